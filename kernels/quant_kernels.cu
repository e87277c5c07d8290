// Dequantization on the GPU: the same codec functions as the CPU reference
// (src/quant/codec.h: code decoding, the scale index, code x scale, the
// rounding to bf16 / f16), so both give the same bits.
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

// Eight elements per step (cols % 8 == 0, src and dst 16-byte aligned): the
// eight share a row and a scale (8 divides 128 and cols).
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
    if (O == kF32) {
      float4* d = reinterpret_cast<float4*>(dst) + 2 * static_cast<uint64_t>(v);
      d[0] = make_float4(y[0], y[1], y[2], y[3]);
      d[1] = make_float4(y[4], y[5], y[6], y[7]);
    } else {
      uint32_t h[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t lo = O == kBf16 ? quant::f32_to_bf16(y[2 * k]) : quant::f32_to_f16(y[2 * k]);
        const uint32_t hi =
            O == kBf16 ? quant::f32_to_bf16(y[2 * k + 1]) : quant::f32_to_f16(y[2 * k + 1]);
        h[k] = lo | (hi << 16);
      }
      reinterpret_cast<uint4*>(dst)[v] = make_uint4(h[0], h[1], h[2], h[3]);
    }
  }
}

unsigned grid_for(uint64_t work) {
  const uint64_t blocks = (work + 255) / 256;
  return static_cast<unsigned>(std::min<uint64_t>(std::max<uint64_t>(blocks, 1), 65536));
}

template <lwo_quant_format_t F, int O>
void launch(const Shape& s, const uint8_t* src, void* dst, bool vec, cudaStream_t stream) {
  const uint64_t n = s.rows * s.cols;
  // 32-bit indices while every index (and index + stride) stays below 2^32.
  const bool narrow = n + uint64_t(65536) * 256 < (uint64_t(1) << 32);
  if (vec) {
    if (narrow)
      dequant_vec8<F, O, uint32_t><<<grid_for(n / 8), 256, 0, stream>>>(src, dst, s);
    else
      dequant_vec8<F, O, uint64_t><<<grid_for(n / 8), 256, 0, stream>>>(src, dst, s);
  } else {
    if (narrow)
      dequant_scalar<F, O, uint32_t><<<grid_for(n), 256, 0, stream>>>(src, dst, s);
    else
      dequant_scalar<F, O, uint64_t><<<grid_for(n), 256, 0, stream>>>(src, dst, s);
  }
}

template <lwo_quant_format_t F>
void launch_out(const Shape& s, const uint8_t* src, void* dst, lwo_dtype_t dtype, bool vec,
                cudaStream_t stream) {
  switch (dtype) {
    case LWO_DTYPE_F32: launch<F, kF32>(s, src, dst, vec, stream); return;
    case LWO_DTYPE_BF16: launch<F, kBf16>(s, src, dst, vec, stream); return;
    case LWO_DTYPE_F16: launch<F, kF16>(s, src, dst, vec, stream); return;
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
  const bool vec = l.cols % 8 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const auto* b = static_cast<const uint8_t*>(src);
  auto st = static_cast<cudaStream_t>(stream);
  switch (l.format) {
    case LWO_QUANT_FP8_E4M3_CHANNEL:
      launch_out<LWO_QUANT_FP8_E4M3_CHANNEL>(s, b, dst, dtype, vec, st);
      break;
    case LWO_QUANT_FP8_E4M3_BLOCK128:
      launch_out<LWO_QUANT_FP8_E4M3_BLOCK128>(s, b, dst, dtype, vec, st);
      break;
    case LWO_QUANT_INT8_CHANNEL: launch_out<LWO_QUANT_INT8_CHANNEL>(s, b, dst, dtype, vec, st); break;
    case LWO_QUANT_INT4_GROUP128: launch_out<LWO_QUANT_INT4_GROUP128>(s, b, dst, dtype, vec, st); break;
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
