//! LUKS2 with authenticated sectors (dm-crypt over dm-integrity, direct mode) between the
//! kernel and ucrypt's [`ucrypt::integrity`], in two boots of a stock Debian kernel (tests/vm/):
//!
//! 1. In the VM, cryptsetup 2.6 formats each case (`--integrity-no-wipe`) and, opened with
//!    `--integrity-no-journal`, the kernel writes a seeded plaintext at the start and across
//!    the end of the first 16 MiB interleave area.
//! 2. On the host, ucrypt opens each image: it reads the kernel's data byte for byte, reports
//!    never-written blocks as integrity errors (EILSEQ), then writes (aligned, unaligned and
//!    across areas) and reads its own data back. On an in-memory copy of each image: a flipped
//!    ciphertext bit, a flipped tag bit, two swapped blocks and old data under a new tag each
//!    fail with the integrity error on exactly the blocks touched; old data with its old tag
//!    (a replay) verifies, as in the kernel: the format has no freshness.
//! 3. In the VM, the kernel reads ucrypt's writes byte for byte, and refuses (EIO from
//!    dm-crypt) a block ucrypt wrote and the test then damaged.
//!
//! Cases: aes-xts-random + hmac-sha256 with 512- and 4096-byte sectors, aes-xts-random +
//! hmac-sha512 (4096), aes-gcm-random + aead (512, 4096), chacha20-random + poly1305 (512,
//! 4096); and from cryptsetup's luks2-integrity-test, some formatted as it does with
//! `--integrity-legacy-padding --offset 8192`: aes-xts-plain64 + hmac-sha1 (4096, legacy),
//! aes-cbc-essiv:sha256 + hmac-sha256 (128-bit key, 512, legacy), aes-xts-essiv:sha256 +
//! hmac-sha512 (4096), aes-xts-random + hmac-sha1 (256-bit key, 4096), aes-ccm-random + aead
//! (152-bit key 512 legacy, 280-bit key 4096), chacha20-plain64 + poly1305 (512, legacy),
//! aegis128-random + aead (512 legacy, 4096); and the 17 other lines of that test's matrix
//! (`intformat`), legacy-formatted as it does, so that each of its 32 lines runs.
//! `UCRYPT_INTEGRITY_CASES=chacha,gcm-512` runs only the cases whose names contain one of
//! the words (the guest's crypto is emulated, so each case costs minutes).
//! Needs qemu-system-x86_64 and a kernel (tests/vm/install-deps.sh): SKIPPED otherwise, unless
//! CI is set.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use ucrypt::backend::{Backend, DirectMode, FileBackend, MemBackend};
use ucrypt::format::IntegrityKind;
use ucrypt::integrity::{open_luks2_mode, IntegrityVolume, TagMode, WriteMode};
use ucrypt::luks::{read_header, unlock_key, Unlock};
use ucrypt::{BlockDev, Error, ErrorKind, SecretBytes};

struct Case {
    name: &'static str,
    cipher: &'static str,
    integrity: &'static str,
    key_bits: u32,
    sector: u64,
    /// More `luksFormat` options: cryptsetup's luks2-integrity-test formats with
    /// `--integrity-legacy-padding --offset 8192`.
    extra: &'static str,
}

/// luks2-integrity-test's format options.
const LEGACY: &str = "--integrity-legacy-padding --offset 8192";

impl Case {
    /// The mode as ucrypt parses it from the header cryptsetup writes.
    fn mode(&self) -> TagMode {
        let kind = IntegrityKind::from_name(self.integrity).expect("integrity type");
        let key_bytes = self.key_bits as usize / 8 + kind.mac_key_bytes();
        TagMode::from_luks2(self.cipher, kind.luks2_name(), key_bytes).expect("mode")
    }
}

