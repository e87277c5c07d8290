// Shared helpers of the GPU tests (tests/gpu) on top of the testkit
// (testkit/: device detection, owners, the generator, the checksum
// kernel): skipping, gtest check macros, random layer descriptions, test
// pools (pinned and registered) that remember the checksums of their host
// bytes, and a collector of device-side checksum results.
//
// The tests use only the public C API (lwo.h), the CUDA runtime and the
// testkit. Every test skips with a visible reason when no CUDA device is
// present.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lwo.h"
#include "testkit/check.h"
#include "testkit/checksum.h"
#include "testkit/owner.h"
#include "testkit/random.h"

namespace lwo_test {

// Devices: why there is no usable device ("" when there is one), how many.
using testkit::device_count;
using testkit::no_device_reason;

// Owners (testkit/owner.h): get(), out() for create calls, reset() returns
// the release's status.
using testkit::Engine;
using testkit::Event;
using testkit::Ring;
using testkit::Schedule;
using testkit::Stream;
// A tensor's description, no host data, no extensions (testkit/check.h).
using testkit::tensor_desc;

// ---------------------------------------------------------------------------
// Check macros
// ---------------------------------------------------------------------------

#define LWO_REQUIRE_GPU()                                                  \
  do {                                                                     \
    if (!::lwo_test::no_device_reason().empty())                           \
      GTEST_SKIP() << ::lwo_test::no_device_reason(); /* its own words */ \
  } while (0)

// Asserts (or expects) that a call succeeded; on failure prints the call, the
// status and, for lwo, the thread's message (testkit::describe).
#define LWO_TEST_STATUS_(GTEST_EQ, ok, type, expr)                                 \
  do {                                                                            \
    type status_ = (expr);                                                        \
    GTEST_EQ(ok, status_) << #expr << " returned " << ::testkit::describe(status_); \
  } while (0)
#define CUDA_OK(expr) LWO_TEST_STATUS_(ASSERT_EQ, cudaSuccess, cudaError_t, expr)
#define CHECK_LWO(expr) LWO_TEST_STATUS_(ASSERT_EQ, LWO_OK, lwo_status_t, expr)
#define EXPECT_LWO_OK(expr) LWO_TEST_STATUS_(EXPECT_EQ, LWO_OK, lwo_status_t, expr)

// Expects status `want` from `expr`, and a message that names `call`.
#define EXPECT_LWO_ERR(want, call, expr)                                          \
  do {                                                                            \
    lwo_status_t lwo_s_ = (expr);                                                 \
    std::string lwo_m_ = lwo_last_error_message();                                \
    EXPECT_EQ(lwo_status_string(want), std::string(lwo_status_string(lwo_s_)))    \
        << #expr << " (message: \"" << lwo_m_ << "\")";                          \
    EXPECT_NE(std::string::npos, lwo_m_.find(call))                               \
        << #expr << ": the message does not name " << (call) << ": \"" << lwo_m_ << "\""; \
  } while (0)

// ---------------------------------------------------------------------------
// Scope guards and stream delays
// ---------------------------------------------------------------------------

// Runs a callable at scope exit.
template <class F>
class Defer {
 public:
  explicit Defer(F f) : f_(std::move(f)) {}
  ~Defer() { f_(); }
  Defer(const Defer&) = delete;
  Defer& operator=(const Defer&) = delete;

 private:
  F f_;
};
template <class F>
Defer<F> defer(F f) {
  return Defer<F>(std::move(f));
}

// A stream delay: the stream stands still for `us` microseconds (a host
// function), so that later work on it lags behind other streams.
inline void CUDART_CB sleep_host_fn(void* us) {
  std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<uintptr_t>(us)));
}
inline cudaError_t stream_delay(cudaStream_t s, unsigned us) {
  return cudaLaunchHostFunc(s, sleep_host_fn, reinterpret_cast<void*>(uintptr_t(us)));
}

// ---------------------------------------------------------------------------
// Random data
// ---------------------------------------------------------------------------

// Fills [p, p+n) with bytes from a seeded generator; no 8-byte word is zero.
inline void fill_random(void* p, size_t n, uint64_t seed) { testkit::fill_nonzero(p, n, seed); }

// The seed of a test: LWO_TEST_SEED from the environment, else `fallback`.
inline uint64_t test_seed(uint64_t fallback) {
  const char* s = std::getenv("LWO_TEST_SEED");
  if (s && *s) return testkit::Rng(std::strtoull(s, nullptr, 0)).next() + fallback;
  return fallback;
}

