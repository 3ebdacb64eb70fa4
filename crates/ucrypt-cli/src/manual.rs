//! Man pages and shell completions, generated from the command's own definition (the same
//! `clap::Command` that parses arguments), so they cannot drift from `--help`.
//!
//! `ucrypt generate-docs DIR` (hidden; the package script runs it) writes `DIR/man/ucrypt.8`,
//! one `ucrypt-VERB.8` per visible verb (`ucrypt-tab-start.8` for nested ones), and
//! `DIR/completions/` for bash (`ucrypt.bash`), zsh (`_ucrypt`) and fish (`ucrypt.fish`).
//! Beyond clap_mangen's sections each page gets EXIT STATUS (cryptsetup's codes, from
//! [`crate::error::EXIT_CODES`]), EXAMPLES where [`EXAMPLES`] has some, and SEE ALSO.
//! `ucrypttab(5)`, a file format, is written by hand (`docs/man/ucrypttab.5`).

use std::io::Write;
use std::path::{Path, PathBuf};

use clap_complete::Shell;
use clap_mangen::roff::{roman, Roff};

use crate::error::{CliError, CliResult, EXIT_CODES};

/// Man pages are in section 8: administration commands, as cryptsetup(8)'s.
const SECTION: &str = "8";

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// Directory to write `man/` and `completions/` into (made if missing).
    pub out: PathBuf,
}

/// Examples per page (the page's name without section): a comment line and a command each.
const EXAMPLES: &[(&str, &[(&str, &str)])] = &[
    (
        "ucrypt",
        &[
            ("Make a LUKS2 volume in a file (asks the passphrase twice).", "truncate -s 1G vol.img && ucrypt format vol.img"),
            ("Open it as the device /dev/ucrypt/data, put a file system on it and mount it.", "ucrypt open vol.img data && mkfs.ext4 /dev/ucrypt/data && mount /dev/ucrypt/data /mnt"),
            ("Show it, then unmount and close it.", "ucrypt status data; umount /mnt && ucrypt close data"),
        ],
    ),
    (
        "ucrypt-format",
        &[
            ("A LUKS2 volume with the defaults (aes-xts-plain64, 512-bit key, argon2id).", "ucrypt format vol.img"),
            ("An authenticated volume (dm-crypt over dm-integrity, AES-GCM).", "ucrypt format --integrity aead --cipher aes-gcm-random vol.img"),
            ("The passphrase from a file, no questions (as cryptsetup's -q).", "ucrypt format -q --key-file pass.txt vol.img"),
        ],
    ),
    (
        "ucrypt-open",
        &[
            ("Open as /dev/ucrypt/data, by the best front end the host offers.", "ucrypt open vol.img data"),
            ("Over FUSE only (no root needed); the stable path then names the FUSE file.", "ucrypt open --front-end fuse vol.img data"),
            ("Only check the passphrase (cryptsetup's open --test-passphrase).", "ucrypt open --test-passphrase vol.img"),
        ],
    ),
    ("ucrypt-close", &[("Flush, detach and stop the daemon of data.", "ucrypt close data")]),
    ("ucrypt-status", &[("cryptsetup's status lines for data, then ucrypt's own.", "ucrypt status data")]),
    ("ucrypt-dump", &[("The header's keyslots, segments and digests.", "ucrypt dump vol.img")]),
    ("ucrypt-add-key", &[("Add a passphrase in a free keyslot (asks an existing one first).", "ucrypt add-key vol.img")]),
    ("ucrypt-mount", &[("Serve the decrypted volume as the regular file ./plain over FUSE (for losetup).", "ucrypt mount vol.img ./plain")]),
    ("ucrypt-serve", &[("Serve to NBD clients on a Unix socket (qemu, nbdfuse, nbd-client).", "ucrypt serve vol.img --nbd unix:/run/vol.sock")]),
    ("ucrypt-ublk", &[("Serve as /dev/ublkbN (Linux 6.0 or later with ublk_drv).", "ucrypt ublk vol.img")]),
    (
        "ucrypt-reencrypt",
        &[
            ("A new volume key, offline.", "ucrypt reencrypt vol.img"),
            ("Online, while the volume is open as data.", "ucrypt reencrypt --active-name data vol.img"),
        ],
    ),
    ("ucrypt-tab-start", &[("Open every volume of /etc/ucrypttab but the noauto ones.", "ucrypt tab start")]),
];

/// Writes the man pages and completions of `cmd` under `args.out`.
pub fn run(cmd: clap::Command, args: GenerateArgs) -> i32 {
    crate::error::report("generate-docs", generate(cmd, &args.out))
}

fn generate(cmd: clap::Command, out: &Path) -> CliResult<()> {
    let io = |what: &Path| {
        let what = what.display().to_string();
        move |e: std::io::Error| CliError::Usage(format!("{what}: {e}"))
    };
    let man_dir = out.join("man");
    let comp_dir = out.join("completions");
    for d in [&man_dir, &comp_dir] {
        std::fs::create_dir_all(d).map_err(io(d))?;
    }
    let mut built = cmd.clone().disable_help_subcommand(true);
    built.build();
    let mut pages = Vec::new();
    collect(&built, &mut pages);
    let names: Vec<String> = pages.iter().map(page_name).collect();
    for c in &pages {
        let path = man_dir.join(format!("{}.{SECTION}", page_name(c)));
        let mut page = Vec::new();
        render(c, &names, &mut page).map_err(io(&path))?;
        std::fs::write(&path, page).map_err(io(&path))?;
    }
    let mut cmd = cmd;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut cmd, "ucrypt", &comp_dir).map_err(io(&comp_dir))?;
    }
    Ok(())
}

