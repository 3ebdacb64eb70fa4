//! Online reencryption: the same hotzones as `run`, while a [`Volume`] serves the
//! data. A key rotation (or a new cipher), and, with a detached header, an encryption or a
//! decryption in place (one side is then plaintext, served as `cipher_null`; a decryption
//! goes backward, from the end); and both data shifts, the encryption that puts the header
//! in front and the decryption that moves the data back (the new side at its own offset, the
//! old side reading the moved segment where it moved: `Remap`). The volume maps each
//! request by offset to the new side (the bytes done) or the old one (`volume/segments.rs`);
//! the driver holds each hotzone from before its read to after its last commit, so only the
//! requests touching it wait. Hotzones, header and resilience data go through the device
//! itself (or the detached header).
//!
//! - [`open`]: a volume whose header (in front or detached) is in reencryption (a rotation
//!   interrupted, by a crash or a close) opens as cryptsetup activates one: a hotzone left by
//!   a crash is recovered first (as `repair` does), then both keys are unlocked and checked
//!   against the reencryption digest, and the volume serves the two segments.
//! - [`rotate`]: runs (or continues) the reencryption on an open volume, then switches it to
//!   the new side. The header must already be in reencryption (`run::init`,
//!   `init_on`, `init_encrypt`, `init_encrypt_shift`, `init_decrypt_unshift`).
//! - [`recover_stopped`]: after a rotation whose driver died or failed inside a hotzone, the
//!   same recovery as `repair` (and [`open`]) runs, while the volume serves on: the requests
//!   touching the hotzone wait for it, and the rotation can then be resumed online.

use std::sync::Arc;

use super::run::{self, unlock_digest, Progress, RunOptions};
use super::serving::Serving;
use crate::backend::Backend;
use crate::blockdev::BlockDev;
use crate::luks::json::SegmentKind;
use crate::luks::json::{Metadata, SegmentSize};
use crate::luks::reencrypt::plan::{
    check_layout, position, shift_geometry, unshift_geometry, Shift, Unshift,
};
use crate::luks::reencrypt::{digest_of_segment, Direction, ReencryptState, Resilience};
use crate::luks::{read_header, Header, OpenOptions};
use crate::sector::{CipherSpec, Geometry, SectorSize};
use crate::volume::{Volume, VolumeConfig};
use crate::{Error, Result, SecretBytes};

fn bad(detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check: "reencrypt",
        detail: detail.into(),
    }
}

/// One side of a reencryption served online, from its backup segment.
struct Side {
    /// `cipher_null` for a `linear` segment (plaintext).
    spec: CipherSpec,
    /// `None` for a `linear` segment: it serves in the other side's sectors.
    sector_size: Option<SectorSize>,
    offset: u64,
    /// `None`: dynamic.
    size: Option<u64>,
}

/// The side segment `seg` describes.
fn segment_params(meta: &Metadata, seg: u32) -> Result<Side> {
    let s = meta
        .segments
        .get(&seg.to_string())
        .ok_or_else(|| bad(format!("segment {seg} missing")))?;
    let size = match s.size {
        SegmentSize::Bytes(n) => Some(n),
        SegmentSize::Dynamic => None,
    };
    if s.kind == SegmentKind::Linear {
        return Ok(Side {
            spec: CipherSpec::NULL,
            sector_size: None,
            offset: s.offset.0,
            size,
        });
    }
    let spec: CipherSpec = s
        .encryption
        .as_deref()
        .ok_or_else(|| bad("crypt segment lacks encryption"))?
        .parse()?;
    let ss = SectorSize::new(u64::from(s.sector_size.unwrap_or(512)))?;
    if s.iv_tweak.is_some_and(|t| t.0 != 0) {
        return Err(bad("a backup segment with a non-zero iv_tweak"));
    }
    Ok(Side {
        spec,
        sector_size: Some(ss),
        offset: s.offset.0,
        size,
    })
}

