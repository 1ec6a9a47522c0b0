"""The bytes of open files: writes buffered, then streamed; reads by stripe units.

Memory per open file is bounded whatever the file's size:

- **Writing.** A handle holds the file in memory up to ``write_buffer_bytes``; any
  write pattern works there, and a file that stays that small is committed as one
  ``put`` on close; its writes of at least ``TAIL_PIECE_BYTES`` in order (``tofile``,
  ``cp``) are kept as the kernel's buffers came, and that put sends them as they are.
  Past it, whole stripe units more than ``write_buffer_bytes`` behind the file's end go
  to a streaming put (:class:`kvfs.stream.StreamPut`) as they come, and close commits
  the stream.  A write (or read, or truncation) before what was streamed fails with
  ``EOPNOTSUPP``: write large files in order, as cp, dd, numpy ``tofile`` and
  ``torch.save`` do.
- **A commit in the middle** (``fsync``, or the close of one of several descriptors
  of the file, e.g. a forked child's) commits what was written so far, as on a
  small file.  Writing on after that streams the committed part again (read back
  from the cluster) ahead of the new bytes: correct, at the cost of a copy.  A handle
  whose small file is held (``--write-behind``) reads and writes on from that held
  version (``Handle.held``), never from a value another node committed meanwhile: the
  kernel's pages of the file, and the mtime it was told, are that version's.  (Its
  first write loads the value there is then, maybe another node's newer one than it
  read: the kernel drops the pages it read when it sees the handle's new mtime.)
- **Reading.** A read-only open soon after the kernel's LOOKUP (or this mount's commit
  of the file) pins the layout that lookup fetched, and keeps the kernel's cached pages of
  the file when they hold that very value: read from it, or written through them by the
  handle that committed it with no other open of the file here (``opened``, ``_wrote``; at
  most ``page_cache_files`` inodes remembered); otherwise the first read pins the value's
  layout (a lookup batched with other files' first reads).  With ``--write-behind`` the
  same holds once a held version's commit lands, for the pages of the handle whose close
  held it: remembered at that close (``_held_through``: at most one per held version) and
  made the value's at its commit (``_behind_committed``, with the layout the commit
  returned and the mtime the kernel was told, which a held file reports too), unless
  anything that drops the pages happened in between (an open of the file here, a write, a
  truncation, a rename or unlink, another commit of it: ``_unknown``); a version that
  fails, is superseded or dropped leaves nothing, and an older version's commit landing
  leaves a newer one's record as it is.  The kernel's pages are per inode: an open while
  another open of the file here reads another version through them gets ``direct_io``
  (``opened``); with ``--direct-first-open`` so does the first open here of each value
  (``_first_open``: the next open of that value reads through the pages).  Each read
  fetches the stripe units it overlaps, batched across files, and answers from them
  without a copy; a sequential reader gets ``read_ahead_units`` units
  fetched ahead.  An open file keeps at most ``read_ahead_units + 2`` units.
- **Closes share commits** as reads share batches: the small files closed while
  earlier commits are in flight go out together, one ``put_many``.  With
  ``--write-behind`` a close hands the file to :mod:`kvfs.mount.writebehind` instead
  and returns; reads, lookups and loads of a held file answer from its held bytes.
"""

from __future__ import annotations

import asyncio
import bisect
import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvfs._batch import Batcher
from kvfs._loop import retrieve
from kvfs.config import MountConfig
from kvfs.errors import StaleLayout
from kvfs.fs import KVFileSystem, path_info
from kvfs.layout import MAX_VALUE_BYTES, Layout
from kvfs.mount.inodes import Handle, Info, InodeTable
from kvfs.mount.writebehind import Held, WriteBehind
from kvfs.oserrors import builtin_errors
from kvfs.protocol import ReceivePool
from kvfs.stream import StreamPut, ValueReader, open_read, put_stream, read_units

__all__ = ["FileIO"]

log = logging.getLogger("kvfs.mount")

Unit = tuple[ValueReader, int, bytes | bytearray | memoryview] | None
Value = bytes | bytearray | list[bytes | bytearray]
UnitBytes = bytes | bytearray | memoryview  # a stripe unit's bytes (a pooled buffer's view)
# a write of at least this many bytes, in order, is kept as the kernel's buffer came (bytes
# written before it are not copied again either); smaller ones are copied into one buffer, so
# an open file keeps at most write_buffer_bytes / TAIL_PIECE_BYTES such buffers
TAIL_PIECE_BYTES = 64 * 1024
# a directory over --negative-listing-keys is not listed again for this long
OVER_CAP_RELIST_S = 60.0
# a lookup this close (in its directory's listing's order) to the last one there is a walk
# through the directory: the names after it are looked up ahead (FileIO._walked)
WALK_NEAR = 16


class _Walk:
    """A directory's names in order (its last listing, --negative-timeout) and how far
    lookups walked them: the names up to ``end`` (inclusive) were looked up ahead."""

    __slots__ = ("end", "last", "names")

    def __init__(self, names: list[str], end: str) -> None:
        self.names = names
        self.last = -WALK_NEAR - 1  # the index of the last name looked up
        self.end = end


class _Ahead:
    """A name's layout looked up ahead of the kernel's LOOKUP of it: the LOOKUP's answer
    (``task``'s, at ``index``), sent at ``at`` (loop time)."""

    __slots__ = ("at", "index", "task")

    def __init__(self, task: asyncio.Task[list[Layout | bool]], index: int, at: float) -> None:
        self.task = task
        self.index = index
        self.at = at


def _gone() -> OSError:
    """A value that went missing under an open file (as on a miss, whatever the read of it)."""
    return OSError(errno.ENOENT, "deleted, expired or lost (no replica can serve it) since it "
                   "was opened")


