#!/usr/bin/env bash
# A COMMIT past --commit-group-max-keys written in parts (bench/RESULTS.md): meta's longest
# loop step on a 16,384-key COMMIT (write-stall-2026-12-04.py, RocksDB, 300k keys stored),
# then large client COMMITs end to end (4 KiB x 512, 8 calls in flight: the client's group
# commit merges them), the worktree BEFORE (its own venv) and main alternated, 2 rounds.
# Usage: BEFORE=/work/wt/before bash bench/results/commit-parts-2026-12-05.sh > OUT
. "$(dirname "$0")/alternate.sh"
step() {
  .venv/bin/python "$MAIN/bench/results/write-stall-2026-12-04.py" 300000 rocksdb | grep COMMIT
  timeout 300 .venv/bin/kvfs bench --rw write --bs 4k --batch 512 --iodepth 8 --size 1g \
    --time_based --runtime 6 --cpu --cluster processes 2>&1 | grep -E "IOPS=|cpu \("
}
alternate 2 step
