//! The fixed 4096-byte binary part of a LUKS2 header copy, its checksum, and reading one
//! copy (binary header + JSON area) from the device's first bytes with every check applied.

use super::bad;
use crate::luks::json::Metadata;
use crate::luks::util::{c_string, put_c_string, HashAlg};
use crate::luks::{BIN_HDR_BYTES, HDR2_OFFSETS};
use crate::{Error, Result};

pub const MAGIC_1ST: &[u8; 6] = b"LUKS\xba\xbe";
pub const MAGIC_2ND: &[u8; 6] = b"SKUL\xba\xbe";
/// Header copy sizes (binary header + JSON area) cryptsetup supports: 16 KiB .. 4 MiB.
pub const HDR_SIZES: [u64; 9] = HDR2_OFFSETS;

/// The fixed 4096-byte binary part of one header copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinHeader {
    pub hdr_size: u64,
    pub seqid: u64,
    pub label: String,
    pub checksum_alg: String,
    pub salt: [u8; 64],
    pub uuid: String,
    pub subsystem: String,
    pub hdr_offset: u64,
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// The magic a primary or secondary copy starts with.
fn magic_of(secondary: bool) -> &'static [u8; 6] {
    if secondary {
        MAGIC_2ND
    } else {
        MAGIC_1ST
    }
}

impl BinHeader {
    /// Decodes the binary header found at `offset` (magic must be the copy's own).
    pub fn decode(b: &[u8], secondary: bool) -> Result<BinHeader> {
        if b.len() < BIN_HDR_BYTES as usize {
            return Err(bad("truncated", "device too small for a LUKS2 header"));
        }
        if !b.starts_with(magic_of(secondary)) {
            return Err(Error::NotLuks(format!(
                "no {} LUKS2 magic",
                if secondary { "secondary" } else { "primary" }
            )));
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 2 {
            return Err(bad("version", format!("version {version}, expected 2")));
        }
        let mut salt = [0u8; 64];
        salt.copy_from_slice(&b[104..168]);
        Ok(BinHeader {
            hdr_size: be64(b, 8),
            seqid: be64(b, 16),
            label: c_string(&b[24..72], "label")?,
            checksum_alg: c_string(&b[72..104], "checksum_alg")?,
            salt,
            uuid: c_string(&b[168..208], "uuid")?,
            subsystem: c_string(&b[208..256], "subsystem")?,
            hdr_offset: be64(b, 256),
        })
    }

    /// Encodes with a zero checksum field.
    pub fn encode(&self, secondary: bool) -> Result<Vec<u8>> {
        let mut b = vec![0u8; BIN_HDR_BYTES as usize];
        b[0..6].copy_from_slice(if secondary { MAGIC_2ND } else { MAGIC_1ST });
        b[6..8].copy_from_slice(&2u16.to_be_bytes());
        b[8..16].copy_from_slice(&self.hdr_size.to_be_bytes());
        b[16..24].copy_from_slice(&self.seqid.to_be_bytes());
        put_c_string(&mut b[24..72], &self.label, "label")?;
        put_c_string(&mut b[72..104], &self.checksum_alg, "checksum algorithm")?;
        b[104..168].copy_from_slice(&self.salt);
        put_c_string(&mut b[168..208], &self.uuid, "UUID")?;
        put_c_string(&mut b[208..256], &self.subsystem, "subsystem")?;
        b[256..264].copy_from_slice(&self.hdr_offset.to_be_bytes());
        Ok(b)
    }
}

/// Checksum of a header copy: hash over the whole copy with the checksum field zeroed.
pub(super) fn checksum(alg: HashAlg, copy: &[u8]) -> Vec<u8> {
    let zero = [0u8; 64];
    alg.digest(&[&copy[..448], &zero, &copy[512..]])
}

/// One valid header copy.
#[derive(Debug, Clone)]
pub struct Copy {
    pub bin: BinHeader,
    pub meta: Metadata,
}

/// Reads and fully validates the copy at `offset` of `prefix` (the device's first bytes).
pub fn read_copy(prefix: &[u8], offset: u64, secondary: bool) -> Result<Copy> {
    let start = usize::try_from(offset).map_err(|_| bad("truncated", "offset"))?;
    let first = match prefix.get(start..) {
        None | Some([]) => {
            return Err(Error::NotLuks(format!(
                "device ends before offset {offset}"
            )))
        }
        // A short tail without the copy's magic is simply not a header; with it, a cut one.
        Some(r) if r.len() < BIN_HDR_BYTES as usize && !r.starts_with(magic_of(secondary)) => {
            return Err(Error::NotLuks(format!(
                "device ends at {} without a LUKS2 header at {offset}",
                offset + r.len() as u64
            )))
        }
        Some(r) if r.len() < BIN_HDR_BYTES as usize => {
            return Err(bad(
                "truncated",
                format!("device ends inside the header at {offset}"),
            ))
        }
        Some(r) => r,
    };
    let bin = BinHeader::decode(first, secondary)?;
    if bin.hdr_offset != offset {
        return Err(bad(
            "hdr_offset",
            format!("hdr_offset {} but found at {offset}", bin.hdr_offset),
        ));
    }
    if !HDR_SIZES.contains(&bin.hdr_size) {
        return Err(bad(
            "hdr_size",
            format!("unsupported header size {}", bin.hdr_size),
        ));
    }
    if secondary && bin.hdr_size != offset {
        return Err(bad(
            "hdr_size",
            format!(
                "secondary header of size {} at offset {offset}",
                bin.hdr_size
            ),
        ));
    }
    let size = bin.hdr_size as usize;
    let copy = first.get(..size).ok_or_else(|| {
        bad(
            "truncated",
            format!("device ends inside the header at {offset}"),
        )
    })?;
    let alg = HashAlg::from_name(&bin.checksum_alg).map_err(|_| {
        bad(
            "checksum_alg",
            format!("unsupported '{}'", bin.checksum_alg),
        )
    })?;
    let want = checksum(alg, copy);
    let stored = &copy[448..448 + want.len()];
    // Under cargo-fuzz the checksum is not enforced, so mutated inputs reach the JSON
    // checks (a fuzzer cannot forge SHA-256); normal builds always enforce it.
    if !cfg!(fuzzing) && !bool::from(subtle::ConstantTimeEq::ct_eq(stored, &want[..])) {
        return Err(bad("checksum", format!("{} checksum mismatch", alg.name())));
    }
    let json_area = &copy[BIN_HDR_BYTES as usize..];
    let end = json_area
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| bad("json-unterminated", "JSON area has no terminating NUL"))?;
    // As cryptsetup: the text is one object, `{` first and `}` last, and the rest of the
    // area is NUL bytes.
    if json_area.first() != Some(&b'{') || end == 0 || json_area[end - 1] != b'}' {
        return Err(bad(
            "json-syntax",
            "JSON area does not hold exactly one object from its first byte",
        ));
    }
    if let Some(i) = json_area[end..].iter().position(|&c| c != 0) {
        return Err(bad(
            "json-trailing",
            format!(
                "byte {} of the JSON area, after the JSON, is not NUL",
                end + i
            ),
        ));
    }
    let meta = Metadata::parse(&json_area[..end])?;
    super::validate(&meta, bin.hdr_size)?;
    Ok(Copy { bin, meta })
}
