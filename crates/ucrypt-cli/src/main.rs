//! `ucrypt`: cryptsetup-style verbs and the front ends (NBD, FUSE, ublk, vhost-user-blk) that
//! serve volumes.
//!
//! This crate parses arguments, asks for passphrases, wires the library crates together and
//! turns their typed errors into one line and cryptsetup's exit code (`error.rs`). Each verb
//! family lives in its own module and contributes its variants to [`Cmd`].

mod aliases;
mod bench;
mod bitlk;
mod compat;
mod daemon;
mod error;
mod formats;
mod fvault2;
mod header_dev;
mod in_use;
mod loopaes;
mod luks_cli;
mod manual;
mod metrics;
mod mount;
mod open;
mod pass;
mod serve;
mod signals;
mod tab;
mod target;
mod token;
mod ublk;
mod vhost;
mod volume_args;
mod volume_key;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ucrypt",
    version,
    about = "Userspace dm-crypt and LUKS2 compatible disk encryption",
    long_about = "Userspace dm-crypt and LUKS2 compatible disk encryption.\n\n\
        ucrypt makes and opens the volumes cryptsetup makes, encrypts sectors byte for byte as \
        the kernel's dm-crypt does, and serves them where dm-crypt cannot run (containers, \
        micro-VMs, hosts without root) as a block device (ublk, or a loop device over FUSE), a \
        FUSE file or an NBD export. Every cryptsetup verb spelling is an alias (luksFormat, \
        luksOpen, ...), with cryptsetup's options and exit codes."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    #[command(flatten)]
    global: compat::GlobalOpts,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmarks: cipher, engine, nbd, fuse, scale, all, compare (runs ucrypt-bench).
    Bench(bench::BenchArgs),
    /// cryptsetup's `benchmark`, refused by name: ucrypt's is `bench cipher`.
    #[command(hide = true, disable_help_flag = true)]
    Benchmark(bench::BenchArgs),
    /// LUKS verbs (cryptsetup spellings accepted as aliases).
    #[command(flatten)]
    Luks(Box<luks_cli::LuksCmd>),
    /// Open VOLUME as the device NAME, served by a background daemon until `close NAME`
    /// (or, with --test-passphrase, only check the passphrase).
    #[command(name = "open", visible_alias = "luksOpen")]
    Open(Box<daemon::OpenArgs>),
    /// Serve volumes to NBD clients (qemu, nbd-client, libnbd tools, fio).
    Serve(Box<serve::ServeArgs>),
    /// Serve a volume as a ublk block device (/dev/ublkbN); needs Linux's ublk_drv.
    Ublk(ublk::UblkArgs),
    /// Serve a volume to a virtual machine as a vhost-user-blk disk (qemu vhost-user-blk-pci,
    /// cloud-hypervisor, Firecracker) over a UNIX socket.
    Vhost(Box<vhost::VhostArgs>),
    /// Serve a decrypted volume as one regular file over FUSE (for losetup, VMs, mkfs).
    Mount(mount::MountArgs),
    /// Close a volume `open` started: flush, detach, stop its daemon (cryptsetup close).
    #[command(visible_alias = "luksClose", aliases = aliases::CLOSE_ALIASES)]
    Close(daemon::CloseArgs),
    /// Show an open volume (cryptsetup status), then ucrypt's own lines.
    Status(daemon::StatusArgs),
    /// Change an open volume's run-time settings without closing it (cryptsetup refresh).
    Refresh(daemon::RefreshArgs),
    /// Flush, hold new I/O (it waits) and wipe the key from memory (cryptsetup luksSuspend).
    #[command(visible_alias = "luksSuspend")]
    Suspend(daemon::SuspendArgs),
    /// Re-derive the key from a passphrase and release the held I/O (cryptsetup luksResume).
    #[command(visible_alias = "luksResume")]
    Resume(daemon::ResumeArgs),
    /// Grow or shrink an open volume to its backing file or device, or to --size (cryptsetup
    /// resize).
    Resize(daemon::ResizeArgs),
    /// List open volumes: NAME, stable path, device, front end, state.
    List,
    /// LUKS2 tokens: add (a kernel keyring token), remove, import, export, unassign
    /// (cryptsetup token).
    Token(Box<token::TokenArgs>),
    /// Show the header of a TrueCrypt/VeraCrypt volume (decrypted with the passphrase).
    #[command(name = "tcryptDump")]
    TcryptDump(formats::TcryptDumpArgs),
    /// Show the metadata of a BitLocker volume (cryptsetup bitlkDump).
    #[command(name = "bitlkDump")]
    BitlkDump(bitlk::BitlkDumpArgs),
    /// Show the metadata of a FileVault2 volume (cryptsetup fvault2Dump).
    #[command(name = "fvault2Dump")]
    Fvault2Dump(fvault2::Fvault2DumpArgs),
    /// Open or close the volumes of /etc/ucrypttab (crypttab's syntax).
    #[command(subcommand)]
    Tab(tab::TabCmd),
    /// The hotzones of an online rotation, in a process of their own (started by the process
    /// that serves the volume; not for users).
    #[command(name = daemon::worker::WORKER_VERB, hide = true)]
    ReencryptWorker(daemon::worker::WorkerArgs),
    /// Write the man pages and shell completions, generated from this command's definition,
    /// under DIR (the package script runs it; not for users).
    #[command(name = "generate-docs", hide = true)]
    GenerateDocs(manual::GenerateArgs),
}

