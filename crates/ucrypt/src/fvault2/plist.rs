//! The three values FileVault2 keeps in XML plists, found as cryptsetup finds them: the first
//! `<key>KEY</key><TYPE ...>VALUE</TYPE>` with no `<` in VALUE (cryptsetup's regular
//! expression), not a full plist parser. Bounded by the 8 KiB block the text comes from.

/// The value of `key` whose element is `ty`.
pub(super) fn value<'a>(xml: &'a [u8], key: &str, ty: &str) -> Option<&'a str> {
    let needle = format!("<key>{key}</key><{ty}");
    let close = format!("</{ty}>");
    let mut from = 0;
    while let Some(p) = find(&xml[from..], needle.as_bytes()) {
        let start = from + p + needle.len();
        from = from + p + 1;
        let rest = &xml[start..];
        let Some(gt) = rest.iter().position(|&c| c == b'>') else {
            continue;
        };
        let v = &rest[gt + 1..];
        let len = v.iter().position(|&c| c == b'<').unwrap_or(v.len());
        if len == 0 || !v[len..].starts_with(close.as_bytes()) {
            continue;
        }
        return std::str::from_utf8(&v[..len]).ok();
    }
    None
}

/// The bytes of a `<data>` value (base64, whitespace skipped).
pub(super) fn data(xml: &[u8], key: &str) -> Option<Vec<u8>> {
    base64_decode(value(xml, key, "data")?)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// RFC 4648 base64 with `=` padding; spaces, tabs and line breaks are skipped (as
/// cryptsetup's decoder skips them).
pub(super) fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0;
    let mut pad = 0;
    for c in s.bytes() {
        let v = match c {
            b' ' | b'\t' | b'\n' | b'\r' => continue,
            b'=' => {
                pad += 1;
                continue;
            }
            _ if pad > 0 => return None,
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    // Leftover bits must be padding zeros, and at most two `=`.
    if pad > 2 || acc != 0 || bits >= 6 {
        return None;
    }
    Some(out)
}

/// C's `strtoull(s, NULL, 16)`: leading whitespace, an optional `0x`, hex digits up to the
/// first other character; `None` when no digit is there; saturates at `u64::MAX` on overflow.
pub(super) fn strtoull_hex(s: &str) -> Option<u64> {
    let t = s.trim_start();
    let t = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .filter(|r| r.starts_with(|c: char| c.is_ascii_hexdigit()))
        .unwrap_or(t);
    let digits: &str = &t[..t.find(|c: char| !c.is_ascii_hexdigit()).unwrap_or(t.len())];
    if digits.is_empty() {
        return None;
    }
    let mut v: u64 = 0;
    for c in digits.chars() {
        let d = u64::from(c.to_digit(16)?);
        v = match v.checked_mul(16).and_then(|v| v.checked_add(d)) {
            Some(v) => v,
            None => return Some(u64::MAX),
        };
    }
    Some(v)
}
