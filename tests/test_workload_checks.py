"""The fault tests' and the soak's checker (kvfs.bench.workload) itself: a reader whose
``get_into`` misbehaves in each way the checker names is caught, and a right one passes, so a
broken read path cannot pass the soak or the netns faults unseen."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from kvfs.bench.workload import EXPIRY_SLACK_S, MixedWorkload, Values, verify_all
from kvfs.client import MISS, TOO_SMALL, AsyncClient
from kvfs.errors import Unavailable

VALUES = Values(max_small=8192, large_every=0)
KEYS = [f"k/{i:03d}".encode() for i in range(64)]


def _pieces(buf: Any) -> list[memoryview]:
    return [memoryview(b) for b in (buf if isinstance(buf, list) else [buf])]


def _scatter(value: bytes, buf: Any) -> None:
    at = 0
    for view in _pieces(buf):
        n = min(view.nbytes, len(value) - at)
        view[:n] = value[at:at + n]
        at += n


class Reader:
    """``get_into`` and ``get_many`` as the client's contract says, but for ``fault``,
    which is applied to each key's answer."""

    def __init__(self, fault: Callable[[bytes, Any, int], int] | None = None) -> None:
        self.fault = fault

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [VALUES.of(k) for k in keys]

    async def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        out = []
        for k, buf in zip(keys, buffers, strict=True):
            value = VALUES.of(k)
            room = sum(v.nbytes for v in _pieces(buf))
            if room < len(value):
                n = TOO_SMALL
            else:
                _scatter(value, buf)
                n = len(value)
            out.append(n if self.fault is None else self.fault(value, buf, n))
        return out


def _past_the_value(value: bytes, buf: Any, n: int) -> int:
    views = _pieces(buf)
    if n > 0 and sum(v.nbytes for v in views) > n:
        _scatter(value + b"\0", buf)
    return n


def _scribble_when_too_small(value: bytes, buf: Any, n: int) -> int:
    if n == TOO_SMALL:
        _pieces(buf)[0][0] = 0
    return n


def _short_size(value: bytes, buf: Any, n: int) -> int:
    return n - 1 if n > 0 else n


def _flip(value: bytes, buf: Any, n: int) -> int:
    if n > 0:
        first = _pieces(buf)[0]
        first[0] ^= 1
    return n


def _truncated_into_too_small(value: bytes, buf: Any, n: int) -> int:
    if n == TOO_SMALL:  # the buffer's bytes of the value, reported as a hit
        _scatter(value, buf)
        return sum(v.nbytes for v in _pieces(buf))
    return n


def _workload(reader: Reader) -> MixedWorkload:
    client = cast(AsyncClient, reader)
    return MixedWorkload(client, client, values=VALUES)


async def _outcomes(reader: Reader) -> list[str | None]:
    load = _workload(reader)
    return await load._get_into(KEYS, sync=False)


async def test_a_right_reader_passes_every_buffer_shape() -> None:
    assert await _outcomes(Reader()) == [""] * len(KEYS)
    load = _workload(Reader())
    assert await load._get_many(KEYS, sync=False) == [""] * len(KEYS)


def _too_small_for_all(value: bytes, buf: Any, n: int) -> int:
    return TOO_SMALL


@pytest.mark.parametrize(("fault", "named"), [
    (_past_the_value, "bytes written past the value"),
    (_scribble_when_too_small, "TOO_SMALL with the buffer written"),
    (_too_small_for_all, "TOO_SMALL"),  # ... for a buffer as large as every version / written
    # its last byte is past the size it gave (or, where that byte is 0xA5, the value is short)
    (_short_size, ("bytes written past the value", "version 0 cut at")),
    (_flip, "wrong bytes"),
    (_truncated_into_too_small, "version 0 cut at"),
])
async def test_each_wrong_answer_is_caught(fault: Callable[[bytes, Any, int], int],
                                          named: str | tuple[str, ...]) -> None:
    got = await _outcomes(Reader(fault))
    wrong = [o for o in got if o]
    assert wrong, got  # the 64 keys' random shapes include the one this fault needs
    assert all(o.startswith(named) for o in wrong), wrong
    assert None not in got


