//! Hex text for known-answer vectors. One file that the integration-test kit, the core
//! library's integration tests and its unit tests all take in with `#[path]` (unit tests
//! cannot import an integration-test module).

/// Lower-case hex of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of hex text `s` (white space ignored).
pub fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}
