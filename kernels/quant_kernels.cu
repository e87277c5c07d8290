// Dequantization on the GPU: the same codec functions as the CPU reference
// (src/quant/codec.h: code decoding, the scale index, code x scale, the
// rounding to bf16 / f16), so both give the same bits. The one exception,
// e4m3 decoded in hardware on the wide path, is exact (see decode16).
//
// Three paths, picked per call by shape and alignment: dequant_wide (16
// bytes of codes per thread step, at memory speed), dequant_vec8 (8
// elements per step) and dequant_scalar (any shape, any alignment); the GPU
// tests (tests/gpu/quant_test.cc) take each against lwo_dequantize_host.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "kernels/quant_kernels.h"
#include "src/common/error.h"
#include "src/quant/codec.h"
#include "src/quant/quant.h"

namespace lwo {
namespace detail {
namespace {

// What a kernel needs of a Layout (passed by value).
struct Shape {
  uint64_t rows, cols, scale_cols, scale_offset;
};

enum Out { kF32 = 0, kBf16 = 1, kF16 = 2 };

template <lwo_quant_format_t F>
__device__ inline float code_at(const uint8_t* data, uint64_t i) {
  if (F == LWO_QUANT_INT8_CHANNEL) return quant::i8_to_f32(data[i]);
  if (F == LWO_QUANT_INT4_GROUP128)
    return quant::i4_to_f32(static_cast<uint32_t>(data[i >> 1]) >> (4 * (i & 1)));
  return quant::e4m3_to_f32(data[i]);
}

template <int O>
__device__ inline void store(void* dst, uint64_t i, float v) {
  if (O == kF32) {
    static_cast<float*>(dst)[i] = v;
  } else {
    static_cast<uint16_t*>(dst)[i] = O == kBf16 ? quant::f32_to_bf16(v) : quant::f32_to_f16(v);
  }
}

// The scale of element (r, c); src need not be 4-byte aligned unless Aligned.
template <lwo_quant_format_t F, bool Aligned, class I>
__device__ inline float scale_at(const uint8_t* src, const Shape& s, I r, I c) {
  const uint8_t* p =
      src + s.scale_offset +
      4 * static_cast<uint64_t>(quant::scale_index<I>(F, r, c, static_cast<I>(s.scale_cols)));
  if (Aligned) return *reinterpret_cast<const float*>(p);
  float f;
  memcpy(&f, p, 4);
  return f;
}

// One element per step (dst aligned to its element, src to nothing). I: the
// index type, 32-bit where the element count fits (cheaper divisions).
template <lwo_quant_format_t F, int O, class I>
__global__ void dequant_scalar(const uint8_t* src, void* dst, Shape s) {
  const I n = static_cast<I>(s.rows * s.cols), cols = static_cast<I>(s.cols);
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const I r = i / cols, c = i % cols;
    store<O>(dst, i, quant::dequant(code_at<F>(src, i), scale_at<F, false, I>(src, s, r, c)));
  }
}

// Stores y[0..N) (N a multiple of 8) as vector v of N elements of dst
// (16-byte aligned): 16-byte stores of f32, or of bf16 / f16 pairs.
template <int O, int N>
__device__ inline void store_vec(void* dst, uint64_t v, const float* y) {
  if (O == kF32) {
    float4* d = reinterpret_cast<float4*>(dst) + (N / 4) * v;
#pragma unroll
    for (int k = 0; k < N / 4; ++k)
      d[k] = make_float4(y[4 * k], y[4 * k + 1], y[4 * k + 2], y[4 * k + 3]);
  } else {
    uint4* d = reinterpret_cast<uint4*>(dst) + (N / 8) * v;
#pragma unroll
    for (int k = 0; k < N / 8; ++k) {
      uint32_t h[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float a = y[8 * k + 2 * j], b = y[8 * k + 2 * j + 1];
        const uint32_t lo = O == kBf16 ? quant::f32_to_bf16(a) : quant::f32_to_f16(a);
        const uint32_t hi = O == kBf16 ? quant::f32_to_bf16(b) : quant::f32_to_f16(b);
        h[j] = lo | (hi << 16);
      }
      d[k] = make_uint4(h[0], h[1], h[2], h[3]);
    }
  }
}

// Eight elements per step (cols % 8 == 0, dst 16-byte aligned, src aligned
// to its load: 8 bytes of fp8 / int8 codes, 4 bytes of int4 codes): the
// eight share a row and a scale (8 divides 128 and cols). The path of the
// shapes and alignments dequant_wide cannot take.
template <lwo_quant_format_t F, int O, class I>
__global__ void dequant_vec8(const uint8_t* src, void* dst, Shape s) {
  const I n8 = static_cast<I>(s.rows * s.cols / 8), cols8 = static_cast<I>(s.cols / 8);
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I v = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; v < n8; v += stride) {
    const I r = v / cols8, c = (v % cols8) * 8;
    const float sc = scale_at<F, true, I>(src, s, r, c);
    float q[8];
    if (F == LWO_QUANT_INT4_GROUP128) {
      const uint32_t w = reinterpret_cast<const uint32_t*>(src)[v];  // 8 nibbles
#pragma unroll
      for (int k = 0; k < 8; ++k) q[k] = quant::i4_to_f32(w >> (4 * k));
    } else {
      const uint2 w = reinterpret_cast<const uint2*>(src)[v];  // 8 bytes
      uint8_t b[8];
      memcpy(b, &w, 8);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        q[k] = F == LWO_QUANT_INT8_CHANNEL ? quant::i8_to_f32(b[k]) : quant::e4m3_to_f32(b[k]);
    }
    float y[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) y[k] = quant::dequant(q[k], sc);
    store_vec<O, 8>(dst, static_cast<uint64_t>(v), y);
  }
}

// The codes of one 16-byte vector as floats: 16 fp8 / int8 codes, or 32 int4
// codes (nibble k of the vector is element k). e4m3 decodes in hardware on
// sm_89 and later (cvt.rn.f16x2.e4m3x2, then f16 -> f32: both exact for
// every e4m3 value; a NaN code gives some NaN, which quant::dequant turns
// into the one quiet NaN, so the result's bits equal the CPU reference's);
// elsewhere with codec.h's e4m3_to_f32.
template <lwo_quant_format_t F>
__device__ inline void decode16(const uint4& w, float* q) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
  if (F == LWO_QUANT_INT4_GROUP128) {
#pragma unroll
    for (int k = 0; k < 32; ++k) q[k] = quant::i4_to_f32(u[k / 8] >> (4 * (k % 8)));
  } else if (F == LWO_QUANT_INT8_CHANNEL) {
#pragma unroll
    for (int k = 0; k < 16; ++k)
      q[k] = quant::i8_to_f32(static_cast<uint8_t>(u[k / 4] >> (8 * (k % 4))));
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(u[k / 2] >> (16 * (k % 2))), __NV_E4M3);
      q[2 * k] = __half2float(__half(__half_raw{h.x}));
      q[2 * k + 1] = __half2float(__half(__half_raw{h.y}));
    }
