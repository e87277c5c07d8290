#include "dtype.h"

#include "error.h"

namespace lwo {

size_t dtype_size(lwo_dtype_t d) {
  switch (d) {
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
  switch (d) {
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

}  // namespace lwo
