//! Starting a decryption that moves the data back to offset 0 and exports the header in front
//! to a detached file (datashift-checksum or datashift-journal, requirement v3).

use crate::luks::json::KeyslotKind;
use crate::luks::json::{CryptSegment, Metadata, U64Str};
use crate::luks::kdf::KdfRequest;
use crate::luks::luks2::digest::free_id;
use crate::luks::reencrypt::plan::{check_layout, position, unshift_geometry, Position};
use crate::luks::reencrypt::{Direction, Mode, ReencryptState};
use crate::luks::util::HashAlg;
use crate::luks::{apply, read_area, read_header, unlock, Header, Luks2Header};
use crate::{Error, Result};

use super::copy_across;
use super::init::{reencrypt_area, reencrypt_keyslot, Started};
use super::seal::{add_reencryption_digest, assign_segments, require};
use super::{
    luks2, Devices, ResilienceKind, CHECKSUM_BLOCK_BYTES, HOTZONE_BYTES_MAX, REQUIREMENT_V3,
};

/// The moved segment of a decryption that moves the data, unless `--hotzone-size` says
/// otherwise: the shift, at most this (cryptsetup 2.6's `LUKS2_DEFAULT_NONE_REENCRYPTION_LENGTH`,
/// 20 MiB), at most the data.
pub const MOVED_BYTES_DEFAULT: u64 = 20 << 20;

/// How to start a decryption that moves the data back ([`init_decrypt_unshift`]).
pub struct UnshiftOptions<'a> {
    /// Whether the reencryption digest is calibrated (forced iterations use the minimum).
    pub kdf: &'a KdfRequest,
    /// The keyslot the passphrase opens (`--key-slot`); without it the volume must have
    /// exactly one keyslot.
    pub key_slot: Option<u32>,
    /// `--hotzone-size`: the moved segment's size (at most the shift); `None`:
    /// [`MOVED_BYTES_DEFAULT`] or less.
    pub moved_bytes: Option<u64>,
    /// How the moved segment's hotzone is protected: [`ResilienceKind::Checksum`]
    /// (`datashift-checksum`, cryptsetup's default) or [`ResilienceKind::Journal`]
    /// (`datashift-journal`: its old ciphertext copied to the reencrypt keyslot's area, which
    /// must hold the whole moved segment); `None` is refused, as cryptsetup refuses it.
    pub resilience: ResilienceKind,
    /// The checksum of the moved segment (`--resilience-hash`).
    pub resilience_hash: HashAlg,
}

/// Bytes zeroed over each binary header copy left on the data device (a whole 512-byte
/// sector holding the magic), so that nothing finds a LUKS header there once the data is
/// moved: cryptsetup wipes the signatures too before it moves anything.
pub(super) const MAGIC_WIPE_BYTES: usize = 512;

