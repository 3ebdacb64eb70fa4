//! The NBD client backend against real servers: nbdkit (memory and file plugins, the
//! blocksize-policy filter, TLS) over unix sockets and TCP, and qemu-storage-daemon exporting a
//! file; reconnection across an nbdkit killed and restarted; the remote timeout; and a LUKS-less
//! `Volume` whose ciphertext on the remote equals the same volume's over memory.
//! Debian packages: nbdkit, qemu-system-common (qemu-storage-daemon), openssl. A missing tool
//! prints `SKIPPED: …` (and fails under CI, which installs them).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ucrypt::backend::{Backend, MemBackend};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};
use ucrypt_nbd::{ClientOptions, NbdBackend, NbdUri};

// ---- helpers ----

fn need(prog: &str, package: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {prog}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        if std::env::var_os("CI").is_some() {
            panic!("{prog} (Debian package {package}) is required under CI");
        }
        println!("SKIPPED: {prog} not installed (Debian package {package})");
    }
    found
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "ucrypt-nbdc-it-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random bytes (xorshift), so failures replay from the printed seed.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.extend_from_slice(&s.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A server process we started; killed (by its own handle) when dropped.
struct Proc(Child);

impl Proc {
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

enum Addr {
    Unix(PathBuf),
    Tcp(u16),
}

impl Addr {
    fn reachable(&self) -> bool {
        match self {
            Addr::Unix(p) => std::os::unix::net::UnixStream::connect(p).is_ok(),
            Addr::Tcp(port) => std::net::TcpStream::connect(("127.0.0.1", *port)).is_ok(),
        }
    }
    fn args(&self) -> Vec<String> {
        match self {
            Addr::Unix(p) => vec!["-U".into(), p.to_string_lossy().into_owned()],
            Addr::Tcp(port) => vec![
                "-i".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string(),
            ],
        }
    }
    fn uri(&self, tls: bool, export: &str) -> NbdUri {
        let s = match self {
            Addr::Unix(p) => format!(
                "nbd{}+unix:///{export}?socket={}",
                if tls { "s" } else { "" },
                p.display()
            ),
            Addr::Tcp(port) => {
                format!(
                    "nbd{}://127.0.0.1:{port}/{export}",
                    if tls { "s" } else { "" }
                )
            }
        };
        NbdUri::parse(&s).unwrap()
    }
}

fn wait_up(addr: &Addr, p: &mut Proc) {
    let t0 = Instant::now();
    while !addr.reachable() {
        if let Ok(Some(st)) = p.0.try_wait() {
            panic!("server exited at start: {st}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn nbdkit(addr: &Addr, extra: &[&str]) -> Proc {
    if let Addr::Unix(p) = addr {
        let _ = std::fs::remove_file(p);
    }
    let mut args: Vec<String> = vec!["-f".into(), "--exit-with-parent".into()];
    args.extend(addr.args());
    args.extend(extra.iter().map(|s| s.to_string()));
    let child = Command::new("nbdkit")
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut p = Proc(child);
    wait_up(addr, &mut p);
    p
}

fn opts(connections: usize, timeout: Duration) -> ClientOptions {
    ClientOptions {
        connections,
        remote_timeout: timeout,
        ..ClientOptions::default()
    }
}

/// Many threads write random patterns to their own regions and read them back; then flush,
/// trim and write-zeroes, each checked by reading.
fn exercise(b: &Arc<NbdBackend>, seed: u64) {
    println!("exercise {} seed {seed}", b.describe());
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || {
                let region = 1u64 << 20;
                let base = t * region;
                let mut at = 0u64;
                let mut k = 0u64;
                while at < region {
                    let len = (4096usize << (k % 6)).min((region - at) as usize);
                    let p = pattern(len, seed ^ (t << 40) ^ k);
                    b.write_at(&p, base + at).unwrap();
                    at += len as u64;
                    k += 1;
                }
                let mut got = vec![0u8; region as usize];
                b.read_exact_at(&mut got, base).unwrap();
                let (mut at, mut k) = (0u64, 0u64);
                while at < region {
                    let len = (4096usize << (k % 6)).min((region - at) as usize);
                    let p = pattern(len, seed ^ (t << 40) ^ k);
                    assert!(
                        got[at as usize..at as usize + len] == p[..],
                        "seed {seed} thread {t} at {at}"
                    );
                    at += len as u64;
                    k += 1;
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    b.flush().unwrap();
    b.write_zeroes(8192, 65536).unwrap();
    let mut r = vec![1u8; 65536];
    b.read_exact_at(&mut r, 8192).unwrap();
    assert!(r.iter().all(|&x| x == 0), "write_zeroes");
    b.discard(1 << 20, 1 << 20).unwrap();
    b.flush().unwrap();
}

// ---- tests ----

#[test]
fn nbdkit_memory_over_unix_and_tcp() {
    if !need("nbdkit", "nbdkit") {
        return;
    }
    let dir = TempDir::new("mem");
    for (i, addr) in [Addr::Unix(dir.path("s")), Addr::Tcp(free_port())]
        .into_iter()
        .enumerate()
    {
        let _srv = nbdkit(&addr, &["memory", "64M"]);
        let b =
            Arc::new(NbdBackend::connect(&addr.uri(false, ""), &ClientOptions::default()).unwrap());
        assert_eq!(b.size(), 64 << 20);
        // nbdkit's memory plugin advertises CAN_MULTI_CONN: one connection per core, ≤ 8.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(b.connections(), cores.clamp(1, 8));
        // No block sizes advertised: the client still addresses 512-byte blocks.
        assert_eq!(b.logical_block_bytes(), 512);
        exercise(&b, 0x5eed_0000 + i as u64);
        // Trimmed memory reads back as zeroes in nbdkit's memory plugin.
        let mut r = vec![1u8; 4096];
        b.read_exact_at(&mut r, 1 << 20).unwrap();
        assert!(r.iter().all(|&x| x == 0), "trim");
    }
}

#[test]
fn nbdkit_block_size_constraints_are_honoured() {
    if !need("nbdkit", "nbdkit") {
        return;
    }
    let dir = TempDir::new("bs");
    let addr = Addr::Unix(dir.path("s"));
    // Any request breaking the advertised sizes fails with EINVAL instead of being served.
    let _srv = nbdkit(
        &addr,
        &[
            "--filter=blocksize-policy",
            "memory",
            "16M",
            "blocksize-minimum=4096",
            "blocksize-preferred=65536",
            "blocksize-maximum=65536",
            "blocksize-error-policy=error",
        ],
    );
    let b = Arc::new(
        NbdBackend::connect(&addr.uri(false, ""), &opts(2, Duration::from_secs(30))).unwrap(),
    );
    assert_eq!(b.logical_block_bytes(), 4096);
    let g = b.geometry();
    assert_eq!(
        (
            g.min_block_bytes,
            g.preferred_block_bytes,
            g.max_payload_bytes
        ),
        (4096, 65536, 65536)
    );
    // 1 MiB + 4 KiB in one call: cut into 65536-byte requests.
    let p = pattern((1 << 20) + 4096, 77);
    b.write_at(&p, 4096).unwrap();
    let mut r = vec![0u8; p.len()];
    b.read_exact_at(&mut r, 4096).unwrap();
    assert!(r == p);
    b.write_zeroes(4096, 1 << 20).unwrap();
    b.read_exact_at(&mut r, 4096).unwrap();
    assert!(r[..1 << 20].iter().all(|&x| x == 0));
    // 512-byte requests are refused before they reach the server.
    assert!(matches!(
        b.write_at(&[0u8; 512], 0),
        Err(ucrypt::Error::InvalidArgument(_))
    ));
}

#[test]
fn qemu_storage_daemon_file_export_holds_what_was_written() {
    if !need("qemu-storage-daemon", "qemu-system-common") {
        return;
    }
    let dir = TempDir::new("qsd");
    let file = dir.path("disk.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let sock = dir.path("s");
    let addr = Addr::Unix(sock.clone());
    let child = Command::new("qemu-storage-daemon")
        .args([
            "--blockdev",
            &format!("driver=file,node-name=f,filename={}", file.display()),
            "--nbd-server",
            &format!("addr.type=unix,addr.path={}", sock.display()),
            "--export",
            "type=nbd,id=e,node-name=f,name=disk,writable=on",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut srv = Proc(child);
    wait_up(&addr, &mut srv);
    let b =
        Arc::new(NbdBackend::connect(&addr.uri(false, "disk"), &ClientOptions::default()).unwrap());
    assert_eq!(b.size(), 16 << 20);
    let mut expect = vec![0u8; 16 << 20];
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || {
                let mut written = Vec::new();
                for k in 0..64u64 {
                    let off = (t * 64 + k) * 65536 + (k % 7) * 512;
                    let p = pattern(4096 + 512 * (k as usize % 9), t * 100 + k);
                    b.write_at(&p, off).unwrap();
                    written.push((off, p));
                }
                written
            })
        })
        .collect();
    for t in threads {
        for (off, p) in t.join().unwrap() {
            expect[off as usize..off as usize + p.len()].copy_from_slice(&p);
        }
    }
    b.flush().unwrap();
    drop(b);
    let got = std::fs::read(&file).unwrap();
    assert!(got == expect, "the file differs from what was written");
}

/// Makes a CA and a leaf signed by it with `openssl` (as crates/ucrypt-cli/tests/nbd_tls.rs).
fn make_ca(dir: &Path, name: &str) {
    let ok = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{}/{name}-key.pem", dir.display()),
            "-out",
            &format!("{}/{name}-cert.pem", dir.display()),
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "openssl req -x509");
}

fn make_leaf(dir: &Path, ca: &str, name: &str, ext: &str) {
    let d = dir.display();
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    let ok = Command::new("openssl")
        .args([
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{d}/{name}-key.pem"),
            "-out",
            &format!("{d}/{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "openssl req -new");
    let ok = Command::new("openssl")
        .args([
            "x509",
            "-req",
            "-in",
            &format!("{d}/{name}.csr"),
            "-CA",
            &format!("{d}/{ca}-cert.pem"),
            "-CAkey",
            &format!("{d}/{ca}-key.pem"),
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &format!("{d}/{name}-cert.pem"),
            "-extfile",
            &format!("{d}/{name}.ext"),
        ])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "openssl x509 -req");
}

#[test]
fn tls_with_nbdkit_right_and_wrong_ca_and_client_certificates() {
    if !need("nbdkit", "nbdkit") || !need("openssl", "openssl") {
        return;
    }
    let dir = TempDir::new("tls");
    let d = dir.0.clone();
    make_ca(&d, "ca");
    make_ca(&d, "rogue");
    make_leaf(
        &d,
        "ca",
        "server",
        "basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n\
         extendedKeyUsage=serverAuth\n",
    );
    make_leaf(
        &d,
        "ca",
        "client",
        "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
    );
    // nbdkit's certificate directory layout.
    let certs = dir.path("nbdkit");
    std::fs::create_dir_all(&certs).unwrap();
    for (from, to) in [
        ("ca-cert.pem", "ca-cert.pem"),
        ("server-cert.pem", "server-cert.pem"),
        ("server-key.pem", "server-key.pem"),
    ] {
        std::fs::copy(d.join(from), certs.join(to)).unwrap();
    }
    let tls_dir = format!("--tls-certificates={}", certs.display());
    let with_ca = |ca: &str| ClientOptions {
        tls_ca_file: Some(d.join(format!("{ca}-cert.pem"))),
        connections: 2,
        remote_timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    };

    // TCP and a unix socket (the certificate names localhost).
    for addr in [Addr::Tcp(free_port()), Addr::Unix(dir.path("s"))] {
        let _srv = nbdkit(&addr, &["--tls=require", &tls_dir, "memory", "16M"]);
        let b = Arc::new(NbdBackend::connect(&addr.uri(true, ""), &with_ca("ca")).unwrap());
        exercise(&b, 0x715);
        drop(b);

        // A CA that did not sign the server's certificate is refused, saying why.
        let e = NbdBackend::connect(&addr.uri(true, ""), &with_ca("rogue")).unwrap_err();
        let msg = e.to_string();
        println!("wrong CA: {msg}");
        assert!(
            msg.contains("TLS handshake") && msg.contains("certificate"),
            "wrong CA: {msg}"
        );
        // Without TLS, the server's refusal is named.
        let e = NbdBackend::connect(&addr.uri(false, ""), &ClientOptions::default()).unwrap_err();
        assert!(e.to_string().contains("NBD_REP_ERR_TLS_REQD"), "{e}");
    }

    // A server that asks for client certificates.
    let addr = Addr::Tcp(free_port());
    let _srv = nbdkit(
        &addr,
        &[
            "--tls=require",
            &tls_dir,
            "--tls-verify-peer",
            "memory",
            "16M",
        ],
    );
    let mut o = with_ca("ca");
    o.tls_cert_file = Some(d.join("client-cert.pem"));
    o.tls_key_file = Some(d.join("client-key.pem"));
    let b = NbdBackend::connect(&addr.uri(true, ""), &o).unwrap();
    b.write_at(&pattern(4096, 1), 0).unwrap();
    drop(b);
    assert!(
        NbdBackend::connect(&addr.uri(true, ""), &with_ca("ca")).is_err(),
        "no client certificate, yet accepted"
    );
}

#[test]
fn nbdkit_killed_and_restarted_loses_no_acknowledged_write() {
    if !need("nbdkit", "nbdkit") {
        return;
    }
    let dir = TempDir::new("reconnect");
    let file = dir.path("disk.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let addr = Addr::Unix(dir.path("s"));
    let file_arg = format!("file={}", file.display());
    let mut srv = nbdkit(&addr, &["file", &file_arg]);
    let b = Arc::new(
        NbdBackend::connect(&addr.uri(false, ""), &opts(2, Duration::from_secs(30))).unwrap(),
    );
    let acked: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..8u64)
        .map(|t| {
            let (b, acked, stop) = (b.clone(), acked.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let off = (t * 512 + k % 512) * 8192;
                    let seed = (t << 32) | k;
                    b.write_at(&pattern(8192, seed), off).unwrap();
                    acked.lock().unwrap().push((off, seed));
                    if k % 32 == 31 {
                        b.flush().unwrap();
                    }
                    k += 1;
                }
            })
        })
        .collect();
    // Two kills while writes are in flight, the second with a longer outage.
    for outage_ms in [100, 700] {
        std::thread::sleep(Duration::from_millis(400));
        srv.kill();
        std::thread::sleep(Duration::from_millis(outage_ms));
        srv = nbdkit(&addr, &["file", &file_arg]);
    }
    std::thread::sleep(Duration::from_millis(400));
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    let b_reconnections = b.reconnections();
    assert!(b_reconnections >= 2, "reconnections: {b_reconnections}");
    b.flush().unwrap();
    drop(b);
    let mut last = std::collections::HashMap::new();
    for (off, seed) in acked.lock().unwrap().iter() {
        last.insert(*off, *seed);
    }
    println!(
        "{} offsets written, {} reconnections",
        last.len(),
        b_reconnections
    );
    let data = std::fs::read(&file).unwrap();
    for (off, seed) in last {
        assert!(
            data[off as usize..off as usize + 8192] == pattern(8192, seed)[..],
            "acknowledged write at {off} (seed {seed:#x}) is not in the file"
        );
    }
}

#[test]
fn without_the_server_requests_fail_after_the_remote_timeout() {
    if !need("nbdkit", "nbdkit") {
        return;
    }
    let dir = TempDir::new("timeout");
    let addr = Addr::Unix(dir.path("s"));
    let mut srv = nbdkit(&addr, &["memory", "16M"]);
    let uri = addr.uri(false, "");
    let b = Arc::new(NbdBackend::connect(&uri, &opts(1, Duration::from_millis(800))).unwrap());
    b.write_at(&[1u8; 4096], 0).unwrap();
    srv.kill();
    let t0 = Instant::now();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || b.write_at(&[2u8; 4096], t * 4096).unwrap_err())
        })
        .collect();
    for t in threads {
        let e = t.join().unwrap();
        let msg = e.to_string();
        println!("{msg}");
        assert!(msg.contains(&uri.to_string()), "{msg}");
        assert!(msg.contains("remote timeout of 800 ms"), "{msg}");
    }
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_secs(5),
        "failed after {took:?}"
    );
    let e = b.flush().unwrap_err();
    assert!(e.to_string().contains("NBD_CMD_FLUSH"), "{e}");
}

#[test]
fn volume_ciphertext_on_the_remote_equals_the_local_one() {
    if !need("nbdkit", "nbdkit") {
        return;
    }
    let dir = TempDir::new("volume");
    let file = dir.path("disk.img");
    const SIZE: u64 = 8 << 20;
    std::fs::File::create(&file).unwrap().set_len(SIZE).unwrap();
    let addr = Addr::Unix(dir.path("s"));
    let _srv = nbdkit(&addr, &["file", &format!("file={}", file.display())]);
    let cfg = || {
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(7)).collect();
        let mut c = VolumeConfig::new(
            CipherSpec::AES_XTS_PLAIN64,
            SecretBytes::from_slice(&key),
            Geometry::new(SectorSize::S4096),
        );
        c.data_offset_bytes = 1 << 20;
        c
    };
    let nbd: Arc<dyn Backend> =
        Arc::new(NbdBackend::connect(&addr.uri(false, ""), &ClientOptions::default()).unwrap());
    let mem = Arc::new(MemBackend::new(SIZE));
    let remote = Volume::new(nbd, cfg()).unwrap();
    let local = Volume::new(mem.clone(), cfg()).unwrap();
    assert_eq!(remote.size(), local.size());
    // The same plaintext writes, unaligned ones included (read-modify-write in the volume).
    for (k, (off, len)) in [
        (0u64, 4096usize),
        (8192, 1 << 20),
        (12345, 777),
        (3 << 20, 65536),
    ]
    .into_iter()
    .enumerate()
    {
        let p = pattern(len, 0xc0de + k as u64);
        remote.write_at(&p, off).unwrap();
        local.write_at(&p, off).unwrap();
    }
    remote.write_zeroes(5 << 20, 8192).unwrap();
    local.write_zeroes(5 << 20, 8192).unwrap();
    remote.flush().unwrap();
    // Plaintext reads agree, and the remote file holds exactly the local ciphertext.
    let (mut a, mut b) = (vec![0u8; 4 << 20], vec![0u8; 4 << 20]);
    remote.read_at(&mut a, 0).unwrap();
    local.read_at(&mut b, 0).unwrap();
    assert!(a == b, "plaintext differs");
    drop(remote);
    let on_file = std::fs::read(&file).unwrap();
    let mut in_mem = vec![0u8; SIZE as usize];
    mem.read_exact_at(&mut in_mem, 0).unwrap();
    assert!(on_file == in_mem, "ciphertext on the NBD export differs");
    assert!(
        on_file[1 << 20..(1 << 20) + 4096] != pattern(4096, 0xc0de)[..],
        "plaintext reached the server"
    );
}