#else
#pragma unroll
    for (int k = 0; k < 16; ++k)
      q[k] = quant::e4m3_to_f32(static_cast<uint8_t>(u[k / 4] >> (8 * (k % 4))));
#endif
  }
}

// Elements per wide vector: 16 bytes of codes.
template <lwo_quant_format_t F>
__host__ __device__ constexpr int wide_width() {
  return F == LWO_QUANT_INT4_GROUP128 ? 32 : 16;
}

// The memory-speed path (cols % wide_width == 0, src and dst 16-byte
// aligned): each step of a thread takes U vectors of 16 bytes of codes (16
// fp8 / int8 or 32 int4 elements: they share a row and a scale, as 16 and 32
// divide 128 and cols), loads the U code vectors and their U scales first
// (U loads in flight per thread), then decodes and stores each with 16-byte
// stores. Grid-stride over vectors v = v0 + u * stride.
template <lwo_quant_format_t F, int O, class I, int U>
__global__ void __launch_bounds__(256) dequant_wide(const uint8_t* src, void* dst, Shape s) {
  constexpr int N = wide_width<F>();
  const I nv = static_cast<I>(s.rows * s.cols / N), vpr = static_cast<I>(s.cols / N);
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  const uint4* codes = reinterpret_cast<const uint4*>(src);
  for (I v0 = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; v0 < nv; v0 += U * stride) {
    uint4 w[U];
    float sc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const I v = v0 + static_cast<I>(u) * stride;
      if (v < nv) {
        w[u] = __ldg(codes + v);
        const I r = v / vpr, c = (v - r * vpr) * N;
        sc[u] = scale_at<F, true, I>(src, s, r, c);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const I v = v0 + static_cast<I>(u) * stride;
      if (v < nv) {
        float y[N];
        decode16<F>(w[u], y);
#pragma unroll
        for (int k = 0; k < N; ++k) y[k] = quant::dequant(y[k], sc[u]);
        store_vec<O, N>(dst, static_cast<uint64_t>(v), y);
      }
    }
  }
}

unsigned grid_for(uint64_t work) {
  const uint64_t blocks = (work + 255) / 256;
  return static_cast<unsigned>(std::min<uint64_t>(std::max<uint64_t>(blocks, 1), 65536));
}

