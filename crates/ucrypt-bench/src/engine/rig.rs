//! The benchmark's rig: the setups (backends and volumes), the round-robin that runs each
//! variant in turn, timed thread groups, allocation counting and the background load.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{
    AtomicBool, AtomicU64, Ordering::AcqRel, Ordering::Acquire, Ordering::Relaxed,
};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use ucrypt::backend::{Backend, DirectMode, FileBackend, MemBackend};
use ucrypt::engine::Policy;
use ucrypt::engine::StatsSnapshot;
use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

use crate::stats::Summary;

// ---------------------------------------------------------------- allocation counting

/// Counts heap allocations of the whole process (one relaxed add per allocation); scenario 2
/// divides the count by the I/Os done meanwhile.
pub(super) struct Counting;
pub(super) static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call unchanged to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

// ---------------------------------------------------------------- set-up

/// Data offset inside the backend, like a LUKS2 data segment (cryptsetup default 16 MiB; 1 MiB
/// keeps the file small).
pub(super) const DATA_OFFSET: u64 = 1 << 20;

/// A buffer aligned to 4096 bytes (O_DIRECT), carved out of a bigger Vec without unsafe.
pub(super) struct Aligned {
    pub(super) store: Vec<u8>,
    pub(super) start: usize,
    pub(super) len: usize,
}

impl Aligned {
    pub(super) fn new(len: usize) -> Self {
        let store = vec![0x5au8; len + 4096];
        let start = (4096 - store.as_ptr() as usize % 4096) % 4096;
        Aligned { store, start, len }
    }
    pub(super) fn get(&mut self) -> &mut [u8] {
        &mut self.store[self.start..self.start + self.len]
    }
}

/// What a workload runs against: the raw backend (at the data offset) or a volume.
#[derive(Clone)]
pub(super) enum Target {
    Raw(Arc<dyn Backend>),
    Vol(Arc<Volume>),
}

impl Target {
    pub(super) fn read(&self, buf: &mut [u8], off: u64) {
        match self {
            Target::Raw(b) => b.read_exact_at(buf, DATA_OFFSET + off).expect("raw read"),
            Target::Vol(v) => v.read_at(buf, off).expect("volume read"),
        }
    }
    pub(super) fn write(&self, buf: &[u8], off: u64) {
        match self {
            Target::Raw(b) => b.write_at(buf, DATA_OFFSET + off).expect("raw write"),
            Target::Vol(v) => v.write_at(buf, off).expect("volume write"),
        }
    }
}

pub(super) struct Setup {
    pub(super) name: &'static str,
    pub(super) backend: Arc<dyn Backend>,
    pub(super) null: Arc<Volume>,
    pub(super) xts: Arc<Volume>,
    pub(super) data_bytes: u64,
    pub(super) _file: Option<TempFile>,
}

impl Setup {
    /// A backend with a null-cipher and an aes-xts volume over the same data area.
    pub(super) fn new(
        name: &'static str,
        backend: Arc<dyn Backend>,
        data_bytes: u64,
        file: Option<TempFile>,
    ) -> Setup {
        Setup {
            name,
            null: volume(&backend, CipherSpec::NULL, data_bytes),
            xts: volume(&backend, CipherSpec::AES_XTS_PLAIN64, data_bytes),
            backend,
            data_bytes,
            _file: file,
        }
    }
}

