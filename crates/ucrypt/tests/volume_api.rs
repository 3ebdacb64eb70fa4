//! The Volume's contract at its edges: configuration checks, read-only, ranges, zero-length
//! requests, policy names, stats.

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::Arc;

use common::*;
use ucrypt::backend::{Backend, MemBackend};
use ucrypt::engine::Policy;
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, Error, SecretBytes};

fn cfg(sector: SectorSize) -> VolumeConfig {
    let key: Vec<u8> = (0..64u8).collect();
    VolumeConfig::new(
        CipherSpec::AES_XTS_PLAIN64,
        SecretBytes::from_slice(&key),
        Geometry::new(sector),
    )
}

#[test]
fn config_errors_table() {
    let mem = |size: u64, lbs: u32| -> Arc<dyn Backend> {
        Arc::new(MemBackend::with_block_bytes(size, lbs))
    };
    // (what, backend, edit, error must mention)
    type Edit = fn(&mut VolumeConfig);
    let rows: Vec<(&str, Arc<dyn Backend>, Edit, &str)> = vec![
        (
            "size not a sector multiple",
            mem(1 << 20, 512),
            |c| c.size_bytes = Some(1000),
            "multiple",
        ),
        (
            "size beyond backend",
            mem(1 << 20, 512),
            |c| c.size_bytes = Some(2 << 20),
            "does not fit",
        ),
        (
            "offset beyond backend",
            mem(1 << 20, 512),
            |c| c.data_offset_bytes = 4 << 20,
            "beyond",
        ),
        (
            "offset unaligned",
            mem(1 << 20, 512),
            |c| c.data_offset_bytes = 100,
            "multiple",
        ),
        (
            "sector below block size",
            mem(1 << 20, 4096),
            |c| c.geometry = Geometry::new(SectorSize::S512),
            "smaller",
        ),
        (
            "huge pool",
            mem(1 << 20, 512),
            |c| c.pool_bytes = 1 << 40,
            "pool",
        ),
        (
            "spin beyond the limit",
            mem(1 << 20, 512),
            |c| c.spin = std::time::Duration::from_secs(1),
            "spin",
        ),
    ];
    for (what, b, edit, needle) in rows {
        let mut c = cfg(SectorSize::S4096);
        edit(&mut c);
        match Volume::new(b, c) {
            Err(e) => assert!(e.to_string().contains(needle), "{what}: {e}"),
            Ok(_) => panic!("{what}: accepted"),
        }
    }
    // None = to the end, rounded down to whole sectors.
    let mut c = cfg(SectorSize::S4096);
    c.data_offset_bytes = 4096;
    let v = Volume::new(mem((1 << 20) + 5000, 512), c).unwrap();
    // Backend 1 MiB + 5000 bytes, minus 4096 of offset = 1 MiB + 904: rounds down to 1 MiB.
    assert_eq!(v.size(), 1 << 20);
}

#[test]
fn read_only_ranges_and_zero_length() {
    let mut c = cfg(SectorSize::S4096);
    c.read_only = true;
    let v = Volume::new(Arc::new(MemBackend::new(1 << 20)), c).unwrap();
    assert!(v.read_only());
    assert_eq!(v.block_size(), 4096);
    let mut b = [0u8; 10];
    v.read_at(&mut b, 0).unwrap();
    for r in [
        v.write_at(&b, 0),
        v.discard(0, 4096),
        v.write_zeroes(0, 4096),
    ] {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::ReadOnly(_)), "{e}");
        assert_eq!(e.errno(), libc::EROFS);
    }
    v.flush().unwrap();
    // Ranges: the last byte is fine, one past is not, overflow is not.
    v.read_at(&mut b[..1], (1 << 20) - 1).unwrap();
    assert!(matches!(
        v.read_at(&mut b[..2], (1 << 20) - 1),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        v.read_at(&mut b, u64::MAX - 2),
        Err(Error::OutOfRange { .. })
    ));
    v.read_at(&mut [], 1 << 20).unwrap();
}

