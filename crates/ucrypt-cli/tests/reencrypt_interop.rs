//! `ucrypt reencrypt` against the real cryptsetup 2.6 on files, as tables of cases run by one
//! runner each. A case names what the reencryption does to the volume ([`Kind`]: a new key,
//! cipher, key size or sector size in place; decryption or encryption with a detached header;
//! encryption that moves the data to make room for the header, decryption that moves it back),
//! its sector sizes, resilience and options, and which tool does what:
//! - [`RUNS`]: ucrypt runs the whole reencryption, cryptsetup accepts the result and the data
//!   read back is the original plaintext;
//! - [`INITS`]: ucrypt's `--init-only` (and, in the rows that say so, cryptsetup's on a copy,
//!   which must leave the same metadata and bytes); then each tool finishes the other's start;
//! - [`KILLS`]: one tool is SIGKILLed at a seeded random point, the other (`repair` if it was
//!   inside a hotzone, then `reencrypt --resume-only`) finishes, data intact.
//!
//! After the tables, the refusals. What no row states has its own files: several keyslots
//! (`reencrypt_interop_keyslots.rs`), kills at a chosen point and resilience switches
//! (`reencrypt_interop_kill_points.rs`); what all three share is `reencrypt_common/`.
//!
//! Needs `cryptsetup` (Debian package cryptsetup-bin); without it each test prints
//! `SKIPPED: <reason>` (or fails when the env var CI is set). Kill delays come from the seed
//! printed as `UCRYPT_TEST_SEED=n` (set it to replay).

#[path = "../../../tests/kit/mod.rs"]
mod kit;
mod reencrypt_common;

use std::process::Command;
use std::time::Duration;

use kit::cryptsetup::{self as cs, dump, CRYPTSETUP};
use kit::{kill_after, kill_when, ok, run, s, stderr, Poll, SplitMix, TempDir};
use reencrypt_common::*;

// ------------------------------------------------------------------------------- whole runs

/// ucrypt runs a whole reencryption of `mib` MiB for each sector size × resilience (an empty
/// list: no `--resilience`) with `extra` options; luksDump must then show each of `shows`.
struct WholeRun {
    kind: Kind,
    mib: u64,
    sectors: &'static [u32],
    resiliences: &'static [&'static str],
    extra: &'static [&'static str],
    shows: &'static [&'static str],
}

const HZ_1M: &[&str] = &["--hotzone-size", "1M"];
const ALL: &[&str] = &["checksum", "journal", "none"];
const NONE: &[&str] = &["none"];
const CIPHER_SHOWS: &[&str] = &[
    "cipher: aes-cbc-essiv:sha256\n",
    "sector: 512 [bytes]",
    "Key:        256 bits",
];
const KEY_SIZE_SHOWS: &[&str] = &[
    "cipher: aes-xts-plain64\n",
    "sector: 4096 [bytes]",
    "Key:        256 bits",
];

