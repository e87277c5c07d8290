// Optimizer steps on host memory (issue 17, first part): a fused AdamW and
// SGD with momentum over one tensor's parameters, f32 master weights and
// state, gradients read in their wire dtype, the updated weights written back
// rounded to the pool's dtype. Host only, multithreaded through parallel_for,
// the loops vectorized (GCC clones them for AVX-512 and AVX2). Nothing in the
// library calls it yet (the overlap with the backward pass comes next).
#pragma once

#include <cstdint>

#include "lwo.h"

namespace lwo {
namespace optim {

// As PyTorch's AdamW: p *= 1 - lr wd; m = b1 m + (1 - b1) g; v = b2 v + (1 -
// b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
struct AdamW {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

// p *= 1 - lr wd; b = momentum b + (1 - dampening) g (b = g on step 1);
// p -= lr b.
struct Sgd {
  double lr = 1e-2, momentum = 0.9, dampening = 0, weight_decay = 0;
};

// One tensor's parameters and state; `weights` (may be null) receives each
// updated master weight rounded to `weight_dtype` (f32, bf16 or f16, round to
// nearest even); `grad` holds n elements of `grad_dtype` (f32, bf16, f16).
struct Tensor {
  uint64_t n = 0;
  float* master = nullptr;
  float* m = nullptr;  // AdamW: first moment; SGD: the momentum buffer
  float* v = nullptr;  // AdamW: second moment
  const void* grad = nullptr;
  lwo_dtype_t grad_dtype = LWO_DTYPE_F32;
  void* weights = nullptr;
  lwo_dtype_t weight_dtype = LWO_DTYPE_BF16;
};

// Step `step` (1 for the first) over the tensor, on up to n_threads threads
// (0: one per core). LWO_ERR_INVALID_ARGUMENT for a step of 0, a dtype
// outside those above or a missing buffer.
void adamw_step(const Tensor& t, const AdamW& h, uint64_t step, uint32_t n_threads);
void sgd_step(const Tensor& t, const Sgd& h, uint64_t step, uint32_t n_threads);

}  // namespace optim
}  // namespace lwo
