"""Meta's LOOKUP loop alone (``MetaIndex.lookup_now``, no RPC), 128 keys a call, over an index of
1M keys, the keys looked up in random order (copies, their hashes not yet computed, as a
request's keys are): ns a key, 5 sets of 200k (bench/RESULTS.md, "meta's keys split over 256
dicts").  Usage: python bench/results/keymap-lookup-2026-12-05.py LABEL"""
import hashlib
import random
import sys
import tempfile
import time
from pathlib import Path

from kvfs.config import MetaConfig
from kvfs.layout import Extent, Layout, Replica, make_chunk_id
from kvfs.meta.index import MetaIndex
from kvfs.meta.localstore import open_local

N = 1_000_000
keys = [hashlib.sha256(b"%d" % i).hexdigest().encode() for i in range(N)]
lay = Layout(100, 7, 100.0, None, (Extent(100, 7, (Replica(1, make_chunk_id(1, 1), 0),)),))
rng = random.Random(3)
with tempfile.TemporaryDirectory() as t:
    ix = MetaIndex(MetaConfig(data=Path(t)), open_local(Path(t), "rocksdb"), time.time)
    for k in keys:
        ix.entries[k] = lay
    res = []
    for _ in range(5):
        fresh = [bytes(bytearray(k)) for k in rng.sample(keys, 200_000)]
        ix.accessed.clear()
        ix.dirty_access.clear()
        t0 = time.perf_counter()
        for lo in range(0, len(fresh), 128):
            ix.lookup_now(fresh[lo:lo + 128], 150.0)
        res.append((time.perf_counter() - t0) / len(fresh) * 1e9)
    print(sys.argv[1], " ".join(f"{x:.0f}" for x in res), "ns a key")
    ix.store.close()