#[test]
fn policies_parse_and_switch_stats_count() {
    for p in Policy::ALL {
        assert_eq!(p.name().parse::<Policy>().unwrap(), p);
    }
    assert!("fast".parse::<Policy>().is_err());
    let r = rig(RigCfg::default());
    for p in Policy::ALL {
        r.vol.set_policy(p);
        assert_eq!(r.vol.policy(), p.into());
        r.vol.write_at(&[1u8; 5000], 100).unwrap();
        let mut b = vec![0u8; 300 << 10];
        r.vol.read_at(&mut b, 0).unwrap();
        assert!(b[100..5100].iter().all(|&x| x == 1), "{p}");
    }
    let s = r.vol.stats();
    assert_eq!(s.read.requests, 5);
    assert_eq!(s.write.requests, 5);
    assert_eq!(s.write.bytes, 25000);
    assert_eq!(s.rmw, 5);
    assert!(s.split >= 1, "parallel/ordered split a 300 KiB read");
    eprintln!("{s}");
}

/// Without allow_discards (a LUKS2 header lacking the flag) a discard succeeds and leaves the
/// ciphertext in place, as dm-crypt does; with it, the backend sees the discard (MemBackend
/// zero-fills discarded ranges).
#[test]
fn discards_reach_the_backend_only_when_allowed() {
    for allow in [false, true] {
        let backend = Arc::new(MemBackend::new(1 << 20));
        let mut c = cfg(SectorSize::S4096);
        c.allow_discards = allow;
        let vol = Volume::new(backend.clone(), c).unwrap();
        vol.write_at(&vec![0xa5; 64 << 10], 0).unwrap();
        let mut before = vec![0u8; 64 << 10];
        backend.read_at(&mut before, 0).unwrap();
        assert!(before.iter().any(|&b| b != 0));
        vol.discard(0, 64 << 10).unwrap();
        let mut after = vec![0u8; 64 << 10];
        backend.read_at(&mut after, 0).unwrap();
        if allow {
            assert!(
                after.iter().all(|&b| b == 0),
                "allowed discard must reach the backend"
            );
        } else {
            assert_eq!(
                after, before,
                "discard without allow_discards must not touch the ciphertext"
            );
        }
    }
}

/// With `spin` zero nobody busy-waits: split and queued requests still complete, through
/// sleeps and wake-ups alone, with the right data.
#[test]
fn zero_spin_still_completes_every_policy() {
    for policy in [
        Policy::Parallel,
        Policy::Ordered,
        Policy::Queued,
        Policy::Auto,
    ] {
        let mut c = cfg(SectorSize::S4096);
        c.spin = std::time::Duration::ZERO;
        c.policy = policy.into();
        let v = Volume::new(Arc::new(MemBackend::new(8 << 20)), c).unwrap();
        let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
        for round in 0..20u64 {
            let off = (round % 6) << 20;
            v.write_at(&data, off).unwrap();
            let mut back = vec![0u8; data.len()];
            v.read_at(&mut back, off).unwrap();
            assert!(
                back == data,
                "{policy}: round {round} read back different data"
            );
        }
        if matches!(policy, Policy::Parallel | Policy::Ordered) {
            assert!(v.stats().split > 0, "{policy}: nothing was split");
        }
    }
}

#[test]
fn write_at_mut_encrypts_in_place_only_when_direct() {
    // (policy, offset, length, encrypted in the caller's buffer)
    let rows: &[(Policy, u64, usize, bool)] = &[
        (Policy::Inline, 0, 4096, true),
        (Policy::Inline, 8192, 3 * 4096, true),
        (Policy::Auto, 4096, 4096, true),
        // Not sector-aligned: read-modify-write through a bounce buffer.
        (Policy::Inline, 512, 4096, false),
        (Policy::Inline, 0, 1000, false),
        // Split across workers: the planned path.
        (Policy::Parallel, 0, 1 << 20, false),
        (Policy::Queued, 0, 4096, false),
    ];
    for &(policy, off, len, in_place) in rows {
        let ctx = format!("{policy} {off}+{len}");
        let mut c = cfg(SectorSize::S4096);
        c.policy = policy.into();
        let backend = Arc::new(MemBackend::new(4 << 20));
        let v = Volume::new(backend.clone(), c).unwrap();
        let plain: Vec<u8> = (0..len).map(|i| (i * 13 + 5) as u8).collect();
        let mut b = OffsetBuf::new(len, 0);
        b.get().copy_from_slice(&plain);
        v.write_at_mut(b.get(), off).unwrap();
        let mut back = vec![0u8; len];
        v.read_at(&mut back, off).unwrap();
        assert!(back == plain, "{ctx}: read back different data");
        let mut ct = vec![0u8; len];
        backend.read_exact_at(&mut ct, off).unwrap();
        if in_place {
            assert!(
                b.get() == &ct[..],
                "{ctx}: buffer does not hold the ciphertext"
            );
        } else {
            assert!(
                b.get() == &plain[..],
                "{ctx}: buffer changed on the planned path"
            );
        }
    }
    // A read-only volume refuses it like write_at.
    let mut c = cfg(SectorSize::S4096);
    c.read_only = true;
    let v = Volume::new(Arc::new(MemBackend::new(1 << 20)), c).unwrap();
    let mut b = OffsetBuf::new(4096, 0);
    assert!(matches!(
        v.write_at_mut(b.get(), 0),
        Err(Error::ReadOnly(_))
    ));
}

