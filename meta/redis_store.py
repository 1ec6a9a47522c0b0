"""Meta's index on Redis Cluster: the :class:`~kvfs.meta.storeapi.MetaStore` of stateless
meta processes (several may serve one store).

Key design
----------
Every key belongs to one of ``buckets`` buckets (CRC-32C of the key, modulo; the count is
fixed when the store is first opened and kept in Redis).  A bucket's structures share
the hash tag ``{NS.B}``, so they live in one hash slot and one Lua script can change
them together:

=================  =====================================================================
``{NS.B}h``        hash key -> ``EXPIRES;SIZE;CID:BYTES,...|LAYOUT`` (msgpack layout behind
                   a text prefix: its expiry, its size, the live bytes it adds to each chunk)
``{NS.B}k``        sorted set, every score 0: the keys in byte order (prefix listing)
``{NS.B}a``        sorted set key -> last access (LRU eviction)
``{NS.B}x``        sorted set key -> expires_at (the expiry sweep)
``{NS.B}L``        hash chunk -> live bytes *of this bucket's keys*
``{NS.B}c<CID>``   hash: this bucket's keys with a replica in chunk CID -> '' (chunk index)
``{NS.B}s<SID>``   set: the chunks of server SID with live bytes in this bucket
``{NS.B}n``        hash ``bytes`` -> the size of this bucket's values (keys: HLEN of h),
                   ``live:SID`` -> live bytes of this bucket's keys on server SID
``{NS.B}D``        set of retired chunks (every bucket holds the whole set)
``{NS.B}p<key>``   its leases: hash holder -> until (meta's clock); Redis expiry (at the
                   latest until) removes it
``{NS}cluster``,   cluster id, bucket count, the store's format (3: with the indexes
``{NS}buckets``,   above; an older store is refused by name at open), chunkservers
``{NS}servers``…   (hash), GC state (hash), retired chunks with their time, the retire lock
=================  =====================================================================

What is atomic
--------------
Commit, lookup, exists, delete, expiry, eviction, relocation, lease, release, live bytes and
retirement each run **one Lua script per involved node**, covering every bucket of the
call that node serves (Redis 7's ``allow-cross-slot-keys`` script flag: one script may
use keys of several slots, all on its node).  So:

- per key, always: the layout, the indexes (order, LRU, expiry, chunk -> keys, server ->
  chunks), the bytes counter and that key's live-bytes contribution change together: one
  Lua helper (``index``) adds or takes away all a stored value contributes, in the script
  that stores or removes it, and every index structure is in the key's own bucket (slot),
  so no entry is left stale or missing by a race or a crash (a failover loses a script's
  writes whole or not at all: Redis replicates them as one transaction).  Readers still
  check each chunk-index entry against the layout and drop one that does not hold.
  Relocation and eviction compare the stored value; a commit or relocation naming a
  retired chunk is refused in the same script (each bucket holds the dead set);
- per node: the keys of one batch that one master holds commit together, all or none.
  **A batch spanning masters is not all-or-nothing**: a refused commit (a retired chunk)
  may leave the batch's part on other masters committed.  Each committed key is still
  whole (its bytes were written before the commit);
- a chunk's live bytes are the sum over buckets.  Retiring a chunk marks it dead on each
  node only if none of that node's buckets has live bytes in it, and undoes every mark
  if some node had; a commit racing it is refused by a marked node, or makes an
  unmarked one refuse.  Retires are serialised by a lock key (one GC at a time).

A slot that moves (failover, resharding) makes a script fail on its first touch of that
bucket, before it wrote anything (Redis never rolls a script back); the store re-reads
the slot map and sends those buckets again, once, then answers ``Unavailable``.

Every network step (a pipeline to one node, a command, a read of the slot map) is bounded
by ``timeout_s`` (meta's ``--store-timeout``); redis-py retries only a connection the
server closed, once.  A master that stops answering (hung, partitioned) makes a call
fail as ``Unavailable`` after a few steps, never wait on it.  (redis-py's own retries
and re-reads of the slot map took a minute per call on a stopped master.)

Time
----
Layouts do not get a Redis expiry: a key Redis dropped by itself would keep its chunk
bytes counted live forever.  Expiry is exact with meta's clock (every read compares
``expires_at``), and the GC sweep removes expired keys from the ``x`` index.  Leases
use Redis expiry only to clean up (a key's lease hash expires with its latest lease);
whether a holder's lease holds is its value against meta's clock.

Cost
----
A commit or a lookup is one script on each involved node, the nodes called at once:
one round trip (a commit adds one HSET per chunk of each key to the chunk index; the
live bytes, the bytes counter and the server index are summed per bucket and chunk and
written once per script).  Listing merges the buckets' ``k`` indexes: each round fetches
a few keys per bucket (one pipeline per node), plus one round trip for the layouts of the
page.
The expiry sweep and LRU candidates merge the same way over ``x`` and ``a``.
Nothing meta serves reads every key: :meth:`refs` (a compaction's chunk references, repair
plans, drains) reads the chunk and server indexes of every bucket (O(keys named +
buckets)), :meth:`key_stats` and :meth:`server_live` the counters (plus the expired keys
not swept yet), and :meth:`expired_rows` the expiry index.  Only :meth:`scan` reads everything (tests).  The bucket count bounds
how far the store spreads (a bucket is one slot) and what a list page costs; it is
fixed when the store is created.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import heapq
import logging
import math
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import crc32c
import msgpack
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvfs.address import parse_addr
from kvfs.errors import InvalidArgument, StaleLayout, Unavailable
from kvfs.layout import Layout, decode_layout, encode_layout
from kvfs.meta.index import RECORD_OVERHEAD_BYTES
from kvfs.meta.store import prefix_upper_bound
from kvfs.meta.storeapi import OVERFLOW_HOLDER, Lease

T = TypeVar("T")
log = logging.getLogger("kvfs.meta.redis")

URL_SCHEME = "redis-cluster://"
DEFAULT_BUCKETS = 256
RETIRE_LOCK_MS = 30_000
SCAN_MIN_COUNT = 64  # HSCAN's COUNT hint per bucket and round of scan()
ROUND_BUCKETS = 16  # buckets per round (one script per node) of refs() by server: bounds a reply
FORMAT = "3"  # the store's layout: 2 added the chunk and server indexes and the bytes counter,
#               3 each server's live bytes
CLOSE_TIMEOUT_S = 5.0  # close(): each connection's close, and the last access-time flush
HMGET_FIELDS = 4096  # chunks asked per HMGET of the retired set
DEFAULT_TIMEOUT_S = 5.0  # one network step: a pipeline to a node, a command, a slot-map read

# --- Lua ----------------------------------------------------------------------------------
# The value prefix: "EXPIRES;SIZE;CID:N,CID:N|" (N: the live bytes the key adds to the chunk).
# Numbers stay strings in Lua (chunk ids exceed 2^53); HINCRBY parses them.
# index(t, k, v, sign) adds (sign 1) or takes away (-1) everything a stored value contributes
# to its bucket's derived structures, in the script that stores or removes it: the chunk ->
# keys index (c<CID>: a hash, fields the keys, values empty: Redis 7.0 packs a small hash,
# not a small set of strings, into one listpack) at once; the chunk's live bytes (L), the
# server -> chunks index (s<SID>: the chunks with live bytes in this bucket) and the bytes
# counters (n: the values' bytes, and each server's live bytes) summed per bucket and chunk,
# written by flush() once at the script's end.
_LUA_ADJUST = """
local function parts(v)
  local s1 = string.find(v, ';', 1, true)
  local s2 = string.find(v, ';', s1 + 1, true)
  local bar = string.find(v, '|', s2 + 1, true)
  return string.sub(v, s1 + 1, s2 - 1), string.sub(v, s2 + 1, bar - 1)
