//! The driver that performs the sans-I/O LUKS steps against a [`Backend`], so that a library
//! user can open a volume in one call ([`open`]), the way rustls' `complete_io` drives a
//! connection over a socket:
//! - [`read_header`] feeds the header bytes to [`probe_len`] and [`parse_any`];
//! - [`unlock_key`] feeds keyslot areas to [`super::unlock`] (or checks a volume key);
//! - [`apply`] performs a [`WriteOp`] plan in order.
//!
//! The rest of `luks` stays sans-I/O; this module does no syscall itself either: it only calls
//! the backend. It prints nothing: a header's warnings are the caller's to show
//! ([`Header::warnings`] after [`read_header`]).
//!
//! Alignment. A backend may accept only offsets and lengths in whole logical blocks, from
//! buffers aligned in memory (O_DIRECT), while the core asks for arbitrary ranges: a LUKS1
//! header is 592 bytes at offset 0, keyslot material ends mid-block. So every transfer goes
//! through a bounce buffer aligned to the backend's memory alignment and cut into whole I/O
//! units; a write that covers a unit only in part reads that unit first (read-modify-write).
//! Bounce buffers are wiped when dropped, as is the header prefix read for parsing: they carry
//! keyslot material.

use std::sync::Arc;
use std::time::Duration;

use zeroize::{Zeroize, Zeroizing};

use super::luks2::MAGIC_2ND;
use super::{
    parse_any, probe_len, volume_config, Header, KeyUse, VolumeKey, WriteOp, HDR2_OFFSETS,
    HEADER_BYTES_MAX, PROBE_BYTES,
};
use crate::backend::{check_range, Backend};
use crate::engine::workers::SPIN_BEFORE_SLEEP;
use crate::engine::{Policies, Policy};
use crate::volume::Volume;
use crate::{Error, Result, SecretBytes};

/// Bytes moved per backend call, and so the bounce buffer's size: format's wipe of a 16 MiB
/// metadata area takes 16 calls, and no call holds more than this in memory.
const BOUNCE_BYTES: u64 = 1 << 20;
/// Largest logical block or memory alignment a backend may ask for. Linux block sizes and
/// O_DIRECT alignments are at most a page, and pages are at most 64 KiB; anything larger is a
/// backend bug, refused before it turns into a huge allocation.
const ALIGN_BYTES_MAX: u64 = 64 << 10;

/// How to open a LUKS volume with [`open`]. `Default`: read-write, the header on the data
/// backend, and the policy and spin of [`crate::volume::VolumeConfig::new`].
#[non_exhaustive]
#[derive(Clone)]
pub struct OpenOptions {
    /// Try only this keyslot with a passphrase (cryptsetup's `--key-slot`); ignored with a
    /// volume key, which is checked against the data segment's digest.
    pub key_slot: Option<u32>,
    /// Serve reads only. (A header with requirements ucrypt does not know is refused either
    /// way, as cryptsetup refuses to activate it.)
    pub read_only: bool,
    /// Pass discards down to the backend even without the header's `allow-discards` flag
    /// (cryptsetup's `--allow-discards`); the flag alone also enables them.
    pub allow_discards: bool,
    /// How reads and writes are dispatched (see [`Policies`]).
    pub policy: Policies,
    /// See [`crate::volume::VolumeConfig::spin`].
    pub spin: Duration,
    /// A detached header (cryptsetup's `--header`); `None`: the header is on the data backend.
    pub header: Option<Arc<dyn Backend>>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            key_slot: None,
            read_only: false,
            allow_discards: false,
            // The policy and spin `VolumeConfig::new` starts from.
            policy: Policy::Inline.into(),
            spin: SPIN_BEFORE_SLEEP,
            header: None,
        }
    }
}

impl std::fmt::Debug for OpenOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenOptions")
            .field("key_slot", &self.key_slot)
            .field("read_only", &self.read_only)
            .field("allow_discards", &self.allow_discards)
            .field("policy", &self.policy)
            .field("spin", &self.spin)
            .field("header", &self.header.as_ref().map(|h| h.describe()))
            .finish()
    }
}

/// What unlocks a volume. The secret is consumed: a passphrase is wiped once the unlock is
/// done, a volume key becomes the [`VolumeKey`] (wiped when that is dropped).
#[non_exhaustive]
#[derive(Debug)]
pub enum Unlock {
    /// Tried against the keyslots in cryptsetup's order (or only `key_slot`).
    Passphrase(SecretBytes),
    /// The volume key itself (cryptsetup's `--volume-key-file`), checked against the header's
    /// digest.
    VolumeKey(SecretBytes),
}

