// What the unit and GPU tests of convolutions share (unit/fp8_train_test.cc,
// unit/quant_record_test.cc, unit/linear_test.cc, gpu/compute_test.cc): the
// descriptor of a 3 x 3 convolution that keeps the input's size.
#pragma once

#include <cstdint>

#include "lwo.h"

namespace lwo_conv_test {

// A bf16 NHWC 3 x 3 convolution of `c` input and `k` output channels, padding
// 1, stride and dilation 1, with `flags` (LWO_CONV_BIAS or 0).
inline lwo_conv2d_desc conv3x3_desc(int32_t c, int32_t k, uint32_t flags) {
  lwo_conv2d_desc d = LWO_CONV2D_DESC_INIT;
  d.dtype = LWO_DTYPE_BF16;
  d.flags = flags;
  d.in_channels = c;
  d.out_channels = k;
  d.kernel_h = d.kernel_w = 3;
  d.pad_h = d.pad_w = 1;
  return d;
}

}  // namespace lwo_conv_test
