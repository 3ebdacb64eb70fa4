use super::in_place::{last_backward_hotzone, next_hotzone_in_place};
use super::shift::{next_hotzone_shift, shift_geometry, Shift};
use super::unshift::{
    next_hotzone_unshift, unshift_geometry, Unshift, UNSHIFT_REQUIREMENT_VERSION,
};
use super::{bounded_data_bytes, position, set_segments, Movement};
use super::{
    check_layout, check_supported, finalise, hotzone_offset, MovedGuard, Position, Protect, Step,
};
use crate::luks::json::{Metadata, Segment, SegmentSize, U64Str};
use crate::luks::reencrypt::{Direction, ReencryptState, Resilience};
use crate::luks::{parse_any, HashAlg, Header};
use crate::Error;

const MIB: u64 = 1 << 20;
/// The data size of the volume the stored crash header comes from.
const DATA: u64 = 192 * MIB;

/// The first 32 KiB of a volume cryptsetup 2.6.1 was SIGKILLed in, inside its hotzone.
fn crash() -> Metadata {
    let bytes = include_bytes!("../../../../tests/data/reencrypt-crash-hdr.bin");
    match parse_any(bytes).unwrap() {
        Header::Luks2(h) => h.meta,
        Header::Luks1(_) => unreachable!(),
    }
}

fn state(meta: &Metadata) -> ReencryptState {
    ReencryptState::from_metadata(meta).unwrap().unwrap()
}

fn digest_lists(meta: &Metadata) -> Vec<Vec<String>> {
    meta.digests.values().map(|d| d.segments.clone()).collect()
}

#[test]
fn position_of_cryptsetups_crash() {
    let m = crash();
    assert_eq!(
        position(&m, &state(&m), DATA).unwrap(),
        Position {
            done: 28 * MIB,
            hotzone: Some(4 * MIB)
        }
    );
}

/// Rebuilding the segments for cryptsetup's own position gives cryptsetup's segments and
/// digest lists, to the byte of the JSON.
#[test]
fn set_segments_reproduces_cryptsetups_layout() {
    let m = crash();
    let mut st = state(&m);
    let pos = position(&m, &st, DATA).unwrap();
    // From another layout (the start) back to cryptsetup's position.
    let mut rebuilt = m.clone();
    let start = Position {
        done: 0,
        hotzone: None,
    };
    set_segments(&mut rebuilt, &mut st, start, DATA).unwrap();
    assert_eq!(rebuilt.segments.len(), 3);
    set_segments(&mut rebuilt, &mut st, pos, DATA).unwrap();
    assert_eq!(
        serde_json::to_value(&rebuilt.segments).unwrap(),
        serde_json::to_value(&m.segments).unwrap()
    );
    assert_eq!(digest_lists(&rebuilt), digest_lists(&m));
    assert_eq!(st, state(&m));
}

