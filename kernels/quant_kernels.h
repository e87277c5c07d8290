// The dequantization kernels of the quantized weight formats
// (src/quant/quant.h; the element codecs are src/quant/codec.h, shared with
// the CPU reference). The launcher takes the stream last and checks its
// launch (throws lwo::Error, LWO_ERR_CUDA).
#pragma once

#include <cstdint>

#include "lwo.h"

namespace lwo {
namespace quant {
struct Layout;
}

namespace detail {
// dst[r, c] = code(r, c) x scale(r, c), rounded to `dtype` (f32, bf16, f16),
// for the quantized tensor at `src` (device memory, laid out as `layout`
// says). Grid-stride, in one of three paths:
//  - wide, where src and dst are 16-byte aligned and cols is a multiple of
//    16 (fp8, int8) or 32 (int4): 16-byte loads of codes (16 or 32 elements,
//    one scale), 16-byte stores, 4 vectors per thread step on large tensors;
//  - 8 elements per step (one 8-byte or 4-byte load of codes, one scale)
//    where cols is a multiple of 8, dst is 16-byte aligned and src aligned
//    to that load;
//  - else one element per step.
void dequantize(const quant::Layout& layout, const void* src, void* dst, lwo_dtype_t dtype,
                void* stream);
}  // namespace detail

}  // namespace lwo
