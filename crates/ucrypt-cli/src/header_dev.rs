//! Where LUKS verbs get their devices: the header device as a backend, locked as cryptsetup
//! locks it, and new files (backups, dumped keys). Reading and writing the header itself is
//! the library's driver (`ucrypt::luks::{read_header, apply, unlock_key, read_area}`).

use std::fs::OpenOptions;
use std::path::Path;
use std::sync::Arc;

use ucrypt::backend::{Backend, DirectMode, FileBackend, FileLock};
use ucrypt::{Error, Result};

/// A header device as the verbs hold it.
pub type HeaderDev = Arc<dyn Backend>;

/// cryptsetup's words for a device that cannot be opened; keeps the OS error (and so the exit
/// code: 4 for a missing device, 2 for no permission).
fn open_err(path: &Path, e: Error) -> Error {
    match e {
        Error::Io { source, .. } if source.raw_os_error() == Some(libc::EPERM) => Error::io(
            format!(
                "Cannot open device {} for writing (immutable or append-only file?)",
                path.display()
            ),
            source,
        ),
        // The backend's own words: not a file or block device.
        e @ Error::Io { .. } if is_enodev(&e) => e,
        Error::Io { source, .. } => Error::io(
            format!("Device {} does not exist or access denied", path.display()),
            source,
        ),
        other => other,
    }
}

fn is_enodev(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENODEV))
}

/// Opens the header device (the volume, or its `--header`) buffered and takes cryptsetup's
/// lock: shared to read, exclusive to update.
pub fn open_header(path: &Path, update: bool) -> Result<HeaderDev> {
    Ok(open_header_file(path, update)?)
}

/// [`open_header`], as the file backend itself (to release the lock and take it again).
pub fn open_header_file(path: &Path, update: bool) -> Result<Arc<FileBackend>> {
    let dev = FileBackend::open(path, update, DirectMode::Never).map_err(|e| open_err(path, e))?;
    dev.lock(if update {
        FileLock::Exclusive
    } else {
        FileLock::Shared
    })?;
    Ok(Arc::new(dev))
}

/// Opens a header device for `format`, creating a detached header file that does not exist
/// yet and growing one shorter than `metadata_bytes` to that size (never shrinking), so that
/// the whole metadata area can be written; cryptsetup's detached headers have that size too.
pub fn create_header(path: &Path, metadata_bytes: u64) -> Result<HeaderDev> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| open_err(path, Error::io("", e)))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
    if meta.is_file() && meta.len() < metadata_bytes {
        file.set_len(metadata_bytes)
            .map_err(|e| Error::io(format!("growing {}", path.display()), e))?;
    }
    drop(file);
    open_header(path, true)
}

/// Size in bytes of the device at `path` (a regular file or block device).
pub fn size_of(path: &Path) -> Result<u64> {
    let dev = FileBackend::open(path, false, DirectMode::Never).map_err(|e| open_err(path, e))?;
    Ok(dev.size())
}

/// Creates a new file (never overwrites, like cryptsetup) readable only by the owner.
pub fn write_new_file(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                Error::InvalidArgument(format!("Requested file {} already exists.", path.display()))
            } else {
                Error::io(format!("Cannot create file {}", path.display()), e)
            }
        })?;
    f.write_all(data)
        .and_then(|_| f.sync_all())
        .map_err(|e| Error::io(format!("Cannot write file {}", path.display()), e))
}
