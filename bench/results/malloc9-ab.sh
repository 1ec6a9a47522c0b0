#!/bin/bash
# get_many 1m x 32: glibc's malloc defaults against MALLOC_MMAP_THRESHOLD_=32MiB MALLOC_TRIM_THRESHOLD_=256MiB
# (env of the whole bench tree), blocking and async clients, alternating; page faults of the
# bench process over 2 s of the measured phase (perf stat), client CPU per GB (--cpu)
cd /tmp  # PY: the python of the tree measured
for pair in 1 2 3 4; do
  for e in none tuned; do
    [ $((pair % 2)) = 0 ] && { [ $e = none ] && e=tuned || e=none; }
    for c in sync async; do
      if [ $e = tuned ]; then export MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=268435456; else unset MALLOC_MMAP_THRESHOLD_ MALLOC_TRIM_THRESHOLD_; fi
      ${PY:-python} -m kvfs bench --cpu --no-internal --no-progress --runtime 6 --time-based --client $c --rw randread --bs 1m --batch 32 --iodepth 2 --size 512m --api get_many > /tmp/malloc9-b.txt 2>&1 & BP=$!
      sleep 5; pf=$(perf stat -e page-faults -p $BP -x, -- sleep 2 2>&1 | cut -d, -f1); wait $BP
      echo "$(date -u +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg) pair=$pair malloc=$e client=$c faults/2s=$pf $(grep -oE 'READ: bw=[^ ]*|client=[^,]*' /tmp/malloc9-b.txt | tr '\n' ' ')"
    done
  done
done
unset MALLOC_MMAP_THRESHOLD_ MALLOC_TRIM_THRESHOLD_
