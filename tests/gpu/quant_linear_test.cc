// Linear layers on quantized ring slots: a layer whose weight
// is a quantized record tensor (LWO_EXT_TENSOR_QUANT, filled by
// lwo_pool_write_quantized) computes forward and backward-data from its
// slot (lwo_linear_desc.weight_format), against an fp64 CPU reference on the
// dequantized weights (lwo_dequantize_host: the very values the device
// dequantizes to), for every format and activation dtype, on random and on
// heavy-tailed weights; the streamed results equal, bit for bit, the same
// calls on a resident device copy of the quantized tensor; the refusals
// (gradients of a quantized weight, bad formats) keep every object usable.
//
// Tolerance: the relative L2 error of y and dx against the reference, the
// same as the dense layers' (bf16 1e-2, f16 2e-3, f32 2e-5): the weights are
// exact in the activation dtype once dequantized, so what remains is the
// GEMM's f32 accumulation and the output rounding.
#include <unistd.h>

#include "gpu_util.h"
#include "quant_util.h"
#include "testkit/dtype.h"

namespace lwo_test {
namespace {

// A pool of `n` layers: "weight" [OUT, IN] of logical dtype `dt` quantized
// in `f`, and "bias" [OUT] in `dt`.
using QuantModel = QuantWeightPool;

lwo_linear_desc linear(lwo_quant_format_t f, lwo_dtype_t dt, int64_t out, int64_t in) {
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.dtype = dt;
  d.in_features = in;
  d.out_features = out;
  d.flags = LWO_LINEAR_BIAS;
  d.weight_format = f;
  return d;
}

class QuantLinear : public GpuTest {};

TEST_F(QuantLinear, SlotMatchesFp64ReferenceOnDequantizedWeights) {
  std::mt19937_64 rng(fresh_seed());
  const int64_t T = 77, OUT = 384, IN = 640;  // IN: 5 groups of 128; OUT: a partial block
  int checked = 0;
  for (lwo_quant_format_t f : kFormats)
    for (lwo_dtype_t dt : {LWO_DTYPE_BF16, LWO_DTYPE_F16, LWO_DTYPE_F32})
      for (bool heavy : {false, true}) {
        SCOPED_TRACE(std::string(lwo_quant_format_name(f)) + " " + lwo_dtype_name(dt) +
                     (heavy ? ", heavy-tailed" : ", normal"));
        QuantModel m(engine_, f, dt, OUT, IN, 1);
        ASSERT_NE(nullptr, m.pool.get());
        const std::vector<float> w = make_weights(OUT, IN, heavy, rng);
        CHECK_LWO(lwo_pool_write_quantized(m.pool.get(), 0, "weight", w.data(), LWO_DTYPE_F32,
                                           w.size() * 4, 0));
        HostMat b = random_mat(dt, OUT, 1.f, rng), x = random_mat(dt, T * IN, 1.f, rng),
                dy = random_mat(dt, T * OUT, 1.f, rng);
        CHECK_LWO(lwo_pool_write(m.pool.get(), 0, "bias", b.bytes.data(), b.bytes.size()));
        // The reference's weights: the host dequantization of the pool's bytes.
        void* qh = nullptr;
        uint64_t qb = 0;
        CHECK_LWO(lwo_pool_tensor_host(m.pool.get(), 0, "weight", &qh, &qb));
        lwo_quant_desc qd = LWO_QUANT_DESC_INIT;
        qd.format = f;
        qd.dtype = dt;
        qd.rows = OUT;
        qd.cols = IN;
        std::vector<uint8_t> wd(static_cast<size_t>(OUT * IN) * lwo_dtype_size(dt));
        CHECK_LWO(lwo_dequantize_host(&qd, qh, qb, wd.data(), wd.size(), 0));
        std::vector<double> W(static_cast<size_t>(OUT * IN));
        for (size_t i = 0; i < W.size(); ++i) W[i] = testkit::load_f32(wd.data(), dt, i);
        std::vector<double> ry(static_cast<size_t>(T * OUT)), rdx(static_cast<size_t>(T * IN), 0.0);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t o = 0; o < OUT; ++o) {
            double acc = b.vals[o];
            for (int64_t k = 0; k < IN; ++k) acc += x.vals[t * IN + k] * W[o * IN + k];
            ry[t * OUT + o] = acc;
            const double g = dy.vals[t * OUT + o];
            for (int64_t k = 0; k < IN; ++k) rdx[t * IN + k] += g * W[o * IN + k];
          }
        Ring ring;
        create_ring(m.pool.get(), 1, 0, &ring);
        testkit::DeviceMem xd = upload(x.bytes), dyd = upload(dy.bytes);
        const size_t es = lwo_dtype_size(dt);
        testkit::DeviceMem yd = poisoned(T * OUT * es), dxd = poisoned(T * IN * es);
        cudaStream_t st = stream(0);
        lwo_ticket tk{0};
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), 0, st, &tk, &v));
        ASSERT_EQ(v.tensor_bytes[0], qb);
        const lwo_linear_desc d = linear(f, dt, OUT, IN);
        CHECK_LWO(lwo_linear_forward(engine_, &d, T, xd.get(), v.tensors[0], v.tensors[1],
                                     yd.get(), st));
        CHECK_LWO(lwo_linear_backward(engine_, &d, T, xd.get(), dyd.get(), v.tensors[0],
                                      dxd.get(), nullptr, nullptr, LWO_DTYPE_F32, st));
        CHECK_LWO(lwo_ring_release(ring.get(), tk, st));
        CUDA_OK(cudaStreamSynchronize(st));
        const double ey = rel_err(fetch(yd, T * OUT * es), dt, ry);
        const double edx = rel_err(fetch(dxd, T * IN * es), dt, rdx);
        EXPECT_LT(ey, tol_for(dt)) << "y";
        EXPECT_LT(edx, tol_for(dt)) << "dx";
        ++checked;
      }
  EXPECT_EQ(checked, 4 * 3 * 2);
}

