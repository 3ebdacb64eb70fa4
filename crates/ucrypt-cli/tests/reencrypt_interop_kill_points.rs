//! `ucrypt reencrypt` and cryptsetup 2.6, each killed at a chosen point rather than a random
//! one (the last hotzone of a decryption, the moved segment's hotzone, a decryption's
//! finalisation), and resilience switches on resume: one tool starts, the other resumes with
//! another resilience and is killed, the first finishes. The cases of the tables are in
//! `reencrypt_interop.rs`, what both share in `reencrypt_common/`.
//!
//! Needs `cryptsetup` (Debian package cryptsetup-bin); without it each test prints
//! `SKIPPED: <reason>` (or fails when the env var CI is set). Kill delays come from the seed
//! printed as `UCRYPT_TEST_SEED=n` (set it to replay).

#[path = "../../../tests/kit/mod.rs"]
mod kit;
mod reencrypt_common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kit::cryptsetup::{self as cs, dump, CRYPTSETUP};
use kit::{kill_stepped, kill_when, ok, run, stderr, Poll, SplitMix, TempDir};
use reencrypt_common::*;

// ------------------------------------------------------------------------ chosen kill points

/// cryptsetup 2.6.1 mis-finishes a backward reencryption repaired inside its last hotzone
/// (the one at data offset 0) when that hotzone is shorter than the one it would have cut
/// itself (the whole journal area, or as many checksum blocks as the area holds hashes, at
/// most 1 GiB): its `repair` counts its own length as done, so the decryption is not
/// finished, and its `--resume-only` then takes the one linear segment left for the old one
/// and decrypts the plaintext again (docs/reencryption.md, "cryptsetup's last-hotzone
/// repair"). ucrypt plans a decryption's last hotzone that long, so that cryptsetup repairs
/// and finishes it: here ucrypt is SIGKILLed inside that hotzone, for journal and checksum,
/// and cryptsetup's repair and resume must give the plaintext.
#[test]
fn cryptsetup_repairs_a_decryption_ucrypt_was_killed_in_at_its_last_hotzone() {
    if !cs::require() {
        return;
    }
    // Whether the header's first copy has a hotzone segment at data offset 0, the last
    // hotzone of a backward walk.
    let in_last = |hdr: &Path| {
        json_raw(hdr).is_some_and(|v| {
            v["segments"].as_object().is_some_and(|segs| {
                segs.values()
                    .any(|seg| seg["offset"] == "0" && in_reencryption_flag(seg))
            })
        })
    };
    for (resilience, sector) in [("journal", 512), ("checksum", 512), ("journal", 4096)] {
        let t = TempDir::new("kill-last");
        let vol = Decrypt.volume(&t, 24, sector);
        let mut cmd = Command::new(UCRYPT);
        cmd.args(vol.reencrypt(
            Ucrypt,
            &["--resilience", resilience, "--hotzone-size", "1M"],
        ));
        let killed = kill_when(cmd, || in_last(vol.meta()), Poll::Spin, Duration::ZERO);
        let what = format!(
            "{resilience}/{sector}; the header as killed:\n{}\n",
            dump(vol.meta())
        );
        assert!(killed, "{what}: ucrypt ended before the kill");
        assert!(vol.in_hotzone(), "{what}: not killed inside a hotzone");
        assert!(in_last(vol.meta()), "{what}: not the last hotzone");
        vol.repair(Cryptsetup);
        if vol.in_reencryption() {
            ok(CRYPTSETUP, &vol.resume(Cryptsetup, &[]));
        }
        vol.finished(&t, &what);
    }
}

