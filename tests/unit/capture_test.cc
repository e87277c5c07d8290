// CUDA graphs of a ring's passes (lwo_ring_capture_begin / _end,
// lwo_graph_launch / _destroy) on the recording backend, whose capture keeps
// the copies as enqueued and runs them at each launch: a replay moves the
// pool's bytes as they are at the launch, never before; nothing a capture
// enqueues waits on work from outside it, and no eager call waits on an event
// of an ended capture; the ring belongs to the graph until it is destroyed,
// then stages copy again; and the refusals, each with its status, leaving
// every object usable.
#include <chrono>
#include <functional>
#include <thread>

#include "capture_fixture.h"
#include "bindings/c/lwo_test.h"

namespace lwo {
namespace testing {
namespace {

class Capture : public CaptureFixture {
 protected:
  // Drives `sch` to its end on `s`: each view's slot is read on `s` (and,
  // with `pool`, must hold its layer's host bytes); returns the views.
  std::vector<lwo_layer_view> drive(lwo_schedule* sch, StreamH s, lwo_pool* pool) {
    std::vector<lwo_layer_view> views;
    for (;;) {
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      const lwo_status_t st = lwo_schedule_next(sch, stream(s), &v);
      if (st == LWO_END) break;
      EXPECT_EQ(st, LWO_OK) << msg();
      if (st != LWO_OK) break;
      if (pool) {
        EXPECT_TRUE(holds_layer(pool, v)) << "layer " << v.layer;
      }
      gpu->read(s, v.base, v.record_bytes);
      views.push_back(v);
    }
    return views;
  }
  // A gradient as the backward wrote it: its staging slot and each tensor's
  // offset in it (a view's tensors change at the layer's next begin).
  struct GradEnd {
    uint32_t layer;
    uint8_t* base;
    uint64_t bytes;
    std::vector<uint64_t> offsets;
  };
  static GradEnd grad_end(const lwo_layer_view& g) {
    GradEnd e{g.layer, static_cast<uint8_t*>(g.base), g.record_bytes, {}};
    for (uint32_t k = 0; k < g.n_tensors; ++k)
      e.offsets.push_back(static_cast<uint64_t>(static_cast<uint8_t*>(g.tensors[k]) - e.base));
    return e;
  }
  // A training step's calls on `s`: a forward over 0..n-1, then for each
  // entry of `bwd` its layer staged, acquired and read, its gradient begun,
  // written by write(i, end) (the backward kernel, which in a capture only
  // declares the write: a launch copies what the slot holds then) and
  // ended, and the layer released.
  std::vector<GradEnd> train_step(lwo_ring* ring, lwo_grads* grads, StreamH s, uint32_t n,
                                  const std::vector<uint32_t>& bwd,
                                  const std::function<void(size_t, const GradEnd&)>& write) {
    std::vector<uint32_t> fwd(n);
    for (uint32_t l = 0; l < n; ++l) fwd[l] = l;
    pass(ring, s, fwd);
    std::vector<GradEnd> ends;
    for (size_t i = 0; i < bwd.size(); ++i) {
      lwo_ticket t{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT, g = LWO_LAYER_VIEW_INIT;
      EXPECT_EQ(lwo_ring_stage(ring, bwd[i], &t), LWO_OK) << msg();
      EXPECT_EQ(lwo_ring_acquire(ring, t, stream(s), &v), LWO_OK) << msg();
      gpu->read(s, v.base, v.record_bytes);
      EXPECT_EQ(lwo_grads_begin(grads, bwd[i], stream(s), &g), LWO_OK) << msg();
      GradEnd e = grad_end(g);
      gpu->write(s, g.base, g.record_bytes);
      write(i, e);
      EXPECT_EQ(lwo_grads_end(grads, bwd[i], stream(s)), LWO_OK) << msg();
      EXPECT_EQ(lwo_ring_release(ring, t, stream(s)), LWO_OK) << msg();
      ends.push_back(std::move(e));
    }
    return ends;
  }
  // The f32 values the backward writes into end i's slot in step k: small
  // whole numbers, so that sums are exact.
  static float grad_value(uint64_t k, size_t i, uint64_t j) {
    return static_cast<float>(static_cast<int64_t>((k * 13 + i * 5 + j) % 97) - 48);
  }
  // The training step of GradientsOfACapturedStepLandAtEachLaunch and its
  // joined twin: 3 layers, a ring of depth 2, f32 host gradients (depth 4),
  // the backward {2, 1, 1, 0} (layer 1's gradient twice, the second added).
  struct TrainSet {
    lwo_pool* pool = nullptr;
    lwo_ring* ring = nullptr;
    lwo_grads* grads = nullptr;
    StreamH s = nullptr;
    std::vector<uint32_t> bwd = {2, 1, 1, 0};
  };
  // A gradient set over every layer of `pool`, f32 on the host, with
  // `depth` staging slots (0: the default).
  lwo_grads* f32_grads(lwo_pool* pool, uint32_t depth = 0) {
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    gc.flags = LWO_GRADS_F32;
    if (depth) gc.depth = depth;
    lwo_grads* g = nullptr;
    EXPECT_EQ(lwo_grads_create(pool, nullptr, &gc, &g), LWO_OK) << msg();
    return g;
  }
  // Makes the set and runs one eager step of it (gradients 0).
  void train_set(TrainSet* t) {
    t->pool = make_pool(3);
    t->ring = make_ring(t->pool, 2);
    ASSERT_TRUE(t->grads = f32_grads(t->pool, 4));
    t->s = gpu->new_stream();
    eager_train_step(*t, 0);
  }
  // One eager step with gradients k; the host gradients checked.
  void eager_train_step(const TrainSet& t, uint64_t k) {
    ASSERT_LWO(lwo_grads_zero(t.grads));
    const std::vector<GradEnd> ends = train_step(
        t.ring, t.grads, t.s, 3, t.bwd, [&](size_t i, const GradEnd& e) { write_grad(k, i, e); });
    ASSERT_LWO(lwo_grads_wait(t.grads));
    expect_host_grads(t.grads, t.pool, ends, k);
  }

  // Five replays of t's captured step, each after lwo_grads_zero and launched
  // by `launch`, land that replay's slot bytes, summed, in the host
  // gradients (the third's host work comes late: lwo_grads_wait waits for it).
  void five_replays(const TrainSet& t, const std::vector<GradEnd>& ends,
                    const lwo_grads_stats& before, const std::function<lwo_status_t()>& launch) {
    for (uint64_t k = 1; k <= 5; ++k) {
      ASSERT_LWO(lwo_grads_zero(t.grads));
      for (size_t i = 0; i < ends.size(); ++i) write_grad(k, i, ends[i]);
      const RecordingBackend::Stats st = gpu->stats;
      gpu->pause_at_host_func = k == 3;  // the fence waits for the replay's host work
      ASSERT_LWO(launch());
      gpu->pause_at_host_func = false;
      ASSERT_LWO(lwo_grads_wait(t.grads));
      expect_host_grads(t.grads, t.pool, ends, k);
      EXPECT_EQ(gpu->stats.replayed_d2h_copies - st.replayed_d2h_copies, 4u);
      EXPECT_EQ(gpu->stats.replayed_host_funcs - st.replayed_host_funcs, 5u);
      EXPECT_EQ(grads_stats(t.grads).n_transfers, before.n_transfers + 4 * k);
    }
  }

  static void write_grad(uint64_t k, size_t i, const GradEnd& e) {
    std::vector<float> v(e.bytes / 4);
    for (uint64_t j = 0; j < v.size(); ++j) v[j] = grad_value(k, i, j);
    std::memcpy(e.base, v.data(), v.size() * 4);
  }
  // Each host gradient (f32) equals the sum of step k's writes of its layer.
  void expect_host_grads(lwo_grads* grads, lwo_pool* pool, const std::vector<GradEnd>& ends,
                         uint64_t k) {
    for (size_t i = 0; i < ends.size(); ++i) {
      bool first = true;
      for (size_t j = 0; j < i; ++j) first &= ends[j].layer != ends[i].layer;
      if (!first) continue;
      const uint32_t l = ends[i].layer;
      for (size_t t = 0; t < ends[i].offsets.size(); ++t) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        ASSERT_LWO(lwo_pool_tensor_info(pool, l, static_cast<uint32_t>(t), &ti));
        lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
        ASSERT_LWO(lwo_grads_tensor(grads, l, ti.name, &gt));
        ASSERT_EQ(gt.dtype, LWO_DTYPE_F32);
        const float* got = static_cast<const float*>(gt.data);
        for (uint64_t x = 0; x < gt.n_elements; ++x) {
          float want = 0;
          for (size_t j = i; j < ends.size(); ++j)
            if (ends[j].layer == l) want += grad_value(k, j, ends[j].offsets[t] / 4 + x);
          ASSERT_EQ(got[x], want) << "step " << k << " layer " << l << " tensor " << t
                                  << " element " << x;
        }
      }
    }
  }
  // New random bytes for the pool's `layer`, written with lwo_pool_write.
  void rewrite(lwo_pool* pool, uint32_t layer, uint64_t seed) {
    lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
    for (uint32_t t = 0; lwo_pool_tensor_info(pool, layer, t, &ti) == LWO_OK; ++t) {
      std::vector<uint8_t> b(ti.bytes);
      fill_random(b.data(), b.size(), seed + t);
      ASSERT_LWO(lwo_pool_write(pool, layer, ti.name, b.data(), b.size()));
    }
  }
  lwo_grads_stats grads_stats(lwo_grads* grads) {
    lwo_grads_stats st{};
    st.size = sizeof st;
    EXPECT_EQ(lwo_grads_get_stats(grads, &st), LWO_OK) << msg();
    return st;
  }
};

// Captured passes over 3 layers in a ring of depth 2 (layer 2 reuses layer
// 0's slot): the capture copies nothing; each launch copies the bytes the
// pool holds then (layer 1 rewritten between launches), into the slots the
// capture chose; after the graph, stages copy again (no hit on what the
// graph left), ordered without any event of the capture.
TEST_F(Capture, ReplaysMoveThePoolsBytesAtEachLaunch) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  StreamH s = gpu->new_stream();
  pass(ring, s, {0, 1, 2});  // eager: the slots hold layers 2 and 1
  const uint64_t copies_before = gpu->stats.copies;
  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  const std::vector<const uint8_t*> bases = pass(ring, s, {0, 1, 2});
  lwo_graph* graph = nullptr;
  ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));
  ASSERT_NE(graph, nullptr);
  // Every layer was a copy in the capture (the slots were taken as empty),
  // and none ran: slot 0 still holds layer 2 from the eager pass.
  EXPECT_EQ(gpu->stats.copies - copies_before, 3u);
  EXPECT_EQ(bases[0], bases[2]);
  EXPECT_NE(bases[0], bases[1]);
  uint64_t b2 = 0, b1 = 0;
  const uint8_t* h2 = host_of(pool, 2, &b2);
  const uint8_t* h1 = host_of(pool, 1, &b1);
  EXPECT_EQ(0, std::memcmp(bases[2], h2, b2));  // the eager pass's bytes, untouched
  // A launch copies 0 then 2 into slot 0 and 1 into slot 1.
  std::memset(const_cast<uint8_t*>(bases[0]), 0, b2);
  std::memset(const_cast<uint8_t*>(bases[1]), 0, b1);
  ASSERT_LWO(lwo_graph_launch(graph, stream(s)));
  EXPECT_EQ(gpu->launches, 1u);
  EXPECT_EQ(0, std::memcmp(bases[2], h2, b2));
  EXPECT_EQ(0, std::memcmp(bases[1], h1, b1));
  // The pool's layer 1 changes: the next launch moves the new bytes.
  std::vector<uint8_t> fresh(b1);
  fill_random(fresh.data(), b1, 4242);
  std::memcpy(const_cast<uint8_t*>(h1), fresh.data(), b1);
  ASSERT_LWO(lwo_pool_layer_changed(pool, 1));
  ASSERT_LWO(lwo_graph_launch(graph, stream(s)));
  EXPECT_EQ(0, std::memcmp(bases[1], fresh.data(), b1));
  // The ring belongs to the graph.
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(ring, 0, &t), LWO_ERR_BUSY);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_stage: staging a layer: the ring belongs to a CUDA "
                                 "graph")) << msg();
  EXPECT_EQ(t.id, 0u);
  EXPECT_EQ(lwo_ring_destroy(ring), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "lwo_graph_destroy")) << msg();
  EXPECT_EQ(lwo_pool_destroy(pool), LWO_ERR_BUSY);
  ASSERT_LWO(lwo_graph_destroy(graph));
  EXPECT_EQ(lwo_graph_launch(graph, stream(s)), LWO_ERR_INVALID_HANDLE);
  ASSERT_LWO(lwo_graph_destroy(nullptr));
  // Given back with its slots empty: every stage copies again.
  const lwo_ring_stats before = ring_stats(ring);
  pass(ring, s, {1, 2}, pool);
  const lwo_ring_stats after = ring_stats(ring);
  EXPECT_EQ(after.n_hits, before.n_hits);
  EXPECT_EQ(after.n_stages - before.n_stages, 2u);
  pass(ring, s, {1}, pool);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(ring, pool);
}

