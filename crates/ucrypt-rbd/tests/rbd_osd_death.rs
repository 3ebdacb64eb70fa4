//! The OSD dies mid-run: requests in flight and new ones fail with an I/O error within
//! `remote_timeout`, instead of hanging. Its own cluster, since the case kills it.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ucrypt::backend::Backend;
use ucrypt::ErrorKind;
use ucrypt_rbd::{RbdBackend, CLOSE_WAIT_DEADLINES};

/// Short, so the test is quick; the default is 30 s.
const REMOTE_TIMEOUT: Duration = Duration::from_secs(5);
/// Slack over the timeout for a failing request to come back: librados checks its timers
/// about once a second, and the machine may be busy.
const SLACK: Duration = Duration::from_secs(5);
const THREADS: usize = 4;

#[test]
fn osd_killed_mid_run() {
    run_cases("osd-death", &[("io_fails_within_remote_timeout", io_fails)]);
}

/// One request a worker made after the kill was decided: what, when it began and ended, and
/// whether it succeeded.
struct Step {
    what: &'static str,
    began: Instant,
    ended: Instant,
    ok: bool,
}

/// How a worker thread ended: its first error, when, and the requests it made after the kill.
struct Ended {
    at: Instant,
    error: ucrypt::Error,
    after_kill: bool,
    requests: u64,
    steps: Vec<Step>,
}

/// Margin after `kill` returned for the OSD's sockets to close: a request begun later cannot
/// have reached the OSD.
const DEAD_MARGIN: Duration = Duration::from_millis(100);

fn io_fails(c: &Cluster) {
    let name = image_name("death");
    c.create_image(&name, "64M");
    let mut spec = c.spec(&name);
    spec.options.remote_timeout = REMOTE_TIMEOUT;
    let b = Arc::new(RbdBackend::open(&spec).unwrap());
    // Writers (write, then flush) and readers at fresh offsets (so that no cache answers), each
    // until its first error; every thread flushes on its own, as the engine's workers do.
    let killed = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (b, killed) = (Arc::clone(&b), Arc::clone(&killed));
            std::thread::spawn(move || {
                let mut steps = Vec::new();
                let mut step = |what: &'static str, began: Instant, r: ucrypt::Result<()>| {
                    if killed.load(Ordering::SeqCst) {
                        let (ended, ok) = (Instant::now(), r.is_ok());
                        steps.push(Step {
                            what,
                            began,
                            ended,
                            ok,
                        });
                    }
                    r
                };
                let mut n = 0u64;
                loop {
                    let off = ((n * THREADS as u64 + t as u64) * 65536) % (64 << 20);
                    let r = if t % 2 == 0 {
                        let t0 = Instant::now();
                        step("write", t0, b.write_at(&[t as u8 + 1; 65536], off)).and_then(|()| {
                            let t1 = Instant::now();
                            step("flush", t1, b.flush())
                        })
                    } else {
                        let mut buf = vec![0u8; 65536];
                        let t0 = Instant::now();
                        step("read", t0, b.read_at(&mut buf, off).map(drop))
                    };
                    n += 1;
                    if let Err(error) = r {
                        let after_kill = killed.load(Ordering::SeqCst);
                        return Ended {
                            at: Instant::now(),
                            error,
                            after_kill,
                            requests: n,
                            steps,
                        };
                    }
                }
            })
        })
        .collect();
    // Let them run, then kill the OSD.
    std::thread::sleep(Duration::from_secs(2));
    let pid = c.osd_pid();
    killed.store(true, Ordering::SeqCst);
    let killed_at = Instant::now();
    let st = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill the OSD");
    let dead_at = Instant::now() + DEAD_MARGIN;
    println!("killed the OSD (pid {pid})");
    let limit = REMOTE_TIMEOUT + SLACK;
    let since = |i: Instant| i.saturating_duration_since(killed_at).as_secs_f64();
    let mut ends = Vec::new();
    for (t, w) in workers.into_iter().enumerate() {
        let end = within("an I/O thread", limit * 4, move || w.join().unwrap());
        println!(
            "thread {t}: {} requests, failed {:.1} s after the kill: {}",
            end.requests,
            since(end.at),
            end.error
        );
        for s in end.steps.iter().rev().take(8).rev() {
            let ok = if s.ok { "ok" } else { "failed" };
            println!(
                "  {} {:.2}..{:.2} s {ok}",
                s.what,
                since(s.began),
                since(s.ended)
            );
        }
        ends.push(end);
    }
    for (t, end) in ends.iter().enumerate() {
        let e = &end.error;
        assert!(end.after_kill, "thread {t} failed before the kill: {e}");
        // Nothing acknowledged is lost: no flush succeeds after a write that began once the
        // OSD was dead (that write cannot be on it).
        for w in end.steps.windows(2) {
            assert!(
                !(w[0].what == "write" && w[0].began > dead_at && w[1].what == "flush" && w[1].ok),
                "thread {t}: a write begun {:.2} s after the kill was acknowledged by a flush",
                since(w[0].began)
            );
        }
        // No request waits past its deadline (plus librados's slack), the failing one
        // included. A request begun before the OSD was seen dead may still succeed (a flush
        // of writes the OSD had: seen once, a flush begun at the kill came back ok 5.0 s
        // later, and the write after it failed 10.00006 s after the kill, on time for its
        // own start); so the thread's error comes within two deadlines of the kill.
        for s in &end.steps {
            assert!(
                s.ended.duration_since(s.began) <= limit,
                "thread {t}: a {} took {:?} (limit {limit:?})",
                s.what,
                s.ended.duration_since(s.began)
            );
        }
        assert!(
            end.at.duration_since(killed_at) <= 2 * limit,
            "thread {t}: the error came {:?} after the kill (limit {:?})",
            end.at.duration_since(killed_at),
            2 * limit
        );
        assert_eq!(e.kind(), ErrorKind::Device, "{e}");
        assert!(e.to_string().contains(&name), "{e}");
    }
    // A new read fails in time too; a new write is refused at once, since a change given up
    // at its deadline may still land (the backend fences writes).
    let t0 = Instant::now();
    let b2 = Arc::clone(&b);
    let r = within("a read after the kill", limit * 2, move || {
        let mut buf = vec![0u8; 4096];
        b2.read_at(&mut buf, (64 << 20) - 4096).map(drop)
    });
    let e = r.expect_err("a read after the kill succeeded");
    assert!(t0.elapsed() <= limit, "took {:?}: {e}", t0.elapsed());
    let t0 = Instant::now();
    let e = b
        .write_at(&[7u8; 4096], 1 << 20)
        .expect_err("a write after the kill");
    assert!(e.to_string().contains("refused"), "{e}");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "took {:?}",
        t0.elapsed()
    );
    // Closing waits for librbd to finish the given-up requests and to try to release the
    // image's lock, at most CLOSE_WAIT_DEADLINES time-outs; then it is left to librbd.
    let t0 = Instant::now();
    let wait = REMOTE_TIMEOUT * (CLOSE_WAIT_DEADLINES + 1);
    within("closing the image", wait, move || drop(b));
    println!("closed in {:.1} s", t0.elapsed().as_secs_f64());
}
