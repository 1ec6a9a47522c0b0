"""The chunk record format, and scanning a chunk's bytes without meta.

A record is ``header | key | value`` where the header (56 bytes) is::

    magic b"KVR2" | key_len u16 | flags u16 | value_crc u32 | value_len u64
    | expires_at f64 (0 = never) | write_id u64 | total_size u64 | total_crc u32
    | extent_index u32 | header_crc u32 (CRC-32C of header[:52] + key)

``write_id`` orders the writes of one key (newest wins); ``total_size``,
``total_crc`` and ``extent_index`` say which part of which value this record
is, so meta's index can be rebuilt from the chunks alone
(:mod:`kvfs.meta.rebuild`).  Flag ``TOMBSTONE`` marks a delete (no value).
Records of the first format (magic ``KVR1``, 32-byte header without the
rebuild fields) are still read.

A layout's extent points at the *value* (offset past header and key), so a
read never touches record headers.  A scan needs no meta and loses no more
than the damage: a record whose value fails its CRC is reported and stepped
over (its header says how long it is); a header that fails its own CRC is
skipped by resyncing on the next magic whose header checks out, and every
record after it is kept.  See :func:`recovery_point` for what recovery cuts.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c

from kvfs.errors import ChecksumMismatch, InvalidArgument
from kvfs.layout import MAX_KEY_BYTES

RECORD = struct.Struct("<4sHHIQdQQIII")
_HEAD = struct.Struct("<4sHHIQdQQII")  # RECORD up to its header CRC
_U32 = struct.Struct("<I")
REC_MAGIC = b"KVR2"
RECORD_V1 = struct.Struct("<4sHHIQdI")  # the first format: no write id, size or index
REC_MAGIC_V1 = b"KVR1"
TOMBSTONE = 1  # flag: the key was deleted at write_id; the record has no value


def record_header(key: bytes, length: int, crc: int, expires_at: float | None, *, write_id: int = 0,
                  total_size: int | None = None, total_crc: int | None = None, index: int = 0,
                  tombstone: bool = False) -> bytes:
    """The header and key of a record; ``total_*`` default to this extent's (an unstriped value)."""
    head = RECORD.pack(REC_MAGIC, len(key), TOMBSTONE if tombstone else 0, crc, length,
                       expires_at or 0.0, write_id, length if total_size is None else total_size,
                       crc if total_crc is None else total_crc, index, 0)
    hcrc = crc32c.crc32c(key, crc32c.crc32c(head[:-4]))
    return head[:-4] + struct.pack("<I", hcrc) + key


_DEFAULTS = (0, None, None, 0, False)  # an append record's optional fields, as record_header's


def _full(rec: Sequence[Any]) -> tuple[Any, ...]:
    """An append record of another shape than the wire's nine fields (a caller's own
    4-tuple), checked and padded with the defaults of the rebuild fields."""
    key, length, crc, expires_at, *more = rec
    if len(more) > len(_DEFAULTS):
        raise InvalidArgument(f"append record has {len(rec)} fields, at most {4 + len(_DEFAULTS)}")
    more += _DEFAULTS[len(more):]
    return (key, int(length), int(crc), expires_at, int(more[0]), more[1], more[2], int(more[3]),
            bool(more[4]))


def only_tombstones(records: Sequence[Sequence[Any]]) -> bool:
    """Whether an APPEND's records are all tombstones with no value (a delete's, an
    eviction's: they free room, so may take the GC reserve)."""
    return all(len(rec) == 9 and rec[8] and not rec[1] for rec in records)