/// Opens a volume whose header (on `data`, or the detached `opts.header`) is in reencryption,
/// serving both segments. A hotzone left by a crash is recovered first (not read-only: then
/// refused with [`Error::NeedsRecovery`]). Only a passphrase unlocks both keys.
pub fn open(
    data: Arc<dyn Backend>,
    hdr: &Header,
    passphrase: &[u8],
    opts: &OpenOptions,
) -> Result<Volume> {
    let (hdr_dev, mut hdr) = header_device(&data, hdr, opts)?;
    let detached = !Arc::ptr_eq(&hdr_dev, &data);
    let devs = run::Devices {
        header: hdr_dev.as_ref(),
        data: data.as_ref(),
    };
    let needs_recovery = match &hdr {
        Header::Luks2(h) => {
            let st = ReencryptState::from_metadata(&h.meta)?
                .ok_or_else(|| bad("not in reencryption"))?;
            check_served(&st)?;
            st.needs_recovery()
        }
        Header::Luks1(_) => return Err(bad("LUKS1 has no reencryption")),
    };
    if needs_recovery {
        // A detached header is held read-only while the volume is served: `repair` first.
        if opts.read_only || detached {
            return Err(Error::NeedsRecovery);
        }
        run::recover_on(devs, passphrase)?;
        hdr = read_header(hdr_dev.as_ref())?;
    }
    let Header::Luks2(h) = &hdr else {
        return Err(bad("LUKS1 has no reencryption"));
    };
    let Some(st) = ReencryptState::from_metadata(&h.meta)? else {
        // The recovered hotzone was the last one: the rotation is finished.
        return crate::luks::open_parsed(
            data,
            &hdr,
            crate::luks::Unlock::Passphrase(SecretBytes::from_slice(passphrase)),
            opts,
        );
    };
    let old = segment_params(&h.meta, st.backup_previous)?;
    let new = segment_params(&h.meta, st.backup_final)?;
    // A plaintext side (linear) has no key, and so no digest.
    let key_of = |side: &Side, seg: u32, name: &str| -> Result<Option<_>> {
        if side.spec == CipherSpec::NULL && side.sector_size.is_none() {
            return Ok(None);
        }
        let d =
            digest_of_segment(&h.meta, seg).ok_or_else(|| bad(format!("{name} has no digest")))?;
        unlock_digest(hdr_dev.as_ref(), &hdr, &h.meta, d, passphrase).map(Some)
    };
    let new_vk = key_of(&new, st.backup_final, "backup-final")?;
    let old_vk = key_of(&old, st.backup_previous, "backup-previous")?;
    h.verify_reencrypt_digest(old_vk.as_ref(), new_vk.as_ref())?;
    // Each side serves in its own sectors (a linear side in the other's): the volume's own
    // engine in the old side's, the new side's engine in the new ones. Hotzones and the mark
    // move in whole sectors of both.
    let (sector_size, new_sector) = match (old.sector_size, new.sector_size) {
        (Some(a), Some(b)) => (a, b),
        (Some(a), None) | (None, Some(a)) => (a, a),
        (None, None) => return Err(bad("neither side of the reencryption is encrypted")),
    };
    let ss = u64::from(sector_size.bytes().max(new_sector.bytes()));
    let (shift, data_bytes) = served_data_bytes(data.as_ref(), &h.meta, &st, &old, &new, ss)?;
    // A decryption that moves the data back: its moved segment (the first `M` bytes of
    // data, at the new data offset) stays on the old side until its hotzone, the last.
    let unshift = unshift_geometry(&h.meta, &st, data_bytes)?;
    if let Some(us) = unshift {
        us.check_device(data.size())?;
    }
    // The live segments say where the mark is; the reencryption digest does not cover them.
    check_layout(&h.meta, &st, data_bytes)?;
    let done = position(&h.meta, &st, data_bytes)?.done;
    let geometry = Geometry {
        sector_size,
        iv_offset: 0,
        iv_large_sectors: false,
    };
    let old_key = old_vk.as_ref().map_or(&[][..], |k| k.bytes());
    let mut cfg = VolumeConfig::new(old.spec, SecretBytes::from_slice(old_key), geometry);
    drop(old_vk);
    cfg.data_offset_bytes = old.offset;
    cfg.size_bytes = old.size.or(shift.map(|sh| sh.data_bytes));
    cfg.policy = opts.policy;
    cfg.spin = opts.spin;
    cfg.read_only = opts.read_only;
    cfg.allow_discards =
        opts.allow_discards || hdr.activation_flags().iter().any(|f| f == "allow-discards");
    let vol = Volume::new(old_side_device(&data, shift, unshift)?, cfg)?;
    let new_key = new_vk.as_ref().map_or(&[][..], |k| k.bytes());
    let backward = st.keyslot.direction == Direction::Backward;
    let new_side = (new.spec, SecretBytes::from_slice(new_key), new_sector);
    let at = crate::volume::NewSideAt {
        backend: data,
        data_offset: new.offset,
        head_bytes: unshift.map_or(0, |us| us.moved_bytes),
    };
    vol.begin_segments_at(new_side, at, done, backward)?;
    Ok(vol)
}

