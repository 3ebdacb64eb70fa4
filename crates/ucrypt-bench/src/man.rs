//! `ucrypt-bench generate-man DIR` (hidden; the package script runs it): the man pages of this
//! binary, generated from the same `clap::Command` that parses its arguments, so they cannot
//! drift from `--help`. `DIR/ucrypt-bench.1` names every scenario; `DIR/ucrypt-bench-NAME.1`
//! gives each scenario's options. Section 1: the benchmarks are user commands (they need root
//! only for the FUSE, NBD, scale and VM scenarios, as their own pages say).

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::CommandFactory;
use clap_mangen::roff::{roman, Roff};

/// User commands.
const SECTION: &str = "1";
/// The page name of the binary (its clap name is `ucrypt bench`, as `ucrypt bench` runs it).
const NAME: &str = "ucrypt-bench";

/// What the exit status means, in the order the pages list it.
const EXIT_STATUS: &[(i32, &str)] = &[
    (0, "The scenario ran and its report was printed."),
    (
        1,
        "The scenario could not run (a missing tool, a failed setup); the reason is on stderr.",
    ),
    (
        2,
        "The command line was not understood (clap's usage error).",
    ),
];

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Directory to write the pages into (made if missing).
    pub out: PathBuf,
}

/// Writes the pages under `args.out`; the exit status.
pub fn run(args: &GenerateArgs) -> i32 {
    match generate(&args.out) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ucrypt-bench generate-man: {e}");
            1
        }
    }
}

/// The command as the pages name it: `ucrypt-bench`, its scenarios `ucrypt-bench-NAME`.
fn command() -> clap::Command {
    let mut cmd = super::BenchArgs::command()
        .name(NAME)
        .bin_name(NAME)
        .disable_help_subcommand(true);
    cmd.build();
    cmd
}

fn generate(out: &Path) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let cmd = command();
    let mut pages = vec![cmd.clone()];
    pages.extend(cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned());
    for c in &pages {
        let path = out.join(format!("{}.{SECTION}", page_name(c)));
        let mut page = Vec::new();
        render(c, &mut page).map_err(|e| format!("{}: {e}", path.display()))?;
        std::fs::write(&path, page).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// `ucrypt-bench`, `ucrypt-bench-cipher`: what clap names a built subcommand for display.
fn page_name(cmd: &clap::Command) -> String {
    cmd.get_display_name().unwrap_or(cmd.get_name()).to_owned()
}

fn render(cmd: &clap::Command, w: &mut dyn Write) -> std::io::Result<()> {
    let name = page_name(cmd);
    let man = clap_mangen::Man::new(cmd.clone())
        .title(name.to_uppercase())
        .section(SECTION)
        .source(format!("ucrypt {}", env!("CARGO_PKG_VERSION")))
        .manual("User Commands");
    man.render_title(w)?;
    man.render_name_section(w)?;
    man.render_synopsis_section(w)?;
    man.render_description_section(w)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(w)?;
    }
    if cmd.get_subcommands().any(|s| !s.is_hide_set()) {
        man.render_subcommands_section(w)?;
    }
    let mut roff = Roff::default();
    roff.control("SH", ["EXIT STATUS"]);
    for (code, meaning) in EXIT_STATUS {
        roff.control("TP", []).text([roman(code.to_string())]);
        roff.text([roman(*meaning)]);
    }
    roff.control("SH", ["SEE ALSO"]);
    let mut see: Vec<String> = if name == NAME {
        cmd.get_subcommands()
            .filter(|s| !s.is_hide_set())
            .map(|s| format!("{}({SECTION})", page_name(s)))
            .collect()
    } else {
        vec![format!("{NAME}({SECTION})")]
    };
    see.push("ucrypt(8)".to_owned());
    roff.text([roman(see.join(", "))]);
    roff.to_writer(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page for the binary and one per visible scenario, none for the hidden commands;
    /// each has its sections, and the scenario pages list their options.
    #[test]
    fn pages_per_scenario() {
        let dir = std::env::temp_dir().join(format!("ucrypt-bench-man-{}", std::process::id()));
        generate(&dir).expect("generate");
        let read = |n: &str| std::fs::read_to_string(dir.join(n)).unwrap_or_default();
        let main = read("ucrypt-bench.1");
        for want in [
            ".TH UCRYPT-BENCH 1",
            "SYNOPSIS",
            "EXIT STATUS",
            "ucrypt\\-bench\\-cipher(1)",
        ] {
            assert!(main.contains(want), "{want}: {main}");
        }
        let cipher = read("ucrypt-bench-cipher.1");
        assert!(cipher.contains("\\-\\-only"), "{cipher}");
        assert!(cipher.contains("ucrypt\\-bench(1)"), "{cipher}");
        assert!(dir.join("ucrypt-bench-engine.1").exists());
        let scale = read("ucrypt-bench-scale.1");
        assert!(scale.contains("\\-\\-volumes"), "{scale}");
        assert!(main.contains("ucrypt\\-bench\\-scale(1)"), "{main}");
        assert!(dir.join("ucrypt-bench-formats.1").exists());
        let vhost = read("ucrypt-bench-vhost.1");
        for want in ["vhost\\-user\\-blk", "\\-\\-quick", "\\-\\-json", "SKIPPED"] {
            assert!(vhost.contains(want), "{want}: {vhost}");
        }
        assert!(main.contains("ucrypt\\-bench\\-vhost(1)"), "{main}");
        assert!(!dir.join("ucrypt-bench-generate-man.1").exists());
        assert!(!dir.join("ucrypt-bench-integrity-vm-probe.1").exists());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