const CASES: &[Case] = &[
    Case {
        name: "xts-hmac256-512",
        cipher: "aes-xts-random",
        integrity: "hmac-sha256",
        key_bits: 512,
        sector: 512,
        extra: "",
    },
    Case {
        name: "xts-hmac256-4096",
        cipher: "aes-xts-random",
        integrity: "hmac-sha256",
        key_bits: 512,
        sector: 4096,
        extra: "",
    },
    Case {
        name: "xts-hmac512-4096",
        cipher: "aes-xts-random",
        integrity: "hmac-sha512",
        key_bits: 512,
        sector: 4096,
        extra: "",
    },
    Case {
        name: "gcm-512",
        cipher: "aes-gcm-random",
        integrity: "aead",
        key_bits: 256,
        sector: 512,
        extra: "",
    },
    Case {
        name: "gcm-4096",
        cipher: "aes-gcm-random",
        integrity: "aead",
        key_bits: 256,
        sector: 4096,
        extra: "",
    },
    Case {
        name: "chacha-512",
        cipher: "chacha20-random",
        integrity: "poly1305",
        key_bits: 256,
        sector: 512,
        extra: "",
    },
    Case {
        name: "chacha-4096",
        cipher: "chacha20-random",
        integrity: "poly1305",
        key_bits: 256,
        sector: 4096,
        extra: "",
    },
    Case {
        name: "xts-plain64-sha1-4096",
        cipher: "aes-xts-plain64",
        integrity: "hmac-sha1",
        key_bits: 512,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "cbc-essiv-sha256-512",
        cipher: "aes-cbc-essiv:sha256",
        integrity: "hmac-sha256",
        key_bits: 128,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "xts-essiv-sha512-4096",
        cipher: "aes-xts-essiv:sha256",
        integrity: "hmac-sha512",
        key_bits: 512,
        sector: 4096,
        extra: "",
    },
    Case {
        name: "xts-random-sha1-aes128-4096",
        cipher: "aes-xts-random",
        integrity: "hmac-sha1",
        key_bits: 256,
        sector: 4096,
        extra: "",
    },
    Case {
        name: "ccm-512",
        cipher: "aes-ccm-random",
        integrity: "aead",
        key_bits: 152,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "ccm-4096",
        cipher: "aes-ccm-random",
        integrity: "aead",
        key_bits: 280,
        sector: 4096,
        extra: "",
    },
    Case {
        name: "chacha-plain64-512",
        cipher: "chacha20-plain64",
        integrity: "poly1305",
        key_bits: 256,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "aegis128-512",
        cipher: "aegis128-random",
        integrity: "aead",
        key_bits: 128,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "aegis128-4096",
        cipher: "aegis128-random",
        integrity: "aead",
        key_bits: 128,
        sector: 4096,
        extra: "",
    },
    // The rest of luks2-integrity-test's `intformat` lines, formatted as it formats them:
    // with the cases above, each of its 32 lines runs.
    Case {
        name: "xts-plain64-h256-k256-512",
        cipher: "aes-xts-plain64",
        integrity: "hmac-sha256",
        key_bits: 256,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "xts-random-h256-k256-512",
        cipher: "aes-xts-random",
        integrity: "hmac-sha256",
        key_bits: 256,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "cbc-essiv-h256-k256-512",
        cipher: "aes-cbc-essiv:sha256",
        integrity: "hmac-sha256",
        key_bits: 256,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "xts-plain64-h256-k512-512",
        cipher: "aes-xts-plain64",
        integrity: "hmac-sha256",
        key_bits: 512,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "cbc-essiv-h256-k128-4096",
        cipher: "aes-cbc-essiv:sha256",
        integrity: "hmac-sha256",
        key_bits: 128,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "xts-plain64-h256-k256-4096",
        cipher: "aes-xts-plain64",
        integrity: "hmac-sha256",
        key_bits: 256,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "xts-random-h256-k256-4096",
        cipher: "aes-xts-random",
        integrity: "hmac-sha256",
        key_bits: 256,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "cbc-essiv-h256-k256-4096",
        cipher: "aes-cbc-essiv:sha256",
        integrity: "hmac-sha256",
        key_bits: 256,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "xts-plain64-h256-k512-4096",
        cipher: "aes-xts-plain64",
        integrity: "hmac-sha256",
        key_bits: 512,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "cbc-essiv-h512-k256-4096",
        cipher: "aes-cbc-essiv:sha256",
        integrity: "hmac-sha512",
        key_bits: 256,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "xts-plain64-h512-k512-4096",
        cipher: "aes-xts-plain64",
        integrity: "hmac-sha512",
        key_bits: 512,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "xts-random-h1-k512-4096",
        cipher: "aes-xts-random",
        integrity: "hmac-sha1",
        key_bits: 512,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "gcm-k128-512",
        cipher: "aes-gcm-random",
        integrity: "aead",
        key_bits: 128,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "gcm-k128-4096",
        cipher: "aes-gcm-random",
        integrity: "aead",
        key_bits: 128,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "ccm-k152-4096",
        cipher: "aes-ccm-random",
        integrity: "aead",
        key_bits: 152,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "ccm-k280-512",
        cipher: "aes-ccm-random",
        integrity: "aead",
        key_bits: 280,
        sector: 512,
        extra: LEGACY,
    },
    Case {
        name: "chacha-plain64-4096",
        cipher: "chacha20-plain64",
        integrity: "poly1305",
        key_bits: 256,
        sector: 4096,
        extra: LEGACY,
    },
];

