//! A reencryption's keys and state once unlocked (`Unlocked`), and opening a rotation: every
//! key the protocol names checked against the reencryption digest, the ciphers of both sides.

use crate::backend::Backend;
use crate::engine::crew::Crew;
use crate::luks::json::Metadata;
use crate::luks::json::SegmentKind;
use crate::luks::reencrypt::plan::{
    bounded_data_bytes, check_layout, check_supported, relocate_geometry, shift_geometry,
    unshift_geometry, Movement, Protect,
};
use crate::luks::reencrypt::{digest_of_segment, ReencryptState};
use crate::luks::{read_area, read_header, unlock, Header, Luks2Header, VolumeKey};
use crate::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use crate::{Error, Result};

use super::resilience::switch_resilience;
use super::{bad, luks2, Devices, ResilienceAsked, HOTZONE_BYTES_MAX, REKEY_LANES_MAX};
use crate::luks::apply;
use crate::luks::reencrypt::plan::Position;

/// A volume in rotation, unlocked: header, state, both keys checked against the
/// reencryption digest.
pub(super) struct Unlocked {
    pub(super) h: Luks2Header,
    pub(super) st: ReencryptState,
    pub(super) protect: Protect,
    /// One (old, new) cipher pair per worker thread, keyed once; `None` for a linear
    /// (plaintext) side: the old one of an encryption, the new one of a decryption.
    pub(super) lanes: Vec<Lane>,
    /// The threads of every lane but the first, started when the hotzones start
    /// ([`run_hotzones`]); `None` before, and with one lane.
    pub(super) crew: Option<Crew>,
    /// Where the data is read (backup-previous's offset) and written (backup-final's): the
    /// same but for a data shift.
    pub(super) data_offset: u64,
    pub(super) new_offset: u64,
    pub(super) data_bytes: u64,
    pub(super) align: u64,
    /// How the data moves: in place, shifted up ([`Shift`]) or back ([`Unshift`]).
    pub(super) movement: Movement,
    /// The new cipher, volume key and sector size, for a volume that serves the data
    /// meanwhile ([`Serving::start`]); `None` for a decryption (the new side is linear).
    pub(super) new_key: Option<NewKey>,
}

/// The new side of a reencryption, for a volume that serves the data meanwhile.
pub(super) type NewKey = (CipherSpec, crate::SecretBytes, SectorSize);

/// The ciphers of one worker thread.
pub(super) type Lane = (Option<SectorCipher>, Option<SectorCipher>);

/// How a step spreads over threads: its lanes, and the crew that runs all but the first
/// ([`share_out`]; scoped threads without one).
#[derive(Clone, Copy)]
pub(super) struct Spread<'a> {
    pub(super) lanes: usize,
    pub(super) crew: Option<&'a Crew>,
}

impl Unlocked {
    /// Commits the segments of `pos`: the header says the reencryption is there.
    pub(super) fn commit(&mut self, dev: &dyn Backend, pos: Position) -> Result<()> {
        self.movement
            .set_segments(&mut self.h.meta, &mut self.st, pos, self.data_bytes)?;
        let ops = self.h.commit()?;
        apply(dev, &ops)
    }

    pub(super) fn spread(&self) -> Spread<'_> {
        Spread {
            lanes: self.lanes.len(),
            crew: self.crew.as_ref(),
        }
    }
}

