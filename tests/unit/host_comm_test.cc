// The host backend's communicators of N ranks (engine/backend.h,
// make_host_backend): N host engines, each driven from its own thread, form
// one world by a unique id; a sharded pool over it all-gathers the ranks'
// different shards, sums their different gradients in rank order, and steps
// as the whole pool does with the summed gradient; calls that disagree and a
// rank that never comes fail with their statuses.
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "bindings/c/lwo_test.h"
#include "engine/backend.h"
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

// Runs fn(rank, engine) on n threads, each with its own host engine.
void run_ranks(int n, const std::function<void(int, lwo_engine*)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&fn, r] {
      lwo_engine* e = nullptr;
      ASSERT_LWO(lwo_test_engine_create_host(LWO_TEST_HOST_POISON, &e));
      fn(r, e);
      EXPECT_EQ(lwo_engine_destroy(e), LWO_OK) << lwo_last_error_message();
    });
  for (std::thread& t : threads) t.join();
}

lwo_nccl_unique_id random_id(uint64_t seed) {
  lwo_nccl_unique_id id;
  fill_random(id.internal, sizeof id.internal, seed);
  return id;
}

// Sets the deadline through the test export (lwo_test_host_comm_timeout).
void set_deadline(uint32_t ms, uint32_t* previous = nullptr) {
  ASSERT_LWO(lwo_test_host_comm_timeout(ms, previous));
}

// The deadline shortened for the tests of this file (a failed test then
// ends in seconds, not minutes), put back after.
class HostRanks : public ::testing::Test {
 protected:
  void SetUp() override { set_deadline(20000, &old_); }
  void TearDown() override { set_deadline(old_); }
  uint32_t old_ = 0;
};

TEST_F(HostRanks, TheDeadlineIsOneTwentySecondsUntilSetAndNeverZero) {
  uint32_t was = 0;
  set_deadline(old_, &was);
  EXPECT_EQ(was, 20000u);  // SetUp's
  EXPECT_EQ(old_, 120000u);
  EXPECT_EQ(std::chrono::milliseconds(old_), kHostCommTimeout);
  EXPECT_EQ(lwo_test_host_comm_timeout(0, &was), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("timeout_ms 0"), std::string::npos);
}

TEST_F(HostRanks, CreateAndSplitGiveEachRankItsPlace) {
  for (int n : {2, 3}) {
    SCOPED_TRACE(n);
    const lwo_nccl_unique_id id = random_id(100 + n);
    // Per rank: n_ranks and rank of the world, of a split by color r % 2
    // with key -r (so reversed), and of a split with one color and equal
    // keys (so in parent order).
    std::vector<std::array<int, 6>> got(n);
    run_ranks(n, [&](int r, lwo_engine* e) {
      lwo_nccl_comm_t world = nullptr, odd_even = nullptr, all = nullptr;
      ASSERT_LWO(lwo_nccl_comm_create(e, &id, n, r, &world));
      ASSERT_LWO(lwo_nccl_comm_split(e, world, r % 2, -r, &odd_even));
      ASSERT_LWO(lwo_nccl_comm_split(e, world, 7, 0, &all));
      Backend* be = engine_backend(e);
      be->comm_info(world, &got[r][0], &got[r][1]);
      be->comm_info(odd_even, &got[r][2], &got[r][3]);
      ASSERT_LWO(lwo_nccl_comm_destroy(world));  // the children outlive it
      be->comm_info(all, &got[r][4], &got[r][5]);
      // A sharded pool over a child sees its place too.
      ModelDesc m(2);
      lwo_pool* pool = nullptr;
      ASSERT_LWO(lwo_pool_create_sharded(e, m.layers.data(), 2, odd_even, nullptr, &pool));
      lwo_pool_info info = LWO_POOL_INFO_INIT;
      ASSERT_LWO(lwo_pool_get_info(pool, &info));
      EXPECT_EQ(info.n_ranks, got[r][2]);
      EXPECT_EQ(info.rank, got[r][3]);
      ASSERT_LWO(lwo_pool_destroy(pool));
      ASSERT_LWO(lwo_nccl_comm_destroy(odd_even));
      ASSERT_LWO(lwo_nccl_comm_destroy(all));
      EXPECT_EQ(lwo_nccl_comm_destroy(all), LWO_ERR_INVALID_HANDLE);
    });
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(r);
      EXPECT_EQ(got[r][0], n);
      EXPECT_EQ(got[r][1], r);
      // Color r % 2, reversed by key: the ranks of r's color above r come first.
      int size = 0, above = 0;
      for (int k = 0; k < n; ++k)
        if (k % 2 == r % 2) {
          ++size;
          above += k > r;
        }
      EXPECT_EQ(got[r][2], size);
      EXPECT_EQ(got[r][3], above);
      EXPECT_EQ(got[r][4], n);
      EXPECT_EQ(got[r][5], r);
    }
  }
}

