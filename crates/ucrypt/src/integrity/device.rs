//! [`IntegrityVolume`]: a [`BlockDev`] over a LUKS2 volume with authenticated sectors, reading
//! and writing dm-integrity's on-disk format directly (no journal: the kernel's direct mode
//! 'D', see docs/integrity.md for what that guarantees after a crash).
//!
//! Every read fetches the data and the tags of whole blocks, verifies each block's tag before
//! its plaintext leaves this module, and fails the request with [`Error::Integrity`] (EILSEQ)
//! on the first block that does not verify. Every write encrypts with fresh random IVs and
//! stores the data, then the tags (a read-modify-write of the 512-byte tag sectors it shares
//! with neighbours). Writes exclude each other and reads; reads run together.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::layout::Layout;
use super::superblock::{Superblock, SB_BYTES};
use super::tag::{TagCipher, TagMode};
use crate::backend::Backend;
use crate::blockdev::check_range;
use crate::luks::{read_area, Header, VolumeKey};
use crate::pool::BufferPool;
use crate::sync::lock;
use crate::{BlockDev, Error, Result, SecretBytes};

/// Blocks handled per backend call pair (data + tags); bounds the scratch each request takes.
pub const CHUNK_BYTES: usize = 256 << 10;
/// Scratch memory per volume: enough for 8 chunks in flight at once (data, tag span, tuples).
pub const SCRATCH_POOL_BYTES: usize =
    8 * (CHUNK_BYTES + (CHUNK_BYTES / 512) * TUPLE_BYTES_MAX + 2 * 4096);
/// Largest tuple accepted (dm-integrity's tag size for the modes here is at most 80).
pub const TUPLE_BYTES_MAX: usize = 128;
/// Keyed ciphers kept for reuse between requests (one per concurrent caller at most).
pub const CIPHERS_CACHED_MAX: usize = 16;
/// The largest block dm-integrity supports.
const BLOCK_BYTES_MAX: usize = 4096;

/// Where and how a LUKS2 volume's data is authenticated.
pub struct IntegrityVolume {
    backend: Arc<dyn Backend>,
    /// Byte offset of the dm-integrity superblock on the backend (the segment offset).
    start_bytes: u64,
    layout: Layout,
    mode: TagMode,
    key: SecretBytes,
    ciphers: Mutex<Vec<TagCipher>>,
    pool: BufferPool,
    /// Writes hold it exclusively (tag sectors are shared between neighbouring blocks, and a
    /// write stores data and tags in two steps); reads hold it shared, so a read never sees a
    /// block between its data and its tag and fails spuriously (dm-integrity's range locks
    /// give the kernel the same).
    io_lock: RwLock<()>,
    /// Backend I/O alignment (at least 512).
    io_align: u64,
    read_only: bool,
    integrity_errors: AtomicU64,
}

/// Where the bytes of a write come from.
#[derive(Clone, Copy)]
enum Src<'a> {
    Bytes(&'a [u8]),
    Zeroes,
}

fn align_down(v: u64, a: u64) -> u64 {
    v / a * a
}

