//! `ucrypt reencrypt` (offline key rotation, cipher / key size / sector size change,
//! decryption and encryption with a detached header; the rows of each below) against the real
//! cryptsetup 2.6 on files:
//! - ucrypt rotates, cryptsetup accepts the result (`open --test-passphrase`, `luksDump`) and
//!   the data read back with `ucrypt export` is the original plaintext; sector sizes 512 and
//!   4096, resilience checksum, journal and none;
//! - ucrypt is SIGKILLed at a random point, cryptsetup (`repair` if it was inside a hotzone,
//!   then `reencrypt --resume-only --force-offline-reencrypt`) finishes, data intact;
//! - cryptsetup is SIGKILLed mid-way (`--resilience checksum --hotzone-size 4M`), ucrypt
//!   (`repair` if needed, then `reencrypt --resume-only`) finishes, data intact.
//!
//! Needs `cryptsetup` (Debian package cryptsetup-bin); without it each test prints
//! `SKIPPED: <reason>` (or fails when the env var CI is set). Kill delays come from a seed
//! printed as `REENCRYPT_KILL_SEED=n` (set it to replay).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const UCRYPT: &str = env!("CARGO_BIN_EXE_ucrypt");
const FAST_PBKDF2: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
/// cryptsetup's default LUKS2 data offset.
const DATA_OFFSET: u64 = 16 << 20;

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "ucrypt-reenc-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn have_cryptsetup() -> bool {
    let ok = Command::new("cryptsetup")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !ok {
        if std::env::var_os("CI").is_some() {
            panic!("cryptsetup missing under CI: install the Debian package cryptsetup-bin");
        }
        println!("SKIPPED: cryptsetup not installed (Debian package cryptsetup-bin)");
    }
    ok
}

fn run(prog: &str, args: &[&str]) -> Output {
    Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"))
}

