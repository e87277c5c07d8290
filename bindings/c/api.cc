// The C ABI: argument checks, handle validation, status + message, exports.
// Each exported function body runs inside guard(), which turns every C++
// exception into a status and the calling thread's message.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "src/checkpoint/checkpoint.h"
#include "engine/engine.h"
#include "src/common/error.h"
#include "engine/grads.h"
#include "engine/layout.h"
#include "engine/pool.h"
#include "engine/ring.h"
#include "engine/schedule.h"
#include "testing.h"
#include "lwo.h"
#include "src/compute/compute.h"

#include <nccl.h>

using lwo::Error;
using lwo::fail;

struct lwo_engine {
  std::unique_ptr<lwo::Engine> impl;
  std::mutex compute_mu;
  std::unique_ptr<lwo::Compute> compute;  // made on first use; destroyed first
};
struct lwo_pool {
  std::unique_ptr<lwo::Pool> impl;
  lwo_engine* engine;
};
struct lwo_ring {
  std::unique_ptr<lwo::Ring> impl;
  lwo_pool* pool;
};
struct lwo_grads {
  std::unique_ptr<lwo::Grads> impl;
  lwo_pool* pool;
};
struct lwo_checkpoint {
  std::shared_ptr<lwo::Checkpoint> impl;
};
struct lwo_schedule {
  std::unique_ptr<lwo::Schedule> impl;
  lwo_ring* ring;
};

namespace {

thread_local std::string t_message;

enum class Kind { Engine, Pool, Ring, Schedule, Grads, Checkpoint };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Engine: return "engine";
    case Kind::Pool: return "pool";
    case Kind::Ring: return "ring";
    case Kind::Schedule: return "schedule";
    case Kind::Grads: return "grads";
    case Kind::Checkpoint: return "checkpoint";
  }
  return "?";
}

// Live handles: a destroyed or foreign pointer is never dereferenced.
std::shared_mutex g_mu;
std::unordered_map<const void*, Kind>& handles() {
  static auto* m = new std::unordered_map<const void*, Kind>();  // never destroyed
  return *m;
}
void add_handle(const void* p, Kind k) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  handles()[p] = k;
}
void remove_handle(const void* p) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  handles().erase(p);
}
// Registers a fully built handle and hands its ownership to the caller.
template <class H>
H* publish(std::unique_ptr<H> h, Kind k) {
  add_handle(h.get(), k);
  return h.release();
}

template <class T>
T* check_handle(const T* p, Kind k, const char* call) {
  if (!p) fail(LWO_ERR_INVALID_HANDLE, "%s: %s handle is NULL", call, kind_name(k));
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = handles().find(p);
  if (it == handles().end())
    fail(LWO_ERR_INVALID_HANDLE, "%s: %s handle %p is not a live lwo object (destroyed?)", call,
         kind_name(k), static_cast<const void*>(p));
  if (it->second != k)
    fail(LWO_ERR_INVALID_HANDLE, "%s: handle %p is a %s, not a %s", call,
         static_cast<const void*>(p), kind_name(it->second), kind_name(k));
  return const_cast<T*>(p);
}

template <class F>
lwo_status_t guard_status(F&& f) noexcept {
  try {
    lwo_status_t s = f();
    t_message.clear();
    return s;
  } catch (const Error& e) {
    try {
      t_message = e.what();
    } catch (...) {
    }
    return e.status();
  } catch (const std::bad_alloc&) {
    try {
      t_message = "host memory allocation failed";
    } catch (...) {
    }
    return LWO_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    try {
      t_message = std::string("internal error: ") + e.what();
    } catch (...) {
    }
    return LWO_ERR_INTERNAL;
  } catch (...) {
    t_message.clear();
    return LWO_ERR_INTERNAL;
  }
}
template <class F>
lwo_status_t guard(F&& f) noexcept {
  return guard_status([&]() {
    f();
    return LWO_OK;
  });
}

void need(const void* p, const char* call, const char* what) {
  if (!p) fail(LWO_ERR_INVALID_ARGUMENT, "%s: %s is NULL", call, what);
}

// Reads a caller's config: min(size, sizeof) bytes over the defaults.
template <class Cfg>
Cfg read_config(const Cfg* in, const Cfg& defaults, const char* call) {
  if (!in) return defaults;
  if (in->size < sizeof(size_t))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: config size %zu is too small (expected %zu)", call,
         in->size, sizeof(Cfg));
  Cfg out = defaults;
  std::memcpy(&out, in, std::min(in->size, sizeof(Cfg)));
  out.size = sizeof(Cfg);
  return out;
}
// Writes an info struct whose size the caller set: min(size, sizeof) bytes.
template <class Info>
void write_info(Info* out, Info value, const char* call) {
  need(out, call, "output struct");
  if (out->size < sizeof(size_t))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: output struct size %zu is too small (set it to %zu)",
         call, out->size, sizeof(Info));
  size_t n = std::min(out->size, sizeof(Info));
  value.size = out->size;
  std::memcpy(out, &value, n);
}

lwo_status_t make_engine(std::unique_ptr<lwo::Backend> backend, int device, uint32_t flags,
                         lwo_engine** engine) {
  return guard([&] {
    auto h = std::make_unique<lwo_engine>();
    h->impl = std::make_unique<lwo::Engine>(std::move(backend), device);
    if (flags & LWO_ENGINE_CHECK_COLLECTIVES) h->impl->set_check_collectives(true);
    *engine = publish(std::move(h), Kind::Engine);
  });
}

}  // namespace

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
    C(LWO_ERR_IO) C(LWO_ERR_TRUNCATED) C(LWO_ERR_BAD_HEADER_SIZE) C(LWO_ERR_BAD_JSON)
    C(LWO_ERR_BAD_DTYPE) C(LWO_ERR_SHAPE_MISMATCH) C(LWO_ERR_SHAPE_OVERFLOW)
    C(LWO_ERR_BAD_RANGE) C(LWO_ERR_OVERLAP) C(LWO_ERR_FILE_CHANGED)
    C(LWO_ERR_COLLECTIVE_MISMATCH)
#undef C
    default:
      return "unknown status";
  }
}

LWO_API const char* lwo_last_error_message(void) { return t_message.c_str(); }

LWO_API size_t lwo_dtype_size(lwo_dtype_t d) { return lwo::dtype_size(d); }
LWO_API const char* lwo_dtype_name(lwo_dtype_t d) { return lwo::dtype_name(d); }