TEST_F(QuantLinear, StreamedEqualsResidentBitForBit) {
  std::mt19937_64 rng(fresh_seed() + 1);
  const uint32_t L = 4;
  const int64_t T = 50, OUT = 256, IN = 384;
  const lwo_dtype_t DT = LWO_DTYPE_BF16;
  const size_t es = 2;
  for (lwo_quant_format_t f : kFormats) {
    SCOPED_TRACE(lwo_quant_format_name(f));
    QuantModel m(engine_, f, DT, OUT, IN, L);
    ASSERT_NE(nullptr, m.pool.get());
    std::vector<testkit::DeviceMem> resident_w, resident_b;
    for (uint32_t l = 0; l < L; ++l) {
      const std::vector<float> w = make_weights(OUT, IN, l % 2 == 1, rng);
      CHECK_LWO(lwo_pool_write_quantized(m.pool.get(), l, "weight", w.data(), LWO_DTYPE_F32,
                                         w.size() * 4, 2));
      HostMat b = random_mat(DT, OUT, 1.f, rng);
      CHECK_LWO(lwo_pool_write(m.pool.get(), l, "bias", b.bytes.data(), b.bytes.size()));
      void* qh = nullptr;
      uint64_t qb = 0;
      CHECK_LWO(lwo_pool_tensor_host(m.pool.get(), l, "weight", &qh, &qb));
      resident_w.push_back(upload(std::vector<uint8_t>(static_cast<uint8_t*>(qh),
                                                       static_cast<uint8_t*>(qh) + qb)));
      resident_b.push_back(upload(b.bytes));
    }
    HostMat x = random_mat(DT, T * IN, 1.f, rng), dy = random_mat(DT, T * OUT, 1.f, rng);
    testkit::DeviceMem xd = upload(x.bytes), dyd = upload(dy.bytes);
    const lwo_linear_desc d = linear(f, DT, OUT, IN);
    cudaStream_t st = stream(0);
    std::vector<std::vector<uint8_t>> ry, rdx;
    for (uint32_t l = 0; l < L; ++l) {
      testkit::DeviceMem yd = poisoned(T * OUT * es), dxd = poisoned(T * IN * es);
      CHECK_LWO(lwo_linear_forward(engine_, &d, T, xd.get(), resident_w[l].get(),
                                   resident_b[l].get(), yd.get(), st));
      CHECK_LWO(lwo_linear_backward(engine_, &d, T, xd.get(), dyd.get(), resident_w[l].get(),
                                    dxd.get(), nullptr, nullptr, LWO_DTYPE_F32, st));
      CUDA_OK(cudaStreamSynchronize(st));
      ry.push_back(fetch(yd, T * OUT * es));
      rdx.push_back(fetch(dxd, T * IN * es));
    }
    for (uint32_t depth : {1u, 2u, 3u}) {
      SCOPED_TRACE("depth " + std::to_string(depth));
      schedule_pass(m.pool.get(), depth, L, st, [&](uint32_t layer, const lwo_layer_view& v) {
        testkit::DeviceMem yd = poisoned(T * OUT * es), dxd = poisoned(T * IN * es);
        CHECK_LWO(lwo_linear_forward(engine_, &d, T, xd.get(), v.tensors[0], v.tensors[1],
                                     yd.get(), st));
        CHECK_LWO(lwo_linear_backward(engine_, &d, T, xd.get(), dyd.get(), v.tensors[0],
                                      dxd.get(), nullptr, nullptr, LWO_DTYPE_F32, st));
        CUDA_OK(cudaStreamSynchronize(st));
        EXPECT_TRUE(fetch(yd, T * OUT * es) == ry[layer]) << "y of layer " << layer;
        EXPECT_TRUE(fetch(dxd, T * IN * es) == rdx[layer]) << "dx of layer " << layer;
      });
      if (HasFatalFailure()) return;
    }
  }
}

