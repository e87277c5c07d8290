// The host's work on the gradients, measured (testkit/host.h).
#include "host.h"

#include <algorithm>

namespace testkit {

HostAdd time_host_add(const Grads& grads, const Stream& compute, uint32_t n_records) {
  TK_CHECK(lwo_grads_zero(grads.get()));
  auto end_layer = [&](uint32_t l) {
    lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
    TK_CHECK(lwo_grads_begin(grads.get(), l, compute.get(), &gv));
    TK_CHECK(lwo_grads_end(grads.get(), l, compute.get()));
  };
  for (uint32_t l = 0; l < n_records; ++l) end_layer(l);  // in place
  TK_CHECK(lwo_grads_wait(grads.get()));
  const lwo_grads_stats g0 = grads_stats(grads.get());
  for (uint32_t l = 0; l < n_records; ++l) {
    end_layer(l);  // added on the host
    TK_CHECK(lwo_grads_wait(grads.get()));
  }
  const lwo_grads_stats g1 = grads_stats(grads.get());
  return {g1.accumulated_bytes - g0.accumulated_bytes, g1.accumulate_ns - g0.accumulate_ns};
}

lwo_optim_stats optim_stats(lwo_optim* optim) {
  lwo_optim_stats st{};
  st.size = sizeof st;
  TK_CHECK(lwo_optim_get_stats(optim, &st));
  return st;
}

void OptimPairs::update() {
  p.step = ++step_no;
  TK_CHECK(lwo_optim_step(optim, &p));
}

void OptimPairs::time_pair(const std::function<StepStats()>& plain_step,
                           StepOptions& step_options) {
  // The update alone: nothing in flight, a plain step (the gradients land,
  // fenced; its time is the pair's GPU step), then the update.
  TK_CHECK(lwo_optim_wait(optim));
  gpu_ms.push_back(plain_step().ms);
  const lwo_optim_stats a = optim_stats(optim);
  const double t0 = now_seconds();
  update();
  TK_CHECK(lwo_optim_wait(optim));
  alone_ms.push_back((now_seconds() - t0) * 1e3);
  n_params = optim_stats(optim).n_params_updated - a.n_params_updated;
  // Two full steps, each updating once its backward is enqueued: the first
  // sets the update in flight; the second, timed from the first's return to
  // its own, waits for it where it needs its layers.
  step_options.after_enqueue = [this] { update(); };
  plain_step();
  const double t1 = now_seconds();
  plain_step();
  full_ms.push_back((now_seconds() - t1) * 1e3);
  step_options.after_enqueue = nullptr;
  tail_ms.push_back(optim_stats(optim).last_tail_ns / 1e6);
  pair_ratio.push_back(full_ms.back() / std::max(gpu_ms.back(), alone_ms.back()));
}

double OptimPairs::overlap() const {
  const double shorter = std::min(gpu(), alone());
  return shorter > 0 ? std::max(0.0, gpu() + alone() - full()) / shorter : 0;
}

OptimPairs::MemoryFloor OptimPairs::memory_floor(double update_bytes, double copy_bytes) const {
  const auto floor_ms = [&](double a_ms) {  // of an update alone in a_ms
    return update_bytes > 0 ? a_ms * (1 + copy_bytes / update_bytes) : 0;
  };
  MemoryFloor f{update_bytes, copy_bytes};
  f.update_gbps = alone() > 0 ? update_bytes / alone() / 1e6 : 0;
  f.floor_ms = floor_ms(alone());
  std::vector<double> ratios;
  for (size_t i = 0; i < full_ms.size(); ++i)
    if (floor_ms(alone_ms[i]) > 0) ratios.push_back(full_ms[i] / floor_ms(alone_ms[i]));
  f.ratio = median(ratios);
  return f;
}

}  // namespace testkit
