// NCCL communicators for sharded pools: made on the engine's device, owned by
// the caller (lwo.h: lwo_nccl_comm_create).
#pragma once

#include <cstddef>

#include "engine.h"

namespace lwo {

constexpr size_t kNcclUniqueIdBytes = 128;  // sizeof(ncclUniqueId)

// ncclGetUniqueId into out[kNcclUniqueIdBytes]. Throws LWO_ERR_NCCL.
void nccl_unique_id(void* out);
// ncclCommInitRank on the engine's device; blocks until every rank calls.
// Throws LWO_ERR_INVALID_ARGUMENT (rank outside 0..n_ranks-1), LWO_ERR_NCCL.
void* nccl_comm_create(Engine& engine, const void* id, int n_ranks, int rank);
// ncclCommDestroy; null does nothing.
void nccl_comm_destroy(void* comm);

}  // namespace lwo
