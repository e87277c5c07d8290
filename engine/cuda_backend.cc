// Backend over the CUDA runtime. The only file of the engine that calls CUDA.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>

#include "backend.h"
#include "comm.h"
#include "src/common/error.h"

// The CUDA architectures the library's kernels were built for, as CMake's
// CMAKE_CUDA_ARCHITECTURES gives them, comma-separated ("90", "80,90-real");
// set by the build.
#ifndef LWO_CUDA_ARCHITECTURES
#define LWO_CUDA_ARCHITECTURES ""
#endif

namespace lwo {
namespace {

// How the registry (comm.h) destroys a communicator this backend made.
void destroy_nccl_comm(void* comm) {
  ncclResult_t r = ncclCommDestroy(static_cast<ncclComm_t>(comm));
  if (r != ncclSuccess) fail(LWO_ERR_NCCL, "ncclCommDestroy(%p): %s", comm, ncclGetErrorString(r));
}

// Registers a communicator just made; destroys it if registering throws.
void* register_nccl_comm(ncclComm_t c) {
  try {
    register_comm(c, destroy_nccl_comm);
  } catch (...) {
    ncclCommDestroy(c);
    throw;
  }
  return c;
}

lwo_status_t status_of(cudaError_t e) {
  switch (e) {
    case cudaErrorMemoryAllocation:
      return LWO_ERR_OUT_OF_MEMORY;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return LWO_ERR_NO_DEVICE;
    default:
      return LWO_ERR_CUDA;
  }
}

#define LWO_CUDA(call, ...)                                                   \
  do {                                                                        \
    cudaError_t e_ = (call);                                                  \
    if (e_ != cudaSuccess) {                                                  \
      (void)cudaGetLastError();                                               \
      fail(status_of(e_), "%s: %s (%s)", lwo::strf(__VA_ARGS__).c_str(),      \
           cudaGetErrorString(e_), cudaGetErrorName(e_));                     \
    }                                                                         \
  } while (0)

// The calling thread's capture mode relaxed for the scope
// (cudaThreadExchangeStreamCaptureMode): the library's host waits and queries
// (stream_sync, stream_check, event_sync, event_done) are never of captured
// work, and a capture some thread runs in global mode (torch.cuda.graph's
// default), or this thread in thread-local mode, would otherwise refuse them,
// on the caller's thread (lwo_ring_capture_join) and on the library's own
// (an optimizer waiting for a gradient's landing) alike.
class RelaxedCapture {
 public:
  RelaxedCapture() {
    LWO_CUDA(cudaThreadExchangeStreamCaptureMode(&mode_), "cudaThreadExchangeStreamCaptureMode");
  }
  ~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }  // the thread's own again
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      (void)cudaGetLastError();
      no_device(e);
    }
    if (device < 0 || device >= n)
      fail(LWO_ERR_NO_DEVICE, "CUDA device %d does not exist (%d device%s found)",
           device, n, n == 1 ? "" : "s");
    check_architecture(device);
  }

  // Why there is no device, and what to do about it: each case its own line.
  [[noreturn]] static void no_device(cudaError_t e) {
    int driver = 0, runtime = 0;
    (void)cudaDriverGetVersion(&driver);  // 0 when no driver is installed
    (void)cudaRuntimeGetVersion(&runtime);
    auto ver = [](int v) { return strf("%d.%d", v / 1000, v % 1000 / 10); };
    if (driver == 0)
      fail(LWO_ERR_NO_DEVICE,
           "no CUDA device: no NVIDIA driver is installed on this machine (install the NVIDIA "
           "driver to run on a GPU; building and the host-only tests need none)");
    if (e == cudaErrorInsufficientDriver || driver < runtime)
      fail(LWO_ERR_NO_DEVICE,
           "no CUDA device: the NVIDIA driver supports CUDA %s, older than the CUDA %s runtime lwo "
           "was built with (update the driver, or build lwo with a CUDA toolkit no newer than %s)",
           ver(driver).c_str(), ver(runtime).c_str(), ver(driver).c_str());
    fail(LWO_ERR_NO_DEVICE,
         "no CUDA device: the NVIDIA driver (CUDA %s) found no GPU (%s; check that a GPU is "
         "installed and that CUDA_VISIBLE_DEVICES, if set, names one)",
         ver(driver).c_str(), e == cudaSuccess ? "device count is 0" : cudaGetErrorString(e));
  }

  // A GPU older than every architecture the library's kernels were built for
  // cannot run them (newer ones compile the embedded PTX).
  static void check_architecture(int device) {
    cudaDeviceProp p{};
    LWO_CUDA(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties(%d)", device);
    int have = p.major * 10 + p.minor, oldest = 0;
    for (const char* a = LWO_CUDA_ARCHITECTURES; *a;) {
      int v = 0;
      while (*a >= '0' && *a <= '9') v = v * 10 + (*a++ - '0');
      if (v && (!oldest || v < oldest)) oldest = v;
      while (*a && *a != ',' && *a != ';') ++a;
      if (*a) ++a;
    }
    if (oldest && have < oldest)
      fail(LWO_ERR_NO_DEVICE,
           "CUDA device %d (%s) has compute capability %d.%d, older than every architecture this "
           "lwo was built for (%s): rebuild it with -DCMAKE_CUDA_ARCHITECTURES=%d",
           device, p.name, p.major, p.minor, LWO_CUDA_ARCHITECTURES, have);
  }

  int get_device() override {
    int d = 0;
    LWO_CUDA(cudaGetDevice(&d), "cudaGetDevice");
    return d;
  }
  void set_device(int device) override {
    LWO_CUDA(cudaSetDevice(device), "cudaSetDevice(%d)", device);
  }

  void* device_alloc(size_t bytes) override {
    void* p = nullptr;
    LWO_CUDA(cudaMalloc(&p, bytes), "cudaMalloc(%zu bytes) on device %d", bytes, device_);
    return p;
  }
  void device_free(void* p) noexcept override {
    if (p) (void)cudaFree(p);
  }
  void mem_get_info(size_t* free_bytes, size_t* total_bytes) override {
    LWO_CUDA(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo on device %d", device_);
  }

  void* host_alloc_pinned(size_t bytes) override {
    void* p = nullptr;
    LWO_CUDA(cudaHostAlloc(&p, bytes, cudaHostAllocPortable),
             "cudaHostAlloc(%zu bytes)", bytes);
    return p;
  }
  void host_free_pinned(void* p) noexcept override {
    if (p) (void)cudaFreeHost(p);
  }
  bool host_register(void* ptr, size_t bytes, bool read_only) override {
    // Memory the caller already pinned or registered is used as it is (asked
    // first, so no call is made to fail on purpose).
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, ptr) == cudaSuccess && attr.type == cudaMemoryTypeHost)
      return false;
    (void)cudaGetLastError();
    unsigned flags = cudaHostRegisterPortable;
    if (read_only && read_only_supported()) flags |= cudaHostRegisterReadOnly;
    cudaError_t e = cudaHostRegister(ptr, bytes, flags);
    if (e == cudaErrorHostMemoryAlreadyRegistered) {
      (void)cudaGetLastError();
      return false;
    }
    LWO_CUDA(e, "cudaHostRegister(%p, %zu bytes)", ptr, bytes);
    return true;
  }
  void host_unregister(void* ptr) noexcept override {
    if (ptr) (void)cudaHostUnregister(ptr);
  }

  StreamH stream_create() override {
    cudaStream_t s = nullptr;
    LWO_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    return s;
  }
  void stream_destroy(StreamH s) noexcept override {
    if (s) (void)cudaStreamDestroy(static_cast<cudaStream_t>(s));
  }
  void stream_sync(StreamH s) override {
    RelaxedCapture relaxed;
    LWO_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize(%p)", s);
  }
  void stream_check(StreamH s) override {
    RelaxedCapture relaxed;
    cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(s));
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return;
    }
    LWO_CUDA(e, "work on stream %p failed", s);
  }

  EventH event_create(bool timing) override {
    cudaEvent_t ev = nullptr;
    LWO_CUDA(cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming),
             "cudaEventCreate");
    return ev;
  }
  void event_destroy(EventH ev) noexcept override {
    if (ev) (void)cudaEventDestroy(static_cast<cudaEvent_t>(ev));
  }
  void event_record(EventH ev, StreamH s) override {
    LWO_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(ev), static_cast<cudaStream_t>(s)),
             "cudaEventRecord on stream %p", s);
  }
  void stream_wait(StreamH s, EventH ev) override {
    LWO_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(ev), 0),
             "cudaStreamWaitEvent on stream %p", s);
  }
  void capture_begin(StreamH s) override {
    LWO_CUDA(cudaStreamBeginCapture(static_cast<cudaStream_t>(s), cudaStreamCaptureModeRelaxed),
             "cudaStreamBeginCapture on stream %p", s);
  }
  void* capture_end(StreamH s) override {
    cudaGraph_t graph = nullptr;
    LWO_CUDA(cudaStreamEndCapture(static_cast<cudaStream_t>(s), &graph),
             "cudaStreamEndCapture on stream %p", s);
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);  // the executable graph is a copy
    LWO_CUDA(e, "cudaGraphInstantiate of the graph captured on stream %p", s);
    return exec;
  }
  CaptureStatus capture_status(StreamH s) override {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    LWO_CUDA(cudaStreamIsCapturing(static_cast<cudaStream_t>(s), &st),
             "cudaStreamIsCapturing on stream %p", s);
    return st == cudaStreamCaptureStatusActive  ? CaptureStatus::Active
           : st == cudaStreamCaptureStatusNone ? CaptureStatus::None
                                               : CaptureStatus::Invalidated;
  }
  void event_record_in_graph(EventH ev, StreamH s) override {
    LWO_CUDA(cudaEventRecordWithFlags(static_cast<cudaEvent_t>(ev), static_cast<cudaStream_t>(s),
                                      cudaEventRecordExternal),
             "cudaEventRecordWithFlags (external: a node of the capture) on stream %p", s);
  }
  void graph_launch(void* g, StreamH s) override {
    LWO_CUDA(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g), static_cast<cudaStream_t>(s)),
             "cudaGraphLaunch on stream %p", s);
  }
  void graph_destroy(void* g) noexcept override {
    if (g) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g));
  }
  bool event_done(EventH ev) override {
    RelaxedCapture relaxed;
    cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(ev));
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    LWO_CUDA(e, "cudaEventQuery");
    return true;
  }
  void event_sync(EventH ev) override {
    RelaxedCapture relaxed;
    LWO_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(ev)), "cudaEventSynchronize");
  }
  float event_elapsed_ms(EventH a, EventH b) override {
    float ms = 0.f;
    LWO_CUDA(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a), static_cast<cudaEvent_t>(b)),
             "cudaEventElapsedTime");
    return ms;
  }

  void copy_h2d(void* dst, const void* src, size_t bytes, StreamH s) override {
    LWO_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)),
             "cudaMemcpyAsync(host %p -> device %p, %zu bytes)", src, dst, bytes);
  }
  void copy_d2h(void* dst, const void* src, size_t bytes, StreamH s) override {
    LWO_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(s)),
             "cudaMemcpyAsync(device %p -> host %p, %zu bytes)", src, dst, bytes);
  }
  void fill_device(void* dst, uint8_t value, size_t bytes, StreamH s) override {
    LWO_CUDA(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(s)),
             "cudaMemsetAsync(device %p, 0x%02x, %zu bytes)", dst, value, bytes);
  }
  void* comm_create(const void* id, int n_ranks, int rank) override {
    ncclUniqueId u;
    std::memcpy(&u, id, sizeof u);
    ncclComm_t c = nullptr;
    ncclResult_t r = ncclCommInitRank(&c, n_ranks, u, rank);
    if (r != ncclSuccess)
      fail(LWO_ERR_NCCL, "ncclCommInitRank(rank %d of %d): %s", rank, n_ranks,
           ncclGetErrorString(r));
    return register_nccl_comm(c);
  }
  void* comm_split(void* parent, int color, int key) override {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    int n = 0, rank = 0;
    comm_info(parent, &n, &rank);  // a live communicator on this device, or it throws
    // Blocking, whatever the parent's mode (a non-blocking parent, as
    // PyTorch may make, would hand its mode on): the split returns when the
    // child is ready. The other settings are the parent's.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    ncclComm_t c = nullptr;
    ncclResult_t r = ncclCommSplit(static_cast<ncclComm_t>(parent), color, key, &c, &config);
    while (r == ncclInProgress && c) {
      ncclResult_t a = ncclCommGetAsyncError(c, &r);
      if (a != ncclSuccess) r = a;
    }
    if (r != ncclSuccess) {
      if (c) ncclCommAbort(c);
      fail(LWO_ERR_NCCL, "ncclCommSplit(communicator %p, rank %d of %d, color %d, key %d): %s",
           parent, rank, n, color, key, ncclGetErrorString(r));
    }
    if (!c)
      fail(LWO_ERR_NCCL, "ncclCommSplit(communicator %p, color %d, key %d) gave no communicator",
           parent, color, key);
    return register_nccl_comm(c);
#else
    (void)key;
    fail(LWO_ERR_UNSUPPORTED,
         "split of communicator %p (color %d): lwo was built with NCCL %d.%d, ncclCommSplit "
         "needs 2.18",
         parent, color, NCCL_MAJOR, NCCL_MINOR);
#endif
  }
  void comm_info(void* comm, int* n_ranks, int* rank) override {
    ncclResult_t r = ncclCommCount(static_cast<ncclComm_t>(comm), n_ranks);
    if (r == ncclSuccess) r = ncclCommUserRank(static_cast<ncclComm_t>(comm), rank);
    if (r != ncclSuccess)
      fail(LWO_ERR_NCCL, "communicator %p: %s", comm, ncclGetErrorString(r));
    int dev = -1;
    r = ncclCommCuDevice(static_cast<ncclComm_t>(comm), &dev);
    if (r != ncclSuccess) fail(LWO_ERR_NCCL, "communicator %p: %s", comm, ncclGetErrorString(r));
    if (dev != device_)
      fail(LWO_ERR_INVALID_ARGUMENT, "communicator %p is on device %d, the engine on device %d",
           comm, dev, device_);
  }
  void all_gather(const void* send, void* recv, size_t bytes, void* comm, StreamH s) override {
    ncclResult_t r = ncclAllGather(send, recv, bytes, ncclUint8, static_cast<ncclComm_t>(comm),
                                   static_cast<cudaStream_t>(s));
    if (r != ncclSuccess)
      fail(LWO_ERR_NCCL, "ncclAllGather(%zu bytes per rank): %s", bytes, ncclGetErrorString(r));
  }
  void reduce_owned(void* buf, const uint64_t* bounds, void* comm, StreamH s) override {
    ncclComm_t c = static_cast<ncclComm_t>(comm);
    cudaStream_t st = static_cast<cudaStream_t>(s);
    int n = 0, rank = 0;
    ncclResult_t r = ncclCommCount(c, &n);
    if (r == ncclSuccess) r = ncclCommUserRank(c, &rank);
    if (r != ncclSuccess) fail(LWO_ERR_NCCL, "communicator %p: %s", comm, ncclGetErrorString(r));
    uint8_t* b = static_cast<uint8_t*>(buf);
    bool even = true;
    for (int q = 1; q < n; ++q)
      even = even && bounds[q + 1] - bounds[q] == bounds[1] - bounds[0];
    if (even && bounds[0] == 0) {
      // The common case (records of one dtype): one in-place reduce-scatter.
      size_t count = (bounds[1] - bounds[0]) / 4;
      if (count == 0) return;
      r = ncclReduceScatter(b, b + bounds[rank], count, ncclFloat32, ncclSum, c, st);
      if (r != ncclSuccess)
        fail(LWO_ERR_NCCL, "ncclReduceScatter(%zu floats per rank): %s", count,
             ncclGetErrorString(r));
      return;
    }
    // Parts of different sizes: one reduce to each part's owner, grouped.
    r = ncclGroupStart();
    if (r != ncclSuccess) fail(LWO_ERR_NCCL, "ncclGroupStart: %s", ncclGetErrorString(r));
    ncclResult_t first = ncclSuccess;
    for (int q = 0; q < n; ++q) {
      size_t count = (bounds[q + 1] - bounds[q]) / 4;
      if (count == 0) continue;
      r = ncclReduce(b + bounds[q], b + bounds[q], count, ncclFloat32, ncclSum, q, c, st);
      if (r != ncclSuccess && first == ncclSuccess) first = r;
    }
    r = ncclGroupEnd();
    if (first == ncclSuccess) first = r;
    if (first != ncclSuccess)
      fail(LWO_ERR_NCCL, "ncclReduce to each of %d ranks: %s", n, ncclGetErrorString(first));
  }
  void all_reduce(void* buf, size_t n_floats, void* comm, StreamH s) override {
    if (n_floats == 0) return;
    ncclResult_t r = ncclAllReduce(buf, buf, n_floats, ncclFloat32, ncclSum,
                                   static_cast<ncclComm_t>(comm), static_cast<cudaStream_t>(s));
    if (r != ncclSuccess)
      fail(LWO_ERR_NCCL, "ncclAllReduce(%zu floats): %s", n_floats, ncclGetErrorString(r));
  }
  void host_func(StreamH s, void (*fn)(void*), void* arg, const std::vector<HostSpan>&) override {
    LWO_CUDA(cudaLaunchHostFunc(static_cast<cudaStream_t>(s), fn, arg), "cudaLaunchHostFunc");
  }

 private:
  bool read_only_supported() {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrHostRegisterReadOnlySupported, device_) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return v != 0;
  }

  int device_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

}  // namespace lwo
