// Every misuse status on the real device: each call returns its own status,
// its message names the call, and afterwards the objects still work (a round
// trip through the ring, verified by checksum).
#include <thread>

#include "gpu/gpu_util.h"

namespace lwo_test {
namespace {

class Misuse : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (!engine_ || HasFatalFailure()) return;
    std::vector<LayerSpec> specs(5);
    for (uint32_t l = 0; l < 5; ++l) {
      specs[l].push_back(make_tensor("weight", LWO_DTYPE_BF16, {64 + 16 * l, 48}));
      specs[l].push_back(make_tensor("bias", LWO_DTYPE_F32, {48}));
      specs[l].push_back(make_tensor("scale", LWO_DTYPE_U8, {7 + l}));
    }
    specs[2].push_back(make_tensor("only_in_2", LWO_DTYPE_F8_E5M2, {33, 3}));
    ASSERT_NO_FATAL_FAILURE(create_pinned_pool(engine_, std::move(specs), test_seed(77), &tp_));
    ASSERT_NO_FATAL_FAILURE(checks_.init(1024));
  }
  void TearDown() override {
    if (tp_.pool) {
      checks_.verify();
      EXPECT_LWO_OK(tp_.destroy());
    }
    GpuTest::TearDown();
  }
  // Every layer through `ring` once more, checked by checksum.
  void still_works(lwo_ring* ring, const char* what) {
    for (uint32_t l = 0; l < tp_.n_layers(); ++l)
      ASSERT_NO_FATAL_FAILURE(round_trip(ring, tp_, l, stream(l % 2), &checks_, what));
    EXPECT_LWO_OK(lwo_engine_check(engine_));
  }
  // Acquires `t` (layer `layer`) on stream 0, checks its record, releases it.
  void acquire_check_release(lwo_ring* ring, lwo_ticket t, uint32_t layer, const char* what) {
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    CHECK_LWO(lwo_ring_acquire(ring, t, stream(0), &v));
    ASSERT_EQ(layer, v.layer);
    const LayerRef& lr = tp_.layers[layer];
    CUDA_OK(checks_.add(v.base, lr.whole_bytes, lr.whole_sum, stream(0),
                        std::string(what) + ": layer " + std::to_string(layer)));
    CHECK_LWO(lwo_ring_release(ring, t, stream(0)));
  }

  TestPool tp_;
  Checks checks_;
};

TEST_F(Misuse, RingFull) {
  for (uint32_t depth = 1; depth <= 3; ++depth) {
    SCOPED_TRACE("depth " + std::to_string(depth));
    Ring ring;
    ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, depth, 0, &ring));
    std::vector<lwo_ticket> t(depth);
    for (uint32_t l = 0; l < depth; ++l) CHECK_LWO(lwo_ring_stage(ring.get(), l, &t[l]));
    EXPECT_EQ(0u, ring_info(ring.get()).n_free);
    lwo_ticket extra{0};
    EXPECT_LWO_ERR(LWO_ERR_RING_FULL, "lwo_ring_stage", lwo_ring_stage(ring.get(), depth, &extra));
    // Also when the staged tickets are acquired (held).
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    CHECK_LWO(lwo_ring_acquire(ring.get(), t[0], stream(0), &v));
    EXPECT_LWO_ERR(LWO_ERR_RING_FULL, "lwo_ring_stage", lwo_ring_stage(ring.get(), depth + 1, &extra));
    EXPECT_EQ(uint64_t(depth), ring_stats(ring.get()).n_stages) << "failed stages are not counted";
    CHECK_LWO(lwo_ring_release(ring.get(), t[0], stream(0)));
    for (uint32_t l = 1; l < depth; ++l)
      ASSERT_NO_FATAL_FAILURE(acquire_check_release(ring.get(), t[l], l, "after RING_FULL"));
    ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after RING_FULL"));
    CHECK_LWO(ring.reset());
  }
}

