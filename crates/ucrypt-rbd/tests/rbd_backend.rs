//! RbdBackend against a real single-node Ceph cluster (scripts/ceph-cluster.sh): concurrent I/O
//! checked against a model and against `rbd export`, flush, discard, write-zeroes, resize,
//! snapshots, open errors, and a Volume over RBD whose ciphertext equals the same Volume's over
//! memory. One cluster for all cases (see `common`); SKIPPED without Ceph's packages.

mod common;

use std::sync::Arc;

use common::*;
use rand::{Rng, SeedableRng};
use ucrypt::backend::{Backend, MemBackend};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, Error, ErrorKind, SecretBytes};
use ucrypt_rbd::{FuaPath, RbdBackend};

const MIB: u64 = 1 << 20;

#[test]
fn against_a_ceph_cluster() {
    run_cases(
        "backend",
        &[
            ("concurrent_random_io", concurrent_random_io),
            ("zeroes_discard_flush", zeroes_discard_flush),
            ("fua_follows_the_cache_policy", fua_follows_the_cache_policy),
            ("range_and_read_only_errors", range_and_read_only_errors),
            ("resize", resize),
            ("snapshot", snapshot),
            ("open_errors", open_errors),
            (
                "volume_ciphertext_equals_memory",
                volume_ciphertext_equals_memory,
            ),
        ],
    );
}

fn open(c: &Cluster, image: &str) -> RbdBackend {
    RbdBackend::open(&c.spec(image)).unwrap_or_else(|e| panic!("open {image}: {e}"))
}

/// The seed: `UCRYPT_RBD_SEED` or the time; printed so a failure can be replayed.
fn seed() -> u64 {
    let s = std::env::var("UCRYPT_RBD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("seed {s} (UCRYPT_RBD_SEED={s} replays it)");
    s
}

/// Threads writing and reading random block-aligned ranges at once. Thread `t` owns the 1 MiB
/// chunks `k` with `k % THREADS == t`, so neighbours share every 4 MiB object and requests race
/// inside librbd, while each thread can check its reads against its own model. At the end the
/// image, read whole with `rbd export`, equals the models put together.
fn concurrent_random_io(c: &Cluster) {
    const THREADS: u64 = 8;
    const CHUNK: u64 = MIB;
    const SIZE: u64 = 64 * MIB;
    const OPS_PER_THREAD: usize = 200;
    let name = image_name("rw");
    c.create_image(&name, "64M");
    let b = Arc::new(open(c, &name));
    assert_eq!(b.size(), SIZE);
    assert_eq!(b.logical_block_bytes(), 512);
    assert_eq!(b.describe(), format!("rbd rbd/{name}"));
    assert_eq!(b.object_bytes(), 4 * MIB);
    let seed = seed();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ t);
                // What this thread's chunks should hold (zeroes to start: a new image).
                let mut model = vec![0u8; SIZE as usize];
                for op in 0..OPS_PER_THREAD {
                    let k = rng.random_range(0..SIZE / CHUNK / THREADS) * THREADS + t;
                    let blocks = rng.random_range(1..=CHUNK / 512);
                    let first = rng.random_range(0..=CHUNK / 512 - blocks);
                    let off = k * CHUNK + first * 512;
                    let len = (blocks * 512) as usize;
                    let r = off as usize..off as usize + len;
                    if rng.random_bool(0.6) {
                        let mut data = vec![0u8; len];
                        rng.fill(&mut data[..]);
                        b.write_at(&data, off).unwrap();
                        model[r].copy_from_slice(&data);
                    } else {
                        let mut got = vec![0u8; len];
                        b.read_exact_at(&mut got, off).unwrap();
                        assert!(
                            got == model[r],
                            "thread {t} op {op}: read at {off} ({len} bytes) differs"
                        );
                    }
                    if op % 50 == 49 {
                        b.flush().unwrap();
                    }
                }
                model
            })
        })
        .collect();
    let mut expect = vec![0u8; SIZE as usize];
    for (t, h) in handles.into_iter().enumerate() {
        let model = h.join().expect("an I/O thread panicked");
        for k in (t as u64..SIZE / CHUNK).step_by(THREADS as usize) {
            let r = (k * CHUNK) as usize..((k + 1) * CHUNK) as usize;
            expect[r.clone()].copy_from_slice(&model[r]);
        }
    }
    b.flush().unwrap();
    // Read back through the backend in large requests (one spans many objects)...
    let mut all = vec![0u8; SIZE as usize];
    b.read_exact_at(&mut all, 0).unwrap();
    assert!(all == expect, "whole-image read differs from the model");
    drop(b);
    // ...and through librbd's own command.
    let exported = c.export(&name);
    assert_eq!(exported.len(), SIZE as usize);
    assert!(exported == expect, "rbd export differs from the model");
}

