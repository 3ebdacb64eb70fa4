//! The demo's set-up stays light: `scripts/check-deps-sets.sh` checks that `deps.sh run` (all
//! the demo installs) holds no kernel, VM kit or initramfs trigger, that `deps.sh test` holds
//! the VM kit, and that the demo asks for `run` only. It installs nothing.

use std::path::Path;
use std::process::Command;

#[test]
fn demo_installs_only_the_run_set() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let o = Command::new("bash")
        .arg(root.join("scripts/check-deps-sets.sh"))
        .output()
        .expect("run check-deps-sets.sh");
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "check-deps-sets.sh: {out}");
}
