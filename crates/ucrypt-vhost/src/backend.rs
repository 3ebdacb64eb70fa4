//! The vhost-user-blk device for one connection: features, config space and the per-queue
//! request loop, plugged into `vhost-user-backend`'s daemon (which owns the protocol, the
//! memory map and one epoll thread per entry of `queues_per_thread`). Each queue's thread
//! parses what the driver made available and hands it to the queue's [`Inflight`] set, or,
//! for a small read or write with others in flight, to its [`Ring`].
//!
//! A resize reaches the guest through the VMM: [`BlkBackend::config_changed`] sends
//! `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG` on the backend channel (`SET_BACKEND_REQ_FD`), and the
//! VMM reads the config space again (qemu's vhost-user-blk then raises the guest's
//! config-change interrupt when the capacity differs).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ucrypt::blockdev::SCRATCH_ALIGN;
use ucrypt::direct::{DirectRead, DirectWrite};
use ucrypt::sync::lock;
use ucrypt::BlockDev;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Backend, VhostUserFrontendReqHandler};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_ID_BYTES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestAddressSpace};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::inflight::{Inflight, Job, Mem, Memory};
use crate::request::{self, Bounce, Mode, CHUNK_BYTES, RANGES_MAX, SECTOR_BYTES, SEGMENTS_MAX};
use crate::ring::{Ring, RING_IO_BYTES_MAX};

/// Descriptors per virtqueue the device accepts (the driver may choose fewer).
pub const QUEUE_SIZE_MAX: usize = 256;

/// One virtqueue's side of the device.
struct Queue {
    /// The queue thread's own bounce buffer (for a request it serves itself); locked only by
    /// that thread.
    bounce: Mutex<Bounce>,
    /// The queue thread's ring (`None` inside: the kernel refused one), made the first time
    /// requests wait beside each other; locked only by that thread.
    ring: Mutex<Option<Option<Ring>>>,
    inflight: Arc<Inflight>,
}

/// The requests of one [`BlkBackend::serve_queue`] call in flight on the queue's ring, by
/// slot: each holds its request's place in the queue and the volume's [`DirectRead`] or
/// [`DirectWrite`] (which borrow the device, so none outlives the call: the call returns only
/// once all are reaped).
struct RingOps<'d> {
    inflight: &'d Inflight,
    slots: Vec<Option<RingOp<'d>>>,
}

struct RingOp<'d> {
    job: Job,
    io: DirectIo<'d>,
}

enum DirectIo<'d> {
    /// The guest range the plaintext goes to.
    Read(DirectRead<'d>, GuestAddress),
    Write(DirectWrite<'d>),
}

impl<'d> RingOps<'d> {
    fn new(inflight: &'d Inflight) -> Self {
        RingOps {
            inflight,
            slots: Vec::new(),
        }
    }

    /// Starts `job` on the ring if it is a read or write the ring serves and the volume hands
    /// out; gives it back (`Some`) otherwise.
    fn start(
        &mut self,
        ring: &mut Ring,
        dev: &'d dyn BlockDev,
        mode: Mode,
        job: Job,
    ) -> Option<Job> {
        let max = RING_IO_BYTES_MAX;
        let io = if let Some((offset, at, len)) = request::ring_read(dev, job.mem(), job.req(), max)
        {
            // The ring's buffers are scratch buffers, `SCRATCH_ALIGN`-aligned.
            let Some(read) = dev
                .read_direct(offset, len)
                .filter(|r| SCRATCH_ALIGN % r.align() == 0)
            else {
                return Some(job);
            };
            let Some((slot, _)) = ring.take(len) else {
                return Some(job);
            };
            if !ring.read(slot, read.fd(), read.file_offset()) {
                ring.give_back(slot);
                return Some(job);
            }
            (slot, DirectIo::Read(read, at))
        } else if let Some((offset, at, len)) = request::ring_write(dev, job.mem(), job.req(), max)
        {
            let fua = !mode.write_back;
            let Some(write) = dev
                .write_direct(offset, len, fua)
                .filter(|w| SCRATCH_ALIGN % w.align() == 0)
            else {
                return Some(job);
            };
            let Some((slot, buf)) = ring.take(len) else {
                return Some(job);
            };
            // The guest's data read once, encrypted into the slot's private buffer.
            let sealed = request::with_guest(job.mem(), at, len, |src| write.seal(src, buf));
            if !matches!(sealed, Some(Ok(())))
                || !ring.write(slot, write.fd(), write.file_offset(), write.durable())
            {
                ring.give_back(slot);
                return Some(job);
            }
            (slot, DirectIo::Write(write))
        } else {
            return Some(job);
        };
        let (slot, io) = io;
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, || None);
        }
        self.slots[slot] = Some(RingOp { job, io });
        None
    }

    /// Finishes every request the ring completed and returns it to the used ring in its turn.
    fn reap(&mut self, ring: &mut Ring) {
        let inflight = self.inflight;
        ring.reap(|slot, res, buf| {
            let Some(RingOp { job, io }) = self.slots.get_mut(slot).and_then(Option::take) else {
                return;
            };
            let done = match io {
                DirectIo::Read(read, at) => {
                    let len = read.len();
                    request::finish_ring_read(job.mem(), job.req(), at, len, |dst| {
                        read.finish(res, buf, dst)
                    })
                }
                DirectIo::Write(write) => {
                    request::finish_ring(job.mem(), job.req(), write.finish(res, buf), 0)
                }
            };
            inflight.finish(job, done);
        });
    }
}

