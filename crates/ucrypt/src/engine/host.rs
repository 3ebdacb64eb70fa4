//! How many of the host's cores this process could use lately, for `auto`.
//!
//! `auto` splits a big request across cores only when another core is free. An idle worker
//! of ours does not say that on a shared host: other processes (the NBD client and server
//! beside a relay, other tenants) may hold every core, and then a split only adds hand-offs
//! and a bounce buffer (an NBD relay's 1 MiB writes are such a case: the relay rows of
//! `bench remote`, BENCHMARKS.md). So `auto` also asks this module:
//! the cores that sat idle over the last window, from `/proc/stat`, plus the CPU this process
//! used itself in it (its own helpers' time is ours to spend again). Splitting onto cores that
//! others are using is what `parallel` is for.
//!
//! Sampling is lazy and cheap: the first big request after a window of [`WINDOW`] reads
//! `/proc/stat` and `getrusage` (a few µs, no allocation); every other caller reads one
//! atomic. Where `/proc/stat` cannot be read the answer is "unknown" and `auto` decides on its
//! workers alone, as before.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How often the host is sampled (at most; only while big requests come). `/proc/stat` counts
/// in ticks of 10 ms per CPU, so over 50 ms one tick is 0.2 of a core: fine enough to round.
pub const WINDOW: Duration = Duration::from_millis(50);

/// "Not known": no sample yet, or `/proc/stat` unreadable.
const UNKNOWN: u32 = u32::MAX;

/// One reading: when, the host's idle ticks (idle + iowait, all CPUs), this process's CPU time.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    at: Instant,
    idle_ticks: u64,
    self_cpu: Duration,
}

struct HostLoad {
    /// Cores available to this process over the last window, in thousandths (or UNKNOWN).
    milli_cores: AtomicU32,
    /// Nanoseconds after `epoch` when the next sample is due.
    next_ns: AtomicU64,
    epoch: Instant,
    last: Mutex<Option<Sample>>,
    ticks_per_s: f64,
}

fn host() -> &'static HostLoad {
    static HOST: OnceLock<HostLoad> = OnceLock::new();
    HOST.get_or_init(|| {
        // SAFETY: sysconf takes no pointers; it only reads a constant of the C library.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        HostLoad {
            milli_cores: AtomicU32::new(UNKNOWN),
            next_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            last: Mutex::new(None),
            ticks_per_s: if hz > 0 { hz as f64 } else { 100.0 },
        }
    })
}

/// Whole cores this process could have used over the last window (idle ones plus its own use,
/// rounded), or `None` when not known.
pub fn cores_for_us() -> Option<usize> {
    let h = host();
    let now = Instant::now();
    let now_ns = now.duration_since(h.epoch).as_nanos() as u64;
    if now_ns >= h.next_ns.load(Relaxed) {
        // One caller samples; the others go on with the last value.
        if let Ok(mut last) = h.last.try_lock() {
            h.next_ns.store(now_ns + WINDOW.as_nanos() as u64, Relaxed);
            let fresh = read_sample(now);
            let milli = match (*last, fresh) {
                (Some(a), Some(b)) => available(a, b, h.ticks_per_s)
                    .map_or(UNKNOWN, |c| (c * 1000.0).round().min(1e9) as u32),
                _ => UNKNOWN,
            };
            h.milli_cores.store(milli, Relaxed);
            *last = fresh;
        }
    }
    match h.milli_cores.load(Relaxed) {
        UNKNOWN => None,
        m => Some(((m + 500) / 1000) as usize),
    }
}

/// Cores free for a split's helpers: of `lanes` (the engine's threads per request), at most
/// the cores this process could use lately, less one for each big request running (`others`)
/// and one for the caller.
pub fn free_cores(lanes: usize, others: usize) -> usize {
    let cores = cores_for_us().map_or(lanes, |c| c.min(lanes));
    cores.saturating_sub(others + 1)
}

/// Cores available to this process between two samples: the host's idle cores plus its own
/// use. `None` if the samples are not in order.
fn available(a: Sample, b: Sample, ticks_per_s: f64) -> Option<f64> {
    let wall = b.at.checked_duration_since(a.at)?.as_secs_f64();
    if wall <= 0.0 || b.idle_ticks < a.idle_ticks {
        return None;
    }
    let idle = (b.idle_ticks - a.idle_ticks) as f64 / ticks_per_s / wall;
    let ours = b.self_cpu.saturating_sub(a.self_cpu).as_secs_f64() / wall;
    Some(idle + ours)
}

