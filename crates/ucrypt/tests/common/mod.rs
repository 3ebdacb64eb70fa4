//! What the ucrypt crate's integration tests share beyond the test kit (`crate::kit`, which
//! each test file includes): volumes over memory or a file with a chosen policy, the power-cut
//! backends, LUKS2 formatting shortcuts and header surgery.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ucrypt::backend::{Backend, CrashBackend, DirectMode, FileBackend, MemBackend};
use ucrypt::engine::Policy;
use ucrypt::luks::luks2::{format, FormatLuks2};
use ucrypt::luks::{self, HashAlg, KdfRequest, NewKeyslot, OpenOptions, Unlock};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

use crate::kit::TempFile;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Mem,
    /// A /dev/shm file opened with O_DIRECT when the filesystem allows it.
    File,
}

pub fn key_for(spec: CipherSpec, seed: u64) -> Vec<u8> {
    let n = spec.default_key_bytes();
    (0..n)
        .map(|i| {
            (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (i % 8 * 8)) as u8
                ^ (i as u8).wrapping_mul(31)
        })
        .collect()
}

pub struct Rig {
    pub vol: Arc<Volume>,
    pub backend: Arc<dyn Backend>,
    pub data_offset: u64,
    pub key: Vec<u8>,
    pub geometry: Geometry,
    pub spec: CipherSpec,
    _file: Option<TempFile>,
}

pub struct RigCfg {
    pub kind: BackendKind,
    pub spec: CipherSpec,
    pub sector: u32,
    pub policy: Policy,
    pub pool_bytes: usize,
    pub size: u64,
    pub data_offset: u64,
    pub seed: u64,
    /// `VolumeConfig::idle_release`.
    pub idle_release: std::time::Duration,
}

impl Default for RigCfg {
    fn default() -> Self {
        RigCfg {
            kind: BackendKind::Mem,
            spec: CipherSpec::AES_XTS_PLAIN64,
            sector: 4096,
            policy: Policy::Inline,
            pool_bytes: 1 << 20,
            size: 4 << 20,
            data_offset: 8192,
            seed: 1,
            idle_release: ucrypt::volume::THREAD_IDLE_EXIT,
        }
    }
}

pub fn rig(c: RigCfg) -> Rig {
    rig_over(c, None)
}

/// Builds a volume; `wrap` may wrap the raw backend (e.g. in a FaultBackend).
pub type Wrap<'a> = &'a dyn Fn(Arc<dyn Backend>) -> Arc<dyn Backend>;

pub fn rig_over(c: RigCfg, wrap: Option<Wrap<'_>>) -> Rig {
    let total = c.size + c.data_offset;
    let (raw, file): (Arc<dyn Backend>, _) = match c.kind {
        BackendKind::Mem => (Arc::new(MemBackend::new(total)), None),
        BackendKind::File => {
            let f = TempFile::new(total);
            // O_DIRECT unless the filesystem wants bigger blocks than the sector size.
            let b = FileBackend::open_for_sector(&f.0, true, DirectMode::Auto, c.sector).unwrap();
            (Arc::new(b), Some(f))
        }
    };
    let backend = match wrap {
        Some(w) => w(raw),
        None => raw,
    };
    let key = key_for(c.spec, c.seed);
    let geometry = Geometry {
        sector_size: SectorSize::new(c.sector as u64).unwrap(),
        iv_offset: 0,
        iv_large_sectors: false,
    };
    let mut cfg = VolumeConfig::new(c.spec, SecretBytes::from_slice(&key), geometry);
    cfg.data_offset_bytes = c.data_offset;
    cfg.size_bytes = Some(c.size);
    cfg.policy = c.policy.into();
    cfg.pool_bytes = c.pool_bytes;
    cfg.idle_release = c.idle_release;
    let vol = Arc::new(Volume::new(backend.clone(), cfg).unwrap());
    Rig {
        vol,
        backend,
        data_offset: c.data_offset,
        key,
        geometry,
        spec: c.spec,
        _file: file,
    }
}

/// A buffer whose data starts at a chosen misalignment from a 4096-byte boundary (to test both
/// the in-place O_DIRECT path and the bounce path).
pub struct OffsetBuf {
    store: Vec<u8>,
    start: usize,
    len: usize,
}

