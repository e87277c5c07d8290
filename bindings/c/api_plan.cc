// lwo.h: The planner (Since 0.4.0). The choice and the prediction are
// src/plan's; this file gathers their inputs from the pool, the engine's
// budget and (when asked) a calibration of the engine's link, and keeps the
// result.
#include <cmath>

#include "abi.h"
#include "engine/calibrate.h"
#include "src/plan/plan.h"

using namespace lwo::abi;
using lwo::fail;

namespace lwo {
struct PlanHandle {
  plan::Plan plan;     // one record per layer
  plan::Plan first_k;
  plan::Link link;
  bool train = false;
  uint64_t budget = 0;
  // The records the plan recommends (one per layer without grouping), their
  // costs, and the prediction, depth and bytes the info reports.
  std::vector<plan::Group> groups;
  std::vector<uint64_t> group_bytes;
  plan::Prediction prediction;
  uint32_t depth = 0;
  uint64_t device_bytes = 0;
  std::vector<uint32_t> resident;  // ascending record indices
};
}  // namespace lwo

namespace {

// The bytes the engine's budget will charge for a plan's ring, resident
// layers and gradient staging (each allocation rounded as cudaMalloc does).
uint64_t charged_bytes(const std::vector<lwo::plan::LayerCost>& layers, const lwo::plan::Plan& p,
                       const lwo::plan::Pass& pass) {
  uint64_t res = 0, slot = 0, grad = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    if (p.resident[l])
      res += lwo::device_footprint(layers[l].bytes);
    else
      slot = std::max(slot, layers[l].bytes);
    if (pass.backward) grad = std::max(grad, layers[l].grad_bytes);
  }
  return res + p.depth * lwo::device_footprint(slot ? slot : LWO_RECORD_ALIGN) +
         (pass.backward && grad ? pass.grad_depth * lwo::device_footprint(grad) : 0);
}

void check_times(const double* t, uint32_t n, const char* what) {
  for (uint32_t l = 0; l < n; ++l)
    if (!std::isfinite(t[l]) || t[l] < 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s[%u] is %g: compute times are finite and >= 0", what, l,
           t[l]);
}

}  // namespace

