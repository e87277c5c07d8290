// Optimizer math beyond the f32 step (src/optim): bf16 state rounded to
// nearest and stochastically against an f64 reference over 100 steps,
// clipping by global norm on and off, the speculative step redone from saved
// state equal to the clipped step, the stochastic rounding's distribution
// and determinism, the thread partition, the NUMA cpulist parser; the
// rounded (streaming) stores of the pool's weights at every vector level.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/optim/optim.h"
#include "src/optim/workers.h"
#include "test_util.h"
#include "unit/optim_buffers.h"

namespace lwo {
namespace optim {
namespace {

// The f64 reference of AdamW over one tensor, gradients scaled by c.
struct Ref {
  std::vector<double> p, m, v;
  void step(const AdamW& h, uint64_t t, const std::vector<float>& g, double c) {
    const double bc1 = 1 - std::pow(h.beta1, double(t)), bc2 = 1 - std::pow(h.beta2, double(t));
    for (size_t i = 0; i < p.size(); ++i) {
      const double gi = double(g[i]) * c;
      p[i] *= 1 - h.lr * h.weight_decay;
      m[i] = h.beta1 * m[i] + (1 - h.beta1) * gi;
      v[i] = h.beta2 * v[i] + (1 - h.beta2) * gi * gi;
      p[i] -= h.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + h.eps);
    }
  }
};

// 100 steps with bf16 state (nearest, stochastic) and with f32 state, each
// against the f64 reference. Stated tolerance for bf16 state (8 significant
// bits: each rounding of m and v is up to 2^-9 relative, and m near zero
// makes it larger relative to the update): over 100 steps, whose updates
// move each master about 100 lr, the masters' error stays within 2 lr per
// element (2% of the path) and its mean within 0.25 lr. Measured here: worst
// about 0.9 lr (nearest) and 1.1 lr (stochastic), mean 0.09 and 0.13 lr;
// stochastic rounding trades a little variance for no bias (v's small
// increments, 1 - beta2 of it, are not lost to rounding). f32 state as in
// optim_test.
TEST(OptimMath, Bf16StateMatchesAnF64ReferenceWithinItsTolerance) {
  const uint64_t n = 50021;
  Workers w3(3);
  for (int mode = 0; mode < 3; ++mode) {
    const lwo_dtype_t sd = mode == 0 ? LWO_DTYPE_F32 : LWO_DTYPE_BF16;
    const bool sr = mode == 2;
    SCOPED_TRACE(mode == 0 ? "f32 state" : sr ? "bf16 state, stochastic" : "bf16 state, nearest");
    std::mt19937 rng(11 + mode);
    std::normal_distribution<double> normal(0.0, 1.0);
    Buf b(n, sd);
    Ref r;
    r.p.resize(n);
    r.m.assign(n, 0);
    r.v.assign(n, 0);
    for (uint64_t i = 0; i < n; ++i) r.p[i] = b.master[i] = static_cast<float>(normal(rng));
    AdamW h;
    h.lr = 1e-3;
    h.weight_decay = 0.1;
    Tensor t = b.tensor(sd);
    t.stochastic = sr;
    t.key = tensor_key(42, 3, 1);
    std::vector<float> g(n);
    for (uint64_t s = 1; s <= 100; ++s) {
      // Gradients with a persistent mean, so that the moments matter.
      for (uint64_t i = 0; i < n; ++i)
        g[i] = static_cast<float>((i % 5 == 0 ? 0.5 : -0.2) + 0.5 * normal(rng));
      t.grad = g.data();
      adamw_step(t, h, s, w3);
      r.step(h, s, g, 1.0);
    }
    double worst = 0, mean = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const double err = std::fabs(b.master[i] - r.p[i]);
      worst = std::max(worst, err);
      mean += err / n;
      ASSERT_EQ(b.weights[i], f32_to_bf16(b.master[i])) << "element " << i;
    }
    if (sd == LWO_DTYPE_F32) {
      EXPECT_LE(worst, 100 * (6e-8 * 4 + 1e-6 * h.lr));
    } else {
      EXPECT_LE(worst, 2.0 * h.lr);
      EXPECT_LE(mean, 0.25 * h.lr);
    }
    EXPECT_GT(worst, 0.0);
    std::printf("state %s: worst error %.3g lr, mean %.3g lr\n",
                mode == 0 ? "f32" : sr ? "bf16 (stochastic)" : "bf16 (nearest)", worst / h.lr,
                mean / h.lr);
  }
}

// Clipping by global norm, on (the norm above max_norm) and off (below),
// against the f64 reference of torch.nn.utils.clip_grad_norm_ + AdamW.
TEST(OptimMath, ClippingByGlobalNormMatchesTheReference) {
  const uint64_t n0 = 30011, n1 = 7001;  // two tensors: the norm is global
  Workers w2(2);
  for (double max_norm : {1.0, 1e9}) {
    SCOPED_TRACE("max_norm " + std::to_string(max_norm));
    std::mt19937 rng(7);
    std::normal_distribution<double> normal(0.0, 1.0);
    Buf b0(n0, LWO_DTYPE_F32), b1(n1, LWO_DTYPE_F32);
    Ref r0, r1;
    r0.p.resize(n0);
    r0.m.assign(n0, 0);
    r0.v.assign(n0, 0);
    r1.p.resize(n1);
    r1.m.assign(n1, 0);
    r1.v.assign(n1, 0);
    for (uint64_t i = 0; i < n0; ++i) r0.p[i] = b0.master[i] = static_cast<float>(normal(rng));
    for (uint64_t i = 0; i < n1; ++i) r1.p[i] = b1.master[i] = static_cast<float>(normal(rng));
    AdamW h;
    h.lr = 2e-3;
    std::vector<float> g0(n0), g1(n1);
    int clipped = 0;
    for (uint64_t s = 1; s <= 100; ++s) {
      for (auto& x : g0) x = static_cast<float>(0.05 * normal(rng));
      for (auto& x : g1) x = static_cast<float>(0.05 * normal(rng) * (s % 10 == 0 ? 20 : 1));
      const double sq = sum_squares(g0.data(), LWO_DTYPE_F32, n0, w2) +
                        sum_squares(g1.data(), LWO_DTYPE_F32, n1, w2);
      double sq64 = 0;
      for (float x : g0) sq64 += double(x) * x;
      for (float x : g1) sq64 += double(x) * x;
      ASSERT_NEAR(sq, sq64, 1e-12 * sq64);
      const float c = clip_scale(std::sqrt(sq), max_norm);
      const double c64 = std::min(1.0, max_norm / (std::sqrt(sq64) + 1e-6));
      ASSERT_NEAR(c, c64, 1e-6 * c64);
      clipped += c < 1;
      Tensor t0 = b0.tensor(LWO_DTYPE_F32), t1 = b1.tensor(LWO_DTYPE_F32);
      t0.grad = g0.data();
      t1.grad = g1.data();
      t0.grad_scale = t1.grad_scale = c;
      adamw_step(t0, h, s, w2);
      adamw_step(t1, h, s, w2);
      r0.step(h, s, g0, c64);
      r1.step(h, s, g1, c64);
    }
    if (max_norm < 10)
      EXPECT_EQ(clipped, 100);
    else
      EXPECT_EQ(clipped, 0);
    for (uint64_t i = 0; i < n0; ++i)
      ASSERT_NEAR(b0.master[i], r0.p[i], 100 * (6e-8 * std::fabs(r0.p[i]) + 2e-6 * h.lr) + 1e-7)
          << "element " << i;
    for (uint64_t i = 0; i < n1; ++i)
      ASSERT_NEAR(b1.master[i], r1.p[i], 100 * (6e-8 * std::fabs(r1.p[i]) + 2e-6 * h.lr) + 1e-7)
          << "element " << i;
  }
}

// The speculative step (scale 1, from saved state into the other buffers)
// redone from the saved state with the clipping scale equals the clipped
// step done once, bit for bit; a scale of 1 equals no scale at all.
TEST(OptimMath, SpeculativeStepRedoneEqualsTheClippedStep) {
  const uint64_t n = 40961;
  Workers w3(3);
  for (lwo_dtype_t sd : {LWO_DTYPE_F32, LWO_DTYPE_BF16}) {
    std::mt19937 rng(9);
    std::uniform_real_distribution<float> u(-1, 1);
    Buf a(n, sd), x(n, sd), once(n, sd);
    for (uint64_t i = 0; i < n; ++i) a.master[i] = u(rng);
    std::vector<float> g(n);
    AdamW h;
    for (uint64_t s = 1; s <= 3; ++s) {  // some state first
      for (auto& e : g) e = u(rng);
      Tensor t = a.tensor(sd);
      t.grad = g.data();
      t.stochastic = true;
      adamw_step(t, h, s, w3);
    }
    for (auto& e : g) e = u(rng);
    once = a;
    Tensor t1 = once.tensor(sd);
    t1.grad = g.data();
    t1.stochastic = true;
    t1.grad_scale = 0.37f;
    adamw_step(t1, h, 4, w3);
    // Speculative: a -> x with scale 1, then redone a -> x with the scale.
    for (float sc : {1.0f, 0.37f}) {
      Tensor t = x.tensor(sd);
      t.master_in = a.master.data();
      t.m_in = a.m.data();
      t.v_in = a.v.data();
      t.grad = g.data();
      t.stochastic = true;
      t.grad_scale = sc;
      adamw_step(t, h, 4, w3);
    }
    EXPECT_EQ(x.master, once.master);
    EXPECT_EQ(x.m, once.m);
    EXPECT_EQ(x.v, once.v);
    EXPECT_EQ(x.weights, once.weights);
  }
}

// Stochastic rounding rounds up with probability equal to the distance from
// the lower neighbour: over all 2^16 random values exactly (low bits) of them.
TEST(OptimMath, StochasticRoundingIsUnbiased) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-100, 100);
  for (int k = 0; k < 200; ++k) {
    const float x = u(rng);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint16_t lo = static_cast<uint16_t>(bits >> 16);
    uint32_t up = 0;
    for (uint32_t r = 0; r < 65536; ++r) {
      const uint16_t y = f32_to_bf16_stochastic(x, r);
      ASSERT_TRUE(y == lo || y == lo + 1);
      up += y != lo;
    }
    ASSERT_EQ(up, bits & 0xffffu);
  }
  const float inf = INFINITY, nan = NAN;
  EXPECT_EQ(f32_to_bf16_stochastic(inf, 0xffff), 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16_stochastic(nan, 0xffff))));
  EXPECT_EQ(f32_to_bf16_stochastic(1.0f, 0xffff), 0x3f80);  // exact values stay
}

