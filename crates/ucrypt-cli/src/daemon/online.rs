//! `ucrypt reencrypt` on a volume a live daemon serves: the verb starts the rotation in the
//! header itself (init), then hands the hotzones to the daemon over its control socket (the
//! passphrase as `resume` sends it) and follows the progress through `status` until the
//! daemon reports the end.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ucrypt::SecretBytes;

use super::proto::{self, Request, ResumeKey};
use super::state::{self, Identity, RunDir};
use super::{expect_status, live_dir};
use crate::error::{CliError, CliResult};

/// How often the verb asks the daemon how far the rotation got.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// A live daemon serving a volume.
pub struct Holder {
    pub name: String,
    dir: PathBuf,
    ident: Option<Identity>,
}

/// The live daemon serving the local volume at `path` (by device and inode, whatever path
/// named it), if any.
pub fn holder_of(path: &Path) -> Option<Holder> {
    let md = std::fs::metadata(path).ok()?;
    let run = RunDir::locate().ok()?;
    run.names().into_iter().find_map(|name| {
        let dir = run.dir(&name);
        let ident = Identity::read(&dir)?;
        let serves = ident.st_ino != 0
            && ident.st_dev == md.dev()
            && ident.st_ino == md.ino()
            && state::is_alive(&dir);
        serves.then_some(Holder {
            name,
            dir,
            ident: Some(ident),
        })
    })
}

/// The live daemon named `name` (cryptsetup's `--active-name`): "not active" (exit 4) if none.
pub fn by_name(name: &str) -> CliResult<Holder> {
    let (_, dir) = live_dir(name)?;
    let ident = Identity::read(&dir);
    Ok(Holder {
        name: name.to_string(),
        dir,
        ident,
    })
}

impl Holder {
    /// True if this daemon serves the local volume at `path`.
    pub fn serves(&self, path: &Path) -> bool {
        let Ok(md) = std::fs::metadata(path) else {
            return false;
        };
        self.ident
            .as_ref()
            .is_some_and(|i| i.st_ino != 0 && i.st_dev == md.dev() && i.st_ino == md.ino())
    }

    /// The volume the daemon serves, as it named it.
    pub fn volume(&self) -> Option<PathBuf> {
        self.ident.as_ref().map(|i| i.volume.clone())
    }

    /// Has the daemon rotate the key (the header already in reencryption) and waits for the
    /// end; `progress` gets (bytes done, bytes in all) as the daemon reports them.
    pub fn rotate(
        &self,
        passphrase: SecretBytes,
        hotzone_bytes: Option<u64>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> CliResult<i32> {
        if passphrase.len() > proto::RESUME_KEY_BYTES_MAX {
            return Err(CliError::Usage(format!(
                "online reencryption takes a passphrase or key file of at most {} bytes",
                proto::RESUME_KEY_BYTES_MAX
            )));
        }
        let req = Request::Reencrypt {
            key: ResumeKey::Passphrase(passphrase),
            hotzone_bytes,
        };
        expect_status(&self.name, &self.dir, &req)?;
        loop {
            let s = expect_status(&self.name, &self.dir, &Request::Status)?;
            let Some(r) = s.reencryption else {
                return Err(CliError::Usage(format!(
                    "the daemon of {} lost track of the reencryption",
                    self.name
                )));
            };
            progress(r.done_bytes, r.total_bytes);
            match r.finished {
                Some(true) => return Ok(0),
                Some(false) => {
                    return Err(CliError::Remote {
                        code: r.code.unwrap_or(1),
                        message: r.error.unwrap_or_else(|| "reencryption failed".into()),
                    })
                }
                None => std::thread::sleep(POLL_INTERVAL),
            }
        }
    }
}
