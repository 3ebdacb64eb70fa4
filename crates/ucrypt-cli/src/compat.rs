//! cryptsetup's options that are not a verb's own: the ones cryptsetup 2.6.1 takes on every verb
//! (`--debug`, `--usage`, `--test-args`, `--timeout`, `--verify-passphrase`, ...), the ones that
//! have no effect in ucrypt (said in each one's help and in docs/cryptsetup-options.md), and the
//! ones ucrypt refuses by name with the reason. They are parsed on every command (clap's global
//! arguments) so that a cryptsetup command line never fails on an unknown option; each is then
//! acted on, ignored as documented, or refused here before the verb runs.

use std::sync::atomic::{AtomicBool, Ordering};

use clap::Args;

use crate::error::CliError;

/// cryptsetup's global options, and the per-verb ones ucrypt does not implement.
#[derive(Args, Debug, Default)]
pub struct GlobalOpts {
    /// Show what runs: the command line and its outcome, on standard error (cryptsetup
    /// --debug).
    #[arg(long, global = true)]
    pub debug: bool,
    /// As --debug (cryptsetup's adds its JSON metadata; `luksDump --dump-json-metadata` prints
    /// that).
    #[arg(long = "debug-json", global = true)]
    pub debug_json: bool,
    /// Print the command's usage line and exit (see [`usage`]).
    #[arg(long, global = true)]
    pub usage: bool,
    /// Check the command line and exit without acting.
    #[arg(long = "test-args", global = true)]
    pub test_args: bool,
    /// Seconds an interactive passphrase prompt waits for input (0: no limit).
    #[arg(short = 't', long, global = true, value_name = "SECS")]
    pub timeout: Option<u32>,
    /// Ask twice for every passphrase typed on a terminal (new ones are always asked twice).
    #[arg(short = 'y', long = "verify-passphrase", global = true)]
    pub verify_passphrase: bool,
    /// `open`: derive the key under a lock that every ucrypt process taking this option
    /// shares, so that volumes opened at once do not each take Argon2's memory together.
    #[arg(long = "serialize-memory-hard-pbkdf", global = true)]
    pub serialize_memory_hard_pbkdf: bool,
    #[command(flatten)]
    pub no_effect: NoEffect,
    #[command(flatten)]
    pub refused: Refused,
}

/// Options cryptsetup 2.6.1 takes that change nothing in ucrypt, each for the reason in its
/// help; accepted so that scripts and crypttab lines keep working.
#[derive(Args, Debug, Default)]
pub struct NoEffect {
    /// No effect: ucrypt loads no token plugins (its tokens are built in).
    #[arg(long = "disable-external-tokens", global = true, hide = true)]
    pub disable_external_tokens: bool,
    /// No effect: ucrypt never hands volume keys to the kernel keyring.
    #[arg(long = "disable-keyring", global = true, hide = true)]
    pub disable_keyring: bool,
    /// No effect: keys come from getrandom(2), the kernel's one CSPRNG that /dev/random and
    /// /dev/urandom both read once it is seeded.
    #[arg(
        long = "use-random",
        global = true,
        hide = true,
        conflicts_with = "use_urandom"
    )]
    pub use_random: bool,
    /// No effect: as --use-random.
    #[arg(long = "use-urandom", global = true, hide = true)]
    pub use_urandom: bool,
    /// No effect: options of cryptsetup's retired LUKS1 reencryption tool, ignored by
    /// cryptsetup 2.6.1 for LUKS2 as well; ucrypt's reencryption always writes through its
    /// own protocol (O_DIRECT where the device allows, a flush after each hotzone).
    #[arg(long = "use-directio", global = true, hide = true)]
    pub use_directio: bool,
    /// No effect: as --use-directio.
    #[arg(long = "use-fsync", global = true, hide = true)]
    pub use_fsync: bool,
    /// No effect: as --use-directio.
    #[arg(long = "write-log", global = true, hide = true)]
    pub write_log: bool,
    /// No effect: as --use-directio (ucrypt sizes its hotzones itself; see --hotzone-size).
    #[arg(
        short = 'B',
        long = "block-size",
        global = true,
        hide = true,
        value_name = "MiB"
    )]
    pub block_size: Option<u32>,
}

/// Options cryptsetup 2.6.1 has that ucrypt refuses by name, each with its reason (cryptsetup
/// exits 1 on an option it cannot honour; so does ucrypt).
#[derive(Args, Debug, Default)]
pub struct Refused {}

/// One refused option: whether it was given, its name, and why ucrypt refuses it.
type RefusedRow = (fn(&Refused) -> bool, &'static str, &'static str);

