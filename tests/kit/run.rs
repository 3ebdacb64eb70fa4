//! Running a program and showing what it said; stopping and killing one.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A path as the `&str` a command line takes (the tests' paths are UTF-8).
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Runs `prog ARGS` with no stdin and collects its output.
pub fn run(prog: &str, args: &[&str]) -> Output {
    Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"))
}

/// Runs `prog ARGS` with `input` on stdin (a pipe, not a terminal) and collects its output.
pub fn run_in(prog: &str, args: &[&str], input: &[u8]) -> Output {
    use std::io::Write;
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"));
    let mut stdin = child.stdin.take().expect("stdin");
    // The program may exit without reading (a usage error): a broken pipe is its answer.
    let _ = stdin.write_all(input);
    drop(stdin);
    child.wait_with_output().expect("wait")
}

/// Exit code, stdout and stderr, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// What the program wrote to stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// What the program wrote to stdout.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs `prog ARGS`, which must succeed; returns its stdout.
pub fn ok(prog: &str, args: &[&str]) -> String {
    let o = run(prog, args);
    assert!(o.status.success(), "{prog} {args:?} failed: {}", text(&o));
    stdout(&o)
}

/// [`run_in`], which must succeed; returns its stdout.
pub fn ok_in(prog: &str, args: &[&str], input: &[u8]) -> String {
    let o = run_in(prog, args, input);
    assert!(o.status.success(), "{prog} {args:?} failed: {}", text(&o));
    stdout(&o)
}

/// Sends SIGTERM to `pid` (a server asked to stop cleanly).
pub fn terminate(pid: u32) {
    // SAFETY: kill has no memory-safety preconditions; an ended process makes it fail with
    // ESRCH, which is no concern here.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
}

/// Waits at most `limit` for `child` to exit; its exit code, or None if it is still running
/// (or was ended by a signal).
pub fn wait_timeout(child: &mut Child, limit: Duration) -> Option<i32> {
    wait_timeout_doing(child, limit, || {})
}

/// [`wait_timeout`], calling `meanwhile` between looks (every 20 ms).
pub fn wait_timeout_doing(
    child: &mut Child,
    limit: Duration,
    mut meanwhile: impl FnMut(),
) -> Option<i32> {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return status.code();
        }
        if Instant::now() >= deadline {
            return None;
        }
        meanwhile();
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `cmd` with no stdin and its output discarded.
fn spawn_quiet(cmd: &mut Command) -> Child {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// How long a killed run may take to reach its kill point before it is killed anyway: a
/// bound for a condition that never comes, long enough for a loaded machine.
pub const KILL_WAIT_MAX: Duration = Duration::from_secs(60);

/// How [`kill_when`] watches for its condition.
#[derive(Debug, Clone, Copy)]
pub enum Poll {
    /// Check, then sleep this long: for a condition that lasts.
    Every(Duration),
    /// Check without a pause: for a window of a few writes.
    Spin,
}

/// Runs `cmd` (no stdin, output discarded) until `until` holds, the program ends or
/// [`KILL_WAIT_MAX`] passed; waits `delay` more, then SIGKILLs it, as a crash would. Returns
/// whether it was still running when killed.
pub fn kill_when(mut cmd: Command, until: impl Fn() -> bool, poll: Poll, delay: Duration) -> bool {
    let mut child = spawn_quiet(&mut cmd);
    let start = Instant::now();
    while !until() && child.try_wait().expect("wait").is_none() && start.elapsed() < KILL_WAIT_MAX {
        match poll {
            Poll::Every(p) => std::thread::sleep(p),
            Poll::Spin => std::hint::spin_loop(),
        }
    }
    std::thread::sleep(delay);
    let running = child.try_wait().expect("wait").is_none();
    let _ = child.kill();
    let _ = child.wait();
    running
}

/// [`kill_when`] `delay` after the start.
pub fn kill_after(cmd: Command, delay: Duration) -> bool {
    kill_when(cmd, || true, Poll::Spin, delay)
}

/// Runs `cmd` (no stdin, output discarded) in steps: it runs for `step`, is stopped
/// (SIGSTOP, waited for), and `until` is checked while it cannot write. Once `until` has held,
/// it runs `steps_after` more steps and is SIGKILLed while stopped, as a crash would end it.
/// Unlike [`kill_when`], a loaded machine cannot let the program run past the condition
/// unseen: each step gives it at most `step` of wall-clock time. Returns whether it was still
/// running when killed (false: it ended first, or [`KILL_WAIT_MAX`] passed unseen).
pub fn kill_stepped(
    mut cmd: Command,
    until: impl Fn() -> bool,
    step: Duration,
    steps_after: u32,
) -> bool {
    let mut child = spawn_quiet(&mut cmd);
    let pid = child.id() as libc::pid_t;
    let signal = |sig| {
        // SAFETY: kill has no memory-safety preconditions; `pid` is our unreaped child, so
        // the number names no other process.
        unsafe { libc::kill(pid, sig) };
    };
    // Waits until the child stops or ends; true if it ended (then it is reaped here).
    let ended = || {
        let mut status = 0;
        // SAFETY: `status` is a valid out-pointer for the call's duration; `pid` is our child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
        r == pid && !libc::WIFSTOPPED(status)
    };
    let start = Instant::now();
    let mut left: Option<u32> = None;
    loop {
        std::thread::sleep(step);
        signal(libc::SIGSTOP);
        if ended() {
            // Reaped by waitpid above: this wait finds nothing (ECHILD), and no kill may
            // follow, since the pid is free for reuse.
            let _ = child.wait();
            return false;
        }
        if left.is_none() && until() {
            left = Some(steps_after);
        }
        match left {
            Some(0) => break,
            Some(n) => left = Some(n - 1),
            None if start.elapsed() >= KILL_WAIT_MAX => break,
            None => {}
        }
        signal(libc::SIGCONT);
    }
    let _ = child.kill();
    let _ = child.wait();
    left.is_some()
}
