// lwo.h: Weight gradients to host memory.
#include "abi.h"

using namespace lwo::abi;
using lwo::fail;

extern "C" {

LWO_API void lwo_grads_config_init(lwo_grads_config* c) {
  if (c) *c = lwo_grads_config LWO_GRADS_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_grads_create(lwo_pool* pool, const uint8_t* trainable,
                                      const lwo_grads_config* config, lwo_grads** grads) {
  return guard("lwo_grads_create", [&] {
    need(grads, "grads (output)");
    *grads = nullptr;
    lwo_pool* p = check_handle(pool);
    lwo_grads_config cfg = read_config(config, lwo_grads_config LWO_GRADS_CONFIG_INIT);
    check_flags(cfg.flags, LWO_GRADS_NATIVE_WIRE);
    if (cfg.depth < 1 || cfg.depth > 64)
      fail(LWO_ERR_INVALID_ARGUMENT, "depth %u is outside 1..64", cfg.depth);
    auto impl = std::make_unique<lwo::Grads>(*p->impl, trainable, cfg.depth,
                                             (cfg.flags & LWO_GRADS_NATIVE_WIRE) != 0,
                                             cfg.n_threads);
    *grads = publish(std::make_unique<lwo_grads>(lwo_grads{std::move(impl)}));
  });
}

LWO_API lwo_status_t lwo_grads_destroy(lwo_grads* grads) {
  return guard("lwo_grads_destroy", [&] { destroy(grads); });
}

LWO_API lwo_status_t lwo_grads_begin(lwo_grads* grads, uint32_t layer, lwo_stream_t stream,
                                     lwo_layer_view* view) {
  return guard("lwo_grads_begin", [&] {
    lwo_grads* g = check_handle(grads);
    check_out(view, "view");
    lwo_layer_view v{};
    g->impl->begin(layer, stream, &v);
    write_out(view, v, "view");
  });
}

LWO_API lwo_status_t lwo_grads_end(lwo_grads* grads, uint32_t layer, lwo_stream_t stream) {
  return guard("lwo_grads_end", [&] { check_handle(grads)->impl->end(layer, stream); });
}

LWO_API lwo_status_t lwo_grads_wait(lwo_grads* grads) {
  return guard("lwo_grads_wait", [&] { check_handle(grads)->impl->wait(); });
}

LWO_API lwo_status_t lwo_grads_zero(lwo_grads* grads) {
  return guard("lwo_grads_zero", [&] { check_handle(grads)->impl->zero(); });
}

LWO_API lwo_status_t lwo_grads_query(lwo_grads* grads, uint32_t* done) {
  return guard("lwo_grads_query", [&] {
    lwo_grads* g = check_handle(grads);
    need(done, "done");
    *done = g->impl->done() ? 1u : 0u;
  });
}

LWO_API lwo_status_t lwo_grads_shard(lwo_grads* grads, uint32_t layer, const char* name,
                                     float** data, uint64_t* first_element,
                                     uint64_t* n_elements) {
  return guard("lwo_grads_shard", [&] {
    lwo_grads* g = check_handle(grads);
    need(data, "data");
    uint64_t first = 0, n = 0;
    *data = g->impl->shard(layer, name, &first, &n);
    if (first_element) *first_element = first;
    if (n_elements) *n_elements = n;
  });
}

LWO_API lwo_status_t lwo_grads_get_stats(lwo_grads* grads, lwo_grads_stats* stats) {
  return guard("lwo_grads_get_stats", [&] {
    lwo_grads* g = check_handle(grads);
    lwo_grads_stats v{};
    g->impl->stats(&v);
    write_out(stats, v, "stats");
  });
}

}  // extern "C"
