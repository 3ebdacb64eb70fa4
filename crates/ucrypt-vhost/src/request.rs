//! One virtio-blk request: a descriptor chain in guest memory parsed, checked and served
//! against a [`BlockDev`].
//!
//! Guest memory is hostile and shared. Every descriptor is read once (the chain iterator
//! copies it), every guest range is checked against the memory map before the device is
//! touched, and data reaches the device as the guest's pages themselves, runs of shared memory
//! (`BlockDev::read_shared_runs`, `write_shared_runs`; on the queue's ring, `DirectRead` and
//! `DirectWrite`): the device encrypts or decrypts in memory of its own (the queue's private
//! bounce buffer, or the volume's pool), never in memory the guest can change while it
//! happens; guest memory is read once as plaintext to encrypt, or receives finished
//! plaintext. Whatever the chain holds, the request ends with a status (`OK`, `IOERR` or
//! `UNSUPP`) when the chain has a writable status byte, and the caller returns the chain to the
//! used ring either way.

use std::ops::Deref;

use ucrypt::blockdev::{Scratch, SharedRun};
use ucrypt::BlockDev;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::bitmap::{Bitmap, BitmapSlice, BS};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions, VolatileSlice};

/// virtio-blk addresses the device in 512-byte sectors, whatever its block size.
pub const SECTOR_BYTES: u64 = 512;
/// Size of the request header (`struct virtio_blk_outhdr`: type, ioprio, sector).
const HEADER_BYTES: usize = 16;
/// Size of one discard / write-zeroes range (`struct virtio_blk_discard_write_zeroes`).
const RANGE_BYTES: usize = 16;
/// `VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP`: the only flag a range may carry (write-zeroes only).
const RANGE_FLAG_UNMAP: u32 = 1;
/// Data segments a request may have besides header and status: the queue size bounds a direct
/// chain, but an indirect table may list up to 65535 descriptors. Matches `seg_max` in the
/// config space; a chain with more is refused.
pub const SEGMENTS_MAX: usize = 254;
/// Discard / write-zeroes ranges per request (`max_discard_seg`, `max_write_zeroes_seg`).
pub const RANGES_MAX: usize = 1;
/// Largest piece of a request the device sees at once, bytes: the queue's bounce buffer.
/// Longer requests are served piece by piece (virtio-blk promises no atomicity); a piece is
/// large enough for the volume's dispatch to split it across idle cores.
pub const CHUNK_BYTES: usize = 1 << 20;

/// One guest memory range of a request.
#[derive(Debug, Clone, Copy)]
struct Seg {
    addr: GuestAddress,
    len: u32,
}

/// The data of a segment list from `skip` bytes in, adjacent segments merged: guest ranges in
/// order.
fn runs(segs: &[Seg], mut skip: u64) -> impl Iterator<Item = (GuestAddress, u64)> + '_ {
    let mut pieces = segs
        .iter()
        .filter_map(move |s| {
            let len = u64::from(s.len);
            if skip >= len {
                skip -= len;
                return None;
            }
            let piece = (s.addr.checked_add(skip)?, len - skip);
            skip = 0;
            Some(piece)
        })
        .peekable();
    std::iter::from_fn(move || {
        let (at, mut n) = pieces.next()?;
        while let Some(&(next, len)) = pieces.peek() {
            if at.checked_add(n) != Some(next) {
                break;
            }
            n += len;
            pieces.next();
        }
        Some((at, n))
    })
}

/// The guest memory of `len` bytes of `segs` from `skip` bytes in, with `access`: slices of
/// the memory map in order, adjacent segments merged and cut where a region of the map ends.
/// IOERR if a byte lies outside the map or the segments hold fewer bytes. At most a few per
/// segment (a segment list is at most [`SEGMENTS_MAX`] long).
fn guest_slices<'m, G: GuestMemory + ?Sized>(
    mem: &'m G,
    segs: &[Seg],
    skip: u64,
    len: usize,
    access: Permissions,
) -> Result<Vec<GuestSlice<'m, G>>, Refused> {
    let mut out = Vec::new();
    let mut left = len;
    for (at, n) in runs(segs, skip) {
        if left == 0 {
            break;
        }
        let n = n.min(left as u64) as usize;
        for slice in mem.get_slices(at, n, access).map_err(|_| Refused::IoErr)? {
            out.push(slice.map_err(|_| Refused::IoErr)?);
        }
        left -= n;
    }
    if left == 0 {
        Ok(out)
    } else {
        Err(Refused::IoErr)
    }
}

