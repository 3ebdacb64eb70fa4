//! `ucrypt`: cryptsetup-style verbs, front ends (NBD, FUSE, ublk) and benchmarks.
//!
//! Each verb family lives in its own module and contributes its variants to [`Cmd`].

mod bench;
mod mount;

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
    /// Serve a decrypted volume as one regular file over FUSE (for losetup, VMs, mkfs).
    Mount(mount::MountArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Bench(a) => bench::run(a),
        Cmd::Mount(a) => mount::run(a),
    };
    std::process::exit(code);
}
