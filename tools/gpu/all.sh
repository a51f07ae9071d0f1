#!/usr/bin/env bash
# One GPU session: build, info, the whole test suite, then each feature's GPU script.
# Usage (on the GPU box, repo root): bash tools/gpu/all.sh [feature ...]
# Logs go to $OUT (default ./out).
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
t0=$(date +%s)
echo "== build" | tee "$OUT/build.log"
python3 -m pip install --no-build-isolation --no-deps -v . >>"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
grep -E "jax_vmm: CUDA|error" "$OUT/build.log" | head -20
echo "build took $(( $(date +%s) - t0 )) s"
cd /tmp  # import the installed package, not the source tree
python3 -m jax_vmm info 2>&1 | tee "$OUT/info.log"
cd - >/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee -a "$OUT/info.log"
echo "== tests"
timeout 400 python3 -m pytest tests -v -ra --timeout=120 -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40
for f in "$@"; do
  echo "== feature $f"
  timeout 300 bash "tools/gpu/$f.sh" 2>&1 | tee "$OUT/$f.log" | tail -40
done
echo "total $(( $(date +%s) - t0 )) s"
