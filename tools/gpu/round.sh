#!/usr/bin/env bash
# A full GPU round in one call: build + all tests, then the benchmarks. Logs in $OUT.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests -v -ra --timeout=120 -p no:cacheprovider ${PYTEST_ARGS:-} >"$OUT/tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25
echo "tests done $(( $(date +%s) - t0 )) s"
for b in ${BENCHES:-}; do
  case $b in
    attention) timeout 200 python3 bench/attention.py --json "$OUT/attention.json" >"$OUT/bench_attention.log" 2>&1 ;;
    kv_write) timeout 150 python3 bench/kv_write.py --json "$OUT/kv_write.json" >"$OUT/bench_kv_write.log" 2>&1 ;;
    commit) timeout 100 python3 bench/commit.py --json "$OUT/commit.json" >"$OUT/bench_commit.log" 2>&1 ;;
    decode) timeout 250 python3 bench/decode.py --out "$OUT/decode" >"$OUT/bench_decode.log" 2>&1 ;;
    growth) timeout 150 python3 bench/growth.py --out "$OUT/growth" >"$OUT/bench_growth.log" 2>&1 ;;
  esac
  echo "bench $b rc=$? $(( $(date +%s) - t0 )) s"; tail -25 "$OUT/bench_$b.log"
done
