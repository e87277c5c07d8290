// Linear layers and gradients to host on the device: outputs and gradients
// against an fp64 CPU reference, streamed against resident bit for bit, and
// the gradient fence.
#include "gpu_util.h"
#include "testkit/conv_ref.h"
#include "testkit/dtype.h"
#include "testkit/spin.h"
#include "unit/conv_desc.h"

namespace lwo_test {
namespace {

// ---- host-side dtype handling (testkit/dtype.h) ----

size_t esize(lwo_dtype_t d) { return lwo_dtype_size(d); }

// Rounds v to `d` and stores it at p[i]; returns the rounded value.
float store(void* p, size_t i, float v, lwo_dtype_t d) { return testkit::store_f32(p, d, i, v); }
float load(const void* p, size_t i, lwo_dtype_t d) { return testkit::load_f32(p, d, i); }

// A host matrix in a dtype with its rounded float values, and a device copy.
struct Mat {
  lwo_dtype_t dt;
  size_t n;
  std::vector<uint8_t> bytes;
  std::vector<float> vals;
  testkit::DeviceMem mem;
  void* dev = nullptr;
  Mat(lwo_dtype_t d, size_t count, std::mt19937_64& rng, float scale) : dt(d), n(count) {
    bytes.resize(n * esize(d));
    vals.resize(n);
    std::uniform_real_distribution<float> u(-scale, scale);
    for (size_t i = 0; i < n; ++i) vals[i] = store(bytes.data(), i, u(rng), d);
  }
  cudaError_t upload() {
    cudaError_t e = cudaMalloc(mem.out(), bytes.size());
    if (e != cudaSuccess) return e;
    dev = mem.get();
    return cudaMemcpy(dev, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
  }
};

// A device output, poisoned (all bits set: NaN in every float format).
struct Out {
  size_t bytes;
  testkit::DeviceMem mem;
  void* dev = nullptr;
  explicit Out(size_t b) : bytes(b) {}
  cudaError_t alloc() {
    cudaError_t e = cudaMalloc(mem.out(), bytes);
    if (e != cudaSuccess) return e;
    dev = mem.get();
    return cudaMemset(dev, 0xff, bytes);
  }
  std::vector<uint8_t> fetch() const {
    std::vector<uint8_t> h(bytes);
    EXPECT_EQ(cudaSuccess, cudaMemcpy(h.data(), dev, bytes, cudaMemcpyDeviceToHost));
    return h;
  }
};

// ||got - ref|| / ||ref||; NaN anywhere (an element never written) gives inf.
double rel_err(const std::vector<uint8_t>& got, lwo_dtype_t d, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    double g = load(got.data(), i, d);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double tol_for(lwo_dtype_t out, bool tf32, bool f32_from_half) {
  if (out == LWO_DTYPE_BF16) return 1e-2;
  if (out == LWO_DTYPE_F16) return 2e-3;
  if (tf32) return 5e-3;
  return f32_from_half ? 1e-5 : 2e-5;
}

struct Shape {
  int64_t t, in, out;
};

class Compute : public GpuTest {};

TEST_F(Compute, LinearMatchesFp64Reference) {
  std::vector<Shape> shapes = {{1, 1, 1},     {1, 7, 5},       {3, 17, 33},    {17, 100, 129},
                               {64, 255, 64}, {257, 96, 1000}, {1000, 1024, 17}, {4096, 128, 192},
                               {8192, 24, 40}};
  std::mt19937_64 rng(test_seed(2024));
  for (int i = 0; i < 4; ++i) {  // and a few random ones
    int64_t t = 1 + rng() % 8192, in = 1 + rng() % 300, out = 1 + rng() % 300;
    while (t * in * out > 20000000) t = 1 + t / 2;
    shapes.push_back({t, in, out});
  }
  struct Mode {
    lwo_dtype_t dt;
    bool tf32;
  };
  for (Mode mode : {Mode{LWO_DTYPE_BF16, false}, Mode{LWO_DTYPE_F16, false},
                    Mode{LWO_DTYPE_F32, false}, Mode{LWO_DTYPE_F32, true}}) {
    for (const Shape& s : shapes) {
      for (int bias = 0; bias < 2; ++bias) {
        SCOPED_TRACE(std::string(lwo_dtype_name(mode.dt)) + (mode.tf32 ? "+tf32" : "") + " T=" +
                     std::to_string(s.t) + " in=" + std::to_string(s.in) + " out=" +
                     std::to_string(s.out) + (bias ? " bias" : ""));
        Mat x(mode.dt, s.t * s.in, rng, 1.f), w(mode.dt, s.out * s.in, rng, 1.f / std::sqrt(float(s.in))),
            b(mode.dt, s.out, rng, 1.f), dy(mode.dt, s.t * s.out, rng, 1.f);
        CUDA_OK(x.upload());
        CUDA_OK(w.upload());
        CUDA_OK(b.upload());
        CUDA_OK(dy.upload());
        Out y(s.t * s.out * esize(mode.dt)), dx(s.t * s.in * esize(mode.dt)),
            dw(s.out * s.in * 4), db(s.out * 4);
        CUDA_OK(y.alloc());
        CUDA_OK(dx.alloc());
        CUDA_OK(dw.alloc());
        CUDA_OK(db.alloc());
        lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
        d.dtype = mode.dt;
        d.in_features = s.in;
        d.out_features = s.out;
        d.flags = (bias ? LWO_LINEAR_BIAS : 0u) | (mode.tf32 ? LWO_LINEAR_TF32 : 0u);
        cudaStream_t st = stream(0);
        CHECK_LWO(lwo_linear_forward(engine_, &d, s.t, x.dev, w.dev, b.dev, y.dev, st));
        CHECK_LWO(lwo_linear_backward(engine_, &d, s.t, x.dev, dy.dev, w.dev, dx.dev, dw.dev,
                                      bias ? db.dev : nullptr, LWO_DTYPE_F32, st));
        CUDA_OK(cudaStreamSynchronize(st));
        // fp64 reference on the dtype-rounded inputs.
        std::vector<double> ry(s.t * s.out), rdx(s.t * s.in, 0.0), rdw(s.out * s.in, 0.0),
            rdb(s.out, 0.0);
        for (int64_t t = 0; t < s.t; ++t)
          for (int64_t o = 0; o < s.out; ++o) {
            double acc = bias ? b.vals[o] : 0.0;
            for (int64_t k = 0; k < s.in; ++k) acc += double(x.vals[t * s.in + k]) * w.vals[o * s.in + k];
            ry[t * s.out + o] = acc;
            double g = dy.vals[t * s.out + o];
            rdb[o] += g;
            for (int64_t k = 0; k < s.in; ++k) {
              rdx[t * s.in + k] += g * w.vals[o * s.in + k];
              rdw[o * s.in + k] += g * x.vals[t * s.in + k];
            }
          }
        bool half_in = mode.dt != LWO_DTYPE_F32;
        EXPECT_LT(rel_err(y.fetch(), mode.dt, ry), tol_for(mode.dt, mode.tf32, half_in)) << "y";
        EXPECT_LT(rel_err(dx.fetch(), mode.dt, rdx), tol_for(mode.dt, mode.tf32, half_in)) << "dx";
        EXPECT_LT(rel_err(dw.fetch(), LWO_DTYPE_F32, rdw), tol_for(LWO_DTYPE_F32, mode.tf32, half_in))
            << "dW";
        if (bias) {
          EXPECT_LT(rel_err(db.fetch(), LWO_DTYPE_F32, rdb), 1e-5) << "db";
        }
        if (HasFailure()) return;
      }
    }
  }
}

// A pool of L layers (weight [out, in] + bias [out], bf16), streamed through
// rings of every depth over a forward + backward order; y, dx and the host
// gradients (two micro-batches, f32 on the wire) must equal the resident
// computation bit for bit.
TEST_F(Compute, StreamedEqualsResidentBitForBit) {
  const uint32_t L = 5;
  const int64_t T = 77, IN = 300, OUT = 200;
  const lwo_dtype_t DT = LWO_DTYPE_BF16;
  std::mt19937_64 rng(test_seed(77));
  lwo_tensor_desc td[2] = {};
  td[0] = tensor_desc("weight", DT, {OUT, IN});
  td[1] = tensor_desc("bias", DT, {OUT});
  std::vector<lwo_layer_desc> layers(L, lwo_layer_desc{td, 2, nullptr});
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_pinned(engine_, layers.data(), L, nullptr, &pool));
  auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  // Weights, and resident copies of them.
  std::vector<std::unique_ptr<Mat>> W, B, X[2], DY[2];
  for (uint32_t l = 0; l < L; ++l) {
    W.push_back(std::make_unique<Mat>(DT, OUT * IN, rng, 0.05f));
    B.push_back(std::make_unique<Mat>(DT, OUT, rng, 1.f));
    CUDA_OK(W[l]->upload());
    CUDA_OK(B[l]->upload());
    CHECK_LWO(lwo_pool_write(pool, l, "weight", W[l]->bytes.data(), W[l]->bytes.size()));
    CHECK_LWO(lwo_pool_write(pool, l, "bias", B[l]->bytes.data(), B[l]->bytes.size()));
    for (int m = 0; m < 2; ++m) {
      X[m].push_back(std::make_unique<Mat>(DT, T * IN, rng, 1.f));
      DY[m].push_back(std::make_unique<Mat>(DT, T * OUT, rng, 1.f));
      CUDA_OK(X[m][l]->upload());
      CUDA_OK(DY[m][l]->upload());
    }
  }
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.dtype = DT;
  d.in_features = IN;
  d.out_features = OUT;
  d.flags = LWO_LINEAR_BIAS;
  cudaStream_t st = stream(0);
  // Resident: y, dx, dW, db per layer and micro-batch.
  size_t ybytes = T * OUT * 2, dxbytes = T * IN * 2;
  std::vector<std::vector<uint8_t>> ry(2 * L), rdx(2 * L);
  std::vector<std::vector<float>> rdw(L, std::vector<float>(OUT * IN, 0.f)), rdb(L, std::vector<float>(OUT, 0.f));
  for (int m = 0; m < 2; ++m)
    for (uint32_t l = 0; l < L; ++l) {
      Out y(ybytes), dx(dxbytes), dw(OUT * IN * 4), db(OUT * 4);
      CUDA_OK(y.alloc());
      CUDA_OK(dx.alloc());
      CUDA_OK(dw.alloc());
      CUDA_OK(db.alloc());
      CHECK_LWO(lwo_linear_forward(engine_, &d, T, X[m][l]->dev, W[l]->dev, B[l]->dev, y.dev, st));
      CHECK_LWO(lwo_linear_backward(engine_, &d, T, X[m][l]->dev, DY[m][l]->dev, W[l]->dev, dx.dev,
                                    dw.dev, db.dev, LWO_DTYPE_F32, st));
      CUDA_OK(cudaStreamSynchronize(st));
      ry[m * L + l] = y.fetch();
      rdx[m * L + l] = dx.fetch();
      std::vector<uint8_t> gw = dw.fetch(), gb = db.fetch();
      for (int64_t i = 0; i < OUT * IN; ++i) rdw[l][i] += reinterpret_cast<float*>(gw.data())[i];
      for (int64_t i = 0; i < OUT; ++i) rdb[l][i] += reinterpret_cast<float*>(gb.data())[i];
    }
  const std::vector<uint32_t> order = forward_backward(L);
  for (uint32_t depth = 1; depth <= 8; ++depth) {
    SCOPED_TRACE("depth " + std::to_string(depth));
    Ring ring;
    create_ring(pool, depth, 0, &ring);
    if (HasFatalFailure()) return;
    lwo_grads* grads = nullptr;
    lwo_grads_config f32 = LWO_GRADS_CONFIG_INIT;
    f32.flags = LWO_GRADS_F32;  // f32 gradients, compared with lwo_grads_shard
    CHECK_LWO(lwo_grads_create(pool, nullptr, &f32, &grads));
    auto gguard = defer([&] { EXPECT_LWO_OK(lwo_grads_destroy(grads)); });
    Schedule sched;
    CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()), sched.out()));
    Out y(ybytes), dx(dxbytes);
    CUDA_OK(y.alloc());
    CUDA_OK(dx.alloc());
    for (int m = 0; m < 2; ++m) {
      CHECK_LWO(lwo_schedule_reset(sched.get(), st));
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      for (size_t pos = 0; pos < order.size(); ++pos) {
        CHECK_LWO(lwo_schedule_next(sched.get(), st, &v));
        uint32_t l = v.layer;
        if (pos < L) {
          CHECK_LWO(lwo_linear_forward(engine_, &d, T, X[m][l]->dev, v.tensors[0], v.tensors[1], y.dev, st));
          CUDA_OK(cudaStreamSynchronize(st));
          EXPECT_EQ(y.fetch(), ry[m * L + l]) << "y of layer " << l;
        } else {
          lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
          CHECK_LWO(lwo_grads_begin(grads, l, st, &gv));
          CHECK_LWO(lwo_linear_backward(engine_, &d, T, X[m][l]->dev, DY[m][l]->dev, v.tensors[0],
                                        dx.dev, gv.tensors[0], gv.tensors[1], LWO_DTYPE_F32, st));
          CHECK_LWO(lwo_grads_end(grads, l, st));
          CUDA_OK(cudaStreamSynchronize(st));
          EXPECT_EQ(dx.fetch(), rdx[m * L + l]) << "dx of layer " << l;
        }
      }
      EXPECT_EQ(lwo_schedule_next(sched.get(), st, &v), LWO_END);
    }
    CHECK_LWO(lwo_grads_wait(grads));
    for (uint32_t l = 0; l < L; ++l) {
      float* h = nullptr;
      uint64_t first = 0, n = 0;
      CHECK_LWO(lwo_grads_shard(grads, l, "weight", &h, &first, &n));
      ASSERT_EQ(first, 0u);
      ASSERT_EQ(n, uint64_t(OUT * IN));
      EXPECT_EQ(0, std::memcmp(h, rdw[l].data(), n * 4)) << "dW of layer " << l;
      CHECK_LWO(lwo_grads_shard(grads, l, "bias", &h, &first, &n));
      ASSERT_EQ(first, 0u);
      EXPECT_EQ(0, std::memcmp(h, rdb[l].data(), n * 4)) << "db of layer " << l;
    }
    lwo_ring_stats rs = ring_stats(ring.get());
    EXPECT_GE(rs.n_hits, 2u * std::min<uint32_t>(depth, L));  // backward reuses resident layers
    CHECK_LWO(sched.reset());
  }
}

