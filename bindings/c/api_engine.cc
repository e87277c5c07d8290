// lwo.h: Engine.
#include <chrono>

#include "abi.h"
#include "lwo_test.h"
#include "testing.h"

using namespace lwo::abi;
using lwo::fail;

namespace {

// The engine's host limit for a host_limit_bytes value (0: none).
uint64_t host_limit_of(uint64_t v) {
  if (v == LWO_HOST_LIMIT_NONE) return 0;
  return v ? v : lwo::default_host_limit();
}

// engine->impl->*wait(): the engine's check or synchronize, a failure
// reported as its device's ("device 0: ...").
void on_device(lwo_engine* engine, void (lwo::Engine::*wait)()) {
  try {
    (engine->impl.get()->*wait)();
  } catch (const lwo::Error& err) {
    fail(err.status(), "device %d: %s", engine->impl->device(), err.what());
  }
}

lwo_status_t make_engine(const char* call, std::unique_ptr<lwo::Backend> backend, int device,
                         const lwo_engine_config& cfg, lwo_engine** engine) {
  return guard(call, [&] {
    auto h = std::make_unique<lwo_engine>();
    h->impl = std::make_unique<lwo::Engine>(std::move(backend), device);
    if (cfg.flags & LWO_ENGINE_CHECK_COLLECTIVES) h->impl->set_check_collectives(true);
    if (cfg.flags & LWO_ENGINE_HEURISTIC_GEMM) h->impl->set_tune_gemms(false);
    if (cfg.flags & LWO_ENGINE_CHECKING) h->impl->set_checking(true);
    if (cfg.budget_bytes || cfg.budget_share != 0.0 || cfg.budget_headroom)
      h->impl->set_budget(cfg.budget_bytes, cfg.budget_share, cfg.budget_headroom);
    h->impl->set_host_limit(host_limit_of(cfg.host_limit_bytes));
    *engine = publish(std::move(h));
  });
}

}  // namespace

