//! TrueCrypt/VeraCrypt: every image of cryptsetup's `tests/tcrypt-images.tar.xz`, with the
//! checks of its `tcrypt-compat-test` (header dumps with the script's hash and cipher filters,
//! the VeraCrypt-only images refused with `--disable-veracrypt`, hidden volumes, keyfiles,
//! PIM, system volumes), and the data: `export --type tcrypt` stands for the script's
//! activation, and the plaintext's FAT serial must be the one the script reads with blkid
//! (DEAD-BABE, hidden CAFE-BABE). Where cryptsetup is installed, its `tcryptDump` runs beside
//! ucrypt's on the same image and every field both print must agree.
//!
//! Images skipped, with why, are listed at the end of the run (kuznyechik: no Debian kernel
//! has it, and ucrypt refuses it by name). The legacy modes cryptsetup does not activate
//! (`cbci-tcrypt`, `cbc-tcrypt`) and `cbc-tcw` are N/A for the data as in the script: the
//! refusal must name the TCRYPT legacy mode.
//!
//! SKIPPED when cryptsetup's test material cannot be had or xz is missing.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use cli_common::{have, run_in, text, UCRYPT};

const PASSWORD: &str = "aaaaaaaaaaaa";
const PASSWORD_HIDDEN: &str = "bbbbbbbbbbbb";
const PASSWORD_72C: &str =
    "aaaaaaaaaaaabbbbbbbbbbbbccccccccccccddddddddddddeeeeeeeeeeeeffffffffffff";
const PIM: &str = "1234";

/// The script's `cut -d- -f3` and `-f5` of the path `tcrypt-images/NAME`: the hash and the
/// first cipher.
fn hash_cipher(name: &str) -> (String, String) {
    let path = format!("tcrypt-images/{name}");
    let f: Vec<&str> = path.split('-').collect();
    (f[2].to_string(), f[4].to_string())
}

/// The FAT volume serial of a boot sector as blkid prints it (`DEAD-BABE`).
fn fat_serial(boot: &[u8]) -> String {
    let at = if &boot[0x52..0x5a] == b"FAT32   " {
        0x43
    } else {
        0x27
    };
    let v = u32::from_le_bytes(boot[at..at + 4].try_into().unwrap());
    format!("{:04X}-{:04X}", v >> 16, v & 0xffff)
}

/// "Key:\tvalue" lines of a dump, the value without cryptsetup 2.8's " [bytes]".
fn fields(dump: &str) -> Vec<(String, String)> {
    dump.lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| {
            (
                k.trim().to_string(),
                v.trim().trim_end_matches(" [bytes]").to_string(),
            )
        })
        .collect()
}

/// The "MK offset" a dump prints, in bytes.
fn mk_offset_of(dump: &str) -> usize {
    fields(dump)
        .into_iter()
        .find(|(k, _)| k == "MK offset")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

struct Run {
    failures: Vec<String>,
    skipped: Vec<String>,
    passed: usize,
    compared: usize,
    cryptsetup: bool,
}

impl Run {
    fn check(&mut self, what: &str, ok: bool, detail: impl FnOnce() -> String) {
        if ok {
            self.passed += 1;
        } else {
            self.failures.push(format!("{what}: {}", detail()));
        }
    }
}

fn dump_args<'a>(extra: &[&'a str], hash: &'a str, cipher: &'a str, file: &'a str) -> Vec<&'a str> {
    let mut a = vec!["tcryptDump"];
    a.extend_from_slice(extra);
    a.extend_from_slice(&["-h", hash, "-c", cipher, file]);
    a
}

