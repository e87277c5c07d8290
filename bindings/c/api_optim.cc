// lwo.h: The optimizer step on the host.
#include <cstddef>
#include <vector>

#include "abi.h"
#include "src/common/dtype.h"

using namespace lwo::abi;
using lwo::fail;

namespace {
// lwo_optim_step_groups' and lwo_optim_step_open's array: each element read
// like a config, its own size the caller's stride.
std::vector<lwo_optim_step_params> read_groups(const lwo_optim_step_params* params,
                                               uint32_t n_groups) {
  need(params, "params");
  if (n_groups == 0 || n_groups > (1u << 20))
    fail(LWO_ERR_INVALID_ARGUMENT, "n_groups %u is outside [1, 2^20]", n_groups);
  const size_t stride = params[0].size;
  if (stride < offsetof(lwo_optim_step_params, step) + sizeof(uint64_t))
    fail(LWO_ERR_INVALID_ARGUMENT, "params[0].size %zu is too small for a step's parameters",
         stride);
  std::vector<lwo_optim_step_params> g(n_groups);
  for (uint32_t i = 0; i < n_groups; ++i) {
    const auto* e = reinterpret_cast<const lwo_optim_step_params*>(
        reinterpret_cast<const char*>(params) + i * stride);
    if (e->size != stride)
      fail(LWO_ERR_INVALID_ARGUMENT, "params[%u].size %zu differs from params[0].size %zu "
           "(one array of one struct size)", i, e->size, stride);
    g[i] = read_config(e, lwo_optim_step_params LWO_OPTIM_STEP_PARAMS_INIT, "params");
  }
  return g;
}
}  // namespace

