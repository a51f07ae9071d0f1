#include "python/cudnn_bindings.h"

#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ops/attention/cudnn/cudnn_attention.h"
#include "ops/attention/cudnn/cudnn_library.h"
#include "ops/attention/cudnn/cudnn_sdpa.h"

namespace nb = nanobind;

namespace jax_vmm {

void BindCudnn(nb::module_& m) {
  m.def(
      "cudnn_load",
      [](const std::string& cudnn_hint, const std::string& cudart_hint) {
        nb::gil_scoped_release release;
        return cudnn::Load(cudnn_hint, cudart_hint);
      },
      nb::arg("cudnn_hint") = "", nb::arg("cudart_hint") = "",
      "Load libcudnn for the cuDNN attention backend (the one already in the process, else "
      "cudnn_hint, else libcudnn.so.9 by name). Returns '' on success, else why not.");
  m.def(
      "cudnn_prepare",
      [](int device, int io, int64_t batch, int64_t q_tokens, int64_t max_tokens,
         int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t window, float softcap,
         float scale) {
        cudnn::SdpaKey key;
        key.device = device;
        key.io = io == 0 ? cudnn::IoType::kBF16 : cudnn::IoType::kF16;
        key.batch = batch;
        key.q_tokens = q_tokens;
        key.max_tokens = max_tokens;
        key.q_heads = q_heads;
        key.kv_heads = kv_heads;
        key.head_dim = head_dim;
        key.window = window;
        key.softcap = softcap;
        key.scale = scale;
        const cudnn::SdpaGraph* graph = nullptr;
        std::string err;
        {
          nb::gil_scoped_release release;
          err = cudnn::GetGraph(key, /*may_build=*/true, &graph);
        }
        if (!err.empty()) throw std::runtime_error(err);
        return cudnn::WorkspaceBytes(*graph);
      },
      nb::arg("device"), nb::arg("io"), nb::arg("batch"), nb::arg("q_tokens"),
      nb::arg("max_tokens"), nb::arg("q_heads"), nb::arg("kv_heads"), nb::arg("head_dim"),
      nb::arg("window"), nb::arg("softcap"), nb::arg("scale"),
      "Build (or find) the cuDNN graph of one attention configuration on CUDA device "
      "`device` (io 0 bfloat16, 1 float16) now, outside any capture, and return its "
      "workspace bytes. Raises RuntimeError with cuDNN's message when cuDNN cannot run it.");
  m.def(
      "cudnn_info",
      []() {
        const cudnn::LibraryInfo i = cudnn::Info();
        nb::dict d;
        d["loaded"] = i.loaded;
        d["version"] = i.version;
        d["path"] = i.path;
        d["how"] = i.how;
        d["cudart"] = i.cudart;
        d["error"] = i.error;
        d["compiled_version"] = i.compiled_version;
        d["frontend_version"] = i.frontend_version;
        return d;
      },
      "What the cuDNN attention backend loaded: version, path, errors, and the cuDNN and "
      "frontend versions it was compiled against.");
  m.def(
      "cudnn_attention_stats",
      []() {
        const cudnn::SdpaStats s = cudnn::Stats();
        const cudnn::HandlerStats h = cudnn::GetHandlerStats();
        nb::dict d;
        d["graphs_built"] = s.graphs_built;
        d["build_failures"] = s.build_failures;
        d["cache_hits"] = s.cache_hits;
        d["executions"] = s.executions;
        d["execute_failures"] = s.execute_failures;
        d["initialize_calls"] = h.initialize_calls;
        d["initialize_ns"] = h.initialize_ns;
        d["execute_calls"] = h.execute_calls;
        d["captured_calls"] = h.captured_calls;
        return d;
      },
      "Counters of the cuDNN attention handlers and their graph cache.");
}

}  // namespace jax_vmm
