"""The soak's short version (bench/soak.py; `python -m kvfs.bench.soak` runs the long one):
meta, 4 chunkservers, the GC daemon and 2 client processes for 20 s.  They read through
get_many and get_into, async and blocking, get_ranges, single gets and fsspec's open, while some keys are
put again as new versions, some deleted, some put with a TTL, and present ones put with
if_absent.  Meanwhile a bit is flipped in a stored value, and a chunkserver is SIGKILLed until
it is declared dead and repaired, then restarted.  The second test also reads every key's file
through a kvfs mount of the cluster (FUSE); the third runs on a full cluster, where the GC
daemon evicts."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuse_mount import needs_fuse

from kvfs.bench.soak import soak
from kvfs.bench.workload import READ_APIS

# over every meta backend (conftest's meta_backend: the SQLite and Redis Cluster halves are
# markers meta_sqlite and meta_redis)
pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(300), pytest.mark.usefixtures("meta_backend")]


async def test_short_soak_reads_every_byte_right_and_loses_nothing(tmp_path: Path) -> None:
    fig = await soak(tmp_path, seconds=20, clients=2, replicas=2)
    print(fig)
    assert fig["reads"] > 0 and fig["puts_ok"] > 0, fig
    assert set(fig["by_api"]) == set(READ_APIS) - {"mount"}, fig  # each API was checked under the faults
    # and reads raced overwrites, deletes and expiries
    assert fig["overwritten"] > 0 and fig["deleted"] > 0 and fig["after_ttl"] > 0, fig
    assert fig["kept_present"] > 0, fig  # and puts with if_absent of present keys,
    assert fig["stored_absent"] == 0, fig  # which kept every one (a replica was always up)
    # replicas=2: neither the dead server nor the bad copy, nor a value overwritten (its old
    # bytes reclaimed) under a reader's cached layout, makes a committed key a miss
    assert fig["misses"] == 0, fig
    assert fig["wrong_total"] == 0, fig
    assert fig["values_lost"] == 0, fig  # replicas=2: one dead server and one bad copy lose nothing
    assert fig["restore_s"] is not None, fig  # the GC daemon repaired the dead server's extents
    # a reader (read repair) or the GC daemon's background scrub found the flipped replica
    # bad, and it was mended from the good copy
    assert fig["flip_mended_s"] is not None, fig
    assert fig["gc_replicas_reported_bad"] + fig["gc_replicas_scrubbed_bad"] >= 1, fig


@needs_fuse
@pytest.mark.fuse
@pytest.mark.parametrize("write_behind", [None, "64MiB"])
async def test_short_soak_through_a_mount_reads_every_file_right(tmp_path: Path, write_behind: str | None
                                                                  ) -> None:
    """The same, with the readers' files through a ``kvfs mount`` of the cluster as another
    read API (another node's view, its kernel's pages and sizes included), and some new keys
    and next versions written as files through it (and with ``--write-behind``, held after
    their close and renamed while held, until their directory's fsync).  Before the mount
    gave its kernel the size of the version an open reads, about 1 in 800 files read here
    came back as one version's bytes cut at another's size."""
    fig = await soak(tmp_path, seconds=20, clients=2, replicas=2, mount=True, write_behind=write_behind)
    print(fig)
    assert set(fig["by_api"]) == set(READ_APIS), fig
    assert fig["by_api"]["mount"] > 0 and fig["overwritten"] > 0, fig
    assert fig["files_written"] > 0, fig  # and some keys were written through it
    # no file read or write through it failed, but for the rare documented ESTALE (a first
    # read finding its file replaced at another size, its pinned bytes reclaimed)
    failed = {k: n for k, n in fig["errors"].items() if k.startswith("mount")}
    assert set(failed) <= {"mount: ESTALE"}, fig
    assert sum(failed.values()) <= max(2, fig["by_api"]["mount"] // 1000), fig
    assert fig["misses"] == 0, fig
    assert fig["wrong_total"] == 0, fig
    assert fig["values_lost"] == 0, fig


async def test_short_soak_of_a_full_cluster_misses_only_evicted_keys_and_never_leased_ones(
        tmp_path: Path) -> None:
    """The same on a full cluster (16 MiB per chunkserver): the GC daemon evicts as the
    clients write.  A read may then miss a committed key, but only one meta no longer has
    after the miss, never one a lease holds: readers lease batches of the oldest keys with
    ``exists_many`` and read them again halfway through the lease.  (With meta ignoring
    leases, a 40 s run had 61 misses of leased keys.)"""
    # (24 MiB filled only as fast as the machine wrote: under IO load 2 of 3 runs of
    # 34e2c78 never filled it in 20 s, and the GC evicted nothing)
    fig = await soak(tmp_path, seconds=20, clients=2, replicas=2, capacity=16 * 1024 * 1024)
    print(fig)
    # it was full, and reads saw it: during the run, or in the final check (whether a
    # reader meets an evicted key before the end is timing: 2 of 7 runs had none)
    assert fig["gc_keys_evicted"] > 0 and fig["evicted"] + fig["final_evicted"] > 0, fig
    # the final check's misses of keys meta no longer has: no more than GC evicted, and
    # none of them a key meta dropped as lost (a reader finding every replica bad)
    assert fig["final_evicted"] <= fig["gc_keys_evicted"] and fig["gc_keys_lost"] == 0, fig
    assert fig["leased"] > 0, fig
    assert fig["misses"] == 0, fig  # no miss of a leased key, nor of a key meta had
    assert fig["wrong_total"] == 0, fig
    assert fig["values_lost"] == 0, fig  # the final check's misses are all eviction's
