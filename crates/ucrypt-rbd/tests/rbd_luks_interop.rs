//! Images encrypted by librbd itself (`rbd encryption format`), read and written by ucrypt
//! over RbdBackend, and the other way round through qemu's rbd driver with librbd's encryption
//! (`encrypt.format=`, Debian's qemu-block-extra). SKIPPED without Ceph's packages or qemu's
//! rbd driver (a failure under CI).
//!
//! librbd chooses the KDF itself (argon2id, ~475 MiB, ~2 s per unlock for LUKS2), and its
//! format benchmarks it first: each row takes some 20 s.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use common::*;
use ucrypt::backend::Backend;
use ucrypt::luks::{self, OpenOptions, Unlock};
use ucrypt::{BlockDev, SecretBytes};
use ucrypt_rbd::RbdBackend;

const MIB: u64 = 1 << 20;
const PASSPHRASE: &[u8] = b"ucrypt-rbd interop passphrase";

#[test]
fn librbd_encryption_interop() {
    if !present(qemu_rbd_missing()) {
        return;
    }
    run_cases(
        "luks",
        &[
            ("librbd_luks2", |c| interop(c, "luks2", 2, 16 * MIB, 4096)),
            ("librbd_luks1", |c| interop(c, "luks1", 1, 4 * MIB, 512)),
        ],
    );
}

fn qemu_rbd_missing() -> Option<String> {
    let have_module = Command::new("sh")
        .args(["-c", "ls /usr/lib/*/qemu/block-rbd.so"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    let have_io = Command::new("qemu-io")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok();
    match (have_io, have_module) {
        (false, _) => Some("qemu-io not installed (Debian package qemu-utils)".into()),
        (_, false) => {
            Some("qemu's rbd driver not installed (Debian package qemu-block-extra)".into())
        }
        _ => None,
    }
}

/// Runs qemu-io on `image` opened through librbd's encryption (`format`); true when every
/// command succeeded (a `read -P` whose bytes differ fails).
fn qemu_io(c: &Cluster, image: &str, format: &str, pass: &Path, cmds: &[&str]) -> bool {
    // qemu spells librbd's LUKS1 `luks`.
    let format = if format == "luks1" { "luks" } else { format };
    let mut cmd = Command::new("timeout");
    cmd.args([&RBD_COMMAND_SECONDS.to_string(), "qemu-io"])
        .arg("--object")
        .arg(format!("secret,id=sec0,file={}", pass.display()))
        .arg("--image-opts")
        .arg(format!(
            "driver=rbd,pool=rbd,image={image},conf={},encrypt.format={format},encrypt.key-secret=sec0",
            c.conf.display()
        ));
    for k in cmds {
        cmd.args(["-c", k]);
    }
    let o = cmd.stdin(Stdio::null()).output().expect("run qemu-io");
    let out = String::from_utf8_lossy(&o.stdout);
    println!(
        "qemu-io {cmds:?}: {}{}",
        out.trim(),
        String::from_utf8_lossy(&o.stderr).trim()
    );
    o.status.success() && !out.contains("failed")
}

/// librbd formats and writes; ucrypt reads the header, unlocks, reads librbd's plaintext and
/// writes its own; qemu (through librbd's encryption) reads ucrypt's plaintext.
fn interop(c: &Cluster, format: &str, version: u32, data_offset: u64, sector_bytes: u32) {
    let name = image_name(format);
    c.create_image(&name, "64M");
    let pass = c.dir.join(format!("pass-{name}"));
    std::fs::write(&pass, PASSPHRASE).unwrap();
    c.rbd(&[
        "encryption",
        "format",
        &format!("rbd/{name}"),
        format,
        pass.to_str().unwrap(),
    ]);
    assert!(
        qemu_io(
            c,
            &name,
            format,
            &pass,
            &["write -P 0xc3 0 1M", "write -P 0x3c 8M 64k"]
        ),
        "qemu-io could not write through librbd's {format}"
    );

    let backend = Arc::new(RbdBackend::open(&c.spec(&name)).unwrap());
    let hdr = luks::read_header(backend.as_ref()).expect("ucrypt reads librbd's header");
    assert_eq!(hdr.version(), version);
    let layout = hdr.data_layout().unwrap();
    println!(
        "{format}: data at {} bytes, {}-byte sectors, {:?}",
        layout.offset_bytes,
        layout.sector_size.bytes(),
        layout.cipher
    );
    assert_eq!(layout.offset_bytes, data_offset);
    assert_eq!(layout.sector_size.bytes(), sector_bytes);
    let t0 = std::time::Instant::now();
    let dev: Arc<dyn Backend> = backend;
    let vol = luks::open(
        dev,
        Unlock::Passphrase(SecretBytes::from_slice(PASSPHRASE)),
        &OpenOptions::default(),
    )
    .expect("ucrypt unlocks librbd's header");
    println!("{format}: unlocked in {:.1} s", t0.elapsed().as_secs_f64());
    assert_eq!(vol.size(), 64 * MIB - data_offset);
    // What librbd wrote, as ucrypt decrypts it.
    let mut got = vec![0u8; MIB as usize];
    vol.read_at(&mut got, 0).unwrap();
    assert!(
        got.iter().all(|&b| b == 0xc3),
        "{format}: librbd's plaintext at 0"
    );
    let mut got = vec![0u8; 64 << 10];
    vol.read_at(&mut got, 8 * MIB).unwrap();
    assert!(
        got.iter().all(|&b| b == 0x3c),
        "{format}: librbd's plaintext at 8 MiB"
    );
    // What ucrypt writes, as librbd decrypts it (one range unaligned to objects).
    vol.write_at(&vec![0x5a; MIB as usize], MIB).unwrap();
    vol.write_at(&vec![0xa5; 8192], 4 * MIB - 4096).unwrap();
    vol.flush().unwrap();
    drop(vol);
    assert!(
        qemu_io(
            c,
            &name,
            format,
            &pass,
            &[
                "read -P 0xc3 0 1M",
                "read -P 0x5a 1M 1M",
                "read -P 0xa5 4092k 8k",
                "read -P 0x3c 8M 64k",
            ]
        ),
        "librbd's {format} reads other bytes than ucrypt wrote"
    );
}
