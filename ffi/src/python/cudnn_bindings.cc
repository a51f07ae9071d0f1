#include "python/cudnn_bindings.h"

#include <nanobind/stl/string.h>

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
        d["execute_calls"] = h.execute_calls;
        d["captured_calls"] = h.captured_calls;
        return d;
      },
      "Counters of the cuDNN attention handlers and their graph cache.");
}

}  // namespace jax_vmm
