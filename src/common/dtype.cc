#include "dtype.h"

#include <algorithm>

#include "error.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__ELF__)
#define LWO_STREAMING_X86 1
#include <immintrin.h>
#endif

namespace lwo {

void check_dtype_value(const lwo_dtype_t& d, const char* what) {
  int32_t v = dtype_value(d);
  if (v < 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s %d is not a dtype (lwo_dtype_t values are %d..%d)", what,
         v, static_cast<int>(LWO_DTYPE_F32), static_cast<int>(LWO_DTYPE_C64));
}

size_t dtype_size(lwo_dtype_t d) {
  switch (dtype_value(d)) {  // the bytes: d may be any int a C caller passed
    case LWO_DTYPE_F32: return 4;
    case LWO_DTYPE_BF16:
    case LWO_DTYPE_F16: return 2;
    case LWO_DTYPE_F8_E4M3:
    case LWO_DTYPE_F8_E5M2:
    case LWO_DTYPE_I8:
    case LWO_DTYPE_U8:
    case LWO_DTYPE_BOOL:
    case LWO_DTYPE_F8_E8M0: return 1;
    case LWO_DTYPE_I16:
    case LWO_DTYPE_U16: return 2;
    case LWO_DTYPE_I32:
    case LWO_DTYPE_U32: return 4;
    case LWO_DTYPE_I64:
    case LWO_DTYPE_U64:
    case LWO_DTYPE_F64:
    case LWO_DTYPE_C64: return 8;
    default: return 0;
  }
}

const char* dtype_name(lwo_dtype_t d) {
  switch (dtype_value(d)) {
    case LWO_DTYPE_F32: return "f32";
    case LWO_DTYPE_BF16: return "bf16";
    case LWO_DTYPE_F16: return "f16";
    case LWO_DTYPE_F8_E4M3: return "f8_e4m3";
    case LWO_DTYPE_F8_E5M2: return "f8_e5m2";
    case LWO_DTYPE_I8: return "i8";
    case LWO_DTYPE_U8: return "u8";
    case LWO_DTYPE_BOOL: return "bool";
    case LWO_DTYPE_I16: return "i16";
    case LWO_DTYPE_U16: return "u16";
    case LWO_DTYPE_I32: return "i32";
    case LWO_DTYPE_U32: return "u32";
    case LWO_DTYPE_I64: return "i64";
    case LWO_DTYPE_U64: return "u64";
    case LWO_DTYPE_F64: return "f64";
    case LWO_DTYPE_F8_E8M0: return "f8_e8m0";
    case LWO_DTYPE_C64: return "c64";
    default: return "unknown";
  }
}

// --- the host gradient addition ---------------------------------------------

namespace {

LWO_VECTOR_LOOP void add_bf16(uint16_t* __restrict d, const uint16_t* __restrict s, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(bf16_to_f32(d[i]) + bf16_to_f32(s[i]));
}
LWO_VECTOR_LOOP void add_f16(uint16_t* __restrict d, const uint16_t* __restrict s, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) d[i] = f32_to_f16(f16_to_f32(d[i]) + f16_to_f32(s[i]));
}
LWO_VECTOR_LOOP void add_f32(float* __restrict d, const float* __restrict s, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) d[i] += s[i];
}
LWO_VECTOR_LOOP void add_f32_bf16(float* __restrict d, const uint16_t* __restrict s, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) d[i] += bf16_to_f32(s[i]);
}
LWO_VECTOR_LOOP void set_f32_bf16(float* __restrict d, const uint16_t* __restrict s, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
}
LWO_VECTOR_LOOP void add_f32_f16(float* __restrict d, const uint16_t* __restrict s, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) d[i] += f16_to_f32(s[i]);
}
LWO_VECTOR_LOOP void set_f32_f16(float* __restrict d, const uint16_t* __restrict s, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) d[i] = f16_to_f32(s[i]);
}

}  // namespace

