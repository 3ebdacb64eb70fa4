//! LUKS2 keyslots: the order a passphrase tries them in, the digest check that turns a
//! candidate into a [`VolumeKey`], and adding, removing and changing passphrase keyslots as
//! write plans.

use serde_json::Map;

use super::digest::{digest_matches, free_id, make_digest};
use super::{bad, Luks2Header};
use crate::luks::af::AF_STRIPES;
use crate::luks::json::{
    af_area_bytes, kdf_to_json, round_up, AfJson, Area, Keyslot, KeyslotParams, U64Str,
};
use crate::luks::json::{KeyslotKind, SegmentKind};
use crate::luks::kdf::{Kdf, KdfRequest};
use crate::luks::keyslot::SlotCrypto;
use crate::luks::util::random_fill;
use crate::luks::{KeyUse, NewKeyslot, VolumeKey, WriteOp, KEYSLOTS_MAX};
use crate::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use crate::{Error, Result, SecretBytes};

/// The key size of cryptsetup's default keyslot cipher (aes-xts-plain64, 512 bits), used for
/// the keyslot areas of an authenticated volume.
const KEYSLOT_DEFAULT_KEY_BYTES: usize = 64;

/// How a keyslot's area is encrypted: a cipher and its key size, both recorded in the
/// keyslot's `area` object. One chosen by the user (cryptsetup's `--keyslot-cipher` and
/// `--keyslot-key-size`) is built by [`Luks2Header::keyslot_area`], which checks it against
/// the header as cryptsetup does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyslotArea {
    cipher: CipherSpec,
    key_bytes: usize,
}

impl KeyslotArea {
    /// An area encryption the library picked itself (a default, or an existing keyslot's).
    pub(crate) fn known(cipher: CipherSpec, key_bytes: usize) -> KeyslotArea {
        KeyslotArea { cipher, key_bytes }
    }

    pub fn cipher(&self) -> CipherSpec {
        self.cipher
    }

    pub fn key_bytes(&self) -> usize {
        self.key_bytes
    }
}

impl Luks2Header {
    /// Keyslots usable with a passphrase for `key_use`, in the order cryptsetup tries them:
    /// high priority first, then normal; priority 0 ("ignore") only when asked for by number.
    /// For the data, a keyslot whose digest is assigned to no segment (an unbound key) is
    /// skipped, and named by number it is [`Error::NoUsableKeyslot`], as cryptsetup's
    /// keyslot-for-segment check has it.
    pub fn unlock_order(&self, slot: Option<u32>, key_use: KeyUse) -> Result<Vec<KeyslotParams>> {
        let bound = |id: &str| {
            key_use == KeyUse::AnySegment
                || self
                    .meta
                    .digest_for_keyslot(id)
                    .is_some_and(|(_, d)| !d.segments.is_empty())
        };
        if let Some(id) = slot {
            let params = self.meta.keyslot_params(&id.to_string())?;
            if !bound(&id.to_string()) {
                return Err(Error::NoUsableKeyslot);
            }
            return Ok(vec![params]);
        }
        let reencrypt_final = crate::luks::reencrypt::ReencryptState::from_metadata(&self.meta)
            .ok()
            .flatten()
            .and_then(|st| crate::luks::reencrypt::digest_of_segment(&self.meta, st.backup_final))
            .map(|d| d.to_string());
        let mut v: Vec<KeyslotParams> = self
            .meta
            .keyslots
            .iter()
            .filter(|(id, k)| k.kind == KeyslotKind::Luks2 && bound(id))
            .filter_map(|(id, _)| self.meta.keyslot_params(id).ok())
            .filter(|p| p.priority > 0)
            .filter(|p| match &reencrypt_final {
                // In reencryption cryptsetup unlocks for its default segment, the
                // backup-final one: only keyslots of the new key's digest are tried.
                Some(d) => self
                    .meta
                    .digest_for_keyslot(&p.id.to_string())
                    .is_some_and(|(id, _)| id == d),
                None => true,
            })
            .collect();
        v.sort_by_key(|p| (std::cmp::Reverse(p.priority), p.id));
        Ok(v)
    }