inline uint64_t host_checksum(const void* p, size_t n) {
  return lwo::kernels::checksum_host(p, n, 1);
}

// ---------------------------------------------------------------------------
// Layer descriptions
// ---------------------------------------------------------------------------

struct TensorSpec {
  std::string name;
  lwo_dtype_t dtype = LWO_DTYPE_U8;
  int32_t n_dims = 1;
  int64_t shape[LWO_MAX_DIMS] = {};
  uint64_t bytes() const {
    uint64_t n = lwo_dtype_size(dtype);
    for (int d = 0; d < n_dims; ++d) n *= static_cast<uint64_t>(shape[d]);
    return n;
  }
};
using LayerSpec = std::vector<TensorSpec>;

inline TensorSpec make_tensor(std::string name, lwo_dtype_t dtype,
                              std::initializer_list<int64_t> shape) {
  TensorSpec t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.n_dims = static_cast<int32_t>(shape.size());
  int d = 0;
  for (int64_t v : shape) t.shape[d++] = v;
  return t;
}

// A tensor of about `target` bytes (>= one element unless `empty`), of a
// random dtype, with a random shape of 0..4 dimensions.
inline TensorSpec random_tensor(std::mt19937_64& rng, std::string name, uint64_t target,
                                bool empty) {
  static const lwo_dtype_t kDtypes[] = {LWO_DTYPE_F32,     LWO_DTYPE_BF16,    LWO_DTYPE_F16,
                                        LWO_DTYPE_F8_E4M3, LWO_DTYPE_F8_E5M2, LWO_DTYPE_I8,
                                        LWO_DTYPE_U8};
  TensorSpec t;
  t.name = std::move(name);
  t.dtype = kDtypes[rng() % 7];
  uint64_t es = lwo_dtype_size(t.dtype);
  uint64_t elems = std::max<uint64_t>(1, target / es);
  t.n_dims = static_cast<int32_t>(rng() % 5);
  if (t.n_dims == 0 && (elems != 1 || empty)) t.n_dims = 1;
  for (int d = 0; d < t.n_dims; ++d) t.shape[d] = 1;
  if (t.n_dims > 0) {
    uint64_t rest = elems;
    static const uint64_t kFactors[] = {2, 3, 5, 7};
    for (int round = 0; round < 24; ++round) {
      uint64_t f = kFactors[rng() % 4];
      if (rest % f == 0) {
        t.shape[rng() % t.n_dims] *= static_cast<int64_t>(f);
        rest /= f;
      }
    }
    t.shape[rng() % t.n_dims] *= static_cast<int64_t>(rest);
    if (empty) t.shape[rng() % t.n_dims] = 0;
  }
  return t;
}

// `n_layers` layers of 1..max_tensors tensors each, tensor sizes log-uniform in
// [min_bytes, max_bytes], with now and then a 0-element tensor. Layer 1 (when
// there are at least 3 layers) holds only 0-element tensors: a 0-byte record.
inline std::vector<LayerSpec> random_layer_specs(std::mt19937_64& rng, uint32_t n_layers,
                                                 uint64_t min_bytes, uint64_t max_bytes,
                                                 uint32_t max_tensors) {
  std::vector<LayerSpec> layers(n_layers);
  double lo = std::log(static_cast<double>(std::max<uint64_t>(1, min_bytes)));
  double hi = std::log(static_cast<double>(std::max(min_bytes, max_bytes)));
  std::uniform_real_distribution<double> logsize(lo, hi);
  for (uint32_t l = 0; l < n_layers; ++l) {
    uint32_t nt = 1 + static_cast<uint32_t>(rng() % max_tensors);
    bool all_empty = (n_layers >= 3 && l == 1);
    for (uint32_t i = 0; i < nt; ++i) {
      uint64_t target = static_cast<uint64_t>(std::exp(logsize(rng)));
      bool empty = all_empty || (rng() % 30 == 0);
      char name[64];
      std::snprintf(name, sizeof name, "layers.%u.t%u", l, i);
      layers[l].push_back(random_tensor(rng, name, target, empty));
    }
  }
  return layers;
}

