"""Meta's index on Redis Cluster: the :class:`~kvfs.meta.storeapi.MetaStore` of stateless
meta processes (several may serve one store).

Key design
----------
Every key belongs to one of ``buckets`` buckets (CRC-32C of the key, modulo; the count is
fixed when the store is first opened and kept in Redis).  A bucket's structures share
the hash tag ``{NS.B}``, so they live in one hash slot and one Lua script can change
them together:

=================  =====================================================================
``{NS.B}h``        hash key -> ``EXPIRES;CID:BYTES,...|LAYOUT`` (msgpack layout behind a
                   text prefix: its expiry, and the live bytes it adds to each chunk)
``{NS.B}k``        sorted set, every score 0: the keys in byte order (prefix listing)
``{NS.B}a``        sorted set key -> last access (LRU eviction)
``{NS.B}x``        sorted set key -> expires_at (the expiry sweep)
``{NS.B}L``        hash chunk -> live bytes *of this bucket's keys*
``{NS.B}D``        set of retired chunks (every bucket holds the whole set)
``{NS.B}l<key>``   a lease: value = until (meta's clock); Redis expiry removes it
``{NS}cluster``,   cluster id, bucket count, chunkservers (hash), GC state (hash),
``{NS}buckets``,   retired chunks with their time (hash), the retire lock
``{NS}servers``…
=================  =====================================================================

What is atomic
--------------
- Per key, always: a commit, delete, expiry, eviction or relocation changes the layout,
  the indexes and that key's live-bytes contribution in one script.  Relocation and
  eviction are compare-and-swaps on the stored value; a commit or relocation naming a
  retired chunk is refused in the same script (each bucket holds the dead set).
- Per bucket: one script per bucket per call, so the keys of one batch that share a
  bucket commit together.  **A batch spanning buckets is not all-or-nothing**: a
  refused commit (a retired chunk) may leave the batch's other buckets committed.  Each
  committed key is still whole (its bytes were written before the commit).
- A chunk's live bytes are the sum over buckets (read with one pipelined round trip per
  node).  Retiring a chunk marks it dead bucket by bucket, each only if that bucket has
  no live bytes in it, and undoes the marks if any bucket had some; a commit racing it
  is refused by a marked bucket, or makes an unmarked one refuse.  Retires are
  serialised by a lock key (one GC at a time per store).

Time
----
Layouts do not get a Redis expiry: a key Redis dropped by itself would keep its chunk
bytes counted live forever.  Expiry is exact with meta's clock (every read compares
``expires_at``), and the GC sweep removes expired keys from the ``x`` index.  Leases
use Redis expiry only to clean up; whether a lease holds is its value against meta's
clock.

Cost
----
A commit or a lookup is one pipelined round trip per involved node (redis-py sends the
per-node pipelines concurrently).  Listing merges the buckets' ``k`` indexes: each
round fetches a few keys per bucket, ``buckets`` small commands per page, plus one round
trip for the layouts of the page.  The expiry sweep and LRU candidates merge the same
way over ``x`` and ``a``.  :meth:`scan` (GC status, chunk references) reads everything.
"""

from __future__ import annotations

import builtins
import heapq
import math
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import crc32c
import msgpack
from redis.asyncio.cluster import ClusterNode, RedisCluster

from kvfs.address import parse_addr
from kvfs.errors import InvalidArgument, StaleLayout
from kvfs.layout import Layout, decode_layout, encode_layout
from kvfs.meta.index import RECORD_OVERHEAD_BYTES
from kvfs.meta.store import prefix_upper_bound

URL_SCHEME = "redis-cluster://"
DEFAULT_BUCKETS = 256
RETIRE_LOCK_MS = 30_000