/// write_zeroes reads back as zeroes (also unaligned to objects), a discard of whole objects
/// too, and `rbd export` agrees after a flush.
fn zeroes_discard_flush(c: &Cluster) {
    let name = image_name("zd");
    c.create_image(&name, "16M");
    let b = open(c, &name);
    let fill: Vec<u8> = (0..16 * MIB).map(|i| (i % 251) as u8 + 1).collect();
    b.write_at(&fill, 0).unwrap();
    b.flush().unwrap();
    let mut expect = fill.clone();
    // (what, offset, len): zeroes across an object boundary, inside one object, a whole object.
    let zeroes = [
        ("across objects", 4 * MIB - 3 * 512, 8 * 512),
        ("inside an object", 9 * MIB + 512, 64 << 10),
    ];
    for (what, off, len) in zeroes {
        b.write_zeroes(off, len).unwrap();
        expect[off as usize..(off + len) as usize].fill(0);
        let mut got = vec![1u8; len as usize];
        b.read_exact_at(&mut got, off).unwrap();
        assert!(got.iter().all(|&x| x == 0), "write_zeroes {what}");
    }
    // A discard of whole objects removes them: they read back as zeroes.
    b.discard(12 * MIB, 4 * MIB).unwrap();
    expect[(12 * MIB) as usize..].fill(0);
    // A partial discard may leave data in place (librbd skips partial discards by default):
    // only check that it is accepted.
    b.discard(512, 4096).unwrap();
    expect[512..512 + 4096].copy_from_slice(&{
        let mut g = vec![0u8; 4096];
        b.read_exact_at(&mut g, 512).unwrap();
        g
    });
    b.flush().unwrap();
    let mut all = vec![0u8; 16 * MIB as usize];
    b.read_exact_at(&mut all, 0).unwrap();
    assert!(all == expect, "image differs after zeroes and discards");
    drop(b);
    assert!(c.export(&name) == expect, "rbd export differs");
}

/// A FUA write takes librados' FUA flag where librbd's cache lets it through (off, ucrypt's
/// default; write-around, librbd's) and a write plus a flush where a write-back cache may hold
/// it, as the image's effective settings say: the client's configuration or the image's own
/// metadata. Either way, once it returns another client (`rbd export`) reads it, with no flush
/// and the image still open.
fn fua_follows_the_cache_policy(c: &Cluster) {
    let name = image_name("fua");
    c.create_image(&name, "8M");
    let check = |b: &RbdBackend, at: u64, seed: u8| {
        // A first flush ends librbd's write-through start (rbd_cache_writethrough_until_flush).
        b.flush().unwrap();
        let data: Vec<u8> = (0..64u32 << 10).map(|i| (i as u8) ^ seed).collect();
        b.write_at_fua(&data, at).unwrap();
        let img = c.export(&name);
        assert!(
            img[at as usize..at as usize + data.len()] == data[..],
            "{:?}: a FUA write is not on the cluster when it returns",
            b.fua_path()
        );
    };
    // Defaults: librbd's cache off.
    let b = open(c, &name);
    assert_eq!(b.fua_path(), &FuaPath::Native);
    check(&b, MIB, 1);
    drop(b);
    // The cache turned back on by the client, write-back. Dirty data may stay in the cache for
    // 30 s, so a write that is not made durable is not in the export.
    let mut spec = c.spec(&name);
    spec.options
        .settings
        .push(("rbd_cache".into(), "true".into()));
    spec.options
        .settings
        .push(("rbd_cache_max_dirty_age".into(), "30".into()));
    let lazy = spec.clone();
    spec.options
        .settings
        .push(("rbd_cache_policy".into(), "writeback".into()));
    let b = RbdBackend::open(&spec).unwrap();
    assert_eq!(
        b.fua_path(),
        &FuaPath::WriteThenFlush("rbd_cache_policy = writeback".into())
    );
    check(&b, 2 * MIB, 2);
    drop(b);
    // Write-back named by the image's own metadata.
    c.rbd(&[
        "config",
        "image",
        "set",
        &format!("rbd/{name}"),
        "rbd_cache_policy",
        "writeback",
    ]);
    let b = RbdBackend::open(&lazy).unwrap();
    assert!(
        matches!(b.fua_path(), FuaPath::WriteThenFlush(_)),
        "the image's metadata says writeback, got {:?}",
        b.fua_path()
    );
    check(&b, 3 * MIB, 3);
    drop(b);
    // The cache on with librbd's own default policy, write-around: FUA goes through.
    c.rbd(&[
        "config",
        "image",
        "remove",
        &format!("rbd/{name}"),
        "rbd_cache_policy",
    ]);
    let mut spec = c.spec(&name);
    spec.options
        .settings
        .push(("rbd_cache".into(), "true".into()));
    let b = RbdBackend::open(&spec).unwrap();
    assert_eq!(b.fua_path(), &FuaPath::Native);
    check(&b, 4 * MIB, 4);
}