// What each rank keeps of one run over a sharded pool, for the main thread
// to compare.
struct RankOut {
  std::vector<uint64_t> shard_off, shard_bytes;
  std::vector<std::vector<uint8_t>> staged;      // per layer: the acquired slot's record
  std::vector<std::vector<uint8_t>> after;       // per layer: the shard after the step
  struct Grad {
    uint64_t first = 0;
    std::vector<float> values;
  };
  std::vector<std::vector<Grad>> grads;  // per layer, per tensor: lwo_grads_shard
};

// The elements of each tensor of each layer of ModelDesc(L).
std::vector<std::vector<uint64_t>> elements(const ModelDesc& m) {
  std::vector<std::vector<uint64_t>> out(m.layers.size());
  for (size_t l = 0; l < m.layers.size(); ++l)
    for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
      const lwo_tensor_desc& t = m.layers[l].tensors[k];
      uint64_t n = 1;
      for (int d = 0; d < t.n_dims; ++d) n *= static_cast<uint64_t>(t.shape[d]);
      out[l].push_back(n);
    }
  return out;
}

// Random f32 values uniform in [-1, 1) from `seed`.
std::vector<float> uniform(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Per rank, layer and tensor: the rank's own gradient.
using RankGrads = std::vector<std::vector<std::vector<float>>>;
RankGrads rank_grads(const ModelDesc& m, int rank, uint64_t seed) {
  auto ne = elements(m);
  RankGrads g(ne.size());
  for (size_t l = 0; l < ne.size(); ++l)
    for (size_t k = 0; k < ne[l].size(); ++k)
      g[l].push_back(
          uniform(ne[l][k], seed * 1000003 + static_cast<uint64_t>(rank) * 1009 + l * 31 + k));
  return g;
}

// The sum over the ranks in rank order, in f32, as the host backend sums.
RankGrads sum_in_rank_order(const std::vector<RankGrads>& per_rank) {
  RankGrads s = per_rank[0];
  for (size_t q = 1; q < per_rank.size(); ++q)
    for (size_t l = 0; l < s.size(); ++l)
      for (size_t k = 0; k < s[l].size(); ++k)
        for (size_t i = 0; i < s[l][k].size(); ++i) s[l][k][i] += per_rank[q][l][k][i];
  return s;
}

// The AdamW step both the reference and the ranks take.
lwo_optim_step_params step_params() {
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.step = 1;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  return p;
}

// An optimizer over `grads` (default config) that took one AdamW step of
// step_params() and is done; the caller destroys it.
void step_once(lwo_grads* grads, lwo_optim** optim) {
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  ASSERT_LWO(lwo_optim_create(grads, &oc, optim));
  lwo_optim_step_params p = step_params();
  ASSERT_LWO(lwo_optim_step(*optim, &p));
  ASSERT_LWO(lwo_optim_wait(*optim));
}

// Writes each layer's gradients g[l] into a begun slot and ends it, last
// layer first; then waits.
void send_grads(lwo_grads* grads, const RankGrads& g) {
  for (uint32_t l = static_cast<uint32_t>(g.size()); l-- > 0;) {
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(grads, l, nullptr, &v));
    ASSERT_EQ(v.n_tensors, g[l].size());
    for (uint32_t k = 0; k < v.n_tensors; ++k) {
      ASSERT_EQ(v.tensor_dtypes[k], LWO_DTYPE_F32);
      ASSERT_EQ(v.tensor_bytes[k], g[l][k].size() * 4);
      std::memcpy(v.tensors[k], g[l][k].data(), g[l][k].size() * 4);
    }
    ASSERT_LWO(lwo_grads_end(grads, l, nullptr));
  }
  ASSERT_LWO(lwo_grads_wait(grads));
}

