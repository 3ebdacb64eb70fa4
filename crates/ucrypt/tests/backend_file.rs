//! FileBackend on a real file: O_DIRECT when possible, short files, discard (punch hole),
//! write-zeroes, flush, range checks.

mod common;

use common::TempFile;
use ucrypt::backend::{Backend, DirectMode, FileBackend};

#[test]
fn file_backend_round_trip_discard_zeroes() {
    for mode in [DirectMode::Auto, DirectMode::Never] {
        let f = TempFile::new(1 << 20);
        let b = FileBackend::open(&f.0, true, mode).unwrap();
        eprintln!(
            "{} (note: {:?}), block {} mem align {}",
            b.describe(),
            b.note(),
            b.logical_block_bytes(),
            b.mem_align_bytes()
        );
        assert_eq!(b.size(), 1 << 20);
        if mode == DirectMode::Never {
            assert!(!b.is_direct());
        }
        // Aligned buffer for O_DIRECT.
        let mut store = vec![0u8; 3 * 4096];
        let start = (4096 - store.as_ptr() as usize % 4096) % 4096;
        let buf = &mut store[start..start + 8192];
        buf.fill(0xab);
        b.write_at(buf, 4096).unwrap();
        b.flush().unwrap();
        buf.fill(0);
        b.read_exact_at(buf, 4096).unwrap();
        assert!(buf.iter().all(|&x| x == 0xab));
        b.write_zeroes(4096, 4096).unwrap();
        b.discard(8192, 4096).unwrap();
        b.read_exact_at(buf, 4096).unwrap();
        assert!(buf[..4096].iter().all(|&x| x == 0), "write_zeroes");
        // A discarded range may read back as anything; on tmpfs/ext4 a punched hole is zeroes.
        // Past the end: a short read, then an error from read_exact_at.
        assert_eq!(b.read_at(buf, (1 << 20) - 4096).unwrap(), 4096);
        let e = b.read_exact_at(buf, (1 << 20) - 4096).unwrap_err();
        assert!(e.to_string().contains("ended early"), "{e}");
        assert!(matches!(
            b.write_at(&buf[..4096], 1 << 20),
            Err(ucrypt::Error::OutOfRange { .. })
        ));
    }
}

#[test]
fn read_only_open_refuses_writes() {
    let f = TempFile::new(1 << 16);
    let b = FileBackend::open(&f.0, false, DirectMode::Never).unwrap();
    let e = b.write_at(&[0u8; 512], 0).unwrap_err();
    assert_eq!(e.errno(), libc::EBADF, "{e}");
}
