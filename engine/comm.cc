#include "comm.h"

#include <nccl.h>

#include <cstring>

#include "src/common/error.h"

namespace lwo {
namespace {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "unique id layout");

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) fail(LWO_ERR_NCCL, "%s: %s", what, ncclGetErrorString(r));
}

}  // namespace

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
  return c;
}

void nccl_comm_destroy(void* comm) {
  if (comm) check_nccl(ncclCommDestroy(static_cast<ncclComm_t>(comm)), "ncclCommDestroy");
}

}  // namespace lwo
