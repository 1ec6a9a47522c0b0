#!/bin/bash
# A/B: main (base) vs crchot9 (new), get_into 1m x 32 and 8m x 8, alternating pairs
cd /tmp
for pair in 1 2 3 4 5 6; do
  for arm in base new; do
    if [ $arm = base ]; then PY=/work/main/.venv/bin/python; else PY=/work/wt/crchot9/.venv/bin/python; fi
    [ $((pair % 2)) = 0 ] && { if [ $arm = base ]; then PY=/work/wt/crchot9/.venv/bin/python; A=new; else PY=/work/main/.venv/bin/python; A=base; fi; } || A=$arm
    for cell in "1m 32 512m" "8m 8 1g"; do
      set -- $cell
      out=$($PY -m kvfs bench --cpu --no-internal --no-progress --runtime 3 --time-based --rw randread --bs $1 --batch $2 --iodepth 2 --size $3 --api get_into 2>&1)
      bw=$(echo "$out" | grep -o "READ: bw=[^ ]*")
      cpu=$(echo "$out" | grep -o "client=[^,]*,")
      cs=$(echo "$out" | grep -o "cs[0-9]=[^ ]* [^ ]*s/GB" | tr '\n' ' ')
      echo "$(date -u +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg) pair=$pair arm=$A bs=$1 $bw $cpu $cs"
    done
  done
done