// The same, drawn from a generator of their own seeded with `seed`.
inline std::vector<LayerSpec> random_layer_specs(uint64_t seed, uint32_t n_layers,
                                                 uint64_t min_bytes, uint64_t max_bytes,
                                                 uint32_t max_tensors) {
  std::mt19937_64 rng(seed);
  return random_layer_specs(rng, n_layers, min_bytes, max_bytes, max_tensors);
}

// The lwo descriptions of `specs` (names point into `specs`, which must
// outlive them). host_data stays NULL; registered pools fill it in.
struct Descs {
  std::vector<std::vector<lwo_tensor_desc>> tensors;
  std::vector<lwo_layer_desc> layers;
  explicit Descs(const std::vector<LayerSpec>& specs) {
    tensors.resize(specs.size());
    layers.resize(specs.size());
    for (size_t l = 0; l < specs.size(); ++l) {
      for (const TensorSpec& t : specs[l]) {
        lwo_tensor_desc d;
        std::memset(&d, 0, sizeof d);
        d.name = t.name.c_str();
        d.dtype = t.dtype;
        d.n_dims = t.n_dims;
        for (int k = 0; k < t.n_dims; ++k) d.shape[k] = t.shape[k];
        d.host_data = nullptr;
        tensors[l].push_back(d);
      }
      layers[l].tensors = tensors[l].empty() ? nullptr : tensors[l].data();
      layers[l].n_tensors = static_cast<uint32_t>(tensors[l].size());
    }
  }
};

// ---------------------------------------------------------------------------
// Test pools: a pool plus the checksums of its host bytes
// ---------------------------------------------------------------------------

struct TensorRef {
  std::string name;
  uint64_t offset = 0;  // in the record
  uint64_t bytes = 0;
  uint64_t sum = 0;     // checksum of the host bytes
};

struct LayerRef {
  uint64_t record_bytes = 0;
  // The prefix [0, whole_bytes) of the slot must equal these host bytes
  // (pinned: the whole record; registered and contiguous: up to the end of the
  // last tensor; scattered: nothing, whole_check false).
  bool whole_check = false;
  uint64_t whole_bytes = 0;
  uint64_t whole_sum = 0;
  // What one miss moves: copies and bytes.
  uint32_t copy_runs = 0;
  uint64_t copy_bytes = 0;
  std::vector<TensorRef> tensors;
};

struct TestPool {
  lwo_pool* pool = nullptr;
  bool registered = false;
  std::vector<LayerSpec> specs;
  std::vector<LayerRef> layers;
  uint64_t max_record = 0;
  std::vector<void*> owned;  // caller memory of a registered pool (free())

  TestPool() = default;
  TestPool(const TestPool&) = delete;
  TestPool& operator=(const TestPool&) = delete;
  ~TestPool() { (void)destroy(); }
  // Destroys the pool, then frees the caller memory it was registered over.
  lwo_status_t destroy() {
    if (pool) {
      lwo_status_t s = lwo_pool_destroy(pool);
      if (s != LWO_OK) return s;
      pool = nullptr;
    }
    for (void* p : owned) std::free(p);
    owned.clear();
    return LWO_OK;
  }
  uint32_t n_layers() const { return static_cast<uint32_t>(layers.size()); }
};

