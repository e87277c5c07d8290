// Resident layers of a ring and the engine's device memory budget (Since
// 0.4.0), against the recording backend: hits that move nothing, a changed
// layer uploaded again only after every reader of its old bytes, tickets and
// schedules as for streamed layers, every error, and the budget counting ring
// slots, resident layers and gradient staging.
#include <algorithm>
#include <random>

#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

class ResidentTest : public EngineTest {
 protected:
  lwo_status_t try_ring(lwo_pool* pool, uint32_t depth, const uint32_t* resident, uint32_t n,
                        lwo_ring** ring) {
    lwo_ring_config c = LWO_RING_CONFIG_INIT;
    c.depth = depth;
    c.resident_layers = resident;
    c.n_resident = n;
    return lwo_ring_create(pool, &c, ring);
  }
  uint64_t record_bytes(lwo_pool* pool, uint32_t layer) {
    void* p = nullptr;
    uint64_t b = 0;
    EXPECT_EQ(lwo_pool_layer_host(pool, layer, &p, &b), LWO_OK);
    return b;
  }
  lwo_ring_stats stats(lwo_ring* ring) {
    lwo_ring_stats st{};
    st.size = sizeof st;
    EXPECT_EQ(lwo_ring_get_stats(ring, &st), LWO_OK);
    return st;
  }
};

// Resident layers go up once at creation; every later stage of them is a hit
// that enqueues no copy, their views hold the host bytes, and the streamed
// layers keep streaming through slots of the largest streamed record.
TEST_F(ResidentTest, ResidentLayersAreHitsThatMoveNothing) {
  const uint32_t kLayers = 8;
  lwo_pool* pool = make_pool(kLayers, 7);
  // Layers 4 and 9 % 5 are the largest (5 x 37 rows): make 4 resident, so the
  // slots shrink to the largest streamed record.
  uint64_t copies0 = gpu->stats.copies, bytes0 = gpu->stats.bytes;
  lwo_ring* ring = resident_ring(pool, 2, {4, 1});
  ASSERT_NE(ring, nullptr);
  EXPECT_EQ(gpu->stats.copies, copies0 + 2);  // the two uploads
  EXPECT_EQ(gpu->stats.bytes, bytes0 + record_bytes(pool, 4) + record_bytes(pool, 1));
  lwo_ring_info info{};
  info.size = sizeof info;
  ASSERT_LWO(lwo_ring_get_info(ring, &info));
  EXPECT_EQ(info.depth, 2u);
  EXPECT_EQ(info.n_free, 2u);
  EXPECT_EQ(info.n_resident, 2u);
  EXPECT_EQ(info.resident_bytes, record_bytes(pool, 4) + record_bytes(pool, 1));
  uint64_t streamed_max = 0;
  for (uint32_t l = 0; l < kLayers; ++l)
    if (l != 4 && l != 1) streamed_max = std::max(streamed_max, record_bytes(pool, l));
  EXPECT_EQ(info.slot_bytes, streamed_max);
  EXPECT_LT(info.slot_bytes, record_bytes(pool, 4));
  ASSERT_LWO(lwo_ring_reset_stats(ring));

  StreamH c = gpu->new_stream(), d = gpu->new_stream();
  const int kPasses = 3;
  for (int pass = 0; pass < kPasses; ++pass)
    for (uint32_t l = 0; l < kLayers; ++l) {
      uint64_t before = gpu->stats.copies;
      use(ring, pool, l, pass % 2 ? c : d);
      if (l == 4 || l == 1) {
        EXPECT_EQ(gpu->stats.copies, before) << "resident layer " << l;
      }
    }
  lwo_ring_stats st = stats(ring);
  EXPECT_EQ(st.n_stages, uint64_t(kPasses) * kLayers);
  EXPECT_EQ(st.n_resident_hits, uint64_t(kPasses) * 2);
  EXPECT_EQ(st.n_resident_uploads, 0u);
  EXPECT_GE(st.n_hits, st.n_resident_hits);
  EXPECT_EQ(st.n_copies, st.n_stages - st.n_hits);
  uint64_t streamed_bytes = 0;
  for (uint32_t l = 0; l < kLayers; ++l)
    if (l != 4 && l != 1) streamed_bytes += record_bytes(pool, l);
  EXPECT_EQ(st.bytes_copied, streamed_bytes * kPasses);  // depth 2 < 6 streamed: no hits
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(ring, pool);
}

