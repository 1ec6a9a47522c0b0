#!/bin/bash
# client perf samples: CRC-32C vs the kernel's receive copy, base vs new, alternating
cd /tmp/pf
for pair in 1 2 3; do
  for arm in base new; do
    if [ $arm = base ]; then PY=/work/wt/base9/.venv/bin/python; else PY=/work/wt/crchot9/.venv/bin/python; fi
    for bs in "1m 32 512m" "8m 8 1g"; do set -- $bs
    $PY -m kvfs bench --no-progress --runtime 10 --time-based --rw randread --bs $1 --batch $2 --iodepth 2 --size $3 --api get_into > b.txt 2>&1 & BP=$!
    sleep 6; perf record -F 2000 -p $BP -o ab.data -- sleep 3 > /dev/null 2>&1; wait $BP
    r=$(perf report -i ab.data --no-children --sort sym --stdio 2>/dev/null | grep -E "_crc32c_hw|_copy_to_iter|_PyEval_EvalFrameDefault" | awk '{printf "%s %s  ", $3, $1}')
    echo "$(date -u +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg) pair=$pair arm=$arm bs=$1 $(grep -o 'READ: bw=[^ ]*' b.txt) $r"
    done
  done
done
