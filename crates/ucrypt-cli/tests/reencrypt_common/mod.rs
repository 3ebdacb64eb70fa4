//! What the reencryption interop tests (`reencrypt_interop*.rs`) share: the two tools, the
//! kinds of reencryption ([`Kind`]), a volume of each kind ([`Vol`]) with the commands both
//! tools take for it, what a finished one must look like, and where a kill left one.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::kit::cryptsetup::{self as cs, dump, is_luks, CRYPTSETUP, FAST_PBKDF2};
use crate::kit::{ok, run, s, stderr, SplitMix, TempDir};

pub const UCRYPT: &str = env!("CARGO_BIN_EXE_ucrypt");
/// cryptsetup's default LUKS2 data offset.
pub const DATA_OFFSET: u64 = 16 << 20;
/// `--reduce-device-size` of the data-moving encryption: a shift (and data offset) of 16 MiB,
/// the moved segment's hotzone 16 MiB.
pub const REDUCE: &str = "32M";
pub const SHIFT: u64 = 16 << 20;
/// `--reduce-device-size` of the data-moving rotation ([`Relocate`]): the data moves up by
/// 8 MiB, and the volume loses its last 8 MiB.
pub const RELOCATE: &str = "8M";
pub const RELOCATE_SHIFT: u64 = 8 << 20;
pub const SECTORS: &[u32] = &[512, 4096];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    Ucrypt,
    Cryptsetup,
}

pub use Tool::{Cryptsetup, Ucrypt};

impl Tool {
    pub fn prog(self) -> &'static str {
        match self {
            Ucrypt => UCRYPT,
            Cryptsetup => CRYPTSETUP,
        }
    }

    pub fn other(self) -> Tool {
        match self {
            Ucrypt => Cryptsetup,
            Cryptsetup => Ucrypt,
        }
    }

    /// cryptsetup runs a reencryption of a file only when told not to activate it.
    pub fn offline(self) -> &'static [&'static str] {
        match self {
            Ucrypt => &[],
            Cryptsetup => &["--force-offline-reencrypt"],
        }
    }
}

/// What the reencryption does to the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A new key (with options also a new cipher, key size or sector size), the header in front.
    Rotate,
    /// Decryption through a detached header; the data stays in place.
    Decrypt,
    /// Encryption of a plaintext file into a new detached header; the data stays in place.
    Encrypt,
    /// Encryption that moves the data by [`SHIFT`] to make room for the header.
    Shift,
    /// Decryption that moves the data back over the header, which it exports (`--header NEW`).
    Unshift,
    /// A new key, the data moved up by [`RELOCATE_SHIFT`] (`--reduce-device-size` alone): the
    /// volume keeps the first bytes of its plaintext, all but the last shift.
    Relocate,
}

pub use Kind::{Decrypt, Encrypt, Relocate, Rotate, Shift, Unshift};

/// A volume of one case: the data file, its header file if detached, the key file, the
/// plaintext it must read as, and (moving decryption) the file as it was before.
pub struct Vol {
    pub kind: Kind,
    pub img: PathBuf,
    pub hdr: Option<PathBuf>,
    pub key: PathBuf,
    pub plain: Vec<u8>,
    pub before: Vec<u8>,
}

/// Seeded plaintext of `len` bytes.
pub fn plaintext(len: u64, salt: u64) -> Vec<u8> {
    SplitMix(salt).bytes(len as usize)
}

pub fn sparse(p: &Path, len: u64) {
    std::fs::File::create(p)
        .and_then(|f| f.set_len(len))
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
}

