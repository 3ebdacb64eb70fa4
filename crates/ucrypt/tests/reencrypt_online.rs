//! Online key rotation (`luks::reencrypt::online`): a `Volume` serves reads and writes while its
//! key is rotated hotzone by hotzone, each request mapped by offset to the new key (below the
//! mark) or the old one; and a volume left in reencryption (the driver failed mid-way) opens
//! as two segments, recovered first, and its rotation finishes online.
//!
//! Threads each own a region of the volume and write and read random ranges there (crossing
//! hotzone boundaries), checking every read against their own model of the region. The seed
//! is printed; `REENCRYPT_ONLINE_SEED=n` replays one.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use ucrypt::backend::{Backend, Fault, FaultBackend, FaultOp, FaultRule, MemBackend};
use ucrypt::blockdev::BlockDev;
use ucrypt::luks::reencrypt::run::{
    init, init_on, recover_on, resume, resume_on, Devices, InitOptions, KeyslotKdf, ResilienceKind,
    RunOptions, SegmentChange, CHECKSUM_HASH,
};
use ucrypt::luks::reencrypt::{self, Mode};
use ucrypt::luks::{self, OpenOptions, Unlock};
use ucrypt::volume::Volume;
use ucrypt::Error;
use ucrypt::SecretBytes;

mod common;
use common::{fast_kdf, format_detached, format_filled};
const DATA_OFFSET: u64 = 1 << 20;
const HDR_SIZE: u64 = 0x4000;
const DATA_BYTES: u64 = 4 << 20;
const DEVICE_BYTES: u64 = DATA_OFFSET + DATA_BYTES;
/// Small hotzones: many per run, so requests meet them.
const HOTZONE_BYTES: u64 = 64 << 10;
const IO_THREADS: u64 = 3;
/// Largest request of the I/O threads.
const REQUEST_BYTES_MAX: u64 = 96 << 10;
const PASS: &[u8] = b"rotate me online";

fn seed() -> u64 {
    let s = std::env::var("REENCRYPT_ONLINE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("REENCRYPT_ONLINE_SEED={s}");
    s
}

/// xorshift64*.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn plaintext() -> Vec<u8> {
    (0..DATA_BYTES)
        .map(|i| (i.wrapping_mul(2654435761) >> 9) as u8)
        .collect()
}

/// A LUKS2 volume with one keyslot (`PASS`) holding [`plaintext`], on `dev`.
fn formatted(dev: &Arc<dyn Backend>, sector: u32) {
    let vk: Vec<u8> = (0..64u8).map(|i| i ^ 0x5a).collect();
    format_filled(
        dev,
        "5e0b8a1c-2d3e-4f50-8172-93a4b5c6d7e8",
        (DATA_OFFSET, HDR_SIZE, sector),
        &vk,
        PASS,
        &plaintext(),
    );
}

fn open(dev: Arc<dyn Backend>) -> Volume {
    luks::open(
        dev,
        Unlock::Passphrase(SecretBytes::from_slice(PASS)),
        &OpenOptions::default(),
    )
    .expect("open")
}

/// A new cipher and key size for the rotation's new segment (`--cipher`, `--key-size`).
fn new_cipher(spec: &str, key_bytes: usize) -> SegmentChange {
    SegmentChange {
        cipher: Some(spec.parse().expect("cipher spec")),
        key_bytes: Some(key_bytes),
        sector_size: None,
    }
}

fn start(dev: &dyn Backend, kind: ResilienceKind, change: SegmentChange) {
    init(
        dev,
        PASS,
        &InitOptions {
            resilience: kind,
            kdf: &fast_kdf(),
            key_slot: None,
            change,
            mode: Mode::Reencrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: CHECKSUM_HASH,
            shift_bytes: None,
        },
    )
    .expect("init");
}

/// Lets the rotation wait, between two hotzones, until a request has completed while it waits:
/// on a loaded machine the I/O threads may otherwise not be scheduled until the rotation has
/// ended, and "I/O during the rotation" would test nothing.
struct IoProbe {
    /// Requests completed so far (by every I/O thread).
    completed: AtomicU64,
    /// Progress reports seen.
    reports: AtomicU64,
    /// A request completed while the rotation waited.
    seen: AtomicBool,
}

/// How long the rotation waits for one request to complete between two hotzones: far beyond
/// any loaded machine's scheduling delay; reaching it means I/O is blocked while a rotation
/// is under way.
const IO_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

