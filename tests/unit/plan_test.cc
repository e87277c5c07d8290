// The planner's model (src/plan): predictions against hand-computed
// timelines, the steady state's hits, gradient staging, the budget, and the
// greedy choice against the "first k layers" rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>

#include "src/common/error.h"
#include "src/plan/plan.h"

namespace lwo {
namespace plan {
namespace {

constexpr uint64_t MB = 1000 * 1000;

std::vector<LayerCost> uniform(uint32_t n, uint64_t bytes, double fwd_ms, double bwd_ms = 0,
                               uint64_t grad_bytes = 0) {
  std::vector<LayerCost> v(n);
  for (LayerCost& c : v) c = {bytes, grad_bytes, fwd_ms, bwd_ms};
  return v;
}

Link link50() {  // 50 GB/s alone, 40 at once: 100 MB in 2 ms alone, 2.5 ms at once
  Link k;
  k.h2d_gbps = k.d2h_gbps = 50;
  k.duplex_h2d_gbps = k.duplex_d2h_gbps = 40;
  return k;
}

// Link-bound forward: every layer copied back to back, the last one computed.
TEST(Plan, LinkBoundForwardIsTheCopiesThenTheLastCompute) {
  const auto layers = uniform(8, 100 * MB, 0.1);
  const Prediction p = predict(layers, std::vector<bool>(8, false), 2, link50(), Pass{});
  EXPECT_NEAR(p.ms, 8 * 2.0 + 0.1, 1e-9);
  EXPECT_EQ(p.h2d_bytes, 800 * MB);
  ASSERT_EQ(p.positions.size(), 8u);
  for (const Position& pos : p.positions) EXPECT_FALSE(pos.hit || pos.resident);
  EXPECT_NEAR(p.positions[3].start_ms, 4 * 2.0, 1e-9);  // layer 3 lands at 8 ms
  EXPECT_NEAR(p.stall_ms, 16.1 - 0.8, 1e-9);
}

// Compute-bound: the first copy, then compute back to back.
TEST(Plan, ComputeBoundForwardIsTheFirstCopyThenTheComputes) {
  const auto layers = uniform(8, 100 * MB, 5.0);
  const Prediction p = predict(layers, std::vector<bool>(8, false), 2, link50(), Pass{});
  EXPECT_NEAR(p.ms, 2.0 + 8 * 5.0, 1e-9);
  EXPECT_NEAR(p.stall_ms, 2.0, 1e-9);
}

TEST(Plan, EveryLayerResidentIsTheComputeAlone) {
  const auto layers = uniform(6, 100 * MB, 1.0, 2.0, 100 * MB);
  Pass step;
  step.backward = true;
  const Prediction p = predict(layers, std::vector<bool>(6, true), 0, link50(), step);
  // The gradients still leave, 2.5 ms each at the duplex rate against 2 ms of
  // compute: from the first backward's end the copies run back to back.
  EXPECT_NEAR(p.ms, 6 * 1.0 + 2.0 + 6 * 2.5, 1e-9);
  EXPECT_EQ(p.h2d_bytes, 0u);
  EXPECT_EQ(p.d2h_bytes, 600 * MB);
}

// A steady-state step at depth 2 copies 2L - 4 layers: 2 hits at the turn,
// 2 at the start (left by the previous step's backward).
TEST(Plan, StepsHitAtTheTurnAndAtTheStart) {
  const uint32_t L = 10;
  const auto layers = uniform(L, 100 * MB, 0.1, 0.2, 100 * MB);
  Pass step;
  step.backward = true;
  const Prediction p = predict(layers, std::vector<bool>(L, false), 2, link50(), step);
  EXPECT_EQ(p.h2d_bytes, (2 * L - 4) * 100 * MB);
  ASSERT_EQ(p.positions.size(), 2 * L);
  EXPECT_TRUE(p.positions[0].hit && p.positions[1].hit);
  EXPECT_FALSE(p.positions[2].hit);
  EXPECT_TRUE(p.positions[L].hit && p.positions[L + 1].hit);
  EXPECT_FALSE(p.positions[L + 2].hit);
  EXPECT_EQ(p.positions[L].layer, L - 1);
  // Forward: 8 copies of 2 ms; backward: 8 copies and 10 gradients at 2.5 ms
  // each on their own engines, the last gradient ending the step.
  EXPECT_GT(p.ms, 8 * 2.0 + 10 * 2.5);
  EXPECT_LT(p.ms, 8 * 2.0 + 10 * 2.5 + 2.0 + 2 * 0.3);
}

// One gradient staging slot: each backward waits for the previous layer's
// gradient copy.
TEST(Plan, GradientStagingDepthOrdersTheBackward) {
  const auto layers = uniform(4, 100 * MB, 0.1, 0.1, 100 * MB);
  Pass one, two;
  one.backward = two.backward = true;
  one.grad_depth = 1;
  two.grad_depth = 2;
  const std::vector<bool> all(4, true);
  const Prediction p1 = predict(layers, all, 0, link50(), one);
  const Prediction p2 = predict(layers, all, 0, link50(), two);
  EXPECT_NEAR(p1.ms, 0.4 + 4 * (0.1 + 2.5), 1e-9);  // compute and copy alternate
  EXPECT_LT(p2.ms, p1.ms);
  EXPECT_NEAR(p2.ms, 0.4 + 0.1 + 4 * 2.5, 1e-9);  // the copies back to back
}

TEST(Plan, DeviceBytesCountResidentRingAndStaging) {
  std::vector<LayerCost> layers = uniform(4, 100 * MB, 1, 1, 50 * MB);
  layers[3].bytes = 300 * MB;
  Pass step;
  step.backward = true;
  EXPECT_EQ(device_bytes(layers, {true, false, false, false}, 2, step),
            100 * MB + 2 * 300 * MB + 2 * 50 * MB);
  EXPECT_EQ(device_bytes(layers, {false, false, false, true}, 3, Pass{}), 300 * MB + 3 * 100 * MB);
  EXPECT_EQ(device_bytes(layers, {true, true, true, true}, 8, Pass{}), 600 * MB);
}

TEST(Plan, ABudgetBelowTheSmallestRingIsRefusedWithTheBytesNeeded) {
  const auto layers = uniform(4, 100 * MB, 1);
  try {
    choose(layers, 150 * MB, link50(), Pass{}, {2, 4});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), LWO_ERR_OVER_BUDGET);
    EXPECT_NE(std::string(e.what()).find("200000000 bytes"), std::string::npos) << e.what();
  }
  EXPECT_THROW(predict(layers, {true, false}, 2, link50(), Pass{}), Error);
  EXPECT_THROW(predict(layers, std::vector<bool>(4, false), 0, link50(), Pass{}), Error);
}

TEST(Plan, AWholeModelBudgetKeepsEverythingResident) {
  const auto layers = uniform(6, 100 * MB, 0.5);
  const Plan p = choose(layers, 600 * MB, link50(), Pass{});
  // Five resident and one in a slot of depth 1 is as fast (in the steady
  // state the one streamed layer stays in its slot: a hit every pass).
  EXPECT_GE(std::count(p.resident.begin(), p.resident.end(), true), 5);
  EXPECT_NEAR(p.prediction.ms, 6 * 0.5, 1e-9);
  EXPECT_EQ(p.prediction.h2d_bytes, 0u);
  EXPECT_LE(p.device_bytes, 600 * MB);
}

// Uneven: the first half compute-bound (streaming them is nearly free), the
// second half link-bound. Keeping the first k resident saves little; the
// search keeps layers whose copies are exposed (here 0, 5, 7 and 8: 68.2 ms
// against 76.2 for the first six and 82.1 for none).
TEST(Plan, TheSearchBeatsTheFirstLayersOnAnUnevenModel) {
  std::vector<LayerCost> layers;
  for (int i = 0; i < 6; ++i) layers.push_back({100 * MB, 0, 10.0, 0});  // 2 ms copy, 10 ms compute
  for (int i = 0; i < 6; ++i) layers.push_back({200 * MB, 0, 0.1, 0});   // 4 ms copy, 0.1 ms
  const uint64_t budget = 600 * MB + 2 * 200 * MB;
  const Plan greedy = choose(layers, budget, link50(), Pass{}, {2});
  const Plan first = first_layers(layers, budget, link50(), Pass{}, 2);
  EXPECT_LE(greedy.device_bytes, budget);
  EXPECT_LE(first.device_bytes, budget);
  EXPECT_LT(greedy.prediction.ms, first.prediction.ms - 5.0)
      << "greedy " << greedy.prediction.ms << " ms, first layers " << first.prediction.ms << " ms";
  uint64_t link_bound_resident = 0;
  for (int i = 6; i < 12; ++i) link_bound_resident += greedy.resident[i] ? 1 : 0;
  EXPECT_GE(link_bound_resident, 2u);
}

// On random models and budgets the plan fits, saves time against streaming
// everything, and the deeper rings are considered.
TEST(Plan, RandomModelsFitTheirBudgetAndNeverLoseToStreamingAll) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> mb(10, 300), n(3, 24);
  std::uniform_real_distribution<double> ms(0.05, 6.0), share(0.0, 1.2);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<LayerCost> layers(n(rng));
    uint64_t total = 0;
    for (LayerCost& c : layers) {
      c.bytes = static_cast<uint64_t>(mb(rng)) * MB;
      c.grad_bytes = trial % 2 ? c.bytes : 0;
      c.fwd_ms = ms(rng);
      c.bwd_ms = 2 * c.fwd_ms;
      total += c.bytes;
    }
    Pass pass;
    pass.backward = trial % 2 == 1;
    const uint64_t ring = device_bytes(layers, std::vector<bool>(layers.size(), false), 1, pass);
    const uint64_t budget = ring + static_cast<uint64_t>(share(rng) * static_cast<double>(total));
    const Plan p = choose(layers, budget, link50(), pass);
    SCOPED_TRACE("trial " + std::to_string(trial));
    EXPECT_LE(p.device_bytes, budget);
    EXPECT_EQ(p.device_bytes, device_bytes(layers, p.resident, p.depth, pass));
    double stream_all = 1e300;
    for (uint32_t d : {1u, 2u, 3u, 4u, 6u, 8u})
      if (device_bytes(layers, std::vector<bool>(layers.size(), false), d, pass) <= budget)
        stream_all = std::min(stream_all,
                              predict(layers, std::vector<bool>(layers.size(), false), d,
                                      link50(), pass).ms);
    EXPECT_LE(p.prediction.ms, stream_all + 1e-9);
  }
}

}  // namespace
}  // namespace plan
}  // namespace lwo
