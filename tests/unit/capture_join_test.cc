// Joining a CUDA graph capture the caller began (lwo_ring_capture_join /
// _leave / _release) on the recording backend: the test plays the framework
// (caller_capture_begin in global mode, caller_capture_end, graph_launch as
// its own cudaGraphLaunch). The ring's host waits at the join run with the
// thread's capture mode relaxed; its transfer stream is joined back at the
// leave, so the caller's capture ends; each replay moves the pool's bytes as
// they are at the launch and is checked against the work around it; the
// caller's graph holds the ring, and its resident layers, until the release,
// whose stream orders the ring's later copies after the replays; and every
// misuse gets its status, leaving every object usable.
#include "capture_fixture.h"

namespace lwo {
namespace testing {
namespace {

class CaptureJoin : public CaptureFixture {
 protected:
  // An f32 gradient set of `pool` and an SGD optimizer over it with `flags`.
  void make_sgd(lwo_pool* pool, uint32_t flags, lwo_grads** grads, lwo_optim** optim) {
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    gc.flags = LWO_GRADS_F32;
    ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, grads));
    lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
    oc.kind = LWO_OPTIM_SGD;
    oc.flags = flags;
    ASSERT_LWO(lwo_optim_create(*grads, &oc, optim));
  }
  // New random bytes for the first tensor of `layer` ("weight").
  lwo_status_t rewrite(lwo_pool* pool, uint32_t layer, uint64_t seed) {
    void* data = nullptr;
    uint64_t bytes = 0;
    EXPECT_EQ(lwo_pool_tensor_host(pool, layer, "weight", &data, &bytes), LWO_OK) << msg();
    std::vector<uint8_t> b(bytes);
    fill_random(b.data(), b.size(), seed);
    return lwo_pool_write(pool, layer, "weight", b.data(), b.size());
  }
};

// A pass over 3 layers in a ring of depth 2, captured inside the caller's
// own capture and replayed by the caller's launches (layer 1 rewritten before
// each): each launch copies the bytes the pool holds then; the ring refuses
// eager use until lwo_ring_capture_release, after which an eager pass is
// ordered after the replays and finds every layer.
TEST_F(CaptureJoin, AJoinedPassIsReplayedByTheCallersLaunches) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  StreamH s = gpu->new_stream();
  pass(ring, s, {0, 1, 2}, pool);  // eager: the join must wait for it
  gpu->caller_capture_begin(s);
  ASSERT_LWO(lwo_ring_capture_join(ring, stream(s)));
  const uint64_t copies_before = gpu->stats.copies;
  const std::vector<const uint8_t*> bases = pass(ring, s, {0, 1, 2});
  EXPECT_EQ(lwo_engine_synchronize(engine), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "lwo_ring_capture_leave")) << msg();
  ASSERT_LWO(lwo_ring_capture_leave(ring, stream(s)));
  void* g = caller_end(s);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(gpu->stats.copies - copies_before, 3u);
  EXPECT_EQ(gpu->graph_ops().size(), 3u);
  uint64_t b1 = 0, b2 = 0;
  const uint8_t* h1 = host_of(pool, 1, &b1);
  const uint8_t* h2 = host_of(pool, 2, &b2);
  for (int k = 0; k < 3; ++k) {
    ASSERT_LWO(rewrite(pool, 1, 50 + k));
    std::memset(const_cast<uint8_t*>(bases[1]), 0, b1);
    std::memset(const_cast<uint8_t*>(bases[2]), 0, b2);
    gpu->graph_launch(g, s);  // the caller's cudaGraphLaunch
    EXPECT_EQ(0, std::memcmp(bases[1], h1, b1)) << "launch " << k;
    EXPECT_EQ(0, std::memcmp(bases[2], h2, b2)) << "launch " << k;
  }
  // The caller's graph holds the ring.
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(ring, 0, &t), LWO_ERR_BUSY);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_stage: staging a layer: the ring belongs to a CUDA "
                                 "graph the caller captured")) << msg();
  EXPECT_TRUE(contains(msg(), "lwo_ring_capture_release")) << msg();
  EXPECT_EQ(lwo_ring_destroy(ring), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "lwo_ring_capture_release")) << msg();
  EXPECT_EQ(lwo_ring_capture_join(ring, stream(s)), LWO_ERR_BUSY);
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  EXPECT_EQ(lwo_ring_capture_release(ring, stream(s)), LWO_ERR_CAPTURING);
  pass(ring, s, {2, 0, 1}, pool);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(ring, pool);
}

