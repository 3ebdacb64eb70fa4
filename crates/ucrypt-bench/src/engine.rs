//! `ucrypt bench engine`: the volume engine's dispatch policies side by side with the raw
//! backend, on a /dev/shm file (O_DIRECT) and on the memory backend. Every scenario runs its
//! variants round-robin in one process; each number is the median of the runs (min–max shown).
//!
//! Scenarios (numbered as in the engine's brief):
//! 1. 4 KiB sequential reads, QD1, null cipher and aes-xts-plain64: raw vs inline vs queued.
//! 2. 1 MiB writes, 64 in flight (64 threads): throughput vs raw, heap allocations per I/O.
//! 3. 12 concurrent jobs of 256 KiB random reads/writes: inline vs parallel vs auto.
//! 4. One stream of 1 MiB reads, and of 1 MiB writes: parallel vs inline.
//! 5. 4 KiB random reads QD1 while two busy-loop threads compete: latency percentiles.
//! 6. Many independent streams of mixed sizes: auto vs the best static policy; again (6c)
//!    while a background load comes and goes every 150 ms.
//! 7. Throughput by block size (4 KiB .. 1 MiB), one stream, per policy (file backend only).
//! 8. Scaling with threads (1 .. 16 threads of 64 KiB random I/O), per policy (file backend).
//!
//! Scenario 5 also runs without the busy threads (5a), and keeps its latency CDF for plots.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{
    AtomicBool, AtomicU64, Ordering::AcqRel, Ordering::Acquire, Ordering::Relaxed,
};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde::Serialize;
use ucrypt::backend::{Backend, DirectMode, FileBackend, MemBackend};
use ucrypt::engine::Policy;
use ucrypt::engine::{OpStats, Phase, StatsSnapshot};
use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

use super::stats::{Machine, Summary};

// ---------------------------------------------------------------- allocation counting

/// Counts heap allocations of the whole process (one relaxed add per allocation); scenario 2
/// divides the count by the I/Os done meanwhile.
struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

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
const DATA_OFFSET: u64 = 1 << 20;

/// A buffer aligned to 4096 bytes (O_DIRECT), carved out of a bigger Vec without unsafe.
struct Aligned {
    store: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Self {
        let store = vec![0x5au8; len + 4096];
        let start = (4096 - store.as_ptr() as usize % 4096) % 4096;
        Aligned { store, start, len }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.store[self.start..self.start + self.len]
    }
}

/// What a workload runs against: the raw backend (at the data offset) or a volume.
#[derive(Clone)]
enum Target {
    Raw(Arc<dyn Backend>),
    Vol(Arc<Volume>),
}

impl Target {
    fn read(&self, buf: &mut [u8], off: u64) {
        match self {
            Target::Raw(b) => b.read_exact_at(buf, DATA_OFFSET + off).expect("raw read"),
            Target::Vol(v) => v.read_at(buf, off).expect("volume read"),
        }
    }
    fn write(&self, buf: &[u8], off: u64) {
        match self {
            Target::Raw(b) => b.write_at(buf, DATA_OFFSET + off).expect("raw write"),
            Target::Vol(v) => v.write_at(buf, off).expect("volume write"),
        }
    }
}

struct Setup {
    name: &'static str,
    backend: Arc<dyn Backend>,
    null: Arc<Volume>,
    xts: Arc<Volume>,
    data_bytes: u64,
    _file: Option<TempFile>,
}

