//! LUKS1: the 592-byte big-endian phdr with 8 keyslots (LUKS1 on-disk format spec 1.2.3).
//!
//! Layout: `magic[6] version:u16 cipher_name[32] cipher_mode[32] hash_spec[32]
//! payload_offset:u32 (sectors) key_bytes:u32 mk_digest[20] mk_digest_salt[32]
//! mk_digest_iterations:u32 uuid[40]`, then 8 × `{ active:u32 iterations:u32 salt[32]
//! key_material_offset:u32 (sectors) stripes:u32 }`.

use super::af::AF_STRIPES;
use super::kdf::{Kdf, KdfRequest, PBKDF2_ITERATIONS_MIN, SALT_BYTES};
use super::keyslot::SlotCrypto;
use super::util::{c_string, put_c_string, random_fill, HashAlg};
use super::{NewKeyslot, VolumeKey, WriteOp, DIGEST_TIME_MS, KEY_BYTES_MAX};
use crate::sector::CipherSpec;
use crate::{Error, Result, SecretBytes};

pub const MAGIC: &[u8; 6] = b"LUKS\xba\xbe";
pub const PHDR_BYTES: usize = 592;
pub const KEYSLOTS: usize = 8;
pub const DIGEST_BYTES: usize = 20;
const ACTIVE: u32 = 0x00AC_71F3;
const DISABLED: u32 = 0x0000_DEAD;
/// Keyslot material starts aligned to 4096 bytes (8 sectors), as cryptsetup lays it out.
const ALIGN_KEYSLOTS_SECTORS: u32 = 8;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Luks1Slot {
    pub active: bool,
    pub iterations: u32,
    pub salt: [u8; 32],
    pub key_material_offset: u32,
    pub stripes: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Luks1Header {
    pub cipher_name: String,
    pub cipher_mode: String,
    pub hash_spec: String,
    pub payload_offset: u32,
    pub key_bytes: u32,
    pub mk_digest: [u8; DIGEST_BYTES],
    pub mk_digest_salt: [u8; 32],
    pub mk_digest_iterations: u32,
    pub uuid: String,
    pub slots: [Luks1Slot; KEYSLOTS],
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(bytes_at(b, at))
}

fn bad(check: &'static str, detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check,
        detail: detail.into(),
    }
}

/// The `N` bytes at `at` of a phdr the caller has checked is long enough.
fn bytes_at<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&b[at..at + N]);
    out
}

