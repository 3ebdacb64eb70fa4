//! TLS (NBD_OPT_STARTTLS) with x509 certificates made at test time by the `openssl` CLI:
//! qemu-img and libnbd connect with the right CA and client certificate; clients with a
//! certificate from another CA, without a certificate, or without TLS are refused.
//! Debian packages: openssl, qemu-utils, libnbd-bin.

mod nbd_common;

use nbd_common::*;

/// Makes a CA and a certificate signed by it into `dir` (`{name}-cert.pem`, `{name}-key.pem`).
const CLIENT_EXT: &str = "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n";

/// A qemu/libnbd client credentials directory: ca-cert.pem and optionally a client pair.
fn client_dir(dir: &TempDir, sub: &str, ca: &str, client: Option<&str>) -> String {
    let d = dir.path(sub);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(dir.path(&format!("{ca}-cert.pem")), d.join("ca-cert.pem")).unwrap();
    if let Some(c) = client {
        std::fs::copy(
            dir.path(&format!("{c}-cert.pem")),
            d.join("client-cert.pem"),
        )
        .unwrap();
        std::fs::copy(dir.path(&format!("{c}-key.pem")), d.join("client-key.pem")).unwrap();
    }
    d.to_string_lossy().into_owned()
}

fn port_of(uri: &str) -> String {
    // nbds://127.0.0.1:PORT/NAME
    uri.rsplit_once(':')
        .unwrap()
        .1
        .split('/')
        .next()
        .unwrap()
        .to_string()
}

fn qemu_img(creds: &str, port: &str, cmd: &[&str]) -> (bool, String) {
    let obj = format!("tls-creds-x509,id=tls0,dir={creds},endpoint=client");
    let opts = format!("driver=nbd,host=127.0.0.1,port={port},export=disk,tls-creds=tls0");
    let mut args: Vec<&str> = vec![cmd[0], "--object", &obj, "--image-opts"];
    args.extend_from_slice(&cmd[1..]);
    args.push(&opts);
    run("qemu-img", &args)
}

