// The planner's model (src/plan): predictions against hand-computed
// timelines, the steady state's hits, gradient staging, the budget, and the
// greedy choice against the "first k layers" rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
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
// The status of the Error f throws (LWO_OK when it returns).
template <class F>
lwo_status_t status_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.status();
  }
  return LWO_OK;
}

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

// An allocator that hands out 16 MiB units: the charge of a plan is then
// well above what the model counts.
uint64_t round16m(uint64_t b) {
  const uint64_t g = uint64_t(16) << 20;
  return (b + g - 1) / g * g;
}

TEST(Plan, ChargedBytesRoundEveryAllocation) {
  const auto layers = uniform(4, 10 * MB, 1.0, 2.0, 5 * MB);
  Pass step;
  step.backward = true;
  step.grad_depth = 3;
  const std::vector<bool> res = {true, false, true, false};
  // Two resident records, two ring slots, three staging slots: 16 MiB each.
  EXPECT_EQ(charged_bytes(layers, res, 2, step, round16m), 7 * (uint64_t(16) << 20));
  EXPECT_EQ(charged_bytes(layers, res, 2, step, nullptr), device_bytes(layers, res, 2, step));
  // Every layer resident: the slots still hold LWO_RECORD_ALIGN bytes each.
  EXPECT_EQ(charged_bytes(layers, std::vector<bool>(4, true), 2, Pass{}, nullptr),
            40 * MB + 2 * LWO_RECORD_ALIGN);
}

// best_fit's plan is charged within the budget (rounded); one byte less and
// that plan no longer fits, so another (or none) is returned.
TEST(Plan, BestFitIsChargedWithinTheBudgetAndABytesLessRefusesIt) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> mb(3, 90), n(3, 14);
  std::uniform_real_distribution<double> ms(0.05, 6.0), share(0.0, 1.2);
  int planned = 0, refused = 0, other = 0;
  for (int trial = 0; trial < 40; ++trial) {
    Request r;
    r.layers.resize(n(rng));
    uint64_t total = 0;
    for (LayerCost& c : r.layers) {
      c.bytes = static_cast<uint64_t>(mb(rng)) * MB + 17;
      c.grad_bytes = trial % 2 ? c.bytes : 0;
      c.fwd_ms = ms(rng);
      c.bwd_ms = 2 * c.fwd_ms;
      total += c.bytes;
    }
    r.pass.backward = trial % 2 == 1;
    r.link = link50();
    r.link.copy_overhead_ms = trial % 3 ? 0.0 : 0.05;
    r.grouping = trial % 4 >= 2;
    r.footprint = round16m;
    const std::vector<bool> none(r.layers.size(), false);
    r.budget_bytes = charged_bytes(r.layers, none, 1, r.pass, round16m) +
                     static_cast<uint64_t>(share(rng) * static_cast<double>(total));
    SCOPED_TRACE("trial " + std::to_string(trial));
    Choice c;
    try {
      c = best_fit(r);
    } catch (const Error& e) {  // the searches within less room found none that fits
      EXPECT_EQ(e.status(), LWO_ERR_OVER_BUDGET) << e.what();
      continue;
    }
    ++planned;
    const uint64_t charged = charged_bytes(grouped_costs(r.layers, c.groups),
                                           grouped_resident(c.groups), c.depth, r.pass, round16m);
    EXPECT_LE(charged, r.budget_bytes);
    EXPECT_LE(charged_bytes(r.layers, c.plan.resident, c.plan.depth, r.pass, round16m),
              r.budget_bytes);
    EXPECT_LE(c.room_bytes, r.budget_bytes);
    // The records cover every layer once; their bytes and resident indices.
    uint32_t next = 0;
    std::vector<uint32_t> resident;
    for (uint32_t i = 0; i < c.groups.size(); ++i) {
      EXPECT_EQ(c.groups[i].first, next);
      next += c.groups[i].count;
      EXPECT_EQ(c.group_bytes[i], grouped_costs(r.layers, {c.groups[i]})[0].bytes);
      if (c.groups[i].resident) resident.push_back(i);
    }
    EXPECT_EQ(next, r.layers.size());
    EXPECT_EQ(c.resident, resident);

    Request less = r;
    less.budget_bytes = charged - 1;
    try {
      const Choice d = best_fit(less);
      const uint64_t d_charged = charged_bytes(grouped_costs(r.layers, d.groups),
                                               grouped_resident(d.groups), d.depth, r.pass,
                                               round16m);
      EXPECT_LE(d_charged, less.budget_bytes);
      EXPECT_FALSE(d.groups.size() == c.groups.size() && d.depth == c.depth &&
                   grouped_resident(d.groups) == grouped_resident(c.groups) &&
                   std::equal(d.groups.begin(), d.groups.end(), c.groups.begin(),
                              [](const Group& a, const Group& b) {
                                return a.first == b.first && a.count == b.count;
                              }));
      ++other;
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), LWO_ERR_OVER_BUDGET) << e.what();
      ++refused;
    }
  }
  EXPECT_GE(planned, 30);
  EXPECT_GT(other, 0);  // the sweep reaches both outcomes
  EXPECT_GT(refused, 0);
}