/// Starts the decryption of the LUKS2 volume whose header is in front of its data on
/// `devs.data`, moving the plaintext to the start of the device, as cryptsetup 2.6's
/// `reencrypt --decrypt --header NEW.hdr` does when NEW.hdr does not exist: the header is
/// exported to `devs.header` (a new file of at least the metadata and keyslots area) and
/// carries the reencryption from then on; the walk is [`crate::luks::reencrypt::plan::Unshift`]'s.
///
/// The exported header, as cryptsetup 2.6.1 writes it (compared field by field in the interop
/// test): the old header, plus a `reencrypt` keyslot (mode `decrypt`, direction `forward`,
/// area `datashift-checksum` with sha256 (or `--resilience-hash`) over 4096-byte blocks and `shift_size` = the old data
/// offset `S`, over the rest of the keyslots area); segments `0` crypt at 0 (the moved
/// segment: `M` bytes, IV tweak 0), `1` crypt at `S + M` (the rest of the ciphertext, IV tweak
/// `M / 512`, dynamic), `2` backup-moved-segment (as `0`), `3` backup-previous (crypt at `S`,
/// dynamic), `4` backup-final (linear at 0, dynamic); the old key's digest listing 0-3; the
/// `online-reencrypt-v3` requirement; the reencryption digest (version 3) over the old key.
///
/// Everything is checked before the first write. Writes, in order: the old header and
/// keyslots area copied to `devs.header`, flushed (from here the volume opens with the new
/// file as its detached header); the magic of both header copies on the data device zeroed;
/// the ciphertext of the first `M` bytes copied over the header (the moved segment), flushed;
/// the new header committed. A crash before that commit leaves the data at its place and a
/// plain detached header describing it.
pub fn init_decrypt_unshift(
    devs: Devices<'_>,
    passphrase: &[u8],
    opts: &UnshiftOptions<'_>,
) -> Result<Started> {
    if !devs.detached() {
        return Err(Error::InvalidArgument(
            "a decryption that moves the data exports the header to a new file (--header)".into(),
        ));
    }
    let header = read_header(devs.data)?;
    header.check_requirements()?;
    let mut h = luks2(header)?;
    let seg = unshiftable_segment(&h, opts)?;
    let s = seg.offset_bytes;
    let hdr_any = Header::Luks2(h.clone());
    let mut read = |offset: u64, len: u64| read_area(devs.data, offset, len);
    let (old_slot, old_vk) = unlock(&hdr_any, passphrase, opts.key_slot, &mut read)?;
    let UnshiftSizes {
        data_bytes,
        moved_bytes,
        meta_bytes,
    } = unshift_sizes(devs, &h, &seg, opts)?;
    let rk = add_datashift_keyslot(&mut h, opts, s, moved_bytes)?;

    let segs = unshift_segments(&seg, data_bytes, moved_bytes);
    let old_list: Vec<String> = (0..segs.len() - 1).map(|i| i.to_string()).collect();
    h.meta.segments = segs
        .into_iter()
        .enumerate()
        .map(|(i, s)| (i.to_string(), s))
        .collect();
    let old_digest = old_vk.digest_id();
    assign_segments(&mut h.meta, old_digest, old_list, "old key digest vanished")?;
    require(&mut h.meta, REQUIREMENT_V3);
    let st = add_reencryption_digest(&mut h.meta, opts.kdf, rk, Some(old_vk.bytes()), None)?;
    check_unshift_start(&h.meta, &st, data_bytes, moved_bytes)?;
    let ops = h.commit()?;

    copy_across(devs.data, 0, devs.header, 0, meta_bytes)?;
    devs.header.flush()?;
    let zeros = [0u8; MAGIC_WIPE_BYTES];
    for copy in [0, h.bin.hdr_size] {
        devs.data.write_at(&zeros, copy)?;
    }
    copy_across(devs.data, s, devs.data, 0, moved_bytes)?;
    devs.data.flush()?;
    apply(devs.header, &ops)?;
    Ok(Started {
        old_keyslot: old_slot,
        new_keyslot: None,
        new_keyslots: Vec::new(),
        reencrypt_keyslot: rk,
    })
}

/// The one crypt segment of a volume whose data can be moved back over its header: the only
/// segment, IV tweak 0, past a header in front, running to the end of the device; without
/// `--key-slot` the volume must have one LUKS2 keyslot.
fn unshiftable_segment(h: &Luks2Header, opts: &UnshiftOptions<'_>) -> Result<CryptSegment> {
    let seg = h.meta.crypt_segment()?;
    if h.meta.segments.len() != 1 || seg.iv_tweak != 0 {
        return Err(Error::UnsupportedLuks(
            "a decryption that moves the data of a volume with more than one segment or an \
             IV tweak"
                .into(),
        ));
    }
    if seg.offset_bytes == 0 {
        return Err(Error::InvalidArgument(
            "the data starts at offset 0: there is no header in front to move it over".into(),
        ));
    }
    let crate::luks::json::SegmentSize::Dynamic = seg.size else {
        return Err(Error::UnsupportedLuks(
            "a decryption that moves the data of a segment with a fixed size (ucrypt moves a \
             segment that runs to the end of the device)"
                .into(),
        ));
    };
    let luks2_slots = h
        .meta
        .keyslots
        .values()
        .filter(|k| k.kind == KeyslotKind::Luks2)
        .count();
    if opts.key_slot.is_none() && luks2_slots != 1 {
        return Err(Error::InvalidArgument(
            "Key file can be used only with --key-slot or with exactly one key slot active.".into(),
        ));
    }
    Ok(seg)
}

