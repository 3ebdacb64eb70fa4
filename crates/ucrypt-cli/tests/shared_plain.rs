//! `open --type plain --shared`: several plain mappings of one volume, as cryptsetup's
//! compat-test maps two areas of one device (`create A DEV --offset 0 --size 256`, then
//! `create B DEV --offset 512 --size 256` fails, and passes with `--shared`). The command-line
//! checks are compared with cryptsetup 2.6.1's (`--test-args`: `--shared` only on a plain
//! `open`); the mappings are ucrypt's (cryptsetup's need device-mapper, which its own
//! compat-test exercises): a second mapping without `--shared` is refused (exit 5, as
//! cryptsetup's EBUSY), with it both serve, each its own area, and one that is not shared
//! still finds the volume in use while a shared one lives.
//!
//! The mappings need root, /dev/fuse and /dev/loop-control (FUSE + loop): SKIPPED otherwise.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::Path;

use cli_common::*;

/// 512-byte sectors of each mapping (compat-test's `--size 256`).
const AREA_SECTORS: u64 = 256;

#[test]
fn shared_is_taken_where_cryptsetup_takes_it() {
    if !have("cryptsetup") {
        println!("SKIPPED: needs cryptsetup");
        return;
    }
    let t = TempDir::new("shared-args");
    let img = t.sparse("v.img", 4 << 20);
    let img = s(&img);
    let cases: &[(&str, Vec<&str>)] = &[
        (
            "open --type plain",
            vec!["open", img, "n", "--type", "plain", "--shared"],
        ),
        (
            "open --type luks1",
            vec!["open", img, "n", "--type", "luks1", "--shared"],
        ),
        ("open, no type", vec!["open", img, "n", "--shared"]),
        ("close", vec!["close", "n", "--shared"]),
        ("luksDump", vec!["luksDump", img, "--shared"]),
    ];
    for (what, args) in cases {
        let codes: Vec<Option<i32>> = ["cryptsetup", UCRYPT]
            .iter()
            .map(|tool| {
                let mut a = args.clone();
                a.push("--test-args");
                run(tool, &a).status.code()
            })
            .collect();
        assert_eq!(
            codes[0], codes[1],
            "{what}: cryptsetup's exit code, then ucrypt's"
        );
    }
    let o = run(
        UCRYPT,
        &[
            "open",
            img,
            "n",
            "--type",
            "luks2",
            "--shared",
            "--test-args",
        ],
    );
    assert_eq!(
        stderr_line(&o),
        "Option --shared is allowed only for open of plain device."
    );
}

fn stderr_line(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).trim().to_string()
}

/// `ucrypt open VOLUME NAME` in plain mode over the area at `offset` sectors; its exit code
/// and output.
fn open_area(img: &Path, key: &Path, name: &str, offset: u64, extra: &[&str]) -> (i32, String) {
    let offset = offset.to_string();
    let size = AREA_SECTORS.to_string();
    let mut a = vec![
        "open",
        s(img),
        name,
        "--type",
        "plain",
        "--cipher",
        "aes-xts-plain64",
        "--key-size",
        "512",
        "--key-file",
        s(key),
        "--offset",
        &offset,
        "--size",
        &size,
        "--front-end",
        "loop",
    ];
    a.extend(extra);
    let o = run(UCRYPT, &a);
    (o.status.code().unwrap_or(-1), text(&o))
}

/// The plaintext of the area at `offset` sectors, read offline (`ucrypt export`).
fn export_area(t: &TempDir, img: &Path, key: &Path, offset: u64) -> Vec<u8> {
    let out = t.path(&format!("area-{offset}"));
    let offset = offset.to_string();
    let size = AREA_SECTORS.to_string();
    ok(
        UCRYPT,
        &[
            "export",
            s(img),
            s(&out),
            "--cipher",
            "aes-xts-plain64",
            "--key-size",
            "512",
            "--volume-key-file",
            s(key),
            "--offset",
            &offset,
            "--size",
            &size,
        ],
    );
    std::fs::read(&out).unwrap()
}

fn write_device(name: &str, data: &[u8]) {
    let dev = format!("/dev/ucrypt/{name}");
    std::fs::write(&dev, data).unwrap_or_else(|e| panic!("writing {dev}: {e}"));
    ok("sync", &[]);
}

#[test]
fn shared_plain_mappings_of_one_volume() {
    if let Some(why) = missing_root_rig(&["losetup", "sync"]) {
        println!("SKIPPED: {why}");
        return;
    }
    let t = TempDir::new("shared");
    let img = t.path("v.img");
    std::fs::write(&img, kit::SplitMix(0x5a).bytes(1 << 20)).unwrap();
    let key = t.file("key", kit::SplitMix(0x5b).bytes(64));
    let (a, b) = (
        format!("shared-a-{}", std::process::id()),
        format!("shared-b-{}", std::process::id()),
    );
    let close = |n: &str| {
        let _ = run(UCRYPT, &["close", n]);
    };
    // compat-test: the second area without --shared is busy; with it, mapped.
    let (code, out) = open_area(&img, &key, &a, 0, &[]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = open_area(&img, &key, &b, 512, &[]);
    assert_eq!(code, 5, "a second mapping without --shared: {out}");
    let (code, out) = open_area(&img, &key, &b, 512, &["--shared"]);
    if code != 0 {
        close(&a);
        panic!("--shared beside a mapping: {out}");
    }
    // Each mapping writes its own area, and both are read back offline as written.
    let area = (AREA_SECTORS * 512) as usize;
    let (pa, pb) = (kit::SplitMix(1).bytes(area), kit::SplitMix(2).bytes(area));
    write_device(&a, &pa);
    write_device(&b, &pb);
    // While the shared mapping lives, a mapping that is not shared finds the volume in use,
    // and a verb that rewrites the volume refuses it.
    close(&a);
    let (code, out) = open_area(&img, &key, &a, 0, &[]);
    assert_eq!(code, 5, "not shared, beside a shared mapping: {out}");
    let (code, out) = open_area(&img, &key, &a, 0, &["--shared"]);
    assert_eq!(code, 0, "two shared mappings: {out}");
    close(&a);
    close(&b);
    assert_eq!(export_area(&t, &img, &key, 0), pa);
    assert_eq!(export_area(&t, &img, &key, 512), pb);
    // Closed: a mapping that is not shared is free to open.
    let (code, out) = open_area(&img, &key, &a, 0, &[]);
    assert_eq!(code, 0, "{out}");
    close(&a);
}
