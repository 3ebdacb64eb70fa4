//! A backend wrapper that injects failures by rule, for tests: EIO on reads or writes, short
//! reads, ENOSPC, chosen by operation, byte range and call number.

use std::io;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::Backend;
use crate::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The call fails with EIO and does nothing.
    Eio,
    /// The call fails with ENOSPC and does nothing.
    Enospc,
    /// A read returns only this many bytes (a short read; the caller must retry the rest).
    ShortRead(usize),
    /// A read returns 0 bytes, as at the end of the device.
    Eof,
}

/// When a fault fires: on calls of `op` overlapping `range` (all if None), on the `nth`
/// matching call (1-based; every matching call if None), at most `times` times.
#[derive(Debug, Clone)]
pub struct FaultRule {
    pub op: FaultOp,
    pub range: Option<Range<u64>>,
    pub nth: Option<u64>,
    pub times: u64,
    pub fault: Fault,
}

impl FaultRule {
    /// Every call of `op` fails with `fault`, without limit.
    pub fn always(op: FaultOp, fault: Fault) -> Self {
        FaultRule {
            op,
            range: None,
            nth: None,
            times: u64::MAX,
            fault,
        }
    }

    pub fn in_range(mut self, range: Range<u64>) -> Self {
        self.range = Some(range);
        self
    }

    pub fn nth(mut self, nth: u64) -> Self {
        self.nth = Some(nth);
        self
    }

    pub fn times(mut self, times: u64) -> Self {
        self.times = times;
        self
    }
}

struct Rule {
    rule: FaultRule,
    matched: u64,
    fired: u64,
}

pub struct FaultBackend {
    inner: Arc<dyn Backend>,
    rules: Mutex<Vec<Rule>>,
    fired_total: std::sync::atomic::AtomicU64,
}

impl FaultBackend {
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        FaultBackend {
            inner,
            rules: Mutex::new(Vec::new()),
            fired_total: Default::default(),
        }
    }

    pub fn add_rule(&self, rule: FaultRule) {
        self.lock().push(Rule {
            rule,
            matched: 0,
            fired: 0,
        });
    }

    pub fn clear_rules(&self) {
        self.lock().clear();
    }

    /// How many faults have fired so far.
    pub fn fired(&self) -> u64 {
        self.fired_total.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Rule>> {
        // A test thread that panicked while holding the lock left the rules intact.
        self.rules.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(&self, op: FaultOp, offset: u64, len: u64) -> Option<Fault> {
        let mut rules = self.lock();
        for r in rules.iter_mut() {
            if r.rule.op != op || r.fired >= r.rule.times {
                continue;
            }
            if let Some(range) = &r.rule.range {
                if !(offset < range.end && range.start < offset + len.max(1)) {
                    continue;
                }
            }
            r.matched += 1;
            if r.rule.nth.is_some_and(|n| n != r.matched) {
                continue;
            }
            r.fired += 1;
            self.fired_total
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Some(r.rule.fault);
        }
        None
    }
}

fn injected(what: &str, offset: u64, errno: i32) -> Error {
    Error::io(
        format!("injected fault: {what} at offset {offset}"),
        io::Error::from_raw_os_error(errno),
    )
}

impl Backend for FaultBackend {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        match self.check(FaultOp::Read, offset, buf.len() as u64) {
            None => self.inner.read_at(buf, offset),
            Some(Fault::Eio) => Err(injected("read", offset, libc::EIO)),
            Some(Fault::Enospc) => Err(injected("read", offset, libc::ENOSPC)),
            Some(Fault::Eof) => Ok(0),
            Some(Fault::ShortRead(n)) => {
                let n = n.min(buf.len());
                self.inner.read_at(&mut buf[..n], offset)
            }
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        match self.check(FaultOp::Write, offset, buf.len() as u64) {
            None | Some(Fault::ShortRead(_)) | Some(Fault::Eof) => self.inner.write_at(buf, offset),
            Some(Fault::Eio) => Err(injected("write", offset, libc::EIO)),
            Some(Fault::Enospc) => Err(injected("write", offset, libc::ENOSPC)),
        }
    }

    fn flush(&self) -> Result<()> {
        match self.check(FaultOp::Flush, 0, 0) {
            Some(Fault::Eio) => Err(injected("flush", 0, libc::EIO)),
            Some(Fault::Enospc) => Err(injected("flush", 0, libc::ENOSPC)),
            _ => self.inner.flush(),
        }
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        match self.check(FaultOp::Discard, offset, len) {
            Some(Fault::Eio) => Err(injected("discard", offset, libc::EIO)),
            Some(Fault::Enospc) => Err(injected("discard", offset, libc::ENOSPC)),
            _ => self.inner.discard(offset, len),
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        match self.check(FaultOp::WriteZeroes, offset, len) {
            Some(Fault::Eio) => Err(injected("write-zeroes", offset, libc::EIO)),
            Some(Fault::Enospc) => Err(injected("write-zeroes", offset, libc::ENOSPC)),
            _ => self.inner.write_zeroes(offset, len),
        }
    }

    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn logical_block_bytes(&self) -> u32 {
        self.inner.logical_block_bytes()
    }

    fn mem_align_bytes(&self) -> usize {
        self.inner.mem_align_bytes()
    }

    fn describe(&self) -> String {
        format!("faults over {}", self.inner.describe())
    }

    fn serializes_writes(&self) -> bool {
        self.inner.serializes_writes()
    }
}
