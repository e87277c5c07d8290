// bench_ring: ring streaming bandwidth by ring depth (1..8) and record size
// (1, 4, 16, 64, 256 MiB). A pinned pool of about 1 GiB (at least depth + 2
// layers, so no step finds its layer still in a slot) streams through a ring
// by lwo_schedule_next; a checksum kernel on a consumer stream reads every
// byte of each slot (as `lwo probe` does), and the sums are checked against
// the host's after the timed passes.
//
// One iteration streams whole passes over the pool, at least 2 GiB, timed
// with CUDA events on the consumer stream from before the first
// lwo_schedule_next to after the last checksum kernel; one untimed pass warms
// up. Counters:
//   GB/s           pool bytes streamed / median iteration time (1e9 B/s)
//   share_of_peak  GB/s over the pinned H2D peak this process measured first
//   GB/s_best, share_of_peak_best   the same for the fastest iteration
//   record_MiB, depth, layers, passes_per_iter
//   hits           stages that found their layer in a slot (should be 0)
//
// Names: ring/record_MiB:<r>/depth:<d>. Runs in about 30 s on an H200.
#include <algorithm>
#include <memory>
#include <numeric>

#include "bench/common.h"
#include "testkit/checksum.h"

namespace lwob {
namespace {

constexpr uint32_t kMaxDepth = 8;
constexpr uint64_t kPoolBytes = 1 * GiB;
constexpr uint64_t kIterBytes = 2 * GiB;
constexpr int kIterations = 5;
const uint64_t kRecordsMiB[] = {1, 4, 16, 64, 256};

// The pool of one record size, shared by all depths (registered
// record-size-major); replaced when the record size changes.
struct RingPool {
  uint64_t record = 0;
  uint32_t layers = 0;
  uint64_t total = 0;
  Pool pool;
  std::vector<uint64_t> expect;  // host checksum of each record
  DeviceMem sums;
  Stream consumer;
  Event a, b;
};
std::unique_ptr<RingPool> g_pool;

RingPool& pool_for(uint64_t record) {
  if (g_pool && g_pool->record == record) return *g_pool;
  g_pool.reset();
  auto p = std::make_unique<RingPool>();
  p->record = record;
  p->layers =
      static_cast<uint32_t>(std::max<uint64_t>(kMaxDepth + 2, (kPoolBytes + record - 1) / record));
  lwo_tensor_desc tensor =
      testkit::tensor_desc("data", LWO_DTYPE_U8, {static_cast<int64_t>(record)});
  std::vector<lwo_layer_desc> descs(p->layers, lwo_layer_desc{&tensor, 1, nullptr});
  check(lwo_pool_create_pinned(engine(), descs.data(), p->layers, nullptr, p->pool.out()),
        "lwo_pool_create_pinned");
  std::vector<testkit::HostRange> host(p->layers);
  std::vector<testkit::ByteRange> fill;
  for (uint32_t l = 0; l < p->layers; ++l) {
    check(lwo_pool_layer_host(p->pool.get(), l, &host[l].data, &host[l].bytes),
          "lwo_pool_layer_host");
    p->total += host[l].bytes;
    fill.push_back({host[l].data, host[l].bytes, testkit::key_of(record, l)});
  }
  testkit::fill_bytes(fill);
  p->expect = testkit::checksums(host);
  p->sums = device_alloc(p->layers * sizeof(unsigned long long));
  p->consumer = make_stream();
  p->a = make_event();
  p->b = make_event();
  g_pool = std::move(p);
  return *g_pool;
}

void cleanup() { g_pool.reset(); }

using testkit::checksum_pass;
using testkit::ring_stats;

void bm_ring(benchmark::State& state) {
  run_guarded(state, [&] {
    const uint64_t record = static_cast<uint64_t>(state.range(0)) * MiB;
    const uint32_t depth = static_cast<uint32_t>(state.range(1));
    RingPool& p = pool_for(record);
    cudaStream_t cs = p.consumer.get();
    auto* sums = static_cast<unsigned long long*>(p.sums.get());
    check(cudaMemsetAsync(sums, 0, p.layers * sizeof(*sums), cs), "cudaMemsetAsync");

    lwo_ring_config config = LWO_RING_CONFIG_INIT;
    config.depth = depth;
    Ring ring;
    check(lwo_ring_create(p.pool.get(), &config, ring.out()), "lwo_ring_create");
    std::vector<uint32_t> order(p.layers);
    std::iota(order.begin(), order.end(), 0u);
    Schedule schedule;
    check(lwo_schedule_create(ring.get(), order.data(), p.layers, schedule.out()),
          "lwo_schedule_create");
    const uint32_t passes =
        static_cast<uint32_t>(std::max<uint64_t>(1, (kIterBytes + p.total - 1) / p.total));

    checksum_pass(schedule.get(), cs, sums);  // warm-up
    check(cudaStreamSynchronize(cs), "cudaStreamSynchronize");
    const lwo_ring_stats s0 = ring_stats(ring.get());
    std::vector<double> ms;
    for (auto _ : state) {
      check(cudaEventRecord(p.a.get(), cs), "cudaEventRecord");
      for (uint32_t i = 0; i < passes; ++i) checksum_pass(schedule.get(), cs, sums);
      check(cudaEventRecord(p.b.get(), cs), "cudaEventRecord");
      check(cudaEventSynchronize(p.b.get()), "cudaEventSynchronize");
      ms.push_back(elapsed_ms(p.a, p.b));
      state.SetIterationTime(ms.back() / 1e3);
    }
    const lwo_ring_stats s1 = ring_stats(ring.get());
    schedule.reset();
    ring.reset();
    check(lwo_engine_check(engine()), "lwo_engine_check");

    // Every pass, warm-up included, added each layer's checksum once.
    const uint64_t times = 1 + uint64_t(passes) * ms.size();
    const std::vector<testkit::SumMismatch> bad = testkit::verify_sums(sums, p.expect, times, cs);
    if (!bad.empty())
      fail(strf("layer %u summed to checksum 0x%016llx over %llu passes, expected 0x%016llx: "
                "a slot did not hold its layer's bytes (%zu of %u layers differ)",
                bad[0].layer, bad[0].got, static_cast<unsigned long long>(times), bad[0].want,
                bad.size(), p.layers));

    const uint64_t iter_bytes = p.total * passes;
    auto gbps = [&](double t) { return testkit::gbps(static_cast<double>(iter_bytes), t); };
    const double peak = peaks().h2d_gbps;
    const double med = gbps(median(ms)), best = gbps(*std::min_element(ms.begin(), ms.end()));
    state.counters["GB/s"] = med;
    state.counters["share_of_peak"] = peak > 0 ? med / peak : 0;
    state.counters["GB/s_best"] = best;
    state.counters["share_of_peak_best"] = peak > 0 ? best / peak : 0;
    state.counters["peak_GB/s"] = peak;
    state.counters["record_MiB"] = static_cast<double>(record / MiB);
    state.counters["depth"] = depth;
    state.counters["layers"] = p.layers;
    state.counters["passes_per_iter"] = passes;
    state.counters["hits"] = static_cast<double>(s1.n_hits - s0.n_hits);
    state.counters["bytes_per_iter"] = static_cast<double>(s1.bytes_copied - s0.bytes_copied) /
                                       static_cast<double>(std::max<size_t>(1, ms.size()));
    state.SetBytesProcessed(static_cast<int64_t>(iter_bytes) * state.iterations());
  });
}

void register_benchmarks() {
  for (uint64_t r : kRecordsMiB)
    for (uint32_t d = 1; d <= kMaxDepth; ++d)
      timed_ms(benchmark::RegisterBenchmark("ring", bm_ring)
                   ->Args({static_cast<int64_t>(r), static_cast<int64_t>(d)})
                   ->ArgNames({"record_MiB", "depth"}),
               kIterations);
}

}  // namespace

const MainSpec kMain = {
    "bench_ring",
    "ring streaming bandwidth by depth 1..8 and record size 1..256 MiB, checksum consumer",
    register_benchmarks, cleanup, {}, /*needs_engine=*/true, /*needs_peaks=*/true,
    /*needs_d2h_peak=*/false};

}  // namespace lwob
