"""Two meta processes over one Redis Cluster (``kvfs meta --store redis-cluster://...``):
real ``kvfs meta`` and ``kvfs chunkserver`` processes, a real 3-master Redis Cluster.

The chunkservers register and report to the first meta only; the second learns them
from the store.  Clients on both metas write and read the same keys."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path

import pytest
from poll import until_alive

from kvfs.client import AsyncClient
from kvfs.errors import StaleLayout
from kvfs.launcher import ProcessCluster, ServiceProcess
from kvfs.meta.redis_local import LocalRedisCluster

pytestmark = pytest.mark.redis


def value(key: bytes, gen: int) -> bytes:
    return (key + b":%d:" % gen) * 37


async def test_two_metas_serve_one_store(tmp_path: Path, redis_cluster: LocalRedisCluster) -> None:
    ns = "m" + uuid.uuid4().hex[:10]
    store = ("--store", redis_cluster.url, "--store-namespace", ns)
    c = ProcessCluster(tmp_path / "c", 2, listen="127.0.0.1:0", meta_args=store)
    await c.start()
    meta2 = ServiceProcess("meta 2", [sys.executable, "-m", "kvfs", "meta", "--data", str(tmp_path / "meta2"),
                                      "--listen", "127.0.0.1:0", *store], c.env)
    try:
        addr2 = (await meta2.start()).split()[-1]
        a = AsyncClient(c.addr, token=c.token)
        b = AsyncClient(addr2, token=c.token)
        try:
            # meta 2 knows the chunkservers (registered with meta 1) through the store
            await until_alive(b, 2, "meta 2")
            own = {b"a/%03d" % i: value(b"a/%03d" % i, 0) for i in range(100)}
            other = {b"b/%03d" % i: value(b"b/%03d" % i, 0) for i in range(100)}
            both = [b"s/%03d" % i for i in range(50)]  # written through both metas at once
            await asyncio.gather(
                a.put_many(list(own.items())), b.put_many(list(other.items())),
                a.put_many([(k, value(k, 1)) for k in both]), b.put_many([(k, value(k, 2)) for k in both]))
            everything = {**own, **other}
            for kv in (a, b):
                got = await kv.get_many(list(everything))
                assert got == list(everything.values())
                shared = await kv.get_many(both)
                assert all(v in (value(k, 1), value(k, 2)) for k, v in zip(both, shared, strict=True))
            # one layout per shared key, the same through either meta (each client's layout
            # cache holds the layout it committed itself: read past it)
            assert await a.lookup(both, use_cache=False) == await b.lookup(both, use_cache=False)
            # no lost or duplicate commits: each key listed once, through either meta
            for kv in (a, b):
                listed = [e.key for e in await kv.list(b"", page_size=64)]  # pages across buckets
                assert listed == sorted({*everything, *both})
                assert await kv.match_prefix([b"a/000", b"b/000", b"s/000", b"x"]) == 3
            # a delete through one meta is a miss through the other
            assert await b.delete_many([b"a/000", b"a/001"]) == 2
            assert await a.exists_many([b"a/000", b"a/001", b"a/002"]) == [False, False, True]
            stats = await b.stats()
            assert stats["keys"] == len(everything) + len(both) - 2
            assert [s["alive"] for s in stats["servers"]] == [True, True]
        finally:
            await a.close()
            await b.close()
    finally:
        await meta2.stop()
        await c.stop()


async def test_a_bad_store_is_refused_by_name(tmp_path: Path) -> None:
    from kvfs.config import MetaConfig
    from kvfs.errors import InvalidArgument, Unavailable
    from kvfs.meta import MetaService

    with pytest.raises(ValueError, match=r"--store must be rocksdb, sqlite or redis-cluster://HOST:PORT\[,\.\.\.\], "
                                         r"got 'sqlite:/x'"):
        MetaConfig(data=tmp_path / "a", store="sqlite:/x")
    with pytest.raises(InvalidArgument, match="bad meta store 'redis-cluster://': no HOST:PORT after"):
        MetaService(MetaConfig(data=tmp_path / "a", store="redis-cluster://"))
    meta = MetaService(MetaConfig(data=tmp_path / "b", listen="127.0.0.1:0", store="redis-cluster://127.0.0.1:1"))
    try:
        with pytest.raises(Unavailable, match=r"redis cluster at 127\.0\.0\.1:1 unreachable"):
            await meta.start()
    finally:
        await meta.close()


async def test_metas_registering_at_once_give_out_distinct_ids(tmp_path: Path,
                                                              redis_cluster: LocalRedisCluster) -> None:
    from kvfs import rpc
    from kvfs.config import MetaConfig
    from kvfs.meta import MetaService

    ns = "r" + uuid.uuid4().hex[:10]
    metas = [MetaService(MetaConfig(data=tmp_path / f"m{i}", listen="127.0.0.1:0", store=redis_cluster.url,
                                    store_namespace=ns)) for i in range(2)]
    try:
        for m in metas:
            await m.start()
        regs = [m.rpc_register(rpc.Register(addr=f"127.0.0.1:{1000 + 10 * i + j}", key=f"k{i}.{j}"),
                               memoryview(b"")) for i, m in enumerate(metas) for j in range(5)]
        ids = [reply.server_id for reply, _ in await asyncio.gather(*regs)]
        assert sorted(ids) == list(range(1, 11))  # ten servers, ten ids, none given twice
        for m in metas:
            await m.index.refresh()
            assert sorted(m.index.servers) == list(range(1, 11))
    finally:
        for m in metas:
            await m.close()


async def test_two_metas_with_gc_lose_and_duplicate_no_commit(tmp_path: Path,
                                                            redis_cluster: LocalRedisCluster) -> None:
    """Two metas on one store, a client and a GC daemon on each, and GC passes run through
    the second meta while both clients overwrite, delete and expire keys: every key reads
    back its last committed value through either meta, is listed once, every TTL key is
    swept and counted exactly once, and fsck finds no layout pointing at reclaimed bytes.
    The daemons take turns by the store's lease: one runs passes until it stops."""
    from kvfs.gc.driver import GarbageCollector, PassOptions, run_daemon

    ns = "g" + uuid.uuid4().hex[:10]
    store = ("--store", redis_cluster.url, "--store-namespace", ns)
    c = ProcessCluster(tmp_path / "c", 2, listen="127.0.0.1:0", meta_args=store,
                       chunkserver_args=("--chunk-bytes", str(256 * 1024)))
    await c.start()
    meta2 = ServiceProcess("meta 2", [sys.executable, "-m", "kvfs", "meta", "--data", str(tmp_path / "meta2"),
                                      "--listen", "127.0.0.1:0", *store], c.env)
    opts = PassOptions(apply=True, grace_s=0.0, threshold=0.2)
    passes = {1: 0, 2: 0}
    stops = {1: asyncio.Event(), 2: asyncio.Event()}
    daemons: dict[int, asyncio.Task[None]] = {}
    try:
        addr2 = (await meta2.start()).split()[-1]
        addrs = {1: c.addr, 2: addr2}
        a = AsyncClient(c.addr, token=c.token)
        b = AsyncClient(addr2, token=c.token)
        try:
            await until_alive(b, 2, "meta 2")
            for i in (1, 2):
                daemons[i] = asyncio.create_task(run_daemon(
                    addrs[i], c.admin_token, opts, 0.2, stops[i],
                    on_pass=lambda _r, i=i: passes.__setitem__(i, passes[i] + 1)))
            final: dict[str, dict[bytes, bytes]] = {"a": {}, "b": {}}
            ttl_keys: list[bytes] = []

            async def put(kv: AsyncClient, items: list[tuple[bytes, bytes]], ttl: float | None = None,
                          ) -> None:
                # with grace_s=0 a pass may reclaim a put's chunk before its COMMIT (a slow
                # machine widens that window): StaleLayout, "retry the put" (keys on other
                # Redis nodes may be committed already; the retry overwrites them)
                for _ in range(5):
                    try:
                        await kv.put_many(items, ttl=ttl)
                        return
                    except StaleLayout:
                        continue
                raise AssertionError("a put was refused StaleLayout 5 times in a row")

            async def writer(kv: AsyncClient, name: str, gens: int) -> None:
                for g in range(gens):
                    own = [(b"%s/%03d" % (name.encode(), i), value(b"%s/%d" % (name.encode(), i), g) * 10)
                           for i in range(40)]
                    shared = [(b"s/%03d" % i, value(b"s%s" % name.encode(), g) * 10) for i in range(20)]
                    await put(kv, own + shared)  # overwrites: the last generation becomes garbage
                    final[name].update(own + shared)
                    ttl = [(b"t/%s/%d/%d" % (name.encode(), g, i), b"x" * 3000) for i in range(5)]
                    await put(kv, ttl, ttl=0.5)
                    ttl_keys.extend(k for k, _ in ttl)

            async def manual_passes(stop: asyncio.Event) -> int:
                n = 0
                async with GarbageCollector(addr2, token=c.admin_token) as gc:
                    while not stop.is_set():
                        await gc.run_pass(opts)
                        n += 1
                return n

            writers_done = asyncio.Event()
            manual = asyncio.create_task(manual_passes(writers_done))
            await asyncio.gather(writer(a, "a", 12), writer(b, "b", 12))
            writers_done.set()
            assert await manual > 0
            # deletes through one meta, of keys written through the other
            assert await b.delete_many([b"a/000", b"a/001"]) == 2
            for k in (b"a/000", b"a/001"):
                del final["a"][k]

            async with GarbageCollector(c.addr, token=c.admin_token) as gc:
                deadline = time.monotonic() + 60
                while (await gc.status())["metrics"]["keys_expired"] < len(ttl_keys):
                    assert time.monotonic() < deadline, "the TTL keys were never swept"
                    await asyncio.sleep(0.2)
                ran = sorted(passes.values())
                assert ran[0] == 0 < ran[1], passes  # one daemon ran passes, the other waited its turn
                holder = max(passes, key=lambda i: passes[i])
                stops[holder].set()
                await daemons.pop(holder)
                other = 3 - holder
                deadline = time.monotonic() + 30
                while passes[other] == 0:  # the stopped daemon handed its lease on
                    assert time.monotonic() < deadline, "the other daemon never took over"
                    await asyncio.sleep(0.1)
                status = await gc.status()
                fsck = await gc.fsck(cutoff_s=0.0)
            m = status["metrics"]
            assert m["keys_expired"] == len(ttl_keys)  # each swept once, by one of the GCs
            assert m["chunks_deleted"] > 0 and m["bytes_reclaimed"] > 0
            assert fsck.missing_refs == [] and fsck.corrupt_refs == []

            own = {**{k: v for k, v in final["a"].items() if not k.startswith(b"s/")},
                   **{k: v for k, v in final["b"].items() if not k.startswith(b"s/")}}
            shared_keys = sorted(k for k in final["a"] if k.startswith(b"s/"))
            for kv in (a, b):
                assert await kv.get_many(list(own)) == list(own.values())
                for k, v in zip(shared_keys, await kv.get_many(shared_keys), strict=True):
                    assert v in (final["a"][k], final["b"][k])  # the last commit of one writer
                assert await kv.exists_many(ttl_keys) == [False] * len(ttl_keys)
                listed = [e.key for e in await kv.list(b"", page_size=64)]
                assert listed == sorted({*own, *shared_keys})  # each key once
            assert (await b.stats())["keys"] == len(own) + len(shared_keys)
        finally:
            await a.close()
            await b.close()
    finally:
        for i, t in daemons.items():
            stops[i].set()
            await t
        await meta2.stop()
        await c.stop()

