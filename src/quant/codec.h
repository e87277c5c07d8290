// The element codecs of the quantized formats (src/quant/quant.h), defined
// once for the host and the device: decoding a stored code to f32, the scale
// that covers an element, the dequantized value (code x scale, one f32
// multiply) and its rounding to bf16 / f16. quant.cc (the CPU reference) and
// kernels/quant_kernels.cu (the GPU) both call these functions, so the two
// agree bit for bit by construction; the GPU tests check that they do. The
// encoders (f32 -> code) are host-only: quantization runs on the host.
//
// Header-only, no CUDA header: compiled by the host compiler and by nvcc.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "lwo.h"

#if defined(__CUDACC__)
#define LWO_QUANT_HD __host__ __device__
#else
#define LWO_QUANT_HD
#endif

namespace lwo {
namespace quant {

// Elements per scale: fp8 blocks are kBlock x kBlock (as fp8 checkpoints
// ship them), 4-bit groups are kGroup consecutive elements of one row.
constexpr int64_t kBlock = 128;
constexpr int64_t kGroup = 128;

// The largest code magnitude of each format: an integer unit's scale is
// max(amax / kMax, kMinScale) (unit_scale), an fp8 unit's a power of two
// (fp8_scale).
constexpr float kFp8Max = 448.0f;  // e4m3 (OCP "fn": no infinity), 0x7e
constexpr float kInt8Max = 127.0f;  // symmetric: -128 is never written
constexpr float kInt4Max = 7.0f;    // symmetric: codes -7..7, stored as code + 8
// The smallest scale (2^-126, the smallest normal f32): a unit of zeros (or
// of values below kMax * 2^-126) gets it, so x / scale never divides by 0.
constexpr float kMinScale = 0x1p-126f;

// Which scale covers element (r, c): the one rule, for the host (Layout)
// and the kernels (with `format` a compile-time constant there). scale_cols
// is 1 per channel, ceil(cols / 128) per block, cols / 128 per group.
template <class I>
LWO_QUANT_HD inline I scale_index(lwo_quant_format_t format, I r, I c, I scale_cols) {
  switch (format) {
    case LWO_QUANT_FP8_E4M3_BLOCK128: return (r / I(kBlock)) * scale_cols + c / I(kBlock);
    case LWO_QUANT_INT4_GROUP128: return r * scale_cols + c / I(kGroup);
    default: return r;  // per output channel
  }
}

LWO_QUANT_HD inline float f32_of_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
LWO_QUANT_HD inline uint32_t bits_of_f32(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

// ---- decoding (host and device) ----

// e4m3 (bias 7, 3 mantissa bits, no infinity): 0x7f / 0xff are NaN, the
// largest finite value 0x7e = 448, subnormals m * 2^-9.
LWO_QUANT_HD inline float e4m3_to_f32(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu;
  const uint32_t m = b & 0x7u;
  if (e == 0xfu && m == 0x7u) return f32_of_bits(sign | 0x7fc00000u);
  if (e == 0) return f32_of_bits(sign | bits_of_f32(static_cast<float>(m) * 0x1p-9f));
  return f32_of_bits(sign | ((e + 120u) << 23) | (m << 20));
}

LWO_QUANT_HD inline float i8_to_f32(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)); }

// A 4-bit code: the nibble minus 8 (nibble 0, -8, is never written).
LWO_QUANT_HD inline float i4_to_f32(uint32_t nibble) {
  return static_cast<float>(static_cast<int32_t>(nibble & 0xfu) - 8);
}

// A dequantized element: code x scale, one f32 multiply (round to nearest
// even, subnormals kept). A NaN result (an fp8 NaN code, or a NaN or
// infinite scale) is always the quiet NaN 0x7fc00000: the GPU's multiply
// returns its own canonical NaN and the host's propagates the operand's, so
// neither is used.
LWO_QUANT_HD inline float dequant(float code, float scale) {
  const float v = code * scale;
  return v != v ? f32_of_bits(0x7fc00000u) : v;
}

// Round to nearest even; NaN stays a (quiet) NaN, overflow gives infinity.
// Equal to lwo::f32_to_bf16 (src/common/dtype.h) for every input.
LWO_QUANT_HD inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_of_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Round to nearest even, subnormals included; NaN stays a (quiet) NaN, 65520
// and up give infinity. Integer arithmetic only, so host and device agree.
// Equal to lwo::f32_to_f16 (src/common/dtype.h) for every input.
LWO_QUANT_HD inline uint16_t f32_to_f16(float f) {
  const uint32_t x = bits_of_f32(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up: infinity
  if (ax < 0x38800000u) {                        // below 2^-14: a multiple of 2^-24
    const uint32_t e = ax >> 23;                 // < 113
    const uint32_t shift = 126u - e;             // value * 2^24 = mant >> shift
    if (e == 0 || shift > 24u) return sign;      // below 2^-25: 0
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  ax += 0xc8000fffu + ((ax >> 13) & 1u);  // rebias the exponent by -112 and round
  return sign | static_cast<uint16_t>(ax >> 13);
}

// ---- encoding (host only), of a value already divided by its scale ----

// Round to nearest even, saturating to +-448 (so values of 464 and up, which
// would round past the largest code, give 0x7e as well). v must not be NaN
// (a NaN gives sign | 0x7e). Branch free, so that a loop of it vectorizes
// (the optimizer's fused fp8 write): both paths are formed and one selected,
// on the magnitude's bits. From 2^-6 up the 23-bit mantissa is rounded to 3
// bits in the integer bits (ties to the even mantissa, a carry moving into
// the exponent), and the code capped at 0x7e: every magnitude below 448
// gives at most 0x7e, every one from 448 up (and NaN) more. Below 2^-6 the
// code is a multiple of 2^-9, a x 512 (exact) rounded to an integer by adding
// 2^23 in f32 (the hardware's nearest even: the ulp there is 1).
inline uint8_t f32_to_e4m3(float v) {
  const uint32_t u = bits_of_f32(v);
  const uint32_t au = u & 0x7fffffffu;
  const uint32_t r = au + 0x7ffffu + ((au >> 20) & 1u);
  const uint32_t normal = (r >> 20) - (120u << 3);  // (exponent - 120) << 3 | mantissa
  const uint32_t capped = normal < 0x7eu ? normal : 0x7eu;
  const uint32_t sub = bits_of_f32(f32_of_bits(au) * 512.0f + 0x1p23f) - 0x4b000000u;  // 0 .. 8
  const uint32_t mag = au < 0x3c800000u ? sub : capped;  // below 2^-6: subnormal codes
  return static_cast<uint8_t>(((u >> 24) & 0x80u) | mag);
}

// The scale of an integer unit (channel, group) whose largest magnitude is
// amax (finite, >= 0), for a format whose largest code is code_max
// (kInt8Max, kInt4Max): max(amax / code_max, kMinScale), the f32 division
// rounded to nearest even. The codes' grid is uniform, so the unit's largest
// magnitude maps to the largest code.
inline float unit_scale(float amax, float code_max) {
  const float s = amax / code_max;
  return s < kMinScale ? kMinScale : s;
}

// The scale of an fp8 unit (channel or 128 x 128 block) whose largest
// magnitude is amax (finite, >= 0): the smallest power of two s with
// amax / s <= 464, and at least kMinScale. 464 is the midpoint past 448,
// the largest code: from 448 to 464 a value rounds to 448 within half a step
// (16) as any value of that binade does, so the unit's largest magnitude
// lands in (232, 464] and is coded within half a step. Its code is then 240
// to 448, whose own scale is s again: quantize(dequantize(q)) is q. The e4m3
// grid has the same relative step in every binade, so a power of two costs
// no precision above the subnormal codes, and it makes the encoding a
// multiply by the exact 1 / s (fp8_inverse) and the decoded value code x s
// exact in f32 and in bf16 (as the OCP microscaling formats' scales).
// quantize() (quant.cc) and the host optimizer's fused fp8 write (src/optim)
// both call it. With amax = m 2^e (m in [1, 2)) and 464 = 1.8125 x 2^8:
// s = 2^(e - 8) for m <= 1.8125, else 2^(e - 7).
inline float fp8_scale(float amax) {
  const uint32_t u = bits_of_f32(amax);
  const int32_t k = static_cast<int32_t>(u >> 23) - 127 - 8 + ((u & 0x7fffffu) > 0x680000u ? 1 : 0);
  return k < -126 ? kMinScale : f32_of_bits(static_cast<uint32_t>(k + 127) << 23);
}

// 1 / s of an fp8 scale (a power of two from 2^-126 to 2^120): exact, so
// x x fp8_inverse(s) is x / s rounded once.
inline float fp8_inverse(float scale) { return 1.0f / scale; }

// The e4m3 code of x under a scale whose inverse is `inverse`
// (fp8_inverse): f32_to_e4m3(x x inverse), the product rounded to nearest
// even (x / scale exactly, the scale being a power of two) and the code by
// f32_to_e4m3 (nearest even, saturating). x must not be NaN.
inline uint8_t e4m3_code(float x, float inverse) { return f32_to_e4m3(x * inverse); }

// Round to nearest even, clamped to [-max, max] (max 127 or 7).
inline int32_t f32_to_int(float v, float max) {
  const float c = std::fmin(std::fmax(v, -max), max);
  return static_cast<int32_t>(std::nearbyint(c));
}

}  // namespace quant
}  // namespace lwo