/// After the hotzone: two live segments, the boundary at 32 MiB, the IV tweak of the rest
/// advanced by 32 MiB / 512, digests as cryptsetup lists them between hotzones.
#[test]
fn set_segments_after_the_hotzone() {
    let mut m = crash();
    let mut st = state(&m);
    let done = 32 * MIB;
    set_segments(
        &mut m,
        &mut st,
        Position {
            done,
            hotzone: None,
        },
        DATA,
    )
    .unwrap();
    assert_eq!(m.segments.len(), 4);
    assert_eq!(m.segments["0"].size, SegmentSize::Bytes(done));
    assert_eq!(m.segments["1"].offset.0, 16 * MIB + done);
    assert_eq!(m.segments["1"].iv_tweak, Some(U64Str(done / 512)));
    assert_eq!(m.segments["1"].size, SegmentSize::Dynamic);
    assert_eq!(
        digest_lists(&m),
        vec![vec!["1", "2"], vec!["0", "3"], vec![]]
            .into_iter()
            .map(|v| v.into_iter().map(String::from).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    );
    assert_eq!(
        position(&m, &st, DATA).unwrap(),
        Position {
            done,
            hotzone: None
        }
    );
    assert_eq!((st.backup_previous, st.backup_final), (2, 3));
}

/// A walk bounded short of the data (`--device-size`): the part that ends at the bound gets a
/// fixed size, as cryptsetup's fixed-size mode writes it; the header then says the bound, and
/// its layout passes the check for it.
#[test]
fn a_bounded_walk_fixes_the_size_of_its_last_part() {
    let mut m = crash();
    let mut st = state(&m);
    assert_eq!(bounded_data_bytes(&m), None);
    let bound = 64 * MIB;
    let bounded = Movement::InPlace { bounded: true };
    for pos in [
        Position {
            done: 32 * MIB,
            hotzone: Some(4 * MIB),
        },
        Position {
            done: 36 * MIB,
            hotzone: None,
        },
    ] {
        bounded.set_segments(&mut m, &mut st, pos, bound).unwrap();
        let last = &m.segments[&(st.backup_previous - 1).to_string()];
        assert_eq!(
            last.size,
            SegmentSize::Bytes(bound - 32 * MIB - pos.hotzone.unwrap_or(4 * MIB))
        );
        assert_eq!(bounded_data_bytes(&m), Some(bound));
        assert_eq!(position(&m, &st, bound).unwrap(), pos);
        check_layout(&m, &st, bound).unwrap();
    }
    // Unbounded, the same position keeps the rest dynamic; a bound past it is no bound.
    set_segments(
        &mut m,
        &mut st,
        Position {
            done: 36 * MIB,
            hotzone: None,
        },
        DATA,
    )
    .unwrap();
    assert_eq!(bounded_data_bytes(&m), None);
}

#[test]
fn next_hotzone_steps_in_cryptsetups_order() {
    let m = crash();
    let st = state(&m);
    let data = 80 * MIB;
    let pos = Position {
        done: 32 * MIB,
        hotzone: None,
    };
    let steps = next_hotzone_in_place(&st, pos, data, 4 * MIB, 4096)
        .unwrap()
        .unwrap();
    assert_eq!(
        steps,
        vec![
            Step::ReadOld {
                offset: 32 * MIB,
                len: 4 * MIB
            },
            Step::WriteChecksums {
                area_offset: 548864,
                block: 4096,
                hash: HashAlg::Sha256
            },
            Step::SyncData,
            Step::CommitSegments(Position {
                done: 32 * MIB,
                hotzone: Some(4 * MIB)
            }),
            Step::WriteNew {
                offset: 32 * MIB,
                len: 4 * MIB
            },
            Step::SyncData,
            Step::CommitSegments(Position {
                done: 36 * MIB,
                hotzone: None
            }),
        ]
    );
    // The last hotzone is what remains; then nothing.
    let last = next_hotzone_in_place(
        &st,
        Position {
            done: 78 * MIB,
            hotzone: None,
        },
        data,
        4 * MIB,
        4096,
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        last[0],
        Step::ReadOld {
            offset: 78 * MIB,
            len: 2 * MIB
        }
    );
    assert_eq!(last.last(), Some(&Step::Finalise));
    assert_eq!(
        next_hotzone_in_place(
            &st,
            Position {
                done: data,
                hotzone: None
            },
            data,
            4 * MIB,
            4096
        )
        .unwrap(),
        None
    );
    // Inside a hotzone: recovery first.
    assert!(
        next_hotzone_in_place(&st, position(&m, &st, DATA).unwrap(), data, 4 * MIB, 4096).is_err()
    );
}

#[test]
fn hotzone_is_bounded_by_the_checksum_area() {
    let m = crash();
    let mut st = state(&m);
    // Room for 10 sha256 hashes: 10 blocks of 4096 bytes.
    st.keyslot.area_bytes = 10 * 32;
    let s = next_hotzone_in_place(
        &st,
        Position {
            done: 0,
            hotzone: None,
        },
        80 * MIB,
        4 * MIB,
        4096,
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        s[0],
        Step::ReadOld {
            offset: 0,
            len: 10 * 4096
        }
    );
}

#[test]
fn other_modes_are_refused() {
    let m = crash();
    let mut st = state(&m);
    st.keyslot.resilience = Resilience::Datashift { shift_size: MIB };
    assert!(matches!(
        next_hotzone_in_place(
            &st,
            Position {
                done: 0,
                hotzone: None
            },
            MIB,
            MIB,
            4096
        ),
        Err(Error::UnsupportedLuks(_))
    ));
    let mut st = state(&m);
    st.keyslot.direction = Direction::Backward;
    assert!(position(&m, &st, DATA).is_err());
}

/// The metadata cryptsetup 2.6.1 left when SIGKILLed inside a hotzone of a decryption
/// (detached header, 200 MiB of data, `--resilience checksum --hotzone-size 4M`; salts and
/// digests left out).
fn decrypt_crash() -> Metadata {
    serde_json::from_str(
        r#"{
  "keyslots": {
"0": {"type": "luks2", "key_size": 64,
      "af": {"type": "luks1", "stripes": 4000, "hash": "sha256"},
      "area": {"type": "raw", "offset": "32768", "size": "258048",
               "encryption": "aes-xts-plain64", "key_size": 64},
      "kdf": {"type": "pbkdf2", "hash": "sha256", "iterations": 1000, "salt": "AA=="}},
"1": {"type": "reencrypt", "key_size": 1, "mode": "decrypt", "direction": "backward",
      "priority": 0,
      "area": {"offset": "290816", "size": "16486400", "type": "checksum",
               "hash": "sha256", "sector_size": 4096}}
  },
  "tokens": {},
  "segments": {
"0": {"type": "crypt", "offset": "0", "size": "125829120", "iv_tweak": "0",
      "encryption": "aes-xts-plain64", "sector_size": 4096},
"1": {"type": "linear", "offset": "125829120", "size": "4194304",
      "flags": ["in-reencryption"]},
"2": {"type": "linear", "offset": "130023424", "size": "dynamic"},
"3": {"type": "crypt", "offset": "0", "size": "dynamic", "iv_tweak": "0",
      "encryption": "aes-xts-plain64", "sector_size": 4096, "flags": ["backup-previous"]},
"4": {"type": "linear", "offset": "0", "size": "dynamic", "flags": ["backup-final"]}
  },
  "digests": {
"0": {"type": "pbkdf2", "keyslots": ["0"], "segments": ["3", "0"], "hash": "sha256",
      "iterations": 1000, "salt": "AA==", "digest": "AA=="},
"1": {"type": "pbkdf2", "keyslots": ["1"], "segments": [], "hash": "sha256",
      "iterations": 50257, "salt": "AA==", "digest": "AA=="}
  },
  "config": {"json_size": "12288", "keyslots_size": "16744448",
         "requirements": {"mandatory": ["online-reencrypt-v2"]}}
}"#,
    )
    .unwrap()
}