// A changed resident layer is uploaded again into its slot at its next stage,
// ordered after every reader of the old bytes (on two streams, one of which
// only staged and released), and holds the new bytes; while it is staged or
// acquired, staging it again is LAYER_BUSY.
TEST_F(ResidentTest, ChangedResidentLayerIsUploadedAfterEveryReader) {
  lwo_pool* pool = make_pool(3, 11);
  lwo_ring* ring = resident_ring(pool, 1, {0});
  StreamH a = gpu->new_stream(), b = gpu->new_stream(), c = gpu->new_stream();
  lwo_ticket t{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(acquire(ring, 0, a, &t, &v));
  void* old_base = v.base;
  gpu->read(a, v.base, v.record_bytes);
  lwo_ticket t2{};
  EXPECT_EQ(lwo_ring_stage(ring, 0, &t2), LWO_ERR_LAYER_BUSY);
  EXPECT_NE(std::string(lwo_last_error_message()).find("resident slot"), std::string::npos);
  ASSERT_LWO(lwo_ring_release(ring, t, stream(a)));
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));  // a hit read on b
  ASSERT_LWO(lwo_ring_acquire(ring, t, stream(b), &v));
  gpu->read(b, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t, stream(b)));
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));  // a hit released on c unread
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];

  void* host = nullptr;
  uint64_t bytes = 0;
  ASSERT_LWO(lwo_pool_layer_host(pool, 0, &host, &bytes));
  fill_random(host, bytes, 4242);
  ASSERT_LWO(lwo_pool_layer_changed(pool, 0));
  uint64_t copies = gpu->stats.copies;
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));  // the upload: after a's and b's reads
  EXPECT_EQ(gpu->stats.copies, copies + 1);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_acquire(ring, t, stream(a), &v));
  EXPECT_EQ(v.base, old_base);  // the same slot
  EXPECT_TRUE(holds_layer(pool, v));
  gpu->read(a, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t, stream(a)));
  use(ring, pool, 0, b);  // unchanged since: a hit again
  EXPECT_EQ(gpu->stats.copies, copies + 1);
  // lwo_pool_write marks it changed too.
  std::vector<uint8_t> w(37 * 19 * 2);
  fill_random(w.data(), w.size(), 99);
  ASSERT_LWO(lwo_pool_write(pool, 0, "weight", w.data(), w.size()));
  use(ring, pool, 0, c);
  EXPECT_EQ(gpu->stats.copies, copies + 2);
  lwo_ring_stats st = stats(ring);
  EXPECT_EQ(st.n_resident_uploads, 3u);  // creation and two changes
  EXPECT_EQ(st.n_resident_hits, 4u);  // the first stage, b, c, and the hit after a change
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(ring, pool);
}

