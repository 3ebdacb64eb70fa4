//! The write cost of dm-integrity's journal: an authenticated volume (aes-gcm-random + aead,
//! 4096-byte blocks, the kernel's default journal) on a file, written in journal mode and in
//! direct mode, side by side:
//!
//! - 4 KiB random writes, one flush at the end (commits when a journal section fills);
//! - 4 KiB random writes, each followed by a flush (a journal section per write);
//! - 1 MiB sequential writes, one flush each.
//!
//! Each measurement runs 5 rounds, direct and journal alternating; medians are printed.
//! `cargo run --release -p ucrypt --example integrity_journal_cost [DIR]` (default /dev/shm:
//! the backing file's flushes are then cheap and the numbers show the journal's extra work,
//! not the disk's).

use std::sync::Arc;
use std::time::Instant;

use ucrypt::backend::{Backend, DirectMode, FileBackend};
use ucrypt::integrity::{new_superblock, write_new_device, IntegrityVolume, TagMode, WriteMode};
use ucrypt::{BlockDev, SecretBytes};

const DEVICE_BYTES: u64 = 256 << 20;
const START_BYTES: u64 = 16 << 20;
/// Bytes written per measurement.
const WRITE_BYTES: u64 = 64 << 20;
const WRITE_BYTES_FLUSH_EACH: u64 = 8 << 20;
/// Rounds of each measurement; the median is reported.
const ROUNDS: usize = 5;

fn open(path: &std::path::Path, mode: TagMode, wm: WriteMode) -> IntegrityVolume {
    let be: Arc<dyn Backend> =
        Arc::new(FileBackend::open(path, true, DirectMode::Never).expect("file"));
    let l = new_superblock(
        mode.tuple_bytes() as u16,
        4096,
        START_BYTES / 512,
        DEVICE_BYTES / 512,
        true,
    )
    .expect("superblock");
    write_new_device(be.as_ref(), START_BYTES, &l).expect("format");
    let key: Vec<u8> = (0..mode.key_bytes() as u8).collect();
    IntegrityVolume::with_write_mode(
        be,
        START_BYTES,
        l.sb,
        mode,
        SecretBytes::from_slice(&key),
        false,
        wm,
    )
    .expect("volume")
}

fn rate(bytes: u64, t: Instant) -> f64 {
    bytes as f64 / t.elapsed().as_secs_f64() / (1 << 20) as f64
}

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "/dev/shm".into());
    let path =
        std::path::Path::new(&dir).join(format!("ucrypt-journal-cost-{}", std::process::id()));
    let mode = TagMode::AesGcmRandom { key_bytes: 32 };
    println!("| write | direct MiB/s | journal MiB/s | journal / direct |");
    println!("|---|---|---|---|");
    // Per row and mode, one rate per round; the modes alternate round by round (the machine's
    // clock drifts), and the median is reported.
    let mut rows: Vec<(&str, [Vec<f64>; 2])> = vec![
        ("4 KiB random, flush at the end", [vec![], vec![]]),
        ("4 KiB random, flush after each", [vec![], vec![]]),
        ("1 MiB sequential, flush after each", [vec![], vec![]]),
    ];
    for (k, wm) in (0..ROUNDS).flat_map(|_| {
        [WriteMode::Direct, WriteMode::Journal]
            .into_iter()
            .enumerate()
    }) {
        std::fs::File::create(&path)
            .and_then(|f| f.set_len(DEVICE_BYTES))
            .expect("backing file");
        let v = open(&path, mode, wm);
        let blocks = v.size() / 4096;
        let buf4 = vec![0x5au8; 4096];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % blocks
        };
        let t = Instant::now();
        for _ in 0..WRITE_BYTES / 4096 {
            v.write_at(&buf4, next() * 4096).expect("write");
        }
        v.flush().expect("flush");
        rows[0].1[k].push(rate(WRITE_BYTES, t));
        let t = Instant::now();
        for _ in 0..WRITE_BYTES_FLUSH_EACH / 4096 {
            v.write_at(&buf4, next() * 4096).expect("write");
            v.flush().expect("flush");
        }
        rows[1].1[k].push(rate(WRITE_BYTES_FLUSH_EACH, t));
        let buf1m = vec![0xa5u8; 1 << 20];
        let t = Instant::now();
        let mib = (v.size() >> 20).min(WRITE_BYTES >> 20);
        for i in 0..mib {
            v.write_at(&buf1m, i << 20).expect("write");
            v.flush().expect("flush");
        }
        rows[2].1[k].push(rate(mib << 20, t));
        drop(v);
    }
    let _ = std::fs::remove_file(&path);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (what, [mut d, mut j]) in rows {
        let (d, j) = (median(&mut d), median(&mut j));
        println!("| {what} | {d:.1} | {j:.1} | {:.2} |", j / d);
    }
}