void accumulate(void* dst, lwo_dtype_t dd, const void* src, lwo_dtype_t sd, uint64_t n,
                bool assign) {
  if (n == 0) return;
  auto* d16 = static_cast<uint16_t*>(dst);
  auto* d32 = static_cast<float*>(dst);
  const auto* s16 = static_cast<const uint16_t*>(src);
  const auto* s32 = static_cast<const float*>(src);
  if (dd == sd && assign) {
    std::memcpy(dst, src, n * dtype_size(dd));
    return;
  }
  if (dd == LWO_DTYPE_F32 && sd == LWO_DTYPE_F32) return add_f32(d32, s32, n);
  if (dd == LWO_DTYPE_BF16 && sd == LWO_DTYPE_BF16) return add_bf16(d16, s16, n);
  if (dd == LWO_DTYPE_F16 && sd == LWO_DTYPE_F16) return add_f16(d16, s16, n);
  if (dd == LWO_DTYPE_F32 && sd == LWO_DTYPE_BF16)
    return assign ? set_f32_bf16(d32, s16, n) : add_f32_bf16(d32, s16, n);
  if (dd == LWO_DTYPE_F32 && sd == LWO_DTYPE_F16)
    return assign ? set_f32_f16(d32, s16, n) : add_f32_f16(d32, s16, n);
  fail(LWO_ERR_INTERNAL, "no host addition of %s into %s", dtype_name(sd), dtype_name(dd));
}

// --- rounded, streaming stores -----------------------------------------------

namespace {

LWO_VECTOR_LOOP void round_bf16(uint16_t* __restrict d, const float* __restrict s, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
}
LWO_VECTOR_LOOP void round_f16(uint16_t* __restrict d, const float* __restrict s, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) d[i] = f32_to_f16(s[i]);
}

// The plain loops (no streaming).
void store_plain(void* dst, lwo_dtype_t dtype, uint64_t at, const float* src, uint64_t n) {
  if (dtype == LWO_DTYPE_BF16) return round_bf16(static_cast<uint16_t*>(dst) + at, src, n);
  if (dtype == LWO_DTYPE_F16) return round_f16(static_cast<uint16_t*>(dst) + at, src, n);
  std::memcpy(static_cast<float*>(dst) + at, src, n * 4);
}

#ifdef LWO_STREAMING_X86
// The vector forms of f32_to_bf16 and f32_to_f16, lane by lane the same
// bits: bf16 by the same integer rounding (NaN: the top half with the quiet
// bit set); f16 by the hardware's round-to-nearest-even conversion, which
// equals f32_to_f16 on every value but NaN (overflow to infinity and
// subnormals included), with each NaN lane then set to sign | 0x7e00.
// GCC 12 warns of its own intrinsics' undefined vectors (_mm512_undefined_*).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define LWO_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
#define LWO_AVX2 __attribute__((target("avx2,f16c")))

LWO_AVX512 inline __m256i bf16_x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q));
}
LWO_AVX512 inline __m256i f16_x16(__m512 x) {
  const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i a = _mm256_and_si256(h, _mm256_set1_epi16(0x7fff));
  const __m256i nan = _mm256_cmpgt_epi16(a, _mm256_set1_epi16(0x7c00));
  const __m256i q = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0x8000))),
                                    _mm256_set1_epi16(0x7e00));
  return _mm256_blendv_epi8(h, q, nan);
}
// 64-byte stores: 32 elements of 16 bits or 16 of f32; d 64-byte aligned.
LWO_AVX512 void stream_512(void* d, lwo_dtype_t dtype, const float* s, uint64_t n) {
  if (dtype == LWO_DTYPE_BF16 || dtype == LWO_DTYPE_F16) {
    auto* q = static_cast<__m512i*>(d);
    for (uint64_t i = 0; i + 32 <= n; i += 32, ++q) {
      const __m512 a = _mm512_loadu_ps(s + i), b = _mm512_loadu_ps(s + i + 16);
      const __m256i lo = dtype == LWO_DTYPE_BF16 ? bf16_x16(a) : f16_x16(a);
      const __m256i hi = dtype == LWO_DTYPE_BF16 ? bf16_x16(b) : f16_x16(b);
      _mm512_stream_si512(q, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
  } else {
    auto* q = static_cast<float*>(d);
    for (uint64_t i = 0; i + 16 <= n; i += 16) _mm512_stream_ps(q + i, _mm512_loadu_ps(s + i));
  }
}

LWO_AVX2 inline __m256i bits32_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, q, nan);  // each lane 0..0xffff
}
LWO_AVX2 inline __m128i f16_x8(__m256 x) {
  const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m128i a = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
  const __m128i nan = _mm_cmpgt_epi16(a, _mm_set1_epi16(0x7c00));
  const __m128i q = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0x8000))),
                                 _mm_set1_epi16(0x7e00));
  return _mm_blendv_epi8(h, q, nan);
}
// 32-byte stores: 16 elements of 16 bits or 8 of f32; d 32-byte aligned.
LWO_AVX2 void stream_256(void* d, lwo_dtype_t dtype, const float* s, uint64_t n) {
  if (dtype == LWO_DTYPE_BF16 || dtype == LWO_DTYPE_F16) {
    auto* q = static_cast<__m256i*>(d);
    for (uint64_t i = 0; i + 16 <= n; i += 16, ++q) {
      const __m256 a = _mm256_loadu_ps(s + i), b = _mm256_loadu_ps(s + i + 8);
      __m256i v;
      if (dtype == LWO_DTYPE_BF16)  // pack the two halves' lanes, then put them in order
        v = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits32_bf16(a), bits32_bf16(b)), 0xd8);
      else
        v = _mm256_inserti128_si256(_mm256_castsi128_si256(f16_x8(a)), f16_x8(b), 1);
      _mm256_stream_si256(q, v);
    }
  } else {
    auto* q = static_cast<float*>(d);
    for (uint64_t i = 0; i + 8 <= n; i += 8) _mm256_stream_ps(q + i, _mm256_loadu_ps(s + i));
  }
}

