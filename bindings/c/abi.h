// The C ABI's own machinery, shared by its files (one per section of lwo.h):
// the handle structs, the registry of live handles, the guard that turns
// every exception into a status and a message that starts with the call's
// name, and the readers and writers of size-first structs. Each exported
// function is check, convert, forward; the logic lives in engine/ and src/.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <shared_mutex>
#include <string>

#include "engine/engine.h"
#include "engine/grads.h"
#include "engine/optimizer.h"
#include "engine/pool.h"
#include "engine/ring.h"
#include "engine/schedule.h"
#include "lwo.h"
#include "src/checkpoint/checkpoint.h"
#include "src/common/error.h"

namespace lwo {
struct PlanHandle;  // a plan (bindings/c/api_plan.cc defines what it holds)
namespace abi {
// What every handle struct holds: its object, and the value the caller holds
// (abi::publish).
template <class Impl, template <class...> class Owner = std::unique_ptr>
struct Handle {
  Owner<Impl> impl;
  uint64_t handle = 0;
};
}  // namespace abi
}  // namespace lwo

struct lwo_engine : lwo::abi::Handle<lwo::Engine> {};
struct lwo_pool : lwo::abi::Handle<lwo::Pool> {};
struct lwo_ring : lwo::abi::Handle<lwo::Ring> {};
struct lwo_grads : lwo::abi::Handle<lwo::Grads> {};
struct lwo_checkpoint : lwo::abi::Handle<lwo::Checkpoint, std::shared_ptr> {};
struct lwo_schedule : lwo::abi::Handle<lwo::Schedule> {};
struct lwo_plan : lwo::abi::Handle<lwo::PlanHandle> {};
struct lwo_optim : lwo::abi::Handle<lwo::Optimizer> {};
struct lwo_graph : lwo::abi::Handle<lwo::Graph> {};

namespace lwo {
namespace abi {

enum class Kind { Engine, Pool, Ring, Schedule, Grads, Checkpoint, Plan, Optim, Graph };
template <class H> constexpr Kind kind_of();
template <> constexpr Kind kind_of<lwo_engine>() { return Kind::Engine; }
template <> constexpr Kind kind_of<lwo_pool>() { return Kind::Pool; }
template <> constexpr Kind kind_of<lwo_ring>() { return Kind::Ring; }
template <> constexpr Kind kind_of<lwo_schedule>() { return Kind::Schedule; }
template <> constexpr Kind kind_of<lwo_grads>() { return Kind::Grads; }
template <> constexpr Kind kind_of<lwo_checkpoint>() { return Kind::Checkpoint; }
template <> constexpr Kind kind_of<lwo_plan>() { return Kind::Plan; }
template <> constexpr Kind kind_of<lwo_optim>() { return Kind::Optim; }
template <> constexpr Kind kind_of<lwo_graph>() { return Kind::Graph; }

// The registry of live handles. The caller never holds an address: a handle
// is a value that names a slot of the registry and that slot's generation
// (abi.cc), so a destroyed, foreign or never-issued handle is never
// dereferenced, and a destroyed handle stays invalid when its slot (or the
// object's address) is reused.
uint64_t add_handle(void* obj, Kind k);
void remove_handle(uint64_t handle);
// The object of handle p; throws LWO_ERR_INVALID_HANDLE unless p is a live
// handle of kind k.
void* check_live(const void* p, Kind k);

template <class H>
H* check_handle(const H* p) {
  return static_cast<H*>(check_live(p, kind_of<H>()));
}
// Registers a fully built handle and hands its ownership to the caller (the
// returned value names it; it is not the object's address).
template <class H>
H* publish(std::unique_ptr<H> h) {
  h->handle = add_handle(h.get(), kind_of<H>());
  H* value = reinterpret_cast<H*>(static_cast<uintptr_t>(h->handle));
  h.release();
  return value;
}
// Unregisters and deletes a handle (the object check_handle returned).
template <class H>
void retire(H* h) {
  remove_handle(h->handle);
  delete h;
}

// lwo_*_destroy of an object that refuses while others depend on it
// (check_destroyable); NULL does nothing.
template <class H>
void destroy(H* h) {
  if (!h) return;
  H* live = check_handle(h);
  live->impl->check_destroyable();
  retire(live);
}

// Element `index` of `v`: LWO_ERR_OUT_OF_RANGE names the index, the owner
// and how many `what` it has.
template <class V>
const typename V::value_type& at(const V& v, uint32_t index, const std::string& owner,
                                 const char* what) {
  if (index >= v.size())
    fail(LWO_ERR_OUT_OF_RANGE, "index %u, but %s has %zu %s", index, owner.c_str(), v.size(),
         what);
  return v[index];
}

// Sets the calling thread's message (the empty string clears it).
void set_message(const char* call, const char* what);
lwo_status_t status_of_current_exception(const char* call) noexcept;
const char* t_message_ref();  // the calling thread's message

// Runs f; every exception becomes a status and the message "call: what".
template <class F>
lwo_status_t guard_status(const char* call, F&& f) noexcept {
  try {
    lwo_status_t s = f();
    set_message(nullptr, nullptr);
    return s;
  } catch (...) {
    return status_of_current_exception(call);
  }
}
template <class F>
lwo_status_t guard(const char* call, F&& f) noexcept {
  return guard_status(call, [&]() {
    f();
    return LWO_OK;
  });
}

inline void need(const void* p, const char* what) {
  if (!p) fail(LWO_ERR_INVALID_ARGUMENT, "%s is NULL", what);
}
// The output handle of a create call: not NULL, and NULL until the call
// succeeds (a failed call leaves it NULL).
template <class H>
void clear_output(H** out, const char* what) {
  need(out, what);
  *out = nullptr;
}

// Writes how many elements `v` has to a count output (not NULL).
template <class V>
void count_out(const V& v, uint32_t* n, const char* what) {
  need(n, what);
  *n = static_cast<uint32_t>(v.size());
}

// Throws unless every byte of [from, to) of `p` is zero: a newer caller's
// larger struct whose options this version does not know.
void check_tail_zero(const void* p, size_t from, size_t to, const char* what);

// Reads a caller's config or descriptor: min(size, sizeof) bytes over the
// defaults; a larger struct only if its extra bytes are zero, and a size over
// LWO_MAX_STRUCT_SIZE not at all (no byte past sizeof is read then).
template <class Cfg>
Cfg read_config(const Cfg* in, const Cfg& defaults, const char* what = "config") {
  if (!in) return defaults;
  if (in->size < sizeof(size_t))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s size %zu is too small (expected %zu)", what, in->size,
         sizeof(Cfg));
  // A size is a claim of the caller: bound it before reading past sizeof.
  if (in->size > LWO_MAX_STRUCT_SIZE)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "%s size %zu is larger than LWO_MAX_STRUCT_SIZE (%u; this library's is %zu): not a "
         "size an lwo struct can have (is it set?)",
         what, in->size, LWO_MAX_STRUCT_SIZE, sizeof(Cfg));
  static_assert(sizeof(Cfg) <= LWO_MAX_STRUCT_SIZE, "a config larger than the bound");
  if (in->size > sizeof(Cfg)) check_tail_zero(in, sizeof(Cfg), in->size, what);
  Cfg out = defaults;
  std::memcpy(&out, in, std::min(in->size, sizeof(Cfg)));
  out.size = sizeof(Cfg);
  return out;
}

