#include <algorithm>
#include <cstring>

#include "testkit/copy.h"

namespace testkit {

const char* direction_name(Direction d) {
  switch (d) {
    case Direction::kH2D:
      return "h2d";
    case Direction::kD2H:
      return "d2h";
    default:
      return "both";
  }
}

namespace {
uint64_t total(const std::vector<HostRange>& v) {
  uint64_t t = 0;
  for (const HostRange& r : v) t += r.bytes;
  return t;
}
bool uses_h2d(Direction d) { return d != Direction::kD2H; }
bool uses_d2h(Direction d) { return d != Direction::kH2D; }
}  // namespace

uint64_t CopyPlan::h2d_bytes() const { return uses_h2d(direction) ? total(h2d) : 0; }
uint64_t CopyPlan::d2h_bytes() const { return uses_d2h(direction) ? total(d2h) : 0; }

CopyPlan uniform_plan(Direction direction, const void* host_src, void* host_dst,
                      void* device_dst, const void* device_src, uint64_t bytes, uint64_t copies) {
  CopyPlan p;
  p.direction = direction;
  p.device_dst = device_dst;
  p.device_src = device_src;
  if (uses_h2d(direction)) p.h2d.assign(copies, HostRange{const_cast<void*>(host_src), bytes});
  if (uses_d2h(direction)) p.d2h.assign(copies, HostRange{host_dst, bytes});
  return p;
}

CopyPlan cycle_plan(Direction direction, const std::vector<void*>& hosts, void* device,
                    uint64_t bytes, uint64_t copies) {
  if (direction == Direction::kBoth || hosts.empty())
    fail("testkit::cycle_plan: one direction and at least one host buffer");
  CopyPlan p;
  p.direction = direction;
  std::vector<HostRange>& list = direction == Direction::kH2D ? p.h2d : p.d2h;
  for (uint64_t i = 0; i < copies; ++i) list.push_back({hosts[i % hosts.size()], bytes});
  if (direction == Direction::kH2D)
    p.device_dst = device;
  else
    p.device_src = device;
  return p;
}

CopyLoop::CopyLoop() {
  stream_[0] = make_stream();
  stream_[1] = make_stream();
  start_ = make_event();
  end_[0] = make_event();
  end_[1] = make_event();
}

BatchTime CopyLoop::run_batch(const CopyPlan& plan) {
  const Direction dir = plan.direction;
  const bool h2d = uses_h2d(dir), d2h = uses_d2h(dir), both = h2d && d2h;
  if ((h2d && !plan.device_dst) || (d2h && !plan.device_src))
    fail("testkit::CopyLoop: the plan has no device buffer for its direction");
  cudaStream_t s0 = stream_[0].get(), s1 = both ? stream_[1].get() : s0;
  check(cudaEventRecord(start_.get(), s0), "cudaEventRecord");
  if (both) check(cudaStreamWaitEvent(s1, start_.get(), 0), "cudaStreamWaitEvent");
  const size_t n_h2d = h2d ? plan.h2d.size() : 0, n_d2h = d2h ? plan.d2h.size() : 0;
  // Alternately, so that both directions are in flight at once (and pageable
  // copies, which hold the host thread, still overlap).
  for (size_t i = 0; i < std::max(n_h2d, n_d2h); ++i) {
    if (i < n_h2d)
      check(cudaMemcpyAsync(plan.device_dst, plan.h2d[i].data, plan.h2d[i].bytes,
                            cudaMemcpyHostToDevice, s0),
            "cudaMemcpyAsync (H2D)");
    if (i < n_d2h)
      check(cudaMemcpyAsync(plan.d2h[i].data, plan.device_src, plan.d2h[i].bytes,
                            cudaMemcpyDeviceToHost, s1),
            "cudaMemcpyAsync (D2H)");
  }
  check(cudaEventRecord(end_[0].get(), s0), "cudaEventRecord");
  if (both) check(cudaEventRecord(end_[1].get(), s1), "cudaEventRecord");
  check(cudaEventSynchronize(end_[0].get()), "cudaEventSynchronize");
  BatchTime t;
  if (both) {
    check(cudaEventSynchronize(end_[1].get()), "cudaEventSynchronize");
    t.h2d_ms = elapsed_ms(start_, end_[0]);
    t.d2h_ms = elapsed_ms(start_, end_[1]);
    t.ms = std::max(t.h2d_ms, t.d2h_ms);
  } else {
    t.ms = elapsed_ms(start_, end_[0]);
    (h2d ? t.h2d_ms : t.d2h_ms) = t.ms;
  }
  return t;
}

// --- results ----------------------------------------------------------------------

namespace {
template <class F>
std::vector<double> each(const std::vector<BatchTime>& b, F f) {
  std::vector<double> v;
  for (const BatchTime& t : b) v.push_back(f(t));
  return v;
}
double best_of(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}
}  // namespace

std::vector<double> CopyResult::gbps() const {
  const double bytes = static_cast<double>(h2d_bytes + d2h_bytes);
  return each(batches, [&](const BatchTime& t) { return testkit::gbps(bytes, t.ms); });
}
double CopyResult::best_gbps() const { return best_of(gbps()); }
double CopyResult::median_gbps() const {
  return testkit::gbps(static_cast<double>(h2d_bytes + d2h_bytes), median_ms());
}
double CopyResult::best_ms() const {
  std::vector<double> ms = each(batches, [](const BatchTime& t) { return t.ms; });
  return ms.empty() ? 0 : *std::min_element(ms.begin(), ms.end());
}
double CopyResult::median_ms() const {
  return median(each(batches, [](const BatchTime& t) { return t.ms; }));
}
double CopyResult::h2d_median_gbps() const {
  return testkit::gbps(static_cast<double>(h2d_bytes),
                       median(each(batches, [](const BatchTime& t) { return t.h2d_ms; })));
}
double CopyResult::d2h_median_gbps() const {
  return testkit::gbps(static_cast<double>(d2h_bytes),
                       median(each(batches, [](const BatchTime& t) { return t.d2h_ms; })));
}
double CopyResult::h2d_best_gbps() const {
  const double b = static_cast<double>(h2d_bytes);
  return best_of(each(batches, [&](const BatchTime& t) { return testkit::gbps(b, t.h2d_ms); }));
}
double CopyResult::d2h_best_gbps() const {
  const double b = static_cast<double>(d2h_bytes);
  return best_of(each(batches, [&](const BatchTime& t) { return testkit::gbps(b, t.d2h_ms); }));
}

CopyFigure time_copy_size(CopyLoop& loop, void* host, void* device, uint64_t bytes,
                          uint64_t batch_bytes, const CopyRepeats& repeats) {
  CopyFigure f;
  f.bytes = bytes;
  f.copies = std::max<uint64_t>(1, batch_bytes / bytes);
  const auto timed = [&](Direction d) {  // one buffer each side, either way
    return time_copies(loop, uniform_plan(d, host, host, device, device, bytes, f.copies),
                       repeats);
  };
  const CopyResult h2d = timed(Direction::kH2D);
  const CopyResult d2h = timed(Direction::kD2H);
  f.h2d_best = h2d.best_gbps();
  f.h2d_median = median(h2d.gbps());
  f.d2h_best = d2h.best_gbps();
  f.d2h_median = median(d2h.gbps());
  f.measured = true;
  return f;
}

CopyResult time_copies(CopyLoop& loop, const CopyPlan& plan, const CopyRepeats& repeats) {
  CopyResult r;
  r.direction = plan.direction;
  r.h2d_bytes = plan.h2d_bytes();
  r.d2h_bytes = plan.d2h_bytes();
  for (int i = 0; i < repeats.warmup; ++i) loop.run_batch(plan);
  for (int i = 0; i < repeats.repeats; ++i) r.batches.push_back(loop.run_batch(plan));
  return r;
}

CopyResult time_copies(const CopyPlan& plan, const CopyRepeats& repeats) {
  CopyLoop loop;
  return time_copies(loop, plan, repeats);
}

CopyResult time_h2d_copies(const std::vector<HostRange>& copies, uint64_t device_bytes,
                           const CopyRepeats& repeats) {
  DeviceMem buffer = device_alloc(device_bytes);
  CopyPlan plan;
  plan.direction = Direction::kH2D;
  plan.h2d = copies;
  plan.device_dst = buffer.get();
  return time_copies(plan, repeats);
}

// --- the pinned peak ------------------------------------------------------------------

std::string PeakKnobs::method() const {
  return strf("pinned (cudaHostAlloc) copies, %llu x %s back-to-back on %s, best of %d rounds",
              static_cast<unsigned long long>(copies), fmt_bytes(copy_bytes).c_str(),
              direction == Direction::kBoth ? "two streams (both directions at once)"
                                            : "one stream",
              repeats);
}

namespace {

// One pinned and one device buffer per direction used, touched before use.
struct PeakBuffers {
  PinnedMem host[2];
  DeviceMem dev[2];
  PeakBuffers(uint64_t bytes, int n) {
    for (int i = 0; i < n; ++i) {
      host[i] = pinned_alloc(bytes);
      dev[i] = device_alloc(bytes);
      std::memset(host[i].get(), 0x5a, bytes);
      check(cudaMemset(dev[i].get(), 0, bytes), "cudaMemset");
    }
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // the memsets are not ordered with the loop's streams
  }
};

CopyPlan peak_plan(const PeakKnobs& k, Direction d, const PeakBuffers& b) {
  const int second = d == Direction::kBoth ? 1 : 0;
  return uniform_plan(d, b.host[0].get(), b.host[second].get(), b.dev[0].get(),
                      b.dev[second].get(), k.copy_bytes, k.copies);
}

}  // namespace

CopyResult measure_pinned_peak(const PeakKnobs& knobs) {
  PeakBuffers buffers(knobs.copy_bytes, knobs.direction == Direction::kBoth ? 2 : 1);
  return time_copies(peak_plan(knobs, knobs.direction, buffers), {knobs.warmup, knobs.repeats});
}

Peaks measure_pinned_peaks(PeakKnobs knobs, bool h2d_only) {
  PeakBuffers buffers(knobs.copy_bytes, 1);
  CopyLoop loop;
  const CopyRepeats rep{knobs.warmup, knobs.repeats};
  Peaks p;
  CopyResult h2d = time_copies(loop, peak_plan(knobs, Direction::kH2D, buffers), rep);
  p.h2d_gbps = h2d.best_gbps();
  p.h2d_best_ms = h2d.best_ms();
  if (!h2d_only) {
    CopyResult d2h = time_copies(loop, peak_plan(knobs, Direction::kD2H, buffers), rep);
    p.d2h_gbps = d2h.best_gbps();
    p.d2h_best_ms = d2h.best_ms();
  }
  return p;
}

}  // namespace testkit
