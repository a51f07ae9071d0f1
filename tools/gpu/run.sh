#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step_* functions are called by name (bash run.sh --one)
# Every GPU check of jax_vmm, as named steps, in one call on the GPU machine:
#   bash tools/gpu/run.sh [STEP ...]          (no STEP: build info tests)
# Each step runs in its own process under a time limit and logs to $OUT/<step>.log
# (':' becomes '_'); the script prints each step's log tail and time, then one summary
# line per step. Exit status 1 when any step failed; a failed build skips the rest.
#
# Steps and what each checks:
#   build               pip install of this checkout (no build isolation, no deps); the
#                       "jax_vmm: CUDA" lines say whether the CUDA kernels were built; with
#                       .whl/nvidia_cudnn_frontend-*.whl present (pip download it here),
#                       the cuDNN attention backend is built from its headers, required
#   info                `python -m jax_vmm info` of the installed package (run from /tmp,
#                       not the source tree), nvidia-smi, cupy / cuda-python versions (GPU
#                       tests that write arena memory need cupy, the driver oracle cuda-python)
#   tests               the whole suite, verbose: every [gpu] param listed, skip reasons
#   tests:LAYER         one folder of tests/: core, drivers, scratch, ops, integration, example,
#                       sharding (4 host devices in child processes; 1- and 2-GPU tests)
#   tests:gpu           the GPU tests only (-m gpu), skip reasons listed: none should skip here
#                       but the two-GPU ones; TESTS="tests/ops tests/example" narrows it (to
#                       split the suite over calls of the device tool's 600 s); on an H100
#                       "tests/ops tests/scratch tests/sharding tests/core" takes ~375 s and
#                       "tests/integration tests/drivers tests/example" ~400 s: with the
#                       build's ~90 s, give the latter its own call or DEADLINE >= 520
#   tests:attention     tests/ops/test_attention.py, test_attention_v2.py and
#                       test_attention_semantics.py (S queries, q_lengths, window, softcap) -m gpu: the
#                       split-K (tensor-core, simple) and streaming kernels (bf16/fp16/fp8)
#                       against a float64 reference, NaN-prefilled outputs, forced plans,
#                       ring depths, determinism, capture + replay + growth
#   tests:kv_cache      the KV cache pytree (issue 10) -m gpu: tests/ops/test_kv_cache.py (the
#                       arena written in every mode, donated or not, eager / jit / scan of 64 /
#                       fori / while, attention after the write against float64, read back by
#                       a device-to-host memcpy; drops and clamped reads counted; identity-stripped and
#                       limits-ignored variants caught), the cache API's error rows F*, the
#                       example's GPU preset (jax_vmm cache against prealloc, no copy per step)
#                       and the command-buffer replay of a cache step
#   tests:memory        the memory tests (deferred release, commit ahead, sleep/wake,
#                       offload, kernels in flight over released pages, the driver tests)
#   facts               raw CUDA driver facts (tests/oracles/cuda_oracle.py) -> facts.json:
#                       read_only_access_ok must be true; unmap_spans_mappings=true means one
#                       cuMemUnmap may cover a whole run
#   sanitize            sanitize:hazard, sanitize:attention, sanitize:memory
#   sanitize:hazard     compute-sanitizer memcheck (API-error reports off: cuda-python probes
#                       entry points and gets "invalid argument" by design) on a trivial JAX
#                       program and on the scratch hazard scenario (the command-buffer test
#                       run as a script; under pytest the sanitizer makes XLA re-record the
#                       graph): 0 errors in grow and in retire mode; with the debug
#                       free-on-growth switch errors must be reported (the sanitizer sees the
#                       bug the scenario guards against); the pytest form (-k hazard_replay):
#                       0 sanitizer errors (its own zero-handler-call assertion may fail there)
#   sanitize:attention  compute-sanitizer memcheck on every decode-attention kernel variant,
#                       split-K and streaming (tools/gpu/attention_memcheck.py): 0 errors
#   sanitize:memory     compute-sanitizer memcheck on tools/gpu/memory_hazard.py: a kernel in
#                       flight while release() runs on its pages and ensure() maps new pages
#                       next to them (release safe: 0 errors), a commit under a raw XLA
#                       reader (commit safe: 0 errors); with the deferral removed (release
#                       unsafe) memcheck must report errors (or the run fail)
#   diag:hazard         XLA's command-buffer log around the hazard scenario (its RESULT line)
#   diag:example        XLA's command-buffer log of the main job at batch 16 (how often the
#                       decode block's command buffers were recorded against executed)
#   diag:serving        tools/gpu/profile_serving.py: the main job at batch 64 under JAX's
#                       profiler, jax_vmm and prealloc (each its own process): kernel time
#                       per part, and the device's idle gaps by the kernels around them
#   diag:host           bench/host_costs.py: the arena and raw VMM calls of a commit and
#                       a release, device idle and busy, and a cProfile of the main job at
#                       batch 64 (where its host time in ensure/release goes), and the zero
#                       mapping's share of a large commit -> host_costs.json (HOST_PARTS=4:
#                       only that part; HOST_SWAPS=32x8,256x1: its zero-piece cases)
#   diag:dispatch       bench/dispatch_costs.py: the main job at batch 64 with the
#                       dispatching thread's cache calls split into core calls and Python,
#                       and CPU seconds per thread -> dispatch_costs.json
#   example             examples/decode.py -> $OUT/example/
#   example:B           the gpu preset at batch B = 16 or 64 (3 requests per slot), decode
#                       blocks of 16 -> $OUT/example_bB/; B+release, B+aheadN (and both,
#                       B+release+ahead16) add --slot-memory release / --commit-ahead N;
#                       B+chunkM: --chunk-bytes M MiB (fewer, larger commits: what the
#                       page-table changes of the 2 MiB ones cost the step);
#                       example:prealloc16 / prealloc64 the cuDNN baseline; example:fp8, example:sleep (batch 16);
#                       example:shared / shared_no_ahead: --shared-prefix 4096 (commit ahead off);
#                       example:shared_kernels: shared_no_ahead on jax_vmm's attention kernels
#                       (JAX_VMM_ATTENTION=kernels): runs that repeat, so the token check is exact;
#                       example:hf1b: examples/generate.py on a 1B-shaped random Llama
#                       checkpoint (tools/make_hf_fixtures.py --preset 1b), bf16, both backends
#   diag:kv_write       bench/kv_write_overhead.py: a decode-size kv_write against XLA's
#                       .at[].set in a fori_loop, unrolled, one jit per write; with nsys on
#                       the machine, the CUDA API calls and kernels of the n = 1 case
#   diag:kv_write_ncu   bench/kv_write_kernel_times.py: the kv_write kernel's own time by
#                       Nsight Compute at 1..32768 tokens -> kv_write_kernel_times.json
#   diag:step           tools/gpu/profile_step.py: one decode step (32 layers, B16 T1k) by
#                       ablation (reads alone vs the whole step) and a jax.profiler trace
#                       summed per part (kv_write vs XLA's scatter, cuDNN, table read, gaps),
#                       with and without command buffers -> profile_step{,_nocb}/profile.json
#   diag:step8          the same at 8 layers, B4 T1k, B16 T1k and B16 T4k, prealloc+cudnn and
#                       vmm+cudnn, command buffers on -> profile_step8_bB_tT/profile.json
#   bench:attention_goals  bench/cudnn_attention.py: issue 28's goals in one run (decode grid,
#                       fp8, several queries; copy-bandwidth floor) -> attention_goals.json
#   bench:attention     bench/attention.py: copy-bandwidth floor, then the table -> bench_attention.json
#   bench:attention_options  bench/attention_options.py: S queries / window / softcap beside cuDNN
#                       -> bench_attention_options.json
#   bench:kv_write      bench/kv_write.py at 1 GiB and 32 GiB -> bench_kv_write.json
#   bench:commit        bench/commit.py: arena vs raw cuda-python, 64 GiB creation -> bench_commit.json
#   bench:decode        bench/decode.py -> decode.json, decode.png
#   bench:decode32      bench/decode.py --grid layers32: B 1/4/16/64 x T 1k/4k, prealloc+cudnn,
#                       vmm+cudnn, vmm+kernel, +us/layer -> decode32/decode.json
#   bench:decode8       the same at 8 layers -> decode8/decode.json
#   bench:step_loop     bench/step_loop.py: one step per call (write, write+attention,
#                       views+write with cuDNN), 2/8/32 layers, bf16 -> step_loop.log
#   bench:growth        bench/growth.py 16 -> 20 GiB -> growth/growth.json, growth.png
#   bench:capacity      bench/capacity.py: one decode step over 1 GiB and 32 GiB caches, as a
#                       ratio (arena: ~1.0) -> bench_capacity.json
#   bench:sleep         bench/sleep.py: 100 sleep/wake cycles of a 20 GiB cache -> bench_sleep.json
#   bench:multi_query   bench/cudnn_attention.py, several queries per sequence only: jax_vmm
#                       against JAX's cuDNN, padding-only and the equal-score split (best)
#   bench:seed          bench/commit.py --sections seed --repeats 9: against the seed's
#                       one-handle-per-extension code, with paired ratios -> seed.json;
#                       bench:seed_interleaved: jax_vmm's arena with layout="interleaved"
#   bench:shared_prefix bench/shared_prefix.py (the interleaved layout): time to first
#                       token and memory of a shared 4k prefix -> shared_prefix.json;
#                       bench:shared_prefix_per_layer: per-layer buffers;
#                       bench:shared_prefix_no_ahead: commit ahead off (--commit-ahead 0)
#   bench:equal_memory32[_interleaved]  bench/decode.py --layers 32 at B16 T1k and the
#                       equal-memory case (16 GiB), per-layer buffers or interleaved
#   bench:decode8_interleaved  bench:decode8 over an interleaved arena (no vmm+cudnn)
#   bench:main_job      bench/main_job.py: the main job at batch 16 and 64, both backends in
#                       one process, 3 rounds in alternating order -> main_job.json
#   bench               the seven benches
#   goals               the goals not established or missed by a hair: bench:multi_query
#                       bench:seed bench:shared_prefix and the main job at batch 16 and 64,
#                       both backends (more than one device call: split it with DEADLINE)
#   probe:kernels       bench/kernels_probe.py -> kernels.json: every decode-attention kernel
#                       (split-K, streaming, fp8) checked against float64 with NaN-prefilled
#                       outputs, then timed beside cuDNN and the copy/read ceilings per shape;
#                       kv_write: the tiled kernel, its token-kernel fallback and XLA's .at[].set,
#                       kv_write_fp8 (one table at the end; failed variants listed, exit 0)
#   probe:deferred_zeros  tools/gpu/cudnn_deferred_zeros_probe.py: cuDNN over arena layers
#                       with deferred zeros, lengths just short of chunk boundaries, each case
#                       in a child process: must print "PROBE no case faulted"
#   probe:commit_fill   tools/gpu/commit_fill_probe.py: the fill 0 -> 16 GiB of bench/commit.py's
#                       seed section by placement (from the buffer base or 2 MiB in) and call
#                       order, raw calls beside kv.ensure: whose is the fill's gap
#   probe:stream_ncu    Nsight Compute (needs hardware counters: Firecracker machines) of the
#                       streaming attention kernel at B32 T8k, bf16 and fp8 caches
#                       (tools/gpu/stream_kernel_ncu.py): DRAM %, issue rate, warps, occupancy
#   probe:attention_trace  tools/gpu/attention_trace.py: the kernels_probe step (3 layers) of
#                       the fp8 streaming kernel, bf16 cuDNN and bf16 streaming kernel under
#                       jax.profiler: per layer, wall vs device busy, kernels by name
#                       -> attention_trace.json
#   probe:row_read      tools/gpu/row_read_probe.py (cupy): read bandwidth of the streaming
#                       kernel's tile pattern (128- and 256-byte rows) in the kernel's tile
#                       order, heads-fastest and linear -> row_read.json
#   probe:views_barrier tools/gpu/views_barrier_ab.py: bench/_stack.py's vmm+cudnn loop with
#                       and without ordered_views' barrier, beside prealloc+cudnn (32
#                       layers): ms per step and checksums -> views_barrier.json
#   probe:step_loop_handlers  tools/gpu/step_loop_handlers.py: bench/step_loop.py's 32-layer
#                       write+attention step, arena and prealloc: per call, which handler
#                       stages run on the host (XLA re-records the command buffer each call)
#   probe:spanning      tools/gpu/spanning_layout_probe.py (plain JAX): cuDNN decode over a
#                       2 MiB page layout spanning every layer (paged mode) against dense
#                       per-layer arrays, 8 and 32 layers -> spanning.json
#   probe:interleaved   tools/gpu/interleaved_layout_probe.py (torch + cuDNN's Python
#                       frontend from .whl/): cuDNN decode over one (B, T, 2L, H, D) buffer,
#                       layer l a strided view, against compact per-layer arrays -> interleaved.json
#   probe               probe:kernels
#   all                 build info tests facts sanitize example bench probe
#
# Environment: OUT (default ./out), PYTHON (default python3), TAIL (log lines shown, 30),
# PYTEST_ARGS (added to every tests step, split into words), PYTEST_K (a -k expression,
# spaces allowed: PYTEST_K="fake_cuda or device_waits"), ARTIFACTS=1 (the command-buffer
# test keeps its XLA dump in $OUT/artifacts), LIMIT_<step> (seconds, ':' as '_': LIMIT_bench_decode=600),
# DEADLINE (seconds for the whole run: later steps get what is left, or are skipped),
# PACK=1 (write everything into $OUT/gpu-run.tar.gz plus $OUT/summary.txt: the device
# tool brings back 8 files at most).
set -uo pipefail
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$SELF")/../.." || exit 1  # the repo root
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the arena allocates outside XLA's pool

