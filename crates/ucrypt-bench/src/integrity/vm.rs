//! `ucrypt bench integrity --vm`: the kernel column, as ratios measured in one boot of the
//! test VM (tests/vm/, through the test kit, tests/kit/vm.rs).
//!
//! The host has no dm-integrity; the VM has it but emulates its CPU (qemu TCG, `-cpu max`:
//! AES-NI, PCLMULQDQ and AVX2 exist but are emulated, a few MiB/s of AES), so an absolute
//! number there says how fast qemu emulates, and the host's in-process numbers cannot be set
//! beside it. What the VM can say is how much authentication costs *relative to plain XTS on
//! the same emulated CPU*, for the kernel and for ucrypt, in the same boot:
//!
//! - One volume per mode, formatted by the guest's cryptsetup (LUKS2, 4096-byte sectors, each
//!   on its own virtio disk backed by a sparse image file): plain `aes-xts-plain64`, and
//!   `aes-gcm-random` + `aead`, `chacha20-random` + `poly1305`, `aes-xts-random` +
//!   `hmac-sha256` (`--integrity-no-wipe`; the measured region is written once, untimed, by
//!   the kernel before the first round so that every read verifies a real tag).
//! - The kernel: `cryptsetup open` (dm-crypt, over dm-integrity for the authenticated ones; in
//!   journal mode as cryptsetup opens them, and again with `--integrity-no-journal`).
//! - ucrypt: `ucrypt ublk` serving *the same volume* as /dev/ublkbN (journal mode, and again
//!   with `--integrity-no-journal`), the default policy (`auto`). This measures what the
//!   kernel's side measures (a block device an application reads and writes with O_DIRECT,
//!   backed by the same virtio disk), which the in-process bench run in the guest would not:
//!   it has no block-device front end, so its ratio would leave out costs the kernel's ratio
//!   includes. ublk needs Debian trixie's kernel (6.12; the ublk tests use it), so the
//!   kernel side runs on 6.12 too.
//! - Both devices are measured by the same code: this binary's hidden `integrity-vm-probe`
//!   subcommand runs the in-process scenario's requests ([`super::sequential`],
//!   [`super::small`]) on the device, O_DIRECT, no flushes.
//! - Each round runs every configuration once, the kernel and ucrypt alternating which goes
//!   first; cells are medians over rounds. Per side, ratios to that side's plain XTS volume
//!   (throughput: this / plain; latency: plain / this, so below 1 is slower in both), and the
//!   ratio of ratios, ucrypt's ÷ the kernel's (above 1: authentication costs ucrypt a smaller
//!   share of its plain speed than it costs the kernel).
//!
//! Not comparable, and said in the report: absolute numbers across the two sides (different
//! front ends: device-mapper in the kernel, ublk plus a userspace process for ucrypt, whose
//! fixed cost per request dilutes ucrypt's ratio more), and anything across the host and the
//! VM. The guest loads the kernel's SIMD crypto modules (sha256/sha512-ssse3, chacha-x86_64,
//! poly1305-x86_64, besides aesni and ghash-clmulni) so that, as ucrypt's AWS-LC, it uses the
//! vector code a real CPU would run; the drivers the kernel picked are printed.

use crate::kit;

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use super::{sequential, small, Aligned, Io, BIG_BYTES};
use crate::stats::{loadavg, Summary};

/// The volumes, one virtio disk each (/dev/vda, /dev/vdb, ... in this order), with the options
/// `cryptsetup luksFormat` gets besides the common ones.
const VOLUMES: [(&str, &str); 4] = [
    (
        "plain aes-xts-plain64",
        "--cipher aes-xts-plain64 --key-size 512",
    ),
    (
        "aes-gcm-random + aead",
        "--cipher aes-gcm-random --integrity aead --key-size 256 --integrity-no-wipe",
    ),
    (
        "chacha20-random + poly1305",
        "--cipher chacha20-random --integrity poly1305 --key-size 256 --integrity-no-wipe",
    ),
    (
        "aes-xts-random + hmac-sha256",
        "--cipher aes-xts-random --integrity hmac-sha256 --key-size 512 --integrity-no-wipe",
    ),
];

/// Kernel modules the guest loads besides build-initramfs.sh's list: the x86 SIMD
/// implementations of SHA-2, ChaCha20 and Poly1305 (the generic C ones are loaded already and
/// the crypto API does not look for a faster one once it has one).
const GUEST_EXTRA_MODS: [&str; 4] = [
    "sha256-ssse3",
    "sha512-ssse3",
    "chacha-x86_64",
    "poly1305-x86_64",
];

