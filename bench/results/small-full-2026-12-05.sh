#!/usr/bin/env bash
# A small full cluster: `kvfs up --capacity $CAP` (3 chunkservers, the GC daemon, the default
# 64 MiB chunks, so a 256 MiB server's GC reserve is 12.8 MiB, under a chunk), then $RUN s of
# `kvfs bench --rw $RW` (write; or, after 10 s of randwrite, randrw with keys drawn as $DIST says)
# of $BS values over $SIZE (a key space many times the capacity). For each tree (alternated,
# bench/results/alternate.sh): whether the bench ended or failed (NoSpace), its MiB/s, the reads'
# hit rate, and GC's totals after it (keys evicted, chunks compacted and deleted).
# Usage: BEFORE=/path/to/worktree OUT=dir bash bench/results/small-full-2026-12-05.sh [ROUNDS]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/alternate.sh"
source "$(dirname "${BASH_SOURCE[0]}")/kvfs-up.sh"
CAP=${CAP:-256MiB} RUN=${RUN:-20} BS=${BS:-1m} SIZE=${SIZE:-8g} RW=${RW:-write} DIST=${DIST:-random}
OUT=${OUT:-/tmp/small-full}
mkdir -p "$OUT"
step() {
  local dir rc
  dir=$(mktemp -d "$OUT/run.XXXX") PY=$PWD/.venv/bin/python PORT=$((7300 + RANDOM % 500))
  kvfs_up small --chunkservers 3 --gc --capacity "$CAP"
  if [ "$RW" != write ]; then  # (a fill first, as full-hits-2026-12-05.sh has)
    $PY -m kvfs bench --addr kvfs://127.0.0.1:$PORT --rw randwrite --bs $BS --runtime 10 --time_based \
      --size $SIZE --no-progress > "$dir/fill.txt" 2>&1 || echo "fill failed: $(grep -o 'NoSpace.*' "$dir/fill.txt" | cut -c1-200)"
  fi
  $PY -m kvfs bench --addr kvfs://127.0.0.1:$PORT --rw $RW --bs $BS --runtime "$RUN" --time_based \
    --size $SIZE --no-progress --output-format json \
    $([ "$DIST" = random ] || echo --random_distribution "$DIST") > "$dir/run.json" 2> "$dir/run.err"
  rc=$?
  echo "bench exit $rc"
  grep -o "NoSpace.*" "$dir/run.err" | cut -c1-220
  $PY - "$dir/run.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit(0)  # (the bench failed: no figures)
for job in d["jobs"]:
    r, w = job["read"], job["write"]
    hits = f"; reads {r['total_ios']}, hit rate {1 - job['kvfs']['missing'] / r['total_ios']:.3f}" if r["total_ios"] else ""
    print(f"{job['jobname']}: {w['bw_bytes'] / 2**20:.0f} MiB/s written, {r['bw_bytes'] / 2**20:.0f} MiB/s read"
          f"{hits}; wrong bytes {job['kvfs']['mismatched']}")
PY
  $PY -m kvfs gc status --addr kvfs://127.0.0.1:$PORT --json | $PY -c \
    'import json,sys; m=json.load(sys.stdin)["metrics"]; print("gc totals:", ", ".join(f"{k} {int(m[k])}" for k in ("keys_evicted","chunks_compacted","chunks_deleted","passes")))'
  kvfs_down
}
alternate "${1:-2}" step
