#include "comm.h"

#include <nccl.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "src/common/error.h"

namespace lwo {
namespace {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "unique id layout");

// The communicators lwo made that nccl_comm_destroy has not destroyed yet. A
// communicator is a caller-held ncclComm_t, not an lwo handle, so the
// registry holds addresses: once NCCL reuses a destroyed communicator's
// address for a communicator lwo makes, that address is live again.
struct CommRegistry {
  std::mutex mutex;
  std::unordered_map<void*, CommDestroy> live;
};
CommRegistry& comm_registry() {
  static CommRegistry* r = new CommRegistry;  // never destroyed: usable at exit
  return *r;
}

}  // namespace

void register_comm(void* comm, CommDestroy destroy) {
  CommRegistry& r = comm_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live[comm] = destroy;
}

CommDestroy unregister_comm(void* comm) {
  CommRegistry& r = comm_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.live.find(comm);
  if (it == r.live.end()) return nullptr;
  CommDestroy d = it->second;
  r.live.erase(it);
  return d;
}

bool registered_with(void* comm, CommDestroy destroy) {
  CommRegistry& r = comm_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.live.find(comm);
  return it != r.live.end() && it->second == destroy;
}

void nccl_unique_id(void* out) {
  ncclUniqueId u;
  ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) fail(LWO_ERR_NCCL, "ncclGetUniqueId: %s", ncclGetErrorString(r));
  std::memcpy(out, &u, sizeof u);
}

void* nccl_comm_create(Engine& engine, const void* id, int n_ranks, int rank) {
  if (n_ranks < 1 || rank < 0 || rank >= n_ranks)
    fail(LWO_ERR_INVALID_ARGUMENT, "rank %d of %d ranks", rank, n_ranks);
  DeviceScope scope(engine);
  return engine.gpu().comm_create(id, n_ranks, rank);
}

void* nccl_comm_split(Engine& engine, void* parent, int color, int key) {
  if (!parent) fail(LWO_ERR_INVALID_ARGUMENT, "parent communicator is NULL");
  if (color < 0)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "color %d: colors are 0 or more (every rank of the parent gets a child)", color);
  DeviceScope scope(engine);
  return engine.gpu().comm_split(parent, color, key);
}

void nccl_comm_destroy(void* comm) {
  if (!comm) return;
  // Taken out of the registry before NCCL sees it: of two threads destroying
  // one communicator, only one reaches ncclCommDestroy.
  CommDestroy destroy = unregister_comm(comm);
  if (!destroy)
    fail(LWO_ERR_INVALID_HANDLE,
         "communicator %p is not one that lwo_nccl_comm_create or lwo_nccl_comm_split made, or "
         "it is already destroyed; it was left alone (destroy a communicator of your own with "
         "ncclCommDestroy)",
         comm);
  destroy(comm);
}

}  // namespace lwo

namespace lwo {

void* Backend::comm_create(const void*, int n_ranks, int rank) {
  fail(LWO_ERR_UNSUPPORTED, "rank %d of %d: this backend makes no communicators", rank, n_ranks);
}

void* Backend::comm_split(void* parent, int color, int) {
  fail(LWO_ERR_UNSUPPORTED, "split of communicator %p (color %d): this backend makes no communicators",
       parent, color);
}

void Backend::capture_begin(StreamH stream) {
  fail(LWO_ERR_UNSUPPORTED, "capture on stream %p: this backend records no CUDA graphs", stream);
}

void* Backend::capture_end(StreamH stream) {
  fail(LWO_ERR_UNSUPPORTED, "capture on stream %p: this backend records no CUDA graphs", stream);
}

Backend::CaptureStatus Backend::capture_status(StreamH stream) {
  fail(LWO_ERR_UNSUPPORTED, "capture on stream %p: this backend records no CUDA graphs", stream);
}

void Backend::event_record_in_graph(EventH event, StreamH stream) {
  fail(LWO_ERR_UNSUPPORTED, "event %p in a capture on stream %p: this backend records no CUDA "
       "graphs", event, stream);
}

void Backend::graph_launch(void* graph, StreamH stream) {
  fail(LWO_ERR_UNSUPPORTED, "graph %p on stream %p: this backend records no CUDA graphs", graph,
       stream);
}

}  // namespace lwo
