//! A rotation of a volume with several keyslots (`reencrypt::run::init_slots`), as cryptsetup
//! 2.6.1's `reencrypt` does it: a passphrase per active keyslot, each checked against its
//! keyslot (`check_passphrase`); a new keyslot per passphrase for the new key, with the old
//! keyslot's PBKDF copied ([`KeyslotKdf::SameAsOld`]) or the one asked for; tokens follow;
//! every old keyslot gone at finalisation. And the refusals, each before any write: a single
//! passphrase (a key file) for several active keyslots, a keyslot given twice or not of the
//! volume key, too few free keyslots.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::Arc;

use serde_json::json;
use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::luks::kdf::Argon2Variant;
use ucrypt::luks::reencrypt::run::{
    check_free_keyslots, check_passphrase, init_on, init_slots, passphrase_keyslots, resume,
    Devices, InitOptions, KeyslotKdf, ResilienceKind, RunOptions, SegmentChange, SlotPassphrase,
    CHECKSUM_HASH, KEY_FILE_NEEDS_ONE_KEYSLOT, NOT_ENOUGH_KEYSLOTS,
};
use ucrypt::luks::reencrypt::Mode;
use ucrypt::luks::{
    self, HashAlg, Header, Kdf, KdfRequest, NewKeyslot, OpenOptions, Unlock, VolumeKey,
};
use ucrypt::{BlockDev, Error, SecretBytes};

mod common;
use common::{fast_kdf, format_filled};

/// Room for 15 keyslot areas of a 512-bit key (252 KiB each) and the reencryption's.
const DATA_OFFSET: u64 = 4 << 20;
/// Room for 31 keyslot areas (the count of free keyslots fills the header).
const DATA_OFFSET_FULL: u64 = 8 << 20;
const HDR: u64 = 0x4000;
const DATA_BYTES: u64 = 128 << 10;
const PASSES: [&[u8]; 3] = [b"first", b"second one", b"third"];

fn fill() -> Vec<u8> {
    (0..DATA_BYTES).map(|i| (i * 13 + i / 512) as u8).collect()
}

fn luks2(dev: &dyn Backend) -> luks::Luks2Header {
    match luks::read_header(dev).expect("header") {
        Header::Luks2(h) => h,
        Header::Luks1(_) => panic!("LUKS1"),
    }
}

/// Keyslot 1's PBKDF: pbkdf2-sha512 of its own iterations; keyslot 2's: a cheap argon2id.
fn other_kdfs() -> [KdfRequest; 2] {
    let mut sha512 = fast_kdf();
    sha512.hash = HashAlg::Sha512;
    sha512.force_iterations = Some(1234);
    let argon = KdfRequest {
        kind: "argon2id".into(),
        hash: HashAlg::Sha256,
        iter_time_ms: 1,
        memory_kib: 64,
        parallel: 1,
        force_iterations: Some(4),
    };
    [sha512, argon]
}

/// The volume key, from keyslot 0.
fn key(dev: &dyn Backend) -> VolumeKey {
    let hdr = luks::read_header(dev).expect("header");
    let p = Unlock::Passphrase(SecretBytes::from_slice(PASSES[0]));
    luks::unlock_key(dev, &hdr, p, Some(0)).expect("unlock").1
}

/// A filled volume with data at `data_offset`, one keyslot (0) for `PASSES[0]`.
fn volume_at(data_offset: u64) -> Arc<CrashBackend> {
    let dev = Arc::new(CrashBackend::new(data_offset + DATA_BYTES, 512).expect("device"));
    let vk: Vec<u8> = (0..64u8).map(|i| i ^ 0xa5).collect();
    format_filled(
        &(dev.clone() as Arc<dyn Backend>),
        "0e1f2d3c-4b5a-4978-8695-a4b3c2d1e0f1",
        (data_offset, HDR, 4096),
        &vk,
        PASSES[0],
        &fill(),
    );
    dev
}

