#!/usr/bin/env bash
# A meta's start-up on RocksDB through rocksdict's iterator of pairs (bench/RESULTS.md): seconds to
# the ready line of `kvfs meta` on a store of 1M and of 10M keys (filled once, 64-byte keys, one
# extent of one replica each), the worktree BEFORE (its own venv) and main alternated, 3 rounds.
# Stores: python bench/results/meta-fill-2026-12-05.py 1000000 DIR_1M (and 10000000 DIR_10M).
# Usage: BEFORE=/work/wt/before bash bench/results/meta-start-2026-12-05.sh DIR_1M DIR_10M > OUT
. "$(dirname "$0")/alternate.sh"
step() {
  local data
  for data in "$@"; do
    .venv/bin/python "$MAIN/bench/results/meta-start-2026-12-05.py" "$data"
  done
}
alternate 3 step "$@"
