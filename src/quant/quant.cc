// Quantized weight formats: layouts, host quantization, host dequantization
// (the CPU reference). See quant.h and codec.h.
#include "src/quant/quant.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/parallel.h"
#include "src/quant/codec.h"

namespace lwo {
namespace quant {
namespace {

constexpr int64_t kMaxDim = INT64_C(1) << 31;
// Elements per host thread at least (parallel_for's min_part, in elements).
constexpr uint64_t kMinElementsPerThread = uint64_t(1) << 18;

bool float_dtype(lwo_dtype_t d) {
  return d == LWO_DTYPE_F32 || d == LWO_DTYPE_BF16 || d == LWO_DTYPE_F16;
}

float code_max(lwo_quant_format_t f) {
  switch (f) {
    case LWO_QUANT_FP8_E4M3_CHANNEL:
    case LWO_QUANT_FP8_E4M3_BLOCK128: return kFp8Max;
    case LWO_QUANT_INT8_CHANNEL: return kInt8Max;
    default: return kInt4Max;
  }
}

// Calls f(load) with load(p, i) -> float for the dtype's elements.
template <class F>
void with_loader(lwo_dtype_t dt, F&& f) {
  switch (dt) {
    case LWO_DTYPE_F32:
      f([](const uint8_t* p, uint64_t i) {
        float v;
        std::memcpy(&v, p + 4 * i, 4);
        return v;
      });
      return;
    case LWO_DTYPE_BF16:
      f([](const uint8_t* p, uint64_t i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        return bf16_to_f32(h);
      });
      return;
    case LWO_DTYPE_F16:
      f([](const uint8_t* p, uint64_t i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        return f16_to_f32(h);
      });
      return;
    default:
      fail(LWO_ERR_INTERNAL, "quantize: dtype %s is not f32, bf16 or f16", dtype_name(dt));
  }
}

// Scale rows per parallel part, so each part has kMinElementsPerThread.
uint64_t min_scale_rows(const Layout& l) {
  const uint64_t per = static_cast<uint64_t>(l.unit_rows) * static_cast<uint64_t>(l.cols);
  return std::max<uint64_t>(1, kMinElementsPerThread / std::max<uint64_t>(per, 1));
}

// The rows of scale rows [b, e).
void rows_of(const Layout& l, uint64_t b, uint64_t e, int64_t* r0, int64_t* r1) {
  *r0 = static_cast<int64_t>(b) * l.unit_rows;
  *r1 = std::min(l.rows, static_cast<int64_t>(e) * l.unit_rows);
}

}  // namespace

uint64_t Layout::scale_index(int64_t r, int64_t c) const {
  return quant::scale_index<uint64_t>(format, static_cast<uint64_t>(r), static_cast<uint64_t>(c),
                                      static_cast<uint64_t>(scale_cols));
}

const char* format_name(lwo_quant_format_t format) {
  switch (format) {
    case LWO_QUANT_NONE: return "none";
    case LWO_QUANT_FP8_E4M3_CHANNEL: return "fp8_e4m3_channel";
    case LWO_QUANT_FP8_E4M3_BLOCK128: return "fp8_e4m3_block128";
    case LWO_QUANT_INT8_CHANNEL: return "int8_channel";
    case LWO_QUANT_INT4_GROUP128: return "int4_group128";
    default: return nullptr;
  }
}

Layout layout_of(lwo_quant_format_t format, lwo_dtype_t dtype, int64_t rows, int64_t cols) {
  if (format == LWO_QUANT_NONE)
    fail(LWO_ERR_INVALID_ARGUMENT, "format LWO_QUANT_NONE (0) describes no quantized tensor");
  if (!format_name(format))
    fail(LWO_ERR_INVALID_ARGUMENT, "format %d is not a quantized format (1..4)",
         static_cast<int>(format));
  if (!float_dtype(dtype))
    fail(LWO_ERR_INVALID_ARGUMENT, "dtype %s (%d) is not f32, bf16 or f16", dtype_name(dtype),
         static_cast<int>(dtype));
  if (rows < 1 || cols < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s tensor of %lld x %lld: rows and cols must be >= 1",
         format_name(format), static_cast<long long>(rows), static_cast<long long>(cols));
  if (format == LWO_QUANT_INT4_GROUP128 && cols % kGroup != 0)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "%s tensor of %lld x %lld: cols must be a multiple of the group size %lld",
         format_name(format), static_cast<long long>(rows), static_cast<long long>(cols),
         static_cast<long long>(kGroup));
  if (rows >= kMaxDim || cols >= kMaxDim)
    fail(LWO_ERR_OUT_OF_RANGE, "%s tensor of %lld x %lld: rows and cols must be below 2^31",
         format_name(format), static_cast<long long>(rows), static_cast<long long>(cols));
  Layout l;
  l.format = format;
  l.rows = rows;
  l.cols = cols;
  const uint64_t n = static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols);  // < 2^62
  switch (format) {
    case LWO_QUANT_FP8_E4M3_BLOCK128:
      l.unit_rows = kBlock;
      l.unit_cols = kBlock;
      l.data_bytes = n;
      break;
    case LWO_QUANT_INT4_GROUP128:
      l.unit_rows = 1;
      l.unit_cols = kGroup;
      l.data_bytes = n / 2;
      break;
    default:  // per output channel
      l.unit_rows = 1;
      l.unit_cols = cols;
      l.data_bytes = n;
      break;
  }
  l.scale_rows = (rows + l.unit_rows - 1) / l.unit_rows;
  l.scale_cols = (cols + l.unit_cols - 1) / l.unit_cols;
  l.scale_offset = align_up(l.data_bytes, LWO_RECORD_ALIGN);
  l.scale_bytes = 4 * static_cast<uint64_t>(l.scale_rows) * static_cast<uint64_t>(l.scale_cols);
  l.total_bytes = align_up(l.scale_offset + l.scale_bytes, LWO_RECORD_ALIGN);
  return l;
}

