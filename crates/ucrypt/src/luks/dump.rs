//! Human-readable header dump in the shape of `cryptsetup luksDump`: one function per printed
//! section, in the order cryptsetup prints them.
//!
//! Every section writes to a `String`, which cannot fail; the `fmt::Result`s exist only so
//! sections can use `?`, and [`dump`] discards the one it gets back.

use std::fmt::{self, Write as _};

use super::json::{DigestJson, KdfJson, Keyslot, SegmentSize};
use super::kdf::Kdf;
use super::luks1::{Luks1Header, Luks1Slot};
use super::luks2::KEYRING_TOKEN;
use super::util::b64_decode;
use super::{Header, Luks2Header, VolumeKey, TOKENS_MAX};
use crate::luks::json::{KdfKind, KeyslotKind};

/// Bytes as hex, 16 a line with `indent` before each further line; `indent` empty: one line.
fn hex_block(out: &mut String, bytes: &[u8], indent: &str) {
    for (i, b) in bytes.iter().enumerate() {
        if i > 0 && i % 16 == 0 && !indent.is_empty() {
            out.push('\n');
            out.push_str(indent);
        }
        let _ = write!(out, "{b:02x} ");
    }
    out.push('\n');
}

/// The dump text. With `vk`, prints the volume key instead (cryptsetup's
/// `--dump-volume-key` layout, including the "MK dump:" line scripts look for).
pub fn dump(hdr: &Header, device: &str, vk: Option<&VolumeKey>) -> String {
    let mut o = String::new();
    let _ = match (vk, hdr) {
        (Some(vk), _) => volume_key(&mut o, hdr, device, vk),
        (None, Header::Luks1(h)) => luks1(&mut o, h, device),
        (None, Header::Luks2(h)) => luks2(&mut o, h),
    };
    o
}

/// `--dump-volume-key`: the same for both versions.
fn volume_key(o: &mut String, hdr: &Header, device: &str, vk: &VolumeKey) -> fmt::Result {
    writeln!(o, "LUKS header information for {device}")?;
    if let Ok(l) = hdr.data_layout() {
        let (name, mode) = l.cipher.luks1_name_mode();
        writeln!(o, "Cipher name:   \t{name}")?;
        writeln!(o, "Cipher mode:   \t{mode}")?;
        writeln!(o, "Payload offset:\t{}", l.offset_bytes / 512)?;
    }
    writeln!(o, "UUID:          \t{}", hdr.uuid())?;
    writeln!(o, "MK bits:       \t{}", vk.len() * 8)?;
    o.push_str("MK dump:\t");
    hex_block(o, vk.bytes(), "\t\t");
    Ok(())
}

/// `luksDump --unbound --key-slot N`: keyslot `slot`'s unbound key in cryptsetup's layout;
/// `show_key` false leaves out the key itself (it went to a file).
pub fn dump_unbound(
    hdr: &Header,
    device: &str,
    slot: u32,
    key: &VolumeKey,
    show_key: bool,
) -> String {
    let mut o = String::new();
    let _ = unbound_key(&mut o, hdr, device, slot, key, show_key);
    o
}

fn unbound_key(
    o: &mut String,
    hdr: &Header,
    device: &str,
    slot: u32,
    key: &VolumeKey,
    show_key: bool,
) -> fmt::Result {
    writeln!(o, "LUKS header information for {device}")?;
    writeln!(o, "UUID:    \t{}", hdr.uuid())?;
    writeln!(o, "Keyslot: \t{slot}")?;
    writeln!(o, "Key bits:\t{}", key.len() * 8)?;
    if show_key {
        o.push_str("Unbound Key:\t");
        hex_block(o, key.bytes(), "\t\t");
    }
    Ok(())
}

// ---------------------------------------------------------------- LUKS1

fn luks1(o: &mut String, h: &Luks1Header, device: &str) -> fmt::Result {
    luks1_phdr(o, h, device)?;
    for (i, s) in h.slots.iter().enumerate() {
        luks1_keyslot(o, i, s)?;
    }
    Ok(())
}

