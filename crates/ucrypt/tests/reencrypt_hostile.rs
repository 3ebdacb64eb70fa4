//! Hostile reencryption metadata: a volume caught in the middle of a key rotation (between two
//! hotzones, and inside one), its header mangled the way a buggy tool or a tampering storage
//! could mangle it, with the checksums of both header copies made valid again. `resume` and
//! `recover` must refuse each with a named check and write nothing; activation refuses too.
//!
//! The reencryption digest covers the reencrypt keyslot and the backup segments only, so
//! mangled live segments (where the hotzone is, which key maps where) must be caught by the
//! layout checks, not by the digest.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::{json, Value};
use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::luks::reencrypt::plan::position;
use ucrypt::luks::reencrypt::run::{
    init, init_decrypt_unshift, init_encrypt_shift, recover, recover_on, resume, resume_on,
    Devices, EncryptOptions, InitOptions, KeyslotKdf, ResilienceKind, RunOptions, SegmentChange,
    UnshiftOptions, CHECKSUM_HASH,
};
use ucrypt::luks::reencrypt::{Mode, ReencryptState};
use ucrypt::luks::{self, HashAlg, Header, OpenOptions, Unlock};
use ucrypt::sector::{CipherSpec, SectorSize};
use ucrypt::{Error, Result, SecretBytes};

mod common;
use common::{fast_kdf, format_filled, Cut, Slice};
const DATA_OFFSET: u64 = 1 << 20;
const HDR: u64 = 0x4000;
const DATA_BYTES: u64 = 256 << 10;
const HOTZONE_BYTES: u64 = 64 << 10;
const PASS: &[u8] = b"hostile";

/// A filled volume with one keyslot, 4096-byte sectors.
fn base() -> Vec<u8> {
    let dev = Arc::new(CrashBackend::new(DATA_OFFSET + DATA_BYTES, 512).expect("device"));
    let vk: Vec<u8> = (0..64u8).collect();
    let fill: Vec<u8> = (0..DATA_BYTES).map(|i| (i * 7 + i / 4096) as u8).collect();
    format_filled(
        &(dev.clone() as Arc<dyn Backend>),
        "5e1f2d3c-4b5a-4978-8695-a4b3c2d1e0f0",
        (DATA_OFFSET, HDR, 4096),
        &vk,
        PASS,
        &fill,
    );
    dev.crash_image(0)
}

fn rotate(dev: &dyn Backend, kind: ResilienceKind) -> Result<()> {
    init(
        dev,
        PASS,
        &InitOptions {
            resilience: kind,
            kdf: &fast_kdf(),
            key_slot: None,
            change: SegmentChange::default(),
            mode: Mode::Reencrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: CHECKSUM_HASH,
            shift_bytes: None,
        },
    )?;
    resume(
        dev,
        PASS,
        RunOptions {
            hotzone_bytes: Some(HOTZONE_BYTES),
            ..Default::default()
        },
        &mut |_| {},
    )
}

/// (done, hotzone) of a header in reencryption.
fn where_is(img: &[u8]) -> Option<(u64, Option<u64>)> {
    let hdr = luks::read_header(&CrashBackend::from_image(img.to_vec(), 512)).ok()?;
    let Header::Luks2(h) = hdr else { return None };
    let st = ReencryptState::from_metadata(h.meta()).ok()??;
    let p = position(h.meta(), &st, DATA_BYTES).ok()?;
    Some((p.done, p.hotzone))
}

