// The ring's state machine against the recording backend: happens-before of
// every copy, wait, record and read on thousands of random sequences.
#include <map>
#include <set>

#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

using RingTest = EngineTest;

// The checker itself: a copy and a read on two streams with no event between
// them is a violation; with record + wait it is not.
TEST_F(RingTest, CheckerFlagsUnorderedAccesses) {
  StreamH a = gpu->new_stream(), b = gpu->new_stream();
  void* dev = gpu->device_alloc(1024);
  void* host = gpu->host_alloc_pinned(1024);
  gpu->copy_h2d(dev, host, 1024, a);
  gpu->read(b, dev, 512);
  EXPECT_EQ(gpu->violations.size(), 1u);  // read not ordered after the copy
  gpu->violations.clear();

  EventH ev = gpu->event_create(false);
  gpu->event_record(ev, a);
  gpu->stream_wait(b, ev);
  gpu->read(b, dev, 512);
  EXPECT_TRUE(gpu->violations.empty());
  gpu->copy_h2d(dev, host, 1024, a);  // overwrites what b's two reads may still read
  EXPECT_EQ(gpu->violations.size(), 2u);
  gpu->violations.clear();

  gpu->event_record(ev, b);
  gpu->stream_wait(a, ev);
  gpu->copy_h2d(dev, host, 1024, a);
  EXPECT_TRUE(gpu->violations.empty());
  char pageable[64];
  gpu->copy_h2d(dev, pageable, sizeof pageable, a);  // not DMA-ready
  EXPECT_EQ(gpu->violations.size(), 1u);
  gpu->violations.clear();
  gpu->host_free_pinned(host);
  gpu->device_free(dev);
}

