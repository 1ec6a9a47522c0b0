#!/usr/bin/env bash
# rollahead8's alternating A/B (bench/RESULTS.md, "Issue 11, large puts: the next chunk reserved
# ahead"): PAIRS pairs of (base, new) per cell, the order flipped every other pair, each kvfs bench
# run from its own worktree's venv with rollahead8-hook/sitecustomize.py counting the rolls.
# One line per run: time, load, tree, cell, MB/s, calls' p99 / max (ms), the --cpu line, the rolls.
# usage: rollahead8-ab.sh BASE_WT NEW_WT PAIRS CELL...   (CELL: 1m, 8m, 1m-durable, 8m-durable)
set -euo pipefail
base=$1 new=$2 pairs=$3; shift 3
hook=$(cd "$(dirname "$0")" && pwd)/rollahead8-hook
tmp=$(mktemp -d /tmp/rollahead8-ab.XXXXXX)
args() {  # the cell's kvfs bench arguments
  local common=(--cpu --no-internal --no-progress --runtime 3 --time-based --client async --rw write
                --iodepth 2)  # (writes are put_many calls; --api names the read calls only)
  case $1 in
    1m) echo "${common[@]} --bs 1m --batch 32 --size 512m --fsync never" ;;
    8m) echo "${common[@]} --bs 8m --batch 8 --size 512m --fsync never" ;;
    1m-durable) echo "${common[@]} --bs 1m --batch 32 --size 128m --fsync batch" ;;
    8m-durable) echo "${common[@]} --bs 8m --batch 8 --size 256m --fsync batch" ;;
  esac; }
one() {  # tree-name worktree cell
  local name=$1 wt=$2 cell=$3 out="$tmp/$1-$3"
  rm -rf "$out.d"; mkdir -p "$out.d"
  local load; load=$(cut -d' ' -f1 /proc/loadavg)
  local t; t=$(date -u +%T)
  (cd "$wt" && PYTHONPATH="$hook" ROLLAHEAD8_OUT="$out.d" .venv/bin/python -m kvfs bench $(args "$cell") \
     --json-out "$out.json" > "$out.txt" 2>&1) || { echo "$t load $load $name $cell FAILED"; tail -5 "$out.txt"; return; }
  python3 - "$out" "$t" "$load" "$name" "$cell" <<'PY'
import glob, json, re, sys
out, t, load, name, cell = sys.argv[1:]
d = json.load(open(out + ".json"))
w = d["jobs"][0]["write"]
call = w["call_lat_ns"]
p99 = call.get("percentile", {}).get("99.000000", 0) / 1e6
txt = open(out + ".txt").read()
cpu = " | ".join(l.strip() for l in txt.splitlines() if "cpu" in l.lower() and ("us/key" in l or "s/GB" in l))
rolls = taken = missed = 0; fresh = []; ahead = []
for f in glob.glob(out + ".d/*.json"):
    r = json.load(open(f)); rolls += r["rolls"]; taken += r["taken"]; missed += r["missed"]
    fresh += r["fresh_ms"]; ahead += r["ahead_ms"]
mx = lambda v: max(v) if v else 0
cs = sum(float(x) for x in re.findall(r"cs\d+=\S+us/key (\S+)s/GB", txt))
cl = re.search(r"client=(\S+)us/key", txt)
print(f"{t} load {load} {name:4} {cell:10} {w['bw_bytes']/1e6:7.0f} MB/s  call p99 {p99:6.1f} max {call['max']/1e6:6.1f} ms"
      f"  rolls {rolls} ready {taken} not {missed}  append-path fallocate n {len(fresh)} sum {sum(fresh):.0f} max {mx(fresh):.0f} ms"
      f"  ahead n {len(ahead)} max {mx(ahead):.0f} ms  cs {cs:.3f} s/GB client {cl.group(1) if cl else '?'} us/key  || {cpu}")
PY
}
for cell in "$@"; do
  for i in $(seq 1 "$pairs"); do
    if [ $((i % 2)) = 1 ]; then one base "$base" "$cell"; one new "$new" "$cell"
    else one new "$new" "$cell"; one base "$base" "$cell"; fi
  done
done
rm -rf "$tmp"