// The fence: gradients are not in host memory before lwo_grads_wait says so.
// The stream is held busy before the gradient is written, the host buffer is
// poisoned, and it must still be poison right after lwo_grads_end.
TEST_F(Compute, GradientsAppearOnlyThroughTheFence) {
  const int64_t T = 64, IN = 96, OUT = 80;
  std::mt19937_64 rng(test_seed(5));
  lwo_tensor_desc td = tensor_desc("weight", LWO_DTYPE_F32, {OUT, IN});
  lwo_layer_desc ld{&td, 1, nullptr};
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_pinned(engine_, &ld, 1, nullptr, &pool));
  auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  Mat x(LWO_DTYPE_F32, T * IN, rng, 1.f), dy(LWO_DTYPE_F32, T * OUT, rng, 1.f);
  CUDA_OK(x.upload());
  CUDA_OK(dy.upload());
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.dtype = LWO_DTYPE_F32;
  d.in_features = IN;
  d.out_features = OUT;
  Out ref(OUT * IN * 4);
  CUDA_OK(ref.alloc());
  cudaStream_t st = stream(0);
  CHECK_LWO(lwo_linear_backward(engine_, &d, T, x.dev, dy.dev, nullptr, nullptr, ref.dev, nullptr,
                                LWO_DTYPE_F32, st));
  CUDA_OK(cudaStreamSynchronize(st));
  std::vector<uint8_t> want = ref.fetch();
  for (uint32_t flags : {0u, LWO_GRADS_NATIVE_WIRE}) {
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    gc.flags = flags;
    lwo_grads* grads = nullptr;
    CHECK_LWO(lwo_grads_create(pool, nullptr, &gc, &grads));
    auto gguard = defer([&] { EXPECT_LWO_OK(lwo_grads_destroy(grads)); });
    for (int round = 0; round < 2; ++round) {  // in place (fresh), then accumulated
      float* h = nullptr;
      uint64_t first = 0, n = 0;
      CHECK_LWO(lwo_grads_shard(grads, 0, "weight", &h, &first, &n));
      ASSERT_EQ(first, 0u);
      CHECK_LWO(lwo_grads_zero(grads));
      CHECK_LWO(lwo_grads_wait(grads));
      if (round == 1) {  // start from a known sum: one gradient already in
        lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
        CHECK_LWO(lwo_grads_begin(grads, 0, st, &gv));
        CHECK_LWO(lwo_linear_backward(engine_, &d, T, x.dev, dy.dev, nullptr, nullptr, gv.tensors[0],
                                      nullptr, LWO_DTYPE_F32, st));
        CHECK_LWO(lwo_grads_end(grads, 0, st));
        CHECK_LWO(lwo_grads_wait(grads));
      }
      std::vector<float> before(h, h + n);
      for (uint64_t i = 0; round == 0 && i < n; ++i) h[i] = NAN;  // poison the fresh buffer
      CUDA_OK(lwo::kernels::spin_async(300000, st));  // 300 ms
      lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
      CHECK_LWO(lwo_grads_begin(grads, 0, st, &gv));
      CHECK_LWO(lwo_linear_backward(engine_, &d, T, x.dev, dy.dev, nullptr, nullptr, gv.tensors[0],
                                    nullptr, LWO_DTYPE_F32, st));
      CHECK_LWO(lwo_grads_end(grads, 0, st));
      // Nothing has landed yet: the stream is still spinning.
      size_t unchanged = 0;
      for (uint64_t i = 0; i < n; ++i)
        unchanged += round == 0 ? std::isnan(h[i]) : (h[i] == before[i]);
      EXPECT_EQ(unchanged, n) << "gradient bytes reached the host before the fence";
      CHECK_LWO(lwo_grads_wait(grads));
      const float* w = reinterpret_cast<const float*>(want.data());
      for (uint64_t i = 0; i < n; ++i) {
        float expect = round == 0 ? w[i] : before[i] + w[i];
        ASSERT_EQ(h[i], expect) << "element " << i << (flags ? " native wire" : " f32 wire");
      }
    }
  }
}

