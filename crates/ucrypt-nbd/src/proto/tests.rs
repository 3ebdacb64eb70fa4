//! Codec tests: case tables for the handshake and request validation, and a seeded mutation
//! test that feeds corrupted sessions through both (must never panic or over-read).

use super::handshake::GREETING_BYTES;
use super::transmission::REQUEST_HEADER_BYTES;
use super::*;

fn export(name: &str, size: u64, tx_flags: u16) -> ExportInfo {
    ExportInfo {
        name: name.into(),
        description: format!("desc of {name}"),
        size_bytes: size,
        tx_flags,
        min_block_bytes: MIN_BLOCK_BYTES,
        preferred_block_bytes: PREFERRED_BLOCK_BYTES,
        max_payload_bytes: MAX_PAYLOAD_BYTES,
    }
}

const RW: u16 = TX_HAS_FLAGS | TX_SEND_FLUSH | TX_SEND_FUA | TX_SEND_TRIM | TX_SEND_WRITE_ZEROES;

fn exports() -> Vec<ExportInfo> {
    vec![
        export("disk", 1 << 20, RW),
        export("ro", 8192, RW | TX_READ_ONLY),
    ]
}

fn opt(code: u32, data: &[u8]) -> Vec<u8> {
    let mut v = IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&code.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        v.extend_from_slice(&i.to_be_bytes());
    }
    v
}

/// Feeds `input` exactly as a driver would; returns all output after the greeting, the last
/// step (or error) and how many input bytes were consumed.
fn drive(hs: &mut Handshake, input: &[u8]) -> (Vec<u8>, Result<Step, String>, usize) {
    let mut out = hs.take_output();
    assert_eq!(out.len(), GREETING_BYTES);
    out.clear();
    let mut pos = 0;
    loop {
        let want = hs.bytes_wanted();
        assert!(
            want <= OPTION_DATA_MAX_BYTES,
            "handshake asked for {want} bytes"
        );
        if want == 0 {
            return (out, Err("done".into()), pos);
        }
        let take = want.min(input.len() - pos);
        if take == 0 {
            return (out, Err("eof".into()), pos);
        }
        let r = hs.feed(&input[pos..pos + take]);
        pos += take;
        out.extend(hs.take_output());
        match r {
            Ok(Step::Continue) => continue,
            Ok(s) => return (out, Ok(s), pos),
            Err(e) => return (out, Err(e.to_string()), pos),
        }
    }
}

/// Splits option replies: (option, reply type, data).
fn replies(mut b: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let mut v = Vec::new();
    while b.len() >= 20 {
        assert_eq!(
            u64::from_be_bytes(b[0..8].try_into().unwrap()),
            OPTION_REPLY_MAGIC
        );
        let o = u32::from_be_bytes(b[8..12].try_into().unwrap());
        let t = u32::from_be_bytes(b[12..16].try_into().unwrap());
        let l = u32::from_be_bytes(b[16..20].try_into().unwrap()) as usize;
        v.push((o, t, b[20..20 + l].to_vec()));
        b = &b[20 + l..];
    }
    assert!(b.is_empty(), "trailing bytes after replies: {b:?}");
    v
}

fn types(r: &[(u32, u32, Vec<u8>)]) -> Vec<u32> {
    r.iter().map(|x| x.1).collect()
}

const FIXED: [u8; 4] = [0, 0, 0, 1];
const FIXED_NZ: [u8; 4] = [0, 0, 0, 3];

fn session(flags: [u8; 4], opts: &[Vec<u8>]) -> Vec<u8> {
    let mut v = flags.to_vec();
    for o in opts {
        v.extend_from_slice(o);
    }
    v
}

#[test]
fn greeting_is_fixed_newstyle_with_no_zeroes() {
    let mut hs = Handshake::new(exports(), TlsPolicy::Disabled);
    let g = hs.take_output();
    assert_eq!(&g[0..8], b"NBDMAGIC");
    assert_eq!(&g[8..16], b"IHAVEOPT");
    assert_eq!(
        u16::from_be_bytes([g[16], g[17]]),
        FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
    );
    assert_eq!(hs.bytes_wanted(), 4);
}