# -- the steps (each runs in its own process, output into its log) -----------------------

note() { [ -z "$*" ] || echo "SUMMARY: $*"; }  # for the step's summary line; returns 0

step_build() {
  # The cuDNN attention backend needs cudnn_frontend.h, which the GPU machine lacks and
  # cannot download: the nvidia-cudnn-frontend wheel travels in .whl/ (carry it), and its
  # headers are unpacked outside the source tree; the build then requires the backend.
  local fe=(.whl/nvidia_cudnn_frontend-*.whl)
  if [ -z "${JAX_VMM_CUDNN_FRONTEND_INCLUDE:-}" ] && [ -e "${fe[0]}" ]; then
    local target="${TMPDIR:-/tmp}/jax_vmm_cudnn_frontend"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$target" \
      "${fe[0]}" || return
    export JAX_VMM_CUDNN_FRONTEND_INCLUDE="$target/include" JAX_VMM_CUDNN="${JAX_VMM_CUDNN:-ON}"
  fi
  "$PY" -m pip install --no-build-isolation --no-deps -v . || return
  note "$(grep -E "jax_vmm: CUDA" "$LOG" | head -1)"
  note "$(grep -E "jax_vmm: cuDNN" "$LOG" | head -1)"
}

step_info() {
  (cd /tmp && "$PY" -m jax_vmm info) || return
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv || true
  "$PY" -c "import cupy; print('cupy', cupy.__version__)" || note "no cupy: GPU tests that write arena memory skip"
  "$PY" -c "import cuda.bindings as b; print('cuda-python', b.__version__)" || note "no cuda-python: no driver oracle"
}

