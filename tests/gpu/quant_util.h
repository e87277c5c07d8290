// What the GPU tests of quantized weights share (quant_test.cc,
// quant_linear_test.cc, quant_conv_test.cc): the formats, the run's seed,
// random weights (normal or heavy-tailed) and operands with their exact
// values, device operands, the relative error of a layer's output against
// an fp64 reference and its tolerance, and a pool of quantized layers.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "gpu_util.h"
#include "lwo.h"
#include "testkit/dtype.h"
#include "unit/quant_formats.h"

namespace lwo_test {

using lwo_quant_test::desc_of;
using lwo_quant_test::kFormats;

// A seed that differs from run to run (printed once, so that a failure can
// be replayed with LWO_QUANT_SEED); each test adds its own offset.
inline uint64_t fresh_seed() {
  static const uint64_t seed = [] {
    const char* e = std::getenv("LWO_QUANT_SEED");
    uint64_t s = e ? std::strtoull(e, nullptr, 0) : std::random_device{}();
    std::printf("quantized-weight tests: seed %llu (LWO_QUANT_SEED replays it)\n",
                static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

// Relative L2 error allowed for a layer's output against the fp64 reference
// on the dequantized weights, per compute dtype.
inline double tol_for(lwo_dtype_t dt) {
  return dt == LWO_DTYPE_BF16 ? 1e-2 : dt == LWO_DTYPE_F16 ? 2e-3 : 2e-5;
}

// Random f32 weights [rows, cols]: normal, or heavy-tailed (a few outliers of
// 30-60x per row, which set their rows' and blocks' scales).
inline std::vector<float> make_weights(int64_t rows, int64_t cols, bool heavy,
                                       std::mt19937_64& rng) {
  std::normal_distribution<float> g(0.f, 0.03f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (float& v : w) v = g(rng);
  if (heavy) {
    std::uniform_real_distribution<float> big(30.f, 60.f);
    for (int64_t r = 0; r < rows; ++r)
      for (int k = 0; k < 4; ++k)
        w[static_cast<size_t>(r * cols) + rng() % static_cast<uint64_t>(cols)] *= big(rng);
  }
  return w;
}

// n uniform values in [-scale, scale] stored in dt, and the values as stored.
struct HostMat {
  std::vector<uint8_t> bytes;
  std::vector<double> vals;
};
inline HostMat random_mat(lwo_dtype_t dt, size_t n, float scale, std::mt19937_64& rng) {
  HostMat m;
  m.bytes.resize(n * lwo_dtype_size(dt));
  m.vals.resize(n);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (size_t i = 0; i < n; ++i) m.vals[i] = testkit::store_f32(m.bytes.data(), dt, i, u(rng));
  return m;
}

inline testkit::DeviceMem upload(const void* h, size_t bytes) {
  testkit::DeviceMem d = testkit::device_alloc(bytes, "operand");
  EXPECT_EQ(cudaSuccess, cudaMemcpy(d.get(), h, bytes, cudaMemcpyHostToDevice));
  return d;
}
inline testkit::DeviceMem upload(const std::vector<uint8_t>& h) {
  return upload(h.data(), h.size());
}
// An output buffer filled with 0xff (NaN in every float dtype).
inline testkit::DeviceMem poisoned(size_t bytes) {
  testkit::DeviceMem d = testkit::device_alloc(bytes, "output");
  EXPECT_EQ(cudaSuccess, cudaMemset(d.get(), 0xff, bytes));
  return d;
}
inline std::vector<uint8_t> fetch(const testkit::DeviceMem& d, size_t bytes) {
  std::vector<uint8_t> h(bytes);
  EXPECT_EQ(cudaSuccess, cudaMemcpy(h.data(), d.get(), bytes, cudaMemcpyDeviceToHost));
  return h;
}

// ||got - ref|| / ||ref|| over the elements of got (dtype dt); infinity if
// any is not finite.
inline double rel_err(const std::vector<uint8_t>& got, lwo_dtype_t dt,
                      const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = testkit::load_f32(got.data(), dt, i);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

// A pinned pool of `n` layers: "weight", a quantized [rows, cols] tensor of
// logical dtype `dt` in format `f`, and "bias" [rows] in `dt`.
struct QuantWeightPool {
  lwo_tensor_quant_ext q{};
  lwo_tensor_desc t[2] = {};
  testkit::Pool pool;
  QuantWeightPool(lwo_engine* e, lwo_quant_format_t f, lwo_dtype_t dt, int64_t rows, int64_t cols,
                  uint32_t n) {
    q.header.type = LWO_EXT_TENSOR_QUANT;
    q.format = f;
    t[0] = tensor_desc("weight", dt, {rows, cols});
    t[0].next = &q;
    t[1] = tensor_desc("bias", dt, {rows});
    std::vector<lwo_layer_desc> layers(n, lwo_layer_desc{t, 2, nullptr});
    EXPECT_EQ(LWO_OK, lwo_pool_create_pinned(e, layers.data(), n, nullptr, pool.out()))
        << lwo_last_error_message();
  }
  QuantWeightPool(const QuantWeightPool&) = delete;
  QuantWeightPool& operator=(const QuantWeightPool&) = delete;
};

// A forward and a backward pass over the `n` layers of `pool` through a
// schedule on a ring of `depth` slots: at(layer, view) at each position (the
// view checked to be of that layer), the schedule's LWO_END after the last.
template <class F>
void schedule_pass(lwo_pool* pool, uint32_t depth, uint32_t n, cudaStream_t st, F&& at) {
  const std::vector<uint32_t> order = forward_backward(n);
  Ring ring;
  Schedule sched;
  create_schedule(pool, depth, order, &ring, &sched);
  if (::testing::Test::HasFatalFailure()) return;
  for (uint32_t layer : order) {
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    CHECK_LWO(lwo_schedule_next(sched.get(), st, &v));
    ASSERT_EQ(layer, v.layer);
    at(layer, v);
    if (::testing::Test::HasFatalFailure()) return;
  }
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(LWO_END, lwo_schedule_next(sched.get(), st, &v));
}

}  // namespace lwo_test
