//! Keyslot key derivation: PBKDF2 (sha1/sha256/sha512), Argon2i and Argon2id, with cost
//! calibration the way cryptsetup does it (target time, bounded memory).

use super::util::HashAlg;
use crate::{Error, Result, SecretBytes};

/// Salt length cryptsetup writes for keyslots and digests.
pub const SALT_BYTES: usize = 32;
/// Largest Argon2 memory cost accepted from a header or the command line: cryptsetup's own
/// maximum (4 GiB). A hostile header cannot make us allocate more.
pub const ARGON2_MEMORY_KIB_MAX: u32 = 4 * 1024 * 1024;
/// Smallest Argon2 memory cost cryptsetup accepts.
pub const ARGON2_MEMORY_KIB_MIN: u32 = 32;
/// Largest Argon2 parallelism accepted (cryptsetup's limit for LUKS2 is 4 by default and never
/// above this).
pub const ARGON2_CPUS_MAX: u32 = 16;
/// Smallest Argon2 time cost cryptsetup writes.
pub const ARGON2_TIME_MIN: u32 = 4;
/// Smallest PBKDF2 iteration count cryptsetup writes (keyslots and digests).
pub const PBKDF2_ITERATIONS_MIN: u32 = 1000;
/// Largest salt accepted from a header: a bound on what a hostile header can make us hash.
pub const SALT_BYTES_MAX: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Argon2Variant {
    I,
    Id,
}

impl Argon2Variant {
    pub fn name(self) -> &'static str {
        match self {
            Argon2Variant::I => "argon2i",
            Argon2Variant::Id => "argon2id",
        }
    }
}

/// A validated key derivation function with its parameters and salt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kdf {
    Pbkdf2 {
        hash: HashAlg,
        iterations: u32,
        salt: Vec<u8>,
    },
    Argon2 {
        variant: Argon2Variant,
        cost: Argon2Cost,
        salt: Vec<u8>,
    },
}

/// Argon2's costs, as a LUKS2 header stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Argon2Cost {
    /// Passes over the memory (the header's `time`).
    pub time: u32,
    pub memory_kib: u32,
    /// Lanes (the header's `cpus`).
    pub cpus: u32,
}

impl Kdf {
    pub fn name(&self) -> &'static str {
        match self {
            Kdf::Pbkdf2 { .. } => "pbkdf2",
            Kdf::Argon2 { variant, .. } => variant.name(),
        }
    }

    /// Checks the bounds that protect a reader (memory, parallelism, salt length).
    pub fn check(&self) -> Result<()> {
        let bad = |d: String| {
            Err(Error::BadHeader {
                check: "kdf",
                detail: d,
            })
        };
        match self {
            Kdf::Pbkdf2 {
                iterations, salt, ..
            } => {
                if *iterations == 0 {
                    return bad("pbkdf2 iterations is 0".into());
                }
                if salt.is_empty() || salt.len() > SALT_BYTES_MAX {
                    return bad(format!("salt of {} bytes", salt.len()));
                }
            }
            Kdf::Argon2 { cost, salt, .. } => {
                let Argon2Cost {
                    time,
                    memory_kib,
                    cpus,
                } = *cost;
                if time == 0 {
                    return bad("argon2 time cost is 0".into());
                }
                if memory_kib > ARGON2_MEMORY_KIB_MAX || memory_kib < 8 * cpus {
                    return bad(format!(
                        "argon2 memory {memory_kib} KiB outside 8*cpus..={ARGON2_MEMORY_KIB_MAX}"
                    ));
                }
                if cpus == 0 || cpus > ARGON2_CPUS_MAX {
                    return bad(format!("argon2 cpus {cpus} outside 1..={ARGON2_CPUS_MAX}"));
                }
                if salt.len() < 8 || salt.len() > SALT_BYTES_MAX {
                    return bad(format!("salt of {} bytes", salt.len()));
                }
            }
        }
        Ok(())
    }

    /// Derives `out_len` bytes from `passphrase`.
    pub fn derive(&self, passphrase: &[u8], out_len: usize) -> Result<SecretBytes> {
        self.check()?;
        let mut out = SecretBytes::zeroed(out_len);
        match self {
            Kdf::Pbkdf2 {
                hash,
                iterations,
                salt,
            } => hash.pbkdf2(passphrase, salt, *iterations, out.as_mut()),
            Kdf::Argon2 {
                variant,
                cost,
                salt,
            } => {
                let params =
                    argon2::Params::new(cost.memory_kib, cost.time, cost.cpus, Some(out_len))
                        .map_err(|e| Error::BadHeader {
                            check: "kdf",
                            detail: format!("argon2 parameters: {e}"),
                        })?;
                let alg = match variant {
                    Argon2Variant::I => argon2::Algorithm::Argon2i,
                    Argon2Variant::Id => argon2::Algorithm::Argon2id,
                };
                argon2::Argon2::new(alg, argon2::Version::V0x13, params)
                    .hash_password_into(passphrase, salt, out.as_mut())
                    .map_err(|e| Error::BadHeader {
                        check: "kdf",
                        detail: format!("argon2: {e}"),
                    })?;
            }
        }
        Ok(out)
    }
}

