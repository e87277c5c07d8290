#include "arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "error.h"
#include "layout.h"

namespace lwo {

void parallel_for_bytes(uint8_t* data, size_t bytes, uint32_t n_threads,
                        void (*fn)(uint8_t*, size_t, void*), void* arg) {
  if (bytes == 0) return;
  constexpr size_t kMinChunk = size_t(64) << 20;
  uint32_t hw = std::max(1u, std::thread::hardware_concurrency());
  uint32_t n = n_threads ? n_threads : hw;
  n = std::min<uint32_t>(n, 64);
  n = static_cast<uint32_t>(std::min<size_t>(n, (bytes + kMinChunk - 1) / kMinChunk));
  if (n <= 1) {
    fn(data, bytes, arg);
    return;
  }
  size_t chunk = align_up((bytes + n - 1) / n, 4096);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    size_t b = std::min(bytes, chunk * i);
    size_t e = std::min(bytes, chunk * (i + 1));
    if (b >= e) break;
    try {
      threads.emplace_back(fn, data + b, e - b, arg);
    } catch (...) {  // no thread: do it here
      fn(data + b, e - b, arg);
    }
  }
  for (auto& t : threads) t.join();
}

namespace {
void zero_fill(uint8_t* p, size_t n, void*) { std::memset(p, 0, n); }
}  // namespace

PinnedArena::PinnedArena(Backend& gpu, size_t bytes, uint32_t n_threads, const char* call)
    : gpu_(&gpu) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  bytes_ = align_up(std::max<size_t>(bytes, 1), page);
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p != MAP_FAILED) {
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes_, MADV_HUGEPAGE);
#endif
    parallel_for_bytes(static_cast<uint8_t*>(p), bytes_, n_threads, zero_fill, nullptr);
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
    fail(LWO_ERR_OUT_OF_MEMORY, "%s: cannot pin %zu bytes of host memory: %s", call, bytes_,
         e.what());
  }
  zero(bytes_, n_threads);
}

PinnedArena& PinnedArena::operator=(PinnedArena&& o) noexcept {
  if (this != &o) {
    release();
    gpu_ = o.gpu_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    mmapped_ = o.mmapped_;
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
}

void PinnedArena::zero(size_t n, uint32_t n_threads) {
  parallel_for_bytes(data_, std::min(n, bytes_), n_threads, zero_fill, nullptr);
}

}  // namespace lwo
