// lwo.h: Layer compute (linear layers through cuBLASLt, 2-D convolutions
// through cuDNN): the descriptors are checked and converted here, and the
// engine's Compute runs them.
#include "abi.h"
#include "src/common/dtype.h"
#include "src/compute/compute.h"
#include "src/compute/host_compute.h"
#include "src/quant/quant.h"

using namespace lwo::abi;
using lwo::fail;

namespace {

// A caller's layer descriptor (read_config over `defaults`): a compute dtype
// of bf16, f16 or f32 and no flags but `known`.
template <class Desc>
Desc read_desc(const Desc* desc, const Desc& defaults, uint32_t known) {
  need(desc, "desc");
  Desc d = read_config(desc, defaults);
  lwo::check_dtype_value(d.dtype, "dtype");
  if (d.dtype != LWO_DTYPE_BF16 && d.dtype != LWO_DTYPE_F16 && d.dtype != LWO_DTYPE_F32)
    fail(LWO_ERR_INVALID_ARGUMENT, "dtype %s (%d) is not bf16, f16 or f32",
         lwo::dtype_name(d.dtype), static_cast<int>(d.dtype));
  if (d.flags & ~known) fail(LWO_ERR_INVALID_ARGUMENT, "unknown flags 0x%x", d.flags & ~known);
  return d;
}

}  // namespace

