//! `ucrypt-bench` (run as `ucrypt bench ...`): reproducible benchmark scenarios. Every
//! scenario runs its configurations side by side (round-robin) in one process, because this
//! class of machine (virtual, power-managed) changes its clock over minutes: only ratios
//! within one run are comparable.
//!
//! A binary of its own, beside `ucrypt`: its counting allocator (allocations per I/O, see
//! `engine.rs`) and its plot libraries are never part of the binary that serves volumes. The
//! NBD, FUSE and vhost scenarios run that `ucrypt` binary ([`ucrypt_bin`]).

mod all;
mod cipher;
mod cmd;
mod compare;
mod cpu;
mod disk;
mod engine;
mod fio;
mod formats;
mod fuse;
mod integrity;
mod interrupt;
/// The test kit's VM harness (tests/kit/vm.rs), which `integrity --vm` and `vhost` boot.
#[path = "../../../tests/kit/mod.rs"]
mod kit;
mod limit;
mod man;
mod nbd;
pub mod plot;
mod reencrypt;
mod reencrypt_online;
mod remote;
mod scale;
mod server;
pub mod stats;
mod vhost;

use clap::{Args, Parser, Subcommand};

/// ucrypt's benchmarks (also run as `ucrypt bench ...`).
#[derive(Parser)]
#[command(name = "ucrypt bench", version)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Which,
}

/// The `ucrypt` binary the NBD and FUSE scenarios serve volumes with: the one installed beside
/// this benchmark (`UCRYPT_BIN` overrides it).
pub fn ucrypt_bin() -> Result<std::path::PathBuf, String> {
    if let Some(p) = std::env::var_os("UCRYPT_BIN") {
        return Ok(p.into());
    }
    let me = std::env::current_exe().map_err(|e| format!("locating ucrypt-bench: {e}"))?;
    let p = me.with_file_name("ucrypt");
    if p.is_file() {
        if let Some(src) = newer_source(&p) {
            return Err(format!(
                "{} is older than its source {}: a build of ucrypt-bench alone leaves it \
                 stale; build the whole workspace (cargo build --release), or set UCRYPT_BIN",
                p.display(),
                src.display()
            ));
        }
        Ok(p)
    } else {
        Err(format!(
            "{} not found: build the whole workspace (cargo build --release) so that ucrypt \
             sits beside ucrypt-bench, or set UCRYPT_BIN",
            p.display()
        ))
    }
}

/// A source file of the `ucrypt` binary (the library's or the CLI's, in the checkout this
/// bench was built from) changed after `bin` was built; `None` when it is up to date or the
/// sources are not there (an installed bench).
fn newer_source(bin: &std::path::Path) -> Option<std::path::PathBuf> {
    let built = std::fs::metadata(bin).and_then(|m| m.modified()).ok()?;
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent()?;
    let mut dirs = vec![crates.join("ucrypt/src"), crates.join("ucrypt-cli/src")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).ok()?.flatten() {
            let (path, meta) = (e.path(), e.metadata().ok()?);
            if meta.is_dir() {
                dirs.push(path);
            } else if meta.modified().is_ok_and(|m| m > built) {
                return Some(path);
            }
        }
    }
    None
}

fn main() {
    let args = BenchArgs::parse();
    std::process::exit(run(args));
}

#[derive(Args, Clone, Copy)]
pub struct Common {
    /// Print machine-readable JSON instead of a markdown table.
    #[arg(long)]
    json: bool,
    /// Fewer and shorter runs (a smoke run; numbers are noisier).
    #[arg(long)]
    quick: bool,
    /// Number of round-robin repetitions (default 7, or 3 with --quick).
    #[arg(long)]
    runs: Option<usize>,
}

impl Common {
    fn runs(&self) -> usize {
        self.runs.unwrap_or(if self.quick { 3 } else { 7 }).max(1)
    }
}

#[derive(Args, Clone)]
pub struct EngineArgs {
    #[command(flatten)]
    common: Common,
    /// Run only these scenarios (1-8, comma-separated; default all).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u8).range(1..=8))]
    only: Vec<u8>,
}

