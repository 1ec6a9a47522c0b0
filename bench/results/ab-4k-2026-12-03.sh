#!/usr/bin/env bash
# 4 KiB x 128 CPU per key, stop 32's main (8e66798) vs this main, alternating, same machine
out=${OUT:-/tmp/ab-4k.txt}; : > "$out"  # (the run of record wrote /work/notes/ab4k.txt, kept as bench/results/ab-4k-2026-12-03.txt)
for i in 1 2 3 4; do
  for t in base32 lead; do
    [ $((i % 2)) = 0 ] && t=$([ $t = base32 ] && echo lead || echo base32)
    echo "== pair $i $t $(date -u +%T) $(uptime | sed 's/.*load/load/')" >> $out
    (cd /tmp && /work/wt/$t/.venv/bin/python -m kvfs bench --cpu --no-internal --no-progress --runtime 3 --time-based --client async --rw randread,write --bs 4k --batch 128 --iodepth 4 --size 32m --api get_many 2>&1 | grep -E 'cpu \(per|^ *(randread|write)|keys/s|IOPS' ) >> $out
  done
done
echo done >> $out
