"""CRC-32C of a whole from the CRC-32Cs of its parts, without reading the bytes again.

A value larger than a stripe is stored as units, each with its own CRC-32C, and its
records and layout also carry the CRC-32C of the whole value.  Summing each byte twice
(once per unit, once for the whole) doubled the client's checksum work on large puts;
:func:`crc32c_combine` gives the whole's CRC from the units' in a few microseconds.

The method is zlib's ``crc32_combine`` (multiplication by ``x^(8 * len2)`` modulo the
polynomial, in the reflected bit order the CRC uses), with CRC-32C's polynomial; the
checks in ``tests/test_crc.py`` compare it with :func:`crc32c.crc32c` of the joined bytes.
"""

from __future__ import annotations

from functools import lru_cache

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial (reflected: bit 31 is x^0); ``a`` must not be 0."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    """``x^(2^k)`` modulo the polynomial, k = 0..31."""
    out, p = [], 1 << 30  # x^1
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return out


_X2N = _x2n_table()


def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial."""
    p, k, n = 1 << 31, 3, nbytes  # x^0; 2^3 = 8 bits a byte
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


@lru_cache(maxsize=64)  # a put's units share a handful of lengths (the stripe, a last one)
def _shifter(nbytes: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Multiplication by ``x^(8 * nbytes)`` as four tables, one per byte of the CRC it
    shifts: the map is linear, so each table is the XORs of its 8 basis images."""
    a = _shift(nbytes)
    tables = []
    for byte in range(4):
        basis = [_multmodp(a, 1 << (8 * byte + bit)) for bit in range(8)]
        table = [0] * 256
        for v in range(1, 256):
            low = v & -v  # the lowest set bit: v is v without it, plus its image
            table[v] = table[v ^ low] ^ basis[low.bit_length() - 1]
        tables.append(table)
    return tables[0], tables[1], tables[2], tables[3]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc1`` (of A), ``crc2`` (of B) and B's length."""
    if len2 <= 0:
        return crc1
    t0, t1, t2, t3 = _shifter(len2)
    return (t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF]
            ^ t3[crc1 >> 24] ^ crc2)
