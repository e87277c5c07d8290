// CUDA graphs of a ring's passes on the GPU (lwo_ring_capture_begin / _end,
// lwo_graph_launch / _destroy): a forward pass of a chain of linear layers
// (stage, acquire, lwo_linear_forward, release per layer, a ring shallower
// than the chain) captured once and replayed equals the same chain computed
// from resident copies of the weights bit for bit; a layer rewritten in the
// pool between replays is seen by the next one; replays on two streams in a
// row are ordered by the library; the ring belongs to the graph until it is
// destroyed, then an eager pass equals the resident chain again. The same
// with the pass driven by a schedule made before the capture; and a training
// step with its gradients to host memory, replayed 100 times. A ring keeping
// layers resident: its replays read them in place, and a launch uploads those
// the host rewrote since the last. A pass captured inside a capture the test
// begins itself in global mode, as torch.cuda.graph does
// (lwo_ring_capture_join / _leave), replayed with cudaGraphLaunch alone, its
// resident layers held until lwo_ring_capture_release; and a training step
// so joined, each launch announced (lwo_ring_capture_replay), with the host
// optimizer stepping between replays.
#include <cstdlib>
#include <random>

#include "quant_util.h"

namespace lwo_test {
namespace {

constexpr int64_t kDim = 256;
constexpr int64_t kTokens = 64;
constexpr uint32_t kLayers = 6;

// Replays of the captured training step: 100, or LWO_CAPTURE_REPLAYS
// (scripts/device-test sets 5 under compute-sanitizer, which runs every
// kernel many times slower).
uint32_t step_replays() {
  const char* e = std::getenv("LWO_CAPTURE_REPLAYS");
  const unsigned long n = e ? std::strtoul(e, nullptr, 10) : 0;
  return n ? static_cast<uint32_t>(n) : 100u;
}

lwo_linear_desc linear_desc() {
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.dtype = LWO_DTYPE_BF16;
  d.in_features = d.out_features = kDim;
  d.flags = LWO_LINEAR_BIAS;
  return d;
}

// A chain of kLayers linear layers (bf16, with bias) in a pinned pool, on
// random weights and input (a fresh seed per run), its activations X[l]
// (poisoned before each pass) and the resident reference.
class CaptureGpu : public GpuTest {
 protected:
  static constexpr lwo_dtype_t DT = LWO_DTYPE_BF16;
  static constexpr size_t NW = size_t(kDim * kDim), NB = size_t(kDim);
  static constexpr size_t kAct = size_t(kTokens * kDim) * 2;

  void SetUp() override {
    GpuTest::SetUp();
    if (!engine_ || HasFatalFailure()) return;
    t_[0] = tensor_desc("weight", DT, {kDim, kDim});
    t_[1] = tensor_desc("bias", DT, {kDim});
    std::vector<lwo_layer_desc> layers(kLayers, lwo_layer_desc{t_, 2, nullptr});
    CHECK_LWO(lwo_pool_create_pinned(engine_, layers.data(), kLayers, nullptr, pool_.out()));
    for (uint32_t l = 0; l < kLayers; ++l) {
      W_.push_back(random_mat(DT, NW, 0.12f, rng_));
      B_.push_back(random_mat(DT, NB, 0.1f, rng_));
      write(l);
    }
    X0_ = upload(random_mat(DT, size_t(kTokens * kDim), 1.f, rng_).bytes);
    for (uint32_t l = 0; l < kLayers; ++l) X_.push_back(poisoned(kAct));
  }
  void TearDown() override {
    pool_.reset();
    GpuTest::TearDown();
  }
  // The pool's layer l from W_[l] and B_[l].
  void write(uint32_t l) {
    CHECK_LWO(lwo_pool_write(pool_.get(), l, "weight", W_[l].bytes.data(), W_[l].bytes.size()));
    CHECK_LWO(lwo_pool_write(pool_.get(), l, "bias", B_[l].bytes.data(), B_[l].bytes.size()));
  }
  // New random weights for layer l, in W_ and the pool.
  void rewrite(uint32_t l) {
    W_[l] = random_mat(DT, NW, 0.12f, rng_);
    write(l);
  }
  // The chain from resident weights: what every pass must give.
  std::vector<uint8_t> resident() {
    const cudaStream_t st = stream(0);
    std::vector<testkit::DeviceMem> Y;
    for (uint32_t l = 0; l < kLayers; ++l) {
      testkit::DeviceMem w = upload(W_[l].bytes), b = upload(B_[l].bytes);
      Y.push_back(poisoned(kAct));
      EXPECT_LWO_OK(lwo_linear_forward(engine_, &desc_, kTokens, l ? Y[l - 1].get() : X0_.get(),
                                       w.get(), b.get(), Y[l].get(), st));
      EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(st));
    }
    return fetch(Y[kLayers - 1], kAct);
  }
  // A ring of depth `depth` keeping `resident` on the device.
  void resident_ring(uint32_t depth, const std::vector<uint32_t>& resident, Ring* out) {
    lwo_ring_config cfg = LWO_RING_CONFIG_INIT;
    cfg.depth = depth;
    cfg.resident_layers = resident.data();
    cfg.n_resident = uint32_t(resident.size());
    CHECK_LWO(lwo_ring_create(pool_.get(), &cfg, out->out()));
    ASSERT_NE(nullptr, out->get());
  }
  // `pass` enqueued on `st` in a capture the test begins (global mode) and
  // ends itself, the ring joined and left around it; the graph instantiated
  // into *exec, as a framework would.
  template <typename F>
  void capture_joined(lwo_ring* ring, cudaStream_t st, F pass, cudaGraphExec_t* exec) {
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    CHECK_LWO(lwo_ring_capture_join(ring, st));
    pass();
    CHECK_LWO(lwo_ring_capture_leave(ring, st));
    cudaGraph_t g = nullptr;
    CUDA_OK(cudaStreamEndCapture(st, &g));
    const cudaError_t inst = cudaGraphInstantiate(exec, g, 0);
    CUDA_OK(cudaGraphDestroy(g));
    CUDA_OK(inst);
  }

