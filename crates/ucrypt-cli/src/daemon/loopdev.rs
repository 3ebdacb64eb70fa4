//! Loop devices through their ioctls (linux/loop.h): attach the FUSE file with direct I/O,
//! detach it, and find one by its backing file after a crash.
//!
//! Attaching: LOOP_CTL_GET_FREE on /dev/loop-control names a free device, LOOP_CONFIGURE sets
//! file, block size and flags in one call (Linux >= 5.8). Flags: LO_FLAGS_DIRECT_IO, so the
//! page cache is not kept twice (once above the loop device, once for the FUSE file), and
//! LO_FLAGS_AUTOCLEAR, so the kernel detaches the device by itself when its last opener
//! closes it: a daemon killed with SIGKILL leaves no loop device behind unless something
//! (a mount) still holds it.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LOOP_CONTROL: &str = "/dev/loop-control";
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_SET_CAPACITY: libc::c_ulong = 0x4C07;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// Free devices tried, at most, when another process takes the one LOOP_CTL_GET_FREE named
/// before we configure it (EBUSY).
const ATTACH_TRIES_MAX: u32 = 8;

/// How long [`LoopDevice::detach`] waits for the kernel to let go of the backing file, so
/// that the FUSE file can then be unmounted normally rather than lazily.
pub const RELEASE_WAIT: Duration = Duration::from_secs(5);
const RELEASE_POLL: Duration = Duration::from_millis(20);

/// `struct loop_info64`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

// The kernel's sizes (uapi, stable ABI): a mismatch would make the ioctls read garbage.
const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

/// An attached loop device; this process holds it open (and so keeps it attached).
#[derive(Debug)]
pub struct LoopDevice {
    file: File,
    pub path: PathBuf,
    /// Why direct I/O is off, when it was asked for and refused.
    pub note: Option<String>,
}

fn ioctl_arg(fd: &File, req: libc::c_ulong, arg: libc::c_ulong) -> std::io::Result<libc::c_int> {
    // SAFETY: the requests used with this helper (LOOP_CTL_GET_FREE, LOOP_CLR_FD,
    // LOOP_SET_CAPACITY) take an integer argument, not a pointer.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn configure(
    dev: &File,
    backing: &File,
    name: &Path,
    block_size: u32,
    flags: u32,
) -> std::io::Result<()> {
    // SAFETY: LoopConfig is plain data (integers and byte arrays): all-zero is valid.
    let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
    cfg.fd = backing.as_raw_fd() as u32;
    cfg.block_size = block_size;
    cfg.info.lo_flags = flags;
    let bytes = name.as_os_str().as_encoded_bytes();
    // The name is informational (losetup shows it); keep room for the NUL.
    let n = bytes.len().min(LO_NAME_SIZE - 1);
    cfg.info.lo_file_name[..n].copy_from_slice(&bytes[..n]);
    // SAFETY: LOOP_CONFIGURE reads one struct loop_config, which lives across the call.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn status_flags(dev: &File) -> std::io::Result<u32> {
    // SAFETY: LoopInfo64 is plain data: all-zero is valid.
    let mut info: LoopInfo64 = unsafe { std::mem::zeroed() };
    // SAFETY: LOOP_GET_STATUS64 writes one struct loop_info64 into `info`, which lives across
    // the call.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_GET_STATUS64 as _, &mut info) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(info.lo_flags)
    }
}

/// Attaches `backing` (the FUSE file) to a free loop device with direct I/O, or buffered if
/// the kernel refuses direct I/O (then `note` says why).
pub fn attach(backing: &Path, block_size: u32, read_only: bool) -> std::io::Result<LoopDevice> {
    let ctl = File::open(LOOP_CONTROL)?;
    let file = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(backing)?;
    let base = LO_FLAGS_AUTOCLEAR | if read_only { LO_FLAGS_READ_ONLY } else { 0 };
    let mut last = None;
    for _ in 0..ATTACH_TRIES_MAX {
        let n = ioctl_arg(&ctl, LOOP_CTL_GET_FREE, 0)?;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(&path)?;
        let mut note = None;
        let r = match configure(&dev, &file, backing, block_size, base | LO_FLAGS_DIRECT_IO) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                note = Some(format!("direct I/O refused ({e}): buffered"));
                configure(&dev, &file, backing, block_size, base)
            }
            r => r,
        };
        match r {
            Ok(()) => {
                // The kernel may also have fallen back silently: ask it.
                let direct_io = status_flags(&dev)? & LO_FLAGS_DIRECT_IO != 0;
                if !direct_io && note.is_none() {
                    note = Some("direct I/O not taken by the kernel: buffered".into());
                }
                return Ok(LoopDevice {
                    file: dev,
                    path,
                    note,
                });
            }
            // Taken by someone else between GET_FREE and CONFIGURE: ask for another.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::from_raw_os_error(libc::EBUSY)))
}