impl OffsetBuf {
    pub fn new(len: usize, misalign: usize) -> Self {
        let store = vec![0u8; len + 8192];
        let base = store.as_ptr() as usize;
        let start = (4096 - base % 4096) % 4096 + misalign % 4096;
        OffsetBuf { store, start, len }
    }
    pub fn get(&mut self) -> &mut [u8] {
        &mut self.store[self.start..self.start + self.len]
    }
}

/// Bounce buffers of a power-cut test's volume: room for its largest request.
pub const CRASH_POOL_BYTES: usize = 1 << 20;

/// The aes-xts-plain64 volume the power-cut tests open, before and after each crash, on a
/// `CrashBackend` (or a wrapper of one): `bytes` of plaintext after `data_offset`, a fixed key,
/// a small pool and no busy-waiting, so that building two volumes a crash point stays cheap
/// (neither changes what reaches the device, or in which order).
pub fn crash_volume(
    backend: Arc<dyn Backend>,
    sector: SectorSize,
    policy: Policy,
    data_offset: u64,
    bytes: u64,
    allow_discards: bool,
) -> Volume {
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(29) ^ 0x5a).collect();
    let mut cfg = VolumeConfig::new(
        CipherSpec::AES_XTS_PLAIN64,
        SecretBytes::from_slice(&key),
        Geometry::new(sector),
    );
    cfg.data_offset_bytes = data_offset;
    cfg.size_bytes = Some(bytes);
    cfg.policy = policy.into();
    cfg.allow_discards = allow_discards;
    cfg.pool_bytes = CRASH_POOL_BYTES;
    cfg.spin = std::time::Duration::ZERO;
    Volume::new(backend, cfg).expect("volume")
}

/// A KDF that costs nothing (pbkdf2, 1000 iterations): for tests that make many keyslots.
pub fn fast_kdf() -> KdfRequest {
    KdfRequest {
        kind: "pbkdf2".into(),
        hash: HashAlg::Sha256,
        iter_time_ms: 1,
        memory_kib: 32,
        parallel: 1,
        force_iterations: Some(1000),
    }
}

/// A crash-simulating backend that stops after `budget` writes, flushes, discards and
/// write-zeroes: from then on each fails, as after a power cut or a kill -9. `used` counts the
/// calls (also those refused), so a run with budget `u64::MAX` counts a whole run's.
pub struct Cut {
    pub inner: Arc<CrashBackend>,
    pub budget: u64,
    pub used: AtomicU64,
}

impl Cut {
    pub fn new(image: Vec<u8>, unit: u64, budget: u64) -> Cut {
        Cut {
            inner: Arc::new(CrashBackend::from_image(image, unit)),
            budget,
            used: AtomicU64::new(0),
        }
    }

    fn spend(&self) -> ucrypt::Result<()> {
        if self.used.fetch_add(1, Ordering::SeqCst) >= self.budget {
            Err(ucrypt::Error::InvalidArgument("power cut".into()))
        } else {
            Ok(())
        }
    }

    /// Everything written so far, unsynced writes included (a killed process, not a power
    /// cut).
    pub fn image(&self) -> Vec<u8> {
        self.inner.flush().expect("flush");
        self.inner.crash_image(0)
    }
}

impl Backend for Cut {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        self.spend()?;
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.spend()?;
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.spend()?;
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.spend()?;
        self.inner.write_zeroes(offset, len)
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_bytes(&self) -> u32 {
        self.inner.logical_block_bytes()
    }
    fn describe(&self) -> String {
        "cut".into()
    }
}

/// Formats a LUKS2 volume on `dev` (header copies of `hdr_size`, data at `data_offset`,
/// `sector`-byte sectors, volume key `vk`, one keyslot for `pass` with [`fast_kdf`]) and
/// writes `data` at its start through the volume, flushed.
pub fn format_filled(
    dev: &Arc<dyn Backend>,
    uuid: &str,
    (data_offset, hdr_size, sector): (u64, u64, u32),
    vk: &[u8],
    pass: &[u8],
    data: &[u8],
) {
    let mut o = FormatLuks2::defaults(uuid.into());
    o.data_offset = data_offset;
    o.hdr_size = hdr_size;
    o.keyslots_size = data_offset - 2 * hdr_size;
    format_one_keyslot(dev.as_ref(), o, sector, vk, pass);
    let vol = luks::open(
        dev.clone(),
        Unlock::Passphrase(SecretBytes::from_slice(pass)),
        &OpenOptions::default(),
    )
    .expect("open");
    vol.write_at(data, 0).expect("fill");
    vol.flush().expect("flush");
}

