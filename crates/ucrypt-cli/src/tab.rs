//! `ucrypt tab start|stop [NAME]`: the volumes of `/etc/ucrypttab`, which has crypttab(5)'s
//! syntax: one volume a line, `NAME DEVICE KEY OPTIONS`, `#` comments.
//!
//! - DEVICE: a path, or `UUID=`, `PARTUUID=`, `LABEL=`, `PARTLABEL=` (the `/dev/disk/by-*`
//!   links).
//! - KEY: a key file, or `none` / `-` / absent: the passphrase is asked (through
//!   `systemd-ask-password` under systemd).
//! - OPTIONS, comma-separated, crypttab's spellings: `luks` (the default), `plain`,
//!   `cipher=`, `offset=`, `skip=`, `sector-size=` (plain mode; KEY is then the volume key
//!   file), `discard`, `readonly`/`read-only`, `header=`, `keyfile-offset=`, `keyfile-size=`,
//!   `key-slot=`, `tries=`, `noauto` (not opened by `tab start` without NAME); ucrypt's own:
//!   `policy=`, `front-end=`, `metrics=`. systemd's `nofail`, `_netdev`, `x-systemd.*` and
//!   the `no-*-workqueue` flags are accepted and have no effect here; anything else is refused
//!   with its line number.
//!
//! Each line becomes the arguments of `ucrypt open`, parsed by the same parser, so an entry
//! means exactly what the command would.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use crate::error::{CliError, CliResult};

/// Where the table is unless `--tab` says otherwise.
pub const TAB_DEFAULT: &str = "/etc/ucrypttab";
/// Largest table read (a bound on a file we parse whole).
pub const TAB_BYTES_MAX: u64 = 1 << 20;

#[derive(Subcommand, Debug)]
pub enum TabCmd {
    /// Open every volume of the table (but `noauto` ones), or the one named.
    Start(TabArgs),
    /// Close every open volume of the table, or the one named.
    Stop(TabArgs),
}

#[derive(Args, Debug)]
pub struct TabArgs {
    /// Only this volume.
    pub name: Option<String>,
    /// The table.
    #[arg(long, default_value = TAB_DEFAULT)]
    pub tab: PathBuf,
    /// `start NAME` only: stay in the foreground (the systemd unit runs this, Type=notify).
    #[arg(long, requires = "name")]
    pub foreground: bool,
}

/// One line of the table, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub line: usize,
    pub name: String,
    pub device: PathBuf,
    /// `None`: the passphrase is asked.
    pub key: Option<PathBuf>,
    pub noauto: bool,
    /// `ucrypt open` options the line's options stand for.
    pub open_args: Vec<String>,
}

fn bad(line: usize, what: String) -> CliError {
    CliError::Usage(format!("ucrypttab line {line}: {what}"))
}

/// `UUID=...` and friends name a `/dev/disk/by-*` link.
fn device_path(spec: &str) -> PathBuf {
    for (tag, dir) in [
        ("UUID=", "by-uuid"),
        ("PARTUUID=", "by-partuuid"),
        ("LABEL=", "by-label"),
        ("PARTLABEL=", "by-partlabel"),
    ] {
        if let Some(v) = spec.strip_prefix(tag) {
            return Path::new("/dev/disk").join(dir).join(v);
        }
    }
    PathBuf::from(spec)
}

/// Parses the table (sans I/O).
pub fn parse(text: &str) -> CliResult<Vec<Entry>> {
    let mut out: Vec<Entry> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 2 || f.len() > 4 {
            return Err(bad(
                line,
                format!("expected NAME DEVICE [KEY [OPTIONS]], got '{l}'"),
            ));
        }
        let name = f[0].to_string();
        if out.iter().any(|e| e.name == name) {
            return Err(bad(line, format!("{name} is named twice")));
        }
        let key = match f.get(2) {
            None | Some(&"none") | Some(&"-") => None,
            Some(k) => Some(PathBuf::from(k)),
        };
        let mut e = Entry {
            line,
            name,
            device: device_path(f[1]),
            key,
            noauto: false,
            open_args: Vec::new(),
        };
        let mut plain = false;
        for opt in f
            .get(3)
            .map_or("", |o| o)
            .split(',')
            .filter(|o| !o.is_empty())
        {
            let (k, v) = match opt.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (opt, None),
            };
            let mut arg = |flag: &str| match v {
                Some(v) if !v.is_empty() => {
                    e.open_args.push(format!("--{flag}={v}"));
                    Ok(())
                }
                _ => Err(bad(line, format!("option {k} needs a value"))),
            };
            match k {
                "luks" => {}
                "plain" => plain = true,
                "cipher" => arg("cipher")?,
                "offset" => arg("offset")?,
                "skip" => arg("skip")?,
                "sector-size" => arg("sector-size")?,
                "header" => arg("header")?,
                "keyfile-offset" => arg("keyfile-offset")?,
                "keyfile-size" => arg("keyfile-size")?,
                "key-slot" | "keyslot" => arg("key-slot")?,
                "tries" => arg("tries")?,
                "policy" => arg("policy")?,
                "front-end" => arg("front-end")?,
                "metrics" => arg("metrics")?,
                "discard" => e.open_args.push("--allow-discards".into()),
                "readonly" | "read-only" => e.open_args.push("--readonly".into()),
                "noauto" => e.noauto = true,
                "auto"
                | "nofail"
                | "_netdev"
                | "no-read-workqueue"
                | "no-write-workqueue"
                | "same-cpu-crypt"
                | "submit-from-crypt-cpus" => {}
                k if k.starts_with("x-systemd.") || k.starts_with("x-initrd.") => {}
                other => return Err(bad(line, format!("unknown option '{other}'"))),
            }
        }
        if plain {
            let key = e.key.as_ref().ok_or_else(|| {
                bad(
                    line,
                    "plain needs a key file: the raw volume key (no passphrase hashing)".into(),
                )
            })?;
            if !e.open_args.iter().any(|a| a.starts_with("--cipher=")) {
                e.open_args.push("--cipher=aes-cbc-essiv:sha256".into());
            }
            e.open_args
                .push(format!("--volume-key-file={}", key.display()));
        } else if let Some(k) = &e.key {
            e.open_args.push(format!("--key-file={}", k.display()));
        }
        out.push(e);
    }
    Ok(out)
}

