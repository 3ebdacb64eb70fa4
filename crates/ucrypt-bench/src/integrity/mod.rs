//! `ucrypt bench integrity`: authenticated volumes (dm-crypt over dm-integrity, direct mode)
//! beside a plain aes-xts-plain64 volume, on the same kind of backing (a /dev/shm file,
//! O_DIRECT), side by side: 1 MiB sequential read and write throughput, and 4 KiB QD1 random
//! read and write latency. Every configuration runs once per round, round-robin; each cell is
//! the median of the rounds with their minimum and maximum, and the ratio of medians to the
//! plain XTS volume (the engine's default policy, `auto`) is printed per row. A second plain
//! XTS row runs `inline` (one core). Each authenticated mode runs with `auto` (large requests
//! split across cores, as `ucrypt` opens volumes) and with `inline` (the caller's thread
//! only, as before authenticated volumes split), and aes-gcm-random + aead once more in
//! journal mode.
//!
//! The volumes are built through the library (`IntegrityVolume::new` over the superblock the
//! kernel would write, `Volume::new`), not through `ucrypt format`, so no KDF runs.
//!
//! The kernel column: with `--vm`, the kernel's dm-integrity + dm-crypt and ucrypt (over ublk)
//! on the same volumes in one boot of the test VM, as ratios to plain XTS on each side
//! ([`vm`]); the host has no dm-integrity, and the VM's emulated CPU makes
//! its absolute numbers incomparable with these. Without `--vm`, or where the VM cannot run,
//! the column says SKIPPED and why.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use ucrypt::backend::{Backend, DirectMode, FileBackend};
use ucrypt::engine::{Policies, Policy};
use ucrypt::integrity::{
    new_superblock, write_new_device, HmacHash, IntegrityVolume, TagMode, WriteMode,
};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

pub mod vm;

use crate::stats::{Machine, Summary};
use vm::KernelColumn;

/// Plaintext bytes of each volume (the integrity ones provide a little less: the size of the
/// backing file is chosen so that they provide at least this).
const DATA_BYTES: u64 = 64 << 20;
const DATA_BYTES_QUICK: u64 = 16 << 20;
/// The large request size.
pub(crate) const BIG_BYTES: usize = 1 << 20;
/// The small request size, as a file system's block.
pub(crate) const SMALL_BYTES: usize = 4096;
/// 4 KiB requests per latency sample (each round, each direction).
const SMALL_OPS: usize = 4000;
const SMALL_OPS_QUICK: usize = 1000;
/// Room for the dm-integrity superblock, journal and tags beyond the data (≤ 3 % for the
/// modes here at 4 KiB blocks, plus the journal's 1/128).
const BACKING_SLACK_NUM: u64 = 9;
const BACKING_SLACK_DEN: u64 = 100;

/// The authenticated modes, as the rows name them.
const MODES: [(&str, TagMode); 5] = [
    (
        "aes-gcm-random + aead",
        TagMode::AesGcmRandom { key_bytes: 32 },
    ),
    ("aegis128-random + aead", TagMode::Aegis128Random),
    (
        "chacha20-random + poly1305",
        TagMode::ChaCha20RandomPoly1305,
    ),
    (
        "aes-xts-random + hmac-sha256",
        TagMode::xts_random_hmac(HmacHash::Sha256),
    ),
    (
        "aes-xts-random + hmac-sha512",
        TagMode::xts_random_hmac(HmacHash::Sha512),
    ),
];