#[test]
fn our_own_tls_server_and_client_agree() {
    use ucrypt_nbd::server::{load_tls_config, serve, Listen, ServerOptions, TlsFiles};
    if !need("openssl", "openssl") {
        return;
    }
    let dir = TempDir::new("own-tls");
    let d = dir.0.clone();
    make_ca(&d, "ca");
    make_leaf(
        &d,
        "ca",
        "server",
        "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n",
    );
    make_leaf(
        &d,
        "ca",
        "client",
        "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
    );
    let tls = load_tls_config(&TlsFiles {
        cert: d.join("server-cert.pem"),
        key: d.join("server-key.pem"),
        client_ca: Some(d.join("ca-cert.pem")),
    })
    .unwrap();
    // The export is itself an encrypted volume over memory.
    let key: Vec<u8> = (0..64u8).collect();
    let vol = Volume::new(
        Arc::new(MemBackend::new(4 << 20)),
        VolumeConfig::new(
            CipherSpec::AES_XTS_PLAIN64,
            SecretBytes::from_slice(&key),
            Geometry::new(SectorSize::S4096),
        ),
    )
    .unwrap();
    let sock = dir.path("s");
    let stop = ucrypt::Stop::new();
    let server = {
        let (stop, sock) = (stop.clone(), sock.clone());
        std::thread::spawn(move || {
            let opts = ServerOptions {
                read_only: false,
                tls: Some(tls),
                insecure_plaintext: false,
                pid_file: None,
                announce: false,
                poll: Duration::ZERO,
                poll_backoff: true,
                workers: ucrypt_nbd::server::WORKERS_PER_CONNECTION,
                idle_timeout: ucrypt_nbd::server::IDLE_TIMEOUT_DEFAULT,
                connections_max: ucrypt_nbd::server::CONNECTIONS_MAX_DEFAULT,
            };
            serve(
                vec![("v".into(), Arc::new(vol) as Arc<dyn BlockDev>)],
                &Listen::Unix(sock),
                opts,
                stop,
            )
        })
    };
    let addr = Addr::Unix(sock);
    let t0 = Instant::now();
    while !addr.reachable() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = ClientOptions {
        tls_ca_file: Some(d.join("ca-cert.pem")),
        tls_cert_file: Some(d.join("client-cert.pem")),
        tls_key_file: Some(d.join("client-key.pem")),
        connections: 2,
        remote_timeout: Duration::from_secs(10),
    };
    let b = Arc::new(NbdBackend::connect(&addr.uri(true, "v"), &o).unwrap());
    assert_eq!(b.connections(), 2);
    let p = pattern(1 << 20, 3);
    b.write_at(&p, 4096).unwrap();
    b.flush().unwrap();
    let mut r = vec![0u8; 1 << 20];
    b.read_exact_at(&mut r, 4096).unwrap();
    assert!(r == p);
    drop(b);
    // Without a client certificate the server refuses the session.
    let no_cert = ClientOptions {
        tls_cert_file: None,
        tls_key_file: None,
        ..o
    };
    let e = NbdBackend::connect(&addr.uri(true, "v"), &no_cert).unwrap_err();
    println!("no client certificate: {e}");
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
    stop.request();
    server.join().unwrap().unwrap();
}