// An fp8 checkpoint as they ship: F8_E4M3 codes and an f32 "_scale_inv" of
// 128 x 128 blocks (here made by lwo_quantize), mapped in place as one
// quantized tensor: the slot computes y and dx equal, bit for bit, to the
// same calls on a resident copy of the quantized tensor, and within the bf16
// tolerance of the fp64 reference on its dequantized weights.
TEST_F(QuantLinear, Fp8CheckpointSlotMatchesResidentAndReference) {
  std::mt19937_64 rng(fresh_seed() + 3);
  const int64_t T = 64, OUT = 384, IN = 320, L = 2;  // IN: a partial block
  lwo_quant_desc qd = LWO_QUANT_DESC_INIT;
  qd.format = LWO_QUANT_FP8_E4M3_BLOCK128;
  qd.dtype = LWO_DTYPE_F32;
  qd.rows = OUT;
  qd.cols = IN;
  lwo_quant_layout_info ql = LWO_QUANT_LAYOUT_INFO_INIT;
  CHECK_LWO(lwo_quant_layout(&qd, &ql));
  std::vector<std::vector<uint8_t>> q(L, std::vector<uint8_t>(ql.total_bytes));
  for (int64_t l = 0; l < L; ++l) {
    const std::vector<float> w = make_weights(OUT, IN, l == 1, rng);
    CHECK_LWO(lwo_quantize(&qd, w.data(), w.size() * 4, q[l].data(), q[l].size(), 0));
  }
  // The file: per layer the codes and the scales, as two tensors.
  char dir_tmpl[] = "/tmp/lwo_gpu_fp8_XXXXXX";
  ASSERT_NE(nullptr, mkdtemp(dir_tmpl));
  const std::string path = std::string(dir_tmpl) + "/fp8.safetensors";
  auto cleanup = defer([&] {
    std::remove(path.c_str());
    rmdir(dir_tmpl);
  });
  {
    std::string h = "{";
    std::string data;
    for (int64_t l = 0; l < L; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".proj.weight";
      const size_t b0 = data.size();
      data.append(reinterpret_cast<const char*>(q[l].data()), ql.data_bytes);
      const size_t b1 = data.size();
      data.append(reinterpret_cast<const char*>(q[l].data() + ql.scale_offset), ql.scale_bytes);
      h += (l ? "," : "") + ("\"" + p + "\":{\"dtype\":\"F8_E4M3\",\"shape\":[" +
                              std::to_string(OUT) + "," + std::to_string(IN) +
                              "],\"data_offsets\":[" + std::to_string(b0) + "," +
                              std::to_string(b1) + "]}");
      h += ",\"" + p + "_scale_inv\":{\"dtype\":\"F32\",\"shape\":[" +
           std::to_string(ql.scale_rows) + "," + std::to_string(ql.scale_cols) +
           "],\"data_offsets\":[" + std::to_string(b1) + "," + std::to_string(data.size()) + "]}";
    }
    h += "}";
    while (h.size() % 8) h += ' ';
    const uint64_t n = h.size();
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(nullptr, f);
    std::fwrite(&n, 8, 1, f);
    std::fwrite(h.data(), 1, h.size(), f);
    std::fwrite(data.data(), 1, data.size(), f);
    std::fclose(f);
  }
  testkit::Checkpoint ck;
  CHECK_LWO(lwo_checkpoint_open(path.c_str(), ck.out()));
  HostMat x = random_mat(LWO_DTYPE_BF16, T * IN, 1.f, rng), dy = random_mat(LWO_DTYPE_BF16, T * OUT, 1.f, rng);
  testkit::DeviceMem xd = upload(x.bytes), dyd = upload(dy.bytes);
  lwo_linear_desc d = linear(LWO_QUANT_FP8_E4M3_BLOCK128, LWO_DTYPE_BF16, OUT, IN);
  d.flags = 0;
  cudaStream_t st = stream(0);
  for (uint32_t flags : {0u, static_cast<uint32_t>(LWO_CHECKPOINT_STAGED)}) {
    SCOPED_TRACE(flags ? "staged" : "registered");
    lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
    cfg.pattern = "layers.{i}.";
    cfg.flags = flags;
    testkit::Pool pool;
    CHECK_LWO(lwo_pool_create_from_checkpoint(engine_, ck.get(), &cfg, pool.out()));
    Ring ring;
    create_ring(pool.get(), 2, 0, &ring);
    for (int64_t l = 0; l < L; ++l) {
      // Resident: the quantized tensor as lwo_quantize wrote it (zero padding).
      testkit::DeviceMem wq = upload(q[l]);
      testkit::DeviceMem ry = poisoned(T * OUT * 2), rdx = poisoned(T * IN * 2);
      CHECK_LWO(lwo_linear_forward(engine_, &d, T, xd.get(), wq.get(), nullptr, ry.get(), st));
      CHECK_LWO(lwo_linear_backward(engine_, &d, T, nullptr, dyd.get(), wq.get(), rdx.get(),
                                    nullptr, nullptr, LWO_DTYPE_F32, st));
      lwo_ticket tk{0};
      CHECK_LWO(lwo_ring_stage(ring.get(), static_cast<uint32_t>(l), &tk));
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      CHECK_LWO(lwo_ring_acquire(ring.get(), tk, st, &v));
      ASSERT_EQ(1u, v.n_tensors);
      ASSERT_EQ(ql.total_bytes, v.tensor_bytes[0]);
      testkit::DeviceMem y = poisoned(T * OUT * 2), dx = poisoned(T * IN * 2);
      CHECK_LWO(lwo_linear_forward(engine_, &d, T, xd.get(), v.tensors[0], nullptr, y.get(), st));
      CHECK_LWO(lwo_linear_backward(engine_, &d, T, nullptr, dyd.get(), v.tensors[0], dx.get(),
                                    nullptr, nullptr, LWO_DTYPE_F32, st));
      CHECK_LWO(lwo_ring_release(ring.get(), tk, st));
      CUDA_OK(cudaStreamSynchronize(st));
      const std::vector<uint8_t> got_y = fetch(y, T * OUT * 2), got_dx = fetch(dx, T * IN * 2);
      EXPECT_TRUE(got_y == fetch(ry, T * OUT * 2)) << "y of layer " << l;
      EXPECT_TRUE(got_dx == fetch(rdx, T * IN * 2)) << "dx of layer " << l;
      // fp64 reference on the dequantized weights.
      lwo_quant_desc bd = qd;
      bd.dtype = LWO_DTYPE_BF16;
      std::vector<uint8_t> wd(static_cast<size_t>(OUT * IN) * 2);
      CHECK_LWO(lwo_dequantize_host(&bd, q[l].data(), q[l].size(), wd.data(), wd.size(), 0));
      std::vector<double> ref_y(static_cast<size_t>(T * OUT)), ref_dx(static_cast<size_t>(T * IN), 0.0);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t o = 0; o < OUT; ++o) {
          double acc = 0;
          for (int64_t k = 0; k < IN; ++k)
            acc += x.vals[t * IN + k] * testkit::load_f32(wd.data(), LWO_DTYPE_BF16, o * IN + k);
          ref_y[t * OUT + o] = acc;
          for (int64_t k = 0; k < IN; ++k)
            ref_dx[t * IN + k] +=
                dy.vals[t * OUT + o] * testkit::load_f32(wd.data(), LWO_DTYPE_BF16, o * IN + k);
        }
      EXPECT_LT(rel_err(got_y, LWO_DTYPE_BF16, ref_y), tol_for(LWO_DTYPE_BF16)) << "y";
      EXPECT_LT(rel_err(got_dx, LWO_DTYPE_BF16, ref_dx), tol_for(LWO_DTYPE_BF16)) << "dx";
    }
  }
}

