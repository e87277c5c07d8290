// What the host optimizer's unit tests share (optim_math_test.cc,
// optim_fp8_test.cc): one tensor's buffers and the optim::Tensor over them.
#pragma once

#include <cstdint>
#include <vector>

#include "src/common/dtype.h"
#include "src/optim/optim.h"

namespace lwo {
namespace optim {

// A tensor's buffers: f32 masters, moments for state of either dtype, bf16
// weights.
struct Buf {
  std::vector<float> master;
  std::vector<uint8_t> m, v;
  std::vector<uint16_t> weights;
  Tensor tensor(lwo_dtype_t sd) {
    Tensor t;
    t.n = master.size();
    t.master = master.data();
    t.m = m.data();
    t.v = v.data();
    t.state_dtype = sd;
    t.weights = weights.data();
    t.weight_dtype = LWO_DTYPE_BF16;
    return t;
  }
  Buf(uint64_t n, lwo_dtype_t sd)
      : master(n), m(n * dtype_size(sd)), v(n * dtype_size(sd)), weights(n) {}
};

}  // namespace optim
}  // namespace lwo
