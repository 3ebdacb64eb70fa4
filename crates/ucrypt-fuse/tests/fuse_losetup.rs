//! The FUSE front end end to end, on this machine's kernel: the served file attached with
//! `losetup` (page cache and `--direct-io=on`), `mkfs.ext4`, a file tree copied in, `fsck.ext4
//! -f` clean, unmounted, remounted, read back identical; parallel O_DIRECT I/O against a model;
//! fallocate semantics. Every case runs on both transports: classic /dev/fuse and
//! FUSE-over-io_uring (which these tests switch on through
//! /sys/module/fuse/parameters/enable_uring as root, restoring the old value afterwards).
//! Needs root, /dev/fuse and loop devices: SKIPPED otherwise; io_uring rows are SKIPPED where the
//! kernel lacks it, but fail under CI as root on Linux >= 6.14.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, RwLock};

use ucrypt::{BlockDev, Error, Result};
use ucrypt_fuse::{spawn, ActiveTransport, MountOptions, Transport, ENABLE_URING_PATH};

/// Plaintext in memory; discard leaves a recognisable pattern (not zeroes), like a LUKS
/// volume's freed ciphertext would read as garbage.
struct MemDev {
    data: RwLock<Vec<u8>>,
    block: u32,
}

const DISCARD_PATTERN: u8 = 0xdb;

impl MemDev {
    fn new(size: usize, block: u32) -> Arc<Self> {
        Arc::new(MemDev {
            data: RwLock::new(vec![0; size]),
            block,
        })
    }
    fn check(&self, off: u64, len: u64) -> Result<std::ops::Range<usize>> {
        let size = self.size();
        match off.checked_add(len) {
            Some(end) if end <= size => Ok(off as usize..end as usize),
            _ => Err(Error::OutOfRange {
                offset: off,
                len,
                size,
            }),
        }
    }
}

impl BlockDev for MemDev {
    fn size(&self) -> u64 {
        self.data.read().expect("lock").len() as u64
    }
    fn block_size(&self) -> u32 {
        self.block
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let r = self.check(offset, buf.len() as u64)?;
        buf.copy_from_slice(&self.data.read().expect("lock")[r]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let r = self.check(offset, buf.len() as u64)?;
        self.data.write().expect("lock")[r].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let r = self.check(offset, len)?;
        self.data.write().expect("lock")[r].fill(DISCARD_PATTERN);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let r = self.check(offset, len)?;
        self.data.write().expect("lock")[r].fill(0);
        Ok(())
    }
}

fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (mount, losetup)".into());
    }
    for p in ["/dev/fuse", "/dev/loop-control"] {
        if !Path::new(p).exists() {
            return Some(format!("{p} missing"));
        }
    }
    for t in ["losetup", "mkfs.ext4", "fsck.ext4", "mount", "umount"] {
        if Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {t}"))
            .output()
            .map(|o| !o.status.success())
            .unwrap_or(true)
        {
            return Some(format!(
                "{t} missing (Debian packages util-linux, mount, e2fsprogs)"
            ));
        }
    }
    None
}

macro_rules! skip_unless_able {
    () => {
        if let Some(r) = skip_reason() {
            println!("SKIPPED: {r}");
            return;
        }
    };
}

/// Tests using io_uring and the enable_uring value to restore when the last one ends.
static URING_USERS: Mutex<(usize, Option<String>)> = Mutex::new((0, None));

/// Holds enable_uring at Y while alive.
struct UringOn;

fn kernel_at_least(major: u32, minor: u32) -> bool {
    let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut it = r
        .trim()
        .split(['.', '-'])
        .map(|x| x.parse::<u32>().unwrap_or(0));
    let (a, b) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    (a, b) >= (major, minor)
}

impl UringOn {
    /// Err: why io_uring cannot be had here.
    fn new() -> std::result::Result<UringOn, String> {
        let mut g = URING_USERS.lock().unwrap_or_else(|e| e.into_inner());
        let old = std::fs::read_to_string(ENABLE_URING_PATH)
            .map_err(|e| format!("{ENABLE_URING_PATH}: {e} (kernel without FUSE-over-io_uring)"))?;
        if g.0 == 0 {
            std::fs::write(ENABLE_URING_PATH, "Y")
                .map_err(|e| format!("cannot set {ENABLE_URING_PATH} to Y: {e}"))?;
            g.1 = Some(old.trim().to_string());
        }
        g.0 += 1;
        Ok(UringOn)
    }
}

