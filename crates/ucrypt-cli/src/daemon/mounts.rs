//! Is a device in use? Mounted (from /proc/self/mountinfo), held by another block device
//! (sysfs holders, e.g. dm or md), attached to a loop device (a FUSE file), or open in a
//! process (its descriptors in /proc) — the reasons `close` refuses without `--force`, as
//! dm refuses to remove a device whose open count is not zero. Also the lazy unmount of a
//! FUSE file after a crash.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Largest mountinfo read, bytes: thousands of mounts; beyond it the check sees only the
/// first ones (a container host with more mounts than that is not this tool's target).
const MOUNTINFO_BYTES_MAX: u64 = 16 << 20;

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = (oct[0] - b'0') as u32 * 64
                    + (oct[1] - b'0') as u32 * 8
                    + (oct[2] - b'0') as u32;
                if let Ok(byte) = u8::try_from(v) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount points in `mountinfo` whose device is `dev` (major, minor) or whose source is
/// `source`. Pure: the text is passed in.
pub fn mount_points(mountinfo: &str, dev: Option<(u32, u32)>, source: Option<&str>) -> Vec<String> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        // id parent major:minor root mount-point options [optional...] - fstype source super
        let fields: Vec<&str> = line.split(' ').collect();
        if fields.len() < 5 {
            continue;
        }
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        let by_dev = dev.is_some_and(|(ma, mi)| fields[2] == format!("{ma}:{mi}"));
        let by_source =
            source.is_some_and(|s| fields.get(sep + 2).map(|f| unescape(f)).as_deref() == Some(s));
        if by_dev || by_source {
            out.push(unescape(fields[4]));
        }
    }
    out
}

fn mountinfo() -> String {
    use std::io::Read;
    let mut s = String::new();
    if let Ok(f) = std::fs::File::open("/proc/self/mountinfo") {
        let _ = f.take(MOUNTINFO_BYTES_MAX).read_to_string(&mut s);
    }
    s
}

/// major:minor of a block device node.
fn block_dev_numbers(dev: &Path) -> Option<(u32, u32)> {
    let m = std::fs::metadata(dev).ok()?;
    if !m.file_type().is_block_device() {
        return None;
    }
    let rdev = m.rdev();
    Some((libc::major(rdev), libc::minor(rdev)))
}

/// Why `device` (a block device, or the FUSE file) cannot be closed without --force, if it
/// cannot: mounted, held by another device, or attached to a loop device other than
/// `own_loop`.
pub fn in_use(device: &Path, own_loop: Option<&Path>) -> Option<String> {
    let numbers = block_dev_numbers(device);
    let source = device.to_str();
    let points = mount_points(
        &mountinfo(),
        numbers,
        if numbers.is_none() { source } else { None },
    );
    if let Some(p) = points.first() {
        return Some(format!("{} is mounted on {p}", device.display()));
    }
    if let Some((ma, mi)) = numbers {
        let holders: Vec<String> = std::fs::read_dir(format!("/sys/dev/block/{ma}:{mi}/holders"))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        if let Some(h) = holders.first() {
            return Some(format!("{} is held by {h}", device.display()));
        }
    } else {
        let loops: Vec<PathBuf> = super::loopdev::devices_backed_by(device)
            .into_iter()
            .filter(|l| Some(l.as_path()) != own_loop)
            .collect();
        if let Some(l) = loops.first() {
            return Some(format!(
                "{} is attached to {}",
                device.display(),
                l.display()
            ));
        }
    }
    None
}

/// Processes looked at, at most, by [`opener`]: more than a host runs. Past the bound a
/// holder can be missed; `close` then detaches the device and the daemon serves it until its
/// last user closes it, holding the volume's in-use lock (`crate::in_use`) all along.
const PROCESSES_SCANNED_MAX: usize = 1 << 20;

/// Descriptors of one process looked at, at most (as [`PROCESSES_SCANNED_MAX`]).
const FDS_SCANNED_MAX: usize = 1 << 20;

/// Whether the descriptor target `link` is `device` or one of its partitions (`/dev/loop0`,
/// `/dev/loop0p1`). Pure: for tests.
fn names_device(link: &Path, device: &Path) -> bool {
    let (Some(l), Some(d)) = (link.to_str(), device.to_str()) else {
        return false;
    };
    match l.strip_prefix(d) {
        Some("") => true,
        Some(rest) => rest
            .strip_prefix('p')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())),
        None => false,
    }
}

