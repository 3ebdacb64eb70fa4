use super::*;

fn quick() -> Options {
    // TrueCrypt's SHA-512 KDF (1000 iterations) only: a fast search.
    Options {
        veracrypt: false,
        hash: Some("sha512".into()),
        ..Options::default()
    }
}

#[test]
fn hostile_headers_are_refused_cleanly() {
    // (what, bytes, expected error kind)
    let rows: Vec<(&str, Vec<u8>)> = vec![
        ("zeros", vec![0u8; HEADER_BYTES]),
        ("ones", vec![0xff; HEADER_BYTES]),
        ("pattern", (0..HEADER_BYTES).map(|i| i as u8).collect()),
    ];
    for (what, raw) in rows {
        let e = decrypt_header(&raw, b"aaaaaaaaaaaa", &[], &quick()).unwrap_err();
        assert!(matches!(e, Error::NoFormatHeader), "{what}: {e}");
    }
    let e = decrypt_header(&[0u8; 100], b"a", &[], &quick()).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "truncated: {e}");
    let e = decrypt_header(&[0u8; HEADER_BYTES], &[b'a'; 65], &[], &quick()).unwrap_err();
    assert!(
        e.to_string()
            .contains("Maximum TCRYPT passphrase length (64)"),
        "{e}"
    );
    // A filter that matches nothing finds nothing.
    let o = Options {
        hash: Some("xxxx".into()),
        ..Options::default()
    };
    assert!(matches!(
        decrypt_header(&[0u8; HEADER_BYTES], b"a", &[], &o),
        Err(Error::NoFormatHeader)
    ));
}

#[test]
fn header_copies_by_option() {
    let size = 1 << 20;
    let o = |hidden, backup, system| Options {
        hidden,
        backup,
        system,
        ..Options::default()
    };
    assert_eq!(header_offsets(&o(false, false, false), size), vec![0]);
    assert_eq!(
        header_offsets(&o(true, false, false), size),
        vec![65536, size - 1536]
    );
    assert_eq!(
        header_offsets(&o(false, true, false), size),
        vec![size - 131072]
    );
    assert_eq!(
        header_offsets(&o(true, true, false), size),
        vec![size - 65536]
    );
    assert_eq!(header_offsets(&o(false, false, true), size), vec![31744]);
    // A device too small for a copy has none there.
    assert!(header_offsets(&o(false, true, false), 4096).is_empty());
}

#[test]
fn every_chain_has_consistent_key_offsets() {
    for a in algs::ALGS.iter() {
        let mut total = 0;
        for l in a.layers {
            let end = match a.chain {
                Chain::Xts => (l.key_offset + l.key_bytes / 2).max(l.iv_offset + l.key_bytes / 2),
                Chain::Lrw => l.key_offset + l.key_bytes - 16,
                _ => (l.key_offset + l.key_bytes).max(l.iv_offset + l.extra_bytes),
            };
            assert!(end <= 256, "{} {}", a.long_name, a.chain.name());
            total += algs::layer_key(l, a.chain, &[0u8; 256]).len();
        }
        assert_eq!(
            total,
            a.chain_key_bytes,
            "{} {}",
            a.long_name,
            a.chain.name()
        );
    }
}

/// Every chain's data mapping, as cryptsetup activates it: the `-tcrypt` legacy modes refused
/// with cryptsetup's words, kuznyechik by name; every other chain (the 64-bit `cbc-tcw` ones
/// too) a spec that takes the chain's volume key and keys a sector cipher.
#[test]
fn every_chain_maps_as_cryptsetup_activates_it() {
    let mut mapped = Vec::new();
    for a in algs::ALGS.iter() {
        let hdr = Header {
            flavour: Flavour::TrueCrypt,
            version: 5,
            version_tc: 0x0700,
            hidden_volume_bytes: 0,
            volume_bytes: 1 << 20,
            mk_offset: 131072,
            mk_size: 1 << 20,
            flags: 0,
            sector_bytes: 512,
            hash: Hash::Sha512,
            algs: a,
            opts_hidden: false,
            opts_system: false,
            keys: SecretBytes::from_vec((0..=255).collect()),
        };
        let what = format!("{}-{}", a.long_name, a.chain.name());
        let r = hdr.mapping(4 << 20);
        if matches!(a.chain, Chain::CbciTcrypt | Chain::CbcTcrypt) {
            let e = r.err().unwrap_or_else(|| panic!("{what} mapped"));
            assert!(e.to_string().contains("TCRYPT legacy mode"), "{what}: {e}");
            continue;
        }
        if a.long_name.contains("kuznyechik") {
            let e = r.err().unwrap_or_else(|| panic!("{what} mapped"));
            assert!(e.to_string().contains("kuznyechik"), "{what}: {e}");
            continue;
        }
        let m = r.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(m.key.len(), a.chain_key_bytes, "{what}");
        crate::sector::SectorCipher::new(m.spec, m.key.as_ref(), m.geometry)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        mapped.push(m.spec.to_string());
    }
    for want in ["cast5-cbc-tcw", "des3_ede-cbc-tcw", "aes-cbc-tcw"] {
        assert!(mapped.iter().any(|s| s == want), "{want} in {mapped:?}");
    }
}
