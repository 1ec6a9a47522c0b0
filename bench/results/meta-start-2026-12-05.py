"""A ``kvfs meta`` process's start on a filled RocksDB store: seconds to its ready line and its
RSS then (``kvfs.bench.metastore.start_meta``), run by the venv of the tree being measured.
Usage: python bench/results/meta-start-2026-12-05.py DATA_DIR [ROUNDS]"""
import sys
from pathlib import Path

from kvfs.bench.metastore import start_meta

for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
    ready_s, rss = start_meta(Path(sys.argv[1]), "rocksdb", "")
    print(f"{sys.argv[1]}: ready in {ready_s:.2f} s, RSS {rss / 2**20:.0f} MiB", flush=True)