// Calibration through the caller's measurement: one size, or two and the
// fitted overhead.
TEST(PlanGroup, CalibrateFitsTheOverheadThroughTwoSizes) {
  std::vector<uint64_t> sizes;
  auto measure = [&sizes](uint64_t bytes) {  // t = 0.02 ms + bytes / 10 GB/s
    sizes.push_back(bytes);
    const double ms = 0.02 + static_cast<double>(bytes) / 10e6;
    Link k;
    k.h2d_gbps = static_cast<double>(bytes) / (ms * 1e6);
    k.d2h_gbps = 7;
    k.duplex_h2d_gbps = 6;
    k.duplex_d2h_gbps = 5;
    return k;
  };
  const Link one = calibrate(measure, 64 * MB, false, 0.5);
  EXPECT_EQ(sizes, std::vector<uint64_t>{64 * MB});
  EXPECT_EQ(one.copy_overhead_ms, 0.5);
  EXPECT_EQ(one.d2h_gbps, 7);
  EXPECT_EQ(one.duplex_h2d_gbps, 6);
  EXPECT_EQ(one.duplex_d2h_gbps, 5);
  sizes.clear();
  const Link two = calibrate(measure, 0, true, 0.5);
  EXPECT_EQ(sizes, (std::vector<uint64_t>{uint64_t(256) << 20, uint64_t(4) << 20}));
  EXPECT_NEAR(two.copy_overhead_ms, 0.02, 1e-9);
  EXPECT_NEAR(two.h2d_gbps, 10, 1e-6);
  EXPECT_EQ(two.d2h_gbps, 7);
  sizes.clear();
  // Too small for a second size: the overhead as given.
  EXPECT_EQ(calibrate(measure, 4096, true, 0.5).copy_overhead_ms, 0.5);
  EXPECT_EQ(sizes, std::vector<uint64_t>{4096});
}

// The per-copy overhead: each streamed copy costs it on top of bytes / rate.
TEST(PlanGroup, CopyOverheadAddsToEveryCopy) {
  const auto layers = uniform(8, 100 * MB, 0.1);
  Link k = link50();
  k.copy_overhead_ms = 0.5;
  const Prediction p = predict(layers, std::vector<bool>(8, false), 2, k, Pass{});
  EXPECT_NEAR(p.ms, 8 * 2.5 + 0.1, 1e-9);
  for (const Position& pos : p.positions) EXPECT_NEAR(pos.copy_ms, 2.5, 1e-12);
  // Resident layers and hits cost nothing: every layer resident is the compute.
  const Prediction r = predict(layers, std::vector<bool>(8, true), 0, k, Pass{});
  EXPECT_NEAR(r.ms, 8 * 0.1, 1e-9);
}

