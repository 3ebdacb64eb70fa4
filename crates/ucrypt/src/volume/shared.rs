//! Requests on memory another party shares (`BlockDev::read_shared`, `write_shared`): a VM's
//! buffers, which the guest can read and change while the request runs. A big request of whole
//! sectors goes through the caller's private scratch with no copy: a read's ciphertext is read
//! into the scratch and decrypted from there into the caller's buffer (the task's `out`), a
//! write is encrypted from the caller's buffer into the scratch and written from there. So the
//! caller's buffer only ever receives plaintext, and each byte of it is read once before
//! anything is computed from it. Other requests take `blockdev::read_through` /
//! `write_through`, a copy through the scratch.
//!
//! A buffer of several runs (`read_shared_runs`, `write_shared_runs`: a VM's scattered pages)
//! takes the same way when each run is a whole number of sectors: the task carries the runs
//! ([`Runs`]) and its crypto goes run by run ([`Core::crypt_runs`]) between the caller's runs
//! and the one scratch, so the backend still sees one request.

use std::sync::atomic::Ordering::Relaxed;

use super::{counted, Core, Kind, Op, Task, Times, Volume};
use crate::blockdev::{runs_len, SharedRun};
use crate::engine::task::{Runs, RUNS_BYTES_MAX};
use crate::sector::SectorCipher;
use crate::{Error, Result};

/// The caller's buffer of a shared request (see [`Core::through_scratch`]).
pub(super) enum Shared<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
    ReadRuns(&'a [SharedRun]),
    WriteRuns(&'a [SharedRun]),
}

impl Shared<'_> {
    fn write(&self) -> bool {
        matches!(self, Shared::Write(_) | Shared::WriteRuns(_))
    }
}

/// Shared reads and writes ([`BlockDev::read_shared`](crate::BlockDev::read_shared), [`BlockDev::write_shared`](crate::BlockDev::write_shared)) shorter
/// than this copy through the caller's scratch and take the direct path: for them a copy
/// costs less than planning and a pool grant.
pub const SHARED_COPY_BELOW_BYTES: u64 = 64 << 10;

impl Volume {
    /// Serves a shared request without a copy where [`Core::shared_scratch`] allows it;
    /// `None` where it does not (the caller then takes the default's way, outside the gate).
    pub(super) fn shared_io(
        &self,
        user: Shared<'_>,
        offset: u64,
        fua: bool,
        scratch: &mut [u8],
    ) -> Option<Result<()>> {
        let write = user.write();
        let kind = if write { Kind::Write } else { Kind::Read };
        let sector = 1usize << self.core.shift;
        let (len, whole) = match &user {
            Shared::Read(d) => (d.len(), true),
            Shared::Write(s) => (s.len(), true),
            Shared::ReadRuns(r) | Shared::WriteRuns(r) => {
                let len = runs_len(r);
                let fits = len <= RUNS_BYTES_MAX && r.len() <= RUNS_BYTES_MAX;
                (len, fits && r.iter().all(|r| r.len % sector == 0))
            }
        };
        if !whole {
            return None;
        }
        // Checked inside the gate: reencryption begins with it closed.
        let _in = match self.core.enter(kind) {
            Ok(pass) => pass,
            Err(e) => return Some(Err(e)),
        };
        let via = self.core.shared_scratch(len, offset, scratch, write)?;
        let r = self.core.through_scratch(user, via, offset, fua);
        Some(counted(&self.core, kind, r))
    }
}

impl Core {
    /// The crypto of a task whose caller's buffer is runs of shared memory: encrypts from them
    /// into `buf`, or decrypts `buf` into them, run by run with one cipher context.
    pub(super) fn crypt_runs(
        &self,
        own: Option<&mut SectorCipher>,
        task: &Task,
        buf: &mut [u8],
    ) -> Result<()> {
        let mut go = |c: &mut SectorCipher| {
            let mut at = 0usize;
            // SAFETY: the caller of the request waits for every task made from its runs.
            for (ptr, n) in unsafe { task.runs.pieces(buf.len()) } {
                // Each run is whole sectors and a task starts on a sector: so does each piece.
                let sector = task.sectors.first + (at as u64 >> self.shift);
                let b = &mut buf[at..at + n];
                if task.write {
                    // SAFETY: `SharedRun::new`'s contract: readable while the request runs.
                    // `encrypt_to` reads each byte once before computing from it.
                    let s = unsafe { std::slice::from_raw_parts(ptr, n) };
                    self.crypt(Some(&mut *c), true, sector, b, Some(s))?;
                } else {
                    // SAFETY: `SharedRun::new`'s contract: writable while the request runs;
                    // only finished plaintext is stored there, and never read back.
                    let o = unsafe { std::slice::from_raw_parts_mut(ptr, n) };
                    self.decrypt_out(Some(&mut *c), sector, b, o)?;
                }
                at += n;
            }
            if at == buf.len() {
                Ok(())
            } else {
                Err(Error::Bug("a task's runs are shorter than its sectors"))
            }
        };
        match own {
            Some(c) => go(c),
            None => self.ciphers.with(go),
        }
    }