LWO_API lwo_status_t lwo_record_layout(const lwo_layer_desc* layer, uint64_t* offsets,
                                       uint64_t* record_bytes) {
  return guard([&] {
    static const char* call = "lwo_record_layout";
    need(layer, call, "layer");
    need(record_bytes, call, "record_bytes");
    lwo::RecordLayout l = lwo::make_layout(*layer, call, false);
    if (offsets)
      for (size_t i = 0; i < l.tensors.size(); ++i) offsets[i] = l.tensors[i].offset;
    *record_bytes = l.record_bytes;
  });
}

/* ---- engine ---- */

LWO_API void lwo_engine_config_init(lwo_engine_config* c) {
  if (c) *c = lwo_engine_config LWO_ENGINE_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_engine_create(const lwo_engine_config* config, lwo_engine** engine) {
  static const char* call = "lwo_engine_create";
  lwo_engine_config cfg{};
  lwo_status_t s = guard([&] {
    need(engine, call, "engine (output)");
    *engine = nullptr;
    cfg = read_config(config, lwo_engine_config LWO_ENGINE_CONFIG_INIT, call);
    if (cfg.flags & ~LWO_ENGINE_CHECK_COLLECTIVES)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", call,
           cfg.flags & ~LWO_ENGINE_CHECK_COLLECTIVES);
    if (cfg.device < 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: device %d is negative", call, cfg.device);
  });
  if (s != LWO_OK) return s;
  std::unique_ptr<lwo::Backend> backend;
  s = guard([&] {
    try {
      backend = lwo::make_cuda_backend(cfg.device);
    } catch (const Error& e) {
      fail(e.status(), "%s: %s", call, e.what());
    }
  });
  if (s != LWO_OK) return s;
  return make_engine(std::move(backend), cfg.device, cfg.flags, engine);
}

LWO_API lwo_status_t lwo_engine_destroy(lwo_engine* engine) {
  if (!engine) return guard([] {});
  return guard([&] {
    static const char* call = "lwo_engine_destroy";
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    int n = e->impl->n_pools.load();
    if (n > 0)
      fail(LWO_ERR_BUSY, "%s: engine on device %d still has %d pool%s", call, e->impl->device(),
           n, n == 1 ? "" : "s");
    remove_handle(e);
    delete e;
  });
}

LWO_API lwo_status_t lwo_engine_device(const lwo_engine* engine, int32_t* device) {
  return guard([&] {
    lwo_engine* e = check_handle(engine, Kind::Engine, "lwo_engine_device");
    need(device, "lwo_engine_device", "device");
    *device = e->impl->device();
  });
}

LWO_API lwo_status_t lwo_engine_transfer_stream(const lwo_engine* engine, lwo_stream_t* stream) {
  return guard([&] {
    lwo_engine* e = check_handle(engine, Kind::Engine, "lwo_engine_transfer_stream");
    need(stream, "lwo_engine_transfer_stream", "stream");
    *stream = static_cast<lwo_stream_t>(e->impl->h2d());
  });
}

LWO_API lwo_status_t lwo_engine_check(lwo_engine* engine) {
  return guard([&] {
    lwo_engine* e = check_handle(engine, Kind::Engine, "lwo_engine_check");
    try {
      e->impl->check();
    } catch (const Error& err) {
      fail(err.status(), "lwo_engine_check: device %d: %s", e->impl->device(), err.what());
    }
  });
}

LWO_API lwo_status_t lwo_engine_synchronize(lwo_engine* engine) {
  return guard([&] {
    lwo_engine* e = check_handle(engine, Kind::Engine, "lwo_engine_synchronize");
    try {
      e->impl->synchronize();
    } catch (const Error& err) {
      fail(err.status(), "lwo_engine_synchronize: device %d: %s", e->impl->device(), err.what());
    }
  });
}

/* ---- pool ---- */

LWO_API void lwo_pool_config_init(lwo_pool_config* c) {
  if (c) *c = lwo_pool_config LWO_POOL_CONFIG_INIT;
}

static lwo_pool_config pool_config(const lwo_pool_config* config, const char* call) {
  lwo_pool_config cfg = read_config(config, lwo_pool_config LWO_POOL_CONFIG_INIT, call);
  if (cfg.flags != 0) fail(LWO_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", call, cfg.flags);
  return cfg;
}

static void add_pool(lwo_engine* e, std::unique_ptr<lwo::Pool> impl, lwo_pool** pool) {
  *pool = publish(std::make_unique<lwo_pool>(lwo_pool{std::move(impl), e}), Kind::Pool);
  e->impl->n_pools.fetch_add(1);
}

LWO_API lwo_status_t lwo_pool_create_pinned(lwo_engine* engine, const lwo_layer_desc* layers,
                                            uint32_t n_layers, const lwo_pool_config* config,
                                            lwo_pool** pool) {
  return guard([&] {
    static const char* call = "lwo_pool_create_pinned";
    need(pool, call, "pool (output)");
    *pool = nullptr;
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    lwo_pool_config cfg = pool_config(config, call);
    add_pool(e, lwo::Pool::create_pinned(*e->impl, layers, n_layers, cfg), pool);
  });
}

LWO_API lwo_status_t lwo_pool_create_registered(lwo_engine* engine, const lwo_layer_desc* layers,
                                                uint32_t n_layers, const lwo_host_region* regions,
                                                uint32_t n_regions, const lwo_pool_config* config,
                                                lwo_pool** pool) {
  return guard([&] {
    static const char* call = "lwo_pool_create_registered";
    need(pool, call, "pool (output)");
    *pool = nullptr;
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    lwo_pool_config cfg = pool_config(config, call);
    add_pool(e,
             lwo::Pool::create_registered(*e->impl, layers, n_layers, regions, n_regions, cfg),
             pool);
  });
}

LWO_API lwo_status_t lwo_pool_destroy(lwo_pool* pool) {
  if (!pool) return guard([] {});
  return guard([&] {
    static const char* call = "lwo_pool_destroy";
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    int n = p->impl->n_rings.load();
    if (n > 0)
      fail(LWO_ERR_BUSY, "%s: pool of %u layers still has %d ring%s", call, p->impl->n_layers(), n,
           n == 1 ? "" : "s");
    int ng = p->impl->n_grads.load();
    if (ng > 0)
      fail(LWO_ERR_BUSY, "%s: pool of %u layers still has %d gradient set%s", call,
           p->impl->n_layers(), ng, ng == 1 ? "" : "s");
    remove_handle(p);
    p->engine->impl->n_pools.fetch_sub(1);
    delete p;
  });
}

LWO_API lwo_status_t lwo_pool_get_info(const lwo_pool* pool, lwo_pool_info* info) {
  return guard([&] {
    lwo_pool* p = check_handle(pool, Kind::Pool, "lwo_pool_get_info");
    lwo_pool_info v{};
    v.n_layers = p->impl->n_layers();
    v.is_registered = p->impl->registered() ? 1u : 0u;
    v.total_bytes = p->impl->total_bytes();
    v.max_record_bytes = p->impl->max_record_bytes();
    v.is_staged = p->impl->staged() ? 1u : 0u;
    write_info(info, v, "lwo_pool_get_info");
  });
}

LWO_API lwo_status_t lwo_pool_layer_tensor_count(const lwo_pool* pool, uint32_t layer,
                                                 uint32_t* n_tensors) {
  return guard([&] {
    static const char* call = "lwo_pool_layer_tensor_count";
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    need(n_tensors, call, "n_tensors");
    *n_tensors = static_cast<uint32_t>(p->impl->layer(layer, call).layout.tensors.size());
  });
}

LWO_API lwo_status_t lwo_pool_tensor_info(const lwo_pool* pool, uint32_t layer, uint32_t index,
                                          lwo_tensor_info* info) {
  return guard([&] {
    static const char* call = "lwo_pool_tensor_info";
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    need(info, call, "info");
    const auto& l = p->impl->layer(layer, call);
    if (index >= l.layout.tensors.size())
      fail(LWO_ERR_OUT_OF_RANGE, "%s: layer %u has %zu tensors, index %u is out of range", call,
           layer, l.layout.tensors.size(), index);
    const lwo::TensorLayout& t = l.layout.tensors[index];
    info->name = t.name.c_str();
    info->dtype = t.dtype;
    info->n_dims = t.n_dims;
    for (int d = 0; d < LWO_MAX_DIMS; ++d) info->shape[d] = d < t.n_dims ? t.shape[d] : 0;
    info->offset = t.offset;
    info->bytes = t.bytes;
  });
}

LWO_API lwo_status_t lwo_pool_find_tensor(const lwo_pool* pool, uint32_t layer, const char* name,
                                          uint32_t* index) {
  return guard([&] {
    static const char* call = "lwo_pool_find_tensor";
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    need(index, call, "index");
    *index = p->impl->tensor_index(layer, name, call);
  });
}

LWO_API lwo_status_t lwo_pool_record_bytes(const lwo_pool* pool, uint32_t layer,
                                           uint64_t* bytes) {
  return guard([&] {
    static const char* call = "lwo_pool_record_bytes";
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    need(bytes, call, "bytes");
    *bytes = p->impl->layer(layer, call).layout.record_bytes;
  });
}

LWO_API lwo_status_t lwo_pool_write(lwo_pool* pool, uint32_t layer, const char* name,
                                    const void* src, uint64_t bytes) {
  return guard([&] {
    lwo_pool* p = check_handle(pool, Kind::Pool, "lwo_pool_write");
    p->impl->write(layer, name, src, bytes);
  });
}

LWO_API lwo_status_t lwo_pool_layer_host(lwo_pool* pool, uint32_t layer, void** data,
                                         uint64_t* bytes) {
  return guard([&] {
    static const char* call = "lwo_pool_layer_host";
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    need(data, call, "data");
    const auto& l = p->impl->layer(layer, call);
    if (p->impl->comm())
      fail(LWO_ERR_UNSUPPORTED, "%s: the pool is sharded: use lwo_pool_shard_host", call);
    if (!l.host)
      fail(LWO_ERR_UNSUPPORTED,
           "%s: layer %u of the registered pool is not contiguous in host memory (%zu copy runs)",
           call, layer, l.runs.size());
    *data = l.host;
    if (bytes)
      *bytes = !p->impl->registered() ? l.layout.record_bytes : l.runs.empty() ? 0 : l.runs[0].bytes;
  });
}

LWO_API lwo_status_t lwo_pool_layer_changed(lwo_pool* pool, uint32_t layer) {
  return guard([&] {
    static const char* call = "lwo_pool_layer_changed";
    check_handle(pool, Kind::Pool, call)->impl->changed(layer, call);
  });
}

LWO_API lwo_status_t lwo_pool_tensor_host(lwo_pool* pool, uint32_t layer, const char* name,
                                          void** data, uint64_t* bytes) {
  return guard([&] {
    static const char* call = "lwo_pool_tensor_host";
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    need(data, call, "data");
    uint32_t ti = p->impl->tensor_index(layer, name, call);
    const auto& l = p->impl->layer(layer, call);
    if (p->impl->comm())
      fail(LWO_ERR_UNSUPPORTED, "%s: the pool is sharded: use lwo_pool_shard_host", call);
    const lwo::TensorLayout& t = l.layout.tensors[ti];
    *data = p->impl->registered() ? const_cast<void*>(t.host_data) : l.host + t.offset;
    if (bytes) *bytes = t.bytes;
  });
}

/* ---- ring ---- */

LWO_API void lwo_ring_config_init(lwo_ring_config* c) {
  if (c) *c = lwo_ring_config LWO_RING_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_ring_create(lwo_pool* pool, const lwo_ring_config* config,
                                     lwo_ring** ring) {
  return guard([&] {
    static const char* call = "lwo_ring_create";
    need(ring, call, "ring (output)");
    *ring = nullptr;
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    lwo_ring_config cfg = read_config(config, lwo_ring_config LWO_RING_CONFIG_INIT, call);
    if (cfg.flags & ~LWO_RING_TIMING)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", call, cfg.flags & ~LWO_RING_TIMING);
    if (cfg.depth < 1 || cfg.depth > lwo::kMaxDepth)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: depth %u is outside 1..%u", call, cfg.depth,
           lwo::kMaxDepth);
    auto impl = std::make_unique<lwo::Ring>(*p->impl, cfg.depth, cfg.flags);
    *ring = publish(std::make_unique<lwo_ring>(lwo_ring{std::move(impl), p}), Kind::Ring);
    p->impl->n_rings.fetch_add(1);
  });
}

LWO_API lwo_status_t lwo_ring_destroy(lwo_ring* ring) {
  if (!ring) return guard([] {});
  return guard([&] {
    static const char* call = "lwo_ring_destroy";
    lwo_ring* r = check_handle(ring, Kind::Ring, call);
    r->impl->check_destroyable(call);
    remove_handle(r);
    r->pool->impl->n_rings.fetch_sub(1);
    delete r;
  });
}

LWO_API lwo_status_t lwo_ring_stage(lwo_ring* ring, uint32_t layer, lwo_ticket* ticket) {
  return guard([&] {
    lwo_ring* r = check_handle(ring, Kind::Ring, "lwo_ring_stage");
    need(ticket, "lwo_ring_stage", "ticket");
    ticket->id = 0;
    *ticket = r->impl->stage(layer);
  });
}

LWO_API lwo_status_t lwo_ring_acquire(lwo_ring* ring, lwo_ticket ticket, lwo_stream_t stream,
                                      lwo_layer_view* view) {
  return guard([&] {
    lwo_ring* r = check_handle(ring, Kind::Ring, "lwo_ring_acquire");
    need(view, "lwo_ring_acquire", "view");
    r->impl->acquire(ticket, stream, view);
  });
}

LWO_API lwo_status_t lwo_ring_tensor(lwo_ring* ring, lwo_ticket ticket, const char* name,
                                     void** device_ptr) {
  return guard([&] {
    lwo_ring* r = check_handle(ring, Kind::Ring, "lwo_ring_tensor");
    need(device_ptr, "lwo_ring_tensor", "device_ptr");
    *device_ptr = r->impl->tensor(ticket, name);
  });
}

LWO_API lwo_status_t lwo_ring_release(lwo_ring* ring, lwo_ticket ticket, lwo_stream_t stream) {
  return guard([&] {
    lwo_ring* r = check_handle(ring, Kind::Ring, "lwo_ring_release");
    r->impl->release(ticket, stream);
  });
}

LWO_API lwo_status_t lwo_ring_get_info(const lwo_ring* ring, lwo_ring_info* info) {
  return guard([&] {
    lwo_ring* r = check_handle(ring, Kind::Ring, "lwo_ring_get_info");
    lwo_ring_info v{};
    r->impl->info(&v);
    write_info(info, v, "lwo_ring_get_info");
  });
}

LWO_API lwo_status_t lwo_ring_get_stats(lwo_ring* ring, lwo_ring_stats* stats) {
  return guard([&] {
    lwo_ring* r = check_handle(ring, Kind::Ring, "lwo_ring_get_stats");
    need(stats, "lwo_ring_get_stats", "stats");
    lwo_ring_stats v{};
    r->impl->stats(&v);
    write_info(stats, v, "lwo_ring_get_stats");
  });
}

LWO_API lwo_status_t lwo_ring_reset_stats(lwo_ring* ring) {
  return guard([&] {
    check_handle(ring, Kind::Ring, "lwo_ring_reset_stats")->impl->reset_stats();
  });
}

/* ---- schedule ---- */

LWO_API lwo_status_t lwo_schedule_create(lwo_ring* ring, const uint32_t* layers,
                                         uint32_t n_layers, lwo_schedule** schedule) {
  return guard([&] {
    static const char* call = "lwo_schedule_create";
    need(schedule, call, "schedule (output)");
    *schedule = nullptr;
    lwo_ring* r = check_handle(ring, Kind::Ring, call);
    auto impl = std::make_unique<lwo::Schedule>(*r->impl, layers, n_layers);
    *schedule = publish(std::make_unique<lwo_schedule>(lwo_schedule{std::move(impl), r}), Kind::Schedule);
    r->impl->n_schedules.fetch_add(1);
  });
}

LWO_API lwo_status_t lwo_schedule_destroy(lwo_schedule* schedule) {
  if (!schedule) return guard([] {});
  return guard([&] {
    lwo_schedule* s = check_handle(schedule, Kind::Schedule, "lwo_schedule_destroy");
    remove_handle(s);
    s->ring->impl->n_schedules.fetch_sub(1);
    delete s;
  });
}

LWO_API lwo_status_t lwo_schedule_next(lwo_schedule* schedule, lwo_stream_t stream,
                                       lwo_layer_view* view) {
  return guard_status([&] {
    lwo_schedule* s = check_handle(schedule, Kind::Schedule, "lwo_schedule_next");
    need(view, "lwo_schedule_next", "view");
    return s->impl->next(stream, view);
  });
}

LWO_API lwo_status_t lwo_schedule_position(const lwo_schedule* schedule, uint32_t* position) {
  return guard([&] {
    lwo_schedule* s = check_handle(schedule, Kind::Schedule, "lwo_schedule_position");
    need(position, "lwo_schedule_position", "position");
    *position = s->impl->position();
  });
}

LWO_API lwo_status_t lwo_schedule_reset(lwo_schedule* schedule, lwo_stream_t stream) {
  return guard([&] {
    check_handle(schedule, Kind::Schedule, "lwo_schedule_reset")->impl->reset(stream);
  });
}

/* ---- gradients ---- */

LWO_API void lwo_grads_config_init(lwo_grads_config* c) {
  if (c) *c = lwo_grads_config LWO_GRADS_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_grads_create(lwo_pool* pool, const uint8_t* trainable,
                                      const lwo_grads_config* config, lwo_grads** grads) {
  return guard([&] {
    static const char* call = "lwo_grads_create";
    need(grads, call, "grads (output)");
    *grads = nullptr;
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    lwo_grads_config cfg = read_config(config, lwo_grads_config LWO_GRADS_CONFIG_INIT, call);
    if (cfg.flags & ~LWO_GRADS_NATIVE_WIRE)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", call,
           cfg.flags & ~LWO_GRADS_NATIVE_WIRE);
    if (cfg.depth < 1 || cfg.depth > 64)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: depth %u is outside 1..64", call, cfg.depth);
    auto impl = std::make_unique<lwo::Grads>(*p->impl, trainable, cfg.depth,
                                             (cfg.flags & LWO_GRADS_NATIVE_WIRE) != 0,
                                             cfg.n_threads);
    *grads = publish(std::make_unique<lwo_grads>(lwo_grads{std::move(impl), p}), Kind::Grads);
    p->impl->n_grads.fetch_add(1);
  });
}

LWO_API lwo_status_t lwo_grads_destroy(lwo_grads* grads) {
  if (!grads) return guard([] {});
  return guard([&] {
    static const char* call = "lwo_grads_destroy";
    lwo_grads* g = check_handle(grads, Kind::Grads, call);
    g->impl->check_destroyable(call);
    remove_handle(g);
    g->pool->impl->n_grads.fetch_sub(1);
    delete g;
  });
}

LWO_API lwo_status_t lwo_grads_begin(lwo_grads* grads, uint32_t layer, lwo_stream_t stream,
                                     lwo_layer_view* view) {
  return guard([&] {
    lwo_grads* g = check_handle(grads, Kind::Grads, "lwo_grads_begin");
    need(view, "lwo_grads_begin", "view");
    g->impl->begin(layer, stream, view);
  });
}

LWO_API lwo_status_t lwo_grads_end(lwo_grads* grads, uint32_t layer, lwo_stream_t stream) {
  return guard([&] {
    check_handle(grads, Kind::Grads, "lwo_grads_end")->impl->end(layer, stream);
  });
}

LWO_API lwo_status_t lwo_grads_wait(lwo_grads* grads) {
  return guard([&] { check_handle(grads, Kind::Grads, "lwo_grads_wait")->impl->wait(); });
}

LWO_API lwo_status_t lwo_grads_zero(lwo_grads* grads) {
  return guard([&] { check_handle(grads, Kind::Grads, "lwo_grads_zero")->impl->zero(); });
}

LWO_API lwo_status_t lwo_grads_host(lwo_grads* grads, uint32_t layer, const char* name,
                                    float** data, uint64_t* n_elements) {
  return guard([&] {
    lwo_grads* g = check_handle(grads, Kind::Grads, "lwo_grads_host");
    need(data, "lwo_grads_host", "data");
    *data = g->impl->host(layer, name, n_elements);
  });
}

LWO_API lwo_status_t lwo_grads_shard(lwo_grads* grads, uint32_t layer, const char* name,
                                     float** data, uint64_t* first_element,
                                     uint64_t* n_elements) {
  return guard([&] {
    static const char* call = "lwo_grads_shard";
    lwo_grads* g = check_handle(grads, Kind::Grads, call);
    need(data, call, "data");
    uint64_t first = 0, n = 0;
    *data = g->impl->shard(layer, name, &first, &n);
    if (first_element) *first_element = first;
    if (n_elements) *n_elements = n;
  });
}

LWO_API lwo_status_t lwo_grads_get_stats(lwo_grads* grads, lwo_grads_stats* stats) {
  return guard([&] {
    lwo_grads* g = check_handle(grads, Kind::Grads, "lwo_grads_get_stats");
    lwo_grads_stats v{};
    g->impl->stats(&v);
    write_info(stats, v, "lwo_grads_get_stats");
  });
}

/* ---- linear layers ---- */

LWO_API void lwo_linear_desc_init(lwo_linear_desc* d) {
  if (d) *d = lwo_linear_desc LWO_LINEAR_DESC_INIT;
}

static lwo::Compute::Linear linear_of(const lwo_linear_desc* desc, int64_t tokens,
                                      const char* call) {
  need(desc, call, "desc");
  lwo_linear_desc d = read_config(desc, lwo_linear_desc LWO_LINEAR_DESC_INIT, call);
  if (d.dtype != LWO_DTYPE_BF16 && d.dtype != LWO_DTYPE_F16 && d.dtype != LWO_DTYPE_F32)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: dtype %s (%d) is not bf16, f16 or f32", call,
         lwo::dtype_name(d.dtype), static_cast<int>(d.dtype));
  if (d.flags & ~(LWO_LINEAR_BIAS | LWO_LINEAR_TF32))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", call,
         d.flags & ~(LWO_LINEAR_BIAS | LWO_LINEAR_TF32));
  if (d.in_features < 1 || d.out_features < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: in_features %lld and out_features %lld must be >= 1",
         call, static_cast<long long>(d.in_features), static_cast<long long>(d.out_features));
  if (tokens < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: tokens %lld must be >= 1", call,
         static_cast<long long>(tokens));
  const int64_t kMax = INT64_C(1) << 31;
  if (d.in_features >= kMax || d.out_features >= kMax || tokens >= kMax)
    fail(LWO_ERR_OUT_OF_RANGE, "%s: tokens %lld x in %lld x out %lld: a dimension is 2^31 or more",
         call, static_cast<long long>(tokens), static_cast<long long>(d.in_features),
         static_cast<long long>(d.out_features));
  return lwo::Compute::Linear{d.dtype, (d.flags & LWO_LINEAR_BIAS) != 0,
                              (d.flags & LWO_LINEAR_TF32) != 0, d.in_features, d.out_features};
}