/// The rotation stopped with some data done and no hotzone open, and stopped inside a hotzone
/// past the first.
fn stopped_images(kind: ResilienceKind) -> (Vec<u8>, Vec<u8>) {
    let img = base();
    let mut between = None;
    let mut inside = None;
    for budget in 0.. {
        let dev = Cut::new(img.clone(), 512, budget);
        if rotate(&dev, kind).is_ok() {
            break;
        }
        let got = dev.image();
        // Only stops where both header copies were written (the rows mangle both).
        let json = |c: usize| &got[c * HDR as usize + 4096..(c + 1) * HDR as usize];
        if json(0) != json(1) {
            continue;
        }
        match where_is(&got) {
            Some((done, None)) if done > 0 && between.is_none() => between = Some(got),
            Some((done, Some(_))) if done > 0 && inside.is_none() => inside = Some(got),
            _ => {}
        }
        if between.is_some() && inside.is_some() {
            break;
        }
    }
    (
        between.expect("a stop between hotzones"),
        inside.expect("a stop inside a hotzone"),
    )
}

/// The id of the segment carrying `flag`.
fn flagged(v: &Value, flag: &str) -> String {
    v["segments"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, s)| {
            s["flags"]
                .as_array()
                .is_some_and(|f| f.iter().any(|x| x == flag))
        })
        .map(|(k, _)| k.clone())
        .unwrap_or_else(|| panic!("no segment flagged {flag}"))
}

fn reencrypt_keyslot_id(v: &Value) -> String {
    v["keyslots"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, k)| k["type"] == "reencrypt")
        .map(|(k, _)| k.clone())
        .expect("a reencrypt keyslot")
}

fn reencrypt_keyslot(v: &mut Value) -> &mut Value {
    let id = reencrypt_keyslot_id(v);
    &mut v["keyslots"][&id]
}

fn set_size(s: &mut Value, n: u64) {
    s["size"] = json!(n.to_string());
}

fn num(s: &Value, field: &str) -> u64 {
    s[field].as_str().unwrap().parse().unwrap()
}

/// Which stopped image a row mangles.
#[derive(Clone, Copy, Debug)]
enum At {
    Between,
    Inside,
}

type Mangle = Box<dyn Fn(&mut Value)>;

