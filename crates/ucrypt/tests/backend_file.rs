//! FileBackend on a real file: O_DIRECT when possible, short files, discard (punch hole),
//! write-zeroes, flush, range checks.

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::TempFile;
use ucrypt::backend::{Backend, CacheMode, DirectMode, FileBackend};

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

/// Open flags of the descriptor a backend holds, from /proc/self/fdinfo (its only open file
/// on `path`).
fn direct_flag_of(path: &std::path::Path) -> bool {
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if std::fs::read_link(e.path()).ok().as_deref() == Some(path) {
            let info = std::fs::read_to_string(format!(
                "/proc/self/fdinfo/{}",
                e.file_name().to_str().unwrap()
            ))
            .unwrap();
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .map(|v| u32::from_str_radix(v.trim(), 8).unwrap())
                .unwrap();
            return flags & libc_o_direct() != 0;
        }
    }
    panic!("{} is not open", path.display());
}

fn libc_o_direct() -> u32 {
    0o40000 // O_DIRECT on x86-64 and aarch64 Linux
}

#[test]
fn cache_modes_open_as_named_and_keep_data() {
    for (name, direct) in [
        ("none", true),
        ("writeback", false),
        ("writethrough", false),
        ("directsync", true),
        ("unsafe", false),
    ] {
        let mode: CacheMode = name.parse().unwrap();
        assert_eq!(mode.to_string(), name);
        let f = TempFile::new(1 << 20);
        let b = FileBackend::open_cached(&f.0, true, mode).unwrap();
        assert_eq!(b.cache_mode(), mode);
        // /dev/shm and other filesystems may refuse O_DIRECT: then none falls back, with a note.
        let want_direct = direct && b.note().is_none();
        assert_eq!(b.is_direct(), want_direct, "{name}: {}", b.describe());
        let canonical = std::fs::canonicalize(&f.0).unwrap();
        assert_eq!(
            direct_flag_of(&canonical),
            want_direct,
            "{name}: descriptor flags"
        );
        let mut store = vec![0u8; 3 * 4096];
        let start = (4096 - store.as_ptr() as usize % 4096) % 4096;
        let buf = &mut store[start..start + 4096];
        buf.fill(0x5c);
        b.write_at(buf, 8192).unwrap();
        b.write_at_fua(buf, 16384).unwrap();
        b.flush().unwrap();
        drop(b);
        let on_disk = std::fs::read(&f.0).unwrap();
        assert!(
            on_disk[8192..8192 + 4096].iter().all(|&x| x == 0x5c),
            "{name}"
        );
        assert!(
            on_disk[16384..16384 + 4096].iter().all(|&x| x == 0x5c),
            "{name}"
        );
    }
    assert!("fast"
        .parse::<CacheMode>()
        .unwrap_err()
        .to_string()
        .contains("writeback"));
}
