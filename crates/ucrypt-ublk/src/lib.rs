//! ublk front end: a `/dev/ublkbN` block device served by ucrypt (Linux ≥ 6.0 with `ublk_drv`).
//!
//! One queue per CPU; each queue thread serves its tags synchronously, so crypto runs inline in
//! the queue thread (the volume's dispatch policy may still split a large request across
//! cores). Flush, FUA, discard and write-zeroes map onto the `BlockDev` contract. A request on
//! the caller's [`Stop`] (the `ucrypt` command ties SIGINT and SIGTERM to it) stops the device:
//! queues drain, the volume is flushed, the device is deleted.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::sys;
use libublk::{BufDesc, UblkError, UblkFlags, UblkIORes};
use ucrypt::{BlockDev, Stop};

/// What can go wrong serving a ublk device.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel has no ublk driver loaded.
    #[error("/dev/ublk-control not found: this kernel has no ublk driver loaded (modprobe ublk_drv; Linux ≥ 6.0)")]
    NoDriver,
    /// The ublk control or queue machinery failed.
    #[error("{what}: {detail}")]
    Ublk { what: &'static str, detail: String },
    /// The volume failed (flushing it at the end).
    #[error(transparent)]
    Device(#[from] ucrypt::Error),
}

impl Error {
    /// Who can act on this error (see [`ucrypt::ErrorKind`]).
    pub fn kind(&self) -> ucrypt::ErrorKind {
        match self {
            Error::NoDriver | Error::Ublk { .. } => ucrypt::ErrorKind::Device,
            Error::Device(e) => e.kind(),
        }
    }
}

fn ublk_err(what: &'static str) -> impl FnOnce(libublk::UblkError) -> Error {
    move |e| Error::Ublk {
        what,
        detail: e.to_string(),
    }
}

/// Largest request the kernel may send, bytes (the kernel's max_sectors); also the size of
/// each tag's bounce buffer, so memory = queues × depth × this.
pub const IO_BYTES_MAX: u32 = 512 << 10;
/// Requests in flight per queue.
pub const QUEUE_DEPTH: u16 = 64;

pub struct UblkOptions {
    /// Number of hardware queues (default: one per CPU).
    pub queues: u16,
    /// Device id to ask for, or -1 for the next free one.
    pub id: i32,
}

impl Default for UblkOptions {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        UblkOptions {
            queues: cpus.min(u16::MAX as usize) as u16,
            id: -1,
        }
    }
}

fn shift_of(bytes: u32) -> u8 {
    bytes.trailing_zeros() as u8
}

/// One request: returns the byte count done, or a negative errno.
fn handle(dev: &dyn BlockDev, iod: &sys::ublksrv_io_desc, buf: &mut [u8]) -> i32 {
    let op = iod.op_flags & 0xff;
    let offset = iod.start_sector << 9;
    let bytes = (iod.nr_sectors as u64) << 9;
    let res = match op {
        sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE if bytes as usize > buf.len() => {
            return -libc::EINVAL
        }
        sys::UBLK_IO_OP_READ => dev.read_at(&mut buf[..bytes as usize], offset),
        // The I/O buffer is refilled by the kernel for the next request: the volume may
        // encrypt in it.
        sys::UBLK_IO_OP_WRITE if iod.op_flags & sys::UBLK_IO_F_FUA != 0 => {
            dev.write_fua(&mut buf[..bytes as usize], offset)
        }
        sys::UBLK_IO_OP_WRITE => dev.write_at_mut(&mut buf[..bytes as usize], offset),
        sys::UBLK_IO_OP_FLUSH => dev.flush(),
        sys::UBLK_IO_OP_DISCARD => dev.discard(offset, bytes),
        sys::UBLK_IO_OP_WRITE_ZEROES => dev.write_zeroes(offset, bytes),
        _ => return -libc::EOPNOTSUPP,
    };
    match res {
        Ok(()) => bytes.min(i32::MAX as u64) as i32,
        Err(e) => {
            eprintln!("ucrypt ublk: op {op} at {offset} (+{bytes}): {e}");
            -e.errno()
        }
    }
}

