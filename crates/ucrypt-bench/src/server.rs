//! A server process a benchmark runs (ucrypt or a peer): started with its output in a log,
//! waited for until its unix socket accepts, killed with the benchmark (PR_SET_PDEATHSIG), and
//! stopped on drop (SIGTERM, then SIGKILL if it lingers), so that none outlives a run however
//! it ends.

use std::fs::File;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to exit after SIGTERM before it is killed.
const EXIT_WAIT: Duration = Duration::from_secs(5);

pub struct Server {
    child: Child,
}

impl Server {
    /// Starts `cmd` (stdout and stderr to `log`) and waits up to `ready_wait` until `sock`
    /// accepts connections; `name` is for messages.
    pub fn start(
        mut cmd: Command,
        sock: &Path,
        log: &Path,
        name: &str,
        ready_wait: Duration,
    ) -> Result<Server, String> {
        let mut s = Server {
            child: spawn_logged(&mut cmd, log, name)?,
        };
        let t0 = Instant::now();
        while t0.elapsed() < ready_wait {
            if let Ok(Some(st)) = s.child.try_wait() {
                let log = std::fs::read_to_string(log).unwrap_or_default();
                return Err(format!(
                    "{name} exited ({st}) before serving: {}",
                    log.trim()
                ));
            }
            if UnixStream::connect(sock).is_ok() {
                return Ok(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!("{name} did not listen within {ready_wait:?}"))
    }

    pub fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }
}

/// Spawns `cmd` with no stdin and its stdout and stderr to `log`, killed when the benchmark
/// dies (PR_SET_PDEATHSIG); `name` is for messages.
pub fn spawn_logged(cmd: &mut Command, log: &Path, name: &str) -> Result<Child, String> {
    let out = File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent; it runs in the
    // child between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().map_err(|e| format!("{name}: {e}"))
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid, reserved until we reap it below.
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < EXIT_WAIT {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