  // A ring of depth 2 over the pool and a gradient set of `flags` for the
  // training-step tests.
  void train_ring(uint32_t flags, Ring* ring, testkit::Grads* grads) {
    create_ring(pool_.get(), 2, 0, ring);
    if (HasFatalFailure()) return;
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    gc.flags = flags;
    CHECK_LWO(lwo_grads_create(pool_.get(), nullptr, &gc, grads->out()));
  }

  // One pass by hand over the ring on `s`: stage, acquire, the layer's
  // forward, release (eager, or captured).
  void hand_pass(lwo_ring* ring, cudaStream_t s) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      lwo_ticket tk{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring, l, s, &tk, &v));
      forward(v, s);
      CHECK_LWO(lwo_ring_release(ring, tk, s));
    }
  }
  // Layer v.layer's forward from its view, enqueued on s.
  void forward(const lwo_layer_view& v, cudaStream_t s) {
    const uint32_t l = v.layer;
    CHECK_LWO(lwo_linear_forward(engine_, &desc_, kTokens, l ? X_[l - 1].get() : X0_.get(),
                                 v.tensors[0], v.tensors[1], X_[l].get(), s));
  }
  void poison() {
    for (testkit::DeviceMem& m : X_) CUDA_OK(cudaMemset(m.get(), 0xff, kAct));
    CUDA_OK(cudaDeviceSynchronize());
  }
  // The last activation once `s` is done.
  std::vector<uint8_t> output(cudaStream_t s) {
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(s));
    return fetch(X_[kLayers - 1], kAct);
  }

  // ---- A training step: forward, then backward with the weights' gradients ----
  // Its output gradient DY_ (random) and each layer's input gradient DX_[l].
  void train_buffers() {
    const HostMat dy = random_mat(DT, size_t(kTokens * kDim), 0.05f, rng_);
    DY_ = upload(dy.bytes);
    for (uint32_t l = 0; l < kLayers; ++l) DX_.push_back(poisoned(kAct));
  }
  // The schedule's order: forward over the chain, then backward.
  static std::vector<uint32_t> step_order() {
    std::vector<uint32_t> order;
    for (uint32_t l = 0; l < kLayers; ++l) order.push_back(l);
    for (uint32_t l = kLayers; l-- > 0;) order.push_back(l);
    return order;
  }
  // The step from resident weights: each layer's dW and db (bf16), and dx_0.
  struct Step {
    std::vector<std::vector<uint8_t>> dw, db;
    std::vector<uint8_t> dx0;
  };
  Step resident_step() {
    const cudaStream_t st = stream(0);
    std::vector<testkit::DeviceMem> w, b, Y, dX, dW, dB;
    for (uint32_t l = 0; l < kLayers; ++l) {
      w.push_back(upload(W_[l].bytes));
      b.push_back(upload(B_[l].bytes));
      Y.push_back(poisoned(kAct));
      dX.push_back(poisoned(kAct));
      dW.push_back(poisoned(NW * 2));
      dB.push_back(poisoned(NB * 2));
      EXPECT_LWO_OK(lwo_linear_forward(engine_, &desc_, kTokens, l ? Y[l - 1].get() : X0_.get(),
                                       w[l].get(), b[l].get(), Y[l].get(), st));
    }
    for (uint32_t l = kLayers; l-- > 0;)
      EXPECT_LWO_OK(lwo_linear_backward(engine_, &desc_, kTokens, l ? Y[l - 1].get() : X0_.get(),
                                        l + 1 < kLayers ? dX[l + 1].get() : DY_.get(), w[l].get(),
                                        dX[l].get(), dW[l].get(), dB[l].get(), DT, st));
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(st));
    Step r;
    for (uint32_t l = 0; l < kLayers; ++l) {
      r.dw.push_back(fetch(dW[l], NW * 2));
      r.db.push_back(fetch(dB[l], NB * 2));
    }
    r.dx0 = fetch(dX[0], kAct);
    return r;
  }
  // The host gradient of `name` as the resident step's bf16 bytes: itself, or
  // widened to f32 (exact) where the set holds f32.
  static std::vector<uint8_t> as_host(const std::vector<uint8_t>& bf16, lwo_dtype_t host) {
    if (host == LWO_DTYPE_BF16) return bf16;
    std::vector<uint8_t> f32(bf16.size() * 2);
    for (size_t i = 0; i < bf16.size() / 2; ++i) {
      const uint32_t bits = uint32_t(bf16[2 * i] | (bf16[2 * i + 1] << 8)) << 16;
      std::memcpy(&f32[4 * i], &bits, 4);
    }
    return f32;
  }
  // One streamed step on st driven by `sch` (step_order()): forward, then
  // backward with the gradients to `grads` (eager, or captured).
  void streamed_step(lwo_schedule* sch, lwo_grads* grads, cudaStream_t st) {
    CHECK_LWO(lwo_schedule_reset(sch, st));
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    for (uint32_t k = 0; k < kLayers; ++k) {
      CHECK_LWO(lwo_schedule_next(sch, st, &v));
      forward(v, st);
    }
    for (uint32_t k = 0; k < kLayers; ++k) {
      CHECK_LWO(lwo_schedule_next(sch, st, &v));
      const uint32_t l = v.layer;
      lwo_layer_view g = LWO_LAYER_VIEW_INIT;
      CHECK_LWO(lwo_grads_begin(grads, l, st, &g));
      CHECK_LWO(lwo_linear_backward(engine_, &desc_, kTokens, l ? X_[l - 1].get() : X0_.get(),
                                    l + 1 < kLayers ? DX_[l + 1].get() : DY_.get(), v.tensors[0],
                                    DX_[l].get(), g.tensors[0], g.tensors[1], DT, st));
      CHECK_LWO(lwo_grads_end(grads, l, st));
    }
    lwo_status_t end = lwo_schedule_next(sch, st, &v);
    EXPECT_EQ(end, LWO_END) << lwo_last_error_message();
  }
  // After a step: the host gradients and dx_0 against the resident step.
  void check_step(lwo_grads* grads, const Step& want, cudaStream_t st, const char* what) {
    CHECK_LWO(lwo_grads_wait(grads));
    CUDA_OK(cudaStreamSynchronize(st));
    ASSERT_EQ(fetch(DX_[0], kAct), want.dx0) << what << ": dx_0";
    for (uint32_t l = 0; l < kLayers; ++l)
      for (const char* name : {"weight", "bias"}) {
        lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
        CHECK_LWO(lwo_grads_tensor(grads, l, name, &gt));
        const std::vector<uint8_t> ref = as_host(*name == 'w' ? want.dw[l] : want.db[l], gt.dtype);
        ASSERT_EQ(ref.size(), gt.n_elements * lwo_dtype_size(gt.dtype));
        ASSERT_EQ(0, std::memcmp(gt.data, ref.data(), ref.size()))
            << what << ": layer " << l << " " << name;
      }
  }
  // Poisoned activations and input gradients, and new sums in `grads`.
  void fresh_train_buffers(lwo_grads* grads) {
    poison();
    for (testkit::DeviceMem& m : DX_) CUDA_OK(cudaMemset(m.get(), 0xff, kAct));
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_LWO(lwo_grads_zero(grads));
  }

  std::mt19937_64 rng_{fresh_seed() + 77};
  lwo_tensor_desc t_[2];
  testkit::Pool pool_;
  std::vector<HostMat> W_, B_;
  testkit::DeviceMem X0_;
  std::vector<testkit::DeviceMem> X_;
  testkit::DeviceMem DY_;
  std::vector<testkit::DeviceMem> DX_;
  const lwo_linear_desc desc_ = linear_desc();
};