end
local sids = {}
local function sid_of(cid)
  local got = sids[cid]
  if got then return got end
  local q, r = 0, 0
  for i = 1, #cid do
    r = r * 10 + string.byte(cid, i) - 48
    local d = math.floor(r / 1099511627776)
    q = q * 10 + d
    r = r - d * 1099511627776
  end
  got = string.format('%d', q)
  sids[cid] = got
  return got
end
local live_delta, bytes_delta = {}, {}
local function index(t, k, v, sign)
  local size, con = parts(v)
  local a = live_delta[t]
  if not a then
    a = {}
    live_delta[t] = a
    bytes_delta[t] = 0
  end
  for cid, nb in string.gmatch(con, '(%d+):(%d+)') do
    a[cid] = (a[cid] or 0) + sign * tonumber(nb)
    if sign < 0 then redis.call('HDEL', t .. 'c' .. cid, k)
    else redis.call('HSET', t .. 'c' .. cid, k, '') end
  end
  bytes_delta[t] = bytes_delta[t] + sign * tonumber(size)
end
local function flush()
  for t, a in pairs(live_delta) do
    local L, n = t .. 'L', t .. 'n'
    local per_server = {}
    for cid, d in pairs(a) do
      if d ~= 0 then
        local sid = sid_of(cid)
        per_server[sid] = (per_server[sid] or 0) + d
        local r = redis.call('HINCRBY', L, cid, string.format('%d', d))
        if r == 0 then
          redis.call('HDEL', L, cid)
          redis.call('SREM', t .. 's' .. sid, cid)
        elseif r == d then
          redis.call('SADD', t .. 's' .. sid, cid)
        end
      end
    end
    for sid, d in pairs(per_server) do
      if d ~= 0 then redis.call('HINCRBY', n, 'live:' .. sid, string.format('%d', d)) end
    end
    if bytes_delta[t] ~= 0 then
      redis.call('HINCRBY', n, 'bytes', string.format('%d', bytes_delta[t]))
    end
  end
end
local function dead_in(D, v)
  if redis.call('SCARD', D) == 0 then return false end
  local _, con = parts(v)
  for cid in string.gmatch(con, '(%d+):%d+') do
    if redis.call('SISMEMBER', D, cid) == 1 then return cid end
  end
  return false