// Random stage / acquire / read / release on several consumer streams, every
// depth 1..8: no copy is ordered before the release of the slot's previous
// reader, every read follows its copy, and every acquired slot holds exactly
// its layer's host bytes.
TEST_F(RingTest, RandomSequencesKeepHappensBefore) {
  const uint32_t kLayers = 11;
  lwo_pool* pool = make_pool(kLayers, 3);
  std::vector<StreamH> consumers = {gpu->new_stream(), gpu->new_stream(), gpu->new_stream()};
  std::mt19937 rng(12345);
  uint64_t total_ops = 0, hits_seen = 0;
  for (uint32_t depth = 1; depth <= 8; ++depth) {
    lwo_ring* ring = make_ring(pool, depth);
    ASSERT_NE(ring, nullptr);
    struct Out {
      lwo_ticket t;
      uint32_t layer;
      bool acquired;
      StreamH stream;
      lwo_layer_view view;
    };
    std::vector<Out> out;
    for (int op = 0; op < 3000; ++op, ++total_ops) {
      uint32_t choice = rng() % 10;
      if (choice < 4) {  // stage a random layer
        uint32_t layer = rng() % kLayers;
        lwo_ticket t{};
        lwo_status_t s = lwo_ring_stage(ring, layer, &t);
        bool busy = false;
        for (const Out& o : out) busy |= (o.layer == layer);
        if (busy) {
          ASSERT_EQ(s, LWO_ERR_LAYER_BUSY) << lwo_last_error_message();
        } else if (out.size() == depth) {
          ASSERT_EQ(s, LWO_ERR_RING_FULL) << lwo_last_error_message();
        } else {
          ASSERT_EQ(s, LWO_OK) << lwo_last_error_message();
          out.push_back({t, layer, false, nullptr, LWO_LAYER_VIEW_INIT});
        }
      } else if (choice < 7 && !out.empty()) {  // acquire one
        Out& o = out[rng() % out.size()];
        if (o.acquired) continue;
        o.stream = consumers[rng() % consumers.size()];
        ASSERT_LWO(lwo_ring_acquire(ring, o.t, stream(o.stream), &o.view));
        o.acquired = true;
        ASSERT_EQ(o.view.layer, o.layer);
        ASSERT_TRUE(holds_layer(pool, o.view)) << "layer " << o.layer << " depth " << depth;
        // The consumer reads the whole record, sometimes in pieces.
        gpu->read(o.stream, o.view.base, o.view.record_bytes);
        if (o.view.n_tensors > 1) gpu->read(o.stream, o.view.tensors[1], 4);
      } else if (!out.empty()) {  // release one (acquired or not)
        size_t i = rng() % out.size();
        Out o = out[i];
        // Usually on the stream that read; sometimes join into another first.
        StreamH rs = o.acquired ? o.stream : consumers[rng() % consumers.size()];
        if (o.acquired && rng() % 4 == 0) {
          StreamH other = consumers[rng() % consumers.size()];
          EventH j = gpu->event_create(false);
          gpu->event_record(j, o.stream);
          gpu->stream_wait(other, j);
          rs = other;
        }
        ASSERT_LWO(lwo_ring_release(ring, o.t, stream(rs)));
        out.erase(out.begin() + static_cast<long>(i));
      }
      ASSERT_TRUE(gpu->violations.empty())
          << "depth " << depth << " op " << op << ": " << gpu->violations[0];
    }
    for (const Out& o : out)
      ASSERT_LWO(lwo_ring_release(ring, o.t, stream(o.acquired ? o.stream : consumers[0])));
    lwo_ring_stats st{};
    st.size = sizeof st;
    ASSERT_LWO(lwo_ring_get_stats(ring, &st));
    EXPECT_GT(st.n_hits, 0u) << "depth " << depth;
    EXPECT_EQ(st.n_copies, st.n_stages - st.n_hits);  // pinned layers: one copy each
    hits_seen += st.n_hits;
    ASSERT_LWO(lwo_ring_destroy(ring));
  }
  EXPECT_GE(total_ops, 24000u);
  EXPECT_GT(hits_seen, 100u);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Staging in order with release at once streams every layer through slots in
// LRU order; a layer released and staged again before its slot is reused is a
// hit and moves no bytes.
TEST_F(RingTest, HitsMoveNothingAndLruEvictsOldest) {
  lwo_pool* pool = make_pool(6);
  lwo_ring* ring = make_ring(pool, 3);
  StreamH c = gpu->new_stream();
  auto pass = [&](std::vector<uint32_t> layers) {
    for (uint32_t l : layers) {
      lwo_ticket t{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(acquire(ring, l, c, &t, &v));
      ASSERT_TRUE(holds_layer(pool, v));
      gpu->read(c, v.base, v.record_bytes);
      ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
    }
  };
  pass({0, 1, 2});
  uint64_t copies = gpu->stats.copies;
  pass({2, 1, 0});  // all three still in slots
  EXPECT_EQ(gpu->stats.copies, copies);
  pass({3});  // evicts the least recently released: layer 2
  EXPECT_EQ(gpu->stats.copies, copies + 1);
  pass({1, 0});  // still there
  EXPECT_EQ(gpu->stats.copies, copies + 1);
  pass({2});  // was evicted: a copy
  EXPECT_EQ(gpu->stats.copies, copies + 2);
  lwo_ring_stats st{};
  st.size = sizeof st;
  ASSERT_LWO(lwo_ring_get_stats(ring, &st));
  EXPECT_EQ(st.n_stages, 10u);
  EXPECT_EQ(st.n_hits, 5u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_reset_stats(ring));
  ASSERT_LWO(lwo_ring_get_stats(ring, &st));
  EXPECT_EQ(st.n_stages, 0u);
  destroy(ring, pool);
}

// A hit acquired on stream B while stream A may still read the previous
// occupancy: B's release must still cover A's reads before the slot is reused.
TEST_F(RingTest, HitOnAnotherStreamStillCoversEarlierReaders) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 1);
  StreamH a = gpu->new_stream(), b = gpu->new_stream(), c = gpu->new_stream();
  lwo_ticket t{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(acquire(ring, 0, a, &t, &v));
  gpu->read(a, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t, stream(a)));
  // Hit, acquired and released on b.
  ASSERT_NO_FATAL_FAILURE(acquire(ring, 0, b, &t, &v));
  gpu->read(b, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t, stream(b)));
  // Hit, released on c without acquiring.
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  // Now the slot is overwritten: must be after a's and b's reads.
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  destroy(ring, pool);
}