/// A backward decryption: the position read from cryptsetup's segments, the hotzone
/// before the done part, and the segments and digest lists rebuilt to the byte.
#[test]
fn backward_decryption_reproduces_cryptsetups_layout() {
    const DATA_200M: u64 = 200 * MIB;
    let m = decrypt_crash();
    let mut st = state(&m);
    assert_eq!(st.keyslot.direction, Direction::Backward);
    let pos = position(&m, &st, DATA_200M).unwrap();
    let done = DATA_200M - 130023424;
    assert_eq!(
        pos,
        Position {
            done,
            hotzone: Some(4 * MIB)
        }
    );
    assert_eq!(hotzone_offset(&st, pos, 4 * MIB, DATA_200M), 120 * MIB);
    let mut rebuilt = m.clone();
    set_segments(
        &mut rebuilt,
        &mut st,
        Position {
            done: 0,
            hotzone: None,
        },
        DATA_200M,
    )
    .unwrap();
    assert_eq!(rebuilt.segments.len(), 3);
    set_segments(&mut rebuilt, &mut st, pos, DATA_200M).unwrap();
    assert_eq!(
        serde_json::to_value(&rebuilt.segments).unwrap(),
        serde_json::to_value(&m.segments).unwrap()
    );
    assert_eq!(digest_lists(&rebuilt), digest_lists(&m));
    // The next hotzone after this one ends where the done part begins.
    let after = Position {
        done: done + 4 * MIB,
        hotzone: None,
    };
    // The 120 MiB left are fewer than the checksum blocks the area protects: one last
    // hotzone, whole, whatever the hotzone size ([`last_backward_hotzone`]).
    let steps = next_hotzone_in_place(&st, after, DATA_200M, 4 * MIB, 4096)
        .unwrap()
        .unwrap();
    assert_eq!(
        steps[0],
        Step::ReadOld {
            offset: 0,
            len: 120 * MIB
        }
    );
    assert_eq!(steps.last(), Some(&Step::Finalise));
    // Finalising leaves one linear segment and no keyslot or digest.
    finalise(&mut rebuilt, &st).unwrap();
    assert_eq!(rebuilt.segments["0"].kind.as_str(), "linear");
    assert!(rebuilt.keyslots.is_empty());
    assert!(rebuilt.digests.is_empty());
    assert!(rebuilt.config.requirements.is_none());
}

/// The hotzones (offset, length) of a whole backward walk of `data` bytes.
fn walk(st: &ReencryptState, data: u64, hot_max: u64) -> Vec<(u64, u64)> {
    let mut pos = Position {
        done: 0,
        hotzone: None,
    };
    let mut out = Vec::new();
    while let Some(steps) = next_hotzone_in_place(st, pos, data, hot_max, 4096).unwrap() {
        let Step::ReadOld { offset, len } = steps[0] else {
            panic!("a hotzone starts with its read: {steps:?}")
        };
        out.push((offset, len));
        if steps.last() == Some(&Step::Finalise) {
            break;
        }
        pos.done += len;
    }
    out
}

