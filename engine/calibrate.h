// Link calibration for the planner: timed host-to-device,
// device-to-host and both-at-once copies between pinned host memory and
// device memory on the engine's own transfer and gradient streams. The
// buffers count against the engine's budget while they exist.
#pragma once

#include <cstdint>

#include "engine.h"

namespace lwo {

struct LinkRates {  // 1e9 bytes per second
  double h2d_gbps = 0, d2h_gbps = 0;                // each direction alone
  double duplex_h2d_gbps = 0, duplex_d2h_gbps = 0;  // both at once
};

// Copies `bytes` `reps` times each way, alone and at once (after one
// untimed warm-up of each), and returns the rates of the median repetition.
// Blocks the host until the copies are done. Throws LWO_ERR_OVER_BUDGET,
// LWO_ERR_OUT_OF_MEMORY, LWO_ERR_CUDA.
LinkRates measure_link(Engine& engine, uint64_t bytes, uint32_t reps);

// The device bytes a plan may take: what the engine's budget has left, or,
// without a limit, the device's free memory now.
uint64_t plan_room(Engine& engine);

}  // namespace lwo
