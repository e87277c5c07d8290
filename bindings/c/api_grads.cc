// lwo.h: Weight gradients to host memory.
#include "abi.h"
#include "src/common/dtype.h"

using namespace lwo::abi;
using lwo::fail;

extern "C" {

LWO_API void lwo_grads_config_init(lwo_grads_config* c) {
  if (c) *c = lwo_grads_config LWO_GRADS_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_grads_create(lwo_pool* pool, const uint8_t* trainable,
                                      const lwo_grads_config* config, lwo_grads** grads) {
  return guard("lwo_grads_create", [&] {
    clear_output(grads, "grads (output)");
    lwo_pool* p = check_handle(pool);
    const CaptureGate gate = capture_gate(p->impl->engine());
    p->impl->engine().check_not_capturing("a gradient set's creation");
    lwo_grads_config cfg = read_config(config, lwo_grads_config LWO_GRADS_CONFIG_INIT);
    check_flags(cfg.flags, LWO_GRADS_NATIVE_WIRE | LWO_GRADS_F32);
    if ((cfg.flags & LWO_GRADS_NATIVE_WIRE) && (cfg.flags & LWO_GRADS_F32))
      fail(LWO_ERR_INVALID_ARGUMENT,
           "flags 0x%x: LWO_GRADS_NATIVE_WIRE and LWO_GRADS_F32 exclude each other", cfg.flags);
    if (cfg.depth < 1 || cfg.depth > 64)
      fail(LWO_ERR_INVALID_ARGUMENT, "depth %u is outside 1..64", cfg.depth);
    using Mode = lwo::Grads::Mode;
    const Mode mode = (cfg.flags & LWO_GRADS_F32)           ? Mode::kF32
                      : (cfg.flags & LWO_GRADS_NATIVE_WIRE) ? Mode::kNativeWire
                                                            : Mode::kNative;
    // Of the quantized formats only fp8 e4m3 block-128 trains (its gradient is
    // dense, in the tensor's logical dtype; the optimizer keeps f32 masters
    // and writes the record from them); any other stays frozen.
    for (uint32_t l = 0; l < p->impl->n_layers(); ++l) {
      if (trainable && !trainable[l]) continue;
      const lwo::RecordLayout& rl = p->impl->layer(l).layout;
      for (const lwo::TensorLayout& t : rl.tensors) {
        if (t.quant == LWO_QUANT_NONE) continue;
        if (t.quant != LWO_QUANT_FP8_E4M3_BLOCK128)
          fail(LWO_ERR_QUANTIZED_WEIGHT,
               "layer %u is marked trainable%s but its tensor '%s' is quantized (%s): only "
               "fp8_e4m3_block128 tensors train, other quantized weights are frozen (mark the "
               "layer frozen in trainable)",
               l, trainable ? "" : " (trainable is NULL: every layer)", t.name.c_str(),
               lwo_quant_format_name(t.quant));
        if (p->impl->communicator())
          fail(LWO_ERR_UNSUPPORTED,
               "layer %u tensor '%s' is quantized (%s) in a sharded pool: quantized tensors "
               "train only in unsharded pools", l, t.name.c_str(),
               lwo_quant_format_name(t.quant));
      }
    }
    auto impl = std::make_unique<lwo::Grads>(*p->impl, trainable, cfg.depth, mode, cfg.n_threads,
                                             cfg.replica_comm);
    *grads = publish(std::make_unique<lwo_grads>(lwo_grads{std::move(impl)}));
  });
}

LWO_API lwo_status_t lwo_grads_destroy(lwo_grads* grads) {
  return guard("lwo_grads_destroy", [&] {
    if (!grads) return;
    const CaptureGate gate = capture_gate(check_handle(grads)->impl->pool().engine());
    destroy(grads);
  });
}

LWO_API lwo_status_t lwo_grads_begin(lwo_grads* grads, uint32_t layer, lwo_stream_t stream,
                                     lwo_layer_view* view) {
  return guard("lwo_grads_begin", [&] {
    lwo_grads* g = check_handle(grads);
    check_out(view, "view");
    lwo_layer_view v{};
    const CaptureGate gate = capture_gate(g->impl->pool().engine());
    g->impl->begin(layer, stream, &v);
    write_out(view, v, "view");
  });
}

LWO_API lwo_status_t lwo_grads_end(lwo_grads* grads, uint32_t layer, lwo_stream_t stream) {
  return guard("lwo_grads_end", [&] {
    lwo_grads* g = check_handle(grads);
    const CaptureGate gate = capture_gate(g->impl->pool().engine());
    g->impl->end(layer, stream);
  });
}

LWO_API lwo_status_t lwo_grads_wait(lwo_grads* grads) {
  return guard("lwo_grads_wait", [&] {
    lwo_grads* g = check_handle(grads);
    const CaptureGate gate = capture_gate(g->impl->pool().engine());
    g->impl->wait();
  });
}

LWO_API lwo_status_t lwo_grads_zero(lwo_grads* grads) {
  return guard("lwo_grads_zero", [&] {
    lwo_grads* g = check_handle(grads);
    const CaptureGate gate = capture_gate(g->impl->pool().engine());
    g->impl->zero();
  });
}

LWO_API lwo_status_t lwo_grads_query(lwo_grads* grads, uint32_t* done) {
  return guard("lwo_grads_query", [&] {
    lwo_grads* g = check_handle(grads);
    need(done, "done");
    const CaptureGate gate = capture_gate(g->impl->pool().engine());
    *done = g->impl->done() ? 1u : 0u;
  });
}

LWO_API lwo_status_t lwo_grads_tensor(lwo_grads* grads, uint32_t layer, const char* name,
                                      lwo_grad_tensor* info) {
  return guard("lwo_grads_tensor", [&] {
    lwo_grads* g = check_handle(grads);
    check_out(info, "info");
    lwo_grad_tensor v{};
    v.size = sizeof v;
    v.data = g->impl->tensor(layer, name, &v.dtype, &v.first_element, &v.n_elements);
    write_out(info, v, "info");
  });
}

LWO_API lwo_status_t lwo_grads_shard(lwo_grads* grads, uint32_t layer, const char* name,
                                     float** data, uint64_t* first_element,
                                     uint64_t* n_elements) {
  return guard("lwo_grads_shard", [&] {
    lwo_grads* g = check_handle(grads);
    need(data, "data");
    uint64_t first = 0, n = 0;
    lwo_dtype_t dtype = LWO_DTYPE_F32;
    void* p = g->impl->tensor(layer, name, &dtype, &first, &n);
    if (dtype != LWO_DTYPE_F32)
      fail(LWO_ERR_BAD_DTYPE,
           "layer %u tensor '%.255s': the host gradient is %s, not f32 (read it with "
           "lwo_grads_tensor, or create the grads with LWO_GRADS_F32)",
           layer, name, lwo::dtype_name(dtype));
    *data = static_cast<float*>(p);
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
