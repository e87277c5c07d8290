// Layer compute on the CPU, for engines whose device memory is host memory
// (Backend::compute_on_host: the host backend of the tests). The same calls
// as Compute's, in f32: every product and sum in f32, each output rounded
// once to its dtype (an accumulated gradient: its old value plus the new sum,
// rounded once); a quantized weight is dequantized to the layer's dtype
// first, as the GPU's workspace holds it. Runs at once on the calling thread.
#pragma once

#include <cstdint>

#include "lwo.h"
#include "src/compute/compute.h"

namespace lwo {
namespace host_compute {

void linear_forward(const Compute::Linear& l, int64_t tokens, const void* x, const void* w,
                    const void* b, void* y);
void linear_backward(const Compute::Linear& l, int64_t tokens, const void* x, const void* dy,
                     const void* w, void* dx, void* dw, void* db, lwo_dtype_t grad_dtype);
void conv_forward(const Compute::Conv& cv, int32_t n, int32_t h, int32_t w, const void* x,
                  const void* wt, const void* b, void* y);
void conv_backward(const Compute::Conv& cv, int32_t n, int32_t h, int32_t w, const void* x,
                   const void* dy, const void* wt, void* dx, void* dwt, void* db,
                   lwo_dtype_t grad_dtype);

}  // namespace host_compute
}  // namespace lwo
