// testkit: host conversions between f32 and the 16-bit float formats and
// element access by dtype, all the library's own (src/common/dtype.h); only
// store_f32's returned rounded value is testkit's.
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

using lwo::load_f32;

// Rounds v to dtype (bf16, f16 or f32), stores it as element i and returns the
// rounded value.
inline float store_f32(void* data, lwo_dtype_t dtype, uint64_t i, float v) {
  lwo::store_f32(data, dtype, i, v);
  return lwo::load_f32(data, dtype, i);
}

}  // namespace testkit
