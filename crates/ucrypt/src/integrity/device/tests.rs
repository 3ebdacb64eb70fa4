use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::open::write_new_device;
use super::*;
use crate::backend::Backend;
use crate::backend::MemBackend;
use crate::integrity::layout::Layout;
use crate::integrity::superblock::flags;
use crate::integrity::superblock::{Superblock, SB_BYTES};
use crate::integrity::tag::TagMode;
use crate::luks::read_area;
use crate::{Error, SecretBytes};

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
    let be: Arc<dyn Backend> = Arc::new(SlowWrites(MemBackend::new(DEVICE_BYTES)));
    mem_volume_on(be, mode, false)
}

fn mem_volume_on(be: Arc<dyn Backend>, mode: TagMode, read_only: bool) -> IntegrityVolume {
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
    let l = Layout::new(sb).expect("layout");
    if Superblock::parse(&read_area(be.as_ref(), 0, SB_BYTES as u64).expect("read")).is_err() {
        write_new_device(be.as_ref(), 0, &l).expect("format");
    }
    IntegrityVolume::new(be, 0, sb, mode, SecretBytes::from_slice(&key), read_only).expect("volume")
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
    let mode = TagMode::xts_random_hmac(crate::integrity::HmacHash::Sha256);
    let be: Arc<dyn Backend> = Arc::new(MemBackend::new(DEVICE_BYTES));
    let v = mem_volume_on(be.clone(), mode, false);
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
    v.flush().expect("flush: commits the open journal section");
    // Committed and written back: a read-only open checks the entries are in place.
    let ro = mem_volume_on(be.clone(), mode, true);
    let mut b = vec![0u8; 4096];
    ro.read_at(&mut b[..3333], 1)
        .expect("read-only, entries in place");
    assert_eq!(&b[..3333], &want[1..3334]);
    assert!(matches!(
        ro.write_at(&[0u8; 512], 0),
        Err(Error::ReadOnly(_))
    ));
    drop(ro);
    // Committed, not written back (as after a crash): a read-only open refuses.
    v.hold_writeback_for_tests();
    v.write_at(&[3u8; 1024], 2048).expect("write");
    v.flush().expect("commit");
    let ro = IntegrityVolume::new(
        v.backend.clone(),
        0,
        v.layout.sb,
        v.mode,
        SecretBytes::from_slice(v.key.as_ref()),
        true,
    );
    assert!(
        matches!(ro, Err(Error::ReadOnly(_))),
        "a journal with entries not in place refuses a read-only open"
    );
    drop(v);
    // A read-write open replays them; afterwards the journal is empty.
    let rw = mem_volume_on(be.clone(), mode, false);
    assert_eq!(rw.replay_report().entries, 2);
    drop(rw);
    let ro = mem_volume_on(be, mode, true);
    want[2048..3072].fill(3);
    ro.read_at(&mut b, 0).expect("read after the replay");
    assert_eq!(b, want);
}
