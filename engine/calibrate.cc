#include "calibrate.h"

#include <algorithm>
#include <vector>

#include "arena.h"
#include "src/common/error.h"

namespace lwo {
namespace {

double gbps(uint64_t bytes, double ms) { return ms > 0 ? static_cast<double>(bytes) / (ms * 1e6) : 0; }

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Frees device memory on every way out.
struct DeviceBuf {
  Backend& gpu;
  uint8_t* p;
  ~DeviceBuf() { gpu.device_free(p); }
};

// Events created for one measurement, destroyed on every way out.
struct Events {
  Backend& gpu;
  std::vector<EventH> all;
  EventH make() {
    EventH ev = gpu.event_create(true);
    all.push_back(ev);
    return ev;
  }
  ~Events() {
    for (EventH e : all) gpu.event_destroy(e);
  }
};

}  // namespace

LinkRates measure_link(Engine& e, uint64_t bytes, uint32_t reps) {
  if (bytes == 0 || reps == 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "link calibration needs bytes and repetitions (got %llu x %u)",
         static_cast<unsigned long long>(bytes), reps);
  Backend& gpu = e.gpu();
  DeviceScope scope(e);
  Charge charge(e, MemUse::Other, bytes, 2,
                strf("link calibration buffers (2 x %llu bytes)",
                     static_cast<unsigned long long>(bytes)).c_str());
  PinnedArena host(gpu, 2 * bytes, 0);
  DeviceBuf dev{gpu, static_cast<uint8_t*>(gpu.device_alloc(2 * bytes))};
  Events ev{gpu, {}};
  StreamH up = e.h2d(), down = e.d2h();
  // Whatever the streams still carry finishes first (the measurement owns them).
  gpu.stream_sync(up);
  gpu.stream_sync(down);
  uint8_t* h_src = host.data();
  uint8_t* h_dst = host.data() + bytes;
  uint8_t* d_dst = dev.p;
  uint8_t* d_src = dev.p + bytes;
  // The device buffer's bytes come from the host once (the copies out read them).
  gpu.copy_h2d(dev.p, host.data(), 2 * bytes, up);
  std::vector<double> h2d, d2h, dup_h2d, dup_d2h;
  for (uint32_t r = 0; r <= reps; ++r) {  // repetition 0 warms up
    EventH a = ev.make(), b = ev.make();
    gpu.event_record(a, up);
    gpu.copy_h2d(d_dst, h_src, bytes, up);
    gpu.event_record(b, up);
    EventH c = ev.make(), d = ev.make();
    gpu.stream_wait(down, b);
    gpu.event_record(c, down);
    gpu.copy_d2h(h_dst, d_src, bytes, down);
    gpu.event_record(d, down);
    // Both at once: the two streams start from one event.
    EventH s = ev.make(), u1 = ev.make(), d1 = ev.make();
    gpu.stream_wait(up, d);
    gpu.event_record(s, up);
    gpu.stream_wait(down, s);
    gpu.copy_h2d(d_dst, h_src, bytes, up);
    gpu.copy_d2h(h_dst, d_src, bytes, down);
    gpu.event_record(u1, up);
    gpu.event_record(d1, down);
    gpu.event_sync(u1);
    gpu.event_sync(d1);
    if (r == 0) continue;
    h2d.push_back(gpu.event_elapsed_ms(a, b));
    d2h.push_back(gpu.event_elapsed_ms(c, d));
    dup_h2d.push_back(gpu.event_elapsed_ms(s, u1));
    dup_d2h.push_back(gpu.event_elapsed_ms(s, d1));
  }
  LinkRates out;
  out.h2d_gbps = gbps(bytes, median_of(h2d));
  out.d2h_gbps = gbps(bytes, median_of(d2h));
  out.duplex_h2d_gbps = gbps(bytes, median_of(dup_h2d));
  out.duplex_d2h_gbps = gbps(bytes, median_of(dup_d2h));
  return out;
}

uint64_t plan_room(Engine& e) {
  uint64_t used = 0;
  e.memory_use(nullptr, &used);
  const uint64_t limit = e.budget();
  if (limit) return limit - std::min(limit, used);
  size_t free_b = 0, total_b = 0;
  DeviceScope scope(e);
  e.gpu().mem_get_info(&free_b, &total_b);
  return free_b;
}

}  // namespace lwo
