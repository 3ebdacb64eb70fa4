# Reference for dm-crypt's authenticated sectors, from python3-cryptography (an independent
# implementation). One request per input line:
#   MODE KEY_HEX SECTOR IV_HEX PLAIN_HEX
# MODE: gcm | chacha20-poly1305 | xts-hmac-sha256 | xts-hmac-sha512. Prints "CIPHERTEXT_HEX AUTHTAG_HEX" per line.
import hashlib
import hmac
import struct
import sys

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

for line in sys.stdin:
    mode, key, sector, iv, plain = line.split()
    key, iv, plain = bytes.fromhex(key), bytes.fromhex(iv), bytes.fromhex(plain)
    s = struct.pack("<Q", int(sector))
    if mode == "gcm":
        out = AESGCM(key).encrypt(iv, plain, s + iv)
        ct, tag = out[:-16], out[-16:]
    elif mode == "chacha20-poly1305":
        out = ChaCha20Poly1305(key).encrypt(iv, plain, s + iv)
        ct, tag = out[:-16], out[-16:]
    else:
        h = hashlib.sha256 if mode == "xts-hmac-sha256" else hashlib.sha512
        xk, mk = key[:64], key[64:]
        ct = Cipher(algorithms.AES(xk), modes.XTS(iv)).encryptor().update(plain)
        tag = hmac.new(mk, s + iv + ct, h).digest()
    print(ct.hex(), tag.hex())
