// Schedules on the device: random layer orders with repeats, several passes,
// every view checksummed; hits when a layer comes back while still in a slot;
// exact copy accounting.
#include <set>

#include "gpu/gpu_util.h"

namespace lwo_test {
namespace {

// Runs one pass of `sched` on `stream` (or `max_steps` steps of it), checking
// positions, view contents and, after the last layer, LWO_END.
void run_pass(lwo_schedule* sched, const TestPool& tp, const std::vector<uint32_t>& order,
              cudaStream_t stream, Checks* checks, const std::string& what,
              size_t max_steps = SIZE_MAX, uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  const size_t n = std::min(order.size(), max_steps);
  for (size_t k = 0; k < n; ++k) {
    uint32_t pos = 999999;
    CHECK_LWO(lwo_schedule_position(sched, &pos));
    ASSERT_EQ(k, pos);
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    CHECK_LWO(lwo_schedule_next(sched, stream, &v));
    const uint32_t layer = order[k];
    ASSERT_EQ(layer, v.layer) << "position " << k;
    const LayerRef& lr = tp.layers[layer];
    ASSERT_EQ(lr.tensors.size(), v.n_tensors);
    ASSERT_EQ(lr.record_bytes, v.record_bytes);
    std::string w = what + " position " + std::to_string(k) + " layer " + std::to_string(layer);
    if (lr.whole_check && lr.whole_bytes)
      CUDA_OK(checks->add(v.base, lr.whole_bytes, lr.whole_sum, stream, w));
    if (v.n_tensors) {
      uint32_t i = static_cast<uint32_t>(rng() % v.n_tensors);
      const TensorRef& tr = lr.tensors[i];
      ASSERT_EQ(static_cast<uint8_t*>(v.base) + tr.offset, v.tensors[i]);
      if (tr.bytes)
        CUDA_OK(checks->add(v.tensors[i], tr.bytes, tr.sum, stream, w + " tensor " + tr.name));
    }
  }
  if (n == order.size()) {
    lwo_layer_view v;
    std::memset(&v, 0x5A, sizeof v);
    v.size = sizeof v;
    lwo_layer_view untouched = v;
    lwo_status_t s = lwo_schedule_next(sched, stream, &v);
    ASSERT_EQ(LWO_END, s) << lwo_status_string(s) << ": " << lwo_last_error_message();
    ASSERT_EQ(0, std::memcmp(&v, &untouched, sizeof v)) << "LWO_END must leave the view as is";
    uint32_t pos = 0;
    CHECK_LWO(lwo_schedule_position(sched, &pos));
    ASSERT_EQ(order.size(), pos);
    // Calling again after the end stays at the end.
    ASSERT_EQ(LWO_END, lwo_schedule_next(sched, stream, &v));
  }
}

// Layers all of one record size, so that bytes_copied = n_copies * size.
std::vector<LayerSpec> uniform_specs(uint32_t n_layers) {
  std::vector<LayerSpec> specs(n_layers);
  for (uint32_t l = 0; l < n_layers; ++l) {
    specs[l].push_back(make_tensor("attn.w", LWO_DTYPE_BF16, {96, 320}));
    specs[l].push_back(make_tensor("attn.b", LWO_DTYPE_F32, {320}));
    specs[l].push_back(make_tensor("mlp.w", LWO_DTYPE_F8_E4M3, {640, 96}));
    specs[l].push_back(make_tensor("norm", LWO_DTYPE_F16, {77}));
    specs[l].push_back(make_tensor("tail", LWO_DTYPE_U8, {13}));
  }
  return specs;
}

// A random order over [0, n_layers) with repeats, plus `n_adjacent` places
// where a layer comes twice in a row.
std::vector<uint32_t> random_order(std::mt19937_64& rng, uint32_t n_layers, size_t len,
                                   int n_adjacent) {
  std::vector<uint32_t> order(len);
  for (auto& x : order) x = static_cast<uint32_t>(rng() % n_layers);
  for (int i = 0; i < n_adjacent; ++i) {
    size_t p = rng() % (order.size() - 1);
    order[p + 1] = order[p];
  }
  return order;
}

size_t adjacent_repeats(const std::vector<uint32_t>& order) {
  size_t n = 0;
  for (size_t i = 1; i < order.size(); ++i) n += order[i] == order[i - 1];
  return n;
}

class ScheduleDepth : public GpuTest, public ::testing::WithParamInterface<uint32_t> {};

TEST_P(ScheduleDepth, UniformRecordsExactAccounting) {
  const uint32_t depth = GetParam();
  const uint64_t seed = test_seed(0x5C4Eu + depth);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const uint32_t n_layers = 10;
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_pinned_pool(engine_, uniform_specs(n_layers), seed, &tp));
  const uint64_t record = tp.layers[0].record_bytes;
  for (const LayerRef& lr : tp.layers) ASSERT_EQ(record, lr.record_bytes);

