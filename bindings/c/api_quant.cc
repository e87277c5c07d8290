// lwo.h: Quantized weights: the descriptor is checked and
// turned into a layout here (src/quant), host quantization and the CPU
// reference run in src/quant, the GPU dequantization in src/compute's
// launcher of kernels/quant_kernels.cu.
#include "abi.h"
#include "src/common/dtype.h"
#include "src/compute/dequantize.h"
#include "src/quant/quant.h"

using namespace lwo::abi;
using lwo::fail;

namespace {

lwo_quant_desc read_desc(const lwo_quant_desc* desc) {
  need(desc, "desc");
  lwo_quant_desc d = read_config(desc, lwo_quant_desc LWO_QUANT_DESC_INIT, "desc");
  lwo::check_dtype_value(d.dtype, "dtype");
  return d;
}

lwo::quant::Layout layout_of(const lwo_quant_desc& d) {
  return lwo::quant::layout_of(d.format, d.dtype, d.rows, d.cols);
}

uint64_t plain_bytes(const lwo_quant_desc& d) {
  return static_cast<uint64_t>(d.rows) * static_cast<uint64_t>(d.cols) * lwo::dtype_size(d.dtype);
}

void check_bytes(const char* what, uint64_t have, uint64_t need_bytes, const char* of,
                 const lwo_quant_desc& d) {
  if (have < need_bytes)
    fail(LWO_ERR_SIZE_MISMATCH, "%s %llu is smaller than the %llu bytes of the %lld x %lld %s",
         what, static_cast<unsigned long long>(have), static_cast<unsigned long long>(need_bytes),
         static_cast<long long>(d.rows), static_cast<long long>(d.cols), of);
}

std::string quant_name(const lwo_quant_desc& d) {
  return lwo::strf("%s tensor (%s)", lwo::quant::format_name(d.format),
                   lwo::dtype_name(d.dtype));
}

}  // namespace

extern "C" {

LWO_API void lwo_quant_desc_init(lwo_quant_desc* desc) {
  if (desc) *desc = lwo_quant_desc LWO_QUANT_DESC_INIT;
}

LWO_API const char* lwo_quant_format_name(lwo_quant_format_t format) {
  const char* n = lwo::quant::format_name(format);
  return n ? n : "unknown";
}

LWO_API lwo_status_t lwo_quant_layout(const lwo_quant_desc* desc, lwo_quant_layout_info* info) {
  return guard("lwo_quant_layout", [&] {
    lwo_quant_desc d = read_desc(desc);
    check_out(info, "info");
    lwo::quant::Layout l = layout_of(d);
    lwo_quant_layout_info out = LWO_QUANT_LAYOUT_INFO_INIT;
    out.data_offset = 0;
    out.data_bytes = l.data_bytes;
    out.scale_offset = l.scale_offset;
    out.scale_bytes = l.scale_bytes;
    out.scale_rows = l.scale_rows;
    out.scale_cols = l.scale_cols;
    out.total_bytes = l.total_bytes;
    write_out(info, out, "info");
  });
}

LWO_API lwo_status_t lwo_quantize(const lwo_quant_desc* desc, const void* src, uint64_t src_bytes,
                                  void* dst, uint64_t dst_bytes, uint32_t n_threads) {
  return guard("lwo_quantize", [&] {
    lwo_quant_desc d = read_desc(desc);
    need(src, "src");
    need(dst, "dst");
    lwo::quant::Layout l = layout_of(d);
    const std::string what = quant_name(d);
    check_bytes("src_bytes", src_bytes, plain_bytes(d), lwo::dtype_name(d.dtype), d);
    check_bytes("dst_bytes", dst_bytes, l.total_bytes, what.c_str(), d);
    lwo::quant::quantize(l, src, d.dtype, dst, n_threads);
  });
}

LWO_API lwo_status_t lwo_dequantize_host(const lwo_quant_desc* desc, const void* src,
                                         uint64_t src_bytes, void* dst, uint64_t dst_bytes,
                                         uint32_t n_threads) {
  return guard("lwo_dequantize_host", [&] {
    lwo_quant_desc d = read_desc(desc);
    need(src, "src");
    need(dst, "dst");
    lwo::quant::Layout l = layout_of(d);
    const std::string what = quant_name(d);
    check_bytes("src_bytes", src_bytes, l.total_bytes, what.c_str(), d);
    check_bytes("dst_bytes", dst_bytes, plain_bytes(d), lwo::dtype_name(d.dtype), d);
    lwo::quant::dequantize(l, src, dst, d.dtype, n_threads);
  });
}

LWO_API lwo_status_t lwo_dequantize(lwo_engine* engine, const lwo_quant_desc* desc,
                                    const void* src, void* dst, lwo_stream_t stream) {
  return guard("lwo_dequantize", [&] {
    lwo_engine* e = check_handle(engine);
    lwo_quant_desc d = read_desc(desc);
    need(src, "src");
    need(dst, "dst");
    const bool known = d.dtype == LWO_DTYPE_F32 || d.dtype == LWO_DTYPE_BF16 ||
                       d.dtype == LWO_DTYPE_F16;  // else layout_of names the dtype
    const size_t es = lwo::dtype_size(d.dtype);
    if (known && reinterpret_cast<uintptr_t>(dst) % es != 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "dst %p is not aligned to the %zu bytes of a %s element",
           dst, es, lwo::dtype_name(d.dtype));
    lwo::quant::Layout l = layout_of(d);
    lwo::DeviceScope scope(*e->impl);
    if (e->impl->gpu().compute_on_host())  // the host backend: device memory is host memory
      return lwo::quant::dequantize(l, src, dst, d.dtype, 1);
    lwo::dequantize_on_device(l, src, dst, d.dtype, stream);
  });
}

}  // extern "C"
