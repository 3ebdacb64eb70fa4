//! `resize` as every control socket answers it (the `ucrypt open` daemon's and the `--control`
//! socket of `serve`, `mount`, `ublk` and `vhost`): the volume takes its new size, then the
//! front end that serves it is told, each in the one way it has.

use std::path::Path;

use ucrypt_fuse::SizeNotifier;

use super::loopdev;
use super::proto::Response;
use crate::error::CliError;
use crate::open::Opened;

/// The front end a resize tells of the new size.
pub enum Notice<'a> {
    /// The FUSE file (none while it is not mounted yet: the mount takes the volume's size),
    /// and the loop device over it, if any.
    Fuse {
        file: Option<&'a SizeNotifier>,
        loop_device: Option<&'a Path>,
    },
    /// vhost-user: the VMM is sent a config-change notice.
    Vhost(&'a ucrypt_vhost::Handle),
    /// An NBD server alone (`ucrypt serve`): the protocol has no size-change notice.
    Nbd,
    /// ublk: refused, the device's size cannot change.
    Ublk,
}

/// An NBD server serving the volume, whose clients are not told of a resize.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NbdClients {
    /// None serves it.
    None,
    /// This process's own socket (`serve`, or `open --nbd` owning its socket): each new
    /// connection is told the size at its handshake.
    OwnSocket,
    /// A socket another daemon owns (`open --nbd` as a member of a shared socket): its owner
    /// tells new connections the size this export joined with.
    SharedSocket,
}

impl NbdClients {
    /// What the NBD clients see of a resize: said in the process's log and by the `resize`
    /// verb.
    pub fn note(self) -> Option<&'static str> {
        match self {
            NbdClients::None => None,
            NbdClients::OwnSocket => Some(
                "NBD has no size-change notice: clients connected keep the size they were \
                 told; new connections see the new size",
            ),
            NbdClients::SharedSocket => Some(
                "NBD has no size-change notice: clients connected keep the size they were \
                 told, and new connections through the shared socket's owner see the size \
                 this export joined it with",
            ),
        }
    }
}

/// Why the ublk front end is not resized.
const UBLK_REFUSED: &str = "resize: the ublk front end cannot change its device's size \
                            (libublk has no size update); serve the volume through loop, FUSE \
                            or vhost-user (ucrypt open --front-end loop, fuse or vhost-user; \
                            ucrypt mount; ucrypt vhost)";

/// Resizes `vol` (named `name` in messages, and logged on stderr after `log`) to
/// `size_sectors` 512-byte sectors, or to all of its backing file or device after the data
/// offset, then tells `front`; `nbd`: the NBD server serving the volume beside `front`, if
/// any (`open --nbd`), whose clients are not told. Returns the new size in bytes, or the error
/// to answer. The volume keeps its new size when telling the front end fails.
pub fn resize(
    (name, log): (&str, &str),
    vol: &Opened,
    size_sectors: Option<u64>,
    front: Notice<'_>,
    nbd: NbdClients,
) -> Result<u64, Response> {
    let Some(engine) = vol.engine() else {
        return Err(Response::error(
            1,
            ucrypt::Refusal::ResizeAuthenticated.to_string(),
        ));
    };
    if let Notice::Ublk = front {
        return Err(Response::error(1, UBLK_REFUSED));
    }
    let bytes = match size_sectors.map(|s| s.checked_mul(512)) {
        Some(None) => return Err(Response::error(1, "resize: --size too large")),
        Some(Some(b)) => Some(b),
        None => None,
    };
    let nbd = match front {
        Notice::Nbd => NbdClients::OwnSocket,
        _ => nbd,
    };
    let at = || format!("resize {name}");
    let new = engine
        .resize(bytes)
        .map_err(|e| Response::failed(CliError::from(e).at(at())))?;
    match front {
        Notice::Fuse { file, loop_device } => {
            if let Some(notifier) = file {
                notifier.size_changed().map_err(Response::failed)?;
            }
            if let Some(l) = loop_device {
                loopdev::set_capacity(l).map_err(|e| {
                    Response::failed(CliError::Core(ucrypt::Error::io(
                        format!("LOOP_SET_CAPACITY on {}", l.display()),
                        e,
                    )))
                })?;
            }
        }
        // The config space shows the new capacity from here on; a VMM that negotiated no
        // backend channel is not told (the resize stands).
        Notice::Vhost(handle) => {
            handle
                .size_changed()
                .map_err(|e| Response::failed(CliError::from(e).at(at())))?;
        }
        Notice::Nbd | Notice::Ublk => {}
    }
    eprintln!("{log}: resized to {} sectors", new / 512);
    if let Some(note) = nbd.note() {
        eprintln!("{log}: {note}");
    }
    Ok(new)
}