TEST_F(CaptureGpu, ReplayedForwardEqualsTheResidentChainAndSeesPoolChanges) {
  Ring ring;
  create_ring(pool_.get(), 2, 0, &ring);
  if (HasFatalFailure()) return;
  const cudaStream_t st = stream(0), st2 = stream(1);
  // One streamed pass enqueued on `s` (eager, or captured).
  auto pass = [&](cudaStream_t s) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      lwo_ticket tk{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), l, s, &tk, &v));
      forward(v, s);
      CHECK_LWO(lwo_ring_release(ring.get(), tk, s));
    }
  };
  const std::vector<uint8_t> want = resident();
  pass(st);  // eager first: the compute's plans are made outside the capture
  ASSERT_EQ(output(st), want) << "eager pass";

  CHECK_LWO(lwo_ring_capture_begin(ring.get(), st));
  pass(st);
  lwo_graph* graph = nullptr;
  CHECK_LWO(lwo_ring_capture_end(ring.get(), st, &graph));
  ASSERT_NE(graph, nullptr);
  auto destroy_graph = defer([&] {
    if (graph) EXPECT_LWO_OK(lwo_graph_destroy(graph));
  });
  poison();
  CHECK_LWO(lwo_graph_launch(graph, st));
  ASSERT_EQ(output(st), want) << "first replay";

  // Layer 2 rewritten in the pool: the next replay moves the new bytes.
  rewrite(2);
  const std::vector<uint8_t> want2 = resident();
  ASSERT_NE(want2, want);
  CHECK_LWO(lwo_graph_launch(graph, st));
  ASSERT_EQ(output(st), want2) << "replay after the pool changed";

  // Two replays in a row on two streams, the first held back by a delay:
  // the second waits for the first (they share the slots and buffers).
  CUDA_OK(stream_delay(st, 20000));
  CHECK_LWO(lwo_graph_launch(graph, st));
  CHECK_LWO(lwo_graph_launch(graph, st2));
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_EQ(fetch(X_[kLayers - 1], kAct), want2) << "replays on two streams";

  // The ring belongs to the graph.
  lwo_ticket tk{};
  EXPECT_EQ(lwo_ring_stage(ring.get(), 0, &tk), LWO_ERR_BUSY) << lwo_last_error_message();
  EXPECT_EQ(lwo_ring_destroy(ring.get()), LWO_ERR_BUSY);
  CHECK_LWO(lwo_graph_destroy(graph));
  graph = nullptr;
  // Given back: an eager pass equals the resident chain.
  poison();
  pass(st);
  ASSERT_EQ(output(st), want2) << "eager pass after the graph";
}