#[rustfmt::skip]
const RUNS: &[WholeRun] = &[
    WholeRun { kind: Rotate, mib: 24, sectors: SECTORS, resiliences: ALL, extra: HZ_1M, shows: &[] },
    // `none` with its default 64 MiB hotzones rekeys each through a 16 MiB buffer: a 48 MiB
    // volume is one hotzone three buffers long, a 112 MiB one two hotzones and a last one.
    WholeRun { kind: Rotate, mib: 64, sectors: &[512], resiliences: NONE, extra: &[], shows: &[] },
    WholeRun { kind: Rotate, mib: 128, sectors: &[4096], resiliences: NONE, extra: &[], shows: &[] },
    // Cipher, key size and sector size changes, from either sector size.
    WholeRun { kind: Rotate, mib: 24, sectors: SECTORS, resiliences: ALL, shows: KEY_SIZE_SHOWS,
        extra: &["--hotzone-size", "1M", "--key-size", "256", "--sector-size", "4096"] },
    WholeRun { kind: Rotate, mib: 24, sectors: SECTORS, resiliences: ALL, shows: CIPHER_SHOWS,
        extra: &["--hotzone-size", "1M", "--cipher", "aes-cbc-essiv:sha256", "--sector-size", "512"] },
    WholeRun { kind: Decrypt, mib: 24, sectors: SECTORS, resiliences: ALL, extra: HZ_1M, shows: &[] },
    WholeRun { kind: Encrypt, mib: 24, sectors: SECTORS, resiliences: ALL, extra: HZ_1M, shows: &[] },
    WholeRun { kind: Shift, mib: 84, sectors: SECTORS, resiliences: &[], extra: &[], shows: &[] },
    // The default moved segment, a 1 MiB one, and a journal.
    WholeRun { kind: Unshift, mib: 72, sectors: SECTORS, resiliences: &[], extra: &[], shows: &[] },
    WholeRun { kind: Unshift, mib: 72, sectors: &[4096], resiliences: &[], extra: HZ_1M, shows: &[] },
    WholeRun { kind: Unshift, mib: 72, sectors: &[512], resiliences: &["journal"],
        extra: &["--hotzone-size", "4M"], shows: &[] },
    // The data moved up as the key changes; with a new cipher and sector size too.
    WholeRun { kind: Relocate, mib: 52, sectors: SECTORS, resiliences: &[], extra: &[], shows: &[] },
    WholeRun { kind: Relocate, mib: 52, sectors: &[512], resiliences: &[], shows: KEY_SIZE_SHOWS,
        extra: &["--key-size", "256", "--sector-size", "4096"] },
];

fn whole_runs(kinds: &[Kind]) {
    if !cs::require() {
        return;
    }
    let mut cases = 0;
    for r in RUNS.iter().filter(|r| kinds.contains(&r.kind)) {
        let resiliences = if r.resiliences.is_empty() {
            &[""][..]
        } else {
            r.resiliences
        };
        for (&sector, &resilience) in r
            .sectors
            .iter()
            .flat_map(|s| resiliences.iter().map(move |x| (s, x)))
        {
            let what = format!("{:?} {sector} {resilience:?} {:?}", r.kind, r.extra);
            let t = TempDir::new("reenc-run");
            let vol = r.kind.volume(&t, r.mib, sector);
            let before = vol.has_header().then(|| dump(vol.meta()));
            let ss = sector.to_string();
            let mut extra = r.kind.sector_opt(&ss);
            if !resilience.is_empty() {
                extra.extend(["--resilience", resilience]);
            }
            extra.extend(r.extra);
            ok(UCRYPT, &vol.reencrypt(Ucrypt, &extra));
            let d = dump(vol.meta());
            assert_ne!(before.as_ref(), Some(&d), "{what}: the header changed");
            for shown in r.shows {
                assert!(d.contains(shown), "{what}: no {shown:?} in\n{d}");
            }
            if matches!(r.kind, Encrypt | Shift) {
                assert!(
                    d.contains(&format!("sector: {sector} [bytes]")),
                    "{what}: {d}"
                );
            }
            if r.kind == Unshift {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(vol.meta())
                    .expect("header")
                    .permissions()
                    .mode();
                assert_eq!(mode & 0o777, 0o600, "{what}: exported header mode");
            }
            vol.finished(&t, &what);
            cases += 1;
        }
    }
    println!("{cases} whole runs by ucrypt read by cryptsetup");
}

#[test]
fn whole_runs_in_place_read_by_cryptsetup() {
    whole_runs(&[Rotate]);
}

#[test]
fn whole_runs_detached_or_moving_read_by_cryptsetup() {
    whole_runs(&[Decrypt, Encrypt, Shift, Unshift, Relocate]);
}

// ---------------------------------------------------------------- --init-only, then the other

