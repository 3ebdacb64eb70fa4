//! Fuzzes the NBD codec with whole client sessions: the first byte picks the TLS policy, the
//! rest is fed to the handshake exactly as the server's driver does (never more than it asks
//! for), then any remaining bytes are decoded as transmission requests.
//! Run: RUSTC_BOOTSTRAP=1 cargo fuzz run nbd_session   (from the repository root)
#![no_main]

use libfuzzer_sys::fuzz_target;
use ucrypt_nbd::proto::transmission::REQUEST_HEADER_BYTES;
use ucrypt_nbd::proto::*;

fuzz_target!(|data: &[u8]| {
    let Some((&policy, mut rest)) = data.split_first() else { return };
    let tls = if policy & 1 == 0 { TlsPolicy::Disabled } else { TlsPolicy::Required };
    let export = |name: &str, size: u64, flags: u16| ExportInfo {
        name: name.into(),
        description: String::new(),
        size_bytes: size,
        tx_flags: flags,
        min_block_bytes: MIN_BLOCK_BYTES,
        preferred_block_bytes: PREFERRED_BLOCK_BYTES,
        max_payload_bytes: MAX_PAYLOAD_BYTES,
    };
    let rw = TX_HAS_FLAGS | TX_SEND_FLUSH | TX_SEND_FUA | TX_SEND_TRIM | TX_SEND_WRITE_ZEROES;
    let exports = vec![export("a", 1 << 20, rw), export("b", 1 << 30, rw | TX_READ_ONLY)];
    let mut hs = Handshake::new(exports.clone(), tls);
    let negotiated = loop {
        let want = hs.bytes_wanted();
        assert!(want <= OPTION_DATA_MAX_BYTES);
        if want == 0 || rest.is_empty() {
            return;
        }
        let take = want.min(rest.len());
        let step = hs.feed(&rest[..take]);
        rest = &rest[take..];
        let _ = hs.take_output();
        match step {
            Ok(Step::Continue) => {}
            Ok(Step::StartTls) => hs.tls_established(),
            Ok(Step::Transmission(n)) => break n,
            Ok(Step::Abort) | Err(_) => return,
        }
    };
    let e = &exports[negotiated.export];
    let lim = TransmissionLimits {
        size_bytes: e.size_bytes,
        tx_flags: negotiated.tx_flags,
        min_block_bytes: e.min_block_bytes,
        max_payload_bytes: e.max_payload_bytes,
    };
    while rest.len() >= REQUEST_HEADER_BYTES {
        let (h, tail) = rest.split_at(REQUEST_HEADER_BYTES);
        rest = tail;
        let Ok(h) = RequestHeader::parse(h.try_into().unwrap()) else { return };
        match decode_request(&h, &lim) {
            Decoded::Ok(r) => {
                if let Command::Write { len, .. } = r.command {
                    rest = &rest[rest.len().min(len as usize)..];
                }
            }
            Decoded::Reject { skip_payload_bytes, .. } => {
                rest = &rest[rest.len().min(skip_payload_bytes as usize)..];
            }
            Decoded::Fatal(_) => return,
        }
    }
});
