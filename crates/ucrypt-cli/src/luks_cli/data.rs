//! `export` and `import`: stream the whole data area of a volume through the engine, opened
//! like every front end opens it ([`VolumeArgs`]), in large requests so the engine's parallel
//! dispatch can use every core.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use ucrypt::Error;

use super::progress_json::JsonProgress;
use crate::error::{CliError, CliResult};
use crate::open::VolumeArgs;

/// Bytes per request: large enough that the engine splits it across workers.
const CHUNK_BYTES: usize = 4 << 20;

/// How often a terminal's progress line is redrawn.
const TTY_REFRESH: Duration = Duration::from_millis(500);

/// Progress of a long verb: a line redrawn on a terminal, nothing when stderr is not one,
/// or with `--progress-frequency N` a line every N seconds wherever stderr goes.
pub(crate) struct Progress {
    start: Instant,
    last: Instant,
    total: u64,
    /// None: silent.
    every: Option<Duration>,
    /// Lines (--progress-frequency) rather than one line redrawn.
    lines: bool,
    /// `--progress-json`: cryptsetup's JSON lines instead of the text.
    json: Option<JsonProgress>,
}

impl Progress {
    pub(crate) fn new(total: u64, frequency_s: Option<u64>) -> Self {
        let now = Instant::now();
        let (every, lines) = match frequency_s {
            Some(s) => (Some(Duration::from_secs(s.max(1))), true),
            None if crate::pass::stderr_is_tty() => (Some(TTY_REFRESH), false),
            None => (None, false),
        };
        Progress {
            start: now,
            last: now,
            total,
            every,
            lines,
            json: None,
        }
    }

    /// Progress as cryptsetup's `--progress-json` lines, `device` named in them; the report
    /// of 0 bytes done starts their clock.
    pub(crate) fn json(mut self, device: String) -> Self {
        let frequency_s = self
            .lines
            .then(|| self.every.map(|d| d.as_secs()))
            .flatten();
        let mut j = JsonProgress::new(device, frequency_s);
        j.report(0, self.total);
        self.json = Some(j);
        self
    }

    pub(crate) fn tick(&mut self, done: u64) {
        if let Some(j) = &mut self.json {
            return j.report(done, self.total);
        }
        let Some(every) = self.every else { return };
        if self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        let pct = if self.total == 0 {
            100.0
        } else {
            done as f64 * 100.0 / self.total as f64
        };
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let rate = done as f64 / secs;
        let eta = if rate > 0.0 {
            let left = self.total.saturating_sub(done) as f64 / rate;
            format!("{}m{:02}s", left as u64 / 60, left as u64 % 60)
        } else {
            "?".into()
        };
        let line = format!(
            "Progress: {pct:5.1}%, ETA {eta}, {} MiB of {} MiB, {:.0} MiB/s",
            done >> 20,
            self.total >> 20,
            rate / (1 << 20) as f64
        );
        if self.lines {
            eprintln!("{line}");
        } else {
            eprint!("\r{line}");
        }
    }

    pub(crate) fn finish(&mut self, verb: &str, done: u64) {
        if let Some(j) = &mut self.json {
            // The last line says where it ended.
            j.report(done, self.total);
            self.every = None;
            self.lines = false;
        }
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        if self.every.is_some() && !self.lines {
            eprintln!();
        }
        if self.lines {
            // The last line says where it ended, however short the run.
            self.last = self.start;
            self.every = Some(Duration::ZERO);
            self.tick(done);
        }
        eprintln!(
            "{verb} {done} bytes in {secs:.2} s ({:.0} MiB/s).",
            done as f64 / (1 << 20) as f64 / secs
        );
    }
}

/// `export`: refused (exit 5) while a ucrypt process serves the volume read-write, as `open`
/// refuses it, unless `force`: the copy would mix data from before and after its writes. A
/// volume served read-only is exported beside it.
pub fn export(v: &VolumeArgs, file: &Path, progress_s: Option<u64>, force: bool) -> CliResult<i32> {
    let v = VolumeArgs {
        read_only: true,
        ..v.clone()
    };
    if !force {
        v.refuse_if_served_for_reading(
            "its data changes under the copy; export through that process, stop it, or give \
             --force",
        )?;
    }
    let vol = v.open()?.dev();
    let total = vol.size();
    let mut out = File::create(file)
        .map_err(|e| Error::io(format!("Cannot create {}", file.display()), e))?;
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut done = 0u64;
    let mut p = Progress::new(total, progress_s);
    while done < total {
        let n = (total - done).min(CHUNK_BYTES as u64) as usize;
        vol.read_at(&mut buf[..n], done)?;
        out.write_all(&buf[..n])
            .map_err(|e| Error::io(format!("writing {}", file.display()), e))?;
        done += n as u64;
        p.tick(done);
    }
    buf.fill(0);
    out.sync_all()
        .map_err(|e| Error::io(format!("syncing {}", file.display()), e))?;
    p.finish("Exported", done);
    Ok(0)
}

pub fn import(file: &Path, v: &VolumeArgs, progress_s: Option<u64>) -> CliResult<i32> {
    // Written under a process serving the volume, the import would race its users' writes.
    v.refuse_if_served("cannot import into it while it is served; write through that process")?;
    let vol = v.open()?.dev();
    let total = vol.size();
    let mut input =
        File::open(file).map_err(|e| Error::io(format!("Cannot open {}", file.display()), e))?;
    let in_len = input
        .metadata()
        .map_err(|e| Error::io(format!("stat {}", file.display()), e))?
        .len();
    if in_len > total {
        return Err(CliError::Usage(format!(
            "{} ({in_len} bytes) is larger than the data area of {} ({total} bytes)",
            file.display(),
            v.volume
        )));
    }
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut done = 0u64;
    let mut p = Progress::new(in_len, progress_s);
    while done < in_len {
        let n = (in_len - done).min(CHUNK_BYTES as u64) as usize;
        input
            .read_exact(&mut buf[..n])
            .map_err(|e| Error::io(format!("reading {}", file.display()), e))?;
        // The engine handles a partial last sector (read-modify-write). The chunk is refilled
        // next round, so the volume may encrypt in it.
        vol.write_at_mut(&mut buf[..n], done)?;
        done += n as u64;
        p.tick(done);
    }
    buf.fill(0);
    vol.flush()?;
    p.finish("Imported", done);
    Ok(0)
}
