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
//!
//! As systemd-cryptsetup does, one volume's trouble is not every volume's: a line that does
//! not parse is a warning naming its line and problem, and the other volumes start and stop
//! all the same; the command then exits non-zero and its last line names what failed. A
//! `tab start` finds a volume already open under its name (a second `tab start`, or one
//! opened by hand) and leaves it alone with a note. `tab stop` closes the volume a bad line
//! names too: its name is its first word, whatever is wrong further on.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use crate::error::{CliError, CliResult};

/// Where the table is unless `--tab` says otherwise.
pub const TAB_DEFAULT: &str = "/etc/ucrypttab";
/// Largest table read (a bound on a file we parse whole).
pub const TAB_BYTES_MAX: u64 = 1 << 20;
/// The exit code a bad line's volume counts as: cryptsetup's 1, wrong parameters.
const BAD_LINE_EXIT: i32 = 1;

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

/// A line that does not parse: skipped, with a warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    pub line: usize,
    /// The line's first word: the volume it was meant to be.
    pub name: String,
    pub problem: String,
}

impl std::fmt::Display for BadLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ucrypttab line {}: {}", self.line, self.problem)
    }
}

/// The table, parsed: its good lines and its bad ones, each in line order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    pub entries: Vec<Entry>,
    pub bad: Vec<BadLine>,
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

/// Parses the table (sans I/O). A line that does not parse is kept as a [`BadLine`]; the
/// others parse as if it were not there (but a second line of a name is bad: the first wins).
pub fn parse(text: &str) -> Table {
    let mut t = Table::default();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        match parse_line(line, l, &t.entries) {
            Ok(e) => t.entries.push(e),
            Err(problem) => t.bad.push(BadLine {
                line,
                name: l.split_whitespace().next().unwrap_or_default().to_string(),
                problem,
            }),
        }
    }
    t
}

/// One non-empty, non-comment line; `before` are the good lines above it.
fn parse_line(line: usize, l: &str, before: &[Entry]) -> Result<Entry, String> {
    let f: Vec<&str> = l.split_whitespace().collect();
    if f.len() < 2 || f.len() > 4 {
        return Err(format!("expected NAME DEVICE [KEY [OPTIONS]], got '{l}'"));
    }
    let name = f[0].to_string();
    if let Some(first) = before.iter().find(|e| e.name == name) {
        return Err(format!(
            "{name} is named twice (first on line {})",
            first.line
        ));
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
            _ => Err(format!("option {k} needs a value")),
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
            "memory-budget" => arg("memory-budget")?,
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
            other => return Err(format!("unknown option '{other}'")),
        }
    }
    if plain {
        let key = e.key.as_ref().ok_or_else(|| {
            "plain needs a key file: the raw volume key (no passphrase hashing)".to_string()
        })?;
        if !e.open_args.iter().any(|a| a.starts_with("--cipher=")) {
            e.open_args.push("--cipher=aes-cbc-essiv:sha256".into());
        }
        e.open_args
            .push(format!("--volume-key-file={}", key.display()));
    } else if let Some(k) = &e.key {
        e.open_args.push(format!("--key-file={}", k.display()));
    }
    Ok(e)
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

fn read_tab(path: &Path) -> CliResult<Table> {
    let ctx = |e| CliError::Core(ucrypt::Error::io(format!("reading {}", path.display()), e));
    let meta = std::fs::metadata(path).map_err(ctx)?;
    if meta.len() > TAB_BYTES_MAX {
        return Err(CliError::Usage(format!(
            "{} is {} bytes; a table of at most {TAB_BYTES_MAX} is read",
            path.display(),
            meta.len()
        )));
    }
    Ok(parse(&std::fs::read_to_string(path).map_err(ctx)?))
}

