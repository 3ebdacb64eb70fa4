//! `Volume::suspend`/`resume` (requests wait, the key's contexts are dropped, the same key
//! brings the data back) and `Volume::resize` (after the backing file changed size).

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use kit::TempFile;
use ucrypt::backend::{Backend, DirectMode, FileBackend};
use ucrypt::engine::Policy;
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

/// How long a request must stay blocked to count as waiting at the gate.
const BLOCKED_FOR: Duration = Duration::from_millis(300);

#[test]
fn suspended_requests_wait_and_resume_with_the_key_releases_them() {
    for policy in [
        Policy::Inline,
        Policy::Parallel,
        Policy::Queued,
        Policy::Auto,
    ] {
        let r = rig(RigCfg {
            policy,
            ..RigCfg::default()
        });
        let data: Vec<u8> = (0..256 << 10).map(|i| (i * 7 % 251) as u8).collect();
        r.vol.write_at(&data, 0).unwrap();
        r.vol.suspend().unwrap();
        assert!(r.vol.is_suspended());
        assert!(r.vol.suspend().is_err(), "suspended twice");
        assert!(r.vol.resize(None).is_err(), "resized while suspended");
        let done = Arc::new(AtomicU32::new(0));
        let mut threads = Vec::new();
        for i in 0..3u64 {
            let (vol, done, want) = (r.vol.clone(), done.clone(), data.clone());
            threads.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; want.len()];
                vol.read_at(&mut buf, 0).unwrap();
                assert!(buf == want, "read after resume differs");
                vol.write_at(&buf[..4096], (64 + i) << 12).unwrap();
                done.fetch_add(1, SeqCst);
            }));
        }
        std::thread::sleep(BLOCKED_FOR);
        assert_eq!(
            done.load(SeqCst),
            0,
            "{policy}: a request ran while suspended"
        );
        // A wrong-length key is refused and the volume stays suspended.
        assert!(r.vol.resume(SecretBytes::from_slice(&[1u8; 7])).is_err());
        assert!(r.vol.is_suspended());
        r.vol.resume(SecretBytes::from_slice(&r.key)).unwrap();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(done.load(SeqCst), 3);
        assert!(!r.vol.is_suspended());
        assert!(r.vol.resume(SecretBytes::from_slice(&r.key)).is_err());
        let mut back = vec![0u8; 4096];
        r.vol.read_at(&mut back, 65 << 12).unwrap();
        assert!(back == data[..4096]);
    }
}

#[test]
fn resume_with_another_key_reads_other_plaintext() {
    // The volume cannot check a key: this is why the caller must (LUKS digest). It shows the
    // new contexts are really keyed from the key given, not kept from before.
    let r = rig(RigCfg::default());
    let data = vec![0x5au8; 8192];
    r.vol.write_at(&data, 0).unwrap();
    r.vol.suspend().unwrap();
    let mut other = r.key.clone();
    other[0] ^= 1;
    r.vol.resume(SecretBytes::from_vec(other)).unwrap();
    let mut back = vec![0u8; 8192];
    r.vol.read_at(&mut back, 0).unwrap();
    assert!(back != data);
    r.vol.suspend().unwrap();
    r.vol.resume(SecretBytes::from_slice(&r.key)).unwrap();
    r.vol.read_at(&mut back, 0).unwrap();
    assert!(back == data);
}

#[test]
fn resize_follows_the_backing_file() {
    let f = TempFile::new(1 << 20);
    let b: Arc<dyn Backend> = Arc::new(FileBackend::open(&f.0, true, DirectMode::Never).unwrap());
    let key = key_for(ucrypt::sector::CipherSpec::AES_XTS_PLAIN64, 3);
    let geometry = ucrypt::sector::Geometry {
        sector_size: ucrypt::sector::SectorSize::new(4096).unwrap(),
        iv_offset: 0,
        iv_large_sectors: false,
    };
    let mut cfg = VolumeConfig::new(
        ucrypt::sector::CipherSpec::AES_XTS_PLAIN64,
        SecretBytes::from_slice(&key),
        geometry,
    );
    cfg.data_offset_bytes = 4096;
    let vol = Volume::new(b, cfg).unwrap();
    assert_eq!(vol.size(), (1 << 20) - 4096);
    let mut buf = vec![0u8; 4096];
    assert!(vol.read_at(&mut buf, 1 << 20).is_err());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f.0)
        .unwrap()
        .set_len((2 << 20) + 4096 + 100)
        .unwrap();
    assert_eq!(vol.resize(None).unwrap(), 2 << 20);
    assert_eq!(vol.size(), 2 << 20);
    vol.write_at(&[9u8; 4096], (2 << 20) - 4096).unwrap();
    vol.read_at(&mut buf, (2 << 20) - 4096).unwrap();
    assert!(buf.iter().all(|&b| b == 9));
    // An explicit size: whole sectors, within the backend.
    assert_eq!(vol.resize(Some(1 << 20)).unwrap(), 1 << 20);
    assert!(vol.read_at(&mut buf, 1 << 20).is_err());
    assert!(vol.resize(Some(4 << 20)).is_err());
    assert!(
        vol.resize(Some((2 << 20) + 4096)).is_err(),
        "a sector beyond the backend"
    );
    assert!(vol.resize(Some(1000)).is_err());
    assert_eq!(vol.size(), 1 << 20);
}