/// The cases selected by `UCRYPT_INTEGRITY_CASES` (all when unset).
fn selected_cases() -> Vec<&'static Case> {
    let filter = std::env::var("UCRYPT_INTEGRITY_CASES").unwrap_or_default();
    let words: Vec<&str> = filter.split(',').filter(|w| !w.is_empty()).collect();
    CASES
        .iter()
        .filter(|c| words.is_empty() || words.iter().any(|w| c.name.contains(w)))
        .collect()
}

/// Each image: 16 MiB of LUKS2 header, then dm-integrity (two interleave areas).
const IMAGE_BYTES: u64 = 48 << 20;
const MIB: u64 = 1 << 20;
/// What the kernel writes first: 1 MiB at 0 and 2 MiB across the first area's end (16 MiB of
/// data sectors), both from plain.bin().
const K1: (u64, u64) = (0, MIB);
const K2: (u64, u64) = (15 * MIB + MIB / 2, 2 * MIB);
/// What ucrypt writes: a fresh MiB, then an unaligned patch inside it.
const U1: (u64, u64) = (4 * MIB, MIB);
const U_PATCH: (u64, u64) = (4 * MIB + 12_345, 10_000);
/// ucrypt overwrites the first 64 KiB the kernel wrote, and 128 KiB across the area boundary.
const U_OVER_A: (u64, u64) = (0, 64 << 10);
const U_OVER_B: (u64, u64) = (16 * MIB - (64 << 10), 128 << 10);
/// A region ucrypt writes whose third 4 KiB block the test damages before the kernel reads.
const DAMAGE_REGION: (u64, u64) = (6 * MIB, 64 << 10);
const DAMAGE_AT: u64 = DAMAGE_REGION.0 + 8192 + 100;
/// The plaintext ranges compared after ucrypt's writes, in this order.
const COMPARED: [(u64, u64); 3] = [K1, K2, U1];

fn open_file(img: &Path, key: &[u8], writable: bool) -> IntegrityVolume {
    let be: Arc<dyn Backend> =
        Arc::new(FileBackend::open(img, writable, DirectMode::Never).expect("open image"));
    open_backend(be, key, writable)
}

fn open_backend(be: Arc<dyn Backend>, key: &[u8], writable: bool) -> IntegrityVolume {
    let hdr = read_header(be.as_ref()).expect("LUKS2 header");
    let (_, vk) = unlock_key(
        be.as_ref(),
        &hdr,
        Unlock::Passphrase(SecretBytes::from_slice(key)),
        None,
    )
    .expect("unlock");
    // Direct mode, as the kernel's side of this test (`--integrity-no-journal`); the journal
    // has its own test (kernel_integrity_journal).
    open_luks2_mode(be, &hdr, &vk, !writable, WriteMode::Direct).expect("open integrity volume")
}

fn read(v: &IntegrityVolume, (off, len): (u64, u64)) -> ucrypt::Result<Vec<u8>> {
    let mut b = vec![0u8; len as usize];
    v.read_at(&mut b, off).map(|()| b)
}