// Random stage / acquire / read / release / change over streamed and resident
// layers on three streams: no copy overwrites bytes a reader may still read,
// every read follows its copy, every view holds its layer's current bytes,
// and resident layers are copied only after a change.
TEST_F(ResidentTest, RandomSequencesWithResidentLayersKeepHappensBefore) {
  const uint32_t kLayers = 9;
  lwo_pool* pool = make_pool(kLayers, 5);
  std::vector<StreamH> consumers = {gpu->new_stream(), gpu->new_stream(), gpu->new_stream()};
  std::mt19937 rng(777);
  uint64_t changes_of_resident = 0;
  for (uint32_t depth = 1; depth <= 4; ++depth) {
    std::vector<uint32_t> resident = {depth % kLayers, (depth + 3) % kLayers, 8};
    lwo_ring* ring = resident_ring(pool, depth, resident);
    ASSERT_NE(ring, nullptr);
    ASSERT_LWO(lwo_ring_reset_stats(ring));
    auto is_res = [&](uint32_t l) {
      return std::find(resident.begin(), resident.end(), l) != resident.end();
    };
    struct Out {
      lwo_ticket t;
      uint32_t layer;
      bool acquired;
      StreamH stream;
    };
    std::vector<Out> out;
    uint64_t expected_uploads = 0;
    std::vector<bool> changed(kLayers, false);
    for (int op = 0; op < 3000; ++op) {
      uint32_t choice = rng() % 12;
      if (choice < 4) {
        uint32_t layer = rng() % kLayers;
        lwo_ticket t{};
        uint64_t copies = gpu->stats.copies;
        lwo_status_t s = lwo_ring_stage(ring, layer, &t);
        bool busy = false;
        size_t streamed_out = 0;
        for (const Out& o : out) {
          busy |= o.layer == layer;
          streamed_out += !is_res(o.layer);
        }
        if (busy) {
          ASSERT_EQ(s, LWO_ERR_LAYER_BUSY) << lwo_last_error_message();
        } else if (!is_res(layer) && streamed_out == depth) {
          ASSERT_EQ(s, LWO_ERR_RING_FULL) << lwo_last_error_message();
        } else {
          ASSERT_EQ(s, LWO_OK) << lwo_last_error_message();
          if (is_res(layer)) {
            ASSERT_EQ(gpu->stats.copies, copies + (changed[layer] ? 1 : 0)) << "layer " << layer;
            expected_uploads += changed[layer];
            changed[layer] = false;
          }
          out.push_back({t, layer, false, nullptr});
        }
      } else if (choice < 7 && !out.empty()) {
        Out& o = out[rng() % out.size()];
        if (o.acquired) continue;
        o.stream = consumers[rng() % consumers.size()];
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_LWO(lwo_ring_acquire(ring, o.t, stream(o.stream), &v));
        o.acquired = true;
        ASSERT_TRUE(holds_layer(pool, v)) << "layer " << o.layer << " depth " << depth;
        gpu->read(o.stream, v.base, v.record_bytes);
      } else if (choice < 11 && !out.empty()) {
        size_t i = rng() % out.size();
        Out o = out[i];
        StreamH rs = o.acquired ? o.stream : consumers[rng() % consumers.size()];
        ASSERT_LWO(lwo_ring_release(ring, o.t, stream(rs)));
        out.erase(out.begin() + static_cast<long>(i));
      } else {
        // An optimizer step on a layer no one holds.
        uint32_t layer = rng() % kLayers;
        bool held = false;
        for (const Out& o : out) held |= o.layer == layer;
        if (held) continue;
        void* host = nullptr;
        uint64_t bytes = 0;
        ASSERT_LWO(lwo_pool_layer_host(pool, layer, &host, &bytes));
        fill_random(host, bytes, rng());
        ASSERT_LWO(lwo_pool_layer_changed(pool, layer));
        changed[layer] = true;
        changes_of_resident += is_res(layer);
      }
      ASSERT_TRUE(gpu->violations.empty())
          << "depth " << depth << " op " << op << ": " << gpu->violations[0];
    }
    for (const Out& o : out)
      ASSERT_LWO(lwo_ring_release(ring, o.t, stream(o.acquired ? o.stream : consumers[0])));
    lwo_ring_stats st = stats(ring);
    EXPECT_EQ(st.n_resident_uploads, expected_uploads);
    EXPECT_GT(st.n_resident_hits, 100u);
    ASSERT_LWO(lwo_ring_destroy(ring));
  }
  EXPECT_GT(changes_of_resident, 10u);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// A schedule over a ring with resident layers: every view holds its layer,
// the resident layers are hits on every pass.
TEST_F(ResidentTest, SchedulesRunOverResidentLayers) {
  lwo_pool* pool = make_pool(6, 3);
  lwo_ring* ring = resident_ring(pool, 2, {0, 5});
  std::vector<uint32_t> order = {0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 0};
  lwo_schedule* sch = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order.data(), static_cast<uint32_t>(order.size()), &sch));
  StreamH c = gpu->new_stream();
  ASSERT_LWO(lwo_ring_reset_stats(ring));
  for (int pass = 0; pass < 2; ++pass) {
    size_t n = 0;
    for (;;) {
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      lwo_status_t s = lwo_schedule_next(sch, stream(c), &v);
      if (s == LWO_END) break;
      ASSERT_LWO(s);
      ASSERT_EQ(v.layer, order[n]);
      ASSERT_TRUE(holds_layer(pool, v));
      gpu->read(c, v.base, v.record_bytes);
      ++n;
    }
    ASSERT_EQ(n, order.size());
    ASSERT_LWO(lwo_schedule_reset(sch, stream(c)));
  }
  lwo_ring_stats st = stats(ring);
  EXPECT_EQ(st.n_resident_hits, 8u);  // 4 per pass
  EXPECT_EQ(st.n_resident_uploads, 0u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(sch, ring, pool);
}

