#include "compute.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <cstring>

#include "kernels/compute_kernels.h"
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/compute/dequantize.h"
#include "src/quant/quant.h"

namespace lwo {
namespace {

const char* status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "error";
  }
}

constexpr size_t kWorkspaceBytes = size_t(32) << 20;
static_assert(sizeof(cublasLtMatmulAlgo_t) <= 64, "algo storage");

#define LWO_LT(call, what)                                                              \
  do {                                                                                  \
    cublasStatus_t st_ = (call);                                                        \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                   \
      fail(LWO_ERR_CUBLAS, "%s: cuBLASLt status %s (%d)", what, status_name(st_),       \
           static_cast<int>(st_));                                                      \
  } while (0)

#define LWO_RT(call, what)                                                              \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      (void)cudaGetLastError();                                                         \
      fail(e_ == cudaErrorMemoryAllocation ? LWO_ERR_OUT_OF_MEMORY : LWO_ERR_CUDA,      \
           "%s: %s", what, cudaGetErrorString(e_));                                     \
    }                                                                                   \
  } while (0)

cudaDataType_t cuda_type(lwo_dtype_t d) {
  switch (d) {
    case LWO_DTYPE_F32: return CUDA_R_32F;
    case LWO_DTYPE_BF16: return CUDA_R_16BF;
    case LWO_DTYPE_F16: return CUDA_R_16F;
    default: fail(LWO_ERR_UNSUPPORTED, "compute: dtype %d", static_cast<int>(d));
  }
}

int alignment(const void* p) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int al = 1;
  while (al < 256 && (a & static_cast<uintptr_t>(al)) == 0) al <<= 1;
  return al;
}

// RAII for the cuBLASLt descriptors of one call.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

Compute::Compute(int device, bool tune) : device_(device), tune_(tune) {
  cublasLtHandle_t h = nullptr;
  LWO_LT(cublasLtCreate(&h), "cublasLtCreate");
  lt_ = h;
}

Compute::~Compute() {
  // The streams that used the workspaces belong to callers and may be gone:
  // wait for the whole device instead.
  int prev = 0;
  if (cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess) {
    (void)cudaDeviceSynchronize();
    for (auto* m : {&workspaces_, &weight_workspaces_})
      for (auto& kv : *m) {
        (void)cudaFree(kv.second.ptr);
        uncharge(kv.second.charged);
      }
    (void)cudaSetDevice(prev);
  }
  for (auto& kv : algos_) {
    Algo& p = kv.second;
    if (p.d) cublasLtMatrixLayoutDestroy(static_cast<cublasLtMatrixLayout_t>(p.d));
    if (p.b) cublasLtMatrixLayoutDestroy(static_cast<cublasLtMatrixLayout_t>(p.b));
    if (p.a) cublasLtMatrixLayoutDestroy(static_cast<cublasLtMatrixLayout_t>(p.a));
    if (p.op) cublasLtMatmulDescDestroy(static_cast<cublasLtMatmulDesc_t>(p.op));
  }
  if (lt_) cublasLtDestroy(static_cast<cublasLtHandle_t>(lt_));
  destroy_cudnn();
}

size_t Compute::n_cached() const {
  std::lock_guard<std::mutex> lock(mu_);
  return algos_.size();
}

void* Compute::grow(std::unordered_map<void*, Workspace>& m, void* stream, size_t bytes, const char* what) {
  // One buffer per stream: work on different streams may run at once.
  auto it = m.find(stream);
  if (it != m.end() && it->second.bytes >= bytes) return it->second.ptr;
  if (it != m.end()) {  // grow: the old one may still be in use on its stream
    const std::string growing = std::string("compute: growing a ") + what;
    LWO_RT(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), growing.c_str());
    LWO_RT(cudaFree(it->second.ptr), growing.c_str());
    uncharge(it->second.charged);
    m.erase(it);
  }
  uint64_t charged = hooks_.charge ? hooks_.charge(bytes) : 0;  // throws over budget
  void* p = nullptr;
  try {
    LWO_RT(cudaMalloc(&p, bytes), (std::string("compute: ") + what).c_str());
  } catch (...) {
    uncharge(charged);
    throw;
  }
  m[stream] = Workspace{p, bytes, charged};
  return p;
}