/// Reads and parses the header at the start of `dev`: the first [`PROBE_BYTES`], then as much
/// as [`probe_len`] asks for (at most [`HEADER_BYTES_MAX`], and never past the end of `dev`).
/// A LUKS2 header with a copy to recover is refused ([`Error::AmbiguousSignatures`]) when the
/// device also carries another format's signature ([`super::foreign_signature`]).
pub fn read_header(dev: &dyn Backend) -> Result<Header> {
    let (hdr, bytes) = read_header_bytes(dev)?;
    if let Header::Luks2(h) = &hdr {
        if h.repair.is_some() {
            if let Some(sig) = super::foreign_signature(&bytes) {
                return Err(Error::AmbiguousSignatures(sig));
            }
        }
    }
    Ok(hdr)
}

/// [`read_header`] for `repair`, which recovers a copy whatever other signature the device
/// carries: the user asked for it.
pub fn read_header_to_repair(dev: &dyn Backend) -> Result<Header> {
    Ok(read_header_bytes(dev)?.0)
}

/// The header and the bytes it was parsed from.
fn read_header_bytes(dev: &dyn Backend) -> Result<(Header, Zeroizing<Vec<u8>>)> {
    let first = read_upto(dev, 0, PROBE_BYTES)?;
    let need = probe_len(&first)?;
    // No primary's magic (a valid primary of 4 MiB metadata needs the whole 8 MiB too) and
    // no secondary's at any of its offsets: the whole probe range says what the first bytes
    // say (every candidate is "not a header"), without reading 8 MiB of what is likely
    // plaintext (an `--encrypt` probes twice). (If they parsed, the whole range is read.)
    if need == HEADER_BYTES_MAX
        && !first.starts_with(super::luks1::MAGIC)
        && !secondary_magic_anywhere(dev)?
    {
        parse_any(&first)?;
    }
    let mut bytes = read_upto(dev, 0, need.min(HEADER_BYTES_MAX))?;
    let hdr = parse_any(&bytes)?;
    // A copy to recover: the signatures' region (btrfs's is the farthest) is looked at too.
    if matches!(&hdr, Header::Luks2(h) if h.repair.is_some())
        && (bytes.len() as u64) < SIGNATURES_BYTES
    {
        bytes = read_upto(dev, 0, SIGNATURES_BYTES)?;
    }
    // A device cut short inside its keyslot areas (a truncated header copy) is no LUKS device,
    // as cryptsetup says: its keyslots cannot be read.
    let (need, have) = (hdr.areas_end(), dev.size());
    if have < need {
        return Err(Error::BadHeader {
            check: "truncated",
            detail: format!(
                "device too small: its header and keyslots need at least {need} bytes, it has \
                 {have}"
            ),
        });
    }
    Ok((hdr, bytes))
}

/// Bytes from offset 0 that hold every signature [`super::foreign_signature`] looks for.
const SIGNATURES_BYTES: u64 = 128 << 10;