#[test]
fn option_haggling_table() {
    struct Case {
        name: &'static str,
        tls: TlsPolicy,
        input: Vec<u8>,
        reply_types: Vec<u32>,
        outcome: Result<Step, &'static str>,
    }
    let go = |n: &str| {
        opt(
            OPT_GO,
            &go_data(n, &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]),
        )
    };
    let cases = vec![
        Case {
            name: "GO known export",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[go("ro")]),
            reply_types: vec![REP_INFO, REP_INFO, REP_INFO, REP_INFO, REP_ACK],
            outcome: Ok(Step::Transmission(Negotiated {
                export: 1,
                tx_flags: RW | TX_READ_ONLY,
            })),
        },
        Case {
            name: "GO empty name is the default (first) export",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[opt(OPT_GO, &go_data("", &[]))]),
            reply_types: vec![REP_INFO, REP_INFO, REP_ACK],
            outcome: Ok(Step::Transmission(Negotiated {
                export: 0,
                tx_flags: RW,
            })),
        },
        Case {
            name: "INFO then GO unknown then GO",
            tls: TlsPolicy::Disabled,
            input: session(
                FIXED,
                &[opt(OPT_INFO, &go_data("disk", &[])), go("nope"), go("disk")],
            ),
            reply_types: vec![
                REP_INFO,
                REP_INFO,
                REP_ACK,
                REP_ERR_UNKNOWN,
                REP_INFO,
                REP_INFO,
                REP_INFO,
                REP_INFO,
                REP_ACK,
            ],
            outcome: Ok(Step::Transmission(Negotiated {
                export: 0,
                tx_flags: RW,
            })),
        },
        Case {
            name: "LIST",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[opt(OPT_LIST, &[])]),
            reply_types: vec![REP_SERVER, REP_SERVER, REP_ACK],
            outcome: Err("eof"),
        },
        Case {
            name: "LIST with data is invalid",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[opt(OPT_LIST, b"x")]),
            reply_types: vec![REP_ERR_INVALID],
            outcome: Err("eof"),
        },
        Case {
            name: "unknown and structured-reply options are unsupported",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[opt(99, b"abc"), opt(OPT_STRUCTURED_REPLY, &[])]),
            reply_types: vec![REP_ERR_UNSUP, REP_ERR_UNSUP],
            outcome: Err("eof"),
        },
        Case {
            name: "STARTTLS without TLS configured",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[opt(OPT_STARTTLS, &[])]),
            reply_types: vec![REP_ERR_POLICY],
            outcome: Err("eof"),
        },
        Case {
            name: "TLS required: GO refused, STARTTLS acked",
            tls: TlsPolicy::Required,
            input: session(
                FIXED,
                &[go("disk"), opt(OPT_LIST, &[]), opt(OPT_STARTTLS, &[])],
            ),
            reply_types: vec![REP_ERR_TLS_REQD, REP_ERR_TLS_REQD, REP_ACK],
            outcome: Ok(Step::StartTls),
        },
        Case {
            name: "TLS required: EXPORT_NAME disconnects",
            tls: TlsPolicy::Required,
            input: session(FIXED, &[opt(OPT_EXPORT_NAME, b"disk")]),
            reply_types: vec![],
            outcome: Err("before TLS"),
        },
        Case {
            name: "TLS required: client without fixed newstyle",
            tls: TlsPolicy::Required,
            input: session([0; 4], &[]),
            reply_types: vec![],
            outcome: Err("fixed newstyle"),
        },
        Case {
            name: "ABORT",
            tls: TlsPolicy::Required,
            input: session(FIXED, &[opt(OPT_ABORT, b"ignored")]),
            reply_types: vec![REP_ACK],
            outcome: Ok(Step::Abort),
        },
        Case {
            name: "unknown client flags",
            tls: TlsPolicy::Disabled,
            input: session([0, 0, 0, 5], &[]),
            reply_types: vec![],
            outcome: Err("unknown client flags"),
        },
        Case {
            name: "bad option magic",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[vec![0u8; 16]]),
            reply_types: vec![],
            outcome: Err("bad option magic"),
        },
        Case {
            name: "option data too long",
            tls: TlsPolicy::Disabled,
            input: {
                let mut o = opt(99, &[]);
                o[12..16].copy_from_slice(&(OPTION_DATA_MAX_BYTES as u32 + 1).to_be_bytes());
                session(FIXED, &[o])
            },
            reply_types: vec![],
            outcome: Err("too long"),
        },
        Case {
            name: "GO name length past option end",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[opt(OPT_GO, &[0, 0, 0, 9, b'd', 0, 0])]),
            reply_types: vec![REP_ERR_INVALID],
            outcome: Err("eof"),
        },
        Case {
            name: "GO info count mismatch",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[opt(OPT_GO, &[0, 0, 0, 0, 0, 2, 0, 3])]),
            reply_types: vec![REP_ERR_INVALID],
            outcome: Err("eof"),
        },
        Case {
            name: "EXPORT_NAME unknown disconnects",
            tls: TlsPolicy::Disabled,
            input: session(FIXED, &[opt(OPT_EXPORT_NAME, b"nope")]),
            reply_types: vec![],
            outcome: Err("unknown export"),
        },
    ];
    for c in cases {
        let mut hs = Handshake::new(exports(), c.tls);
        let (out, step, consumed) = drive(&mut hs, &c.input);
        assert_eq!(types(&replies(&out)), c.reply_types, "case '{}'", c.name);
        match (&step, &c.outcome) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "case '{}'", c.name),
            (Err(a), Err(b)) => {
                assert!(a.contains(b), "case '{}': error '{a}' lacks '{b}'", c.name)
            }
            _ => panic!("case '{}': got {step:?}, want {:?}", c.name, c.outcome),
        }
        if step.is_ok() {
            assert_eq!(
                consumed,
                c.input.len(),
                "case '{}' left input unread",
                c.name
            );
        }
    }
}