static lwo::Compute& compute_of(lwo_engine* e) {
  std::lock_guard<std::mutex> lock(e->compute_mu);
  if (!e->compute) e->compute = std::make_unique<lwo::Compute>(e->impl->device());
  return *e->compute;
}

LWO_API lwo_status_t lwo_linear_forward(lwo_engine* engine, const lwo_linear_desc* desc,
                                        int64_t tokens, const void* x, const void* weight,
                                        const void* bias, void* y, lwo_stream_t stream) {
  return guard([&] {
    static const char* call = "lwo_linear_forward";
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    lwo::Compute::Linear l = linear_of(desc, tokens, call);
    need(x, call, "x");
    need(weight, call, "weight");
    need(y, call, "y");
    if (l.bias) need(bias, call, "bias (the layer has LWO_LINEAR_BIAS)");
    lwo::DeviceScope scope(*e->impl);
    compute_of(e).linear_forward(l, tokens, x, weight, bias, y, stream);
  });
}

LWO_API lwo_status_t lwo_linear_backward(lwo_engine* engine, const lwo_linear_desc* desc,
                                         int64_t tokens, const void* x, const void* dy,
                                         const void* weight, void* dx, void* dweight,
                                         void* dbias, lwo_dtype_t grad_dtype,
                                         lwo_stream_t stream) {
  return guard([&] {
    static const char* call = "lwo_linear_backward";
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    lwo::Compute::Linear l = linear_of(desc, tokens, call);
    need(dy, call, "dy");
    if (dx) need(weight, call, "weight (needed for dx)");
    if (dweight) need(x, call, "x (needed for dweight)");
    if (dbias && !l.bias)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: dbias given but the layer has no LWO_LINEAR_BIAS", call);
    if ((dweight || dbias) && grad_dtype != LWO_DTYPE_F32 && grad_dtype != l.dtype)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: grad_dtype %s is neither f32 nor the layer's %s", call,
           lwo::dtype_name(grad_dtype), lwo::dtype_name(l.dtype));
    if (!dx && !dweight && !dbias)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: dx, dweight and dbias are all NULL: nothing to do", call);
    lwo::DeviceScope scope(*e->impl);
    compute_of(e).linear_backward(l, tokens, x, dy, weight, dx, dweight, dbias, grad_dtype, stream);
  });
}

