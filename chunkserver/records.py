"""The chunk record format, and scanning a chunk's bytes without meta.

A record is ``header | key | value`` where the header is::

    magic b"KVR1" | key_len u16 | flags u16 | value_crc u32 | value_len u64
    | expires_at f64 (0 = never) | header_crc u32 (CRC-32C of header[:28] + key)

A layout's extent points at the *value* (offset past header and key), so a
read never touches record headers.  A scan needs no meta and loses no more
than the damage: a record whose value fails its CRC is reported and stepped
over (its header says how long it is); a header that fails its own CRC is
skipped by resyncing on the next magic whose header checks out, and every
record after it is kept.  See :func:`recovery_point` for what recovery cuts.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import crc32c

from kvfs.layout import MAX_KEY_BYTES

RECORD = struct.Struct("<4sHHIQdI")
REC_MAGIC = b"KVR1"


def record_header(key: bytes, length: int, crc: int, expires_at: float | None) -> bytes:
    head = RECORD.pack(REC_MAGIC, len(key), 0, crc, length, expires_at or 0.0, 0)
    hcrc = crc32c.crc32c(key, crc32c.crc32c(head[:-4]))
    return head[:-4] + struct.pack("<I", hcrc) + key


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    record_offset: int
    value_offset: int
    key: bytes
    length: int
    crc: int
    expires_at: float | None
    value_ok: bool

    @property
    def end(self) -> int:
        return self.value_offset + self.length


@dataclass(frozen=True, slots=True)
class Damage:
    """Bytes ``[start, end)`` of a chunk that hold no record whose header checks out."""

    start: int
    end: int


def _record_at(data: bytes, pos: int, verify: bool) -> ScannedRecord | None:
    """The record whose header starts at ``pos``, or None when none checks out there
    (wrong magic, header CRC mismatch, or a value running past the end of the data)."""
    n = len(data)
    if pos + RECORD.size > n:
        return None
    magic, klen, _flags, crc, vlen, exp, hcrc = RECORD.unpack_from(data, pos)
    if magic != REC_MAGIC or not 0 < klen <= MAX_KEY_BYTES:
        return None
    key_end = pos + RECORD.size + klen
    if key_end > n:
        return None
    if crc32c.crc32c(data[pos + RECORD.size : key_end], crc32c.crc32c(data[pos : pos + RECORD.size - 4])) != hcrc:
        return None
    end = key_end + vlen
    if end > n:
        return None
    ok = (crc32c.crc32c(memoryview(data)[key_end:end]) == crc) if verify else True
    return ScannedRecord(pos, key_end, bytes(data[pos + RECORD.size : key_end]), vlen, crc, exp or None, ok)


def scan_records(data: bytes, *, verify: bool = True,
                 damage: list[Damage] | None = None) -> Iterator[ScannedRecord]:
    """Every record in a chunk's bytes, in order.

    A record whose value fails its CRC is yielded with ``value_ok=False``.  Bytes where
    no valid header starts are skipped up to the next magic whose header checks out;
    each skipped run is appended to ``damage`` when given (a torn tail is the last one).
    """
    pos, n = 0, len(data)
    while pos < n:
        rec = _record_at(data, pos, verify)
        if rec is not None:
            yield rec
            pos = rec.end
            continue
        nxt = pos + 1
        while True:
            nxt = data.find(REC_MAGIC, nxt)
            if nxt < 0:
                nxt = n
                break
            if _record_at(data, nxt, False) is not None:
                break
            nxt += 1
        if damage is not None:
            damage.append(Damage(pos, nxt))
        pos = nxt


def recovery_point(data: bytes) -> tuple[int, list[Damage], list[ScannedRecord]]:
    """Where recovery cuts a chunk: ``(keep, damage, bad_records)``.

    Only a torn *last* record is cut: the bytes after the last record whose header checks
    out, plus that record itself when its value fails its CRC (an append that never
    finished).  Damage and bad values before it are reported, never cut, so every record
    after them is kept.
    """
    damage: list[Damage] = []
    bad: list[ScannedRecord] = []
    keep = 0
    last: ScannedRecord | None = None
    for rec in scan_records(data, damage=damage):
        if not rec.value_ok:
            bad.append(rec)
        last = rec
    if last is not None:
        keep = last.end if last.value_ok else last.record_offset
        if not last.value_ok:
            bad.pop()
    damage = [d for d in damage if d.start < keep]
    return keep, damage, bad
