#include "plan.h"

#include "check.h"

namespace testkit {

PlanReport make_plan(lwo_pool* pool, uint64_t budget, const std::vector<double>& fwd_ms,
                     const std::vector<double>& bwd_ms, const uint8_t* trainable,
                     uint32_t grad_depth, bool group, double copy_overhead_ms) {
  PlanReport r;
  r.fwd_ms = fwd_ms;
  r.bwd_ms = bwd_ms;
  lwo_plan_config c;
  lwo_plan_config_init(&c);
  c.flags = LWO_PLAN_CALIBRATE_LINK | (bwd_ms.empty() ? 0u : LWO_PLAN_TRAIN) |
            (group ? LWO_PLAN_GROUP : 0u);
  r.grouped = group;
  c.budget_bytes = budget;
  c.fwd_ms = r.fwd_ms.data();
  c.bwd_ms = r.bwd_ms.empty() ? nullptr : r.bwd_ms.data();
  c.trainable = trainable;
  c.grad_depth = grad_depth;
  c.copy_overhead_ms = copy_overhead_ms;
  lwo_plan* plan = nullptr;
  TK_CHECK(lwo_plan_create(pool, &c, &plan));
  struct Guard {
    lwo_plan* p;
    ~Guard() { lwo_plan_destroy(p); }
  } guard{plan};
  r.info.size = sizeof r.info;
  TK_CHECK(lwo_plan_get_info(plan, &r.info));
  r.positions.resize(r.info.n_positions);
  for (uint32_t i = 0; i < r.info.n_positions; ++i) {
    r.positions[i].size = sizeof r.positions[i];
    TK_CHECK(lwo_plan_get_position(plan, i, &r.positions[i]));
  }
  lwo_ring_config rc = LWO_RING_CONFIG_INIT;
  TK_CHECK(lwo_plan_ring_config(plan, &rc));
  r.resident.assign(rc.resident_layers, rc.resident_layers + rc.n_resident);
  r.groups.resize(r.info.n_groups);
  for (uint32_t g = 0; g < r.info.n_groups; ++g) {
    r.groups[g].size = sizeof r.groups[g];
    TK_CHECK(lwo_plan_get_group(plan, g, &r.groups[g]));
  }
  return r;
}

lwo_ring_config plan_ring_config(const PlanReport& r, uint32_t flags) {
  lwo_ring_config c = LWO_RING_CONFIG_INIT;
  c.depth = r.info.depth;
  c.flags = flags;
  c.resident_layers = r.resident.empty() ? nullptr : r.resident.data();
  c.n_resident = static_cast<uint32_t>(r.resident.size());
  return c;
}

}  // namespace testkit
