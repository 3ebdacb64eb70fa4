//! The command's error: every library error kept with its type up to here, where it becomes
//! one line on stderr and cryptsetup's exit code.
//!
//! Exit codes follow cryptsetup(8): 1 wrong parameters (and anything else), 2 no permission or
//! bad passphrase, 3 out of memory, 4 wrong device specified, 5 device already exists or busy.

use ucrypt::ErrorKind;

/// The exit codes [`CliError::exit_code`] chooses from, with cryptsetup(8)'s meaning of each;
/// the man pages' EXIT STATUS section is this table.
pub const EXIT_CODES: [(i32, &str); 6] = [
    (0, "Success."),
    (1, "Wrong parameters, or any other failure."),
    (2, "No permission, or a bad passphrase."),
    (3, "Out of memory."),
    (
        4,
        "Wrong device specified (none there, not a block device or file, not active).",
    ),
    (
        5,
        "Device already exists or is busy (the name is open, or the volume is in use).",
    ),
];

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The core library: LUKS, the volume, backends.
    #[error(transparent)]
    Core(#[from] ucrypt::Error),
    #[error(transparent)]
    Nbd(#[from] ucrypt_nbd::Error),
    #[error(transparent)]
    Ublk(#[from] ucrypt_ublk::Error),
    #[error(transparent)]
    Vhost(#[from] ucrypt_vhost::Error),
    /// Arguments that make no sense together, found after parsing.
    #[error("{0}")]
    Usage(String),
    /// A name or volume already in use: an open device of that name, or a volume another
    /// open device serves (cryptsetup exits 5).
    #[error("{0}")]
    Busy(String),
    /// No open device of that name (cryptsetup exits 4).
    #[error("{0}")]
    NotActive(String),
    /// `--token-only` and no token of the requested id or type assigned to a keyslot
    /// (cryptsetup's words and exit 1).
    #[error("{}", match .0 { Some(t) => format!("No usable token (type {t}) is available."), None => "No usable token is available.".to_string() })]
    NoUsableToken(Option<String>),
    /// `--token-only` and the tokens tried could not unlock: the passphrase was not in the
    /// kernel keyring, or no keyslot took it (cryptsetup's words, exit 2 as a wrong
    /// passphrase).
    #[error("{0} cannot unlock assigned keyslot(s) (wrong keyslot passphrase).")]
    TokenCannotUnlock(String),
    /// The process that served a device is gone (killed, crashed) and left its state behind:
    /// cryptsetup has no such state; exit 1, as `status` of a dead daemon.
    #[error("{0}")]
    Gone(String),
    /// A failure another ucrypt process (an open volume's daemon) reported, with the exit code
    /// it chose.
    #[error("{message}")]
    Remote { code: i32, message: String },
    /// An error about one of several things (a volume among exports): named in front.
    #[error("{what}: {source}")]
    At { what: String, source: Box<CliError> },
}

pub type CliResult<T> = Result<T, CliError>;

impl CliError {
    /// The same error, named as being about `what`.
    pub fn at(self, what: impl Into<String>) -> Self {
        CliError::At {
            what: what.into(),
            source: Box::new(self),
        }
    }

    /// The error underneath any naming.
    fn inner(&self) -> &CliError {
        match self {
            CliError::At { source, .. } => source.inner(),
            e => e,
        }
    }

    /// The library error underneath, if the failure came from the core.
    fn core(&self) -> Option<&ucrypt::Error> {
        match self.inner() {
            CliError::Core(e) => Some(e),
            CliError::Nbd(ucrypt_nbd::Error::Device(e)) => Some(e),
            CliError::Ublk(ucrypt_ublk::Error::Device(e)) => Some(e),
            CliError::Vhost(ucrypt_vhost::Error::Device(e)) => Some(e),
            _ => None,
        }
    }

    /// Who can act on it.
    pub fn kind(&self) -> ErrorKind {
        match self {
            CliError::Core(e) => e.kind(),
            CliError::Nbd(e) => e.kind(),
            CliError::Ublk(e) => e.kind(),
            CliError::Vhost(e) => e.kind(),
            CliError::Usage(_) | CliError::NotActive(_) | CliError::NoUsableToken(_) => {
                ErrorKind::BadInput
            }
            CliError::Busy(_) | CliError::Gone(_) => ErrorKind::Device,
            CliError::Remote { code: 2, .. } | CliError::TokenCannotUnlock(_) => {
                ErrorKind::WrongKey
            }
            CliError::Remote { .. } => ErrorKind::Device,
            CliError::At { source, .. } => source.kind(),
        }
    }

    /// cryptsetup's exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self.inner() {
            CliError::Busy(_) => return 5,
            CliError::NotActive(_) => return 4,
            CliError::Gone(_) => return 1,
            CliError::Remote { code, .. } => return *code,
            _ => {}
        }
        if self.kind() == ErrorKind::WrongKey {
            return 2;
        }
        let io = match (self.core(), self.inner()) {
            (Some(ucrypt::Error::Io { source, .. }), _) => Some(source),
            (_, CliError::Nbd(ucrypt_nbd::Error::Io { source, .. })) => Some(source),
            _ => None,
        };
        let Some(source) = io else { return 1 };
        // EPERM is no missing permission but a file that refuses the operation (immutable,
        // append-only, sealed): cryptsetup fails such a write with its generic 1.
        if source.raw_os_error() == Some(libc::EPERM) {
            return 1;
        }
        match source.kind() {
            std::io::ErrorKind::NotFound => 4,
            std::io::ErrorKind::PermissionDenied => 2,
            std::io::ErrorKind::OutOfMemory => 3,
            _ => match source.raw_os_error() {
                Some(libc::EBUSY) => 5,
                Some(libc::ENOMEM) => 3,
                Some(libc::ENODEV) | Some(libc::ENXIO) => 4,
                _ => 1,
            },
        }
    }
}

impl CliError {
    /// The line the user reads: the error as it displays, except that the core's invalid
    /// arguments, most of them cryptsetup's own sentences, are printed bare (without the
    /// library's "invalid argument: " in front), as cryptsetup prints them.
    pub fn message(&self) -> String {
        match self {
            CliError::Core(ucrypt::Error::InvalidArgument(m)) => m.clone(),
            CliError::At { what, source } => format!("{what}: {}", source.message()),
            e => e.to_string(),
        }
    }
}

/// Prints `ucrypt VERB: error` (one line) and returns the exit code; 0 for success.
pub fn report(verb: &str, r: CliResult<()>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ucrypt {verb}: {}", e.message());
            e.exit_code()
        }
    }
}