impl IntegrityVolume {
    /// A volume over `backend` whose dm-integrity superblock `sb` lies at `start_bytes`, with
    /// tags made by `mode` under `key`.
    pub fn new(
        backend: Arc<dyn Backend>,
        start_bytes: u64,
        sb: Superblock,
        mode: TagMode,
        key: SecretBytes,
        read_only: bool,
    ) -> Result<Self> {
        if usize::from(sb.tag_bytes) != mode.tuple_bytes() {
            return Err(Error::BadHeader {
                check: "integrity tag size",
                detail: format!(
                    "the superblock keeps {} bytes per block; {mode:?} needs {}",
                    sb.tag_bytes,
                    mode.tuple_bytes()
                ),
            });
        }
        if start_bytes % 512 != 0 {
            return Err(Error::BadHeader {
                check: "integrity offset",
                detail: format!("superblock at byte {start_bytes}, not a 512-byte sector"),
            });
        }
        let layout = Layout::for_device(sb, start_bytes / 512, backend.size() / 512)?;
        let io_align = u64::from(backend.logical_block_bytes()).max(512);
        if io_align > u64::from(sb.block_bytes()) || start_bytes % io_align != 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: {io_align}-byte I/O cannot address {}-byte integrity blocks at byte {start_bytes}",
                backend.describe(),
                sb.block_bytes()
            )));
        }
        let cipher = TagCipher::new(mode, key.as_ref())?;
        Ok(IntegrityVolume {
            backend,
            start_bytes,
            layout,
            mode,
            key,
            ciphers: Mutex::new(vec![cipher]),
            pool: BufferPool::new(SCRATCH_POOL_BYTES)?,
            io_lock: RwLock::new(()),
            io_align,
            read_only,
            integrity_errors: AtomicU64::new(0),
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn mode(&self) -> TagMode {
        self.mode
    }

    /// Where data sector `sector` (512-byte units) and its block's tag lie on the backend, in
    /// bytes: `(data, tag)`. For tools and tests that inspect or damage a volume on purpose.
    pub fn locate(&self, sector: u64) -> Option<(u64, u64)> {
        if sector >= self.layout.sb.provided_data_sectors {
            return None;
        }
        let data = self.layout.data_sector(sector)?.checked_mul(512)?;
        let tag = self.layout.tag_byte(sector)?;
        Some((
            self.start_bytes.checked_add(data)?,
            self.start_bytes.checked_add(tag)?,
        ))
    }

    /// Blocks whose tag did not verify, since opening.
    pub fn integrity_errors(&self) -> u64 {
        self.integrity_errors.load(Ordering::Relaxed)
    }

    fn with_cipher<T>(&self, f: impl FnOnce(&mut TagCipher) -> Result<T>) -> Result<T> {
        let cached = lock(&self.ciphers).pop();
        let mut c = match cached {
            Some(c) => c,
            None => TagCipher::new(self.mode, self.key.as_ref())?,
        };
        let r = f(&mut c);
        let mut cache = lock(&self.ciphers);
        if cache.len() < CIPHERS_CACHED_MAX {
            cache.push(c);
        }
        r
    }

    fn block_bytes(&self) -> usize {
        self.layout.sb.block_bytes() as usize
    }

    /// The aligned byte span on the backend holding the tags of `blocks` blocks from
    /// `tag_byte` (relative to the superblock), and where they start inside it.
    fn tag_span(&self, tag_byte: u64, blocks: u64) -> (u64, usize, usize) {
        let tb = u64::from(self.layout.sb.tag_bytes);
        let lo_abs = self.start_bytes + tag_byte;
        let lo = align_down(lo_abs, self.io_align);
        let hi = (lo_abs + blocks * tb).next_multiple_of(self.io_align);
        (lo, (hi - lo) as usize, (lo_abs - lo) as usize)
    }

    /// Reads, verifies and decrypts whole blocks starting at data sector `first` into `out`.
    fn read_blocks(&self, first: u64, out: &mut [u8]) -> Result<()> {
        let bb = self.block_bytes();
        let tb = usize::from(self.layout.sb.tag_bytes);
        debug_assert!(out.len() % bb == 0);
        let mut done = 0usize;
        while done < out.len() {
            let sector = first + (done / 512) as u64;
            let want = ((out.len() - done) / bb).min(CHUNK_BYTES / bb) as u64;
            let e = self
                .layout
                .extent(sector, want)
                .filter(|e| e.blocks > 0)
                .ok_or(Error::Bug("integrity extent outside the device"))?;
            let n = e.blocks as usize;
            let data_len = n * bb;
            let (tag_lo, span, at) = self.tag_span(e.tag_byte, e.blocks);
            let mut g = self.pool.take(data_len + span)?;
            let (dbuf, tbuf) = g.as_mut_slice().split_at_mut(data_len);
            let tbuf = &mut tbuf[..span];
            self.backend
                .read_exact_at(dbuf, self.start_bytes + e.data_byte)?;
            self.backend.read_exact_at(tbuf, tag_lo)?;
            let tuples = &tbuf[at..at + n * tb];
            let verdict = self.with_cipher(|c| c.open(sector, bb, dbuf, tuples))?;
            if let Err(m) = verdict {
                self.integrity_errors.fetch_add(1, Ordering::Relaxed);
                return Err(Error::Integrity { sector: m.sector });
            }
            out[done..done + data_len].copy_from_slice(dbuf);
            done += data_len;
        }
        Ok(())
    }

    /// Encrypts and writes whole blocks starting at data sector `first`; the caller holds
    /// `self.io_lock` exclusively.
    fn write_blocks(&self, first: u64, len: usize, src: Src<'_>) -> Result<()> {
        let bb = self.block_bytes();
        let tb = usize::from(self.layout.sb.tag_bytes);
        debug_assert!(len % bb == 0);
        let mut done = 0usize;
        while done < len {
            let sector = first + (done / 512) as u64;
            let want = ((len - done) / bb).min(CHUNK_BYTES / bb) as u64;
            let e = self
                .layout
                .extent(sector, want)
                .filter(|e| e.blocks > 0)
                .ok_or(Error::Bug("integrity extent outside the device"))?;
            let n = e.blocks as usize;
            let data_len = n * bb;
            let (tag_lo, span, at) = self.tag_span(e.tag_byte, e.blocks);
            let mut g = self.pool.take(data_len + span + n * tb)?;
            let (dbuf, rest) = g.as_mut_slice().split_at_mut(data_len);
            let (tbuf, tuples) = rest.split_at_mut(span);
            let tuples = &mut tuples[..n * tb];
            match src {
                Src::Bytes(b) => dbuf.copy_from_slice(&b[done..done + data_len]),
                Src::Zeroes => dbuf.fill(0),
            }
            self.with_cipher(|c| c.seal(sector, bb, dbuf, tuples))?;
            // Tag sectors are shared with the neighbours: read, patch, write back.
            if at != 0 || n * tb != span {
                self.backend.read_exact_at(tbuf, tag_lo)?;
            }
            tbuf[at..at + n * tb].copy_from_slice(tuples);
            self.backend
                .write_at(dbuf, self.start_bytes + e.data_byte)?;
            self.backend.write_at(tbuf, tag_lo)?;
            done += data_len;
        }
        Ok(())
    }

    /// Splits `offset..offset+len` into a partial head block, whole blocks, a partial tail.
    fn split(&self, offset: u64, len: usize) -> (usize, usize, usize) {
        let bb = self.block_bytes();
        let head_off = (offset % bb as u64) as usize;
        let head = if head_off == 0 {
            0
        } else {
            (bb - head_off).min(len)
        };
        let mid = (len - head) / bb * bb;
        (head, mid, len - head - mid)
    }

    fn write_any(&self, offset: u64, len: usize, src: Src<'_>) -> Result<()> {
        check_range(offset, len as u64, self.size())?;
        if self.read_only {
            return Err(Error::ReadOnly(
                "the integrity volume was opened read-only".into(),
            ));
        }
        let _w = self.io_lock.write().unwrap_or_else(|p| p.into_inner());
        let bb = self.block_bytes();
        let (head, mid, tail) = self.split(offset, len);
        let sub = |from: usize, n: usize| match src {
            Src::Bytes(b) => Src::Bytes(&b[from..from + n]),
            Src::Zeroes => Src::Zeroes,
        };
        // A partial block: read it whole (verified), patch, write it whole.
        let rmw = |block_off: u64, within: usize, piece: Src<'_>, n: usize| -> Result<()> {
            let mut blk = [0u8; BLOCK_BYTES_MAX];
            let blk = &mut blk[..bb];
            self.read_blocks(block_off / 512, blk)?;
            match piece {
                Src::Bytes(b) => blk[within..within + n].copy_from_slice(b),
                Src::Zeroes => blk[within..within + n].fill(0),
            }
            let r = self.write_blocks(block_off / 512, bb, Src::Bytes(blk));
            blk.fill(0);
            r
        };
        if head > 0 {
            let block_off = align_down(offset, bb as u64);
            rmw(block_off, (offset - block_off) as usize, sub(0, head), head)?;
        }
        if mid > 0 {
            self.write_blocks((offset + head as u64) / 512, mid, sub(head, mid))?;
        }
        if tail > 0 {
            let block_off = offset + (head + mid) as u64;
            rmw(block_off, 0, sub(head + mid, tail), tail)?;
        }
        Ok(())
    }
}