/// The device the header `hdr` is read from and its header as read there: the data device
/// (then everything goes through it, as offline), or the detached `opts.header` (`--header`;
/// a handle that may be read-only: the daemon's rotation opens its own writable one).
/// Refused when the header on the device is not `hdr` (by UUID).
fn header_device(
    data: &Arc<dyn Backend>,
    hdr: &Header,
    opts: &OpenOptions,
) -> Result<(Arc<dyn Backend>, Header)> {
    let same = |on: &Result<Header>| match (on, hdr) {
        (Ok(Header::Luks2(a)), Header::Luks2(b)) => a.bin.uuid == b.bin.uuid,
        _ => false,
    };
    let on_data = read_header(data.as_ref());
    let (hdr_dev, on_dev) = match &opts.header {
        _ if same(&on_data) => (data.clone(), on_data),
        Some(h) => (h.clone(), read_header(h.as_ref())),
        None => (data.clone(), on_data),
    };
    if !same(&on_dev) {
        return Err(bad("the header given is not the one on its device"));
    }
    Ok((hdr_dev, on_dev?))
}

/// Refuses a reencryption that is not served online. Served: a reencryption in place, an
/// encryption or decryption with a detached header, an encryption that puts the header in
/// front (the data moves up) and a decryption that moves the data back.
fn check_served(st: &ReencryptState) -> Result<()> {
    let shifted = matches!(
        (st.keyslot.mode, &st.keyslot.resilience),
        (
            crate::luks::reencrypt::Mode::Encrypt,
            Resilience::Datashift { .. }
        ) | (
            crate::luks::reencrypt::Mode::Decrypt,
            Resilience::DatashiftChecksum { .. } | Resilience::DatashiftJournal { .. }
        )
    );
    let in_place = matches!(
        st.keyslot.resilience,
        Resilience::None | Resilience::Checksum { .. } | Resilience::Journal
    );
    if st.keyslot.mode != crate::luks::reencrypt::Mode::Reencrypt && !in_place && !shifted {
        return Err(Error::UnsupportedLuks(format!(
            "serving a volume in {} (resilience {}): finish it offline with ucrypt \
             reencrypt --resume-only",
            match st.keyslot.mode {
                crate::luks::reencrypt::Mode::Encrypt => "encryption",
                _ => "decryption",
            },
            st.keyslot.resilience.name()
        )));
    }
    Ok(())
}

/// The shift of an encryption that puts the header in front (if it is one) and the bytes of
/// data served, in whole sectors of `ss`. Only a reencryption that moves the data may have
/// sides (`old`, `new`) at different places.
fn served_data_bytes(
    data: &dyn Backend,
    meta: &Metadata,
    st: &ReencryptState,
    old: &Side,
    new: &Side,
    ss: u64,
) -> Result<(Option<Shift>, u64)> {
    // A reencryption that moves the data: the new side at its own offset, the old one over a
    // backend that reads the moved segment where it moved (`Remap`).
    let shift = shift_geometry(meta, st)?;
    let moves = shift.is_some()
        || matches!(
            st.keyslot.resilience,
            Resilience::DatashiftChecksum { .. } | Resilience::DatashiftJournal { .. }
        );
    if !moves && (old.offset, old.size) != (new.offset, new.size) {
        return Err(Error::UnsupportedLuks(
            "serving a volume whose reencryption moves the data other than an encryption \
             with the header put in front or a decryption that moves it back (a rotation \
             with --reduce-device-size is served once it ends: finish it with reencrypt \
             --resume-only)"
                .into(),
        ));
    }
    let data_bytes = match (shift, old.size) {
        (Some(sh), _) => {
            sh.check_device(data.size())?;
            sh.data_bytes
        }
        (None, Some(n)) => n,
        (None, None) => data
            .size()
            .checked_sub(old.offset)
            .ok_or_else(|| bad("the device ends before its data offset"))?,
    } / ss
        * ss;
    Ok((shift, data_bytes))
}