/// What the kernel column says without `--vm`.
const KERNEL_NOT_ASKED: &str = "not asked for: dm-integrity + dm-crypt run only in the test VM; \
     `ucrypt bench integrity --vm` boots it (tests/vm/, qemu) and measures the kernel and \
     ucrypt there as ratios to plain XTS";

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub name: String,
    /// MiB/s of 1 MiB sequential reads / writes.
    pub read_mib_s: Summary,
    pub write_mib_s: Summary,
    /// µs per 4 KiB request at QD1 (mean of a round), reads / writes.
    pub read_4k_us: Summary,
    pub write_4k_us: Summary,
    /// Ratios of the medians to the plain XTS row (throughput: this / plain; latency: plain /
    /// this, so that below 1 is slower in both).
    pub read_ratio: f64,
    pub write_ratio: f64,
    pub read_4k_ratio: f64,
    pub write_4k_ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub backing: String,
    pub data_bytes: u64,
    pub runs: usize,
    pub rows: Vec<Row>,
    /// The kernel column in one line: `SKIPPED: why`, or where the measurement is.
    pub kernel: String,
    /// The kernel column itself (`--vm`): `status` "skipped" with a `reason`, or "measured"
    /// with the VM's report.
    pub kernel_vm: KernelColumn,
    pub notes: Vec<String>,
}

struct TempFile(std::path::PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

struct Config {
    name: String,
    dev: Arc<dyn BlockDev>,
    _file: TempFile,
}

fn key(n: usize) -> SecretBytes {
    let k: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(29) ^ 0x3c).collect();
    SecretBytes::from_slice(&k)
}

fn backing(tag: &str, bytes: u64) -> Result<(TempFile, Arc<dyn Backend>), String> {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!(
        "ucrypt-bench-integrity-{tag}-{}",
        std::process::id()
    ));
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(bytes))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let tf = TempFile(path);
    let b = FileBackend::open(&tf.0, true, DirectMode::Auto).map_err(|e| e.to_string())?;
    Ok((tf, Arc::new(b)))
}

fn plain_xts(data: u64, policy: Policy) -> Result<Config, String> {
    let (tf, b) = backing(&format!("xts-{policy}"), data)?;
    let spec = CipherSpec::AES_XTS_PLAIN64;
    let mut cfg = VolumeConfig::new(
        spec,
        key(spec.default_key_bytes()),
        Geometry::new(SectorSize::S4096),
    );
    cfg.policy = Policies::from(policy);
    let v = Volume::new(b, cfg).map_err(|e| e.to_string())?;
    Ok(Config {
        name: format!("plain aes-xts-plain64 (policy {policy})"),
        dev: Arc::new(v),
        _file: tf,
    })
}

fn authenticated(
    name: &str,
    mode: TagMode,
    data: u64,
    policy: Policy,
    wm: WriteMode,
) -> Result<Config, String> {
    let total = data + data * BACKING_SLACK_NUM / BACKING_SLACK_DEN + (4 << 20);
    let (tf, b) = backing(&name.replace([' ', '+', '(', ')'], "_"), total)?;
    let tag = u16::try_from(mode.tuple_bytes()).map_err(|_| "tag size".to_string())?;
    let layout = new_superblock(tag, 4096, 0, total / 512, true).map_err(|e| e.to_string())?;
    // The superblock and an initialised journal, as `ucrypt format` writes them (opening checks
    // the journal's commit ids); then direct mode, to measure the tag layer alone (the
    // journal's cost: docs/integrity.md, "What it costs"), except in the journal row.
    write_new_device(b.as_ref(), 0, &layout).map_err(|e| e.to_string())?;
    let v =
        IntegrityVolume::with_write_mode(b, 0, layout.sb, mode, key(mode.key_bytes()), false, wm)
            .map_err(|e| e.to_string())?;
    v.set_policy(policy);
    if v.size() < data {
        return Err(format!("{name}: provides {} < {data} bytes", v.size()));
    }
    Ok(Config {
        name: name.into(),
        dev: Arc::new(v),
        _file: tf,
    })
}

/// A 4096-aligned buffer.
pub(crate) struct Aligned {
    store: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    pub(crate) fn new(len: usize) -> Self {
        let store: Vec<u8> = (0..len + 4096).map(|i| (i * 7) as u8).collect();
        let start = (4096 - store.as_ptr() as usize % 4096) % 4096;
        Aligned { store, start, len }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.store[self.start..self.start + self.len]
    }
}

