#!/usr/bin/env bash
# The runs behind bench/RESULTS.md (issue 11), one sitting: the same-run comparisons, then the cost curves.
# Each command writes its text to <name>.txt and its JSON to <name>.json here.
# RUNTIME=S seconds per timed job (default 3); REPEAT=N passes of every comparison cell, in alternating
# order, each cell the median pass (default 3); CURVES=0: the comparisons only; CMP=0: the cost curves only.
set -euo pipefail
cd "$(dirname "$0")"
R=${RUNTIME:-3}
N=${REPEAT:-3}
common=(--compare --cpu --no-internal --no-progress --runtime "$R" --time-based --peers file,redis,mooncake,loopback,fio
        --client async,sync --repeat "$N")
# each run's command, start time, load average (this machine is shared) and free memory go to
# runs.log (MemFree, and the part of it in small blocks: bench/cpu.py's small_free_mib); --cpu puts
# every job's in the outputs too, and kvfs bench's default --reclaim
# deletes the bench's keys and chunks after each kvfs cell (each put cell starts with the memory
# the last one used freed, not further down the guest's free memory: bench/RESULTS.md)
state() { echo "$(uptime | sed 's/.*load/load/'), MemFree $(python -c 'from kvfs.bench.cpu import free_text; print(free_text())')"; }
run() { local name=$1; shift; echo "== $name: kvfs bench $*" | tee -a runs.log >&2
        echo "   start $(date -u '+%F %T UTC'), $(state)" | tee -a runs.log >&2
        kvfs bench "$@" --json-out "$name.json" > "$name.txt"
        echo "   end   $(date -u '+%F %T UTC'), $(state)" | tee -a runs.log >&2; }
if [ "${CMP:-1}" = 1 ]; then  # CMP=0: the cost curves only (appended to runs.log)
: > runs.log
run cmp-4k   "${common[@]}" --rw randread,write --bs 4k  --batch 128 --iodepth 4 --size 32m  --api get_many,get_into,exists_many,match_prefix --plot cmp-4k.png
# large values: the embedded cluster with durability off (--fsync never), as Mooncake keeps values
# in DRAM; then the writes again with the default durability (--fsync batch) against fio's
# sequential writes synced once per batch, the disk's rate (targets.py judges each on its run)
run cmp-1m   "${common[@]}" --fsync never --rw randread,write --bs 1m  --batch 32 --iodepth 2 --size 128m --api get_many,get_into --plot cmp-1m.png
run cmp-8m   "${common[@]}" --fsync never --rw randread,write --bs 8m  --batch 8  --iodepth 2 --size 256m --api get_many,get_into
run cmp-32m  "${common[@]}" --fsync never --rw randread,write --bs 32m --batch 2  --iodepth 2 --size 256m --api get_many,get_into
durable=(--compare --cpu --no-internal --no-progress --runtime "$R" --time-based --peers fio --fsync batch --rw write --iodepth 2
         --repeat "$N")
run cmp-1m-durable  "${durable[@]}" --bs 1m  --batch 32 --size 128m
run cmp-8m-durable  "${durable[@]}" --bs 8m  --batch 8  --size 256m
run cmp-32m-durable "${durable[@]}" --bs 32m --batch 2  --size 256m
fi
[ "${CURVES:-1}" = 1 ] || exit 0  # CURVES=0: the comparisons only
# cost curves: throughput vs chunkservers, vs client processes; meta CPU per key vs batch size
for n in 1 2 3 4; do
  run curve-cs$n --chunkservers $n --rw read,write --bs 1m --batch 32 --iodepth 2 --size 128m --runtime "$R" --time-based --no-progress --cpu
done
for j in 1 2 4; do
  run curve-jobs$j --numjobs $j --rw read,write --bs 1m --batch 32 --iodepth 2 --size 64m --runtime "$R" --time-based --no-progress
done
# meta's own cost per key vs batch (its handlers called in one process, on meta's default store,
# RocksDB, synced per write; lookups included, which the end-to-end runs below cannot show: the
# client's layout cache answers them)
echo "== curve-metastore: python -m kvfs.bench.metastore --store rocksdb" | tee -a runs.log >&2
echo "   start $(date -u '+%F %T UTC'), $(state)" | tee -a runs.log >&2
python -m kvfs.bench.metastore --store rocksdb --keys 100000 --batches 1,8,64,256,1024 --min-s "$R" --json \
    > curve-metastore.json
echo "   end   $(date -u '+%F %T UTC'), $(state)" | tee -a runs.log >&2
for b in 1 8 64 256 1024; do
  run curve-batch$b --rw randread,write --bs 4k --batch $b --iodepth 4 --size 16m --runtime "$R" --time-based --no-progress --cpu \
      --api get_many
done
date -u >&2