/* ---- 2-D convolutions ---- */

LWO_API void lwo_conv2d_desc_init(lwo_conv2d_desc* d) {
  if (d) *d = lwo_conv2d_desc LWO_CONV2D_DESC_INIT;
}

static lwo::Compute::Conv conv_of(const lwo_conv2d_desc* desc, const char* call) {
  need(desc, call, "desc");
  lwo_conv2d_desc d = read_config(desc, lwo_conv2d_desc LWO_CONV2D_DESC_INIT, call);
  if (d.dtype != LWO_DTYPE_BF16 && d.dtype != LWO_DTYPE_F16 && d.dtype != LWO_DTYPE_F32)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: dtype %s (%d) is not bf16, f16 or f32", call,
         lwo::dtype_name(d.dtype), static_cast<int>(d.dtype));
  if (d.flags & ~(LWO_CONV_BIAS | LWO_CONV_TF32))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", call,
         d.flags & ~(LWO_CONV_BIAS | LWO_CONV_TF32));
  if (d.layout != LWO_LAYOUT_NCHW && d.layout != LWO_LAYOUT_NHWC)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: layout %d is neither NCHW (0) nor NHWC (1)", call,
         static_cast<int>(d.layout));
  if (d.groups < 1 || d.in_channels < 1 || d.out_channels < 1 || d.in_channels % d.groups ||
      d.out_channels % d.groups)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "%s: in_channels %d and out_channels %d must be >= 1 and multiples of groups %d", call,
         d.in_channels, d.out_channels, d.groups);
  if (d.kernel_h < 1 || d.kernel_w < 1 || d.stride_h < 1 || d.stride_w < 1 || d.dilation_h < 1 ||
      d.dilation_w < 1 || d.pad_h < 0 || d.pad_w < 0)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "%s: kernel %dx%d, stride %dx%d, dilation %dx%d must be >= 1 and padding %dx%d >= 0", call,
         d.kernel_h, d.kernel_w, d.stride_h, d.stride_w, d.dilation_h, d.dilation_w, d.pad_h,
         d.pad_w);
  return lwo::Compute::Conv{d.dtype, (d.flags & LWO_CONV_BIAS) != 0, (d.flags & LWO_CONV_TF32) != 0,
                            d.layout == LWO_LAYOUT_NHWC, d.in_channels, d.out_channels, d.kernel_h,
                            d.kernel_w, d.stride_h, d.stride_w, d.pad_h, d.pad_w, d.dilation_h,
                            d.dilation_w, d.groups};
}

