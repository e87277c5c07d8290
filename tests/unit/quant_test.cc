// Quantized weight formats (lwo.h "Quantized weights", src/quant): layouts
// and their validation, the element codecs against independent references,
// the scale and rounding rules bit for bit on hand-picked values, and the
// round-trip error of lwo_quantize -> lwo_dequantize_host against the fp64
// weights, on random and heavy-tailed weights, within a bound derived from
// each format's step. No GPU: lwo_dequantize is checked here for its
// validation only (tests/gpu/quant_test.cc runs it).
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/common/dtype.h"
#include "src/quant/codec.h"
#include "src/quant/quant.h"
#include "test_util.h"
#include "unit/quant_formats.h"

namespace lwo {
namespace testing {
namespace {

using lwo_quant_test::desc_of;
using lwo_quant_test::kFormats;

lwo_quant_layout_info layout(const lwo_quant_desc& d) {
  lwo_quant_layout_info info = LWO_QUANT_LAYOUT_INFO_INIT;
  EXPECT_EQ(lwo_quant_layout(&d, &info), LWO_OK) << lwo_last_error_message();
  return info;
}


// ---- independent references ----

// The value of an e4m3 code by the definition: (-1)^s 2^(e-7) (1 + m/8), or
// 2^-6 (m/8) for e = 0; NaN for S.1111.111.
double e4m3_ref(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}

// Nearest e4m3 code to v by exhaustive search (ties to the even code, whose
// last bit is the mantissa's), saturating to 448.
uint8_t e4m3_encode_ref(double v) {
  const double a = std::min(std::fabs(v), 448.0);
  int best = 0;
  double best_d = INFINITY;
  for (int b = 0; b <= 0x7e; ++b) {
    const double d = std::fabs(e4m3_ref(static_cast<uint8_t>(b)) - a);
    if (d < best_d || (d == best_d && (b & 1) == 0)) {
      best = b;
      best_d = d;
    }
  }
  return static_cast<uint8_t>((std::signbit(v) ? 0x80 : 0) | best);
}

// Bytes of n elements of dt from f32 values (rounded to nearest even).
std::vector<uint8_t> encode_src(const std::vector<float>& v, lwo_dtype_t dt) {
  std::vector<uint8_t> out(v.size() * lwo_dtype_size(dt));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == LWO_DTYPE_F32) {
      std::memcpy(&out[4 * i], &v[i], 4);
    } else {
      uint16_t h = dt == LWO_DTYPE_BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
      std::memcpy(&out[2 * i], &h, 2);
    }
  }
  return out;
}

double src_value(const std::vector<uint8_t>& b, lwo_dtype_t dt, size_t i) {
  if (dt == LWO_DTYPE_F32) {
    float f;
    std::memcpy(&f, &b[4 * i], 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, &b[2 * i], 2);
  return dt == LWO_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

float scale_at(const std::vector<uint8_t>& q, const lwo_quant_layout_info& info, int64_t i) {
  float s;
  std::memcpy(&s, &q[info.scale_offset + 4 * static_cast<uint64_t>(i)], 4);
  return s;
}

// The code of element i, decoded independently of src/quant.
double code_ref(lwo_quant_format_t f, const std::vector<uint8_t>& q, uint64_t i) {
  switch (f) {
    case LWO_QUANT_FP8_E4M3_CHANNEL:
    case LWO_QUANT_FP8_E4M3_BLOCK128: return e4m3_ref(q[i]);
    case LWO_QUANT_INT8_CHANNEL: return static_cast<int8_t>(q[i]);
    default: return static_cast<int>((q[i / 2] >> (4 * (i % 2))) & 15) - 8;
  }
}

// Which scale covers (r, c), by the documented rule.
int64_t scale_index_ref(lwo_quant_format_t f, const lwo_quant_layout_info& info, int64_t r,
                        int64_t c) {
  switch (f) {
    case LWO_QUANT_FP8_E4M3_BLOCK128: return (r / 128) * info.scale_cols + c / 128;
    case LWO_QUANT_INT4_GROUP128: return r * info.scale_cols + c / 128;
    default: return r;
  }
}

double code_max(lwo_quant_format_t f) {
  return f == LWO_QUANT_INT8_CHANNEL ? 127.0 : f == LWO_QUANT_INT4_GROUP128 ? 7.0 : 448.0;
}

// The documented scale of a unit whose largest magnitude is amax: for the
// integer formats max(amax / M, 2^-126), the f32 quotient; for fp8 the
// smallest power of two s with amax / s <= 464 (the midpoint past 448, the
// largest code; exact comparisons in f64), at least 2^-126.
float scale_ref(lwo_quant_format_t f, double amax) {
  if (f == LWO_QUANT_INT8_CHANNEL || f == LWO_QUANT_INT4_GROUP128)
    return std::max(static_cast<float>(amax / code_max(f)), 0x1p-126f);
  int k = -126;
  while (std::ldexp(464.0, k) < amax) ++k;
  return std::ldexp(1.0f, k);
}

// The round-trip bound of one element x under scale s, from the format's
// step: half a step of the code at x / s, plus the f32 roundings of the
// quotient x / s (relative 2^-24, 2^-23 taken) and of the product code x s.
//  - int8, int4: the step is 1 (code units), so |x^ - x| <= s/2 (+ slop);
//  - fp8 e4m3: 3 mantissa bits, so half a step is 2^(floor(log2 |q|) - 4)
//    (at most |q| / 16, relative 6.25%) for |q| >= 2^-6 and 2^-10 below (the
//    subnormal step 2^-9).
double bound(lwo_quant_format_t f, double x, double s) {
  const double q = std::fabs(x) / s * (1 + 0x1p-22);
  double half_step = 0.5;
  if (f == LWO_QUANT_FP8_E4M3_CHANNEL || f == LWO_QUANT_FP8_E4M3_BLOCK128)
    half_step = q < 0x1p-6 ? 0x1p-10 : std::ldexp(1.0, static_cast<int>(std::floor(std::log2(q))) - 4);
  return s * (half_step + q * 0x1p-23) + std::fabs(x) * 0x1p-23;
}

// ---------------------------------------------------------------------------
// Layouts
// ---------------------------------------------------------------------------

TEST(QuantLayout, ArithmeticOfEveryFormat) {
  struct Case {
    lwo_quant_format_t f;
    int64_t rows, cols;
    uint64_t data, scale_off, scale_bytes;
    int64_t srows, scols;
    uint64_t total;
  } cases[] = {
      {LWO_QUANT_FP8_E4M3_CHANNEL, 3, 5, 15, 256, 12, 3, 1, 512},
      {LWO_QUANT_FP8_E4M3_CHANNEL, 1, 256, 256, 256, 4, 1, 1, 512},
      {LWO_QUANT_FP8_E4M3_BLOCK128, 300, 200, 60000, 60160, 24, 3, 2, 60416},
      {LWO_QUANT_FP8_E4M3_BLOCK128, 128, 128, 16384, 16384, 4, 1, 1, 16640},
      {LWO_QUANT_FP8_E4M3_BLOCK128, 1, 1, 1, 256, 4, 1, 1, 512},
      {LWO_QUANT_INT8_CHANNEL, 4096, 4096, 16777216, 16777216, 16384, 4096, 1, 16793600},
      {LWO_QUANT_INT4_GROUP128, 2, 256, 256, 256, 16, 2, 2, 512},
      {LWO_QUANT_INT4_GROUP128, 8192, 8192, 33554432, 33554432, 2097152, 8192, 64, 35651584},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(lwo_quant_format_name(c.f)) + " " + std::to_string(c.rows) + "x" +
                 std::to_string(c.cols));
    lwo_quant_layout_info info = layout(desc_of(c.f, c.rows, c.cols));
    EXPECT_EQ(info.size, sizeof info);
    EXPECT_EQ(info.data_offset, 0u);
    EXPECT_EQ(info.data_bytes, c.data);
    EXPECT_EQ(info.scale_offset, c.scale_off);
    EXPECT_EQ(info.scale_bytes, c.scale_bytes);
    EXPECT_EQ(info.scale_rows, c.srows);
    EXPECT_EQ(info.scale_cols, c.scols);
    EXPECT_EQ(info.total_bytes, c.total);
    EXPECT_EQ(info.scale_offset % LWO_RECORD_ALIGN, 0u);
    EXPECT_EQ(info.total_bytes % LWO_RECORD_ALIGN, 0u);
    // The source dtype does not change the layout.
    lwo_quant_layout_info f32 = layout(desc_of(c.f, c.rows, c.cols, LWO_DTYPE_F32));
    EXPECT_EQ(f32.total_bytes, info.total_bytes);
  }
}

TEST(QuantLayout, SmallerOutputStructGetsItsPrefix) {
  lwo_quant_desc d = desc_of(LWO_QUANT_INT8_CHANNEL, 3, 5);
  lwo_quant_layout_info info;
  std::memset(&info, 0xab, sizeof info);
  info.size = offsetof(lwo_quant_layout_info, scale_offset);
  ASSERT_LWO(lwo_quant_layout(&d, &info));
  EXPECT_EQ(info.size, offsetof(lwo_quant_layout_info, scale_offset));
  EXPECT_EQ(info.data_bytes, 15u);
  uint64_t untouched;
  std::memset(&untouched, 0xab, sizeof untouched);
  EXPECT_EQ(info.scale_offset, untouched);
}

TEST(QuantLayout, FormatNames) {
  EXPECT_STREQ(lwo_quant_format_name(LWO_QUANT_NONE), "none");
  EXPECT_STREQ(lwo_quant_format_name(LWO_QUANT_FP8_E4M3_CHANNEL), "fp8_e4m3_channel");
  EXPECT_STREQ(lwo_quant_format_name(LWO_QUANT_FP8_E4M3_BLOCK128), "fp8_e4m3_block128");
  EXPECT_STREQ(lwo_quant_format_name(LWO_QUANT_INT8_CHANNEL), "int8_channel");
  EXPECT_STREQ(lwo_quant_format_name(LWO_QUANT_INT4_GROUP128), "int4_group128");
  EXPECT_STREQ(lwo_quant_format_name(static_cast<lwo_quant_format_t>(77)), "unknown");
  lwo_quant_desc d;
  std::memset(&d, 0x5a, sizeof d);
  lwo_quant_desc_init(&d);
  EXPECT_EQ(d.size, sizeof d);
  EXPECT_EQ(d.format, LWO_QUANT_NONE);
  EXPECT_EQ(d.dtype, LWO_DTYPE_BF16);
  EXPECT_EQ(d.rows, 0);
  EXPECT_EQ(d.cols, 0);
}

TEST(QuantLayout, Validation) {
  lwo_quant_layout_info info = LWO_QUANT_LAYOUT_INFO_INIT;
  lwo_quant_desc ok = desc_of(LWO_QUANT_INT4_GROUP128, 4, 256);
  const char* L = "lwo_quant_layout";
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "desc is NULL", lwo_quant_layout(nullptr, &info));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "info is NULL", lwo_quant_layout(&ok, nullptr));
  lwo_quant_layout_info small = info;
  small.size = 4;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "info size 4 is too small", lwo_quant_layout(&ok, &small));
  lwo_quant_desc d = ok;
  d.size = 2;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "desc size 2 is too small", lwo_quant_layout(&d, &info));
  // A newer caller's larger desc: accepted with a zero tail, refused otherwise.
  struct {
    lwo_quant_desc d;
    uint32_t extra;
  } bigger{ok, 0};
  bigger.d.size = sizeof bigger;
  EXPECT_EQ(lwo_quant_layout(&bigger.d, &info), LWO_OK) << lwo_last_error_message();
  bigger.extra = 1;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "desc", lwo_quant_layout(&bigger.d, &info));
  d = ok;
  d.format = LWO_QUANT_NONE;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "LWO_QUANT_NONE", lwo_quant_layout(&d, &info));
  d.format = static_cast<lwo_quant_format_t>(9);
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "format 9 is not a quantized format", lwo_quant_layout(&d, &info));
  d = ok;
  d.dtype = LWO_DTYPE_I8;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "dtype i8 (5) is not f32, bf16 or f16", lwo_quant_layout(&d, &info));
  d = ok;
  d.rows = 0;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "0 x 256: rows and cols must be >= 1", lwo_quant_layout(&d, &info));
  d = ok;
  d.cols = -128;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "must be >= 1", lwo_quant_layout(&d, &info));
  d = desc_of(LWO_QUANT_FP8_E4M3_CHANNEL, INT64_C(1) << 31, 8);
  EXPECT_QERR(LWO_ERR_OUT_OF_RANGE, L, "below 2^31", lwo_quant_layout(&d, &info));
  d = desc_of(LWO_QUANT_FP8_E4M3_BLOCK128, 8, INT64_C(1) << 40);
  EXPECT_QERR(LWO_ERR_OUT_OF_RANGE, L, "below 2^31", lwo_quant_layout(&d, &info));
  d = desc_of(LWO_QUANT_INT4_GROUP128, 4, 200);
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "int4_group128 tensor of 4 x 200: cols must be a multiple of the group size 128",
              lwo_quant_layout(&d, &info));
  d = desc_of(LWO_QUANT_INT4_GROUP128, 4, 64);
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, L, "group size 128", lwo_quant_layout(&d, &info));
  // Shapes that fit no block or group are fine elsewhere: edge blocks.
  for (lwo_quant_format_t f : {LWO_QUANT_FP8_E4M3_CHANNEL, LWO_QUANT_FP8_E4M3_BLOCK128, LWO_QUANT_INT8_CHANNEL}) {
    d = desc_of(f, 129, 1);
    EXPECT_EQ(lwo_quant_layout(&d, &info), LWO_OK) << lwo_last_error_message();
  }
  EXPECT_STREQ(lwo_last_error_message(), "");
}

