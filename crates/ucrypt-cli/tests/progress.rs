//! Progress of long verbs: `export`/`import` print nothing about progress when stderr is not a
//! terminal, and with `--progress-frequency N` a line every N seconds (rate and ETA) ending
//! with the 100 % line, as cryptsetup's option does.

use std::process::Command;

const UCRYPT: &str = env!("CARGO_BIN_EXE_ucrypt");

fn stderr_of(args: &[&str]) -> String {
    let o = Command::new(UCRYPT)
        .args(args)
        .output()
        .expect("run ucrypt");
    let e = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "ucrypt {args:?}: {e}");
    e
}

#[test]
fn progress_lines_only_when_asked() {
    let dir = std::env::temp_dir().join(format!("ucrypt-progress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (img, key, out, back) = (
        dir.join("vol.img"),
        dir.join("key"),
        dir.join("plain"),
        dir.join("vol2.img"),
    );
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(8 << 20))
        .unwrap();
    std::fs::write(&key, [3u8; 64]).unwrap();
    let raw = |v: &std::path::Path| {
        vec![
            v.to_str().unwrap().to_string(),
            "--cipher".into(),
            "aes-xts-plain64".into(),
            "--volume-key-file".into(),
            key.to_str().unwrap().to_string(),
        ]
    };
    let mut a = vec!["export".to_string()];
    a.extend(raw(&img));
    a.push(out.to_str().unwrap().into());
    let args: Vec<&str> = a.iter().map(String::as_str).collect();
    let quiet = stderr_of(&args);
    assert!(!quiet.contains("Progress:"), "{quiet}");
    assert!(quiet.contains("Exported 8388608 bytes"), "{quiet}");
    std::fs::remove_file(&out).unwrap();
    let mut args = args.clone();
    args.extend(["--progress-frequency", "1"]);
    let lines = stderr_of(&args);
    let last = lines
        .lines()
        .rev()
        .find(|l| l.starts_with("Progress:"))
        .unwrap_or_else(|| panic!("no progress line: {lines}"));
    assert!(
        last.starts_with("Progress: 100.0%, ETA 0m00s, 8 MiB of 8 MiB"),
        "{last}"
    );
    // import likewise.
    std::fs::File::create(&back)
        .and_then(|f| f.set_len(8 << 20))
        .unwrap();
    let mut b = vec!["import".to_string(), out.to_str().unwrap().into()];
    b.extend(raw(&back));
    b.extend(["--progress-frequency".into(), "1".into()]);
    let args: Vec<&str> = b.iter().map(String::as_str).collect();
    let e = stderr_of(&args);
    assert!(e.contains("Progress: 100.0%"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The keys of one `--progress-json` line, in order, and their values (each must be a JSON
/// string); `None` when the line is no such object.
fn json_fields(line: &str) -> Option<Vec<(String, String)>> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let obj = v.as_object()?;
    // The order as printed: each key's position in the line.
    let mut keys: Vec<(usize, String)> = obj
        .keys()
        .map(|k| {
            (
                line.find(&format!("\"{k}\":")).unwrap_or(usize::MAX),
                k.clone(),
            )
        })
        .collect();
    keys.sort();
    keys.into_iter()
        .map(|(_, k)| Some((k.clone(), obj[&k].as_str()?.to_string())))
        .collect()
}

/// `reencrypt --progress-json` of volumes of the same size: ucrypt's lines have cryptsetup's
/// keys in cryptsetup's order, every value a string (numbers in decimal), the device as given,
/// the same device size, bytes that only grow and a last line at the end with no time left;
/// and no text progress beside them.
#[test]
fn reencrypt_progress_json_as_cryptsetups() {
    if Command::new("cryptsetup")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("SKIPPED: needs cryptsetup");
        return;
    }
    let dir = std::env::temp_dir().join(format!("ucrypt-progress-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("key"), "pass0").unwrap();
    let fast = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
    let mut runs = Vec::new();
    for (tool, img) in [("cryptsetup", "c.img"), (UCRYPT, "u.img")] {
        std::fs::File::create(dir.join(img))
            .and_then(|f| f.set_len(64 << 20))
            .unwrap();
        let run = |args: &[&str]| {
            let o = Command::new(tool)
                .args(args)
                .args(fast)
                .current_dir(&dir)
                .output()
                .expect(tool);
            assert!(
                o.status.success(),
                "{tool} {args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            o
        };
        run(&["luksFormat", "-q", img, "key"]);
        let o = run(&[
            "reencrypt",
            "-q",
            img,
            "--key-file",
            "key",
            "--force-offline-reencrypt",
            "--hotzone-size",
            "1048576",
            "--progress-json",
        ]);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!err.contains("Progress:"), "{tool}: text progress: {err}");
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let lines: Vec<Vec<(String, String)>> = out
            .lines()
            .map(|l| json_fields(l).unwrap_or_else(|| panic!("{tool}: not a progress line: {l}")))
            .collect();
        assert!(!lines.is_empty(), "{tool}: no progress line");
        runs.push((tool, img, lines));
    }
    let keys = |l: &[(String, String)]| l.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
    let field = |l: &[(String, String)], k: &str| -> String {
        l.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let (_, _, cs) = &runs[0];
    let expected_keys = keys(&cs[0]);
    assert_eq!(
        expected_keys,
        [
            "device",
            "device_bytes",
            "device_size",
            "speed",
            "eta_ms",
            "time_ms"
        ]
    );
    for (tool, img, lines) in &runs {
        let mut bytes = 0u64;
        for l in lines {
            assert_eq!(keys(l), expected_keys, "{tool}");
            assert_eq!(field(l, "device"), *img, "{tool}");
            assert_eq!(
                field(l, "device_size"),
                field(&cs[0], "device_size"),
                "{tool}"
            );
            for k in &expected_keys[1..] {
                assert!(field(l, k).parse::<u64>().is_ok(), "{tool}: {k} {l:?}");
            }
            let b: u64 = field(l, "device_bytes").parse().unwrap_or(0);
            assert!(b >= bytes, "{tool}: bytes went back: {lines:?}");
            bytes = b;
        }
        let last = lines.last().expect("a line");
        assert_eq!(
            field(last, "device_bytes"),
            field(last, "device_size"),
            "{tool}"
        );
        assert_eq!(field(last, "eta_ms"), "0", "{tool}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
