// Shared pieces of the host-only unit tests: an engine over the recording
// backend, layer descriptions, a seeded filler and page-aligned memory.
#pragma once

#include <gtest/gtest.h>

#include <set>
#include <thread>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bindings/c/testing.h"
#include "lwo.h"
#include "recording_backend.h"

#define ASSERT_LWO(call)                                                                   \
  do {                                                                                     \
    lwo_status_t s_ = (call);                                                              \
    ASSERT_EQ(s_, LWO_OK) << #call << ": " << lwo_status_string(s_) << ": "              \
                          << lwo_last_error_message();                                    \
  } while (0)

namespace lwo {
namespace testing {

// The tensors of `pool`'s layer `layer`, in order (lwo_pool_layer_tensor_count
// and lwo_pool_tensor_info); a failed call fails the test and ends the list.
inline std::vector<lwo_tensor_info> layer_tensors(lwo_pool* pool, uint32_t layer) {
  std::vector<lwo_tensor_info> out;
  uint32_t n = 0;
  lwo_status_t s = lwo_pool_layer_tensor_count(pool, layer, &n);
  EXPECT_EQ(s, LWO_OK) << "lwo_pool_layer_tensor_count: " << lwo_last_error_message();
  for (uint32_t k = 0; s == LWO_OK && k < n; ++k) {
    lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
    s = lwo_pool_tensor_info(pool, layer, k, &ti);
    EXPECT_EQ(s, LWO_OK) << "lwo_pool_tensor_info: " << lwo_last_error_message();
    if (s == LWO_OK) out.push_back(ti);
  }
  return out;
}

// One tensor description.
inline lwo_tensor_desc tensor(const char* name, lwo_dtype_t dt, std::vector<int64_t> shape,
                              const void* host = nullptr) {
  lwo_tensor_desc t{};
  t.name = name;
  t.dtype = dt;
  t.n_dims = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  t.host_data = host;
  return t;
}

// Layers of varied records: layer i has a "weight" of (i % 5 + 1) * 37 x 19
// bf16 and, for odd i, an f32 "bias".
struct ModelDesc {
  std::vector<std::vector<lwo_tensor_desc>> tensors;
  std::vector<lwo_layer_desc> layers;
  explicit ModelDesc(uint32_t n) : tensors(n), layers(n) {
    for (uint32_t i = 0; i < n; ++i) {
      tensors[i].push_back(tensor("weight", LWO_DTYPE_BF16, {(i % 5 + 1) * 37, 19}));
      if (i % 2) tensors[i].push_back(tensor("bias", LWO_DTYPE_F32, {(i % 5 + 1) * 37}));
      layers[i] = lwo_layer_desc{tensors[i].data(), static_cast<uint32_t>(tensors[i].size()), nullptr};
    }
  }
};

inline void fill_random(void* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* b = static_cast<uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(rng() >> 17);
}

// Fills p and g (of one size) with values uniform in [-1, 1) drawn from
// std::mt19937(seed) in turn: p[0], g[0], p[1], g[1], ...
inline void fill_uniform_pairs(uint32_t seed, std::vector<float>& p, std::vector<float>& g) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = u(rng);
    g[i] = u(rng);
  }
}

