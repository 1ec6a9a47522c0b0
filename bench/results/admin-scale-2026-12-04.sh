#!/usr/bin/env bash
# Admin commands against one chunkserver holding N small values (64-hex names, 16-byte values):
#   scrub: kvfs gc scrub --rate 0, then kvfs gc fsck
#   drain: a second chunkserver joins, then kvfs gc decommission 1 --wait --repair-rate 0
#   compact: every other key deleted, then kvfs gc run --compact --apply --grace 0
# Usage (bench/RESULTS.md): PY=path/to/venv/bin/python N=1000000 bash bench/results/admin-scale-2026-12-04.sh scrub
set -u
MODE=${1:?scrub or drain}
PY=${PY:-python3}
N=${N:-1000000}
PORT=${PORT:-7391}
. "$(dirname "$0")/kvfs-up.sh"; kvfs_up admin
export KVFS_ADDR=kvfs://127.0.0.1:$PORT
$PY - <<PY
import asyncio, hashlib, time, kvfs
async def main():
    async with kvfs.AsyncClient("$KVFS_ADDR") as c:
        t0=time.time(); n=$N; B=1024
        for s in range(0, n, B):
            await c.put_many([(hashlib.sha256(str(i).encode()).hexdigest().encode(), b"v"*16) for i in range(s, min(n, s+B))])
        print("put", n, "in", round(time.time()-t0,1), "s")
asyncio.run(main())
PY
if [ "$MODE" = compact ]; then
  $PY - <<PY
import asyncio, hashlib, kvfs
async def main():
    async with kvfs.AsyncClient("$KVFS_ADDR") as c:
        for s in range(0, $N, 2048):
            await c.delete_many([hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(s, min($N, s+2048), 2)])
asyncio.run(main())
PY
  $PY -m kvfs stat | tail -3
  /usr/bin/time -f "compact %e s maxrss %M KB" $PY -m kvfs gc run --compact --apply --grace 0 2>&1 | tail -12
  $PY -m kvfs stat | tail -3
  $PY - <<PY
import asyncio, hashlib, kvfs
async def main():
    async with kvfs.AsyncClient("$KVFS_ADDR") as c:
        keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(1, $N, 2)]
        got = [v for s in range(0, len(keys), 4096) for v in await c.get_many(keys[s:s + 4096])]
        print("read back", sum(v == b"v" * 16 for v in got), "of", len(keys), "kept keys intact")
asyncio.run(main())
PY
elif [ "$MODE" = scrub ]; then
  /usr/bin/time -f "scrub %e s maxrss %M KB" $PY -m kvfs gc scrub --rate 0 2>&1 | tail -5
  /usr/bin/time -f "fsck %e s maxrss %M KB" $PY -m kvfs gc fsck 2>&1 | tail -5
else
  mkdir -p "$D/cs2" && cp "$D"/data/{token,admin.token,server.token} "$D/cs2/"
  $PY -m kvfs chunkserver --data "$D/cs2" --meta 127.0.0.1:$PORT --listen 127.0.0.1:0 > cs2.log 2>&1 &
  CS2=$!
  for i in $(seq 100); do $PY -m kvfs stat 2>/dev/null | grep -c "127.0.0.1" | grep -q 2 && break; sleep 0.2; done
  $PY -m kvfs stat | tail -4
  /usr/bin/time -f "decommission %e s maxrss %M KB" timeout 600 $PY -m kvfs gc decommission 1 --wait --repair-rate 0 2>&1 | tail -6
  $PY -m kvfs stat | tail -4
  kill $CS2; wait $CS2
fi
kill $UP; wait $UP
rm -rf "$D"
