"""One batch call past meta's --max-header while 8 tasks make small calls on the same
client: how many of the small ones fail (bench/RESULTS.md, 2026-12-04)."""

import asyncio
import hashlib
import tempfile
from pathlib import Path

from kvfs.launcher import LocalCluster


async def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        async with LocalCluster(Path(d), 1) as c, c.client() as kv:
            await kv.put_many([(b"small%d" % i, b"x" * 100) for i in range(100)])
            big = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(400000)]
            stop = False
            ok = bad = 0
            errs: set[str] = set()

            async def small() -> None:
                nonlocal ok, bad
                while not stop:
                    try:
                        r = await kv.exists_many([b"small%d" % i for i in range(100)])
                        ok += all(r)
                    except Exception as e:
                        bad += 1
                        errs.add(type(e).__name__ + ": " + str(e)[:100])

            tasks = [asyncio.create_task(small()) for _ in range(8)]
            await asyncio.sleep(0.3)
            try:
                await kv.exists_many(big)
            except Exception as e:
                print("big:", type(e).__name__)
            await asyncio.sleep(0.3)
            stop = True
            await asyncio.gather(*tasks)
            print("small ok", ok, "failed", bad, errs)


asyncio.run(main())
