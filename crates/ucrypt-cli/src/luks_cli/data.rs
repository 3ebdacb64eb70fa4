//! `export` and `import`: stream the whole data area of a LUKS volume through the sector
//! cipher, in large chunks (one cipher call per chunk).
//!
//! These run directly on `SectorCipher` over the data area: the engine (`ucrypt::volume`) was
//! not merged when they were written. The LUKS side hands over a `DataLayout` and a verified
//! `VolumeKey`, which is everything a `VolumeConfig` needs too.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use ucrypt::luks::{DataLayout, Header, VolumeKey};
use ucrypt::sector::{Geometry, SectorCipher};
use ucrypt::{Error, Result};

use super::dev::{DataDev, HeaderDev};
use super::{existing_source, load, read_volume_key_file, unlock_with, LuksOpts};

/// Bytes per read-crypt-write step: large enough that per-call costs vanish.
const CHUNK_BYTES: usize = 4 << 20;

/// Unlocks for a data verb: with --volume-key-file or a passphrase.
fn unlock_volume(volume: &Path, o: &LuksOpts, writable: bool) -> Result<(Header, VolumeKey)> {
    let (dev, hdr): (HeaderDev, Header) = load(volume, o, false)?;
    if writable {
        hdr.check_requirements()?;
    }
    let vk = match &o.volume_key_file {
        Some(p) => hdr.verify_key(read_volume_key_file(p, None)?)?,
        None => {
            unlock_with(
                &dev,
                &hdr,
                &existing_source(o, None),
                o.key_slot,
                &format!("Enter passphrase for {}: ", volume.display()),
            )?
            .1
        }
    };
    Ok((hdr, vk))
}

/// Size of the data area in bytes (whole sectors).
fn data_bytes(layout: &DataLayout, dev: &DataDev) -> Result<u64> {
    let ss = u64::from(layout.sector_size.bytes());
    let avail = dev.size()?.saturating_sub(layout.offset_bytes);
    let n = layout.size_bytes.unwrap_or(avail).min(avail);
    Ok(n / ss * ss)
}

fn cipher(layout: &DataLayout, vk: &VolumeKey) -> Result<SectorCipher> {
    let g = Geometry {
        sector_size: layout.sector_size,
        iv_offset: layout.iv_tweak,
        iv_large_sectors: false,
    };
    SectorCipher::new(layout.cipher, vk.bytes(), g)
}

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
            show: super::pass::stderr_is_tty(),
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

pub fn export(volume: &Path, file: &Path, o: &LuksOpts) -> Result<i32> {
    let (hdr, vk) = unlock_volume(volume, o, false)?;
    let layout = hdr.data_layout()?;
    let dev = DataDev::open(volume, false)?;
    let total = data_bytes(&layout, &dev)?;
    let mut c = cipher(&layout, &vk)?;
    let shift = layout.sector_size.shift();
    let mut out = File::create(file)
        .map_err(|e| Error::io(format!("Cannot create {}", file.display()), e))?;
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut done = 0u64;
    let mut p = Progress::new(total);
    while done < total {
        let n = (total - done).min(CHUNK_BYTES as u64) as usize;
        dev.file
            .read_exact_at(&mut buf[..n], layout.offset_bytes + done)
            .map_err(|e| Error::io(format!("reading {}", volume.display()), e))?;
        c.decrypt(done >> shift, &mut buf[..n])?;
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

pub fn import(file: &Path, volume: &Path, o: &LuksOpts) -> Result<i32> {
    let (hdr, vk) = unlock_volume(volume, o, true)?;
    let layout = hdr.data_layout()?;
    let dev = DataDev::open(volume, true)?;
    let total = data_bytes(&layout, &dev)?;
    let mut input =
        File::open(file).map_err(|e| Error::io(format!("Cannot open {}", file.display()), e))?;
    let in_len = input
        .metadata()
        .map_err(|e| Error::io(format!("stat {}", file.display()), e))?
        .len();
    if in_len > total {
        return Err(Error::InvalidArgument(format!(
            "{} ({in_len} bytes) is larger than the data area of {} ({total} bytes)",
            file.display(),
            volume.display()
        )));
    }
    let ss = layout.sector_size.bytes() as usize;
    let shift = layout.sector_size.shift();
    let mut c = cipher(&layout, &vk)?;
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut done = 0u64;
    let mut p = Progress::new(in_len);
    while done < in_len {
        let n = (in_len - done).min(CHUNK_BYTES as u64) as usize;
        input
            .read_exact(&mut buf[..n])
            .map_err(|e| Error::io(format!("reading {}", file.display()), e))?;
        // A partial last sector keeps the rest of its old plaintext (read-modify-write).
        let whole = n.div_ceil(ss) * ss;
        if whole != n {
            let last = whole - ss;
            let mut old = vec![0u8; ss];
            dev.file
                .read_exact_at(&mut old, layout.offset_bytes + done + last as u64)
                .map_err(|e| Error::io(format!("reading {}", volume.display()), e))?;
            c.decrypt((done + last as u64) >> shift, &mut old)?;
            buf[n..whole].copy_from_slice(&old[n - last..]);
        }
        c.encrypt(done >> shift, &mut buf[..whole])?;
        dev.file
            .write_all_at(&buf[..whole], layout.offset_bytes + done)
            .map_err(|e| Error::io(format!("writing {}", volume.display()), e))?;
        done += n as u64;
        p.tick(done);
    }
    buf.fill(0);
    let f: &File = &dev.file;
    f.sync_all()
        .map_err(|e| Error::io(format!("syncing {}", volume.display()), e))?;
    let _ = OpenOptions::new();
    p.finish("Imported", done);
    Ok(0)
}
