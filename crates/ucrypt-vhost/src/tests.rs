//! The device driven through real virtqueues in a test's guest memory (virtio-queue's
//! `MockSplitQueue` lays them out), served by the same per-queue loop a VMM's kicks reach:
//! well-formed requests of every type, then hostile chains that must end in a status or an
//! empty used entry, never a panic, a hang or an access outside guest memory or the device.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ucrypt::blockdev::SharedRun;
use ucrypt::BlockDev;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic, GuestMemoryMmap};

use crate::backend::{BlkBackend, CONFIG_BYTES};
use crate::inflight::INFLIGHT_PER_QUEUE_MAX;
use crate::request::CHUNK_BYTES;

/// What reached the device, in the order it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Read(u64),
    Write(u64),
    Flush,
}

/// A plaintext device in memory that counts what reached it; reads and writes at a held
/// offset wait until it is released.
struct MemDev {
    data: Mutex<Vec<u8>>,
    read_only: bool,
    flushes: AtomicU32,
    fua_writes: AtomicU32,
    plain_writes: AtomicU32,
    /// Calls of `read_shared_runs` and `write_shared_runs` (served through the default's
    /// scratch), and the runs the last one was given.
    shared_reads: AtomicU32,
    shared_writes: AtomicU32,
    last_runs: AtomicU32,
    discards: AtomicU32,
    held: Mutex<Vec<u64>>,
    released: Condvar,
    /// Requests inside the device now, and the most seen at once.
    inside: AtomicU32,
    inside_max: AtomicU32,
    log: Mutex<Vec<Event>>,
}

impl MemDev {
    fn new(size: usize, read_only: bool) -> Arc<MemDev> {
        Arc::new(MemDev {
            data: Mutex::new(vec![0xee; size]),
            read_only,
            flushes: AtomicU32::new(0),
            fua_writes: AtomicU32::new(0),
            plain_writes: AtomicU32::new(0),
            shared_reads: AtomicU32::new(0),
            shared_writes: AtomicU32::new(0),
            last_runs: AtomicU32::new(0),
            discards: AtomicU32::new(0),
            held: Mutex::new(Vec::new()),
            released: Condvar::new(),
            inside: AtomicU32::new(0),
            inside_max: AtomicU32::new(0),
            log: Mutex::new(Vec::new()),
        })
    }
    fn hold(&self, offset: u64) {
        self.held.lock().unwrap().push(offset);
    }
    fn release(&self, offset: u64) {
        self.held.lock().unwrap().retain(|&o| o != offset);
        self.released.notify_all();
    }
    /// Enters the device: waits while `offset` is held.
    fn enter(&self, offset: u64) {
        let n = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.inside_max.fetch_max(n, Ordering::SeqCst);
        let mut held = self.held.lock().unwrap();
        while held.contains(&offset) {
            held = self.released.wait(held).unwrap();
        }
    }
    fn leave(&self, e: Event) {
        self.log.lock().unwrap().push(e);
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }
    fn bytes(&self, at: usize, n: usize) -> Vec<u8> {
        self.data.lock().unwrap()[at..at + n].to_vec()
    }
    fn check(&self, offset: u64, len: usize) -> ucrypt::Result<usize> {
        ucrypt::blockdev::check_range(offset, len as u64, self.size())?;
        Ok(offset as usize)
    }
}

impl BlockDev for MemDev {
    fn size(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }
    fn block_size(&self) -> u32 {
        4096
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        let o = self.check(offset, buf.len())?;
        self.enter(offset);
        buf.copy_from_slice(&self.data.lock().unwrap()[o..o + buf.len()]);
        self.leave(Event::Read(offset));
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        assert!(!self.read_only, "a write reached a read-only device");
        let o = self.check(offset, buf.len())?;
        self.enter(offset);
        self.data.lock().unwrap()[o..o + buf.len()].copy_from_slice(buf);
        self.plain_writes.fetch_add(1, Ordering::SeqCst);
        self.leave(Event::Write(offset));
        Ok(())
    }
    fn read_shared_runs(
        &self,
        dst: &[SharedRun],
        offset: u64,
        scratch: &mut [u8],
    ) -> ucrypt::Result<()> {
        self.shared_reads.fetch_add(1, Ordering::SeqCst);
        self.last_runs.store(dst.len() as u32, Ordering::SeqCst);
        ucrypt::blockdev::read_runs_through(self, dst, offset, scratch)
    }
    fn write_shared_runs(
        &self,
        src: &[SharedRun],
        offset: u64,
        fua: bool,
        scratch: &mut [u8],
    ) -> ucrypt::Result<()> {
        self.shared_writes.fetch_add(1, Ordering::SeqCst);
        self.last_runs.store(src.len() as u32, Ordering::SeqCst);
        ucrypt::blockdev::write_runs_through(self, src, offset, fua, scratch)
    }
    fn write_fua(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        self.write_at(buf, offset)?;
        self.plain_writes.fetch_sub(1, Ordering::SeqCst);
        self.fua_writes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        self.log.lock().unwrap().push(Event::Flush);
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.check(offset, len as usize)?;
        self.discards.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        let o = self.check(offset, len as usize)?;
        self.data.lock().unwrap()[o..o + len as usize].fill(0);
        Ok(())
    }
}

const QUEUE_LEN: u16 = 64;
const MEM_BYTES: usize = 4 << 20;
const HDR: u64 = 0x1_0000;
const STATUS: u64 = 0x1_1000;
const RANGES: u64 = 0x1_2000;
const INDIRECT: u64 = 0x2_0000;
const DATA: u64 = 0x10_0000;
/// An address no guest memory region covers.
const OUTSIDE: u64 = 0x4000_0000;
const DEV_BYTES: usize = 4 << 20;

type Mem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// One device with one queue, and the guest memory it sees.
struct Rig<'a> {
    mem: &'a GuestMemoryMmap<()>,
    mq: MockSplitQueue<'a, GuestMemoryMmap<()>>,
    vring: VringRwLock<Mem>,
    backend: BlkBackend,
    dev: Arc<MemDev>,
    next_desc: u16,
    served: u16,
}

fn guest_memory() -> GuestMemoryMmap<()> {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_BYTES)]).unwrap()
}