/// Serves one hardware queue until the device is stopped.
fn queue_loop(qid: u16, udev: &UblkDev, dev: &dyn BlockDev) {
    // One bounce buffer per tag, allocated once when the queue starts.
    let bufs = Rc::new(RefCell::new(udev.alloc_queue_io_bufs()));
    let queue = match UblkQueue::new(qid, udev)
        .and_then(|q| q.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs.borrow()))))
    {
        Ok(q) => q,
        Err(e) => {
            eprintln!("ucrypt ublk: queue {qid} failed to start: {e}");
            return;
        }
    };
    queue.wait_and_handle_io(move |q: &UblkQueue, tag: u16, _io: &UblkIOCtx| {
        let iod = *q.get_iod(tag);
        let res = handle(dev, &iod, bufs.borrow_mut()[tag as usize].as_mut_slice());
        let all = bufs.borrow();
        if let Err(e) = q.complete_io_cmd_unified(
            tag,
            BufDesc::Slice(all[tag as usize].as_slice()),
            Ok(UblkIORes::Result(res)),
        ) {
            eprintln!("ucrypt ublk: completing tag {tag} on queue {qid}: {e}");
        }
    });
}

/// What [`serve`] reports once the device is usable.
#[derive(Debug, Clone)]
pub struct Ready {
    /// The kernel's device id (N of `/dev/ublkbN`).
    pub dev_id: u32,
    /// The block device, `/dev/ublkbN`.
    pub path: std::path::PathBuf,
}

/// Creates the device, prints `ready: /dev/ublkbN`, serves until `stop` is requested, then
/// flushes the volume and deletes the device.
pub fn run(dev: Arc<dyn BlockDev>, opts: UblkOptions, stop: &Stop) -> Result<(), Error> {
    serve(dev, opts, stop, |r: Ready| {
        println!("ready: {}", r.path.display());
        use std::io::Write;
        let _ = std::io::stdout().flush();
    })
}

/// Deletes a ublk device whose server is gone (a daemon killed with SIGKILL leaves its
/// device behind, failing every request): the block device disappears.
pub fn delete_device(dev_id: u32) -> Result<(), Error> {
    let id = i32::try_from(dev_id).map_err(|_| Error::Ublk {
        what: "deleting a ublk device",
        detail: format!("device id {dev_id} out of range"),
    })?;
    let ctrl = UblkCtrl::new_simple(id).map_err(ublk_err("opening the ublk device"))?;
    ctrl.del_dev()
        .map_err(ublk_err("deleting the ublk device"))?;
    Ok(())
}

/// [`run`] that tells `on_ready` (from another thread) instead of printing, once the device
/// exists and serves.
pub fn serve(
    dev: Arc<dyn BlockDev>,
    opts: UblkOptions,
    stop: &Stop,
    on_ready: impl FnOnce(Ready) + Send + Sync + 'static,
) -> Result<(), Error> {
    if !std::path::Path::new("/dev/ublk-control").exists() {
        return Err(Error::NoDriver);
    }
    let ctrl = on_passing_thread(|| {
        UblkCtrlBuilder::default()
            .name("ucrypt")
            .id(opts.id)
            .nr_queues(opts.queues.max(1))
            .depth(QUEUE_DEPTH)
            .io_buf_bytes(IO_BYTES_MAX)
            .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
            .build()
    })
    .map_err(ublk_err("creating the ublk device"))?;
    let dev_id = ctrl.dev_info().dev_id as i32;

    // Stop on request: killing the device makes every queue loop return.
    stop.on_request(move || {
        eprintln!("ucrypt ublk: stopping /dev/ublkb{dev_id}");
        match UblkCtrl::new_simple(dev_id) {
            Ok(c) => {
                let _ = c.kill_dev();
            }
            Err(e) => eprintln!("ucrypt ublk: cannot stop device: {e}"),
        }
    });

    let (size, bs, ro) = (dev.size(), dev.block_size(), dev.read_only());
    let tgt_init = move |d: &mut UblkDev| {
        d.set_default_params(size);
        let p = &mut d.tgt.params;
        p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
        p.basic.attrs = sys::UBLK_ATTR_VOLATILE_CACHE
            | sys::UBLK_ATTR_FUA
            | if ro { sys::UBLK_ATTR_READ_ONLY } else { 0 };
        p.basic.logical_bs_shift = shift_of(bs);
        p.basic.physical_bs_shift = shift_of(bs.max(4096));
        p.basic.io_min_shift = shift_of(bs.max(4096));
        p.basic.io_opt_shift = shift_of(bs.max(4096));
        p.discard.discard_granularity = bs.max(4096);
        p.discard.max_discard_sectors = u32::MAX >> 9;
        p.discard.max_write_zeroes_sectors = u32::MAX >> 9;
        p.discard.max_discard_segments = 1;
        Ok(())
    };
    let served = UblkDev::new(ctrl.get_name(), tgt_init, &ctrl)
        .map_err(ublk_err("serving the ublk device"))
        .and_then(|udev| run_queues(&ctrl, &Arc::new(udev), &dev, on_ready));
    let flushed = dev.flush().map_err(Error::from);
    let _ = on_passing_thread(|| ctrl.del_dev());
    served.and(flushed)
}