#[derive(Args)]
pub struct CipherArgs {
    #[command(flatten)]
    common: Common,
    /// Run only the rows whose spec contains one of these (comma-separated, e.g.
    /// serpent,adiantum; default all).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

#[derive(Args)]
pub struct ReencryptArgs {
    #[command(flatten)]
    common: Common,
    /// Rotate online (through the `ucrypt open` daemon) under fio, instead of offline beside
    /// cryptsetup.
    #[arg(long)]
    online: bool,
}

#[derive(Args)]
pub struct RemoteArgs {
    #[command(flatten)]
    common: Common,
    /// Only the NBD targets (nbdkit behind ucrypt's NBD client and its peers): no Ceph cluster.
    #[arg(long, conflicts_with = "rbd_only")]
    nbd_only: bool,
    /// Only the Ceph RBD targets.
    #[arg(long)]
    rbd_only: bool,
}

#[derive(Args)]
pub struct ScaleArgs {
    #[command(flatten)]
    common: Common,
    /// Numbers of volumes to open, one after the other (comma-separated, e.g. 1,10,100,1000);
    /// the reads run with the largest number open.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100",
          value_parser = clap::value_parser!(u32).range(1..=4000))]
    volumes: Vec<u32>,
}

#[derive(Args)]
pub struct IntegrityArgs {
    #[command(flatten)]
    common: Common,
    /// Also fill the kernel column: boot the test VM (tests/vm/, qemu, Debian trixie's kernel)
    /// and measure the kernel's dm-crypt + dm-integrity and `ucrypt ublk` on the same volumes
    /// there, as ratios to plain XTS on each side (minutes under emulation). SKIPPED, with the
    /// reason, where the VM cannot run.
    #[arg(long)]
    vm: bool,
}

#[derive(Args)]
pub struct ProbeArgs {
    /// The block device.
    dev: std::path::PathBuf,
    /// Bytes of the device the requests cover (from offset 0).
    #[arg(long)]
    bytes: u64,
    /// 4 KiB requests each way.
    #[arg(long)]
    ops: usize,
    /// Printed first on the result line.
    #[arg(long)]
    tag: String,
}

#[derive(Subcommand)]
enum Which {
    /// Sector cipher throughput per spec, sector size and provider, beside memcpy.
    Cipher(CipherArgs),
    /// The volume engine: dispatch policies side by side with the raw backend.
    Engine(EngineArgs),
    /// The volume as a file over FUSE, with fio, beside qemu-storage-daemon's FUSE export.
    Fuse(Common),
    /// The foreign formats (cryptsetup's BitLocker and VeraCrypt test images): BitLocker
    /// through `ucrypt mount` beside dislocker-fuse on the same image, AES-XTS BitLocker and
    /// VeraCrypt beside LUKS2, the Elephant diffuser beside XTS (fio over FUSE); and the
    /// VeraCrypt header-key search on every CPU beside one CPU and beside cryptsetup.
    Formats(Common),
    /// Authenticated volumes (LUKS2 with integrity) per mode beside a plain XTS volume:
    /// 1 MiB throughput and 4 KiB QD1 latency.
    Integrity(IntegrityArgs),
    /// (internal) Run inside the test VM by `integrity --vm`: the scenario's requests on a
    /// block device, one `@@PROBE` line.
    #[command(hide = true)]
    IntegrityVmProbe(ProbeArgs),
    /// The NBD server with fio, beside qemu-storage-daemon's and nbdkit's LUKS exports.
    Nbd(Common),
    /// Offline key rotation of a file volume: `ucrypt reencrypt` beside `cryptsetup reencrypt`
    /// per resilience, and beside `ucrypt export` + `import` of the same bytes; idle and busy.
    /// With --online: the rotation through the `ucrypt open` daemon while fio reads, against
    /// fio alone and the offline rotation (root, FUSE + loop).
    Reencrypt(ReencryptArgs),
    /// Many open volumes (as root): N volumes opened with `ucrypt open --front-end fuse`, a
    /// daemon each: time to open them all, their memory and threads, `ucrypt list` and
    /// `status` times; 4 KiB QD1 reads on 1, 10 and 100 at once against one; beside
    /// qemu-storage-daemon serving the same N exports from one process.
    Scale(ScaleArgs),
    /// A VM's disk over vhost-user-blk in one boot of the test VM (tests/vm/, qemu TCG): `ucrypt
    /// vhost` beside qemu-storage-daemon's vhost-user-blk export of the same LUKS1 image and of
    /// a plain file (the unencrypted ceiling), and `ucrypt serve` of the image behind qemu's NBD
    /// client; fio in the guest, each backend's CPU per request; the goals as targets. SKIPPED,
    /// with the reason, where qemu, qemu-storage-daemon, fio or cryptsetup is missing. Each
    /// round takes about 24 × (8 s + fio's start) under emulation (--quick: 4 s per job). A
    /// signal stops the VM and the servers and removes the images.
    Vhost(Common),
    /// ucrypt in front of Ceph RBD beside librbd's own LUKS2 and qemu's luks driver, on a
    /// throw-away single-node cluster (needs Ceph's packages: scripts/deps.sh test).
    Remote(RemoteArgs),
    /// Every scenario in one run: a results folder with report.md, JSON and plots.
    All(all::AllArgs),
    /// Deltas between two `--json` results (OLD NEW) of any scenario or of `bench all`.
    Compare(compare::CompareArgs),
    /// (internal) Write the man pages into DIR (the package script runs it).
    #[command(name = "generate-man", hide = true)]
    GenerateMan(man::GenerateArgs),
}