pub(super) struct TempFile(std::path::PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub(super) fn volume(backend: &Arc<dyn Backend>, spec: CipherSpec, data_bytes: u64) -> Arc<Volume> {
    let key = bench_key(spec.default_key_bytes());
    let mut cfg = VolumeConfig::new(
        spec,
        SecretBytes::from_slice(&key),
        Geometry::new(SectorSize::S4096),
    );
    cfg.data_offset_bytes = DATA_OFFSET;
    cfg.size_bytes = Some(data_bytes);
    Arc::new(Volume::new(backend.clone(), cfg).expect("volume"))
}

pub(super) fn setups(data_bytes: u64, log: &mut Vec<String>) -> Vec<Setup> {
    let total = DATA_OFFSET + data_bytes;
    let mut v = Vec::new();
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        "/dev/shm".into()
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!("ucrypt-bench-engine-{}", std::process::id()));
    let file = std::fs::File::create(&path)
        .and_then(|f| f.set_len(total))
        .map(|_| TempFile(path.clone()));
    match file.map_err(|e| e.to_string()).and_then(|tf| {
        FileBackend::open(&tf.0, true, DirectMode::Auto)
            .map(|b| (tf, b))
            .map_err(|e| e.to_string())
    }) {
        Ok((tf, b)) => {
            if let Some(n) = b.note() {
                log.push(n.to_string());
            }
            v.push(Setup::new("shm-file", Arc::new(b), data_bytes, Some(tf)));
        }
        Err(e) => log.push(format!("no /dev/shm file backend: {e}")),
    }
    let mem = Arc::new(MemBackend::new(total));
    v.push(Setup::new("memory", mem, data_bytes, None));
    // Fill the data area so that reads hit real pages, not holes.
    for s in &v {
        let mut buf = Aligned::new(1 << 20);
        let mut off = 0;
        while off < data_bytes {
            let n = (data_bytes - off).min(1 << 20) as usize;
            s.xts.write_at(&buf.get()[..n], off).expect("fill");
            off += n as u64;
        }
    }
    v
}

pub(super) struct Knobs {
    pub(super) runs: usize,
    /// Time each variant runs per repetition.
    pub(super) slice: Duration,
}

/// Runs `variants` round-robin `runs` times; `f(i)` returns (value, extras) for variant i.
/// In the last round, the volume's stats are reset before each variant and kept after it, so
/// that `stats_out` gets one `Volume::stats()` per variant: where its time went.
pub(super) fn round_robin(
    knobs: &Knobs,
    names: &[&str],
    vol: Option<&Volume>,
    stats_out: &mut Vec<(String, StatsSnapshot)>,
    mut f: impl FnMut(usize) -> (f64, Vec<(String, f64)>),
) -> Vec<(Summary, Vec<(String, Summary)>)> {
    let variants = names.len();
    let mut vals: Vec<Vec<f64>> = vec![Vec::new(); variants];
    let mut extras: Vec<Vec<(String, Vec<f64>)>> = vec![Vec::new(); variants];
    for round in 0..knobs.runs {
        let last = round + 1 == knobs.runs;
        for i in 0..variants {
            let keep = last && !names[i].starts_with("raw");
            if let (true, Some(v)) = (keep, vol) {
                v.reset_stats();
            }
            let (v, ex) = f(i);
            if let (true, Some(vol)) = (keep, vol) {
                stats_out.push((names[i].to_string(), vol.stats()));
            }
            vals[i].push(v);
            for (k, x) in ex {
                match extras[i].iter_mut().find(|(n, _)| *n == k) {
                    Some((_, xs)) => xs.push(x),
                    None => extras[i].push((k, vec![x])),
                }
            }
        }
    }
    vals.iter()
        .zip(extras)
        .map(|(v, ex)| {
            (
                Summary::of(v),
                ex.into_iter()
                    .map(|(k, xs)| (k, Summary::of(&xs)))
                    .collect(),
            )
        })
        .collect()
}

/// Context switches (voluntary and involuntary) and CPU seconds (user and system) of the
/// whole process so far: every thread, the volume's workers included.
pub(super) fn usage() -> (u64, f64) {
    // SAFETY: getrusage fills the zeroed struct we own; RUSAGE_SELF is always valid.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    (
        (ru.ru_nvcsw + ru.ru_nivcsw) as u64,
        secs(ru.ru_utime) + secs(ru.ru_stime),
    )
}

/// What [`timed_threads`] measured over its timed part.
pub(super) struct Timed {
    pub(super) mbps: f64,
    pub(super) ios: u64,
    /// Heap allocations of the process.
    pub(super) allocs: u64,
    /// Context switches of the process.
    pub(super) csw: u64,
    /// CPU seconds of the process (user + system): on a shared host the throughput depends
    /// on the CPU share the process gets; the CPU time per request much less.
    pub(super) cpu_s: f64,
}

