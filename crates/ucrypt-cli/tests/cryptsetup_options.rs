//! Every long option of cryptsetup 2.6.1, read from cryptsetup's own option tables
//! (`src/cryptsetup_arg_list.h`: each option, its value type and the verbs that take it;
//! `src/cryptsetup_args.h`: those verb lists; `src/utils_arg_names.h`: the long names), is
//! parsed by ucrypt on each verb cryptsetup takes it on (`ucrypt VERB --OPTION [VALUE]
//! --test-args ...`), or refused by name with a reason ("Option --X is not supported by ucrypt:
//! ..."); an option cryptsetup takes on every verb must be parsed by at least one of the verbs
//! it means something to. docs/cryptsetup-options.md lists each option with ucrypt's verdict,
//! and agrees with what ucrypt does.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::collections::BTreeMap;
use std::path::Path;

use cli_common::*;

/// One option of cryptsetup's table.
#[derive(Debug)]
struct CsOption {
    long: String,
    /// Whether it takes a value (every type but a flag and an alias of a flag).
    takes_value: bool,
    /// The verbs cryptsetup restricts it to; empty: every verb.
    verbs: Vec<String>,
}

/// The text between the first `(` and the last `)` of an `ARG(...)` line, split at the commas
/// outside quotes and braces.
fn fields(line: &str) -> Vec<String> {
    let inner = &line[line.find('(').unwrap_or(0) + 1..line.rfind(')').unwrap_or(line.len())];
    let (mut out, mut cur, mut depth, mut quote) = (Vec::new(), String::new(), 0i32, None);
    for ch in inner.chars() {
        match (quote, ch) {
            (Some(q), c) if c == q => quote = None,
            (None, '"' | '\'') => quote = Some(ch),
            (None, '{' | '(') => depth += 1,
            (None, '}' | ')') => depth -= 1,
            (None, ',') if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    out.push(cur.trim().to_string());
    out
}

/// cryptsetup's option table, from its source's `src/` folder.
fn cryptsetup_options(src: &Path) -> Vec<CsOption> {
    let read = |f: &str| std::fs::read_to_string(src.join(f)).expect(f);
    let defines = |text: &str| -> BTreeMap<String, String> {
        text.lines()
            .filter_map(|l| l.strip_prefix("#define "))
            .filter_map(|l| {
                let mut it = l.splitn(2, char::is_whitespace);
                Some((it.next()?.to_string(), it.next()?.trim().to_string()))
            })
            .collect()
    };
    let names = defines(&read("utils_arg_names.h"));
    let args = defines(&read("cryptsetup_args.h"));
    let verb_list = |mut macro_name: String| -> Vec<String> {
        // `OPT_X_ACTIONS` is a brace list of `*_ACTION` names, or another such macro.
        for _ in 0..4 {
            match args.get(&macro_name) {
                Some(v) if v.starts_with('{') => {
                    return v
                        .trim_matches(|c| c == '{' || c == '}')
                        .split(',')
                        .map(str::trim)
                        .filter(|a| !a.is_empty())
                        .map(|a| args.get(a).expect(a).trim_matches('"').to_string())
                        .collect();
                }
                Some(v) => macro_name = v.clone(),
                None => break,
            }
        }
        panic!("no verb list {macro_name}")
    };
    read("cryptsetup_arg_list.h")
        .lines()
        .filter(|l| l.starts_with("ARG("))
        .map(|l| {
            let f = fields(l);
            assert_eq!(f.len(), 8, "{l}");
            let long = names.get(&f[0]).expect(&f[0]).trim_matches('"').to_string();
            let kind = f[5].as_str();
            CsOption {
                long,
                takes_value: !matches!(kind, "CRYPT_ARG_BOOL" | "CRYPT_ARG_ALIAS")
                    || f[2] == "POPT_ARG_STRING",
                verbs: if f[7] == "{}" {
                    Vec::new()
                } else {
                    verb_list(f[7].clone())
                },
            }
        })
        .collect()
}

/// A value ucrypt's parser accepts for `long` (cryptsetup's spelling of the value).
fn sample(long: &str) -> &'static str {
    match long {
        "cipher" | "keyslot-cipher" => "aes-xts-plain64",
        "hash" | "resilience-hash" => "sha256",
        "type" => "luks2",
        "pbkdf" => "pbkdf2",
        "integrity" => "hmac-sha256",
        "resilience" => "checksum",
        "key-size" => "256",
        "keyslot-key-size" => "512",
        // cryptsetup 2.8's (its tables, with UCRYPT_CRYPTSETUP_TESTS naming 2.8's material).
        "integrity-key-size" => "256",
        "sector-size" => "4096",
        "key-slot" | "new-key-slot" | "token-id" | "new-token-id" => "1",
        "token-type" => "luks2-keyring",
        "uuid" => "2a3b4c5d-6e7f-4081-92a3-b4c5d6e7f809",
        "priority" => "normal",
        "luks2-metadata-size" => "16384",
        "luks2-keyslots-size" => "16777216",
        "hotzone-size" => "1048576",
        "reduce-device-size" | "device-size" => "33554432",
        "iter-time" | "pbkdf-memory" => "100",
        "pbkdf-force-iterations" => "1000",
        "keyfile-size" | "new-keyfile-size" => "32",
        "keyfile-offset" | "new-keyfile-offset" => "0",
        _ => "1",
    }
}

/// How each verb is called with nothing but its required arguments (a device path that need
/// not exist: `--test-args` stops before anything is opened).
fn verb_argv(verb: &str) -> Option<Vec<&'static str>> {
    const DEV: &str = "/nonexistent/ucrypt-options-dev";
    Some(match verb {
        "open" => vec!["open", DEV, "name"],
        "close" | "status" | "resize" | "luksSuspend" | "luksResume" => {
            vec![static_verb(verb), "name"]
        }
        "luksKillSlot" => vec!["luksKillSlot", DEV, "1"],
        "luksHeaderBackup" | "luksHeaderRestore" => {
            vec![
                static_verb(verb),
                DEV,
                "--header-backup-file",
                "/nonexistent/b",
            ]
        }
        "convert" => vec!["convert", DEV, "--type", "luks1"],
        "token" => vec!["token", "export", DEV, "--token-id", "0"],
        // cryptsetup's cipher speed table is `ucrypt bench cipher` (the benchmark's options
        // are its own).
        "benchmark" => return None,
        v => vec![static_verb(v), DEV],
    })
}