TEST_F(Misuse, LayerBusy) {
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 3, 0, &ring));
  lwo_ticket t{0}, again{0};
  CHECK_LWO(lwo_ring_stage(ring.get(), 1, &t));
  EXPECT_LWO_ERR(LWO_ERR_LAYER_BUSY, "lwo_ring_stage", lwo_ring_stage(ring.get(), 1, &again));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  CHECK_LWO(lwo_ring_acquire(ring.get(), t, stream(1), &v));
  EXPECT_LWO_ERR(LWO_ERR_LAYER_BUSY, "lwo_ring_stage", lwo_ring_stage(ring.get(), 1, &again));
  EXPECT_EQ(2u, ring_info(ring.get()).n_free) << "a busy stage takes no slot";
  CUDA_OK(checks_.add(v.base, tp_.layers[1].whole_bytes, tp_.layers[1].whole_sum, stream(1),
                      "held through LAYER_BUSY"));
  CHECK_LWO(lwo_ring_release(ring.get(), t, stream(1)));
  uint64_t hits = ring_stats(ring.get()).n_hits;
  CHECK_LWO(lwo_ring_stage(ring.get(), 1, &again));
  EXPECT_EQ(hits + 1, ring_stats(ring.get()).n_hits) << "released and not overwritten: a hit";
  EXPECT_NE(t.id, again.id) << "a new occupancy has a new ticket";
  ASSERT_NO_FATAL_FAILURE(acquire_check_release(ring.get(), again, 1, "hit after LAYER_BUSY"));
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after LAYER_BUSY"));
}

TEST_F(Misuse, StaleTicket) {
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 1, 0, &ring));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  void* p = nullptr;
  // Released twice.
  lwo_ticket a{0};
  CHECK_LWO(lwo_ring_stage(ring.get(), 0, &a));
  CHECK_LWO(lwo_ring_acquire(ring.get(), a, stream(0), &v));
  CHECK_LWO(lwo_ring_release(ring.get(), a, stream(0)));
  EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_release", lwo_ring_release(ring.get(), a, stream(0)));
  // Acquired after its release.
  lwo_ticket b{0};
  CHECK_LWO(lwo_ring_stage(ring.get(), 2, &b));
  CHECK_LWO(lwo_ring_release(ring.get(), b, stream(0)));  // staged, never acquired: allowed
  EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_acquire", lwo_ring_acquire(ring.get(), b, stream(0), &v));
  EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_tensor", lwo_ring_tensor(ring.get(), b, "weight", &p));
  // Used after its slot was reused by another layer (depth 1: one slot).
  lwo_ticket c{0};
  CHECK_LWO(lwo_ring_stage(ring.get(), 3, &c));
  EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_acquire", lwo_ring_acquire(ring.get(), b, stream(0), &v));
  EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_release", lwo_ring_release(ring.get(), a, stream(0)));
  EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_tensor", lwo_ring_tensor(ring.get(), a, "weight", &p));
  ASSERT_NO_FATAL_FAILURE(acquire_check_release(ring.get(), c, 3, "after stale tickets"));
  // Used after its slot was reused by the same layer (a hit: new occupancy).
  lwo_ticket d{0};
  CHECK_LWO(lwo_ring_stage(ring.get(), 3, &d));
  EXPECT_NE(c.id, d.id);
  EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_acquire", lwo_ring_acquire(ring.get(), c, stream(0), &v));
  ASSERT_NO_FATAL_FAILURE(acquire_check_release(ring.get(), d, 3, "hit after stale tickets"));
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after STALE_TICKET"));
}