/// Prints a scenario's report as JSON or markdown; an error as `ucrypt bench NAME: ...`.
fn emit<T: serde::Serialize>(
    name: &str,
    report: Result<T, String>,
    json: bool,
    markdown: fn(&T) -> String,
) -> i32 {
    match report {
        Ok(r) if json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&r).expect("report serialises")
            );
            0
        }
        Ok(r) => {
            print!("{}", markdown(&r));
            0
        }
        Err(e) => {
            eprintln!("ucrypt bench {name}: {e}");
            1
        }
    }
}

pub fn run(a: BenchArgs) -> i32 {
    match a.which {
        Which::Cipher(CipherArgs { common: c, only }) => emit(
            "cipher",
            Ok(cipher::measure(c.runs(), c.quick, !c.json, &only)),
            c.json,
            cipher::markdown,
        ),
        Which::Engine(EngineArgs { common: c, only }) => emit(
            "engine",
            Ok(engine::measure(c.runs(), c.quick, !c.json, &only)),
            c.json,
            engine::markdown,
        ),
        Which::Fuse(c) => emit(
            "fuse",
            fuse::measure(c.runs(), c.quick, !c.json),
            c.json,
            fuse::markdown,
        ),
        Which::Formats(c) => emit(
            "formats",
            formats::measure(c.runs(), c.quick, !c.json),
            c.json,
            formats::markdown,
        ),
        Which::Integrity(IntegrityArgs { common: c, vm }) => emit(
            "integrity",
            integrity::measure(c.runs(), c.quick, !c.json || vm, vm),
            c.json,
            integrity::markdown,
        ),
        Which::IntegrityVmProbe(p) => match integrity::vm::probe(&p.dev, p.bytes, p.ops, &p.tag) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("ucrypt bench integrity-vm-probe: {e}");
                1
            }
        },
        Which::Nbd(c) => emit(
            "nbd",
            nbd::measure(c.runs(), c.quick, !c.json),
            c.json,
            nbd::markdown,
        ),
        Which::Reencrypt(ReencryptArgs { common: c, online }) if online => emit(
            "reencrypt --online",
            reencrypt_online::measure(c.runs(), c.quick, !c.json),
            c.json,
            reencrypt_online::markdown,
        ),
        Which::Reencrypt(ReencryptArgs { common: c, .. }) => emit(
            "reencrypt",
            reencrypt::measure(c.runs(), c.quick, !c.json),
            c.json,
            reencrypt::markdown,
        ),
        Which::Remote(RemoteArgs {
            common: c,
            nbd_only,
            rbd_only,
        }) => emit(
            "remote",
            remote::measure(
                c.runs(),
                c.quick,
                !c.json,
                remote::Part::of(nbd_only, rbd_only),
            ),
            c.json,
            remote::markdown,
        ),
        Which::Scale(ScaleArgs { common: c, volumes }) => emit(
            "scale",
            scale::measure(c.runs(), c.quick, !c.json, &volumes),
            c.json,
            scale::markdown,
        ),
        Which::Vhost(c) => emit(
            "vhost",
            vhost::measure(c.runs(), c.quick, !c.json),
            c.json,
            vhost::markdown,
        ),
        Which::Compare(a) => compare::run(&a),
        Which::All(a) => all::run(a),
        Which::GenerateMan(a) => man::run(&a),
    }
}
