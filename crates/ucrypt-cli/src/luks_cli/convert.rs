//! Header-only verbs that rewrite keyslots or the whole header in place: `convert` (LUKS1 ↔
//! LUKS2), `luksConvertKey` (a keyslot's PBKDF) and `erase` (every keyslot), with cryptsetup's
//! words, confirmations and exit codes. The plans are the library's
//! (`ucrypt::luks::convert`, the keyslot updates); this file reads, confirms and applies.

use std::path::PathBuf;

use ucrypt::luks::convert::{self as conv, ConvertTo, MetadataDevice};
use ucrypt::luks::{self, Header, KeyUse};
use ucrypt::{Error, Result};

use super::{existing_source, header_name, kdf_request, load, refuse_if_served, LuksOpts};
use crate::pass;
use crate::target::Target;

/// The header device as a local path (the `--header` file, or the volume itself).
fn local_header_path(device: &Target, o: &LuksOpts) -> Option<PathBuf> {
    match (&o.header, device) {
        (Some(h), _) => Some(h.clone()),
        (None, Target::Path(p)) => Some(p.clone()),
        _ => None,
    }
}

/// `convert --type luks1|luks2 DEVICE` (cryptsetup's `convert`).
pub(super) fn convert(device: &Target, o: &LuksOpts) -> Result<i32> {
    let to = match o.luks_type.as_deref() {
        Some("luks2") => ConvertTo::Luks2,
        Some("luks1") => ConvertTo::Luks1,
        _ => {
            return Err(Error::InvalidArgument(
                "Invalid LUKS type, only luks1 and luks2 are supported.".into(),
            ))
        }
    };
    let name = header_name(device, o);
    let (dev, hdr) = load(device, o, true)?;
    let already = matches!(
        (&hdr, to),
        (Header::Luks1(_), ConvertTo::Luks1) | (Header::Luks2(_), ConvertTo::Luks2)
    );
    if already {
        return Err(Error::InvalidArgument(format!(
            "Device is already {} type.",
            to.name()
        )));
    }
    pass::confirm(
        o.batch_mode,
        &format!(
            "This operation will convert {name} to {} format.\n",
            to.name()
        ),
    )?;
    // A serving process holds the header it opened and may write it back.
    refuse_if_served(
        device,
        o,
        "cannot convert it while it is in use; stop that process first",
    )?;
    let path = local_header_path(device, o);
    let growable = path
        .as_deref()
        .and_then(|p| std::fs::metadata(p).ok())
        .is_some_and(|m| m.is_file());
    let md = MetadataDevice {
        size_bytes: dev.size(),
        growable,
    };
    let plan = conv::convert(&hdr, to, md, &mut |off, len| {
        luks::read_area(dev.as_ref(), off, len)
    })?;
    if plan.device_bytes_needed > dev.size() {
        // Only a regular file gets here (`growable`): it grows as cryptsetup fallocates it.
        let Some(p) = &path else {
            return Err(Error::Bug(
                "a device that cannot grow passed the space check",
            ));
        };
        std::fs::OpenOptions::new()
            .write(true)
            .open(p)
            .and_then(|f| f.set_len(plan.device_bytes_needed))
            .map_err(|e| Error::io(format!("growing {}", p.display()), e))?;
        dev.refresh_size()?;
    }
    luks::apply(dev.as_ref(), &plan.ops)?;
    Ok(0)
}

/// `luksConvertKey DEVICE [KEY_FILE]`: keyslot `--key-slot` (or the one the passphrase opens)
/// gets the PBKDF the options ask for (cryptsetup's defaults otherwise), same passphrase and
/// number. LUKS2 only, as in cryptsetup.
pub(super) fn convert_key(device: &Target, key_file: Option<&str>, o: &LuksOpts) -> Result<i32> {
    let (dev, mut hdr) = load(device, o, true)?;
    let Header::Luks2(_) = &hdr else {
        return Err(Error::InvalidArgument(format!(
            "Device {} is not a valid LUKS2 device.",
            header_name(device, o)
        )));
    };
    hdr.check_requirements()?;
    let area = super::keyslot_area::for_header(o, &hdr)?;
    if let Some(slot) = o.key_slot {
        if !hdr.active_keyslots().contains(&slot) {
            return Err(Error::InvalidArgument(format!(
                "Keyslot {slot} is not active."
            )));
        }
    }
    let kdf = kdf_request(o, 2)?;
    let src = existing_source(o, key_file);
    let passphrase = pass::read_passphrase(
        &src,
        "Enter passphrase for keyslot to be converted: ",
        false,
    )?;
    let (slot, vk) = match luks::unlock_key_for(
        dev.as_ref(),
        &hdr,
        luks::Unlock::Passphrase(ucrypt::SecretBytes::from_slice(passphrase.as_ref())),
        o.key_slot,
        KeyUse::AnySegment,
    )? {
        (Some(slot), vk) => (slot, vk),
        (None, _) => return Err(Error::Bug("a passphrase unlock named no keyslot")),
    };
    let Header::Luks2(h) = &mut hdr else {
        return Err(Error::Bug("checked LUKS2 above"));
    };
    let (id, ops) = h.change_keyslot(slot, &vk, passphrase.as_ref(), &kdf, area)?;
    luks::apply(dev.as_ref(), &ops)?;
    if o.verbose {
        eprintln!("Key slot {id} created.");
    }
    Ok(0)
}

/// `erase DEVICE` / `luksErase`: every keyslot that opens the data is destroyed (header entry
/// removed, material overwritten), as cryptsetup does; unbound keyslots stay, as in
/// cryptsetup, since they hold no volume key.
pub(super) fn erase(device: &Target, o: &LuksOpts) -> Result<i32> {
    let name = header_name(device, o);
    let (dev, mut hdr) = load(device, o, true)?;
    pass::confirm(
        o.batch_mode,
        &format!(
            "This operation will erase all keyslots on device {name}.\nDevice will become \
             unusable after this operation."
        ),
    )?;
    let bound: Vec<u32> = match &hdr {
        Header::Luks1(_) => hdr.active_keyslots(),
        Header::Luks2(h) => hdr
            .active_keyslots()
            .into_iter()
            .filter(|k| {
                h.meta()
                    .digest_for_keyslot(&k.to_string())
                    .is_some_and(|(_, d)| !d.segments.is_empty())
            })
            .collect(),
    };
    for slot in bound {
        let ops = hdr.remove_keyslot(slot)?;
        luks::apply(dev.as_ref(), &ops)?;
        if o.verbose {
            eprintln!("Key slot {slot} removed.");
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_path_is_the_header_file_or_the_volume() {
        let o = LuksOpts {
            header: Some("/tmp/h".into()),
            ..Default::default()
        };
        let v: Target = "/tmp/v".parse().expect("path");
        assert_eq!(local_header_path(&v, &o), Some(PathBuf::from("/tmp/h")));
        assert_eq!(
            local_header_path(&v, &LuksOpts::default()),
            Some(PathBuf::from("/tmp/v"))
        );
    }
}