/// Whether any `luks2` keyslot's area in the header file differs from what `seen` first
/// recorded for it: the finalisation of a decryption has begun wiping the old key's keyslots.
/// Read without locking, as the writer holds the lock. Only a header in reencryption (its
/// requirement set) is looked at: before that the export is still being written (ucrypt
/// copies the old header across in pieces, so on a busy host a poll may find the JSON
/// written and the keyslot area not yet), and a change then is no wipe.
fn keyslot_area_changed(hdr: &Path, seen: &RefCell<HashMap<String, Vec<u8>>>) -> bool {
    use std::os::unix::fs::FileExt;
    let Some(v) = json_raw(hdr) else {
        return false;
    };
    let reencrypting = v["config"]["requirements"]
        .to_string()
        .contains("online-reencrypt");
    let (Some(slots), Ok(f)) = (
        v["keyslots"].as_object().filter(|_| reencrypting),
        std::fs::File::open(hdr),
    ) else {
        return false;
    };
    for (id, k) in slots.iter().filter(|(_, k)| k["type"] == "luks2") {
        let num = |x: &serde_json::Value| x.as_str().and_then(|t| t.parse::<u64>().ok());
        let (Some(off), Some(len)) = (num(&k["area"]["offset"]), num(&k["area"]["size"])) else {
            continue;
        };
        // The first 4 KiB tell (the wipe writes the whole area), and keep the poll quick.
        let mut area = vec![0u8; len.min(4096) as usize];
        if f.read_exact_at(&mut area, off).is_err() {
            continue;
        }
        match seen.borrow_mut().entry(id.clone()) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(area);
            }
            std::collections::hash_map::Entry::Occupied(e) if *e.get() != area => return true,
            _ => {}
        }
    }
    false
}

/// cryptsetup SIGKILLed the moment its finalisation of a decryption that moves the data back
/// has begun wiping the old key's keyslot area (it wipes before the JSON drops the keyslot
/// and the requirement): both tools refuse the header ("No key available", "No usable
/// keyslot"), neither resumes it, nothing is written by trying, and the device already
/// starts with the plaintext. The state a kill at a random time reaches once in many runs,
/// reached on purpose (up to ten tries, as a poll can miss the window). ucrypt commits the
/// keyslots' removal before it wipes their areas, so the same watch on ucrypt never finds
/// that state: its runs end finished.
#[test]
fn unshift_killed_while_its_finalisation_wipes_the_keyslots() {
    if !cs::require() {
        return;
    }
    let (mut tries, mut gone) = (0, 0);
    let runs = (0..10)
        .map(|i| (Cryptsetup, SECTORS[i % 2]))
        .chain([(Ucrypt, 512), (Ucrypt, 4096)]);
    for (runner, sector) in runs {
        if runner == Cryptsetup && gone == 2 {
            continue;
        }
        tries += usize::from(runner == Cryptsetup);
        let t = TempDir::new("unshift-kill-final");
        let vol = Unshift.volume(&t, 64, sector);
        let mut cmd = Command::new(runner.prog());
        cmd.args(vol.reencrypt(runner, &[]));
        let seen = RefCell::new(HashMap::new());
        let killed = kill_when(
            cmd,
            || keyslot_area_changed(vol.meta(), &seen),
            Poll::Spin,
            Duration::ZERO,
        );
        let what = format!("{runner:?} killed={killed}, sector {sector}");
        let left = vol.after_kill(&t, runner, &what);
        println!("{what}: {left:?}");
        match left {
            Left::KeyslotsGone if runner == Cryptsetup => gone += 1,
            // Done before the kill, or the wipe and the commit came between two polls.
            Left::Done => vol.finished(&t, &what),
            other => panic!("{what}: killed in the finalisation, yet left {other:?}"),
        }
    }
    println!(
        "{gone} of {tries} kills of cryptsetup landed while its finalisation wiped the keyslots"
    );
    assert!(
        gone > 0,
        "no kill landed inside cryptsetup's finalisation wipe"
    );
}

/// Whether the header file's first copy says the moved segment's hotzone is open (segment
/// `0` linear at 0, flagged in-reencryption): the last hotzone, rewritten in place and
/// protected by checksums.
fn in_moved_hotzone(hdr: &Path) -> bool {
    json_raw(hdr).is_some_and(|v| {
        let s0 = &v["segments"]["0"];
        s0["type"] == "linear" && s0["offset"] == "0" && in_reencryption_flag(s0)
    })
}