#[test]
fn go_reports_size_flags_and_block_sizes() {
    let mut hs = Handshake::new(exports(), TlsPolicy::Disabled);
    let input = session(FIXED, &[opt(OPT_GO, &go_data("disk", &[INFO_BLOCK_SIZE]))]);
    let (out, _, _) = drive(&mut hs, &input);
    let r = replies(&out);
    let export = &r[0].2;
    assert_eq!(u16::from_be_bytes([export[0], export[1]]), INFO_EXPORT);
    assert_eq!(
        u64::from_be_bytes(export[2..10].try_into().unwrap()),
        1 << 20
    );
    assert_eq!(u16::from_be_bytes([export[10], export[11]]), RW);
    let bs = &r[1].2;
    assert_eq!(bs.len(), 14);
    assert_eq!(u16::from_be_bytes([bs[0], bs[1]]), INFO_BLOCK_SIZE);
    let words: Vec<u32> = bs[2..]
        .chunks(4)
        .map(|c| u32::from_be_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        words,
        vec![MIN_BLOCK_BYTES, PREFERRED_BLOCK_BYTES, MAX_PAYLOAD_BYTES]
    );
}

#[test]
fn export_name_reply_padding_follows_no_zeroes() {
    for (flags, want_len) in [(FIXED, 8 + 2 + 124), (FIXED_NZ, 8 + 2)] {
        let mut hs = Handshake::new(exports(), TlsPolicy::Disabled);
        let (out, step, _) = drive(&mut hs, &session(flags, &[opt(OPT_EXPORT_NAME, b"disk")]));
        assert_eq!(
            step,
            Ok(Step::Transmission(Negotiated {
                export: 0,
                tx_flags: RW
            }))
        );
        assert_eq!(out.len(), want_len);
        assert_eq!(u64::from_be_bytes(out[0..8].try_into().unwrap()), 1 << 20);
    }
}

#[test]
fn tls_upgrade_then_go() {
    let mut hs = Handshake::new(exports(), TlsPolicy::Required);
    let (_, step, _) = drive(&mut hs, &session(FIXED, &[opt(OPT_STARTTLS, &[])]));
    assert_eq!(step, Ok(Step::StartTls));
    hs.tls_established();
    let mut out = Vec::new();
    let mut input = opt(OPT_STARTTLS, &[]);
    input.extend(opt(OPT_GO, &go_data("disk", &[])));
    let mut pos = 0;
    let mut last = Step::Continue;
    while hs.bytes_wanted() > 0 && pos < input.len() {
        let n = hs.bytes_wanted();
        last = hs.feed(&input[pos..pos + n]).unwrap();
        pos += n;
        out.extend(hs.take_output());
    }
    assert_eq!(
        types(&replies(&out)),
        vec![REP_ERR_INVALID, REP_INFO, REP_INFO, REP_ACK]
    );
    assert_eq!(
        last,
        Step::Transmission(Negotiated {
            export: 0,
            tx_flags: RW
        })
    );
}

