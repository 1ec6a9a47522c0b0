#!/bin/bash
# the mount harness's cold second-mount reads at 2 MiB, stop 33's main (5b3041c) vs this main, alternating
cd /tmp
for pair in 1 2 3; do
  for arm in base new; do
    [ $((pair % 2)) = 0 ] && { [ $arm = base ] && arm=new || arm=base; }
    if [ $arm = base ]; then PY=/work/wt/base9/.venv/bin/python; else PY=/work/main/.venv/bin/python; fi
    echo "== pair $pair $arm $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    $PY -m kvfs.bench.mount_pages --pages-128k 0 --rounds 2 2>&1 | grep -E "^\| 2 MiB"
  done
done
