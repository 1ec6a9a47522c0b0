#!/usr/bin/env bash
# Meta's keys split over 256 dicts (bench/RESULTS.md): meta's longest loop steps while its index
# grows to 3M keys, and its LOOKUP rate (keymap-2026-12-05.py), the worktree BEFORE (its own venv)
# and main alternated, 2 rounds.
# Usage: BEFORE=/work/wt/before bash bench/results/keymap-2026-12-05.sh > OUT
. "$(dirname "$0")/alternate.sh"
step() {
  .venv/bin/python "$MAIN/bench/results/keymap-2026-12-05.py" 3000000
}
alternate 2 step