TEST_F(QuantLinear, GradientsOfQuantizedWeightsAreRefused) {
  std::mt19937_64 rng(fresh_seed() + 2);
  const int64_t T = 8, OUT = 128, IN = 256;
  const lwo_dtype_t DT = LWO_DTYPE_BF16;
  QuantModel m(engine_, LWO_QUANT_INT8_CHANNEL, DT, OUT, IN, 2);
  ASSERT_NE(nullptr, m.pool.get());
  lwo_grads* g = nullptr;
  EXPECT_LWO_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_grads_create",
                 lwo_grads_create(m.pool.get(), nullptr, nullptr, &g));
  EXPECT_EQ(nullptr, g);
  const std::vector<float> w = make_weights(OUT, IN, true, rng);
  CHECK_LWO(lwo_pool_write_quantized(m.pool.get(), 0, "weight", w.data(), LWO_DTYPE_F32,
                                     w.size() * 4, 0));
  HostMat x = random_mat(DT, T * IN, 1.f, rng), dy = random_mat(DT, T * OUT, 1.f, rng);
  testkit::DeviceMem xd = upload(x.bytes), dyd = upload(dy.bytes);
  testkit::DeviceMem dxd = poisoned(T * IN * 2), dwd = poisoned(OUT * IN * 4),
                     dbd = poisoned(OUT * 4);
  Ring ring;
  create_ring(m.pool.get(), 1, 0, &ring);
  cudaStream_t st = stream(0);
  lwo_ticket tk{0};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), 0, st, &tk, &v));
  lwo_linear_desc d = linear(LWO_QUANT_INT8_CHANNEL, DT, OUT, IN);
  EXPECT_LWO_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_linear_backward",
                 lwo_linear_backward(engine_, &d, T, xd.get(), dyd.get(), v.tensors[0], dxd.get(),
                                     dwd.get(), nullptr, LWO_DTYPE_F32, st));
  EXPECT_LWO_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_linear_backward",
                 lwo_linear_backward(engine_, &d, T, xd.get(), dyd.get(), v.tensors[0], dxd.get(),
                                     nullptr, dbd.get(), LWO_DTYPE_F32, st));
  d.weight_format = 77;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_linear_forward",
                 lwo_linear_forward(engine_, &d, T, xd.get(), v.tensors[0], v.tensors[1], dxd.get(),
                                    st));
  // Nothing was written by the refused calls; the engine and ring still work.
  CUDA_OK(cudaStreamSynchronize(st));
  const std::vector<uint8_t> untouched = fetch(dwd, OUT * IN * 4);
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](uint8_t c) { return c == 0xff; }));
  d.weight_format = LWO_QUANT_INT8_CHANNEL;
  CHECK_LWO(lwo_linear_backward(engine_, &d, T, xd.get(), dyd.get(), v.tensors[0], dxd.get(),
                                nullptr, nullptr, LWO_DTYPE_F32, st));
  CHECK_LWO(lwo_ring_release(ring.get(), tk, st));
  CHECK_LWO(lwo_engine_synchronize(engine_));
}

}  // namespace
}  // namespace lwo_test
