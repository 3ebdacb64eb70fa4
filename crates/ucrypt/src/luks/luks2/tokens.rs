//! LUKS2 tokens: JSON objects a header carries for other programs (systemd's TPM2, FIDO2,
//! PKCS#11 and recovery tokens, cryptsetup's keyring token), each with a `type` and the
//! keyslots it unlocks. ucrypt keeps every token as it is and changes one only when asked
//! (cryptsetup's `token import`, `token remove`).

use serde_json::{Map, Value};

use super::Luks2Header;
use crate::luks::TOKENS_MAX;
use crate::{Error, Result};

impl Luks2Header {
    /// Token `id`'s JSON, as stored.
    pub fn token(&self, id: u32) -> Option<&Map<String, Value>> {
        self.meta.tokens.get(&id.to_string())
    }

    /// Adds a token (`id`, or the first free one; `replace` lets it take an id in use), as
    /// cryptsetup's `token import` does: the object needs a string `type` and a `keyslots`
    /// array naming keyslots of this header. Returns the id; [`Luks2Header::commit`] writes it.
    pub fn import_token(
        &mut self,
        id: Option<u32>,
        token: Map<String, Value>,
        replace: bool,
    ) -> Result<u32> {
        let id = match id {
            Some(i) if i >= TOKENS_MAX => {
                return Err(Error::InvalidArgument(format!(
                    "token id {i} is out of range (0..{TOKENS_MAX})"
                )))
            }
            Some(i) if !replace && self.meta.tokens.contains_key(&i.to_string()) => {
                return Err(Error::InvalidArgument(format!("Token {i} is in use.")))
            }
            Some(i) => i,
            None => (0..TOKENS_MAX)
                .find(|i| !self.meta.tokens.contains_key(&i.to_string()))
                .ok_or_else(|| Error::InvalidArgument("all tokens are in use".into()))?,
        };
        if !matches!(token.get("type"), Some(Value::String(_))) {
            return Err(Error::InvalidArgument(
                "the token has no string 'type'".into(),
            ));
        }
        let Some(Value::Array(slots)) = token.get("keyslots") else {
            return Err(Error::InvalidArgument(
                "the token has no 'keyslots' array".into(),
            ));
        };
        for s in slots {
            match s {
                Value::String(s) if self.meta.keyslots.contains_key(s) => {}
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "the token names keyslot {other}, which is not in use"
                    )))
                }
            }
        }
        self.meta.tokens.insert(id.to_string(), token);
        Ok(id)
    }

    /// Removes token `id` (cryptsetup's `token remove`).
    pub fn remove_token(&mut self, id: u32) -> Result<()> {
        self.meta
            .tokens
            .remove(&id.to_string())
            .map(|_| ())
            .ok_or_else(|| Error::InvalidArgument(format!("Token {id} is not in use.")))
    }
}
