//! Booting a kernel under qemu (`tests/vm/run-in-vm.sh`) for the tests that check ucrypt
//! against the kernel's dm-crypt, dm-integrity and ublk: finding the harness, deciding SKIPPED
//! vs. failing, and running one script in one boot.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

use super::{have, SplitMix};

/// The whole VM run (boot + script) must finish within this; run-in-vm.sh kills qemu after it.
pub const VM_TIMEOUT_S: u32 = 300;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn vm_dir() -> PathBuf {
    repo_root().join("tests/vm")
}

/// A stock kernel whose modules include dm-crypt (what run-in-vm.sh picks by default).
pub fn default_kernel() -> Option<PathBuf> {
    let mut kernels: Vec<PathBuf> = std::fs::read_dir("/boot")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .collect();
    kernels.sort();
    kernels.into_iter().rev().find(|k| {
        let ver =
            k.file_name().and_then(|n| n.to_str()).unwrap_or("")["vmlinuz-".len()..].to_string();
        Path::new("/lib/modules")
            .join(&ver)
            .join("kernel/drivers/md")
            .is_dir()
    })
}

/// Why the VM cannot run here, or `None` when it can. Never panics (for callers that report
/// SKIPPED themselves, such as `ucrypt bench integrity --vm`); tests use [`require_vm`].
pub fn vm_missing() -> Option<String> {
    if !have("qemu-system-x86_64") {
        Some("qemu-system-x86_64 not found (Debian package qemu-system-x86)".to_string())
    } else if default_kernel().is_none() {
        Some("no /boot/vmlinuz-* with dm-crypt modules (Debian package linux-image-amd64)".into())
    } else if !have("busybox") && !Path::new("/bin/busybox").exists() {
        Some("busybox not found (Debian package busybox-static)".into())
    } else if !vm_dir().join("run-in-vm.sh").is_file() {
        Some(format!(
            "{} not found (the VM kit of ucrypt's source tree)",
            vm_dir().display()
        ))
    } else {
        None
    }
}

/// `Err(reason)` when the VM cannot run here. Under CI this panics instead (CI installs qemu
/// and a kernel), so a CI run can never count a skipped VM test as passed.
pub fn require_vm() -> Result<(), String> {
    match vm_missing() {
        None => Ok(()),
        Some(r) if super::under_ci() => {
            panic!("CI is set but the VM cannot run: {r}; run tests/vm/install-deps.sh")
        }
        Some(r) => Err(r),
    }
}

/// One boot of the VM running `script`.
pub struct VmRun {
    pub script: String,
    pub disks: Vec<(PathBuf, bool)>,
    /// vhost-user-blk sockets, attached after `disks` in /dev/vdX order (`run-in-vm.sh -V`).
    pub vhosts: Vec<PathBuf>,
    /// NBD servers' UNIX sockets, whose default export qemu's NBD client attaches as a
    /// virtio-blk disk after `vhosts` (`run-in-vm.sh -N`; num-queues as `vhost_queues`).
    pub nbds: Vec<PathBuf>,
    /// num-queues of each vhost-user-blk disk (`VMTEST_VHOST_QUEUES`; default 2).
    pub vhost_queues: Option<u32>,
    /// Seconds after which qemu reconnects to a vhost-user backend it lost (the chardev's
    /// `reconnect=`, `VMTEST_VHOST_RECONNECT`). None: a lost backend stays lost.
    pub vhost_reconnect: Option<u32>,
    pub share: Option<PathBuf>,
    pub kernel: Option<PathBuf>,
    pub modroot: Option<PathBuf>,
    pub mem_mb: u32,
    pub extra_bins: Vec<PathBuf>,
    /// Overall timeout of the boot, seconds.
    pub timeout_s: u32,
    /// Ends the VM once its console has been silent this long, seconds (`run-in-vm.sh -i`):
    /// a hang, however slowly a busy host runs the guest. None: no such limit.
    pub silence_max_s: Option<u32>,
    /// Guest CPUs (`run-in-vm.sh -c`; default: the host's, at most 4).
    pub cpus: Option<u32>,
    /// Kernel modules loaded at boot besides build-initramfs.sh's list (`EXTRA_MODS`).
    pub extra_mods: Vec<String>,
    /// Print the VM's output to stdout when it ends (tests); off where stdout is a report.
    pub echo: bool,
}

pub struct VmOutput {
    pub status: i32,
    pub output: String,
    pub elapsed: Duration,
}

