#include "common/ffi_record_stage.h"

#include <cstring>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_vmm::record_stage {
namespace {

namespace ffi = xla::ffi;

std::vector<Target>& Targets() {
  static auto* targets = new std::vector<Target>();  // never destroyed: read by XLA threads
  return *targets;
}

std::mutex g_status_mu;
std::string g_status = "pending";  // guarded by g_status_mu

void SetStatus(std::string s) {
  std::lock_guard<std::mutex> lock(g_status_mu);
  g_status = std::move(s);
}

#ifdef JAX_VMM_HAVE_FFI_RECORD
std::string TakeErrorMessage(const XLA_FFI_Api* api, XLA_FFI_Error* error) {
  XLA_FFI_Error_GetDetails_Args details{};
  details.struct_size = XLA_FFI_Error_GetDetails_Args_STRUCT_SIZE;
  details.error = error;
  api->XLA_FFI_Error_GetDetails(&details);
  std::string message = details.message ? details.message : "(no message)";
  XLA_FFI_Error_Destroy_Args destroy{};
  destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  destroy.error = error;
  api->XLA_FFI_Error_Destroy(&destroy);
  return message;
}

void RegisterAll(const XLA_FFI_Api* api) {
  static constexpr char kPlatform[] = "CUDA";
  for (const Target& t : Targets()) {
    XLA_FFI_Handler_Register_Args args{};
    args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
    args.name = XLA_FFI_ByteSpan{t.name, std::strlen(t.name)};
    args.platform = XLA_FFI_ByteSpan{kPlatform, sizeof(kPlatform) - 1};
    args.bundle = XLA_FFI_Handler_Bundle{nullptr, nullptr, nullptr, t.execute, t.record};
    args.traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
    if (XLA_FFI_Error* err = api->XLA_FFI_Handler_Register(&args)) {
      SetStatus(std::string("failed: XLA refused the record stage of ") + t.name + ": " +
                TakeErrorMessage(api, err));
      return;
    }
  }
  SetStatus("registered");
}
#endif

// Answers XLA's metadata query and checks the call frame; no device work.
ffi::Error BootstrapNoOp(ffi::Result<ffi::AnyBuffer> done) {
  (void)done;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kBootstrapTyped, BootstrapNoOp, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

XLA_FFI_Error* Bootstrap(XLA_FFI_CallFrame* frame) {
  const bool metadata_query = frame->extension_start != nullptr &&
                              frame->extension_start->type == XLA_FFI_Extension_Metadata;
  if (!metadata_query && frame->stage == XLA_FFI_ExecutionStage_EXECUTE) {
    static std::once_flag once;
#ifdef JAX_VMM_HAVE_FFI_RECORD
    std::call_once(once, [api = frame->api] { RegisterAll(api); });
#else
    std::call_once(once, [] {
      SetStatus("unavailable: jax_vmm was built against jaxlib headers without XLA's FFI "
                "record stage (jaxlib >= 0.11 has it)");
    });
#endif
  }
  return kBootstrapTyped(frame);
}

}  // namespace

void Add(Target target) { Targets().push_back(target); }

XLA_FFI_Handler* BootstrapHandler() { return Bootstrap; }

std::string Status() {
  std::lock_guard<std::mutex> lock(g_status_mu);
  return g_status;
}

}  // namespace jax_vmm::record_stage
