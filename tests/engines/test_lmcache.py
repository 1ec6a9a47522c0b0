"""LMCache 0.5.6 on kvfs, on CPU: its own checker, a StorageManager built from a config with
``remote_storage_plugins: [kvfs]`` alone, shutdown with puts in flight, a dead cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from lmcache.v1.check.utils import (
        _get_default_metadata,
        create_test_key,
        create_test_memory_obj_for_storage_manager,
        find_remote_backend,
    )

from conftest import ThreadCluster

import kvfs
from kvfs.bench.engines import lmcache_config, lmcache_storage_manager

pytestmark = pytest.mark.engines
MODEL = "kvfs-test-model"


def config_file(tmp: Path, tc: ThreadCluster, *, remote_url: bool = False,
                **extra: Any) -> Path:
    return lmcache_config(tmp / "lmcache.yaml", tc.addr, tc.token, max_local_cpu_gib=0.05,
                          remote_url=remote_url, **extra)


def test_lmcache_basic_check_test_remote(tcluster: ThreadCluster, tmp_path: Path) -> None:
    cfg = config_file(tmp_path, tcluster, remote_url=True)  # the checker builds one backend
    env = {**os.environ, "LMCACHE_CONFIG_FILE": str(cfg), "PYTHONHASHSEED": "0"}
    r = subprocess.run([sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_remote"],
                       env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("Validation: 5/5 passed (100.0%)") == 3  # no-exist, put, exist
    assert "Validation (content correct): 5/5 passed (100.0%)" in r.stdout


def _wait_listed(kv: kvfs.Client, prefix: bytes, n: int) -> None:
    """Until ``n`` keys under ``prefix`` are in kvfs (LMCache's puts are asynchronous)."""
    deadline = time.monotonic() + 60
    while len(kv.list(prefix)) < n:
        assert time.monotonic() < deadline, "puts did not reach kvfs"
        time.sleep(0.05)


def storage_manager(cfg: Path) -> tuple[Any, Any]:
    metadata = _get_default_metadata(MODEL)
    return lmcache_storage_manager(cfg, metadata), metadata


def test_storage_manager_round_trip_bit_exact(tcluster: ThreadCluster, tmp_path: Path) -> None:
    sm, metadata = storage_manager(config_file(tmp_path, tcluster, kvfs_namespace="rt"))
    try:
        remotes = [n for n in sm.storage_backends if n.startswith("RemoteBackend")]
        assert remotes == ["RemoteBackend-kvfs"]  # one backend: every chunk written once
        keys = [create_test_key(MODEL, f"rt-{i}") for i in range(8)]
        objs = [create_test_memory_obj_for_storage_manager(sm, metadata) for _ in keys]
        gen = torch.Generator().manual_seed(3)
        for o in objs:
            o.tensor.copy_(torch.randn(o.tensor.shape, generator=gen).to(o.tensor.dtype))
        want = [bytes(o.byte_array) for o in objs]
        sm.batched_put(keys, objs)
        with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
            _wait_listed(kv, b"rt/", len(keys))
            # one value per chunk, named as before: namespace/ + LMCache's to_string()
            assert {i.key for i in kv.list(b"rt/")} == {b"rt/" + k.to_string().encode()
                                                       for k in keys}
        remote = find_remote_backend(sm)
        assert remote is not None
        conn = remote.connection._connector  # inside LMCache's InstrumentedRemoteConnector
        assert not conn.client._meta_sockets._idle
        assert remote.batched_contains(keys) == len(keys)  # a pinned lookup: leases
        # LMCache waits for the answer: asked in this thread, on the blocking client's own
        # meta socket, not through kvfs's IO thread
        assert len(conn.client._meta_sockets._idle) == 1
        assert conn.client.aio.lease_holder == conn.aclient.lease_holder  # one engine, one holder

        async def holders() -> set[str]:
            assert tcluster.cluster.meta is not None
            leases = tcluster.cluster.meta.index.leases
            return {h for k in keys for h in leases.holders(conn._key(k))}

        assert tcluster.call(holders()) == {conn.aclient.lease_holder}
        got = remote.batched_get_blocking(keys)
        assert got is not None and [bytes(g.byte_array) for g in got] == want  # bit-exact
        for g in got:
            g.ref_count_down()
    finally:
        sm.close()


def test_chunk_keys_are_namespace_and_to_string(tcluster: ThreadCluster, tmp_path: Path) -> None:
    """The connector builds a batch's kvfs keys from a template per run of keys (not
    ``to_string`` per key); every kind of LMCache key still gets ``namespace/`` +
    ``to_string()``, byte for byte: runs of keys of other models, workers, world sizes and
    dtypes interleaved, odd model names, hashes that are negative or bytes, tags, layer keys."""
    from lmcache.utils import CacheEngineKey, LayerCacheEngineKey

    sm, _metadata = storage_manager(config_file(tmp_path, tcluster, kvfs_namespace="k%s/ns"))
    try:
        remote = find_remote_backend(sm)
        assert remote is not None
        conn = remote.connection._connector
        big = int("1" * 40)  # world sizes equal in value, not the same int object
        keys: list[Any] = []
        for i in range(3):
            for model in (MODEL, "m%x@y/ü", MODEL + "%%"):
                for ws, worker in ((8, 0), (8, 3), (big, 1), (int(str(big)), 1)):
                    for dtype in (torch.bfloat16, torch.float16):
                        keys.append(CacheEngineKey(model, ws, worker, 0xABC << (20 * i), dtype))
        keys += [
            CacheEngineKey(MODEL, 8, 0, -0x1F, torch.bfloat16),
            CacheEngineKey(MODEL, 8, 0, 0, torch.bfloat16),
            CacheEngineKey(MODEL, 8, 0, b"\x00\x01ab", torch.bfloat16),
            CacheEngineKey(MODEL, 8, 0, 7, torch.bfloat16,
                           request_configs={"lmcache.tag.user": "a%b", "other": 1}),
            CacheEngineKey(MODEL, 8, 0, True, torch.bfloat16),
            LayerCacheEngineKey(MODEL, 8, 0, 0x5A, torch.bfloat16, layer_id=3),
            create_test_key(MODEL, "after"),
        ]
        want = [b"k%s/ns/" + k.to_string().encode() for k in keys]
        assert conn._keys(keys) == want
        assert conn._keys(keys[::-1]) == want[::-1]  # again: the last run's template kept
        assert conn._keys(keys[-1:]) == want[-1:]
        assert [conn._key(k) for k in keys] == want
        assert conn._keys([]) == conn._keys([], keep=False) == []
        # the lookups' way (keep=False): from the last template alone where every key fits
        # it, else as above; the same bytes either way
        assert conn._keys(keys, keep=False) == want
        assert conn._keys(keys[::-1], keep=False) == want[::-1]
        plain = [CacheEngineKey(MODEL, 8, 0, h, torch.bfloat16)
                 for h in (0, 1, 0xF, 0x10, -0x1F, 1 << 255, (1 << 256) - 1, 1 << 300)]

        def made(call: list[Any]) -> list[bytes]:
            return [b"k%s/ns/" + k.to_string().encode() for k in call]

        def fresh_template() -> None:  # the last template plain's, its memo empty
            conn._keys(plain[:1])
            conn._last_template[-1].clear()

        fresh_template()
        assert conn._fill(plain) == made(plain)  # filled from the template
        conn._keys(plain[:1])
        assert conn._fill(plain) is None  # its first chunk's key kept: the memo's way
        assert conn._keys(plain, keep=False) == made(plain)
        odd = [*keys[-5:-1], keys[1], keys[2]]  # bytes/bool hash, tags, layer, dtype, worker
        for o in odd:  # one key of another kind or other fields anywhere in the call
            for at in (0, 3, len(plain)):
                call = [*plain[:at], o, *plain[at:]]
                fresh_template()
                assert conn._fill(call) is None
                fresh_template()
                assert conn._keys(call, keep=False) == made(call)
    finally:
        sm.close()


@pytest.mark.parametrize("limit", [0, 5])
def test_key_memo_gives_the_same_keys_and_stays_bounded(tcluster: ThreadCluster, tmp_path: Path,
                                                        limit: int) -> None:
    """``kvfs_key_memo`` keys made from a template by chunk hash: every key is still
    ``namespace/`` + ``to_string()`` byte for byte, when found in the memo, after it was
    cleared for being full, after a key of another model in between, and with it off (0);
    the memo never holds more than the limit, and a stored chunk is found through it."""
    from kvfs.config import EngineConfig, from_mapping

    with pytest.raises(ValueError, match="key_memo"):
        from_mapping(EngineConfig, {"kvfs_key_memo": -1}, prefix="kvfs_")
    sm, metadata = storage_manager(config_file(tmp_path, tcluster, kvfs_namespace="memo",
                                               kvfs_key_memo=limit))
    try:
        remote = find_remote_backend(sm)
        assert remote is not None
        conn = remote.connection._connector
        assert conn.config.key_memo == limit

        def memo() -> dict[int, bytes]:
            held: dict[int, bytes] = conn._last_template[-1]
            return held

        keys = [create_test_key(MODEL, f"memo-{i}") for i in range(8)]  # more than 5
        other = create_test_key(MODEL + "-other", "memo-0")
        want = [b"memo/" + k.to_string().encode() for k in keys]
        calls = [keys[:3], keys[:3], keys, keys[::-1], [keys[0], other, keys[1]], keys[:2],
                 keys[6:], keys]
        for call in calls:
            got = conn._keys(call)
            assert got == [b"memo/" + k.to_string().encode() for k in call]
            assert len(memo()) <= limit
        first = conn._keys(keys[6:])
        if limit:  # kept, and handed out again
            assert [memo()[k.chunk_hash] for k in keys[6:]] == want[6:]
            assert all(a is b for a, b in zip(first, conn._keys(keys[6:]), strict=True))
            assert all(a is b for a, b in zip(first, conn._keys(keys[6:], keep=False),
                                              strict=True))  # a lookup finds them too
        else:
            assert memo() == {}
        # a lookup whose first chunk's key is not kept neither uses the memo nor adds to it
        fresh = [create_test_key(MODEL, f"fresh-{i}") for i in range(3)]
        before = dict(memo())
        assert conn._keys(fresh, keep=False) == [b"memo/" + k.to_string().encode() for k in fresh]
        assert memo() == before
        objs = [create_test_memory_obj_for_storage_manager(sm, metadata) for _ in keys]
        sm.batched_put(keys, objs)
        with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
            _wait_listed(kv, b"memo/", len(keys))
            assert sorted(i.key for i in kv.list(b"memo/")) == sorted(want)
        assert remote.batched_contains(keys) == remote.batched_contains(keys) == len(keys)
        assert len(memo()) <= limit
    finally:
        sm.close()


def test_destroy_with_puts_in_flight_does_not_crash(tcluster: ThreadCluster,
                                                   tmp_path: Path) -> None:
    """LMCache's close frees its CPU buffer pool, then closes the remote backends, while the
    puts it just queued on its loop still have to read that pool.  Before the connector's
    pool close waited for queued-but-unstarted puts this crashed (SIGSEGV in kvfs's CRC of a
    freed buffer) in 5 of 5 runs here."""
    cfg = config_file(tmp_path, tcluster, kvfs_namespace="destroy")
    script = textwrap.dedent(f"""
        import warnings; warnings.simplefilter("ignore")
        from lmcache.v1.check.utils import (_get_default_metadata, create_test_key,
            create_test_memory_obj_for_storage_manager)
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.storage_backend.storage_manager import StorageManager
        md = _get_default_metadata({MODEL!r})
        for trial in range(3):
            sm = StorageManager(config=LMCacheEngineConfig.from_file({str(cfg)!r}),
                                metadata=md, event_manager=EventManager())
            keys = [create_test_key({MODEL!r}, f"d{{trial}}-{{i}}") for i in range(24)]
            objs = [create_test_memory_obj_for_storage_manager(sm, md) for _ in keys]
            sm.batched_put(keys, [o for o in objs if o is not None])
            sm.close()   # frees the CPU pool first, then the remote backends
        print("survived")
        """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stderr[-3000:])


def test_cluster_down_is_a_miss_in_bounded_time(tmp_path: Path) -> None:
    tc = ThreadCluster(tmp_path / "c")
    sm, _metadata = storage_manager(config_file(tmp_path, tc, kvfs_namespace="down",
                                               kvfs_timeout_s=1, kvfs_connect_timeout_s=1))
    try:
        remote = find_remote_backend(sm)
        assert remote is not None
        keys = [create_test_key(MODEL, f"down-{i}") for i in range(4)]
        tc.stop_services()
        started = time.monotonic()
        assert remote.batched_contains(keys) == 0
        assert not remote.contains(keys[0])
        got = remote.batched_get_blocking(keys)
        assert not got or all(g is None for g in got)
        assert time.monotonic() - started < 60  # bounded, never a hang
    finally:
        sm.close()
        tc.close()