// A schedule made before the capture drives it: the replayed forward equals
// the resident chain bit for bit, over replays with a pool layer rewritten
// before each (the first, a middle and the last layer in turn); while the
// graph exists the reset schedule's next is LWO_ERR_BUSY, and after it the
// schedule drives eager passes again.
TEST_F(CaptureGpu, AScheduleDrivenForwardReplayedEqualsTheResidentChain) {
  Ring ring;
  create_ring(pool_.get(), 2, 0, &ring);
  if (HasFatalFailure()) return;
  std::vector<uint32_t> order(kLayers);
  for (uint32_t l = 0; l < kLayers; ++l) order[l] = l;
  testkit::Schedule sch;
  CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), kLayers, sch.out()));
  const cudaStream_t st = stream(0);
  // The schedule from its start to its LWO_END, each layer's forward on st.
  auto pass = [&] {
    CHECK_LWO(lwo_schedule_reset(sch.get(), st));
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    lwo_status_t s;
    while ((s = lwo_schedule_next(sch.get(), st, &v)) == LWO_OK) forward(v, st);
    EXPECT_EQ(s, LWO_END) << lwo_last_error_message();
  };
  std::vector<uint8_t> want = resident();
  pass();  // eager first
  ASSERT_EQ(output(st), want) << "eager pass";

  CHECK_LWO(lwo_ring_capture_begin(ring.get(), st));
  pass();
  testkit::Graph graph;
  CHECK_LWO(lwo_ring_capture_end(ring.get(), st, graph.out()));
  uint32_t pos = 0;
  CHECK_LWO(lwo_schedule_position(sch.get(), &pos));
  EXPECT_EQ(pos, kLayers);
  for (uint32_t k = 0; k < 6; ++k) {
    if (k) {
      rewrite(k % 3 == 1 ? 0 : k % 3 == 2 ? kLayers / 2 : kLayers - 1);
      const std::vector<uint8_t> next = resident();
      ASSERT_NE(next, want);
      want = next;
    }
    poison();
    CHECK_LWO(lwo_graph_launch(graph.get(), st));
    ASSERT_EQ(output(st), want) << "replay " << k;
  }

  CHECK_LWO(lwo_schedule_reset(sch.get(), st));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_schedule_next(sch.get(), st, &v), LWO_ERR_BUSY) << lwo_last_error_message();
  graph.destroy();
  poison();
  pass();
  ASSERT_EQ(output(st), want) << "eager pass after the graph";
}

