//! The one error type of the `ucrypt` library. Every variant names what failed in words a user
//! can act on; none ever carries secret material.

use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- caller input (CLI strings, API arguments) ----
    #[error("unsupported cipher spec '{spec}': {reason}; supported: {supported}")]
    UnsupportedCipher {
        spec: String,
        reason: String,
        supported: &'static str,
    },

    #[error("invalid key size for {spec}: {bits} bits; expected {expected}")]
    KeySize {
        spec: String,
        bits: usize,
        expected: &'static str,
    },

    #[error("invalid sector size {0}: must be 512, 1024, 2048 or 4096 bytes")]
    SectorSize(u64),

    #[error("buffer of {len} bytes is not a whole number of {sector_bytes}-byte sectors")]
    NotSectorMultiple { len: usize, sector_bytes: u32 },

    #[error("request at offset {offset} of {len} bytes is outside the volume ({size} bytes)")]
    OutOfRange { offset: u64, len: u64, size: u64 },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("volume is read-only: {0}")]
    ReadOnly(String),

    // ---- the backing store ----
    #[error("{context}: {source}")]
    Io { context: String, source: io::Error },

    // ---- bad data from disk (LUKS) ----
    #[error("not a LUKS device: {0}")]
    NotLuks(String),

    #[error("LUKS header check '{check}' failed: {detail}")]
    BadHeader { check: &'static str, detail: String },

    /// One LUKS2 header copy needs recovery and the device also carries another format's
    /// signature: the surviving copy may be a stale leftover of a reused device, so it is
    /// not used until `repair` (cryptsetup's rule and words).
    #[error("Device contains ambiguous signatures ({0} and LUKS2), cannot auto-recover LUKS2. Please run \"ucrypt repair\" for recovery.")]
    AmbiguousSignatures(&'static str),

    #[error("No key available with this passphrase.")]
    WrongPassphrase,

    /// A passphrase asked for twice (to be sure of a new one) came back different
    /// (cryptsetup's words; exit 2, as a wrong passphrase).
    #[error("Passphrases do not match.")]
    PassphraseMismatch,

    /// A volume key given as such (cryptsetup's `--volume-key-file`) that the header's digest
    /// does not accept: cryptsetup's words, and its exit code of a wrong key.
    #[error("Volume key does not match the volume.")]
    VolumeKeyMismatch,

    #[error("No usable keyslot is available.")]
    NoUsableKeyslot,

    /// The LUKS2 header names mandatory requirements ucrypt does not implement: it may be
    /// read (dump, header backup, a passphrase test) but neither written nor activated
    /// (cryptsetup's words, exit 1).
    #[error("Unmet LUKS2 requirements detected. (unknown to ucrypt: {})", .0.join(", "))]
    UnmetRequirements(Vec<String>),

    /// The header carries an unfinished reencryption (cryptsetup's words for a verb that
    /// cannot run on it).
    #[error("Operation incompatible with device marked for LUKS2 reencryption. Aborting.")]
    InReencryption,

    /// The reencryption metadata was committed inside a hotzone (a crash there): the hotzone
    /// must be recovered (`repair`) before the reencryption resumes (cryptsetup's words).
    #[error("Device requires reencryption recovery. Run repair first.")]
    NeedsRecovery,

    #[error("unsupported LUKS feature: {0}")]
    UnsupportedLuks(String),

    #[error("keyslot {slot}: {reason}")]
    Keyslot { slot: u32, reason: String },

    // ---- bad data or a wrong key (TrueCrypt/VeraCrypt, BitLocker) ----
    /// No header decrypts with this passphrase (TCRYPT: no KDF and cipher chain gives the
    /// magic), cryptsetup's words and exit code of a wrong passphrase.
    #[error("No device header detected with this passphrase.")]
    NoFormatHeader,

    /// A volume of a foreign format that ucrypt reads but does not map (a legacy mode, a
    /// cipher it lacks): the text says which, in cryptsetup's words where it refuses too.
    #[error("{0}")]
    UnsupportedFormat(String),

    // ---- bad data from disk (authenticated sectors) ----
    /// A sector's data does not match its authentication tag (changed, moved, replayed or never
    /// written through the integrity layer). Reported as `EILSEQ`, as dm-integrity does.
    #[error("integrity check failed: sector {sector} (512-byte units of the data) does not match its tag")]
    Integrity { sector: u64 },

    /// The volume cannot do what was asked, by what it is (an authenticated volume cannot be
    /// resized): refused before anything changed. See [`Refusal`].
    #[error("{0}")]
    Refused(Refusal),

    // ---- the machine ----
    /// A kernel feature the caller asked for is missing or switched off; the text says which
    /// and how to turn it on.
    #[error("kernel feature unavailable: {0}")]
    KernelFeature(String),

    // ---- the crypto library ----
    #[error("cipher library call {call} failed")]
    CipherLibrary { call: &'static str },

    // ---- our own bug: reported, never silently ignored ----
    #[error("internal error (a ucrypt bug, please report): {0}")]
    Bug(&'static str),
}

/// What a volume refuses to do by its kind ([`Error::Refused`]): a typed reason, so that a
/// caller can tell the refusal from a failure without reading the message.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// An authenticated volume's size is the data area its dm-integrity superblock records;
    /// growing or shrinking it would need the tags of the new area written first.
    ResizeAuthenticated,
    /// A raw dm-crypt mapping has no header to check a key against, so it is not suspended: a
    /// wrong key could not be told on resume.
    SuspendWithoutHeader,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refusal::ResizeAuthenticated => {
                "resize: the volume has authenticated encryption (integrity): its size is the \
                 data area recorded in its dm-integrity superblock, which ucrypt does not grow \
                 or shrink (the tags of a new area would have to be written first)"
            }
            Refusal::SuspendWithoutHeader => {
                "suspend: a plain volume has no LUKS header to check the key against on resume"
            }
        })
    }
}