/// A process other than this one with one of `devices` (or a partition of one) open, said
/// as "DEV is open in process PID (COMM)". Looks at what each descriptor names
/// (`readlink`), never at the file itself, so that a hung file system elsewhere cannot hang
/// the scan. Rootless, only the user's own processes can be seen (they are the only ones
/// that can open the FUSE file).
pub fn opener(devices: &[&Path]) -> Option<String> {
    let me = std::process::id();
    let procs = std::fs::read_dir("/proc").ok()?;
    for p in procs.filter_map(|e| e.ok()).take(PROCESSES_SCANNED_MAX) {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        for fd in fds.filter_map(|e| e.ok()).take(FDS_SCANNED_MAX) {
            let Ok(link) = std::fs::read_link(fd.path()) else {
                continue;
            };
            if let Some(d) = devices.iter().find(|d| names_device(&link, d)) {
                let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
                return Some(format!(
                    "{} is open in process {pid} ({})",
                    d.display(),
                    comm.trim_end()
                ));
            }
        }
    }
    None
}

/// Lazily unmounts a FUSE file: umount2(MNT_DETACH) as root, `fusermount3 -u -z` for the
/// user who mounted it. Not mounted is success.
pub fn lazy_unmount(file: &Path) -> std::io::Result<()> {
    let c = std::ffi::CString::new(file.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `c` is a NUL-terminated path that lives across the call.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOENT) => Ok(()),
        Some(libc::EPERM) => {
            let st = std::process::Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(file)
                .stderr(std::process::Stdio::null())
                .status()?;
            if st.success() {
                return Ok(());
            }
            // fusermount3 also fails on a file that is not mounted: that is success here.
            let still = mountinfo()
                .lines()
                .any(|l| l.split(' ').nth(4).map(unescape).as_deref() == file.to_str());
            if still {
                Err(std::io::Error::other(format!("fusermount3 -u -z: {st}")))
            } else {
                Ok(())
            }
        }
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
22 1 0:21 / /proc rw,nosuid shared:12 - proc proc rw
30 22 7:3 / /mnt/data rw,relatime shared:1 - ext4 /dev/loop3 rw
31 22 7:3 / /mnt/other\\040place rw - ext4 /dev/loop3 rw
40 22 0:55 / /run/ucrypt/x/volume rw,nosuid,nodev - fuse ucrypt:x rw,user_id=0
41 22 7:30 / /srv rw - ext4 /run/ucrypt/y/volume rw
bad line
";

    #[test]
    fn mount_points_table() {
        assert_eq!(
            mount_points(INFO, Some((7, 3)), None),
            vec!["/mnt/data".to_string(), "/mnt/other place".to_string()]
        );
        assert!(mount_points(INFO, Some((7, 30)), Some("/nope")).len() == 1);
        assert!(mount_points(INFO, Some((7, 4)), None).is_empty());
        assert!(mount_points(INFO, Some((17, 3)), None).is_empty());
        assert_eq!(
            mount_points(INFO, None, Some("/run/ucrypt/y/volume")),
            vec!["/srv".to_string()]
        );
        // The FUSE file's own mount is by its mount point, not its source: not "in use".
        assert!(mount_points(INFO, None, Some("/run/ucrypt/x/volume")).is_empty());
    }

    #[test]
    fn names_device_table() {
        for (link, dev, want) in [
            ("/dev/loop0", "/dev/loop0", true),
            ("/dev/loop0p1", "/dev/loop0", true),
            ("/dev/loop0p", "/dev/loop0", false),
            ("/dev/loop01", "/dev/loop0", false),
            ("/dev/loop10", "/dev/loop1", false),
            ("/dev/ublkb3p12", "/dev/ublkb3", true),
            ("/dev/ublkc3", "/dev/ublkb3", false),
            ("/run/ucrypt/x/volume", "/run/ucrypt/x/volume", true),
            (
                "/run/ucrypt/x/volume (deleted)",
                "/run/ucrypt/x/volume",
                false,
            ),
            ("socket:[123]", "/dev/loop0", false),
        ] {
            assert_eq!(
                names_device(Path::new(link), Path::new(dev)),
                want,
                "{link} {dev}"
            );
        }
    }

    #[test]
    fn an_open_descriptor_is_seen_in_another_process_only() {
        let dir = std::env::temp_dir().join(format!("ucrypt-opener-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("dev");
        std::fs::write(&f, b"x").unwrap();
        // Our own descriptors do not count (the daemon holds its loop device).
        let own = std::fs::File::open(&f).unwrap();
        assert_eq!(opener(&[&f]), None);
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdin(std::fs::File::open(&f).unwrap())
            .spawn()
            .unwrap();
        let seen = opener(&[&f]);
        let _ = child.kill();
        let _ = child.wait();
        drop(own);
        let seen = seen.expect("the child's descriptor");
        assert!(
            seen.starts_with(&format!(
                "{} is open in process {}",
                f.display(),
                child.id()
            )),
            "{seen}"
        );
        assert_eq!(opener(&[&f]), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unescape_table() {
        for (i, o) in [
            ("a\\040b", "a b"),
            ("a\\011b\\012", "a\tb\n"),
            ("back\\134slash", "back\\slash"),
            ("no\\escape", "no\\escape"),
            ("end\\04", "end\\04"),
            ("plain", "plain"),
        ] {
            assert_eq!(unescape(i), o, "{i}");
        }
    }
}
