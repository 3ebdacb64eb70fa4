//! Which local volumes a ucrypt process is serving, so that two processes never write one
//! ciphertext, and a verb that would rewrite a served volume (an offline `reencrypt`,
//! `format`, `import`) refuses, as cryptsetup refuses an active device.
//!
//! A serving process (the `open` daemon, `serve`, `mount`, `ublk`) holds, for as long as it
//! serves (after a `close --deferred` too, until its last user goes), an open file
//! description lock (`F_OFD_SETLK`) on one byte of the volume file and of its detached header,
//! far past any data: [`IN_USE_BYTE`]. Serving read-write it takes a write lock, read-only a
//! read lock, so that a second serving process of the same file is refused (exit 5) unless
//! both serve it read-only: cryptsetup refuses a second read-write activation of a device, and
//! two read-only views of one ciphertext cannot corrupt it. (`open` keeps cryptsetup's one
//! activation per device on top of this: its claim refuses a volume another NAME serves.)
//! `serve --unencrypted`, which writes no ciphertext, takes a read lock whatever it does.
//! A verb asks whether its lock would conflict (`F_OFD_GETLK`): a write probe meets every
//! server, a read probe (a read-only `export`) only one that writes.
//!
//! A plain `open --shared` (cryptsetup's: several mappings of one device, each its own
//! `--offset`/`--size`) takes a read lock on the byte before, [`SHARED_BYTE`], and none on
//! [`IN_USE_BYTE`]: as cryptsetup's `--shared` skips its exclusive-open check, it maps beside
//! every other server, shared or not; a server that is not shared then meets it (its mark
//! looks for a lock on [`SHARED_BYTE`] once it holds its own), as cryptsetup's exclusive open
//! meets a device a shared mapping holds; and every probe counts it as a writer. The marker is not
//! cryptsetup's header lock (`flock`, taken around each header access): on Linux the two kinds
//! of lock do not interact, so keyslot verbs of either tool work on a volume being served, as
//! on an active dm-crypt device; nor does it meet qemu's image locks (bytes 100 to 299).
//!
//! A block device is marked through the node named (another node of the same device is not
//! seen); a remote volume (`rbd:`, `nbd:`) is not marked. A block device served read-write is
//! also claimed from the kernel, as cryptsetup claims a device it maps without `--shared`
//! (`claim_from_kernel`): that refuses a device that is mounted or held by a dm-crypt mapping,
//! and the kernel refuses those to others while ucrypt serves it. `--shared` claims nothing,
//! so it maps beside dm-crypt mappings of the same device as cryptsetup's does.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::error::{CliError, CliResult};

/// The byte the marker locks: the last one an `off_t` can name but one, so that no volume's
/// data or header ever reaches it and the range `[IN_USE_BYTE, IN_USE_BYTE + 1)` stays
/// representable.
pub const IN_USE_BYTE: i64 = i64::MAX - 1;

/// The byte a shared plain mapping (`open --shared`) locks instead (see the module's doc).
pub const SHARED_BYTE: i64 = IN_USE_BYTE - 1;

/// A volume marked as served, for as long as this lives.
#[derive(Debug)]
pub struct InUse {
    _files: Vec<File>,
}

fn lock_request(kind: libc::c_short, byte: i64) -> libc::flock {
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value of it.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    fl
}

fn os_err(what: String, e: std::io::Error) -> CliError {
    CliError::Core(ucrypt::Error::io(what, e))
}

/// How a process means to use a volume: what its lock is, and which others it meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads only: shares the volume with other readers, meets a writer.
    Read,
    /// Writes (or rewrites the header): meets every other server.
    Write,
    /// A shared plain mapping (`open --shared`): writes, beside every other server, and is met
    /// by each later one that is not shared.
    Shared,
}

impl Access {
    pub fn of(read_only: bool) -> Access {
        if read_only {
            Access::Read
        } else {
            Access::Write
        }
    }

    /// The lock this access takes, and on which byte.
    fn lock(self) -> (libc::c_short, i64) {
        match self {
            Access::Read => (libc::F_RDLCK as libc::c_short, IN_USE_BYTE),
            Access::Write => (libc::F_WRLCK as libc::c_short, IN_USE_BYTE),
            Access::Shared => (libc::F_RDLCK as libc::c_short, SHARED_BYTE),
        }
    }
}