TEST_F(Compute, FrozenLayersMoveNoGradient) {
  const uint32_t L = 4;
  lwo_tensor_desc td = tensor_desc("weight", LWO_DTYPE_BF16, {64, 48});
  std::vector<lwo_layer_desc> layers(L, lwo_layer_desc{&td, 1, nullptr});
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_pinned(engine_, layers.data(), L, nullptr, &pool));
  auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  uint8_t trainable[L] = {1, 0, 1, 0};
  lwo_grads* grads = nullptr;
  lwo_grads_config f32 = LWO_GRADS_CONFIG_INIT;
  f32.flags = LWO_GRADS_F32;  // 64 x 48 f32 gradients per layer on the wire
  CHECK_LWO(lwo_grads_create(pool, trainable, &f32, &grads));
  auto gguard = defer([&] { EXPECT_LWO_OK(lwo_grads_destroy(grads)); });
  lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_grads_begin", lwo_grads_begin(grads, 1, stream(0), &gv));
  for (uint32_t l : {0u, 2u}) {
    CHECK_LWO(lwo_grads_begin(grads, l, stream(0), &gv));
    CUDA_OK(cudaMemsetAsync(gv.tensors[0], 0, 64 * 48 * 4, stream(0)));
    CHECK_LWO(lwo_grads_end(grads, l, stream(0)));
  }
  CHECK_LWO(lwo_grads_wait(grads));
  lwo_grads_stats gs{};
  gs.size = sizeof gs;
  CHECK_LWO(lwo_grads_get_stats(grads, &gs));
  EXPECT_EQ(gs.n_transfers, 2u);
  EXPECT_EQ(gs.bytes, 2u * 64 * 48 * 4);
}


