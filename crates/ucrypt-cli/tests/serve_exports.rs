//! One `ucrypt serve` for many volumes: several VOLUMEs sharing the key options, `--export`s
//! with options of their own, names checked before anything is opened, and all or nothing at
//! start-up (a volume that fails to open names itself and none is served); a resize through
//! `--control` reaches new connections. Debian packages:
//! libnbd-bin (nbdinfo, nbdcopy).

mod nbd_common;

use std::process::{Command, Stdio};

use nbd_common::*;

const MIB: usize = 1 << 20;

/// A LUKS2 volume of `mib` MiB at `name` unlocked by the passphrase in `pass` (cheap PBKDF).
fn luks(dir: &TempDir, name: &str, mib: usize, pass: &str) {
    make_image(&dir.path(name), mib * MIB, None);
    ok(
        UCRYPT,
        &[
            "format",
            "-q",
            "--type",
            "luks2",
            "--key-file",
            &dir.s(pass),
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            &dir.s(name),
        ],
    );
}

/// `ucrypt serve ARGS` run to its end: (exit code, stderr, stdout).
fn serve_fails(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(UCRYPT)
        .arg("serve")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// (name, size, read-only) of every export the server at `sock` lists.
fn listed(sock: &str) -> Vec<(String, u64, bool)> {
    let list = ok(
        "nbdinfo",
        &["--json", "--list", &format!("nbd+unix:///?socket={sock}")],
    );
    let v: serde_json::Value = serde_json::from_str(&list).unwrap();
    v["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["export-name"].as_str().unwrap().to_string(),
                e["export-size"].as_u64().unwrap(),
                e["is_read_only"].as_bool().unwrap(),
            )
        })
        .collect()
}

#[test]
fn several_volumes_and_exports_from_one_server() {
    if !need("nbdinfo", "libnbd-bin") || !need("nbdcopy", "libnbd-bin") {
        return;
    }
    let dir = TempDir::new("many");
    std::fs::write(dir.path("pass"), b"shared passphrase").unwrap();
    std::fs::write(dir.path("pass-c"), b"c's own passphrase").unwrap();
    luks(&dir, "a.img", 20, "pass");
    luks(&dir, "b.img", 24, "pass");
    luks(&dir, "c.img", 28, "pass-c");
    make_image(&dir.path("src"), 4 * MIB, Some(0x5e7));
    let sock = dir.s("sock");
    let listen = format!("unix:{sock}");
    let c = format!(
        "--export=name=cee,path={},key-file={},readonly",
        dir.s("c.img"),
        dir.s("pass-c")
    );
    let srv = Server::start(
        &[
            &dir.s("a.img"),
            &dir.s("b.img"),
            "--key-file",
            &dir.s("pass"),
            &c,
            "--nbd",
            &listen,
        ],
        3,
    );
    // LUKS2 keeps 16 MiB of header at the front of each volume.
    let want = [
        ("a.img".to_string(), 4 * MIB as u64, false),
        ("b.img".to_string(), 8 * MIB as u64, false),
        ("cee".to_string(), 12 * MIB as u64, true),
    ];
    assert_eq!(listed(&sock), want);
    // Each export reaches its own volume: what is written to b reads back from b only.
    let b = format!("nbd+unix:///b.img?socket={sock}");
    ok("nbdcopy", &[&dir.s("src"), &b]);
    ok("nbdcopy", &[&b, &dir.s("back-b")]);
    ok("nbdcopy", &[srv.uri(), &dir.s("back-a")]);
    let src = std::fs::read(dir.path("src")).unwrap();
    assert!(std::fs::read(dir.path("back-b")).unwrap()[..4 * MIB] == src[..]);
    assert!(std::fs::read(dir.path("back-a")).unwrap()[..4 * MIB] != src[..]);
    let (good, out) = run(
        "nbdcopy",
        &[&dir.s("src"), &format!("nbd+unix:///cee?socket={sock}")],
    );
    assert!(!good, "write to the read-only export succeeded: {out}");
    assert_eq!(srv.stop(), Some(0));

    // --add-export is short for --export name=N,path=P, with the shared options.
    let add = format!("--add-export=again={}", dir.s("b.img"));
    let srv = Server::start(
        &[
            &dir.s("a.img"),
            "--key-file",
            &dir.s("pass"),
            &add,
            "--nbd",
            &listen,
        ],
        2,
    );
    let names: Vec<String> = listed(&sock).into_iter().map(|e| e.0).collect();
    assert_eq!(names, ["a.img", "again"]);
    assert_eq!(srv.stop(), Some(0));

    // `--control` answers for the first volume: `ucrypt resize VOLUME --control PATH` grows it
    // to its grown image, and a new connection is told the new size (NBD has no size-change
    // notice for the clients connected: the verb says so).
    let ctl = dir.s("control.sock");
    let srv = Server::start(
        &[
            &dir.s("a.img"),
            "--key-file",
            &dir.s("pass"),
            "--control",
            &ctl,
            "--nbd",
            &listen,
        ],
        1,
    );
    assert_eq!(listed(&sock)[0].1, 4 * MIB as u64);
    let a = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path("a.img"))
        .unwrap();
    a.set_len(24 * MIB as u64).unwrap();
    let out = Command::new(UCRYPT)
        .args(["resize", &dir.s("a.img"), "--control", &ctl])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("clients connected keep the size"), "{err}");
    assert_eq!(
        listed(&sock)[0].1,
        8 * MIB as u64,
        "a new connection's size"
    );
    assert_eq!(srv.stop(), Some(0));
}