impl Drop for RingOps<'_> {
    /// Requests still in flight when the call ends early (the ring failed): each ends in
    /// IOERR, so that the queue's order is not held up by requests nobody will finish. The
    /// ring keeps their buffers until the kernel is done with them.
    fn drop(&mut self) {
        for op in self.slots.iter_mut().filter_map(Option::take) {
            let failed = Err(ucrypt::Error::Bug(
                "the queue's ring failed with the request in flight",
            ));
            let done = request::finish_ring(op.job.mem(), op.job.req(), failed, 0);
            drop(op.io);
            self.inflight.finish(op.job, done);
        }
    }
}

/// The device as `vhost-user-backend` sees it: shared by the connection's threads.
pub struct BlkBackend {
    dev: Arc<dyn BlockDev>,
    queues: usize,
    discard: bool,
    mem: Mutex<Option<Mem>>,
    event_idx: AtomicBool,
    acked: AtomicU64,
    /// One per queue.
    queue: Vec<Queue>,
    /// The backend-to-VMM channel, where the VMM negotiated `BACKEND_REQ` and sent it.
    channel: Mutex<Option<Backend>>,
    /// The VMM read the config space, so it negotiated `CONFIG` (the protocol handler refuses
    /// `GET_CONFIG` otherwise; the acked protocol features are not passed on to a backend).
    /// Written under `channel`'s lock, so that the channel's `CONFIG` flag follows it.
    config_read: AtomicBool,
}

impl BlkBackend {
    pub fn new(
        dev: Arc<dyn BlockDev>,
        queues: usize,
        discard: bool,
        id: [u8; VIRTIO_BLK_ID_BYTES as usize],
    ) -> Self {
        let queues = queues.clamp(1, 64);
        BlkBackend {
            queues,
            discard,
            mem: Mutex::new(None),
            event_idx: AtomicBool::new(false),
            acked: AtomicU64::new(0),
            queue: (0..queues)
                .map(|_| Queue {
                    bounce: Mutex::default(),
                    ring: Mutex::new(None),
                    inflight: Inflight::new(dev.clone(), id),
                })
                .collect(),
            dev,
            channel: Mutex::new(None),
            config_read: AtomicBool::new(false),
        }
    }

    /// Tells the VMM that the config space changed (its capacity, after a resize of the
    /// volume, which the next read of the config space shows). With `REPLY_ACK` negotiated it
    /// returns once the VMM answered (qemu answers after reading the config space again); the
    /// channel has no timeout, so a VMM that stops answering holds the caller
    /// ([`crate::Handle::size_changed`] bounds that wait).
    /// Returns whether the message was sent: it is not where the VMM gave no backend channel
    /// or has not read the config space (`CONFIG` not negotiated).
    pub fn config_changed(&self) -> std::io::Result<bool> {
        // A clone (the channel is shared): the VMM's answer to the message may need a
        // `GET_CONFIG` answered first, which must not wait for this lock.
        let Some(channel) = lock(&self.channel).clone() else {
            return Ok(false);
        };
        if !self.config_read.load(Ordering::Acquire) {
            return Ok(false);
        }
        channel.handle_config_change().map(|_| true)
    }

    /// The VMM read the config space: `CONFIG` is negotiated.
    fn note_config_read(&self) {
        let channel = lock(&self.channel);
        self.config_read.store(true, Ordering::Release);
        if let Some(c) = channel.as_ref() {
            c.set_config_flag(true);
        }
    }

    fn mode(&self) -> Mode {
        Mode {
            write_back: self.acked.load(Ordering::Acquire) & (1 << VIRTIO_BLK_F_FLUSH) != 0,
            discard: self.discard,
        }
    }

