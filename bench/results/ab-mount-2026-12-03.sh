#!/usr/bin/env bash
# mount page files (--write-behind, as the quiet run), stop 32's main vs this main, alternating
out=${OUT:-/tmp/ab-mount.txt}; : > "$out"  # (the run of record wrote /work/notes/abmnt.txt, kept as bench/results/ab-mount-2026-12-03.txt)
for t in base32 lead lead base32; do
  echo "== $t $(date -u +%T) $(uptime | sed 's/.*load/load/')" >> $out
  (cd /work/wt/$t && .venv/bin/python -m kvfs.bench.mount_pages --rounds 2 --write-behind 256MiB --mount-arg=--negative-timeout=1s 2>&1 | grep -E '^\| (128|2 MiB)') >> $out
done
echo done >> $out
