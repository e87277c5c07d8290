#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <vector>

#include "src/common/thread_pool.h"
#include "testkit/check.h"
#include "testkit/checksum.h"
#include "testkit/owner.h"

namespace lwo {
namespace kernels {
namespace {

constexpr int kThreads = 256;

__global__ void checksum_kernel(const uint4* __restrict__ data, size_t n_vec,
                                const uint8_t* __restrict__ tail, size_t tail_bytes,
                                unsigned long long* out) {
  unsigned long long acc = 0;
  size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t v = size_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vec; v += stride) {
    uint4 x = __ldcs(data + v);  // streaming: read once
    unsigned long long w0 = (unsigned long long)x.x | ((unsigned long long)x.y << 32);
    unsigned long long w1 = (unsigned long long)x.z | ((unsigned long long)x.w << 32);
    unsigned long long i0 = 2 * v;
    acc += w0 * (2 * i0 + 1) + w1 * (2 * i0 + 3);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && tail_bytes) {
    // Up to 15 bytes after the last full 16-byte vector: one or two words.
    size_t base_word = 2 * n_vec;
    for (size_t w = 0; w * 8 < tail_bytes; ++w) {
      unsigned long long word = 0;
      for (size_t b = 0; b < 8 && w * 8 + b < tail_bytes; ++b)
        word |= (unsigned long long)tail[w * 8 + b] << (8 * b);
      acc += word * (2 * (base_word + w) + 1);
    }
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}

uint64_t checksum_range(const uint8_t* p, size_t first_word, size_t n_words, size_t total_bytes) {
  uint64_t acc = 0;
  size_t full = std::min(first_word + n_words, total_bytes / 8);
  size_t i = first_word;
  for (; i < full; ++i) {
    uint64_t w;
    std::memcpy(&w, p + i * 8, 8);  // little-endian hosts
    acc += w * (2 * i + 1);
  }
  for (; i < first_word + n_words; ++i) {  // the zero-padded tail word
    uint64_t w = 0;
    std::memcpy(&w, p + i * 8, total_bytes - i * 8);
    acc += w * (2 * i + 1);
  }
  return acc;
}

int sm_count() {
  static std::atomic<int> cached[64];  // zero-initialised (static storage)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (cached[dev] == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0)
      sms = 132;
    cached[dev].store(sms);
  }
  return cached[dev].load();
}

}  // namespace

cudaError_t checksum_async(const void* data, size_t bytes, unsigned long long* out,
                           cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0) return cudaErrorMisalignedAddress;
  size_t n_vec = bytes / 16;
  const uint8_t* tail = static_cast<const uint8_t*>(data) + n_vec * 16;
  int sms = sm_count();
  size_t blocks = std::min<size_t>((n_vec + kThreads - 1) / kThreads, size_t(sms) * 8);
  blocks = std::max<size_t>(blocks, 1);
  checksum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(data), n_vec, tail, bytes % 16, out);
  return cudaGetLastError();
}

uint64_t checksum_host(const void* data, size_t bytes, unsigned n_threads) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  size_t n_words = (bytes + 7) / 8;
  ThreadPool& pool = ThreadPool::process();
  unsigned n = n_threads ? n_threads : pool.size();
  n = static_cast<unsigned>(std::min<size_t>(n, std::max<size_t>(1, n_words / (1u << 20))));
  if (n <= 1) return checksum_range(p, 0, n_words, bytes);
  // The sum is the same however the words are cut: one contiguous part per
  // slot of the library's host pool.
  std::vector<uint64_t> part(n, 0);
  size_t chunk = (n_words + n - 1) / n;
  pool.run(n, [&](uint32_t t) {
    size_t b = std::min(n_words, chunk * t), e = std::min(n_words, chunk * (t + 1));
    part[t] = checksum_range(p, b, e - b, bytes);
  });
  uint64_t acc = 0;
  for (uint64_t v : part) acc += v;
  return acc;
}

}  // namespace kernels
}  // namespace lwo