    /// Decrypts `buf` into `out`, leaving `buf` as it was.
    pub(super) fn decrypt_out(
        &self,
        own: Option<&mut SectorCipher>,
        sector: u64,
        buf: &[u8],
        out: &mut [u8],
    ) -> Result<()> {
        if self.null_cipher() {
            out.copy_from_slice(buf);
            return Ok(());
        }
        let mut run = |c: &mut SectorCipher| c.decrypt_to(sector, buf, out);
        match own {
            Some(c) => run(c),
            None => self.ciphers.with(run),
        }
    }

    /// The part of `scratch` a shared request ([`BlockDev::read_shared`](crate::BlockDev::read_shared),
    /// [`BlockDev::write_shared`](crate::BlockDev::write_shared)) of `len` bytes at `offset` goes through, if it takes the
    /// way without a copy: [`SHARED_COPY_BELOW_BYTES`] or more, whole sectors, outside
    /// reencryption (whose segments plan their own pieces), a `scratch` the backend can do
    /// I/O from, and for a read a cipher that writes only plaintext into its output.
    fn shared_scratch<'a>(
        &self,
        len: usize,
        offset: u64,
        scratch: &'a mut [u8],
        write: bool,
    ) -> Option<&'a mut [u8]> {
        let mask = (1u64 << self.shift) - 1;
        let fits = len as u64 >= SHARED_COPY_BELOW_BYTES
            && (offset | len as u64) & mask == 0
            && !self.segmented.load(Relaxed)
            && (scratch.as_ptr() as usize) % self.mem_align == 0;
        if fits && (write || self.null_cipher() || self.out_of_place.load(Relaxed)) {
            scratch.get_mut(..len)
        } else {
            None
        }
    }

    /// A shared request through `via`, the caller's private memory of the same length: a read
    /// has its ciphertext read into `via` and decrypted from there into the caller's buffer; a
    /// write is encrypted from the caller's buffer into `via` and written from there. Planned
    /// and dispatched as any request of its size; the caller checked what `shared_scratch`
    /// checks.
    fn through_scratch(
        &self,
        mut user: Shared<'_>,
        via: &mut [u8],
        offset: u64,
        fua: bool,
    ) -> Result<()> {
        let mut t = Times::start();
        let len = via.len() as u64;
        let write = user.write();
        self.check(offset, len)?;
        if write {
            self.check_writable()?;
        }
        let op = if write { Op::Write } else { Op::Read };
        let (plan, _big) = self.plan(op, offset, len);
        let t0 = t.clock();
        let _lock = plan.lock.map(|r| self.locks.lock(r));
        t.wait += t.clock().wrapping_sub(t0);
        let mut r = Ok(());
        for piece in plan.pieces() {
            if !piece.aligned() {
                r = Err(Error::Bug(
                    "a shared request of whole sectors cut mid-sector",
                ));
                break;
            }
            let at = piece.buf_off;
            let (src, out, runs) = match &mut user {
                Shared::Write(s) => (s[at..].as_ptr(), std::ptr::null_mut(), Runs::NONE),
                Shared::Read(d) => (std::ptr::null(), d[at..].as_mut_ptr(), Runs::NONE),
                Shared::ReadRuns(r) | Shared::WriteRuns(r) => {
                    (std::ptr::null(), std::ptr::null_mut(), Runs::of(r, at))
                }
            };
            let task = Task {
                write,
                sectors: piece.sectors,
                buf: via[at..].as_mut_ptr(),
                src,
                out,
                io: true,
                fua,
                runs,
            };
            r = self.run(&plan, &piece, task, &mut t);
            if r.is_err() {
                break;
            }
        }
        let kind = if write { Kind::Write } else { Kind::Read };
        self.stats
            .record(kind, len, &t, plan.dispatch.splits(), false);
        r
    }
}
