#!/usr/bin/env bash
# A full cluster's steady state (a cache always is full): 1 MiB puts over a key space 2.7x
# the cluster's capacity, so every put past the first fill evicts. For each tree (alternated,
# bench/results/alternate.sh): a fresh `kvfs up --capacity $CAP` (3 chunkservers, the GC daemon),
# a fill of $FILL s, then $RUN s measured: the client's MiB/s and call latency, the GC's bytes
# copied and chunks compacted/deleted in that phase, and each process's CPU.
# Usage: BEFORE=/path/to/worktree OUT=dir bash bench/results/full-steady-2026-12-05.sh [ROUNDS]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/alternate.sh"
source "$(dirname "${BASH_SOURCE[0]}")/kvfs-up.sh"
CAP=${CAP:-1GiB} FILL=${FILL:-8} RUN=${RUN:-20} BS=${BS:-1m} SIZE=${SIZE:-8g}
OUT=${OUT:-/tmp/full-steady}
mkdir -p "$OUT"
step() {
  kvfs_full_up write  # (the cluster, then the fill)
  local dir=$RUN_DIR addr=$ADDR
  metrics() { $PY -m kvfs gc status --addr $addr --json | $PY -c \
    'import json,sys; m=json.load(sys.stdin)["metrics"]; print(" ".join(str(int(m[k])) for k in ("bytes_copied","chunks_compacted","chunks_deleted","passes","bytes_evicted")))'; }
  local pids a b m0 m1
  pids="$UP $(pgrep -P "$UP" | tr '\n' ' ')"
  a=$(for p in $pids; do awk -v p=$p '{print p, $14+$15}' /proc/$p/stat; done)
  m0=$(metrics)
  $PY -m kvfs bench --addr $addr --rw write --bs $BS --runtime "$RUN" --time_based --size $SIZE \
    --no-progress > "$dir/run.txt" 2>&1
  m1=$(metrics)
  b=$(for p in $pids; do awk -v p=$p '{print p, $14+$15}' /proc/$p/stat; done)
  grep -E "^  write:|call lat \(msec\)" "$dir/run.txt" | sed 's/^ *//'
  grep -A5 "call lat percentiles" "$dir/run.txt" | tail -5 | sed 's/^ *//'
  $PY - "$m0" "$m1" "$RUN" <<'PY'
import sys
a, b, run = [int(x) for x in sys.argv[1].split()], [int(x) for x in sys.argv[2].split()], float(sys.argv[3])
d = [y - x for x, y in zip(a, b)]
print(f"gc in the measured phase: {d[0]/2**20:.0f} MiB copied, {d[1]} chunks compacted, {d[2]} deleted, "
      f"{d[3]} GC passes (the daemon's and MAKE_ROOM's), {d[4]/2**20:.0f} MiB evicted")
PY
  join <(echo "$a" | sort) <(echo "$b" | sort) | while read -r p x y; do
    echo "cpu $(tr '\0' ' ' < /proc/$p/cmdline | awk '{print $4}') $(awk -v x=$x -v y=$y -v r=$RUN 'BEGIN{printf "%.2f", (y-x)/100/r}') CPUs"
  done
  kvfs_down
}
alternate "${1:-2}" step
