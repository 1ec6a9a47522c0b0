#!/usr/bin/env bash
# A large COMMIT's layouts built a part at a time (bench/RESULTS.md): meta's longest loop step on
# one COMMIT of 16,384 and of 131,072 keys (commit-lazy-2026-12-05.py, RocksDB, 300k keys stored),
# then 4 KiB x 128 puts end to end (the common COMMIT, not lazy: no change expected), the
# worktree BEFORE (its own venv) and main alternated, 2 rounds.
# Usage: BEFORE=/work/wt/before bash bench/results/commit-lazy-2026-12-05.sh > OUT
. "$(dirname "$0")/alternate.sh"
step() {
  for per in 16384 131072; do
    .venv/bin/python "$MAIN/bench/results/commit-lazy-2026-12-05.py" 300000 $per | grep COMMIT
  done
  timeout 300 .venv/bin/kvfs bench --rw write --bs 4k --batch 128 --iodepth 4 --size 32m \
    --time_based --runtime 6 --cpu --cluster processes 2>&1 | grep -E "IOPS=|cpu \("
}
alternate 2 step
