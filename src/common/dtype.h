// Element types: sizes, names, alignment arithmetic, the host conversions
// of the 16-bit float formats and the host gradient addition. Host-only; used by every role.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "lwo.h"

namespace lwo {

size_t dtype_size(lwo_dtype_t dtype);  // 0 if unknown
const char* dtype_name(lwo_dtype_t dtype);

// The integer a caller stored in an lwo_dtype_t, read from its bytes. A C
// caller may store any int there, and loading an enum whose value is outside
// its range (lwo_dtype_t's is 0..2^31 - 1: a negative value) is undefined
// behaviour in C++: every dtype that comes from a caller is checked through
// this before it is used as an enum.
inline int32_t dtype_value(const lwo_dtype_t& d) {
  static_assert(sizeof(lwo_dtype_t) == sizeof(int32_t), "lwo_dtype_t is 32 bits");
  int32_t v;
  std::memcpy(&v, &d, sizeof v);
  return v;
}
// Throws LWO_ERR_INVALID_ARGUMENT (naming `what` and the value) unless d's
// integer lies in lwo_dtype_t's range; a value in range that names no dtype
// is left to the caller's own check (dtype_size() is 0 for it).
void check_dtype_value(const lwo_dtype_t& d, const char* what);

inline uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Exact for every value; NaN stays a NaN. Branch-free, so loops vectorize.
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal (and inf/NaN): shift the exponent and mantissa into place, rebias
  // by a multiply (2^-112) that also carries inf and NaN through.
  uint32_t nb = (two_w >> 4) + (uint32_t(0xe0) << 23);
  float normal;
  std::memcpy(&normal, &nb, 4);
  normal *= 0x1.0p-112f;
  // Subnormal: the mantissa as the low bits of 0.5 * 2^k, minus 0.5.
  uint32_t db = (two_w >> 17) | (uint32_t(126) << 23);
  float denormal;
  std::memcpy(&denormal, &db, 4);
  denormal -= 0.5f;
  uint32_t nbits, dbits;
  std::memcpy(&nbits, &normal, 4);
  std::memcpy(&dbits, &denormal, 4);
  const uint32_t r = sign | (two_w < (uint32_t(1) << 27) ? dbits : nbits);
  float f;
  std::memcpy(&f, &r, 4);
  return f;
}

// Round to nearest even; NaN stays a (quiet) NaN, overflow gives infinity.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Round to nearest even, subnormals included; NaN stays a (quiet) NaN, 65520
// and up give infinity.
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up: infinity
  if (ax < 0x38800000u)                          // below 2^-14: subnormal or zero
    return sign | static_cast<uint16_t>(std::lrint(std::fabs(f) * 16777216.0f));
  ax += 0xc8000fffu + ((ax >> 13) & 1u);  // rebias the exponent by -112 and round
  return sign | static_cast<uint16_t>(ax >> 13);
}

// Element i of a buffer of dtype bf16, f16 or f32 (anything else reads as
// f32) as a float, and v rounded to the buffer's dtype (nearest even) stored
// as element i.
inline float load_f32(const void* data, lwo_dtype_t dtype, uint64_t i) {
  const auto* p = static_cast<const uint8_t*>(data);
  if (dtype != LWO_DTYPE_BF16 && dtype != LWO_DTYPE_F16) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return dtype == LWO_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}
inline void store_f32(void* data, lwo_dtype_t dtype, uint64_t i, float v) {
  auto* p = static_cast<uint8_t*>(data);
  if (dtype != LWO_DTYPE_BF16 && dtype != LWO_DTYPE_F16) {
    std::memcpy(p + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = dtype == LWO_DTYPE_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
  std::memcpy(p + 2 * i, &h, 2);
}

// A host loop GCC builds once per x86-64 level (AVX-512, AVX2, baseline),
// picking one at load time; elsewhere a plain function.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__ELF__)
#define LWO_VECTOR_LOOP __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LWO_VECTOR_LOOP
#endif

// dst[at + i] = src[i] rounded to dtype (bf16 / f16: store_f32's rounding,
// bit for bit, NaN included; f32 and anything else: as is) for i in [0, n).
// streaming: the stores bypass the cache where the host has AVX2 or AVX-512
// (non-temporal, for a buffer written once and next read by a DMA engine or
// much later: no read for ownership, no cache lines evicted for it); the
// caller then calls streaming_fence() before anything else (another thread,
// a copy engine) may read dst. The level is picked at run time.
void store_rounded(void* dst, lwo_dtype_t dtype, uint64_t at, const float* src, uint64_t n,
                   bool streaming);
// Orders this thread's streaming stores before its later stores (sfence).
void streaming_fence();

namespace detail {
// store_rounded at one vector level: 2 AVX-512, 1 AVX2, 0 plain loop. A
// level the host lacks returns false and stores nothing (for the tests).
bool store_rounded_at(int level, void* dst, lwo_dtype_t dtype, uint64_t at, const float* src,
                      uint64_t n, bool streaming);
}  // namespace detail

// dst[i] = src[i] (assign) or dst[i] = dst[i] + src[i] for i in [0, n): the
// sum formed in f32 and rounded once to dst's dtype (round to nearest even).
// dst and src must not overlap. Pairs: (f32, f32 / bf16 / f16), (bf16, bf16),
// (f16, f16); anything else is LWO_ERR_INTERNAL. Vectorized for the host's
// widest vector unit where the compiler can choose at run time.
void accumulate(void* dst, lwo_dtype_t dst_dtype, const void* src, lwo_dtype_t src_dtype,
                uint64_t n, bool assign);

}  // namespace lwo
