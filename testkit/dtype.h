// testkit: host conversions between f32 and the 16-bit float formats and
// element access by dtype, all the library's own (src/common/dtype.h); only
// store_f32's returned rounded value is testkit's.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "src/common/dtype.h"
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

// The host memory traffic of one parameter's update (bench_optim and lwo
// train count it so; write-allocate included): the f32 master read and
// written (8 bytes), each state buffer read and written (AdamW two, SGD
// one), the gradient read, the pool's weight written: with streaming stores
// (nothing read for ownership) unless the optimizer's loops are the
// baseline ones (lwo_optim_info.vector_level), else read first as well.
inline double update_bytes_per_param(bool adamw, lwo_dtype_t state, lwo_dtype_t grad,
                                     lwo_dtype_t weight, const char* vector_level) {
  const bool streaming = std::strcmp(vector_level, "baseline") != 0;
  const double w = static_cast<double>(lwo_dtype_size(weight)) * (streaming ? 1 : 2);
  return 8.0 + (adamw ? 2 : 1) * 2.0 * static_cast<double>(lwo_dtype_size(state)) +
         static_cast<double>(lwo_dtype_size(grad)) + w;
}

}  // namespace testkit