// A warm ring's pass 0 1 2 (LWO_RING_CAPTURE_WARM, depth 2) joined after an
// eager pass 0 1: the capture hits layers 0 and 1, copies layer 2 and then
// layer 0 back into its slot; the leave ends the ring's part with an event
// record node (there is host work before the next launch), and
// lwo_ring_capture_replay copies layer 1 before the caller's launch once the
// pool's bytes of it changed, after the last replay.
TEST_F(CaptureJoin, AWarmJoinedPassIsFilledBeforeEachAnnouncedLaunch) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2, LWO_RING_CAPTURE_WARM);
  StreamH s = gpu->new_stream();
  pass(ring, s, {0, 1}, pool);
  const uint64_t copies_before = gpu->stats.copies;
  std::vector<const uint8_t*> bases;
  void* g = capture_joined(ring, s, [&] { bases = pass(ring, s, {0, 1, 2}); });
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(gpu->stats.copies - copies_before, 2u);
  const auto& ops = gpu->graph_ops();
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[0].kind, RecordingBackend::GraphOp::Copy);
  EXPECT_EQ(ops[1].kind, RecordingBackend::GraphOp::Copy);
  EXPECT_EQ(ops[2].kind, RecordingBackend::GraphOp::EventRecord);
  uint64_t b0 = 0, b1 = 0;
  const uint8_t* h0 = host_of(pool, 0, &b0);
  const uint8_t* h1 = host_of(pool, 1, &b1);
  const uint64_t refills[] = {0, 0, 1, 0};
  for (int k = 0; k < 4; ++k) {
    if (k == 2) ASSERT_LWO(rewrite(pool, 1, 80 + k));
    const uint64_t eager_copies = gpu->stats.copies;
    ASSERT_LWO(lwo_ring_capture_replay(ring, stream(s)));
    EXPECT_EQ(gpu->stats.copies - eager_copies, refills[k]) << "launch " << k;
    EXPECT_EQ(0, std::memcmp(bases[1], h1, b1)) << "launch " << k;
    gpu->graph_launch(g, s);
    EXPECT_EQ(0, std::memcmp(bases[0], h0, b0)) << "launch " << k;
    EXPECT_EQ(0, std::memcmp(bases[1], h1, b1)) << "launch " << k;
  }
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  pass(ring, s, {2, 1, 0}, pool);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(ring, pool);
}

// Between the leave and the caller's end of its capture the engine's transfer
// stream is still a stream of that capture: another ring's stage, the
// engine's synchronize, a gradient's begin and the release are LWO_ERR_CAPTURING (naming the
// leave and cudaStreamEndCapture), and nothing of them is captured into the
// caller's graph; once the caller ends it, each goes through.
TEST_F(CaptureJoin, UntilTheCallerEndsItsCaptureTheEnginesWorkIsRefused) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_ring* other = make_ring(pool, 1);
  lwo_grads* grads = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &grads));
  StreamH s = gpu->new_stream();
  StreamH c = gpu->new_stream();
  gpu->caller_capture_begin(s);
  ASSERT_LWO(lwo_ring_capture_join(ring, stream(s)));
  pass(ring, s, {0, 1});
  ASSERT_LWO(lwo_ring_capture_leave(ring, stream(s)));
  const uint64_t copies = gpu->stats.copies;
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(other, 2, &t), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "left a capture the caller began (lwo_ring_capture_leave) that "
                              "has not ended")) << msg();
  EXPECT_TRUE(contains(msg(), "cudaStreamEndCapture")) << msg();
  EXPECT_EQ(lwo_engine_synchronize(engine), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "has not ended")) << msg();
  lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_grads_begin(grads, 0, stream(c), &gv), LWO_ERR_CAPTURING);
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_begin: a gradient's begin: ring ")) << msg();
  EXPECT_EQ(lwo_ring_capture_release(ring, stream(c)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "has not ended")) << msg();
  EXPECT_EQ(gpu->stats.copies, copies);  // nothing went into the caller's capture
  void* g = caller_end(s);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(gpu->graph_ops().size(), 2u);  // the pass's two copies alone
  ASSERT_LWO(lwo_ring_stage(other, 2, &t));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_acquire(other, t, stream(c), &v));
  EXPECT_TRUE(holds_layer(pool, v));
  ASSERT_LWO(lwo_ring_release(other, t, stream(c)));
  ASSERT_LWO(lwo_engine_synchronize(engine));
  ASSERT_LWO(lwo_grads_begin(grads, 0, stream(c), &gv));
  ASSERT_LWO(lwo_grads_end(grads, 0, stream(c)));
  ASSERT_LWO(lwo_grads_wait(grads));
  gpu->graph_launch(g, s);
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  pass(ring, s, {2, 0}, pool);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(grads, other, ring, pool);
}