/// Failed requests are counted by direction and by who can act on them; the phase histograms
/// are cumulative, end at the last non-empty bucket and add up to the phase's count.
#[test]
fn stats_count_errors_by_kind_and_expose_histograms() {
    use ucrypt::backend::{Fault, FaultBackend, FaultOp, FaultRule};
    use ucrypt::engine::Phase;
    use ucrypt::ErrorKind;
    let mem: Arc<dyn Backend> = Arc::new(MemBackend::new(4 << 20));
    let faulty = Arc::new(FaultBackend::new(mem));
    let vol = Volume::new(faulty.clone(), cfg(SectorSize::S4096)).unwrap();
    let mut buf = vec![0u8; 4096];
    // Outside the volume: bad input, on the read side.
    assert!(vol.read_at(&mut buf, 4 << 20).is_err());
    // The backend fails one write: a device error, on the write side.
    faulty.add_rule(FaultRule::always(FaultOp::Write, Fault::Eio).times(1));
    assert!(vol.write_at(&buf, 0).is_err());
    for _ in 0..2000 {
        vol.read_at(&mut buf, 8192).unwrap();
    }
    let s = vol.stats();
    assert_eq!(s.read.errors_of(ErrorKind::BadInput), 1);
    assert_eq!(s.write.errors_of(ErrorKind::Device), 1);
    assert_eq!(s.read.errors.iter().sum::<u64>(), 1);
    assert_eq!(s.write.errors.iter().sum::<u64>(), 1);
    let total = s.read.phase(Phase::Total);
    assert!(total.count > 0, "some of 2000 reads were timed");
    let h = total.cumulative_ns();
    assert_eq!(h.last().map(|&(_, c)| c), Some(total.count));
    assert!(h.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
    assert!(total.sum_ns > 0.0 && total.sum_ns <= h.last().unwrap().0 * total.count as f64);
}

/// One policy per direction: parsed as `read=P,write=Q` (a direction not named is auto),
/// shown back the same way, and applied per direction (a big write splits under `parallel`
/// while a big read of the same volume stays inline).
#[test]
fn policies_per_direction() {
    use ucrypt::engine::Policies;
    let p: Policies = "read=inline,write=parallel".parse().unwrap();
    assert_eq!((p.read, p.write), (Policy::Inline, Policy::Parallel));
    assert_eq!(p.to_string(), "read=inline,write=parallel");
    assert_eq!("auto".parse::<Policies>().unwrap(), Policy::Auto.into());
    assert_eq!("auto".parse::<Policies>().unwrap().to_string(), "auto");
    let w: Policies = "write=ordered".parse().unwrap();
    assert_eq!((w.read, w.write), (Policy::Auto, Policy::Ordered));
    for bad in ["read=fast", "up=inline", "read=inline,read=auto", "read"] {
        assert!(bad.parse::<Policies>().is_err(), "{bad}");
    }
    let r = rig(RigCfg::default());
    r.vol.set_policy(p);
    assert_eq!(r.vol.policy(), p);
    let mut big = vec![7u8; 1 << 20];
    r.vol.read_at(&mut big, 0).unwrap();
    assert_eq!(r.vol.stats().split, 0, "reads stay inline");
    r.vol.write_at(&big, 0).unwrap();
    assert_eq!(
        r.vol.stats().split,
        1,
        "a 1 MiB write splits under parallel"
    );
}

const ALL_POLICIES: [Policy; 5] = [
    Policy::Auto,
    Policy::Inline,
    Policy::Parallel,
    Policy::Ordered,
    Policy::Queued,
];

/// A 4 MiB volume in memory of 4096-byte sectors with `spec`, a fixed key and `policy`, and
/// its backend.
fn shared_test_volume(spec: &str, key_len: usize, policy: Policy) -> (Volume, Arc<MemBackend>) {
    let key: Vec<u8> = (0..key_len as u8).collect();
    let mut c = VolumeConfig::new(
        spec.parse::<CipherSpec>().unwrap(),
        SecretBytes::from_slice(&key),
        Geometry::new(SectorSize::S4096),
    );
    c.policy = policy.into();
    let backend = Arc::new(MemBackend::new(4 << 20));
    (Volume::new(backend.clone(), c).unwrap(), backend)
}

/// Whether two of [`shared_test_volume`]'s backends hold the same bytes.
fn same_bytes(a: &MemBackend, b: &MemBackend) -> bool {
    let mut x = vec![0u8; 4 << 20];
    let mut y = vec![0u8; 4 << 20];
    a.read_exact_at(&mut x, 0).unwrap();
    b.read_exact_at(&mut y, 0).unwrap();
    x == y
}

/// `read_shared` and `write_shared`, a front end's calls for memory a guest shares, store and
/// return what `read_at` and `write_at` do: under every policy, big (straight into or from the
/// caller's buffer where the cipher works out of place) and small, aligned or not. A scratch
/// buffer too short for the default's copy is refused by name.
#[test]
fn shared_reads_and_writes_equal_the_plain_calls() {
    let specs = [
        ("aes-xts-plain64", 64),
        ("aes-cbc-essiv:sha256", 32),
        ("serpent-xts-plain64", 64),
    ];
    let big = ucrypt::volume::SHARED_COPY_BELOW_BYTES as usize;
    let sizes: &[(u64, usize)] = &[(0, 1 << 20), (8192, big), (4096, 4096), (512, big + 512)];
    for (spec, key_len) in specs {
        for policy in ALL_POLICIES {
            let (shared, shared_store) = shared_test_volume(spec, key_len, policy);
            let (plain, plain_store) = shared_test_volume(spec, key_len, policy);
            for &(off, len) in sizes {
                let ctx = format!("{spec} {policy} {off}+{len}");
                let data: Vec<u8> = (0..len).map(|i| (i * 7 + off as usize) as u8).collect();
                let mut scratch = ucrypt::blockdev::Scratch::default();
                let scratch = scratch.get(len);
                shared.write_shared(&data, off, false, scratch).unwrap();
                shared.write_shared(&data, off, true, scratch).unwrap();
                plain.write_at(&data, off).unwrap();
                assert!(
                    same_bytes(&shared_store, &plain_store),
                    "{ctx}: the stored ciphertext differs"
                );
                let mut back = vec![0u8; len];
                shared.read_shared(&mut back, off, scratch).unwrap();
                assert!(back == data, "{ctx}: read back different data");
            }
        }
    }
    let v = Volume::new(Arc::new(MemBackend::new(1 << 20)), cfg(SectorSize::S4096)).unwrap();
    let mut dst = vec![0u8; 8192];
    let err = v.read_shared(&mut dst, 0, &mut [0u8; 4096]).unwrap_err();
    assert!(err.to_string().contains("scratch"), "{err}");
}

/// `read_shared_runs` and `write_shared_runs`, for a buffer of scattered runs (a guest's
/// pages), store and return what `write_at` and `read_at` do, under every policy: runs of
/// whole sectors (crypto straight between the runs and the scratch: after a read the scratch
/// holds ciphertext, not a copy of the plaintext) and runs that cut sectors (a copy through
/// the scratch).
#[test]
fn shared_runs_equal_the_plain_calls() {
    use ucrypt::blockdev::SharedRun;
    let specs = [("aes-xts-plain64", 64), ("aes-cbc-essiv:sha256", 32)];
    // (offset, run lengths, whole sectors)
    let cases: &[(u64, &[usize], bool)] = &[
        (0, &[4096, 8192, 65536, 4096, (1 << 20) - 81920], true),
        (8192, &[65536, 4096, 4096], true),
        (4096, &[1000, 64536, 4096], false),
        (0, &[4096, 4096], true),
    ];
    for (spec, key_len) in specs {
        for policy in ALL_POLICIES {
            let (shared, shared_store) = shared_test_volume(spec, key_len, policy);
            let (plain, plain_store) = shared_test_volume(spec, key_len, policy);
            for &(off, lens, whole) in cases {
                let len: usize = lens.iter().sum();
                let ctx = format!("{spec} {policy} {off}+{lens:?}");
                let data: Vec<u8> = (0..len).map(|i| (i * 13 + off as usize) as u8).collect();
                let mut bufs: Vec<Vec<u8>> = Vec::new();
                let mut at = 0;
                for &n in lens {
                    bufs.push(data[at..at + n].to_vec());
                    at += n;
                }
                let runs = |bufs: &mut Vec<Vec<u8>>| -> Vec<SharedRun> {
                    bufs.iter_mut()
                        // SAFETY: the buffers outlive every call given these runs.
                        .map(|b| unsafe { SharedRun::new(b.as_mut_ptr(), b.len()) })
                        .collect()
                };
                let mut scratch = ucrypt::blockdev::Scratch::default();
                let scratch = scratch.get(len);
                let src = runs(&mut bufs);
                shared.write_shared_runs(&src, off, false, scratch).unwrap();
                shared.write_shared_runs(&src, off, true, scratch).unwrap();
                plain.write_at(&data, off).unwrap();
                assert!(
                    same_bytes(&shared_store, &plain_store),
                    "{ctx}: the stored ciphertext differs"
                );
                for b in &mut bufs {
                    b.fill(0);
                }
                let dst = runs(&mut bufs);
                shared.read_shared_runs(&dst, off, scratch).unwrap();
                assert!(bufs.concat() == data, "{ctx}: read back different data");
                if whole && spec.contains("xts") && len >= 64 << 10 {
                    assert!(
                        scratch[..len] != data[..],
                        "{ctx}: a read of whole-sector runs was copied through the scratch"
                    );
                }
            }
        }
    }
}

/// A read the caller does itself (`read_direct`): handed out for whole sectors of a file
/// backend, it decrypts what the caller read (completing a short read) into the caller's
/// buffer, as `read_at` would, and counts the request or its error; refused (`None`) where
/// the volume cannot hand one out.
#[test]
fn direct_reads_decrypt_what_the_caller_read() {
    use std::os::unix::fs::FileExt;
    use ucrypt::backend::{DirectMode, FileBackend};
    let dir = kit::TempDir::new("direct-read");
    let path = dir.sparse("v.img", 4 << 20);
    let file = Arc::new(FileBackend::open(&path, true, DirectMode::Auto).unwrap());
    let v = Volume::new(file, cfg(SectorSize::S4096)).unwrap();
    let data: Vec<u8> = (0..(1 << 20)).map(|i| (i * 31 + 7) as u8).collect();
    v.write_at(&data, 0).unwrap();
    let mut scratch = ucrypt::blockdev::Scratch::default();
    let reader = std::fs::File::open(&path).unwrap();
    let s0 = v.stats();
    for (off, len, short) in [
        (0u64, 4096usize, 4096usize),
        (8192, 65536, 65536),
        (4096, 16384, 5000),
    ] {
        let d = v
            .read_direct(off, len)
            .expect("a direct read of whole sectors");
        assert_eq!(d.len(), len);
        assert!(
            4096 % d.align() == 0,
            "the scratch's pages satisfy the alignment"
        );
        let buf = scratch.get(len);
        // The caller's read; `short` < len leaves the rest to `finish`.
        let n = reader.read_at(&mut buf[..short], d.file_offset());
        let mut out = vec![0u8; len];
        d.finish(n, buf, &mut out).unwrap();
        let want = &data[off as usize..off as usize + len];
        assert!(
            out == want,
            "{off}+{len} (caller read {short}): other plaintext"
        );
    }
    let before = v.stats();
    assert_eq!(
        before.read.requests,
        s0.read.requests + 3,
        "each finished read counted"
    );
    let d = v.read_direct(0, 4096).unwrap();
    let err = d
        .finish(
            Err(std::io::Error::from_raw_os_error(libc::EIO)),
            scratch.get(4096),
            &mut [0u8; 4096],
        )
        .unwrap_err();
    assert!(err.to_string().contains("read of 4096 bytes"), "{err}");
    let after = v.stats();
    assert_eq!(
        after.read.errors.iter().sum::<u64>(),
        before.read.errors.iter().sum::<u64>() + 1
    );
    // Not whole sectors, outside the volume, or a backend that is not a file: none.
    assert!(v.read_direct(512, 4096).is_none());
    assert!(v.read_direct(0, 1000).is_none());
    assert!(v.read_direct(4 << 20, 4096).is_none());
    assert!(v.read_direct(0, 0).is_none());
    let mem = Volume::new(Arc::new(MemBackend::new(1 << 20)), cfg(SectorSize::S4096)).unwrap();
    assert!(mem.read_direct(0, 4096).is_none());
}

/// A write the caller does itself (`write_direct`): sealed (encrypted from the caller's
/// plaintext into its buffer) and written by the caller, it stores what `write_at` stores and
/// reads back; a short write is completed; it holds its sectors (an overlapping write is not
/// handed out meanwhile, reads are), and nothing is handed out while the volume is suspended,
/// for a `queued` policy, or on a read-only volume.
#[test]
fn direct_writes_store_what_write_at_stores() {
    use std::os::unix::fs::FileExt;
    use ucrypt::backend::{DirectMode, FileBackend};
    let dir = kit::TempDir::new("direct-write");
    let open = |name: &str| {
        let path = dir.sparse(name, 4 << 20);
        let file = Arc::new(FileBackend::open(&path, true, DirectMode::Auto).unwrap());
        (Volume::new(file, cfg(SectorSize::S4096)).unwrap(), path)
    };
    let (v, path) = open("d.img");
    let (reference, ref_path) = open("r.img");
    let writer = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let mut scratch = ucrypt::blockdev::Scratch::default();
    for (off, len, short, fua) in [
        (0u64, 4096usize, 4096usize, false),
        (8192, 65536, 12288, true),
    ] {
        let data: Vec<u8> = (0..len).map(|i| (i * 13 + off as usize) as u8).collect();
        let w = v
            .write_direct(off, len, fua)
            .expect("a direct write of whole sectors");
        assert_eq!(w.durable(), fua);
        // Its sectors are held until it finishes; reads are not.
        assert!(v
            .write_direct(off + len as u64 - 4096, 8192, false)
            .is_none());
        assert!(v.read_direct(off, 4096).is_some());
        let buf = scratch.get(len);
        w.seal(&data, buf).unwrap();
        let n = writer.write_at(&buf[..short], w.file_offset());
        w.finish(n, buf).unwrap();
        assert!(
            v.write_direct(off, len, false).is_some(),
            "let go once finished"
        );
        reference.write_at(&data, off).unwrap();
        let mut back = vec![0u8; len];
        v.read_at(&mut back, off).unwrap();
        assert!(back == data, "{off}+{len}: read back other data");
    }
    let (a, b) = (
        std::fs::read(&path).unwrap(),
        std::fs::read(&ref_path).unwrap(),
    );
    assert!(a == b, "the stored ciphertext differs from write_at's");
    let before = v.stats();
    let w = v.write_direct(0, 4096, false).unwrap();
    let err = w
        .finish(
            Err(std::io::Error::from_raw_os_error(libc::ENOSPC)),
            scratch.get(4096),
        )
        .unwrap_err();
    assert!(err.to_string().contains("write of 4096 bytes"), "{err}");
    let after = v.stats();
    assert_eq!(
        after.write.errors.iter().sum::<u64>(),
        before.write.errors.iter().sum::<u64>() + 1
    );
    assert!(
        v.write_direct(512, 4096, false).is_none(),
        "not whole sectors"
    );
    v.set_policy(Policy::Queued);
    assert!(
        v.write_direct(0, 4096, false).is_none(),
        "queued: not inline"
    );
    assert!(v.read_direct(0, 4096).is_none(), "queued: not inline");
    v.set_policy(Policy::Auto);
    v.suspend().unwrap();
    assert!(
        v.write_direct(0, 4096, false).is_none(),
        "suspended: the gate is closed"
    );
    assert!(
        v.read_direct(0, 4096).is_none(),
        "suspended: the gate is closed"
    );
    v.resume(SecretBytes::from_slice(&(0..64u8).collect::<Vec<u8>>()))
        .unwrap();
    assert!(v.write_direct(0, 4096, false).is_some());
    let file = Arc::new(FileBackend::open(&path, false, DirectMode::Auto).unwrap());
    let mut c = cfg(SectorSize::S4096);
    c.read_only = true;
    let ro = Volume::new(file, c).unwrap();
    assert!(ro.write_direct(0, 4096, false).is_none(), "read-only");
    assert!(ro.read_direct(0, 4096).is_some());
}
