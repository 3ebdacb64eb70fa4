//! ublk front end: serves any [`BlockDev`] as a Linux block device `/dev/ublkbN` (needs the
//! kernel's `ublk_drv`, Linux >= 6.0, and root).
//!
//! One queue per CPU, each served by its own thread and io_uring (libublk); within a queue, one
//! task per tag owns its I/O buffer. Requests map to the device by [`plan`], a pure function
//! tested as a table: READ/WRITE (WRITE with FUA = write then flush), FLUSH, DISCARD,
//! WRITE_ZEROES. The device advertises a volatile write cache and FUA, so the kernel sends
//! flushes, and a logical block size equal to the volume's encryption sector, like dm-crypt.
//!
//! [`serve`] blocks until SIGINT/SIGTERM, then stops and removes the device. As libublk warns,
//! a filesystem on the device must be unmounted before that (no shared mount namespace tricks).

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use libublk::ctrl::UblkCtrlBuilder;
use libublk::helpers::IoBuf;
use libublk::io::{UblkDev, UblkQueue};
use libublk::{sys, BufDesc, UblkError, UblkFlags};
use ucrypt::{BlockDev, Error, Result};

/// Queue depth per hardware queue: requests the kernel may have in flight on one queue.
pub const QUEUE_DEPTH_DEFAULT: u16 = 64;
/// Largest request (and per-tag buffer): 512 KiB, so a queue pins at most depth × 512 KiB.
pub const IO_BUF_BYTES: u32 = 512 << 10;
/// Upper bound on queues, whatever the CPU count: each costs a thread and depth buffers.
pub const QUEUES_MAX: usize = 32;
/// Largest discard / write-zeroes the kernel may send in one request (1 GiB, in 512-byte units).
const DISCARD_SECTORS_MAX: u32 = (1 << 30) >> 9;
/// How often the signal thread checks whether the device already went away.
const SIGNAL_POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Clone)]
pub struct UblkOptions {
    /// Hardware queues (0 = one per CPU, at most [`QUEUES_MAX`]).
    pub queues: usize,
    pub depth: u16,
}

impl Default for UblkOptions {
    fn default() -> Self {
        UblkOptions {
            queues: 0,
            depth: QUEUE_DEPTH_DEFAULT,
        }
    }
}

/// What one ublk request asks of the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Read { offset: u64, len: usize },
    Write { offset: u64, len: usize, fua: bool },
    Flush,
    Discard { offset: u64, len: u64 },
    WriteZeroes { offset: u64, len: u64 },
}

/// Maps a request (`op_flags`, `start_sector` and `nr_sectors` in 512-byte units) on a device
/// of `size` bytes with `buf_len`-byte buffers to an [`Action`], or the negative errno to
/// complete it with.
pub fn plan(
    op_flags: u32,
    start_sector: u64,
    nr_sectors: u32,
    size: u64,
    buf_len: usize,
) -> Result<Action, i32> {
    let op = op_flags & 0xff;
    // A flush carries no range: the kernel leaves its start sector at u64::MAX.
    if op == sys::UBLK_IO_OP_FLUSH {
        return Ok(Action::Flush);
    }
    let offset = start_sector.checked_mul(512).ok_or(-libc::EINVAL)?;
    let len = u64::from(nr_sectors) * 512;
    let in_range = offset.checked_add(len).is_some_and(|end| end <= size);
    match op {
        sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE if len as usize > buf_len => {
            Err(-libc::EINVAL)
        }
        _ if !in_range => Err(-libc::EIO),
        sys::UBLK_IO_OP_READ => Ok(Action::Read {
            offset,
            len: len as usize,
        }),
        sys::UBLK_IO_OP_WRITE => Ok(Action::Write {
            offset,
            len: len as usize,
            fua: op_flags & sys::UBLK_IO_F_FUA != 0,
        }),
        sys::UBLK_IO_OP_DISCARD => Ok(Action::Discard { offset, len }),
        sys::UBLK_IO_OP_WRITE_ZEROES => Ok(Action::WriteZeroes { offset, len }),
        _ => Err(-libc::EOPNOTSUPP),
    }
}

/// Performs `action` on `dev`; returns what the request completes with (bytes or -errno).
fn perform(dev: &dyn BlockDev, action: Action, buf: &mut [u8]) -> i32 {
    let r = match action {
        Action::Read { offset, len } => dev.read_at(&mut buf[..len], offset).map(|()| len as i32),
        Action::Write { offset, len, fua } => dev
            .write_at(&buf[..len], offset)
            .and_then(|()| if fua { dev.flush() } else { Ok(()) })
            .map(|()| len as i32),
        Action::Flush => dev.flush().map(|()| 0),
        Action::Discard { offset, len } => dev.discard(offset, len).map(|()| 0),
        Action::WriteZeroes { offset, len } => dev.write_zeroes(offset, len).map(|()| 0),
    };
    r.unwrap_or_else(|e| -e.errno())
}