// The same seed gives the same bits with any threads; another seed other
// bits; SGD's bf16 momentum too.
TEST(OptimMath, StochasticStateIsDeterministicGivenTheSeed) {
  const uint64_t n = (uint64_t(1) << 17) + 3;
  std::vector<float> p0(n), g(n);
  testing::fill_uniform_pairs(2, p0, g);
  auto run = [&](uint32_t threads, uint64_t seed, bool sgd) {
    Workers w(threads);
    Buf b(n, LWO_DTYPE_BF16);
    b.master = p0;
    Tensor t = b.tensor(LWO_DTYPE_BF16);
    t.grad = g.data();
    t.stochastic = true;
    t.key = tensor_key(seed, 0, 0);
    for (uint64_t s = 1; s <= 4; ++s) sgd ? sgd_step(t, Sgd{}, s, w) : adamw_step(t, AdamW{}, s, w);
    return b;
  };
  for (bool sgd : {false, true}) {
    Buf a = run(1, 5, sgd), b = run(5, 5, sgd), c = run(2, 6, sgd);
    EXPECT_EQ(a.master, b.master);
    EXPECT_EQ(a.m, b.m);
    EXPECT_EQ(a.v, b.v);
    EXPECT_NE(a.m, c.m);
  }
}

// SGD with bf16 momentum (nearest) against its definition in f64.
TEST(OptimMath, SgdWithBf16MomentumStaysNearItsDefinition) {
  const uint64_t n = 5003;
  Workers w2(2);
  std::mt19937 rng(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  Buf b(n, LWO_DTYPE_BF16);
  std::vector<double> p64(n), b64(n, 0);
  for (uint64_t i = 0; i < n; ++i) p64[i] = b.master[i] = static_cast<float>(normal(rng));
  Sgd h;
  h.lr = 1e-3;
  std::vector<float> g(n);
  for (uint64_t s = 1; s <= 100; ++s) {
    for (auto& x : g) x = static_cast<float>(normal(rng));
    Tensor t = b.tensor(LWO_DTYPE_BF16);
    t.grad = g.data();
    sgd_step(t, h, s, w2);
    for (uint64_t i = 0; i < n; ++i) {
      b64[i] = s == 1 ? g[i] : h.momentum * b64[i] + g[i];
      p64[i] -= h.lr * b64[i];
    }
  }
  // One bf16 rounding of the buffer per step (2^-9 relative), carried by
  // the momentum (1 / (1 - 0.9) steps, |b| about 2.3): about 0.05 lr per
  // step, a random walk over 100 steps (sigma about 0.5 lr): within 3 lr for
  // every element (measured worst about 1.2 lr), and not exactly the f64 path.
  double worst = 0;
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(b.master[i], p64[i], 3.0 * h.lr) << i;
    worst = std::max(worst, std::fabs(b.master[i] - p64[i]));
  }
  EXPECT_GT(worst, 0.0);
}

