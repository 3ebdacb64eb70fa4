//! Starting an encryption: with a detached header over data left in place, or with the header
//! put in front of data moved up by half of `--reduce-device-size` (datashift).

use crate::backend::Backend;
use crate::luks::json::U64Str;
use crate::luks::kdf::KdfRequest;
use crate::luks::luks2::digest::free_id;
use crate::luks::reencrypt::plan::{check_layout, position, Position};
use crate::luks::reencrypt::{Direction, Mode};
use crate::luks::util::{random_secret, HashAlg};
use crate::luks::{apply, read_header, NewKeyslot};
use crate::sector::{CipherSpec, SectorSize};
use crate::{Error, Result};

use super::copy_then_wipe;
use super::init::{add_shift_keyslot, reencrypt_area, reencrypt_keyslot, Started};
use super::seal::{add_reencryption_digest, assign_segments, require};
use super::{Devices, ResilienceKind, AREA_ALIGN_BYTES, REDUCE_BYTES_MAX, REQUIREMENT_V2};

/// How to start an encryption of a plaintext device ([`init_encrypt`]).
pub struct EncryptOptions<'a> {
    pub resilience: ResilienceKind,
    /// The checksum of [`ResilienceKind::Checksum`] (`--resilience-hash`).
    pub resilience_hash: HashAlg,
    pub kdf: &'a KdfRequest,
    /// The new segment: cipher, key size in bytes, sector size.
    pub cipher: CipherSpec,
    pub key_bytes: usize,
    pub sector_size: SectorSize,
    /// The new header's UUID.
    pub uuid: String,
    /// The new keyslot's area encryption, a cipher and its key size in bytes
    /// (`--keyslot-cipher`, `--keyslot-key-size`); `None`: the new segment's.
    pub keyslot_area: Option<(CipherSpec, usize)>,
}

/// The message cryptsetup 2.6 refuses an encryption with, without a detached header.
pub const ENCRYPT_NEEDS_DETACHED_HEADER: &str = "Encryption without detached header (--header) \
     is not possible without data device size reduction (--reduce-device-size).";

/// Starts the encryption of the plaintext on `devs.data` in place, with a new detached LUKS2
/// header on `devs.header` (cryptsetup 2.6's `reencrypt --encrypt --header --init-only`): a
/// header with data offset 0 and a new random volume key, a keyslot for the passphrase, a
/// `reencrypt` keyslot with mode `encrypt`, direction `forward`; segments `0` (the whole
/// device, `linear`), `1` backup-previous (`linear`) and `2` backup-final (`crypt`, the new
/// cipher); the new key's digest listing `2`; the requirement and the reencryption digest over
/// the new key alone. The keyslot's material is written and flushed first, then one header
/// write makes the whole header visible: a crash leaves no header (or the old bytes of the
/// header device) or a header in reencryption, never one that calls the plaintext encrypted.
pub fn init_encrypt(
    devs: Devices<'_>,
    passphrase: &[u8],
    opts: &EncryptOptions<'_>,
) -> Result<Started> {
    if !devs.detached() {
        return Err(Error::InvalidArgument(ENCRYPT_NEEDS_DETACHED_HEADER.into()));
    }
    opts.cipher.check_key_len(opts.key_bytes)?;
    let data_bytes = devs.data.size();
    let align = u64::from(opts.sector_size.bytes());
    if data_bytes == 0 || data_bytes % align != 0 {
        return Err(Error::InvalidArgument(format!(
            "Data device is not aligned to encryption sector size ({align} bytes)."
        )));
    }
    let mut f = crate::luks::luks2::FormatLuks2::defaults(opts.uuid.clone());
    f.cipher = opts.cipher;
    f.key_bytes = opts.key_bytes;
    f.sector_size = opts.sector_size;
    f.kdf = opts.kdf.clone();
    f.data_offset = 0;
    f.detached = true;
    // cryptsetup's default keyslots area, or what a smaller header device holds.
    let room =
        devs.header.size().saturating_sub(2 * f.hdr_size) / AREA_ALIGN_BYTES * AREA_ALIGN_BYTES;
    f.keyslots_size = f.keyslots_size.min(room);
    let (mut h, vk) = crate::luks::luks2::format(&f, random_secret(opts.key_bytes)?)?;
    let seqid = h.bin.seqid;
    let area = opts
        .keyslot_area
        .map(|(cipher, bytes)| h.keyslot_area(cipher, bytes))
        .transpose()?;
    let (slot, mut ops) = h.add_keyslot_with_area(
        NewKeyslot {
            vk: &vk,
            passphrase,
            kdf: opts.kdf,
            slot: None,
        },
        None,
        area,
    )?;
    ops.truncate(2); // the material and its flush; the one header write comes below
    h.bin.seqid = seqid;

    let (used_end, end) = reencrypt_area(&h)?;
    let rk = free_id(h.meta.keyslots.keys())?;
    h.meta.keyslots.insert(
        rk.to_string(),
        reencrypt_keyslot(
            Mode::Encrypt,
            Direction::Forward,
            opts.resilience,
            opts.resilience_hash,
            used_end,
            end - used_end,
        ),
    );
    let crypt = h
        .meta
        .segments
        .get("0")
        .cloned()
        .ok_or(Error::Bug("format made no segment 0"))?;
    let linear = |flag: Option<&str>| crate::luks::json::Segment {
        kind: "linear".into(),
        offset: crypt.offset,
        size: crypt.size,
        iv_tweak: None,
        encryption: None,
        sector_size: None,
        flags: flag.map(|f| vec![f.to_string()]),
        integrity: None,
        extra: Default::default(),
    };
    let mut fin = crypt.clone();
    fin.flags = Some(vec!["backup-final".into()]);
    h.meta.segments = std::collections::BTreeMap::from([
        ("0".to_string(), linear(None)),
        ("1".to_string(), linear(Some("backup-previous"))),
        ("2".to_string(), fin),
    ]);
    let new_digest = vk.digest_id();
    assign_segments(
        &mut h.meta,
        new_digest,
        vec!["2".into()],
        "new key digest vanished",
    )?;
    require(&mut h.meta, REQUIREMENT_V2);
    add_reencryption_digest(&mut h.meta, opts.kdf, rk, None, Some(vk.bytes()))?;
    ops.extend(h.commit()?);
    apply(devs.header, &ops)?;
    Ok(Started {
        old_keyslot: slot,
        new_keyslot: Some(slot),
        new_keyslots: Vec::new(),
        reencrypt_keyslot: rk,
    })
}

