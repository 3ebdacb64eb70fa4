//! LUKS2 tokens: JSON objects a header carries for other programs (systemd's TPM2, FIDO2,
//! PKCS#11 and recovery tokens, cryptsetup's keyring token), each with a `type` and the
//! keyslots it unlocks. ucrypt keeps every token as it is, key order included, and changes one
//! only when asked (cryptsetup's `token add|import|remove|unassign`).
//!
//! One token type is built in, as in cryptsetup: `luks2-keyring`, whose passphrase is a
//! `user` key in the kernel keyring named by its `key_description`
//! ([`Luks2Header::keyring_tokens`] lists the ones that may unlock). A type starting with
//! `luks2-` is reserved for built-in types: any other such type is refused on import.

use serde_json::{Map, Value};

use super::Luks2Header;
use crate::luks::TOKENS_MAX;
use crate::{Error, Result};

/// The built-in token type whose passphrase is in the kernel keyring.
pub const KEYRING_TOKEN: &str = "luks2-keyring";

/// A keyring token that may unlock: its id, the key it names and the keyslots it unlocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyringToken {
    pub id: u32,
    pub key_description: String,
    pub keyslots: Vec<u32>,
}

/// Which tokens an unlock may use (cryptsetup's `--token-id`, `--token-type`).
#[derive(Debug, Clone, Default)]
pub struct TokenFilter {
    pub id: Option<u32>,
    pub kind: Option<String>,
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

impl Luks2Header {
    /// Token `id`'s JSON, as stored.
    pub fn token(&self, id: u32) -> Option<&Map<String, Value>> {
        self.meta.tokens.get(&id.to_string())
    }

    /// Token `id` as cryptsetup's `token export` prints it: compact JSON in the token's own
    /// key order, no newline.
    pub fn token_json(&self, id: u32) -> Result<String> {
        let t = self
            .token(id)
            .ok_or_else(|| invalid(format!("Failed to get token {id} for export.")))?;
        serde_json::to_string(t).map_err(|e| invalid(format!("token {id}: {e}")))
    }

    /// The first unused token id, or the given one if it is free (or `replace` lets it be
    /// taken). Ids are checked as cryptsetup's `token add|import` checks them.
    fn token_slot_for(&self, id: Option<u32>, replace: bool) -> Result<u32> {
        match id {
            Some(i) if i >= TOKENS_MAX => Err(invalid(format!("Token {i} is invalid."))),
            Some(i) if !replace && self.meta.tokens.contains_key(&i.to_string()) => {
                Err(invalid(format!("Token {i} in use.")))
            }
            Some(i) => Ok(i),
            None => (0..TOKENS_MAX)
                .find(|i| !self.meta.tokens.contains_key(&i.to_string()))
                .ok_or_else(|| invalid("All tokens are in use.".into())),
        }
    }

    /// Adds a token (`id`, or the first free one; `replace` lets it take an id in use), as
    /// cryptsetup's `token import` does: the object needs a string `type` and a `keyslots`
    /// array naming keyslots of this header; a `luks2-` type must be a built-in one and valid
    /// as such. Returns the id; [`Luks2Header::commit`] writes it.
    pub fn import_token(
        &mut self,
        id: Option<u32>,
        token: Map<String, Value>,
        replace: bool,
    ) -> Result<u32> {
        let id = self.token_slot_for(id, replace)?;
        let Some(Value::String(kind)) = token.get("type") else {
            return Err(invalid("the token has no string 'type'".into()));
        };
        if kind == KEYRING_TOKEN {
            match token.get("key_description") {
                Some(Value::String(d)) if !d.is_empty() => {}
                _ => {
                    return Err(invalid(format!(
                        "a {KEYRING_TOKEN} token needs a non-empty string 'key_description'"
                    )))
                }
            }
        } else if kind.starts_with("luks2-") {
            return Err(invalid(format!(
                "token type '{kind}' is reserved for a built-in type ucrypt does not have"
            )));
        }
        let Some(Value::Array(slots)) = token.get("keyslots") else {
            return Err(invalid("the token has no 'keyslots' array".into()));
        };
        for s in slots {
            match s {
                Value::String(s) if self.meta.keyslots.contains_key(s) => {}
                other => {
                    return Err(invalid(format!(
                        "the token names keyslot {other}, which is not in use"
                    )))
                }
            }
        }
        self.meta.tokens.insert(id.to_string(), token);
        Ok(id)
    }

