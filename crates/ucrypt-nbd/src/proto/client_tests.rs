//! Client codec tests: the client handshake against the server's own state machine in memory
//! (a table of policies and exports), against hand-made server byte streams (fallbacks and
//! every refusal a broken server can provoke), and simple reply decoding.

use super::handshake::GREETING_BYTES;
use super::transmission::SIMPLE_REPLY_BYTES;
use super::*;
use crate::Error;

const RW: u16 = TX_HAS_FLAGS | TX_SEND_FLUSH | TX_SEND_FUA | TX_SEND_TRIM | TX_SEND_WRITE_ZEROES;

fn export(name: &str, size: u64, tx_flags: u16, min: u32) -> ExportInfo {
    ExportInfo {
        name: name.into(),
        description: String::new(),
        size_bytes: size,
        tx_flags,
        min_block_bytes: min,
        preferred_block_bytes: PREFERRED_BLOCK_BYTES,
        max_payload_bytes: MAX_PAYLOAD_BYTES,
    }
}

/// What a session ended with, seen from both sides.
#[derive(Debug, PartialEq)]
enum End {
    Ready(ExportGeometry, Negotiated),
    ClientErr(String),
}

/// Runs both state machines against each other, moving exactly the bytes each asks for;
/// a STARTTLS acknowledged by both sides is "upgraded" by telling both (no real TLS here).
fn converse(client: &mut ClientHandshake, server: &mut Handshake) -> (End, bool) {
    let (mut to_client, mut to_server) = (Vec::new(), Vec::new());
    let mut tls = false;
    let mut server_done: Option<Negotiated> = None;
    for _round in 0..1000 {
        to_client.extend(server.take_output());
        to_server.extend(client.take_output());
        let mut progressed = false;
        let sw = server.bytes_wanted();
        if sw > 0 && !to_server.is_empty() {
            let n = sw.min(to_server.len());
            let chunk: Vec<u8> = to_server.drain(..n).collect();
            match server
                .feed(&chunk)
                .expect("server refused a well-behaved client")
            {
                Step::Continue => {}
                Step::StartTls => server.tls_established(),
                Step::Transmission(n) => server_done = Some(n),
                Step::Abort => panic!("client aborted"),
            }
            progressed = true;
        }
        to_client.extend(server.take_output());
        let cw = client.bytes_wanted();
        if cw > 0 && !to_client.is_empty() {
            let n = cw.min(to_client.len());
            let chunk: Vec<u8> = to_client.drain(..n).collect();
            match client.feed(&chunk) {
                Ok(ClientStep::Continue) => {}
                Ok(ClientStep::StartTls) => {
                    tls = true;
                    client.tls_established().unwrap();
                }
                Ok(ClientStep::Ready(g)) => {
                    assert!(to_client.is_empty(), "bytes left after the handshake");
                    let n = server_done.take().expect("client ready before the server");
                    return (End::Ready(g, n), tls);
                }
                Err(e) => return (End::ClientErr(e.to_string()), tls),
            }
            progressed = true;
        }
        assert!(progressed, "handshake stalled");
    }
    panic!("handshake did not end");
}

#[test]
fn client_against_server_table() {
    // (what, exports, server TLS, client export, client TLS, expected end, TLS used)
    let exports = vec![
        export("disk", 1 << 20, RW | TX_CAN_MULTI_CONN, 512),
        export("ro", 8192, RW | TX_READ_ONLY, 4096),
    ];
    let geo = |size, flags, min| ExportGeometry {
        size_bytes: size,
        tx_flags: flags,
        min_block_bytes: min,
        preferred_block_bytes: PREFERRED_BLOCK_BYTES,
        max_payload_bytes: MAX_PAYLOAD_BYTES,
        block_sizes_advertised: true,
    };
    let ready = |g, export| {
        End::Ready(
            g,
            Negotiated {
                export,
                tx_flags: g.tx_flags,
            },
        )
    };
    type Row = (&'static str, TlsPolicy, &'static str, bool, End, bool);
    let rows: Vec<Row> = vec![
        (
            "plain GO",
            TlsPolicy::Disabled,
            "disk",
            false,
            ready(geo(1 << 20, RW | TX_CAN_MULTI_CONN, 512), 0),
            false,
        ),
        (
            "empty name is the default export",
            TlsPolicy::Disabled,
            "",
            false,
            ready(geo(1 << 20, RW | TX_CAN_MULTI_CONN, 512), 0),
            false,
        ),
        (
            "read-only export, 4096-byte blocks",
            TlsPolicy::Disabled,
            "ro",
            false,
            ready(geo(8192, RW | TX_READ_ONLY, 4096), 1),
            false,
        ),
        (
            "TLS both sides",
            TlsPolicy::Required,
            "disk",
            true,
            ready(geo(1 << 20, RW | TX_CAN_MULTI_CONN, 512), 0),
            true,
        ),
        (
            "unknown export",
            TlsPolicy::Disabled,
            "nope",
            false,
            End::ClientErr(
                "NBD server refused NBD_OPT_GO: NBD_REP_ERR_UNKNOWN (no such export)".into(),
            ),
            false,
        ),
        (
            "server requires TLS, client does not ask",
            TlsPolicy::Required,
            "disk",
            false,
            End::ClientErr(
                "NBD server refused NBD_OPT_GO: NBD_REP_ERR_TLS_REQD (this server requires TLS)"
                    .into(),
            ),
            false,
        ),
        (
            "client requires TLS, server has none: no fall-back to plaintext",
            TlsPolicy::Disabled,
            "disk",
            true,
            End::ClientErr(
                "NBD server refused NBD_OPT_STARTTLS: NBD_REP_ERR_POLICY (TLS is not \
                 configured on this server)"
                    .into(),
            ),
            false,
        ),
    ];
    for (what, policy, name, tls, want, want_tls) in rows {
        let mut server = Handshake::new(exports.clone(), policy);
        let mut client = ClientHandshake::new(name, tls).unwrap();
        let (end, used_tls) = converse(&mut client, &mut server);
        assert_eq!(end, want, "{what}");
        assert_eq!(used_tls, want_tls, "{what}: TLS");
    }
}