/// A backward walk leaves for its last hotzone the length cryptsetup 2.6.1's repair counts
/// as done: the journal area, or the checksum blocks the area protects up to 1 GiB (or
/// what is left); the others keep the hotzone size.
#[test]
fn backward_walk_leaves_cryptsetups_length_for_its_last_hotzone() {
    let checksum = decrypt_crash();
    let mut journal = serde_json::to_value(&checksum).unwrap();
    let reenc_area = &mut journal["keyslots"]["1"]["area"];
    reenc_area["type"] = "journal".into();
    for k in ["hash", "sector_size"] {
        reenc_area.as_object_mut().unwrap().remove(k);
    }
    let journal: Metadata = serde_json::from_value(journal).unwrap();
    let area = 16486400;
    let st = state(&journal);
    assert_eq!(st.keyslot.resilience, Resilience::Journal);
    let zones = walk(&st, 40 * MIB, MIB);
    assert_eq!(zones.last(), Some(&(0, area)), "the last one: the area");
    // Whole hotzones from the end, then what is left above the last one.
    let n = zones.len();
    assert!(zones[..n - 2].iter().all(|z| z.1 == MIB), "{zones:?}");
    assert_eq!(zones[n - 2], (area, 40 * MIB - area - (n as u64 - 2) * MIB));
    assert_eq!(zones.iter().map(|z| z.1).sum::<u64>(), 40 * MIB);
    assert_eq!(last_backward_hotzone(&st, 40 * MIB, 4096).unwrap(), area);
    // Less data than the area: one hotzone.
    assert_eq!(walk(&st, 8 * MIB, MIB), vec![(0, 8 * MIB)]);
    // Checksums of 4 KiB blocks: the area protects 2 GiB, cryptsetup cuts 1 GiB.
    let st = state(&checksum);
    let zones = walk(&st, 1536 * MIB, 64 * MIB);
    assert_eq!(zones.len(), 9);
    assert_eq!(zones.last(), Some(&(0, 1024 * MIB)));
    assert_eq!(zones[0], (1472 * MIB, 64 * MIB));
    // Forward walks are cut as before.
    let mut fwd = state(&journal);
    fwd.keyslot.direction = Direction::Forward;
    assert_eq!(last_backward_hotzone(&fwd, 40 * MIB, 4096).unwrap(), 0);
    assert!(walk(&fwd, 40 * MIB, MIB).iter().all(|z| z.1 == MIB));
}

/// The metadata cryptsetup 2.6.1 left when SIGKILLed inside a hotzone of `reencrypt
/// --encrypt --reduce-device-size 32M` on a 300 MiB file (D = 268 MiB of data, S = 16 MiB;
/// salts and digests left out).
fn shift_crash() -> Metadata {
    serde_json::from_str(
        r#"{"keyslots": {"0": {"type": "luks2", "key_size": 64,
  "af": {"type": "luks1", "stripes": 4000, "hash": "sha256"},
  "area": {"type": "raw", "offset": "32768", "size": "258048", "encryption": "aes-xts-plain64",
       "key_size": 64},
  "kdf": {"type": "pbkdf2", "hash": "sha256", "iterations": 1000, "salt": "AA=="}},
 "1": {"area": {"offset": "290816", "size": "4096", "type": "datashift",
            "shift_size": "16777216"},
   "type": "reencrypt", "key_size": 1, "mode": "encrypt", "direction": "backward",
   "priority": 0}},
 "tokens": {},
 "segments": {
  "0": {"type": "linear", "offset": "297795584", "size": "16777216"},
  "1": {"type": "linear", "offset": "16777216", "size": "197132288"},
  "2": {"type": "crypt", "offset": "230686720", "size": "16777216", "iv_tweak": "417792",
    "encryption": "aes-xts-plain64", "sector_size": 512, "flags": ["in-reencryption"]},
  "3": {"type": "crypt", "offset": "247463936", "size": "50331648", "iv_tweak": "450560",
    "encryption": "aes-xts-plain64", "sector_size": 512},
  "4": {"type": "linear", "offset": "0", "size": "281018368", "flags": ["backup-previous"]},
  "5": {"type": "crypt", "offset": "16777216", "size": "dynamic", "iv_tweak": "0",
    "encryption": "aes-xts-plain64", "sector_size": 512, "flags": ["backup-final"]},
  "6": {"type": "linear", "offset": "297795584", "size": "16777216",
    "flags": ["backup-moved-segment"]}},
 "digests": {
  "0": {"type": "pbkdf2", "keyslots": ["0"], "segments": ["5", "2", "3"], "hash": "sha256",
    "iterations": 1000, "salt": "AA==", "digest": "AA=="},
  "1": {"type": "pbkdf2", "keyslots": ["1"], "segments": [], "hash": "sha256",
    "iterations": 1000, "salt": "AA==", "digest": "AA=="}},
 "config": {"json_size": "12288", "keyslots_size": "16744448",
        "requirements": {"mandatory": ["online-reencrypt-v2"]}}}"#,
    )
    .unwrap()
}

