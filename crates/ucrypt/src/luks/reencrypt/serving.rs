//! The contract between a reencryption's hotzone loop and whoever serves the volume while it
//! runs: nobody offline ([`Offline`]), a [`crate::volume::Volume`] online
//! (`reencrypt::online`), or a daemon answering a worker process's calls (the CLI's
//! `daemon/worker.rs`). The loop calls it around each hotzone and each piece it rewrites.

use crate::sector::{CipherSpec, SectorSize};
use crate::Result;

/// What the hotzone loop tells a volume that serves the data while it runs (online
/// rotation, `luks::reencrypt_online`). Offsets are bytes from the start of the data.
pub trait Serving {
    /// Before the first hotzone, with the new cipher, key (checked against the reencryption
    /// digest) and sector size (`None` for a decryption), the bytes already done, and the
    /// direction (`backward`: from the end, a decryption).
    fn start(
        &mut self,
        new_key: Option<(CipherSpec, &[u8], SectorSize)>,
        done: u64,
        backward: bool,
    ) -> Result<()>;
    /// Before the hotzone `[offset, offset + len)` is read: returns once no write touches it,
    /// and none will until [`Serving::release`] (its data stays the old ciphertext).
    fn hold(&mut self, offset: u64, len: u64) -> Result<()>;
    /// Before the piece `[offset, offset + len)` of the hotzone is rewritten: returns once no
    /// request at all touches the piece.
    fn rewrite(&mut self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }
    /// After the piece `[offset, offset + len)` was rewritten (written, not yet flushed). A
    /// hotzone's pieces are rewritten from its start going forward, from its end going
    /// backward.
    fn rewritten(&mut self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }
    /// The pieces a hotzone of `hotzone_bytes` is read, journalled and rewritten in (`None`:
    /// the whole hotzone at once), so that a request waits for one piece at most, and the
    /// device's queue holds one piece of the rotation's I/O at a time.
    fn piece_bytes(&self, _hotzone_bytes: u64) -> Option<u64> {
        None
    }
    /// The most threads a hotzone's crypto and I/O run on (`None`: one per CPU).
    fn rekey_lanes_max(&self) -> Option<usize> {
        None
    }
    /// After the hotzone's last commit: the data below `done` is under the new key.
    fn release(&mut self, done: u64) -> Result<()>;
    /// Whether anyone is served meanwhile: where nobody is, hold and release do nothing, and
    /// `none` and data shift hotzones run back to back (`reencrypt_run/walk.rs`).
    fn serves(&self) -> bool {
        true
    }
    /// The loop failed while a hotzone was held: its data may be half rewritten.
    fn failed(&mut self);
}

/// The offline driver: nobody serves the data meanwhile.
pub(crate) struct Offline;

impl Serving for Offline {
    fn serves(&self) -> bool {
        false
    }
    fn start(&mut self, _: Option<(CipherSpec, &[u8], SectorSize)>, _: u64, _: bool) -> Result<()> {
        Ok(())
    }
    fn hold(&mut self, _: u64, _: u64) -> Result<()> {
        Ok(())
    }
    fn release(&mut self, _: u64) -> Result<()> {
        Ok(())
    }
    fn failed(&mut self) {}
}