/// `threads` threads run `body(thread, buffer, stop)` until `dur` passes; returns what
/// [`Timed`] says. `body` returns (bytes, ios) done.
pub(super) fn timed_threads(
    threads: usize,
    buf_bytes: usize,
    dur: Duration,
    body: impl Fn(usize, &mut [u8], &AtomicBool) -> (u64, u64) + Sync,
) -> Timed {
    let stop = AtomicBool::new(false);
    // Two start lines: everyone ready (buffers allocated), then the clock and the allocation
    // counter start, then everyone goes. Starting the clock after "go" would miss the work of
    // threads that run before the main thread is scheduled again (many threads, 2 cores).
    let ready = Barrier::new(threads + 1);
    let go = Barrier::new(threads + 1);
    let (bytes, ios, allocs, csw, cpu_s, secs) = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let (stop, ready, go, body) = (&stop, &ready, &go, &body);
                s.spawn(move || {
                    let mut buf = Aligned::new(buf_bytes);
                    ready.wait();
                    go.wait();
                    body(t, buf.get(), stop)
                })
            })
            .collect();
        ready.wait();
        let a0 = ALLOCS.load(Relaxed);
        let (c0, cpu0) = usage();
        let t0 = Instant::now();
        go.wait();
        std::thread::sleep(dur);
        stop.store(true, Relaxed);
        let mut bytes = 0;
        let mut ios = 0;
        for h in hs {
            let (b, n) = h.join().expect("bench thread");
            bytes += b;
            ios += n;
        }
        let secs = t0.elapsed().as_secs_f64();
        let (c1, cpu1) = usage();
        let allocs = ALLOCS.load(Relaxed) - a0;
        (bytes, ios, allocs, c1.saturating_sub(c0), cpu1 - cpu0, secs)
    });
    Timed {
        mbps: bytes as f64 / secs / 1e6,
        ios,
        allocs,
        csw,
        cpu_s,
    }
}

pub(super) fn variant_target(s: &Setup, xts: bool, v: &str) -> Target {
    if v == "raw" {
        return Target::Raw(s.backend.clone());
    }
    let vol = if xts { &s.xts } else { &s.null };
    vol.set_policy(v.parse::<Policy>().expect("policy name"));
    Target::Vol(vol.clone())
}

/// A barrier for a few threads that spins instead of sleeping: the cheapest hand-over a split
/// request can have. `wait` gives up (false) once `stop` is set, so a thread never waits for
/// one that has quit.
pub(super) struct SpinBarrier {
    pub(super) threads: u64,
    pub(super) arrived: AtomicU64,
}

impl SpinBarrier {
    pub(super) fn new(threads: usize) -> Self {
        SpinBarrier {
            threads: threads as u64,
            arrived: AtomicU64::new(0),
        }
    }

    pub(super) fn wait(&self, stop: &AtomicBool) -> bool {
        let ticket = self.arrived.fetch_add(1, AcqRel);
        let all_in = (ticket / self.threads + 1) * self.threads;
        while self.arrived.load(Acquire) < all_in {
            if stop.load(Relaxed) {
                return false;
            }
            std::hint::spin_loop();
        }
        true
    }
}

/// Simple xorshift for offsets (no allocation, reproducible per thread).
pub(super) fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// The benchmark volumes' key (any fixed bytes will do).
pub(super) fn bench_key(n: usize) -> Vec<u8> {
    (0..n).map(|i| i as u8 ^ 0xa5).collect()
}

/// An aes-xts-plain64 context with the benchmark key, 4096-byte sectors: for the rows measured
/// without ucrypt.
pub(super) fn bench_cipher() -> SectorCipher {
    SectorCipher::new(
        CipherSpec::AES_XTS_PLAIN64,
        &bench_key(64),
        Geometry::new(SectorSize::S4096),
    )
    .expect("cipher")
}

/// Busy-loop threads of the changing-load job, and how long each busy or quiet phase lasts.
pub(super) const CHURN_THREADS: usize = 2;
pub(super) const CHURN_PHASE: Duration = Duration::from_millis(150);

/// Background load that comes and goes: `threads` spinners, busy for a phase, asleep for the
/// next, until dropped.
pub(super) struct Churn {
    pub(super) stop: Arc<AtomicBool>,
    pub(super) threads: Vec<std::thread::JoinHandle<()>>,
}

impl Churn {
    pub(super) fn start(threads: usize, phase: Duration) -> Churn {
        let stop = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        let threads = (0..threads)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !stop.load(Relaxed) {
                        let busy = (t0.elapsed().as_millis() / phase.as_millis().max(1)) % 2 == 0;
                        if busy {
                            for _ in 0..10_000 {
                                x = black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                            }
                        } else {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                })
            })
            .collect();
        Churn { stop, threads }
    }
}

impl Drop for Churn {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
