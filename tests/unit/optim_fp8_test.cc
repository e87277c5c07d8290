// The host optimizer's fused fp8 block-128 write (optim::Tensor's
// quant_format): the codes and scales it writes from the updated masters
// against an f64 reference of the whole update and quantization, bit for bit
// against the same update without it followed by quant::quantize of the
// masters (shapes with rows and cols off the 128 grid, one across two tiles
// of kTileCols; a zero block, large and tiny values; AdamW and SGD, f32 and
// bf16 state), whatever scales the record held before, ties to the even
// code, the same bytes for 1, 2 and 3 threads, a non-finite block, and the
// refused inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/optim/optim.h"
#include "src/optim/workers.h"
#include "src/quant/codec.h"
#include "src/quant/quant.h"
#include "unit/optim_buffers.h"

namespace lwo {
namespace optim {
namespace {

// One tensor's buffers: masters, moments (f32 or bf16), bf16 gradients,
// bf16 weights, and the fp8 record (quant::Layout's, codes then scales).
struct Case : Buf {
  int64_t rows, cols;
  uint64_t n;
  lwo_dtype_t sd;
  std::vector<uint16_t> grad;
  quant::Layout layout;
  std::vector<uint8_t> record;

  Case(int64_t r, int64_t c, lwo_dtype_t state, uint32_t seed)
      : Buf(uint64_t(r) * uint64_t(c), state), rows(r), cols(c), n(uint64_t(r) * uint64_t(c)),
        sd(state), grad(n) {
    layout = quant::layout_of(LWO_QUANT_FP8_E4M3_BLOCK128, LWO_DTYPE_F32, rows, cols);
    record.assign(layout.total_bytes, 0xcd);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (uint64_t i = 0; i < n; ++i) {
      master[i] = 0.05f * nd(rng);
      grad[i] = f32_to_bf16(1e-2f * nd(rng));
    }
    // Block (0, 0): large values; the last block: tiny ones (subnormal
    // codes); block (0, 1) where there is one: all zero (masters, gradients
    // and moments), so it stays zero and gets kMinScale.
    for (int64_t i = 0; i < std::min<int64_t>(rows, 128); ++i)
      for (int64_t j = 0; j < std::min<int64_t>(cols, 128); ++j)
        master[uint64_t(i * cols + j)] = 3e4f * nd(rng);
    if (rows > 128 || cols > 128) {
      const int64_t r0 = (rows - 1) / 128 * 128, c0 = (cols - 1) / 128 * 128;
      for (int64_t i = r0; i < rows; ++i)
        for (int64_t j = c0; j < cols; ++j) {
          master[uint64_t(i * cols + j)] = 1e-35f * nd(rng);
          grad[uint64_t(i * cols + j)] = 0;
        }
    }
    if (cols > 128)
      for (int64_t i = 0; i < std::min<int64_t>(rows, 128); ++i)
        for (int64_t j = 128; j < std::min<int64_t>(cols, 256); ++j) {
          master[uint64_t(i * cols + j)] = 0;
          grad[uint64_t(i * cols + j)] = 0;
        }
  }
  uint8_t* codes() { return record.data(); }
  float* scales() { return reinterpret_cast<float*>(record.data() + layout.scale_offset); }
  Tensor tensor(bool fp8, bool with_weights = true) {
    Tensor t = Buf::tensor(sd);
    t.grad = grad.data();
    t.grad_dtype = LWO_DTYPE_BF16;
    if (!with_weights) t.weights = nullptr;
    if (fp8) {
      t.quant_format = LWO_QUANT_FP8_E4M3_BLOCK128;
      t.rows = rows;
      t.cols = cols;
      t.codes = codes();
      t.scales = scales();
    }
    return t;
  }
};

// A step of either optimizer.
void step(int kind, const Tensor& t, uint64_t s, Workers& w) {
  if (kind == 0)
    adamw_step(t, AdamW{}, s, w);
  else
    sgd_step(t, Sgd{}, s, w);
}

struct Shape {
  int64_t rows, cols;
};
const Shape kShapes[] = {{1, 1}, {3, 700}, {127, 129}, {128, 128}, {129, 1},
                         {200, 300}, {256, 1100}, {300, 512}, {130, 1025}, {129, 4200}};
static_assert(kTileCols == 4096, "the last shape spans two tiles");

// The fused write equals the plain update (the same masters, moments and
// bf16 weights) followed by quant::quantize of the masters, byte for byte,
// over two steps, for AdamW and SGD and both state dtypes.
TEST(OptimFp8, EqualsTheUpdateThenQuantize) {
  Workers w(2);
  uint32_t seed = 1;
  for (int kind = 0; kind < 2; ++kind)
    for (lwo_dtype_t sd : {LWO_DTYPE_F32, LWO_DTYPE_BF16})
      for (const Shape& sh : kShapes) {
        const std::string what = std::string(kind ? "sgd " : "adamw ") + dtype_name(sd) + " " +
                                 std::to_string(sh.rows) + "x" + std::to_string(sh.cols);
        Case fused(sh.rows, sh.cols, sd, seed), plain(sh.rows, sh.cols, sd, seed);
        ++seed;
        for (uint64_t s = 1; s <= 2; ++s) {
          step(kind, fused.tensor(true), s, w);
          step(kind, plain.tensor(false), s, w);
          ASSERT_EQ(0, std::memcmp(fused.master.data(), plain.master.data(), 4 * fused.n)) << what;
          ASSERT_EQ(fused.m, plain.m) << what;
          ASSERT_EQ(fused.v, plain.v) << what;
          ASSERT_EQ(fused.weights, plain.weights) << what;
          quant::quantize(plain.layout, plain.master.data(), LWO_DTYPE_F32, plain.record.data(), 1);
          ASSERT_EQ(0, std::memcmp(fused.codes(), plain.codes(), fused.layout.data_bytes))
              << what << " step " << s;
          ASSERT_EQ(0, std::memcmp(fused.scales(), plain.scales(), fused.layout.scale_bytes))
              << what << " step " << s;
        }
        // The zero block kept the smallest scale; the large one is large.
        if (sh.cols > 128) {
          EXPECT_EQ(fused.scales()[1], quant::kMinScale) << what;
        }
        if (sh.rows >= 128 && sh.cols >= 128) {
          EXPECT_GT(fused.scales()[0], 10.0f) << what;
        }
        // The record's padding is not the step's to write.
        for (uint64_t b = fused.layout.data_bytes; b < fused.layout.scale_offset; ++b)
          ASSERT_EQ(fused.record[b], 0xcd) << what;
      }
}

// Against an f64 AdamW step and an f64 quantization of its masters: each
// scale the power of two that puts amax in (232, 464] (or kMinScale; up to
// the f32 update's error at a binade's edge), each dequantized element
// within half an e4m3 step (2^-4 of it, or 2^-10 of the scale below the
// normal range) of the f64 master, plus the f32 update's own error.
TEST(OptimFp8, MatchesAnF64Reference) {
  Workers w(3);
  const AdamW h;
  const double bc1 = 1 - h.beta1, bc2 = 1 - h.beta2;
  uint32_t seed = 100;
  for (const Shape& sh : kShapes) {
    Case c(sh.rows, sh.cols, LWO_DTYPE_F32, seed++);
    std::vector<double> ref(c.n);
    for (uint64_t i = 0; i < c.n; ++i) {
      const double g = bf16_to_f32(c.grad[i]);
      const double m = (1 - h.beta1) * g, v = (1 - h.beta2) * g * g;
      ref[i] = double(c.master[i]) * (1 - h.lr * h.weight_decay) -
               h.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
    }
    adamw_step(c.tensor(true, false), h, 1, w);
    const quant::Layout& l = c.layout;
    std::vector<double> amax(uint64_t(l.scale_rows * l.scale_cols), 0.0);
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t k = 0; k < c.cols; ++k) {
        double& a = amax[l.scale_index(r, k)];
        a = std::max(a, std::fabs(ref[uint64_t(r * c.cols + k)]));
      }
    for (size_t s = 0; s < amax.size(); ++s) {
      const double sc = c.scales()[s];
      ASSERT_EQ(sc, std::ldexp(1.0, std::ilogb(sc))) << sh.rows << "x" << sh.cols << " scale " << s;
      ASSERT_LE(amax[s] / sc, 464.0 * (1 + 1e-6)) << sh.rows << "x" << sh.cols << " scale " << s;
      if (sc > quant::kMinScale) {
        ASSERT_GT(amax[s] / sc, 232.0 * (1 - 1e-6)) << sh.rows << "x" << sh.cols << " scale " << s;
      }
    }
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t k = 0; k < c.cols; ++k) {
        const uint64_t i = uint64_t(r * c.cols + k);
        const double s = c.scales()[l.scale_index(r, k)];
        const double got = double(quant::e4m3_to_f32(c.codes()[i])) * s;
        const double tol = std::max(std::fabs(ref[i]) * 0x1p-4, s * 0x1p-10) * (1 + 1e-5) +
                           std::fabs(ref[i]) * 1e-6 + 1e-12 * s;
        ASSERT_NEAR(got, ref[i], tol) << sh.rows << "x" << sh.cols << " [" << r << ", " << k << "]";
      }
  }
}

// Ties: with SGD at lr 0 the masters stay as they are, so a block whose
// scale is s = 2^-2 (amax 448 s) and whose elements are s x each midpoint
// between two e4m3 codes (exact) puts every quotient on a tie: each goes to
// the even code (nearest even), as quantize's do; another tie rule fails.
TEST(OptimFp8, TiesGoToTheEvenCode) {
  Workers w(1);
  Case c(128, 256, LWO_DTYPE_F32, 11), plain(128, 256, LWO_DTYPE_F32, 11);
  std::vector<uint8_t> want(c.n, 0);
  uint64_t k = 1;
  const float scale = 0.25f;
  c.master[0] = 448.0f * scale;
  want[0] = 0x7e;
  for (int rep = 0; k < 128 * 128 && rep < 100; ++rep)
    for (uint32_t b = 0; b + 1 < 0x7f; ++b) {
      const float mid = 0.5f * (quant::e4m3_to_f32(uint8_t(b)) + quant::e4m3_to_f32(uint8_t(b + 1)));
      const uint8_t even = uint8_t((b & 1) ? b + 1 : b);
      for (int sign = 0; sign < 2; ++sign) {
        const uint64_t i = (k / 128) * 256 + k % 128;  // within block (0, 0)
        if (k >= 128 * 128) break;
        c.master[i] = (sign ? -scale : scale) * mid;
        want[i] = uint8_t(even | (sign ? 0x80 : 0));
        ++k;
      }
    }
  plain.master = c.master;
  Sgd h;
  h.lr = 0;
  sgd_step(c.tensor(true), h, 1, w);
  ASSERT_EQ(c.master, plain.master);  // unchanged
  EXPECT_EQ(c.scales()[0], scale);
  for (uint64_t r = 0; r < 128; ++r)
    for (uint64_t j = 0; j < 128; ++j)
      ASSERT_EQ(c.codes()[r * 256 + j], want[r * 256 + j]) << r << ", " << j << ": "
          << c.master[r * 256 + j];
  quant::quantize(plain.layout, plain.master.data(), LWO_DTYPE_F32, plain.record.data(), 1);
  EXPECT_EQ(0, std::memcmp(c.codes(), plain.codes(), c.layout.data_bytes));
  EXPECT_EQ(0, std::memcmp(c.scales(), plain.scales(), c.layout.scale_bytes));
}

// The codes are written first under the scale the record holds, then again
// where the block's new scale differs: whatever the record held (no fp8
// scale, the right one, one binade off either way, NaN, a negative or
// subnormal value, a mix), the bytes are quantize's of the updated masters.
TEST(OptimFp8, AnyHeldScalesGiveQuantizesBytes) {
  Workers w(2);
  for (int held = 0; held < 7; ++held) {
    Case c(300, 700, LWO_DTYPE_F32, 40), plain(300, 700, LWO_DTYPE_F32, 40);
    step(0, plain.tensor(false), 1, w);
    quant::quantize(plain.layout, plain.master.data(), LWO_DTYPE_F32, plain.record.data(), 1);
    const uint64_t n_scales = uint64_t(c.layout.scale_rows * c.layout.scale_cols);
    for (uint64_t s = 0; s < n_scales; ++s) {
      const float right = plain.scales()[s];
      const float held_scale[7] = {1.0f, right, 2 * right, 0.5f * right, NAN, -right,
                                   s % 2 ? right : 0x1p-140f};
      c.scales()[s] = held_scale[held];
    }
    step(0, c.tensor(true), 1, w);
    ASSERT_EQ(0, std::memcmp(c.master.data(), plain.master.data(), 4 * c.n)) << held;
    ASSERT_EQ(0, std::memcmp(c.codes(), plain.codes(), c.layout.data_bytes)) << held;
    ASSERT_EQ(0, std::memcmp(c.scales(), plain.scales(), c.layout.scale_bytes)) << held;
  }
}

// 1, 2 and 3 threads (whole bands each: 3 threads take 3, 3 and 2 of the 8
// bands of 1000 rows) write the same bytes, with stochastic bf16 state too.
TEST(OptimFp8, ThreadCountsGiveTheSameBytes) {
  for (int kind = 0; kind < 2; ++kind)
    for (bool sr : {false, true}) {
      std::vector<Case> cases;
      for (uint32_t nt = 1; nt <= 3; ++nt) {
        Workers w(nt);
        cases.emplace_back(1000, 300, sr ? LWO_DTYPE_BF16 : LWO_DTYPE_F32, 7);
        Tensor t = cases.back().tensor(true);
        t.stochastic = sr;
        t.key = 99;
        for (uint64_t s = 1; s <= 3; ++s) step(kind, t, s, w);
      }
      for (size_t k = 1; k < cases.size(); ++k) {
        EXPECT_EQ(cases[k].record, cases[0].record) << "kind " << kind << " sr " << sr << ", " << k + 1 << " threads";
        EXPECT_EQ(0, std::memcmp(cases[k].master.data(), cases[0].master.data(), 4 * cases[0].n));
        EXPECT_EQ(cases[k].m, cases[0].m);
        EXPECT_EQ(cases[k].weights, cases[0].weights);
      }
    }
}

// A NaN gradient makes its block's scale NaN and its codes 0x7f (quantize
// would refuse the masters); the other blocks are written as ever.
TEST(OptimFp8, NonFiniteBlockIsNaN) {
  Workers w(1);
  Case c(200, 300, LWO_DTYPE_F32, 5), ref(200, 300, LWO_DTYPE_F32, 5);
  c.grad[uint64_t(150 * 300 + 260)] = 0x7fc0;  // block (1, 2)
  adamw_step(c.tensor(true), AdamW{}, 1, w);
  adamw_step(ref.tensor(true), AdamW{}, 1, w);
  const quant::Layout& l = c.layout;
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t k = 0; k < c.cols; ++k) {
      const uint64_t i = uint64_t(r * c.cols + k);
      if (l.scale_index(r, k) == uint64_t(1 * l.scale_cols + 2))
        ASSERT_EQ(c.codes()[i], 0x7f) << r << ", " << k;
      else
        ASSERT_EQ(c.codes()[i], ref.codes()[i]) << r << ", " << k;
    }
  for (int64_t s = 0; s < l.scale_rows * l.scale_cols; ++s) {
    if (s == 1 * l.scale_cols + 2)
      EXPECT_TRUE(std::isnan(c.scales()[s]));
    else
      EXPECT_EQ(c.scales()[s], ref.scales()[s]) << s;
  }
}