/// The device the old side reads: `data` itself, or for a reencryption that moves the data
/// a [`Remap`] of the moved segment.
fn old_side_device(
    data: &Arc<dyn Backend>,
    shift: Option<Shift>,
    unshift: Option<Unshift>,
) -> Result<Arc<dyn Backend>> {
    Ok(match (shift, unshift) {
        // The first shift of plaintext (where the header now is) at the moved segment.
        (Some(sh), _) => Arc::new(Remap::new(
            data.clone(),
            (sh.old_offset, sh.shift_bytes),
            sh.moved_offset,
        )?),
        // The first `M` bytes of ciphertext over the old header, at the new data offset.
        (None, Some(us)) => Arc::new(Remap::new(
            data.clone(),
            (us.old_offset, us.moved_bytes),
            us.new_offset,
        )?),
        (None, None) => data.clone(),
    })
}

/// The device as the old side of a reencryption that moves the data sees it: the bytes
/// `[from, from + len)` (where the moved segment's data belongs) are read and written at
/// `to` (where it moved), every other byte where it is. For an encryption that puts the
/// header in front, the first shift of plaintext, at the end of the device; for a decryption
/// that moves the data back, the first `M` bytes of ciphertext, over the old header. The
/// data path's requests cross the range's ends, so a request is cut there.
struct Remap {
    dev: Arc<dyn Backend>,
    from: u64,
    len: u64,
    to: u64,
}

impl Remap {
    fn new(dev: Arc<dyn Backend>, (from, len): (u64, u64), to: u64) -> Result<Self> {
        // The planners' checks (`shift_geometry`, `unshift_geometry`) keep the moved segment
        // apart from every byte the new side writes while the old side serves it; this keeps
        // the remap itself sane.
        let (end, to_end) = match (from.checked_add(len), to.checked_add(len)) {
            (Some(e), Some(t)) => (e, t),
            _ => (u64::MAX, u64::MAX),
        };
        let overlap = len > 0 && from < to_end && to < end;
        if end == u64::MAX || to_end > dev.size() || overlap {
            return Err(bad(format!(
                "a moved segment of {len} bytes from {from} to {to} (overlapping, or past the \
                 device's {} bytes)",
                dev.size()
            )));
        }
        Ok(Remap { dev, from, len, to })
    }

    /// Runs `f` on each part of `[offset, offset + len)`: the parts inside the moved range at
    /// its new place, the rest where they are; `f` gets the device offset and the part's
    /// range in the request.
    fn split(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(u64, std::ops::Range<usize>) -> Result<()>,
    ) -> Result<()> {
        let end = offset + len;
        let (a, b) = (
            self.from.clamp(offset, end),
            (self.from + self.len).clamp(offset, end),
        );
        if a > offset || len == 0 {
            f(offset, 0..(a - offset) as usize)?;
        }
        if b > a {
            f(
                self.to + (a - self.from),
                (a - offset) as usize..(b - offset) as usize,
            )?;
        }
        if end > b {
            f(b, (b - offset) as usize..len as usize)?;
        }
        Ok(())
    }
}

impl Backend for Remap {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        // Whole parts (a short read inside the head would leave a hole before the rest).
        let len = buf.len() as u64;
        self.split(offset, len, |at, r| self.dev.read_exact_at(&mut buf[r], at))?;
        Ok(buf.len())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.split(offset, len, |at, r| self.dev.write_at(&buf[r], at))
    }

    fn write_at_fua(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.split(offset, len, |at, r| self.dev.write_at_fua(&buf[r], at))
    }

    fn flush(&self) -> Result<()> {
        self.dev.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.split(offset, len, |at, r| self.dev.discard(at, r.len() as u64))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.split(offset, len, |at, r| {
            self.dev.write_zeroes(at, r.len() as u64)
        })
    }

    fn size(&self) -> u64 {
        self.dev.size()
    }

    fn logical_block_bytes(&self) -> u32 {
        self.dev.logical_block_bytes()
    }

    fn mem_align_bytes(&self) -> usize {
        self.dev.mem_align_bytes()
    }

    fn describe(&self) -> String {
        format!(
            "{} (its bytes {}..{} at {})",
            self.dev.describe(),
            self.from,
            self.from + self.len,
            self.to
        )
    }

    fn serializes_writes(&self) -> bool {
        self.dev.serializes_writes()
    }
}

