// testkit: the host's work on a training step's gradients, measured (lwo
// train): their addition into the host buffers alone, and the host optimizer.
//
// The optimizer (lwo_optim) is timed beside the training steps whose
// gradients it updates (lwo train --optimizer), in alternating pairs:
// the host's memory bandwidth drifts within minutes, so figures taken in
// separate phases measure the drift as much as the step. Each pair: a plain
// step (its time the GPU step; its gradients landed and fenced),
// lwo_optim_step and lwo_optim_wait timed (the update alone), then two full
// steps, each calling lwo_optim_step once its backward is enqueued; the
// second is timed from the first's return to its own (its zero and stages
// wait for the first's update). The bound is max(GPU step, update alone) of
// the same pair; the figure the median of the pairs' ratios.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "lwo.h"
#include "check.h"
#include "owner.h"
#include "workload.h"

namespace testkit {

// The host addition alone, of `grads` over records 0..n_records-1: every
// record's gradient ended twice after a zero (the first lands in place, the
// second is added on the host), each addition waited for before the next
// record's copy starts, so nothing runs beside it (no copy, no compute); the
// library's own counters time the additions. The buffers' contents do not
// matter. Calls on `compute`.
struct HostAdd {
  uint64_t bytes = 0, ns = 0;  // added, and the host time it took
  double gbps() const { return ns ? static_cast<double>(bytes) / static_cast<double>(ns) : 0; }
};
HostAdd time_host_add(const Grads& grads, const Stream& compute, uint32_t n_records);

lwo_optim_stats optim_stats(lwo_optim* optim);  // lwo_optim_get_stats; a failure throws

struct OptimPairs {
  lwo_optim* optim = nullptr;                            // the caller's
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;  // p.step set by update()
  uint64_t step_no = 0;                                  // updates so far
  // Per pair, in order: the plain step (the GPU step), the update alone, the
  // full step, the update's tail after the last landing, and full over
  // max(GPU step, update alone).
  std::vector<double> gpu_ms, alone_ms, full_ms, tail_ms, pair_ratio;
  uint64_t n_params = 0;  // updated by one update (the last pair's)

  // One pair: plain_step() runs one training step with step_options, whose
  // after_enqueue is update() during the two full steps.
  void time_pair(const std::function<StepStats()>& plain_step, StepOptions& step_options);
  void update();  // lwo_optim_step with the next step number
  // The medians of the pairs.
  double gpu() const { return median(gpu_ms); }
  double alone() const { return median(alone_ms); }
  double full() const { return median(full_ms); }
  double ratio() const { return median(pair_ratio); }
  // What the full step hides of the shorter of the two: (GPU step + update
  // alone - full step) over the shorter, at least 0 (medians; 0 without).
  double overlap() const;

  // The host's memory, which the update and the copy engines share: a step
  // moves `update_bytes` of update traffic and `copy_bytes` of copies (H2D
  // and D2H). At the bandwidth an update alone reached (update_gbps) both
  // take alone() x (update + copies) / update (floor_ms); each pair's full
  // step over its own update's floor, the median (ratio).
  struct MemoryFloor {
    double update_bytes = 0, copy_bytes = 0, update_gbps = 0, floor_ms = 0, ratio = 0;
  };
  MemoryFloor memory_floor(double update_bytes, double copy_bytes) const;
};

}  // namespace testkit
