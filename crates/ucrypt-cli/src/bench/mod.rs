//! `ucrypt bench ...`: reproducible benchmark scenarios.

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Which,
}

#[derive(Subcommand)]
enum Which {
    /// Sector cipher throughput per spec, sector size and provider, beside memcpy.
    Cipher,
}

pub fn run(a: BenchArgs) -> i32 {
    match a.which {
        Which::Cipher => 0,
    }
}