impl VmRun {
    pub fn new(script: impl Into<String>) -> Self {
        VmRun {
            script: script.into(),
            disks: Vec::new(),
            vhosts: Vec::new(),
            nbds: Vec::new(),
            vhost_queues: None,
            vhost_reconnect: None,
            share: None,
            kernel: None,
            modroot: None,
            mem_mb: 1024,
            extra_bins: Vec::new(),
            timeout_s: VM_TIMEOUT_S,
            silence_max_s: None,
            cpus: None,
            extra_mods: Vec::new(),
            echo: true,
        }
    }

    /// Attaches `img` as the next virtio disk (/dev/vda, /dev/vdb, ...).
    pub fn disk(&mut self, img: &Path, read_only: bool) -> &mut Self {
        self.disks.push((img.to_path_buf(), read_only));
        self
    }

    pub fn run(&self, work: &Path) -> VmOutput {
        let script = work.join("vm-script.sh");
        std::fs::write(&script, &self.script).expect("write VM script");
        let mut cmd = Command::new(vm_dir().join("run-in-vm.sh"));
        cmd.arg("-t").arg(self.timeout_s.to_string());
        if let Some(s) = self.silence_max_s {
            cmd.arg("-i").arg(s.to_string());
        }
        cmd.arg("-m").arg(self.mem_mb.to_string());
        cmd.arg("-l").arg(work.join("serial.log"));
        for (d, ro) in &self.disks {
            let mut s = d.as_os_str().to_owned();
            if *ro {
                s.push(":ro");
            }
            cmd.arg("-d").arg(s);
        }
        for v in &self.vhosts {
            cmd.arg("-V").arg(v);
        }
        for n in &self.nbds {
            cmd.arg("-N").arg(n);
        }
        if let Some(q) = self.vhost_queues {
            cmd.env("VMTEST_VHOST_QUEUES", q.to_string());
        }
        if let Some(r) = self.vhost_reconnect {
            cmd.env("VMTEST_VHOST_RECONNECT", r.to_string());
        }
        if let Some(s) = &self.share {
            cmd.arg("-s").arg(s);
        }
        if let Some(k) = &self.kernel {
            cmd.arg("-k").arg(k);
        }
        if let Some(c) = self.cpus {
            cmd.arg("-c").arg(c.to_string());
        }
        if !self.extra_mods.is_empty() {
            cmd.env("EXTRA_MODS", self.extra_mods.join(" "));
        }
        if let Some(m) = &self.modroot {
            cmd.env("MODROOT", m);
        }
        if !self.extra_bins.is_empty() {
            let bins: Vec<String> = self
                .extra_bins
                .iter()
                .map(|b| b.display().to_string())
                .collect();
            cmd.env("EXTRA_BINS", bins.join(" "));
        }
        cmd.arg(&script);
        let t0 = Instant::now();
        let (status, stdout, stderr) = run_script(cmd);
        let elapsed = t0.elapsed();
        let mut output = String::from_utf8_lossy(&stdout).into_owned();
        output.push_str(&String::from_utf8_lossy(&stderr));
        if self.echo {
            println!(
                "---- VM output ({:.1} s) ----\n{output}---- end of VM output ----",
                elapsed.as_secs_f64()
            );
        }
        VmOutput {
            status,
            output,
            elapsed,
        }
    }
}

/// Most VMs one process runs at once that [`stop_running_vms`] can reach (a test binary runs
/// its tests in parallel, each its own VM); a VM beyond it still runs, and still stops when its
/// runner dies (the script's parent-death signal).
const RUNNING_MAX: usize = 16;

/// The run-in-vm.sh processes running now (0: a free slot). A pid is put here after the spawn
/// and taken out before the process is reaped, so no slot ever names a pid reused by another.
static RUNNING: [AtomicI32; RUNNING_MAX] = [const { AtomicI32::new(0) }; RUNNING_MAX];

