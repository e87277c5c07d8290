// A consumer that reads every byte of a buffer: a position-weighted checksum,
// the same function on the GPU and on the CPU, so a test or the lwo program
// can prove a slot holds exactly the host bytes of its layer.
//
//   checksum(b) = sum over 8-byte little-endian words w_i of w_i * (2*i + 1)
//                 (mod 2^64); a tail shorter than 8 bytes is zero-padded.
//
// Addition commutes, so the GPU reduces in any order; the odd weights make a
// moved or swapped word change the result.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "lwo.h"
#include "random.h"

namespace lwo {
namespace kernels {

// Adds checksum(data[0..bytes)) into *out (device memory) on `stream`.
// `data` must be 16-byte aligned (slots and tensors are 256-byte aligned). Returns the launch error, if any.
cudaError_t checksum_async(const void* data, size_t bytes, unsigned long long* out,
                           cudaStream_t stream);

// The same function on the CPU, in up to n_threads parts on the library's
// host pool (0: one per slot).
uint64_t checksum_host(const void* data, size_t bytes, unsigned n_threads = 1);

}  // namespace kernels
}  // namespace lwo

namespace testkit {

// checksum_host of each range from all cores (a range per core, or all cores
// on each range when there are fewer ranges than cores).
std::vector<uint64_t> checksums(const std::vector<HostRange>& ranges,
                                const Progress& progress = {});

// The checksum of the first `bytes` bytes of the stream of `key` (what
// fill_bytes writes with offset 0), from its formula: no memory is read.
uint64_t checksum_generated(uint64_t key, uint64_t bytes, unsigned n_threads = 0);

// One pass of `schedule` on `stream`, the checksum consumer: for each layer,
// checksum_async of the whole record from its slot into sums[layer]; then
// lwo_schedule_reset for the next pass. With record_bytes, every layer must
// arrive with a record of that size ("layer L arrived with N bytes, expected
// a record of M"). A failure throws testkit::Error.
void checksum_pass(lwo_schedule* schedule, cudaStream_t stream, unsigned long long* sums,
                   uint64_t record_bytes = 0);

// Copies the per-layer sums (expect.size() of them) from the device after
// `stream` and returns the layers whose sum is not times x expect[layer]
// (empty: every slot held its layer's bytes on every pass).
struct SumMismatch {
  uint32_t layer;
  unsigned long long got, want;
};
std::vector<SumMismatch> verify_sums(const unsigned long long* device_sums,
                                     const std::vector<uint64_t>& expect, uint64_t times,
                                     cudaStream_t stream);

// The median time of the checksum consumer over one record of `pool`'s layer
// `layer` on `stream` (what lwo run computes per layer), in ms: the record
// staged into a ring of depth 1, summed six times, the last five timed.
double checksum_ms(lwo_pool* pool, uint32_t layer, cudaStream_t stream);

// Timed passes on a consumer stream (lwo run, lwo stream): pass 0 warms up,
// then `passes` timed ones. enqueue(p) enqueues pass p; the host enqueues
// pass p while the GPU runs pass p - 1, then waits for pass p - 1 and calls
// timed(p - 1, its ms) for a timed one. A pass is timed between CUDA events
// after its last consumer kernel and after the previous pass's; total_ms
// spans every timed pass. Returns once the consumer is done.
struct TimedPasses {
  std::vector<double> ms;  // per timed pass
  double median_ms = 0, best_ms = 0, total_ms = 0;
};
TimedPasses time_passes(uint32_t passes, cudaStream_t consumer,
                        const std::function<void(uint32_t p)>& enqueue,
                        const std::function<void(uint32_t p, double ms)>& timed);

}  // namespace testkit
