#!/usr/bin/env bash
set -u
# put_many (1,024 keys a call) then one delete_many of N keys (64 hex chars, 16-byte values) against a
# real `kvfs up`; prints meta's CPU per key (/proc). The cache A/B ran with a temporary line in
# MetaStore.__init__ (PRAGMA cache_size=$KVFS_XCACHE), not committed (bench/RESULTS.md, 2026-12-04).
# Usage: N=300000 bash bench/results/meta-putdel-2026-12-04.sh
PY=${PY:-python3}; N=${N:-300000}; PORT=7395
. "$(dirname "$0")/kvfs-up.sh"; kvfs_up pd
$PY - <<PY
import asyncio, hashlib, time, kvfs
from kvfs.bench.cpu import cpu_seconds as cpu
async def main():
    async with kvfs.AsyncClient("kvfs://127.0.0.1:$PORT") as c:
        keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range($N)]
        m = cpu($META); t = time.perf_counter()
        for s in range(0, $N, 1024):
            await c.put_many([(k, b"v" * 16) for k in keys[s:s+1024]])
        print("cache=${KVFS_XCACHE:-default} put", round(time.perf_counter() - t, 1), "s meta cpu", round((cpu($META) - m) / $N * 1e6, 1), "us/key", flush=True)
        m = cpu($META); t = time.perf_counter()
        await c.delete_many(keys)
        print("cache=${KVFS_XCACHE:-default} delete", round(time.perf_counter() - t, 1), "s meta cpu", round((cpu($META) - m) / $N * 1e6, 1), "us/key", flush=True)
asyncio.run(main())
PY
kvfs_down
