#!/usr/bin/env bash
# The CPU+GPU arena suite (issue 2) on the GPU box, after the lead's
# `python3 -m pip install --no-build-isolation --no-deps .`. Run from the repo root.
# Every device-generic test runs twice there: [cpu] and [gpu]. Logs go to $OUT.
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
FILES="tests/test_arena.py tests/test_kv_arena.py tests/test_errors.py tests/test_concurrency.py"
python3 -c "import cupy, cuda.bindings; print('cupy', cupy.__version__)" 2>&1 | tee "$OUT/tests_env.log"
# 1) the GPU params only, verbose, so each [gpu] result is listed
timeout 400 python3 -m pytest $FILES -k gpu -v -rsx -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.log" | tail -60
# 2) everything (cpu + gpu params), counts only
timeout 300 python3 -m pytest $FILES -q -rsx -p no:cacheprovider 2>&1 | tee "$OUT/tests_all.log" | tail -25
