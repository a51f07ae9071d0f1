#!/usr/bin/env bash
# Issue 3 on the GPU: kv_write, graph-safe scratch, command buffers. Run from the repo
# root after `python3 -m pip install --no-build-isolation --no-deps .`:
#   bash tools/gpu/ops.sh [test] [memcheck] [bench]      (default: all three)
# Logs and JSON go to $OUT/ops/ (default ./out/ops). Exit status != 0 when a step failed.
#
#   test.log       pytest tests/test_kv_write.py tests/test_scratch.py
#                  tests/test_command_buffer_gpu.py: every test passes on the GPU params
#                  (none skipped except test_kv_write's CPU-only 'write' drop variant)
#   memcheck.log   compute-sanitizer --tool memcheck python -m pytest
#                  tests/test_command_buffer_gpu.py -k hazard: 4 passed and
#                  "ERROR SUMMARY: 0 errors"
#   bench.log      bench/kv_write.py at 1 GiB and 32 GiB; bench.json
set -uo pipefail
OUT="${OUT:-$PWD/out}/ops"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the arena allocates outside XLA's pool
PY="${PYTHON:-python3}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(test memcheck bench)
rc=0
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local r=$?
  tail -n 40 "$OUT/$name.log"
  echo "== $name: exit $r after $(( $(date +%s) - t0 )) s"
  [ "$r" -ne 0 ] && rc=1
}

for s in "${steps[@]}"; do
  case "$s" in
    test)
      run test 500 "$PY" -m pytest tests/test_kv_write.py tests/test_scratch.py \
        tests/test_command_buffer_gpu.py -v -rs -p no:cacheprovider ;;
    memcheck)
      CS="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
      if [ -n "$CS" ]; then
        run memcheck 580 "$CS" --tool memcheck --error-exitcode 7 "$PY" -m pytest \
          tests/test_command_buffer_gpu.py -k hazard -v -p no:cacheprovider
        grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
      else
        echo "== memcheck: compute-sanitizer not on PATH, skipped"; rc=1
      fi ;;
    bench) run bench 580 "$PY" bench/kv_write.py --json "$OUT/bench.json" ;;
    *) echo "unknown step $s (expected test, memcheck, bench)"; rc=1 ;;
  esac
done
exit $rc
