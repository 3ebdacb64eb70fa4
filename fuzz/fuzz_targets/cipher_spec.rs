//! Fuzzes the cipher-spec parser (`aes-xts-plain64`, `capi:xts(aes)-plain64`, ...): parsing
//! never panics, and a spec that parses prints as a spec that parses to itself.
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none cipher_spec`
#![no_main]

use libfuzzer_sys::fuzz_target;
use ucrypt::sector::CipherSpec;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    let Ok(spec) = s.parse::<CipherSpec>() else { return };
    let shown = spec.to_string();
    let again: CipherSpec = shown.parse().expect("a printed spec parses");
    assert_eq!(again, spec, "{s:?} printed as {shown:?}");
    for &n in spec.key_bytes_allowed() {
        spec.check_key_len(n).expect("an allowed key length is accepted");
    }
    let _ = spec.luks1_name_mode();
});