extern "C" {

LWO_API void lwo_optim_config_init(lwo_optim_config* c) {
  if (c) *c = lwo_optim_config LWO_OPTIM_CONFIG_INIT;
}

LWO_API void lwo_optim_step_params_init(lwo_optim_step_params* p) {
  if (p) *p = lwo_optim_step_params LWO_OPTIM_STEP_PARAMS_INIT;
}

LWO_API lwo_status_t lwo_optim_create(lwo_grads* grads, const lwo_optim_config* config,
                                      lwo_optim** optim) {
  return guard("lwo_optim_create", [&] {
    clear_output(optim, "optim (output)");
    lwo_grads* g = check_handle(grads);
    lwo_optim_config cfg = read_config(config, lwo_optim_config LWO_OPTIM_CONFIG_INIT);
    lwo::check_dtype_value(cfg.state_dtype, "state_dtype");
    check_flags(cfg.flags, LWO_OPTIM_STOCHASTIC_ROUNDING | LWO_OPTIM_CLIPPING | LWO_OPTIM_DELAYED);
    if ((cfg.flags & LWO_OPTIM_DELAYED) && (cfg.flags & LWO_OPTIM_CLIPPING))
      fail(LWO_ERR_INVALID_ARGUMENT,
           "flags 0x%x: LWO_OPTIM_DELAYED and LWO_OPTIM_CLIPPING exclude each other", cfg.flags);
    if (cfg.kind != LWO_OPTIM_ADAMW && cfg.kind != LWO_OPTIM_SGD)
      fail(LWO_ERR_INVALID_ARGUMENT, "kind %d is not LWO_OPTIM_ADAMW or LWO_OPTIM_SGD", cfg.kind);
    if (cfg.state_dtype != LWO_DTYPE_F32 && cfg.state_dtype != LWO_DTYPE_BF16)
      fail(LWO_ERR_INVALID_ARGUMENT, "state_dtype %s: the state is f32 or bf16",
           lwo::dtype_name(cfg.state_dtype));
    if ((cfg.flags & LWO_OPTIM_STOCHASTIC_ROUNDING) && cfg.state_dtype != LWO_DTYPE_BF16)
      fail(LWO_ERR_INVALID_ARGUMENT,
           "LWO_OPTIM_STOCHASTIC_ROUNDING with state_dtype %s (it rounds bf16 state)",
           lwo::dtype_name(cfg.state_dtype));
    if (cfg.n_threads > 64)
      fail(LWO_ERR_INVALID_ARGUMENT, "n_threads %u is above 64", cfg.n_threads);
    lwo::Optimizer::Config c;
    c.kind = cfg.kind;
    c.state_dtype = cfg.state_dtype;
    c.stochastic = (cfg.flags & LWO_OPTIM_STOCHASTIC_ROUNDING) != 0;
    c.clipping = (cfg.flags & LWO_OPTIM_CLIPPING) != 0;
    c.delayed = (cfg.flags & LWO_OPTIM_DELAYED) != 0;
    c.n_threads = cfg.n_threads;
    c.seed = cfg.seed;
    auto impl = std::make_unique<lwo::Optimizer>(*g->impl, c);
    *optim = publish(std::make_unique<lwo_optim>(lwo_optim{std::move(impl)}));
  });
}

LWO_API lwo_status_t lwo_optim_destroy(lwo_optim* optim) {
  return guard("lwo_optim_destroy", [&] { destroy(optim); });
}

LWO_API lwo_status_t lwo_optim_step(lwo_optim* optim, const lwo_optim_step_params* params) {
  return guard("lwo_optim_step", [&] {
    lwo_optim* o = check_handle(optim);
    need(params, "params");
    lwo_optim_step_params p =
        read_config(params, lwo_optim_step_params LWO_OPTIM_STEP_PARAMS_INIT, "params");
    o->impl->step(&p, 1);
  });
}

LWO_API lwo_status_t lwo_optim_set_group(lwo_optim* optim, uint32_t layer, const char* name,
                                         uint32_t group) {
  return guard("lwo_optim_set_group", [&] { check_handle(optim)->impl->set_group(layer, name, group); });
}

LWO_API lwo_status_t lwo_optim_step_groups(lwo_optim* optim, const lwo_optim_step_params* params,
                                           uint32_t n_groups) {
  return guard("lwo_optim_step_groups", [&] {
    lwo_optim* o = check_handle(optim);
    std::vector<lwo_optim_step_params> g = read_groups(params, n_groups);
    o->impl->step(g.data(), n_groups);
  });
}

LWO_API lwo_status_t lwo_optim_step_open(lwo_optim* optim, const lwo_optim_step_params* params,
                                         uint32_t n_groups) {
  return guard("lwo_optim_step_open", [&] {
    lwo_optim* o = check_handle(optim);
    std::vector<lwo_optim_step_params> g = read_groups(params, n_groups);
    o->impl->step(g.data(), n_groups, true);
  });
}

LWO_API lwo_status_t lwo_optim_step_add(lwo_optim* optim, uint32_t layer) {
  return guard("lwo_optim_step_add", [&] { check_handle(optim)->impl->add(layer); });
}

LWO_API lwo_status_t lwo_optim_step_close(lwo_optim* optim) {
  return guard("lwo_optim_step_close", [&] { check_handle(optim)->impl->close(); });
}

LWO_API lwo_status_t lwo_optim_wait(lwo_optim* optim) {
  return guard("lwo_optim_wait", [&] { check_handle(optim)->impl->wait(); });
}

LWO_API lwo_status_t lwo_optim_query(lwo_optim* optim, uint32_t* done) {
  return guard("lwo_optim_query", [&] {
    lwo_optim* o = check_handle(optim);
    need(done, "done");
    *done = o->impl->done() ? 1u : 0u;
  });
}

LWO_API lwo_status_t lwo_optim_read(lwo_optim* optim, uint32_t layer, const char* name,
                                    lwo_optim_state_t which, void* dst, uint64_t bytes) {
  return guard("lwo_optim_read", [&] {
    check_handle(optim)->impl->read(layer, name, which, dst, bytes);
  });
}

LWO_API lwo_status_t lwo_optim_write(lwo_optim* optim, uint32_t layer, const char* name,
                                     lwo_optim_state_t which, const void* src, uint64_t bytes) {
  return guard("lwo_optim_write", [&] {
    check_handle(optim)->impl->write(layer, name, which, src, bytes);
  });
}

LWO_API lwo_status_t lwo_optim_get_info(lwo_optim* optim, lwo_optim_info* info) {
  return guard("lwo_optim_get_info", [&] {
    lwo_optim* o = check_handle(optim);
    check_out(info, "info");
    lwo_optim_info v{};
    o->impl->info(&v);
    write_out(info, v, "info");
  });
}

LWO_API lwo_status_t lwo_optim_get_stats(lwo_optim* optim, lwo_optim_stats* stats) {
  return guard("lwo_optim_get_stats", [&] {
    lwo_optim* o = check_handle(optim);
    check_out(stats, "stats");
    lwo_optim_stats v{};
    o->impl->stats(&v);
    write_out(stats, v, "stats");
  });
}

}  // extern "C"

namespace lwo {
namespace testing {

std::vector<uint32_t> optim_last_order(lwo_optim* optim) {
  return lwo::abi::check_handle(optim)->impl->last_order();
}

}  // namespace testing
}  // namespace lwo