// The whole records of ModelDesc(L) with weights uniform in [-1, 1), and
// the records after one AdamW step with gradient `sum`, both from a pinned
// pool on a host engine of the main thread.
void reference(const ModelDesc& m, const RankGrads& sum, std::vector<std::vector<uint8_t>>* before,
               std::vector<std::vector<uint8_t>>* after) {
  const uint32_t L = static_cast<uint32_t>(m.layers.size());
  lwo_engine* e = nullptr;
  ASSERT_LWO(lwo_test_engine_create_host(LWO_TEST_HOST_POISON, &e));
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(e, m.layers.data(), L, nullptr, &pool));
  auto ne = elements(m);
  for (uint32_t l = 0; l < L; ++l)
    for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
      const std::vector<float> w = uniform(ne[l][k], 7000 + l * 10 + k);
      const lwo_tensor_desc& t = m.layers[l].tensors[k];
      std::vector<uint8_t> b(ne[l][k] * lwo_dtype_size(t.dtype));
      for (uint64_t i = 0; i < ne[l][k]; ++i) store_f32(b.data(), t.dtype, i, w[i]);
      ASSERT_LWO(lwo_pool_write(pool, l, t.name, b.data(), b.size()));
    }
  auto records = [&](std::vector<std::vector<uint8_t>>* out) {
    for (uint32_t l = 0; l < L; ++l) {
      void* h = nullptr;
      uint64_t bytes = 0;
      ASSERT_LWO(lwo_pool_layer_host(pool, l, &h, &bytes));
      out->emplace_back(static_cast<uint8_t*>(h), static_cast<uint8_t*>(h) + bytes);
    }
  };
  records(before);
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.flags = LWO_GRADS_F32;
  lwo_grads* grads = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &grads));
  ASSERT_NO_FATAL_FAILURE(send_grads(grads, sum));
  lwo_optim* optim = nullptr;
  ASSERT_NO_FATAL_FAILURE(step_once(grads, &optim));
  records(after);
  ASSERT_LWO(lwo_optim_destroy(optim));
  ASSERT_LWO(lwo_grads_destroy(grads));
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_engine_destroy(e));
}

// Each layer's record `records[l]` into the pool's shard of it (the rank's
// part of the record); the shards' places into `o` when given.
void write_shards(lwo_pool* pool, const std::vector<std::vector<uint8_t>>& records,
                  RankOut* o = nullptr) {
  for (uint32_t l = 0; l < records.size(); ++l) {
    void* shard = nullptr;
    uint64_t off = 0, bytes = 0;
    ASSERT_LWO(lwo_pool_shard_host(pool, l, &shard, &off, &bytes));
    const uint64_t rb = records[l].size();
    if (off < rb) std::memcpy(shard, records[l].data() + off, std::min(bytes, rb - off));
    if (o) {
      o->shard_off.push_back(off);
      o->shard_bytes.push_back(bytes);
    }
  }
}