/// Each tool SIGKILLed inside the moved segment's hotzone (caught by watching the exported
/// header, then a seeded delay of up to 60 ms into the in-place rewrite), the other repairs
/// it from the checksums (in the last two rounds from the journal: datashift-journal) and
/// finishes: the plaintext is intact.
#[test]
fn unshift_moved_hotzone_killed_and_repaired_by_the_other() {
    if !cs::require() {
        return;
    }
    let mut rng = SplitMix(kit::seed());
    let mut caught = 0;
    for (round, runner) in [Ucrypt, Cryptsetup].into_iter().cycle().take(6).enumerate() {
        let sector = [512u32, 4096, 4096][round / 2];
        let t = TempDir::new("unshift-moved");
        let vol = Unshift.volume(&t, 96, sector);
        // The last two rounds protect the moved segment with a journal (datashift-journal).
        let journal = round >= 4;
        let extra: &[&str] = if journal {
            &["--resilience", "journal", "--hotzone-size", "8M"]
        } else {
            &[]
        };
        let mut cmd = Command::new(runner.prog());
        cmd.args(vol.reencrypt(runner, extra));
        // cryptsetup rewrites the moved segment faster than ucrypt (one pass, no lanes).
        let window_ms = if runner == Cryptsetup { 8 } else { 60 };
        let delay = Duration::from_millis(rng.next_u64() % window_ms);
        let every = Poll::Every(Duration::from_millis(1));
        let killed = kill_when(cmd, || in_moved_hotzone(vol.meta()), every, delay);
        let what = format!(
            "round {round}: {runner:?} killed={killed}, sector {sector}, journal {journal}"
        );
        let left = vol.after_kill(&t, runner, &what);
        println!("{what}: {left:?}");
        assert_ne!(
            left,
            Left::NotStarted,
            "{what}: killed before the reencryption started"
        );
        if left == Left::KeyslotsGone {
            continue;
        }
        if left == (Left::Mid { hot: true }) && in_moved_hotzone(vol.meta()) {
            caught += 1;
        }
        if let Left::Mid { hot } = left {
            if hot {
                vol.repair(runner.other());
            }
            if vol.in_reencryption() {
                ok(runner.other().prog(), &vol.resume(runner.other(), &[]));
            }
        }
        vol.finished(&t, &what);
    }
    println!("{caught} of 6 kills inside the moved segment's hotzone, repaired by the other tool");
    assert!(
        caught > 0,
        "no kill landed inside the moved segment's hotzone"
    );
}

// --------------------------------------------------------------------- resilience switches

/// The resilience named in a reencryption's keyslot, as cryptsetup's luksDump shows it.
fn resilience_shown(hdr: &Path) -> Option<String> {
    dump(hdr).lines().find_map(|l| {
        l.trim()
            .strip_prefix("Resilience:")
            .map(|r| r.trim().to_string())
    })
}

/// The reencrypt keyslot's area type in the header file's first JSON area.
fn area_type_raw(hdr: &Path) -> Option<String> {
    let v = json_raw(hdr)?;
    v["keyslots"]
        .as_object()?
        .values()
        .find(|k| k["type"] == "reencrypt")
        .and_then(|k| k["area"]["type"].as_str().map(str::to_string))
}

/// `--resume-only --resilience` switches a reencryption's resilience (cryptsetup 2.6), both
/// ways: one tool starts with checksum, the other resumes with journal, run in 2 ms steps and
/// SIGKILLed while stopped a seeded number of steps (up to 40) after its header shows the
/// switch, and the first finishes from the switched header (which its reencryption digest
/// check accepts); data intact. A switch away from a data shift's resilience is refused with
/// cryptsetup's words and exit code, nothing written.
#[test]
fn resilience_switches_on_resume_both_ways() {
    if !cs::require() {
        return;
    }
    let mut rng = SplitMix(kit::seed());
    for starts in [Cryptsetup, Ucrypt] {
        let switches = starts.other();
        let mut switched_mid_way = 0;
        for round in 0..4 {
            let t = TempDir::new("switch");
            let vol = Rotate.volume(&t, 80, SECTORS[round % 2]);
            ok(
                starts.prog(),
                &vol.reencrypt(starts, &["--init-only", "--resilience", "checksum"]),
            );
            // Small hotzones, each committed: the run takes long enough to be cut mid-way.
            let mut cmd = Command::new(switches.prog());
            cmd.args(vol.resume(
                Cryptsetup,
                &["--resilience", "journal", "--hotzone-size", "64K"],
            ));
            let steps = (rng.next_u64() % 40) as u32;
            let switched = || area_type_raw(vol.meta()).as_deref() == Some("journal");
            let killed = kill_stepped(cmd, switched, Duration::from_millis(2), steps);
            let shown = resilience_shown(vol.meta());
            let what = format!(
                "{switches:?} switching, round {round}: killed={killed} {steps} steps after: {shown:?}"
            );
            println!("{what}");
            if vol.in_reencryption() {
                switched_mid_way += usize::from(shown.as_deref() == Some("journal"));
                if vol.in_hotzone() {
                    vol.repair(starts);
                }
                ok(starts.prog(), &vol.resume(Cryptsetup, &[]));
            }
            vol.finished(&t, &what);
        }
        assert!(
            switched_mid_way > 0,
            "{switches:?} never left a switched reencryption mid-way in 4 rounds"
        );
    }
    // A data shift's resilience stays: refused by both, the header untouched.
    let t = TempDir::new("switch-shift");
    let vol = Shift.volume(&t, 64, 512);
    ok(CRYPTSETUP, &vol.reencrypt(Cryptsetup, &["--init-only"]));
    let before = vol.raw();
    for tool in [Ucrypt, Cryptsetup] {
        let o = run(
            tool.prog(),
            &vol.resume(Cryptsetup, &["--resilience", "checksum"]),
        );
        assert_eq!(o.status.code(), Some(1), "{tool:?}");
        let err = stderr(&o);
        assert!(
            err.contains("Requested --resilience option cannot be applied"),
            "{tool:?}: {err}"
        );
        assert!(vol.raw() == before, "{tool:?} wrote");
    }
}