/// Who can act on an error: what a front end or a command needs to decide how to report it
/// and which exit code to give (see `ucrypt-cli`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The caller's input: arguments, options, a request outside the volume. Fix the call.
    BadInput,
    /// The passphrase or key does not open the volume.
    WrongKey,
    /// The data on the device is not what it should be (not LUKS, a damaged or unsupported
    /// header). Repair or restore the device's metadata.
    BadData,
    /// The device, the backing store or the machine failed or lacks a feature. Fix the host.
    Device,
    /// The other end of a connection broke the protocol. Blame the peer.
    Peer,
    /// A ucrypt bug. Report it.
    Internal,
}

impl ErrorKind {
    /// Every kind, in the order of their discriminants (which index per-kind counters).
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::BadInput,
        ErrorKind::WrongKey,
        ErrorKind::BadData,
        ErrorKind::Device,
        ErrorKind::Peer,
        ErrorKind::Internal,
    ];

    /// A short lowercase name, for logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::BadInput => "bad_input",
            ErrorKind::WrongKey => "wrong_key",
            ErrorKind::BadData => "bad_data",
            ErrorKind::Device => "device",
            ErrorKind::Peer => "peer",
            ErrorKind::Internal => "internal",
        }
    }
}

impl Error {
    /// Who can act on this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::UnsupportedCipher { .. }
            | Error::KeySize { .. }
            | Error::SectorSize(_)
            | Error::NotSectorMultiple { .. }
            | Error::OutOfRange { .. }
            | Error::InvalidArgument(_)
            | Error::ReadOnly(_)
            | Error::InReencryption
            | Error::NeedsRecovery
            | Error::Refused(_) => ErrorKind::BadInput,
            Error::UnmetRequirements(_) => ErrorKind::BadData,
            Error::WrongPassphrase
            | Error::PassphraseMismatch
            | Error::VolumeKeyMismatch
            | Error::NoFormatHeader => ErrorKind::WrongKey,
            Error::UnsupportedFormat(_) => ErrorKind::BadData,
            // No keyslot left to try: the header cannot be opened by any passphrase
            // (cryptsetup exits 1 here, not 2).
            Error::NoUsableKeyslot
            | Error::NotLuks(_)
            | Error::BadHeader { .. }
            | Error::AmbiguousSignatures(_)
            | Error::UnsupportedLuks(_)
            | Error::Keyslot { .. }
            | Error::Integrity { .. } => ErrorKind::BadData,
            Error::Io { .. } | Error::KernelFeature(_) | Error::CipherLibrary { .. } => {
                ErrorKind::Device
            }
            Error::Bug(_) => ErrorKind::Internal,
        }
    }

    /// Wraps an `io::Error` with what we were doing.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The errno a block front end (NBD, FUSE, ublk) should report for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::OutOfRange { .. } => libc::ENOSPC,
            Error::ReadOnly(_) | Error::InReencryption => libc::EROFS,
            Error::Integrity { .. } => libc::EILSEQ,
            Error::KernelFeature(_) | Error::Refused(_) => libc::EOPNOTSUPP,
            Error::NotSectorMultiple { .. } | Error::InvalidArgument(_) => libc::EINVAL,
            _ => libc::EIO,
        }
    }
}