// What a capture refuses, each leaving the objects usable: a NULL stream,
// a timed ring, a live ticket, a second capture;
// during one, another ring's stage, a new ring, pool, gradient set or
// schedule, lwo_ring_query, lwo_engine_synchronize; lwo_ring_capture_end on
// another stream or without a capture; a capture ended with a live ticket is
// discarded (LWO_ERR_TICKET_STATE) and the ring stages eagerly again.
TEST_F(Capture, RefusalsLeaveEveryObjectUsable) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_ring* other = make_ring(pool, 1);
  lwo_ring* timed = make_ring(pool, 1, LWO_RING_TIMING);
  StreamH s = gpu->new_stream(), s2 = gpu->new_stream();
  EXPECT_EQ(lwo_ring_capture_begin(ring, nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(msg(), "legacy default stream")) << msg();
  EXPECT_EQ(lwo_ring_capture_begin(timed, stream(s)), LWO_ERR_UNSUPPORTED);
  EXPECT_TRUE(contains(msg(), "LWO_RING_TIMING")) << msg();
  lwo_ticket live{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &live));
  EXPECT_EQ(lwo_ring_capture_begin(ring, stream(s)), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "release every ticket before a capture")) << msg();
  ASSERT_LWO(lwo_ring_release(ring, live, stream(s)));
  lwo_graph* graph = bogus<lwo_graph>();
  EXPECT_EQ(lwo_ring_capture_end(ring, stream(s), &graph), LWO_ERR_CAPTURING);
  EXPECT_EQ(graph, nullptr);

  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  EXPECT_EQ(lwo_ring_capture_begin(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_EQ(lwo_ring_capture_begin(other, stream(s2)), LWO_ERR_CAPTURING);
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(other, 1, &t), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "transfer stream is part of its capture")) << msg();
  lwo_ring* r2 = bogus<lwo_ring>();
  lwo_ring_config rc = LWO_RING_CONFIG_INIT;
  EXPECT_EQ(lwo_ring_create(pool, &rc, &r2), LWO_ERR_CAPTURING);
  EXPECT_EQ(r2, nullptr);
  ModelDesc m(1);
  lwo_pool* p2 = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), 1, nullptr, &p2), LWO_ERR_CAPTURING);
  EXPECT_EQ(p2, nullptr);
  const uint8_t trainable[3] = {1, 1, 1};
  lwo_grads* g = bogus<lwo_grads>();
  EXPECT_EQ(lwo_grads_create(pool, trainable, nullptr, &g), LWO_ERR_CAPTURING);
  EXPECT_EQ(g, nullptr);
  const uint32_t order[] = {0, 1};
  lwo_schedule* sch = bogus<lwo_schedule>();
  EXPECT_EQ(lwo_schedule_create(ring, order, 2, &sch), LWO_ERR_CAPTURING);
  EXPECT_EQ(sch, nullptr);
  EXPECT_EQ(lwo_engine_synchronize(engine), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "lwo_ring_capture_end")) << msg();
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t));
  uint32_t landed = 7;
  EXPECT_EQ(lwo_ring_query(ring, t, &landed), LWO_ERR_CAPTURING);
  EXPECT_EQ(landed, 7u);
  EXPECT_EQ(lwo_ring_destroy(ring), LWO_ERR_BUSY);
  EXPECT_EQ(lwo_ring_capture_end(ring, stream(s2), &graph), LWO_ERR_INVALID_ARGUMENT);
  // Ended with ticket t live: discarded, the ring back to eager staging.
  EXPECT_EQ(lwo_ring_capture_end(ring, stream(s), &graph), LWO_ERR_TICKET_STATE);
  EXPECT_TRUE(contains(msg(), "discarded")) << msg();
  EXPECT_EQ(graph, nullptr);
  EXPECT_EQ(lwo_ring_query(ring, t, &landed), LWO_ERR_STALE_TICKET);
  ASSERT_LWO(lwo_engine_synchronize(engine));
  // The other ring and the captured one stage and copy again.
  pass(other, s2, {1});
  pass(ring, s, {0}, pool);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(timed, other, ring, pool);
}

uint32_t position(lwo_schedule* sch) {
  uint32_t p = 0;
  EXPECT_EQ(lwo_schedule_position(sch, &p), LWO_OK) << msg();
  return p;
}

