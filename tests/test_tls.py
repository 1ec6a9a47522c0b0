"""TLS (optional, stdlib ssl): a cluster whose every connection is TLS, with certificates
made in the test (trustme: a CA, a certificate for 127.0.0.1/localhost, a client
certificate); a wrong CA, a plaintext peer on either side and a missing client certificate
are refused quickly with an error that names TLS."""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme

import kvfs
from kvfs.address import parse_addr
from kvfs.blocking import BlockingSocket
from kvfs.client import AsyncClient
from kvfs.config import (
    ChunkServerConfig,
    ClientConfig,
    MetaConfig,
    ServerConfig,
    TlsConfig,
    tls_fields,
)
from kvfs.errors import AuthError, InvalidArgument, TlsError, Unavailable
from kvfs.handshake import Role
from kvfs.launcher import LocalCluster
from kvfs.rpc import Service
from kvfs.server import RpcServer
from kvfs.tls import TLS_ENV, client_context, server_context
from kvfs.transport import Connection


@dataclass(frozen=True)
class Certs:
    ca: Path  # the cluster's CA
    cert: Path  # for 127.0.0.1 / localhost; the services use it as server and as client
    key: Path
    client_cert: Path  # a client's own (for mutual TLS)
    client_key: Path
    other_ca: Path  # a CA that signed none of them

    def services(self, mutual: bool = True) -> TlsConfig:
        return TlsConfig(tls_cert=self.cert, tls_key=self.key, tls_ca=self.ca if mutual else None)

    def client(self, cert: bool = True, **over: Any) -> ClientConfig:
        mine = {"tls_cert": self.client_cert, "tls_key": self.client_key} if cert else {}
        return ClientConfig(**{"tls_ca": self.ca, **mine, **over})


def write_chain(cert: trustme.LeafCert, path: Path) -> None:
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(path), append=i > 0)


def make_certs(d: Path) -> Certs:
    d.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    c = Certs(d / "ca.pem", d / "kvfs.pem", d / "kvfs.key", d / "client.pem", d / "client.key",
              d / "other-ca.pem")
    ca.cert_pem.write_to_path(str(c.ca))
    server = ca.issue_cert("127.0.0.1", "localhost")
    write_chain(server, c.cert)
    server.private_key_pem.write_to_path(str(c.key))
    client = ca.issue_cert("kvfs-client.test")
    write_chain(client, c.client_cert)
    client.private_key_pem.write_to_path(str(c.client_key))
    trustme.CA().cert_pem.write_to_path(str(c.other_ca))
    return c


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def tls_cluster(tmp_path: Path, certs: Certs) -> AsyncIterator[LocalCluster]:
    """Meta and 2 chunkservers, mutual TLS on every connection (also registration)."""
    c = LocalCluster(tmp_path / "cluster", 2, tls=certs.services())
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def ssl_object(conn: Connection | None) -> ssl.SSLObject | None:
    assert conn is not None and conn._proto.transport is not None
    obj = conn._proto.transport.get_extra_info("ssl_object")
    return obj if isinstance(obj, ssl.SSLObject) else None


async def test_put_get_through_a_tls_cluster(tls_cluster: LocalCluster, certs: Certs) -> None:
    """Every connection is TLS (client to meta and chunkservers, chunkserver to meta), and
    the zero-copy receive path (BufferedProtocol into the caller's buffer) works through it."""
    assert tls_cluster.meta is not None and tls_cluster.meta.rpc.tls is not None
    big = os.urandom(3 * 1024 * 1024 + 17)  # striped over both chunkservers
    async with tls_cluster.client(certs.client()) as kv:
        await kv.put_many([("small", b"x" * 100), ("big", big)])
        assert await kv.get("small") == b"x" * 100
        assert await kv.get("big") == big
        into = bytearray(len(big))
        assert await kv.get_into(["big"], [into]) == [len(big)]
        assert into == big
        assert await kv.get_many(["small", "big", "nope"]) == [b"x" * 100, big, None]
        sessions = [ssl_object(c) for c in kv.connections()]
        assert len(sessions) == 3
        assert all(s is not None and s.version() in ("TLSv1.2", "TLSv1.3") for s in sessions)
    for cs in tls_cluster.chunkservers:
        assert cs is not None and ssl_object(cs.meta_link.connections()[0]) is not None  # over TLS