/// What the user asked for (cryptsetup's --pbkdf, --hash, --iter-time, --pbkdf-memory,
/// --pbkdf-parallel, --pbkdf-force-iterations).
#[derive(Debug, Clone)]
pub struct KdfRequest {
    /// "pbkdf2", "argon2i" or "argon2id".
    pub kind: String,
    pub hash: HashAlg,
    pub iter_time_ms: u32,
    pub memory_kib: u32,
    pub parallel: u32,
    /// Fixed cost instead of calibration: PBKDF2 iterations or Argon2 time cost.
    pub force_iterations: Option<u32>,
}

impl KdfRequest {
    /// The request that makes a keyslot with `kdf`'s type and costs again, without
    /// calibration (a fresh salt): what cryptsetup's reencrypt gives each new keyslot when no
    /// PBKDF option is given, copying the keyslot whose passphrase it takes. Argon2 keyslots
    /// get sha256 for the anti-forensic split (their KDF names no hash; cryptsetup's
    /// default), and their threads and memory are capped as cryptsetup caps any request: at
    /// the CPUs online and half the physical memory.
    pub fn same_as(kdf: &Kdf) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        Self::same_as_on(kdf, cpus, half_ram_kib())
    }

    /// [`KdfRequest::same_as`] on a machine with `cpus` CPUs online and `half_ram_kib`.
    pub fn same_as_on(kdf: &Kdf, cpus: u32, half_ram_kib: u32) -> Self {
        match kdf {
            Kdf::Pbkdf2 {
                hash, iterations, ..
            } => KdfRequest {
                kind: "pbkdf2".into(),
                hash: *hash,
                iter_time_ms: 0,
                memory_kib: 0,
                parallel: 0,
                force_iterations: Some(*iterations),
            },
            Kdf::Argon2 { variant, cost, .. } => KdfRequest {
                kind: match variant {
                    Argon2Variant::I => "argon2i",
                    Argon2Variant::Id => "argon2id",
                }
                .into(),
                hash: HashAlg::Sha256,
                iter_time_ms: 0,
                memory_kib: cost.memory_kib.min(half_ram_kib),
                parallel: cost.cpus.min(cpus.max(1)),
                force_iterations: Some(cost.time),
            },
        }
    }

    /// cryptsetup 2.6's LUKS2 defaults: argon2id, 2 s, 1 GiB (at most half the RAM), 4 threads
    /// (at most the CPU count).
    pub fn luks2_default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        KdfRequest {
            kind: "argon2id".into(),
            hash: HashAlg::Sha256,
            iter_time_ms: 2000,
            memory_kib: default_memory_kib(),
            parallel: cpus.clamp(1, 4),
            force_iterations: None,
        }
    }

    /// LUKS1: pbkdf2-sha256, 2 s.
    pub fn luks1_default() -> Self {
        KdfRequest {
            kind: "pbkdf2".into(),
            hash: HashAlg::Sha256,
            iter_time_ms: 2000,
            memory_kib: 0,
            parallel: 1,
            force_iterations: None,
        }
    }

    /// Picks parameters (calibrating unless forced) and a fresh salt.
    pub fn resolve(&self, key_len: usize) -> Result<Kdf> {
        let mut salt = vec![0u8; SALT_BYTES];
        super::util::random_fill(&mut salt)?;
        let kdf = match self.kind.as_str() {
            "pbkdf2" => {
                let iterations = match self.force_iterations {
                    Some(n) => n.max(PBKDF2_ITERATIONS_MIN),
                    None => calibrate_pbkdf2(self.hash, self.iter_time_ms, key_len),
                };
                Kdf::Pbkdf2 {
                    hash: self.hash,
                    iterations,
                    salt,
                }
            }
            "argon2i" | "argon2id" => {
                let variant = if self.kind.as_str() == "argon2i" {
                    Argon2Variant::I
                } else {
                    Argon2Variant::Id
                };
                let cpus = self.parallel.clamp(1, ARGON2_CPUS_MAX);
                let memory_kib = self
                    .memory_kib
                    .clamp(ARGON2_MEMORY_KIB_MIN.max(8 * cpus), ARGON2_MEMORY_KIB_MAX);
                let cost = match self.force_iterations {
                    Some(t) => Argon2Cost {
                        time: t.max(ARGON2_TIME_MIN),
                        memory_kib,
                        cpus,
                    },
                    None => {
                        calibrate_argon2(variant, self.iter_time_ms, memory_kib, cpus, key_len)?
                    }
                };
                Kdf::Argon2 {
                    variant,
                    cost,
                    salt,
                }
            }
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown PBKDF '{other}' (pbkdf2, argon2i, argon2id)"
                )))
            }
        };
        kdf.check()?;
        Ok(kdf)
    }
}