TEST_F(Misuse, TicketState) {
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &ring));
  lwo_ticket t{0};
  CHECK_LWO(lwo_ring_stage(ring.get(), 4, &t));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT, v2 = LWO_LAYER_VIEW_INIT;
  CHECK_LWO(lwo_ring_acquire(ring.get(), t, stream(0), &v));
  EXPECT_LWO_ERR(LWO_ERR_TICKET_STATE, "lwo_ring_acquire", lwo_ring_acquire(ring.get(), t, stream(1), &v2));
  EXPECT_LWO_ERR(LWO_ERR_TICKET_STATE, "lwo_ring_acquire", lwo_ring_acquire(ring.get(), t, stream(0), &v2));
  // Still acquired, still readable, released once.
  void* p = nullptr;
  CHECK_LWO(lwo_ring_tensor(ring.get(), t, "bias", &p));
  EXPECT_EQ(v.tensors[1], p);
  CUDA_OK(checks_.add(v.base, tp_.layers[4].whole_bytes, tp_.layers[4].whole_sum, stream(0),
                      "after TICKET_STATE"));
  CHECK_LWO(lwo_ring_release(ring.get(), t, stream(0)));
  EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_release", lwo_ring_release(ring.get(), t, stream(0)));
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after TICKET_STATE"));
}

TEST_F(Misuse, ForeignTicket) {
  Ring r1, r2;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &r1));
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &r2));
  lwo_ticket t1{0}, t2{0};
  CHECK_LWO(lwo_ring_stage(r1.get(), 0, &t1));
  CHECK_LWO(lwo_ring_stage(r2.get(), 0, &t2));  // same layer, same slot index, other ring
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  void* p = nullptr;
  EXPECT_LWO_ERR(LWO_ERR_FOREIGN_TICKET, "lwo_ring_acquire", lwo_ring_acquire(r2.get(), t1, stream(0), &v));
  EXPECT_LWO_ERR(LWO_ERR_FOREIGN_TICKET, "lwo_ring_release", lwo_ring_release(r2.get(), t1, stream(0)));
  EXPECT_LWO_ERR(LWO_ERR_FOREIGN_TICKET, "lwo_ring_tensor", lwo_ring_tensor(r2.get(), t1, "weight", &p));
  EXPECT_LWO_ERR(LWO_ERR_FOREIGN_TICKET, "lwo_ring_acquire", lwo_ring_acquire(r1.get(), t2, stream(0), &v));
  // Ticket id 0 is never a ticket.
  const lwo_ticket zero{0};
  EXPECT_LWO_ERR(LWO_ERR_FOREIGN_TICKET, "lwo_ring_acquire", lwo_ring_acquire(r1.get(), zero, stream(0), &v));
  EXPECT_LWO_ERR(LWO_ERR_FOREIGN_TICKET, "lwo_ring_release", lwo_ring_release(r1.get(), zero, stream(0)));
  EXPECT_LWO_ERR(LWO_ERR_FOREIGN_TICKET, "lwo_ring_tensor", lwo_ring_tensor(r1.get(), zero, "weight", &p));
  // Both tickets still belong to their rings and work there.
  ASSERT_NO_FATAL_FAILURE(acquire_check_release(r1.get(), t1, 0, "ring 1 after FOREIGN_TICKET"));
  ASSERT_NO_FATAL_FAILURE(acquire_check_release(r2.get(), t2, 0, "ring 2 after FOREIGN_TICKET"));
  ASSERT_NO_FATAL_FAILURE(still_works(r1.get(), "ring 1 after FOREIGN_TICKET"));
  ASSERT_NO_FATAL_FAILURE(still_works(r2.get(), "ring 2 after FOREIGN_TICKET"));
}

