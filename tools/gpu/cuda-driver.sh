#!/usr/bin/env bash
# GPU checks of the CUDA VMM driver (ffi/src/drivers/cuda/, issue 2), on the GPU box from
# the repo root after `python3 -m pip install --no-build-isolation --no-deps .`.
# Logs go to $OUT (default ./out) as cuda-driver_*.log. Exit status non-zero when a step
# failed. What to look for:
#   cuda-driver_facts.json  raw-driver facts (tests/cuda_oracle.py): read_only_access_ok
#                           must be true; unmap_spans_mappings=true means one cuMemUnmap
#                           may cover a whole run (the run-API proposal relies on it;
#                           the driver falls back to one call per chunk otherwise)
#   cuda-driver_tests.log   tests/test_gpu_arena.py: all pass, none skipped
#   cuda-driver_bench.log   bench/commit.py table: GiB/s of arena vs raw cuda-python at
#                           the same handle size, ratio arena/raw (goal <= 1.25x), and
#                           64 GiB arena creation vs raw reserve (+ zero-mapped reserve)
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
status=0
run() {  # run NAME SECONDS CMD...: log to $OUT/cuda-driver_NAME.log, remember failures
  local name="$1" secs="$2"; shift 2
  echo "== cuda-driver $name: $*"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/cuda-driver_$name.log" 2>&1
  local rc=$?
  tail -40 "$OUT/cuda-driver_$name.log"
  echo "== cuda-driver $name: rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}
run facts 60 bash -c "cd tests && python3 cuda_oracle.py"
cp "$OUT/cuda-driver_facts.log" "$OUT/cuda-driver_facts.json" 2>/dev/null || true
run tests 170 python3 -m pytest tests/test_gpu_arena.py -v -rs -p no:cacheprovider
run bench 110 python3 bench/commit.py --json "$OUT/cuda-driver_bench.json"
echo "cuda-driver overall status: $status"
exit $status