extern "C" {

LWO_API void lwo_linear_desc_init(lwo_linear_desc* d) {
  if (d) *d = lwo_linear_desc LWO_LINEAR_DESC_INIT;
}

// The outputs of a backward call of a layer, linear or convolution, after
// its inputs are checked: dbias needs the layer's bias flag (`bias_flag`),
// gradients are f32 or the layer's dtype, something is asked, and a quantized
// weight gets dx only unless it is fp8 block-128 (the one format that trains:
// dweight and dbias come from x and dy, whatever W's format).
static void check_backward_outputs(const char* bias_flag, bool has_bias, lwo_dtype_t dtype,
                                   lwo_quant_format_t weight_format, const void* dx,
                                   const void* dweight, const void* dbias,
                                   lwo_dtype_t grad_dtype) {
  if (dbias && !has_bias)
    fail(LWO_ERR_INVALID_ARGUMENT, "dbias given but the layer has no %s", bias_flag);
  if ((dweight || dbias) && grad_dtype != LWO_DTYPE_F32 && grad_dtype != dtype)
    fail(LWO_ERR_INVALID_ARGUMENT, "grad_dtype %s is neither f32 nor the layer's %s",
         lwo::dtype_name(grad_dtype), lwo::dtype_name(dtype));
  if (!dx && !dweight && !dbias)
    fail(LWO_ERR_INVALID_ARGUMENT, "dx, dweight and dbias are all NULL: nothing to do");
  if (weight_format != LWO_QUANT_NONE && weight_format != LWO_QUANT_FP8_E4M3_BLOCK128 &&
      (dweight || dbias))
    fail(LWO_ERR_QUANTIZED_WEIGHT,
         "the weight is quantized (weight_format %s): it is frozen (only fp8_e4m3_block128 "
         "weights train), so dweight and dbias must be NULL (given %s%s%s)",
         lwo::quant::format_name(weight_format), dweight ? "dweight" : "",
         dweight && dbias ? " and " : "", dbias ? "dbias" : "");
}

static lwo::Compute::Linear linear_of(const lwo_linear_desc* desc, int64_t tokens) {
  const lwo_linear_desc d = read_desc(
      desc, lwo_linear_desc LWO_LINEAR_DESC_INIT,
      LWO_LINEAR_BIAS | LWO_LINEAR_TF32 | LWO_LINEAR_ACCUMULATE);
  if (d.in_features < 1 || d.out_features < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "in_features %lld and out_features %lld must be >= 1", static_cast<long long>(d.in_features), static_cast<long long>(d.out_features));
  if (tokens < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "tokens %lld must be >= 1",
         static_cast<long long>(tokens));
  const int64_t kMax = INT64_C(1) << 31;
  if (d.in_features >= kMax || d.out_features >= kMax || tokens >= kMax)
    fail(LWO_ERR_OUT_OF_RANGE, "tokens %lld x in %lld x out %lld: a dimension is 2^31 or more", static_cast<long long>(tokens), static_cast<long long>(d.in_features),
         static_cast<long long>(d.out_features));
  lwo::Compute::Linear l{d.dtype, (d.flags & LWO_LINEAR_BIAS) != 0,
                         (d.flags & LWO_LINEAR_TF32) != 0, d.in_features, d.out_features,
                         (d.flags & LWO_LINEAR_ACCUMULATE) != 0};
  // A quantized weight [out_features x in_features].
  l.weight_format = static_cast<lwo_quant_format_t>(d.weight_format);
  if (l.weight_format != LWO_QUANT_NONE) {
    if (!lwo::quant::format_name(l.weight_format))
      fail(LWO_ERR_INVALID_ARGUMENT, "weight_format %d is not a quantized format",
           static_cast<int>(d.weight_format));
    try {
      lwo::quant::layout_of(l.weight_format, l.dtype, l.out, l.in);
    } catch (const lwo::Error& e) {
      fail(e.status(), "weight_format %s with out_features %lld, in_features %lld: %s",
           lwo::quant::format_name(l.weight_format), static_cast<long long>(l.out),
           static_cast<long long>(l.in), e.what());
    }
  }
  return l;
}

LWO_API lwo_status_t lwo_linear_forward(lwo_engine* engine, const lwo_linear_desc* desc,
                                        int64_t tokens, const void* x, const void* weight,
                                        const void* bias, void* y, lwo_stream_t stream) {
  return guard("lwo_linear_forward", [&] {
    lwo_engine* e = check_handle(engine);
    lwo::Compute::Linear l = linear_of(desc, tokens);
    need(x, "x");
    need(weight, "weight");
    need(y, "y");
    if (l.bias) need(bias, "bias (the layer has LWO_LINEAR_BIAS)");
    lwo::DeviceScope scope(*e->impl);
    if (e->impl->gpu().compute_on_host())
      return lwo::host_compute::linear_forward(l, tokens, x, weight, bias, y);
    e->impl->compute().linear_forward(l, tokens, x, weight, bias, y, stream);
  });
}

LWO_API lwo_status_t lwo_linear_backward(lwo_engine* engine, const lwo_linear_desc* desc,
                                         int64_t tokens, const void* x, const void* dy,
                                         const void* weight, void* dx, void* dweight,
                                         void* dbias, lwo_dtype_t grad_dtype,
                                         lwo_stream_t stream) {
  return guard("lwo_linear_backward", [&] {
    lwo_engine* e = check_handle(engine);
    lwo::check_dtype_value(grad_dtype, "grad_dtype");
    lwo::Compute::Linear l = linear_of(desc, tokens);
    need(dy, "dy");
    if (dx) need(weight, "weight (needed for dx)");
    if (dweight) need(x, "x (needed for dweight)");
    check_backward_outputs("LWO_LINEAR_BIAS", l.bias, l.dtype, l.weight_format, dx, dweight, dbias,
                           grad_dtype);
    lwo::DeviceScope scope(*e->impl);
    if (e->impl->gpu().compute_on_host())
      return lwo::host_compute::linear_backward(l, tokens, x, dy, weight, dx, dweight, dbias,
                                                grad_dtype);
    e->impl->compute().linear_backward(l, tokens, x, dy, weight, dx, dweight, dbias, grad_dtype, stream);
  });
}

/* ---- 2-D convolutions ---- */

LWO_API void lwo_conv2d_desc_init(lwo_conv2d_desc* d) {
  if (d) *d = lwo_conv2d_desc LWO_CONV2D_DESC_INIT;
}

static lwo::Compute::Conv conv_of(const lwo_conv2d_desc* desc) {
  const lwo_conv2d_desc d = read_desc(desc, lwo_conv2d_desc LWO_CONV2D_DESC_INIT,
                                      LWO_CONV_BIAS | LWO_CONV_TF32 | LWO_CONV_ACCUMULATE);
  if (d.layout != LWO_LAYOUT_NCHW && d.layout != LWO_LAYOUT_NHWC)
    fail(LWO_ERR_INVALID_ARGUMENT, "layout %d is neither NCHW (0) nor NHWC (1)",
         static_cast<int>(d.layout));
  if (d.groups < 1 || d.in_channels < 1 || d.out_channels < 1 || d.in_channels % d.groups ||
      d.out_channels % d.groups)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "in_channels %d and out_channels %d must be >= 1 and multiples of groups %d",
         d.in_channels, d.out_channels, d.groups);
  if (d.kernel_h < 1 || d.kernel_w < 1 || d.stride_h < 1 || d.stride_w < 1 || d.dilation_h < 1 ||
      d.dilation_w < 1 || d.pad_h < 0 || d.pad_w < 0)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "kernel %dx%d, stride %dx%d, dilation %dx%d must be >= 1 and padding %dx%d >= 0",
         d.kernel_h, d.kernel_w, d.stride_h, d.stride_w, d.dilation_h, d.dilation_w, d.pad_h,
         d.pad_w);
  lwo::Compute::Conv cv{d.dtype, (d.flags & LWO_CONV_BIAS) != 0, (d.flags & LWO_CONV_TF32) != 0,
                        d.layout == LWO_LAYOUT_NHWC, d.in_channels, d.out_channels, d.kernel_h,
                        d.kernel_w, d.stride_h, d.stride_w, d.pad_h, d.pad_w, d.dilation_h,
                        d.dilation_w, d.groups, (d.flags & LWO_CONV_ACCUMULATE) != 0};
  // A quantized weight [out_channels x in_channels / groups *
  // kernel_h * kernel_w] (a caller's 0.4 struct, without the field, reads
  // as LWO_QUANT_NONE from the defaults).
  cv.weight_format = static_cast<lwo_quant_format_t>(d.weight_format);
  if (cv.weight_format != LWO_QUANT_NONE) {
    if (!lwo::quant::format_name(cv.weight_format))
      fail(LWO_ERR_INVALID_ARGUMENT, "weight_format %d is not a quantized format",
           static_cast<int>(d.weight_format));
    const int64_t kMaxCols = INT64_C(1) << 31, cols_h = int64_t(cv.c / cv.groups) * cv.kh;
    if (cols_h >= kMaxCols || cols_h * cv.kw >= kMaxCols)  // each factor below 2^31
      fail(LWO_ERR_OUT_OF_RANGE,
           "weight_format %s with in_channels %d / groups %d x kernel %dx%d: the weight's cols "
           "(their product) must be below 2^31",
           lwo::quant::format_name(cv.weight_format), cv.c, cv.groups, cv.kh, cv.kw);
    try {
      lwo::quant::layout_of(cv.weight_format, cv.dtype, cv.k, cv.weight_cols());
    } catch (const lwo::Error& e) {
      fail(e.status(),
           "weight_format %s with out_channels %d and %lld cols (in_channels %d / groups %d x "
           "kernel %dx%d): %s",
           lwo::quant::format_name(cv.weight_format), cv.k,
           static_cast<long long>(cv.weight_cols()), cv.c, cv.groups, cv.kh, cv.kw, e.what());
    }
  }
  return cv;
}

