//! Creating a new LUKS2 header (cryptsetup's luksFormat for LUKS2).

use serde_json::Map;

use super::{BinHeader, Luks2Header, HDR_SIZES};
use crate::luks::json::{
    Config, DigestJson, Metadata, Segment, SegmentIntegrity, SegmentSize, U64Str,
};
use crate::luks::kdf::{calibrate_pbkdf2, KdfRequest, PBKDF2_ITERATIONS_MIN, SALT_BYTES};
use crate::luks::util::{b64_encode, random_fill};
use crate::luks::{VolumeKey, BIN_HDR_BYTES, DIGEST_TIME_MS};
use crate::{Error, Result, SecretBytes};

/// The header copy size cryptsetup writes by default.
pub const HDR_SIZE_DEFAULT: u64 = 0x4000;

/// What `format` needs (cryptsetup's luksFormat options for LUKS2).
#[derive(Debug, Clone)]
pub struct FormatLuks2 {
    pub cipher: crate::sector::CipherSpec,
    pub key_bytes: usize,
    pub sector_size: crate::sector::SectorSize,
    pub kdf: KdfRequest,
    pub label: String,
    pub subsystem: String,
    pub uuid: String,
    /// Data offset in bytes (0 with a detached header and no --offset).
    pub data_offset: u64,
    /// Header copy size (binary + JSON).
    pub hdr_size: u64,
    /// Bytes reserved for keyslot material after the two header copies.
    pub keyslots_size: u64,
    pub detached: bool,
    /// Authenticated encryption (dm-crypt over dm-integrity): the segment's encryption and
    /// integrity type replace `cipher`, which is then ignored.
    pub integrity: Option<FormatIntegrity>,
}

/// The data segment of an authenticated volume, as cryptsetup 2.6 writes it.
#[derive(Debug, Clone)]
pub struct FormatIntegrity {
    /// The segment's cipher, e.g. "aes-gcm-random" or "aes-xts-random".
    pub encryption: String,
    /// The integrity type: "aead", "hmac(sha256)", "hmac(sha512)".
    pub kind: String,
    /// The HMAC key's size in bytes when it was asked for (cryptsetup 2.8's
    /// `--integrity-key-size`): written to the segment as `integrity.key_size`.
    pub key_size: Option<u32>,
}

impl FormatLuks2 {
    /// cryptsetup's defaults: aes-xts-plain64, 512-bit key, 4096-byte sectors, argon2id,
    /// 16 KiB header copies, 16 MiB data offset.
    pub fn defaults(uuid: String) -> Self {
        FormatLuks2 {
            cipher: crate::sector::CipherSpec::AES_XTS_PLAIN64,
            key_bytes: 64,
            sector_size: crate::sector::SectorSize::S4096,
            kdf: KdfRequest::luks2_default(),
            label: String::new(),
            subsystem: String::new(),
            uuid,
            data_offset: 16 << 20,
            hdr_size: HDR_SIZE_DEFAULT,
            keyslots_size: (16 << 20) - 2 * HDR_SIZE_DEFAULT,
            detached: false,
            integrity: None,
        }
    }
}

/// Creates a new LUKS2 header around `volume_key` (random from the caller, or a user's
/// --volume-key-file), with a pbkdf2 digest, and no keyslot yet.
pub fn format(opts: &FormatLuks2, volume_key: SecretBytes) -> Result<(Luks2Header, VolumeKey)> {
    match &opts.integrity {
        // Checks the cipher, the integrity type and the key length together.
        Some(i) => drop(crate::integrity::TagMode::from_luks2_keyed(
            &i.encryption,
            &i.kind,
            volume_key.len(),
            i.key_size.map(|b| b as usize),
        )?),
        None => opts.cipher.check_key_len(volume_key.len())?,
    }
    if !HDR_SIZES.contains(&opts.hdr_size) {
        return Err(Error::InvalidArgument(format!(
            "header size {}",
            opts.hdr_size
        )));
    }
    let ss = u64::from(opts.sector_size.bytes());
    if opts.data_offset % ss != 0 || opts.data_offset % 512 != 0 {
        return Err(Error::InvalidArgument(format!(
            "data offset {} is not aligned to the {ss}-byte sector size",
            opts.data_offset
        )));
    }
    let mut digest_salt = vec![0u8; SALT_BYTES];
    random_fill(&mut digest_salt)?;
    let hash = opts.kdf.hash;
    let iterations = if opts.kdf.force_iterations.is_some() {
        PBKDF2_ITERATIONS_MIN
    } else {
        calibrate_pbkdf2(hash, DIGEST_TIME_MS, volume_key.len())
    };
    let mut digest = vec![0u8; hash.output_bytes()];
    hash.pbkdf2(volume_key.as_ref(), &digest_salt, iterations, &mut digest);
    let mut segments = std::collections::BTreeMap::new();
    segments.insert(
        "0".to_string(),
        Segment {
            kind: "crypt".into(),
            offset: U64Str(opts.data_offset),
            size: SegmentSize::Dynamic,
            iv_tweak: Some(U64Str(0)),
            encryption: Some(match &opts.integrity {
                Some(i) => i.encryption.clone(),
                None => opts.cipher.to_string(),
            }),
            sector_size: Some(opts.sector_size.bytes()),
            flags: None,
            integrity: opts.integrity.as_ref().map(|i| SegmentIntegrity {
                kind: i.kind.clone(),
                journal_encryption: "none".into(),
                journal_integrity: "none".into(),
                key_size: i.key_size,
                extra: Map::new(),
            }),
            extra: Map::new(),
        },
    );
    let mut digests = std::collections::BTreeMap::new();
    digests.insert(
        "0".to_string(),
        DigestJson {
            kind: "pbkdf2".into(),
            keyslots: vec![],
            segments: vec!["0".into()],
            hash: Some(hash.name().into()),
            iterations: Some(iterations),
            salt: Some(b64_encode(&digest_salt)),
            digest: Some(b64_encode(&digest)),
            extra: Map::new(),
        },
    );
    let meta = Metadata {
        keyslots: Default::default(),
        tokens: Default::default(),
        segments,
        digests,
        config: Config {
            json_size: U64Str(opts.hdr_size - BIN_HDR_BYTES),
            keyslots_size: U64Str(opts.keyslots_size),
            flags: None,
            requirements: None,
            extra: Map::new(),
        },
        extra: Map::new(),
    };
    let mut salt1 = [0u8; 64];
    let mut salt2 = [0u8; 64];
    random_fill(&mut salt1)?;
    random_fill(&mut salt2)?;
    let hdr = Luks2Header {
        bin: BinHeader {
            hdr_size: opts.hdr_size,
            seqid: 0,
            label: opts.label.clone(),
            checksum_alg: "sha256".into(),
            salt: salt1,
            uuid: opts.uuid.clone(),
            subsystem: opts.subsystem.clone(),
            hdr_offset: 0,
        },
        meta,
        salt2,
        warnings: vec![],
        repair: None,
    };
    // Check everything a reader will check before anything is written.
    super::validate(&hdr.meta, hdr.bin.hdr_size)?;
    let vk = hdr.verify_key(None, volume_key)?;
    Ok((hdr, vk))
}