/// The lines a command acts on: the one named (a bad line of that name is the command's
/// error), or all of them, good and bad.
fn chosen(a: &TabArgs) -> CliResult<Table> {
    let all = read_tab(&a.tab)?;
    let Some(n) = &a.name else { return Ok(all) };
    if let Some(e) = all.entries.into_iter().find(|e| &e.name == n) {
        return Ok(Table {
            entries: vec![e],
            bad: Vec::new(),
        });
    }
    match all.bad.into_iter().find(|b| &b.name == n) {
        Some(b) => Err(CliError::Usage(b.to_string())),
        None => Err(CliError::NotActive(format!(
            "{n} is not in {}",
            a.tab.display()
        ))),
    }
}

/// What failed of a `tab start|stop` that went on past failures: the exit code (the first
/// failure's) and what to name in the closing line.
#[derive(Debug, Default)]
struct Failures {
    code: i32,
    what: Vec<String>,
}

impl Failures {
    fn add(&mut self, code: i32, what: String) {
        if self.code == 0 {
            self.code = code;
        }
        self.what.push(what);
    }

    /// Prints the closing line (if anything failed) and returns the exit code.
    fn finish(self, verb: &str) -> i32 {
        if !self.what.is_empty() {
            eprintln!("ucrypt tab {verb}: failed: {}", self.what.join(", "));
        }
        self.code
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

/// Whether an entry's NAME is open already.
enum Already {
    No,
    /// Open, for the entry's volume.
    Same,
    /// Open, for another volume (named).
    Other(String),
}

fn already_open(e: &Entry) -> Already {
    let Ok(h) = crate::daemon::online::by_name(&e.name) else {
        return Already::No;
    };
    // A local volume by device and inode (whatever path names it), a remote one by its URI.
    if h.serves(&e.device) || h.volume().as_deref() == Some(e.device.as_path()) {
        return Already::Same;
    }
    Already::Other(
        h.volume()
            .map(|v| v.display().to_string())
            .unwrap_or_else(|| "a volume not known".into()),
    )
}

fn start(a: &TabArgs) -> CliResult<i32> {
    let table = chosen(a)?;
    let mut failed = Failures::default();
    for b in &table.bad {
        eprintln!("ucrypt tab: WARNING: {b}: line skipped");
        failed.add(
            BAD_LINE_EXIT,
            format!("{} (line {}: bad line)", b.name, b.line),
        );
    }
    for e in table.entries {
        if e.noauto && a.name.is_none() {
            continue;
        }
        // In the foreground (the systemd unit) the daemon must be this process: a volume
        // already open is refused as `open` refuses it.
        if !a.foreground {
            match already_open(&e) {
                Already::No => {}
                Already::Same => {
                    eprintln!(
                        "ucrypt tab: {} (line {}) is already open: left as it is",
                        e.name, e.line
                    );
                    continue;
                }
                Already::Other(v) => {
                    let err = CliError::Busy(format!(
                        "{} is open already, but for {v}, not {}",
                        e.name,
                        e.device.display()
                    ));
                    eprintln!("ucrypt tab: {} (line {}): {err}", e.name, e.line);
                    failed.add(
                        err.exit_code(),
                        format!("{} (line {}, exit {})", e.name, e.line, err.exit_code()),
                    );
                    continue;
                }
            }
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
        if c != 0 {
            failed.add(c, format!("{} (line {}, exit {c})", e.name, e.line));
        }
    }
    Ok(failed.finish("start"))
}

fn stop(a: &TabArgs) -> CliResult<i32> {
    let table = chosen(a)?;
    // Every name of the table, good line or bad, once (the first line of a name), closed in
    // the reverse of the table's order.
    // A bad line's first word may be no valid name at all: only a live one is closed.
    let mut names: Vec<(usize, String)> = Vec::new();
    let bad_open = table
        .bad
        .iter()
        .filter(|b| crate::daemon::online::by_name(&b.name).is_ok());
    for (line, name) in table
        .entries
        .iter()
        .map(|e| (e.line, &e.name))
        .chain(bad_open.map(|b| (b.line, &b.name)))
    {
        if !names.iter().any(|(_, n)| n == name) {
            names.push((line, name.clone()));
        }
    }
    names.sort_by_key(|(line, _)| *line);
    for b in &table.bad {
        eprintln!(
            "ucrypt tab: WARNING: {b}: line skipped ({}, if open, is closed all the same)",
            b.name
        );
    }
    let mut failed = Failures::default();
    for (line, name) in names.into_iter().rev() {
        let close = crate::daemon::CloseArgs {
            name: name.clone(),
            force: false,
            deferred: false,
            cancel_deferred: false,
        };
        let c = match crate::daemon::close(close) {
            Ok(c) => c,
            // Not open: nothing to stop.
            Err(CliError::NotActive(_)) => 0,
            Err(err) => {
                eprintln!("ucrypt tab: {name} (line {line}): {err}");
                err.exit_code()
            }
        };
        if c != 0 {
            failed.add(c, format!("{name} (line {line}, exit {c})"));
        }
    }
    Ok(failed.finish("stop"))
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
        let t = parse(text);
        assert_eq!(t.bad, []);
        let e = t.entries;
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
            (
                "a /x\n\n# c\na /y\n",
                "line 4: a is named twice (first on line 1)",
            ),
        ] {
            let t = parse(text);
            let e = t.bad.last().expect(text).to_string();
            assert!(e.contains(want), "{text:?}: {e}");
            assert_eq!(t.bad[0].name, "a");
        }
    }

    /// A bad line costs only its own volume: the lines around it parse as without it.
    #[test]
    fn a_bad_line_leaves_the_others() {
        let text = "\
a /x /k discard
b /y /k frobnicate
c /z
";
        let t = parse(text);
        let names: Vec<&str> = t.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a", "c"]);
        assert_eq!(
            t.bad,
            [BadLine {
                line: 2,
                name: "b".into(),
                problem: "unknown option 'frobnicate'".into()
            }]
        );
    }

    /// ucrypttab(5) (docs/man/ucrypttab.5, written by hand) documents options this parser
    /// takes: each option of its OPTIONS section, on a line, parses, and the `ucrypt open`
    /// command the line becomes is accepted by the command's own parser.
    #[test]
    fn man_page_options_are_the_parsers() {
        let page = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/man/ucrypttab.5"
        ));
        let section = page
            .split(".SH OPTIONS")
            .nth(1)
            .and_then(|s| s.split(".SH ").next())
            .expect("an OPTIONS section");
        // An option's entry is `.TP` then `.B word` or `.BI word= value`.
        let lines: Vec<&str> = section.lines().collect();
        let documented: Vec<&str> = lines
            .windows(2)
            .filter(|w| w[0] == ".TP")
            .filter_map(|w| w[1].split_whitespace().nth(1))
            .collect();
        assert!(documented.len() >= 15, "{documented:?}");
        fn sample(opt: &str) -> Option<&str> {
            Some(match opt {
                "cipher=" => "plain,cipher=aes-xts-plain64",
                "offset=" => "plain,offset=0",
                "skip=" => "plain,skip=0",
                "sector-size=" => "plain,sector-size=4096",
                "header=" => "header=/etc/ucrypt/data.hdr",
                "keyfile-offset=" => "keyfile-offset=0",
                "keyfile-size=" => "keyfile-size=32",
                "key-slot=" => "key-slot=1",
                "tries=" => "tries=3",
                "policy=" => "policy=inline",
                "front-end=" => "front-end=fuse",
                "metrics=" => "metrics=tcp:127.0.0.1:9100",
                "memory-budget=" => "memory-budget=64M",
                o if !o.ends_with('=') => o,
                _ => return None,
            })
        }
        for opt in documented {
            let Some(opt) = sample(opt) else {
                panic!("ucrypttab(5) documents {opt}: give it a sample value here");
            };
            let t = parse(&format!("v /srv/v.img /etc/ucrypt/v.key {opt}\n"));
            assert!(t.bad.is_empty(), "{opt}: {:?}", t.bad);
            let argv = t.entries[0].open_command(false);
            if let Err(e) = crate::parse_open(argv.clone()) {
                panic!("{opt}: {argv:?} does not parse: {e}");
            }
        }
        assert_eq!(parse("v /srv/v.img none bogus\n").bad.len(), 1);
    }
}
