// Sharded pools on two GPUs of one process (one thread per rank): the slots
// hold exactly the unsharded records, and ranks that describe different
// layers are refused instead of hanging.
#include <cstdlib>
#include <thread>

#include "gpu_util.h"

namespace lwo_test {
namespace {

struct Model {
  std::vector<int64_t> rows;          // layer l: tensor "w" [rows[l], 1000] bf16
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<uint64_t> record_sums;  // checksum of the whole record (zero padded)
  std::vector<uint64_t> record_bytes;
};

Model make_model(uint32_t L, uint64_t seed) {
  Model m;
  std::mt19937_64 rng(seed);
  for (uint32_t l = 0; l < L; ++l) {
    int64_t rows = 1 + static_cast<int64_t>(rng() % 3000);
    m.rows.push_back(rows);
    m.bytes.emplace_back(static_cast<size_t>(rows) * 1000 * 2);
    fill_random(m.bytes.back().data(), m.bytes.back().size(), rng());
    uint64_t rb = (m.bytes.back().size() + 255) / 256 * 256;
    std::vector<uint8_t> rec(rb, 0);
    std::memcpy(rec.data(), m.bytes.back().data(), m.bytes.back().size());
    m.record_bytes.push_back(rb);
    m.record_sums.push_back(lwo::kernels::checksum_host(rec.data(), rec.size()));
  }
  return m;
}

// Layer descriptions of a Model: layer l is one bf16 tensor "w" [rows[l], 1000].
void model_descs(const Model& m, std::vector<lwo_tensor_desc>& td, std::vector<lwo_layer_desc>& ld) {
  td.assign(m.rows.size(), lwo_tensor_desc{});
  ld.resize(m.rows.size());
  for (size_t l = 0; l < m.rows.size(); ++l) {
    td[l] = tensor_desc("w", LWO_DTYPE_BF16, {m.rows[l], 1000});
    ld[l] = lwo_layer_desc{&td[l], 1, nullptr};
  }
}

// Rank `rank` of `n_ranks` (two by default): its engine on GPU `rank` (engine
// flags `flags`) and its communicator.
void open_rank(int rank, const lwo_nccl_unique_id& id, uint32_t flags, Engine* eng,
               lwo_nccl_comm_t* comm, int n_ranks = 2) {
  CUDA_OK(cudaSetDevice(rank));
  lwo_engine_config ec = LWO_ENGINE_CONFIG_INIT;
  ec.device = rank;
  ec.flags = flags;
  CHECK_LWO(lwo_engine_create(&ec, eng->out()));
  CHECK_LWO(lwo_nccl_comm_create(eng->get(), &id, n_ranks, rank, comm));
}

// One rank: engine, communicator, sharded pool, ring, a random schedule.
void run_rank(int rank, const lwo_nccl_unique_id& id, const Model& m, uint32_t n_layers_given,
              lwo_status_t want_pool, const std::vector<uint32_t>& order) {
  Engine eng;
  lwo_nccl_comm_t comm = nullptr;
  open_rank(rank, id, 0u, &eng, &comm);
  auto comm_guard = defer([&] { EXPECT_LWO_OK(lwo_nccl_comm_destroy(comm)); });
  if (::testing::Test::HasFatalFailure()) return;
  std::vector<lwo_tensor_desc> td;
  std::vector<lwo_layer_desc> ld;
  model_descs(m, td, ld);
  lwo_pool* pool = nullptr;
  lwo_status_t s = lwo_pool_create_sharded(eng.get(), ld.data(), n_layers_given, comm, nullptr, &pool);
  if (want_pool != LWO_OK) {
    EXPECT_EQ(lwo_status_string(want_pool), std::string(lwo_status_string(s)))
        << "rank " << rank << ": " << lwo_last_error_message();
    EXPECT_NE(std::string(lwo_last_error_message()).find("lwo_pool_create_sharded"), std::string::npos);
    if (s == LWO_OK) EXPECT_LWO_OK(lwo_pool_destroy(pool));
    return;
  }
  CHECK_LWO(s);
  auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  for (uint32_t l = 0; l < n_layers_given; ++l)
    CHECK_LWO(lwo_pool_write(pool, l, "w", m.bytes[l].data(), m.bytes[l].size()));
  void* shard = nullptr;
  uint64_t off = 0, sb = 0;
  CHECK_LWO(lwo_pool_shard_host(pool, 0, &shard, &off, &sb));
  EXPECT_EQ(off, rank * sb);
  for (uint32_t depth : {1u, 2u, 3u}) {
    Ring ring;
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    rc.depth = depth;
    CHECK_LWO(lwo_ring_create(pool, &rc, ring.out()));
    Schedule sched;
    CHECK_LWO(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()), sched.out()));
    Stream st;
    CUDA_OK(cudaStreamCreateWithFlags(st.out(), cudaStreamNonBlocking));
    Checks checks;
    checks.init(order.size());
    if (::testing::Test::HasFatalFailure()) return;
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    while ((s = lwo_schedule_next(sched.get(), st.get(), &v)) == LWO_OK)
      CUDA_OK(checks.add(v.base, v.record_bytes, m.record_sums[v.layer], st.get(),
                         "rank " + std::to_string(rank) + " layer " + std::to_string(v.layer)));
    EXPECT_EQ(s, LWO_END) << lwo_last_error_message();
    checks.verify();
    CHECK_LWO(sched.reset());
  }
  EXPECT_LWO_OK(lwo_engine_synchronize(eng.get()));
}

