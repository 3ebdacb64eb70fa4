//! The OSD dies mid-run: requests in flight and new ones fail with an I/O error within
//! `remote_timeout`, instead of hanging. Its own cluster, since the case kills it.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use ucrypt::backend::Backend;
use ucrypt::ErrorKind;
use ucrypt_rbd::RbdBackend;

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

fn io_fails(c: &Cluster) {
    let name = image_name("death");
    c.create_image(&name, "64M");
    let mut spec = c.spec(&name);
    spec.options.remote_timeout = REMOTE_TIMEOUT;
    let b = Arc::new(RbdBackend::open(&spec).unwrap());
    // Writers and readers at fresh offsets (so that no cache answers), until the first error.
    let killed = Arc::new(AtomicBool::new(false));
    let kill_time = Arc::new(Mutex::new(None::<Instant>));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (b, killed) = (Arc::clone(&b), Arc::clone(&killed));
            std::thread::spawn(move || {
                let mut n = 0u64;
                loop {
                    let off = ((n * THREADS as u64 + t as u64) * 65536) % (64 << 20);
                    let r = if t % 2 == 0 {
                        b.write_at(&[t as u8 + 1; 65536], off)
                            .and_then(|()| b.flush())
                    } else {
                        let mut buf = vec![0u8; 65536];
                        b.read_at(&mut buf, off).map(drop)
                    };
                    n += 1;
                    if let Err(e) = r {
                        return (Instant::now(), e, killed.load(Ordering::SeqCst), n);
                    }
                }
            })
        })
        .collect();
    // Let them run, then kill the OSD.
    std::thread::sleep(Duration::from_secs(2));
    let pid = c.osd_pid();
    killed.store(true, Ordering::SeqCst);
    *kill_time.lock().unwrap() = Some(Instant::now());
    let st = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill the OSD");
    let killed_at = kill_time.lock().unwrap().unwrap();
    println!("killed the OSD (pid {pid})");
    let limit = REMOTE_TIMEOUT + SLACK;
    let mut results = Vec::new();
    for (t, w) in workers.into_iter().enumerate() {
        let (at, e, after_kill, n) = within("an I/O thread", limit * 4, move || w.join().unwrap());
        println!(
            "thread {t}: {n} requests, failed {:.1} s after the kill: {e}",
            at.duration_since(killed_at).as_secs_f64()
        );
        results.push((at, e, after_kill));
    }
    for (t, (at, e, after_kill)) in results.into_iter().enumerate() {
        assert!(after_kill, "thread {t} failed before the kill: {e}");
        assert!(
            at.duration_since(killed_at) <= limit,
            "thread {t}: the error came {:?} after the kill (limit {limit:?})",
            at.duration_since(killed_at)
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
    // image's lock, each bounded by librados' op time-out: a few time-outs, not a hang.
    let t0 = Instant::now();
    within("closing the image", REMOTE_TIMEOUT * 6, move || drop(b));
    println!("closed in {:.1} s", t0.elapsed().as_secs_f64());
}