/// The phdr fields: cipher, hash, payload offset, master key digest, UUID.
fn luks1_phdr(o: &mut String, h: &Luks1Header, device: &str) -> fmt::Result {
    writeln!(o, "LUKS header information for {device}\n")?;
    writeln!(o, "Version:       \t1")?;
    writeln!(o, "Cipher name:   \t{}", h.cipher_name)?;
    writeln!(o, "Cipher mode:   \t{}", h.cipher_mode)?;
    writeln!(o, "Hash spec:     \t{}", h.hash_spec)?;
    writeln!(o, "Payload offset:\t{}", h.payload_offset)?;
    writeln!(o, "MK bits:       \t{}", h.key_bytes * 8)?;
    // The digest on one line, the salt wrapped at 16 bytes, as cryptsetup prints them.
    o.push_str("MK digest:     \t");
    hex_block(o, &h.mk_digest, "");
    o.push_str("MK salt:       \t");
    hex_block(o, &h.mk_digest_salt, "               \t");
    writeln!(o, "MK iterations: \t{}", h.mk_digest_iterations)?;
    writeln!(o, "UUID:          \t{}\n", h.uuid)
}

fn luks1_keyslot(o: &mut String, i: usize, s: &Luks1Slot) -> fmt::Result {
    if !s.active {
        return writeln!(o, "Key Slot {i}: DISABLED");
    }
    writeln!(o, "Key Slot {i}: ENABLED")?;
    writeln!(o, "\tIterations:         \t{}", s.iterations)?;
    o.push_str("\tSalt:               \t");
    hex_block(o, &s.salt, "\t                      \t");
    writeln!(o, "\tKey material offset:\t{}", s.key_material_offset)?;
    writeln!(o, "\tAF stripes:            \t{}", s.stripes)
}

// ---------------------------------------------------------------- LUKS2

fn luks2(o: &mut String, h: &Luks2Header) -> fmt::Result {
    luks2_binary_and_config(o, h)?;
    luks2_segments(o, h)?;
    luks2_keyslots(o, h)?;
    luks2_tokens(o, h)?;
    luks2_digests(o, h)
}

/// The binary header's fields, then `config`: flags and requirements.
fn luks2_binary_and_config(o: &mut String, h: &Luks2Header) -> fmt::Result {
    writeln!(o, "LUKS header information")?;
    writeln!(o, "Version:       \t2")?;
    writeln!(o, "Epoch:         \t{}", h.bin.seqid)?;
    writeln!(o, "Metadata area: \t{} [bytes]", h.bin.hdr_size)?;
    writeln!(
        o,
        "Keyslots area: \t{} [bytes]",
        h.meta.config.keyslots_size.0
    )?;
    writeln!(o, "UUID:          \t{}", h.bin.uuid)?;
    let or_none = |s: &str, none: &'static str| if s.is_empty() { none } else { s }.to_string();
    writeln!(
        o,
        "Label:         \t{}",
        or_none(&h.bin.label, "(no label)")
    )?;
    writeln!(
        o,
        "Subsystem:     \t{}",
        or_none(&h.bin.subsystem, "(no subsystem)")
    )?;
    let flags = h.flags();
    writeln!(
        o,
        "Flags:       \t{}",
        if flags.is_empty() {
            "(no flags)".into()
        } else {
            // cryptsetup prints each flag followed by a space.
            flags.iter().map(|f| format!("{f} ")).collect::<String>()
        }
    )?;
    let req = h.meta.requirements();
    if !req.is_empty() {
        let names: String = req.iter().map(|r| format!("{r} ")).collect();
        writeln!(o, "Requirements:\t{names}")?;
    }
    Ok(())
}

fn luks2_segments(o: &mut String, h: &Luks2Header) -> fmt::Result {
    writeln!(o, "\nData segments:")?;
    // In numeric order, as cryptsetup prints them (the map's order is the keys' text order).
    let mut segs: Vec<_> = h.meta.segments.iter().collect();
    segs.sort_by_key(|(k, _)| k.parse::<u32>().unwrap_or(u32::MAX));
    for (k, s) in segs {
        writeln!(o, "  {k}: {}", s.kind)?;
        writeln!(o, "\toffset: {} [bytes]", s.offset.0)?;
        match s.size {
            SegmentSize::Dynamic => writeln!(o, "\tlength: (whole device)")?,
            SegmentSize::Bytes(n) => writeln!(o, "\tlength: {n} [bytes]")?,
        }
        // As cryptsetup: only a segment with an `encryption` field (a linear one has none).
        if let Some(e) = &s.encryption {
            writeln!(o, "\tcipher: {e}")?;
        }
        if let Some(ss) = s.sector_size {
            writeln!(o, "\tsector: {ss} [bytes]")?;
        }
        if let Some(i) = &s.integrity {
            writeln!(o, "\tintegrity: {}", i.kind)?;
            // cryptsetup 2.8 prints the recorded HMAC key size (bytes in the JSON) in bits.
            if let Some(k) = i.key_size {
                writeln!(o, "\tintegrity key size: {} [bits]", u64::from(k) * 8)?;
            }
        }
        // Reencryption marks its hotzone and backup segments.
        if let Some(f) = s.flags.as_ref().filter(|f| !f.is_empty()) {
            writeln!(o, "\tflags : {}", f.join(", "))?;
        }
        // Every segment ends with an empty line.
        writeln!(o)?;
    }
    Ok(())
}