  // Two orders: a random one, and one over fewer distinct layers than slots
  // (where after the first copy of each layer everything is a hit).
  std::vector<std::vector<uint32_t>> orders;
  orders.push_back(random_order(rng, n_layers, 24, 3));
  orders.push_back(random_order(rng, std::max(1u, depth), 16, 2));
  const int passes = 3;
  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(2 * passes * 24 * 2 + 16));

  for (size_t oi = 0; oi < orders.size(); ++oi) {
    const std::vector<uint32_t>& order = orders[oi];
    SCOPED_TRACE("order " + std::to_string(oi));
    Ring ring;
    ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, depth, 0, &ring));
    Schedule sched;
    CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()),
                                  sched.out()));
    for (int p = 0; p < passes; ++p) {
      // A new pass starts from the first layer again after LWO_END (reset);
      // passes alternate between the two consumer streams.
      if (p > 0) CHECK_LWO(lwo_schedule_reset(sched.get(), stream(p % 2)));
      ASSERT_NO_FATAL_FAILURE(run_pass(sched.get(), tp, order, stream(p % 2), &checks,
                                       "order " + std::to_string(oi) + " pass " +
                                           std::to_string(p),
                                       SIZE_MAX, seed + p));
      ASSERT_EQ(depth, ring_info(ring.get()).n_free) << "everything is released after LWO_END";
    }
    lwo_ring_stats st = ring_stats(ring.get());
    const uint64_t stages = uint64_t(passes) * order.size();
    std::set<uint32_t> distinct(order.begin(), order.end());
    std::printf("[ schedule ] depth %u, order %zu (%zu entries, %zu distinct): %llu stages, "
                "%llu hits, %llu copies, %llu bytes\n",
                depth, oi, order.size(), distinct.size(), (unsigned long long)st.n_stages,
                (unsigned long long)st.n_hits, (unsigned long long)st.n_copies,
                (unsigned long long)st.bytes_copied);
    EXPECT_EQ(stages, st.n_stages);
    EXPECT_EQ(st.n_stages - st.n_hits, st.n_copies);
    EXPECT_EQ(st.n_copies * record, st.bytes_copied);
    EXPECT_GE(st.n_copies, distinct.size());
    EXPECT_GE(st.n_hits, passes * adjacent_repeats(order))
        << "a layer that comes twice in a row must be a hit the second time";
    if (distinct.size() <= depth) {
      EXPECT_EQ(stages - distinct.size(), st.n_hits)
          << "every layer fits in the ring: only first copies may miss";
    }
    EXPECT_GT(st.n_hits, 0u);
    CHECK_LWO(sched.reset());
    CHECK_LWO(ring.reset());
  }
  checks.verify();
  CHECK_LWO(tp.destroy());
}

INSTANTIATE_TEST_SUITE_P(Depth, ScheduleDepth, ::testing::Range(1u, 9u),
                         [](const ::testing::TestParamInfo<uint32_t>& p) {
                           return "depth" + std::to_string(p.param);
                         });

