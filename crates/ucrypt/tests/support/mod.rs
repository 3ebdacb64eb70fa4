//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// True if `program` can be run. When it cannot: under CI (which installs every Debian package
/// the suite needs) this panics; elsewhere it prints SKIPPED with the package to install.
pub fn have_tool(program: &str, package: &str, test: &str) -> bool {
    let ok = Command::new(program).arg("--version").output().is_ok() || Path::new(program).exists();
    if !ok {
        if std::env::var_os("CI").is_some() {
            panic!("{test}: {program} missing under CI; .ci/run must install {package}");
        }
        println!("SKIPPED {test}: {program} not found (apt-get install {package})");
    }
    ok
}

/// A small xorshift generator: tests print the seed so any failure can be replayed.
pub struct Rng(pub u64);

impl Rng {
    pub fn from_env(test: &str) -> Self {
        let seed = std::env::var("UCRYPT_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            })
            | 1;
        println!("{test}: seed {seed} (replay with UCRYPT_TEST_SEED={seed})");
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}