impl BlockDev for IntegrityVolume {
    fn size(&self) -> u64 {
        self.layout.sb.provided_data_sectors * 512
    }

    fn block_size(&self) -> u32 {
        self.layout.sb.block_bytes()
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(offset, buf.len() as u64, self.size())?;
        let bb = self.block_bytes();
        let (head, mid, tail) = self.split(offset, buf.len());
        let mut blk = [0u8; BLOCK_BYTES_MAX];
        let _r = self.io_lock.read().unwrap_or_else(|p| p.into_inner());
        let r = (|| {
            if head > 0 {
                let block_off = align_down(offset, bb as u64);
                self.read_blocks(block_off / 512, &mut blk[..bb])?;
                let within = (offset - block_off) as usize;
                buf[..head].copy_from_slice(&blk[within..within + head]);
            }
            if mid > 0 {
                self.read_blocks((offset + head as u64) / 512, &mut buf[head..head + mid])?;
            }
            if tail > 0 {
                self.read_blocks((offset + (head + mid) as u64) / 512, &mut blk[..bb])?;
                buf[head + mid..].copy_from_slice(&blk[..tail]);
            }
            Ok(())
        })();
        blk.fill(0);
        r
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_any(offset, buf.len(), Src::Bytes(buf))
    }

    fn flush(&self) -> Result<()> {
        self.backend.flush()
    }

