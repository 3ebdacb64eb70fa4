//! `reencrypt --device-size SIZE` beside cryptsetup 2.6.1 on the same volume: only the first
//! SIZE bytes of the data area are reencrypted, the rest keeps its old ciphertext, and the
//! header ends as a whole reencryption leaves it (one `dynamic` segment under the new key):
//! both tools' metadata alike, the first SIZE bytes reading back as written, the rest
//! untouched on the disk. A run of one tool killed partway leaves the bound in the header
//! (the segment after the hotzone fixed at SIZE), which the other repairs and finishes
//! when asked for the same `--device-size` (another one is refused); resumed without it,
//! both walk on to the end of the data area. The checks both tools make (a size past the
//! data, not a whole number of sectors, with `--reduce-device-size`) give the same exit
//! codes, and leave the metadata as it was (ucrypt writes nothing at all).
//!
//! Needs `cryptsetup` (Debian package cryptsetup-bin); SKIPPED without it.

#[path = "../../../tests/kit/mod.rs"]
mod kit;
mod reencrypt_common;

use std::process::Command;
use std::time::Duration;

use kit::cryptsetup as cs;
use kit::{kill_when, ok, run, text, Poll, TempDir};
use reencrypt_common::*;

/// The volume: 40 MiB, of which 24 MiB of data after cryptsetup's 16 MiB header.
const VOLUME_MIB: u64 = 40;
/// `--device-size`: the first 8 MiB of the data.
const BOUND: &str = "8M";
const BOUND_BYTES: usize = 8 << 20;
/// Eight hotzones in the bound, so that a kill lands inside the walk.
const HOTZONE: &str = "1M";

/// The volume's bytes past the bound, as they are on the disk.
fn tail(vol: &Vol) -> Vec<u8> {
    vol.raw()[DATA_OFFSET as usize + BOUND_BYTES..].to_vec()
}

/// What a finished bounded run must leave: the header as cryptsetup reads it after a whole
/// reencryption, the first `BOUND` bytes of plaintext intact, the rest as it was on the disk.
fn bounded_and_finished(vol: &Vol, t: &TempDir, tail_before: &[u8], what: &str) {
    assert!(!vol.in_reencryption(), "{what}: still in reencryption");
    let o = vol.cryptsetup_opens();
    assert!(o.status.success(), "{what}: cryptsetup: {}", text(&o));
    let got = vol.exported(t);
    assert!(
        got[..BOUND_BYTES] == vol.plain[..BOUND_BYTES],
        "{what}: the first {BOUND}: {}",
        differences(&got[..BOUND_BYTES], &vol.plain[..BOUND_BYTES])
    );
    assert!(
        tail(vol) == tail_before,
        "{what}: the data past {BOUND} was written"
    );
}

#[test]
fn device_size_reencrypts_the_first_bytes_as_cryptsetup_does() {
    if !cs::require() {
        return;
    }
    for sector in SECTORS {
        let t = TempDir::new("device-size");
        let vol = Rotate.volume(&t, VOLUME_MIB, *sector);
        let before = tail(&vol);
        let mut finished = Vec::new();
        for tool in [Cryptsetup, Ucrypt] {
            let v = vol.copy(&t, &format!("{tool:?}"));
            let a = v.reencrypt(tool, &["--device-size", BOUND, "--hotzone-size", HOTZONE]);
            ok(tool.prog(), &a);
            let what = format!("{tool:?}, {sector}-byte sectors");
            bounded_and_finished(&v, &t, &before, &what);
            finished.push((what, metadata(v.meta())));
        }
        assert_eq!(
            finished[0].1, finished[1].1,
            "{} and {}: the metadata",
            finished[0].0, finished[1].0
        );
    }
}

/// Whether the header's first copy is past its first hotzone: a live segment of fixed size
/// after one in reencryption, or a new one before it.
fn past_first_hotzone(hdr: &std::path::Path) -> bool {
    json_raw(hdr).is_some_and(|v| v["segments"].get("1").is_some_and(in_reencryption_flag))
}

/// Runs `tool`'s reencryption of `vol` bounded at `BOUND` and SIGKILLs it once past its first
/// hotzone: whether it was still running.
fn bounded_run_killed(tool: Tool, vol: &Vol) -> bool {
    let mut cmd = Command::new(tool.prog());
    cmd.args(vol.reencrypt(tool, &["--device-size", BOUND, "--hotzone-size", HOTZONE]));
    kill_when(
        cmd,
        || past_first_hotzone(vol.meta()),
        Poll::Spin,
        Duration::ZERO,
    )
}