    /// cryptsetup's `token add --key-description DESC`: a `luks2-keyring` token, assigned to
    /// `keyslot` (or, with `None`, to every keyslot) unless `unbound`.
    pub fn add_keyring_token(
        &mut self,
        id: Option<u32>,
        key_description: &str,
        keyslot: Option<u32>,
        unbound: bool,
        replace: bool,
    ) -> Result<u32> {
        if let Some(s) = keyslot {
            if !self.meta.keyslots.contains_key(&s.to_string()) {
                return Err(invalid(format!("Keyslot {s} is not active.")));
            }
        }
        let mut t = Map::new();
        t.insert("type".into(), Value::String(KEYRING_TOKEN.into()));
        t.insert("keyslots".into(), Value::Array(Vec::new()));
        t.insert(
            "key_description".into(),
            Value::String(key_description.into()),
        );
        let id = self.import_token(id, t, replace)?;
        if !unbound {
            self.assign_token(id, keyslot)?;
        }
        Ok(id)
    }

    /// Assigns token `id` to `keyslot` (or to every keyslot), keeping the order of the
    /// keyslots it already names.
    pub fn assign_token(&mut self, id: u32, keyslot: Option<u32>) -> Result<()> {
        let slots: Vec<String> = match keyslot {
            Some(s) if self.meta.keyslots.contains_key(&s.to_string()) => vec![s.to_string()],
            Some(s) => return Err(invalid(format!("Keyslot {s} is not active."))),
            None => self.meta.keyslots.keys().cloned().collect(),
        };
        let list = self.token_keyslots_mut(id)?;
        for s in slots {
            if !list.iter().any(|v| v.as_str() == Some(&s)) {
                list.push(Value::String(s));
            }
        }
        Ok(())
    }

    /// cryptsetup's `token unassign --token-id ID --key-slot N`.
    pub fn unassign_token(&mut self, id: u32, keyslot: u32) -> Result<()> {
        let name = keyslot.to_string();
        let list = self
            .token_keyslots_mut(id)
            .map_err(|_| invalid(format!("Token {id} is not assigned to keyslot {keyslot}.")))?;
        let before = list.len();
        list.retain(|v| v.as_str() != Some(&name));
        if list.len() == before {
            return Err(invalid(format!(
                "Token {id} is not assigned to keyslot {keyslot}."
            )));
        }
        Ok(())
    }

    fn token_keyslots_mut(&mut self, id: u32) -> Result<&mut Vec<Value>> {
        match self
            .meta
            .tokens
            .get_mut(&id.to_string())
            .and_then(|t| t.get_mut("keyslots"))
        {
            Some(Value::Array(a)) => Ok(a),
            _ => Err(invalid(format!("Token {id} is not in use."))),
        }
    }

    /// Removes token `id` (cryptsetup's `token remove`).
    pub fn remove_token(&mut self, id: u32) -> Result<()> {
        if id >= TOKENS_MAX {
            return Err(invalid(format!("Token {id} is invalid.")));
        }
        self.meta
            .tokens
            .remove(&id.to_string())
            .map(|_| ())
            .ok_or_else(|| invalid(format!("Token {id} is not in use.")))
    }

    /// The keyring tokens `filter` admits that name at least one keyslot, by id. A filter on
    /// another type admits none: ucrypt runs no other token type.
    pub fn keyring_tokens(&self, filter: &TokenFilter) -> Vec<KeyringToken> {
        let mut out: Vec<KeyringToken> = self
            .meta
            .tokens
            .iter()
            .filter_map(|(k, t)| {
                let id: u32 = k.parse().ok()?;
                if filter.id.is_some_and(|f| f != id) {
                    return None;
                }
                let kind = t.get("type")?.as_str()?;
                if kind != KEYRING_TOKEN || filter.kind.as_deref().is_some_and(|f| f != kind) {
                    return None;
                }
                let key_description = t.get("key_description")?.as_str()?.to_string();
                let keyslots: Vec<u32> = t
                    .get("keyslots")?
                    .as_array()?
                    .iter()
                    .filter_map(|v| v.as_str()?.parse().ok())
                    .collect();
                (!keyslots.is_empty()).then_some(KeyringToken {
                    id,
                    key_description,
                    keyslots,
                })
            })
            .collect();
        out.sort_by_key(|t| t.id);
        out
    }
}
