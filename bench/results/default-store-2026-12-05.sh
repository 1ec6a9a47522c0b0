#!/usr/bin/env bash
# The quick start's `kvfs bench` (default job set, embedded 3-chunkserver cluster, --cpu)
# with meta on SQLite (the default before 2026-12-05) and on RocksDB (the default now),
# alternated, ROUNDS times each; then the 4 KiB x 128 write job over a large key space
# (where SQLite's pages no longer all sit in its cache), alternated the same way.
#   PY=.venv/bin/python ROUNDS=2 bash bench/results/default-store-2026-12-05.sh > OUT.txt
set -u
PY=${PY:-python3}
ROUNDS=${ROUNDS:-2}
echo "# $(date -u '+%F %T UTC'), $(nproc) vCPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $(git log --oneline -1)"
for r in $(seq "$ROUNDS"); do
  for store in sqlite rocksdb; do
    echo "## round $r: kvfs bench --cpu --meta-store $store"
    $PY -m kvfs bench --cpu --meta-store "$store" 2>&1 | grep -v "^kvfs bench: starting"
  done
done
for r in $(seq "$ROUNDS"); do
  for store in sqlite rocksdb; do
    echo "## round $r: 4 KiB x 128 writes over 1 GiB of keys, --meta-store $store"
    $PY -m kvfs bench --cpu --meta-store "$store" --rw randwrite --bs 4k --size 1GiB \
        --runtime 15 --time_based 2>&1 | grep -v "^kvfs bench: starting"
  done
done
echo "# done $(date -u '+%F %T UTC')"
