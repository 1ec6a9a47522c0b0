"""Chunk files: append-only, records packed back to back, each self-describing.

A record is ``header | key | value`` where the header is::

    magic b"KVR1" | key_len u16 | flags u16 | value_crc u32 | value_len u64
    | expires_at f64 (0 = never) | header_crc u32 (CRC-32C of header[:28] + key)

A layout's extent points at the *value* (offset past header and key), so a
read never touches record headers; a scan (recovery, fsck) needs no meta.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import crc32c

from kvfs.errors import ChecksumMismatch, InvalidArgument, NoSpace, StaleLayout
from kvfs.layout import MAX_KEY_BYTES, make_chunk_id

log = logging.getLogger("kvfs.chunkserver")

RECORD = struct.Struct("<4sHHIQdI")
REC_MAGIC = b"KVR1"
ALIGN = 4096
IOV_MAX = 512


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def record_header(key: bytes, length: int, crc: int, expires_at: float | None) -> bytes:
    head = RECORD.pack(REC_MAGIC, len(key), 0, crc, length, expires_at or 0.0, 0)
    hcrc = crc32c.crc32c(key, crc32c.crc32c(head[:-4]))
    return head[:-4] + struct.pack("<I", hcrc) + key


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    record_offset: int
    value_offset: int
    key: bytes
    length: int
    crc: int
    expires_at: float | None
    value_ok: bool


def scan_records(data: bytes | memoryview, *, verify: bool = True) -> Iterator[ScannedRecord]:
    """Records in a chunk's bytes, stopping at the first that is torn or corrupt."""
    pos, n = 0, len(data)
    while pos + RECORD.size <= n:
        magic, klen, _flags, crc, vlen, exp, hcrc = RECORD.unpack_from(data, pos)
        if magic != REC_MAGIC or klen > MAX_KEY_BYTES:
            return
        key_end = pos + RECORD.size + klen
        if key_end > n:
            return
        key = bytes(data[pos + RECORD.size : key_end])
        if crc32c.crc32c(key, crc32c.crc32c(bytes(data[pos : pos + RECORD.size - 4]))) != hcrc:
            return
        end = key_end + vlen
        if end > n:
            return
        ok = (crc32c.crc32c(data[key_end:end]) == crc) if verify else True
        yield ScannedRecord(pos, key_end, key, vlen, crc, exp or None, ok)
        pos = end


@dataclass(frozen=True, slots=True)
class Span:
    chunk_id: int
    start: int
    end: int
    members: tuple[int, ...]  # indices into the request's ranges


def plan_spans(ranges: Sequence[tuple[int, int, int]], merge_gap: int) -> list[Span]:
    """Sort ranges, widen to 4 KiB alignment, merge neighbours closer than ``merge_gap``.

    Every range lies inside exactly one span; spans of one chunk never overlap,
    so each byte is read at most once.
    """
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1]))
    spans: list[Span] = []
    members: list[int] = []
    cur_c, cur_s, cur_e = -1, 0, 0
    for i in order:
        c, off, ln = ranges[i]
        s, e = align_down(off), align_up(off + ln)
        if c == cur_c and s <= cur_e + merge_gap:
            cur_e = max(cur_e, e)
            members.append(i)
            continue
        if members:
            spans.append(Span(cur_c, cur_s, cur_e, tuple(members)))
        cur_c, cur_s, cur_e, members = c, s, e, [i]
    if members:
        spans.append(Span(cur_c, cur_s, cur_e, tuple(members)))
    return spans


def _pwritev_all(fd: int, bufs: list[bytes | memoryview], offset: int) -> None:
    i = 0
    while i < len(bufs):
        batch = bufs[i : i + IOV_MAX]
        want = sum(len(b) for b in batch)
        n = os.pwritev(fd, batch, offset)
        offset += n
        if n == want:
            i += len(batch)
            continue
        # short write: drop what was written and go on
        rest: list[bytes | memoryview] = []
        for b in batch:
            if n >= len(b):
                n -= len(b)
                continue
            rest.append(memoryview(b)[n:])
            n = 0
        bufs = rest + bufs[i + len(batch) :]
        i = 0


