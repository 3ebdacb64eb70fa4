//! `ucrypt bench reencrypt`: offline key rotation of a file volume, `ucrypt reencrypt` beside
//! `cryptsetup reencrypt --force-offline-reencrypt` on a copy of the same volume, per
//! resilience mode; and the ceiling the rotation is judged against: `ucrypt export` then
//! `ucrypt import` of the same bytes (one decrypting pass and one encrypting pass, each
//! through the engine), timed in the same round. One more row: the encryption of the same
//! plaintext with the header in front (`reencrypt --encrypt --reduce-device-size 32M`, the
//! data moved by 16 MiB: datashift), by both tools on copies of one plaintext file.
//!
//! Each round formats one volume with cryptsetup (aes-xts-plain64, 512-bit key, 4096-byte
//! sectors, pbkdf2 at 1000 iterations so the unlocks cost little), fills it through `ucrypt
//! import`, and copies it once per tool and mode; then every timed command runs once, in turn
//! (round-robin across rounds). Wall seconds include each tool's unlocks. Each cell is the
//! median of the rounds (min–max); ratios are of medians. The whole scenario runs once on an
//! idle host and once with two busy-loop threads competing for the CPU (a shared host).
//!
//! A second ceiling, for the goal against cryptsetup: the bare rotation. One thread per core
//! claims the same file's data area 256 KiB at a time (ucrypt's lane chunk), reads it,
//! decrypts it with one AES-XTS key and encrypts it with another in place, and writes it back;
//! the threads take turns at the writes (`ucrypt::sync::TakeTurns`, as ucrypt's lanes do on a
//! buffered file, whose every write takes the file's lock anyway), with up to 16 MiB of
//! chunks waiting for theirs; then the file is synced: the crypto and the copies any key
//! rotation of these bytes must do on this machine, with no header, no resilience data and no
//! unlock. cryptsetup ÷ bare is the most any tool could beat cryptsetup by here; where it is
//! below 2 the "2×" goal is above what the machine allows, and ucrypt is judged by bare ÷
//! ucrypt instead (the brief's ceiling rule: within 0.9). The journal row has a bare rotation
//! of its own: the same loop that also writes each chunk, as read, to a journal area before
//! rekeying it (the one copy more a journal must make of every byte), so that its ceiling
//! does the work its mode needs; the datashift row's bare loop encrypts 512-byte sectors (as
//! both tools' `--encrypt` of a file does) and writes each chunk a shift lower.
//!
//! A third, for the rows whose protocol orders the hotzones (journal, datashift): the ordered
//! bare rotation. The bare loop keeps no order; a rotation on the LUKS2 protocol cannot
//! start a journal hotzone's rewrite before its whole journal copy is flushed (and committed),
//! nor the next hotzone's copy before the rewrite is (the journal area holds one hotzone, and
//! a default header's area bounds the hotzone), nor move a datashift hotzone before the
//! previous one is flushed (its target is the next one's source). The ordered bare loop does
//! the same crypto and copies with those order points: per hotzone, every thread claims 256
//! KiB chunks (writing in turns, as above), then waits for the others, and one flushes (no
//! commit, header or unlock); the shift encrypts 512-byte sectors, as both tools' `--encrypt`
//! of a file does. On a busy host a thread the scheduler holds back makes the others wait at
//! each order point; the bare loop never waits. It bounds a rotation that waits at each order
//! point. ucrypt's offline `none` and datashift rotations do not wait there (they read and
//! rekey the next hotzone while the last one's writes and commits finish), so for them the
//! bare loops are the ceiling and the ordered ones show what the order points cost a
//! rotation that waits, as the journal's does.
//!
//! Needs cryptsetup (2.6 or later for `--force-offline-reencrypt`); without it the cryptsetup
//! column says SKIPPED and the rest runs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::cmd::{have, run_ok};
use super::stats::{Machine, Summary};