/// A backend for `dev` on the queue `mq` in `mem`, as a VMM sets one up: the ring's
/// addresses, the next used index read from the ring (vhost-user-backend does so on
/// `SET_VRING_ADDR`) and the next available index (`SET_VRING_BASE`) the same.
fn attach(
    mem: &GuestMemoryMmap<()>,
    mq: &MockSplitQueue<'_, GuestMemoryMmap<()>>,
    dev: Arc<dyn BlockDev>,
    features: u64,
    event_idx: bool,
) -> (VringRwLock<Mem>, BlkBackend) {
    let atomic = GuestMemoryAtomic::new(mem.clone());
    let vring = VringRwLock::new(atomic.clone(), QUEUE_LEN).unwrap();
    vring.set_queue_size(QUEUE_LEN);
    vring
        .set_queue_info(mq.desc_table_addr().0, mq.avail_addr().0, mq.used_addr().0)
        .unwrap();
    let used_idx = vring.queue_used_idx().unwrap();
    vring.set_queue_next_used(used_idx);
    vring.set_queue_next_avail(used_idx);
    vring.set_queue_event_idx(event_idx);
    vring.set_queue_ready(true);
    vring.set_enabled(true);
    let backend = BlkBackend::new(dev, 1, true, crate::id_of("ucrypt-test-serial-0123"));
    backend.acked_features(features);
    backend.set_event_idx(event_idx);
    backend.update_memory(atomic).unwrap();
    (vring, backend)
}

impl<'a> Rig<'a> {
    fn new(mem: &'a GuestMemoryMmap<()>, dev: Arc<MemDev>, features: u64, event_idx: bool) -> Self {
        Self::serving(mem, dev.clone(), dev, features, event_idx)
    }

    /// A rig whose backend serves `served`; `dev` is the test's view (unused when `served` is
    /// another device).
    fn serving(
        mem: &'a GuestMemoryMmap<()>,
        served: Arc<dyn BlockDev>,
        dev: Arc<MemDev>,
        features: u64,
        event_idx: bool,
    ) -> Self {
        let mq = MockSplitQueue::create(mem, GuestAddress(0), QUEUE_LEN);
        let (vring, backend) = attach(mem, &mq, served, features, event_idx);
        Rig {
            mem,
            mq,
            vring,
            backend,
            dev,
            next_desc: 0,
            served: 0,
        }
    }

    /// Puts descriptors at the next free table slots, chained in order, and offers the chain:
    /// its head index.
    fn offer(&mut self, descs: &[(u64, u32, u16)]) -> u16 {
        // Served chains' slots are free again: start over at 0 when the table's end is near.
        let base = if usize::from(self.next_desc) + descs.len() > usize::from(QUEUE_LEN) {
            0
        } else {
            self.next_desc
        };
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, flags))| {
                let last = i + 1 == descs.len();
                let flags = if last {
                    flags
                } else {
                    flags | VRING_DESC_F_NEXT as u16
                };
                RawDescriptor::from(SplitDescriptor::new(addr, len, flags, base + i as u16 + 1))
            })
            .collect();
        self.mq.add_desc_chains(&raw, base).unwrap();
        self.next_desc = (base + descs.len() as u16) % QUEUE_LEN;
        base
    }

    /// Serves what is available and waits for it; the used entries added since the last call.
    fn serve(&mut self) -> Vec<(u32, u32)> {
        self.backend.serve_queue(0, &self.vring).unwrap();
        self.backend.drain_queue(0);
        self.used()
    }

    /// The used entries added since the last call.
    fn used(&mut self) -> Vec<(u32, u32)> {
        let used = self.mq.used_addr().0;
        let idx: u16 = self.mem.read_obj(GuestAddress(used + 2)).unwrap();
        let mut out = Vec::new();
        while self.served != idx {
            let at = used + 4 + 8 * u64::from(self.served % QUEUE_LEN);
            let id: u32 = self.mem.read_obj(GuestAddress(at)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).unwrap();
            out.push((id, len));
            self.served = self.served.wrapping_add(1);
        }
        out
    }

    fn header(&self, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(HDR)).unwrap();
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    fn status(&self) -> u8 {
        self.mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    /// A request whose data is `segs` lengths laid out one after another at DATA: the status
    /// and the used length.
    fn request(&mut self, kind: u32, sector: u64, segs: &[u32], device_writes: bool) -> (u8, u32) {
        self.header(kind, sector);
        let mut descs = vec![(HDR, 16, 0)];
        let mut at = DATA;
        let flag = if device_writes {
            VRING_DESC_F_WRITE as u16
        } else {
            0
        };
        for &n in segs {
            descs.push((at, n, flag));
            at += u64::from(n) + 512; // gaps: the segments are not one contiguous range
        }
        descs.push((STATUS, 1, VRING_DESC_F_WRITE as u16));
        self.offer(&descs);
        let used = self.serve();
        assert_eq!(used.len(), 1, "one chain offered, one used entry");
        (self.status(), used[0].1)
    }

    /// Fills the segments' guest memory with `data` (laid out as `request` does).
    fn put_data(&self, segs: &[u32], data: &[u8]) {
        let (mut at, mut off) = (DATA, 0usize);
        for &n in segs {
            self.mem
                .write_slice(&data[off..off + n as usize], GuestAddress(at))
                .unwrap();
            off += n as usize;
            at += u64::from(n) + 512;
        }
    }

    fn get_data(&self, segs: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut at = DATA;
        for &n in segs {
            let mut b = vec![0u8; n as usize];
            self.mem.read_slice(&mut b, GuestAddress(at)).unwrap();
            out.extend_from_slice(&b);
            at += u64::from(n) + 512;
        }
        out
    }

    fn ranges(&mut self, kind: u32, ranges: &[(u64, u32, u32)]) -> u8 {
        self.header(kind, 0);
        let mut b = Vec::new();
        for &(sector, n, flags) in ranges {
            b.extend_from_slice(&sector.to_le_bytes());
            b.extend_from_slice(&n.to_le_bytes());
            b.extend_from_slice(&flags.to_le_bytes());
        }
        self.mem.write_slice(&b, GuestAddress(RANGES)).unwrap();
        self.offer(&[
            (HDR, 16, 0),
            (RANGES, b.len() as u32, 0),
            (STATUS, 1, VRING_DESC_F_WRITE as u16),
        ]);
        assert_eq!(self.serve().len(), 1);
        self.status()
    }
}

const FLUSH: u64 = 1 << VIRTIO_BLK_F_FLUSH;
const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn write_then_read_over_scattered_segments() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let wsegs = [512, 1536, 6144];
    let data = pattern(8192, 7);
    r.put_data(&wsegs, &data);
    assert_eq!(r.request(VIRTIO_BLK_T_OUT, 8, &wsegs, false), (OK, 1));
    assert_eq!(r.dev.bytes(4096, 8192), data);
    assert_eq!(r.dev.plain_writes.load(Ordering::SeqCst), 1);
    assert_eq!(r.dev.fua_writes.load(Ordering::SeqCst), 0);
    assert_eq!(r.dev.shared_writes.load(Ordering::SeqCst), 1);
    assert_eq!(r.dev.last_runs.load(Ordering::SeqCst), 3);

    let rsegs = [4096, 2048, 2048];
    assert_eq!(r.request(VIRTIO_BLK_T_IN, 8, &rsegs, true), (OK, 8193));
    assert_eq!(r.get_data(&rsegs), data);
    assert_eq!(r.dev.shared_reads.load(Ordering::SeqCst), 1);
    assert_eq!(r.dev.last_runs.load(Ordering::SeqCst), 3);
}

