#!/usr/bin/env bash
# A drain's effect on other clients: N small values (64-hex names, 16-byte values) on one
# chunkserver; a second joins; then `kvfs gc decommission 1 --wait --repair-rate 0` while a
# client asks meta `exists_many` of one key in a loop, timing each call (bench/RESULTS.md).
# Prints the drain's time and the probe's calls, median, p99 and longest, during the drain.
# Usage: PY=path/to/venv/bin/python N=200000 bash bench/results/drain-stall-2026-12-04.sh
set -u
PY=${PY:-python3}; N=${N:-200000}; PORT=${PORT:-7398}
. "$(dirname "$0")/kvfs-up.sh"; kvfs_up dstall
export KVFS_ADDR=kvfs://127.0.0.1:$PORT
$PY - <<PY
import asyncio, hashlib, kvfs
async def main():
    async with kvfs.AsyncClient("$KVFS_ADDR") as c:
        for s in range(0, $N, 1024):
            await c.put_many([(hashlib.sha256(str(i).encode()).hexdigest().encode(), b"v" * 16)
                              for i in range(s, min($N, s + 1024))])
asyncio.run(main())
PY
mkdir -p "$D/cs2" && cp "$D"/data/{token,admin.token,server.token} "$D/cs2/"
$PY -m kvfs chunkserver --data "$D/cs2" --meta 127.0.0.1:$PORT --listen 127.0.0.1:0 > cs2.log 2>&1 &
CS2=$!
for i in $(seq 100); do $PY -m kvfs stat 2>/dev/null | grep -c "127.0.0.1" | grep -q 2 && break; sleep 0.2; done
$PY - > probe.txt <<PY &
import asyncio, os, time, kvfs
async def main():
    lat = []
    async with kvfs.AsyncClient("$KVFS_ADDR") as c:
        while not os.path.exists("$D/stop"):
            t = time.perf_counter()
            await c.exists_many([b"probe"])
            lat.append(time.perf_counter() - t)
    lat.sort()
    n = len(lat)
    print(f"probe: {n} calls, median {lat[n // 2] * 1e3:.1f} ms, p99 {lat[int(n * 0.99)] * 1e3:.1f} ms, "
          f"longest {lat[-1] * 1e3:.0f} ms")
asyncio.run(main())
PY
PROBE=$!
/usr/bin/time -f "decommission %e s" timeout 600 $PY -m kvfs gc decommission 1 --wait --repair-rate 0 2>&1 | tail -2
touch "$D/stop"; wait $PROBE; cat probe.txt
kill $CS2; wait $CS2; kill $UP; wait $UP
rm -rf "$D"
