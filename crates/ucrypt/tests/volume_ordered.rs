//! The `ordered` policy: backend writes and completions leave in submission order. A gate
//! backend holds the first request's backend write; a request submitted after it must not reach
//! the backend, nor complete, before it. Under `parallel` the later request overtakes (which
//! shows the test can tell the two apart).

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use ucrypt::backend::Backend;
use ucrypt::engine::Policy;
use ucrypt::BlockDev;

/// Blocks writes at `gate_at` until opened; logs the offset of every write that reaches it.
struct Gate {
    inner: Arc<dyn Backend>,
    gate_at: u64,
    open: Mutex<bool>,
    cv: Condvar,
    reached: AtomicBool,
    log: Mutex<Vec<u64>>,
}

impl Backend for Gate {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        if offset == self.gate_at {
            self.reached.store(true, Ordering::SeqCst);
            let mut o = self.open.lock().unwrap();
            while !*o {
                o = self.cv.wait(o).unwrap();
            }
        }
        self.log.lock().unwrap().push(offset);
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_bytes(&self) -> u32 {
        self.inner.logical_block_bytes()
    }
    fn describe(&self) -> String {
        "gate".into()
    }
}

/// Returns (backend write log, whether the second request completed while the first was held).
fn run(policy: Policy) -> (Vec<u64>, bool) {
    let data_offset = 8192u64;
    let slot: Mutex<Option<Arc<Gate>>> = Mutex::new(None);
    let wrap = |b: Arc<dyn Backend>| -> Arc<dyn Backend> {
        let g = Arc::new(Gate {
            inner: b,
            gate_at: data_offset,
            open: Mutex::new(false),
            cv: Condvar::new(),
            reached: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
        });
        *slot.lock().unwrap() = Some(g.clone());
        g
    };
    let r = rig_over(
        RigCfg {
            policy,
            data_offset,
            ..RigCfg::default()
        },
        Some(&wrap),
    );
    let gate = slot.lock().unwrap().take().unwrap();
    // First request: a 4 KiB write at volume offset 0, held at the backend.
    let v1 = r.vol.clone();
    let first = std::thread::spawn(move || v1.write_at(&[1u8; 4096], 0).unwrap());
    while !gate.reached.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
    // Second request, submitted after the first reached the backend.
    let v2 = r.vol.clone();
    let done2 = Arc::new(AtomicBool::new(false));
    let d2 = done2.clone();
    let second = std::thread::spawn(move || {
        v2.write_at(&[2u8; 4096], 1 << 20).unwrap();
        d2.store(true, Ordering::SeqCst);
    });
    // Give the second request ample time to overtake (up to 10 s if it is expected to, so that a
    // loaded machine does not fail the test; 200 ms if it must not).
    let patience = if policy == Policy::Ordered { 20 } else { 1000 };
    for _ in 0..patience {
        if done2.load(Ordering::SeqCst) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let overtook = done2.load(Ordering::SeqCst);
    *gate.open.lock().unwrap() = true;
    gate.cv.notify_all();
    first.join().unwrap();
    second.join().unwrap();
    let log = gate.log.lock().unwrap().clone();
    (log, overtook)
}

#[test]
fn ordered_writes_and_completions_keep_submission_order() {
    let (log, overtook) = run(Policy::Ordered);
    assert_eq!(
        log,
        vec![8192, 8192 + (1 << 20)],
        "ordered: backend write order"
    );
    assert!(!overtook, "ordered: the later request completed first");
}

#[test]
fn parallel_lets_later_requests_overtake() {
    let (log, overtook) = run(Policy::Parallel);
    assert_eq!(
        log,
        vec![8192 + (1 << 20), 8192],
        "parallel: backend write order"
    );
    assert!(overtook);
}
