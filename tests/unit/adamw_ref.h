// What the unit and GPU tests of the optimizer share (unit/optim_object_test.cc,
// gpu/optim_test.cc): the f64 reference of one AdamW step.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "lwo.h"

namespace lwo_optim_test {

// One AdamW step `step` (from 1) of a tensor's reference state `t` (vectors
// p, m and v of its elements) on its gradient `g` scaled by `c`, with the
// hyperparameters of `p`.
template <class Ref>
void adamw_ref(Ref& t, const std::vector<double>& g, const lwo_optim_step_params& p, double c,
               uint64_t step) {
  const double bc1 = 1 - std::pow(p.beta1, double(step));
  const double bc2 = 1 - std::pow(p.beta2, double(step));
  for (size_t i = 0; i < t.p.size(); ++i) {
    const double gi = g[i] * c;
    t.p[i] *= 1 - p.lr * p.weight_decay;
    t.m[i] = p.beta1 * t.m[i] + (1 - p.beta1) * gi;
    t.v[i] = p.beta2 * t.v[i] + (1 - p.beta2) * gi * gi;
    t.p[i] -= p.lr / bc1 * t.m[i] / (std::sqrt(t.v[i]) / std::sqrt(bc2) + p.eps);
  }
}

}  // namespace lwo_optim_test