/// Data bytes of the volume (the file adds cryptsetup's 16 MiB header).
const DATA_BYTES: u64 = 1 << 30;
const DATA_BYTES_QUICK: u64 = 256 << 20;
/// cryptsetup's LUKS2 data offset for a default format.
const HEADER_BYTES: u64 = 16 << 20;
const PASSPHRASE: &[u8] = b"bench-rotate";
const PBKDF2_ITERATIONS: &str = "1000";
/// Threads that spin during the busy-host runs.
const BUSY_THREADS: usize = 2;
/// The resilience modes both tools rotate with.
const MODES: [&str; 3] = ["checksum", "journal", "none"];
/// The datashift row: its name, and the free space at the end of the plaintext file (the
/// header takes half of it, the data moves by that half).
const SHIFT_ROW: &str = "datashift (encrypt)";
const REDUCE: &str = "32M";
const REDUCE_BYTES: u64 = 32 << 20;

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub resilience: String,
    /// Busy-loop threads competing during the run.
    pub busy_threads: usize,
    /// Wall seconds.
    pub ucrypt_s: Summary,
    pub cryptsetup_s: Option<Summary>,
    /// `ucrypt export` + `ucrypt import` of the same bytes.
    pub export_import_s: Summary,
    /// cryptsetup ÷ ucrypt (above 1: ucrypt faster; goal ≥ 2).
    pub vs_cryptsetup: Option<f64>,
    /// (export + import) ÷ ucrypt (the share of the one-pass ceiling reached; goal ≥ 0.8).
    pub of_ceiling: f64,
    /// The bare rotation of the same bytes in the same rounds (module docs); for the journal
    /// row, the bare rotation with the journal's copy.
    pub bare_s: Summary,
    /// cryptsetup ÷ bare: the most a rotation can beat cryptsetup by on this machine (the
    /// 2× goal is reachable only where this is ≥ 2).
    pub cryptsetup_over_bare: Option<f64>,
    /// bare ÷ ucrypt (the share of the bare rotation's speed reached; 0.9 is the target where
    /// the 2× goal is out of reach).
    pub of_bare: f64,
    /// The ordered bare rotation (module docs), for the rows whose protocol orders every
    /// hotzone (journal and datashift): the bare loop's work with the protocol's order points.
    pub ordered_s: Option<Summary>,
    /// cryptsetup ÷ ordered bare: the most a rotation that waits at the protocol's order
    /// points can beat cryptsetup by here (one that never waited could do better).
    pub cryptsetup_over_ordered: Option<f64>,
    /// ordered bare ÷ ucrypt.
    pub of_ordered: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub dir: String,
    pub data_bytes: u64,
    pub runs: usize,
    pub rows: Vec<Row>,
    pub cryptsetup: String,
    pub notes: Vec<String>,
}

/// The scratch directory and what lives in it; removed on drop.
struct Scratch(PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch_dir() -> Result<Scratch, String> {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    Ok(Scratch(crate::disk::run_dir(&base, "reencrypt")?))
}

fn timed(cmd: &mut Command) -> Result<f64, String> {
    let t = Instant::now();
    run_ok(cmd)?;
    Ok(t.elapsed().as_secs_f64())
}

/// A cryptsetup-formatted volume of `data` bytes holding pseudo-random plaintext.
fn make_volume(
    ucrypt: &Path,
    dir: &Path,
    key: &Path,
    data: u64,
    formatter: &str,
) -> Result<PathBuf, String> {
    let img = dir.join("base.img");
    let plain = dir.join("plain.bin");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(data + HEADER_BYTES))
        .map_err(|e| format!("{}: {e}", img.display()))?;
    let fmt_args = [
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        PBKDF2_ITERATIONS,
        "--cipher",
        "aes-xts-plain64",
        "--key-size",
        "512",
        "--sector-size",
        "4096",
        "--key-file",
    ];
    if formatter == "cryptsetup" {
        run_ok(
            Command::new("cryptsetup")
                .args(["luksFormat", "-q", "--type", "luks2"])
                .args(fmt_args)
                .arg(key)
                .arg(&img),
        )?;
    } else {
        run_ok(
            Command::new(ucrypt)
                .args(["format", "-q"])
                .args(fmt_args)
                .arg(key)
                .arg(&img),
        )?;
    }
    // Plaintext that compresses nowhere: a counter through a cheap mixer.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut buf = vec![0u8; 1 << 20];
    let mut f = std::fs::File::create(&plain).map_err(|e| format!("{}: {e}", plain.display()))?;
    for _ in 0..data >> 20 {
        for c in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes());
        }
        std::io::Write::write_all(&mut f, &buf).map_err(|e| e.to_string())?;
    }
    drop(f);
    run_ok(
        Command::new(ucrypt)
            .arg("import")
            .arg(&plain)
            .arg(&img)
            .arg("--key-file")
            .arg(key),
    )?;
    std::fs::remove_file(&plain).map_err(|e| e.to_string())?;
    Ok(img)
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| format!("copy to {}: {e}", to.display()))
}

