// lwo.h: Host weights sharded across NCCL ranks.
#include "abi.h"
#include "engine/comm.h"

using namespace lwo::abi;
using lwo::fail;

static_assert(sizeof(lwo_nccl_unique_id) == lwo::kNcclUniqueIdBytes, "unique id layout");

extern "C" {

LWO_API lwo_status_t lwo_nccl_get_unique_id(lwo_nccl_unique_id* id) {
  return guard("lwo_nccl_get_unique_id", [&] {
    need(id, "id");
    lwo::nccl_unique_id(id->internal);
  });
}

LWO_API lwo_status_t lwo_nccl_comm_create(lwo_engine* engine, const lwo_nccl_unique_id* id,
                                          int32_t n_ranks, int32_t rank, lwo_nccl_comm_t* comm) {
  return guard("lwo_nccl_comm_create", [&] {
    lwo_engine* e = check_handle(engine);
    need(id, "id");
    clear_output(comm, "comm (output)");
    *comm = static_cast<lwo_nccl_comm_t>(lwo::nccl_comm_create(*e->impl, id->internal, n_ranks, rank));
  });
}

LWO_API lwo_status_t lwo_nccl_comm_split(lwo_engine* engine, lwo_nccl_comm_t parent,
                                         int32_t color, int32_t key, lwo_nccl_comm_t* comm) {
  return guard("lwo_nccl_comm_split", [&] {
    lwo_engine* e = check_handle(engine);
    clear_output(comm, "comm (output)");
    *comm = static_cast<lwo_nccl_comm_t>(lwo::nccl_comm_split(*e->impl, parent, color, key));
  });
}

LWO_API lwo_status_t lwo_nccl_comm_destroy(lwo_nccl_comm_t comm) {
  return guard("lwo_nccl_comm_destroy", [&] { lwo::nccl_comm_destroy(comm); });
}

LWO_API lwo_status_t lwo_pool_create_sharded(lwo_engine* engine, const lwo_layer_desc* layers,
                                             uint32_t n_layers, lwo_nccl_comm_t comm,
                                             const lwo_pool_config* config, lwo_pool** pool) {
  return guard("lwo_pool_create_sharded", [&] {
    CaptureGate gate;
    lwo_engine* e = pool_engine(engine, pool, &gate);
    uint32_t n_threads = pool_threads(config);
    add_pool(lwo::Pool::create_sharded(*e->impl, layers, n_layers, comm, n_threads), pool);
  });
}

}  // extern "C"