/// `cmd` and its visible subcommands, depth first.
fn collect(cmd: &clap::Command, out: &mut Vec<clap::Command>) {
    out.push(cmd.clone());
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        collect(sub, out);
    }
}

/// `ucrypt`, `ucrypt-open`, `ucrypt-tab-start`: what clap names a built subcommand for display.
fn page_name(cmd: &clap::Command) -> String {
    cmd.get_display_name().unwrap_or(cmd.get_name()).to_owned()
}

fn render(cmd: &clap::Command, all: &[String], w: &mut dyn Write) -> std::io::Result<()> {
    let name = page_name(cmd);
    let source = format!("ucrypt {}", env!("CARGO_PKG_VERSION"));
    let man = clap_mangen::Man::new(cmd.clone())
        .title(name.to_uppercase())
        .section(SECTION)
        .source(source)
        .manual("System Administration");
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
    for (code, meaning) in EXIT_CODES {
        roff.control("TP", []).text([roman(code.to_string())]);
        roff.text([roman(meaning)]);
    }
    if let Some((_, examples)) = EXAMPLES.iter().find(|(page, _)| *page == name) {
        roff.control("SH", ["EXAMPLES"]);
        for (what, command) in examples.iter() {
            roff.control("PP", []).text([roman(*what)]);
            roff.control("IP", []).text([roman(*command)]);
        }
    }
    roff.control("SH", ["SEE ALSO"]);
    let mut see: Vec<String> = if name == "ucrypt" {
        all.iter()
            .skip(1)
            .map(|p| format!("{p}({SECTION})"))
            .collect()
    } else {
        vec![format!("ucrypt({SECTION})")]
    };
    see.extend(["ucrypttab(5)".to_owned(), "cryptsetup(8)".to_owned()]);
    roff.text([roman(see.join(", "))]);
    roff.to_writer(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every example's `ucrypt` command line is accepted by the parser, and every example
    /// names a page that exists.
    #[test]
    fn examples_parse_and_name_pages() {
        let mut built = crate::command().disable_help_subcommand(true);
        built.build();
        let mut pages = Vec::new();
        collect(&built, &mut pages);
        let names: Vec<String> = pages.iter().map(page_name).collect();
        for (page, examples) in EXAMPLES {
            assert!(names.iter().any(|n| n == page), "no page {page}");
            for (_, line) in examples.iter() {
                for part in line.split(&['&', ';'][..]).map(str::trim) {
                    if !part.starts_with("ucrypt ") {
                        continue;
                    }
                    let argv = part.split_whitespace().map(str::to_owned).collect();
                    if let Err(e) = crate::try_parse(argv) {
                        panic!("{page}: `{part}` does not parse: {e}");
                    }
                }
            }
        }
    }

    /// Every `ucrypt` command line in the README's and the user guide's `sh` blocks is
    /// accepted by the parser (after the same argument reordering `main` does).
    #[test]
    fn readme_and_guide_commands_parse() {
        let docs = [
            ("README.md", include_str!("../../../README.md")),
            ("docs/using.md", include_str!("../../../docs/using.md")),
        ];
        let mut checked = 0;
        for (file, text) in docs {
            let mut in_sh = false;
            for line in text.lines() {
                if line.starts_with("```") {
                    in_sh = !in_sh && line == "```sh";
                    continue;
                }
                if !in_sh {
                    continue;
                }
                let code = line.split(" #").next().unwrap_or_default();
                for part in code.split(&['&', ';', '|'][..]).map(str::trim) {
                    if !part.starts_with("ucrypt ") {
                        continue;
                    }
                    let argv = part.split_whitespace().map(str::to_owned).collect();
                    if let Err(e) = crate::try_parse(crate::luks_cli::reorder_args(argv)) {
                        panic!("{file}: `{part}` does not parse: {e}");
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked >= 20, "only {checked} command lines found");
    }

    /// The pages are written, each renders with EXIT STATUS, and the completions exist.
    #[test]
    fn generate_writes_pages_and_completions() {
        let dir = std::env::temp_dir().join(format!("ucrypt-manual-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        generate(crate::command(), &dir).expect("generate");
        let page = std::fs::read_to_string(dir.join("man/ucrypt-open.8")).expect("open page");
        assert!(page.contains(".SH \"EXIT STATUS\""), "{page}");
        assert!(page.contains("ucrypt open vol.img data"), "{page}");
        assert!(!dir.join("man/ucrypt-help.8").exists());
        for verb in ["open", "serve", "mount", "ublk"] {
            let page = std::fs::read_to_string(dir.join(format!("man/ucrypt-{verb}.8")))
                .unwrap_or_else(|e| panic!("the {verb} page: {e}"));
            assert!(
                page.contains("memory\\-budget"),
                "the {verb} page lacks --memory-budget"
            );
        }
        for f in ["ucrypt.bash", "_ucrypt", "ucrypt.fish"] {
            let text = std::fs::read_to_string(dir.join("completions").join(f)).expect(f);
            assert!(
                text.contains("luksFormat"),
                "{f} lacks the alias luksFormat"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
