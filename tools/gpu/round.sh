#!/usr/bin/env bash
# A full GPU round in one call: build + all tests, then the benchmarks. Logs in $OUT.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# ARTIFACTS=1: keep the XLA dump of the command-buffer test (about 100 files) in $OUT.
[ -n "${ARTIFACTS:-}" ] && export JAX_VMM_TEST_ARTIFACTS="$OUT/artifacts"
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests -v -ra --timeout=120 -p no:cacheprovider ${PYTEST_ARGS:-} >"$OUT/tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25
echo "tests done $(( $(date +%s) - t0 )) s"
if [ -n "${DIAG:-}" ]; then  # XLA's command-buffer log around the scratch hazard scenario
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_conversion_pass=2 \
    timeout 120 python3 tests/test_command_buffer_gpu.py hazard grow keep "$OUT/hazard.json" \
    >"$OUT/diag_hazard.log" 2>&1
  echo "diag rc=$?"; grep RESULT "$OUT/diag_hazard.log" | cut -c1-400
fi
if [ -n "${SANITIZE:-}" ]; then  # compute-sanitizer memcheck on the hazard scenario
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)  # as common.sh
  san() {  # name, then the command to check
    local name=$1; shift
    # API errors are not reported: cuda-python's driver bindings (the tests' oracle) probe
    # entry points with cuGetProcAddress and get "invalid argument" by design.
    timeout 150 "$CS" --tool memcheck --report-api-errors no --error-exitcode 99 "$@" \
      >"$OUT/sanitizer_$name.log" 2>&1
    echo "compute-sanitizer $name rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_$name.log" | tail -1)"
    grep -E "RESULT|passed|failed" "$OUT/sanitizer_$name.log" | cut -c1-300 | tail -2
  }
  san jax python3 -c "import jax, jax.numpy as jnp; print('RESULT', float(jnp.arange(8.0).sum()))"
  for m in grow retire; do
    san "hazard_$m" python3 tests/test_command_buffer_gpu.py hazard $m keep "$OUT/san_$m.json"
  done
  san "hazard_grow_free" python3 tests/test_command_buffer_gpu.py hazard grow free "$OUT/san_free.json"
  san pytest_hazard python3 -m pytest tests/test_command_buffer_gpu.py -k hazard_replay -q -p no:cacheprovider
fi
for b in ${BENCHES:-}; do
  case $b in
    attention) timeout 200 python3 bench/attention.py --json "$OUT/attention.json" >"$OUT/bench_attention.log" 2>&1 ;;
    kv_write) timeout 150 python3 bench/kv_write.py --json "$OUT/kv_write.json" >"$OUT/bench_kv_write.log" 2>&1 ;;
    commit) timeout 100 python3 bench/commit.py --json "$OUT/commit.json" >"$OUT/bench_commit.log" 2>&1 ;;
    decode) timeout 250 python3 bench/decode.py --out "$OUT" >"$OUT/bench_decode.log" 2>&1 ;;
    growth) timeout 150 python3 bench/growth.py --out "$OUT/growth" >"$OUT/bench_growth.log" 2>&1 ;;
  esac
  echo "bench $b rc=$? $(( $(date +%s) - t0 )) s"; tail -25 "$OUT/bench_$b.log"
done