#[test]
fn tls_with_client_certificates() {
    if !need("openssl", "openssl")
        || !need("qemu-img", "qemu-utils")
        || !need("nbdinfo", "libnbd-bin")
    {
        return;
    }
    let dir = TempDir::new("tls");
    ca(&dir, "ca");
    ca(&dir, "rogue");
    leaf(&dir, "ca", "server", SERVER_EXT);
    leaf(&dir, "ca", "client", CLIENT_EXT);
    leaf(&dir, "rogue", "intruder", CLIENT_EXT);
    make_image(&dir.path("disk"), 8 << 20, Some(0x7e5));
    let (cert, key, cacert, disk) = (
        dir.s("server-cert.pem"),
        dir.s("server-key.pem"),
        dir.s("ca-cert.pem"),
        dir.s("disk"),
    );
    let srv = Server::start(
        &[
            &disk,
            "--nbd",
            "tcp:127.0.0.1:0",
            "--unencrypted",
            "--export-name",
            "disk",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-ca",
            &cacert,
        ],
        1,
    );
    assert!(srv.uri().starts_with("nbds://127.0.0.1:"), "{}", srv.uri());
    let port = port_of(srv.uri());

    let good = client_dir(&dir, "good", "ca", Some("client"));
    let (yes, out) = qemu_img(&good, &port, &["info"]);
    assert!(
        yes && out.contains("8 MiB"),
        "qemu-img over TLS failed:\n{out}"
    );
    ok(
        "qemu-io",
        &[
            "--object",
            &format!("tls-creds-x509,id=tls0,dir={good},endpoint=client"),
            "--image-opts",
            "-c",
            "write -P 0x3c 0 1M",
            "-c",
            "read -P 0x3c 0 1M",
            &format!("driver=nbd,host=127.0.0.1,port={port},export=disk,tls-creds=tls0"),
        ],
    );
    let info = ok(
        "nbdinfo",
        &[&format!(
            "nbds://127.0.0.1:{port}/disk?tls-certificates={good}"
        )],
    );
    assert!(
        info.contains("with TLS") && info.contains("8388608"),
        "{info}"
    );

    // Refusals, each must fail; the server must keep serving afterwards.
    let wrong_cert = client_dir(&dir, "rogue", "ca", Some("intruder"));
    let no_cert = client_dir(&dir, "nocert", "ca", None);
    let distrusting = client_dir(&dir, "distrust", "rogue", Some("intruder"));
    for (what, creds) in [
        ("client cert from another CA", &wrong_cert),
        ("no client cert", &no_cert),
        ("client does not trust server", &distrusting),
    ] {
        let (yes, out) = qemu_img(creds, &port, &["info"]);
        assert!(!yes, "{what}: accepted:\n{out}");
    }
    let (yes, out) = run("nbdinfo", &[&format!("nbd://127.0.0.1:{port}/disk")]);
    assert!(!yes, "plaintext client accepted:\n{out}");
    let (yes, out) = qemu_img(&good, &port, &["info"]);
    assert!(yes, "server stopped serving after refusals:\n{out}");
    // Stop while a TLS client is mid-session: its acknowledged write must be on disk and the
    // server must exit 0 (the TLS relay half-closes so in-flight replies still go out).
    let mut client = std::process::Command::new("qemu-io")
        .args([
            "--object",
            &format!("tls-creds-x509,id=tls0,dir={good},endpoint=client"),
            "--image-opts",
            "-c",
            "write -P 0x4d 1M 1M",
            "-c",
            "sleep 2000",
            &format!("driver=nbd,host=127.0.0.1,port={port},export=disk,tls-creds=tls0"),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let out = client.stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(out));
    assert!(lines.any(|l| l.map(|l| l.starts_with("wrote 1048576/")).unwrap_or(false)));
    assert_eq!(srv.stop(), Some(0));
    let _ = wait_timeout(&mut client, std::time::Duration::from_secs(20));
    let data = std::fs::read(dir.path("disk")).unwrap();
    assert!(data[..1 << 20].iter().all(|&b| b == 0x3c));
    assert!(data[1 << 20..2 << 20].iter().all(|&b| b == 0x4d));
}

#[test]
fn tls_without_client_ca_accepts_any_tls_client() {
    if !need("openssl", "openssl") || !need("nbdinfo", "libnbd-bin") {
        return;
    }
    let dir = TempDir::new("tls-anon");
    ca(&dir, "ca");
    leaf(&dir, "ca", "server", SERVER_EXT);
    make_image(&dir.path("disk"), 8 << 20, None);
    let (cert, key, disk) = (
        dir.s("server-cert.pem"),
        dir.s("server-key.pem"),
        dir.s("disk"),
    );
    let srv = Server::start(
        &[
            &disk,
            "--nbd",
            "tcp:127.0.0.1:0",
            "--unencrypted",
            "--export-name",
            "disk",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ],
        1,
    );
    let port = port_of(srv.uri());
    let creds = client_dir(&dir, "c", "ca", None);
    let info = ok(
        "nbdinfo",
        &[&format!(
            "nbds://127.0.0.1:{port}/disk?tls-certificates={creds}"
        )],
    );
    assert!(info.contains("8388608"), "{info}");
    // Many requests in flight on several TLS connections, both directions, exact round trip:
    // exercises the relay's back-pressure.
    if need("nbdcopy", "libnbd-bin") {
        let uri = format!("nbds://127.0.0.1:{port}/disk?tls-certificates={creds}");
        make_image(&dir.path("src"), 8 << 20, Some(0x715));
        ok(
            "nbdcopy",
            &[
                "--connections=4",
                "--requests=64",
                "--request-size=65536",
                &dir.s("src"),
                &uri,
            ],
        );
        ok(
            "nbdcopy",
            &["--connections=4", "--requests=64", &uri, &dir.s("back")],
        );
        assert!(
            std::fs::read(dir.path("back")).unwrap() == std::fs::read(dir.path("src")).unwrap()
        );
        assert!(
            std::fs::read(dir.path("disk")).unwrap() == std::fs::read(dir.path("src")).unwrap()
        );
    }
    // Certificate and key problems are reported at start-up, not at the first client.
    let (yes, out) = run(
        UCRYPT,
        &[
            "serve",
            &disk,
            "--nbd",
            "tcp:127.0.0.1:0",
            "--unencrypted",
            "--tls-cert",
            &key,
            "--tls-key",
            &key,
        ],
    );
    assert!(!yes && out.contains("certificate"), "{out}");
}
