"""Meta's kv table (WITHOUT ROWID, keyed by a random 64-byte key) against an append-ordered
table (rowid, the key a plain column), 1024-row transactions into a table growing to N rows;
WAL mode, synchronous=NORMAL, autocheckpoint as meta's default; CPU per row by process_time (bench/RESULTS.md, 2026-12-04).
Usage: python sqlite-append-2026-12-04.py N"""
import hashlib
import os
import sqlite3
import sys
import tempfile
import time

N = int(sys.argv[1])
B = 1024
keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(N)]
blob = bytearray(os.urandom(60))
for name, schema, sql in [
    ("keyed (meta's)", "CREATE TABLE kv (key BLOB PRIMARY KEY, layout BLOB NOT NULL, "
     "expires_at REAL, last_access REAL NOT NULL DEFAULT 0) WITHOUT ROWID",
     "INSERT OR REPLACE INTO kv(key, layout, expires_at, last_access) VALUES (?,?,NULL,?)"),
    ("append-ordered", "CREATE TABLE kv (key BLOB NOT NULL, layout BLOB NOT NULL, expires_at REAL, "
     "last_access REAL NOT NULL DEFAULT 0)",
     "INSERT INTO kv(key, layout, expires_at, last_access) VALUES (?,?,NULL,?)")]:
    d = tempfile.mkdtemp()
    db = sqlite3.connect(os.path.join(d, "m.db"), isolation_level=None)
    db.executescript(f"PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; {schema};")
    c0, t0 = time.process_time(), time.perf_counter()
    for s in range(0, N, B):
        db.execute("BEGIN")
        db.executemany(sql, ((k, blob, 1.0) for k in keys[s:s + B]))
        db.execute("COMMIT")
    cpu = time.process_time() - c0
    size = os.path.getsize(os.path.join(d, "m.db"))
    print(f"{name}: {N} rows, {cpu / N * 1e6:.1f} us CPU a row, "
          f"{(time.perf_counter() - t0) / N * 1e6:.1f} us wall; db {size / N:.0f} B a row")
