#!/usr/bin/env bash
# One put_many / exists_many / get_many / delete_many of N keys (64 hex chars, 16-byte values),
# each one call, against a real `kvfs up` (meta, 1 chunkserver, separate processes; bench/RESULTS.md)
# Usage: PY=path/to/venv/bin/python N=1000000 bash bench/results/batch-split-up-2026-12-04.sh
set -u
PY=${PY:-python3}; N=${N:-1000000}; PORT=${PORT:-7393}
. "$(dirname "$0")/kvfs-up.sh"; kvfs_up big
KVFS_ADDR=kvfs://127.0.0.1:$PORT $PY - <<PY
import asyncio, hashlib, time, gc, kvfs
async def main():
    async with kvfs.AsyncClient("kvfs://127.0.0.1:$PORT") as c:
        keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range($N)]
        for name, call in [("put_many", lambda: c.put_many([(k, b"v" * 16) for k in keys])),
                           ("exists_many", lambda: c.exists_many(keys)),
                           ("get_many", lambda: c.get_many(keys)),
                           ("delete_many", lambda: c.delete_many(keys))]:
            t = time.perf_counter(); r = await call()
            ok = sum(r) if isinstance(r, list) and name != "get_many" else (sum(v == b"v" * 16 for v in r) if isinstance(r, list) else r)
            print(name, $N, "keys:", round(time.perf_counter() - t, 1), "s;", ok, "ok", flush=True)
asyncio.run(main())
PY
kill $UP; wait $UP
rm -rf "$D"