/// A slice of guest memory in one region of the map.
type GuestSlice<'m, G> = VolatileSlice<'m, BS<'m, <G as GuestMemory>::Bitmap>>;

/// Calls `f` with `slices` as the shared runs of the device's API, `writable` for a read's
/// destination (then marked dirty after).
fn with_runs<B: BitmapSlice, R>(
    slices: &[VolatileSlice<'_, B>],
    writable: bool,
    f: impl FnOnce(&[SharedRun]) -> R,
) -> R {
    // Safety of the runs (both arms): each slice lies in one region of the guest memory map
    // (`get_slices` checked it, with the access asked), which stays mapped while the slices
    // borrow it, and the guards keep it so until `f` has returned. The memory is shared with
    // the guest, which may read or change it meanwhile and may name one page in two segments,
    // so runs may overlap: `SharedRun::new` allows both, since the device reads each byte of a
    // write's runs once into memory of its own and stores only finished plaintext into a
    // read's runs, never reading them back.
    let r = if writable {
        let guards: Vec<_> = slices.iter().map(|s| s.ptr_guard_mut()).collect();
        let runs: Vec<SharedRun> = guards
            .iter()
            .map(|g| {
                // SAFETY: see the start of the function.
                unsafe { SharedRun::new(g.as_ptr(), g.len()) }
            })
            .collect();
        f(&runs)
    } else {
        let guards: Vec<_> = slices.iter().map(|s| s.ptr_guard()).collect();
        let runs: Vec<SharedRun> = guards
            .iter()
            .map(|g| {
                // SAFETY: see the start of the function; these runs are only read.
                unsafe { SharedRun::new(g.as_ptr().cast_mut(), g.len()) }
            })
            .collect();
        f(&runs)
    };
    if writable {
        for s in slices {
            s.bitmap().mark_dirty(0, s.len());
        }
    }
    r
}

/// The `len` bytes of guest memory at `at` as one slice, when they lie in one region of the
/// map with `access`.
fn one_slice<G: GuestMemory + ?Sized>(
    mem: &G,
    at: GuestAddress,
    len: usize,
    access: Permissions,
) -> Option<vm_memory::VolatileSlice<'_, vm_memory::bitmap::BS<'_, G::Bitmap>>> {
    let slice = mem.get_slices(at, len, access).ok()?.next()?.ok()?;
    (slice.len() == len).then_some(slice)
}

/// Calls `f` with the host memory of the `len` bytes of guest memory at `at`, when they lie in
/// one region of the map (else `None`), and marks them dirty after: for a read
/// [`ring_read`] found there, decrypted from the ring's buffer.
fn with_guest_mut<G: GuestMemory + ?Sized, R>(
    mem: &G,
    at: GuestAddress,
    len: usize,
    f: impl FnOnce(&mut [u8]) -> R,
) -> Option<R> {
    let slice = one_slice(mem, at, len, Permissions::Write)?;
    let guard = slice.ptr_guard_mut();
    // SAFETY: the range lies in one region of the guest memory map (`get_slices` checked it),
    // which stays mapped while `mem` is borrowed, and the slice lives only while `f` runs.
    // The memory is shared with the guest, which may read or write it meanwhile (and may point
    // another request in flight at the same bytes), so nothing may rely on it staying as
    // written, and nothing does: `f` hands it to `DirectRead::finish`, which only ever stores
    // finished plaintext there and never reads it back.
    let dst = unsafe { std::slice::from_raw_parts_mut(guard.as_ptr(), len) };
    let r = f(dst);
    slice.bitmap().mark_dirty(0, len);
    Some(r)
}

/// Calls `f` with the host memory of the `len` bytes of guest memory at `at`, when they lie in
/// one region of the map (else `None`): for a write [`ring_write`] found there, sealed into
/// the ring's buffer.
pub(crate) fn with_guest<G: GuestMemory + ?Sized, R>(
    mem: &G,
    at: GuestAddress,
    len: usize,
    f: impl FnOnce(&[u8]) -> R,
) -> Option<R> {
    let slice = one_slice(mem, at, len, Permissions::Read)?;
    let guard = slice.ptr_guard();
    // SAFETY: as in `with_guest_mut`; the guest may change the bytes while `f` runs, and `f`
    // hands them to `DirectWrite::seal`, which reads each byte once into memory of its own
    // before it computes anything from it, so a change shows as other data written, never as
    // a broken invariant.
    let src = unsafe { std::slice::from_raw_parts(guard.as_ptr(), len) };
    Some(f(src))
}

/// How the queue's thread serves requests (settings fixed per connection).
#[derive(Debug, Clone, Copy)]
pub struct Mode {
    /// The driver negotiated `VIRTIO_BLK_F_FLUSH` (a write-back cache it flushes); without it
    /// every write must be durable when completed.
    pub write_back: bool,
    /// Discards reach the device (`VIRTIO_BLK_F_DISCARD` was offered).
    pub discard: bool,
}

/// A request's private bounce buffer, the device's scratch for its shared requests: the
/// only memory besides the volume's own that holds data being encrypted or decrypted. It grows
/// to the largest piece served (at most [`CHUNK_BYTES`]), is page-aligned so that the volume
/// can do direct I/O from it, and is wiped when dropped (it may hold plaintext).
#[derive(Default)]
pub struct Bounce(Scratch);

impl Bounce {
    /// The first `n` bytes (`n <= CHUNK_BYTES`), grown on first use; page-aligned.
    pub(crate) fn get(&mut self, n: usize) -> &mut [u8] {
        debug_assert!(n <= CHUNK_BYTES);
        self.0.get(n)
    }
}

/// Why a request fails: the status byte it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    IoErr,
    Unsupp,
}

