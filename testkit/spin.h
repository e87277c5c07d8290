// A kernel that keeps a stream busy for a while, so a test can prove that
// something has not happened yet when the host looks (and happens only after
// a fence).
#pragma once

#include <cuda_runtime.h>

namespace lwo {
namespace kernels {

// One thread spins for about `microseconds` on `stream`.
cudaError_t spin_async(unsigned microseconds, cudaStream_t stream);

}  // namespace kernels
}  // namespace lwo