/// Set by [`stop_running_vms`]: a VM started afterwards is stopped at once too (one whose
/// script was spawned but not yet in [`RUNNING`] when the signal came).
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Sends SIGTERM to every VM this process runs now, and to every one it starts from now on;
/// each script then stops its qemu and exits, and its [`VmRun::run`] returns. Async-signal-safe
/// (atomics and kill(2)): for a signal handler that must not leave a VM behind (ucrypt-bench's).
pub fn stop_running_vms() {
    STOPPING.store(true, Ordering::SeqCst);
    for slot in &RUNNING {
        let pid = slot.load(Ordering::SeqCst);
        if pid > 0 {
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is a child of this
            // process not yet reaped (see RUNNING), so it names no other process.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
}

/// Runs run-in-vm.sh (`cmd`) to its end: its exit code (-1 when a signal ended it), stdout and
/// stderr. The script gets SIGTERM when the thread that runs it dies (PR_SET_PDEATHSIG), and
/// stops its qemu then, so a runner killed in any way leaves no VM behind; while it runs, its
/// pid is in [`RUNNING`] for [`stop_running_vms`].
fn run_script(mut cmd: Command) -> (i32, Vec<u8>, Vec<u8>) {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent; it runs in the
    // child between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("spawn tests/vm/run-in-vm.sh");
    let pid = child.id() as i32;
    let slot = RUNNING.iter().find(|s| {
        s.compare_exchange(0, pid, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    });
    // After the pid is in RUNNING: a stop that scanned RUNNING before is seen here.
    if STOPPING.load(Ordering::SeqCst) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let mut stderr = child.stderr.take().expect("piped stderr");
    let err_reader = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = stderr.read_to_end(&mut b);
        b
    });
    let mut stdout = Vec::new();
    let _ = child
        .stdout
        .take()
        .expect("piped stdout")
        .read_to_end(&mut stdout);
    let stderr = err_reader.join().unwrap_or_default();
    wait_unreaped(pid);
    if let Some(s) = slot {
        s.store(0, Ordering::SeqCst);
    }
    let status = child.wait().expect("wait for run-in-vm.sh");
    (status.code().unwrap_or(-1), stdout, stderr)
}

/// Waits until child `pid` has exited, leaving it unreaped (a zombie keeps its pid).
fn wait_unreaped(pid: i32) {
    loop {
        // SAFETY: a zeroed siginfo_t is a valid out-parameter; waitid writes only into it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with a valid pointer; WNOWAIT leaves it unreaped.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

/// Debian trixie's stock kernel (6.12, which has ublk_drv) and its module root, fetched once
/// into the harness cache by `fetch-kernel.sh`.
pub fn trixie_kernel() -> Result<(PathBuf, PathBuf), String> {
    let root = vm_dir().join("cache/trixie");
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(root.join("boot"))
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("vmlinuz-"))
            })
    };
    if let Some(k) = find() {
        return Ok((k, root));
    }
    let out = Command::new("bash")
        .arg(vm_dir().join("fetch-kernel.sh"))
        .arg(&root)
        .arg("trixie")
        .output()
        .map_err(|e| format!("fetch-kernel.sh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "fetching Debian trixie's kernel failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    find()
        .map(|k| (k, root))
        .ok_or_else(|| "fetch-kernel.sh produced no vmlinuz".to_string())
}

/// Runs a command on the host (not in the VM): its stdout, or an error naming the command, its
/// arguments, its exit status and both outputs.
pub fn host(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    host_result(cmd, args, &out)
}

/// As [`host`], with `input` on the command's standard input (a pipe).
pub fn host_in(cmd: &str, args: &[&str], input: &[u8]) -> Result<String, String> {
    host_result(cmd, args, &super::run_in(cmd, args, input))
}

fn host_result(cmd: &str, args: &[&str], out: &Output) -> Result<String, String> {
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{cmd} {args:?}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// cryptsetup's default LUKS2 data offset (16 MiB), in 512-byte sectors: where
/// [`Luks2Image`] puts the data.
pub const LUKS2_DATA_OFFSET_SECTORS: u64 = 32768;

/// A LUKS2 volume for a VM test, made on the host by `ucrypt format` at
/// [`LUKS2_DATA_OFFSET_SECTORS`], with PBKDF2 at 1000 iterations so that the guest's
/// cryptsetup unlocks it at once.
pub struct Luks2Image<'a> {
    pub cipher: &'a str,
    pub key_bits: u32,
    pub sector_bytes: u64,
    /// Bytes of data after the header area: the image is this much larger than the offset.
    pub data_bytes: u64,
}

impl Luks2Image<'_> {
    /// Creates the image `path` and formats it with the binary `ucrypt`, the passphrase in
    /// `key`; the error names the step that failed.
    pub fn format(&self, ucrypt: &str, path: &Path, key: &Path) -> Result<String, String> {
        std::fs::File::create(path)
            .and_then(|f| f.set_len(LUKS2_DATA_OFFSET_SECTORS * 512 + self.data_bytes))
            .map_err(|e| format!("create {}: {e}", path.display()))?;
        let key_bits = self.key_bits.to_string();
        let sector = self.sector_bytes.to_string();
        let offset = LUKS2_DATA_OFFSET_SECTORS.to_string();
        host(
            ucrypt,
            &[
                "format",
                super::s(path),
                super::s(key),
                "--type",
                "luks2",
                "--cipher",
                self.cipher,
                "--key-size",
                &key_bits,
                "--sector-size",
                &sector,
                "--pbkdf",
                "pbkdf2",
                "--pbkdf-force-iterations",
                "1000",
                "--offset",
                &offset,
                "--batch-mode",
            ],
        )
    }
}