#[test]
fn shutdown_refuses_options_but_allows_abort() {
    let mut hs = Handshake::new(exports(), TlsPolicy::Disabled);
    hs.set_shutting_down();
    let input = session(
        FIXED,
        &[opt(OPT_GO, &go_data("disk", &[])), opt(OPT_ABORT, &[])],
    );
    let (out, step, _) = drive(&mut hs, &input);
    assert_eq!(types(&replies(&out)), vec![REP_ERR_SHUTDOWN, REP_ACK]);
    assert_eq!(step, Ok(Step::Abort));
}

#[test]
fn too_many_options_disconnects() {
    let mut hs = Handshake::new(exports(), TlsPolicy::Disabled);
    let opts: Vec<Vec<u8>> = (0..=OPTIONS_PER_CONNECTION_MAX)
        .map(|_| opt(99, &[]))
        .collect();
    let (_, step, _) = drive(&mut hs, &session(FIXED, &opts));
    assert!(matches!(step, Err(e) if e.contains("too many options")));
}

#[test]
fn overfeeding_is_a_caller_bug_not_a_panic() {
    let mut hs = Handshake::new(exports(), TlsPolicy::Disabled);
    assert!(matches!(hs.feed(&[0; 5]), Err(crate::Error::Bug(_))));
}

fn limits(read_only: bool) -> TransmissionLimits {
    TransmissionLimits {
        size_bytes: 1 << 20,
        tx_flags: if read_only { RW | TX_READ_ONLY } else { RW },
        min_block_bytes: 512,
        max_payload_bytes: MAX_PAYLOAD_BYTES,
    }
}

fn hdr(kind: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
    RequestHeader {
        flags,
        kind,
        cookie: 0xc0ffee,
        offset,
        length,
    }
}

#[test]
fn request_validation_table() {
    use Decoded::*;
    use NbdError::*;
    let rej = |e, skip| Reject {
        cookie: 0xc0ffee,
        error: e,
        skip_payload_bytes: skip,
    };
    let ok = |command| {
        Ok(Request {
            cookie: 0xc0ffee,
            command,
        })
    };
    let size = 1u64 << 20;
    #[rustfmt::skip]
    let cases: Vec<(&str, RequestHeader, bool, Decoded)> = vec![
        ("read", hdr(CMD_READ, 0, 4096, 4096), false, ok(Command::Read { offset: 4096, len: 4096 })),
        ("read with FUA (clients do this)", hdr(CMD_READ, CMD_FLAG_FUA, 0, 512), false, ok(Command::Read { offset: 0, len: 512 })),
        ("read zero length", hdr(CMD_READ, 0, 0, 0), false, ok(Command::Read { offset: 0, len: 0 })),
        ("read to the last byte", hdr(CMD_READ, 0, size - 512, 512), false, ok(Command::Read { offset: size - 512, len: 512 })),
        ("read past end", hdr(CMD_READ, 0, size - 512, 1024), false, rej(Inval, 0)),
        ("read offset overflow", hdr(CMD_READ, 0, u64::MAX - 100, 512), false, rej(Inval, 0)),
        ("read unaligned offset", hdr(CMD_READ, 0, 100, 512), false, rej(Inval, 0)),
        ("read unaligned length", hdr(CMD_READ, 0, 0, 100), false, rej(Inval, 0)),
        ("read over max payload", hdr(CMD_READ, 0, 0, MAX_PAYLOAD_BYTES + 512), false, rej(Inval, 0)),
        ("read with NO_HOLE", hdr(CMD_READ, CMD_FLAG_NO_HOLE, 0, 512), false, rej(Inval, 0)),
        ("write", hdr(CMD_WRITE, 0, 0, 8192), false, ok(Command::Write { offset: 0, len: 8192, fua: false })),
        ("write FUA", hdr(CMD_WRITE, CMD_FLAG_FUA, 512, 512), false, ok(Command::Write { offset: 512, len: 512, fua: true })),
        ("write past end skips payload", hdr(CMD_WRITE, 0, size, 512), false, rej(NoSpc, 512)),
        ("write unaligned skips payload", hdr(CMD_WRITE, 0, 1, 512), false, rej(Inval, 512)),
        ("write read-only", hdr(CMD_WRITE, 0, 0, 512), true, rej(Perm, 512)),
        ("write unknown flag", hdr(CMD_WRITE, 1 << 7, 0, 512), false, rej(Inval, 512)),
        ("write over max payload", hdr(CMD_WRITE, 0, 0, MAX_PAYLOAD_BYTES + 1), false, Fatal("write payload larger than the maximum payload")),
        ("trim", hdr(CMD_TRIM, 0, 0, 1 << 20), false, ok(Command::Trim { offset: 0, len: 1 << 20, fua: false })),
        ("trim past end", hdr(CMD_TRIM, 0, 512, 1 << 20), false, rej(Inval, 0)),
        ("trim read-only", hdr(CMD_TRIM, 0, 0, 512), true, rej(Perm, 0)),
        ("write zeroes no-hole fua", hdr(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, 0, 4096), false, ok(Command::WriteZeroes { offset: 0, len: 4096, fua: true, no_hole: true })),
        ("write zeroes past end", hdr(CMD_WRITE_ZEROES, 0, size, 512), false, rej(NoSpc, 0)),
        ("write zeroes read-only", hdr(CMD_WRITE_ZEROES, 0, 0, 512), true, rej(Perm, 0)),
        ("write zeroes fast-zero flag not offered", hdr(CMD_WRITE_ZEROES, 1 << 4, 0, 512), false, rej(Inval, 0)),
        ("flush", hdr(CMD_FLUSH, 0, 0, 0), false, ok(Command::Flush)),
        ("flush on read-only is fine", hdr(CMD_FLUSH, 0, 0, 0), true, ok(Command::Flush)),
        ("flush with length", hdr(CMD_FLUSH, 0, 0, 512), false, rej(Inval, 0)),
        ("disconnect", hdr(CMD_DISC, 0, 0, 0), false, ok(Command::Disconnect)),
        ("cache is unknown here", hdr(5, 0, 0, 512), false, rej(Inval, 0)),
        ("block status is unknown here", hdr(7, 0, 0, 512), false, rej(Inval, 0)),
        ("unknown command", hdr(0xffff, 0, 0, 0), false, rej(Inval, 0)),
    ];
    for (name, h, ro, want) in cases {
        assert_eq!(decode_request(&h, &limits(ro)), want, "case '{name}'");
        // Every header survives an encode/parse round trip.
        assert_eq!(
            RequestHeader::parse(&h.encode()).unwrap(),
            h,
            "case '{name}'"
        );
    }
}

