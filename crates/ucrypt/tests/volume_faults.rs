//! Backend failures (EIO on read and write, short reads, ENOSPC, early end) reach exactly the
//! affected caller as clear errors; the volume stays usable; nothing is acknowledged that was
//! not written.

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::Arc;

use common::*;
use ucrypt::backend::{Backend, Fault, FaultBackend, FaultOp, FaultRule};
use ucrypt::engine::Policy;
use ucrypt::BlockDev;

const SIZE: u64 = 2 << 20;
const OFF: u64 = 8192; // data offset of the rig

fn faulty(policy: Policy) -> (Rig, Arc<FaultBackend>) {
    let slot: std::sync::Mutex<Option<Arc<FaultBackend>>> = Default::default();
    let wrap = |b: Arc<dyn Backend>| -> Arc<dyn Backend> {
        let f = Arc::new(FaultBackend::new(b));
        *slot.lock().unwrap() = Some(f.clone());
        f
    };
    let r = rig_over(
        RigCfg {
            policy,
            size: SIZE,
            data_offset: OFF,
            ..RigCfg::default()
        },
        Some(&wrap),
    );
    let f = slot.lock().unwrap().take().unwrap();
    (r, f)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed)
        .collect()
}

/// (name, rule, request is a write, expected errno (None = must succeed))
fn cases() -> Vec<(&'static str, FaultRule, bool, Option<i32>)> {
    // Faults hit the backend range of volume bytes 256 KiB .. 320 KiB.
    let hot = OFF + (256 << 10)..OFF + (320 << 10);
    vec![
        (
            "read EIO",
            FaultRule::always(FaultOp::Read, Fault::Eio).in_range(hot.clone()),
            false,
            Some(libc::EIO),
        ),
        (
            "read short",
            FaultRule::always(FaultOp::Read, Fault::ShortRead(100))
                .in_range(hot.clone())
                .times(3),
            false,
            None,
        ),
        (
            "read early end",
            FaultRule::always(FaultOp::Read, Fault::Eof).in_range(hot.clone()),
            false,
            Some(libc::EIO),
        ),
        (
            "write EIO",
            FaultRule::always(FaultOp::Write, Fault::Eio).in_range(hot.clone()),
            true,
            Some(libc::EIO),
        ),
        (
            "write ENOSPC",
            FaultRule::always(FaultOp::Write, Fault::Enospc).in_range(hot),
            true,
            Some(libc::ENOSPC),
        ),
    ]
}