// ---- gradients in every dtype, in both accumulation orders ----

// The host gradient of tensor `name` (lwo_grads_tensor), as bytes.
std::vector<uint8_t> host_grad(lwo_grads* g, uint32_t layer, const char* name, lwo_dtype_t* dtype) {
  lwo_grad_tensor t = LWO_GRAD_TENSOR_INIT;
  EXPECT_EQ(lwo_grads_tensor(g, layer, name, &t), LWO_OK) << lwo_last_error_message();
  *dtype = t.dtype;
  const uint8_t* p = static_cast<const uint8_t*>(t.data);
  return p ? std::vector<uint8_t>(p, p + t.n_elements * esize(t.dtype)) : std::vector<uint8_t>{};
}

// Gradients of one linear layer summed over K micro-batches, for every layer
// dtype and every wire (native, LWO_GRADS_F32, LWO_GRADS_NATIVE_WIRE), in both
// orders: batch-major (each micro-batch ended on its own and summed on the
// host) and layer-major (summed in the slot with LWO_LINEAR_ACCUMULATE, one
// end). Bit for bit against the same arithmetic done resident (device
// buffers; the host sums done here with the library's rounding), and within a
// tolerance of the fp64 sum.
TEST_F(Compute, GradientOrdersAndWiresMatchResidentAndFp64) {
  const int64_t T = 48, IN = 72, OUT = 40;
  const int K = 3;
  struct Mode {
    uint32_t flags;
    const char* name;
  };
  const Mode modes[] = {{0u, "native"}, {LWO_GRADS_F32, "f32"}, {LWO_GRADS_NATIVE_WIRE, "native wire"}};
  for (lwo_dtype_t dt : {LWO_DTYPE_BF16, LWO_DTYPE_F16, LWO_DTYPE_F32})
    for (const Mode& mode : modes)
      for (bool layer_major : {false, true}) {
        SCOPED_TRACE(std::string(lwo_dtype_name(dt)) + ", " + mode.name + ", " +
                     (layer_major ? "layer-major" : "batch-major"));
        std::mt19937_64 rng(test_seed(900 + dt * 10 + mode.flags * 2 + layer_major));
        lwo_tensor_desc td[2] = {};
        td[0] = tensor_desc("weight", dt, {OUT, IN});
        td[1] = tensor_desc("bias", dt, {OUT});
        lwo_layer_desc ld{td, 2, nullptr};
        lwo_pool* pool = nullptr;
        CHECK_LWO(lwo_pool_create_pinned(engine_, &ld, 1, nullptr, &pool));
        auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
        std::vector<std::unique_ptr<Mat>> X, DY;
        for (int k = 0; k < K; ++k) {
          X.push_back(std::make_unique<Mat>(dt, T * IN, rng, 1.f));
          DY.push_back(std::make_unique<Mat>(dt, T * OUT, rng, 1.f));
          CUDA_OK(X[k]->upload());
          CUDA_OK(DY[k]->upload());
        }
        lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
        gc.flags = mode.flags;
        lwo_grads* grads = nullptr;
        CHECK_LWO(lwo_grads_create(pool, nullptr, &gc, &grads));
        auto gguard = defer([&] { EXPECT_LWO_OK(lwo_grads_destroy(grads)); });
        const lwo_dtype_t wire = mode.flags == LWO_GRADS_F32 ? LWO_DTYPE_F32 : dt;
        const lwo_dtype_t host = mode.flags == 0 ? dt : LWO_DTYPE_F32;
        lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
        d.dtype = dt;
        d.in_features = IN;
        d.out_features = OUT;
        auto flags_for = [&](int k) {
          return LWO_LINEAR_BIAS | (layer_major && k > 0 ? LWO_LINEAR_ACCUMULATE : 0u);
        };
        cudaStream_t st = stream(0);
        // Through lwo_grads.
        lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
        for (int k = 0; k < K; ++k) {
          if (k == 0 || !layer_major) {
            CHECK_LWO(lwo_grads_begin(grads, 0, st, &gv));
            ASSERT_EQ(gv.tensor_dtypes[0], wire);
          }
          d.flags = flags_for(k);
          CHECK_LWO(lwo_linear_backward(engine_, &d, T, X[k]->dev, DY[k]->dev, nullptr, nullptr,
                                        gv.tensors[0], gv.tensors[1], wire, st));
          if (k == K - 1 || !layer_major) CHECK_LWO(lwo_grads_end(grads, 0, st));
        }
        CHECK_LWO(lwo_grads_wait(grads));
        lwo_grads_stats gs{};
        gs.size = sizeof gs;
        CHECK_LWO(lwo_grads_get_stats(grads, &gs));
        EXPECT_EQ(gs.n_transfers, layer_major ? 1u : uint64_t(K));
        EXPECT_EQ(gs.n_accumulated, layer_major ? (wire == host ? 0u : 1u)
                                                : uint64_t(wire == host ? K - 1 : K));
        // Resident: the same calls into device buffers, the host sums here.
        std::vector<uint8_t> want_w(OUT * IN * esize(host)), want_b(OUT * esize(host));
        Out rw(OUT * IN * esize(wire)), rb(OUT * esize(wire));
        CUDA_OK(rw.alloc());
        CUDA_OK(rb.alloc());
        auto host_add = [&](std::vector<uint8_t>& sum, const std::vector<uint8_t>& part, size_t n,
                            bool first) {
          for (size_t i = 0; i < n; ++i)
            store(sum.data(), i, first ? load(part.data(), i, wire)
                                       : load(sum.data(), i, host) + load(part.data(), i, wire),
                  host);
        };
        for (int k = 0; k < K; ++k) {
          d.flags = flags_for(k);
          CHECK_LWO(lwo_linear_backward(engine_, &d, T, X[k]->dev, DY[k]->dev, nullptr, nullptr,
                                        rw.dev, rb.dev, wire, st));
          CUDA_OK(cudaStreamSynchronize(st));
          if (!layer_major) {
            host_add(want_w, rw.fetch(), OUT * IN, k == 0);
            host_add(want_b, rb.fetch(), OUT, k == 0);
          }
        }
        if (layer_major) {
          host_add(want_w, rw.fetch(), OUT * IN, true);
          host_add(want_b, rb.fetch(), OUT, true);
        }
        lwo_dtype_t got_dt = LWO_DTYPE_F32;
        std::vector<uint8_t> got_w = host_grad(grads, 0, "weight", &got_dt);
        EXPECT_EQ(got_dt, host);
        std::vector<uint8_t> got_b = host_grad(grads, 0, "bias", &got_dt);
        EXPECT_TRUE(got_w == want_w) << "weight gradient differs from the resident computation";
        EXPECT_TRUE(got_b == want_b) << "bias gradient differs from the resident computation";
        // fp64: the sum over micro-batches of dy^T x and of dy over tokens.
        std::vector<double> ref_w(OUT * IN, 0.0), ref_b(OUT, 0.0);
        for (int k = 0; k < K; ++k)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t o = 0; o < OUT; ++o) {
              const double g = DY[k]->vals[t * OUT + o];
              ref_b[o] += g;
              for (int64_t i = 0; i < IN; ++i) ref_w[o * IN + i] += g * X[k]->vals[t * IN + i];
            }
        // The coarsest rounding on the way sets the tolerance, a little wider
        // for K sums in a 16-bit dtype.
        const lwo_dtype_t coarse = wire != LWO_DTYPE_F32 ? wire : host;
        const double tol = tol_for(coarse, false, dt != LWO_DTYPE_F32) * (coarse == LWO_DTYPE_F32 ? 1 : 1.5);
        EXPECT_LE(rel_err(got_w, host, ref_w), tol) << "dW against fp64";
        EXPECT_LE(rel_err(got_b, host, ref_b), tol) << "db against fp64";
      }
}

