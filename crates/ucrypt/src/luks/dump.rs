//! Human-readable header dump in the shape of `cryptsetup luksDump`.

use std::fmt::Write as _;

use super::json::SegmentSize;
use super::kdf::Kdf;
use super::util::b64_decode;
use super::{Header, VolumeKey};

fn hex_block(out: &mut String, bytes: &[u8], indent: &str) {
    for (i, b) in bytes.iter().enumerate() {
        if i > 0 && i % 16 == 0 {
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
    if let Some(vk) = vk {
        let _ = writeln!(o, "LUKS header information for {device}");
        if let Ok(l) = hdr.data_layout() {
            let (name, mode) = l.cipher.luks1_name_mode();
            let _ = writeln!(o, "Cipher name:   \t{name}");
            let _ = writeln!(o, "Cipher mode:   \t{mode}");
            let _ = writeln!(o, "Payload offset:\t{}", l.offset_bytes / 512);
        }
        let _ = writeln!(o, "UUID:          \t{}", hdr.uuid());
        let _ = writeln!(o, "MK bits:       \t{}", vk.len() * 8);
        o.push_str("MK dump:\t");
        hex_block(&mut o, vk.bytes(), "\t\t");
        return o;
    }
    match hdr {
        Header::Luks1(h) => {
            let _ = writeln!(o, "LUKS header information for {device}\n");
            let _ = writeln!(o, "Version:       \t1");
            let _ = writeln!(o, "Cipher name:   \t{}", h.cipher_name);
            let _ = writeln!(o, "Cipher mode:   \t{}", h.cipher_mode);
            let _ = writeln!(o, "Hash spec:     \t{}", h.hash_spec);
            let _ = writeln!(o, "Payload offset:\t{}", h.payload_offset);
            let _ = writeln!(o, "MK bits:       \t{}", h.key_bytes * 8);
            o.push_str("MK digest:     \t");
            hex_block(&mut o, &h.mk_digest, "               \t");
            o.push_str("MK salt:       \t");
            hex_block(&mut o, &h.mk_digest_salt, "               \t");
            let _ = writeln!(o, "MK iterations: \t{}", h.mk_digest_iterations);
            let _ = writeln!(o, "UUID:          \t{}\n", h.uuid);
            for (i, s) in h.slots.iter().enumerate() {
                if s.active {
                    let _ = writeln!(o, "Key Slot {i}: ENABLED");
                    let _ = writeln!(o, "\tIterations:         \t{}", s.iterations);
                    o.push_str("\tSalt:               \t");
                    hex_block(&mut o, &s.salt, "\t                      \t");
                    let _ = writeln!(o, "\tKey material offset:\t{}", s.key_material_offset);
                    let _ = writeln!(o, "\tAF stripes:            \t{}", s.stripes);
                } else {
                    let _ = writeln!(o, "Key Slot {i}: DISABLED");
                }
            }
        }
        Header::Luks2(h) => {
            let _ = writeln!(o, "LUKS header information");
            let _ = writeln!(o, "Version:       \t2");
            let _ = writeln!(o, "Epoch:         \t{}", h.bin.seqid);
            let _ = writeln!(o, "Metadata area: \t{} [bytes]", h.bin.hdr_size);
            let _ = writeln!(
                o,
                "Keyslots area: \t{} [bytes]",
                h.meta.config.keyslots_size.0
            );
            let _ = writeln!(o, "UUID:          \t{}", h.bin.uuid);
            let lbl = |s: &str, none: &str| {
                if s.is_empty() {
                    none.to_string()
                } else {
                    s.to_string()
                }
            };
            let _ = writeln!(o, "Label:         \t{}", lbl(&h.bin.label, "(no label)"));
            let _ = writeln!(
                o,
                "Subsystem:     \t{}",
                lbl(&h.bin.subsystem, "(no subsystem)")
            );
            let flags = h.flags();
            let _ = writeln!(
                o,
                "Flags:       \t{}",
                if flags.is_empty() {
                    "(no flags)".into()
                } else {
                    flags.join(" ")
                }
            );
            let req = h.meta.requirements();
            if !req.is_empty() {
                let _ = writeln!(o, "Requirements:\t{}", req.join(" "));
            }
            let _ = writeln!(o, "\nData segments:");
            for (k, s) in &h.meta.segments {
                let _ = writeln!(o, "  {k}: {}", s.kind);
                let _ = writeln!(o, "\toffset: {} [bytes]", s.offset.0);
                match s.size {
                    SegmentSize::Dynamic => {
                        let _ = writeln!(o, "\tlength: (whole device)");
                    }
                    SegmentSize::Bytes(n) => {
                        let _ = writeln!(o, "\tlength: {n} [bytes]");
                    }
                }
                if let Some(e) = &s.encryption {
                    let _ = writeln!(o, "\tcipher: {e}");
                }
                if let Some(ss) = s.sector_size {
                    let _ = writeln!(o, "\tsector: {ss} [bytes]");
                }
            }
            let _ = writeln!(o, "\nKeyslots:");
            for (k, ks) in &h.meta.keyslots {
                let _ = writeln!(o, "  {k}: {}", ks.kind);
                let _ = writeln!(o, "\tKey:        {} bits", ks.key_size * 8);
                let prio = match ks.priority.unwrap_or(1) {
                    0 => "ignored",
                    2 => "prefer",
                    _ => "normal",
                };
                let _ = writeln!(o, "\tPriority:   {prio}");
                if let Some(a) = &ks.area {
                    if let Some(e) = &a.encryption {
                        let _ = writeln!(o, "\tCipher:     {e}");
                    }
                    if let Some(n) = a.key_size {
                        let _ = writeln!(o, "\tCipher key: {} bits", n * 8);
                    }
                }
                if let Some(kj) = &ks.kdf {
                    let _ = writeln!(o, "\tPBKDF:      {}", kj.kind);
                    match super::json::kdf_from_json(kj) {
                        Ok(Kdf::Pbkdf2 {
                            hash, iterations, ..
                        }) => {
                            let _ = writeln!(o, "\tHash:       {}", hash.name());
                            let _ = writeln!(o, "\tIterations: {iterations}");
                        }
                        Ok(Kdf::Argon2 {
                            time,
                            memory_kib,
                            cpus,
                            ..
                        }) => {
                            let _ = writeln!(o, "\tTime cost:  {time}");
                            let _ = writeln!(o, "\tMemory:     {memory_kib}");
                            let _ = writeln!(o, "\tThreads:    {cpus}");
                        }
                        Err(e) => {
                            let _ = writeln!(o, "\t(invalid kdf: {e})");
                        }
                    }
                    if let Some(s) = b64_decode(&kj.salt) {
                        o.push_str("\tSalt:       ");
                        hex_block(&mut o, &s, "\t            ");
                    }
                }
                if let Some(af) = &ks.af {
                    let _ = writeln!(o, "\tAF stripes: {}", af.stripes);
                    let _ = writeln!(o, "\tAF hash:    {}", af.hash);
                }
                if let Some(a) = &ks.area {
                    let _ = writeln!(o, "\tArea offset:{} [bytes]", a.offset.0);
                    let _ = writeln!(o, "\tArea length:{} [bytes]", a.size.0);
                }
                if let Some((d, _)) = h.meta.digest_for_keyslot(k) {
                    let _ = writeln!(o, "\tDigest ID:  {d}");
                }
            }
            let _ = writeln!(o, "Tokens:");
            for (k, t) in &h.meta.tokens {
                let ty = t.get("type").and_then(|v| v.as_str()).unwrap_or("?");
                let _ = writeln!(o, "  {k}: {ty}");
            }
            let _ = writeln!(o, "Digests:");
            for (k, d) in &h.meta.digests {
                let _ = writeln!(o, "  {k}: {}", d.kind);
                if let Some(hh) = &d.hash {
                    let _ = writeln!(o, "\tHash:       {hh}");
                }
                if let Some(i) = d.iterations {
                    let _ = writeln!(o, "\tIterations: {i}");
                }
                if let Some(s) = d.salt.as_deref().and_then(b64_decode) {
                    o.push_str("\tSalt:       ");
                    hex_block(&mut o, &s, "\t            ");
                }
                if let Some(s) = d.digest.as_deref().and_then(b64_decode) {
                    o.push_str("\tDigest:     ");
                    hex_block(&mut o, &s, "\t            ");
                }
            }
        }
    }
    o
}
