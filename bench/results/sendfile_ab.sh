#!/usr/bin/env bash
# The before/after pairs of "Chunkserver READV answers sent with sendfile" (bench/RESULTS.md):
# sendfile_ab.sh REPS "BS BATCH SIZE" ...  runs, for each repetition and workload, `kvfs bench`
# (get_into, --compare --peers loopback, --cpu) in BEFORE (a worktree of the old main with its own
# venv) and then AFTER, and appends one line per run to $LOG: kvfs MB/s, the loopback peer's MB/s
# of the same run, the chunkservers' CPU s/GB (all three), the client's, the load average.
set -u
BEFORE=${BEFORE:-/tmp/sf-before}
AFTER=${AFTER:-$(cd "$(dirname "$0")/../.." && pwd)}
out=${LOG:-sendfile-ab.log}
reps=$1; shift
cfgs=("$@")
for r in $(seq 1 "$reps"); do
  for cfg in "${cfgs[@]}"; do
    read -r bs batch size <<< "$cfg"
    for side in before after; do
      [ $side = before ] && dir=$BEFORE || dir=$AFTER
      ld=$(uptime | sed 's/.*load average: //')
      res=$(cd $dir && timeout 300 .venv/bin/python -m kvfs bench --rw randread --bs $bs --batch $batch --iodepth 2 --size $size \
            --api get_into --cpu --compare --peers loopback --runtime 3 --time-based --no-progress --fsync never --no-internal 2>&1)
      kv=$(echo "$res" | awk '/ into +kvfs /{print $(NF-2)}' | head -1)
      lo=$(echo "$res" | awk '$1=="loopback" && NF==6 {print $3}' | head -1)
      cs=$(echo "$res" | awk '/all cs/{print $NF}' | head -1)
      cl=$(echo "$res" | awk '/kvfs +client/{print $NF}' | head -1)
      echo "$(date -u +%T) rep=$r bs=$bs side=$side kvfs_MBps=$kv loopback_MBps=$lo cs_sGB=$cs client_sGB=$cl load=[$ld]" | tee -a $out
    done
  done
done