/// Bytes a thread of the bare rotation claims, reads, rekeys and writes at a time: ucrypt's
/// lane chunk.
const BARE_CHUNK: usize = 256 << 10;
/// Chunks the bare rotation holds in memory (16 MiB): a chunk waits for its slot's last chunk
/// to be written, so the writes may fall that far behind the crypto.
const BARE_SLOTS: usize = 64;
/// Slots of [`BARE_CHUNK`] bytes for the bare rotation's journal copies, at the start of the
/// file (its header area, [`HEADER_BYTES`]: the bare rotation works on a throw-away copy).
const BARE_JOURNAL_SLOTS: u64 = HEADER_BYTES / BARE_CHUNK as u64;

/// An AES-256-XTS context (4096-byte sectors) with a key made from `seed`: the bare
/// rotations' old and new keys.
pub(crate) fn xts_cipher(seed: u8) -> Result<ucrypt::sector::SectorCipher, String> {
    xts_cipher_sectors(seed, ucrypt::sector::SectorSize::S4096)
}

/// [`xts_cipher`] with sectors of `size`.
fn xts_cipher_sectors(
    seed: u8,
    size: ucrypt::sector::SectorSize,
) -> Result<ucrypt::sector::SectorCipher, String> {
    use ucrypt::sector::{CipherSpec, Geometry, SectorCipher};
    let key: Vec<u8> = (0..64u8).map(|i| i ^ seed).collect();
    SectorCipher::new(CipherSpec::AES_XTS_PLAIN64, &key, Geometry::new(size))
        .map_err(|e| e.to_string())
}

/// `path` opened for a bare rotation, and its threads: one per core.
fn open_for_bare(path: &Path) -> Result<(std::fs::File, usize), String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((
        file,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    ))
}

/// What a bare loop does with each chunk ([`bare_rotation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bare {
    /// Decrypts and encrypts it in place, in 4096-byte sectors.
    Rekey,
    /// The same, after writing it, as read, to a slot of the file's first [`HEADER_BYTES`]
    /// (the journal's copy).
    RekeyJournal,
    /// Encrypts it in 512-byte sectors and writes it [`SHIFT_BYTES`] lower: a data shift's
    /// move, in no hotzone order (the datashift row's ceiling for a rotation that never waits
    /// at the order points).
    Shift,
}