async def test_clients_and_chunkservers_fail_over_between_metas(tmp_path: Path,
                                                                redis_cluster: LocalRedisCluster) -> None:
    """Two metas on one store; a client given both (``kvfs://M1,M2``) spreads its calls over
    them, chunkservers given both report to one; meta 1 is killed while the client writes
    and reads: no call fails, and past the heartbeat timeout the chunkservers are still
    alive (their heartbeats went to meta 2)."""
    ns = "f" + uuid.uuid4().hex[:10]
    store = ("--store", redis_cluster.url, "--store-namespace", ns, "--heartbeat-timeout", "2s")
    c = ProcessCluster(tmp_path / "c", 0, listen="127.0.0.1:0", meta_args=store)
    await c.start()
    meta2 = ServiceProcess("meta 2", [sys.executable, "-m", "kvfs", "meta", "--data", str(tmp_path / "meta2"),
                                      "--listen", "127.0.0.1:0", *store], c.env)
    servers: list[ServiceProcess] = []
    kv: AsyncClient | None = None
    try:
        addr2 = (await meta2.start()).split()[-1]
        both = c.addr + "," + addr2.removeprefix("kvfs://")
        servers = [ServiceProcess(f"cs{i}", [sys.executable, "-m", "kvfs", "chunkserver", "--data",
                                             str(tmp_path / f"cs{i}"), "--meta", both, "--listen",
                                             "127.0.0.1:0", "--heartbeat-interval", "200ms"], c.env)
                   for i in range(2)]
        await asyncio.gather(*(s.start() for s in servers))
        kv = AsyncClient(both, token=c.token)
        assert kv.addr == both
        await until_alive(kv, 2, "the client's metas")
        m1, m2 = (a.removeprefix("kvfs://") for a in (c.addr, addr2))
        written: dict[bytes, bytes] = {}
        errors: list[BaseException] = []
        killed_at: float | None = None

        async def work(rounds_after_kill: float) -> None:
            i = 0
            while killed_at is None or time.monotonic() - killed_at < rounds_after_kill:
                assert kv is not None
                batch = {b"k/%05d" % (i * 4 + j): value(b"k/%05d" % (i * 4 + j), 0) for j in range(4)}
                try:
                    await kv.put_many(list(batch.items()))
                    written.update(batch)
                    assert await kv.get_many(list(batch)) == list(batch.values())
                    assert await kv.exists_many(list(batch)) == [True] * 4
                except BaseException as exc:
                    errors.append(exc)
                    return
                i += 1

        task = asyncio.create_task(work(4.0))  # on past the 2 s heartbeat timeout
        while len(written) < 80 and not task.done():
            await asyncio.sleep(0.05)
        spread = dict(kv.meta_calls)
        assert spread.get(m1, 0) > 5 and spread.get(m2, 0) > 5, spread  # both metas served calls
        assert c.meta is not None
        c.meta.kill()  # SIGKILL meta 1 mid-run
        killed_at = time.monotonic()
        await task
        assert errors == []
        after = dict(kv.meta_calls)
        assert after[m1] - spread[m1] <= 1 and after[m2] - spread[m2] > 10, (spread, after)
        assert await kv.get_many(list(written)) == list(written.values())
        # the chunkservers kept reporting, to meta 2: alive well past the heartbeat timeout
        assert [s.alive for s in await kv.servers(refresh=True)] == [True, True]
    finally:
        if kv is not None:
            await kv.close()
        await asyncio.gather(*(s.stop() for s in servers))
        await meta2.stop()
        await c.stop()