async def test_large_reads_over_tls_are_read_into_a_buffer_not_sendfiled(
        tls_cluster: LocalCluster, certs: Certs) -> None:
    """sendfile cannot encrypt: over TLS a chunkserver reads every READV answer into a
    buffer (never from its chunk files into the socket, kvfs/fileparts.py), and it arrives
    whole."""
    values = {f"tls/{i}": os.urandom(1024 * 1024 - i) for i in range(8)}
    stores = [cs.store for cs in tls_cluster.chunkservers if cs is not None]
    async with tls_cluster.client(certs.client()) as kv:
        calls = sum(cs.append_calls for cs in tls_cluster.chunkservers if cs is not None)
        await kv.put_many(values)  # 8 MiB on one server: two APPENDs of 4 MiB, sent together
        assert sum(cs.append_calls for cs in tls_cluster.chunkservers if cs is not None) == calls + 2
        bufs = [bytearray(len(v)) for v in values.values()]
        assert await kv.get_into(list(values), bufs) == [len(v) for v in values.values()]
        assert [bytes(b) for b in bufs] == list(values.values())
        assert sum(s.file_spans for s in stores) == 0
        assert sum(s.spans_read for s in stores) >= 1
        conns = [p for cs in tls_cluster.chunkservers if cs is not None for p in cs.rpc.connections]
        assert conns and all(not p.can_send_files for p in conns)


async def test_the_blocking_clients_own_meta_sockets_speak_tls(tls_cluster: LocalCluster,
                                                              certs: Certs) -> None:
    """The blocking client's lookups and reads in its callers' threads (kvfs.blocking) go
    over TLS too, with the client's certificate (the cluster runs mutual TLS) and its
    token."""
    def work() -> None:
        with kvfs.Client(tls_cluster.addr, token=tls_cluster.token, config=certs.client()) as kv:
            kv.put(b"t/k", b"v")
            big = os.urandom(200_000)  # a READV answer over 64 KiB: into the pooled buffer
            kv.put_many({f"t/{i}".encode(): big[i:] for i in range(3)})
            assert kv.exists_many([b"t/k", b"t/none"]) == [True, False]
            assert kv.match_prefix([b"t/k", b"t/none"]) == 1
            (ms,) = kv._meta_sockets._idle
            assert isinstance(ms.sock, ssl.SSLSocket)
            assert ms.sock.version() in ("TLSv1.2", "TLSv1.3")
            reads = kv.aio.rpc_counts["READV"]
            assert kv.get_many([b"t/k", b"t/none"]) == [b"v", None]
            bufs = [bytearray(200_000) for _ in range(3)]
            keys = [f"t/{i}".encode() for i in range(3)]
            assert kv.get_many(keys) == [big[i:] for i in range(3)]
            assert kv.get_into(keys, bufs) == [200_000 - i for i in range(3)]
            assert [bytes(b[: 200_000 - i]) for i, b in enumerate(bufs)] == [big[i:] for i in range(3)]
            assert kv.aio.rpc_counts["READV"] > reads
            socks = [s for p in kv._server_sockets._pools.values() for s in p._idle]
            assert socks and all(isinstance(s.sock, ssl.SSLSocket) for s in socks)

    await asyncio.to_thread(work)


async def test_server_only_tls_accepts_clients_without_certificates(
        tmp_path: Path, certs: Certs) -> None:
    async with LocalCluster(tmp_path / "c", 0, tls=certs.services(mutual=False)) as c:
        async with c.client(certs.client(cert=False)) as kv:
            assert (await kv.stats())["keys"] == 0
            assert ssl_object(kv.connections()[0]) is not None
        # no --tls-ca: the system's CAs, which never signed the test CA
        kv = c.client(ClientConfig(tls_cert=certs.client_cert, tls_key=certs.client_key))
        with pytest.raises(TlsError, match="failed verification"):
            await kv.open()
        await kv.close()


