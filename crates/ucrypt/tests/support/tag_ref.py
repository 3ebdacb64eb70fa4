# Reference for dm-crypt's authenticated sectors, from python3-cryptography (an independent
# implementation) and the kernel's constructions. One request per input line:
#   MODE KEY_HEX SECTOR IV_HEX PLAIN_HEX
# IV_HEX is "-" when no IV is kept (the IV comes from the sector). SECTOR is in 512-byte units.
# MODE:
#   gcm                       rfc4106(gcm(aes)): nonce = the kept 12-byte IV
#   chacha20-poly1305         rfc7539(chacha20,poly1305), nonce = the kept 12-byte IV
#   chacha20-plain64-poly1305 the same, nonce = le64(sector) zero-padded to 12 bytes
#   ccm                       rfc4309(ccm(aes)): KEY = AES key || 3-byte salt,
#                             nonce = salt || kept 8-byte IV, authenticated data = le64(sector)
#   authenc-M-I-H             authenc(hmac(H), M(aes)), M xts|cbc, I random|plain64|essiv:
#                             KEY = cipher key || MAC key; the IV is the kept one (random),
#                             le64(sector) zero-padded (plain64), or that encrypted with AES-256
#                             keyed by SHA-256 of the whole KEY (essiv); the tag is
#                             HMAC(le64(sector) || IV || ciphertext)
# For the AEADs the associated data is le64(sector) || nonce, as dm-crypt passes it.
# Prints "CIPHERTEXT_HEX AUTHTAG_HEX" per line.
import hashlib
import hmac
import struct
import sys

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESCCM, AESGCM, ChaCha20Poly1305


def sector_iv(s, n):
    return s + bytes(n - len(s))


for line in sys.stdin:
    mode, key, sector, iv, plain = line.split()
    key, plain = bytes.fromhex(key), bytes.fromhex(plain)
    iv = b"" if iv == "-" else bytes.fromhex(iv)
    s = struct.pack("<Q", int(sector))
    if mode in ("gcm", "chacha20-poly1305", "chacha20-plain64-poly1305"):
        nonce = iv if iv else sector_iv(s, 12)
        aead = AESGCM(key) if mode == "gcm" else ChaCha20Poly1305(key)
        out = aead.encrypt(nonce, plain, s + nonce)
        ct, tag = out[:-16], out[-16:]
    elif mode == "ccm":
        aes, salt = key[:-3], key[-3:]
        out = AESCCM(aes, tag_length=16).encrypt(salt + iv, plain, s)
        ct, tag = out[:-16], out[-16:]
    elif mode.startswith("authenc-"):
        _, m, ivsrc, h = mode.split("-")
        h = {"sha1": hashlib.sha1, "sha256": hashlib.sha256, "sha512": hashlib.sha512}[h]
        ek, mk = key[: len(key) - h().digest_size], key[len(key) - h().digest_size :]
        if ivsrc == "random":
            full_iv = iv
        else:
            full_iv = sector_iv(s, 16)
            if ivsrc == "essiv":
                salt = hashlib.sha256(key).digest()
                e = Cipher(algorithms.AES(salt), modes.ECB()).encryptor()
                full_iv = e.update(full_iv) + e.finalize()
        mo = modes.XTS(full_iv) if m == "xts" else modes.CBC(full_iv)
        enc = Cipher(algorithms.AES(ek), mo).encryptor()
        ct = enc.update(plain) + enc.finalize()
        tag = hmac.new(mk, s + full_iv + ct, h).digest()
    else:
        sys.exit(f"unknown mode {mode}")
    print(ct.hex(), tag.hex())
