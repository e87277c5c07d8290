// 2-D convolutions on quantized weights: a conv layer whose
// weight is a quantized record tensor (LWO_EXT_TENSOR_QUANT, declared 2-D
// [out_channels, in_channels / groups * kh * kw] and filled by
// lwo_pool_write_quantized) computes forward and backward-data from its ring
// slot (lwo_conv2d_desc.weight_format). For every format, dtype, layout and
// on normal and heavy-tailed weights, the slot's y and dx equal, bit for bit,
// the dense convolution on the weight lwo_dequantize_host dequantizes (the
// very values the device dequantizes to, run through the same cached cuDNN
// algorithm) and the same calls on a resident device copy of the quantized
// tensor; both are also within the dense convolutions' tolerance of an fp64
// CPU reference on the dequantized weights (bf16 1e-2, f16 2e-3, f32 2e-5:
// what remains is cuDNN's f32 accumulation and the output rounding). The
// weight workspace grows for a larger weight; gradients of a quantized
// weight are refused and every object stays usable.
#include "gpu_util.h"
#include "quant_util.h"
#include "testkit/conv_ref.h"
#include "testkit/dtype.h"

namespace lwo_test {
namespace {

int64_t weight_cols(const testkit::ConvShape& s) { return int64_t(s.c / s.g) * s.kh * s.kw; }

lwo_conv2d_desc conv_desc(const testkit::ConvShape& s, lwo_dtype_t dt, lwo_quant_format_t f) {
  lwo_conv2d_desc d = LWO_CONV2D_DESC_INIT;
  d.dtype = dt;
  d.layout = s.nhwc ? LWO_LAYOUT_NHWC : LWO_LAYOUT_NCHW;
  d.flags = LWO_CONV_BIAS;
  d.in_channels = s.c;
  d.out_channels = s.k;
  d.kernel_h = s.kh;
  d.kernel_w = s.kw;
  d.stride_h = s.sh;
  d.stride_w = s.sw;
  d.pad_h = s.ph;
  d.pad_w = s.pw;
  d.dilation_h = s.dh;
  d.dilation_w = s.dw;
  d.groups = s.g;
  d.weight_format = f;
  return d;
}

// A pool of `n` conv layers: "weight", the quantized [k, c/g * kh * kw] of
// logical dtype `dt` in format `f`, and "bias" [k] in `dt`.
struct QuantConvModel : QuantWeightPool {
  QuantConvModel(lwo_engine* e, lwo_quant_format_t f, lwo_dtype_t dt, const testkit::ConvShape& s,
                 uint32_t n)
      : QuantWeightPool(e, f, dt, s.k, weight_cols(s), n) {}
  // Quantizes fresh weights into `layer`, writes `bias`; returns the layer's
  // quantized bytes (host) and fills `dense` with their host dequantization.
  std::vector<uint8_t> fill(uint32_t layer, lwo_quant_format_t f, lwo_dtype_t dt,
                            const testkit::ConvShape& s, bool heavy, const HostMat& bias,
                            std::mt19937_64& rng, std::vector<uint8_t>* dense) {
    const int64_t cols = weight_cols(s);
    const std::vector<float> w = make_weights(s.k, cols, heavy, rng);
    EXPECT_EQ(LWO_OK, lwo_pool_write_quantized(pool.get(), layer, "weight", w.data(),
                                               LWO_DTYPE_F32, w.size() * 4, 0))
        << lwo_last_error_message();
    EXPECT_EQ(LWO_OK,
              lwo_pool_write(pool.get(), layer, "bias", bias.bytes.data(), bias.bytes.size()))
        << lwo_last_error_message();
    void* qh = nullptr;
    uint64_t qb = 0;
    EXPECT_EQ(LWO_OK, lwo_pool_tensor_host(pool.get(), layer, "weight", &qh, &qb))
        << lwo_last_error_message();
    std::vector<uint8_t> qbytes(static_cast<uint8_t*>(qh), static_cast<uint8_t*>(qh) + qb);
    lwo_quant_desc qd = LWO_QUANT_DESC_INIT;
    qd.format = f;
    qd.dtype = dt;
    qd.rows = s.k;
    qd.cols = cols;
    dense->assign(s.weight_elems() * lwo_dtype_size(dt), 0);
    EXPECT_EQ(LWO_OK, lwo_dequantize_host(&qd, qbytes.data(), qbytes.size(), dense->data(),
                                          dense->size(), 0))
        << lwo_last_error_message();
    return qbytes;
  }
};

// y and dx of one conv layer, fetched to the host.
struct Result {
  std::vector<uint8_t> y, dx;
};
Result run_conv(lwo_engine* e, const lwo_conv2d_desc& d, const testkit::ConvShape& s,
                const void* x, const void* dy, const void* w, const void* b, lwo_dtype_t dt,
                cudaStream_t st) {
  const size_t es = lwo_dtype_size(dt);
  const size_t ny = size_t(s.n) * s.k * s.out_h() * s.out_w() * es;
  const size_t nx = size_t(s.n) * s.c * s.h * s.w * es;
  testkit::DeviceMem yd = poisoned(ny), dxd = poisoned(nx);
  EXPECT_EQ(LWO_OK, lwo_conv2d_forward(e, &d, s.n, s.h, s.w, x, w, b, yd.get(), st))
      << lwo_last_error_message();
  EXPECT_EQ(LWO_OK, lwo_conv2d_backward(e, &d, s.n, s.h, s.w, nullptr, dy, w, dxd.get(), nullptr,
                                        nullptr, LWO_DTYPE_F32, st))
      << lwo_last_error_message();
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(st));
  return Result{fetch(yd, ny), fetch(dxd, nx)};
}

class QuantConv : public GpuTest {};

// cols = c / g * kh * kw: 128 * 9 = 1152 (9 groups of 128, a partial
// 128 x 128 block of rows), 32 * 4 = 128 (grouped, strided, NCHW), 12 * 9 =
// 108 (dilated; not a multiple of 128: every format but int4).
const testkit::ConvShape kShapes[] = {
    {true, 2, 128, 7, 7, 48, 3, 3, 1, 1, 1, 1, 1, 1, 1},
    {false, 2, 64, 9, 9, 40, 2, 2, 2, 2, 0, 0, 1, 1, 2},
    {true, 2, 12, 8, 8, 20, 3, 3, 1, 1, 1, 1, 2, 2, 1},
};

TEST_F(QuantConv, SlotEqualsDenseOnDequantizedWeightsBitForBit) {
  std::mt19937_64 rng(fresh_seed());
  int checked = 0;
  for (lwo_quant_format_t f : kFormats)
    for (lwo_dtype_t dt : {LWO_DTYPE_BF16, LWO_DTYPE_F16, LWO_DTYPE_F32})
      for (size_t si = 0; si < sizeof kShapes / sizeof kShapes[0]; ++si) {
        const testkit::ConvShape& s = kShapes[si];
        if (f == LWO_QUANT_INT4_GROUP128 && weight_cols(s) % 128) continue;
        // Normal and heavy-tailed alternate over the shapes and dtypes, so
        // that every format and dtype sees both.
        const bool heavy = (si + static_cast<size_t>(dt)) % 2 == 1;
        SCOPED_TRACE(std::string(lwo_quant_format_name(f)) + " " + lwo_dtype_name(dt) +
                     (s.nhwc ? " NHWC" : " NCHW") + " shape " + std::to_string(si) +
                     (heavy ? ", heavy-tailed" : ", normal"));
        QuantConvModel m(engine_, f, dt, s, 1);
        ASSERT_NE(nullptr, m.pool.get());
        const HostMat b = random_mat(dt, size_t(s.k), 1.f, rng);
        std::vector<uint8_t> dense;
        const std::vector<uint8_t> qbytes = m.fill(0, f, dt, s, heavy, b, rng, &dense);
        if (HasFatalFailure()) return;
        const HostMat x = random_mat(dt, size_t(s.n) * s.c * s.h * s.w, 1.f, rng);
        const HostMat dy = random_mat(dt, size_t(s.n) * s.k * s.out_h() * s.out_w(), 1.f, rng);
        testkit::DeviceMem xd = upload(x.bytes), dyd = upload(dy.bytes), bd = upload(b.bytes);
        testkit::DeviceMem wdense = upload(dense), wq = upload(qbytes);
        cudaStream_t st = stream(0);
        // Dense first: it chooses (and caches) the shape's cuDNN algorithms.
        const lwo_conv2d_desc dd = conv_desc(s, dt, LWO_QUANT_NONE), dq = conv_desc(s, dt, f);
        const Result want = run_conv(engine_, dd, s, xd.get(), dyd.get(), wdense.get(), bd.get(), dt, st);
        const Result resident = run_conv(engine_, dq, s, xd.get(), dyd.get(), wq.get(), bd.get(), dt, st);
        Ring ring;
        create_ring(m.pool.get(), 1, 0, &ring);
        if (HasFatalFailure()) return;
        lwo_ticket tk{0};
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), 0, st, &tk, &v));
        ASSERT_EQ(v.tensor_bytes[0], qbytes.size());
        const Result slot = run_conv(engine_, dq, s, xd.get(), dyd.get(), v.tensors[0], v.tensors[1], dt, st);
        CHECK_LWO(lwo_ring_release(ring.get(), tk, st));
        CUDA_OK(cudaStreamSynchronize(st));
        EXPECT_TRUE(slot.y == want.y) << "y: slot vs dense";
        EXPECT_TRUE(slot.dx == want.dx) << "dx: slot vs dense";
        EXPECT_TRUE(resident.y == want.y) << "y: resident vs dense";
        EXPECT_TRUE(resident.dx == want.dx) << "dx: resident vs dense";
        // And all of them against the fp64 reference on the dequantized weights.
        std::vector<double> W(s.weight_elems());
        for (size_t i = 0; i < W.size(); ++i) W[i] = testkit::load_f32(dense.data(), dt, i);
        std::vector<double> ry, rdx;
        testkit::conv2d_reference(s, x.vals, W, &b.vals, dy.vals, &ry, &rdx, nullptr, nullptr);
        EXPECT_LT(rel_err(slot.y, dt, ry), tol_for(dt)) << "y";
        EXPECT_LT(rel_err(slot.dx, dt, rdx), tol_for(dt)) << "dx";
        ++checked;
        if (HasFailure()) return;
      }
  EXPECT_EQ(checked, 4 * 3 * 3 - 3);  // int4 skips the 108-col shape
}

