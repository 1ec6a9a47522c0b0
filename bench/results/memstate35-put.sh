#!/usr/bin/env bash
# The put cell against Mooncake (bench/RESULTS.md, 2026-12-03), with the guest's cheap free memory
# there ("warm") and taken first by a process holding 6 GiB ("held"), alternating -> memstate35-put.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
out=bench/results/memstate35-put.txt
: > "$out"
cell() {
  echo "== $(date -u '+%F %T UTC') $1: kvfs bench --compare --peers mooncake --cpu --no-internal --no-progress --runtime 3 --time-based --fsync never --rw write --bs 1m --batch 32 --iodepth 2 --size 128m ($(uptime | sed 's/.*load/load/'), MemFree $(awk '/^MemFree/ {print int($2 / 1024)}' /proc/meminfo) MiB)" >> "$out"
  kvfs bench --compare --peers mooncake --cpu --no-internal --no-progress --runtime 3 --time-based \
      --fsync never --rw write --bs 1m --batch 32 --iodepth 2 --size 128m 2>&1 \
    | grep -E '^\[|^ +write:|cpu \(|memory:' >> "$out"
}
held() {
  python bench/results/memstate35-touch.py 6 120 > /tmp/memstate35-hold.txt 2>&1 &
  local pid=$!
  for _ in $(seq 100); do grep -q holding /tmp/memstate35-hold.txt && break; sleep 0.2; done
  sed 's/^/   hold: /' /tmp/memstate35-hold.txt >> "$out"
  cell "held (6 GiB taken first)"
  kill -TERM "$pid"; wait "$pid"
}
for i in 1 2 3; do
  if [ $((i % 2)) = 1 ]; then cell warm; held; else held; cell warm; fi
done
echo "== $(date -u '+%F %T UTC') done" >> "$out"