// Memory for registered pools, page-aligned.
struct Aligned {
  explicit Aligned(size_t bytes)
      : p(static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096))) {}
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  uint8_t* p;
};

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto be = std::make_unique<RecordingBackend>();
    gpu = be.get();
    ASSERT_LWO(engine_create(std::move(be), 0, &engine));
  }
  void TearDown() override {
    if (engine) {
      EXPECT_EQ(lwo_engine_destroy(engine), LWO_OK) << lwo_last_error_message();
    }
  }
  // A pinned pool of `n` layers of ModelDesc, filled with random bytes.
  lwo_pool* make_pool(uint32_t n, uint64_t seed = 1) {
    ModelDesc m(n);
    lwo_pool* pool = nullptr;
    EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), n, nullptr, &pool), LWO_OK)
        << lwo_last_error_message();
    for (uint32_t i = 0; pool && i < n; ++i) {
      void* p = nullptr;
      uint64_t b = 0;
      EXPECT_EQ(lwo_pool_layer_host(pool, i, &p, &b), LWO_OK);
      fill_random(p, b, seed * 1000 + i);
    }
    return pool;
  }
  lwo_ring* make_ring(lwo_pool* pool, uint32_t depth, uint32_t flags = 0) {
    lwo_ring_config c = LWO_RING_CONFIG_INIT;
    c.depth = depth;
    c.flags = flags;
    lwo_ring* ring = nullptr;
    EXPECT_EQ(lwo_ring_create(pool, &c, &ring), LWO_OK) << lwo_last_error_message();
    return ring;
  }
  // A ring of `depth` slots keeping `resident` on the device.
  lwo_ring* resident_ring(lwo_pool* pool, uint32_t depth, const std::vector<uint32_t>& resident,
                          uint32_t flags = 0) {
    lwo_ring_config c = LWO_RING_CONFIG_INIT;
    c.depth = depth;
    c.flags = flags;
    c.resident_layers = resident.data();
    c.n_resident = static_cast<uint32_t>(resident.size());
    lwo_ring* ring = nullptr;
    EXPECT_EQ(lwo_ring_create(pool, &c, &ring), LWO_OK) << lwo_last_error_message();
    return ring;
  }
  // A pool of `n` layers (make_pool), a ring of `depth` slots over it
  // (make_ring) and then a consumer stream, made in that order: for
  // `auto [pool, ring, c] = pool_ring_stream(n, depth);`.
  struct PoolRingStream {
    lwo_pool* pool;
    lwo_ring* ring;
    StreamH c;
  };
  PoolRingStream pool_ring_stream(uint32_t n, uint32_t depth) {
    lwo_pool* pool = make_pool(n);
    return {pool, make_ring(pool, depth), gpu->new_stream()};
  }
  // Does the acquired view hold exactly the host record of its layer?
  bool holds_layer(lwo_pool* pool, const lwo_layer_view& v) {
    void* host = nullptr;
    uint64_t bytes = 0;
    if (lwo_pool_layer_host(pool, v.layer, &host, &bytes) != LWO_OK) return false;
    return bytes == v.record_bytes && std::memcmp(host, v.base, bytes) == 0;
  }
  lwo_stream_t stream(StreamH s) { return static_cast<lwo_stream_t>(s); }
  // Destroys each handle in the order given (dependents first), each call
  // checked; stops at the first that fails.
  void destroy(lwo_schedule* s) { ASSERT_LWO(lwo_schedule_destroy(s)); }
  void destroy(lwo_grads* g) { ASSERT_LWO(lwo_grads_destroy(g)); }
  void destroy(lwo_ring* r) { ASSERT_LWO(lwo_ring_destroy(r)); }
  void destroy(lwo_pool* p) { ASSERT_LWO(lwo_pool_destroy(p)); }
  void destroy(lwo_checkpoint* c) { ASSERT_LWO(lwo_checkpoint_destroy(c)); }
  template <class A, class B, class... Rest>
  void destroy(A* a, B* b, Rest*... rest) {
    destroy(a);
    if (::testing::Test::HasFatalFailure()) return;
    destroy(b, rest...);
  }
  // Stages `layer` and acquires it on `s`: its ticket in *t, its view in *v.
  void acquire(lwo_ring* ring, uint32_t layer, StreamH s, lwo_ticket* t, lwo_layer_view* v) {
    ASSERT_LWO(lwo_ring_stage(ring, layer, t));
    ASSERT_LWO(lwo_ring_acquire(ring, *t, stream(s), v));
  }
  // Stage, acquire on `s`, check the bytes, read them on `s`, release on `s`.
  void use(lwo_ring* ring, lwo_pool* pool, uint32_t layer, StreamH s) {
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(acquire(ring, layer, s, &t, &v));
    ASSERT_EQ(v.layer, layer);
    ASSERT_TRUE(holds_layer(pool, v)) << "layer " << layer;
    gpu->read(s, v.base, v.record_bytes);
    ASSERT_LWO(lwo_ring_release(ring, t, stream(s)));
  }

  lwo_engine* engine = nullptr;
  RecordingBackend* gpu = nullptr;
};

}  // namespace testing
}  // namespace lwo