TEST(OptimMath, WorkersTakeFixedAlignedParts) {
  Workers w(5);
  ASSERT_EQ(w.size(), 5u);
  const uint64_t n = 5 * kAlign * 10 + 17;
  std::vector<int> owner(n, -1);
  std::mutex mu;
  std::vector<std::pair<uint64_t, uint64_t>> parts;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::pair<uint64_t, uint64_t>> got;
    w.run(n, kAlign, kMinPart, [&](uint64_t b, uint64_t e) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back({b, e});
    });
    std::sort(got.begin(), got.end());
    uint64_t at = 0;
    for (auto& pe : got) {
      EXPECT_EQ(pe.first, at);
      EXPECT_EQ(pe.first % kAlign, 0u);
      at = pe.second;
    }
    EXPECT_EQ(at, n);
    if (rep == 0) parts = got;
    EXPECT_EQ(got, parts);
  }
  // Small ranges: one thread.
  int calls = 0;
  w.run(100, kAlign, kMinPart, [&](uint64_t b, uint64_t e) {
    ++calls;
    EXPECT_EQ(b, 0u);
    EXPECT_EQ(e, 100u);
  });
  EXPECT_EQ(calls, 1);
  EXPECT_NE(std::string(vector_level()), "");
}

// store_rounded at each vector level the host has (the plain loop always;
// AVX2 and AVX-512 where present: which ran is printed), streaming and not,
// equals store_f32 element by element on special values (NaN of every kind,
// infinities, zeros, the bf16 / f16 rounding midpoints and overflow edges,
// subnormals of both) and random bits, at every offset and length around
// the vectors' widths, and writes nothing outside [at, at + n).
TEST(OptimMath, RoundedStoresEqualStoreF32AtEveryLevel) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu, 0x7fffffffu,
                                0x7f7fffffu, 0xff7fffffu, 0x3f808000u, 0x3f818000u, 0x3f80ffffu,
                                0x477fe000u, 0x477fefffu, 0x477ff000u, 0xc77ff000u, 0x38800000u,
                                0x387fffffu, 0x33800000u, 0x33000001u, 0x00000001u, 0x807fffffu};
  std::mt19937 rng(20261201);
  for (int i = 0; i < 4000; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  for (int i = 0; i < 1000; ++i) {
    const float f = u(rng) * (i % 3 == 0 ? 1e-9f : 1.0f);
    uint32_t b;
    std::memcpy(&b, &f, 4);
    bits.push_back(b);
  }
  std::vector<float> src(bits.size());
  std::memcpy(src.data(), bits.data(), bits.size() * 4);
  const uint64_t pad = 80;  // guard elements on each side
  int levels_run = 0;
  for (int level = 0; level <= 2; ++level) {
    bool ran = false;
    for (lwo_dtype_t d : {LWO_DTYPE_BF16, LWO_DTYPE_F16, LWO_DTYPE_F32}) {
      const size_t es = dtype_size(d);
      for (bool streaming : {false, true}) {
        // Every offset 0..40 and lengths around the widths; then the whole.
        std::vector<std::pair<uint64_t, uint64_t>> cases;
        for (uint64_t at = 0; at <= 40; ++at)
          for (uint64_t n : {0u, 1u, 7u, 15u, 16u, 17u, 31u, 32u, 33u, 63u, 64u, 65u, 200u})
            cases.push_back({at, n});
        cases.push_back({3, src.size()});
        for (auto [at, n] : cases) {
          SCOPED_TRACE("level " + std::to_string(level) + ", " + dtype_name(d) +
                       (streaming ? ", streaming" : "") + ", at " + std::to_string(at) + ", n " +
                       std::to_string(n));
          // Elements [0, pad) and [pad + at + n, ...) are guards.
          std::vector<uint8_t> got((pad * 2 + at + n) * es, 0xa5), want = got;
          const uint64_t from = (n == src.size()) ? 0 : (at * 37) % (src.size() - n);
          for (uint64_t i = 0; i < n; ++i) store_f32(want.data(), d, pad + at + i, src[from + i]);
          ran = detail::store_rounded_at(level, got.data(), d, pad + at, src.data() + from, n,
                                         streaming);
          if (!ran) break;
          streaming_fence();
          ASSERT_EQ(got, want);
        }
        if (!ran) break;
      }
      if (!ran) break;
    }
    if (level == 0) {
      ASSERT_TRUE(ran) << "the plain loop must always run";
    }
    if (ran) {
      ++levels_run;
      std::printf("store_rounded: vector level %d checked\n", level);
    }
  }
  EXPECT_GE(levels_run, 1);
  // The dispatching entry point gives the same bits as the plain loop.
  std::vector<uint16_t> a(src.size()), b(src.size());
  store_rounded(a.data(), LWO_DTYPE_BF16, 0, src.data(), src.size(), true);
  streaming_fence();
  detail::store_rounded_at(0, b.data(), LWO_DTYPE_BF16, 0, src.data(), src.size(), false);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace optim
}  // namespace lwo
