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

lwo_ring_stats ring_stats(lwo_ring* ring) {
  lwo_ring_stats s{};
  s.size = sizeof s;
  check(lwo_ring_get_stats(ring, &s), "lwo_ring_get_stats");
  return s;
}

lwo_ring_info ring_info(lwo_ring* ring) {
  lwo_ring_info i{};
  i.size = sizeof i;
  check(lwo_ring_get_info(ring, &i), "lwo_ring_get_info");
  return i;
}

lwo_pool_info pool_info(lwo_pool* pool) {
  lwo_pool_info i{};
  i.size = sizeof i;
  check(lwo_pool_get_info(pool, &i), "lwo_pool_get_info");
  return i;
}

lwo_grads_stats grads_stats(lwo_grads* grads) {
  lwo_grads_stats s{};
  s.size = sizeof s;
  if (grads) check(lwo_grads_get_stats(grads, &s), "lwo_grads_get_stats");
  return s;
}

}  // namespace testkit
