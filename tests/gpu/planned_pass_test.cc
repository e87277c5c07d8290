// The planned pass as bench_plan runs it, on a small uneven
// chain: each record's resident compute time (testkit's
// ChainRun::resident_record_times) is one positive figure per record and
// half; a plan made from those times gives a ring of its depth and resident
// records; the steady-state pass through that ring moves exactly the bytes the
// plan predicts, host to device and (in a step) device to host; the measured
// stalls (StepOptions::stalls) are one finite, non-negative figure per
// position; and the pass, events and all, equals the resident computation bit
// for bit.
#include "gpu_util.h"
#include "testkit/workload.h"

namespace lwo_test {
namespace {

class PlannedPass : public GpuTest {};

// 12 linears, widths cycling over 64, 256, 512, 128, 64, 512: records of 16 KiB
// to 256 KiB of bf16.
testkit::ChainSpec uneven_chain() {
  static const int64_t kCycle[] = {64, 256, 512, 128, 64, 512};
  testkit::ChainSpec c;
  c.name = "uneven12";
  for (size_t i = 0; i < 12; ++i) c.ops.push_back({kCycle[i % 6], kCycle[(i + 1) % 6]});
  c.group(1);
  c.seed = 1601;
  return c;
}

TEST_F(PlannedPass, MovesThePlansBytesAndEqualsResident) {
  LWO_REQUIRE_GPU();
  testkit::ChainWeights W(engine_, uneven_chain());
  W.make_resident();
  const uint32_t R = W.n_records();
  uint64_t largest = 0;
  for (uint32_t r = 0; r < R; ++r) largest = std::max(largest, W.record_bytes(r));
  testkit::Stream stream = testkit::make_stream();
  for (bool step : {false, true}) {
    SCOPED_TRACE(step ? "training step" : "forward");
    testkit::ChainRun run(W, 64, stream.get(), /*trainable=*/step, LWO_DTYPE_BF16);
    run.resident_pass(step);
    const testkit::ChainRun::RecordTimes t = run.resident_record_times(step, 3);
    ASSERT_EQ(R, t.fwd_ms.size());
    ASSERT_EQ(step ? R : 0u, t.bwd_ms.size());
    for (uint32_t r = 0; r < R; ++r) {
      EXPECT_TRUE(std::isfinite(t.fwd_ms[r]) && t.fwd_ms[r] > 0) << "record " << r;
      if (step) {
        EXPECT_TRUE(std::isfinite(t.bwd_ms[r]) && t.bwd_ms[r] > 0) << "record " << r;
      }
    }

    testkit::Grads grads;
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    if (step) CHECK_LWO(lwo_grads_create(W.pool(), nullptr, &gc, grads.out()));
    // Half the model, plus the gradient staging of a step; a slow link (1 GB/s)
    // so that streamed records stall.
    lwo_plan_config pc = LWO_PLAN_CONFIG_INIT;
    pc.flags = step ? LWO_PLAN_TRAIN : 0u;
    pc.budget_bytes = W.pool_bytes() / 2 + (step ? gc.depth * largest : 0);
    pc.fwd_ms = t.fwd_ms.data();
    pc.bwd_ms = step ? t.bwd_ms.data() : nullptr;
    pc.grad_depth = gc.depth;
    pc.h2d_gbps = pc.d2h_gbps = 1.0;
    testkit::Plan plan;
    CHECK_LWO(lwo_plan_create(W.pool(), &pc, plan.out()));
    lwo_plan_info info{};
    info.size = sizeof info;
    CHECK_LWO(lwo_plan_get_info(plan.get(), &info));
    EXPECT_LT(info.n_resident, R);  // something streams at half the model
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    CHECK_LWO(lwo_plan_ring_config(plan.get(), &rc));
    Ring ring;
    CHECK_LWO(lwo_ring_create(W.pool(), &rc, ring.out()));
    lwo_ring_info ri{};
    ri.size = sizeof ri;
    CHECK_LWO(lwo_ring_get_info(ring.get(), &ri));
    EXPECT_EQ(info.depth, ri.depth);
    EXPECT_EQ(info.n_resident, ri.n_resident);
    const std::vector<uint32_t> order = testkit::step_order(R, step);
    Schedule schedule;
    CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()),
                                  schedule.out()));
    testkit::StepOptions o;
    o.backward = step;
    run.streamed_pass(schedule.get(), ring.get(), grads.get(), o);  // to the steady state
    o.stalls = true;
    const testkit::StepStats st = run.streamed_pass(schedule.get(), ring.get(), grads.get(), o);
    EXPECT_EQ(info.h2d_bytes, st.h2d_bytes);
    if (step) {
      EXPECT_EQ(info.d2h_bytes, st.d2h_bytes);
    }
    ASSERT_EQ(order.size(), st.stall_ms.size());
    for (size_t i = 0; i < order.size(); ++i)
      EXPECT_TRUE(std::isfinite(st.stall_ms[i]) && st.stall_ms[i] >= 0) << "position " << i;
    const testkit::ChainCheck same = run.compare_with_resident(grads.get(), step);
    EXPECT_TRUE(same.same) << same.what << ": " << same.first;
    CHECK_LWO(schedule.reset());
    CHECK_LWO(ring.reset());
    CHECK_LWO(grads.reset());
  }
}

}  // namespace
}  // namespace lwo_test
