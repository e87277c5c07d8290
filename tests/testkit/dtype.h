// testkit: host conversions between f32 and the 16-bit float formats, both
// directions the library's own (src/common/dtype.h), and element access by dtype.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../../src/common/dtype.h"
#include "lwo.h"

namespace testkit {

using lwo::bf16_to_f32;
using lwo::f16_to_f32;

using lwo::f32_to_bf16;
using lwo::f32_to_f16;

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
