// The capture tests' shared fixture: one eager or captured pass over a ring.
#pragma once
#include <cstdint>
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
};

}  // namespace testing
}  // namespace lwo