TEST_F(Misuse, InvalidHandle) {
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  lwo_ticket t{0};
  // A destroyed ring: the library checks handles against its registry, so the
  // dangling pointer is never dereferenced. No object is created between the
  // destroy and the checks (a new one could reuse the address).
  {
    lwo_ring* dead = nullptr;
    lwo_ring_config cfg = LWO_RING_CONFIG_INIT;
    CHECK_LWO(lwo_ring_create(tp_.pool, &cfg, &dead));
    CHECK_LWO(lwo_ring_destroy(dead));
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_ring_stage", lwo_ring_stage(dead, 0, &t));
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_ring_acquire", lwo_ring_acquire(dead, t, stream(0), &v));
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_ring_release", lwo_ring_release(dead, t, stream(0)));
    lwo_ring_info in;
    in.size = sizeof in;
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_ring_get_info", lwo_ring_get_info(dead, &in));
    lwo_ring_stats st;
    st.size = sizeof st;
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_ring_get_stats", lwo_ring_get_stats(dead, &st));
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_ring_destroy", lwo_ring_destroy(dead));
    uint32_t order[] = {0, 1};
    lwo_schedule* s = nullptr;
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_schedule_create", lwo_schedule_create(dead, order, 2, &s));
    EXPECT_EQ(nullptr, s);
  }
  // NULL where a handle is required; a handle of the wrong kind.
  EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_ring_stage", lwo_ring_stage(nullptr, 0, &t));
  EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_ring_stage",
                 lwo_ring_stage(reinterpret_cast<lwo_ring*>(tp_.pool), 0, &t));
  EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_pool_record_bytes",
                 lwo_pool_record_bytes(reinterpret_cast<lwo_pool*>(engine_), 0, nullptr));
  // A destroyed schedule.
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &ring));
  {
    uint32_t order[] = {0, 1, 2};
    lwo_schedule* dead = nullptr;
    CHECK_LWO(lwo_schedule_create(ring.get(), order, 3, &dead));
    CHECK_LWO(lwo_schedule_next(dead, stream(0), &v));
    CHECK_LWO(lwo_schedule_destroy(dead));
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_schedule_next", lwo_schedule_next(dead, stream(0), &v));
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_schedule_reset", lwo_schedule_reset(dead, stream(0)));
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_schedule_destroy", lwo_schedule_destroy(dead));
  }
  // A destroyed pool and a destroyed engine (a second engine of this device).
  {
    lwo_engine* e2 = nullptr;
    CHECK_LWO(lwo_engine_create(nullptr, &e2));
    Descs descs(tp_.specs);
    lwo_pool* p2 = nullptr;
    CHECK_LWO(lwo_pool_create_pinned(e2, descs.layers.data(), 2, nullptr, &p2));
    CHECK_LWO(lwo_pool_destroy(p2));
    lwo_ring* r = nullptr;
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_ring_create", lwo_ring_create(p2, nullptr, &r));
    EXPECT_EQ(nullptr, r);
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_pool_destroy", lwo_pool_destroy(p2));
    CHECK_LWO(lwo_engine_destroy(e2));
    lwo_pool* p3 = nullptr;
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_pool_create_pinned",
                   lwo_pool_create_pinned(e2, descs.layers.data(), 2, nullptr, &p3));
    EXPECT_EQ(nullptr, p3);
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_engine_check", lwo_engine_check(e2));
    EXPECT_LWO_ERR(LWO_ERR_INVALID_HANDLE, "lwo_engine_destroy", lwo_engine_destroy(e2));
  }
  // Destroying NULL is a no-op.
  EXPECT_LWO_OK(lwo_ring_destroy(nullptr));
  EXPECT_LWO_OK(lwo_pool_destroy(nullptr));
  EXPECT_LWO_OK(lwo_schedule_destroy(nullptr));
  EXPECT_LWO_OK(lwo_engine_destroy(nullptr));
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after INVALID_HANDLE"));
}