const SHIFT: u64 = 16 * MIB;
const SHIFT_DATA: u64 = 268 * MIB;

/// The geometry, position and layout of cryptsetup's datashift crash, rebuilt to the byte
/// (segments, backup ids, digest lists) from another position.
#[test]
fn datashift_reproduces_cryptsetups_layout() {
    let m = shift_crash();
    let mut st = state(&m);
    let sh = shift_geometry(&m, &st).unwrap().unwrap();
    assert_eq!(
        sh,
        Shift {
            shift_bytes: SHIFT,
            old_offset: 0,
            new_offset: SHIFT,
            moved_offset: 284 * MIB,
            data_bytes: SHIFT_DATA,
        }
    );
    let pos = position(&m, &st, SHIFT_DATA).unwrap();
    // Hotzone [204, 220) MiB of data (at 220 MiB on the device), done [220, 268) MiB.
    assert_eq!(
        pos,
        Position {
            done: 48 * MIB,
            hotzone: Some(SHIFT)
        }
    );
    assert_eq!(hotzone_offset(&st, pos, SHIFT, SHIFT_DATA), 204 * MIB);
    check_layout(&m, &st, SHIFT_DATA).unwrap();
    let mut rebuilt = m.clone();
    let start = Position {
        done: 0,
        hotzone: None,
    };
    set_segments(&mut rebuilt, &mut st, start, SHIFT_DATA).unwrap();
    // The start: moved segment, the rest at its place, three backups.
    assert_eq!(rebuilt.segments.len(), 5);
    assert_eq!(rebuilt.segments["1"].offset.0, SHIFT);
    assert_eq!(
        rebuilt.segments["1"].size,
        SegmentSize::Bytes(SHIFT_DATA - SHIFT)
    );
    set_segments(&mut rebuilt, &mut st, pos, SHIFT_DATA).unwrap();
    assert_eq!(
        serde_json::to_value(&rebuilt.segments).unwrap(),
        serde_json::to_value(&m.segments).unwrap()
    );
    assert_eq!(digest_lists(&rebuilt), digest_lists(&m));
    assert_eq!(st, state(&m));
    // Inside a hotzone: recovery first.
    assert!(next_hotzone_shift(&sh, pos, 512).is_err());
}

/// The walk cryptsetup 2.6.1 takes (seen with --debug on 68 MiB of data shifted by 16
/// MiB: hotzones at 52, 36, 20 MiB of 16 MiB, then 16 MiB of 4 MiB, then 0 from the moved
/// segment), each hotzone's steps, and finalisation to one dynamic crypt segment with the
/// moved segment's area to wipe.
#[test]
fn datashift_walks_as_cryptsetup() {
    let sh = Shift {
        shift_bytes: SHIFT,
        old_offset: 0,
        new_offset: SHIFT,
        moved_offset: 84 * MIB,
        data_bytes: 68 * MIB,
    };
    let mut pos = Position {
        done: 0,
        hotzone: None,
    };
    let mut walk = Vec::new();
    while let Some(steps) = next_hotzone_shift(&sh, pos, 4096).unwrap() {
        let Step::MoveNew { from, offset, len } = steps[1] else {
            panic!("{steps:?}")
        };
        assert_eq!(
            steps[0],
            Step::CommitSegments(Position {
                done: pos.done,
                hotzone: Some(len)
            })
        );
        assert_eq!(steps[2], Step::SyncData);
        walk.push((offset / MIB, len / MIB, from / MIB));
        match steps[3] {
            Step::CommitSegments(p) => pos = p,
            Step::Finalise => break,
            ref s => panic!("{s:?}"),
        }
    }
    assert_eq!(
        walk,
        vec![
            (52, 16, 52),
            (36, 16, 36),
            (20, 16, 20),
            (16, 4, 16),
            (0, 16, 84)
        ]
    );
    let mut m = shift_crash();
    let mut st = state(&m);
    let done = Position {
        done: SHIFT_DATA,
        hotzone: None,
    };
    set_segments(&mut m, &mut st, done, SHIFT_DATA).unwrap();
    assert_eq!(m.segments["0"].size, SegmentSize::Dynamic);
    assert_eq!(m.segments["0"].offset.0, SHIFT);
    assert_eq!(position(&m, &st, SHIFT_DATA).unwrap(), done);
    let retired = finalise(&mut m, &st).unwrap();
    assert_eq!(retired.data_areas, vec![(284 * MIB, SHIFT)]);
    assert_eq!(m.segments.len(), 1);
    assert!(m.config.requirements.is_none());
}

