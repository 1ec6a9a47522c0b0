#!/usr/bin/env bash
set -u
# Meta's CPU per key on SQLite and on RocksDB (--meta-store): put_many (1,024 keys a call) of N
# keys (64 hex chars, 16-byte values), then exists_many of them, then one delete_many, against
# a real `kvfs up`; meta's CPU from /proc (bench/RESULTS.md, 2026-12-04). meta-putdel-2026-12-04.sh's
# harness, with --meta-store and an exists phase.
# Usage: N=300000 STORE=rocksdb bash bench/results/meta-rocksdb-2026-12-04.sh
PY=${PY:-python3}; N=${N:-300000}; STORE=${STORE:-sqlite}; PORT=${PORT:-7396}
. "$(dirname "$0")/kvfs-up.sh"; kvfs_up mr --meta-store "$STORE"
$PY - <<PY
import asyncio, hashlib, time, kvfs
from kvfs.bench.cpu import cpu_seconds as cpu
async def main():
    async with kvfs.AsyncClient("kvfs://127.0.0.1:$PORT") as c:
        keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range($N)]
        def line(what, t, m):
            print("$STORE", what, round(time.perf_counter() - t, 1), "s, meta cpu",
                  round((cpu($META) - m) / $N * 1e6, 1), "us/key", flush=True)
        m = cpu($META); t = time.perf_counter()
        for s in range(0, $N, 1024):
            await c.put_many([(k, b"v" * 16) for k in keys[s:s+1024]])
        line("put", t, m)
        m = cpu($META); t = time.perf_counter()
        for s in range(0, $N, 1024):
            assert all(await c.exists_many(keys[s:s+1024]))
        line("exists", t, m)
        m = cpu($META); t = time.perf_counter()
        await c.delete_many(keys)
        line("delete", t, m)
asyncio.run(main())
PY
kvfs_down