// Tests of two ranks in this process, one per GPU: skipped unless there are
// two devices; NVLink multicast off; id the ranks' NCCL unique id.
class Sharded : public ::testing::Test {
 protected:
  void SetUp() override {
    LWO_REQUIRE_GPU();
    if (device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << device_count();
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    CHECK_LWO(lwo_nccl_get_unique_id(&id));
  }
  lwo_nccl_unique_id id;
};

TEST_F(Sharded, TwoGpusOneProcessHoldTheUnshardedRecords) {
  Model m = make_model(7, test_seed(61));
  std::mt19937_64 rng(test_seed(62));
  std::vector<uint32_t> order(60);
  for (auto& o : order) o = static_cast<uint32_t>(rng() % 7);
  std::thread r1(run_rank, 1, std::cref(id), std::cref(m), 7u, LWO_OK, std::cref(order));
  run_rank(0, id, m, 7u, LWO_OK, order);
  r1.join();
}

TEST_F(Sharded, RanksThatDisagreeAreRefused) {
  Model m = make_model(5, test_seed(63));
  std::vector<uint32_t> order = {0, 1};
  std::thread r1(run_rank, 1, std::cref(id), std::cref(m), 4u, LWO_ERR_COLLECTIVE_MISMATCH,
                 std::cref(order));
  run_rank(0, id, m, 5u, LWO_ERR_COLLECTIVE_MISMATCH, order);
  r1.join();
}


// Gradients on two GPUs: each rank writes its own random f32 gradients for
// every layer, twice (two micro-batches); afterwards each rank's shard must
// equal, bit for bit, (a0 + b0) + (a1 + b1) over the ranks' gradients a, b
// (two ranks: NCCL's f32 sum is one rounding, as the host's), the ranks'
// shards must cover every element exactly once, and only the shard moved.
// Layers of one dtype take the reduce-scatter path, mixed ones the grouped
// reduce path.
struct GradModel {
  std::vector<std::vector<lwo_tensor_desc>> td;
  std::vector<lwo_layer_desc> ld;
  std::vector<std::vector<uint64_t>> n;  // elements per tensor
  explicit GradModel(uint32_t L) : td(L), ld(L), n(L) {
    for (uint32_t l = 0; l < L; ++l) {
      int64_t rows = 64 + 97 * l, cols = 320 + 13 * l;
      lwo_tensor_desc w = tensor_desc("weight", LWO_DTYPE_BF16, {rows, cols});
      // Odd layers: mixed dtypes.
      lwo_tensor_desc b = tensor_desc("bias", l % 2 ? LWO_DTYPE_F32 : LWO_DTYPE_BF16, {rows});
      td[l] = {w, b};
      ld[l] = lwo_layer_desc{td[l].data(), 2, nullptr};
      n[l] = {static_cast<uint64_t>(rows * cols), static_cast<uint64_t>(rows)};
    }
  }
};

float grad_value(int rank, uint32_t layer, int k, uint64_t i, int micro) {
  uint64_t x = (uint64_t(rank) << 56) ^ (uint64_t(layer) << 40) ^ (uint64_t(k) << 36) ^
               (uint64_t(micro) << 34) ^ i;
  x = testkit::Rng(x).next();
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t(1) << 23)) / 4096.0f;
}

struct RankResult {
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> ranges;  // [layer][tensor] (first, n)
  uint64_t d2h_bytes = 0;
};

