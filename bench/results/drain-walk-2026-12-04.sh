#!/bin/bash
# Usage: from the repository root; "after" and "before" name worktrees of main, each with its own venv (.venv)
S=bench/results/admin-scale-2026-12-04.sh
for spec in "after 200000 /work/main" "after 800000 /work/main" "before 800000 /work/wt/final"; do
  set -- $spec
  echo "# $1: N=$2 $(cd $3 && git log --oneline -1) $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PY=$3/.venv/bin/python N=$2 PORT=7391 bash $S drain 2>&1
done
echo DONE $(date -u +%H:%M:%S)