/// Writes a detached LUKS2 header to `hdr_dev`: data offset 0, header copies of `hdr_size`
/// and a keyslots area filling the rest of `hdr_bytes`, `sector`-byte sectors, volume key
/// `vk`, one keyslot for `pass` with [`fast_kdf`].
pub fn format_detached(
    hdr_dev: &dyn Backend,
    uuid: &str,
    (hdr_size, hdr_bytes, sector): (u64, u64, u32),
    vk: &[u8],
    pass: &[u8],
) {
    let mut o = FormatLuks2::defaults(uuid.into());
    o.data_offset = 0;
    o.detached = true;
    o.hdr_size = hdr_size;
    o.keyslots_size = hdr_bytes - 2 * hdr_size;
    format_one_keyslot(hdr_dev, o, sector, vk, pass);
}

/// Formats `o` (with [`fast_kdf`] and `sector`-byte sectors) for the volume key `vk` with one
/// keyslot for `pass`, and writes it to `dev`.
fn format_one_keyslot(dev: &dyn Backend, mut o: FormatLuks2, sector: u32, vk: &[u8], pass: &[u8]) {
    o.kdf = fast_kdf();
    o.sector_size = SectorSize::new(u64::from(sector)).unwrap();
    let (mut hdr, key) = format(&o, SecretBytes::from_slice(vk)).expect("format");
    let (_, ops) = hdr
        .add_keyslot(
            NewKeyslot {
                vk: &key,
                passphrase: pass,
                kdf: &fast_kdf(),
                slot: None,
            },
            None,
        )
        .expect("keyslot");
    luks::apply(dev, &ops).expect("apply");
}

/// `len` bytes of `inner` from `offset`, as a backend of their own (a detached header and
/// the volume on one crash-simulated disk); writes past the end are a test bug.
pub struct Slice {
    pub inner: Arc<dyn Backend>,
    pub offset: u64,
    pub len: u64,
}

impl Backend for Slice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<usize> {
        self.inner.read_at(buf, self.offset + offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        assert!(
            offset + buf.len() as u64 <= self.len,
            "write past the slice"
        );
        self.inner.write_at(buf, self.offset + offset)
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.inner.discard(self.offset + offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.inner.write_zeroes(self.offset + offset, len)
    }
    fn size(&self) -> u64 {
        self.len
    }
    fn logical_block_bytes(&self) -> u32 {
        self.inner.logical_block_bytes()
    }
    fn describe(&self) -> String {
        "slice".into()
    }
}

/// Applies `f` to the JSON of both LUKS2 header copies of `img` (each `hdr_size` bytes) and
/// makes their checksums valid again: a header that says what a test needs it to say, past
/// the library's own checks on what it writes.
pub fn mutate_json(hdr_size: u64, img: &mut [u8], f: &dyn Fn(&mut serde_json::Value)) {
    for c in 0..2 {
        let copy = &mut img[c * hdr_size as usize..(c + 1) * hdr_size as usize];
        let area = &mut copy[4096..];
        let end = area.iter().position(|&b| b == 0).expect("NUL");
        let mut v: serde_json::Value = serde_json::from_slice(&area[..end]).expect("JSON");
        f(&mut v);
        let text = serde_json::to_vec(&v).expect("serialise");
        assert!(text.len() < area.len(), "mutated JSON fits");
        area.fill(0);
        area[..text.len()].copy_from_slice(&text);
        copy[448..512].fill(0);
        let sum = HashAlg::Sha256.digest(&[copy]);
        copy[448..480].copy_from_slice(&sum);
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as LUKS2's JSON stores binary values.
pub fn b64_encode(data: &[u8]) -> String {
    let mut out = String::new();
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The inverse of [`b64_encode`]; `None` for text that is not base64.
pub fn b64_decode(s: &str) -> Option<Vec<u8>> {
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::new();
    for ch in s.bytes().filter(|&b| b != b'=') {
        let v = B64.iter().position(|&x| x == ch)? as u32;
        bits = bits << 6 | v;
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
        }
    }
    Some(out)
}