/// A filled volume with `n` keyslots (0..n), keyslot i opened by `PASSES[i]` (i < 3; more are
/// pbkdf2 copies of `PASSES[0]`), keyslots 1 and 2 with [`other_kdfs`].
fn volume(n: usize) -> Arc<CrashBackend> {
    let dev = volume_at(DATA_OFFSET);
    let key = key(dev.as_ref());
    let kdfs = other_kdfs();
    for i in 1..n {
        let mut h = luks2(dev.as_ref());
        let kdf = kdfs.get(i - 1).cloned().unwrap_or_else(fast_kdf);
        let (slot, ops) = h
            .add_keyslot(
                NewKeyslot {
                    vk: &key,
                    passphrase: PASSES.get(i).copied().unwrap_or(PASSES[0]),
                    kdf: &kdf,
                    slot: None,
                },
                None,
            )
            .expect("keyslot");
        assert_eq!(slot as usize, i);
        luks::apply(dev.as_ref(), &ops).expect("apply");
    }
    dev
}

fn opts(kdf: &KdfRequest, keyslot_kdf: KeyslotKdf) -> InitOptions<'_> {
    InitOptions {
        resilience: ResilienceKind::Checksum,
        kdf,
        key_slot: None,
        change: SegmentChange::default(),
        mode: Mode::Reencrypt,
        keyslot_kdf,
        resilience_hash: CHECKSUM_HASH,
        shift_bytes: None,
    }
}

fn proofs(dev: &dyn Backend, slots: &[(u32, &[u8])]) -> Vec<SlotPassphrase> {
    let hdr = luks::read_header(dev).expect("header");
    slots
        .iter()
        .map(|&(slot, p)| {
            check_passphrase(dev, &hdr, slot, SecretBytes::from_slice(p)).expect("passphrase")
        })
        .collect()
}

fn run(dev: &dyn Backend, pass: &[u8]) {
    resume(
        dev,
        pass,
        RunOptions {
            hotzone_bytes: Some(32 << 10),
            ..Default::default()
        },
        &mut |_| {},
    )
    .expect("resume");
}

fn contents(dev: Arc<CrashBackend>, pass: &[u8]) -> Vec<u8> {
    let vol = luks::open(
        dev,
        Unlock::Passphrase(SecretBytes::from_slice(pass)),
        &OpenOptions::default(),
    )
    .expect("open");
    let mut out = vec![0u8; DATA_BYTES as usize];
    vol.read_at(&mut out, 0).expect("read");
    out
}

/// Opens keyslot `slot` with `pass`: the key's digest id.
fn opens(dev: &dyn Backend, slot: u32, pass: &[u8]) -> ucrypt::Result<u32> {
    let hdr = luks::read_header(dev)?;
    let (_, vk) = luks::unlock_key(
        dev,
        &hdr,
        Unlock::Passphrase(SecretBytes::from_slice(pass)),
        Some(slot),
    )?;
    Ok(vk.digest_id())
}

/// The PBKDF type and costs of a keyslot, without its salt.
fn costs(h: &luks::Luks2Header, slot: u32) -> String {
    match h
        .meta()
        .keyslot_params(&slot.to_string())
        .expect("keyslot")
        .kdf
    {
        Kdf::Pbkdf2 {
            hash, iterations, ..
        } => format!("pbkdf2 {} {iterations}", hash.name()),
        Kdf::Argon2 { variant, cost, .. } => format!(
            "{} {} {} {}",
            match variant {
                Argon2Variant::I => "argon2i",
                Argon2Variant::Id => "argon2id",
            },
            cost.time,
            cost.memory_kib,
            cost.cpus
        ),
    }
}

