// The planner's C calls against the recording backend: the plan
// is src/plan's choice for the pool's records, the caller's compute times
// and the budget; its ring config creates a ring that fits that budget as
// the engine charges it; calibration times the engine's own streams; every
// bad argument has its status.
#include <cmath>

#include "src/plan/plan.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

class PlanApiTest : public EngineTest {
 protected:
  // Layers of uneven sizes: ModelDesc's (i % 5 + 1) * 37 rows.
  void SetUp() override {
    EngineTest::SetUp();
    pool = make_pool(kLayers, 9);
    for (uint32_t l = 0; l < kLayers; ++l) {
      fwd[l] = 0.001 * (1 + l % 3);
      bwd[l] = 2 * fwd[l];
    }
  }
  void TearDown() override {
    EXPECT_EQ(lwo_pool_destroy(pool), LWO_OK) << lwo_last_error_message();
    EngineTest::TearDown();
  }
  lwo_plan_config config(uint64_t budget, bool train) {
    lwo_plan_config c = LWO_PLAN_CONFIG_INIT;
    c.flags = train ? LWO_PLAN_TRAIN : 0u;
    c.budget_bytes = budget;
    c.fwd_ms = fwd;
    c.bwd_ms = bwd;
    c.h2d_gbps = 0.02;  // slow enough that the copies matter at these sizes
    c.d2h_gbps = 0.02;
    return c;
  }
  // Creates *plan of c over the pool and reads its info into *info.
  void create(const lwo_plan_config& c, lwo_plan** plan, lwo_plan_info* info) {
    ASSERT_LWO(lwo_plan_create(pool, &c, plan));
    *info = lwo_plan_info{};
    info->size = sizeof *info;
    ASSERT_LWO(lwo_plan_get_info(*plan, info));
  }
  uint64_t record(uint32_t l) {
    void* p = nullptr;
    uint64_t b = 0;
    EXPECT_EQ(lwo_pool_layer_host(pool, l, &p, &b), LWO_OK);
    return b;
  }
  static constexpr uint32_t kLayers = 10;
  lwo_pool* pool = nullptr;
  double fwd[kLayers], bwd[kLayers];
};

TEST_F(PlanApiTest, PlanIsTheModelsChoiceAndItsRingFitsTheBudget) {
  uint64_t total = 0;
  for (uint32_t l = 0; l < kLayers; ++l) total += record(l);
  for (bool train : {false, true}) {
    const uint64_t budget = total / 2 + (uint64_t(64) << 10);
    lwo_plan_config c = config(budget, train);
    lwo_plan* plan = nullptr;
    lwo_plan_info info;
    ASSERT_NO_FATAL_FAILURE(create(c, &plan, &info));
    EXPECT_EQ(info.n_positions, train ? 2 * kLayers : kLayers);
    EXPECT_EQ(info.train, train ? 1u : 0u);
    EXPECT_EQ(info.budget_bytes, budget);
    EXPECT_GT(info.n_resident, 0u);
    EXPECT_LE(info.device_bytes, budget);
    EXPECT_LE(info.predicted_ms, info.first_k_ms + 1e-12);
    // The same as the model's own prediction of that configuration.
    std::vector<plan::LayerCost> layers(kLayers);
    for (uint32_t l = 0; l < kLayers; ++l) {
      layers[l].bytes = record(l);
      layers[l].fwd_ms = fwd[l];
      layers[l].bwd_ms = train ? bwd[l] : 0;
    }
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    ASSERT_LWO(lwo_plan_ring_config(plan, &rc));
    EXPECT_EQ(rc.depth, info.depth);
    ASSERT_EQ(rc.n_resident, info.n_resident);
    std::vector<bool> res(kLayers, false);
    for (uint32_t k = 0; k < rc.n_resident; ++k) res[rc.resident_layers[k]] = true;
    if (!train) {
      plan::Link link;
      link.h2d_gbps = link.d2h_gbps = 0.02;
      plan::Prediction p = plan::predict(layers, res, rc.depth, link, plan::Pass{});
      EXPECT_DOUBLE_EQ(p.ms, info.predicted_ms);
      EXPECT_EQ(p.h2d_bytes, info.h2d_bytes);
    }
    double stall = 0;
    for (uint32_t i = 0; i < info.n_positions; ++i) {
      lwo_plan_position pos{};
      pos.size = sizeof pos;
      ASSERT_LWO(lwo_plan_get_position(plan, i, &pos));
      EXPECT_EQ(pos.layer, i < kLayers ? i : 2 * kLayers - 1 - i);
      EXPECT_EQ(pos.backward, i >= kLayers ? 1u : 0u);
      EXPECT_EQ(pos.resident, res[pos.layer] ? 1u : 0u);
      if (pos.resident) {
        EXPECT_EQ(pos.copy_ms, 0.0);
      }
      stall += pos.stall_ms;
    }
    EXPECT_NEAR(stall, info.predicted_stall_ms, 1e-12);
    lwo_plan_position pos{};
    pos.size = sizeof pos;
    EXPECT_EQ(lwo_plan_get_position(plan, info.n_positions, &pos), LWO_ERR_OUT_OF_RANGE);
    // The ring (and in a step the gradient staging) fits the budget as the
    // engine charges it.
    ASSERT_LWO(lwo_engine_set_budget(engine, budget, 0.0, 0));
    lwo_ring* ring = nullptr;
    ASSERT_LWO(lwo_ring_create(pool, &rc, &ring));
    lwo_grads* grads = nullptr;
    if (train) ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &grads));
    lwo_ring_info ri{};
    ri.size = sizeof ri;
    ASSERT_LWO(lwo_ring_get_info(ring, &ri));
    EXPECT_EQ(ri.n_resident, info.n_resident);
    destroy(grads, ring);
    ASSERT_LWO(lwo_engine_set_budget(engine, 0, 0.0, 0));
    ASSERT_LWO(lwo_plan_destroy(plan));
  }
}