/// The bare rotation (module docs) of `len` bytes of `path` from `offset`: wall seconds; each
/// chunk as `kind` says.
fn bare_rotation(path: &Path, offset: u64, len: u64, kind: Bare) -> Result<f64, String> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::AtomicU64;
    use std::sync::{Mutex, PoisonError};
    use ucrypt::sync::TakeTurns;
    let (file, cores) = open_for_bare(path)?;
    if kind == Bare::Shift && offset < SHIFT_BYTES {
        return Err("bare shift: nowhere to move the first chunks".into());
    }
    let chunks = len.div_ceil(BARE_CHUNK as u64);
    let slots: Vec<Mutex<Vec<u8>>> = (0..BARE_SLOTS)
        .map(|_| Mutex::new(vec![0u8; BARE_CHUNK]))
        .collect();
    // The chunk each slot may take next: chunk k takes slot k % BARE_SLOTS once chunk
    // k - BARE_SLOTS is written from it.
    let next: Vec<AtomicU64> = (0..BARE_SLOTS as u64).map(AtomicU64::new).collect();
    // Whether a slot's journal copy is still to be written.
    let copying: Vec<AtomicBool> = (0..BARE_SLOTS).map(|_| AtomicBool::new(false)).collect();
    let claimed = AtomicU64::new(0);
    // Set when a write failed: nobody then waits for one.
    let failed = AtomicBool::new(false);
    let io = |e: std::io::Error| format!("bare rotation: {e}");
    // The writes to the file, one thread at a time (as ucrypt writes a buffered file,
    // `ucrypt::sync::TakeTurns`): slot, file offset, bytes, and whether the write is the
    // journal's copy (else the chunk's rekeyed bytes, after which its slot is free).
    let turns = TakeTurns::<(usize, u64, usize, bool)>::new(BARE_SLOTS);
    let write = |(s, to, n, copy): (usize, u64, usize, bool)| -> Result<(), String> {
        let b = slots[s].lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = file.write_all_at(&b[..n], to) {
            failed.store(true, Ordering::Release);
            return Err(io(e));
        }
        if copy {
            copying[s].store(false, Ordering::Release);
        } else {
            next[s].fetch_add(BARE_SLOTS as u64, Ordering::Release);
        }
        Ok(())
    };
    // Waits until `done` holds (another thread's write, in its turn).
    let wait = |done: &dyn Fn() -> bool| -> Result<(), String> {
        while !done() {
            if failed.load(Ordering::Acquire) {
                return Err("bare rotation: another thread's write failed".into());
            }
            std::thread::yield_now();
        }
        Ok(())
    };
    let t = Instant::now();
    std::thread::scope(|sc| {
        let threads: Vec<_> = (0..cores)
            .map(|_| {
                let (file, slots, next, copying) = (&file, &slots, &next, &copying);
                let (claimed, turns, write, wait) = (&claimed, &turns, &write, &wait);
                sc.spawn(move || -> Result<(), String> {
                    let sectors = match kind {
                        Bare::Rekey | Bare::RekeyJournal => ucrypt::sector::SectorSize::S4096,
                        Bare::Shift => ucrypt::sector::SectorSize::S512,
                    };
                    let mut old = xts_cipher_sectors(0xa5, sectors)?;
                    let mut new = xts_cipher_sectors(0x5a, sectors)?;
                    loop {
                        let k = claimed.fetch_add(1, Ordering::Relaxed);
                        if k >= chunks {
                            return Ok(());
                        }
                        let s = (k % BARE_SLOTS as u64) as usize;
                        wait(&|| next[s].load(Ordering::Acquire) == k)?;
                        let at = k * BARE_CHUNK as u64;
                        let n = (len - at).min(BARE_CHUNK as u64) as usize;
                        let lock = || slots[s].lock().unwrap_or_else(PoisonError::into_inner);
                        file.read_exact_at(&mut lock()[..n], offset + at)
                            .map_err(io)?;
                        if kind == Bare::RekeyJournal {
                            let slot = k % BARE_JOURNAL_SLOTS * BARE_CHUNK as u64;
                            copying[s].store(true, Ordering::Release);
                            turns.take((s, slot, n, true), write)?;
                            wait(&|| !copying[s].load(Ordering::Acquire))?;
                        }
                        {
                            let mut g = lock();
                            let b = &mut g[..n];
                            let sector = at / new.sector_bytes() as u64;
                            if kind != Bare::Shift {
                                old.decrypt(sector, b).map_err(|e| e.to_string())?;
                            }
                            new.encrypt(sector, b).map_err(|e| e.to_string())?;
                        }
                        let to = match kind {
                            Bare::Rekey | Bare::RekeyJournal => offset + at,
                            Bare::Shift => offset + at - SHIFT_BYTES,
                        };
                        turns.take((s, to, n, false), write)?;
                    }
                })
            })
            .collect();
        threads.into_iter().try_for_each(|t| {
            t.join()
                .map_err(|_| "bare rotation thread panicked".to_string())?
        })
    })?;
    if turns.left() != 0 {
        return Err("bare rotation: a chunk was left unwritten".into());
    }
    file.sync_all()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(t.elapsed().as_secs_f64())
}

/// What the ordered bare rotation keeps of the protocol's order (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Per hotzone of the journal area: every byte read and copied to the journal, a flush,
    /// then every byte rekeyed and written back, a flush.
    Journal,
    /// Per hotzone of the shift: every byte read, encrypted and written a shift lower, a flush.
    /// In 512-byte sectors: what both tools' `--encrypt` of a file writes (its `luksDump`).
    Shift,
}

/// The journal area a default LUKS2 header leaves for the reencryption keyslot (its
/// `luksDump` "Area length" after either tool's `--init-only --resilience journal` on this
/// bench's format): the longest journal hotzone of either tool.
const JOURNAL_AREA_BYTES: u64 = 16_228_352;
/// The data shift of the datashift row: half the space `--reduce-device-size` frees.
const SHIFT_BYTES: u64 = REDUCE_BYTES / 2;
/// Bytes the ordered bare rotation's threads claim at a time within a hotzone.
const ORDERED_CHUNK: usize = 256 << 10;

