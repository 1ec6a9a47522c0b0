"""The packed COMMIT form (:mod:`kvfs.packed`): what the client packs, meta unpacks to the
same layouts, stamped; and every malformed blob is refused with an error naming what
is wrong (truncated, lengths past the end, counts over the limits or disagreeing with the
head, values out of bounds), never a crash or a wrong layout."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from kvfs import packed, rpc
from kvfs.errors import InvalidArgument
from kvfs.layout import (
    MAX_EXTENTS,
    MAX_KEY_BYTES,
    MAX_META_BYTES,
    MAX_VALUE_BYTES,
    Extent,
    Layout,
    Replica,
    server_of_chunk,
)
from kvfs.packed import HEAD, pack, pack_single, unpack


def _lay(size: int, crc: int, extents: list[tuple[int, int, list[tuple[int, int, int]]]],
         meta: bytes | None = None) -> Layout:
    return Layout(size, crc, 0.0, None,
                  tuple(Extent(n, c, tuple(Replica(*r) for r in reps)) for n, c, reps in extents), meta)


ONE = _lay(4096, 7, [(4096, 7, [(1, (1 << 40) + 3, 8192)])])
MIXED = [  # one extent of one replica, striped, replicated, metadata, an empty value
    (b"a" * 64, ONE),
    (b"striped", _lay(3 << 20, 11, [(1 << 20, 1, [(1, (1 << 40) + 5, 0)]), (1 << 20, 2, [(2, (2 << 40) + 6, 0)]),
                                    (1 << 20, 3, [(3, (3 << 40) + 7, 2**63 - 1)])])),
    (b"r3", _lay(100, 9, [(100, 9, [(s, (s << 40) + s, s) for s in (1, 2, 3)])], meta=b"\x81\xa1m\x01")),
    (b"k" * MAX_KEY_BYTES, _lay(0, 0, [(0, 0, [(1, (1 << 40) + 9, 4)])])),
    (b"nothing", _lay(0, 0, [], meta=b"")),
]


@pytest.mark.parametrize("items", [[(b"k1", ONE)], MIXED], ids=["one", "mixed"])
def test_unpack_gives_the_packed_layouts_stamped(items: list[tuple[bytes, Layout]]) -> None:
    keys, lays = [k for k, _ in items], [lay for _, lay in items]
    out = unpack(pack(keys, lays), 123.5, 456.0)
    assert out.staged == [(k, lay.stamped(123.5, 456.0)) for k, lay in items]
    assert out.servers == {r.server_id for lay in lays for e in lay.extents for r in e.replicas}
    assert out.max_meta == max(len(lay.meta or b"") for lay in lays)


def test_many_single_extent_layouts_take_the_column_path_and_match() -> None:
    lays = [_lay(4096 + i, i, [(4096 + i, i ^ 5, [(i % 3, ((i % 3) << 40) + i, i * 4096)])]) for i in range(300)]
    keys = [b"key%d" % i for i in range(300)]
    out = unpack(pack(keys, lays), 1.0, None)
    assert out.staged == [(k, lay.stamped(1.0, None)) for k, lay in zip(keys, lays, strict=True)]


@pytest.mark.parametrize("meta", [False, True], ids=["plain", "with-metadata"])
def test_a_lazy_batch_builds_the_same_rows_a_slice_at_a_time(meta: bool) -> None:
    """Past ``lazy_over`` keys a batch of single-extent layouts is checked whole, but its rows
    are built when asked: every slice, index and the whole walk give what the eager unpack
    gives; at or under it, a plain list."""
    n = packed.LAZY_PAGE + 700
    lays = [_lay(4096 + i, i, [(4096 + i, i ^ 5, [(i % 3, ((i % 3) << 40) + i, i * 4096)])],
                 meta=(b"\x81\xa1m%c" % (i % 100)) if meta and i % 3 else None) for i in range(n)]
    keys = [b"key%d" % i + b"x" * (i % 7) for i in range(n)]  # (keys of many lengths)
    blob = pack(keys, lays)
    eager = unpack(blob, 2.0, 9.0).staged
    assert eager == [(k, lay.stamped(2.0, 9.0)) for k, lay in zip(keys, lays, strict=True)]
    assert type(unpack(blob, 2.0, 9.0, lazy_over=n).staged) is list
    out = unpack(blob, 2.0, 9.0, lazy_over=10)
    lazy = out.staged
    assert isinstance(lazy, packed.LazyStaged) and len(lazy) == n
    assert out.servers == {0, 1, 2} and list(out.chunks) == [r.chunk_id for _, lay in eager
                                                            for r in lay.extents[0].replicas]
    for a, b in [(0, 10), (10, 20), (5, 2100), (n - 3, n + 5), (7, 7), (None, None)]:
        assert lazy[a:b] == eager[a:b]
    assert lazy[0] == eager[0] and lazy[-1] == eager[-1] and lazy[1234] == eager[1234]
    assert list(lazy) == eager
    with pytest.raises(IndexError):
        lazy[n]
    with pytest.raises(ValueError, match="steps of 1"):
        lazy[::2]


def test_a_lazy_batch_is_still_checked_whole() -> None:
    """A bad item past the first slice is refused by unpack itself, before any row is built."""
    lays = [_lay(10, 1, [(10, 1, [(1, (1 << 40) + i, 0)])]) for i in range(50)]
    lays[40] = _lay(10, 1, [(10, 1, [(1, (2 << 40) + 1, 0)])])  # a chunk of another server
    with pytest.raises(InvalidArgument, match="replica 40"):
        unpack(pack([b"k%d" % i for i in range(50)], lays), 1.0, None, lazy_over=10)


@pytest.mark.parametrize("n", [1, 300, packed._SPLIT_KEYS + 1])
@pytest.mark.parametrize("same_length", [True, False])
def test_keys_of_one_length_or_many_come_back_as_packed(n: int, same_length: bool) -> None:
    """The keys are cut by one struct format (up to _SPLIT_KEYS of them) or sliced."""
    keys = [b"k%09d" % i if same_length else b"k%d" % i for i in range(n)]
    lays = [_lay(10, i % 7, [(10, i % 7, [(1, 1 << 40, 10 * i)])]) for i in range(n)]
    assert unpack(pack(keys, lays), 1.0, None).staged == [
        (k, lay.stamped(1.0, None)) for k, lay in zip(keys, lays, strict=True)]


def test_the_largest_allowed_values_pass_the_check_on_the_columns_bytes() -> None:
    """Each bound's largest value in the common shape (one extent of one replica, no
    metadata), where the check on the columns' top bytes defers to the exact one."""
    big = MAX_VALUE_BYTES
    keys = [b"k" * MAX_KEY_BYTES, b"k" * (MAX_KEY_BYTES - 1), b"x"]
    top = server_of_chunk(2**63 - 1)  # the largest server id a chunk id can name
    lays = [_lay(big, 2**32 - 1, [(big, 2**32 - 1, [(top, 2**63 - 1, 2**63 - 1)])]),
            _lay(big - 1, 0, [(big - 1, 0, [(top, 2**63 - 2, 0)])]),
            _lay(0, 0, [(0, 0, [(0, 0, 0)])])]
    assert unpack(pack(keys, lays), 1.0, None).staged == [
        (k, lay.stamped(1.0, None)) for k, lay in zip(keys, lays, strict=True)]