// A training step captured with its gradients: a schedule over
// [0..5, 5..0] drives the forward and then the backward, whose weight and
// bias gradients go to host memory through a gradient set (in bf16, and
// with LWO_GRADS_NATIVE_WIRE converted to f32 on the host); 100 replays
// (step_replays),
// the host writing a layer's new weights into the pool and zeroing the
// gradients before each, every gradient and the input gradient equal to the
// step computed from resident weights bit for bit.
TEST_F(CaptureGpu, ACapturedTrainingStepsGradientsEqualTheResidentStep) {
  const cudaStream_t st = stream(0);
  train_buffers();
  const std::vector<uint32_t> order = step_order();
  for (uint32_t flags : {0u, uint32_t(LWO_GRADS_NATIVE_WIRE)}) {
    SCOPED_TRACE(flags ? "f32 host gradients" : "bf16 host gradients");
    Ring ring;
    testkit::Grads grads;
    ASSERT_NO_FATAL_FAILURE(train_ring(flags, &ring, &grads));
    testkit::Schedule sch;
    CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), uint32_t(order.size()), sch.out()));
    auto step = [&] { streamed_step(sch.get(), grads.get(), st); };
    auto check = [&](const Step& want, const char* what) {
      check_step(grads.get(), want, st, what);
    };
    auto fresh_buffers = [&] { fresh_train_buffers(grads.get()); };
    Step want = resident_step();
    fresh_buffers();
    step();  // eager first: the compute's plans are made outside the capture
    check(want, "eager step");
    if (HasFatalFailure()) return;

    CHECK_LWO(lwo_grads_zero(grads.get()));
    CHECK_LWO(lwo_ring_capture_begin(ring.get(), st));
    step();
    testkit::Graph graph;
    CHECK_LWO(lwo_ring_capture_end(ring.get(), st, graph.out()));
    for (uint32_t k = 0; k < step_replays(); ++k) {
      if (k) {
        rewrite(k % kLayers);
        want = resident_step();
      }
      fresh_buffers();
      CHECK_LWO(lwo_graph_launch(graph.get(), st));
      check(want, "replay");
      if (HasFatalFailure()) {
        ADD_FAILURE() << "replay " << k;
        return;
      }
    }
    graph.destroy();
    fresh_buffers();
    step();
    check(want, "eager step after the graph");
    if (HasFatalFailure()) return;
  }
}

// A ring of depth 2 keeping layers 1 and 4 of the chain resident: the
// captured forward copies only the streamed layers; replays, with the host
// rewriting a resident layer, a streamed one, both or neither before each
// (fresh random weights), equal the resident chain bit for bit, each launch
// uploading only the resident layers that changed; a launch on a second
// stream right after one held back by a delay is ordered after it; after the
// graph an eager pass equals the chain again.
TEST_F(CaptureGpu, ResidentLayersReplayedEqualTheResidentChainOverHostChanges) {
  Ring ring;
  resident_ring(2, {1, 4}, &ring);
  if (HasFatalFailure()) return;
  const cudaStream_t st = stream(0), st2 = stream(1);
  std::vector<uint8_t> want = resident();
  hand_pass(ring.get(), st);  // eager first
  ASSERT_EQ(output(st), want) << "eager pass";
  rewrite(4);  // changed before the capture: lwo_ring_capture_begin uploads it
  want = resident();
  CHECK_LWO(lwo_ring_capture_begin(ring.get(), st));
  hand_pass(ring.get(), st);
  testkit::Graph graph;
  CHECK_LWO(lwo_ring_capture_end(ring.get(), st, graph.out()));
  const lwo_ring_stats st0 = ring_stats(ring.get());
  poison();
  CHECK_LWO(lwo_graph_launch(graph.get(), st));
  ASSERT_EQ(output(st), want) << "first replay";
  EXPECT_EQ(ring_stats(ring.get()).n_resident_uploads, st0.n_resident_uploads);
  // Before replay k the host rewrites these layers.
  const std::vector<std::vector<uint32_t>> changes = {{1}, {2}, {1, 4}, {}, {4, 0}, {1}, {5}};
  for (size_t k = 0; k < changes.size(); ++k) {
    uint64_t n_resident = 0;
    for (uint32_t l : changes[k]) {
      rewrite(l);
      n_resident += l == 1 || l == 4;
    }
    if (!changes[k].empty()) {
      const std::vector<uint8_t> next = resident();
      ASSERT_NE(next, want) << "replay " << k;
      want = next;
    }
    poison();
    const lwo_ring_stats before = ring_stats(ring.get());
    const cudaStream_t on = k == 5 ? st2 : st;
    if (k == 5) CUDA_OK(stream_delay(st, 20000));  // the replay before may still run
    if (k == 5) CHECK_LWO(lwo_graph_launch(graph.get(), st));
    CHECK_LWO(lwo_graph_launch(graph.get(), on));
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(fetch(X_[kLayers - 1], kAct), want) << "replay " << k;
    EXPECT_EQ(ring_stats(ring.get()).n_resident_uploads - before.n_resident_uploads, n_resident)
        << "replay " << k;
  }
  graph.destroy();
  rewrite(1);
  want = resident();
  poison();
  hand_pass(ring.get(), st);
  ASSERT_EQ(output(st), want) << "eager pass after the graph";
}

