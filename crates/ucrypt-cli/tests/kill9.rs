//! kill -9 of the front ends, as a user's crash would do it: a client writes seeded data to a
//! LUKS2 volume while `ucrypt serve` (NBD, a libnbd client: writes, some with FUA, and
//! flushes) or `ucrypt mount` (FUSE, O_DIRECT writes and fsync) runs; the server gets SIGKILL
//! at a seeded random moment; then the volume is served again (it must open cleanly) and read
//! back. Every write acknowledged as durable (with FUA, or before an acknowledged flush or
//! fsync) must read back, unless a later write to the same block replaced it; every block
//! holds its durable contents or one of the writes started after them, never anything else.
//!
//! A kill -9 is not a power cut: what the server handed to the kernel survives it. The test
//! shows the server acknowledges nothing before it has written it, and that a killed server
//! leaves a volume that opens (power cuts are `ucrypt`'s crash_sim and crash_luks tests).
//!
//! `UCRYPT_KILL9_TRIALS` sets the trials per front end (default 10; the long mode recorded in
//! BENCHMARKS.md runs 100); `UCRYPT_SEED` the first seed. Needs /usr/bin/python3 with libnbd's
//! binding (Debian python3-libnbd) for NBD, and root with /dev/fuse for FUSE: SKIPPED
//! otherwise.

mod nbd_common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nbd_common::{need, run, Server, TempDir, UCRYPT};

const PYTHON: &str = "/usr/bin/python3";
/// The client writes whole blocks of this size.
const BLOCK: usize = 4096;
/// The part of the volume the client writes and the check reads back.
const REGION: usize = 8 << 20;
/// The image: LUKS2's 16 MiB of metadata and the data area.
const IMAGE_BYTES: u64 = 32 << 20;
/// The kill comes this long after the client's first write, plus a seeded part of
/// `KILL_SPREAD_MS`.
const KILL_AFTER_MS: u64 = 50;
const KILL_SPREAD_MS: u64 = 500;
const WAIT: Duration = Duration::from_secs(20);
const PASSPHRASE: &[u8] = b"kill -9 trial passphrase";

/// The client: `write` mode writes until the server is gone and logs, before each write
/// `W index first-block blocks fua`, after its acknowledgement `A index`, around each flush
/// `S` and `F`; `read` mode saves the region to a file. A block written by write `i` holds
/// (trial, i, block) as three little-endian u64 and then a byte derived from them.
const CLIENT: &str = r#"
import mmap, os, random, struct, sys
mode, target, op, trial, seed, region = sys.argv[1:7]
trial, seed, region = int(trial), int(seed), int(region)
BS = 4096
def block(i, b):
    return struct.pack('<QQQ', trial, i, b) + bytes([(i * 31 + b * 7 + trial) & 0xff]) * (BS - 24)
if mode == 'nbd':
    import nbd
    h = nbd.NBD()
    h.connect_uri(target)
    def write(buf, off, fua): h.pwrite(buf, off, nbd.CMD_FLAG_FUA if fua else 0)
    def sync(): h.flush()
    def read(n, off): return h.pread(n, off)
else:
    fd = os.open(target, os.O_RDWR | os.O_DIRECT)
    def write(buf, off, fua):
        m = mmap.mmap(-1, len(buf)); m.write(buf)
        if os.pwritev(fd, [m], off) != len(buf): raise OSError('short write')
    def sync(): os.fsync(fd)
    def read(n, off):
        m = mmap.mmap(-1, n)
        if os.preadv(fd, [m], off) != n: raise OSError('short read')
        return bytes(m)
if op == 'read':
    with open(sys.argv[7], 'wb') as f:
        for off in range(0, region, 1 << 20):
            f.write(read(min(1 << 20, region - off), off))
    sys.exit(0)
def log(s):
    sys.stdout.write(s + '\n'); sys.stdout.flush()