extern "C" {

LWO_API void lwo_plan_config_init(lwo_plan_config* c) {
  if (c) *c = lwo_plan_config LWO_PLAN_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_plan_create(lwo_pool* pool, const lwo_plan_config* config,
                                     lwo_plan** plan) {
  return guard("lwo_plan_create", [&] {
    need(plan, "plan (output)");
    *plan = nullptr;
    lwo_pool* p = check_handle(pool);
    need(config, "config");
    lwo_plan_config cfg = read_config(config, lwo_plan_config LWO_PLAN_CONFIG_INIT);
    check_flags(cfg.flags, LWO_PLAN_TRAIN | LWO_PLAN_CALIBRATE_LINK | LWO_PLAN_GROUP);
    const bool grouping = cfg.flags & LWO_PLAN_GROUP;
    if (!std::isfinite(cfg.copy_overhead_ms) || cfg.copy_overhead_ms < 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "copy_overhead_ms is %g: it must be finite and >= 0",
           cfg.copy_overhead_ms);
    const bool train = cfg.flags & LWO_PLAN_TRAIN;
    lwo::Pool& po = *p->impl;
    const uint32_t L = po.n_layers();
    need(cfg.fwd_ms, "fwd_ms");
    check_times(cfg.fwd_ms, L, "fwd_ms");
    if (train) {
      need(cfg.bwd_ms, "bwd_ms (a training step)");
      check_times(cfg.bwd_ms, L, "bwd_ms");
      if (cfg.grad_depth < 1)
        fail(LWO_ERR_INVALID_ARGUMENT, "grad_depth is 0: a step needs a gradient slot");
    }
    std::vector<uint32_t> depths = {1, 2, 3, 4, 6, 8};
    if (cfg.n_depths) {
      need(cfg.depths, "depths");
      depths.assign(cfg.depths, cfg.depths + cfg.n_depths);
      for (uint32_t d : depths)
        if (d < 1 || d > lwo::kMaxDepth)
          fail(LWO_ERR_INVALID_ARGUMENT, "depth %u is outside 1..%u", d, lwo::kMaxDepth);
    }
    const bool calibrate = cfg.flags & LWO_PLAN_CALIBRATE_LINK;
    if (!calibrate && !(cfg.h2d_gbps > 0 && (!train || cfg.d2h_gbps > 0)))
      fail(LWO_ERR_INVALID_ARGUMENT, "the link's rates (h2d_gbps %g, d2h_gbps %g) must be > 0, "
           "or set LWO_PLAN_CALIBRATE_LINK", cfg.h2d_gbps, cfg.d2h_gbps);
    if (po.comm())
      fail(LWO_ERR_UNSUPPORTED, "the pool is sharded over %d ranks: resident layers are not "
           "supported there, so there is nothing to plan", po.n_ranks());

    std::vector<lwo::plan::LayerCost> layers(L);
    for (uint32_t l = 0; l < L; ++l) {
      const lwo::Pool::Layer& pl = po.layer(l);
      layers[l].bytes = pl.layout.record_bytes;
      layers[l].fwd_ms = cfg.fwd_ms[l];
      if (train) {
        layers[l].bwd_ms = cfg.bwd_ms[l];
        bool trainable = !cfg.trainable || cfg.trainable[l];
        if (trainable) {
          if (cfg.grad_bytes) {
            layers[l].grad_bytes = cfg.grad_bytes[l];
          } else {
            for (uint64_t b : pl.tensor_bytes) layers[l].grad_bytes += b;
          }
        }
      }
    }
    lwo::plan::Pass pass;
    pass.backward = train;
    pass.grad_depth = cfg.grad_depth;
    lwo::plan::Link link;
    if (calibrate) {
      lwo::LinkRates r = lwo::measure_link(po.engine(), cfg.calibrate_bytes ? cfg.calibrate_bytes
                                                                             : (uint64_t(256) << 20), 5);
      link.h2d_gbps = r.h2d_gbps;
      link.d2h_gbps = r.d2h_gbps;
      link.duplex_h2d_gbps = r.duplex_h2d_gbps;
      link.duplex_d2h_gbps = r.duplex_d2h_gbps;
      link.copy_overhead_ms = cfg.copy_overhead_ms;
      if (grouping) {  // a second, smaller size: t = overhead + bytes / rate
        const uint64_t big = cfg.calibrate_bytes ? cfg.calibrate_bytes : (uint64_t(256) << 20);
        const uint64_t small = std::max<uint64_t>(big / 64, 4096);
        if (small < big) {
          lwo::LinkRates s = lwo::measure_link(po.engine(), small, 5);
          auto ms = [](uint64_t b, double gbps) { return static_cast<double>(b) / (gbps * 1e6); };
          try {
            lwo::plan::CopyFit f =
                lwo::plan::fit_copy(small, ms(small, s.h2d_gbps), big, ms(big, r.h2d_gbps));
            link.copy_overhead_ms = f.overhead_ms;
            link.h2d_gbps = f.gbps;
          } catch (const lwo::Error&) {
            link.copy_overhead_ms = 0;  // the small copy was not faster: no overhead seen
          }
        }
      }
    } else {
      link.h2d_gbps = cfg.h2d_gbps;
      link.d2h_gbps = cfg.d2h_gbps;
      link.duplex_h2d_gbps = cfg.duplex_h2d_gbps;
      link.duplex_d2h_gbps = cfg.duplex_d2h_gbps;
      link.copy_overhead_ms = cfg.copy_overhead_ms;
    }
    uint64_t budget = cfg.budget_bytes;
    if (!budget) {
      lwo::Engine& e = po.engine();
      uint64_t used = 0;
      e.memory_use(nullptr, &used);
      uint64_t limit = e.budget();
      if (limit) {
        budget = limit - std::min(limit, used);
      } else {
        size_t free_b = 0, total_b = 0;
        lwo::DeviceScope scope(e);
        e.gpu().mem_get_info(&free_b, &total_b);
        budget = free_b;
      }
    }
    // The model counts bytes as asked; the budget charges them rounded. Search
    // again with less room until the rounded plan fits.
    auto h = std::make_unique<lwo::PlanHandle>();
    uint64_t room = budget;
    for (int tries = 0;; ++tries) {
      h->plan = lwo::plan::choose(layers, room, link, pass, depths);
      uint64_t charged = charged_bytes(layers, h->plan, pass);
      if (charged <= budget) break;
      if (tries == 8 || charged - budget >= room)
        fail(LWO_ERR_OVER_BUDGET, "no plan's allocations fit a budget of %llu bytes (the "
             "smallest found needs %llu)", static_cast<unsigned long long>(budget),
             static_cast<unsigned long long>(charged));
      room -= charged - budget;
    }
    try {
      h->first_k = lwo::plan::first_layers(layers, room, link, pass, h->plan.depth);
    } catch (const lwo::Error&) {
      h->first_k = h->plan;
    }
    h->link = link;
    h->train = train;
    h->budget = budget;
    for (uint32_t l = 0; l < L; ++l) h->groups.push_back(lwo::plan::Group{l, 1, h->plan.resident[l]});
    h->prediction = h->plan.prediction;
    h->depth = h->plan.depth;
    h->device_bytes = h->plan.device_bytes;
    if (grouping && L > 1) {
      // Groups and residents together; taken only if it predicts less and its
      // rounded allocations fit the budget too.
      lwo::plan::Grouping g = lwo::plan::choose_grouped(layers, room, link, pass, depths);
      lwo::plan::Plan gp;
      gp.resident = lwo::plan::grouped_resident(g.groups);
      gp.depth = g.depth;
      const auto costs = lwo::plan::grouped_costs(layers, g.groups);
      if (g.prediction.ms < h->prediction.ms && charged_bytes(costs, gp, pass) <= budget) {
        h->groups = std::move(g.groups);
        h->prediction = std::move(g.prediction);
        h->depth = g.depth;
        h->device_bytes = g.device_bytes;
      }
    }
    for (uint32_t i = 0; i < h->groups.size(); ++i) {
      uint64_t b = 0;
      for (uint32_t l = h->groups[i].first; l < h->groups[i].first + h->groups[i].count; ++l)
        b += layers[l].bytes;
      h->group_bytes.push_back(b);
      if (h->groups[i].resident) h->resident.push_back(i);
    }
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
    v.depth = h.depth;
    v.n_resident = static_cast<uint32_t>(h.resident.size());
    v.n_positions = static_cast<uint32_t>(h.prediction.positions.size());
    v.train = h.train ? 1u : 0u;
    v.device_bytes = h.device_bytes;
    v.budget_bytes = h.budget;
    v.predicted_ms = h.prediction.ms;
    v.predicted_stall_ms = h.prediction.stall_ms;
    v.h2d_bytes = h.prediction.h2d_bytes;
    v.d2h_bytes = h.prediction.d2h_bytes;
    v.h2d_gbps = h.link.h2d_gbps;
    v.d2h_gbps = h.link.d2h_gbps;
    v.duplex_h2d_gbps = h.link.duplex_h2d_gbps;
    v.duplex_d2h_gbps = h.link.duplex_d2h_gbps;
    v.first_k_ms = h.first_k.prediction.ms;
    v.n_groups = static_cast<uint32_t>(h.groups.size());
    v.ungrouped_ms = h.plan.prediction.ms;
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
        at(h.prediction.positions, position, "the plan", "positions");
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
    config->depth = h.depth;
    config->resident_layers = h.resident.empty() ? nullptr : h.resident.data();
    config->n_resident = static_cast<uint32_t>(h.resident.size());
  });
}

LWO_API lwo_status_t lwo_plan_get_group(const lwo_plan* plan, uint32_t group,
                                        lwo_plan_group* out) {
  return guard("lwo_plan_get_group", [&] {
    const lwo::PlanHandle& h = *check_handle(plan)->impl;
    need(out, "out");
    const lwo::plan::Group& g = at(h.groups, group, "the plan", "groups");
    lwo_plan_group v{};
    v.first_layer = g.first;
    v.n_layers = g.count;
    v.resident = g.resident ? 1u : 0u;
    v.bytes = h.group_bytes[group];
    write_out(out, v, "out");
  });
}

}  // extern "C"