#[test]
fn request_bad_magic_is_fatal() {
    let mut b = hdr(CMD_READ, 0, 0, 512).encode();
    b[0] ^= 1;
    assert!(matches!(
        RequestHeader::parse(&b),
        Err(crate::Error::Protocol(_))
    ));
}

#[test]
fn errno_mapping_table() {
    use ucrypt::Error;
    let io = |errno| Error::io("backing store", std::io::Error::from_raw_os_error(errno));
    let cases: Vec<(Error, NbdError)> = vec![
        (Error::ReadOnly("x".into()), NbdError::Perm),
        (
            Error::OutOfRange {
                offset: 0,
                len: 1,
                size: 0,
            },
            NbdError::NoSpc,
        ),
        (Error::InvalidArgument("x".into()), NbdError::Inval),
        (io(libc::EIO), NbdError::Io),
        (io(libc::ENOSPC), NbdError::NoSpc),
        (io(libc::EDQUOT), NbdError::NoSpc),
        (io(libc::EFBIG), NbdError::NoSpc),
        (io(libc::ENOMEM), NbdError::NoMem),
        (io(libc::EOVERFLOW), NbdError::Overflow),
        (io(libc::EOPNOTSUPP), NbdError::NotSup),
        (io(libc::ESHUTDOWN), NbdError::Shutdown),
        (io(libc::EPERM), NbdError::Perm),
        (io(libc::ENXIO), NbdError::Io),
        (Error::Bug("x"), NbdError::Io),
    ];
    for (e, want) in cases {
        assert_eq!(NbdError::from_error(&e), want, "error {e}");
    }
    let r = encode_simple_reply(7, Some(NbdError::NoSpc));
    assert_eq!(
        u32::from_be_bytes(r[0..4].try_into().unwrap()),
        SIMPLE_REPLY_MAGIC
    );
    assert_eq!(u32::from_be_bytes(r[4..8].try_into().unwrap()), 28);
    assert_eq!(u64::from_be_bytes(r[8..16].try_into().unwrap()), 7);
    assert_eq!(&encode_simple_reply(7, None)[4..8], &[0, 0, 0, 0]);
}