/// What `--version` prints after "ucrypt ": the version, the git commit it was built from
/// (build.rs; none outside a git checkout) and the cipher library, e.g.
/// `0.1.0 (1a2b3c4, AWS-LC 5.12.0)`.
fn long_version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        let commit = env!("UCRYPT_COMMIT");
        let backend = ucrypt::sector::backend();
        match commit {
            "" => format!("{} ({backend})", env!("CARGO_PKG_VERSION")),
            c => format!("{} ({c}, {backend})", env!("CARGO_PKG_VERSION")),
        }
    })
}

/// The command line's grammar: the derived one, with cryptsetup's help flags on every
/// command. cryptsetup's `-h` is `--hash` and its help is `-?`/`--help`: clap's own `-h` is
/// taken away everywhere (a script's `-h sha512` must never print help and exit 0 instead
/// of acting).
fn command() -> clap::Command {
    fn cryptsetup_help(c: clap::Command) -> clap::Command {
        let c = c.mut_subcommands(cryptsetup_help);
        if c.is_disable_help_flag_set() {
            // A command that hands its arguments on (`bench`): --help is the callee's.
            return c;
        }
        c.disable_help_flag(true).arg(
            clap::Arg::new("help")
                .short('?')
                .long("help")
                .action(clap::ArgAction::Help)
                .help("Print help"),
        )
    }
    cryptsetup_help(<Cli as clap::CommandFactory>::command()).version(long_version())
}

/// Parses `argv` with [`command`].
fn try_parse(argv: Vec<String>) -> Result<Cli, clap::Error> {
    let m = command().try_get_matches_from(argv)?;
    <Cli as clap::FromArgMatches>::from_arg_matches(&m)
}

/// Parses a `ucrypt open ...` command line (a ucrypttab entry's) with the command's own parser.
fn parse_open(argv: Vec<String>) -> error::CliResult<daemon::OpenArgs> {
    let cli = try_parse(argv).map_err(|e| error::CliError::Usage(e.to_string()))?;
    match cli.cmd {
        Cmd::Open(a) => Ok(*a),
        _ => Err(error::CliError::Usage("not an open command".into())),
    }
}

fn main() {
    // cryptsetup exits 1 on wrong parameters (clap's default, 2, means "bad passphrase" there).
    let (argv, rewritten) = aliases::expand(std::env::args().collect());
    let argv = luks_cli::reorder_args(argv);
    if compat::usage(command(), &argv) {
        std::process::exit(0);
    }
    let cli = match try_parse(argv.clone()) {
        Ok(c) if rewritten.name_first => name_first(c),
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            std::process::exit(if e.use_stderr() { 1 } else { 0 });
        }
    };
    compat::debug_start(&cli.global, &argv);
    if let Cmd::Benchmark(_) = cli.cmd {
        // Before --test-args: the verb itself is refused.
        let code = benchmark_refused();
        compat::debug_end(&cli.global, code);
        std::process::exit(code);
    }
    if let Some(why) = match &cli.cmd {
        Cmd::Open(a) => daemon::refusal(a),
        _ => None,
    } {
        let e = error::CliError::Usage(why.into());
        eprintln!("{}", e.message());
        compat::debug_end(&cli.global, e.exit_code());
        std::process::exit(e.exit_code());
    }
    if let compat::Next::Exit(code) = compat::apply(&cli.global) {
        compat::debug_end(&cli.global, code);
        std::process::exit(code);
    }
    let code = run(cli.cmd);
    compat::debug_end(&cli.global, code);
    std::process::exit(code);
}

