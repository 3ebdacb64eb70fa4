//! `ucrypt bench ...`: reproducible benchmark scenarios. Every scenario runs its
//! configurations side by side (round-robin) in one process, because this class of machine
//! changes its clock by up to 50 % over minutes: only ratios within one run are comparable.

mod all;
mod cipher;
mod cmd;
mod compare;
mod engine;
mod fio;
mod fuse;
mod nbd;
pub mod plot;
pub mod stats;

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Which,
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

#[derive(Subcommand)]
enum Which {
    /// Sector cipher throughput per spec, sector size and provider, beside memcpy.
    Cipher(Common),
    /// The volume engine: dispatch policies side by side with the raw backend.
    Engine(EngineArgs),
    /// The volume as a file over FUSE, with fio, beside qemu-storage-daemon's FUSE export.
    Fuse(Common),
    /// The NBD server with fio, beside qemu-storage-daemon's and nbdkit's LUKS exports.
    Nbd(Common),
    /// Every scenario in one run: a results folder with report.md, JSON and plots.
    All(all::AllArgs),
    /// Deltas between two `--json` results (OLD NEW) of any scenario or of `bench all`.
    Compare(compare::CompareArgs),
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
        Which::Cipher(c) => emit(
            "cipher",
            Ok(cipher::measure(c.runs(), c.quick, !c.json)),
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
        Which::Nbd(c) => emit(
            "nbd",
            nbd::measure(c.runs(), c.quick, !c.json),
            c.json,
            nbd::markdown,
        ),
        Which::Compare(a) => compare::run(&a),
        Which::All(a) => all::run(a),
    }
}