// Checks the pool's metadata against the specs (tensor counts, info, layout).
inline void check_pool_metadata(TestPool& tp) {
  lwo_pool_info info;
  std::memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK_LWO(lwo_pool_get_info(tp.pool, &info));
  ASSERT_EQ(tp.specs.size(), info.n_layers);
  ASSERT_EQ(tp.registered ? LWO_POOL_REGISTERED : LWO_POOL_PINNED, info.kind);
  uint64_t total = 0, max_record = 0;
  Descs descs(tp.specs);
  tp.layers.resize(tp.specs.size());
  for (uint32_t l = 0; l < tp.specs.size(); ++l) {
    LayerRef& lr = tp.layers[l];
    CHECK_LWO(lwo_pool_record_bytes(tp.pool, l, &lr.record_bytes));
    std::vector<uint64_t> offsets(tp.specs[l].size() + 1, 0);
    uint64_t rb = 0;
    CHECK_LWO(lwo_record_layout(&descs.layers[l], offsets.data(), &rb));
    ASSERT_EQ(rb, lr.record_bytes) << "layer " << l;
    ASSERT_EQ(0u, lr.record_bytes % LWO_RECORD_ALIGN) << "layer " << l;
    uint32_t nt = 0;
    CHECK_LWO(lwo_pool_layer_tensor_count(tp.pool, l, &nt));
    ASSERT_EQ(tp.specs[l].size(), nt);
    lr.tensors.resize(nt);
    for (uint32_t i = 0; i < nt; ++i) {
      lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
      CHECK_LWO(lwo_pool_tensor_info(tp.pool, l, i, &ti));
      const TensorSpec& ts = tp.specs[l][i];
      ASSERT_STREQ(ts.name.c_str(), ti.name);
      ASSERT_EQ(ts.dtype, ti.dtype);
      ASSERT_EQ(ts.n_dims, ti.n_dims);
      for (int d = 0; d < ts.n_dims; ++d) ASSERT_EQ(ts.shape[d], ti.shape[d]);
      ASSERT_EQ(ts.bytes(), ti.bytes) << "layer " << l << " tensor " << ts.name;
      ASSERT_EQ(offsets[i], ti.offset) << "layer " << l << " tensor " << ts.name;
      ASSERT_EQ(0u, ti.offset % LWO_RECORD_ALIGN);
      ASSERT_LE(ti.offset + ti.bytes, lr.record_bytes);
      uint32_t idx = 1234567;
      CHECK_LWO(lwo_pool_find_tensor(tp.pool, l, ts.name.c_str(), &idx));
      ASSERT_EQ(i, idx);
      lr.tensors[i].name = ts.name;
      lr.tensors[i].offset = ti.offset;
      lr.tensors[i].bytes = ti.bytes;
    }
    total += lr.record_bytes;
    max_record = std::max(max_record, lr.record_bytes);
  }
  ASSERT_EQ(total, info.total_bytes);
  ASSERT_EQ(max_record, info.max_record_bytes);
  tp.max_record = max_record;
}

// Computes the per-tensor checksums from lwo_pool_tensor_host.
inline void compute_tensor_sums(TestPool& tp) {
  for (uint32_t l = 0; l < tp.n_layers(); ++l) {
    for (TensorRef& t : tp.layers[l].tensors) {
      void* p = nullptr;
      uint64_t n = 0;
      CHECK_LWO(lwo_pool_tensor_host(tp.pool, l, t.name.c_str(), &p, &n));
      ASSERT_EQ(t.bytes, n);
      t.sum = host_checksum(p, n);
    }
  }
}

// A pinned pool over `specs`, every record filled with seeded random bytes
// (the whole record, padding too), some tensors rewritten with lwo_pool_write.
inline void create_pinned_pool(lwo_engine* engine, std::vector<LayerSpec> specs, uint64_t seed,
                               TestPool* tp) {
  tp->specs = std::move(specs);
  tp->registered = false;
  Descs descs(tp->specs);
  lwo_pool_config cfg;
  lwo_pool_config_init(&cfg);
  cfg.n_threads = 2;
  CHECK_LWO(lwo_pool_create_pinned(engine, descs.layers.data(),
                                   static_cast<uint32_t>(descs.layers.size()), &cfg, &tp->pool));
  ASSERT_NE(nullptr, tp->pool);
  ASSERT_NO_FATAL_FAILURE(check_pool_metadata(*tp));
  for (uint32_t l = 0; l < tp->n_layers(); ++l) {
    LayerRef& lr = tp->layers[l];
    void* host = nullptr;
    uint64_t bytes = 0;
    CHECK_LWO(lwo_pool_layer_host(tp->pool, l, &host, &bytes));
    ASSERT_EQ(lr.record_bytes, bytes);
    if (bytes) {
      ASSERT_NE(nullptr, host);
      fill_random(host, bytes, seed * 1000003u + l);
    }
    // Every third layer: rewrite its first non-empty tensor through the API.
    if (l % 3 == 0) {
      for (const TensorRef& t : lr.tensors) {
        if (t.bytes == 0) continue;
        std::vector<uint8_t> src(t.bytes);
        fill_random(src.data(), src.size(), seed ^ (0xABCDull + l));
        CHECK_LWO(lwo_pool_write(tp->pool, l, t.name.c_str(), src.data(), src.size()));
        ASSERT_EQ(0, std::memcmp(static_cast<uint8_t*>(host) + t.offset, src.data(), t.bytes));
        break;
      }
    }
    lr.whole_check = true;
    lr.whole_bytes = bytes;
    lr.whole_sum = host_checksum(host, bytes);
    lr.copy_runs = bytes ? 1 : 0;
    lr.copy_bytes = bytes;
    // Tensor host addresses lie inside the record.
    for (const TensorRef& t : lr.tensors) {
      void* tp_host = nullptr;
      CHECK_LWO(lwo_pool_tensor_host(tp->pool, l, t.name.c_str(), &tp_host, nullptr));
      ASSERT_EQ(static_cast<uint8_t*>(host) + t.offset, tp_host);
    }
  }
  ASSERT_NO_FATAL_FAILURE(compute_tensor_sums(*tp));
}

