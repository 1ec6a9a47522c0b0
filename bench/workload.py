"""A mixed read/write workload that checks every byte it reads, for fault tests and the soak.

Writers ``put_many`` new keys in small batches; a key counts as committed only once its
put returned.  Optionally they also overwrite, delete, put with a TTL and put with
``if_absent`` (:class:`MixedWorkload`).  Readers read random committed keys through each read
API in turn (:data:`READ_APIS`: ``get_many``; ``get_into`` into buffers of the value's size,
larger, one byte too small, or three pieces; ``get_ranges`` of a slice; ``get`` of each key at
once; the first two through a blocking ``kvfs.Client`` too, when one is given; files, whole
or a slice, through a kvfs mount and a blocking fsspec filesystem's ``open``, when given) and
compare
each value with the bytes its key and version determine (:class:`Values`), so a wrong byte can
never pass unseen.  A ``get_into`` that writes a byte it should not (past the value, or
anything on ``TOO_SMALL``) counts as a wrong value too, but for bytes of an older version of
the key at their own offsets, which a read that found the key resized may leave
(``Figures.left_old``).  Figures are kept per phase (:meth:`MixedWorkload.phase`): reads (in all
and per API), wrong values, misses of committed keys, read errors, failed puts, and the
longest single read (the stall a reader saw).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import itertools
import os
import random
import time
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from fsspec import AbstractFileSystem

from kvfs.chunkserver.durability import fsync_dir
from kvfs.client import MISS, TOO_SMALL, AsyncClient
from kvfs.errors import KVFSError
from kvfs.sync import Client

MiB = 1024 * 1024
# the sync ones: through the blocking Client, when one is given; get_ranges: fsspec's cat paths;
# get: one call per key, all at once (the client batches them and cuts each call's answer out);
# mount: each key's file through a kvfs mount (FUSE); fsspec open: through a blocking fsspec
# KVFileSystem's open(); each read whole or a slice
READ_APIS = ("get_many", "get_into", "get_ranges", "get", "sync get_many", "sync get_into", "mount",
             "fsspec open")
_BLOCK = 64  # a value is one block repeated: its version (4 bytes), then a digest
EXPIRY_SLACK_S = 0.5  # a read this close to a key's expiry may find it or miss it
_UNTOUCHED = 0xA5  # what a get_into buffer holds before the read: bytes it must not write stay so


@dataclass(frozen=True)
class Values:
    """The value each version of a key holds: 1 KiB to ``max_small`` bytes (from a hash of
    both), one in ``large_every`` 1.5 MiB (striped over two servers).  Its bytes are one
    block repeated: the version (4 bytes, little-endian) and a digest of the key and the
    version, so a read tells which version it got and any wrong or mixed byte is detectable."""

    max_small: int = 64 * 1024
    large_every: int = 50

    @staticmethod
    def _hash(key: bytes, version: int, size: int) -> bytes:
        return hashlib.blake2b(key + b"#%d" % version if version else key, digest_size=size).digest()

    def size(self, key: bytes, version: int = 0) -> int:
        h = int.from_bytes(self._hash(key, version, 8), "little")
        if self.large_every and h % self.large_every == 0:
            return 3 * MiB // 2
        return 1024 + h % max(self.max_small - 1024, 1)

    def of(self, key: bytes, version: int = 0) -> bytes:
        n = self.size(key, version)
        d = version.to_bytes(4, "little") + self._hash(key, version, _BLOCK - 4)
        return (d * (n // len(d) + 1))[:n]

    def largest(self, key: bytes, newest: int) -> int:
        """The largest size of versions 0 to ``newest``."""
        return max(self.size(key, v) for v in range(newest + 1))

    def check(self, key: bytes, value: bytes | bytearray | memoryview, oldest: int = 0,
              newest: int = 0) -> str:
        """"" when ``value`` is exactly one of the key's versions ``oldest`` to ``newest``;
        else what is wrong with it."""
        version = int.from_bytes(value[:4], "little")
        if oldest <= version <= newest and value == self.of(key, version):
            return ""
        whole = self.of(key, version)
        if len(value) >= 4 and value == whole:
            return f"version {version}, not {oldest} to {newest}"
        if len(value) >= 4 and whole.startswith(value):  # (a size of another version, say)
            return f"version {version} cut at {len(value)} of {len(whole)} bytes"
        return "wrong bytes"

    def check_slice(self, key: bytes, got: bytes | bytearray, start: int, end: int, newest: int) -> str:
        """"" when ``got`` is ``value[start:end]`` of one of the key's versions 0 to
        ``newest``; else what is wrong with it."""
        at = -start % _BLOCK  # where the slice's first whole block (its version field) begins
        if len(got) >= at + 4:
            version = int.from_bytes(got[at:at + 4], "little")
            if version <= newest and got == self.of(key, version)[start:end]:
                return ""
        elif any(got == self.of(key, v)[start:end] for v in range(newest + 1)):
            return ""
        return "wrong bytes (a slice)"


@dataclass
class Figures:
    """What one phase of the workload saw."""

    name: str
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    puts_ok: int = 0
    puts_failed: int = 0
    asked: int = 0  # values asked for (each key of a read, answered or not)
    reads: int = 0  # values read (each key of a read that returned)
    wrong: int = 0  # values whose bytes differ from what was put (or bytes written past them): must always be 0
    misses: int = 0  # committed keys read as missing
    read_errors: int = 0  # reads that raised
    longest_read_s: float = 0.0  # the longest single read: the stall a reader saw
    errors: Counter[str] = field(default_factory=Counter)
    by_api: Counter[str] = field(default_factory=Counter)  # values read, per READ_APIS entry
    overwritten: int = 0  # keys put again as their next version
    deleted: int = 0  # keys deleted (the delete returned)
    expiring: int = 0  # keys put with a TTL
    after_ttl: int = 0  # of the values read, those of keys whose TTL had surely ended (each must miss)
    kept_present: int = 0  # present keys a put with if_absent left as they were
    stored_absent: int = 0  # keys a put with if_absent found absent (unreadable) and stored
    left_old: int = 0  # get_into buffers holding part of an older version past the value (or on TOO_SMALL)
    files_written: int = 0  # keys written as files through the mount (new, or as a next version)
    leased: int = 0  # keys leased by exists_many or match_prefix (``lease_every``), read again during the lease
    evicted: int = 0  # misses of committed keys meta no longer had after (``evicting``: eviction's)
    rewritten: int = 0  # the writer's puts and deletes written again after a refused COMMIT (its counter)

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.name, "seconds": round(self.seconds, 2), "puts_ok": self.puts_ok,
                "puts_failed": self.puts_failed, "asked": self.asked, "reads": self.reads, "wrong": self.wrong,
                "misses": self.misses, "read_errors": self.read_errors,
                "longest_read_s": round(self.longest_read_s, 3), "errors": dict(self.errors),
                "by_api": dict(self.by_api), "overwritten": self.overwritten,
                "deleted": self.deleted, "expiring": self.expiring,
                "after_ttl": self.after_ttl, "kept_present": self.kept_present,
                "stored_absent": self.stored_absent, "left_old": self.left_old,
                "files_written": self.files_written, "leased": self.leased, "evicted": self.evicted,
                "rewritten": self.rewritten}


def _rewritten(client: AsyncClient) -> int:
    """The client's count of puts and deletes written again (``WritePath.rewritten``); 0 for a
    stand-in client without a write path (the harness's own tests)."""
    return int(getattr(getattr(client, "writer", None), "rewritten", 0))


class MixedWorkload:
    """``writers`` + ``readers`` coroutines until :meth:`stop`; ``writer`` and ``reader``
    may be one client or two (a reader with its own layout cache asks meta as a fresh
    process would).  ``blocking``: a ``kvfs.Client`` the readers also read through (its
    calls run in threads of their own, as an engine's would).  ``overwrite_every``: every
    that many puts of a writer, a batch of the keys this workload wrote gets each its next
    version (one writer at a time per key), which a read must see whole: one version, never
    a newer one than was put, nor a mix.  ``delete_every``: every that many puts, a batch
    of them is deleted (a read may then miss them; a fresh reader must, once the delete
    returned).  ``ttl_every``: every that many puts, the new keys are put with ``ttl_s``: a
    read must find them until then and miss them after (``EXPIRY_SLACK_S`` either side).
    ``if_absent_every``: every that many puts, a batch of present keys is put with
    ``if_absent=True`` (``Figures.stored_absent`` counts those it stored).  ``mount``: the
    directory of a kvfs mount of the same cluster, whose files the readers also read (another
    node's view: its kernel and its layouts may keep a file for ``mount_stale_s``, its
    attribute time, after a delete or an expiry; a found file is judged by the TTL that
    much later).  ``mount_write_every``: every that many puts of a writer, its new keys are
    written as files through the mount instead (a temporary file renamed over the name, as
    SGLang's ``HiCacheFile`` does), and so are about half the overwrites; a file counts as
    written once its rename and then an fsync of its directory returned.  ``files``:
    a blocking fsspec ``KVFileSystem`` whose ``open`` the readers read each key's file
    through too.  ``lease_every``: instead of about one read in that many, ``exists_many``
    or ``match_prefix`` takes a lease of ``lease_s`` on a batch of the oldest quarter of the
    committed keys (the ones eviction takes first, as an engine leases pages it found before
    it loads them), and a read ``lease_s / 2`` later reads them again.  ``evicting``: the cluster is full and GC
    evicts, so a committed key may miss (``Figures.evicted``), but not while a lease holds
    it, nor while meta still has it after the miss (eviction never brings a key back)."""

    def __init__(self, writer: AsyncClient, reader: AsyncClient, *, prefix: str = "w",
                 writers: int = 2, readers: int = 3, batch: int = 8,
                 values: Values = Values(), write_pause_s: float = 0.0,
                 max_keys: int = 100_000, blocking: Client | None = None,
                 overwrite_every: int = 0, delete_every: int = 0, ttl_every: int = 0,
                 ttl_s: float = 2.0, if_absent_every: int = 0, mount: Path | None = None,
                 mount_stale_s: float = 1.0, mount_write_every: int = 0,
                 files: AbstractFileSystem | None = None, lease_every: int = 0,
                 lease_s: float = 3.0, evicting: bool = False) -> None:
        self.writer, self.reader, self.blocking = writer, reader, blocking
        self._rewritten = _rewritten(writer)  # its count when this phase began
        self.mount, self.mount_stale_s, self.files = mount, mount_stale_s, files
        self.mount_write_every = mount_write_every if mount is not None else 0
        self.apis = tuple(a for a in READ_APIS if (blocking is not None or not a.startswith("sync"))
                          and (mount is not None or a != "mount")
                          and (files is not None or a != "fsspec open"))
        self.prefix = prefix
        self.nwriters, self.nreaders, self.batch = writers, readers, batch
        self.values = values
        self.write_pause_s = write_pause_s  # pacing between a writer's puts
        self.max_keys = max_keys
        self.committed: list[bytes] = []
        self.overwrite_every = overwrite_every
        self.own: list[bytes] = []  # the committed keys this workload wrote (the others: never overwritten)
        self.newest: dict[bytes, int] = {}  # key -> its newest version put, or being put (absent: 0)
        self.oldest: dict[bytes, int] = {}  # key -> its newest version a put returned for
        self._busy: set[bytes] = set()  # keys being overwritten, deleted or put with if_absent
        self.delete_every = delete_every
        self.deleting: set[bytes] = set()  # keys whose delete began: a miss is no miss for them
        self.deleted: set[bytes] = set()  # of them, those whose delete returned
        self.ttl_every, self.ttl_s = ttl_every, ttl_s
        self.if_absent_every = if_absent_every
        self.expiry: dict[bytes, tuple[float, float]] = {}  # key put with a TTL -> its expiry's bounds
        self.lease_every, self.lease_s, self.evicting = lease_every, lease_s, evicting
        self.leased: dict[bytes, float] = {}  # key -> until when (wall clock) a lease surely keeps it
        self._lease_reads: list[tuple[float, list[bytes]]] = []  # (when, keys leased): read them then
        # one writer's files at a time: a directory's fsync reports (and clears) a failed
        # write-behind commit under it once, to whichever writer asks first
        self._files_lock = asyncio.Lock()
        self.history: list[Figures] = []
        self.now = Figures("start")
        self._seq = 0
        self._stop = asyncio.Event()
        self._progress = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random(1)

    def versions(self) -> dict[bytes, tuple[int, int]]:
        """The overwritten keys' (oldest, newest) versions a fresh reader may see now
        (:func:`verify_all`)."""
        return {k: (self.oldest.get(k, 0), v) for k, v in self.newest.items()}

    def phase(self, name: str) -> Figures:
        """Close the current phase (returned) and start counting a new one."""
        done = self.now
        done.ended = time.monotonic()
        rewritten = _rewritten(self.writer)  # (the client's counter: this phase's part)
        done.rewritten, self._rewritten = rewritten - self._rewritten, rewritten
        self.history.append(done)
        self.now = Figures(name)
        return done

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write_loop(i)) for i in range(self.nwriters)]
        self._tasks += [loop.create_task(self._read_loop(i)) for i in range(self.nreaders)]

    async def stop(self) -> Figures:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.phase("stopped")

    async def wait_reads(self, n: int, timeout_s: float) -> None:
        """Until readers asked for ``n`` more values in this phase, answered or not (or the
        timeout: then the figures say how few)."""
        target = self.now.asked + n
        async with self._progress:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._progress.wait_for(lambda: self.now.asked >= target)
            except TimeoutError:
                pass

    async def wait_committed(self, n: int, timeout_s: float) -> None:
        """Until at least ``n`` keys are committed (or the timeout)."""
        async with self._progress:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._progress.wait_for(lambda: len(self.committed) >= n)
            except TimeoutError:
                pass

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    def _new_keys(self) -> list[bytes]:
        keys = []
        for _ in range(self.batch):
            self._seq += 1
            keys.append(f"{self.prefix}/{self._seq:08d}".encode())
        return keys

    async def _write_loop(self, i: int) -> None:
        n = 0
        while not self._stop.is_set() and len(self.committed) < self.max_keys:
            n += 1
            if len(self.own) > 4 * self.batch:
                if self.overwrite_every and n % self.overwrite_every == 0:
                    await self._put_again()
                    continue
                if self.delete_every and n % self.delete_every == 0:
                    await self._delete()
                    continue
                if self.if_absent_every and n % self.if_absent_every == 0:
                    await self._put_again(if_absent=True)
                    continue
            keys = self._new_keys()
            fig = self.now
            ttl = self.ttl_s if self.ttl_every and n % self.ttl_every == 0 else None
            if (ttl is None and self.mount_write_every and n % self.mount_write_every == 0
                    and len(self.own) > 4 * self.batch):  # (their directory is there by now)
                self._committed(await self._put_files(keys), None, 0.0, fig)
                continue
            t0 = time.time()  # meta's clock (time.time) makes the expiry during the put
            try:
                await self.writer.put_many([(k, self.values.of(k)) for k in keys], ttl=ttl)
            except KVFSError as exc:
                fig.puts_failed += 1
                fig.errors[f"put: {type(exc).__name__}"] += 1
                await asyncio.sleep(0.05)  # pacing after a failure, not a wait for a condition
                continue
            fig.puts_ok += 1
            self._committed(keys, ttl, t0, fig)
            await self._notify()
            await asyncio.sleep(self.write_pause_s)

    def _committed(self, keys: list[bytes], ttl: float | None, t0: float, fig: Figures) -> None:
        """New keys whose put returned (``ttl``: put with it, from wall clock ``t0``)."""
        self.committed.extend(keys)
        if ttl is None:
            self.own.extend(keys)  # only these are overwritten or deleted
        else:
            fig.expiring += len(keys)
            self.expiry.update(dict.fromkeys(keys, (t0 + ttl, time.time() + ttl)))

    async def _put_files(self, keys: list[bytes]) -> list[bytes]:
        """Each key's newest version written as its file through the mount (a temporary file
        renamed over it, its directory fsynced: :func:`_write_files`), in a thread: the keys whose
        rename and fsync returned.  A batch with a failure counts as a failed put (a failed
        close or fsync may still have committed)."""
        assert self.mount is not None
        fig = self.now
        items = [(self.mount / k.decode(), self.values.of(k, self.newest.get(k, 0))) for k in keys]
        async with self._files_lock:
            failed = await asyncio.to_thread(_write_files, items)
        for exc in failed:
            if exc is not None:
                fig.errors[f"mount write: {_error_name(exc)}"] += 1
        done = [k for k, exc in zip(keys, failed, strict=True) if exc is None]
        fig.files_written += len(done)
        if len(done) == len(keys):
            fig.puts_ok += 1
        else:
            fig.puts_failed += 1
        return done

    async def _put_again(self, *, if_absent: bool = False) -> None:
        """A batch of this workload's keys put again, each as its next version: an overwrite,
        or with ``if_absent``.  Then a key present (unexpired and readable) must keep its
        value; one with an extent whose every copy is on servers meta counts gone is absent
        for it, and stored (``stored_absent``: with a replica always up, it must stay 0)."""
        keys = list({k for k in self._rng.sample(self.own, self.batch) if k not in self._busy})
        self._busy.update(keys)
        for k in keys:  # a lease kept the version read, not the next one
            self.leased.pop(k, None)
        fig = self.now
        try:
            for k in keys:  # the version a read may see from now on
                self.newest[k] = self.newest.get(k, 0) + 1
            if not if_absent and self.mount_write_every and self._rng.randrange(2):
                done = await self._put_files(keys)  # (the others: their version may have landed)
                self.oldest.update((k, self.newest[k]) for k in done)
                fig.overwritten += len(done)
                return
            stored = await self.writer.put_many([(k, self.values.of(k, self.newest[k])) for k in keys],
                                                if_absent=if_absent)
        except KVFSError as exc:
            fig.puts_failed += not if_absent
            fig.errors[f"{'put if_absent' if if_absent else 'overwrite'}: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)  # pacing after a failure, not a wait for a condition
            return
        finally:
            self._busy.difference_update(keys)
        for k, new in zip(keys, stored, strict=True):
            if new:
                self.oldest[k] = self.newest[k]
            else:  # refused (if_absent): a read of that version from now on is a wrong one
                self.newest[k] -= 1
        if if_absent:
            fig.kept_present += len(keys) - sum(stored)
            fig.stored_absent += sum(stored)
        else:
            fig.puts_ok += 1
            fig.overwritten += len(keys)
        await asyncio.sleep(self.write_pause_s)

    async def _delete(self) -> None:
        """A batch of this workload's keys deleted (never written again)."""
        keys = {k for k in self._rng.sample(self.own, self.batch) if k not in self._busy}
        self.own = [k for k in self.own if k not in keys]
        self.deleting.update(keys)
        fig = self.now
        try:
            await self.writer.delete_many(keys)
        except KVFSError as exc:  # deleted or not: either answer is right from now on
            fig.errors[f"delete: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)  # pacing after a failure, not a wait for a condition
            return
        self.deleted.update(keys)
        fig.deleted += len(keys)
        await asyncio.sleep(self.write_pause_s)

    async def _read_loop(self, i: int) -> None:
        turn = i  # each reader starts at a different API, then takes each in turn
        while not self._stop.is_set():
            if not self.committed:
                await asyncio.sleep(0.01)
                continue
            fig = self.now
            if self.lease_every and self._rng.randrange(self.lease_every) == 0:
                await self._lease(fig)
                continue
            if self._lease_reads and self._lease_reads[0][0] <= time.time():
                keys = self._lease_reads.pop(0)[1]  # leased a while ago: each must be found
            else:
                keys = [self._rng.choice(self.committed) for _ in range(self.batch)]
            api = self.apis[turn % len(self.apis)]
            turn += 1
            before = self._settled(keys)  # to tell a key put again meanwhile
            t0, w0 = time.monotonic(), time.time()
            try:
                if api.endswith("get_many"):
                    got = await self._get_many(keys, sync=api != "get_many")
                elif api == "get_ranges":
                    got = await self._get_ranges(keys)
                elif api == "get":
                    got = await self._gets(keys)
                elif api in ("mount", "fsspec open"):
                    got = await self._file_reads(keys, api)
                else:
                    got = await self._get_into(keys, sync=api != "get_into")
            except (KVFSError, OSError) as exc:  # OSError: a file read through the mount or fsspec
                fig.asked += len(keys)
                fig.read_errors += 1
                fig.errors[f"{api}: {_error_name(exc)}"] += 1
                fig.longest_read_s = max(fig.longest_read_s, time.monotonic() - t0)
                await self._notify()
                await asyncio.sleep(0.05)
                continue
            w1 = time.time()
            fig.asked += len(keys)
            fig.longest_read_s = max(fig.longest_read_s, time.monotonic() - t0)
            fig.by_api[api] += len(keys)
            if self.expiry:
                stale_s = self.mount_stale_s if api == "mount" else 0.0
                got = self._expiring(keys, got, w0 - stale_s, w1, fig)
            await self._tally(api, keys, got, before, w1, fig)
            await self._notify()

    async def _tally(self, api: str, keys: list[bytes], got: list[str | None],
                     before: dict[bytes, int | None], w1: float, fig: Figures) -> None:
        """Count a read's outcomes (ended at wall clock ``w1``) in ``fig``: values read,
        wrong ones, and misses (``evicting``: those a lease held, or of keys meta still has
        after, :meth:`_evicted`)."""
        unsure = []  # misses eviction may explain
        for k, outcome in zip(keys, got, strict=True):
            fig.reads += 1
            if outcome is None:
                if self.evicting and self.leased.get(k, 0.0) < w1:
                    unsure.append(k)
                    continue
                fig.misses += 1
                fig.errors[f"{api}: miss{' while leased' if self.evicting else ''}"] += 1
            elif outcome:
                fig.wrong += 1
                fig.errors[f"{api}: {outcome}"] += 1
        if unsure:
            await self._evicted(unsure, before, api, fig)

    def _settled(self, keys: list[bytes]) -> dict[bytes, int | None]:
        """Each key's newest version, None while it is being put again."""
        return {k: None if k in self._busy else self.newest.get(k, 0) for k in keys}

    async def _lease(self, fig: Figures) -> None:
        """A batch of the oldest committed keys leased by ``exists_many`` or ``match_prefix``
        (its leading ones found): each found (not being put again, deleted or expiring) is
        kept from eviction until at least the call's start + ``lease_s`` (less
        ``EXPIRY_SLACK_S``), so a read that ends before then must find it; one such read is
        queued for ``lease_s / 2`` later."""
        old = self.committed[:max(1, len(self.committed) // 4)]
        keys = list({self._rng.choice(old) for _ in range(self.batch)} - self._busy)
        before = self._settled(keys)
        w0 = time.time()
        try:
            if self._rng.randrange(2):
                found = await self.reader.exists_many(keys, lease_s=self.lease_s)
            else:  # as SGLang's batch_exists: the leading keys present, leased
                n = await self.reader.match_prefix(keys, lease_s=self.lease_s)
                found = [i < n for i in range(len(keys))]
        except KVFSError as exc:
            fig.errors[f"lease: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)  # pacing after a failure, not a wait for a condition
            return
        until = w0 + self.lease_s - EXPIRY_SLACK_S
        held = [k for k, there in zip(keys, found, strict=True)
                if there and k not in self.deleting and k not in self.expiry and self._same(k, before)]
        for k in held:
            self.leased[k] = max(self.leased.get(k, 0.0), until)
        fig.leased += len(held)
        if held:
            self._lease_reads.append((w0 + self.lease_s / 2, held))

    def _same(self, key: bytes, before: dict[bytes, int | None]) -> bool:
        """Whether ``key`` was not put again (nor being put) since ``before`` (:meth:`_settled`)."""
        return before[key] is not None and key not in self._busy and self.newest.get(key, 0) == before[key]

    async def _evicted(self, keys: list[bytes], before: dict[bytes, int | None], api: str,
                       fig: Figures) -> None:
        """``keys`` read as misses, unleased (``evicting``): eviction's if meta does not have
        them now (eviction never brings a key back), else a miss of a key present throughout,
        unless it was put again meanwhile."""
        try:
            present = await self.reader.exists_many(keys)
        except KVFSError as exc:  # not known to be eviction's: misses
            fig.misses += len(keys)
            fig.errors[f"{api}: miss, not checked ({type(exc).__name__})"] += len(keys)
            return
        for k, there in zip(keys, present, strict=True):
            if not there:
                fig.evicted += 1
            elif self._same(k, before):
                fig.misses += 1
                fig.errors[f"{api}: miss of a present key"] += 1

    async def _get_many(self, keys: list[bytes], *, sync: bool) -> list[str | None]:
        """Each key's outcome: None (a miss of a key not being deleted), "" (one of its
        versions put so far, whole, or a deleted key's miss) or what was wrong.  Any version
        may come back: a reader's cached layout may name an older one."""
        if sync:
            assert self.blocking is not None
            got = await asyncio.to_thread(self.blocking.get_many, keys)
        else:
            got = await self.reader.get_many(keys)
        return [self._judge(k, v) for k, v in zip(keys, got, strict=True)]

    def _judge(self, key: bytes, value: bytes | bytearray | None,
               span: tuple[int, int] | None = None) -> str | None:
        """A read's outcome for ``key``: a miss's (:meth:`_miss`), "" for one of its versions
        put so far (whole, or that version's ``[start:end]`` for a ``span``), else what is
        wrong with it."""
        if value is None:
            return self._miss(key)
        newest = self.newest.get(key, 0)
        return (self.values.check(key, value, 0, newest) if span is None
                else self.values.check_slice(key, value, *span, newest))

    def _old_left(self, key: bytes, whole: bytes, start: int, newest: int) -> bool:
        """Whether every byte of ``whole`` from ``start`` on is as the buffer was or, at its
        own offset, a byte of one version put so far: what a read that found the key resized
        (its bytes gone, the new layout another size) may leave of the old version it began
        with.  Counted in ``Figures.left_old``."""
        tail = whole[start:]
        for v in range(newest + 1 if newest else 0):
            ref = self.values.of(key, v)
            for at in range(0, len(tail), 4096):
                seg, pos = tail[at:at + 4096], start + at
                if seg.count(_UNTOUCHED) == len(seg) or seg == ref[pos:pos + len(seg)]:
                    continue
                if not all(b == _UNTOUCHED or (pos + i < len(ref) and b == ref[pos + i])
                           for i, b in enumerate(seg)):
                    break
            else:
                self.now.left_old += 1
                return True
        return False

    async def _gets(self, keys: list[bytes]) -> list[str | None]:
        """As :meth:`_get_many`, by one ``get`` per key, all at once; a call that raised
        raises (the first one's error) once all have ended."""
        answers = await asyncio.gather(*(self.reader.get(k) for k in keys), return_exceptions=True)
        out = [None if isinstance(v, BaseException) else self._judge(k, v)
               for k, v in zip(keys, answers, strict=True)]
        return self._unless_raised("get", out, answers)

    def _unless_raised(self, api: str, out: list[str | None], answers: list[Any]) -> list[str | None]:
        """``out``, the outcomes of one read's keys, where no key's read raised; else the
        wrong values among those that answered counted, and the first error raised."""
        raised = [v for v in answers if isinstance(v, BaseException)]
        if raised:  # the keys that answered are checked all the same
            for outcome in out:
                if outcome:
                    self.now.wrong += 1
                    self.now.errors[f"{api}: {outcome}"] += 1
            raise raised[0]
        return out

    async def _file_reads(self, keys: list[bytes], api: str) -> list[str | None]:
        """As :meth:`_get_ranges`, each key's file (``api``: through the mount, or fsspec's
        ``open``), in a thread: read whole (open, read to its end, close), or a slice (a seek,
        then reads to its end: :func:`_read_on`); a missing file is a miss.  Any other error
        raises, once the files read are checked."""
        spans = [None if self._rng.randrange(2) else self._span(k) for k in keys]
        answers = await asyncio.to_thread(self._read_files, keys, spans, api)
        out = [None if isinstance(v, BaseException) else self._judge(k, v, span)
               for k, span, v in zip(keys, spans, answers, strict=True)]
        return self._unless_raised(api, out, answers)

    def _read_files(self, keys: list[bytes], spans: list[tuple[int, int] | None], api: str
                    ) -> list[bytes | OSError | None]:
        """Each key's file (or its slice): bytes, None (not found) or the error."""
        out: list[bytes | OSError | None] = []
        for k, span in zip(keys, spans, strict=True):
            try:
                with self._open(k, api) as f:
                    if span is None:
                        out.append(f.read())
                        continue
                    f.seek(span[0])
                    out.append(_read_on(f, span[1] - span[0]))
            except FileNotFoundError:
                out.append(None)
            except OSError as exc:
                out.append(exc)
        return out

    def _open(self, key: bytes, api: str) -> IO[bytes]:
        if api == "mount":
            assert self.mount is not None
            return open(self.mount / key.decode(), "rb", buffering=0)  # (read(): to its end)
        assert self.files is not None
        return cast(IO[bytes], self.files.open(key.decode(), "rb"))

    async def _get_ranges(self, keys: list[bytes]) -> list[str | None]:
        """As :meth:`_get_many`, of a slice of each value: in its first KiB (in every version),
        or anywhere in its newest version (a slice of an older one may be cut short)."""
        spans = [self._span(k) for k in keys]
        got = await self.reader.get_ranges([(k, a, b) for k, (a, b) in zip(keys, spans, strict=True)])
        return [self._judge(k, v, span) for k, span, v in zip(keys, spans, got, strict=True)]

    def _span(self, key: bytes) -> tuple[int, int]:
        """A slice to read of ``key``'s value: in its first KiB (in every version), or anywhere
        in its newest version."""
        rng = self._rng
        size = self.values.size(key, self.newest.get(key, 0)) if rng.randrange(2) else 1024
        a = rng.randrange(size - 1)
        return a, rng.randrange(a + 1, size + 1)

    def _expiring(self, keys: list[bytes], got: list[str | None], w0: float, w1: float,
                  fig: Figures) -> list[str | None]:
        """The outcomes of a read made from ``w0`` to ``w1`` (wall clock) with the keys put
        with a TTL judged by it: a miss is right once the key may have expired, a value
        (or TOO_SMALL: the key found) is wrong once it surely had."""
        out = list(got)
        for i, k in enumerate(keys):
            span = self.expiry.get(k)
            if span is None:
                continue
            ended = _ttl_ended(span, w0)
            fig.after_ttl += ended
            if out[i] is None and _ttl_may_have_ended(span, w1):
                out[i] = ""
            elif out[i] is not None and ended:
                out[i] = "found after its TTL ended"
        return out

    def expected(self) -> dict[str, Any]:
        """What a fresh reader must find: :func:`verify_all`'s keyword arguments."""
        return {"versions": self.versions(), "deleted": set(self.deleted),
                "maybe_deleted": self.deleting - self.deleted, "expiry": dict(self.expiry)}

    def _miss(self, key: bytes) -> str | None:
        """A miss's outcome: None (a miss) for a key that is there, "" for one being deleted."""
        return "" if key in self.deleting else None

    async def _get_into(self, keys: list[bytes], *, sync: bool) -> list[str | None]:
        """As :meth:`_get_many`, through ``get_into``: each key's buffer the size of its
        newest version, larger, one byte too small, or three pieces.  TOO_SMALL is right
        only where a version put so far is larger than the buffer, and with the buffer as it
        was; a hit, only with nothing written past the value, but for part of an older
        version at its own offsets (:meth:`_old_left`)."""
        rng = self._rng
        bufs: list[list[bytearray]] = []
        for k in keys:
            n = self.values.size(k, self.newest.get(k, 0))
            shape = rng.randrange(4)
            room = n - 1 if shape == 2 else n + rng.randrange(1, 4097) if shape == 1 else n
            cuts = sorted(rng.sample(range(1, room), 2)) if shape == 3 and room > 2 else []
            bounds = [0, *cuts, room]
            bufs.append([bytearray([_UNTOUCHED]) * (b - a) for a, b in itertools.pairwise(bounds)])
        dests: list[Any] = [b[0] if len(b) == 1 else b for b in bufs]
        if sync:
            assert self.blocking is not None
            got = await asyncio.to_thread(self.blocking.get_into, keys, dests)
        else:
            got = await self.reader.get_into(keys, dests)
        out: list[str | None] = []
        for k, pieces, n in zip(keys, bufs, got, strict=True):
            whole = b"".join(pieces)
            newest = self.newest.get(k, 0)
            untouched = whole.count(_UNTOUCHED) == len(whole)
            if n == MISS:
                out.append(self._miss(k))
            elif n == TOO_SMALL:
                left = untouched or self._old_left(k, whole, 0, newest)
                out.append("" if left and len(whole) < self.values.largest(k, newest)
                           else "TOO_SMALL for a buffer as large as every version"
                           if left else "TOO_SMALL with the buffer written")
            elif not 0 <= n <= len(whole):
                out.append(f"size {n} for a buffer of {len(whole)}")
            elif (whole[n:].count(_UNTOUCHED) != len(whole) - n
                  and not self._old_left(k, whole, n, newest)):
                out.append("bytes written past the value")
            else:
                out.append(self.values.check(k, whole[:n], 0, newest))
        return out


def _read_on(f: IO[bytes], n: int) -> bytes:
    """``n`` bytes from ``f``, read on after a short read, as a buffered reader does: up to
    its end, or what a later read raises.  (A mount's file is read unbuffered, one read(2)
    a call: where the kernel holds a file's first pages and a later page cannot be read,
    it returns the pages it has, a short read, and the error only to the next read.)"""
    parts = []
    while n > 0:
        got = f.read(n)
        if not got:
            break
        parts.append(got)
        n -= len(got)
    return b"".join(parts)


def _write_files(items: list[tuple[Path, bytes]]) -> list[OSError | None]:
    """Each file written as SGLang's ``HiCacheFile`` writes a page: whole under a temporary
    name, closed, then renamed over its name (a file truncated and written in place is seen
    partly written by other opens on the same mount, as on a local disk); then their
    directories fsynced, which returns once they are in the cluster (with ``kvfs mount
    --write-behind`` a close returns before): None where that returned, else the error."""
    out: list[OSError | None] = []
    for path, data in items:
        tmp = path.with_name(f"{path.name}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            out.append(None)
        except OSError as exc:
            out.append(exc)
    for parent in {path.parent for (path, _), exc in zip(items, out, strict=True) if exc is None}:
        try:
            fsync_dir(parent)
        except OSError as exc:  # a commit under it failed: which is not known
            out = [exc if e is None and p.parent == parent else e
                   for (p, _), e in zip(items, out, strict=True)]
    return out


def _error_name(exc: Exception) -> str:
    """A read error's name in ``Figures.errors``: its type, or an OSError's errno name."""
    if isinstance(exc, OSError) and not isinstance(exc, KVFSError) and exc.errno:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


def _ttl_ended(span: tuple[float, float], w0: float) -> bool:
    """Whether a key whose expiry lies in ``span`` (wall clock) had surely expired by ``w0``,
    a read's start."""
    return w0 > span[1] + EXPIRY_SLACK_S


def _ttl_may_have_ended(span: tuple[float, float], w1: float) -> bool:
    """Whether it may have expired by ``w1``, a read's end (its miss is then right)."""
    return w1 >= span[0] - EXPIRY_SLACK_S


async def verify_all(client: AsyncClient, keys: list[bytes], values: Values, *,
                     batch: int = 64, versions: Mapping[bytes, tuple[int, int]] | None = None,
                     deleted: Collection[bytes] = (), maybe_deleted: Collection[bytes] = (),
                     expiry: Mapping[bytes, tuple[float, float]] | None = None,
                     missed: list[bytes] | None = None) -> tuple[int, int, int]:
    """Read every key once: (misses, wrong values, keys whose read raised), the missed keys
    also appended to ``missed``.  ``versions``:
    key -> (the newest version a put returned for, the newest put at all), those a fresh
    reader may see (absent: 0 alone).  ``deleted``: keys that must be misses (a value read
    is a wrong one); ``maybe_deleted``: keys whose delete failed (a miss is right too).
    ``expiry``: keys put with a TTL -> their expiry's bounds (wall clock), judged at each
    read as the workload's readers do: a miss is right once the key may have expired, a
    value is wrong once it surely had."""
    misses = wrong = failed = 0
    span = versions or {}
    ttl = expiry or {}

    def tally(k: bytes, v: bytes | None, w0: float, w1: float) -> None:
        nonlocal misses, wrong
        ends = ttl.get(k)
        if k in deleted or (ends is not None and _ttl_ended(ends, w0)):
            wrong += v is not None
        elif v is None:
            if k not in maybe_deleted and (ends is None or not _ttl_may_have_ended(ends, w1)):
                misses += 1
                if missed is not None:
                    missed.append(k)
        else:
            wrong += bool(values.check(k, v, *span.get(k, (0, 0))))

    for i in range(0, len(keys), batch):
        part = keys[i:i + batch]
        w0 = time.time()
        try:
            got = await client.get_many(part)
        except KVFSError:
            for k in part:  # one by one: which keys cannot be read
                w0 = time.time()
                try:
                    v = await client.get(k)
                except KVFSError:
                    failed += 1
                    continue
                tally(k, v, w0, time.time())
            continue
        w1 = time.time()
        for k, v in zip(part, got, strict=True):
            tally(k, v, w0, w1)
    return misses, wrong, failed


async def under_replicated(client: AsyncClient, keys: list[bytes], replicas: int) -> int:
    """Keys with an extent held by fewer than ``replicas`` servers that meta reports alive
    (a missing key counts too)."""
    alive = {s.server_id for s in await client.servers(refresh=True) if s.alive}
    short = 0
    for i in range(0, len(keys), 256):
        layouts = await asyncio.gather(*(client.layout(k) for k in keys[i:i + 256]))
        for lay in layouts:
            if lay is None or any(sum(r.server_id in alive for r in e.replicas) < replicas
                                  for e in lay.extents):
                short += 1
    return short