// Random record sizes (an empty record among them), random orders with
// repeats; a pass cut short and reset; stats counted per pass.
TEST_F(GpuTest, ScheduleRandomRecordsWithReset) {
  const uint64_t seed = test_seed(0xABCDu);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const uint32_t n_layers = 12;
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_pinned_pool(
      engine_, random_layer_specs(rng, n_layers, 4, uint64_t(2) << 20, 4), seed, &tp));
  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(8 * 3 * 40 * 2 + 16));
  for (uint32_t depth = 1; depth <= 8; ++depth) {
    SCOPED_TRACE("depth " + std::to_string(depth));
    std::vector<uint32_t> order = random_order(rng, n_layers, 40, 4);
    Ring ring;
    ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, depth, 0, &ring));
    Schedule sched;
    CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()),
                                  sched.out()));
    uint64_t all_bytes = 0, distinct_bytes = 0;
    for (uint32_t l : order) all_bytes += tp.layers[l].record_bytes;
    for (uint32_t l : std::set<uint32_t>(order.begin(), order.end()))
      distinct_bytes += tp.layers[l].record_bytes;

    ASSERT_NO_FATAL_FAILURE(run_pass(sched.get(), tp, order, stream(0), &checks, "pass 0",
                                     SIZE_MAX, seed));
    lwo_ring_stats st = ring_stats(ring.get());
    EXPECT_EQ(order.size(), st.n_stages);
    EXPECT_LE(st.n_copies, st.n_stages - st.n_hits);
    EXPECT_GE(st.bytes_copied, distinct_bytes);
    EXPECT_LE(st.bytes_copied, all_bytes);
    EXPECT_GE(st.n_hits, adjacent_repeats(order));

    // Half a pass, then back to the start.
    CHECK_LWO(lwo_schedule_reset(sched.get(), stream(0)));
    ASSERT_NO_FATAL_FAILURE(
        run_pass(sched.get(), tp, order, stream(1), &checks, "pass 1 (cut)", order.size() / 2, seed));
    CHECK_LWO(lwo_schedule_reset(sched.get(), stream(1)));
    uint32_t pos = 99;
    CHECK_LWO(lwo_schedule_position(sched.get(), &pos));
    EXPECT_EQ(0u, pos);
    EXPECT_EQ(depth, ring_info(ring.get()).n_free) << "reset releases everything it held";

    CHECK_LWO(lwo_ring_reset_stats(ring.get()));
    st = ring_stats(ring.get());
    EXPECT_EQ(0u, st.n_stages);
    EXPECT_EQ(0u, st.bytes_copied);
    ASSERT_NO_FATAL_FAILURE(run_pass(sched.get(), tp, order, stream(0), &checks, "pass 2",
                                     SIZE_MAX, seed + 2));
    st = ring_stats(ring.get());
    EXPECT_EQ(order.size(), st.n_stages);
    EXPECT_LE(st.bytes_copied, all_bytes);
    EXPECT_GE(st.n_hits, adjacent_repeats(order));
    CHECK_LWO(sched.reset());
    CHECK_LWO(ring.reset());
  }
  checks.verify();
  CHECK_LWO(tp.destroy());
}

// A schedule destroyed while it holds a layer releases it; the ring cannot be
// destroyed while the schedule exists.
TEST_F(GpuTest, ScheduleDestroyWhileHolding) {
  const uint64_t seed = test_seed(0x1357u);
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_pinned_pool(engine_, uniform_specs(6), seed, &tp));
  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(64));
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, 3, 0, &ring));
  std::vector<uint32_t> order = {0, 1, 2, 3, 4, 5, 0, 1};
  Schedule sched;
  CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()),
                                sched.out()));
  ASSERT_NO_FATAL_FAILURE(run_pass(sched.get(), tp, order, stream(0), &checks, "partial", 3, seed));
  EXPECT_GT(3u - ring_info(ring.get()).n_free, 0u) << "the schedule holds slots mid-pass";
  EXPECT_LWO_ERR(LWO_ERR_BUSY, "lwo_ring_destroy", lwo_ring_destroy(ring.get()));
  CHECK_LWO(sched.reset());
  EXPECT_EQ(3u, ring_info(ring.get()).n_free) << "destroying the schedule released its layers";
  // The ring still works, and a released layer still in a slot is a hit.
  lwo_ring_stats before = ring_stats(ring.get());
  ASSERT_NO_FATAL_FAILURE(round_trip(ring.get(), tp, order[2], stream(1), &checks, "after"));
  lwo_ring_stats after = ring_stats(ring.get());
  EXPECT_EQ(before.n_hits + 1, after.n_hits);
  CHECK_LWO(ring.reset());
  checks.verify();
  CHECK_LWO(tp.destroy());
}