// A rank's gradients `g` through a gradient set over the sharded `pool`
// (`replicas`: its replica communicator, or null): each tensor's
// lwo_grads_shard into o.grads; then one AdamW step, the shards after it
// into o.after; the set and the optimizer destroyed.
void sum_and_step(lwo_pool* pool, lwo_nccl_comm_t replicas, const ModelDesc& m,
                  const RankGrads& g, RankOut& o) {
  const uint32_t L = static_cast<uint32_t>(m.layers.size());
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.replica_comm = replicas;
  lwo_grads* grads = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &grads));
  ASSERT_NO_FATAL_FAILURE(send_grads(grads, g));
  o.grads.resize(L);
  for (uint32_t l = 0; l < L; ++l)
    for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
      float* gs = nullptr;
      uint64_t first = 0, count = 0;
      ASSERT_LWO(lwo_grads_shard(grads, l, m.layers[l].tensors[k].name, &gs, &first, &count));
      o.grads[l].push_back({first, std::vector<float>(gs, gs + count)});
    }
  lwo_optim* optim = nullptr;
  ASSERT_NO_FATAL_FAILURE(step_once(grads, &optim));
  for (uint32_t l = 0; l < L; ++l) {
    void* shard = nullptr;
    uint64_t off = 0, bytes = 0;
    ASSERT_LWO(lwo_pool_shard_host(pool, l, &shard, &off, &bytes));
    o.after.emplace_back(static_cast<uint8_t*>(shard), static_cast<uint8_t*>(shard) + bytes);
  }
  ASSERT_LWO(lwo_optim_destroy(optim));
  ASSERT_LWO(lwo_grads_destroy(grads));
}

// N ranks over one sharded pool: each writes different random bytes into its
// shard and every rank's ring stages the whole record, assembled from all
// shards; each rank sends a different random gradient and each keeps the
// sum over the ranks of its shard's part; then the shards get the records of
// a reference pool, and an AdamW step updates each shard to the bytes the
// reference pool's step gives with the summed gradient.
TEST_F(HostRanks, AShardedPoolGathersSumsAndStepsAsTheWholePool) {
  const uint32_t L = 4;
  ModelDesc m(L);
  for (int n : {2, 3}) {
    SCOPED_TRACE(n);
    std::vector<RankGrads> per_rank;
    for (int r = 0; r < n; ++r) per_rank.push_back(rank_grads(m, r, 11 + n));
    const RankGrads sum = sum_in_rank_order(per_rank);
    std::vector<std::vector<uint8_t>> before, after;
    ASSERT_NO_FATAL_FAILURE(reference(m, sum, &before, &after));
    const lwo_nccl_unique_id id = random_id(200 + n);
    std::vector<RankOut> out(n);
    run_ranks(n, [&](int r, lwo_engine* e) {
      RankOut& o = out[r];
      lwo_nccl_comm_t comm = nullptr;
      ASSERT_LWO(lwo_nccl_comm_create(e, &id, n, r, &comm));
      lwo_pool* pool = nullptr;
      ASSERT_LWO(lwo_pool_create_sharded(e, m.layers.data(), L, comm, nullptr, &pool));
      for (uint32_t l = 0; l < L; ++l) {
        void* shard = nullptr;
        uint64_t off = 0, bytes = 0;
        ASSERT_LWO(lwo_pool_shard_host(pool, l, &shard, &off, &bytes));
        fill_random(shard, bytes, 5000 + 100 * l + r);
        o.shard_off.push_back(off);
        o.shard_bytes.push_back(bytes);
      }
      lwo_ring_config rc = LWO_RING_CONFIG_INIT;
      lwo_ring* ring = nullptr;
      ASSERT_LWO(lwo_ring_create(pool, &rc, &ring));
      for (uint32_t l = 0; l < L; ++l) {
        lwo_ticket t{};
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_LWO(lwo_ring_stage(ring, l, &t));
        ASSERT_LWO(lwo_ring_acquire(ring, t, nullptr, &v));
        const auto* b = static_cast<const uint8_t*>(v.base);
        o.staged.emplace_back(b, b + v.record_bytes);
        ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
      }
      ASSERT_LWO(lwo_ring_destroy(ring));
      // The weights of the reference: each shard its part of the records.
      ASSERT_NO_FATAL_FAILURE(write_shards(pool, before));
      ASSERT_NO_FATAL_FAILURE(sum_and_step(pool, nullptr, m, per_rank[r], o));
      ASSERT_LWO(lwo_pool_destroy(pool));
      ASSERT_LWO(lwo_nccl_comm_destroy(comm));
    });
    if (HasFailure()) return;
    for (uint32_t l = 0; l < L; ++l) {
      SCOPED_TRACE(l);
      // The record assembled from every rank's random shard bytes.
      const uint64_t rb = before[l].size();
      std::vector<uint8_t> whole;
      for (int q = 0; q < n; ++q) {
        ASSERT_EQ(out[q].shard_off[l], whole.size());
        std::vector<uint8_t> s(out[q].shard_bytes[l]);
        fill_random(s.data(), s.size(), 5000 + 100 * l + q);
        whole.insert(whole.end(), s.begin(), s.end());
      }
      ASSERT_GE(whole.size(), rb);
      whole.resize(rb);
      for (int r = 0; r < n; ++r) {
        SCOPED_TRACE(r);
        EXPECT_EQ(out[r].staged[l], whole);
        // The gradient: exactly the rank-order sum, and the shards together
        // cover every element once.
        for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
          const RankOut::Grad& g = out[r].grads[l][k];
          ASSERT_LE(g.first + g.values.size(), sum[l][k].size());
          for (size_t i = 0; i < g.values.size(); ++i)
            ASSERT_EQ(g.values[i], sum[l][k][g.first + i]) << "tensor " << k << " element " << i;
          const uint64_t end = r + 1 < n ? out[r + 1].grads[l][k].first : sum[l][k].size();
          EXPECT_EQ(g.first + g.values.size(), end) << "tensor " << k;
        }
        // The step: the shard's bytes within the record are the reference's.
        const uint64_t off = out[r].shard_off[l];
        const uint64_t in = off < rb ? std::min<uint64_t>(rb - off, out[r].after[l].size()) : 0;
        for (uint64_t i = 0; i < in; ++i)
          ASSERT_EQ(out[r].after[l][i], after[l][off + i]) << "record byte " << off + i;
        EXPECT_NE(std::memcmp(before[l].data() + off, after[l].data() + off, in), 0);
      }
    }
  }
}