pytest_run() {  # pytest arguments...
  local timeout_opt=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout=120)
  local k_opt=()
  [ -n "${PYTEST_K:-}" ] && k_opt=(-k "$PYTEST_K")
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  "$PY" -m pytest "$@" -v -p no:cacheprovider "${timeout_opt[@]}" "${k_opt[@]}" ${PYTEST_ARGS:-}
  local r=$?
  note "$(grep -E "(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s" "$LOG" | tail -1 | tr -d '=' | xargs)"
  return "$r"
}

step_tests() {
  [ -n "${ARTIFACTS:-}" ] && export JAX_VMM_TEST_ARTIFACTS="$RUN_DIR/artifacts"
  case "${1:-}" in
    "") pytest_run tests -ra ;;
    gpu)
      # shellcheck disable=SC2086  # TESTS is a list of paths
      pytest_run ${TESTS:-tests} -m gpu -rs ;;
    attention) pytest_run tests/ops/test_attention.py tests/ops/test_attention_v2.py \
      tests/ops/test_attention_semantics.py -m gpu -rs ;;
    kv_cache) pytest_run tests/ops/test_kv_cache.py tests/core/test_errors.py \
                tests/example/test_decode_example.py tests/integration/test_command_buffer_gpu.py \
                -m gpu -rs ;;
    memory) pytest_run tests/integration/test_memory_gpu.py tests/drivers tests/core/test_reclaim.py \
              tests/core/test_sleep.py tests/core/test_offload.py tests/core/test_commit_ahead.py -rs ;;
    *) [ -d "tests/$1" ] || { echo "no folder tests/$1"; return 2; }
       pytest_run "tests/$1" -ra ;;
  esac
}

