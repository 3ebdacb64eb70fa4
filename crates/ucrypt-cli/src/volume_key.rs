//! `--volume-key-file`, read by every verb the same way: exactly the key's size, as
//! cryptsetup's `tools_read_vk` reads it. A longer file gives its first bytes (so
//! `/dev/urandom` and `/dev/zero` work, as cryptsetup's own tests use them); a shorter one is
//! an error. The key's size is the header's (LUKS), or `--key-size` / the cipher's default
//! (`format`, plain mode).
//!
//! The file is opened without blocking and each read waits in `poll` for at most what is left
//! of [`VOLUME_KEY_FILE_WAIT`]: a FIFO that nobody writes fails the verb (or the daemon's
//! `resume` request) after that long instead of holding it for ever.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use ucrypt::luks::{Header, VolumeKey};
use ucrypt::{Error, Result, SecretBytes};

/// How long reading a volume key file may wait for its bytes (a FIFO whose writer is late, or
/// absent).
pub const VOLUME_KEY_FILE_WAIT: Duration = Duration::from_secs(10);

/// Largest volume key read, bytes. The longest key a LUKS2 volume ucrypt opens has is 128
/// bytes (an XTS key and an HMAC key); the bound stops a damaged header's key size, or a
/// mistyped `--key-size`, from sizing the allocation.
pub const VOLUME_KEY_BYTES_MAX: usize = 4096;

/// Reads exactly `key_bytes` from the file at `path`.
pub fn read(path: &Path, key_bytes: usize) -> Result<SecretBytes> {
    if key_bytes > VOLUME_KEY_BYTES_MAX {
        return Err(Error::InvalidArgument(format!(
            "a volume key of {key_bytes} bytes is longer than the {VOLUME_KEY_BYTES_MAX} \
             ucrypt reads"
        )));
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(format!("Cannot read volume key file {}", path.display()), e))?;
    let mut key = SecretBytes::zeroed(key_bytes);
    let short = || {
        Error::InvalidArgument(format!(
            "Cannot read {key_bytes} bytes from volume key file {}.",
            path.display()
        ))
    };
    let deadline = Instant::now() + VOLUME_KEY_FILE_WAIT;
    let mut got = 0;
    while got < key_bytes {
        let left = deadline.saturating_duration_since(Instant::now());
        if !readable(&f, left).map_err(|e| Error::io(format!("polling {}", path.display()), e))? {
            return Err(Error::InvalidArgument(format!(
                "Cannot read {key_bytes} bytes from volume key file {}: nothing came within \
                 {} s.",
                path.display(),
                VOLUME_KEY_FILE_WAIT.as_secs()
            )));
        }
        match (&f).read(&mut key.as_mut()[got..]) {
            Ok(0) => return Err(short()),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => {
                return Err(Error::io(
                    format!("Cannot read volume key file {}", path.display()),
                    e,
                ))
            }
        }
    }
    Ok(key)
}

/// Whether `f` has something to read (data, or its end) within `wait`.
fn readable(f: &File, wait: Duration) -> std::io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: f.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // Rounded up, so that a last fraction of a millisecond still waits.
    let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    loop {
        // SAFETY: poll reads and writes one pollfd, which lives across the call; `f` keeps
        // the descriptor open.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        match r {
            0 => return Ok(false),
            r if r > 0 => return Ok(true),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// The size of the volume key to read for `hdr`: the header's, else `key_bits` (as
/// cryptsetup's `--key-size` for a header without keyslots).
pub fn key_bytes_for(hdr: &Header, key_bits: Option<u32>) -> Result<usize> {
    if let Some(n) = hdr.volume_key_bytes() {
        return Ok(n);
    }
    match key_bits {
        Some(b) if b % 8 == 0 && b > 0 => Ok(b as usize / 8),
        Some(b) => Err(Error::InvalidArgument(format!(
            "key size {b} bits is not a positive multiple of 8"
        ))),
        None => Err(Error::InvalidArgument(
            "Cannot determine volume key size for LUKS without keyslots, please use \
             --key-size option."
                .into(),
        )),
    }
}

/// A key from a volume key file rejected by the header's digest, in cryptsetup's words
/// ("Volume key does not match the volume.", a wrong key's exit code) rather than as a wrong
/// passphrase; every other error as it is.
pub fn mismatch(e: Error) -> Error {
    match e {
        Error::WrongPassphrase => Error::VolumeKeyMismatch,
        e => e,
    }
}

/// Reads the key for `hdr` from `path` and checks it against the header's digest.
pub fn read_verified(hdr: &Header, path: &Path, key_bits: Option<u32>) -> Result<VolumeKey> {
    let key = read(path, key_bytes_for(hdr, key_bits)?)?;
    hdr.verify_key(key).map_err(mismatch)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("ucrypt-vk-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn exactly_the_key_size_is_read() {
        let d = temp("sizes");
        let f = d.join("k");
        std::fs::write(&f, (0u8..100).collect::<Vec<_>>()).unwrap();
        assert_eq!(
            read(&f, 64).unwrap().as_ref(),
            &(0u8..64).collect::<Vec<_>>()[..]
        );
        assert_eq!(read(&f, 100).unwrap().len(), 100);
        let e = read(&f, 101).unwrap_err().to_string();
        assert!(
            e.contains("Cannot read 101 bytes from volume key file"),
            "{e}"
        );
        assert_eq!(
            read(Path::new("/dev/zero"), 64).unwrap().as_ref(),
            &[0u8; 64]
        );
        assert_eq!(read(Path::new("/dev/urandom"), 32).unwrap().len(), 32);
        assert!(read(&f, VOLUME_KEY_BYTES_MAX + 1).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