extern "C" {

LWO_API void lwo_engine_config_init(lwo_engine_config* c) {
  if (c) *c = lwo_engine_config LWO_ENGINE_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_engine_create(const lwo_engine_config* config, lwo_engine** engine) {
  static const char* call = "lwo_engine_create";
  lwo_engine_config cfg{};
  std::unique_ptr<lwo::Backend> backend;
  lwo_status_t s = guard(call, [&] {
    clear_output(engine, "engine (output)");
    cfg = read_config(config, lwo_engine_config LWO_ENGINE_CONFIG_INIT);
    check_flags(cfg.flags, LWO_ENGINE_CHECK_COLLECTIVES | LWO_ENGINE_HEURISTIC_GEMM |
                               LWO_ENGINE_CHECKING);
    if (cfg.device < 0) fail(LWO_ERR_INVALID_ARGUMENT, "device %d is negative", cfg.device);
    if (!(cfg.budget_share >= 0.0 && cfg.budget_share <= 1.0))
      fail(LWO_ERR_INVALID_ARGUMENT, "budget_share %g is outside [0, 1]", cfg.budget_share);
    backend = lwo::make_cuda_backend(cfg.device);
  });
  if (s != LWO_OK) return s;
  return make_engine(call, std::move(backend), cfg.device, cfg, engine);
}

// bindings/c/lwo_test.h: the engine on the host backend, for tests only.
LWO_API lwo_status_t lwo_test_engine_create_host(uint32_t flags, lwo_engine** engine) {
  static const char* call = "lwo_test_engine_create_host";
  lwo_status_t s = guard(call, [&] {
    need(engine, "engine (output)");
    *engine = nullptr;
    check_flags(flags, LWO_TEST_HOST_POISON);
  });
  if (s != LWO_OK) return s;
  return make_engine(call, lwo::make_host_backend((flags & LWO_TEST_HOST_POISON) != 0), 0,
                     lwo_engine_config LWO_ENGINE_CONFIG_INIT, engine);
}

LWO_API lwo_status_t lwo_test_host_comm_timeout(uint32_t timeout_ms, uint32_t* previous_ms) {
  return guard("lwo_test_host_comm_timeout", [&] {
    if (timeout_ms == 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "timeout_ms 0: a deadline is at least 1 ms");
    const auto old = lwo::set_host_comm_timeout(std::chrono::milliseconds(timeout_ms));
    if (previous_ms) *previous_ms = static_cast<uint32_t>(old.count());
  });
}

LWO_API lwo_status_t lwo_engine_destroy(lwo_engine* engine) {
  return guard("lwo_engine_destroy", [&] { destroy(engine); });
}

LWO_API lwo_status_t lwo_engine_device(const lwo_engine* engine, int32_t* device) {
  return guard("lwo_engine_device", [&] {
    lwo_engine* e = check_handle(engine);
    need(device, "device");
    *device = e->impl->device();
  });
}

LWO_API lwo_status_t lwo_engine_set_host_limit(lwo_engine* engine, uint64_t host_limit_bytes) {
  return guard("lwo_engine_set_host_limit", [&] {
    lwo_engine* e = check_handle(engine);
    uint64_t limit = host_limit_of(host_limit_bytes);
    uint64_t charged = e->impl->host_charged();
    if (limit && charged > limit)
      fail(LWO_ERR_OVER_BUDGET,
           "engine on device %d: a host limit of %llu bytes is below the %llu bytes of host "
           "memory already charged", e->impl->device(), static_cast<unsigned long long>(limit),
           static_cast<unsigned long long>(charged));
    e->impl->set_host_limit(limit);
  });
}

LWO_API lwo_status_t lwo_engine_host_usage(const lwo_engine* engine, uint64_t* limit_bytes,
                                           uint64_t* charged_bytes) {
  return guard("lwo_engine_host_usage", [&] {
    const lwo_engine* e = check_handle(engine);
    if (limit_bytes) *limit_bytes = e->impl->host_limit();
    if (charged_bytes) *charged_bytes = e->impl->host_charged();
  });
}

LWO_API lwo_status_t lwo_engine_set_budget(lwo_engine* engine, uint64_t budget_bytes,
                                           double budget_share, uint64_t budget_headroom) {
  return guard("lwo_engine_set_budget", [&] {
    lwo_engine* e = check_handle(engine);
    e->impl->set_budget(budget_bytes, budget_share, budget_headroom);
  });
}

LWO_API lwo_status_t lwo_engine_get_memory(const lwo_engine* engine, lwo_engine_memory* memory) {
  return guard("lwo_engine_get_memory", [&] {
    lwo_engine* e = check_handle(engine);
    need(memory, "memory");
    lwo::Engine& en = *e->impl;
    uint64_t by[lwo::kMemUses] = {}, used = 0;
    en.memory_use(by, &used);
    size_t free_b = 0, total_b = 0;
    {
      lwo::DeviceScope scope(en);
      en.gpu().mem_get_info(&free_b, &total_b);
    }
    lwo_engine_memory m{};
    m.budget = en.budget();
    m.used = used;
    m.left = m.budget ? m.budget - std::min(m.budget, used) : free_b;
    m.ring_slots = by[static_cast<uint32_t>(lwo::MemUse::Slots)];
    m.resident = by[static_cast<uint32_t>(lwo::MemUse::Resident)];
    m.grads = by[static_cast<uint32_t>(lwo::MemUse::Grads)];
    m.workspaces = by[static_cast<uint32_t>(lwo::MemUse::Workspace)];
    m.device_free = free_b;
    m.device_total = total_b;
    write_out(memory, m, "memory");
  });
}

LWO_API lwo_status_t lwo_engine_transfer_stream(const lwo_engine* engine, lwo_stream_t* stream) {
  return guard("lwo_engine_transfer_stream", [&] {
    lwo_engine* e = check_handle(engine);
    need(stream, "stream");
    *stream = static_cast<lwo_stream_t>(e->impl->h2d());
  });
}

LWO_API lwo_status_t lwo_engine_check(lwo_engine* engine) {
  return guard("lwo_engine_check", [&] {
    lwo_engine* e = check_handle(engine);
    const CaptureGate gate = capture_gate(*e->impl);
    on_device(e, &lwo::Engine::check);
  });
}

LWO_API lwo_status_t lwo_engine_synchronize(lwo_engine* engine) {
  return guard("lwo_engine_synchronize", [&] {
    lwo_engine* e = check_handle(engine);
    const CaptureGate gate = capture_gate(*e->impl);
    on_device(e, &lwo::Engine::synchronize);
  });
}

}  // extern "C"

namespace lwo {
namespace testing {

lwo_status_t engine_create(std::unique_ptr<Backend> backend, int device, lwo_engine** engine) {
  if (!engine) return LWO_ERR_INVALID_ARGUMENT;
  *engine = nullptr;
  return make_engine("lwo::testing::engine_create", std::move(backend), device,
                     lwo_engine_config LWO_ENGINE_CONFIG_INIT, engine);
}

Backend* engine_backend(lwo_engine* engine) {
  return &lwo::abi::check_handle(engine)->impl->gpu();
}

void engine_set_check_collectives(lwo_engine* engine, bool on) {
  lwo::abi::check_handle(engine)->impl->set_check_collectives(on);
}

void engine_set_checking(lwo_engine* engine, bool on) {
  lwo::abi::check_handle(engine)->impl->set_checking(on);
}

}  // namespace testing
}  // namespace lwo
