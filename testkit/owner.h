// testkit: owners of lwo handles and CUDA resources, one template for all.
//
//   testkit::Ring ring;
//   TK_CHECK(lwo_ring_create(pool, &config, ring.out()));
//   ... ring.get() ...
//   ring.destroy();   // now, a failure throws testkit::Error; or
//   ring.reset();     // now, a failure is reported (and returned); or neither:
//                     // the destructor calls reset().
//
// A release that fails keeps the handle (an lwo object refused with
// LWO_ERR_BUSY is still alive and still owned), so a later reset() can try
// again; the failure goes to testkit's release reporter (testkit/check.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "lwo.h"
#include "check.h"

namespace testkit {

template <class T, auto Free, const char* Name>
class Owner {
 public:
  using Status = decltype(Free(T{}));

  Owner() = default;
  explicit Owner(T p) : p_(p) {}
  Owner(Owner&& o) noexcept : p_(std::exchange(o.p_, T{})) {}
  Owner& operator=(Owner&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, T{});
    }
    return *this;
  }
  Owner(const Owner&) = delete;
  Owner& operator=(const Owner&) = delete;
  ~Owner() { reset(); }

  T get() const { return p_; }
  explicit operator bool() const { return p_ != T{}; }
  // For create calls that write the new resource through a pointer (releases
  // the one held first).
  T* out() {
    reset();
    return &p_;
  }
  // Gives the handle up without releasing it.
  T release() { return std::exchange(p_, T{}); }
  // Releases now; returns the release's status (success when empty). A failure
  // is reported and the handle kept.
  Status reset() noexcept {
    Status s = free_now();
    if (s != Status{}) report_release(Name, s);
    return s;
  }
  // Releases now; a failure throws Error (the handle is kept).
  void destroy() { check(free_now(), Name); }

 private:
  Status free_now() noexcept {
    if (p_ == T{}) return Status{};
    Status s = Free(p_);
    if (s == Status{}) p_ = T{};
    return s;
  }
  T p_{};
};

// Waits for the stream, then destroys it (the first error of the two).
cudaError_t sync_and_destroy_stream(cudaStream_t stream);

#define TESTKIT_OWNER(Alias, T, Free)                 \
  inline constexpr char k##Alias##Release[] = #Free; \
  using Alias = Owner<T, Free, k##Alias##Release>

TESTKIT_OWNER(Engine, lwo_engine*, lwo_engine_destroy);
TESTKIT_OWNER(Pool, lwo_pool*, lwo_pool_destroy);
TESTKIT_OWNER(Ring, lwo_ring*, lwo_ring_destroy);
TESTKIT_OWNER(Schedule, lwo_schedule*, lwo_schedule_destroy);
TESTKIT_OWNER(Grads, lwo_grads*, lwo_grads_destroy);
TESTKIT_OWNER(Checkpoint, lwo_checkpoint*, lwo_checkpoint_destroy);
TESTKIT_OWNER(Plan, lwo_plan*, lwo_plan_destroy);
TESTKIT_OWNER(Graph, lwo_graph*, lwo_graph_destroy);
TESTKIT_OWNER(Comm, lwo_nccl_comm_t, lwo_nccl_comm_destroy);
TESTKIT_OWNER(Stream, cudaStream_t, sync_and_destroy_stream);
TESTKIT_OWNER(Event, cudaEvent_t, cudaEventDestroy);
TESTKIT_OWNER(GraphExec, cudaGraphExec_t, cudaGraphExecDestroy);  // cudaGraphInstantiate
TESTKIT_OWNER(DeviceMem, void*, cudaFree);
TESTKIT_OWNER(PinnedMem, void*, cudaFreeHost);       // cudaHostAlloc / cudaMallocHost
TESTKIT_OWNER(Registration, void*, cudaHostUnregister);  // cudaHostRegister (not the memory)
#undef TESTKIT_OWNER

// Factories; a failure throws Error naming the call (and the size).
Stream make_stream(unsigned flags = cudaStreamNonBlocking);
Event make_event(unsigned flags = cudaEventDefault);  // cudaEventDefault: with timing
// At least 1 byte; `what` (may be null) names the buffer in the message:
// "cudaMalloc(256 MiB, checksums) failed: ...".
DeviceMem device_alloc(size_t bytes, const char* what = nullptr);
PinnedMem pinned_alloc(size_t bytes);                 // cudaHostAlloc, at least 1 byte
Engine make_engine(int device, uint32_t flags = 0);
// Between two completed events. Out of line over the plain handles only:
// clang and nvcc's host compiler (gcc) mangle Owner's Name argument
// differently, so no function compiled by nvcc takes an Owner (the LWO_FUZZ
// build links clang code against testkit's .cu objects).
double elapsed_ms(cudaEvent_t a, cudaEvent_t b);
inline double elapsed_ms(const Event& a, const Event& b) { return elapsed_ms(a.get(), b.get()); }

// Statistics of a ring and of gradients (zeros for a null grads), or Error.
lwo_ring_stats ring_stats(lwo_ring* ring);
lwo_grads_stats grads_stats(lwo_grads* grads);
// What a ring and a pool are (lwo_ring_get_info, lwo_pool_get_info), or Error.
lwo_ring_info ring_info(lwo_ring* ring);
lwo_pool_info pool_info(lwo_pool* pool);

}  // namespace testkit
