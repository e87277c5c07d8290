// 2-D convolutions through cuDNN's convolution API: descriptors per call,
// algorithms chosen once per shape by cuDNN's heuristics (deterministic ones,
// within the workspace limit) and cached; bias add and bias gradient by our
// own kernels; weight gradients converted to f32 where asked; quantized
// weights dequantized into the stream's weight workspace first.
#include <cudnn.h>

#include <algorithm>
#include <cstdint>

#include "kernels/compute_kernels.h"
#include "src/common/error.h"
#include "compute.h"

namespace lwo {
namespace {

constexpr size_t kMaxConvWorkspace = size_t(1) << 30;

#define LWO_DNN(call, what)                                                        \
  do {                                                                             \
    cudnnStatus_t st_ = (call);                                                    \
    if (st_ != CUDNN_STATUS_SUCCESS)                                               \
      fail(LWO_ERR_CUDNN, "%s: %s", what, cudnnGetErrorString(st_));               \
  } while (0)

cudnnDataType_t dnn_type(lwo_dtype_t d) {
  switch (d) {
    case LWO_DTYPE_F32: return CUDNN_DATA_FLOAT;
    case LWO_DTYPE_BF16: return CUDNN_DATA_BFLOAT16;
    case LWO_DTYPE_F16: return CUDNN_DATA_HALF;
    default: fail(LWO_ERR_UNSUPPORTED, "conv2d: dtype %d", static_cast<int>(d));
  }
}

// The descriptors of one convolution shape.
struct ConvDescs {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  int32_t oh = 0, ow = 0;
  ConvDescs(const Compute::Conv& cv, int32_t n, int32_t h, int32_t wd) {
    cudnnTensorFormat_t fmt = cv.nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
    cudnnDataType_t dt = dnn_type(cv.dtype);
    LWO_DNN(cudnnCreateTensorDescriptor(&x), "cudnnCreateTensorDescriptor");
    LWO_DNN(cudnnCreateTensorDescriptor(&y), "cudnnCreateTensorDescriptor");
    LWO_DNN(cudnnCreateFilterDescriptor(&w), "cudnnCreateFilterDescriptor");
    LWO_DNN(cudnnCreateConvolutionDescriptor(&conv), "cudnnCreateConvolutionDescriptor");
    LWO_DNN(cudnnSetTensor4dDescriptor(x, fmt, dt, n, cv.c, h, wd), "conv2d: input descriptor");
    LWO_DNN(cudnnSetFilter4dDescriptor(w, dt, fmt, cv.k, cv.c / cv.groups, cv.kh, cv.kw),
            "conv2d: filter descriptor");
    LWO_DNN(cudnnSetConvolution2dDescriptor(conv, cv.ph, cv.pw, cv.sh, cv.sw, cv.dh, cv.dw,
                                            CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
            "conv2d: convolution descriptor");
    LWO_DNN(cudnnSetConvolutionGroupCount(conv, cv.groups), "conv2d: group count");
    cudnnMathType_t math = cv.dtype == LWO_DTYPE_F32
                               ? (cv.tf32 ? CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION : CUDNN_FMA_MATH)
                               : CUDNN_TENSOR_OP_MATH;
    LWO_DNN(cudnnSetConvolutionMathType(conv, math), "conv2d: math type");
    Compute::conv_out_size(cv, h, wd, &oh, &ow);
    LWO_DNN(cudnnSetTensor4dDescriptor(y, fmt, dt, n, cv.k, oh, ow), "conv2d: output descriptor");
  }
  ~ConvDescs() {
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
  }
  ConvDescs(const ConvDescs&) = delete;
  ConvDescs& operator=(const ConvDescs&) = delete;
};

std::vector<int64_t> conv_key(int dir, const Compute::Conv& cv, int32_t n, int32_t h, int32_t w) {
  return {dir, cv.dtype, cv.tf32, cv.nhwc, cv.c, cv.k, cv.kh, cv.kw, cv.sh, cv.sw, cv.ph, cv.pw,
          cv.dh, cv.dw, cv.groups, n, h, w};
}

// Picks the first deterministic algorithm the heuristics rank as working
// within the workspace limit.
template <class Perf>
std::pair<int, size_t> pick(const Perf* perf, int n, const char* what) {
  for (int i = 0; i < n; ++i)
    if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].determinism == CUDNN_DETERMINISTIC &&
        perf[i].memory <= kMaxConvWorkspace)
      return {static_cast<int>(perf[i].algo), perf[i].memory};
  fail(LWO_ERR_UNSUPPORTED, "%s: cuDNN offers no deterministic algorithm for this shape", what);
}

// The algorithm cached for `key` in `cache`, chosen on first use from the N
// candidates `heuristic(perf, &got)` ranks.
template <class Perf, int N, class F>
std::pair<int, size_t> cached_algo(std::map<std::vector<int64_t>, std::pair<int, size_t>>& cache,
                                   const std::vector<int64_t>& key, const char* what,
                                   F&& heuristic) {
  auto it = cache.find(key);
  if (it == cache.end()) {
    Perf perf[N];
    int got = 0;
    heuristic(perf, &got);
    it = cache.emplace(key, pick(perf, got, what)).first;
  }
  return it->second;
}

}  // namespace