async def test_a_miss_is_a_miss_not_a_wrong_value() -> None:
    got = await _outcomes(Reader(lambda value, buf, n: MISS))
    assert got == [None] * len(KEYS)


class VersionReader(Reader):
    """``get_many`` answering each key with ``answer(key)``."""

    def __init__(self, answer: Callable[[bytes], bytes]) -> None:
        super().__init__()
        self.answer = answer

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.answer(k) for k in keys]


async def test_any_version_put_so_far_passes_a_newer_one_or_a_mix_does_not() -> None:
    load = _workload(VersionReader(lambda k: VALUES.of(k, 1)))
    assert set(await load._get_many(KEYS, sync=False)) == {"version 1, not 0 to 0"}
    load.newest.update({k: 2 for k in KEYS})  # versions 1 and 2 put: 1 is a right answer
    assert set(await load._get_many(KEYS, sync=False)) == {""}

    def mixed(k: bytes) -> bytes:
        old, new = VALUES.of(k, 1), VALUES.of(k, 2)
        return new[:64] + old[64:len(new)] if len(old) >= len(new) else new[:64] + old[64:] + new[len(old):]
    load = _workload(VersionReader(mixed))
    load.newest.update({k: 2 for k in KEYS})
    assert set(await load._get_many(KEYS, sync=False)) == {"wrong bytes"}


class RangeReader(Reader):
    """``get_ranges`` answering ``value[start + shift:end + shift]`` of ``version``."""

    def __init__(self, shift: int = 0, version: int = 0) -> None:
        super().__init__()
        self.shift, self.version = shift, version

    async def get_ranges(self, requests: Sequence[tuple[bytes, int, int]]) -> list[bytes | None]:
        return [VALUES.of(k, self.version)[a + self.shift:b + self.shift] for k, a, b in requests]


async def test_a_slice_is_checked_against_every_version_put() -> None:
    assert set(await _workload(RangeReader())._get_ranges(KEYS)) == {""}
    assert set(await _workload(RangeReader(shift=1))._get_ranges(KEYS)) == {"wrong bytes (a slice)"}
    load = _workload(RangeReader(version=1))
    assert "wrong bytes (a slice)" in await load._get_ranges(KEYS)  # version 1 was never put
    load.newest.update({k: 1 for k in KEYS})
    assert set(await load._get_ranges(KEYS)) == {""}


async def test_a_key_found_after_its_ttl_ended_is_caught_and_its_miss_is_not_one() -> None:
    load = _workload(Reader())
    now = time.time()
    load.expiry.update({k: (now - 10, now - 9) for k in KEYS[:8]})  # ended 9 s ago
    load.expiry.update({k: (now + 60, now + 61) for k in KEYS[8:16]})  # ends in a minute
    keys = KEYS[:16]
    got = load._expiring(keys, await load._get_many(keys, sync=False), now, now, load.now)
    assert got == ["found after its TTL ended"] * 8 + [""] * 8
    assert load.now.after_ttl == 8
    missing: list[str | None] = [None] * 16
    assert load._expiring(keys, missing, now, now, load.now) == [""] * 8 + [None] * 8  # early: a miss


class IfAbsentWriter(Reader):
    """``put_many(if_absent=True)`` answering ``stored`` for every key, storing nothing."""

    def __init__(self, stored: bool) -> None:
        super().__init__()
        self.stored = stored

    async def put_many(self, items: Sequence[tuple[bytes, bytes]], *, if_absent: bool = False,
                       ) -> list[bool]:
        assert if_absent
        return [self.stored] * len(items)


async def test_a_refused_if_absent_version_is_never_a_right_read() -> None:
    load = _workload(IfAbsentWriter(stored=False))
    load.own.extend(KEYS)
    await load._put_again(if_absent=True)
    assert load.now.kept_present > 0 and load.now.stored_absent == 0
    sampled = list(load.newest)
    assert sampled and all(load.newest[k] == 0 for k in sampled)  # refused: not counted as put
    load.reader = cast(AsyncClient, VersionReader(lambda k: VALUES.of(k, 1)))
    assert await load._get_many(sampled, sync=False) == ["version 1, not 0 to 0"] * len(sampled)

    load = _workload(IfAbsentWriter(stored=True))  # absent (unreadable): stored, version 1 now right
    load.own.extend(KEYS)
    await load._put_again(if_absent=True)
    assert load.now.stored_absent > 0
    stored = [k for k, v in load.newest.items() if v == 1]
    assert stored and load.versions()[stored[0]] == (1, 1)


