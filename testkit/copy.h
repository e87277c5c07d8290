// testkit: the one pinned-copy loop, behind every copy bandwidth and every
// "peak" that a bound or a share is computed against (bench_*, lwo probe,
// lwo run, lwo run --train, lwo shard).
//
// A batch is a list of back-to-back cudaMemcpyAsync between host memory and
// one device buffer per direction, timed with CUDA events: host to device on
// stream 0; device to host on stream 0 alone, or with kBoth on stream 1,
// started together with stream 0 and enqueued alternately with the H2D
// copies, so both directions run at once. warmup untimed batches come first,
// then `repeats` timed ones.
//
//   CopyPlan plan = uniform_plan(Direction::kH2D, host, nullptr, dev, nullptr, 256 * MiB, 4);
//   CopyResult r = time_copies(plan, {/*warmup*/ 1, /*repeats*/ 5});
//   r.best_gbps(), r.median_gbps()
//
// measure_pinned_peak() allocates its own pinned and device buffers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "check.h"
#include "owner.h"
#include "random.h"

namespace testkit {

enum class Direction { kH2D, kD2H, kBoth };
const char* direction_name(Direction d);  // "h2d", "d2h", "both"

// What one batch copies. Copy i of a direction uses its i-th (host, bytes);
// every H2D copy lands at device_dst, every D2H copy reads device_src (each
// at least as large as that direction's largest copy).
struct CopyPlan {
  Direction direction = Direction::kH2D;
  std::vector<HostRange> h2d;  // host sources
  std::vector<HostRange> d2h;  // host destinations
  void* device_dst = nullptr;
  const void* device_src = nullptr;
  uint64_t h2d_bytes() const;  // per batch
  uint64_t d2h_bytes() const;
};

// `copies` copies of `bytes` per direction, from host_src (H2D) and into
// host_dst (D2H); the host pointers that the direction does not use may be null.
CopyPlan uniform_plan(Direction direction, const void* host_src, void* host_dst,
                      void* device_dst, const void* device_src, uint64_t bytes, uint64_t copies);
// `copies` copies of `bytes` from (H2D) or into (D2H) hosts[i % hosts.size()]
// in turn: one direction, kH2D or kD2H.
CopyPlan cycle_plan(Direction direction, const std::vector<void*>& hosts, void* device,
                    uint64_t bytes, uint64_t copies);

// One timed batch, in ms: `ms` is the whole batch (with kBoth, the later of the
// two streams), h2d_ms and d2h_ms each direction from the common start.
struct BatchTime {
  double ms = 0, h2d_ms = 0, d2h_ms = 0;
};

// The streams and events of the loop, made once and reused batch after batch.
class CopyLoop {
 public:
  CopyLoop();  // two non-blocking streams and three timing events on the current device
  BatchTime run_batch(const CopyPlan& plan);

 private:
  Stream stream_[2];
  Event start_, end_[2];
};

struct CopyRepeats {
  int warmup = 1;   // untimed batches first
  int repeats = 5;  // timed batches
};

// The timed batches of one plan, and their bandwidths (1e9 B/s; both
// directions' bytes for kBoth; each direction over its own time for h2d/d2h).
struct CopyResult {
  Direction direction = Direction::kH2D;
  uint64_t h2d_bytes = 0, d2h_bytes = 0;  // per batch
  std::vector<BatchTime> batches;
  std::vector<double> gbps() const;  // per batch, in order
  double best_gbps() const;
  double median_gbps() const;
  double best_ms() const;
  double median_ms() const;
  double h2d_median_gbps() const;
  double d2h_median_gbps() const;
  double h2d_best_gbps() const;
  double d2h_best_gbps() const;
};
CopyResult time_copies(CopyLoop& loop, const CopyPlan& plan, const CopyRepeats& repeats);
// Pinned copies of one size both ways (lwo probe's copy figures): on `loop`,
// H2D then D2H, each batch max(1, batch_bytes / bytes) back-to-back copies of
// `bytes` between one pinned host buffer and one device buffer; the best and
// the median of the batches' GB/s (of their times, for an odd count).
struct CopyFigure {
  uint64_t bytes = 0;
  bool measured = false;
  uint64_t copies = 0;  // per batch
  double h2d_best = 0, h2d_median = 0, d2h_best = 0, d2h_median = 0;
};
CopyFigure time_copy_size(CopyLoop& loop, void* host, void* device, uint64_t bytes,
                          uint64_t batch_bytes, const CopyRepeats& repeats);
CopyResult time_copies(const CopyPlan& plan, const CopyRepeats& repeats);  // a loop of its own
// H2D: each of `copies` in turn, back-to-back on one stream into one device
// buffer of device_bytes, allocated here (the peak of a pool's records, or of
// their copy sizes, from pinned memory: lwo run, lwo stream, lwo train).
CopyResult time_h2d_copies(const std::vector<HostRange>& copies, uint64_t device_bytes,
                           const CopyRepeats& repeats);

// The knobs of the pinned peak: `copies` back-to-back copies of `copy_bytes`
// per batch and direction, between one cudaHostAlloc buffer per direction
// (touched first) and device memory (zeroed first), best of `repeats` batches
// after `warmup`.
struct PeakKnobs {
  uint64_t copy_bytes = 256 * MiB;
  uint64_t copies = 4;
  int warmup = 1;
  int repeats = 5;
  Direction direction = Direction::kH2D;  // kBoth: both at once
  std::string method() const;  // "pinned (cudaHostAlloc) copies, 4 x 256 MiB back-to-back on one stream, best of 5 rounds"
};
CopyResult measure_pinned_peak(const PeakKnobs& knobs);

// Both directions, one after the other (kH2D, then kD2H unless h2d_only), with
// the same knobs: the peaks the bounds use.
struct Peaks {
  double h2d_gbps = 0, d2h_gbps = 0;        // best batch
  double h2d_best_ms = 0, d2h_best_ms = 0;  // its time
};
Peaks measure_pinned_peaks(PeakKnobs knobs, bool h2d_only = false);

}  // namespace testkit
