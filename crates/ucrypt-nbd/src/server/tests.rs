//! In-process tests of `serve` over an in-memory device that injects errors and counts
//! flushes: device errors become NBD error replies for that request only, FUA and FLUSH reach
//! `BlockDev::flush`, and stopping flushes and returns.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ucrypt::{BlockDev, Error, Result};

use super::{serve, Listen, ServerOptions};

const SIZE: u64 = 1 << 20;
/// Reads here fail with EIO, writes with ENOSPC.
const BAD: std::ops::Range<u64> = 65536..131072;
/// Reads here panic (a device bug): the request must fail alone, the connection go on.
const PANIC_AT: u64 = 196608;

struct MemDev {
    data: Mutex<Vec<u8>>,
    flushes: AtomicU32,
}

fn io(errno: i32) -> Error {
    Error::io("injected", std::io::Error::from_raw_os_error(errno))
}

impl BlockDev for MemDev {
    fn size(&self) -> u64 {
        SIZE
    }
    fn block_size(&self) -> u32 {
        4096
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if BAD.contains(&offset) {
            return Err(io(libc::EIO));
        }
        assert_ne!(offset, PANIC_AT, "injected device bug");
        let d = self.data.lock().unwrap();
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        if BAD.contains(&offset) {
            return Err(io(libc::ENOSPC));
        }
        self.data.lock().unwrap()[offset as usize..offset as usize + buf.len()]
            .copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn discard(&self, _offset: u64, _len: u64) -> Result<()> {
        Err(io(libc::EOPNOTSUPP))
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.data.lock().unwrap()[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

fn req(s: &mut UnixStream, kind: u16, flags: u16, cookie: u64, offset: u64, len: u32) {
    let h = crate::proto::RequestHeader {
        flags,
        kind,
        cookie,
        offset,
        length: len,
    };
    s.write_all(&h.encode()).unwrap();
}

fn reply(s: &mut UnixStream) -> (u32, u64) {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    (
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
    )
}

#[test]
fn device_errors_fua_flush_and_stop() {
    let dir = std::env::temp_dir().join(format!("ucrypt-nbd-unit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("s");
    let dev = Arc::new(MemDev {
        data: Mutex::new(vec![7u8; SIZE as usize]),
        flushes: AtomicU32::new(0),
    });
    let stop = ucrypt::Stop::new();
    let server = {
        let (dev, stop, sock) = (dev.clone() as Arc<dyn BlockDev>, stop.clone(), sock.clone());
        std::thread::spawn(move || {
            let opts = ServerOptions {
                read_only: false,
                tls: None,
                insecure_plaintext: false,
                pid_file: None,
                announce: false,
                poll: std::time::Duration::from_micros(50),
                poll_backoff: true,
                workers: crate::server::WORKERS_PER_CONNECTION,
                idle_timeout: crate::server::IDLE_TIMEOUT_DEFAULT,
                connections_max: crate::server::CONNECTIONS_MAX_DEFAULT,
            };
            serve(vec![("m".into(), dev)], &Listen::Unix(sock), opts, stop)
        })
    };
    let mut s = loop {
        match UnixStream::connect(&sock) {
            Ok(s) => break s,
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greet = [0u8; 18];
    s.read_exact(&mut greet).unwrap();
    // Client flags, then EXPORT_NAME "m" (NO_ZEROES so the reply is 10 bytes).
    s.write_all(&3u32.to_be_bytes()).unwrap();
    let mut o = crate::proto::IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&1u32.to_be_bytes());
    o.extend_from_slice(&1u32.to_be_bytes());
    o.push(b'm');
    s.write_all(&o).unwrap();
    let mut x = [0u8; 10];
    s.read_exact(&mut x).unwrap();
    assert_eq!(u64::from_be_bytes(x[..8].try_into().unwrap()), SIZE);

    // (kind, flags, offset, len, expected NBD error)
    #[rustfmt::skip]
    let cases: [(u16, u16, u64, u32, u32); 7] = [
        (0, 0, BAD.start, 4096, 5),   // read fails: EIO, and no payload follows
        (0, 0, PANIC_AT, 4096, 5),    // device panics: EIO for this request only
        (1, 0, BAD.start, 4096, 28),  // write fails: ENOSPC
        (4, 0, 0, 4096, 95),          // trim unsupported by the device: ENOTSUP
        (1, 1, 0, 4096, 0),           // FUA write: succeeds, flushes
        (6, 2, 4096, 4096, 0),        // write zeroes, NO_HOLE
        (3, 0, 0, 0, 0),              // flush
    ];
    for (i, (kind, flags, off, len, want)) in cases.into_iter().enumerate() {
        let before = dev.flushes.load(Ordering::SeqCst);
        req(&mut s, kind, flags, i as u64, off, len);
        if kind == 1 {
            s.write_all(&vec![0x42; len as usize]).unwrap();
        }
        assert_eq!(reply(&mut s), (want, i as u64), "case {i}");
        let flushed = dev.flushes.load(Ordering::SeqCst) > before;
        assert_eq!(flushed, flags & 1 != 0 || kind == 3, "case {i}: flush");
    }
    // The stream is still in sync after the failed read: a good read returns its data.
    req(&mut s, 0, 0, 99, 0, 8192);
    assert_eq!(reply(&mut s), (0, 99));
    let mut d = vec![0u8; 8192];
    s.read_exact(&mut d).unwrap();
    assert!(d[..4096].iter().all(|&b| b == 0x42) && d[4096..].iter().all(|&b| b == 0));

    // Large writes (payloads received straight into their buffers, and the header after one
    // read alone) pipelined with small ones in one burst: every byte lands where it belongs.
    // (cookie, offset, len, fill byte)
    let burst: [(u64, u64, u32, u8); 4] = [
        (200, 262144, 256 << 10, 0xa1),
        (201, 12288, 4096, 0xb2),
        (202, 524288, 128 << 10, 0xc3),
        (203, 16384, 512, 0xd4),
    ];
    let mut bytes = Vec::new();
    for (cookie, off, len, fill) in burst {
        let h = crate::proto::RequestHeader {
            flags: 0,
            kind: 1,
            cookie,
            offset: off,
            length: len,
        };
        bytes.extend_from_slice(&h.encode());
        bytes.extend(std::iter::repeat_n(fill, len as usize));
    }
    s.write_all(&bytes).unwrap();
    let mut cookies: Vec<u64> = (0..burst.len())
        .map(|_| reply(&mut s))
        .map(|(e, c)| {
            assert_eq!(e, 0, "write {c}");
            c
        })
        .collect();
    cookies.sort();
    assert_eq!(cookies, [200, 201, 202, 203]);
    {
        let d = dev.data.lock().unwrap();
        for (cookie, off, len, fill) in burst {
            let r = off as usize..(off + u64::from(len)) as usize;
            assert!(d[r].iter().all(|&b| b == fill), "write {cookie}");
        }
    }

    let before = dev.flushes.load(Ordering::SeqCst);
    stop.request();
    server.join().unwrap().unwrap();
    assert!(
        dev.flushes.load(Ordering::SeqCst) > before,
        "stop did not flush"
    );
    let mut b = [0u8; 1];
    assert!(
        matches!(s.read(&mut b), Ok(0) | Err(_)),
        "connection left open after stop"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn listen_displays_as_it_is_written() {
    for s in ["unix:/run/x.sock", "tcp:127.0.0.1:10809", "tcp:[::1]:10809"] {
        let l: Listen = s.parse().unwrap();
        assert_eq!(l.to_string(), s);
        assert_eq!(l.to_string().parse::<Listen>().unwrap(), l);
    }
}