fn luks2_keyslots(o: &mut String, h: &Luks2Header) -> fmt::Result {
    writeln!(o, "Keyslots:")?;
    for (k, ks) in &h.meta.keyslots {
        luks2_keyslot(o, h, k, ks)?;
    }
    Ok(())
}

fn luks2_keyslot(o: &mut String, h: &Luks2Header, k: &str, ks: &Keyslot) -> fmt::Result {
    let unbound = if keyslot_unbound(h, k) {
        " (unbound)"
    } else {
        ""
    };
    writeln!(o, "  {k}: {}{unbound}", ks.kind)?;
    writeln!(o, "\tKey:        {} bits", ks.key_size * 8)?;
    let prio = match ks.priority.unwrap_or(1) {
        0 => "ignored",
        1 => "normal",
        2 => "preferred",
        _ => "invalid",
    };
    writeln!(o, "\tPriority:   {prio}")?;
    if ks.kind == KeyslotKind::Reencrypt {
        reencrypt_keyslot(o, k, ks)?;
    }
    if let Some(a) = &ks.area {
        if let Some(e) = &a.encryption {
            writeln!(o, "\tCipher:     {e}")?;
        }
        if let Some(n) = a.key_size {
            writeln!(o, "\tCipher key: {} bits", n * 8)?;
        }
    }
    if let Some(kj) = &ks.kdf {
        luks2_keyslot_kdf(o, kj)?;
    }
    if let Some(af) = &ks.af {
        writeln!(o, "\tAF stripes: {}", af.stripes)?;
        writeln!(o, "\tAF hash:    {}", af.hash)?;
    }
    if let Some(a) = &ks.area {
        writeln!(o, "\tArea offset:{} [bytes]", a.offset.0)?;
        writeln!(o, "\tArea length:{} [bytes]", a.size.0)?;
    }
    if let Some((d, _)) = h.meta.digest_for_keyslot(k) {
        writeln!(o, "\tDigest ID:  {d}")?;
    }
    Ok(())
}

/// Whether cryptsetup calls a keyslot "unbound": its digest serves none of the live segments
/// (the backups a reencryption keeps do not count), where a segment's digest is the first
/// digest that lists it.
fn keyslot_unbound(h: &Luks2Header, k: &str) -> bool {
    let Some((mine, _)) = h.meta.digest_for_keyslot(k) else {
        return true;
    };
    let is_backup = |s: &super::json::Segment| {
        s.flags
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f.starts_with("backup-")))
    };
    !h.meta
        .segments
        .iter()
        .filter(|(_, s)| !is_backup(s))
        .any(|(id, _)| {
            h.meta
                .digests
                .iter()
                .find(|(_, d)| d.segments.contains(id))
                .is_some_and(|(d, _)| d == mine)
        })
}

/// The `reencrypt` keyslot's own fields, as cryptsetup prints them; one that does not parse is
/// shown with the reason.
fn reencrypt_keyslot(o: &mut String, k: &str, ks: &Keyslot) -> fmt::Result {
    use super::reencrypt::{parse_keyslot, Resilience};
    let r = match parse_keyslot(k.parse().unwrap_or(u32::MAX), ks) {
        Ok(r) => r,
        Err(e) => return writeln!(o, "\t(invalid reencrypt keyslot: {e})"),
    };
    writeln!(o, "\t{:<12}{}", "Mode:", r.mode.name())?;
    writeln!(o, "\t{:<12}{}", "Direction:", r.direction.name())?;
    writeln!(o, "\t{:<12}{}", "Resilience:", r.resilience.name())?;
    match &r.resilience {
        Resilience::Checksum { hash, sector_size } => {
            writeln!(o, "\t{:<12}{hash}", "Hash:")?;
            writeln!(o, "\t{:<12}{sector_size} [bytes]", "Hash data:")?;
        }
        // cryptsetup prints no space before "[bytes]" here, and shows the shift only for the
        // plain datashift type.
        Resilience::Datashift { shift_size } => {
            writeln!(o, "\t{:<12}{shift_size}[bytes]", "Shift size:")?;
        }
        _ => {}
    }
    Ok(())
}