/// Starts the encryption of the plaintext on `dev` in place with the header in front of the
/// data, as cryptsetup 2.6's `reencrypt --encrypt --reduce-device-size R` (without
/// `--header`) does: the last `R` bytes of the device must be free (the filesystem shrunk by
/// `R`); the data moves by the shift `S = R / 2` (the new data offset), and the data grows by
/// `S` when done. `D = size - R` bytes of plaintext are encrypted.
///
/// The header (a new random volume key, keyslot 0 for the passphrase, a `reencrypt` keyslot
/// with mode `encrypt`, direction `backward`, resilience `datashift` with `shift_size` S over
/// a 4 KiB area; the segments of [`crate::luks::reencrypt::plan::Shift`]: `0` the moved segment
/// (linear at `D + S`, S bytes), `1` the plaintext beyond the first shift at its place
/// (linear at S), then backup-moved-segment, backup-previous (linear at 0, D bytes) and
/// backup-final (crypt at S); the `online-reencrypt-v2` requirement; the reencryption digest
/// over the new key) is what cryptsetup 2.6.1 writes (compared field by field in the
/// interop test).
///
/// Writes, in order: the first S bytes of plaintext copied to the moved segment (free
/// space), flush; the header area's keyslots area filled with random bytes (it held that
/// plaintext, as cryptsetup's header restore overwrites it); the keyslot's material, flush;
/// the header. A crash before the header's commit leaves no header, the plaintext beyond the
/// first shift untouched and its first shift in the moved segment.
pub fn init_encrypt_shift(
    dev: &dyn Backend,
    passphrase: &[u8],
    opts: &EncryptOptions<'_>,
    reduce_bytes: u64,
) -> Result<Started> {
    let (shift, data_bytes) = shift_sizes(dev, opts, reduce_bytes)?;
    let mut f = crate::luks::luks2::FormatLuks2::defaults(opts.uuid.clone());
    f.cipher = opts.cipher;
    f.key_bytes = opts.key_bytes;
    f.sector_size = opts.sector_size;
    f.kdf = opts.kdf.clone();
    f.data_offset = shift;
    // As cryptsetup: the keyslots area is what the shift leaves after the two copies.
    f.keyslots_size = shift
        .checked_sub(2 * f.hdr_size)
        .filter(|&n| n >= AREA_ALIGN_BYTES)
        .ok_or_else(|| {
            Error::InvalidArgument("LUKS2 metadata size is larger than data shift value.".into())
        })?
        / AREA_ALIGN_BYTES
        * AREA_ALIGN_BYTES;
    let (mut h, vk) = crate::luks::luks2::format(&f, random_secret(opts.key_bytes)?)?;
    let seqid = h.bin.seqid;
    let area = opts
        .keyslot_area
        .map(|(cipher, bytes)| h.keyslot_area(cipher, bytes))
        .transpose()?;
    let (slot, mut ops) = h.add_keyslot_with_area(
        NewKeyslot {
            vk: &vk,
            passphrase,
            kdf: opts.kdf,
            slot: None,
        },
        None,
        area,
    )?;
    ops.truncate(2); // the material and its flush; the one header write comes below
    h.bin.seqid = seqid;

    let rk = add_shift_keyslot(&mut h, Mode::Encrypt, shift)?;
    let crypt = h
        .meta
        .segments
        .get("0")
        .cloned()
        .ok_or(Error::Bug("format made no segment 0"))?;
    let segs = shift_segments(crypt, data_bytes, shift);
    let final_id = segs.len() - 1;
    h.meta.segments = segs
        .into_iter()
        .enumerate()
        .map(|(i, s)| (i.to_string(), s))
        .collect();
    let new_digest = vk.digest_id();
    let final_seg = vec![final_id.to_string()];
    assign_segments(
        &mut h.meta,
        new_digest,
        final_seg,
        "new key digest vanished",
    )?;
    require(&mut h.meta, REQUIREMENT_V2);
    let st = add_reencryption_digest(&mut h.meta, opts.kdf, rk, None, Some(vk.bytes()))?;
    // What is written is what the planner reads back: the start of the walk.
    check_layout(&h.meta, &st, data_bytes)?;
    if position(&h.meta, &st, data_bytes)?
        != (Position {
            done: 0,
            hotzone: None,
        })
    {
        return Err(Error::Bug("a new data shift does not start at the end"));
    }
    ops.extend(h.commit()?);
    let hdr_end = 2 * h.bin.hdr_size;
    let moved_offset = data_bytes + shift;
    copy_then_wipe(dev, 0, moved_offset, shift, (hdr_end, shift - hdr_end))?;
    apply(dev, &ops)?;
    Ok(Started {
        old_keyslot: slot,
        new_keyslot: Some(slot),
        new_keyslots: Vec::new(),
        reencrypt_keyslot: rk,
    })
}

