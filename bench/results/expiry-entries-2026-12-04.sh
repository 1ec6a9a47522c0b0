#!/usr/bin/env bash
set -u
# RocksDB meta's expiry index under overwrites with a TTL: N hashed keys put ROUNDS times in
# 1,024-key batches, each round at a new TTL, against a real `kvfs up --meta-store rocksdb`;
# meta's CPU per put key each round (from /proc), then the expiry entries its store holds
# (meta stopped, the store opened read-only) against the keys that expire (bench/RESULTS.md).
# Usage: N=100000 ROUNDS=5 bash bench/results/expiry-entries-2026-12-04.sh
PY=${PY:-python3}; N=${N:-100000}; ROUNDS=${ROUNDS:-5}; PORT=${PORT:-7398}
. "$(dirname "$0")/kvfs-up.sh"; kvfs_up xe --meta-store rocksdb
$PY - <<PY
import asyncio, hashlib, time, kvfs
from kvfs.bench.cpu import cpu_seconds as cpu
async def main():
    async with kvfs.AsyncClient("kvfs://127.0.0.1:$PORT") as c:
        keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range($N)]
        for r in range($ROUNDS):
            m = cpu($META); t = time.perf_counter()
            for s in range(0, $N, 1024):
                await c.put_many([(k, b"v" * 16) for k in keys[s:s+1024]], ttl=3600.0 + r)
            print("round", r, round(time.perf_counter() - t, 1), "s, meta cpu",
                  round((cpu($META) - m) / $N * 1e6, 1), "us/key", flush=True)
asyncio.run(main())
PY
kill $UP; wait $UP
$PY - <<PY
from pathlib import Path
from kvfs.meta.rocks import EXP, KEY, RocksStore
s = RocksStore(Path("$D/data/meta/meta.rocksdb"), read_only=True)
print("keys", sum(1 for _ in s._prefixed(KEY)), "expiry entries", sum(1 for _ in s._prefixed(EXP)))
s.close()
PY
rm -rf $D
