//! Model-based test: seeded random sequences of reads, writes (`write_at` and, giving up the
//! buffer, `write_at_mut`), flushes, discards and
//! write-zeroes (random sizes, offsets, alignments) against a plaintext model, for every policy,
//! 512- and 4096-byte sectors, memory and O_DIRECT file backends. At the end, the ciphertext on
//! the backend must equal what `SectorCipher` computes one sector at a time.
//! Replay a failure with `UCRYPT_TEST_SEED=<seed printed on failure>`.

#![allow(clippy::needless_range_loop)] // byte-by-byte comparison with the model reads best with indices

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ucrypt::engine::Policy;
use ucrypt::sector::{CipherSpec, SectorCipher};
use ucrypt::BlockDev;

struct Model {
    data: Vec<u8>,
    /// False after a discard: the bytes may read back as anything.
    known: Vec<bool>,
}

fn random_extent(rng: &mut StdRng, size: u64, sector: u64) -> (u64, u64) {
    // Mostly small, sometimes big enough to be split among workers and across pool pieces.
    let len = match rng.random_range(0..10) {
        0..=3 => rng.random_range(1..=3 * sector),
        4..=6 => rng.random_range(1..=64) * sector,
        7 => rng.random_range(0..=600_000u64),
        _ => rng.random_range(1..=8192u64),
    }
    .min(size);
    let mut off = rng.random_range(0..=size - len);
    if rng.random_bool(0.5) {
        off = off / sector * sector;
    }
    (off, len)
}

fn run_case(kind: BackendKind, spec: CipherSpec, sector: u32, policy: Policy, seed: u64) {
    let ctx = format!("{kind:?} {spec} sector {sector} policy {policy} seed {seed}");
    let size = 3u64 << 20;
    let r = rig(RigCfg {
        kind,
        spec,
        sector,
        policy,
        // Smaller than the biggest requests: exercises pieces.
        pool_bytes: 256 << 10,
        size,
        data_offset: 16384,
        seed,
        ..RigCfg::default()
    });
    let mut rng = StdRng::seed_from_u64(seed);
    let mut m = Model {
        data: vec![0; size as usize],
        known: vec![false; size as usize],
    };
    let ss = sector as u64;
    for step in 0..250 {
        let (off, len) = random_extent(&mut rng, size, ss);
        let (o, l) = (off as usize, len as usize);
        match rng.random_range(0..10) {
            0..=3 => {
                let mut b = OffsetBuf::new(
                    l,
                    if rng.random_bool(0.5) {
                        0
                    } else {
                        rng.random_range(1..4096)
                    },
                );
                r.vol
                    .read_at(b.get(), off)
                    .unwrap_or_else(|e| panic!("{ctx} step {step}: read {off}+{len}: {e}"));
                let got = b.get();
                for i in 0..l {
                    if m.known[o + i] && got[i] != m.data[o + i] {
                        panic!(
                            "{ctx} step {step}: read {off}+{len}: byte {} differs",
                            o + i
                        );
                    }
                }
            }
            4..=6 => {
                // Half the writes give up their buffer (`write_at_mut`), half of those from an
                // aligned one: the in-place path when the request is aligned too.
                let give = rng.random_bool(0.5);
                let shift = if give && rng.random_bool(0.5) {
                    0
                } else {
                    rng.random_range(0..4096)
                };
                let mut b = OffsetBuf::new(l, shift);
                rng.fill(b.get());
                m.data[o..o + l].copy_from_slice(b.get());
                m.known[o..o + l].fill(true);
                let res = if give {
                    r.vol.write_at_mut(b.get(), off)
                } else {
                    r.vol.write_at(b.get(), off)
                };
                res.unwrap_or_else(|e| panic!("{ctx} step {step}: write {off}+{len}: {e}"));
            }
            7 => r
                .vol
                .flush()
                .unwrap_or_else(|e| panic!("{ctx} step {step}: flush: {e}")),
            8 => {
                r.vol
                    .discard(off, len)
                    .unwrap_or_else(|e| panic!("{ctx} step {step}: discard {off}+{len}: {e}"));
                // Only whole sectors inside the range may change.
                let first = off.div_ceil(ss);
                let end = (off + len) / ss;
                if end > first {
                    m.known[(first * ss) as usize..(end * ss) as usize].fill(false);
                }
            }
            _ => {
                r.vol
                    .write_zeroes(off, len)
                    .unwrap_or_else(|e| panic!("{ctx} step {step}: write-zeroes {off}+{len}: {e}"));
                m.data[o..o + l].fill(0);
                m.known[o..o + l].fill(true);
            }
        }
    }
    // Out of range is refused.
    let mut one = [0u8; 1];
    assert!(
        matches!(
            r.vol.read_at(&mut one, size),
            Err(ucrypt::Error::OutOfRange { .. })
        ),
        "{ctx}"
    );
    assert!(
        matches!(
            r.vol.write_at(&one, size),
            Err(ucrypt::Error::OutOfRange { .. })
        ),
        "{ctx}"
    );
    // Whole-volume read-back.
    let mut all = vec![0u8; size as usize];
    r.vol.read_at(&mut all, 0).unwrap();
    for i in 0..size as usize {
        if m.known[i] && all[i] != m.data[i] {
            panic!("{ctx}: final read: byte {i} differs");
        }
    }
    // Ciphertext equals a sector-at-a-time reference encryption of the model.
    let mut reference = SectorCipher::new(spec, &r.key, r.geometry).unwrap();
    let mut ct = vec![0u8; ss as usize];
    let mut want = vec![0u8; ss as usize];
    for s in 0..size / ss {
        let range = (s * ss) as usize..((s + 1) * ss) as usize;
        if !m.known[range.clone()].iter().all(|&k| k) {
            continue;
        }
        r.backend
            .read_exact_at(&mut ct, r.data_offset + s * ss)
            .unwrap();
        want.copy_from_slice(&m.data[range]);
        reference.encrypt(s, &mut want).unwrap();
        assert!(
            ct == want,
            "{ctx}: ciphertext of sector {s} differs from the reference"
        );
    }
}

#[test]
fn model_all_policies_sectors_backends() {
    let base = kit::seed_or(20261122);
    let mut case = 0u64;
    for kind in [BackendKind::Mem, BackendKind::File] {
        for sector in [512u32, 4096] {
            for policy in Policy::ALL {
                case += 1;
                run_case(
                    kind,
                    CipherSpec::AES_XTS_PLAIN64,
                    sector,
                    policy,
                    base.wrapping_add(case),
                );
            }
        }
    }
}

#[test]
fn model_other_ciphers() {
    let base = kit::seed_or(777);
    for (i, spec) in ["aes-cbc-essiv:sha256", "cipher_null-ecb", "aes-xts-plain"]
        .iter()
        .enumerate()
    {
        let spec: CipherSpec = spec.parse().unwrap();
        run_case(BackendKind::Mem, spec, 4096, Policy::Auto, base + i as u64);
        run_case(
            BackendKind::File,
            spec,
            512,
            Policy::Parallel,
            base + 10 + i as u64,
        );
    }
}