// How a registered pool's tensors sit in caller memory.
enum class Placement {
  kContiguous,  // all layers in one malloc'd region, each as lwo_record_layout says
  kScattered,   // every tensor in its own page-aligned allocation (one region each)
  kMixed,       // per layer: contiguous, reversed, half contiguous, or scattered
};

inline void* alloc_pages(size_t bytes) {
  size_t n = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  return std::aligned_alloc(4096, n);
}

// A registered pool over caller memory laid out per `placement`, filled with
// seeded random bytes (gaps too). Records per layer the copies one miss takes
// (one per contiguous run of tensors in record order within one region).
inline void create_registered_pool(lwo_engine* engine, std::vector<LayerSpec> specs,
                                   uint64_t seed, Placement placement, TestPool* tp) {
  tp->specs = std::move(specs);
  tp->registered = true;
  Descs descs(tp->specs);
  const uint32_t n_layers = static_cast<uint32_t>(tp->specs.size());
  std::mt19937_64 rng(seed);

  struct Where {
    int region = -1;
    const uint8_t* src = nullptr;
  };
  std::vector<std::vector<Where>> where(n_layers);
  std::vector<lwo_host_region> regions;
  std::vector<std::vector<uint64_t>> offsets(n_layers);
  std::vector<uint64_t> record(n_layers, 0);
  for (uint32_t l = 0; l < n_layers; ++l) {
    offsets[l].assign(tp->specs[l].size() + 1, 0);
    CHECK_LWO(lwo_record_layout(&descs.layers[l], offsets[l].data(), &record[l]));
    where[l].resize(tp->specs[l].size());
  }
  auto add_region = [&](size_t bytes, bool pages) -> uint8_t* {
    void* p = pages ? alloc_pages(bytes) : std::malloc(std::max<size_t>(bytes, 1));
    if (!p) return nullptr;
    tp->owned.push_back(p);
    fill_random(p, std::max<size_t>(bytes, 1), seed ^ (0x51ull * (regions.size() + 1)));
    regions.push_back({p, std::max<uint64_t>(bytes, 1), nullptr});
    return static_cast<uint8_t*>(p);
  };

  if (placement == Placement::kContiguous) {
    // One malloc'd region; layer l at an odd (8-byte, not 256-byte) offset.
    std::vector<uint64_t> base(n_layers);
    uint64_t off = 8;
    for (uint32_t l = 0; l < n_layers; ++l) {
      base[l] = off;
      off += record[l] + 8 + 8 * (rng() % 7);
    }
    uint8_t* mem = add_region(off, false);
    ASSERT_NE(nullptr, mem);
    for (uint32_t l = 0; l < n_layers; ++l)
      for (size_t i = 0; i < tp->specs[l].size(); ++i)
        where[l][i] = {0, mem + base[l] + offsets[l][i]};
  } else {
    for (uint32_t l = 0; l < n_layers; ++l) {
      const size_t nt = tp->specs[l].size();
      int mode = placement == Placement::kScattered ? 3 : static_cast<int>(rng() % 4);
      if (mode == 0) {  // contiguous, in its own region
        uint8_t* mem = add_region(record[l] + 64, true);
        ASSERT_NE(nullptr, mem);
        int r = static_cast<int>(regions.size()) - 1;
        for (size_t i = 0; i < nt; ++i) where[l][i] = {r, mem + 16 + offsets[l][i]};
      } else if (mode == 1) {  // one region, tensors packed in reverse order
        uint64_t total = 0;
        for (size_t i = 0; i < nt; ++i) total += tp->specs[l][i].bytes() + 16;
        uint8_t* mem = add_region(total + 16, true);
        ASSERT_NE(nullptr, mem);
        int r = static_cast<int>(regions.size()) - 1;
        uint64_t off = 0;
        for (size_t k = nt; k-- > 0;) {
          where[l][k] = {r, mem + off};
          off += tp->specs[l][k].bytes() + 16;
        }
      } else if (mode == 2) {  // first half contiguous, the rest scattered
        size_t half = (nt + 1) / 2;
        uint64_t span = offsets[l][half - 1] + tp->specs[l][half - 1].bytes();
        uint8_t* mem = add_region(span + 32, true);
        ASSERT_NE(nullptr, mem);
        int r = static_cast<int>(regions.size()) - 1;
        for (size_t i = 0; i < half; ++i) where[l][i] = {r, mem + offsets[l][i]};
        for (size_t i = half; i < nt; ++i) {
          uint8_t* m = add_region(tp->specs[l][i].bytes() + 24, true);
          ASSERT_NE(nullptr, m);
          where[l][i] = {static_cast<int>(regions.size()) - 1, m + 24};
        }
      } else {  // every tensor in its own region
        for (size_t i = 0; i < nt; ++i) {
          uint8_t* m = add_region(tp->specs[l][i].bytes() + 8, true);
          ASSERT_NE(nullptr, m);
          where[l][i] = {static_cast<int>(regions.size()) - 1, m + 8};
        }
      }
    }
  }
  for (uint32_t l = 0; l < n_layers; ++l)
    for (size_t i = 0; i < tp->specs[l].size(); ++i)
      descs.tensors[l][i].host_data = where[l][i].src;

  CHECK_LWO(lwo_pool_create_registered(engine, descs.layers.data(), n_layers, regions.data(),
                                       static_cast<uint32_t>(regions.size()), nullptr,
                                       &tp->pool));
  ASSERT_NE(nullptr, tp->pool);
  ASSERT_NO_FATAL_FAILURE(check_pool_metadata(*tp));

  // Expected copy runs: non-empty tensors in record order merge while they stay
  // in one region at the record's relative offsets.
  for (uint32_t l = 0; l < n_layers; ++l) {
    LayerRef& lr = tp->layers[l];
    struct Run {
      int region;
      const uint8_t* src;
      uint64_t dst, end;
    };
    std::vector<Run> runs;
    for (size_t i = 0; i < tp->specs[l].size(); ++i) {
      const TensorRef& t = lr.tensors[i];
      if (t.bytes == 0) continue;
      const Where& w = where[l][i];
      if (!runs.empty() && runs.back().region == w.region &&
          runs.back().src + (t.offset - runs.back().dst) == w.src) {
        runs.back().end = t.offset + t.bytes;
        continue;
      }
      runs.push_back({w.region, w.src, t.offset, t.offset + t.bytes});
    }
    lr.copy_runs = static_cast<uint32_t>(runs.size());
    lr.copy_bytes = 0;
    for (const Run& r : runs) lr.copy_bytes += r.end - r.dst;
    void* host = nullptr;
    uint64_t hb = 0;
    lwo_status_t s = lwo_pool_layer_host(tp->pool, l, &host, &hb);
    if (runs.size() == 1 && runs[0].dst == 0) {
      EXPECT_EQ(LWO_OK, s) << "layer " << l << " is contiguous: " << lwo_last_error_message();
      if (s == LWO_OK) {
        EXPECT_EQ(runs[0].src, host) << "layer " << l;
        // The caller's bytes from the first tensor to the end of the last
        // (the record's tail padding is not copied).
        EXPECT_EQ(runs[0].end, hb) << "layer " << l;
      }
      lr.whole_check = true;
      lr.whole_bytes = runs[0].end;
      lr.whole_sum = host_checksum(runs[0].src, runs[0].end);
    } else if (runs.empty()) {
      lr.whole_check = true;  // a 0-byte layer: nothing to compare
      lr.whole_bytes = 0;
      lr.whole_sum = 0;
    } else {
      EXPECT_LWO_ERR(LWO_ERR_UNSUPPORTED, "lwo_pool_layer_host", s);
      lr.whole_check = false;
    }
    // lwo_pool_tensor_host gives back the caller's address.
    for (size_t i = 0; i < tp->specs[l].size(); ++i) {
      if (lr.tensors[i].bytes == 0) continue;
      void* p = nullptr;
      CHECK_LWO(lwo_pool_tensor_host(tp->pool, l, lr.tensors[i].name.c_str(), &p, nullptr));
      EXPECT_EQ(where[l][i].src, p);
    }
  }
  ASSERT_NO_FATAL_FAILURE(compute_tensor_sums(*tp));
}