// Rank r of n: its communicator (from `id`), a sharded pool of `m` over it
// and a ring of the pool (depth 2); close() destroys them.
struct ShardedRing {
  lwo_nccl_comm_t comm = nullptr;
  lwo_pool* pool = nullptr;
  lwo_ring* ring = nullptr;
  void open(lwo_engine* e, const lwo_nccl_unique_id& id, int n, int r, const ModelDesc& m) {
    ASSERT_LWO(lwo_nccl_comm_create(e, &id, n, r, &comm));
    ASSERT_LWO(lwo_pool_create_sharded(e, m.layers.data(),
                                       static_cast<uint32_t>(m.layers.size()), comm, nullptr,
                                       &pool));
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    ASSERT_LWO(lwo_ring_create(pool, &rc, &ring));
  }
  void close() {
    ASSERT_LWO(lwo_ring_destroy(ring));
    ASSERT_LWO(lwo_pool_destroy(pool));
    ASSERT_LWO(lwo_nccl_comm_destroy(comm));
  }
};

// Ranks that make different calls: on a sharded pool, one stages layer 0
// while the other stages layer 1 (records of different sizes): every rank
// gets LWO_ERR_COLLECTIVE_MISMATCH naming both calls; the world goes on.
TEST_F(HostRanks, DifferentCallsAreACollectiveMismatchOnEveryRank) {
  ModelDesc m(2);
  const lwo_nccl_unique_id id = random_id(300);
  std::vector<lwo_status_t> status(2, LWO_OK);
  std::vector<std::string> message(2);
  run_ranks(2, [&](int r, lwo_engine* e) {
    ShardedRing sr;
    ASSERT_NO_FATAL_FAILURE(sr.open(e, id, 2, r, m));
    lwo_ticket t{};
    status[r] = lwo_ring_stage(sr.ring, static_cast<uint32_t>(r), &t);
    message[r] = lwo_last_error_message();
    // The communicator still works: a collective both make alike.
    Backend* be = engine_backend(e);
    std::vector<uint8_t> send(8, static_cast<uint8_t>(r + 1)), recv(16);
    try {
      be->all_gather(send.data(), recv.data(), 8, sr.comm, nullptr);
    } catch (const Error& err) {
      ADD_FAILURE() << err.what();
    }
    EXPECT_EQ(recv[0], 1);
    EXPECT_EQ(recv[15], 2);
    ASSERT_NO_FATAL_FAILURE(sr.close());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[r], LWO_ERR_COLLECTIVE_MISMATCH) << message[r];
    EXPECT_NE(message[r].find("not making the same call"), std::string::npos) << message[r];
    for (const char* call : {"rank 0: all_gather of 768 bytes per rank",
                             "rank 1: all_gather of 1792 bytes per rank"})
      EXPECT_NE(message[r].find(call), std::string::npos) << message[r];
  }
}