/// One request of a measurement: (buffer, byte offset, write?). The in-process rows call a
/// `BlockDev`; `ucrypt bench integrity --vm` calls a block device of the guest (O_DIRECT), so
/// both make the same requests in the same order.
pub(crate) type Io<'a> = dyn FnMut(&mut [u8], u64, bool) -> Result<(), String> + 'a;

fn blockdev_io(dev: &dyn BlockDev) -> impl FnMut(&mut [u8], u64, bool) -> Result<(), String> + '_ {
    move |b, off, write| {
        if write {
            dev.write_at(b, off)
        } else {
            dev.read_at(b, off)
        }
        .map_err(|e| format!("{} at {off}: {e}", if write { "write" } else { "read" }))
    }
}

/// MiB/s of sequential `BIG_BYTES` requests over the first `data` bytes.
pub(crate) fn sequential(
    io: &mut Io,
    data: u64,
    write: bool,
    buf: &mut Aligned,
) -> Result<f64, String> {
    let b = buf.get();
    let t0 = Instant::now();
    let mut off = 0;
    while off + BIG_BYTES as u64 <= data {
        io(b, off, write)?;
        off += BIG_BYTES as u64;
    }
    Ok(off as f64 / (1 << 20) as f64 / t0.elapsed().as_secs_f64())
}

/// Mean µs per `SMALL_BYTES` request at random aligned offsets (a fixed xorshift sequence).
pub(crate) fn small(
    io: &mut Io,
    data: u64,
    write: bool,
    ops: usize,
    buf: &mut Aligned,
) -> Result<f64, String> {
    let b = &mut buf.get()[..SMALL_BYTES];
    let blocks = data / SMALL_BYTES as u64;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let t0 = Instant::now();
    for _ in 0..ops {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        io(b, (x % blocks) * SMALL_BYTES as u64, write)?;
    }
    Ok(t0.elapsed().as_secs_f64() * 1e6 / ops as f64)
}

/// The in-process rows on this host, then (with `vm`) the kernel column from the test VM.
pub fn measure(runs: usize, quick: bool, progress: bool, vm: bool) -> Result<Report, String> {
    let mut r = measure_here(runs, quick, progress)?;
    if vm {
        r.kernel_vm = vm::measure(runs, quick, progress)?;
        r.kernel = match &r.kernel_vm {
            KernelColumn::Skipped { reason } => format!("SKIPPED: {reason}"),
            KernelColumn::Measured(_) => "measured in the test VM (ratios): kernel_vm".into(),
        };
    }
    Ok(r)
}

