#!/usr/bin/env bash
# 4 KiB x 128 reads, the seventeenth run's main (9c781c5, /work/wt/q17, its own venv) against this
# main, alternating (bench/RESULTS.md, 2026-12-03: the read path's review mends between them) -> rd4k35-ab.txt
set -uo pipefail
out=$(cd "$(dirname "$0")" && pwd)/rd4k35-ab.txt
: > "$out"
for i in 1 2 3 4; do
  if [ $((i % 2)) = 1 ]; then order="/work/wt/q17 /work/main"; else order="/work/main /work/wt/q17"; fi
  for t in $order; do
    echo "== $(date -u '+%F %T UTC') $t $(git -C "$t" rev-parse --short HEAD) ($(uptime | sed 's/.*load/load/'))" >> "$out"
    (cd "$t" && .venv/bin/kvfs bench --client async,sync --cpu --no-internal --no-progress --runtime 3 --time-based \
        --rw randread --bs 4k --batch 128 --iodepth 4 --size 32m --api get_many,get_into 2>&1 \
      | grep -E '^\[|IOPS=|cpu \(' | sed -E 's/\(groupid=.*//; s/cpu \(per process[^:]*: /cpu: /' >> "$out")
  done
done
echo "== $(date -u '+%F %T UTC') done" >> "$out"
