// The seam between the engine's host-side logic and the GPU. Pools, rings and
// schedules talk to the device only through this interface, so unit tests can
// run them against a recording implementation with no GPU (tests/unit) and the
// library runs them against the CUDA runtime (cuda_backend.cc).
//
// Every method throws lwo::Error on failure. Streams and events are opaque
// pointers (cudaStream_t / cudaEvent_t in the CUDA implementation).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "lwo.h"

namespace lwo {

using StreamH = void*;
using EventH = void*;

class Backend {
 public:
  virtual ~Backend() = default;

  // Device selection: the engine makes its device current around every call.
  virtual int get_device() = 0;
  virtual void set_device(int device) = 0;

  virtual void* device_alloc(size_t bytes) = 0;
  virtual void device_free(void* ptr) noexcept = 0;
  // Free and total bytes of the current device's memory.
  virtual void mem_get_info(size_t* free_bytes, size_t* total_bytes) = 0;

  // Page-locked host memory owned by the backend (fallback for arenas).
  virtual void* host_alloc_pinned(size_t bytes) = 0;
  virtual void host_free_pinned(void* ptr) noexcept = 0;
  // Registers caller memory for DMA. Returns false if the memory is already
  // registered or pinned (then it must not be unregistered by us); throws if
  // registration is refused.
  virtual bool host_register(void* ptr, size_t bytes, bool read_only) = 0;
  virtual void host_unregister(void* ptr) noexcept = 0;

  virtual StreamH stream_create() = 0;  // non-blocking w.r.t. the legacy stream
  virtual void stream_destroy(StreamH stream) noexcept = 0;
  // Host waits and queries (stream_sync, stream_check, event_sync,
  // event_done) are never of work in a capture under way; the CUDA
  // implementation makes them with the calling thread's capture mode relaxed,
  // so that a capture in global mode, on any thread, does not refuse them.
  virtual void stream_sync(StreamH stream) = 0;
  // Throws if work on the stream has failed; does not block.
  virtual void stream_check(StreamH stream) = 0;

  virtual EventH event_create(bool timing) = 0;
  virtual void event_destroy(EventH event) noexcept = 0;
  virtual void event_record(EventH event, StreamH stream) = 0;
  virtual void stream_wait(StreamH stream, EventH event) = 0;
  virtual bool event_done(EventH event) = 0;  // non-blocking query
  virtual void event_sync(EventH event) = 0;
  virtual float event_elapsed_ms(EventH start, EventH end) = 0;

  virtual void copy_h2d(void* dst, const void* src, size_t bytes, StreamH stream) = 0;
  virtual void copy_d2h(void* dst, const void* src, size_t bytes, StreamH stream) = 0;
  // Sets `bytes` bytes of device memory at `dst` to `value`, in stream order.
  virtual void fill_device(void* dst, uint8_t value, size_t bytes, StreamH stream) = 0;
  // Communicators (ncclComm_t in the CUDA implementation), made on the
  // current device and registered (engine/comm.h) with the function that
  // destroys them. comm_create: ncclCommInitRank of rank `rank` of `n_ranks`
  // with a unique id (comm.h's kNcclUniqueIdBytes), blocking until every rank
  // calls. comm_split: ncclCommSplit of the caller's `parent` (color >= 0),
  // a collective of the parent's ranks; the parent is only read. These
  // defaults throw LWO_ERR_UNSUPPORTED.
  virtual void* comm_create(const void* id, int n_ranks, int rank);
  virtual void* comm_split(void* parent, int color, int key);
  // CUDA graph capture (lwo_ring_capture_begin): capture_begin starts a
  // capture on `stream` in relaxed mode (the engine's and other threads'
  // CUDA calls are not refused, and stay out of the graph unless they
  // enqueue on a stream that joined the capture); capture_end ends it and
  // returns the executable graph (cudaGraphExec_t), or throws with the
  // capture ended and nothing kept; graph_launch enqueues one replay on a
  // stream. These defaults throw LWO_ERR_UNSUPPORTED (the host-only backend
  // records no graphs; graph_destroy does nothing).
  virtual void capture_begin(StreamH stream);
  virtual void* capture_end(StreamH stream);
  virtual void graph_launch(void* graph, StreamH stream);
  virtual void graph_destroy(void* graph) noexcept {}
  // In a capture under way on `stream`: a node of the graph that records
  // `event` at each replay, once the work captured before it on `stream` is
  // done (cudaEventRecordWithFlags with cudaEventRecordExternal), so that
  // the host and other streams can wait for a replay that the caller
  // launches (lwo_ring_capture_replay). The capture takes no dependency on
  // the event. The default throws LWO_ERR_UNSUPPORTED as capture_begin does.
  virtual void event_record_in_graph(EventH event, StreamH stream);
  // Whether `stream` is capturing now (cudaStreamGetCaptureInfo), whoever
  // began it: None, Active, or Invalidated (a call the capture could not
  // hold failed it; its origin must still end it). The default throws
  // LWO_ERR_UNSUPPORTED as capture_begin does.
  enum class CaptureStatus { None, Active, Invalidated };
  virtual CaptureStatus capture_status(StreamH stream);
  // Collectives over a communicator.
  virtual void comm_info(void* comm, int* n_ranks, int* rank) = 0;
  // recv[k*bytes .. (k+1)*bytes) = rank k's send, for every rank k.
  virtual void all_gather(const void* send, void* recv, size_t bytes, void* comm,
                          StreamH stream) = 0;
  // Sums f32 data over the ranks, each rank keeping its own part: `bounds`
  // holds n_ranks + 1 increasing byte offsets into `buf` (multiples of 4);
  // afterwards rank q's buf[bounds[q], bounds[q+1]) is the sum over every
  // rank of that range. The rest of buf is left unspecified.
  virtual void reduce_owned(void* buf, const uint64_t* bounds, void* comm, StreamH stream) = 0;
  // Sums `n_floats` f32 values at `buf` over the ranks, in place: afterwards
  // every rank's buf holds the sum of every rank's (ncclAllReduce).
  virtual void all_reduce(void* buf, size_t n_floats, void* comm, StreamH stream) = 0;