class FileIO:
    """Reads, writes, truncations and commits of the mount's open files."""

    def __init__(self, fs: KVFileSystem, table: InodeTable, config: MountConfig, *,
                 fresh_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 hold: Callable[[], bool] | None = None) -> None:
        self.fs = fs
        self.table = table
        self.config = config
        # the layouts the last lookups saw (reader, when): a first read within fresh_s of its
        # lookup (the kernel's own attribute cache time) reads them without looking up again
        self.fresh_s = fresh_s
        self._looked_up: dict[int, tuple[ValueReader, float]] = {}
        # --page-cache-files: per inode, the value (layout) whose bytes alone the kernel's
        # cached pages of it hold, as far as this mount knows (read from it since an open
        # dropped them, or written through them by a handle that committed it), and for a
        # value written here the mtime the kernel was told while it was written (reported
        # for that value from then on, so that the kernel keeps the pages: FUSE drops them
        # when a file's mtime changes); absent: not known (an open drops them)
        self._cached: OrderedDict[int, tuple[Layout, float | None]] = OrderedDict()
        # --write-behind: per inode, the held version a handle that wrote through the
        # kernel's pages of it alone (``sole``) closed, and the mtime the kernel was told:
        # its pages hold those bytes only.  Once that version is committed they are its
        # value's (``_cached``), unless anything that drops ``_cached`` happened meanwhile
        # (``_unknown`` drops this too).  At most one per held version: gone once it ends,
        # whatever its outcome (``_behind_ended``), so bounded by --write-behind-files
        self._held_pages: dict[int, tuple[Held, float]] = {}
        self._held_ino: dict[Held, int] = {}  # the inode of each version recorded there
        # --direct-first-open: per inode, the value (layout) its last direct_io open read, at
        # most page_cache_files of them: a value's first open here reads past the kernel's
        # pages, its next one through them (``opened``)
        self._read_direct: OrderedDict[int, Layout] = OrderedDict()

        self.stripe = fs.client.config.stripe_bytes
        # whole-MiB units are received into buffers kept from files closed (--unit-pool):
        # a fresh one costs zeroing and a page fault per 4 KiB (~5 % of a cold 2 MiB read)
        self._unit_pool = ReceivePool(config.unit_pool_bytes, min_bytes=ReceivePool.GRAIN)
        # FUSE requests reach the loop one at a time, so reads batch by load, not by tick;
        # with ``hold`` (the mount's: still reading queued requests) and --batch-hold, what
        # a burst of requests submits goes as one batch once none is left queued
        if config.batch_hold_s <= 0:
            hold = None
        self.reads: Batcher[tuple[ValueReader | bytes, int], Unit] = Batcher(
            self._read_units, max_items=config.max_batch_items,
            max_bytes=config.max_batch_bytes, max_inflight=config.batches_in_flight, hold=hold,
            hold_s=config.batch_hold_s)
        # closes of small files share commits the same way: one put_many (one APPEND per
        # server, one COMMIT) for the files closed while earlier batches were running
        self.puts: Batcher[tuple[bytes, Value], Layout | None] = Batcher(
            self._put_many, max_items=config.max_batch_items,
            max_bytes=config.max_batch_bytes, max_inflight=config.batches_in_flight)
        # lookups (the kernel's LOOKUP and GETATTR) share LOOKUPs the same way; a miss says
        # in the same round trip whether it is a directory
        self.lookups: Batcher[bytes, Layout | bool] = Batcher(
            fs.client.lookup_dirs, max_items=config.max_batch_items,
            max_bytes=config.max_batch_bytes, max_inflight=config.batches_in_flight, hold=hold,
            hold_s=config.batch_hold_s)
        self._tasks: set[asyncio.Task[Any]] = set()  # read-ahead and listings in flight
        # --negative-timeout: directories' listings (when sent, names; None: over
        # --negative-listing-keys), and those being listed (the names made here meanwhile)
        self.clock = clock
        self._listings: OrderedDict[str, tuple[float, set[str] | None]] = OrderedDict()
        self._listing: dict[str, set[str] | None] = {}
        # --negative-timeout: a walk through a listed directory (lookups of names near each
        # other in its order) looks the next --max-batch-items names up ahead, in one LOOKUP
        # (at most one in flight per directory); a name's layout from there answers its
        # LOOKUP within fresh_s of when it was asked for, unless the name was changed
        # through this mount since (a change, as it starts and as it lands, drops the
        # name's entry: _touch); at most looked_up_layouts of them, the oldest dropped
        self._walks: dict[str, _Walk] = {}
        self._walking: set[str] = set()  # directories with a look-ahead LOOKUP in flight
        self._ahead: OrderedDict[str, _Ahead] = OrderedDict()
        # --write-behind: closed files held here and committed in batches (off: never used)
        self.wb = WriteBehind(fs.client, config, ttl=fs.ttl, committed=self._behind_committed,
                              ended=self._behind_ended)

    def send_held(self) -> None:
        """The mount has read every FUSE request queued: the lookups and reads they
        submitted go out (``hold``)."""
        self.lookups.release()
        self.reads.release()

    def _behind_committed(self, e: Held) -> None:
        if e.pieces is None:  # a held delete (a written file's: made(), below)
            self._touch(e.path)
        ino = self.table.ino_of(e.path)
        if ino is not None:
            written = self._held_pages.get(ino)
            if written is not None and written[0] is e:  # nothing changed it since its close
                del self._held_pages[ino]
                if e.layout is not None:
                    self._wrote_value(ino, e.path, e.layout, written[1])
            else:  # a layout looked up meanwhile is stale (a newer version's record stays:
                # this commit changes neither the pages nor what that version commits)
                self._looked_up.pop(ino, None)
                self._cached.pop(ino, None)
        if e.pieces is not None:  # in a listing sent while it was held (meta's lacks it)
            self.made(e.path)

    def _held_through(self, h: Handle, e: Held) -> None:
        """``h``'s bytes are held as ``e``: if ``h`` wrote through the kernel's pages of its
        file with no other open of it here since it opened (``sole``, as :meth:`_wrote`
        asks), they hold ``e``'s bytes only, and are its value's once it is committed."""
        if h.sole and not h.orphan and self.config.page_cache_files:
            self._held_pages[h.ino] = (e, h.mtime)
            self._held_ino[e] = h.ino

    def _behind_ended(self, e: Held) -> None:
        """``e`` committed (recorded already), failed, superseded or dropped (the write-behind's
        ``ended`` hook, called as it ends)."""
        ino = self._held_ino.pop(e, None)
        if ino is not None:
            written = self._held_pages.get(ino)
            if written is not None and written[0] is e:
                del self._held_pages[ino]

    def held(self, path: str) -> Held | None:
        """``path``'s held version (write-behind); FileNotFoundError for a held delete."""
        e = self.wb.get(path)
        if e is not None and e.pieces is None:
            raise FileNotFoundError(errno.ENOENT, "renamed or removed on this mount", path)
        return e

    async def _put_many(self, items: list[tuple[bytes, Value]]) -> list[Layout | None]:
        last = dict(items)  # a path closed twice in one batch: its last value wins
        layouts = await self.fs.client.put_layouts(list(last.items()), ttl=self.fs.ttl)
        sent = {k: lay for k, lay in zip(last, layouts, strict=True)}
        # a close superseded in its batch committed nothing of its own
        return [sent[k] if last[k] is value else None for k, value in items]

    async def put(self, path: str, value: Value, nbytes: int | None = None) -> Layout | None:
        """One small file's value (a buffer, or a list of buffers to send one after another:
        ``nbytes`` in all), committed in a batch with other files' closes (``value`` is sent as
        it is: the caller does not change it until this returns).  Returns the layout it was
        committed with (None: superseded by a later close of the path in the same batch)."""
        with builtin_errors(path):
            async with self.wb.sending(path):
                layout = await self.puts.submit((os.fsencode(path), value),
                                                len(value) if nbytes is None else nbytes)
        self.made(path)  # in a listing sent before the commit, too
        return layout

    async def _read_units(self, wants: list[tuple[ValueReader | bytes, int]]) -> list[Unit]:
        return await read_units(self.fs.client, wants, self._unit_pool.take)

    # lookups --------------------------------------------------------------------
    async def info(self, ino: int, path: str) -> Info:
        """``path``'s info from one LOOKUP (shared with other requests'): a file's, a
        directory's, or FileNotFoundError; a file's layout is kept for a first read soon after."""
        if self._listed_missing(path):
            self._looked_up.pop(ino, None)
            raise FileNotFoundError(errno.ENOENT, "not in its directory's listing", path)
        key = os.fsencode(path)
        ahead = await self._looked_ahead(path)
        if ahead is None:
            with builtin_errors(path):
                found = await self.lookups.submit(key)
            at = None
        else:
            found, at = ahead
        self._walked(path)
        if not isinstance(found, Layout):
            self._looked_up.pop(ino, None)
            info = path_info(path, found)
        else:
            self._saw(ino, key, found, at)
            shown = self._pages_layout(ino) or found
            info = path_info(path, shown)
            cached = self._cached.get(ino)
            if cached is not None and cached[1] is not None and cached[0] == shown:
                info["created"] = info["mtime"] = cached[1]  # written here: as the kernel was told
        if at is not None:  # the kernel keeps it no longer than a lookup's answer now
            info["valid_s"] = max(0.0, self.fresh_s - (asyncio.get_running_loop().time() - at))
        return info

    def listed_missing(self, path: str) -> bool:
        """Whether ``path`` is missing as :meth:`info` would find it without asking meta: not
        held here (nor a directory of held files), and missing from its directory's listing."""
        return (self.wb.get(path) is None and self._listed_missing(path)
                and not self.wb.has_under(path + "/"))

    def _saw(self, ino: int, key: bytes, layout: Layout, at: float | None = None) -> None:
        """``ino``'s value is ``layout`` as of now, or of ``at`` (loop time) (a lookup found
        it, or this mount committed it): an open or first read within ``fresh_s`` of that
        reads it without looking up again."""
        if self.fresh_s > 0:
            self._looked_up.pop(ino, None)
            self._looked_up[ino] = (ValueReader(self.fs.client, key, layout),
                                    asyncio.get_running_loop().time() if at is None else at)
            if len(self._looked_up) > self.config.looked_up_layouts:
                del self._looked_up[next(iter(self._looked_up))]

    # lookups ahead of a walk through a listed directory (--negative-timeout) ----------------
    async def _looked_ahead(self, path: str) -> tuple[Layout | bool, float] | None:
        """``path``'s lookup answer from a look-ahead, and when it was sent; None where
        there is none still valid (the caller asks meta; a walk there looks ahead again from
        ``path`` on)."""
        e = self._ahead.get(path)
        if e is None:
            return None
        loop = asyncio.get_running_loop()
        found = None
        if loop.time() - e.at < self.fresh_s:  # (strictly: as _fresh)
            try:
                found = (await asyncio.shield(e.task))[e.index]
            except Exception:  # meta answers it now
                found = None
        if self._ahead.pop(path, None) is not e:
            return None  # changed through this mount meanwhile (_touch), or looked up again
        if found is not None and loop.time() - e.at < self.fresh_s:
            return found, e.at
        # too old, or failed: what was looked up after it is too (or may be)
        d, _, name = path.rpartition("/")
        w = self._walks.get(d)
        if w is not None and name < w.end:
            w.end = name
        return None

    def _walked(self, path: str) -> None:
        """``path`` was looked up: if its directory has a listing and the last lookup there
        was of a name near it in the listing's order, the names after it are looked up
        ahead, up to --max-batch-items past it (again once fewer than half that are left)."""
        if self.fresh_s <= 0:
            return
        d, _, name = path.rpartition("/")
        w = self._walks.get(d)
        if w is None:
            return
        names = w.names
        i = bisect.bisect_left(names, name)
        if i == len(names) or names[i] != name:
            return
        near = abs(i - w.last) <= WALK_NEAR
        w.last = i
        width = self.config.max_batch_items
        if not near or d in self._walking:
            return
        start = max(i + 1, bisect.bisect_right(names, w.end))
        if start - i > width // 2 or start >= len(names):
            return
        prefix = d + "/" if d else ""
        paths = [prefix + n for n in names[start : i + 1 + width]]
        w.end = names[min(i + width, len(names) - 1)]
        self._walking.add(d)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._look_ahead(d, [os.fsencode(p) for p in paths]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(retrieve)
        at = loop.time()
        for j, p in enumerate(paths):
            self._ahead.pop(p, None)
            self._ahead[p] = _Ahead(task, j, at)
        while len(self._ahead) > self.config.looked_up_layouts:
            self._ahead.popitem(last=False)

    def _touch(self, path: str) -> None:
        """This mount starts, or has landed, a change of ``path`` (made, changed, removed,
        renamed): a look-ahead sent before is not its answer (one being awaited included:
        :meth:`_looked_ahead` finds its entry gone)."""
        self._ahead.pop(path, None)

    async def _look_ahead(self, d: str, keys: list[bytes]) -> list[Layout | bool]:
        try:
            return await self.fs.client.lookup_dirs(keys)
        finally:
            self._walking.discard(d)

    # listings: misses without a LOOKUP (--negative-timeout) -------------------------------
    def _listed_missing(self, path: str) -> bool:
        """Whether ``path`` is missing from its directory's listing made at most
        ``negative_timeout_s`` ago.  A directory with no such listing is listed anew, in the
        background (one listing at a time per directory); meanwhile its lookups ask meta."""
        bound = self.config.negative_timeout_s
        if bound <= 0:
            return False
        d, _, name = path.rpartition("/")
        seen = self._listings.get(d)
        if seen is not None:
            at, names = seen
            age = self.clock() - at
            if names is not None and age <= bound:
                return name not in names
            if names is None and age <= max(bound, OVER_CAP_RELIST_S):
                return False
        if d not in self._listing:
            self._listing[d] = set()
            task = asyncio.get_running_loop().create_task(self._list(d))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return False

    async def _list(self, d: str) -> None:
        at = self.clock()  # names made by others after this may be missing from it
        cap = self.config.negative_listing_keys
        prefix = d + "/" if d else ""
        try:
            infos = await self.fs.client.list(os.fsencode(prefix), limit=cap + 1)
        except Exception as exc:  # no listing: lookups there go on asking meta
            log.info("listing %r for --negative-timeout: %s", prefix, exc)
            self._listing.pop(d, None)
            return
        if d not in self._listing:  # a directory was renamed meanwhile: maybe stale
            return
        made = self._listing.pop(d)
        names: set[str] | None = None
        if made is not None and len(infos) <= cap:
            n = len(prefix)
            names = {os.fsdecode(ki.key[n:]).partition("/")[0] for ki in infos} | made
            if len(names) > cap:
                names = None
        self._listings[d] = (at, names)
        self._listings.move_to_end(d)
        while len(self._listings) > self.config.negative_listing_dirs:
            self._walks.pop(self._listings.popitem(last=False)[0], None)
        if names is None:
            self._walks.pop(d, None)
        else:  # a walk there goes on from where it was
            old = self._walks.get(d)
            self._walks[d] = _Walk(sorted(names), "" if old is None else old.end)

    def made(self, path: str) -> None:
        """A name this mount made (create, mkdir, a rename's target, a held file's commit) is
        in its listing."""
        self._touch(path)
        if self.config.negative_timeout_s <= 0:
            return
        cap = self.config.negative_listing_keys
        d, _, name = path.rpartition("/")
        seen = self._listings.get(d)
        if seen is not None and seen[1] is not None:
            seen[1].add(name)
            if len(seen[1]) > cap:
                self._listings[d] = (seen[0], None)
        meanwhile = self._listing.get(d)
        if meanwhile is not None:
            meanwhile.add(name)
            if len(meanwhile) > cap:
                self._listing[d] = None

    def forget_listings(self) -> None:
        """Names moved in bulk (a directory renamed): no listing is trusted any more."""
        self._listings.clear()
        self._listing.clear()
        self._walks.clear()

    def changed(self, ino: int | None) -> None:
        """This mount changes or removed ``ino``'s value (called as the change starts, and
        again where it lands apart from a commit, which calls :meth:`made`): its looked-up
        layout is stale, and so is one looked up ahead before."""
        if ino is not None:
            if self._ahead:
                path = self.table.path_or_none(ino)
                if path is not None:
                    self._touch(path)
            self._looked_up.pop(ino, None)
            self._unknown(ino)

    def _unknown(self, ino: int) -> None:
        """What the kernel's pages of ``ino`` hold is not known (an open drops them)."""
        self._cached.pop(ino, None)
        self._held_pages.pop(ino, None)

    def writing(self, ino: int) -> bool:
        """``ino`` is being opened for writing here: the kernel's pages of it take what is
        written.  Returns whether no other open of it is here (the new handle is ``sole``)."""
        self._unknown(ino)
        return self._alone(ino)

    def _alone(self, ino: int) -> bool:
        """Another open of ``ino`` is being made here: whether there was none; the writers
        already open are ``sole`` no more (the kernel's pages may take other bytes now)."""
        others = self.table.handles_of(ino)
        for o in others:
            o.sole = False
        return not others

    def _wrote(self, h: Handle, path: str, layout: Layout | None) -> None:
        """``h``'s bytes were committed as ``path``'s value ``layout`` (as if looked up now:
        the kernel's entry for a file it created here was not looked up).  If ``h`` wrote
        through the kernel's pages of its file with no other open of it here since it opened
        (``sole``), they hold that value's bytes only, so a later open of that value keeps them
        (read back from them, nothing from the cluster), and the mtime the kernel was told
        while it wrote stays that value's here."""
        if layout is None or h.orphan:
            return
        if h.sole:
            self._wrote_value(h.ino, path, layout, h.mtime)
        else:
            self._saw(h.ino, os.fsencode(path), layout)

    def _wrote_value(self, ino: int, path: str, layout: Layout, mtime: float) -> None:
        """The kernel's pages of ``ino`` hold bytes of ``path``'s value ``layout`` only, just
        committed here (as if looked up now), and the kernel was told ``mtime``."""
        self._saw(ino, os.fsencode(path), layout)
        if self.config.page_cache_files:
            self._remember(ino, (layout, mtime))

    def _remember(self, ino: int, entry: tuple[Layout, float | None] | None) -> None:
        """``ino`` the most recent of the inodes whose pages' value is known (``entry``: that
        value now; None: as recorded), at most ``page_cache_files`` of them."""
        if entry is not None:
            self._cached[ino] = entry
        self._cached.move_to_end(ino)
        while len(self._cached) > self.config.page_cache_files:
            self._cached.popitem(last=False)

    def forget_layouts(self) -> None:
        self._ahead.clear()
        self._read_direct.clear()
        self._looked_up.clear()
        self._cached.clear()
        self._held_pages.clear()

    def _fresh(self, ino: int) -> ValueReader | None:
        """The reader of ``ino``'s layout looked up within ``fresh_s`` (not to be read with)."""
        seen = self._looked_up.get(ino)
        # (within: strictly, so a window of 0 s holds nothing in the tick it was seen, uvloop's
        # clock moving by the millisecond)
        if seen is None or asyncio.get_running_loop().time() - seen[1] >= self.fresh_s:
            return None
        return seen[0]

    def _recent(self, ino: int) -> ValueReader | None:
        seen = self._fresh(ino)
        return None if seen is None else ValueReader(self.fs.client, seen.key, seen.layout)

    def _key(self, h: Handle) -> bytes:
        return os.fsencode(self.table.path(h.ino))

    @staticmethod
    def _behind(h: Handle, what: str, off: int) -> OSError:
        return OSError(errno.EOPNOTSUPP, f"{what} at {off}: the bytes before {h.base} of this file "
                       "have gone to the cluster already (write large files in order)")

    # reading ---------------------------------------------------------------------
    def opened(self, h: Handle, *, looked: bool = False) -> bool | None:
        """A read-only open; whether the kernel may keep its cached pages of the file (and
        ``h.direct``: whether its reads must bypass them).  None, with nothing changed, where
        the open should look the file up first and then call again with ``looked``: no
        lookup within ``fresh_s`` says which value it is, and the kernel's pages of it may be
        kept (``--page-cache-files``) or the kernel was told a size of it, which the value
        must match (the kernel sends no LOOKUP while its entry for the file is valid: one
        made by a create here, one whose time ends just as ours does, or one of more files
        than ``--looked-up-layouts``).  Whether a lookup is recent is read once, here, and that one reading decides
        both (a check before the open and another as it pins could disagree, the lookup's time
        ending between them: the pages, and the mtime the kernel was told while the file was
        written here, dropped with nothing changed).

        With the layout the kernel's LOOKUP just fetched (within ``fresh_s``) the handle is
        pinned to it now.  The pages are kept when they were read from that same value (the
        layout this mount recorded at the last open that dropped them, unchanged since: a
        value replaced, even with the same bytes, or moved by the GC has another layout) and
        no other open of the file here reads another version or writes; otherwise the kernel
        drops them at this open, and only this value's bytes fill them from then on.  No such
        layout, or a version of the file held here (write-behind): dropped, and the first read
        pins the value as before.

        The kernel's pages are per file, not per handle: a handle reading through them while
        another reads another version would be answered the other's bytes.  So the handles
        that read through the pages (not ``direct``) all read one version: an open while such
        a handle is open reads through them only if pinned now to that handle's very layout;
        otherwise it is ``direct`` (``direct_io``: each read a READ, never the pages).  The
        common case, no other open of the file here, is never direct, unless
        ``--direct-first-open``: then a value's first open here (pages not kept) is direct and
        records nothing about the pages (they hold nothing of it), and its next open reads
        through them as above.  The kernel ends reads through the pages at the file's size in
        the last attributes it was sent (``InodeTable.tell``), so an open pinned to a value of
        another size (looked up here without the kernel, or while other opens read an older
        version: :meth:`_pages_layout`) is direct too (a held version's too), and one pinned
        only at its first read to a value of another size fails that read (ESTALE,
        :meth:`read`); an open with no recent lookup looks the file up first, unless it is
        held or written here."""
        ino = h.ino
        reader = self._recent(ino)
        others = self.table.handles_of(ino)
        held = self.wb.get(self.table.path(ino))
        mine = held is not None or any(o.writable for o in others)
        told = self.table.told_size(ino)
        if (reader is None and not looked and self.fresh_s > 0 and not mine
                and (ino in self._cached or told is not None)):
            return None
        self._alone(ino)
        cached = [o for o in others if not o.writable and not o.direct] if others else ()
        if reader is None or mine:
            self._unknown(ino)  # (a version held with pages written through: dropped too)
            # pinned only at its first read: maybe another version, or (held) another size
            h.direct = bool(cached) or (held is not None and held.pieces is not None
                                        and told not in (None, held.nbytes))
            return False
        layout = reader.layout
        if ((told is not None and told != layout.size)
                or any(o.reader is None or o.reader.layout != layout for o in cached)):
            self._unknown(ino)
            # pages of two versions would mix, or the kernel's size is another (its reads
            # through the pages would end there, or past the value's end on zeros)
            h.direct = True
            return False
        h.reader = reader
        h.pinned_at_open = True
        bound = self.config.page_cache_files
        seen = self._cached.get(ino)
        h.kept_cache = bound > 0 and seen is not None and seen[0] == layout
        if not h.kept_cache and self.config.direct_first_open and self._first_open(ino, layout):
            h.direct = True  # (the pages are not this value's: not recorded as such)
            return False
        if bound:
            self._remember(ino, None if h.kept_cache else (layout, None))
        return h.kept_cache

    def _pages_layout(self, ino: int) -> Layout | None:
        """The value the opens of ``ino`` here that read through the kernel's pages read (they
        all read one: :meth:`opened`), once one has pinned it; else None.  A lookup of the file
        answers its attributes while such an open lasts: the kernel cuts its pages at any
        other size it is told, and a smaller one would end their reads inside the old value."""
        for o in self.table.handles_of(ino):
            if not o.writable and not o.direct and o.reader is not None:
                return o.reader.layout
        return None

    def _first_open(self, ino: int, layout: Layout) -> bool:
        """--direct-first-open: whether this is the first open of ``ino``'s value ``layout`` here
        (its last direct open read another, or none is remembered); recorded as opened now."""
        d = self._read_direct
        if d.pop(ino, None) == layout:  # opened before: this open reads through the pages
            return False
        d[ino] = layout  # (one in per call: one out at most)
        if len(d) > self.config.page_cache_files:
            d.popitem(last=False)
        return True

    def _shares_pages(self, h: Handle) -> bool:
        """Whether ``h`` reads through the kernel's pages of its file while another open of it
        here does too (so ``h`` must keep to the version it was pinned to at open)."""
        return not h.direct and any(o is not h and not o.writable and not o.direct
                                    for o in self.table.handles_of(h.ino))

    async def read(self, h: Handle, off: int, size: int) -> bytes | memoryview:
        if h.writable and h.data is not None:
            self._check(h)
            self._merge(h)
            if off < h.base:
                raise self._behind(h, "read", off)
            return bytes(h.data[off - h.base : off - h.base + size])
        if h.pinned_at_open:
            async with h.lock:
                if h.pinned_at_open and h.reader is not None and off < h.reader.size:
                    if off == h.next_read:  # read in order: the units after it are asked for
                        self._read_ahead(h, off)  # with its own, in one batch
                    try:
                        await self._unit(h, off)
                    except StaleLayout:  # replaced since the lookup, its old bytes gone
                        self.changed(h.ino)
                        if h.kept_cache or self._shares_pages(h):  # the kernel's pages are
                            # (or will be) of the old value: never mix
                            raise OSError(errno.ESTALE, "replaced, and its old bytes reclaimed, "
                                          "since it was opened: open it again") from None
                        h.reader = None  # read what is there now
                        h.units.clear()
                h.pinned_at_open = False
        if h.reader is None:
            held = h.held or self.held(self.table.path(h.ino))
            if held is not None:  # closed here, not committed yet: its bytes are here
                h.held = held
                return held.read(off, size)
            async with h.lock:
                if h.reader is None:
                    path = self.table.path(h.ino)
                    key = os.fsencode(path)
                    which: ValueReader | bytes = self._recent(h.ino) or key
                    with builtin_errors(path):
                        try:
                            unit = await self.reads.submit((which, off), self.stripe)
                        except StaleLayout:  # replaced since a lookup: read what is there now
                            self.changed(h.ino)
                            unit = await self.reads.submit((key, off), self.stripe)
                    if unit is None:
                        raise _gone()
                    h.reader, start, data = unit
                    told = self.table.told_size(h.ino)
                    if (not h.direct and told is not None and told != h.reader.size
                            and not self.table.writers(h.ino)):
                        h.reader = None  # the kernel's size is another version's: its
                        self.changed(h.ino)  # reads through the pages would end there
                        raise OSError(errno.ESTALE, "changed since this mount's kernel was told "
                                      "its size: open it again")
                    self._keep(h, start, asyncio.get_running_loop().create_future()).set_result(data)
        reader = h.reader
        end = min(off + size, reader.size)
        parts = []
        pos = off
        while pos < end:
            start, data = await self._unit(h, pos)
            if not data:
                break
            parts.append(memoryview(data)[pos - start : end - start])  # not copied
            pos = start + len(data)
        if off == h.next_read:
            self._read_ahead(h, pos)
        h.next_read = end
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _keep(self, h: Handle, start: int, fut: asyncio.Future[UnitBytes]
              ) -> asyncio.Future[UnitBytes]:
        h.units[start] = fut
        while len(h.units) > self.config.read_ahead_units + 2:
            h.units.popitem(last=False)
        return fut

    def _fetch(self, h: Handle, pos: int) -> tuple[int, asyncio.Future[UnitBytes]]:
        """The unit holding ``pos``: cached, or being fetched from now on."""
        assert h.reader is not None
        start, e = h.reader.unit_at(pos)
        fut = h.units.get(start)
        if fut is not None:
            h.units.move_to_end(start)
            return start, fut
        nbytes = 0 if e is None else e.length
        task = asyncio.get_running_loop().create_task(self._fetch_unit(h.reader, pos, nbytes))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(retrieve)  # read ahead and never read: a failure is a miss
        return start, self._keep(h, start, task)

    async def _fetch_unit(self, reader: ValueReader, pos: int, nbytes: int) -> UnitBytes:
        unit = await self.reads.submit((reader, pos), nbytes)
        if unit is None:
            raise _gone()
        return unit[2]

    async def _unit(self, h: Handle, pos: int) -> tuple[int, UnitBytes]:
        start, fut = self._fetch(h, pos)
        try:
            return start, await asyncio.shield(fut)
        except Exception:
            if h.units.get(start) is fut:  # not cached: the next read tries again
                del h.units[start]
            raise

    def _read_ahead(self, h: Handle, pos: int) -> None:
        assert h.reader is not None
        for _ in range(self.config.read_ahead_units):
            start, e = h.reader.unit_at(pos)
            if e is None:
                return
            self._fetch(h, start)
            pos = start + e.length

    # writing ---------------------------------------------------------------------
    @staticmethod
    def _check(h: Handle) -> None:
        if h.failed is not None:
            raise OSError(errno.EIO, f"an earlier write or commit of this open file failed ({h.failed}); "
                          "what it wrote is lost")

    async def write(self, h: Handle, off: int, buf: bytes) -> None:
        if off + len(buf) > MAX_VALUE_BYTES:
            raise OSError(errno.EFBIG, f"kvfs values are limited to {MAX_VALUE_BYTES} bytes")
        if not h.lock.locked() and h.failed is None and self._append(h, off, buf):
            return  # (no lock needed: nothing else is under way on h, and this does not wait)
        async with h.lock:
            self._unknown(h.ino)  # the kernel's pages take bytes not committed yet
            self._check(h)
            await self._load(h)
            if self._append(h, off, buf):
                return
            d = h.data
            assert d is not None
            end = off + len(buf)
            self._merge(h)
            if off < h.base:
                raise self._behind(h, "write", off)
            await self._grow(h, off)
            d[off - h.base : end - h.base] = buf
            h.dirty = True
            await self._spill(h)

    def _append(self, h: Handle, off: int, buf: bytes) -> bool:
        """``buf`` kept as it came if it is a write in order of at least ``TAIL_PIECE_BYTES``
        that needs no spill (``h`` loaded, no failure); whether it was."""
        d = h.data
        if (d is None or off != h.base + len(d) + h.tail_bytes or len(buf) < TAIL_PIECE_BYTES
                or off + len(buf) - h.base > self.config.write_buffer_bytes):
            return False
        self._unknown(h.ino)  # the kernel's pages take bytes not committed yet
        h.tail.append(buf)
        h.tail_bytes += len(buf)
        h.dirty = True
        return True

    async def truncate(self, h: Handle, size: int) -> None:
        """``ftruncate`` of an open file."""
        async with h.lock:
            self._unknown(h.ino)
            if size == 0:  # a new, empty file: whatever was streamed is dropped
                await self._drop_stream(h)
                h.data, h.base, h.prefix, h.failed = bytearray(), 0, 0, None
                h.tail.clear()
                h.tail_bytes = 0
                h.dirty = True
                return
            self._check(h)
            await self._load(h)
            self._merge(h)
            assert h.data is not None
            if size < h.base:
                raise self._behind(h, "truncate", size)
            del h.data[size - h.base :]
            await self._grow(h, size)
            h.dirty = True
            await self._spill(h)

    async def _load(self, h: Handle) -> None:
        """A writable handle opened without O_TRUNC starts from the committed value (lock held):
        another open's unflushed bytes here, a version held here (or the one this handle held
        last, which it reads and its pages hold), or the cluster's value."""
        if h.data is not None:
            return
        for other in self.table.writers(h.ino):  # unflushed data of another open wins
            if other is not h and other.data is not None and not other.orphan:
                if other.base:
                    raise OSError(errno.EOPNOTSUPP, "another open of this file is streaming it")
                h.data = bytearray(other.data)
                for piece in other.tail:
                    h.data += piece
                return
        path = self.table.path(h.ino)
        # a version held here, or the one this handle held last (committed since, maybe
        # replaced by another node's: this handle reads that version, not the cluster's)
        held = self.held(path) or h.held
        if held is not None:
            h.data = bytearray(held.value())
            h.reader = h.held = None
            h.units.clear()
            return
        with builtin_errors(path):
            reader = await open_read(self.fs.client, os.fsencode(path))
            if reader is None:
                raise await self.fs._missing(path)
            if reader.size > self.config.write_buffer_bytes:
                raise OSError(errno.EOPNOTSUPP, f"changing a file over {self.config.write_buffer_bytes} "
                              "bytes in place is not supported: write it anew (O_TRUNC), as cp does")
            h.data = bytearray(await reader.read())
        h.reader = None
        h.units.clear()

    @staticmethod
    def _merge(h: Handle) -> None:
        """The buffers written in order after ``h.data`` copied into it: for what needs the
        bytes in one piece (a write elsewhere, a read, a truncation, a stream)."""
        if h.tail:
            assert h.data is not None
            for piece in h.tail:
                h.data += piece
            h.tail.clear()
            h.tail_bytes = 0

    async def _grow(self, h: Handle, size: int) -> None:
        """Zeros up to ``size`` (a hole), streamed as they pile up."""
        d = h.data
        assert d is not None
        while h.base + len(d) < size:
            d.extend(bytes(min(size - h.base - len(d), self.stripe)))
            await self._spill(h)

    async def _spill(self, h: Handle) -> None:
        """Hand whole stripe units more than ``write_buffer_bytes`` behind the end to the stream."""
        d = h.data
        assert d is not None
        n = (len(d) - self.config.write_buffer_bytes) // self.stripe * self.stripe
        if n <= 0:
            return
        with memoryview(d) as view:
            piece = bytes(view[:n])
        del d[:n]
        h.base += n
        if h.orphan:  # unlinked: nobody will see it
            return
        try:
            if h.stream is None:
                await self._start(h)
            assert h.stream is not None
            await h.stream.feed(piece)
        except BaseException as exc:
            await self._fail(h, exc)
            raise

    async def _start(self, h: Handle) -> None:
        """A stream for this file: first the part of it committed earlier, if any."""
        h.stream = StreamPut(self.fs.client, self._key(h), ttl=self.fs.ttl)
        if not h.prefix:
            return
        reader = await open_read(self.fs.client, self._key(h))
        if reader is None or reader.size != h.prefix:
            raise OSError(errno.ESTALE, "the part of this file committed earlier was replaced or "
                          "deleted meanwhile")
        async for piece in reader.chunks():
            await h.stream.feed(piece)

    async def _fail(self, h: Handle, exc: BaseException) -> None:
        h.failed = exc if isinstance(exc, Exception) else OSError(errno.EINTR, "interrupted")
        await self._drop_stream(h)

    @staticmethod
    async def _drop_stream(h: Handle) -> None:
        if h.stream is not None:
            stream, h.stream = h.stream, None
            await stream.abort()

    async def commit(self, h: Handle) -> None:
        """Make what was written the file's value (close, fsync, rename)."""
        if not h.dirty or h.orphan:
            return
        async with h.lock:
            if not h.dirty or h.orphan:
                return
            self._check(h)
            await self._load(h)
            d = h.data
            assert d is not None
            self.changed(h.ino)
            if h.stream is None and not h.prefix:  # small: one put, the stream never started
                # no copy: the buffers as written (h.lock keeps writes out until it returns)
                value: Value = d if not h.tail else h.tail[0] if not d and len(h.tail) == 1 \
                    else [d, *h.tail]
                path = self.table.path(h.ino)
                new, h.new = h.new, False
                held = await self.wb.hold(path, value, len(d) + h.tail_bytes,
                                          wanted=lambda: not h.orphan, new=new, created=h.mtime)
                if held is not False:
                    # the held value owns these buffers now: the handle reads on from it and
                    # writing on starts from a copy of it, whatever is committed meanwhile (the
                    # kernel's pages of the file hold its bytes, and keep its mtime)
                    h.data, h.tail, h.tail_bytes = None, [], 0
                    h.held = held if isinstance(held, Held) else None
                    h.dirty = False
                    if isinstance(held, Held):
                        self._held_through(h, held)
                    # (its name is in the listings from its create on, and lookups answer from
                    # the held version until its commit, which puts it in them again)
                    return
                layout = await self.put(path, value, len(d) + h.tail_bytes)
                h.dirty = False
                self._wrote(h, path, layout)
                return
            h.new = False
            self._merge(h)
            try:
                if h.stream is None:
                    await self._start(h)
                assert h.stream is not None
                if d:
                    await h.stream.feed(bytes(d))
                stream, h.stream = h.stream, None
                path = self.table.path(h.ino)
                with builtin_errors(path):
                    async with self.wb.sending(path):
                        size = await stream.finish()
                self.made(self.table.path(h.ino))
            except BaseException as exc:
                await self._fail(h, exc)
                raise
            h.data, h.base, h.prefix = bytearray(), size, size
            h.dirty = False

    async def release(self, h: Handle) -> None:
        """A handle closed: a stream still open (unlinked, failed) commits nothing."""
        if h.stream is not None:
            await self._drop_stream(h)

    def closed(self, h: Handle) -> None:
        """``h`` is closed (the kernel's RELEASE: no read of it runs or comes any more): the
        units it read go back to the pool, those no view of is alive anywhere (one being
        fetched ahead is left to finish and be dropped)."""
        units, h.units = h.units, OrderedDict()
        for fut in units.values():
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._unit_pool.give(fut.result())

    # whole values ------------------------------------------------------------------
    async def reader(self, path: str) -> ValueReader | None:
        """A reader of ``path``'s value, None if it has none (missing, or a directory)."""
        with builtin_errors(path):
            return await open_read(self.fs.client, os.fsencode(path))

    async def copy(self, reader: ValueReader, dst: str) -> None:
        """The value ``reader`` reads put under ``dst``, in bounded memory."""
        self.changed(self.table.ino_of(dst))
        await self._put_from(reader, dst, reader.size)

    async def resize(self, path: str, size: int) -> None:
        """``truncate(2)`` of a file nobody here has open: its first ``size`` bytes (zero
        padded) become its new value."""
        self.changed(self.table.ino_of(path))
        if size == 0:
            await self.wb.drop(path)
            await self.put(path, b"")
            return
        await self.wb.sync(path)
        reader = await self.reader(path)
        if reader is None:
            raise await self.fs._missing(path)
        await self._put_from(reader, path, size)

    async def _put_from(self, reader: ValueReader, dst: str, size: int) -> None:
        if size <= self.config.write_buffer_bytes:  # small: one put (rebuildable records)
            value = bytearray(await reader.read(0, size))
            value.extend(bytes(size - len(value)))
            await self.put(dst, bytes(value))
            return

        async def pieces() -> AsyncIterator[bytes]:
            left = size
            async for piece in reader.chunks():
                if left <= 0:
                    return
                yield piece[:left]
                left -= len(piece)
            while left > 0:
                yield bytes(min(left, self.stripe))
                left -= self.stripe

        with builtin_errors(dst):
            async with self.wb.sending(dst):
                await put_stream(self.fs.client, os.fsencode(dst), pieces(), size=size,
                                 ttl=self.fs.ttl)
        self.made(dst)