static void check_image(int32_t n, int32_t h, int32_t w) {
  if (n < 1 || h < 1 || w < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "batch %d of %dx%d images: every size must be >= 1",
         n, h, w);
}

// The checked descriptor of a convolution over n images of h x w whose kernel
// fits the padded input.
static lwo::Compute::Conv conv_over(const lwo_conv2d_desc* desc, int32_t n, int32_t h,
                                    int32_t w) {
  lwo::Compute::Conv cv = conv_of(desc);
  check_image(n, h, w);
  int32_t oh = 0, ow = 0;
  lwo::Compute::conv_out_size(cv, h, w, &oh, &ow);
  return cv;
}

LWO_API lwo_status_t lwo_conv2d_output_size(const lwo_conv2d_desc* desc, int32_t h, int32_t w,
                                            int32_t* out_h, int32_t* out_w) {
  return guard("lwo_conv2d_output_size", [&] {
    lwo::Compute::Conv cv = conv_of(desc);
    need(out_h, "out_h");
    need(out_w, "out_w");
    check_image(1, h, w);
    lwo::Compute::conv_out_size(cv, h, w, out_h, out_w);
  });
}

LWO_API lwo_status_t lwo_conv2d_forward(lwo_engine* engine, const lwo_conv2d_desc* desc,
                                        int32_t n, int32_t h, int32_t w, const void* x,
                                        const void* weight, const void* bias, void* y,
                                        lwo_stream_t stream) {
  return guard("lwo_conv2d_forward", [&] {
    lwo_engine* e = check_handle(engine);
    lwo::Compute::Conv cv = conv_over(desc, n, h, w);
    need(x, "x");
    need(weight, "weight");
    need(y, "y");
    if (cv.bias) need(bias, "bias (the layer has LWO_CONV_BIAS)");
    lwo::DeviceScope scope(*e->impl);
    if (e->impl->gpu().compute_on_host())
      return lwo::host_compute::conv_forward(cv, n, h, w, x, weight, bias, y);
    e->impl->compute().conv_forward(cv, n, h, w, x, weight, bias, y, stream);
  });
}

LWO_API lwo_status_t lwo_conv2d_backward(lwo_engine* engine, const lwo_conv2d_desc* desc,
                                         int32_t n, int32_t h, int32_t w, const void* x,
                                         const void* dy, const void* weight, void* dx,
                                         void* dweight, void* dbias, lwo_dtype_t grad_dtype,
                                         lwo_stream_t stream) {
  return guard("lwo_conv2d_backward", [&] {
    lwo_engine* e = check_handle(engine);
    lwo::check_dtype_value(grad_dtype, "grad_dtype");
    lwo::Compute::Conv cv = conv_over(desc, n, h, w);
    need(dy, "dy");
    if (dx) need(weight, "weight (needed for dx)");
    if (dweight) need(x, "x (needed for dweight)");
    check_backward_outputs("LWO_CONV_BIAS", cv.bias, cv.dtype, cv.weight_format, dx, dweight,
                           dbias, grad_dtype);
    lwo::DeviceScope scope(*e->impl);
    if (e->impl->gpu().compute_on_host())
      return lwo::host_compute::conv_backward(cv, n, h, w, x, dy, weight, dx, dweight, dbias,
                                              grad_dtype);
    e->impl->compute().conv_backward(cv, n, h, w, x, dy, weight, dx, dweight, dbias, grad_dtype, stream);
  });
}

}  // extern "C"