fn greeting(flags: u16) -> Vec<u8> {
    let mut v = NBD_MAGIC.to_be_bytes().to_vec();
    v.extend_from_slice(&IHAVEOPT.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v
}

fn rep(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let mut v = OPTION_REPLY_MAGIC.to_be_bytes().to_vec();
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&reply_type.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut v = INFO_EXPORT.to_be_bytes().to_vec();
    v.extend_from_slice(&size.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v
}

fn info_block(min: u32, pref: u32, max: u32) -> Vec<u8> {
    let mut v = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for x in [min, pref, max] {
        v.extend_from_slice(&x.to_be_bytes());
    }
    v
}

/// Feeds a server byte stream exactly as a driver would: returns everything the client sent
/// and how it ended.
fn run(export: &str, tls: bool, server_bytes: &[u8]) -> (Vec<u8>, Result<ClientStep, String>) {
    let mut c = ClientHandshake::new(export, tls).unwrap();
    assert!(c.take_output().is_empty(), "the client spoke first");
    assert_eq!(c.bytes_wanted(), GREETING_BYTES);
    let (mut out, mut pos) = (Vec::new(), 0);
    loop {
        let want = c.bytes_wanted();
        assert!(
            want <= OPTION_REPLY_MAX_BYTES,
            "client asked for {want} bytes"
        );
        let take = want.min(server_bytes.len() - pos);
        if want == 0 || take == 0 {
            return (out, Err("stalled".into()));
        }
        let r = c.feed(&server_bytes[pos..pos + take]);
        pos += take;
        out.extend(c.take_output());
        match r {
            Ok(ClientStep::Continue) => {}
            Ok(s) => {
                assert_eq!(
                    pos,
                    server_bytes.len(),
                    "client stopped before the stream ended"
                );
                return (out, Ok(s));
            }
            Err(e) => return (out, Err(e.to_string())),
        }
    }
}

fn go_bytes(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&1u16.to_be_bytes());
    d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    let mut v = IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&OPT_GO.to_be_bytes());
    v.extend_from_slice(&(d.len() as u32).to_be_bytes());
    v.extend_from_slice(&d);
    v
}

#[test]
fn client_sends_exact_bytes() {
    let mut server = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    server.extend(rep(OPT_GO, REP_INFO, &info_export(4096, RW)));
    server.extend(rep(OPT_GO, REP_ACK, &[]));
    let (out, end) = run("vm1", false, &server);
    let mut want = vec![0, 0, 0, 3]; // FIXED_NEWSTYLE | NO_ZEROES
    want.extend(go_bytes("vm1"));
    assert_eq!(out, want);
    // No block sizes from the server: the spec's defaults.
    assert_eq!(
        end,
        Ok(ClientStep::Ready(ExportGeometry {
            size_bytes: 4096,
            tx_flags: RW,
            min_block_bytes: 1,
            preferred_block_bytes: 4096,
            max_payload_bytes: 32 << 20,
            block_sizes_advertised: false,
        }))
    );

    // Without NO_ZEROES offered, the client does not ask for it; STARTTLS goes first.
    let mut server = greeting(FLAG_FIXED_NEWSTYLE);
    server.extend(rep(OPT_STARTTLS, REP_ACK, &[]));
    let (out, end) = run("x", true, &server);
    let mut want = vec![0, 0, 0, 1];
    want.extend_from_slice(&IHAVEOPT.to_be_bytes());
    want.extend_from_slice(&OPT_STARTTLS.to_be_bytes());
    want.extend_from_slice(&0u32.to_be_bytes());
    assert_eq!(out, want);
    assert_eq!(end, Ok(ClientStep::StartTls));
}