fn range_and_read_only_errors(c: &Cluster) {
    let name = image_name("err");
    c.create_image(&name, "4M");
    let b = open(c, &name);
    let size = b.size();
    // Reads at and past the end are short, like pread.
    let mut buf = vec![0u8; 4096];
    assert_eq!(b.read_at(&mut buf, size).unwrap(), 0);
    assert_eq!(b.read_at(&mut buf, size - 512).unwrap(), 512);
    // Writes, zeroes and discards past the end are the caller's error.
    type Op = fn(&RbdBackend, u64) -> ucrypt::Result<()>;
    let ops: [(&str, Op); 3] = [
        ("write", |b, at| b.write_at(&[0u8; 1024], at)),
        ("write_zeroes", |b, at| b.write_zeroes(at, 1024)),
        ("discard", |b, at| b.discard(at, 1024)),
    ];
    for (what, op) in ops {
        match op(&b, size - 512) {
            Err(Error::OutOfRange { .. }) => {}
            other => panic!("{what} past the end: {other:?}"),
        }
    }
    drop(b);
    // Read-only: every change is refused before librbd sees it.
    let mut spec = c.spec(&name);
    spec.options.read_only = true;
    let ro = RbdBackend::open(&spec).unwrap();
    assert!(ro.read_only());
    for (what, op) in ops {
        match op(&ro, 0) {
            Err(e @ Error::ReadOnly(_)) => assert!(e.to_string().contains(&name), "{e}"),
            other => panic!("{what} on a read-only image: {other:?}"),
        }
    }
    assert!(matches!(ro.resize(8 * MIB), Err(Error::ReadOnly(_))));
    ro.flush().unwrap();
    ro.read_exact_at(&mut buf, 0).unwrap();
}

fn resize(c: &Cluster) {
    let name = image_name("rs");
    c.create_image(&name, "4M");
    let b = open(c, &name);
    b.resize(12 * MIB).unwrap();
    assert_eq!(b.size(), 12 * MIB);
    // The new end is writable, and the rbd command sees the new size.
    b.write_at(&[0xa5; 4096], 12 * MIB - 4096).unwrap();
    b.flush().unwrap();
    let info = c.rbd(&["info", "--format", "json", &format!("rbd/{name}")]);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(text.contains(&format!("\"size\":{}", 12 * MIB)), "{text}");
    b.resize(2 * MIB).unwrap();
    assert_eq!(b.size(), 2 * MIB);
    assert!(matches!(
        b.write_at(&[0u8; 512], 2 * MIB),
        Err(Error::OutOfRange { .. })
    ));
    drop(b);
    assert_eq!(c.export(&name).len() as u64, 2 * MIB);
}

/// `rbd:pool/image@snap` opens read-only and reads the snapshot, not the head.
fn snapshot(c: &Cluster) {
    let name = image_name("snap");
    c.create_image(&name, "4M");
    let b = open(c, &name);
    b.write_at(&[0x11; 8192], 0).unwrap();
    b.flush().unwrap();
    drop(b);
    c.rbd(&["snap", "create", &format!("rbd/{name}@s1")]);
    let b = open(c, &name);
    b.write_at(&[0x22; 8192], 0).unwrap();
    b.flush().unwrap();
    let spec = ucrypt_rbd::RbdSpec::parse(&format!("rbd:rbd/{name}@s1:conf={}", c.conf.display()))
        .unwrap();
    let s = RbdBackend::open(&spec).unwrap();
    assert!(s.read_only());
    assert_eq!(s.describe(), format!("rbd rbd/{name}@s1"));
    let mut got = vec![0u8; 8192];
    s.read_exact_at(&mut got, 0).unwrap();
    assert!(
        got.iter().all(|&x| x == 0x11),
        "snapshot shows the head's data"
    );
    b.read_exact_at(&mut got, 0).unwrap();
    assert!(got.iter().all(|&x| x == 0x22));
    assert!(matches!(s.write_at(&got, 0), Err(Error::ReadOnly(_))));
}

