"""Meta's rows in RocksDB (rocksdict) instead of SQLite: 1,024-row write batches of random
64-byte keys into a store growing to N rows, WAL on, not synced per batch (as SQLite at
synchronous=NORMAL); CPU per row by process_time; then a page of 1,000 in key order
(bench/RESULTS.md, 2026-12-04).  rocksdict is not a kvfs dependency: run it in a venv of its
own (pip install rocksdict==0.3.29).  Usage: python rocks-put-2026-12-04.py N"""
import hashlib
import os
import sys
import tempfile
import time

from rocksdict import Options, Rdict, WriteBatch

N = int(sys.argv[1])
B = 1024
keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(N)]
blob = os.urandom(60) + b"\0" * 16
d = tempfile.mkdtemp()
db = Rdict(os.path.join(d, "r"), Options(raw_mode=True))
c0, t0 = time.process_time(), time.perf_counter()
for s in range(0, N, B):
    wb = WriteBatch(raw_mode=True)
    for k in keys[s : s + B]:
        wb.put(k, blob)
    db.write(wb)
cpu = time.process_time() - c0
t = time.perf_counter()
it = db.iter()
it.seek(keys[N // 2])
page: list[bytes] = []
while it.valid() and len(page) < 1000:
    page.append(it.key())
    it.next()
lst = (time.perf_counter() - t) * 1e3
db.close()
size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
print(f"rocksdb: {N} rows, {cpu / N * 1e6:.1f} us CPU a row (the process: RocksDB's flush and "
      f"compaction threads included), {(time.perf_counter() - t0) / N * 1e6:.1f} us wall; a page "
      f"of 1000 in key order {lst:.2f} ms; {size / N:.0f} B a row on disk", flush=True)