// The caller's own capture (cudaStreamBeginCapture in global mode, as
// torch.cuda.graph begins it) with lwo's pass joined into it: a ring of depth
// 2 keeping layer 3 resident, stage / acquire / forward / release by hand,
// lwo_ring_capture_leave, cudaStreamEndCapture and cudaGraphInstantiate by
// the test; every replay is cudaGraphLaunch alone. Over replays with the host
// rewriting a streamed layer before each (fresh random weights), the output
// equals the resident chain bit for bit; a write of the resident layer is
// LWO_ERR_BUSY and changes nothing; after lwo_ring_capture_release the write
// goes through and an eager pass equals the chain with it.
TEST_F(CaptureGpu, AJoinedForwardReplayedByCudaGraphLaunchEqualsTheResidentChain) {
  Ring ring;
  resident_ring(2, {3}, &ring);
  if (HasFatalFailure()) return;
  const cudaStream_t st = stream(0);
  std::vector<uint8_t> want = resident();
  hand_pass(ring.get(), st);  // eager first: plans and workspaces outside the capture
  ASSERT_EQ(output(st), want) << "eager pass";
  CUDA_OK(cudaStreamSynchronize(st));
  cudaGraphExec_t exec = nullptr;
  ASSERT_NO_FATAL_FAILURE(capture_joined(ring.get(), st, [&] { hand_pass(ring.get(), st); },
                                         &exec));
  auto destroy_exec = defer([&] {
    if (exec) {
      EXPECT_EQ(cudaSuccess, cudaGraphExecDestroy(exec));
    }
  });
  for (uint32_t k = 0; k < 8; ++k) {
    if (k) {
      rewrite(k % 2 ? 0 : kLayers - 1);  // streamed layers
      const std::vector<uint8_t> next = resident();
      ASSERT_NE(next, want);
      want = next;
    }
    poison();
    CUDA_OK(cudaGraphLaunch(exec, st));
    ASSERT_EQ(output(st), want) << "replay " << k;
  }
  // The resident layer is held while the caller's graph holds the ring.
  const HostMat new3 = random_mat(DT, NW, 0.12f, rng_);
  EXPECT_EQ(lwo_pool_write(pool_.get(), 3, "weight", new3.bytes.data(), new3.bytes.size()),
            LWO_ERR_BUSY) << lwo_last_error_message();
  poison();
  CUDA_OK(cudaGraphLaunch(exec, st));
  ASSERT_EQ(output(st), want) << "replay after the refused write";
  lwo_ticket tk{};
  EXPECT_EQ(lwo_ring_stage(ring.get(), 0, &tk), LWO_ERR_BUSY) << lwo_last_error_message();
  CUDA_OK(cudaGraphExecDestroy(exec));
  exec = nullptr;
  CHECK_LWO(lwo_ring_capture_release(ring.get(), st));
  W_[3] = new3;
  write(3);
  want = resident();
  poison();
  hand_pass(ring.get(), st);
  ASSERT_EQ(output(st), want) << "eager pass after the release";
}

