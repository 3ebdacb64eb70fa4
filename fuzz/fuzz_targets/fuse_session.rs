//! Fuzzes the FUSE front end with whole sessions of `/dev/fuse` requests, served by the
//! sans-I/O handler over a 64 KiB in-memory device: each request is as long as its header's
//! length field says (or what is left), exactly as the classic transport hands it over. The
//! handler must never panic, and every reply must lie inside the request buffer.
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none fuse_session`
#![no_main]

use std::sync::{Arc, Mutex};

use libfuzzer_sys::fuzz_target;
use ucrypt::BlockDev;
use ucrypt_fuse::{FsConfig, PunchHole, VolumeFs};

const DEV_BYTES: usize = 64 << 10;
/// The request buffer: room for the largest request this target is fed, and read replies.
const BUF_BYTES: usize = 128 << 10;

struct Mem(Mutex<Vec<u8>>);

impl Mem {
    fn range(&self, offset: u64, len: u64) -> ucrypt::Result<std::ops::Range<usize>> {
        ucrypt::blockdev::check_range(offset, len, DEV_BYTES as u64)?;
        Ok(offset as usize..(offset + len) as usize)
    }
}

impl BlockDev for Mem {
    fn size(&self) -> u64 {
        DEV_BYTES as u64
    }
    fn block_size(&self) -> u32 {
        4096
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        let r = self.range(offset, buf.len() as u64)?;
        buf.copy_from_slice(&self.0.lock().unwrap()[r]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        let r = self.range(offset, buf.len() as u64)?;
        self.0.lock().unwrap()[r].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> ucrypt::Result<()> {
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.write_zeroes(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        let r = self.range(offset, len)?;
        self.0.lock().unwrap()[r].fill(0);
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, mut rest)) = data.split_first() else { return };
    let cfg = FsConfig {
        file_name: (pick & 1 != 0).then(|| "disk".to_string()),
        direct_io: pick & 2 != 0,
        punch_hole: if pick & 4 != 0 { PunchHole::Discard } else { PunchHole::Zeroes },
        uid: 0,
        gid: 0,
        want_io_uring: pick & 8 != 0,
    };
    let fs = VolumeFs::new(Arc::new(Mem(Mutex::new(vec![0; DEV_BYTES]))), cfg);
    let mut buf = vec![0u8; BUF_BYTES];
    while rest.len() >= 4 {
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let n = len.clamp(4, rest.len()).min(BUF_BYTES);
        buf[..n].copy_from_slice(&rest[..n]);
        rest = &rest[n..];
        if let Some(reply) = fs.handle_classic(&mut buf, n) {
            assert!(reply.body.end <= BUF_BYTES, "reply body outside the buffer");
        }
    }
});