/// The largest piece of a hotzone read, journalled or rewritten at a time while the volume
/// serves: a read touching the hotzone waits for one piece's write at most (milliseconds), not
/// for the whole hotzone's rewrite, and the device's queue holds one piece of the rotation's
/// I/O at a time, so the front end's requests do not queue behind a whole hotzone.
pub const PIECE_BYTES_MAX: u64 = 4 << 20;
/// Pieces per hotzone at least (smaller hotzones get smaller pieces, down to one page), so
/// that a small hotzone is cut too.
pub const PIECES_PER_HOTZONE_MIN: u64 = 16;

/// The piece of a hotzone of `hotzone_bytes` (the driver rounds it to whole sectors and pages).
pub fn piece_bytes(hotzone_bytes: u64) -> u64 {
    (hotzone_bytes / PIECES_PER_HOTZONE_MIN).clamp(4096, PIECE_BYTES_MAX)
}

/// Threads the rotation's crypto and I/O run on while the volume serves: one CPU fewer than
/// there are (at least one), so the front end and its clients keep a CPU.
pub fn rekey_lanes_serving() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(1)
        .max(1)
}

/// While the volume's clients issue requests, the rotation pauses after each hotzone for this
/// share of the time the hotzone took (so it runs 1 / (1 + share) of the time, 62 %): the
/// device and the CPUs are then the clients' alone for a while, and the rotation still goes at
/// more than half its offline speed. A smaller share leaves the clients' 4 KiB reads at QD1
/// under half their speed, a larger one takes the rotation under half its offline speed: the
/// two goals of `ucrypt bench reencrypt --online` (BENCHMARKS.md). Nothing is held during
/// the pause; with no
/// requests there is no pause.
pub const YIELD_SHARE: f64 = 0.6;
// The share keeps the rotation running more than half the time while clients are busy.
const _: () = assert!(YIELD_SHARE >= 0.0 && YIELD_SHARE < 1.0);

/// The hotzone loop's link to the volume.
struct Online<'a> {
    vol: &'a Volume,
    /// When the current hotzone's work began (the previous release, or after its pause).
    since: std::time::Instant,
    /// The volume's request count then.
    requests: u64,
}

impl<'a> Online<'a> {
    fn new(vol: &'a Volume) -> Self {
        let mut o = Online {
            vol,
            since: std::time::Instant::now(),
            requests: 0,
        };
        o.requests = o.requests();
        o
    }

    fn requests(&self) -> u64 {
        let s = self.vol.stats();
        s.read.requests + s.write.requests
    }

    /// After a hotzone: pause for [`YIELD_SHARE`] of its time if clients came meanwhile.
    fn pace(&mut self) {
        let pause = pause_after(self.since.elapsed(), self.requests, self.requests());
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
        self.since = std::time::Instant::now();
        self.requests = self.requests();
    }
}

/// The pause after a hotzone that took `busy`, the volume's request count being `before` when
/// it began and `now` at its end.
fn pause_after(busy: std::time::Duration, before: u64, now: u64) -> std::time::Duration {
    if now == before {
        std::time::Duration::ZERO
    } else {
        busy.mul_f64(YIELD_SHARE)
    }
}

