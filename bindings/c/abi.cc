// The ABI's machinery (abi.h) and the calls of lwo.h's first sections:
// version, statuses, messages, dtypes, record layouts.
#include "abi.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

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
    case Kind::Optim: return "optimizer";
    case Kind::Graph: return "graph";
  }
  return "?";
}

// The handle registry: slots in chunks that are never freed or moved, each
// with the object it names, its kind and a generation. A handle's value is
// (generation << 32) | (slot + 1); destroying it bumps the slot's generation,
// so the old value never matches again, whatever reuses the slot or the
// object's address. A slot whose 32-bit generation is used up is never reused.
// Lookups take no lock: the tag is read before and after the object.
static_assert(sizeof(void*) == sizeof(uint64_t), "handles carry 64-bit values");
constexpr int kChunkBits = 12;
constexpr uint32_t kChunkSlots = 1u << kChunkBits;
constexpr uint32_t kMaxChunks = 1u << 16;  // 2^28 live handles at most
constexpr uint64_t kLastGen = 0xffffffffu;

struct Slot {
  // Live: (gen << 8) | (kind << 1) | 1. Free: (next gen << 8), 0 if used up.
  std::atomic<uint64_t> tag{0};
  std::atomic<void*> obj{nullptr};
};

std::atomic<Slot*> g_chunks[kMaxChunks];
std::mutex g_mu;  // add_handle and remove_handle
uint32_t g_used = 0;  // slots ever handed out (under g_mu)
std::vector<uint32_t>& free_slots() {
  static auto* v = new std::vector<uint32_t>();  // never destroyed
  return *v;
}

Slot* slot_of(uint64_t index) {
  if (index >= uint64_t(kMaxChunks) * kChunkSlots) return nullptr;
  Slot* c = g_chunks[index >> kChunkBits].load(std::memory_order_acquire);
  return c ? &c[index & (kChunkSlots - 1)] : nullptr;
}

}  // namespace

uint64_t add_handle(void* obj, Kind k) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<uint32_t>& fl = free_slots();
  fl.reserve(fl.size() + 1);  // remove_handle then never allocates
  uint32_t index;
  uint64_t gen = 1;
  if (!fl.empty()) {
    index = fl.back();
    fl.pop_back();
    gen = slot_of(index)->tag.load() >> 8;
  } else {
    if (g_used == kMaxChunks * kChunkSlots)
      fail(LWO_ERR_OUT_OF_MEMORY, "%u live lwo handles: the registry is full", g_used);
    index = g_used;
    if (index % kChunkSlots == 0)
      g_chunks[index >> kChunkBits].store(new Slot[kChunkSlots], std::memory_order_release);
    ++g_used;
  }
  Slot* s = slot_of(index);
  s->obj.store(obj);
  s->tag.store((gen << 8) | (uint64_t(k) << 1) | 1);
  return (gen << 32) | (uint64_t(index) + 1);
}

void remove_handle(uint64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  uint64_t index = (handle & 0xffffffffu) - 1;
  uint64_t gen = handle >> 32;
  Slot* s = slot_of(index);
  if (!s || s->tag.load() >> 8 != gen) return;  // not live (check_live came first)
  s->tag.store(gen < kLastGen ? (gen + 1) << 8 : 0);
  s->obj.store(nullptr);
  if (gen < kLastGen) free_slots().push_back(static_cast<uint32_t>(index));
}

void* check_live(const void* p, Kind k) {
  if (!p) fail(LWO_ERR_INVALID_HANDLE, "%s handle is NULL", kind_name(k));
  uint64_t v = reinterpret_cast<uintptr_t>(p);
  uint64_t gen = v >> 32;
  Slot* s = (v & 0xffffffffu) && gen ? slot_of((v & 0xffffffffu) - 1) : nullptr;
  uint64_t t = s ? s->tag.load() : 0;
  if (!(t & 1) || t >> 8 != gen)
    fail(LWO_ERR_INVALID_HANDLE, "%s handle %p is not a live lwo object (destroyed?)",
         kind_name(k), p);
  Kind is = static_cast<Kind>((t >> 1) & 0x7f);
  if (is != k)
    fail(LWO_ERR_INVALID_HANDLE, "handle %p is a %s, not a %s", p, kind_name(is), kind_name(k));
  void* obj = s->obj.load();
  if (s->tag.load() != t)  // destroyed meanwhile by another thread
    fail(LWO_ERR_INVALID_HANDLE, "%s handle %p is not a live lwo object (destroyed?)",
         kind_name(k), p);
  return obj;
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
    C(LWO_ERR_BAD_RANGE) C(LWO_ERR_OVERLAP) C(LWO_ERR_FILE_CHANGED) C(LWO_ERR_CAPTURING)
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