@pytest.mark.parametrize("with_meta", [False, True])
def test_pack_single_makes_the_blob_pack_makes_of_the_same_single_extent_layouts(
        with_meta: bool) -> None:
    """The put path packs values of one extent from columns (no layout objects): the bytes
    must be exactly :func:`pack`'s, or meta would stage other layouts than the client's."""
    metas = [None if i % 3 else b"\x81\xa1m%c" % i for i in range(7)] if with_meta else None
    lays = [_lay(100 + i, i * 7, [(100 + i, i * 7, [(s, (s << 40) + 10 + s, i * 4096) for s in range(1 + i % 3)])],
                 None if metas is None else metas[i]) for i in range(7)]
    keys = [b"key%d" % i for i in range(7)]
    reps = [r for lay in lays for r in lay.extents[0].replicas]
    blob = pack_single(keys, [lay.size for lay in lays], [lay.crc for lay in lays],
                       [len(lay.extents[0].replicas) for lay in lays], [r.server_id for r in reps],
                       [r.chunk_id for r in reps], [r.offset for r in reps], metas)
    assert blob == pack(keys, lays)
    with pytest.raises(ValueError, match="replica columns"):
        pack_single(keys, [1] * 7, [0] * 7, [1] * 7, [1], [1], [1], metas)


