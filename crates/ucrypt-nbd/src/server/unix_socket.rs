//! A unix socket at a path the user named (`--nbd unix:PATH`, `--metrics unix:PATH`,
//! `--control PATH`): the one rule every ucrypt listener follows, so that binding never costs
//! anyone a file or a live server.
//!
//! - Nothing at PATH: bind there.
//! - A socket at PATH: connect first. Refused (nobody listens: a server that died) means
//!   stale, and it is replaced; an answer, or any other outcome (a full backlog, no
//!   permission), means it is someone's, and the bind is refused.
//! - Anything else at PATH (a file, a directory, a symlink): refused, untouched.
//!
//! The socket is made mode 0600 from its first instant, and removed when the
//! [`BoundSocket`] is dropped, provided PATH still names the socket bound (not one another
//! process put there since).

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The path of a socket this process bound; removes it on drop while it is still that socket.
#[derive(Debug)]
pub struct BoundSocket {
    path: PathBuf,
    dev: u64,
    ino: u64,
    /// Removed on drop: false once another process serves the socket ([`BoundSocket::keep`]).
    remove: std::sync::atomic::AtomicBool,
}

impl BoundSocket {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The socket at `path` that this process did not bind but serves from now on (a shared
    /// listener taken over), known by its file's device and inode.
    pub(crate) fn adopt(path: PathBuf, dev: u64, ino: u64) -> BoundSocket {
        BoundSocket {
            path,
            dev,
            ino,
            remove: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// The socket file's device and inode.
    pub(crate) fn file_id(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    /// Leaves the path in place when dropped: other processes still listen on the socket.
    pub(crate) fn keep(&self) {
        self.remove
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        if !*self.remove.get_mut() {
            return;
        }
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.dev() == self.dev && m.ino() == self.ino);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// What is at a socket path before a bind, and so what the bind may do. Pure: the caller
/// looks (`lstat`, `connect`) and this decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Nothing,
    /// Not a socket: a file, a directory, a symlink, a device.
    NotSocket,
    /// A socket, and how a connect to it went: `Ok` answered, else the error's errno.
    Socket(std::result::Result<(), Option<i32>>),
}

/// What a bind does about what is at the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Bind,
    ReplaceStale,
    RefuseNotSocket,
    RefuseLive,
}

/// The rule of this module's doc.
pub fn decide(found: Found) -> Decision {
    match found {
        Found::Nothing => Decision::Bind,
        Found::NotSocket => Decision::RefuseNotSocket,
        Found::Socket(Err(Some(libc::ECONNREFUSED))) => Decision::ReplaceStale,
        // Gone between the look and the connect: nothing to replace.
        Found::Socket(Err(Some(libc::ENOENT))) => Decision::Bind,
        Found::Socket(_) => Decision::RefuseLive,
    }
}

fn look(path: &Path) -> Found {
    match std::fs::symlink_metadata(path) {
        Err(_) => Found::Nothing,
        Ok(m) if !m.file_type().is_socket() => Found::NotSocket,
        Ok(_) => Found::Socket(
            UnixStream::connect(path)
                .map(|_| ())
                .map_err(|e| e.raw_os_error()),
        ),
    }
}

/// Binds a listening unix socket at `path` by the rule of this module's doc.
pub fn bind_unix(path: &Path) -> Result<(UnixListener, BoundSocket)> {
    match decide(look(path)) {
        Decision::Bind => {}
        Decision::ReplaceStale => std::fs::remove_file(path)
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(e),
            })
            .map_err(|e| Error::io(format!("removing the stale socket {}", path.display()), e))?,
        Decision::RefuseNotSocket => {
            return Err(Error::Config(format!(
                "{} exists and is not a socket: ucrypt does not replace it; name another path",
                path.display()
            )))
        }
        Decision::RefuseLive => {
            return Err(Error::io(
                format!(
                    "{} is the socket of a live server (it answers): stop it, or name another \
                     path",
                    path.display()
                ),
                std::io::Error::from_raw_os_error(libc::EBUSY),
            ))
        }
    }
    // Bind with a umask that leaves the socket 0600 from its first instant: a chmod after bind
    // would leave a window in which anyone could connect.
    // SAFETY: umask only swaps the process file mode mask; it cannot fail or touch memory.
    let old = unsafe { libc::umask(0o177) };
    let r = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let l = r.map_err(|e| Error::io(format!("binding {}", path.display()), e))?;
    let meta = std::fs::symlink_metadata(path)
        .map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
    let bound = BoundSocket::adopt(path.to_path_buf(), meta.dev(), meta.ino());
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io(format!("chmod {}", path.display()), e))?;
    Ok((l, bound))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_table() {
        use Decision::*;
        for (found, want) in [
            (Found::Nothing, Bind),
            (Found::NotSocket, RefuseNotSocket),
            (Found::Socket(Ok(())), RefuseLive),
            (Found::Socket(Err(Some(libc::ECONNREFUSED))), ReplaceStale),
            (Found::Socket(Err(Some(libc::ENOENT))), Bind),
            (Found::Socket(Err(Some(libc::EAGAIN))), RefuseLive),
            (Found::Socket(Err(Some(libc::EACCES))), RefuseLive),
            (Found::Socket(Err(None)), RefuseLive),
        ] {
            assert_eq!(decide(found), want, "{found:?}");
        }
    }

    #[test]
    fn files_and_live_sockets_are_kept_stale_ones_replaced_ours_removed() {
        let dir = std::env::temp_dir().join(format!("ucrypt-sock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file");
        std::fs::write(&file, b"precious").unwrap();
        assert!(matches!(bind_unix(&file), Err(Error::Config(_))));
        assert_eq!(std::fs::read(&file).unwrap(), b"precious");

        let sock = dir.join("sock");
        let (live, bound) = bind_unix(&sock).unwrap();
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(matches!(bind_unix(&sock), Err(Error::Io { .. })));
        // Dead: the listener closed, the path left (as after a crash).
        drop(live);
        std::mem::forget(bound);
        let (_l, bound) = bind_unix(&sock).unwrap();
        drop(bound);
        assert!(
            std::fs::symlink_metadata(&sock).is_err(),
            "ours not removed"
        );

        // Replaced by someone else since: not ours to remove.
        let (_l, bound) = bind_unix(&sock).unwrap();
        std::fs::remove_file(&sock).unwrap();
        std::fs::write(&sock, b"theirs").unwrap();
        drop(bound);
        assert_eq!(std::fs::read(&sock).unwrap(), b"theirs");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