#[test]
fn fua_writes_carry_the_fua_flag_and_send_no_flush() {
    if !need("nbdkit", "nbdkit") {
        return;
    }
    let dir = TempDir::new("fua");
    let log = dir.path("log");
    let addr = Addr::Unix(dir.path("s"));
    let logfile = format!("logfile={}", log.display());
    let srv = nbdkit(&addr, &["--filter=log", "memory", "8M", &logfile]);
    let b = NbdBackend::connect(&addr.uri(false, ""), &ClientOptions::default()).unwrap();
    let data = pattern(8192, 7);
    b.write_at_fua(&data, 4096).unwrap();
    b.write_at(&data, 65536).unwrap();
    let mut back = vec![0u8; 8192];
    b.read_exact_at(&mut back, 4096).unwrap();
    assert_eq!(back, data);
    drop(b);
    drop(srv);
    // nbdkit's log filter writes one line per request, with its flags.
    let text = std::fs::read_to_string(&log).unwrap();
    let writes: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(" Write ") && !l.contains("...Write"))
        .collect();
    assert!(
        writes
            .iter()
            .any(|l| l.contains("offset=0x1000") && l.contains("fua=1")),
        "no FUA write at 4096 in nbdkit's log:\n{text}"
    );
    assert!(
        writes
            .iter()
            .any(|l| l.contains("offset=0x10000") && l.contains("fua=0")),
        "the plain write at 65536 should carry no FUA:\n{text}"
    );
    assert!(
        !text.lines().any(|l| l.contains(" Flush ")),
        "a FUA write needs no flush:\n{text}"
    );
}
