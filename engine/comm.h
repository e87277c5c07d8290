// NCCL communicators for sharded pools: made on the engine's device (by its
// backend: NCCL on the CUDA backend, in-process communicators of one or N
// ranks on the host backend), owned by the caller (lwo.h: lwo_nccl_comm_create,
// lwo_nccl_comm_split), and remembered so that lwo_nccl_comm_destroy
// destroys only those. A communicator lwo did not make is used, never
// destroyed.
#pragma once

#include <cstddef>

#include "engine.h"

namespace lwo {

constexpr size_t kNcclUniqueIdBytes = 128;  // sizeof(ncclUniqueId)

// ncclGetUniqueId into out[kNcclUniqueIdBytes]. Throws LWO_ERR_NCCL.
void nccl_unique_id(void* out);
// ncclCommInitRank on the engine's device (Backend::comm_create); blocks
// until every rank calls. Registers the communicator. Throws
// LWO_ERR_INVALID_ARGUMENT (rank outside 0..n_ranks-1), LWO_ERR_NCCL.
void* nccl_comm_create(Engine& engine, const void* id, int n_ranks, int rank);
// ncclCommSplit of the caller's `parent` (Backend::comm_split): a collective
// of every rank of the parent; the ranks of one color form the child, ordered
// by key. Registers the child; the parent is only read. Throws
// LWO_ERR_INVALID_ARGUMENT (null parent, a negative color, a parent on
// another device), LWO_ERR_UNSUPPORTED (NCCL older than 2.18), LWO_ERR_NCCL.
void* nccl_comm_split(Engine& engine, void* parent, int color, int key);
// Destroys a communicator nccl_comm_create or nccl_comm_split made, the way
// its backend registered; null does nothing. Any other pointer, one already
// destroyed included, throws LWO_ERR_INVALID_HANDLE and is never
// dereferenced. Throws LWO_ERR_NCCL.
void nccl_comm_destroy(void* comm);

// The registry of the communicators lwo made and has not destroyed
// (thread-safe), each with the function that destroys it (it may throw).
// unregister_comm takes comm out and returns its function, or null if comm
// was not registered. registered_with is true if comm is registered with
// `destroy` (how a backend recognises its own communicators).
using CommDestroy = void (*)(void* comm);
void register_comm(void* comm, CommDestroy destroy);
CommDestroy unregister_comm(void* comm);
bool registered_with(void* comm, CommDestroy destroy);

}  // namespace lwo