// Checks a struct the library will write: not NULL, and a size the caller
// set (its _INIT macro does). An argument check: it runs before ranges.
template <class Out>
void check_out(const Out* out, const char* what) {
  need(out, what);
  if (out->size < sizeof(size_t))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s size %zu is too small (set it to %zu: its _INIT macro)",
         what, out->size, sizeof(Out));
}

// Writes a struct whose size the caller set: min(size, sizeof) bytes.
template <class Out>
void write_out(Out* out, Out value, const char* what = "output struct") {
  check_out(out, what);
  size_t n = std::min(out->size, sizeof(Out));
  value.size = out->size;
  std::memcpy(out, &value, n);
}

// Unknown flag bits are an error.
inline void check_flags(uint32_t flags, uint32_t known) {
  if (flags & ~known) fail(LWO_ERR_INVALID_ARGUMENT, "unknown flags 0x%x", flags & ~known);
}

// Pools (api_pools.cc): the engine a pool is created on (*pool cleared
// first, the engine checked, none of its streams capturing), the thread count
// of a checked lwo_pool_config, and the publication of a new pool as the
// caller's handle.
// The engine's capture gate, held shared to the end of the call that takes
// it (engine.h, Engine::capture_gate): taken before the call's check that no
// capture is under way, so that its work is all enqueued before a capture
// can begin. ExclusiveGate: a capture's begin or join.
using CaptureGate = std::shared_lock<std::shared_mutex>;
using ExclusiveGate = std::unique_lock<std::shared_mutex>;
inline CaptureGate capture_gate(lwo::Engine& e) { return CaptureGate(e.capture_gate()); }

// A pool's creation: *pool cleared, the engine's handle checked and its
// capture gate taken into *gate, no capture under way.
lwo_engine* pool_engine(lwo_engine* engine, lwo_pool** pool, CaptureGate* gate);
uint32_t pool_threads(const lwo_pool_config* config);
void add_pool(std::unique_ptr<lwo::Pool> impl, lwo_pool** pool);

}  // namespace abi
}  // namespace lwo