impl Setup {
    /// A backend with a null-cipher and an aes-xts volume over the same data area.
    fn new(
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

struct TempFile(std::path::PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn volume(backend: &Arc<dyn Backend>, spec: CipherSpec, data_bytes: u64) -> Arc<Volume> {
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

fn setups(data_bytes: u64, log: &mut Vec<String>) -> Vec<Setup> {
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

// ---------------------------------------------------------------- measuring

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub scenario: &'static str,
    pub backend: &'static str,
    pub cipher: &'static str,
    pub variant: String,
    pub unit: &'static str,
    pub value: Summary,
    /// Extra per-variant numbers (e.g. allocations per I/O, latency percentiles).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extra: Vec<(String, Summary)>,
    /// Request size of a block-size sweep row (scenario 7).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_bytes: Option<u64>,
    /// Thread count of a scaling row (scenario 8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
    /// Latency CDF of the last run, (percentile 0..100, µs), for plots (scenario 5).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cdf: Vec<(f64, f64)>,
}

/// Where a variant's time went in its last run (from `Volume::stats()`): mean ns per timed
/// request of each stage. Stages of split requests are summed over their chunks, so they can
/// add up to more than the total.
#[derive(Debug, Clone, Serialize)]
pub struct Breakdown {
    pub backend: &'static str,
    pub scenario: String,
    pub variant: String,
    /// "read" or "write".
    pub op: &'static str,
    pub requests: u64,
    /// Requests cut into chunks for the workers.
    pub split: u64,
    pub wait_ns: f64,
    pub queue_ns: f64,
    pub crypto_ns: f64,
    pub device_ns: f64,
    pub total_ns: f64,
}

impl Breakdown {
    fn from_snapshot(
        backend: &'static str,
        scenario: &str,
        variant: &str,
        snap: &StatsSnapshot,
    ) -> Vec<Breakdown> {
        let per_request = |o: &OpStats, p: Phase| {
            let timed = o.phase(Phase::Total).count.max(1) as f64;
            let ph = o.phase(p);
            ph.mean_ns * ph.count as f64 / timed
        };
        [("read", &snap.read), ("write", &snap.write)]
            .into_iter()
            .filter(|(_, o)| o.requests > 0)
            .map(|(op, o)| Breakdown {
                backend,
                scenario: scenario.to_string(),
                variant: variant.to_string(),
                op,
                requests: o.requests,
                split: snap.split,
                wait_ns: per_request(o, Phase::Wait),
                queue_ns: per_request(o, Phase::Queue),
                crypto_ns: per_request(o, Phase::Crypto),
                device_ns: per_request(o, Phase::Backend),
                total_ns: per_request(o, Phase::Total),
            })
            .collect()
    }
}

/// A target of the engine's brief, checked against this run.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    pub what: String,
    pub measured: f64,
    pub target: f64,
    pub met: bool,
}

#[derive(Serialize)]
pub struct EngineReport {
    /// Bumped on an incompatible change of this JSON (see docs/bench-json.md).
    pub schema: u32,
    pub machine: Machine,
    pub quick: bool,
    pub runs: usize,
    pub notes: Vec<String>,
    pub rows: Vec<Row>,
    pub targets: Vec<TargetCheck>,
    /// Where each variant's time went in its last run.
    pub breakdown: Vec<Breakdown>,
}

type StatsLog = Vec<Breakdown>;
type Targets = Vec<TargetCheck>;

/// What the scenarios produce, gathered into the report.
#[derive(Default)]
struct Sink {
    stats: StatsLog,
    rows: Vec<Row>,
    targets: Targets,
    notes: Vec<String>,
}

fn target(targets: &mut Targets, what: String, measured: f64, want: f64) {
    targets.push(TargetCheck {
        what,
        measured,
        target: want,
        met: measured >= want,
    });
}

/// Breakdown rows of one scenario's round-robin (`stats` as `round_robin` returns them).
fn log_stats(log: &mut StatsLog, s: &Setup, scenario: &str, stats: Vec<(String, StatsSnapshot)>) {
    for (variant, snap) in stats {
        log.extend(Breakdown::from_snapshot(s.name, scenario, &variant, &snap));
    }
}

/// One row per variant of a scenario's round-robin results (in variant order); returns the
/// new rows, for scenario-specific fields.
/// [`push_rows`] for the usual case: aes-xts-plain64 on `s`'s backend, in MB/s.
fn push_mbps<'a>(
    rows: &'a mut Vec<Row>,
    s: &Setup,
    scenario: &'static str,
    variants: &[&str],
    res: Vec<(Summary, Vec<(String, Summary)>)>,
) -> &'a mut [Row] {
    push_rows(
        rows,
        scenario,
        s.name,
        "aes-xts-plain64",
        "MB/s",
        variants,
        res,
    )
}

fn push_rows<'a>(
    rows: &'a mut Vec<Row>,
    scenario: &'static str,
    backend: &'static str,
    cipher: &'static str,
    unit: &'static str,
    variants: &[&str],
    res: Vec<(Summary, Vec<(String, Summary)>)>,
) -> &'a mut [Row] {
    let first = rows.len();
    for (v, (value, extra)) in variants.iter().zip(res) {
        rows.push(Row {
            scenario,
            backend,
            cipher,
            variant: v.to_string(),
            unit,
            value,
            extra,
            block_bytes: None,
            threads: None,
            cdf: Vec::new(),
        });
    }
    &mut rows[first..]
}

struct Knobs {
    runs: usize,
    /// Time each variant runs per repetition.
    slice: Duration,
}