    /// The config space (`struct virtio_blk_config` up to the write-zeroes fields), little
    /// endian as virtio 1.0 requires.
    pub fn config_space(&self) -> [u8; CONFIG_BYTES] {
        let mut c = [0u8; CONFIG_BYTES];
        let bs = self.dev.block_size().max(SECTOR_BYTES as u32);
        let put32 = |c: &mut [u8; CONFIG_BYTES], at: usize, v: u32| {
            c[at..at + 4].copy_from_slice(&v.to_le_bytes())
        };
        c[0..8].copy_from_slice(&(self.dev.size() / SECTOR_BYTES).to_le_bytes());
        put32(&mut c, 8, SEGMENT_BYTES_MAX); // size_max
        put32(&mut c, 12, SEGMENTS_MAX as u32); // seg_max
        put32(&mut c, 20, bs); // blk_size
        c[24] = 0; // physical_block_exp: physical = logical
        c[25] = 0; // alignment_offset
        c[26..28].copy_from_slice(&1u16.to_le_bytes()); // min_io_size, in logical blocks
        put32(&mut c, 28, 1); // opt_io_size
        c[32] = u8::from(self.mode().write_back); // writeback
        c[34..36].copy_from_slice(&(self.queues as u16).to_le_bytes());
        // Discard / write-zeroes limits: one range of up to u32 sectors at a time, a whole
        // number of logical blocks.
        let align = bs / SECTOR_BYTES as u32;
        let max_sectors = u32::MAX / align * align;
        put32(&mut c, 36, max_sectors); // max_discard_sectors
        put32(&mut c, 40, RANGES_MAX as u32); // max_discard_seg
        put32(&mut c, 44, align); // discard_sector_alignment
        put32(&mut c, 48, max_sectors); // max_write_zeroes_sectors
        put32(&mut c, 52, RANGES_MAX as u32); // max_write_zeroes_seg
        c[56] = 1; // write_zeroes_may_unmap
        c
    }

    /// Takes everything available on `vring`, the queue `qid`: a small request alone in
    /// flight is served on this thread; with others, a small read or write of one guest range
    /// goes through the queue's ring (`ring.rs`), anything else (and a big request, even
    /// alone) to the queue's workers; each
    /// returns to the used ring when done. Returns once nothing is available and nothing of
    /// the ring is in flight: while something is, this thread waits on the ring and looks at
    /// the available ring after each completion.
    pub fn serve_queue(&self, qid: usize, vring: &VringRwLock<Mem>) -> std::io::Result<()> {
        let Some(mem) = lock(&self.mem).clone() else {
            return Ok(());
        };
        let Some(queue) = self.queue.get(qid) else {
            return Ok(());
        };
        let mut bounce = lock(&queue.bounce);
        let mut ring = lock(&queue.ring);
        let inflight = &queue.inflight;
        let mut ops = RingOps::new(inflight);
        let mode = self.mode();
        let event_idx = self.event_idx.load(Ordering::Acquire);
        loop {
            if event_idx {
                vring.disable_notification().map_err(io_err)?;
            }
            loop {
                if let Some(r) = made(&mut ring) {
                    ops.reap(r);
                    // A full queue waits here for the ring's requests, which only this
                    // thread reaps, not in `take`.
                    if r.in_flight() > 0 && !inflight.has_room() {
                        r.wait()?;
                        continue;
                    }
                }
                let map: Arc<Memory> = mem.memory().into_inner();
                // The vring lock is held only to pop (a statement of its own: a guard in a
                // `let ... else` scrutinee would live through the block).
                let popped = vring
                    .get_mut()
                    .get_queue_mut()
                    .pop_descriptor_chain(map.clone());
                let Some(chain) = popped else {
                    match made(&mut ring) {
                        Some(r) if r.in_flight() > 0 => {
                            r.wait()?;
                            continue;
                        }
                        _ => break,
                    }
                };
                let mut req = inflight.request();
                if let Err(done) = request::parse(&mut req, chain) {
                    inflight.refuse(vring, req, done.used_len);
                    continue;
                }
                let big = req.data_bytes() > RING_IO_BYTES_MAX as u64;
                let (job, alone) = inflight.take(req, map.clone(), vring, mode);
                // A small request with nothing else in flight or waiting is served here: a
                // hand-over would only add a thread's wake-up to its latency. A big one goes
                // to a worker even alone, so that this thread takes the guest's next request
                // while its crypto and I/O run: a wake-up is little beside them.
                if alone && !big && !more_available(vring, &map) {
                    inflight.run(job, &mut bounce);
                    continue;
                }
                // The ring is made the first time small requests wait beside each other.
                let ring_ok = if big {
                    None
                } else {
                    ring.get_or_insert_with(Ring::new).as_mut()
                };
                let job = match ring_ok {
                    Some(r) => match ops.start(r, &*self.dev, mode, job) {
                        None => continue,
                        Some(job) => job,
                    },
                    None => job,
                };
                if let Some(job) = inflight.dispatch(job) {
                    // Served here, so the ring's requests finish first: a flush waits for
                    // its writes, and a request waiting at the volume's gate for theirs.
                    if let Some(r) = made(&mut ring) {
                        while r.in_flight() > 0 {
                            r.wait()?;
                            ops.reap(r);
                        }
                    }
                    inflight.run(job, &mut bounce);
                }
            }
            // With EVENT_IDX, re-enabling notification tells whether the driver added chains
            // meanwhile (then serve them before sleeping on the kick eventfd).
            if !event_idx || !vring.enable_notification().map_err(io_err)? {
                return Ok(());
            }
        }
    }

