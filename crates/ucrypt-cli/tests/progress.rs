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