// After the host bytes of a layer change, a slot holding the old bytes is
// never a hit again.
TEST_F(RingTest, ChangedLayersAreCopiedAgain) {
  auto [pool, ring, c] = pool_ring_stream(3, 2);
  use(ring, pool, 0, c);
  use(ring, pool, 1, c);
  uint64_t copies = gpu->stats.copies;
  use(ring, pool, 0, c);  // hit
  EXPECT_EQ(gpu->stats.copies, copies);
  void* host = nullptr;
  uint64_t bytes = 0;
  ASSERT_LWO(lwo_pool_layer_host(pool, 0, &host, &bytes));
  fill_random(host, bytes, 777);  // an optimizer step, say
  ASSERT_LWO(lwo_pool_layer_changed(pool, 0));
  use(ring, pool, 0, c);  // copied again, and holds the new bytes
  EXPECT_EQ(gpu->stats.copies, copies + 1);
  std::vector<uint8_t> w(74 * 19 * 2, 3);
  ASSERT_LWO(lwo_pool_write(pool, 1, "weight", w.data(), w.size()));  // changes it too
  use(ring, pool, 1, c);
  EXPECT_EQ(gpu->stats.copies, copies + 2);
  use(ring, pool, 1, c);
  EXPECT_EQ(gpu->stats.copies, copies + 2);  // unchanged since: a hit
  EXPECT_EQ(lwo_pool_layer_changed(pool, 3), LWO_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(ring, pool);
}

TEST_F(RingTest, TicketMisuseGivesDistinctStatusesAndRingStaysUsable) {
  lwo_pool* pool = make_pool(4);
  lwo_ring* ring = make_ring(pool, 2);
  lwo_ring* other = make_ring(pool, 2);
  StreamH c = gpu->new_stream();
  lwo_ticket t0{}, t1{}, t2{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t0));
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t1));
  EXPECT_EQ(lwo_ring_stage(ring, 2, &t2), LWO_ERR_RING_FULL);
  EXPECT_NE(std::string(lwo_last_error_message()).find("no free slot"), std::string::npos);
  EXPECT_EQ(t2.id, 0u);
  EXPECT_EQ(lwo_ring_stage(ring, 1, &t2), LWO_ERR_LAYER_BUSY);
  EXPECT_EQ(lwo_ring_stage(ring, 4, &t2), LWO_ERR_OUT_OF_RANGE);
  EXPECT_NE(std::string(lwo_last_error_message()).find("layer 4"), std::string::npos);
  ASSERT_LWO(lwo_ring_acquire(ring, t0, stream(c), &v));
  EXPECT_EQ(lwo_ring_acquire(ring, t0, stream(c), &v), LWO_ERR_TICKET_STATE);
  void* d = nullptr;
  EXPECT_EQ(lwo_ring_tensor(ring, t0, "nope", &d), LWO_ERR_NOT_FOUND);
  ASSERT_LWO(lwo_ring_tensor(ring, t0, "weight", &d));
  EXPECT_EQ(d, v.tensors[0]);
  EXPECT_EQ(lwo_ring_acquire(other, t0, stream(c), &v), LWO_ERR_FOREIGN_TICKET);
  EXPECT_EQ(lwo_ring_release(ring, lwo_ticket{0}, stream(c)), LWO_ERR_FOREIGN_TICKET);
  ASSERT_LWO(lwo_ring_release(ring, t0, stream(c)));
  EXPECT_EQ(lwo_ring_release(ring, t0, stream(c)), LWO_ERR_STALE_TICKET);
  EXPECT_NE(std::string(lwo_last_error_message()).find("already released"), std::string::npos);
  EXPECT_EQ(lwo_ring_acquire(ring, t0, stream(c), &v), LWO_ERR_STALE_TICKET);
  ASSERT_LWO(lwo_ring_stage(ring, 2, &t2));  // reuses t0's slot
  EXPECT_EQ(lwo_ring_release(ring, t0, stream(c)), LWO_ERR_STALE_TICKET);
  EXPECT_NE(std::string(lwo_last_error_message()).find("reused"), std::string::npos);
  // Ring destroy refuses while a ticket is acquired.
  ASSERT_LWO(lwo_ring_acquire(ring, t2, stream(c), &v));
  EXPECT_EQ(lwo_ring_destroy(ring), LWO_ERR_BUSY);
  EXPECT_EQ(lwo_pool_destroy(pool), LWO_ERR_BUSY);
  // Everything still works.
  ASSERT_TRUE(holds_layer(pool, v));
  gpu->read(c, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t2, stream(c)));
  ASSERT_LWO(lwo_ring_release(ring, t1, stream(c)));
  ASSERT_NO_FATAL_FAILURE(acquire(ring, 3, c, &t0, &v));
  ASSERT_TRUE(holds_layer(pool, v));
  ASSERT_LWO(lwo_ring_release(ring, t0, stream(c)));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(other, ring, pool);
}

// Ticket serials never wrap: 65,536 more rings (depth 1) are created and
// destroyed after the first; none issues the first ring's ticket, and each
// refuses it as foreign. (Serials were 16 bits: ring 65,536 after the first
// issued the same ticket, released it as its own, and its real holder then
// got LWO_ERR_STALE_TICKET.)
TEST_F(RingTest, TicketsOfRingsCreatedLaterNeverRepeat) {
  lwo_pool* pool = make_pool(1);
  StreamH c = gpu->new_stream();
  lwo_ring* first = make_ring(pool, 1);
  lwo_ticket t1{};
  ASSERT_LWO(lwo_ring_stage(first, 0, &t1));
  ASSERT_LWO(lwo_ring_release(first, t1, stream(c)));
  for (int i = 1; i <= 65536; ++i) {
    lwo_ring* r = make_ring(pool, 1);
    ASSERT_NE(r, nullptr);
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(r, 0, &t));
    ASSERT_NE(t.id, t1.id) << "ring " << i << " after the first";
    ASSERT_EQ(lwo_ring_release(r, t1, stream(c)), LWO_ERR_FOREIGN_TICKET) << "ring " << i;
    ASSERT_LWO(lwo_ring_release(r, t, stream(c)));
    ASSERT_LWO(lwo_ring_destroy(r));
  }
  // The first ring still knows its own (ended) ticket.
  EXPECT_EQ(lwo_ring_release(first, t1, stream(c)), LWO_ERR_STALE_TICKET);
  destroy(first, pool);
}