impl Serving for Online<'_> {
    fn start(
        &mut self,
        new_key: Option<(CipherSpec, &[u8], SectorSize)>,
        done: u64,
        backward: bool,
    ) -> Result<()> {
        // A decryption's new side is plaintext, in the old side's sectors.
        let (spec, new_key, sector) =
            new_key.unwrap_or((CipherSpec::NULL, &[], self.vol.sector_size()));
        if self
            .vol
            .reencryption_backward()
            .is_some_and(|b| b != backward)
        {
            return Err(Error::Bug(
                "the volume serves the reencryption in the other direction",
            ));
        }
        match self.vol.reencrypted_bytes() {
            None if done == 0 => {
                let new_side = (spec, SecretBytes::from_slice(new_key), sector);
                self.vol.begin_segments(new_side, 0, backward)
            }
            // Opened before the rotation started, the volume holds the old key only: the bytes
            // already rewritten would be read with the wrong key.
            None => Err(Error::InvalidArgument(format!(
                "the volume was opened before this rotation started and {done} bytes are \
                 already under the new key: close and open it again to continue online"
            ))),
            Some(mark) if mark == done => Ok(()),
            Some(mark) => Err(Error::Bug(if mark < done {
                "the volume's reencryption mark is behind the header's"
            } else {
                "the volume's reencryption mark is ahead of the header's"
            })),
        }
    }

    fn hold(&mut self, offset: u64, len: u64) -> Result<()> {
        // start() made the segments; the hotzone lock refuses a second hotzone (busy).
        self.vol.hold_hotzone(offset, len)
    }

    fn rewrite(&mut self, offset: u64, len: u64) -> Result<()> {
        self.vol.hotzone_rewrite(offset, len)
    }

    fn rewritten(&mut self, offset: u64, len: u64) -> Result<()> {
        self.vol.hotzone_rewritten(offset, len)
    }

    fn piece_bytes(&self, hotzone_bytes: u64) -> Option<u64> {
        Some(piece_bytes(hotzone_bytes))
    }

    fn rekey_lanes_max(&self) -> Option<usize> {
        Some(rekey_lanes_serving())
    }

    fn release(&mut self, done: u64) -> Result<()> {
        self.vol.release_hotzone(done)?;
        // After the last hotzone the rotation ends: no pause.
        if done < self.vol.size() {
            self.pace();
        }
        Ok(())
    }

    fn failed(&mut self) {
        self.vol.break_hotzone();
    }
}

/// The volume's side of the hotzone loop, for a driver that runs the loop somewhere else (the
/// CLI's rotation worker, a process of its own) and relays its [`Serving`] calls here; after
/// the loop finished, [`finish_rotation`] switches the volume to the new side, as [`rotate`]
/// does.
pub fn serving(vol: &Volume) -> impl Serving + '_ {
    Online::new(vol)
}

/// After a hotzone loop relayed through [`serving`] finished: the volume serves the new side
/// alone.
pub fn finish_rotation(vol: &Volume) -> Result<()> {
    vol.end_segments()
}

/// What [`recover_stopped`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Nothing was held and the header records no hotzone: volume and header agree.
    Consistent,
    /// The hotzone `[offset, offset + len)` is consistent again and the volume serves it: the
    /// header recorded it and it was recovered from the resilience data (`recovered`), or the
    /// driver held it before it committed it or after it committed past it. The rotation
    /// resumes at `done` bytes.
    Released {
        offset: u64,
        len: u64,
        recovered: bool,
        done: u64,
    },
    /// The header was finalised (by the driver, or by the recovery of the last hotzone): the
    /// volume serves the new side alone.
    Finished,
    /// The header records the hotzone `[offset, offset + len)` and the reencryption has no
    /// resilience data (`none`): the old data of the hotzone is nowhere and which of its
    /// sectors the driver rewrote is not known, so it is not recovered here. It stays blocked
    /// (requests touching it fail) until the volume is closed and opened again, whose
    /// recovery takes it as rewritten, as cryptsetup's does (data there may be lost).
    Unrecoverable { offset: u64, len: u64 },
}

/// After a rotation of `vol` driven through [`serving`] (or [`rotate`]) stopped before its
/// end, its driver dead or failed: brings the hotzone it held, or the one the header records,
/// to a consistent state with the recovery `repair` and `open` run ([`run::
/// recover_on`], from the resilience data), while the volume serves on. Requests touching
/// the hotzone wait while it is recovered, and are served from the header's state after it;
/// then the rotation can be resumed online ([`rotate`], or a new worker). The header is on
/// the volume's device, or the writable detached `header`. On failure the hotzone held (if
/// any) is left blocked: requests touching it fail until the volume is closed and opened
/// again.
pub fn recover_stopped(
    vol: &Volume,
    header: Option<&dyn Backend>,
    passphrase: &[u8],
) -> Result<Stopped> {
    let r = recover_stopped_inner(vol, header, passphrase);
    if r.is_err() {
        vol.break_hotzone();
    }
    r
}