fn expect_integrity_error(r: ucrypt::Result<Vec<u8>>, what: &str) -> u64 {
    match r {
        Err(e @ Error::Integrity { sector }) => {
            assert_eq!(e.kind(), ErrorKind::BadData, "{what}");
            assert_eq!(e.errno(), libc::EILSEQ, "{what}");
            sector
        }
        Err(e) => panic!("{what}: expected an integrity error, got {e}"),
        Ok(_) => panic!("{what}: read succeeded, expected an integrity error"),
    }
}

/// Tampering on an in-memory copy of a volume ucrypt and the kernel wrote.
fn tamper_checks(case: &Case, img: &Path, key: &[u8], model: &[u8]) {
    let bytes = std::fs::read(img).expect("read image");
    let mem = Arc::new(MemBackend::new(bytes.len() as u64));
    mem.write_at(&bytes, 0).expect("copy image");
    let v = open_backend(mem.clone(), key, true);
    let bb = case.sector;
    let spb = bb / 512;
    // Blocks inside the kernel's second region, away from its edges.
    let block = |k: u64| K2.0 / 512 + k * spb;
    let flip = |at: u64| {
        let mut b = [0u8; 1];
        mem.read_at(&mut b, at).expect("read byte");
        b[0] ^= 0x10;
        mem.write_at(&b, at).expect("write byte");
    };
    let read_block = |sector: u64| read(&v, (sector * 512, bb));
    let good = |sector: u64, what: &str| {
        let got = read_block(sector).unwrap_or_else(|e| panic!("{}: {what}: {e}", case.name));
        let at = (sector * 512) as usize;
        assert!(
            got == model[at..at + bb as usize],
            "{}: {what}: wrong data",
            case.name
        );
    };
    // 1. A flipped ciphertext bit: that block fails, its neighbours read fine.
    let (d, _) = v.locate(block(2)).expect("locate");
    flip(d + 5);
    let bad = expect_integrity_error(read_block(block(2)), "flipped data bit");
    assert_eq!(bad, block(2), "{}: the error names the block", case.name);
    good(block(1), "left of a flipped data bit");
    good(block(3), "right of a flipped data bit");
    // A larger read covering it fails too, and the volume stays usable.
    expect_integrity_error(read(&v, (block(0) * 512, 8 * bb)), "read over a bad block");
    good(block(4), "after a failed read");
    // 2. A flipped tag bit (auth tag, then the stored IV where the mode stores one).
    let mode = case.mode();
    let (_, t) = v.locate(block(5)).expect("locate");
    flip(t + 1);
    expect_integrity_error(read_block(block(5)), "flipped auth-tag bit");
    let mut errors = 6;
    if mode.iv_bytes() > 0 {
        let (_, t) = v.locate(block(7)).expect("locate");
        flip(t + mode.auth_bytes() as u64);
        expect_integrity_error(read_block(block(7)), "flipped IV bit");
        errors += 1;
    }
    good(block(6), "between damaged tags");
    // 3. Two blocks swapped with their tags: both fail (the sector number is authenticated).
    let tb = mode.tuple_bytes() as u64;
    let swap = |a: u64, b: u64| {
        let (da, ta) = v.locate(a).expect("locate");
        let (db, tbb) = v.locate(b).expect("locate");
        for (x, y, n) in [(da, db, bb), (ta, tbb, tb)] {
            let (mut bx, mut by) = (vec![0u8; n as usize], vec![0u8; n as usize]);
            mem.read_at(&mut bx, x).expect("read");
            mem.read_at(&mut by, y).expect("read");
            mem.write_at(&by, x).expect("write");
            mem.write_at(&bx, y).expect("write");
        }
    };
    swap(block(10), block(12));
    expect_integrity_error(read_block(block(10)), "swapped block (a)");
    expect_integrity_error(read_block(block(12)), "swapped block (b)");
    good(block(11), "between swapped blocks");
    // 4. Old data under the new tag fails; old data with its own old tag (a replay) verifies:
    //    dm-crypt's tags bind data, IV and place, not a version (the kernel accepts it too).
    let (d, t) = v.locate(block(20)).expect("locate");
    let (mut old_d, mut old_t) = (vec![0u8; bb as usize], vec![0u8; tb as usize]);
    mem.read_at(&mut old_d, d).expect("read");
    mem.read_at(&mut old_t, t).expect("read");
    let old_plain = read_block(block(20)).expect("old block");
    let new_plain = vec![0xa5u8; bb as usize];
    v.write_at(&new_plain, block(20) * 512).expect("new write");
    assert_eq!(read_block(block(20)).expect("new block"), new_plain);
    mem.write_at(&old_d, d).expect("old data back");
    expect_integrity_error(read_block(block(20)), "old data under a new tag");
    mem.write_at(&old_t, t).expect("old tag back");
    assert_eq!(
        read_block(block(20)).expect("replayed block"),
        old_plain,
        "{}: a replay of data and tag reads the old data",
        case.name
    );
    // data bit, the larger read, auth tag, (IV,) two swapped, old data under a new tag
    assert_eq!(
        v.integrity_errors(),
        errors,
        "{}: errors counted",
        case.name
    );
}

