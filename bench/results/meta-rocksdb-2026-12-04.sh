#!/usr/bin/env bash
set -u
# Meta's CPU per key on SQLite and on RocksDB (--meta-store): put_many (1,024 keys a call) of N
# keys (64 hex chars, 16-byte values), then exists_many of them, then one delete_many, against
# a real `kvfs up`; meta's CPU from /proc (bench/RESULTS.md, 2026-12-04). meta-putdel-2026-12-04.sh's
# harness, with --meta-store and an exists phase (a dated record of what ran: not shared).
# Usage: N=300000 STORE=rocksdb bash bench/results/meta-rocksdb-2026-12-04.sh
PY=${PY:-python3}; N=${N:-300000}; STORE=${STORE:-sqlite}; PORT=${PORT:-7396}
D=$(mktemp -d /tmp/kvfs-mr.XXXX); cd "$D"
$PY -m kvfs up --data "$D/data" --chunkservers 1 --listen 127.0.0.1:$PORT --no-gc --meta-store "$STORE" > up.log 2>&1 &
UP=$!
for i in $(seq 100); do grep -q "kvfs://" up.log 2>/dev/null && break; sleep 0.2; done
META=$(pgrep -f "kvfs meta --data $D")
$PY - <<PY
import asyncio, hashlib, time, kvfs
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / 100
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
kill $UP; wait $UP; rm -rf $D
