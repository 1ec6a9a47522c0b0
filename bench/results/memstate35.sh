#!/usr/bin/env bash
# The sitting behind bench/RESULTS.md's section on the guest's memory and cold mount reads
# (2026-12-03): the control without kvfs, then the cold-read probe without and with
# --direct-first-open and with each round's files deleted, then once more with perf; -> memstate35.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
out=bench/results/memstate35.txt
: > "$out"
step() { echo "== $(date -u '+%F %T UTC') $* ($(uptime | sed 's/.*load/load/'))" >> "$out"; }
step "python bench/results/memstate35-touch.py 10"
python bench/results/memstate35-touch.py 10 >> "$out" 2>&1
step "python bench/results/memstate35-coldprobe.py (ROUNDS=6: default mount)"
ROUNDS=6 python bench/results/memstate35-coldprobe.py >> "$out" 2>&1
step "MARGS=--direct-first-open python bench/results/memstate35-coldprobe.py"
ROUNDS=6 MARGS=--direct-first-open python bench/results/memstate35-coldprobe.py >> "$out" 2>&1
step "RECLAIM=1 python bench/results/memstate35-coldprobe.py"
ROUNDS=6 RECLAIM=1 python bench/results/memstate35-coldprobe.py >> "$out" 2>&1
step "PERF=1 python bench/results/memstate35-coldprobe.py (default mount)"
ROUNDS=6 PERF=1 python bench/results/memstate35-coldprobe.py >> "$out" 2>&1
for r in 0 5; do
  echo "-- perf report --no-children --sort sym, round $r (the mount process), top 8" >> "$out"
  perf report -i /tmp/coldprobe-r$r.perf --no-children --sort sym 2>/dev/null | grep -E '^ +[0-9.]+%' | head -8 >> "$out"
  perf report -i /tmp/coldprobe-r$r.perf --no-children --sort sym -G 2>/dev/null | grep -A12 '__pi_memcpy$' | head -13 >> "$out"
done
step "python bench/results/memstate35-touch.py 10 (again, at the end)"
python bench/results/memstate35-touch.py 10 >> "$out" 2>&1
step "done"
