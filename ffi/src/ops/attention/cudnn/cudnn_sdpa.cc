// The one translation unit that includes the cuDNN frontend (it is large to compile).
#include "ops/attention/cudnn/cudnn_sdpa.h"

#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

// The frontend is header-only: its inline functions, function-local statics (the logger,
// the backend entry points) and classes would otherwise be exported from this library with
// default visibility, and so interposable: the dynamic linker may bind them to another copy
// of the frontend in the process (XLA's own, of another version). Hidden, they bind here.
// (The C headers it uses are included above: declared inside the pragma, dlopen & co.
// would become hidden undefined references and fail the link.)
#pragma GCC visibility push(hidden)
#include <cudnn_frontend.h>
#pragma GCC visibility pop

#include "ops/attention/cudnn/cudnn_library.h"

namespace fe = cudnn_frontend;
namespace feg = cudnn_frontend::graph;

namespace jax_vmm::cudnn {

bool SdpaKey::operator<(const SdpaKey& o) const {
  auto tie = [](const SdpaKey& k) {
    uint32_t softcap_bits, scale_bits;
    std::memcpy(&softcap_bits, &k.softcap, 4);
    std::memcpy(&scale_bits, &k.scale, 4);
    return std::make_tuple(k.device, static_cast<int>(k.io), k.batch, k.q_tokens, k.max_tokens,
                           k.q_heads, k.kv_heads, k.kv_token_heads, k.head_dim, k.window,
                           softcap_bits,
                           scale_bits);
  };
  return tie(*this) < tie(o);
}

class SdpaGraph {
 public:
  std::shared_ptr<feg::Graph> graph;
  int64_t workspace_bytes = 0;
  std::string error;  // non-empty: cuDNN could not build this graph
};

namespace {

// Tensor uids of the variant pack.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kSeqQ, kSeqKv };

struct Device {
  std::mutex mu;  // guards handle (cudnnSetStream + execute) and building
  cudnnHandle_t handle = nullptr;
};

std::mutex g_mu;  // guards g_devices and g_graphs (not the graphs themselves)
std::map<int, std::unique_ptr<Device>> g_devices;
std::map<SdpaKey, std::unique_ptr<SdpaGraph>> g_graphs;

std::atomic<int64_t> g_built{0}, g_build_failures{0}, g_hits{0}, g_execs{0}, g_exec_failures{0};

Device& DeviceOf(int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::unique_ptr<Device>& d = g_devices[device];
  if (!d) d = std::make_unique<Device>();
  return *d;
}

std::string StatusText(cudnnStatus_t s) {
  const char* name = fe::detail::get_error_string(s);
  return std::string(name ? name : "?") + " (" + std::to_string(static_cast<int>(s)) + ")";
}

// Creates `d`'s handle on `device` (caller holds d.mu; never under capture).
std::string EnsureHandle(Device& d, int device) {
  if (d.handle != nullptr) return "";
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return std::string("cudaSetDevice failed: ") + cudaGetErrorString(e);
  }
  cudnnHandle_t h = nullptr;
  if (cudnnStatus_t s = fe::detail::create_handle(&h); s != CUDNN_STATUS_SUCCESS) {
    return "cudnnCreate failed: " + StatusText(s) + ": " + fe::detail::get_last_error_string_();
  }
  d.handle = h;
  return "";
}

std::string Describe(const SdpaKey& k) {
  return "B=" + std::to_string(k.batch) + " S=" + std::to_string(k.q_tokens) +
         " T=" + std::to_string(k.max_tokens) + " H_q=" + std::to_string(k.q_heads) +
         " H_kv=" + std::to_string(k.kv_heads) +
         (k.kv_token_heads > 0 ? " (token stride " + std::to_string(k.kv_token_heads) + " heads)"
                               : "") +
         " D=" + std::to_string(k.head_dim) +
         (k.io == IoType::kBF16 ? " bf16" : " fp16") +
         " window=" + std::to_string(k.window) + " softcap=" + std::to_string(k.softcap);
}

// `row` heads between consecutive tokens (h when dense).
std::shared_ptr<feg::Tensor_attributes> Bshd(feg::Graph& g, const char* name, int64_t uid,
                                             int64_t b, int64_t s, int64_t h, int64_t d,
                                             int64_t row) {
  // cuDNN's logical order is (B, H, S, D); the memory is (B, S, H, D).
  return g.tensor(feg::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({b, h, s, d})
                      .set_stride({s * row * d, d, row * d, 1}));
}

using TensorPtr = std::shared_ptr<feg::Tensor_attributes>;

TensorPtr Pointwise(feg::Graph& g, fe::PointwiseMode_t mode, TensorPtr a, TensorPtr b,
                    fe::DataType_t compute, fe::DataType_t out_type) {
  auto out =
      g.pointwise(a, b, feg::Pointwise_attributes().set_mode(mode).set_compute_data_type(compute));
  out->set_data_type(out_type);
  return out;
}

TensorPtr Index(feg::Graph& g, TensorPtr score, int64_t axis) {
  auto out = g.pointwise(score, feg::Pointwise_attributes()
                                    .set_mode(fe::PointwiseMode_t::GEN_INDEX)
                                    .set_axis(axis)
                                    .set_compute_data_type(fe::DataType_t::INT32));
  out->set_data_type(fe::DataType_t::INT32);
  return out;
}

using ScoreMod = std::function<TensorPtr(std::shared_ptr<feg::Graph>, TensorPtr)>;

// The score modifier of the soft-capped form. cuDNN's native masks cannot be combined with
// a score modifier, so the masks are built here, after the cap, from the same
// sequence-length tensors, with the ops (and in the order) the frontend itself lowers its
// padding, bottom-right causal and sliding-window masks to, so that the backend fuses
// them the same way (portable across frontend versions: this uses no frontend helper):
//   padding   row < q_lengths && col < lengths
//   causal    row + lengths - q_lengths >= col     (the query's position >= the key's)
//   window    col + window - lengths + q_lengths > row
ScoreMod SoftcapScoreMod(const SdpaKey& key, bool causal, TensorPtr seq_q, TensorPtr seq_kv) {
  const float cap = key.softcap;
  const int64_t window = key.window;
  const float neg_inf = fe::detail::get_backend_version() < 91000
                            ? std::numeric_limits<float>::lowest()
                            : -std::numeric_limits<float>::infinity();
  return [=](std::shared_ptr<feg::Graph> gp, TensorPtr score) {
    using M = fe::PointwiseMode_t;
    const auto F = fe::DataType_t::FLOAT, I = fe::DataType_t::INT32, B = fe::DataType_t::BOOLEAN;
    feg::Graph& g = *gp;
    auto select = [&](TensorPtr x, TensorPtr keep) {
      return g.pointwise(x, std::make_shared<feg::Tensor_attributes>(neg_inf), keep,
                         feg::Pointwise_attributes().set_mode(M::BINARY_SELECT));
    };
    auto cap_t = std::make_shared<feg::Tensor_attributes>(cap);
    auto x = Pointwise(g, M::DIV, score, cap_t, F, F);
    x = g.pointwise(x, feg::Pointwise_attributes().set_mode(M::TANH_FWD).set_compute_data_type(F));
    x = Pointwise(g, M::MUL, x, cap_t, F, F);

    auto row = Index(g, x, 2);
    auto col = Index(g, x, 3);
    x = select(x, Pointwise(g, M::LOGICAL_AND, Pointwise(g, M::CMP_LT, row, seq_q, B, B),
                            Pointwise(g, M::CMP_LT, col, seq_kv, B, B), B, B));
    if (causal) {
      auto r = Index(g, x, 2);
      auto c = Index(g, x, 3);
      auto pos = Pointwise(g, M::SUB, Pointwise(g, M::ADD, r, seq_kv, I, I), seq_q, I, I);
      x = select(x, Pointwise(g, M::CMP_GE, pos, c, B, B));
    }
    if (window > 0) {
      auto r = Index(g, x, 2);
      auto c = Index(g, x, 3);
      auto w = std::make_shared<feg::Tensor_attributes>(static_cast<int32_t>(window));
      auto lhs = Pointwise(g, M::ADD, c, w, I, I);
      lhs = Pointwise(g, M::SUB, lhs, seq_kv, I, I);
      lhs = Pointwise(g, M::ADD, lhs, seq_q, I, I);
      x = select(x, Pointwise(g, M::CMP_GT, lhs, r, B, B));
    }
    return x;
  };
}

#define JAX_VMM_FE_CHECK(expr, what)                                     \
  do {                                                                   \
    auto _st = (expr);                                                   \
    if (_st.is_bad()) return std::string(what) + ": " + _st.get_message(); \
  } while (0)

// Builds the graph of `key` into `out` (caller holds the device mutex).
std::string Build(const SdpaKey& key, cudnnHandle_t handle, SdpaGraph* out) {
  auto g = std::make_shared<feg::Graph>();
  g->set_io_data_type(key.io == IoType::kBF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const int64_t B = key.batch, S = key.q_tokens, T = key.max_tokens, D = key.head_dim;
  const int64_t kv_row = key.kv_token_heads > 0 ? key.kv_token_heads : key.kv_heads;
  auto q = Bshd(*g, "q", kQ, B, S, key.q_heads, D, key.q_heads);
  auto k = Bshd(*g, "k", kK, B, T, key.kv_heads, D, kv_row);
  auto v = Bshd(*g, "v", kV, B, T, key.kv_heads, D, kv_row);
  auto seq = [&](const char* name, int64_t uid) {
    return g->tensor(feg::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({B, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT32));
  };
  auto seq_q = seq("q_lengths", kSeqQ);
  auto seq_kv = seq("lengths", kSeqKv);
  // With one query token and no window the causal mask adds nothing to the padding mask
  // (the query sits at the last cached position); leaving it out keeps cuDNN's decode path.
  const bool causal = S > 1 || key.window > 0;
  auto opts = feg::SDPA_attributes()
                  .set_name("jax_vmm_attention")
                  .set_generate_stats(false)
                  .set_attn_scale(key.scale)
                  .set_seq_len_q(seq_q)
                  .set_seq_len_kv(seq_kv)
                  // Frontend 1.18 auto-selects its UNIFIED node on cuDNN >= 9.13, which
                  // crashed building this graph on the H200 (cuDNN 9.19, no stats output);
                  // the composite node is the fused flash-attention path.
                  .set_implementation(fe::AttentionImplementation_t::COMPOSITE);
  if (key.softcap > 0.0f) {
    opts.set_score_mod(SoftcapScoreMod(key, causal, seq_q, seq_kv));
  } else {
    opts.set_padding_mask(true);
    if (causal) opts.set_causal_mask_bottom_right(true);
    if (key.window > 0) opts.set_diagonal_band_left_bound(static_cast<int>(key.window));
  }
  auto [o, stats] = g->sdpa(q, k, v, opts);
  (void)stats;
  o->set_output(true)
      .set_uid(kO)
      .set_dim({B, key.q_heads, S, D})
      .set_stride({S * key.q_heads * D, D, key.q_heads * D, 1});
  JAX_VMM_FE_CHECK(g->validate(), "validate");
  JAX_VMM_FE_CHECK(g->build_operation_graph(handle), "build_operation_graph");
  JAX_VMM_FE_CHECK(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                   "create_execution_plans");
  JAX_VMM_FE_CHECK(g->check_support(handle), "check_support");
  JAX_VMM_FE_CHECK(g->build_plans(handle), "build_plans");
  int64_t ws = 0;
  JAX_VMM_FE_CHECK(g->get_workspace_size(ws), "get_workspace_size");
  out->graph = std::move(g);
  out->workspace_bytes = ws;
  return "";
}

}  // namespace

const SdpaGraph* FindGraph(const SdpaKey& key, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_graphs.find(key);
  if (it == g_graphs.end()) return nullptr;
  g_hits.fetch_add(1, std::memory_order_relaxed);
  if (!it->second->error.empty()) {
    *error = it->second->error;
    return nullptr;
  }
  return it->second.get();
}

std::string GetGraph(const SdpaKey& key, bool may_build, const SdpaGraph** graph) {
  std::string cached_error;
  if (const SdpaGraph* found = FindGraph(key, &cached_error);
      found != nullptr || !cached_error.empty()) {
    *graph = found;
    return cached_error;
  }
  if (!may_build) {
    return "no cuDNN graph was built for " + Describe(key) +
           " before the stream capture (graphs are built at the FFI initialize stage or on "
           "an uncaptured call; building under capture is not allowed)";
  }
  if (std::string err = Load(); !err.empty()) return err;
  Device& d = DeviceOf(key.device);
  std::lock_guard<std::mutex> dev_lock(d.mu);
  {
    // Another thread may have built it while this one waited for the device.
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_graphs.find(key);
    if (it != g_graphs.end()) {
      *graph = it->second.get();
      return it->second->error;
    }
  }
  auto built = std::make_unique<SdpaGraph>();
  std::string err;
  try {
    err = EnsureHandle(d, key.device);
    if (err.empty()) err = Build(key, d.handle, built.get());
    if (!err.empty()) {
      // The backend's own account of the last failure, when it kept one.
      const std::string last = fe::detail::get_last_error_string_();
      if (!last.empty()) err += " [cudnnGetLastErrorString: " + last + "]";
    }
  } catch (const std::exception& e) {
    err = std::string("exception: ") + e.what();
  }
  if (!err.empty()) {
    built->graph.reset();
    built->error = "cuDNN " + std::to_string(Info().version) + " cannot run " + Describe(key) +
                   ": " + err;
    g_build_failures.fetch_add(1, std::memory_order_relaxed);
  } else {
    g_built.fetch_add(1, std::memory_order_relaxed);
  }
  std::lock_guard<std::mutex> lock(g_mu);
  SdpaGraph* raw = built.get();
  g_graphs[key] = std::move(built);
  *graph = raw;
  return raw->error;
}

int64_t WorkspaceBytes(const SdpaGraph& graph) { return graph.workspace_bytes; }

std::string Execute(const SdpaGraph& graph, int device, cudaStream_t stream,
                    const SdpaPointers& p) {
  if (!graph.graph) return graph.error;
  Device& d = DeviceOf(device);
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.handle == nullptr) return "no cuDNN handle on device " + std::to_string(device);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(p.q)},
      {kK, const_cast<void*>(p.k)},
      {kV, const_cast<void*>(p.v)},
      {kO, p.out},
      {kSeqQ, const_cast<int32_t*>(p.q_lengths)},
      {kSeqKv, const_cast<int32_t*>(p.lengths)},
  };
  std::string err;
  try {
    if (cudnnStatus_t s = fe::detail::set_stream(d.handle, stream); s != CUDNN_STATUS_SUCCESS) {
      err = "cudnnSetStream failed: " + StatusText(s);
    } else if (auto st = graph.graph->execute(d.handle, pack, p.workspace); st.is_bad()) {
      err = "execute: " + st.get_message();
    }
  } catch (const std::exception& e) {
    err = std::string("execute: exception: ") + e.what();
  }
  g_execs.fetch_add(1, std::memory_order_relaxed);
  if (!err.empty()) g_exec_failures.fetch_add(1, std::memory_order_relaxed);
  return err;
}

SdpaStats Stats() {
  SdpaStats s;
  s.graphs_built = g_built.load();
  s.build_failures = g_build_failures.load();
  s.cache_hits = g_hits.load();
  s.executions = g_execs.load();
  s.execute_failures = g_exec_failures.load();
  return s;
}

}  // namespace jax_vmm::cudnn
