"""The engines' own file backends, unmodified, on a real ``kvfs mount`` (FUSE, root), on CPU.

SGLang 0.5.23's ``HiCacheFile`` (its ``file`` HiCache backend) with ``file_path`` on the mount,
driven through its page API (``batch_set``/``batch_get``/``exists``, as HiCacheController calls
it); LMCache 0.5.6's ``LocalDiskBackend`` with ``local_disk`` on the mount, put/get of memory
objects.  Bytes read back must equal those written, and the files must be kvfs keys that
another client of the cluster reads with the same bytes.  HiCacheFile runs on the default
mount and on one with ``--write-behind`` (its closes return before the commit; an fsync of
the directory waits for it, then another client reads the pages).  Each half runs in its engine's venv
(the other is skipped there); the mount process runs under ``KVFS_MOUNT_PYTHON``
(tests/fuse_mount.py), since the engine venvs hold no pyfuse3.  The cluster is of real server
processes (``module_proc_cluster``), apart from the engine's: numpy's ``tofile`` holds the GIL
through its ``fclose``, whose FUSE flush commits to the cluster, so servers on threads of this
process (a ``ThreadCluster``) could not answer until the mount's 3 s timeout, for each page.
"""

from __future__ import annotations

import importlib.util
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuse_mount import Mount

import kvfs
from kvfs.chunkserver.durability import fsync_dir
from kvfs.launcher import ProcessCluster

pytestmark = pytest.mark.engines
PAGES = 16


def kvfs_key(mount: Mount, path: Path) -> bytes:
    return str(path.relative_to(mount.mnt)).encode()


@pytest.fixture(scope="module")
def tcluster(module_proc_cluster: ProcessCluster) -> ProcessCluster:
    """The cluster of conftest's ``mount`` in this module: real server processes."""
    return module_proc_cluster


@pytest.fixture(params=["default", "write-behind"])
def hicache_mount(request: pytest.FixtureRequest, module_proc_cluster: ProcessCluster,
                  tmp_path: Path) -> Iterator[tuple[Mount, str]]:
    """The module's mount, or one of its own with ``--write-behind``; and a directory name
    for the run (both mounts are of one cluster)."""
    if request.param == "default":
        yield request.getfixturevalue("mount"), "sglang-hicache"
        return
    m = Mount(tmp_path / "mnt", module_proc_cluster, tmp_path / "logs", "--write-behind", "64MiB")
    try:
        yield m, "sglang-hicache-wb"
    finally:
        m.cleanup()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang venv only")
def test_sglang_hicache_file_on_the_mount(module_proc_cluster: ProcessCluster,
                                         hicache_mount: tuple[Mount, str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    mount, name = hicache_mount
    with warnings.catch_warnings():  # sglang warns about GPU-only quantizers at import
        warnings.simplefilter("ignore")
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    d = mount.mnt / name
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="test/llama")
    store = HiCacheFile(cfg, file_path=str(d))
    assert d.is_dir()  # HiCacheFile made its directory on the mount

    gen = torch.Generator().manual_seed(12)
    # one page: [2 (k, v), layers 4, page 16 tokens, heads 2, head_dim 64] in bfloat16, 16 KiB
    pages = [torch.randn(2, 4, 16, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(PAGES)]
    keys = [f"{i:04x}" + "ab" * 30 for i in range(PAGES)]
    assert not any(store.exists(k) for k in keys)
    assert store.batch_set(keys, pages)
    assert all(store.exists(k) for k in keys)

    targets = [torch.empty_like(p) for p in pages]
    got = store.batch_get(keys, targets)
    assert all(g is not None for g in got)
    for want, t in zip(pages, targets, strict=True):
        assert t.view(torch.uint8).numpy().tobytes() == want.view(torch.uint8).numpy().tobytes()

    files = sorted(p for p in d.iterdir())
    assert len(files) == PAGES and all(p.suffix == ".bin" for p in files)  # no .tmp left
    fsync_dir(d)  # --write-behind: the pages held by the mount committed (else: no-op)
    with kvfs.Client(module_proc_cluster.addr, token=module_proc_cluster.token) as kv:
        for k, want in zip(keys, pages, strict=True):
            path = d / f"{store._get_suffixed_key(k)}.bin"
            value = kv.get(kvfs_key(mount, path))
            assert value == want.view(torch.uint8).numpy().tobytes(), path.name
    # a page missing from the mount is a miss, not an error
    assert store.batch_get(["ff" * 32], [torch.empty_like(pages[0])]) == [None]


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is None, reason="lmcache venv only")
def test_lmcache_local_disk_on_the_mount(module_proc_cluster: ProcessCluster, mount: Mount,
                                        tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from lmcache.v1.check.utils import (
            _get_default_metadata,
            create_test_key,
            create_test_memory_obj_for_storage_manager,
        )
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
        from lmcache.v1.storage_backend.storage_manager import StorageManager

    d = mount.mnt / "lmcache-disk"
    cfg_path = tmp_path / "lmcache.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        chunk_size: 256
        local_cpu: true
        max_local_cpu_size: 0.05
        local_disk: "file://{d}/"
        max_local_disk_size: 0.05
        """))
    model = "kvfs-mount-model"
    metadata = _get_default_metadata(model)
    sm = StorageManager(config=LMCacheEngineConfig.from_file(str(cfg_path)), metadata=metadata,
                        event_manager=EventManager())
    try:
        disks = [b for b in sm.storage_backends.values() if isinstance(b, LocalDiskBackend)]
        assert len(disks) == 1, list(sm.storage_backends)
        disk = disks[0]
        keys = [create_test_key(model, f"mnt-{i}") for i in range(8)]
        objs = [create_test_memory_obj_for_storage_manager(sm, metadata) for _ in keys]
        assert all(o is not None for o in objs)
        gen = torch.Generator().manual_seed(5)
        for o in objs:
            o.tensor.copy_(torch.randn(o.tensor.shape, generator=gen).to(o.tensor.dtype))
        want = [bytes(o.byte_array) for o in objs]
        disk.batched_submit_put_task(keys, objs)
        deadline = time.monotonic() + 120
        while not all(disk.contains(k) for k in keys):
            assert time.monotonic() < deadline, "LocalDiskBackend puts did not finish"
            time.sleep(0.05)
        for k, w in zip(keys, want, strict=True):
            got = disk.get_blocking(k)
            assert got is not None and bytes(got.byte_array) == w  # bit-exact through the mount
            got.ref_count_down()
        with kvfs.Client(module_proc_cluster.addr, token=module_proc_cluster.token) as kv:
            for k, w in zip(keys, want, strict=True):
                path = Path(disk._key_to_path(k))
                assert path.is_file() and path.parent == d
                value = kv.get(kvfs_key(mount, path))
                assert value == w, path.name  # the file is a kvfs key, the same bytes
    finally:
        sm.close()