bool has_level(int level) {
  __builtin_cpu_init();
  if (level == 2)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("f16c");
  if (level == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return level == 0;
}

int best_level() {
  static const int level = has_level(2) ? 2 : has_level(1) ? 1 : 0;
  return level;
}
#pragma GCC diagnostic pop
#else
bool has_level(int level) { return level == 0; }
int best_level() { return 0; }
#endif

// store_rounded at `level`, which the host has (checked by the callers:
// once per process for store_rounded, per call for the tests' entry).
void store_at(int level, void* dst, lwo_dtype_t dtype, uint64_t at, const float* src, uint64_t n,
              bool streaming) {
  if (n == 0) return;
  if (dtype != LWO_DTYPE_BF16 && dtype != LWO_DTYPE_F16) dtype = LWO_DTYPE_F32;
  if (!streaming || level == 0) return store_plain(dst, dtype, at, src, n);
#ifdef LWO_STREAMING_X86
  // Plain stores up to the first aligned address and after the last whole
  // vector; streaming stores between.
  const uint64_t es = dtype == LWO_DTYPE_F32 ? 4 : 2, align = level == 2 ? 64 : 32;
  const uint64_t per = align / es;  // elements per store
  const uintptr_t a = reinterpret_cast<uintptr_t>(static_cast<uint8_t*>(dst) + at * es);
  uint64_t head = (align - a % align) % align;
  if (head % es) return store_plain(dst, dtype, at, src, n);  // misaligned to its own element
  head = std::min(n, head / es);
  store_plain(dst, dtype, at, src, head);
  const uint64_t body = (n - head) / per * per;
  void* d = static_cast<uint8_t*>(dst) + (at + head) * es;
  if (level == 2)
    stream_512(d, dtype, src + head, body);
  else
    stream_256(d, dtype, src + head, body);
  store_plain(dst, dtype, at + head + body, src + head + body, n - head - body);
#endif
}
}  // namespace

namespace detail {
bool store_rounded_at(int level, void* dst, lwo_dtype_t dtype, uint64_t at, const float* src,
                      uint64_t n, bool streaming) {
  if (!has_level(level)) return false;
  store_at(level, dst, dtype, at, src, n, streaming);
  return true;
}
}  // namespace detail

void store_rounded(void* dst, lwo_dtype_t dtype, uint64_t at, const float* src, uint64_t n,
                   bool streaming) {
  store_at(best_level(), dst, dtype, at, src, n, streaming);  // the level read once per process
}

void streaming_fence() {
#ifdef LWO_STREAMING_X86
  _mm_sfence();
#endif
}

}  // namespace lwo
