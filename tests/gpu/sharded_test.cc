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

// One rank: engine, communicator, sharded pool, ring, a random schedule.
void run_rank(int rank, const lwo_nccl_unique_id& id, const Model& m, uint32_t n_layers_given,
              lwo_status_t want_pool, const std::vector<uint32_t>& order) {
  CUDA_OK(cudaSetDevice(rank));
  lwo_engine_config ec = LWO_ENGINE_CONFIG_INIT;
  ec.device = rank;
  EngineOwner eng;
  CHECK_LWO(lwo_engine_create(&ec, &eng.e));
  lwo_nccl_comm_t comm = nullptr;
  CHECK_LWO(lwo_nccl_comm_create(eng.e, &id, 2, rank, &comm));
  auto comm_guard = defer([&] { EXPECT_LWO_OK(lwo_nccl_comm_destroy(comm)); });
  std::vector<lwo_tensor_desc> td(m.rows.size());
  std::vector<lwo_layer_desc> ld(m.rows.size());
  for (size_t l = 0; l < m.rows.size(); ++l) {
    td[l] = lwo_tensor_desc{};
    td[l].name = "w";
    td[l].dtype = LWO_DTYPE_BF16;
    td[l].n_dims = 2;
    td[l].shape[0] = m.rows[l];
    td[l].shape[1] = 1000;
    ld[l] = lwo_layer_desc{&td[l], 1};
  }
  lwo_pool* pool = nullptr;
  lwo_status_t s = lwo_pool_create_sharded(eng.e, ld.data(), n_layers_given, comm, nullptr, &pool);
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
    RingOwner ring;
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    rc.depth = depth;
    CHECK_LWO(lwo_ring_create(pool, &rc, &ring.r));
    ScheduleOwner sched;
    CHECK_LWO(lwo_schedule_create(ring.r, order.data(), static_cast<uint32_t>(order.size()), &sched.s));
    Stream st;
    CUDA_OK(st.create(cudaStreamNonBlocking));
    Checks checks;
    checks.init(order.size());
    if (::testing::Test::HasFatalFailure()) return;
    lwo_layer_view v{};
    while ((s = lwo_schedule_next(sched.s, st.s, &v)) == LWO_OK)
      CUDA_OK(checks.add(v.base, v.record_bytes, m.record_sums[v.layer], st.s,
                         "rank " + std::to_string(rank) + " layer " + std::to_string(v.layer)));
    EXPECT_EQ(s, LWO_END) << lwo_last_error_message();
    checks.verify();
    CHECK_LWO(lwo_schedule_destroy(sched.s));
    sched.s = nullptr;
  }
  EXPECT_LWO_OK(lwo_engine_synchronize(eng.e));
}

TEST(Sharded, TwoGpusOneProcessHoldTheUnshardedRecords) {
  LWO_REQUIRE_GPU();
  if (device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << device_count();
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  lwo_nccl_unique_id id;
  CHECK_LWO(lwo_nccl_get_unique_id(&id));
  Model m = make_model(7, test_seed(61));
  std::mt19937_64 rng(test_seed(62));
  std::vector<uint32_t> order(60);
  for (auto& o : order) o = static_cast<uint32_t>(rng() % 7);
  std::thread r1(run_rank, 1, std::cref(id), std::cref(m), 7u, LWO_OK, std::cref(order));
  run_rank(0, id, m, 7u, LWO_OK, order);
  r1.join();
}

TEST(Sharded, RanksThatDisagreeAreRefused) {
  LWO_REQUIRE_GPU();
  if (device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << device_count();
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  lwo_nccl_unique_id id;
  CHECK_LWO(lwo_nccl_get_unique_id(&id));
  Model m = make_model(5, test_seed(63));
  std::vector<uint32_t> order = {0, 1};
  std::thread r1(run_rank, 1, std::cref(id), std::cref(m), 4u, LWO_ERR_COLLECTIVE_MISMATCH,
                 std::cref(order));
  run_rank(0, id, m, 5u, LWO_ERR_COLLECTIVE_MISMATCH, order);
  r1.join();
}

}  // namespace
}  // namespace lwo_test