/// At most this many failed requests are reported on stderr (the rest only counted), so a
/// failing disk cannot flood the log.
const ERRORS_REPORTED_MAX: u64 = 20;
static ERRORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `UCRYPT_UBLK_TRACE=1` logs every request on stderr (debugging only: it is slow).
fn trace() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("UCRYPT_UBLK_TRACE").is_some_and(|v| v == "1"))
}

fn report_error(op_flags: u32, start_sector: u64, nr_sectors: u32, res: i32) {
    let n = ERRORS.fetch_add(1, Ordering::Relaxed);
    if n < ERRORS_REPORTED_MAX {
        eprintln!(
            "ucrypt ublk: request op {} flags {:#x} sector {start_sector} count {nr_sectors} failed: errno {}",
            op_flags & 0xff,
            op_flags >> 8,
            -res
        );
    }
}

async fn tag_task(q: &UblkQueue<'_>, tag: u16, dev: &dyn BlockDev) -> Result<(), UblkError> {
    let buf_len = q.dev.dev_info.max_io_buf_bytes as usize;
    let mut buf = IoBuf::<u8>::new(buf_len);
    q.submit_io_prep_cmd(tag, BufDesc::Slice(buf.as_slice()), 0, Some(&buf))
        .await?;
    loop {
        let iod = q.get_iod(tag);
        let res = match plan(
            iod.op_flags,
            iod.start_sector,
            iod.nr_sectors,
            dev.size(),
            buf_len,
        ) {
            Ok(action) => perform(dev, action, buf.as_mut_slice()),
            Err(e) => e,
        };
        if res < 0 {
            report_error(iod.op_flags, iod.start_sector, iod.nr_sectors, res);
        } else if trace() {
            eprintln!(
                "ucrypt ublk: tag {tag} op {} flags {:#x} sector {} count {} -> {res}",
                iod.op_flags & 0xff,
                iod.op_flags >> 8,
                iod.start_sector,
                iod.nr_sectors
            );
        }
        q.submit_io_commit_cmd(tag, BufDesc::Slice(buf.as_slice()), res)
            .await?;
    }
}

fn queue_thread(qid: u16, udev: &UblkDev, dev: Arc<dyn BlockDev>) {
    let q = match UblkQueue::new(qid, udev) {
        Ok(q) => Rc::new(q),
        Err(e) => {
            eprintln!("ucrypt ublk: queue {qid}: {e}");
            return;
        }
    };
    let exe = Rc::new(smol::LocalExecutor::new());
    let tasks: Vec<_> = q
        .tags()
        .map(|tag| {
            let (q, dev) = (q.clone(), dev.clone());
            exe.spawn(async move {
                match tag_task(&q, tag, dev.as_ref()).await {
                    Ok(()) | Err(UblkError::QueueIsDown) => {}
                    Err(e) => eprintln!("ucrypt ublk: queue {qid} tag {tag}: {e}"),
                }
            })
        })
        .collect();
    let exe2 = exe.clone();
    smol::block_on(exe.run(async move {
        let run_ops = || while exe2.try_tick() {};
        let done = || tasks.iter().all(|t| t.is_finished());
        if let Err(e) = libublk::wait_and_handle_io_events(&q, Some(20), run_ops, done).await {
            eprintln!("ucrypt ublk: queue {qid}: {e}");
        }
    }));
}

fn ublk_err(what: &str, e: UblkError) -> Error {
    Error::io(
        format!("ublk: {what}"),
        std::io::Error::other(e.to_string()),
    )
}