/// Opening what does not exist fails with the call, the name and the errno.
fn open_errors(c: &Cluster) {
    let missing_image = c.spec("no-such-image");
    let mut missing_pool = c.spec("img");
    missing_pool.pool = "no-such-pool".into();
    let mut missing_snap = c.spec(&image_name("rw"));
    missing_snap.snapshot = Some("no-such-snap".into());
    let mut bad_option = c.spec("img");
    bad_option.options.settings = vec![("no_such_ceph_option".into(), "1".into())];
    let mut bad_conf = c.spec("img");
    bad_conf.options.conf = Some("/nonexistent/ceph.conf".into());
    // (what, spec, kind, the message must mention, errno)
    let rows = [
        (
            "image",
            missing_image,
            ErrorKind::Device,
            "rbd_open rbd/no-such-image",
            Some(libc::ENOENT),
        ),
        (
            "pool",
            missing_pool,
            ErrorKind::Device,
            "rados_ioctx_create no-such-pool",
            Some(libc::ENOENT),
        ),
        (
            "snapshot",
            missing_snap,
            ErrorKind::Device,
            "rbd_open_read_only",
            Some(libc::ENOENT),
        ),
        (
            "option",
            bad_option,
            ErrorKind::BadInput,
            "not a Ceph option",
            None,
        ),
        (
            "conf",
            bad_conf,
            ErrorKind::Device,
            "/nonexistent/ceph.conf",
            Some(libc::ENOENT),
        ),
    ];
    for (what, spec, kind, needle, errno) in rows {
        let e = match RbdBackend::open(&spec) {
            Ok(_) => panic!("missing {what}: opened"),
            Err(e) => e,
        };
        assert_eq!(e.kind(), kind, "{what}: {e}");
        assert!(e.to_string().contains(needle), "{what}: {e}");
        if let Some(n) = errno {
            assert_eq!(e.errno(), n, "{what}: {e}");
        }
    }
}

fn volume_config(size: u64) -> VolumeConfig {
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5c).collect();
    let mut cfg = VolumeConfig::new(
        CipherSpec::AES_XTS_PLAIN64,
        SecretBytes::from_slice(&key),
        Geometry::new(SectorSize::S4096),
    );
    cfg.data_offset_bytes = MIB;
    cfg.size_bytes = Some(size - MIB);
    cfg
}

/// The same writes through a Volume over RBD and over memory leave the same ciphertext, and the
/// RBD volume reads its plaintext back, from many threads at once.
fn volume_ciphertext_equals_memory(c: &Cluster) {
    const SIZE: u64 = 32 * MIB;
    const THREADS: u64 = 4;
    let name = image_name("vol");
    c.create_image(&name, "32M");
    let rbd: Arc<dyn Backend> = Arc::new(open(c, &name));
    let mem = Arc::new(MemBackend::new(SIZE));
    let vr = Arc::new(Volume::new(Arc::clone(&rbd), volume_config(SIZE)).unwrap());
    let vm = Volume::new(mem.clone(), volume_config(SIZE)).unwrap();
    let seed = seed();
    // Plaintext writes in disjoint slots (so that the order among threads does not matter),
    // 512-byte aligned (so some are partial 4096-byte sectors) and crossing objects.
    const WRITES: u64 = 64;
    let slot = (SIZE - MIB) / WRITES / 4096 * 4096;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let writes: Vec<(u64, Vec<u8>)> = (0..WRITES)
        .map(|k| {
            let len = rng.random_range(1..=slot / 512) * 512;
            let off = k * slot + rng.random_range(0..=(slot - len) / 512) * 512;
            let mut d = vec![0u8; len as usize];
            rng.fill(&mut d[..]);
            (off, d)
        })
        .collect();
    for (off, d) in &writes {
        vm.write_at(d, *off).unwrap();
    }
    let writes = Arc::new(writes);
    let hs: Vec<_> = (0..THREADS)
        .map(|t| {
            let (vr, writes) = (Arc::clone(&vr), Arc::clone(&writes));
            std::thread::spawn(move || {
                for (off, d) in writes.iter().skip(t as usize).step_by(THREADS as usize) {
                    vr.write_at(d, *off).unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().expect("a writer thread panicked");
    }
    vr.flush().unwrap();
    // Plaintext reads agree.
    let plain_len = (SIZE - MIB) as usize;
    let (mut a, mut b) = (vec![0u8; plain_len], vec![0u8; plain_len]);
    vr.read_at(&mut a, 0).unwrap();
    vm.read_at(&mut b, 0).unwrap();
    assert!(a == b, "plaintext over RBD differs from over memory");
    drop(vr);
    drop(rbd);
    // Ciphertext agrees, as librbd's own export reads it.
    let mut cipher = vec![0u8; SIZE as usize];
    mem.read_exact_at(&mut cipher, 0).unwrap();
    assert!(
        c.export(&name) == cipher,
        "ciphertext on RBD differs from the same volume's in memory"
    );
}
