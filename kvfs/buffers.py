"""Turning caller objects into flat byte views (bytes, bytearray, memoryview, numpy, torch)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from operator import add, attrgetter
from typing import Any, Literal, overload

from kvfs.errors import InvalidArgument

_NBYTES = attrgetter("nbytes")
# formats of one unsigned byte a flat view may carry besides "B", taken as "B" by a cast
_BYTE_FORMATS = frozenset({"<B", ">B", "=B", "!B", "@B"})
# a view's flags as as_parts_many checks them at once: a flat, C-contiguous byte view
# (format, ndim, c_contiguous, readonly), writable or either
_VIEW_FLAGS = attrgetter("format", "ndim", "c_contiguous", "readonly")
_FLAT_RW = {("B", 1, True, False)}
_FLAT_ANY = {("B", 1, True, False), ("B", 1, True, True)}


# a bytes object of n bytes not yet filled (CPython's C API: "if v is NULL, the contents of
# the bytes object are uninitialized"), and the address of its bytes; function objects of
# their own (indexing, not the attribute pythonapi caches and shares with every other user,
# whose argtypes/restype another library may set)
_NEW_BYTES = ctypes.pythonapi["PyBytes_FromStringAndSize"]
_NEW_BYTES.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_NEW_BYTES.restype = ctypes.py_object
_BYTES_AT = ctypes.pythonapi["PyBytes_AsString"]
_BYTES_AT.argtypes = [ctypes.py_object]
_BYTES_AT.restype = ctypes.c_void_p


def fresh_bytes(n: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` object of ``n`` (>= 1) bytes, not filled yet, and a writable view of
    them: a value read straight into the ``bytes`` a call hands back, with no copy out of a
    buffer.  The view keeps the object alive; the object is never to be handed out, or
    hashed, before it is filled (a read that fails drops it)."""
    b = _NEW_BYTES(None, n)
    region = (ctypes.c_char * n).from_address(_BYTES_AT(b))
    region.owner = b  # type: ignore[attr-defined]  # (the view holds the region, which holds b)
    return b, memoryview(region).cast("B")


def fresh_value(n: int) -> tuple[bytes, memoryview | None]:
    """:func:`fresh_bytes` for a value of ``n`` >= 0 bytes: an empty one is ``b""``, with
    nothing to read into."""
    return fresh_bytes(n) if n else (b"", None)


class Parts(list[memoryview]):
    """One value's buffers, checked already: flat, C-contiguous byte views (writable ones
    when ``writable``) of ``nbytes`` bytes in all, as :func:`regions` cuts them out of one
    checked view.  :func:`as_parts` takes it as it is and :func:`nbytes` reads its total,
    so a value scattered over many regions (an engine's per-layer K and V) costs no check
    per region.  Not to be changed once made."""

    __slots__ = ("nbytes", "writable")
    nbytes: int
    writable: bool