// ---------------------------------------------------------------------------
// Device-side checksum results and their expected values
// ---------------------------------------------------------------------------

class Checks {
 public:
  Checks() = default;
  Checks(const Checks&) = delete;
  Checks& operator=(const Checks&) = delete;
  ~Checks() {
    if (dev_) {
      int prev = 0;
      (void)cudaGetDevice(&prev);
      (void)cudaSetDevice(device_);
      (void)cudaDeviceSynchronize();
      (void)cudaFree(dev_);
      (void)cudaSetDevice(prev);
    }
  }
  // Allocates `capacity` zeroed result slots on the current device.
  void init(size_t capacity) {
    CUDA_OK(cudaGetDevice(&device_));
    capacity_ = capacity;
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev_), capacity * sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(dev_, 0, capacity * sizeof(unsigned long long)));
    CUDA_OK(cudaDeviceSynchronize());
  }
  size_t size() const { return expected_.size(); }
  bool full() const { return expected_.size() >= capacity_; }
  // Enqueues checksum(data[0..bytes)) on `stream` into a new slot that must end
  // up equal to `expected`. The current device must be the stream's.
  cudaError_t add(const void* data, uint64_t bytes, uint64_t expected, cudaStream_t stream,
                  std::string what) {
    if (full()) return cudaErrorMemoryAllocation;
    unsigned long long* out = dev_ + expected_.size();
    cudaError_t e = lwo::kernels::checksum_async(data, bytes, out, stream);
    if (e != cudaSuccess) return e;
    expected_.push_back(expected);
    what_.push_back(std::move(what));
    return cudaSuccess;
  }
  // Waits for the device, copies results back and compares each.
  void verify() {
    if (expected_.empty()) return;
    int prev = 0;
    CUDA_OK(cudaGetDevice(&prev));
    CUDA_OK(cudaSetDevice(device_));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<unsigned long long> got(expected_.size());
    CUDA_OK(cudaMemcpy(got.data(), dev_, got.size() * sizeof(got[0]), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaSetDevice(prev));
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != expected_[i]) {
        if (++bad <= 20)
          ADD_FAILURE() << "checksum mismatch #" << i << " (" << what_[i] << "): device 0x"
                        << std::hex << got[i] << ", host 0x" << expected_[i] << std::dec;
      }
    }
    EXPECT_EQ(0u, bad) << bad << " of " << got.size() << " device checksums differ from the host";
  }

 private:
  int device_ = 0;
  size_t capacity_ = 0;
  unsigned long long* dev_ = nullptr;
  std::vector<uint64_t> expected_;
  std::vector<std::string> what_;
};