/// ucrypt's `--init-only` with `extra` (luksDump or its JSON must then show each of `shows`);
/// in the rows `both`, cryptsetup's too on a copy: the same metadata, and (data-moving rows,
/// whose moved segment is `moved` bytes) the same bytes, `ucrypt dump` equal to luksDump, and
/// either start served read-only. Then cryptsetup finishes ucrypt's start and ucrypt
/// cryptsetup's (`--resume-only` with `resume`).
struct Init {
    kind: Kind,
    mib: u64,
    sectors: &'static [u32],
    extra: &'static [&'static str],
    shows: &'static [&'static str],
    both: bool,
    moved: usize,
    resume: &'static [&'static str],
}

/// Where cryptsetup 2.6.1 puts a reencryption's area on a volume with the header in front.
const AREA_OFFSET: &str = "Area offset:548864 [bytes]";
const AREA_LENGTH: &str = "Area length:16228352 [bytes]";
const V3_CHECKSUM: &[&str] = &["online-reencrypt-v3", "datashift-checksum"];
const V3_JOURNAL: &[&str] = &["online-reencrypt-v3", "datashift-journal"];

#[rustfmt::skip]
const INITS: &[Init] = &[
    Init { kind: Rotate, mib: 24, sectors: &[4096], extra: &["--resilience", "checksum"],
        shows: &["online-reencrypt-v2", "Resilience: checksum", AREA_OFFSET, AREA_LENGTH],
        both: false, moved: 0, resume: &[] },
    Init { kind: Rotate, mib: 24, sectors: &[4096], extra: &["--resilience", "journal"],
        shows: &["online-reencrypt-v2", "Resilience: journal", AREA_OFFSET, AREA_LENGTH],
        both: false, moved: 0, resume: &[] },
    Init { kind: Rotate, mib: 24, sectors: &[4096], extra: &["--resilience", "none"],
        shows: &["online-reencrypt-v2", "Resilience: none", AREA_OFFSET, AREA_LENGTH],
        both: false, moved: 0, resume: &[] },
    Init { kind: Decrypt, mib: 24, sectors: &[4096], extra: &[],
        shows: &["Mode:       decrypt", "Direction:  backward", "2: linear"],
        both: false, moved: 0, resume: &[] },
    Init { kind: Encrypt, mib: 24, sectors: &[4096], extra: &[],
        shows: &["Mode:       encrypt", "0: linear"], both: false, moved: 0, resume: &[] },
    Init { kind: Shift, mib: 72, sectors: SECTORS, extra: &[], shows: &[],
        both: true, moved: SHIFT as usize, resume: &[] },
    // The reencrypt keyslot's area: datashift-journal (--resilience journal) needs a moved
    // segment the area holds.
    Init { kind: Unshift, mib: 64, sectors: SECTORS, extra: &[], shows: V3_CHECKSUM,
        both: true, moved: 16 << 20, resume: &[] },
    Init { kind: Unshift, mib: 64, sectors: &[4096], extra: HZ_1M, shows: V3_CHECKSUM,
        both: true, moved: 1 << 20, resume: &[] },
    Init { kind: Unshift, mib: 64, sectors: &[4096], shows: V3_JOURNAL,
        extra: &["--resilience", "journal", "--hotzone-size", "8M"],
        both: true, moved: 8 << 20, resume: &[] },
    Init { kind: Unshift, mib: 64, sectors: &[512], shows: V3_JOURNAL,
        extra: &["--resilience", "journal", "--hotzone-size", "1M"],
        both: true, moved: 1 << 20, resume: &[] },
    // `--resilience-hash` of SHA-2, SHA-1 and the others cryptsetup's backend offers.
    Init { kind: Rotate, mib: 24, sectors: &[4096], both: true, moved: 0, resume: HZ_1M,
        extra: &["--resilience", "checksum", "--resilience-hash", "sha512"], shows: &["Hash:       sha512"] },
    Init { kind: Rotate, mib: 24, sectors: &[4096], both: true, moved: 0, resume: HZ_1M,
        extra: &["--resilience", "checksum", "--resilience-hash", "sha1"], shows: &["Hash:       sha1"] },
    Init { kind: Rotate, mib: 24, sectors: &[4096], both: true, moved: 0, resume: HZ_1M,
        extra: &["--resilience", "checksum", "--resilience-hash", "whirlpool"],
        shows: &["Hash:       whirlpool"] },
    Init { kind: Rotate, mib: 24, sectors: &[4096], both: true, moved: 0, resume: HZ_1M,
        extra: &["--resilience", "checksum", "--resilience-hash", "sha3-256"],
        shows: &["Hash:       sha3-256"] },
    Init { kind: Rotate, mib: 24, sectors: &[4096], both: true, moved: 0, resume: HZ_1M,
        extra: &["--resilience", "checksum", "--resilience-hash", "ripemd160"],
        shows: &["Hash:       ripemd160"] },
    Init { kind: Rotate, mib: 24, sectors: &[4096], both: true, moved: 0, resume: HZ_1M,
        extra: &["--resilience", "checksum", "--resilience-hash", "blake2b-512"],
        shows: &["Hash:       blake2b-512"] },
    Init { kind: Relocate, mib: 52, sectors: SECTORS, extra: &[], both: true, moved: 0, resume: &[],
        shows: &["online-reencrypt-v2", "Direction:  backward", "Resilience: datashift",
            "offset: 25165824 [bytes]"] },
];