// A schedule made before the capture drives it: a forward and backward order
// over 4 layers in a ring of depth 2 (layers 3 and 2 come back while still in
// their slots: hits). The graph holds the pass's copies in the pass's order,
// each into the slot its view named; every launch runs them all, moving the
// pool's bytes as they are then. After the capture the schedule is at its end;
// reset, its next is LWO_ERR_BUSY until the graph is destroyed, then it drives
// the ring eagerly again.
TEST_F(Capture, AScheduleDrivesTheCaptureAndReplaysMoveThePoolsBytes) {
  lwo_pool* pool = make_pool(4);
  lwo_ring* ring = make_ring(pool, 2);
  StreamH s = gpu->new_stream();
  const uint32_t order[] = {0, 1, 2, 3, 3, 2, 1, 0};
  lwo_schedule* sch = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 8, &sch));
  EXPECT_EQ(drive(sch, s, pool).size(), 8u);  // eager, to its end
  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_schedule_next(sch, stream(s), &v), LWO_END);  // still at its end
  ASSERT_LWO(lwo_schedule_reset(sch, stream(s)));
  const uint64_t copies_before = gpu->stats.copies;
  const std::vector<lwo_layer_view> views = drive(sch, s, nullptr);
  ASSERT_EQ(views.size(), 8u);
  lwo_graph* graph = nullptr;
  ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));
  ASSERT_NE(graph, nullptr);
  EXPECT_EQ(position(sch), 8u);

  // The pass's copies, in order: 0, 1, 2 and 3 into the two slots in turn;
  // 3 and 2 again are hits; then 1 and 0 where 3 and 2 were released.
  void* const A = views[0].base;
  void* const B = views[1].base;
  ASSERT_NE(A, B);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(views[i].layer, order[i]);
  EXPECT_EQ(views[2].base, A);
  EXPECT_EQ(views[3].base, B);
  EXPECT_EQ(views[4].base, B);
  EXPECT_EQ(views[5].base, A);
  EXPECT_EQ(views[6].base, B);
  EXPECT_EQ(views[7].base, A);
  struct Want {
    uint32_t layer;
    void* slot;
  };
  const Want want[] = {{0, A}, {1, B}, {2, A}, {3, B}, {1, B}, {0, A}};
  const auto& ops = gpu->graph_ops();
  ASSERT_EQ(ops.size(), 6u);
  EXPECT_EQ(gpu->stats.copies - copies_before, 6u);
  uint64_t pass_bytes = 0;
  for (size_t i = 0; i < 6; ++i) {
    uint64_t bytes = 0;
    const uint8_t* host = host_of(pool, want[i].layer, &bytes);
    EXPECT_EQ(ops[i].kind, RecordingBackend::GraphOp::Copy) << "op " << i;
    EXPECT_EQ(ops[i].src, host) << "op " << i;
    EXPECT_EQ(ops[i].dst, want[i].slot) << "op " << i;
    EXPECT_EQ(ops[i].bytes, bytes) << "op " << i;
    pass_bytes += bytes;
  }

  // Each launch runs the six copies: the slots end with layers 0 and 1 as the
  // pool holds them at the launch.
  uint64_t b0 = 0, b1 = 0;
  uint8_t* h0 = const_cast<uint8_t*>(host_of(pool, 0, &b0));
  const uint8_t* h1 = host_of(pool, 1, &b1);
  for (int launch = 0; launch < 3; ++launch) {
    std::memset(A, 0, b0);
    std::memset(B, 0, b1);
    fill_random(h0, b0, 500 + launch);
    ASSERT_LWO(lwo_pool_layer_changed(pool, 0));
    const RecordingBackend::Stats before = gpu->stats;
    ASSERT_LWO(lwo_graph_launch(graph, stream(s)));
    EXPECT_EQ(gpu->stats.replayed_copies - before.replayed_copies, 6u);
    EXPECT_EQ(gpu->stats.replayed_bytes - before.replayed_bytes, pass_bytes);
    EXPECT_EQ(0, std::memcmp(A, h0, b0)) << "launch " << launch;
    EXPECT_EQ(0, std::memcmp(B, h1, b1)) << "launch " << launch;
  }

  // The graph holds the ring: the schedule at its end answers LWO_END, and
  // after a reset its next is refused, leaving it at position 0.
  EXPECT_EQ(lwo_schedule_next(sch, stream(s), &v), LWO_END);
  ASSERT_LWO(lwo_schedule_reset(sch, stream(s)));
  EXPECT_EQ(lwo_schedule_next(sch, stream(s), &v), LWO_ERR_BUSY);
  EXPECT_TRUE(starts_with(msg(), "lwo_schedule_next: position 0 of 8 (layer 0): staging a layer: "
                                 "the ring belongs to a CUDA graph")) << msg();
  EXPECT_EQ(position(sch), 0u);
  EXPECT_EQ(lwo_ring_destroy(ring), LWO_ERR_BUSY);
  ASSERT_LWO(lwo_graph_destroy(graph));
  EXPECT_EQ(drive(sch, s, pool).size(), 8u);  // eager again, every slot its layer's
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(sch, ring, pool);
}

// Schedules and a capture, each refusal leaving every object usable: a capture
// cannot begin while a schedule of the ring holds tickets; while a ring
// captures, a schedule of another ring cannot move, be reset or be destroyed
// while it holds tickets (LWO_ERR_CAPTURING, its position kept); a capture
// ended while the ring's schedule holds tickets is discarded, and the
// schedule goes on from its position, staging its layers again.
TEST_F(Capture, ScheduleRefusalsLeaveEveryObjectUsable) {
  lwo_pool* pool = make_pool(4);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_ring* other = make_ring(pool, 1);
  StreamH s = gpu->new_stream(), s2 = gpu->new_stream();
  const uint32_t order[] = {0, 1, 2, 3};
  lwo_schedule *sch = nullptr, *osch = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 4, &sch));
  ASSERT_LWO(lwo_schedule_create(other, order, 3, &osch));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_schedule_next(sch, stream(s), &v));
  EXPECT_EQ(lwo_ring_capture_begin(ring, stream(s)), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "a schedule holds its tickets until lwo_schedule_reset")) << msg();
  EXPECT_EQ(drive(sch, s, pool).size(), 3u);  // the rest of the pass, eager
  ASSERT_LWO(lwo_schedule_next(osch, stream(s2), &v));
  EXPECT_TRUE(holds_layer(pool, v));

  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));  // sch at its end, osch on `other`
  EXPECT_EQ(lwo_schedule_next(osch, stream(s2), &v), LWO_ERR_CAPTURING);
  EXPECT_TRUE(starts_with(msg(), "lwo_schedule_next: position 1 of 3 (layer 1): driving a "
                                 "schedule of another ring: ring ")) << msg();
  EXPECT_TRUE(contains(msg(), "is capturing a CUDA graph")) << msg();
  EXPECT_EQ(lwo_schedule_reset(osch, stream(s2)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(starts_with(msg(), "lwo_schedule_reset: resetting a schedule of another ring"))
      << msg();
  EXPECT_EQ(lwo_schedule_destroy(osch), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "destroying a schedule that holds tickets")) << msg();
  EXPECT_EQ(position(osch), 1u);
  ASSERT_LWO(lwo_schedule_reset(sch, stream(s)));
  ASSERT_LWO(lwo_schedule_next(sch, stream(s), &v));  // captured: layer 0 held
  lwo_graph* graph = bogus<lwo_graph>();
  EXPECT_EQ(lwo_ring_capture_end(ring, stream(s), &graph), LWO_ERR_TICKET_STATE);
  EXPECT_TRUE(contains(msg(), "discarded")) << msg();
  EXPECT_TRUE(contains(msg(), "a schedule holds its tickets")) << msg();
  EXPECT_EQ(graph, nullptr);

  // The discarded capture ended sch's tickets: it goes on from position 1.
  EXPECT_EQ(position(sch), 1u);
  const std::vector<lwo_layer_view> rest = drive(sch, s, pool);
  ASSERT_EQ(rest.size(), 3u);
  EXPECT_EQ(rest[0].layer, 1u);
  // And osch from where it stood.
  const std::vector<lwo_layer_view> orest = drive(osch, s2, pool);
  ASSERT_EQ(orest.size(), 2u);
  EXPECT_EQ(orest[0].layer, 1u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(osch, sch, other, ring, pool);
}

size_t count_ops(const std::vector<RecordingBackend::GraphOp>& ops,
                 RecordingBackend::GraphOp::Kind kind) {
  size_t n = 0;
  for (const RecordingBackend::GraphOp& op : ops) n += op.kind == kind;
  return n;
}

// A training step captured with its gradients: a forward over 3 layers and a
// backward whose gradients go to host memory in f32, layer 1's twice (two
// micro-batches: the second adds on the host). The capture moves nothing and
// changes no host state; the graph holds the four copies down and their host
// functions (each end's landing, and the staging buffer's wait before the
// added one), and every launch after lwo_grads_zero lands the slots' bytes
// of that launch, summed, in the host gradients (lwo_grads_wait the fence,
// also when the replay's host work comes late).
// A launch without the zero is refused; the graph holds the set until it is
// destroyed, then eager steps land again.
TEST_F(Capture, GradientsOfACapturedStepLandAtEachLaunch) {
  TrainSet t;
  ASSERT_NO_FATAL_FAILURE(train_set(&t));
  const lwo_grads_stats before = grads_stats(t.grads);

  ASSERT_LWO(lwo_grads_zero(t.grads));
  ASSERT_LWO(lwo_ring_capture_begin(t.ring, stream(t.s)));
  const std::vector<GradEnd> ends =
      train_step(t.ring, t.grads, t.s, 3, t.bwd, [](size_t, const GradEnd&) {});
  lwo_graph* graph = nullptr;
  ASSERT_LWO(lwo_ring_capture_end(t.ring, stream(t.s), &graph));
  ASSERT_NE(graph, nullptr);
  EXPECT_EQ(grads_stats(t.grads).n_transfers, before.n_transfers);  // nothing ran
  const auto& ops = gpu->graph_ops();
  EXPECT_EQ(count_ops(ops, RecordingBackend::GraphOp::CopyD2H), 4u);
  EXPECT_EQ(count_ops(ops, RecordingBackend::GraphOp::HostFunc), 5u);
  for (size_t i = 0; i < ends.size(); ++i)
    for (size_t j = 0; j < i; ++j) ASSERT_NE(ends[i].base, ends[j].base);  // one slot each
  // The graph's edges: the host functions run in the capture's order (each
  // layer's landings take its serials in turn), but a copy down waits for no
  // landing of a copy straight into host memory (layers 2 and 1 first): only
  // a staging buffer's wait (before the added copy of layer 1) holds copies.
  std::vector<const RecordingBackend::GraphOp*> fns, downs;
  for (const RecordingBackend::GraphOp& op : ops) {
    if (op.kind == RecordingBackend::GraphOp::HostFunc) fns.push_back(&op);
    if (op.kind == RecordingBackend::GraphOp::CopyD2H) downs.push_back(&op);
  }
  ASSERT_EQ(fns.size(), 5u);
  ASSERT_EQ(downs.size(), 4u);
  for (size_t i = 1; i < fns.size(); ++i)
    EXPECT_TRUE(RecordingBackend::ordered(*fns[i - 1], *fns[i])) << "host function " << i;
  EXPECT_TRUE(RecordingBackend::ordered(*downs[0], *fns[0]));   // layer 2's landing after its copy
  EXPECT_FALSE(RecordingBackend::ordered(*fns[0], *downs[1]));  // layer 1's copy not after it
  EXPECT_TRUE(RecordingBackend::ordered(*fns[2], *downs[2]));   // the staging buffer's wait

  ASSERT_NO_FATAL_FAILURE(
      five_replays(t, ends, before, [&] { return lwo_graph_launch(graph, stream(t.s)); }));
  // Without the zero the replay would overwrite the last one's gradients.
  EXPECT_EQ(lwo_graph_launch(graph, stream(t.s)), LWO_ERR_TICKET_STATE);
  EXPECT_TRUE(contains(msg(), "call lwo_grads_zero before each replay")) << msg();
  EXPECT_EQ(grads_stats(t.grads).n_transfers, before.n_transfers + 20);
  expect_host_grads(t.grads, t.pool, ends, 5);
  ASSERT_LWO(lwo_grads_zero(t.grads));
  for (size_t i = 0; i < ends.size(); ++i) write_grad(6, i, ends[i]);
  ASSERT_LWO(lwo_graph_launch(graph, stream(t.s)));
  ASSERT_LWO(lwo_grads_wait(t.grads));
  expect_host_grads(t.grads, t.pool, ends, 6);
  // The graph holds the set.
  lwo_layer_view g = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_grads_begin(t.grads, 0, stream(t.s), &g), LWO_ERR_BUSY);
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_begin: a gradient's begin: the gradient set belongs "
                                 "to a CUDA graph")) << msg();
  EXPECT_EQ(lwo_grads_destroy(t.grads), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "lwo_graph_destroy")) << msg();
  ASSERT_LWO(lwo_graph_destroy(graph));
  eager_train_step(t, 7);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(t.grads, t.ring, t.pool);
}

