#include "comm.h"

#include <nccl.h>

#include <cstring>
#include <mutex>
#include <unordered_set>

#include "src/common/error.h"

namespace lwo {
namespace {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "unique id layout");

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) fail(LWO_ERR_NCCL, "%s: %s", what, ncclGetErrorString(r));
}

// The communicators nccl_comm_create made that nccl_comm_destroy has not
// destroyed yet. A communicator is a caller-held ncclComm_t, not an lwo
// handle, so the registry holds addresses: once NCCL reuses a destroyed
// communicator's address for a communicator lwo makes, that address is live
// again.
struct CommRegistry {
  std::mutex mutex;
  std::unordered_set<void*> live;
};
CommRegistry& comm_registry() {
  static CommRegistry* r = new CommRegistry;  // never destroyed: usable at exit
  return *r;
}

}  // namespace

void register_comm(void* comm) {
  CommRegistry& r = comm_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live.insert(comm);
}

bool unregister_comm(void* comm) {
  CommRegistry& r = comm_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.live.erase(comm) != 0;
}

void nccl_unique_id(void* out) {
  ncclUniqueId u;
  check_nccl(ncclGetUniqueId(&u), "ncclGetUniqueId");
  std::memcpy(out, &u, sizeof u);
}

void* nccl_comm_create(Engine& engine, const void* id, int n_ranks, int rank) {
  if (n_ranks < 1 || rank < 0 || rank >= n_ranks)
    fail(LWO_ERR_INVALID_ARGUMENT, "rank %d of %d ranks", rank, n_ranks);
  DeviceScope scope(engine);
  ncclUniqueId u;
  std::memcpy(&u, id, sizeof u);
  ncclComm_t c = nullptr;
  check_nccl(ncclCommInitRank(&c, n_ranks, u, rank), "ncclCommInitRank");
  try {
    register_comm(c);
  } catch (...) {
    ncclCommDestroy(c);
    throw;
  }
  return c;
}

void nccl_comm_destroy(void* comm) {
  if (!comm) return;
  // Taken out of the registry before NCCL sees it: of two threads destroying
  // one communicator, only one reaches ncclCommDestroy.
  if (!unregister_comm(comm))
    fail(LWO_ERR_INVALID_HANDLE,
         "communicator %p is not one that lwo_nccl_comm_create made, or it is already "
         "destroyed; it was left alone (destroy a communicator of your own with "
         "ncclCommDestroy)",
         comm);
  check_nccl(ncclCommDestroy(static_cast<ncclComm_t>(comm)), "ncclCommDestroy");
}

}  // namespace lwo
