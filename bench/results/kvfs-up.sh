# Sourced by the dated meta harnesses here: kvfs_up TAG [kvfs up options...] starts a real
# `kvfs up` (one chunkserver, no GC, on 127.0.0.1:$PORT) in a new temporary directory and
# waits for its ready line (and stops it if the script exits first); sets D (the directory,
# now the working one), UP (kvfs up's pid) and META (meta's). kvfs_down stops it and removes D. Their Python reads a process's CPU
# with kvfs.bench.cpu.cpu_seconds.
kvfs_up() {
  local tag=$1; shift
  D=$(mktemp -d "/tmp/kvfs-$tag.XXXX"); cd "$D" || return 1
  $PY -m kvfs up --data "$D/data" --chunkservers 1 --listen "127.0.0.1:$PORT" --no-gc "$@" > up.log 2>&1 &
  UP=$!
  trap 'kill "$UP" 2>/dev/null' EXIT  # (a harness that stops early, e.g. under set -e, stops it too)
  for _ in $(seq 100); do grep -q "kvfs://" up.log 2>/dev/null && break; sleep 0.2; done
  META=$(pgrep -f "kvfs meta --data $D")
}
kvfs_down() { trap - EXIT; kill "$UP"; wait "$UP"; rm -rf "$D"; }
# kvfs_full_up RW: the full-cluster harnesses' start (full-steady, full-hits): a fresh `kvfs up`
# as it starts one, sized (3 chunkservers, the GC daemon, --capacity $CAP), then $FILL s of
# `kvfs bench --rw RW` of $BS values over $SIZE, its output in $RUN_DIR/fill.txt; run from the
# tree whose .venv runs it. Sets RUN_DIR (a new directory under $OUT) and ADDR besides kvfs_up's.
kvfs_full_up() {
  RUN_DIR=$(mktemp -d "$OUT/run.XXXX") PY=$PWD/.venv/bin/python PORT=$((7300 + RANDOM % 500))
  kvfs_up full --chunkservers 3 --gc --capacity "$CAP"
  ADDR=kvfs://127.0.0.1:$PORT
  $PY -m kvfs bench --addr $ADDR --rw "$1" --bs $BS --runtime "$FILL" --time_based --size $SIZE \
    --no-progress > "$RUN_DIR/fill.txt" 2>&1
}