// ---------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------

// Skips without a device; remembers and restores the caller's current device.
class GpuOnlyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LWO_REQUIRE_GPU();
    have_gpu_ = true;
    CUDA_OK(cudaGetDevice(&saved_device_));
  }
  void TearDown() override {
    if (have_gpu_) (void)cudaSetDevice(saved_device_);
  }
  bool have_gpu_ = false;
  int saved_device_ = 0;
};

// An engine on device 0 and two consumer streams (one non-blocking, one
// created with default flags, which synchronises with the legacy stream).
class GpuTest : public GpuOnlyTest {
 protected:
  void SetUp() override {
    GpuOnlyTest::SetUp();
    if (!have_gpu_ || HasFatalFailure()) return;
    CUDA_OK(cudaSetDevice(0));
    lwo_engine_config cfg;
    lwo_engine_config_init(&cfg);
    cfg.device = 0;
    cfg.flags = engine_flags();
    CHECK_LWO(lwo_engine_create(&cfg, &engine_));
    ASSERT_NE(nullptr, engine_);
    CUDA_OK(cudaStreamCreateWithFlags(streams_[0].out(), cudaStreamNonBlocking));
    CUDA_OK(cudaStreamCreateWithFlags(streams_[1].out(), cudaStreamDefault));
  }
  void TearDown() override {
    for (Stream& s : streams_)
      if (s.get()) {
        EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(s.get()));
      }
    if (engine_) {
      EXPECT_LWO_OK(lwo_engine_check(engine_));
      EXPECT_LWO_OK(lwo_engine_synchronize(engine_));
      EXPECT_LWO_OK(lwo_engine_destroy(engine_));
      engine_ = nullptr;
    }
    GpuOnlyTest::TearDown();
  }
  cudaStream_t stream(int i) const { return streams_[i].get(); }
  // The engine's flags (lwo_engine_config.flags) for a fixture that needs some.
  virtual uint32_t engine_flags() const { return 0; }

  lwo_engine* engine_ = nullptr;
  Stream streams_[2];
};