impl Refused {
    fn status(self) -> u8 {
        match self {
            Refused::IoErr => VIRTIO_BLK_S_IOERR as u8,
            Refused::Unsupp => VIRTIO_BLK_S_UNSUPP as u8,
        }
    }
}

/// The request types served, parsed from the header.
#[derive(Debug, Clone, Copy)]
enum Op {
    Read,
    Write,
    Flush,
    GetId,
    Discard,
    WriteZeroes,
}

impl Op {
    fn parse(t: u32) -> Option<Op> {
        Some(match t {
            VIRTIO_BLK_T_IN => Op::Read,
            VIRTIO_BLK_T_OUT => Op::Write,
            VIRTIO_BLK_T_FLUSH => Op::Flush,
            VIRTIO_BLK_T_GET_ID => Op::GetId,
            VIRTIO_BLK_T_DISCARD => Op::Discard,
            VIRTIO_BLK_T_WRITE_ZEROES => Op::WriteZeroes,
            _ => return None,
        })
    }
}

/// What serving a request produced for the used ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    /// Bytes written into the chain's writable part (data and status), the used length.
    pub used_len: u32,
    /// The status written, or `None` when the chain had no writable status byte in memory.
    pub status: Option<u8>,
}

/// A request parsed from its chain on the queue's thread: everything serving it needs, read
/// from guest memory once (the header included), so a guest that rewrites the chain or the
/// header afterwards changes nothing about what is served. Reused from one request to the
/// next (the segment lists keep their capacity).
pub struct Request {
    /// The chain's head, returned to the used ring when the request completes.
    head: u16,
    /// `None`: a request type this device does not know (answered `UNSUPP`).
    op: Option<Op>,
    sector: u64,
    readable: Vec<Seg>,
    writable: Vec<Seg>,
    status_at: GuestAddress,
}

impl Default for Request {
    fn default() -> Self {
        Request {
            head: 0,
            op: None,
            sector: 0,
            readable: Vec::new(),
            writable: Vec::new(),
            status_at: GuestAddress(0),
        }
    }
}

/// How a request orders against the others in flight on its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Changes the device (write, discard, write-zeroes): a later flush waits for it.
    Write,
    /// A flush: completes only after every write taken before it has.
    Flush,
    /// Anything else (reads, GET_ID, unknown types): in any order.
    Other,
}

impl Request {
    pub fn head(&self) -> u16 {
        self.head
    }