// lwo_nccl_comm_create's refusals: ranks that disagree on n_ranks, and a rank
// that joins twice, fail every rank that joined (none waits for the
// deadline).
TEST_F(HostRanks, CreateRefusesDisagreeingSizesAndDuplicateRanks) {
  struct Case {
    int n[2], rank[2];
    lwo_status_t status;
    const char* says;
  } cases[] = {
      {{2, 3}, {0, 1}, LWO_ERR_COLLECTIVE_MISMATCH, "every rank must give the same n_ranks"},
      {{2, 2}, {1, 1}, LWO_ERR_INVALID_ARGUMENT, "rank 1 has joined communicator id"}};
  set_deadline(5000);  // a wait would be the bug
  uint64_t seed = 400;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.says);
    const lwo_nccl_unique_id id = random_id(++seed);
    std::vector<lwo_status_t> status(2, LWO_OK);
    std::vector<std::string> message(2);
    std::vector<lwo_nccl_comm_t> comm(2, nullptr);
    const auto t0 = std::chrono::steady_clock::now();
    run_ranks(2, [&](int r, lwo_engine* e) {
      status[r] = lwo_nccl_comm_create(e, &id, c.n[r], c.rank[r], &comm[r]);
      message[r] = lwo_last_error_message();
    });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4));
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(status[r], c.status) << message[r];
      EXPECT_NE(message[r].find(c.says), std::string::npos) << message[r];
      EXPECT_EQ(comm[r], nullptr);
    }
  }
}

// A rank that never comes: past the deadline the ranks waiting fail with
// LWO_ERR_NCCL naming the call and the missing rank, at creation and at a
// collective; a rank arriving late at a broken communicator fails at once.
TEST_F(HostRanks, AMissingRankFailsTheOthersAtTheDeadline) {
  set_deadline(300);
  lwo_engine* e = nullptr;
  ASSERT_LWO(lwo_test_engine_create_host(0, &e));
  const lwo_nccl_unique_id lonely = random_id(500);
  lwo_nccl_comm_t comm = nullptr;
  EXPECT_EQ(lwo_nccl_comm_create(e, &lonely, 3, 1, &comm), LWO_ERR_NCCL);
  std::string msg = lwo_last_error_message();
  EXPECT_NE(msg.find("rank(s) 0, 2 did not join within 0.3 s"), std::string::npos) << msg;
  EXPECT_EQ(comm, nullptr);
  ASSERT_LWO(lwo_engine_destroy(e));

  ModelDesc m(2);
  const lwo_nccl_unique_id id = random_id(501);
  std::vector<lwo_status_t> status(2, LWO_OK);
  std::vector<std::string> message(2);
  std::mutex mu;
  std::condition_variable cv;
  bool rank0_done = false;
  run_ranks(2, [&](int r, lwo_engine* eng) {
    ShardedRing sr;
    ASSERT_NO_FATAL_FAILURE(sr.open(eng, id, 2, r, m));
    lwo_ticket t{};
    if (r == 1) {  // comes only after rank 0 gave up
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return rank0_done; });
    }
    status[r] = lwo_ring_stage(sr.ring, 0, &t);
    message[r] = lwo_last_error_message();
    if (r == 0) {
      std::lock_guard<std::mutex> lock(mu);
      rank0_done = true;
      cv.notify_all();
    }
    ASSERT_NO_FATAL_FAILURE(sr.close());
  });
  EXPECT_EQ(status[0], LWO_ERR_NCCL) << message[0];
  EXPECT_NE(message[0].find("rank(s) 1 did not reach collective"), std::string::npos) << message[0];
  EXPECT_NE(message[0].find("all_gather of 768 bytes per rank"), std::string::npos) << message[0];
  EXPECT_EQ(status[1], LWO_ERR_NCCL) << message[1];
  EXPECT_NE(message[1].find("unusable"), std::string::npos) << message[1];
}