TEST(PlanGroup, FitCopyRecoversOverheadAndRate) {
  std::mt19937_64 rng(1601);
  std::uniform_real_distribution<double> ov(0.001, 0.05), rate(10, 60);
  for (int i = 0; i < 20; ++i) {
    const double o = ov(rng), g = rate(rng);
    const uint64_t a = (2 + i) * MB, b = (64 + 3 * i) * MB;
    auto t = [&](uint64_t bytes) { return o + static_cast<double>(bytes) / (g * 1e6); };
    const CopyFit f = fit_copy(a, t(a), b, t(b));
    EXPECT_NEAR(f.overhead_ms, o, 1e-9);
    EXPECT_NEAR(f.gbps, g, 1e-6 * g);
    const CopyFit r = fit_copy(b, t(b), a, t(a));  // either order
    EXPECT_NEAR(r.overhead_ms, o, 1e-9);
  }
  // Noise that fits a negative overhead: clamped, the rate through the larger copy.
  const CopyFit c = fit_copy(10 * MB, 0.1, 100 * MB, 2.0);
  EXPECT_EQ(c.overhead_ms, 0.0);
  EXPECT_NEAR(c.gbps, 50.0, 1e-9);
}

TEST(PlanGroup, FitCopyRefusesWhatFitsNoLine) {
  EXPECT_EQ(status_of([] { fit_copy(MB, 0.1, MB, 0.2); }), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([] { fit_copy(MB, 0.0, 2 * MB, 0.2); }), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([] { fit_copy(MB, 0.1, 2 * MB, -1.0); }), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([] { fit_copy(MB, 0.3, 2 * MB, 0.2); }), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([] { fit_copy(MB, 0.1, 2 * MB, std::nan("")); }), LWO_ERR_INVALID_ARGUMENT);
}

// Every partition of the layers into runs (resident layers alone), at every
// depth, within the budget: the best prediction.
double brute_force_grouping(const std::vector<LayerCost>& layers,
                            const std::vector<bool>& resident, uint64_t budget, const Link& k,
                            const Pass& pass, const std::vector<uint32_t>& depths) {
  const uint32_t L = static_cast<uint32_t>(layers.size());
  double best = 1e300;
  for (uint32_t mask = 0; mask < (1u << (L - 1)); ++mask) {  // bit i: layers i, i+1 joined
    std::vector<Group> gs;
    bool ok = true;
    for (uint32_t l = 0; l < L; ++l) {
      if (l > 0 && (mask >> (l - 1) & 1)) {
        if (resident[l] || resident[l - 1]) ok = false;
        gs.back().count++;
      } else {
        gs.push_back(Group{l, 1, resident[l]});
      }
    }
    if (!ok) continue;
    const auto c = grouped_costs(layers, gs);
    const auto r = grouped_resident(gs);
    for (uint32_t d : depths)
      if (device_bytes(c, r, d, pass) <= budget) best = std::min(best, predict(c, r, d, k, pass).ms);
  }
  return best;
}

uint32_t covered(const std::vector<Group>& gs) {
  uint32_t next = 0;
  for (const Group& g : gs) {
    EXPECT_EQ(g.first, next);
    EXPECT_GE(g.count, 1u);
    next += g.count;
  }
  return next;
}

// L layers of mb(rng) MB taking ms(rng) forward; in a backward pass also
// 2 ms(rng) backward, with gradients of the layer's size where has_grads()
// (drawn after the layer's times).
std::vector<LayerCost> random_layers(uint32_t L, bool backward, std::mt19937_64& rng,
                                     std::uniform_int_distribution<uint64_t>& mb,
                                     std::uniform_real_distribution<double>& ms,
                                     const std::function<bool()>& has_grads) {
  std::vector<LayerCost> layers(L);
  for (LayerCost& c : layers) {
    c.bytes = mb(rng) * MB;
    c.fwd_ms = ms(rng);
    if (backward) {
      c.bwd_ms = 2 * ms(rng);
      c.grad_bytes = has_grads() ? c.bytes : 0;
    }
  }
  return layers;
}