    /// Bytes of data a read or write moves (0 for other requests).
    pub fn data_bytes(&self) -> u64 {
        match self.op {
            Some(Op::Read) => total(&self.writable),
            Some(Op::Write) => total(&self.readable).saturating_sub(HEADER_BYTES as u64),
            _ => 0,
        }
    }

    pub fn class(&self) -> Class {
        match self.op {
            Some(Op::Write | Op::Discard | Op::WriteZeroes) => Class::Write,
            Some(Op::Flush) => Class::Flush,
            _ => Class::Other,
        }
    }
}

/// Parses `chain` into `req`; `Err` for a chain that ends here (malformed: its status, if it
/// has a writable one, already written).
pub fn parse<M>(req: &mut Request, chain: DescriptorChain<M>) -> Result<(), Done>
where
    M: Deref + Clone,
    M::Target: GuestMemory,
{
    let mem = chain.memory();
    req.head = chain.head_index();
    req.status_at = match collect(req, mem, chain.clone()) {
        Ok(at) => at,
        Err(None) => {
            return Err(Done {
                used_len: 0,
                status: None,
            })
        }
        Err(Some(at)) => return Err(finish(mem, at, Err(Refused::IoErr))),
    };
    let mut hdr = [0u8; HEADER_BYTES];
    if let Err(r) = gather(mem, &req.readable, 0, &mut hdr) {
        return Err(finish(mem, req.status_at, Err(r)));
    }
    let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let mut sector = [0u8; 8];
    sector.copy_from_slice(&hdr[8..16]);
    req.sector = u64::from_le_bytes(sector);
    req.op = Op::parse(kind);
    Ok(())
}

/// Serves a parsed request against `dev`, through the private buffer `bounce`, and writes
/// its status into guest memory.
pub fn serve<G: GuestMemory + ?Sized>(
    dev: &dyn BlockDev,
    id: &[u8; VIRTIO_BLK_ID_BYTES as usize],
    mode: Mode,
    bounce: &mut Bounce,
    mem: &G,
    req: &Request,
) -> Done {
    let res = execute(dev, id, mode, bounce, mem, req);
    finish(mem, req.status_at, res)
}

/// A read the queue may serve through its ring (`ring.rs`): its offset on the device, its one
/// guest range (writable, in one region of the map) and its length, at most `max` bytes.
/// `None` for any other request, which [`serve`] serves.
pub fn ring_read<G: GuestMemory + ?Sized>(
    dev: &dyn BlockDev,
    mem: &G,
    req: &Request,
    max: usize,
) -> Option<(u64, GuestAddress, usize)> {
    matches!(req.op, Some(Op::Read)).then_some(())?;
    one_range(dev, mem, req, max, &req.writable, 0, Permissions::Write)
}

/// A write the queue may serve through its ring: as [`ring_read`], its one guest range
/// readable.
pub fn ring_write<G: GuestMemory + ?Sized>(
    dev: &dyn BlockDev,
    mem: &G,
    req: &Request,
    max: usize,
) -> Option<(u64, GuestAddress, usize)> {
    (matches!(req.op, Some(Op::Write)) && !dev.read_only()).then_some(())?;
    one_range(
        dev,
        mem,
        req,
        max,
        &req.readable,
        HEADER_BYTES as u64,
        Permissions::Read,
    )
}

/// The data of `segs` from `skip` bytes in, when it is one guest range of at most `max`
/// bytes, in one region of the map with `access`, for a request inside the device: its
/// offset on the device, the range and its length.
fn one_range<G: GuestMemory + ?Sized>(
    dev: &dyn BlockDev,
    mem: &G,
    req: &Request,
    max: usize,
    segs: &[Seg],
    skip: u64,
    access: Permissions,
) -> Option<(u64, GuestAddress, usize)> {
    let mut one = runs(segs, skip);
    let (at, len) = one.next()?;
    if one.next().is_some() || len > max as u64 {
        return None;
    }
    let offset = range(dev, req.sector, len).ok()?;
    let len = len as usize;
    one_slice(mem, at, len, access)?;
    Some((offset, at, len))
}