TEST(QuantLayout, QuantizeAndDequantizeValidation) {
  lwo_quant_desc d = desc_of(LWO_QUANT_FP8_E4M3_CHANNEL, 3, 5);
  lwo_quant_layout_info info = layout(d);
  std::vector<uint8_t> src(3 * 5 * 2, 0), dst(info.total_bytes + 7, 0xcd);
  const char* Q = "lwo_quantize";
  const char* H = "lwo_dequantize_host";
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, Q, "desc is NULL",
              lwo_quantize(nullptr, src.data(), src.size(), dst.data(), dst.size(), 1));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, Q, "src is NULL",
              lwo_quantize(&d, nullptr, src.size(), dst.data(), dst.size(), 1));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, Q, "dst is NULL",
              lwo_quantize(&d, src.data(), src.size(), nullptr, dst.size(), 1));
  EXPECT_QERR(LWO_ERR_SIZE_MISMATCH, Q, "src_bytes 29 is smaller than the 30 bytes of the 3 x 5 bf16",
              lwo_quantize(&d, src.data(), 29, dst.data(), dst.size(), 1));
  EXPECT_QERR(LWO_ERR_SIZE_MISMATCH, Q,
              "dst_bytes 511 is smaller than the 512 bytes of the 3 x 5 fp8_e4m3_channel tensor (bf16)",
              lwo_quantize(&d, src.data(), src.size(), dst.data(), 511, 1));
  lwo_quant_desc bad = d;
  bad.format = LWO_QUANT_NONE;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, Q, "LWO_QUANT_NONE",
              lwo_quantize(&bad, src.data(), src.size(), dst.data(), dst.size(), 1));
  bad = desc_of(LWO_QUANT_INT8_CHANNEL, 3, INT64_C(1) << 31);
  EXPECT_QERR(LWO_ERR_OUT_OF_RANGE, Q, "below 2^31",
              lwo_quantize(&bad, src.data(), src.size(), dst.data(), dst.size(), 1));
  // Nothing was written by the failed calls.
  for (uint8_t b : dst) ASSERT_EQ(b, 0xcd);

  // Non-finite values: named by row and column, found before dst is written.
  for (lwo_dtype_t dt : {LWO_DTYPE_F32, LWO_DTYPE_BF16, LWO_DTYPE_F16}) {
    for (float v : {NAN, INFINITY, -INFINITY}) {
      std::vector<float> w(15, 0.5f);
      w[1 * 5 + 2] = v;
      w[2 * 5 + 4] = v;  // a later one is not the one named
      std::vector<uint8_t> s = encode_src(w, dt);
      lwo_quant_desc dd = desc_of(LWO_QUANT_FP8_E4M3_CHANNEL, 3, 5, dt);
      EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, Q,
                  std::string("src element [1, 2] of the 3 x 5 tensor is ") + (std::isnan(v) ? "NaN" : "infinite"),
                  lwo_quantize(&dd, s.data(), s.size(), dst.data(), dst.size(), 0));
      for (uint8_t b : dst) ASSERT_EQ(b, 0xcd);
    }
  }

  ASSERT_LWO(lwo_quantize(&d, src.data(), src.size(), dst.data(), info.total_bytes, 1));
  for (size_t i = info.total_bytes; i < dst.size(); ++i) EXPECT_EQ(dst[i], 0xcd) << i;
  std::vector<uint8_t> out(3 * 5 * 2 + 3, 0xee);
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, H, "src is NULL",
              lwo_dequantize_host(&d, nullptr, dst.size(), out.data(), out.size(), 1));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, H, "dst is NULL",
              lwo_dequantize_host(&d, dst.data(), dst.size(), nullptr, out.size(), 1));
  EXPECT_QERR(LWO_ERR_SIZE_MISMATCH, H, "src_bytes 300 is smaller than the 512 bytes",
              lwo_dequantize_host(&d, dst.data(), 300, out.data(), out.size(), 1));
  EXPECT_QERR(LWO_ERR_SIZE_MISMATCH, H, "dst_bytes 29 is smaller than the 30 bytes",
              lwo_dequantize_host(&d, dst.data(), dst.size(), out.data(), 29, 1));
  for (uint8_t b : out) ASSERT_EQ(b, 0xee);
  ASSERT_LWO(lwo_dequantize_host(&d, dst.data(), dst.size(), out.data(), out.size(), 1));
  for (size_t i = 30; i < out.size(); ++i) EXPECT_EQ(out[i], 0xee) << i;
}

