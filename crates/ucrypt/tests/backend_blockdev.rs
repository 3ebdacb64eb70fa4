//! FileBackend on a real block device (a loop device over a /dev/shm file): size by lseek,
//! logical block size by BLKSSZGET, O_DIRECT, BLKDISCARD, BLKZEROOUT, and a volume on top.
//! Prints SKIPPED when loop devices cannot be set up here (needs root and the loop driver).

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::process::Command;
use std::sync::Arc;

use kit::TempFile;
use ucrypt::backend::{Backend, DirectMode, FileBackend};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

struct Loop(String);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// A loop device with 4096-byte sectors over `file`, detached when dropped; None (after saying
/// SKIPPED) where loop devices cannot be set up here.
fn attach_4k_loop(file: &std::path::Path) -> Option<Loop> {
    let out = Command::new("losetup")
        .args(["-f", "--show", "--sector-size", "4096"])
        .arg(file)
        .output();
    match out {
        Ok(o) if o.status.success() => {
            Some(Loop(String::from_utf8_lossy(&o.stdout).trim().to_string()))
        }
        Ok(o) => {
            println!(
                "SKIPPED: losetup failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            None
        }
        Err(e) => {
            println!("SKIPPED: no losetup: {e}");
            None
        }
    }
}

#[test]
fn loop_device_backend_and_volume() {
    let f = TempFile::new(8 << 20);
    let Some(lo) = attach_4k_loop(&f.0) else {
        return;
    };
    let dev = lo.0.clone();
    let b = FileBackend::open(&dev, true, DirectMode::Auto).unwrap();
    eprintln!(
        "{} block {} note {:?}",
        b.describe(),
        b.logical_block_bytes(),
        b.note()
    );
    assert!(b.describe().starts_with("block device"));
    assert_eq!(b.size(), 8 << 20);
    assert_eq!(b.logical_block_bytes(), 4096);
    let b: Arc<dyn Backend> = Arc::new(b);
    // A 512-byte encryption sector on a 4096-byte device is refused.
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(7)).collect();
    let cfg = |s| {
        VolumeConfig::new(
            CipherSpec::AES_XTS_PLAIN64,
            SecretBytes::from_slice(&key),
            Geometry::new(s),
        )
    };
    assert!(Volume::new(b.clone(), cfg(SectorSize::S512)).is_err());
    let mut c = cfg(SectorSize::S4096);
    c.data_offset_bytes = 1 << 20;
    let v = Volume::new(b.clone(), c).unwrap();
    assert_eq!(v.size(), 7 << 20);
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    v.write_at(&data, 12345).unwrap();
    v.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    v.read_at(&mut back, 12345).unwrap();
    assert!(back == data);
    v.write_zeroes(12345, 100_000).unwrap();
    v.read_at(&mut back[..100_000], 12345).unwrap();
    assert!(back[..100_000].iter().all(|&x| x == 0));
    v.discard(0, 1 << 20).unwrap();
    // BLKZEROOUT straight on the device.
    b.write_zeroes(0, 1 << 20).unwrap();
    let mut store = vec![1u8; 8192];
    let st = (4096 - store.as_ptr() as usize % 4096) % 4096;
    b.read_exact_at(&mut store[st..st + 4096], 4096).unwrap();
    assert!(store[st..st + 4096].iter().all(|&x| x == 0));
}

struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A regular file on a filesystem whose O_DIRECT needs 4096-byte blocks (ext4 on a loop device
/// with 4096-byte sectors) holding a 512-byte-sector volume: `open_for_sector` falls back to
/// buffered I/O with a note, and the volume round-trips.
#[test]
fn file_on_4k_filesystem_with_512_byte_sectors_falls_back_to_buffered() {
    let f = TempFile::new(32 << 20);
    let Some(lo) = attach_4k_loop(&f.0) else {
        return;
    };
    let dev = lo.0.clone();
    let mkfs = Command::new("mkfs.ext4")
        .args(["-q", "-F", &dev])
        .status()
        .expect("mkfs.ext4 (e2fsprogs)");
    assert!(mkfs.success(), "mkfs.ext4 {dev}");
    let mnt = std::env::temp_dir().join(format!("ucrypt-4k-fs-{}", std::process::id()));
    std::fs::create_dir_all(&mnt).unwrap();
    let mounted = Command::new("mount").arg(&dev).arg(&mnt).status();
    if !matches!(mounted, Ok(s) if s.success()) {
        let _ = std::fs::remove_dir(&mnt);
        println!("SKIPPED: cannot mount ext4 from {dev} here");
        return;
    }
    let _mnt = Unmount(mnt.clone());
    let path = mnt.join("vol.img");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(4 << 20))
        .unwrap();

    // Rows: (sector bytes, expect direct I/O)
    for (sector, direct) in [(SectorSize::S512, false), (SectorSize::S4096, true)] {
        let b =
            FileBackend::open_for_sector(&path, true, DirectMode::Auto, sector.bytes()).unwrap();
        assert_eq!(b.is_direct(), direct, "sector {}", sector.bytes());
        assert_eq!(
            b.note().is_some(),
            !direct,
            "note for sector {}",
            sector.bytes()
        );
        if let Some(n) = b.note() {
            assert!(n.contains("buffered"), "{n}");
        }
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(5)).collect();
        let v = Volume::new(
            Arc::new(b),
            VolumeConfig::new(
                CipherSpec::AES_XTS_PLAIN64,
                SecretBytes::from_slice(&key),
                Geometry::new(sector),
            ),
        )
        .unwrap();
        let data: Vec<u8> = (0..70_001u32).map(|i| (i % 253) as u8).collect();
        v.write_at(&data, 1000).unwrap();
        v.flush().unwrap();
        let mut back = vec![0u8; data.len()];
        v.read_at(&mut back, 1000).unwrap();
        assert!(back == data, "round trip with sector {}", sector.bytes());
    }
}