/// Ends a request served through the ring with `res`: writes the status, and for a failure
/// says why on stderr; `data` is the bytes written into guest memory.
pub fn finish_ring<G: GuestMemory + ?Sized>(
    mem: &G,
    req: &Request,
    res: ucrypt::Result<()>,
    data: u32,
) -> Done {
    let res = res.map(|()| data).map_err(|e| {
        if let Some(op) = req.op {
            eprintln!("ucrypt vhost: {op:?} at sector {}: {e}", req.sector);
        }
        Refused::IoErr
    });
    finish(mem, req.status_at, res)
}

/// Ends a read taken by [`ring_read`]: `open` decrypts into the guest range `at` (`len`
/// bytes) of `mem`; writes the status. A range no longer in one region of the map (it was, for
/// the same `mem`, when taken) ends in IOERR.
pub fn finish_ring_read<G: GuestMemory + ?Sized>(
    mem: &G,
    req: &Request,
    at: GuestAddress,
    len: usize,
    open: impl FnOnce(&mut [u8]) -> ucrypt::Result<()>,
) -> Done {
    let res = with_guest_mut(mem, at, len, open).unwrap_or({
        Err(ucrypt::Error::Bug(
            "a ring read's guest range left its memory region",
        ))
    });
    // `len` is at most the ring's request size.
    finish_ring(mem, req, res, len as u32)
}

/// Writes the status byte at `at`; the used length is the data written plus the status.
fn finish<G: GuestMemory + ?Sized>(mem: &G, at: GuestAddress, res: Result<u32, Refused>) -> Done {
    let (status, data) = match res {
        Ok(n) => (VIRTIO_BLK_S_OK as u8, n),
        Err(r) => (r.status(), 0),
    };
    match mem.write_obj(status, at) {
        Ok(()) => Done {
            used_len: data.saturating_add(1),
            status: Some(status),
        },
        Err(_) => Done {
            used_len: 0,
            status: None,
        },
    }
}

/// Splits the chain into `ctx.readable` and `ctx.writable` (the status byte cut off the last
/// writable segment): the status byte's address, or `Err(Some(status))` for a chain that can
/// still be told it is malformed, `Err(None)` for one that cannot.
fn collect<M>(
    ctx: &mut Request,
    mem: &M::Target,
    chain: DescriptorChain<M>,
) -> Result<GuestAddress, Option<GuestAddress>>
where
    M: Deref,
    M::Target: GuestMemory,
{
    ctx.readable.clear();
    ctx.writable.clear();
    let mut bad = false;
    // The chain iterator stops on a loop (it yields at most one table's worth of descriptors),
    // on a `next` outside the table and on a nested indirect table.
    let mut last: Option<Descriptor> = None;
    for d in chain {
        if d.is_write_only() {
            if ctx.writable.len() > SEGMENTS_MAX + 1 {
                bad = true;
            } else {
                ctx.writable.push(Seg {
                    addr: d.addr(),
                    len: d.len(),
                });
            }
        } else if !ctx.writable.is_empty() || ctx.readable.len() > SEGMENTS_MAX + 1 {
            // virtio: device-readable descriptors all come before device-writable ones.
            bad = true;
        } else {
            ctx.readable.push(Seg {
                addr: d.addr(),
                len: d.len(),
            });
        }
        last = Some(d);
    }
    // The status is the last byte of the last descriptor, which must be device-writable.
    let status_at = match last {
        Some(d) if d.is_write_only() && d.len() >= 1 => d
            .addr()
            .checked_add(u64::from(d.len()) - 1)
            .filter(|a| mem.check_range(*a, 1, Permissions::Write))
            .ok_or(None)?,
        _ => return Err(None),
    };
    if bad {
        return Err(Some(status_at));
    }
    // `last` is writable, so `writable` holds it (the length check above refused a chain
    // whose writable list overflowed).
    if let Some(s) = ctx.writable.last_mut() {
        s.len -= 1;
        if s.len == 0 {
            ctx.writable.pop();
        }
    }
    // Every range must lie in guest memory before the device is touched.
    let in_memory = |p: Permissions| move |s: &Seg| mem.check_range(s.addr, s.len as usize, p);
    if !ctx.readable.iter().all(in_memory(Permissions::Read))
        || !ctx.writable.iter().all(in_memory(Permissions::Write))
    {
        return Err(Some(status_at));
    }
    Ok(status_at)
}

