//! Request buffers: page-aligned, with room for the reply header in front, and reused from
//! request to request by every connection of the server.
//!
//! Why: a read lands in an [`IoBuf`] at an address the volume's backend accepts for direct
//! I/O, so the volume reads and decrypts in place (no bounce buffer, no copy, no wipe of a
//! bounce buffer), and the reply header sits right before the data so header and data leave in
//! one write. Reusing buffers spares the allocator's zeroing (and, for large requests, fresh
//! page faults) on every request. Spare buffers are bounded ([`SPARE_BYTES_MAX`],
//! [`SPARE_BUFFERS_MAX`]) and wiped when dropped: they may hold plaintext.

use zeroize::Zeroize;

use std::sync::Mutex;
use ucrypt::sync::lock;

/// Alignment of the data in a buffer: a page, what O_DIRECT asks of memory on every device
/// seen so far (the volume falls back to a bounce buffer if its backend wants more).
pub const BUF_ALIGN_BYTES: usize = ucrypt::sync::PAGE_BYTES;
/// Smallest data capacity allocated, so small requests share buffers.
const BUF_MIN_BYTES: usize = 4096;
/// Idle bytes the server keeps for reuse: a few queue-depth-32 4 KiB clients or a handful of
/// 1 MiB requests go without allocating; beyond this, returned buffers are freed.
pub const SPARE_BYTES_MAX: usize = 16 << 20;
/// Idle buffers the server keeps (bounds the best-fit search too).
pub const SPARE_BUFFERS_MAX: usize = 64;

/// A buffer whose data area starts page-aligned with at least `head` bytes in front of it.
pub struct IoBuf {
    mem: Vec<u8>,
    /// Offset of the aligned data area in `mem`.
    data_at: usize,
}

impl IoBuf {
    /// A buffer for at least `data_bytes` of data with `head` bytes (at most one alignment
    /// unit) available right before it.
    pub fn new(data_bytes: usize, head: usize) -> IoBuf {
        debug_assert!(head <= BUF_ALIGN_BYTES);
        let data_bytes = data_bytes.max(BUF_MIN_BYTES);
        // Room to slide the data to an aligned address with `head` bytes before it.
        let mem = vec![0u8; data_bytes + 2 * BUF_ALIGN_BYTES];
        let addr = mem.as_ptr() as usize;
        let first_aligned = (BUF_ALIGN_BYTES - addr % BUF_ALIGN_BYTES) % BUF_ALIGN_BYTES;
        let data_at = if first_aligned >= head {
            first_aligned
        } else {
            first_aligned + BUF_ALIGN_BYTES
        };
        IoBuf { mem, data_at }
    }

    /// Data bytes this buffer holds at most.
    pub fn capacity(&self) -> usize {
        self.mem.len() - self.data_at
    }

    /// The first `len` data bytes.
    pub fn data_mut(&mut self, len: usize) -> &mut [u8] {
        &mut self.mem[self.data_at..self.data_at + len]
    }

    /// `head` bytes before the data and the first `len` data bytes, as one slice.
    pub fn with_head_mut(&mut self, head: usize, len: usize) -> &mut [u8] {
        &mut self.mem[self.data_at - head..self.data_at + len]
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        // It may hold plaintext of the volume.
        self.mem.zeroize();
    }
}

/// Idle buffers of the server.
pub struct Spares {
    state: Mutex<SpareState>,
    /// Head room every buffer handed out has.
    head: usize,
}

struct SpareState {
    bufs: Vec<IoBuf>,
    bytes: usize,
}

impl Spares {
    pub fn new(head: usize) -> Spares {
        Spares {
            state: Mutex::new(SpareState {
                bufs: Vec::new(),
                bytes: 0,
            }),
            head,
        }
    }

    /// The smallest spare buffer that holds `len` bytes, or a new one.
    pub fn take(&self, len: usize) -> IoBuf {
        {
            let mut s = lock(&self.state);
            let best = s
                .bufs
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            if let Some(i) = best {
                let b = s.bufs.swap_remove(i);
                s.bytes -= b.capacity();
                return b;
            }
        }
        IoBuf::new(len, self.head)
    }

    /// Keeps `b` for reuse if within the limits, else frees it.
    pub fn give(&self, b: IoBuf) {
        let mut s = lock(&self.state);
        if s.bufs.len() < SPARE_BUFFERS_MAX && s.bytes + b.capacity() <= SPARE_BYTES_MAX {
            s.bytes += b.capacity();
            s.bufs.push(b);
            return;
        }
        drop(s);
        drop(b); // wiped and freed outside the lock
    }

    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let s = lock(&self.state);
        (s.bufs.len(), s.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_is_aligned_with_head_room() {
        // (data bytes asked, head room)
        let rows = [
            (0, 16),
            (512, 16),
            (4096, 16),
            (4096, 0),
            (1 << 20, 16),
            (5000, 4096),
        ];
        for (len, head) in rows {
            let mut b = IoBuf::new(len, head);
            assert!(b.capacity() >= len.max(BUF_MIN_BYTES), "{len} {head}");
            assert_eq!(b.data_mut(len).as_ptr() as usize % BUF_ALIGN_BYTES, 0);
            let s = b.with_head_mut(head, len);
            assert_eq!(s.len(), head + len);
            s[head..].fill(7);
            assert!(b.data_mut(len).iter().all(|&x| x == 7));
        }
    }

    #[test]
    fn spares_best_fit_and_limits() {
        let sp = Spares::new(16);
        let small = sp.take(4096);
        let big = sp.take(1 << 20);
        let (small_cap, big_cap) = (small.capacity(), big.capacity());
        sp.give(big);
        sp.give(small);
        assert_eq!(sp.held(), (2, small_cap + big_cap));
        // A 4 KiB request gets the small buffer, a 64 KiB one the big buffer.
        let a = sp.take(4096);
        assert_eq!(a.capacity(), small_cap);
        let b = sp.take(64 << 10);
        assert_eq!(b.capacity(), big_cap);
        assert_eq!(sp.held(), (0, 0));
        // Nothing spare: a new buffer.
        let c = sp.take(4096);
        for x in [a, b, c] {
            sp.give(x);
        }
        assert_eq!(sp.held().0, 3);
        // The byte limit: buffers beyond it are freed, not kept.
        let many: Vec<IoBuf> = (0..20).map(|_| sp.take(1 << 20)).collect();
        for x in many {
            sp.give(x);
        }
        let (n, bytes) = sp.held();
        assert!(
            bytes <= SPARE_BYTES_MAX && n <= SPARE_BUFFERS_MAX,
            "{n} {bytes}"
        );
        // The count limit.
        let small: Vec<IoBuf> = (0..SPARE_BUFFERS_MAX + 10).map(|_| sp.take(1)).collect();
        for x in small {
            sp.give(x);
        }
        assert!(sp.held().0 <= SPARE_BUFFERS_MAX);
    }
}