async def test_a_wrong_ca_is_refused(tls_cluster: LocalCluster, certs: Certs) -> None:
    kv = tls_cluster.client(certs.client(tls_ca=certs.other_ca))
    with pytest.raises(TlsError, match=r"certificate of 127\.0\.0\.1:\d+ failed verification"):
        await kv.open()
    await kv.close()


async def test_a_certificate_naming_another_host_is_refused(tmp_path: Path) -> None:
    """The chunkserver checks meta's certificate names the host it dialled."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert("elsewhere.test").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "other.pem"))
    c = LocalCluster(tmp_path / "c", 1, tls=TlsConfig(tls_cert=tmp_path / "other.pem",
                                                      tls_ca=tmp_path / "ca.pem"))
    with pytest.raises(TlsError, match=r"(?i)hostname mismatch|IP address mismatch"):
        await c.start()


async def test_plaintext_client_to_tls_server_fails_fast_naming_tls(
        tls_cluster: LocalCluster) -> None:
    """No silent fallback, no hang: the server waits for a TLS ClientHello, the client for
    a HELLO; the client gives up at its connect timeout and says why."""
    kv = tls_cluster.client(ClientConfig(connect_timeout_s=0.5))
    async with asyncio.timeout(10):
        with pytest.raises(Unavailable, match="--tls-cert, give this client --tls-ca"):
            await kv.open()
    await kv.close()


async def test_plaintext_client_is_closed_by_the_servers_handshake_timeout(
        tmp_path: Path, certs: Certs) -> None:
    meta = MetaConfig(data=tmp_path / "c" / "meta", listen="127.0.0.1:0",
                      handshake_timeout_s=0.3, **tls_fields(certs.services()))
    async with LocalCluster(tmp_path / "c", 0, meta=meta) as c:
        kv = c.client(ClientConfig(connect_timeout_s=30.0))
        async with asyncio.timeout(10):
            with pytest.raises(Unavailable, match=r"closed the connection before its HELLO .*"
                               r"--tls-ca"):
                await kv.open()
        await kv.close()


async def test_the_blocking_clients_socket_closed_before_hello_names_tls(
        tmp_path: Path, certs: Certs, tls_cluster: LocalCluster) -> None:
    """The blocking client's own meta socket (kvfs.blocking) says why a server closed it
    before its HELLO, as the async connection does: a plaintext socket to a TLS server
    (closed at the server's handshake timeout), a TLS one without a client certificate to
    a mutual-TLS server (it once said only "lost in the handshake")."""
    def open_socket(addr: str, token: str, tls: ssl.SSLContext | None) -> None:
        host, port = parse_addr(addr)
        BlockingSocket.open((host, port, None), token, connect_timeout_s=30.0,
                        request_timeout_s=30.0, tls=tls).close()

    meta = MetaConfig(data=tmp_path / "c" / "meta", listen="127.0.0.1:0",
                      handshake_timeout_s=0.3, **tls_fields(certs.services()))
    async with LocalCluster(tmp_path / "c", 0, meta=meta) as c:
        with pytest.raises(Unavailable, match=r"closed the connection before its HELLO .*"
                           r"--tls-cert, give this client --tls-ca"):
            await asyncio.wait_for(asyncio.to_thread(open_socket, c.addr, c.token, None), 10)
    no_cert = client_context(certs.client(cert=False))
    with pytest.raises(Unavailable, match=r"before its HELLO .*mutual TLS .* requires a client "
                       r"certificate"):
        await asyncio.wait_for(asyncio.to_thread(open_socket, tls_cluster.addr,
                                                 tls_cluster.token, no_cert), 10)


async def test_a_close_and_the_timeout_together_still_name_tls(
        tmp_path: Path, certs: Certs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plaintext client starved while the TLS server's handshake timeout closes it: the
    close and the client's own timeout land in one turn of its loop.  The error still says
    why (it once said only "handshake timed out", without the --tls-ca hint)."""
    import time

    from kvfs import transport

    connect_timeout_s = 0.5
    lost = transport._ClientProtocol.connection_lost

    def lost_then_starved(self: Any, exc: Exception | None) -> None:
        lost(self, exc)
        time.sleep(connect_timeout_s)  # the fault: no CPU until the client's timeout is due

    monkeypatch.setattr(transport._ClientProtocol, "connection_lost", lost_then_starved)
    meta = MetaConfig(data=tmp_path / "c" / "meta", listen="127.0.0.1:0",
                      handshake_timeout_s=0.1, **tls_fields(certs.services()))
    async with LocalCluster(tmp_path / "c", 0, meta=meta) as c:
        kv = c.client(ClientConfig(connect_timeout_s=connect_timeout_s))
        async with asyncio.timeout(10):
            with pytest.raises(Unavailable, match="--tls-cert, give this client --tls-ca"):
                await kv.open()
        await kv.close()


async def test_tls_client_to_plaintext_server_is_refused_naming_tls(
        tmp_path: Path, certs: Certs) -> None:
    async with LocalCluster(tmp_path / "plain", 0) as c:
        kv = c.client(certs.client())
        async with asyncio.timeout(10):
            with pytest.raises(TlsError, match="does not speak TLS"):
                await kv.open()
        await kv.close()


async def test_mutual_tls_refuses_a_client_without_a_good_certificate(
        tls_cluster: LocalCluster, certs: Certs, tmp_path: Path) -> None:
    """TLS 1.3 finishes the client's side of the handshake before the server checks the
    client's certificate; the server then hangs up before any HELLO."""
    kv = tls_cluster.client(certs.client(cert=False))
    with pytest.raises(Unavailable, match=r"mutual TLS .* requires a client certificate"):
        await kv.open()
    await kv.close()
    trustme.CA().issue_cert("kvfs-client.test").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "stranger.pem"))
    kv = tls_cluster.client(certs.client(tls_cert=tmp_path / "stranger.pem", tls_key=None))
    with pytest.raises(Unavailable, match=r"mutual TLS .* requires a client certificate"):
        await kv.open()
    await kv.close()


