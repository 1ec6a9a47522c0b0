#!/usr/bin/env bash
set -u
# `kvfs meta backup` of a live meta with N keys, while one client keeps putting 1,024-key
# batches: the backup's wall time, what it printed, the longest gap between two answered
# puts during it and in the 2 s before it, and how many keys the restored copy holds (bench/RESULTS.md, 2026-12-04).
# Usage: N=300000 STORE=rocksdb bash bench/results/meta-backup-2026-12-04.sh
PY=${PY:-python3}; N=${N:-300000}; STORE=${STORE:-sqlite}; PORT=${PORT:-7397}
. "$(dirname "$0")/kvfs-up.sh"; kvfs_up mb --meta-store "$STORE"
$PY - <<PY
import asyncio, hashlib, sys, time, kvfs
async def main():
    async with kvfs.AsyncClient("kvfs://127.0.0.1:$PORT") as c:
        keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range($N)]
        for s in range(0, $N, 1024):
            await c.put_many([(k, b"v" * 16) for k in keys[s:s+1024]])
        stop = asyncio.Event(); gaps = []; more = 0
        async def writer():
            nonlocal more
            last = time.perf_counter()
            while not stop.is_set():
                await c.put_many([(b"w%09d" % (more + j), b"w" * 16) for j in range(1024)])
                more += 1024; now = time.perf_counter(); gaps.append(now - last); last = now
        w = asyncio.create_task(writer())
        await asyncio.sleep(2.0)  # the writer alone first: its gaps without a backup
        alone = max(gaps); gaps.clear()
        t = time.perf_counter()
        p = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvfs", "meta", "backup", "$D/backup",
                                                 "--data", "$D/data/meta", stdout=asyncio.subprocess.PIPE)
        out, _ = await p.communicate()
        wall = time.perf_counter() - t
        stop.set(); await w
        print("$STORE", "N=$N", "backup", round(wall, 2), "s, rc", p.returncode, "|", out.decode().strip().rsplit("(", 1)[-1],
              "| the writer put", more, "keys in all; longest gap between answers", round(max(gaps) * 1000), "ms (in the 2 s before it, alone:",
              round(alone * 1000), "ms)", flush=True)
asyncio.run(main())
PY
kill $UP; wait $UP; du -sh "$D/backup" "$D/data/meta" 2>/dev/null | tr '\n' ' '; echo; rm -rf $D