    /// The error cryptsetup gives when no keyslot of [`Self::unlock_order`] (for the data,
    /// none named) took the passphrase: it walks the preferred keyslots, then the normal ones,
    /// and answers with what the last keyslot walked said: a wrong passphrase, or, for a
    /// keyslot of no data segment, "no usable keyslot" (exit 1, not 2); a wrong passphrase
    /// on a preferred keyslot wins over an unusable normal one.
    pub(crate) fn data_unlock_failure(&self) -> Error {
        let bound = |id: &str| {
            self.meta
                .digest_for_keyslot(id)
                .is_some_and(|(_, d)| !d.segments.is_empty())
        };
        let mut ids: Vec<(u32, &str, u32)> = self
            .meta
            .keyslots
            .iter()
            .filter_map(|(id, k)| Some((id.parse().ok()?, id.as_str(), k.priority.unwrap_or(1))))
            .collect();
        ids.sort_unstable();
        // Whether the last keyslot of this priority was a wrong passphrase (true) or
        // unusable, or there was none (false).
        let last_wrong = |priority: u32| {
            ids.iter()
                .rfind(|(_, _, p)| *p == priority)
                .is_some_and(|(_, id, _)| bound(id))
        };
        if last_wrong(2) || last_wrong(1) {
            Error::WrongPassphrase
        } else {
            Error::NoUsableKeyslot
        }
    }

    pub fn slot_crypto(p: &KeyslotParams) -> SlotCrypto {
        SlotCrypto {
            key_bytes: p.key_bytes,
            area_cipher: p.area_cipher,
            area_key_bytes: p.area_key_bytes,
            kdf: p.kdf.clone(),
            af_hash: p.af_hash,
            stripes: p.stripes,
        }
    }

    /// Checks a candidate key against the digest of `keyslot`; the only way to get a
    /// [`VolumeKey`] for this header.
    pub fn verify_key(&self, keyslot: Option<u32>, candidate: SecretBytes) -> Result<VolumeKey> {
        let digest = match keyslot {
            Some(id) => self.meta.digest_for_keyslot(&id.to_string()),
            None => self
                .meta
                .digests
                .iter()
                .find(|(_, d)| !d.segments.is_empty()),
        };
        let (id, d) = digest.ok_or(Error::WrongPassphrase)?;
        let matches = digest_matches(id, d, candidate.as_ref());
        // The candidate was PBKDF2's password: its copies in the frames beneath go.
        crate::secret::scrub_stack();
        if matches? {
            let bound = !d.segments.is_empty();
            Ok(VolumeKey::new_verified(
                candidate,
                id.parse().unwrap_or(0),
                bound,
            ))
        } else {
            Err(Error::WrongPassphrase)
        }
    }

    /// Checks the reencryption digest (bound to the `reencrypt` keyslot) against the header's
    /// reencryption metadata and the volume keys: `Ok(())` when they match, a
    /// [`Error::BadHeader`] ("reencrypt-digest") when not. `None` for a key the layout does
    /// not use (encryption has no old key, decryption no new one).
    pub fn verify_reencrypt_digest(
        &self,
        old: Option<&VolumeKey>,
        new: Option<&VolumeKey>,
    ) -> Result<()> {
        use crate::luks::reencrypt::{verification_data, ReencryptState};
        let st = ReencryptState::from_metadata(&self.meta)?
            .ok_or_else(|| bad("reencrypt-digest", "the header is not in reencryption"))?;
        let data = verification_data(
            &self.meta,
            &st,
            old.map(VolumeKey::bytes),
            new.map(VolumeKey::bytes),
        )?;
        let (id, d) = self
            .meta
            .digest_for_keyslot(&st.keyslot.id.to_string())
            .ok_or_else(|| bad("reencrypt-digest", "the reencrypt keyslot has no digest"))?;
        let matches = digest_matches(id, d, data.as_ref());
        crate::secret::scrub_stack();
        if matches? {
            Ok(())
        } else {
            Err(bad(
                "reencrypt-digest",
                "reencryption metadata is invalid (its digest does not match)",
            ))
        }
    }

    /// `cipher` with a `key_bytes` key as the area encryption of new keyslots, checked as
    /// cryptsetup's `crypt_keyslot_set_encryption` checks it: not the null cipher, not on an
    /// authenticated volume (its keyslots take the default keyslot cipher), and a cipher and
    /// key size a keyslot area can be encrypted with.
    pub fn keyslot_area(&self, cipher: CipherSpec, key_bytes: usize) -> Result<KeyslotArea> {
        let refuse = |why: &str| {
            Err(Error::InvalidArgument(format!(
                "keyslot cipher {cipher} with a {}-bit key: {why}",
                key_bytes * 8
            )))
        };
        if cipher == CipherSpec::NULL {
            return refuse("the null cipher cannot encrypt a keyslot");
        }
        let authenticated = self
            .meta
            .segments
            .values()
            .any(|s| s.kind == SegmentKind::Crypt && s.integrity.is_some());
        if authenticated {
            return refuse("an authenticated volume's keyslots take the default keyslot cipher");
        }
        if key_bytes == 0 || key_bytes > crate::luks::KEY_BYTES_MAX {
            return refuse("no such key size");
        }
        cipher.check_key_len(key_bytes)?;
        // The area is encrypted in 512-byte sectors as any sector is: a cipher the sector
        // layer cannot set up (a key layout it refuses) cannot encrypt it either. The key is a
        // placeholder whose halves differ, as XTS requires.
        let probe: Vec<u8> = (0..key_bytes).map(|i| i as u8).collect();
        SectorCipher::new(cipher, &probe, Geometry::new(SectorSize::S512))?;
        Ok(KeyslotArea { cipher, key_bytes })
    }

