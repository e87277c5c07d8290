// The capture tests' shared fixture: one eager or captured pass over a ring.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "abi_fixture.h"

namespace lwo {
namespace testing {

class CaptureFixture : public AbiTest {
 protected:
  // One pass over `layers`: stage, acquire, a consumer's read of the slot on
  // `s`, release; returns each layer's slot address. With `pool` (an eager
  // pass), each acquired slot must hold its layer's host bytes.
  std::vector<const uint8_t*> pass(lwo_ring* ring, StreamH s, const std::vector<uint32_t>& layers,
                                   lwo_pool* pool = nullptr) {
    std::vector<const uint8_t*> bases;
    for (uint32_t l : layers) {
      lwo_ticket t{};
      EXPECT_EQ(lwo_ring_stage(ring, l, &t), LWO_OK) << msg();
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      EXPECT_EQ(lwo_ring_acquire(ring, t, stream(s), &v), LWO_OK) << msg();
      if (pool) {
        EXPECT_TRUE(holds_layer(pool, v)) << "layer " << l;
      }
      gpu->read(s, v.base, v.record_bytes);
      EXPECT_EQ(lwo_ring_release(ring, t, stream(s)), LWO_OK) << msg();
      bases.push_back(static_cast<const uint8_t*>(v.base));
    }
    return bases;
  }

  // The host bytes of `layer` in `pool` (and their count in *bytes).
  const uint8_t* host_of(lwo_pool* pool, uint32_t layer, uint64_t* bytes) {
    void* p = nullptr;
    EXPECT_EQ(lwo_pool_layer_host(pool, layer, &p, bytes), LWO_OK) << msg();
    return static_cast<const uint8_t*>(p);
  }

  // The caller's end of its capture: the graph, or null (with a failure)
  // where the recording backend refuses it as CUDA would.
  void* caller_end(StreamH s) {
    try {
      return gpu->caller_capture_end(s);
    } catch (const Error& e) {
      ADD_FAILURE() << "the caller's capture did not end: " << e.what();
      return nullptr;
    }
  }

  // The caller's capture of `step` on `s` with the ring joined into it: the
  // graph, or null (with a failure).
  void* capture_joined(lwo_ring* ring, StreamH s, const std::function<void()>& step) {
    gpu->caller_capture_begin(s);
    EXPECT_EQ(lwo_ring_capture_join(ring, stream(s)), LWO_OK) << msg();
    step();
    EXPECT_EQ(lwo_ring_capture_leave(ring, stream(s)), LWO_OK) << msg();
    return caller_end(s);
  }

  // The caller's capture on `s`, which `ring` joined, ends (or, with
  // `invalidate`, is invalidated) before the ring leaves it: the leave is
  // LWO_ERR_CAPTURING and says which, and the caller's end fails.
  void end_before_leave(lwo_ring* ring, StreamH s, bool invalidate) {
    if (invalidate) {
      gpu->invalidate_capture();
      EXPECT_EQ(lwo_ring_capture_leave(ring, stream(s)), LWO_ERR_CAPTURING);
      EXPECT_TRUE(contains(msg(), "was invalidated before lwo_ring_capture_leave")) << msg();
      EXPECT_THROW(gpu->caller_capture_end(s), Error);
    } else {
      EXPECT_THROW(gpu->caller_capture_end(s), Error);  // unjoined
      EXPECT_EQ(lwo_ring_capture_leave(ring, stream(s)), LWO_ERR_CAPTURING);
      EXPECT_TRUE(contains(msg(), "ended before lwo_ring_capture_leave")) << msg();
    }
  }
};

}  // namespace testing
}  // namespace lwo