#[test]
fn adjacent_segments_reach_the_device_as_one_shared_run() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let half = 64u32 << 10;
    let data = pattern(2 * half as usize, 5);
    mem.write_slice(&data, GuestAddress(DATA)).unwrap();
    let w = VRING_DESC_F_WRITE as u16;
    let two = |flag| {
        [
            (HDR, 16, 0),
            (DATA, half, flag),
            (DATA + u64::from(half), half, flag),
        ]
    };
    r.header(VIRTIO_BLK_T_OUT, 8);
    r.offer(&[two(0).as_slice(), &[(STATUS, 1, w)]].concat());
    assert_eq!(r.serve().len(), 1);
    assert_eq!(r.status(), OK);
    assert_eq!(r.dev.bytes(4096, data.len()), data);
    assert_eq!(r.dev.shared_writes.load(Ordering::SeqCst), 1);
    assert_eq!(r.dev.last_runs.load(Ordering::SeqCst), 1);
    assert_eq!(r.dev.plain_writes.load(Ordering::SeqCst), 1);

    mem.write_slice(&vec![0u8; data.len()], GuestAddress(DATA))
        .unwrap();
    r.header(VIRTIO_BLK_T_IN, 8);
    let mut descs = two(w).to_vec();
    descs.push((STATUS, 1, w));
    let head = r.offer(&descs);
    assert_eq!(r.serve(), [(u32::from(head), 2 * half + 1)]);
    assert_eq!(r.status(), OK);
    let mut back = vec![0u8; data.len()];
    mem.read_slice(&mut back, GuestAddress(DATA)).unwrap();
    assert_eq!(back, data);
    assert_eq!(r.dev.shared_reads.load(Ordering::SeqCst), 1);
    assert_eq!(r.dev.last_runs.load(Ordering::SeqCst), 1);
}

#[test]
fn a_run_across_two_memory_regions_reaches_the_device_as_two_runs() {
    // Two regions, adjacent in guest memory but two mappings in this process.
    let mem = GuestMemoryMmap::<()>::from_ranges(&[
        (GuestAddress(0), MEM_BYTES / 2),
        (GuestAddress(MEM_BYTES as u64 / 2), MEM_BYTES / 2),
    ])
    .unwrap();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let n = 128u32 << 10;
    let at = MEM_BYTES as u64 / 2 - u64::from(n) / 2;
    let data = pattern(n as usize, 9);
    mem.write_slice(&data, GuestAddress(at)).unwrap();
    let w = VRING_DESC_F_WRITE as u16;
    r.header(VIRTIO_BLK_T_OUT, 0);
    r.offer(&[(HDR, 16, 0), (at, n, 0), (STATUS, 1, w)]);
    assert_eq!(r.serve().len(), 1);
    assert_eq!(r.status(), OK);
    assert_eq!(r.dev.bytes(0, n as usize), data);
    assert_eq!(r.dev.shared_writes.load(Ordering::SeqCst), 1);
    assert_eq!(r.dev.last_runs.load(Ordering::SeqCst), 2);

    mem.write_slice(&vec![0u8; n as usize], GuestAddress(at))
        .unwrap();
    r.header(VIRTIO_BLK_T_IN, 0);
    r.offer(&[(HDR, 16, 0), (at, n, w), (STATUS, 1, w)]);
    assert_eq!(r.serve().len(), 1);
    assert_eq!(r.status(), OK);
    let mut back = vec![0u8; n as usize];
    mem.read_slice(&mut back, GuestAddress(at)).unwrap();
    assert_eq!(back, data);
    assert_eq!(r.dev.shared_reads.load(Ordering::SeqCst), 1);
    assert_eq!(r.dev.last_runs.load(Ordering::SeqCst), 2);
}

#[test]
fn request_longer_than_the_bounce_buffer_is_served_in_pieces() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let n = CHUNK_BYTES as u32 * 2 + 4096;
    let data = pattern(n as usize, 3);
    r.put_data(&[n], &data);
    assert_eq!(r.request(VIRTIO_BLK_T_OUT, 0, &[n], false), (OK, 1));
    assert_eq!(r.dev.plain_writes.load(Ordering::SeqCst), 3);
    r.put_data(&[n], &vec![0u8; n as usize]);
    assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, &[n], true), (OK, n + 1));
    assert_eq!(r.get_data(&[n]), data);
}

#[test]
fn without_negotiated_flush_every_write_is_durable() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), 0, false);
    r.put_data(&[4096], &pattern(4096, 1));
    assert_eq!(r.request(VIRTIO_BLK_T_OUT, 0, &[4096], false), (OK, 1));
    assert_eq!(r.dev.fua_writes.load(Ordering::SeqCst), 1);
    assert_eq!(r.dev.plain_writes.load(Ordering::SeqCst), 0);
    assert_eq!(
        r.backend.config_space()[32],
        0,
        "writethrough in config space"
    );
}

#[test]
fn flush_reaches_the_device() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    assert_eq!(r.request(VIRTIO_BLK_T_FLUSH, 0, &[], false), (OK, 1));
    assert_eq!(r.dev.flushes.load(Ordering::SeqCst), 1);
}

#[test]
fn get_id_answers_twenty_bytes() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    assert_eq!(r.request(VIRTIO_BLK_T_GET_ID, 0, &[20], true), (OK, 21));
    assert_eq!(r.get_data(&[20]), b"ucrypt-test-serial-0");
}

#[test]
fn write_zeroes_and_discard() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    assert_eq!(r.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(16, 16, 1)]), OK);
    assert_eq!(r.dev.bytes(8192, 8192), vec![0u8; 8192]);
    assert_eq!(r.dev.bytes(8192 + 8192, 1), vec![0xee]);
    assert_eq!(r.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 8, 0)]), OK);
    assert_eq!(r.dev.discards.load(Ordering::SeqCst), 1);
    // Discard carries no flags; write-zeroes only UNMAP.
    assert_eq!(r.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 8, 1)]), UNSUPP);
    assert_eq!(r.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 2)]), UNSUPP);
    // More ranges than max_discard_seg, past the end, overflowing.
    assert_eq!(
        r.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 8, 0), (8, 8, 0)]),
        IOERR
    );
    let end = (DEV_BYTES / 512) as u64;
    assert_eq!(
        r.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(end - 8, 16, 0)]),
        IOERR
    );
    assert_eq!(
        r.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(u64::MAX, 16, 0)]),
        IOERR
    );
    assert_eq!(r.ranges(VIRTIO_BLK_T_DISCARD, &[]), IOERR);
    assert_eq!(r.dev.discards.load(Ordering::SeqCst), 1);
}

#[test]
fn discard_not_offered_is_unsupported() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    r.backend = BlkBackend::new(r.dev.clone(), 1, false, [0; 20]);
    r.backend
        .update_memory(GuestMemoryAtomic::new(mem.clone()))
        .unwrap();
    assert_eq!(r.backend.features() & (1 << VIRTIO_BLK_F_DISCARD), 0);
    assert_eq!(r.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 8, 0)]), UNSUPP);
    assert_eq!(r.dev.discards.load(Ordering::SeqCst), 0);
}