/// The refused options, in the order they are reported (none at present: every option
/// cryptsetup 2.6.1 takes on a verb is parsed by that verb, or refused by it with its reason).
const REFUSED: &[RefusedRow] = &[];

impl Refused {
    /// The first refused option given, and why ucrypt refuses it.
    fn first(&self) -> Option<(&'static str, &'static str)> {
        REFUSED
            .iter()
            .find(|(given, _, _)| given(self))
            .map(|&(_, name, why)| (name, why))
    }
}

/// What `main` does with the global options once the command line is parsed.
pub enum Next {
    /// Run the verb.
    Run,
    /// Exit now with this code (`--test-args`, a refused option).
    Exit(i32),
}

/// `--usage`: prints the usage line of the command `argv` names (its first words that are
/// commands), and whether it did. It runs before the command line is parsed, since a usage
/// line is asked for without the arguments it lists. `cmd` is the whole grammar.
pub fn usage(mut cmd: clap::Command, argv: &[String]) -> bool {
    if !argv.iter().skip(1).any(|a| a == "--usage") {
        return false;
    }
    cmd.build();
    let mut c = cmd;
    for word in argv.iter().skip(1).filter(|a| !a.starts_with('-')) {
        match c.find_subcommand(word) {
            Some(s) => c = s.clone(),
            None => break,
        }
    }
    println!("{}", c.render_usage());
    true
}

/// Refuses option `name` by name with its reason, as [`apply`] refuses the global ones;
/// returns the exit code.
pub fn refuse(name: &str, why: &str) -> i32 {
    let e = CliError::Usage(format!("Option {name} is not supported by ucrypt: {why}."));
    eprintln!("{}", e.message());
    e.exit_code()
}

/// Acts on the global options of a parsed command line: refuses what ucrypt refuses, stops
/// after the check (`--test-args`), and configures the passphrase prompts.
pub fn apply(g: &GlobalOpts) -> Next {
    if let Some((name, why)) = g.refused.first() {
        return Next::Exit(refuse(name, why));
    }
    if g.test_args {
        return Next::Exit(0);
    }
    SERIALIZE_PBKDF.store(g.serialize_memory_hard_pbkdf, Ordering::Relaxed);
    crate::pass::configure_prompts(crate::pass::PromptSettings {
        timeout_secs: g.timeout.filter(|&t| t > 0),
        always_verify: g.verify_passphrase,
    });
    Next::Run
}

/// `--debug`: the line cryptsetup's debug output starts with.
pub fn debug_start(g: &GlobalOpts, argv: &[String]) {
    if g.debug || g.debug_json {
        eprintln!(
            "# ucrypt {} processing \"{}\"",
            crate::long_version(),
            argv.join(" ")
        );
    }
}

/// `--debug`: the line cryptsetup's debug output ends with.
pub fn debug_end(g: &GlobalOpts, code: i32) {
    if g.debug || g.debug_json {
        match code {
            0 => eprintln!("Command successful."),
            c => eprintln!("Command failed with code {c}."),
        }
    }
}

/// `--serialize-memory-hard-pbkdf` was given.
static SERIALIZE_PBKDF: AtomicBool = AtomicBool::new(false);

/// The lock `--serialize-memory-hard-pbkdf` takes: in /run/lock (world-writable on Debian),
/// else the temporary directory. Opened read-only once it exists, so that processes of any
/// user share it.
fn pbkdf_lock_path() -> std::path::PathBuf {
    let run_lock = std::path::Path::new("/run/lock");
    let dir = if run_lock.is_dir() {
        run_lock.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    dir.join("ucrypt-memory-hard-pbkdf")
}

/// With `--serialize-memory-hard-pbkdf`: waits for and holds the lock its holders share, until
/// the returned file is dropped (the caller drops it once the key is derived, before any
/// fork); without it, `None` at once.
pub fn memory_hard_pbkdf_lock() -> Result<Option<std::fs::File>, CliError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    if !SERIALIZE_PBKDF.load(Ordering::Relaxed) {
        return Ok(None);
    }
    let path = pbkdf_lock_path();
    let io = |e| CliError::from(ucrypt::Error::io(format!("lock {}", path.display()), e));
    let f = match std::fs::OpenOptions::new().read(true).open(&path) {
        Ok(f) => f,
        Err(_) => std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&path)
            .map_err(io)?,
    };
    loop {
        // SAFETY: flock on a descriptor `f` owns; no memory is passed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(Some(f));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(io(e));
        }
    }
}