// Without a budget in the config the plan takes what the engine's budget has
// left; a budget that holds nothing is LWO_ERR_OVER_BUDGET.
TEST_F(PlanApiTest, BudgetComesFromTheEngineAndMustHoldARing) {
  ASSERT_LWO(lwo_engine_set_budget(engine, uint64_t(1) << 20, 0.0, 0));
  lwo_ring* r = make_ring(pool, 1);  // holds some of it
  lwo_engine_memory m = LWO_ENGINE_MEMORY_INIT;
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  lwo_plan_config c = config(0, false);
  lwo_plan* plan = nullptr;
  lwo_plan_info info;
  ASSERT_NO_FATAL_FAILURE(create(c, &plan, &info));
  EXPECT_EQ(info.budget_bytes, m.left);
  ASSERT_LWO(lwo_plan_destroy(plan));
  ASSERT_LWO(lwo_ring_destroy(r));
  c.budget_bytes = 100;
  EXPECT_EQ(lwo_plan_create(pool, &c, &plan), LWO_ERR_OVER_BUDGET);
  EXPECT_NE(std::string(lwo_last_error_message()).find("lwo_plan_create"), std::string::npos);
  EXPECT_EQ(plan, nullptr);
}

TEST_F(PlanApiTest, CalibrationTimesTheEnginesStreams) {
  lwo_plan_config c = config(uint64_t(1) << 20, true);
  c.flags |= LWO_PLAN_CALIBRATE_LINK;
  c.h2d_gbps = c.d2h_gbps = 0;
  c.calibrate_bytes = 4096;
  uint64_t copies = gpu->stats.copies, d2h = gpu->stats.d2h_copies;
  lwo_plan* plan = nullptr;
  ASSERT_LWO(lwo_plan_create(pool, &c, &plan));
  EXPECT_EQ(gpu->stats.copies, copies + 1 + 2 * 6);  // the fill, then 6 rounds of 2
  EXPECT_EQ(gpu->stats.d2h_copies, d2h + 2 * 6);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  lwo_plan_info info{};
  info.size = sizeof info;
  ASSERT_LWO(lwo_plan_get_info(plan, &info));
  // The recording backend's intervals last 1 ms: 4096 bytes per ms.
  EXPECT_DOUBLE_EQ(info.h2d_gbps, 4096 / 1e6);
  EXPECT_DOUBLE_EQ(info.d2h_gbps, 4096 / 1e6);
  EXPECT_DOUBLE_EQ(info.duplex_h2d_gbps, 4096 / 1e6);
  ASSERT_LWO(lwo_plan_destroy(plan));
  lwo_engine_memory m = LWO_ENGINE_MEMORY_INIT;
  ASSERT_LWO(lwo_engine_get_memory(engine, &m));
  EXPECT_EQ(m.used, 0u);  // the calibration buffers are gone
}

