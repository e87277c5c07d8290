// The ABI's machinery (abi.h) and the calls of lwo.h's first sections:
// version, statuses, messages, dtypes, record layouts.
#include "abi.h"

#include <shared_mutex>
#include <unordered_map>

#include "engine/layout.h"

namespace lwo {
namespace abi {
namespace {

thread_local std::string t_message;

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Engine: return "engine";
    case Kind::Pool: return "pool";
    case Kind::Ring: return "ring";
    case Kind::Schedule: return "schedule";
    case Kind::Grads: return "grads";
    case Kind::Checkpoint: return "checkpoint";
    case Kind::Plan: return "plan";
  }
  return "?";
}

std::shared_mutex g_mu;
std::unordered_map<const void*, Kind>& handles() {
  static auto* m = new std::unordered_map<const void*, Kind>();  // never destroyed
  return *m;
}

}  // namespace

void add_handle(const void* p, Kind k) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  handles()[p] = k;
}

void remove_handle(const void* p) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  handles().erase(p);
}

void check_live(const void* p, Kind k) {
  if (!p) fail(LWO_ERR_INVALID_HANDLE, "%s handle is NULL", kind_name(k));
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = handles().find(p);
  if (it == handles().end())
    fail(LWO_ERR_INVALID_HANDLE, "%s handle %p is not a live lwo object (destroyed?)",
         kind_name(k), p);
  if (it->second != k)
    fail(LWO_ERR_INVALID_HANDLE, "handle %p is a %s, not a %s", p, kind_name(it->second),
         kind_name(k));
}

void set_message(const char* call, const char* what) {
  try {
    if (!what)
      t_message.clear();
    else
      t_message = std::string(call) + ": " + what;
  } catch (...) {
  }
}

lwo_status_t status_of_current_exception(const char* call) noexcept {
  try {
    throw;
  } catch (const Error& e) {
    set_message(call, e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set_message(call, "host memory allocation failed");
    return LWO_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_message(call, (std::string("internal error: ") + e.what()).c_str());
    return LWO_ERR_INTERNAL;
  } catch (...) {
    set_message(call, "internal error");
    return LWO_ERR_INTERNAL;
  }
}

void check_tail_zero(const void* p, size_t from, size_t to, const char* what) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (size_t i = from; i < to; ++i)
    if (b[i])
      fail(LWO_ERR_INVALID_ARGUMENT,
           "%s size %zu is larger than this library's %zu and byte %zu is not zero: it sets an "
           "option lwo %d.%d.%d does not know",
           what, to, from, i, LWO_VERSION_MAJOR, LWO_VERSION_MINOR, LWO_VERSION_PATCH);
}

const char* t_message_ref() { return t_message.c_str(); }

}  // namespace abi
}  // namespace lwo

using namespace lwo::abi;
using lwo::fail;

extern "C" {

LWO_API unsigned lwo_version(void) { return LWO_VERSION; }

LWO_API const char* lwo_status_string(lwo_status_t s) {
  switch (s) {
#define C(x) \
  case x:    \
    return #x;
    C(LWO_OK) C(LWO_END) C(LWO_ERR_INVALID_ARGUMENT) C(LWO_ERR_INVALID_HANDLE)
    C(LWO_ERR_OUT_OF_RANGE) C(LWO_ERR_NOT_FOUND) C(LWO_ERR_SIZE_MISMATCH)
    C(LWO_ERR_RING_FULL) C(LWO_ERR_LAYER_BUSY) C(LWO_ERR_STALE_TICKET)
    C(LWO_ERR_TICKET_STATE) C(LWO_ERR_FOREIGN_TICKET) C(LWO_ERR_BUSY) C(LWO_ERR_NO_DEVICE)
    C(LWO_ERR_OUT_OF_MEMORY) C(LWO_ERR_CUDA) C(LWO_ERR_CUBLAS) C(LWO_ERR_CUDNN)
    C(LWO_ERR_NCCL) C(LWO_ERR_FOREIGN_OBJECT) C(LWO_ERR_UNSUPPORTED) C(LWO_ERR_INTERNAL)
    C(LWO_ERR_IO) C(LWO_ERR_OVER_BUDGET) C(LWO_ERR_TRUNCATED) C(LWO_ERR_BAD_HEADER_SIZE) C(LWO_ERR_BAD_JSON)
    C(LWO_ERR_BAD_DTYPE) C(LWO_ERR_SHAPE_MISMATCH) C(LWO_ERR_SHAPE_OVERFLOW)
    C(LWO_ERR_BAD_RANGE) C(LWO_ERR_OVERLAP) C(LWO_ERR_FILE_CHANGED)
    C(LWO_ERR_COLLECTIVE_MISMATCH) C(LWO_ERR_QUANTIZED_WEIGHT)
#undef C
    default:
      return "unknown status";
  }
}

LWO_API const char* lwo_last_error_message(void) { return lwo::abi::t_message_ref(); }

LWO_API size_t lwo_dtype_size(lwo_dtype_t d) { return lwo::dtype_size(d); }
LWO_API const char* lwo_dtype_name(lwo_dtype_t d) { return lwo::dtype_name(d); }

LWO_API lwo_status_t lwo_record_layout(const lwo_layer_desc* layer, uint64_t* offsets,
                                       uint64_t* record_bytes) {
  return guard("lwo_record_layout", [&] {
    need(layer, "layer");
    need(record_bytes, "record_bytes");
    lwo::RecordLayout l = lwo::make_layout(*layer, "layer", false);
    if (offsets)
      for (size_t i = 0; i < l.tensors.size(); ++i) offsets[i] = l.tensors[i].offset;
    *record_bytes = l.record_bytes;
  });
}

}  // extern "C"