/// A decryption that moves the data back switches the protection of its moved segment on
/// resume (`--resilience journal`, which both tools map to `datashift-journal`), both ways:
/// one tool starts it with checksums, the other resumes with a journal, run in 2 ms steps
/// and SIGKILLed while stopped a seeded number of steps (up to 40, halved after each round
/// that left no switched decryption mid-way) after its header shows the switch; the first
/// finishes from the switched header (its digest check accepts it); the plaintext is at the
/// start of the device. Three rounds each way, and more (up to eight) until one kill has left
/// the switched decryption mid-way.
#[test]
fn resilience_switches_on_a_moved_back_decryption() {
    if !cs::require() {
        return;
    }
    let mut rng = SplitMix(kit::seed());
    for starts in [Cryptsetup, Ucrypt] {
        let switches = starts.other();
        let (mut switched_mid_way, mut steps_max) = (0, 40);
        for round in 0..8 {
            if round >= 3 && switched_mid_way > 0 {
                break;
            }
            let t = TempDir::new("unshift-switch");
            let vol = Unshift.volume(&t, 160, 4096);
            ok(
                starts.prog(),
                &vol.reencrypt(starts, &["--init-only", "--hotzone-size", "8M"]),
            );
            let mut cmd = Command::new(switches.prog());
            cmd.args(vol.resume(switches, &["--resilience", "journal"]));
            let steps = (rng.next_u64() % steps_max) as u32;
            let switched = || area_type_raw(vol.meta()).as_deref() == Some("datashift-journal");
            let killed = kill_stepped(cmd, switched, Duration::from_millis(2), steps);
            let shown = resilience_shown(vol.meta());
            if !killed || shown.as_deref() != Some("datashift-journal") {
                steps_max = (steps_max / 2).max(1);
            }
            let what = format!(
                "{switches:?} switching, round {round}: killed={killed} {steps} steps after: {shown:?}"
            );
            println!("{what}");
            if vol.in_reencryption() && !vol.has_keyslot() {
                // Killed in cryptsetup's finalisation, its keyslots destroyed: neither tool
                // resumes (see `killed_in_finalisation`); the data is all plaintext.
                assert!(vol.data_plain(), "{what}: not the plaintext");
                continue;
            }
            if vol.in_reencryption() {
                switched_mid_way += usize::from(shown.as_deref() == Some("datashift-journal"));
                if vol.in_hotzone() {
                    vol.repair(starts);
                }
                if vol.in_reencryption() {
                    let before_resume = metadata(vol.meta());
                    let o = run(starts.prog(), &vol.resume(starts, &[]));
                    let err = stderr(&o);
                    if starts == Cryptsetup
                        && err.contains("Failed to write reencryption resilience metadata")
                    {
                        // cryptsetup 2.6.1 cannot resume a datashift-journal decryption left
                        // between its walk and the moved segment's hotzone when the moved
                        // segment is shorter than the shift: it fails so on a header it wrote
                        // and was killed in itself. ucrypt finishes it.
                        println!("{what}: cryptsetup cannot resume this state; ucrypt does");
                        ok(UCRYPT, &vol.resume(Ucrypt, &[]));
                    } else {
                        assert!(
                            o.status.success(),
                            "{what}: {starts:?} resume: {err}\n{before_resume}"
                        );
                    }
                }
            }
            vol.finished(&t, &what);
        }
        assert!(
            switched_mid_way > 0,
            "{switches:?} never left a switched decryption mid-way in 8 rounds"
        );
    }
}