    /// Discards are advisory and dm-crypt refuses them on authenticated volumes unless asked;
    /// nothing is freed here (a discarded range keeps its old data and tags).
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(offset, len, self.size())?;
        if self.read_only {
            return Err(Error::ReadOnly(
                "the integrity volume was opened read-only".into(),
            ));
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let len = usize::try_from(len).map_err(|_| Error::OutOfRange {
            offset,
            len,
            size: self.size(),
        })?;
        self.write_any(offset, len, Src::Zeroes)
    }
}

/// The byte offset of the dm-integrity superblock of a LUKS2 header's authenticated data
/// segment (the segment offset); `None` if the header has none.
pub fn superblock_offset(hdr: &Header) -> Option<u64> {
    let Header::Luks2(h) = hdr else {
        return None;
    };
    h.meta
        .segments
        .values()
        .find(|s| s.kind == "crypt" && s.integrity.is_some())
        .map(|s| s.offset.0)
}

/// The dm-integrity superblock under a LUKS2 header's authenticated segment (at the segment
/// offset of `data`), with its layout checked against `data`'s size; `None` if the header has
/// no authenticated segment.
pub fn read_superblock(data: &dyn Backend, hdr: &Header) -> Result<Option<Layout>> {
    let Some(start) = superblock_offset(hdr) else {
        return Ok(None);
    };
    let sb = Superblock::parse(&read_area(data, start, SB_BYTES as u64)?)?;
    Layout::for_device(sb, start / 512, data.size() / 512).map(Some)
}

