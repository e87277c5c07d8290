// Dequantization of a quantized weight (src/quant/quant.h) on the GPU, for
// the C ABI's lwo_dequantize and, later, the quantized GEMMs: the compute
// role is the one that reaches kernels/.
#pragma once

#include "lwo.h"

namespace lwo {
namespace quant {
struct Layout;
}

// Enqueues on `stream` dst = the dequantized tensor at src (device memory,
// laid out as `layout` says), rounded to `dtype` (f32, bf16, f16); dst must
// be aligned to its element's size. Throws lwo::Error (LWO_ERR_CUDA for a
// failed launch). The caller has made the device current.
void dequantize_on_device(const quant::Layout& layout, const void* src, void* dst,
                          lwo_dtype_t dtype, lwo_stream_t stream);

}  // namespace lwo