// The hierarchical layout on 4 ranks (2 nodes of 2): a world split into
// shard communicators (color rank / 2: the ranks of a node) and replica
// communicators (color rank % 2: the ranks holding the same shard on each
// node). A sharded pool over the shard communicator and gradients with the
// replica communicator: every rank's host shard is the sum of all 4 ranks'
// random gradients, (g0 + g1) + (g2 + g3) bit for bit (within a node in
// rank order, then over the nodes); an AdamW step then gives every rank the
// bytes of a whole pool stepped with that sum, so replicas stay identical.
TEST_F(HostRanks, ReplicaCommunicatorsSumTheShardsOverTheNodes) {
  const uint32_t L = 4;
  const int n = 4;
  ModelDesc m(L);
  std::vector<RankGrads> per_rank;
  for (int r = 0; r < n; ++r) per_rank.push_back(rank_grads(m, r, 77));
  RankGrads sum = sum_in_rank_order({per_rank[0], per_rank[1]});
  const RankGrads node1 = sum_in_rank_order({per_rank[2], per_rank[3]});
  for (size_t l = 0; l < sum.size(); ++l)
    for (size_t k = 0; k < sum[l].size(); ++k)
      for (size_t i = 0; i < sum[l][k].size(); ++i) sum[l][k][i] += node1[l][k][i];
  std::vector<std::vector<uint8_t>> before, after;
  ASSERT_NO_FATAL_FAILURE(reference(m, sum, &before, &after));
  const lwo_nccl_unique_id id = random_id(600);
  std::vector<RankOut> out(n);
  run_ranks(n, [&](int r, lwo_engine* e) {
    RankOut& o = out[r];
    lwo_nccl_comm_t world = nullptr, node = nullptr, replicas = nullptr;
    ASSERT_LWO(lwo_nccl_comm_create(e, &id, n, r, &world));
    ASSERT_LWO(lwo_nccl_comm_split(e, world, r / 2, r, &node));
    ASSERT_LWO(lwo_nccl_comm_split(e, world, r % 2, r, &replicas));
    lwo_pool* pool = nullptr;
    ASSERT_LWO(lwo_pool_create_sharded(e, m.layers.data(), L, node, nullptr, &pool));
    ASSERT_NO_FATAL_FAILURE(write_shards(pool, before, &o));
    ASSERT_NO_FATAL_FAILURE(sum_and_step(pool, replicas, m, per_rank[r], o));
    ASSERT_LWO(lwo_pool_destroy(pool));
    for (lwo_nccl_comm_t c : {world, node, replicas}) ASSERT_LWO(lwo_nccl_comm_destroy(c));
  });
  if (HasFailure()) return;
  for (uint32_t l = 0; l < L; ++l) {
    SCOPED_TRACE(l);
    const uint64_t rb = before[l].size();
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(r);
      EXPECT_EQ(out[r].shard_off[l], out[r % 2].shard_off[l]);  // replicas: the same shard
      for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
        const RankOut::Grad& g = out[r].grads[l][k];
        ASSERT_LE(g.first + g.values.size(), sum[l][k].size());
        for (size_t i = 0; i < g.values.size(); ++i)
          ASSERT_EQ(g.values[i], sum[l][k][g.first + i]) << "tensor " << k << " element " << i;
      }
      const uint64_t off = out[r].shard_off[l];
      const uint64_t in = off < rb ? std::min<uint64_t>(rb - off, out[r].after[l].size()) : 0;
      EXPECT_EQ(std::memcmp(out[r].after[l].data(), after[l].data() + off, in), 0);
      EXPECT_NE(std::memcmp(before[l].data() + off, after[l].data() + off, in), 0);
      EXPECT_EQ(out[r].after[l], out[r % 2].after[l]);  // bit-identical replicas
    }
  }
}

