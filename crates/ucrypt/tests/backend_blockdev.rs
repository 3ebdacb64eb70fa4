//! FileBackend on a real block device (a loop device over a /dev/shm file): size by lseek,
//! logical block size by BLKSSZGET, O_DIRECT, BLKDISCARD, BLKZEROOUT, and a volume on top.
//! Prints SKIPPED when loop devices cannot be set up here (needs root and the loop driver).

mod common;

use std::process::Command;
use std::sync::Arc;

use common::TempFile;
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

#[test]
fn loop_device_backend_and_volume() {
    let f = TempFile::new(8 << 20);
    let out = Command::new("losetup")
        .args(["-f", "--show", "--sector-size", "4096"])
        .arg(&f.0)
        .output();
    let dev = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        Ok(o) => {
            println!(
                "SKIPPED: losetup failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return;
        }
        Err(e) => {
            println!("SKIPPED: no losetup: {e}");
            return;
        }
    };
    let _guard = Loop(dev.clone());
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
