"""put_many / exists_many / get_many (twice: the second from the layout cache) / delete_many of N
64-byte keys (16-byte values) on an in-process cluster of one chunkserver, with
ClientConfig(call_max_keys=MK): the cost of the parts a batch call is cut into
(bench/RESULTS.md, 2026-12-04).  Prints N, MK, the call, its seconds and the COMMITs sent so
far.  Usage: python batch-split-ab-2026-12-04.py N MK"""

import asyncio
import hashlib
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvfs.config import ClientConfig
from kvfs.launcher import LocalCluster


async def main(n: int, mk: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        async with LocalCluster(Path(d), 1) as c, c.client(ClientConfig(call_max_keys=mk)) as kv:
            keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(n)]
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("put_many", lambda: kv.put_many([(k, b"v" * 16) for k in keys])),
                ("exists_many", lambda: kv.exists_many(keys)),
                ("get_many", lambda: kv.get_many(keys)),
                ("get_many_cached", lambda: kv.get_many(keys)),
                ("delete_many", lambda: kv.delete_many(keys))]
            for name, call in calls:
                t = time.perf_counter()
                await call()
                print(n, mk, name, round(time.perf_counter() - t, 2), "s",
                      dict(kv.rpc_counts).get("COMMIT"), flush=True)


asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