impl IoProbe {
    /// The rotation's progress callback: after its first hotzone (the volume then served by
    /// both sides), waits once for a request to complete.
    fn between_hotzones(&self, p: ucrypt::luks::reencrypt::run::Progress) {
        let first = self.reports.fetch_add(1, Ordering::SeqCst) == 0;
        if first || p.done >= p.total || self.seen.load(Ordering::SeqCst) {
            return;
        }
        let before = self.completed.load(Ordering::SeqCst);
        let start = std::time::Instant::now();
        while self.completed.load(Ordering::SeqCst) == before {
            assert!(
                start.elapsed() < IO_WAIT_LIMIT,
                "no request completed in {IO_WAIT_LIMIT:?} while the rotation waited between \
                 hotzones ({} of {} bytes done): I/O is blocked",
                p.done,
                p.total
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        self.seen.store(true, Ordering::SeqCst);
    }
}

/// Runs `IO_THREADS` threads of random I/O on `vol` (each in its own region, checked against
/// its model, which starts as `model`) while `rotate` runs; returns the final contents the
/// threads expect and how many requests ran while the rotation did. `rotate` hands its
/// progress reports to the probe, which holds it after its first hotzone until a request has
/// completed.
fn io_during(
    vol: &Arc<Volume>,
    seed: u64,
    model: Vec<u8>,
    rotate: impl FnOnce(&IoProbe) + Send,
) -> (Vec<u8>, u64) {
    let done = AtomicBool::new(false);
    let during = AtomicU64::new(0);
    let probe = IoProbe {
        completed: AtomicU64::new(0),
        reports: AtomicU64::new(0),
        seen: AtomicBool::new(false),
    };
    let region = DATA_BYTES / IO_THREADS / 4096 * 4096;
    let models: Vec<Vec<u8>> = (0..IO_THREADS)
        .map(|t| model[(t * region) as usize..((t + 1) * region) as usize].to_vec())
        .collect();
    let models = std::thread::scope(|sc| {
        let handles: Vec<_> = models
            .into_iter()
            .enumerate()
            .map(|(t, mut m)| {
                let (vol, done, during, probe) = (vol.clone(), &done, &during, &probe);
                sc.spawn(move || {
                    let mut rng = Rng(seed ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    let base = t as u64 * region;
                    let mut after = 0;
                    // Keep going a little after the rotation ends (the switch to one key).
                    while after < 20 {
                        if done.load(Ordering::SeqCst) {
                            after += 1;
                        } else {
                            during.fetch_add(1, Ordering::Relaxed);
                        }
                        // Sector-aligned or not: sub-sector writes are read-modify-writes.
                        let len = 1 + rng.below(REQUEST_BYTES_MAX);
                        let len = if rng.below(2) == 0 {
                            len.div_ceil(512) * 512
                        } else {
                            len
                        };
                        let len = len.min(region);
                        let off = rng.below(region - len + 1);
                        let off = if rng.below(2) == 0 {
                            off / 512 * 512
                        } else {
                            off
                        };
                        let r = off as usize..(off + len) as usize;
                        if rng.below(2) == 0 {
                            let fill = rng.next() as u8;
                            for (i, b) in m[r.clone()].iter_mut().enumerate() {
                                *b = fill.wrapping_add(i as u8);
                            }
                            vol.write_at(&m[r], base + off).expect("write");
                        } else {
                            let mut got = vec![0u8; len as usize];
                            vol.read_at(&mut got, base + off).expect("read");
                            assert!(
                                got == m[r],
                                "thread {t}: read at {} ({len} bytes) differs from what was \
                                 written",
                                base + off
                            );
                        }
                        probe.completed.fetch_add(1, Ordering::SeqCst);
                    }
                    m
                })
            })
            .collect();
        rotate(&probe);
        done.store(true, Ordering::SeqCst);
        handles
            .into_iter()
            .map(|h| h.join().expect("io thread"))
            .collect::<Vec<_>>()
    });
    let mut out = model;
    for (t, m) in models.into_iter().enumerate() {
        let at = t * region as usize;
        out[at..at + m.len()].copy_from_slice(&m);
    }
    (out, during.into_inner())
}

/// [`reencrypt::online::rotate`] of `vol` in [`HOTZONE_BYTES`] hotzones, its header on the
/// volume or on `header`.
fn rotate_online(
    vol: &Volume,
    header: Option<&dyn Backend>,
    progress: &mut dyn FnMut(ucrypt::luks::reencrypt::run::Progress),
) -> ucrypt::Result<()> {
    reencrypt::online::rotate(
        vol,
        header,
        PASS,
        RunOptions {
            hotzone_bytes: Some(HOTZONE_BYTES),
            ..Default::default()
        },
        progress,
    )
}

fn read_all(vol: &Volume) -> Vec<u8> {
    let mut got = vec![0u8; DATA_BYTES as usize];
    vol.read_at(&mut got, 0).expect("read all");
    got
}

fn assert_plain_luks2(dev: &dyn Backend) {
    let hdr = luks::read_header(dev).expect("header");
    assert!(
        hdr.unmet_requirements().is_empty(),
        "still in reencryption: {:?}",
        hdr.unmet_requirements()
    );
}

#[test]
fn io_flows_and_verifies_during_an_online_rotation() {
    let seed = seed();
    // (sector size, resilience, new cipher and key bytes; `None`: the same)
    for (sector, kind, cipher) in [
        (512, ResilienceKind::Checksum, None),
        (4096, ResilienceKind::Journal, None),
        (4096, ResilienceKind::None, None),
        (
            4096,
            ResilienceKind::Checksum,
            Some(("aes-cbc-essiv:sha256", 32)),
        ),
        (512, ResilienceKind::Journal, Some(("aes-xts-plain64", 32))),
    ] {
        println!("sector {sector}, resilience {kind:?}, new cipher {cipher:?}");
        let dev: Arc<dyn Backend> = Arc::new(MemBackend::new(DEVICE_BYTES));
        formatted(&dev, sector);
        let vol = Arc::new(open(dev.clone()));
        let change = cipher.map_or_else(SegmentChange::default, |(c, k)| new_cipher(c, k));
        start(dev.as_ref(), kind, change);
        let hotzones = AtomicU64::new(0);
        let (want, during) = io_during(&vol, seed, plaintext(), |probe| {
            rotate_online(&vol, None, &mut |p| {
                hotzones.fetch_add(1, Ordering::Relaxed);
                probe.between_hotzones(p);
            })
            .expect("online rotation");
        });
        println!(
            "{} hotzones, {during} requests during the rotation",
            hotzones.load(Ordering::Relaxed)
        );
        assert!(!vol.in_reencryption());
        let (spec, key_bytes) = vol.cipher();
        let want_cipher = cipher.unwrap_or(("aes-xts-plain64", 64));
        assert_eq!(
            (spec.to_string().as_str(), key_bytes),
            want_cipher,
            "the volume serves with the new cipher"
        );
        assert!(hotzones.load(Ordering::Relaxed) > 8, "too few hotzones");
        assert!(during > 0, "no request ran during the rotation");
        assert!(read_all(&vol) == want, "contents after the rotation");
        drop(vol);
        assert_plain_luks2(dev.as_ref());
        // Opened again from the header: the new key alone reads the same.
        assert!(read_all(&open(dev)) == want, "contents after reopening");
    }
}

#[test]
fn a_volume_left_in_reencryption_opens_segmented_and_finishes_online() {
    let seed = seed();
    for (kind, change) in [
        (ResilienceKind::Checksum, SegmentChange::default()),
        (
            ResilienceKind::Journal,
            new_cipher("aes-cbc-essiv:sha256", 32),
        ),
    ] {
        let mem: Arc<dyn Backend> = Arc::new(MemBackend::new(DEVICE_BYTES));
        formatted(&mem, 4096);
        start(mem.as_ref(), kind, change);
        // The offline driver fails at a data write a few hotzones in: the header is left
        // inside a hotzone, part of which may be rewritten.
        let fault = FaultBackend::new(mem.clone());
        let nth = 3 + seed % 5;
        fault.add_rule(
            FaultRule::always(FaultOp::Write, Fault::Eio)
                .in_range(DATA_OFFSET..DEVICE_BYTES)
                .nth(nth)
                .times(1),
        );
        let r = resume(
            &fault,
            PASS,
            RunOptions {
                hotzone_bytes: Some(HOTZONE_BYTES),
                ..Default::default()
            },
            &mut |_| {},
        );
        assert!(r.is_err(), "the fault did not stop the offline run");
        let hdr = luks::read_header(mem.as_ref()).unwrap();
        assert!(
            !hdr.unmet_requirements().is_empty(),
            "not left in reencryption"
        );
        // Open: recovered, then served as two segments.
        let vol = Arc::new(open(mem.clone()));
        assert!(vol.in_reencryption());
        let mark = vol.reencrypted_bytes().unwrap();
        println!("{kind:?}: left at data write {nth}, opened with {mark} bytes under the new key");
        assert!(mark > 0 && mark < DATA_BYTES);
        assert!(
            read_all(&vol) == plaintext(),
            "contents of the reopened volume"
        );
        let (want, _) = io_during(&vol, seed, plaintext(), |probe| {
            rotate_online(&vol, None, &mut |p| probe.between_hotzones(p)).expect("online rotation");
        });
        assert!(read_all(&vol) == want);
        drop(vol);
        assert_plain_luks2(mem.as_ref());
        assert!(read_all(&open(mem)) == want, "contents after reopening");
    }
}

/// A new sector size online, both ways (`--sector-size`): 512 → 4096 started online, and 4096
/// → 512 left mid-way by a failing offline run and opened as two segments in their own
/// sectors. The threads' requests, aligned or not to either size, verify throughout. At the
/// end the volume serves the new sectors through its new side (its own engine keeps the old
/// ones): it is no longer in reencryption, refuses to suspend or resize until it is closed,
/// and opened again from the header it reads the same in the new sectors alone.
#[test]
fn a_new_sector_size_online() {
    let seed = seed();
    for (from, to, kind, left_mid_way) in [
        (512u32, 4096u32, ResilienceKind::Checksum, false),
        (4096, 512, ResilienceKind::Journal, true),
    ] {
        println!("sector {from} -> {to}, resilience {kind:?}, left mid-way {left_mid_way}");
        let mem: Arc<dyn Backend> = Arc::new(MemBackend::new(DEVICE_BYTES));
        formatted(&mem, from);
        let change = SegmentChange {
            sector_size: Some(ucrypt::sector::SectorSize::new(u64::from(to)).unwrap()),
            ..SegmentChange::default()
        };
        start(mem.as_ref(), kind, change);
        if left_mid_way {
            let fault = FaultBackend::new(mem.clone());
            fault.add_rule(
                FaultRule::always(FaultOp::Write, Fault::Eio)
                    .in_range(DATA_OFFSET..DEVICE_BYTES)
                    .nth(3 + seed % 5)
                    .times(1),
            );
            let run = RunOptions {
                hotzone_bytes: Some(HOTZONE_BYTES),
                ..Default::default()
            };
            assert!(resume(&fault, PASS, run, &mut |_| {}).is_err(), "no fault");
        }
        let vol = Arc::new(open(mem.clone()));
        assert_eq!(vol.sector_size().bytes(), from, "served in the old sectors");
        if left_mid_way {
            let mark = vol.reencrypted_bytes().expect("opened in reencryption");
            assert!(mark > 0 && mark < DATA_BYTES, "mark {mark}");
            assert!(
                read_all(&vol) == plaintext(),
                "contents of the reopened volume"
            );
        }
        let (want, during) = io_during(&vol, seed, plaintext(), |probe| {
            rotate_online(&vol, None, &mut |p| probe.between_hotzones(p)).expect("online rotation");
        });
        assert!(during > 0, "no request ran during the rotation");
        assert!(!vol.in_reencryption());
        assert!(vol.reopen_needed());
        assert_eq!(vol.reencrypted_bytes(), None);
        // Served in the new sectors until closed, as `status` says.
        assert_eq!(
            vol.serving_layout(),
            (
                ucrypt::sector::SectorSize::new(u64::from(to)).unwrap(),
                DATA_OFFSET
            )
        );
        assert_eq!(vol.sector_size().bytes(), from, "the volume's own sectors");
        for (verb, r) in [
            ("suspend", vol.suspend()),
            ("resize", vol.resize(None).map(|_| ())),
        ] {
            let e = r.expect_err(verb).to_string();
            assert!(e.contains("changed online"), "{verb}: {e}");
        }
        assert!(read_all(&vol) == want, "contents after the rotation");
        drop(vol);
        assert_plain_luks2(mem.as_ref());
        let again = open(mem);
        assert_eq!(again.sector_size().bytes(), to, "opened in the new sectors");
        assert!(read_all(&again) == want, "contents after reopening");
    }
}

/// Bytes of a detached header device: both header copies and the keyslots area (which holds
/// the reencrypt area).
const DETACHED_HDR_BYTES: u64 = 1 << 20;

/// A detached LUKS2 header (data offset 0, one keyslot for `PASS`) on its own device, and
/// [`plaintext`] written through the volume on the data device.
fn formatted_detached() -> (Arc<dyn Backend>, Arc<dyn Backend>) {
    let hdr_dev: Arc<dyn Backend> = Arc::new(MemBackend::new(DETACHED_HDR_BYTES));
    let data: Arc<dyn Backend> = Arc::new(MemBackend::new(DATA_BYTES));
    let vk: Vec<u8> = (0..64u8).map(|i| i ^ 0x3c).collect();
    format_detached(
        hdr_dev.as_ref(),
        "7a6b5c4d-3e2f-4a1b-9c8d-7e6f5a4b3c2d",
        (HDR_SIZE, DETACHED_HDR_BYTES, 4096),
        &vk,
        PASS,
    );
    let vol = open_detached(&hdr_dev, &data).expect("open");
    vol.write_at(&plaintext(), 0).expect("fill");
    vol.flush().expect("flush");
    (hdr_dev, data)
}

fn open_detached(hdr_dev: &Arc<dyn Backend>, data: &Arc<dyn Backend>) -> ucrypt::Result<Volume> {
    let mut o = OpenOptions::default();
    o.header = Some(hdr_dev.clone());
    luks::open(
        data.clone(),
        Unlock::Passphrase(SecretBytes::from_slice(PASS)),
        &o,
    )
}

fn start_detached(devs: Devices<'_>, kind: ResilienceKind) {
    init_on(
        devs,
        PASS,
        &InitOptions {
            resilience: kind,
            kdf: &fast_kdf(),
            key_slot: None,
            change: new_cipher("aes-xts-plain64", 32),
            mode: Mode::Reencrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: CHECKSUM_HASH,
            shift_bytes: None,
        },
    )
    .expect("init");
}

/// A detached header (`--header`): the rotation runs online with the header and resilience
/// data on their own device and the hotzones through the volume; and a volume left inside a
/// hotzone is refused until repaired (its header is served read-only), then opens as two
/// segments and finishes online.
#[test]
fn a_detached_header_rotates_online() {
    let seed = seed();
    for kind in [ResilienceKind::Checksum, ResilienceKind::Journal] {
        let (hdr_dev, data) = formatted_detached();
        let vol = Arc::new(open_detached(&hdr_dev, &data).expect("open"));
        let devs = Devices {
            header: hdr_dev.as_ref(),
            data: data.as_ref(),
        };
        start_detached(devs, kind);
        let (want, during) = io_during(&vol, seed, plaintext(), |probe| {
            rotate_online(&vol, Some(hdr_dev.as_ref()), &mut |p| {
                probe.between_hotzones(p)
            })
            .expect("online rotation");
        });
        println!("{kind:?}: {during} requests during the rotation");
        assert!(during > 0, "no request ran during the rotation");
        assert!(!vol.in_reencryption());
        assert_eq!(vol.cipher().1, 32, "the new key's size");
        assert!(read_all(&vol) == want, "contents after the rotation");
        drop(vol);
        assert_plain_luks2(hdr_dev.as_ref());
        let again = open_detached(&hdr_dev, &data).expect("reopen");
        assert!(read_all(&again) == want, "contents after reopening");
        drop(again);

        // Left inside a hotzone by a failed offline run: refused, repaired, served, finished.
        start_detached(devs, kind);
        fail_mid_way(devs, &data, 3 + seed % 5);
        match open_detached(&hdr_dev, &data) {
            Err(Error::NeedsRecovery) => {}
            Err(e) => panic!("{kind:?}: a hotzone to recover: {e}"),
            Ok(_) => panic!("{kind:?}: opened a detached header left inside a hotzone"),
        }
        recover_on(devs, PASS).expect("repair");
        let vol = Arc::new(open_detached(&hdr_dev, &data).expect("open after repair"));
        assert!(vol.in_reencryption());
        assert!(read_all(&vol) == want, "contents of the repaired volume");
        let (want, _) = io_during(&vol, seed, want, |probe| {
            rotate_online(&vol, Some(hdr_dev.as_ref()), &mut |p| {
                probe.between_hotzones(p)
            })
            .expect("online rotation after repair");
        });
        assert!(read_all(&vol) == want);
        drop(vol);
        assert_plain_luks2(hdr_dev.as_ref());
        assert!(read_all(&open_detached(&hdr_dev, &data).expect("reopen")) == want);
    }
}

/// Fails the offline run of `devs` at the `nth` data write (a few hotzones in), leaving the
/// header inside a hotzone.
fn fail_mid_way(devs: Devices<'_>, data: &Arc<dyn Backend>, nth: u64) {
    let fault = FaultBackend::new(data.clone());
    fault.add_rule(
        FaultRule::always(FaultOp::Write, Fault::Eio)
            .nth(nth)
            .times(1),
    );
    let r = resume_on(
        Devices {
            header: devs.header,
            data: &fault,
        },
        PASS,
        RunOptions {
            hotzone_bytes: Some(HOTZONE_BYTES),
            ..Default::default()
        },
        &mut |_| {},
    );
    assert!(r.is_err(), "the fault did not stop the offline run");
}

/// [`fail_mid_way`], then repaired as `ucrypt repair` does.
fn leave_mid_way(devs: Devices<'_>, data: &Arc<dyn Backend>, nth: u64) {
    fail_mid_way(devs, data, nth);
    recover_on(devs, PASS).expect("repair");
}

/// A decryption with a detached header served online: it goes backward (from the end), its
/// new side plaintext. I/O verifies throughout, the data device holds the plaintext after;
/// and one left mid-way by a failed offline run opens as two segments (the plaintext side
/// above the mark) and finishes online. Left mid-way with a journal only: with checksums this
/// 4 MiB volume is one hotzone, its last, as long as cryptsetup's repair assumes
/// (`reencrypt::plan::last_backward_hotzone`: the checksum blocks its ~1 MiB header's area
/// protects), so a failed run is never left between two.
#[test]
fn a_detached_header_decrypts_online() {
    let seed = seed();
    for (kind, interrupted) in [
        (ResilienceKind::Checksum, false),
        (ResilienceKind::Journal, false),
        (ResilienceKind::None, false),
        (ResilienceKind::Journal, true),
    ] {
        let (hdr_dev, data) = formatted_detached();
        let devs = Devices {
            header: hdr_dev.as_ref(),
            data: data.as_ref(),
        };
        let opts = InitOptions {
            resilience: kind,
            kdf: &fast_kdf(),
            key_slot: None,
            change: SegmentChange::default(),
            mode: Mode::Decrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: CHECKSUM_HASH,
            shift_bytes: None,
        };
        let vol = if interrupted {
            init_on(devs, PASS, &opts).expect("init");
            leave_mid_way(devs, &data, 3 + seed % 5);
            let vol = open_detached(&hdr_dev, &data).expect("open mid-way");
            assert!(vol.in_reencryption());
            let done = vol.reencrypted_bytes().unwrap();
            println!("{kind:?}: opened with {done} bytes decrypted (from the end)");
            assert!(done > 0 && done < DATA_BYTES);
            assert!(read_all(&vol) == plaintext(), "contents opened mid-way");
            // The end is plaintext on the device already, the start not.
            let mut tail = vec![0u8; done as usize];
            data.read_exact_at(&mut tail, DATA_BYTES - done).unwrap();
            assert!(tail[..] == plaintext()[(DATA_BYTES - done) as usize..]);
            vol
        } else {
            let vol = open_detached(&hdr_dev, &data).expect("open");
            init_on(devs, PASS, &opts).expect("init");
            vol
        };
        let vol = Arc::new(vol);
        let (want, during) = io_during(&vol, seed, plaintext(), |probe| {
            rotate_online(&vol, Some(hdr_dev.as_ref()), &mut |p| {
                probe.between_hotzones(p)
            })
            .expect("online decryption");
        });
        println!("{kind:?}: {during} requests during the decryption");
        assert!(during > 0, "no request ran during the decryption");
        assert!(!vol.in_reencryption());
        assert_eq!(vol.cipher().0.to_string(), "cipher_null-ecb");
        assert!(read_all(&vol) == want, "contents after the decryption");
        let mut raw = vec![0u8; DATA_BYTES as usize];
        data.read_exact_at(&mut raw, 0).unwrap();
        assert!(raw == want, "the data device holds the plaintext");
        // Written after the end: plaintext on the device too.
        vol.write_at(&[0xa5; 4096], 8192).unwrap();
        data.read_exact_at(&mut raw[..4096], 8192).unwrap();
        assert!(raw[..4096] == [0xa5; 4096]);
    }
}

/// An encryption with a detached header served online: the old side is the plaintext. I/O
/// verifies throughout; after it the data device holds no plaintext and the header alone
/// opens it; one left mid-way opens as two segments and finishes online.
#[test]
fn a_detached_header_encrypts_online() {
    use ucrypt::luks::reencrypt::run::{init_encrypt, EncryptOptions};
    use ucrypt::sector::{CipherSpec, SectorSize};
    let seed = seed();
    for (kind, sector, interrupted) in [
        (ResilienceKind::Checksum, 4096, false),
        (ResilienceKind::Journal, 512, false),
        (ResilienceKind::Checksum, 512, true),
        (ResilienceKind::Journal, 4096, true),
        (ResilienceKind::None, 4096, false),
    ] {
        let hdr_dev: Arc<dyn Backend> = Arc::new(MemBackend::new(DETACHED_HDR_BYTES));
        let data: Arc<dyn Backend> = Arc::new(MemBackend::new(DATA_BYTES));
        data.write_at(&plaintext(), 0).unwrap();
        let devs = Devices {
            header: hdr_dev.as_ref(),
            data: data.as_ref(),
        };
        init_encrypt(
            devs,
            PASS,
            &EncryptOptions {
                resilience: kind,
                kdf: &fast_kdf(),
                cipher: CipherSpec::AES_XTS_PLAIN64,
                key_bytes: 64,
                sector_size: SectorSize::new(sector).unwrap(),
                uuid: "1f2e3d4c-5b6a-4798-8a9b-acbdcedf0f1e".into(),
                keyslot_area: None,
                resilience_hash: CHECKSUM_HASH,
            },
        )
        .expect("init");
        if interrupted {
            leave_mid_way(devs, &data, 3 + seed % 5);
        }
        let vol = Arc::new(open_detached(&hdr_dev, &data).expect("open in encryption"));
        assert!(vol.in_reencryption());
        let done = vol.reencrypted_bytes().unwrap();
        println!("{kind:?}, sector {sector}: opened with {done} bytes encrypted");
        assert_eq!(done > 0, interrupted);
        assert!(
            read_all(&vol) == plaintext(),
            "contents opened in encryption"
        );
        let (want, during) = io_during(&vol, seed, plaintext(), |probe| {
            rotate_online(&vol, Some(hdr_dev.as_ref()), &mut |p| {
                probe.between_hotzones(p)
            })
            .expect("online encryption");
        });
        println!("{kind:?}: {during} requests during the encryption");
        assert!(during > 0, "no request ran during the encryption");
        assert!(!vol.in_reencryption());
        assert_eq!(vol.cipher().0.to_string(), "aes-xts-plain64");
        assert!(read_all(&vol) == want, "contents after the encryption");
        drop(vol);
        assert_plain_luks2(hdr_dev.as_ref());
        let mut raw = vec![0u8; DATA_BYTES as usize];
        data.read_exact_at(&mut raw, 0).unwrap();
        let plain_sectors = raw
            .chunks(4096)
            .zip(want.chunks(4096))
            .filter(|(a, b)| a == b)
            .count();
        assert_eq!(plain_sectors, 0, "plaintext left on the data device");
        let again = open_detached(&hdr_dev, &data).expect("reopen");
        assert!(read_all(&again) == want, "contents after reopening");
    }
}

/// An encryption that moves the data (the header put in front, `--reduce-device-size`)
/// served online: the old side is the plaintext at offset 0, its first shift read from the
/// moved segment; the new side the ciphertext at the shift. I/O verifies throughout (the
/// volume keeps its size, the data's, until it is closed); after it the device holds no
/// plaintext, and the volume opens again with the data at the shift and grown by it. One
/// left inside a hotzone by a failed offline run is recovered when it is opened, and
/// finishes online.
#[test]
fn an_encryption_moving_the_data_online() {
    use ucrypt::luks::reencrypt::run::{init_encrypt_shift, EncryptOptions};
    use ucrypt::sector::{CipherSpec, SectorSize};
    /// Many hotzones (each at most the shift) over the data.
    const SHIFT: u64 = 512 << 10;
    let seed = seed();
    for (sector, interrupted) in [(512u32, false), (4096, true), (4096, false), (512, true)] {
        let dev: Arc<dyn Backend> = Arc::new(MemBackend::new(DATA_BYTES + 2 * SHIFT));
        dev.write_at(&plaintext(), 0).unwrap();
        init_encrypt_shift(
            dev.as_ref(),
            PASS,
            &EncryptOptions {
                resilience: ResilienceKind::None,
                kdf: &fast_kdf(),
                cipher: CipherSpec::AES_XTS_PLAIN64,
                key_bytes: 64,
                sector_size: SectorSize::new(u64::from(sector)).unwrap(),
                uuid: "2a3b4c5d-6e7f-4081-92a3-b4c5d6e7f809".into(),
                keyslot_area: None,
                resilience_hash: CHECKSUM_HASH,
            },
            2 * SHIFT,
        )
        .expect("init");
        if interrupted {
            // Left inside a hotzone: `open` moves it again first, as `repair` does.
            let fault = FaultBackend::new(dev.clone());
            fault.add_rule(
                FaultRule::always(FaultOp::Write, Fault::Eio)
                    .in_range(SHIFT..DATA_BYTES + SHIFT)
                    .nth(2 + seed % 5)
                    .times(1),
            );
            let run = RunOptions {
                hotzone_bytes: Some(HOTZONE_BYTES),
                ..Default::default()
            };
            assert!(resume(&fault, PASS, run, &mut |_| {}).is_err(), "no fault");
            let hdr = luks::read_header(dev.as_ref()).unwrap();
            let luks::Header::Luks2(h) = &hdr else {
                panic!("LUKS2")
            };
            let st = ucrypt::luks::reencrypt::ReencryptState::from_metadata(h.meta())
                .unwrap()
                .expect("in reencryption");
            assert!(st.needs_recovery(), "left inside a hotzone");
        }
        let vol = Arc::new(open(dev.clone()));
        assert!(vol.in_reencryption());
        assert_eq!(vol.size(), DATA_BYTES, "served at the data's size");
        let done = vol.reencrypted_bytes().unwrap();
        println!("sector {sector}, interrupted {interrupted}: opened with {done} bytes encrypted");
        assert_eq!(done > 0, interrupted);
        assert!(
            read_all(&vol) == plaintext(),
            "contents opened in encryption"
        );
        let (want, during) = io_during(&vol, seed, plaintext(), |probe| {
            rotate_online(&vol, None, &mut |p| probe.between_hotzones(p))
                .expect("online encryption");
        });
        println!("sector {sector}: {during} requests during the encryption");
        assert!(during > 0, "no request ran during the encryption");
        assert!(!vol.in_reencryption());
        assert!(vol.reopen_needed(), "the data offset changed");
        assert_eq!(
            vol.serving_layout(),
            (SectorSize::new(u64::from(sector)).unwrap(), SHIFT),
            "served at the new data offset until closed"
        );
        let e = vol.suspend().expect_err("suspend").to_string();
        assert!(e.contains("changed online"), "suspend: {e}");
        assert!(read_all(&vol) == want, "contents after the encryption");
        // Still written through the new side after the end.
        vol.write_at(&[0x3c; 4096], 8192).unwrap();
        let mut want = want;
        want[8192..8192 + 4096].fill(0x3c);
        drop(vol);
        assert_plain_luks2(dev.as_ref());
        // No 4 KiB of plaintext left anywhere on the device (the moved segment wiped).
        let mut raw = vec![0u8; (DATA_BYTES + 2 * SHIFT) as usize];
        dev.read_exact_at(&mut raw, 0).unwrap();
        let (orig, chunks) = (plaintext(), raw.chunks(4096));
        let left = chunks
            .filter(|c| orig.chunks(4096).chain(want.chunks(4096)).any(|p| p == *c))
            .count();
        assert_eq!(left, 0, "plaintext left on the device");
        let again = open(dev);
        assert_eq!(again.size(), DATA_BYTES + SHIFT, "grown by the shift");
        assert!(read_all(&again) == want, "contents after reopening");
    }
}

/// A decryption that moves the data back (the header exported to a new file, the plaintext
/// moved to the start of the device) served online, as cryptsetup 2.6 activates one: the
/// walk goes forward from the end of the moved segment and decrypts the moved segment (the
/// first `M` bytes, copied over the old header) last, so the volume is three ranges while it
/// runs: the moved segment on the old side (read where it moved), the walk's part done on the
/// new side (plaintext at offset 0), the rest on the old side (ciphertext at the old offset).
/// I/O verifies throughout; the device then holds the plaintext from offset 0; one left
/// mid-way by a failed offline run and repaired opens as three ranges and finishes online.
#[test]
fn a_decryption_moving_the_data_back_online() {
    use ucrypt::luks::reencrypt::run::{init_decrypt_unshift, UnshiftOptions};
    let seed = seed();
    for (sector, moved, kind, interrupted) in [
        (512u32, None, ResilienceKind::Checksum, false),
        (4096, Some(256u64 << 10), ResilienceKind::Journal, true),
        (4096, None, ResilienceKind::Checksum, true),
        (512, Some(256 << 10), ResilienceKind::Journal, false),
    ] {
        let what = format!("sector {sector}, moved {moved:?}, {kind:?}, interrupted {interrupted}");
        let dev: Arc<dyn Backend> = Arc::new(MemBackend::new(DEVICE_BYTES));
        formatted(&dev, sector);
        let hdr: Arc<dyn Backend> = Arc::new(MemBackend::new(DATA_OFFSET));
        let devs = Devices {
            header: hdr.as_ref(),
            data: dev.as_ref(),
        };
        init_decrypt_unshift(
            devs,
            PASS,
            &UnshiftOptions {
                kdf: &fast_kdf(),
                key_slot: None,
                moved_bytes: moved,
                resilience: kind,
                resilience_hash: CHECKSUM_HASH,
            },
        )
        .expect("init");
        if interrupted {
            // The 2nd or 3rd data write: one write per lane chunk leaves the walk mid-way,
            // before the moved segment's hotzone (the last; a fault there is recovered whole).
            leave_mid_way(devs, &dev, 2 + seed % 2);
        }
        let vol = Arc::new(open_detached(&hdr, &dev).expect("open in decryption"));
        assert!(vol.in_reencryption(), "{what}");
        assert_eq!(vol.size(), DATA_BYTES, "{what}: served at the data's size");
        let done = vol.reencrypted_bytes().unwrap();
        println!("{what}: opened with {done} bytes decrypted");
        assert_eq!(done > 0, interrupted, "{what}");
        assert!(read_all(&vol) == plaintext(), "{what}: contents opened");
        let (want, during) = io_during(&vol, seed, plaintext(), |probe| {
            rotate_online(&vol, Some(hdr.as_ref()), &mut |p| probe.between_hotzones(p))
                .expect("online decryption");
        });
        println!("{what}: {during} requests during the decryption");
        assert!(during > 0, "{what}: no request ran during the decryption");
        assert!(!vol.in_reencryption(), "{what}");
        assert!(vol.reopen_needed(), "{what}: the data offset changed");
        assert!(
            read_all(&vol) == want,
            "{what}: contents after the decryption"
        );
        drop(vol);
        assert_plain_luks2(hdr.as_ref());
        let mut raw = vec![0u8; DATA_BYTES as usize];
        dev.read_exact_at(&mut raw, 0).unwrap();
        assert!(
            raw == want,
            "{what}: the device holds the plaintext from offset 0"
        );
    }
}

/// A rotation driven online that stops inside a hotzone (its driver died or failed: here one
/// of its data or header writes fails, at many points of the first hotzones) while the
/// volume serves on. Before the recovery another rotation is refused (no panic in the
/// hotzone lock); `reencrypt::online::recover_stopped` (the recovery `repair` runs) brings
/// the hotzone back from the resilience data while the volume serves, after which every
/// byte reads back as it was (the hotzone too, no EIO), the volume's mark is the header's,
/// and the rotation resumes online to the end under I/O. Without resilience data (`none`)
/// a hotzone the header records is not recovered online: it stays blocked (reads of it fail,
/// the rest reads back), and the volume opened again recovers it as cryptsetup does.
#[test]
fn a_rotation_stopped_inside_a_hotzone_is_recovered_while_served() {
    use reencrypt::online::Stopped;
    let seed = seed();
    let mut seen = std::collections::BTreeMap::<String, u32>::new();
    for kind in [
        ResilienceKind::Checksum,
        ResilienceKind::Journal,
        ResilienceKind::None,
    ] {
        // The nth write to the data (a piece of a hotzone), or to the header and its
        // resilience data (checksums, journal, the commits).
        let data = (DATA_OFFSET..DEVICE_BYTES, 1..=4u64);
        let header = (0..DATA_OFFSET, 1..=8u64);
        for (range, nths) in [data, header] {
            for nth in nths {
                let case = format!("{kind:?}, write {nth} in {range:?}");
                let mem: Arc<dyn Backend> = Arc::new(MemBackend::new(DEVICE_BYTES));
                formatted(&mem, 4096);
                let fault = Arc::new(FaultBackend::new(mem.clone()));
                let vol = open(fault.clone());
                start(mem.as_ref(), kind, SegmentChange::default());
                fault.add_rule(
                    FaultRule::always(FaultOp::Write, Fault::Eio)
                        .in_range(range.clone())
                        .nth(nth)
                        .times(1),
                );
                let r = rotate_online(&vol, None, &mut |_| {});
                assert!(r.is_err(), "{case}: the fault did not stop the rotation");
                fault.clear_rules();
                // Another rotation before the recovery: refused (busy, or needs recovery).
                let again = rotate_online(&vol, None, &mut |_| {});
                assert!(
                    again.is_err(),
                    "{case}: a second rotation ran over the first"
                );
                let stopped = reencrypt::online::recover_stopped(&vol, None, PASS)
                    .unwrap_or_else(|e| panic!("{case}: recovery: {e}"));
                let what = match stopped {
                    Stopped::Released { recovered, .. } => format!("released {recovered}"),
                    s => format!("{s:?}").split(' ').next().unwrap_or("").to_string(),
                };
                *seen.entry(format!("{kind:?} {what}")).or_default() += 1;
                if let Stopped::Unrecoverable { offset, len } = stopped {
                    assert_eq!(kind, ResilienceKind::None, "{case}: {stopped:?}");
                    let mut got = vec![0u8; len as usize];
                    assert!(
                        vol.read_at(&mut got, offset).is_err(),
                        "{case}: the blocked hotzone read"
                    );
                    // The rest reads back; opened again, the hotzone is taken as rewritten.
                    let want = plaintext();
                    let mut before = vec![0u8; offset as usize];
                    vol.read_at(&mut before, 0).expect("read below the hotzone");
                    assert!(
                        before == want[..offset as usize],
                        "{case}: below the hotzone"
                    );
                    drop(vol);
                    let vol = open(mem.clone());
                    rotate_online(&vol, None, &mut |_| {}).expect("rotation after reopening");
                    let got = read_all(&vol);
                    let (a, b) = (offset as usize, (offset + len) as usize);
                    assert!(got[..a] == want[..a] && got[b..] == want[b..], "{case}");
                    continue;
                }
                assert!(
                    !matches!(
                        stopped,
                        Stopped::Released {
                            recovered: true,
                            ..
                        }
                    ) || kind != ResilienceKind::None,
                    "{case}: recovered without resilience data"
                );
                let hdr = luks::read_header(mem.as_ref()).expect("header");
                let luks::Header::Luks2(h) = &hdr else {
                    panic!("{case}: not LUKS2");
                };
                let st = ucrypt::luks::reencrypt::ReencryptState::from_metadata(h.meta())
                    .expect("state")
                    .expect("in reencryption");
                assert!(!st.needs_recovery(), "{case}: left inside a hotzone");
                if let Stopped::Released { done, .. } = stopped {
                    assert_eq!(vol.reencrypted_bytes(), Some(done), "{case}: the mark");
                }
                assert!(
                    read_all(&vol) == plaintext(),
                    "{case}: contents after recovery"
                );
                let vol = Arc::new(vol);
                let (want, _) = io_during(&vol, seed ^ nth, plaintext(), |probe| {
                    rotate_online(&vol, None, &mut |p| probe.between_hotzones(p))
                        .expect("resumed online");
                });
                assert!(!vol.in_reencryption(), "{case}");
                assert!(
                    read_all(&vol) == want,
                    "{case}: contents after the rotation"
                );
                drop(vol);
                assert_plain_luks2(mem.as_ref());
                assert!(read_all(&open(mem)) == want, "{case}: after reopening");
            }
        }
    }
    println!("{seen:?}");
    // Each way a stopped rotation can be left was met.
    for want in [
        "Checksum released true",
        "Checksum released false",
        "Journal released true",
        "None Unrecoverable",
    ] {
        assert!(seen.contains_key(want), "never {want}: {seen:?}");
    }
}