namespace testkit {

std::vector<uint64_t> checksums(const std::vector<HostRange>& ranges, const Progress& progress) {
  std::vector<uint64_t> out(ranges.size());
  if (ranges.size() >= lwo::ThreadPool::process().size()) {  // one range per core at a time
    parallel_for(ranges.size(), [&](size_t i) {
      out[i] = lwo::kernels::checksum_host(ranges[i].data, ranges[i].bytes, 1);
      if (progress) progress(ranges[i].bytes);
    });
  } else {  // all cores on each range
    for (size_t i = 0; i < ranges.size(); ++i) {
      out[i] = lwo::kernels::checksum_host(ranges[i].data, ranges[i].bytes, 0);
      if (progress) progress(ranges[i].bytes);
    }
  }
  return out;
}

uint64_t checksum_generated(uint64_t key, uint64_t bytes, unsigned n_threads) {
  constexpr uint64_t kWordsPerItem = uint64_t(1) << 19;
  const uint64_t n_words = (bytes + 7) / 8;
  const uint64_t n_items = (n_words + kWordsPerItem - 1) / kWordsPerItem;
  std::vector<uint64_t> part(n_items, 0);
  parallel_for(
      n_items,
      [&](size_t item) {
        const uint64_t b = item * kWordsPerItem, e = std::min(n_words, b + kWordsPerItem);
        uint64_t acc = 0;
        for (uint64_t w = b; w < e; ++w) {
          uint64_t word = counter_word(key, w);
          const uint64_t left = bytes - w * 8;
          if (left < 8) word &= (uint64_t(1) << (8 * left)) - 1;  // the zero-padded tail
          acc += word * (2 * w + 1);
        }
        part[item] = acc;
      },
      n_threads);
  uint64_t acc = 0;
  for (uint64_t p : part) acc += p;
  return acc;
}

void checksum_pass(lwo_schedule* schedule, cudaStream_t stream, unsigned long long* sums,
                   uint64_t record_bytes) {
  lwo_layer_view view = LWO_LAYER_VIEW_INIT;
  for (;;) {
    lwo_status_t s = lwo_schedule_next(schedule, stream, &view);
    if (s == LWO_END) break;
    check(s, "lwo_schedule_next");
    if (record_bytes && view.record_bytes != record_bytes)
      fail(strf("layer %u arrived with %llu bytes, expected a record of %llu", view.layer,
                static_cast<unsigned long long>(view.record_bytes),
                static_cast<unsigned long long>(record_bytes)));
    check(lwo::kernels::checksum_async(view.base, view.record_bytes, sums + view.layer, stream),
          "lwo::kernels::checksum_async");
  }
  check(lwo_schedule_reset(schedule, stream), "lwo_schedule_reset");
}

std::vector<SumMismatch> verify_sums(const unsigned long long* device_sums,
                                     const std::vector<uint64_t>& expect, uint64_t times,
                                     cudaStream_t stream) {
  std::vector<unsigned long long> got(expect.size());
  check(cudaMemcpyAsync(got.data(), device_sums, got.size() * sizeof(got[0]),
                        cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync (checksums)");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<SumMismatch> bad;
  for (size_t l = 0; l < got.size(); ++l) {
    const unsigned long long want = times * expect[l];
    if (got[l] != want) bad.push_back({static_cast<uint32_t>(l), got[l], want});
  }
  return bad;
}

double checksum_ms(lwo_pool* pool, uint32_t layer, cudaStream_t stream) {
  lwo_ring_config c = LWO_RING_CONFIG_INIT;
  c.depth = 1;
  Ring ring;
  TK_CHECK(lwo_ring_create(pool, &c, ring.out()));
  lwo_ticket t{0};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  TK_CHECK(lwo_ring_stage(ring.get(), layer, &t));
  TK_CHECK(lwo_ring_acquire(ring.get(), t, stream, &v));
  DeviceMem sum = device_alloc(sizeof(unsigned long long));
  Event a = make_event(), b = make_event();
  std::vector<double> ms;
  for (int rep = 0; rep < 6; ++rep) {
    TK_CHECK(cudaEventRecord(a.get(), stream));
    TK_CHECK(lwo::kernels::checksum_async(v.base, v.record_bytes,
                                          static_cast<unsigned long long*>(sum.get()), stream));
    TK_CHECK(cudaEventRecord(b.get(), stream));
    TK_CHECK(cudaEventSynchronize(b.get()));
    if (rep) ms.push_back(elapsed_ms(a, b));
  }
  TK_CHECK(lwo_ring_release(ring.get(), t, stream));
  TK_CHECK(cudaStreamSynchronize(stream));
  return median(ms);
}

TimedPasses time_passes(uint32_t passes, cudaStream_t consumer,
                        const std::function<void(uint32_t p)>& enqueue,
                        const std::function<void(uint32_t p, double ms)>& timed) {
  // ends[p] follows pass p's last consumer kernel.
  std::vector<Event> ends;
  for (uint32_t p = 0; p <= passes; ++p) ends.push_back(make_event());
  TimedPasses t;
  t.ms.resize(passes);
  auto finish = [&](uint32_t p) {
    TK_CHECK(cudaEventSynchronize(ends[p].get()));
    t.ms[p - 1] = elapsed_ms(ends[p - 1], ends[p]);
    timed(p, t.ms[p - 1]);
  };
  for (uint32_t p = 0; p <= passes; ++p) {
    enqueue(p);
    TK_CHECK(cudaEventRecord(ends[p].get(), consumer));
    if (p >= 2) finish(p - 1);
  }
  finish(passes);
  TK_CHECK(cudaStreamSynchronize(consumer));
  t.total_ms = elapsed_ms(ends.front(), ends.back());
  t.median_ms = median(t.ms);
  t.best_ms = *std::min_element(t.ms.begin(), t.ms.end());
  return t;
}

}  // namespace testkit
