//! Cipher contexts reused across requests. A `SectorCipher` is not `Sync` and creating one
//! expands a key schedule and allocates, which costs more than the crypto of a 4 KiB request,
//! so callers borrow one from a fixed table of slots: each thread starts at "its" slot
//! (by thread number), so in the common case the slot is uncontended and stays in that core's
//! cache; a busy slot is skipped. Contexts are created lazily, once per slot, from a prototype.
//! Workers borrow theirs here too, so that [`CipherSlots::clear`] reaches every context of
//! the volume: a suspended volume holds no key.

use std::sync::{Mutex, MutexGuard, TryLockError};

use super::stats::thread_index;
use crate::sector::SectorCipher;
use crate::sync::lock;
use crate::{Error, Result};

/// Cipher contexts per volume for callers' threads (workers own theirs). More concurrent callers
/// than this take turns.
pub const CIPHER_SLOTS: usize = 64;

pub struct CipherSlots {
    /// None while the volume is suspended (its key wiped).
    proto: Mutex<Option<SectorCipher>>,
    slots: Box<[Mutex<Option<SectorCipher>>]>,
}

impl CipherSlots {
    pub fn new(proto: SectorCipher) -> Self {
        CipherSlots {
            proto: Mutex::new(Some(proto)),
            slots: (0..CIPHER_SLOTS).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// Another context from the prototype.
    fn clone_cipher(&self) -> Result<SectorCipher> {
        match self
            .proto
            .lock()
            .map_err(|_| Error::Bug("cipher prototype lock poisoned"))?
            .as_ref()
        {
            Some(p) => p.try_clone(),
            None => Err(Error::Bug("cipher used while the volume is suspended")),
        }
    }

    /// Drops the prototype and every context made from it (each wipes its key material as it
    /// goes). A context in use is waited for; the volume calls this with its gate closed, so
    /// none is.
    pub fn clear(&self) {
        drop(lock(&self.proto).take());
        for s in self.slots.iter() {
            drop(lock(s).take());
        }
    }

    /// Installs a new prototype (after [`CipherSlots::clear`]); contexts are made from it
    /// lazily, as at the start.
    pub fn install(&self, proto: SectorCipher) {
        for s in self.slots.iter() {
            drop(lock(s).take());
        }
        *lock(&self.proto) = Some(proto);
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
