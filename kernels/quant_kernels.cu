// Dequantization on the GPU: the same codec functions as the CPU reference
// (src/quant/codec.h: code decoding, the scale index, code x scale, the
// rounding to bf16 / f16), so both give the same bits; where the unit path
// decodes and rounds faster in its own way (integer decoding, the
// hardware's conversion), it does so only where the two are equal for
// every input (see dequant_units).
//
// Two paths, picked per call by shape and alignment: dequant_units (8
// elements per thread step, at memory speed) and dequant_scalar (any shape,
// any alignment); the GPU tests (tests/gpu/quant_test.cc) take each against
// lwo_dequantize_host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

// ---- the unit path: eight elements per thread step ----
//
// A unit is 8 consecutive elements of one row (cols % 8 == 0): 8 bytes of
// fp8 / int8 codes or 4 of int4, one scale (8 divides 128 and cols), 16
// bytes of bf16 / f16 out (32 of f32). Consecutive threads take consecutive
// units, so a warp's loads and 16-byte stores are contiguous.
//
// Each unit is decoded one of two ways, both giving the reference's bits:
// - fast, when its scale is finite and (fp8) none of its codes is a NaN code,
//   so no product can be NaN: integer decoding (below), one f32 multiply by
//   the scale, and the hardware's round-to-nearest-even conversion to bf16 /
//   f16 (cvt.rn.{bf16,f16}x2.f32), which equals codec.h's f32_to_bf16 /
//   f32_to_f16 on every value but NaN (overflow to infinity and subnormals
//   included);
// - reference, otherwise: codec.h's decoding, quant::dequant (the one quiet
//   NaN) and codec.h's rounding.
// Integer decoding, exact for every code:
// - e4m3: the f32 with sign bit b & 0x80 and bits (b & 0x7f) << 20, times
//   2^120. A normal code (exponent e >= 1) is 2^(e-127) (1 + m/8) before the
//   multiply, 2^(e-7) (1 + m/8) after; a subnormal code is the f32 subnormal
//   m 2^-129, m 2^-9 after (the device keeps subnormals: no -ftz). NaN codes
//   (0x7f, 0xff) take the reference path.
// - int8: the f32 with bits 0x4b000000 | (b ^ 0x80) is 2^23 + 128 + code.
// - int4: 0x4b000000 | nibble is 2^23 + nibble, and the code is nibble - 8.

// Whether any byte of u is an e4m3 NaN code (low 7 bits all set): adding 1
// to the low 7 bits of each byte carries into its top bit only there.
__device__ inline bool has_nan_code(uint32_t u) {
  return (((u & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0;
}

// The 8 codes of a unit (w.y unused for int4), exactly, by integer decoding.
template <lwo_quant_format_t F>
__device__ inline void decode8_fast(uint2 w, float* q) {
  const uint32_t u[2] = {w.x, w.y};
  if (F == LWO_QUANT_INT4_GROUP128) {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      q[k] = __uint_as_float(0x4b000000u | ((u[0] >> (4 * k)) & 0xfu)) - 8388616.0f;
  } else if (F == LWO_QUANT_INT8_CHANNEL) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t t = u[k / 4] ^ 0x80808080u;
      q[k] = __uint_as_float(__byte_perm(t, 0x4b000000u, 0x7540u | (k % 4))) - 8388736.0f;
    }
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t b = (u[k / 4] >> (8 * (k % 4))) & 0xffu;
      q[k] = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * 0x1p120f;
    }
  }
}

// The 8 codes of a unit by codec.h's functions.
template <lwo_quant_format_t F>
__device__ inline void decode8_ref(uint2 w, float* q) {
  const uint32_t u[2] = {w.x, w.y};
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (F == LWO_QUANT_INT4_GROUP128)
      q[k] = quant::i4_to_f32(u[0] >> (4 * k));
    else if (F == LWO_QUANT_INT8_CHANNEL)
      q[k] = quant::i8_to_f32(static_cast<uint8_t>(u[k / 4] >> (8 * (k % 4))));
    else
      q[k] = quant::e4m3_to_f32(static_cast<uint8_t>(u[k / 4] >> (8 * (k % 4))));
  }
}

