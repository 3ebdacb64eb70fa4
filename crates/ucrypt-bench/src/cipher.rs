//! `ucrypt bench cipher`: sector cipher throughput per spec × key size × sector size ×
//! provider, in place, on a hot buffer (256 KiB, L2-resident) and a cold one (64 MiB), beside
//! memcpy of the same buffers measured in the same run. Configurations run round-robin, so a
//! clock change on this noisy machine hits every row alike; each row is the median of the runs.
//!
//! The ciphers off AWS-LC's AES-XTS/CBC (serpent, twofish, camellia, LRW, Adiantum) are one to
//! two orders of magnitude slower: their rows process [`SLOW_DIVISOR`] times fewer bytes per
//! measurement (the cold buffer's first part), so a run stays short.

use std::hint::black_box;
use std::time::Instant;

use serde::Serialize;
use ucrypt::sector::{
    BlockCipher, CipherSpec, Geometry, IvMode, Mode, Provider, SectorCipher, SectorSize,
};

use super::stats::{Machine, Summary};

const HOT_BYTES: usize = 256 << 10;
const COLD_BYTES: usize = 64 << 20;
/// Bytes processed per hot measurement: enough passes over the hot buffer for some tens of
/// milliseconds at AES-NI speeds.
const HOT_WORK_BYTES: usize = 256 << 20;
/// How many times fewer bytes a row off AWS-LC's AES-XTS/CBC processes per measurement.
const SLOW_DIVISOR: usize = 16;

#[derive(Clone, Copy)]
struct Row {
    spec: &'static str,
    key_bits: usize,
    provider: Provider,
}

fn rows() -> Vec<Row> {
    let mut v = vec![
        Row {
            spec: "aes-xts-plain64",
            key_bits: 512,
            provider: Provider::AwsLcXts,
        },
        Row {
            spec: "aes-xts-plain64",
            key_bits: 512,
            provider: Provider::EcbXts,
        },
        Row {
            spec: "aes-xts-plain64",
            key_bits: 256,
            provider: Provider::EcbXts,
        },
    ];
    for spec in ["aes-xts-plain", "aes-xts-plain64be", "aes-xts-essiv:sha256"] {
        v.push(Row {
            spec,
            key_bits: 512,
            provider: Provider::AwsLcXts,
        });
    }
    for spec in ["aes-cbc-essiv:sha256", "aes-cbc-plain64", "aes-cbc-plain"] {
        v.push(Row {
            spec,
            key_bits: 256,
            provider: Provider::Auto,
        });
    }
    // The other ciphers dm-crypt volumes use: XTS with two 256-bit keys and CBC-ESSIV with
    // one, as `cryptsetup benchmark` lists them; camellia-CBC at 128 and 256 bits beside
    // `openssl speed -evp camellia-{128,256}-cbc`; LRW-AES with AES-128 and AES-256 keys.
    for spec in [
        "serpent-xts-plain64",
        "twofish-xts-plain64",
        "camellia-xts-plain64",
    ] {
        v.push(Row {
            spec,
            key_bits: 512,
            provider: Provider::Auto,
        });
    }
    for (spec, key_bits) in [
        ("serpent-cbc-essiv:sha256", 256),
        ("twofish-cbc-essiv:sha256", 256),
        ("camellia-cbc-essiv:sha256", 256),
        ("camellia-cbc-plain64", 128),
        ("camellia-cbc-plain64", 256),
        ("aes-lrw-benbi", 256),
        ("aes-lrw-benbi", 384),
        ("xchacha12,aes-adiantum-plain64", 256),
        ("xchacha20,aes-adiantum-plain64", 256),
        // BitLocker's AES-CBC with the Elephant diffuser (Windows 7), AES-128 and AES-256:
        // the key is the CBC key and the sector key's AES key, each half.
        ("aes-cbc-elephant", 256),
        ("aes-cbc-elephant", 512),
    ] {
        v.push(Row {
            spec,
            key_bits,
            provider: Provider::Auto,
        });
    }
    // cipher_null-ecb is a no-op in place: it has no throughput to measure here (the engine
    // benchmark uses it to show the cost of everything but the cipher).
    v
}

/// Whether a row runs off AWS-LC's AES-XTS/CBC alone (and so at a fraction of its speed).
fn slow(spec: &CipherSpec) -> bool {
    spec.iv == IvMode::Elephant
        || !matches!(
            spec.mode,
            Mode::Xts(BlockCipher::Aes) | Mode::Cbc(BlockCipher::Aes)
        )
}

