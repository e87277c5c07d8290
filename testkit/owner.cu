#include <algorithm>

#include "testkit/owner.h"

namespace testkit {

cudaError_t sync_and_destroy_stream(cudaStream_t stream) {
  cudaError_t waited = cudaStreamSynchronize(stream);
  cudaError_t destroyed = cudaStreamDestroy(stream);
  return waited != cudaSuccess ? waited : destroyed;
}

Stream make_stream(unsigned flags) {
  Stream s;
  check(cudaStreamCreateWithFlags(s.out(), flags), "cudaStreamCreateWithFlags");
  return s;
}

Event make_event(unsigned flags) {
  Event e;
  check(cudaEventCreateWithFlags(e.out(), flags), "cudaEventCreateWithFlags");
  return e;
}

DeviceMem device_alloc(size_t bytes, const char* what) {
  DeviceMem m;
  check(cudaMalloc(m.out(), std::max<size_t>(bytes, 1)),
        what ? strf("cudaMalloc(%s, %s)", fmt_bytes(bytes).c_str(), what)
             : strf("cudaMalloc(%s)", fmt_bytes(bytes).c_str()));
  return m;
}

PinnedMem pinned_alloc(size_t bytes) {
  PinnedMem m;
  check(cudaHostAlloc(m.out(), std::max<size_t>(bytes, 1), cudaHostAllocDefault),
        strf("cudaHostAlloc(%s)", fmt_bytes(bytes).c_str()));
  return m;
}

Engine make_engine(int device, uint32_t flags) {
  lwo_engine_config config = LWO_ENGINE_CONFIG_INIT;
  config.device = device;
  config.flags = flags;
  Engine e;
  check(lwo_engine_create(&config, e.out()), strf("lwo_engine_create (device %d)", device));
  return e;
}

double elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  return ms;
}

namespace {

// The size-first struct get(object, &out) writes; a failure throws naming `call`.
template <class Out, class Obj, class Arg>
Out written_by(lwo_status_t (*get)(Obj*, Out*), Arg* object, const char* call) {
  Out out{};
  out.size = sizeof out;
  check(get(object, &out), call);
  return out;
}

}  // namespace

lwo_ring_stats ring_stats(lwo_ring* ring) {
  return written_by(lwo_ring_get_stats, ring, "lwo_ring_get_stats");
}

lwo_ring_info ring_info(lwo_ring* ring) {
  return written_by(lwo_ring_get_info, ring, "lwo_ring_get_info");
}

lwo_pool_info pool_info(lwo_pool* pool) {
  return written_by(lwo_pool_get_info, pool, "lwo_pool_get_info");
}

lwo_grads_stats grads_stats(lwo_grads* grads) {
  if (grads) return written_by(lwo_grads_get_stats, grads, "lwo_grads_get_stats");
  lwo_grads_stats s{};  // zeros
  s.size = sizeof s;
  return s;
}

}  // namespace testkit