// Under the collective check, a rank that ends another layer than its node
// peer fails on the shard communicator and tells its replica communicator
// so: every rank of the 4 fails with LWO_ERR_COLLECTIVE_MISMATCH, none waits
// for a rank that has given up, and all go on once they agree again.
TEST_F(HostRanks, ACheckedEndThatDiffersFailsEveryRankOfBothCommunicators) {
  const int n = 4;
  ModelDesc m(2);
  const lwo_nccl_unique_id id = random_id(700);
  std::vector<lwo_status_t> status(n, LWO_OK);
  std::vector<std::string> message(n);
  const auto t0 = std::chrono::steady_clock::now();
  run_ranks(n, [&](int r, lwo_engine* e) {
    engine_set_check_collectives(e, true);
    lwo_nccl_comm_t world = nullptr, node = nullptr, replicas = nullptr;
    ASSERT_LWO(lwo_nccl_comm_create(e, &id, n, r, &world));
    ASSERT_LWO(lwo_nccl_comm_split(e, world, r / 2, r, &node));
    ASSERT_LWO(lwo_nccl_comm_split(e, world, r % 2, r, &replicas));
    lwo_pool* pool = nullptr;
    ASSERT_LWO(lwo_pool_create_sharded(e, m.layers.data(), 2, node, nullptr, &pool));
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    gc.replica_comm = replicas;
    lwo_grads* grads = nullptr;
    ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &grads));
    const uint32_t layer = r == 3 ? 0 : 1;  // rank 3 differs from rank 2
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(grads, layer, nullptr, &v));
    std::memset(v.base, 0, v.record_bytes);
    status[r] = lwo_grads_end(grads, layer, nullptr);
    message[r] = lwo_last_error_message();
    // Nothing was enqueued and the layer is still begun: the ranks go on
    // alike, ending layer 1 and then layer 0.
    if (r == 3) {
      ASSERT_LWO(lwo_grads_begin(grads, 1, nullptr, &v));
      std::memset(v.base, 0, v.record_bytes);
      ASSERT_LWO(lwo_grads_end(grads, 1, nullptr));
    } else {
      ASSERT_LWO(lwo_grads_end(grads, 1, nullptr));
      ASSERT_LWO(lwo_grads_begin(grads, 0, nullptr, &v));
      std::memset(v.base, 0, v.record_bytes);
    }
    ASSERT_LWO(lwo_grads_end(grads, 0, nullptr));
    ASSERT_LWO(lwo_grads_wait(grads));
    ASSERT_LWO(lwo_grads_destroy(grads));
    ASSERT_LWO(lwo_pool_destroy(pool));
    for (lwo_nccl_comm_t c : {world, node, replicas}) ASSERT_LWO(lwo_nccl_comm_destroy(c));
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(status[r], LWO_ERR_COLLECTIVE_MISMATCH) << "rank " << r << ": " << message[r];
}

}  // namespace
}  // namespace testing
}  // namespace lwo
