"""``FrameProtocol.write`` with the frame's size known (a server's answer made at once): many
buffers written into the socket by one ``writev`` of its own while the transport holds
nothing, what the socket does not take handed to the transport: every byte arrives once,
in order, through partial writes and a reader that stops and starts.  A real socket pair."""

from __future__ import annotations

import asyncio
import os
import random
import socket
from typing import Any

import pytest

from kvfs import frame_protocol
from kvfs.frame_protocol import FrameProtocol


async def test_frames_written_straight_into_the_socket_arrive_whole_through_partial_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []  # (bytes asked, bytes the socket took)
    writev = os.writev

    def counted(fd: int, buffers: Any) -> int:
        asked = sum(memoryview(b).nbytes for b in buffers)
        try:
            took = writev(fd, buffers)
        except BlockingIOError:
            took = -1
            raise
        finally:
            calls.append((asked, took))
        return took

    monkeypatch.setattr(frame_protocol.os, "writev", counted)
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    b.setblocking(False)
    transport, proto = await loop.create_connection(FrameProtocol, sock=a)
    try:
        assert isinstance(proto, FrameProtocol) and proto.can_send_files
        rnd = random.Random(7)
        data = memoryview(os.urandom(4 << 20))
        want = bytearray()
        for i in range(40):  # 40 frames of 1 + 43 buffers, ~172 KiB each: past the socket's room
            parts = [b"frame %d:" % i] + [data[o : o + 4096] for o in rnd.sample(range(0, 4 << 20, 4096), 43)]
            for p in parts:
                want += p
            proto.write(parts, sum(memoryview(p).nbytes for p in parts))
        assert calls, "no frame was written straight into the socket"
        assert any(0 <= took < asked for asked, took in calls), "no partial write was exercised"
        got = bytearray()
        deadline = loop.time() + 30
        while len(got) < len(want):
            assert loop.time() < deadline, f"{len(got)} of {len(want)} bytes arrived"
            try:
                chunk = b.recv(1 << 20)
            except BlockingIOError:
                await asyncio.sleep(0.001)  # the transport sends the rest once there is room
                continue
            assert chunk
            got += chunk
        assert got == want
    finally:
        transport.close()
        b.close()
