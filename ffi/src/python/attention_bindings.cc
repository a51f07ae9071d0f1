// Python-facing helpers of the decode-attention feature:
//   attention_plan(...)          the split-K plan (Python sizes the optional XLA workspace
//                                with it and passes chunk/splits explicitly)
//   attention_stream_plan(...)   the streaming kernel's plan (Python reserves its scratch)
//   attention_stats()            handler counters (calls, captured calls, kernel choice)
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "jax_vmm/errors.h"
#include "ops/attention/attention_plan.h"
#include "ops/attention/attention_stats.h"
#include "ops/attention/stream_plan.h"
#include "python/bindings.h"

namespace nb = nanobind;

namespace jax_vmm {
namespace {

// The static shapes of a plan; InvalidArgument (ValueError) when unusable.
attention::Shapes CheckedShapes(int64_t batch, int64_t max_tokens, int64_t q_heads,
                                int64_t kv_heads, int64_t head_dim) {
  const attention::Shapes s{batch, max_tokens, q_heads, kv_heads, head_dim};
  if (std::string err = attention::ValidateShapes(s); !err.empty()) {
    throw InvalidArgument("decode_attention: " + err);
  }
  return s;
}

}  // namespace

void BindAttention(nb::module_& m) {
  using namespace jax_vmm::attention;
  m.def(
      "attention_plan",
      [](int64_t batch, int64_t max_tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
         int64_t parallel_units, int64_t chunk, int64_t splits, int64_t q_len) {
        Shapes s = CheckedShapes(batch, max_tokens, q_heads, kv_heads, head_dim);
        s.q_len = q_len;
        if (std::string err = ValidateShapes(s); !err.empty()) {
          throw InvalidArgument("attention: " + err);
        }
        const Plan p = MakePlan(s, parallel_units, chunk, splits);
        nb::dict d;
        d["chunk"] = p.chunk;
        d["splits"] = p.splits;
        d["head_group"] = p.head_group;
        d["row_blocks"] = p.row_blocks;
        d["max_chunks"] = p.max_chunks;
        d["workspace_bytes"] = p.workspace_bytes;
        return d;
      },
      nb::arg("batch"), nb::arg("max_tokens"), nb::arg("q_heads"), nb::arg("kv_heads"),
      nb::arg("head_dim"), nb::arg("parallel_units"), nb::arg("chunk") = 0, nb::arg("splits") = 0,
      nb::arg("q_len") = 1,
      "Split-K plan of decode_attention (q_len: query rows per sequence, jax_vmm attention) "
      "for static shapes (see "
      "ffi/src/ops/attention/attention_plan.h).");

  m.def(
      "attention_stream_plan",
      [](int64_t batch, int64_t max_tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
         int64_t storage_bytes, int64_t sm_count, int64_t ctas, int64_t min_tiles) {
        const Shapes s = CheckedShapes(batch, max_tokens, q_heads, kv_heads, head_dim);
        const stream::Plan p = stream::MakeStreamPlan(
            s, storage_bytes, stream::DefaultCtas(sm_count, head_dim, storage_bytes), ctas,
            min_tiles);
        nb::dict d;
        d["ctas"] = p.ctas;
        d["head_group"] = p.head_group;
        d["unit_groups"] = p.unit_groups;
        d["min_tiles"] = p.min_tiles;
        d["tile_tokens"] = p.tile_tokens;
        d["workspace_bytes"] = p.workspace_bytes;
        d["unsupported"] = stream::Unsupported(s);
        return d;
      },
      nb::arg("batch"), nb::arg("max_tokens"), nb::arg("q_heads"), nb::arg("kv_heads"),
      nb::arg("head_dim"), nb::arg("storage_bytes"), nb::arg("sm_count"), nb::arg("ctas") = 0,
      nb::arg("min_tiles") = 0,
      "Plan of the streaming decode attention for static shapes (see "
      "ffi/src/ops/attention/stream_plan.h); sm_count 0 plans for the CPU model.");

  m.def(
      "attention_stats",
      []() {
        Counters& c = GetCounters();
        nb::dict d;
        d["cpu_calls"] = c.cpu_calls.load();
        d["cuda_initialize_calls"] = c.cuda_initialize_calls.load();
        d["cuda_execute_calls"] = c.cuda_execute_calls.load();
        d["cuda_captured_calls"] = c.cuda_captured_calls.load();
        d["cuda_tensor_core_launches"] = c.cuda_tensor_core_launches.load();
        d["cuda_simple_launches"] = c.cuda_simple_launches.load();
        return d;
      },
      "Counters of the decode-attention handlers (process-wide).");
}

}  // namespace jax_vmm
