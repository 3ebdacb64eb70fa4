//! Cipher contexts reused across requests. A `SectorCipher` is not `Sync` and costs ~2 µs to
//! create, so callers borrow one from a fixed table of slots: each thread starts at "its" slot
//! (by thread number), so in the common case the slot is uncontended and stays in that core's
//! cache; a busy slot is skipped. Contexts are created lazily, once per slot, from a prototype.

use std::sync::{Mutex, MutexGuard, TryLockError};

use super::stats::thread_index;
use crate::sector::SectorCipher;
use crate::{Error, Result};

/// Cipher contexts per volume for callers' threads (workers own theirs). More concurrent callers
/// than this take turns.
pub const CIPHER_SLOTS: usize = 64;

pub struct CipherSlots {
    proto: Mutex<SectorCipher>,
    slots: Box<[Mutex<Option<SectorCipher>>]>,
}

impl CipherSlots {
    pub fn new(proto: SectorCipher) -> Self {
        CipherSlots {
            proto: Mutex::new(proto),
            slots: (0..CIPHER_SLOTS).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// Another context for a worker thread to own.
    pub fn clone_cipher(&self) -> Result<SectorCipher> {
        self.proto
            .lock()
            .map_err(|_| Error::Bug("cipher prototype lock poisoned"))?
            .try_clone()
    }

    /// Runs `f` with a context borrowed for the duration of the call.
    pub fn with<R>(&self, f: impl FnOnce(&mut SectorCipher) -> Result<R>) -> Result<R> {
        let start = thread_index();
        let n = self.slots.len();
        let mut guard: Option<MutexGuard<'_, Option<SectorCipher>>> = None;
        for i in 0..n {
            match self.slots[(start + i) % n].try_lock() {
                Ok(g) => {
                    guard = Some(g);
                    break;
                }
                // A panic while a context was borrowed does not make the context unusable.
                Err(TryLockError::Poisoned(p)) => {
                    guard = Some(p.into_inner());
                    break;
                }
                Err(TryLockError::WouldBlock) => {}
            }
        }
        let mut g = match guard {
            Some(g) => g,
            None => self.slots[start % n]
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        };
        if g.is_none() {
            *g = Some(self.clone_cipher()?);
        }
        match g.as_mut() {
            Some(c) => f(c),
            None => Err(Error::Bug("cipher slot empty after filling it")),
        }
    }
}
