//! The real cryptsetup, which the interop tests read ucrypt's volumes with and race against.
//! To kill one mid-way, build its `Command` and hand it to [`super::kill_when`].

use std::path::Path;
use std::process::Output;

pub const CRYPTSETUP: &str = "cryptsetup";

/// KDF settings both ucrypt and cryptsetup accept, fast enough for a test suite.
pub const FAST_PBKDF2: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];

/// Whether cryptsetup is here ([`super::require`]: SKIPPED without it, a failure under CI).
pub fn require() -> bool {
    super::require(CRYPTSETUP, "cryptsetup-bin")
}

/// `cryptsetup ARGS`, collected.
pub fn run(args: &[&str]) -> Output {
    super::run(CRYPTSETUP, args)
}

/// `cryptsetup ARGS`, which must succeed; its stdout.
pub fn ok(args: &[&str]) -> String {
    super::ok(CRYPTSETUP, args)
}

/// `cryptsetup luksDump` of a volume or a detached header.
pub fn dump(img: &Path) -> String {
    ok(&["luksDump", super::s(img)])
}

/// `cryptsetup luksDump --dump-json-metadata`: the JSON text.
pub fn dump_json(img: &Path) -> String {
    ok(&["luksDump", "--dump-json-metadata", super::s(img)])
}

/// Whether `cryptsetup isLuks` finds a LUKS header in `img`.
pub fn is_luks(img: &Path) -> bool {
    run(&["isLuks", super::s(img)]).status.success()
}