/// Each relation of the shift is checked by name.
#[test]
fn datashift_geometry_is_checked() {
    let check = |f: &dyn Fn(&mut Metadata)| {
        let mut m = shift_crash();
        f(&mut m);
        let st = state(&m);
        match shift_geometry(&m, &st) {
            Err(Error::BadHeader { check, .. }) => check,
            r => panic!("{r:?}"),
        }
    };
    let set = |m: &mut Metadata, id: &str, off: Option<u64>, size: Option<u64>| {
        let s = m.segments.get_mut(id).unwrap();
        if let Some(o) = off {
            s.offset = U64Str(o);
        }
        if let Some(n) = size {
            s.size = SegmentSize::Bytes(n);
        }
    };
    // Moved segment smaller than the shift.
    assert_eq!(
        check(&|m| set(m, "6", None, Some(8 * MIB))),
        "reencrypt-datashift"
    );
    // The new offset is not old + shift.
    assert_eq!(
        check(&|m| set(m, "5", Some(8 * MIB), None)),
        "reencrypt-datashift"
    );
    // The moved segment inside what the hotzones write.
    assert_eq!(
        check(&|m| set(m, "6", Some(200 * MIB), None)),
        "reencrypt-datashift"
    );
    // Less than one shift of data.
    assert_eq!(
        check(&|m| set(m, "4", None, Some(8 * MIB))),
        "reencrypt-datashift"
    );
}

// ------------------------------------------------------------ decryption moving the data

/// The data of the volume cryptsetup 2.6.1 decrypted for the stored states: 256 MiB with
/// the header in front (data offset 16 MiB).
const UNSHIFT_DATA: u64 = 240 * MIB;

/// cryptsetup 2.6.1's exported header after `reencrypt --decrypt --header NEW.hdr
/// --init-only` of that volume.
fn unshift_init() -> Metadata {
    Metadata::parse(include_bytes!(
        "../../../../tests/data/reencrypt-unshift-init.json"
    ))
    .unwrap()
}

/// The segments and the old key's digest list of every state cryptsetup 2.6.1 committed
/// while it ran that decryption (read from the exported header while the process was
/// stopped between its writes, after every header write): (seqid, metadata).
fn unshift_states() -> Vec<(u64, Metadata)> {
    let v: serde_json::Value = serde_json::from_slice(include_bytes!(
        "../../../../tests/data/reencrypt-unshift-states.json"
    ))
    .unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|st| {
            let mut m = unshift_init();
            m.segments = serde_json::from_value(st["segments"].clone()).unwrap();
            let d = &st["digest_segments"];
            m.digests.get_mut("0").unwrap().segments =
                serde_json::from_value(d["0"].clone()).unwrap_or_default();
            (st["seqid"].as_u64().unwrap(), m)
        })
        .collect()
}

fn unshift_snapshot(m: &Metadata) -> (serde_json::Value, Vec<String>) {
    (
        serde_json::to_value(&m.segments).unwrap(),
        m.digests["0"].segments.clone(),
    )
}

#[test]
fn unshift_geometry_of_cryptsetups_init() {
    let m = unshift_init();
    let st = state(&m);
    assert_eq!(st.version, UNSHIFT_REQUIREMENT_VERSION);
    assert!(matches!(
        check_supported(&st).unwrap(),
        Protect::Unshift(MovedGuard::Checksum {
            hash: HashAlg::Sha256,
            block: 4096
        })
    ));
    let u = unshift_geometry(&m, &st, UNSHIFT_DATA).unwrap().unwrap();
    assert_eq!(
        u,
        Unshift {
            shift_bytes: 16 * MIB,
            old_offset: 16 * MIB,
            new_offset: 0,
            moved_bytes: 16 * MIB,
            data_bytes: UNSHIFT_DATA,
        }
    );
    assert_eq!(
        position(&m, &st, UNSHIFT_DATA).unwrap(),
        Position {
            done: 0,
            hotzone: None
        }
    );
    check_layout(&m, &st, UNSHIFT_DATA).unwrap();
    // Not a plain data shift, nor a reencryption in place.
    assert_eq!(shift_geometry(&m, &st).unwrap(), None);
    assert!(next_hotzone_in_place(
        &st,
        Position {
            done: 0,
            hotzone: None
        },
        UNSHIFT_DATA,
        MIB,
        4096
    )
    .is_err());
}

