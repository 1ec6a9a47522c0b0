#!/usr/bin/env bash
# Meta's MAKE_ROOM passes with one collector kept from pass to pass (bench/RESULTS.md): 300
# passes one after another on a process cluster (make-room-2026-12-05.py), the worktree BEFORE
# (its own venv) and main alternated, 3 rounds.
# Usage: BEFORE=/work/wt/before bash bench/results/make-room-2026-12-05.sh > OUT
. "$(dirname "$0")/alternate.sh"
step() {
  timeout 300 .venv/bin/python "$MAIN/bench/results/make-room-2026-12-05.py" 300
}
alternate 3 step