/// Cases one pair of boots takes: each is a virtio disk, and the VM's PCI bus has room for
/// about 28 (and the guest's device names `vda`..`vdz` for 26).
const CASES_PER_BOOT: usize = 17;

#[test]
fn luks2_integrity_between_kernel_and_ucrypt() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let cases = selected_cases();
    assert!(!cases.is_empty(), "UCRYPT_INTEGRITY_CASES selects no case");
    let seed = kit::seed();
    let mut rng = kit::SplitMix(seed);
    for batch in cases.chunks(CASES_PER_BOOT) {
        between_kernel_and_ucrypt(batch, seed, &mut rng);
    }
}

/// The cases of one pair of boots (module documentation).
fn between_kernel_and_ucrypt(cases: &[&Case], seed: u64, rng: &mut kit::SplitMix) {
    let tmp = kit::TempDir::new("kernel-integrity");
    let dir = &tmp.0;
    let key_path = dir.join("key");
    let key = vm::random_file(rng, &key_path, 32);
    let plain = vm::random_file(rng, &dir.join("plain.bin"), (K1.1 + K2.1) as usize);

    // ---- boot 1: cryptsetup formats, the kernel writes ----
    let mut run = vm::VmRun::new("");
    run.share = Some(dir.clone());
    let mut script = String::from("set -u\nK=/mnt/host/key\nP=/mnt/host/plain.bin\n");
    let mut imgs = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let img = dir.join(format!("{}.img", c.name));
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(IMAGE_BYTES))
            .expect("image");
        run.disk(&img, false);
        let dev = format!("/dev/vd{}", (b'a' + i as u8) as char);
        let (k1, k2) = (K1.1 / 65536, (K2.0 / 65536, K2.1 / 65536));
        writeln!(
            script,
            "cryptsetup luksFormat --type luks2 --cipher {} --integrity {} --key-size {} \
             --sector-size {} {} --integrity-no-wipe --pbkdf pbkdf2 --pbkdf-force-iterations 1000 \
             --batch-mode --key-file $K {dev} && \
             cryptsetup open --integrity-no-journal --key-file $K {dev} x{i} && \
             dd if=$P of=/dev/mapper/x{i} bs=65536 count={k1} conv=fsync 2>/dev/null && \
             dd if=$P of=/dev/mapper/x{i} bs=65536 skip={k1} seek={} count={} conv=fsync 2>/dev/null && \
             echo \"CASE {} KERNEL-WROTE\" || echo \"CASE {} KERNEL-WRITE-FAIL\"\n\
             cryptsetup close x{i}",
            c.cipher,
            c.integrity,
            c.key_bits,
            c.sector,
            c.extra,
            k2.0,
            k2.1,
            c.name,
            c.name
        )
        .expect("script");
        imgs.push(img);
    }
    run.script = script;
    let out = run.run(dir);
    assert_eq!(out.status, 0, "seed {seed}: VM boot 1 failed");

    // ---- host: ucrypt reads the kernel's writes, writes its own ----
    let mut failures = Vec::new();
    let mut done = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        if !out
            .output
            .contains(&format!("CASE {} KERNEL-WROTE", c.name))
        {
            failures.push(format!("{}: the kernel did not format and write", c.name));
            continue;
        }
        let v = open_file(&imgs[i], &key, true);
        assert_eq!(v.block_size() as u64, c.sector, "{}", c.name);
        // A plaintext model of the first 18 MiB.
        let mut model = vec![0u8; 18 * MIB as usize];
        model[..K1.1 as usize].copy_from_slice(&plain[..K1.1 as usize]);
        model[K2.0 as usize..(K2.0 + K2.1) as usize].copy_from_slice(&plain[K1.1 as usize..]);
        for r in [K1, K2] {
            let got = read(&v, r).unwrap_or_else(|e| panic!("{}: read {r:?}: {e}", c.name));
            assert!(
                got == model[r.0 as usize..(r.0 + r.1) as usize],
                "seed {seed}: {}: ucrypt read of the kernel's data at {r:?} differs",
                c.name
            );
        }
        println!("CASE {} ucrypt reads the kernel's writes OK", c.name);
        // Never written (--integrity-no-wipe): the tags are garbage.
        expect_integrity_error(read(&v, (10 * MIB, 4096)), "never-written block");
        let mut write = |v: &IntegrityVolume, (off, len): (u64, u64), rng: &mut kit::SplitMix| {
            let mut b = vec![0u8; len as usize];
            rng.fill(&mut b);
            v.write_at(&b, off)
                .unwrap_or_else(|e| panic!("{}: write {off}+{len}: {e}", c.name));
            model[off as usize..(off + len) as usize].copy_from_slice(&b);
        };
        for r in [U1, U_PATCH, U_OVER_A, U_OVER_B, DAMAGE_REGION] {
            write(&v, r, rng);
        }
        // An unaligned read across both areas, then the compared ranges.
        let r = (K2.0 + 777, MIB + 3);
        let got = read(&v, r).expect("unaligned read");
        assert!(
            got == model[r.0 as usize..(r.0 + r.1) as usize],
            "{}: unaligned read",
            c.name
        );
        let mut expect = Vec::new();
        for r in COMPARED {
            let got = read(&v, r).expect("read back");
            let want = &model[r.0 as usize..(r.0 + r.1) as usize];
            assert!(
                got == want,
                "seed {seed}: {}: ucrypt read-back of {r:?}",
                c.name
            );
            expect.extend_from_slice(want);
        }
        v.flush().expect("flush");
        drop(v);
        std::fs::write(dir.join(format!("expect{i}.bin")), &expect).expect("expect file");
        tamper_checks(c, &imgs[i], &key, &model);
        println!("CASE {} tamper checks OK", c.name);
        // Damage one block ucrypt wrote, for the kernel to refuse.
        let v = open_file(&imgs[i], &key, false);
        let (d, _) = v.locate(DAMAGE_AT / 512).expect("locate");
        drop(v);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&imgs[i])
            .expect("img");
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, d + DAMAGE_AT % 512).expect("read");
        b[0] ^= 0x01;
        f.write_all_at(&b, d + DAMAGE_AT % 512).expect("write");
        done.push(i);
    }

    // ---- boot 2: the kernel reads ucrypt's writes ----
    let mut run = vm::VmRun::new("");
    run.share = Some(dir.clone());
    let mut script = String::from("set -u\nK=/mnt/host/key\n");
    for (i, _) in cases.iter().enumerate() {
        run.disk(&imgs[i], false);
    }
    for &i in &done {
        let c = cases[i];
        let dev = format!("/dev/vd{}", (b'a' + i as u8) as char);
        let reads: Vec<String> = COMPARED
            .iter()
            .map(|(o, l)| {
                format!(
                    "dd if=/dev/mapper/y{i} bs=65536 skip={} count={} 2>/dev/null",
                    o / 65536,
                    l / 65536
                )
            })
            .collect();
        let good_blk = DAMAGE_REGION.0 / 4096;
        let bad_blk = DAMAGE_AT / 4096;
        writeln!(
            script,
            "cryptsetup open --readonly --integrity-no-journal --key-file $K {dev} y{i} || echo \"CASE {n} OPEN-FAIL\"\n\
             if {{ {}; }} | cmp - /mnt/host/expect{i}.bin; then echo \"CASE {n} KERNEL-READ-OK\"; else echo \"CASE {n} KERNEL-READ-FAIL\"; fi\n\
             if dd if=/dev/mapper/y{i} of=/dev/null bs=4096 skip={good_blk} count=1 2>/dev/null; then echo \"CASE {n} GOOD-BLOCK-OK\"; fi\n\
             if dd if=/dev/mapper/y{i} of=/dev/null bs=4096 skip={bad_blk} count=1 2>/dev/null; then echo \"CASE {n} DAMAGE-MISSED\"; else echo \"CASE {n} DAMAGE-REFUSED\"; fi\n\
             cryptsetup close y{i}",
            reads.join("; "),
            n = c.name
        )
        .expect("script");
    }
    run.script = script;
    let out2 = run.run(dir);
    assert_eq!(out2.status, 0, "seed {seed}: VM boot 2 failed");
    for &i in &done {
        let n = cases[i].name;
        for want in ["KERNEL-READ-OK", "GOOD-BLOCK-OK", "DAMAGE-REFUSED"] {
            if !out2.output.contains(&format!("CASE {n} {want}")) {
                failures.push(format!("{n}: no {want}"));
            }
        }
    }
    assert_eq!(done.len(), cases.len(), "seed {seed}: {failures:#?}");
    assert!(failures.is_empty(), "seed {seed}: {failures:#?}");
}