// Vectors of the wide path at and above which a thread takes 4 per step
// (4 loads in flight; a quarter of the blocks): the 8192 x 8192 weights.
// Below it, one per step and more blocks, so that a small tensor (2048 x
// 2048) still spreads over every SM.
constexpr uint64_t kWideUnroll4 = uint64_t(1) << 20;

template <lwo_quant_format_t F, int O>
void launch(const Shape& s, const uint8_t* src, void* dst, cudaStream_t stream) {
  const uint64_t n = s.rows * s.cols;
  // 32-bit indices while every index (and index + 4 strides) stays below 2^32.
  const bool narrow = n + uint64_t(65536) * 256 * 4 < (uint64_t(1) << 32);
  const auto sa = reinterpret_cast<uintptr_t>(src), da = reinterpret_cast<uintptr_t>(dst);
  constexpr int N = wide_width<F>();
  if (s.cols % N == 0 && sa % 16 == 0 && da % 16 == 0) {
    const uint64_t nv = n / N;
    if (nv >= kWideUnroll4) {
      const unsigned g = grid_for((nv + 3) / 4);
      if (narrow)
        dequant_wide<F, O, uint32_t, 4><<<g, 256, 0, stream>>>(src, dst, s);
      else
        dequant_wide<F, O, uint64_t, 4><<<g, 256, 0, stream>>>(src, dst, s);
    } else {
      // nv < 2^20: 32-bit indices always.
      dequant_wide<F, O, uint32_t, 1><<<grid_for(nv), 256, 0, stream>>>(src, dst, s);
    }
    return;
  }
  const uintptr_t load = F == LWO_QUANT_INT4_GROUP128 ? 4 : 8;  // vec8's code load
  if (s.cols % 8 == 0 && sa % load == 0 && da % 16 == 0) {
    if (narrow)
      dequant_vec8<F, O, uint32_t><<<grid_for(n / 8), 256, 0, stream>>>(src, dst, s);
    else
      dequant_vec8<F, O, uint64_t><<<grid_for(n / 8), 256, 0, stream>>>(src, dst, s);
    return;
  }
  if (narrow)
    dequant_scalar<F, O, uint32_t><<<grid_for(n), 256, 0, stream>>>(src, dst, s);
  else
    dequant_scalar<F, O, uint64_t><<<grid_for(n), 256, 0, stream>>>(src, dst, s);
}

template <lwo_quant_format_t F>
void launch_out(const Shape& s, const uint8_t* src, void* dst, lwo_dtype_t dtype,
                cudaStream_t stream) {
  switch (dtype) {
    case LWO_DTYPE_F32: launch<F, kF32>(s, src, dst, stream); return;
    case LWO_DTYPE_BF16: launch<F, kBf16>(s, src, dst, stream); return;
    case LWO_DTYPE_F16: launch<F, kF16>(s, src, dst, stream); return;
    default:
      fail(LWO_ERR_INTERNAL, "dequantize: output dtype %d is not f32, bf16 or f16",
           static_cast<int>(dtype));
  }
}

}  // namespace

void dequantize(const quant::Layout& l, const void* src, void* dst, lwo_dtype_t dtype,
                void* stream) {
  const Shape s{static_cast<uint64_t>(l.rows), static_cast<uint64_t>(l.cols),
                static_cast<uint64_t>(l.scale_cols), l.scale_offset};
  const auto* b = static_cast<const uint8_t*>(src);
  auto st = static_cast<cudaStream_t>(stream);
  switch (l.format) {
    case LWO_QUANT_FP8_E4M3_CHANNEL:
      launch_out<LWO_QUANT_FP8_E4M3_CHANNEL>(s, b, dst, dtype, st);
      break;
    case LWO_QUANT_FP8_E4M3_BLOCK128:
      launch_out<LWO_QUANT_FP8_E4M3_BLOCK128>(s, b, dst, dtype, st);
      break;
    case LWO_QUANT_INT8_CHANNEL: launch_out<LWO_QUANT_INT8_CHANNEL>(s, b, dst, dtype, st); break;
    case LWO_QUANT_INT4_GROUP128: launch_out<LWO_QUANT_INT4_GROUP128>(s, b, dst, dtype, st); break;
    default:
      fail(LWO_ERR_INTERNAL, "dequantize: format %d", static_cast<int>(l.format));
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    fail(LWO_ERR_CUDA, "dequantize (%s, %lld x %lld): kernel launch failed: %s",
         quant::format_name(l.format), static_cast<long long>(l.rows),
         static_cast<long long>(l.cols), cudaGetErrorString(e));
}

}  // namespace detail
}  // namespace lwo