// Several quantized conv layers streamed through rings of depth 1 and 2 by a
// schedule (forward order, then backward) equal, bit for bit, the same calls
// on resident copies of their quantized tensors.
TEST_F(QuantConv, StreamedEqualsResidentBitForBit) {
  std::mt19937_64 rng(fresh_seed() + 1);
  const uint32_t L = 3;
  const testkit::ConvShape s{true, 2, 128, 6, 6, 96, 3, 3, 1, 1, 1, 1, 1, 1, 1};
  const lwo_dtype_t DT = LWO_DTYPE_BF16;
  cudaStream_t st = stream(0);
  for (lwo_quant_format_t f : kFormats) {
    SCOPED_TRACE(lwo_quant_format_name(f));
    QuantConvModel m(engine_, f, DT, s, L);
    ASSERT_NE(nullptr, m.pool.get());
    std::vector<testkit::DeviceMem> rw, rb;
    for (uint32_t l = 0; l < L; ++l) {
      const HostMat b = random_mat(DT, size_t(s.k), 1.f, rng);
      std::vector<uint8_t> dense;
      const std::vector<uint8_t> q = m.fill(l, f, DT, s, l % 2 == 1, b, rng, &dense);
      rw.push_back(upload(q));
      rb.push_back(upload(b.bytes));
    }
    if (HasFatalFailure()) return;
    const HostMat x = random_mat(DT, size_t(s.n) * s.c * s.h * s.w, 1.f, rng);
    const HostMat dy = random_mat(DT, size_t(s.n) * s.k * s.out_h() * s.out_w(), 1.f, rng);
    testkit::DeviceMem xd = upload(x.bytes), dyd = upload(dy.bytes);
    const lwo_conv2d_desc d = conv_desc(s, DT, f);
    std::vector<Result> want;
    for (uint32_t l = 0; l < L; ++l)
      want.push_back(run_conv(engine_, d, s, xd.get(), dyd.get(), rw[l].get(), rb[l].get(), DT, st));
    for (uint32_t depth : {1u, 2u}) {
      SCOPED_TRACE("depth " + std::to_string(depth));
      schedule_pass(m.pool.get(), depth, L, st, [&](uint32_t layer, const lwo_layer_view& v) {
        const Result got =
            run_conv(engine_, d, s, xd.get(), dyd.get(), v.tensors[0], v.tensors[1], DT, st);
        EXPECT_TRUE(got.y == want[layer].y) << "y of layer " << layer;
        EXPECT_TRUE(got.dx == want[layer].dx) << "dx of layer " << layer;
      });
      if (HasFatalFailure()) return;
    }
  }
}