#[test]
fn active_keyslots_are_the_bound_ones() {
    let dev = volume(3);
    let hdr = luks::read_header(dev.as_ref()).unwrap();
    assert_eq!(passphrase_keyslots(&hdr), vec![0, 1, 2]);
    // A keyslot of a digest of no segment (cryptsetup's "unbound") is not asked for.
    let mut h = luks2(dev.as_ref());
    let (slot, ops) = h
        .add_unbound_keyslot(
            SecretBytes::from_slice(&[7; 9]),
            b"unbound",
            &fast_kdf(),
            None,
            None,
        )
        .unwrap();
    assert_eq!(slot, 3);
    luks::apply(dev.as_ref(), &ops).unwrap();
    assert_eq!(
        passphrase_keyslots(&Header::Luks2(luks2(dev.as_ref()))),
        vec![0, 1, 2]
    );
}

/// Three keyslots of three PBKDFs, one passphrase each: three new keyslots (3, 4, 5) for the
/// new key, each with its old keyslot's PBKDF; a token of keyslot 1 also names keyslot 4;
/// finalisation leaves exactly those three, each opened by its passphrase, the data intact.
#[test]
fn each_keyslot_gets_a_twin_with_its_pbkdf() {
    let dev = volume(3);
    // A token assigned to keyslot 1, as `cryptsetup token import --key-slot 1` makes it.
    let mut h = luks2(dev.as_ref());
    let token = json!({"type": "ucrypt-test", "keyslots": ["1"]});
    h.import_token(Some(0), token.as_object().unwrap().clone(), false)
        .unwrap();
    let ops = h.commit().unwrap();
    luks::apply(dev.as_ref(), &ops).unwrap();
    let before = luks2(dev.as_ref());
    let old_costs: Vec<String> = (0..3).map(|s| costs(&before, s)).collect();

    let slots = proofs(
        dev.as_ref(),
        &[(0, PASSES[0]), (1, PASSES[1]), (2, PASSES[2])],
    );
    let kdf = fast_kdf();
    let started = init_slots(
        Devices::one(dev.as_ref()),
        &slots,
        &opts(&kdf, KeyslotKdf::SameAsOld),
    )
    .expect("init");
    assert_eq!(started.new_keyslots, vec![(0, 3), (1, 4), (2, 5)]);
    assert_eq!((started.old_keyslot, started.new_keyslot), (0, Some(3)));
    assert_eq!(started.reencrypt_keyslot, 6);
    let mid = luks2(dev.as_ref());
    for (old, new) in [(0, 3), (1, 4), (2, 5)] {
        assert_eq!(costs(&mid, new), old_costs[old as usize], "keyslot {new}");
    }
    assert_eq!(mid.meta().tokens["0"]["keyslots"], json!(["1", "4"]));
    // Every new keyslot opens the new key with its passphrase, every old one the old key.
    let new_did = opens(dev.as_ref(), 3, PASSES[0]).unwrap();
    for (i, p) in PASSES.iter().enumerate() {
        assert_eq!(opens(dev.as_ref(), i as u32 + 3, p).unwrap(), new_did);
        assert_ne!(opens(dev.as_ref(), i as u32, p).unwrap(), new_did);
    }

    run(dev.as_ref(), PASSES[1]);
    let after = luks2(dev.as_ref());
    let mut left: Vec<&String> = after.meta().keyslots.keys().collect();
    left.sort();
    assert_eq!(left, ["3", "4", "5"]);
    assert_eq!(after.meta().tokens["0"]["keyslots"], json!(["4"]));
    for (i, p) in PASSES.iter().enumerate() {
        assert_eq!(costs(&after, i as u32 + 3), old_costs[i]);
        assert!(
            opens(dev.as_ref(), i as u32, p).is_err(),
            "old keyslot {i} gone"
        );
        assert!(contents(dev.clone(), p) == fill(), "passphrase {i}");
    }
}