/// The shift `S = reduce_bytes / 2` and the bytes of plaintext `D` of an encryption that puts
/// the header in front of the data on `dev`, checked as cryptsetup checks them (and `dev`
/// holds no LUKS header).
fn shift_sizes(
    dev: &dyn Backend,
    opts: &EncryptOptions<'_>,
    reduce_bytes: u64,
) -> Result<(u64, u64)> {
    if reduce_bytes == 0 || reduce_bytes % 512 != 0 {
        return Err(Error::InvalidArgument(
            "Reduce size must be multiple of 512 bytes sector.".into(),
        ));
    }
    if reduce_bytes > REDUCE_BYTES_MAX {
        return Err(Error::InvalidArgument(
            "Maximum device reduce size is 1 GiB.".into(),
        ));
    }
    opts.cipher.check_key_len(opts.key_bytes)?;
    if read_header(dev).is_ok() {
        return Err(Error::InvalidArgument(
            "Device is already LUKS device. Aborting operation.".into(),
        ));
    }
    let shift = reduce_bytes / 2;
    let ss = u64::from(opts.sector_size.bytes());
    if shift % ss != 0 {
        return Err(Error::InvalidArgument(format!(
            "Data shift value is not aligned to encryption sector size ({ss} bytes)."
        )));
    }
    let dev_bytes = dev.size();
    // At least one shift of data: cryptsetup 2.6.1 starts with less, but its first hotzone
    // then reads past the moved segment (a layout ucrypt does not take).
    let data_bytes = dev_bytes
        .checked_sub(reduce_bytes)
        .filter(|&d| d >= shift)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "Device is too small: {dev_bytes} bytes hold less than one shift ({shift} \
                 bytes) of data besides the {reduce_bytes} bytes of --reduce-device-size."
            ))
        })?;
    if data_bytes % ss != 0 {
        return Err(Error::InvalidArgument(format!(
            "Data device is not aligned to encryption sector size ({ss} bytes)."
        )));
    }
    Ok((shift, data_bytes))
}

/// The segments of a data shift of `data_bytes` by `shift`, in cryptsetup's order: the moved
/// segment (linear at `D + S`), the plaintext beyond the first shift at its place (if any),
/// backup-moved-segment, backup-previous (linear at 0) and backup-final (`crypt`, the new
/// segment, last).
fn shift_segments(
    crypt: crate::luks::json::Segment,
    data_bytes: u64,
    shift: u64,
) -> Vec<crate::luks::json::Segment> {
    let linear = |offset: u64, size: u64, flag: Option<&str>| crate::luks::json::Segment {
        kind: "linear".into(),
        offset: U64Str(offset),
        size: crate::luks::json::SegmentSize::Bytes(size),
        iv_tweak: None,
        encryption: None,
        sector_size: None,
        flags: flag.map(|f| vec![f.to_string()]),
        integrity: None,
        extra: Default::default(),
    };
    let moved_offset = data_bytes + shift;
    let mut segs = vec![linear(moved_offset, shift, None)];
    if data_bytes > shift {
        segs.push(linear(shift, data_bytes - shift, None));
    }
    segs.push(linear(moved_offset, shift, Some("backup-moved-segment")));
    segs.push(linear(0, data_bytes, Some("backup-previous")));
    let mut fin = crypt;
    fin.flags = Some(vec!["backup-final".into()]);
    segs.push(fin);
    segs
}