/// xorshift64*: tiny, seedable, no dependency; the seed is printed so a failure replays.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// A valid session (handshake + requests) whose bytes are then mutated: flipped bytes, random
/// bytes, truncation, insertion, deletion. The codec must never panic, never ask for more than
/// its named limits, and every request it accepts must lie inside the export.
#[test]
fn seeded_mutation_of_sessions() {
    let seed: u64 = std::env::var("UCRYPT_NBD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x0005_eed0_f4bd);
    println!("seed {seed} (set UCRYPT_NBD_SEED to replay)");
    let mut rng = Rng(seed | 1);
    let mut base = session(
        FIXED_NZ,
        &[
            opt(OPT_LIST, &[]),
            opt(OPT_INFO, &go_data("ro", &[INFO_NAME])),
            opt(
                OPT_GO,
                &go_data("disk", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]),
            ),
        ],
    );
    let lim = limits(false);
    for (k, off, len) in [
        (CMD_WRITE, 0, 512),
        (CMD_READ, 0, 4096),
        (CMD_TRIM, 4096, 8192),
        (CMD_FLUSH, 0, 0),
    ] {
        base.extend(hdr(k, 0, off, len).encode());
        if k == CMD_WRITE {
            base.extend(vec![0xab; len as usize]);
        }
    }
    base.extend(hdr(CMD_DISC, 0, 0, 0).encode());
    let (mut accepted, mut transmissions) = (0u32, 0u32);
    for iter in 0..20_000 {
        let mut s = base.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(s.len());
            match rng.below(5) {
                0 => s[at] ^= 1 << rng.below(8),
                1 => s[at] = rng.next() as u8,
                2 => s.truncate(at),
                3 => s.insert(at, rng.next() as u8),
                _ => {
                    if !s.is_empty() {
                        s.remove(at.min(s.len() - 1));
                    }
                }
            }
            if s.is_empty() {
                break;
            }
        }
        let tls = if iter % 2 == 0 {
            TlsPolicy::Disabled
        } else {
            TlsPolicy::Required
        };
        let mut hs = Handshake::new(exports(), tls);
        let (out, step, consumed) = drive(&mut hs, &s);
        if !matches!(step, Ok(Step::Transmission(_))) {
            // Everything sent before anything but EXPORT_NAME's reply is well-formed replies.
            replies(&out);
        }
        let Ok(Step::Transmission(n)) = step else {
            continue;
        };
        transmissions += 1;
        let e = &exports()[n.export];
        let lim = TransmissionLimits {
            size_bytes: e.size_bytes,
            tx_flags: n.tx_flags,
            ..lim
        };
        let mut rest = &s[consumed..];
        while rest.len() >= REQUEST_HEADER_BYTES {
            let Ok(h) = RequestHeader::parse(rest[..REQUEST_HEADER_BYTES].try_into().unwrap())
            else {
                break;
            };
            rest = &rest[REQUEST_HEADER_BYTES..];
            match decode_request(&h, &lim) {
                Decoded::Ok(r) => {
                    accepted += 1;
                    match r.command {
                        Command::Read { offset, len }
                        | Command::Trim { offset, len, .. }
                        | Command::Write { offset, len, .. }
                        | Command::WriteZeroes { offset, len, .. } => {
                            assert!(
                                offset + u64::from(len) <= lim.size_bytes,
                                "seed {seed} iter {iter}"
                            );
                            assert_eq!(
                                (offset | u64::from(len)) % 512,
                                0,
                                "seed {seed} iter {iter}"
                            );
                            if matches!(r.command, Command::Write { .. }) {
                                assert!(lim.tx_flags & TX_READ_ONLY == 0);
                                rest = &rest[rest.len().min(len as usize)..];
                            }
                        }
                        Command::Flush => {}
                        Command::Disconnect => break,
                    }
                }
                Decoded::Reject {
                    skip_payload_bytes, ..
                } => {
                    assert!(skip_payload_bytes <= MAX_PAYLOAD_BYTES);
                    rest = &rest[rest.len().min(skip_payload_bytes as usize)..];
                }
                Decoded::Fatal(_) => break,
            }
        }
    }
    println!("{transmissions} sessions reached transmission, {accepted} requests accepted");
    // The mutations are light enough that many sessions survive: if none did, the test would
    // not be testing the transmission path.
    assert!(
        transmissions > 1000 && accepted > 1000,
        "seed {seed}: mutation too destructive"
    );
}