/// Whether a LUKS2 secondary header's magic starts at any offset cryptsetup may put one.
fn secondary_magic_anywhere(dev: &dyn Backend) -> Result<bool> {
    for off in HDR2_OFFSETS {
        let magic = read_upto(dev, off, MAGIC_2ND.len() as u64)?;
        if magic.as_slice() == MAGIC_2ND {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Performs a write plan on `dev` in order: writes (through whole aligned units), zeroing in
/// bounded pieces, and `flush` at every [`WriteOp::Sync`]. An error stops the plan at that
/// step, which the plans are built to survive like a crash there (`luks::tests` crash a plan
/// at every step).
pub fn apply(dev: &dyn Backend, ops: &[WriteOp]) -> Result<()> {
    let io = IoRules::of(dev)?;
    for op in ops {
        match op {
            WriteOp::Write { offset, data } => {
                write_span(dev, &io, *offset, data.len() as u64, Source::Bytes(data))?
            }
            WriteOp::Zero { offset, len } => write_span(dev, &io, *offset, *len, Source::Zeroes)?,
            WriteOp::Sync => dev.flush()?,
        }
    }
    Ok(())
}

/// Turns `unlock` into a verified volume key for `hdr`, whose keyslot areas are read from
/// `dev` (the device `hdr` was read from). Returns the keyslot that opened (`None` for a
/// volume key) and the key. A wrong passphrase or key is [`Error::WrongPassphrase`].
pub fn unlock_key(
    dev: &dyn Backend,
    hdr: &Header,
    unlock: Unlock,
    key_slot: Option<u32>,
) -> Result<(Option<u32>, VolumeKey)> {
    unlock_key_for(dev, hdr, unlock, key_slot, KeyUse::Data)
}

/// [`unlock_key`] for `key_use`: with [`KeyUse::AnySegment`] an unbound keyslot (or volume
/// key) is accepted too, and the key returned may be unbound.
pub fn unlock_key_for(
    dev: &dyn Backend,
    hdr: &Header,
    unlock: Unlock,
    key_slot: Option<u32>,
    key_use: KeyUse,
) -> Result<(Option<u32>, VolumeKey)> {
    match unlock {
        Unlock::VolumeKey(key) => {
            let vk = hdr.verify_key(key)?;
            if key_use == KeyUse::Data {
                vk.require_bound()?;
            }
            Ok((None, vk))
        }
        Unlock::Passphrase(p) => {
            let mut read = |offset: u64, len: u64| read_area(dev, offset, len);
            let (slot, vk) = match key_use {
                KeyUse::Data => super::unlock(hdr, p.as_ref(), key_slot, &mut read)?,
                KeyUse::AnySegment => {
                    super::unlock_any_segment(hdr, p.as_ref(), key_slot, &mut read)?
                }
            };
            Ok((Some(slot), vk))
        }
    }
}

/// Opens the LUKS volume on `data` (header on `data` or on `opts.header`) as a [`Volume`]:
/// reads the header, refuses unmet mandatory requirements, unlocks, and
/// builds the volume with `opts` applied over what the header says. `data` must be writable
/// unless `opts.read_only`. Prints nothing: to show the header's warnings (a damaged copy),
/// call [`read_header`] and then [`open_parsed`].
pub fn open(data: Arc<dyn Backend>, unlock: Unlock, opts: &OpenOptions) -> Result<Volume> {
    let hdr = read_header(opts.header.as_deref().unwrap_or(data.as_ref()))?;
    open_parsed(data, &hdr, unlock, opts)
}

/// [`open`] with the header already read by [`read_header`] from `opts.header` (or `data`),
/// for a caller that looked at it first (its warnings, its version) without reading it twice.
pub fn open_parsed(
    data: Arc<dyn Backend>,
    hdr: &Header,
    unlock: Unlock,
    opts: &OpenOptions,
) -> Result<Volume> {
    let hdr_dev: &dyn Backend = match &opts.header {
        Some(h) => h.as_ref(),
        None => data.as_ref(),
    };
    // A requirement ucrypt does not know: no activation, not even read-only.
    hdr.check_known_requirements()?;
    if let Header::Luks2(h) = hdr {
        if super::reencrypt::ReencryptState::from_metadata(&h.meta)?.is_some() {
            // In reencryption: served as two segments (as cryptsetup activates such a volume).
            let Unlock::Passphrase(p) = unlock else {
                return Err(Error::UnsupportedLuks(
                    "opening a volume in reencryption with a volume key (both keys are needed: \
                     give the passphrase)"
                        .into(),
                ));
            };
            return super::reencrypt::online::open(data, hdr, p.as_ref(), opts);
        }
    }
    hdr.check_requirements()?;
    let (_, vk) = unlock_key(hdr_dev, hdr, unlock, opts.key_slot)?;
    let mut cfg = volume_config(hdr, &vk)?;
    drop(vk);
    cfg.policy = opts.policy;
    cfg.spin = opts.spin;
    cfg.read_only = cfg.read_only || opts.read_only;
    cfg.allow_discards |= opts.allow_discards;
    Volume::new(data, cfg)
}

// ---------------------------------------------------------------- aligned transfers

/// How one backend wants its I/O cut, read once per call.
struct IoRules {
    /// Offsets and lengths are whole units: the larger of the logical block and the memory
    /// alignment. Both are powers of two, so the larger is a multiple of the smaller: a
    /// unit-aligned position in an aligned buffer is aligned in memory and on the device.
    unit: u64,
    mem_align: usize,
    /// Bytes per backend call: [`BOUNCE_BYTES`] in whole units.
    chunk: u64,
    size: u64,
}

impl IoRules {
    fn of(dev: &dyn Backend) -> Result<IoRules> {
        let block = u64::from(dev.logical_block_bytes());
        let mem = dev.mem_align_bytes() as u64;
        for (what, n) in [("logical block size", block), ("memory alignment", mem)] {
            if !n.is_power_of_two() || n > ALIGN_BYTES_MAX {
                return Err(Error::InvalidArgument(format!(
                    "{}: a {what} of {n} bytes is not a power of two up to {ALIGN_BYTES_MAX}",
                    dev.describe()
                )));
            }
        }
        let unit = block.max(mem);
        Ok(IoRules {
            unit,
            mem_align: mem as usize,
            chunk: (BOUNCE_BYTES / unit * unit).max(unit),
            size: dev.size(),
        })
    }

    fn down(&self, x: u64) -> u64 {
        x / self.unit * self.unit
    }

    /// Rounds up to a unit, but never past the end of the device: the last unit of a device
    /// whose size is not a whole number of units is transferred short (buffered backends take
    /// that; O_DIRECT on such a device fails in the backend, with its error).
    fn up_to_size(&self, x: u64) -> u64 {
        x.div_ceil(self.unit)
            .saturating_mul(self.unit)
            .min(self.size)
    }
}

/// A scratch buffer aligned to the backend's memory alignment: an over-allocated `Vec` and an
/// aligned window into it, so no unsafe code and no custom allocator. Wiped on drop, since it
/// carries keyslot material and header bytes.
struct Bounce {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl Bounce {
    fn new(len: u64, mem_align: usize) -> Bounce {
        // `len` is at most one chunk (BOUNCE_BYTES).
        let len = len as usize;
        let raw = vec![0u8; len + mem_align - 1];
        let start = (mem_align - raw.as_ptr() as usize % mem_align) % mem_align;
        // The window never moves: `raw` is never resized, so its heap address is fixed.
        debug_assert_eq!((raw.as_ptr() as usize + start) % mem_align, 0);
        Bounce { raw, start, len }
    }

    /// The first `n` bytes of the aligned window.
    fn get(&mut self, n: u64) -> &mut [u8] {
        assert!(n as usize <= self.len, "bounce buffer asked for {n} bytes");
        &mut self.raw[self.start..self.start + n as usize]
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        self.raw.zeroize();
    }
}

/// Reads `offset..offset + len`, cut short only by the end of `dev` (like `pread`), through
/// whole aligned units. The result is wiped when dropped.
fn read_upto(dev: &dyn Backend, offset: u64, len: u64) -> Result<Zeroizing<Vec<u8>>> {
    let io = IoRules::of(dev)?;
    let end = offset.saturating_add(len).min(io.size);
    let mut out = Zeroizing::new(Vec::new());
    if offset >= end {
        return Ok(out);
    }
    // Reserved once, so the vector never reallocates and leaves unwiped copies behind. The
    // callers bound `len`: HEADER_BYTES_MAX, or a keyslot area the parser has bounded.
    let want = usize::try_from(end - offset).map_err(|_| {
        Error::InvalidArgument(format!("a read of {len} bytes does not fit in memory"))
    })?;
    out.reserve_exact(want);
    let (from, to) = (io.down(offset), io.up_to_size(end));
    let mut bounce = Bounce::new((to - from).min(io.chunk), io.mem_align);
    let mut at = from;
    while at < to {
        let n = (to - at).min(io.chunk);
        let buf = bounce.get(n);
        dev.read_exact_at(buf, at)?;
        let (lo, hi) = (offset.max(at) - at, end.min(at + n) - at);
        out.extend_from_slice(&buf[lo as usize..hi as usize]);
        at += n;
    }
    debug_assert_eq!(out.len(), want);
    Ok(out)
}

/// Exactly `len` bytes at `offset` of `dev`, through whole aligned units: a keyslot area, or
/// the metadata area a header backup saves. A device that ends first fails the header's
/// "truncated" check, as a truncated header image does. `len` must be bounded by the caller
/// (a parsed header's areas are).
pub fn read_area(dev: &dyn Backend, offset: u64, len: u64) -> Result<Vec<u8>> {
    let end = offset.checked_add(len).filter(|&e| e <= dev.size());
    if end.is_none() {
        return Err(Error::BadHeader {
            check: "truncated",
            detail: format!(
                "{} ends before byte {} (keyslot or header area)",
                dev.describe(),
                offset.saturating_add(len)
            ),
        });
    }
    let mut b = read_upto(dev, offset, len)?;
    // The core takes ownership of the bytes; they are keyslot ciphertext, as readable on the
    // device as here.
    Ok(std::mem::take(&mut *b))
}

/// What a write puts in its range.
#[derive(Clone, Copy)]
enum Source<'a> {
    Bytes(&'a [u8]),
    Zeroes,
}

/// Writes `len` bytes at `offset` through whole aligned units, one chunk per backend call.
/// Only the first and last units can be partly covered; their other bytes are read first.
fn write_span(
    dev: &dyn Backend,
    io: &IoRules,
    offset: u64,
    len: u64,
    src: Source<'_>,
) -> Result<()> {
    check_range(offset, len, io.size)?;
    if len == 0 {
        return Ok(());
    }
    let end = offset + len;
    let (from, to) = (io.down(offset), io.up_to_size(end));
    let mut bounce = Bounce::new((to - from).min(io.chunk), io.mem_align);
    let mut at = from;
    while at < to {
        let n = (to - at).min(io.chunk);
        let buf = bounce.get(n);
        let head = offset > at;
        if head {
            dev.read_exact_at(&mut buf[..io.unit.min(n) as usize], at)?;
        }
        let tail_at = io.down(end).max(at);
        if end < at + n && !(head && tail_at == at) {
            dev.read_exact_at(&mut buf[(tail_at - at) as usize..], tail_at)?;
        }
        let (lo, hi) = (offset.max(at), end.min(at + n));
        let dst = &mut buf[(lo - at) as usize..(hi - at) as usize];
        match src {
            Source::Bytes(d) => {
                dst.copy_from_slice(&d[(lo - offset) as usize..(hi - offset) as usize])
            }
            Source::Zeroes => dst.fill(0),
        }
        dev.write_at(buf, at)?;
        at += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    use super::*;
    use crate::backend::{DirectMode, FileBackend, MemBackend};
    use crate::luks::json::Requirements;
    use crate::luks::luks2::{self, FormatLuks2};
    use crate::luks::tests::fast_kdf;
    use crate::luks::{apply_to_image, luks1, HashAlg, NewKeyslot};
    use crate::sector::CipherSpec;
    use crate::BlockDev;

    const MIB: u64 = 1 << 20;
    const UUID: &str = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0";
    /// LUKS2 data offset in these tests: 1 MiB of metadata (two 16 KiB copies + keyslots).
    const DATA_OFFSET: u64 = MIB;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Ev {
        Read(u64, usize),
        Write(u64, usize),
        Flush,
    }

    /// A memory backend with O_DIRECT's rules: offsets and lengths in whole `block`s, buffers
    /// aligned to `mem_align`; anything else fails, as the kernel's EINVAL would. Records every
    /// call, so a test can see what reached the device and in which order.
    struct Strict {
        inner: MemBackend,
        block: u32,
        mem_align: usize,
        log: Mutex<Vec<Ev>>,
    }

    impl Strict {
        fn new(size: u64, block: u32, mem_align: usize) -> Strict {
            Strict {
                inner: MemBackend::new(size),
                block,
                mem_align,
                log: Mutex::new(Vec::new()),
            }
        }

        fn check(&self, what: &str, ptr: *const u8, len: usize, offset: u64) -> Result<()> {
            let b = u64::from(self.block);
            if offset % b != 0 || len as u64 % b != 0 || ptr as usize % self.mem_align != 0 {
                return Err(Error::InvalidArgument(format!(
                    "unaligned {what} of {len} bytes at {offset} from {ptr:p}"
                )));
            }
            Ok(())
        }

        fn events(&self) -> Vec<Ev> {
            self.log.lock().expect("log").clone()
        }
    }

    impl Backend for Strict {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
            self.check("read", buf.as_ptr(), buf.len(), offset)?;
            self.log
                .lock()
                .expect("log")
                .push(Ev::Read(offset, buf.len()));
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
            self.check("write", buf.as_ptr(), buf.len(), offset)?;
            self.log
                .lock()
                .expect("log")
                .push(Ev::Write(offset, buf.len()));
            self.inner.write_at(buf, offset)
        }
        fn flush(&self) -> Result<()> {
            self.log.lock().expect("log").push(Ev::Flush);
            Ok(())
        }
        fn discard(&self, offset: u64, len: u64) -> Result<()> {
            self.inner.discard(offset, len)
        }
        fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
            self.inner.write_zeroes(offset, len)
        }
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn logical_block_bytes(&self) -> u32 {
            self.block
        }
        fn mem_align_bytes(&self) -> usize {
            self.mem_align
        }
        fn describe(&self) -> String {
            format!(
                "strict memory (block {}, align {})",
                self.block, self.mem_align
            )
        }
    }

    fn pass(p: &str) -> Unlock {
        Unlock::Passphrase(SecretBytes::from_slice(p.as_bytes()))
    }

    /// LUKS2 on `hdr_dev` through [`apply`], with the CLI's plan (wipe the metadata area, then
    /// keyslot material and the header commit): 4096-byte sectors, "pass0" in keyslot 0.
    /// Returns the volume key.
    fn format_luks2(hdr_dev: &dyn Backend, data_offset: u64) -> Vec<u8> {
        let mut o = FormatLuks2::defaults(UUID.into());
        o.kdf = fast_kdf();
        o.data_offset = data_offset;
        o.keyslots_size = MIB - 2 * o.hdr_size;
        let vk: Vec<u8> = (0..64u8).collect();
        let (mut h, key) = luks2::format(&o, SecretBytes::from_slice(&vk)).expect("format");
        let mut plan = vec![WriteOp::Zero {
            offset: 0,
            len: h.metadata_area_bytes(),
        }];
        let (_, add) = h
            .add_keyslot(
                NewKeyslot {
                    vk: &key,
                    passphrase: b"pass0",
                    kdf: &fast_kdf(),
                    slot: None,
                },
                None,
            )
            .expect("add keyslot");
        plan.extend(add);
        apply(hdr_dev, &plan).expect("apply the format plan");
        vk
    }

    /// LUKS1 (592-byte header at offset 0, 512-byte sectors) through [`apply`], "pass0" in
    /// keyslot 0. Returns the volume key and the data offset.
    fn format_luks1(dev: &dyn Backend) -> (Vec<u8>, u64) {
        let vk = vec![7u8; 64];
        let (mut h, key) = luks1::format(
            CipherSpec::AES_XTS_PLAIN64,
            HashAlg::Sha256,
            UUID.into(),
            SecretBytes::from_slice(&vk),
            &fast_kdf(),
            None,
        )
        .expect("format");
        let mut plan = vec![
            WriteOp::Zero {
                offset: 0,
                len: Header::Luks1(h.clone()).metadata_area_bytes(),
            },
            WriteOp::Write {
                offset: 0,
                data: h.encode().expect("encode"),
            },
        ];
        let (_, add) = h
            .add_keyslot(NewKeyslot {
                vk: &key,
                passphrase: b"pass0",
                kdf: &fast_kdf(),
                slot: None,
            })
            .expect("add keyslot");
        plan.extend(add);
        apply(dev, &plan).expect("apply the format plan");
        (vk, u64::from(h.payload_offset) * 512)
    }

    /// Data written through one opened volume is read back through a second one, and the
    /// backend holds ciphertext, not the data.
    fn write_reopen_read(data: &Arc<dyn Backend>, opts: &OpenOptions, data_offset: u64) {
        let pattern: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        // Unaligned on purpose: the volume's own read-modify-write runs over the backend too.
        let at = 3 * 4096 + 17;
        let v = open(data.clone(), pass("pass0"), opts).expect("open");
        assert!(!v.read_only());
        assert_eq!(BlockDev::size(&v), data.size() - data_offset);
        v.write_at(&pattern, at).expect("write");
        v.flush().expect("flush");
        drop(v);
        let raw = read_upto(data.as_ref(), data_offset + at, pattern.len() as u64).expect("raw");
        assert_ne!(&raw[..], &pattern[..], "the backend holds plaintext");
        let v = open(data.clone(), pass("pass0"), opts).expect("reopen");
        let mut back = vec![0u8; pattern.len()];
        v.read_at(&mut back, at).expect("read");
        assert_eq!(back, pattern);
    }

    #[test]
    fn apply_matches_the_image_model_through_whole_aligned_units() {
        let size = 3 * MIB;
        let dev = Strict::new(size, 4096, 4096);
        let noise: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        dev.inner.write_at(&noise, 0).expect("fill");
        let plan = vec![
            // Starts and ends mid-unit.
            WriteOp::Write {
                offset: 5000,
                data: vec![0xab; 10_000],
            },
            // Starts and ends inside one unit.
            WriteOp::Write {
                offset: 100,
                data: vec![0xcd; 50],
            },
            // More than two chunks, both ends unaligned.
            WriteOp::Zero {
                offset: 4097,
                len: 2 * MIB + 10,
            },
            WriteOp::Sync,
            // The last bytes of the device.
            WriteOp::Write {
                offset: size - 10,
                data: vec![0xef; 10],
            },
            WriteOp::Sync,
        ];
        apply(&dev, &plan).expect("apply");
        let ev = dev.events();
        let mut want = noise.clone();
        apply_to_image(&mut want, &plan);
        let got = read_upto(&dev, 0, size).expect("read back");
        assert!(got[..] == want[..], "device differs from the image model");
        // Every call was whole units (Strict refuses anything else); no call moved more than a
        // chunk; the flushes sit where the plan's syncs are.
        assert!(ev.iter().all(|e| match e {
            Ev::Read(_, n) | Ev::Write(_, n) => *n as u64 <= BOUNCE_BYTES,
            Ev::Flush => true,
        }));
        let flushes: Vec<usize> = (0..ev.len()).filter(|&i| ev[i] == Ev::Flush).collect();
        assert_eq!(flushes.len(), 2, "{ev:?}");
        assert_eq!(flushes[1], ev.len() - 1);
        let last_write = ev
            .iter()
            .position(|e| *e == Ev::Write(size - 4096, 4096))
            .expect("write of the last unit");
        assert!(
            flushes[0] < last_write,
            "a write moved across a sync: {ev:?}"
        );
    }

    #[test]
    fn apply_refuses_a_write_past_the_end_before_writing_anything() {
        let dev = Strict::new(MIB, 512, 512);
        let plan = [WriteOp::Write {
            offset: MIB - 10,
            data: vec![1; 11],
        }];
        assert!(matches!(apply(&dev, &plan), Err(Error::OutOfRange { .. })));
        assert!(dev.events().is_empty());
    }

    #[test]
    fn a_backend_with_impossible_alignment_is_refused() {
        for (block, align) in [(512, 3), (1000, 1), (512, 1 << 20)] {
            let dev = Strict::new(MIB, block, align);
            let r = apply(
                &dev,
                &[WriteOp::Write {
                    offset: 0,
                    data: vec![1],
                }],
            );
            assert!(
                matches!(r, Err(Error::InvalidArgument(_))),
                "{block} {align}"
            );
            assert!(matches!(read_header(&dev), Err(Error::InvalidArgument(_))));
        }
    }

    /// Not LUKS: the probe asks for [`HEADER_BYTES_MAX`], and the device is smaller. Reading
    /// past its end would be an I/O error ("ended early"); the parser's own verdict comes out.
    #[test]
    fn read_header_reads_no_further_than_the_device() {
        let noise = |size: u64| {
            let dev = Strict::new(size, 512, 512);
            dev.inner
                .write_at(&vec![0x5a; size as usize], 0)
                .expect("fill");
            dev
        };
        assert!(matches!(
            read_header(&noise(64 << 10)),
            Err(Error::NotLuks(_))
        ));
        // Shorter than a LUKS2 binary header, and no magic: not LUKS either.
        assert!(matches!(read_header(&noise(1024)), Err(Error::NotLuks(_))));
        assert!(matches!(
            read_header(&MemBackend::new(0)),
            Err(Error::NotLuks(_))
        ));
    }

    #[test]
    fn luks2_opens_writes_and_reopens_on_aligned_backends() {
        let backends: Vec<Arc<dyn Backend>> = vec![
            Arc::new(MemBackend::new(4 * MIB)),
            Arc::new(Strict::new(4 * MIB, 4096, 4096)),
            Arc::new(Strict::new(4 * MIB, 512, 4096)),
        ];
        for data in backends {
            format_luks2(data.as_ref(), DATA_OFFSET);
            write_reopen_read(&data, &OpenOptions::default(), DATA_OFFSET);
        }
    }

    #[test]
    fn wrong_passphrase_and_volume_keys() {
        let data: Arc<dyn Backend> = Arc::new(Strict::new(4 * MIB, 4096, 4096));
        let vk = format_luks2(data.as_ref(), DATA_OFFSET);
        let opts = OpenOptions::default();
        assert!(matches!(
            open(data.clone(), pass("nope"), &opts),
            Err(Error::WrongPassphrase)
        ));
        let mut wrong = vk.clone();
        wrong[0] ^= 1;
        let wrong = Unlock::VolumeKey(SecretBytes::from_vec(wrong));
        assert!(matches!(
            open(data.clone(), wrong, &opts),
            Err(Error::WrongPassphrase)
        ));
        // The right volume key opens the volume that the passphrase wrote.
        let v = open(data.clone(), pass("pass0"), &opts).expect("open");
        v.write_at(b"written with the passphrase", 0)
            .expect("write");
        drop(v);
        let right = Unlock::VolumeKey(SecretBytes::from_slice(&vk));
        let v = open(data.clone(), right, &opts).expect("open with the volume key");
        let mut b = [0u8; 27];
        v.read_at(&mut b, 0).expect("read");
        assert_eq!(&b, b"written with the passphrase");
        // unlock_key says which keyslot opened.
        let hdr = read_header(data.as_ref()).expect("header");
        let (slot, key) = unlock_key(data.as_ref(), &hdr, pass("pass0"), Some(0)).expect("slot 0");
        assert_eq!((slot, key.bytes()), (Some(0), &vk[..]));
        let by_key = Unlock::VolumeKey(SecretBytes::from_slice(&vk));
        let (slot, _) = unlock_key(data.as_ref(), &hdr, by_key, None).expect("volume key");
        assert_eq!(slot, None);
    }

    #[test]
    fn detached_luks2_header() {
        let header: Arc<dyn Backend> = Arc::new(Strict::new(MIB, 4096, 4096));
        let data: Arc<dyn Backend> = Arc::new(Strict::new(2 * MIB, 4096, 4096));
        format_luks2(header.as_ref(), 0);
        let opts = OpenOptions {
            header: Some(header.clone()),
            ..OpenOptions::default()
        };
        write_reopen_read(&data, &opts, 0);
        // The data device alone carries no header.
        assert!(matches!(
            open(data.clone(), pass("pass0"), &OpenOptions::default()),
            Err(Error::NotLuks(_))
        ));
    }

    #[test]
    fn luks1_unaligned_header_through_aligned_units() {
        let backends: Vec<Arc<dyn Backend>> = vec![
            Arc::new(MemBackend::new(3 * MIB)),
            Arc::new(Strict::new(3 * MIB, 512, 512)),
        ];
        for data in backends {
            let (_, offset) = format_luks1(data.as_ref());
            assert_eq!(read_header(data.as_ref()).expect("header").version(), 1);
            write_reopen_read(&data, &OpenOptions::default(), offset);
        }
        // Memory alignment above the block size, as a FileBackend assumes when the kernel does
        // not report O_DIRECT alignment: the driver's part (format, header, keyslot) only, as
        // the volume's own 512-byte read-modify-write buffers are aligned to 512 bytes.
        let dev = Strict::new(3 * MIB, 512, 4096);
        let (vk, _) = format_luks1(&dev);
        let hdr = read_header(&dev).expect("header");
        assert_eq!(hdr.version(), 1);
        let (slot, key) = unlock_key(&dev, &hdr, pass("pass0"), None).expect("unlock");
        assert_eq!((slot, key.bytes()), (Some(0), &vk[..]));
    }

    #[test]
    fn unmet_requirement_is_refused_even_read_only() {
        let data: Arc<dyn Backend> = Arc::new(MemBackend::new(4 * MIB));
        format_luks2(data.as_ref(), DATA_OFFSET);
        let Header::Luks2(mut h) = read_header(data.as_ref()).expect("header") else {
            panic!("not LUKS2")
        };
        h.meta.config.requirements = Some(Requirements {
            mandatory: Some(vec!["future-feature".into()]),
            extra: Default::default(),
        });
        apply(data.as_ref(), &h.commit().expect("commit")).expect("apply");
        let ro = OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        };
        for opts in [OpenOptions::default(), ro] {
            assert!(matches!(
                open(data.clone(), pass("pass0"), &opts),
                Err(Error::UnmetRequirements(r)) if r == ["future-feature"]
            ));
        }
        // The keyslots still answer (a passphrase test), as cryptsetup's do.
        let hdr = read_header(data.as_ref()).expect("header");
        let (slot, _) = unlock_key(data.as_ref(), &hdr, pass("pass0"), None).expect("unlock");
        assert_eq!(slot, Some(0));
    }

    #[test]
    fn damaged_primary_is_reported_by_read_header_and_still_opens() {
        let data: Arc<dyn Backend> = Arc::new(MemBackend::new(4 * MIB));
        format_luks2(data.as_ref(), DATA_OFFSET);
        // A byte inside the primary's JSON: its checksum breaks.
        apply(
            data.as_ref(),
            &[WriteOp::Write {
                offset: 4096 + 10,
                data: vec![b'#'],
            }],
        )
        .expect("damage");
        let hdr = read_header(data.as_ref()).expect("header");
        assert_eq!(hdr.warnings().len(), 1, "{:?}", hdr.warnings());
        open(data, pass("pass0"), &OpenOptions::default()).expect("open");
    }

    #[test]
    fn keyslot_area_past_the_end_fails_the_truncated_check() {
        let full = MemBackend::new(4 * MIB);
        format_luks2(&full, DATA_OFFSET);
        // Both header copies, and only the start of keyslot 0's material (at 32 KiB).
        let cut = read_upto(&full, 0, 40_000).expect("read");
        let short: Arc<dyn Backend> = Arc::new(MemBackend::new(40_000));
        short.write_at(&cut, 0).expect("copy");
        match open(short, pass("pass0"), &OpenOptions::default()) {
            Err(Error::BadHeader { check, .. }) => assert_eq!(check, "truncated"),
            other => panic!("expected 'truncated', got {:?}", other.err()),
        }
    }

    /// A file under `dir`, removed when dropped.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(dir: &str, size: u64) -> Option<TempFile> {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = PathBuf::from(dir).join(format!(
                "ucrypt-luks-driver-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let f = std::fs::File::create(&p).ok()?;
            let t = TempFile(p);
            f.set_len(size).ok()?;
            Some(t)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// The real thing: a file opened with O_DIRECT. ext4 (/var/tmp) refuses unaligned offsets
    /// and lengths; tmpfs (/dev/shm) supports O_DIRECT but enforces nothing, so it is only the
    /// fallback.
    #[test]
    fn luks2_and_luks1_on_an_o_direct_file() {
        let found = ["/var/tmp", "/dev/shm"].into_iter().find_map(|dir| {
            let f = TempFile::new(dir, 4 * MIB)?;
            let b = FileBackend::open(&f.0, true, DirectMode::Always).ok()?;
            Some((f, b))
        });
        let Some((file, probe)) = found else {
            println!("SKIPPED: no O_DIRECT-capable directory among /var/tmp and /dev/shm");
            return;
        };
        assert!(probe.is_direct());
        drop(probe);
        let reopen = || -> Arc<dyn Backend> {
            Arc::new(FileBackend::open(&file.0, true, DirectMode::Always).expect("reopen"))
        };
        let data = reopen();
        format_luks2(data.as_ref(), DATA_OFFSET);
        // Probed after format: a read from a hole of a sparse file skips the alignment check.
        let strict = data.read_at(&mut [0u8; 100], 0).is_err();
        eprintln!(
            "{}: block {}, memory alignment {}, unaligned I/O {}",
            data.describe(),
            data.logical_block_bytes(),
            data.mem_align_bytes(),
            if strict { "refused" } else { "accepted" }
        );
        write_reopen_read(&data, &OpenOptions::default(), DATA_OFFSET);
        let data = reopen();
        let (_, offset) = format_luks1(data.as_ref());
        write_reopen_read(&data, &OpenOptions::default(), offset);
    }
}
