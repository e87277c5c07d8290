// Kernels behind Compute: a plain GEMM used only where cuBLASLt offers no
// algorithm for a shape, and the bias gradient (a column sum).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "src/common/error.h"
#include "kernels/compute_kernels.h"

namespace lwo {
namespace detail {
namespace {

__device__ inline float to_f(float x) { return x; }
__device__ inline float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float to_f(__half x) { return __half2float(x); }
template <class T>
__device__ inline T from_f(float x);
template <>
__device__ inline float from_f<float>(float x) { return x; }
template <>
__device__ inline __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ inline __half from_f<__half>(float x) { return __float2half(x); }

template <class Tin, class Tout>
__global__ void gemm_kernel(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const Tin* a,
                            int64_t lda, const Tin* b, int64_t ldb, Tout* d, int64_t ldd,
                            const Tin* bias, bool accumulate) {
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= m) return;
  for (int64_t j = blockIdx.y * int64_t(blockDim.y) + threadIdx.y; j < n;
       j += int64_t(gridDim.y) * blockDim.y) {
  float acc = 0.f;
  for (int64_t l = 0; l < k; ++l) {
    float av = to_f(ta ? a[l + i * lda] : a[i + l * lda]);
    float bv = to_f(tb ? b[j + l * ldb] : b[l + j * ldb]);
    acc = fmaf(av, bv, acc);
  }
  if (bias) acc += to_f(bias[i]);
  if (accumulate) acc += to_f(d[i + j * ldd]);
  d[i + j * ldd] = from_f<Tout>(acc);
  }
}

template <class Tin, class Tout>
__global__ void bias_grad_kernel(const Tin* dy, int64_t tokens, int64_t out, Tout* db,
                                 bool accumulate) {
  int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (o >= out) return;
  float acc = 0.f;
  for (int64_t t = 0; t < tokens; ++t) acc += to_f(dy[t * out + o]);
  if (accumulate) acc += to_f(db[o]);
  db[o] = from_f<Tout>(acc);
}

// y[(o*C + c)*inner + s] += b[c]
template <class T>
__global__ void channel_bias_add_kernel(T* y, const T* b, int64_t outer, int64_t C, int64_t inner) {
  int64_t total = outer * C * inner;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t c = (i / inner) % C;
    y[i] = from_f<T>(to_f(y[i]) + to_f(b[c]));
  }
}

// db[c] = sum over o, s of dy[(o*C + c)*inner + s]; one block per channel.
template <class Tin, class Tout>
__global__ void channel_sum_kernel(const Tin* dy, int64_t outer, int64_t C, int64_t inner, Tout* db,
                                   bool accumulate) {
  int64_t c = blockIdx.x;
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < outer * inner; i += blockDim.x) {
    int64_t o = i / inner, s = i % inner;
    acc += to_f(dy[(o * C + c) * inner + s]);
  }
  __shared__ float part[32];
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (threadIdx.x == 0) db[c] = from_f<Tout>(accumulate ? acc + to_f(db[c]) : acc);
  }
}

template <class Tin, class Tout>
__global__ void convert_kernel(const Tin* src, Tout* dst, int64_t n, bool accumulate) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f<Tout>(accumulate ? to_f(src[i]) + to_f(dst[i]) : to_f(src[i]));
}

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 16)));
}

template <class F>
void dispatch2(lwo_dtype_t ab, lwo_dtype_t dt, F&& f) {
  auto inner = [&](auto tin) {
    using Tin = decltype(tin);
    switch (dt) {
      case LWO_DTYPE_F32: f(Tin{}, float{}); return;
      case LWO_DTYPE_BF16: f(Tin{}, __nv_bfloat16{}); return;
      case LWO_DTYPE_F16: f(Tin{}, __half{}); return;
      default: fail(LWO_ERR_UNSUPPORTED, "compute: output dtype %d", static_cast<int>(dt));
    }
  };
  switch (ab) {
    case LWO_DTYPE_F32: inner(float{}); return;
    case LWO_DTYPE_BF16: inner(__nv_bfloat16{}); return;
    case LWO_DTYPE_F16: inner(__half{}); return;
    default: fail(LWO_ERR_UNSUPPORTED, "compute: input dtype %d", static_cast<int>(ab));
  }
}

void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail(LWO_ERR_CUDA, "%s: kernel launch failed: %s", what, cudaGetErrorString(e));
}

}  // namespace

void gemm_fallback(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                   const void* b, int64_t ldb, void* d, int64_t ldd, const void* bias,
                   lwo_dtype_t ab, lwo_dtype_t dt, bool accumulate, void* stream) {
  dispatch2(ab, dt, [&](auto tin, auto tout) {
    using Tin = decltype(tin);
    using Tout = decltype(tout);
    dim3 block(16, 16);
    dim3 grid(static_cast<unsigned>((m + 15) / 16),
              static_cast<unsigned>(std::min<int64_t>((n + 15) / 16, 65535)));
    gemm_kernel<Tin, Tout><<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(
        ta, tb, m, n, k, static_cast<const Tin*>(a), lda, static_cast<const Tin*>(b), ldb,
        static_cast<Tout*>(d), ldd, static_cast<const Tin*>(bias), accumulate);
  });
  check_launch("gemm fallback");
}

void bias_grad(const void* dy, int64_t tokens, int64_t out, lwo_dtype_t dt_in, void* db,
               lwo_dtype_t dt_out, bool accumulate, void* stream) {
  dispatch2(dt_in, dt_out, [&](auto tin, auto tout) {
    using Tin = decltype(tin);
    using Tout = decltype(tout);
    unsigned blocks = static_cast<unsigned>((out + 255) / 256);
    bias_grad_kernel<Tin, Tout><<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const Tin*>(dy), tokens, out, static_cast<Tout*>(db), accumulate);
  });
  check_launch("bias gradient");
}

void channel_bias_add(void* y, const void* b, int64_t outer, int64_t C, int64_t inner,
                      lwo_dtype_t dt, void* stream) {
  dispatch2(dt, dt, [&](auto tin, auto) {
    using T = decltype(tin);
    channel_bias_add_kernel<T><<<grid_for(outer * C * inner), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(y), static_cast<const T*>(b), outer, C, inner);
  });
  check_launch("channel bias add");
}

void channel_sum(const void* dy, int64_t outer, int64_t C, int64_t inner, lwo_dtype_t dt_in,
                 void* db, lwo_dtype_t dt_out, bool accumulate, void* stream) {
  if (inner == 1) {  // contiguous channels: one thread per channel reads coalesced
    bias_grad(dy, outer, C, dt_in, db, dt_out, accumulate, stream);
    return;
  }
  dispatch2(dt_in, dt_out, [&](auto tin, auto tout) {
    using Tin = decltype(tin);
    using Tout = decltype(tout);
    channel_sum_kernel<Tin, Tout><<<static_cast<unsigned>(C), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const Tin*>(dy), outer, C, inner, static_cast<Tout*>(db), accumulate);
  });
  check_launch("channel sum");
}

void convert(const void* src, lwo_dtype_t dt_in, void* dst, lwo_dtype_t dt_out, int64_t n,
             bool accumulate, void* stream) {
  dispatch2(dt_in, dt_out, [&](auto tin, auto tout) {
    using Tin = decltype(tin);
    using Tout = decltype(tout);
    convert_kernel<Tin, Tout><<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const Tin*>(src), static_cast<Tout*>(dst), n, accumulate);
  });
  check_launch("convert");
}

}  // namespace detail
}  // namespace lwo