// A schedule of the ring drives the joined capture (forward and backward over
// 4 layers in a ring of depth 2 with layer 2 resident); its next is
// LWO_ERR_BUSY while the caller's graph holds the ring, and after the release
// it drives eager passes again.
TEST_F(CaptureJoin, AScheduleDrivesAJoinedCapture) {
  lwo_pool* pool = make_pool(4);
  lwo_ring* ring = resident_ring(pool, 2, {2});
  StreamH s = gpu->new_stream();
  const uint32_t order[] = {0, 1, 2, 3, 3, 2, 1, 0};
  lwo_schedule* sch = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 8, &sch));
  auto drive = [&](lwo_pool* check) {
    std::vector<lwo_layer_view> views;
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    lwo_status_t st;
    while ((st = lwo_schedule_next(sch, stream(s), &v)) == LWO_OK) {
      if (check) {
        EXPECT_TRUE(holds_layer(check, v)) << "layer " << v.layer;
      }
      gpu->read(s, v.base, v.record_bytes);
      views.push_back(v);
    }
    EXPECT_EQ(st, LWO_END) << msg();
    return views;
  };
  EXPECT_EQ(drive(pool).size(), 8u);
  ASSERT_LWO(lwo_schedule_reset(sch, stream(s)));
  gpu->caller_capture_begin(s);
  ASSERT_LWO(lwo_ring_capture_join(ring, stream(s)));
  const std::vector<lwo_layer_view> views = drive(nullptr);
  ASSERT_EQ(views.size(), 8u);
  ASSERT_LWO(lwo_ring_capture_leave(ring, stream(s)));
  void* g = caller_end(s);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(views[2].base, views[5].base);  // the resident slot, both times
  for (const auto& op : gpu->graph_ops()) EXPECT_NE(op.dst, views[2].base);
  for (int k = 0; k < 3; ++k) {
    ASSERT_LWO(rewrite(pool, 0, 80 + k));
    gpu->graph_launch(g, s);
    uint64_t b0 = 0;
    const uint8_t* h0 = host_of(pool, 0, &b0);
    EXPECT_EQ(0, std::memcmp(views[7].base, h0, b0)) << "launch " << k;
  }
  ASSERT_LWO(lwo_schedule_reset(sch, stream(s)));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_schedule_next(sch, stream(s), &v), LWO_ERR_BUSY);
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  EXPECT_EQ(drive(pool).size(), 8u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(sch, ring, pool);
}

