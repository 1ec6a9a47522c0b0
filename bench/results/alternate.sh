# Sourced by the before/after scripts here: `alternate ROUNDS STEP [ARGS...]` runs STEP ARGS in the
# worktree $BEFORE (its own venv) and in this checkout ($MAIN), alternated, ROUNDS times, each run
# under a line "== round R, before|main (COMMIT)"; STEP runs with the tree as its working directory.
set -u
MAIN=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
alternate() {
  local rounds=$1 step=$2 r t d
  shift 2
  for r in $(seq 1 "$rounds"); do
    for t in before main; do
      d=$BEFORE; [ $t = main ] && d=$MAIN
      echo "== round $r, $t ($(git -C "$d" log --oneline -1 | cut -c1-7))"
      (cd "$d" && "$step" "$@")
    done
  done
}