/// Total bytes of a segment list.
fn total(segs: &[Seg]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// Copies `out.len()` bytes from the segments, starting `skip` bytes in, into `out`.
fn gather<G: GuestMemory + ?Sized>(
    mem: &G,
    segs: &[Seg],
    mut skip: u64,
    out: &mut [u8],
) -> Result<(), Refused> {
    let mut done = 0;
    for s in segs {
        if done == out.len() {
            break;
        }
        let len = u64::from(s.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = ((len - skip) as usize).min(out.len() - done);
        let at = s.addr.checked_add(skip).ok_or(Refused::IoErr)?;
        mem.read_slice(&mut out[done..done + n], at)
            .map_err(|_| Refused::IoErr)?;
        done += n;
        skip = 0;
    }
    if done == out.len() {
        Ok(())
    } else {
        Err(Refused::IoErr)
    }
}

/// Copies `data` into the segments, starting `skip` bytes in.
fn scatter<G: GuestMemory + ?Sized>(
    mem: &G,
    segs: &[Seg],
    mut skip: u64,
    data: &[u8],
) -> Result<(), Refused> {
    let mut done = 0;
    for s in segs {
        if done == data.len() {
            break;
        }
        let len = u64::from(s.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = ((len - skip) as usize).min(data.len() - done);
        let at = s.addr.checked_add(skip).ok_or(Refused::IoErr)?;
        mem.write_slice(&data[done..done + n], at)
            .map_err(|_| Refused::IoErr)?;
        done += n;
        skip = 0;
    }
    if done == data.len() {
        Ok(())
    } else {
        Err(Refused::IoErr)
    }
}

/// The device byte range of `len` bytes at 512-byte `sector`, if it lies inside the device.
fn range(dev: &dyn BlockDev, sector: u64, len: u64) -> Result<u64, Refused> {
    if len % SECTOR_BYTES != 0 {
        return Err(Refused::IoErr);
    }
    let offset = sector.checked_mul(SECTOR_BYTES).ok_or(Refused::IoErr)?;
    ucrypt::blockdev::check_range(offset, len, dev.size()).map_err(|_| Refused::IoErr)?;
    Ok(offset)
}

/// Serves a parsed request: the data bytes written into guest memory.
fn execute<G: GuestMemory + ?Sized>(
    dev: &dyn BlockDev,
    id: &[u8; VIRTIO_BLK_ID_BYTES as usize],
    mode: Mode,
    bounce: &mut Bounce,
    mem: &G,
    ctx: &Request,
) -> Result<u32, Refused> {
    let sector = ctx.sector;
    let op = ctx.op.ok_or(Refused::Unsupp)?;
    let payload = total(&ctx.readable) - HEADER_BYTES as u64;
    let device_err = |e: ucrypt::Error| {
        eprintln!("ucrypt vhost: {op:?} at sector {sector}: {e}");
        Refused::IoErr
    };
    match op {
        Op::Read => {
            let len = total(&ctx.writable);
            // A used length is u32: a longer read is refused rather than reported wrongly.
            let used = u32::try_from(len).map_err(|_| Refused::IoErr)?;
            let offset = range(dev, sector, len)?;
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(CHUNK_BYTES as u64) as usize;
                let into = guest_slices(mem, &ctx.writable, done, n, Permissions::Write)?;
                let at = offset + done;
                with_runs(&into, true, |runs| {
                    dev.read_shared_runs(runs, at, bounce.get(n))
                })
                .map_err(device_err)?;
                done += n as u64;
            }
            Ok(used)
        }
        Op::Write => {
            if dev.read_only() {
                return Err(Refused::IoErr);
            }
            let offset = range(dev, sector, payload)?;
            let fua = !mode.write_back;
            let mut done = 0u64;
            while done < payload {
                let n = (payload - done).min(CHUNK_BYTES as u64) as usize;
                let skip = HEADER_BYTES as u64 + done;
                let from = guest_slices(mem, &ctx.readable, skip, n, Permissions::Read)?;
                let at = offset + done;
                with_runs(&from, false, |runs| {
                    dev.write_shared_runs(runs, at, fua, bounce.get(n))
                })
                .map_err(device_err)?;
                done += n as u64;
            }
            Ok(0)
        }
        Op::Flush => dev.flush().map(|()| 0).map_err(device_err),
        Op::GetId => {
            let n = total(&ctx.writable).min(id.len() as u64) as usize;
            scatter(mem, &ctx.writable, 0, &id[..n])?;
            Ok(n as u32)
        }
        Op::Discard | Op::WriteZeroes => {
            if dev.read_only() || (matches!(op, Op::Discard) && !mode.discard) {
                return Err(Refused::Unsupp);
            }
            if payload == 0 || payload % RANGE_BYTES as u64 != 0 {
                return Err(Refused::IoErr);
            }
            if payload > (RANGES_MAX * RANGE_BYTES) as u64 {
                return Err(Refused::IoErr);
            }
            for i in 0..payload / RANGE_BYTES as u64 {
                let mut r = [0u8; RANGE_BYTES];
                let skip = HEADER_BYTES as u64 + i * RANGE_BYTES as u64;
                gather(mem, &ctx.readable, skip, &mut r)?;
                let mut s = [0u8; 8];
                s.copy_from_slice(&r[0..8]);
                let start = u64::from_le_bytes(s);
                let sectors = u32::from_le_bytes([r[8], r[9], r[10], r[11]]);
                let flags = u32::from_le_bytes([r[12], r[13], r[14], r[15]]);
                let allowed = match op {
                    Op::WriteZeroes => RANGE_FLAG_UNMAP,
                    _ => 0,
                };
                if flags & !allowed != 0 {
                    return Err(Refused::Unsupp);
                }
                let len = u64::from(sectors) * SECTOR_BYTES;
                let offset = range(dev, start, len)?;
                match op {
                    Op::Discard => dev.discard(offset, len),
                    _ => dev.write_zeroes(offset, len),
                }
                .map_err(device_err)?;
            }
            Ok(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryBackend;

    fn seg(addr: u64, len: u32) -> Seg {
        Seg {
            addr: GuestAddress(addr),
            len,
        }
    }

    #[test]
    fn runs_merge_adjacent_segments_after_the_skip() {
        let segs = [
            seg(0x1000, 16),
            seg(0x1010, 4080),
            seg(0x3000, 4096),
            seg(0x4000, 4096),
            seg(0x9000, 512),
        ];
        let got: Vec<_> = runs(&segs, 16).map(|(a, n)| (a.0, n)).collect();
        assert_eq!(got, [(0x1010, 4080), (0x3000, 8192), (0x9000, 512)]);
        let got: Vec<_> = runs(&segs, 0).map(|(a, n)| (a.0, n)).collect();
        assert_eq!(got, [(0x1000, 4096), (0x3000, 8192), (0x9000, 512)]);
        assert_eq!(runs(&segs, 20_000).count(), 0);
    }

    #[test]
    fn guest_slices_follow_the_segments_and_cut_at_a_region_end() {
        // Two regions, one after the other: 0x0..0x4000 and 0x4000..0x8000.
        let mem: vm_memory::GuestMemoryMmap<()> = vm_memory::GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x4000),
            (GuestAddress(0x4000), 0x4000),
        ])
        .unwrap();
        let segs = [seg(0x1000, 16), seg(0x3000, 0x2000), seg(0x100, 512)];
        let host = |at: u64| mem.get_host_address(GuestAddress(at)).unwrap() as usize;
        let lens = |skip, len| -> Result<Vec<(usize, usize)>, Refused> {
            let got = guest_slices(&mem, &segs, skip, len, Permissions::Write)?;
            Ok(got
                .iter()
                .map(|s| (s.ptr_guard().as_ptr() as usize, s.len()))
                .collect())
        };
        // The header skipped, the middle segment cut where the first region ends.
        assert_eq!(
            lens(16, 0x2200).unwrap(),
            [
                (host(0x3000), 0x1000),
                (host(0x4000), 0x1000),
                (host(0x100), 512)
            ]
        );
        // Only as far as asked.
        assert_eq!(lens(16, 0x800).unwrap(), [(host(0x3000), 0x800)]);
        // More than the segments hold, or a segment outside the map: IOERR.
        assert!(lens(16, 0x2201).is_err());
        let outside = [seg(0x7000, 0x2000)];
        assert!(guest_slices(&mem, &outside, 0, 0x2000, Permissions::Write).is_err());
    }
}
