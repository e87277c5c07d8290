// A ring's bandwidth over a pool at one depth, checked (testkit/ring.h).
// Host C++: it takes owners, which testkit's nvcc-compiled functions do not (owner.h).
#include "ring.h"

#include "check.h"
#include "checksum.h"
#include "workload.h"

namespace testkit {

void measure_ring(lwo_engine* engine, lwo_pool* pool, const std::vector<uint64_t>& expect,
                  uint64_t pool_bytes, cudaStream_t consumer, unsigned long long* sums,
                  const Event& a, const Event& b, RingFigure& f) {
  lwo_ring_config config = LWO_RING_CONFIG_INIT;
  config.depth = f.depth;
  Ring ring;
  lwo_status_t s = lwo_ring_create(pool, &config, ring.out());
  if (s == LWO_ERR_OUT_OF_MEMORY) {
    f.skipped = lwo_last_error_message();
    return;
  }
  check(s, "lwo_ring_create");
  const std::vector<uint32_t> order = step_order(f.layers, /*backward=*/false);
  Schedule schedule;
  TK_CHECK(lwo_schedule_create(ring.get(), order.data(), f.layers, schedule.out()));

  TK_CHECK(cudaMemsetAsync(sums, 0, f.layers * sizeof(*sums), consumer));
  checksum_pass(schedule.get(), consumer, sums);  // warm-up
  TK_CHECK(cudaEventRecord(a.get(), consumer));
  for (uint32_t p = 0; p < f.passes; ++p) checksum_pass(schedule.get(), consumer, sums);
  TK_CHECK(cudaEventRecord(b.get(), consumer));
  TK_CHECK(cudaEventSynchronize(b.get()));
  f.ms = elapsed_ms(a, b);
  f.gbps = gbps(static_cast<double>(pool_bytes) * f.passes, f.ms);
  f.measured = true;

  f.hits = ring_stats(ring.get()).n_hits;
  schedule.destroy();
  ring.destroy();
  TK_CHECK(lwo_engine_check(engine));

  const std::vector<SumMismatch> bad = verify_sums(sums, expect, f.passes + 1ull, consumer);
  if (!bad.empty())
    fail(
        strf("ring depth %u, %s records: layer %u summed to checksum 0x%016llx over %u "
             "passes, expected 0x%016llx: a slot did not hold its layer's bytes",
             f.depth, fmt_bytes(f.record_bytes).c_str(), bad[0].layer, bad[0].got, f.passes + 1,
             bad[0].want));
}

}  // namespace testkit
