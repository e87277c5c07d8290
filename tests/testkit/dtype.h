// testkit: host conversions between f32 and the 16-bit float formats. The
// widening direction is the library's own (src/common/dtype.h); the rounding
// direction (f32 -> bf16 / f16, round to nearest even) is written here once.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../../src/common/dtype.h"
#include "lwo.h"

namespace testkit {

using lwo::bf16_to_f32;
using lwo::f16_to_f32;

// Round to nearest even; NaN stays a (quiet) NaN, overflow gives infinity.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Round to nearest even, subnormals included; NaN stays a (quiet) NaN, 65520
// and up give infinity.
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up: infinity
  if (ax < 0x38800000u)                          // below 2^-14: subnormal or zero
    return sign | static_cast<uint16_t>(std::lrint(std::fabs(f) * 16777216.0f));
  ax += 0xc8000fffu + ((ax >> 13) & 1u);  // rebias the exponent by -112 and round
  return sign | static_cast<uint16_t>(ax >> 13);
}

// Element i of a buffer of dtype (bf16, f16 or f32; anything else reads as f32) as a float.
inline float load_f32(const void* data, lwo_dtype_t dtype, uint64_t i) {
  const auto* p = static_cast<const uint8_t*>(data);
  if (dtype != LWO_DTYPE_BF16 && dtype != LWO_DTYPE_F16) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return dtype == LWO_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// Rounds v to dtype (bf16, f16 or f32), stores it as element i and returns the
// rounded value.
inline float store_f32(void* data, lwo_dtype_t dtype, uint64_t i, float v) {
  auto* p = static_cast<uint8_t*>(data);
  if (dtype != LWO_DTYPE_BF16 && dtype != LWO_DTYPE_F16) {
    std::memcpy(p + 4 * i, &v, 4);
    return v;
  }
  const uint16_t h = dtype == LWO_DTYPE_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
  std::memcpy(p + 2 * i, &h, 2);
  return dtype == LWO_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

}  // namespace testkit