/// (name, image, mutation, the check the refusal names)
fn rows() -> Vec<(&'static str, At, Mangle, &'static str)> {
    use At::*;
    vec![
        (
            "reencryption digest flipped",
            Between,
            Box::new(|v: &mut Value| {
                let id = reencrypt_keyslot_id(v);
                let d = v["digests"]
                    .as_object_mut()
                    .unwrap()
                    .values_mut()
                    .find(|d| {
                        d["keyslots"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .any(|k| k == id.as_str())
                    })
                    .expect("the reencryption digest");
                let s = d["digest"].as_str().unwrap().to_string();
                let flipped = if s.starts_with('A') { "B" } else { "A" };
                d["digest"] = json!(format!("{flipped}{}", &s[1..]));
            }),
            "reencrypt-digest",
        ),
        (
            "backup-final segment given another cipher",
            Between,
            Box::new(|v: &mut Value| {
                let id = flagged(v, "backup-final");
                v["segments"][&id]["encryption"] = json!("aes-cbc-essiv:sha256");
            }),
            "reencrypt-digest",
        ),
        (
            "resilience changed from checksum to none",
            Between,
            Box::new(|v: &mut Value| {
                let ks = reencrypt_keyslot(v);
                ks["area"] = json!({
                    "type": "none",
                    "offset": ks["area"]["offset"].clone(),
                    "size": ks["area"]["size"].clone(),
                });
            }),
            "reencrypt-digest",
        ),
        (
            "requirement of an unknown reencryption version",
            Between,
            Box::new(|v: &mut Value| {
                v["config"]["requirements"] = json!({"mandatory": ["online-reencrypt-v9"]});
            }),
            "reencrypt",
        ),
        (
            "hotzone past the end of the device",
            Inside,
            Box::new(|v: &mut Value| {
                let id = flagged(v, "in-reencryption");
                set_size(&mut v["segments"][&id], DATA_BYTES);
            }),
            // The planner reads the position back and finds it past the data.
            "reencrypt-plan",
        ),
        (
            "done part past the end of the device",
            Between,
            Box::new(|v: &mut Value| set_size(&mut v["segments"]["0"], DATA_BYTES + 4096)),
            "reencrypt-plan",
        ),
        (
            "gap between the done part and the rest",
            Between,
            Box::new(|v: &mut Value| {
                let off = num(&v["segments"]["1"], "offset");
                v["segments"]["1"]["offset"] = json!((off + 4096).to_string());
            }),
            "reencrypt-segments",
        ),
        (
            "hotzone overlapping the done part",
            Inside,
            Box::new(|v: &mut Value| {
                let off = num(&v["segments"]["1"], "offset");
                let size = num(&v["segments"]["1"], "size");
                v["segments"]["1"]["offset"] = json!((off - 4096).to_string());
                set_size(&mut v["segments"]["1"], size + 4096);
            }),
            "reencrypt-segments",
        ),
        (
            "IV tweak of the rest not at its offset",
            Between,
            Box::new(|v: &mut Value| {
                v["segments"]["1"]["iv_tweak"] = json!("0");
            }),
            "reencrypt-segments",
        ),
        (
            "done part keyed with the old key",
            Between,
            Box::new(|v: &mut Value| {
                let digests = v["digests"].as_object_mut().unwrap();
                for d in digests.values_mut() {
                    let segs = d["segments"].as_array_mut().unwrap();
                    segs.retain(|s| s != "0");
                }
                let prev = flagged(v, "backup-previous");
                for d in v["digests"].as_object_mut().unwrap().values_mut() {
                    let segs = d["segments"].as_array_mut().unwrap();
                    if segs.iter().any(|s| s == prev.as_str()) {
                        segs.push(json!("0"));
                    }
                }
            }),
            "reencrypt-plan",
        ),
        (
            "done part with the old cipher's sector size",
            Between,
            Box::new(|v: &mut Value| {
                v["segments"]["0"]["sector_size"] = json!(512);
            }),
            "reencrypt-segments",
        ),
        (
            "hotzone larger than its checksums cover",
            Inside,
            Box::new(|v: &mut Value| {
                let ks = reencrypt_keyslot(v);
                // 32 bytes of sha256 per 4 KiB block: room for one block only.
                ks["area"]["size"] = json!("4096");
            }),
            "reencrypt-digest",
        ),
    ]
}

fn check_named(what: &str, r: Result<impl std::fmt::Debug>, want: &str) {
    match r {
        Err(Error::BadHeader { check, detail }) => assert_eq!(
            check, want,
            "{what}: refused by check '{check}' ({detail}), expected '{want}'"
        ),
        other => panic!("{what}: expected a refusal naming '{want}', got {other:?}"),
    }
}

#[test]
fn mangled_reencryption_metadata_is_refused_and_nothing_is_written() {
    let (between, inside) = stopped_images(ResilienceKind::Checksum);
    // The unmangled images go on: the rows below fail for their mangling alone.
    for (name, img) in [("between", &between), ("inside", &inside)] {
        let dev = Cut::new(img.clone(), 512, u64::MAX);
        if name == "inside" {
            recover(&dev, PASS).expect("recover the unmangled hotzone");
        }
        resume(
            &dev,
            PASS,
            RunOptions {
                hotzone_bytes: Some(HOTZONE_BYTES),
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap_or_else(|e| panic!("{name}: the unmangled rotation resumes: {e}"));
    }
    for (name, at, mangle, want) in rows() {
        let mut img = match at {
            At::Between => between.clone(),
            At::Inside => inside.clone(),
        };
        common::mutate_json(HDR, &mut img, &*mangle);
        let dev = Cut::new(img.clone(), 512, 0);
        let r = resume(
            &dev,
            PASS,
            RunOptions {
                hotzone_bytes: Some(HOTZONE_BYTES),
                ..Default::default()
            },
            &mut |_| {},
        );
        check_named(&format!("{name} (resume)"), r, want);
        check_named(&format!("{name} (recover)"), recover(&dev, PASS), want);
        assert_eq!(
            dev.used.load(Ordering::SeqCst),
            0,
            "{name}: a refused call wrote"
        );
        let opened = luks::open(
            Arc::new(CrashBackend::from_image(img, 512)),
            Unlock::Passphrase(SecretBytes::from_slice(PASS)),
            &OpenOptions::default(),
        );
        assert!(opened.is_err(), "{name}: activation refused");
        println!("{name}: refused by '{want}'");
    }
}

// ---------------------------------------------------------------- encryption moving the data

/// The shift of the data-moving rows, and the plaintext (three shifts), on a device with
/// the two shifts of free space after it.
const SHIFT: u64 = 512 << 10;
const SHIFT_DATA: u64 = 3 * SHIFT;

fn shift_base() -> Vec<u8> {
    (0..SHIFT_DATA + 2 * SHIFT)
        .map(|i| (i * 13 + i / 512) as u8)
        .collect()
}

fn encrypt_shift(dev: &dyn Backend) -> Result<()> {
    init_encrypt_shift(
        dev,
        PASS,
        &EncryptOptions {
            resilience: ResilienceKind::None,
            kdf: &fast_kdf(),
            cipher: CipherSpec::AES_XTS_PLAIN64,
            key_bytes: 64,
            sector_size: SectorSize::S512,
            uuid: "5e1f2d3c-4b5a-4978-8695-a4b3c2d1e0f1".into(),
            keyslot_area: None,
            resilience_hash: CHECKSUM_HASH,
        },
        2 * SHIFT,
    )?;
    resume(dev, PASS, RunOptions::default(), &mut |_| {})
}

/// The data-moving encryption stopped between hotzones and inside one (past the first).
fn shift_stopped() -> (Vec<u8>, Vec<u8>) {
    let img = shift_base();
    let (mut between, mut inside) = (None, None);
    for budget in 0.. {
        let dev = Cut::new(img.clone(), 512, budget);
        if encrypt_shift(&dev).is_ok() {
            break;
        }
        let got = dev.image();
        let json = |c: usize| &got[c * HDR as usize + 4096..(c + 1) * HDR as usize];
        if json(0) != json(1) {
            continue;
        }
        let Ok(Header::Luks2(h)) = luks::read_header(&CrashBackend::from_image(got.clone(), 512))
        else {
            continue;
        };
        let Ok(Some(st)) = ReencryptState::from_metadata(h.meta()) else {
            continue;
        };
        match position(h.meta(), &st, SHIFT_DATA) {
            Ok(p) if p.done > 0 && p.hotzone.is_none() && between.is_none() => between = Some(got),
            Ok(p) if p.done > 0 && p.hotzone.is_some() && inside.is_none() => inside = Some(got),
            _ => {}
        }
        if between.is_some() && inside.is_some() {
            break;
        }
    }
    (between.expect("between"), inside.expect("inside"))
}

/// Recomputes the reencryption digest of both copies with the volume key, as a tool holding
/// the key would write it: the rows then reach the checks behind the digest.
fn redigest(img: &mut [u8]) {
    redigest_with(img, false)
}

/// [`redigest`] over the old key (a decryption) when `old`, else the new one.
fn redigest_with(img: &mut [u8], old: bool) {
    let dev = CrashBackend::from_image(img.to_vec(), 512);
    let hdr = luks::read_header(&dev).expect("header");
    let Header::Luks2(h) = &hdr else { panic!() };
    let st = ReencryptState::from_metadata(h.meta()).unwrap().unwrap();
    let mut read = |o: u64, l: u64| luks::read_area(&dev, o, l);
    let (_, vk) = luks::unlock(&hdr, PASS, Some(0), &mut read).expect("unlock");
    let (o, n) = if old {
        (Some(vk.bytes()), None)
    } else {
        (None, Some(vk.bytes()))
    };
    let data = ucrypt::luks::reencrypt::verification_data(h.meta(), &st, o, n).unwrap();
    let rk = st.keyslot.id.to_string();
    let (id, d) = h
        .meta()
        .digest_for_keyslot(&rk)
        .expect("reencryption digest");
    let salt = common::b64_decode(d.salt.as_deref().unwrap()).unwrap();
    let mut out = vec![0u8; 32];
    HashAlg::Sha256.pbkdf2(data.as_ref(), &salt, d.iterations.unwrap(), &mut out);
    let digest = common::b64_encode(&out);
    let id = id.clone();
    common::mutate_json(HDR, img, &move |v: &mut Value| {
        v["digests"][&id]["digest"] = json!(digest.clone());
    });
}

/// (name, image, mutation, recompute the digest, the check the refusal names)
fn shift_rows() -> Vec<(&'static str, At, Mangle, bool, &'static str)> {
    use At::*;
    let moved_to = |v: &mut Value, offset: u64| {
        let id = flagged(v, "backup-moved-segment");
        v["segments"][&id]["offset"] = json!(offset.to_string());
        v["segments"]["0"]["offset"] = json!(offset.to_string());
    };
    vec![
        (
            "shift size not matching the moved segment",
            Between,
            Box::new(|v: &mut Value| {
                reencrypt_keyslot(v)["area"]["shift_size"] = json!((SHIFT / 2).to_string());
            }),
            true,
            "reencrypt-datashift",
        ),
        (
            "new data offset not the old one plus the shift",
            Between,
            Box::new(|v: &mut Value| {
                let id = flagged(v, "backup-final");
                v["segments"][&id]["offset"] = json!((2 * SHIFT).to_string());
            }),
            true,
            "reencrypt-datashift",
        ),
        (
            "moved segment inside what the hotzones write",
            Between,
            Box::new(move |v: &mut Value| moved_to(v, SHIFT_DATA)),
            true,
            "reencrypt-datashift",
        ),
        (
            "moved segment past the end of the device",
            Inside,
            Box::new(move |v: &mut Value| moved_to(v, SHIFT_DATA + 2 * SHIFT)),
            true,
            "reencrypt-datashift",
        ),
        (
            "moved segment resized, digest not recomputed",
            Between,
            Box::new(|v: &mut Value| {
                let id = flagged(v, "backup-moved-segment");
                set_size(&mut v["segments"][&id], SHIFT / 2);
            }),
            false,
            "reencrypt-digest",
        ),
        (
            "live moved segment away from its backup",
            Between,
            Box::new(|v: &mut Value| {
                v["segments"]["0"]["offset"] = json!((SHIFT_DATA + SHIFT + 4096).to_string());
            }),
            false,
            "reencrypt-segments",
        ),
        (
            "hotzone not ending where the done part begins",
            Inside,
            Box::new(|v: &mut Value| {
                let id = flagged(v, "in-reencryption");
                let off = num(&v["segments"][&id], "offset");
                v["segments"][&id]["offset"] = json!((off - 4096).to_string());
            }),
            false,
            "reencrypt-plan",
        ),
    ]
}

#[test]
fn mangled_datashift_metadata_is_refused_and_nothing_is_written() {
    let (between, inside) = shift_stopped();
    for (name, img) in [("between", &between), ("inside", &inside)] {
        let mut img = img.clone();
        // Recomputing the digest of unmangled metadata changes nothing that matters.
        redigest(&mut img);
        let dev = Cut::new(img, 512, u64::MAX);
        if name == "inside" {
            recover(&dev, PASS).expect("recover the unmangled hotzone");
        }
        resume(&dev, PASS, RunOptions::default(), &mut |_| {})
            .unwrap_or_else(|e| panic!("{name}: the unmangled encryption resumes: {e}"));
    }
    for (name, at, mangle, digest, want) in shift_rows() {
        let mut img = match at {
            At::Between => between.clone(),
            At::Inside => inside.clone(),
        };
        common::mutate_json(HDR, &mut img, &*mangle);
        if digest {
            redigest(&mut img);
        }
        let dev = Cut::new(img.clone(), 512, 0);
        let r = resume(&dev, PASS, RunOptions::default(), &mut |_| {});
        check_named(&format!("{name} (resume)"), r, want);
        check_named(&format!("{name} (recover)"), recover(&dev, PASS), want);
        assert_eq!(
            dev.used.load(Ordering::SeqCst),
            0,
            "{name}: a refused call wrote"
        );
        let opened = luks::open(
            Arc::new(CrashBackend::from_image(img, 512)),
            Unlock::Passphrase(SecretBytes::from_slice(PASS)),
            &OpenOptions::default(),
        );
        assert!(opened.is_err(), "{name}: activation refused");
        println!("{name}: refused by '{want}'");
    }
}

// ------------------------------------------------------ decryption moving the data back

/// The old data offset (the shift) of the rows of a decryption that moves the data back, and
/// its data (three shifts): the disk is the new header file (one shift: the metadata and
/// keyslots area), then the volume with its header in front.
const UNSHIFT_S: u64 = 512 << 10;
const UNSHIFT_DATA: u64 = 3 * UNSHIFT_S;
const UNSHIFT_VOL: u64 = UNSHIFT_S + UNSHIFT_DATA;

/// The header file and the volume on `disk`.
fn unshift_devs(disk: Arc<dyn Backend>) -> (Arc<Slice>, Arc<Slice>) {
    (
        Arc::new(Slice {
            inner: disk.clone(),
            offset: 0,
            len: UNSHIFT_S,
        }),
        Arc::new(Slice {
            inner: disk,
            offset: UNSHIFT_S,
            len: UNSHIFT_VOL,
        }),
    )
}

fn unshift_base() -> Vec<u8> {
    let disk = Arc::new(CrashBackend::new(UNSHIFT_S + UNSHIFT_VOL, 512).expect("disk"));
    let (_, vol) = unshift_devs(disk.clone());
    let vk: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(3)).collect();
    let fill: Vec<u8> = (0..UNSHIFT_DATA)
        .map(|i| (i * 11 + i / 512) as u8)
        .collect();
    format_filled(
        &(vol as Arc<dyn Backend>),
        "5e1f2d3c-4b5a-4978-8695-a4b3c2d1e0f2",
        (UNSHIFT_S, HDR, 4096),
        &vk,
        PASS,
        &fill,
    );
    disk.crash_image(0)
}

/// `resume` of a decryption that moves the data back, on `disk`.
fn unshift_resume(disk: Arc<dyn Backend>) -> Result<()> {
    let (h, d) = unshift_devs(disk);
    let devs = Devices {
        header: h.as_ref(),
        data: d.as_ref(),
    };
    resume_on(devs, PASS, RunOptions::default(), &mut |_| {})
}

fn unshift_recover(disk: Arc<dyn Backend>) -> Result<ucrypt::luks::reencrypt::run::Recovery> {
    let (h, d) = unshift_devs(disk);
    recover_on(
        Devices {
            header: h.as_ref(),
            data: d.as_ref(),
        },
        PASS,
    )
}

fn unshift_all(disk: Arc<dyn Backend>) -> Result<()> {
    let (h, d) = unshift_devs(disk.clone());
    init_decrypt_unshift(
        Devices {
            header: h.as_ref(),
            data: d.as_ref(),
        },
        PASS,
        &UnshiftOptions {
            kdf: &fast_kdf(),
            key_slot: None,
            moved_bytes: None,
            resilience: ResilienceKind::Checksum,
            resilience_hash: CHECKSUM_HASH,
        },
    )?;
    unshift_resume(disk)
}

/// The decryption stopped between hotzones of the walk (some done), inside one of them (some
/// done), and inside the moved segment's hotzone.
fn unshift_stopped() -> [Vec<u8>; 3] {
    let img = unshift_base();
    let (mut between, mut inside, mut moved) = (None, None, None);
    for budget in 0.. {
        let dev = Arc::new(Cut::new(img.clone(), 512, budget));
        if unshift_all(dev.clone()).is_ok() {
            break;
        }
        let got = dev.image();
        let json = |c: usize| &got[c * HDR as usize + 4096..(c + 1) * HDR as usize];
        if json(0) != json(1) {
            continue;
        }
        let Ok(Header::Luks2(h)) = luks::read_header(&CrashBackend::from_image(got.clone(), 512))
        else {
            continue;
        };
        let Ok(Some(st)) = ReencryptState::from_metadata(h.meta()) else {
            continue;
        };
        let walk = UNSHIFT_DATA - UNSHIFT_S;
        match position(h.meta(), &st, UNSHIFT_DATA) {
            Ok(p) if p.done > 0 && p.done < walk && p.hotzone.is_none() && between.is_none() => {
                between = Some(got)
            }
            Ok(p) if p.done > 0 && p.done < walk && p.hotzone.is_some() && inside.is_none() => {
                inside = Some(got)
            }
            Ok(p) if p.done == walk && p.hotzone.is_some() && moved.is_none() => moved = Some(got),
            _ => {}
        }
        if between.is_some() && inside.is_some() && moved.is_some() {
            break;
        }
    }
    [
        between.expect("between"),
        inside.expect("inside"),
        moved.expect("inside the moved segment's hotzone"),
    ]
}

/// Which stopped decryption a row mangles.
#[derive(Clone, Copy, Debug)]
enum UnshiftAt {
    Between,
    Inside,
    Moved,
}

/// (name, image, mutation, recompute the digest over the old key, the check the refusal names)
fn unshift_rows() -> Vec<(&'static str, UnshiftAt, Mangle, bool, &'static str)> {
    use UnshiftAt::*;
    let backup = |v: &mut Value, flag: &str, f: &dyn Fn(&mut Value)| {
        let id = flagged(v, flag);
        f(&mut v["segments"][&id]);
    };
    vec![
        (
            "v3 reencryption digest flipped",
            Between,
            Box::new(|v: &mut Value| {
                let id = reencrypt_keyslot_id(v);
                let (did, _) = v["digests"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .find(|(_, d)| d["keyslots"].as_array().unwrap().contains(&json!(id)))
                    .map(|(k, d)| (k.clone(), d.clone()))
                    .unwrap();
                let d = v["digests"][&did]["digest"].as_str().unwrap().to_string();
                let flipped = if d.starts_with('A') { "B" } else { "A" };
                v["digests"][&did]["digest"] = json!(format!("{flipped}{}", &d[1..]));
            }),
            false,
            "reencrypt-digest",
        ),
        (
            "datashift-checksum under the v2 requirement",
            Between,
            Box::new(|v: &mut Value| {
                v["config"]["requirements"]["mandatory"] = json!(["online-reencrypt-v2"]);
            }),
            true,
            "reencrypt-datashift",
        ),
        (
            "shift size not the distance between the data offsets",
            Between,
            Box::new(|v: &mut Value| {
                reencrypt_keyslot(v)["area"]["shift_size"] = json!((UNSHIFT_S / 2).to_string());
            }),
            true,
            "reencrypt-datashift",
        ),
        (
            "moved segment larger than the shift",
            Between,
            Box::new(move |v: &mut Value| {
                backup(v, "backup-moved-segment", &|s| set_size(s, 2 * UNSHIFT_S))
            }),
            true,
            "reencrypt-datashift",
        ),
        (
            "moved segment away from the new data offset",
            Inside,
            Box::new(move |v: &mut Value| {
                backup(v, "backup-moved-segment", &|s| {
                    s["offset"] = json!("4096");
                })
            }),
            true,
            "reencrypt-datashift",
        ),
        (
            "moved segment under another cipher",
            Moved,
            Box::new(move |v: &mut Value| {
                backup(v, "backup-moved-segment", &|s| {
                    s["encryption"] = json!("aes-cbc-essiv:sha256");
                })
            }),
            true,
            "reencrypt-datashift",
        ),
        (
            "backup-previous moved, digest not recomputed",
            Between,
            Box::new(move |v: &mut Value| {
                backup(v, "backup-previous", &|s| {
                    s["offset"] = json!((UNSHIFT_S + 4096).to_string());
                })
            }),
            false,
            "reencrypt-digest",
        ),
        (
            "live moved segment away from its backup",
            Between,
            Box::new(|v: &mut Value| {
                v["segments"]["0"]["offset"] = json!("4096");
            }),
            false,
            "reencrypt-segments",
        ),
        (
            "ciphertext left with an IV tweak off its offset",
            Between,
            Box::new(|v: &mut Value| {
                let last = v["segments"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .filter(|(_, s)| s["type"] == "crypt" && s.get("flags").is_none())
                    .map(|(k, _)| k.clone())
                    .next_back()
                    .unwrap();
                let t = num(&v["segments"][&last], "iv_tweak");
                v["segments"][&last]["iv_tweak"] = json!((t + 8).to_string());
            }),
            false,
            "reencrypt-segments",
        ),
        (
            "hotzone not beginning where the plaintext done ends",
            Inside,
            Box::new(|v: &mut Value| {
                let id = flagged(v, "in-reencryption");
                let off = num(&v["segments"][&id], "offset");
                v["segments"][&id]["offset"] = json!((off + 4096).to_string());
            }),
            false,
            "reencrypt-plan",
        ),
        (
            "moved segment's hotzone shorter than the moved segment",
            Moved,
            Box::new(|v: &mut Value| {
                let id = flagged(v, "in-reencryption");
                set_size(&mut v["segments"][&id], UNSHIFT_S / 2);
            }),
            false,
            "reencrypt-plan",
        ),
    ]
}

#[test]
fn mangled_unshift_metadata_is_refused_and_nothing_is_written() {
    let stopped = unshift_stopped();
    let names = ["between", "inside", "moved"];
    for (name, img) in names.iter().zip(&stopped) {
        let mut img = img.clone();
        redigest_with(&mut img, true);
        let dev: Arc<dyn Backend> = Arc::new(Cut::new(img, 512, u64::MAX));
        if *name != "between" {
            unshift_recover(dev.clone()).expect("recover the unmangled hotzone");
        }
        // Recovering the moved segment's hotzone, the last, finalises.
        if *name != "moved" {
            unshift_resume(dev.clone())
                .unwrap_or_else(|e| panic!("{name}: the unmangled decryption resumes: {e}"));
        }
        let (h, _) = unshift_devs(dev);
        assert!(
            luks::read_header(h.as_ref())
                .unwrap()
                .unmet_requirements()
                .is_empty(),
            "{name}: finished"
        );
    }
    for (name, at, mangle, digest, want) in unshift_rows() {
        let mut img = stopped[at as usize].clone();
        common::mutate_json(HDR, &mut img, &*mangle);
        if digest {
            redigest_with(&mut img, true);
        }
        let cut = Arc::new(Cut::new(img.clone(), 512, 0));
        check_named(
            &format!("{name} (resume)"),
            unshift_resume(cut.clone()),
            want,
        );
        check_named(
            &format!("{name} (recover)"),
            unshift_recover(cut.clone()),
            want,
        );
        assert_eq!(
            cut.used.load(Ordering::SeqCst),
            0,
            "{name}: a refused call wrote"
        );
        let (h, d) = unshift_devs(Arc::new(CrashBackend::from_image(img, 512)));
        let mut o = OpenOptions::default();
        o.header = Some(h);
        let opened = luks::open(d, Unlock::Passphrase(SecretBytes::from_slice(PASS)), &o);
        assert!(opened.is_err(), "{name}: activation refused");
        println!("{name}: refused by '{want}'");
    }
}
