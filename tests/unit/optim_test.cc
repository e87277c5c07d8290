// Optimizer steps on host memory (src/optim) against an f64 reference over
// 100 steps on random data; the weights written equal the rounding of the
// f32 masters; every dtype pair; threads change nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/optim/optim.h"
#include "src/optim/workers.h"
#include "test_util.h"

namespace lwo {
namespace optim {
namespace {

struct Buffers {
  std::vector<float> master, m, v;
  std::vector<uint8_t> grad, weights;
};

void fill_grad(std::vector<uint8_t>& g, lwo_dtype_t d, const std::vector<double>& vals) {
  g.assign(vals.size() * lwo_dtype_size(d), 0);
  for (size_t i = 0; i < vals.size(); ++i) {
    const float f = static_cast<float>(vals[i]);
    if (d == LWO_DTYPE_BF16) {
      const uint16_t h = f32_to_bf16(f);
      std::memcpy(g.data() + 2 * i, &h, 2);
    } else if (d == LWO_DTYPE_F16) {
      const uint16_t h = f32_to_f16(f);
      std::memcpy(g.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(g.data() + 4 * i, &f, 4);
    }
  }
}

double grad_value(const std::vector<uint8_t>& g, lwo_dtype_t d, size_t i) {
  uint16_t h;
  float f;
  switch (d) {
    case LWO_DTYPE_BF16: std::memcpy(&h, g.data() + 2 * i, 2); return bf16_to_f32(h);
    case LWO_DTYPE_F16: std::memcpy(&h, g.data() + 2 * i, 2); return f16_to_f32(h);
    default: std::memcpy(&f, g.data() + 4 * i, 4); return f;
  }
}

// 100 AdamW steps in f32 (the library) and f64 (here), from the same masters,
// on the same gradients (as the library reads them: in their dtype).
TEST(Optim, AdamWMatchesAnF64ReferenceOver100Steps) {
  const uint64_t n = 100007;  // not a multiple of any vector width, several parts
  Workers w1(1), w4(4);
  for (lwo_dtype_t gd : {LWO_DTYPE_F32, LWO_DTYPE_BF16, LWO_DTYPE_F16})
    for (lwo_dtype_t wd : {LWO_DTYPE_BF16, LWO_DTYPE_F16, LWO_DTYPE_F32}) {
      SCOPED_TRACE(std::string("grads ") + dtype_name(gd) + ", weights " + dtype_name(wd));
      std::mt19937 rng(static_cast<unsigned>(gd * 10 + wd));
      std::normal_distribution<double> normal(0.0, 1.0);
      Buffers b;
      b.master.resize(n);
      b.m.assign(n, 0.f);
      b.v.assign(n, 0.f);
      b.weights.assign(n * lwo_dtype_size(wd), 0);
      std::vector<double> p64(n), m64(n, 0), v64(n, 0);
      for (uint64_t i = 0; i < n; ++i) p64[i] = b.master[i] = static_cast<float>(normal(rng));
      AdamW h;
      h.lr = 3e-3;
      h.weight_decay = 0.05;
      Tensor t{n, b.master.data(), b.m.data(), b.v.data()};  // the other fields as they default
      t.grad_dtype = gd;
      t.weights = b.weights.data();
      t.weight_dtype = wd;
      std::vector<double> g(n);
      for (uint64_t step = 1; step <= 100; ++step) {
        for (uint64_t i = 0; i < n; ++i) g[i] = normal(rng) * (i % 7 == 0 ? 1e-3 : 1.0);
        fill_grad(b.grad, gd, g);
        t.grad = b.grad.data();
        adamw_step(t, h, step, step % 3 == 0 ? w1 : w4);
        const double bc1 = 1 - std::pow(h.beta1, double(step)), bc2 = 1 - std::pow(h.beta2, double(step));
        for (uint64_t i = 0; i < n; ++i) {
          const double gi = grad_value(b.grad, gd, i);
          p64[i] *= 1 - h.lr * h.weight_decay;
          m64[i] = h.beta1 * m64[i] + (1 - h.beta1) * gi;
          v64[i] = h.beta2 * v64[i] + (1 - h.beta2) * gi * gi;
          p64[i] -= h.lr / bc1 * m64[i] / (std::sqrt(v64[i]) / std::sqrt(bc2) + h.eps);
        }
      }
      // Tolerance: each step rounds p, m and v in f32 (about 6e-8 of |p| and an
      // update of lr at most, with a few roundings each), over 100 steps.
      double worst = 0;
      for (uint64_t i = 0; i < n; ++i) {
        const double tol = 100 * (6e-8 * std::fabs(p64[i]) + 1e-6 * h.lr) + 1e-7;
        const double err = std::fabs(b.master[i] - p64[i]);
        worst = std::max(worst, err / tol);
        ASSERT_LE(err, tol) << "element " << i;
        // The weights written are the masters, rounded once.
        std::vector<uint8_t> want(lwo_dtype_size(wd));
        if (wd == LWO_DTYPE_BF16) {
          const uint16_t x = f32_to_bf16(b.master[i]);
          std::memcpy(want.data(), &x, 2);
        } else if (wd == LWO_DTYPE_F16) {
          const uint16_t x = f32_to_f16(b.master[i]);
          std::memcpy(want.data(), &x, 2);
        } else {
          std::memcpy(want.data(), &b.master[i], 4);
        }
        ASSERT_EQ(0, std::memcmp(want.data(), b.weights.data() + i * want.size(), want.size()))
            << "element " << i;
      }
      EXPECT_GT(worst, 0.0);
    }
}

TEST(Optim, ThreadsChangeNoBit) {
  const uint64_t n = (uint64_t(1) << 18) + 77;
  std::vector<float> p0(n), g(n);
  testing::fill_uniform_pairs(3, p0, g);
  std::vector<float> results[2];
  Workers w1(1), w7(7);
  for (int k = 0; k < 2; ++k) {
    std::vector<float> p = p0, m(n, 0.f), v(n, 0.f);
    Tensor t{n, p.data(), m.data(), v.data()};
    t.grad = g.data();
    for (uint64_t s = 1; s <= 3; ++s) adamw_step(t, AdamW{}, s, k == 0 ? w1 : w7);
    results[k] = p;
  }
  EXPECT_EQ(results[0], results[1]);
}

// SGD with momentum against its definition in f64.
TEST(Optim, SgdWithMomentumMatchesItsDefinition) {
  const uint64_t n = 1001;
  std::mt19937 rng(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> p(n), b(n, 0.f);
  std::vector<uint16_t> w(n);
  std::vector<double> p64(n), b64(n, 0);
  for (uint64_t i = 0; i < n; ++i) p64[i] = p[i] = static_cast<float>(normal(rng));
  Sgd h;
  h.weight_decay = 0.01;
  h.dampening = 0.1;
  std::vector<float> g(n);
  Workers w2(2);
  for (uint64_t step = 1; step <= 50; ++step) {
    for (uint64_t i = 0; i < n; ++i) g[i] = static_cast<float>(normal(rng));
    Tensor t{n, p.data(), b.data()};
    t.grad = g.data();
    t.weights = w.data();
    t.weight_dtype = LWO_DTYPE_BF16;
    sgd_step(t, h, step, w2);
    for (uint64_t i = 0; i < n; ++i) {
      b64[i] = step == 1 ? g[i] : h.momentum * b64[i] + (1 - h.dampening) * g[i];
      p64[i] = p64[i] * (1 - h.lr * h.weight_decay) - h.lr * b64[i];
    }
  }
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p[i], p64[i], 50 * 1e-6 * (1 + std::fabs(p64[i]))) << "element " << i;
    ASSERT_EQ(w[i], f32_to_bf16(p[i])) << "element " << i;
  }
}

TEST(Optim, BadArgumentsAreRefused) {
  float x = 0;
  Workers w1(1);
  Tensor t{1, &x, &x, &x};
  t.grad = &x;
  for (auto call : {0, 1}) {
    try {
      if (call == 0)
        adamw_step(t, AdamW{}, 0, w1);
      else
        sgd_step(t, Sgd{}, 0, w1);
      ADD_FAILURE() << "step 0 accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), LWO_ERR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(e.what()).find("step 0"), std::string::npos) << e.what();
    }
  }
  t.grad_dtype = LWO_DTYPE_I8;
  EXPECT_THROW(adamw_step(t, AdamW{}, 1, w1), Error);
  t.grad_dtype = LWO_DTYPE_F32;
  t.v = nullptr;
  EXPECT_THROW(adamw_step(t, AdamW{}, 1, w1), Error);
  sgd_step(t, Sgd{}, 1, w1);  // SGD needs no second moment
  t.state_dtype = LWO_DTYPE_F16;
  EXPECT_THROW(sgd_step(t, Sgd{}, 1, w1), Error);
  t.state_dtype = LWO_DTYPE_F32;
  t.grad_scale = -1;
  EXPECT_THROW(sgd_step(t, Sgd{}, 1, w1), Error);
}

}  // namespace
}  // namespace optim
}  // namespace lwo