// Gradient sets and a capture, each refusal leaving every object usable: a
// set of another pool cannot begin during the capture (LWO_ERR_CAPTURING); a
// set with a layer begun before the capture cannot join it (LWO_ERR_BUSY),
// and ends that layer eagerly after; a capture ended with a gradient layer
// begun is discarded (LWO_ERR_TICKET_STATE) and the set is as before it.
TEST_F(Capture, GradientRefusalsLeaveEveryObjectUsable) {
  lwo_pool* pool = make_pool(3);
  lwo_pool* other_pool = make_pool(2, 2);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_grads* grads = f32_grads(pool);
  lwo_grads* other = f32_grads(other_pool);
  ASSERT_TRUE(grads && other);
  StreamH s = gpu->new_stream();
  lwo_layer_view g = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_zero(grads));
  ASSERT_LWO(lwo_grads_begin(grads, 0, stream(s), &g));
  const GradEnd held = grad_end(g);
  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  EXPECT_EQ(lwo_grads_begin(other, 0, stream(s), &g), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "capturing a CUDA graph of another pool")) << msg();
  EXPECT_EQ(lwo_grads_end(grads, 0, stream(s)), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "layer 0 was begun before the capture")) << msg();
  lwo_graph* graph = nullptr;
  ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));  // holds no gradient
  ASSERT_LWO(lwo_graph_destroy(graph));
  gpu->write(s, held.base, held.bytes);
  write_grad(1, 0, held);
  ASSERT_LWO(lwo_grads_end(grads, 0, stream(s)));
  ASSERT_LWO(lwo_grads_begin(other, 1, stream(s), &g));
  gpu->write(s, g.base, g.record_bytes);
  ASSERT_LWO(lwo_grads_end(other, 1, stream(s)));
  ASSERT_LWO(lwo_grads_wait(other));

  const lwo_grads_stats before = grads_stats(grads);
  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  ASSERT_LWO(lwo_grads_begin(grads, 1, stream(s), &g));
  gpu->write(s, g.base, g.record_bytes);
  ASSERT_LWO(lwo_grads_end(grads, 1, stream(s)));
  ASSERT_LWO(lwo_grads_begin(grads, 2, stream(s), &g));
  graph = bogus<lwo_graph>();
  EXPECT_EQ(lwo_ring_capture_end(ring, stream(s), &graph), LWO_ERR_TICKET_STATE);
  EXPECT_TRUE(contains(msg(), "gradient layer 2 begun and not ended")) << msg();
  EXPECT_TRUE(contains(msg(), "discarded")) << msg();
  EXPECT_EQ(graph, nullptr);
  EXPECT_EQ(grads_stats(grads).n_transfers, before.n_transfers);
  // As before the capture: layer 0's gradient is there, and layers 1 and 2
  // take their gradients eagerly.
  ASSERT_LWO(lwo_grads_wait(grads));
  expect_host_grads(grads, pool, {held}, 1);
  std::vector<GradEnd> ends;
  for (uint32_t l : {1u, 2u}) {
    ASSERT_LWO(lwo_grads_begin(grads, l, stream(s), &g));
    GradEnd e = grad_end(g);
    gpu->write(s, g.base, g.record_bytes);
    write_grad(2, ends.size(), e);
    ASSERT_LWO(lwo_grads_end(grads, l, stream(s)));
    ends.push_back(std::move(e));
  }
  ASSERT_LWO(lwo_grads_wait(grads));
  expect_host_grads(grads, pool, ends, 2);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(other, grads, ring, other_pool, pool);
}

// A gradient set's destruction waits for the gradient stream, which a
// capture's gradient set joined: while a ring of the engine captures (or has
// joined the caller's capture), destroying any gradient set, of the captured
// pool or of another, is LWO_ERR_CAPTURING and leaves it usable; after the
// capture it is destroyed, and no host wait touched captured work.
TEST_F(Capture, NoGradientSetIsDestroyedDuringACapture) {
  lwo_pool* pool = make_pool(3);
  lwo_pool* other_pool = make_pool(2, 2);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_grads* grads = f32_grads(pool);
  lwo_grads* second = f32_grads(pool);
  lwo_grads* other = f32_grads(other_pool);
  ASSERT_TRUE(grads && second && other);
  StreamH s = gpu->new_stream();
  ASSERT_LWO(lwo_grads_zero(grads));
  for (bool join : {false, true}) {
    SCOPED_TRACE(join ? "joined" : "begun");
    if (join) {
      gpu->caller_capture_begin(s);
      ASSERT_LWO(lwo_ring_capture_join(ring, stream(s)));
    } else {
      ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
    }
    pass(ring, s, {0});
    lwo_layer_view g = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(grads, 0, stream(s), &g));  // the gradient stream joins
    gpu->write(s, g.base, g.record_bytes);
    ASSERT_LWO(lwo_grads_end(grads, 0, stream(s)));
    for (lwo_grads* gs : {second, other}) {
      EXPECT_EQ(lwo_grads_destroy(gs), LWO_ERR_CAPTURING);
      EXPECT_TRUE(contains(msg(), "lwo_grads_destroy")) << msg();
      uint32_t done = 0;
      EXPECT_EQ(lwo_grads_query(gs, &done), LWO_ERR_CAPTURING);  // a wait's twin
    }
    if (join) {
      ASSERT_LWO(lwo_ring_capture_leave(ring, stream(s)));
      EXPECT_EQ(lwo_grads_destroy(other), LWO_ERR_CAPTURING);  // until the caller ends it
      EXPECT_TRUE(contains(msg(), "has not ended")) << msg();
      void* exec = caller_end(s);
      ASSERT_NE(exec, nullptr);
      ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
      gpu->graph_destroy(exec);
    } else {
      lwo_graph* graph = nullptr;
      ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));
      ASSERT_LWO(lwo_graph_destroy(graph));
    }
  }
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  ASSERT_LWO(lwo_grads_destroy(second));
  ASSERT_LWO(lwo_grads_destroy(other));
  ASSERT_LWO(lwo_grads_wait(grads));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(grads, ring, other_pool, pool);
}