/// Every state cryptsetup committed (between and inside each hotzone, the moved segment's
/// hotzone, and all done before finalisation) is read back to a position, passes the
/// layout check, and is rebuilt from that position to the byte of its segments and digest
/// list; and the planner's own walk from the init commits exactly cryptsetup's sequence.
#[test]
fn unshift_walk_reproduces_cryptsetups_states() {
    let init = unshift_init();
    let st0 = state(&init);
    let u = unshift_geometry(&init, &st0, UNSHIFT_DATA)
        .unwrap()
        .unwrap();
    let mut theirs = Vec::new();
    for (seqid, m) in unshift_states() {
        // The first two are the init (seqid 4) and the reencryption digest cryptsetup
        // writes again when it resumes (5); the last, the finalised header.
        if !(6..=35).contains(&seqid) {
            continue;
        }
        let st = state(&m);
        let pos = position(&m, &st, UNSHIFT_DATA).unwrap_or_else(|e| panic!("seqid {seqid}: {e}"));
        check_layout(&m, &st, UNSHIFT_DATA).unwrap_or_else(|e| panic!("seqid {seqid}: {e}"));
        let mut rebuilt = init.clone();
        let mut st1 = st0.clone();
        set_segments(&mut rebuilt, &mut st1, pos, UNSHIFT_DATA).unwrap();
        assert_eq!(
            unshift_snapshot(&rebuilt),
            unshift_snapshot(&m),
            "seqid {seqid} at {pos:?}"
        );
        assert_eq!(st1, st, "seqid {seqid}");
        theirs.push((pos, unshift_snapshot(&m)));
    }
    assert_eq!(theirs.len(), 30);
    // The planner's walk: each commit as cryptsetup's, in order.
    let (mut meta, mut st) = (init.clone(), st0.clone());
    let mut pos = position(&meta, &st, UNSHIFT_DATA).unwrap();
    let mut mine = Vec::new();
    let mut walk = Vec::new();
    'walk: while let Some(steps) = next_hotzone_unshift(&st, &u, pos, 4096).unwrap() {
        for step in steps {
            match step {
                Step::CommitSegments(p) => {
                    set_segments(&mut meta, &mut st, p, UNSHIFT_DATA).unwrap();
                    pos = p;
                    mine.push((p, unshift_snapshot(&meta)));
                }
                Step::MoveNew { from, offset, len } => {
                    assert_eq!(from, offset + 16 * MIB);
                    walk.push((offset / MIB, len / MIB));
                }
                Step::ReadAt { from, offset, len } => {
                    assert_eq!((from, offset, len), (0, 0, 16 * MIB));
                    walk.push((0, len / MIB));
                }
                Step::WriteChecksums { area_offset, .. } => {
                    assert_eq!(area_offset, 290816)
                }
                Step::Finalise => break 'walk,
                _ => {}
            }
        }
    }
    let want_walk: Vec<(u64, u64)> = (1..15).map(|i| (i * 16, 16)).chain([(0, 16)]).collect();
    assert_eq!(walk, want_walk);
    // cryptsetup commits "all done" once more before finalising; the planner finalises
    // at once (a header left there finalises on resume: next below).
    assert_eq!(mine.len(), theirs.len() - 1);
    for (i, (m, t)) in mine.iter().zip(&theirs).enumerate() {
        assert_eq!(m, t, "commit {i}");
    }
    let (done, _) = &theirs[theirs.len() - 1];
    assert_eq!(
        *done,
        Position {
            done: UNSHIFT_DATA,
            hotzone: None
        }
    );
    assert_eq!(next_hotzone_unshift(&st, &u, *done, 4096).unwrap(), None);
    // Finalisation: one linear segment, no keyslot, the stale tail to wipe.
    let mut m = meta.clone();
    set_segments(&mut m, &mut st, *done, UNSHIFT_DATA).unwrap();
    let retired = finalise(&mut m, &st).unwrap();
    assert_eq!(retired.keyslots, vec![0, 1]);
    assert_eq!(m.segments.len(), 1);
    assert_eq!(m.segments["0"].kind.as_str(), "linear");
    assert!(m.keyslots.is_empty() && m.digests.is_empty());
    assert!(m.config.requirements.is_none());
    assert_eq!(u.tail(), (UNSHIFT_DATA, 16 * MIB));
}

/// A moved segment smaller than the shift (`--hotzone-size`): the walk starts after it and
/// still moves whole shifts, the last hotzone shortened, then the moved segment.
#[test]
fn unshift_walk_with_a_small_moved_segment() {
    let u = Unshift {
        shift_bytes: 16 * MIB,
        old_offset: 16 * MIB,
        new_offset: 0,
        moved_bytes: MIB,
        data_bytes: 48 * MIB,
    };
    let st = state(&unshift_init());
    let mut pos = Position {
        done: 0,
        hotzone: None,
    };
    let mut walk = Vec::new();
    while let Some(steps) = next_hotzone_unshift(&st, &u, pos, 4096).unwrap() {
        let Step::CommitSegments(Position {
            hotzone: Some(len), ..
        }) = steps
            .iter()
            .find(|s| matches!(s, Step::CommitSegments(_)))
            .unwrap()
        else {
            panic!("{steps:?}")
        };
        walk.push((u.hotzone_offset(pos.done) / MIB, len / MIB));
        match steps.last().unwrap() {
            Step::CommitSegments(p) => pos = *p,
            _ => break,
        }
    }
    assert_eq!(walk, vec![(1, 16), (17, 16), (33, 15), (0, 1)]);
}

