#!/usr/bin/env bash
# Meta's leases as a KeyMap (bench/RESULTS.md): meta's longest loop steps while leasing lookups
# cover 3M keys, and the flush that forgets them (leases-2026-12-05.py), the worktree BEFORE (its
# own venv) and main alternated, 2 rounds.
# Usage: BEFORE=/work/wt/before bash bench/results/leases-2026-12-05.sh > OUT
. "$(dirname "$0")/alternate.sh"
step() {
  timeout 600 .venv/bin/python "$MAIN/bench/results/leases-2026-12-05.py" 3000000
}
alternate 2 step
