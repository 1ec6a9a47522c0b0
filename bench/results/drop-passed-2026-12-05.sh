#!/usr/bin/env bash
# GC_DELETED's drop of passed tombstones when nothing can have passed (bench/RESULTS.md):
# drop-passed-2026-12-05.py at 100k and 400k tombstones, the worktree BEFORE (its own venv)
# and main alternated, 2 rounds.
# Usage: BEFORE=/work/wt/before bash bench/results/drop-passed-2026-12-05.sh > OUT
. "$(dirname "$0")/alternate.sh"
step() {
  for n in 100000 400000; do timeout 600 .venv/bin/python "$MAIN/bench/results/drop-passed-2026-12-05.py" $n; done
}
alternate 2 step
