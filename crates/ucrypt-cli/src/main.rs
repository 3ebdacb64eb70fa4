//! `ucrypt`: cryptsetup-style verbs, front ends (NBD, FUSE, ublk) and benchmarks.
//!
//! Each verb family lives in its own module and contributes its variants to [`Cmd`].

mod bench;
mod luks_cli;
mod mount;
mod nbd_server;
mod open;
mod signals;
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
    /// LUKS verbs (cryptsetup spellings accepted as aliases).
    #[command(flatten)]
    Luks(Box<luks_cli::LuksCmd>),
    /// Serve volumes to NBD clients (qemu, nbd-client, libnbd tools, fio).
    Serve(Box<nbd_server::ServeArgs>),
    /// Serve a volume as a ublk block device (/dev/ublkbN); needs Linux's ublk_drv.
    Ublk {
        #[command(flatten)]
        volume: open::VolumeArgs,
        /// Hardware queues (default: one per CPU).
        #[arg(long)]
        queues: Option<u16>,
    },
    /// Serve a decrypted volume as one regular file over FUSE (for losetup, VMs, mkfs).
    Mount(mount::MountArgs),
}

fn main() {
    // cryptsetup exits 1 on wrong parameters (clap's default, 2, means "bad passphrase" there).
    let cli = match Cli::try_parse_from(luks_cli::reorder_args(std::env::args().collect())) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            std::process::exit(if e.use_stderr() { 1 } else { 0 });
        }
    };
    let code = match cli.cmd {
        Cmd::Bench(a) => bench::run(a),
        Cmd::Luks(c) => luks_cli::run(*c),
        Cmd::Serve(a) => nbd_server::run_serve(*a),
        Cmd::Ublk { volume, queues } => {
            let mut opts = ublk::UblkOptions::default();
            if let Some(q) = queues {
                opts.queues = q;
            }
            let opened =
                signals::block_stop_signals().and_then(|sigs| volume.open().map(|dev| (dev, sigs)));
            match opened.and_then(|(dev, sigs)| ublk::run(dev, opts, sigs)) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("ucrypt ublk: {e}");
                    1
                }
            }
        }
        Cmd::Mount(a) => mount::run(a),
    };
    std::process::exit(code);
}