/// What a data-moving `--init-only` must leave, the same from both tools: the moved segment
/// where it belongs, the rest in place.
fn moved_as_cryptsetup_moves(mine: &Vol, theirs: &Vol, m: usize, what: &str) {
    let (my_raw, their_raw) = (mine.raw(), theirs.raw());
    if mine.kind == Shift {
        let (sh, moved) = (SHIFT as usize, my_raw.len() - SHIFT as usize);
        assert!(my_raw[moved..] == mine.plain[..sh], "{what}: moved segment");
        assert!(
            my_raw[moved..] == their_raw[moved..],
            "{what}: moved segment"
        );
        assert!(
            my_raw[sh..moved - sh] == their_raw[sh..moved - sh],
            "{what}: the rest in place"
        );
        // The header area no longer holds the first shift of plaintext.
        assert!(
            my_raw[1 << 20..sh] != mine.plain[1 << 20..sh],
            "{what}: header area"
        );
    } else {
        assert!(my_raw == their_raw, "{what}: the devices differ after init");
        let (my_h, their_h) = (
            std::fs::read(mine.meta()).expect("h"),
            std::fs::read(theirs.meta()).expect("h"),
        );
        assert_eq!(my_h.len(), their_h.len(), "{what}: header file size");
        assert!(
            my_h[32 << 10..] == their_h[32 << 10..],
            "{what}: keyslots area"
        );
        // The moved segment: the first ciphertext over the old header.
        let at = DATA_OFFSET as usize;
        assert!(
            my_raw[..m] == mine.before[at..at + m],
            "{what}: moved segment"
        );
    }
}