/// What runs the row: AWS-LC's EVP modes, ucrypt's modes over AWS-LC's AES-ECB, over
/// RustCrypto's serpent or over ucrypt's table-driven twofish and camellia; Adiantum with
/// RustCrypto's XChaCha, ucrypt's NH and Poly1305 and AWS-LC's AES.
fn implementation(c: &SectorCipher) -> &'static str {
    match c.spec().mode {
        Mode::Xts(BlockCipher::Aes) => c.provider().name(),
        Mode::Cbc(BlockCipher::Aes) if c.spec().iv == IvMode::Elephant => {
            "ucrypt elephant + aws-lc"
        }
        Mode::Cbc(BlockCipher::Aes) => "aws-lc",
        Mode::Lrw(BlockCipher::Aes) => "lrw + aws-lc ecb",
        Mode::Xts(BlockCipher::Serpent)
        | Mode::Cbc(BlockCipher::Serpent)
        | Mode::Lrw(BlockCipher::Serpent)
        | Mode::Cbc64(_) => "rustcrypto",
        Mode::Xts(_) | Mode::Cbc(_) | Mode::Lrw(_) => "ucrypt tables",
        Mode::Adiantum(_) => "rustcrypto xchacha + aws-lc aes",
        Mode::Cascade(_) => "cascade of the above",
        Mode::Null => "-",
    }
}

#[derive(Serialize)]
pub struct CipherResult {
    pub spec: String,
    pub key_bits: usize,
    pub sector_bytes: u32,
    pub provider: String,
    /// GB/s (10^9 bytes per second), encrypt in place.
    pub hot_gbps: Summary,
    pub cold_gbps: Summary,
    /// Decrypt in place, hot buffer (what reads pay; CBC decrypts in parallel, encrypts serially).
    pub hot_decrypt_gbps: Summary,
    /// Encrypt in place, hot buffer, per second of this thread's CPU time (what `openssl speed`
    /// reports without `-elapsed`): on a host shared with other work, the cipher's own speed.
    pub hot_cpu_gbps: Summary,
    /// Decrypt in place, hot buffer, per second of this thread's CPU time.
    pub hot_decrypt_cpu_gbps: Summary,
    /// Median hot GB/s divided by the median hot memcpy GB/s of the same run.
    pub hot_vs_memcpy: f64,
    pub cold_vs_memcpy: f64,
}