step_facts() {
  "$PY" tests/oracles/cuda_oracle.py >"$RUN_DIR/facts.json" || return
  cat "$RUN_DIR/facts.json"
  note "$(tr -d ' \n' <"$RUN_DIR/facts.json" | grep -oE '"(read_only_access_ok|unmap_spans_mappings)":[a-z]+' | tr '\n' ' ')"
}

sanitizer() {  # prints the compute-sanitizer path, or nothing
  command -v compute-sanitizer && return
  local f
  for f in /usr/local/cuda*/bin/compute-sanitizer; do
    [ -x "$f" ] && { echo "$f"; return; }
  done
}

memcheck() {  # NAME EXPECT COMMAND...: one sanitizer run, its own log; EXPECT: clean |
  # errors (memcheck must report some) | sanitizer-clean (0 memcheck errors, the command
  # itself may fail). Returns 0 when the expectation held.
  local name=$1 expect=$2; shift 2  # EXPECT also: fails (memcheck errors or a failed run)
  local log="$RUN_DIR/${STEP_FILE}.$name.log"
  timeout 200 "$CS" --tool memcheck --report-api-errors no --error-exitcode 99 "$@" >"$log" 2>&1
  local r=$? summary ok=1
  summary=$(grep -E "ERROR SUMMARY" "$log" | tail -1)
  case "$expect" in
    clean) [ "$r" -eq 0 ] && ok=0 ;;
    errors) [[ "$summary" =~ ERROR\ SUMMARY:\ [1-9] ]] && ok=0 ;;
    fails) { [[ "$summary" =~ ERROR\ SUMMARY:\ [1-9] ]] || [ "$r" -ne 0 ]; } && [ "$r" -ne 124 ] && ok=0 ;;
    sanitizer-clean) [[ "$summary" =~ ERROR\ SUMMARY:\ 0\ errors ]] && [ "$r" -ne 124 ] && ok=0 ;;
  esac
  summary=${summary#*ERROR SUMMARY: }
  echo "-- memcheck $name (expected $expect): exit $r, ${summary:-no ERROR SUMMARY}, $([ "$ok" -eq 0 ] && echo ok || echo FAILED); log $log"
  grep -E "RESULT|passed|failed" "$log" | cut -c1-300 | tail -2
  [ "$ok" -eq 0 ] || tail -n 20 "$log"
  note "$name ${summary:-no ERROR SUMMARY}$([ "$ok" -eq 0 ] || echo " FAILED")"
  return "$ok"
}