static void check_image(int32_t n, int32_t h, int32_t w, const char* call) {
  if (n < 1 || h < 1 || w < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: batch %d of %dx%d images: every size must be >= 1", call,
         n, h, w);
}

LWO_API lwo_status_t lwo_conv2d_output_size(const lwo_conv2d_desc* desc, int32_t h, int32_t w,
                                            int32_t* out_h, int32_t* out_w) {
  return guard([&] {
    static const char* call = "lwo_conv2d_output_size";
    lwo::Compute::Conv cv = conv_of(desc, call);
    need(out_h, call, "out_h");
    need(out_w, call, "out_w");
    check_image(1, h, w, call);
    try {
      lwo::Compute::conv_out_size(cv, h, w, out_h, out_w);
    } catch (const Error& e) {
      fail(e.status(), "%s: %s", call, e.what());
    }
  });
}

LWO_API lwo_status_t lwo_conv2d_forward(lwo_engine* engine, const lwo_conv2d_desc* desc,
                                        int32_t n, int32_t h, int32_t w, const void* x,
                                        const void* weight, const void* bias, void* y,
                                        lwo_stream_t stream) {
  return guard([&] {
    static const char* call = "lwo_conv2d_forward";
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    lwo::Compute::Conv cv = conv_of(desc, call);
    check_image(n, h, w, call);
    int32_t oh = 0, ow = 0;
    try {
      lwo::Compute::conv_out_size(cv, h, w, &oh, &ow);
    } catch (const Error& err) {
      fail(err.status(), "%s: %s", call, err.what());
    }
    need(x, call, "x");
    need(weight, call, "weight");
    need(y, call, "y");
    if (cv.bias) need(bias, call, "bias (the layer has LWO_CONV_BIAS)");
    lwo::DeviceScope scope(*e->impl);
    compute_of(e).conv_forward(cv, n, h, w, x, weight, bias, y, stream);
  });
}