fn recover_stopped_inner(
    vol: &Volume,
    header: Option<&dyn Backend>,
    passphrase: &[u8],
) -> Result<Stopped> {
    // Not in two segments: the driver stopped before it started, nothing is held.
    let Some(dev) = vol.reencryption_backend() else {
        return Ok(Stopped::Consistent);
    };
    let held = vol.held_hotzone();
    let devs = run::Devices {
        header: header.unwrap_or(dev.as_ref()),
        data: dev.as_ref(),
    };
    let state = match read_header(devs.header)? {
        Header::Luks2(h) => ReencryptState::from_metadata(&h.meta)?,
        Header::Luks1(_) => return Err(bad("LUKS1 has no reencryption")),
    };
    let Some(state) = state else {
        // Finalised after the last hotzone, before its release.
        if let Some((offset, len)) = held {
            vol.fence_hotzone(offset, len)?;
            vol.release_hotzone(vol.size())?;
        }
        vol.end_segments()?;
        return Ok(Stopped::Finished);
    };
    if held.is_none() && !state.needs_recovery() {
        return Ok(Stopped::Consistent);
    }
    // The keys are unlocked before anything is held: requests wait for the recovery's I/O
    // only, not for its key derivation.
    let pending = run::prepare_recovery(devs, passphrase)?;
    let recorded = pending.hotzone();
    let Some((offset, len)) = recorded.or(held) else {
        return Ok(Stopped::Consistent);
    };
    // A data shift commits its hotzone before it holds it: the recorded one is fenced too.
    vol.fence_hotzone(offset, len)?;
    if let Some((offset, len)) = recorded.filter(|_| pending.without_resilience()) {
        vol.break_hotzone();
        return Ok(Stopped::Unrecoverable { offset, len });
    }
    let (done, finished) = pending.done_after();
    pending.run()?;
    vol.release_hotzone(done)?;
    if finished {
        vol.end_segments()?;
        return Ok(Stopped::Finished);
    }
    Ok(Stopped::Released {
        offset,
        len,
        recovered: recorded.is_some(),
        done,
    })
}

/// Rotates the key of `vol` while it serves I/O: the header (on the volume's backend, or the
/// detached `header`, `--header`) must be in reencryption ([`run::init`] started
/// it, or [`open`] opened it so). Each hotzone is rewritten through the volume's backend
/// while only the requests touching it wait; at the end the header is finalised and the
/// volume serves under the new key alone. `progress` is called after each hotzone. A failure
/// inside a hotzone leaves it blocked (requests touching it fail) until [`recover_stopped`]
/// recovers it, or the volume is closed and opened again.
pub fn rotate(
    vol: &Volume,
    header: Option<&dyn Backend>,
    passphrase: &[u8],
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    // The device itself (the volume's own backend may remap a data shift's moved head).
    let dev = vol
        .reencryption_backend()
        .unwrap_or_else(|| vol.backend().clone());
    run::resume_serving(
        run::Devices {
            header: header.unwrap_or(dev.as_ref()),
            data: dev.as_ref(),
        },
        passphrase,
        opts,
        progress,
        &mut Online::new(vol),
    )?;
    vol.end_segments()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_rotation_pauses_only_after_a_hotzone_that_served_requests() {
        let busy = Duration::from_millis(100);
        assert_eq!(
            pause_after(busy, 7, 7),
            Duration::ZERO,
            "no requests, no pause"
        );
        assert_eq!(pause_after(busy, 7, 8), Duration::from_millis(60));
        // A counter that went back (statistics reset meanwhile) counts as requests served.
        assert_eq!(pause_after(busy, 9, 2), Duration::from_millis(60));
        assert_eq!(pause_after(Duration::ZERO, 0, 5), Duration::ZERO);
    }
}
