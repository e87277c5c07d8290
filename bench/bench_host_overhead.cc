// bench_host_overhead: host CPU time per layer of the streaming calls, with
// records of 4 KiB so that the copies are trivial. Only the host time of the
// calls is measured (steady clock around batches of 64 layers); between
// batches the program waits for the GPU, untimed, so the GPU never falls far
// behind and no call blocks on a full launch queue.
//
//   host/stage_acquire_release/miss/depth:D  lwo_ring_stage + lwo_ring_acquire
//       + lwo_ring_release per layer, cycling over 256 layers (every stage
//       copies)
//   host/stage_acquire_release/hit/depth:D   the same cycling over D layers with
//       a ring of depth D (every stage finds its layer in a slot: no copy)
//   host/schedule_next/miss/depth:D          lwo_schedule_next per layer over a
//       schedule of 256 layers (its end and lwo_schedule_reset included)
//   host/schedule_next/hit/depth:D           lwo_schedule_next over 0..D-1
//       repeated (every stage a hit)
//   host/grads_begin_end                     lwo_grads_begin + lwo_grads_end per
//       layer (f32 wire, 8 KiB of gradients, buffers zeroed before each pass)
//   host/linear_forward_enqueue              lwo_linear_forward, 256x256 bf16,
//       16 tokens (the enqueue alone)
//
// Counters: us_per_layer (mean over all timed layers), us_per_layer_median
// (median over batches), layers (timed per iteration), target_us (5, lwo's
// target). Runs in about 5 s on an H200.
#include <algorithm>
#include <memory>
#include <numeric>

#include "bench/common.h"