/// What the kernel offers beyond ucrypt's modes, pinned so the documentation's claims stay
/// true (one boot): dm-integrity's bitmap mode ('B') under LUKS2 integrity. The same integrity
/// table the kernel activated for a LUKS2 volume (mode 'J') is refused with mode 'B' ("Bitmap
/// mode can be only used with internal hash": dm-crypt makes the tags, dm-integrity has no
/// internal hash), while 'J' and 'D' are accepted; cryptsetup 2.6 has no option for it either.
#[test]
fn bitmap_mode_in_the_kernel() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let tmp = kit::TempDir::new("kernel-integrity-modes");
    let dir = &tmp.0;
    std::fs::write(dir.join("key"), b"integrity modes passphrase").expect("key file");
    let img = dir.join("gcm.img");
    let mut run = vm::VmRun::new(
        "set -u\nK=/mnt/host/key\n\
         F='--type luks2 --sector-size 4096 --integrity-no-wipe --pbkdf pbkdf2 \
         --pbkdf-force-iterations 1000 --batch-mode --key-file /mnt/host/key'\n\
         cryptsetup luksFormat $F --cipher aes-gcm-random --integrity aead /dev/vda && \
         cryptsetup open --key-file $K /dev/vda v && echo OPEN-OK\n\
         T=$(dmsetup table v_dif)\n\
         echo \"TABLE: $T\"\n\
         cryptsetup close v\n\
         for m in J D B; do \
           X=$(echo \"$T\" | awk -v m=$m '$7 == \"J\" { $7 = m; print }'); \
           if [ -n \"$X\" ] && dmsetup create t$m --table \"$X\"; then echo MODE-$m-ACCEPTED; \
           dmsetup remove t$m; else echo MODE-$m-REFUSED; fi; \
         done\n\
         dmesg | grep -o 'Bitmap mode can be only used with internal hash'\n\
         if cryptsetup --help | grep -q bitmap; then echo CRYPTSETUP-HAS-BITMAP; fi\n",
    );
    run.share = Some(dir.clone());
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(IMAGE_BYTES))
        .expect("image");
    run.disk(&img, false);
    let out = run.run(dir);
    assert_eq!(out.status, 0, "VM boot failed");
    let o = &out.output;
    for want in [
        "OPEN-OK",
        "MODE-J-ACCEPTED",
        "MODE-D-ACCEPTED",
        "MODE-B-REFUSED",
        "Bitmap mode can be only used with internal hash",
    ] {
        assert!(o.contains(want), "no {want} in the VM output:\n{o}");
    }
    assert!(
        !o.contains("CRYPTSETUP-HAS-BITMAP"),
        "cryptsetup now offers a bitmap option: revisit docs/integrity.md"
    );
}