/// Sizes. Each image holds a 16 MiB LUKS2 header, dm-integrity's journal and tags, and the
/// measured region (the first `*_MIB` of the volume) with room to spare.
const IMAGE_MIB: u64 = 64;
const REGION_MIB: u64 = 32;
const IMAGE_MIB_QUICK: u64 = 40;
const REGION_MIB_QUICK: u64 = 8;
/// 4 KiB requests per latency sample (each direction, each round, each configuration).
const OPS_4K: usize = 500;
const OPS_4K_QUICK: usize = 100;
/// Guest memory: the 1 GiB the VM tests use (ucrypt's pool and the initramfs fit easily).
const GUEST_MEM_MB: u32 = 1024;
/// The VM's work at a pessimistic emulated speed: boot and formatting, plus for every
/// configuration on each side and round an open, a close and the probe.
const VM_FIXED_S: u32 = 240;
const VM_PER_CONFIG_S: u32 = 20;
const VM_EMULATED_MIB_S_MIN: u32 = 2;
const VM_MS_PER_4K_OP_MAX: u32 = 10;
/// How the VM's run is bounded. TCG's speed follows what the host has to spare, so no fixed
/// limit on the whole run both catches a hang soon and lets a run on a busy host finish. The
/// guest's console shows a line at least every step (a volume formatted, a probe's result,
/// a device started): a console silent for `VM_SILENCE_MAX_S` is a hang, and ends the run.
/// The whole run's limit is only a ceiling: the work above at its pessimistic speed,
/// `VM_BUSY_HOST_SLOWDOWN` times over.
const VM_SILENCE_MAX_S: u32 = 600;
const VM_BUSY_HOST_SLOWDOWN: u32 = 4;

/// What the kernel column of `ucrypt bench integrity` holds.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum KernelColumn {
    /// Not measured; why (not asked for, or the VM cannot run here).
    Skipped {
        reason: String,
    },
    Measured(Box<VmReport>),
}