@pytest.mark.parametrize("same", ["all", "key_len", "size", "server", "chunk"])
def test_pack_single_of_columns_of_one_number_makes_the_blob_pack_makes(same: str) -> None:
    """A put's usual columns (keys of one length, values of one size, one replica each on
    one server, in one chunk) are made by repeating one number: the bytes must still be
    :func:`pack`'s, and a column of one number among columns of many too."""
    def col(name: str, one: int, many: list[int]) -> list[int]:
        return [one] * 9 if same in ("all", name) else many
    sizes = col("size", 4096, [100 + i for i in range(9)])
    servers = [2] * 9 if same in ("all", "server", "chunk") else [1 + i % 3 for i in range(9)]
    chunks = [(s << 40) + (1 if same in ("all", "chunk") else 1 + i) for i, s in enumerate(servers)]
    keys = [b"k%08d" % i if same in ("all", "key_len") else b"k" * (1 + i) for i in range(9)]
    lays = [_lay(n, 5 * i, [(n, 5 * i, [(s, c, 4160 * i)])])
            for i, (n, s, c) in enumerate(zip(sizes, servers, chunks, strict=True))]
    blob = pack_single(keys, sizes, [5 * i for i in range(9)], [1] * 9, servers, chunks,
                       [4160 * i for i in range(9)])
    assert blob == pack(keys, lays)
    assert unpack(blob, 1.0, None).staged == [(k, lay.stamped(1.0, None)) for k, lay in zip(keys, lays, strict=True)]


@pytest.mark.parametrize(("replicas", "extents"), [(3, 1), (1, 4), (2, 2)])
def test_uniform_shapes_round_trip(replicas: int, extents: int) -> None:
    """Every value with the same extent and replica counts (a replicated or striped put)."""
    lays = [_lay(100 * extents, i, [(100, i + e, [(s, (s << 40) + i, e * 100) for s in range(replicas)])
                                    for e in range(extents)]) for i in range(50)]
    keys = [b"u%d" % i for i in range(50)]
    assert unpack(pack(keys, lays), 2.0, 3.0).staged == [
        (k, lay.stamped(2.0, 3.0)) for k, lay in zip(keys, lays, strict=True)]


def test_a_value_whose_extents_do_not_add_up_is_named_among_many() -> None:
    keys = [k for k, _ in MIXED]
    blob = bytearray(pack(keys, [lay for _, lay in MIXED]))
    at = HEAD.size + 2 * len(MIXED) + 4 * 2  # the size column, item 2
    blob[at:at + 4] = struct.pack("<I", 99)
    with pytest.raises(InvalidArgument, match=r"item 2 \(key b'r3'\): layout extents add up to 100, not 99"):
        unpack(bytes(blob), 1.0, None)


def test_the_limits_agree_with_the_typed_messages() -> None:
    assert packed.MAX_KEYS == rpc.MAX_ITEMS
    assert rpc.Commit(packed=pack([b"k"], [ONE])).packed is not None
    with pytest.raises(ValueError, match="either as `items` or as `packed`"):
        rpc.Commit()
    with pytest.raises(ValueError, match="not both"):
        rpc.Commit(items=[rpc.CommitItem(b"k", ONE)], packed=pack([b"k"], [ONE]))


# -- malformed blobs --------------------------------------------------------------------------
def _good() -> bytes:
    return pack([k for k, _ in MIXED], [lay for _, lay in MIXED])


def _head(blob: bytes, **fields: int) -> bytes:
    magic, n, ne, nr, nm = HEAD.unpack_from(blob)
    vals = {"n": n, "ne": ne, "nr": nr, "nm": nm, **fields}
    return HEAD.pack(magic, vals["n"], vals["ne"], vals["nr"], vals["nm"]) + blob[HEAD.size:]


def _col(name: str) -> int:
    """Where column ``name`` starts in the one-item blob of ONE (n = e = r = 1)."""
    widths = [("key_len", 2), ("size", 4), ("crc", 4), ("extents", 4), ("meta_len", 4),
              ("ext_len", 4), ("ext_crc", 4), ("ext_reps", 1), ("server", 4), ("chunk", 8),
              ("offset", 8)]
    at = HEAD.size
    for col, w in widths:
        if col == name:
            return at
        at += w
    raise AssertionError(name)


def _one(**cols: bytes) -> bytes:
    """The blob of key b"k1" -> ONE with columns replaced (their packed bytes)."""
    blob = bytearray(pack([b"k1"], [ONE]))
    for name, raw in cols.items():
        at = _col(name)
        blob[at:at + len(raw)] = raw
    return bytes(blob)