// The stream's weight workspace (grown in steps of 2 MiB) grows for a larger
// weight: a small quantized conv, then one whose dequantized f32 weight is
// 512 x 1152 x 4 bytes (2.25 MiB), then the small one again, on one stream,
// each equal bit for bit to the dense conv on its host-dequantized weight.
// The engine's workspace bytes (lwo_engine_get_memory, what the budget
// counts) grow by at least the 2 MiB step with the larger weight and are
// kept for the small one after it.
TEST_F(QuantConv, WeightWorkspaceGrowsForALargerWeight) {
  std::mt19937_64 rng(fresh_seed() + 2);
  const testkit::ConvShape small{true, 1, 32, 6, 6, 16, 2, 2, 1, 1, 0, 0, 1, 1, 1};  // 16 x 128
  const testkit::ConvShape large{true, 1, 128, 5, 5, 512, 3, 3, 1, 1, 1, 1, 1, 1, 1};  // 512 x 1152
  const lwo_quant_format_t f = LWO_QUANT_INT4_GROUP128;
  cudaStream_t st = stream(0);
  struct Layer {
    testkit::ConvShape s;
    lwo_dtype_t dt;
  };
  std::vector<uint64_t> workspaces;
  for (const Layer& ly : {Layer{small, LWO_DTYPE_BF16}, Layer{large, LWO_DTYPE_F32},
                          Layer{small, LWO_DTYPE_BF16}}) {
    const testkit::ConvShape& s = ly.s;
    SCOPED_TRACE(std::to_string(s.k) + " x " + std::to_string(weight_cols(s)) + " " +
                 lwo_dtype_name(ly.dt));
    QuantConvModel m(engine_, f, ly.dt, s, 1);
    ASSERT_NE(nullptr, m.pool.get());
    const HostMat b = random_mat(ly.dt, size_t(s.k), 1.f, rng);
    std::vector<uint8_t> dense;
    const std::vector<uint8_t> q = m.fill(0, f, ly.dt, s, true, b, rng, &dense);
    if (HasFatalFailure()) return;
    const HostMat x = random_mat(ly.dt, size_t(s.n) * s.c * s.h * s.w, 1.f, rng);
    const HostMat dy = random_mat(ly.dt, size_t(s.n) * s.k * s.out_h() * s.out_w(), 1.f, rng);
    testkit::DeviceMem xd = upload(x.bytes), dyd = upload(dy.bytes), bd = upload(b.bytes);
    testkit::DeviceMem wdense = upload(dense), wq = upload(q);
    const Result want = run_conv(engine_, conv_desc(s, ly.dt, LWO_QUANT_NONE), s, xd.get(),
                                 dyd.get(), wdense.get(), bd.get(), ly.dt, st);
    const Result got = run_conv(engine_, conv_desc(s, ly.dt, f), s, xd.get(), dyd.get(), wq.get(),
                                bd.get(), ly.dt, st);
    EXPECT_TRUE(got.y == want.y) << "y";
    EXPECT_TRUE(got.dx == want.dx) << "dx";
    lwo_engine_memory mem = LWO_ENGINE_MEMORY_INIT;
    CHECK_LWO(lwo_engine_get_memory(engine_, &mem));
    workspaces.push_back(mem.workspaces);
  }
  ASSERT_EQ(3u, workspaces.size());
  EXPECT_GE(workspaces[1], workspaces[0] + (uint64_t(2) << 20)) << "the weight workspace grew";
  EXPECT_EQ(workspaces[2], workspaces[1]) << "and was kept";
  CHECK_LWO(lwo_engine_check(engine_));
}

