# Sourced by the tools/gpu feature scripts (ops.sh, attention.sh, model.sh): the
# environment every GPU step needs, a step runner and the compute-sanitizer lookup.
# Before sourcing, set OUT to the feature's log directory.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the arena allocates outside XLA's pool
PY="${PYTHON:-python3}"
rc=0

run() {  # name, timeout seconds, command... -> $OUT/<name>.log; rc=1 when it failed
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local r=$?
  tail -n "${TAIL:-30}" "$OUT/$name.log"
  echo "== $name: exit $r after $(( $(date +%s) - t0 )) s"
  [ "$r" -ne 0 ] && rc=1
}

sanitizer() {  # prints the compute-sanitizer path, or nothing
  command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1
}