/// Why `path` cannot be served with `access`: cryptsetup's words for a device in use.
fn busy(path: &Path, access: Access) -> CliError {
    CliError::Busy(format!(
        "Cannot use device {} which is in use (a ucrypt process serves it{}: open, serve, mount \
         or ublk).",
        path.display(),
        match access {
            Access::Read => " read-write",
            Access::Write | Access::Shared => "",
        }
    ))
}

/// A block device written by one server is claimed from the kernel as cryptsetup claims it
/// for a mapping that is not `--shared`: an `O_EXCL` open, which fails (EBUSY) while the
/// device is mounted or held by device-mapper (a dm-crypt mapping) or another block device,
/// and makes a later exclusive opener (`mount`, `cryptsetup open` without `--shared`) fail
/// while it is held. `None` for anything but a block device written exclusively.
fn claim_from_kernel(path: &Path, access: Access) -> CliResult<Option<File>> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let is_block = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
    if access != Access::Write || !is_block {
        return Ok(None);
    }
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(path)
    {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Err(CliError::Busy(format!(
            "Cannot use device {} which is in use (mounted, or held by a device-mapper \
             mapping or another block device; a dm-crypt mapping beside it needs --shared \
             on both sides, as with cryptsetup).",
            path.display()
        ))),
        Err(e) => Err(os_err(
            format!("claiming {} (open with O_EXCL)", path.display()),
            e,
        )),
    }
}

/// Marks the local files among `paths` as served by this process with `access` until the
/// returned guard is dropped; refuses (exit 5) a file another process serves in a way that
/// conflicts (see the module's doc). Paths that are not local files or block devices are
/// skipped.
pub fn mark(paths: &[&Path], access: Access) -> CliResult<InUse> {
    let mut files = Vec::with_capacity(paths.len());
    for p in paths {
        // A write lock needs a descriptor open for writing.
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .write(access == Access::Write)
            .open(p);
        let Ok(f) = opened else {
            // A remote name, or a path the open itself will report on.
            continue;
        };
        let (kind, byte) = access.lock();
        let mut fl = lock_request(kind, byte);
        // SAFETY: F_OFD_SETLK on a descriptor `f` owns, with a pointer to a live, initialised
        // `flock`; the kernel only reads it.
        let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &mut fl) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
                return Err(busy(p, access));
            }
            return Err(os_err(
                format!("marking {} as in use (F_OFD_SETLK)", p.display()),
                e,
            ));
        }
        // Held now: a shared mapping that comes later sees nothing to meet, so one already
        // there is this server's to meet.
        if access != Access::Shared && shared_mapping_on(&f, p)? {
            return Err(busy(p, access));
        }
        files.push(f);
        files.extend(claim_from_kernel(p, access)?);
    }
    Ok(InUse { _files: files })
}

/// Whether a ucrypt process serves the file at `path` in a way that conflicts with `access`
/// ([`mark`]). `false` for a path that cannot be opened (the verb reports that itself).
pub fn is_served(path: &Path, access: Access) -> CliResult<bool> {
    if access == Access::Shared {
        // cryptsetup's --shared skips the in-use check: nothing conflicts with it.
        return Ok(false);
    }
    let Ok(f) = File::open(path) else {
        return Ok(false);
    };
    let (kind, byte) = access.lock();
    Ok(locked_against(&f, path, kind, byte)? || shared_mapping_on(&f, path)?)
}

/// Whether another open file description holds a lock on `byte` of `f` that conflicts with a
/// lock of `kind` there.
fn locked_against(f: &File, path: &Path, kind: libc::c_short, byte: i64) -> CliResult<bool> {
    let mut fl = lock_request(kind, byte);
    // SAFETY: F_OFD_GETLK on a descriptor `f` owns, with a pointer to a live, initialised
    // `flock` the kernel writes the conflicting lock (or F_UNLCK) into.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(os_err(
            format!("asking whether {} is in use (F_OFD_GETLK)", path.display()),
            e,
        ));
    }
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// Whether a shared plain mapping (`open --shared`) of the file `f` is served.
fn shared_mapping_on(f: &File, path: &Path) -> CliResult<bool> {
    locked_against(f, path, libc::F_WRLCK as libc::c_short, SHARED_BYTE)
}

/// Refuses (exit 5) to serve `paths` with `access` when another process serves one of them
/// in a way that conflicts: the check a serving verb makes before it asks for a passphrase
/// ([`mark`] decides, race-free, after).
pub fn check_servable(paths: &[&Path], access: Access) -> CliResult<()> {
    for p in paths {
        if is_served(p, access)? {
            return Err(busy(p, access));
        }
        // Claimed and let go at once: the server claims it again when it marks the volume.
        drop(claim_from_kernel(p, access)?);
    }
    Ok(())
}

