"""A bad byte costs one record: recovery cuts only a torn last record and resyncs past damage."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import pytest

from kvfs.chunkserver.records import RECORD, Damage, record_header, recovery_point, scan_records
from kvfs.client import AsyncClient
from kvfs.launcher import LocalCluster


def _record(key: bytes, value: bytes) -> bytes:
    return record_header(key, len(value), crc32c.crc32c(value), None) + value


def _chunk(n: int = 3, size: int = 5000) -> bytes:
    return b"".join(_record(b"k%d" % i, bytes([65 + i]) * size) for i in range(n))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


def test_scan_clean_chunk() -> None:
    data = _chunk()
    damage: list[Damage] = []
    recs = list(scan_records(data, damage=damage))
    assert [r.key for r in recs] == [b"k0", b"k1", b"k2"]
    assert all(r.value_ok for r in recs) and not damage
    assert recovery_point(data) == (len(data), [], [])


def test_bad_value_in_the_middle_is_reported_and_kept() -> None:
    data = _chunk()
    first = next(scan_records(data))
    bad = _flip(data, first.value_offset + 7)
    keep, damage, badrecs = recovery_point(bad)
    assert keep == len(bad)  # nothing cut
    assert not damage
    assert [r.key for r in badrecs] == [b"k0"]
    assert [r.value_ok for r in scan_records(bad)] == [False, True, True]


@pytest.mark.parametrize("where", [0, 5, RECORD.size - 1, RECORD.size + 1])  # magic, crc, header crc, key
def test_bad_header_is_skipped_by_resyncing_on_the_magic(where: int) -> None:
    data = _chunk()
    second = list(scan_records(data))[1]
    bad = _flip(data, second.record_offset + where)
    damage: list[Damage] = []
    recs = list(scan_records(bad, damage=damage))
    assert [r.key for r in recs] == [b"k0", b"k2"]
    assert damage == [Damage(second.record_offset, second.end)]
    assert recovery_point(bad)[0] == len(bad)


def test_garbage_between_records_is_skipped() -> None:
    a, b = _record(b"a", b"x" * 100), _record(b"b", b"y" * 100)
    data = a + b"KVR1" + os.urandom(300) + b"KVR1junk" + b
    damage: list[Damage] = []
    assert [r.key for r in scan_records(data, damage=damage)] == [b"a", b"b"]
    assert damage == [Damage(len(a), len(data) - len(b))]


def test_only_a_torn_last_record_is_cut() -> None:
    data = _chunk()
    recs = list(scan_records(data))
    # a header with half its value: the tail after the last whole record goes
    torn = data + _record(b"t", b"z" * 4096)[: RECORD.size + 1 + 100]
    assert recovery_point(torn)[0] == len(data)
    # a last record whose value never finished (fails its CRC) goes, the others stay
    last_bad = _flip(data, recs[-1].value_offset + 3)
    assert recovery_point(last_bad)[0] == recs[-1].record_offset
    # damage in the middle and a torn tail: the middle is skipped, only the tail is cut
    both = _flip(data, recs[1].record_offset + 2) + b"\0" * 37
    keep, damage, _ = recovery_point(both)
    assert keep == len(data) and damage == [Damage(recs[1].record_offset, recs[1].end)]


async def _one_server_chunk(cluster: LocalCluster, kv: AsyncClient, items: dict[bytes, bytes]
                            ) -> tuple[int, Path, list[int]]:
    await kv.put_many(items)  # small values of one call: one run on one server, one chunk
    layouts = [await kv.layout(k) for k in items]
    reps = [lay.extents[0].replicas[0] for lay in layouts if lay is not None]
    assert len({(r.server_id, r.chunk_id) for r in reps}) == 1
    idx = next(i for i, c in enumerate(cluster.chunkservers) if c and c.server_id == reps[0].server_id)
    cs = cluster.chunkservers[idx]
    assert cs is not None
    return idx, cs.store.chunk_path(reps[0].chunk_id), [r.offset for r in reps]


async def test_flipped_bit_in_first_record_costs_only_that_record(cluster: LocalCluster,
                                                                   kv: AsyncClient) -> None:
    items = {b"r0": os.urandom(50_000), b"r1": os.urandom(50_000), b"r2": os.urandom(50_000)}
    idx, path, offsets = await _one_server_chunk(cluster, kv, items)
    size = path.stat().st_size
    await cluster.stop_chunkserver(idx)
    with open(path, "r+b") as f:
        f.seek(offsets[0] + 1000)
        b = f.read(1)
        f.seek(offsets[0] + 1000)
        f.write(bytes([b[0] ^ 0x01]))
    cs = await cluster.start_chunkserver(idx)
    assert path.stat().st_size == size  # nothing truncated
    assert cs.store.bad_records == 1
    kv.layout_cache.clear()
    assert await kv.get_many([b"r1", b"r2"]) == [items[b"r1"], items[b"r2"]]
    assert await kv.get(b"r0") is None  # a miss, never wrong bytes (tests/test_lost.py)


async def test_damaged_header_in_the_middle_keeps_every_value(cluster: LocalCluster,
                                                               kv: AsyncClient) -> None:
    items = {b"h0": os.urandom(20_000), b"h1": os.urandom(20_000), b"h2": os.urandom(20_000)}
    idx, path, offsets = await _one_server_chunk(cluster, kv, items)
    await cluster.stop_chunkserver(idx)
    head = offsets[1] - RECORD.size - len(b"h1")
    with open(path, "r+b") as f:  # the second record's magic
        f.seek(head)
        f.write(b"XXXX")
    size = path.stat().st_size
    cs = await cluster.start_chunkserver(idx)
    assert path.stat().st_size == size
    assert cs.store.damage[int(path.stem, 16)] == [Damage(head, offsets[1] + 20_000)]
    kv.layout_cache.clear()
    assert await kv.get_many(list(items)) == list(items.values())