/// Creates `/dev/ublkbN` serving `dev`, calls `ready` with its path once the kernel has it,
/// serves until SIGINT/SIGTERM, then removes the device and flushes `dev`.
pub fn serve(
    dev: Arc<dyn BlockDev>,
    opts: &UblkOptions,
    ready: impl FnOnce(&str) + Send + Sync + 'static,
) -> Result<()> {
    if !std::path::Path::new("/dev/ublk-control").exists() {
        return Err(Error::InvalidArgument(
            "/dev/ublk-control missing: load the ublk_drv kernel module (modprobe ublk_drv)".into(),
        ));
    }
    let block = dev.block_size();
    if !block.is_power_of_two() || !(512..=4096).contains(&block) {
        return Err(Error::InvalidArgument(format!(
            "block size {block} not usable by ublk"
        )));
    }
    let block_shift = block.trailing_zeros() as u8;
    let size = dev.size() / u64::from(block) * u64::from(block);
    let queues = if opts.queues == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    } else {
        opts.queues
    }
    .clamp(1, QUEUES_MAX) as u16;

    let sigs = SignalBlock::new(&[libc::SIGINT, libc::SIGTERM])?;
    let ctrl = UblkCtrlBuilder::default()
        .name("ucrypt")
        .nr_queues(queues)
        .depth(opts.depth)
        .io_buf_bytes(IO_BUF_BYTES)
        .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
        .build()
        .map_err(|e| ublk_err("create device", e))?;

    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let stop = stop.clone();
        let dev_id = ctrl.dev_info().dev_id as i32;
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                if let Some(sig) = sigs.wait(SIGNAL_POLL) {
                    eprintln!("ucrypt ublk: signal {sig}: stopping the device");
                    // libublk's control ring is per thread: this thread needs its own handle.
                    let r = libublk::ctrl::UblkCtrl::new_simple(dev_id).and_then(|c| c.kill_dev());
                    if let Err(e) = r {
                        eprintln!("ucrypt ublk: stop failed: {e}");
                    }
                }
            }
        })
    };

    let read_only = dev.read_only();
    let tgt_init = move |udev: &mut UblkDev| {
        udev.tgt.dev_size = size;
        let mut attrs = sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
        if read_only {
            attrs |= sys::UBLK_ATTR_READ_ONLY;
        }
        udev.tgt.params = sys::ublk_params {
            types: sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD,
            basic: sys::ublk_param_basic {
                attrs,
                logical_bs_shift: block_shift,
                physical_bs_shift: block_shift.max(12),
                io_opt_shift: block_shift.max(12),
                io_min_shift: block_shift,
                max_sectors: udev.dev_info.max_io_buf_bytes >> 9,
                dev_sectors: size >> 9,
                ..Default::default()
            },
            discard: sys::ublk_param_discard {
                discard_granularity: block,
                max_discard_sectors: DISCARD_SECTORS_MAX,
                max_write_zeroes_sectors: DISCARD_SECTORS_MAX,
                max_discard_segments: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        Ok(())
    };
    let qdev = dev.clone();
    let q_fn = move |qid: u16, udev: &UblkDev| queue_thread(qid, udev, qdev.clone());
    let ready_fn = move |c: &libublk::ctrl::UblkCtrl| ready(&c.get_bdev_path());
    let run = ctrl.run_target(tgt_init, q_fn, ready_fn);

    stop.store(true, Ordering::Release);
    let _ = watcher.join();
    let del = ctrl.del_dev();
    run.map_err(|e| ublk_err("serve", e))?;
    del.map_err(|e| ublk_err("remove device", e))?;
    dev.flush()
}

/// Blocks signals in this thread and the threads it starts, so one thread can take them with
/// `sigtimedwait`. The mask stays for the life of the process (the server ends with it).
struct SignalBlock {
    set: libc::sigset_t,
}

impl SignalBlock {
    fn new(signals: &[i32]) -> Result<Self> {
        // SAFETY: sigset_t is plain data; sigemptyset initialises it before use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t owned by this frame.
        unsafe { libc::sigemptyset(&mut set) };
        for &s in signals {
            // SAFETY: as above; `s` is a valid signal number.
            unsafe { libc::sigaddset(&mut set, s) };
        }
        // SAFETY: `set` is valid for the call; the old mask is not needed.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(Error::io(
                "block signals",
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(SignalBlock { set })
    }

    fn wait(&self, timeout: Duration) -> Option<i32> {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `self.set` and `ts` are valid for the call; siginfo may be null.
        let s = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &ts) };
        (s > 0).then_some(s)
    }
}

// SAFETY: sigset_t is a plain bit set with no pointers; it is only read after construction.
unsafe impl Send for SignalBlock {}

#[cfg(test)]
mod tests {
    use super::*;

    const R: u32 = sys::UBLK_IO_OP_READ;
    const W: u32 = sys::UBLK_IO_OP_WRITE;
    const FUA: u32 = sys::UBLK_IO_F_FUA;

    #[test]
    fn plan_table() {
        const SIZE: u64 = 1 << 20;
        const BUF: usize = 512 << 10;
        // (op_flags, start_sector, nr_sectors, expected)
        let rows: &[(u32, u64, u32, Result<Action, i32>)] = &[
            (
                R,
                0,
                8,
                Ok(Action::Read {
                    offset: 0,
                    len: 4096,
                }),
            ),
            (
                W,
                8,
                8,
                Ok(Action::Write {
                    offset: 4096,
                    len: 4096,
                    fua: false,
                }),
            ),
            (
                W | FUA,
                8,
                8,
                Ok(Action::Write {
                    offset: 4096,
                    len: 4096,
                    fua: true,
                }),
            ),
            (sys::UBLK_IO_OP_FLUSH, 0, 0, Ok(Action::Flush)),
            (sys::UBLK_IO_OP_FLUSH, u64::MAX, 0, Ok(Action::Flush)),
            (
                sys::UBLK_IO_OP_DISCARD,
                16,
                2032,
                Ok(Action::Discard {
                    offset: 8192,
                    len: 2032 * 512,
                }),
            ),
            (sys::UBLK_IO_OP_DISCARD, 16, 2048, Err(-libc::EIO)),
            (
                sys::UBLK_IO_OP_WRITE_ZEROES,
                0,
                2048,
                Ok(Action::WriteZeroes {
                    offset: 0,
                    len: 1 << 20,
                }),
            ),
            (R, 2047, 2, Err(-libc::EIO)),
            (R, 0, 2048, Err(-libc::EINVAL)),
            (sys::UBLK_IO_OP_WRITE_SAME, 0, 8, Err(-libc::EOPNOTSUPP)),
            (R, u64::MAX, 1, Err(-libc::EINVAL)),
        ];
        for (i, &(op, start, n, want)) in rows.iter().enumerate() {
            assert_eq!(plan(op, start, n, SIZE, BUF), want, "row {i}");
        }
    }
}
