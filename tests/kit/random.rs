//! The one seed variable of the test suite, and a small generator driven by it.
//!
//! Every randomised test draws from one printed seed, so that a failure can be replayed:
//! `UCRYPT_TEST_SEED=<the printed value> cargo test ...`.

/// The environment variable every randomised test reads its seed from.
pub const SEED_VAR: &str = "UCRYPT_TEST_SEED";

/// The seed in [`SEED_VAR`] (decimal, or hex after `0x`), if set; a value that does not parse
/// is a mistake worth a failure, not a silent other seed.
fn from_env() -> Option<u64> {
    let v = std::env::var(SEED_VAR).ok()?;
    let v = v.trim();
    let parsed = match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|e| panic!("{SEED_VAR}={v}: {e}")))
}

fn announce(seed: u64) -> u64 {
    println!("seed: {SEED_VAR}={seed}");
    seed
}

/// The seed of a test whose values should differ from run to run: [`SEED_VAR`] if set, else
/// one drawn from the clock. Printed.
pub fn seed() -> u64 {
    announce(from_env().unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    }))
}

/// The seed of a test that runs the same values every time unless told otherwise:
/// [`SEED_VAR`] if set, else `default`. Printed.
pub fn seed_or(default: u64) -> u64 {
    announce(from_env().unwrap_or(default))
}

/// splitmix64: a tiny seeded generator so every byte of test data follows from a printed seed.
/// Any seed is fine (zero too).
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value below `n` (`n` > 0; the bias of the modulo does not matter to a test).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.fill(&mut b);
        b
    }
}
