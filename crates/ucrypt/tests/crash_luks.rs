//! Power cuts during LUKS2 header updates: each update's write plan runs through
//! `luks::apply` on a `CrashBackend`, and the power goes at every step of it (before each
//! write and sync, and after the last), with seeded choices of which unsynced writes landed,
//! whole or torn at the device's atomic unit (512 bytes and 4 KiB). Then the header is read
//! from what the device kept: it must parse, be the old or the new version (by seqid), and
//! open with exactly the passphrases that version has.
//!
//! Updates: add a keyslot, remove one, change a passphrase, change the label and flags, and
//! repair a header whose primary or secondary copy is damaged (plus a keyslot added to a header
//! with a damaged secondary: the update must rewrite the damaged copy first, or a torn write of
//! the only valid copy would leave none).

use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::luks::luks2::{format, FormatLuks2, Luks2Header};
use ucrypt::luks::{self, HashAlg, Header, KdfRequest, NewKeyslot, Unlock, WriteOp};
use ucrypt::SecretBytes;

const DATA_OFFSET: u64 = 1 << 20;
const HDR_SIZE: u64 = 0x4000;
const DEVICE_BYTES: u64 = DATA_OFFSET + 4096;
/// Seeded power cuts at each step of a plan, unless `UCRYPT_CRASH_CUTS_PER_STEP` says (the
/// long mode recorded in BENCHMARKS.md).
const CUTS_PER_STEP: u64 = 12;

