//! Scenarios 1 to 4: sequential reads at QD1, big writes, concurrent jobs, one stream.

use std::hint::black_box;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ucrypt::engine::Policy;
use ucrypt::volume::Volume;

use crate::stats::Summary;

use super::rig::*;
use super::rows::*;

// ---------------------------------------------------------------- scenarios

pub(super) fn s1_seq_reads(s: &Setup, k: &Knobs, out: &mut Sink) {
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
        // With aes-xts, the ceiling is raw+decrypt's ratio to the same limit: the loop without
        // ucrypt. The null cipher has none beside raw itself, whose ratio is 1 by definition.
        let ceiling = xts.then(|| res[1].0.median / limit);
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
        target(targets, what, ratio, want, ceiling);
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
pub(super) const BURST_READS: u64 = 512;

/// Scenario 1's measurement: the `variants` (raw, raw+decrypt, or a volume policy) take turns
/// on one thread in bursts of [`BURST_READS`] 4 KiB sequential reads, for a slice per variant
/// and run; each run gives every variant's MB/s over all its bursts. Taking turns this often
/// puts clock changes and other tenants' bursts on every variant alike, which whole slices
/// one after the other do not (they moved the inline ÷ raw ratio by ±0.1 between runs).
pub(super) fn interleaved_seq_reads(
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

/// Scenario 2's target: each policy's throughput ÷ the limit of the machine.
pub(super) const S2_TARGET: f64 = 0.9;

/// Scenario 2: 64 threads each writing 1 MiB at a time. Beside the policies it measures, in
/// the same round-robin, what bounds them: `raw` (the backend alone), `cipher x cores` (one
/// thread per core, each encrypting 1 MiB from one buffer into another, as a write does: the
/// cores × cipher of the formula, as measured while the machine carries the load it carries)
/// and `raw+crypt x64` (the same 64 threads encrypting into a buffer of their own and writing
/// it, without ucrypt: the ceiling of this workload on this machine as loaded now). The limit
/// of a write that must be encrypted, then written, is 1 / (1/raw + 1/(cores × cipher)),
/// computed per run from that run's raw and cipher; each policy's ratio to it (and to the
/// ceiling) is taken per run too.
pub(super) fn s2_big_writes(s: &Setup, k: &Knobs, out: &mut Sink) {
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
            Some(ratio(ceiling).median),
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

pub(super) fn s3_twelve_jobs(s: &Setup, k: &Knobs, out: &mut Sink) {
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

pub(super) fn s4_one_stream(s: &Setup, k: &Knobs, out: &mut Sink) {
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
        let one = res[at("raw+crypt")].0.median;
        // The ceiling of a split: two threads finishing each MiB together, without ucrypt.
        let lockstep = res[at("raw+crypt x2 lockstep")].0.median / one;
        target(
            &mut out.targets,
            format!(
                "{}: one stream of 1 MiB {dir}: parallel / inline ({} cores)",
                s.name,
                s.xts.workers()
            ),
            ratio,
            1.8,
            Some(lockstep),
        );
        out.notes.push(format!(
            "{}: 1 MiB {dir} without ucrypt, 2 threads ÷ 1 thread: {:.2} running freely (raw+crypt \
             x2), {:.2} finishing each MiB together (raw+crypt x2 lockstep: the most a split of \
             one stream can gain here); parallel ÷ inline = {ratio:.2}",
            s.name,
            res[at("raw+crypt x2")].0.median / one,
            lockstep,
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