/// The options cryptsetup requires beside `long` on `verb` (as its own checks do: e.g.
/// `open --unbound` only with `--test-passphrase`, `--keyslot-cipher` only with
/// `--keyslot-key-size`).
fn companions(long: &str, verb: &str) -> &'static [&'static str] {
    match (long, verb) {
        ("unbound", "open") => &["--test-passphrase"],
        ("shared", "open") => &["--type", "plain"],
        // cryptsetup takes these two together only.
        ("keyslot-cipher", _) => &["--keyslot-key-size", "512"],
        ("keyslot-key-size", _) => &["--keyslot-cipher", "aes-xts-plain64"],
        _ => &[],
    }
}

/// `verb` as a `'static` string (the verbs are a closed set).
fn static_verb(verb: &str) -> &'static str {
    Box::leak(verb.to_string().into_boxed_str())
}

/// The verbs an option cryptsetup takes on every verb is tried on.
const ANY_VERB: &[&str] = &[
    "open",
    "luksFormat",
    "luksAddKey",
    "reencrypt",
    "luksDump",
    "token",
    "close",
    "status",
    "luksHeaderBackup",
];

enum Verdict {
    Parsed,
    /// Refused by name; the reason ucrypt gives.
    Refused(String),
    /// Anything else: the output.
    Failed(String),
}

