//! `ucrypt token add|remove|import|export|unassign`: LUKS2 tokens, as cryptsetup's `token`
//! action manages them. Only the header changes; the data is never read.
//!
//! Exit codes and messages are cryptsetup's: a refused request exits 1 with its reason
//! ("Token 3 in use.", "Keyslot 5 is not active."); `--verbose` says "Token N created."
//! and "Token N removed." as cryptsetup's verbose mode does.

use std::io::{Read as _, Write as _};
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde_json::{Map, Value};
use ucrypt::luks::{self, Header};
use ucrypt::{Error, Result};

use crate::error::CliError;
use crate::target::{RemoteArgs, Target};

/// The largest token JSON read from a file or stdin (a header's whole JSON area is at most
/// 4 MiB, so no token is larger).
const TOKEN_JSON_BYTES_MAX: u64 = 4 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TokenAction {
    /// A luks2-keyring token (--key-description), assigned to --key-slot or every keyslot.
    Add,
    /// Removes --token-id.
    Remove,
    /// A token's JSON from --json-file (default: stdin).
    Import,
    /// --token-id's JSON to --json-file (default: stdout), exactly as stored.
    Export,
    /// Takes keyslot --key-slot out of token --token-id.
    Unassign,
}

#[derive(Args, Debug)]
pub struct TokenArgs {
    /// What to do with the token.
    #[arg(value_enum)]
    pub action: TokenAction,
    /// The LUKS2 volume (or give its detached header with --header).
    pub device: Target,
    /// A detached header holding the tokens.
    #[arg(long)]
    pub header: Option<PathBuf>,
    /// The token id (0-31); add and import take the first free one without it.
    #[arg(long)]
    pub token_id: Option<u32>,
    /// add/import: overwrite the token --token-id names if it is in use.
    #[arg(long)]
    pub token_replace: bool,
    /// import: the token's JSON (default or "-": stdin); export: where it goes (default or
    /// "-": stdout).
    #[arg(long)]
    pub json_file: Option<PathBuf>,
    /// add/import: the keyslot the token unlocks; unassign: the keyslot to take out.
    #[arg(long, short = 'S')]
    pub key_slot: Option<u32>,
    /// add: the kernel keyring key (type `user`) holding the passphrase.
    #[arg(long)]
    pub key_description: Option<String>,
    /// add: assign the token to no keyslot.
    #[arg(long)]
    pub unbound: bool,
    /// Print what was done.
    #[arg(long, short = 'v')]
    pub verbose: bool,
    /// Never ask for confirmation.
    #[arg(long, short = 'q')]
    pub batch_mode: bool,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

/// Runs a `token` action; its exit code.
pub fn run(a: TokenArgs) -> i32 {
    match act(&a) {
        Ok(()) => 0,
        Err(e) => {
            let e = CliError::Core(e);
            eprintln!("{}", e.message());
            e.exit_code()
        }
    }
}

fn act(a: &TokenArgs) -> Result<()> {
    let update = a.action != TokenAction::Export;
    let dev = match &a.header {
        Some(h) => crate::header_dev::open_header(h, update)?,
        None => a.device.open_header(update, &a.remote)?,
    };
    let name = match &a.header {
        Some(h) => h.display().to_string(),
        None => a.device.to_string(),
    };
    let not_luks2 =
        || Error::InvalidArgument(format!("Device {name} is not a valid LUKS2 device."));
    let mut hdr = match luks::read_header(dev.as_ref()) {
        Ok(Header::Luks2(h)) => h,
        Ok(Header::Luks1(_)) | Err(Error::NotLuks(_)) => return Err(not_luks2()),
        Err(e) => return Err(e),
    };
    if a.action == TokenAction::Export {
        let id = a.token_id.ok_or_else(|| usage("export needs --token-id"))?;
        return write_json(a.json_file.as_deref(), &hdr.token_json(id)?);
    }
    Header::Luks2(hdr.clone()).check_requirements()?;
    crate::in_use::refuse_if_served(
        &served_paths(a),
        "cannot change its tokens; stop that process first",
    )?;
    let (id, created) = match a.action {
        TokenAction::Add => {
            let desc = a
                .key_description
                .as_deref()
                .ok_or_else(|| usage("token add needs --key-description"))?;
            let id =
                hdr.add_keyring_token(a.token_id, desc, a.key_slot, a.unbound, a.token_replace)?;
            (id, true)
        }
        TokenAction::Import => {
            let token = read_json(a.json_file.as_deref())?;
            let id = hdr.import_token(a.token_id, token, a.token_replace)?;
            if let Some(s) = a.key_slot {
                hdr.assign_token(id, Some(s)).map_err(|_| {
                    Error::InvalidArgument(format!("Failed to assign token {id} to keyslot {s}."))
                })?;
            }
            (id, true)
        }
        TokenAction::Remove => {
            let id = a.token_id.ok_or_else(|| usage("remove needs --token-id"))?;
            hdr.remove_token(id)?;
            (id, false)
        }
        TokenAction::Unassign => {
            let (Some(id), Some(s)) = (a.token_id, a.key_slot) else {
                return Err(usage("unassign needs --token-id and --key-slot"));
            };
            hdr.unassign_token(id, s)?;
            (id, false)
        }
        TokenAction::Export => unreachable!("handled above"),
    };
    luks::apply(dev.as_ref(), &hdr.commit()?)?;
    if a.verbose {
        match (a.action, created) {
            (TokenAction::Unassign, _) => {}
            (_, true) => eprintln!("Token {id} created."),
            (_, false) => eprintln!("Token {id} removed."),
        }
        eprintln!("Command successful.");
    }
    Ok(())
}

fn usage(msg: &str) -> Error {
    Error::InvalidArgument(msg.to_string())
}

fn served_paths(a: &TokenArgs) -> Vec<&std::path::Path> {
    let mut paths: Vec<&std::path::Path> = a.header.iter().map(|h| h.as_path()).collect();
    if let Target::Path(p) = &a.device {
        paths.push(p);
    }
    paths
}

fn is_stdio(p: Option<&std::path::Path>) -> bool {
    p.is_none_or(|p| p.as_os_str() == "-")
}

/// A token object from `path` (or stdin), at most [`TOKEN_JSON_BYTES_MAX`] bytes.
fn read_json(path: Option<&std::path::Path>) -> Result<Map<String, Value>> {
    let mut text = Vec::new();
    let r = if is_stdio(path) {
        std::io::stdin()
            .take(TOKEN_JSON_BYTES_MAX + 1)
            .read_to_end(&mut text)
    } else {
        let p = path.expect("not stdio");
        std::fs::File::open(p).and_then(|f| f.take(TOKEN_JSON_BYTES_MAX + 1).read_to_end(&mut text))
    };
    r.map_err(|e| Error::io("reading the token JSON", e))?;
    if text.len() as u64 > TOKEN_JSON_BYTES_MAX {
        return Err(usage(&format!(
            "the token JSON is longer than {TOKEN_JSON_BYTES_MAX} bytes"
        )));
    }
    match serde_json::from_slice::<Value>(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(usage(
            "Failed to import token from file: not a JSON object.",
        )),
        Err(e) => Err(usage(&format!("Failed to import token from file: {e}."))),
    }
}

fn write_json(path: Option<&std::path::Path>, json: &str) -> Result<()> {
    if is_stdio(path) {
        let mut out = std::io::stdout().lock();
        return out
            .write_all(json.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| Error::io("writing the token JSON", e));
    }
    let p = path.expect("not stdio");
    std::fs::write(p, json).map_err(|e| Error::io(format!("writing {}", p.display()), e))
}

/// How an unlock may use tokens (cryptsetup's `--token-only`, `--token-id`, `--token-type`).
/// Without any of them, the header's keyring tokens are still tried first, as cryptsetup
/// tries every token before it asks for a passphrase.
#[derive(Args, Debug, Clone, Default)]
pub struct TokenOpts {
    /// Unlock only through a token; never ask for a passphrase.
    #[arg(long)]
    pub token_only: bool,
    /// Only this token may unlock.
    #[arg(long, value_name = "ID")]
    pub token_id: Option<u32>,
    /// Only tokens of this type may unlock (ucrypt runs luks2-keyring tokens).
    #[arg(long, value_name = "TYPE")]
    pub token_type: Option<String>,
}

impl TokenOpts {
    /// Whether only a token may unlock (no passphrase is asked for).
    pub fn only(&self) -> bool {
        self.token_only
    }