    /// Waits until every request taken from queue `qid` is back in its used ring.
    pub fn drain_queue(&self, qid: usize) {
        if let Some(q) = self.queue.get(qid) {
            q.inflight.drain();
        }
    }

    /// Ends the connection's request service: waits for every request in flight, then for
    /// the workers to end. Called once the queue threads are gone.
    pub fn close(&self) {
        for q in &self.queue {
            q.inflight.close();
        }
    }

    /// Workers alive on queue `qid`.
    pub fn workers(&self, qid: usize) -> usize {
        self.queue.get(qid).map_or(0, |q| q.inflight.workers())
    }
}

/// The queue's ring, if made and the kernel gave one.
fn made(ring: &mut Option<Option<Ring>>) -> Option<&mut Ring> {
    ring.as_mut()?.as_mut()
}

/// Whether the driver made more chains available than the queue has taken.
fn more_available(vring: &VringRwLock<Mem>, mem: &Memory) -> bool {
    let state = vring.get_ref();
    let q = state.get_queue();
    q.avail_idx(mem, std::sync::atomic::Ordering::Acquire)
        .map_or(true, |idx| idx.0 != q.next_avail())
}

fn io_err(e: virtio_queue::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Bytes of config space served (up to `write_zeroes_may_unmap` and its padding).
pub const CONFIG_BYTES: usize = 60;
/// Largest data segment, bytes (`size_max`): with `seg_max` this bounds a request to about one
/// bounce buffer, so a typical request is one call to the device.
pub const SEGMENT_BYTES_MAX: u32 = (CHUNK_BYTES / SEGMENTS_MAX) as u32 & !4095;

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock<Mem>;

    fn num_queues(&self) -> usize {
        self.queues
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE_MAX
    }

    fn features(&self) -> u64 {
        let mut f = 1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_BLK_F_SIZE_MAX
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
            | 1 << VIRTIO_BLK_F_TOPOLOGY
            | 1 << VIRTIO_BLK_F_FLUSH
            | 1 << VIRTIO_BLK_F_MQ
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.dev.read_only() {
            f |= 1 << VIRTIO_BLK_F_RO;
        } else {
            f |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
            if self.discard {
                f |= 1 << VIRTIO_BLK_F_DISCARD;
            }
        }
        // CONFIG_WCE (a driver-writable cache mode) is not offered: writeback follows FLUSH.
        f & !(1 << VIRTIO_BLK_F_CONFIG_WCE)
    }

    fn acked_features(&self, features: u64) {
        self.acked.store(features, Ordering::Release);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // BACKEND_REQ: the channel a config change is told on.
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::BACKEND_REQ
    }

    /// Kept for [`BlkBackend::config_changed`]; `vhost-user-backend` has set its `REPLY_ACK`
    /// flag, the `CONFIG` flag is set here.
    fn set_backend_req_fd(&self, channel: Backend) {
        let mut slot = lock(&self.channel);
        channel.set_config_flag(self.config_read.load(Ordering::Acquire));
        *slot = Some(channel);
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Release);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        if !self.config_read.load(Ordering::Acquire) {
            self.note_config_read();
        }
        let c = self.config_space();
        let mut out = vec![0u8; size as usize];
        let start = (offset as usize).min(c.len());
        let end = (offset as usize).saturating_add(size as usize).min(c.len());
        out[..end - start].copy_from_slice(&c[start..end]);
        out
    }

    /// The VMM stops a queue (`GET_VRING_BASE`): every request taken from it goes back to its
    /// used ring first, so the ring state the VMM reads back has none half done.
    fn stop_vring(&self, queue_index: u32) -> std::io::Result<()> {
        self.drain_queue(queue_index as usize);
        Ok(())
    }

    fn reset_device(&self) {
        for q in &self.queue {
            q.inflight.drain();
        }
    }

    fn update_memory(&self, mem: Mem) -> std::io::Result<()> {
        *lock(&self.mem) = Some(mem);
        Ok(())
    }

    /// One thread per queue: the thread that takes a queue's kick serves its requests.
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> std::io::Result<()> {
        // Each thread owns one queue: its vring is vrings[0], its queue index the thread's.
        match vrings.get(usize::from(device_event)) {
            Some(vring) => self.serve_queue(thread_id, vring),
            None => Ok(()),
        }
    }
}