end
"""

# The scripts below run once per node for every bucket of a call that node serves
# (Redis 7's allow-cross-slot-keys: one script may use keys of several slots of its node).
# ARGV holds groups: a bucket's tag, its item count n, then n items of a fixed width.
# groups() touches every bucket first, so a bucket whose slot left the node fails the script
# before it wrote anything (Redis does not roll a script back); the caller re-reads the slot
# map and sends that node's buckets again.
_SHEBANG = "#!lua flags=allow-cross-slot-keys\n"
_LUA_GROUPS = """
local function groups(first, width)
  local gs = {}
  local i = first
  while i <= #ARGV do
    local n = tonumber(ARGV[i + 1])
    gs[#gs + 1] = {ARGV[i], i + 2, n}
    i = i + 2 + n * width
  end
  for _, g in ipairs(gs) do redis.call('EXISTS', g[1] .. 'h') end
  return gs
end
"""

# ARGV: groups of keys.  Their stored values, in order (nil: absent).
_LUA_GET = _SHEBANG + _LUA_GROUPS + """
local out = {}
for _, g in ipairs(groups(1, 1)) do
  local h, s, n = g[1] .. 'h', g[2], g[3]
  local j = 0
  while j < n do
    local m = math.min(n - j, 1000)
    local vals = redis.call('HMGET', h, unpack(ARGV, s + j, s + j + m - 1))
    for q = 1, m do out[#out + 1] = vals[q] end
    j = j + m
  end
end
return out
"""

# ARGV: now, expires ('' = none), if_absent ('1' or ''), groups of (key, value).  All or
# nothing for the node: a value naming a dead chunk refuses the whole call there ({0, key,
# chunk} returned).  Otherwise {1, keys not committed...}: with if_absent, a key already
# present and unexpired at now keeps its value.
_LUA_COMMIT = _SHEBANG + _LUA_GROUPS + _LUA_ADJUST + """
local now, exp, absent = ARGV[1], ARGV[2], ARGV[3] == '1'
local gs = groups(4, 2)
for _, g in ipairs(gs) do
  local D = g[1] .. 'D'
  for j = 0, g[3] - 1 do
    local cid = dead_in(D, ARGV[g[2] + 2 * j + 1])
    if cid then return {0, ARGV[g[2] + 2 * j], cid} end
  end
end
local out = {1}
for _, g in ipairs(gs) do
  local t = g[1]
  local h, kk, a, x = t .. 'h', t .. 'k', t .. 'a', t .. 'x'
  for j = 0, g[3] - 1 do
    local k, v = ARGV[g[2] + 2 * j], ARGV[g[2] + 2 * j + 1]
    local old = redis.call('HGET', h, k)
    local keep = false
    if old and absent then
      local e = string.sub(old, 1, string.find(old, ';', 1, true) - 1)
      keep = e == '' or tonumber(e) > tonumber(now)
    end
    if keep then
      out[#out + 1] = k
    else
      if old then index(t, k, old, -1) end
      index(t, k, v, 1)
      redis.call('HSET', h, k, v)
      redis.call('ZADD', kk, 0, k)
      redis.call('ZADD', a, now, k)
      if exp == '' then redis.call('ZREM', x, k) else redis.call('ZADD', x, exp, k) end
    end
  end
end
flush()
return out
"""

# A key's leases (p<key>, hash holder -> until): whether any holder's lasts past now.
_LUA_LEASED = """
local function leased(p, now)
  for _, e in ipairs(redis.call('HVALS', p)) do
    if tonumber(e) > now then return true end
  end
  return false
end
"""

# ARGV: mode, now, groups of (key, expected).  mode 'del': remove; 'exp': remove if still
# expired at now; 'evict': remove if the value is still the expected one and no lease holds
# past now.  Returns key, value of each removed.
_LUA_REMOVE = _SHEBANG + _LUA_GROUPS + _LUA_ADJUST + _LUA_LEASED + """
local mode, now = ARGV[1], tonumber(ARGV[2])
local out = {}
for _, g in ipairs(groups(3, 2)) do
  local t = g[1]
  local h, kk, a, x = t .. 'h', t .. 'k', t .. 'a', t .. 'x'
  for j = 0, g[3] - 1 do
    local k, want = ARGV[g[2] + 2 * j], ARGV[g[2] + 2 * j + 1]
    local v = redis.call('HGET', h, k)
    local ok = v ~= false
    if ok and mode == 'exp' then
      local e = redis.call('ZSCORE', x, k)
      ok = e ~= false and tonumber(e) <= now
    elseif ok and mode == 'evict' then
      ok = v == want
      if ok and leased(t .. 'p' .. k, now) then ok = false end
    end
    if ok then
      index(t, k, v, -1)
      redis.call('HDEL', h, k)
      redis.call('ZREM', kk, k)
      redis.call('ZREM', a, k)
      redis.call('ZREM', x, k)
      out[#out + 1] = k
      out[#out + 1] = v
    end
  end
end
flush()
return out
"""

# ARGV: groups of (key, expected, new).  Returns 1/0 per item, in order.
_LUA_SWITCH = _SHEBANG + _LUA_GROUPS + _LUA_ADJUST + """
local out = {}
for _, g in ipairs(groups(1, 3)) do
  local t = g[1]
  local h, D = t .. 'h', t .. 'D'
  for j = 0, g[3] - 1 do
    local k, want, new = ARGV[g[2] + 3 * j], ARGV[g[2] + 3 * j + 1], ARGV[g[2] + 3 * j + 2]
    if redis.call('HGET', h, k) == want and not dead_in(D, new) then
      index(t, k, want, -1)
      index(t, k, new, 1)
      redis.call('HSET', h, k, new)
      out[#out + 1] = 1
    else
      out[#out + 1] = 0
    end
  end
end
flush()
return out
"""

# ARGV: nc, nc chunk ids, groups of buckets (n = 0).  Marks dead, in every bucket, each chunk
# that no bucket of this node holds live bytes of; returns the others (marked nowhere here).
_LUA_RETIRE_MARK = _SHEBANG + _LUA_GROUPS + """
local nc = tonumber(ARGV[1])
local gs = groups(2 + nc, 0)
local live = {}
for c = 2, 1 + nc do
  local used = false
  for _, g in ipairs(gs) do
    local n = redis.call('HGET', g[1] .. 'L', ARGV[c])
    if n and tonumber(n) > 0 then used = true break end
  end
  if used then live[#live + 1] = ARGV[c]
  else for _, g in ipairs(gs) do redis.call('SADD', g[1] .. 'D', ARGV[c]) end end
end
return live
"""

# ARGV: nc, nc chunk ids (none: every chunk), groups of buckets (n = 0).  Returns chunk,
# live bytes pairs summed over this node's buckets.
_LUA_LIVE = _SHEBANG + _LUA_GROUPS + """
local nc = tonumber(ARGV[1])
local total = {}
for _, g in ipairs(groups(2 + nc, 0)) do
  local L = g[1] .. 'L'
  if nc == 0 then
    local kv = redis.call('HGETALL', L)
    for i = 1, #kv, 2 do total[kv[i]] = (total[kv[i]] or 0) + tonumber(kv[i + 1]) end
  else
    local vals = redis.call('HMGET', L, unpack(ARGV, 2, 1 + nc))
    for i = 1, nc do
      if vals[i] then total[ARGV[1 + i]] = (total[ARGV[1 + i]] or 0) + tonumber(vals[i]) end
    end
  end
end
local out = {}
for c, n in pairs(total) do out[#out + 1] = c out[#out + 1] = string.format('%d', n) end
return out
"""

# ARGV: nc, nc chunk ids, ns, ns server ids, groups of buckets (n = 0).  The chunk index's
# entries in those chunks, and in every chunk of those servers (the server -> chunks index),
# in this node's buckets: {chunk, key, stored value} triples, the value once per key ('' after
# its first triple; false: the key is gone).  The caller checks each against the value.
_LUA_REFS = _SHEBANG + _LUA_GROUPS + """
local nc = tonumber(ARGV[1])
local ns = tonumber(ARGV[2 + nc])
local out = {}
for _, g in ipairs(groups(3 + nc + ns, 0)) do
  local t = g[1]
  local cids = {}
  for i = 2, 1 + nc do cids[#cids + 1] = ARGV[i] end
  for i = 3 + nc, 2 + nc + ns do
    for _, c in ipairs(redis.call('SMEMBERS', t .. 's' .. ARGV[i])) do cids[#cids + 1] = c end
  end
  local sent = {}
  for _, c in ipairs(cids) do
    for _, k in ipairs(redis.call('HKEYS', t .. 'c' .. c)) do
      out[#out + 1] = c
      out[#out + 1] = k
      if sent[k] then out[#out + 1] = '' else
        sent[k] = true
        out[#out + 1] = redis.call('HGET', t .. 'h', k)
      end
    end
  end
end
return out
"""

# ARGV: groups of (key, chunk).  Drops each chunk index entry whose key is gone or no longer
# has a replica in that chunk (checked here, against the stored value); returns how many.
_LUA_UNREF = _SHEBANG + _LUA_GROUPS + _LUA_ADJUST + """
local n = 0
for _, g in ipairs(groups(1, 2)) do
  local t = g[1]
  for j = 0, g[3] - 1 do
    local k, c = ARGV[g[2] + 2 * j], ARGV[g[2] + 2 * j + 1]
    local v = redis.call('HGET', t .. 'h', k)
    local named = false
    if v then
      local _, con = parts(v)
      for cid in string.gmatch(con, '(%d+):%d+') do
        if cid == c then named = true break end
      end
    end
    if not named then n = n + redis.call('HDEL', t .. 'c' .. c, k) end
  end
end
return n
"""

# ARGV: now, groups of buckets (n = 0).  {keys stored, bytes of their values (the n counter),
# keys expired at now (not swept yet)} summed over this node's buckets.
_LUA_STATS = _SHEBANG + _LUA_GROUPS + """
local keys, nbytes, expired = 0, 0, 0
for _, g in ipairs(groups(2, 0)) do
  local t = g[1]
  keys = keys + redis.call('HLEN', t .. 'h')
  nbytes = nbytes + tonumber(redis.call('HGET', t .. 'n', 'bytes') or '0')
  expired = expired + redis.call('ZCOUNT', t .. 'x', '-inf', ARGV[1])
end
return {keys, string.format('%d', nbytes), expired}
"""

# ARGV: ns, ns server ids, groups of buckets (n = 0).  Each server's live bytes (its chunks'
# live bytes, every replica's value + record header + key) summed over this node's buckets,
# in the order asked.
_LUA_SERVER_LIVE = _SHEBANG + _LUA_GROUPS + """
local ns = tonumber(ARGV[1])
local total = {}
for i = 1, ns do total[i] = 0 end
local fields = {}
for i = 1, ns do fields[i] = 'live:' .. ARGV[1 + i] end
for _, g in ipairs(groups(2 + ns, 0)) do
  local vals = redis.call('HMGET', g[1] .. 'n', unpack(fields))
  for i = 1, ns do
    if vals[i] then total[i] = total[i] + tonumber(vals[i]) end
  end
end
for i = 1, ns do total[i] = string.format('%d', total[i]) end
return total
"""

# KEYS: the bucket count's key, the format's.  ARGV: buckets, format.  A new store gets both
# at once; returns {buckets, format (false: a store made before the format was recorded)}.
_LUA_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[2])
end
return {redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}
"""

# ARGV: groups of buckets (n = 0).  Keys stored in this node's buckets.
_LUA_COUNT = _SHEBANG + _LUA_GROUPS + """
local n = 0
for _, g in ipairs(groups(1, 0)) do n = n + redis.call('HLEN', g[1] .. 'h') end
return n
"""

# ARGV: holder, until, now, max holders, overflow holder, px, groups of keys.  The holder's
# lease is only ever lengthened; a key with max holders' unexpired leases besides the
# overflow's gets it as the overflow's (storeapi.Lease).  The hash expires px ms from now
# unless it lasts longer already.  Returns how many keys got the overflow's.
_LUA_LEASE = _SHEBANG + _LUA_GROUPS + """
local holder, untl, now, cap, over = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local px = tonumber(ARGV[6])
local n = 0
for _, g in ipairs(groups(7, 1)) do
  for j = 0, g[3] - 1 do
    local p = g[1] .. 'p' .. ARGV[g[2] + j]
    local h = holder
    if redis.call('HEXISTS', p, h) == 0 and redis.call('HLEN', p) - redis.call('HEXISTS', p, over) >= cap then
      local kv = redis.call('HGETALL', p)
      for i = 1, #kv, 2 do
        if tonumber(kv[i + 1]) <= now then redis.call('HDEL', p, kv[i]) end
      end
      if redis.call('HLEN', p) - redis.call('HEXISTS', p, over) >= cap then
        h = over
        n = n + 1
      end
    end
    local cur = redis.call('HGET', p, h)
    if not cur or tonumber(cur) < untl then redis.call('HSET', p, h, ARGV[2]) end
    if redis.call('PTTL', p) < px then redis.call('PEXPIRE', p, px) end
  end
end
return n
"""

# ARGV: groups of keys.  Per key, in order, the latest end of its holders' leases ('': none).
_LUA_LEASE_ENDS = _SHEBANG + _LUA_GROUPS + """
local out = {}
for _, g in ipairs(groups(1, 1)) do
  for j = 0, g[3] - 1 do
    local best = ''
    for _, e in ipairs(redis.call('HVALS', g[1] .. 'p' .. ARGV[g[2] + j])) do
      if best == '' or tonumber(e) > tonumber(best) then best = e end
    end
    out[#out + 1] = best
  end
end
return out
"""

# KEYS: the lease.  ARGV: holder, ttl ms.  Taken (1) if free or already this holder's.
_LUA_CLAIM = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# ARGV: holder, groups of keys.  Ends the holder's leases of them; returns how many it had.
_LUA_UNLEASE = _SHEBANG + _LUA_GROUPS + """
local n = 0
for _, g in ipairs(groups(2, 1)) do
  for j = 0, g[3] - 1 do n = n + redis.call('HDEL', g[1] .. 'p' .. ARGV[g[2] + j], ARGV[1]) end
end
return n
"""

_LUA_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


_DOWN = (RedisConnectionError, RedisTimeoutError, ClusterError, TryAgainError)


async def _raise(exc: BaseException) -> None:
    raise exc


class _Pipe:
    """Commands queued with redis-py's method names, sent by :meth:`RedisMetaStore._execute`."""

    def __init__(self, store: RedisMetaStore) -> None:
        self.store = store
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        def queue(*args: Any, **kwargs: Any) -> None:
            self.calls.append((name, args, kwargs))
        return queue

    async def execute(self) -> list[Any]:
        return await self.store._execute(self.calls) if self.calls else []


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _server_rows(got: dict[bytes, bytes]) -> list[tuple[int, str, int, int, str]]:
    """The servers hash: (server_id, addr, capacity, free, data dir's key ('' in rows
    stored before keys were)), by id."""
    out = []
    for sid, v in got.items():
        addr, capacity, free, *rest = msgpack.unpackb(v, raw=False)
        out.append((int(sid), addr, int(capacity), int(free), rest[0] if rest else ""))
    return sorted(out)


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
    """``EXPIRES;SIZE;CID:N,...|`` + the msgpack layout: the prefix is what the Lua scripts
    read (expiry, the bytes counter, each chunk's live bytes and index entry)."""
    exp = "" if layout.expires_at is None else _num(layout.expires_at)
    contrib = ",".join(f"{c}:{n}" for c, n in live_contrib(key, layout).items())
    return f"{exp};{layout.size};{contrib}|".encode() + encode_layout(layout)


def decode_value(v: bytes) -> Layout:
    return decode_layout(v[v.index(b"|") + 1:])


def value_expired(v: bytes, now: float) -> bool:
    """From the prefix alone (exists / match_prefix decode no layout)."""
    exp = v[:v.index(b";")]
    return bool(exp) and float(exp) <= now


class RedisMetaStore:
    """``url``: ``redis-cluster://h:p,...``; ``namespace`` separates several stores on one
    cluster; ``buckets`` is used when the store is created (an existing one keeps its own)."""

    def __init__(self, url: str, *, namespace: str = "kvfs", buckets: int = DEFAULT_BUCKETS,
                 timeout_s: float = DEFAULT_TIMEOUT_S, read_old: bool = False) -> None:
        if not namespace or not namespace.replace("_", "").replace("-", "").isalnum():
            raise InvalidArgument(f"redis namespace must be letters, digits, - or _, got {namespace!r:.80}")
        if not 1 <= buckets <= 65536:
            raise InvalidArgument(f"buckets must be 1..65536, got {buckets}")
        if not 0 < timeout_s <= 3600:
            raise InvalidArgument(f"redis timeout (--store-timeout) must be in (0, 3600] seconds, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.read_old = read_old
        self.nodes = parse_url(url)
        self.ns = namespace
        self.buckets = buckets
        self._r: RedisCluster | None = None
        self._access: dict[bytes, float] = {}
        g = "{" + namespace + "}"
        self._g = {n: (g + n).encode() for n in
                   ("cluster", "buckets", "format", "servers", "seen", "state", "dead",
                    "retire_lock", "counts", "claim:")}
        self._tags: builtins.list[bytes] = []
        self._slots: builtins.list[int] = []
        self._clients: dict[str, Redis] = {}  # one plain client per node (see _execute)
        self.leases_overflowed = 0  # leases this object gave the overflow holder (STATS)

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
                         decode_responses=False, **self._conn_opts())
        try:
            await self._bounded(r.initialize())
        except (*_DOWN, RedisClusterException, OSError) as exc:
            await r.aclose()
            nodes = ",".join(f"{h}:{p}" for h, p in self.nodes)
            raise Unavailable(f"redis cluster at {nodes} unreachable: {type(exc).__name__}: {exc}") from exc
        self._r = r
        try:
            await self._check_eviction()
        except BaseException:
            await self.close()
            raise
        buckets, fmt = await self._run(self.r.eval(_LUA_CREATE, 2, self._g["buckets"], self._g["format"],
                                                   str(self.buckets), FORMAT))
        if fmt != FORMAT.encode() and not self.read_old:
            await self.close()
            raise InvalidArgument(
                f"redis store {self.ns!r} has format {fmt.decode() if fmt else '1'}, this kvfs "
                f"needs {FORMAT} (its chunk index and counters); copy it to a new namespace with kvfs meta "
                f"migrate --from URL --from-namespace {self.ns} --to URL --to-namespace NEW")
        self.buckets = int(buckets)
        self._tags = [f"{{{self.ns}.{b}}}".encode() for b in range(self.buckets)]
        self._slots = [key_slot(t) for t in self._tags]

    async def _check_eviction(self) -> None:
        """Refuse a cluster any of whose nodes (masters and replicas: a replica becomes a
        master on failover) may evict keys: ``maxmemory-policy`` other than ``noeviction``.
        Evicted, the store's derived structures go wrong silently: a chunk's live bytes
        (``L``) read as zero and GC reclaims bytes live keys still name; a dropped retired
        set lets a late commit name a reclaimed chunk; a dropped lease lets GC evict a leased
        key; a dropped layout leaves its bytes counted live forever.  No option allows it:
        no policy but ``noeviction`` keeps these, and with ``maxmemory`` 0 (no limit) setting
        it costs nothing.  Read with ``CONFIG GET``, or, where CONFIG is renamed or forbidden
        (managed Redis), ``INFO memory``; a node where neither answers is logged, not
        refused.  A store opened only to be read (``read_old``: a migration's source, the
        way out of such a Redis) gets a warning instead."""
        nodes = builtins.list(self.r.get_nodes())
        got = await asyncio.gather(*(self._eviction_policy(n) for n in nodes))
        bad = [f"{n.name} ({p})" for n, p in zip(nodes, got, strict=True) if p not in (None, "noeviction")]
        unknown = [n.name for n, p in zip(nodes, got, strict=True) if p is None]
        if unknown:
            log.warning("redis store %r: could not read maxmemory-policy of %s (neither CONFIG GET "
                        "nor INFO memory answered): make sure it is noeviction, or Redis may drop "
                        "the store's keys", self.ns, ", ".join(unknown))
        if bad:
            msg = (f"redis store {self.ns!r}: maxmemory-policy is not noeviction on {', '.join(bad)}: "
                   f"Redis may then evict the store's keys (layouts, chunk index, counters, leases) "
                   f"and break it silently; run CONFIG SET maxmemory-policy noeviction on every node "
                   f"(and put it in redis.conf, or the managed service's parameters)")
            if not self.read_old:
                raise InvalidArgument(msg)
            log.warning("%s (read anyway: this store is only read)", msg)

    async def _eviction_policy(self, node: Any) -> str | None:
        """One node's ``maxmemory-policy``; None where it cannot be read."""
        try:
            (cfg,) = await self._node_pipeline(node, [("config_get", ("maxmemory-policy",), {})])
            if isinstance(cfg, dict) and cfg:
                return _text(next(iter(cfg.values())))
            (info,) = await self._node_pipeline(node, [("info", ("memory",), {})])
            if isinstance(info, dict) and "maxmemory_policy" in info:
                return _text(info["maxmemory_policy"])
        except (*_DOWN, OSError):
            pass
        return None

    async def close(self) -> None:
        """Write the buffered access times, then close every connection, each step bounded
        by ``CLOSE_TIMEOUT_S`` (redis-py waits for a closing socket without a timeout; a
        test cluster's stop over Redis stalled in a few suite runs, where exactly not found:
        a timer here bounds it)."""
        if self._r is not None:
            r = self._r
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self.flush_access()
            except (TimeoutError, Unavailable):
                pass  # access times are a hint (LRU): lose them rather than hang
            self._r = None
            closing: builtins.list[Any] = [*self._clients.values(), r]
            for c in closing:
                with contextlib.suppress(TimeoutError, *_DOWN, OSError):
                    async with asyncio.timeout(CLOSE_TIMEOUT_S):
                        await c.aclose()
            self._clients.clear()

    def _pipe(self) -> _Pipe:
        return _Pipe(self)

    def _conn_opts(self) -> dict[str, Any]:
        """Every connection's timeouts; inside redis-py one retry, at once, and only of a
        connection the server closed (a pooled one to a node that restarted), never of a
        timeout: the store sends a moved bucket again itself, and anything else is the
        caller's ``Unavailable``.  (No retry at all failed the first call after a local
        cluster's restart: tests/test_up.py.)"""
        return {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s,
                "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))}

    async def _bounded(self, aw: Awaitable[T]) -> T:
        """One network step, at most ``timeout_s``: past it, redis-py's ``TimeoutError``
        (so :class:`Unavailable` from :meth:`_run`).  The socket timeouts bound a read and
        a connect; this bounds the rest (a slot-map read that tries node after node)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await aw
        except TimeoutError:
            raise RedisTimeoutError(f"no answer within {self.timeout_s:g} s") from None

    async def _reread_slots(self) -> None:
        """Read the slot map again (after a failover or a move); a failure is left to the
        next call."""
        with contextlib.suppress(*_DOWN, OSError):
            await self._bounded(self.r.nodes_manager.initialize())

    async def _execute(self, calls: builtins.list[tuple[str, tuple[Any, ...], dict[str, Any]]],
                       ) -> builtins.list[Any]:
        """Send queued commands as one plain pipeline per node, all nodes at once.

        Every command names one bucket's key (an EVAL its first key), so its node is that
        slot's master in redis-py's slot map.  redis-py's own cluster pipeline does the
        same at several times the client CPU per command (it resolves a routing policy
        per command).  Failover and resharding as in :meth:`_by_owner`."""
        out: builtins.list[Any] = [None] * len(calls)

        async def send(node: Any, idx: builtins.list[int]) -> builtins.list[tuple[builtins.list[int], Any]]:
            return [([i], r) for i, r in zip(idx, await self._node_pipeline(node, [calls[i] for i in idx]),
                                             strict=True)]

        for (i,), r in await self._by_owner(
                builtins.list(range(len(calls))),
                lambda i: key_slot(calls[i][1][2] if calls[i][0] == "eval" else calls[i][1][0]), send):
            out[i] = r
        return out

    async def _by_owner(self, todo: builtins.list[int], slot: Callable[[int], int],
                        send: Callable[[Any, builtins.list[int]],
                                       Awaitable[builtins.list[tuple[builtins.list[int], Any]]]],
                        ) -> builtins.list[tuple[builtins.list[int], Any]]:
        """Send the units ``todo`` (commands, buckets) grouped by the master of each one's
        ``slot``, all nodes at once: ``send(node, units)`` answers (units, reply) pairs.  Units
        whose reply says their slot moved (failover, resharding) are sent again, once, after
        the slot map is read again; a node unreachable or another error reply is raised
        (:class:`Unavailable` for the cluster's own faults: the caller retries, every script
        is safe to run again).  Returns the other pairs, in no set order."""
        out: builtins.list[tuple[builtins.list[int], Any]] = []
        nm = self.r.nodes_manager
        for _attempt in range(2):
            by_node: dict[str, tuple[Any, builtins.list[int]]] = {}
            for u in todo:
                node = nm.get_node_from_slot(slot(u))
                by_node.setdefault(node.name, (node, []))[1].append(u)
            results = await asyncio.gather(*(send(node, us) for node, us in by_node.values()),
                                           return_exceptions=True)
            moved: builtins.list[int] = []
            for res in results:
                if isinstance(res, BaseException):
                    await self._run(_raise(res))
                    continue
                for us, r in res:
                    if isinstance(r, (MovedError, AskError, TryAgainError, ClusterDownError)) or (
                            isinstance(r, ResponseError) and ("non local key" in str(r)
                                                              or "cluster is down" in str(r))):
                        moved += us
                    elif isinstance(r, Exception):
                        await self._run(_raise(r))
                    else:
                        out.append((us, r))
            if not moved:
                return out
            await self._reread_slots()
            todo = moved
        raise Unavailable("redis cluster: slots still moving (failover, resharding) or the "
                          "cluster is down; retry")

    async def _node_pipeline(self, node: Any,
                             calls: builtins.list[tuple[str, tuple[Any, ...], dict[str, Any]]],
                             ) -> builtins.list[Any]:
        client = self._clients.get(node.name)
        if client is None:
            client = self._clients[node.name] = Redis(host=node.host, port=node.port,
                                                      decode_responses=False, **self._conn_opts())
        p = client.pipeline(transaction=False)
        for name, args, kwargs in calls:
            getattr(p, name)(*args, **kwargs)
        return builtins.list(await self._bounded(p.execute(raise_on_error=False)))

    async def _run(self, aw: Awaitable[T]) -> T:
        """A Redis call; the cluster unreachable or failing over is :class:`Unavailable`,
        and the slot map is read again (redis-py's pipelines keep sending a dead master's
        slots to it otherwise), so the call after a failover reaches the new master."""
        try:
            return await self._bounded(aw)
        except _DOWN as exc:
            await self._reread_slots()
            raise Unavailable(f"redis cluster: {type(exc).__name__}: {exc}") from exc

    async def cluster_id(self, *, create: str | None = None) -> str:
        await self._run(self.r.set(self._g["cluster"], create or uuid.uuid4().hex, nx=True))
        return (await self._run(self.r.get(self._g["cluster"]))).decode()

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
        """One pipelined command per bucket of ``keys`` (one round trip per node)."""
        groups = self._by_bucket(keys)
        if not groups:
            return []
        p = self._pipe()
        order = []
        for b, idx in groups.items():
            add(p, b, [keys[i] for i in idx])
            order.append((b, idx))
        res = await self._run(p.execute())
        return [(b, idx, r) for (b, idx), r in zip(order, res, strict=True)]

    async def _per_node(self, script: str, head: Sequence[Any], items: dict[int, builtins.list[Any]],
                        width: int) -> builtins.list[tuple[builtins.list[int], Any]]:
        """One EVAL of ``script`` per node for all of ``items``' buckets it serves (bucket ->
        flat items, ``width`` values each), all nodes at once; (buckets in the order sent,
        reply) per node.  A node whose buckets moved away answers with an error before
        writing; those buckets are sent again, once, after the slot map is read again."""

        async def send(node: Any, bs: builtins.list[int]) -> builtins.list[tuple[builtins.list[int], Any]]:
            args: builtins.list[Any] = [*head]
            for b in bs:
                args += [self._tags[b], len(items[b]) // width, *items[b]]
            (reply,) = await self._node_pipeline(node, [("eval", (script, 0, *args), {})])
            return [(bs, reply)]

        return await self._by_owner(builtins.list(items), self._slots.__getitem__, send)

    def _all_buckets(self) -> dict[int, builtins.list[Any]]:
        return {b: [] for b in range(self.buckets)}

    # keys ---------------------------------------------------------------------------------
    async def commit(self, rows: Sequence[tuple[bytes, Layout]], now: float, *,
                     if_absent: bool = False) -> builtins.list[int]:
        if not rows:
            return []
        exps = {lay.expires_at for _, lay in rows}
        if len(exps) != 1:
            raise InvalidArgument("one commit stamps every layout with one expiry")
        (exp,) = exps
        values: dict[bytes, bytes] = {}
        first: dict[bytes, int] = {}  # if_absent: the first of a repeated key is the one tried
        for i, (k, lay) in enumerate(rows):
            if not if_absent or k not in values:  # else the last of a repeated key wins
                values[k] = encode_value(k, lay)
                first[k] = i
        items: dict[int, builtins.list[Any]] = defaultdict(list)
        nb = self.buckets
        for k, v in values.items():
            items[crc32c.crc32c(k) % nb] += (k, v)
        head = [_num(now), "" if exp is None else _num(exp), "1" if if_absent else ""]
        replies = [r for _, r in await self._per_node(_LUA_COMMIT, head, items, 2)]
        refused = [r for r in replies if not r[0]]
        if refused:
            key, cid = refused[0][1], refused[0][2].decode()
            raise StaleLayout(f"layout for {key[:64]!r} names chunk {cid}, which garbage collection "
                              "already reclaimed (the put took longer than the GC grace period); "
                              "retry the put")
        kept = {k for r in replies for k in r[1:]}
        for k in values:
            if k not in kept:
                self._access.pop(k, None)
        return [i for i, (k, _) in enumerate(rows) if k in kept or first[k] != i]

    async def _values(self, keys: Sequence[bytes]) -> builtins.list[bytes | None]:
        groups = self._by_bucket(keys)
        items = {b: [keys[i] for i in idx] for b, idx in groups.items()}
        out: builtins.list[bytes | None] = [None] * len(keys)
        for bs, vals in await self._per_node(_LUA_GET, (), items, 1):
            it = iter(vals)
            for b in bs:
                for i in groups[b]:
                    out[i] = next(it)
        return out

    async def lookup(self, keys: Sequence[bytes], now: float,
                     lease: Lease | None = None) -> builtins.list[Layout | None]:
        out: builtins.list[Layout | None] = []
        for k, v in zip(keys, await self._values(keys), strict=True):
            if v is None or value_expired(v, now):
                out.append(None)
            else:
                out.append(decode_value(v))
                self._access[k] = now
        if lease is not None:
            await self.lease([k for k, lay in zip(keys, out, strict=True) if lay is not None], now,
                             lease)
        return out

    async def peek(self, keys: Sequence[bytes], now: float) -> builtins.list[Layout | None]:
        """Layouts of unexpired keys, recording no access."""
        return [None if v is None or value_expired(v, now) else decode_value(v)
                for v in await self._values(keys)]

    async def exists(self, keys: Sequence[bytes], now: float,
                     lease: Lease | None = None) -> builtins.list[bool]:
        out = [v is not None and not value_expired(v, now) for v in await self._values(keys)]
        if lease is not None:
            await self.lease([k for k, ok in zip(keys, out, strict=True) if ok], now, lease)
        return out

    async def get(self, keys: Sequence[bytes]) -> builtins.list[Layout | None]:
        """Stored layouts, expired ones included, recording no access (GC)."""
        return [None if v is None else decode_value(v) for v in await self._values(keys)]

    async def leases(self, keys: Sequence[bytes]) -> dict[bytes, float]:
        """key -> the latest end (meta's clock) of its holders' leases, of those of ``keys``
        with a lease hash left."""
        groups = self._by_bucket(keys)
        items = {b: [keys[i] for i in idx] for b, idx in groups.items()}
        out: dict[bytes, float] = {}
        for bs, ends in await self._per_node(_LUA_LEASE_ENDS, (), items, 1):
            it = iter(ends)
            for b in bs:
                for i in groups[b]:
                    end = next(it)
                    if end:
                        out[keys[i]] = float(end)
        return out

    async def match_prefix(self, keys: Sequence[bytes], now: float,
                           lease: Lease | None = None) -> int:
        n = 0
        for v in await self._values(keys):
            if v is None or value_expired(v, now):
                break
            n += 1
        if lease is not None:
            await self.lease(keys[:n], now, lease)
        return n

    async def lease(self, keys: Sequence[bytes], now: float, lease: Lease) -> None:
        if not keys:
            return
        px = str(max(1, math.ceil((lease.until - now) * 1000)) + 1000)
        groups = self._by_bucket(keys)
        got = await self._per_node(_LUA_LEASE, [lease.holder, _num(lease.until), _num(now),
                                                str(lease.max_holders), OVERFLOW_HOLDER, px],
                                   {b: [keys[i] for i in idx] for b, idx in groups.items()}, 1)
        self.leases_overflowed += sum(int(n) for _, n in got)

    async def release(self, keys: Sequence[bytes], holder: str) -> int:
        groups = self._by_bucket(keys)
        items = {b: [keys[i] for i in idx] for b, idx in groups.items()}
        return sum(int(r) for _, r in await self._per_node(_LUA_UNLEASE, (holder,), items, 1))

    async def _remove(self, mode: str, items: Sequence[tuple[bytes, bytes]],
                      now: float) -> builtins.list[tuple[bytes, Layout]]:
        groups: dict[int, builtins.list[Any]] = defaultdict(list)
        nb = self.buckets
        for k, want in dict(items).items():
            groups[crc32c.crc32c(k) % nb] += (k, want)
        out = []
        for _, r in await self._per_node(_LUA_REMOVE, [mode, _num(now)], groups, 2):
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
                p = self._pipe()
                for b in need:
                    fetch(p, b, state.get(b), m)
                for b, r in zip(need, await self._run(p.execute()), strict=True):
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
        """Rounds of one pipelined HSCAN per unfinished bucket (one round trip per node each)."""
        cursors = dict.fromkeys(range(self.buckets), 0)
        while cursors:
            order = builtins.list(cursors)
            count = max(SCAN_MIN_COUNT, batch // len(order))
            p = self._pipe()
            for b in order:
                p.hscan(self._k(b, b"h"), cursors[b], count=count)
            rows: builtins.list[tuple[bytes, Layout]] = []
            for b, (cur, got) in zip(order, await self._run(p.execute()), strict=True):
                rows += [(k, decode_value(v)) for k, v in got.items()]
                if cur == 0:
                    del cursors[b]
                else:
                    cursors[b] = cur
            if rows:
                yield rows

    async def count(self) -> int:
        return sum(int(r) for _, r in await self._per_node(_LUA_COUNT, (), self._all_buckets(), 1))

    async def key_stats(self, now: float) -> tuple[int, int, int]:
        """(unexpired keys, stored keys, bytes of the unexpired values): the per-bucket key
        counts (HLEN) and bytes counters, one script per node, less the keys expired at
        ``now`` that the GC has not swept yet, read through the expiry index
        (:meth:`expired_rows`: O(those keys), none read when there are none)."""
        stored = nbytes = expired = 0
        for _, (n, b, e) in await self._per_node(_LUA_STATS, [_num(now)], self._all_buckets(), 1):
            stored, nbytes, expired = stored + int(n), nbytes + int(b), expired + int(e)
        gone = 0
        if expired:
            async for rows in self.expired_rows(now):
                gone += len(rows)
                nbytes -= sum(lay.size for _, lay in rows)
        return stored - gone, stored, nbytes

    async def server_live(self, servers: Iterable[int]) -> dict[int, int]:
        """Live bytes on each of ``servers`` (``kvfs stat``, ``kvfs gc status``): the
        per-bucket counters, one script per node, whatever the keys and chunks."""
        ss = builtins.list(dict.fromkeys(servers))
        if not ss:
            return {}
        total = dict.fromkeys(ss, 0)
        for _, r in await self._per_node(_LUA_SERVER_LIVE, [len(ss), *(str(x) for x in ss)],
                                         self._all_buckets(), 1):
            for sid, v in zip(ss, r, strict=True):
                total[sid] += int(v)
        return total

    async def expired_rows(self, now: float, batch: int = 1000,
                           ) -> AsyncIterator[builtins.list[tuple[bytes, Layout]]]:
        """Every key expired at ``now`` (not swept yet) with its layout, in batches of about
        ``batch``: each round reads a page of each unfinished bucket's expiry index (one
        pipeline) and then their values: O(expired keys + buckets), never the other keys.
        Not a snapshot: keys swept or written meanwhile may be missed or seen twice."""
        offsets = dict.fromkeys(range(self.buckets), 0)
        m = max(SCAN_MIN_COUNT, batch // self.buckets)
        while offsets:
            order = builtins.list(offsets)
            p = self._pipe()
            for b in order:
                p.zrangebyscore(self._k(b, b"x"), "-inf", _num(now), start=offsets[b], num=m)
            keys: builtins.list[bytes] = []
            for b, got in zip(order, await self._run(p.execute()), strict=True):
                keys += got
                if len(got) < m:
                    del offsets[b]
                else:
                    offsets[b] += m
            if keys:
                rows = [(k, decode_value(v)) for k, v in zip(keys, await self._values(keys), strict=True)
                        if v is not None]
                yield [(k, lay) for k, lay in rows if lay.expired(now)]

    async def refs(self, chunks: Iterable[int] = (), servers: Iterable[int] = (),
                   ) -> AsyncGenerator[builtins.list[tuple[bytes, Layout]], None]:
        """Every stored key (expired ones included) with a replica in one of ``chunks`` or on
        one of ``servers``, with its layout, each once, read from the chunk index
        (``{NS.B}c<CID>``) and the server index (``{NS.B}s<SID>``): one script per node (for
        servers, per round of ``ROUND_BUCKETS`` buckets, as a server's keys may be many),
        O(the keys named + buckets), never the others.

        The index changes in the same script as the layout, so it is exact; still, each entry
        is checked against the stored layout, and one that no longer holds (the key gone, or
        not in that chunk any more: a hand edit, a bug) is never returned, and is dropped
        (a compare-and-delete against the value)."""
        cs = [str(c) for c in dict.fromkeys(chunks)]
        ss = [str(sid) for sid in dict.fromkeys(servers)]
        if not cs and not ss:
            return
        head = [len(cs), *cs, len(ss), *ss]
        step = ROUND_BUCKETS if ss else self.buckets  # given chunks only: their keys, one round
        for lo in range(0, self.buckets, step):
            part: dict[int, builtins.list[Any]] = {b: [] for b in range(lo, min(lo + step, self.buckets))}
            rows: dict[bytes, Layout] = {}
            stale: dict[int, builtins.list[Any]] = defaultdict(list)
            for _, r in await self._per_node(_LUA_REFS, head, part, 1):
                values: dict[bytes, bytes | None] = {}
                for i in range(0, len(r), 3):
                    c, k, v = int(r[i]), r[i + 1], r[i + 2]
                    if v != b"":
                        values[k] = v
                    v = values.get(k)
                    lay = None if v is None else decode_value(v)
                    if lay is not None and any(rep.chunk_id == c for x in lay.extents for rep in x.replicas):
                        rows[k] = lay
                    else:
                        stale[self.bucket(k)] += (k, str(c))
            if stale:
                dropped = sum(int(n) for _, n in await self._per_node(_LUA_UNREF, (), stale, 2))
                log.warning("redis store %s: dropped %d chunk index entries that no longer held",
                            self.ns, dropped)
            if rows:
                yield builtins.list(rows.items())

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
        head = [0] if chunks is None else [len(chunks), *(str(c) for c in chunks)]
        total: dict[int, int] = defaultdict(int)
        for _, r in await self._per_node(_LUA_LIVE, head, self._all_buckets(), 1):
            for i in range(0, len(r), 2):
                total[int(r[i])] += int(r[i + 1])
        return {c: n for c, n in total.items() if n}

    async def switch(self, rows: Sequence[tuple[bytes, Layout, Layout]]) -> builtins.list[bool]:
        groups = self._by_bucket([k for k, _, _ in rows])
        items: dict[int, builtins.list[Any]] = {}
        for b, idx in groups.items():
            items[b] = []
            for i in idx:
                k, old, new = rows[i]
                items[b] += (k, encode_value(k, old), encode_value(k, new))
        out = [False] * len(rows)
        for bs, res in await self._per_node(_LUA_SWITCH, (), items, 3):
            it = iter(res)
            for b in bs:
                for i in groups[b]:
                    out[i] = bool(next(it))
        return out

    async def retire(self, server_id: int, chunks: Sequence[int], now: float) -> builtins.list[int]:
        dead = await self.retired_among(chunks)
        already = [c for c in chunks if c in dead]
        fresh = [c for c in dict.fromkeys(chunks) if c not in dead]
        if not fresh:
            return already
        token = uuid.uuid4().hex
        lock = self._g["retire_lock"]
        if not await self._run(self.r.set(lock, token, nx=True, px=RETIRE_LOCK_MS)):
            return already  # another GC is retiring: try again next pass
        try:
            head = [len(fresh), *(str(c) for c in fresh)]
            live = {int(c) for _, r in await self._per_node(_LUA_RETIRE_MARK, head,
                                                            self._all_buckets(), 1) for c in r}
            if live:  # undo: every bucket must refuse nothing of a chunk some key still uses
                undo = [str(c) for c in live]
                p = self._pipe()
                for b in range(self.buckets):
                    p.srem(self._k(b, b"D"), *undo)
                await self._run(p.execute())
            retired = [c for c in fresh if c not in live]
            if retired:
                await self._run(self.r.hset(self._g["dead"], mapping={
                    str(c): msgpack.packb([server_id, now]) for c in retired}))
        finally:
            await self._run(self.r.eval(_LUA_UNLOCK, 1, lock, token))
        return already + retired

    async def dead_chunks(self) -> dict[int, float]:
        got = await self._run(self.r.hgetall(self._g["dead"]))
        return {int(c): float(msgpack.unpackb(v)[1]) for c, v in got.items()}

    async def retired_among(self, chunks: Iterable[int]) -> set[int]:
        """HMGET of just these chunks (in pieces of ``HMGET_FIELDS``, one pipeline), not the
        whole retired set, which only grows."""
        cs = builtins.list(dict.fromkeys(chunks))
        if not cs:
            return set()
        p = self._pipe()
        for i in range(0, len(cs), HMGET_FIELDS):
            p.hmget(self._g["dead"], [str(c) for c in cs[i:i + HMGET_FIELDS]])
        got = [v for part in await self._run(p.execute()) for v in part]
        return {c for c, v in zip(cs, got, strict=True) if v is not None}

    async def retired_count(self) -> int:
        return int(await self._run(self.r.hlen(self._g["dead"])))

    async def dead_rows(self) -> builtins.list[tuple[int, int, float]]:
        """(chunk, server_id, retired_at) of every retired chunk (``kvfs meta migrate``)."""
        got = await self._run(self.r.hgetall(self._g["dead"]))
        return sorted((int(c), int(sid), float(at)) for c, (sid, at) in
                      ((c, msgpack.unpackb(v)) for c, v in got.items()))

    # registry and state ----------------------------------------------------------------
    async def servers(self) -> builtins.list[tuple[int, str, int, int]]:
        got = await self._run(self.r.hgetall(self._g["servers"]))
        return [row[:4] for row in _server_rows(got)]

    async def registry(self) -> tuple[builtins.list[tuple[int, str, int, int, str]], dict[int, float]]:
        """Both hashes in one pipeline (one hash tag: one node, one round trip)."""
        p = self._pipe()
        p.hgetall(self._g["servers"])
        p.hgetall(self._g["seen"])
        servers, seen = await self._run(p.execute())
        return _server_rows(servers), {int(sid): float(t) for sid, t in seen.items()}

    async def put_server(self, server_id: int, addr: str, capacity: int, free: int, key: str = "") -> None:
        """``key``: the chunkserver's data-dir key (only that data dir may move the id)."""
        await self._run(self.r.hset(self._g["servers"], str(server_id),
                          msgpack.packb([addr, capacity, free, key], use_bin_type=True)))

    async def claim_server(self, server_id: int, addr: str) -> bool:
        """Register ``server_id`` at ``addr`` only if no server has that id (HSETNX)."""
        return bool(await self._run(self.r.hsetnx(self._g["servers"], str(server_id),
                                                  msgpack.packb([addr, 0, 0], use_bin_type=True))))

    async def put_seen(self, server_id: int, at: float) -> None:
        await self._run(self.r.hset(self._g["seen"], str(server_id), _num(at)))

    async def delete_server(self, server_id: int) -> None:
        p = self._pipe()
        p.hdel(self._g["servers"], str(server_id))
        p.hdel(self._g["seen"], str(server_id))
        await self._run(p.execute())

    async def add_counts(self, inc: dict[str, float], put: dict[str, float] | None = None) -> None:
        """GC's counters: one hash, HINCRBYFLOAT (several metas add to it at once)."""
        p = self._pipe()
        for k, v in inc.items():
            p.hincrbyfloat(self._g["counts"], k, v)
        if put:
            p.hset(self._g["counts"], mapping={k: _num(v) for k, v in put.items()})
        await self._run(p.execute())

    async def counts(self) -> dict[str, float]:
        got = await self._run(self.r.hgetall(self._g["counts"]))
        out: dict[str, float] = {}
        for k, v in got.items():
            x = float(v)
            out[k.decode()] = int(x) if x.is_integer() else x  # counts print as integers
        return out

    async def claim(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the lease ``name`` for ``holder`` (a key with a Redis expiry)."""
        key = self._g["claim:"] + name.encode()
        return bool(await self._run(self.r.eval(_LUA_CLAIM, 1, key, holder,
                                                str(max(1, math.ceil(ttl_s * 1000))))))

    async def get_state(self, name: str) -> Any:
        v = await self._run(self.r.hget(self._g["state"], name))
        return None if v is None else msgpack.unpackb(v, raw=False)

    async def all_state(self) -> dict[str, Any]:
        got = await self._run(self.r.hgetall(self._g["state"]))
        return {n.decode(): msgpack.unpackb(v, raw=False) for n, v in got.items()}

    async def put_state(self, name: str, value: Any) -> None:
        await self._run(self.r.hset(self._g["state"], name, msgpack.packb(value, use_bin_type=True)))