impl Luks1Header {
    pub fn parse(b: &[u8]) -> Result<Luks1Header> {
        if b.len() < PHDR_BYTES {
            return Err(bad("truncated", "device too small for a LUKS1 header"));
        }
        if &b[0..6] != MAGIC {
            return Err(Error::NotLuks("no LUKS magic".into()));
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 1 {
            return Err(bad("version", format!("version {version}, expected 1")));
        }
        let cipher_name = c_string(&b[8..40], "cipher_name")?;
        let cipher_mode = c_string(&b[40..72], "cipher_mode")?;
        let hash_spec = c_string(&b[72..104], "hash_spec")?;
        let payload_offset = be32(b, 104);
        let key_bytes = be32(b, 108);
        let mk_digest_iterations = be32(b, 164);
        let uuid = c_string(&b[168..208], "uuid")?;
        // The cipher and hash are parsed where they are used (unlock, the data): a header
        // whose cipher ucrypt cannot run still dumps, as cryptsetup's does.
        let spec_text = format!("{cipher_name}-{cipher_mode}");
        let key_len_ok = match spec_text.parse::<CipherSpec>() {
            Ok(cipher) => cipher.check_key_len(key_bytes as usize).is_ok(),
            Err(_) => true,
        };
        if key_bytes == 0 || key_bytes as usize > KEY_BYTES_MAX || !key_len_ok {
            return Err(bad(
                "key_bytes",
                format!("{key_bytes} bytes for {spec_text}"),
            ));
        }
        if mk_digest_iterations == 0 {
            return Err(bad("mk_digest_iterations", "0"));
        }
        let mut slots = Vec::with_capacity(KEYSLOTS);
        for i in 0..KEYSLOTS {
            let o = 208 + i * 48;
            let state = be32(b, o);
            let active = match state {
                ACTIVE => true,
                DISABLED => false,
                other => {
                    return Err(bad(
                        "keyslot-state",
                        format!("keyslot {i} state {other:#x} is neither active nor disabled"),
                    ))
                }
            };
            let slot = Luks1Slot {
                active,
                iterations: be32(b, o + 4),
                salt: bytes_at(b, o + 8),
                key_material_offset: be32(b, o + 40),
                stripes: be32(b, o + 44),
            };
            if slot.active && slot.iterations == 0 {
                return Err(bad("iterations", format!("keyslot {i} has 0 iterations")));
            }
            slots.push(slot);
        }
        check_keyslot_areas(&slots, key_bytes, payload_offset)?;
        let slots: [Luks1Slot; KEYSLOTS] =
            slots.try_into().map_err(|_| Error::Bug("eight keyslots"))?;
        Ok(Luks1Header {
            cipher_name,
            cipher_mode,
            hash_spec,
            payload_offset,
            key_bytes,
            mk_digest: bytes_at(b, 112),
            mk_digest_salt: bytes_at(b, 132),
            mk_digest_iterations,
            uuid,
            slots,
        })
    }

    /// The data (and keyslot area) cipher: [`Error::UnsupportedCipher`] for one ucrypt cannot
    /// run, which only what uses it reports.
    pub fn cipher(&self) -> Result<CipherSpec> {
        format!("{}-{}", self.cipher_name, self.cipher_mode).parse()
    }

    /// The hash of the keyslots' PBKDF2, the AF and the digest, where it is used.
    pub fn hash(&self) -> Result<HashAlg> {
        HashAlg::from_name(&self.hash_spec)
            .map_err(|_| Error::UnsupportedLuks(format!("LUKS1 hash '{}'", self.hash_spec)))
    }

    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut b = vec![0u8; PHDR_BYTES];
        b[0..6].copy_from_slice(MAGIC);
        b[6..8].copy_from_slice(&1u16.to_be_bytes());
        put_c_string(&mut b[8..40], &self.cipher_name, "cipher name")?;
        put_c_string(&mut b[40..72], &self.cipher_mode, "cipher mode")?;
        put_c_string(&mut b[72..104], &self.hash_spec, "hash")?;
        b[104..108].copy_from_slice(&self.payload_offset.to_be_bytes());
        b[108..112].copy_from_slice(&self.key_bytes.to_be_bytes());
        b[112..132].copy_from_slice(&self.mk_digest);
        b[132..164].copy_from_slice(&self.mk_digest_salt);
        b[164..168].copy_from_slice(&self.mk_digest_iterations.to_be_bytes());
        put_c_string(&mut b[168..208], &self.uuid, "UUID")?;
        for (i, s) in self.slots.iter().enumerate() {
            let o = 208 + i * 48;
            b[o..o + 4].copy_from_slice(&(if s.active { ACTIVE } else { DISABLED }).to_be_bytes());
            b[o + 4..o + 8].copy_from_slice(&s.iterations.to_be_bytes());
            b[o + 8..o + 40].copy_from_slice(&s.salt);
            b[o + 40..o + 44].copy_from_slice(&s.key_material_offset.to_be_bytes());
            b[o + 44..o + 48].copy_from_slice(&s.stripes.to_be_bytes());
        }
        Ok(b)
    }

    pub fn material_bytes(&self) -> u64 {
        super::json::af_area_bytes(self.key_bytes as usize, AF_STRIPES)
    }

    pub fn slot_crypto(&self, i: usize) -> Result<SlotCrypto> {
        let s = &self.slots[i];
        let hash = self.hash()?;
        Ok(SlotCrypto {
            key_bytes: self.key_bytes as usize,
            area_cipher: self.cipher()?,
            area_key_bytes: self.key_bytes as usize,
            kdf: Kdf::Pbkdf2 {
                hash,
                iterations: s.iterations,
                salt: s.salt.to_vec(),
            },
            af_hash: hash,
            stripes: s.stripes,
        })
    }

    /// Active slots to try (all, or the one asked for).
    pub fn unlock_order(&self, slot: Option<u32>) -> Result<Vec<usize>> {
        match slot {
            Some(i) if (i as usize) < KEYSLOTS && self.slots[i as usize].active => {
                Ok(vec![i as usize])
            }
            Some(i) => Err(Error::Keyslot {
                slot: i,
                reason: "keyslot is not active".into(),
            }),
            None => Ok((0..KEYSLOTS).filter(|&i| self.slots[i].active).collect()),
        }
    }