fn ok(prog: &str, args: &[&str]) -> String {
    let o = run(prog, args);
    assert!(
        o.status.success(),
        "{prog} {args:?} failed ({:?}):\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

fn plaintext(len: u64, salt: u64) -> Vec<u8> {
    let mut x = salt | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A cryptsetup-formatted LUKS2 file of `mib` MiB with one passphrase (key file `k`) and
/// known plaintext written through ucrypt; returns (image, key file, plaintext).
fn volume(t: &TempDir, mib: u64, sector: u32) -> (PathBuf, PathBuf, Vec<u8>) {
    let img = t.path("vol.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(mib << 20))
        .expect("image");
    let key = t.path("key");
    std::fs::write(&key, b"rotate-me").expect("key");
    let ss = sector.to_string();
    let mut f = vec!["luksFormat", "-q", "--type", "luks2", "--sector-size", &ss];
    f.extend(FAST_PBKDF2);
    f.extend([s(&img), s(&key)]);
    ok("cryptsetup", &f);
    let plain = plaintext((mib << 20) - DATA_OFFSET, mib ^ u64::from(sector));
    let pf = t.path("plain");
    std::fs::write(&pf, &plain).expect("plain");
    ok(UCRYPT, &["import", s(&pf), s(&img), "--key-file", s(&key)]);
    (img, key, plain)
}

fn exported(t: &TempDir, img: &Path, key: &Path) -> Vec<u8> {
    let out = t.path("out");
    let _ = std::fs::remove_file(&out);
    ok(UCRYPT, &["export", "--key-file", s(key), s(img), s(&out)]);
    std::fs::read(&out).expect("export")
}

fn dump(img: &Path) -> String {
    ok("cryptsetup", &["luksDump", s(img)])
}

fn in_reencryption(img: &Path) -> bool {
    dump(img).contains("online-reencrypt")
}

fn in_hotzone(img: &Path) -> bool {
    dump(img).contains("in-reencryption")
}

/// cryptsetup accepts the finished volume as a plain LUKS2 volume.
fn cryptsetup_accepts(img: &Path, key: &Path) {
    ok(
        "cryptsetup",
        &["open", "--test-passphrase", "--key-file", s(key), s(img)],
    );
    let d = dump(img);
    assert!(!d.contains("reencrypt"), "reencryption left in:\n{d}");
    assert_eq!(d.matches(": luks2").count(), 1, "one keyslot left:\n{d}");
}

fn seed() -> u64 {
    let seed = std::env::var("REENCRYPT_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!("REENCRYPT_KILL_SEED={seed}");
    seed
}

#[test]
fn ucrypt_rotates_cryptsetup_reads() {
    if !have_cryptsetup() {
        return;
    }
    for sector in [512u32, 4096] {
        for resilience in ["checksum", "journal", "none"] {
            let t = TempDir::new("rot");
            let (img, key, plain) = volume(&t, 24, sector);
            let before = dump(&img);
            ok(
                UCRYPT,
                &[
                    "reencrypt",
                    "--batch-mode",
                    "--force-offline-reencrypt",
                    "--resilience",
                    resilience,
                    "--hotzone-size",
                    "1M",
                    "--pbkdf",
                    "pbkdf2",
                    "--pbkdf-force-iterations",
                    "1000",
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
            cryptsetup_accepts(&img, &key);
            assert_ne!(before, dump(&img), "the header changed");
            assert!(
                exported(&t, &img, &key) == plain,
                "sector {sector} {resilience}: plaintext changed"
            );
        }
    }
}

/// An offline `none` rotation with its default 64 MiB hotzones rekeys each hotzone through a
/// 16 MiB buffer (`NONE_BUFFER_BYTES`): a 48 MiB volume is one hotzone three buffers long,
/// and a 112 MiB one two hotzones (back to back) and a last one. cryptsetup reads the result.
#[test]
fn none_hotzones_longer_than_the_buffer() {
    if !have_cryptsetup() {
        return;
    }
    for (mib, sector) in [(64u64, 512u32), (128, 4096)] {
        let t = TempDir::new("none-long");
        let (img, key, plain) = volume(&t, mib, sector);
        ok(
            UCRYPT,
            &[
                "reencrypt",
                "--batch-mode",
                "--resilience",
                "none",
                "--pbkdf",
                "pbkdf2",
                "--pbkdf-force-iterations",
                "1000",
                "--key-file",
                s(&key),
                s(&img),
            ],
        );
        cryptsetup_accepts(&img, &key);
        assert!(
            exported(&t, &img, &key) == plain,
            "{mib} MiB, sector {sector}: plaintext changed"
        );
    }
}

/// `--init-only` leaves what cryptsetup's `--init-only` leaves; cryptsetup finishes it.
#[test]
fn ucrypt_init_only_cryptsetup_finishes() {
    if !have_cryptsetup() {
        return;
    }
    for resilience in ["checksum", "journal", "none"] {
        let t = TempDir::new("init");
        let (img, key, plain) = volume(&t, 24, 4096);
        ok(
            UCRYPT,
            &[
                "reencrypt",
                "--init-only",
                "--resilience",
                resilience,
                "--pbkdf",
                "pbkdf2",
                "--pbkdf-force-iterations",
                "1000",
                "--key-file",
                s(&key),
                s(&img),
            ],
        );
        let d = dump(&img);
        assert!(d.contains("online-reencrypt-v2"), "{d}");
        assert!(d.contains(&format!("Resilience: {resilience}")), "{d}");
        // Where cryptsetup 2.6.1 puts the area on the same volume (measured).
        assert!(d.contains("Area offset:548864 [bytes]"), "{d}");
        assert!(d.contains("Area length:16228352 [bytes]"), "{d}");
        ok(
            "cryptsetup",
            &[
                "reencrypt",
                "--resume-only",
                "--force-offline-reencrypt",
                "-q",
                "--key-file",
                s(&key),
                s(&img),
            ],
        );
        cryptsetup_accepts(&img, &key);
        assert!(exported(&t, &img, &key) == plain, "{resilience}: data");
    }
}

/// `reencrypt` refuses what is not built, naming it, with cryptsetup's exit code 1.
#[test]
fn unbuilt_modes_are_refused_by_name() {
    if !have_cryptsetup() {
        return;
    }
    let t = TempDir::new("refuse");
    let (img, key, _) = volume(&t, 20, 512);
    let new_hdr = t.path("exported.hdr");
    for (args, word) in [
        // The volume is LUKS already (cryptsetup's words).
        (
            vec!["--encrypt", "--reduce-device-size", "32M"],
            "already LUKS",
        ),
        (vec!["--reduce-device-size", "32M"], "--reduce-device-size"),
        (
            vec![
                "--encrypt",
                "--reduce-device-size",
                "32M",
                "--header",
                s(&new_hdr),
            ],
            "detached --header",
        ),
        // The decryption that moves the data back protects its moved segment: `none` is
        // refused (cryptsetup's words).
        (
            vec!["--decrypt", "--header", s(&new_hdr), "--resilience", "none"],
            "cannot be applied",
        ),
    ] {
        let mut a = vec!["reencrypt", "-q", "--key-file", s(&key)];
        a.extend(args.iter());
        a.push(s(&img));
        let o = run(UCRYPT, &a);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(word), "{args:?}: {err}");
    }
    assert!(!in_reencryption(&img));
    assert!(!new_hdr.exists(), "no header exported");
}

/// Kills `cmd` after `delay`, returns whether it was still running.
fn kill_after(cmd: Command, delay: Duration) -> bool {
    kill_when(cmd, || true, delay)
}

/// Runs `cmd` until `until` holds (polled every millisecond; or `cmd` ends, or a minute
/// passed), waits `delay` more, then SIGKILLs it, as a crash would; returns whether it was
/// still running.
fn kill_when(cmd: Command, until: impl Fn() -> bool, delay: Duration) -> bool {
    kill_polling(cmd, until, delay, Some(Duration::from_millis(1)))
}

/// [`kill_when`] without a sleep between polls (`poll` `None`), for a window of a few writes,
/// and the kill at once.
fn kill_when_spinning(cmd: Command, until: impl Fn() -> bool) -> bool {
    kill_polling(cmd, until, Duration::ZERO, None)
}

fn kill_polling(
    mut cmd: Command,
    until: impl Fn() -> bool,
    delay: Duration,
    poll: Option<Duration>,
) -> bool {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let start = std::time::Instant::now();
    while !until()
        && child.try_wait().expect("wait").is_none()
        && start.elapsed() < Duration::from_secs(60)
    {
        match poll {
            Some(p) => std::thread::sleep(p),
            None => std::hint::spin_loop(),
        }
    }
    std::thread::sleep(delay);
    let running = child.try_wait().expect("wait").is_none();
    let _ = child.kill();
    let _ = child.wait();
    running
}

#[test]
fn cryptsetup_resumes_after_ucrypt_is_killed() {
    if !have_cryptsetup() {
        return;
    }
    kill_ucrypt_rounds(6, &[]);
}

/// ucrypt is SIGKILLed at seeded random points of a run with `extra` options (a cipher
/// change), then cryptsetup (`repair` if inside a hotzone, `reencrypt --resume-only`)
/// finishes it; the data must be intact.
fn kill_ucrypt_rounds(rounds: usize, extra: &[&str]) {
    let mut x = seed() | 1;
    let mut mid_way = 0;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let resilience = ["checksum", "journal"][round % 2];
        let t = TempDir::new("kill-u");
        let (img, key, plain) = volume(&t, 80, [512, 4096][round / 2 % 2]);
        let delay = Duration::from_millis(20 + x % 400);
        let mut cmd = Command::new(UCRYPT);
        cmd.args([
            "reencrypt",
            "-q",
            "--resilience",
            resilience,
            "--hotzone-size",
            "1M",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
            s(&key),
        ]);
        cmd.args(extra);
        cmd.arg(s(&img));
        let killed = kill_after(cmd, delay);
        let state = if !in_reencryption(&img) {
            "not in reencryption"
        } else if in_hotzone(&img) {
            ok(
                "cryptsetup",
                &["repair", "-q", "--key-file", s(&key), s(&img)],
            );
            "inside a hotzone"
        } else {
            "between hotzones"
        };
        println!("round {round} {resilience} {extra:?}: killed={killed} after {delay:?}: {state}");
        if in_reencryption(&img) {
            mid_way += 1;
            ok(
                "cryptsetup",
                &[
                    "reencrypt",
                    "--resume-only",
                    "--force-offline-reencrypt",
                    "-q",
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
            cryptsetup_accepts(&img, &key);
        }
        assert!(exported(&t, &img, &key) == plain, "round {round}: data");
    }
    println!("{mid_way} of {rounds} rounds left mid-way and finished by cryptsetup");
}

/// Rounds of killing cryptsetup (each a 208 MiB volume).
const ROUNDS_KILL_CRYPTSETUP: usize = 6;

#[test]
fn ucrypt_resumes_after_cryptsetup_is_killed() {
    if !have_cryptsetup() {
        return;
    }
    kill_cryptsetup_rounds(ROUNDS_KILL_CRYPTSETUP, &[]);
}

/// cryptsetup is SIGKILLed mid-way through a run with `extra` options (`--resilience
/// checksum --hotzone-size 4M` on a 208 MiB file), then ucrypt (`repair` if inside a hotzone,
/// after checking that `--resume-only` refuses it; `reencrypt --resume-only`) finishes it.
fn kill_cryptsetup_rounds(rounds: usize, extra: &[&str]) {
    let mut x = seed() | 1;
    let mut mid_way = 0;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let t = TempDir::new("kill-c");
        let (img, key, plain) = volume(&t, 208, [512, 4096][round % 2]);
        let delay = Duration::from_millis(80 + x % 260);
        let mut cmd = Command::new("cryptsetup");
        cmd.args([
            "reencrypt",
            "-q",
            "--force-offline-reencrypt",
            "--resilience",
            "checksum",
            "--hotzone-size",
            "4M",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
            s(&key),
        ]);
        cmd.args(extra);
        cmd.arg(s(&img));
        let killed = kill_after(cmd, delay);
        let hot = in_reencryption(&img) && in_hotzone(&img);
        if hot {
            // As cryptsetup: --resume-only refuses until repair recovered the hotzone.
            let o = run(
                UCRYPT,
                &["reencrypt", "--resume-only", "--key-file", s(&key), s(&img)],
            );
            assert_eq!(o.status.code(), Some(1));
            assert!(String::from_utf8_lossy(&o.stderr).contains("Run repair first"));
            ok(UCRYPT, &["repair", "-q", "--key-file", s(&key), s(&img)]);
        }
        println!(
            "round {round} {extra:?}: killed={killed} after {delay:?}: in reencryption {}, \
             inside a hotzone {hot}",
            in_reencryption(&img)
        );
        if in_reencryption(&img) {
            mid_way += 1;
            ok(
                UCRYPT,
                &[
                    "reencrypt",
                    "--resume-only",
                    "--force-offline-reencrypt",
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
            cryptsetup_accepts(&img, &key);
        }
        assert!(exported(&t, &img, &key) == plain, "round {round}: data");
    }
    println!("{mid_way} of {rounds} rounds left mid-way and finished by ucrypt");
}

/// The cipher, key size and sector size changes the interop rows make (each from a volume of
/// either sector size), with what luksDump must show after: cipher, sector size, key bits.
const CHANGES: &[(&[&str], &str, u32, u32)] = &[
    (
        &["--key-size", "256", "--sector-size", "4096"],
        "aes-xts-plain64",
        4096,
        256,
    ),
    (
        &["--cipher", "aes-cbc-essiv:sha256", "--sector-size", "512"],
        "aes-cbc-essiv:sha256",
        512,
        256,
    ),
];

/// ucrypt changes cipher, key size and sector size; cryptsetup reads the result and the
/// data is the original plaintext.
#[test]
fn ucrypt_changes_cipher_cryptsetup_reads() {
    if !have_cryptsetup() {
        return;
    }
    for (args, cipher, sector_new, bits) in CHANGES {
        for sector in [512u32, 4096] {
            for resilience in ["checksum", "journal", "none"] {
                let t = TempDir::new("cipher");
                let (img, key, plain) = volume(&t, 24, sector);
                let mut a = vec![
                    "reencrypt",
                    "--batch-mode",
                    "--resilience",
                    resilience,
                    "--hotzone-size",
                    "1M",
                    "--key-file",
                    s(&key),
                ];
                a.extend(FAST_PBKDF2);
                a.extend(args.iter());
                a.push(s(&img));
                ok(UCRYPT, &a);
                cryptsetup_accepts(&img, &key);
                let d = dump(&img);
                assert!(d.contains(&format!("cipher: {cipher}\n")), "{args:?}:\n{d}");
                assert!(d.contains(&format!("sector: {sector_new} [bytes]")), "{d}");
                assert!(d.contains(&format!("Key:        {bits} bits")), "{d}");
                assert!(
                    exported(&t, &img, &key) == plain,
                    "{args:?} from {sector} {resilience}: plaintext changed"
                );
            }
        }
    }
}

/// ucrypt killed during a cipher change; cryptsetup finishes.
#[test]
fn cryptsetup_finishes_a_cipher_change_ucrypt_was_killed_in() {
    if !have_cryptsetup() {
        return;
    }
    for (args, ..) in CHANGES {
        kill_ucrypt_rounds(4, args);
    }
}

/// cryptsetup killed during a cipher change; ucrypt finishes.
#[test]
fn ucrypt_finishes_a_cipher_change_cryptsetup_was_killed_in() {
    if !have_cryptsetup() {
        return;
    }
    for (args, ..) in CHANGES {
        kill_cryptsetup_rounds(4, args);
    }
}

/// Two keyslots: without `--key-slot` a key file is refused (exit 1, cryptsetup's rule); with
/// it the named keyslot's passphrase gets the new key, and finalisation drops every old
/// keyslot (cryptsetup 2.6.1 does the same); a wrong passphrase exits 2 as cryptsetup's.
#[test]
fn key_slot_rotation_with_two_keyslots() {
    if !have_cryptsetup() {
        return;
    }
    let t = TempDir::new("slots");
    let (img, key, plain) = volume(&t, 20, 4096);
    let key2 = t.path("key2");
    std::fs::write(&key2, b"second").expect("key2");
    let mut a = vec!["luksAddKey", "-q", "--key-file", s(&key)];
    a.extend(FAST_PBKDF2);
    a.extend([s(&img), s(&key2)]);
    ok("cryptsetup", &a);
    let o = run(UCRYPT, &["reencrypt", "-q", "--key-file", s(&key), s(&img)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("exactly one key slot active"));
    let wrong = t.path("wrong");
    std::fs::write(&wrong, b"nope").expect("wrong");
    let o = run(
        UCRYPT,
        &[
            "reencrypt",
            "-q",
            "--key-slot",
            "1",
            "--key-file",
            s(&wrong),
            s(&img),
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(!in_reencryption(&img));
    let mut a = vec!["reencrypt", "-q", "--key-slot", "1", "--key-file", s(&key2)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    cryptsetup_accepts(&img, &key2);
    let o = run(
        "cryptsetup",
        &["open", "--test-passphrase", "--key-file", s(&key), s(&img)],
    );
    assert_eq!(o.status.code(), Some(2), "the other old keyslot is gone");
    assert!(exported(&t, &img, &key2) == plain);
}

// ---------------------------------------------------------------- decryption (detached header)

/// A cryptsetup-formatted volume with a detached header: the data file of `mib` MiB (data
/// offset 0) holds known plaintext written through ucrypt; returns (data, header, key file,
/// plaintext).
fn detached_volume(t: &TempDir, mib: u64, sector: u32) -> (PathBuf, PathBuf, PathBuf, Vec<u8>) {
    let img = t.path("data.img");
    let hdr = t.path("hdr.img");
    for (p, len) in [(&img, mib << 20), (&hdr, 16 << 20)] {
        std::fs::File::create(p)
            .and_then(|f| f.set_len(len))
            .expect("file");
    }
    let key = t.path("key");
    std::fs::write(&key, b"decrypt-me").expect("key");
    let ss = sector.to_string();
    let mut f = vec![
        "luksFormat",
        "-q",
        "--type",
        "luks2",
        "--sector-size",
        &ss,
        "--header",
        s(&hdr),
    ];
    f.extend(FAST_PBKDF2);
    f.extend([s(&img), s(&key)]);
    ok("cryptsetup", &f);
    let plain = plaintext(mib << 20, mib ^ u64::from(sector) ^ 0xdec);
    let pf = t.path("plain");
    std::fs::write(&pf, &plain).expect("plain");
    ok(
        UCRYPT,
        &[
            "import",
            s(&pf),
            s(&img),
            "--header",
            s(&hdr),
            "--key-file",
            s(&key),
        ],
    );
    assert!(std::fs::read(&img).expect("data") != plain, "encrypted");
    (img, hdr, key, plain)
}

/// cryptsetup reads the header a finished decryption leaves (one linear segment, no
/// keyslot, no reencryption), and the data file is the plaintext.
fn decrypted(img: &Path, hdr: &Path, plain: &[u8], what: &str) {
    let d = dump(hdr);
    assert!(
        !d.contains("reencrypt"),
        "{what}: reencryption left in:\n{d}"
    );
    assert!(d.contains("0: linear"), "{what}: {d}");
    assert!(!d.contains(": luks2"), "{what}: keyslots left:\n{d}");
    let got = std::fs::read(img).expect("data");
    assert!(
        got == plain,
        "{what}: the data file is not the plaintext; {}",
        differences(&got, plain)
    );
}

/// Where `got` differs from `want`, in runs of 4 KiB blocks (byte offsets), for a failure's
/// message: which hotzones went wrong says which step did.
fn differences(got: &[u8], want: &[u8]) -> String {
    const BLOCK: usize = 4096;
    if got.len() != want.len() {
        return format!("{} bytes, not {}", got.len(), want.len());
    }
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (i, (g, w)) in got.chunks(BLOCK).zip(want.chunks(BLOCK)).enumerate() {
        if g != w {
            match runs.last_mut() {
                Some((_, end)) if *end == i * BLOCK => *end += g.len(),
                _ => runs.push((i * BLOCK, i * BLOCK + g.len())),
            }
        }
    }
    let shown: Vec<String> = runs
        .iter()
        .take(20)
        .map(|(a, b)| format!("[{a:#x}, {b:#x})"))
        .collect();
    format!(
        "{} runs of 4 KiB blocks differ: {}{}",
        runs.len(),
        shown.join(" "),
        if runs.len() > 20 { " ..." } else { "" }
    )
}

#[test]
fn ucrypt_decrypts_cryptsetup_reads() {
    if !have_cryptsetup() {
        return;
    }
    for sector in [512u32, 4096] {
        for resilience in ["checksum", "journal", "none"] {
            let t = TempDir::new("decrypt");
            let (img, hdr, key, plain) = detached_volume(&t, 24, sector);
            ok(
                UCRYPT,
                &[
                    "reencrypt",
                    "--decrypt",
                    "--header",
                    s(&hdr),
                    "-q",
                    "--resilience",
                    resilience,
                    "--hotzone-size",
                    "1M",
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
            decrypted(&img, &hdr, &plain, &format!("{sector} {resilience}"));
        }
    }
    // Without --header: cryptsetup's refusal, exit 1, nothing written.
    let t = TempDir::new("decrypt-nohdr");
    let (img, key, _) = volume(&t, 20, 512);
    let o = run(
        UCRYPT,
        &[
            "reencrypt",
            "--decrypt",
            "-q",
            "--key-file",
            s(&key),
            s(&img),
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("detached header"));
    assert!(!in_reencryption(&img));
}

/// ucrypt's decryption `--init-only`, then cryptsetup finishes it.
#[test]
fn ucrypt_init_decrypt_cryptsetup_finishes() {
    if !have_cryptsetup() {
        return;
    }
    let t = TempDir::new("decrypt-init");
    let (img, hdr, key, plain) = detached_volume(&t, 24, 4096);
    ok(
        UCRYPT,
        &[
            "reencrypt",
            "--decrypt",
            "--init-only",
            "--header",
            s(&hdr),
            "--key-file",
            s(&key),
            s(&img),
        ],
    );
    let d = dump(&hdr);
    assert!(d.contains("Mode:       decrypt"), "{d}");
    assert!(d.contains("Direction:  backward"), "{d}");
    assert!(d.contains("2: linear"), "{d}");
    ok(
        "cryptsetup",
        &[
            "reencrypt",
            "--resume-only",
            "--force-offline-reencrypt",
            "-q",
            "--header",
            s(&hdr),
            "--key-file",
            s(&key),
            s(&img),
        ],
    );
    decrypted(&img, &hdr, &plain, "init-only");
}

#[test]
fn cryptsetup_finishes_a_decryption_ucrypt_was_killed_in() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    let mut mid_way = 0;
    let rounds = 4;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let resilience = ["checksum", "journal"][round % 2];
        let t = TempDir::new("kill-ud");
        let (img, hdr, key, plain) = detached_volume(&t, 80, [512, 4096][round / 2 % 2]);
        let delay = Duration::from_millis(20 + x % 400);
        let mut cmd = Command::new(UCRYPT);
        cmd.args([
            "reencrypt",
            "--decrypt",
            "--header",
            s(&hdr),
            "-q",
            "--resilience",
            resilience,
            "--hotzone-size",
            "1M",
            "--key-file",
            s(&key),
        ]);
        cmd.args(FAST_PBKDF2);
        cmd.arg(s(&img));
        let killed = kill_after(cmd, delay);
        // The header as the kill left it, for a failure's message.
        let as_killed = dump(&hdr);
        let state = if !in_reencryption(&hdr) {
            "not in reencryption"
        } else if in_hotzone(&hdr) {
            ok(
                "cryptsetup",
                &[
                    "repair",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
            "inside a hotzone"
        } else {
            "between hotzones"
        };
        println!("decrypt round {round} {resilience}: killed={killed} after {delay:?}: {state}");
        if in_reencryption(&hdr) {
            mid_way += 1;
            ok(
                "cryptsetup",
                &[
                    "reencrypt",
                    "--resume-only",
                    "--force-offline-reencrypt",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
        }
        if dump(&hdr).contains(": luks2") {
            // Killed before the init's commit: still the encrypted volume.
            ok(
                "cryptsetup",
                &[
                    "reencrypt",
                    "--decrypt",
                    "--force-offline-reencrypt",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
        }
        let what = format!("round {round} ({state}); the header as killed:\n{as_killed}\n");
        decrypted(&img, &hdr, &plain, &what);
    }
    println!("{mid_way} of {rounds} decryptions left mid-way and finished by cryptsetup");
}

/// Whether the primary copy of the LUKS2 header in `hdr` (its JSON area, read straight from
/// the file: cheap enough to poll without a pause) has a hotzone segment at data offset 0, the
/// last hotzone of a backward walk. A torn read (a copy being written) says no.
fn in_last_backward_hotzone(hdr: &Path) -> bool {
    use std::io::Read;
    let mut json = vec![0u8; 16384 - 4096];
    let read = std::fs::File::open(hdr)
        .and_then(|mut f| {
            std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(4096))?;
            f.read_exact(&mut json)
        })
        .is_ok();
    let end = json.iter().position(|&b| b == 0).unwrap_or(json.len());
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&json[..end]) else {
        return false;
    };
    read && v["segments"].as_object().is_some_and(|segs| {
        segs.values().any(|seg| {
            seg["offset"] == "0"
                && seg["flags"]
                    .as_array()
                    .is_some_and(|f| f.iter().any(|x| x == "in-reencryption"))
        })
    })
}

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
    if !have_cryptsetup() {
        return;
    }
    for (resilience, sector) in [("journal", 512), ("checksum", 512), ("journal", 4096)] {
        let t = TempDir::new("kill-last");
        let (img, hdr, key, plain) = detached_volume(&t, 24, sector);
        let mut cmd = Command::new(UCRYPT);
        cmd.args(["reencrypt", "--decrypt", "--header", s(&hdr), "-q"])
            .args(["--resilience", resilience, "--hotzone-size", "1M"])
            .args(["--key-file", s(&key)])
            .args(FAST_PBKDF2)
            .arg(s(&img));
        let killed = kill_when_spinning(cmd, || in_last_backward_hotzone(&hdr));
        let as_killed = dump(&hdr);
        let what = format!("{resilience}/{sector}; the header as killed:\n{as_killed}\n");
        assert!(killed, "{what}: ucrypt ended before the kill");
        assert!(in_hotzone(&hdr), "{what}: not killed inside a hotzone");
        assert!(
            in_last_backward_hotzone(&hdr),
            "{what}: not the last hotzone"
        );
        let args = ["-q", "--header", s(&hdr), "--key-file", s(&key), s(&img)];
        ok("cryptsetup", &[&["repair"][..], &args].concat());
        if in_reencryption(&hdr) {
            let resume = ["reencrypt", "--resume-only", "--force-offline-reencrypt"];
            ok("cryptsetup", &[&resume[..], &args].concat());
        }
        decrypted(&img, &hdr, &plain, &what);
        println!("{resilience}/{sector}: killed in the last hotzone, cryptsetup finished it");
    }
}

/// A decryption cryptsetup was killed in after its finalisation destroyed the old key's
/// keyslots (or wiped one's area) and before it cleared the requirement: no passphrase opens
/// the header any more,
/// so ucrypt's `--resume-only` or `export` failed (`ucrypt`). cryptsetup must refuse to
/// resume it too,
/// and every byte must already be plaintext (`data_plain`).
fn killed_in_finalisation(
    hdr: &Path,
    key: &Path,
    img: &Path,
    ucrypt: &std::process::Output,
    data_plain: bool,
    what: &str,
) {
    let c = run(
        "cryptsetup",
        &[
            "reencrypt",
            "--resume-only",
            "--force-offline-reencrypt",
            "-q",
            "--header",
            s(hdr),
            "--key-file",
            s(key),
            s(img),
        ],
    );
    assert!(
        !c.status.success(),
        "{what}: cryptsetup resumed a decryption ucrypt refused ({})",
        String::from_utf8_lossy(&ucrypt.stderr)
    );
    assert!(
        data_plain,
        "{what}: killed in finalisation, but the data is not all plaintext"
    );
    println!(
        "{what}: killed in cryptsetup's finalisation (its keyslots destroyed): neither tool \
         resumes; the data is plaintext"
    );
}

#[test]
fn ucrypt_finishes_a_decryption_cryptsetup_was_killed_in() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    let mut mid_way = 0;
    let rounds = 4;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let t = TempDir::new("kill-cd");
        let (img, hdr, key, plain) = detached_volume(&t, 208, [512, 4096][round % 2]);
        // cryptsetup calibrates the reencryption digest for about a second first.
        let delay = Duration::from_millis(1000 + x % 1800);
        let mut cmd = Command::new("cryptsetup");
        cmd.args([
            "reencrypt",
            "--decrypt",
            "--header",
            s(&hdr),
            "-q",
            "--force-offline-reencrypt",
            "--resilience",
            "checksum",
            "--hotzone-size",
            "4M",
            "--key-file",
            s(&key),
            s(&img),
        ]);
        let killed = kill_after(cmd, delay);
        let hot = in_reencryption(&hdr) && in_hotzone(&hdr);
        let with_hdr = |verb: &[&str]| -> Vec<String> {
            let mut a: Vec<String> = verb.iter().map(|v| v.to_string()).collect();
            a.extend(
                ["--header", s(&hdr), "--key-file", s(&key), s(&img)]
                    .iter()
                    .map(|v| v.to_string()),
            );
            a
        };
        if hot {
            let a = with_hdr(&["reencrypt", "--resume-only"]);
            let o = run(UCRYPT, &a.iter().map(String::as_str).collect::<Vec<_>>());
            assert_eq!(o.status.code(), Some(1));
            assert!(String::from_utf8_lossy(&o.stderr).contains("Run repair first"));
            let a = with_hdr(&["repair", "-q"]);
            ok(UCRYPT, &a.iter().map(String::as_str).collect::<Vec<_>>());
        }
        println!(
            "decrypt round {round}: killed={killed} after {delay:?}: in reencryption {}, \
             inside a hotzone {hot}",
            in_reencryption(&hdr)
        );
        if in_reencryption(&hdr) {
            let a = with_hdr(&["reencrypt", "--resume-only", "-q"]);
            let o = run(UCRYPT, &a.iter().map(String::as_str).collect::<Vec<_>>());
            // Killed in its finalisation: the keyslots gone from the JSON, or one still listed
            // whose area was already (partly) wiped (no passphrase opens it: cryptsetup wipes
            // the area before it commits the keyslot's removal).
            let err = String::from_utf8_lossy(&o.stderr);
            let no_key = err.contains("No usable keyslot") || err.contains("No key available");
            if !o.status.success() && (!dump(&hdr).contains(": luks2") || no_key) {
                let what = format!("decrypt round {round}");
                let data_plain = std::fs::read(&img).expect("data") == plain;
                killed_in_finalisation(&hdr, &key, &img, &o, data_plain, &what);
                continue;
            }
            assert!(
                o.status.success(),
                "round {round}: ucrypt --resume-only failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            mid_way += 1;
        }
        if dump(&hdr).contains(": luks2") {
            // Killed before the init's commit: ucrypt decrypts it whole.
            let a = with_hdr(&["reencrypt", "--decrypt", "-q"]);
            ok(UCRYPT, &a.iter().map(String::as_str).collect::<Vec<_>>());
        }
        decrypted(&img, &hdr, &plain, &format!("round {round}"));
    }
    println!("{mid_way} of {rounds} decryptions left mid-way and finished by ucrypt");
}

// ---------------------------------------------------------------- encryption (detached header)

/// A plaintext data file of `mib` MiB; returns (data, header path (not created), key file,
/// plaintext).
fn plain_volume(t: &TempDir, mib: u64) -> (PathBuf, PathBuf, PathBuf, Vec<u8>) {
    let img = t.path("data.img");
    let plain = plaintext(mib << 20, mib ^ 0xe4c);
    std::fs::write(&img, &plain).expect("data");
    let key = t.path("key");
    std::fs::write(&key, b"encrypt-me").expect("key");
    (img, t.path("hdr.img"), key, plain)
}

/// cryptsetup's `open --test-passphrase` of `img` through the detached header `hdr` with the
/// passphrase in `key`.
fn cryptsetup_test_passphrase(img: &Path, hdr: &Path, key: &Path) -> Output {
    run(
        "cryptsetup",
        &[
            "open",
            "--test-passphrase",
            "--header",
            s(hdr),
            "--key-file",
            s(key),
            s(img),
        ],
    )
}

/// cryptsetup accepts the finished encryption (`open --test-passphrase`, `luksDump` of the
/// header: one keyslot, no reencryption) and `ucrypt export` through the header gives the
/// plaintext, while the data file itself no longer holds it.
fn encrypted(t: &TempDir, img: &Path, hdr: &Path, key: &Path, plain: &[u8], what: &str) {
    let o = cryptsetup_test_passphrase(img, hdr, key);
    assert!(
        o.status.success(),
        "{what}: cryptsetup open --test-passphrase: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let d = dump(hdr);
    assert!(
        !d.contains("reencrypt"),
        "{what}: reencryption left in:\n{d}"
    );
    assert_eq!(d.matches(": luks2").count(), 1, "{what}: one keyslot:\n{d}");
    assert!(
        std::fs::read(img).expect("data") != plain,
        "{what}: still plaintext"
    );
    let out = t.path("out");
    let _ = std::fs::remove_file(&out);
    ok(
        UCRYPT,
        &[
            "export",
            "--header",
            s(hdr),
            "--key-file",
            s(key),
            s(img),
            s(&out),
        ],
    );
    assert!(
        std::fs::read(&out).expect("export") == plain,
        "{what}: the plaintext changed"
    );
}

#[test]
fn ucrypt_encrypts_cryptsetup_reads() {
    if !have_cryptsetup() {
        return;
    }
    for sector in ["512", "4096"] {
        for resilience in ["checksum", "journal", "none"] {
            let t = TempDir::new("encrypt");
            let (img, hdr, key, plain) = plain_volume(&t, 24);
            let mut a = vec![
                "reencrypt",
                "--encrypt",
                "--header",
                s(&hdr),
                "-q",
                "--sector-size",
                sector,
                "--resilience",
                resilience,
                "--hotzone-size",
                "1M",
                "--key-file",
                s(&key),
            ];
            a.extend(FAST_PBKDF2);
            a.push(s(&img));
            ok(UCRYPT, &a);
            let d = dump(&hdr);
            assert!(d.contains(&format!("sector: {sector} [bytes]")), "{d}");
            encrypted(
                &t,
                &img,
                &hdr,
                &key,
                &plain,
                &format!("{sector} {resilience}"),
            );
        }
    }
    // Without --header: cryptsetup's refusal, exit 1, the data untouched.
    let t = TempDir::new("encrypt-nohdr");
    let (img, _, key, plain) = plain_volume(&t, 20);
    let o = run(
        UCRYPT,
        &[
            "reencrypt",
            "--encrypt",
            "-q",
            "--key-file",
            s(&key),
            s(&img),
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--reduce-device-size"));
    assert!(std::fs::read(&img).expect("data") == plain);
}

/// ucrypt's `--encrypt --init-only` header, then cryptsetup finishes the encryption.
#[test]
fn ucrypt_init_encrypt_cryptsetup_finishes() {
    if !have_cryptsetup() {
        return;
    }
    let t = TempDir::new("encrypt-init");
    let (img, hdr, key, plain) = plain_volume(&t, 24);
    let mut a = vec![
        "reencrypt",
        "--encrypt",
        "--init-only",
        "--header",
        s(&hdr),
        "--key-file",
        s(&key),
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    let d = dump(&hdr);
    assert!(d.contains("Mode:       encrypt"), "{d}");
    assert!(d.contains("0: linear"), "{d}");
    ok(
        "cryptsetup",
        &[
            "reencrypt",
            "--resume-only",
            "--force-offline-reencrypt",
            "-q",
            "--header",
            s(&hdr),
            "--key-file",
            s(&key),
            s(&img),
        ],
    );
    encrypted(&t, &img, &hdr, &key, &plain, "init-only");
}

#[test]
fn cryptsetup_finishes_an_encryption_ucrypt_was_killed_in() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    let mut mid_way = 0;
    let rounds = 4;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let resilience = ["checksum", "journal"][round % 2];
        let sector = ["512", "4096"][round / 2 % 2];
        let t = TempDir::new("kill-ue");
        let (img, hdr, key, plain) = plain_volume(&t, 80);
        let delay = Duration::from_millis(20 + x % 400);
        let mut cmd = Command::new(UCRYPT);
        cmd.args([
            "reencrypt",
            "--encrypt",
            "--header",
            s(&hdr),
            "-q",
            "--sector-size",
            sector,
            "--resilience",
            resilience,
            "--hotzone-size",
            "1M",
            "--key-file",
            s(&key),
        ]);
        cmd.args(FAST_PBKDF2);
        cmd.arg(s(&img));
        let killed = kill_after(cmd, delay);
        let have_hdr = run("cryptsetup", &["isLuks", s(&hdr)]).status.success();
        let state = if !have_hdr {
            "no header yet"
        } else if !in_reencryption(&hdr) {
            "not in reencryption"
        } else if in_hotzone(&hdr) {
            ok(
                "cryptsetup",
                &[
                    "repair",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
            "inside a hotzone"
        } else {
            "between hotzones"
        };
        println!(
            "encrypt round {round} {resilience} {sector}: killed={killed} after {delay:?}: {state}"
        );
        if !have_hdr {
            assert!(std::fs::read(&img).expect("data") == plain, "untouched");
            continue;
        }
        if in_reencryption(&hdr) {
            mid_way += 1;
            ok(
                "cryptsetup",
                &[
                    "reencrypt",
                    "--resume-only",
                    "--force-offline-reencrypt",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
        }
        encrypted(&t, &img, &hdr, &key, &plain, &format!("round {round}"));
    }
    println!("{mid_way} of {rounds} encryptions left mid-way and finished by cryptsetup");
}

#[test]
fn ucrypt_finishes_an_encryption_cryptsetup_was_killed_in() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    let mut mid_way = 0;
    let rounds = 4;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let t = TempDir::new("kill-ce");
        let (img, hdr, key, plain) = plain_volume(&t, 208);
        let delay = Duration::from_millis(100 + x % 1500);
        let mut cmd = Command::new("cryptsetup");
        cmd.args([
            "reencrypt",
            "--encrypt",
            "--header",
            s(&hdr),
            "-q",
            "--force-offline-reencrypt",
            "--sector-size",
            ["512", "4096"][round % 2],
            "--resilience",
            "checksum",
            "--hotzone-size",
            "4M",
            "--key-file",
            s(&key),
        ]);
        cmd.args(FAST_PBKDF2);
        cmd.arg(s(&img));
        let killed = kill_after(cmd, delay);
        let have_hdr = run("cryptsetup", &["isLuks", s(&hdr)]).status.success();
        let hot = have_hdr && in_reencryption(&hdr) && in_hotzone(&hdr);
        let args = |verb: &[&str]| -> Vec<String> {
            verb.iter()
                .chain(&["--header", s(&hdr), "--key-file", s(&key), s(&img)])
                .map(|v| v.to_string())
                .collect()
        };
        if hot {
            let a = args(&["reencrypt", "--resume-only"]);
            let o = run(UCRYPT, &a.iter().map(String::as_str).collect::<Vec<_>>());
            assert_eq!(o.status.code(), Some(1));
            assert!(String::from_utf8_lossy(&o.stderr).contains("Run repair first"));
            let a = args(&["repair", "-q"]);
            ok(UCRYPT, &a.iter().map(String::as_str).collect::<Vec<_>>());
        }
        let mid = have_hdr && in_reencryption(&hdr);
        println!(
            "encrypt round {round}: killed={killed} after {delay:?}: header {have_hdr}, in \
             reencryption {mid}, inside a hotzone {hot}"
        );
        if !have_hdr {
            continue;
        }
        if !mid && std::fs::read(&img).expect("data") == plain {
            // cryptsetup writes its new header in several commits: killed between them it
            // leaves a header without reencryption metadata over the plaintext.
            println!("encrypt round {round}: cryptsetup left a plain header over plaintext");
            continue;
        }
        if mid {
            mid_way += 1;
            let a = args(&["reencrypt", "--resume-only", "-q"]);
            ok(UCRYPT, &a.iter().map(String::as_str).collect::<Vec<_>>());
        }
        encrypted(&t, &img, &hdr, &key, &plain, &format!("round {round}"));
    }
    println!("{mid_way} of {rounds} encryptions left mid-way and finished by ucrypt");
}

// ---------------------------------------------------------------- encryption moving the data

/// `--reduce-device-size` of the data-moving rows: a shift (and data offset) of 16 MiB, the
/// moved segment's hotzone 16 MiB.
const REDUCE: &str = "32M";
const SHIFT: u64 = 16 << 20;

/// A plaintext file of `mib` MiB whose last 32 MiB are free (a filesystem shrunk by
/// --reduce-device-size); returns (image, key file, the plaintext before the free space).
fn shift_volume(t: &TempDir, mib: u64) -> (PathBuf, PathBuf, Vec<u8>) {
    let img = t.path("data.img");
    let all = plaintext(mib << 20, mib ^ 0x5417);
    std::fs::write(&img, &all).expect("data");
    let key = t.path("key");
    std::fs::write(&key, b"shift-me").expect("key");
    let plain = all[..all.len() - 2 * SHIFT as usize].to_vec();
    (img, key, plain)
}

/// cryptsetup accepts the finished volume (`open --test-passphrase`, `luksDump`: one keyslot,
/// no reencryption, the data at the shift) and `ucrypt export` gives the plaintext first
/// (the volume grew by the shift).
fn shift_encrypted(t: &TempDir, img: &Path, key: &Path, plain: &[u8], what: &str) {
    cryptsetup_accepts(img, key);
    let d = dump(img);
    assert!(
        d.contains(&format!("offset: {SHIFT} [bytes]")),
        "{what}:\n{d}"
    );
    let raw = std::fs::read(img).expect("data");
    assert!(
        raw[SHIFT as usize..SHIFT as usize + plain.len()] != plain[..],
        "{what}: still plaintext"
    );
    let got = exported(t, img, key);
    assert_eq!(got.len(), plain.len() + SHIFT as usize, "{what}: size");
    assert!(
        got[..plain.len()] == plain[..],
        "{what}: the plaintext changed"
    );
}

fn shift_args<'a>(key: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "reencrypt",
        "--encrypt",
        "--reduce-device-size",
        REDUCE,
        "-q",
        "--key-file",
        s(key),
    ];
    a.extend(FAST_PBKDF2);
    a.extend(extra);
    a
}

#[test]
fn ucrypt_shift_encrypts_cryptsetup_reads() {
    if !have_cryptsetup() {
        return;
    }
    for sector in ["512", "4096"] {
        let t = TempDir::new("shift");
        let (img, key, plain) = shift_volume(&t, 84);
        let mut a = shift_args(&key, &["--sector-size", sector]);
        a.push(s(&img));
        ok(UCRYPT, &a);
        let d = dump(&img);
        assert!(d.contains(&format!("sector: {sector} [bytes]")), "{d}");
        shift_encrypted(&t, &img, &key, &plain, sector);
    }
}

/// The metadata cryptsetup's JSON carries, minus what is random (salts, digests, UUIDs,
/// iterations of calibrated digests) and what orders keys.
fn shift_metadata(img: &Path) -> String {
    let j = ok("cryptsetup", &["luksDump", "--dump-json-metadata", s(img)]);
    let v: serde_json::Value = serde_json::from_str(&j).expect("json");
    let digests: Vec<_> = v["digests"]
        .as_object()
        .unwrap()
        .values()
        .map(|d| (d["keyslots"].clone(), d["segments"].clone()))
        .collect();
    let mut ks = v["keyslots"].clone();
    for k in ks.as_object_mut().unwrap().values_mut() {
        if let Some(kdf) = k.get_mut("kdf") {
            kdf["salt"] = serde_json::Value::Null;
        }
    }
    format!(
        "keyslots {}\nsegments {}\ndigests {digests:?}\nconfig {}",
        ks, v["segments"], v["config"]
    )
}

/// `--encrypt --header HDR --reduce-device-size SIZE`: cryptsetup 2.6.1 encrypts from the end
/// with `datashift` resilience while the data stays where it is, so no hotzone is protected.
/// ucrypt refuses to start it (nothing written, no header made) and refuses the state
/// cryptsetup's `--init-only` leaves, naming it, in every verb that would read or write the
/// data (`export`, `reencrypt --resume-only`, `repair`), writing nothing; cryptsetup finishes
/// it, and the result is an ordinary detached-header volume ucrypt reads.
#[test]
fn reduce_device_size_with_a_detached_header_is_refused_by_name() {
    if !have_cryptsetup() {
        return;
    }
    let t = TempDir::new("rds-header");
    let img = t.path("data.img");
    let plain = plaintext(32 << 20, 0x5eed);
    std::fs::write(&img, &plain).expect("plaintext");
    let key = t.path("key");
    std::fs::write(&key, b"rotate-me").expect("key");
    let hdr = t.path("hdr");
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "reencrypt",
            "--encrypt",
            "--header",
            s(&hdr),
            "--reduce-device-size",
            "4M",
            "-q",
            "--key-file",
            s(&key),
        ];
        a.extend(FAST_PBKDF2);
        a.extend(extra);
        a.push(s(&img));
        a
    };
    let o = run(UCRYPT, &args(&[]));
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--reduce-device-size with a detached --header is refused"),
        "{err}"
    );
    assert!(!hdr.exists(), "a header was made");
    assert!(std::fs::read(&img).expect("image") == plain, "ucrypt wrote");

    ok("cryptsetup", &args(&["--init-only"]));
    let out = t.path("out");
    let base = ["--header", s(&hdr), "--key-file", s(&key)];
    for (what, a) in [
        (
            "export",
            [&["export"][..], &base, &[s(&img), s(&out)]].concat(),
        ),
        (
            "reencrypt --resume-only",
            [&["reencrypt", "--resume-only", "-q"][..], &base, &[s(&img)]].concat(),
        ),
        (
            "repair",
            [&["repair", "-q"][..], &base, &[s(&img)]].concat(),
        ),
    ] {
        let before = (
            std::fs::read(&hdr).expect("hdr"),
            std::fs::read(&img).expect("img"),
        );
        let o = run(UCRYPT, &a);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_ne!(o.status.code(), Some(0), "{what}: {err}");
        assert!(err.contains("the data not moved"), "{what}: {err}");
        assert!(
            err.contains("cryptsetup reencrypt --resume-only"),
            "{what}: {err}"
        );
        let after = (
            std::fs::read(&hdr).expect("hdr"),
            std::fs::read(&img).expect("img"),
        );
        assert!(before == after, "{what} wrote");
    }
    ok(
        "cryptsetup",
        &[
            &[
                "reencrypt",
                "--resume-only",
                "-q",
                "--force-offline-reencrypt",
            ][..],
            &base,
            &[s(&img)],
        ]
        .concat(),
    );
    let _ = std::fs::remove_file(&out);
    ok(
        UCRYPT,
        &[&["export"][..], &base, &[s(&img), s(&out)]].concat(),
    );
    assert!(
        std::fs::read(&out).expect("export") == plain,
        "finished by cryptsetup"
    );
}

/// Both tools' `--init-only` on the same plaintext: the same keyslots (reencrypt keyslot:
/// mode, direction, datashift area at the same place, shift size), segments (moved segment,
/// backups, in cryptsetup's order) and digest lists, the same bytes moved to the same
/// place; then each tool finishes what the other started.
#[test]
fn shift_init_matches_cryptsetup_and_each_finishes_the_other() {
    if !have_cryptsetup() {
        return;
    }
    for sector in ["512", "4096"] {
        let t = TempDir::new("shift-init");
        let (img, key, plain) = shift_volume(&t, 72);
        let theirs = t.path("theirs.img");
        std::fs::copy(&img, &theirs).expect("copy");
        let mut a = shift_args(&key, &["--init-only", "--sector-size", sector]);
        a.push(s(&img));
        ok(UCRYPT, &a);
        let mut c = shift_args(
            &key,
            &[
                "--init-only",
                "--force-offline-reencrypt",
                "--sector-size",
                sector,
            ],
        );
        c.push(s(&theirs));
        let o = Command::new("cryptsetup")
            .args(&c)
            .current_dir(&t.0)
            .stdin(Stdio::null())
            .output()
            .expect("cryptsetup");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(shift_metadata(&img), shift_metadata(&theirs), "{sector}");
        // `dump` shows the state as luksDump does, to the byte.
        for f in [&img, &theirs] {
            assert_eq!(ok(UCRYPT, &["dump", s(f)]), dump(f), "{sector}: dump");
        }
        let (mine_raw, their_raw) = (
            std::fs::read(&img).expect("mine"),
            std::fs::read(&theirs).expect("theirs"),
        );
        let moved = mine_raw.len() - SHIFT as usize;
        assert!(
            mine_raw[moved..] == plain[..SHIFT as usize],
            "moved segment"
        );
        assert!(mine_raw[moved..] == their_raw[moved..]);
        assert!(
            mine_raw[SHIFT as usize..moved - SHIFT as usize]
                == their_raw[SHIFT as usize..moved - SHIFT as usize],
            "the rest in place"
        );
        // The header area no longer holds the first shift of plaintext.
        assert!(mine_raw[1 << 20..SHIFT as usize] != plain[1 << 20..SHIFT as usize]);
        // Either tool's start serves the plaintext (the first shift from the moved segment),
        // read-only: nothing written.
        for (f, raw) in [(&img, &mine_raw), (&theirs, &their_raw)] {
            let out = t.path("started.out");
            ok(UCRYPT, &["export", "--key-file", s(&key), s(f), s(&out)]);
            let got = std::fs::read(&out).expect("exported");
            assert!(got == plain, "{sector}: {} exported", f.display());
            assert!(
                std::fs::read(f).expect("image") == **raw,
                "{sector}: written"
            );
        }
        // Each finishes the other's.
        ok(
            "cryptsetup",
            &[
                "reencrypt",
                "--resume-only",
                "--force-offline-reencrypt",
                "-q",
                "--key-file",
                s(&key),
                s(&img),
            ],
        );
        shift_encrypted(&t, &img, &key, &plain, "ucrypt init, cryptsetup run");
        ok(
            UCRYPT,
            &[
                "reencrypt",
                "--resume-only",
                "-q",
                "--key-file",
                s(&key),
                s(&theirs),
            ],
        );
        shift_encrypted(&t, &theirs, &key, &plain, "cryptsetup init, ucrypt run");
    }
}

/// After a kill: no header (the init was cut: the plaintext beyond the first shift must be
/// in place, the first shift in place or in the moved segment), or a volume in reencryption
/// (`repair` first when inside a hotzone, by `repair_with`) that `finish_with` completes.
fn shift_after_kill(img: &Path, plain: &[u8], what: &str) -> Option<bool> {
    if !run("cryptsetup", &["isLuks", s(img)]).status.success() {
        let raw = std::fs::read(img).expect("data");
        let sh = SHIFT as usize;
        let moved = raw.len() - sh;
        assert!(
            raw[sh..plain.len()] == plain[sh..],
            "{what}: no header, data moved"
        );
        assert!(
            raw[..sh] == plain[..sh] || raw[moved..] == plain[..sh],
            "{what}: no header, first shift lost"
        );
        return None;
    }
    Some(in_reencryption(img))
}

#[test]
fn cryptsetup_finishes_a_shift_ucrypt_was_killed_in() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    let (mut mid_way, mut hot_hits) = (0, 0);
    let rounds = 6;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let sector = ["512", "4096"][round % 2];
        let t = TempDir::new("kill-us");
        let (img, key, plain) = shift_volume(&t, 200);
        let delay = Duration::from_millis(150 + x % 900);
        let mut cmd = Command::new(UCRYPT);
        cmd.args(shift_args(
            &key,
            &["--sector-size", sector, "--hotzone-size", "4M"],
        ));
        cmd.arg(s(&img));
        let killed = kill_after(cmd, delay);
        let what = format!("round {round} sector {sector}: killed={killed} after {delay:?}");
        let Some(mid) = shift_after_kill(&img, &plain, &what) else {
            println!("{what}: no header yet");
            continue;
        };
        let hot = mid && in_hotzone(&img);
        println!("{what}: in reencryption {mid}, inside a hotzone {hot}");
        if mid {
            assert_eq!(ok(UCRYPT, &["dump", s(&img)]), dump(&img), "{what}: dump");
            // Served read-only mid-way (the plaintext, at the data's size); inside a hotzone
            // refused before anything is written (a read-only open does not recover).
            let before = std::fs::read(&img).expect("image");
            let out = t.path("mid-way.out");
            let o = run(UCRYPT, &["export", "--key-file", s(&key), s(&img), s(&out)]);
            let err = String::from_utf8_lossy(&o.stderr);
            if hot {
                assert_ne!(o.status.code(), Some(0), "{what}: export served a hotzone");
                assert!(err.contains("Run repair first"), "{what}: {err}");
            } else {
                assert_eq!(o.status.code(), Some(0), "{what}: export: {err}");
                let got = std::fs::read(&out).expect("exported");
                assert!(
                    got == plain,
                    "{what}: exported mid-way is not the plaintext"
                );
            }
            assert!(
                std::fs::read(&img).expect("image") == before,
                "{what}: written"
            );
        }
        if hot {
            hot_hits += 1;
            ok(
                "cryptsetup",
                &["repair", "-q", "--key-file", s(&key), s(&img)],
            );
        }
        // A repair of the last hotzone finishes the encryption: nothing left to resume.
        if mid && in_reencryption(&img) {
            mid_way += 1;
            ok(
                "cryptsetup",
                &[
                    "reencrypt",
                    "--resume-only",
                    "--force-offline-reencrypt",
                    "-q",
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
        }
        shift_encrypted(&t, &img, &key, &plain, &what);
    }
    println!(
        "{mid_way} of {rounds} left mid-way ({hot_hits} inside a hotzone), finished by cryptsetup"
    );
}

#[test]
fn ucrypt_finishes_a_shift_cryptsetup_was_killed_in() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    let (mut mid_way, mut hot_hits) = (0, 0);
    let rounds = 6;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let sector = ["512", "4096"][round % 2];
        let t = TempDir::new("kill-cs");
        let (img, key, plain) = shift_volume(&t, 300);
        let delay = Duration::from_millis(300 + x % 1200);
        let mut cmd = Command::new("cryptsetup");
        cmd.args(shift_args(
            &key,
            &["--force-offline-reencrypt", "--sector-size", sector],
        ));
        cmd.arg(s(&img));
        // cryptsetup builds the header in a temporary file in its working directory.
        cmd.current_dir(&t.0);
        let killed = kill_after(cmd, delay);
        let what = format!("round {round} sector {sector}: killed={killed} after {delay:?}");
        let Some(mid) = shift_after_kill(&img, &plain, &what) else {
            println!("{what}: no header yet");
            continue;
        };
        let hot = mid && in_hotzone(&img);
        println!("{what}: in reencryption {mid}, inside a hotzone {hot}");
        if mid {
            assert_eq!(ok(UCRYPT, &["dump", s(&img)]), dump(&img), "{what}: dump");
        }
        if hot {
            hot_hits += 1;
            let o = run(
                UCRYPT,
                &["reencrypt", "--resume-only", "--key-file", s(&key), s(&img)],
            );
            assert_eq!(o.status.code(), Some(1), "{what}");
            assert!(String::from_utf8_lossy(&o.stderr).contains("Run repair first"));
            ok(UCRYPT, &["repair", "-q", "--key-file", s(&key), s(&img)]);
        }
        // A repair of the last hotzone finishes the encryption: nothing left to resume.
        if mid && in_reencryption(&img) {
            mid_way += 1;
            ok(
                UCRYPT,
                &[
                    "reencrypt",
                    "--resume-only",
                    "-q",
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
        }
        shift_encrypted(&t, &img, &key, &plain, &what);
    }
    println!(
        "{mid_way} of {rounds} left mid-way ({hot_hits} inside a hotzone), finished by ucrypt"
    );
}

// ------------------------------------- decryption moving the data back (header exported)

/// `reencrypt --decrypt --header NEW` (NEW not existing) with `extra` options, as both tools
/// spell it.
fn unshift_args<'a>(key: &'a Path, hdr: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "reencrypt",
        "--decrypt",
        "--header",
        s(hdr),
        "-q",
        "--key-file",
        s(key),
    ];
    a.extend(FAST_PBKDF2);
    a.extend(extra);
    a
}

/// The finished decryption: the exported header is plain (one linear segment at 0, no
/// keyslot, no reencryption, as cryptsetup reads it), the device holds no LUKS header and
/// starts with the plaintext, and the old ciphertext of the last shift past it is wiped.
fn unshift_decrypted(img: &Path, hdr: &Path, plain: &[u8], before: &[u8], what: &str) {
    let d = dump(hdr);
    assert!(
        !d.contains("reencrypt"),
        "{what}: reencryption left in:\n{d}"
    );
    assert!(
        d.contains("0: linear") && d.contains("offset: 0 [bytes]"),
        "{what}: {d}"
    );
    assert!(!d.contains(": luks2"), "{what}: keyslots left:\n{d}");
    assert!(
        !run("cryptsetup", &["isLuks", s(img)]).status.success(),
        "{what}: a LUKS header left on the device"
    );
    let raw = std::fs::read(img).expect("data");
    assert_eq!(raw.len(), before.len(), "{what}: the device changed size");
    assert!(raw[..plain.len()] == plain[..], "{what}: not the plaintext");
    assert!(
        raw[plain.len()..] != before[plain.len()..],
        "{what}: the old ciphertext left past the data"
    );
}

/// ucrypt decrypts (sector sizes 512 and 4096; the default moved segment and a 1 MiB one):
/// cryptsetup reads the exported header, the device holds the plaintext at offset 0.
#[test]
fn unshift_ucrypt_decrypts_cryptsetup_reads() {
    if !have_cryptsetup() {
        return;
    }
    for (sector, extra) in [
        (512u32, &[][..]),
        (4096, &[][..]),
        (4096, &["--hotzone-size", "1M"][..]),
        (
            512,
            &["--resilience", "journal", "--hotzone-size", "4M"][..],
        ),
    ] {
        let t = TempDir::new("unshift");
        let (img, key, plain) = volume(&t, 72, sector);
        let before = std::fs::read(&img).expect("image");
        let hdr = t.path("exported.hdr");
        let mut a = unshift_args(&key, &hdr, extra);
        a.push(s(&img));
        ok(UCRYPT, &a);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&hdr)
            .expect("header")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "exported header mode");
        unshift_decrypted(&img, &hdr, &plain, &before, &format!("{sector} {extra:?}"));
    }
}

/// Both tools' `--init-only` on copies of one volume: the same metadata (keyslots, the
/// reencrypt keyslot's datashift-checksum area, segments in cryptsetup's order, digest lists,
/// config with the v3 requirement: JSON compared), the same bytes in the exported header's
/// keyslots area and on the device (the moved segment over the old header); `dump` equals
/// luksDump; then each tool finishes the other's.
#[test]
fn unshift_init_matches_cryptsetup_and_each_finishes_the_other() {
    if !have_cryptsetup() {
        return;
    }
    // (sector size, options, the reencrypt keyslot's area type, the moved segment's bytes).
    // datashift-journal (--resilience journal) needs a moved segment the area holds.
    let journal_8m = &["--resilience", "journal", "--hotzone-size", "8M"][..];
    let journal_1m = &["--resilience", "journal", "--hotzone-size", "1M"][..];
    for (sector, extra, area, m) in [
        (512u32, &[][..], "datashift-checksum", 16usize << 20),
        (4096, &[][..], "datashift-checksum", 16 << 20),
        (
            4096,
            &["--hotzone-size", "1M"][..],
            "datashift-checksum",
            1 << 20,
        ),
        (4096, journal_8m, "datashift-journal", 8 << 20),
        (512, journal_1m, "datashift-journal", 1 << 20),
    ] {
        let what = format!("{sector} {extra:?}");
        let t = TempDir::new("unshift-init");
        let (img, key, plain) = volume(&t, 64, sector);
        let before = std::fs::read(&img).expect("image");
        let theirs = t.path("theirs.img");
        std::fs::copy(&img, &theirs).expect("copy");
        let (my_hdr, their_hdr) = (t.path("mine.hdr"), t.path("theirs.hdr"));
        let mut a = unshift_args(&key, &my_hdr, &["--init-only"]);
        a.extend(extra);
        a.push(s(&img));
        ok(UCRYPT, &a);
        let mut c = unshift_args(
            &key,
            &their_hdr,
            &["--init-only", "--force-offline-reencrypt"],
        );
        c.extend(extra);
        c.push(s(&theirs));
        ok("cryptsetup", &c);
        let (mine, theirs_meta) = (shift_metadata(&my_hdr), shift_metadata(&their_hdr));
        assert_eq!(mine, theirs_meta, "{what}");
        assert!(mine.contains("online-reencrypt-v3"), "{mine}");
        assert!(mine.contains(area), "{what}: {mine}");
        for f in [&my_hdr, &their_hdr] {
            assert_eq!(ok(UCRYPT, &["dump", s(f)]), dump(f), "{what}: dump");
        }
        let (my_raw, their_raw) = (
            std::fs::read(&img).expect("mine"),
            std::fs::read(&theirs).expect("theirs"),
        );
        assert!(my_raw == their_raw, "{what}: the devices differ after init");
        let (my_h, their_h) = (
            std::fs::read(&my_hdr).expect("mine"),
            std::fs::read(&their_hdr).expect("theirs"),
        );
        assert_eq!(my_h.len(), their_h.len(), "{what}: header file size");
        assert!(
            my_h[32 << 10..] == their_h[32 << 10..],
            "{what}: keyslots area"
        );
        // The moved segment: the first ciphertext over the old header.
        assert!(my_raw[..m] == before[DATA_OFFSET as usize..DATA_OFFSET as usize + m]);
        // Either tool's start serves the plaintext (the moved segment read where it moved),
        // read-only: nothing written.
        for (f, h, raw) in [(&img, &my_hdr, &my_raw), (&theirs, &their_hdr, &their_raw)] {
            let out = t.path("started.out");
            let a = [
                "export",
                "--header",
                s(h),
                "--key-file",
                s(&key),
                s(f),
                s(&out),
            ];
            ok(UCRYPT, &a);
            let got = std::fs::read(&out).expect("exported");
            assert!(got == plain, "{what}: {} exported", f.display());
            assert!(std::fs::read(f).expect("image") == **raw, "{what}: written");
        }
        // Each finishes the other's.
        ok(
            "cryptsetup",
            &[
                "reencrypt",
                "--resume-only",
                "--force-offline-reencrypt",
                "-q",
                "--header",
                s(&my_hdr),
                "--key-file",
                s(&key),
                s(&img),
            ],
        );
        unshift_decrypted(
            &img,
            &my_hdr,
            &plain,
            &before,
            &format!("{what}: ucrypt init"),
        );
        ok(
            UCRYPT,
            &[
                "reencrypt",
                "--resume-only",
                "-q",
                "--header",
                s(&their_hdr),
                "--key-file",
                s(&key),
                s(&theirs),
            ],
        );
        unshift_decrypted(
            &theirs,
            &their_hdr,
            &plain,
            &before,
            &format!("{what}: cryptsetup init"),
        );
    }
}

/// Where a killed decryption that moves the data was left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UnshiftLeft {
    /// No exported header that opens (none, or its export was cut): the volume untouched.
    NotExported,
    /// A plain exported header, the reencryption not committed: the volume reads the
    /// plaintext through it.
    Exported,
    /// In reencryption (inside a hotzone or not): `dump` equals luksDump; `export` serves the
    /// plaintext, or inside a hotzone is refused; nothing written.
    Mid { hot: bool },
    /// Killed in the finalisation, once it began wiping the old key's keyslot areas and
    /// before it cleared the requirement: no passphrase opens the header in either tool,
    /// neither resumes it, and the device already holds the plaintext from offset 0.
    KeyslotsGone,
    /// Finished (the tail may still be being wiped by ucrypt's last step).
    Finished,
}

/// Checks and names where a kill left a decryption that moves the data.
fn unshift_after_kill(
    t: &TempDir,
    img: &Path,
    hdr: &Path,
    key: &Path,
    plain: &[u8],
    before: &[u8],
    what: &str,
) -> UnshiftLeft {
    let out = t.path("out");
    let _ = std::fs::remove_file(&out);
    let header_ok = hdr.exists() && run("cryptsetup", &["isLuks", s(hdr)]).status.success();
    if header_ok && !in_reencryption(hdr) && dump(hdr).contains("0: linear") {
        return UnshiftLeft::Finished;
    }
    if !header_ok || !in_reencryption(hdr) {
        let o = run(
            UCRYPT,
            &[
                "export",
                "--header",
                s(hdr),
                "--key-file",
                s(key),
                s(img),
                s(&out),
            ],
        );
        if header_ok && o.status.success() {
            assert!(
                std::fs::read(&out).expect("export") == plain,
                "{what}: the volume through the exported header"
            );
            return UnshiftLeft::Exported;
        }
        assert!(
            std::fs::read(img).expect("image") == before,
            "{what}: no usable exported header, the volume changed"
        );
        return UnshiftLeft::NotExported;
    }
    assert_eq!(ok(UCRYPT, &["dump", s(hdr)]), dump(hdr), "{what}: dump");
    let now = std::fs::read(img).expect("image");
    let o = run(
        UCRYPT,
        &[
            "export",
            "--header",
            s(hdr),
            "--key-file",
            s(key),
            s(img),
            s(&out),
        ],
    );
    // Served read-only mid-way (the three ranges: the plaintext); inside a hotzone refused
    // (a read-only open does not recover).
    let hot = in_hotzone(hdr);
    let err = String::from_utf8_lossy(&o.stderr);
    let no_key = err.contains("No usable keyslot") || err.contains("No key available");
    if !hot && !o.status.success() && no_key {
        // cryptsetup must not open it either: its finalisation wiped the keyslot's area.
        let tp = cryptsetup_test_passphrase(img, hdr, key);
        assert!(
            !tp.status.success(),
            "{what}: cryptsetup opens a header ucrypt's export refused: {err}"
        );
        let data_plain = now[..plain.len()] == plain[..];
        killed_in_finalisation(hdr, key, img, &o, data_plain, what);
        assert!(std::fs::read(img).expect("image") == now, "{what}: written");
        return UnshiftLeft::KeyslotsGone;
    }
    if hot {
        assert_ne!(o.status.code(), Some(0), "{what}: export served a hotzone");
        assert!(err.contains("Run repair first"), "{what}: {err}");
    } else {
        assert_eq!(
            o.status.code(),
            Some(0),
            "{what}: export: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            std::fs::read(&out).expect("export") == plain,
            "{what}: exported mid-way is not the plaintext"
        );
    }
    assert!(std::fs::read(img).expect("image") == now, "{what}: written");
    UnshiftLeft::Mid { hot }
}

/// Whether the header file holds cryptsetup's v3 requirement in its first JSON area: the
/// reencryption is committed (read without locking, as the writer holds the lock).
fn v3_committed(hdr: &Path) -> bool {
    std::fs::read(hdr)
        .map(|b| {
            let json = &b[..b.len().min(16 << 10)];
            json.windows(19).any(|w| w == b"online-reencrypt-v3")
        })
        .unwrap_or(false)
}

#[test]
fn unshift_cryptsetup_finishes_after_ucrypt_is_killed() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    let (mut mid_way, mut hot_hits) = (0, 0);
    let rounds = 6;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let sector = [512u32, 4096][round % 2];
        let t = TempDir::new("unshift-kill-us");
        let (img, key, plain) = volume(&t, 200, sector);
        let before = std::fs::read(&img).expect("image");
        let hdr = t.path("exported.hdr");
        let delay = Duration::from_millis(50 + x % 1200);
        let mut cmd = Command::new(UCRYPT);
        cmd.args(unshift_args(&key, &hdr, &[]));
        cmd.arg(s(&img));
        let killed = kill_after(cmd, delay);
        let what = format!("round {round} sector {sector}: killed={killed} after {delay:?}");
        let left = unshift_after_kill(&t, &img, &hdr, &key, &plain, &before, &what);
        println!("{what}: {left:?}");
        let hot = match left {
            UnshiftLeft::NotExported | UnshiftLeft::Exported | UnshiftLeft::KeyslotsGone => {
                continue
            }
            UnshiftLeft::Mid { hot } => {
                mid_way += 1;
                hot
            }
            UnshiftLeft::Finished => false,
        };
        if hot {
            hot_hits += 1;
            ok(
                "cryptsetup",
                &[
                    "repair",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
        }
        if in_reencryption(&hdr) {
            ok(
                "cryptsetup",
                &[
                    "reencrypt",
                    "--resume-only",
                    "--force-offline-reencrypt",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
        }
        unshift_decrypted(&img, &hdr, &plain, &before, &what);
    }
    println!(
        "{mid_way} of {rounds} left mid-way ({hot_hits} inside a hotzone), finished by cryptsetup"
    );
}

#[test]
fn unshift_ucrypt_finishes_after_cryptsetup_is_killed() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    let (mut mid_way, mut hot_hits) = (0, 0);
    let rounds = 6;
    for round in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let sector = [512u32, 4096][round % 2];
        let t = TempDir::new("unshift-kill-cs");
        let (img, key, plain) = volume(&t, 300, sector);
        let before = std::fs::read(&img).expect("image");
        let hdr = t.path("exported.hdr");
        // cryptsetup calibrates its reencryption digest before it commits (one to two
        // seconds here, more under load): the kill comes a seeded delay after the commit,
        // or (one round in three) a seeded delay after the start.
        let delay = Duration::from_millis(x % 1500);
        let after_commit = round % 3 != 2;
        let mut child = Command::new("cryptsetup")
            .args(unshift_args(&key, &hdr, &["--force-offline-reencrypt"]))
            .arg(s(&img))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        let start = std::time::Instant::now();
        while after_commit
            && !v3_committed(&hdr)
            && child.try_wait().expect("wait").is_none()
            && start.elapsed() < Duration::from_secs(60)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(delay);
        let killed = child.try_wait().expect("wait").is_none();
        // SIGKILL, as a crash would.
        let _ = child.kill();
        let _ = child.wait();
        let delay = format!(
            "{delay:?} after {}",
            if after_commit {
                "its commit"
            } else {
                "its start"
            }
        );
        let what = format!("round {round} sector {sector}: killed={killed} after {delay:?}");
        let left = unshift_after_kill(&t, &img, &hdr, &key, &plain, &before, &what);
        println!("{what}: {left:?}");
        let hot = match left {
            UnshiftLeft::NotExported | UnshiftLeft::Exported | UnshiftLeft::KeyslotsGone => {
                continue
            }
            UnshiftLeft::Mid { hot } => {
                mid_way += 1;
                hot
            }
            UnshiftLeft::Finished => false,
        };
        if hot {
            hot_hits += 1;
            let o = run(
                UCRYPT,
                &[
                    "reencrypt",
                    "--resume-only",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
            assert_eq!(o.status.code(), Some(1), "{what}");
            assert!(String::from_utf8_lossy(&o.stderr).contains("Run repair first"));
            ok(
                UCRYPT,
                &[
                    "repair",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
        }
        if in_reencryption(&hdr) {
            let o = run(
                UCRYPT,
                &[
                    "reencrypt",
                    "--resume-only",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                    s(&img),
                ],
            );
            if !o.status.success() && !dump(&hdr).contains(": luks2") {
                let raw = std::fs::read(&img).expect("data");
                let data_plain = raw[..plain.len()] == plain[..];
                killed_in_finalisation(&hdr, &key, &img, &o, data_plain, &what);
                continue;
            }
            assert!(
                o.status.success(),
                "{what}: ucrypt --resume-only failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        unshift_decrypted(&img, &hdr, &plain, &before, &what);
    }
    println!(
        "{mid_way} of {rounds} left mid-way ({hot_hits} inside a hotzone), finished by ucrypt"
    );
}

/// Whether the header file's first copy says the moved segment's hotzone is open (segment
/// `0` linear at 0, flagged in-reencryption): the last hotzone, rewritten in place and
/// protected by checksums. Read without locking, as the writer holds the lock.
fn in_moved_hotzone(hdr: &Path) -> bool {
    let Ok(b) = std::fs::read(hdr) else {
        return false;
    };
    let Some(area) = b.get(4096..16 << 10) else {
        return false;
    };
    let end = area.iter().position(|&c| c == 0).unwrap_or(area.len());
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&area[..end]) else {
        return false;
    };
    let s0 = &v["segments"]["0"];
    s0["type"] == "linear"
        && s0["offset"] == "0"
        && s0["flags"]
            .as_array()
            .is_some_and(|f| f.iter().any(|x| x == "in-reencryption"))
}

/// Whether any `luks2` keyslot's area in the header file differs from what `seen` first
/// recorded for it: the finalisation of a decryption has begun wiping the old key's keyslots.
/// Read without locking, as the writer holds the lock. Only a header in reencryption (its
/// requirement set) is looked at: before that the export is still being written (ucrypt
/// copies the old header across in pieces, so on a busy host a poll may find the JSON
/// written and the keyslot area not yet), and a change then is no wipe.
fn keyslot_area_changed(
    hdr: &Path,
    seen: &std::cell::RefCell<std::collections::HashMap<String, Vec<u8>>>,
) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(hdr) else {
        return false;
    };
    let mut json = vec![0u8; 12 << 10];
    if f.seek(SeekFrom::Start(4096)).is_err() || f.read_exact(&mut json).is_err() {
        return false;
    }
    let end = json.iter().position(|&c| c == 0).unwrap_or(json.len());
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&json[..end]) else {
        return false;
    };
    let in_reencryption = json[..end].windows(16).any(|w| w == b"online-reencrypt");
    let Some(slots) = v["keyslots"].as_object().filter(|_| in_reencryption) else {
        return false;
    };
    for (id, k) in slots.iter().filter(|(_, k)| k["type"] == "luks2") {
        let num = |x: &serde_json::Value| x.as_str().and_then(|t| t.parse::<u64>().ok());
        let (Some(off), Some(len)) = (num(&k["area"]["offset"]), num(&k["area"]["size"])) else {
            continue;
        };
        // The first 4 KiB tell (the wipe writes the whole area), and keep the poll quick.
        let mut area = vec![0u8; len.min(4096) as usize];
        if f.seek(SeekFrom::Start(off)).is_err() || f.read_exact(&mut area).is_err() {
            continue;
        }
        let mut seen = seen.borrow_mut();
        match seen.get(id) {
            None => {
                seen.insert(id.clone(), area);
            }
            Some(first) if *first != area => return true,
            Some(_) => {}
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
    if !have_cryptsetup() {
        return;
    }
    let (mut tries, mut gone) = (0, 0);
    let runs = (0..10)
        .map(|i| ("cryptsetup", [512u32, 4096][i % 2]))
        .chain([(UCRYPT, 512), (UCRYPT, 4096)]);
    for (runner, sector) in runs {
        if runner == "cryptsetup" && gone == 2 {
            continue;
        }
        let t = TempDir::new("unshift-kill-final");
        let (img, key, plain) = volume(&t, 64, sector);
        let before = std::fs::read(&img).expect("image");
        let hdr = t.path("exported.hdr");
        let mut extra = Vec::new();
        if runner == "cryptsetup" {
            tries += 1;
            extra.push("--force-offline-reencrypt");
        }
        let mut cmd = Command::new(runner);
        cmd.args(unshift_args(&key, &hdr, &extra)).arg(s(&img));
        let seen = std::cell::RefCell::new(std::collections::HashMap::new());
        let killed = kill_when_spinning(cmd, || keyslot_area_changed(&hdr, &seen));
        let what = format!("{runner} killed={killed}, sector {sector}");
        let left = unshift_after_kill(&t, &img, &hdr, &key, &plain, &before, &what);
        println!("{what}: {left:?}");
        match left {
            UnshiftLeft::KeyslotsGone if runner == "cryptsetup" => gone += 1,
            // Done before the kill, or the wipe and the commit came between two polls.
            UnshiftLeft::Finished => unshift_decrypted(&img, &hdr, &plain, &before, &what),
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

/// Each tool SIGKILLed inside the moved segment's hotzone (caught by watching the exported
/// header, then a seeded delay of up to 60 ms into the in-place rewrite), the other repairs
/// it from the checksums (in the last two rounds from the journal: datashift-journal) and
/// finishes: the plaintext is intact.
#[test]
fn unshift_moved_hotzone_killed_and_repaired_by_the_other() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    let mut caught = 0;
    for (round, (runner, finisher)) in [("ucrypt", "cryptsetup"), ("cryptsetup", "ucrypt")]
        .iter()
        .cycle()
        .take(6)
        .enumerate()
    {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let sector = [512u32, 4096, 4096][round / 2];
        let t = TempDir::new("unshift-moved");
        let (img, key, plain) = volume(&t, 96, sector);
        let before = std::fs::read(&img).expect("image");
        let hdr = t.path("exported.hdr");
        let prog = if *runner == "ucrypt" {
            UCRYPT
        } else {
            "cryptsetup"
        };
        let mut extra = vec![];
        if *runner == "cryptsetup" {
            extra.push("--force-offline-reencrypt");
        }
        // The last two rounds protect the moved segment with a journal (datashift-journal).
        let journal = round >= 4;
        if journal {
            extra.extend(["--resilience", "journal", "--hotzone-size", "8M"]);
        }
        let mut cmd = Command::new(prog);
        cmd.args(unshift_args(&key, &hdr, &extra)).arg(s(&img));
        // cryptsetup rewrites the moved segment faster than ucrypt (one pass, no lanes).
        let window_ms = if *runner == "cryptsetup" { 8 } else { 60 };
        let delay = Duration::from_millis(x % window_ms);
        let killed = kill_when(cmd, || in_moved_hotzone(&hdr), delay);
        let what =
            format!("round {round}: {runner} killed={killed}, sector {sector}, journal {journal}");
        let left = unshift_after_kill(&t, &img, &hdr, &key, &plain, &before, &what);
        println!("{what}: {left:?}");
        let fin = if *finisher == "ucrypt" {
            UCRYPT
        } else {
            "cryptsetup"
        };
        if left == UnshiftLeft::KeyslotsGone {
            continue;
        }
        if let UnshiftLeft::Mid { hot } = left {
            if hot && in_moved_hotzone(&hdr) {
                caught += 1;
                println!("{what}: inside the moved segment's hotzone, repaired by {finisher}");
            }
            if hot {
                ok(
                    fin,
                    &[
                        "repair",
                        "-q",
                        "--header",
                        s(&hdr),
                        "--key-file",
                        s(&key),
                        s(&img),
                    ],
                );
            }
            if in_reencryption(&hdr) {
                let mut a = vec![
                    "reencrypt",
                    "--resume-only",
                    "-q",
                    "--header",
                    s(&hdr),
                    "--key-file",
                    s(&key),
                ];
                if *finisher == "cryptsetup" {
                    a.push("--force-offline-reencrypt");
                }
                a.push(s(&img));
                ok(fin, &a);
            }
        }
        assert!(
            !matches!(left, UnshiftLeft::NotExported | UnshiftLeft::Exported),
            "{what}: killed before the reencryption started"
        );
        unshift_decrypted(&img, &hdr, &plain, &before, &what);
    }
    println!("{caught} of 6 kills inside the moved segment's hotzone, repaired by the other tool");
    assert!(
        caught > 0,
        "no kill landed inside the moved segment's hotzone"
    );
}

// ------------------------------------------------- several keyslots, --resilience-hash

/// Runs `prog` with `input` on its standard input (a pipe, not a terminal: both tools read
/// one passphrase per line from it).
fn run_input(prog: &str, args: &[&str], input: &[u8]) -> Output {
    use std::io::Write;
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"));
    let mut stdin = child.stdin.take().expect("stdin");
    // A tool that refuses before reading closes the pipe: a failed write is no error here.
    let _ = stdin.write_all(input);
    drop(stdin);
    child.wait_with_output().expect("wait")
}

fn ok_input(prog: &str, args: &[&str], input: &[u8]) -> String {
    let o = run_input(prog, args, input);
    assert!(
        o.status.success(),
        "{prog} {args:?} failed ({:?}):\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The passphrases of keyslots 0, 1 and 2 of [`three_keyslots`].
const PASSPHRASES: [&str; 3] = ["rotate-me", "second passphrase", "third"];

/// [`volume`] with two more keyslots added by cryptsetup, each of another PBKDF: keyslot 1
/// pbkdf2-sha512 of 1500 iterations, keyslot 2 argon2id (4 passes, 64 KiB, 1 thread).
/// Returns (image, the key files of the three passphrases, plaintext).
fn three_keyslots(t: &TempDir, mib: u64, sector: u32) -> (PathBuf, Vec<PathBuf>, Vec<u8>) {
    let (img, key, plain) = volume(t, mib, sector);
    let mut keys = vec![key.clone()];
    let kdfs: [&[&str]; 2] = [
        &[
            "--pbkdf",
            "pbkdf2",
            "--hash",
            "sha512",
            "--pbkdf-force-iterations",
            "1500",
        ],
        &[
            "--pbkdf",
            "argon2id",
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-memory",
            "64",
            "--pbkdf-parallel",
            "1",
        ],
    ];
    for (i, kdf) in kdfs.iter().enumerate() {
        let k = t.path(&format!("key{}", i + 1));
        std::fs::write(&k, PASSPHRASES[i + 1]).expect("key");
        let mut a = vec!["luksAddKey", "-q", "--key-file", s(&key)];
        a.extend(kdf.iter());
        a.extend([s(&img), s(&k)]);
        ok("cryptsetup", &a);
        keys.push(k);
    }
    (img, keys, plain)
}

/// The passphrases of [`three_keyslots`] as both tools read them from a pipe: one a line.
fn passphrase_lines() -> Vec<u8> {
    PASSPHRASES
        .iter()
        .flat_map(|p| [p.as_bytes(), b"\n"])
        .flatten()
        .copied()
        .collect()
}

/// The keyslots luksDump lists, by number and type.
fn keyslot_list(img: &Path) -> Vec<String> {
    let j = ok("cryptsetup", &["luksDump", "--dump-json-metadata", s(img)]);
    let v: serde_json::Value = serde_json::from_str(&j).expect("json");
    let mut l: Vec<String> = v["keyslots"]
        .as_object()
        .expect("keyslots")
        .iter()
        .map(|(id, k)| format!("{id}:{}", k["type"].as_str().unwrap_or("?")))
        .collect();
    l.sort();
    l
}

/// The PBKDF of keyslot `slot` without its salt (type, hash or costs), from luksDump's JSON.
fn keyslot_kdf(img: &Path, slot: u32) -> serde_json::Value {
    let j = ok("cryptsetup", &["luksDump", "--dump-json-metadata", s(img)]);
    let v: serde_json::Value = serde_json::from_str(&j).expect("json");
    let mut kdf = v["keyslots"][slot.to_string()]["kdf"].clone();
    kdf["salt"] = serde_json::Value::Null;
    kdf
}

/// cryptsetup opens keyslot `slot` with the passphrase in `key`, and no other.
fn cryptsetup_opens_slot(img: &Path, key: &Path, slot: u32) {
    let n = slot.to_string();
    ok(
        "cryptsetup",
        &[
            "open",
            "--test-passphrase",
            "--key-slot",
            &n,
            "--key-file",
            s(key),
            s(img),
        ],
    );
}

/// A volume with three keyslots of three PBKDFs, rotated from a pipe of three passphrases,
/// by ucrypt and by cryptsetup from copies of one image: `--init-only` leaves the same
/// keyslots (3, 4, 5 for the new key, each with its old keyslot's PBKDF, the reencrypt
/// keyslot after them), segments, digest lists and config; each finishes the other's; the
/// result opens with each passphrase in its new keyslot (cryptsetup `--key-slot N`), the old
/// keyslots are gone, and the data is the original.
#[test]
fn several_keyslots_init_matches_cryptsetup_and_each_finishes_the_other() {
    if !have_cryptsetup() {
        return;
    }
    let t = TempDir::new("slots3");
    let (img, keys, plain) = three_keyslots(&t, 20, 4096);
    let theirs = t.path("theirs.img");
    std::fs::copy(&img, &theirs).expect("copy");
    let init = |prog: &str, img: &Path| {
        ok_input(
            prog,
            &[
                "reencrypt",
                "--init-only",
                "-q",
                "--force-offline-reencrypt",
                s(img),
            ],
            &passphrase_lines(),
        )
    };
    init(UCRYPT, &img);
    init("cryptsetup", &theirs);
    assert_eq!(shift_metadata(&img), shift_metadata(&theirs), "init");
    let want = [
        "0:luks2",
        "1:luks2",
        "2:luks2",
        "3:luks2",
        "4:luks2",
        "5:luks2",
        "6:reencrypt",
    ];
    assert_eq!(keyslot_list(&img), want);
    for (old, new) in [(0u32, 3u32), (1, 4), (2, 5)] {
        assert_eq!(
            keyslot_kdf(&img, new),
            keyslot_kdf(&img, old),
            "keyslot {new}"
        );
    }
    for (name, img, finisher) in [
        ("ucrypt", &img, "cryptsetup"),
        ("cryptsetup", &theirs, UCRYPT),
    ] {
        ok(
            finisher,
            &[
                "reencrypt",
                "--resume-only",
                "-q",
                "--force-offline-reencrypt",
                "--key-file",
                s(&keys[1]),
                s(img),
            ],
        );
        assert_eq!(
            keyslot_list(img),
            ["3:luks2", "4:luks2", "5:luks2"],
            "{name} init"
        );
        for (i, key) in keys.iter().enumerate() {
            cryptsetup_opens_slot(img, key, i as u32 + 3);
            assert!(exported(&t, img, key) == plain, "{name} init: data");
        }
    }
}

/// A whole run from a pipe each way: ucrypt rotates and cryptsetup opens each passphrase in
/// its keyslot; cryptsetup rotates and ucrypt reads the data with each passphrase.
#[test]
fn several_keyslots_rotated_by_either_tool() {
    if !have_cryptsetup() {
        return;
    }
    for tool in [UCRYPT, "cryptsetup"] {
        let t = TempDir::new("slots-run");
        let (img, keys, plain) = three_keyslots(&t, 20, 512);
        ok_input(
            tool,
            &[
                "reencrypt",
                "-q",
                "--force-offline-reencrypt",
                "--hotzone-size",
                "1M",
                s(&img),
            ],
            &passphrase_lines(),
        );
        assert_eq!(
            keyslot_list(&img),
            ["3:luks2", "4:luks2", "5:luks2"],
            "{tool}"
        );
        assert_eq!(keyslot_kdf(&img, 4)["hash"], "sha512", "{tool}");
        assert_eq!(keyslot_kdf(&img, 5)["type"], "argon2id", "{tool}");
        for (i, key) in keys.iter().enumerate() {
            cryptsetup_opens_slot(&img, key, i as u32 + 3);
            assert!(
                exported(&t, &img, key) == plain,
                "{tool}: data, passphrase {i}"
            );
        }
    }
}

/// What both tools refuse on a volume of several keyslots, with the same exit code and
/// cryptsetup's words, writing nothing: a key file without `--key-slot`; a wrong passphrase
/// for one keyslot (exit 2); `--key-slot` of a keyslot that is not there (exit 1, no words
/// from cryptsetup); a volume whose keyslots leave no room for the new ones (16 active
/// keyslots need 16 more and the reencrypt keyslot). And a `--resilience-hash` that is no
/// hash: exit 1 from both, but cryptsetup adds the new keyslots, fails ("Failed to
/// initialize LUKS2 reencryption in metadata.") and destroys them again (its header
/// changed), while ucrypt refuses before any write.
#[test]
fn several_keyslots_refusals_match_cryptsetup() {
    if !have_cryptsetup() {
        return;
    }
    let t = TempDir::new("slots-refuse");
    let (img, keys, _) = three_keyslots(&t, 20, 4096);
    let before = std::fs::read(&img).expect("image");
    let wrong = b"rotate-me\nnot the second\nthird\n";
    let rows: [(&[&str], &[u8], i32, &str); 3] = [
        (
            &["--key-file", s(&keys[0])],
            b"",
            1,
            "Key file can be used only with --key-slot or with exactly one key slot active.",
        ),
        (&[], wrong, 2, "No key available with this passphrase."),
        (&["--key-slot", "7", "--key-file", s(&keys[0])], b"", 1, ""),
    ];
    for (extra, input, code, words) in rows {
        for tool in [UCRYPT, "cryptsetup"] {
            let mut a = vec!["reencrypt", "-q", "--force-offline-reencrypt"];
            a.extend(extra);
            a.push(s(&img));
            let o = run_input(tool, &a, input);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(code), "{tool} {extra:?}: {err}");
            assert!(err.contains(words), "{tool} {extra:?}: {err}");
            assert!(
                std::fs::read(&img).expect("image") == before,
                "{tool} {extra:?} wrote"
            );
        }
    }
    for tool in [UCRYPT, "cryptsetup"] {
        let copy = t.path("nohash.img");
        std::fs::copy(&img, &copy).expect("copy");
        let o = run_input(
            tool,
            &[
                "reencrypt",
                "-q",
                "--force-offline-reencrypt",
                "--resilience-hash",
                "nohash",
                s(&copy),
            ],
            &passphrase_lines(),
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{tool}: {err}");
        assert_eq!(
            keyslot_list(&copy),
            ["0:luks2", "1:luks2", "2:luks2"],
            "{tool}"
        );
        if tool == UCRYPT {
            assert!(
                err.contains("Hash algorithm nohash is not available"),
                "{err}"
            );
            assert!(
                std::fs::read(&copy).expect("image") == before,
                "ucrypt wrote"
            );
        }
    }
    // 16 active keyslots.
    for i in 3..16 {
        let mut a = vec!["luksAddKey", "-q", "--key-file", s(&keys[0])];
        a.extend(FAST_PBKDF2);
        a.extend([s(&img), s(&keys[i % 3])]);
        ok("cryptsetup", &a);
    }
    let full = std::fs::read(&img).expect("image");
    let lines: Vec<u8> = (0..16)
        .flat_map(|i| [PASSPHRASES[if i < 3 { i } else { i % 3 }].as_bytes(), b"\n"])
        .flatten()
        .copied()
        .collect();
    for tool in [UCRYPT, "cryptsetup"] {
        let o = run_input(
            tool,
            &["reencrypt", "-q", "--force-offline-reencrypt", s(&img)],
            &lines,
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{tool}: {err}");
        assert!(
            err.contains("Not enough free keyslots for reencryption."),
            "{tool}: {err}"
        );
        assert!(std::fs::read(&img).expect("image") == full, "{tool} wrote");
    }
}

/// `--resilience-hash` of SHA-2, SHA-1 and the others cryptsetup's backend offers, each
/// way: both tools' `--init-only` name the hash in the reencrypt keyslot (the same
/// metadata); each finishes the other's; a whole ucrypt run with it is accepted by
/// cryptsetup.
#[test]
fn resilience_hash_each_way() {
    if !have_cryptsetup() {
        return;
    }
    for hash in [
        "sha512",
        "sha1",
        "whirlpool",
        "sha3-256",
        "ripemd160",
        "blake2b-512",
    ] {
        let t = TempDir::new("rhash");
        let (img, key, plain) = volume(&t, 24, 4096);
        let theirs = t.path("theirs.img");
        std::fs::copy(&img, &theirs).expect("copy");
        let init = |prog: &str, img: &Path| {
            ok(
                prog,
                &[
                    "reencrypt",
                    "--init-only",
                    "-q",
                    "--force-offline-reencrypt",
                    "--resilience",
                    "checksum",
                    "--resilience-hash",
                    hash,
                    "--pbkdf",
                    "pbkdf2",
                    "--pbkdf-force-iterations",
                    "1000",
                    "--key-file",
                    s(&key),
                    s(img),
                ],
            )
        };
        init(UCRYPT, &img);
        init("cryptsetup", &theirs);
        assert_eq!(shift_metadata(&img), shift_metadata(&theirs), "{hash}");
        let d = dump(&img);
        assert!(d.contains(&format!("Hash:       {hash}")), "{hash}:\n{d}");
        for (img, finisher) in [(&img, "cryptsetup"), (&theirs, UCRYPT)] {
            ok(
                finisher,
                &[
                    "reencrypt",
                    "--resume-only",
                    "-q",
                    "--force-offline-reencrypt",
                    "--hotzone-size",
                    "1M",
                    "--key-file",
                    s(&key),
                    s(img),
                ],
            );
            cryptsetup_accepts(img, &key);
            assert!(
                exported(&t, img, &key) == plain,
                "{hash} finished by {finisher}"
            );
        }
    }
}

/// cryptsetup with `--resilience-hash` sha512 and whirlpool SIGKILLed mid-way, ucrypt
/// repairs and finishes; and the other way round with sha1 and sha3-256.
#[test]
fn resilience_hash_kills_either_way() {
    if !have_cryptsetup() {
        return;
    }
    kill_cryptsetup_rounds(2, &["--resilience-hash", "sha512"]);
    kill_cryptsetup_rounds(1, &["--resilience-hash", "whirlpool"]);
    // One round: the first is a checksum one (the second would be journal).
    kill_ucrypt_rounds(1, &["--resilience-hash", "sha1"]);
    kill_ucrypt_rounds(1, &["--resilience-hash", "sha3-256"]);
}

/// An Argon2 keyslot of 4 threads (made by `ucrypt add-key`: cryptsetup caps the threads at
/// the CPUs online when it makes one) rotated by both tools from copies of one image: the
/// new keyslots get the same PBKDF, its threads capped as cryptsetup caps them (2 on a
/// 2-CPU machine, measured), its passes and memory copied.
#[test]
fn argon2_keyslot_copied_as_cryptsetup_copies_it() {
    if !have_cryptsetup() {
        return;
    }
    let t = TempDir::new("slots-argon");
    let (img, key, plain) = volume(&t, 20, 4096);
    let key2 = t.path("key2");
    std::fs::write(&key2, "argon").expect("key2");
    ok(
        UCRYPT,
        &[
            "add-key",
            "-q",
            "--key-file",
            s(&key),
            "--pbkdf",
            "argon2id",
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-memory",
            "64",
            "--pbkdf-parallel",
            "4",
            s(&img),
            s(&key2),
        ],
    );
    ok("cryptsetup", &["luksKillSlot", "-q", s(&img), "0"]);
    assert_eq!(keyslot_kdf(&img, 1)["cpus"], 4);
    let theirs = t.path("theirs.img");
    std::fs::copy(&img, &theirs).expect("copy");
    let args = |img: &Path| -> Vec<String> {
        [
            "reencrypt",
            "--init-only",
            "-q",
            "--key-file",
            s(&key2),
            s(img),
        ]
        .map(String::from)
        .to_vec()
    };
    let a = args(&img);
    ok(UCRYPT, &a.iter().map(String::as_str).collect::<Vec<_>>());
    let c = args(&theirs);
    ok(
        "cryptsetup",
        &c.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let cpus = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(4);
    assert_eq!(keyslot_kdf(&img, 0), keyslot_kdf(&theirs, 0));
    assert_eq!(keyslot_kdf(&img, 0)["cpus"], cpus);
    assert_eq!(shift_metadata(&img), shift_metadata(&theirs));
    ok(
        "cryptsetup",
        &[
            "reencrypt",
            "--resume-only",
            "-q",
            "--force-offline-reencrypt",
            "--key-file",
            s(&key2),
            s(&img),
        ],
    );
    cryptsetup_opens_slot(&img, &key2, 0);
    assert!(exported(&t, &img, &key2) == plain);
}

/// The resilience named in a reencryption's keyslot, as cryptsetup's luksDump shows it.
fn resilience_shown(img: &Path) -> Option<String> {
    dump(img).lines().find_map(|l| {
        l.trim()
            .strip_prefix("Resilience:")
            .map(|r| r.trim().to_string())
    })
}

/// `--resume-only --resilience` switches a reencryption's resilience (cryptsetup 2.6), both
/// ways: one tool starts with checksum, the other resumes with journal and is SIGKILLed
/// after its header shows the switch (plus a seeded delay), and the first finishes from the
/// switched header (which its reencryption digest check accepts); data intact. A switch away
/// from a data shift's resilience is refused with cryptsetup's words and exit code, nothing
/// written.
#[test]
fn resilience_switches_on_resume_both_ways() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    for (starts, switches, finishes) in [
        ("cryptsetup", UCRYPT, "cryptsetup"),
        (UCRYPT, "cryptsetup", UCRYPT),
    ] {
        let mut switched_mid_way = 0;
        for round in 0..4 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let t = TempDir::new("switch");
            let (img, key, plain) = volume(&t, 80, [512, 4096][round % 2]);
            let mut init = vec!["reencrypt", "-q", "--init-only", "--resilience", "checksum"];
            init.extend(FAST_PBKDF2);
            init.extend(["--key-file", s(&key), s(&img)]);
            ok(starts, &init);
            // Small hotzones, each committed: the run takes long enough to be cut mid-way.
            let mut cmd = Command::new(switches);
            cmd.args([
                "reencrypt",
                "-q",
                "--resume-only",
                "--force-offline-reencrypt",
            ])
            .args(["--resilience", "journal", "--hotzone-size", "64K"])
            .args(["--key-file", s(&key), s(&img)]);
            // Killed once the header shows the switch, plus a seeded delay.
            let delay = Duration::from_millis(x % 200);
            let killed = kill_after_switch(cmd, &img, "journal", delay);
            let shown = resilience_shown(&img);
            println!(
                "{switches} switching, round {round}: killed={killed} after {delay:?}: {shown:?}"
            );
            if in_reencryption(&img) {
                switched_mid_way += usize::from(shown.as_deref() == Some("journal"));
                if in_hotzone(&img) {
                    ok(finishes, &["repair", "-q", "--key-file", s(&key), s(&img)]);
                }
                let resume = [
                    "reencrypt",
                    "-q",
                    "--resume-only",
                    "--force-offline-reencrypt",
                    "--key-file",
                    s(&key),
                    s(&img),
                ];
                ok(finishes, &resume);
            }
            cryptsetup_accepts(&img, &key);
            assert!(
                exported(&t, &img, &key) == plain,
                "{switches} round {round}: data"
            );
        }
        assert!(
            switched_mid_way > 0,
            "{switches} never left a switched reencryption mid-way in 4 rounds"
        );
    }
    // A data shift's resilience stays: refused by both, the header untouched.
    let t = TempDir::new("switch-shift");
    let img = t.path("plain.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(64 << 20))
        .expect("image");
    let key = t.path("key");
    std::fs::write(&key, b"rotate-me").expect("key");
    let mut init = vec!["reencrypt", "-q", "--encrypt", "--init-only"];
    init.extend(["--reduce-device-size", "32M"]);
    init.extend(FAST_PBKDF2);
    init.extend(["--key-file", s(&key), s(&img)]);
    ok("cryptsetup", &init);
    let before = std::fs::read(&img).expect("read");
    for tool in [UCRYPT, "cryptsetup"] {
        let o = run(
            tool,
            &[
                "reencrypt",
                "--resume-only",
                "--force-offline-reencrypt",
                "--resilience",
                "checksum",
                "--key-file",
                s(&key),
                s(&img),
            ],
        );
        assert_eq!(o.status.code(), Some(1), "{tool}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("Requested --resilience option cannot be applied"),
            "{tool}: {err}"
        );
        assert!(std::fs::read(&img).expect("read") == before, "{tool} wrote");
    }
}

/// The reencrypt keyslot's area type in the header file's first JSON area, read without
/// locking while a tool writes it (a torn read gives `None`).
fn area_type_raw(hdr: &Path) -> Option<String> {
    let b = std::fs::read(hdr).ok()?;
    let area = b.get(4096..16 << 10)?;
    let end = area.iter().position(|&c| c == 0).unwrap_or(area.len());
    let v: serde_json::Value = serde_json::from_slice(&area[..end]).ok()?;
    v["keyslots"]
        .as_object()?
        .values()
        .find(|k| k["type"] == "reencrypt")
        .and_then(|k| k["area"]["type"].as_str().map(str::to_string))
}

/// [`kill_when`] the header file `hdr` names the reencrypt area type `area`.
fn kill_after_switch(cmd: Command, hdr: &Path, area: &str, delay: Duration) -> bool {
    kill_when(cmd, || area_type_raw(hdr).as_deref() == Some(area), delay)
}

/// A decryption that moves the data back switches the protection of its moved segment on
/// resume (`--resilience journal`, which both tools map to `datashift-journal`), both ways:
/// one tool starts it with checksums, the other resumes with a journal and is SIGKILLed once
/// its header shows the switch (plus a seeded delay of up to 300 ms, halved after each round
/// the tool finished before the kill: ucrypt can finish the rest within 250 ms), and the first
/// finishes from the switched header (its digest check accepts it); the plaintext is at the
/// start of the device.
#[test]
fn resilience_switches_on_a_moved_back_decryption() {
    if !have_cryptsetup() {
        return;
    }
    let mut x = seed() | 1;
    for (starts, switches, finishes) in [
        ("cryptsetup", UCRYPT, "cryptsetup"),
        (UCRYPT, "cryptsetup", UCRYPT),
    ] {
        let offline = |prog: &str| {
            if prog == "cryptsetup" {
                vec!["--force-offline-reencrypt"]
            } else {
                vec![]
            }
        };
        let mut switched_mid_way = 0;
        let mut delay_max_ms = 300;
        for round in 0..3 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let t = TempDir::new("unshift-switch");
            let (img, key, plain) = volume(&t, 160, 4096);
            let before = std::fs::read(&img).expect("image");
            let hdr = t.path("exported.hdr");
            let mut init = offline(starts);
            init.extend(["--init-only", "--hotzone-size", "8M"]);
            let mut a = unshift_args(&key, &hdr, &init);
            a.push(s(&img));
            ok(starts, &a);
            let mut cmd = Command::new(switches);
            cmd.args(["reencrypt", "-q", "--resume-only", "--header", s(&hdr)])
                .args(offline(switches))
                .args(["--resilience", "journal", "--key-file", s(&key), s(&img)]);
            let delay = Duration::from_millis(x % delay_max_ms);
            let killed = kill_after_switch(cmd, &hdr, "datashift-journal", delay);
            if !killed {
                delay_max_ms = (delay_max_ms / 2).max(10);
            }
            let what = format!(
                "{switches} switching, round {round}: killed={killed} {delay:?} after the switch"
            );
            let shown = resilience_shown(&hdr);
            println!("{what}: {shown:?}");
            if in_reencryption(&hdr) && !dump(&hdr).contains(": luks2") {
                // Killed in cryptsetup's finalisation, its keyslots destroyed: neither tool
                // resumes (see `killed_in_finalisation`); the data is all plaintext.
                let raw = std::fs::read(&img).expect("data");
                assert!(raw[..plain.len()] == plain[..], "{what}: not the plaintext");
                println!("{what}: killed in cryptsetup's finalisation");
                continue;
            }
            if in_reencryption(&hdr) {
                switched_mid_way += usize::from(shown.as_deref() == Some("datashift-journal"));
                let mut tail = vec!["-q", "--header", s(&hdr), "--key-file", s(&key)];
                tail.extend(offline(finishes));
                tail.push(s(&img));
                if in_hotzone(&hdr) {
                    let mut r = vec!["repair"];
                    r.extend(tail.iter().filter(|a| **a != "--force-offline-reencrypt"));
                    ok(finishes, &r);
                }
                if in_reencryption(&hdr) {
                    let mut r = vec!["reencrypt", "--resume-only"];
                    r.extend(&tail);
                    let before_resume = shift_metadata(&hdr);
                    let o = run(finishes, &r);
                    let err = String::from_utf8_lossy(&o.stderr);
                    if finishes == "cryptsetup"
                        && err.contains("Failed to write reencryption resilience metadata")
                    {
                        // cryptsetup 2.6.1 cannot resume a datashift-journal decryption left
                        // between its walk and the moved segment's hotzone when the moved
                        // segment is shorter than the shift: it fails so on a header it wrote
                        // and was killed in itself (measured). ucrypt finishes it.
                        println!("{what}: cryptsetup cannot resume this state; ucrypt does");
                        let mut u = vec!["reencrypt", "--resume-only"];
                        u.extend(tail.iter().filter(|a| **a != "--force-offline-reencrypt"));
                        ok(UCRYPT, &u);
                    } else {
                        assert!(
                            o.status.success(),
                            "{what}: {finishes} resume: {err}\n{before_resume}"
                        );
                    }
                }
            }
            unshift_decrypted(&img, &hdr, &plain, &before, &what);
        }
        assert!(
            switched_mid_way > 0,
            "{switches} never left a switched decryption mid-way in 3 rounds"
        );
    }
}
