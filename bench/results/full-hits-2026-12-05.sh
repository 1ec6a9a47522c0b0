#!/usr/bin/env bash
# A full cluster's hit rate under random reads and writes: for each tree (alternated,
# bench/results/alternate.sh), a fresh `kvfs up --capacity $CAP`, $FILL s of random 1 MiB puts
# over a key space of $SIZE (larger than the cluster), then $RUN s of `--rw randrw` (half reads,
# half puts, the same keys, chosen as DIST says: random or zipf:THETA, the bench's
# --random_distribution; `kvfs bench` first puts every key once): the reads' misses (keys
# evicted) over the reads.
# Usage: BEFORE=/path/to/worktree OUT=dir bash bench/results/full-hits-2026-12-05.sh [ROUNDS]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/alternate.sh"
source "$(dirname "${BASH_SOURCE[0]}")/kvfs-up.sh"
CAP=${CAP:-1GiB} FILL=${FILL:-10} RUN=${RUN:-20} BS=${BS:-1m} SIZE=${SIZE:-6g} DIST=${DIST:-random}
OUT=${OUT:-/tmp/full-hits}
mkdir -p "$OUT"
step() {
  kvfs_full_up randwrite  # (the cluster, then the fill)
  local dir=$RUN_DIR addr=$ADDR
  $PY -m kvfs bench --addr $addr --rw randrw --bs $BS --runtime "$RUN" --time_based --size $SIZE \
    --no-progress --output-format json $([ "$DIST" = random ] || echo --random_distribution "$DIST") \
    > "$dir/run.json" 2> "$dir/run.err"
  $PY - "$dir/run.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for job in d["jobs"]:
    r, w = job["read"], job["write"]
    reads, missing = r["total_ios"], job["kvfs"]["missing"]
    print(f"{job['jobname']}: reads {reads}, of them missing {missing}: hit rate {1 - missing / max(reads, 1):.3f}; "
          f"{r['bw_bytes'] / 2**20:.0f} MiB/s read, {w['bw_bytes'] / 2**20:.0f} MiB/s written; "
          f"wrong bytes {job['kvfs']['mismatched']}")
PY
  kvfs_down
}
alternate "${1:-2}" step