TEST_F(QuantConv, GradientsOfQuantizedWeightsAreRefused) {
  std::mt19937_64 rng(fresh_seed() + 3);
  const testkit::ConvShape s{false, 2, 16, 6, 6, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1};  // 8 x 144
  const lwo_dtype_t DT = LWO_DTYPE_BF16;
  QuantConvModel m(engine_, LWO_QUANT_INT8_CHANNEL, DT, s, 1);
  ASSERT_NE(nullptr, m.pool.get());
  lwo_grads* g = nullptr;
  EXPECT_LWO_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_grads_create",
                 lwo_grads_create(m.pool.get(), nullptr, nullptr, &g));
  EXPECT_EQ(nullptr, g);
  const HostMat b = random_mat(DT, size_t(s.k), 1.f, rng);
  std::vector<uint8_t> dense;
  (void)m.fill(0, LWO_QUANT_INT8_CHANNEL, DT, s, true, b, rng, &dense);
  if (HasFatalFailure()) return;
  const HostMat x = random_mat(DT, size_t(s.n) * s.c * s.h * s.w, 1.f, rng);
  const HostMat dy = random_mat(DT, size_t(s.n) * s.k * s.out_h() * s.out_w(), 1.f, rng);
  testkit::DeviceMem xd = upload(x.bytes), dyd = upload(dy.bytes);
  testkit::DeviceMem dxd = poisoned(x.bytes.size()), dwd = poisoned(s.weight_elems() * 4),
                     dbd = poisoned(size_t(s.k) * 4);
  Ring ring;
  create_ring(m.pool.get(), 1, 0, &ring);
  if (HasFatalFailure()) return;
  cudaStream_t st = stream(0);
  lwo_ticket tk{0};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), 0, st, &tk, &v));
  lwo_conv2d_desc d = conv_desc(s, DT, LWO_QUANT_INT8_CHANNEL);
  EXPECT_LWO_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_conv2d_backward",
                 lwo_conv2d_backward(engine_, &d, s.n, s.h, s.w, xd.get(), dyd.get(), v.tensors[0],
                                     dxd.get(), dwd.get(), nullptr, LWO_DTYPE_F32, st));
  EXPECT_LWO_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_conv2d_backward",
                 lwo_conv2d_backward(engine_, &d, s.n, s.h, s.w, xd.get(), dyd.get(), v.tensors[0],
                                     dxd.get(), nullptr, dbd.get(), LWO_DTYPE_F32, st));
  EXPECT_LWO_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_conv2d_backward",
                 lwo_conv2d_backward(engine_, &d, s.n, s.h, s.w, xd.get(), dyd.get(), v.tensors[0],
                                     nullptr, dwd.get(), dbd.get(), LWO_DTYPE_F32, st));
  d.weight_format = 77;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_forward",
                 lwo_conv2d_forward(engine_, &d, s.n, s.h, s.w, xd.get(), v.tensors[0],
                                    v.tensors[1], dxd.get(), st));
  d.weight_format = LWO_QUANT_INT4_GROUP128;  // 144 cols
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_forward",
                 lwo_conv2d_forward(engine_, &d, s.n, s.h, s.w, xd.get(), v.tensors[0],
                                    v.tensors[1], dxd.get(), st));
  // Nothing was written by the refused calls; the engine and the ring still
  // work: the slot's dx equals the dense conv's on the dequantized weight.
  CUDA_OK(cudaStreamSynchronize(st));
  for (const testkit::DeviceMem* p : {&dxd, &dwd, &dbd}) {
    const size_t n = p == &dxd ? x.bytes.size() : p == &dwd ? s.weight_elems() * 4 : size_t(s.k) * 4;
    const std::vector<uint8_t> untouched = fetch(*p, n);
    EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](uint8_t c) { return c == 0xff; }));
  }
  d.weight_format = LWO_QUANT_INT8_CHANNEL;
  const Result got = run_conv(engine_, d, s, xd.get(), dyd.get(), v.tensors[0], v.tensors[1], DT, st);
  CHECK_LWO(lwo_ring_release(ring.get(), tk, st));
  testkit::DeviceMem wdense = upload(dense), bd = upload(b.bytes);
  const Result want = run_conv(engine_, conv_desc(s, DT, LWO_QUANT_NONE), s, xd.get(), dyd.get(),
                               wdense.get(), bd.get(), DT, st);
  EXPECT_TRUE(got.y == want.y) << "y";
  EXPECT_TRUE(got.dx == want.dx) << "dx";
  CHECK_LWO(lwo_engine_synchronize(engine_));
}

}  // namespace
}  // namespace lwo_test