void quantize(const Layout& l, const void* src_v, lwo_dtype_t dtype, void* dst_v,
              uint32_t n_threads) {
  const auto* src = static_cast<const uint8_t*>(src_v);
  auto* dst = static_cast<uint8_t*>(dst_v);
  const uint64_t n_scales = static_cast<uint64_t>(l.scale_rows) * static_cast<uint64_t>(l.scale_cols);
  const uint64_t cols = static_cast<uint64_t>(l.cols);
  const float qmax = code_max(l.format);
  const bool fp8 = l.format == LWO_QUANT_FP8_E4M3_CHANNEL || l.format == LWO_QUANT_FP8_E4M3_BLOCK128;
  std::vector<float> scales;
  scales.assign(n_scales, 0.0f);
  std::atomic<uint64_t> first_bad{UINT64_MAX};

  with_loader(dtype, [&](auto load) {
    // Pass 1: each unit's amax, then its scale; the first non-finite element.
    parallel_for(static_cast<uint64_t>(l.scale_rows), n_threads, min_scale_rows(l), 1,
                 [&](uint64_t b, uint64_t e) {
      int64_t r0, r1;
      rows_of(l, b, e, &r0, &r1);
      uint64_t bad = UINT64_MAX;
      for (int64_t r = r0; r < r1 && bad == UINT64_MAX; ++r) {
        const uint64_t row = static_cast<uint64_t>(r) * cols;
        for (int64_t c = 0; c < l.cols; ++c) {
          const float a = std::fabs(load(src, row + static_cast<uint64_t>(c)));
          if (!(a <= FLT_MAX)) {
            bad = row + static_cast<uint64_t>(c);
            break;
          }
          float& m = scales[l.scale_index(r, c)];
          if (a > m) m = a;
        }
      }
      if (bad != UINT64_MAX) {
        uint64_t cur = first_bad.load();
        while (bad < cur && !first_bad.compare_exchange_weak(cur, bad)) {
        }
        return;
      }
      for (uint64_t s = b * static_cast<uint64_t>(l.scale_cols);
           s < e * static_cast<uint64_t>(l.scale_cols) && s < n_scales; ++s)
        scales[s] = fp8 ? fp8_scale(scales[s]) : unit_scale(scales[s], qmax);
    });
    const uint64_t bad = first_bad.load();
    if (bad != UINT64_MAX) {
      const float v = load(src, bad);
      fail(LWO_ERR_INVALID_ARGUMENT,
           "src element [%llu, %llu] of the %lld x %lld tensor is %s: quantized weights must "
           "be finite",
           static_cast<unsigned long long>(bad / cols),
           static_cast<unsigned long long>(bad % cols), static_cast<long long>(l.rows),
           static_cast<long long>(l.cols), std::isnan(v) ? "NaN" : "infinite");
    }

    // Pass 2: the codes of the rows of each part, then scales and padding.
    parallel_for(static_cast<uint64_t>(l.scale_rows), n_threads, min_scale_rows(l), 1,
                 [&](uint64_t b, uint64_t e) {
      int64_t r0, r1;
      rows_of(l, b, e, &r0, &r1);
      for (int64_t r = r0; r < r1; ++r) {
        const uint64_t row = static_cast<uint64_t>(r) * cols;
        switch (l.format) {
          case LWO_QUANT_FP8_E4M3_CHANNEL:
          case LWO_QUANT_FP8_E4M3_BLOCK128:
            for (int64_t c0 = 0; c0 < l.cols; c0 += l.unit_cols) {
              const float inverse = fp8_inverse(scales[l.scale_index(r, c0)]);
              for (int64_t c = c0; c < std::min(l.cols, c0 + l.unit_cols); ++c)
                dst[row + static_cast<uint64_t>(c)] =
                    e4m3_code(load(src, row + static_cast<uint64_t>(c)), inverse);
            }
            break;
          case LWO_QUANT_INT8_CHANNEL:
            for (int64_t c = 0; c < l.cols; ++c)
              dst[row + static_cast<uint64_t>(c)] = static_cast<uint8_t>(static_cast<int8_t>(
                  f32_to_int(load(src, row + static_cast<uint64_t>(c)) / scales[l.scale_index(r, c)],
                             kInt8Max)));
            break;
          default:  // int4: two codes per byte, the even element low
            for (int64_t c = 0; c < l.cols; c += 2) {
              const float s = scales[l.scale_index(r, c)];  // c and c+1 share the group
              const int32_t lo = f32_to_int(load(src, row + static_cast<uint64_t>(c)) / s, kInt4Max);
              const int32_t hi = f32_to_int(load(src, row + static_cast<uint64_t>(c) + 1) / s, kInt4Max);
              dst[(row + static_cast<uint64_t>(c)) / 2] =
                  static_cast<uint8_t>((lo + 8) | ((hi + 8) << 4));
            }
            break;
        }
      }
    });
  });
  std::memset(dst + l.data_bytes, 0, l.scale_offset - l.data_bytes);
  if (n_scales) std::memcpy(dst + l.scale_offset, scales.data(), l.scale_bytes);
  std::memset(dst + l.scale_offset + l.scale_bytes, 0,
              l.total_bytes - l.scale_offset - l.scale_bytes);
}