    /// First gap in the keyslots area that holds `len` bytes (4096-aligned).
    fn find_area(&self, len: u64) -> Result<u64> {
        let start = 2 * self.bin.hdr_size;
        let end = start + self.meta.config.keyslots_size.0;
        let mut used: Vec<(u64, u64)> = self
            .meta
            .keyslots
            .values()
            .filter_map(|k| k.area.as_ref().map(|a| (a.offset.0, a.offset.0 + a.size.0)))
            .collect();
        used.sort();
        let mut at = start;
        for (s, e) in used {
            if at + len <= s {
                break;
            }
            at = at.max(round_up(e, 4096).unwrap_or(u64::MAX));
        }
        if at.checked_add(len).is_some_and(|e| e <= end) {
            Ok(at)
        } else {
            Err(Error::InvalidArgument(
                "no space for a new keyslot in the LUKS2 keyslots area".into(),
            ))
        }
    }

    /// Adds a passphrase keyslot for `vk`. Returns the writes: key material first, then the
    /// header update, so a crash never leaves a header pointing at missing material.
    pub fn add_keyslot(
        &mut self,
        new: NewKeyslot<'_>,
        priority: Option<u32>,
    ) -> Result<(u32, Vec<WriteOp>)> {
        self.add_keyslot_with_area(new, priority, None)
    }

    /// [`Luks2Header::add_keyslot`] with the keyslot area's cipher and key size given
    /// (`area`), instead of the segment's cipher and `vk`'s size: a reencryption that changes
    /// the cipher or key size keeps the old segment's for the new keyslot's area, as
    /// cryptsetup does (it adds the keyslot before the new segment exists).
    pub fn add_keyslot_with_area(
        &mut self,
        new: NewKeyslot<'_>,
        priority: Option<u32>,
        area: Option<KeyslotArea>,
    ) -> Result<(u32, Vec<WriteOp>)> {
        let NewKeyslot {
            vk,
            passphrase,
            kdf,
            slot,
        } = new;
        let used = self.meta.used_keyslots();
        let id = match slot {
            Some(id) if id >= KEYSLOTS_MAX => {
                return Err(Error::InvalidArgument(format!(
                    "keyslot {id} is out of range (0..{KEYSLOTS_MAX})"
                )))
            }
            Some(id) if used.contains(&id) => {
                return Err(Error::Keyslot {
                    slot: id,
                    reason: "keyslot is already in use".into(),
                })
            }
            Some(id) => id,
            None => (0..KEYSLOTS_MAX)
                .find(|i| !used.contains(i))
                .ok_or_else(|| Error::InvalidArgument("all keyslots are full".into()))?,
        };
        let key_bytes = vk.len();
        // cryptsetup encrypts keyslot areas with the segment's cipher, except when that cipher
        // cannot encrypt a keyslot area (an authenticated one, with random IVs): then with its
        // default keyslot cipher.
        let authenticated = self
            .meta
            .segments
            .values()
            .any(|s| s.kind == SegmentKind::Crypt && s.integrity.is_some());
        let (area_cipher, area_key_bytes) = if let Some(a) = area {
            (a.cipher, a.key_bytes)
        } else if authenticated {
            (CipherSpec::AES_XTS_PLAIN64, KEYSLOT_DEFAULT_KEY_BYTES)
        } else {
            (self.meta.crypt_segment()?.cipher, key_bytes)
        };
        let stripes = AF_STRIPES;
        let area_len = round_up(af_area_bytes(key_bytes, stripes), 4096)
            .ok_or(Error::Bug("area length overflow"))?;
        let offset = self.find_area(area_len)?;
        let kdf_params = kdf.resolve(key_bytes)?;
        let crypto = SlotCrypto {
            key_bytes,
            area_cipher,
            area_key_bytes,
            kdf: kdf_params.clone(),
            af_hash: kdf.hash,
            stripes,
        };
        let material = crypto.seal(passphrase, vk.bytes())?;
        let ks = Keyslot {
            kind: "luks2".into(),
            key_size: key_bytes as u32,
            af: Some(AfJson {
                kind: "luks1".into(),
                stripes,
                hash: kdf.hash.name().into(),
                extra: Map::new(),
            }),
            area: Some(Area {
                kind: "raw".into(),
                offset: U64Str(offset),
                size: U64Str(area_len),
                encryption: Some(area_cipher.to_string()),
                key_size: Some(area_key_bytes as u32),
                extra: Map::new(),
            }),
            kdf: Some(kdf_to_json(&kdf_params)),
            priority: priority.filter(|&p| p != 1),
            extra: Map::new(),
        };
        let key = id.to_string();
        self.meta.keyslots.insert(key.clone(), ks);
        let did = vk.digest_id().to_string();
        let d = self
            .meta
            .digests
            .get_mut(&did)
            .ok_or(Error::Bug("volume key digest vanished"))?;
        if !d.keyslots.contains(&key) {
            d.keyslots.push(key);
        }
        let mut ops = vec![
            WriteOp::Write {
                offset,
                data: material,
            },
            WriteOp::Sync,
        ];
        ops.extend(self.commit()?);
        Ok((id, ops))
    }