LWO_API lwo_status_t lwo_conv2d_backward(lwo_engine* engine, const lwo_conv2d_desc* desc,
                                         int32_t n, int32_t h, int32_t w, const void* x,
                                         const void* dy, const void* weight, void* dx,
                                         void* dweight, void* dbias, lwo_dtype_t grad_dtype,
                                         lwo_stream_t stream) {
  return guard([&] {
    static const char* call = "lwo_conv2d_backward";
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    lwo::Compute::Conv cv = conv_of(desc, call);
    check_image(n, h, w, call);
    int32_t oh = 0, ow = 0;
    try {
      lwo::Compute::conv_out_size(cv, h, w, &oh, &ow);
    } catch (const Error& err) {
      fail(err.status(), "%s: %s", call, err.what());
    }
    need(dy, call, "dy");
    if (dx) need(weight, call, "weight (needed for dx)");
    if (dweight) need(x, call, "x (needed for dweight)");
    if (dbias && !cv.bias)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: dbias given but the layer has no LWO_CONV_BIAS", call);
    if ((dweight || dbias) && grad_dtype != LWO_DTYPE_F32 && grad_dtype != cv.dtype)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: grad_dtype %s is neither f32 nor the layer's %s", call,
           lwo::dtype_name(grad_dtype), lwo::dtype_name(cv.dtype));
    if (!dx && !dweight && !dbias)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: dx, dweight and dbias are all NULL: nothing to do", call);
    lwo::DeviceScope scope(*e->impl);
    compute_of(e).conv_backward(cv, n, h, w, x, dy, weight, dx, dweight, dbias, grad_dtype, stream);
  });
}

/* ---- checkpoints ---- */

