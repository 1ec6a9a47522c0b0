#!/usr/bin/env bash
# the blocking client at 4 KiB x 128 (get_many, exists_many, put_many), stop 32's main vs this main, alternating
out=${OUT:-/tmp/ab-sync.txt}; : > "$out"  # (the run of record wrote /work/notes/absync.txt, kept as bench/results/ab-sync-2026-12-03.txt)
for i in 1 2 3 4; do
  for t in base32 lead; do
    [ $((i % 2)) = 0 ] && t=$([ $t = base32 ] && echo lead || echo base32)
    echo "== pair $i $t $(date -u +%T) $(uptime | sed 's/.*load/load/')" >> $out
    (cd /tmp && /work/wt/$t/.venv/bin/python -m kvfs bench --no-internal --no-progress --runtime 3 --time-based --client sync --rw randread,write --bs 4k --batch 128 --iodepth 4 --size 32m --api get_many,exists_many 2>&1 | grep -E '^[a-z].*groupid|IOPS=' ) >> $out
  done
done
echo done >> $out
