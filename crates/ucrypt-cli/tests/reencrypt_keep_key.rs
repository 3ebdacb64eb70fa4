//! `reencrypt --keep-key` beside cryptsetup 2.6.1 on the same volume: the data reencrypted
//! to a new cipher or sector size under the volume key it has (no new keyslot: the key's
//! digest covers the old and the new segments, and the keyslot that opened it stays). Both
//! tools' `--init-only` and finished metadata alike, the plaintext intact, the volume key the
//! same before and after; a run of one tool killed partway is repaired and finished by the
//! other; `--keep-key` that changes nothing is refused by both.
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

const VOLUME_MIB: u64 = 40;

/// The volume key, as cryptsetup dumps it.
fn volume_key(vol: &Vol) -> String {
    let mut a = vec!["luksDump", "--dump-volume-key", "-q"];
    a.extend(vol.tail());
    let out = cs::ok(&a);
    out.lines()
        .skip_while(|l| !l.starts_with("MK dump:"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The changes `--keep-key` is tried with.
const CHANGES: &[(&str, &[&str])] = &[
    ("sector size 512 to 4096", &["--sector-size", "4096"]),
    ("cipher to aes-xts-plain", &["--cipher", "aes-xts-plain"]),
];

#[test]
fn keep_key_reencrypts_as_cryptsetup_does() {
    if !cs::require() {
        return;
    }
    for (what, change) in CHANGES {
        let t = TempDir::new("keep-key");
        let vol = Rotate.volume(&t, VOLUME_MIB, 512);
        let vk = volume_key(&vol);
        let mut inits = Vec::new();
        let mut finished = Vec::new();
        for tool in [Cryptsetup, Ucrypt] {
            let mut extra = vec!["--keep-key", "--hotzone-size", "1M"];
            extra.extend(*change);
            let v = vol.copy(&t, &format!("init-{tool:?}"));
            let mut init = extra.clone();
            init.push("--init-only");
            ok(tool.prog(), &v.reencrypt(tool, &init));
            inits.push(metadata(v.meta()));
            let v = vol.copy(&t, &format!("{tool:?}"));
            ok(tool.prog(), &v.reencrypt(tool, &extra));
            let how = format!("{what}, {tool:?}");
            assert!(!v.in_reencryption(), "{how}: still in reencryption");
            let o = v.cryptsetup_opens();
            assert!(o.status.success(), "{how}: cryptsetup: {}", text(&o));
            assert!(v.exported(&t) == vol.plain, "{how}: the plaintext");
            assert_eq!(volume_key(&v), vk, "{how}: the volume key changed");
            finished.push(metadata(v.meta()));
        }
        assert_eq!(
            inits[0], inits[1],
            "{what}: --init-only, cryptsetup then ucrypt"
        );
        assert_eq!(
            finished[0], finished[1],
            "{what}: finished, cryptsetup then ucrypt"
        );
    }
}

#[test]
fn a_keep_key_run_killed_partway_is_finished_by_the_other_tool() {
    if !cs::require() {
        return;
    }
    for first in [Cryptsetup, Ucrypt] {
        let t = TempDir::new("keep-key-kill");
        let vol = Rotate.volume(&t, VOLUME_MIB, 512);
        let vk = volume_key(&vol);
        let mut cmd = Command::new(first.prog());
        cmd.args(vol.reencrypt(
            first,
            &[
                "--keep-key",
                "--sector-size",
                "4096",
                "--hotzone-size",
                "1M",
            ],
        ));
        // Killed once a hotzone past the first is under way.
        let past_first = || {
            json_raw(vol.meta())
                .is_some_and(|v| v["segments"].get("1").is_some_and(in_reencryption_flag))
        };
        let killed = kill_when(cmd, past_first, Poll::Spin, Duration::ZERO);
        let what = format!("{first:?} killed, {:?} finishes", first.other());
        let other = first.other();
        if killed && vol.in_reencryption() {
            if vol.in_hotzone() {
                vol.repair(other);
            }
            ok(other.prog(), &vol.resume(other, &[]));
        } else {
            println!("{what}: the run ended before the kill");
        }
        assert!(!vol.in_reencryption(), "{what}: still in reencryption");
        assert!(vol.exported(&t) == vol.plain, "{what}: the plaintext");
        assert_eq!(volume_key(&vol), vk, "{what}: the volume key changed");
    }
}

#[test]
fn keep_key_that_changes_nothing_is_refused_by_both() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("keep-key-nothing");
    let vol = Rotate.volume(&t, VOLUME_MIB, 512);
    for tool in [Cryptsetup, Ucrypt] {
        let v = vol.copy(&t, &format!("{tool:?}"));
        let before = v.raw();
        let o = run(tool.prog(), &v.reencrypt(tool, &["--keep-key"]));
        assert_eq!(o.status.code(), Some(1), "{tool:?}: {}", text(&o));
        assert!(
            text(&o).contains("No data segment parameters changed. Reencryption aborted."),
            "{tool:?}: {}",
            text(&o)
        );
        assert!(v.raw() == before, "{tool:?}: written");
    }
}