#[test]
fn go_unsupported_falls_back_to_export_name() {
    for no_zeroes in [true, false] {
        let flags = FLAG_FIXED_NEWSTYLE | if no_zeroes { FLAG_NO_ZEROES } else { 0 };
        let mut server = greeting(flags);
        server.extend(rep(OPT_GO, REP_ERR_UNSUP, b"old server"));
        server.extend_from_slice(&(1u64 << 30).to_be_bytes());
        server.extend_from_slice(&(TX_HAS_FLAGS | TX_SEND_FLUSH).to_be_bytes());
        if !no_zeroes {
            server.extend_from_slice(&[0u8; 124]);
        }
        let (out, end) = run("e", false, &server);
        let mut want = vec![0, 0, 0, if no_zeroes { 3 } else { 1 }];
        want.extend(go_bytes("e"));
        want.extend_from_slice(&IHAVEOPT.to_be_bytes());
        want.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
        want.extend_from_slice(&1u32.to_be_bytes());
        want.push(b'e');
        assert_eq!(out, want, "no_zeroes={no_zeroes}");
        match end {
            Ok(ClientStep::Ready(g)) => {
                assert_eq!(g.size_bytes, 1 << 30);
                assert_eq!(g.tx_flags, TX_HAS_FLAGS | TX_SEND_FLUSH);
                assert!(!g.block_sizes_advertised);
            }
            other => panic!("no_zeroes={no_zeroes}: {other:?}"),
        }
    }
}

#[test]
fn broken_servers_table() {
    let ok_go = |extra: &[Vec<u8>]| {
        let mut v = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        for e in extra {
            v.extend_from_slice(e);
        }
        v
    };
    let mut wrong_magic = greeting(FLAG_FIXED_NEWSTYLE);
    wrong_magic[0] = b'X';
    let mut oldstyle = NBD_MAGIC.to_be_bytes().to_vec();
    oldstyle.extend_from_slice(&0x0000_4202_8186_1253u64.to_be_bytes());
    oldstyle.extend_from_slice(&[0, 0]);
    let mut bad_reply_magic = rep(OPT_GO, REP_ACK, &[]);
    bad_reply_magic[7] ^= 1;
    let mut too_long = rep(OPT_GO, REP_INFO, &[]);
    too_long[16..20].copy_from_slice(&(OPTION_REPLY_MAX_BYTES as u32 + 1).to_be_bytes());
    let many_infos: Vec<Vec<u8>> = (0..=REPLIES_PER_OPTION_MAX)
        .map(|_| rep(OPT_GO, REP_INFO, &[0, 9]))
        .collect();
    // (what, server bytes, error must mention)
    let rows: Vec<(&str, Vec<u8>, &str)> = vec![
        ("not NBD", wrong_magic, "not an NBD server"),
        ("old-style server", oldstyle, "old-style"),
        (
            "no fixed newstyle",
            greeting(FLAG_NO_ZEROES),
            "fixed newstyle",
        ),
        ("bad reply magic", ok_go(&[bad_reply_magic]), "reply magic"),
        (
            "reply to another option",
            ok_go(&[rep(OPT_LIST, REP_ACK, &[])]),
            "while NBD_OPT_GO was asked",
        ),
        ("reply too long", ok_go(&[too_long]), "longer than"),
        (
            "endless replies",
            ok_go(&many_infos),
            "more than 64 replies",
        ),
        (
            "ACK without export info",
            ok_go(&[rep(OPT_GO, REP_ACK, &[])]),
            "without NBD_INFO_EXPORT",
        ),
        (
            "short export info",
            ok_go(&[rep(OPT_GO, REP_INFO, &info_export(1, 1)[..8])]),
            "NBD_INFO_EXPORT of 6 bytes",
        ),
        (
            "min block not a power of two",
            ok_go(&[rep(OPT_GO, REP_INFO, &info_block(768, 4096, 1 << 20))]),
            "minimum block size 768",
        ),
        (
            "min block too large",
            ok_go(&[rep(
                OPT_GO,
                REP_INFO,
                &info_block(1 << 17, 1 << 17, 1 << 20),
            )]),
            "minimum block size 131072",
        ),
        (
            "preferred below minimum",
            ok_go(&[rep(OPT_GO, REP_INFO, &info_block(4096, 512, 1 << 20))]),
            "preferred block size 512",
        ),
        (
            "max below minimum",
            ok_go(&[rep(OPT_GO, REP_INFO, &info_block(4096, 4096, 512))]),
            "maximum payload 512",
        ),
        (
            "non-error reply type that GO never gets",
            ok_go(&[rep(OPT_GO, REP_SERVER, &[0, 0, 0, 0])]),
            "unexpected reply NBD_REP_SERVER",
        ),
        (
            "block size required (we always ask, a server may still say so)",
            ok_go(&[rep(OPT_GO, REP_ERR_BLOCK_SIZE_REQD, b"")]),
            "NBD_REP_ERR_BLOCK_SIZE_REQD",
        ),
        (
            "shutting down",
            ok_go(&[rep(OPT_GO, REP_ERR_SHUTDOWN, b"bye")]),
            "NBD_REP_ERR_SHUTDOWN (bye)",
        ),
        (
            "unknown error reply",
            ok_go(&[rep(OPT_GO, (1 << 31) + 77, b"")]),
            "an unknown NBD_REP_ERR",
        ),
    ];
    for (what, server, needle) in rows {
        let (_, end) = run("d", false, &server);
        match end {
            Err(e) => assert!(e.contains(needle), "{what}: {e}"),
            Ok(s) => panic!("{what}: accepted ({s:?})"),
        }
    }
}

