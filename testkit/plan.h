// testkit: a plan of the library's planner and what it says, position by
// position (lwo plan, lwo run --budget, lwo train --budget, bench_plan).
#pragma once

#include <cstdint>
#include <vector>

#include "lwo.h"

namespace testkit {

// A plan of lwo_plan_create and what it says, position by position.
struct PlanReport {
  lwo_plan_info info{};
  std::vector<lwo_plan_position> positions;
  std::vector<uint32_t> resident;  // ascending
  std::vector<double> fwd_ms, bwd_ms;
  bool grouped = false;                // asked with LWO_PLAN_GROUP
  std::vector<lwo_plan_group> groups;  // the records the plan recommends
};
// Plans `pool` for `budget` bytes with the link calibrated on the engine's
// device; bwd_ms empty: a forward pass, else a training step (trainable may
// be null: every layer). copy_overhead_ms as lwo_plan_config's (0: none).
// A failed call throws Error.
PlanReport make_plan(lwo_pool* pool, uint64_t budget, const std::vector<double>& fwd_ms,
                     const std::vector<double>& bwd_ms, const uint8_t* trainable,
                     uint32_t grad_depth, bool group = false, double copy_overhead_ms = 0);
// The ring config of a plan (its resident array points into `r`).
lwo_ring_config plan_ring_config(const PlanReport& r, uint32_t flags);

}  // namespace testkit