/// The ordered bare rotation (module docs) of `len` bytes of `path` from `offset`: wall
/// seconds. The bare loop's work with the order points the on-disk protocol puts between
/// hotzones (`order`), where every thread waits for the others and one flushes; the lanes
/// claim [`ORDERED_CHUNK`] bytes at a time, so a thread held back leaves its share to the
/// others. No header, no commit, no unlock.
fn bare_ordered(path: &Path, offset: u64, len: u64, order: Order) -> Result<f64, String> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Barrier, Mutex, PoisonError};
    use ucrypt::sector::{SectorCipher, SectorSize};
    use ucrypt::sync::TakeTurns;
    let (file, cores) = open_for_bare(path)?;
    let hot = match order {
        Order::Journal => JOURNAL_AREA_BYTES,
        Order::Shift => SHIFT_BYTES,
    };
    if order == Order::Shift && offset < hot {
        return Err("ordered bare shift: nowhere to move the first hotzone".into());
    }
    let per_hotzone = hot.div_ceil(ORDERED_CHUNK as u64) as usize;
    let hotzones = len.div_ceil(hot) as usize;
    // The hotzone in memory, a chunk per lock (each taken by one thread at a time).
    let bufs: Vec<Mutex<Vec<u8>>> = (0..per_hotzone)
        .map(|_| Mutex::new(vec![0u8; ORDERED_CHUNK]))
        .collect();
    // One claim counter per phase: two per journal hotzone, one per shift hotzone.
    let claims: Vec<AtomicUsize> = (0..hotzones * 2).map(|_| AtomicUsize::new(0)).collect();
    let barrier = Barrier::new(cores);
    // The writes to the file, one thread at a time (as ucrypt writes a buffered file,
    // `ucrypt::sync::TakeTurns`): chunk, file offset, bytes.
    let turns = TakeTurns::<(usize, u64, usize)>::new(per_hotzone);
    let write = |(i, to, c): (usize, u64, usize)| -> Result<(), String> {
        let b = bufs[i].lock().unwrap_or_else(PoisonError::into_inner);
        file.write_all_at(&b[..c], to)
            .map_err(|e| format!("ordered bare rotation: {e}"))
    };
    // The first error; the others then only pass the order points, so nobody waits forever.
    let error: Mutex<Option<String>> = Mutex::new(None);
    let failed = AtomicBool::new(false);
    let fail = |e: String| {
        failed.store(true, Ordering::Relaxed);
        error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(e);
    };
    // One thread's part: claims the chunks of phase `phase` (of a hotzone `n` bytes long at
    // data offset `start`) until none is left.
    let phase =
        |phase: usize, start: u64, n: u64, ciphers: &mut Option<(SectorCipher, SectorCipher)>| {
            let k = n.div_ceil(ORDERED_CHUNK as u64) as usize;
            let journal_copy = order == Order::Journal && phase % 2 == 0;
            loop {
                let i = claims[phase].fetch_add(1, Ordering::Relaxed);
                if i >= k || failed.load(Ordering::Relaxed) {
                    return;
                }
                let at = start + (i * ORDERED_CHUNK) as u64;
                let c = (start + n - at).min(ORDERED_CHUNK as u64) as usize;
                let io = |e: std::io::Error| format!("ordered bare rotation: {e}");
                let r = (|| -> Result<(), String> {
                    let Some((old, new)) = ciphers.as_mut() else {
                        return Err("ordered bare rotation: no cipher".into());
                    };
                    let sector = at / new.sector_bytes() as u64;
                    let mut guard = bufs[i].lock().unwrap_or_else(PoisonError::into_inner);
                    let b = &mut guard[..c];
                    // Where the chunk goes, once it is ready.
                    let to = if journal_copy {
                        file.read_exact_at(b, offset + at).map_err(io)?;
                        (i * ORDERED_CHUNK) as u64
                    } else {
                        match order {
                            // Read in the journal's phase, still in memory.
                            Order::Journal => {
                                old.decrypt(sector, b).map_err(|e| e.to_string())?;
                                new.encrypt(sector, b).map_err(|e| e.to_string())?;
                                offset + at
                            }
                            Order::Shift => {
                                file.read_exact_at(b, offset + at).map_err(io)?;
                                new.encrypt(sector, b).map_err(|e| e.to_string())?;
                                offset + at - hot
                            }
                        }
                    };
                    // Unlocked before the chunk is handed on: the writing thread locks it.
                    drop(guard);
                    turns.take((i, to, c), &write)
                })();
                if let Err(e) = r {
                    fail(e);
                }
            }
        };
    // Every thread waits for the others, one flushes, and all wait for the flush.
    let order_point = || {
        if barrier.wait().is_leader() {
            if let Err(e) = file.sync_data() {
                fail(format!("ordered bare rotation: {e}"));
            }
        }
        barrier.wait();
    };
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..cores {
            s.spawn(|| {
                let sectors = match order {
                    Order::Journal => SectorSize::S4096,
                    Order::Shift => SectorSize::S512,
                };
                let ciphers = (
                    xts_cipher_sectors(0xa5, sectors),
                    xts_cipher_sectors(0x5a, sectors),
                );
                let mut ciphers = match ciphers {
                    (Ok(o), Ok(n)) => Some((o, n)),
                    (Err(e), _) | (_, Err(e)) => {
                        fail(e);
                        None
                    }
                };
                for z in 0..hotzones {
                    let start = z as u64 * hot;
                    let n = hot.min(len - start);
                    if order == Order::Journal {
                        phase(2 * z, start, n, &mut ciphers);
                        order_point();
                    }
                    phase(2 * z + 1, start, n, &mut ciphers);
                    order_point();
                }
            });
        }
    });
    if let Some(e) = error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        return Err(e);
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Spins `n` threads until dropped.
pub(crate) struct Busy {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Busy {
    pub(crate) fn start(n: usize) -> Busy {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let s = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !s.load(Ordering::Relaxed) {
                        for _ in 0..10_000 {
                            x = std::hint::black_box(x.wrapping_mul(6364136223846793005) + 1);
                        }
                    }
                })
            })
            .collect();
        Busy { stop, threads }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

