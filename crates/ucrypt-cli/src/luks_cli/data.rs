//! `export` and `import`: stream the whole data area of a volume through the engine, opened
//! like every front end opens it ([`VolumeArgs`]), in large requests so the engine's parallel
//! dispatch can use every core.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

use ucrypt::{BlockDev, Error};

use crate::error::{CliError, CliResult};
use crate::open::VolumeArgs;

/// Bytes per request: large enough that the engine splits it across workers.
const CHUNK_BYTES: usize = 4 << 20;

struct Progress {
    start: Instant,
    last: Instant,
    total: u64,
    show: bool,
}

impl Progress {
    fn new(total: u64) -> Self {
        let now = Instant::now();
        Progress {
            start: now,
            last: now,
            total,
            show: crate::pass::stderr_is_tty(),
        }
    }

    fn tick(&mut self, done: u64) {
        if self.show && self.last.elapsed().as_millis() >= 500 {
            self.last = Instant::now();
            let pct = if self.total == 0 {
                100.0
            } else {
                done as f64 * 100.0 / self.total as f64
            };
            let mibs =
                done as f64 / (1 << 20) as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
            eprint!(
                "\rProgress: {pct:5.1}%, {} MiB of {} MiB, {mibs:.0} MiB/s",
                done >> 20,
                self.total >> 20
            );
        }
    }

    fn finish(&self, verb: &str, done: u64) {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        if self.show {
            eprintln!();
        }
        eprintln!(
            "{verb} {done} bytes in {secs:.2} s ({:.0} MiB/s).",
            done as f64 / (1 << 20) as f64 / secs
        );
    }
}

pub fn export(v: &VolumeArgs, file: &Path) -> CliResult<i32> {
    let v = VolumeArgs {
        read_only: true,
        ..v.clone()
    };
    let vol = v.open()?;
    let total = vol.size();
    let mut out = File::create(file)
        .map_err(|e| Error::io(format!("Cannot create {}", file.display()), e))?;
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut done = 0u64;
    let mut p = Progress::new(total);
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

pub fn import(file: &Path, v: &VolumeArgs) -> CliResult<i32> {
    let vol = v.open()?;
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
    let mut p = Progress::new(in_len);
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