/// With a PBKDF asked for, every new keyslot gets it (cryptsetup's `--pbkdf` and kin); a
/// rotation of one keyslot of several (`--key-slot`) leaves only that one's twin.
#[test]
fn a_given_pbkdf_and_one_keyslot_of_several() {
    let dev = volume(3);
    let slots = proofs(dev.as_ref(), &[(2, PASSES[2])]);
    let mut kdf = fast_kdf();
    kdf.force_iterations = Some(1111);
    let started = init_slots(
        Devices::one(dev.as_ref()),
        &slots,
        &opts(&kdf, KeyslotKdf::Given),
    )
    .expect("init");
    assert_eq!(started.new_keyslots, vec![(2, 3)]);
    assert_eq!(costs(&luks2(dev.as_ref()), 3), "pbkdf2 sha256 1111");
    run(dev.as_ref(), PASSES[2]);
    let after = luks2(dev.as_ref());
    assert_eq!(after.meta().keyslots.keys().collect::<Vec<_>>(), ["3"]);
    assert!(contents(dev.clone(), PASSES[2]) == fill());
}

/// Refusals, each with nothing written: one passphrase without a keyslot for several active
/// keyslots (a key file: cryptsetup's words), a keyslot given twice, no passphrase at all, a
/// passphrase that does not open the keyslot named.
#[test]
fn refusals_write_nothing() {
    let dev = volume(3);
    let img = dev.crash_image(0);
    let kdf = fast_kdf();
    let e = init_on(
        Devices::one(dev.as_ref()),
        PASSES[0],
        &opts(&kdf, KeyslotKdf::SameAsOld),
    )
    .unwrap_err();
    assert!(e.to_string().contains(KEY_FILE_NEEDS_ONE_KEYSLOT), "{e}");
    let twice = proofs(dev.as_ref(), &[(1, PASSES[1]), (1, PASSES[1])]);
    let e = init_slots(
        Devices::one(dev.as_ref()),
        &twice,
        &opts(&kdf, KeyslotKdf::SameAsOld),
    )
    .unwrap_err();
    assert!(e.to_string().contains("given twice"), "{e}");
    let e = init_slots(
        Devices::one(dev.as_ref()),
        &[],
        &opts(&kdf, KeyslotKdf::SameAsOld),
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let hdr = luks::read_header(dev.as_ref()).unwrap();
    let wrong = check_passphrase(dev.as_ref(), &hdr, 0, SecretBytes::from_slice(PASSES[1]));
    assert!(matches!(wrong, Err(Error::WrongPassphrase)));
    assert!(dev.crash_image(0) == img, "nothing written");
}

/// cryptsetup's count before any passphrase: 15 active keyslots fit without `--key-slot`
/// (15 + 15 new + the reencrypt keyslot = 31), 16 do not (33 > 32) but do with it (18);
/// 30 fit only with it, 31 not at all.
#[test]
fn free_keyslots_are_counted_as_cryptsetup_does() {
    let dev = volume_at(DATA_OFFSET_FULL);
    let key = key(dev.as_ref());
    let mut h = luks2(dev.as_ref());
    let mut rows = vec![];
    for n in 2..=31usize {
        // Only the JSON matters for the count: the keyslot material is not written.
        let (_, _) = h
            .add_keyslot(
                NewKeyslot {
                    vk: &key,
                    passphrase: b"x",
                    kdf: &fast_kdf(),
                    slot: None,
                },
                None,
            )
            .expect("keyslot");
        if [15, 16, 30, 31].contains(&n) {
            let hdr = Header::Luks2(h.clone());
            let any = check_free_keyslots(&hdr, false).is_ok();
            let one = check_free_keyslots(&hdr, true).map_err(|e| e.to_string());
            if let Err(e) = &one {
                assert!(e.contains(NOT_ENOUGH_KEYSLOTS), "{e}");
            }
            rows.push((n, any, one.is_ok()));
        }
    }
    assert_eq!(
        rows,
        [
            (15, true, true),
            (16, false, true),
            (30, false, true),
            (31, false, false)
        ]
    );
}