#[test]
fn read_only_device_refuses_writes() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, true), FLUSH, false);
    assert_ne!(r.backend.features() & (1 << VIRTIO_BLK_F_RO), 0);
    r.put_data(&[4096], &pattern(4096, 1));
    assert_eq!(r.request(VIRTIO_BLK_T_OUT, 0, &[4096], false), (IOERR, 1));
    assert_eq!(r.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 0)]), UNSUPP);
    assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, &[4096], true), (OK, 4097));
}

#[test]
fn config_space_describes_the_device() {
    let mem = guest_memory();
    let r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let c = r.backend.get_config(0, CONFIG_BYTES as u32);
    assert_eq!(
        u64::from_le_bytes(c[0..8].try_into().unwrap()),
        (DEV_BYTES / 512) as u64
    );
    assert_eq!(
        u32::from_le_bytes(c[20..24].try_into().unwrap()),
        4096,
        "blk_size"
    );
    assert_eq!(
        u16::from_le_bytes(c[34..36].try_into().unwrap()),
        1,
        "num_queues"
    );
    assert_eq!(c[32], 1, "writeback");
    // Windows past the end read as zeroes, whatever the VMM asks for.
    assert_eq!(r.backend.get_config(56, 16).len(), 16);
    assert_eq!(r.backend.get_config(1000, 8), vec![0u8; 8]);
    assert_eq!(r.backend.get_config(u32::MAX, 4), vec![0u8; 4]);
}

#[test]
fn config_space_capacity_follows_the_volume_size() {
    let mem = guest_memory();
    let r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let capacity = |r: &Rig| u64::from_le_bytes(r.backend.get_config(0, 8).try_into().unwrap());
    assert_eq!(capacity(&r), (DEV_BYTES / 512) as u64);
    // A resize changes what the next read of the config space says.
    r.dev.data.lock().unwrap().resize(DEV_BYTES * 2, 0);
    assert_eq!(capacity(&r), (DEV_BYTES * 2 / 512) as u64);
}

/// `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG`'s code, and the header flags: version 1, REPLY,
/// NEED_REPLY (the vhost-user spec's "Message Specification").
const CONFIG_CHANGE_MSG: u32 = 2;
const VERSION_1: u32 = 0x1;
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;

/// A header as the spec lays it out: request, flags, payload size, each u32 little endian.
fn header(bytes: &[u8; 12]) -> (u32, u32, u32) {
    let word = |i: usize| u32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap());
    (word(0), word(1), word(2))
}

/// A device with a backend channel whose VMM end is returned; `config_read`: the VMM has read
/// the config space (it negotiated CONFIG).
fn with_channel(
    dev: Arc<MemDev>,
    reply_ack: bool,
    config_read: bool,
) -> (crate::Handle, Arc<BlkBackend>, UnixStream) {
    let backend = Arc::new(BlkBackend::new(dev, 1, false, crate::id_of("t")));
    let (ours, vmm) = UnixStream::pair().unwrap();
    let channel = vhost::vhost_user::Backend::from_stream(ours);
    // vhost-user-backend sets REPLY_ACK from the negotiated protocol features.
    channel.set_reply_ack_flag(reply_ack);
    backend.set_backend_req_fd(channel);
    if config_read {
        backend.get_config(0, CONFIG_BYTES as u32);
    }
    let handle = crate::Handle(
        Arc::new(Mutex::new(Some(backend.clone()))),
        Default::default(),
    );
    (handle, backend, vmm)
}

#[test]
fn a_resize_sends_config_change_once_the_config_space_shows_it() {
    let dev = MemDev::new(DEV_BYTES, false);
    let (handle, backend, mut vmm) = with_channel(dev.clone(), true, true);
    // What the VMM must negotiate for the message: offered.
    use vhost::vhost_user::VhostUserProtocolFeatures as P;
    assert!(backend
        .protocol_features()
        .contains(P::BACKEND_REQ | P::CONFIG));
    dev.data.lock().unwrap().resize(DEV_BYTES * 2, 0);
    // The VMM's side, as qemu's vhost-user-blk does it: the message, then a read of the
    // config space, then the answer NEED_REPLY asks for.
    let vmm_side = std::thread::spawn(move || {
        let mut hdr = [0u8; 12];
        vmm.read_exact(&mut hdr).unwrap();
        let capacity = u64::from_le_bytes(backend.get_config(0, 8).try_into().unwrap());
        let mut ack = Vec::new();
        for w in [CONFIG_CHANGE_MSG, VERSION_1 | REPLY, 8] {
            ack.extend_from_slice(&w.to_le_bytes());
        }
        ack.extend_from_slice(&0u64.to_le_bytes());
        vmm.write_all(&ack).unwrap();
        (header(&hdr), capacity, vmm)
    });
    assert!(handle.size_changed().unwrap(), "the VMM was told");
    let (hdr, capacity, vmm) = vmm_side.join().unwrap();
    assert_eq!(hdr, (CONFIG_CHANGE_MSG, VERSION_1 | NEED_REPLY, 0));
    assert_eq!(capacity, (DEV_BYTES * 2 / 512) as u64);
    // Exactly one message.
    vmm.set_nonblocking(true).unwrap();
    assert_eq!(
        (&vmm).read(&mut [0u8; 1]).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock
    );
}

#[test]
fn config_change_without_reply_ack_is_sent_and_not_waited_for() {
    let dev = MemDev::new(DEV_BYTES, false);
    let (handle, _backend, mut vmm) = with_channel(dev, false, true);
    assert!(handle.size_changed().unwrap());
    let mut hdr = [0u8; 12];
    vmm.read_exact(&mut hdr).unwrap();
    assert_eq!(header(&hdr), (CONFIG_CHANGE_MSG, VERSION_1, 0));
}

#[test]
fn config_change_is_not_sent_where_not_negotiated() {
    // CONFIG not negotiated: the VMM never read the config space.
    let dev = MemDev::new(DEV_BYTES, false);
    let (handle, _backend, vmm) = with_channel(dev.clone(), true, false);
    assert!(!handle.size_changed().unwrap());
    vmm.set_nonblocking(true).unwrap();
    assert_eq!(
        (&vmm).read(&mut [0u8; 1]).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock
    );
    // No backend channel (BACKEND_REQ not negotiated), and no VMM at all.
    let backend = Arc::new(BlkBackend::new(dev, 1, false, crate::id_of("t")));
    backend.get_config(0, CONFIG_BYTES as u32);
    assert!(!backend.config_changed().unwrap());
    assert!(!crate::Handle::default().size_changed().unwrap());
}

