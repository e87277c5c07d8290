// lwo.h: The planner. The search, the calibration's fit and the prediction
// are src/plan's (plan::best_fit, plan::calibrate); this file checks the
// arguments, gathers the inputs from the pool, the engine's budget and (when
// asked) the engine's link measurements, makes the one call and keeps the
// result.
#include <cmath>

#include "abi.h"
#include "engine/calibrate.h"
#include "src/plan/plan.h"

using namespace lwo::abi;
using lwo::fail;

namespace lwo {
struct PlanHandle {
  plan::Choice choice;  // the plan, its records and what the info reports
  plan::Link link;
  bool train = false;
  uint64_t budget = 0;
};
}  // namespace lwo

namespace {

void check_times(const double* t, uint32_t n, const char* what) {
  for (uint32_t l = 0; l < n; ++l)
    if (!std::isfinite(t[l]) || t[l] < 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s[%u] is %g: compute times are finite and >= 0", what, l,
           t[l]);
}

// The model's layers: the pool's records, the caller's compute times, and in
// a step the gradients of the trainable layers (the caller's bytes, or the
// sum of the layer's tensors).
std::vector<lwo::plan::LayerCost> layer_costs(lwo::Pool& po, const lwo_plan_config& cfg,
                                              bool train) {
  std::vector<lwo::plan::LayerCost> layers(po.n_layers());
  for (uint32_t l = 0; l < po.n_layers(); ++l) {
    const lwo::Pool::Layer& pl = po.layer(l);
    layers[l].bytes = pl.layout.record_bytes;
    layers[l].fwd_ms = cfg.fwd_ms[l];
    if (!train) continue;
    layers[l].bwd_ms = cfg.bwd_ms[l];
    if (cfg.trainable && !cfg.trainable[l]) continue;
    if (cfg.grad_bytes)
      layers[l].grad_bytes = cfg.grad_bytes[l];
    else
      for (uint64_t b : pl.tensor_bytes) layers[l].grad_bytes += b;
  }
  return layers;
}

// The link as the caller gives it, or calibrated on the engine's streams.
lwo::plan::Link link_of(lwo::Pool& po, const lwo_plan_config& cfg) {
  if (cfg.flags & LWO_PLAN_CALIBRATE_LINK) {
    auto measure = [&po](uint64_t bytes) {
      const lwo::LinkRates r = lwo::measure_link(po.engine(), bytes, 5);
      return lwo::plan::Link{r.h2d_gbps, r.d2h_gbps, r.duplex_h2d_gbps, r.duplex_d2h_gbps, 0};
    };
    return lwo::plan::calibrate(measure, cfg.calibrate_bytes, (cfg.flags & LWO_PLAN_GROUP) != 0,
                                cfg.copy_overhead_ms);
  }
  return lwo::plan::Link{cfg.h2d_gbps, cfg.d2h_gbps, cfg.duplex_h2d_gbps, cfg.duplex_d2h_gbps,
                         cfg.copy_overhead_ms};
}

}  // namespace