impl Kind {
    /// The volume a case starts from, of `mib` MiB: a cryptsetup-formatted LUKS2 file of
    /// `sector`-byte sectors holding known plaintext written through ucrypt (the header in
    /// front, or detached for [`Decrypt`]), or a plaintext file ([`Encrypt`], [`Shift`]: its
    /// last 2 × [`SHIFT`] free, as a filesystem shrunk for `--reduce-device-size`).
    pub fn volume(self, t: &TempDir, mib: u64, sector: u32) -> Vol {
        let key = t.file("key", "rotate-me");
        let salt = mib ^ u64::from(sector) ^ self as u64;
        let (img, hdr) = (t.path("data.img"), t.path("hdr.img"));
        let mut vol = Vol {
            kind: self,
            img,
            hdr: None,
            key,
            plain: Vec::new(),
            before: vec![],
        };
        match self {
            Rotate | Relocate | Unshift | Decrypt => {
                let detached = self == Decrypt;
                sparse(&vol.img, mib << 20);
                let ss = sector.to_string();
                let mut f = vec!["luksFormat", "-q", "--type", "luks2", "--sector-size", &ss];
                if detached {
                    sparse(&hdr, 16 << 20);
                    f.extend(["--header", s(&hdr)]);
                }
                f.extend(FAST_PBKDF2);
                f.extend([s(&vol.img), s(&vol.key)]);
                cs::ok(&f);
                let len = if detached {
                    mib << 20
                } else {
                    (mib << 20) - DATA_OFFSET
                };
                vol.plain = plaintext(len, salt);
                let pf = t.file("plain", &vol.plain);
                let mut i = vec!["import", s(&pf), s(&vol.img), "--key-file", s(&vol.key)];
                if detached {
                    i.extend(["--header", s(&hdr)]);
                }
                ok(UCRYPT, &i);
                std::fs::remove_file(&pf).expect("plain");
                if detached {
                    assert!(
                        std::fs::read(&vol.img).expect("data") != vol.plain,
                        "encrypted"
                    );
                }
                if !matches!(self, Rotate | Relocate) {
                    vol.hdr = Some(if detached {
                        hdr
                    } else {
                        t.path("exported.hdr")
                    });
                }
                if self == Unshift {
                    vol.before = std::fs::read(&vol.img).expect("image");
                }
            }
            Encrypt | Shift => {
                let all = plaintext(mib << 20, salt);
                std::fs::write(&vol.img, &all).expect("data");
                let keep = all.len() - if self == Shift { 2 * SHIFT as usize } else { 0 };
                vol.plain = all[..keep].to_vec();
                vol.hdr = (self == Encrypt).then_some(hdr);
            }
        }
        vol
    }

    /// Options a case's sector size takes: those that make a new header set it.
    pub fn sector_opt(self, ss: &str) -> Vec<&str> {
        match self {
            Encrypt | Shift => vec!["--sector-size", ss],
            _ => vec![],
        }
    }
}

impl Vol {
    /// A copy of the volume in the same directory (its header, if detached and existing, too),
    /// for the other tool to start on.
    pub fn copy(&self, t: &TempDir, tag: &str) -> Vol {
        let img = t.path(&format!("{tag}.img"));
        std::fs::copy(&self.img, &img).expect("copy");
        let hdr = self.hdr.as_ref().map(|h| {
            let to = t.path(&format!("{tag}.hdr"));
            if h.exists() {
                std::fs::copy(h, &to).expect("copy");
            }
            to
        });
        Vol {
            img,
            hdr,
            key: self.key.clone(),
            plain: self.plain.clone(),
            before: self.before.clone(),
            ..*self
        }
    }

    /// Where the LUKS2 header is.
    pub fn meta(&self) -> &Path {
        self.hdr.as_deref().unwrap_or(&self.img)
    }

    /// `--header HDR --key-file KEY IMG`, as every verb takes the volume.
    pub fn tail(&self) -> Vec<&str> {
        let mut a = vec![];
        if let Some(h) = &self.hdr {
            a.extend(["--header", s(h)]);
        }
        a.extend(["--key-file", s(&self.key), s(&self.img)]);
        a
    }