namespace lwob {
namespace {

constexpr uint32_t kLayers = 256;       // layers of the pool
constexpr int64_t kRecordElems = 2048;  // bf16 elements: 4 KiB records
constexpr uint32_t kBatch = 64;         // layers timed between synchronisations
constexpr uint32_t kLayersPerIter = 1024;
constexpr int kIterations = 30;
constexpr double kTargetUs = 5.0;

struct Shared {
  Pool pool;
  Stream stream;
};
std::unique_ptr<Shared> g_shared;

Shared& shared() {
  if (g_shared) return *g_shared;
  auto s = std::make_unique<Shared>();
  lwo_tensor_desc tensor = testkit::tensor_desc("weight", LWO_DTYPE_BF16, {kRecordElems});
  std::vector<lwo_layer_desc> descs(kLayers, lwo_layer_desc{&tensor, 1, nullptr});
  check(lwo_pool_create_pinned(engine(), descs.data(), kLayers, nullptr, s->pool.out()),
        "lwo_pool_create_pinned");
  s->stream = make_stream();
  g_shared = std::move(s);
  return *g_shared;
}

void cleanup() { g_shared.reset(); }

// Times `per_iter` layers per iteration: `step(i)` does the calls of layer i
// (a running index) and is timed; `sync()` runs untimed after each batch.
template <class Step, class Sync>
void time_layers(benchmark::State& state, uint32_t per_iter, Step step, Sync sync) {
  for (uint32_t i = 0; i < 2 * kBatch; ++i) step(i);  // warm-up
  sync();
  uint64_t index = 0;
  double total_s = 0;
  uint64_t total_layers = 0;
  std::vector<double> per_batch_us;
  for (auto _ : state) {
    double iter_s = 0;
    for (uint32_t done = 0; done < per_iter;) {
      const uint32_t n = std::min(kBatch, per_iter - done);
      const double t0 = now_seconds();
      for (uint32_t k = 0; k < n; ++k) step(index++);
      const double dt = now_seconds() - t0;
      sync();
      iter_s += dt;
      per_batch_us.push_back(dt * 1e6 / n);
      done += n;
    }
    state.SetIterationTime(iter_s);
    total_s += iter_s;
    total_layers += per_iter;
  }
  state.counters["us_per_layer"] =
      total_layers ? total_s * 1e6 / static_cast<double>(total_layers) : 0;
  state.counters["us_per_layer_median"] = median(per_batch_us);
  state.counters["layers"] = per_iter;
  state.counters["target_us"] = kTargetUs;
}

void sync_all(cudaStream_t stream) {
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  check(lwo_engine_synchronize(engine()), "lwo_engine_synchronize");
}

Ring make_ring(lwo_pool* pool, uint32_t depth) {
  lwo_ring_config config = LWO_RING_CONFIG_INIT;
  config.depth = depth;
  Ring ring;
  check(lwo_ring_create(pool, &config, ring.out()), "lwo_ring_create");
  return ring;
}

// time_layers over a ring's calls: kLayersPerIter layers per iteration, and
// the share of the timed stages (the warm-up's excluded) that hit.
template <class Step>
void time_ring_layers(benchmark::State& state, lwo_ring* ring, uint32_t depth,
                      cudaStream_t stream, Step step) {
  lwo_ring_stats before{};
  time_layers(state, kLayersPerIter, step, [&] {
    sync_all(stream);
    if (before.n_stages == 0) before = testkit::ring_stats(ring);
  });
  const lwo_ring_stats after = testkit::ring_stats(ring);
  const double stages = static_cast<double>(after.n_stages - before.n_stages);
  state.counters["hit_share"] =
      stages > 0 ? static_cast<double>(after.n_hits - before.n_hits) / stages : 0;
  state.counters["depth"] = depth;
}

// stage + acquire + release per layer; `cycle` layers (kLayers: every stage
// copies; depth: every stage hits).
void bm_stage_acquire_release(benchmark::State& state, bool hit) {
  run_guarded(state, [&] {
    const uint32_t depth = static_cast<uint32_t>(state.range(0));
    const uint32_t cycle = hit ? depth : kLayers;
    Shared& s = shared();
    cudaStream_t stream = s.stream.get();
    Ring ring = make_ring(s.pool.get(), depth);
    time_ring_layers(
        state, ring.get(), depth, stream,
        [&](uint64_t i) {
          lwo_ticket t{};
          lwo_layer_view view = LWO_LAYER_VIEW_INIT;
          lwo_status_t st = lwo_ring_stage(ring.get(), static_cast<uint32_t>(i % cycle), &t);
          if (st != LWO_OK) check(st, "lwo_ring_stage");
          st = lwo_ring_acquire(ring.get(), t, stream, &view);
          if (st != LWO_OK) check(st, "lwo_ring_acquire");
          st = lwo_ring_release(ring.get(), t, stream);
          if (st != LWO_OK) check(st, "lwo_ring_release");
        });
  });
}

// lwo_schedule_next per layer (the LWO_END call and lwo_schedule_reset that
// close each pass are timed too, and spread over the pass's layers).
void bm_schedule_next(benchmark::State& state, bool hit) {
  run_guarded(state, [&] {
    const uint32_t depth = static_cast<uint32_t>(state.range(0));
    Shared& s = shared();
    cudaStream_t stream = s.stream.get();
    Ring ring = make_ring(s.pool.get(), depth);
    std::vector<uint32_t> order(kLayers);
    for (uint32_t i = 0; i < kLayers; ++i) order[i] = hit ? i % depth : i;
    Schedule schedule;
    check(lwo_schedule_create(ring.get(), order.data(), kLayers, schedule.out()),
          "lwo_schedule_create");
    time_ring_layers(
        state, ring.get(), depth, stream,
        [&](uint64_t) {
          lwo_layer_view view = LWO_LAYER_VIEW_INIT;
          lwo_status_t st = lwo_schedule_next(schedule.get(), stream, &view);
          if (st == LWO_END) {
            check(lwo_schedule_reset(schedule.get(), stream), "lwo_schedule_reset");
            st = lwo_schedule_next(schedule.get(), stream, &view);
          }
          if (st != LWO_OK) check(st, "lwo_schedule_next");
        });
  });
}

void bm_grads(benchmark::State& state) {
  run_guarded(state, [&] {
    Shared& s = shared();
    cudaStream_t stream = s.stream.get();
    Grads grads;
    check(lwo_grads_create(s.pool.get(), nullptr, nullptr, grads.out()), "lwo_grads_create");
    // Each layer once per pass of kLayers, the buffers zeroed between passes
    // (untimed), so that the gradients (in the layers' own dtype, the default)
    // land in place with no host work.
    time_layers(
        state, kLayers,
        [&](uint64_t i) {
          const uint32_t l = static_cast<uint32_t>(i % kLayers);
          lwo_layer_view view = LWO_LAYER_VIEW_INIT;
          lwo_status_t st = lwo_grads_begin(grads.get(), l, stream, &view);
          if (st != LWO_OK) check(st, "lwo_grads_begin");
          st = lwo_grads_end(grads.get(), l, stream);
          if (st != LWO_OK) check(st, "lwo_grads_end");
        },
        [&] {
          check(lwo_grads_wait(grads.get()), "lwo_grads_wait");
          check(lwo_grads_zero(grads.get()), "lwo_grads_zero");
        });
    sync_all(stream);
  });
}

void bm_linear_enqueue(benchmark::State& state) {
  run_guarded(state, [&] {
    Shared& s = shared();
    cudaStream_t stream = s.stream.get();
    constexpr int64_t kDim = 256, kTokens = 16;
    DeviceMem x = device_alloc(kTokens * kDim * 2), w = device_alloc(kDim * kDim * 2),
              y = device_alloc(kTokens * kDim * 2);
    check(cudaMemset(x.get(), 0, kTokens * kDim * 2), "cudaMemset");
    check(cudaMemset(w.get(), 0, kDim * kDim * 2), "cudaMemset");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // not ordered with `stream`
    lwo_linear_desc desc = LWO_LINEAR_DESC_INIT;
    desc.in_features = kDim;
    desc.out_features = kDim;
    time_layers(
        state, kLayersPerIter,
        [&](uint64_t) {
          lwo_status_t st = lwo_linear_forward(engine(), &desc, kTokens, x.get(), w.get(), nullptr,
                                               y.get(), stream);
          if (st != LWO_OK) check(st, "lwo_linear_forward");
        },
        [&] { sync_all(stream); });
  });
}

void register_benchmarks() {
  auto common = [](benchmark::internal::Benchmark* b) {
    b->UseManualTime()->Iterations(kIterations)->Unit(benchmark::kMicrosecond);
  };
  for (bool hit : {false, true}) {
    std::string suffix = hit ? "hit" : "miss";
    common(benchmark::RegisterBenchmark(
               ("host/stage_acquire_release/" + suffix).c_str(),
               [hit](benchmark::State& st) { bm_stage_acquire_release(st, hit); })
               ->Arg(2)
               ->Arg(8)
               ->ArgName("depth"));
    common(benchmark::RegisterBenchmark(("host/schedule_next/" + suffix).c_str(),
                                        [hit](benchmark::State& st) { bm_schedule_next(st, hit); })
               ->Arg(2)
               ->Arg(8)
               ->ArgName("depth"));
  }
  common(benchmark::RegisterBenchmark("host/grads_begin_end", bm_grads));
  common(benchmark::RegisterBenchmark("host/linear_forward_enqueue", bm_linear_enqueue));
}

}  // namespace

const MainSpec kMain = {
    "bench_host_overhead",
    "host CPU time per layer of stage+acquire+release and schedule_next (4 KiB records)",
    register_benchmarks, cleanup, {}, /*needs_engine=*/true, /*needs_peaks=*/false};

}  // namespace lwob