    /// Adds a keyslot holding `key`, a key no segment uses (cryptsetup's `luksAddKey
    /// --unbound`): a new digest of `key` assigned to no segment, and the keyslot assigned to
    /// it. Its area is encrypted as cryptsetup encrypts a new keyslot's by default (the data
    /// segment's cipher and volume key size, or aes-xts-plain64 with a 512-bit key where the
    /// segment's cipher cannot encrypt a keyslot), or with `area`. Returns the keyslot id and
    /// the write plan.
    pub fn add_unbound_keyslot(
        &mut self,
        key: SecretBytes,
        passphrase: &[u8],
        kdf: &KdfRequest,
        slot: Option<u32>,
        area: Option<KeyslotArea>,
    ) -> Result<(u32, Vec<WriteOp>)> {
        if key.is_empty() || key.len() > crate::luks::KEY_BYTES_MAX {
            return Err(Error::InvalidArgument(format!(
                "an unbound key of {} bytes (1 to {} bytes)",
                key.len(),
                crate::luks::KEY_BYTES_MAX
            )));
        }
        let area = match area {
            Some(a) => a,
            None => {
                let (c, n) = self.keyslot_area_default()?;
                KeyslotArea::known(c, n)
            }
        };
        let did = free_id(self.meta.digests.keys())?;
        // The keyslot is added to the digest by `add_keyslot_with_area`.
        self.meta.digests.insert(
            did.to_string(),
            make_digest(kdf, key.as_ref(), vec![], vec![])?,
        );
        let vk = VolumeKey::new_verified(key, did, false);
        let r = self.add_keyslot_with_area(
            NewKeyslot {
                vk: &vk,
                passphrase,
                kdf,
                slot,
            },
            None,
            Some(area),
        );
        if r.is_err() {
            self.meta.digests.remove(&did.to_string());
        }
        r
    }

    /// The cipher and key size cryptsetup gives a new keyslot's area by default: the data
    /// segment's cipher with the volume key's size, unless that cipher cannot encrypt a
    /// keyslot (null, or authenticated with random IVs) or no keyslot says the key's size; then
    /// aes-xts-plain64 with a 512-bit key.
    fn keyslot_area_default(&self) -> Result<(CipherSpec, usize)> {
        let fallback = (CipherSpec::AES_XTS_PLAIN64, KEYSLOT_DEFAULT_KEY_BYTES);
        let Ok(seg) = self.meta.crypt_segment() else {
            return Ok(fallback);
        };
        let authenticated = self
            .meta
            .segments
            .values()
            .any(|s| s.kind == SegmentKind::Crypt && s.integrity.is_some());
        if authenticated || seg.cipher == CipherSpec::NULL {
            return Ok(fallback);
        }
        Ok(self
            .volume_key_bytes()
            .map_or(fallback, |n| (seg.cipher, n)))
    }