// A warm ring (LWO_RING_CAPTURE_WARM, depth 2) whose slots hold layers 1
// and 0 when the forward is captured: the capture reads them where they are,
// copies the rest and at its end layers 0 and 1 back into their slots, so a
// launch copies one of them first only after the host rewrote it. In
// the ring's own graph (lwo_graph_launch) and in the caller's
// (lwo_ring_capture_replay, then cudaGraphLaunch), over replays with the host
// rewriting layer 0, layer 1 or a later layer before each (fresh random
// weights), the output equals the resident chain bit for bit.
TEST_F(CaptureGpu, AWarmCapturesReplaysEqualTheResidentChainOverHostChanges) {
  for (bool joined : {false, true}) {
    SCOPED_TRACE(joined ? "the caller's graph" : "lwo_graph");
    Ring ring;
    create_ring(pool_.get(), 2, LWO_RING_CAPTURE_WARM, &ring);
    if (HasFatalFailure()) return;
    const cudaStream_t st = stream(0);
    std::vector<uint8_t> want = resident();
    hand_pass(ring.get(), st);  // eager first: plans and workspaces outside the capture
    ASSERT_EQ(output(st), want) << "eager pass";
    for (uint32_t l : {1u, 0u}) {  // the slots hold layers 1 and 0
      lwo_ticket tk{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), l, st, &tk, &v));
      CHECK_LWO(lwo_ring_release(ring.get(), tk, st));
    }
    CUDA_OK(cudaStreamSynchronize(st));
    lwo_graph* graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    if (joined) {
      ASSERT_NO_FATAL_FAILURE(capture_joined(ring.get(), st, [&] { hand_pass(ring.get(), st); },
                                             &exec));
    } else {
      CHECK_LWO(lwo_ring_capture_begin(ring.get(), st));
      hand_pass(ring.get(), st);
      CHECK_LWO(lwo_ring_capture_end(ring.get(), st, &graph));
    }
    auto destroy = defer([&] {
      if (exec) {
        EXPECT_EQ(cudaSuccess, cudaGraphExecDestroy(exec));
        EXPECT_LWO_OK(lwo_ring_capture_release(ring.get(), st));
      }
      if (graph) EXPECT_LWO_OK(lwo_graph_destroy(graph));
    });
    lwo_ring_stats before;
    std::memset(&before, 0, sizeof before);
    before.size = sizeof before;
    CHECK_LWO(lwo_ring_get_stats(ring.get(), &before));
    const uint32_t changed[] = {0, 0, 1, kLayers - 1, 0, 2};
    for (uint32_t k = 0; k < 6; ++k) {
      if (k) {
        rewrite(changed[k]);
        const std::vector<uint8_t> next = resident();
        ASSERT_NE(next, want);
        want = next;
      }
      poison();
      if (joined) {
        CHECK_LWO(lwo_ring_capture_replay(ring.get(), st));
        CUDA_OK(cudaGraphLaunch(exec, st));
      } else {
        CHECK_LWO(lwo_graph_launch(graph, st));
      }
      ASSERT_EQ(output(st), want) << "replay " << k;
    }
    // Copied before a launch: layer 0 (twice) and layer 1, each after a write.
    lwo_ring_stats after = before;
    CHECK_LWO(lwo_ring_get_stats(ring.get(), &after));
    EXPECT_EQ(after.n_copies - before.n_copies, 3u);
  }
}

