//! `reencrypt --keep-key` beside cryptsetup 2.6.1 on the same volume: the data reencrypted
//! to a new cipher or sector size under the volume key it has (no new keyslot: the key's
//! digest covers the old and the new segments, and the keyslot that opened it stays). Both
//! tools' `--init-only` and finished metadata alike, the plaintext intact, the volume key the
//! same before and after; a run of one tool killed partway is repaired and finished by the
//! other; `--keep-key` that changes nothing is refused by both. `--key-size` beside
//! `--keep-key` is ignored by both when the cipher changes (the kept key is the new
//! segment's), and a new cipher that cannot take the kept key is refused by both with
//! cryptsetup's words. `--reduce-device-size` with `--keep-key` and no new cipher or sector
//! size is refused by both as a change of nothing; with one, both move the data up by the
//! reduction while they reencrypt. `--keep-key --key-size` alone:
//! ucrypt refuses it as cryptsetup 2.8 does, while 2.6.1 starts a reencryption that
//! changes nothing (pinned here, so that a change of either shows).
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
    (
        "cipher to aes-xts-plain, --key-size 256 ignored",
        &["--cipher", "aes-xts-plain", "--key-size", "256"],
    ),
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

/// Refusals both tools make before writing anything, with cryptsetup's words and exit code.
#[test]
fn keep_key_refusals_as_cryptsetup() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("keep-key-refused");
    let vol = Rotate.volume(&t, VOLUME_MIB, 512);
    const NOTHING: &str = "No data segment parameters changed. Reencryption aborted.";
    let cases: &[(&[&str], &str)] = &[
        (&["--keep-key", "--reduce-device-size", "4M"], NOTHING),
        (&["--keep-key", "--key-size", "512"], NOTHING),
        (
            &["--keep-key", "--cipher", "aes-cbc-essiv:sha256"],
            "Unable to use cipher specification aes-cbc-essiv:sha256 for LUKS2.",
        ),
        (
            &[
                "--keep-key",
                "--cipher",
                "aes-cbc-essiv:sha256",
                "--key-size",
                "256",
            ],
            "Unable to use cipher specification aes-cbc-essiv:sha256 for LUKS2.",
        ),
    ];
    for (args, want) in cases {
        for tool in [Cryptsetup, Ucrypt] {
            let v = vol.copy(&t, &format!("{tool:?}"));
            let before = v.raw();
            let o = run(tool.prog(), &v.reencrypt(tool, args));
            let how = format!("{tool:?} {args:?}");
            assert_eq!(o.status.code(), Some(1), "{how}: {}", text(&o));
            assert!(text(&o).contains(want), "{how}: {}", text(&o));
            assert!(v.raw() == before, "{how}: written");
        }
    }
}

/// Where the tools part: `--keep-key --key-size` with nothing else changed (cryptsetup 2.6.1
/// starts a reencryption whose new segment is the old one; ucrypt refuses as 2.8 does).
#[test]
fn keep_key_where_cryptsetup_2_6_differs() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("keep-key-differs");
    let vol = Rotate.volume(&t, VOLUME_MIB, 512);
    let key_size: &[&str] = &["--keep-key", "--key-size", "256", "--init-only"];
    let v = vol.copy(&t, "cs-key-size");
    ok(Cryptsetup.prog(), &v.reencrypt(Cryptsetup, key_size));
    let j = json_raw(v.meta()).expect("cryptsetup's metadata");
    let (old, new) = (&j["segments"]["1"], &j["segments"]["2"]);
    for field in ["offset", "encryption", "sector_size"] {
        assert_eq!(old[field], new[field], "cryptsetup 2.6.1: {field} changed");
    }
    let v = vol.copy(&t, "ucrypt-key-size");
    let before = v.raw();
    let o = run(Ucrypt.prog(), &v.reencrypt(Ucrypt, key_size));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("No data segment parameters changed. Reencryption aborted."),
        "{}",
        text(&o)
    );
    assert!(v.raw() == before, "ucrypt wrote");
}

/// `--keep-key` with a new cipher and `--reduce-device-size`: both tools move the data up by
/// the reduction while they reencrypt under the kept key, their `--init-only` alike; each
/// finishes the other's, the plaintext (all but the last shift) intact, the key the same.
#[test]
fn keep_key_with_a_reduce_moves_the_data_as_cryptsetup_does() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("keep-key-relocate");
    let vol = Relocate.volume(&t, VOLUME_MIB, 512);
    let key = volume_key(&vol);
    let extra: &[&str] = &["--keep-key", "--cipher", "aes-xts-plain", "--init-only"];
    let theirs = vol.copy(&t, "theirs");
    ok(Cryptsetup.prog(), &theirs.reencrypt(Cryptsetup, extra));
    ok(Ucrypt.prog(), &vol.reencrypt(Ucrypt, extra));
    assert_eq!(metadata(vol.meta()), metadata(theirs.meta()), "--init-only");
    ok(Cryptsetup.prog(), &vol.resume(Cryptsetup, &[]));
    ok(Ucrypt.prog(), &theirs.resume(Ucrypt, &[]));
    for (v, what) in [
        (&vol, "ucrypt init, cryptsetup run"),
        (&theirs, "the other way"),
    ] {
        v.finished(&t, what);
        assert_eq!(volume_key(v), key, "{what}: the key changed");
        assert!(
            cs::dump(v.meta()).contains("cipher: aes-xts-plain\n"),
            "{what}"
        );
    }
}
