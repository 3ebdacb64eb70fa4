//! The life cycle of an authenticated volume: an [`IntegrityVolume`] wrapped so that it can be
//! suspended and resumed like an engine volume, counts its requests, bytes and errors, and
//! tells the caller's hook about each block that fails authentication.
//!
//! Suspending drops the whole `IntegrityVolume` (its key, its keyed tag ciphers, its workers)
//! and resuming builds it again from the volume key, while requests wait: the integrity layer
//! has no gate of its own, and rebuilding it is what leaves no copy of the key behind.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::{OnIntegrityError, OpCounts, Stats};
use crate::backend::Backend;
use crate::engine::Policies;
use crate::integrity::{self, superblock::flags as sb_flags, IntegrityVolume, WriteMode};
use crate::luks::{self, Header, OpenOptions, Unlock, VolumeKey};
use crate::sync::lock;
use crate::{BlockDev, Error, ErrorKind, Result};

/// How often `suspend` looks whether the requests inside are done.
const SUSPEND_POLL: Duration = Duration::from_millis(1);

/// What [`open`] needs besides the header and the key.
pub(super) struct How {
    pub name: String,
    /// `None`: as the header's flags say.
    pub write_mode: Option<WriteMode>,
    pub on_integrity_error: Option<OnIntegrityError>,
}

/// Opens the authenticated segment of a LUKS2 volume (see [`check_superblock_flags`] for the
/// superblocks refused), in dm-integrity's direct mode when asked (or when the header's
/// persistent `no-journal` flag says so), else through its journal; a journal left with
/// committed entries is replayed first (docs/integrity.md).
pub(super) fn open(
    data: Arc<dyn Backend>,
    hdr: &Header,
    unlock: Unlock,
    opts: &OpenOptions,
    how: How,
) -> Result<Authenticated> {
    let hdr_dev: &dyn Backend = match &opts.header {
        Some(h) => h.as_ref(),
        None => data.as_ref(),
    };
    hdr.check_requirements()?;
    let (_, vk) = luks::unlock_key(hdr_dev, hdr, unlock, opts.key_slot)?;
    let write_mode = how
        .write_mode
        .unwrap_or_else(|| integrity::luks2_write_mode(hdr));
    let vol = integrity::open_luks2_mode(data.clone(), hdr, &vk, opts.read_only, write_mode)?;
    drop(vk);
    vol.set_policy(opts.policy);
    check_superblock_flags(&vol)?;
    Ok(Authenticated::new(how, data, vol, write_mode))
}

/// Requests and bytes of one direction, counted as they are served.
#[derive(Default)]
struct OpCounters {
    requests: AtomicU64,
    bytes: AtomicU64,
    /// Failed requests by [`ErrorKind`] (indexed as `ErrorKind::ALL`).
    errors: [AtomicU64; ErrorKind::ALL.len()],
}