async def test_verify_all_counts_a_deleted_or_expired_key_read_back_as_wrong() -> None:
    keys = KEYS[:6]
    now = time.time()
    expiry = {keys[2]: (now - 10, now - 9), keys[3]: (now - 1, now + 30), keys[4]: (now + 60, now + 61)}
    expect: dict[str, Any] = {"deleted": {keys[0]}, "maybe_deleted": {keys[1]}, "expiry": expiry}

    class Fresh(Reader):  # every key read back with its value
        async def get_many(self, ks: Sequence[bytes]) -> list[bytes | None]:
            return [VALUES.of(k) for k in ks]

    class Empty(Reader):  # every key a miss
        async def get_many(self, ks: Sequence[bytes]) -> list[bytes | None]:
            return [None] * len(ks)

    # keys[0] deleted and keys[2] expired for sure: wrong when read back
    assert await verify_all(cast(AsyncClient, Fresh()), keys, VALUES, **expect) == (0, 2, 0)
    # keys[4] (expires in a minute) and keys[5] must be there: 2 misses; the others may miss
    assert await verify_all(cast(AsyncClient, Empty()), keys, VALUES, **expect) == (2, 0, 0)


async def test_one_get_per_key_is_checked_each_and_a_raise_is_the_call_s() -> None:
    class Gets(Reader):
        async def get(self, k: bytes) -> bytes | None:
            if k == KEYS[3]:
                return VALUES.of(KEYS[4])  # another key's value: a mis-cut batch
            return None if k == KEYS[5] else VALUES.of(k)

    got = await _workload(Gets())._gets(KEYS[:8])
    assert got == ["", "", "", "wrong bytes", "", None, "", ""]

    class Raises(Reader):
        async def get(self, k: bytes) -> bytes | None:
            if k == KEYS[1]:
                raise Unavailable("down")
            return VALUES.of(k)

    with pytest.raises(Unavailable, match="down"):
        await _workload(Raises())._gets(KEYS[:8])

    class RaisesAndMiscuts(Raises):
        async def get(self, k: bytes) -> bytes | None:
            return VALUES.of(KEYS[0]) if k == KEYS[2] else await super().get(k)

    load = _workload(RaisesAndMiscuts())
    with pytest.raises(Unavailable):
        await load._gets(KEYS[:8])
    assert load.now.wrong == 1  # the calls that answered were checked before the raise


async def test_an_older_version_left_past_the_value_is_let_off_and_counted_nothing_else() -> None:
    """A resized key's buffer may hold part of the old version it began with, at its own
    offsets (past the new value, or on TOO_SMALL); any other byte there is wrong."""
    load = _workload(Reader())
    k = next(k for k in KEYS if VALUES.size(k, 0) > VALUES.size(k, 1) + 4096)  # shrunk
    old, new = VALUES.of(k, 0), VALUES.of(k, 1)
    room = max(len(old), len(new)) + 100
    buf = bytearray([0xA5]) * room
    buf[:len(old)] = old  # the first round: the old version landed
    buf[:len(new)] = new  # the re-read: the new one over its start
    load.newest[k] = 1
    assert bytes(buf[len(new):len(old)]) == old[len(new):]  # the old version's tail is there
    assert load._old_left(k, bytes(buf), len(new), 1)
    assert load.now.left_old == 1
    assert not load._old_left(k, bytes(buf), len(new), 0)  # a key put once: never let off
    bad = bytearray(buf)
    bad[-1] = 0  # one byte neither as the buffer was nor the old version's
    assert not load._old_left(k, bytes(bad), len(new), 1)
    other = bytearray([0xA5]) * room
    other[:len(VALUES.of(KEYS[1]))] = VALUES.of(KEYS[1])[:room]  # another key's bytes: not let off
    assert not load._old_left(k, bytes(other), 0, 1)