    pub fn verify_key(&self, candidate: SecretBytes) -> Result<VolumeKey> {
        let mut got = [0u8; DIGEST_BYTES];
        self.hash()?.pbkdf2(
            candidate.as_ref(),
            &self.mk_digest_salt,
            self.mk_digest_iterations,
            &mut got,
        );
        let ok = bool::from(subtle::ConstantTimeEq::ct_eq(&got[..], &self.mk_digest[..]));
        // The candidate was PBKDF2's password: its copies in the frames beneath go.
        crate::secret::scrub_stack();
        if ok {
            Ok(VolumeKey::new_verified(candidate, 0, true))
        } else {
            Err(Error::WrongPassphrase)
        }
    }

    /// Writes a new passphrase into a free slot: material, then the phdr.
    pub fn add_keyslot(&mut self, new: NewKeyslot<'_>) -> Result<(u32, Vec<WriteOp>)> {
        let i = match new.slot {
            Some(i) if i as usize >= KEYSLOTS => {
                return Err(Error::InvalidArgument(format!(
                    "keyslot {i} out of range (0..8)"
                )))
            }
            Some(i) if self.slots[i as usize].active => {
                return Err(Error::Keyslot {
                    slot: i,
                    reason: "keyslot is already in use".into(),
                })
            }
            Some(i) => i as usize,
            None => (0..KEYSLOTS)
                .find(|&i| !self.slots[i].active)
                .ok_or_else(|| Error::InvalidArgument("all keyslots are full".into()))?,
        };
        let req = KdfRequest {
            kind: "pbkdf2".into(),
            hash: self.hash()?,
            ..new.kdf.clone()
        };
        let Kdf::Pbkdf2 {
            iterations, salt, ..
        } = req.resolve(self.key_bytes as usize)?
        else {
            return Err(Error::Bug("pbkdf2 request resolved to another KDF"));
        };
        let s = &mut self.slots[i];
        s.active = true;
        s.iterations = iterations;
        s.salt.copy_from_slice(&salt);
        s.stripes = AF_STRIPES;
        let material = self.slot_crypto(i)?.seal(new.passphrase, new.vk.bytes())?;
        let offset = u64::from(self.slots[i].key_material_offset) * 512;
        Ok((
            i as u32,
            vec![
                WriteOp::Write {
                    offset,
                    data: material,
                },
                WriteOp::Sync,
                WriteOp::Write {
                    offset: 0,
                    data: self.encode()?,
                },
                WriteOp::Sync,
            ],
        ))
    }

    pub fn remove_keyslot(&mut self, i: u32) -> Result<Vec<WriteOp>> {
        if i as usize >= KEYSLOTS || !self.slots[i as usize].active {
            return Err(Error::Keyslot {
                slot: i,
                reason: "keyslot is not active".into(),
            });
        }
        let s = &mut self.slots[i as usize];
        s.active = false;
        s.iterations = 0;
        s.salt = [0u8; 32];
        s.stripes = AF_STRIPES;
        let mut noise = vec![0u8; self.material_bytes() as usize];
        random_fill(&mut noise)?;
        Ok(vec![
            WriteOp::Write {
                offset: 0,
                data: self.encode()?,
            },
            WriteOp::Sync,
            WriteOp::Write {
                offset: u64::from(self.slots[i as usize].key_material_offset) * 512,
                data: noise,
            },
            WriteOp::Sync,
        ])
    }
}

/// cryptsetup's check of the keyslot descriptors, enabled or not (a disabled one is where
/// the next passphrase's material goes): 4000 stripes, material after the phdr and wholly
/// before the payload (when the payload is on this device), and no two areas overlapping.
/// Any failure is "LUKS keyslot N is invalid." naming the keyslot cryptsetup names.
fn check_keyslot_areas(slots: &[Luks1Slot], key_bytes: u32, payload_offset: u32) -> Result<()> {
    let material_sectors = super::json::af_area_bytes(key_bytes as usize, AF_STRIPES) / 512;
    let invalid =
        |check, i: usize, why: String| bad(check, format!("LUKS keyslot {i} is invalid ({why})."));
    for (i, s) in slots.iter().enumerate() {
        if s.stripes != AF_STRIPES {
            return Err(invalid(
                "stripes",
                i,
                format!("{} stripes, must be {AF_STRIPES}", s.stripes),
            ));
        }
        let start = u64::from(s.key_material_offset);
        let end = start + material_sectors;
        if start * 512 < PHDR_BYTES as u64 {
            return Err(invalid(
                "keyslot-area",
                i,
                format!("its material at sector {start} overlaps the header"),
            ));
        }
        if payload_offset != 0 && end > u64::from(payload_offset) {
            return Err(invalid(
                "keyslot-area",
                i,
                format!(
                    "its material [{start}, {end}) sectors reaches past the payload at {payload_offset}"
                ),
            ));
        }
    }
    // By material offset (a stable sort, as cryptsetup's): each area ends before the next
    // begins; cryptsetup names the earlier one.
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&i| slots[i].key_material_offset);
    for w in order.windows(2) {
        let (prev, next) = (w[0], w[1]);
        if u64::from(slots[next].key_material_offset)
            < u64::from(slots[prev].key_material_offset) + material_sectors
        {
            return Err(invalid(
                "keyslot-area",
                prev,
                format!("its material overlaps keyslot {next}'s"),
            ));
        }
    }
    Ok(())
}