#[test]
fn faults_reach_the_affected_caller_only() {
    for policy in Policy::ALL {
        for (name, rule, write, errno) in cases() {
            let ctx = format!("{policy} {name}");
            let (r, f) = faulty(policy);
            let v = &r.vol;
            let old = pattern(SIZE as usize, 1);
            v.write_at(&old, 0).unwrap();
            f.add_rule(rule.clone());
            // The affected request: 128 KiB at 224 KiB, overlapping the faulty range (big
            // enough to be split among workers), plus an unaligned small one inside it.
            let (off, len) = (224u64 << 10, 128usize << 10);
            let new = pattern(len, 2);
            let res = if write {
                v.write_at(&new, off)
            } else {
                let mut b = vec![0u8; len];
                let res = v.read_at(&mut b, off);
                if res.is_ok() {
                    assert!(
                        b[..] == old[off as usize..off as usize + len],
                        "{ctx}: wrong data"
                    );
                }
                res
            };
            match (errno, &res) {
                (None, Ok(())) => {}
                (Some(e), Err(err)) => {
                    assert_eq!(err.errno(), e, "{ctx}: {err}");
                    assert!(
                        err.to_string().contains("offset"),
                        "{ctx}: error names no offset: {err}"
                    );
                }
                _ => panic!("{ctx}: expected errno {errno:?}, got {res:?}"),
            }
            if write {
                // The second write fails the same way: the same caller sees the same error.
                assert!(v.write_at(&new[..4096], 256 << 10).is_err(), "{ctx}");
            }
            // Other callers are unaffected while the fault is active.
            let mut b = vec![0u8; 64 << 10];
            v.read_at(&mut b, 1 << 20)
                .unwrap_or_else(|e| panic!("{ctx}: unrelated read failed: {e}"));
            assert!(b[..] == old[1 << 20..(1 << 20) + (64 << 10)], "{ctx}");
            v.write_at(&pattern(4096, 3), 1536 << 10)
                .unwrap_or_else(|e| panic!("{ctx}: unrelated write failed: {e}"));
            // After the fault clears, the volume works everywhere.
            f.clear_rules();
            let mut all = vec![0u8; SIZE as usize];
            v.read_at(&mut all, 0).unwrap();
            if write {
                // Nothing acknowledged was lost; a failed write left each sector old or new.
                for (i, sec) in all.chunks(4096).enumerate() {
                    let o = i * 4096;
                    let is_old = sec == &old[o..o + 4096];
                    let inside = o >= off as usize && o < off as usize + len;
                    let is_new = inside && sec == &new[o - off as usize..o - off as usize + 4096];
                    let is_third = o == 1536 << 10 && sec == &pattern(4096, 3)[..];
                    assert!(
                        is_old || is_new || is_third,
                        "{ctx}: sector {i} is neither old nor new"
                    );
                    if res.is_ok() && inside {
                        assert!(is_new, "{ctx}: acknowledged write lost at sector {i}");
                    }
                }
            }
            v.write_at(&old, 0).unwrap();
            v.flush().unwrap();
        }
    }
}

#[test]
fn concurrent_callers_only_the_faulty_one_fails() {
    for policy in Policy::ALL {
        let (r, f) = faulty(policy);
        r.vol.write_at(&pattern(SIZE as usize, 5), 0).unwrap();
        f.add_rule(FaultRule::always(FaultOp::Read, Fault::Eio).in_range(OFF..OFF + 4096));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let v = r.vol.clone();
                std::thread::spawn(move || {
                    let mut b = vec![0u8; 64 << 10];
                    let mut fails = 0;
                    for _ in 0..50 {
                        // Thread 0 reads the faulty first sector; the others read elsewhere.
                        let off = if t == 0 { 0 } else { t << 18 };
                        if v.read_at(&mut b, off).is_err() {
                            fails += 1;
                        }
                    }
                    fails
                })
            })
            .collect();
        let fails: Vec<u32> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(fails, vec![50, 0, 0, 0], "{policy}");
        f.clear_rules();
        let mut b = vec![0u8; 4096];
        r.vol.read_at(&mut b, 0).unwrap();
    }
}

#[test]
fn flush_and_discard_errors_are_reported() {
    let (r, f) = faulty(Policy::Inline);
    f.add_rule(FaultRule::always(FaultOp::Flush, Fault::Eio).times(1));
    assert_eq!(r.vol.flush().unwrap_err().errno(), libc::EIO);
    r.vol.flush().unwrap();
    f.add_rule(FaultRule::always(FaultOp::Discard, Fault::Eio).times(1));
    assert_eq!(r.vol.discard(0, 8192).unwrap_err().errno(), libc::EIO);
    r.vol.discard(0, 8192).unwrap();
}

#[test]
fn nth_write_fails_alone() {
    for policy in Policy::ALL {
        let (r, f) = faulty(policy);
        f.add_rule(FaultRule::always(FaultOp::Write, Fault::Eio).nth(2));
        let res: Vec<bool> = (0..3u64)
            .map(|i| r.vol.write_at(&pattern(4096, i as u8), i * 4096).is_ok())
            .collect();
        assert_eq!(res, vec![true, false, true], "{policy}");
        let mut b = vec![0u8; 4096];
        r.vol.read_at(&mut b, 8192).unwrap();
        assert!(b == pattern(4096, 2), "{policy}");
    }
}