// The host optimizer on replayed gradients: SGD (lr 1) after each launch
// starts each layer once its replayed gradient has landed (a replay whose
// host functions come late updates nothing before them), and the pool holds
// the weights less the gradients.
TEST_F(Capture, AnOptimizerUpdatesFromEachReplaysGradients) {
  constexpr uint32_t kL = 3, kN = 64;
  lwo_tensor_desc t = tensor("w", LWO_DTYPE_F32, {kN});
  std::vector<lwo_layer_desc> layers(kL, lwo_layer_desc{&t, 1, nullptr});
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, layers.data(), kL, nullptr, &pool));
  std::vector<std::vector<float>> w(kL, std::vector<float>(kN));
  for (uint32_t l = 0; l < kL; ++l) {
    for (uint32_t j = 0; j < kN; ++j) w[l][j] = static_cast<float>((l * 31 + j * 7) % 53);
    ASSERT_LWO(lwo_pool_write(pool, l, "w", w[l].data(), kN * 4));
  }
  lwo_ring* ring = make_ring(pool, 2);
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.depth = kL;  // a slot per end: the test writes them all before a launch
  lwo_grads* grads = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &grads));  // f32: straight to host
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  oc.kind = LWO_OPTIM_SGD;
  lwo_optim* optim = nullptr;
  ASSERT_LWO(lwo_optim_create(grads, &oc, &optim));
  StreamH s = gpu->new_stream();
  ASSERT_LWO(lwo_grads_zero(grads));
  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  const std::vector<GradEnd> ends =
      train_step(ring, grads, s, kL, {2, 1, 0}, [](size_t, const GradEnd&) {});
  lwo_graph* graph = nullptr;
  ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));
  ASSERT_NE(ends[0].base, ends[1].base);
  ASSERT_NE(ends[0].base, ends[2].base);
  ASSERT_NE(ends[1].base, ends[2].base);
  for (uint64_t k = 1; k <= 4; ++k) {
    ASSERT_LWO(lwo_grads_zero(grads));
    for (size_t i = 0; i < ends.size(); ++i) write_grad(k, i, ends[i]);
    // In step 2 the replay's host functions come late: no layer may be
    // updated before its landing, though its bytes are in place.
    gpu->pause_at_host_func = k == 2;
    ASSERT_LWO(lwo_graph_launch(graph, stream(s)));
    lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
    p.step = k;
    p.lr = 1;
    p.weight_decay = 0;
    ASSERT_LWO(lwo_optim_step(optim, &p));
    if (k == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      uint32_t done = 7;
      ASSERT_LWO(lwo_optim_query(optim, &done));
      EXPECT_EQ(done, 0u);
      void* host = nullptr;
      uint64_t bytes = 0;
      ASSERT_LWO(lwo_pool_layer_host(pool, 2, &host, &bytes));
      EXPECT_EQ(0, std::memcmp(host, w[2].data(), kN * 4)) << "updated before its landing";
      gpu->pause_at_host_func = false;
      gpu->resume();
    }
    ASSERT_LWO(lwo_optim_wait(optim));
    for (size_t i = 0; i < ends.size(); ++i) {
      const uint32_t l = ends[i].layer;
      void* host = nullptr;
      uint64_t bytes = 0;
      ASSERT_LWO(lwo_pool_layer_host(pool, l, &host, &bytes));
      const float* got = static_cast<const float*>(host);
      for (uint32_t j = 0; j < kN; ++j) {
        w[l][j] -= grad_value(k, i, j);
        ASSERT_EQ(got[j], w[l][j]) << "step " << k << " layer " << l << " element " << j;
      }
    }
  }
  ASSERT_LWO(lwo_graph_destroy(graph));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  ASSERT_LWO(lwo_optim_destroy(optim));
  destroy(grads, ring, pool);
}

// Resident layers in a captured pass (a ring of depth 2 keeping layers 1 and
// 3): lwo_ring_capture_begin uploads the one changed before it, outside the
// capture; the graph copies only the streamed layers, and each launch uploads
// the resident layers the host changed since the last (none, one, both, on a
// second stream), after the last replay's reads and before this one's: the
// recording backend checks each replay's reads and copies at its launch. After
// the graph, an eager pass finds the resident layers as the pool holds them.
TEST_F(Capture, ResidentLayersAreReadInPlaceAndUploadedBeforeALaunchThatNeedsThem) {
  lwo_pool* pool = make_pool(4);
  lwo_ring* ring = resident_ring(pool, 2, {1, 3});
  StreamH s = gpu->new_stream(), s2 = gpu->new_stream();
  pass(ring, s, {0, 1, 2, 3}, pool);
  rewrite(pool, 3, 31);
  const lwo_ring_stats st0 = ring_stats(ring);
  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  EXPECT_EQ(ring_stats(ring).n_resident_uploads - st0.n_resident_uploads, 1u);
  const uint64_t copies_before = gpu->stats.copies;
  const std::vector<const uint8_t*> bases = pass(ring, s, {0, 1, 2, 3});
  lwo_graph* graph = nullptr;
  ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));
  EXPECT_EQ(gpu->stats.copies - copies_before, 2u);
  const auto& ops = gpu->graph_ops();
  ASSERT_EQ(ops.size(), 2u);
  uint64_t bytes[4] = {};
  const uint8_t* host[4];
  for (uint32_t l = 0; l < 4; ++l) host[l] = host_of(pool, l, &bytes[l]);
  EXPECT_EQ(ops[0].src, host[0]);
  EXPECT_EQ(ops[0].dst, bases[0]);
  EXPECT_EQ(ops[1].src, host[2]);
  EXPECT_EQ(ops[1].dst, bases[2]);
  EXPECT_EQ(ring_stats(ring).n_resident_hits - st0.n_resident_hits, 2u);
  // Launch k: which resident layers the host changed before it, and on
  // which stream it runs.
  struct Launch {
    std::vector<uint32_t> changed;
    StreamH on;
  };
  const Launch launches[] = {{{}, s}, {{1}, s}, {{1, 3}, s}, {{}, s}, {{3}, s2}, {{1}, s}};
  for (size_t k = 0; k < sizeof launches / sizeof launches[0]; ++k) {
    const Launch& L = launches[k];
    for (uint32_t l : L.changed) rewrite(pool, l, 100 * k + l);
    std::memset(const_cast<uint8_t*>(bases[0]), 0, bytes[0]);
    std::memset(const_cast<uint8_t*>(bases[2]), 0, bytes[2]);
    const lwo_ring_stats st = ring_stats(ring);
    ASSERT_LWO(lwo_graph_launch(graph, stream(L.on)));
    const lwo_ring_stats after = ring_stats(ring);
    EXPECT_EQ(after.n_resident_uploads - st.n_resident_uploads, L.changed.size()) << "launch " << k;
    for (uint32_t l = 0; l < 4; ++l)
      EXPECT_EQ(0, std::memcmp(bases[l], host[l], bytes[l])) << "launch " << k << " layer " << l;
  }
  ASSERT_LWO(lwo_graph_destroy(graph));
  rewrite(pool, 1, 999);
  const lwo_ring_stats before = ring_stats(ring);
  pass(ring, s, {3, 2, 1, 0}, pool);
  const lwo_ring_stats after = ring_stats(ring);
  EXPECT_EQ(after.n_resident_uploads - before.n_resident_uploads, 1u);  // layer 1 only
  EXPECT_EQ(after.n_resident_hits - before.n_resident_hits, 1u);        // layer 3
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(ring, pool);
}

// A schedule's forward and backward (0 1 2 2 1 0) over a ring of depth 2
// keeping layer 1: both of layer 1's stages are hits on its resident slot
// (the second after the first's release, in the capture), the graph copies
// only layers 0 and 2, and replays with layer 1 rewritten before each read it
// as the pool holds it.
TEST_F(Capture, AScheduleReadsAResidentLayerTwiceInACapturedPass) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = resident_ring(pool, 2, {1});
  StreamH s = gpu->new_stream();
  const uint32_t order[] = {0, 1, 2, 2, 1, 0};
  lwo_schedule* sch = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 6, &sch));
  EXPECT_EQ(drive(sch, s, pool).size(), 6u);
  ASSERT_LWO(lwo_schedule_reset(sch, stream(s)));
  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  const std::vector<lwo_layer_view> views = drive(sch, s, nullptr);
  ASSERT_EQ(views.size(), 6u);
  lwo_graph* graph = nullptr;
  ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));
  EXPECT_EQ(views[1].base, views[4].base);
  uint64_t b1 = 0;
  const uint8_t* h1 = host_of(pool, 1, &b1);
  for (const auto& op : gpu->graph_ops()) {
    EXPECT_EQ(op.kind, RecordingBackend::GraphOp::Copy);
    EXPECT_NE(op.dst, views[1].base);
  }
  for (int k = 0; k < 3; ++k) {
    rewrite(pool, 1, 700 + k);
    ASSERT_LWO(lwo_graph_launch(graph, stream(s)));
    EXPECT_EQ(0, std::memcmp(views[1].base, h1, b1)) << "launch " << k;
  }
  ASSERT_LWO(lwo_graph_destroy(graph));
  ASSERT_LWO(lwo_schedule_reset(sch, stream(s)));
  EXPECT_EQ(drive(sch, s, pool).size(), 6u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(sch, ring, pool);
}

