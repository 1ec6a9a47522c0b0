"""Roles and mutual authentication, over real sockets.

A relay test puts a real forwarding socket between a client and meta.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.chunkserver import ChunkServer
from kvfs.client import AsyncClient
from kvfs.config import MetaConfig
from kvfs.datadir import DataDirInUse
from kvfs.errors import AuthError, InvalidArgument
from kvfs.handshake import Role
from kvfs.launcher import LocalCluster
from kvfs.meta import MetaService
from kvfs.protocol import PROTOCOL_VERSION, Flag, FrameDecoder, encode_frame
from kvfs.rpc import RPCS, Op, Service
from kvfs.transport import Connection


def _admin_ops(service: Service) -> list[Op]:
    return [op for op, r in RPCS.items() if r.service == service and Role.CLIENT not in r.roles]


@pytest.mark.parametrize("service", [Service.META, Service.CHUNKSERVER])
async def test_a_client_token_may_not_call_any_admin_or_server_rpc(
        cluster: LocalCluster, service: Service) -> None:
    cs = cluster.chunkservers[0]
    assert cs is not None
    addr = cluster.addr if service == Service.META else "kvfs://" + cs.addr
    conn = await Connection.open(*parse_addr(addr), cluster.token)
    try:
        assert conn.role == Role.CLIENT
        ops = _admin_ops(service)
        assert ops  # GC_*, CHUNK_DELETE, REGISTER, ...
        for op in ops:
            with pytest.raises(AuthError, match=f"this token may not call {op.name}"):
                await conn.call_raw(op, {})
        assert (await conn.call(rpc.Ping())).service == service.value
    finally:
        conn.close()


async def test_an_admin_token_may_call_admin_and_data_rpcs_but_not_register(
        cluster: LocalCluster) -> None:
    conn = await Connection.open(*parse_addr(cluster.addr), cluster.admin_token)
    try:
        assert conn.role == Role.ADMIN
        assert (await conn.call(rpc.GcStatus())).paused is False
        assert (await conn.call(rpc.Exists(keys=[b"k"]))).exists == [False]
        with pytest.raises(AuthError, match="may not call REGISTER: it needs the server token"):
            await conn.call(rpc.Register(addr="127.0.0.1:1"))
    finally:
        conn.close()


async def test_a_server_token_may_only_register_and_heartbeat(cluster: LocalCluster) -> None:
    conn = await Connection.open(*parse_addr(cluster.addr), cluster.tokens[Role.SERVER])
    try:
        assert conn.role == Role.SERVER
        for op in (Op.LOOKUP, Op.GC_EXPIRE, Op.SERVERS):
            with pytest.raises(AuthError, match=f"may not call {op.name}"):
                await conn.call_raw(op, {})
    finally:
        conn.close()


async def test_wrong_and_missing_tokens_are_refused(cluster: LocalCluster) -> None:
    with pytest.raises(AuthError, match="wrong cluster token"):
        await Connection.open(*parse_addr(cluster.addr), "not-the-token")
    with pytest.raises(AuthError, match="wrong cluster token"):
        await Connection.open(*parse_addr(cluster.addr), "")


class Relay:
    """A real TCP relay on 127.0.0.1:0 that forwards every byte to ``target``, both ways
    (the MITM of the issue: a client given ``kvfs://evil:port``).  ``fake_server``:
    instead of forwarding, answer the client like a server that has no token."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server: asyncio.Server | None = None
        self.port = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Relay:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.target)
        for coro in (self._pipe(r, uw), self._pipe(ur, w)):
            task = asyncio.create_task(coro)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


async def test_a_relay_between_client_and_meta_is_refused(cluster: LocalCluster) -> None:
    async with Relay(parse_addr(cluster.addr)) as relay:
        with pytest.raises(AuthError, match="a relay is between them"):
            await Connection.open("127.0.0.1", relay.port, cluster.token)
        kv = AsyncClient(f"kvfs://127.0.0.1:{relay.port}", token=cluster.token)
        with pytest.raises(AuthError, match="a relay is between them"):
            await kv.open()
        await kv.close()


async def test_a_server_that_cannot_prove_the_token_is_refused_by_the_client(
        cluster: LocalCluster) -> None:
    """An impostor that accepts any AUTH: the client sees no valid proof and refuses."""
    async def impostor(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.writelines(encode_frame(Op.HELLO, 0, {"version": PROTOCOL_VERSION,
                                                "nonce": b"n" * 16, "service": "meta"}))
        dec = FrameDecoder()
        while (ev := dec.next_event()) is not None and not hasattr(ev, "op"):
            data = await r.read(65536)
            if not data:
                return
            dec.receive_data(data)
        assert hasattr(ev, "request_id")
        w.writelines(encode_frame(Op.AUTH, ev.request_id, {"role": "client", "mac": b"x" * 32},
                                  flags=Flag.RESPONSE))
        with contextlib.suppress(ConnectionError):
            await r.read()
        w.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(AuthError, match="could not prove it holds the cluster token"):
            await Connection.open("127.0.0.1", port, cluster.token)
    finally:
        server.close()
        await server.wait_closed()


async def test_address_binding_can_be_turned_off_for_nat(tmp_path: Path) -> None:
    root = tmp_path / "c"
    c = LocalCluster(root, 1, meta=MetaConfig(data=root / "meta", listen="127.0.0.1:0",
                                              bind_auth_to_addresses=False))
    async with c, Relay(parse_addr(c.addr)) as relay:
        conn = await Connection.open("127.0.0.1", relay.port, c.token)
        assert conn.role == Role.CLIENT  # what a NAT or proxy looks like: accepted
        conn.close()


async def test_a_server_id_alive_at_another_address_is_refused(cluster: LocalCluster) -> None:
    """A second chunkserver (another data dir) claiming a live server's id: refused."""
    cs = cluster.chunkservers[0]
    assert cs is not None and cs.server_id is not None
    other = cluster.root / "impostor"
    other.mkdir()
    (other / "state.json").write_text(
        f'{{"server_id": {cs.server_id}, "next_seq": 1, "key": "not-its-key"}}')
    impostor = ChunkServer(cluster.cs_config(0).__class__(
        data=other, meta=cluster.addr, listen="127.0.0.1:0"), tokens=cluster.tokens)
    try:
        with pytest.raises(InvalidArgument, match=f"chunkserver {cs.server_id} is alive at"):
            await impostor.start()
    finally:
        await impostor.close()
    async with cluster.client() as kv:  # the real one still owns its id and address
        servers = {s.server_id: s.addr for s in await kv.servers(refresh=True)}
        assert servers[cs.server_id] == cs.addr
    # the same data dir restarted on a new port keeps its id (its key matches)
    await cluster.stop_chunkserver(0)
    again = await cluster.start_chunkserver(0)
    assert again.server_id == cs.server_id and again.addr != cs.addr


async def test_two_servers_cannot_share_a_data_dir(cluster: LocalCluster) -> None:
    cs = cluster.chunkservers[0]
    assert cs is not None
    with pytest.raises(DataDirInUse, match=f"in use by another chunkserver \\(pid {os.getpid()}\\)"):
        ChunkServer(cluster.cs_config(0), tokens=cluster.tokens)
    assert cluster.meta is not None
    with pytest.raises(DataDirInUse, match="in use by another meta"):
        MetaService(cluster.meta_config, tokens=cluster.tokens)
