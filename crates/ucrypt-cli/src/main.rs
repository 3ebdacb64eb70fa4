//! `ucrypt`: cryptsetup-style verbs, front ends (NBD, FUSE, ublk) and benchmarks.
//!
//! Each verb family lives in its own module and contributes its variants to [`Cmd`].

mod bench;
mod nbd_server;

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
    /// Serve volumes to NBD clients (qemu, nbd-client, libnbd tools, fio).
    Serve(Box<nbd_server::ServeArgs>),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Bench(a) => bench::run(a),
        Cmd::Serve(a) => nbd_server::run_serve(*a),
    };
    std::process::exit(code);
}
