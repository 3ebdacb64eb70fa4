//! CPU time a server process spent, from /proc (user + system, all its threads, including
//! those that exited): what each throughput row cost the host, so speed bought with the CPU
//! of other tenants shows.

use std::time::Instant;

/// user + system seconds of process `pid` so far, or None when /proc does not say.
pub fn process_cpu_s(pid: libc::pid_t) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the state field.
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

/// A server's CPU use over one measured run.
pub struct CpuWatch {
    pid: libc::pid_t,
    cpu0: Option<f64>,
    t0: Instant,
}

impl CpuWatch {
    pub fn start(pid: libc::pid_t) -> Self {
        CpuWatch {
            pid,
            cpu0: process_cpu_s(pid),
            t0: Instant::now(),
        }
    }

    /// (CPU seconds per wall second, i.e. cores kept busy; µs of CPU per request at `iops`,
    /// assuming the warm-up ran at the measured rate). NaN where /proc did not say.
    pub fn stop(&self, iops: f64) -> (f64, f64) {
        let wall = self.t0.elapsed().as_secs_f64();
        match (self.cpu0, process_cpu_s(self.pid)) {
            (Some(a), Some(b)) if wall > 0.0 => {
                let cores = (b - a) / wall;
                let per_req = if iops > 0.0 {
                    cores / iops * 1e6
                } else {
                    f64::NAN
                };
                (cores, per_req)
            }
            _ => (f64::NAN, f64::NAN),
        }
    }
}