/// Entries of a passing thread's control ring (what libublk gives its own).
const CONTROL_RING_DEPTH: u32 = 16;

/// Gives this thread the control ring libublk issues control commands through, if it has none.
fn control_ring() -> Result<(), UblkError> {
    libublk::ublk_init_ctrl_task_ring(|ring| {
        if ring.is_none() {
            *ring = Some(io_uring::IoUring::builder().build(CONTROL_RING_DEPTH)?);
        }
        Ok(())
    })
}

/// Runs `f` on a thread of its own that ends with it, with a control ring. For the device's
/// control commands: the kernel serves each on an io_uring worker of the thread that issued
/// it, and that worker stays as long as the thread does, so a control command issued from a
/// serving thread would leave an idle thread beside every device.
fn on_passing_thread<R: Send>(
    f: impl FnOnce() -> Result<R, UblkError> + Send,
) -> Result<R, UblkError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            control_ring()?;
            f()
        })
        .join()
    })
    .unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// Serves every queue until the device is stopped: queue 0 on this thread, the others on one
/// thread each; a passing thread configures them and starts the device (`START_DEV` returns
/// once every queue has asked for requests), tells `on_ready`, and ends. So an idle device
/// costs this thread and one per further queue.
fn run_queues(
    ctrl: &UblkCtrl,
    udev: &Arc<UblkDev>,
    dev: &Arc<dyn BlockDev>,
    on_ready: impl FnOnce(Ready) + Send,
) -> Result<(), Error> {
    let queues = udev.dev_info.nr_hw_queues;
    // Each queue's thread id, for its CPU affinity and the device's record of it.
    let (tx, rx) = std::sync::mpsc::channel::<(u16, libc::pid_t)>();
    let mut others = Vec::new();
    for qid in 1..queues {
        let (udev, dev, tx) = (udev.clone(), dev.clone(), tx.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("ublk-queue-{qid}"))
            .spawn(move || {
                let _ = tx.send((qid, UblkCtrl::init_queue_thread()));
                queue_loop(qid, &udev, &*dev);
            });
        match spawned {
            Ok(h) => others.push(h),
            Err(e) => {
                // Queue 0 has not started: nothing waits for the queues begun so far but
                // the device's deletion, which ends them.
                let _ = on_passing_thread(|| ctrl.kill_dev());
                for h in others {
                    let _ = h.join();
                }
                return Err(Error::Ublk {
                    what: "starting a ublk queue thread",
                    detail: e.to_string(),
                });
            }
        }
    }
    let _ = tx.send((0, UblkCtrl::init_queue_thread()));
    drop(tx);
    let started = std::thread::scope(|s| {
        let starter = s.spawn(move || {
            let started = control_ring().and_then(|()| {
                for (qid, tid) in rx.iter().take(queues as usize) {
                    ctrl.set_thread_affinity(qid, tid);
                    if let Err(e) = ctrl.configure_queue(udev, qid, tid) {
                        eprintln!("ucrypt ublk: configuring queue {qid}: {e}");
                    }
                }
                ctrl.start_dev(udev)
            });
            match started {
                Ok(_) => {
                    on_ready(Ready {
                        dev_id: ctrl.dev_info().dev_id,
                        path: ctrl.get_bdev_path().into(),
                    });
                    Ok(())
                }
                Err(e) => {
                    // The queues wait for requests that will not come: stopping the device
                    // ends them.
                    let _ = on_passing_thread(|| ctrl.kill_dev());
                    Err(e)
                }
            }
        });
        queue_loop(0, udev, &**dev);
        starter.join()
    });
    for h in others {
        let _ = h.join();
    }
    let _ = on_passing_thread(|| ctrl.stop_dev());
    match started {
        Ok(r) => r.map_err(ublk_err("starting the ublk device")),
        Err(p) => std::panic::resume_unwind(p),
    }
}
