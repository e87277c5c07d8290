// lwo.h: Device slot rings and schedules.
#include "abi.h"

using namespace lwo::abi;
using lwo::fail;

extern "C" {

LWO_API void lwo_ring_config_init(lwo_ring_config* c) {
  if (c) *c = lwo_ring_config LWO_RING_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_ring_create(lwo_pool* pool, const lwo_ring_config* config,
                                     lwo_ring** ring) {
  return guard("lwo_ring_create", [&] {
    clear_output(ring, "ring (output)");
    lwo_pool* p = check_handle(pool);
    const CaptureGate gate = capture_gate(p->impl->engine());
    p->impl->engine().check_not_capturing("a ring's creation");
    lwo_ring_config cfg = read_config(config, lwo_ring_config LWO_RING_CONFIG_INIT);
    check_flags(cfg.flags, LWO_RING_TIMING | LWO_RING_CAPTURE_WARM);
    if (cfg.depth < 1 || cfg.depth > lwo::kMaxDepth)
      fail(LWO_ERR_INVALID_ARGUMENT, "depth %u is outside 1..%u", cfg.depth, lwo::kMaxDepth);
    if (cfg.n_resident && !cfg.resident_layers)
      fail(LWO_ERR_INVALID_ARGUMENT, "resident_layers is NULL but n_resident is %u",
           cfg.n_resident);
    std::vector<uint32_t> resident;
    if (cfg.n_resident) resident.assign(cfg.resident_layers, cfg.resident_layers + cfg.n_resident);
    auto impl = std::make_unique<lwo::Ring>(*p->impl, cfg.depth, cfg.flags, resident);
    *ring = publish(std::make_unique<lwo_ring>(lwo_ring{std::move(impl)}));
  });
}

LWO_API lwo_status_t lwo_ring_destroy(lwo_ring* ring) {
  return guard("lwo_ring_destroy", [&] { destroy(ring); });
}

LWO_API lwo_status_t lwo_ring_stage(lwo_ring* ring, uint32_t layer, lwo_ticket* ticket) {
  return guard("lwo_ring_stage", [&] {
    if (ticket) ticket->id = 0;  // the output of a failed call
    lwo_ring* r = check_handle(ring);
    need(ticket, "ticket");
    const CaptureGate gate = capture_gate(r->impl->engine());
    *ticket = r->impl->stage(layer);
  });
}

LWO_API lwo_status_t lwo_ring_acquire(lwo_ring* ring, lwo_ticket ticket, lwo_stream_t stream,
                                      lwo_layer_view* view) {
  return guard("lwo_ring_acquire", [&] {
    lwo_ring* r = check_handle(ring);
    check_out(view, "view");
    lwo_layer_view v{};
    const CaptureGate gate = capture_gate(r->impl->engine());
    r->impl->acquire(ticket, stream, &v);
    write_out(view, v, "view");
  });
}

LWO_API lwo_status_t lwo_ring_tensor(lwo_ring* ring, lwo_ticket ticket, const char* name,
                                     void** device_ptr) {
  return guard("lwo_ring_tensor", [&] {
    lwo_ring* r = check_handle(ring);
    need(device_ptr, "device_ptr");
    *device_ptr = r->impl->tensor(ticket, name);
  });
}

LWO_API lwo_status_t lwo_ring_query(lwo_ring* ring, lwo_ticket ticket, uint32_t* landed) {
  return guard("lwo_ring_query", [&] {
    lwo_ring* r = check_handle(ring);
    need(landed, "landed");
    const CaptureGate gate = capture_gate(r->impl->engine());
    *landed = r->impl->landed(ticket) ? 1u : 0u;
  });
}

LWO_API lwo_status_t lwo_ring_ticket_state(lwo_ring* ring, lwo_ticket ticket,
                                           lwo_ticket_state_t* state) {
  return guard("lwo_ring_ticket_state", [&] {
    lwo_ring* r = check_handle(ring);
    need(state, "state");
    *state = r->impl->ticket_state(ticket);
  });
}

LWO_API lwo_status_t lwo_ring_release(lwo_ring* ring, lwo_ticket ticket, lwo_stream_t stream) {
  return guard("lwo_ring_release", [&] {
    lwo_ring* r = check_handle(ring);
    const CaptureGate gate = capture_gate(r->impl->engine());
    r->impl->release(ticket, stream);
  });
}

LWO_API lwo_status_t lwo_ring_release_all(lwo_ring* ring, lwo_stream_t stream,
                                          uint32_t* n_released) {
  return guard("lwo_ring_release_all", [&] {
    lwo_ring* r = check_handle(ring);
    const CaptureGate gate = capture_gate(r->impl->engine());
    uint32_t n = r->impl->release_all(stream);
    if (n_released) *n_released = n;
  });
}

LWO_API lwo_status_t lwo_ring_get_info(const lwo_ring* ring, lwo_ring_info* info) {
  return guard("lwo_ring_get_info", [&] {
    lwo_ring* r = check_handle(ring);
    lwo_ring_info v{};
    r->impl->info(&v);
    write_out(info, v, "info");
  });
}

LWO_API lwo_status_t lwo_ring_get_stats(lwo_ring* ring, lwo_ring_stats* stats) {
  return guard("lwo_ring_get_stats", [&] {
    lwo_ring* r = check_handle(ring);
    need(stats, "stats");
    lwo_ring_stats v{};
    r->impl->stats(&v);
    write_out(stats, v, "stats");
  });
}

LWO_API lwo_status_t lwo_ring_reset_stats(lwo_ring* ring) {
  return guard("lwo_ring_reset_stats", [&] { check_handle(ring)->impl->reset_stats(); });
}

/* ---- schedules ---- */

LWO_API lwo_status_t lwo_schedule_create(lwo_ring* ring, const uint32_t* layers,
                                         uint32_t n_layers, lwo_schedule** schedule) {
  return guard("lwo_schedule_create", [&] {
    clear_output(schedule, "schedule (output)");
    lwo_ring* r = check_handle(ring);
    const CaptureGate gate = capture_gate(r->impl->engine());
    r->impl->engine().check_not_capturing("a schedule's creation");
    auto impl = std::make_unique<lwo::Schedule>(*r->impl, layers, n_layers);
    *schedule = publish(std::make_unique<lwo_schedule>(lwo_schedule{std::move(impl)}));
  });
}

LWO_API lwo_status_t lwo_schedule_destroy(lwo_schedule* schedule) {
  return guard("lwo_schedule_destroy", [&] {
    if (!schedule) return;
    const CaptureGate gate = capture_gate(check_handle(schedule)->impl->ring().engine());
    destroy(schedule);
  });
}

LWO_API lwo_status_t lwo_schedule_next(lwo_schedule* schedule, lwo_stream_t stream,
                                       lwo_layer_view* view) {
  return guard_status("lwo_schedule_next", [&] {
    lwo_schedule* s = check_handle(schedule);
    check_out(view, "view");
    lwo_layer_view v{};
    const CaptureGate gate = capture_gate(s->impl->ring().engine());
    lwo_status_t st = s->impl->next(stream, &v);
    if (st == LWO_OK) write_out(view, v, "view");
    return st;
  });
}

LWO_API lwo_status_t lwo_schedule_position(const lwo_schedule* schedule, uint32_t* position) {
  return guard("lwo_schedule_position", [&] {
    lwo_schedule* s = check_handle(schedule);
    need(position, "position");
    *position = s->impl->position();
  });
}

LWO_API lwo_status_t lwo_schedule_reset(lwo_schedule* schedule, lwo_stream_t stream) {
  return guard("lwo_schedule_reset", [&] {
    lwo_schedule* s = check_handle(schedule);
    const CaptureGate gate = capture_gate(s->impl->ring().engine());
    s->impl->reset(stream);
  });
}

LWO_API lwo_status_t lwo_ring_capture_begin(lwo_ring* ring, lwo_stream_t stream) {
  return guard("lwo_ring_capture_begin", [&] {
    lwo_ring* r = check_handle(ring);
    const ExclusiveGate gate(r->impl->engine().capture_gate());
    r->impl->capture_begin(stream);
  });
}

LWO_API lwo_status_t lwo_ring_capture_end(lwo_ring* ring, lwo_stream_t stream, lwo_graph** graph) {
  return guard("lwo_ring_capture_end", [&] {
    clear_output(graph, "graph (output)");
    lwo_ring* r = check_handle(ring);
    auto impl = r->impl->capture_end(stream);
    *graph = publish(std::make_unique<lwo_graph>(lwo_graph{std::move(impl)}));
  });
}

LWO_API lwo_status_t lwo_ring_capture_join(lwo_ring* ring, lwo_stream_t stream) {
  return guard("lwo_ring_capture_join", [&] {
    lwo_ring* r = check_handle(ring);
    const ExclusiveGate gate(r->impl->engine().capture_gate());
    r->impl->capture_join(stream);
  });
}

LWO_API lwo_status_t lwo_ring_capture_leave(lwo_ring* ring, lwo_stream_t stream) {
  return guard("lwo_ring_capture_leave", [&] { check_handle(ring)->impl->capture_leave(stream); });
}

LWO_API lwo_status_t lwo_ring_capture_replay(lwo_ring* ring, lwo_stream_t stream) {
  return guard("lwo_ring_capture_replay", [&] {
    lwo_ring* r = check_handle(ring);
    const CaptureGate gate = capture_gate(r->impl->engine());
    r->impl->capture_replay(stream);
  });
}

LWO_API lwo_status_t lwo_ring_capture_release(lwo_ring* ring, lwo_stream_t stream) {
  return guard("lwo_ring_capture_release", [&] {
    lwo_ring* r = check_handle(ring);
    const CaptureGate gate = capture_gate(r->impl->engine());
    r->impl->capture_release(stream);
  });
}

LWO_API lwo_status_t lwo_graph_launch(lwo_graph* graph, lwo_stream_t stream) {
  return guard("lwo_graph_launch", [&] {
    lwo_graph* g = check_handle(graph);
    const CaptureGate gate = capture_gate(g->impl->ring().engine());
    g->impl->launch(stream);
  });
}

LWO_API lwo_status_t lwo_graph_destroy(lwo_graph* graph) {
  return guard("lwo_graph_destroy", [&] {
    if (!graph) return;
    lwo::Engine& e = check_handle(graph)->impl->ring().engine();
    const CaptureGate gate = capture_gate(e);
    // It orders the transfer and gradient streams after the graph's replays.
    e.check_not_capturing("destroying a graph");
    destroy(graph);
  });
}

}  // extern "C"