@pytest.mark.parametrize("api", ["mount", "fsspec open"])
async def test_a_file_read_through_a_mount_or_fsspec_is_checked_whole_or_as_a_slice(
        tmp_path: Path, api: str) -> None:
    """The readers' files through a mount, or a blocking fsspec filesystem's ``open`` (here a
    plain directory standing in for either): a right file passes whole and in slices, a
    missing one is a miss, a version cut short (the size of another version with this one's
    bytes) is caught by name, and a file that cannot be read raises once the others are
    checked."""
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    keys = KEYS[:16]
    for k in keys:
        (tmp_path / k.decode()).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / k.decode()).write_bytes(VALUES.of(k))
    where: dict[str, Any] = ({"mount": tmp_path} if api == "mount" else
                             {"files": DirFileSystem(str(tmp_path), LocalFileSystem())})
    load = MixedWorkload(cast(AsyncClient, Reader()), cast(AsyncClient, Reader()), values=VALUES,
                         **where)
    assert api in load.apis
    for _ in range(4):  # whole or a slice, at random
        assert set(await load._file_reads(keys, api)) == {""}
    (tmp_path / keys[0].decode()).unlink()
    cut = VALUES.of(keys[1])[:-1]
    (tmp_path / keys[1].decode()).write_bytes(cut)
    got: list[str | None] = []
    for _ in range(16):  # until keys[1] was read whole (not as a slice) once
        got = await load._file_reads(keys[:2], api)
        if got[1] != "":
            break
    assert got == [None, f"version 0 cut at {len(cut)} of {len(cut) + 1} bytes"]
    (tmp_path / keys[2].decode()).write_bytes(b"x" * 2048)  # no version's bytes
    (tmp_path / keys[3].decode()).unlink()
    (tmp_path / keys[3].decode()).mkdir()  # a file that cannot be read
    before = load.now.wrong
    with pytest.raises(IsADirectoryError):
        await load._file_reads(keys[2:4], api)
    assert load.now.wrong == before + 1  # keys[2], checked all the same
    assert _workload(Reader()).apis == ("get_many", "get_into", "get_ranges", "get")  # neither


async def test_files_written_through_a_mount_count_once_renamed_into_place(tmp_path: Path) -> None:
    """A writer's files through the mount (here a plain directory), each written under a
    temporary name and renamed over its own: each holds its key's newest version, no
    temporary file is left; one whose write fails is not counted written, and fails the
    batch."""
    (tmp_path / "k").mkdir()
    load = MixedWorkload(cast(AsyncClient, Reader()), cast(AsyncClient, Reader()), values=VALUES,
                         mount=tmp_path, mount_write_every=1)
    keys = KEYS[:4]
    load.newest[keys[1]] = 2
    assert await load._put_files(keys) == keys
    assert [(tmp_path / k.decode()).read_bytes() for k in keys] == [
        VALUES.of(keys[0]), VALUES.of(keys[1], 2), VALUES.of(keys[2]), VALUES.of(keys[3])]
    assert (load.now.files_written, load.now.puts_ok, load.now.puts_failed) == (4, 1, 0)
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [k.decode()[2:] for k in keys]
    lost = b"nowhere/k"  # its directory does not exist: the open fails
    assert await load._put_files([keys[0], lost]) == [keys[0]]
    assert (load.now.files_written, load.now.puts_ok, load.now.puts_failed) == (5, 1, 1)
    assert load.now.errors == {"mount write: ENOENT": 1}


class Meta(Reader):
    """``exists_many`` answering from ``present``, and taking no lease."""

    def __init__(self, present: set[bytes]) -> None:
        super().__init__()
        self.present = present

    async def exists_many(self, keys: Sequence[bytes], *, lease_s: float | None = None) -> list[bool]:
        return [k in self.present for k in keys]

    async def match_prefix(self, keys: Sequence[bytes], *, lease_s: float | None = None) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.present), len(keys))


