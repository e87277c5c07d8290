// Pinned host memory owned by lwo: an anonymous mapping with huge pages where
// the kernel gives them, first-touched (zeroed) from all cores, then
// registered for DMA; cudaHostAlloc where registration is refused. Making
// 16 GiB DMA-ready this way took 0.9 s on the H200 machine against 10.9 s for
// cudaHostAlloc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend.h"
#include "engine.h"

namespace lwo {

class PinnedArena {
 public:
  PinnedArena() = default;
  // Throws LWO_ERR_OUT_OF_MEMORY.
  PinnedArena(Backend& gpu, size_t bytes, uint32_t n_threads);
  // The same, charging the page-rounded bytes to the engine's host budget
  // first (LWO_ERR_OVER_BUDGET naming `what`); uncharged when freed.
  PinnedArena(Engine& engine, size_t bytes, uint32_t n_threads, const char* what);
  ~PinnedArena();
  PinnedArena(PinnedArena&& o) noexcept { *this = static_cast<PinnedArena&&>(o); }
  PinnedArena& operator=(PinnedArena&& o) noexcept;
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  uint8_t* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  // Zeroes [0, n) from up to n_threads threads.
  void zero(size_t n, uint32_t n_threads);

 private:
  void release() noexcept;
  Backend* gpu_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
  bool mmapped_ = false;
  HostCharge charge_;
};

}  // namespace lwo
