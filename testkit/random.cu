#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>

#include "src/common/thread_pool.h"
#include "testkit/check.h"
#include "testkit/dtype.h"
#include "testkit/random.h"

namespace testkit {

void parallel_for(size_t n, const std::function<void(size_t)>& fn, unsigned n_threads) {
  lwo::ThreadPool& pool = lwo::ThreadPool::process();
  const size_t n_workers = std::min<size_t>(n, n_threads ? n_threads : pool.size());
  if (n_workers <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // After the first failure the items left are skipped; it is rethrown.
  std::atomic<bool> failed{false};
  pool.share(static_cast<uint32_t>(n_workers), n, [&](uint64_t i) {
    if (failed.load()) return;
    try {
      fn(static_cast<size_t>(i));
    } catch (...) {
      failed = true;
      throw;
    }
  });
}

namespace {

constexpr uint64_t kChunk = uint64_t(1) << 22;  // bytes or elements per work item (a multiple of 8)

struct Item {
  size_t range;
  uint64_t begin, end;
};

template <class R, class Size>
std::vector<Item> split(const std::vector<R>& ranges, Size size) {
  std::vector<Item> items;
  for (size_t r = 0; r < ranges.size(); ++r) {
    const uint64_t n = size(ranges[r]);
    for (uint64_t b = 0; b < n; b += kChunk) items.push_back({r, b, std::min(n, b + kChunk)});
  }
  return items;
}

template <class T, class Round>
void uniform_chunk(const UniformRange& r, uint64_t b, uint64_t e, Round round) {
  T* p = static_cast<T*>(r.data);
  for (uint64_t i = b; i < e; ++i) p[i] = round(uniform_pm1(counter_word(r.key, i)) * r.bound);
}

}  // namespace

void fill_bytes(const std::vector<ByteRange>& ranges, unsigned n_threads,
                const Progress& progress) {
  for (const ByteRange& r : ranges)
    if (r.offset % 8 || (r.limit != std::numeric_limits<uint64_t>::max() && r.limit % 8))
      fail("testkit::fill_bytes: offset and limit must be multiples of 8");
  const std::vector<Item> items = split(ranges, [](const ByteRange& r) { return r.bytes; });
  parallel_for(
      items.size(),
      [&](size_t i) {
        const ByteRange& r = ranges[items[i].range];
        auto* p = static_cast<uint8_t*>(r.data);
        // Items start at multiples of 8 bytes: word k of the item holds bytes 8k..8k+7.
        for (uint64_t j = items[i].begin; j < items[i].end; j += 8) {
          const uint64_t at = r.offset + j;
          const uint64_t w = at < r.limit ? counter_word(r.key, at / 8) : 0;
          std::memcpy(p + j, &w, std::min<uint64_t>(8, items[i].end - j));
        }
        if (progress) progress(items[i].end - items[i].begin);
      },
      n_threads);
}

std::vector<ByteRange> keyed_ranges(const std::vector<HostRange>& ranges, uint64_t seed) {
  std::vector<ByteRange> out;
  for (size_t i = 0; i < ranges.size(); ++i)
    out.push_back({ranges[i].data, ranges[i].bytes, key_of(seed, i)});
  return out;
}

void fill_uniform(const std::vector<UniformRange>& ranges, unsigned n_threads,
                  const Progress& progress) {
  for (const UniformRange& r : ranges)
    if (r.dtype != LWO_DTYPE_BF16 && r.dtype != LWO_DTYPE_F16 && r.dtype != LWO_DTYPE_F32)
      fail(strf("testkit::fill_uniform: dtype %s is not bf16, f16 or f32",
                lwo_dtype_name(r.dtype)));
  const std::vector<Item> items = split(ranges, [](const UniformRange& r) { return r.n; });
  parallel_for(
      items.size(),
      [&](size_t i) {
        const UniformRange& r = ranges[items[i].range];
        const uint64_t b = items[i].begin, e = items[i].end;
        switch (r.dtype) {
          case LWO_DTYPE_BF16:
            uniform_chunk<uint16_t>(r, b, e, f32_to_bf16);
            break;
          case LWO_DTYPE_F16:
            uniform_chunk<uint16_t>(r, b, e, f32_to_f16);
            break;
          default:
            uniform_chunk<float>(r, b, e, [](float v) { return v; });
            break;
        }
        if (progress) progress((e - b) * lwo_dtype_size(r.dtype));
      },
      n_threads);
}

void fill_nonzero(void* data, size_t bytes, uint64_t seed) {
  auto* b = static_cast<uint8_t*>(data);
  Rng rng(seed * 0x2545F4914F6CDD1Dull + 0x1234567ull);
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w = rng.next();
    if (w == 0) w = 0xA5A5A5A5A5A5A5A5ull;
    std::memcpy(b + i, &w, 8);
  }
  if (i < bytes) {
    const uint64_t w = rng.next() | 0x0101010101010101ull;
    std::memcpy(b + i, &w, bytes - i);
  }
}

}  // namespace testkit