async def test_the_token_still_counts_inside_tls(tls_cluster: LocalCluster, certs: Certs) -> None:
    kv = AsyncClient(tls_cluster.addr, token="0" * 32, config=certs.client())
    with pytest.raises(AuthError, match="wrong cluster token"):
        await kv.open()
    await kv.close()


def test_bad_tls_settings_are_refused_by_name(tmp_path: Path, certs: Certs) -> None:
    with pytest.raises(InvalidArgument, match=r"no such file .*missing.pem"):
        server_context(TlsConfig(tls_cert=tmp_path / "missing.pem"))
    with pytest.raises(InvalidArgument, match="--tls-key/--tls-ca need --tls-cert"):
        server_context(TlsConfig(tls_ca=certs.ca))
    with pytest.raises(InvalidArgument, match="--tls-cert/--tls-key: cannot load"):
        server_context(TlsConfig(tls_cert=certs.ca))  # a certificate without its key
    with pytest.raises(InvalidArgument, match="needs --tls-cert"):
        client_context(TlsConfig(tls_key=certs.key), env=False)
    with pytest.raises(InvalidArgument, match="no such file"):
        RpcServer(object(), Service.META, {Role.CLIENT: "t"},
                  ServerConfig(tls_cert=tmp_path / "nope.pem", tls_key=certs.key))


def test_client_tls_from_the_environment(monkeypatch: pytest.MonkeyPatch, certs: Certs) -> None:
    for name in TLS_ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert client_context(None) is None
    monkeypatch.setenv("KVFS_TLS_CA", str(certs.ca))
    ctx = client_context(ClientConfig())
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert client_context(ClientConfig(), env=False) is None  # services never read it