step_sanitize() {
  CS="$(sanitizer)"
  [ -n "$CS" ] || { echo "compute-sanitizer not on PATH nor under /usr/local/cuda*/bin"; return 1; }
  local rc=0 hazard=tests/integration/test_command_buffer_gpu.py
  case "${1:-}" in
    hazard)
      export PYTHONPATH="tests:tests/oracles${PYTHONPATH:+:$PYTHONPATH}"  # the scenario imports conftest
      memcheck jax clean "$PY" -c "import jax.numpy as jnp; print('RESULT', float(jnp.arange(8.0).sum()))" || rc=1
      memcheck grow clean "$PY" "$hazard" hazard grow keep "$RUN_DIR/hazard_grow.json" || rc=1
      memcheck retire clean "$PY" "$hazard" hazard retire keep "$RUN_DIR/hazard_retire.json" || rc=1
      memcheck grow_free errors "$PY" "$hazard" hazard grow free "$RUN_DIR/hazard_grow_free.json" || rc=1
      memcheck pytest sanitizer-clean "$PY" -m pytest "$hazard" -k hazard_replay -q -p no:cacheprovider || rc=1 ;;
    attention)
      memcheck attention clean "$PY" tools/gpu/attention_memcheck.py || rc=1 ;;
    memory)
      export HAZARD_SMALL=1  # kernels run far slower under the sanitizer
      memcheck release clean "$PY" tools/gpu/memory_hazard.py release safe || rc=1
      memcheck commit clean "$PY" tools/gpu/memory_hazard.py commit safe || rc=1
      memcheck release_unsafe fails "$PY" tools/gpu/memory_hazard.py release unsafe || rc=1 ;;
    *) echo "unknown sanitize step ${1:-} (hazard, attention, memory)"; return 2 ;;
  esac
  return "$rc"
}

step_diag() {
  if [ "${1:-}" = example ]; then  # does the decode block replay as a graph? XLA says
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_conversion_pass=2 \
      "$PY" examples/decode.py --preset gpu --batch 16 --requests 48 --no-progress --no-plot \
      --out "$RUN_DIR/diag_example" 2>"$RUN_DIR/diag_example.xla.log"
    local r=$?
    echo "XLA command-buffer log lines by kind ($RUN_DIR/diag_example.xla.log):"
    grep -oE "[A-Za-z]+ (a |the )?command buffer[a-z ]{0,24}" "$RUN_DIR/diag_example.xla.log" \
      | sort | uniq -c | sort -rn | head -20
    return "$r"
  fi
  if [ "${1:-}" = dispatch ]; then
    "$PY" bench/dispatch_costs.py --batch 64 --json "$RUN_DIR/dispatch_costs.json"
    return
  fi
  if [ "${1:-}" = kv_write ]; then
    "$PY" bench/kv_write_overhead.py --json "$RUN_DIR/kv_write_overhead.json"
    if command -v nsys >/dev/null; then  # the API calls and kernels of the loop at n = 1
      nsys profile -q -o "$RUN_DIR/kv_write" --force-overwrite true -t cuda \
        "$PY" bench/kv_write_overhead.py --sizes 1 &&
        nsys stats -q -r cuda_api_sum,cuda_gpu_kern_sum "$RUN_DIR/kv_write.nsys-rep" | head -60
    fi
    return
  fi
  if [ "${1:-}" = kv_write_ncu ]; then
    "$PY" bench/kv_write_kernel_times.py --json "$RUN_DIR/kv_write_kernel_times.json"
    return
  fi
  if [ "${1:-}" = step ]; then  # one decode step's time by part, graphs on and off
    "$PY" tools/gpu/profile_step.py --out "$RUN_DIR/profile_step" || return
    "$PY" tools/gpu/profile_step.py --no-command-buffers --out "$RUN_DIR/profile_step_nocb"
    return
  fi
  if [ "${1:-}" = step8 ]; then  # the 8-layer points where the step misses 1.02 (issue 29)
    local shape
    for shape in "4 1024" "16 1024" "16 4096"; do
      set -- $shape
      "$PY" tools/gpu/profile_step.py --layers 8 --batch "$1" --context "$2" \
        --variants prealloc+cudnn vmm+cudnn --out "$RUN_DIR/profile_step8_b$1_t$2" || return
    done
    return
  fi
  if [ "${1:-}" = serving ]; then  # the main job's device time by part and its idle gaps
    local be
    for be in jax_vmm prealloc; do
      "$PY" tools/gpu/profile_serving.py --out "$RUN_DIR/profile_serving_$be" -- --preset gpu \
        --block 16 --batch 64 --requests 192 --backend "$be" | grep -vE "^ {6}" || return
    done
    return
  fi
  if [ "${1:-}" = host ]; then
    "$PY" bench/host_costs.py --batch 64 --json "$RUN_DIR/host_costs.json" \
      ${HOST_PARTS:+--parts "$HOST_PARTS"} ${HOST_SWAPS:+--swaps "$HOST_SWAPS"}
    return
  fi
  [ "${1:-}" = hazard ] || { echo "unknown diag step ${1:-} (hazard, example, host, dispatch, kv_write, kv_write_ncu, step, step8, serving)"; return 2; }
  PYTHONPATH="tests:tests/oracles${PYTHONPATH:+:$PYTHONPATH}" TF_CPP_MIN_LOG_LEVEL=0 \
    TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_conversion_pass=2 \
    "$PY" tests/integration/test_command_buffer_gpu.py hazard grow keep "$RUN_DIR/diag_hazard.json"
  local r=$?
  note "$(grep RESULT "$LOG" | cut -c1-300)"
  return "$r"
}

