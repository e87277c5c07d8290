/* What the examples share: checks that end the program with a message
 * naming the call and what lwo (or CUDA) reported, the host's bf16
 * conversions, a tensor description, a small random generator and a square
 * root without libm.
 *
 * An example defines, before including this file, EXAMPLE_PREFIX: the start
 * of its messages, a format string ("train_step"); and when that format
 * takes arguments, EXAMPLE_PREFIX_ARGS: them, each followed by a comma.
 * CUDA_CHECK needs <cuda_runtime_api.h>, included first. */
#ifndef LWO_EXAMPLES_COMMON_H
#define LWO_EXAMPLES_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lwo.h>

#ifndef EXAMPLE_PREFIX
#error "define EXAMPLE_PREFIX (the start of the example's messages) before common.h"
#endif
#ifndef EXAMPLE_PREFIX_ARGS
#define EXAMPLE_PREFIX_ARGS
#endif

#define LWO_CHECK(call)                                                   \
  do {                                                                    \
    lwo_status_t s_ = (call);                                             \
    if (s_ != LWO_OK) {                                                   \
      fprintf(stderr, EXAMPLE_PREFIX ": %s: %s: %s\n", EXAMPLE_PREFIX_ARGS \
              #call, lwo_status_string(s_), lwo_last_error_message());    \
      exit(1);                                                            \
    }                                                                     \
  } while (0)

#define CUDA_CHECK(call)                                                  \
  do {                                                                    \
    cudaError_t e_ = (call);                                              \
    if (e_ != cudaSuccess) {                                              \
      fprintf(stderr, EXAMPLE_PREFIX ": %s: %s\n", EXAMPLE_PREFIX_ARGS     \
              #call, cudaGetErrorString(e_));                             \
      exit(1);                                                            \
    }                                                                     \
  } while (0)

#define EXPECT(cond)                                                      \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, EXAMPLE_PREFIX ": check failed: %s\n",              \
              EXAMPLE_PREFIX_ARGS #cond);                                 \
      exit(1);                                                            \
    }                                                                     \
  } while (0)

/* The description of a tensor `name` of `dtype` and shape [rows] (cols 0) or
 * [rows, cols]: no host data, no extensions. */
static inline lwo_tensor_desc tensor_desc(const char* name, lwo_dtype_t dtype, int64_t rows,
                                          int64_t cols) {
  lwo_tensor_desc t;
  memset(&t, 0, sizeof t);
  t.name = name;
  t.dtype = dtype;
  t.n_dims = cols ? 2 : 1;
  t.shape[0] = rows;
  t.shape[1] = cols;
  return t;
}

/* bf16 <-> f32 on the host (round to nearest even; finite values only). */
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* A value uniform in [-bound, bound), the generator's state advanced. */
static inline float uniform(uint64_t* state, float bound) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return ((float)(*state >> 40) / 16777216.0f * 2.0f - 1.0f) * bound;
}

/* The square root of v >= 0 (Newton's method; no libm needed). */
static inline double root(double v) {
  double r = v > 1.0 ? v : 1.0;
  int i;
  if (v <= 0.0) return 0.0;
  for (i = 0; i < 200 && r * r - v > 1e-15 * v; ++i) r = 0.5 * (r + v / r);
  return r;
}

#endif /* LWO_EXAMPLES_COMMON_H */
