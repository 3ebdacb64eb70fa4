//! LUKS2 settings a user changes in place (cryptsetup's `config`, `luksUUID --uuid`): label,
//! subsystem, UUID, a keyslot's priority and the persistent activation flags. Each setter
//! checks its input and changes the header in memory; [`Luks2Header::commit`] turns the
//! change into a write plan. Unknown flags (a newer cryptsetup's) are kept.

use super::Luks2Header;
use crate::luks::json::KNOWN_FLAGS;
use crate::luks::util::check_uuid;
use crate::{Error, Result};

/// The binary header's label and subsystem fields hold this many bytes and a NUL.
const LABEL_BYTES_MAX: usize = 47;

/// A keyslot's priority, as cryptsetup's `config --priority` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// Tried only when named (`--key-slot`): 0 on disk.
    Ignore,
    /// The default: no priority field on disk.
    Normal,
    /// Tried before the normal ones: 2 on disk.
    Prefer,
}

impl std::str::FromStr for Priority {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "ignore" => Ok(Priority::Ignore),
            "normal" => Ok(Priority::Normal),
            "prefer" => Ok(Priority::Prefer),
            other => Err(Error::InvalidArgument(format!(
                "priority '{other}' (prefer, normal, ignore)"
            ))),
        }
    }
}

fn short_field(what: &str, s: &str) -> Result<String> {
    if s.len() > LABEL_BYTES_MAX || s.contains('\0') {
        return Err(Error::InvalidArgument(format!(
            "{what} '{s}' is longer than {LABEL_BYTES_MAX} bytes or holds a NUL"
        )));
    }
    Ok(s.to_string())
}

impl Luks2Header {
    /// The persistent activation flags (`config.flags`).
    pub fn flags(&self) -> Vec<String> {
        self.meta.config.flags.clone().unwrap_or_default()
    }

    pub fn set_label(&mut self, label: &str) -> Result<()> {
        self.bin.label = short_field("label", label)?;
        Ok(())
    }

    pub fn set_subsystem(&mut self, subsystem: &str) -> Result<()> {
        self.bin.subsystem = short_field("subsystem", subsystem)?;
        Ok(())
    }

    /// Sets the UUID (checked for cryptsetup's form, stored lowercase).
    pub fn set_uuid(&mut self, uuid: &str) -> Result<()> {
        check_uuid(uuid)?;
        self.bin.uuid = uuid.to_lowercase();
        Ok(())
    }

    pub fn set_keyslot_priority(&mut self, slot: u32, priority: Priority) -> Result<()> {
        let ks = self
            .meta
            .keyslots
            .get_mut(&slot.to_string())
            .ok_or(Error::Keyslot {
                slot,
                reason: "keyslot is not in use".into(),
            })?;
        ks.priority = match priority {
            Priority::Ignore => Some(0),
            Priority::Normal => None,
            Priority::Prefer => Some(2),
        };
        Ok(())
    }

    /// Replaces the persistent activation flags ucrypt knows with `flags` (each one of
    /// [`KNOWN_FLAGS`]), keeping the unknown ones a newer cryptsetup stored.
    pub fn set_persistent_flags(&mut self, flags: &[&str]) -> Result<()> {
        if let Some(f) = flags.iter().find(|f| !KNOWN_FLAGS.contains(f)) {
            return Err(Error::InvalidArgument(format!(
                "unknown activation flag '{f}' ({})",
                KNOWN_FLAGS.join(", ")
            )));
        }
        let mut all: Vec<String> = self
            .flags()
            .into_iter()
            .filter(|f| !KNOWN_FLAGS.contains(&f.as_str()))
            .collect();
        all.extend(flags.iter().map(|f| f.to_string()));
        self.meta.config.flags = if all.is_empty() { None } else { Some(all) };
        Ok(())
    }
}