rng = random.Random(seed)
i = 0
while True:
    if rng.random() < 0.15:
        log('S'); sync(); log('F')
    else:
        n = rng.randint(1, 16)
        b0 = rng.randrange(0, region // BS - n + 1)
        fua = mode == 'nbd' and rng.random() < 0.25
        buf = b''.join(block(i, b0 + k) for k in range(n))
        log('W %d %d %d %d' % (i, b0, n, fua)); write(buf, b0 * BS, fua); log('A %d' % i)
        i += 1
"#;

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn trials() -> u64 {
    std::env::var("UCRYPT_KILL9_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

fn first_seed() -> u64 {
    let s = std::env::var("UCRYPT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    eprintln!("seed = {s} (replay with UCRYPT_SEED={s})");
    s
}

/// A fresh LUKS2 image and its key file.
fn luks2_volume(dir: &TempDir) -> (String, String) {
    let (img, key) = (dir.s("vol.img"), dir.s("key"));
    std::fs::write(&key, PASSPHRASE).expect("key file");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(IMAGE_BYTES))
        .expect("image");
    let (ok, out) = run(
        UCRYPT,
        &[
            "format",
            "-q",
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
            &key,
            &img,
        ],
    );
    assert!(ok, "format: {out}");
    (img, key)
}

fn client(
    mode: &str,
    target: &str,
    op: &str,
    trial: u64,
    seed: u64,
    out: Option<&Path>,
) -> Command {
    let mut c = Command::new(PYTHON);
    c.args(["-c", CLIENT, mode, target, op])
        .arg(trial.to_string())
        .arg(seed.to_string())
        .arg(REGION.to_string());
    if let Some(o) = out {
        c.arg(o);
    }
    c
}

/// Reads the region through a client into memory.
fn read_region(mode: &str, target: &str, dir: &TempDir) -> Vec<u8> {
    let out = dir.path("region");
    let st = client(mode, target, "read", 0, 0, Some(&out))
        .stdin(Stdio::null())
        .status()
        .expect("run the read client");
    assert!(st.success(), "read the region back through {mode}");
    let v = std::fs::read(&out).expect("region");
    assert_eq!(v.len(), REGION);
    v
}

#[derive(Debug, Clone, Copy)]
struct Write {
    first: usize,
    blocks: usize,
    fua: bool,
    /// Acknowledged with FUA, or before an acknowledged flush.
    durable: bool,
}

/// Runs the writing client, kills the server (`kill`) `kill_after` its first write, and
/// returns the client's writes (by index) and how many flushes were acknowledged.
fn write_until_killed(
    mut c: Command,
    kill_after: Duration,
    kill: impl FnOnce(),
) -> (Vec<Write>, u64) {
    let mut child: Child = c
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the client");
    let lines = BufReader::new(child.stdout.take().expect("client stdout"));
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut writes: Vec<Write> = Vec::new();
        let mut acked_since_flush: Vec<usize> = Vec::new();
        let mut flushes = 0;
        for line in lines.lines() {
            let Ok(line) = line else { break };
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                ["W", i, b, n, fua] => {
                    if writes.is_empty() {
                        let _ = tx.send(());
                    }
                    assert_eq!(
                        i.parse::<usize>().ok(),
                        Some(writes.len()),
                        "client log order"
                    );
                    writes.push(Write {
                        first: b.parse().expect("block"),
                        blocks: n.parse().expect("blocks"),
                        fua: *fua == "1",
                        durable: false,
                    });
                }
                ["A", i] => {
                    let i: usize = i.parse().expect("index");
                    if writes[i].fua {
                        writes[i].durable = true;
                    } else {
                        acked_since_flush.push(i);
                    }
                }
                ["S"] => {}
                ["F"] => {
                    flushes += 1;
                    for i in acked_since_flush.drain(..) {
                        writes[i].durable = true;
                    }
                }
                _ => panic!("client log line {line:?}"),
            }
        }
        (writes, flushes)
    });
    // Kill once the client has started writing (or give up waiting).
    let _ = rx.recv_timeout(WAIT);
    std::thread::sleep(kill_after);
    kill();
    let t0 = Instant::now();
    while child.try_wait().expect("client").is_none() {
        assert!(
            t0.elapsed() < WAIT,
            "the client did not notice the server's death"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    reader.join().expect("client log")
}

/// The contents write `i` of `trial` gives block `b` (the client's `block`).
fn block_of(trial: u64, i: usize, b: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(BLOCK);
    v.extend_from_slice(&trial.to_le_bytes());
    v.extend_from_slice(&(i as u64).to_le_bytes());
    v.extend_from_slice(&(b as u64).to_le_bytes());
    let fill = ((i as u64 * 31 + b as u64 * 7 + trial) & 0xff) as u8;
    v.resize(BLOCK, fill);
    v
}

/// Checks the region read after the kill against the writes of `trial` over `before`.
fn check(trial: u64, before: &[u8], after: &[u8], writes: &[Write]) -> Result<(), String> {
    let mut by_block: Vec<Vec<usize>> = vec![Vec::new(); REGION / BLOCK];
    for (i, w) in writes.iter().enumerate() {
        for ws in &mut by_block[w.first..w.first + w.blocks] {
            ws.push(i);
        }
    }
    for (b, ws) in by_block.iter().enumerate() {
        let got = &after[b * BLOCK..(b + 1) * BLOCK];
        // The last durable write, and every write started after it, are allowed; the block's
        // contents before the trial only if no write to it is durable.
        let last_durable = ws.iter().rposition(|&i| writes[i].durable);
        let from = last_durable.unwrap_or(0);
        let ok = ws[from..]
            .iter()
            .any(|&i| got == &block_of(trial, i, b)[..])
            || (last_durable.is_none() && got == &before[b * BLOCK..(b + 1) * BLOCK]);
        if !ok {
            return Err(format!(
                "block {b}: neither {} nor a later write ({} writes to it, last durable {:?})",
                if last_durable.is_some() {
                    "its durable write"
                } else {
                    "its old contents"
                },
                ws.len(),
                last_durable.map(|k| ws[k])
            ));
        }
    }
    Ok(())
}

fn sigkill(pid: u32) {
    // SAFETY: a signal to our own child process, which has not been reaped yet.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
}

#[test]
fn nbd_server_killed_keeps_every_durable_write() {
    if !need(PYTHON, "python3") {
        return;
    }
    let has_nbd = Command::new(PYTHON)
        .args(["-c", "import nbd"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_nbd {
        if std::env::var_os("CI").is_some() {
            panic!("libnbd's Python binding (python3-libnbd) is required under CI");
        }
        println!("SKIPPED: no libnbd Python binding (Debian package python3-libnbd)");
        return;
    }
    let dir = TempDir::new("kill9");
    let (img, key) = luks2_volume(&dir);
    let sock = dir.s("sock");
    let listen = format!("unix:{sock}");
    let serve = || Server::start(&[&img, "--key-file", &key, "--nbd", &listen], 1);
    let first = first_seed();
    let n = trials();
    let t0 = Instant::now();
    let mut before = {
        let s = serve();
        read_region("nbd", s.uri(), &dir)
    };
    let (mut writes_total, mut durable_total) = (0, 0);
    for trial in 0..n {
        let seed = first + trial;
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let kill_after = Duration::from_millis(KILL_AFTER_MS + xorshift(&mut x) % KILL_SPREAD_MS);
        let mut srv = serve();
        let uri = srv.uri().to_string();
        let pid = srv.child.id();
        let (writes, _) = write_until_killed(
            client("nbd", &uri, "write", trial + 1, seed, None),
            kill_after,
            || sigkill(pid),
        );
        let _ = srv.child.wait();
        std::mem::forget(srv);
        let _ = std::fs::remove_file(&sock);
        // Served again: the volume must open, and hold every durable write.
        let s = serve();
        let after = read_region("nbd", s.uri(), &dir);
        drop(s);
        if let Err(e) = check(trial + 1, &before, &after, &writes) {
            panic!("trial {trial} (seed {seed}, kill after {kill_after:?}): {e}");
        }
        writes_total += writes.len();
        durable_total += writes.iter().filter(|w| w.durable).count();
        before = after;
    }
    let (ok, out) = run(UCRYPT, &["dump", &img]);
    assert!(ok, "dump after the trials: {out}");
    eprintln!(
        "NBD: {n} kill -9 trials (seeds {first}..{}): {writes_total} writes, {durable_total} \
         acknowledged as durable, all kept; {:.1} s",
        first + n,
        t0.elapsed().as_secs_f64()
    );
}

/// Whether `p` is a FUSE mount point now (/proc/self/mountinfo).
fn is_fuse_mount(p: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let want = p.to_string_lossy();
    info.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.get(4) == Some(&want.as_ref()) && l.contains(" - fuse")
    })
}

/// `ucrypt mount IMG FILE`, once FILE is a FUSE mount.
fn mount(img: &str, key: &str, file: &Path) -> Child {
    let child = Command::new(UCRYPT)
        .args([
            "mount",
            img,
            file.to_str().expect("utf-8"),
            "--key-file",
            key,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn ucrypt mount");
    let t0 = Instant::now();
    while !is_fuse_mount(file) {
        assert!(t0.elapsed() < WAIT, "ucrypt mount did not mount in time");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Takes down the dead mount a killed daemon left (lazily, as a user would).
fn unmount(file: &Path) {
    let _ = Command::new("umount")
        .arg("-l")
        .arg(file)
        .stderr(Stdio::null())
        .status();
    let t0 = Instant::now();
    while is_fuse_mount(file) {
        assert!(t0.elapsed() < WAIT, "the dead mount did not go");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct UnmountOnDrop(PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        if is_fuse_mount(&self.0) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

#[test]
fn fuse_daemon_killed_keeps_every_fsynced_write() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/fuse").exists() {
        println!("SKIPPED: needs root and /dev/fuse (mount, umount -l)");
        return;
    }
    if !need(PYTHON, "python3") {
        return;
    }
    let dir = TempDir::new("kill9-fuse");
    let (img, key) = luks2_volume(&dir);
    let file: PathBuf = dir.path("plain");
    std::fs::write(&file, b"").expect("mount point");
    // Dropped before `dir`: a failed trial leaves no mount behind (and its daemon then exits).
    let _unmount = UnmountOnDrop(file.clone());
    let target = file.to_str().expect("utf-8").to_string();
    let first = first_seed();
    let n = trials();
    let t0 = Instant::now();
    let stop = |mut c: Child| {
        // SAFETY: a signal to our own child process, not yet reaped.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while c.try_wait().expect("mount").is_none() {
            if t.elapsed() > WAIT {
                let _ = c.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        unmount(&file);
    };
    let mut before = {
        let m = mount(&img, &key, &file);
        let r = read_region("file", &target, &dir);
        stop(m);
        r
    };
    let (mut writes_total, mut durable_total) = (0, 0);
    for trial in 0..n {
        let seed = first + trial;
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let kill_after = Duration::from_millis(KILL_AFTER_MS + xorshift(&mut x) % KILL_SPREAD_MS);
        let mut m = mount(&img, &key, &file);
        let pid = m.id();
        let (writes, _) = write_until_killed(
            client("file", &target, "write", trial + 1, seed, None),
            kill_after,
            || sigkill(pid),
        );
        let _ = m.wait();
        unmount(&file);
        let m = mount(&img, &key, &file);
        let after = read_region("file", &target, &dir);
        stop(m);
        if let Err(e) = check(trial + 1, &before, &after, &writes) {
            panic!("trial {trial} (seed {seed}, kill after {kill_after:?}): {e}");
        }
        writes_total += writes.len();
        durable_total += writes.iter().filter(|w| w.durable).count();
        before = after;
    }
    let (ok, out) = run(UCRYPT, &["dump", &img]);
    assert!(ok, "dump after the trials: {out}");
    eprintln!(
        "FUSE: {n} kill -9 trials (seeds {first}..{}): {writes_total} writes, {durable_total} \
         acknowledged as durable, all kept; {:.1} s",
        first + n,
        t0.elapsed().as_secs_f64()
    );
}

/// The check is not vacuous: a lost durable write, a block from nowhere, and a write older
/// than the block's durable one are each caught; a lost write that was never durable is not.
#[test]
fn the_check_catches_lost_and_foreign_blocks() {
    let before = vec![7u8; REGION];
    let w = |first, durable| Write {
        first,
        blocks: 2,
        fua: false,
        durable,
    };
    let writes = [w(0, true), w(1, true), w(10, false)];
    let mut after = before.clone();
    for (i, wr) in writes.iter().enumerate().take(2) {
        for b in wr.first..wr.first + wr.blocks {
            after[b * BLOCK..(b + 1) * BLOCK].copy_from_slice(&block_of(5, i, b));
        }
    }
    // Write 2 (never durable) lost: allowed.
    assert_eq!(check(5, &before, &after, &writes), Ok(()));
    // Block 2 keeps its old contents though write 1 was durable.
    let mut lost = after.clone();
    lost[2 * BLOCK..3 * BLOCK].copy_from_slice(&before[..BLOCK]);
    assert!(check(5, &before, &lost, &writes).is_err());
    // Block 1 holds write 0's contents, older than durable write 1.
    let mut stale = after.clone();
    stale[BLOCK..2 * BLOCK].copy_from_slice(&block_of(5, 0, 1));
    assert!(check(5, &before, &stale, &writes).is_err());
    // A block nobody wrote changed.
    let mut foreign = after;
    foreign[100 * BLOCK] ^= 1;
    assert!(check(5, &before, &foreign, &writes).is_err());
}
