// lwo.h: Host weight pools (pinned and registered; checkpoint and sharded
// pools are created in api_checkpoints.cc and api_nccl.cc).
#include "abi.h"

using namespace lwo::abi;
using lwo::fail;

namespace lwo {
namespace abi {

lwo_engine* pool_engine(lwo_engine* engine, lwo_pool** pool, CaptureGate* gate) {
  clear_output(pool, "pool (output)");
  lwo_engine* e = check_handle(engine);
  *gate = capture_gate(*e->impl);
  e->impl->check_not_capturing("a pool's creation");
  return e;
}

uint32_t pool_threads(const lwo_pool_config* config) {
  lwo_pool_config cfg = read_config(config, lwo_pool_config LWO_POOL_CONFIG_INIT);
  check_flags(cfg.flags, 0);
  return cfg.n_threads;
}

void add_pool(std::unique_ptr<lwo::Pool> impl, lwo_pool** pool) {
  *pool = publish(std::make_unique<lwo_pool>(lwo_pool{std::move(impl)}));
}

}  // namespace abi
}  // namespace lwo

extern "C" {

LWO_API void lwo_pool_config_init(lwo_pool_config* c) {
  if (c) *c = lwo_pool_config LWO_POOL_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_pool_create_pinned(lwo_engine* engine, const lwo_layer_desc* layers,
                                            uint32_t n_layers, const lwo_pool_config* config,
                                            lwo_pool** pool) {
  return guard("lwo_pool_create_pinned", [&] {
    CaptureGate gate;
    lwo_engine* e = pool_engine(engine, pool, &gate);
    uint32_t n_threads = pool_threads(config);
    add_pool(lwo::Pool::create_pinned(*e->impl, layers, n_layers, n_threads), pool);
  });
}

LWO_API lwo_status_t lwo_pool_create_registered(lwo_engine* engine, const lwo_layer_desc* layers,
                                                uint32_t n_layers, const lwo_host_region* regions,
                                                uint32_t n_regions, const lwo_pool_config* config,
                                                lwo_pool** pool) {
  return guard("lwo_pool_create_registered", [&] {
    CaptureGate gate;
    lwo_engine* e = pool_engine(engine, pool, &gate);
    pool_threads(config);  // checked; registering touches no memory
    add_pool(lwo::Pool::create_registered(*e->impl, layers, n_layers, regions, n_regions),
             pool);
  });
}

LWO_API lwo_status_t lwo_pool_destroy(lwo_pool* pool) {
  return guard("lwo_pool_destroy", [&] { destroy(pool); });
}

LWO_API lwo_status_t lwo_pool_get_info(const lwo_pool* pool, lwo_pool_info* info) {
  return guard("lwo_pool_get_info", [&] {
    const lwo::Pool& p = *check_handle(pool)->impl;
    lwo_pool_info v{};
    v.n_layers = p.n_layers();
    v.kind = p.kind();
    v.total_bytes = p.total_bytes();
    v.max_record_bytes = p.max_record_bytes();
    v.rank = p.rank();
    v.n_ranks = p.n_ranks();
    write_out(info, v, "info");
  });
}

LWO_API lwo_status_t lwo_pool_layer_tensor_count(const lwo_pool* pool, uint32_t layer,
                                                 uint32_t* n_tensors) {
  return guard("lwo_pool_layer_tensor_count", [&] {
    lwo_pool* p = check_handle(pool);
    need(n_tensors, "n_tensors");
    *n_tensors = static_cast<uint32_t>(p->impl->layer(layer).layout.tensors.size());
  });
}

LWO_API lwo_status_t lwo_pool_tensor_info(const lwo_pool* pool, uint32_t layer, uint32_t index,
                                          lwo_tensor_info* info) {
  return guard("lwo_pool_tensor_info", [&] {
    lwo_pool* p = check_handle(pool);
    check_out(info, "info");
    const lwo::TensorLayout& t =
        at(p->impl->layer(layer).layout.tensors, index, lwo::strf("layer %u", layer), "tensors");
    lwo_tensor_info v{};
    v.name = t.name.c_str();
    v.dtype = t.dtype;
    v.n_dims = t.n_dims;
    for (int d = 0; d < LWO_MAX_DIMS; ++d) v.shape[d] = d < t.n_dims ? t.shape[d] : 0;
    v.offset = t.offset;
    v.bytes = t.bytes;
    v.quant_format = t.quant;
    write_out(info, v, "info");
  });
}

LWO_API lwo_status_t lwo_pool_find_tensor(const lwo_pool* pool, uint32_t layer, const char* name,
                                          uint32_t* index) {
  return guard("lwo_pool_find_tensor", [&] {
    lwo_pool* p = check_handle(pool);
    need(index, "index");
    *index = p->impl->tensor_index(layer, name);
  });
}

LWO_API lwo_status_t lwo_pool_record_bytes(const lwo_pool* pool, uint32_t layer,
                                           uint64_t* bytes) {
  return guard("lwo_pool_record_bytes", [&] {
    lwo_pool* p = check_handle(pool);
    need(bytes, "bytes");
    *bytes = p->impl->layer(layer).layout.record_bytes;
  });
}

LWO_API lwo_status_t lwo_pool_write(lwo_pool* pool, uint32_t layer, const char* name,
                                    const void* src, uint64_t bytes) {
  return guard("lwo_pool_write", [&] {
    check_handle(pool)->impl->write(layer, name, 0, src, bytes, true);
  });
}

LWO_API lwo_status_t lwo_pool_write_range(lwo_pool* pool, uint32_t layer, const char* name,
                                          uint64_t offset, const void* src, uint64_t bytes) {
  return guard("lwo_pool_write_range", [&] {
    check_handle(pool)->impl->write(layer, name, offset, src, bytes, false);
  });
}

LWO_API lwo_status_t lwo_pool_layer_host(lwo_pool* pool, uint32_t layer, void** data,
                                         uint64_t* bytes) {
  return guard("lwo_pool_layer_host", [&] {
    lwo_pool* p = check_handle(pool);
    need(data, "data");
    p->impl->layer_host(layer, data, bytes);
  });
}

LWO_API lwo_status_t lwo_pool_layer_changed(lwo_pool* pool, uint32_t layer) {
  return guard("lwo_pool_layer_changed", [&] {
    lwo::Pool& p = *check_handle(pool)->impl;
    p.check_not_held(layer, "marking the layer changed");
    p.changed(layer);
  });
}

LWO_API lwo_status_t lwo_pool_tensor_host(lwo_pool* pool, uint32_t layer, const char* name,
                                          void** data, uint64_t* bytes) {
  return guard("lwo_pool_tensor_host", [&] {
    lwo_pool* p = check_handle(pool);
    need(data, "data");
    p->impl->tensor_host(layer, p->impl->tensor_index(layer, name), data, bytes);
  });
}

LWO_API lwo_status_t lwo_pool_shard_host(lwo_pool* pool, uint32_t layer, void** data,
                                         uint64_t* record_offset, uint64_t* bytes) {
  return guard("lwo_pool_shard_host", [&] {
    lwo_pool* p = check_handle(pool);
    need(data, "data");
    p->impl->shard_host(layer, data, record_offset, bytes);
  });
}

LWO_API lwo_status_t lwo_pool_shard_tensor(lwo_pool* pool, uint32_t layer, const char* name,
                                           void** data, uint64_t* first_element,
                                           uint64_t* n_elements) {
  return guard("lwo_pool_shard_tensor", [&] {
    lwo_pool* p = check_handle(pool);
    need(data, "data");
    p->impl->shard_tensor(layer, p->impl->tensor_index(layer, name), data, first_element,
                          n_elements);
  });
}

// -- Quantized records --

LWO_API lwo_status_t lwo_pool_write_quantized(lwo_pool* pool, uint32_t layer, const char* name,
                                              const void* src, lwo_dtype_t src_dtype,
                                              uint64_t src_bytes, uint32_t n_threads) {
  return guard("lwo_pool_write_quantized", [&] {
    lwo_pool* p = check_handle(pool);
    lwo::check_dtype_value(src_dtype, "src_dtype");
    p->impl->write_quantized(layer, name, src, src_dtype, src_bytes, n_threads);
  });
}

}  // extern "C"