void dequantize(const Layout& l, const void* src_v, void* dst_v, lwo_dtype_t dtype,
                uint32_t n_threads) {
  if (!float_dtype(dtype))
    fail(LWO_ERR_INTERNAL, "dequantize: dtype %s is not f32, bf16 or f16", dtype_name(dtype));
  const auto* src = static_cast<const uint8_t*>(src_v);
  const uint8_t* scale_bytes = src + l.scale_offset;
  auto* dst = static_cast<uint8_t*>(dst_v);
  const uint64_t cols = static_cast<uint64_t>(l.cols);
  const uint64_t min_rows = std::max<uint64_t>(1, kMinElementsPerThread / cols);
  parallel_for(static_cast<uint64_t>(l.rows), n_threads, min_rows, 1, [&](uint64_t b, uint64_t e) {
    for (uint64_t r = b; r < e; ++r) {
      const uint64_t row = r * cols;
      for (uint64_t c = 0; c < cols; ++c) {
        float s;
        std::memcpy(&s, scale_bytes + 4 * l.scale_index(static_cast<int64_t>(r), static_cast<int64_t>(c)), 4);
        float q;
        switch (l.format) {
          case LWO_QUANT_FP8_E4M3_CHANNEL:
          case LWO_QUANT_FP8_E4M3_BLOCK128: q = e4m3_to_f32(src[row + c]); break;
          case LWO_QUANT_INT8_CHANNEL: q = i8_to_f32(src[row + c]); break;
          default: q = i4_to_f32(static_cast<uint32_t>(src[(row + c) / 2] >> (4 * ((row + c) & 1)))); break;
        }
        const float v = dequant(q, s);
        const uint64_t i = row + c;
        if (dtype == LWO_DTYPE_F32) {
          std::memcpy(dst + 4 * i, &v, 4);
        } else {
          const uint16_t h = dtype == LWO_DTYPE_BF16 ? quant::f32_to_bf16(v) : quant::f32_to_f16(v);
          std::memcpy(dst + 2 * i, &h, 2);
        }
      }
    }
  });
}

}  // namespace quant
}  // namespace lwo