fn inits(kinds: &[Kind]) {
    if !cs::require() {
        return;
    }
    let mut cases = 0;
    for r in INITS.iter().filter(|r| kinds.contains(&r.kind)) {
        for &sector in r.sectors {
            let what = format!("{:?} {sector} {:?}", r.kind, r.extra);
            let t = TempDir::new("reenc-init");
            let mine = r.kind.volume(&t, r.mib, sector);
            let theirs = r.both.then(|| mine.copy(&t, "theirs"));
            let ss = sector.to_string();
            let mut extra = vec!["--init-only"];
            extra.extend(r.kind.sector_opt(&ss));
            extra.extend(r.extra);
            ok(UCRYPT, &mine.reencrypt(Ucrypt, &extra));
            let shown = dump(mine.meta()) + &cs::dump_json(mine.meta());
            for want in r.shows {
                assert!(shown.contains(want), "{what}: no {want:?} in\n{shown}");
            }
            if let Some(theirs) = &theirs {
                // cryptsetup builds a new header in a temporary file in its working directory.
                let o = Command::new(CRYPTSETUP)
                    .args(theirs.reencrypt(Cryptsetup, &extra))
                    .current_dir(t.dir())
                    .output()
                    .expect("cryptsetup");
                assert!(o.status.success(), "{what}: {}", kit::text(&o));
                assert_eq!(metadata(mine.meta()), metadata(theirs.meta()), "{what}");
                if r.moved > 0 {
                    for v in [&mine, theirs] {
                        // `dump` shows the state as luksDump does, to the byte.
                        assert_eq!(
                            ok(UCRYPT, &["dump", s(v.meta())]),
                            dump(v.meta()),
                            "{what}: dump"
                        );
                    }
                    moved_as_cryptsetup_moves(&mine, theirs, r.moved, &what);
                    mine.exports_read_only(&t, &what);
                    theirs.exports_read_only(&t, &what);
                }
            }
            ok(CRYPTSETUP, &mine.resume(Cryptsetup, r.resume));
            mine.finished(&t, &format!("{what}: ucrypt init, cryptsetup run"));
            if let Some(theirs) = &theirs {
                ok(UCRYPT, &theirs.resume(Ucrypt, r.resume));
                theirs.finished(&t, &format!("{what}: cryptsetup init, ucrypt run"));
            }
            cases += 1;
        }
    }
    println!("{cases} starts finished by the other tool");
}

#[test]
fn init_in_place_finished_by_the_other() {
    inits(&[Rotate]);
}

#[test]
fn init_detached_or_moving_finished_by_the_other() {
    inits(&[Decrypt, Encrypt, Shift, Unshift, Relocate]);
}

// ---------------------------------------------------------------------------- random kills

/// When the killed tool is killed.
#[derive(Clone, Copy)]
enum When {
    /// `base_ms` + a seeded delay below `spread_ms` after its start.
    After(u64, u64),
    /// A seeded delay below the given ms after its commit of the reencryption (the header
    /// file names the v3 requirement), or (one round in three) after its start: cryptsetup
    /// calibrates its reencryption digest for one to two seconds before it commits.
    AfterCommit(u64),
}

/// `killed` runs `rounds` reencryptions of `mib` MiB with `extra` options and is SIGKILLed
/// (`when`); the other tool finishes. Round `n` takes resilience `n % len` of `resiliences`
/// (none: no `--resilience`) and sector size `n / len % 2`.
struct Kill {
    kind: Kind,
    killed: Tool,
    rounds: usize,
    mib: u64,
    resiliences: &'static [&'static str],
    hotzone: Option<&'static str>,
    extra: &'static [&'static str],
    when: When,
}

const CS_JOURNAL: &[&str] = &["checksum", "journal"];
const CHECKSUM: &[&str] = &["checksum"];
const CHANGE_KEY_SIZE: &[&str] = &["--key-size", "256", "--sector-size", "4096"];
const CHANGE_CIPHER: &[&str] = &["--cipher", "aes-cbc-essiv:sha256", "--sector-size", "512"];
const HZ: Option<&str> = Some("1M");
const HZ_4M: Option<&str> = Some("4M");

