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


ALGS = {"aes": algorithms.AES, "camellia": algorithms.Camellia}


def iv_for(ivmode, alg, key, n):
    if ivmode == "plain64":
        return (n & MASK64).to_bytes(8, "little") + bytes(8)
    if ivmode == "plain":
        return (n & 0xFFFFFFFF).to_bytes(4, "little") + bytes(12)
    if ivmode == "plain64be":
        return bytes(8) + (n & MASK64).to_bytes(8, "big")
    if ivmode == "benbi":
        # dm-crypt: 16-byte blocks before the sector (512-byte units << 5), plus one.
        return bytes(8) + (((n << 5) + 1) & MASK64).to_bytes(8, "big")
    if ivmode.startswith("essiv:"):
        salt = hashlib.new(ivmode[len("essiv:"):], key).digest()
        enc = Cipher(alg(salt), modes.ECB()).encryptor()
        return enc.update((n & MASK64).to_bytes(8, "little") + bytes(8)) + enc.finalize()
    raise ValueError(ivmode)


def gf128_mul_bbe(a, b):
    """a*b in GF(2^128) mod x^128 + x^7 + x^2 + x + 1, bit i of the integers = coefficient of
    x^i (the kernel's "bbe" order: the 16 bytes read as a big-endian integer)."""
    r = 0
    while b:
        if b & 1:
            r ^= a
        b >>= 1
        a = ((a << 1) ^ (0x87 if a >> 127 else 0)) & ((1 << 128) - 1)
    return r


def lrw(alg, key, iv, data, encrypt):
    """LRW (IEEE P1619 draft; the kernel's lrw template): C = E(P ^ T) ^ T with T = K2 * I,
    K2 the key's last 16 bytes, I the big-endian block index starting at the IV."""
    k2 = int.from_bytes(key[-16:], "big")
    ecb = Cipher(alg(key[:-16]), modes.ECB())
    ctx = ecb.encryptor() if encrypt else ecb.decryptor()
    i = int.from_bytes(iv, "big")
    out = bytearray()
    for j in range(0, len(data), 16):
        tb = gf128_mul_bbe(k2, i).to_bytes(16, "big")
        x = bytes(a ^ b for a, b in zip(data[j:j + 16], tb))
        out += bytes(a ^ b for a, b in zip(ctx.update(x), tb))
        i = (i + 1) & ((1 << 128) - 1)
    return bytes(out)


def xts_by_ecb(alg, key, iv, data, encrypt):
    """XTS from ECB per IEEE 1619, for key sizes python-cryptography's XTS lacks (AES-192) and
    ciphers it has no XTS of (camellia)."""
    h = len(key) // 2
    t = int.from_bytes(Cipher(alg(key[h:]), modes.ECB()).encryptor().update(iv), "little")
    ecb = Cipher(alg(key[:h]), modes.ECB())
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
    name, chain, ivmode = spec.split("-", 2)
    alg = ALGS[name]
    shift = (ss // 512).bit_length() - 1
    out = bytearray()
    for i in range(len(data) // ss):
        sector = req["first_sector"] + i
        n = ((sector << shift) + req["iv_offset"]) & MASK64
        if req["iv_large_sectors"]:
            n >>= shift
        iv = iv_for(ivmode, alg, key, n)
        block = data[i * ss:(i + 1) * ss]
        if chain == "lrw":
            out += lrw(alg, key, iv, block, encrypt)
            continue
        if chain == "xts" and (len(key) == 48 or alg is not algorithms.AES):
            out += xts_by_ecb(alg, key, iv, block, encrypt)
            continue
        mode = modes.XTS(iv) if chain == "xts" else modes.CBC(iv)
        c = Cipher(alg(key), mode)
        ctx = c.encryptor() if encrypt else c.decryptor()
        out += ctx.update(block) + ctx.finalize()
    return bytes(out)


for line in sys.stdin:
    if line.strip():
        sys.stdout.write(crypt(json.loads(line)).hex() + "\n")
