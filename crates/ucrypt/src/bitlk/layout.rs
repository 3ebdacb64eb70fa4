//! The plaintext device cryptsetup maps for a BitLocker volume, as a list of segments: the
//! first `volume_header_bytes` read from where BitLocker moved them (encrypted with the IV of
//! that place), the three FVE metadata areas and the moved header's own place read as zeros,
//! and everything else decrypted in place. Every encrypted segment uses the IV of its
//! physical position, so one sector cipher over the whole device serves them all.

use super::{malformed, BitlkError, Metadata, FVE_METADATA_AREA_BYTES};

/// dm-crypt and dm-zero work in 512-byte units: cryptsetup truncates every offset to them.
const UNIT_BYTES: u64 = 512;
/// The fixed segments: three metadata areas, the moved header's place, the header itself.
const FIXED_SEGMENTS: usize = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    /// Reads as zeros; writes are dropped (dm-zero).
    Zero,
    /// Decrypted from the device at this byte offset, with that offset's IV.
    Crypt { device_offset: u64 },
}

/// A range of the plaintext device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub offset: u64,
    pub len: u64,
    pub kind: SegmentKind,
}

/// The segments of the plaintext device over `device_bytes` of ciphertext, sorted and
/// covering `0..device_bytes` exactly. Metadata whose areas overlap or reach past the device
/// is refused (the kernel would refuse the table).
pub fn segments(meta: &Metadata, device_bytes: u64) -> Result<Vec<Segment>, BitlkError> {
    let unit = |b: u64| b / UNIT_BYTES * UNIT_BYTES;
    let size = unit(device_bytes);
    let hdr_at = unit(meta.volume_header_offset);
    let hdr_len = unit(meta.volume_header_bytes);
    let mut fixed: Vec<Segment> = Vec::with_capacity(FIXED_SEGMENTS);
    for &o in &meta.metadata_offsets {
        fixed.push(Segment {
            offset: unit(o),
            len: FVE_METADATA_AREA_BYTES,
            kind: SegmentKind::Zero,
        });
    }
    fixed.push(Segment {
        offset: hdr_at,
        len: hdr_len,
        kind: SegmentKind::Zero,
    });
    fixed.push(Segment {
        offset: 0,
        len: hdr_len,
        kind: SegmentKind::Crypt {
            device_offset: hdr_at,
        },
    });
    fixed.retain(|s| s.len > 0);
    fixed.sort_by_key(|s| s.offset);
    let mut out = Vec::with_capacity(2 * FIXED_SEGMENTS + 1);
    let mut at = 0u64;
    for s in fixed {
        let end = s
            .offset
            .checked_add(s.len)
            .filter(|&e| e <= size)
            .ok_or_else(|| {
                malformed(
                    "segments",
                    format!(
                        "area at {} of {} bytes past the device end {size}",
                        s.offset, s.len
                    ),
                )
            })?;
        if s.offset < at {
            return Err(malformed(
                "segments",
                format!(
                    "area at {} overlaps the one before (ends at {at})",
                    s.offset
                ),
            ));
        }
        if s.offset > at {
            out.push(Segment {
                offset: at,
                len: s.offset - at,
                kind: SegmentKind::Crypt { device_offset: at },
            });
        }
        out.push(s);
        at = end;
    }
    if at < size {
        out.push(Segment {
            offset: at,
            len: size - at,
            kind: SegmentKind::Crypt { device_offset: at },
        });
    }
    Ok(out)
}