/// Runs the verb; returns the process's exit code.
fn run(cmd: Cmd) -> i32 {
    match cmd {
        Cmd::Bench(a) => bench::run(a),
        Cmd::Benchmark(_) => benchmark_refused(),
        Cmd::Luks(c) => luks_cli::run(*c),
        Cmd::Open(a) if a.test_passphrase && a.dev_type == Some(open::DeviceType::Tcrypt) => {
            tcrypt_test_passphrase(&a)
        }
        Cmd::Open(a) if a.test_passphrase && a.dev_type == Some(open::DeviceType::Bitlk) => {
            error::report("bitlkOpen", bitlk::test_passphrase(&a.v).map(|_| ()))
        }
        Cmd::Open(a) if a.test_passphrase && a.dev_type == Some(open::DeviceType::Fvault2) => {
            fvault2::test_passphrase(&a.v)
        }
        Cmd::Open(a) if a.test_passphrase && a.dev_type == Some(open::DeviceType::Loopaes) => {
            loopaes::test_passphrase_refused()
        }
        Cmd::Open(a) if a.test_passphrase => luks_cli::test_passphrase_of(&a),
        Cmd::Open(a) => daemon::report(daemon::open(*a)),
        Cmd::Serve(a) => serve::run(*a),
        Cmd::Ublk(a) => ublk::run(a),
        Cmd::Vhost(a) => vhost::run(*a),
        Cmd::Mount(a) => mount::run(a),
        Cmd::Close(a) => daemon::report(daemon::close(a)),
        Cmd::Status(a) => daemon::report(daemon::status(a)),
        Cmd::Refresh(a) => daemon::report(daemon::refresh(a)),
        Cmd::Suspend(a) => daemon::report(daemon::suspend(a)),
        Cmd::Resume(a) => daemon::report(daemon::resume(a)),
        Cmd::Resize(a) => daemon::report(daemon::resize(a)),
        Cmd::BitlkDump(a) => error::report("bitlkDump", bitlk::bitlk_dump(&a).map(|_| ())),
        Cmd::TcryptDump(a) => error::report("tcryptDump", formats::tcrypt_dump(&a).map(|_| ())),
        Cmd::Fvault2Dump(a) => error::report("fvault2Dump", fvault2::dump(&a).map(|_| ())),
        Cmd::List => daemon::report(daemon::list()),
        Cmd::Token(a) => token::run(*a),
        Cmd::Tab(c) => tab::run(c),
        Cmd::ReencryptWorker(a) => daemon::worker::run_worker(a),
        Cmd::GenerateDocs(a) => manual::run(command(), a),
    }
}

/// cryptsetup's `benchmark`: refused by name; returns the exit code.
fn benchmark_refused() -> i32 {
    eprintln!(
        "Action benchmark is not supported by ucrypt: its cipher and PBKDF speeds are `ucrypt \
         bench cipher` (a table of its own, not cryptsetup's)."
    );
    1
}

/// cryptsetup's `create NAME DEVICE` (`aliases::expand` made it `open --type plain`): the
/// device and the name parsed in each other's place are swapped back. A name that cannot be a
/// volume (an empty one) exits as clap's own errors do.
fn name_first(mut c: Cli) -> Cli {
    if let Cmd::Open(a) = &mut c.cmd {
        let Some(device) = a.name.take() else {
            eprintln!("create: expected NAME DEVICE");
            std::process::exit(1);
        };
        let name = a.v.volume.to_string();
        a.v.volume = match device.parse() {
            Ok(t) => t,
            Err(e) => {
                eprintln!("create: {device}: {e}");
                std::process::exit(1);
            }
        };
        a.name = Some(name);
    }
    c
}