/// ucrypt killed: small volumes, hotzones of 1 MiB, checksum and journal in turn, 20 to
/// 420 ms after its start; cryptsetup killed: `--resilience checksum --hotzone-size 4M` on
/// 208 MiB.
#[rustfmt::skip]
const KILLS: &[Kill] = &[
    Kill { kind: Rotate, killed: Ucrypt, rounds: 6, mib: 80, resiliences: CS_JOURNAL, hotzone: HZ,
        extra: &[], when: When::After(20, 400) },
    Kill { kind: Rotate, killed: Cryptsetup, rounds: 6, mib: 208, resiliences: CHECKSUM, hotzone: HZ_4M,
        extra: &[], when: When::After(80, 260) },
    Kill { kind: Rotate, killed: Ucrypt, rounds: 4, mib: 80, resiliences: CS_JOURNAL, hotzone: HZ,
        extra: CHANGE_KEY_SIZE, when: When::After(20, 400) },
    Kill { kind: Rotate, killed: Ucrypt, rounds: 4, mib: 80, resiliences: CS_JOURNAL, hotzone: HZ,
        extra: CHANGE_CIPHER, when: When::After(20, 400) },
    Kill { kind: Rotate, killed: Cryptsetup, rounds: 4, mib: 208, resiliences: CHECKSUM, hotzone: HZ_4M,
        extra: CHANGE_KEY_SIZE, when: When::After(80, 260) },
    Kill { kind: Rotate, killed: Cryptsetup, rounds: 4, mib: 208, resiliences: CHECKSUM, hotzone: HZ_4M,
        extra: CHANGE_CIPHER, when: When::After(80, 260) },
    // One round each (a checksum one) or two.
    Kill { kind: Rotate, killed: Ucrypt, rounds: 1, mib: 80, resiliences: CS_JOURNAL, hotzone: HZ,
        extra: &["--resilience-hash", "sha1"], when: When::After(20, 400) },
    Kill { kind: Rotate, killed: Ucrypt, rounds: 1, mib: 80, resiliences: CS_JOURNAL, hotzone: HZ,
        extra: &["--resilience-hash", "sha3-256"], when: When::After(20, 400) },
    Kill { kind: Rotate, killed: Cryptsetup, rounds: 2, mib: 208, resiliences: CHECKSUM, hotzone: HZ_4M,
        extra: &["--resilience-hash", "sha512"], when: When::After(80, 260) },
    Kill { kind: Rotate, killed: Cryptsetup, rounds: 1, mib: 208, resiliences: CHECKSUM, hotzone: HZ_4M,
        extra: &["--resilience-hash", "whirlpool"], when: When::After(80, 260) },
    Kill { kind: Decrypt, killed: Ucrypt, rounds: 4, mib: 80, resiliences: CS_JOURNAL, hotzone: HZ,
        extra: &[], when: When::After(20, 400) },
    // cryptsetup calibrates the reencryption digest for about a second first.
    Kill { kind: Decrypt, killed: Cryptsetup, rounds: 4, mib: 208, resiliences: CHECKSUM, hotzone: HZ_4M,
        extra: &[], when: When::After(1000, 1800) },
    Kill { kind: Encrypt, killed: Ucrypt, rounds: 4, mib: 80, resiliences: CS_JOURNAL, hotzone: HZ,
        extra: &[], when: When::After(20, 400) },
    Kill { kind: Encrypt, killed: Cryptsetup, rounds: 4, mib: 208, resiliences: CHECKSUM, hotzone: HZ_4M,
        extra: &[], when: When::After(100, 1500) },
    Kill { kind: Shift, killed: Ucrypt, rounds: 6, mib: 200, resiliences: &[], hotzone: HZ_4M,
        extra: &[], when: When::After(150, 900) },
    Kill { kind: Shift, killed: Cryptsetup, rounds: 6, mib: 300, resiliences: &[], hotzone: None,
        extra: &[], when: When::After(300, 1200) },
    Kill { kind: Unshift, killed: Ucrypt, rounds: 6, mib: 200, resiliences: &[], hotzone: None,
        extra: &[], when: When::After(50, 1200) },
    Kill { kind: Unshift, killed: Cryptsetup, rounds: 6, mib: 300, resiliences: &[], hotzone: None,
        extra: &[], when: When::AfterCommit(1500) },
    Kill { kind: Relocate, killed: Ucrypt, rounds: 6, mib: 300, resiliences: &[], hotzone: None,
        extra: &[], when: When::After(20, 250) },
    Kill { kind: Relocate, killed: Cryptsetup, rounds: 6, mib: 300, resiliences: &[], hotzone: None,
        extra: &[], when: When::After(300, 700) },
];

