"""Each batch call of N 64-byte keys (16-byte values) on an in-process cluster: passed, or
the error (bench/RESULTS.md, 2026-12-04).  Usage: python batch-limits-2026-12-04.py N"""

import asyncio
import hashlib
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvfs.launcher import LocalCluster


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        async with LocalCluster(Path(d), 1) as c, c.client() as kv:
            keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(n)]
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("put_many", lambda: kv.put_many([(k, b"v" * 16) for k in keys])),
                ("exists_many", lambda: kv.exists_many(keys)),
                ("match_prefix", lambda: kv.match_prefix(keys)),
                ("get_many", lambda: kv.get_many(keys)),
                ("get_meta", lambda: kv.get_meta(keys)),
                ("delete_many", lambda: kv.delete_many(keys))]
            for name, call in calls:
                t = time.time()
                try:
                    r = await call()
                    summary = r if isinstance(r, int) else len(r)
                    print(name, "ok", summary, round(time.time() - t, 1), "s", flush=True)
                except Exception as e:
                    print(name, "FAILED", type(e).__name__, str(e)[:200], round(time.time() - t, 1), "s",
                          flush=True)


asyncio.run(main(int(sys.argv[1])))
