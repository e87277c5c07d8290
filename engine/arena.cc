#include "arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/parallel.h"

namespace lwo {

namespace {
// Zeroes [0, n) of `data` from up to n_threads threads, in parts of at least
// 64 MiB on page boundaries (the first touch places the pages).
void parallel_zero(uint8_t* data, size_t n, uint32_t n_threads) {
  parallel_for(n, n_threads, uint64_t(64) << 20, 4096,
               [data](uint64_t b, uint64_t e) { std::memset(data + b, 0, e - b); });
}
}  // namespace

PinnedArena::PinnedArena(Backend& gpu, size_t bytes, uint32_t n_threads)
    : gpu_(&gpu) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  bytes_ = align_up(std::max<size_t>(bytes, 1), page);
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p != MAP_FAILED) {
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes_, MADV_HUGEPAGE);
#endif
    parallel_zero(static_cast<uint8_t*>(p), bytes_, n_threads);
    try {
      gpu.host_register(p, bytes_, false);
      data_ = static_cast<uint8_t*>(p);
      mmapped_ = true;
      return;
    } catch (const Error&) {
      munmap(p, bytes_);
    }
  }
  try {
    data_ = static_cast<uint8_t*>(gpu.host_alloc_pinned(bytes_));
  } catch (const Error& e) {
    fail(LWO_ERR_OUT_OF_MEMORY, "cannot pin %zu bytes of host memory: %s", bytes_, e.what());
  }
  zero(bytes_, n_threads);
}

PinnedArena::PinnedArena(Engine& engine, size_t bytes, uint32_t n_threads, const char* what) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  HostCharge c(engine, align_up(std::max<size_t>(bytes, 1), page), what);
  *this = PinnedArena(engine.gpu(), bytes, n_threads);
  charge_ = std::move(c);
}

PinnedArena& PinnedArena::operator=(PinnedArena&& o) noexcept {
  if (this != &o) {
    release();
    gpu_ = o.gpu_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    mmapped_ = o.mmapped_;
    charge_ = std::move(o.charge_);
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

PinnedArena::~PinnedArena() { release(); }

void PinnedArena::release() noexcept {
  if (!data_) return;
  if (mmapped_) {
    gpu_->host_unregister(data_);
    munmap(data_, bytes_);
  } else {
    gpu_->host_free_pinned(data_);
  }
  data_ = nullptr;
  charge_.reset();
}

void PinnedArena::zero(size_t n, uint32_t n_threads) {
  parallel_zero(data_, std::min(n, bytes_), n_threads);
}

}  // namespace lwo
