//! The test kit every crate's tests share: temporary directories and files ([`TempDir`],
//! [`TempFile`]); the suite's one seed variable, `UCRYPT_TEST_SEED` ([`seed`], [`seed_or`],
//! [`SplitMix`]); whether a test can run here ([`have`], [`require`], [`can_run`], [`skip`]:
//! SKIPPED, or a failure under CI); running a program and showing what it said ([`run`],
//! [`ok`], [`text`]); killing one mid-way ([`kill_when`], [`kill_stepped`]); the real cryptsetup
//! ([`cryptsetup`]); and booting a kernel under qemu ([`vm`]).
//!
//! Include it from a crate's `tests/` (a test file, not a helper module: those reach it as
//! `crate::kit`) with
//!
//! ```ignore
//! #[path = "../../../tests/kit/mod.rs"]
//! mod kit;
//! ```
//!
//! It is a directory included by path, not a dev-only crate, because ucrypt-bench's
//! `integrity --vm` boots the VM through [`vm`] from its `src`, which cannot use a
//! dev-dependency; one copy serves both, and no manifest or lock file names it. The price: each
//! test binary compiles its own copy and uses part of it, hence the `dead_code` and
//! `unused_imports` allowances. It depends on std and libc only, which every crate of the
//! workspace has.
#![allow(dead_code, unused_imports)]

pub mod cryptsetup;
mod hex;
mod random;
mod run;
mod temp;
mod tools;
pub mod vm;

pub use hex::{hex, unhex};
pub use random::{seed, seed_or, SplitMix, SEED_VAR};
pub use run::{
    kill_after, kill_stepped, kill_when, ok, ok_in, run, run_in, s, stderr, stdout, terminate,
    text, wait_timeout, wait_timeout_doing, Poll, KILL_WAIT_MAX,
};
pub use temp::{TempDir, TempFile, KEEP_VAR};
pub use tools::{can_run, have, is_root, missing_root_rig, require, sibling_bin, skip, under_ci};