/// Refuses (cryptsetup's exit code 5, device busy) when a ucrypt process serves one of
/// `paths` in a way that conflicts with `access`; `what` says what was refused and how to go
/// on. Nothing is written either way.
pub fn refuse_if_served_for(paths: &[&Path], access: Access, what: &str) -> ucrypt::Result<()> {
    for p in paths {
        let served = is_served(p, access).map_err(|e| match e {
            CliError::Core(c) => c,
            other => ucrypt::Error::InvalidArgument(other.to_string()),
        })?;
        if served {
            return Err(ucrypt::Error::io(
                format!(
                    "Device {} is in use by a ucrypt process serving it{} (open, serve, mount \
                     or ublk): {what}",
                    p.display(),
                    match access {
                        Access::Read => " read-write",
                        Access::Write | Access::Shared => "",
                    }
                ),
                std::io::Error::from_raw_os_error(libc::EBUSY),
            ));
        }
    }
    Ok(())
}

/// [`refuse_if_served_for`] a verb that writes: any serving process refuses it.
pub fn refuse_if_served(paths: &[&Path], what: &str) -> ucrypt::Result<()> {
    refuse_if_served_for(paths, Access::Write, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_is_seen_through_another_descriptor_and_goes_with_its_guard() {
        let dir = std::env::temp_dir().join(format!("ucrypt-in-use-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("vol.img");
        std::fs::write(&f, [0u8; 4096]).unwrap();
        assert!(!is_served(&f, Access::Write).unwrap());
        let guard = mark(&[&f, Path::new("rbd:pool/not-a-file")], Access::Write).unwrap();
        // OFD locks conflict between open file descriptions, also of one process.
        assert!(is_served(&f, Access::Write).unwrap());
        assert!(is_served(&f, Access::Read).unwrap());
        let e = CliError::from(refuse_if_served(&[&f], "stop it first").unwrap_err());
        assert_eq!(e.exit_code(), 5);
        assert!(e.to_string().contains("stop it first"), "{e}");
        // A second server, reading or writing, is refused.
        for access in [Access::Read, Access::Write] {
            let e = mark(&[&f], access).unwrap_err();
            assert_eq!(e.exit_code(), 5, "{e}");
            assert_eq!(check_servable(&[&f], access).unwrap_err().exit_code(), 5);
        }
        // cryptsetup's header lock (flock) is not taken by the marker.
        let h = File::open(&f).unwrap();
        // SAFETY: flock on a descriptor `h` owns; no memory is passed.
        let r = unsafe { libc::flock(h.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(r, 0, "the marker blocked cryptsetup's header lock");
        drop(h);
        // The file's contents are untouched: the byte is far past them.
        assert_eq!(std::fs::read(&f).unwrap(), vec![0u8; 4096]);
        drop(guard);
        assert!(!is_served(&f, Access::Write).unwrap());
        // Readers share; a writer meets them, and a verb that writes sees them.
        let r1 = mark(&[&f], Access::Read).unwrap();
        let r2 = mark(&[&f], Access::Read).unwrap();
        assert!(!is_served(&f, Access::Read).unwrap());
        assert!(is_served(&f, Access::Write).unwrap());
        assert_eq!(mark(&[&f], Access::Write).unwrap_err().exit_code(), 5);
        drop((r1, r2));
        assert!(!is_served(&f, Access::Write).unwrap());
        // Shared mappings: beside each other and beside a server there before; a later one
        // that is not shared meets them, and every probe sees a writer.
        let w = mark(&[&f], Access::Write).unwrap();
        let s1 = mark(&[&f], Access::Shared).unwrap();
        let s2 = mark(&[&f], Access::Shared).unwrap();
        assert!(!is_served(&f, Access::Shared).unwrap());
        drop(w);
        for access in [Access::Read, Access::Write] {
            assert!(is_served(&f, access).unwrap());
            assert_eq!(mark(&[&f], access).unwrap_err().exit_code(), 5);
        }
        drop(s1);
        assert!(is_served(&f, Access::Read).unwrap());
        drop(s2);
        assert!(!is_served(&f, Access::Write).unwrap());
        let w = mark(&[&f], Access::Write).unwrap();
        drop(w);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