fn try_option(opt: &CsOption, verb: &str) -> Option<Verdict> {
    let mut argv = verb_argv(verb)?;
    let flag = static_verb(&format!("--{}", opt.long));
    // A verb's own required option, when it is the one under test, is given once.
    if let Some(i) = argv.iter().position(|a| *a == flag) {
        argv.drain(i..i + 2);
    }
    argv.push(flag);
    if opt.takes_value {
        argv.push(sample(&opt.long));
    }
    argv.extend(companions(&opt.long, verb));
    if opt.long != "test-args" {
        argv.push("--test-args");
    }
    let o = run(UCRYPT, &argv);
    let out = text(&o);
    let refused = format!("Option --{} is not supported by ucrypt: ", opt.long);
    Some(match o.status.code() {
        Some(0) => Verdict::Parsed,
        Some(1) if out.contains(&refused) => {
            Verdict::Refused(out.split(&refused).nth(1).unwrap_or("").trim().to_string())
        }
        _ => Verdict::Failed(format!(
            "`ucrypt {}`: {}",
            argv.join(" "),
            out.lines()
                .find(|l| l.contains("error") || l.contains("rror:") || !l.trim().is_empty())
                .unwrap_or("")
        )),
    })
}

#[test]
fn every_cryptsetup_option_is_parsed_or_refused_by_name() {
    let tests = match cryptsetup_tests() {
        Ok(t) => t,
        Err(why) => {
            println!("SKIPPED: cryptsetup's option tables: {why}");
            return;
        }
    };
    let src = tests.join("../src");
    if !src.join("cryptsetup_arg_list.h").is_file() {
        println!(
            "SKIPPED: {} has no src/cryptsetup_arg_list.h (UCRYPT_CRYPTSETUP_TESTS names a \
             copy without cryptsetup's option tables)",
            src.display()
        );
        return;
    }
    let opts = cryptsetup_options(&src);
    assert!(opts.len() >= 100, "only {} options read", opts.len());
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/cryptsetup-options.md"),
    )
    .expect("docs/cryptsetup-options.md");
    let (mut failed, mut refused, mut parsed) = (Vec::new(), Vec::new(), 0);
    for opt in &opts {
        let verbs: Vec<&str> = if opt.verbs.is_empty() {
            ANY_VERB.to_vec()
        } else {
            opt.verbs.iter().map(String::as_str).collect()
        };
        let verdicts: Vec<(&str, Verdict)> = verbs
            .iter()
            .filter_map(|v| try_option(opt, v).map(|r| (*v, r)))
            .collect();
        let any_parsed = verdicts.iter().any(|(_, v)| matches!(v, Verdict::Parsed));
        let why = verdicts.iter().find_map(|(_, v)| match v {
            Verdict::Refused(w) => Some(w.clone()),
            _ => None,
        });
        let fails: Vec<String> = verdicts
            .iter()
            .filter_map(|(verb, v)| match v {
                Verdict::Failed(out) => Some(format!("{verb}: {out}")),
                _ => None,
            })
            .collect();
        // In the documentation's table, as a row of its own.
        let row = format!("| `--{}` |", opt.long);
        let doc_row = doc.lines().find(|l| l.starts_with(&row));
        match (&why, doc_row) {
            (_, None) => failed.push(format!(
                "--{}: no row in docs/cryptsetup-options.md",
                opt.long
            )),
            (Some(_), Some(r)) if !r.contains("refused") => failed.push(format!(
                "--{}: refused, but the documentation says otherwise: {r}",
                opt.long
            )),
            (None, Some(r)) if r.contains("refused") => failed.push(format!(
                "--{}: parsed, but the documentation says it is refused: {r}",
                opt.long
            )),
            _ => {}
        }
        if let Some(w) = why {
            refused.push(format!("--{}: {w}", opt.long));
            continue;
        }
        if opt.verbs.is_empty() {
            // Taken by every cryptsetup verb: parsed by one it means something to.
            if !any_parsed {
                failed.push(format!("--{} (any verb): {}", opt.long, fails.join("; ")));
            } else {
                parsed += 1;
            }
        } else if !fails.is_empty() {
            failed.push(format!("--{}: {}", opt.long, fails.join("; ")));
        } else {
            parsed += 1;
        }
    }
    println!(
        "{} cryptsetup options: {parsed} parsed where cryptsetup takes them, {} refused by name",
        opts.len(),
        refused.len()
    );
    for r in &refused {
        println!("  refused {r}");
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Runs `tool ARGS` on a terminal (util-linux `script` gives it one), typing `lines` (each
/// after a pause, as a user would) and then nothing; returns the exit code and what it
/// printed.
fn on_terminal(tool: &str, args: &[&str], lines: &[&str]) -> (Option<i32>, String) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    // A tool still waiting for keystrokes after a minute has hung: `timeout` ends it (rc=124;
    // in the foreground, as the terminal's reader).
    let cmd = format!(
        "timeout --foreground 60 {tool} {}; echo \"rc=$?\"",
        args.join(" ")
    );
    let mut child = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script");
    let mut stdin = child.stdin.take().expect("stdin");
    for l in lines {
        std::thread::sleep(std::time::Duration::from_millis(400));
        let _ = stdin.write_all(format!("{l}\r").as_bytes());
        let _ = stdin.flush();
    }
    // Nothing more is typed: `script` keeps the terminal open until the tool ends (it does
    // not pass the end of its own input on).
    std::thread::sleep(std::time::Duration::from_millis(200));
    drop(stdin);
    let out = child.wait_with_output().expect("script output");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let code = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("rc="))
        .next_back()
        .and_then(|c| c.parse().ok());
    (code, text)
}

