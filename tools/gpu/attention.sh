#!/usr/bin/env bash
# Issue 5 on the GPU: decode attention (ffi/src/ops/attention/) -- tests, a memcheck
# run, the benchmark. Run from the repo root after
# `python3 -m pip install --no-build-isolation --no-deps .`:
#   bash tools/gpu/attention.sh [test] [memcheck] [bench]      (default: all three)
# Logs and JSON go to $OUT/attention/ (default ./out/attention). Exit status != 0 when a
# step failed.
#
#   test.log       pytest tests/test_attention.py -m gpu: every GPU test passes, none
#                  skipped (tensor-core and simple kernels against a float64 reference;
#                  NaN-prefilled outputs; forced plans; capture + replay + growth)
#   memcheck.log   compute-sanitizer memcheck on a few calls of every kernel variant:
#                  "ERROR SUMMARY: 0 errors"
#   bench.log      bench/attention.py: the floor first, then the table; bench.json
set -uo pipefail
OUT="${OUT:-$PWD/out}/attention"
source "$(dirname "$0")/common.sh"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(test memcheck bench)

MEMCHECK_PY='
import jax, jax.numpy as jnp, numpy as np
from jax_vmm.attention import _decode_attention, attention_stats
rng = np.random.default_rng(0)
for (B, T, Hq, Hkv, D, dtype, impl) in [(3, 300, 8, 2, 128, jnp.bfloat16, "tensor_core"),
        (2, 200, 12, 1, 64, jnp.float16, "tensor_core"), (2, 64, 4, 4, 256, jnp.bfloat16, "tensor_core"),
        (2, 100, 6, 3, 80, jnp.float32, "simple")]:
    q = jnp.asarray(rng.standard_normal((B, Hq, D), dtype=np.float32)).astype(dtype)
    k = jnp.asarray(rng.standard_normal((B, T, Hkv, D), dtype=np.float32)).astype(dtype)
    lens = jnp.asarray([T, 1] + [T // 3] * (B - 2), jnp.int32)
    for ws in ("scratch", "xla"):
        out = _decode_attention(q, k, k, lens, impl=impl, workspace=ws, chunk=48, splits=2)
        assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
print("memcheck workload done", attention_stats())
'

for s in "${steps[@]}"; do
  case "$s" in
    test) run test 400 "$PY" -m pytest tests/test_attention.py -m gpu -v -rs -p no:cacheprovider ;;
    memcheck)
      CS="$(sanitizer)"
      if [ -n "$CS" ]; then
        run memcheck 400 "$CS" --tool memcheck --report-api-errors no "$PY" -c "$MEMCHECK_PY"
      else
        echo "== memcheck: compute-sanitizer not on PATH, skipped"
      fi ;;
    bench) run bench 600 "$PY" bench/attention.py --json "$OUT/bench.json" ;;
    *) echo "unknown step $s (expected test, memcheck, bench)"; rc=1 ;;
  esac
done
exit $rc