def regions(view: Any, offsets: Sequence[int], sizes: Sequence[int], per: int, *,
            writable: bool = False, what: str = "buffer") -> list[Parts]:
    """The views of ``sizes[i]`` bytes at ``offsets[i]`` of ``view`` (any buffer; checked
    once, as :func:`as_view` does), grouped ``per`` at a time, in order: one :class:`Parts`
    per value.  The bounds are checked once for all; no copy is made, and no Python step
    runs per region."""
    flat = as_view(view, writable=writable, what=what)
    n, sizes = len(offsets), list(sizes)
    if len(sizes) != n or per < 1 or n % per:
        raise InvalidArgument(f"{what}: {n} offsets and {len(sizes)} sizes do not make values "
                              f"of {per} regions each")
    ends = list(map(add, offsets, sizes))
    if n and (min(offsets) < 0 or min(sizes) < 0 or max(ends) > flat.nbytes):
        bad = next(i for i, (o, k) in enumerate(zip(offsets, sizes, strict=True))
                   if o < 0 or k < 0 or o + k > flat.nbytes)
        raise InvalidArgument(f"{what}: region {offsets[bad]}+{sizes[bad]} is outside its "
                              f"{flat.nbytes} bytes")
    views = list(map(flat.__getitem__, map(slice, offsets, ends)))
    out = list(map(Parts, [views[i : i + per] for i in range(0, n, per)]))
    alike = sizes[:per] * (n // per) == sizes  # every value's regions the same sizes
    total = sum(sizes[:per])
    for i, parts in enumerate(out):
        parts.nbytes = total if alike else sum(sizes[i * per : (i + 1) * per])
        parts.writable = writable
    return out


def _tensor_view(obj: Any, writable: bool) -> memoryview | None:
    mod = type(obj).__module__
    if not mod.startswith("torch"):
        return None
    t = obj.detach()
    if t.device.type != "cpu":
        raise InvalidArgument(f"tensor on {t.device} must be copied to CPU (or use kvfs.torch helpers)")
    if not t.is_contiguous():
        if writable:
            raise InvalidArgument("destination tensor must be contiguous")
        t = t.contiguous()
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def as_view(obj: Any, *, writable: bool = False, what: str = "value") -> memoryview:
    """A flat unsigned-byte memoryview over ``obj`` without copying it."""
    kind = type(obj)  # the common cases first, one check each (a value may have many parts)
    if kind is bytearray or (kind is bytes and not writable):
        return memoryview(obj)
    if (kind is memoryview and obj.ndim == 1 and obj.c_contiguous
            and not (writable and obj.readonly)):
        fmt = obj.format
        if fmt == "B":
            return obj  # e.g. a plug-in's views of an engine's host pool
        if fmt in _BYTE_FORMATS:  # e.g. a ctypes byte array's ("<B": LMCache's memory objects)
            return obj.cast("B")
    view = _tensor_view(obj, writable)
    if view is None:
        try:
            view = memoryview(obj)
        except TypeError:
            raise InvalidArgument(
                f"{what} must be bytes-like (bytes, bytearray, memoryview, numpy array, CPU tensor), "
                f"got {type(obj).__name__}") from None
    if writable and view.readonly:
        raise InvalidArgument(f"{what} is read-only; pass a bytearray, writable memoryview or array")
    if not view.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def as_parts(obj: Any, *, writable: bool = False, what: str = "value") -> list[memoryview]:
    """A value as a gather/scatter list: one view, or one per element of a list/tuple of
    buffers (e.g. a page's K half and V half), none of them copied."""
    kind = type(obj)
    if kind is bytearray or (kind is bytes and not writable):  # the common case, one check
        return [memoryview(obj)]
    if kind is Parts and (obj.writable or not writable):  # checked when it was made
        return obj
    if isinstance(obj, (list, tuple)):
        try:
            return [as_view(p, writable=writable) for p in obj]
        except InvalidArgument:  # again, naming the part (not built for every good one)
            return [as_view(p, writable=writable, what=f"{what} part {i}") for i, p in enumerate(obj)]
    return [as_view(obj, writable=writable, what=what)]


# one value's buffers: its one flat view as it is, or a list of views (as_parts_many(bare=True))
Views = memoryview | list[memoryview]
# one value to write: its views, or a bytes value as it is (flat already: as_parts_many(bare=True))
Source = Views | bytes


@overload
def as_parts_many(objs: Sequence[Any], *, writable: bool = False, what: str = "value",
                  bare: Literal[False] = False) -> tuple[list[list[memoryview]], list[int]]: ...
@overload
def as_parts_many(objs: Sequence[Any], *, writable: Literal[True], what: str = "value",
                  bare: Literal[True]) -> tuple[list[Views], list[int]]: ...
@overload
def as_parts_many(objs: Sequence[Any], *, writable: Literal[False] = False, what: str = "value",
                  bare: Literal[True]) -> tuple[list[Source], list[int]]: ...
def as_parts_many(objs: Sequence[Any], *, writable: bool = False, what: str = "value",
                  bare: bool = False,
                  ) -> tuple[list[list[memoryview]], list[int]] | tuple[list[Source], list[int]] \
        | tuple[list[Views], list[int]]:
    """:func:`as_parts` of each of ``objs`` (named ``f"{what} {i}"`` in an error), and
    each one's size.  The common case, every object a flat byte view (e.g. per-value views
    cut out of one region), a bytearray, or bytes when not ``writable``, is checked for all
    of them at once: no Python step per object beyond making its one-view list, or with
    ``bare`` none at all: each is its view itself, and bytes are kept as they are (a list
    or a view per value would be one more object per value for Python's cyclic GC to
    track: a get_into of 128 keys made its collections twice as frequent as get_many's)."""
    kinds = set(map(type, objs))
    if kinds == {memoryview}:
        flags = set(map(_VIEW_FLAGS, objs))
        if flags == _FLAT_RW or (not writable and flags <= _FLAT_ANY):
            if bare:
                return list(objs), list(map(_NBYTES, objs))
            return [[v] for v in objs], list(map(_NBYTES, objs))
    elif kinds == {bytearray} or (kinds == {bytes} and not writable):
        if bare:
            views: list[Source] = list(objs) if kinds == {bytes} else [memoryview(b) for b in objs]
            return views, list(map(len, objs))
        return [[memoryview(b)] for b in objs], list(map(len, objs))
    try:
        parts = [as_parts(o, writable=writable) for o in objs]
    except InvalidArgument:  # again, naming the object (not built for every good one)
        parts = [as_parts(o, writable=writable, what=f"{what} {i}") for i, o in enumerate(objs)]
    return parts, [nbytes(p) for p in parts]


def nbytes(parts: Source) -> int:
    if type(parts) is Parts:
        return parts.nbytes
    if not isinstance(parts, list):
        return parts.nbytes if isinstance(parts, memoryview) else len(parts)
    if len(parts) == 1:
        return parts[0].nbytes
    return sum(map(_NBYTES, parts))


def cut(parts: Source, start: int, length: int) -> list[memoryview]:
    """The views covering bytes ``[start, start + length)`` of the concatenation of ``parts``
    (or of the one view, or bytes, ``parts``)."""
    if not isinstance(parts, list):
        return [memoryview(parts)[start : start + length]]
    if len(parts) == 1:
        return [parts[0][start : start + length]]
    out: list[memoryview] = []
    pos = 0
    end = start + length
    for p in parts:
        n = p.nbytes
        if pos + n > start and pos < end:
            out.append(p[max(start - pos, 0) : min(end - pos, n)])
        pos += n
        if pos >= end:
            break
    return out