/// Runs `variants` round-robin `runs` times; `f(i)` returns (value, extras) for variant i.
/// In the last round, the volume's stats are reset before each variant and kept after it, so
/// that `stats_out` gets one `Volume::stats()` per variant: where its time went.
fn round_robin(
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
fn usage() -> (u64, f64) {
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
struct Timed {
    mbps: f64,
    ios: u64,
    /// Heap allocations of the process.
    allocs: u64,
    /// Context switches of the process.
    csw: u64,
    /// CPU seconds of the process (user + system): on a shared host the throughput depends
    /// on the CPU share the process gets; the CPU time per request much less.
    cpu_s: f64,
}

/// `threads` threads run `body(thread, buffer, stop)` until `dur` passes; returns what
/// [`Timed`] says. `body` returns (bytes, ios) done.
fn timed_threads(
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

fn variant_target(s: &Setup, xts: bool, v: &str) -> Target {
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
struct SpinBarrier {
    threads: u64,
    arrived: AtomicU64,
}

impl SpinBarrier {
    fn new(threads: usize) -> Self {
        SpinBarrier {
            threads: threads as u64,
            arrived: AtomicU64::new(0),
        }
    }

    fn wait(&self, stop: &AtomicBool) -> bool {
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
fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

// ---------------------------------------------------------------- scenarios

fn s1_seq_reads(s: &Setup, k: &Knobs, out: &mut Sink) {
    let Sink {
        stats: log,
        rows,
        targets,
        notes,
    } = out;
    for (xts, cipher) in [(false, "cipher_null-ecb"), (true, "aes-xts-plain64")] {
        // With aes-xts, "raw+decrypt" is the same loop without ucrypt: the backend read, then a
        // decrypt in place with a context of its own. It measures what this machine allows for
        // the two interleaved, which is not t_raw + t_cipher (see the note it adds).
        let variants: &[&str] = if xts {
            &["raw", "raw+decrypt", "inline", "queued"]
        } else {
            &["raw", "inline", "queued"]
        };
        let vol = if xts { &s.xts } else { &s.null };
        let res = interleaved_seq_reads(s, k, vol, variants);
        // Where the time went: each ucrypt variant alone for a while (interleaving would mix
        // the policies' stats in the one volume).
        let mut st = Vec::new();
        for v in variants.iter().filter(|v| !v.starts_with("raw")) {
            vol.set_policy(v.parse::<Policy>().expect("policy name"));
            vol.reset_stats();
            let t = Target::Vol(vol.clone());
            timed_threads(1, 4096, k.slice / 2, |_, buf, stop| {
                let (mut off, mut n) = (0u64, 0u64);
                while !stop.load(Relaxed) {
                    t.read(buf, off);
                    off = (off + 4096) % s.data_bytes;
                    n += 1;
                }
                (n * 4096, n)
            });
            st.push((v.to_string(), vol.stats()));
        }
        log_stats(log, s, &format!("1. 4K seq reads, {cipher}"), st);
        // The cipher's own cost for 4 KiB, to state the aes-xts target.
        let cipher_ns = if xts {
            let mut c = bench_cipher();
            let mut buf = vec![0u8; 4096];
            let n = 20_000;
            let t0 = Instant::now();
            for i in 0..n {
                c.decrypt(i, black_box(&mut buf)).expect("decrypt");
            }
            t0.elapsed().as_nanos() as f64 / n as f64
        } else {
            0.0
        };
        let raw = res[0].0.median;
        let inline = res[variants
            .iter()
            .position(|v| *v == "inline")
            .expect("inline")]
        .0
        .median;
        let t_raw_ns = 4096.0 / raw * 1e3; // MB/s -> ns per 4 KiB
        let limit = 4096.0 / (t_raw_ns + cipher_ns) * 1e3;
        let (what, want) = if xts {
            (
                format!(
                    "{}: 4K seq read, aes-xts: inline / (t_raw + t_cipher)",
                    s.name
                ),
                0.95,
            )
        } else {
            (
                format!("{}: 4K seq read, null cipher: inline / raw", s.name),
                0.97,
            )
        };
        let ratio = inline / limit;
        if xts {
            let both = res[1].0.median;
            let t_both_ns = 4096.0 / both * 1e3;
            notes.push(format!(
                "{}: t_cipher (4 KiB aes-xts decrypt, hot) = {cipher_ns:.0} ns; t_raw = {t_raw_ns:.0} ns; \
                 t_raw + t_cipher = {:.0} ns, but the two interleaved without ucrypt (raw+decrypt) \
                 take {t_both_ns:.0} ns; inline ÷ raw+decrypt = {:.2}",
                s.name,
                t_raw_ns + cipher_ns,
                inline / both
            ));
        }
        target(targets, what, ratio, want);
        push_rows(
            rows,
            "1. 4 KiB sequential reads QD1",
            s.name,
            cipher,
            "MB/s",
            variants,
            res,
        );
    }
}

/// 4 KiB sequential reads per burst of [`interleaved_seq_reads`]: milliseconds, short beside the
/// seconds over which this class of machine changes its clock, long beside a policy switch.
const BURST_READS: u64 = 512;

/// Scenario 1's measurement: the `variants` (raw, raw+decrypt, or a volume policy) take turns
/// on one thread in bursts of [`BURST_READS`] 4 KiB sequential reads, for a slice per variant
/// and run; each run gives every variant's MB/s over all its bursts. Taking turns this often
/// puts clock changes and other tenants' bursts on every variant alike, which whole slices
/// one after the other do not (they moved the inline ÷ raw ratio by ±0.1 between runs).
fn interleaved_seq_reads(
    s: &Setup,
    k: &Knobs,
    vol: &Arc<Volume>,
    variants: &[&str],
) -> Vec<(Summary, Vec<(String, Summary)>)> {
    let raw = Target::Raw(s.backend.clone());
    let ucrypt = Target::Vol(vol.clone());
    let mut own = bench_cipher();
    let mut buf = Aligned::new(4096);
    let buf = buf.get();
    let mut vals: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    // Parsed once: None for the rows without ucrypt.
    let policies: Vec<Option<Policy>> = variants
        .iter()
        .map(|v| (!v.starts_with("raw")).then(|| v.parse().expect("policy name")))
        .collect();
    let mut off = 0u64;
    for _ in 0..k.runs {
        let mut ticks = vec![Duration::ZERO; variants.len()];
        let mut reads = vec![0u64; variants.len()];
        let started = Instant::now();
        while started.elapsed() < k.slice * variants.len() as u32 {
            for (i, (v, &policy)) in variants.iter().zip(&policies).enumerate() {
                if let Some(p) = policy {
                    vol.set_policy(p);
                }
                let t0 = Instant::now();
                for _ in 0..BURST_READS {
                    match (*v, policy) {
                        (_, Some(_)) => ucrypt.read(buf, off),
                        ("raw+decrypt", _) => {
                            raw.read(buf, off);
                            own.decrypt(off / 4096, buf).expect("decrypt");
                        }
                        _ => raw.read(buf, off),
                    }
                    off = (off + 4096) % s.data_bytes;
                }
                ticks[i] += t0.elapsed();
                reads[i] += BURST_READS;
            }
        }
        for i in 0..variants.len() {
            vals[i].push((reads[i] * 4096) as f64 / ticks[i].as_secs_f64().max(1e-9) / 1e6);
        }
    }
    vals.iter().map(|v| (Summary::of(v), Vec::new())).collect()
}

/// The benchmark volumes' key (any fixed bytes will do).
fn bench_key(n: usize) -> Vec<u8> {
    (0..n).map(|i| i as u8 ^ 0xa5).collect()
}

/// An aes-xts-plain64 context with the benchmark key, 4096-byte sectors: for the rows measured
/// without ucrypt.
fn bench_cipher() -> SectorCipher {
    SectorCipher::new(
        CipherSpec::AES_XTS_PLAIN64,
        &bench_key(64),
        Geometry::new(SectorSize::S4096),
    )
    .expect("cipher")
}

/// Scenario 2's target: each policy's throughput ÷ the limit of the machine.
const S2_TARGET: f64 = 0.9;

/// Scenario 2: 64 threads each writing 1 MiB at a time. Beside the policies it measures, in
/// the same round-robin, what bounds them: `raw` (the backend alone), `cipher x cores` (one
/// thread per core, each encrypting 1 MiB from one buffer into another, as a write does: the
/// cores × cipher of the formula, as measured while the machine carries the load it carries)
/// and `raw+crypt x64` (the same 64 threads encrypting into a buffer of their own and writing
/// it, without ucrypt: the ceiling of this workload on this machine as loaded now). The limit
/// of a write that must be encrypted, then written, is 1 / (1/raw + 1/(cores × cipher)),
/// computed per run from that run's raw and cipher; each policy's ratio to it (and to the
/// ceiling) is taken per run too.
fn s2_big_writes(s: &Setup, k: &Knobs, out: &mut Sink) {
    let Sink {
        stats: log,
        rows,
        targets,
        notes,
    } = out;
    let variants = [
        "raw",
        "cipher x cores",
        "raw+crypt x64",
        "inline",
        "parallel",
        "queued",
        "auto",
    ];
    let at = |name: &str| variants.iter().position(|v| *v == name).expect("variant");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = 64;
    let region = s.data_bytes / threads as u64 / (1 << 20) * (1 << 20);
    let mut st = Vec::new();
    // Every run's value per variant, for the per-run ratios; and its CPU µs per MiB written.
    let mut per_run: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut cpu_per_run: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let res = round_robin(k, &variants, Some(&s.xts), &mut st, |i| {
        let v = variants[i];
        let m = if v == "cipher x cores" {
            timed_threads(cores, 1 << 20, k.slice, |_, buf, stop| {
                let mut c = bench_cipher();
                let mut dst = Aligned::new(1 << 20);
                let mut n = 0u64;
                while !stop.load(Relaxed) {
                    c.encrypt_to(n * 256, buf, dst.get()).expect("encrypt");
                    black_box(dst.get()[0]);
                    n += 1;
                }
                (n << 20, n)
            })
        } else {
            let bare = v == "raw+crypt x64";
            let t = variant_target(s, true, if bare { "raw" } else { v });
            timed_threads(threads, 1 << 20, k.slice, |th, buf, stop| {
                let mut own = bare.then(|| (bench_cipher(), Aligned::new(1 << 20)));
                let base = th as u64 * region;
                let (mut off, mut n) = (0u64, 0u64);
                while !stop.load(Relaxed) {
                    match own.as_mut() {
                        Some((c, dst)) => {
                            c.encrypt_to((base + off) / 4096, buf, dst.get())
                                .expect("encrypt");
                            t.write(dst.get(), base + off);
                        }
                        None => t.write(buf, base + off),
                    }
                    off = (off + (1 << 20)) % region.max(1 << 20);
                    n += 1;
                }
                (n << 20, n)
            })
        };
        per_run[i].push(m.mbps);
        let per_io = |x: u64| x as f64 / m.ios.max(1) as f64;
        let cpu_us = m.cpu_s * 1e6 / m.ios.max(1) as f64;
        cpu_per_run[i].push(cpu_us);
        (
            m.mbps,
            vec![
                ("allocs/IO".into(), per_io(m.allocs)),
                ("csw/IO".into(), per_io(m.csw)),
                ("CPU µs/IO".into(), cpu_us),
            ],
        )
    });
    log_stats(log, s, "2. 1 MiB writes x64", st);
    // Per run: the limit from that run's raw and cipher, and each variant's ratio to it.
    let limits: Vec<f64> = per_run[at("raw")]
        .iter()
        .zip(&per_run[at("cipher x cores")])
        .map(|(raw, c)| 1.0 / (1.0 / raw + 1.0 / c))
        .collect();
    let per_run_ratio = |i: usize, to: &[f64]| -> Summary {
        Summary::of(
            &per_run[i]
                .iter()
                .zip(to)
                .map(|(x, l)| x / l)
                .collect::<Vec<_>>(),
        )
    };
    let ratio = |i: usize| per_run_ratio(i, &limits);
    let ceiling = at("raw+crypt x64");
    let mut res = res;
    for (i, (_, extra)) in res.iter_mut().enumerate() {
        if i != at("raw") && i != at("cipher x cores") {
            extra.insert(0, ("÷ limit".into(), ratio(i)));
        }
        if i > ceiling {
            extra.insert(
                1,
                (
                    "÷ raw+crypt x64".into(),
                    per_run_ratio(i, &per_run[ceiling]),
                ),
            );
        }
    }
    for p in ["inline", "parallel", "queued", "auto"] {
        target(
            targets,
            format!("{}: 1 MiB writes x64: {p} / limit", s.name),
            ratio(at(p)).median,
            S2_TARGET,
        );
    }
    // CPU time per MiB beside the same writes without ucrypt, per run: what ucrypt adds to
    // each write, and much less at the mercy of other load on the host than the throughput.
    let cpu_ratio = |i: usize| -> Summary {
        Summary::of(
            &cpu_per_run[i]
                .iter()
                .zip(&cpu_per_run[ceiling])
                .map(|(x, b)| x / b.max(f64::MIN_POSITIVE))
                .collect::<Vec<_>>(),
        )
    };
    notes.push(format!(
        "{}: scenario 2's CPU time per MiB ÷ raw+crypt x64's (per run): {}",
        s.name,
        ["inline", "parallel", "queued", "auto"]
            .iter()
            .map(|p| format!("{p} {}", cpu_ratio(at(p)).show(2)))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let lim = Summary::of(&limits);
    notes.push(format!(
        "{}: scenario 2's limit = 1 / (1/raw + 1/({cores} cores × cipher)) per run = {} MB/s \
         (cipher x cores: {cores} threads encrypting at once, measured in the same run); \
         the same writes without ucrypt (raw+crypt x64) reach {} of it: the ceiling this \
         machine allowed while the run lasted",
        s.name,
        lim.show(0),
        ratio(ceiling).show(2),
    ));
    let mut names: Vec<&str> = variants.to_vec();
    names.push("limit");
    res.push((lim, Vec::new()));
    push_mbps(rows, s, "2. 1 MiB writes, 64 in flight", &names, res);
}

fn s3_twelve_jobs(s: &Setup, k: &Knobs, out: &mut Sink) {
    let Sink {
        stats: log, rows, ..
    } = out;
    let variants = ["raw", "inline", "parallel", "auto"];
    let blocks = s.data_bytes / (256 << 10);
    let mut st = Vec::new();
    let res = round_robin(k, &variants, Some(&s.xts), &mut st, |i| {
        let t = variant_target(s, true, variants[i]);
        let mbps = timed_threads(12, 256 << 10, k.slice, |th, buf, stop| {
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ th as u64;
            let mut n = 0u64;
            while !stop.load(Relaxed) {
                let r = xorshift(&mut x);
                let off = (r % blocks) * (256 << 10);
                if r & (1 << 40) == 0 {
                    t.read(buf, off);
                } else {
                    t.write(buf, off);
                }
                n += 1;
            }
            (n * (256 << 10), n)
        })
        .mbps;
        (mbps, vec![])
    });
    log_stats(log, s, "3. 12 jobs 256K", st);
    push_mbps(
        rows,
        s,
        "3. 12 jobs, 256 KiB random read/write",
        &variants,
        res,
    );
}

fn s4_one_stream(s: &Setup, k: &Knobs, out: &mut Sink) {
    // "raw+crypt" is the same stream without ucrypt: the backend I/O and the crypto in place,
    // one thread. "raw+crypt x2" runs two such threads, each on half of every MiB, never
    // waiting for each other: what 2 cores allow at best. "raw+crypt x2 lockstep" is the same,
    // but each MiB is finished by both threads before either starts the next (a spinning
    // barrier, no sleep): what a split of one stream's requests allows at best, since a
    // request completes only when both halves have.
    let variants = [
        "raw",
        "raw+crypt",
        "raw+crypt x2",
        "raw+crypt x2 lockstep",
        "inline",
        "parallel",
    ];
    let at = |name: &str| variants.iter().position(|v| *v == name).expect("variant");
    for write in [false, true] {
        let mut st = Vec::new();
        let res = round_robin(k, &variants, Some(&s.xts), &mut st, |i| {
            let bare = variants[i].starts_with("raw+");
            let threads = if variants[i].contains("x2") { 2 } else { 1 };
            let lockstep = variants[i]
                .ends_with("lockstep")
                .then(|| SpinBarrier::new(threads));
            let part = (1u64 << 20) / threads as u64;
            let t = variant_target(s, true, if bare { "raw" } else { variants[i] });
            let mbps = timed_threads(threads, part as usize, k.slice, |th, buf, stop| {
                let mut own = bare.then(bench_cipher);
                let (mut off, mut n) = (0u64, 0u64);
                while !stop.load(Relaxed) {
                    if let Some(b) = &lockstep {
                        if !b.wait(stop) {
                            break;
                        }
                    }
                    let at = off + th as u64 * part;
                    if write {
                        if let Some(c) = own.as_mut() {
                            c.encrypt(at / 4096, buf).expect("encrypt");
                        }
                        t.write(buf, at);
                    } else {
                        t.read(buf, at);
                        if let Some(c) = own.as_mut() {
                            c.decrypt(at / 4096, buf).expect("decrypt");
                        }
                    }
                    off = (off + (1 << 20)) % s.data_bytes;
                    n += 1;
                }
                (n * part, n)
            })
            .mbps;
            (mbps, vec![])
        });
        let dir = if write { "writes" } else { "reads" };
        log_stats(&mut out.stats, s, &format!("4. one stream 1 MiB {dir}"), st);
        let ratio = res[at("parallel")].0.median / res[at("inline")].0.median;
        target(
            &mut out.targets,
            format!(
                "{}: one stream of 1 MiB {dir}: parallel / inline ({} cores)",
                s.name,
                s.xts.workers()
            ),
            ratio,
            1.8,
        );
        let one = res[at("raw+crypt")].0.median;
        out.notes.push(format!(
            "{}: 1 MiB {dir} without ucrypt, 2 threads ÷ 1 thread: {:.2} running freely (raw+crypt \
             x2), {:.2} finishing each MiB together (raw+crypt x2 lockstep: the most a split of \
             one stream can gain here); parallel ÷ inline = {ratio:.2}",
            s.name,
            res[at("raw+crypt x2")].0.median / one,
            res[at("raw+crypt x2 lockstep")].0.median / one,
        ));
        push_mbps(
            &mut out.rows,
            s,
            if write {
                "4. one stream, 1 MiB writes"
            } else {
                "4. one stream, 1 MiB reads"
            },
            &variants,
            res,
        );
    }
}

/// Percentiles kept for the latency CDF plots.
const CDF_POINTS: [f64; 13] = [
    1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99,
];

fn s5_latency(s: &Setup, k: &Knobs, out: &mut Sink) {
    let Sink {
        stats: log,
        rows,
        targets,
        ..
    } = out;
    let variants = ["raw", "inline", "queued"];
    let blocks = s.data_bytes / 4096;
    for busy in [0usize, 2] {
        let mut st = Vec::new();
        let mut cdfs: Vec<Vec<(f64, f64)>> = vec![Vec::new(); variants.len()];
        let res = round_robin(k, &variants, Some(&s.xts), &mut st, |i| {
            let t = variant_target(s, true, variants[i]);
            let stop = AtomicBool::new(false);
            let ops = (k.slice.as_secs_f64() * 100_000.0) as usize;
            let mut lat_ns: Vec<f64> = Vec::with_capacity(ops);
            std::thread::scope(|sc| {
                for _ in 0..busy {
                    let stop = &stop;
                    sc.spawn(move || {
                        let mut x = 1u64;
                        while !stop.load(Relaxed) {
                            x = black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                        }
                    });
                }
                let mut buf = Aligned::new(4096);
                let mut x = 0x1234_5678u64;
                for _ in 0..ops {
                    let off = (xorshift(&mut x) % blocks) * 4096;
                    let t0 = Instant::now();
                    t.read(buf.get(), off);
                    lat_ns.push(t0.elapsed().as_nanos() as f64);
                }
                stop.store(true, Relaxed);
            });
            lat_ns.sort_by(|a, b| a.total_cmp(b));
            let q = |p: f64| {
                lat_ns[((lat_ns.len() as f64 * p / 100.0) as usize).min(lat_ns.len() - 1)] / 1e3
            };
            // The last run's CDF is kept (round_robin calls variants in order, runs in turn).
            cdfs[i] = CDF_POINTS.iter().map(|&p| (p, q(p))).collect();
            (
                q(50.0),
                vec![("p99 µs".into(), q(99.0)), ("p99.9 µs".into(), q(99.9))],
            )
        });
        let scenario = if busy == 0 {
            "5a. 4 KiB random reads QD1, idle CPUs"
        } else {
            "5. 4 KiB random reads QD1 + 2 busy threads"
        };
        log_stats(log, s, scenario, st);
        if busy > 0 {
            // The brief: inline p99 <= 0.5 x queued p99, i.e. queued p99 / inline p99 >= 2.
            let p99 = |i: usize| {
                res[i]
                    .1
                    .iter()
                    .find(|(k, _)| k == "p99 µs")
                    .map_or(f64::NAN, |(_, v)| v.median)
            };
            target(
                targets,
                format!("{}: QD1 + 2 busy threads: queued p99 / inline p99", s.name),
                p99(2) / p99(1),
                2.0,
            );
        }
        let new = push_rows(
            rows,
            scenario,
            s.name,
            "aes-xts-plain64",
            "p50 µs",
            &variants,
            res,
        );
        for (row, cdf) in new.iter_mut().zip(cdfs) {
            row.cdf = cdf;
        }
    }
}

/// Request sizes of the block-size sweep.
const SWEEP_BYTES: [u64; 5] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20];

fn s7_block_sizes(s: &Setup, k: &Knobs, out: &mut Sink) {
    let Sink {
        stats: log, rows, ..
    } = out;
    let variants = ["raw", "inline", "parallel", "queued", "auto"];
    for write in [false, true] {
        let scenario = if write {
            "7. block size sweep, one stream of writes"
        } else {
            "7. block size sweep, one stream of reads"
        };
        for bs in SWEEP_BYTES {
            let mut st = Vec::new();
            let res = round_robin(k, &variants, Some(&s.xts), &mut st, |i| {
                let t = variant_target(s, true, variants[i]);
                let mbps = timed_threads(1, bs as usize, k.slice, |_, buf, stop| {
                    let (mut off, mut n) = (0u64, 0u64);
                    while !stop.load(Relaxed) {
                        if write {
                            t.write(buf, off);
                        } else {
                            t.read(buf, off);
                        }
                        off = (off + bs) % (s.data_bytes / bs * bs);
                        n += 1;
                    }
                    (n * bs, n)
                })
                .mbps;
                (mbps, vec![])
            });
            log_stats(log, s, &format!("{scenario}, {} KiB", bs >> 10), st);
            push_mbps(rows, s, scenario, &variants, res)
                .iter_mut()
                .for_each(|r| r.block_bytes = Some(bs));
        }
    }
}

/// Thread counts of the scaling scenario.
const SCALING_THREADS: [u32; 5] = [1, 2, 4, 8, 16];

fn s8_threads(s: &Setup, k: &Knobs, out: &mut Sink) {
    let Sink {
        stats: log, rows, ..
    } = out;
    let variants = ["raw", "inline", "parallel", "queued", "auto"];
    const BS: u64 = 64 << 10;
    let scenario = "8. scaling with threads, 64 KiB random read/write 2:1";
    let blocks = s.data_bytes / BS;
    for threads in SCALING_THREADS {
        let mut st = Vec::new();
        let res = round_robin(k, &variants, Some(&s.xts), &mut st, |i| {
            let t = variant_target(s, true, variants[i]);
            let mbps = timed_threads(threads as usize, BS as usize, k.slice, |th, buf, stop| {
                let mut x = 0x51_7cc1_b727_220au64 ^ (th as u64 + 1);
                let mut n = 0u64;
                while !stop.load(Relaxed) {
                    let r = xorshift(&mut x);
                    let off = (r % blocks) * BS;
                    if r % 3 == 2 {
                        t.write(buf, off);
                    } else {
                        t.read(buf, off);
                    }
                    n += 1;
                }
                (n * BS, n)
            })
            .mbps;
            (mbps, vec![])
        });
        log_stats(log, s, &format!("{scenario}, {threads} threads"), st);
        push_mbps(rows, s, scenario, &variants, res)
            .iter_mut()
            .for_each(|r| r.threads = Some(threads));
    }
}

/// Scenario 6's job: [`STREAMS_6`] sequential streams, sizes cycling 4 KiB .. 1 MiB, 2 reads
/// per write, against `variant`; MB/s.
fn mixed_streams(s: &Setup, k: &Knobs, variant: &str) -> f64 {
    const SIZES: [usize; 6] = [4 << 10, 16 << 10, 64 << 10, 4 << 10, 256 << 10, 1 << 20];
    let t = variant_target(s, true, variant);
    timed_threads(STREAMS_6, 1 << 20, k.slice, |th, buf, stop| {
        // Whole MiB per stream, so that every request is sector-aligned.
        let region = s.data_bytes / STREAMS_6 as u64 / (1 << 20) * (1 << 20);
        let base = th as u64 * region;
        let (mut off, mut n, mut bytes) = (0u64, 0u64, 0u64);
        while !stop.load(Relaxed) {
            let len = SIZES[(n as usize + th) % SIZES.len()];
            if off + len as u64 > region {
                off = 0;
            }
            let b = &mut buf[..len];
            if n % 3 == 2 {
                t.write(b, base + off);
            } else {
                t.read(b, base + off);
            }
            off += len as u64;
            bytes += len as u64;
            n += 1;
        }
        (bytes, n)
    })
    .mbps
}

/// Streams of scenario 6.
const STREAMS_6: usize = 6;

fn s6_many_streams(s: &Setup, k: &Knobs, out: &mut Sink) {
    let Sink {
        stats: log,
        rows,
        targets,
        ..
    } = out;
    let variants = ["raw", "inline", "parallel", "auto"];
    let mut st = Vec::new();
    let res = round_robin(k, &variants, Some(&s.xts), &mut st, |i| {
        (mixed_streams(s, k, variants[i]), vec![])
    });
    log_stats(log, s, "6. many streams", st);
    let best_static = res[1].0.median.max(res[2].0.median);
    let ratio = res[3].0.median / best_static;
    target(
        targets,
        format!("{}: many streams: auto / best static", s.name),
        ratio,
        0.98,
    );
    push_mbps(rows, s, "6. 6 streams, mixed 4 KiB-1 MiB", &variants, res);

    // The same streams while the host's load changes under them: two busy-loop threads that
    // run for CHURN_PHASE, pause for CHURN_PHASE, and so on, for the whole scenario (each
    // variant sees busy and quiet phases; the round-robin spreads them alike).
    let churn = Churn::start(CHURN_THREADS, CHURN_PHASE);
    let mut st = Vec::new();
    let res = round_robin(k, &variants, Some(&s.xts), &mut st, |i| {
        (mixed_streams(s, k, variants[i]), vec![])
    });
    drop(churn);
    log_stats(log, s, "6c. many streams, changing load", st);
    let best_static = res[1].0.median.max(res[2].0.median);
    target(
        targets,
        format!(
            "{}: many streams, changing load: auto / best static",
            s.name
        ),
        res[3].0.median / best_static,
        0.95,
    );
    push_mbps(
        rows,
        s,
        "6c. 6 streams, mixed 4 KiB-1 MiB, load changing every 150 ms",
        &variants,
        res,
    );
}

/// Busy-loop threads of the changing-load job, and how long each busy or quiet phase lasts.
const CHURN_THREADS: usize = 2;
const CHURN_PHASE: Duration = Duration::from_millis(150);

/// Background load that comes and goes: `threads` spinners, busy for a phase, asleep for the
/// next, until dropped.
struct Churn {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Churn {
    fn start(threads: usize, phase: Duration) -> Churn {
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

type Scenario = fn(&Setup, &Knobs, &mut Sink);

/// The scenarios: number, what progress says, the code, and whether it is a long sweep.
const SCENARIOS: [(u8, &str, Scenario, bool); 8] = [
    (1, "1: 4 KiB sequential reads", s1_seq_reads, false),
    (2, "2: 1 MiB writes, 64 in flight", s2_big_writes, false),
    (3, "3: 12 jobs of 256 KiB", s3_twelve_jobs, false),
    (4, "4: one stream of 1 MiB", s4_one_stream, false),
    (5, "5: QD1 latency with busy threads", s5_latency, false),
    (6, "6: many streams", s6_many_streams, false),
    (7, "7: block size sweep", s7_block_sizes, true),
    (8, "8: scaling with threads", s8_threads, true),
];

/// Runs the scenarios numbered in `only` (all if empty).
pub fn measure(runs: usize, quick: bool, progress: bool, only: &[u8]) -> EngineReport {
    let run = |n: u8| only.is_empty() || only.contains(&n);
    let knobs = Knobs {
        runs,
        slice: Duration::from_millis(if quick { 120 } else { 400 }),
    };
    // The sweeps have 10 and 5 points of 5 variants each: shorter slices.
    let sweep = Knobs {
        runs,
        slice: knobs.slice / 2,
    };
    let data_bytes = if quick { 64 << 20 } else { 256 << 20 };
    let mut out = Sink::default();
    let sets = setups(data_bytes, &mut out.notes);
    for s in &sets {
        out.notes.push(format!(
            "{}: {}; {} workers; auto splits from {} KiB",
            s.name,
            s.backend.describe(),
            s.xts.workers(),
            s.xts.auto_threshold_bytes() >> 10
        ));
        let say = |what: &str| {
            if progress {
                eprintln!("bench engine: {} {what}", s.name);
            }
        };
        // The sweeps are long; they run on the first (file) backend only, with short slices.
        let first = std::ptr::eq(s, &sets[0]);
        for (n, what, scenario, sweeps) in SCENARIOS {
            if run(n) && (first || !sweeps) {
                say(what);
                scenario(s, if sweeps { &sweep } else { &knobs }, &mut out);
            }
        }
        s.xts.set_policy(Policy::Inline);
        s.null.set_policy(Policy::Inline);
    }
    EngineReport {
        schema: 1,
        machine: Machine::detect(),
        quick,
        runs,
        notes: out.notes,
        rows: out.rows,
        targets: out.targets,
        breakdown: out.stats,
    }
}

pub fn markdown(r: &EngineReport) -> String {
    let mut o = String::new();
    o += &format!(
        "# ucrypt bench engine{}\n\nMachine: {}. {} round-robin runs; median (min–max).\n\n",
        if r.quick { " --quick" } else { "" },
        r.machine.describe(),
        r.runs
    );
    for n in &r.notes {
        o += &format!("- {n}\n");
    }
    let (plain, swept): (Vec<&Row>, Vec<&Row>) = r
        .rows
        .iter()
        .partition(|row| row.block_bytes.is_none() && row.threads.is_none());
    let mut last = "";
    for row in plain {
        if row.scenario != last {
            o += &format!(
                "\n## {}\n\n| backend | cipher | variant | {} | ÷ raw | |\n|---|---|---|---|---|---|\n",
                row.scenario, row.unit
            );
            last = row.scenario;
        }
        let extra: Vec<String> = row
            .extra
            .iter()
            .map(|(k, v)| format!("{k} {}", v.show(2)))
            .collect();
        let raw = r.rows.iter().find(|x| {
            x.variant == "raw"
                && x.scenario == row.scenario
                && x.backend == row.backend
                && x.cipher == row.cipher
        });
        let ratio = match raw {
            Some(x) if row.variant != "raw" => format!("{:.2}", row.value.median / x.value.median),
            _ => String::new(),
        };
        o += &format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            row.backend,
            row.cipher,
            row.variant,
            row.value.show(if row.unit.contains("µs") { 2 } else { 0 }),
            ratio,
            extra.join(", ")
        );
    }
    o += &sweep_tables(&swept);
    o += "\n## Targets\n\n| check | measured | target | |\n|---|---|---|---|\n";
    for t in &r.targets {
        o += &format!(
            "| {} | {:.2} | ≥ {:.2} | {} |\n",
            t.what,
            t.measured,
            t.target,
            if t.met { "met" } else { "MISSED" }
        );
    }
    o += &breakdown_table(&r.breakdown);
    o
}

/// Sweep rows (scenarios 7 and 8) as one table per scenario: a row per variant, a column per
/// block size or thread count; medians only (the JSON keeps min–max).
fn sweep_tables(rows: &[&Row]) -> String {
    let mut o = String::new();
    let mut scenarios: Vec<&str> = Vec::new();
    for r in rows {
        if !scenarios.contains(&r.scenario) {
            scenarios.push(r.scenario);
        }
    }
    for sc in scenarios {
        let these: Vec<&&Row> = rows.iter().filter(|r| r.scenario == sc).collect();
        let key = |r: &Row| r.block_bytes.unwrap_or(r.threads.unwrap_or(0) as u64);
        let mut cols: Vec<u64> = these.iter().map(|r| key(r)).collect();
        cols.dedup();
        let mut variants: Vec<&str> = Vec::new();
        for r in &these {
            if !variants.contains(&r.variant.as_str()) {
                variants.push(&r.variant);
            }
        }
        let head: Vec<String> = cols
            .iter()
            .map(|&c| {
                if these[0].block_bytes.is_some() {
                    format!("{} KiB", c >> 10)
                } else {
                    format!("{c} thr")
                }
            })
            .collect();
        o += &format!(
            "\n## {sc} ({}, {}, {})\n\n| variant | {} |\n|---|{}\n",
            these[0].backend,
            these[0].cipher,
            these[0].unit,
            head.join(" | "),
            "---|".repeat(cols.len())
        );
        for v in variants {
            let cells: Vec<String> = cols
                .iter()
                .map(|&c| {
                    these
                        .iter()
                        .find(|r| r.variant == v && key(r) == c)
                        .map_or("–".into(), |r| format!("{:.0}", r.value.median))
                })
                .collect();
            o += &format!("| {v} | {} |\n", cells.join(" | "));
        }
    }
    o
}

/// The per-stage breakdown as a table (mean ns per timed request).
pub fn breakdown_table(b: &[Breakdown]) -> String {
    let mut o = String::from(
        "\n## Where time went (Volume::stats of each variant's last run; mean ns per request)\n\n\
         Stages of split requests add up over their chunks, so they can exceed the total.\n\n\
         | backend | scenario | variant | op | requests | split | wait | queue | crypto | device | total |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for x in b {
        o += &format!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |\n",
            x.backend,
            x.scenario,
            x.variant,
            x.op,
            x.requests,
            x.split,
            x.wait_ns,
            x.queue_ns,
            x.crypto_ns,
            x.device_ns,
            x.total_ns
        );
    }
    o
}
