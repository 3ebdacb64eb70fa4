//! Fuzzes the NBD client's side of the protocol with whole server sessions: the first byte
//! picks TLS and the export name, the rest is fed to `ClientHandshake` exactly as the client's
//! driver does (never more than it asks for), then the remaining bytes are read as the
//! server's replies: 16-byte simple reply headers, each followed for a read by its data.
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none nbd_client`
#![no_main]

use libfuzzer_sys::fuzz_target;
use ucrypt_nbd::proto::transmission::SIMPLE_REPLY_BYTES;
use ucrypt_nbd::proto::*;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, mut rest)) = data.split_first() else { return };
    let tls = pick & 1 != 0;
    let name = if pick & 2 != 0 { "disk" } else { "" };
    let mut hs = ClientHandshake::new(name, tls).expect("a short export name");
    let geometry = loop {
        let want = hs.bytes_wanted();
        if want == 0 || rest.is_empty() {
            return;
        }
        let take = want.min(rest.len());
        let step = hs.feed(&rest[..take]);
        rest = &rest[take..];
        let _ = hs.take_output();
        match step {
            Ok(ClientStep::Continue) => {}
            Ok(ClientStep::StartTls) => {
                if hs.tls_established().is_err() {
                    return;
                }
            }
            Ok(ClientStep::Ready(g)) => break g,
            Err(_) => return,
        }
    };
    let _ = geometry.has(TX_SEND_FUA);
    // Replies: a cookie names the request; cookies with the low bit set were reads of 4 KiB.
    while rest.len() >= SIMPLE_REPLY_BYTES {
        let (h, tail) = rest.split_at(SIMPLE_REPLY_BYTES);
        rest = tail;
        let Ok(r) = SimpleReply::parse(h.try_into().unwrap()) else { return };
        if r.error.is_none() && r.cookie & 1 == 1 {
            rest = &rest[rest.len().min(4096)..];
        }
    }
});