INLINE_READ_BYTES = 8 * 1024 * 1024
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def _read_spans(fds: dict[int, int], spans: Sequence[Span], needs: Sequence[int],
                nowait: bool = False) -> list[bytearray | None]:
    """Read each span once; ``needs[i]`` bytes of it must exist (the rest is alignment
    past the end of file).  With ``nowait`` (RWF_NOWAIT) a span that is not wholly in
    the page cache comes back as None instead of blocking, for the thread pool to read."""
    out: list[bytearray | None] = []
    for sp, need in zip(spans, needs, strict=True):
        buf = bytearray(sp.end - sp.start)
        got = 0
        with memoryview(buf) as view:
            try:
                while got < need:
                    n = (os.preadv(fds[sp.chunk_id], [view[got:]], sp.start + got, _NOWAIT) if nowait
                         else os.preadv(fds[sp.chunk_id], [view[got:]], sp.start + got))
                    if n == 0:
                        break
                    got += n
            except BlockingIOError:
                got = -1
        if got < need:
            if nowait:
                out.append(None)
                continue
            raise OSError(f"chunk {sp.chunk_id:016x} ended at {sp.start + got}, expected {sp.start + need}")
        del buf[need:]
        out.append(buf)
    return out


class ChunkStore:
    """The chunk files of one chunkserver data dir."""

    def __init__(self, root: Path, *, chunk_bytes: int, io_threads: int = 4, fsync: bool = False,
                 capacity_bytes: int | None = None, merge_gap_bytes: int = 64 * 1024) -> None:
        self.root = root
        self.dir = root / "chunks"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.chunk_bytes = chunk_bytes
        self.fsync = fsync
        self.capacity_bytes = capacity_bytes
        self.merge_gap = merge_gap_bytes
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvfs-io")
        self.sizes: dict[int, int] = {}
        self._fds: dict[int, int] = {}
        self._open: int | None = None
        self._lock = asyncio.Lock()
        self.server_id: int | None = None
        self.next_seq = 1
        self.spans_read = 0
        self.inline_spans = 0
        self.bytes_read = 0
        self._reads_in_flight = 0
        self._last_append = time.monotonic()
        self.wanted_bytes = 0  # the last append refused for space: GC evicts to make it fit
        self._close_later: list[int] = []
        self._load_state()
        self._scan_dir()

    # state ---------------------------------------------------------------
    def _load_state(self) -> None:
        try:
            st = json.loads((self.root / "state.json").read_text())
        except FileNotFoundError:
            return
        self.server_id = st.get("server_id")
        self.next_seq = int(st.get("next_seq", 1))

    def save_state(self) -> None:
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps({"server_id": self.server_id, "next_seq": self.next_seq}))
        os.replace(tmp, self.root / "state.json")

    def chunk_path(self, chunk_id: int) -> Path:
        return self.dir / f"{chunk_id:016x}.chunk"

    def _scan_dir(self) -> None:
        newest = None
        for p in self.dir.glob("*.chunk"):
            try:
                cid = int(p.stem, 16)
            except ValueError:
                continue
            self.sizes[cid] = p.stat().st_size
            self.next_seq = max(self.next_seq, (cid & ((1 << 40) - 1)) + 1)
            newest = cid if newest is None or cid > newest else newest
        if newest is not None:
            self._recover_tail(newest)

    def _recover_tail(self, chunk_id: int) -> None:
        """Truncate a torn or corrupt record at the end of the newest chunk."""
        path = self.chunk_path(chunk_id)
        data = path.read_bytes()
        good = 0
        for rec in scan_records(data):
            if not rec.value_ok:
                break
            good = rec.value_offset + rec.length
        if good < len(data):
            log.warning("chunk %016x: truncating torn tail at %d (file had %d bytes)", chunk_id, good, len(data))
            os.truncate(path, good)
            self.sizes[chunk_id] = good

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.pool.shutdown(wait=True)

    def _fd(self, chunk_id: int) -> int:
        fd = self._fds.get(chunk_id)
        if fd is None:
            fd = os.open(self.chunk_path(chunk_id), os.O_RDWR | os.O_CREAT, 0o644)
            self._fds[chunk_id] = fd
        return fd

    # capacity --------------------------------------------------------------
    def usage(self) -> tuple[int, int, int]:
        """(capacity, free, used) in bytes."""
        used = sum(self.sizes.values())
        disk = shutil.disk_usage(self.dir)
        capacity = self.capacity_bytes or disk.total
        free = max(0, min(capacity - used, disk.free))
        return capacity, free, used

    @property
    def open_chunk(self) -> int | None:
        """The chunk appends go to; every other chunk is sealed."""
        return self._open

    def _check_space(self, nbytes: int) -> None:
        capacity, free, used = self.usage()
        if nbytes > free:
            self.wanted_bytes = nbytes
            raise NoSpace(f"chunkserver {self.server_id} is full: {nbytes} bytes do not fit "
                          f"({used} of {capacity} used, {free} free); nothing left to evict or GC behind")

    # append ----------------------------------------------------------------
    def _new_chunk_id(self) -> int:
        assert self.server_id is not None, "chunkserver is not registered yet"
        cid = make_chunk_id(self.server_id, self.next_seq)
        self.next_seq += 1
        self.save_state()
        return cid

    def _roll(self) -> int:
        cid = self._new_chunk_id()
        self._fd(cid)
        self.sizes[cid] = 0
        self._open = cid
        return cid

    async def append(self, records: Sequence[Sequence[object]], payload: memoryview) -> list[tuple[int, int]]:
        """Write all records with one vectored write; return each value's (chunk_id, offset)."""
        bufs: list[bytes | memoryview] = []
        rel: list[int] = []
        pos = 0
        total = 0
        for rec in records:
            key, length, crc, expires_at = rec
            if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
                raise InvalidArgument("append record with a bad key")
            length, crc = int(length), int(crc)  # type: ignore[call-overload]
            if length < 0 or pos + length > payload.nbytes:
                raise InvalidArgument(f"append records describe more bytes than the {payload.nbytes} sent")
            value = payload[pos : pos + length]
            if crc32c.crc32c(value) != crc:
                raise ChecksumMismatch(f"value for key {key[:64]!r} arrived corrupted (CRC-32C mismatch)")
            head = record_header(key, length, crc, expires_at)  # type: ignore[arg-type]
            bufs.append(head)
            if length:
                bufs.append(value)
            rel.append(total + len(head))
            total += len(head) + length
            pos += length
        if pos != payload.nbytes:
            raise InvalidArgument(f"append sent {payload.nbytes} bytes but its records describe {pos}")
        loop = asyncio.get_running_loop()
        self._check_space(total)
        async with self._lock:
            cid = self._open
            if cid is None or (self.sizes[cid] and self.sizes[cid] + total > self.chunk_bytes):
                cid = self._roll()
            base = self.sizes[cid]
            fd = self._fd(cid)
            await loop.run_in_executor(self.pool, _pwritev_all, fd, bufs, base)
            if self.fsync:
                await loop.run_in_executor(self.pool, os.fsync, fd)
            self.sizes[cid] = base + total
            self._last_append = time.monotonic()
            self.wanted_bytes = 0
        return [(cid, base + r) for r in rel]

    async def seal(self, chunk_id: int, idle_s: float, *, apply: bool = True) -> bool:
        """Stop appending to ``chunk_id`` if it is open and saw no append for ``idle_s``.
        With ``apply=False`` only say whether it would (a GC dry run)."""
        async with self._lock:
            if self._open != chunk_id:
                return True
            if time.monotonic() - self._last_append < idle_s:
                return False
            if apply:
                self._open = None
            return True

    # read ------------------------------------------------------------------
    async def readv(self, ranges: Sequence[tuple[int, int, int]]) -> tuple[list[memoryview | None], dict[int, StaleLayout]]:
        """Read many ranges; each merged 4 KiB-aligned span is read once."""
        errors: dict[int, StaleLayout] = {}
        ok: list[tuple[int, int, int]] = []
        ok_idx: list[int] = []
        for i, (c, off, ln) in enumerate(ranges):
            size = self.sizes.get(c)
            if size is None:
                errors[i] = StaleLayout(f"chunk {c:016x} is not on this server")
            elif off < 0 or ln < 0 or off + ln > size:
                errors[i] = StaleLayout(f"chunk {c:016x} has no bytes at {off}+{ln} (size {size})")
            else:
                ok.append((c, off, ln))
                ok_idx.append(i)
        out: list[memoryview | None] = [None] * len(ranges)
        if not ok:
            return out, errors
        spans = plan_spans(ok, self.merge_gap)
        fds = {sp.chunk_id: self._fd(sp.chunk_id) for sp in spans}
        needs = [min(sp.end, self.sizes[sp.chunk_id]) - sp.start for sp in spans]
        self._reads_in_flight += 1
        try:
            # page-cache hits are read right here (no thread hop); the rest in the pool
            bufs: list[bytearray | None] = [None] * len(spans)
            if _NOWAIT and sum(needs) <= INLINE_READ_BYTES:
                bufs = _read_spans(fds, spans, needs, nowait=True)
                self.inline_spans += sum(b is not None for b in bufs)
            todo = [i for i, b in enumerate(bufs) if b is None]
            if todo:
                got = await asyncio.get_running_loop().run_in_executor(
                    self.pool, _read_spans, fds, [spans[i] for i in todo], [needs[i] for i in todo])
                for i, b in zip(todo, got, strict=True):
                    bufs[i] = b
        finally:
            self._reads_done()
        self.spans_read += len(spans)
        for sp, buf in zip(spans, bufs, strict=True):
            assert buf is not None
            self.bytes_read += len(buf)
            view = memoryview(buf)
            for j in sp.members:
                _, off, ln = ok[j]
                out[ok_idx[j]] = view[off - sp.start : off - sp.start + ln]
        return out, errors

    # garbage collection ----------------------------------------------------
    def _reads_done(self) -> None:
        self._reads_in_flight -= 1
        if not self._reads_in_flight and self._close_later:
            for fd in self._close_later:
                os.close(fd)
            self._close_later.clear()

    def mtimes(self) -> dict[int, float]:
        out = {}
        for cid in self.sizes:
            try:
                out[cid] = self.chunk_path(cid).stat().st_mtime
            except FileNotFoundError:
                continue
        return out

    async def compact(self, sources: Sequence[tuple[int, Sequence[tuple[int, int]]]]
                      ) -> tuple[int | None, int, list[list[int | None]]]:
        """Copy the records whose values start at the given (offset, length) of each source
        chunk into one new sealed chunk (fsynced before returning).

        Returns (new chunk id or None when nothing was copied, its size, per source the new
        value offset of each wanted range or None where the record is gone or corrupt).
        """
        loop = asyncio.get_running_loop()
        bufs: list[bytes | memoryview] = []
        locations: list[list[int | None]] = []
        total = 0
        for cid, wanted in sources:
            if cid == self._open:
                raise InvalidArgument(f"chunk {cid:016x} is open for appends; it cannot be compacted")
            if cid not in self.sizes:
                locations.append([None] * len(wanted))
                continue
            try:
                data = await loop.run_in_executor(self.pool, self.chunk_path(cid).read_bytes)
            except FileNotFoundError:
                locations.append([None] * len(wanted))
                continue
            recs = {r.value_offset: r for r in scan_records(data)}
            locs: list[int | None] = []
            for off, ln in wanted:
                rec = recs.get(off)
                if rec is None or rec.length != ln or not rec.value_ok:
                    locs.append(None)
                    continue
                head = record_header(rec.key, rec.length, rec.crc, rec.expires_at)
                bufs.append(head)
                if rec.length:
                    bufs.append(memoryview(data)[rec.value_offset : rec.value_offset + rec.length])
                locs.append(total + len(head))
                total += len(head) + rec.length
            locations.append(locs)
        if not bufs:
            return None, 0, locations
        self._check_space(total)
        new = self._new_chunk_id()
        path = self.chunk_path(new)
        tmp = path.with_suffix(".tmp")

        def write() -> None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _pwritev_all(fd, bufs, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)

        await loop.run_in_executor(self.pool, write)
        self.sizes[new] = total
        return new, total, locations

    def delete_chunks(self, chunk_ids: Sequence[int]) -> dict[int, int]:
        """Unlink sealed chunks; reads already running finish on their open fds."""
        deleted: dict[int, int] = {}
        for cid in chunk_ids:
            if cid == self._open:
                continue
            size = self.sizes.pop(cid, None)
            fd = self._fds.pop(cid, None)
            if fd is not None:
                if self._reads_in_flight:
                    self._close_later.append(fd)
                else:
                    os.close(fd)
            try:
                st = self.chunk_path(cid).stat()
                os.unlink(self.chunk_path(cid))
                deleted[cid] = st.st_size
            except FileNotFoundError:
                if size is not None:
                    deleted[cid] = size
        return deleted

    async def verify(self, ranges: Sequence[tuple[int, int, int, int]]) -> tuple[list[int], list[int]]:
        """(missing, bad): indices of ranges not on this server / failing their CRC-32C."""
        missing: list[int] = []
        bad: list[int] = []
        plain = []
        idx = []
        for i, (c, off, ln, _crc) in enumerate(ranges):
            size = self.sizes.get(c)
            if size is None or off < 0 or off + ln > size:
                missing.append(i)
            else:
                plain.append((c, off, ln))
                idx.append(i)
        if plain:
            views, _ = await self.readv(plain)
            for j, v in enumerate(views):
                i = idx[j]
                if v is None:
                    missing.append(i)
                elif crc32c.crc32c(v) != ranges[i][3]:
                    bad.append(i)
        return sorted(missing), bad