/// Keyslot material stride and the end of the keyslot areas, in 512-byte sectors, for a
/// volume key of `key_bytes` (cryptsetup's layout: areas aligned to 4 KiB).
fn keyslot_layout(key_bytes: usize) -> (u32, u32) {
    let material_sectors = super::json::af_area_bytes(key_bytes, AF_STRIPES) / 512;
    let stride =
        (material_sectors as u32).div_ceil(ALIGN_KEYSLOTS_SECTORS) * ALIGN_KEYSLOTS_SECTORS;
    (stride, ALIGN_KEYSLOTS_SECTORS + KEYSLOTS as u32 * stride)
}

/// Where cryptsetup puts the payload by default: after the keyslots, aligned to 1 MiB (2048
/// sectors; 4096 for a 512-bit key).
pub fn default_payload_sectors(key_bytes: usize) -> u32 {
    keyslots_end_sectors(key_bytes).div_ceil(2048) * 2048
}

/// Where the keyslot areas of a new header end, in 512-byte sectors: the payload goes at or
/// after this, aligned as asked.
pub fn keyslots_end_sectors(key_bytes: usize) -> u32 {
    keyslot_layout(key_bytes).1
}

/// Creates a LUKS1 header (cryptsetup's layout: slots 4096-aligned from sector 8, payload
/// aligned to 1 MiB unless `payload_offset_sectors` is given; 0 with a detached header).
pub fn format(
    cipher: CipherSpec,
    hash: HashAlg,
    uuid: String,
    volume_key: SecretBytes,
    kdf: &KdfRequest,
    payload_offset_sectors: Option<u32>,
) -> Result<(Luks1Header, VolumeKey)> {
    cipher.check_key_len(volume_key.len())?;
    let key_bytes = volume_key.len() as u32;
    let (stride, slots_end) = keyslot_layout(volume_key.len());
    let payload_offset = match payload_offset_sectors {
        Some(p) => p,
        None => default_payload_sectors(volume_key.len()),
    };
    if payload_offset != 0 && payload_offset < slots_end {
        return Err(Error::InvalidArgument(format!(
            "LUKS1 payload offset {payload_offset} sectors is inside the keyslots (end at {slots_end})"
        )));
    }
    let mut mk_digest_salt = [0u8; 32];
    random_fill(&mut mk_digest_salt)?;
    let mk_digest_iterations = if kdf.force_iterations.is_some() {
        PBKDF2_ITERATIONS_MIN
    } else {
        super::kdf::calibrate_pbkdf2(hash, DIGEST_TIME_MS, DIGEST_BYTES)
    };
    let mut mk_digest = [0u8; DIGEST_BYTES];
    hash.pbkdf2(
        volume_key.as_ref(),
        &mk_digest_salt,
        mk_digest_iterations,
        &mut mk_digest,
    );
    let (name, mode) = cipher.luks1_name_mode();
    let slots = std::array::from_fn(|i| Luks1Slot {
        active: false,
        iterations: 0,
        salt: [0u8; SALT_BYTES],
        key_material_offset: ALIGN_KEYSLOTS_SECTORS + i as u32 * stride,
        stripes: AF_STRIPES,
    });
    let hdr = Luks1Header {
        cipher_name: name.into(),
        cipher_mode: mode,
        hash_spec: hash.name().into(),
        payload_offset,
        key_bytes,
        mk_digest,
        mk_digest_salt,
        mk_digest_iterations,
        uuid,
        slots,
    };
    // Round trip through the parser: what we write is what a reader accepts.
    let check = Luks1Header::parse(&hdr.encode()?)?;
    if check != hdr {
        return Err(Error::Bug("LUKS1 header does not round-trip"));
    }
    let vk = hdr.verify_key(volume_key)?;
    Ok((hdr, vk))
}