LWO_API lwo_status_t lwo_checkpoint_open(const char* path, lwo_checkpoint** checkpoint) {
  return guard([&] {
    static const char* call = "lwo_checkpoint_open";
    need(checkpoint, call, "checkpoint (output)");
    *checkpoint = nullptr;
    need(path, call, "path");
    std::shared_ptr<lwo::Checkpoint> ck;
    try {
      ck = lwo::Checkpoint::open(path);
    } catch (const Error& e) {
      fail(e.status(), "%s: %s", call, e.what());
    }
    *checkpoint = publish(std::make_unique<lwo_checkpoint>(lwo_checkpoint{std::move(ck)}), Kind::Checkpoint);
  });
}

LWO_API lwo_status_t lwo_checkpoint_close(lwo_checkpoint* checkpoint) {
  if (!checkpoint) return guard([] {});
  return guard([&] {
    lwo_checkpoint* c = check_handle(checkpoint, Kind::Checkpoint, "lwo_checkpoint_close");
    remove_handle(c);
    delete c;
  });
}

LWO_API lwo_status_t lwo_checkpoint_tensor_count(const lwo_checkpoint* checkpoint,
                                                 uint32_t* n_tensors) {
  return guard([&] {
    lwo_checkpoint* c = check_handle(checkpoint, Kind::Checkpoint, "lwo_checkpoint_tensor_count");
    need(n_tensors, "lwo_checkpoint_tensor_count", "n_tensors");
    *n_tensors = static_cast<uint32_t>(c->impl->entries().size());
  });
}

LWO_API lwo_status_t lwo_checkpoint_tensor_info(const lwo_checkpoint* checkpoint, uint32_t index,
                                                lwo_checkpoint_tensor* info) {
  return guard([&] {
    static const char* call = "lwo_checkpoint_tensor_info";
    lwo_checkpoint* c = check_handle(checkpoint, Kind::Checkpoint, call);
    const auto& es = c->impl->entries();
    if (index >= es.size())
      fail(LWO_ERR_OUT_OF_RANGE, "%s: index %u, but '%s' has %zu tensors", call, index,
           c->impl->path().c_str(), es.size());
    const lwo::st::Entry& e = es[index];
    lwo_checkpoint_tensor v{};
    v.name = e.name.c_str();
    v.dtype_name = e.dtype_name.c_str();
    v.dtype = lwo::dtype_size(e.dtype) ? static_cast<int32_t>(e.dtype) : -1;
    v.n_dims = static_cast<int32_t>(e.shape.size());
    for (size_t d = 0; d < e.shape.size() && d < LWO_MAX_DIMS; ++d) v.shape[d] = e.shape[d];
    v.bytes = e.end - e.begin;
    v.file_offset = e.begin;
    v.file = e.file;
    write_info(info, v, call);
  });
}

LWO_API void lwo_checkpoint_pool_config_init(lwo_checkpoint_pool_config* c) {
  if (c) *c = lwo_checkpoint_pool_config LWO_CHECKPOINT_POOL_CONFIG_INIT;
}

namespace {

struct Mapping {
  lwo::st::LayerMap map;
  std::vector<std::string> strip;  // per layer
  uint32_t flags = 0;
};

Mapping map_layers(const lwo::Checkpoint& ck, const lwo_checkpoint_pool_config* config,
                   const char* call) {
  need(config, call, "config");
  lwo_checkpoint_pool_config cfg =
      read_config(config, lwo_checkpoint_pool_config LWO_CHECKPOINT_POOL_CONFIG_INIT, call);
  if (cfg.flags & ~LWO_CHECKPOINT_STAGED)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", call, cfg.flags & ~LWO_CHECKPOINT_STAGED);
  Mapping m;
  m.flags = cfg.flags;
  std::string where = std::string(call) + ": '" + ck.path() + "'";
  if (cfg.pattern && cfg.names)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: give a pattern or names, not both", call);
  try {
    if (cfg.pattern) {
      std::string pat = cfg.pattern;
      size_t at = pat.find("{i}");
      if (at == std::string::npos || pat.find("{i}", at + 1) != std::string::npos)
        fail(LWO_ERR_INVALID_ARGUMENT, "%s: pattern '%s' must contain \"{i}\" once", call, cfg.pattern);
      m.map = lwo::st::map_by_pattern(ck.entries(), pat, where);
      for (size_t l = 0; l < m.map.layers.size(); ++l)
        m.strip.push_back(pat.substr(0, at) + std::to_string(l) + pat.substr(at + 3));
    } else if (cfg.names) {
      if (!cfg.n_names || cfg.n_layers == 0)
        fail(LWO_ERR_INVALID_ARGUMENT, "%s: names need n_names and n_layers >= 1", call);
      std::vector<std::vector<std::string>> names(cfg.n_layers);
      size_t k = 0;
      for (uint32_t l = 0; l < cfg.n_layers; ++l)
        for (uint32_t j = 0; j < cfg.n_names[l]; ++j, ++k) {
          if (!cfg.names[k])
            fail(LWO_ERR_INVALID_ARGUMENT, "%s: name %u of layer %u is NULL", call, j, l);
          names[l].push_back(cfg.names[k]);
        }
      m.map = lwo::st::map_by_names(ck.entries(), names, where);
      m.strip.assign(names.size(), std::string());
    } else {
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: the config has neither a pattern nor names", call);
    }
  } catch (const Error& e) {
    if (std::string(e.what()).rfind(call, 0) == 0) throw;
    fail(e.status(), "%s: %s", call, e.what());
  }
  return m;
}

}  // namespace

LWO_API lwo_status_t lwo_pool_create_from_checkpoint(lwo_engine* engine,
                                                     lwo_checkpoint* checkpoint,
                                                     const lwo_checkpoint_pool_config* config,
                                                     lwo_pool** pool) {
  return guard([&] {
    static const char* call = "lwo_pool_create_from_checkpoint";
    need(pool, call, "pool (output)");
    *pool = nullptr;
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    lwo_checkpoint* c = check_handle(checkpoint, Kind::Checkpoint, call);
    Mapping m = map_layers(*c->impl, config, call);
    add_pool(e,
             lwo::Pool::create_from_checkpoint(*e->impl, c->impl, m.map.layers, m.strip,
                                               (m.flags & LWO_CHECKPOINT_STAGED) != 0, call),
             pool);
  });
}

LWO_API lwo_status_t lwo_checkpoint_unmatched_count(lwo_checkpoint* checkpoint,
                                                    const lwo_checkpoint_pool_config* config,
                                                    uint32_t* n_unmatched) {
  return guard([&] {
    static const char* call = "lwo_checkpoint_unmatched_count";
    lwo_checkpoint* c = check_handle(checkpoint, Kind::Checkpoint, call);
    need(n_unmatched, call, "n_unmatched");
    *n_unmatched = static_cast<uint32_t>(map_layers(*c->impl, config, call).map.unmatched.size());
  });
}