#[derive(Serialize)]
pub struct CipherReport {
    /// Bumped on an incompatible change of this JSON (see docs/bench-json.md).
    pub schema: u32,
    pub machine: Machine,
    pub runs: usize,
    pub memcpy_hot_gbps: Summary,
    pub memcpy_cold_gbps: Summary,
    pub results: Vec<CipherResult>,
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// This thread's CPU time, in seconds.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// GB/s by the wall clock and by this thread's CPU time.
fn time_cipher(c: &mut SectorCipher, buf: &mut [u8], total: usize, encrypt: bool) -> (f64, f64) {
    let passes = total.div_ceil(buf.len()).max(1);
    let cpu = thread_cpu_s();
    let t = Instant::now();
    for p in 0..passes {
        let sector = (p * buf.len() / c.sector_bytes()) as u64;
        if encrypt {
            c.encrypt(sector, buf).expect("encrypt");
        } else {
            c.decrypt(sector, buf).expect("decrypt");
        }
        black_box(&mut *buf);
    }
    let wall = t.elapsed().as_secs_f64();
    let cpu = (thread_cpu_s() - cpu).max(1e-9);
    (
        gbps(passes * buf.len(), wall),
        gbps(passes * buf.len(), cpu),
    )
}

fn time_memcpy(src: &[u8], dst: &mut [u8], total: usize) -> f64 {
    let passes = total.div_ceil(src.len()).max(1);
    let t = Instant::now();
    for _ in 0..passes {
        dst.copy_from_slice(black_box(src));
        black_box(&mut *dst);
    }
    gbps(passes * src.len(), t.elapsed().as_secs_f64())
}

/// `only`: run just the rows whose spec contains one of these strings (all when empty).
pub fn measure(runs: usize, quick: bool, progress: bool, only: &[String]) -> CipherReport {
    let hot_work = if quick {
        HOT_WORK_BYTES / 4
    } else {
        HOT_WORK_BYTES
    };
    let cold_bytes = if quick { COLD_BYTES / 4 } else { COLD_BYTES };
    let mut hot = vec![0x5au8; HOT_BYTES];
    let mut hot2 = vec![0u8; HOT_BYTES];
    let mut cold = vec![0xa5u8; cold_bytes];
    let mut cold2 = vec![0u8; cold_bytes];

    let mut configs = Vec::new();
    for row in rows()
        .into_iter()
        .filter(|r| only.is_empty() || only.iter().any(|o| r.spec.contains(o.as_str())))
    {
        for ss in [512u64, 4096] {
            let spec: CipherSpec = row.spec.parse().expect("bench spec parses");
            let key: Vec<u8> = (0..row.key_bits / 8)
                .map(|i| (i as u8).wrapping_mul(37).wrapping_add(11))
                .collect();
            let geo = Geometry::new(SectorSize::new(ss).expect("bench sector size"));
            let c =
                SectorCipher::with_provider(spec, &key, geo, row.provider).expect("bench cipher");
            configs.push((
                row,
                ss as u32,
                c,
                Vec::new(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
            ));
        }
    }
    let (mut mh, mut mc) = (Vec::new(), Vec::new());
    for run in 0..runs {
        if progress {
            eprint!("\rbench cipher: run {}/{runs}", run + 1);
        }
        mh.push(time_memcpy(&hot, &mut hot2, hot_work));
        mc.push(time_memcpy(&cold, &mut cold2, cold_bytes));
        for (_, _, c, h, k, d, u, v) in configs.iter_mut() {
            let div = if slow(&c.spec()) { SLOW_DIVISOR } else { 1 };
            let cold = &mut cold[..cold_bytes / div];
            let (wall, cpu) = time_cipher(c, &mut hot, hot_work / div, true);
            h.push(wall);
            u.push(cpu);
            k.push(time_cipher(c, cold, cold.len(), true).0);
            let (wall, cpu) = time_cipher(c, &mut hot, hot_work / div, false);
            d.push(wall);
            v.push(cpu);
        }
    }
    if progress {
        eprintln!();
    }
    let memcpy_hot_gbps = Summary::of(&mh);
    let memcpy_cold_gbps = Summary::of(&mc);
    let results = configs
        .into_iter()
        .map(|(row, ss, c, h, k, d, u, v)| {
            let (hot_gbps, cold_gbps) = (Summary::of(&h), Summary::of(&k));
            CipherResult {
                spec: row.spec.to_string(),
                key_bits: row.key_bits,
                sector_bytes: ss,
                provider: implementation(&c).to_string(),
                hot_vs_memcpy: hot_gbps.median / memcpy_hot_gbps.median,
                cold_vs_memcpy: cold_gbps.median / memcpy_cold_gbps.median,
                hot_gbps,
                cold_gbps,
                hot_decrypt_gbps: Summary::of(&d),
                hot_cpu_gbps: Summary::of(&u),
                hot_decrypt_cpu_gbps: Summary::of(&v),
            }
        })
        .collect();
    CipherReport {
        schema: 1,
        machine: Machine::detect(),
        runs,
        memcpy_hot_gbps,
        memcpy_cold_gbps,
        results,
    }
}

pub fn markdown(r: &CipherReport) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "Machine: {}. {} runs, round-robin; GB/s = 10^9 bytes/s, encrypt in place, one core; median (min–max).\n\n",
        r.machine.describe(),
        r.runs
    ));
    s.push_str(&format!(
        "memcpy (same run): hot {} GB/s, cold {} GB/s\n\n",
        r.memcpy_hot_gbps.show(1),
        r.memcpy_cold_gbps.show(1)
    ));
    s.push_str("| spec | key bits | sector | provider | encrypt hot GB/s | encrypt cold GB/s | decrypt hot GB/s | encrypt hot GB/s per CPU-s | decrypt hot GB/s per CPU-s | hot ÷ memcpy | cold ÷ memcpy |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for x in &r.results {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} |\n",
            x.spec,
            x.key_bits,
            x.sector_bytes,
            x.provider,
            x.hot_gbps.show(2),
            x.cold_gbps.show(2),
            x.hot_decrypt_gbps.show(2),
            x.hot_cpu_gbps.show(2),
            x.hot_decrypt_cpu_gbps.show(2),
            x.hot_vs_memcpy,
            x.cold_vs_memcpy
        ));
    }
    s
}