// A warm ring (LWO_RING_CAPTURE_WARM) of depth 2 over 3 layers, after an
// eager pass that left layers 0 and 1 in its slots: the captured pass
// 0 1 2 hits both and copies layer 2 into layer 0's slot, then, at the
// capture's end, layer 0 back (each replay leaves the slots as its start
// reads them). A launch copies nothing before the graph unless the pool's
// bytes of layer 0 or 1 changed since the last one: then that layer, after
// the last replay and before this one, on whichever stream it runs. In
// checking mode the ring takes its slots as empty.
TEST_F(Capture, AWarmCaptureHitsWhatItsSlotsHeldAndALaunchCopiesOnlyWhatThoseHitsNeed) {
  for (bool checking : {false, true}) {
    SCOPED_TRACE(checking ? "checking mode" : "plain");
    engine_set_checking(engine, checking);
    lwo_pool* pool = make_pool(3);
    lwo_ring* ring = make_ring(pool, 2, LWO_RING_CAPTURE_WARM);
    StreamH s = gpu->new_stream(), s2 = gpu->new_stream();
    const std::vector<const uint8_t*> eager = pass(ring, s, {0, 1}, pool);
    const uint64_t copies_before = gpu->stats.copies;
    ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
    const std::vector<const uint8_t*> bases = pass(ring, s, {0, 1, 2});
    lwo_graph* graph = nullptr;
    ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));
    uint64_t bytes[3] = {};
    const uint8_t* host[3];
    for (uint32_t l = 0; l < 3; ++l) host[l] = host_of(pool, l, &bytes[l]);
    if (checking) {  // as without the flag: every layer a copy of the graph
      EXPECT_EQ(gpu->stats.copies - copies_before, 3u);
      for (int k = 0; k < 2; ++k) {
        const uint64_t eager_copies = gpu->stats.copies;
        ASSERT_LWO(lwo_graph_launch(graph, stream(s)));
        EXPECT_EQ(gpu->stats.copies, eager_copies);
      }
      ASSERT_LWO(lwo_graph_destroy(graph));
      EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
      destroy(ring, pool);
      continue;
    }
    EXPECT_EQ(bases[0], eager[0]);
    EXPECT_EQ(bases[1], eager[1]);
    EXPECT_EQ(bases[2], bases[0]);
    EXPECT_EQ(gpu->stats.copies - copies_before, 2u);
    const auto& ops = gpu->graph_ops();
    ASSERT_EQ(ops.size(), 2u);
    EXPECT_EQ(ops[0].src, host[2]);
    EXPECT_EQ(ops[0].dst, bases[0]);
    EXPECT_EQ(ops[1].src, host[0]);  // layer 0 back where the next replay reads it
    EXPECT_EQ(ops[1].dst, bases[0]);
    EXPECT_TRUE(RecordingBackend::ordered(ops[0], ops[1]));
    // Launch k: the layers the host rewrites before it, the stream it runs
    // on, and the copies its host side makes first.
    struct Launch {
      std::vector<uint32_t> changed;
      StreamH on;
      uint64_t refills;
    };
    const Launch launches[] = {{{}, s, 0},  {{}, s, 0},  {{1}, s, 1}, {{2}, s2, 0},
                               {{0}, s, 1}, {{0, 1}, s2, 2}};
    for (size_t k = 0; k < sizeof launches / sizeof launches[0]; ++k) {
      const Launch& L = launches[k];
      for (uint32_t l : L.changed) rewrite(pool, l, 300 + 10 * k + l);
      const uint64_t eager_copies = gpu->stats.copies, replayed = gpu->stats.replayed_copies;
      ASSERT_LWO(lwo_graph_launch(graph, stream(L.on)));
      EXPECT_EQ(gpu->stats.copies - eager_copies, L.refills) << "launch " << k;
      EXPECT_EQ(gpu->stats.replayed_copies - replayed, 2u) << "launch " << k;
      // What the replay leaves: layers 0 and 1 as the pool holds them.
      EXPECT_EQ(0, std::memcmp(bases[0], host[0], bytes[0])) << "launch " << k;
      EXPECT_EQ(0, std::memcmp(bases[1], host[1], bytes[1])) << "launch " << k;
    }
    ASSERT_LWO(lwo_graph_destroy(graph));
    // Given back with its slots empty: every stage copies again.
    const lwo_ring_stats before = ring_stats(ring);
    pass(ring, s, {0, 1}, pool);
    EXPECT_EQ(ring_stats(ring).n_hits, before.n_hits);
    EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
    destroy(ring, pool);
  }
}

// In checking mode releases poison slots, resident ones too: the captured
// pass copies its resident layer like a streamed one (each replay fills the
// slot, then poisons it at the release), and after the graph an eager pass
// uploads it again.
TEST_F(Capture, InCheckingModeAReplayCopiesItsResidentLayers) {
  engine_set_checking(engine, true);
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = resident_ring(pool, 2, {1});
  StreamH s = gpu->new_stream();
  pass(ring, s, {0, 1, 2}, pool);
  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  const std::vector<const uint8_t*> bases = pass(ring, s, {0, 1, 2});
  lwo_graph* graph = nullptr;
  ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));
  uint64_t b1 = 0;
  const uint8_t* h1 = host_of(pool, 1, &b1);
  // Layer 1's copy into its slot comes before its release's fill.
  const auto& ops = gpu->graph_ops();
  size_t copy1 = ops.size(), fill1 = ops.size();
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].dst != bases[1]) continue;
    if (ops[i].kind == RecordingBackend::GraphOp::Copy && ops[i].src == h1) copy1 = std::min(copy1, i);
    if (ops[i].kind == RecordingBackend::GraphOp::Fill) fill1 = std::min(fill1, i);
  }
  ASSERT_LT(copy1, ops.size());
  ASSERT_LT(fill1, ops.size());
  EXPECT_LT(copy1, fill1);
  for (int k = 0; k < 2; ++k) {
    const uint64_t replayed = gpu->stats.replayed_copies;
    ASSERT_LWO(lwo_graph_launch(graph, stream(s)));
    EXPECT_EQ(gpu->stats.replayed_copies - replayed, 3u);
    EXPECT_EQ(bases[1][0], LWO_CHECKING_BYTE);  // released: poisoned
  }
  ASSERT_LWO(lwo_graph_destroy(graph));
  const lwo_ring_stats before = ring_stats(ring);
  pass(ring, s, {1, 0}, pool);
  EXPECT_EQ(ring_stats(ring).n_resident_uploads - before.n_resident_uploads, 1u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(ring, pool);
}

// A training step in a capture the caller began (lwo_ring_capture_join /
// _leave / _replay / _release): the test plays the framework, as in
// capture_join_test.cc, announcing each of its launches.
class CaptureJoinTrain : public Capture {
 protected:
  // One replay as the caller does it: announced, then launched.
  lwo_status_t replay(lwo_ring* ring, void* graph, StreamH s) {
    const lwo_status_t st = lwo_ring_capture_replay(ring, stream(s));
    if (st == LWO_OK) gpu->graph_launch(graph, s);
    return st;
  }
};

// The training step of GradientsOfACapturedStepLandAtEachLaunch (forward
// over 3 layers, backward {2, 1, 1, 0} with f32 host gradients, layer 1's
// added), captured inside the caller's capture: the graph holds the four
// copies down, their five host functions and one event record (the replay's
// end); the capture changes no host state. Every announced replay after
// lwo_grads_zero lands that replay's slot bytes, summed, exactly as the eager
// step does (lwo_grads_wait waits for the replay's host work, also when it
// comes late); a replay without the zero is refused at its announcement
// (LWO_ERR_TICKET_STATE) with nothing launched; the caller's graph holds the
// set until lwo_ring_capture_release, then eager steps land again.
TEST_F(CaptureJoinTrain, AnnouncedReplaysOfAJoinedStepLandItsGradients) {
  TrainSet t;
  ASSERT_NO_FATAL_FAILURE(train_set(&t));
  const lwo_grads_stats before = grads_stats(t.grads);

  ASSERT_LWO(lwo_grads_zero(t.grads));
  std::vector<GradEnd> ends;
  void* g = capture_joined(t.ring, t.s, [&] {
    ends = train_step(t.ring, t.grads, t.s, 3, t.bwd, [](size_t, const GradEnd&) {});
  });
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(grads_stats(t.grads).n_transfers, before.n_transfers);  // nothing ran
  const auto& ops = gpu->graph_ops();
  EXPECT_EQ(count_ops(ops, RecordingBackend::GraphOp::CopyD2H), 4u);
  EXPECT_EQ(count_ops(ops, RecordingBackend::GraphOp::HostFunc), 5u);
  EXPECT_EQ(count_ops(ops, RecordingBackend::GraphOp::EventRecord), 1u);
  EXPECT_EQ(ops.back().kind, RecordingBackend::GraphOp::EventRecord);
  ASSERT_NO_FATAL_FAILURE(five_replays(t, ends, before, [&] { return replay(t.ring, g, t.s); }));
  // Without the zero the replay would overwrite the last one's gradients.
  const uint64_t launches = gpu->launches;
  EXPECT_EQ(replay(t.ring, g, t.s), LWO_ERR_TICKET_STATE);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_capture_replay: gradient layer ")) << msg();
  EXPECT_TRUE(contains(msg(), "call lwo_grads_zero before each replay")) << msg();
  EXPECT_EQ(gpu->launches, launches);
  EXPECT_EQ(grads_stats(t.grads).n_transfers, before.n_transfers + 20);
  expect_host_grads(t.grads, t.pool, ends, 5);
  ASSERT_LWO(lwo_grads_zero(t.grads));
  for (size_t i = 0; i < ends.size(); ++i) write_grad(6, i, ends[i]);
  ASSERT_LWO(replay(t.ring, g, t.s));
  ASSERT_LWO(lwo_grads_wait(t.grads));
  expect_host_grads(t.grads, t.pool, ends, 6);
  // The caller's graph holds the set.
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_grads_begin(t.grads, 0, stream(t.s), &v), LWO_ERR_BUSY);
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_begin: a gradient's begin: the gradient set belongs "
                                 "to a CUDA graph: the caller's graph")) << msg();
  EXPECT_TRUE(contains(msg(), "lwo_ring_capture_release")) << msg();
  EXPECT_EQ(lwo_grads_destroy(t.grads), LWO_ERR_BUSY);
  EXPECT_TRUE(contains(msg(), "lwo_ring_capture_release")) << msg();
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(t.ring, stream(t.s)));
  eager_train_step(t, 7);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(t.grads, t.ring, t.pool);
}

