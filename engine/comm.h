// NCCL communicators for sharded pools: made on the engine's device, owned by
// the caller (lwo.h: lwo_nccl_comm_create), and remembered so that
// lwo_nccl_comm_destroy destroys only those.
#pragma once

#include <cstddef>

#include "engine.h"

namespace lwo {

constexpr size_t kNcclUniqueIdBytes = 128;  // sizeof(ncclUniqueId)

// ncclGetUniqueId into out[kNcclUniqueIdBytes]. Throws LWO_ERR_NCCL.
void nccl_unique_id(void* out);
// ncclCommInitRank on the engine's device; blocks until every rank calls.
// Registers the communicator. Throws LWO_ERR_INVALID_ARGUMENT (rank outside
// 0..n_ranks-1), LWO_ERR_NCCL.
void* nccl_comm_create(Engine& engine, const void* id, int n_ranks, int rank);
// ncclCommDestroy of a communicator nccl_comm_create made; null does nothing.
// Any other pointer, one already destroyed included, throws
// LWO_ERR_INVALID_HANDLE and is never dereferenced. Throws LWO_ERR_NCCL.
void nccl_comm_destroy(void* comm);

// The registry of the communicators nccl_comm_create made and
// nccl_comm_destroy has not destroyed (thread-safe). unregister_comm is true
// if comm was registered, and takes it out.
void register_comm(void* comm);
bool unregister_comm(void* comm);

}  // namespace lwo
