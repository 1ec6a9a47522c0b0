# Sourced by the dated meta harnesses here: kvfs_up TAG [kvfs up options...] starts a real
# `kvfs up` (one chunkserver, no GC, on 127.0.0.1:$PORT) in a new temporary directory and
# waits for its ready line; sets D (the directory, now the working one), UP (kvfs up's pid)
# and META (meta's). kvfs_down stops it and removes D. Their Python reads a process's CPU
# with kvfs.bench.cpu.cpu_seconds.
kvfs_up() {
  local tag=$1; shift
  D=$(mktemp -d "/tmp/kvfs-$tag.XXXX"); cd "$D" || return 1
  $PY -m kvfs up --data "$D/data" --chunkservers 1 --listen "127.0.0.1:$PORT" --no-gc "$@" > up.log 2>&1 &
  UP=$!
  for _ in $(seq 100); do grep -q "kvfs://" up.log 2>/dev/null && break; sleep 0.2; done
  META=$(pgrep -f "kvfs meta --data $D")
}
kvfs_down() { kill "$UP"; wait "$UP"; rm -rf "$D"; }
