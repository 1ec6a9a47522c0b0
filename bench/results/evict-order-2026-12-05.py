"""GC_EVICT's cost when it needs little: meta (in process, RocksDB) with N keys on one server,
that server just over its watermark, so a dry run's victims are the VICTIMS least recently used
keys; each call timed (kvfs.bench.meta_stall.stalled: wall ms, longest loop step ms), CALLS calls
in a row, as a full cluster's passes make them.  Usage: python THIS N [VICTIMS] [CALLS]"""

import asyncio
import gc
import sys
import tempfile
from pathlib import Path

from kvfs import rpc
from kvfs.bench.meta_stall import stalled
from kvfs.bench.metastore import LocalMeta, fill, rss_bytes
from kvfs.server import reply_of


async def main(n: int, victims: int, calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta")
        await m.open()
        await fill(m, n, 1000, "k")
        gc.collect()  # type: ignore[attr-defined]  # (the stdlib's gc: mypy takes this repository's)
        gc.freeze()  # type: ignore[attr-defined]  # (as `kvfs meta` does once started)
        svc = m.meta
        ix = svc.index
        live = dict(await ix.live_bytes())
        have = sum(live.values())
        cap = 2 * have  # (the server at half its capacity: over a watermark of low)
        await svc.rpc_heartbeat(rpc.Heartbeat(server_id=1, addr="127.0.0.1:1", capacity=cap, free=0, used=have,
                                              chunks=dict(live)), memoryview(b""))
        low = (have - victims * 100 + 1) / cap  # each key: a 100-byte value
        req = rpc.GcEvict(high=low, low=low)
        print(f"{n} keys: VmRSS {rss_bytes() / 2**20:.0f} MiB before the first call", flush=True)
        for i in range(calls):
            wall, step, _ = await stalled(lambda: reply_of(svc.gc.rpc_gc_evict(req, memoryview(b""))))
            ev = (await reply_of(svc.gc.rpc_gc_evict(req, memoryview(b""))))[0]
            assert isinstance(ev, rpc.Evicted)
            print(f"{n} keys, call {i + 1}: GC_EVICT dry run {wall:.0f} ms, longest step {step:.1f} ms; "
                  f"victims {ev.keys}; VmRSS {rss_bytes() / 2**20:.0f} MiB", flush=True)
        gc.unfreeze()  # type: ignore[attr-defined]
        await svc.close()


asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1000,
                 int(sys.argv[3]) if len(sys.argv) > 3 else 3))