fn kills(kinds: &[Kind]) {
    if !cs::require() {
        return;
    }
    let mut rng = SplitMix(kit::seed());
    for k in KILLS.iter().filter(|k| kinds.contains(&k.kind)) {
        let (mut mid_way, mut hot_hits) = (0, 0);
        for round in 0..k.rounds {
            let x = rng.next_u64();
            let n = k.resiliences.len().max(1);
            let sector = SECTORS[round / n % 2];
            let t = TempDir::new("reenc-kill");
            let vol = k.kind.volume(&t, k.mib, sector);
            let ss = sector.to_string();
            let mut extra = k.kind.sector_opt(&ss);
            if let Some(r) = k.resiliences.get(round % n) {
                extra.extend(["--resilience", r]);
            }
            if let Some(h) = k.hotzone {
                extra.extend(["--hotzone-size", h]);
            }
            extra.extend(k.extra);
            let mut cmd = Command::new(k.killed.prog());
            // cryptsetup builds a new header in a temporary file in its working directory.
            cmd.args(vol.reencrypt(k.killed, &extra))
                .current_dir(t.dir());
            let (killed, delay) = match k.when {
                When::After(base, spread) => {
                    let delay = Duration::from_millis(base + x % spread);
                    (kill_after(cmd, delay), format!("{delay:?} after its start"))
                }
                When::AfterCommit(spread) if round % 3 != 2 => {
                    let delay = Duration::from_millis(x % spread);
                    let hdr = vol.meta();
                    let committed = || {
                        let b = std::fs::read(hdr).unwrap_or_default();
                        b[..b.len().min(16 << 10)]
                            .windows(19)
                            .any(|w| w == b"online-reencrypt-v3")
                    };
                    let killed =
                        kill_when(cmd, committed, Poll::Every(Duration::from_millis(5)), delay);
                    (killed, format!("{delay:?} after its commit"))
                }
                When::AfterCommit(spread) => {
                    let delay = Duration::from_millis(x % spread);
                    (kill_after(cmd, delay), format!("{delay:?} after its start"))
                }
            };
            let what = format!(
                "{:?} round {round}, {:?} killed={killed} {delay}, sector {sector} {extra:?}",
                k.kind, k.killed
            );
            let left = vol.after_kill(&t, k.killed, &what);
            println!("{what}: {left:?}");
            match left {
                Left::NotStarted | Left::KeyslotsGone => continue,
                Left::Mid { hot } => {
                    mid_way += 1;
                    hot_hits += usize::from(hot);
                }
                Left::Done => {}
            }
            if vol.finish(k.killed.other(), left, &what) {
                vol.finished(&t, &what);
            }
        }
        println!(
            "{:?} {:?} killed {:?}: {mid_way} of {} left mid-way ({hot_hits} inside a hotzone)",
            k.kind, k.killed, k.extra, k.rounds
        );
    }
}

#[test]
fn kills_in_place_finished_by_the_other() {
    kills(&[Rotate]);
}

#[test]
fn kills_of_a_decryption_finished_by_the_other() {
    kills(&[Decrypt]);
}

#[test]
fn kills_of_an_encryption_finished_by_the_other() {
    kills(&[Encrypt]);
}

#[test]
fn kills_of_a_shift_finished_by_the_other() {
    kills(&[Shift]);
}

#[test]
fn kills_of_an_unshift_finished_by_the_other() {
    kills(&[Unshift]);
}

#[test]
fn kills_of_a_relocation_finished_by_the_other() {
    kills(&[Relocate]);
}

// ------------------------------------------------------------------------------- refusals