impl LoopDevice {
    /// Detaches: LOOP_CLR_FD (the kernel defers it while others hold the device open), then
    /// closes our descriptor and waits up to `wait` for the backing file to be let go.
    /// Returns whether it was.
    pub fn detach(self, wait: Duration) -> std::io::Result<bool> {
        match ioctl_arg(&self.file, LOOP_CLR_FD, 0) {
            Ok(_) => {}
            // Already cleared (autoclear raced us).
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {}
            Err(e) => return Err(e),
        }
        let path = self.path.clone();
        drop(self.file);
        Ok(wait_released(&path, wait))
    }
}

/// LOOP_SET_CAPACITY on the loop device at `dev`: it takes its backing file's size again
/// (after the FUSE file's size changed and the kernel has seen it).
pub fn set_capacity(dev: &Path) -> std::io::Result<()> {
    let f = File::open(dev)?;
    ioctl_arg(&f, LOOP_SET_CAPACITY, 0).map(|_| ())
}

/// The sysfs name of a loop device path: "/dev/loop3" -> "loop3".
fn sys_name(dev: &Path) -> Option<String> {
    let n = dev.file_name()?.to_str()?;
    n.strip_prefix("loop")
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .map(|_| n.to_string())
}

/// The backing file of a loop device, or None if it has none (or is not one).
pub fn backing_file(dev: &Path) -> Option<PathBuf> {
    let n = sys_name(dev)?;
    let s = std::fs::read_to_string(format!("/sys/block/{n}/loop/backing_file")).ok()?;
    let s = s.trim_end_matches('\n');
    (!s.is_empty()).then(|| PathBuf::from(s))
}

fn wait_released(dev: &Path, wait: Duration) -> bool {
    let t0 = Instant::now();
    loop {
        if backing_file(dev).is_none() {
            return true;
        }
        if t0.elapsed() >= wait {
            return false;
        }
        std::thread::sleep(RELEASE_POLL);
    }
}

/// Loop devices whose backing file is `file`, from sysfs, at most `LOOPS_SCANNED_MAX`.
pub fn devices_backed_by(file: &Path) -> Vec<PathBuf> {
    /// Loop devices looked at, at most (a host has tens; the bound keeps a scan cheap).
    const LOOPS_SCANNED_MAX: usize = 4096;
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .take(LOOPS_SCANNED_MAX)
        .filter_map(|e| e.file_name().into_string().ok())
        .map(|n| PathBuf::from("/dev").join(n))
        .filter(|p| sys_name(p).is_some() && backing_file(p).as_deref() == Some(file))
        .collect()
}

/// Clean-up after a crash: detaches `dev` if (and only if) its backing file is still `file`,
/// so that a loop device reused by someone else since is never touched. Returns whether it
/// detached one.
pub fn clear_if_backed_by(dev: &Path, file: &Path) -> std::io::Result<bool> {
    if backing_file(dev).as_deref() != Some(file) {
        return Ok(false);
    }
    let f = OpenOptions::new().read(true).open(dev)?;
    match ioctl_arg(&f, LOOP_CLR_FD, 0) {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Ok(false),
        Err(e) => return Err(e),
    }
    drop(f);
    Ok(wait_released(dev, RELEASE_WAIT))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sys_names() {
        for (p, want) in [
            ("/dev/loop0", Some("loop0")),
            ("/dev/loop12", Some("loop12")),
            ("/dev/loop", None),
            ("/dev/loop-control", None),
            ("/dev/sda", None),
            ("/dev/loop1p1", None),
        ] {
            assert_eq!(sys_name(Path::new(p)).as_deref(), want, "{p}");
        }
    }
}