#[test]
fn unknown_infos_are_ignored_and_block_sizes_kept() {
    let mut server = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    server.extend(rep(OPT_GO, REP_INFO, &[0, INFO_NAME as u8, b'd']));
    server.extend(rep(OPT_GO, REP_INFO, &[0x7f, 0x7f, 1, 2, 3]));
    server.extend(rep(OPT_GO, REP_INFO, &info_block(4096, 65536, 1 << 20)));
    // Flags without HAS_FLAGS do not count.
    server.extend(rep(OPT_GO, REP_INFO, &info_export(1 << 20, TX_READ_ONLY)));
    server.extend(rep(OPT_GO, REP_ACK, &[]));
    let (_, end) = run("d", false, &server);
    assert_eq!(
        end,
        Ok(ClientStep::Ready(ExportGeometry {
            size_bytes: 1 << 20,
            tx_flags: 0,
            min_block_bytes: 4096,
            preferred_block_bytes: 65536,
            max_payload_bytes: 1 << 20,
            block_sizes_advertised: true,
        }))
    );
}

#[test]
fn misuse_is_reported_not_panicked() {
    let long = "x".repeat(EXPORT_NAME_MAX_BYTES + 1);
    assert!(matches!(
        ClientHandshake::new(&long, false),
        Err(Error::Config(_))
    ));
    let mut c = ClientHandshake::new("d", false).unwrap();
    assert!(matches!(c.feed(&[0u8; 19]), Err(Error::Bug(_))));
    assert!(matches!(c.tls_established(), Err(Error::Bug(_))));
}

#[test]
fn simple_reply_decoding_table() {
    let reply = |magic: u32, error: u32, cookie: u64| {
        let mut b = [0u8; SIMPLE_REPLY_BYTES];
        b[0..4].copy_from_slice(&magic.to_be_bytes());
        b[4..8].copy_from_slice(&error.to_be_bytes());
        b[8..16].copy_from_slice(&cookie.to_be_bytes());
        b
    };
    // The server's encoder and the client's decoder agree.
    for e in [
        None,
        Some(NbdError::Io),
        Some(NbdError::NoSpc),
        Some(NbdError::Shutdown),
    ] {
        let b = encode_simple_reply(0xdead_beef_0102, e);
        assert_eq!(
            SimpleReply::parse(&b).unwrap(),
            SimpleReply {
                cookie: 0xdead_beef_0102,
                error: e
            }
        );
    }
    // Unknown error values read as EINVAL, as the spec asks.
    assert_eq!(
        SimpleReply::parse(&reply(SIMPLE_REPLY_MAGIC, 4242, 7))
            .unwrap()
            .error,
        Some(NbdError::Inval)
    );
    // Structured replies were never negotiated: out of sync.
    let e = SimpleReply::parse(&reply(0x668e_33ef, 0, 7)).unwrap_err();
    assert!(e.to_string().contains("bad reply magic 0x668e33ef"), "{e}");
    // Every wire error has a name and a matching errno.
    for v in [1u32, 5, 12, 22, 28, 75, 95, 108] {
        let e = NbdError::from_wire(v).unwrap();
        assert_eq!(e as u32, v);
        assert_eq!(e.errno() as u32, v, "{}", e.name());
        assert!(e.name().starts_with("NBD_E"));
    }
    // A request header round-trips through the server's parser.
    let h = RequestHeader {
        flags: 0,
        kind: CMD_WRITE,
        cookie: 99,
        offset: 4096,
        length: 512,
    };
    assert_eq!(RequestHeader::parse(&h.encode()).unwrap(), h);
}