step_example() {
  # The issue-12 main-job runs: the gpu preset at batch B (3 requests per slot), jax_vmm
  # or prealloc (cuDNN), and the fp8 / sleep-wake variants at batch 16.
  # --warmup: both backends serve the requests once untimed, so the first execution of each
  # program (jax_vmm's cuDNN graph builds) is not in the timed run.
  local ex=(examples/decode.py --preset gpu --no-progress --warmup)
  case "${1:-}" in
    "") "$PY" examples/decode.py --no-progress --out "$RUN_DIR/example" ;;
    16|64|16+*|64+*)  # 64+release+ahead16: --slot-memory release --commit-ahead 16
      local b=${1%%+*} extra=() w
      IFS=+ read -r -a words <<<"${1#"$b"}"
      for w in "${words[@]}"; do
        case "$w" in
          "") ;;
          release|keep) extra+=(--slot-memory "$w") ;;
          ahead*) extra+=(--commit-ahead "${w#ahead}") ;;
          chunk*) extra+=(--chunk-bytes $(("${w#chunk}" * 1048576))) ;;
          *) echo "unknown example option $w (release, keep, aheadN, chunkMiB)"; return 2 ;;
        esac
      done
      "$PY" "${ex[@]}" --batch "$b" --requests $((3 * b)) "${extra[@]}" \
        --out "$RUN_DIR/example_b${1//+/_}" ;;
    prealloc16|prealloc64)
      local b=${1#prealloc}
      "$PY" "${ex[@]}" --backend prealloc --batch "$b" --requests $((3 * b)) \
        --out "$RUN_DIR/example_prealloc_b$b" ;;
    fp8) "$PY" "${ex[@]}" --kv-dtype fp8 --out "$RUN_DIR/example_fp8" ;;
    sleep) "$PY" "${ex[@]}" --sleep-every 8 --out "$RUN_DIR/example_sleep" ;;
    shared|shared_no_ahead|shared_kernels)  # issue 32 in the engine: a 4k prefix shared by every request
      local ahead=() attention=()
      [ "$1" != shared ] && ahead=(--commit-ahead 0)
      # jax_vmm's kernels repeat themselves run to run (cuDNN does not): exact token checks
      [ "$1" = shared_kernels ] && attention=(JAX_VMM_ATTENTION=kernels)
      env "${attention[@]}" "$PY" "${ex[@]}" --shared-prefix 4096 "${ahead[@]}" \
        --out "$RUN_DIR/example_$1" ;;
    hf1b)  # issue 14: a Llama-3.2-1B-shaped random checkpoint, bf16, 16 prompts x 256 tokens
      "$PY" tools/make_hf_fixtures.py --preset 1b --out /tmp/llama1b || return
      local prompts=() i backend
      for i in $(seq 1 16); do prompts+=(--prompt "request $i: the quick brown fox jumps"); done
      for backend in jax_vmm prealloc; do
        "$PY" examples/generate.py --model /tmp/llama1b --dtype bfloat16 --max-new-tokens 256 \
          --batch 16 --backend "$backend" "${prompts[@]}" --json "$RUN_DIR/hf1b_$backend.json" \
          | tail -n 4 || return
      done ;;
    *) echo "unknown example ${1:-} (16, 64, prealloc16, prealloc64, fp8, sleep, shared, shared_no_ahead, shared_kernels, hf1b)"; return 2 ;;
  esac
}

