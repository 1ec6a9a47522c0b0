#!/usr/bin/env bash
# Meta's keys split over 256 dicts (bench/RESULTS.md): the LOOKUP loop alone, keys in random order
# (keymap-lookup-2026-12-05.py), the worktree BEFORE (its own venv) and main alternated, 2 rounds.
# Usage: BEFORE=/work/wt/before bash bench/results/keymap-lookup-2026-12-05.sh > OUT
. "$(dirname "$0")/alternate.sh"
step() {
  .venv/bin/python "$MAIN/bench/results/keymap-lookup-2026-12-05.py" lookup_now
}
alternate 2 step