@pytest.mark.subprocess
def test_kvfs_up_with_tls_end_to_end(tmp_path: Path, certs: Certs) -> None:
    """`kvfs up --tls-*` hands the files to meta, the chunkservers and the GC daemon; the
    CLI's client commands speak TLS with --tls-* or $KVFS_TLS_*, and refuse plaintext."""
    from test_up import alive, kvfs, start_up

    up = start_up(tmp_path, tmp_path / "data", "--chunkservers", "2", "--gc-interval", "1s",
                  "--tls-cert", str(certs.cert), "--tls-key", str(certs.key),
                  "--tls-ca", str(certs.ca))
    pids: dict[str, int] = {}
    try:
        pids = up.children()
        assert set(pids) == {"meta", "chunkserver 0", "chunkserver 1", "gc"}
        assert "TLS with" in up.stderr() and "mutual TLS" in up.stderr()
        mine = ["--tls-ca", str(certs.ca), "--tls-cert", str(certs.client_cert),
                "--tls-key", str(certs.client_key)]
        value = os.urandom(3_000_000)
        r = kvfs(up, "put", "k", "-", *mine, stdin=value)
        assert r.returncode == 0, r.stderr.decode()
        r = kvfs(up, "get", "k", *mine)
        assert r.returncode == 0 and r.stdout == value, r.stderr.decode()
        up.env.update(KVFS_TLS_CA=str(certs.ca), KVFS_TLS_CERT=str(certs.client_cert),
                      KVFS_TLS_KEY=str(certs.client_key))
        r = kvfs(up, "gc", "status", "--json")  # the admin path, TLS from the environment
        assert r.returncode == 0, r.stderr.decode()
        for name in TLS_ENV.values():
            del up.env[name]
        r = kvfs(up, "stat")  # plaintext against TLS: refused, naming TLS, no hang
        assert r.returncode == 1 and b"--tls-ca" in r.stderr, r.stderr.decode()
        assert "gc pass failed" not in up.stderr() and "restarting" not in up.stderr()
    finally:
        up.proc.terminate()
        up.proc.wait(30)
        assert up.proc.stdout is not None
        up.proc.stdout.close()
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, 9)


def test_engine_config_and_fsspec_options_carry_tls(tmp_path: Path, certs: Certs) -> None:
    """The engines' config (``kvfs_tls_*`` keys) and fsspec's storage options (``tls_*``)
    reach the client; a filesystem without them is refused by the TLS cluster."""
    import threading

    import fsspec

    from kvfs._loop import new_event_loop
    from kvfs.config import EngineConfig, from_mapping
    from kvfs.integrations._common import open_client

    loop = new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    c = LocalCluster(tmp_path / "c", 1, tls=certs.services())
    try:
        call(c.start())
        files = {"tls_ca": str(certs.ca), "tls_cert": str(certs.client_cert),
                 "tls_key": str(certs.client_key)}
        cfg = from_mapping(EngineConfig, {"kvfs_addr": c.addr, "kvfs_token": c.token,
                                          **{f"kvfs_{k}": v for k, v in files.items()}},
                           prefix="kvfs_")
        assert cfg.tls_ca == certs.ca
        kv = open_client(cfg)
        try:
            kv.put("e", b"engine")
            assert kv.get("e") == b"engine"
        finally:
            kv.close()
        fs = fsspec.filesystem("kvfs", addr=c.addr, token=c.token, skip_instance_cache=True,
                               **files)
        fs.pipe_file("f", b"fsspec")
        assert fs.cat_file("f") == b"fsspec"
        fs.close()
        plain = fsspec.filesystem("kvfs", addr=c.addr, token=c.token, skip_instance_cache=True,
                                  config=ClientConfig(connect_timeout_s=0.5))
        with pytest.raises(OSError) as err:  # fsspec's FSTimeoutError: ours is its cause
            plain.cat_file("f")
        assert "--tls-ca" in str(err.value.__cause__ or err.value), repr(err.value)
        plain.close()
    finally:
        call(c.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0,
                    reason="FUSE mount tests run as root with /dev/fuse")