/// The sizes of a decryption that moves the data back.
struct UnshiftSizes {
    /// The data past the old data offset, in whole sectors.
    data_bytes: u64,
    /// The moved segment.
    moved_bytes: u64,
    /// The metadata and keyslots area exported to the new header.
    meta_bytes: u64,
}

/// The data, moved segment and metadata sizes for the segment `seg` of `h`, checked: the
/// moved segment is aligned, at most the shift and ucrypt's hotzone buffer; the metadata
/// fits in front of the data and in the new header device.
fn unshift_sizes(
    devs: Devices<'_>,
    h: &Luks2Header,
    seg: &CryptSegment,
    opts: &UnshiftOptions<'_>,
) -> Result<UnshiftSizes> {
    let s = seg.offset_bytes;
    let ss = u64::from(seg.sector_size.bytes());
    let data_bytes = devs.data.size().saturating_sub(s) / ss * ss;
    if data_bytes == 0 {
        return Err(Error::InvalidArgument(format!(
            "Device is too small: no data past the data offset {s}."
        )));
    }
    // Every hotzone is a whole number of checksum blocks and sectors (cryptsetup's zone
    // alignment, 4096 bytes on files for both sector sizes in cryptsetup 2.6.1).
    let align = ss.max(u64::from(CHECKSUM_BLOCK_BYTES));
    let moved_bytes = match opts.moved_bytes {
        Some(m) if m > s => {
            return Err(Error::InvalidArgument(
                "Moved segment size can not be greater than data shift value.".into(),
            ))
        }
        Some(m) => m,
        None => s.min(MOVED_BYTES_DEFAULT),
    }
    .min(data_bytes);
    if moved_bytes == 0 || moved_bytes % align != 0 || s % align != 0 {
        return Err(Error::InvalidArgument(format!(
            "Hotzone size must be multiple of calculated zone alignment ({align} bytes)."
        )));
    }
    if moved_bytes > HOTZONE_BYTES_MAX {
        return Err(Error::InvalidArgument(format!(
            "A moved segment of {moved_bytes} bytes is larger than ucrypt's hotzone buffer \
             ({HOTZONE_BYTES_MAX} bytes): give a smaller --hotzone-size."
        )));
    }
    let meta_bytes = 2 * h.bin.hdr_size + h.meta.config.keyslots_size.0;
    if meta_bytes > s {
        return Err(Error::BadHeader {
            check: "reencrypt-datashift",
            detail: format!("the metadata ({meta_bytes} bytes) runs past the data offset {s}"),
        });
    }
    if devs.header.size() < meta_bytes {
        return Err(Error::InvalidArgument(format!(
            "The header device holds {} bytes, the header to export {meta_bytes}.",
            devs.header.size()
        )));
    }
    Ok(UnshiftSizes {
        data_bytes,
        moved_bytes,
        meta_bytes,
    })
}

