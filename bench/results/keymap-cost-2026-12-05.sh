#!/usr/bin/env bash
# Meta's keys split over 256 dicts (bench/RESULTS.md): what it costs per key, commit, lookup and
# match_prefix against batch size, memory per key and a `kvfs meta` restart, at 1M keys on
# RocksDB (python -m kvfs.bench.metastore), the worktree BEFORE (its own venv) and main
# alternated, 2 rounds.
# Usage: BEFORE=/work/wt/before bash bench/results/keymap-cost-2026-12-05.sh > OUT
. "$(dirname "$0")/alternate.sh"
step() {
  timeout 600 .venv/bin/python -m kvfs.bench.metastore --store rocksdb --keys 1000000 --restart
}
alternate 2 step
