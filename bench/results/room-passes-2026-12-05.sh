#!/usr/bin/env bash
# MAKE_ROOM passes on a full cluster (bench/RESULTS.md, "compaction under pressure"): the
# full-cluster soak, 60 s, from the worktree BEFORE and from main, alternated, 2 rounds; each
# tree's meta/gc.py with room-passes-2026-12-05.patch applied by hand first (meta prints each
# MAKE_ROOM pass's figures to its stderr, which the soak's output carries), and taken off after.
# Per run: the passes' count, time summed, p50 / p90 / max; chunks compacted and bytes copied
# summed; the soak's operations and errors.
# Usage: BEFORE=/work/wt/before OUT=DIR bash bench/results/room-passes-2026-12-05.sh
set -u
MAIN=$(cd "$(dirname "$0")/../.." && pwd)
for r in 1 2; do for t in "$BEFORE" "$MAIN"; do
  name=after; [ "$t" = "$BEFORE" ] && name=before
  echo "== round $r $name $(git -C "$t" log --oneline -1 | cut -c1-7) $(date -u +%H:%M:%S)"
  f=$OUT/round$r-$name.log
  (cd "$t" && timeout 300 .venv/bin/python -m kvfs.bench.soak --seconds 60 --clients 3 --capacity 32MiB > "$f" 2>&1)
  grep ROOMPASS "$f" | awk '{print $2}' | sort -n | awk '{a[NR]=$1; s+=$1} END {print "passes",NR,"sum",s,"p50",a[int(NR/2)],"p90",a[int(NR*0.9)],"max",a[NR]}'
  grep ROOMPASS "$f" | awk '{c+=$10; cp+=$12} END {print "chunks compacted", c, "bytes copied", cp}'
  grep "^operations\|^wrong values" "$f" | cut -c1-200
  grep -o '"errors": {[^}]*}' "$f"
done; done