# --- Lua ----------------------------------------------------------------------------------
# The value prefix: "EXPIRES;CID:N,CID:N|". Numbers stay strings in Lua (chunk ids exceed
# 2^53); HINCRBY parses them.
_LUA_ADJUST = """
local function contrib(v)
  local semi = string.find(v, ';', 1, true)
  local bar = string.find(v, '|', 1, true)
  return string.sub(v, semi + 1, bar - 1)
end
local function adjust(L, v, sign)
  for cid, nb in string.gmatch(contrib(v), '(%d+):(%d+)') do
    local r
    if sign < 0 then r = redis.call('HINCRBY', L, cid, '-' .. nb)
    else r = redis.call('HINCRBY', L, cid, nb) end
    if r == 0 then redis.call('HDEL', L, cid) end
  end
end
local function dead_in(D, v)
  if redis.call('SCARD', D) == 0 then return false end
  for cid in string.gmatch(contrib(v), '(%d+):%d+') do
    if redis.call('SISMEMBER', D, cid) == 1 then return cid end
  end
  return false
end
"""

# KEYS: h k a x L D; ARGV: now, expires ('' = none), key1, value1, ...
# All or nothing for the bucket: a dead chunk refuses every key of it.
_LUA_COMMIT = _LUA_ADJUST + """
local now, exp = ARGV[1], ARGV[2]
for i = 3, #ARGV, 2 do
  local cid = dead_in(KEYS[6], ARGV[i + 1])
  if cid then return {ARGV[i], cid} end
end
for i = 3, #ARGV, 2 do
  local k, v = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', KEYS[1], k)
  if old then adjust(KEYS[5], old, -1) end
  adjust(KEYS[5], v, 1)
  redis.call('HSET', KEYS[1], k, v)
  redis.call('ZADD', KEYS[2], 0, k)
  redis.call('ZADD', KEYS[3], now, k)
  if exp == '' then redis.call('ZREM', KEYS[4], k) else redis.call('ZADD', KEYS[4], exp, k) end
end
return {}
"""

# KEYS: h k a x L, then one lease key per item; ARGV: mode, now, key1, expected1, ...
# mode 'del': remove; 'exp': remove if still expired at now; 'evict': remove if the value is
# still the expected one and no lease holds past now.  Returns key, value of each removed.
_LUA_REMOVE = _LUA_ADJUST + """
local mode, now = ARGV[1], tonumber(ARGV[2])
local out = {}
local j = 6
for i = 3, #ARGV, 2 do
  local k, want = ARGV[i], ARGV[i + 1]
  local v = redis.call('HGET', KEYS[1], k)
  local ok = v ~= false
  if ok and mode == 'exp' then
    local e = redis.call('ZSCORE', KEYS[4], k)
    ok = e ~= false and tonumber(e) <= now
  elseif ok and mode == 'evict' then
    ok = v == want
    local lease = redis.call('GET', KEYS[j])
    if ok and lease and tonumber(lease) > now then ok = false end
  end
  j = j + 1
  if ok then
    adjust(KEYS[5], v, -1)
    redis.call('HDEL', KEYS[1], k)
    redis.call('ZREM', KEYS[2], k)
    redis.call('ZREM', KEYS[3], k)
    redis.call('ZREM', KEYS[4], k)
    out[#out + 1] = k
    out[#out + 1] = v
  end
end
return out
"""