/// `--timeout` and `--verify-passphrase` at a terminal prompt: the same exit code and error
/// as cryptsetup's, on the same volume and the same keystrokes.
#[test]
fn prompt_options_behave_as_cryptsetups() {
    if !have("script") || !have("cryptsetup") {
        println!("SKIPPED: needs util-linux script and cryptsetup");
        return;
    }
    let t = TempDir::new("prompt-opts");
    let (img, key) = (t.path("v.img"), t.path("key"));
    std::fs::write(&key, "pass1").unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(20 << 20))
        .unwrap();
    let mut a = vec!["luksFormat", "-q", s(&img), s(&key)];
    a.extend(FAST_PBKDF2);
    ok(UCRYPT, &a);
    let img = s(&img);
    let cases: [(&str, Vec<&str>, &[&str], &str); 4] = [
        (
            "nothing typed within --timeout",
            vec!["open", "--test-passphrase", "--timeout", "1", img],
            &[],
            "Error reading passphrase from terminal",
        ),
        (
            "-y, the two entries differ",
            vec!["open", "--test-passphrase", "-y", img],
            &["pass1", "other"],
            "Passphrases do not match.",
        ),
        (
            "-y, the same passphrase twice",
            vec!["open", "--test-passphrase", "-y", img],
            &["pass1", "pass1"],
            "",
        ),
        (
            "--verify-passphrase, a wrong passphrase twice",
            vec![
                "open",
                "--test-passphrase",
                "--verify-passphrase",
                "--tries",
                "1",
                img,
            ],
            &["nope", "nope"],
            "No key available with this passphrase.",
        ),
    ];
    for (what, args, typed, says) in cases {
        let (cs_code, cs_out) = on_terminal("cryptsetup", &args, typed);
        let (u_code, u_out) = on_terminal(UCRYPT, &args, typed);
        assert_eq!(
            u_code, cs_code,
            "{what}: ucrypt {u_out:?}, cryptsetup {cs_out:?}"
        );
        assert!(cs_out.contains(says), "{what}: cryptsetup says {cs_out:?}");
        assert!(u_out.contains(says), "{what}: ucrypt says {u_out:?}");
    }
}