#[test]
fn config_change_to_a_vmm_that_refuses_it_is_an_error() {
    let dev = MemDev::new(DEV_BYTES, false);
    let (handle, _backend, mut vmm) = with_channel(dev, true, true);
    let vmm_side = std::thread::spawn(move || {
        let mut hdr = [0u8; 12];
        vmm.read_exact(&mut hdr).unwrap();
        let mut nack = Vec::new();
        for w in [CONFIG_CHANGE_MSG, VERSION_1 | REPLY, 8] {
            nack.extend_from_slice(&w.to_le_bytes());
        }
        nack.extend_from_slice(&1u64.to_le_bytes());
        vmm.write_all(&nack).unwrap();
    });
    let e = handle.size_changed().unwrap_err();
    vmm_side.join().unwrap();
    assert!(matches!(e, crate::Error::ConfigChange(_)), "{e}");
}

#[test]
fn config_change_to_a_vmm_that_never_answers_is_bounded() {
    let dev = MemDev::new(DEV_BYTES, false);
    let (handle, _backend, mut vmm) = with_channel(dev, true, true);
    let t0 = std::time::Instant::now();
    let e = handle.size_changed().unwrap_err();
    assert!(t0.elapsed() >= crate::CONFIG_CHANGE_ANSWER_WAIT, "{e}");
    assert!(e.to_string().contains("has not answered"), "{e}");
    // The notice was sent; while it waits for its answer, no second one is.
    let mut hdr = [0u8; 12];
    vmm.read_exact(&mut hdr).unwrap();
    let e = handle.size_changed().unwrap_err();
    assert!(e.to_string().contains("has not answered"), "{e}");
    // The VMM goes: the waiting thread ends, and a later notice is tried again.
    drop(vmm);
    let t0 = std::time::Instant::now();
    loop {
        match handle.size_changed() {
            Err(e) if e.to_string().contains("has not answered") => {
                assert!(t0.elapsed() < Duration::from_secs(30), "still waiting: {e}")
            }
            _ => break,
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn event_idx_serves_and_publishes_avail_event() {
    let mem = guest_memory();
    let features = FLUSH | 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), features, true);
    for i in 0..5 {
        r.put_data(&[4096], &pattern(4096, i));
        assert_eq!(
            r.request(VIRTIO_BLK_T_OUT, u64::from(i) * 8, &[4096], false),
            (OK, 1)
        );
    }
    // avail_event (after the used ring) tells the driver the next index the device waits for.
    let used = r.mq.used_addr().0;
    let avail_event: u16 = mem
        .read_obj(GuestAddress(used + 4 + 8 * u64::from(QUEUE_LEN)))
        .unwrap();
    assert_eq!(avail_event, 5);
}

// ---- hostile chains ----

#[test]
fn data_outside_guest_memory_is_refused_before_the_device_is_touched() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    for (addr, len, flags) in [
        (OUTSIDE, 4096, 0),
        (MEM_BYTES as u64 - 2048, 4096, 0), // straddles the end of guest memory
        (DATA, !511u32, 0),                 // 4 GiB - 512: larger than guest memory
        (u64::MAX - 1023, 4096, 0),         // address arithmetic overflows
        (OUTSIDE, 4096, VRING_DESC_F_WRITE as u16),
        (MEM_BYTES as u64 - 2048, 4096, VRING_DESC_F_WRITE as u16),
    ] {
        let kind = if flags == 0 {
            VIRTIO_BLK_T_OUT
        } else {
            VIRTIO_BLK_T_IN
        };
        r.header(kind, 0);
        r.offer(&[
            (HDR, 16, 0),
            (addr, len, flags),
            (STATUS, 1, VRING_DESC_F_WRITE as u16),
        ]);
        let used = r.serve();
        assert_eq!(used.len(), 1);
        assert_eq!(r.status(), IOERR, "{addr:#x}+{len:#x}");
    }
    assert_eq!(r.dev.plain_writes.load(Ordering::SeqCst), 0);
    assert_eq!(r.dev.bytes(0, 8192), vec![0xee; 8192]);
}

#[test]
fn out_of_range_and_misaligned_requests_are_refused() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let end = (DEV_BYTES / 512) as u64;
    assert_eq!(r.request(VIRTIO_BLK_T_IN, end, &[512], true).0, IOERR);
    assert_eq!(r.request(VIRTIO_BLK_T_IN, end - 1, &[1024], true).0, IOERR);
    assert_eq!(
        r.request(VIRTIO_BLK_T_OUT, u64::MAX, &[512], false).0,
        IOERR
    );
    assert_eq!(
        r.request(VIRTIO_BLK_T_OUT, u64::MAX / 512 + 1, &[512], false)
            .0,
        IOERR
    );
    assert_eq!(r.request(VIRTIO_BLK_T_OUT, 0, &[100], false).0, IOERR);
    assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, &[4095], true).0, IOERR);
    assert_eq!(r.request(VIRTIO_BLK_T_IN, end - 8, &[4096], true).0, OK);
    assert_eq!(r.request(0x1234, 0, &[512], false).0, UNSUPP);
    assert_eq!(r.request(VIRTIO_BLK_T_SCSI_CMD, 0, &[512], false).0, UNSUPP);
    assert_eq!(r.dev.plain_writes.load(Ordering::SeqCst), 0);
}

#[test]
fn malformed_chains_end_in_a_status_or_an_empty_used_entry() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let w = VRING_DESC_F_WRITE as u16;
    // Header shorter than 16 bytes.
    r.header(VIRTIO_BLK_T_IN, 0);
    r.offer(&[(HDR, 8, 0), (STATUS, 1, w)]);
    assert_eq!(r.serve().len(), 1);
    assert_eq!(r.status(), IOERR);
    // No writable descriptor: nowhere to put a status; the chain still comes back.
    r.offer(&[(HDR, 16, 0), (DATA, 512, 0)]);
    assert_eq!(r.serve().iter().map(|u| u.1).collect::<Vec<_>>(), vec![0]);
    // The status byte outside guest memory.
    r.header(VIRTIO_BLK_T_FLUSH, 0);
    r.offer(&[(HDR, 16, 0), (OUTSIDE, 1, w)]);
    assert_eq!(r.serve().iter().map(|u| u.1).collect::<Vec<_>>(), vec![0]);
    // An empty status descriptor.
    r.offer(&[(HDR, 16, 0), (STATUS, 0, w)]);
    assert_eq!(r.serve().iter().map(|u| u.1).collect::<Vec<_>>(), vec![0]);
    // A device-readable descriptor after a device-writable one.
    r.header(VIRTIO_BLK_T_IN, 0);
    r.offer(&[
        (HDR, 16, 0),
        (DATA, 512, w),
        (DATA + 4096, 512, 0),
        (STATUS, 1, w),
    ]);
    assert_eq!(r.serve().len(), 1);
    assert_eq!(r.status(), IOERR);
    assert_eq!(r.dev.flushes.load(Ordering::SeqCst), 0);
}