void grads_rank(int rank, const lwo_nccl_unique_id& id, const GradModel& m, RankResult* out) {
  const uint32_t L = static_cast<uint32_t>(m.ld.size());
  Engine eng;
  lwo_nccl_comm_t comm = nullptr;
  open_rank(rank, id, 0u, &eng, &comm);
  auto comm_guard = defer([&] { EXPECT_LWO_OK(lwo_nccl_comm_destroy(comm)); });
  if (::testing::Test::HasFatalFailure()) return;
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_sharded(eng.get(), m.ld.data(), L, comm, nullptr, &pool));
  auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  lwo_grads* g = nullptr;
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.depth = 3;
  CHECK_LWO(lwo_grads_create(pool, nullptr, &gc, &g));
  auto grads_guard = defer([&] { EXPECT_LWO_OK(lwo_grads_destroy(g)); });
  Stream st;
  CUDA_OK(cudaStreamCreateWithFlags(st.out(), cudaStreamNonBlocking));
  std::vector<std::vector<float>> host(2);
  for (int micro = 0; micro < 2; ++micro)
    for (uint32_t l = L; l-- > 0;) {
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      CHECK_LWO(lwo_grads_begin(g, l, st.get(), &v));
      for (int k = 0; k < 2; ++k) {
        std::vector<float>& h = host[k];
        CUDA_OK(cudaStreamSynchronize(st.get()));  // the previous copy from h is done
        h.resize(m.n[l][k]);
        for (uint64_t i = 0; i < h.size(); ++i) h[i] = grad_value(rank, l, k, i, micro);
        CUDA_OK(cudaMemcpyAsync(v.tensors[k], h.data(), h.size() * 4, cudaMemcpyHostToDevice, st.get()));
      }
      CHECK_LWO(lwo_grads_end(g, l, st.get()));
    }
  CHECK_LWO(lwo_grads_wait(g));
  out->ranges.assign(L, {});
  for (uint32_t l = 0; l < L; ++l)
    for (int k = 0; k < 2; ++k) {
      const char* name = m.td[l][k].name;
      float* data = nullptr;
      uint64_t first = 0, n = 0;
      CHECK_LWO(lwo_grads_shard(g, l, name, &data, &first, &n));
      void* wd = nullptr;
      uint64_t wf = 0, wn = 0;
      CHECK_LWO(lwo_pool_shard_tensor(pool, l, name, &wd, &wf, &wn));
      EXPECT_EQ(wn, n) << "rank " << rank << " layer " << l << " " << name;
      if (n) {
        EXPECT_EQ(wf, first) << "rank " << rank << " layer " << l << " " << name;
      }
      out->ranges[l].push_back({first, n});
      uint64_t bad = 0;
      for (uint64_t i = 0; i < n; ++i) {
        uint64_t e = first + i;
        float s0 = grad_value(0, l, k, e, 0) + grad_value(1, l, k, e, 0);
        float s1 = grad_value(0, l, k, e, 1) + grad_value(1, l, k, e, 1);
        float want = s0 + s1;
        if (data[i] != want && ++bad <= 5)
          ADD_FAILURE() << "rank " << rank << " layer " << l << " " << name << " element " << e
                        << ": " << data[i] << ", want " << want;
      }
      EXPECT_EQ(bad, 0u) << "rank " << rank << " layer " << l << " " << name;
    }
  lwo_grads_stats gs{};
  gs.size = sizeof gs;
  CHECK_LWO(lwo_grads_get_stats(g, &gs));
  out->d2h_bytes = gs.bytes;
}

TEST_F(Sharded, TwoGpusSumGradientsAndKeepTheirShards) {
  GradModel m(5);
  RankResult r0, r1;
  std::thread t1(grads_rank, 1, std::cref(id), std::cref(m), &r1);
  grads_rank(0, id, m, &r0);
  t1.join();
  if (::testing::Test::HasFailure()) return;
  uint64_t wire = 0;
  for (uint32_t l = 0; l < 5; ++l)
    for (int k = 0; k < 2; ++k) {
      wire += (m.n[l][k] * 4 + 255) / 256 * 256;
      std::vector<int> cover(m.n[l][k], 0);
      for (const RankResult* r : {&r0, &r1}) {
        auto [first, n] = r->ranges[l][k];
        for (uint64_t i = first; i < first + n; ++i) ++cover[i];
      }
      for (size_t i = 0; i < cover.size(); ++i)
        ASSERT_EQ(cover[i], 1) << "layer " << l << " tensor " << k << " element " << i;
    }
  // Two micro-batches of the layers moved to the host, split between the ranks.
  EXPECT_EQ(r0.d2h_bytes + r1.d2h_bytes, 2 * wire);
  EXPECT_GT(r0.d2h_bytes, 0u);
  EXPECT_GT(r1.d2h_bytes, 0u);
}

