#!/bin/bash
# put_many 1m x 32 --fsync never: stop 33's main (5b3041c) against this main, alternating pairs
cd /tmp
for pair in 1 2 3 4; do
  for arm in base new; do
    [ $((pair % 2)) = 0 ] && { [ $arm = base ] && arm=new || arm=base; }
    if [ $arm = base ]; then PY=/work/wt/base9/.venv/bin/python; else PY=/work/wt/lead/.venv/bin/python; fi
    out=$($PY -m kvfs bench --cpu --no-internal --no-progress --runtime 3 --time-based --fsync never --rw write --bs 1m --batch 32 --iodepth 2 --size 512m 2>&1)
    echo "$(date -u +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg) pair=$pair arm=$arm $(echo "$out" | grep -oE 'WRITE: bw=[^ ]*') $(echo "$out" | grep -oE 'client=[^,]*|cs[0-9]=[^ ]* [^ ]*s/GB|MemFree [0-9]+->[0-9]+' | tr '\n' ' ')"
  done
done