pub(crate) fn unlock_digest(
    dev: &dyn Backend,
    hdr: &Header,
    meta: &Metadata,
    did: u32,
    passphrase: &[u8],
) -> Result<VolumeKey> {
    let slots = meta
        .digests
        .get(&did.to_string())
        .map(|d| d.keyslots.clone())
        .unwrap_or_default();
    let mut read = |offset: u64, len: u64| read_area(dev, offset, len);
    let mut last = Error::NoUsableKeyslot;
    for s in slots.iter().filter_map(|s| s.parse::<u32>().ok()) {
        match unlock(hdr, passphrase, Some(s), &mut read) {
            Ok((_, vk)) => return Ok(vk),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The cipher of segment `seg` (`None` for a linear one, with no key), its offset and its
/// sector size (512 for linear, as cryptsetup counts it).
pub(super) fn cipher_of(
    meta: &Metadata,
    seg: u32,
    key: Option<&VolumeKey>,
) -> Result<(Option<SectorCipher>, u64, u64)> {
    let s = meta
        .segments
        .get(&seg.to_string())
        .ok_or_else(|| bad(format!("segment {seg} missing")))?;
    let key = match (&s.kind, key) {
        (SegmentKind::Linear, None) => return Ok((None, s.offset.0, 512)),
        (SegmentKind::Crypt, Some(k)) => k,
        (kind, k) => {
            return Err(bad(format!(
                "segment {seg} of type {kind} with{} a key",
                if k.is_some() { "" } else { "out" }
            )))
        }
    };
    let spec = s
        .encryption
        .as_deref()
        .ok_or_else(|| bad("crypt segment lacks encryption"))?
        .parse()?;
    let ss = SectorSize::new(u64::from(s.sector_size.unwrap_or(512)))?;
    let geometry = Geometry {
        sector_size: ss,
        iv_offset: s.iv_tweak.map_or(0, |v| v.0),
        iv_large_sectors: false,
    };
    Ok((
        Some(SectorCipher::new(spec, key.bytes(), geometry)?),
        s.offset.0,
        u64::from(ss.bytes()),
    ))
}

/// How far a reencryption in place walks.
#[derive(Clone, Copy, Debug)]
pub(super) enum Extent {
    /// As far as the header says (its bound, if it records one): a repair.
    Header,
    /// A run: `--device-size` when given (a header that records a bound must record that
    /// one, [`in_place_bytes`]); without it the whole data area, past a bound the header
    /// records, as cryptsetup's `--resume-only` does.
    Run(Option<u64>),
}

/// Opens the reencryption on `devs` with `passphrase`, switching its resilience to `asked`;
/// `extent`: how far it walks.
pub(super) fn open_rotation(
    devs: Devices<'_>,
    passphrase: &[u8],
    asked: Option<ResilienceAsked>,
    extent: Extent,
) -> Result<Unlocked> {
    let device_size = match extent {
        Extent::Header => None,
        Extent::Run(n) => n,
    };
    let dev = devs.header;
    let header = read_header(dev)?;
    let hdr_any = header.clone();
    let mut h = luks2(header)?;
    let mut st = ReencryptState::from_metadata(&h.meta)?.ok_or_else(|| {
        Error::InvalidArgument("the device is not in reencryption (nothing to resume)".into())
    })?;
    let mut protect = check_supported(&st)?;
    let d_old = digest_of_segment(&h.meta, st.backup_previous);
    let d_new = digest_of_segment(&h.meta, st.backup_final);
    let new_vk = d_new
        .map(|d| unlock_digest(dev, &hdr_any, &h.meta, d, passphrase))
        .transpose()?;
    let old_vk = match (d_old, &new_vk) {
        // `--keep-key`: one digest over both segments, its keyslot unlocked once.
        (Some(d), Some(k)) if d_new == Some(d) => Some(k.duplicate()),
        (Some(d), _) => Some(unlock_digest(dev, &hdr_any, &h.meta, d, passphrase)?),
        (None, _) => None,
    };
    h.verify_reencrypt_digest(old_vk.as_ref(), new_vk.as_ref())?;
    if let Some(asked) = asked {
        let keys = (old_vk.as_ref(), new_vk.as_ref());
        if switch_resilience(dev, &mut h, &mut st, asked, keys)? {
            protect = check_supported(&st)?;
        }
    }
    let (old, off_old, ss_old) = cipher_of(&h.meta, st.backup_previous, old_vk.as_ref())?;
    let (new, off_new, ss_new) = cipher_of(&h.meta, st.backup_final, new_vk.as_ref())?;
    let new_key = new.as_ref().zip(new_vk.as_ref()).map(|(c, k)| {
        let ss = c.geometry().sector_size;
        (c.spec(), crate::SecretBytes::from_slice(k.bytes()), ss)
    });
    let shift = shift_geometry(&h.meta, &st)?;
    let relocate = relocate_geometry(&h.meta, &st)?;
    let align = ss_old.max(ss_new);
    let data_bytes = match shift {
        Some(sh) => {
            // The moved segment must be on the device, and the data a whole number of
            // sectors (cryptsetup checks both at init).
            sh.check_device(devs.data.size())?;
            if sh.data_bytes % align != 0 || sh.shift_bytes % align != 0 {
                return Err(bad(format!(
                    "data of {} bytes shifted by {} is not aligned to {align}-byte sectors",
                    sh.data_bytes, sh.shift_bytes
                )));
            }
            sh.data_bytes
        }
        None if relocate.is_some() => {
            // The data is what the device holds past the new data offset: the old data
            // area's last shift is dropped.
            let n = devs
                .data
                .size()
                .checked_sub(off_new)
                .filter(|&n| n >= align)
                .ok_or_else(|| bad("the device ends before the new data offset"))?;
            n / align * align
        }
        None => {
            if off_old != off_new && !matches!(protect, Protect::Unshift(_)) {
                return Err(Error::UnsupportedLuks(
                    "reencryption that moves the data other than an encryption with the \
                     header in front (ucrypt reencrypts in place)"
                        .into(),
                ));
            }
            let seg = &h.meta.segments[&st.backup_previous.to_string()];
            let n = match seg.size {
                crate::luks::json::SegmentSize::Bytes(n) => n,
                crate::luks::json::SegmentSize::Dynamic => devs
                    .data
                    .size()
                    .checked_sub(off_old)
                    .ok_or_else(|| bad("the device ends before its data offset"))?,
            };
            n / align * align
        }
    };
    let moves = shift.is_some() || relocate.is_some() || matches!(protect, Protect::Unshift(_));
    if device_size.is_some() && moves {
        return Err(Error::InvalidArgument(
            "reencrypt --device-size with a reencryption that moves the data is not supported \
             by ucrypt (cryptsetup refuses it with --reduce-device-size)"
                .into(),
        ));
    }
    let area_bytes = data_bytes;
    let (mut data_bytes, mut bounded) = match (shift, relocate) {
        (None, None) => in_place_bytes(&h.meta, &st, protect, data_bytes, align, device_size)?,
        _ => (data_bytes, false),
    };
    let mut movement = match (shift, relocate) {
        (Some(sh), _) => Movement::Shift(sh),
        (None, Some(r)) => Movement::Relocate(r),
        (None, None) => match unshift_geometry(&h.meta, &st, data_bytes)? {
            Some(us) => Movement::Unshift(us),
            None => Movement::InPlace { bounded },
        },
    };
    if let Movement::Unshift(us) = movement {
        us.check_device(devs.data.size())?;
        // The moved segment's hotzone is rewritten in place from one buffer.
        if us.moved_bytes > HOTZONE_BYTES_MAX {
            return Err(Error::UnsupportedLuks(format!(
                "a moved segment of {} bytes (ucrypt's hotzone buffer holds at most {})",
                us.moved_bytes, HOTZONE_BYTES_MAX
            )));
        }
    }
    check_layout(&h.meta, &st, data_bytes)?;
    if bounded && matches!(extent, Extent::Run(None)) {
        // Checked against its bound, the header is walked on past it: the next hotzone's
        // header writes the segments of the whole area.
        (data_bytes, bounded) = (area_bytes, false);
        movement = Movement::InPlace { bounded };
    }
    let n = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, REKEY_LANES_MAX);
    let mut lanes = Vec::with_capacity(n);
    for _ in 1..n {
        lanes.push((
            old.as_ref().map(SectorCipher::try_clone).transpose()?,
            new.as_ref().map(SectorCipher::try_clone).transpose()?,
        ));
    }
    lanes.push((old, new));
    Ok(Unlocked {
        h,
        st,
        protect,
        lanes,
        crew: None,
        data_offset: off_old,
        new_offset: off_new,
        data_bytes,
        align,
        movement,
        new_key,
    })
}

/// The bytes a reencryption in place walks, and whether that bounds it short of the
/// `area_bytes` of the data area, as cryptsetup 2.6.1 decides: `--device-size` (`asked`)
/// bounds a walk whose header does not, if it is a whole number of alignment units (the
/// larger sector size, and the checksum block) and no longer than the data area; a header
/// bounded already ([`bounded_data_bytes`]) keeps its bound, and `--device-size` must then
/// be that bound.
fn in_place_bytes(
    meta: &Metadata,
    st: &ReencryptState,
    protect: Protect,
    area_bytes: u64,
    align: u64,
    asked: Option<u64>,
) -> Result<(u64, bool)> {
    let illegal = || {
        Error::InvalidArgument("Illegal device size requested in reencryption parameters.".into())
    };
    let has = bounded_data_bytes(meta).filter(|&b| b < area_bytes);
    let bytes = match (asked, has) {
        (None, None) => return Ok((area_bytes, false)),
        (None, Some(b)) => b,
        (Some(n), Some(b)) if n != b => return Err(illegal()),
        (Some(n), _) => n,
    };
    let zone = match protect {
        Protect::Checksum { block, .. } => align.max(u64::from(block)),
        _ => align,
    };
    if bytes % zone != 0 {
        return Err(Error::InvalidArgument(format!(
            "Device size must be multiple of calculated zone alignment ({zone} bytes)."
        )));
    }
    if bytes == 0 || bytes > area_bytes {
        return Err(illegal());
    }
    // Past what is done already (cryptsetup's minimal size: the fixed segments before the
    // dynamic one, and one sector of it).
    match crate::luks::reencrypt::plan::position(meta, st, bytes) {
        Ok(pos) if pos.done < bytes => {}
        _ => return Err(illegal()),
    }
    Ok((bytes, bytes < area_bytes))
}
