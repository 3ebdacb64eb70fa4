#!/usr/bin/python3
"""Independent reference for dm-crypt sector encryption, built on python3-cryptography.

Reads JSON lines {spec, key, sector_size, iv_offset, iv_large_sectors, first_sector, data, op}
(hex strings for bytes) and writes one hex line of output per request. The IV rules follow the
kernel's dm-crypt: the IV counts 512-byte units from the segment start plus iv_offset, shifted
to sector units only with iv_large_sectors.
"""
import hashlib
import json
import sys

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

MASK64 = (1 << 64) - 1


def iv_for(ivmode, key, n):
    if ivmode == "plain64":
        return (n & MASK64).to_bytes(8, "little") + bytes(8)
    if ivmode == "plain":
        return (n & 0xFFFFFFFF).to_bytes(4, "little") + bytes(12)
    if ivmode == "plain64be":
        return bytes(8) + (n & MASK64).to_bytes(8, "big")
    if ivmode == "essiv:sha256":
        salt = hashlib.sha256(key).digest()
        enc = Cipher(algorithms.AES(salt), modes.ECB()).encryptor()
        return enc.update((n & MASK64).to_bytes(8, "little") + bytes(8)) + enc.finalize()
    raise ValueError(ivmode)


def xts_by_ecb(key, iv, data, encrypt):
    """XTS from AES-ECB per IEEE 1619, for key sizes python-cryptography's XTS lacks (384)."""
    h = len(key) // 2
    t = int.from_bytes(Cipher(algorithms.AES(key[h:]), modes.ECB()).encryptor().update(iv), "little")
    ecb = Cipher(algorithms.AES(key[:h]), modes.ECB())
    ctx = ecb.encryptor() if encrypt else ecb.decryptor()
    out = bytearray()
    for j in range(0, len(data), 16):
        tb = t.to_bytes(16, "little")
        x = bytes(a ^ b for a, b in zip(data[j:j + 16], tb))
        out += bytes(a ^ b for a, b in zip(ctx.update(x), tb))
        t = ((t << 1) ^ (0x87 if t >> 127 else 0)) & ((1 << 128) - 1)
    return bytes(out)


def crypt(req):
    spec = req["spec"]
    key = bytes.fromhex(req["key"])
    data = bytes.fromhex(req["data"])
    ss = req["sector_size"]
    encrypt = req["op"] == "encrypt"
    if spec == "cipher_null-ecb":
        return data
    _, chain, ivmode = spec.split("-", 2)
    shift = (ss // 512).bit_length() - 1
    out = bytearray()
    for i in range(len(data) // ss):
        sector = req["first_sector"] + i
        n = ((sector << shift) + req["iv_offset"]) & MASK64
        if req["iv_large_sectors"]:
            n >>= shift
        iv = iv_for(ivmode, key, n)
        block = data[i * ss:(i + 1) * ss]
        if chain == "xts" and len(key) == 48:
            out += xts_by_ecb(key, iv, block, encrypt)
            continue
        mode = modes.XTS(iv) if chain == "xts" else modes.CBC(iv)
        c = Cipher(algorithms.AES(key), mode)
        ctx = c.encryptor() if encrypt else c.decryptor()
        out += ctx.update(block) + ctx.finalize()
    return bytes(out)


for line in sys.stdin:
    if line.strip():
        sys.stdout.write(crypt(json.loads(line)).hex() + "\n")