void* Compute::workspace(void* stream, size_t bytes) {
  return grow(workspaces_, stream, std::max(bytes, kWorkspaceBytes), "workspace");
}

void* Compute::weight_workspace(void* stream, size_t bytes) {
  // Grown when a larger weight comes, in steps of 2 MiB.
  const size_t step = size_t(2) << 20;
  return grow(weight_workspaces_, stream, (bytes + step - 1) / step * step, "weight workspace");
}

const void* Compute::dequantized_weight(lwo_quant_format_t format, lwo_dtype_t dtype, int64_t rows,
                                        int64_t cols, const void* w, void* stream) {
  const quant::Layout q = quant::layout_of(format, dtype, rows, cols);
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(cols) * dtype_size(dtype);
  void* ws = weight_workspace(stream, bytes);
  dequantize_on_device(q, w, ws, dtype, static_cast<lwo_stream_t>(stream));
  return ws;
}

// Candidates the first call of a shape times (LWO_ENGINE_HEURISTIC_GEMM: 1).
constexpr int kCandidates = 8;

int Compute::tune(void* op_, void* la_, void* lb_, void* ld_, const void* cands, int n,
                  const void* a, const void* b, void* d, void* stream_) {
  auto op = static_cast<cublasLtMatmulDesc_t>(op_);
  auto la = static_cast<cublasLtMatrixLayout_t>(la_), lb = static_cast<cublasLtMatrixLayout_t>(lb_),
       ld = static_cast<cublasLtMatrixLayout_t>(ld_);
  auto res = static_cast<const cublasLtMatmulHeuristicResult_t*>(cands);
  auto stream = static_cast<cudaStream_t>(stream_);
  auto lt = static_cast<cublasLtHandle_t>(lt_);
  void* ws = workspace(stream_, kWorkspaceBytes);
  cudaEvent_t ev[2] = {nullptr, nullptr};
  struct Events {  // destroyed on every path out
    cudaEvent_t* e;
    ~Events() {
      for (int i = 0; i < 2; ++i)
        if (e[i]) (void)cudaEventDestroy(e[i]);
    }
  } guard{ev};
  LWO_RT(cudaEventCreate(&ev[0]), "compute: timing GEMM candidates");
  LWO_RT(cudaEventCreate(&ev[1]), "compute: timing GEMM candidates");
  const float alpha = 1.f, beta = 0.f;
  constexpr int kRuns = 3;
  float first_ms = -1.f, best_ms = 0.f;
  int best = 0;
  for (int i = 0; i < n; ++i) {
    // One untimed run (it also tells whether the candidate runs here at all),
    // then kRuns timed ones. D is written; the caller's call overwrites it.
    if (cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &res[i].algo, ws,
                       kWorkspaceBytes, stream) != CUBLAS_STATUS_SUCCESS)
      continue;
    LWO_RT(cudaEventRecord(ev[0], stream), "compute: timing GEMM candidates");
    for (int r = 0; r < kRuns; ++r)
      LWO_LT(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &res[i].algo, ws,
                            kWorkspaceBytes, stream),
             "cublasLtMatmul (timing a candidate)");
    LWO_RT(cudaEventRecord(ev[1], stream), "compute: timing GEMM candidates");
    LWO_RT(cudaEventSynchronize(ev[1]), "compute: timing GEMM candidates");
    float ms = 0.f;
    LWO_RT(cudaEventElapsedTime(&ms, ev[0], ev[1]), "compute: timing GEMM candidates");
    if (i == 0) first_ms = ms;
    if (i == 0 || ms < best_ms) {
      best_ms = ms;
      best = i;
    }
  }
  // Keep the heuristic's first unless another is clearly faster: a choice
  // that timing noise alone would flip is not worth the variation.
  if (first_ms > 0.f && best_ms > 0.98f * first_ms) best = 0;
  ++n_tuned_;
  return best;
}