// g covers the layers within the budget, its bytes and prediction the
// model's for its groups.
void expect_grouping_holds(const Grouping& g, const std::vector<LayerCost>& layers, uint64_t budget,
                           const Link& k, const Pass& pass) {
  EXPECT_EQ(covered(g.groups), layers.size());
  const auto c = grouped_costs(layers, g.groups);
  const auto r = grouped_resident(g.groups);
  EXPECT_LE(g.device_bytes, budget);
  EXPECT_EQ(g.device_bytes, device_bytes(c, r, g.depth, pass));
  EXPECT_NEAR(g.prediction.ms, predict(c, r, g.depth, k, pass).ms, 1e-9);
}

TEST(PlanGroup, GreedyAgainstEveryPartitionOnRandomModels) {
  std::mt19937_64 rng(16003);
  std::uniform_int_distribution<uint64_t> mb(1, 20);
  std::uniform_real_distribution<double> ms(0.0, 0.4), ov(0.0, 0.2), share(0.0, 1.5), u(0, 1);
  const std::vector<uint32_t> depths = {1, 2, 3};
  double worst = 1.0, sum = 0;
  int exact = 0;
  const int trials = 300;
  for (int trial = 0; trial < trials; ++trial) {
    const uint32_t L = 3 + trial % 5;  // 3..7 layers: up to 64 partitions
    Pass pass;
    pass.backward = trial % 2 == 1;
    const std::vector<LayerCost> layers =
        random_layers(L, pass.backward, rng, mb, ms, [&] { return u(rng) < 0.7; });
    std::vector<bool> resident(L, false);
    for (uint32_t l = 0; l < L; ++l) resident[l] = u(rng) < 0.2;
    Link k = link50();
    k.copy_overhead_ms = ov(rng);
    const uint64_t floor = device_bytes(layers, resident, 1, pass);
    uint64_t total = 0;
    for (const LayerCost& c : layers) total += c.bytes;
    const uint64_t budget = floor + static_cast<uint64_t>(share(rng) * static_cast<double>(total));
    SCOPED_TRACE("trial " + std::to_string(trial));
    const Grouping g = group(layers, resident, budget, k, pass, depths);
    expect_grouping_holds(g, layers, budget, k, pass);
    for (const Group& gr : g.groups)
      for (uint32_t l = gr.first; l < gr.first + gr.count; ++l) EXPECT_EQ(gr.resident, resident[l]);
    double ungrouped = 1e300;
    for (uint32_t d : depths)
      if (device_bytes(layers, resident, d, pass) <= budget)
        ungrouped = std::min(ungrouped, predict(layers, resident, d, k, pass).ms);
    EXPECT_LE(g.prediction.ms, ungrouped + 1e-9);
    const double best = brute_force_grouping(layers, resident, budget, k, pass, depths);
    EXPECT_GE(g.prediction.ms, best - 1e-9);
    const double ratio = g.prediction.ms / best;
    EXPECT_LE(ratio, 1.15);
    worst = std::max(worst, ratio);
    sum += ratio;
    exact += ratio < 1 + 1e-9;
  }
  std::printf("greedy grouping against every partition: %d of %d optimal, mean %.4f, worst %.4f\n",
              exact, trials, sum / trials, worst);
  EXPECT_GE(exact, trials * 9 / 10);
}

// With no per-copy overhead a link-bound pass gains nothing from grouping
// (the copies take as long, and a larger last record only delays its
// compute) unless larger slots change what the ring holds: with room for
// every group in a slot the steady state's forward is all hits.
TEST(PlanGroup, ZeroOverheadGainsOnlyThroughTheSlots) {
  const auto layers = uniform(24, 25 * MB, 0.05);
  const std::vector<bool> none(24, false);
  auto ungrouped = [&](uint64_t budget) {
    double best = 1e300;
    for (uint32_t d : {1u, 2u, 3u, 4u, 6u, 8u})
      if (device_bytes(layers, none, d, Pass{}) <= budget)
        best = std::min(best, predict(layers, none, d, link50(), Pass{}).ms);
    return best;
  };
  const Grouping g = group(layers, none, 200 * MB, link50(), Pass{});
  EXPECT_EQ(g.groups.size(), 24u);
  EXPECT_NEAR(g.prediction.ms, ungrouped(200 * MB), 1e-9);
  const Grouping h = group(layers, none, 1000 * MB, link50(), Pass{});
  EXPECT_LE(h.groups.size(), h.depth);  // every group stays in its slot
  EXPECT_EQ(h.prediction.h2d_bytes, 0u);
  EXPECT_LT(h.prediction.ms, ungrouped(1000 * MB));
  EXPECT_LE(h.device_bytes, 1000 * MB);
}