void Compute::conv_out_size(const Conv& cv, int32_t h, int32_t w, int32_t* oh, int32_t* ow) {
  int64_t eh = int64_t(cv.dh) * (cv.kh - 1) + 1, ew = int64_t(cv.dw) * (cv.kw - 1) + 1;
  int64_t ph = int64_t(h) + 2 * int64_t(cv.ph), pw = int64_t(w) + 2 * int64_t(cv.pw);
  if (ph < eh || pw < ew)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "conv2d: the %lldx%lld dilated kernel does not fit the %lldx%lld padded input",
         static_cast<long long>(eh), static_cast<long long>(ew), static_cast<long long>(ph),
         static_cast<long long>(pw));
  int64_t o_h = (ph - eh) / cv.sh + 1, o_w = (pw - ew) / cv.sw + 1;
  if (o_h > INT32_MAX || o_w > INT32_MAX)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "conv2d: the output of %lldx%lld does not fit in 32 bits (input %dx%d, padding %dx%d, "
         "kernel %dx%d, stride %dx%d, dilation %dx%d)",
         static_cast<long long>(o_h), static_cast<long long>(o_w), h, w, cv.ph, cv.pw, cv.kh,
         cv.kw, cv.sh, cv.sw, cv.dh, cv.dw);
  *oh = static_cast<int32_t>(o_h);
  *ow = static_cast<int32_t>(o_w);
}

void* Compute::cudnn() {
  if (!cudnn_) {
    cudnnHandle_t h = nullptr;
    LWO_DNN(cudnnCreate(&h), "cudnnCreate");
    cudnn_ = h;
  }
  return cudnn_;
}

void Compute::destroy_cudnn() noexcept {
  if (cudnn_) cudnnDestroy(static_cast<cudnnHandle_t>(cudnn_));
  cudnn_ = nullptr;
}

void Compute::conv_forward(const Conv& cv, int32_t n, int32_t h, int32_t w, const void* x,
                           const void* wt, const void* b, void* y, void* stream) {
  // The dequantization and the convolution under one lock, so that no other
  // call on this stream grows (frees) the weight workspace between them.
  std::lock_guard<std::mutex> lock(mu_);
  cudnnHandle_t dnn = static_cast<cudnnHandle_t>(cudnn());
  ConvDescs d(cv, n, h, w);
  LWO_DNN(cudnnSetStream(dnn, static_cast<cudaStream_t>(stream)), "cudnnSetStream");
  if (cv.weight_format != LWO_QUANT_NONE)
    wt = dequantized_weight(cv.weight_format, cv.dtype, cv.k, cv.weight_cols(), wt, stream);
  const auto algo =
      cached_algo<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT>(
          conv_algos_, conv_key(0, cv, n, h, w), "forward", [&](auto* perf, int* got) {
            LWO_DNN(cudnnGetConvolutionForwardAlgorithm_v7(
                        dnn, d.x, d.w, d.conv, d.y, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, got, perf),
                    "conv2d forward: algorithm heuristics");
          });
  void* ws = workspace(stream, algo.second);
  float alpha = 1.f, beta = 0.f;
  LWO_DNN(cudnnConvolutionForward(dnn, &alpha, d.x, x, d.w, wt, d.conv,
                                  static_cast<cudnnConvolutionFwdAlgo_t>(algo.first), ws,
                                  algo.second, &beta, d.y, y),
          "cudnnConvolutionForward");
  if (cv.bias) {
    int64_t outer = cv.nhwc ? int64_t(n) * d.oh * d.ow : n;
    int64_t inner = cv.nhwc ? 1 : int64_t(d.oh) * d.ow;
    detail::channel_bias_add(y, b, outer, cv.k, inner, cv.dtype, stream);
  }
}