/// `open --type tcrypt --test-passphrase`: the TrueCrypt/VeraCrypt header decrypts with the
/// passphrase and keyfiles, and gives a mapping; nothing is served.
fn tcrypt_test_passphrase(a: &daemon::OpenArgs) -> i32 {
    ucrypt::secret::disable_core_dumps();
    let v = &a.v;
    let r = match &v.volume {
        target::Target::Path(p) => formats::tcrypt_mapping(
            v.header.as_deref().unwrap_or(p),
            &v.tcrypt,
            &v.key_files,
            v.hash.as_deref(),
            v.cipher.as_deref(),
        )
        .map(|_| ()),
        other => Err(error::CliError::Usage(format!(
            "{other}: TCRYPT volumes are opened from local files or devices"
        ))),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{}", e.message());
            e.exit_code()
        }
    }
}

#[cfg(test)]
mod tests {
    /// clap's own checks of the whole grammar (unique argument names and shorts in every
    /// command, valid defaults), which otherwise run only when that command is parsed.
    #[test]
    fn the_grammar_is_consistent() {
        super::command().debug_assert();
    }

    /// `--memory-budget` is one option of `open`, `serve`, `mount`, `ublk` and `vhost`: each one's
    /// help shows it, the same SIZE is taken by all, and a size below one buffer chunk is
    /// refused by all with the same words.
    #[test]
    fn every_serving_verb_takes_the_memory_budget() {
        let mut cmd = super::command();
        for verb in ["open", "serve", "mount", "ublk", "vhost"] {
            let help = cmd
                .find_subcommand_mut(verb)
                .unwrap_or_else(|| panic!("no verb {verb}"))
                .render_long_help()
                .to_string();
            assert!(
                help.contains("--memory-budget <SIZE>"),
                "{verb} --help: {help}"
            );
        }
        let verbs: [&[&str]; 5] = [
            &["open", "v.img", "name"],
            &["serve", "v.img", "--nbd", "unix:/tmp/s"],
            &["mount", "v.img", "/tmp/m"],
            &["ublk", "v.img"],
            &["vhost", "v.img", "--socket", "/tmp/v"],
        ];
        for verb in verbs {
            let argv = |size: &str| -> Vec<String> {
                let mut a = vec!["ucrypt"];
                a.extend_from_slice(verb);
                a.extend(["--memory-budget", size]);
                a.into_iter().map(String::from).collect()
            };
            let cli = super::try_parse(argv("3M"))
                .unwrap_or_else(|e| panic!("{verb:?} --memory-budget 3M: {e}"));
            let taken = match cli.cmd {
                super::Cmd::Open(a) => a.budget.memory_budget,
                super::Cmd::Serve(a) => a.budget.memory_budget,
                super::Cmd::Mount(a) => a.budget.memory_budget,
                super::Cmd::Ublk(a) => a.budget.memory_budget,
                super::Cmd::Vhost(a) => a.budget.memory_budget,
                _ => panic!("{verb:?}: another command"),
            };
            assert_eq!(taken, Some(3 << 20), "{verb:?}");
            let refused = super::try_parse(argv("1k"))
                .err()
                .unwrap_or_else(|| panic!("{verb:?} --memory-budget 1k parses"));
            assert!(
                refused.to_string().contains("cannot hold one buffer chunk"),
                "{verb:?}: {refused}"
            );
        }
    }

    /// `create NAME DEVICE` opens DEVICE as NAME.
    #[test]
    fn create_takes_the_name_first() {
        let argv: Vec<String> = [
            "ucrypt",
            "create",
            "secret",
            "/dev/sdx",
            "--cipher",
            "aes-xts-plain64",
        ]
        .map(String::from)
        .to_vec();
        let (argv, rewritten) = crate::aliases::expand(argv);
        assert!(rewritten.name_first);
        let cli = super::name_first(super::try_parse(argv).expect("parses"));
        let super::Cmd::Open(a) = cli.cmd else {
            panic!("not an open command");
        };
        assert_eq!(a.v.volume.to_string(), "/dev/sdx");
        assert_eq!(a.name.as_deref(), Some("secret"));
        assert_eq!(a.dev_type, Some(crate::open::DeviceType::Plain));
    }
}