// The status and message of a refused tensor.
void expect_refused(int kind, const Tensor& t, const std::string& part) {
  Workers w(1);
  try {
    step(kind, t, 1, w);
    ADD_FAILURE() << "accepted; expected a message with \"" << part << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), LWO_ERR_INVALID_ARGUMENT) << e.what();
    const std::string msg = e.what();
    EXPECT_NE(msg.find(kind ? "sgd" : "adamw"), std::string::npos) << msg;
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
  }
}

TEST(OptimFp8, RefusedInputs) {
  Case c(130, 200, LWO_DTYPE_F32, 3);
  const std::vector<float> before = c.master;
  for (int kind = 0; kind < 2; ++kind) {
    Tensor t = c.tensor(true);
    t.rows = 129;  // 129 x 200 is not n
    expect_refused(kind, t, "129 x 200 for 26000 parameters");
    t = c.tensor(true);
    t.rows = 0;  // (26000 x 1 is accepted: below)
    t.cols = 1;
    expect_refused(kind, t, "0 x 1 for 26000");
    t = c.tensor(true);
    t.rows = -130;
    t.cols = -200;
    expect_refused(kind, t, "-130 x -200");
    t = c.tensor(true);
    t.quant_format = LWO_QUANT_INT4_GROUP128;
    expect_refused(kind, t, "quant_format 4");
    t.quant_format = LWO_QUANT_FP8_E4M3_CHANNEL;
    expect_refused(kind, t, "quant_format 1");
    t = c.tensor(true);
    t.scales = nullptr;
    expect_refused(kind, t, "130 x 200 with a NULL scales");
    t = c.tensor(true);
    t.codes = nullptr;
    expect_refused(kind, t, "130 x 200 with a NULL codes");
    t = c.tensor(false);
    t.codes = c.codes();
    expect_refused(kind, t, "LWO_QUANT_NONE");
    ASSERT_EQ(c.master, before) << "a refused step wrote the masters";
  }
  // The accepted shape beside them: a column of 26000 rows.
  Workers w(1);
  Case col(26000, 1, LWO_DTYPE_F32, 4), plain(26000, 1, LWO_DTYPE_F32, 4);
  adamw_step(col.tensor(true), AdamW{}, 1, w);
  adamw_step(plain.tensor(false), AdamW{}, 1, w);
  quant::quantize(plain.layout, plain.master.data(), LWO_DTYPE_F32, plain.record.data(), 1);
  EXPECT_EQ(0, std::memcmp(col.record.data(), plain.record.data(), col.layout.data_bytes));
}

}  // namespace
}  // namespace optim
}  // namespace lwo