#[test]
fn a_bounded_run_killed_partway_is_finished_by_the_other_tool() {
    if !cs::require() {
        return;
    }
    for first in [Cryptsetup, Ucrypt] {
        let t = TempDir::new("device-size-kill");
        let vol = Rotate.volume(&t, VOLUME_MIB, 4096);
        let before = tail(&vol);
        let killed = bounded_run_killed(first, &vol);
        let what = format!("{first:?} killed, {:?} finishes", first.other());
        if !killed || !vol.in_reencryption() {
            println!("{what}: the run ended before the kill; nothing to finish");
            bounded_and_finished(&vol, &t, &before, &what);
            continue;
        }
        // The bound is in the header: the live segments are all of fixed size.
        let v = json_raw(vol.meta()).expect("header");
        let live: Vec<_> = v["segments"]
            .as_object()
            .expect("segments")
            .values()
            .filter(|s| {
                !s["flags"].as_array().is_some_and(|f| {
                    f.iter()
                        .any(|f| f.as_str().unwrap_or("").starts_with("backup-"))
                })
            })
            .collect();
        assert!(
            live.iter().all(|s| s["size"] != "dynamic"),
            "{what}: a live segment is dynamic: {live:?}"
        );
        let other = first.other();
        if vol.in_hotzone() {
            vol.repair(other);
        }
        // Resumed with its bound (without it, both walk on to the end: see below).
        ok(other.prog(), &vol.resume(other, &["--device-size", BOUND]));
        bounded_and_finished(&vol, &t, &before, &what);
    }
}

/// A bounded run resumed without `--device-size` walks on to the end of the data area, as
/// cryptsetup's `--resume-only` does: each tool is killed partway through a bounded run, and
/// each resumes a copy without the option; both must leave the same metadata and the same
/// bytes on the disk, the whole data area reading back as written.
#[test]
fn a_bounded_run_resumed_without_device_size_walks_to_the_end() {
    if !cs::require() {
        return;
    }
    for first in [Cryptsetup, Ucrypt] {
        let t = TempDir::new("device-size-resume");
        let vol = Rotate.volume(&t, VOLUME_MIB, 4096);
        let killed = bounded_run_killed(first, &vol);
        if !killed || !vol.in_reencryption() {
            println!("{first:?} ended before the kill; nothing to resume");
            continue;
        }
        if vol.in_hotzone() {
            vol.repair(first);
        }
        let mut done = Vec::new();
        for tool in [Cryptsetup, Ucrypt] {
            let v = vol.copy(&t, &format!("{tool:?}"));
            ok(tool.prog(), &v.resume(tool, &[]));
            let what = format!("{first:?} killed, {tool:?} resumes");
            assert!(!v.in_reencryption(), "{what}: still in reencryption");
            let got = v.exported(&t);
            assert!(
                got == v.plain,
                "{what}: the data area: {}",
                differences(&got, &v.plain)
            );
            done.push((metadata(v.meta()), v.raw()[DATA_OFFSET as usize..].to_vec()));
        }
        assert_eq!(done[0].0, done[1].0, "{first:?} killed: the metadata");
        assert!(
            done[0].1 == done[1].1,
            "{first:?} killed: the data area's bytes"
        );
    }
}

#[test]
fn device_size_checks_give_cryptsetups_exit_codes() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("device-size-checks");
    let vol = Rotate.volume(&t, VOLUME_MIB, 4096);
    let cases: &[(&str, &[&str])] = &[
        ("past the data", &["--device-size", "32M"]),
        ("not a whole 4096-byte sector", &["--device-size", "4608"]),
        ("not a multiple of 512", &["--device-size", "1000"]),
        ("zero", &["--device-size", "0"]),
        (
            "with --reduce-device-size",
            &["--device-size", "8M", "--reduce-device-size", "32M"],
        ),
    ];
    for (what, extra) in cases {
        let mut codes = Vec::new();
        for tool in [Cryptsetup, Ucrypt] {
            let v = vol.copy(&t, &format!("{tool:?}"));
            let (before, meta_before) = (v.raw(), metadata(v.meta()));
            let o = run(tool.prog(), &v.reencrypt(tool, extra));
            // cryptsetup adds the new keyslot before its checks and removes it after; ucrypt
            // checks before it writes anything.
            assert_eq!(
                metadata(v.meta()),
                meta_before,
                "{what}: {tool:?} left metadata"
            );
            if tool == Ucrypt {
                assert!(v.raw() == before, "{what}: ucrypt wrote the volume");
            }
            codes.push((o.status.code(), text(&o)));
        }
        assert_eq!(
            codes[0].0, codes[1].0,
            "{what}: cryptsetup's exit code ({}), then ucrypt's ({})",
            codes[0].1, codes[1].1
        );
        assert_ne!(codes[0].0, Some(0), "{what}: cryptsetup took it");
    }
}