// Grouping: with a per-copy overhead that dwarfs these small records' bytes,
// the plan recommends fewer records than layers; its prediction is src/plan's
// for those groups, never slower than one record per layer, within the
// budget; its ring config names groups. Without the flag every group is a
// layer.
TEST_F(PlanApiTest, GroupingRecommendsRecordsAndPredictsThem) {
  uint64_t total = 0;
  for (uint32_t l = 0; l < kLayers; ++l) total += record(l);
  for (bool train : {false, true}) {
    SCOPED_TRACE(train ? "step" : "forward");
    // Some records resident, the rest streamed through one slot.
    const uint64_t budget = total * 3 / 4;
    lwo_plan_config c = config(budget, train);
    uint32_t depths[] = {1};
    c.depths = depths;
    c.n_depths = 1;
    c.copy_overhead_ms = 2.0;
    lwo_plan* flat = nullptr;
    lwo_plan_info fi;
    ASSERT_NO_FATAL_FAILURE(create(c, &flat, &fi));
    EXPECT_EQ(fi.n_groups, kLayers);
    EXPECT_EQ(fi.ungrouped_ms, fi.predicted_ms);
    EXPECT_EQ(fi.copy_overhead_ms, 2.0);
    for (uint32_t g = 0; g < kLayers; ++g) {
      lwo_plan_group gr{};
      gr.size = sizeof gr;
      ASSERT_LWO(lwo_plan_get_group(flat, g, &gr));
      EXPECT_EQ(gr.first_layer, g);
      EXPECT_EQ(gr.n_layers, 1u);
      EXPECT_EQ(gr.bytes, record(g));
    }
    c.flags |= LWO_PLAN_GROUP;
    lwo_plan* plan = nullptr;
    lwo_plan_info info;
    ASSERT_NO_FATAL_FAILURE(create(c, &plan, &info));
    EXPECT_LT(info.n_groups, kLayers);
    EXPECT_NEAR(info.ungrouped_ms, fi.predicted_ms, 1e-12);
    EXPECT_LT(info.predicted_ms, info.ungrouped_ms);
    EXPECT_LE(info.device_bytes, budget);
    EXPECT_EQ(info.n_positions, train ? 2 * info.n_groups : info.n_groups);
    // The groups cover the layers in order; the model's prediction of them.
    std::vector<plan::LayerCost> costs;
    std::vector<bool> res;
    uint32_t next = 0;
    for (uint32_t g = 0; g < info.n_groups; ++g) {
      lwo_plan_group gr{};
      gr.size = sizeof gr;
      ASSERT_LWO(lwo_plan_get_group(plan, g, &gr));
      EXPECT_EQ(gr.first_layer, next);
      ASSERT_GE(gr.n_layers, 1u);
      plan::LayerCost cost;
      for (uint32_t l = gr.first_layer; l < gr.first_layer + gr.n_layers; ++l) {
        cost.bytes += record(l);
        cost.fwd_ms += fwd[l];
        cost.bwd_ms += train ? bwd[l] : 0;
      }
      EXPECT_EQ(gr.bytes, cost.bytes);
      costs.push_back(cost);
      res.push_back(gr.resident != 0);
      next += gr.n_layers;
    }
    EXPECT_EQ(next, kLayers);
    if (!train) {
      plan::Link link;
      link.h2d_gbps = link.d2h_gbps = 0.02;
      link.copy_overhead_ms = 2.0;
      const plan::Prediction p = plan::predict(costs, res, info.depth, link, plan::Pass{});
      EXPECT_DOUBLE_EQ(p.ms, info.predicted_ms);
      EXPECT_EQ(p.h2d_bytes, info.h2d_bytes);
      EXPECT_EQ(info.device_bytes, plan::device_bytes(costs, res, info.depth, plan::Pass{}));
    }
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    ASSERT_LWO(lwo_plan_ring_config(plan, &rc));
    EXPECT_EQ(rc.depth, info.depth);
    ASSERT_EQ(rc.n_resident, info.n_resident);
    for (uint32_t k = 0; k < rc.n_resident; ++k) {
      ASSERT_LT(rc.resident_layers[k], info.n_groups);
      EXPECT_TRUE(res[rc.resident_layers[k]]);
    }
    lwo_plan_group gr{};
    gr.size = sizeof gr;
    EXPECT_EQ(lwo_plan_get_group(plan, info.n_groups, &gr), LWO_ERR_OUT_OF_RANGE);
    EXPECT_EQ(lwo_plan_get_group(plan, 0, nullptr), LWO_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(lwo_plan_get_group(nullptr, 0, &gr), LWO_ERR_INVALID_HANDLE);
    ASSERT_LWO(lwo_plan_destroy(plan));
    ASSERT_LWO(lwo_plan_destroy(flat));
  }
}

// With grouping, calibration also copies at a second, smaller size and fits
// the overhead; the recording backend's copies all last 1 ms, so the smaller
// one is not faster and no overhead is seen.
TEST_F(PlanApiTest, GroupingCalibratesASecondSize) {
  lwo_plan_config c = config(uint64_t(1) << 20, false);
  c.flags |= LWO_PLAN_CALIBRATE_LINK | LWO_PLAN_GROUP;
  c.h2d_gbps = c.d2h_gbps = 0;
  c.copy_overhead_ms = 5.0;  // measured instead
  c.calibrate_bytes = 64 * 8192;
  uint64_t copies = gpu->stats.copies;
  lwo_plan* plan = nullptr;
  ASSERT_LWO(lwo_plan_create(pool, &c, &plan));
  EXPECT_EQ(gpu->stats.copies, copies + 2 * (1 + 2 * 6));  // two calibrations
  lwo_plan_info info{};
  info.size = sizeof info;
  ASSERT_LWO(lwo_plan_get_info(plan, &info));
  EXPECT_EQ(info.copy_overhead_ms, 0.0);
  EXPECT_DOUBLE_EQ(info.h2d_gbps, 64 * 8192 / 1e6);
  ASSERT_LWO(lwo_plan_destroy(plan));
}

TEST_F(PlanApiTest, BadArgumentsHaveTheirStatuses) {
  lwo_plan* plan = nullptr;
  lwo_plan_config c = config(1 << 20, true);
  EXPECT_EQ(lwo_plan_create(pool, nullptr, &plan), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_plan_create(nullptr, &c, &plan), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(lwo_plan_create(pool, &c, nullptr), LWO_ERR_INVALID_ARGUMENT);
  c.fwd_ms = nullptr;
  EXPECT_EQ(lwo_plan_create(pool, &c, &plan), LWO_ERR_INVALID_ARGUMENT);
  c = config(1 << 20, true);
  c.bwd_ms = nullptr;
  EXPECT_EQ(lwo_plan_create(pool, &c, &plan), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("bwd_ms"), std::string::npos);
  c = config(1 << 20, false);
  double bad[kLayers];
  std::copy(fwd, fwd + kLayers, bad);
  bad[3] = -1;
  c.fwd_ms = bad;
  EXPECT_EQ(lwo_plan_create(pool, &c, &plan), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("fwd_ms[3]"), std::string::npos);
  c = config(1 << 20, false);
  c.h2d_gbps = 0;
  EXPECT_EQ(lwo_plan_create(pool, &c, &plan), LWO_ERR_INVALID_ARGUMENT);
  c = config(1 << 20, false);
  uint32_t depths[] = {2, 0};
  c.depths = depths;
  c.n_depths = 2;
  EXPECT_EQ(lwo_plan_create(pool, &c, &plan), LWO_ERR_INVALID_ARGUMENT);
  c = config(1 << 20, false);
  c.copy_overhead_ms = -0.5;
  EXPECT_EQ(lwo_plan_create(pool, &c, &plan), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("copy_overhead_ms"), std::string::npos);
  c.copy_overhead_ms = std::nan("");
  EXPECT_EQ(lwo_plan_create(pool, &c, &plan), LWO_ERR_INVALID_ARGUMENT);
  c = config(1 << 20, false);
  c.flags = 0x80;
  EXPECT_EQ(lwo_plan_create(pool, &c, &plan), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(plan, nullptr);
  lwo_plan_info info{};
  info.size = sizeof info;
  EXPECT_EQ(lwo_plan_get_info(nullptr, &info), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(lwo_plan_destroy(nullptr), LWO_OK);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
