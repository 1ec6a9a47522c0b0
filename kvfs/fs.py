"""``kvfs://`` for fsspec: a kvfs cluster seen as a filesystem.

``fsspec.filesystem("kvfs", addr="kvfs://127.0.0.1:7070")``, or a URL that
names the cluster: ``fsspec.open("kvfs://127.0.0.1:7070/model/page-0001.bin")``
(registered through the ``fsspec.specs`` entry point; the token comes from
``token=``, ``$KVFS_TOKEN`` or the file ``kvfs up`` wrote).

Semantics, where a key-value store differs from a disk:

- **A file is a key.**  A path is the key, without a leading slash
  (``a/b/c.bin``).  Paths holding ``..`` or NUL, and paths over the 1 KiB key
  limit, are refused with :class:`InvalidPathError` (a ``ValueError``).
- **Directories are key prefixes** split on ``/``.  A directory exists while
  a key lies under it.  ``mkdir``/``makedirs`` also record an empty-valued
  *marker key* ending in ``/`` (``a/b/``) for every level, so an empty
  directory exists (and ``ls`` shows it) until ``rmdir``/``rm`` removes its
  marker.  Raw ``kvfs ls`` shows these markers.  A directory made only by
  writing a file under it vanishes with its last file.
- **Values are immutable; a write is one value.**  A file opened for writing
  is buffered in memory and committed as one value (striped as usual) on
  ``close()``; until then nobody sees it.  Appending to an existing file
  raises ``OSError(EOPNOTSUPP)``.  ``pipe_file(mode="create")`` and
  ``open(..., "xb")`` raise ``FileExistsError`` on an existing path (checked,
  then written: not atomic against a concurrent writer).
- **Reads are batched.**  ``cat``/``cat_ranges`` send all their keys in one
  ``get_many``; single-key reads go through the client's batcher, so
  concurrent ``cat_file``/``get``/``open().read()`` share lookups and readvs.
  Concurrent single-key writes (``pipe_file``, ``put``, ``cp``) are coalesced
  here into one ``put_many``.  A ranged read currently fetches the whole value
  and slices it (the client has no ranged get yet); a file opened ``"rb"``
  fetches its value on the first read and serves later reads from that
  snapshot.
- **Expiry**: a key whose TTL passed is gone.  ``info()`` reports ``size``,
  ``created``, ``expires_at`` (None: never) and ``extents``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import weakref
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from fsspec.asyn import AbstractAsyncStreamedFile, AsyncFileSystem, sync
from fsspec.callbacks import DEFAULT_CALLBACK, Callback
from fsspec.spec import AbstractBufferedFile
from fsspec.utils import stringify_path

from kvfs._batch import Batcher
from kvfs.address import format_addrs, is_addr, lookup_token, parse_addrs
from kvfs.client import AsyncClient, KeyInfo
from kvfs.config import ClientConfig
from kvfs.layout import MAX_KEY_BYTES, MAX_VALUE_BYTES, Layout
from kvfs.oserrors import builtin_errors

__all__ = ["InvalidPathError", "KVFile", "KVFileSystem"]

Info = dict[str, Any]

DELETE_BATCH = 10_000


class InvalidPathError(ValueError):
    """A path that cannot be a kvfs key (``..``, NUL, longer than the key limit)."""

    def __init__(self, path: str, why: str, err: int = errno.EINVAL) -> None:
        super().__init__(f"kvfs: invalid path {path[:80]!r}{'...' if len(path) > 80 else ''}: {why}")
        self.path = path
        self.errno = err


def _kb(path: str) -> bytes:
    return path.encode("utf-8", "surrogateescape")


def _ks(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def _file_info(name: str, size: int, created: float, expires_at: float | None, extents: int) -> Info:
    return {"name": name, "size": size, "type": "file", "created": created, "mtime": created,
            "expires_at": expires_at, "extents": extents}


def _dir_info(name: str) -> Info:
    return {"name": name, "size": 0, "type": "directory"}


def layout_info(name: str, lay: Layout) -> Info:
    """The info of file ``name`` whose value has layout ``lay``."""
    return _file_info(name, lay.size, lay.created, lay.expires_at, len(lay.extents))


def path_info(name: str, found: Layout | bool) -> Info:
    """The info of ``name`` from :meth:`AsyncClient.lookup_dirs`'s answer for it (a file's
    layout, True for a directory); FileNotFoundError for nothing."""
    if isinstance(found, Layout):
        return layout_info(name, found)
    if found:
        return _dir_info(name)
    raise FileNotFoundError(errno.ENOENT, "no such kvfs file or directory", name)


def _info_of(name: str, ki: KeyInfo) -> Info:
    return _file_info(name, ki.size, ki.created, ki.expires_at, ki.extents)


class _Session:
    """The client and the write batchers of one event loop (a client lives on one loop)."""

    def __init__(self, client: AsyncClient, owned: bool, max_keys: int, max_bytes: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.client = client
        self.owned = owned
        self._max_keys = max_keys
        self._max_bytes = max_bytes
        # concurrent single-value puts share one put_many (one append per server, one commit)
        self._puts: dict[float | None, Batcher[tuple[bytes, Any], None]] = {}

    async def put(self, key: bytes, value: Any, ttl: float | None) -> None:
        b = self._puts.get(ttl)
        if b is None:
            async def put_many(items: list[tuple[bytes, Any]], ttl: float | None = ttl) -> list[None]:
                await self.client.put_many(items, ttl=ttl)
                return [None] * len(items)

            b = self._puts[ttl] = Batcher(put_many, max_items=self._max_keys,
                                          max_bytes=self._max_bytes)
        await b.submit((key, value), memoryview(value).nbytes)


class KVFileSystem(AsyncFileSystem):
    """fsspec filesystem over a kvfs cluster; see the module docstring for semantics.

    Parameters: ``addr`` (``kvfs://host:port``, default ``$KVFS_ADDR``),
    ``token`` (default ``$KVFS_TOKEN`` or the token file), ``config`` (the
    client's :class:`~kvfs.config.ClientConfig`), ``ttl`` (seconds; default
    expiry for everything written through this filesystem), ``client`` (an
    existing :class:`~kvfs.client.AsyncClient` to use, only with
    ``asynchronous=True`` on that client's loop), ``batch_max_keys`` /
    ``batch_max_bytes`` (bounds of a coalesced write), ``tls_cert`` /
    ``tls_key`` / ``tls_ca`` (TLS files, as the ``--tls-*`` flags; default
    the config's, else ``$KVFS_TLS_*``).

    Without ``config`` the client keeps no layout cache, so every read looks
    its keys up in meta (one lookup per batch) and sees overwrites by other
    clients at once.  For write-once data (KV pages) pass a ``ClientConfig``
    with a layout cache to skip that lookup.
    """

    protocol: ClassVar[str] = "kvfs"
    root_marker: ClassVar[str] = ""
    async_impl = True
    cachable = True

    def __init__(self, addr: str | None = None, *, token: str | None = None,
                 config: ClientConfig | None = None, ttl: float | None = None,
                 client: AsyncClient | None = None, batch_max_keys: int = 256,
                 batch_max_bytes: int = 64 * 1024 * 1024, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_ca: str | None = None,
                 asynchronous: bool = False, loop: asyncio.AbstractEventLoop | None = None,
                 **storage_options: Any) -> None:
        super().__init__(asynchronous=asynchronous, loop=loop, **storage_options)
        if client is not None:
            self.addr, self.token = client.addr, client.token
        else:
            self.addr = format_addrs(parse_addrs(addr))
            self.token = lookup_token(token, addr=self.addr)
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be positive seconds or None, got {ttl}")
        self.ttl = ttl
        # No layout cache by default: a path may be overwritten by another client, and a cached
        # (immutable) layout would keep serving the old bytes until they are reclaimed.
        self.config = config or ClientConfig(layout_cache_entries=0)
        tls: dict[str, Any] = {k: Path(v) for k, v in (("tls_cert", tls_cert), ("tls_key", tls_key),
                                                       ("tls_ca", tls_ca)) if v is not None}
        if tls:  # storage options override the config's TLS files
            self.config = dataclasses.replace(self.config, **tls)
        self._client = client
        self._batch_max_keys = batch_max_keys
        self._batch_max_bytes = batch_max_bytes
        self._sessions: dict[int, _Session] = {}
        # connections live on the fsspec IO loop; close them when this object goes away
        self._finalizer = weakref.finalize(self, _close_sessions, self._sessions)
        self._finalizer.atexit = False

    # sessions ----------------------------------------------------------------
    def _session(self) -> _Session:
        loop = asyncio.get_running_loop()
        s = self._sessions.get(id(loop))
        if s is not None and s.loop is loop:
            return s
        for k, old in list(self._sessions.items()):
            if old.loop.is_closed():
                del self._sessions[k]
        if self._client is not None:
            s = _Session(self._client, False, self._batch_max_keys, self._batch_max_bytes)
        else:
            c = AsyncClient(self.addr, token=self.token, config=self.config)
            s = _Session(c, True, self._batch_max_keys, self._batch_max_bytes)
        self._sessions[id(loop)] = s
        return s

    @property
    def client(self) -> AsyncClient:
        """The client of the running loop (for async callers)."""
        return self._session().client

    async def _close(self) -> None:
        """Close the connections this filesystem opened on the running loop."""
        loop = asyncio.get_running_loop()
        s = self._sessions.pop(id(loop), None)
        if s is not None and s.owned:
            await s.client.close()

    def close(self) -> None:
        """Close the connections this filesystem opened (on any loop)."""
        if self.asynchronous:
            _close_sessions(self._sessions)
        elif self.loop is not None and not self.loop.is_closed():
            sync(self.loop, self._close)
            _close_sessions(self._sessions)

    # paths -------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = stringify_path(path)
        if path.startswith("kvfs://"):
            path = path[len("kvfs://"):]
            head, _, rest = path.partition("/")
            if is_addr(head):
                path = rest
        elif path.startswith("kvfs::"):
            path = path[len("kvfs::"):]
        return path.strip("/")

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        if path.startswith("kvfs://"):
            head = path[len("kvfs://"):].partition("/")[0]
            if is_addr(head):
                return {"addr": f"kvfs://{head}"}
        return {}

    def unstrip_protocol(self, name: str) -> str:
        if name.startswith("kvfs://"):
            return name
        return f"{self.addr}/{name.lstrip('/')}"

    def _key(self, path: str, *, limit: int = MAX_KEY_BYTES) -> str:
        """The key for ``path``: validated, without protocol or slashes at either end."""
        p = self._strip_protocol(path)
        if not p:
            raise IsADirectoryError(errno.EISDIR, "the root of a kvfs filesystem is a directory", path)
        check_path(p, limit=limit)
        return str(p)

    # metadata ----------------------------------------------------------------
    async def _info(self, path: str, **kwargs: Any) -> Info:
        p = self._strip_protocol(path)
        if not p:
            return _dir_info("")
        check_path(p)
        with builtin_errors(p):  # a file, a directory or nothing: one LOOKUP says which
            (found,) = await self._session().client.lookup_dirs([_kb(p)])
        return path_info(p, found)

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Info] | list[str]:
        p = self._strip_protocol(path)
        prefix = p + "/" if p else ""
        with builtin_errors(p):
            infos = await self._session().client.list(_kb(prefix))
        out: dict[str, Info] = {}
        for ki in infos:
            rest = _ks(ki.key)[len(prefix):]
            head, sep, _ = rest.partition("/")
            if not head:  # this directory's marker, or a key with an empty component
                continue
            name = prefix + head
            if sep:
                out[name] = _dir_info(name)  # a directory wins over a key of the same name
            elif name not in out:
                out[name] = _info_of(name, ki)
        if not out:
            info = await self._info(p)  # a file lists as itself; an empty directory as []
            if info["type"] == "file":
                return [info] if detail else [p]
        entries = [out[k] for k in sorted(out)]
        return entries if detail else [e["name"] for e in entries]

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False,
                    **kwargs: Any) -> list[str] | dict[str, Info]:
        """Everything under ``path`` from one (paginated) prefix listing, not a walk."""
        if maxdepth is not None and maxdepth < 1:
            raise ValueError("maxdepth must be at least 1")
        detail = kwargs.pop("detail", False)
        stem = kwargs.pop("prefix", "") or ""
        p = self._strip_protocol(path)
        base = p + "/" if p else ""
        with builtin_errors(p):
            infos = await self._session().client.list(_kb(base + stem))
        out: dict[str, Info] = {}
        for ki in infos:
            rel = _ks(ki.key)[len(base):]
            if not rel:
                continue
            parts = rel.split("/")
            marker = parts[-1] == ""
            if marker:
                parts.pop()
            if "" in parts:
                continue
            ndirs = len(parts) if marker else len(parts) - 1
            if withdirs:
                for i in range(1, ndirs + 1):
                    if maxdepth is not None and i > maxdepth:
                        break
                    name = base + "/".join(parts[:i])
                    out[name] = _dir_info(name)
            if not marker and (maxdepth is None or len(parts) <= maxdepth):
                name = base + rel
                out.setdefault(name, _info_of(name, ki))
        if withdirs and p and ((infos and not stem) or await self._isdir(p)):
            out[p] = _dir_info(p)
        if not out and p:
            with contextlib.suppress(FileNotFoundError, ValueError):
                info = await self._info(p)
                if info["type"] == "file":
                    out[p] = info
        names = sorted(out)
        return {n: out[n] for n in names} if detail else names

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        p = self._strip_protocol(path)
        if not p:
            return
        check_path(p, limit=MAX_KEY_BYTES - 1)
        if await self._exists(p):
            raise FileExistsError(errno.EEXIST, "kvfs path exists", p)
        parent = self._parent(p)
        if not create_parents and parent and not await self._isdir(parent):
            raise FileNotFoundError(errno.ENOENT, "parent directory does not exist", parent)
        await self._put_markers(p)

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        p = self._strip_protocol(path)
        if not p:
            return
        check_path(p, limit=MAX_KEY_BYTES - 1)
        if not exist_ok and await self._exists(p):
            raise FileExistsError(errno.EEXIST, "kvfs path exists", p)
        await self._put_markers(p)  # also when the directory exists only implicitly: it stays

    async def _put_markers(self, p: str) -> None:
        """Marker keys for ``p`` and every level above it; no level may be a file."""
        parts = p.split("/")
        levels = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        c = self._session().client
        with builtin_errors(p):
            files = await c.exists_many([_kb(lv) for lv in levels])
            for lv, is_file in zip(levels, files, strict=True):
                if is_file and lv == p:
                    raise FileExistsError(errno.EEXIST, "a kvfs file has this name", lv)
                if is_file:
                    raise NotADirectoryError(errno.ENOTDIR, "a kvfs file is in the way", lv)
            await c.put_many([(_kb(lv + "/"), b"") for lv in levels])

    async def _rmdir(self, path: str) -> None:
        """Remove an empty directory (its marker key); ``OSError(ENOTEMPTY)`` if it holds keys."""
        p = self._key(path, limit=MAX_KEY_BYTES - 1)
        c = self._session().client
        with builtin_errors(p):
            under = await c.list(_kb(p + "/"), limit=2, page_size=2)
            if any(ki.key != _kb(p + "/") for ki in under):
                raise OSError(errno.ENOTEMPTY, "kvfs directory is not empty", p)
            if not under:
                if await c.exists(_kb(p)):
                    raise NotADirectoryError(errno.ENOTDIR, "is a kvfs file", p)
                raise FileNotFoundError(errno.ENOENT, "no such kvfs directory", p)
            await c.delete_many([_kb(p + "/")])

    def rmdir(self, path: str) -> None:
        sync(self.loop, self._rmdir, path)

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        p = self._key(path)
        with builtin_errors(p):
            n = await self._session().client.delete_many([_kb(p), _kb(p + "/")])
        if n == 0:
            raise FileNotFoundError(errno.ENOENT, "no such kvfs file", p)

    async def _rm(self, path: str | list[str], recursive: bool = False, batch_size: int | None = None,
                  maxdepth: int | None = None, **kwargs: Any) -> None:
        paths = await self._expand_path(path, recursive=recursive, maxdepth=maxdepth)
        keys: list[bytes] = []
        for p in paths:
            if p:
                check_path(p)
                keys += [_kb(p), _kb(p + "/")]
        c = self._session().client
        n = 0
        with builtin_errors(str(path)):
            for i in range(0, len(keys), DELETE_BATCH):
                n += await c.delete_many(keys[i : i + DELETE_BATCH])
        if n == 0 and keys:
            raise FileNotFoundError(errno.ENOENT, "no such kvfs file or directory", str(path))

    # reads -------------------------------------------------------------------
    async def _missing(self, p: str) -> OSError:
        if await self._isdir(p):
            return IsADirectoryError(errno.EISDIR, "is a kvfs directory", p)
        return FileNotFoundError(errno.ENOENT, "no such kvfs file", p)

    async def _get_value(self, p: str) -> bytes:
        """The whole value of key ``p`` through the client's batcher."""
        with builtin_errors(p):
            v = await self._session().client.get(_kb(p))
        if v is None:
            raise await self._missing(p)
        return v

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None,
                        **kwargs: Any) -> bytes:
        if start is None and end is None:
            return await self._get_value(self._key(path))
        p = self._key(path)
        with builtin_errors(p):
            (v,) = await self._session().client.get_ranges([(_kb(p), start, end)])
        if v is None:
            raise await self._missing(p)
        return v

    async def _get_many(self, paths: Sequence[str]) -> list[bytes | BaseException]:
        """Whole values of many paths in one ``get_many``; an error in place of each failure."""
        out: list[bytes | BaseException] = []
        keys: list[bytes] = []
        slots: list[int] = []
        for p in paths:
            try:
                keys.append(_kb(self._key(p)))
                slots.append(len(out))
                out.append(b"")
            except (ValueError, OSError) as exc:
                out.append(exc)
        if keys:
            try:
                with builtin_errors(str(paths[0])):
                    values = await self._session().client.get_many(keys)
            except (ValueError, OSError) as exc:
                for i in slots:
                    out[i] = exc
                return out
            for i, v in zip(slots, values, strict=True):
                out[i] = v if v is not None else await self._missing(self._strip_protocol(paths[i]))
        return out

    async def _cat(self, path: str | list[str], recursive: bool = False, on_error: str = "raise",
                   batch_size: int | None = None, **kwargs: Any) -> bytes | dict[str, Any]:
        paths = await self._expand_path(path, recursive=recursive)
        got = await self._get_many(paths)
        if recursive:  # the expansion lists directories too; they have no bytes
            keep = [i for i, v in enumerate(got) if not isinstance(v, IsADirectoryError)]
            paths, got = [paths[i] for i in keep], [got[i] for i in keep]
        if on_error == "raise":
            for v in got:
                if isinstance(v, BaseException):
                    raise v
        if len(paths) > 1 or isinstance(path, list) or (paths and paths[0] != self._strip_protocol(path)):
            return {p: v for p, v in zip(paths, got, strict=True)
                    if on_error != "omit" or not isinstance(v, BaseException)}
        v = got[0]
        if isinstance(v, BaseException):
            raise v
        return v

    async def _cat_ranges(self, paths: list[str], starts: int | list[int] | None,
                          ends: int | list[int] | None, max_gap: int | None = None,
                          batch_size: int | None = None, on_error: str = "return",
                          **kwargs: Any) -> list[bytes | BaseException]:
        """Byte ranges of many files in one batch (one lookup + one readv per server);
        only the extents covering each range are read.

        ``max_gap`` is accepted and ignored: the chunkservers merge nearby reads themselves.
        """
        if not isinstance(paths, list):
            raise TypeError("paths must be a list")
        n = len(paths)
        st = starts if isinstance(starts, list) else [starts] * n
        en = ends if isinstance(ends, list) else [ends] * n
        if len(st) != n or len(en) != n:
            raise ValueError("paths, starts and ends must have the same length")
        out: list[bytes | BaseException] = []
        try:
            keys = [self._key(p) for p in paths]
            with builtin_errors(keys[0] if keys else ""):
                got = await self._session().client.get_ranges(
                    [(_kb(k), s, e) for k, s, e in zip(keys, st, en, strict=True)])
            for k, r in zip(keys, got, strict=True):
                out.append(await self._missing(k) if r is None else r)
        except (OSError, ValueError):
            # one bad path: fall back to whole values, an error in place of each failure
            uniq = list(dict.fromkeys(paths))
            values = dict(zip(uniq, await self._get_many(uniq), strict=True))
            out = []
            for p, s, e in zip(paths, st, en, strict=True):
                v = values[p]
                out.append(v if isinstance(v, BaseException) else v[s:e])
        if on_error != "return":
            for v in out:
                if isinstance(v, BaseException):
                    raise v
        return out

    async def _get_file(self, rpath: str, lpath: str, callback: Callback = DEFAULT_CALLBACK,
                        **kwargs: Any) -> None:
        p = self._strip_protocol(rpath)
        if os.path.isdir(lpath) and await self._isdir(p):
            return
        try:
            v = await self._get_value(self._key(p))
        except IsADirectoryError:
            os.makedirs(lpath, exist_ok=True)
            return
        callback.set_size(len(v))
        if len(v) > 1 << 20:
            await asyncio.to_thread(_write_local, lpath, v)
        else:
            _write_local(lpath, v)
        callback.relative_update(len(v))

    # writes ------------------------------------------------------------------
    def _ttl(self, ttl: float | None) -> float | None:
        return self.ttl if ttl is None else ttl

    async def _put_value(self, p: str, value: Any, ttl: float | None = None) -> None:
        n = memoryview(value).nbytes
        if n > MAX_VALUE_BYTES:
            raise OSError(errno.EFBIG, f"kvfs values are limited to {MAX_VALUE_BYTES} bytes, got {n}", p)
        with builtin_errors(p):
            await self._session().put(_kb(p), value, self._ttl(ttl))

    async def _pipe_file(self, path: str, value: Any, mode: str = "overwrite",
                         ttl: float | None = None, **kwargs: Any) -> None:
        p = self._key(path)
        if mode == "create":
            with builtin_errors(p):
                if await self._session().client.exists(_kb(p)):
                    raise FileExistsError(errno.EEXIST, "kvfs file exists", p)
        elif mode != "overwrite":
            raise ValueError(f"mode must be 'overwrite' or 'create', got {mode!r}")
        await self._put_value(p, value, ttl)

    async def _pipe(self, path: str | Mapping[str, Any], value: Any = None, batch_size: int | None = None,
                    mode: str = "overwrite", ttl: float | None = None, **kwargs: Any) -> None:
        """Many files in one ``put_many`` (one append per chunkserver, one commit)."""
        items = {path: value} if isinstance(path, str) else dict(path)
        keys = [self._key(p) for p in items]
        values = list(items.values())
        c = self._session().client
        with builtin_errors(str(keys[0]) if keys else ""):
            if mode == "create" and keys:
                for k, there in zip(keys, await c.exists_many([_kb(k) for k in keys]), strict=True):
                    if there:
                        raise FileExistsError(errno.EEXIST, "kvfs file exists", k)
            if keys:
                await c.put_many([(_kb(k), v) for k, v in zip(keys, values, strict=True)],
                                 ttl=self._ttl(ttl))

    async def _put_file(self, lpath: str, rpath: str, mode: str = "overwrite",
                        callback: Callback = DEFAULT_CALLBACK, ttl: float | None = None,
                        **kwargs: Any) -> None:
        if os.path.isdir(lpath):
            await self._makedirs(rpath, exist_ok=True)
            return
        size = os.path.getsize(lpath)
        callback.set_size(size)
        data = await asyncio.to_thread(_read_local, lpath) if size > 1 << 20 else _read_local(lpath)
        await self._pipe_file(rpath, data, mode=mode, ttl=ttl)
        callback.relative_update(len(data))

    async def _cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        p2 = self._key(path2)
        try:
            v = await self._get_value(self._key(path1))
        except IsADirectoryError:
            await self._makedirs(p2, exist_ok=True)
            return
        await self._put_value(p2, v)

    # files -------------------------------------------------------------------
    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, autocommit: bool = True,
              cache_options: dict[str, Any] | None = None, **kwargs: Any) -> KVFile:
        return KVFile(self, path, mode, block_size=block_size, autocommit=autocommit,
                      cache_options=cache_options, **kwargs)

    async def open_async(self, path: str, mode: str = "rb", **kwargs: Any) -> KVAsyncFile:
        if "b" not in mode or kwargs.get("compression"):
            raise ValueError("open_async supports binary modes without compression only")
        p = self._key(path)
        size = None
        if mode == "rb":
            size = (await self._info(p))["size"]
        elif mode in ("ab", "xb") and await self._exists(p):
            raise _exists_error(p, mode)
        return KVAsyncFile(self, p, mode, size=size, **kwargs)

    def created(self, path: str) -> datetime:
        return datetime.fromtimestamp(self.info(path)["created"], tz=UTC)

    def modified(self, path: str) -> datetime:
        return self.created(path)


def check_path(p: str, *, limit: int = MAX_KEY_BYTES) -> None:
    """Refuse what cannot be a key: ``..`` components, NUL, more than ``limit`` bytes."""
    if "\x00" in p:
        raise InvalidPathError(p, "contains a NUL character")
    if ".." in p.split("/"):
        raise InvalidPathError(p, "'..' is not allowed in a kvfs path (keys are not resolved)")
    n = len(_kb(p))
    if n > limit:
        raise InvalidPathError(p, f"{n} bytes is longer than the {limit}-byte key limit",
                               errno.ENAMETOOLONG)


def _exists_error(p: str, mode: str) -> OSError:
    if mode == "xb":
        return FileExistsError(errno.EEXIST, "kvfs file exists", p)
    return OSError(errno.EOPNOTSUPP, "kvfs values are immutable: appending to an existing file is "
                   "not supported (read it and write a new value)", p)


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write_local(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _close_sessions(sessions: dict[int, _Session]) -> None:
    """Close owned clients from any thread: on their loop when it runs, else directly."""
    for s in list(sessions.values()):
        if not s.owned or s.loop.is_closed():
            continue
        if s.loop.is_running():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is s.loop:
                s.loop.create_task(s.client.close())
            else:
                asyncio.run_coroutine_threadsafe(s.client.close(), s.loop)
    sessions.clear()


def _unread(f: KVFile | KVAsyncFile) -> bool:
    """Whether read-mode file ``f`` has not yet taken its snapshot of the value."""
    return f.mode == "rb" and f._value is None and not f.closed


class KVFile(AbstractBufferedFile):
    """A kvfs file: ``rb`` fetches the value on the first read or seek from the end (a
    snapshot: its size is the file's from then on, whatever the lookup at open said; the
    async file's ``seek`` from the end still counts from that lookup's); ``wb``/``xb``
    buffer until close.

    ``ab`` is ``wb`` for a new file and ``OSError(EOPNOTSUPP)`` for an existing one.
    """

    fs: KVFileSystem

    def __init__(self, fs: KVFileSystem, path: str, mode: str = "rb", block_size: int | None = None,
                 autocommit: bool = True, cache_type: str = "none",
                 cache_options: dict[str, Any] | None = None, size: int | None = None,
                 ttl: float | None = None, **kwargs: Any) -> None:
        key = fs._key(path)
        if mode in ("ab", "xb") and fs.exists(key):
            raise _exists_error(key, mode)
        self.ttl = ttl
        self._value: bytes | None = None
        self._staged: bytes | None = None
        super().__init__(fs, key, mode, block_size=block_size, autocommit=autocommit,
                         cache_type=cache_type, cache_options=cache_options, size=size, **kwargs)

    def read(self, length: int = -1) -> bytes:
        self._snapshot()  # first: a read's length counts from its size
        return super().read(length)

    def seek(self, loc: int, whence: int = 0) -> int:
        if whence == 2:
            self._snapshot()  # first: the end is its size's
        return super().seek(loc, whence)

    def _snapshot(self) -> None:
        if _unread(self):
            self._fetch_range(0, 0)

    def _fetch_range(self, start: int, end: int) -> bytes:
        if self._value is None:
            try:
                self._value = self.fs.cat_file(self.path)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "kvfs file was deleted or expired after it "
                                        "was opened", self.path) from None
            self.size = self.cache.size = len(self._value)  # the snapshot's size wins
        return self._value[start:end]

    def _initiate_upload(self) -> None:
        pass

    def _upload_chunk(self, final: bool = False) -> bool:
        if not final:
            return False  # keep buffering: the value is written whole on close
        if self.autocommit:
            with self.buffer.getbuffer() as mv:
                self._commit(mv)
        else:
            self._staged = self.buffer.getvalue()
        return True

    def _commit(self, data: Any) -> None:
        self.fs.pipe_file(self.path, data, mode="create" if self.mode == "xb" else "overwrite",
                          ttl=self.ttl)

    def commit(self) -> None:
        if self._staged is not None:
            self._commit(self._staged)
            self._staged = None

    def discard(self) -> None:
        self._staged = None


class KVAsyncFile(AbstractAsyncStreamedFile):
    """``await fs.open_async(path, mode)``: the async twin of :class:`KVFile`."""

    fs: KVFileSystem

    def __init__(self, fs: KVFileSystem, path: str, mode: str = "rb", size: int | None = None,
                 ttl: float | None = None, **kwargs: Any) -> None:
        self.ttl = ttl
        self._value: bytes | None = None
        self._create = mode == "xb"
        super().__init__(fs, path, "wb" if mode in ("ab", "xb") else mode, size=size,
                         cache_type="none", **kwargs)

    async def read(self, length: int = -1) -> bytes:
        if _unread(self):
            await self._fetch_range(0, 0)  # the snapshot first: a read's length counts from its size
        return await super().read(length)

    async def _fetch_range(self, start: int, end: int) -> bytes:
        if self._value is None:
            try:
                self._value = await self.fs._cat_file(self.path)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "kvfs file was deleted or expired after it "
                                        "was opened", self.path) from None
            self.size = len(self._value)
        return self._value[start:end]

    async def _upload_chunk(self, final: bool = False) -> bool:
        if not final:
            return False
        with self.buffer.getbuffer() as mv:
            await self.fs._pipe_file(self.path, mv, mode="create" if self._create else "overwrite",
                                     ttl=self.ttl)
        return True