// The host optimizer on a joined step's replays, as in eager training: SGD
// (lr 1) after each announced launch, and no lwo_optim_wait before the next
// one. Each replay's copies read the weights the last step wrote (the
// announcement waits for the optimizer's writes of the graph's layers, and
// for its reads of the gradients the replay lands), every step updates each
// layer by that replay's gradients, and a replay whose host work comes late
// updates nothing before it.
TEST_F(CaptureJoinTrain, AnOptimizerUpdatesFromEachAnnouncedReplaysGradients) {
  constexpr uint32_t kL = 3, kN = 1u << 20;  // updates long enough to overlap a launch
  lwo_tensor_desc t = tensor("w", LWO_DTYPE_F32, {kN});
  std::vector<lwo_layer_desc> layers(kL, lwo_layer_desc{&t, 1, nullptr});
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, layers.data(), kL, nullptr, &pool));
  std::vector<std::vector<float>> w(kL, std::vector<float>(kN));
  for (uint32_t l = 0; l < kL; ++l) {
    for (uint32_t j = 0; j < kN; ++j) w[l][j] = static_cast<float>((l * 31 + j * 7) % 53);
    ASSERT_LWO(lwo_pool_write(pool, l, "w", w[l].data(), kN * 4));
  }
  lwo_ring* ring = make_ring(pool, kL);  // a slot per layer: the backward hits
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.depth = kL;
  lwo_grads* grads = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &grads));  // f32: straight to host
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  oc.kind = LWO_OPTIM_SGD;
  lwo_optim* optim = nullptr;
  ASSERT_LWO(lwo_optim_create(grads, &oc, &optim));
  StreamH s = gpu->new_stream();
  ASSERT_LWO(lwo_grads_zero(grads));
  std::vector<GradEnd> ends;
  void* g = capture_joined(ring, s, [&] {
    ends = train_step(ring, grads, s, kL, {2, 1, 0}, [](size_t, const GradEnd&) {});
  });
  ASSERT_NE(g, nullptr);
  // Where each layer's replayed copy lands.
  std::vector<const float*> slot(kL, nullptr);
  for (const auto& op : gpu->graph_ops())
    if (op.kind == RecordingBackend::GraphOp::Copy)
      for (uint32_t l = 0; l < kL; ++l) {
        void* host = nullptr;
        uint64_t bytes = 0;
        ASSERT_LWO(lwo_pool_layer_host(pool, l, &host, &bytes));
        if (op.src == host) slot[l] = static_cast<const float*>(op.dst);
      }
  for (uint32_t l = 0; l < kL; ++l) ASSERT_NE(slot[l], nullptr) << "layer " << l;
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = 1;
  p.weight_decay = 0;
  for (size_t i = 0; i < ends.size(); ++i) write_grad(1, i, ends[i]);
  for (uint64_t k = 1; k <= 6; ++k) {
    // Right after the last step began: its updates may still run.
    ASSERT_LWO(lwo_grads_zero(grads));
    gpu->pause_at_host_func = k == 2;
    ASSERT_LWO(replay(ring, g, s));
    // The replay copied the weights as the last step left them.
    for (uint32_t l = 0; l < kL; ++l)
      ASSERT_EQ(0, std::memcmp(slot[l], w[l].data(), kN * 4)) << "replay " << k << " layer " << l;
    // The next backward's gradients, in the slots the replay copied down.
    if (k != 2)
      for (size_t i = 0; i < ends.size(); ++i) write_grad(k + 1, i, ends[i]);
    for (size_t i = 0; i < ends.size(); ++i)  // what the step will write
      for (uint32_t j = 0; j < kN; ++j) w[ends[i].layer][j] -= grad_value(k, i, j);
    p.step = k;
    ASSERT_LWO(lwo_optim_step(optim, &p));
    if (k == 2) {
      // The replay's host functions come late: no layer may be updated
      // before its landing, though its bytes are in place.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      uint32_t done = 7;
      ASSERT_LWO(lwo_optim_query(optim, &done));
      EXPECT_EQ(done, 0u);
      gpu->pause_at_host_func = false;
      gpu->resume();
      for (size_t i = 0; i < ends.size(); ++i) write_grad(k + 1, i, ends[i]);
    }
  }
  ASSERT_LWO(lwo_optim_wait(optim));
  for (uint32_t l = 0; l < kL; ++l) {
    void* host = nullptr;
    uint64_t bytes = 0;
    ASSERT_LWO(lwo_pool_layer_host(pool, l, &host, &bytes));
    EXPECT_EQ(0, std::memcmp(host, w[l].data(), kN * 4)) << "layer " << l;
  }
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  ASSERT_LWO(lwo_optim_destroy(optim));
  destroy(grads, ring, pool);
}

// An announced replay of a joined forward pass waits for the host
// optimizer's writes of the layers it copies: each step's gradients end
// eagerly (the set is not in the graph), SGD (lr 1) starts and the replay is
// announced and launched at once; its copies hold the updated weights.
TEST_F(CaptureJoinTrain, AnAnnouncedForwardReplayWaitsForTheOptimizersWrites) {
  constexpr uint32_t kL = 2, kN = 1u << 20;  // updates long enough to overlap a launch
  lwo_tensor_desc t = tensor("w", LWO_DTYPE_F32, {kN});
  std::vector<lwo_layer_desc> layers(kL, lwo_layer_desc{&t, 1, nullptr});
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, layers.data(), kL, nullptr, &pool));
  std::vector<std::vector<float>> w(kL, std::vector<float>(kN, 0.0f));
  for (uint32_t l = 0; l < kL; ++l) ASSERT_LWO(lwo_pool_write(pool, l, "w", w[l].data(), kN * 4));
  lwo_ring* ring = make_ring(pool, kL);
  lwo_grads* grads = nullptr;
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &grads));
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  oc.kind = LWO_OPTIM_SGD;
  lwo_optim* optim = nullptr;
  ASSERT_LWO(lwo_optim_create(grads, &oc, &optim));
  StreamH s = gpu->new_stream();
  std::vector<const uint8_t*> bases;
  void* g = capture_joined(ring, s, [&] { bases = pass(ring, s, {0, 1}); });
  ASSERT_NE(g, nullptr);
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = 1;
  p.weight_decay = 0;
  for (uint64_t k = 1; k <= 4; ++k) {
    ASSERT_LWO(lwo_grads_zero(grads));
    for (uint32_t l = 0; l < kL; ++l) {
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_grads_begin(grads, l, stream(s), &v));
      GradEnd e = grad_end(v);
      gpu->write(s, v.base, v.record_bytes);
      write_grad(k, l, e);
      ASSERT_LWO(lwo_grads_end(grads, l, stream(s)));
      for (uint32_t j = 0; j < kN; ++j) w[l][j] -= grad_value(k, l, j);
    }
    ASSERT_LWO(lwo_grads_wait(grads));
    p.step = k;
    ASSERT_LWO(lwo_optim_step(optim, &p));
    ASSERT_LWO(replay(ring, g, s));
    for (uint32_t l = 0; l < kL; ++l)
      ASSERT_EQ(0, std::memcmp(bases[l], w[l].data(), kN * 4)) << "replay " << k << " layer " << l;
  }
  ASSERT_LWO(lwo_optim_wait(optim));
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  ASSERT_LWO(lwo_optim_destroy(optim));
  destroy(grads, ring, pool);
}

