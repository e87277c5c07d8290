// Ring tickets and gradient queries through the C ABI, on the recording
// backend: lwo_ring_ticket_state, lwo_ring_query, lwo_ring_release_all,
// lwo_grads_query.
#include "abi_fixture.h"

namespace lwo {
namespace testing {
namespace {

/* ---------------------------------------------------------------------- */
/* Rings: ticket queries and release_all                                  */
/* ---------------------------------------------------------------------- */

using RingTickets = AbiTest;

// lwo_ring_ticket_state follows a ticket: STAGED, ACQUIRED, then ENDED once
// released or once its slot is reused (also by a hit); ticket 0 and another
// ring's tickets are LWO_ERR_FOREIGN_TICKET. lwo_ring_query: landed for live
// tickets (the recording backend reports every event done, so always 1),
// LWO_ERR_STALE_TICKET once ended.
TEST_F(RingTickets, TicketStateAndQuery) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 1);
  lwo_ring* other = make_ring(pool, 1);
  StreamH c = gpu->new_stream();
  lwo_ticket t0{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t0));
  EXPECT_EQ(state(ring, t0), LWO_TICKET_STAGED);
  uint32_t landed = 7;
  ASSERT_LWO(lwo_ring_query(ring, t0, &landed));
  EXPECT_EQ(landed, 1u);
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_acquire(ring, t0, stream(c), &v));
  EXPECT_EQ(state(ring, t0), LWO_TICKET_ACQUIRED);
  landed = 7;
  ASSERT_LWO(lwo_ring_query(ring, t0, &landed));
  EXPECT_EQ(landed, 1u);
  gpu->read(c, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t0, stream(c)));
  EXPECT_EQ(state(ring, t0), LWO_TICKET_ENDED);
  landed = 7;
  EXPECT_EQ(lwo_ring_query(ring, t0, &landed), LWO_ERR_STALE_TICKET);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_query: ")) << msg();
  EXPECT_EQ(landed, 7u);  // left as it was

  // A hit takes the slot again under a new ticket: the old one stays ended.
  lwo_ticket t1{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t1));
  EXPECT_NE(t1.id, t0.id);
  EXPECT_EQ(ring_stats(ring).n_hits, 1u);
  EXPECT_EQ(state(ring, t0), LWO_TICKET_ENDED);
  EXPECT_EQ(state(ring, t1), LWO_TICKET_STAGED);
  ASSERT_LWO(lwo_ring_query(ring, t1, &landed));
  EXPECT_EQ(landed, 1u);  // a hit has landed
  ASSERT_LWO(lwo_ring_release(ring, t1, stream(c)));
  // A copy of another layer reuses the slot.
  lwo_ticket t2{};
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t2));
  EXPECT_EQ(state(ring, t1), LWO_TICKET_ENDED);
  EXPECT_EQ(state(ring, t2), LWO_TICKET_STAGED);
  EXPECT_EQ(lwo_ring_query(ring, t1, &landed), LWO_ERR_STALE_TICKET);

  // Foreign tickets.
  lwo_ticket_state_t s = LWO_TICKET_STATE_FORCE_32;
  EXPECT_EQ(lwo_ring_ticket_state(ring, lwo_ticket{0}, &s), LWO_ERR_FOREIGN_TICKET);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_ticket_state: ")) << msg();
  EXPECT_EQ(s, LWO_TICKET_STATE_FORCE_32);
  lwo_ticket ot{};
  ASSERT_LWO(lwo_ring_stage(other, 2, &ot));
  EXPECT_EQ(lwo_ring_ticket_state(ring, ot, &s), LWO_ERR_FOREIGN_TICKET);
  EXPECT_EQ(lwo_ring_ticket_state(other, t2, &s), LWO_ERR_FOREIGN_TICKET);
  EXPECT_EQ(lwo_ring_query(ring, ot, &landed), LWO_ERR_FOREIGN_TICKET);
  EXPECT_EQ(lwo_ring_query(ring, lwo_ticket{0}, &landed), LWO_ERR_FOREIGN_TICKET);
  EXPECT_EQ(s, LWO_TICKET_STATE_FORCE_32);
  EXPECT_EQ(state(other, ot), LWO_TICKET_STAGED);
  EXPECT_EQ(lwo_ring_ticket_state(ring, t2, nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_ring_query(ring, t2, nullptr), LWO_ERR_INVALID_ARGUMENT);

  ASSERT_LWO(lwo_ring_release(other, ot, stream(c)));
  ASSERT_LWO(lwo_ring_release(ring, t2, stream(c)));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(other, ring, pool);
}

