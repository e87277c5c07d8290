// What the C ABI tests share (abi_structs_test.cc, abi_errors_test.cc,
// pool_access_test.cc, ring_tickets_test.cc, checkpoint_calls_test.cc), on the
// recording backend: a sentinel for untouched output bytes, message checks, a
// layer with an empty tensor, a registered model, and the fixture with its
// pool, ring and ticket queries.
#pragma once

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>

#include "checkpoint_files.h"
#include "test_util.h"

namespace lwo {
namespace testing {

constexpr uint8_t kSentinel = 0xCD;

inline std::string msg() { return lwo_last_error_message(); }
inline bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}
inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
// True if every byte of [from, to) of `p` is the sentinel.
inline bool untouched(const void* p, size_t from, size_t to) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (size_t i = from; i < to; ++i)
    if (b[i] != kSentinel) return false;
  return true;
}
template <class T>
T* bogus() {  // a non-NULL pointer an output must not keep
  return reinterpret_cast<T*>(uintptr_t{0x1234});
}

// A layer of an f32 "w" [4, 8] and a 0-element f32 "empty" [0, 3].
struct WithEmpty {
  lwo_tensor_desc t[2];
  lwo_layer_desc layer;
  WithEmpty() {
    t[0] = tensor("w", LWO_DTYPE_F32, {4, 8});
    t[1] = tensor("empty", LWO_DTYPE_F32, {0, 3});
    layer = lwo_layer_desc{t, 2, nullptr};
  }
};

// A registered pool of ModelDesc layers laid out exactly as their records, in
// one region: every layer moves in one copy and has a host address.
struct RegisteredModel {
  ModelDesc m;
  std::vector<uint64_t> base, rec;
  std::unique_ptr<Aligned> mem;
  uint64_t total = 0;
  explicit RegisteredModel(uint32_t n) : m(n), base(n), rec(n) {
    std::vector<std::vector<uint64_t>> offs(n);
    for (uint32_t i = 0; i < n; ++i) {
      offs[i].resize(m.layers[i].n_tensors);
      EXPECT_EQ(lwo_record_layout(&m.layers[i], offs[i].data(), &rec[i]), LWO_OK);
      base[i] = total;
      total += rec[i];
    }
    mem = std::make_unique<Aligned>(total);
    fill_random(mem->p, total, 77);
    for (uint32_t i = 0; i < n; ++i)
      for (uint32_t k = 0; k < m.layers[i].n_tensors; ++k)
        m.tensors[i][k].host_data = mem->p + base[i] + offs[i][k];
  }
  lwo_host_region region() const { return lwo_host_region{mem->p, total, nullptr}; }
};

class AbiTest : public EngineTest {
 protected:
  lwo_pool_info pool_info(lwo_pool* pool) {
    lwo_pool_info pi = LWO_POOL_INFO_INIT;
    EXPECT_EQ(lwo_pool_get_info(pool, &pi), LWO_OK) << msg();
    return pi;
  }
  lwo_ring_stats ring_stats(lwo_ring* ring) {
    lwo_ring_stats st{};
    st.size = sizeof st;
    EXPECT_EQ(lwo_ring_get_stats(ring, &st), LWO_OK) << msg();
    return st;
  }
  lwo_ticket_state_t state(lwo_ring* ring, lwo_ticket t) {
    lwo_ticket_state_t s = LWO_TICKET_STATE_FORCE_32;
    EXPECT_EQ(lwo_ring_ticket_state(ring, t, &s), LWO_OK) << msg();
    return s;
  }
  uint32_t n_free(lwo_ring* ring) {
    lwo_ring_info info{};
    info.size = sizeof info;
    EXPECT_EQ(lwo_ring_get_info(ring, &info), LWO_OK) << msg();
    return info.n_free;
  }
};

// A config struct `Cfg` followed by a tail of bytes a newer lwo would know.
template <class Cfg>
struct Larger {
  union {
    Cfg cfg;
    uint8_t bytes[sizeof(Cfg) + 24];
  };
  explicit Larger(const Cfg& c) {
    std::memset(bytes, 0, sizeof bytes);
    cfg = c;
    cfg.size = sizeof bytes;
  }
  // Sets byte `i` past the library's struct; returns its offset.
  size_t poke(size_t i) {
    bytes[sizeof(Cfg) + i] = 1;
    return sizeof(Cfg) + i;
  }
};

}  // namespace testing
}  // namespace lwo