pub fn measure(runs: usize, quick: bool, progress: bool) -> Result<Report, String> {
    let ucrypt = crate::ucrypt_bin()?;
    let data = if quick { DATA_BYTES_QUICK } else { DATA_BYTES };
    let with_cryptsetup = have("cryptsetup");
    let scratch = scratch_dir()?;
    let dir = &scratch.0;
    let key = dir.join("key");
    std::fs::write(&key, PASSPHRASE).map_err(|e| e.to_string())?;
    let setup = Setup {
        ucrypt: &ucrypt,
        dir,
        key: &key,
        data,
        with_cryptsetup,
    };
    let mut rows = Vec::new();
    for busy in [0, BUSY_THREADS] {
        let mut s = Samples::new();
        for round in 0..runs {
            run_round(&setup, busy, &mut s)?;
            if progress {
                s.print_last(busy, round, runs);
            }
        }
        rows.extend(s.rows(busy, with_cryptsetup));
    }
    Ok(Report {
        machine: Machine::detect(),
        dir: dir.display().to_string(),
        data_bytes: data,
        runs,
        rows,
        cryptsetup: if with_cryptsetup {
            run_ok(Command::new("cryptsetup").arg("--version"))
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        } else {
            "SKIPPED: cryptsetup is not installed".into()
        },
        notes: notes(),
    })
}

/// What every round of [`measure`] uses.
struct Setup<'a> {
    ucrypt: &'a Path,
    dir: &'a Path,
    key: &'a Path,
    data: u64,
    with_cryptsetup: bool,
}

/// The wall seconds of one busy level, one entry per round.
struct Samples {
    /// ucrypt's, one column per mode, and the datashift encryption last.
    u: Vec<Vec<f64>>,
    /// cryptsetup's, as `u`.
    c: Vec<Vec<f64>>,
    /// export + import.
    ei: Vec<f64>,
    bare: Vec<f64>,
    bare_journal: Vec<f64>,
    bare_shift: Vec<f64>,
    ordered_journal: Vec<f64>,
    ordered_shift: Vec<f64>,
}

impl Samples {
    fn new() -> Self {
        Samples {
            u: vec![Vec::new(); MODES.len() + 1],
            c: vec![Vec::new(); MODES.len() + 1],
            ei: Vec::new(),
            bare: Vec::new(),
            bare_journal: Vec::new(),
            bare_shift: Vec::new(),
            ordered_journal: Vec::new(),
            ordered_shift: Vec::new(),
        }
    }

    /// The last round's timings, on stderr.
    fn print_last(&self, busy: usize, round: usize, runs: usize) {
        let last = |v: &Vec<f64>| v.last().copied().unwrap_or(f64::NAN);
        eprintln!(
            "reencrypt: busy {busy}, round {}/{runs}: ucrypt {:?} cryptsetup {:?} export+import {:.2} bare {:.2} bare+journal {:.2} bare shift {:.2} ordered journal {:.2} ordered shift {:.2}",
            round + 1,
            self.u.iter().map(last).collect::<Vec<_>>(),
            self.c.iter().map(last).collect::<Vec<_>>(),
            last(&self.ei),
            last(&self.bare),
            last(&self.bare_journal),
            last(&self.bare_shift),
            last(&self.ordered_journal),
            last(&self.ordered_shift),
        );
    }