// The 144-linear shape: small records, a per-copy overhead. Grouping saves
// copies; the budget bounds the groups' size through the slots.
TEST(PlanGroup, SmallRecordsWithOverheadAreGroupedWithinTheBudget) {
  const uint32_t L = 48;
  const auto layers = uniform(L, 2 * MB, 0.01);
  Link k = link50();
  k.copy_overhead_ms = 0.004;  // 2 MB: 0.04 ms of bytes, 10% more per copy
  const std::vector<bool> none(L, false);
  const Grouping loose = group(layers, none, 400 * MB, k, Pass{});
  EXPECT_LT(loose.groups.size(), L / 4);
  const Prediction flat = predict(layers, none, 2, k, Pass{});
  EXPECT_LT(loose.prediction.ms, flat.ms - 10 * 0.004);
  EXPECT_LE(loose.device_bytes, 400 * MB);
  // A budget of 8 MB: depth 1 holds a record of at most 4 layers, depth 2 two.
  const Grouping tight = group(layers, none, 8 * MB, k, Pass{});
  EXPECT_LE(tight.device_bytes, 8 * MB);
  uint32_t largest = 0;
  for (const Group& g : tight.groups) largest = std::max(largest, g.count);
  EXPECT_LE(uint64_t(largest) * 2 * MB * tight.depth, 8 * MB);
  EXPECT_LT(tight.groups.size(), L);
  EXPECT_EQ(covered(tight.groups), L);
}

// Residents and groups together: never slower than choose() alone, within
// the budget, the groups covering the layers.
TEST(PlanGroup, ChooseGroupedIsNeverSlowerThanChoose) {
  std::mt19937_64 rng(16004);
  std::uniform_int_distribution<uint64_t> mb(1, 30);
  std::uniform_real_distribution<double> ms(0.0, 0.3), ov(0.0, 0.2), share(0.0, 1.0), u(0, 1);
  for (int trial = 0; trial < 60; ++trial) {
    const uint32_t L = 4 + trial % 12;
    Pass pass;
    pass.backward = trial % 3 == 2;
    const std::vector<LayerCost> layers = random_layers(L, pass.backward, rng, mb, ms, [] { return true; });
    Link k = link50();
    k.copy_overhead_ms = ov(rng);
    uint64_t total = 0;
    for (const LayerCost& c : layers) total += c.bytes;
    const uint64_t budget = device_bytes(layers, std::vector<bool>(L, false), 1, pass) +
                            static_cast<uint64_t>(share(rng) * static_cast<double>(total));
    SCOPED_TRACE("trial " + std::to_string(trial));
    const Plan p = choose(layers, budget, k, pass);
    const Grouping g = choose_grouped(layers, budget, k, pass);
    EXPECT_LE(g.prediction.ms, p.prediction.ms + 1e-9);
    expect_grouping_holds(g, layers, budget, k, pass);
  }
}

TEST(PlanGroup, ValidationErrors) {
  const auto layers = uniform(4, 10 * MB, 0.1);
  EXPECT_EQ(status_of([&] { group(layers, std::vector<bool>(3, false), 100 * MB, link50(), Pass{}); }),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { group(layers, std::vector<bool>(4, false), 100 * MB, link50(), Pass{}, {}); }),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { group(layers, std::vector<bool>(4, false), 100 * MB, link50(), Pass{}, {0}); }),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { group(layers, std::vector<bool>(4, false), 5 * MB, link50(), Pass{}); }),
            LWO_ERR_OVER_BUDGET);
  EXPECT_EQ(status_of([&] { grouped_costs(layers, {Group{3, 2, false}}); }), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { grouped_costs(layers, {Group{0, 0, false}}); }), LWO_ERR_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace plan
}  // namespace lwo