    /// The error of a `--token-only` unlock that found no token to unlock with
    /// ([`TokenOutcome::NoToken`]) or whose tokens failed ([`TokenOutcome::Failed`]).
    pub fn failure(&self, outcome: &TokenOutcome) -> CliError {
        match outcome {
            TokenOutcome::Failed => {
                CliError::TokenCannotUnlock(match (self.token_id, &self.token_type) {
                    (Some(id), _) => format!("Token {id}"),
                    (None, Some(t)) => format!("Token (type {t})"),
                    (None, None) => "Token".to_string(),
                })
            }
            _ => CliError::NoUsableToken(self.token_type.clone()),
        }
    }
}

/// What a token unlocked: the keyslot, the passphrase the kernel keyring held, the key.
pub struct TokenUnlock {
    pub slot: u32,
    pub passphrase: ucrypt::SecretBytes,
    pub key: luks::VolumeKey,
}

/// How trying the tokens ended.
pub enum TokenOutcome {
    Unlocked(TokenUnlock),
    /// Tokens were tried; none unlocked (the key was missing from the keyring, or no keyslot
    /// took its passphrase).
    Failed,
    /// No token that `opts` admits names a keyslot.
    NoToken,
}

/// Tries the header's keyring tokens that `opts` admits, each against the keyslots it names
/// (only `key_slot`, if given), as cryptsetup tries tokens before it asks for a passphrase.
pub fn unlock_by_token(
    header: &dyn ucrypt::backend::Backend,
    hdr: &Header,
    opts: &TokenOpts,
    key_slot: Option<u32>,
    key_use: luks::KeyUse,
) -> Result<TokenOutcome> {
    let Header::Luks2(h) = hdr else {
        return Ok(TokenOutcome::NoToken);
    };
    let filter = luks::luks2::TokenFilter {
        id: opts.token_id,
        kind: opts.token_type.clone(),
    };
    let tokens = h.keyring_tokens(&filter);
    if tokens.is_empty() {
        return Ok(TokenOutcome::NoToken);
    }
    for t in tokens {
        let Some(p) = crate::pass::keyring_passphrase(&t.key_description) else {
            continue;
        };
        for slot in t.keyslots.iter().copied() {
            if key_slot.is_some_and(|k| k != slot) {
                continue;
            }
            let try_it = luks::Unlock::Passphrase(ucrypt::SecretBytes::from_slice(p.as_ref()));
            match luks::unlock_key_for(header, hdr, try_it, Some(slot), key_use) {
                Ok((_, key)) => {
                    return Ok(TokenOutcome::Unlocked(TokenUnlock {
                        slot,
                        passphrase: p,
                        key,
                    }))
                }
                Err(Error::WrongPassphrase | Error::NoUsableKeyslot) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(TokenOutcome::Failed)
}