/// Adds the reencrypt keyslot, datashift-checksum (or -journal) with `shift_size` `shift`
/// over the rest of the keyslots area, which must hold the moved segment's checksums (or
/// the moved segment); returns its id.
fn add_datashift_keyslot(
    h: &mut Luks2Header,
    opts: &UnshiftOptions<'_>,
    shift: u64,
    moved_bytes: u64,
) -> Result<u32> {
    let (used_end, end) = reencrypt_area(h)?;
    let area_bytes = end - used_end;
    let (room, kind) = match opts.resilience {
        ResilienceKind::Checksum => (
            area_bytes / opts.resilience_hash.output_bytes() as u64
                * u64::from(CHECKSUM_BLOCK_BYTES),
            "datashift-checksum",
        ),
        ResilienceKind::Journal => (area_bytes, "datashift-journal"),
        // cryptsetup 2.6.1's words.
        ResilienceKind::None => {
            return Err(Error::InvalidArgument(
                "Requested --resilience option cannot be applied to current reencryption \
                 operation."
                    .into(),
            ))
        }
    };
    if moved_bytes > room {
        return Err(Error::InvalidArgument(format!(
            "Moved segment too large. Requested size {moved_bytes}, available space for: \
             {room}."
        )));
    }
    let rk = free_id(h.meta.keyslots.keys())?;
    let mut ks = reencrypt_keyslot(
        Mode::Decrypt,
        Direction::Forward,
        opts.resilience,
        opts.resilience_hash,
        used_end,
        area_bytes,
    );
    if let Some(a) = ks.area.as_mut() {
        a.kind = kind.into();
        a.extra
            .insert("shift_size".into(), shift.to_string().into());
    }
    h.meta.keyslots.insert(rk.to_string(), ks);
    Ok(rk)
}

/// The segments, in cryptsetup's order at init: the moved segment, the rest of the
/// ciphertext at its place (if any), then backup-moved-segment, backup-previous,
/// backup-final (linear at 0).
fn unshift_segments(
    seg: &CryptSegment,
    data_bytes: u64,
    moved_bytes: u64,
) -> Vec<crate::luks::json::Segment> {
    let s = seg.offset_bytes;
    let crypt = |offset: u64, size: crate::luks::json::SegmentSize, iv: u64, flag: Option<&str>| {
        crate::luks::json::Segment {
            kind: "crypt".into(),
            offset: U64Str(offset),
            size,
            iv_tweak: Some(U64Str(iv)),
            encryption: Some(seg.cipher.to_string()),
            sector_size: Some(seg.sector_size.bytes()),
            flags: flag.map(|f| vec![f.to_string()]),
            integrity: None,
            extra: Default::default(),
        }
    };
    let moved = crate::luks::json::SegmentSize::Bytes(moved_bytes);
    let dynamic = crate::luks::json::SegmentSize::Dynamic;
    let mut segs = vec![crypt(0, moved, 0, None)];
    if data_bytes > moved_bytes {
        segs.push(crypt(s + moved_bytes, dynamic, moved_bytes / 512, None));
    }
    segs.push(crypt(0, moved, 0, Some("backup-moved-segment")));
    segs.push(crypt(s, dynamic, 0, Some("backup-previous")));
    segs.push(crate::luks::json::Segment {
        kind: "linear".into(),
        offset: U64Str(0),
        size: dynamic,
        iv_tweak: None,
        encryption: None,
        sector_size: None,
        flags: Some(vec!["backup-final".into()]),
        integrity: None,
        extra: Default::default(),
    });
    segs
}

/// Checks that what is written is what the planner reads back: the start of the walk, with
/// the moved segment of `moved_bytes`.
fn check_unshift_start(
    meta: &Metadata,
    st: &ReencryptState,
    data_bytes: u64,
    moved_bytes: u64,
) -> Result<()> {
    let geometry = unshift_geometry(meta, st, data_bytes)?.ok_or(Error::Bug(
        "a new decryption that moves the data is not one",
    ))?;
    check_layout(meta, st, data_bytes)?;
    if position(meta, st, data_bytes)?
        != (Position {
            done: 0,
            hotzone: None,
        })
        || geometry.moved_bytes != moved_bytes
    {
        return Err(Error::Bug(
            "a new decryption that moves the data does not start",
        ));
    }
    Ok(())
}