#[test]
fn descriptor_loops_and_bad_next_indices_terminate() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let w = VRING_DESC_F_WRITE as u16;
    let next = VRING_DESC_F_NEXT as u16;
    r.header(VIRTIO_BLK_T_IN, 0);
    // 0 -> 1 -> 0 -> ...: a loop through a readable and a writable descriptor.
    let raw = [
        RawDescriptor::from(SplitDescriptor::new(HDR, 16, next, 1)),
        RawDescriptor::from(SplitDescriptor::new(STATUS, 1, w | next, 0)),
    ];
    r.mq.add_desc_chains(&raw, 0).unwrap();
    let used = r.serve();
    assert_eq!(used.len(), 1);
    assert_eq!(r.status(), IOERR);
    // A writable self-loop: ends after one table's worth of descriptors.
    let raw = [RawDescriptor::from(SplitDescriptor::new(
        STATUS,
        1,
        w | next,
        2,
    ))];
    r.mq.add_desc_chains(&raw, 2).unwrap();
    assert_eq!(r.serve().len(), 1);
    // `next` beyond the table.
    let raw = [
        RawDescriptor::from(SplitDescriptor::new(HDR, 16, next, 4000)),
        RawDescriptor::from(SplitDescriptor::new(STATUS, 1, w, 0)),
    ];
    r.mq.add_desc_chains(&raw, 3).unwrap();
    // The second descriptor is offered as its own chain (the mock offers a head per slot
    // whose predecessor lacks NEXT): both come back.
    assert!(!r.serve().is_empty());
}

#[test]
fn indirect_tables_too_long_or_nested_are_refused() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let w = VRING_DESC_F_WRITE as u16;
    let next = VRING_DESC_F_NEXT as u16;
    let write_table = |descs: &[(u64, u32, u16)]| {
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let flags = if i + 1 < descs.len() {
                flags | next
            } else {
                flags
            };
            let d = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, i as u16 + 1));
            mem.write_obj(d, GuestAddress(INDIRECT + 16 * i as u64))
                .unwrap();
        }
        16 * descs.len() as u32
    };
    // A well-formed indirect read is served.
    r.header(VIRTIO_BLK_T_IN, 0);
    let len = write_table(&[(HDR, 16, 0), (DATA, 4096, w), (STATUS, 1, w)]);
    r.offer(&[(INDIRECT, len, VRING_DESC_F_INDIRECT as u16)]);
    assert_eq!(r.serve()[0].1, 4097);
    assert_eq!(r.status(), OK);
    // 400 data segments: more than seg_max.
    let mut t = vec![(HDR, 16, 0)];
    t.extend((0..400).map(|i| (DATA + 512 * i, 512, w)));
    t.push((STATUS, 1, w));
    r.header(VIRTIO_BLK_T_IN, 0);
    let len = write_table(&t);
    r.offer(&[(INDIRECT, len, VRING_DESC_F_INDIRECT as u16)]);
    assert_eq!(r.serve().len(), 1);
    assert_eq!(r.status(), IOERR);
    // An indirect table inside an indirect table: the chain ends there, without a status.
    let len = write_table(&[(HDR, 16, 0), (INDIRECT, 48, VRING_DESC_F_INDIRECT as u16)]);
    r.offer(&[(INDIRECT, len, VRING_DESC_F_INDIRECT as u16)]);
    assert_eq!(r.serve().iter().map(|u| u.1).collect::<Vec<_>>(), vec![0]);
    // An indirect table outside guest memory, or of a length no table has.
    r.offer(&[(OUTSIDE, 48, VRING_DESC_F_INDIRECT as u16)]);
    assert_eq!(r.serve().len(), 1);
    r.offer(&[(INDIRECT, 47, VRING_DESC_F_INDIRECT as u16)]);
    assert_eq!(r.serve().len(), 1);
}

#[test]
fn hostile_avail_ring_does_not_hang_or_panic() {
    let mem = guest_memory();
    let mut r = Rig::new(&mem, MemDev::new(DEV_BYTES, false), FLUSH, false);
    let avail = r.mq.avail_addr().0;
    // A head index beyond the queue: nothing to return it to; the queue goes on.
    mem.write_obj(1000u16, GuestAddress(avail + 4)).unwrap();
    mem.write_obj(1u16, GuestAddress(avail + 2)).unwrap();
    assert!(r.serve().is_empty());
    r.next_desc = 0;
    r.put_data(&[512], &pattern(512, 9));
    assert_eq!(r.request(VIRTIO_BLK_T_OUT, 0, &[512], false), (OK, 1));
    // avail.idx claiming more chains than the queue holds: refused, nothing served.
    mem.write_obj(500u16, GuestAddress(avail + 2)).unwrap();
    assert!(r.serve().is_empty());
}

// ---- several requests in flight ----

/// Request `i`'s header, status byte and data (up to 8 KiB) in guest memory.
fn slot(i: u64) -> (u64, u64, u64) {
    (HDR + 32 * i, STATUS + i, DATA + 0x2000 * i)
}

impl Rig<'_> {
    /// Offers request `i` of `kind` at `sector` with one data segment of `len` bytes (none if
    /// 0): its head index.
    fn offer_slot(&mut self, i: u64, kind: u32, sector: u64, len: u32) -> u16 {
        let (hdr, status, data) = slot(i);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(hdr)).unwrap();
        self.mem.write_obj(0xffu8, GuestAddress(status)).unwrap();
        let w = VRING_DESC_F_WRITE as u16;
        let mut descs = vec![(hdr, 16, 0)];
        if len > 0 {
            descs.push((data, len, if kind == VIRTIO_BLK_T_IN { w } else { 0 }));
        }
        descs.push((status, 1, w));
        self.offer(&descs)
    }

    fn slot_status(&self, i: u64) -> u8 {
        self.mem.read_obj(GuestAddress(slot(i).1)).unwrap()
    }
}

/// Waits (at most 10 s) until the device's log holds `n` events.
fn wait_log(dev: &MemDev, n: usize) -> Vec<Event> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = dev.log.lock().unwrap().clone();
        if log.len() >= n {
            return log;
        }
        assert!(Instant::now() < deadline, "only {log:?} of {n} events");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn requests_are_served_at_once_and_return_in_ring_order() {
    for event_idx in [false, true] {
        let mem = guest_memory();
        let dev = MemDev::new(DEV_BYTES, false);
        let ring = 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
        let features = FLUSH | if event_idx { ring } else { 0 };
        let mut r = Rig::new(&mem, dev.clone(), features, event_idx);
        dev.hold(0);
        let mut heads = vec![r.offer_slot(0, VIRTIO_BLK_T_IN, 0, 4096)];
        heads.extend((1..4).map(|i| r.offer_slot(i, VIRTIO_BLK_T_IN, 8 * i, 4096)));
        // Returns once everything is handed over; the held read is still in the device.
        r.backend.serve_queue(0, &r.vring).unwrap();
        // The three later reads pass the held one in the device...
        let log = wait_log(&dev, 3);
        assert!(!log.contains(&Event::Read(0)), "event_idx {event_idx}");
        // ...and wait for it before the used ring.
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(r.used(), vec![], "event_idx {event_idx}");
        assert_eq!(r.slot_status(0), 0xff, "the held read is not done");
        dev.release(0);
        r.backend.drain_queue(0);
        let used: Vec<(u32, u32)> = heads.iter().map(|&h| (u32::from(h), 4097)).collect();
        assert_eq!(r.used(), used, "event_idx {event_idx}");
        for i in 0..4 {
            assert_eq!(r.slot_status(i), OK);
        }
        r.backend.close();
        assert_eq!(r.backend.workers(0), 0);
    }
}