/// Opens the authenticated data segment of a LUKS2 volume whose key is already unlocked:
/// reads the dm-integrity superblock at the segment offset and checks it against the header.
pub fn open_luks2(
    backend: Arc<dyn Backend>,
    hdr: &Header,
    vk: &VolumeKey,
    read_only: bool,
) -> Result<IntegrityVolume> {
    let Header::Luks2(h) = hdr else {
        return Err(Error::UnsupportedLuks(
            "LUKS1 has no authenticated encryption".into(),
        ));
    };
    let crypt: Vec<_> = h
        .meta
        .segments
        .values()
        .filter(|s| s.kind == "crypt")
        .collect();
    let [seg] = crypt[..] else {
        return Err(Error::UnsupportedLuks(format!(
            "{} crypt segments (ucrypt opens volumes with exactly one)",
            crypt.len()
        )));
    };
    let integ = seg.integrity.as_ref().ok_or_else(|| {
        Error::InvalidArgument("the data segment has no integrity protection".into())
    })?;
    if integ.journal_encryption != "none" || integ.journal_integrity != "none" {
        return Err(Error::UnsupportedLuks(format!(
            "journal encryption '{}' / journal integrity '{}' (ucrypt supports 'none')",
            integ.journal_encryption, integ.journal_integrity
        )));
    }
    if seg.iv_tweak.is_some_and(|t| t.0 != 0) {
        return Err(Error::UnsupportedLuks(
            "an authenticated segment with an IV tweak".into(),
        ));
    }
    let mode = TagMode::from_luks2(
        seg.encryption.as_deref().unwrap_or(""),
        &integ.kind,
        vk.bytes().len(),
    )?;
    let sector = u64::from(seg.sector_size.unwrap_or(512));
    let start = seg.offset.0;
    let sb_bytes = read_area(backend.as_ref(), start, SB_BYTES as u64)?;
    let sb = Superblock::parse(&sb_bytes)?;
    if u64::from(sb.block_bytes()) != sector {
        return Err(Error::BadHeader {
            check: "integrity block size",
            detail: format!(
                "the superblock's blocks are {} bytes, the segment's sectors {sector}",
                sb.block_bytes()
            ),
        });
    }
    let read_only = read_only || !hdr.unmet_requirements().is_empty();
    IntegrityVolume::new(
        backend,
        start,
        sb,
        mode,
        SecretBytes::from_slice(vk.bytes()),
        read_only,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemBackend;
    use crate::integrity::superblock::flags;

    const DEVICE_BYTES: u64 = 2 << 20;

    /// Memory whose writes take a while, so that a reader racing a writer would land between a
    /// block's data and its tag if nothing kept it out.
    struct SlowWrites(MemBackend);

    impl Backend for SlowWrites {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
            self.0.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
            std::thread::sleep(std::time::Duration::from_micros(200));
            self.0.write_at(buf, offset)
        }
        fn flush(&self) -> Result<()> {
            self.0.flush()
        }
        fn discard(&self, offset: u64, len: u64) -> Result<()> {
            self.0.discard(offset, len)
        }
        fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
            self.0.write_zeroes(offset, len)
        }
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn logical_block_bytes(&self) -> u32 {
            512
        }
        fn describe(&self) -> String {
            "slow memory".into()
        }
    }

    fn mem_volume(mode: TagMode) -> IntegrityVolume {
        let mut sb = Superblock {
            version: 4,
            log2_interleave_sectors: 10,
            tag_bytes: mode.tuple_bytes() as u16,
            journal_sections: 1,
            provided_data_sectors: 8,
            flags: flags::FIXED_PADDING,
            log2_sectors_per_block: 0,
            log2_blocks_per_bitmap_bit: 0,
            recalc_sector: 0,
            salt: [0; 16],
        };
        sb.provided_data_sectors = Layout::new(sb)
            .expect("layout")
            .max_provided_sectors(0, DEVICE_BYTES / 512);
        let key: Vec<u8> = (0..mode.key_bytes() as u8).collect();
        let be = Arc::new(SlowWrites(MemBackend::new(DEVICE_BYTES)));
        IntegrityVolume::new(be, 0, sb, mode, SecretBytes::from_slice(&key), false).expect("volume")
    }

    /// Readers racing writers over the same blocks (which share tag sectors) never see a block
    /// between its data and its tag: no spurious integrity error, only whole written patterns.
    #[test]
    fn concurrent_reads_and_writes_never_fail_verification() {
        use std::sync::atomic::AtomicBool;
        let v = Arc::new(mem_volume(TagMode::AesGcmRandom { key_bytes: 32 }));
        const BLOCKS: usize = 8;
        const WRITES_PER_WRITER: usize = 100;
        v.write_at(&[1u8; BLOCKS * 512], 0).expect("initial write");
        let done = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..2u8)
            .map(|t| {
                let v = v.clone();
                std::thread::spawn(move || {
                    for i in 0..WRITES_PER_WRITER {
                        let block = (i * 3 + usize::from(t)) % BLOCKS;
                        let fill = vec![(t * 100 + (i % 100) as u8) | 1; 512];
                        v.write_at(&fill, (block * 512) as u64).expect("write");
                    }
                })
            })
            .collect();
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (v, done) = (v.clone(), done.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; BLOCKS * 512];
                    let mut reads = 0u64;
                    while !done.load(Ordering::Relaxed) {
                        v.read_at(&mut buf, 0).expect("read verifies");
                        for b in buf.chunks(512) {
                            assert!(b.iter().all(|&x| x == b[0]), "a whole written pattern");
                        }
                        reads += 1;
                    }
                    reads
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer");
        }
        done.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().expect("reader") > 0);
        }
        assert_eq!(v.integrity_errors(), 0);
    }

    #[test]
    fn ranges_read_only_and_unaligned_requests() {
        let v = mem_volume(TagMode::AesXtsRandomHmac(
            crate::integrity::HmacHash::Sha256,
        ));
        let size = v.size();
        assert!(matches!(
            v.read_at(&mut [0u8; 512], size),
            Err(Error::OutOfRange { .. })
        ));
        v.write_at(&[7u8; 4096], 0).expect("write");
        v.write_at(&[9u8; 1000], 100).expect("unaligned write");
        v.write_zeroes(3000, 200).expect("zeroes");
        let mut b = vec![0u8; 4096];
        v.read_at(&mut b[..3333], 1).expect("unaligned read");
        let mut want = vec![7u8; 4096];
        want[100..1100].fill(9);
        want[3000..3200].fill(0);
        assert_eq!(&b[..3333], &want[1..3334]);
        let ro = IntegrityVolume {
            read_only: true,
            ..v
        };
        assert!(matches!(
            ro.write_at(&[0u8; 512], 0),
            Err(Error::ReadOnly(_))
        ));
    }
}