// Resident layers while a caller's graph holds the ring: the join uploads the
// one changed before it; the graph copies nothing into resident slots; from
// the join to the release a change of a resident layer (lwo_pool_write,
// lwo_pool_layer_changed) is LWO_ERR_BUSY with nothing written, while
// streamed layers may change between replays; after the release the change
// goes through and the next stage uploads it.
TEST_F(CaptureJoin, ResidentLayersAreHeldUntilTheRelease) {
  lwo_pool* pool = make_pool(4);
  lwo_ring* ring = resident_ring(pool, 2, {1, 3});
  StreamH s = gpu->new_stream();
  pass(ring, s, {0, 1, 2, 3}, pool);
  ASSERT_LWO(rewrite(pool, 3, 7));
  const lwo_ring_stats st0 = ring_stats(ring);
  gpu->caller_capture_begin(s);
  ASSERT_LWO(lwo_ring_capture_join(ring, stream(s)));
  EXPECT_EQ(ring_stats(ring).n_resident_uploads - st0.n_resident_uploads, 1u);
  uint64_t b1 = 0;
  const uint8_t* h1 = host_of(pool, 1, &b1);
  const std::vector<uint8_t> old1(h1, h1 + b1);
  EXPECT_EQ(rewrite(pool, 1, 8), LWO_ERR_BUSY);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_write: writing the layer: layer 1 is resident in a "
                                 "ring")) << msg();
  EXPECT_TRUE(contains(msg(), "lwo_ring_capture_release")) << msg();
  EXPECT_EQ(0, std::memcmp(h1, old1.data(), b1));  // nothing written
  const std::vector<const uint8_t*> bases = pass(ring, s, {0, 1, 2, 3});
  ASSERT_LWO(lwo_ring_capture_leave(ring, stream(s)));
  void* g = caller_end(s);
  ASSERT_NE(g, nullptr);
  ASSERT_EQ(gpu->graph_ops().size(), 2u);  // layers 0 and 2
  EXPECT_EQ(lwo_pool_layer_changed(pool, 3), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "layer 3 is resident")) << msg();
  for (int k = 0; k < 2; ++k) {
    ASSERT_LWO(rewrite(pool, 2, 60 + k));  // streamed: seen by the next replay
    gpu->graph_launch(g, s);
    for (uint32_t l = 0; l < 4; ++l) {
      uint64_t b = 0;
      const uint8_t* h = host_of(pool, l, &b);
      EXPECT_EQ(0, std::memcmp(bases[l], h, b)) << "launch " << k << " layer " << l;
    }
  }
  EXPECT_EQ(rewrite(pool, 1, 9), LWO_ERR_BUSY);
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  ASSERT_LWO(rewrite(pool, 1, 10));
  const lwo_ring_stats before = ring_stats(ring);
  pass(ring, s, {1, 3}, pool);
  EXPECT_EQ(ring_stats(ring).n_resident_uploads - before.n_resident_uploads, 1u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(ring, pool);
}

// The host optimizer may not update a held resident layer: after an eager
// step whose gradients reach layers 0 and 1 (1 resident), a joined capture's
// graph holds the ring; lwo_optim_step and lwo_optim_step_open are
// LWO_ERR_BUSY naming layer 1 and start nothing, and so is writing layer 1's
// masters; after the release the step runs and the next stage uploads the
// updated layer.
TEST_F(CaptureJoin, TheOptimizerMayNotUpdateAHeldResidentLayer) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = resident_ring(pool, 1, {1});
  lwo_grads* grads = nullptr;
  lwo_optim* optim = nullptr;
  make_sgd(pool, 0, &grads, &optim);
  ASSERT_FALSE(HasFatalFailure());
  StreamH s = gpu->new_stream();
  ASSERT_LWO(lwo_grads_zero(grads));
  for (uint32_t l : {1u, 0u}) {
    lwo_layer_view g = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(grads, l, stream(s), &g));
    std::memset(g.base, 0, g.record_bytes);
    gpu->write(s, g.base, g.record_bytes);
    ASSERT_LWO(lwo_grads_end(grads, l, stream(s)));
  }
  ASSERT_LWO(lwo_grads_wait(grads));
  void* g = capture_joined(ring, s, [&] { pass(ring, s, {0, 1, 2}); });
  ASSERT_NE(g, nullptr);
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.step = 1;
  EXPECT_EQ(lwo_optim_step(optim, &p), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "layer 1 is resident")) << msg();
  EXPECT_EQ(lwo_optim_step_open(optim, &p, 1), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "layer 1 is resident")) << msg();
  lwo_optim_info info{};
  info.size = sizeof info;
  ASSERT_LWO(lwo_optim_get_info(optim, &info));
  EXPECT_EQ(info.last_step, 0u);  // nothing started
  std::vector<float> master(74);
  EXPECT_EQ(lwo_optim_write(optim, 1, "bias", LWO_OPTIM_MASTER, master.data(), 74 * 4),
            LWO_ERR_BUSY);
  gpu->graph_launch(g, s);
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  ASSERT_LWO(lwo_optim_step(optim, &p));
  ASSERT_LWO(lwo_optim_wait(optim));
  pass(ring, s, {1, 0}, pool);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  ASSERT_LWO(lwo_optim_destroy(optim));
  destroy(grads, ring, pool);
}