TEST_F(Misuse, OutOfRange) {
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &ring));
  const uint32_t n = tp_.n_layers();
  lwo_ticket t{0};
  EXPECT_LWO_ERR(LWO_ERR_OUT_OF_RANGE, "lwo_ring_stage", lwo_ring_stage(ring.get(), n, &t));
  EXPECT_LWO_ERR(LWO_ERR_OUT_OF_RANGE, "lwo_ring_stage", lwo_ring_stage(ring.get(), UINT32_MAX, &t));
  EXPECT_EQ(2u, ring_info(ring.get()).n_free);
  uint64_t bytes = 0;
  EXPECT_LWO_ERR(LWO_ERR_OUT_OF_RANGE, "lwo_pool_record_bytes", lwo_pool_record_bytes(tp_.pool, n, &bytes));
  uint32_t count = 0;
  EXPECT_LWO_ERR(LWO_ERR_OUT_OF_RANGE, "lwo_pool_layer_tensor_count",
                 lwo_pool_layer_tensor_count(tp_.pool, n, &count));
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  EXPECT_LWO_ERR(LWO_ERR_OUT_OF_RANGE, "lwo_pool_tensor_info", lwo_pool_tensor_info(tp_.pool, 0, 3, &ti));
  EXPECT_LWO_ERR(LWO_ERR_OUT_OF_RANGE, "lwo_pool_tensor_info", lwo_pool_tensor_info(tp_.pool, n, 0, &ti));
  void* host = nullptr;
  EXPECT_LWO_ERR(LWO_ERR_OUT_OF_RANGE, "lwo_pool_layer_host", lwo_pool_layer_host(tp_.pool, n, &host, &bytes));
  uint8_t buf[4] = {1, 2, 3, 4};
  EXPECT_LWO_ERR(LWO_ERR_OUT_OF_RANGE, "lwo_pool_write", lwo_pool_write(tp_.pool, n, "bias", buf, 4));
  uint32_t order[] = {0, 1, n, 2};
  lwo_schedule* s = nullptr;
  EXPECT_LWO_ERR(LWO_ERR_OUT_OF_RANGE, "lwo_schedule_create", lwo_schedule_create(ring.get(), order, 4, &s));
  EXPECT_EQ(nullptr, s);
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after OUT_OF_RANGE"));
}

TEST_F(Misuse, NotFound) {
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &ring));
  lwo_ticket t{0};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), 3, stream(0), &t, &v));
  void* p = nullptr;
  EXPECT_LWO_ERR(LWO_ERR_NOT_FOUND, "lwo_ring_tensor", lwo_ring_tensor(ring.get(), t, "nope", &p));
  EXPECT_LWO_ERR(LWO_ERR_NOT_FOUND, "lwo_ring_tensor", lwo_ring_tensor(ring.get(), t, "only_in_2", &p));
  EXPECT_LWO_ERR(LWO_ERR_NOT_FOUND, "lwo_ring_tensor", lwo_ring_tensor(ring.get(), t, "Weight", &p));
  EXPECT_LWO_ERR(LWO_ERR_NOT_FOUND, "lwo_ring_tensor", lwo_ring_tensor(ring.get(), t, "", &p));
  uint32_t idx = 0;
  EXPECT_LWO_ERR(LWO_ERR_NOT_FOUND, "lwo_pool_find_tensor", lwo_pool_find_tensor(tp_.pool, 3, "only_in_2", &idx));
  CHECK_LWO(lwo_pool_find_tensor(tp_.pool, 2, "only_in_2", &idx));
  EXPECT_EQ(3u, idx);
  void* host = nullptr;
  EXPECT_LWO_ERR(LWO_ERR_NOT_FOUND, "lwo_pool_tensor_host",
                 lwo_pool_tensor_host(tp_.pool, 0, "weights", &host, nullptr));
  uint8_t buf[4] = {1, 2, 3, 4};
  EXPECT_LWO_ERR(LWO_ERR_NOT_FOUND, "lwo_pool_write", lwo_pool_write(tp_.pool, 0, "nope", buf, 4));
  // The ticket is still acquired and readable through its real names.
  CHECK_LWO(lwo_ring_tensor(ring.get(), t, "scale", &p));
  EXPECT_EQ(v.tensors[2], p);
  const LayerRef& lr = tp_.layers[3];
  CUDA_OK(checks_.add(p, lr.tensors[2].bytes, lr.tensors[2].sum, stream(0), "scale after NOT_FOUND"));
  CUDA_OK(checks_.add(v.base, lr.whole_bytes, lr.whole_sum, stream(0), "layer 3 after NOT_FOUND"));
  CHECK_LWO(lwo_ring_release(ring.get(), t, stream(0)));
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after NOT_FOUND"));
}

