// testkit: a ring's streaming bandwidth over a pool at one depth, every byte
// checked (lwo probe's ring figures): passes of every layer through the ring,
// a checksum kernel on a consumer stream reading each slot, timed by events
// around the passes, and the sums checked against the host's afterwards.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "lwo.h"
#include "owner.h"

namespace testkit {

// One figure: records of `record_bytes`, a ring of `depth` over `layers`
// layers, `passes` timed passes; measured, or why not.
struct RingFigure {
  uint64_t record_bytes = 0;
  uint32_t depth = 0, layers = 0, passes = 0;
  bool measured = false;
  std::string skipped;  // why not, if not measured
  double ms = 0, gbps = 0;
  uint64_t hits = 0;
};

// Streams f.passes passes (after a warm-up pass) of every layer of `pool`
// (`pool_bytes` in all) through a ring of f.depth, a checksum kernel on
// `consumer` reading each layer into `sums` (one per layer, zeroed first),
// timed from event `a` to `b`, and checks the sums against `expect` (a
// mismatch throws Error). A ring that does not fit (LWO_ERR_OUT_OF_MEMORY)
// leaves f not measured, f.skipped the library's message.
void measure_ring(lwo_engine* engine, lwo_pool* pool, const std::vector<uint64_t>& expect,
                  uint64_t pool_bytes, cudaStream_t consumer, unsigned long long* sums,
                  const Event& a, const Event& b, RingFigure& f);

}  // namespace testkit