// Misuse of a joined training step, each with its status and every object
// usable after it: an announcement with no caller's graph (before any join,
// during the capture, for an lwo_graph), on NULL, on a stream that captures,
// while another ring captures; a leave with a gradient layer begun
// (LWO_ERR_TICKET_STATE; ended in the capture, then left); a set of another
// pool in the capture, and an optimizer step (LWO_ERR_CAPTURING: it steps
// after the replay). A launch the caller did not
// announce: nothing of it is taken in, and lwo_grads_wait and the next
// announcement are LWO_ERR_CAPTURING naming lwo_ring_capture_replay until
// lwo_grads_zero, after which announced replays land again. A forward-only
// joined graph may be announced too.
TEST_F(CaptureJoinTrain, MisuseOfAJoinedStepGetsItsStatus) {
  lwo_pool* pool = make_pool(3);
  lwo_pool* other_pool = make_pool(2, 2);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_ring* other = make_ring(other_pool, 1);
  lwo_grads* grads = f32_grads(pool, 4);
  lwo_grads* other_grads = f32_grads(other_pool, 4);
  ASSERT_TRUE(grads && other_grads);
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  oc.kind = LWO_OPTIM_SGD;
  lwo_optim* optim = nullptr;
  ASSERT_LWO(lwo_optim_create(grads, &oc, &optim));
  StreamH s = gpu->new_stream(), s2 = gpu->new_stream();
  EXPECT_EQ(lwo_ring_capture_replay(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_capture_replay: the ring belongs to no CUDA graph "
                                 "the caller captured")) << msg();
  // An lwo_graph is launched by lwo_graph_launch.
  ASSERT_LWO(lwo_ring_capture_begin(ring, stream(s)));
  pass(ring, s, {0, 1});
  lwo_graph* graph = nullptr;
  ASSERT_LWO(lwo_ring_capture_end(ring, stream(s), &graph));
  EXPECT_EQ(lwo_ring_capture_replay(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "lwo_graph_launch replays it")) << msg();
  ASSERT_LWO(lwo_graph_destroy(graph));

  const std::vector<uint32_t> bwd = {2, 1, 0};
  ASSERT_LWO(lwo_grads_zero(grads));
  gpu->caller_capture_begin(s);
  ASSERT_LWO(lwo_ring_capture_join(ring, stream(s)));
  EXPECT_EQ(lwo_ring_capture_replay(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "still in the caller's capture")) << msg();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_grads_begin(other_grads, 0, stream(s), &v), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "of another pool")) << msg();
  EXPECT_TRUE(contains(msg(), "leave it first (lwo_ring_capture_leave)")) << msg();
  const std::vector<GradEnd> ends =
      train_step(ring, grads, s, 3, bwd, [](size_t, const GradEnd&) {});
  // The host optimizer steps after each replay: the captured ends never land.
  lwo_optim_step_params sp = LWO_OPTIM_STEP_PARAMS_INIT;
  sp.step = 1;
  EXPECT_EQ(lwo_optim_step(optim, &sp), LWO_ERR_CAPTURING);
  EXPECT_TRUE(starts_with(msg(), "lwo_optim_step: an optimizer step: ring ")) << msg();
  EXPECT_EQ(lwo_optim_step_open(optim, &sp, 1), LWO_ERR_CAPTURING);
  ASSERT_LWO(lwo_grads_begin(grads, 0, stream(s), &v));  // a second micro-batch's, begun
  EXPECT_EQ(lwo_ring_capture_leave(ring, stream(s)), LWO_ERR_TICKET_STATE);
  EXPECT_TRUE(contains(msg(), "gradient layer 0 begun and not ended: end it in the capture, "
                              "then leave it")) << msg();
  EXPECT_EQ(lwo_engine_synchronize(engine), LWO_ERR_CAPTURING);  // still joined
  gpu->write(s, v.base, v.record_bytes);
  std::memset(v.base, 0, v.record_bytes);  // adds nothing
  ASSERT_LWO(lwo_grads_end(grads, 0, stream(s)));
  ASSERT_LWO(lwo_ring_capture_leave(ring, stream(s)));
  void* g = caller_end(s);
  ASSERT_NE(g, nullptr);
  auto write_step = [&](uint64_t k) {
    for (size_t i = 0; i < ends.size(); ++i) write_grad(k, i, ends[i]);
  };
  // Announcements refused, nothing changed.
  gpu->caller_capture_begin(s2);
  EXPECT_EQ(lwo_ring_capture_replay(ring, stream(s2)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "is capturing")) << msg();
  gpu->graph_destroy(caller_end(s2));
  ASSERT_LWO(lwo_ring_capture_begin(other, stream(s2)));
  EXPECT_EQ(lwo_ring_capture_replay(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "is capturing a CUDA graph")) << msg();
  ASSERT_LWO(lwo_ring_capture_end(other, stream(s2), &graph));
  ASSERT_LWO(lwo_graph_destroy(graph));
  const lwo_grads_stats before = grads_stats(grads);
  EXPECT_EQ(before.n_transfers, 0u);  // nothing announced
  write_step(1);
  ASSERT_LWO(replay(ring, g, s));
  ASSERT_LWO(lwo_grads_wait(grads));
  expect_host_grads(grads, pool, ends, 1);
  // A launch not announced.
  ASSERT_LWO(lwo_grads_zero(grads));
  write_step(2);
  gpu->graph_launch(g, s);
  EXPECT_EQ(lwo_grads_wait(grads), LWO_ERR_CAPTURING);
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_wait: the gradient fence: gradient layer ")) << msg();
  EXPECT_TRUE(contains(msg(), "launched without lwo_ring_capture_replay before it")) << msg();
  EXPECT_TRUE(contains(msg(), "call lwo_grads_zero")) << msg();
  EXPECT_EQ(lwo_grads_wait(grads), LWO_ERR_CAPTURING);  // until the zero
  EXPECT_EQ(lwo_ring_capture_replay(ring, stream(s)), LWO_ERR_CAPTURING);
  EXPECT_TRUE(contains(msg(), "launched without lwo_ring_capture_replay")) << msg();
  EXPECT_EQ(grads_stats(grads).n_transfers, before.n_transfers + 4);  // taken in: the first only
  ASSERT_LWO(lwo_grads_zero(grads));
  write_step(3);
  ASSERT_LWO(replay(ring, g, s));
  ASSERT_LWO(lwo_grads_wait(grads));
  expect_host_grads(grads, pool, ends, 3);
  // On the legacy default stream (NULL), where torch replays by default.
  ASSERT_LWO(lwo_grads_zero(grads));
  write_step(4);
  ASSERT_LWO(replay(ring, g, nullptr));
  ASSERT_LWO(lwo_grads_wait(grads));
  expect_host_grads(grads, pool, ends, 4);
  ASSERT_LWO(lwo_optim_step(optim, &sp));  // after the replay
  ASSERT_LWO(lwo_optim_wait(optim));
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  EXPECT_EQ(lwo_ring_capture_replay(ring, stream(s)), LWO_ERR_CAPTURING);
  // A forward-only joined graph: the announcement is optional, and accepted.
  g = capture_joined(ring, s, [&] { pass(ring, s, {0, 1, 2}); });
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(count_ops(gpu->graph_ops(), RecordingBackend::GraphOp::EventRecord), 0u);
  gpu->graph_launch(g, s);
  ASSERT_LWO(replay(ring, g, s));
  gpu->graph_destroy(g);
  ASSERT_LWO(lwo_ring_capture_release(ring, stream(s)));
  // Everything is usable.
  pass(ring, s, {1, 0}, pool);
  ASSERT_LWO(lwo_grads_zero(grads));
  const std::vector<GradEnd> eager =
      train_step(ring, grads, s, 3, bwd, [&](size_t i, const GradEnd& e) { write_grad(4, i, e); });
  ASSERT_LWO(lwo_grads_wait(grads));
  expect_host_grads(grads, pool, eager, 4);
  ASSERT_LWO(lwo_grads_begin(other_grads, 1, stream(s2), &v));
  gpu->write(s2, v.base, v.record_bytes);
  ASSERT_LWO(lwo_grads_end(other_grads, 1, stream(s2)));
  ASSERT_LWO(lwo_grads_wait(other_grads));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  ASSERT_LWO(lwo_optim_destroy(optim));
  destroy(other_grads, grads, other, ring, other_pool, pool);
}

// The caller's capture of a training step ends without the leave, or is
// invalidated: the leave is LWO_ERR_CAPTURING and drops the gradient set's
// part with the ring's (its begun layer ends, its host state is as before the
// capture), and the set takes gradients eagerly again.
TEST_F(CaptureJoinTrain, ACallersCaptureEndedFirstDropsTheGradientSetsPart) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_grads* grads = f32_grads(pool, 4);
  ASSERT_TRUE(grads);
  StreamH s = gpu->new_stream();
  uint64_t k = 0;
  for (const bool invalidate : {false, true}) {
    SCOPED_TRACE(invalidate ? "invalidated" : "ended");
    ASSERT_LWO(lwo_grads_zero(grads));
    const std::vector<GradEnd> held = train_step(
        ring, grads, s, 3, {2}, [&](size_t i, const GradEnd& e) { write_grad(++k, i, e); });
    const lwo_grads_stats before = grads_stats(grads);
    gpu->caller_capture_begin(s);
    ASSERT_LWO(lwo_ring_capture_join(ring, stream(s)));
    train_step(ring, grads, s, 3, {1}, [](size_t, const GradEnd&) {});
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(grads, 0, stream(s), &v));
    end_before_leave(ring, s, invalidate);
    EXPECT_EQ(grads_stats(grads).n_transfers, before.n_transfers);
    ASSERT_LWO(lwo_grads_wait(grads));
    expect_host_grads(grads, pool, held, k);  // as before the capture
    const std::vector<GradEnd> ends = train_step(
        ring, grads, s, 3, {1, 0}, [&](size_t i, const GradEnd& e) { write_grad(k + 1, i, e); });
    ASSERT_LWO(lwo_grads_wait(grads));
    expect_host_grads(grads, pool, ends, k + 1);
    ++k;
  }
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations.front();
  destroy(grads, ring, pool);
}

// The host-only test backend records no graphs: LWO_ERR_UNSUPPORTED, and the
// ring stays usable.
TEST(CaptureHost, TheHostOnlyBackendRecordsNoGraphs) {
  lwo_engine* e = nullptr;
  ASSERT_LWO(lwo_test_engine_create_host(0, &e));
  ModelDesc m(2);
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(e, m.layers.data(), 2, nullptr, &pool));
  lwo_ring_config c = LWO_RING_CONFIG_INIT;
  c.depth = 1;
  lwo_ring* ring = nullptr;
  ASSERT_LWO(lwo_ring_create(pool, &c, &ring));
  lwo_stream_t s = reinterpret_cast<lwo_stream_t>(uintptr_t{1});
  EXPECT_EQ(lwo_ring_capture_begin(ring, s), LWO_ERR_UNSUPPORTED);
  EXPECT_TRUE(contains(msg(), "records no CUDA graphs")) << msg();
  lwo_ticket t{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  ASSERT_LWO(lwo_ring_release(ring, t, s));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_engine_destroy(e));
}

}  // namespace
}  // namespace testing
}  // namespace lwo