def append_buffers(records: Sequence[Sequence[Any]], payload: memoryview
                   ) -> tuple[list[bytes | memoryview], list[int], int]:
    """An APPEND's records as the buffers one vectored write puts at a chunk's tail
    (``header|key``, value, ...: the values are views of ``payload``, never copied), each
    value's offset from the first record, and the bytes in all.  Each value's CRC-32C is
    checked against its record (:class:`ChecksumMismatch`: it arrived corrupted); a bad key,
    or records that do not describe ``payload`` exactly, are :class:`InvalidArgument`.

    One pass with no object per field: this runs for every key a client writes (the record's
    fields as :func:`record_header` writes them, the same bytes)."""
    bufs: list[bytes | memoryview] = []
    rel: list[int] = []
    add, at = bufs.append, rel.append
    pack, pack32, crc = _HEAD.pack, _U32.pack, crc32c.crc32c
    pos = total = 0
    size = payload.nbytes
    for rec in records:
        if len(rec) != 9:
            rec = _full(rec)
        key, length, vcrc, expires_at, write_id, total_size, total_crc, index, tombstone = rec
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument("append record with a bad key")
        end = pos + length
        if length < 0 or end > size:
            raise InvalidArgument(f"append records describe more bytes than the {size} sent")
        value = payload[pos:end]
        if crc(value) != vcrc:
            raise ChecksumMismatch(f"value for key {key[:64]!r} arrived corrupted (CRC-32C mismatch)")
        head = pack(REC_MAGIC, len(key), TOMBSTONE if tombstone else 0, vcrc, length,
                    expires_at or 0.0, write_id, length if total_size is None else total_size,
                    vcrc if total_crc is None else total_crc, index)
        head += pack32(crc(key, crc(head)))
        head += key
        add(head)
        if length:
            add(value)
        total += len(head)
        at(total)
        total += length
        pos = end
    if pos != size:
        raise InvalidArgument(f"append sent {size} bytes but its records describe {pos}")
    return bufs, rel, total


def copy_header(rec: ScannedRecord) -> bytes:
    """A record's header and key as they were (compaction copies records whole)."""
    return record_header(rec.key, rec.length, rec.crc, rec.expires_at, write_id=rec.write_id,
                         total_size=rec.total_size, total_crc=rec.total_crc, index=rec.index,
                         tombstone=rec.tombstone)


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    record_offset: int
    value_offset: int
    key: bytes
    length: int
    crc: int
    expires_at: float | None
    value_ok: bool
    write_id: int = 0
    total_size: int = 0
    total_crc: int = 0
    index: int = 0
    tombstone: bool = False

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
    magic = data[pos : pos + 4]
    st = RECORD if magic == REC_MAGIC else RECORD_V1 if magic == REC_MAGIC_V1 else None
    if st is None or pos + st.size > n:
        return None
    fields = st.unpack_from(data, pos)
    _, klen, flags, crc, vlen, exp = fields[:6]
    hcrc = fields[-1]
    if not 0 < klen <= MAX_KEY_BYTES:
        return None
    key_end = pos + st.size + klen
    if key_end > n:
        return None
    if crc32c.crc32c(data[pos + st.size : key_end], crc32c.crc32c(data[pos : pos + st.size - 4])) != hcrc:
        return None
    end = key_end + vlen
    if end > n:
        return None
    ok = (crc32c.crc32c(memoryview(data)[key_end:end]) == crc) if verify else True
    key = bytes(data[pos + st.size : key_end])
    if st is RECORD_V1:
        return ScannedRecord(pos, key_end, key, vlen, crc, exp or None, ok, 0, vlen, crc, 0, False)
    write_id, total_size, total_crc, index = fields[6:10]
    return ScannedRecord(pos, key_end, key, vlen, crc, exp or None, ok, write_id, total_size, total_crc,
                         index, bool(flags & TOMBSTONE))


def parse_record(data: bytes) -> ScannedRecord | None:
    """The record at the start of ``data`` (header, key and whole value; the value's CRC
    checked), or None when none checks out there (the GC's repair copies records whole)."""
    return _record_at(data, 0, True)


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
            nxt = min((i for i in (data.find(REC_MAGIC, nxt), data.find(REC_MAGIC_V1, nxt)) if i >= 0),
                      default=-1)
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