fn measure_here(runs: usize, quick: bool, progress: bool) -> Result<Report, String> {
    let data = if quick { DATA_BYTES_QUICK } else { DATA_BYTES };
    let ops = if quick { SMALL_OPS_QUICK } else { SMALL_OPS };
    let mut configs = vec![
        plain_xts(data, Policy::Auto)?,
        plain_xts(data, Policy::Inline)?,
    ];
    // Each mode with the default policy (`auto`: large requests split across cores), then
    // `inline` (the caller's thread only); aes-gcm-random once more through the journal.
    for (name, mode) in MODES {
        configs.push(authenticated(
            name,
            mode,
            data,
            Policy::Auto,
            WriteMode::Direct,
        )?);
    }
    for (name, mode) in MODES {
        let name = format!("{name} (policy inline)");
        configs.push(authenticated(
            &name,
            mode,
            data,
            Policy::Inline,
            WriteMode::Direct,
        )?);
    }
    let (name, mode) = MODES[0];
    let name = format!("{name} (journal)");
    configs.push(authenticated(
        &name,
        mode,
        data,
        Policy::Auto,
        WriteMode::Journal,
    )?);
    let mut buf = Aligned::new(BIG_BYTES);
    // Every block written once, so that reads verify real tags.
    for c in &configs {
        sequential(&mut blockdev_io(c.dev.as_ref()), data, true, &mut buf)?;
    }
    let mut samples = vec![[const { Vec::new() }; 4]; configs.len()];
    for round in 0..runs {
        if progress {
            eprintln!("ucrypt bench integrity: round {}/{runs}", round + 1);
        }
        for (i, c) in configs.iter().enumerate() {
            let io = &mut blockdev_io(c.dev.as_ref());
            samples[i][0].push(sequential(io, data, false, &mut buf)?);
            samples[i][1].push(sequential(io, data, true, &mut buf)?);
            samples[i][2].push(small(io, data, false, ops, &mut buf)?);
            samples[i][3].push(small(io, data, true, ops, &mut buf)?);
        }
    }
    let sums: Vec<[Summary; 4]> = samples
        .iter()
        .map(|s| [0, 1, 2, 3].map(|k| Summary::of(&s[k])))
        .collect();
    let base = sums[0];
    let rows = configs
        .iter()
        .zip(&sums)
        .map(|(c, s)| Row {
            name: c.name.clone(),
            read_mib_s: s[0],
            write_mib_s: s[1],
            read_4k_us: s[2],
            write_4k_us: s[3],
            read_ratio: s[0].median / base[0].median,
            write_ratio: s[1].median / base[1].median,
            read_4k_ratio: base[2].median / s[2].median,
            write_4k_ratio: base[3].median / s[3].median,
        })
        .collect();
    Ok(Report {
        machine: Machine::detect(),
        backing: "a /dev/shm file per volume (O_DIRECT), 4096-byte sectors".into(),
        data_bytes: data,
        runs,
        rows,
        kernel: format!("SKIPPED: {KERNEL_NOT_ASKED}"),
        kernel_vm: KernelColumn::Skipped {
            reason: KERNEL_NOT_ASKED.into(),
        },
        notes: vec![
            "integrity volumes: dm-integrity direct mode (no journal) unless the row says \
             journal; policy auto unless the row says inline (auto: requests above a \
             threshold calibrated at open split across cores when one is idle, as the \
             engine's default for plain XTS)"
                .into(),
        ],
    })
}

/// The main table's kernel cell of an in-process row: the kernel's 1 MiB read and write ratios
/// of the corresponding VM row (same mode, same dm-integrity mode).
fn kernel_cell(k: &KernelColumn, row: &str) -> String {
    let KernelColumn::Measured(vm) = k else {
        return "SKIPPED".into();
    };
    vm::vm_row_for(row)
        .and_then(|n| vm.rows.iter().find(|r| r.name == n))
        .map(|r| format!("{:.2}, {:.2}", r.kernel.ratios.read, r.kernel.ratios.write))
        .unwrap_or_else(|| "—".into())
}

pub fn markdown(r: &Report) -> String {
    let mut o = format!(
        "## ucrypt bench integrity\n\nMachine: {}. Backing: {}; {} MiB per volume; {} \
         round-robin runs, median (min–max).\n\n",
        r.machine.describe(),
        r.backing,
        r.data_bytes >> 20,
        r.runs
    );
    o += "| volume | 1 MiB read MiB/s | ratio | 1 MiB write MiB/s | ratio | 4 KiB QD1 read µs | ratio | 4 KiB QD1 write µs | ratio | kernel (VM): 1 MiB read, write ratio |\n";
    o += "|---|---|---|---|---|---|---|---|---|---|\n";
    for row in &r.rows {
        o += &format!(
            "| {} | {} | {:.2} | {} | {:.2} | {} | {:.2} | {} | {:.2} | {} |\n",
            row.name,
            row.read_mib_s.show(0),
            row.read_ratio,
            row.write_mib_s.show(0),
            row.write_ratio,
            row.read_4k_us.show(1),
            row.read_4k_ratio,
            row.write_4k_us.show(1),
            row.write_4k_ratio,
            kernel_cell(&r.kernel_vm, &row.name),
        );
    }
    o +=
        "\nRatios: to the plain XTS row, medians; for latencies plain / this (below 1 = slower).\n";
    o += &vm::markdown(&r.kernel_vm);
    for n in &r.notes {
        o += &format!("\nNote: {n}.\n");
    }
    o
}
