// The library's CUDA kernels behind layer compute (kernels/compute_kernels.cu):
// a plain GEMM for shapes cuBLASLt has no algorithm for, bias gradients,
// per-channel bias, and dtype conversion. Each launcher takes the stream
// last and checks its launch (throws lwo::Error).
#pragma once

#include <cstdint>

#include "lwo.h"

namespace lwo {

namespace detail {
void gemm_fallback(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                   const void* b, int64_t ldb, void* d, int64_t ldd, const void* bias,
                   lwo_dtype_t ab, lwo_dtype_t dt, bool accumulate, void* stream);
// db[o] (+)= sum_t dy[t, o]; dy row-major [tokens, out] of dtype dt_in, db of
// dt_out. accumulate: added to db, the sum formed in f32 and rounded once.
void bias_grad(const void* dy, int64_t tokens, int64_t out, lwo_dtype_t dt_in, void* db,
               lwo_dtype_t dt_out, bool accumulate, void* stream);
// y[(o*C + c)*inner + s] += b[c] (NCHW: outer = n, inner = h*w; NHWC: outer = n*h*w, inner = 1).
void channel_bias_add(void* y, const void* b, int64_t outer, int64_t C, int64_t inner,
                      lwo_dtype_t dt, void* stream);
// db[c] (+)= sum over o, s of dy[(o*C + c)*inner + s], accumulated in f32.
void channel_sum(const void* dy, int64_t outer, int64_t C, int64_t inner, lwo_dtype_t dt_in,
                 void* db, lwo_dtype_t dt_out, bool accumulate, void* stream);
// dst[i] (+)= src[i], in f32 and rounded once to dt_out.
void convert(const void* src, lwo_dtype_t dt_in, void* dst, lwo_dtype_t dt_out, int64_t n,
             bool accumulate, void* stream);
}  // namespace detail

}  // namespace lwo