/// CPU time of the calling thread in milliseconds. Calibration measures CPU time, not wall
/// time, so a busy machine does not make us pick weaker parameters (both KDF implementations
/// here run on the calling thread).
fn thread_cpu_ms() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid, exclusively borrowed `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1000.0 + ts.tv_nsec as f64 / 1e6
}

/// cryptsetup's default Argon2 memory: 1 GiB, but at most half of the physical memory.
pub fn default_memory_kib() -> u32 {
    // SAFETY: sysconf takes integer constants and returns a value or -1.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let half_ram_kib = if pages > 0 && page > 0 {
        (pages as u64 * page as u64 / 1024 / 2).min(u64::from(u32::MAX)) as u32
    } else {
        1 << 20
    };
    (1u32 << 20).min(half_ram_kib).max(ARGON2_MEMORY_KIB_MIN)
}

/// Half the physical memory in KiB (cryptsetup's `adjusted_phys_memory`: 1 GiB when the
/// machine reports less than 128 MiB or more than 4 TiB).
fn half_ram_kib() -> u32 {
    // SAFETY: sysconf takes integer constants and returns a value or -1.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let kib = if pages > 0 && page > 0 {
        pages as u64 * page as u64 / 1024
    } else {
        0
    };
    if !(128 * 1024..=u64::from(u32::MAX)).contains(&kib) {
        return 1 << 20;
    }
    (kib / 2) as u32
}

/// PBKDF2 iterations that take about `target_ms` on this machine (at least 1000).
pub fn calibrate_pbkdf2(hash: HashAlg, target_ms: u32, key_len: usize) -> u32 {
    let mut out = vec![0u8; key_len.max(1)];
    let mut iters: u32 = 1000;
    loop {
        let t = thread_cpu_ms();
        hash.pbkdf2(b"calibration", &[0u8; SALT_BYTES], iters, &mut out);
        let ms = thread_cpu_ms() - t;
        // Measure at least 50 ms (or the target) before extrapolating.
        if ms >= 50.0_f64.min(f64::from(target_ms)) || iters >= u32::MAX / 2 {
            let scaled = f64::from(iters) * f64::from(target_ms) / ms.max(0.001);
            return (scaled.min(f64::from(u32::MAX)) as u32).max(PBKDF2_ITERATIONS_MIN);
        }
        iters = iters.saturating_mul(2);
    }
}

/// Argon2 costs for about `target_ms`: time cost at least 4; if even that is too slow
/// at the requested memory, memory shrinks (never below the minimum), as cryptsetup does.
pub fn calibrate_argon2(
    variant: Argon2Variant,
    target_ms: u32,
    memory_kib: u32,
    cpus: u32,
    key_len: usize,
) -> Result<Argon2Cost> {
    let probe = |time: u32, memory_kib: u32| -> Result<f64> {
        let kdf = Kdf::Argon2 {
            variant,
            cost: Argon2Cost {
                time,
                memory_kib,
                cpus,
            },
            salt: vec![0u8; SALT_BYTES],
        };
        let t = thread_cpu_ms();
        kdf.derive(b"calibration", key_len.max(4))?;
        Ok(thread_cpu_ms() - t)
    };
    let target = f64::from(target_ms.max(1));
    let mut mem = memory_kib;
    loop {
        let ms_per_pass = probe(1, mem)?.max(0.01);
        let time = (target / ms_per_pass) as u64;
        if time >= u64::from(ARGON2_TIME_MIN) || mem <= ARGON2_MEMORY_KIB_MIN.max(8 * cpus) {
            return Ok(Argon2Cost {
                time: time.clamp(u64::from(ARGON2_TIME_MIN), 1 << 24) as u32,
                memory_kib: mem,
                cpus,
            });
        }
        // Too slow even at the minimum time cost: scale memory down to fit.
        let factor = (time as f64 / f64::from(ARGON2_TIME_MIN)).max(0.1);
        mem = ((f64::from(mem) * factor) as u32).max(ARGON2_MEMORY_KIB_MIN.max(8 * cpus));
    }
}

#[cfg(test)]
mod same_as_tests {
    use super::*;

    fn request_of(kdf: &Kdf, cpus: u32, half_ram_kib: u32) -> Kdf {
        let r = KdfRequest::same_as_on(kdf, cpus, half_ram_kib);
        assert!(r.force_iterations.is_some(), "no calibration: {r:?}");
        r.resolve(64).expect("resolve")
    }

    /// A pbkdf2 keyslot's hash and iterations are copied with a fresh salt.
    #[test]
    fn pbkdf2_keyslot_is_copied() {
        for (hash, iterations) in [(HashAlg::Sha512, 2345), (HashAlg::Sha1, 1000)] {
            let old = Kdf::Pbkdf2 {
                hash,
                iterations,
                salt: vec![7; SALT_BYTES],
            };
            match request_of(&old, 2, 1 << 20) {
                Kdf::Pbkdf2 {
                    hash: h,
                    iterations: i,
                    salt,
                } => {
                    assert_eq!((h, i), (hash, iterations));
                    assert_ne!(salt, vec![7; SALT_BYTES], "a fresh salt");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// An Argon2 keyslot's variant and costs are copied; threads and memory are capped at
    /// the CPUs online and half the memory, as cryptsetup's `init_pbkdf_type` caps them.
    #[test]
    fn argon2_keyslot_is_copied_within_the_machine() {
        let cost = Argon2Cost {
            time: 5,
            memory_kib: 64,
            cpus: 4,
        };
        for (variant, cpus, half, want_cpus, want_mem) in [
            (Argon2Variant::Id, 8, 1 << 20, 4, 64),
            (Argon2Variant::I, 2, 1 << 20, 2, 64),
            (Argon2Variant::Id, 1, 48, 1, 48),
        ] {
            let old = Kdf::Argon2 {
                variant,
                cost,
                salt: vec![1; SALT_BYTES],
            };
            let r = KdfRequest::same_as_on(&old, cpus, half);
            assert_eq!(r.hash, HashAlg::Sha256, "AF hash of an Argon2 keyslot");
            match r.resolve(64).expect("resolve") {
                Kdf::Argon2 {
                    variant: v,
                    cost: c,
                    ..
                } => {
                    assert_eq!(v, variant);
                    assert_eq!(
                        c,
                        Argon2Cost {
                            time: 5,
                            memory_kib: want_mem,
                            cpus: want_cpus
                        },
                        "{cpus} CPUs, {half} KiB"
                    );
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