// A delayed optimizer's lwo_optim_wait keeps a held resident layer's update
// in its masters: layers 0 and 1 (1 resident) zero, a gradient of ones each,
// SGD at lr 1 with LWO_OPTIM_DELAYED; the step starts before the join, and
// the wait during the caller's graph writes layer 0's -1s into the pool, not
// layer 1's, and is LWO_ERR_BUSY naming layer 1; after the release a wait
// writes layer 1's, and the next stage uploads them.
TEST_F(CaptureJoin, ADelayedOptimizersWaitKeepsAHeldLayersUpdate) {
  lwo_pool* pool = make_pool(3);
  for (uint32_t l : {0u, 1u}) {
    lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
    for (uint32_t t = 0; t < (l % 2 ? 2u : 1u); ++t) {
      ASSERT_LWO(lwo_pool_tensor_info(pool, l, t, &ti));
      const std::vector<uint8_t> zero(ti.bytes, 0);
      ASSERT_LWO(lwo_pool_write(pool, l, ti.name, zero.data(), zero.size()));
    }
  }
  lwo_ring* ring = resident_ring(pool, 1, {1});
  lwo_grads* grads = nullptr;
  lwo_optim* optim = nullptr;
  make_sgd(pool, LWO_OPTIM_DELAYED, &grads, &optim);
  ASSERT_FALSE(HasFatalFailure());
  StreamH s = gpu->new_stream();
  ASSERT_LWO(lwo_grads_zero(grads));
  for (uint32_t l : {1u, 0u}) {
    lwo_layer_view g = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(grads, l, stream(s), &g));
    std::vector<float> ones(g.record_bytes / 4, 1.0f);
    std::memcpy(g.base, ones.data(), ones.size() * 4);
    gpu->write(s, g.base, g.record_bytes);
    ASSERT_LWO(lwo_grads_end(grads, l, stream(s)));
  }
  ASSERT_LWO(lwo_grads_wait(grads));
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.step = 1;
  p.lr = 1;
  p.weight_decay = 0;
  ASSERT_LWO(lwo_optim_step(optim, &p));
  // The first bf16 of each layer's weight: 0, or -1 (0xbf80) once updated.
  auto first = [&](uint32_t l) {
    void* data = nullptr;
    uint64_t bytes = 0;
    EXPECT_EQ(lwo_pool_tensor_host(pool, l, "weight", &data, &bytes), LWO_OK) << msg();
    uint16_t v = 0;
    std::memcpy(&v, data, 2);
    return v;
  };
  void* g = capture_joined(ring, s, [&] { pass(ring, s, {0, 1, 2}); });
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(lwo_optim_wait(optim), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "layer 1's update stays in the masters")) << msg();
  EXPECT_EQ(first(0), 0xbf80u);
  EXPECT_EQ(first(1), 0u);
  gpu->graph_launch(g, s);
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  ASSERT_LWO(lwo_optim_wait(optim));
  EXPECT_EQ(first(1), 0xbf80u);
  pass(ring, s, {1, 0}, pool);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  ASSERT_LWO(lwo_optim_destroy(optim));
  destroy(grads, ring, pool);
}

