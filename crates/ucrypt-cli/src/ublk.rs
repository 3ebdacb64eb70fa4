//! `ucrypt ublk VOLUME`: the decrypted volume as a Linux block device /dev/ublkbN. Prints the
//! device path on stdout when it is ready; removes the device on SIGINT/SIGTERM.
//!
//! Until LUKS opening and the engine's `Volume` are on main, only raw (plain dm-crypt) mode is
//! served (see [`crate::raw`]). `ucrypt_ublk::serve` takes any `Arc<dyn BlockDev>`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use ucrypt::Result;
use ucrypt_ublk::UblkOptions;

use crate::raw::RawArgs;

#[derive(Args, Debug)]
pub struct UblkArgs {
    /// The encrypted volume (file or block device).
    volume: PathBuf,
    #[command(flatten)]
    raw: RawArgs,
    /// Hardware queues (0 = one per CPU).
    #[arg(long, default_value_t = 0)]
    queues: usize,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = ucrypt_ublk::QUEUE_DEPTH_DEFAULT)]
    depth: u16,
}

pub fn run(a: UblkArgs) -> i32 {
    match serve(a) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ucrypt ublk: {e}");
            1
        }
    }
}

fn serve(a: UblkArgs) -> Result<()> {
    let dev = a.raw.open(&a.volume)?;
    ucrypt::secret::disable_core_dumps();
    let opts = UblkOptions {
        queues: a.queues,
        depth: a.depth,
    };
    ucrypt_ublk::serve(Arc::new(dev), &opts, |path| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{path}");
        let _ = out.flush();
    })?;
    eprintln!("ucrypt ublk: device removed, all writes flushed");
    Ok(())
}