    /// The volume key's size: the key size of the first keyslot of the data segment's
    /// digest (cryptsetup's rule), if there is one.
    pub fn volume_key_bytes(&self) -> Option<usize> {
        self.meta
            .digests
            .values()
            .find(|d| !d.segments.is_empty())
            .and_then(|d| d.keyslots.first())
            .and_then(|id| self.meta.keyslots.get(id))
            .map(|k| k.key_size as usize)
            .filter(|&n| n > 0)
    }

    /// Removes keyslot `id`: header first, then the area is overwritten with random bytes.
    pub fn remove_keyslot(&mut self, id: u32) -> Result<Vec<WriteOp>> {
        let key = id.to_string();
        let ks = self
            .meta
            .keyslots
            .remove(&key)
            .ok_or_else(|| Error::Keyslot {
                slot: id,
                reason: "keyslot is not in use".into(),
            })?;
        for d in self.meta.digests.values_mut() {
            d.keyslots.retain(|k| k != &key);
        }
        // A digest left with neither keyslot nor segment (an unbound key's) goes, as
        // cryptsetup erases unused digests at every header write.
        self.meta
            .digests
            .retain(|_, d| !(d.keyslots.is_empty() && d.segments.is_empty()));
        for t in self.meta.tokens.values_mut() {
            if let Some(serde_json::Value::Array(a)) = t.get_mut("keyslots") {
                a.retain(|v| v.as_str() != Some(&key));
            }
        }
        let mut ops = self.commit()?;
        if let Some(a) = ks.area {
            ops.extend(wipe_area(&a)?);
        }
        Ok(ops)
    }

    /// Replaces the passphrase of keyslot `id`, keeping its number (as cryptsetup does for
    /// LUKS2): the new material goes to a fresh area, one header commit swaps the keyslot,
    /// then the old area is wiped. A crash leaves the old or the new passphrase working.
    /// `area`: the new area's encryption; `None`: the default a new keyslot gets.
    pub fn change_keyslot(
        &mut self,
        id: u32,
        vk: &VolumeKey,
        passphrase: &[u8],
        kdf: &KdfRequest,
        area: Option<KeyslotArea>,
    ) -> Result<(u32, Vec<WriteOp>)> {
        let key = id.to_string();
        let old = self
            .meta
            .keyslots
            .get(&key)
            .cloned()
            .ok_or(Error::Keyslot {
                slot: id,
                reason: "keyslot is not in use".into(),
            })?;
        let priority = old.priority;
        // Build the new keyslot under a free id, then move it to `id` in the same commit.
        let tmp = (0..KEYSLOTS_MAX)
            .find(|i| !self.meta.used_keyslots().contains(i))
            .ok_or_else(|| Error::InvalidArgument("all keyslots are full".into()))?;
        let saved = self.clone();
        // An unbound key's size says nothing of the area's cipher: the area gets cryptsetup's
        // default, as a new unbound keyslot's does.
        let area = match area {
            Some(a) => Some(a),
            None if vk.is_bound() => None,
            None => {
                let (c, n) = self.keyslot_area_default()?;
                Some(KeyslotArea::known(c, n))
            }
        };
        let (_, mut ops) = self.add_keyslot_with_area(
            NewKeyslot {
                vk,
                passphrase,
                kdf,
                slot: Some(tmp),
            },
            priority,
            area,
        )?;
        // Drop the header writes add_keyslot planned; keep its material write.
        ops.truncate(2);
        let mut ks = self
            .meta
            .keyslots
            .remove(&tmp.to_string())
            .ok_or(Error::Bug("new keyslot vanished"))?;
        ks.priority = priority;
        self.meta.keyslots.insert(key.clone(), ks);
        for d in self.meta.digests.values_mut() {
            d.keyslots.retain(|k| k != &tmp.to_string());
        }
        self.bin.seqid = saved.bin.seqid;
        ops.extend(self.commit()?);
        if let Some(a) = old.area {
            ops.extend(wipe_area(&a)?);
        }
        Ok((id, ops))
    }
}

/// Used by tests and the fuzz entry: a keyslot's typed KDF.
pub fn keyslot_kdf(hdr: &Luks2Header, id: u32) -> Result<Kdf> {
    Ok(hdr.meta.keyslot_params(&id.to_string())?.kdf)
}

/// Writes that overwrite a retired keyslot's area with random bytes, then sync: its key
/// material must not survive on the disk.
fn wipe_area(a: &Area) -> Result<Vec<WriteOp>> {
    let mut noise = vec![0u8; a.size.0 as usize];
    random_fill(&mut noise)?;
    Ok(vec![
        WriteOp::Write {
            offset: a.offset.0,
            data: noise,
        },
        WriteOp::Sync,
    ])
}