TEST_F(ResidentTest, BadResidentListsGiveDistinctStatuses) {
  lwo_pool* pool = make_pool(4);
  size_t allocs = gpu->n_device_allocs();
  lwo_ring* ring = reinterpret_cast<lwo_ring*>(1);
  EXPECT_EQ(try_ring(pool, 2, nullptr, 2, &ring), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ring, nullptr);
  EXPECT_NE(std::string(lwo_last_error_message()).find("resident_layers is NULL"), std::string::npos);
  uint32_t dup[] = {1, 2, 1};
  EXPECT_EQ(try_ring(pool, 2, dup, 3, &ring), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("resident layer 1 is listed twice"),
            std::string::npos);
  uint32_t far[] = {0, 4};
  EXPECT_EQ(try_ring(pool, 2, far, 2, &ring), LWO_ERR_OUT_OF_RANGE);
  EXPECT_NE(std::string(lwo_last_error_message()).find("resident layer 4 (entry 1)"),
            std::string::npos);
  uint32_t one[] = {0};
  EXPECT_EQ(try_ring(pool, 4096, one, 1, &ring), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("4096"), std::string::npos);
  // Out of device memory on the second resident slot: nothing left behind.
  uint32_t two[] = {0, 3};
  gpu->fail_alloc_after = 3;  // two ring slots, the first resident slot, then fail
  EXPECT_EQ(try_ring(pool, 2, two, 2, &ring), LWO_ERR_OUT_OF_MEMORY);
  EXPECT_NE(std::string(lwo_last_error_message()).find("resident"), std::string::npos);
  // A failed upload at creation: nothing left behind either.
  gpu->fail_copy_after = 1;
  EXPECT_EQ(try_ring(pool, 2, two, 2, &ring), LWO_ERR_CUDA);
  EXPECT_EQ(ring, nullptr);
  EXPECT_EQ(gpu->n_device_allocs(), allocs);
  lwo_engine_memory m = LWO_ENGINE_MEMORY_INIT;
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.used, 0u);  // every failed creation gave its charges back
  ASSERT_LWO(lwo_pool_destroy(pool));  // no ring was counted
}

// A failed re-upload leaves the resident slot empty: the next stage uploads
// again (never a hit of half-written bytes).
TEST_F(ResidentTest, FailedReuploadIsRetried) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = resident_ring(pool, 1, {2});
  StreamH c = gpu->new_stream();
  use(ring, pool, 2, c);
  ASSERT_LWO(lwo_pool_layer_changed(pool, 2));
  gpu->fail_copy_after = 0;
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(ring, 2, &t), LWO_ERR_CUDA);
  uint64_t copies = gpu->stats.copies;
  use(ring, pool, 2, c);
  EXPECT_EQ(gpu->stats.copies, copies + 1);
  use(ring, pool, 2, c);
  EXPECT_EQ(gpu->stats.copies, copies + 1);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(ring, pool);
}

TEST_F(ResidentTest, ShardedPoolsRefuseResidentLayers) {
  gpu->fake_ranks = 2;
  gpu->fake_rank = 0;
  ModelDesc m(4);
  int fake_comm = 0;
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 4,
                                     reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr, &pool));
  uint32_t one[] = {1};
  lwo_ring* ring = nullptr;
  EXPECT_EQ(try_ring(pool, 2, one, 1, &ring), LWO_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(lwo_last_error_message()).find("sharded"), std::string::npos);
  ASSERT_LWO(try_ring(pool, 2, nullptr, 0, &ring));  // streaming still works
  destroy(ring, pool);
}

// ---- the budget ----

uint64_t footprint(uint64_t b) {
  const uint64_t g = b >= (uint64_t(1) << 20) ? (uint64_t(2) << 20) : 512;
  return (b + g - 1) / g * g;
}