// Stages `layer` on `ring` and acquires it on `stream`: its ticket in *t, its
// view in *v.
inline void stage_and_acquire(lwo_ring* ring, uint32_t layer, cudaStream_t stream, lwo_ticket* t,
                              lwo_layer_view* v) {
  CHECK_LWO(lwo_ring_stage(ring, layer, t));
  CHECK_LWO(lwo_ring_acquire(ring, *t, stream, v));
}

// One round trip through a ring: stages `layer`, acquires it on `stream`,
// checksums the record prefix and every tensor, releases. Adds to `checks`
// (verify later). For "the objects still work" after a failed call.
inline void round_trip(lwo_ring* ring, const TestPool& tp, uint32_t layer, cudaStream_t stream,
                       Checks* checks, const char* what) {
  lwo_ticket t{0};
  CHECK_LWO(lwo_ring_stage(ring, layer, &t));
  ASSERT_NE(0u, t.id);
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  CHECK_LWO(lwo_ring_acquire(ring, t, stream, &v));
  const LayerRef& lr = tp.layers[layer];
  ASSERT_EQ(layer, v.layer);
  ASSERT_EQ(lr.tensors.size(), v.n_tensors);
  ASSERT_EQ(lr.record_bytes, v.record_bytes);
  if (lr.whole_check && lr.whole_bytes)
    CUDA_OK(checks->add(v.base, lr.whole_bytes, lr.whole_sum, stream,
                        std::string(what) + ": record of layer " + std::to_string(layer)));
  for (uint32_t i = 0; i < v.n_tensors; ++i) {
    const TensorRef& tr = lr.tensors[i];
    void* p = nullptr;
    CHECK_LWO(lwo_ring_tensor(ring, t, tr.name.c_str(), &p));
    ASSERT_EQ(v.tensors[i], p);
    ASSERT_EQ(static_cast<uint8_t*>(v.base) + tr.offset, p);
    if (tr.bytes)
      CUDA_OK(checks->add(p, tr.bytes, tr.sum, stream,
                          std::string(what) + ": layer " + std::to_string(layer) + " tensor " +
                              tr.name));
  }
  CHECK_LWO(lwo_ring_release(ring, t, stream));
}

// A size-first struct the library writes through get(object, &out), the
// call checked.
template <class Out, class Obj, class Arg>
Out written_by(lwo_status_t (*get)(Obj*, Out*), Arg* object) {
  Out out;
  std::memset(&out, 0, sizeof out);
  out.size = sizeof out;
  lwo_status_t s = get(object, &out);
  EXPECT_EQ(LWO_OK, s) << lwo_last_error_message();
  return out;
}
inline lwo_ring_stats ring_stats(lwo_ring* ring) { return written_by(lwo_ring_get_stats, ring); }
inline lwo_ring_info ring_info(lwo_ring* ring) { return written_by(lwo_ring_get_info, ring); }

// Layers 0 .. n-1, then n-1 .. 0: a forward and a backward pass.
inline std::vector<uint32_t> forward_backward(uint32_t n) {
  std::vector<uint32_t> order;
  for (uint32_t l = 0; l < n; ++l) order.push_back(l);
  for (uint32_t l = n; l-- > 0;) order.push_back(l);
  return order;
}

inline void create_ring(lwo_pool* pool, uint32_t depth, uint32_t flags, Ring* out) {
  lwo_ring_config cfg;
  lwo_ring_config_init(&cfg);
  cfg.depth = depth;
  cfg.flags = flags;
  CHECK_LWO(lwo_ring_create(pool, &cfg, out->out()));
  ASSERT_NE(nullptr, out->get());
}

// A ring of `depth` slots over `pool` and a schedule of it over `order`.
inline void create_schedule(lwo_pool* pool, uint32_t depth, const std::vector<uint32_t>& order,
                            Ring* ring, Schedule* sched) {
  create_ring(pool, depth, 0, ring);
  if (::testing::Test::HasFatalFailure()) return;
  CHECK_LWO(lwo_schedule_create(ring->get(), order.data(), static_cast<uint32_t>(order.size()),
                                sched->out()));
}

}  // namespace lwo_test