impl OpCounters {
    fn count<T>(&self, bytes: u64, r: &Result<T>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        match r {
            Ok(_) => {
                self.bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            Err(e) => {
                self.errors[e.kind() as usize].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn snapshot(&self) -> OpCounts {
        OpCounts {
            requests: self.requests.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: std::array::from_fn(|i| self.errors[i].load(Ordering::Relaxed)),
        }
    }
}

/// An [`IntegrityVolume`] with a life cycle: a block that fails authentication is reported to
/// the hook (the request fails with the error's errno, EILSEQ); requests, bytes and errors are
/// counted; and it can be suspended: the whole `IntegrityVolume` is dropped and built again
/// from the volume key on resume, while requests wait.
pub(crate) struct Authenticated {
    name: String,
    /// The dm-integrity device (the LUKS2 data device), kept to rebuild the volume on resume.
    data: Arc<dyn Backend>,
    read_only: bool,
    /// Journal or direct, as opened; kept for resume.
    write_mode: WriteMode,
    /// The dispatch policies (docs/integrity.md, "Dispatch"): set at open and at run time,
    /// given to the volume built again on resume.
    policy: Mutex<Policies>,
    /// Fixed by the dm-integrity superblock: known while suspended too.
    size: u64,
    block_size: u32,
    /// `None` while suspended.
    inner: Mutex<Option<Arc<IntegrityVolume>>>,
    resumed: Condvar,
    /// Set (under `inner`'s lock) by [`Authenticated::abort_suspended`]: the waiting requests
    /// and every later one fail with EIO.
    aborted: AtomicBool,
    /// Mismatches counted by the volumes dropped at earlier suspends.
    mismatches_before: AtomicU64,
    ops: [OpCounters; 2],
    on_integrity_error: Option<OnIntegrityError>,
    /// Passed by every request as it is counted (see [`super::Opened::activity`]).
    activity: crate::sync::Tripwire,
}

const READ: usize = 0;
const WRITE: usize = 1;

impl Authenticated {
    fn new(how: How, data: Arc<dyn Backend>, vol: IntegrityVolume, write_mode: WriteMode) -> Self {
        Authenticated {
            name: how.name,
            data,
            read_only: vol.read_only(),
            write_mode,
            policy: Mutex::new(vol.policy()),
            size: vol.size(),
            block_size: vol.block_size(),
            inner: Mutex::new(Some(Arc::new(vol))),
            resumed: Condvar::new(),
            aborted: AtomicBool::new(false),
            mismatches_before: AtomicU64::new(0),
            ops: Default::default(),
            on_integrity_error: how.on_integrity_error,
            activity: Default::default(),
        }
    }

    /// The volume to serve a request with; waits while suspended, EIO once aborted.
    fn vol(&self) -> Result<Arc<IntegrityVolume>> {
        let mut g = lock(&self.inner);
        loop {
            if let Some(v) = &*g {
                return Ok(v.clone());
            }
            if self.aborted.load(Ordering::Relaxed) {
                return Err(Error::io(
                    format!("{}: the volume was closed while suspended", self.name),
                    std::io::Error::from_raw_os_error(libc::EIO),
                ));
            }
            g = self.resumed.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Ends a suspended volume for good: the requests waiting for the resume, and every later
    /// one, fail with EIO.
    pub(crate) fn abort_suspended(&self) -> Result<()> {
        let g = lock(&self.inner);
        if g.is_some() {
            return Err(Error::InvalidArgument("not suspended".into()));
        }
        // Under the lock the waiters hold between their look and their wait: none misses it.
        self.aborted.store(true, Ordering::Relaxed);
        drop(g);
        self.resumed.notify_all();
        Ok(())
    }

    fn served<T>(&self, op: usize, bytes: u64, r: Result<T>) -> Result<T> {
        self.activity.pass();
        self.ops[op].count(bytes, &r);
        if let (Err(Error::Integrity { sector }), Some(hook)) = (&r, &self.on_integrity_error) {
            hook(*sector);
        }
        r
    }

    pub(crate) fn activity(&self) -> &crate::sync::Tripwire {
        &self.activity
    }

    /// Reads and writes served so far (write-zeroes and discards count as writes).
    pub(crate) fn stats(&self) -> Stats {
        Stats {
            read: self.ops[READ].snapshot(),
            write: self.ops[WRITE].snapshot(),
        }
    }

    /// Blocks whose tag did not verify since opening (across suspends).
    pub(crate) fn integrity_mismatches(&self) -> u64 {
        let now = lock(&self.inner)
            .as_ref()
            .map_or(0, |v| v.integrity_errors());
        self.mismatches_before.load(Ordering::Relaxed) + now
    }

    /// Buffer chunks the volume could not lock (see [`super::Opened::buffer_lock_failures`]); those
    /// of a volume dropped at a suspend are not counted.
    pub(crate) fn buffer_lock_failures(&self) -> u64 {
        lock(&self.inner)
            .as_ref()
            .map_or(0, |v| v.buffer_lock_failures())
    }

    pub(crate) fn is_suspended(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// The dispatch policies requests run with (also while suspended: those of the resume).
    pub(crate) fn policy(&self) -> Policies {
        *lock(&self.policy)
    }

    /// Switches the dispatch policies for the next requests (and the volume built on resume).
    pub(crate) fn set_policy(&self, p: Policies) {
        let mut g = lock(&self.policy);
        *g = p;
        if let Some(v) = &*lock(&self.inner) {
            v.set_policy(p);
        }
    }

    /// Takes the volume away from new requests, waits for the requests inside to finish,
    /// flushes and drops it: its `SecretBytes` key and keyed contexts are wiped on drop.
    pub(crate) fn suspend(&self) -> Result<()> {
        let Some(mut v) = lock(&self.inner).take() else {
            return Err(Error::InvalidArgument("already suspended".into()));
        };
        let vol = loop {
            match Arc::try_unwrap(v) {
                Ok(vol) => break vol,
                Err(still_used) => {
                    v = still_used;
                    std::thread::sleep(SUSPEND_POLL);
                }
            }
        };
        if let Err(e) = vol.flush() {
            // Not suspended: the volume serves on.
            *lock(&self.inner) = Some(Arc::new(vol));
            self.resumed.notify_all();
            return Err(e);
        }
        self.mismatches_before
            .fetch_add(vol.integrity_errors(), Ordering::Relaxed);
        drop(vol);
        Ok(())
    }

    /// Builds the volume again from `vk` and lets the waiting requests in.
    pub(crate) fn resume(&self, hdr: &Header, vk: &VolumeKey) -> Result<()> {
        let vol = integrity::open_luks2_mode(
            self.data.clone(),
            hdr,
            vk,
            self.read_only,
            self.write_mode,
        )?;
        check_superblock_flags(&vol)?;
        if vol.size() != self.size || vol.block_size() != self.block_size {
            return Err(Error::InvalidArgument(format!(
                "{}: the dm-integrity superblock changed while suspended",
                self.name
            )));
        }
        let mut g = lock(&self.inner);
        if g.is_some() || self.aborted.load(Ordering::Relaxed) {
            return Err(Error::InvalidArgument("not suspended".into()));
        }
        vol.set_policy(self.policy());
        *g = Some(Arc::new(vol));
        drop(g);
        self.resumed.notify_all();
        Ok(())
    }
}

impl BlockDev for Authenticated {
    fn size(&self) -> u64 {
        self.size
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = buf.len() as u64;
        let r = self.vol().and_then(|v| v.read_at(buf, offset));
        self.served(READ, n, r)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        // An unaligned write reads (and verifies) the blocks at its ends.
        let r = self.vol().and_then(|v| v.write_at(buf, offset));
        self.served(WRITE, buf.len() as u64, r)
    }
    fn write_at_mut(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = buf.len() as u64;
        let r = self.vol().and_then(|v| v.write_at_mut(buf, offset));
        self.served(WRITE, n, r)
    }
    fn write_fua(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = buf.len() as u64;
        let r = self.vol().and_then(|v| v.write_fua(buf, offset));
        self.served(WRITE, n, r)
    }
    fn flush(&self) -> Result<()> {
        self.vol()?.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let r = self.vol().and_then(|v| v.discard(offset, len));
        self.served(WRITE, len, r)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let r = self.vol().and_then(|v| v.write_zeroes(offset, len));
        self.served(WRITE, len, r)
    }
}

/// Refuses a dm-integrity superblock whose flags say its tags are not all valid:
/// recalculation in progress (tags beyond `recalc_sector` were never written) or a dirty
/// bitmap (bitmap mode left blocks whose tags are stale).
fn check_superblock_flags(vol: &IntegrityVolume) -> Result<()> {
    let sb = &vol.layout().sb;
    for (flag, what) in [
        (
            sb_flags::RECALCULATING,
            "its tags are being recalculated (not all are valid)",
        ),
        (
            sb_flags::DIRTY_BITMAP,
            "its bitmap is dirty (tags of some blocks are stale)",
        ),
    ] {
        if sb.has(flag) {
            return Err(Error::UnsupportedLuks(format!(
                "the dm-integrity superblock says {what}; let the kernel finish with it \
                 (cryptsetup open, then close) before ucrypt opens it"
            )));
        }
    }
    Ok(())
}