// lwo_ring_release_all releases every staged and acquired ticket, as
// lwo_ring_release would one by one: the count, the tickets ENDED, every slot
// free, the layers hits afterwards, and no slot reused before the release's
// stream work (also for a hit that was never acquired, whose release must
// cover the previous occupancy's readers).
TEST_F(RingTickets, ReleaseAllReleasesEveryLiveTicketInStreamOrder) {
  lwo_pool* pool = make_pool(6);
  lwo_ring* ring = make_ring(pool, 3);
  StreamH a = gpu->new_stream(), b = gpu->new_stream();
  uint32_t n = 99;
  ASSERT_LWO(lwo_ring_release_all(ring, stream(b), &n));
  EXPECT_EQ(n, 0u);

  // Layer 0: acquired and read on a, released; staged again (a hit, not
  // acquired). Layer 1: acquired and read on b. Layer 2: staged only.
  lwo_ticket t0{}, t1{}, t2{}, old{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(acquire(ring, 0, a, &old, &v));
  gpu->read(a, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, old, stream(a)));
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t0));
  ASSERT_NO_FATAL_FAILURE(acquire(ring, 1, b, &t1, &v));
  gpu->read(b, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_stage(ring, 2, &t2));
  EXPECT_EQ(n_free(ring), 0u);

  n = 99;
  ASSERT_LWO(lwo_ring_release_all(ring, stream(b), &n));
  EXPECT_EQ(n, 3u);
  EXPECT_EQ(n_free(ring), 3u);
  for (lwo_ticket t : {t0, t1, t2}) {
    EXPECT_EQ(state(ring, t), LWO_TICKET_ENDED);
    EXPECT_EQ(lwo_ring_release(ring, t, stream(b)), LWO_ERR_STALE_TICKET);
  }
  ASSERT_LWO(lwo_ring_release_all(ring, stream(b), nullptr));  // n_released may be NULL
  // Released, the layers are still in their slots: hits.
  uint64_t hits = ring_stats(ring).n_hits;
  for (uint32_t l : {0u, 1u, 2u}) {
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(ring, l, &t));
    ASSERT_LWO(lwo_ring_release(ring, t, stream(b)));
  }
  EXPECT_EQ(ring_stats(ring).n_hits, hits + 3);
  // Overwrite every slot: each copy must follow the reads on a and b.
  for (uint32_t l : {3u, 4u, 5u}) {
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(ring, l, &t));
  }
  EXPECT_EQ(n_free(ring), 0u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_release_all(ring, stream(a), &n));
  EXPECT_EQ(n, 3u);
  destroy(ring, pool);
}

// A depth-1 ring: a hit released by lwo_ring_release_all on a stream other
// than the first reader's; the next copy into the slot must still follow
// that reader (the checker would flag the copy otherwise).
TEST_F(RingTickets, ReleaseAllOfAHitCoversEarlierReaders) {
  lwo_pool* pool = make_pool(2);
  lwo_ring* ring = make_ring(pool, 1);
  StreamH a = gpu->new_stream(), b = gpu->new_stream();
  lwo_ticket t{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(acquire(ring, 0, a, &t, &v));
  gpu->read(a, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t, stream(a)));
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));  // hit
  uint32_t n = 0;
  ASSERT_LWO(lwo_ring_release_all(ring, stream(b), &n));
  EXPECT_EQ(n, 1u);
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t));  // overwrites the slot
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_release(ring, t, stream(b)));
  destroy(ring, pool);
}

// lwo_ring_release_all is LWO_ERR_BUSY while a schedule of the ring exists,
// and then releases nothing (n_released left as it was).
TEST_F(RingTickets, ReleaseAllIsBusyWhileAScheduleExists) {
  auto [pool, ring, c] = pool_ring_stream(3, 2);
  lwo_ticket mine{};
  ASSERT_LWO(lwo_ring_stage(ring, 2, &mine));
  uint32_t order[2] = {0, 1};
  lwo_schedule* s = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 2, &s));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_schedule_next(s, stream(c), &v));
  uint32_t n = 99;
  EXPECT_EQ(lwo_ring_release_all(ring, stream(c), &n), LWO_ERR_BUSY);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_release_all: ")) << msg();
  EXPECT_TRUE(contains(msg(), "schedule")) << msg();
  EXPECT_EQ(n, 99u);
  EXPECT_EQ(state(ring, mine), LWO_TICKET_STAGED);  // nothing was released
  EXPECT_EQ(n_free(ring), 0u);
  ASSERT_LWO(lwo_schedule_destroy(s));
  ASSERT_LWO(lwo_ring_release_all(ring, stream(c), &n));
  EXPECT_EQ(n, 1u);
  EXPECT_EQ(state(ring, mine), LWO_TICKET_ENDED);
  destroy(ring, pool);
}

/* ---------------------------------------------------------------------- */
/* Gradients: lwo_grads_query                                              */
/* ---------------------------------------------------------------------- */

using GradsQuery = AbiTest;

// lwo_grads_query: done 1 with nothing ended (a begun layer does not count),
// and after ends as the backend reports (the recording backend completes
// every copy at once, so 1); NULL done is refused.
TEST_F(GradsQuery, QueryReportsDone) {
  lwo_pool* pool = make_pool(2);
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  uint32_t done = 7;
  ASSERT_LWO(lwo_grads_query(g, &done));
  EXPECT_EQ(done, 1u);
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(g, 0, stream(c), &v));
  done = 7;
  ASSERT_LWO(lwo_grads_query(g, &done));
  EXPECT_EQ(done, 1u);
  gpu->write(c, v.base, v.record_bytes);
  ASSERT_LWO(lwo_grads_end(g, 0, stream(c)));
  done = 7;
  ASSERT_LWO(lwo_grads_query(g, &done));
  EXPECT_EQ(done, 1u);
  ASSERT_LWO(lwo_grads_wait(g));
  done = 7;
  ASSERT_LWO(lwo_grads_query(g, &done));
  EXPECT_EQ(done, 1u);
  EXPECT_EQ(lwo_grads_query(g, nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_query: ")) << msg();
  EXPECT_EQ(lwo_grads_query(nullptr, &done), LWO_ERR_INVALID_HANDLE);
  destroy(g, pool);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
