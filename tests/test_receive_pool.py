"""Large request payloads received into reused buffers (``ReceivePool``, ``--receive-pool``):
reused only when no view of them is alive, bounded, and every byte of every value stored."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import pytest
from poll import until

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.config import ChunkServerConfig
from kvfs.errors import ChecksumMismatch
from kvfs.launcher import LocalCluster
from kvfs.protocol import FrameDecoder, FrameHead, ReceivePool, frame_bytes
from kvfs.rpc import Op
from kvfs.transport import Connection

MiB = 1 << 20


def _head(n: int) -> FrameHead:
    return FrameHead(op=20, flags=0, request_id=1, header={}, payload_len=n)


def test_a_given_back_buffer_receives_the_next_payload() -> None:
    pool = ReceivePool(max_bytes=8 * MiB)
    first = pool(_head(3 * MiB + 5))
    assert isinstance(first, memoryview) and first.nbytes == 3 * MiB + 5
    owner = first.obj
    assert len(owner) == 4 * MiB  # made in whole MiB
    pool.give(first)
    assert pool.kept_bytes == 4 * MiB
    second = pool(_head(4 * MiB))  # fits the kept buffer
    assert isinstance(second, memoryview) and second.obj is owner and pool.reused == 1
    assert pool.kept_bytes == 0
    third = pool(_head(2 * MiB))  # nothing kept now: a new one
    assert isinstance(third, memoryview) and third.obj is not owner


def test_a_buffer_with_a_live_view_is_never_reused() -> None:
    pool = ReceivePool(max_bytes=64 * MiB)
    payload = pool(_head(2 * MiB))
    assert isinstance(payload, memoryview)
    payload[:4] = b"keep"
    held = payload[:4]  # e.g. a pwritev still running in a thread holds the values' views
    pool.give(payload)
    assert pool.kept_bytes == 0
    again = pool(_head(2 * MiB))
    assert isinstance(again, memoryview) and again.obj is not held.obj and pool.reused == 0
    again[:4] = b"new!"
    assert bytes(held) == b"keep"


def test_small_payloads_and_a_zero_pool_get_fresh_buffers() -> None:
    pool = ReceivePool(max_bytes=64 * MiB)
    small = pool(_head(MiB - 1))
    assert isinstance(small, bytearray) and len(small) == MiB - 1
    pool.give(small)  # not one of the pool's: ignored
    off = ReceivePool(max_bytes=0)
    big = off(_head(2 * MiB))
    assert isinstance(big, bytearray)
    off.give(memoryview(big))
    assert off.kept_bytes == 0


def test_a_pool_without_minimum_pools_small_payloads_in_whole_mib() -> None:
    pool = ReceivePool(max_bytes=8 * MiB, min_bytes=0)  # a client's (kvfs.readpath)
    for n in (0, 100_000):
        view = pool(_head(n))
        assert isinstance(view, memoryview) and view.nbytes == n and len(view.obj) == MiB
        pool.give(view)
    assert pool.buffers == 1 and pool.reused == 1


def test_kept_bytes_stay_within_max_bytes() -> None:
    pool = ReceivePool(max_bytes=5 * MiB)
    views = [pool(_head(2 * MiB)) for _ in range(4)]
    for v in views:
        pool.give(v)
    assert pool.kept_bytes == 4 * MiB  # two of 2 MiB fit, the third would pass 5 MiB


def test_decoder_receives_a_payload_into_the_pool() -> None:
    pool = ReceivePool(max_bytes=16 * MiB)
    body = os.urandom(3 * MiB)
    for _ in range(2):
        dec = FrameDecoder(allocator=pool)
        dec.receive_data(frame_bytes(20, 7, {"a": 1}, [body]))
        frame = dec.next_event()
        assert bytes(frame.payload) == body  # type: ignore[union-attr, arg-type]
        pool.give(frame.payload)  # type: ignore[union-attr]
    assert pool.reused == 1


async def test_chunkservers_reuse_receive_buffers_and_store_every_byte(tmp_path: Path) -> None:
    cs = ChunkServerConfig(data=tmp_path, heartbeat_interval_s=0.2, receive_pool_bytes=32 * MiB)
    async with LocalCluster(tmp_path, 1, chunkserver=cs) as cluster:
        kv = cluster.client()
        try:
            for round_ in range(4):
                values = {f"k{round_}-{i}".encode(): os.urandom(MiB + i) for i in range(3)}
                await kv.put_many(values)
                assert await kv.get_many(list(values)) == list(values.values())
        finally:
            await kv.close()
        (server,) = cluster.chunkservers
        assert server is not None
        pool = server.rpc.receive_pool
        # each APPEND after the first landed in a kept buffer: the IO thread's write dropped
        # its views of the payload before the APPEND was answered (else about one in four
        # found its buffer still held and took a fresh one)
        assert pool.reused == 3
        assert 0 < pool.kept_bytes <= 32 * MiB


def test_receive_pool_option(tmp_path: Path) -> None:
    from kvfs.cli import build_parser

    def parse(v: str) -> int:
        ns = build_parser().parse_args(["chunkserver", "--data", str(tmp_path), "--receive-pool", v])
        return int(ns.receive_pool_bytes)

    assert parse("0") == 0 and parse("128m") == 128 * MiB
    with pytest.raises(SystemExit):
        parse("-1")


async def test_a_large_append_from_a_peer_that_dies_mid_payload_writes_nothing(tmp_path: Path) -> None:
    """Half of a 2 MiB APPEND (received into a pooled buffer), then the peer is gone: nothing
    is appended, the connection is dropped, and the next large APPENDs are stored whole."""
    async with LocalCluster(tmp_path, 1) as cluster:
        (server,) = cluster.chunkservers
        assert server is not None
        conn = await Connection.open(*parse_addr(server.addr), cluster.token)
        assert conn._proto.decoder.head_first is conn._proto.sinks  # a client's answers' headers alone
        value = os.urandom(2 * MiB)
        frame = frame_bytes(Op.APPEND, 99, rpc.Append(records=[rpc.RecordHead(
            b"half", len(value), crc32c.crc32c(value), None)]), [value])
        before = dict(server.store.sizes)
        transport = conn._proto.transport
        assert transport is not None
        transport.write(frame[: len(frame) // 2])
        await until(lambda: any(c.decoder.buffered_bytes >= MiB // 2 for c in server.rpc.connections),
                     "the server to receive half the payload")
        assert not any(c.decoder.head_first for c in server.rpc.connections)  # servers never peek
        conn.abort()
        await until(lambda: not server.rpc.connections, "the server to drop the connection")
        assert server.append_calls == 0 and server.store.sizes == before  # nothing written
        kv = cluster.client()
        try:
            values = {f"w{i}".encode(): os.urandom(MiB + i) for i in range(3)}
            await kv.put_many(values)
            kv.layout_cache.clear()
            assert await kv.get_many(list(values)) == list(values.values())
        finally:
            await kv.close()


async def test_a_bad_crc_in_a_large_append_is_refused_and_nothing_written(tmp_path: Path) -> None:
    """A pooled (over 64 KiB) APPEND whose last value does not match its CRC-32C: refused with
    ChecksumMismatch naming the key, no byte of the batch written, the buffer pooled again."""
    async with LocalCluster(tmp_path, 1) as cluster:
        (server,) = cluster.chunkservers
        assert server is not None
        conn = await Connection.open(*parse_addr(server.addr), cluster.token)
        try:
            values = [os.urandom(512 * 1024) for _ in range(4)]
            heads = [rpc.RecordHead(f"c{i}".encode(), len(v), crc32c.crc32c(v), None)
                     for i, v in enumerate(values)]
            heads[3] = rpc.RecordHead(b"c3", len(values[3]), crc32c.crc32c(values[3]) ^ 1, None)
            before = dict(server.store.sizes)
            with pytest.raises(ChecksumMismatch, match=r"b'c3'.*arrived corrupted"):
                await conn.call(rpc.Append(records=heads), values)
            assert server.store.sizes == before
            pool = server.rpc.receive_pool
            assert pool.kept_bytes == 2 * MiB  # its buffer back, nothing holds a view of it
            heads[3] = rpc.RecordHead(b"c3", len(values[3]), crc32c.crc32c(values[3]), None)
            locs = (await conn.call(rpc.Append(records=heads), values)).locations
            assert len(locs) == 4 and pool.reused == 1
        finally:
            conn.close()