// A schedule and the caller's own tickets share one ring.
TEST_F(GpuTest, ScheduleSharesRingWithCallerTickets) {
  const uint64_t seed = test_seed(0x2468u);
  TestPool tp;
  ASSERT_NO_FATAL_FAILURE(create_pinned_pool(engine_, uniform_specs(8), seed, &tp));
  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(256));
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, 3, 0, &ring));
  // The caller holds layer 7 for the whole pass.
  lwo_ticket mine{0};
  lwo_layer_view mv = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), 7, stream(1), &mine, &mv));
  std::vector<uint32_t> order = {0, 1, 2, 3, 0, 0, 4, 5, 6, 1, 2};
  Schedule sched;
  CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()),
                                sched.out()));
  for (int p = 0; p < 2; ++p) {
    if (p) CHECK_LWO(lwo_schedule_reset(sched.get(), stream(0)));
    ASSERT_NO_FATAL_FAILURE(run_pass(sched.get(), tp, order, stream(0), &checks,
                                     "pass " + std::to_string(p), SIZE_MAX, seed + p));
  }
  CUDA_OK(checks.add(mv.base, tp.layers[7].whole_bytes, tp.layers[7].whole_sum, stream(1),
                     "caller's layer 7 after the passes"));
  CHECK_LWO(sched.reset());

  // A schedule that reaches the layer the caller holds: LWO_ERR_LAYER_BUSY,
  // the position stays, and once the caller releases it a retry succeeds.
  std::vector<uint32_t> order2 = {0, 7, 1};
  CHECK_LWO(lwo_schedule_create(ring.get(), order2.data(), 3, sched.out()));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  CHECK_LWO(lwo_schedule_next(sched.get(), stream(0), &v));
  EXPECT_EQ(0u, v.layer);
  lwo_status_t s = lwo_schedule_next(sched.get(), stream(0), &v);
  EXPECT_EQ(std::string("LWO_ERR_LAYER_BUSY"), lwo_status_string(s)) << lwo_last_error_message();
  std::printf("[ schedule ] busy layer message: %s\n", lwo_last_error_message());
  uint32_t pos = 0;
  CHECK_LWO(lwo_schedule_position(sched.get(), &pos));
  EXPECT_EQ(1u, pos) << "a failed next does not advance";
  CHECK_LWO(lwo_ring_release(ring.get(), mine, stream(1)));
  // The release was on stream 1; the schedule reads on stream 0: join first is
  // not needed for correctness of layer 7 itself (a hit waits for its free).
  CHECK_LWO(lwo_schedule_next(sched.get(), stream(0), &v));
  EXPECT_EQ(7u, v.layer);
  CUDA_OK(checks.add(v.base, tp.layers[7].whole_bytes, tp.layers[7].whole_sum, stream(0),
                     "layer 7 through the schedule after the retry"));
  CHECK_LWO(lwo_schedule_next(sched.get(), stream(0), &v));
  EXPECT_EQ(1u, v.layer);
  EXPECT_EQ(LWO_END, lwo_schedule_next(sched.get(), stream(0), &v));
  CHECK_LWO(sched.reset());
  CHECK_LWO(ring.reset());
  checks.verify();
  CHECK_LWO(tp.destroy());
}

}  // namespace
}  // namespace lwo_test