void Compute::gemm(const Gemm& g, const void* a, const void* b, void* d, const void* bias,
                   void* stream, bool accumulate) {
  std::lock_guard<std::mutex> lock(mu_);
  gemm_locked(g, a, b, d, bias, stream, accumulate);
}

void Compute::gemm_locked(const Gemm& g, const void* a, const void* b, void* d, const void* bias,
                          void* stream, bool accumulate) {
  bool use_bias_epilogue = bias && alignment(bias) >= 16;
  Key key{g.ta, g.tb, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, g.ab, g.d, g.tf32, use_bias_epilogue,
          alignment(a), alignment(b), alignment(d), use_bias_epilogue ? alignment(bias) : 0};
  auto it = algos_.find(key);
  if (it == algos_.end()) {
    Descs ds;
    cublasComputeType_t ct =
        (g.ab == LWO_DTYPE_F32 && g.tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    LWO_LT(cublasLtMatmulDescCreate(&ds.op, ct, CUDA_R_32F), "cublasLtMatmulDescCreate");
    cublasOperation_t ta = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    LWO_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "TRANSA");
    LWO_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "TRANSB");
    if (use_bias_epilogue) {
      cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
      cudaDataType_t bt = cuda_type(g.ab);
      LWO_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep), "EPILOGUE");
      LWO_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias), "BIAS_POINTER");
      LWO_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt), "BIAS_DATA_TYPE");
    }
    // Stored column-major: op(A) is m x k, op(B) is k x n.
    LWO_LT(cublasLtMatrixLayoutCreate(&ds.a, cuda_type(g.ab), g.ta ? g.k : g.m, g.ta ? g.m : g.k, g.lda), "layout A");
    LWO_LT(cublasLtMatrixLayoutCreate(&ds.b, cuda_type(g.ab), g.tb ? g.n : g.k, g.tb ? g.k : g.n, g.ldb), "layout B");
    LWO_LT(cublasLtMatrixLayoutCreate(&ds.d, cuda_type(g.d), g.m, g.n, g.ldd), "layout D");
    LWO_LT(cublasLtMatmulPreferenceCreate(&ds.pref), "cublasLtMatmulPreferenceCreate");
    uint64_t ws = kWorkspaceBytes;
    uint32_t al[4] = {static_cast<uint32_t>(std::get<12>(key)), static_cast<uint32_t>(std::get<13>(key)),
                      static_cast<uint32_t>(std::get<14>(key)), static_cast<uint32_t>(std::get<14>(key))};
    LWO_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws), "pref workspace");
    // No split-K reductions: results stay deterministic (a streamed layer
    // equals its resident twin bit for bit) whatever the algorithm.
    uint32_t red = CUBLASLT_REDUCTION_SCHEME_NONE;
    LWO_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &red, sizeof red), "pref reduction");
    LWO_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], 4), "pref align A");
    LWO_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], 4), "pref align B");
    LWO_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], 4), "pref align C");
    LWO_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[3], 4), "pref align D");
    cublasLtMatmulHeuristicResult_t res[kCandidates] = {};
    int n_res = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(lt_), ds.op, ds.a,
                                                       ds.b, ds.d, ds.d, ds.pref,
                                                       tune_ ? kCandidates : 1, res, &n_res);
    Algo algo{};
    algo.ok = (st == CUBLAS_STATUS_SUCCESS && n_res > 0 && res[0].state == CUBLAS_STATUS_SUCCESS);
    if (algo.ok) {
      int pick = 0;
      if (tune_ && n_res > 1 && !accumulate) {
        // Timed on this call's operands (beta 0: a call that accumulates
        // would have its D changed, so its shape takes the first candidate
        // unless a plain call of the same shape came first).
        if (use_bias_epilogue)
          LWO_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof bias),
                 "BIAS_POINTER");
        pick = tune(ds.op, ds.a, ds.b, ds.d, res, n_res, a, b, d, stream);
      }
      std::memcpy(algo.data, &res[pick].algo, sizeof res[pick].algo);
      // The plan keeps the descriptors; Descs no longer owns them.
      algo.op = ds.op;
      algo.a = ds.a;
      algo.b = ds.b;
      algo.d = ds.d;
      ds.op = nullptr;
      ds.a = ds.b = ds.d = nullptr;
    }
    it = algos_.emplace(key, algo).first;
  }
  const Algo& plan = it->second;
  if (!plan.ok || (bias && !use_bias_epilogue)) {
    // No cuBLASLt algorithm for this shape and alignment, or a bias too poorly
    // aligned for the epilogue: the plain kernel, correct for any shape.
    ++n_fallback_;
    detail::gemm_fallback(g.ta, g.tb, g.m, g.n, g.k, a, g.lda, b, g.ldb, d, g.ldd, bias, g.ab,
                          g.d, accumulate, stream);
    return;
  }
  auto op = static_cast<cublasLtMatmulDesc_t>(plan.op);
  if (use_bias_epilogue)
    LWO_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
           "BIAS_POINTER");
  cublasLtMatmulAlgo_t algo;
  std::memcpy(&algo, plan.data, sizeof algo);
  auto la = static_cast<cublasLtMatrixLayout_t>(plan.a), lb = static_cast<cublasLtMatrixLayout_t>(plan.b),
       ld = static_cast<cublasLtMatrixLayout_t>(plan.d);
  float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  void* ws = workspace(stream, kWorkspaceBytes);
  LWO_LT(cublasLtMatmul(static_cast<cublasLtHandle_t>(lt_), op, &alpha, a, la, b, lb, &beta, d, ld,
                        d, ld, &algo, ws, kWorkspaceBytes, static_cast<cudaStream_t>(stream)),
         "cublasLtMatmul");
}