    /// `reencrypt` starting this case's reencryption with `tool`, with `extra` options.
    pub fn reencrypt<'a>(&'a self, tool: Tool, extra: &[&'a str]) -> Vec<&'a str> {
        let mut a = vec!["reencrypt", "-q"];
        a.extend(match self.kind {
            Rotate => &[][..],
            Decrypt | Unshift => &["--decrypt"],
            Encrypt => &["--encrypt"],
            Shift => &["--encrypt", "--reduce-device-size", REDUCE],
            Relocate => &["--reduce-device-size", RELOCATE],
        });
        a.extend(tool.offline());
        a.extend(FAST_PBKDF2);
        a.extend(extra);
        a.extend(self.tail());
        a
    }

    pub fn resume<'a>(&'a self, tool: Tool, extra: &[&'a str]) -> Vec<&'a str> {
        let mut a = vec!["reencrypt", "--resume-only", "-q"];
        a.extend(tool.offline());
        a.extend(extra);
        a.extend(self.tail());
        a
    }

    pub fn repair(&self, tool: Tool) {
        ok(tool.prog(), &[&["repair", "-q"][..], &self.tail()].concat());
    }

    /// ucrypt refuses to resume inside a hotzone, as cryptsetup does, until repaired.
    pub fn resume_refused_until_repair(&self, what: &str) {
        let o = run(
            UCRYPT,
            &[&["reencrypt", "--resume-only"][..], &self.tail()].concat(),
        );
        assert_eq!(o.status.code(), Some(1), "{what}");
        assert!(stderr(&o).contains("Run repair first"), "{what}");
        self.repair(Ucrypt);
    }

    pub fn has_header(&self) -> bool {
        self.meta().exists() && is_luks(self.meta())
    }

    pub fn in_reencryption(&self) -> bool {
        self.has_header() && dump(self.meta()).contains("online-reencrypt")
    }

    pub fn in_hotzone(&self) -> bool {
        dump(self.meta()).contains("in-reencryption")
    }

    pub fn has_keyslot(&self) -> bool {
        dump(self.meta()).contains(": luks2")
    }

    pub fn raw(&self) -> Vec<u8> {
        std::fs::read(&self.img).expect("data")
    }

    /// `ucrypt export` of the volume into `out` in `t`.
    pub fn export(&self, t: &TempDir) -> (Output, PathBuf) {
        let out = t.path("out");
        let _ = std::fs::remove_file(&out);
        let o = run(
            UCRYPT,
            &[&["export"][..], &self.tail(), &[s(&out)]].concat(),
        );
        (o, out)
    }

    pub fn exported(&self, t: &TempDir) -> Vec<u8> {
        let (o, out) = self.export(t);
        assert!(o.status.success(), "export: {}", crate::kit::text(&o));
        std::fs::read(out).expect("export")
    }

    /// Export serves the plaintext and writes nothing to the volume.
    pub fn exports_read_only(&self, t: &TempDir, what: &str) {
        let raw = self.raw();
        assert!(
            self.exported(t) == self.plain,
            "{what}: {} exported",
            self.img.display()
        );
        assert!(self.raw() == raw, "{what}: written");
    }

    pub fn cryptsetup_opens(&self) -> Output {
        cs::run(&[&["open", "--test-passphrase"][..], &self.tail()].concat())
    }

    /// The finished reencryption as cryptsetup reads it, and the plaintext intact.
    pub fn finished(&self, t: &TempDir, what: &str) {
        let d = dump(self.meta());
        assert!(
            !d.contains("reencrypt"),
            "{what}: reencryption left in:\n{d}"
        );
        match self.kind {
            Rotate | Relocate | Encrypt | Shift => {
                let o = self.cryptsetup_opens();
                assert!(
                    o.status.success(),
                    "{what}: cryptsetup open: {}",
                    stderr(&o)
                );
                assert_eq!(d.matches(": luks2").count(), 1, "{what}: one keyslot:\n{d}");
            }
            Decrypt | Unshift => {
                assert!(d.contains("0: linear"), "{what}: {d}");
                assert!(!d.contains(": luks2"), "{what}: keyslots left:\n{d}");
            }
        }
        let raw = self.raw();
        let n = self.plain.len();
        match self.kind {
            Rotate => assert!(self.exported(t) == self.plain, "{what}: plaintext changed"),
            Relocate => {
                let offset = DATA_OFFSET + RELOCATE_SHIFT;
                assert!(
                    d.contains(&format!("offset: {offset} [bytes]")),
                    "{what}:\n{d}"
                );
                let got = self.exported(t);
                assert!(
                    got == self.plain[..n - RELOCATE_SHIFT as usize],
                    "{what}: the plaintext changed ({} bytes read)",
                    got.len()
                );
            }
            Encrypt | Shift => {
                let at = if self.kind == Shift {
                    SHIFT as usize
                } else {
                    0
                };
                assert!(raw[at..at + n] != self.plain[..], "{what}: still plaintext");
                if self.kind == Shift {
                    assert!(
                        d.contains(&format!("offset: {SHIFT} [bytes]")),
                        "{what}:\n{d}"
                    );
                }
                let got = self.exported(t);
                assert_eq!(got.len(), n + at, "{what}: size");
                assert!(got[..n] == self.plain[..], "{what}: the plaintext changed");
            }
            Decrypt => assert!(
                raw == self.plain,
                "{what}: {}",
                differences(&raw, &self.plain)
            ),
            Unshift => {
                assert!(d.contains("offset: 0 [bytes]"), "{what}: {d}");
                assert!(
                    !is_luks(&self.img),
                    "{what}: a LUKS header left on the device"
                );
                assert_eq!(
                    raw.len(),
                    self.before.len(),
                    "{what}: the device changed size"
                );
                assert!(raw[..n] == self.plain[..], "{what}: not the plaintext");
                assert!(
                    raw[n..] != self.before[n..],
                    "{what}: the old ciphertext left past the data"
                );
            }
        }
    }

    /// Whether the data the volume ends as is already there (a decryption killed in its
    /// finalisation).
    pub fn data_plain(&self) -> bool {
        self.raw()[..self.plain.len()] == self.plain[..]
    }
}

/// Where `got` differs from `want`, in runs of 4 KiB blocks (byte offsets), for a failure's
/// message: which hotzones went wrong says which step did.
pub fn differences(got: &[u8], want: &[u8]) -> String {
    const BLOCK: usize = 4096;
    if got.len() != want.len() {
        return format!("{} bytes, not {}", got.len(), want.len());
    }
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (i, (g, w)) in got.chunks(BLOCK).zip(want.chunks(BLOCK)).enumerate() {
        if g != w {
            match runs.last_mut() {
                Some((_, end)) if *end == i * BLOCK => *end += g.len(),
                _ => runs.push((i * BLOCK, i * BLOCK + g.len())),
            }
        }
    }
    let shown: Vec<String> = runs
        .iter()
        .take(20)
        .map(|(a, b)| format!("[{a:#x}, {b:#x})"))
        .collect();
    format!(
        "{} runs of 4 KiB blocks differ: {}",
        runs.len(),
        shown.join(" ")
    )
}

/// The metadata of cryptsetup's JSON, minus what is random (salts, digests, UUIDs,
/// iterations of calibrated digests) and what orders keys.
pub fn metadata(img: &Path) -> String {
    let v: serde_json::Value = serde_json::from_str(&cs::dump_json(img)).expect("json");
    let mut digests: Vec<_> = v["digests"]
        .as_object()
        .expect("digests")
        .iter()
        .map(|(id, d)| (id.clone(), d["keyslots"].clone(), d["segments"].clone()))
        .collect();
    digests.sort_by(|a, b| a.0.cmp(&b.0));
    let digests: Vec<_> = digests.into_iter().map(|(_, k, s)| (k, s)).collect();
    let mut ks = v["keyslots"].clone();
    for k in ks.as_object_mut().expect("keyslots").values_mut() {
        if let Some(kdf) = k.get_mut("kdf") {
            kdf["salt"] = serde_json::Value::Null;
        }
    }
    format!(
        "keyslots {}\nsegments {}\ndigests {digests:?}\nconfig {}",
        sorted(&ks),
        sorted(&v["segments"]),
        sorted(&v["config"])
    )
}

/// `v` with every object's keys in sorted order: the comparison is of content, not of the
/// order each tool wrote the keys in (both keep the order they read).
fn sorted(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            serde_json::Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), sorted(&m[k])))
                    .collect(),
            )
        }
        serde_json::Value::Array(a) => serde_json::Value::Array(a.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

/// The first JSON area of a header file, read without locking while a tool writes it (a torn
/// read gives `None`).
pub fn json_raw(hdr: &Path) -> Option<serde_json::Value> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(hdr).ok()?;
    let mut json = vec![0u8; 12 << 10];
    f.seek(SeekFrom::Start(4096)).ok()?;
    f.read_exact(&mut json).ok()?;
    let end = json.iter().position(|&b| b == 0).unwrap_or(json.len());
    serde_json::from_slice(&json[..end]).ok()
}

