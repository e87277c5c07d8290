#include "optim.h"

#include <cmath>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/parallel.h"

namespace lwo {
namespace optim {
namespace {

// Every per-element constant of one AdamW step, in f32.
struct AdamConsts {
  float decay, b1, one_b1, b2, one_b2, step_size, inv_sqrt_bc2, eps;
};

// The loop for one (grad dtype, weight dtype) pair: templates so that each
// inner loop has fixed types and vectorizes.
template <lwo_dtype_t G, lwo_dtype_t W>
LWO_VECTOR_LOOP void adam_range(float* __restrict p, float* __restrict m, float* __restrict v,
                                const void* __restrict g, void* __restrict w, uint64_t b,
                                uint64_t e, const AdamConsts c) {
  for (uint64_t i = b; i < e; ++i) {
    const float gi = load_f32(g, G, i);
    float pi = p[i] * c.decay;
    const float mi = c.b1 * m[i] + c.one_b1 * gi;
    const float vi = c.b2 * v[i] + c.one_b2 * gi * gi;
    pi -= c.step_size * mi / (__builtin_sqrtf(vi) * c.inv_sqrt_bc2 + c.eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if (W != LWO_DTYPE_FORCE_32) store_f32(w, W, i, pi);
  }
}

template <lwo_dtype_t G>
void adam_dispatch_w(const Tensor& t, uint64_t b, uint64_t e, const AdamConsts& c) {
  if (!t.weights) return adam_range<G, LWO_DTYPE_FORCE_32>(t.master, t.m, t.v, t.grad, nullptr, b, e, c);
  switch (t.weight_dtype) {
    case LWO_DTYPE_BF16: return adam_range<G, LWO_DTYPE_BF16>(t.master, t.m, t.v, t.grad, t.weights, b, e, c);
    case LWO_DTYPE_F16: return adam_range<G, LWO_DTYPE_F16>(t.master, t.m, t.v, t.grad, t.weights, b, e, c);
    default: return adam_range<G, LWO_DTYPE_F32>(t.master, t.m, t.v, t.grad, t.weights, b, e, c);
  }
}

void check_tensor(const Tensor& t, uint64_t step, bool needs_v, const char* what) {
  if (step == 0) fail(LWO_ERR_INVALID_ARGUMENT, "%s: step 0 (the first step is 1)", what);
  auto known = [](lwo_dtype_t d) {
    return d == LWO_DTYPE_F32 || d == LWO_DTYPE_BF16 || d == LWO_DTYPE_F16;
  };
  if (!known(t.grad_dtype))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: gradients of dtype %s (f32, bf16 or f16)", what,
         dtype_name(t.grad_dtype));
  if (t.weights && !known(t.weight_dtype))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: weights of dtype %s (f32, bf16 or f16)", what,
         dtype_name(t.weight_dtype));
  if (t.n && (!t.master || !t.m || !t.grad || (needs_v && !t.v)))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: a NULL master, state or gradient buffer for %llu "
         "parameters", what, static_cast<unsigned long long>(t.n));
}

// Parts of at least 2^16 elements, eight chunks per thread taken in turn.
constexpr uint64_t kMinPart = uint64_t(1) << 16;

}  // namespace

void adamw_step(const Tensor& t, const AdamW& h, uint64_t step, uint32_t n_threads) {
  check_tensor(t, step, true, "adamw");
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  const AdamConsts c{static_cast<float>(1 - h.lr * h.weight_decay), static_cast<float>(h.beta1),
                     static_cast<float>(1 - h.beta1), static_cast<float>(h.beta2),
                     static_cast<float>(1 - h.beta2), static_cast<float>(h.lr / bc1),
                     static_cast<float>(1 / std::sqrt(bc2)), static_cast<float>(h.eps)};
  parallel_for(
      t.n, n_threads, kMinPart, 64,
      [&](uint64_t b, uint64_t e) {
        switch (t.grad_dtype) {
          case LWO_DTYPE_BF16: return adam_dispatch_w<LWO_DTYPE_BF16>(t, b, e, c);
          case LWO_DTYPE_F16: return adam_dispatch_w<LWO_DTYPE_F16>(t, b, e, c);
          default: return adam_dispatch_w<LWO_DTYPE_F32>(t, b, e, c);
        }
      },
      8);
}

void sgd_step(const Tensor& t, const Sgd& h, uint64_t step, uint32_t n_threads) {
  check_tensor(t, step, false, "sgd");
  const float decay = static_cast<float>(1 - h.lr * h.weight_decay);
  const float mom = static_cast<float>(h.momentum), damp = static_cast<float>(1 - h.dampening);
  const float lr = static_cast<float>(h.lr);
  const bool first = step == 1;
  parallel_for(
      t.n, n_threads, kMinPart, 64,
      [&](uint64_t b, uint64_t e) {
        for (uint64_t i = b; i < e; ++i) {
          const float gi = load_f32(t.grad, t.grad_dtype, i);
          const float bi = first ? gi : mom * t.m[i] + damp * gi;
          t.m[i] = bi;
          const float pi = t.master[i] * decay - lr * bi;
          t.master[i] = pi;
          if (t.weights) store_f32(t.weights, t.weight_dtype, i, pi);
        }
      },
      8);
}

}  // namespace optim
}  // namespace lwo
