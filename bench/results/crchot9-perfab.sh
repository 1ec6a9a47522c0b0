#!/bin/bash
# client perf samples: CRC-32C vs the kernel's receive copy, base then new in each of 3 pairs.
# BASE / NEW: the two trees' pythons; SYMS: the symbols kept from each report.
# crchot9-perf.txt: the defaults (base /work/main at 5b3041c, new the crchot9 branch);
# crchot9-vector.txt: BASE=/work/wt/base9/.venv/bin/python (main c89b4dc), NEW the crchot9
# tree with VECTOR_BYTES = 1 MiB, SYMS="_crc32c_hw|_copy_to_iter|_PyEval_EvalFrameDefault".
BASE=${BASE:-/work/main/.venv/bin/python}
NEW=${NEW:-/work/wt/crchot9/.venv/bin/python}
SYMS=${SYMS:-"_crc32c_hw|_copy_to_iter"}
mkdir -p /tmp/pf && cd /tmp/pf
for pair in 1 2 3; do
  for arm in base new; do
    if [ $arm = base ]; then PY=$BASE; else PY=$NEW; fi
    for bs in "1m 32 512m" "8m 8 1g"; do set -- $bs
    $PY -m kvfs bench --no-progress --runtime 10 --time-based --rw randread --bs $1 --batch $2 --iodepth 2 --size $3 --api get_into > b.txt 2>&1 & BP=$!
    sleep 6; perf record -F 2000 -p $BP -o ab.data -- sleep 3 > /dev/null 2>&1; wait $BP
    r=$(perf report -i ab.data --no-children --sort sym --stdio 2>/dev/null | grep -E "$SYMS" | awk '{printf "%s %s  ", $3, $1}')
    echo "$(date -u +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg) pair=$pair arm=$arm bs=$1 $(grep -o 'READ: bw=[^ ]*' b.txt) $r"
    done
  done
done