  // Host memory a host function reads or writes, declared so that a checker
  // of the ordering (the recording backend of the unit tests) can see it;
  // the CUDA backend ignores it.
  struct HostSpan {
    const void* data;
    size_t bytes;
    bool write;
  };
  // Runs fn(arg) on a host thread once the stream's earlier work is done;
  // later work on the stream waits for it to return. fn must not call CUDA,
  // and touches no pinned or registered memory beyond `spans`.
  virtual void host_func(StreamH stream, void (*fn)(void*), void* arg,
                         const std::vector<HostSpan>& spans) = 0;

  // What a checking backend may use and the others ignore (these defaults):
  // a ring slot's bytes [ptr, ptr + bytes) are released on `stream`, so no
  // reader may touch them until the slot is acquired again (reclaimed).
  virtual void slot_released(void* ptr, size_t bytes, StreamH stream) {}
  virtual void slot_reclaimed(void* ptr, size_t bytes, StreamH stream) {}
  // A gradient staging slot's bytes are handed out on `stream` to be written
  // whole: a checking backend may fill them so that bytes left unwritten show.
  virtual void slot_handed_out(void* ptr, size_t bytes, StreamH stream) {}
  // True for a backend whose device memory is host memory: the engine's
  // layer compute then runs on the CPU (src/compute/host_compute.h).
  virtual bool compute_on_host() const { return false; }
};

// The CUDA runtime implementation. Throws LWO_ERR_NO_DEVICE if `device` does
// not exist.
std::unique_ptr<Backend> make_cuda_backend(int device);

// A backend with no GPU, for tests of the library's users (the test export
// lwo_test_engine_create_host, bindings/c/lwo_test.h): "device" memory is
// host memory, every stream runs its work at once on the calling thread (so
// stream order is program order), events are host clock stamps, and layer
// compute runs on the CPU. With `poison`, a released ring slot reads as
// 0xff bytes until it is acquired again or filled anew, and a gradient slot
// is 0xff when handed out.
// Its communicators have one rank, or N ranks in one process: N host
// engines, each driven from its own thread, meet by the unique id's bytes
// (any kNcclUniqueIdBytes bytes the ranks share). comm_create blocks until
// every rank has joined, and each collective (and comm_split) until every
// rank of the communicator has made the same call (all_gather, reduce_owned
// and all_reduce of the same bytes, or LWO_ERR_COLLECTIVE_MISMATCH on every
// rank); the reductions sum in rank order, so every rank gets the same bits.
// A rank missing for kHostCommTimeout fails the ranks waiting for it with
// LWO_ERR_NCCL, naming the call and the missing ranks, and leaves the
// communicator unusable.
std::unique_ptr<Backend> make_host_backend(bool poison);
constexpr std::chrono::seconds kHostCommTimeout{120};
// Sets the host backend's deadline (kHostCommTimeout until set; tests
// shorten it through lwo_test_host_comm_timeout, bindings/c/lwo_test.h) for
// the calls that start from now on; returns the previous.
std::chrono::milliseconds set_host_comm_timeout(std::chrono::milliseconds timeout);

}  // namespace lwo
