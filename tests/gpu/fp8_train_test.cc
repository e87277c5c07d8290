// Trainable fp8 e4m3 block-128 layers on the GPU: a streamed training loop
// (each layer's record staged through a ring, the forward and backward from
// the quantized slot, the weight gradients in bf16 through the gradient set,
// lwo_optim_step updating each layer as it lands and writing its record from
// the f32 masters) against a resident computation from the masters: each
// step, once the forward's stages have waited for the previous update, the
// masters are read back (lwo_optim_read), quantized on the host
// (lwo_quantize) and uploaded; the pool's record and every slot the forward
// read equal those bytes, and y, dx and the landed dW and db of every layer
// equal, bit for bit, the same calls on the resident copy. Layer 1 is frozen
// (dx only; its record never changes). With and without clipping.
#include <cstring>

#include "gpu_util.h"
#include "quant_util.h"
#include "testkit/dtype.h"

namespace lwo_test {
namespace {

constexpr int64_t kDim = 320;  // 2.5 blocks of 128: partial blocks at the edges
constexpr int64_t kTokens = 64;
constexpr uint32_t kLayers = 4;

class Fp8TrainGpu : public GpuTest {};

std::vector<uint8_t> quantize_masters(const std::vector<float>& m) {
  const lwo_quant_desc d =
      desc_of(LWO_QUANT_FP8_E4M3_BLOCK128, kDim, kDim, LWO_DTYPE_F32);
  lwo_quant_layout_info info = LWO_QUANT_LAYOUT_INFO_INIT;
  EXPECT_EQ(LWO_OK, lwo_quant_layout(&d, &info)) << lwo_last_error_message();
  std::vector<uint8_t> out(info.total_bytes);
  EXPECT_EQ(LWO_OK, lwo_quantize(&d, m.data(), m.size() * 4, out.data(), out.size(), 0))
      << lwo_last_error_message();
  return out;
}

void run_loop(lwo_engine* engine, cudaStream_t st, bool clip) {
  std::mt19937_64 rng(fresh_seed() + (clip ? 31 : 30));
  const lwo_dtype_t DT = LWO_DTYPE_BF16;
  const size_t es = 2, NW = size_t(kDim * kDim), NB = size_t(kDim);
  const size_t act = size_t(kTokens * kDim) * es;
  QuantWeightPool m(engine, LWO_QUANT_FP8_E4M3_BLOCK128, DT, kDim, kDim, kLayers);
  ASSERT_NE(nullptr, m.pool.get());
  lwo_pool* pool = m.pool.get();
  for (uint32_t l = 0; l < kLayers; ++l) {
    std::vector<float> w = make_weights(kDim, kDim, l % 2 == 1, rng);
    for (float& x : w) x *= 2.f;  // about 0.06: y keeps its scale through the chain
    CHECK_LWO(lwo_pool_write_quantized(pool, l, "weight", w.data(), LWO_DTYPE_F32, w.size() * 4, 0));
    const HostMat b = random_mat(DT, NB, 0.1f, rng);
    CHECK_LWO(lwo_pool_write(pool, l, "bias", b.bytes.data(), b.bytes.size()));
  }
  void* frozen_h = nullptr;
  uint64_t rec_bytes = 0;
  CHECK_LWO(lwo_pool_tensor_host(pool, 1, "weight", &frozen_h, &rec_bytes));
  const std::vector<uint8_t> frozen(static_cast<uint8_t*>(frozen_h),
                                    static_cast<uint8_t*>(frozen_h) + rec_bytes);
  const uint8_t trainable[kLayers] = {1, 0, 1, 1};
  testkit::Grads grads;
  CHECK_LWO(lwo_grads_create(pool, trainable, nullptr, grads.out()));
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  oc.flags = clip ? LWO_OPTIM_CLIPPING : 0u;
  oc.n_threads = 4;
  lwo_optim* optim = nullptr;
  CHECK_LWO(lwo_optim_create(grads.get(), &oc, &optim));
  auto free_optim = defer([&] { EXPECT_LWO_OK(lwo_optim_destroy(optim)); });
  Ring ring;
  create_ring(pool, 2, 0, &ring);
  if (::testing::Test::HasFatalFailure()) return;
  auto release_all = defer([&] {
    EXPECT_LWO_OK(lwo_ring_release_all(ring.get(), st, nullptr));
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(st));
  });
  const lwo_linear_desc d = [] {
    lwo_linear_desc x = LWO_LINEAR_DESC_INIT;
    x.dtype = LWO_DTYPE_BF16;
    x.in_features = x.out_features = kDim;
    x.flags = LWO_LINEAR_BIAS;
    x.weight_format = LWO_QUANT_FP8_E4M3_BLOCK128;
    return x;
  }();
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = 1e-3;
  p.weight_decay = 0.01;
  p.max_norm = clip ? 1e-3 : 0.0;  // below every step's norm: each step clipped
  for (uint64_t step = 1; step <= 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Forward, streamed; the previous step was not waited for: each stage
    // waits for its layer's update.
    std::vector<testkit::DeviceMem> X;
    X.push_back(upload(random_mat(DT, size_t(kTokens * kDim), 1.f, rng).bytes));
    std::vector<std::vector<uint8_t>> seen(kLayers, std::vector<uint8_t>(rec_bytes + NB * es));
    for (uint32_t l = 0; l < kLayers; ++l) {
      lwo_ticket t{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), l, st, &t, &v));
      X.push_back(poisoned(act));
      CHECK_LWO(lwo_linear_forward(engine, &d, kTokens, X[l].get(), v.tensors[0], v.tensors[1],
                                   X[l + 1].get(), st));
      CUDA_OK(cudaMemcpyAsync(seen[l].data(), v.tensors[0], rec_bytes, cudaMemcpyDeviceToHost, st));
      CUDA_OK(cudaMemcpyAsync(seen[l].data() + rec_bytes, v.tensors[1], NB * es,
                              cudaMemcpyDeviceToHost, st));
      CHECK_LWO(lwo_ring_release(ring.get(), t, st));
    }
    CUDA_OK(cudaStreamSynchronize(st));
    CHECK_LWO(lwo_optim_wait(optim));
    // The resident copy: the masters' quantization (and the biases' bf16
    // rounding), which the pool and the slots the forward read must hold.
    std::vector<testkit::DeviceMem> Wr, Br;
    for (uint32_t l = 0; l < kLayers; ++l) {
      void* h = nullptr;
      CHECK_LWO(lwo_pool_tensor_host(pool, l, "weight", &h, nullptr));
      void* hb = nullptr;
      CHECK_LWO(lwo_pool_tensor_host(pool, l, "bias", &hb, nullptr));
      std::vector<uint8_t> rec, bias(NB * es);
      if (trainable[l]) {
        std::vector<float> mw(NW), mb(NB);
        CHECK_LWO(lwo_optim_read(optim, l, "weight", LWO_OPTIM_MASTER, mw.data(), NW * 4));
        CHECK_LWO(lwo_optim_read(optim, l, "bias", LWO_OPTIM_MASTER, mb.data(), NB * 4));
        rec = quantize_masters(mw);
        for (size_t i = 0; i < NB; ++i) testkit::store_f32(bias.data(), DT, i, mb[i]);
      } else {
        rec = frozen;
        std::memcpy(bias.data(), hb, bias.size());
      }
      ASSERT_EQ(rec.size(), rec_bytes);
      ASSERT_EQ(0, std::memcmp(h, rec.data(), rec_bytes)) << "pool record of layer " << l;
      ASSERT_EQ(0, std::memcmp(hb, bias.data(), bias.size())) << "pool bias of layer " << l;
      ASSERT_EQ(0, std::memcmp(seen[l].data(), rec.data(), rec_bytes)) << "slot of layer " << l;
      ASSERT_EQ(0, std::memcmp(seen[l].data() + rec_bytes, bias.data(), bias.size()))
          << "slot bias of layer " << l;
      Wr.push_back(upload(rec));
      Br.push_back(upload(bias));
    }
    // The resident forward from the same input.
    std::vector<testkit::DeviceMem> Xr;
    Xr.push_back(upload(fetch(X[0], act)));
    for (uint32_t l = 0; l < kLayers; ++l) {
      Xr.push_back(poisoned(act));
      CHECK_LWO(lwo_linear_forward(engine, &d, kTokens, Xr[l].get(), Wr[l].get(), Br[l].get(),
                                   Xr[l + 1].get(), st));
      CUDA_OK(cudaStreamSynchronize(st));
      ASSERT_TRUE(fetch(X[l + 1], act) == fetch(Xr[l + 1], act)) << "y of layer " << l;
    }
    // Backward, streamed and resident: dy is the last output.
    CHECK_LWO(lwo_grads_zero(grads.get()));
    std::vector<testkit::DeviceMem> DX, DXr, DWr, DBr;
    const void* dy = X[kLayers].get();
    const void* dyr = Xr[kLayers].get();
    for (uint32_t l = kLayers; l-- > 0;) {
      lwo_ticket t{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), l, st, &t, &v));
      DX.push_back(poisoned(act));
      DXr.push_back(poisoned(act));
      DWr.push_back(poisoned(NW * es));
      DBr.push_back(poisoned(NB * es));
      if (trainable[l]) {
        lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
        CHECK_LWO(lwo_grads_begin(grads.get(), l, st, &gv));
        ASSERT_EQ(gv.tensor_bytes[0], NW * es) << "the dense gradient of layer " << l;
        CHECK_LWO(lwo_linear_backward(engine, &d, kTokens, X[l].get(), dy, v.tensors[0],
                                      DX.back().get(), gv.tensors[0], gv.tensors[1], DT, st));
        CHECK_LWO(lwo_grads_end(grads.get(), l, st));
        CHECK_LWO(lwo_linear_backward(engine, &d, kTokens, Xr[l].get(), dyr, Wr[l].get(),
                                      DXr.back().get(), DWr.back().get(), DBr.back().get(), DT,
                                      st));
      } else {
        CHECK_LWO(lwo_linear_backward(engine, &d, kTokens, X[l].get(), dy, v.tensors[0],
                                      DX.back().get(), nullptr, nullptr, DT, st));
        CHECK_LWO(lwo_linear_backward(engine, &d, kTokens, Xr[l].get(), dyr, Wr[l].get(),
                                      DXr.back().get(), nullptr, nullptr, DT, st));
      }
      CHECK_LWO(lwo_ring_release(ring.get(), t, st));
      dy = DX.back().get();
      dyr = DXr.back().get();
    }
    CUDA_OK(cudaStreamSynchronize(st));
    CHECK_LWO(lwo_grads_wait(grads.get()));
    for (uint32_t k = 0; k < kLayers; ++k) {
      const uint32_t l = kLayers - 1 - k;
      ASSERT_TRUE(fetch(DX[k], act) == fetch(DXr[k], act)) << "dx of layer " << l;
      if (!trainable[l]) continue;
      lwo_grad_tensor gw = LWO_GRAD_TENSOR_INIT, gb = LWO_GRAD_TENSOR_INIT;
      CHECK_LWO(lwo_grads_tensor(grads.get(), l, "weight", &gw));
      CHECK_LWO(lwo_grads_tensor(grads.get(), l, "bias", &gb));
      ASSERT_EQ(gw.dtype, DT);
      ASSERT_EQ(gw.n_elements, NW);
      const std::vector<uint8_t> rw = fetch(DWr[k], NW * es), rb = fetch(DBr[k], NB * es);
      ASSERT_EQ(0, std::memcmp(gw.data, rw.data(), rw.size())) << "dW of layer " << l;
      ASSERT_EQ(0, std::memcmp(gb.data, rb.data(), rb.size())) << "db of layer " << l;
    }
    p.step = step;
    CHECK_LWO(lwo_optim_step(optim, &p));  // no wait: the next forward's stages wait per layer
  }
  CHECK_LWO(lwo_optim_wait(optim));
  lwo_optim_stats stats{};
  stats.size = sizeof stats;
  CHECK_LWO(lwo_optim_get_stats(optim, &stats));
  EXPECT_EQ(stats.n_steps, 5u);
  EXPECT_EQ(stats.n_clipped, clip ? 5u : 0u);
  EXPECT_EQ(stats.n_layer_updates, 5u * 3u * (clip ? 2u : 1u));
  void* h = nullptr;
  CHECK_LWO(lwo_pool_tensor_host(pool, 1, "weight", &h, nullptr));
  EXPECT_EQ(0, std::memcmp(h, frozen.data(), rec_bytes)) << "the frozen layer changed";
}

TEST_F(Fp8TrainGpu, StreamedLoopEqualsResidentFromTheMastersBitForBit) {
  run_loop(engine_, stream(0), false);
}

TEST_F(Fp8TrainGpu, StreamedLoopWithClippingEqualsResidentFromTheMastersBitForBit) {
  run_loop(engine_, stream(0), true);
}

}  // namespace
}  // namespace lwo_test