pub fn in_reencryption_flag(seg: &serde_json::Value) -> bool {
    seg["flags"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == "in-reencryption"))
}

/// Where a kill left a reencryption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Left {
    /// Nothing to finish: not started (in place: not in reencryption); what the volume must
    /// hold is checked.
    NotStarted,
    /// In reencryption, inside a hotzone or not.
    Mid { hot: bool },
    /// Finished, or not started in a state the finisher runs whole.
    Done,
    /// A decryption killed in its finalisation, once it began wiping the old key's keyslot
    /// areas and before it cleared the requirement: no passphrase opens the header in either
    /// tool, neither resumes it, and the device already holds the plaintext.
    KeyslotsGone,
}

/// A decryption the killed tool left with no keyslot that opens: ucrypt's `--resume-only` or
/// `export` failed (`ucrypt`). cryptsetup must refuse to resume it too, and every byte must
/// already be plaintext.
pub fn killed_in_finalisation(vol: &Vol, ucrypt: &Output, what: &str) {
    let c = cs::run(&vol.resume(Cryptsetup, &[]));
    assert!(
        !c.status.success(),
        "{what}: cryptsetup resumed a decryption ucrypt refused ({})",
        stderr(ucrypt)
    );
    assert!(
        vol.data_plain(),
        "{what}: killed in finalisation, but the data is not all plaintext"
    );
    println!("{what}: killed in the finalisation (its keyslots destroyed): neither tool resumes");
}