step_bench() {
  case "${1:-}" in
    attention|attention_options|kv_write|commit|sleep|capacity)
      "$PY" "bench/$1.py" --json "$RUN_DIR/bench_$1.json" ;;
    decode) "$PY" bench/decode.py --out "$RUN_DIR" ;;
    decode32) "$PY" bench/decode.py --grid layers32 --out "$RUN_DIR/decode32" ;;
    decode8) "$PY" bench/decode.py --grid layers8 --out "$RUN_DIR/decode8" ;;
    step_loop) "$PY" bench/step_loop.py --layers 2 8 32 --calls 300 ;;
    growth) "$PY" bench/growth.py --out "$RUN_DIR/growth" ;;
    multi_query) "$PY" bench/cudnn_attention.py --batches "" --json "$RUN_DIR/multi_query.json" ;;
    attention_goals) "$PY" bench/cudnn_attention.py --json "$RUN_DIR/attention_goals.json" ;;
    seed) "$PY" bench/commit.py --sections seed --repeats 9 --json "$RUN_DIR/seed.json" ;;
    seed_interleaved)
      "$PY" bench/commit.py --sections seed --repeats 9 --kv-layout interleaved \
        --json "$RUN_DIR/seed_interleaved.json" ;;
    shared_prefix) "$PY" bench/shared_prefix.py --json "$RUN_DIR/shared_prefix.json" ;;
    shared_prefix_per_layer)
      "$PY" bench/shared_prefix.py --kv-layout per_layer \
        --json "$RUN_DIR/shared_prefix_per_layer.json" ;;
    shared_prefix_no_ahead)
      "$PY" bench/shared_prefix.py --commit-ahead 0 --json "$RUN_DIR/shared_prefix_no_ahead.json" ;;
    decode8_interleaved)
      "$PY" bench/decode.py --grid layers8 --kv-layout interleaved --out "$RUN_DIR/decode8i" ;;
    equal_memory32|equal_memory32_interleaved)  # issue 29's equal-memory case (16 GiB)
      local layout=per_layer
      [ "$1" = equal_memory32_interleaved ] && layout=interleaved
      "$PY" bench/decode.py --layers 32 --batches 16 --contexts 1024 --no-oom-case \
        --kv-layout "$layout" --out "$RUN_DIR/$1" ;;
    main_job) "$PY" bench/main_job.py --json "$RUN_DIR/main_job.json" ;;
    *) echo "unknown bench ${1:-} (attention, attention_options, kv_write, commit, decode, decode32, decode8, decode8_interleaved, step_loop, growth, multi_query, attention_goals, seed, seed_interleaved, shared_prefix, shared_prefix_per_layer, shared_prefix_no_ahead, equal_memory32, equal_memory32_interleaved, main_job, sleep, capacity)"; return 2 ;;
  esac
}

step_probe() {
  case "${1:-}" in
    kernels)
      "$PY" bench/kernels_probe.py --json "$RUN_DIR/kernels.json" || return
      note "$(grep -E "^correctness: " "$LOG" | tail -1)" ;;
    deferred_zeros)
      "$PY" tools/gpu/cudnn_deferred_zeros_probe.py || return
      note "$(grep -E "^PROBE " "$LOG" | tail -1)" ;;
    commit_fill) "$PY" tools/gpu/commit_fill_probe.py ;;
    step_loop_handlers) "$PY" tools/gpu/step_loop_handlers.py ;;
    stream_ncu)
      ncu --clock-control none -k regex:StreamKernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section Occupancy "$PY" tools/gpu/stream_kernel_ncu.py both ;;
    attention_trace) "$PY" tools/gpu/attention_trace.py --json "$RUN_DIR/attention_trace.json" ;;
    row_read) "$PY" tools/gpu/row_read_probe.py --json "$RUN_DIR/row_read.json" ;;
    views_barrier) "$PY" tools/gpu/views_barrier_ab.py --json "$RUN_DIR/views_barrier.json" ;;
    spanning) "$PY" tools/gpu/spanning_layout_probe.py --json "$RUN_DIR/spanning.json" ;;
    interleaved) "$PY" tools/gpu/interleaved_layout_probe.py --json "$RUN_DIR/interleaved.json" ;;
    *) echo "unknown probe ${1:-} (kernels, deferred_zeros, commit_fill, step_loop_handlers, stream_ncu, attention_trace, row_read, views_barrier, spanning, interleaved)"; return 2 ;;
  esac
}