// With LWO_ENGINE_CHECK_COLLECTIVES, ranks that stage different layers get a
// status on both GPUs instead of a hang, and then go on.
void check_rank(int rank, const lwo_nccl_unique_id& id, const Model& m) {
  Engine eng;
  lwo_nccl_comm_t comm = nullptr;
  open_rank(rank, id, LWO_ENGINE_CHECK_COLLECTIVES, &eng, &comm);
  auto comm_guard = defer([&] { EXPECT_LWO_OK(lwo_nccl_comm_destroy(comm)); });
  if (::testing::Test::HasFatalFailure()) return;
  const uint32_t L = static_cast<uint32_t>(m.rows.size());
  std::vector<lwo_tensor_desc> td;
  std::vector<lwo_layer_desc> ld;
  model_descs(m, td, ld);
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_sharded(eng.get(), ld.data(), L, comm, nullptr, &pool));
  auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  for (uint32_t l = 0; l < L; ++l)
    CHECK_LWO(lwo_pool_write(pool, l, "w", m.bytes[l].data(), m.bytes[l].size()));
  Ring ring;
  CHECK_LWO(lwo_ring_create(pool, nullptr, ring.out()));
  Stream st;
  CUDA_OK(cudaStreamCreateWithFlags(st.out(), cudaStreamNonBlocking));
  lwo_ticket t{};
  lwo_status_t s = lwo_ring_stage(ring.get(), rank == 0 ? 0 : 1, &t);
  EXPECT_EQ(std::string(lwo_status_string(s)), "LWO_ERR_COLLECTIVE_MISMATCH") << "rank " << rank;
  std::string msg = lwo_last_error_message();
  EXPECT_NE(msg.find("rank 0: step 0: lwo_ring_stage of layer 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1: step 0: lwo_ring_stage of layer 1"), std::string::npos) << msg;
  Checks checks;
  checks.init(4);
  for (uint32_t l : {2u, 3u, 2u}) {
    CHECK_LWO(lwo_ring_stage(ring.get(), l, &t));
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    CHECK_LWO(lwo_ring_acquire(ring.get(), t, st.get(), &v));
    CUDA_OK(checks.add(v.base, v.record_bytes, m.record_sums[l], st.get(),
                       "rank " + std::to_string(rank) + " layer " + std::to_string(l)));
    CHECK_LWO(lwo_ring_release(ring.get(), t, st.get()));
  }
  checks.verify();
}

TEST_F(Sharded, TwoGpusCollectiveCheckReportsRanksThatDiffer) {
  Model m = make_model(4, test_seed(64));
  std::thread t1(check_rank, 1, std::cref(id), std::cref(m));
  check_rank(0, id, m);
  t1.join();
}

