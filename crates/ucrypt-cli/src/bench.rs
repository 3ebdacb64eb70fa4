//! `ucrypt bench ...`: runs the benchmark suite, the `ucrypt-bench` binary installed beside this
//! one, with the same arguments. The suite lives in its own crate so that its counting
//! allocator and plot libraries are never part of the `ucrypt` binary that serves volumes.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use clap::Args;

/// The benchmark binary's name; it sits in the same directory as `ucrypt`.
const BENCH_BIN: &str = "ucrypt-bench";

#[derive(Args)]
#[command(disable_help_flag = true)]
pub struct BenchArgs {
    /// Arguments for ucrypt-bench: cipher | engine | fuse | nbd | integrity | formats | reencrypt | remote | scale | all | compare [options]
    /// (`ucrypt bench --help` lists them).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

fn bench_binary() -> Option<PathBuf> {
    let dir = std::env::current_exe().ok()?.parent()?.to_path_buf();
    let p = dir.join(BENCH_BIN);
    p.is_file().then_some(p)
}

pub fn run(a: BenchArgs) -> i32 {
    let Some(bin) = bench_binary() else {
        eprintln!(
            "ucrypt bench: {BENCH_BIN} is not installed beside ucrypt; build it with \
             `cargo build --release -p ucrypt-bench` (target/release/) or install it with \
             `cargo install --path crates/ucrypt-bench`"
        );
        return 1;
    };
    // Replaces this process: signals, exit code and output are the benchmark's own.
    let e = std::process::Command::new(&bin).args(&a.args).exec();
    eprintln!("ucrypt bench: running {}: {e}", bin.display());
    1
}
