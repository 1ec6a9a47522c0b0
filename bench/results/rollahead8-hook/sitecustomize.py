"""rollahead8's measuring hook (bench/RESULTS.md, "Issue 11, large puts: the next chunk reserved
ahead"): put this folder on PYTHONPATH with ROLLAHEAD8_OUT=DIR set and each chunkserver process
of an embedded cluster writes DIR/<pid>.json when its store closes: its rolls, how many took a
chunk reserved ahead, and the time of each fallocate (on the append path: a fresh chunk's first
write's job; off it: the reservation ahead's job).  Works on trees with and without the
reservation ahead.  Nothing happens without ROLLAHEAD8_OUT."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

if os.environ.get("ROLLAHEAD8_OUT"):
    import atexit
    import functools
    import json
    import time

    from kvfs.chunkserver import store as _store

    _out = os.environ["ROLLAHEAD8_OUT"]
    _seen: dict[str, Any] = {"rolls": 0, "fresh_ms": [], "ahead_ms": [], "stores": []}

    def _timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _seen[key].append(round((time.perf_counter() - t) * 1e3, 2))
        return wrapper

    _real_pre = _store.preallocate

    def _write_at(fd: int, bufs: list[Any], offset: int, reserve: int, writeback: int = 0) -> None:
        if reserve:  # the fresh chunk's reservation, timed alone (under the append lock)
            t = time.perf_counter()
            _real_pre(fd, reserve)
            _seen["fresh_ms"].append(round((time.perf_counter() - t) * 1e3, 2))
        _store._pwritev_all(fd, bufs, offset)
        if writeback:
            _store.start_writeback(fd, offset, writeback)

    setattr(_store, "_write_at", _write_at)  # noqa: B010
    if hasattr(_store, "_reserve_chunk"):
        setattr(_store, "_reserve_chunk", _timed("ahead_ms", _store._reserve_chunk))  # noqa: B010
    _real_roll = _store.ChunkStore._roll

    def _roll(self: Any) -> Any:
        _seen["rolls"] += 1
        if self not in _seen["stores"]:
            _seen["stores"].append(self)
        return _real_roll(self)

    setattr(_store.ChunkStore, "_roll", _roll)  # noqa: B010

    def _dump() -> None:
        stores = _seen["stores"]
        out = {k: v for k, v in _seen.items() if k != "stores"}
        out["taken"] = sum(getattr(s, "ahead_taken", 0) for s in stores)
        out["missed"] = sum(getattr(s, "ahead_missed", 0) for s in stores)
        with open(os.path.join(_out, f"{os.getpid()}.json"), "w") as f:
            json.dump(out, f)

    _real_close = _store.ChunkStore.close

    async def _close(self: Any) -> bool:
        try:
            return await _real_close(self)
        finally:
            _dump()

    setattr(_store.ChunkStore, "close", _close)  # noqa: B010
    atexit.register(_dump)