class QuantDevice : public EngineTest {};

TEST_F(QuantDevice, DequantizeValidation) {
  lwo_quant_desc d = desc_of(LWO_QUANT_INT8_CHANNEL, 3, 5);
  alignas(16) static uint8_t src[512], dst[64];
  const char* D = "lwo_dequantize";
  EXPECT_QERR(LWO_ERR_INVALID_HANDLE, D, "", lwo_dequantize(nullptr, &d, src, dst, nullptr));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, D, "desc is NULL", lwo_dequantize(engine, nullptr, src, dst, nullptr));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, D, "src is NULL", lwo_dequantize(engine, &d, nullptr, dst, nullptr));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, D, "dst is NULL", lwo_dequantize(engine, &d, src, nullptr, nullptr));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, D, "is not aligned to the 2 bytes of a bf16 element",
              lwo_dequantize(engine, &d, src, dst + 1, nullptr));
  d.dtype = LWO_DTYPE_F32;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, D, "is not aligned to the 4 bytes of a f32 element",
              lwo_dequantize(engine, &d, src, dst + 2, nullptr));
  d.dtype = LWO_DTYPE_F64;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, D, "dtype f64", lwo_dequantize(engine, &d, src, dst, nullptr));
  d = desc_of(LWO_QUANT_INT4_GROUP128, 3, 5);
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, D, "group size 128", lwo_dequantize(engine, &d, src, dst, nullptr));
  d = desc_of(LWO_QUANT_INT8_CHANNEL, INT64_C(1) << 33, 5);
  EXPECT_QERR(LWO_ERR_OUT_OF_RANGE, D, "below 2^31", lwo_dequantize(engine, &d, src, dst, nullptr));
}

