"""The chunkserver read path: merged 4 KiB-aligned spans, each byte read once."""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import replace

from kvfs.chunkserver.store import ALIGN, plan_spans
from kvfs.client import AsyncClient
from kvfs.launcher import LocalCluster


def test_spans_are_aligned_cover_every_range_and_never_overlap() -> None:
    rng = random.Random(7)
    ranges = [(rng.choice([1, 2]), rng.randrange(0, 10_000_000), rng.randrange(0, 300_000))
              for _ in range(500)]
    spans = plan_spans(ranges, merge_gap=64 * 1024)
    seen = set()
    for sp in spans:
        assert sp.start % ALIGN == 0 and sp.end % ALIGN == 0 and sp.start < sp.end
        for i in sp.members:
            c, off, ln = ranges[i]
            assert c == sp.chunk_id and sp.start <= off and off + ln <= sp.end
            seen.add(i)
    assert seen == set(range(len(ranges)))  # every range in exactly one span
    by_chunk: dict[int, list[tuple[int, int]]] = {}
    for sp in spans:
        by_chunk.setdefault(sp.chunk_id, []).append((sp.start, sp.end))
    for ivs in by_chunk.values():
        ivs.sort()
        assert all(a[1] < b[0] for a, b in itertools.pairwise(ivs))  # disjoint: read once


def test_neighbours_merge_and_far_ranges_do_not() -> None:
    spans = plan_spans([(1, 0, 100), (1, 5000, 100), (1, 10_000_000, 10)], merge_gap=64 * 1024)
    assert [(s.start, s.end) for s in spans] == [(0, 8192), (9998336, 10002432)]


async def test_chain_written_together_is_read_with_one_span(cluster: LocalCluster, kv: AsyncClient) -> None:
    """Read into a buffer: one read of the whole chain.  Sent as views of the mapped chunk
    (ranges below ``sendfile_min_bytes``): one view per value, the record headers between
    them skipped.  Sent with sendfile (when the values average ``sendfile_min_bytes``): one
    send per value, the headers skipped too."""
    chain = {f"chain/{i:02d}".encode(): os.urandom(64 * 1024) for i in range(64)}
    await kv.put_many(chain)
    servers = [cs for cs in cluster.chunkservers if cs is not None]
    stores = [cs.store for cs in servers]
    configs = [cs.config for cs in servers]
    maps = [s.maps.max_maps for s in stores]
    for cs in servers:
        cs.config = replace(cs.config, sendfile_min_bytes=0)  # never sendfile
        cs.store.maps.max_maps = 0  # nor views of mapped chunks: read into a buffer
    for _ in range(20):  # (a page evicted since it was written: read in the pool, then cached)
        before = [s.spans_read for s in stores]
        assert await kv.get_many(list(chain)) == list(chain.values())
        assert sum(s.spans_read for s in stores) - sum(before) == 1  # 64 blocks, one sequential read
        if sum(s.inline_spans for s in stores):
            break
    assert sum(s.inline_spans for s in stores) >= 1  # served from the page cache, no thread hop
    assert sum(s.file_spans for s in stores) == 0
    for s, n in zip(stores, maps, strict=True):
        s.maps.max_maps = n
    for _ in range(20):  # (cachestat can count a page short while the kernel changes it: read)
        assert await kv.get_many(list(chain)) == list(chain.values())
        if sum(s.mapped_spans for s in stores):
            break
    assert sum(s.mapped_spans for s in stores) == 64
    assert sum(s.file_spans for s in stores) == 0
    for cs in servers:
        cs.config = replace(cs.config, sendfile_min_bytes=64 * 1024)
    for _ in range(20):  # (a page evicted since: that READV is read into a buffer, and cached)
        before = [s.file_spans for s in stores]
        assert await kv.get_many(list(chain)) == list(chain.values())
        if sum(s.file_spans for s in stores) > sum(before):
            break
    assert sum(s.file_spans for s in stores) - sum(before) == 64
    for cs, cfg in zip(servers, configs, strict=True):
        cs.config = cfg


async def test_receive_buffer_is_reused_for_values_returned_as_bytes(kv: AsyncClient) -> None:
    values = {f"rx{i}".encode(): os.urandom(30_000) for i in range(8)}  # one answer of 240 KB
    await kv.put_many(values)
    assert await kv.get_many(list(values)) == list(values.values())
    assert kv.rx_pool_buffers  # the answer's buffer went back to the pool
    reused = kv.rx_buffers_reused
    assert await kv.get_many(list(values)) == list(values.values())
    assert kv.rx_buffers_reused > reused  # and was used again


async def test_large_values_are_received_into_the_bytes_handed_back(kv: AsyncClient) -> None:
    """Values of SCATTER_MIN_BYTES or more, one extent or striped, are received straight
    into the bytes get_many returns: no pooled receive to copy them out of."""
    values = {f"big{i}".encode(): os.urandom(300_000) for i in range(4)}
    values[b"striped"] = os.urandom(3 * kv.config.stripe_bytes + 12_345)
    values[b"small"] = os.urandom(100)
    await kv.put_many(values)
    assert len((await kv.layout(b"striped")).extents) > 1  # type: ignore[union-attr]
    keys = [*values, b"none", b"big0"]  # (a key twice: two bytes, each read whole)
    for _ in range(2):
        got = await kv.get_many(keys)
        assert got == [*values.values(), None, values[b"big0"]]
        assert all(type(v) is bytes for v in got if v is not None) and got[0] is not got[-1]
        assert kv.rx_pool_buffers == 0 and kv.rx_buffers_reused == 0