TEST_F(ResidentTest, BudgetCountsSlotsResidentLayersAndGradients) {
  lwo_pool* pool = make_pool(5, 2);
  uint64_t slot = 0;
  for (uint32_t l = 0; l < 5; ++l)
    if (l != 4) slot = std::max(slot, record_bytes(pool, l));
  const uint64_t slots = 2 * footprint(slot), res = footprint(record_bytes(pool, 4));
  ASSERT_LWO(lwo_engine_set_budget(engine, slots + res - 1, 0.0, 0));
  lwo_ring* ring = nullptr;
  uint32_t four[] = {4};
  EXPECT_EQ(try_ring(pool, 2, four, 1, &ring), LWO_ERR_OVER_BUDGET);
  std::string msg = lwo_last_error_message();
  EXPECT_NE(msg.find("lwo_ring_create"), std::string::npos) << msg;
  EXPECT_NE(msg.find(strf("need %llu bytes", static_cast<unsigned long long>(res))),
            std::string::npos) << msg;
  EXPECT_NE(msg.find(strf("has %llu left", static_cast<unsigned long long>(res - 1))),
            std::string::npos) << msg;
  EXPECT_EQ(ring, nullptr);
  lwo_engine_memory m = LWO_ENGINE_MEMORY_INIT;
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.used, 0u);
  EXPECT_EQ(m.budget, slots + res - 1);

  ASSERT_LWO(lwo_engine_set_budget(engine, slots + res, 0.0, 0));
  ring = resident_ring(pool, 2, {4});
  ASSERT_NE(ring, nullptr);
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.ring_slots, slots);
  EXPECT_EQ(m.resident, res);
  EXPECT_EQ(m.used, slots + res);
  EXPECT_EQ(m.left, 0u);
  // Nothing more fits: a second ring, gradient staging.
  lwo_ring* second = nullptr;
  EXPECT_EQ(try_ring(pool, 1, nullptr, 0, &second), LWO_ERR_OVER_BUDGET);
  std::vector<uint8_t> trainable(5, 1);
  lwo_grads* grads = nullptr;
  EXPECT_EQ(lwo_grads_create(pool, trainable.data(), nullptr, &grads), LWO_ERR_OVER_BUDGET);
  EXPECT_NE(std::string(lwo_last_error_message()).find("gradient staging"), std::string::npos);
  // Lowering the budget below what is held is refused and changes nothing.
  EXPECT_EQ(lwo_engine_set_budget(engine, slots, 0.0, 0), LWO_ERR_OVER_BUDGET);
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.budget, slots + res);
  // Without a limit gradients fit, and count.
  ASSERT_LWO(lwo_engine_set_budget(engine, 0, 0.0, 0));
  ASSERT_LWO(lwo_grads_create(pool, trainable.data(), nullptr, &grads));
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_GT(m.grads, 0u);
  EXPECT_EQ(m.used, slots + res + m.grads);
  EXPECT_EQ(m.budget, 0u);
  destroy(grads, ring);
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.used, 0u);  // everything given back
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(ResidentTest, BudgetShareAndHeadroomOfFreeMemory) {
  gpu->device_total = uint64_t(1) << 30;
  ASSERT_LWO(lwo_engine_set_budget(engine, 0, 0.25, 0));
  lwo_engine_memory m = LWO_ENGINE_MEMORY_INIT;
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.budget, uint64_t(1) << 28);
  EXPECT_EQ(m.device_total, uint64_t(1) << 30);
  ASSERT_LWO(lwo_engine_set_budget(engine, 0, 0.0, uint64_t(900) << 20));
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.budget, (uint64_t(1) << 30) - (uint64_t(900) << 20));
  // The smallest that applies.
  ASSERT_LWO(lwo_engine_set_budget(engine, 1000, 0.5, uint64_t(1) << 20));
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.budget, 1000u);
  EXPECT_EQ(lwo_engine_set_budget(engine, 0, 1.5, 0), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("1.5"), std::string::npos);
  EXPECT_EQ(lwo_engine_set_budget(engine, 0, 0.0, uint64_t(2) << 30), LWO_ERR_OVER_BUDGET);
  EXPECT_NE(std::string(lwo_last_error_message()).find("headroom"), std::string::npos);
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.budget, 1000u);  // unchanged by the failed calls
  EXPECT_EQ(lwo_engine_get_memory(engine, nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_engine_set_budget(nullptr, 0, 0, 0), LWO_ERR_INVALID_HANDLE);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
