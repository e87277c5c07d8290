// Layer compute on the caller's stream: linear layers through cuBLASLt, with
// an algorithm chosen once per shape and cached, and a workspace per stream.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "lwo.h"

namespace lwo {

class Compute {
 public:
  // tune: time the heuristic's first candidates of each GEMM shape on first
  // use and keep the fastest; else take its first.
  Compute(int device, bool tune);
  ~Compute();
  Compute(const Compute&) = delete;
  Compute& operator=(const Compute&) = delete;

  // ---- device memory budget ----
  // Workspaces are charged to the engine's budget through these: `charge`
  // returns the bytes charged for one allocation of its argument (or throws
  // LWO_ERR_OVER_BUDGET), `uncharge` gives them back. Set once, before use.
  struct MemoryHooks {
    std::function<uint64_t(uint64_t)> charge;
    std::function<void(uint64_t)> uncharge;
  };
  void set_memory_hooks(MemoryHooks hooks) { hooks_ = std::move(hooks); }

  struct Linear {
    lwo_dtype_t dtype;
    bool bias;
    bool tf32;
    int64_t in, out;
    bool accumulate = false;  // backward adds into dw and db
    // W is a quantized tensor of this format ([out, in] as
    // src/quant lays it out), dequantized into the stream's weight workspace
    // before the GEMM. Backward then computes dx only.
    lwo_quant_format_t weight_format = LWO_QUANT_NONE;
  };

  // y[T,out] = x[T,in] * W[out,in]^T (+ b[out]); all row-major, dtype `l.dtype`.
  void linear_forward(const Linear& l, int64_t tokens, const void* x, const void* w,
                      const void* b, void* y, void* stream);
  // dx = dy * W (if dx); dW = dy^T * x and db = sum over tokens of dy (if dw / db),
  // in grad_dtype (F32 or l.dtype).
  void linear_backward(const Linear& l, int64_t tokens, const void* x, const void* dy,
                       const void* w, void* dx, void* dw, void* db, lwo_dtype_t grad_dtype,
                       void* stream);

  struct Conv {
    lwo_dtype_t dtype;
    bool bias, tf32, nhwc;
    int32_t c, k, kh, kw, sh, sw, ph, pw, dh, dw, groups;
    bool accumulate = false;  // backward adds into dwt and db
    // W is a quantized tensor of this format, [k, c/groups *
    // kh * kw] (rows x cols, the layout's weight with its inner dimensions
    // flattened, as src/quant lays it out), dequantized into the stream's
    // weight workspace before the cuDNN call. Backward then computes dx only.
    lwo_quant_format_t weight_format = LWO_QUANT_NONE;
    int64_t weight_cols() const { return int64_t(c / groups) * kh * kw; }
  };
  void conv_forward(const Conv& cv, int32_t n, int32_t h, int32_t w, const void* x,
                    const void* wt, const void* b, void* y, void* stream);
  void conv_backward(const Conv& cv, int32_t n, int32_t h, int32_t w, const void* x,
                     const void* dy, const void* wt, void* dx, void* dwt, void* db,
                     lwo_dtype_t grad_dtype, void* stream);
  static void conv_out_size(const Conv& cv, int32_t h, int32_t w, int32_t* oh, int32_t* ow);

  // Number of cached algorithms, of GEMMs that took the fallback kernel, and
  // of shapes whose algorithm was chosen by timing.
  size_t n_cached() const;
  uint64_t n_fallback() const { return n_fallback_; }
  uint64_t n_tuned() const { return n_tuned_; }

 private:
  // D[m,n] (column-major, ldd) = op(A) * op(B) (+ bias[m] per row) (+ D with
  // accumulate)
  struct Gemm {
    bool ta, tb;
    int64_t m, n, k, lda, ldb, ldd;
    lwo_dtype_t ab, d;
    bool tf32;
  };
  void gemm(const Gemm& g, const void* a, const void* b, void* d, const void* bias, void* stream,
            bool accumulate = false);
  void gemm_locked(const Gemm& g, const void* a, const void* b, void* d, const void* bias,
                   void* stream, bool accumulate);  // callers hold mu_
  // Quantized weights (of linears and convolutions): enqueues the
  // dequantization of w, a [rows x cols] tensor of `format`, into the
  // stream's weight workspace in `dtype` (callers hold mu_) and returns the
  // workspace.
  const void* dequantized_weight(lwo_quant_format_t format, lwo_dtype_t dtype, int64_t rows,
                                 int64_t cols, const void* w, void* stream);
  // Times candidates [0, n) on the call's operands; the index of the fastest.
  int tune(void* op, void* la, void* lb, void* ld, const void* algos, int n, const void* a,
           const void* b, void* d, void* stream);
  // The stream's workspace, grown to at least `bytes` (callers hold mu_).
  void* workspace(void* stream, size_t bytes);
  void* weight_workspace(void* stream, size_t bytes);
  void* cudnn();  // the cuDNN handle, made on first use (callers hold mu_)
  void destroy_cudnn() noexcept;

  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                         int, int, int, int, int, int>;
  // Everything one GEMM shape needs, made once: the algorithm and the
  // cuBLASLt descriptors (opaque here; owned, destroyed with the Compute).
  struct Algo {
    bool ok;
    unsigned char data[64];  // cublasLtMatmulAlgo_t
    void* op;                // cublasLtMatmulDesc_t
    void* a;                 // cublasLtMatrixLayout_t of A, B and D
    void* b;
    void* d;
  };

  int device_;
  void* lt_ = nullptr;  // cublasLtHandle_t
  mutable std::mutex mu_;
  struct Workspace {
    void* ptr;
    size_t bytes;
    uint64_t charged = 0;  // to the engine's budget
  };
  MemoryHooks hooks_;
  void uncharge(uint64_t charged) noexcept {
    if (charged && hooks_.uncharge) hooks_.uncharge(charged);
  }
  // The buffer of `m` for `stream`, at least `bytes`: grown (the stream
  // waited for, the old one freed) and charged to the budget; `what` names it.
  void* grow(std::unordered_map<void*, Workspace>& m, void* stream, size_t bytes, const char* what);
  std::unordered_map<void*, Workspace> workspaces_;  // per stream
  // Dequantized weights of quantized linears and convolutions, per stream.
  std::unordered_map<void*, Workspace> weight_workspaces_;
  void* cudnn_ = nullptr;                            // cudnnHandle_t
  // Convolution algorithms by (direction, shape...): algorithm, workspace bytes.
  std::map<std::vector<int64_t>, std::pair<int, size_t>> conv_algos_;
  std::map<Key, Algo> algos_;
  uint64_t n_fallback_ = 0;
  uint64_t n_tuned_ = 0;
  bool tune_;
};

}  // namespace lwo
