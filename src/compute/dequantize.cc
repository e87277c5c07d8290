// See dequantize.h.
#include "src/compute/dequantize.h"

#include "kernels/quant_kernels.h"
#include "src/quant/quant.h"

namespace lwo {

void dequantize_on_device(const quant::Layout& layout, const void* src, void* dst,
                          lwo_dtype_t dtype, lwo_stream_t stream) {
  detail::dequantize(layout, src, dst, dtype, static_cast<void*>(stream));
}

}  // namespace lwo
