//! `--memory-budget SIZE` of `open`, `serve`, `mount`, `ublk` and `vhost`: one option, parsed the same
//! for all, and one way to take a share of the budget, so that the volumes of a user's `open`
//! daemons and of its standalone servers charge the same accounting file
//! ([`MEMORY_BUDGET_FILE`] in the state directory; how it is shared: `ucrypt::pool::budget`).

use std::sync::Arc;

use clap::Args;

use super::proto::MemoryBudgetReport;
use super::state::RunDir;
use crate::error::CliResult;

/// The shared accounting of `--memory-budget` in the state directory (`pool::budget`).
pub const MEMORY_BUDGET_FILE: &str = "memory-budget";

#[derive(Args, Clone, Debug, Default)]
pub struct MemoryBudgetArgs {
    /// One memory budget (SIZE: 64M, 1G, ...) for the bounce buffers of every volume of this
    /// user (root's: of root) served with one, whichever verb serves it (open, serve, mount,
    /// ublk, vhost): each grows its buffers beyond a 256 KiB reserve only while the total charged by
    /// all stays within SIZE, and otherwise waits for its own buffers (never fails). Without
    /// it, a volume's buffers are bounded by its own pool only.
    #[arg(long, value_name = "SIZE", value_parser = parse_budget)]
    pub memory_budget: Option<u64>,
}

/// `--memory-budget SIZE`: cryptsetup's size syntax, at least one buffer chunk.
fn parse_budget(s: &str) -> Result<u64, String> {
    let n = crate::volume_args::cryptsetup_size(s)?;
    if n < ucrypt::pool::LOCK_CHUNK_BYTES as u64 {
        return Err(format!(
            "a memory budget below {} bytes cannot hold one buffer chunk",
            ucrypt::pool::LOCK_CHUNK_BYTES
        ));
    }
    Ok(n)
}

/// Takes this process's share of the budget `limit_bytes` (none: nothing is done) in `run`'s
/// accounting file, creating the state directory if needed. Call it in the process that
/// serves the volumes, before their pools are made: pools made earlier charge nothing.
pub fn join(limit_bytes: Option<u64>, run: &RunDir) -> CliResult<()> {
    let Some(limit) = limit_bytes else {
        return Ok(());
    };
    run.create()?;
    let b = ucrypt::pool::budget::FileBudget::open(&run.dir(MEMORY_BUDGET_FILE), limit)?;
    ucrypt::pool::set_process_budget(Some(Arc::new(b)));
    Ok(())
}

/// [`join`] in this user's state directory: what the standalone servers (`serve`, `mount`,
/// `ublk`, `vhost`) call. Without a budget the state directory is not looked for.
pub fn join_own(a: &MemoryBudgetArgs) -> CliResult<()> {
    match a.memory_budget {
        Some(_) => join(a.memory_budget, &RunDir::locate()?),
        None => Ok(()),
    }
}

/// The process's budget for `status`: absent without one.
pub fn report() -> Option<MemoryBudgetReport> {
    ucrypt::pool::process_budget_usage().map(|u| MemoryBudgetReport {
        limit_bytes: u.limit_bytes,
        used_bytes: u.used_bytes,
        charged_bytes: u.charged_bytes,
        refused_charges: u.refused_charges,
        forced_charges: u.forced_charges,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_below_one_chunk_are_refused() {
        let chunk = ucrypt::pool::LOCK_CHUNK_BYTES as u64;
        assert_eq!(parse_budget("1M"), Ok(1 << 20));
        assert_eq!(parse_budget(&chunk.to_string()), Ok(chunk));
        assert!(parse_budget(&(chunk - 1).to_string()).is_err());
        assert!(parse_budget("lots").is_err());
    }
}