// Stores y[0..8), none of them NaN, as unit v of dst by the hardware's
// rounding (f32: as they are).
template <int O>
__device__ inline void store8_fast(void* dst, uint64_t v, const float* y) {
  if (O == kF32) {
    store_vec<kF32, 8>(dst, v, y);
  } else {
    uint32_t h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (O == kBf16) {
        const __nv_bfloat162 p = __floats2bfloat162_rn(y[2 * j], y[2 * j + 1]);  // .x: low half
        memcpy(&h[j], &p, 4);
      } else {
        const __half2 p = __floats2half2_rn(y[2 * j], y[2 * j + 1]);
        memcpy(&h[j], &p, 4);
      }
    }
    reinterpret_cast<uint4*>(dst)[v] = make_uint4(h[0], h[1], h[2], h[3]);
  }
}

template <lwo_quant_format_t F>
__device__ inline uint2 load_unit(const uint8_t* src, uint64_t v) {
  if (F == LWO_QUANT_INT4_GROUP128) return make_uint2(__ldg(reinterpret_cast<const uint32_t*>(src) + v), 0u);
  return __ldg(reinterpret_cast<const uint2*>(src) + v);
}

// cols % 8 == 0, dst 16-byte aligned, src aligned to its unit load (8 bytes,
// int4 4) and its scales to 4 bytes. Grid-stride over units; each thread
// step loads U units (and their scales) before decoding any, so U loads are
// in flight per thread. The row and column of a unit are carried along the
// stride (one division per thread, none per unit).
template <lwo_quant_format_t F, int O, class I, int U>
__global__ void __launch_bounds__(256) dequant_units(const uint8_t* src, void* dst, Shape s) {
  const I nu = static_cast<I>(s.rows * s.cols / 8), upr = static_cast<I>(s.cols / 8);
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  const I srow = stride / upr, scol = stride - srow * upr;
  I v = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x;
  I r = v / upr, cu = v - r * upr;
  while (v < nu) {
    uint2 w[U];
    float sc[U];
    I at[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      at[u] = v;
      if (v < nu) {
        w[u] = load_unit<F>(src, static_cast<uint64_t>(v));
        sc[u] = scale_at<F, true, I>(src, s, r, cu * 8);
      }
      v += stride;
      r += srow;
      cu += scol;
      if (cu >= upr) {
        cu -= upr;
        ++r;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (at[u] >= nu) continue;
      bool fast = (__float_as_uint(sc[u]) & 0x7f800000u) != 0x7f800000u;
      if (F == LWO_QUANT_FP8_E4M3_CHANNEL || F == LWO_QUANT_FP8_E4M3_BLOCK128)
        fast = fast && !has_nan_code(w[u].x) && !has_nan_code(w[u].y);
      float y[8];
      if (fast) {
        decode8_fast<F>(w[u], y);
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] *= sc[u];
        store8_fast<O>(dst, static_cast<uint64_t>(at[u]), y);
      } else {
        decode8_ref<F>(w[u], y);
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = quant::dequant(y[k], sc[u]);
        store_vec<O, 8>(dst, static_cast<uint64_t>(at[u]), y);
      }
    }
  }
}

unsigned grid_for(uint64_t work) {
  const uint64_t blocks = (work + 255) / 256;
  return static_cast<unsigned>(std::min<uint64_t>(std::max<uint64_t>(blocks, 1), 65536));
}

// Units a thread takes per step (2 loads in flight): measured on the H200
// over the shapes of the 144-linear model and 8192 x 8192, sources out of
// L2, 2 was the fastest or within 2% of it everywhere (1 and 4 slower by
// 2-15%; int4 2048 x 8192: 12.4 us against 14.6 with 1).
constexpr int kUnitsPerStep = 2;

template <lwo_quant_format_t F, int O>
void launch(const Shape& s, const uint8_t* src, void* dst, cudaStream_t stream) {
  const uint64_t n = s.rows * s.cols;
  // 32-bit indices while every index (and index + 4 strides, more than a
  // step adds) stays below 2^32.
  const bool narrow = n + uint64_t(65536) * 256 * 4 < (uint64_t(1) << 32);
  const auto sa = reinterpret_cast<uintptr_t>(src), da = reinterpret_cast<uintptr_t>(dst);
  const uintptr_t load = F == LWO_QUANT_INT4_GROUP128 ? 4 : 8;  // a unit's codes
  if (s.cols % 8 == 0 && sa % load == 0 && da % 16 == 0 && (sa + s.scale_offset) % 4 == 0) {
    constexpr int U = kUnitsPerStep;
    const unsigned g = grid_for((n / 8 + U - 1) / U);
    if (narrow)
      dequant_units<F, O, uint32_t, U><<<g, 256, 0, stream>>>(src, dst, s);
    else
      dequant_units<F, O, uint64_t, U><<<g, 256, 0, stream>>>(src, dst, s);
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