// Two GPUs as two nodes of one rank each (lwo_grads_config.replica_comm):
// each rank's pool is sharded over a one-rank communicator split from the
// world (so it holds the whole records) and its gradients are all-reduced
// over the world as the replica communicator. Each rank's host gradients
// must be, bit for bit, a + b over the ranks' gradients a, b (two ranks:
// one f32 rounding), and the same on both ranks.
void replica_rank(int rank, const lwo_nccl_unique_id& id, const GradModel& m,
                  std::vector<std::vector<std::vector<float>>>* out, int n_ranks = 2) {
  const uint32_t L = static_cast<uint32_t>(m.ld.size());
  Engine eng;
  lwo_nccl_comm_t world = nullptr, node = nullptr;
  open_rank(rank, id, LWO_ENGINE_CHECK_COLLECTIVES, &eng, &world, n_ranks);
  auto world_guard = defer([&] { EXPECT_LWO_OK(lwo_nccl_comm_destroy(world)); });
  if (::testing::Test::HasFatalFailure()) return;
  CHECK_LWO(lwo_nccl_comm_split(eng.get(), world, rank, 0, &node));
  auto node_guard = defer([&] { EXPECT_LWO_OK(lwo_nccl_comm_destroy(node)); });
  lwo_pool* pool = nullptr;
  CHECK_LWO(lwo_pool_create_sharded(eng.get(), m.ld.data(), L, node, nullptr, &pool));
  auto pool_guard = defer([&] { EXPECT_LWO_OK(lwo_pool_destroy(pool)); });
  lwo_grads* g = nullptr;
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.replica_comm = world;
  CHECK_LWO(lwo_grads_create(pool, nullptr, &gc, &g));
  auto grads_guard = defer([&] { EXPECT_LWO_OK(lwo_grads_destroy(g)); });
  Stream st;
  CUDA_OK(cudaStreamCreateWithFlags(st.out(), cudaStreamNonBlocking));
  std::vector<float> h;
  for (uint32_t l = L; l-- > 0;) {
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    CHECK_LWO(lwo_grads_begin(g, l, st.get(), &v));
    for (int k = 0; k < 2; ++k) {
      CUDA_OK(cudaStreamSynchronize(st.get()));  // the previous copy from h is done
      h.resize(m.n[l][k]);
      for (uint64_t i = 0; i < h.size(); ++i) h[i] = grad_value(rank, l, k, i, 0);
      CUDA_OK(cudaMemcpyAsync(v.tensors[k], h.data(), h.size() * 4, cudaMemcpyHostToDevice,
                              st.get()));
    }
    CHECK_LWO(lwo_grads_end(g, l, st.get()));
  }
  CHECK_LWO(lwo_grads_wait(g));
  out->assign(L, {});
  for (uint32_t l = 0; l < L; ++l)
    for (int k = 0; k < 2; ++k) {
      float* data = nullptr;
      uint64_t first = 9, n = 0;
      CHECK_LWO(lwo_grads_shard(g, l, m.td[l][k].name, &data, &first, &n));
      EXPECT_EQ(first, 0u);
      EXPECT_EQ(n, m.n[l][k]);
      (*out)[l].emplace_back(data, data + n);
    }
}

TEST_F(Sharded, TwoGpusAsTwoNodesSumGradientsOverTheReplicaCommunicator) {
  GradModel m(4);
  std::vector<std::vector<std::vector<float>>> r0, r1;
  std::thread t1(replica_rank, 1, std::cref(id), std::cref(m), &r1, 2);
  replica_rank(0, id, m, &r0);
  t1.join();
  if (::testing::Test::HasFailure()) return;
  for (uint32_t l = 0; l < 4; ++l)
    for (int k = 0; k < 2; ++k) {
      uint64_t bad = 0;
      for (uint64_t i = 0; i < m.n[l][k]; ++i) {
        const float want = grad_value(0, l, k, i, 0) + grad_value(1, l, k, i, 0);
        if ((r0[l][k][i] != want || r1[l][k][i] != want) && ++bad <= 5)
          ADD_FAILURE() << "layer " << l << " tensor " << k << " element " << i << ": "
                        << r0[l][k][i] << ", " << r1[l][k][i] << ", want " << want;
      }
      EXPECT_EQ(bad, 0u) << "layer " << l << " tensor " << k;
    }
}

// One GPU: a node of one rank and a replica communicator of one (split from
// the world of one): the all-reduce runs (NCCL over one rank, in place in the
// slot, between the reduction and the copy down) and the host shard is the
// rank's own gradient, the whole tensor.
TEST(ShardedOneGpu, AReplicaCommunicatorOfOneRankLeavesTheGradients) {
  LWO_REQUIRE_GPU();
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  lwo_nccl_unique_id id;
  CHECK_LWO(lwo_nccl_get_unique_id(&id));
  GradModel m(4);
  std::vector<std::vector<std::vector<float>>> r0;
  replica_rank(0, id, m, &r0, 1);
  if (::testing::Test::HasFailure()) return;
  for (uint32_t l = 0; l < 4; ++l)
    for (int k = 0; k < 2; ++k) {
      uint64_t bad = 0;
      for (uint64_t i = 0; i < m.n[l][k]; ++i)
        if (r0[l][k][i] != grad_value(0, l, k, i, 0) && ++bad <= 5)
          ADD_FAILURE() << "layer " << l << " tensor " << k << " element " << i << ": "
                        << r0[l][k][i] << ", want " << grad_value(0, l, k, i, 0);
      EXPECT_EQ(bad, 0u) << "layer " << l << " tensor " << k;
    }
}

}  // namespace
}  // namespace lwo_test