LWO_API lwo_status_t lwo_checkpoint_unmatched_name(lwo_checkpoint* checkpoint,
                                                   const lwo_checkpoint_pool_config* config,
                                                   uint32_t index, const char** name) {
  return guard([&] {
    static const char* call = "lwo_checkpoint_unmatched_name";
    lwo_checkpoint* c = check_handle(checkpoint, Kind::Checkpoint, call);
    need(name, call, "name");
    Mapping m = map_layers(*c->impl, config, call);
    if (index >= m.map.unmatched.size())
      fail(LWO_ERR_OUT_OF_RANGE, "%s: index %u, but %zu tensors are unmatched", call, index,
           m.map.unmatched.size());
    *name = c->impl->entries()[m.map.unmatched[index]].name.c_str();
  });
}

/* ---- sharded pools ---- */

static void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) fail(LWO_ERR_NCCL, "%s: %s", what, ncclGetErrorString(r));
}

LWO_API lwo_status_t lwo_nccl_get_unique_id(lwo_nccl_unique_id* id) {
  static_assert(sizeof(lwo_nccl_unique_id) == sizeof(ncclUniqueId), "unique id layout");
  return guard([&] {
    need(id, "lwo_nccl_get_unique_id", "id");
    ncclUniqueId u;
    check_nccl(ncclGetUniqueId(&u), "lwo_nccl_get_unique_id: ncclGetUniqueId");
    std::memcpy(id, &u, sizeof u);
  });
}

LWO_API lwo_status_t lwo_nccl_comm_create(lwo_engine* engine, const lwo_nccl_unique_id* id,
                                          int32_t n_ranks, int32_t rank, lwo_nccl_comm_t* comm) {
  return guard([&] {
    static const char* call = "lwo_nccl_comm_create";
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    need(id, call, "id");
    need(comm, call, "comm (output)");
    *comm = nullptr;
    if (n_ranks < 1 || rank < 0 || rank >= n_ranks)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: rank %d of %d ranks", call, rank, n_ranks);
    lwo::DeviceScope scope(*e->impl);
    ncclUniqueId u;
    std::memcpy(&u, id, sizeof u);
    ncclComm_t c = nullptr;
    check_nccl(ncclCommInitRank(&c, n_ranks, u, rank), "lwo_nccl_comm_create: ncclCommInitRank");
    *comm = reinterpret_cast<lwo_nccl_comm_t>(c);
  });
}

LWO_API lwo_status_t lwo_nccl_comm_destroy(lwo_nccl_comm_t comm) {
  return guard([&] {
    if (comm)
      check_nccl(ncclCommDestroy(reinterpret_cast<ncclComm_t>(comm)),
                 "lwo_nccl_comm_destroy: ncclCommDestroy");
  });
}

LWO_API lwo_status_t lwo_pool_create_sharded(lwo_engine* engine, const lwo_layer_desc* layers,
                                             uint32_t n_layers, lwo_nccl_comm_t comm,
                                             const lwo_pool_config* config, lwo_pool** pool) {
  return guard([&] {
    static const char* call = "lwo_pool_create_sharded";
    need(pool, call, "pool (output)");
    *pool = nullptr;
    lwo_engine* e = check_handle(engine, Kind::Engine, call);
    lwo_pool_config cfg = pool_config(config, call);
    std::unique_ptr<lwo::Pool> impl;
    try {
      impl = lwo::Pool::create_sharded(*e->impl, layers, n_layers, comm, cfg);
    } catch (const Error& err) {
      if (std::string(err.what()).rfind(call, 0) == 0) throw;
      fail(err.status(), "%s: %s", call, err.what());
    }
    add_pool(e, std::move(impl), pool);
  });
}

LWO_API lwo_status_t lwo_pool_shard_host(lwo_pool* pool, uint32_t layer, void** data,
                                         uint64_t* record_offset, uint64_t* bytes) {
  return guard([&] {
    static const char* call = "lwo_pool_shard_host";
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    need(data, call, "data");
    const auto& l = p->impl->layer(layer, call);
    if (!p->impl->comm()) fail(LWO_ERR_UNSUPPORTED, "%s: the pool is not sharded", call);
    *data = l.host;
    if (record_offset) *record_offset = l.shard_bytes * static_cast<uint64_t>(p->impl->rank());
    if (bytes) *bytes = l.shard_bytes;
  });
}

LWO_API lwo_status_t lwo_pool_shard_tensor(lwo_pool* pool, uint32_t layer, const char* name,
                                           void** data, uint64_t* first_element,
                                           uint64_t* n_elements) {
  return guard([&] {
    static const char* call = "lwo_pool_shard_tensor";
    lwo_pool* p = check_handle(pool, Kind::Pool, call);
    need(data, call, "data");
    uint32_t ti = p->impl->tensor_index(layer, name, call);
    if (!p->impl->comm()) fail(LWO_ERR_UNSUPPORTED, "%s: the pool is not sharded", call);
    const auto& l = p->impl->layer(layer, call);
    const auto& t = l.layout.tensors[ti];
    uint64_t lo = l.shard_bytes * static_cast<uint64_t>(p->impl->rank()), hi = lo + l.shard_bytes;
    uint64_t b = std::max(lo, t.offset), e = std::min(hi, t.offset + t.bytes);
    size_t es = lwo_dtype_size(t.dtype);
    if (b >= e) {
      *data = nullptr;
      if (first_element) *first_element = 0;
      if (n_elements) *n_elements = 0;
      return;
    }
    *data = l.host + (b - lo);
    if (first_element) *first_element = (b - t.offset) / es;
    if (n_elements) *n_elements = (e - b) / es;
  });
}

}  // extern "C"

namespace lwo {
namespace testing {

lwo_status_t engine_create(std::unique_ptr<Backend> backend, int device, lwo_engine** engine) {
  if (!engine) return LWO_ERR_INVALID_ARGUMENT;
  *engine = nullptr;
  return make_engine(std::move(backend), device, 0, engine);
}

Backend* engine_backend(lwo_engine* engine) { return &engine->impl->gpu(); }

void engine_set_check_collectives(lwo_engine* engine, bool on) {
  engine->impl->set_check_collectives(on);
}

}  // namespace testing
}  // namespace lwo
