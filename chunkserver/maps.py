"""Read-only mappings of chunk files: a READV answer of page-cache-resident ranges is sent
as views of them, written into the socket with the answer's header by one vectored write,
with no ``preadv`` per range and no copy through a reply buffer
(:meth:`kvfs.chunkserver.store.ChunkStore.readv_mapped`).

A mapping lives as long as anything holds a view of it: a chunk pushed out of the LRU, or
deleted, while an answer made of its views is being sent stays mapped until that answer is
gone (a chunk's records never change once written, so the bytes sent are the ones asked
for).  A deleted chunk's mapping is then its file's last reference, and unmapping it frees
the file's blocks, which can wait for the disk.  So once the last view is gone, the
caller's ``unmap(chunk_id, close)`` decides where to unmap, whether the mapping is still
in the LRU, pushed out of it or replaced by a longer one (the store: a chunk no longer in
its sizes is deleted, and its mapping is unmapped in an IO thread, not in the event loop
that let go of the last view).  For that the views are of a ``ctypes`` array at the
mapping's address, whose end (a weak reference's callback) says when the last view is
gone; the ``mmap`` itself, which has no such callback, is kept until then.  The views go
only to the socket's ``writev``: the kernel copies them out, and a page it cannot read
there fails that write (EFAULT: the connection is dropped, as any failed send) instead of
raising SIGBUS in Python, which never reads them.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class _PyBuffer(ctypes.Structure):  # CPython's Py_buffer (part of the stable ABI since 3.11)
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
                ("internal", ctypes.c_void_p)]


def _address(obj: object) -> int:
    """Where a buffer's bytes start in memory (a read-only ``mmap``'s too, which ctypes'
    ``from_buffer`` refuses)."""
    buf = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(obj), ctypes.byref(buf), ctypes.c_int(0))
    try:
        return int(buf.buf or 0)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buf))


@functools.lru_cache(maxsize=64)
def _pages(nbytes: int) -> Any:
    """A ``ctypes`` array type of at least ``nbytes`` bytes: a power of two (ctypes keeps
    every array type it made, so one per length would grow without bound); views of it
    are cut to the mapping's length at once."""
    return ctypes.c_char * (1 << max(0, nbytes - 1).bit_length())


def _unmap(m: mmap.mmap, chunk_id: int, maps: weakref.ref[ChunkMaps]) -> None:
    """The last view of ``m``, ``chunk_id``'s mapping, is gone: unmapped by the owner's
    ``unmap``, or here once the owner is gone."""
    owner = maps()
    if owner is None:
        m.close()
    else:
        owner.unmap(chunk_id, m.close)


class ChunkMaps:
    """An LRU of at most ``max_maps`` read-only mappings, one per chunk file, each as long as
    its file was when it was mapped (mapped again, longer, once reads go past it: the open
    chunk grows).  Each mapping holds a copy of its file's fd (Python's ``mmap`` keeps one)
    until it is unmapped.  Once a mapping's last view is gone, ``unmap(chunk_id, close)``
    runs ``close`` (the unmap), at once or later in another thread."""

    def __init__(self, max_maps: int, unmap: Callable[[int, Callable[[], None]], object]) -> None:
        self.max_maps = max(0, max_maps)
        self.unmap = unmap
        self._maps: OrderedDict[int, tuple[memoryview, int]] = OrderedDict()  # view, address
        self.mapped = 0  # mappings made (again, longer, included)

    def __len__(self) -> int:
        return len(self._maps)

    def view(self, chunk_id: int, fd: int, end: int) -> tuple[memoryview, int] | None:
        """A read-only view of the chunk file ``fd`` from its first byte to at least ``end``,
        and the address it is mapped at; None where it cannot be mapped (the file shorter
        than ``end``, no mappings allowed, or the kernel refusing: the caller reads it)."""
        maps = self._maps
        got = maps.get(chunk_id)
        if got is not None and got[0].nbytes >= end:
            maps.move_to_end(chunk_id)
            return got
        if not self.max_maps:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < end:
                return None
            m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        addr = _address(m)
        pages = _pages(size).from_address(addr)
        weakref.finalize(pages, _unmap, m, chunk_id, weakref.ref(self)).atexit = False  # m kept until the last view goes
        got = maps[chunk_id] = memoryview(pages).cast("B")[:size].toreadonly(), addr
        maps.move_to_end(chunk_id)
        self.mapped += 1
        while len(maps) > self.max_maps:
            maps.popitem(last=False)  # unmapped once no answer holds a view of it
        return got

    def drop(self, chunk_id: int) -> None:
        """Forget a chunk's mapping (deleted): unmapped once no answer holds a view of it."""
        self._maps.pop(chunk_id, None)

    def clear(self) -> None:
        self._maps.clear()
