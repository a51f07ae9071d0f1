#!/usr/bin/env bash
# Issue 3 on the GPU: kv_write, graph-safe scratch, command buffers. Run from the repo
# root after `python3 -m pip install --no-build-isolation --no-deps .`:
#   bash tools/gpu/ops.sh [test] [memcheck] [bench]      (default: all three)
# Logs and JSON go to $OUT/ops/ (default ./out/ops). Exit status != 0 when a step failed.
#
#   test.log       pytest tests/test_kv_write.py tests/test_scratch.py
#                  tests/test_command_buffer_gpu.py: every test passes on the GPU params
#   memcheck_<mode>.log  compute-sanitizer memcheck on the scratch hazard scenario
#                  (tests/test_command_buffer_gpu.py run as a script; under pytest the
#                  sanitizer makes XLA re-record the graph): "ERROR SUMMARY: 0 errors" for
#                  grow and retire; errors for grow_free (the debug free-on-growth switch)
#   bench.log      bench/kv_write.py at 1 GiB and 32 GiB; bench.json
set -uo pipefail
OUT="${OUT:-$PWD/out}/ops"
TAIL=40
source "$(dirname "$0")/common.sh"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(test memcheck bench)

for s in "${steps[@]}"; do
  case "$s" in
    test)
      run test 500 "$PY" -m pytest tests/test_kv_write.py tests/test_scratch.py \
        tests/test_command_buffer_gpu.py -v -rs -p no:cacheprovider ;;
    memcheck)
      CS="$(sanitizer)"
      if [ -n "$CS" ]; then
        for mode in grow retire; do  # must be clean: any memcheck error fails the step
          run "memcheck_$mode" 200 "$CS" --tool memcheck --report-api-errors no --error-exitcode 99 \
            "$PY" tests/test_command_buffer_gpu.py hazard "$mode" keep "$OUT/hazard_$mode.json"
          grep -E "ERROR SUMMARY" "$OUT/memcheck_$mode.log" | tail -1
        done
        # The debug free-on-growth switch: memcheck must report errors here (not a step
        # result; it shows the sanitizer sees the bug the scenario guards against).
        timeout 200 "$CS" --tool memcheck --report-api-errors no "$PY" tests/test_command_buffer_gpu.py \
          hazard grow free "$OUT/hazard_grow_free.json" >"$OUT/memcheck_grow_free.log" 2>&1
        echo "== memcheck_grow_free (errors expected): $(grep -E "ERROR SUMMARY" "$OUT/memcheck_grow_free.log" | tail -1)"
      else
        echo "== memcheck: compute-sanitizer not on PATH, skipped"; rc=1
      fi ;;
    bench) run bench 580 "$PY" bench/kv_write.py --json "$OUT/bench.json" ;;
    *) echo "unknown step $s (expected test, memcheck, bench)"; rc=1 ;;
  esac
done
exit $rc