// Misuse, each with its status and nothing changed: a join on a stream that
// is not capturing, on NULL, of a timed ring, of a second ring; a
// lwo_ring_capture_begin on a stream the caller captures; a leave or release
// with nothing joined; lwo_ring_capture_end of a joined ring; a leave on
// another stream or with a ticket live (then released in the capture and
// left); a release before the leave, or on a stream that captures. (Gradient
// sets in a joined capture: capture_test.cc, CaptureJoinTrain.)
TEST_F(CaptureJoin, MisuseGetsItsStatusAndChangesNothing) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_ring* other = make_ring(pool, 1);
  lwo_ring* timed = make_ring(pool, 1, LWO_RING_TIMING);
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.flags = LWO_GRADS_F32;
  lwo_grads* grads = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &grads));
  StreamH s = gpu->new_stream(), s2 = gpu->new_stream();
  EXPECT_EQ(lwo_ring_capture_join(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_capture_join: stream ")) << msg();
  EXPECT_TRUE(contains(msg(), "is not capturing")) << msg();
  EXPECT_EQ(lwo_ring_capture_leave(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "in no capture")) << msg();
  EXPECT_EQ(lwo_ring_capture_release(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "belongs to no CUDA graph the caller captured")) << msg();

  gpu->caller_capture_begin(s);
  EXPECT_EQ(lwo_ring_capture_join(ring, nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_ring_capture_join(timed, stream(s)), LWO_ERR_UNSUPPORTED);
  EXPECT_TRUE(contains(msg(), "LWO_RING_TIMING")) << msg();
  EXPECT_EQ(lwo_ring_capture_begin(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "already capturing (a capture the caller began): join it with "
                              "lwo_ring_capture_join")) << msg();
  ASSERT_LWO(lwo_ring_capture_join(ring, stream(s)));
  EXPECT_EQ(lwo_ring_capture_join(other, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "has joined a CUDA graph capture")) << msg();
  EXPECT_EQ(lwo_ring_capture_join(ring, stream(s)), LWO_ERR_CAPTURING);
  lwo_graph* graph = bogus<lwo_graph>();
  EXPECT_EQ(lwo_ring_capture_end(ring, stream(s), &graph), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "leave it with lwo_ring_capture_leave")) << msg();
  EXPECT_EQ(graph, nullptr);
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(other, 0, &t), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "lwo_ring_capture_leave")) << msg();
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_acquire(ring, t, stream(s), &v));
  gpu->read(s, v.base, v.record_bytes);
  EXPECT_EQ(lwo_ring_capture_leave(ring, stream(s2)), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(msg(), "is not the stream")) << msg();
  EXPECT_EQ(lwo_ring_capture_leave(ring, stream(s)), LWO_ERR_TICKET_STATE);
  EXPECT_TRUE(contains(msg(), "release every ticket in the capture, then leave it")) << msg();
  EXPECT_EQ(lwo_ring_capture_release(ring, stream(s2)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "leave it first")) << msg();
  EXPECT_EQ(lwo_engine_synchronize(engine), LWO_ERR_CAPTURING);  // still joined
  ASSERT_LWO(lwo_ring_release(ring, t, stream(s)));
  ASSERT_LWO(lwo_ring_capture_leave(ring, stream(s)));
  void* g = caller_end(s);
  ASSERT_NE(g, nullptr);
  gpu->graph_launch(g, s);
  gpu->graph_destroy(g);
  // A release on a stream that captures would put its event in that capture.
  gpu->caller_capture_begin(s2);
  EXPECT_EQ(lwo_ring_capture_release(ring, stream(s2)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "is capturing")) << msg();
  void* empty = caller_end(s2);
  gpu->graph_destroy(empty);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  // Everything is usable: the rings stage, the set takes a gradient.
  pass(ring, s, {1, 0}, pool);
  pass(other, s2, {2}, pool);
  lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(grads, 0, stream(s), &gv));
  gpu->write(s, gv.base, gv.record_bytes);
  ASSERT_LWO(lwo_grads_end(grads, 0, stream(s)));
  ASSERT_LWO(lwo_grads_wait(grads));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(grads, timed, other, ring, pool);
}

// The caller's capture ends without the leave (CUDA fails it: the transfer
// stream was not joined back), or is invalidated: the leave is
// LWO_ERR_CAPTURING, drops the ring's part (its live ticket ends, as do a
// resident layer's hold), and the ring stages eagerly again.
TEST_F(CaptureJoin, ACallersCaptureEndedFirstDropsTheRingsPart) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = resident_ring(pool, 2, {2});
  StreamH s = gpu->new_stream();
  for (const bool invalidate : {false, true}) {
    SCOPED_TRACE(invalidate ? "invalidated" : "ended");
    gpu->caller_capture_begin(s);
    ASSERT_LWO(lwo_ring_capture_join(ring, stream(s)));
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
    end_before_leave(ring, s, invalidate);
    EXPECT_EQ(state(ring, t), LWO_TICKET_ENDED);
    ASSERT_LWO(rewrite(pool, 2, 5));  // not held any more
    pass(ring, s, {0, 1, 2}, pool);
  }
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(ring, pool);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
