// Quantized weight formats (lwo.h, "Quantized weights"): the one definition
// of each format's layout (codes, then f32 scales, each at LWO_RECORD_ALIGN,
// so a layer and its scales move in one copy), host quantization from
// f32 / bf16 / f16 and host dequantization, the CPU reference of the GPU
// kernels (kernels/quant_kernels.cu). The element codecs both sides share
// are in codec.h. Host only; depends on src/common alone.
//
// The 4-bit format is int4, symmetric, with one f32 scale per group of 128
// elements of a row (LWO_QUANT_INT4_GROUP128), chosen over NF4 because:
//  - it dequantizes with one subtraction and one multiply, which a GEMM can
//    fuse into its operand load at memory speed; NF4 needs a 16-entry table
//    lookup per element (a shuffle or shared-memory read);
//  - group 128 gives 4.25 bits per weight, 3.76x fewer bytes than bf16,
//    leaving room above the 3.5x speed target; group 64 (4.5 bits, 3.56x)
//    would leave almost none. 128 is also the fp8 block edge and the K tile
//    of the GEMMs, so one scale covers one tile row;
//  - NF4's levels fit normally distributed weights better (lower RMS error
//    for Gaussian groups), but its worst case on a group with an outlier is
//    no better: both spend the range on the outlier. The int4 error bound is
//    simply half a step, scale / 2 = amax / 14 of the group.
#pragma once

#include <cstdint>

#include "lwo.h"

namespace lwo {
namespace quant {

// The layout of one quantized tensor, and which elements each scale covers:
// element (r, c) uses scale (r / unit_rows) * scale_cols + c / unit_cols
// (codec.h's scale_index, shared with the kernels).
struct Layout {
  lwo_quant_format_t format = LWO_QUANT_NONE;
  int64_t rows = 0, cols = 0;
  uint64_t data_bytes = 0;    // the codes, at offset 0
  uint64_t scale_offset = 0;  // data_bytes rounded up to LWO_RECORD_ALIGN
  uint64_t scale_bytes = 0;   // 4 * scale_rows * scale_cols
  uint64_t total_bytes = 0;   // rounded up to LWO_RECORD_ALIGN
  int64_t scale_rows = 0, scale_cols = 0;
  int64_t unit_rows = 0, unit_cols = 0;  // elements per scale: 1 x cols, 128 x 128, 1 x 128
  uint64_t scale_index(int64_t r, int64_t c) const;
};

// "fp8_e4m3_channel", ...; "none"; nullptr for an unknown format.
const char* format_name(lwo_quant_format_t format);

// The layout of a [rows x cols] tensor; dtype is the unquantized tensor's.
// Throws lwo::Error: LWO_ERR_INVALID_ARGUMENT (LWO_QUANT_NONE or an unknown
// format, a dtype other than f32 / bf16 / f16, rows or cols below 1, cols
// not a multiple of 128 for int4), LWO_ERR_OUT_OF_RANGE (rows or cols of
// 2^31 or more).
Layout layout_of(lwo_quant_format_t format, lwo_dtype_t dtype, int64_t rows, int64_t cols);

// src: rows x cols elements of `dtype`; dst: layout.total_bytes, written
// whole (codes, scales, zero padding). Reads src twice: the scales first,
// then the codes, so a NaN or infinity (LWO_ERR_INVALID_ARGUMENT naming its
// row and column) is found before dst is touched. n_threads as parallel_for.
void quantize(const Layout& layout, const void* src, lwo_dtype_t dtype, void* dst,
              uint32_t n_threads);

// src: layout.total_bytes; dst: rows x cols elements of `dtype`.
void dequantize(const Layout& layout, const void* src, void* dst, lwo_dtype_t dtype,
                uint32_t n_threads);

}  // namespace quant
}  // namespace lwo