extern "C" {

LWO_API void lwo_plan_config_init(lwo_plan_config* c) {
  if (c) *c = lwo_plan_config LWO_PLAN_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_plan_create(lwo_pool* pool, const lwo_plan_config* config,
                                     lwo_plan** plan) {
  return guard("lwo_plan_create", [&] {
    clear_output(plan, "plan (output)");
    lwo_pool* p = check_handle(pool);
    const CaptureGate gate = capture_gate(p->impl->engine());
    p->impl->engine().check_not_capturing("a plan's measurement");
    need(config, "config");
    lwo_plan_config cfg = read_config(config, lwo_plan_config LWO_PLAN_CONFIG_INIT);
    check_flags(cfg.flags, LWO_PLAN_TRAIN | LWO_PLAN_CALIBRATE_LINK | LWO_PLAN_GROUP);
    if (!std::isfinite(cfg.copy_overhead_ms) || cfg.copy_overhead_ms < 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "copy_overhead_ms is %g: it must be finite and >= 0",
           cfg.copy_overhead_ms);
    const bool train = cfg.flags & LWO_PLAN_TRAIN;
    lwo::Pool& po = *p->impl;
    need(cfg.fwd_ms, "fwd_ms");
    check_times(cfg.fwd_ms, po.n_layers(), "fwd_ms");
    if (train) {
      need(cfg.bwd_ms, "bwd_ms (a training step)");
      check_times(cfg.bwd_ms, po.n_layers(), "bwd_ms");
      if (cfg.grad_depth < 1)
        fail(LWO_ERR_INVALID_ARGUMENT, "grad_depth is 0: a step needs a gradient slot");
    }
    lwo::plan::Request req;
    if (cfg.n_depths) {
      need(cfg.depths, "depths");
      req.depths.assign(cfg.depths, cfg.depths + cfg.n_depths);
      for (uint32_t d : req.depths)
        if (d < 1 || d > lwo::kMaxDepth)
          fail(LWO_ERR_INVALID_ARGUMENT, "depth %u is outside 1..%u", d, lwo::kMaxDepth);
    }
    if (!(cfg.flags & LWO_PLAN_CALIBRATE_LINK) &&
        !(cfg.h2d_gbps > 0 && (!train || cfg.d2h_gbps > 0)))
      fail(LWO_ERR_INVALID_ARGUMENT, "the link's rates (h2d_gbps %g, d2h_gbps %g) must be > 0, "
           "or set LWO_PLAN_CALIBRATE_LINK", cfg.h2d_gbps, cfg.d2h_gbps);
    if (po.communicator())
      fail(LWO_ERR_UNSUPPORTED, "the pool is sharded over %d ranks: resident layers are not "
           "supported there, so there is nothing to plan", po.n_ranks());

    req.layers = layer_costs(po, cfg, train);
    req.pass.backward = train;
    req.pass.grad_depth = cfg.grad_depth;
    req.link = link_of(po, cfg);
    req.budget_bytes = cfg.budget_bytes ? cfg.budget_bytes : lwo::plan_room(po.engine());
    req.grouping = cfg.flags & LWO_PLAN_GROUP;
    req.footprint = lwo::device_footprint;  // the engine's rounding of each allocation
    auto h = std::make_unique<lwo::PlanHandle>();
    h->choice = lwo::plan::best_fit(req);
    h->link = req.link;
    h->train = train;
    h->budget = req.budget_bytes;
    *plan = publish(std::make_unique<lwo_plan>(lwo_plan{std::move(h)}));
  });
}

LWO_API lwo_status_t lwo_plan_destroy(lwo_plan* plan) {
  return guard("lwo_plan_destroy", [&] {
    if (!plan) return;
    retire(check_handle(plan));
  });
}

LWO_API lwo_status_t lwo_plan_get_info(const lwo_plan* plan, lwo_plan_info* info) {
  return guard("lwo_plan_get_info", [&] {
    const lwo::PlanHandle& h = *check_handle(plan)->impl;
    need(info, "info");
    lwo_plan_info v{};
    const lwo::plan::Choice& c = h.choice;
    v.depth = c.depth;
    v.n_resident = static_cast<uint32_t>(c.resident.size());
    v.n_positions = static_cast<uint32_t>(c.prediction.positions.size());
    v.train = h.train ? 1u : 0u;
    v.device_bytes = c.device_bytes;
    v.budget_bytes = h.budget;
    v.predicted_ms = c.prediction.ms;
    v.predicted_stall_ms = c.prediction.stall_ms;
    v.h2d_bytes = c.prediction.h2d_bytes;
    v.d2h_bytes = c.prediction.d2h_bytes;
    v.h2d_gbps = h.link.h2d_gbps;
    v.d2h_gbps = h.link.d2h_gbps;
    v.duplex_h2d_gbps = h.link.duplex_h2d_gbps;
    v.duplex_d2h_gbps = h.link.duplex_d2h_gbps;
    v.first_k_ms = c.first_k.prediction.ms;
    v.n_groups = static_cast<uint32_t>(c.groups.size());
    v.ungrouped_ms = c.plan.prediction.ms;
    v.copy_overhead_ms = h.link.copy_overhead_ms;
    write_out(info, v, "info");
  });
}

LWO_API lwo_status_t lwo_plan_get_position(const lwo_plan* plan, uint32_t position,
                                           lwo_plan_position* out) {
  return guard("lwo_plan_get_position", [&] {
    const lwo::PlanHandle& h = *check_handle(plan)->impl;
    need(out, "out");
    const lwo::plan::Position& p =
        at(h.choice.prediction.positions, position, "the plan", "positions");
    lwo_plan_position v{};
    v.layer = p.layer;
    v.backward = p.backward;
    v.resident = p.resident;
    v.hit = p.hit;
    v.copy_ms = p.copy_ms;
    v.start_ms = p.start_ms;
    v.stall_ms = p.stall_ms;
    write_out(out, v, "out");
  });
}

LWO_API lwo_status_t lwo_plan_ring_config(const lwo_plan* plan, lwo_ring_config* config) {
  return guard("lwo_plan_ring_config", [&] {
    const lwo::PlanHandle& h = *check_handle(plan)->impl;
    need(config, "config");
    if (config->size < offsetof(lwo_ring_config, n_resident) + sizeof(uint32_t))
      fail(LWO_ERR_INVALID_ARGUMENT, "config size %zu has no resident fields (expected %zu)",
           config->size, sizeof(lwo_ring_config));
    const lwo::plan::Choice& c = h.choice;
    config->depth = c.depth;
    config->resident_layers = c.resident.empty() ? nullptr : c.resident.data();
    config->n_resident = static_cast<uint32_t>(c.resident.size());
  });
}

LWO_API lwo_status_t lwo_plan_get_group(const lwo_plan* plan, uint32_t group,
                                        lwo_plan_group* out) {
  return guard("lwo_plan_get_group", [&] {
    const lwo::PlanHandle& h = *check_handle(plan)->impl;
    need(out, "out");
    const lwo::plan::Group& g = at(h.choice.groups, group, "the plan", "groups");
    lwo_plan_group v{};
    v.first_layer = g.first;
    v.n_layers = g.count;
    v.resident = g.resident ? 1u : 0u;
    v.bytes = h.choice.group_bytes[group];
    write_out(out, v, "out");
  });
}

}  // extern "C"