#[test]
fn bad_exports_are_refused_and_none_is_served() {
    let dir = TempDir::new("bad");
    std::fs::write(dir.path("pass"), b"shared passphrase").unwrap();
    std::fs::write(dir.path("wrong"), b"not it").unwrap();
    luks(&dir, "a.img", 20, "pass");
    std::fs::create_dir(dir.path("other")).unwrap();
    std::fs::copy(dir.path("a.img"), dir.path("other/a.img")).unwrap();
    let listen = format!("unix:{}", dir.s("sock"));
    let (a, pass) = (dir.s("a.img"), dir.s("pass"));
    let export = |spec: String| format!("--export={spec}");
    // (arguments after VOLUME, exit code, what stderr must say)
    let rows: Vec<(Vec<String>, i32, String)> = vec![
        // Two exports named a.img.
        (
            vec![dir.s("other/a.img")],
            1,
            "'a.img' is given twice".into(),
        ),
        (
            vec![export(format!("name=a.img,path={}", dir.s("other/a.img")))],
            1,
            "'a.img' is given twice".into(),
        ),
        // Unknown keys and malformed specs, refused by name.
        (
            vec![export(format!("name=x,path={a},cache=none"))],
            1,
            "unknown key 'cache'".into(),
        ),
        (
            vec![export(format!("path={a}"))],
            1,
            "name=N and path=P".into(),
        ),
        (
            vec![export(format!("name=x,name=y,path={a}"))],
            1,
            "'name' given twice".into(),
        ),
        (
            vec![export("name=x,path=".into())],
            1,
            "'path' needs a value".into(),
        ),
        (
            vec!["--add-export=nothing".into()],
            1,
            "expected NAME=PATH".into(),
        ),
        // A volume that cannot be opened names itself; the good one is not served either.
        (vec![dir.s("missing.img")], 4, dir.s("missing.img")),
        (
            vec![export(format!(
                "name=w,path={},key-file={}",
                dir.s("other/a.img"),
                dir.s("wrong")
            ))],
            2,
            dir.s("other/a.img"),
        ),
    ];
    for (extra, code, says) in rows {
        let mut args: Vec<&str> = vec![&a, "--key-file", &pass, "--nbd", &listen];
        args.extend(extra.iter().map(String::as_str));
        let (got, err, out) = serve_fails(&args);
        assert_eq!(got, Some(code), "{extra:?}: {err}");
        assert!(
            err.contains(&says),
            "{extra:?}: stderr does not say {says:?}: {err}"
        );
        assert!(!out.contains("ready:"), "{extra:?}: served: {out}");
        assert!(!dir.path("sock").exists(), "{extra:?}: listening");
    }
}