// The fence for the native default: a bf16 gradient that lands in place
// (fresh) and one added on the host both stay invisible until lwo_grads_wait.
TEST_F(Compute, NativeGradientsAppearOnlyThroughTheFence) {
  const int64_t T = 64, IN = 96, OUT = 80;
  std::mt19937_64 rng(test_seed(6));
  lwo_tensor_desc td = tensor_desc("weight", LWO_DTYPE_BF16, {OUT, IN});
  lwo_layer_desc ld{&td, 1, nullptr};
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_pinned(engine_, &ld, 1, nullptr, &pool));
  auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  Mat x(LWO_DTYPE_BF16, T * IN, rng, 1.f), dy(LWO_DTYPE_BF16, T * OUT, rng, 1.f);
  CUDA_OK(x.upload());
  CUDA_OK(dy.upload());
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.in_features = IN;
  d.out_features = OUT;
  Out ref(OUT * IN * 2);
  CUDA_OK(ref.alloc());
  cudaStream_t st = stream(0);
  CHECK_LWO(lwo_linear_backward(engine_, &d, T, x.dev, dy.dev, nullptr, nullptr, ref.dev, nullptr,
                                LWO_DTYPE_BF16, st));
  CUDA_OK(cudaStreamSynchronize(st));
  const std::vector<uint8_t> want = ref.fetch();
  lwo_grads* grads = nullptr;
  CHECK_LWO(lwo_grads_create(pool, nullptr, nullptr, &grads));
  auto gguard = defer([&] { EXPECT_LWO_OK(lwo_grads_destroy(grads)); });
  lwo_grad_tensor t = LWO_GRAD_TENSOR_INIT;
  CHECK_LWO(lwo_grads_tensor(grads, 0, "weight", &t));
  ASSERT_EQ(t.dtype, LWO_DTYPE_BF16);
  auto* h = static_cast<uint16_t*>(t.data);
  const uint64_t n = t.n_elements;
  for (int round = 0; round < 2; ++round) {  // in place (fresh), then added on the host
    CHECK_LWO(lwo_grads_zero(grads));
    CHECK_LWO(lwo_grads_wait(grads));
    if (round == 1) {  // one gradient already in
      lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
      CHECK_LWO(lwo_grads_begin(grads, 0, st, &gv));
      CHECK_LWO(lwo_linear_backward(engine_, &d, T, x.dev, dy.dev, nullptr, nullptr, gv.tensors[0],
                                    nullptr, LWO_DTYPE_BF16, st));
      CHECK_LWO(lwo_grads_end(grads, 0, st));
      CHECK_LWO(lwo_grads_wait(grads));
    }
    if (round == 0)
      for (uint64_t i = 0; i < n; ++i) h[i] = 0xffff;  // poison (NaN) the fresh buffer
    std::vector<uint16_t> before(h, h + n);
    CUDA_OK(lwo::kernels::spin_async(300000, st));  // 300 ms
    lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
    CHECK_LWO(lwo_grads_begin(grads, 0, st, &gv));
    CHECK_LWO(lwo_linear_backward(engine_, &d, T, x.dev, dy.dev, nullptr, nullptr, gv.tensors[0],
                                  nullptr, LWO_DTYPE_BF16, st));
    CHECK_LWO(lwo_grads_end(grads, 0, st));
    EXPECT_TRUE(std::equal(before.begin(), before.end(), h))
        << "gradient bytes reached the host before the fence (round " << round << ")";
    CHECK_LWO(lwo_grads_wait(grads));
    const auto* w = reinterpret_cast<const uint16_t*>(want.data());
    for (uint64_t i = 0; i < n; ++i) {
      const uint16_t expect =
          round == 0 ? w[i] : testkit::f32_to_bf16(testkit::bf16_to_f32(before[i]) + testkit::bf16_to_f32(w[i]));
      ASSERT_EQ(h[i], expect) << "element " << i << " round " << round;
    }
  }
}

