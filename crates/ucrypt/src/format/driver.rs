//! Performs a [`FormatPlan`] against backends: the only part of `format` that does I/O, and
//! only through a [`Backend`] (the LUKS driver's [`luks::apply`] and the integrity layer).

use std::sync::Arc;

use super::FormatPlan;
use crate::backend::Backend;
use crate::integrity::{self, WriteMode};
use crate::luks;
use crate::{BlockDev, Error, Result};

/// Bytes per zero write of the integrity wipe: each is one request through the integrity
/// layer, which seals it in chunks across its workers; the progress is told after each.
pub const INTEGRITY_WIPE_CHUNK_BYTES: u64 = 4 << 20;

/// Whether [`write_integrity`] writes the data area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntegrityWipe {
    /// Every block written with zeroes through the integrity layer, so that every tag
    /// verifies (cryptsetup's default).
    Zeroes,
    /// Nothing written (cryptsetup's `--integrity-no-wipe`): blocks fail authentication until
    /// written.
    Skip,
}

/// Writes the new header and its first keyslot on `header_dev` (the data device, or a
/// detached header at least [`FormatPlan::header_end_bytes`] long), in the plan's order.
pub fn write_header(header_dev: &dyn Backend, plan: &FormatPlan) -> Result<()> {
    luks::apply(header_dev, &plan.header_ops)
}

/// After [`write_header`], for an authenticated volume: writes the dm-integrity superblock and
/// journal on `data`, then opens the new volume through the integrity layer and, with
/// [`IntegrityWipe::Zeroes`], writes zeroes over its whole data area, calling `progress(done,
/// total)` before the first write and after each [`INTEGRITY_WIPE_CHUNK_BYTES`]. Returns the
/// size of the data area in bytes. A plan without an integrity part is refused.
///
/// The wipe goes straight to the data and tag areas (dm-integrity's direct mode), as
/// cryptsetup's wipe activates without the journal: nothing of it needs to be atomic.
pub fn write_integrity(
    data: Arc<dyn Backend>,
    plan: &FormatPlan,
    wipe: IntegrityWipe,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64> {
    let Some(ip) = &plan.integrity else {
        return Err(Error::InvalidArgument(
            "the volume planned has no authenticated segment".into(),
        ));
    };
    luks::apply(data.as_ref(), &ip.ops)?;
    let vol = integrity::open_luks2_mode(
        data,
        &plan.header,
        &plan.volume_key,
        false,
        WriteMode::Direct,
    )?;
    let total = vol.size();
    if wipe == IntegrityWipe::Skip {
        return Ok(total);
    }
    progress(0, total);
    let mut done = 0u64;
    while done < total {
        let n = (total - done).min(INTEGRITY_WIPE_CHUNK_BYTES);
        vol.write_zeroes(done, n)?;
        done += n;
        progress(done, total);
    }
    vol.flush()?;
    Ok(total)
}
