#!/usr/bin/env bash
# Cold reads through a mount with the guest's small free blocks taken first (bench/RESULTS.md,
# 2026-12-03): memstate35-coldprobe.py, default mount and --direct-first-open alternating, each
# run while memstate35-touch.py holds 6 GiB it touched first -> memstate35-held.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
out=bench/results/memstate35-held.txt
{ echo "# page_reporting_order $(cat /sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null)," \
       "vm.min_free_kbytes $(cat /proc/sys/vm/min_free_kbytes), main $(git describe --always --dirty)"; } > "$out"
probe() {
  : > /tmp/memstate35-hold.txt  # (emptied here: the last hold's lines must not be read as this one's)
  python bench/results/memstate35-touch.py 6 300 >> /tmp/memstate35-hold.txt 2>&1 &
  local pid=$!
  for _ in $(seq 150); do grep -q holding /tmp/memstate35-hold.txt && break; sleep 0.2; done
  sed 's/^/   hold: /' /tmp/memstate35-hold.txt >> "$out"
  echo "== $(date -u '+%F %T UTC') ROUNDS=3 MARGS='$1' python bench/results/memstate35-coldprobe.py" \
       "(6 GiB held; MemFree $(python -c 'from kvfs.bench.cpu import free_text; print(free_text())'))" >> "$out"
  ROUNDS=3 MARGS="$1" python bench/results/memstate35-coldprobe.py >> "$out" 2>&1
  kill -TERM "$pid"; wait "$pid"
}
for i in 1 2; do
  if [ "$i" = 1 ]; then probe ""; probe --direct-first-open; else probe --direct-first-open; probe ""; fi
done
echo "== $(date -u '+%F %T UTC') done" >> "$out"