// ---- conv2d ----

struct ConvCase {
  lwo_layout_t layout;
  int32_t n, c, h, w, k, kh, kw, sh, sw, ph, pw, dh, dw, g;
  bool bias;
};

TEST_F(Compute, Conv2dMatchesFp64Reference) {
  std::vector<ConvCase> cases = {
      {LWO_LAYOUT_NHWC, 2, 8, 9, 7, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1, true},
      {LWO_LAYOUT_NCHW, 2, 8, 9, 7, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1, true},
      {LWO_LAYOUT_NHWC, 1, 6, 11, 10, 12, 3, 2, 2, 1, 0, 1, 1, 2, 3, false},
      {LWO_LAYOUT_NCHW, 3, 4, 8, 8, 8, 1, 1, 2, 2, 0, 0, 1, 1, 1, true},
      {LWO_LAYOUT_NCHW, 2, 6, 10, 9, 6, 3, 3, 1, 2, 2, 1, 2, 1, 6, true},   // depthwise
      {LWO_LAYOUT_NHWC, 4, 32, 14, 14, 32, 3, 3, 1, 1, 1, 1, 1, 1, 1, true},
  };
  std::mt19937_64 rng(test_seed(33));
  for (lwo_dtype_t dt : {LWO_DTYPE_BF16, LWO_DTYPE_F16, LWO_DTYPE_F32}) {
    for (const ConvCase& cc : cases) {
      bool nhwc = cc.layout == LWO_LAYOUT_NHWC;
      SCOPED_TRACE(std::string(lwo_dtype_name(dt)) + (nhwc ? " NHWC" : " NCHW") + " c=" +
                   std::to_string(cc.c) + " k=" + std::to_string(cc.k) + " g=" + std::to_string(cc.g));
      lwo_conv2d_desc d = LWO_CONV2D_DESC_INIT;
      d.dtype = dt;
      d.layout = cc.layout;
      d.flags = cc.bias ? LWO_CONV_BIAS : 0u;
      d.in_channels = cc.c;
      d.out_channels = cc.k;
      d.kernel_h = cc.kh;
      d.kernel_w = cc.kw;
      d.stride_h = cc.sh;
      d.stride_w = cc.sw;
      d.pad_h = cc.ph;
      d.pad_w = cc.pw;
      d.dilation_h = cc.dh;
      d.dilation_w = cc.dw;
      d.groups = cc.g;
      int32_t oh = 0, ow = 0;
      CHECK_LWO(lwo_conv2d_output_size(&d, cc.h, cc.w, &oh, &ow));
      int32_t cg = cc.c / cc.g;
      Mat x(dt, size_t(cc.n) * cc.c * cc.h * cc.w, rng, 1.f);
      Mat wt(dt, size_t(cc.k) * cg * cc.kh * cc.kw, rng, 0.3f);
      Mat b(dt, cc.k, rng, 1.f);
      Mat dy(dt, size_t(cc.n) * cc.k * oh * ow, rng, 1.f);
      CUDA_OK(x.upload());
      CUDA_OK(wt.upload());
      CUDA_OK(b.upload());
      CUDA_OK(dy.upload());
      Out y(dy.n * esize(dt)), dx(x.n * esize(dt)), dw(wt.n * 4), db(size_t(cc.k) * 4);
      CUDA_OK(y.alloc());
      CUDA_OK(dx.alloc());
      CUDA_OK(dw.alloc());
      CUDA_OK(db.alloc());
      cudaStream_t st = stream(0);
      CHECK_LWO(lwo_conv2d_forward(engine_, &d, cc.n, cc.h, cc.w, x.dev, wt.dev, b.dev, y.dev, st));
      CHECK_LWO(lwo_conv2d_backward(engine_, &d, cc.n, cc.h, cc.w, x.dev, dy.dev, wt.dev, dx.dev,
                                    dw.dev, cc.bias ? db.dev : nullptr, LWO_DTYPE_F32, st));
      CUDA_OK(cudaStreamSynchronize(st));
      // fp64 reference (testkit/conv_ref.h).
      const testkit::ConvShape shape{nhwc,  cc.n,  cc.c,  cc.h,  cc.w,  cc.k,  cc.kh, cc.kw,
                                     cc.sh, cc.sw, cc.ph, cc.pw, cc.dh, cc.dw, cc.g};
      ASSERT_EQ(oh, shape.out_h());
      ASSERT_EQ(ow, shape.out_w());
      std::vector<double> ry, rdx, rdw, rdb;
      testkit::conv2d_reference(shape, x.vals, wt.vals, cc.bias ? &b.vals : nullptr, dy.vals, &ry,
                                &rdx, &rdw, &rdb);
      EXPECT_LT(rel_err(y.fetch(), dt, ry), tol_for(dt, false, dt != LWO_DTYPE_F32)) << "y";
      EXPECT_LT(rel_err(dx.fetch(), dt, rdx), tol_for(dt, false, dt != LWO_DTYPE_F32)) << "dx";
      // cuDNN rounds the filter gradient to the layer dtype before it is widened.
      EXPECT_LT(rel_err(dw.fetch(), LWO_DTYPE_F32, rdw), dt == LWO_DTYPE_F32 ? 2e-5 : tol_for(dt, false, true))
          << "dW";
      if (cc.bias) {
        EXPECT_LT(rel_err(db.fetch(), LWO_DTYPE_F32, rdb), 1e-5) << "db";
      }
      if (HasFailure()) return;
    }
  }
}

