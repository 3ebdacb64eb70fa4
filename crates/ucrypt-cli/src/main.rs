//! `ucrypt`: cryptsetup-style verbs, front ends (NBD, FUSE, ublk) and benchmarks.
//!
//! Each verb family lives in its own module and contributes its variants to [`Cmd`].

mod bench;
mod mount;
mod raw;
mod ublk;

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
    /// Serve a decrypted volume as a Linux block device /dev/ublkbN (needs ublk_drv).
    Ublk(ublk::UblkArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Bench(a) => bench::run(a),
        Cmd::Mount(a) => mount::run(a),
        Cmd::Ublk(a) => ublk::run(a),
    };
    std::process::exit(code);
}