/// A small request alone is served on the queue's thread; a big one, alone too, goes to a
/// worker, so the queue's thread is back at the ring while its crypto and I/O run.
#[test]
fn a_lone_big_request_goes_to_a_worker() {
    let mem = guest_memory();
    let dev = MemDev::new(DEV_BYTES, false);
    let mut r = Rig::new(&mem, dev.clone(), FLUSH, false);
    let small = r.offer_slot(0, VIRTIO_BLK_T_IN, 0, 4096);
    r.backend.serve_queue(0, &r.vring).unwrap();
    assert_eq!(r.used(), vec![(u32::from(small), 4097)]);
    assert_eq!(
        r.backend.workers(0),
        0,
        "the small read was served on the queue's thread"
    );
    let n = 128u32 << 10;
    let at = 128 * 512;
    dev.hold(at);
    let big = r.offer_slot(1, VIRTIO_BLK_T_IN, 128, n);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        // Should the queue's thread serve the read itself, it returns only once this lets the
        // device go on, and the checks below fail rather than hang.
        let dev = &dev;
        s.spawn(move || {
            if rx.recv_timeout(Duration::from_secs(5)).is_err() {
                dev.release(at);
            }
        });
        r.backend.serve_queue(0, &r.vring).unwrap();
        let (workers, status) = (r.backend.workers(0), r.slot_status(1));
        drop(tx);
        assert_eq!(workers, 1, "the big read went to a worker");
        assert_eq!(status, 0xff, "the big read is still in the device");
    });
    dev.release(at);
    r.backend.drain_queue(0);
    assert_eq!(r.used(), vec![(u32::from(big), n + 1)]);
    r.backend.close();
}

/// A backend killed with requests in flight, and the next one started as qemu starts it when
/// it cannot read the ring state back (its `reconnect=`): the available index it hands over is
/// the used index in guest memory. The next backend serves exactly the requests the first
/// returned no used entry for (including those its device had finished) and each returns
/// once.
#[test]
fn a_restarted_backend_serves_again_exactly_what_was_not_returned() {
    let mem = guest_memory();
    let dev = MemDev::new(DEV_BYTES, false);
    let mut r = Rig::new(&mem, dev.clone(), FLUSH, false);
    dev.hold(4096);
    let heads: Vec<u16> = (0..4)
        .map(|i| r.offer_slot(i, VIRTIO_BLK_T_IN, 8 * i, 4096))
        .collect();
    r.backend.serve_queue(0, &r.vring).unwrap();
    // Requests 0, 2 and 3 are done in the device, 1 is held there: only 0 is returned.
    wait_log(&dev, 3);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(r.used(), vec![(u32::from(heads[0]), 4097)]);

    // The first backend is gone (its held request never returns); the next one serves a copy
    // of the device's data.
    let dev2 = MemDev::new(DEV_BYTES, false);
    let (vring2, backend2) = attach(&mem, &r.mq, dev2.clone(), FLUSH, false);
    backend2.serve_queue(0, &vring2).unwrap();
    backend2.drain_queue(0);
    let again: Vec<(u32, u32)> = heads[1..].iter().map(|&h| (u32::from(h), 4097)).collect();
    assert_eq!(r.used(), again);
    let mut served: Vec<u64> = (dev2.log.lock().unwrap().iter())
        .map(|e| match e {
            Event::Read(offset) => *offset,
            other => panic!("{other:?} reached the device"),
        })
        .collect();
    served.sort_unstable();
    assert_eq!(served, [4096, 8192, 12288]);
    backend2.close();
    dev.release(4096);
    r.backend.close();
}

#[test]
fn a_flush_completes_after_the_writes_taken_before_it() {
    let mem = guest_memory();
    let dev = MemDev::new(DEV_BYTES, false);
    let mut r = Rig::new(&mem, dev.clone(), FLUSH, false);
    mem.write_slice(&pattern(4096, 5), GuestAddress(slot(0).2))
        .unwrap();
    dev.hold(0);
    let write = r.offer_slot(0, VIRTIO_BLK_T_OUT, 0, 4096);
    let flush = r.offer_slot(1, VIRTIO_BLK_T_FLUSH, 0, 0);
    let read = r.offer_slot(2, VIRTIO_BLK_T_IN, 8, 4096);
    r.backend.serve_queue(0, &r.vring).unwrap();
    // The read, behind the flush in the ring, does not wait for it in the device.
    assert_eq!(wait_log(&dev, 1), vec![Event::Read(4096)]);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        dev.flushes.load(Ordering::SeqCst),
        0,
        "flushed before the write"
    );
    assert_eq!(r.used(), vec![]);
    dev.release(0);
    r.backend.drain_queue(0);
    assert_eq!(
        r.used(),
        vec![
            (u32::from(write), 1),
            (u32::from(flush), 1),
            (u32::from(read), 4097)
        ],
        "the write returns to the ring before the flush, both before the read"
    );
    assert_eq!(
        *dev.log.lock().unwrap(),
        vec![Event::Read(4096), Event::Write(0), Event::Flush]
    );
    assert_eq!(dev.bytes(0, 4096), pattern(4096, 5));
    assert_eq!((r.slot_status(0), r.slot_status(1)), (OK, OK));
}