    /// One row per mode, and the datashift encryption's.
    fn rows(&self, busy: usize, with_cryptsetup: bool) -> Vec<Row> {
        let ceiling = Summary::of(&self.ei);
        let (bare, bare_journal) = (Summary::of(&self.bare), Summary::of(&self.bare_journal));
        let bare_shift = Summary::of(&self.bare_shift);
        let mut rows = Vec::new();
        for (m, mode) in MODES.iter().chain(&[SHIFT_ROW]).enumerate() {
            let us = Summary::of(&self.u[m]);
            let bare = match *mode {
                "journal" => bare_journal,
                SHIFT_ROW => bare_shift,
                _ => bare,
            };
            let cs = with_cryptsetup.then(|| Summary::of(&self.c[m]));
            let ordered = match *mode {
                "journal" => Some(Summary::of(&self.ordered_journal)),
                SHIFT_ROW => Some(Summary::of(&self.ordered_shift)),
                _ => None,
            };
            rows.push(Row {
                resilience: (*mode).into(),
                busy_threads: busy,
                ucrypt_s: us,
                cryptsetup_s: cs,
                export_import_s: ceiling,
                vs_cryptsetup: cs.map(|c| c.median / us.median),
                of_ceiling: ceiling.median / us.median,
                bare_s: bare,
                cryptsetup_over_bare: cs.map(|c| c.median / bare.median),
                of_bare: bare.median / us.median,
                ordered_s: ordered,
                cryptsetup_over_ordered: cs.zip(ordered).map(|(c, o)| c.median / o.median),
                of_ordered: ordered.map(|o| o.median / us.median),
            });
        }
        rows
    }
}

/// One round with `busy` threads spinning: a new volume, each mode's rotation by both tools,
/// the bare and ordered loops, the datashift encryption of its exported plaintext and the
/// export + import ceiling, each added to `s`.
fn run_round(setup: &Setup<'_>, busy: usize, s: &mut Samples) -> Result<(), String> {
    let Setup {
        ucrypt,
        dir,
        key,
        data,
        with_cryptsetup,
    } = *setup;
    let base = make_volume(
        ucrypt,
        dir,
        key,
        data,
        if with_cryptsetup {
            "cryptsetup"
        } else {
            "ucrypt"
        },
    )?;
    let work = dir.join("work.img");
    let _load = Busy::start(busy);
    for (m, mode) in MODES.iter().enumerate() {
        copy(&base, &work)?;
        s.u[m].push(timed(
            Command::new(ucrypt)
                .args(["reencrypt", "-q", "--resilience", mode])
                .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations"])
                .arg(PBKDF2_ITERATIONS)
                .arg("--key-file")
                .arg(key)
                .arg(&work),
        )?);
        if with_cryptsetup {
            copy(&base, &work)?;
            s.c[m].push(timed(
                Command::new("cryptsetup")
                    .args(["reencrypt", "-q", "--force-offline-reencrypt"])
                    .args(["--resilience", mode])
                    .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations"])
                    .arg(PBKDF2_ITERATIONS)
                    .arg("--key-file")
                    .arg(key)
                    .arg(&work),
            )?);
        }
    }
    copy(&base, &work)?;
    s.bare
        .push(bare_rotation(&work, HEADER_BYTES, data, Bare::Rekey)?);
    copy(&base, &work)?;
    s.bare_journal.push(bare_rotation(
        &work,
        HEADER_BYTES,
        data,
        Bare::RekeyJournal,
    )?);
    copy(&base, &work)?;
    s.bare_shift
        .push(bare_rotation(&work, HEADER_BYTES, data, Bare::Shift)?);
    copy(&base, &work)?;
    s.ordered_journal
        .push(bare_ordered(&work, HEADER_BYTES, data, Order::Journal)?);
    copy(&base, &work)?;
    s.ordered_shift
        .push(bare_ordered(&work, HEADER_BYTES, data, Order::Shift)?);
    let plain = dir.join("export.bin");
    let te = timed(
        Command::new(ucrypt)
            .arg("export")
            .arg("--key-file")
            .arg(key)
            .arg(&base)
            .arg(&plain),
    )?;
    // The datashift encryption of the same plaintext, with the free space after it.
    let shift = MODES.len();
    s.u[shift].push(encrypt_shift_timed(
        setup,
        &plain,
        &work,
        &ucrypt.display().to_string(),
    )?);
    if with_cryptsetup {
        s.c[shift].push(encrypt_shift_timed(setup, &plain, &work, "cryptsetup")?);
    }
    let ti = timed(
        Command::new(ucrypt)
            .arg("import")
            .arg(&plain)
            .arg(&base)
            .arg("--key-file")
            .arg(key),
    )?;
    s.ei.push(te + ti);
    let _ = std::fs::remove_file(&plain);
    Ok(())
}