impl Drop for UringOn {
    fn drop(&mut self) {
        let mut g = URING_USERS.lock().unwrap_or_else(|e| e.into_inner());
        g.0 -= 1;
        if g.0 == 0 {
            if let Some(old) = g.1.take() {
                let _ = std::fs::write(ENABLE_URING_PATH, old);
            }
        }
    }
}

/// The options for a transport row, and the guard keeping io_uring on; None: SKIPPED.
fn transport_row(t: Transport) -> Option<(MountOptions, Option<UringOn>)> {
    let opts = MountOptions {
        transport: t,
        ..MountOptions::default()
    };
    if t != Transport::IoUring {
        return Some((opts, None));
    }
    match UringOn::new() {
        Ok(g) => Some((opts, Some(g))),
        Err(r) => {
            assert!(
                std::env::var_os("CI").is_none() || !kernel_at_least(6, 14),
                "CI as root on Linux >= 6.14 must be able to enable FUSE-over-io_uring: {r}"
            );
            println!("SKIPPED: {r}");
            None
        }
    }
}

/// After use: with io_uring, the ring (not /dev/fuse) must have carried the requests.
fn check_served(m: &ucrypt_fuse::Mounted, t: Transport) {
    let (classic, ring) = m.requests_served();
    println!("requests served: {classic} classic, {ring} io_uring");
    if t == Transport::IoUring {
        assert!(
            ring > 0 && ring > classic,
            "io_uring carried too few requests"
        );
    } else {
        assert_eq!(ring, 0);
    }
}