#[test]
fn requests_in_flight_per_queue_are_bounded() {
    let mem = guest_memory();
    let dev = MemDev::new(DEV_BYTES, false);
    let mut r = Rig::new(&mem, dev.clone(), FLUSH, false);
    dev.hold(0);
    let n = INFLIGHT_PER_QUEUE_MAX as u64 + 4;
    for i in 0..n {
        r.offer_slot(i, VIRTIO_BLK_T_IN, 0, 4096);
    }
    std::thread::scope(|s| {
        // The queue's thread waits for room once the limit is taken.
        let serving = s.spawn(|| r.backend.serve_queue(0, &r.vring).unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        while dev.inside.load(Ordering::SeqCst) < INFLIGHT_PER_QUEUE_MAX as u32 {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(50));
        assert!(!serving.is_finished());
        assert_eq!(
            dev.inside_max.load(Ordering::SeqCst),
            INFLIGHT_PER_QUEUE_MAX as u32
        );
        assert!(r.backend.workers(0) <= INFLIGHT_PER_QUEUE_MAX);
        dev.release(0);
        serving.join().unwrap();
    });
    r.backend.drain_queue(0);
    assert_eq!(r.used().len(), n as usize);
    assert!(dev.inside_max.load(Ordering::SeqCst) <= INFLIGHT_PER_QUEUE_MAX as u32);
    r.backend.close();
    assert_eq!(r.backend.workers(0), 0);
}

#[test]
fn stopping_a_queue_waits_for_its_requests_in_flight() {
    let mem = guest_memory();
    let dev = MemDev::new(DEV_BYTES, false);
    let mut r = Rig::new(&mem, dev.clone(), FLUSH, false);
    dev.hold(0);
    let held = r.offer_slot(0, VIRTIO_BLK_T_IN, 0, 4096);
    r.offer_slot(1, VIRTIO_BLK_T_IN, 8, 4096);
    r.backend.serve_queue(0, &r.vring).unwrap();
    std::thread::scope(|s| {
        // GET_VRING_BASE: the VMM reads the ring state back once this returns.
        let stopping = s.spawn(|| r.backend.stop_vring(0).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        assert!(!stopping.is_finished(), "stopped with a request in flight");
        dev.release(0);
        stopping.join().unwrap();
    });
    let used = r.used();
    assert_eq!(used.len(), 2);
    assert!(used.contains(&(u32::from(held), 4097)));
}

/// Reads and writes at depth on a volume whose backend is a file go through the queue's ring
/// (`ring.rs`): each returns OK in ring order, reads with the volume's plaintext in guest
/// memory, writes stored in the volume, and none needed a worker thread. A read the ring does
/// not take (two guest segments) is served beside them by a worker, and so is a flush after
/// writes. (A rig per round: the mock queue's rings overlap beyond 32 entries.)
#[test]
fn requests_at_depth_on_a_file_volume_go_through_the_ring() {
    use ucrypt::backend::{DirectMode, FileBackend};
    use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
    use ucrypt::volume::{Volume, VolumeConfig};
    if crate::ring::Ring::new().is_none() {
        eprintln!("SKIPPED: this kernel (or sandbox) refuses io_uring; requests go to the workers");
        return;
    }
    let path = std::env::temp_dir().join(format!("ucrypt-vhost-ring-{}.img", std::process::id()));
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(DEV_BYTES as u64))
        .unwrap();
    let backend = Arc::new(FileBackend::open(&path, true, DirectMode::Auto).unwrap());
    let key: Vec<u8> = (0..64u8).collect();
    let config = VolumeConfig::new(
        CipherSpec::AES_XTS_PLAIN64,
        ucrypt::SecretBytes::from_slice(&key),
        Geometry::new(SectorSize::S4096),
    );
    let volume = Arc::new(Volume::new(backend, config).unwrap());
    let data = pattern(16 * 4096, 3);
    volume.write_at(&data, 0).unwrap();
    let w = VRING_DESC_F_WRITE as u16;
    for round in 0..3u64 {
        let mem = guest_memory();
        let mut r = Rig::serving(&mem, volume.clone(), MemDev::new(0, false), FLUSH, false);
        let sector = |i: u64| 8 * ((i + round * 5) % 16);
        let mut heads: Vec<u16> = (0..8)
            .map(|i| r.offer_slot(i, VIRTIO_BLK_T_IN, sector(i), 4096))
            .collect();
        // Two segments of one request: not the ring's; it goes to a worker.
        let (hdr, status, at) = slot(8);
        r.mem.write_obj(0xffu8, GuestAddress(status)).unwrap();
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&VIRTIO_BLK_T_IN.to_le_bytes());
        r.mem.write_slice(&h, GuestAddress(hdr)).unwrap();
        heads.push(r.offer(&[
            (hdr, 16, 0),
            (at, 2048, w),
            (at + 4096, 2048, w),
            (status, 1, w),
        ]));
        r.backend.serve_queue(0, &r.vring).unwrap();
        r.backend.drain_queue(0);
        let used: Vec<(u32, u32)> = heads.iter().map(|&h| (u32::from(h), 4097)).collect();
        assert_eq!(r.used(), used, "round {round}: every read, in ring order");
        for i in 0..8u64 {
            assert_eq!(r.slot_status(i), OK, "round {round}, read {i}");
            let mut got = vec![0u8; 4096];
            r.mem.read_slice(&mut got, GuestAddress(slot(i).2)).unwrap();
            let at = 512 * sector(i) as usize;
            assert!(
                got == data[at..at + 4096],
                "round {round}, read {i}: other plaintext"
            );
        }
        assert_eq!(r.slot_status(8), OK);
        let mut got = vec![0u8; 4096];
        r.mem
            .read_slice(&mut got[..2048], GuestAddress(at))
            .unwrap();
        r.mem
            .read_slice(&mut got[2048..], GuestAddress(at + 4096))
            .unwrap();
        assert!(got == data[..4096], "round {round}: the two-segment read");
        let workers = r.backend.workers(0);
        assert!(
            workers <= 1,
            "round {round}: {workers} workers, for one two-segment read"
        );
        r.backend.close();
    }
    // Writes at depth, then a flush: each written through the ring, in ring order.
    for round in 0..2u64 {
        let mem = guest_memory();
        let mut r = Rig::serving(&mem, volume.clone(), MemDev::new(0, false), FLUSH, false);
        let new = pattern(8 * 4096, 40 + round as u8);
        let mut heads = Vec::new();
        for i in 0..8u64 {
            let chunk = &new[4096 * i as usize..4096 * (i + 1) as usize];
            r.mem.write_slice(chunk, GuestAddress(slot(i).2)).unwrap();
            heads.push(r.offer_slot(i, VIRTIO_BLK_T_OUT, 8 * (2 * i + round), 4096));
        }
        heads.push(r.offer_slot(8, VIRTIO_BLK_T_FLUSH, 0, 0));
        r.backend.serve_queue(0, &r.vring).unwrap();
        r.backend.drain_queue(0);
        let used: Vec<(u32, u32)> = heads.iter().map(|&h| (u32::from(h), 1)).collect();
        assert_eq!(
            r.used(),
            used,
            "round {round}: every write and the flush, in ring order"
        );
        for i in 0..9u64 {
            assert_eq!(r.slot_status(i), OK, "round {round}, request {i}");
        }
        for i in 0..8u64 {
            let mut got = vec![0u8; 4096];
            volume.read_at(&mut got, 4096 * (2 * i + round)).unwrap();
            let want = &new[4096 * i as usize..4096 * (i + 1) as usize];
            assert!(
                got == want,
                "round {round}, write {i}: the volume holds other data"
            );
        }
        let workers = r.backend.workers(0);
        assert!(
            workers <= 1,
            "round {round}: {workers} workers, for one flush"
        );
        r.backend.close();
    }
    assert!(volume.stats().read.requests >= 27);
    assert!(volume.stats().write.requests >= 16);
    let _ = std::fs::remove_file(&path);
}