void Compute::linear_forward(const Linear& l, int64_t tokens, const void* x, const void* w,
                             const void* b, void* y, void* stream) {
  // Column-major views: X' = x (in x T), W' = W (in x out), Y' = y (out x T).
  // Y' = W'^T X'.
  Gemm g{true, false, l.out, tokens, l.in, l.in, l.in, l.out, l.dtype, l.dtype, l.tf32};
  if (l.weight_format != LWO_QUANT_NONE) {
    // The dequantization and the GEMM under one lock, so that no other call
    // on this stream grows (frees) the workspace between them.
    std::lock_guard<std::mutex> lock(mu_);
    const void* wd = dequantized_weight(l.weight_format, l.dtype, l.out, l.in, w, stream);
    gemm_locked(g, wd, x, y, l.bias ? b : nullptr, stream, false);
    return;
  }
  gemm(g, w, x, y, l.bias ? b : nullptr, stream);
}

void Compute::linear_backward(const Linear& l, int64_t tokens, const void* x, const void* dy,
                              const void* w, void* dx, void* dw, void* db,
                              lwo_dtype_t grad_dtype, void* stream) {
  // Weight gradients first, so their copy to host can start while dx runs.
  if (dw) {  // dW' (in x out) = X' (in x T) dY'^T (T x out)
    Gemm g{false, true, l.in, l.out, tokens, l.in, l.out, l.in, l.dtype, grad_dtype, l.tf32};
    gemm(g, x, dy, dw, nullptr, stream, l.accumulate);
  }
  if (db) detail::bias_grad(dy, tokens, l.out, l.dtype, db, grad_dtype, l.accumulate, stream);
  if (dx) {  // dX' (in x T) = W' (in x out) dY' (out x T)
    Gemm g{false, false, l.in, tokens, l.out, l.in, l.out, l.in, l.dtype, l.dtype, l.tf32};
    if (l.weight_format != LWO_QUANT_NONE) {  // W is not read by dw, db
      std::lock_guard<std::mutex> lock(mu_);
      const void* wd = dequantized_weight(l.weight_format, l.dtype, l.out, l.in, w, stream);
      gemm_locked(g, wd, dy, dx, nullptr, stream, false);
      return;
    }
    gemm(g, w, dy, dx, nullptr, stream);
  }
}

}  // namespace lwo