fn check_transport(m: &ucrypt_fuse::Mounted, t: Transport) {
    println!("{}", m.transport);
    match t {
        Transport::IoUring => assert!(
            matches!(m.transport, ActiveTransport::IoUring { .. }),
            "asked for io_uring, got {}",
            m.transport
        ),
        Transport::Classic => assert!(matches!(m.transport, ActiveTransport::Classic { .. })),
        Transport::Auto => {}
    }
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("spawn {cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

struct Tmp(PathBuf);
impl Tmp {
    fn new(tag: &str) -> Tmp {
        let p = std::env::temp_dir().join(format!("ucrypt-fuse-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        Tmp(p)
    }
}
impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Detaches the loop device even when an assertion fails in between.
struct Loop(String);
impl Loop {
    fn attach(file: &Path, direct: bool) -> Loop {
        let mut args = vec!["--find", "--show"];
        if direct {
            args.push("--direct-io=on");
        }
        let f = file.to_str().expect("utf-8 path");
        args.push(f);
        let dev = run("losetup", &args);
        let lo = Loop(dev);
        let name = lo.0.trim_start_matches("/dev/");
        let dio =
            std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap_or_default();
        println!(
            "attached {f} as {} (direct I/O asked {direct}, sysfs dio={})",
            lo.0,
            dio.trim()
        );
        if direct {
            assert_eq!(
                dio.trim(),
                "1",
                "losetup --direct-io=on did not enable direct I/O on the FUSE file"
            );
        }
        lo
    }
}
impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

/// Unmounts a filesystem mount even when an assertion fails in between.
struct FsMount(PathBuf);
impl Drop for FsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn seed() -> u64 {
    let s = std::env::var("UCRYPT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!("seed: UCRYPT_TEST_SEED={s}");
    s
}

/// A small tree of seeded files: name -> contents.
fn make_tree(dir: &Path, seed: u64) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut st = seed;
    let mut files = BTreeMap::new();
    // (relative path, size): empty, tiny, unaligned, multi-block, a few MiB.
    let rows: &[(&str, usize)] = &[
        ("empty", 0),
        ("a/one-byte", 1),
        ("a/b/unaligned", 12_345),
        ("a/b/c/four-k", 4096),
        ("big/three-mib", 3 << 20),
        ("big/odd", (1 << 20) + 17),
    ];
    for &(rel, size) in rows {
        let mut v = vec![0u8; size];
        for c in v.chunks_mut(8) {
            let x = splitmix(&mut st).to_le_bytes();
            c.copy_from_slice(&x[..c.len()]);
        }
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, &v).expect("write tree file");
        files.insert(PathBuf::from(rel), v);
    }
    files
}

fn check_tree(dir: &Path, files: &BTreeMap<PathBuf, Vec<u8>>) {
    for (rel, want) in files {
        let got =
            std::fs::read(dir.join(rel)).unwrap_or_else(|e| panic!("read {}: {e}", rel.display()));
        assert!(got == *want, "{} differs after remount", rel.display());
    }
}

#[test]
fn losetup_mkfs_fsck_remount_classic() {
    losetup_mkfs_fsck_remount(Transport::Classic)
}

#[test]
fn losetup_mkfs_fsck_remount_io_uring() {
    losetup_mkfs_fsck_remount(Transport::IoUring)
}

fn losetup_mkfs_fsck_remount(t: Transport) {
    skip_unless_able!();
    let Some((base, _uring)) = transport_row(t) else {
        return;
    };
    let seed = seed();
    let tmp = Tmp::new(&format!("losetup-{t:?}"));
    let dev = MemDev::new(64 << 20, 4096);
    let src = tmp.0.join("src");
    let files = make_tree(&src, seed);

    // 1) the mount point is a regular file; loop device through the page cache.
    let file = tmp.0.join("volume");
    std::fs::write(&file, b"").expect("create mount point file");
    let m = spawn(dev.clone(), &file, &base).expect("FUSE mount");
    check_transport(&m, t);
    assert_eq!(std::fs::metadata(&file).expect("stat").len(), 64 << 20);
    {
        let lo = Loop::attach(&file, false);
        run("mkfs.ext4", &["-q", "-F", &lo.0]);
        let mnt = tmp.0.join("mnt");
        std::fs::create_dir_all(&mnt).expect("mkdir mnt");
        run("mount", &[&lo.0, mnt.to_str().expect("utf-8")]);
        let fsm = FsMount(mnt.clone());
        run(
            "cp",
            &[
                "-a",
                &format!("{}/.", src.display()),
                mnt.to_str().expect("utf-8"),
            ],
        );
        check_tree(&mnt, &files);
        drop(fsm);
        run("fsck.ext4", &["-f", "-n", &lo.0]);
    }
    check_served(&m, t);
    m.unmount().expect("unmount FUSE");

    // 2) remount as a named file in a directory; loop with --direct-io=on; fsck, read back.
    let dir = tmp.0.join("dir");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let opts = MountOptions {
        file_name: Some("disk.img".into()),
        ..base.clone()
    };
    let m = spawn(dev.clone(), &dir, &opts).expect("FUSE remount");
    check_transport(&m, t);
    assert_eq!(m.file, dir.join("disk.img"));
    let names: Vec<_> = std::fs::read_dir(&dir)
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("disk.img")]);
    {
        let lo = Loop::attach(&m.file, true);
        run("fsck.ext4", &["-f", "-n", &lo.0]);
        let mnt = tmp.0.join("mnt2");
        std::fs::create_dir_all(&mnt).expect("mkdir mnt2");
        run("mount", &[&lo.0, mnt.to_str().expect("utf-8")]);
        let fsm = FsMount(mnt.clone());
        check_tree(&mnt, &files);
        // Write through direct I/O too, then fsck again.
        run(
            "cp",
            &[
                "-a",
                &format!("{}/.", src.display()),
                &format!("{}/copy2", mnt.display()),
            ],
        );
        drop(fsm);
        run("fsck.ext4", &["-f", "-n", &lo.0]);
    }
    check_served(&m, t);
    m.unmount().expect("unmount FUSE");
}

#[test]
fn parallel_direct_io_matches_model_and_fallocate_zeroes_classic() {
    parallel_direct_io_matches_model_and_fallocate_zeroes(Transport::Classic)
}

#[test]
fn parallel_direct_io_matches_model_and_fallocate_zeroes_io_uring() {
    parallel_direct_io_matches_model_and_fallocate_zeroes(Transport::IoUring)
}

fn parallel_direct_io_matches_model_and_fallocate_zeroes(t: Transport) {
    skip_unless_able!();
    let Some((base, _uring)) = transport_row(t) else {
        return;
    };
    let seed = seed();
    let tmp = Tmp::new(&format!("parallel-{t:?}"));
    const SIZE: usize = 16 << 20;
    let dev = MemDev::new(SIZE, 4096);
    let dir = tmp.0.join("m");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let opts = MountOptions {
        file_name: Some("vol".into()),
        threads: 4,
        ..base
    };
    let m = spawn(dev.clone(), &dir, &opts).expect("mount");
    check_transport(&m, t);
    let path = m.file.clone();

    // Each thread owns a disjoint quarter and writes seeded 4 KiB-aligned blocks with O_DIRECT,
    // then reads its quarter back; the device must equal the merged model.
    const THREADS: usize = 4;
    let quarter = SIZE / THREADS;
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let path = path.clone();
            std::thread::spawn(move || {
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&path)
                    .expect("open O_DIRECT");
                let mut model = vec![0u8; quarter];
                let mut st = seed ^ (t as u64) << 32;
                let layout = std::alloc::Layout::from_size_align(64 << 10, 4096).expect("layout");
                // SAFETY: non-zero size; freed below with the same layout.
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                assert!(!p.is_null());
                // SAFETY: `p` points to 64 KiB we own exclusively until dealloc.
                let buf = unsafe { std::slice::from_raw_parts_mut(p, 64 << 10) };
                for _ in 0..200 {
                    let blocks = 1 + (splitmix(&mut st) % 16) as usize;
                    let len = blocks * 4096;
                    let off = (splitmix(&mut st) as usize % (quarter / 4096 - blocks + 1)) * 4096;
                    for c in buf[..len].chunks_mut(8) {
                        c.copy_from_slice(&splitmix(&mut st).to_le_bytes());
                    }
                    f.write_all_at(&buf[..len], (t * quarter + off) as u64)
                        .expect("pwrite");
                    model[off..off + len].copy_from_slice(&buf[..len]);
                }
                let mut got = vec![0u8; quarter];
                for (i, chunk) in got.chunks_mut(64 << 10).enumerate() {
                    f.read_exact_at(
                        &mut buf[..chunk.len()],
                        (t * quarter + i * (64 << 10)) as u64,
                    )
                    .expect("pread");
                    chunk.copy_from_slice(&buf[..chunk.len()]);
                }
                // SAFETY: allocated above with this layout, not used after.
                unsafe { std::alloc::dealloc(p, layout) };
                assert!(
                    got == model,
                    "thread {t}: read back differs from what it wrote"
                );
                model
            })
        })
        .collect();
    let mut whole = Vec::with_capacity(SIZE);
    for h in handles {
        whole.extend_from_slice(&h.join().expect("worker"));
    }
    assert!(
        *dev.data.read().expect("lock") == whole,
        "device differs from the model"
    );

    // fallocate: PUNCH_HOLE and ZERO_RANGE must read back as zeroes; growing is refused.
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("open");
    let fd = f.as_raw_fd();
    let rows: &[(i32, i64, i64, i32)] = &[
        // (mode, offset, len, expected errno or 0)
        (
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            8192,
            3 * 4096 + 100,
            0,
        ),
        (libc::FALLOC_FL_ZERO_RANGE, 1 << 20, 12_345, 0),
        (
            libc::FALLOC_FL_ZERO_RANGE,
            SIZE as i64 - 4096,
            8192,
            libc::ENOSPC,
        ),
        (0, SIZE as i64 - 4096, 8192, libc::ENOSPC),
        (0, 0, 4096, 0),
    ];
    for &(mode, off, len, want) in rows {
        // SAFETY: fd is a valid open file for the duration of the call.
        let rc = unsafe { libc::fallocate(fd, mode, off, len) };
        let got = if rc == 0 {
            0
        } else {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
        };
        assert_eq!(got, want, "fallocate(mode {mode:#x}, {off}, {len})");
        if want == 0 && mode != 0 {
            let mut b = vec![1u8; len as usize];
            f.read_exact_at(&mut b, off as u64).expect("read back");
            assert!(
                b.iter().all(|&x| x == 0),
                "fallocate mode {mode:#x} range does not read as zeroes"
            );
            whole[off as usize..(off + len) as usize].fill(0);
        }
    }
    assert!(
        *dev.data.read().expect("lock") == whole,
        "fallocate touched bytes outside its range"
    );
    drop(f);
    check_served(&m, t);
    m.unmount().expect("unmount");
}
