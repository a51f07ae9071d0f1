#!/usr/bin/env bash
# Issue 4 on the GPU: the example, its reference test, and the two benchmarks.
# Usage (repo root, after `python3 -m pip install --no-build-isolation --no-deps .`):
#   bash tools/gpu/model.sh [example] [test] [decode] [growth]     (default: all four)
# Logs, JSON and plots go to $OUT/model/ (default ./out/model).
set -uo pipefail
OUT="${OUT:-$PWD/out}/model"
source "$(dirname "$0")/common.sh"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(example test decode growth)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for s in "${steps[@]}"; do
  case "$s" in
    example) run example 240 python3 examples/decode.py --no-progress --out "$OUT/example" ;;
    test) run test 300 python3 -m pytest tests/test_decode_example.py -q -ra -p no:cacheprovider ;;
    decode) run bench_decode 420 python3 bench/decode.py --out "$OUT/bench_decode" ;;
    growth) run bench_growth 300 python3 bench/growth.py --out "$OUT/bench_growth" ;;
    *) echo "unknown step $s (example test decode growth)"; rc=1 ;;
  esac
done
exit $rc