// ---------------------------------------------------------------------------
// Codecs
// ---------------------------------------------------------------------------

TEST(QuantCodec, E4m3DecodesEveryCodeByTheDefinition) {
  for (int b = 0; b < 256; ++b) {
    const float got = quant::e4m3_to_f32(static_cast<uint8_t>(b));
    const double want = e4m3_ref(static_cast<uint8_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << b;
      EXPECT_EQ(std::signbit(got), (b & 0x80) != 0) << b;
    }
  }
  EXPECT_EQ(quant::e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(quant::e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_EQ(quant::e4m3_to_f32(0x08), 0x1p-6f);
}

TEST(QuantCodec, E4m3EncodesToTheNearestEvenAndSaturates) {
  // Every code round-trips; every midpoint between neighbours goes to the
  // even one; random values to the exhaustive search's nearest.
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    EXPECT_EQ(quant::f32_to_e4m3(quant::e4m3_to_f32(static_cast<uint8_t>(b))), b) << b;
  }
  for (int b = 0; b < 0x7e; ++b) {
    const float mid = static_cast<float>((e4m3_ref(static_cast<uint8_t>(b)) + e4m3_ref(static_cast<uint8_t>(b + 1))) / 2);
    const int even = (b & 1) ? b + 1 : b;
    EXPECT_EQ(quant::f32_to_e4m3(mid), even) << "midpoint above code " << b;
    EXPECT_EQ(quant::f32_to_e4m3(-mid), 0x80 | even) << "midpoint below code " << -b;
  }
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> expo(-14, 10);
  for (int i = 0; i < 200000; ++i) {
    const float v = static_cast<float>(std::exp2(expo(rng)) * ((rng() & 1) ? -1 : 1));
    ASSERT_EQ(quant::f32_to_e4m3(v), e4m3_encode_ref(v)) << v;
  }
  // Saturation: 448 and everything above, to infinity, is 0x7e.
  for (float v : {448.0f, 463.99f, 464.0f, 480.0f, 1e6f, FLT_MAX, INFINITY})
    EXPECT_EQ(quant::f32_to_e4m3(v), 0x7e) << v;
  EXPECT_EQ(quant::f32_to_e4m3(-1e30f), 0xfe);
  EXPECT_EQ(quant::f32_to_e4m3(0x1p-10f), 0x00);       // tie between 0 and 2^-9: even, 0
  EXPECT_EQ(quant::f32_to_e4m3(3 * 0x1p-10f), 0x02);   // tie between 1 and 2 (x 2^-9): 2
  EXPECT_EQ(quant::f32_to_e4m3(1.0625f), 0x38);        // tie between 1 and 1.125: 1
  EXPECT_EQ(quant::f32_to_e4m3(1.1875f), 0x3a);        // tie between 1.125 and 1.25: 1.25
  EXPECT_EQ(quant::f32_to_e4m3(-0.0f), 0x80);
}

TEST(QuantCodec, SixteenBitRoundingEqualsTheCommonConversions) {
  // The host/device converters of codec.h against src/common's host ones.
  std::mt19937_64 rng(11);
  std::vector<uint32_t> bits = {0u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                                0x477ff000u, 0x477fefffu, 0x38800000u, 0x387fffffu, 0x33000000u,
                                0x33000001u, 0x32ffffffu, 0x00000001u, 0x007fffffu, 0x3f808000u,
                                0x3f818000u, 0x7f7fffffu};
  for (int i = 0; i < 2000000; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  // Dense around the f16 subnormal range and the bf16 / f16 ties.
  for (uint32_t e = 100; e < 115; ++e)
    for (int i = 0; i < 20000; ++i) bits.push_back((e << 23) | (static_cast<uint32_t>(rng()) & 0x807fffffu));
  for (uint32_t u : bits) {
    float f;
    std::memcpy(&f, &u, 4);
    ASSERT_EQ(quant::f32_to_bf16(f), f32_to_bf16(f)) << std::hex << u;
    ASSERT_EQ(quant::f32_to_f16(f), f32_to_f16(f)) << std::hex << u;
  }
}

// ---------------------------------------------------------------------------
// Scale and rounding rules, bit for bit
// ---------------------------------------------------------------------------

std::vector<uint8_t> quantize(const lwo_quant_desc& d, const std::vector<float>& w, uint32_t threads = 0) {
  lwo_quant_layout_info info = layout(d);
  std::vector<uint8_t> s = encode_src(w, d.dtype), q(info.total_bytes, 0xcd);
  EXPECT_EQ(lwo_quantize(&d, s.data(), s.size(), q.data(), q.size(), threads), LWO_OK)
      << lwo_last_error_message();
  return q;
}

std::vector<float> dequantize_f32(lwo_quant_desc d, const std::vector<uint8_t>& q, uint32_t threads = 0) {
  d.dtype = LWO_DTYPE_F32;
  std::vector<float> out(static_cast<size_t>(d.rows * d.cols));
  EXPECT_EQ(lwo_dequantize_host(&d, q.data(), q.size(), out.data(), out.size() * 4, threads), LWO_OK)
      << lwo_last_error_message();
  return out;
}

TEST(QuantRules, Fp8TiesSaturationAndZeroRows) {
  // Row 0: amax 448, so the scale is exactly 1 and the codes are the values'.
  // Row 1: all zeros (scale 2^-126, codes 0). Row 2: amax 7 -> scale 7/448 = 1/64.
  std::vector<float> w = {448, 1.0625f, 1.1875f, 0x1p-10f, 3 * 0x1p-10f, -448, 0, -2.5f,
                          0, 0, 0, 0, 0, 0, 0, 0,
                          7, -7, 0.5f, 0.0078125f, -3.5f, 1, 0, 0};
  lwo_quant_desc d = desc_of(LWO_QUANT_FP8_E4M3_CHANNEL, 3, 8, LWO_DTYPE_F32);
  std::vector<uint8_t> q = quantize(d, w);
  lwo_quant_layout_info info = layout(d);
  const uint8_t row0[] = {0x7e, 0x38, 0x3a, 0x00, 0x02, 0xfe, 0x00, 0xc2};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(q[c], row0[c]) << "row 0 col " << c;
  for (int c = 0; c < 8; ++c) EXPECT_EQ(q[8 + c], 0x00) << "row 1 col " << c;
  EXPECT_EQ(scale_at(q, info, 0), 1.0f);
  EXPECT_EQ(scale_at(q, info, 1), 0x1p-126f);
  EXPECT_EQ(scale_at(q, info, 2), 1.0f / 64);
  // Row 2 in code units: 448, -448, 32, 0.5, -224, 64, 0, 0.
  const uint8_t row2[] = {0x7e, 0xfe, 0x60, 0x30, 0xf6, 0x68, 0x00, 0x00};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(q[16 + c], row2[c]) << "row 2 col " << c;
  // Padding between the codes and the scales, and after the scales, is zero.
  for (uint64_t i = info.data_bytes; i < info.scale_offset; ++i) ASSERT_EQ(q[i], 0) << i;
  for (uint64_t i = info.scale_offset + info.scale_bytes; i < info.total_bytes; ++i) ASSERT_EQ(q[i], 0) << i;
  std::vector<float> back = dequantize_f32(d, q);
  const float want0[] = {448, 1, 1.25f, 0, 2 * 0x1p-9f, -448, 0, -2.5f};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(back[c], want0[c]) << c;
  for (int c = 0; c < 8; ++c) EXPECT_EQ(back[8 + c], 0.0f) << c;
  for (int c = 0; c < 8; ++c) EXPECT_EQ(back[16 + c], w[16 + c]) << c;  // all representable
}

TEST(QuantRules, Int8AndInt4TiesClampAndZeroRows) {
  // int8: amax 127 -> scale 1; ties to even, -0.5 to 0.
  std::vector<float> w8 = {127, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, 126.5f, -127, 0, 0, 0, 0, 0, 0, 0, 0};
  lwo_quant_desc d8 = desc_of(LWO_QUANT_INT8_CHANNEL, 2, 8, LWO_DTYPE_F32);
  std::vector<uint8_t> q8 = quantize(d8, w8);
  const int8_t want8[] = {127, 0, 2, 2, 0, -2, 126, -127};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(static_cast<int8_t>(q8[c]), want8[c]) << c;
  for (int c = 8; c < 16; ++c) EXPECT_EQ(q8[c], 0) << c;
  lwo_quant_layout_info i8 = layout(d8);
  EXPECT_EQ(scale_at(q8, i8, 0), 1.0f);
  EXPECT_EQ(scale_at(q8, i8, 1), 0x1p-126f);

  // int4: group 0 of row 0 has amax 7 -> scale 1; group 1 is zeros.
  std::vector<float> w4(2 * 256, 0.0f);
  const float g0[] = {7, 0.5f, 1.5f, 2.5f, -0.5f, -6.5f, 6.5f, -7};
  for (int c = 0; c < 8; ++c) w4[c] = g0[c];
  for (int c = 0; c < 256; ++c) w4[256 + c] = static_cast<float>(c % 15 - 7) * 0.25f;  // row 1: amax 1.75
  lwo_quant_desc d4 = desc_of(LWO_QUANT_INT4_GROUP128, 2, 256, LWO_DTYPE_F32);
  std::vector<uint8_t> q4 = quantize(d4, w4);
  const int want4[] = {7, 0, 2, 2, 0, -6, 6, -7};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(((q4[c / 2] >> (4 * (c % 2))) & 15) - 8, want4[c]) << c;
  EXPECT_EQ(q4[0], (7 + 8) | ((0 + 8) << 4));
  lwo_quant_layout_info i4 = layout(d4);
  EXPECT_EQ(scale_at(q4, i4, 0), 1.0f);
  EXPECT_EQ(scale_at(q4, i4, 1), 0x1p-126f);  // row 0, group 1: zeros
  for (int c = 128; c < 256; ++c) EXPECT_EQ((q4[c / 2] >> (4 * (c % 2))) & 15, 8) << c;
  EXPECT_EQ(scale_at(q4, i4, 2), 0.25f);  // 1.75 / 7
  for (int c = 0; c < 256; ++c)
    EXPECT_EQ(((q4[(256 + c) / 2] >> (4 * (c % 2))) & 15) - 8, c % 15 - 7) << c;
  std::vector<float> back = dequantize_f32(d4, q4);
  for (int c = 0; c < 256; ++c) EXPECT_EQ(back[256 + c], w4[256 + c]) << c;  // exact
}

TEST(QuantRules, Block128ScalesCoverTheirBlocksOnly) {
  // 200 x 300: blocks of 128 x 128 with partial edge blocks; each block's
  // amax is set by one element, and the scale is the smallest power of two
  // with amax / scale <= 464 (448 -> 1, 896 -> 2, 44.8 -> 1/8, 4480 -> 16,
  // 1 -> 2^-8, 7 -> 2^-6).
  const int64_t R = 200, C = 300;
  std::vector<float> w(static_cast<size_t>(R * C), 0.25f);
  lwo_quant_desc d = desc_of(LWO_QUANT_FP8_E4M3_BLOCK128, R, C, LWO_DTYPE_F32);
  lwo_quant_layout_info info = layout(d);
  ASSERT_EQ(info.scale_rows, 2);
  ASSERT_EQ(info.scale_cols, 3);
  const float peaks[6] = {448, 896, 44.8f, 4480, 1, 7};
  for (int br = 0; br < 2; ++br)
    for (int bc = 0; bc < 3; ++bc) w[static_cast<size_t>((br * 128 + 5) * C + bc * 128 + 9)] = peaks[br * 3 + bc];
  std::vector<uint8_t> q = quantize(d, w);
  const float want_scale[6] = {1, 2, 0.125f, 16, 0x1p-8f, 0x1p-6f};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(scale_at(q, info, i), want_scale[i]) << i;
  for (int i = 0; i < 6; ++i) EXPECT_EQ(scale_ref(LWO_QUANT_FP8_E4M3_BLOCK128, peaks[i]), want_scale[i]) << i;
  // The peak of each block is coded under its block's scale (448 and 896 to
  // the largest code, 44.8 x 8 = 358.4 to 352, 4480 / 16 = 280 to 288, 1 x 256 to 256).
  for (int br = 0; br < 2; ++br)
    for (int bc = 0; bc < 3; ++bc)
      EXPECT_EQ(q[static_cast<size_t>((br * 128 + 5) * C + bc * 128 + 9)],
                e4m3_encode_ref(peaks[br * 3 + bc] / want_scale[br * 3 + bc]));
  EXPECT_EQ(q[static_cast<size_t>(5 * C + 9)], 0x7e);
}

TEST(QuantRules, SixteenBitSourcesAndOutputs) {
  // bf16 and f16 sources quantize their exact values; bf16 / f16 outputs are
  // the f32 dequantized values rounded to nearest even.
  std::mt19937_64 rng(3);
  std::normal_distribution<float> g(0.0f, 0.05f);
  const int64_t R = 37, C = 256;
  std::vector<float> w(static_cast<size_t>(R * C));
  for (float& x : w) x = g(rng);
  for (lwo_quant_format_t f : kFormats) {
    for (lwo_dtype_t dt : {LWO_DTYPE_BF16, LWO_DTYPE_F16}) {
      lwo_quant_desc d = desc_of(f, R, C, dt);
      std::vector<uint8_t> s = encode_src(w, dt);
      // The same codes as quantizing the f32 values the 16-bit source holds.
      std::vector<float> exact(w.size());
      for (size_t i = 0; i < w.size(); ++i) exact[i] = static_cast<float>(src_value(s, dt, i));
      std::vector<uint8_t> q = quantize(d, w), q32 = quantize(desc_of(f, R, C, LWO_DTYPE_F32), exact);
      EXPECT_EQ(q, q32) << lwo_quant_format_name(f) << " " << lwo_dtype_name(dt);
      std::vector<float> back = dequantize_f32(d, q);
      std::vector<uint16_t> h(w.size());
      ASSERT_LWO(lwo_dequantize_host(&d, q.data(), q.size(), h.data(), h.size() * 2, 3));
      for (size_t i = 0; i < w.size(); ++i)
        ASSERT_EQ(h[i], dt == LWO_DTYPE_BF16 ? f32_to_bf16(back[i]) : f32_to_f16(back[i])) << i;
    }
  }
}

TEST(QuantRules, NanResultsAreOneQuietNan) {
  // fp8 codes 0x7f and 0xff, and an infinite scale times code 0: the quiet
  // NaN 0x7fc00000 whatever the operands' signs and payloads.
  lwo_quant_desc d = desc_of(LWO_QUANT_FP8_E4M3_CHANNEL, 2, 4, LWO_DTYPE_F32);
  lwo_quant_layout_info info = layout(d);
  std::vector<uint8_t> q(info.total_bytes, 0);
  const uint8_t codes[8] = {0x7f, 0xff, 0x38, 0x00, 0x00, 0x80, 0x38, 0x7f};
  std::memcpy(q.data(), codes, 8);
  const float scales[2] = {2.0f, -INFINITY};
  std::memcpy(&q[info.scale_offset], scales, 8);
  std::vector<uint32_t> f(8);
  ASSERT_LWO(lwo_dequantize_host(&d, q.data(), q.size(), f.data(), 32, 1));
  const uint32_t want[8] = {0x7fc00000u, 0x7fc00000u, 0x40000000u, 0, 0x7fc00000u, 0x7fc00000u,
                            0xff800000u, 0x7fc00000u};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(f[i], want[i]) << i;
  std::vector<uint16_t> h(8);
  d.dtype = LWO_DTYPE_BF16;
  ASSERT_LWO(lwo_dequantize_host(&d, q.data(), q.size(), h.data(), 16, 1));
  EXPECT_EQ(h[1], 0x7fc0);
  EXPECT_EQ(h[4], 0x7fc0);
  d.dtype = LWO_DTYPE_F16;
  ASSERT_LWO(lwo_dequantize_host(&d, q.data(), q.size(), h.data(), 16, 1));
  EXPECT_EQ(h[1], 0x7e00);
  EXPECT_EQ(h[6], 0xfc00);  // -infinity
}

// ---------------------------------------------------------------------------
// Round trip against fp64, random and heavy-tailed weights
// ---------------------------------------------------------------------------

// Weights N(0, 0.02); heavy: plus 3 outliers per row of 20..100 sigma.
std::vector<float> weights(int64_t R, int64_t C, bool heavy, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 0.02f);
  std::uniform_real_distribution<float> big(0.4f, 2.0f);
  std::vector<float> w(static_cast<size_t>(R * C));
  for (float& x : w) x = g(rng);
  if (heavy)
    for (int64_t r = 0; r < R; ++r)
      for (int k = 0; k < 3; ++k)
        w[static_cast<size_t>(r * C + static_cast<int64_t>(rng() % static_cast<uint64_t>(C)))] =
            big(rng) * ((rng() & 1) ? 1.0f : -1.0f);
  return w;
}

// An fp8 record quantized again from its own dequantized values is the same
// record: each unit's largest code (240 to 448) gives back its scale, so a
// trainable record and the masters dequantized from it agree before the
// first update. Units whose amax sits just past a power of two times 232,
// 448 and 464, on random and heavy-tailed data.
TEST(QuantRules, Fp8QuantizeOfDequantizeIsTheSameRecord) {
  const int64_t R = 263, C = 384;
  for (lwo_quant_format_t f : {LWO_QUANT_FP8_E4M3_CHANNEL, LWO_QUANT_FP8_E4M3_BLOCK128})
    for (bool heavy : {false, true}) {
      SCOPED_TRACE(std::string(lwo_quant_format_name(f)) + (heavy ? ", heavy-tailed" : ", normal"));
      std::vector<float> w = weights(R, C, heavy, heavy ? 23 : 29);
      const float edges[] = {232.5f, 233.0f, 240.0f, 447.0f, 448.0f, 449.0f, 463.0f, 464.0f, 465.0f};
      for (int64_t r = 0; r < R; r += 2)
        w[static_cast<size_t>(r * C + (r * 7) % C)] = std::ldexp(edges[(r / 2) % 9], int(r % 11) - 14);
      const lwo_quant_desc d = desc_of(f, R, C, LWO_DTYPE_F32);
      const std::vector<uint8_t> q = quantize(d, w);
      const std::vector<float> back = dequantize_f32(d, q);
      EXPECT_EQ(quantize(d, back), q);
    }
}

TEST(QuantRoundTrip, WithinHalfAStepOfEveryFormat) {
  const int64_t R = 263, C = 384;  // 263: a partial block row
  for (bool heavy : {false, true}) {
    const std::vector<float> w = weights(R, C, heavy, heavy ? 17 : 5);
    for (lwo_quant_format_t f : kFormats) {
      for (lwo_dtype_t dt : {LWO_DTYPE_F32, LWO_DTYPE_BF16, LWO_DTYPE_F16}) {
        SCOPED_TRACE(std::string(lwo_quant_format_name(f)) + " from " + lwo_dtype_name(dt) +
                     (heavy ? ", heavy-tailed" : ", normal"));
        lwo_quant_desc d = desc_of(f, R, C, dt);
        lwo_quant_layout_info info = layout(d);
        std::vector<uint8_t> s = encode_src(w, dt);
        std::vector<uint8_t> q = quantize(d, w, 3);
        std::vector<float> back = dequantize_f32(d, q, 5);
        // Scales: the documented rule's (scale_ref) for the unit's amax.
        std::vector<double> amax(static_cast<size_t>(info.scale_rows * info.scale_cols), 0.0);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < C; ++c) {
            double& m = amax[static_cast<size_t>(scale_index_ref(f, info, r, c))];
            m = std::max(m, std::fabs(src_value(s, dt, static_cast<size_t>(r * C + c))));
          }
        for (size_t i = 0; i < amax.size(); ++i)
          ASSERT_EQ(scale_at(q, info, static_cast<int64_t>(i)), scale_ref(f, amax[i])) << "scale " << i;
        double worst = 0, sum2 = 0, ref2 = 0;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < C; ++c) {
            const uint64_t i = static_cast<uint64_t>(r * C + c);
            const double x = src_value(s, dt, i);
            const double sc = scale_at(q, info, scale_index_ref(f, info, r, c));
            // The dequantized value is the f32 product code x scale.
            const double want = static_cast<float>(code_ref(f, q, i) * sc);
            ASSERT_EQ(static_cast<double>(back[i]), want) << "element " << r << ", " << c;
            const double err = std::fabs(back[i] - x);
            ASSERT_LE(err, bound(f, x, sc)) << "element " << r << ", " << c << ": " << x << " -> " << back[i];
            worst = std::max(worst, err / bound(f, x, sc));
            sum2 += err * err;
            ref2 += x * x;
          }
        RecordProperty(std::string(lwo_quant_format_name(f)) + "_" + lwo_dtype_name(dt) +
                           (heavy ? "_heavy" : "_normal") + "_rel_rms_error",
                       std::to_string(std::sqrt(sum2 / ref2)));
        EXPECT_GT(worst, 0.5) << "the bound is far from tight: is the test measuring anything?";
      }
    }
  }
}

TEST(QuantRoundTrip, ThreadCountsGiveTheSameBytes) {
  const int64_t R = 1031, C = 512;
  const std::vector<float> w = weights(R, C, true, 23);
  for (lwo_quant_format_t f : kFormats) {
    lwo_quant_desc d = desc_of(f, R, C, LWO_DTYPE_BF16);
    std::vector<uint8_t> q1 = quantize(d, w, 1);
    for (uint32_t t : {0u, 2u, 7u, 64u, 1000u}) {
      EXPECT_EQ(quantize(d, w, t), q1) << lwo_quant_format_name(f) << " threads " << t;
      EXPECT_EQ(dequantize_f32(d, q1, t), dequantize_f32(d, q1, 1)) << lwo_quant_format_name(f) << " threads " << t;
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace lwo