// A training step in the caller's own capture (cudaStreamBeginCapture in
// global mode, as torch.cuda.graph begins it) with lwo's ring and gradient
// set joined into it (lwo_ring_capture_join / _leave; f32 host gradients):
// the schedule-driven step of ACapturedTrainingStepsGradientsEqualTheResidentStep,
// instantiated by the test and replayed by cudaGraphLaunch, each launch
// announced first (lwo_ring_capture_replay). The host optimizer (SGD) steps
// after each replay as in eager training, writing new weights into the pool
// that the next replay copies; over the replays every gradient and the input
// gradient equal the step computed from resident copies of the pool's
// weights bit for bit, and the weights move. After lwo_ring_capture_release
// an eager step equals it again.
TEST_F(CaptureGpu, AJoinedTrainingStepReplayedByCudaGraphLaunchEqualsTheResidentStep) {
  const cudaStream_t st = stream(0);
  train_buffers();
  const std::vector<uint32_t> order = step_order();
  Ring ring;
  testkit::Grads grads;
  ASSERT_NO_FATAL_FAILURE(train_ring(LWO_GRADS_NATIVE_WIRE, &ring, &grads));
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  oc.kind = LWO_OPTIM_SGD;
  lwo_optim* optim = nullptr;
  CHECK_LWO(lwo_optim_create(grads.get(), &oc, &optim));
  auto destroy_optim = defer([&] { EXPECT_LWO_OK(lwo_optim_destroy(optim)); });
  testkit::Schedule sch;
  CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), uint32_t(order.size()), sch.out()));
  // W_ and B_ from the pool, as the optimizer left it.
  auto read_back = [&] {
    for (uint32_t l = 0; l < kLayers; ++l)
      for (HostMat* m : {&W_[l], &B_[l]}) {
        void* p = nullptr;
        uint64_t n = 0;
        CHECK_LWO(lwo_pool_tensor_host(pool_.get(), l, m == &W_[l] ? "weight" : "bias", &p, &n));
        ASSERT_EQ(n, m->bytes.size());
        std::memcpy(m->bytes.data(), p, n);
      }
  };
  Step want = resident_step();
  fresh_train_buffers(grads.get());
  streamed_step(sch.get(), grads.get(), st);  // eager first: plans outside the capture
  check_step(grads.get(), want, st, "eager step");
  if (HasFatalFailure()) return;

  CHECK_LWO(lwo_grads_zero(grads.get()));
  CUDA_OK(cudaStreamSynchronize(st));
  cudaGraphExec_t exec = nullptr;
  ASSERT_NO_FATAL_FAILURE(
      capture_joined(ring.get(), st, [&] { streamed_step(sch.get(), grads.get(), st); }, &exec));
  auto destroy_exec = defer([&] {
    if (exec) {
      EXPECT_EQ(cudaSuccess, cudaGraphExecDestroy(exec));
      EXPECT_LWO_OK(lwo_ring_capture_release(ring.get(), st));
    }
  });
  const std::vector<uint8_t> w0 = W_[0].bytes;
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = 0.01f;
  p.weight_decay = 0;
  const uint32_t replays = std::min(step_replays(), 20u);
  for (uint32_t k = 0; k < replays; ++k) {
    fresh_train_buffers(grads.get());
    CHECK_LWO(lwo_ring_capture_replay(ring.get(), st));
    CUDA_OK(cudaGraphLaunch(exec, st));
    check_step(grads.get(), want, st, "replay");
    if (HasFatalFailure()) {
      ADD_FAILURE() << "replay " << k;
      return;
    }
    p.step = k + 1;
    CHECK_LWO(lwo_optim_step(optim, &p));
    CHECK_LWO(lwo_optim_wait(optim));
    read_back();
    if (HasFatalFailure()) return;
    want = resident_step();
  }
  EXPECT_NE(W_[0].bytes, w0) << "the optimizer moved no weight";
  CUDA_OK(cudaGraphExecDestroy(exec));
  exec = nullptr;
  CHECK_LWO(lwo_ring_capture_release(ring.get(), st));
  fresh_train_buffers(grads.get());
  streamed_step(sch.get(), grads.get(), st);
  check_step(grads.get(), want, st, "eager step after the release");
}

// During a capture, calls that wait or query are LWO_ERR_CAPTURING, and a
// capture discarded for a live ticket leaves the ring and the stream usable.
TEST_F(CaptureGpu, RefusalsDuringACaptureLeaveTheStreamUsable) {
  lwo_tensor_desc t[1] = {tensor_desc("w", LWO_DTYPE_F32, {256, 64})};
  std::vector<lwo_layer_desc> layers(3, lwo_layer_desc{t, 1, nullptr});
  testkit::Pool pool;
  CHECK_LWO(lwo_pool_create_pinned(engine_, layers.data(), 3, nullptr, pool.out()));
  Ring ring;
  create_ring(pool.get(), 2, 0, &ring);
  if (HasFatalFailure()) return;
  const cudaStream_t st = stream(0);
  CHECK_LWO(lwo_ring_capture_begin(ring.get(), st));
  lwo_ticket tk{};
  CHECK_LWO(lwo_ring_stage(ring.get(), 0, &tk));
  uint32_t landed = 7;
  EXPECT_EQ(lwo_ring_query(ring.get(), tk, &landed), LWO_ERR_CAPTURING);
  EXPECT_EQ(lwo_engine_synchronize(engine_), LWO_ERR_CAPTURING);
  lwo_graph* graph = nullptr;
  EXPECT_EQ(lwo_ring_capture_end(ring.get(), st, &graph), LWO_ERR_TICKET_STATE);
  EXPECT_EQ(graph, nullptr);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  CUDA_OK(cudaStreamIsCapturing(st, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  CHECK_LWO(lwo_engine_synchronize(engine_));
  // The ring stages eagerly again, and the slot holds the layer's bytes.
  void* host = nullptr;
  uint64_t bytes = 0;
  CHECK_LWO(lwo_pool_layer_host(pool.get(), 1, &host, &bytes));
  fill_random(host, bytes, 99);
  CHECK_LWO(lwo_ring_stage(ring.get(), 1, &tk));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  CHECK_LWO(lwo_ring_acquire(ring.get(), tk, st, &v));
  std::vector<uint8_t> got(bytes);
  CUDA_OK(cudaMemcpyAsync(got.data(), v.base, bytes, cudaMemcpyDeviceToHost, st));
  CHECK_LWO(lwo_ring_release(ring.get(), tk, st));
  CUDA_OK(cudaStreamSynchronize(st));
  EXPECT_EQ(0, std::memcmp(got.data(), host, bytes));
}

}  // namespace
}  // namespace lwo_test
