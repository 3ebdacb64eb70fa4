//! Scenarios 5 to 8: QD1 latency under load, many streams, block sizes, thread scaling.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Instant;

use super::rig::*;
use super::rows::*;

/// Percentiles kept for the latency CDF plots.
pub(super) const CDF_POINTS: [f64; 13] = [
    1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99,
];

pub(super) fn s5_latency(s: &Setup, k: &Knobs, out: &mut Sink) {
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
                None,
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
pub(super) const SWEEP_BYTES: [u64; 5] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20];

pub(super) fn s7_block_sizes(s: &Setup, k: &Knobs, out: &mut Sink) {
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
pub(super) const SCALING_THREADS: [u32; 5] = [1, 2, 4, 8, 16];

pub(super) fn s8_threads(s: &Setup, k: &Knobs, out: &mut Sink) {
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
pub(super) fn mixed_streams(s: &Setup, k: &Knobs, variant: &str) -> f64 {
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
pub(super) const STREAMS_6: usize = 6;

pub(super) fn s6_many_streams(s: &Setup, k: &Knobs, out: &mut Sink) {
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
        None,
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
        None,
    );
    push_mbps(
        rows,
        s,
        "6c. 6 streams, mixed 4 KiB-1 MiB, load changing every 150 ms",
        &variants,
        res,
    );
}