fn read_sample(at: Instant) -> Option<Sample> {
    use std::io::Read;
    // The first line ("cpu  user nice system idle iowait ...") fits easily.
    let mut buf = [0u8; 512];
    let mut f = std::fs::File::open("/proc/stat").ok()?;
    let n = f.read(&mut buf).ok()?;
    let idle_ticks = idle_ticks(&buf[..n])?;
    Some(Sample {
        at,
        idle_ticks,
        self_cpu: self_cpu()?,
    })
}

/// Idle + iowait ticks of all CPUs, from the text of `/proc/stat`.
fn idle_ticks(text: &[u8]) -> Option<u64> {
    let line = text.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut fields = line.split_ascii_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let mut idle = 0u64;
    for (i, f) in fields.take(5).enumerate() {
        let v: u64 = f.parse().ok()?;
        // user nice system idle iowait
        if i >= 3 {
            idle = idle.checked_add(v)?;
        }
    }
    Some(idle)
}

/// User + system CPU time of this process so far.
fn self_cpu() -> Option<Duration> {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: getrusage writes one rusage through the pointer, which points to enough space
    // for it; it is read only after the call said it succeeded.
    let ru = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) != 0 {
            return None;
        }
        ru.assume_init()
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    Some(tv(ru.ru_utime) + tv(ru.ru_stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_ticks_from_proc_stat_text() {
        let rows: &[(&str, Option<u64>)] = &[
            (
                "cpu  10 20 30 400 50 0 6 7 0 0\ncpu0 1 2 3 4 5\n",
                Some(450),
            ),
            ("cpu  1 2 3 4\n", Some(4)),
            ("cpu0 1 2 3 4 5\n", None),
            ("cpu  1 2 x 4 5\n", None),
            ("", None),
        ];
        for &(text, want) in rows {
            assert_eq!(idle_ticks(text.as_bytes()), want, "{text:?}");
        }
    }

    #[test]
    fn available_is_idle_cores_plus_our_own_use() {
        let t0 = Instant::now();
        let s = |ms: u64, idle: u64, cpu_ms: u64| Sample {
            at: t0 + Duration::from_millis(ms),
            idle_ticks: idle,
            self_cpu: Duration::from_millis(cpu_ms),
        };
        // 100 ms at 100 ticks/s: 10 idle ticks = one idle core; 100 ms of ours = one more.
        let rows: &[(Sample, Sample, Option<f64>)] = &[
            (s(0, 0, 0), s(100, 10, 0), Some(1.0)),
            (s(0, 0, 0), s(100, 0, 100), Some(1.0)),
            (s(0, 5, 50), s(100, 15, 150), Some(2.0)),
            (s(0, 0, 0), s(100, 0, 0), Some(0.0)),
            // Out of order, or a counter that went back: not known.
            (s(100, 0, 0), s(0, 10, 0), None),
            (s(0, 10, 0), s(100, 5, 0), None),
        ];
        for (i, &(a, b, want)) in rows.iter().enumerate() {
            let got = available(a, b, 100.0);
            match (got, want) {
                (Some(g), Some(w)) => assert!((g - w).abs() < 1e-9, "row {i}: {g} vs {w}"),
                _ => assert_eq!(got, want, "row {i}"),
            }
        }
    }

    #[test]
    fn this_host_is_sampled() {
        // Linux: /proc/stat and getrusage answer; the first call may be unknown, a call after
        // a window is not, and it never reports more cores than the host has (idle ones and
        // ours are disjoint), give or take a tick of rounding.
        assert!(read_sample(Instant::now()).is_some());
        let _ = cores_for_us();
        std::thread::sleep(WINDOW + Duration::from_millis(10));
        let c = cores_for_us().expect("a second sample after a window");
        let stat = std::fs::read_to_string("/proc/stat").unwrap();
        let n = stat
            .lines()
            .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
            .count();
        assert!(c <= n + 1, "{c} cores for us on a host of {n}");
    }
}