/// The wall seconds of `tool`'s `reencrypt --encrypt --reduce-device-size` of the plaintext
/// `plain` copied to `work`, with [`REDUCE_BYTES`] free after it.
fn encrypt_shift_timed(
    setup: &Setup<'_>,
    plain: &Path,
    work: &Path,
    tool: &str,
) -> Result<f64, String> {
    copy(plain, work)?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(work)
        .and_then(|f| f.set_len(setup.data + REDUCE_BYTES))
        .map_err(|e| format!("{}: {e}", work.display()))?;
    let mut cmd = Command::new(tool);
    cmd.args([
        "reencrypt",
        "-q",
        "--encrypt",
        "--reduce-device-size",
        REDUCE,
    ])
    .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations"])
    .arg(PBKDF2_ITERATIONS)
    .arg("--key-file")
    .arg(setup.key)
    .arg(work)
    // cryptsetup builds the header in a temporary file here.
    .current_dir(setup.dir);
    if tool == "cryptsetup" {
        cmd.arg("--force-offline-reencrypt");
    }
    timed(&mut cmd)
}

/// What the report's columns measure.
fn notes() -> Vec<String> {
    vec![
        "wall seconds include each tool's unlocks (pbkdf2, 1000 iterations)".into(),
        "ucrypt rotates with its default 64 MiB hotzones, cryptsetup with its default (one \
         hotzone as large as the resilience area protects)"
            .into(),
        "bare: the bare rotation of the same bytes (one thread per core, 256 KiB chunks, \
         decrypt + encrypt in place, then sync; no header, resilience or unlock), timed in \
         the same rounds; the journal row's bare rotation also writes each chunk, as read, \
         to a journal area first (the journal's one copy more of every byte); the \
         datashift row's encrypts 512-byte sectors and writes each chunk 16 MiB lower, in \
         no hotzone order; in every bare loop the threads write the file in turns, as \
         ucrypt's lanes write a buffered file"
            .into(),
        format!(
            "ordered bare (journal and {SHIFT_ROW} rows): the bare loop with the order the \
             protocol puts between hotzones: per hotzone ({JOURNAL_AREA_BYTES}-byte journal \
             area; {SHIFT_BYTES}-byte shift), every thread waits for the others and one \
             flushes, after the journal's copy and after the rewrite; the threads claim \
             {} KiB at a time; the shift's encrypts 512-byte sectors, as both tools' \
             --encrypt writes (the bare column's rotation rekeys 4096-byte ones)",
            ORDERED_CHUNK >> 10
        ),
        format!(
            "{SHIFT_ROW}: reencrypt --encrypt --reduce-device-size {REDUCE} of the exported \
             plaintext with {REDUCE} free after it, both tools (hotzones of the 16 MiB \
             shift); its ceiling column is the same export+import"
        ),
    ]
}

pub fn markdown(r: &Report) -> String {
    let mut o = format!(
        "## ucrypt bench reencrypt\n\nMachine: {}. Volume: {} MiB of data in {}; {} \
         round-robin runs, median (min–max) wall seconds. {}.\n\n",
        r.machine.describe(),
        r.data_bytes >> 20,
        r.dir,
        r.runs,
        r.cryptsetup
    );
    o += "| resilience | busy threads | ucrypt s | cryptsetup s | cryptsetup ÷ ucrypt (goal ≥ 2) | export+import s | ceiling ÷ ucrypt (goal ≥ 0.8) | bare s | cryptsetup ÷ bare (most reachable) | bare ÷ ucrypt (≥ 0.9 where the 2× goal is out of reach) | ordered bare s | cryptsetup ÷ ordered bare | ordered bare ÷ ucrypt |\n";
    o += "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for row in &r.rows {
        o += &format!(
            "| {} | {} | {} | {} | {} | {} | {:.2} | {} | {} | {:.2} | {} | {} | {} |\n",
            row.resilience,
            row.busy_threads,
            row.ucrypt_s.show(2),
            row.cryptsetup_s
                .map_or_else(|| "SKIPPED".into(), |s| s.show(2)),
            row.vs_cryptsetup
                .map_or_else(|| "SKIPPED".into(), |v| format!("{v:.2}")),
            row.export_import_s.show(2),
            row.of_ceiling,
            row.bare_s.show(2),
            row.cryptsetup_over_bare
                .map_or_else(|| "SKIPPED".into(), |v| format!("{v:.2}")),
            row.of_bare,
            row.ordered_s.map_or_else(|| "–".into(), |s| s.show(2)),
            row.cryptsetup_over_ordered
                .map_or_else(|| "–".into(), |v| format!("{v:.2}")),
            row.of_ordered
                .map_or_else(|| "–".into(), |v| format!("{v:.2}")),
        );
    }
    for n in &r.notes {
        o += &format!("\nNote: {n}.\n");
    }
    o
}