async def test_on_a_full_cluster_a_miss_counts_as_evictions_only_if_meta_lost_the_key_and_no_lease_held_it(
        ) -> None:
    """``evicting``: a miss of a key meta no longer has is eviction's; one of a key meta still
    has (not put again meanwhile) is a miss, as is one a lease held until after the read."""
    meta = Meta(present=set(KEYS[4:8]))
    load = MixedWorkload(cast(AsyncClient, meta), cast(AsyncClient, meta), values=VALUES, evicting=True)
    now = time.time()
    keys = KEYS[:12]
    load.leased.update({k: now + 1 for k in KEYS[8:10]})  # held past the read's end
    load.leased.update({k: now - 1 for k in KEYS[10:12]})  # ended before it
    before = load._settled(keys)
    await load._tally("get_many", keys, [None] * 12, before, now, load.now)
    assert load.now.evicted == 4 + 2  # gone from meta, unleased (KEYS[:4], KEYS[10:12])
    assert load.now.misses == 4 + 2  # meta has them (KEYS[4:8]); leased (KEYS[8:10])
    assert load.now.errors == {"get_many: miss of a present key": 4, "get_many: miss while leased": 2}
    load.phase("put again")
    load._busy.add(KEYS[4])  # put again meanwhile: its miss may have come before the new version
    load.newest[KEYS[5]] = 1
    await load._tally("get_many", KEYS[4:8], [None] * 4, before, now, load.now)
    assert (load.now.misses, load.now.evicted) == (2, 0)  # KEYS[6:8] only


@pytest.mark.parametrize("call", [1, 0])  # exists_many, match_prefix
async def test_a_lease_is_counted_for_present_keys_and_read_again_halfway(
        monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """``_lease`` leases a batch of the oldest quarter of the committed keys: those found
    (by exists_many; or by match_prefix, its leading ones) that are not expiring are held
    until the call's start + ``lease_s`` less the slack, and queued for a read ``lease_s / 2``
    later."""
    meta = Meta(present=set(KEYS[:8]))
    load = MixedWorkload(cast(AsyncClient, meta), cast(AsyncClient, meta), values=VALUES,
                         evicting=True, lease_every=1, lease_s=4.0, batch=64)
    load.committed.extend(KEYS[:32])  # the oldest quarter: KEYS[:8]
    load.expiry[KEYS[0]] = (0.0, 1e12)  # expiring: never held
    monkeypatch.setattr(load._rng, "randrange", lambda n: call)
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    picked = iter(list(KEYS[:8]) * 8)
    monkeypatch.setattr(load._rng, "choice", lambda seq: next(picked))
    await load._lease(load.now)
    assert set(load.leased) == set(KEYS[1:8])
    assert set(load.leased.values()) == {1000.0 + 4.0 - EXPIRY_SLACK_S}
    assert load.now.leased == 7
    assert [(when, sorted(ks)) for when, ks in load._lease_reads] == [(1002.0, sorted(KEYS[1:8]))]


def test_a_slice_read_short_is_read_on_and_a_later_error_is_the_reads() -> None:
    """A mount's file is read unbuffered: the kernel may answer a read(2) short, with the
    pages it holds, and the error only to the next read (a page it could not read).  The
    reader reads on, as a buffered reader does: the slice whole, or that error."""
    from kvfs.bench.workload import _read_on

    class Short(io.RawIOBase):
        def __init__(self, data: bytes, fail_at: int | None = None) -> None:
            self.data, self.pos, self.fail_at = data, 0, fail_at

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            if self.fail_at is not None and self.pos >= self.fail_at:
                raise FileNotFoundError(2, "lost since it was opened")
            end = min(self.pos + n, self.pos + 3, len(self.data))  # 3 bytes a call at most
            got, self.pos = self.data[self.pos:end], end
            return got

    assert _read_on(Short(b"abcdefghij"), 8) == b"abcdefgh"
    assert _read_on(Short(b"abcdefghij"), 20) == b"abcdefghij"  # up to its end
    with pytest.raises(FileNotFoundError):
        _read_on(Short(b"abcdefghij", fail_at=6), 8)