# -- the runner ---------------------------------------------------------------------------

limit_of() {  # STEP -> seconds
  local var="LIMIT_${1//[^A-Za-z0-9_]/_}" limit
  case "$1" in
    build|tests|tests:*|sanitize:hazard|bench:attention|bench:attention_options|bench:decode|bench:decode32|probe:kernels|diag:step|diag:step8|bench:attention_goals) limit=600 ;;
    sanitize:attention|sanitize:memory|bench:kv_write|bench:growth|bench:sleep|bench:capacity) limit=400 ;;
    example|bench:commit) limit=300 ;;
    info|facts|diag:*) limit=150 ;;
    *) limit=600 ;;
  esac
  echo "${!var:-$limit}"
}

expand() {  # STEP -> the steps it stands for
  case "$1" in
    sanitize) echo sanitize:hazard sanitize:attention sanitize:memory ;;
    bench) echo bench:attention bench:kv_write bench:commit bench:decode bench:growth bench:sleep bench:capacity ;;
    probe) echo probe:kernels ;;
    goals) echo bench:multi_query bench:seed bench:shared_prefix example:16 example:prealloc16 \
                example:64 example:prealloc64 ;;
    all) echo build info tests facts; expand sanitize; echo example; expand bench; expand probe ;;
    *) echo "$1" ;;
  esac
}

if [ "${1:-}" = --one ]; then  # a child: run one step (stdout is its log)
  name=$2 fn="step_${2%%:*}" arg=""
  [[ "$name" == *:* ]] && arg="${name#*:}"
  declare -F "$fn" >/dev/null || { echo "unknown step $name (see the header of $SELF)"; exit 2; }
  "$fn" ${arg:+"$arg"}
  exit $?
fi

OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
RUN_DIR="$OUT"
[ -n "${PACK:-}" ] && RUN_DIR="$(mktemp -d)"
export PY RUN_DIR

steps=()
for s in "${@:-build info tests}"; do
  for e in $s; do
    while read -r -a parts; do steps+=("${parts[@]}"); done < <(expand "$e")
  done
done

summary=()
failed=0
build_failed=0
t_all=$SECONDS
for name in "${steps[@]}"; do
  export STEP_FILE="${name//:/_}" LOG="$RUN_DIR/${name//:/_}.log"
  if [ "$build_failed" -eq 1 ]; then
    summary+=("$(printf '%-20s %-7s %6s  %s' "$name" SKIPPED - "the build failed")")
    continue
  fi
  limit=$(limit_of "$name")
  if [ -n "${DEADLINE:-}" ]; then  # the whole run ends by then, so that the pack is made
    left=$((DEADLINE - (SECONDS - t_all)))
    if [ "$left" -lt 15 ]; then
      summary+=("$(printf '%-20s %-7s %6s  %s' "$name" SKIPPED - "DEADLINE=$DEADLINE s reached")")
      continue
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name (limit $limit s)"
  t0=$SECONDS
  timeout -k 10 "$limit" bash "$SELF" --one "$name" >"$LOG" 2>&1
  r=$?
  dt=$((SECONDS - t0))
  tail -n "${TAIL:-30}" "$LOG"
  detail=$(grep -E "^SUMMARY: " "$LOG" | sed 's/^SUMMARY: //' | paste -sd ';' | sed 's/;/; /g' | cut -c1-200)
  [ "$r" -ne 0 ] && [ -z "$detail" ] && detail=$(grep -v '^\s*$' "$LOG" | tail -1 | cut -c1-200)
  [ "$r" -eq 124 ] || [ "$r" -eq 137 ] && detail="timed out after $limit s${detail:+; $detail}"
  if [ "$r" -eq 0 ]; then result=ok; else result="FAILED"; failed=1; fi
  [ "$name" = build ] && [ "$r" -ne 0 ] && build_failed=1
  echo "== $name: exit $r after $dt s"
  summary+=("$(printf '%-20s %-7s %5ss  %s' "$name" "$result" "$dt" "$detail")")
done

{
  echo "== summary ($((SECONDS - t_all)) s; logs in $RUN_DIR)"
  printf '%s\n' "${summary[@]}"
} | tee "$RUN_DIR/summary.txt"
if [ -n "${PACK:-}" ]; then
  tar -czf "$OUT/gpu-run.tar.gz" -C "$RUN_DIR" . && cp "$RUN_DIR/summary.txt" "$OUT/summary.txt" &&
    rm -rf "$RUN_DIR" && echo "packed into $OUT/gpu-run.tar.gz"
fi
exit "$failed"