/// Each relation of a decryption that moves the data is checked by name.
#[test]
fn unshift_geometry_is_checked() {
    let check = |f: &dyn Fn(&mut Metadata)| {
        let mut m = unshift_init();
        f(&mut m);
        match ReencryptState::from_metadata(&m)
            .and_then(|st| unshift_geometry(&m, &st.unwrap(), UNSHIFT_DATA))
        {
            Err(Error::BadHeader { check, .. }) => check,
            r => panic!("{r:?}"),
        }
    };
    let seg = |m: &mut Metadata, id: &str| m.segments.get_mut(id).unwrap().clone();
    let put = |m: &mut Metadata, id: &str, s: Segment| {
        m.segments.insert(id.into(), s);
    };
    // Moved segment larger than the shift.
    assert_eq!(
        check(&|m| {
            let mut s = seg(m, "2");
            s.size = SegmentSize::Bytes(32 * MIB);
            put(m, "2", s)
        }),
        "reencrypt-datashift"
    );
    // Moved segment away from the new data offset.
    assert_eq!(
        check(&|m| {
            let mut s = seg(m, "2");
            s.offset = U64Str(4096);
            put(m, "2", s)
        }),
        "reencrypt-datashift"
    );
    // The shift is not the distance between the data offsets.
    assert_eq!(
        check(&|m| {
            let mut s = seg(m, "3");
            s.offset = U64Str(8 * MIB);
            put(m, "3", s)
        }),
        "reencrypt-datashift"
    );
    // The moved segment under another cipher.
    assert_eq!(
        check(&|m| {
            let mut s = seg(m, "2");
            s.encryption = Some("aes-cbc-essiv:sha256".into());
            put(m, "2", s)
        }),
        "reencrypt-datashift"
    );
    // A non-zero IV tweak of the data.
    assert_eq!(
        check(&|m| {
            let mut s = seg(m, "3");
            s.iv_tweak = Some(U64Str(8));
            put(m, "3", s)
        }),
        "reencrypt-datashift"
    );
    // datashift-checksum under the v2 requirement.
    assert_eq!(
        check(&|m| {
            m.config.requirements.as_mut().unwrap().mandatory =
                Some(vec!["online-reencrypt-v2".into()]);
        }),
        "reencrypt-datashift"
    );
    // Checksums of the moved segment that do not fit the area.
    assert_eq!(
        check(&|m| {
            m.keyslots.get_mut("1").unwrap().area.as_mut().unwrap().size = U64Str(4096);
        }),
        "reencrypt-datashift"
    );
}

/// A rotation that moves the data walks back from the end in hotzones of the shift, the last
/// one what is left, each moved from its old place to a shift above it; the last finalises.
#[test]
fn relocation_walks_back_in_hotzones_of_the_shift() {
    use super::relocate::{next_hotzone_relocate, Relocate};
    const MIB: u64 = 1 << 20;
    let r = Relocate {
        shift_bytes: 8 * MIB,
        old_offset: 16 * MIB,
        new_offset: 24 * MIB,
    };
    let data = 20 * MIB;
    let mut pos = Position {
        done: 0,
        hotzone: None,
    };
    let mut walked = Vec::new();
    while let Some(steps) = next_hotzone_relocate(&r, pos, data, 4096).unwrap() {
        let [Step::CommitSegments(hot), Step::MoveNew { from, offset, len }, Step::SyncData, last] =
            &steps[..]
        else {
            panic!("steps {steps:?}");
        };
        assert_eq!(hot.hotzone, Some(*len));
        assert_eq!(*from, r.old_offset + offset, "read at its old place");
        assert!(*len <= r.shift_bytes, "a hotzone overlaps its source");
        walked.push((*offset / MIB, *len / MIB));
        pos.done += len;
        assert_eq!(
            *last == Step::Finalise,
            pos.done == data,
            "only the last finalises"
        );
    }
    assert_eq!(walked, [(12, 8), (4, 8), (0, 4)]);
    // Inside a hotzone: recover first.
    let inside = Position {
        done: 8 * MIB,
        hotzone: Some(8 * MIB),
    };
    assert!(next_hotzone_relocate(&r, inside, data, 4096).is_err());
}