/// `reencrypt` refuses what is not built or not possible, naming it, with cryptsetup's exit
/// code 1, writing nothing (no header exported either).
#[test]
fn refusals_name_what_is_refused() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("reenc-refuse");
    let new_hdr = t.path("exported.hdr");
    let nh = s(&new_hdr);
    let rows: [(Kind, &[&str], &str); 6] = [
        // The volume is LUKS already (cryptsetup's words).
        (
            Rotate,
            &["--encrypt", "--reduce-device-size", "32M"],
            "already LUKS",
        ),
        // A rotation that moves the data past the device's end (cryptsetup fails too).
        (
            Rotate,
            &["--reduce-device-size", "32M"],
            "holds no data past the new data offset",
        ),
        (
            Rotate,
            &["--encrypt", "--reduce-device-size", "32M", "--header", nh],
            "detached --header",
        ),
        // The decryption that moves the data back protects its moved segment: `none` is
        // refused (cryptsetup's words).
        (
            Rotate,
            &["--decrypt", "--header", nh, "--resilience", "none"],
            "cannot be applied",
        ),
        (Rotate, &["--decrypt"], "detached header"),
        (Encrypt, &["--encrypt"], "--reduce-device-size"),
    ];
    for (kind, args, word) in rows {
        let vol = kind.volume(&t, 20, 512);
        let before = vol.raw();
        let o = run(
            UCRYPT,
            &[
                &["reencrypt", "-q", "--key-file", s(&vol.key)],
                args,
                &[s(&vol.img)],
            ]
            .concat(),
        );
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(word), "{args:?}: {}", stderr(&o));
        assert!(vol.raw() == before, "{args:?}: written");
        assert!(!new_hdr.exists(), "{args:?}: a header exported");
    }
}

/// `--encrypt --header HDR --reduce-device-size SIZE`: cryptsetup 2.6.1 encrypts from the end
/// with `datashift` resilience while the data stays where it is, so no hotzone is protected.
/// ucrypt refuses to start it (nothing written, no header made) and refuses the state
/// cryptsetup's `--init-only` leaves, naming it, in every verb that would read or write the
/// data (`export`, `reencrypt --resume-only`, `repair`), writing nothing; cryptsetup finishes
/// it, and the result is an ordinary detached-header volume ucrypt reads.
#[test]
fn reduce_device_size_with_a_detached_header_is_refused_by_name() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("rds-header");
    let vol = Encrypt.volume(&t, 32, 512);
    let rds = ["--reduce-device-size", "4M"];
    let o = run(UCRYPT, &vol.reencrypt(Ucrypt, &rds));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--reduce-device-size with a detached --header is refused"),
        "{err}"
    );
    assert!(!vol.meta().exists(), "a header was made");
    assert!(vol.raw() == vol.plain, "ucrypt wrote");
    ok(
        CRYPTSETUP,
        &vol.reencrypt(Cryptsetup, &[&rds[..], &["--init-only"]].concat()),
    );
    let out = t.path("out");
    for (what, verb) in [
        ("export", &["export"][..]),
        ("resume", &["reencrypt", "--resume-only", "-q"]),
        ("repair", &["repair", "-q"]),
    ] {
        let before = (std::fs::read(vol.meta()).expect("hdr"), vol.raw());
        let mut a = [verb, &vol.tail()].concat();
        if what == "export" {
            a.push(s(&out));
        }
        let o = run(UCRYPT, &a);
        let err = stderr(&o);
        assert_ne!(o.status.code(), Some(0), "{what}: {err}");
        assert!(err.contains("the data not moved"), "{what}: {err}");
        assert!(
            err.contains("cryptsetup reencrypt --resume-only"),
            "{what}: {err}"
        );
        assert!(
            before == (std::fs::read(vol.meta()).expect("hdr"), vol.raw()),
            "{what} wrote"
        );
    }
    ok(CRYPTSETUP, &vol.resume(Cryptsetup, &[]));
    assert!(vol.exported(&t) == vol.plain, "finished by cryptsetup");
}