fn cuts_per_step() -> u64 {
    let n = std::env::var("UCRYPT_CRASH_CUTS_PER_STEP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CUTS_PER_STEP);
    eprintln!("{n} power cuts per step (UCRYPT_CRASH_CUTS_PER_STEP)");
    n
}
const UNITS: [u64; 2] = [512, 4096];
const LABEL: &str = "after-the-update";

fn fast_kdf() -> KdfRequest {
    KdfRequest {
        kind: "pbkdf2".into(),
        hash: HashAlg::Sha256,
        iter_time_ms: 1,
        memory_kib: 32,
        parallel: 1,
        force_iterations: Some(1000),
    }
}

/// A LUKS2 image with keyslots 0 ("pass0") and 1 ("pass1"), and its volume key.
fn base_image() -> (Vec<u8>, Vec<u8>) {
    let mut o = FormatLuks2::defaults("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0".into());
    o.kdf = fast_kdf();
    o.data_offset = DATA_OFFSET;
    o.hdr_size = HDR_SIZE;
    o.keyslots_size = DATA_OFFSET - 2 * HDR_SIZE;
    let vk: Vec<u8> = (0..64u8).collect();
    let (mut hdr, key) = format(&o, SecretBytes::from_slice(&vk)).expect("format");
    let dev = CrashBackend::new(DEVICE_BYTES, 512).expect("device");
    for pass in [&b"pass0"[..], b"pass1"] {
        let (_, ops) = hdr
            .add_keyslot(
                NewKeyslot {
                    vk: &key,
                    passphrase: pass,
                    kdf: &fast_kdf(),
                    slot: None,
                },
                None,
            )
            .expect("add a keyslot");
        luks::apply(&dev, &ops).expect("apply");
    }
    (dev.crash_image(0), vk)
}

/// Spoils one byte of a header copy's JSON area: its checksum no longer matches.
fn damage(img: &mut [u8], secondary: bool) {
    let at = if secondary { HDR_SIZE } else { 0 } + 4096 + 100;
    img[at as usize] ^= 0x5a;
}

fn luks2(dev: &dyn Backend) -> Result<Luks2Header, String> {
    match luks::read_header(dev) {
        Ok(Header::Luks2(h)) => Ok(h),
        Ok(_) => Err("LUKS1?".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn opens(dev: &dyn Backend, h: &Luks2Header, pass: &[u8]) -> bool {
    let hdr = Header::Luks2(h.clone());
    match luks::unlock_key(
        dev,
        &hdr,
        Unlock::Passphrase(SecretBytes::from_slice(pass)),
        None,
    ) {
        Ok(_) => true,
        Err(ucrypt::Error::WrongPassphrase) => false,
        Err(e) => panic!("unlock failed otherwise: {e}"),
    }
}

#[derive(Clone, Copy, Debug)]
enum Update {
    Add,
    Remove,
    Change,
    Config,
    RepairPrimary,
    RepairSecondary,
    AddWithDamagedSecondary,
}

const UPDATES: [Update; 7] = [
    Update::Add,
    Update::Remove,
    Update::Change,
    Update::Config,
    Update::RepairPrimary,
    Update::RepairSecondary,
    Update::AddWithDamagedSecondary,
];

/// The image an update starts from, and its plan.
fn plan(update: Update, base: &[u8], vk: &[u8]) -> (Vec<u8>, Vec<WriteOp>) {
    let mut img = base.to_vec();
    match update {
        Update::RepairPrimary => damage(&mut img, false),
        Update::RepairSecondary | Update::AddWithDamagedSecondary => damage(&mut img, true),
        _ => {}
    }
    let dev = CrashBackend::from_image(img.clone(), 512);
    let mut h = luks2(&dev).expect("the update's starting header");
    let key = h
        .verify_key(None, SecretBytes::from_slice(vk))
        .expect("volume key");
    let add = |h: &mut Luks2Header| {
        h.add_keyslot(
            NewKeyslot {
                vk: &key,
                passphrase: b"pass2",
                kdf: &fast_kdf(),
                slot: None,
            },
            None,
        )
        .expect("add")
        .1
    };
    let ops = match update {
        Update::Add | Update::AddWithDamagedSecondary => add(&mut h),
        Update::Remove => h.remove_keyslot(0).expect("remove"),
        Update::Change => {
            h.change_keyslot(0, &key, b"pass9", &fast_kdf(), None)
                .expect("change")
                .1
        }
        Update::Config => {
            h.set_label(LABEL).expect("label");
            h.set_persistent_flags(&["allow-discards"]).expect("flags");
            h.commit().expect("commit")
        }
        Update::RepairPrimary | Update::RepairSecondary => h.repair_plan().expect("repair"),
    };
    (img, ops)
}

/// Checks what a power cut left: a header of the old or the new version that opens with
/// exactly that version's passphrases.
fn check(update: Update, dev: &dyn Backend, old_seqid: u64, row: &str) {
    let h = luks2(dev).unwrap_or_else(|e| panic!("{row}: no valid header is left: {e}"));
    let new = match h.bin().seqid {
        s if s == old_seqid => false,
        s if s == old_seqid + 1 => true,
        s => panic!("{row}: seqid {s}, neither the old {old_seqid} nor the new"),
    };
    let mut want: Vec<(&[u8], bool)> = vec![(b"pass1", true)];
    match update {
        Update::Add | Update::AddWithDamagedSecondary => {
            want.extend([(&b"pass0"[..], true), (b"pass2", new)])
        }
        Update::Remove => want.push((b"pass0", !new)),
        Update::Change => want.extend([(&b"pass0"[..], !new), (b"pass9", new)]),
        Update::Config => {
            want.push((b"pass0", true));
            assert_eq!(
                h.bin().label == LABEL,
                new,
                "{row}: label of the other version"
            );
            assert_eq!(
                h.flags() == ["allow-discards"],
                new,
                "{row}: flags of the other version"
            );
        }
        Update::RepairPrimary | Update::RepairSecondary => want.push((b"pass0", true)),
    }
    for (pass, ok) in want {
        assert_eq!(
            opens(dev, &h, pass),
            ok,
            "{row} ({} version): passphrase {}",
            if new { "new" } else { "old" },
            String::from_utf8_lossy(pass)
        );
    }
}

#[test]
fn power_cuts_during_header_updates_leave_the_old_or_the_new_header() {
    let per_step = cuts_per_step();
    let (base, vk) = base_image();
    let t0 = std::time::Instant::now();
    let mut cuts = 0u64;
    for update in UPDATES {
        let (start, ops) = plan(update, &base, &vk);
        let old_seqid = luks2(&CrashBackend::from_image(start.clone(), 512))
            .expect("start")
            .bin()
            .seqid;
        for unit in UNITS {
            // The power goes just before op `step` would complete (mid-write when it is one),
            // or after the whole plan (`step == ops.len()`).
            for step in 0..=ops.len() {
                let dev = CrashBackend::from_image(start.clone(), unit);
                luks::apply(&dev, &ops[..step]).expect("apply");
                if let Some(op @ WriteOp::Write { .. }) = ops.get(step) {
                    luks::apply(&dev, std::slice::from_ref(op)).expect("apply");
                }
                for seed in 0..per_step {
                    let img = dev.crash_image(seed.wrapping_mul(0x9E37_79B9) ^ step as u64);
                    let row = format!(
                        "{update:?}, {unit}-byte units: power cut at step {step} of {:?} \
                         (seed {seed})",
                        ops
                    );
                    check(
                        update,
                        &CrashBackend::from_image(img, unit),
                        old_seqid,
                        &row,
                    );
                    cuts += 1;
                }
            }
        }
    }
    eprintln!(
        "{cuts} power cuts in {} header updates in {:.1} s",
        UPDATES.len(),
        t0.elapsed().as_secs_f64()
    );
}

/// LUKS1 has one header and no sequence number, so a power cut's "version" is per keyslot:
/// the header must still parse, the keyslot no update touches must open, and each changed
/// passphrase opens or not. Keyslot 6's entry straddles the first 512-byte unit of the header,
/// so adding it there can tear the entry on 512-byte units.
#[test]
fn power_cuts_during_luks1_keyslot_updates_keep_the_header_and_other_keyslots() {
    let vk: Vec<u8> = (100..132u8).collect();
    let (mut h, key) = ucrypt::luks::luks1::format(
        "aes-xts-plain64".parse().expect("spec"),
        HashAlg::Sha256,
        "11111111-2222-4333-8444-555555555555".into(),
        SecretBytes::from_slice(&vk),
        &fast_kdf(),
        None,
    )
    .expect("format");
    let size = u64::from(h.payload_offset) * 512 + 4096;
    let dev = CrashBackend::new(size, 512).expect("device");
    let phdr = h.encode().expect("encode");
    luks::apply(
        &dev,
        &[
            WriteOp::Write {
                offset: 0,
                data: phdr,
            },
            WriteOp::Sync,
        ],
    )
    .expect("apply");
    for pass in [&b"pass0"[..], b"pass1"] {
        let (_, ops) = h
            .add_keyslot(NewKeyslot {
                vk: &key,
                passphrase: pass,
                kdf: &fast_kdf(),
                slot: None,
            })
            .expect("add");
        luks::apply(&dev, &ops).expect("apply");
    }
    let base = dev.crash_image(0);
    let per_step = cuts_per_step();
    let mut cuts = 0;
    // (update, passphrase it adds or removes)
    for (what, changed) in [
        ("add 2", "pass2"),
        ("add 6", "pass2"),
        ("remove 0", "pass0"),
    ] {
        let mut hdr = luks::read_header(&CrashBackend::from_image(base.clone(), 512)).expect("hdr");
        let ops = match what {
            "remove 0" => hdr.remove_keyslot(0).expect("remove"),
            _ => {
                let slot = if what == "add 6" { 6 } else { 2 };
                hdr.add_keyslot(NewKeyslot {
                    vk: &key,
                    passphrase: b"pass2",
                    kdf: &fast_kdf(),
                    slot: Some(slot),
                })
                .expect("add")
                .1
            }
        };
        for unit in UNITS {
            for step in 0..=ops.len() {
                let d = CrashBackend::from_image(base.clone(), unit);
                luks::apply(&d, &ops[..step]).expect("apply");
                if let Some(op @ WriteOp::Write { .. }) = ops.get(step) {
                    luks::apply(&d, std::slice::from_ref(op)).expect("apply");
                }
                for seed in 0..per_step {
                    let img = d.crash_image(seed.wrapping_mul(0x9E37_79B9) ^ step as u64);
                    let after = CrashBackend::from_image(img, unit);
                    let row = format!("LUKS1 {what}, {unit}-byte units, step {step}, seed {seed}");
                    let h = luks::read_header(&after)
                        .unwrap_or_else(|e| panic!("{row}: the header no longer parses: {e}"));
                    let opens = |p: &[u8]| {
                        luks::unlock_key(
                            &after,
                            &h,
                            Unlock::Passphrase(SecretBytes::from_slice(p)),
                            None,
                        )
                        .is_ok()
                    };
                    assert!(
                        opens(b"pass1"),
                        "{row}: the untouched keyslot no longer opens"
                    );
                    if changed != "pass0" {
                        assert!(
                            opens(b"pass0"),
                            "{row}: the untouched keyslot 0 no longer opens"
                        );
                    }
                    // The changed passphrase may open or not; after the whole plan it must have
                    // changed.
                    if step == ops.len() {
                        assert_eq!(opens(changed.as_bytes()), changed == "pass2", "{row}");
                    }
                    cuts += 1;
                }
            }
        }
    }
    eprintln!("{cuts} power cuts in 3 LUKS1 keyslot updates");
}