void Compute::conv_backward(const Conv& cv, int32_t n, int32_t h, int32_t w, const void* x,
                            const void* dy, const void* wt, void* dx, void* dwt, void* db,
                            lwo_dtype_t grad_dtype, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  cudnnHandle_t dnn = static_cast<cudnnHandle_t>(cudnn());
  ConvDescs d(cv, n, h, w);
  LWO_DNN(cudnnSetStream(dnn, static_cast<cudaStream_t>(stream)), "cudnnSetStream");
  float alpha = 1.f, beta = 0.f;
  if (dwt) {  // weight gradients first, so their copy to host can start early
    const auto algo =
        cached_algo<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>(
            conv_algos_, conv_key(1, cv, n, h, w), "backward filter", [&](auto* perf, int* got) {
              LWO_DNN(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                          dnn, d.x, d.y, d.conv, d.w, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, got,
                          perf),
                      "conv2d backward filter: algorithm heuristics");
            });
    // cuDNN writes the gradient in the layer's dtype; an f32 gradient of a
    // bf16/f16 layer goes through a temporary after the workspace.
    bool convert = grad_dtype != cv.dtype;
    // Accumulating: cuDNN adds (beta 1) into a gradient of the layer's dtype;
    // an f32 one takes the temporary, widened and added.
    const float beta_w = (cv.accumulate && !convert) ? 1.f : 0.f;
    int64_t n_w = int64_t(cv.k) * (cv.c / cv.groups) * cv.kh * cv.kw;
    size_t ws_bytes = (algo.second + 255) / 256 * 256;
    size_t tmp_bytes = convert ? size_t(n_w) * 4 : 0;  // at most f32-sized
    uint8_t* ws = static_cast<uint8_t*>(workspace(stream, ws_bytes + tmp_bytes));
    void* target = convert ? ws + ws_bytes : dwt;
    LWO_DNN(cudnnConvolutionBackwardFilter(
                dnn, &alpha, d.x, x, d.y, dy, d.conv,
                static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo.first), ws,
                algo.second, &beta_w, d.w, target),
            "cudnnConvolutionBackwardFilter");
    if (convert) detail::convert(target, cv.dtype, dwt, grad_dtype, n_w, cv.accumulate, stream);
  }
  if (db) {
    int64_t outer = cv.nhwc ? int64_t(n) * d.oh * d.ow : n;
    int64_t inner = cv.nhwc ? 1 : int64_t(d.oh) * d.ow;
    detail::channel_sum(dy, outer, cv.k, inner, cv.dtype, db, grad_dtype, cv.accumulate, stream);
  }
  if (dx) {
    if (cv.weight_format != LWO_QUANT_NONE)  // W is not read by dwt, db
      wt = dequantized_weight(cv.weight_format, cv.dtype, cv.k, cv.weight_cols(), wt, stream);
    const auto algo =
        cached_algo<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT>(
            conv_algos_, conv_key(2, cv, n, h, w), "backward data", [&](auto* perf, int* got) {
              LWO_DNN(cudnnGetConvolutionBackwardDataAlgorithm_v7(
                          dnn, d.w, d.y, d.conv, d.x, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, got,
                          perf),
                      "conv2d backward data: algorithm heuristics");
            });
    void* ws = workspace(stream, algo.second);
    LWO_DNN(cudnnConvolutionBackwardData(
                dnn, &alpha, d.w, wt, d.y, dy, d.conv,
                static_cast<cudnnConvolutionBwdDataAlgo_t>(algo.first), ws,
                algo.second, &beta, d.x, dx),
            "cudnnConvolutionBackwardData");
  }
}

}  // namespace lwo
