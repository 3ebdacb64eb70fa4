//! `ucrypt`: cryptsetup-style verbs, front ends (NBD, FUSE, ublk) and benchmarks.
//!
//! Each verb family lives in its own module and contributes its variants to [`Cmd`].

mod bench;
mod luks_cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ucrypt",
    version,
    about = "Userspace dm-crypt and LUKS2 compatible disk encryption"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmarks: cipher, engine, nbd, fuse, all.
    Bench(bench::BenchArgs),
    /// LUKS verbs (cryptsetup spellings accepted as aliases).
    #[command(flatten)]
    Luks(Box<luks_cli::LuksCmd>),
}

fn main() {
    let cli = Cli::parse_from(luks_cli::reorder_args(std::env::args().collect()));
    let code = match cli.cmd {
        Cmd::Bench(a) => bench::run(a),
        Cmd::Luks(c) => luks_cli::run(*c),
    };
    std::process::exit(code);
}