// A ring draws a new serial after 65,535 tickets: its tickets stay distinct,
// a ticket of an earlier serial is its own (stale, not foreign), and another
// ring still refuses them.
TEST_F(RingTest, ManyTicketsOfOneRingNeverRepeat) {
  lwo_pool* pool = make_pool(1);
  StreamH c = gpu->new_stream();
  lwo_ring* ring = make_ring(pool, 1);
  lwo_ring* other = make_ring(pool, 1);
  lwo_ticket first{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &first));
  ASSERT_LWO(lwo_ring_release(ring, first, stream(c)));
  std::set<uint64_t> seen{first.id};
  lwo_ticket t{};
  for (int i = 0; i < 70000; ++i) {  // hits after the first: no copies
    ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
    ASSERT_TRUE(seen.insert(t.id).second) << "ticket " << i << " repeats";
    if (i % 1000 == 0 || i == 65534 || i == 65535) {
      EXPECT_EQ(lwo_ring_release(other, t, stream(c)), LWO_ERR_FOREIGN_TICKET);
      EXPECT_EQ(lwo_ring_release(ring, first, stream(c)), LWO_ERR_STALE_TICKET);
    }
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  }
  lwo_ticket_state_t st{};
  ASSERT_LWO(lwo_ring_ticket_state(ring, first, &st));
  EXPECT_EQ(st, LWO_TICKET_ENDED);
  EXPECT_EQ(lwo_ring_ticket_state(other, first, &st), LWO_ERR_FOREIGN_TICKET);
  destroy(other, ring, pool);
}

// A copy that fails half-way leaves the slot empty: the old layer must not be
// a hit any more (its bytes may be partly overwritten) and the ring works on.
TEST_F(RingTest, FailedCopyNeverBecomesAHit) {
  auto [pool, ring, c] = pool_ring_stream(3, 1);
  lwo_ticket t{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  gpu->fail_copy_after = 0;
  EXPECT_EQ(lwo_ring_stage(ring, 1, &t), LWO_ERR_CUDA);
  EXPECT_NE(std::string(lwo_last_error_message()).find("injected"), std::string::npos);
  uint64_t copies = gpu->stats.copies;
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));  // must copy again, not hit
  EXPECT_EQ(gpu->stats.copies, copies + 1);
  ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
  EXPECT_TRUE(holds_layer(pool, v));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  destroy(ring, pool);
}

TEST_F(RingTest, CreateFailureLeavesNothingBehind) {
  lwo_pool* pool = make_pool(2);
  size_t before = gpu->n_device_allocs();
  gpu->fail_alloc_after = 2;  // third slot fails
  lwo_ring_config c = LWO_RING_CONFIG_INIT;
  c.depth = 4;
  lwo_ring* ring = nullptr;
  EXPECT_EQ(lwo_ring_create(pool, &c, &ring), LWO_ERR_OUT_OF_MEMORY);
  EXPECT_EQ(ring, nullptr);
  EXPECT_NE(std::string(lwo_last_error_message()).find("depth 4"), std::string::npos);
  EXPECT_EQ(gpu->n_device_allocs(), before);
  ASSERT_LWO(lwo_pool_destroy(pool));  // no ring was counted
}

TEST_F(RingTest, TimingStatsAccumulate) {
  lwo_pool* pool = make_pool(4);
  lwo_ring* ring = make_ring(pool, 2, LWO_RING_TIMING);
  StreamH c = gpu->new_stream();
  for (uint32_t l = 0; l < 4; ++l) {
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(acquire(ring, l, c, &t, &v));
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  }
  lwo_ring_stats st{};
  st.size = sizeof st;
  ASSERT_LWO(lwo_ring_get_stats(ring, &st));
  EXPECT_EQ(st.n_copies, 4u);
  EXPECT_DOUBLE_EQ(st.copy_ms, 4.0);  // the recording backend's 1 ms per interval
  EXPECT_DOUBLE_EQ(st.wait_ms, 4.0);
  EXPECT_NEAR(st.bandwidth_gbps, st.bytes_copied / 4e6, 1e-9);
  destroy(ring, pool);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
