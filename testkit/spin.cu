#include "testkit/spin.h"

namespace lwo {
namespace kernels {
namespace {

__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= ns) break;
    __nanosleep(1000);
  }
}

}  // namespace

cudaError_t spin_async(unsigned microseconds, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(1000ull * microseconds);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace lwo