// A conv layer streamed from a ring slot computes exactly what its resident
// twin computes.
TEST_F(Compute, Conv2dStreamedEqualsResident) {
  std::mt19937_64 rng(test_seed(34));
  const int32_t N = 4, C = 16, H = 12, W = 12, K = 24;
  const lwo_conv2d_desc d = lwo_conv_test::conv3x3_desc(C, K, LWO_CONV_BIAS);
  lwo_tensor_desc td[2] = {};
  td[0] = tensor_desc("weight", LWO_DTYPE_BF16, {K, 3, 3, C});
  td[1] = tensor_desc("bias", LWO_DTYPE_BF16, {K});
  const uint32_t L = 3;
  std::vector<lwo_layer_desc> layers(L, lwo_layer_desc{td, 2, nullptr});
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_pinned(engine_, layers.data(), L, nullptr, &pool));
  auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  std::vector<std::unique_ptr<Mat>> Wt, B;
  for (uint32_t l = 0; l < L; ++l) {
    Wt.push_back(std::make_unique<Mat>(LWO_DTYPE_BF16, size_t(K) * 9 * C, rng, 0.2f));
    B.push_back(std::make_unique<Mat>(LWO_DTYPE_BF16, K, rng, 1.f));
    CUDA_OK(Wt[l]->upload());
    CUDA_OK(B[l]->upload());
    CHECK_LWO(lwo_pool_write(pool, l, "weight", Wt[l]->bytes.data(), Wt[l]->bytes.size()));
    CHECK_LWO(lwo_pool_write(pool, l, "bias", B[l]->bytes.data(), B[l]->bytes.size()));
  }
  Mat x(LWO_DTYPE_BF16, size_t(N) * H * W * C, rng, 1.f);
  CUDA_OK(x.upload());
  Ring ring;
  create_ring(pool, 2, 0, &ring);
  if (HasFatalFailure()) return;
  cudaStream_t st = stream(0);
  size_t ybytes = size_t(N) * H * W * K * 2;
  for (uint32_t l = 0; l < L; ++l) {
    Out yr(ybytes), ys(ybytes);
    CUDA_OK(yr.alloc());
    CUDA_OK(ys.alloc());
    CHECK_LWO(lwo_conv2d_forward(engine_, &d, N, H, W, x.dev, Wt[l]->dev, B[l]->dev, yr.dev, st));
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), l, st, &t, &v));
    CHECK_LWO(lwo_conv2d_forward(engine_, &d, N, H, W, x.dev, v.tensors[0], v.tensors[1], ys.dev, st));
    CHECK_LWO(lwo_ring_release(ring.get(), t, st));
    CUDA_OK(cudaStreamSynchronize(st));
    EXPECT_EQ(ys.fetch(), yr.fetch()) << "layer " << l;
  }
}

}  // namespace
}  // namespace lwo_test