BAD: list[tuple[str, Callable[[], bytes], str]] = [
    ("empty", lambda: b"", "shorter than its 20-byte head"),
    ("head only", lambda: _good()[:HEAD.size], "key_len column"),
    ("bad magic", lambda: b"KVP9" + _good()[4:], "bad magic"),
    ("no keys", lambda: _head(_good(), n=0), "0 keys"),
    ("keys over the limit", lambda: _head(_good(), n=packed.MAX_KEYS + 1), f"{packed.MAX_KEYS + 1} keys"),
    ("extents over the limit", lambda: _head(_good(), ne=packed.MAX_ROWS + 1), "at most"),
    ("replicas over the limit", lambda: _head(_good(), nr=2**32 - 1), "at most"),
    ("head claims more keys than the blob holds", lambda: _head(_good(), n=100_000),
     "runs past the end"),
    ("head claims fewer extents", lambda: _head(_good(), ne=3), "extents add up to"),
    ("head claims more replicas", lambda: _head(_good(), nr=9), "replicas add up to 8, the head says 9"),
    ("metadata bytes disagree", lambda: _head(_good(), nm=1), "metadata add up to"),
    ("truncated keys", lambda: _good()[:-10], "run past the end"),
    ("trailing bytes", lambda: _good() + b"xx", "2 bytes follow the end"),
    ("empty key", lambda: _one(key_len=struct.pack("<H", 0)), "item 0: key of 0 bytes"),
    ("key over the limit", lambda: _one(key_len=struct.pack("<H", MAX_KEY_BYTES + 1)),
     f"key of {MAX_KEY_BYTES + 1} bytes"),
    ("key length past the end", lambda: _one(key_len=struct.pack("<H", 900)), "keys (900 bytes"),
    ("value over the limit", lambda: _one(size=struct.pack("<I", MAX_VALUE_BYTES + 1)),
     f"value size {MAX_VALUE_BYTES + 1} is over"),
    ("extents over the limit", lambda: _one(extents=struct.pack("<I", MAX_EXTENTS + 1)),
     f"{MAX_EXTENTS + 1} extents"),
    ("extents disagree with the head", lambda: _one(extents=struct.pack("<I", 2)),
     "extents add up to 2, the head says 1"),
    ("extent over the limit", lambda: _one(ext_len=struct.pack("<I", MAX_VALUE_BYTES + 1)),
     "extent 0: length"),
    ("extent shorter than the value", lambda: _one(ext_len=struct.pack("<I", 4095)),
     "item 0 (key b'k1'): layout extents add up to 4095, not 4096"),
    ("no replicas", lambda: _one(ext_reps=b"\x00"), "extent 0: 0 replicas"),
    ("replicas over the limit", lambda: _one(ext_reps=b"\x11"), "extent 0: 17 replicas"),
    ("chunk id over 63 bits", lambda: _one(chunk=struct.pack("<Q", 2**63)), "replica 0: chunk id"),
    ("chunk id of another server", lambda: _one(server=struct.pack("<I", 2)),
     "replica 0: chunk id 0x10000000003 is chunkserver 1's, not chunkserver 2's"),
    ("server id past what a chunk id names", lambda: _one(server=struct.pack("<I", 1 | 1 << 24)),
     "not chunkserver 16777217's"),
    ("offset over 63 bits", lambda: _one(offset=struct.pack("<Q", 2**64 - 1)), "replica 0: offset"),
    ("metadata over the limit", lambda: _one(meta_len=struct.pack("<I", MAX_META_BYTES + 1)),
     f"metadata of {MAX_META_BYTES + 1} bytes"),
    ("metadata past the end", lambda: _head(_one(meta_len=struct.pack("<I", 50)), nm=50),
     "metadata (50 bytes"),
]


@pytest.mark.parametrize(("blob", "expect"), [(b, e) for _, b, e in BAD], ids=[w for w, _, _ in BAD])
def test_a_malformed_blob_is_refused_naming_what(blob: Callable[[], bytes], expect: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        unpack(blob(), 1.0, None)
    assert "packed layouts (`$.packed`)" in exc.value.message
    assert expect in exc.value.message


def test_every_truncation_is_refused() -> None:
    blob = _good()
    for n in range(len(blob)):
        with pytest.raises(InvalidArgument, match=r"past the end|shorter than"):
            unpack(blob[:n], 1.0, None)
