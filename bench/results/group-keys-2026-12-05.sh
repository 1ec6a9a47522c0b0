#!/usr/bin/env bash
# meta's --commit-group-max-keys 2048 / 1024 / 512 (bench/RESULTS.md): a lookup's latency at meta while two
# writer processes put 512-key batches of 4 KiB values, 8 in flight each (random keys), and the writers'
# keys/s, 3 rounds alternated (group-keys-2026-12-05.jsonl); then meta's longest step on a 16,384-key
# COMMIT with groups of 2048 and 1024, alternated (group-keys-2026-12-05-commit.txt).
set -u
cd "$(dirname "$0")/../.."
for r in 1 2 3; do
  for g in 2048 1024 512; do
    python -m kvfs.bench.lookup_during_puts --during puts --writers 2 --iodepth 8 --batch 512 --keys hashed \
      --seconds 6 --meta-arg=--commit-group-max-keys=$g 2>/dev/null >> bench/results/group-keys-2026-12-05.jsonl
  done
done
for g in 2048 1024 2048 1024; do
  python bench/results/commit-lazy-2026-12-05.py 300000 16384 $g | grep COMMIT >> bench/results/group-keys-2026-12-05-commit.txt
done