/// Four metrics of one device (medians over rounds, with min and max).
#[derive(Debug, Clone, Serialize)]
pub struct VmSide {
    /// MiB/s of 1 MiB sequential reads / writes.
    pub read_mib_s: Summary,
    pub write_mib_s: Summary,
    /// µs per 4 KiB request at QD1, reads / writes.
    pub read_4k_us: Summary,
    pub write_4k_us: Summary,
    /// To this side's plain XTS volume: throughput this / plain, latency plain / this.
    pub ratios: Ratios,
    /// The device's size in bytes as the probe saw it (the kernel's and ucrypt's must agree:
    /// both compute the data area dm-integrity provides from the same superblock).
    pub device_bytes: u64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Ratios {
    pub read: f64,
    pub write: f64,
    pub read_4k: f64,
    pub write_4k: f64,
}

impl Ratios {
    fn to_plain(s: &[Summary; 4], plain: &[Summary; 4]) -> Ratios {
        Ratios {
            read: s[0].median / plain[0].median,
            write: s[1].median / plain[1].median,
            read_4k: plain[2].median / s[2].median,
            write_4k: plain[3].median / s[3].median,
        }
    }
    fn over(&self, o: &Ratios) -> Ratios {
        Ratios {
            read: self.read / o.read,
            write: self.write / o.write,
            read_4k: self.read_4k / o.read_4k,
            write_4k: self.write_4k / o.write_4k,
        }
    }
    fn cells(&self) -> [f64; 4] {
        [self.read, self.write, self.read_4k, self.write_4k]
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct VmRow {
    pub name: String,
    pub kernel: VmSide,
    pub ucrypt: VmSide,
    /// ucrypt's ratio ÷ the kernel's (above 1: authentication costs ucrypt relatively less).
    pub ucrypt_over_kernel: Ratios,
}

#[derive(Debug, Clone, Serialize)]
pub struct VmReport {
    /// The guest's kernel (`uname -r`).
    pub kernel: String,
    pub guest_cpus: usize,
    /// The guest's CPU flags that matter to the ciphers (all emulated).
    pub guest_cpu_flags: Vec<String>,
    pub image_mib: u64,
    pub region_mib: u64,
    pub ops_4k: usize,
    pub runs: usize,
    /// The host's /proc/loadavg before the boot and after it.
    pub host_load_before: String,
    pub host_load_after: String,
    /// The whole boot, seconds.
    pub vm_seconds: f64,
    pub rows: Vec<VmRow>,
    /// Per configuration (first round): the device-mapper tables (no keys) and the crypto
    /// drivers in use while the kernel had it open, each device's max_sectors_kb, and how
    /// long `ucrypt ublk` took to start in the guest.
    pub kernel_setup: Vec<String>,
    pub notes: Vec<String>,
}

/// One configuration: a volume (disk index) and how both sides open it.
struct Config {
    name: String,
    disk: usize,
    /// Options of `cryptsetup open` and of `ucrypt ublk` alike.
    open_flags: &'static str,
}

fn configs() -> Vec<Config> {
    let mut c = vec![Config {
        name: VOLUMES[0].0.into(),
        disk: 0,
        open_flags: "",
    }];
    for (disk, (name, _)) in VOLUMES.iter().enumerate().skip(1) {
        c.push(Config {
            name: format!("{name} (journal)"),
            disk,
            open_flags: "",
        });
        c.push(Config {
            name: format!("{name} (direct)"),
            disk,
            open_flags: "--integrity-no-journal",
        });
    }
    c
}

/// The row of this table that an in-process row of `ucrypt bench integrity` corresponds to
/// (same mode, same dm-integrity mode, policy auto), if any.
pub fn vm_row_for(in_process_name: &str) -> Option<String> {
    if in_process_name.contains("(policy inline)") {
        return None;
    }
    let base = in_process_name.trim_end_matches(" (policy auto)");
    if base.starts_with("plain ") {
        return Some(base.into());
    }
    if base.ends_with(" (journal)") {
        return Some(base.into());
    }
    Some(format!("{base} (direct)"))
}

/// The guest's shell script: format and fill the volumes, then `runs` rounds of every
/// configuration on both sides, each measurement a `@@PROBE` line.
fn script(cfgs: &[Config], region_mib: u64, ops: usize, runs: usize) -> String {
    let mut s = format!(
        r#"set -u
K=/mnt/host/key; B=/mnt/host/ucrypt-bench; U=/mnt/host/ucrypt
MIB={region_mib}; OPS={ops}
modprobe ublk_drv 2>/dev/null
[ -e /dev/ublk-control ] || {{ echo "@@FAIL setup: no ublk_drv (/dev/ublk-control)"; exit 3; }}
echo "@@CPU $(nproc) $(sed -n 's/^flags[^:]*: //p' /proc/cpuinfo | head -1)"
F="--type luks2 --sector-size 4096 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --batch-mode --key-file $K"
probe() {{ $B integrity-vm-probe "$1" --bytes $((MIB << 20)) --ops $OPS --tag "$2" || echo "@@FAIL $2 probe"; }}
maxkb() {{ set -- "$1" $(stat -L -c '%t %T' "$2"); echo "@@SETUP $1: $(cat /sys/dev/block/$((0x$2)):$((0x$3))/queue/max_sectors_kb) max_sectors_kb"; }}
kernel() {{
  c=$1; d=$2; r=$3; shift 3
  cryptsetup open "$@" --key-file $K $d k || {{ echo "@@FAIL kernel:$c:$r open"; return; }}
  if [ $r = 0 ]; then
    echo "@@SETUP kernel:$c tables: $(dmsetup table | tr '\n' ';')"
    echo "@@SETUP kernel:$c drivers: $(awk '/^name/{{n=$3}} /^driver/{{d=$3}} /^refcnt/{{if ($3 > 1) print n "=" d}}' /proc/crypto | sort -u | tr '\n' ' ')"
    maxkb kernel:$c /dev/mapper/k
  fi
  probe /dev/mapper/k kernel:$c:$r
  cryptsetup close k || echo "@@FAIL kernel:$c:$r close"
}}
up() {{ cut -d' ' -f1 /proc/uptime; }}
since() {{ awk -v a="$1" -v b="$(up)" 'BEGIN {{ printf "%.1f", b - a }}'; }}
ucrypt() {{
  c=$1; d=$2; r=$3; shift 3
  $U ublk $d --key-file $K "$@" > /tmp/u.out 2>&1 &
  p=$!; t0=$(up)
  # Until ucrypt is ready or has exited, however long the emulated start takes on a busy
  # host; a start that hangs leaves the console silent, and the VM's silence limit ends it.
  while ! grep -q '^ready: ' /tmp/u.out && kill -0 $p 2>/dev/null; do sleep 0.2; done
  dev=$(sed -n 's/^ready: //p' /tmp/u.out)
  if [ -b "$dev" ]; then
    [ $r = 0 ] && echo "@@SETUP ucrypt:$c started in $(since $t0) s" && maxkb ucrypt:$c $dev
    probe $dev ucrypt:$c:$r
  else
    echo "@@FAIL ucrypt:$c:$r start after $(since $t0) s: $(tr '\n' ' ' < /tmp/u.out)"
  fi
  kill -TERM $p 2>/dev/null; wait $p || echo "@@FAIL ucrypt:$c:$r exit $?: $(tr '\n' ' ' < /tmp/u.out)"
}}
"#
    );
    for (i, (_, fmt)) in VOLUMES.iter().enumerate() {
        let dev = disk(i);
        s += &format!(
            "cryptsetup luksFormat $F {fmt} {dev} >/dev/null || {{ echo \"@@FAIL setup: luksFormat {dev}\"; exit 4; }}\n"
        );
        if fmt.contains("--integrity ") {
            // Every block of the region written once (untimed), so reads verify real tags.
            s += &format!(
                "cryptsetup open --integrity-no-journal --key-file $K {dev} f && \
                 dd if=/dev/zero of=/dev/mapper/f bs=1048576 count=$MIB oflag=direct 2>/dev/null && \
                 cryptsetup close f || {{ echo \"@@FAIL setup: filling {dev}\"; exit 5; }}\n"
            );
        }
        s += &format!("echo \"@@STEP {dev} formatted\"\n");
    }
    s += "echo \"@@READY $(cut -d' ' -f1 /proc/uptime)\"\n";
    for r in 0..runs {
        for (i, c) in cfgs.iter().enumerate() {
            let args = format!("{i} {} {r} {}", disk(c.disk), c.open_flags);
            // Alternate which side goes first, so a drift within a round favours neither.
            if r % 2 == 0 {
                s += &format!("kernel {args}\nucrypt {args}\n");
            } else {
                s += &format!("ucrypt {args}\nkernel {args}\n");
            }
        }
    }
    s += "echo \"@@DONE $(cut -d' ' -f1 /proc/uptime)\"\n";
    s
}

fn disk(i: usize) -> String {
    format!("/dev/vd{}", (b'a' + i as u8) as char)
}

/// Boots the VM and measures both sides; `Ok(Skipped)` when the VM cannot run here, `Err` when
/// it ran and a measurement failed.
pub fn measure(runs: usize, quick: bool, progress: bool) -> Result<KernelColumn, String> {
    if let Some(reason) = kit::vm::vm_missing() {
        return Ok(KernelColumn::Skipped { reason });
    }
    let ucrypt = match crate::ucrypt_bin() {
        Ok(p) => p,
        Err(e) => return Ok(KernelColumn::Skipped { reason: e }),
    };
    if progress {
        eprintln!("ucrypt bench integrity --vm: Debian trixie's kernel (fetched once into tests/vm/cache/trixie)");
    }
    let (kernel, modroot) = match kit::vm::trixie_kernel() {
        Ok(k) => k,
        Err(e) => return Ok(KernelColumn::Skipped { reason: e }),
    };
    let me = std::env::current_exe().map_err(|e| format!("locating ucrypt-bench: {e}"))?;
    let (image_mib, region_mib, ops) = if quick {
        (IMAGE_MIB_QUICK, REGION_MIB_QUICK, OPS_4K_QUICK)
    } else {
        (IMAGE_MIB, REGION_MIB, OPS_4K)
    };
    let cfgs = configs();
    // A signal stops the VM and ends the run here, removing the images.
    crate::interrupt::catch_signals();
    let tmp = kit::TempDir::new("bench-integrity-vm");
    let share = tmp.0.join("share");
    std::fs::create_dir_all(&share).map_err(|e| format!("{}: {e}", share.display()))?;
    for (from, to) in [(&me, "ucrypt-bench"), (&ucrypt, "ucrypt")] {
        std::fs::copy(from, share.join(to))
            .map_err(|e| format!("copying {} into the VM's share: {e}", from.display()))?;
    }
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let mut key = [0u8; 32];
    kit::SplitMix(seed).fill(&mut key);
    std::fs::write(share.join("key"), key).map_err(|e| format!("key file: {e}"))?;

    let mut run = kit::vm::VmRun::new(script(&cfgs, region_mib, ops, runs));
    for i in 0..VOLUMES.len() {
        let img = tmp.0.join(format!("vol{i}.img"));
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(image_mib << 20))
            .map_err(|e| format!("{}: {e}", img.display()))?;
        run.disk(&img, false);
    }
    run.share = Some(share);
    run.kernel = Some(kernel);
    run.modroot = Some(modroot);
    run.mem_mb = GUEST_MEM_MB;
    run.extra_mods = GUEST_EXTRA_MODS.iter().map(|m| m.to_string()).collect();
    run.echo = false;
    let per_round_mib = 2 * region_mib as u32 * cfgs.len() as u32 * 2;
    let per_round_ops_ms = 2 * ops as u32 * cfgs.len() as u32 * 2 * VM_MS_PER_4K_OP_MAX;
    let work_s = VM_FIXED_S
        + (VOLUMES.len() as u32 * region_mib as u32) / VM_EMULATED_MIB_S_MIN
        + runs as u32
            * (cfgs.len() as u32 * 2 * VM_PER_CONFIG_S
                + per_round_mib / VM_EMULATED_MIB_S_MIN
                + per_round_ops_ms / 1000);
    run.timeout_s = work_s * VM_BUSY_HOST_SLOWDOWN;
    run.silence_max_s = Some(VM_SILENCE_MAX_S);
    if progress {
        eprintln!(
            "ucrypt bench integrity --vm: booting the VM ({} configurations × 2 sides × {runs} \
             rounds, {region_mib} MiB + {ops} 4 KiB requests each way; time limit {} s, \
             or {VM_SILENCE_MAX_S} s without a line from the guest)",
            cfgs.len(),
            run.timeout_s
        );
    }
    let host_load_before = loadavg();
    let t0 = Instant::now();
    crate::interrupt::check()?;
    let out = run.run(&tmp.0);
    let vm_seconds = t0.elapsed().as_secs_f64();
    let host_load_after = loadavg();
    crate::interrupt::check()?;
    if progress {
        eprintln!("ucrypt bench integrity --vm: VM done in {vm_seconds:.0} s");
    }
    parse(&out.output, out.status, &cfgs, runs).map(|mut r| {
        r.image_mib = image_mib;
        r.region_mib = region_mib;
        r.ops_4k = ops;
        r.host_load_before = host_load_before;
        r.host_load_after = host_load_after;
        r.vm_seconds = vm_seconds;
        KernelColumn::Measured(Box::new(r))
    })
}

/// The report from the VM's output: every configuration must have a probe line per side and
/// round, else an error quoting the failures.
fn parse(output: &str, status: i32, cfgs: &[Config], runs: usize) -> Result<VmReport, String> {
    let Scanned {
        samples,
        sizes,
        failures,
        kernel_setup,
        kernel,
        guest_cpus,
        flags,
    } = scan(output, cfgs);
    let missing: Vec<String> = (0..cfgs.len() * 2)
        .filter(|i| samples[*i][0].len() != runs)
        .map(|i| {
            format!(
                "{} {}: {} of {runs} rounds",
                ["kernel", "ucrypt"][i % 2],
                cfgs[i / 2].name,
                samples[i][0].len()
            )
        })
        .collect();
    if status != 0 || !missing.is_empty() || !failures.is_empty() {
        let tail: Vec<&str> = output.lines().rev().take(30).collect();
        return Err(format!(
            "the VM run failed (status {status}); missing: {missing:?}; failures: {failures:?}\n\
             last lines of its output:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    let rows = vm_rows(&samples, &sizes, cfgs);
    let mut notes = Vec::new();
    for r in rows
        .iter()
        .filter(|r| r.kernel.device_bytes != r.ucrypt.device_bytes)
    {
        notes.push(format!(
            "{}: the kernel's device has {} bytes, ucrypt's {}: they should agree",
            r.name, r.kernel.device_bytes, r.ucrypt.device_bytes
        ));
    }
    Ok(VmReport {
        kernel,
        guest_cpus,
        guest_cpu_flags: flags,
        image_mib: 0,
        region_mib: 0,
        ops_4k: 0,
        runs,
        host_load_before: String::new(),
        host_load_after: String::new(),
        vm_seconds: 0.0,
        rows,
        kernel_setup,
        notes: vm_notes().into_iter().chain(notes).collect(),
    })
}

/// What the VM's output lines say, by kind.
struct Scanned {
    /// Per configuration and side (kernel, ucrypt), the probe's four measurements per round.
    samples: Vec<[Vec<f64>; 4]>,
    /// Per configuration and side, the device's size.
    sizes: Vec<u64>,
    /// The `@@FAIL` lines.
    failures: Vec<String>,
    /// The `@@SETUP` lines, with the configuration's name.
    kernel_setup: Vec<String>,
    kernel: String,
    guest_cpus: usize,
    flags: Vec<String>,
}

/// Reads the VM's `@@` lines: the kernel, the guest's CPU, failures, setup lines and probes.
fn scan(output: &str, cfgs: &[Config]) -> Scanned {
    const FLAGS: [&str; 8] = [
        "aes",
        "pclmulqdq",
        "ssse3",
        "avx",
        "avx2",
        "sha_ni",
        "vaes",
        "avx512f",
    ];
    let mut s = Scanned {
        samples: vec![[const { Vec::new() }; 4]; cfgs.len() * 2],
        sizes: vec![0u64; cfgs.len() * 2],
        failures: Vec::new(),
        kernel_setup: Vec::new(),
        kernel: String::new(),
        guest_cpus: 0,
        flags: Vec::new(),
    };
    for line in output.lines() {
        let mut w = line.split_whitespace();
        match w.next() {
            Some("@@VMTEST-BEGIN") => {
                s.kernel = w
                    .find_map(|x| x.strip_prefix("kernel="))
                    .unwrap_or_default()
                    .into()
            }
            Some("@@CPU") => {
                s.guest_cpus = w.next().and_then(|n| n.parse().ok()).unwrap_or(0);
                let all: Vec<&str> = w.collect();
                s.flags = FLAGS
                    .iter()
                    .filter(|f| all.contains(f))
                    .map(|f| f.to_string())
                    .collect();
            }
            Some("@@FAIL") => s.failures.push(line.to_string()),
            Some("@@SETUP") => {
                // "@@SETUP kernel:3 ..." → the configuration's name instead of its index.
                let rest = &line["@@SETUP ".len()..];
                let named = rest
                    .split_once(':')
                    .and_then(|(side, more)| {
                        let (idx, tail) = more.split_once(' ')?;
                        let c = cfgs.get(idx.trim_end_matches(':').parse::<usize>().ok()?)?;
                        Some(format!("{side}, {}: {}", c.name, tail.trim()))
                    })
                    .unwrap_or_else(|| rest.to_string());
                s.kernel_setup.push(named);
            }
            Some("@@PROBE") => {
                let tag = w.next().unwrap_or_default();
                let vals: Vec<f64> = w.filter_map(|x| x.parse().ok()).collect();
                let mut t = tag.split(':');
                let side = match t.next() {
                    Some("kernel") => 0,
                    Some("ucrypt") => 1,
                    _ => continue,
                };
                let Some(c) = t.next().and_then(|c| c.parse::<usize>().ok()) else {
                    continue;
                };
                if c < cfgs.len() && vals.len() == 5 {
                    for (k, v) in vals[..4].iter().enumerate() {
                        s.samples[c * 2 + side][k].push(*v);
                    }
                    s.sizes[c * 2 + side] = vals[4] as u64;
                }
            }
            _ => {}
        }
    }
    s
}

/// One row per configuration: both sides' summaries, each side's ratios to the same side of
/// the first configuration (plain).
fn vm_rows(samples: &[[Vec<f64>; 4]], sizes: &[u64], cfgs: &[Config]) -> Vec<VmRow> {
    let sums: Vec<[Summary; 4]> = samples
        .iter()
        .map(|s| [0, 1, 2, 3].map(|k| Summary::of(&s[k])))
        .collect();
    let side = |i: usize, plain: usize| VmSide {
        read_mib_s: sums[i][0],
        write_mib_s: sums[i][1],
        read_4k_us: sums[i][2],
        write_4k_us: sums[i][3],
        ratios: Ratios::to_plain(&sums[i], &sums[plain]),
        device_bytes: sizes[i],
    };
    cfgs.iter()
        .enumerate()
        .map(|(c, cfg)| {
            let (k, u) = (side(c * 2, 0), side(c * 2 + 1, 1));
            VmRow {
                name: cfg.name.clone(),
                ucrypt_over_kernel: u.ratios.over(&k.ratios),
                kernel: k,
                ucrypt: u,
            }
        })
        .collect()
}

/// How to read the VM report's numbers.
fn vm_notes() -> Vec<String> {
    vec![
        "the guest's CPU is emulated (qemu TCG): compare ratios only, never an absolute \
         number with the host's rows"
            .into(),
        "kernel and ucrypt serve the same cryptsetup-made volume on the same virtio disk, \
         measured by the same probe; their front ends differ (device-mapper in the kernel, \
         ublk and a userspace process for ucrypt), so absolute numbers across the two \
         sides are not comparable either: ublk's fixed cost per request is in both of \
         ucrypt's terms and dilutes its ratio toward 1"
            .into(),
        "ucrypt's ublk device takes requests of at most 512 KiB (IO_BYTES_MAX): a 1 MiB \
         request reaches ucrypt as two; the kernel's max_sectors_kb per device is in the \
         setup lines"
            .into(),
        "journal rows: dm-integrity's journal as `cryptsetup open` uses it; direct rows: \
         `--integrity-no-journal` on both sides; writes are O_DIRECT without flushes, so \
         neither side's journal commit per flush is in these numbers (docs/integrity.md, \
         \"What it costs\")"
            .into(),
    ]
}

/// The hidden `integrity-vm-probe` subcommand: the in-process scenario's four measurements on
/// a block device (O_DIRECT), printed as one `@@PROBE TAG read_mib_s write_mib_s read_4k_us
/// write_4k_us device_bytes` line.
pub fn probe(dev: &Path, bytes: u64, ops: usize, tag: &str) -> Result<(), String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .map_err(|e| format!("{}: {e}", dev.display()))?;
    let size = std::io::Seek::seek(&mut &f, std::io::SeekFrom::End(0))
        .map_err(|e| format!("{}: size: {e}", dev.display()))?;
    let big = BIG_BYTES as u64;
    let data = bytes.min(size) / big * big;
    if data == 0 {
        return Err(format!(
            "{}: {size} bytes, less than one {big}-byte request",
            dev.display()
        ));
    }
    let io: &mut Io = &mut |b: &mut [u8], off: u64, write: bool| {
        let r = if write {
            f.write_all_at(b, off)
        } else {
            f.read_exact_at(b, off)
        };
        r.map_err(|e| {
            let op = if write { "write" } else { "read" };
            format!("{}: {op} at {off}: {e}", dev.display())
        })
    };
    let mut buf = Aligned::new(BIG_BYTES);
    let r = sequential(io, data, false, &mut buf)?;
    let w = sequential(io, data, true, &mut buf)?;
    let r4 = small(io, data, false, ops, &mut buf)?;
    let w4 = small(io, data, true, ops, &mut buf)?;
    println!("@@PROBE {tag} {r:.3} {w:.3} {r4:.3} {w4:.3} {size}");
    Ok(())
}

fn ratio_cell(x: f64) -> String {
    format!("{x:.2}")
}

pub fn markdown(c: &KernelColumn) -> String {
    let r = match c {
        KernelColumn::Skipped { reason } => {
            return format!("\nKernel column: SKIPPED: {reason}.\n")
        }
        KernelColumn::Measured(r) => r,
    };
    let mut o = format!(
        "\n### Kernel column: dm-crypt (+ dm-integrity) vs ucrypt, in the test VM (ratios)\n\n\
         One boot of Linux {} under qemu TCG (`-cpu max`, emulated; {} vCPUs; guest flags {}), \
         {:.0} s. Each volume made by the guest's cryptsetup (LUKS2, 4096-byte sectors, {} MiB \
         image on a virtio disk); the kernel opens it (`cryptsetup open`), ucrypt serves the \
         same volume as /dev/ublkbN (`ucrypt ublk`, policy auto); one probe measures both \
         devices, O_DIRECT: 1 MiB sequential over the first {} MiB, {} random 4 KiB requests \
         at QD1. {} rounds, the two sides alternating; medians. Host load (/proc/loadavg) \
         before: {}; after: {}.\n\n",
        r.kernel,
        r.guest_cpus,
        r.guest_cpu_flags.join(" "),
        r.vm_seconds,
        r.image_mib,
        r.region_mib,
        r.ops_4k,
        r.runs,
        r.host_load_before,
        r.host_load_after,
    );
    o += "Ratio to the same side's plain XTS volume (throughput this / plain, latency plain / \
          this: below 1 is slower), kernel | ucrypt | ucrypt ÷ kernel:\n\n";
    o += "| volume | 1 MiB read | 1 MiB write | 4 KiB QD1 read | 4 KiB QD1 write |\n";
    o += "|---|---|---|---|---|\n";
    for row in &r.rows {
        let (k, u, q) = (
            row.kernel.ratios.cells(),
            row.ucrypt.ratios.cells(),
            row.ucrypt_over_kernel.cells(),
        );
        o += &format!("| {} |", row.name);
        for i in 0..4 {
            o += &format!(
                " {} \\| {} \\| **{}** |",
                ratio_cell(k[i]),
                ratio_cell(u[i]),
                ratio_cell(q[i])
            );
        }
        o += "\n";
    }
    o += "\nThe measurements behind them, median (min–max), emulated CPU: not comparable \
          with the host's rows, nor across the two sides (different front ends):\n\n";
    o += "| volume | side | 1 MiB read MiB/s | 1 MiB write MiB/s | 4 KiB QD1 read µs | 4 KiB QD1 write µs |\n";
    o += "|---|---|---|---|---|---|\n";
    for row in &r.rows {
        for (name, s) in [("kernel", &row.kernel), ("ucrypt", &row.ucrypt)] {
            o += &format!(
                "| {} | {name} | {} | {} | {} | {} |\n",
                row.name,
                s.read_mib_s.show(1),
                s.write_mib_s.show(1),
                s.read_4k_us.show(0),
                s.write_4k_us.show(0)
            );
        }
    }
    o += "\nSetup, as the guest reported it:\n\n";
    for s in &r.kernel_setup {
        o += &format!("- {s}\n");
    }
    for n in &r.notes {
        o += &format!("\nNote: {n}.\n");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_process_rows_map_to_vm_rows() {
        let rows = [
            (
                "plain aes-xts-plain64 (policy auto)",
                Some("plain aes-xts-plain64"),
            ),
            ("plain aes-xts-plain64 (policy inline)", None),
            (
                "aes-gcm-random + aead",
                Some("aes-gcm-random + aead (direct)"),
            ),
            (
                "aes-gcm-random + aead (journal)",
                Some("aes-gcm-random + aead (journal)"),
            ),
            ("chacha20-random + poly1305 (policy inline)", None),
        ];
        for (name, want) in rows {
            assert_eq!(vm_row_for(name).as_deref(), want, "{name}");
        }
    }

    #[test]
    fn parse_computes_ratios_and_reports_missing_cells() {
        let cfgs = configs();
        let mut out = String::from("@@VMTEST-BEGIN kernel=6.12.0 uptime=1\n@@CPU 2 fpu aes avx2\n");
        for r in 0..2 {
            for c in 0..cfgs.len() {
                // Plain: 100 MiB/s, 100 µs; the others half as fast on the kernel side and
                // three quarters on ucrypt's.
                let (k, u) = if c == 0 { (1.0, 1.0) } else { (0.5, 0.75) };
                out += &format!(
                    "@@PROBE kernel:{c}:{r} {} {} {} {} 8388608\n",
                    100.0 * k,
                    100.0 * k,
                    100.0 / k,
                    100.0 / k
                );
                out += &format!(
                    "@@PROBE ucrypt:{c}:{r} {} {} {} {} 8388608\n",
                    100.0 * u,
                    100.0 * u,
                    100.0 / u,
                    100.0 / u
                );
            }
        }
        let rep = parse(&out, 0, &cfgs, 2).expect("parses");
        assert_eq!(rep.kernel, "6.12.0");
        assert_eq!(rep.guest_cpu_flags, ["aes", "avx2"]);
        let gcm = &rep.rows[1];
        assert_eq!(gcm.name, "aes-gcm-random + aead (journal)");
        assert_eq!(gcm.kernel.ratios.cells(), [0.5; 4]);
        assert_eq!(gcm.ucrypt.ratios.cells(), [0.75; 4]);
        assert_eq!(gcm.ucrypt_over_kernel.cells(), [1.5; 4]);
        assert_eq!(gcm.ucrypt.device_bytes, 8 << 20);
        // One round fewer than asked for: an error naming the cell.
        let e = parse(&out, 0, &cfgs, 3).expect_err("missing rounds");
        assert!(
            e.contains("kernel plain aes-xts-plain64: 2 of 3 rounds"),
            "{e}"
        );
        // A failure line fails the run.
        let e =
            parse(&format!("{out}@@FAIL ucrypt:1:0 start\n"), 0, &cfgs, 2).expect_err("failure");
        assert!(e.contains("@@FAIL ucrypt:1:0 start"), "{e}");
    }
}
