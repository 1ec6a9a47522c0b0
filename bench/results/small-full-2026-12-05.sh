#!/usr/bin/env bash
# A small full cluster: `kvfs up --capacity $CAP` (3 chunkservers, the GC daemon, the default
# 64 MiB chunks, so a 256 MiB server's GC reserve is 12.8 MiB, under a chunk), then $RUN s of
# `kvfs bench --rw write` of $BS values over $SIZE (a key space many times the capacity). For each
# tree (alternated, bench/results/alternate.sh): whether the bench ended or failed (NoSpace),
# its MiB/s, and GC's totals after it (keys evicted, chunks compacted and deleted).
# Usage: BEFORE=/path/to/worktree OUT=dir bash bench/results/small-full-2026-12-05.sh [ROUNDS]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/alternate.sh"
source "$(dirname "${BASH_SOURCE[0]}")/kvfs-up.sh"
CAP=${CAP:-256MiB} RUN=${RUN:-20} BS=${BS:-1m} SIZE=${SIZE:-8g}
OUT=${OUT:-/tmp/small-full}
mkdir -p "$OUT"
step() {
  local dir rc
  dir=$(mktemp -d "$OUT/run.XXXX") PY=$PWD/.venv/bin/python PORT=$((7300 + RANDOM % 500))
  kvfs_up small --chunkservers 3 --gc --capacity "$CAP"
  $PY -m kvfs bench --addr kvfs://127.0.0.1:$PORT --rw write --bs $BS --runtime "$RUN" --time_based \
    --size $SIZE --no-progress > "$dir/run.txt" 2>&1
  rc=$?
  echo "bench exit $rc"
  grep -E "^  write:|NoSpace" "$dir/run.txt" | sed 's/^ *//' | cut -c1-220
  $PY -m kvfs gc status --addr kvfs://127.0.0.1:$PORT --json | $PY -c \
    'import json,sys; m=json.load(sys.stdin)["metrics"]; print("gc totals:", ", ".join(f"{k} {int(m[k])}" for k in ("keys_evicted","chunks_compacted","chunks_deleted","passes")))'
  kvfs_down
}
alternate "${1:-2}" step