#[test]
fn tcrypt_images() {
    let Some((tmp, dir)) = cli_common::unpacked_images("tcrypt-images") else {
        return;
    };
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !matches!(n.as_str(), "README" | "keyfile1" | "keyfile2"))
        .collect();
    names.sort();
    let mut run = Run {
        failures: Vec::new(),
        skipped: Vec::new(),
        passed: 0,
        compared: 0,
        cryptsetup: have("cryptsetup"),
    };
    let kf1 = dir.join("keyfile1").display().to_string();
    let kf2 = dir.join("keyfile2").display().to_string();
    for name in &names {
        let file = dir.join(name).display().to_string();
        let (hash, cipher) = hash_cipher(name);
        if name.contains("kuznyechik") {
            run.skipped.push(format!(
                "{name}: kuznyechik is in no Debian kernel; ucrypt refuses it by name"
            ));
            continue;
        }
        let pim = name.starts_with("vcpim_");
        let system = name.starts_with("sys_");
        let keyfiles = name.starts_with("tck_") || name.starts_with("vck_");
        let hidden = name.ends_with("-hidden");
        let mut extra: Vec<&str> = Vec::new();
        if pim {
            extra.extend_from_slice(&["--veracrypt-pim", PIM]);
        }
        if system {
            extra.push("--tcrypt-system");
        }
        let password = if name.starts_with("vck_1_nopw") {
            ""
        } else if name.starts_with("vck_1_pw72") {
            PASSWORD_72C
        } else {
            PASSWORD
        };
        if keyfiles {
            extra.extend_from_slice(&["-d", &kf1, "-d", &kf2]);
        }
        let input = format!("{password}\n");
        // HEADER CHECK / HEADER KEYFILES CHECK.
        let args = dump_args(&extra, &hash, &cipher, &file);
        let out = run_in(UCRYPT, &args, input.as_bytes());
        run.check(&format!("{name}: tcryptDump"), out.status.success(), || {
            text(&out)
        });
        let ours = String::from_utf8_lossy(&out.stdout).into_owned();
        if run.cryptsetup && out.status.success() {
            let cs = run_in("cryptsetup", &args, input.as_bytes());
            if cs.status.success() {
                let theirs = String::from_utf8_lossy(&cs.stdout).into_owned();
                let mine = fields(&ours);
                for (k, v) in fields(&theirs) {
                    let got = mine.iter().find(|(mk, _)| *mk == k).map(|(_, v)| v.clone());
                    run.check(
                        &format!("{name}: dump field {k}"),
                        got.as_deref() == Some(&v),
                        || format!("cryptsetup {v:?}, ucrypt {got:?}"),
                    );
                }
                run.compared += 1;
            } else {
                run.skipped.push(format!(
                    "{name}: dump not compared, cryptsetup 2.6 cannot read it here: {}",
                    text(&cs).lines().last().unwrap_or("")
                ));
            }
        }
        if name.ends_with("-sha512-xts-aes") && !keyfiles {
            let a = dump_args(&extra, "sha512", "aes", &file);
            let o = run_in(UCRYPT, &a, input.as_bytes());
            run.check(
                &format!("{name}: -h sha512 -c aes"),
                o.status.success(),
                || text(&o),
            );
            let mut a = vec!["tcryptDump"];
            a.extend_from_slice(&extra);
            a.extend_from_slice(&["-h", "xxxx", &file]);
            let o = run_in(UCRYPT, &a, input.as_bytes());
            run.check(
                &format!("{name}: -h xxxx fails"),
                !o.status.success(),
                || text(&o),
            );
            let a = dump_args(&extra, "sha512", "xxx", &file);
            let o = run_in(UCRYPT, &a, input.as_bytes());
            run.check(
                &format!("{name}: -c xxx fails"),
                !o.status.success(),
                || text(&o),
            );
        }
        // HEADER CHECK (TCRYPT only).
        if name.starts_with("vc_") || pim {
            let mut e = extra.clone();
            e.push("--disable-veracrypt");
            let a = dump_args(&e, &hash, &cipher, &file);
            let o = run_in(UCRYPT, &a, input.as_bytes());
            run.check(
                &format!("{name}: --disable-veracrypt fails"),
                !o.status.success(),
                || text(&o),
            );
        }
        // HEADER CHECK (HIDDEN).
        if hidden {
            let a = dump_args(&["--tcrypt-hidden"], &hash, &cipher, &file);
            let hin = format!("{PASSWORD_HIDDEN}\n");
            let o = run_in(UCRYPT, &a, hin.as_bytes());
            run.check(
                &format!("{name}: hidden tcryptDump"),
                o.status.success(),
                || text(&o),
            );
        }
        if keyfiles {
            continue;
        }
        // ACTIVATION FS UUID CHECK (and HIDDEN, SYSTEM through the image).
        let mut cases = vec![(extra.clone(), input.clone(), "DEAD-BABE")];
        if hidden {
            cases.push((
                vec!["--tcrypt-hidden"],
                format!("{PASSWORD_HIDDEN}\n"),
                "CAFE-BABE",
            ));
        }
        for (i, (e, inp, want)) in cases.into_iter().enumerate() {
            let outf = tmp.path(&format!("{name}.{i}.plain"));
            let outs = outf.display().to_string();
            let mut a = vec!["export", "--type", "tcrypt", "-r"];
            a.extend_from_slice(&e);
            a.extend_from_slice(&["-h", &hash, "--cipher", &cipher, &file, &outs]);
            let o = run_in(UCRYPT, &a, inp.as_bytes());
            let msg = text(&o);
            if !o.status.success() && msg.contains("TCRYPT legacy mode") {
                run.skipped.push(format!(
                    "{name} ({want}): data N/A: {}",
                    msg.lines().last().unwrap_or("")
                ));
                continue;
            }
            run.check(
                &format!("{name}: export ({want})"),
                o.status.success(),
                || msg,
            );
            if !o.status.success() {
                continue;
            }
            let data = std::fs::read(&outf).unwrap();
            // A whole-system image maps the whole encrypted area (cryptsetup's choice for a
            // drive image without partition devices), from the header's MK offset; its file
            // system is the first MBR partition's, which the script reads through a loop
            // device's partition.
            let fs_at = if system && name.contains("_full") {
                let img = std::fs::read(&file).unwrap();
                let lba = u32::from_le_bytes(img[0x1c6..0x1ca].try_into().unwrap()) as usize;
                (lba * 512).saturating_sub(mk_offset_of(&ours))
            } else {
                0
            };
            let got = if data.len() >= fs_at + 512 {
                fat_serial(&data[fs_at..fs_at + 512])
            } else {
                String::new()
            };
            run.check(&format!("{name}: FAT serial"), got == want, || {
                format!("got {got}, want {want}")
            });
            let _ = std::fs::remove_file(&outf);
        }
    }
    for s in &run.skipped {
        eprintln!("SKIPPED: {s}");
    }
    for f in &run.failures {
        eprintln!("FAILED: {f}");
    }
    eprintln!(
        "tcrypt images: {} checks passed, {} failed, {} skipped; {} dumps compared with cryptsetup",
        run.passed,
        run.failures.len(),
        run.skipped.len(),
        run.compared
    );
    assert!(run.failures.is_empty(), "{} failures", run.failures.len());
}