# KEYS: h L D; ARGV: key1, expected1, new1, ...  Returns 1/0 per item.
_LUA_SWITCH = _LUA_ADJUST + """
local out = {}
for i = 1, #ARGV, 3 do
  local k, want, new = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HGET', KEYS[1], k) == want and not dead_in(KEYS[3], new) then
    adjust(KEYS[2], want, -1)
    adjust(KEYS[2], new, 1)
    redis.call('HSET', KEYS[1], k, new)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# KEYS: L D; ARGV: chunk ids.  Marks dead every chunk this bucket holds no live bytes of;
# returns the ones it does (not marked).
_LUA_RETIRE_MARK = """
local live = {}
for i = 1, #ARGV do
  local n = redis.call('HGET', KEYS[1], ARGV[i])
  if n and tonumber(n) > 0 then live[#live + 1] = ARGV[i]
  else redis.call('SADD', KEYS[2], ARGV[i]) end
end
return live
"""

# KEYS: lease keys; ARGV: until, px.  A lease is only ever lengthened.
_LUA_LEASE = """
for i = 1, #KEYS do
  local cur = redis.call('GET', KEYS[i])
  if not cur or tonumber(cur) < tonumber(ARGV[1]) then
    redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
  end
end
return 0
"""

_LUA_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def parse_url(url: str) -> list[tuple[str, int]]:
    """``redis-cluster://h1:p1,h2:p2,...`` -> the startup nodes."""
    if not url.startswith(URL_SCHEME):
        raise InvalidArgument(f"bad meta store {url!r:.200}: expected {URL_SCHEME}HOST:PORT[,HOST:PORT...]")
    parts = [p for p in url[len(URL_SCHEME):].split(",") if p]
    if not parts:
        raise InvalidArgument(f"bad meta store {url!r:.200}: no HOST:PORT after {URL_SCHEME}")
    return [parse_addr(p, what="redis cluster node") for p in parts]


def _num(x: float) -> str:
    return repr(float(x))


def live_contrib(key: bytes, layout: Layout) -> dict[int, int]:
    """Live bytes a layout adds to each chunk: every replica's extent + record header + key."""
    overhead = RECORD_OVERHEAD_BYTES + len(key)
    out: dict[int, int] = defaultdict(int)
    for cid, n in layout.chunk_bytes():
        out[cid] += n + overhead
    return out


def encode_value(key: bytes, layout: Layout) -> bytes:
    exp = "" if layout.expires_at is None else _num(layout.expires_at)
    contrib = ",".join(f"{c}:{n}" for c, n in live_contrib(key, layout).items())
    return f"{exp};{contrib}|".encode() + encode_layout(layout)


def decode_value(v: bytes) -> Layout:
    return decode_layout(v[v.index(b"|") + 1:])


def value_expired(v: bytes, now: float) -> bool:
    """From the prefix alone (exists / match_prefix decode no layout)."""
    exp = v[:v.index(b";")]
    return bool(exp) and float(exp) <= now


class RedisMetaStore:
    """``url``: ``redis-cluster://h:p,...``; ``namespace`` separates several stores on one
    cluster; ``buckets`` is used when the store is created (an existing one keeps its own)."""

    def __init__(self, url: str, *, namespace: str = "kvfs", buckets: int = DEFAULT_BUCKETS) -> None:
        if not namespace or not namespace.replace("_", "").replace("-", "").isalnum():
            raise InvalidArgument(f"redis namespace must be letters, digits, - or _, got {namespace!r:.80}")
        if not 1 <= buckets <= 65536:
            raise InvalidArgument(f"buckets must be 1..65536, got {buckets}")
        self.nodes = parse_url(url)
        self.ns = namespace
        self.buckets = buckets
        self._r: RedisCluster | None = None
        self._access: dict[bytes, float] = {}
        g = "{" + namespace + "}"
        self._g = {n: (g + n).encode() for n in
                   ("cluster", "buckets", "servers", "state", "dead", "retire_lock")}
        self._tags: builtins.list[bytes] = []

    # lifecycle ------------------------------------------------------------------------
    @property
    def r(self) -> Any:
        """The client (typed Any: redis-py types replies ``bytes | str``; with
        ``decode_responses=False`` they are bytes)."""
        if self._r is None:
            raise RuntimeError("RedisMetaStore used before open()")
        return self._r

    async def open(self) -> None:
        r = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.nodes],
                         decode_responses=False)
        await r.initialize()
        self._r = r
        await self.r.set(self._g["buckets"], str(self.buckets), nx=True)
        self.buckets = int(await self.r.get(self._g["buckets"]))
        self._tags = [f"{{{self.ns}.{b}}}".encode() for b in range(self.buckets)]

    async def close(self) -> None:
        if self._r is not None:
            await self.flush_access()
            await self._r.aclose()
            self._r = None

    async def cluster_id(self, *, create: str | None = None) -> str:
        await self.r.set(self._g["cluster"], create or uuid.uuid4().hex, nx=True)
        return (await self.r.get(self._g["cluster"])).decode()

    # buckets ---------------------------------------------------------------------------
    def bucket(self, key: bytes) -> int:
        return crc32c.crc32c(key) % self.buckets

    def _k(self, b: int, suffix: bytes) -> bytes:
        return self._tags[b] + suffix

    def _by_bucket(self, keys: Sequence[bytes]) -> dict[int, builtins.list[int]]:
        """Bucket -> indexes into ``keys``."""
        out: dict[int, builtins.list[int]] = defaultdict(list)
        nb = self.buckets
        for i, k in enumerate(keys):
            out[crc32c.crc32c(k) % nb].append(i)
        return out

    async def _per_bucket(self, keys: Sequence[bytes], add: Callable[[Any, int, builtins.list[bytes]], None],
                          ) -> builtins.list[tuple[int, builtins.list[int], Any]]:
        """One pipelined call per bucket of ``keys`` (one round trip per node)."""
        groups = self._by_bucket(keys)
        if not groups:
            return []
        p = self.r.pipeline()
        order = []
        for b, idx in groups.items():
            add(p, b, [keys[i] for i in idx])
            order.append((b, idx))
        res = await p.execute()
        return [(b, idx, r) for (b, idx), r in zip(order, res, strict=True)]

    # keys ---------------------------------------------------------------------------------
    async def commit(self, rows: Sequence[tuple[bytes, Layout]], now: float) -> None:
        if not rows:
            return
        keys = [k for k, _ in rows]
        values = {k: encode_value(k, lay) for k, lay in rows}  # the last of a repeated key wins
        exps = {lay.expires_at for _, lay in rows}
        if len(exps) != 1:
            raise InvalidArgument("one commit stamps every layout with one expiry")
        (exp,) = exps
        exp_s = "" if exp is None else _num(exp)

        def add(p: Any, b: int, ks: builtins.list[bytes]) -> None:
            args: builtins.list[bytes | str] = [_num(now), exp_s]
            for k in dict.fromkeys(ks):
                args += [k, values[k]]
            p.eval(_LUA_COMMIT, 6, *(self._k(b, s) for s in (b"h", b"k", b"a", b"x", b"L", b"D")), *args)

        refused = [r for _, _, r in await self._per_bucket(keys, add) if r]
        if refused:
            key, cid = refused[0][0], refused[0][1].decode()
            raise StaleLayout(f"layout for {key[:64]!r} names chunk {cid}, which garbage collection "
                              "already reclaimed (the put took longer than the GC grace period); "
                              "retry the put")
        for k in keys:
            self._access.pop(k, None)

    async def _values(self, keys: Sequence[bytes]) -> builtins.list[bytes | None]:
        out: builtins.list[bytes | None] = [None] * len(keys)
        for _, idx, vals in await self._per_bucket(
                keys, lambda p, b, ks: p.hmget(self._k(b, b"h"), ks)):
            for i, v in zip(idx, vals, strict=True):
                out[i] = v
        return out

    async def lookup(self, keys: Sequence[bytes], now: float) -> builtins.list[Layout | None]:
        out: builtins.list[Layout | None] = []
        for k, v in zip(keys, await self._values(keys), strict=True):
            if v is None or value_expired(v, now):
                out.append(None)
            else:
                out.append(decode_value(v))
                self._access[k] = now
        return out

    async def exists(self, keys: Sequence[bytes], now: float) -> builtins.list[bool]:
        return [v is not None and not value_expired(v, now) for v in await self._values(keys)]

    async def match_prefix(self, keys: Sequence[bytes], now: float,
                           lease_until: float | None = None) -> int:
        n = 0
        for v in await self._values(keys):
            if v is None or value_expired(v, now):
                break
            n += 1
        if lease_until is not None and n:
            px = str(max(1, math.ceil((lease_until - now) * 1000)) + 1000)
            await self._per_bucket(keys[:n], lambda p, b, ks: p.eval(
                _LUA_LEASE, len(ks), *(self._k(b, b"l" + k) for k in ks), _num(lease_until), px))
        return n

    async def _remove(self, mode: str, items: Sequence[tuple[bytes, bytes]],
                      now: float) -> builtins.list[tuple[bytes, Layout]]:
        keys = [k for k, _ in items]
        want = dict(items)

        def add(p: Any, b: int, ks: builtins.list[bytes]) -> None:
            ks = list(dict.fromkeys(ks))
            args: builtins.list[bytes | str] = [mode, _num(now)]
            for k in ks:
                args += [k, want[k]]
            p.eval(_LUA_REMOVE, 5 + len(ks), *(self._k(b, s) for s in (b"h", b"k", b"a", b"x", b"L")),
                   *(self._k(b, b"l" + k) for k in ks), *args)

        out = []
        for _, _, r in await self._per_bucket(keys, add):
            for i in range(0, len(r), 2):
                out.append((r[i], decode_value(r[i + 1])))
                self._access.pop(r[i], None)
        return out

    async def delete(self, keys: Sequence[bytes]) -> builtins.list[tuple[bytes, Layout]]:
        return await self._remove("del", [(k, b"") for k in keys], 0.0)

    async def list(self, prefix: bytes, start_after: bytes | None,
                   limit: int) -> builtins.list[tuple[bytes, Layout]]:
        lo = prefix if start_after is None else max(prefix, start_after + b"\x00")
        hi = prefix_upper_bound(prefix)
        hi_arg = b"+" if hi is None else b"(" + hi

        def fetch(p: Any, b: int, last: Any, m: int) -> None:
            p.zrangebylex(self._k(b, b"k"), b"[" + lo if last is None else b"(" + last, hi_arg,
                          start=0, num=m)

        def parse(r: builtins.list[bytes], last: Any) -> tuple[builtins.list[tuple[Any, Any]], Any]:
            return [(k, k) for k in r], r[-1] if r else last

        keys = await self._merge(fetch, parse, limit, {})
        vals = await self._values(keys)
        return [(k, decode_value(v)) for k, v in zip(keys, vals, strict=True) if v is not None]

    async def _merge(self, fetch: Callable[[Any, int, Any, int], None],
                     parse: Callable[[Any, Any], tuple[builtins.list[tuple[Any, Any]], Any]],
                     limit: int, state: dict[int, Any], skip: Any = None) -> builtins.list[Any]:
        """The first ``limit`` items, in order, of the buckets' sorted indexes merged.

        ``fetch(pipe, bucket, state, m)`` queues a read of up to m items after the bucket's
        resume state (None: from the start); ``parse(reply, state)`` gives (sort key, item)
        pairs and the new state.  Each round refills, in one pipelined call, only the
        buckets whose buffer ran dry, so the output is exact: an item is emitted only
        while every bucket that may hold a smaller one has a buffered head.  Items whose
        sort key is ``<= skip`` are read past, not returned."""
        m = max(8, 2 * limit // self.buckets + 4)
        bufs: dict[int, builtins.list[tuple[Any, Any]]] = {}
        pos: dict[int, int] = {}
        done: set[int] = set()
        need = list(range(self.buckets))
        heap: builtins.list[tuple[Any, int]] = []
        out: builtins.list[Any] = []
        while True:
            if need:
                p = self.r.pipeline()
                for b in need:
                    fetch(p, b, state.get(b), m)
                for b, r in zip(need, await p.execute(), strict=True):
                    items, state[b] = parse(r, state.get(b))
                    if len(r) < m:
                        done.add(b)
                    if items:
                        bufs[b], pos[b] = items, 0
                        heapq.heappush(heap, (items[0][0], b))
                need = []
            while heap and len(out) < limit:
                sk, b = heapq.heappop(heap)
                if skip is None or sk > skip:
                    out.append(bufs[b][pos[b]][1])
                pos[b] += 1
                if pos[b] < len(bufs[b]):
                    heapq.heappush(heap, (bufs[b][pos[b]][0], b))
                elif b not in done:
                    need.append(b)  # refill it before emitting anything larger
                    break
            if len(out) >= limit or not need:
                return out

    async def touch(self, keys: Sequence[bytes], now: float) -> None:
        for k in keys:
            self._access[k] = now

    async def flush_access(self) -> None:
        if not self._access:
            return
        acc, self._access = self._access, {}
        keys = list(acc)
        await self._per_bucket(keys, lambda p, b, ks: p.zadd(
            self._k(b, b"a"), {k: acc[k] for k in ks}, xx=True))

    async def scan(self, batch: int = 1000) -> AsyncIterator[builtins.list[tuple[bytes, Layout]]]:
        for b in range(self.buckets):
            cur = 0
            while True:
                cur, got = await self.r.hscan(self._k(b, b"h"), cur, count=batch)
                if got:
                    yield [(k, decode_value(v)) for k, v in got.items()]
                if cur == 0:
                    break

    async def count(self) -> int:
        p = self.r.pipeline()
        for b in range(self.buckets):
            p.hlen(self._k(b, b"h"))
        return sum(await p.execute())

    # garbage collection ----------------------------------------------------------------
    async def _by_score(self, suffix: bytes, max_score: str, limit: int,
                        after: tuple[float, bytes] | None) -> builtins.list[tuple[bytes, float]]:
        """(key, score) of the lowest scores of the buckets' ``suffix`` sets, merged.  A
        bucket resumes at (last score, how many of that score it has read): ties are
        ordered by key, so the seen ones are skipped by offset."""

        def fetch(p: Any, b: int, st: Any, m: int) -> None:
            lo, seen = ("-inf", 0) if st is None else (_num(st[0]), st[1])
            p.zrangebyscore(self._k(b, suffix), lo, max_score, start=seen, num=m, withscores=True)

        def parse(r: builtins.list[tuple[bytes, float]], st: Any) -> tuple[builtins.list[tuple[Any, Any]], Any]:
            if not r:
                return [], st
            last = r[-1][1]
            tail = sum(1 for _, s in r if s == last)
            if st is not None and st[0] == last and tail == len(r):
                tail += st[1]
            return [((s, k), (k, s)) for k, s in r], (last, tail)

        state: dict[int, Any] = {}
        if after is not None:
            state = dict.fromkeys(range(self.buckets), (after[0], 0))
        return await self._merge(fetch, parse, limit, state, skip=after and (after[0], after[1]))

    async def expired(self, now: float, limit: int) -> builtins.list[bytes]:
        return [k for k, _ in await self._by_score(b"x", _num(now), limit, None)]

    async def remove_expired(self, keys: Sequence[bytes], now: float) -> builtins.list[tuple[bytes, Layout]]:
        return await self._remove("exp", [(k, b"") for k in keys], now)

    async def lru(self, limit: int,
                  after: tuple[float, bytes] | None = None) -> builtins.list[tuple[bytes, float]]:
        return await self._by_score(b"a", "+inf", limit, after)

    async def evict(self, victims: Sequence[tuple[bytes, Layout]], now: float) -> builtins.list[tuple[bytes, Layout]]:
        return await self._remove("evict", [(k, encode_value(k, lay)) for k, lay in victims], now)

    async def chunk_live(self, chunks: Sequence[int] | None = None) -> dict[int, int]:
        p = self.r.pipeline()
        for b in range(self.buckets):
            if chunks is None:
                p.hgetall(self._k(b, b"L"))
            else:
                p.hmget(self._k(b, b"L"), [str(c) for c in chunks])
        total: dict[int, int] = defaultdict(int)
        for r in await p.execute():
            if chunks is None:
                for c, n in r.items():
                    total[int(c)] += int(n)
            else:
                for c, n in zip(chunks, r, strict=True):
                    if n is not None:
                        total[c] += int(n)
        return {c: n for c, n in total.items() if n}

    async def switch(self, rows: Sequence[tuple[bytes, Layout, Layout]]) -> builtins.list[bool]:
        groups = self._by_bucket([k for k, _, _ in rows])
        if not groups:
            return []
        p = self.r.pipeline()
        order = []
        for b, idx in groups.items():
            args: builtins.list[bytes] = []
            for i in idx:
                k, old, new = rows[i]
                args += [k, encode_value(k, old), encode_value(k, new)]
            p.eval(_LUA_SWITCH, 3, self._k(b, b"h"), self._k(b, b"L"), self._k(b, b"D"), *args)
            order.append(idx)
        out = [False] * len(rows)
        for idx, res in zip(order, await p.execute(), strict=True):
            for i, ok in zip(idx, res, strict=True):
                out[i] = bool(ok)
        return out

    async def retire(self, server_id: int, chunks: Sequence[int], now: float) -> builtins.list[int]:
        dead = await self.dead_chunks()
        already = [c for c in chunks if c in dead]
        fresh = [c for c in dict.fromkeys(chunks) if c not in dead]
        if not fresh:
            return already
        token = uuid.uuid4().hex
        lock = self._g["retire_lock"]
        if not await self.r.set(lock, token, nx=True, px=RETIRE_LOCK_MS):
            return already  # another GC is retiring: try again next pass
        try:
            args = [str(c) for c in fresh]
            p = self.r.pipeline()
            for b in range(self.buckets):
                p.eval(_LUA_RETIRE_MARK, 2, self._k(b, b"L"), self._k(b, b"D"), *args)
            live = {int(c) for r in await p.execute() for c in r}
            if live:  # undo: every bucket must refuse nothing of a chunk some key still uses
                undo = [str(c) for c in live]
                p = self.r.pipeline()
                for b in range(self.buckets):
                    p.srem(self._k(b, b"D"), *undo)
                await p.execute()
            retired = [c for c in fresh if c not in live]
            if retired:
                await self.r.hset(self._g["dead"], mapping={
                    str(c): msgpack.packb([server_id, now]) for c in retired})
        finally:
            await self.r.eval(_LUA_UNLOCK, 1, lock, token)
        return already + retired

    async def dead_chunks(self) -> dict[int, float]:
        got = await self.r.hgetall(self._g["dead"])
        return {int(c): float(msgpack.unpackb(v)[1]) for c, v in got.items()}

    # registry and state ----------------------------------------------------------------
    async def servers(self) -> builtins.list[tuple[int, str, int, int]]:
        got = await self.r.hgetall(self._g["servers"])
        out = []
        for sid, v in got.items():
            addr, capacity, free = msgpack.unpackb(v, raw=False)
            out.append((int(sid), addr, int(capacity), int(free)))
        return sorted(out)

    async def put_server(self, server_id: int, addr: str, capacity: int, free: int) -> None:
        await self.r.hset(self._g["servers"], str(server_id),
                          msgpack.packb([addr, capacity, free], use_bin_type=True))

    async def get_state(self, name: str) -> Any:
        v = await self.r.hget(self._g["state"], name)
        return None if v is None else msgpack.unpackb(v, raw=False)

    async def put_state(self, name: str, value: Any) -> None:
        await self.r.hset(self._g["state"], name, msgpack.packb(value, use_bin_type=True))
