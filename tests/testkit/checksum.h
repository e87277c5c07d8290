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

namespace lwo {
namespace kernels {

// Adds checksum(data[0..bytes)) into *out (device memory) on `stream`.
// `data` must be 16-byte aligned (slots and tensors are 256-byte aligned). Returns the launch error, if any.
cudaError_t checksum_async(const void* data, size_t bytes, unsigned long long* out,
                           cudaStream_t stream);

// The same function on the CPU, with up to n_threads threads (0: all cores).
uint64_t checksum_host(const void* data, size_t bytes, unsigned n_threads = 1);

}  // namespace kernels
}  // namespace lwo