impl Entry {
    /// The full `ucrypt open` command line of this entry.
    pub fn open_command(&self, foreground: bool) -> Vec<String> {
        let mut v = vec![
            "ucrypt".to_string(),
            "open".into(),
            self.device.display().to_string(),
            self.name.clone(),
        ];
        v.extend(self.open_args.iter().cloned());
        if foreground {
            v.push("--foreground".into());
        }
        v
    }
}

fn read_tab(path: &Path) -> CliResult<Vec<Entry>> {
    let ctx = |e| CliError::Core(ucrypt::Error::io(format!("reading {}", path.display()), e));
    let meta = std::fs::metadata(path).map_err(ctx)?;
    if meta.len() > TAB_BYTES_MAX {
        return Err(CliError::Usage(format!(
            "{} is {} bytes; a table of at most {TAB_BYTES_MAX} is read",
            path.display(),
            meta.len()
        )));
    }
    parse(&std::fs::read_to_string(path).map_err(ctx)?)
}

/// The entries a command acts on: the one named, or all of them.
fn chosen(a: &TabArgs) -> CliResult<Vec<Entry>> {
    let all = read_tab(&a.tab)?;
    match &a.name {
        None => Ok(all),
        Some(n) => match all.into_iter().find(|e| &e.name == n) {
            Some(e) => Ok(vec![e]),
            None => Err(CliError::NotActive(format!(
                "{n} is not in {}",
                a.tab.display()
            ))),
        },
    }
}

/// Runs `tab start|stop`; returns the exit code (the first failure's, after trying all).
pub fn run(cmd: TabCmd) -> i32 {
    let r = match cmd {
        TabCmd::Start(a) => start(&a),
        TabCmd::Stop(a) => stop(&a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ucrypt tab: {e}");
            e.exit_code()
        }
    }
}

fn start(a: &TabArgs) -> CliResult<i32> {
    let entries = chosen(a)?;
    let mut code = 0;
    for e in entries {
        if e.noauto && a.name.is_none() {
            continue;
        }
        let argv = e.open_command(a.foreground);
        let r = crate::parse_open(argv).and_then(crate::daemon::open);
        let c = match r {
            Ok(c) => c,
            Err(err) => {
                eprintln!("ucrypt tab: {} (line {}): {err}", e.name, e.line);
                err.exit_code()
            }
        };
        if code == 0 {
            code = c;
        }
    }
    Ok(code)
}

fn stop(a: &TabArgs) -> CliResult<i32> {
    let mut code = 0;
    for e in chosen(a)?.into_iter().rev() {
        let close = crate::daemon::CloseArgs {
            name: e.name.clone(),
            force: false,
            deferred: false,
            cancel_deferred: false,
        };
        let c = match crate::daemon::close(close) {
            Ok(c) => c,
            // Not open: nothing to stop.
            Err(CliError::NotActive(_)) => 0,
            Err(err) => {
                eprintln!("ucrypt tab: {}: {err}", e.name);
                err.exit_code()
            }
        };
        if code == 0 {
            code = c;
        }
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_open_commands() {
        let text = "\
# name  device                 key          options
data    /srv/vol.img            /etc/k       discard,policy=inline
home    UUID=1234-abcd          none         luks,readonly,noauto,nofail,x-systemd.device-timeout=0
swap    /dev/sdb2               /etc/swapkey plain,cipher=aes-xts-plain64,sector-size=4096
";
        let e = parse(text).expect("parse");
        assert_eq!(e.len(), 3);
        assert_eq!(
            e[0].open_command(false),
            [
                "ucrypt",
                "open",
                "/srv/vol.img",
                "data",
                "--allow-discards",
                "--policy=inline",
                "--key-file=/etc/k"
            ]
        );
        assert_eq!(e[1].device, PathBuf::from("/dev/disk/by-uuid/1234-abcd"));
        assert!(e[1].noauto && e[1].key.is_none());
        assert_eq!(e[1].open_args, ["--readonly"]);
        assert_eq!(
            e[2].open_args,
            [
                "--cipher=aes-xts-plain64",
                "--sector-size=4096",
                "--volume-key-file=/etc/swapkey"
            ]
        );
        assert!(e[0]
            .open_command(true)
            .ends_with(&["--foreground".to_string()]));
    }

    #[test]
    fn bad_lines_name_their_line() {
        for (text, want) in [
            ("a\n", "line 1: expected NAME DEVICE"),
            ("a /x k opt extra\n", "line 1: expected"),
            ("a /x - frobnicate\n", "line 1: unknown option 'frobnicate'"),
            ("a /x - cipher\n", "line 1: option cipher needs a value"),
            ("a /x - plain\n", "line 1: plain needs a key file"),
            ("a /x\n\n# c\na /y\n", "line 4: a is named twice"),
        ] {
            let e = parse(text).expect_err(text).to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
