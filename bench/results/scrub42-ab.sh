#!/bin/bash
# What the GC daemon's background scrub costs foreground reads: kvfs up --gc-interval 1s with
# the scrub off (--gc-scrub-rate 0) or at its default (8 MiB/s), kvfs bench randread 4k and
# 256k (6 s each), 3 rounds, the order rotated each round.  Run from the repository root.
set -u
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results}
run() { # round arm rate
  d=$(mktemp -d)
  $PY -m kvfs up --data $d/data --listen 127.0.0.1:7393 --gc-interval 1s --gc-scrub-rate $3 > $d/up.log 2>&1 &
  up=$!
  for i in $(seq 150); do grep -q "ready\|kvfs://" $d/up.log && break; sleep 0.2; done
  sleep 1
  $PY -m kvfs bench --addr kvfs://127.0.0.1:7393 --rw randread --bs 4k,256k --runtime 6 --time_based \
    --no-progress --output-format json --json-out $OUT/scrub42-ab-$1-$2.json > /dev/null 2>$d/bench.err
  echo "round $1 $2 rc=$? $($PY -m kvfs gc status --addr kvfs://127.0.0.1:7393 --json | $PY -c \
    "import json,sys; m=json.load(sys.stdin)['metrics']; print('scrubbed', int(m['bytes_scrubbed']), 'passes', int(m['passes']))")"
  kill $up; wait $up 2>/dev/null
  rm -rf $d
}
run 1 off 0; run 1 on 8MiB
run 2 on 8MiB; run 2 off 0
run 3 off 0; run 3 on 8MiB
$PY - "$OUT" <<'PYEOF'
import json, statistics, sys
out = sys.argv[1]
rows = {}
for r in (1, 2, 3):
    for arm in ("off", "on"):
        for job in json.load(open(f"{out}/scrub42-ab-{r}-{arm}.json"))["jobs"]:
            rd = job["read"]
            rows.setdefault((job["jobname"], arm), []).append((rd["iops"], rd["clat_ns"]["percentile"]["99.000000"]))
for name in sorted({n for n, _ in rows}):
    off, on = rows[(name, "off")], rows[(name, "on")]
    mo, mn = statistics.median(x[0] for x in off), statistics.median(x[0] for x in on)
    po, pn = statistics.median(x[1] for x in off), statistics.median(x[1] for x in on)
    print(f"{name}: keys/s off {[round(x[0]) for x in off]} on {[round(x[0]) for x in on]}; "
          f"median on/off {mn / mo:.2f}; p99 per key median off {po / 1e3:.0f} us, on {pn / 1e3:.0f} us")
PYEOF