/// `luksAddKey --new-keyfile F` on copies of one volume, by each tool: the same keyslot added
/// (the keyslot list and the tokens equal), and the new key file opens the volume; with
/// `--new-token-id` too, the key file wins, as in cryptsetup.
#[test]
fn add_key_with_a_new_keyfile_as_cryptsetup() {
    if !have("cryptsetup") {
        println!("SKIPPED: needs cryptsetup");
        return;
    }
    let t = TempDir::new("addkey-newkeyfile");
    let (img, k1, k2) = (t.path("v.img"), t.path("k1"), t.path("k2"));
    std::fs::write(&k1, "pass1").unwrap();
    std::fs::write(&k2, "pass2").unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(20 << 20))
        .unwrap();
    let mut a = vec!["luksFormat", "-q", s(&img), s(&k1)];
    a.extend(FAST_PBKDF2);
    ok(UCRYPT, &a);
    ok(
        UCRYPT,
        &[
            "token",
            "add",
            s(&img),
            "--key-description",
            "d",
            "--key-slot",
            "0",
        ],
    );
    let after = |tool: &str| {
        let copy = t.path(&format!("{}.img", tool.rsplit('/').next().unwrap_or(tool)));
        std::fs::copy(&img, &copy).unwrap();
        let mut a = vec!["luksAddKey", s(&copy), "--key-file", s(&k1)];
        a.extend(["--new-keyfile", s(&k2), "--new-token-id", "0"]);
        a.extend(FAST_PBKDF2);
        ok(tool, &a);
        ok(
            "cryptsetup",
            &["open", "--test-passphrase", s(&copy), "--key-file", s(&k2)],
        );
        let d = ok("cryptsetup", &["luksDump", s(&copy)]);
        d[d.find("Keyslots:").unwrap()..d.find("Digests:").unwrap()]
            .lines()
            .filter(|l| {
                // Salts and areas are random: the slots, their kind and the tokens compare.
                !l.contains("Salt:") && !l.contains("AF hash") && !l.starts_with("\t            ")
            })
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    };
    let (u, c) = (after(UCRYPT), after("cryptsetup"));
    assert_eq!(u, c, "keyslots and tokens after luksAddKey --new-keyfile");
    assert!(u.contains("  1: luks2"), "{u}");
}

/// cryptsetup's verbs: the actions of its `action_types` table (`src/cryptsetup.c`, their
/// names from `src/cryptsetup_args.h`) and the old spellings its "Handle aliases" block
/// rewrites (`create`, `plainOpen`, `luksClose`, ...).
fn cryptsetup_verbs(src: &Path) -> Vec<String> {
    let c = std::fs::read_to_string(src.join("cryptsetup.c")).expect("cryptsetup.c");
    let args = std::fs::read_to_string(src.join("cryptsetup_args.h")).expect("args");
    let action_name = |macro_name: &str| -> Option<String> {
        args.lines()
            .filter_map(|l| l.strip_prefix("#define "))
            .find_map(|l| {
                let mut it = l.split_whitespace();
                (it.next()? == macro_name).then(|| it.next().map(|v| v.trim_matches('"').into()))?
            })
    };
    let table = &c[c.find("action_types[] = {").expect("action table")..];
    let table = &table[..table.find("};").expect("table end")];
    let mut verbs: Vec<String> = table
        .lines()
        .filter_map(|l| l.trim().strip_prefix('{'))
        .filter_map(|l| l.split(',').next())
        .map(str::trim)
        .filter(|m| m.ends_with("_ACTION"))
        .map(|m| action_name(m).unwrap_or_else(|| panic!("no name for {m}")))
        .collect();
    let aliases = &c[c.find("/* Handle aliases */").expect("alias block")..];
    let aliases = &aliases[..aliases.find("for(action").expect("alias block end")];
    for part in aliases.split("!strcmp(aname, \"").skip(1) {
        let name = &part[..part.find('"').expect("quoted alias")];
        if !verbs.iter().any(|v| v == name) {
            verbs.push(name.to_string());
        }
    }
    verbs
}

/// `verb`'s command line with nothing but its required arguments; the old `create` takes the
/// name first.
fn alias_argv(verb: &str) -> Vec<&'static str> {
    const DEV: &str = "/nonexistent/ucrypt-options-dev";
    let v = static_verb(verb);
    match verb {
        "create" => vec![v, "name", DEV],
        "benchmark" => vec![v],
        "refresh" | "remove" => vec![v, "name"],
        _ if verb.ends_with("Open") => vec![v, DEV, "name"],
        _ if verb.ends_with("Close") => vec![v, "name"],
        _ => verb_argv(verb).unwrap_or_else(|| vec![v, DEV]),
    }
}