pub fn no_key(o: &Output) -> bool {
    let err = stderr(o);
    err.contains("No usable keyslot") || err.contains("No key available")
}

impl Vol {
    /// Checks and names where a kill of `killed` left the reencryption.
    pub fn after_kill(&self, t: &TempDir, killed: Tool, what: &str) -> Left {
        let header = self.has_header();
        let mid = header && self.in_reencryption();
        match self.kind {
            Encrypt | Shift if !header => {
                let raw = self.raw();
                let sh = if self.kind == Shift {
                    SHIFT as usize
                } else {
                    0
                };
                if self.kind == Shift {
                    assert!(
                        raw[sh..self.plain.len()] == self.plain[sh..],
                        "{what}: no header, data moved"
                    );
                    let moved = raw.len() - sh;
                    let first = raw[..sh] == self.plain[..sh] || raw[moved..] == self.plain[..sh];
                    assert!(first, "{what}: no header, first shift lost");
                } else if killed == Ucrypt {
                    assert!(raw == self.plain, "{what}: no header, data touched");
                }
                return Left::NotStarted;
            }
            Encrypt if !mid && killed == Cryptsetup && self.raw() == self.plain => {
                // cryptsetup writes its new header in several commits: killed between them it
                // leaves a header without reencryption metadata over the plaintext.
                return Left::NotStarted;
            }
            Unshift if !mid => {
                if header && dump(self.meta()).contains("0: linear") {
                    return Left::Done;
                }
                let (o, out) = self.export(t);
                if header && o.status.success() {
                    let got = std::fs::read(&out).expect("export");
                    assert!(
                        got == self.plain,
                        "{what}: the volume through the exported header"
                    );
                } else {
                    assert!(
                        self.raw() == self.before,
                        "{what}: no usable exported header, the volume changed"
                    );
                }
                return Left::NotStarted;
            }
            Rotate if !mid => {
                // Not started, finished, or cut between the keyslot's addition and the start.
                assert!(self.exported(t) == self.plain, "{what}: data");
                return Left::NotStarted;
            }
            Relocate if !mid => {
                // Not started (all of the old data), or finished (all but the last shift).
                let got = self.exported(t);
                let kept = self.plain.len() - RELOCATE_SHIFT as usize;
                let left = if got.len() == kept {
                    Left::Done
                } else {
                    Left::NotStarted
                };
                assert!(got == self.plain[..got.len()], "{what}: data");
                assert!(got.len() == kept || got == self.plain, "{what}: data");
                return left;
            }
            _ if !mid => return Left::Done,
            _ => {}
        }
        let hot = self.in_hotzone();
        if matches!(self.kind, Shift | Unshift) {
            assert_eq!(
                ok(UCRYPT, &["dump", s(self.meta())]),
                dump(self.meta()),
                "{what}: dump"
            );
            // Served read-only mid-way, inside a hotzone refused before anything is written
            // (a read-only open does not recover).
            let now = self.raw();
            let (o, out) = self.export(t);
            if self.kind == Unshift && !hot && !o.status.success() && no_key(&o) {
                assert!(
                    !self.cryptsetup_opens().status.success(),
                    "{what}: cryptsetup opens it"
                );
                killed_in_finalisation(self, &o, what);
                assert!(self.raw() == now, "{what}: written");
                return Left::KeyslotsGone;
            }
            if hot {
                assert_ne!(o.status.code(), Some(0), "{what}: export served a hotzone");
                assert!(
                    stderr(&o).contains("Run repair first"),
                    "{what}: {}",
                    stderr(&o)
                );
            } else {
                assert!(o.status.success(), "{what}: export: {}", stderr(&o));
                let got = std::fs::read(&out).expect("exported");
                assert!(
                    got == self.plain,
                    "{what}: exported mid-way is not the plaintext"
                );
            }
            assert!(self.raw() == now, "{what}: written");
        }
        Left::Mid { hot }
    }

    /// `finisher` finishes what a kill left (`left`): repair inside a hotzone, resume, or (a
    /// decryption killed before its start's commit) the whole run. False: killed in a
    /// decryption's finalisation, nothing to finish.
    pub fn finish(&self, finisher: Tool, left: Left, what: &str) -> bool {
        if left == (Left::Mid { hot: true }) {
            match finisher {
                Ucrypt => self.resume_refused_until_repair(what),
                Cryptsetup => self.repair(Cryptsetup),
            }
        }
        if self.in_reencryption() {
            let o = run(finisher.prog(), &self.resume(finisher, &[]));
            let decrypts = matches!(self.kind, Decrypt | Unshift);
            if decrypts
                && finisher == Ucrypt
                && !o.status.success()
                && (!self.has_keyslot() || no_key(&o))
            {
                killed_in_finalisation(self, &o, what);
                return false;
            }
            assert!(
                o.status.success(),
                "{what}: {finisher:?} --resume-only: {}",
                crate::kit::text(&o)
            );
        }
        if self.kind == Decrypt && self.has_keyslot() {
            // Killed before the start's commit: still the encrypted volume.
            ok(finisher.prog(), &self.reencrypt(finisher, &[]));
        }
        true
    }
}