TEST_F(Misuse, SizeMismatch) {
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &ring));
  const TensorRef& w = tp_.layers[1].tensors[0];
  std::vector<uint8_t> src(w.bytes + 8);
  fill_random(src.data(), src.size(), 999);
  EXPECT_LWO_ERR(LWO_ERR_SIZE_MISMATCH, "lwo_pool_write",
                 lwo_pool_write(tp_.pool, 1, w.name.c_str(), src.data(), w.bytes + 1));
  EXPECT_LWO_ERR(LWO_ERR_SIZE_MISMATCH, "lwo_pool_write",
                 lwo_pool_write(tp_.pool, 1, w.name.c_str(), src.data(), w.bytes - 1));
  EXPECT_LWO_ERR(LWO_ERR_SIZE_MISMATCH, "lwo_pool_write",
                 lwo_pool_write(tp_.pool, 1, w.name.c_str(), src.data(), 0));
  // Nothing was written: the host record is unchanged.
  void* host = nullptr;
  uint64_t bytes = 0;
  CHECK_LWO(lwo_pool_layer_host(tp_.pool, 1, &host, &bytes));
  EXPECT_EQ(tp_.layers[1].whole_sum, host_checksum(host, bytes));
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after SIZE_MISMATCH"));
}

TEST_F(Misuse, Busy) {
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &ring));
  EXPECT_LWO_ERR(LWO_ERR_BUSY, "lwo_pool_destroy", lwo_pool_destroy(tp_.pool));
  EXPECT_LWO_ERR(LWO_ERR_BUSY, "lwo_engine_destroy", lwo_engine_destroy(engine_));
  lwo_ticket t{0};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(stage_and_acquire(ring.get(), 2, stream(1), &t, &v));
  EXPECT_LWO_ERR(LWO_ERR_BUSY, "lwo_ring_destroy", lwo_ring_destroy(ring.get()));
  // The ring survived: its ticket is still good.
  CUDA_OK(checks_.add(v.base, tp_.layers[2].whole_bytes, tp_.layers[2].whole_sum, stream(1),
                      "held through BUSY"));
  CHECK_LWO(lwo_ring_release(ring.get(), t, stream(1)));
  {
    uint32_t order[] = {0, 1};
    Schedule s;
    CHECK_LWO(lwo_schedule_create(ring.get(), order, 2, s.out()));
    EXPECT_LWO_ERR(LWO_ERR_BUSY, "lwo_ring_destroy", lwo_ring_destroy(ring.get()));
    CHECK_LWO(s.reset());
  }
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after BUSY"));
  // A ticket staged but never acquired does not keep the ring alive.
  CHECK_LWO(lwo_ring_stage(ring.get(), 4, &t));
  CHECK_LWO(ring.reset());
  // Without the ring, the pool can go (TearDown destroys it and the engine).
}