/// A keyslot's KDF as typed parameters; one that does not parse is shown with the reason
/// rather than hidden, since a dump is how a user finds out what is wrong with a header.
fn luks2_keyslot_kdf(o: &mut String, kj: &KdfJson) -> fmt::Result {
    writeln!(o, "\tPBKDF:      {}", kj.kind)?;
    match super::json::kdf_from_json(kj) {
        Ok(Kdf::Pbkdf2 {
            hash, iterations, ..
        }) => {
            writeln!(o, "\tHash:       {}", hash.name())?;
            writeln!(o, "\tIterations: {iterations}")?;
        }
        Ok(Kdf::Argon2 { cost, .. }) => {
            writeln!(o, "\tTime cost:  {}", cost.time)?;
            writeln!(o, "\tMemory:     {}", cost.memory_kib)?;
            writeln!(o, "\tThreads:    {}", cost.cpus)?;
        }
        Err(_) if matches!(kj.kind, KdfKind::Other(_)) => {
            // A type the header may name but ucrypt cannot run ("argon2", an old name): its
            // fields as stored, as cryptsetup shows them.
            if let Some(h) = &kj.hash {
                writeln!(o, "\tHash:       {h}")?;
            }
            let fields = [
                ("Iterations: ", kj.iterations),
                ("Time cost:  ", kj.time),
                ("Memory:     ", kj.memory),
                ("Threads:    ", kj.cpus),
            ];
            for (name, v) in fields {
                if let Some(v) = v {
                    writeln!(o, "\t{name}{v}")?;
                }
            }
            writeln!(o, "\t(unknown PBKDF type: this keyslot cannot be unlocked)")?;
        }
        Err(e) => writeln!(o, "\t(invalid kdf: {e})")?,
    }
    if let Some(s) = b64_decode(&kj.salt) {
        o.push_str("\tSalt:       ");
        hex_block(o, &s, "\t            ");
    }
    Ok(())
}

/// Tokens by id, as cryptsetup prints them: the type, what the built-in keyring type names,
/// then each keyslot the token unlocks.
fn luks2_tokens(o: &mut String, h: &Luks2Header) -> fmt::Result {
    writeln!(o, "Tokens:")?;
    for id in 0..TOKENS_MAX {
        let Some(t) = h.token(id) else { continue };
        let ty = t.get("type").and_then(|v| v.as_str()).unwrap_or("");
        writeln!(o, "  {id}: {ty}")?;
        if ty == KEYRING_TOKEN {
            if let Some(d) = t.get("key_description").and_then(|v| v.as_str()) {
                writeln!(o, "\tKey description: {d}")?;
            }
        }
        for s in t
            .get("keyslots")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
        {
            let s = s.as_str().map_or_else(|| s.to_string(), str::to_string);
            writeln!(o, "\tKeyslot:    {s}")?;
        }
    }
    Ok(())
}

fn luks2_digests(o: &mut String, h: &Luks2Header) -> fmt::Result {
    writeln!(o, "Digests:")?;
    for (k, d) in &h.meta.digests {
        luks2_digest(o, k, d)?;
    }
    Ok(())
}

fn luks2_digest(o: &mut String, k: &str, d: &DigestJson) -> fmt::Result {
    writeln!(o, "  {k}: {}", d.kind)?;
    if let Some(hh) = &d.hash {
        writeln!(o, "\tHash:       {hh}")?;
    }
    if let Some(i) = d.iterations {
        writeln!(o, "\tIterations: {i}")?;
    }
    if let Some(s) = d.salt.as_deref().and_then(b64_decode) {
        o.push_str("\tSalt:       ");
        hex_block(o, &s, "\t            ");
    }
    if let Some(s) = d.digest.as_deref().and_then(b64_decode) {
        o.push_str("\tDigest:     ");
        hex_block(o, &s, "\t            ");
    }
    Ok(())
}

/// cryptsetup's `luksDump --dump-json-metadata`: the LUKS2 metadata as indented JSON, keys in
/// the header's order.
pub fn dump_json(h: &Luks2Header) -> String {
    let mut s = serde_json::to_string_pretty(h.meta()).unwrap_or_default();
    s.push('\n');
    s
}
