//! TrueCrypt/VeraCrypt: every image of cryptsetup's `tests/tcrypt-images.tar.xz`, with the
//! checks of its `tcrypt-compat-test` (header dumps with the script's hash and cipher filters,
//! the VeraCrypt-only images refused with `--disable-veracrypt`, hidden volumes, keyfiles,
//! PIM, system volumes), and the data: `export --type tcrypt` stands for the script's
//! activation, and the plaintext's FAT serial must be the one the script reads with blkid
//! (DEAD-BABE, hidden CAFE-BABE); the keyfile images (which the script only dumps) are
//! exported too, with both keyfiles as two `--key-file`. Where cryptsetup is installed, its
//! `tcryptDump` runs beside ucrypt's on the same image and every field both print must agree.
//!
//! Images skipped, with why, are listed at the end of the run (kuznyechik: no Debian kernel
//! has it, and ucrypt refuses it by name). The legacy modes cryptsetup does not activate
//! (`cbci-tcrypt`, `cbc-tcrypt`: the CBC cascades and Blowfish) are N/A for the data as in
//! the script, and only those: the refusal must name the TCRYPT legacy mode. `cbc-tcw` (aes,
//! serpent, twofish, and the 64-bit cast5 and des3_ede) is mapped and checked as the others.
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

/// The "Cipher mode" a dump prints (`xts-plain64`, `cbc-tcw`, `cbci-tcrypt`, ...).
fn mode_of(dump: &str) -> String {
    fields(dump)
        .into_iter()
        .find(|(k, _)| k == "Cipher mode")
        .map(|(_, v)| v)
        .unwrap_or_default()
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
        let mut hidden_dump = String::new();
        if hidden {
            let a = dump_args(&["--tcrypt-hidden"], &hash, &cipher, &file);
            let hin = format!("{PASSWORD_HIDDEN}\n");
            let o = run_in(UCRYPT, &a, hin.as_bytes());
            run.check(
                &format!("{name}: hidden tcryptDump"),
                o.status.success(),
                || text(&o),
            );
            hidden_dump = String::from_utf8_lossy(&o.stdout).into_owned();
        }
        // ACTIVATION FS UUID CHECK (and HIDDEN, SYSTEM through the image; the keyfile
        // images with both keyfiles, two --key-file).
        let mut cases = vec![(extra.clone(), input.clone(), "DEAD-BABE", mode_of(&ours))];
        if hidden {
            cases.push((
                vec!["--tcrypt-hidden"],
                format!("{PASSWORD_HIDDEN}\n"),
                "CAFE-BABE",
                mode_of(&hidden_dump),
            ));
        }
        for (i, (e, inp, want, mode)) in cases.into_iter().enumerate() {
            let outf = tmp.path(&format!("{name}.{i}.plain"));
            let outs = outf.display().to_string();
            let mut a = vec!["export", "--type", "tcrypt", "-r"];
            a.extend_from_slice(&e);
            a.extend_from_slice(&["-h", &hash, "--cipher", &cipher, &file, &outs]);
            let o = run_in(UCRYPT, &a, inp.as_bytes());
            let msg = text(&o);
            if !o.status.success()
                && msg.contains("TCRYPT legacy mode")
                && mode.ends_with("-tcrypt")
            {
                run.skipped.push(format!(
                    "{name} ({want}): data N/A ({mode}): {}",
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

/// The keyfile pool on the verbs that open a volume: cryptsetup's keyfile image
/// (`tck_5-sha512-xts-aes`, keyfile1 and keyfile2) exported with two `--key-file` holds the
/// FAT serial the script's other images hold; one keyfile alone opens nothing; the second
/// keyfile may come as ucrypt's `--tcrypt-keyfile`; `open --test-passphrase` takes the two
/// too. Any other type refuses a second `--key-file` with cryptsetup's words and exit code.
#[test]
fn tcrypt_keyfile_pool_on_every_verb() {
    let Some((tmp, dir)) = cli_common::unpacked_images("tcrypt-images") else {
        return;
    };
    let name = "tck_5-sha512-xts-aes";
    let (file, kf1, kf2) = (dir.join(name), dir.join("keyfile1"), dir.join("keyfile2"));
    let (file, kf1, kf2) = (kit::s(&file), kit::s(&kf1), kit::s(&kf2));
    let input = format!("{PASSWORD}\n");
    // TrueCrypt's SHA-512 KDF only: a quick search.
    let filters = ["--disable-veracrypt", "-h", "sha512", "--cipher", "aes"];
    let export = |keys: &[&str], out: &str| {
        let mut a = vec!["export", "--type", "tcrypt", "-r"];
        a.extend_from_slice(&filters);
        a.extend_from_slice(keys);
        a.extend_from_slice(&[file, out]);
        run_in(UCRYPT, &a, input.as_bytes())
    };
    let rows: [(&str, Vec<&str>, bool); 4] = [
        ("two --key-file", vec!["-d", kf1, "--key-file", kf2], true),
        ("the other order", vec!["-d", kf2, "-d", kf1], true),
        (
            "--tcrypt-keyfile",
            vec!["-d", kf1, "--tcrypt-keyfile", kf2],
            true,
        ),
        ("one keyfile", vec!["-d", kf1], false),
    ];
    for (what, keys, opens) in rows {
        let out = tmp.path(&format!("{what}.plain"));
        let o = export(&keys, kit::s(&out));
        assert_eq!(o.status.success(), opens, "{what}: {}", text(&o));
        if opens {
            let data = std::fs::read(&out).unwrap();
            assert_eq!(fat_serial(&data[..512]), "DEAD-BABE", "{what}");
        }
    }
    let mut a = vec!["open", "--type", "tcrypt", "--test-passphrase"];
    a.extend_from_slice(&filters);
    a.extend_from_slice(&["-d", kf1, "-d", kf2, file]);
    let o = run_in(UCRYPT, &a, input.as_bytes());
    assert!(o.status.success(), "open --test-passphrase: {}", text(&o));
    // cryptsetup: "Only one --key-file argument is allowed." (usage, exit 1) for other types.
    let out = tmp.path("plain.out");
    let refusals: [Vec<&str>; 3] = [
        vec![
            "export",
            "--type",
            "plain",
            "-c",
            "aes-xts-plain64",
            "-d",
            kf1,
            "-d",
            kf2,
            file,
            kit::s(&out),
        ],
        vec![
            "open",
            "--type",
            "luks2",
            "--test-passphrase",
            "-d",
            kf1,
            "-d",
            kf2,
            file,
        ],
        vec![
            "open",
            "--type",
            "plain",
            "-c",
            "aes-xts-plain64",
            "-d",
            kf1,
            "-d",
            kf2,
            file,
            "n",
        ],
    ];
    for a in refusals {
        let o = run_in(UCRYPT, &a, b"");
        assert_eq!(o.status.code(), Some(1), "{a:?}: {}", text(&o));
        assert!(
            text(&o).contains("Only one --key-file argument is allowed."),
            "{a:?}: {}",
            text(&o)
        );
    }
}

/// TrueCrypt 3.x's CBC over the 64-bit ciphers (cast5, des3_ede: dm-crypt's `tcw` with an
/// 8-byte block) is written as dm-crypt writes it: data imported into a copy of the image
/// reads back whole, the header and the bytes after the data are untouched, and the image's
/// ciphertext changes only where the data is. (Reads equal dm-crypt's byte for byte: the VM
/// test; a sector's CBC decryption is a bijection, so a write that reads back through the
/// same transform is the kernel's write.)
#[test]
fn tcrypt_64bit_cbc_writes_read_back() {
    let Some((tmp, dir)) = cli_common::unpacked_images("tcrypt-images") else {
        return;
    };
    for name in ["tc_1-sha1-cbc-cast5", "tc_1-sha1-cbc-des3_ede"] {
        let (hash, cipher) = hash_cipher(name);
        let img = tmp.path(&format!("{name}.rw"));
        std::fs::copy(dir.join(name), &img).unwrap();
        let before = std::fs::read(&img).unwrap();
        let input = format!("{PASSWORD}\n");
        let opts = [
            "--type",
            "tcrypt",
            "-h",
            hash.as_str(),
            "--cipher",
            cipher.as_str(),
        ];
        let plain0 = tmp.path(&format!("{name}.0"));
        let mut a = vec!["export"];
        a.extend_from_slice(&opts);
        a.extend_from_slice(&[kit::s(&img), kit::s(&plain0)]);
        let o = run_in(UCRYPT, &a, input.as_bytes());
        assert!(o.status.success(), "{name}: export: {}", text(&o));
        let data_len = std::fs::metadata(&plain0).unwrap().len() as usize;
        assert_eq!(
            fat_serial(&std::fs::read(&plain0).unwrap()[..512]),
            "DEAD-BABE"
        );
        // A pattern unlike the file system, each sector different.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let new: Vec<u8> = (0..data_len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let newf = tmp.path(&format!("{name}.new"));
        std::fs::write(&newf, &new).unwrap();
        let mut a = vec!["import", kit::s(&newf)];
        a.extend_from_slice(&opts);
        a.push(kit::s(&img));
        let o = run_in(UCRYPT, &a, input.as_bytes());
        assert!(o.status.success(), "{name}: import: {}", text(&o));
        let plain1 = tmp.path(&format!("{name}.1"));
        let mut a = vec!["export"];
        a.extend_from_slice(&opts);
        a.extend_from_slice(&[kit::s(&img), kit::s(&plain1)]);
        let o = run_in(UCRYPT, &a, input.as_bytes());
        assert!(
            o.status.success(),
            "{name}: export after import: {}",
            text(&o)
        );
        assert!(
            std::fs::read(&plain1).unwrap() == new,
            "{name}: the data read back differs"
        );
        let after = std::fs::read(&img).unwrap();
        assert_eq!(after.len(), before.len());
        // The data starts after the 512-byte header (a TrueCrypt 3.x volume's MK offset).
        let (start, end) = (512, 512 + data_len);
        assert!(
            after[..start] == before[..start],
            "{name}: the header changed"
        );
        assert!(
            after[end..] == before[end..],
            "{name}: bytes past the data changed"
        );
        assert!(
            after[start..end] != before[start..end],
            "{name}: no ciphertext changed"
        );
    }
}

/// Where the guest copies the images (cryptsetup 2.6 does not read the TCRYPT header through
/// the 9p share).
const GUEST_DIR: &str = "/tmp/ti";
/// Seconds a guest cryptsetup call may take (a slow one is reported as not compared).
const GUEST_SECS_MAX: u32 = 90;
/// Set (to anything): the VM test reads the VeraCrypt images too, the long mode. Their
/// hundreds of thousands of PBKDF2 iterations cost the guest's cryptsetup 30 to 60 s a call
/// under TCG, each image two calls: about half an hour for all.
const VERACRYPT_VAR: &str = "UCRYPT_TCRYPT_VM_VERACRYPT";
/// Seconds a guest cryptsetup call may take in the long mode.
const GUEST_SECS_MAX_LONG: u32 = 600;

fn guest_secs_max() -> u32 {
    if std::env::var_os(VERACRYPT_VAR).is_some() {
        GUEST_SECS_MAX_LONG
    } else {
        GUEST_SECS_MAX
    }
}

/// Images whose data the VM test must compare with dm-crypt's, whatever else it lists as not
/// compared: TrueCrypt 3.x's CBC over the 64-bit CAST5 and triple DES (dm-crypt's `tcw` IV
/// with an 8-byte block), and the keyfile image (two `--key-file`).
const VM_MUST_COMPARE: [&str; 3] = [
    "tc_1-sha1-cbc-cast5",
    "tc_1-sha1-cbc-des3_ede",
    "tck_5-sha512-xts-aes",
];

/// One image the VM test reads with the guest's cryptsetup.
struct VmCase {
    name: String,
    /// Options besides `-h`/`-c` and the image, with the guest's paths.
    extra: Vec<String>,
    password: &'static str,
}

/// The images the VM test reads: every TrueCrypt one (few PBKDF2 iterations; the keyfile ones
/// with their two keyfiles; hidden volumes twice), and with [`VERACRYPT_VAR`] set every
/// VeraCrypt one but kuznyechik's (in no Debian kernel), with the options the host test
/// gives each (PIM, system, keyfiles, passphrase).
fn vm_cases(names: &[String]) -> Vec<VmCase> {
    let veracrypt = std::env::var_os(VERACRYPT_VAR).is_some();
    let mut cases = Vec::new();
    for name in names {
        let tc = name.starts_with("tc_") || name.starts_with("tck_");
        let vc = ["vc_", "vck_", "vcpim_", "sys_vc"]
            .iter()
            .any(|p| name.starts_with(p))
            && !name.contains("kuznyechik");
        if !(tc || veracrypt && vc) {
            continue;
        }
        let mut extra = Vec::new();
        if name.starts_with("vcpim_") {
            extra.extend(["--veracrypt-pim".to_string(), PIM.to_string()]);
        }
        if name.starts_with("sys_") {
            extra.push("--tcrypt-system".to_string());
        }
        if name.starts_with("tck_") || name.starts_with("vck_") {
            for k in ["keyfile1", "keyfile2"] {
                extra.extend(["-d".to_string(), format!("{GUEST_DIR}/{k}")]);
            }
        }
        let password = if name.starts_with("vck_1_nopw") {
            ""
        } else if name.starts_with("vck_1_pw72") {
            PASSWORD_72C
        } else {
            PASSWORD
        };
        cases.push(VmCase {
            name: name.clone(),
            extra,
            password,
        });
        if name.ends_with("-hidden") {
            cases.push(VmCase {
                name: name.clone(),
                extra: vec!["--tcrypt-hidden".into()],
                password: PASSWORD_HIDDEN,
            });
        }
    }
    cases
}

/// The guest's script: per case, its `tcryptDump` and the sha256 of its `tcryptOpen -r`
/// device (or why it was refused), between markers. Each cryptsetup call has
/// [`GUEST_SECS_MAX`]: a slow one is reported, not waited for.
fn vm_script(cases: &[VmCase]) -> String {
    let mut s = format!("cp -r /mnt/host {GUEST_DIR} && cd {GUEST_DIR} || exit 1\n");
    let cs = format!("timeout {} cryptsetup", guest_secs_max());
    for (i, c) in cases.iter().enumerate() {
        let (hash, cipher) = hash_cipher(&c.name);
        let opts = format!("{} -h {hash} -c {cipher} {}", c.extra.join(" "), c.name);
        let pw = c.password;
        s += &format!(
            "echo '@@ {i} dump'\nprintf '%s\\n' '{pw}' | {cs} tcryptDump {opts} 2>&1\n\
             echo '@@ {i} open'\n\
             if printf '%s\\n' '{pw}' | {cs} tcryptOpen -r {opts} t{i} 2>/tmp/err; then\n\
             \x20 sha256sum /dev/mapper/t{i} | cut -c1-64; cryptsetup close t{i}\n\
             else echo \"REFUSED $(tail -n 1 /tmp/err)\"; fi\n"
        );
    }
    s + "echo '@@ end'\n"
}

/// What the guest printed for case `i`'s `part` ("dump" or "open").
fn vm_part<'a>(out: &'a str, i: usize, part: &str) -> Option<&'a str> {
    let start = out.find(&format!("@@ {i} {part}\n"))?;
    let body = &out[start..];
    let body = &body[body.find('\n')? + 1..];
    Some(&body[..body.find("@@ ").unwrap_or(body.len())])
}

/// cryptsetup's own reading of the images, in the VM (its TCRYPT code needs the kernel's
/// AF_ALG skcipher, which this host may lack): for each of [`vm_cases`] the guest's
/// cryptsetup reads, every field its `tcryptDump` prints must be ucrypt's, and its
/// `tcryptOpen -r` device must hold exactly what `ucrypt export --type tcrypt` writes (sha256
/// of the whole device); a legacy mode cryptsetup does not activate must be refused by ucrypt
/// too. What the guest's cryptsetup cannot read (a search past [`GUEST_SECS_MAX`]) is listed
/// as not compared, with its words; but the data of [`VM_MUST_COMPARE`] must be compared.
#[test]
fn tcrypt_images_beside_cryptsetup_in_the_vm() {
    if let Err(reason) = kit::vm::require_vm() {
        println!("SKIPPED tcrypt images in the VM: {reason}");
        return;
    }
    let Some((tmp, dir)) = cli_common::unpacked_images("tcrypt-images") else {
        return;
    };
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let cases = vm_cases(&names);
    let mut run = kit::vm::VmRun::new(vm_script(&cases));
    run.share = Some(dir.clone());
    run.silence_max_s = Some(guest_secs_max() * 2);
    // About 4 s per image under TCG on a busy host.
    run.timeout_s = if std::env::var_os(VERACRYPT_VAR).is_some() {
        7200
    } else {
        1200
    };
    // The kernel parts beyond the harness's list: LRW, TCW's CRC32, the 64-bit block
    // ciphers of the oldest images, and the VeraCrypt images' Camellia.
    run.extra_mods = [
        "lrw",
        "crc32_generic",
        "blowfish_generic",
        "cast5_generic",
        "des_generic",
        "camellia_generic",
    ]
    .map(String::from)
    .to_vec();
    let work = tmp.path("vm");
    std::fs::create_dir_all(&work).unwrap();
    let out = run.run(&work);
    assert!(out.output.contains("@@ end"), "the guest did not finish");
    let host = |s: &str| s.replace(GUEST_DIR, &dir.display().to_string());
    let (mut dumps, mut data, mut refused) = (0, 0, 0);
    let mut skipped = Vec::new();
    let mut compared: Vec<&str> = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let what = format!("{}{}", c.name, c.extra.first().map_or("", |e| &e[..]));
        let (hash, cipher) = hash_cipher(&c.name);
        let file = dir.join(&c.name).display().to_string();
        let extra: Vec<String> = c.extra.iter().map(|e| host(e)).collect();
        let extra: Vec<&str> = extra.iter().map(|e| e.as_str()).collect();
        let input = format!("{}\n", c.password);
        let said = vm_part(&out.output, i, "dump").expect("a dump part");
        let theirs = fields(&format!("\n{said}"));
        if theirs.len() < 5 {
            let why = said.lines().last().unwrap_or("no output (timed out)");
            skipped.push(format!(
                "{what}: the guest's cryptsetup cannot dump it: {why}"
            ));
            continue;
        }
        let args = dump_args(&extra, &hash, &cipher, &file);
        let ours = run_in(UCRYPT, &args, input.as_bytes());
        assert!(
            ours.status.success(),
            "{what}: ucrypt tcryptDump: {}",
            text(&ours)
        );
        let mine = fields(&String::from_utf8_lossy(&ours.stdout));
        for (k, v) in &theirs {
            let got = mine.iter().find(|(mk, _)| mk == k).map(|(_, v)| v);
            assert_eq!(got, Some(v), "{what}: dump field {k}");
        }
        dumps += 1;
        let opened = vm_part(&out.output, i, "open")
            .expect("an open part")
            .trim();
        let plain = tmp.path(&format!("vm-{i}.plain"));
        let mut a = vec!["export", "--type", "tcrypt", "-r"];
        a.extend_from_slice(&extra);
        a.extend_from_slice(&["-h", &hash, "--cipher", &cipher, &file, kit::s(&plain)]);
        let o = run_in(UCRYPT, &a, input.as_bytes());
        if let Some(why) = opened.strip_prefix("REFUSED") {
            if why.contains("legacy mode") {
                assert!(
                    !o.status.success(),
                    "{what}: cryptsetup refused ({why}), ucrypt not"
                );
                refused += 1;
            } else {
                skipped.push(format!(
                    "{what}: data not compared, the guest's cryptsetup:{why}"
                ));
            }
            continue;
        }
        let msg = text(&o);
        assert!(o.status.success(), "{what}: ucrypt export: {msg}");
        let sum = kit::vm::host("sha256sum", &[kit::s(&plain)]).unwrap();
        assert_eq!(
            &sum[..64],
            opened,
            "{what}: the plaintext differs from dm-crypt's"
        );
        let _ = std::fs::remove_file(&plain);
        data += 1;
        compared.push(c.name.as_str());
    }
    for s in &skipped {
        println!("SKIPPED: {s}");
    }
    println!(
        "tcrypt images in the VM: {dumps} dumps equal to cryptsetup's, {data} devices equal to \
         dm-crypt's byte for byte, {refused} legacy modes refused by both, {} not compared",
        skipped.len()
    );
    assert!(dumps >= 20 && data >= 10, "too few compared");
    for name in VM_MUST_COMPARE {
        assert!(
            compared.contains(&name),
            "{name}: its data was not compared with dm-crypt's"
        );
    }
}