TEST_F(Misuse, InvalidArgument) {
  lwo_ring* r = nullptr;
  lwo_ring_config rc;
  lwo_ring_config_init(&rc);
  rc.depth = 0;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_create", lwo_ring_create(tp_.pool, &rc, &r));
  EXPECT_EQ(nullptr, r);
  rc.depth = 4097;  // 1..4096
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_create", lwo_ring_create(tp_.pool, &rc, &r));
  lwo_ring_config_init(&rc);
  rc.size = 0;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_create", lwo_ring_create(tp_.pool, &rc, &r));
  rc.size = 4;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_create", lwo_ring_create(tp_.pool, &rc, &r));
  lwo_ring_config_init(&rc);
  rc.flags = 0x4u;  // the first bit no flag names
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_create", lwo_ring_create(tp_.pool, &rc, &r));
  rc.flags = LWO_RING_TIMING | 0x80000000u;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_create", lwo_ring_create(tp_.pool, &rc, &r));
  EXPECT_EQ(nullptr, r);
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_create", lwo_ring_create(tp_.pool, nullptr, nullptr));

  lwo_engine* e = nullptr;
  lwo_engine_config ec;
  lwo_engine_config_init(&ec);
  ec.flags = 0x80;  // no such flag (0x1 is LWO_ENGINE_CHECK_COLLECTIVES)
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_engine_create", lwo_engine_create(&ec, &e));
  lwo_engine_config_init(&ec);
  ec.size = 0;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_engine_create", lwo_engine_create(&ec, &e));
  lwo_engine_config_init(&ec);
  ec.device = -1;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_engine_create", lwo_engine_create(&ec, &e));
  EXPECT_EQ(nullptr, e);

  Descs descs(tp_.specs);
  lwo_pool* p = nullptr;
  lwo_pool_config pc;
  lwo_pool_config_init(&pc);
  pc.flags = 1;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_pool_create_pinned",
                 lwo_pool_create_pinned(engine_, descs.layers.data(), 2, &pc, &p));
  lwo_pool_config_init(&pc);
  pc.size = 2;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_pool_create_pinned",
                 lwo_pool_create_pinned(engine_, descs.layers.data(), 2, &pc, &p));
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_pool_create_pinned",
                 lwo_pool_create_pinned(engine_, descs.layers.data(), 0, nullptr, &p));
  {
    Descs bad(tp_.specs);
    bad.tensors[0][1].dtype = static_cast<lwo_dtype_t>(99);
    EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_pool_create_pinned",
                   lwo_pool_create_pinned(engine_, bad.layers.data(), 2, nullptr, &p));
  }
  {
    Descs bad(tp_.specs);
    bad.tensors[1][0].shape[1] = -3;
    EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_pool_create_pinned",
                   lwo_pool_create_pinned(engine_, bad.layers.data(), 2, nullptr, &p));
  }
  {
    Descs bad(tp_.specs);
    uint8_t junk[64];
    bad.tensors[0][0].host_data = junk;  // pinned pools own their memory
    EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_pool_create_pinned",
                   lwo_pool_create_pinned(engine_, bad.layers.data(), 2, nullptr, &p));
  }
  EXPECT_EQ(nullptr, p);

  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 2, 0, &ring));
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_stage", lwo_ring_stage(ring.get(), 0, nullptr));
  EXPECT_EQ(2u, ring_info(ring.get()).n_free) << "a failed stage takes no slot";
  lwo_ticket t{0};
  CHECK_LWO(lwo_ring_stage(ring.get(), 0, &t));
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_acquire", lwo_ring_acquire(ring.get(), t, stream(0), nullptr));
  ASSERT_NO_FATAL_FAILURE(acquire_check_release(ring.get(), t, 0, "acquired after a NULL view"));
  lwo_ring_info small;
  small.size = 0;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_ring_get_info", lwo_ring_get_info(ring.get(), &small));
  uint32_t order[] = {0};
  lwo_schedule* s = nullptr;
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_schedule_create", lwo_schedule_create(ring.get(), order, 0, &s));
  EXPECT_LWO_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_schedule_create", lwo_schedule_create(ring.get(), nullptr, 1, &s));
  EXPECT_EQ(nullptr, s);
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after INVALID_ARGUMENT"));
}

// Messages: set on failure, cleared by the next success, kept per thread.
TEST_F(Misuse, MessagesArePerThreadAndClearedOnSuccess) {
  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp_.pool, 1, 0, &ring));
  lwo_ticket t{0};
  EXPECT_EQ(LWO_ERR_OUT_OF_RANGE, lwo_ring_stage(ring.get(), 1000, &t));
  std::string mine = lwo_last_error_message();
  EXPECT_NE(std::string::npos, mine.find("1000")) << "the message names the value: " << mine;
  std::string other = "unset";
  std::thread th([&] { other = lwo_last_error_message(); });
  th.join();
  EXPECT_EQ("", other) << "another thread's message is its own";
  EXPECT_EQ(mine, lwo_last_error_message()) << "unchanged by the other thread";
  CHECK_LWO(lwo_ring_stage(ring.get(), 0, &t));
  EXPECT_STREQ("", lwo_last_error_message()) << "a successful call clears the message";
  CHECK_LWO(lwo_ring_release(ring.get(), t, stream(0)));
  ASSERT_NO_FATAL_FAILURE(still_works(ring.get(), "after messages"));
}

}  // namespace
}  // namespace lwo_test