def test_fuse_mount_over_tls(tmp_path: Path, certs: Certs) -> None:
    """`kvfs mount --tls-*` against a mutual-TLS cluster; without them it refuses to mount."""
    import subprocess
    import sys

    from conftest import ThreadCluster
    from fuse_mount import Mount

    from kvfs.fs import KVFileSystem

    c = ThreadCluster(tmp_path / "cluster", 1, tls=certs.services())
    m: Mount | None = None
    try:
        flags = ["--tls-ca", str(certs.ca), "--tls-cert", str(certs.client_cert),
                 "--tls-key", str(certs.client_key)]
        m = Mount(tmp_path / "mnt", c, tmp_path / "logs", *flags)
        (m.mnt / "over-tls.bin").write_bytes(b"through the mount, over TLS")
        fs = KVFileSystem(c.addr, token=c.token, skip_instance_cache=True, tls_ca=str(certs.ca),
                          tls_cert=str(certs.client_cert), tls_key=str(certs.client_key))
        try:
            assert fs.cat_file("over-tls.bin") == b"through the mount, over TLS"
        finally:
            fs.close()
        (tmp_path / "plain").mkdir()
        r = subprocess.run([sys.executable, "-m", "kvfs", "mount", str(tmp_path / "plain"),
                            "--addr", c.addr, "--timeout", "2s"],
                           env={**os.environ, "KVFS_TOKEN": c.token}, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and "--tls-ca" in r.stderr, r.stderr
    finally:
        if m is not None:
            m.cleanup()
        c.close()


@pytest.mark.subprocess
def test_kvfs_up_checks_its_tls_files_before_starting(tmp_path: Path, certs: Certs) -> None:
    import subprocess
    import sys

    for args, said in ((["--tls-key", str(certs.key)], "--tls-key/--tls-ca need --tls-cert"),
                       (["--tls-cert", str(tmp_path / "nope.pem")], "no such file"),
                       (["--tls-cert", str(certs.ca)], "cannot load")):
        r = subprocess.run([sys.executable, "-m", "kvfs", "up", "--data", str(tmp_path / "d"),
                            "--listen", "127.0.0.1:0", *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 1 and said in r.stderr, r.stderr
        assert not (tmp_path / "d").exists()  # nothing was started or created


def test_a_tls_hello_to_a_plaintext_decoder_is_named() -> None:
    from kvfs.errors import RemoteProtocolError
    from kvfs.protocol import FrameDecoder

    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="the peer speaks TLS and this side does not"):
        dec.receive_data(b"\x16\x03\x01\x02\x00" + bytes(64))
        dec.next_event()


async def test_a_full_tls_cluster_makes_room_for_a_write(tmp_path: Path, certs: Certs) -> None:
    """MAKE_ROOM over TLS: meta's own GC pass connects to meta and the chunkservers with the
    cluster's TLS settings, evicts, and the refused write then goes through."""
    root = tmp_path / "full"
    c = LocalCluster(root, 1, tls=certs.services(), chunkserver=ChunkServerConfig(
        data=root, heartbeat_interval_s=0.2, chunk_bytes=64 * 1024, capacity_bytes=256 * 1024))
    await c.start()
    try:
        async with c.client(certs.client()) as kv:
            for i in range(40):  # 40 x 4 x 8 KiB = 1.25 MiB through 256 KiB of capacity
                await kv.put_many([(f"w{i}-{j}", bytes([i]) * 8192) for j in range(4)])
            assert await kv.get_many(["w39-0", "w39-3"]) == [bytes([39]) * 8192] * 2
            assert await kv.get_many(["w0-0"]) == [None]  # the oldest were evicted (no GC daemon)
    finally:
        await c.stop()
