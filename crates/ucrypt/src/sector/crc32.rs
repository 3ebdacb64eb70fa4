//! CRC-32 (the reflected polynomial 0xEDB88320) as a raw register update, without the
//! inversions at start and end: TrueCrypt's header checksums are the usual CRC-32
//! ([`checksum`]), its keyfile pool reads the raw register after every byte, and dm-crypt's
//! `tcw` IV uses the kernel's `crc32(0, ...)`, which inverts nothing.

/// The byte-at-a-time lookup table of the reflected polynomial `poly` (0xEDB88320 for CRC-32,
/// 0x82F63B78 for CRC-32C), built at compile time.
pub(crate) const fn table(poly: u32) -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { poly ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

/// The register after `data`, starting from `crc`, for the polynomial `table` was built from.
pub(crate) fn update_with(table: &[u32; 256], mut crc: u32, data: &[u8]) -> u32 {
    for &b in data {
        crc = table[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

static TABLE: [u32; 256] = table(0xEDB8_8320);

/// The register after `data`, starting from `crc`.
pub(crate) fn update(crc: u32, data: &[u8]) -> u32 {
    update_with(&TABLE, crc, data)
}

/// The usual CRC-32 of `data` (zlib's, TrueCrypt's header checksums).
pub(crate) fn checksum(data: &[u8]) -> u32 {
    !update(!0, data)
}

#[cfg(test)]
mod tests {
    #[test]
    fn check_value() {
        // The CRC-32 check value of "123456789".
        assert_eq!(super::checksum(b"123456789"), 0xCBF4_3926);
        assert_eq!(super::update(0, b""), 0);
    }
}