/// Every verb of cryptsetup, action or alias, is parsed by ucrypt (`--test-args`) or refused
/// by name ("Action X is not supported by ucrypt: ...").
#[test]
fn every_cryptsetup_verb_is_parsed_or_refused_by_name() {
    let tests = match cryptsetup_tests() {
        Ok(t) => t,
        Err(why) => {
            println!("SKIPPED: cryptsetup's verb table: {why}");
            return;
        }
    };
    let src = tests.join("../src");
    if !src.join("cryptsetup.c").is_file() {
        println!("SKIPPED: {} has no src/cryptsetup.c", src.display());
        return;
    }
    let verbs = cryptsetup_verbs(&src);
    assert!(
        verbs.len() >= 40,
        "only {} verbs read: {verbs:?}",
        verbs.len()
    );
    let mut failed = Vec::new();
    for verb in &verbs {
        let mut argv = alias_argv(verb);
        argv.push("--test-args");
        let o = run(UCRYPT, &argv);
        let out = text(&o);
        let refused = format!("Action {verb} is not supported by ucrypt: ");
        match o.status.code() {
            Some(0) => {}
            Some(1) if out.contains(&refused) => println!("  refused {verb}: {out}"),
            c => failed.push(format!("`ucrypt {}`: exit {c:?}: {out}", argv.join(" "))),
        }
    }
    println!("{} cryptsetup verbs", verbs.len());
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// `--device-size`: cryptsetup's checks (not 0, a multiple of 512, not with `--size`) give the
/// same exit codes in both tools on `open` and `resize`; a plain mapping with `--device-size
/// BYTES` is the one `--size BYTES/512` gives; `reencrypt` takes it.
#[test]
fn device_size_as_cryptsetup() {
    if !have("cryptsetup") {
        println!("SKIPPED: needs cryptsetup");
        return;
    }
    let t = TempDir::new("device-size");
    let img = t.path("v.img");
    let key = t.file("key", [7u8; 64]);
    std::fs::write(&img, kit::SplitMix(0xd5).bytes(4 << 20)).unwrap();
    let img = s(&img);
    let plain = [
        "--type",
        "plain",
        "--cipher",
        "aes-xts-plain64",
        "--key-size",
        "512",
    ];
    let cases: &[(&str, Vec<&str>)] = &[
        (
            "open, 1 MiB",
            vec!["open", img, "n", "--device-size", "1048576"],
        ),
        (
            "open, not a multiple of 512",
            vec!["open", img, "n", "--device-size", "1000"],
        ),
        ("open, 0", vec!["open", img, "n", "--device-size", "0"]),
        (
            "open, with --size",
            vec![
                "open",
                img,
                "n",
                "--device-size",
                "1048576",
                "--size",
                "2048",
            ],
        ),
        ("resize", vec!["resize", "n", "--device-size", "1048576"]),
        (
            "resize, with --size",
            vec!["resize", "n", "--device-size", "1048576", "--size", "2048"],
        ),
    ];
    for (what, args) in cases {
        let codes: Vec<Option<i32>> = ["cryptsetup", UCRYPT]
            .iter()
            .map(|tool| {
                let mut a = args.clone();
                if a[0] == "open" {
                    a.extend(plain);
                }
                a.push("--test-args");
                run(tool, &a).status.code()
            })
            .collect();
        assert_eq!(
            codes[0], codes[1],
            "{what}: cryptsetup's exit code, then ucrypt's"
        );
    }
    // The mapping: export through --device-size and through --size.
    let export = |size: &[&str], out: &str| -> Vec<u8> {
        let out = t.path(out);
        let mut a = vec!["export", img, s(&out), "--volume-key-file", s(&key)];
        a.extend(&plain);
        a.extend(size);
        ok(UCRYPT, &a);
        std::fs::read(&out).unwrap()
    };
    let by_bytes = export(&["--device-size", "1048576"], "a");
    assert_eq!(by_bytes.len(), 1 << 20);
    assert_eq!(by_bytes, export(&["--size", "2048"], "b"));
    // reencrypt takes it (reencrypt_device_size.rs runs it), with cryptsetup's units.
    for size in ["1048576", "1M", "2048S"] {
        let o = run(
            UCRYPT,
            &["reencrypt", img, "--device-size", size, "--test-args"],
        );
        assert_eq!(o.status.code(), Some(0), "{size}: {}", text(&o));
    }
}