/// The guest's shell lines for one case of a both-ways test (case `name`, number `i`), for a
/// script that set `fail=0` and `P` (the plaintext's path): `open_read` (a command without its
/// mapping name) maps the disk the host wrote, read-only, as `/dev/mapper/rI`, and `cmp
/// -n CMP_BYTES` (the whole disk when `None`) compares it with `$P`; `open_write` maps the empty disk as `/dev/mapper/wI` and
/// `$P` is written through it. They print `CASE NAME READ-OK` and `CASE NAME WRITE-DONE` (or
/// `-FAIL`, and set `fail=1`), which [`both_ways_failures`] reads.
pub fn both_ways_case(
    name: &str,
    i: usize,
    title: &str,
    open_read: &str,
    open_write: &str,
    cmp_bytes: Option<usize>,
) -> String {
    let cmp_args = cmp_bytes.map_or(String::new(), |n| format!("-n {n} "));
    format!(
        "echo \"== {name}: {title}\"\n\
         if {open_read} r{i} && cmp {cmp_args}/dev/mapper/r{i} $P; then echo \"CASE {name} READ-OK\"; else echo \"CASE {name} READ-FAIL\"; fail=1; fi\n\
         cryptsetup close r{i}\n\
         if {open_write} w{i} && dd if=$P of=/dev/mapper/w{i} bs=65536 conv=fsync 2>/dev/null; then echo \"CASE {name} WRITE-DONE\"; else echo \"CASE {name} WRITE-FAIL\"; fail=1; fi\n\
         cryptsetup close w{i}\n"
    )
}

/// The host's half of a both-ways test, from the VM's `output`: for each case (in order, named
/// as in [`both_ways_case`]) whether the guest read the host-written volume back, and whether
/// what the guest wrote, as the host reads it back (`export(i)`: the plaintext of case `i`'s
/// written disk), is `plain` byte for byte. `kind` names the volumes in the messages. Returns
/// the failures, one line each.
pub fn both_ways_failures<'a>(
    output: &str,
    names: impl IntoIterator<Item = &'a str>,
    kind: &str,
    plain: &[u8],
    mut export: impl FnMut(usize) -> Result<Vec<u8>, String>,
) -> Vec<String> {
    let mut failures = Vec::new();
    for (i, name) in names.into_iter().enumerate() {
        if !output.contains(&format!("CASE {name} READ-OK")) {
            failures.push(format!(
                "{name}: cryptsetup/dm-crypt did not read ucrypt's {kind} volume back exactly"
            ));
        }
        if !output.contains(&format!("CASE {name} WRITE-DONE")) {
            failures.push(format!("{name}: dm-crypt write failed"));
            continue;
        }
        match export(i) {
            Ok(got) if got == plain => println!("CASE {name} both ways OK"),
            Ok(_) => failures.push(format!(
                "{name}: ucrypt export of dm-crypt's writes differs from the plaintext"
            )),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    failures
}

/// `n` bytes from `rng`, also written to `path` (a key file, a plaintext image).
pub fn random_file(rng: &mut SplitMix, path: &Path, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    rng.fill(&mut b);
    std::fs::write(path, &b).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    b
}

/// For a test that boots Debian trixie's kernel (ublk): the kernel and its module root, or
/// `None` after printing `SKIPPED <test>: <reason>` where the VM or the kernel is not to be had
/// here. Under CI a missing kernel fails the test instead.
pub fn require_trixie_vm(test: &str) -> Option<(PathBuf, PathBuf)> {
    if let Err(reason) = require_vm() {
        println!("SKIPPED {test}: {reason}");
        return None;
    }
    match trixie_kernel() {
        Ok(k) => Some(k),
        Err(e) if super::under_ci() => panic!("{e}"),
        Err(e) => {
            println!("SKIPPED {test}: {e}");
            None
        }
    }
}
