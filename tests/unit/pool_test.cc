// Host weight pools: pinned arenas and registered caller memory.
#include <atomic>
#include <cstdlib>

#include "engine/pool.h"
#include "src/common/parallel.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

using PoolTest = EngineTest;

TEST_F(PoolTest, PinnedArenaIsExactZeroedAndWritable) {
  ModelDesc m(5);
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, m.layers.data(), 5, nullptr, &pool));
  lwo_pool_info info{};
  info.size = sizeof info;
  ASSERT_LWO(lwo_pool_get_info(pool, &info));
  uint64_t sum = 0, mx = 0;
  for (uint32_t i = 0; i < 5; ++i) {
    uint64_t rb = 0;
    ASSERT_LWO(lwo_record_layout(&m.layers[i], nullptr, &rb));
    uint64_t pb = 0;
    ASSERT_LWO(lwo_pool_record_bytes(pool, i, &pb));
    EXPECT_EQ(rb, pb);
    sum += rb;
    mx = std::max(mx, rb);
    void* p = nullptr;
    uint64_t b = 0;
    ASSERT_LWO(lwo_pool_layer_host(pool, i, &p, &b));
    EXPECT_EQ(b, rb);
    for (uint64_t k = 0; k < b; ++k) ASSERT_EQ(static_cast<uint8_t*>(p)[k], 0) << k;
  }
  EXPECT_EQ(info.total_bytes, sum);  // no power-of-two rounding
  EXPECT_EQ(info.max_record_bytes, mx);
  EXPECT_EQ(info.kind, LWO_POOL_PINNED);
  EXPECT_EQ(gpu->n_registered(), 1u);  // the arena, registered for DMA

  std::vector<uint8_t> w(74 * 19 * 2);  // layer 1: weight is 74 x 19 bf16
  fill_random(w.data(), w.size(), 9);
  EXPECT_EQ(lwo_pool_write(pool, 1, "weight", w.data(), w.size() - 2), LWO_ERR_SIZE_MISMATCH);
  EXPECT_NE(std::string(lwo_last_error_message()).find("holds 2812 bytes, given 2810"),
            std::string::npos)
      << lwo_last_error_message();
  EXPECT_EQ(lwo_pool_write(pool, 1, "bais", w.data(), w.size()), LWO_ERR_NOT_FOUND);
  EXPECT_EQ(lwo_pool_write(pool, 9, "weight", w.data(), w.size()), LWO_ERR_OUT_OF_RANGE);
  ASSERT_LWO(lwo_pool_write(pool, 1, "weight", w.data(), w.size()));
  void* tp = nullptr;
  uint64_t tb = 0;
  ASSERT_LWO(lwo_pool_tensor_host(pool, 1, "weight", &tp, &tb));
  ASSERT_EQ(tb, w.size());
  EXPECT_EQ(std::memcmp(tp, w.data(), tb), 0);
  uint32_t idx = 9, n = 0;
  ASSERT_LWO(lwo_pool_find_tensor(pool, 1, "bias", &idx));
  EXPECT_EQ(idx, 1u);
  ASSERT_LWO(lwo_pool_layer_tensor_count(pool, 1, &n));
  EXPECT_EQ(n, 2u);
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 1, &ti));
  EXPECT_STREQ(ti.name, "bias");
  EXPECT_EQ(ti.offset, 2816u);
  EXPECT_EQ(ti.bytes, 74u * 4);
  EXPECT_EQ(lwo_pool_tensor_info(pool, 1, 2, &ti), LWO_ERR_OUT_OF_RANGE);
  ASSERT_LWO(lwo_pool_destroy(pool));
  EXPECT_EQ(gpu->n_registered(), 0u);
}

TEST_F(PoolTest, PinnedArenaFallsBackWhenRegistrationIsRefused) {
  gpu->refuse_register = true;
  lwo_pool* pool = make_pool(3);
  ASSERT_NE(pool, nullptr);
  lwo_ring* ring = make_ring(pool, 2);
  StreamH c = gpu->new_stream();
  lwo_ticket t{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_NO_FATAL_FAILURE(acquire(ring, 2, c, &t, &v));
  EXPECT_TRUE(holds_layer(pool, v));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];  // source was pinned
  destroy(ring, pool);
}

TEST_F(PoolTest, PinnedPoolRejectsBadInput) {
  ModelDesc m(2);
  lwo_pool* pool = nullptr;
  EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), 0, nullptr, &pool),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_pool_create_pinned(engine, nullptr, 2, nullptr, &pool), LWO_ERR_INVALID_ARGUMENT);
  int x = 0;
  m.tensors[1][0].host_data = &x;
  EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), 2, nullptr, &pool),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("layer 1"), std::string::npos);
  lwo_tensor_desc empty = tensor("e", LWO_DTYPE_F32, {0});
  lwo_layer_desc l{&empty, 1, nullptr};
  EXPECT_EQ(lwo_pool_create_pinned(engine, &l, 1, nullptr, &pool), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(pool, nullptr);
  EXPECT_EQ(gpu->n_registered(), 0u);
}

TEST_F(PoolTest, RegisteredContiguousLayersMoveInOneCopy) {
  // Lay caller memory out exactly as the records, one region for all.
  const uint32_t L = 4;
  ModelDesc m(L);
  std::vector<uint64_t> rec(L), base(L);
  uint64_t total = 0;
  std::vector<std::vector<uint64_t>> offs(L);
  for (uint32_t i = 0; i < L; ++i) {
    offs[i].resize(m.layers[i].n_tensors);
    ASSERT_LWO(lwo_record_layout(&m.layers[i], offs[i].data(), &rec[i]));
    base[i] = total;
    total += rec[i];
  }
  Aligned mem(total);
  fill_random(mem.p, total, 5);
  for (uint32_t i = 0; i < L; ++i)
    for (uint32_t k = 0; k < m.layers[i].n_tensors; ++k)
      m.tensors[i][k].host_data = mem.p + base[i] + offs[i][k];
  lwo_host_region r{mem.p, total, nullptr};
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_registered(engine, m.layers.data(), L, &r, 1, nullptr, &pool));
  EXPECT_EQ(gpu->n_registered(), 1u);
  for (uint32_t i = 0; i < L; ++i) {  // the caller's bytes, without the record's tail padding
    void* hp = nullptr;
    uint64_t hb = 0;
    ASSERT_LWO(lwo_pool_layer_host(pool, i, &hp, &hb));
    EXPECT_EQ(hp, mem.p + base[i]);
    lwo_tensor_info last = LWO_TENSOR_INFO_INIT;
    ASSERT_LWO(lwo_pool_tensor_info(pool, i, m.layers[i].n_tensors - 1, &last));
    EXPECT_EQ(hb, last.offset + last.bytes);
  }
  lwo_ring* ring = make_ring(pool, 2);
  StreamH c = gpu->new_stream();
  for (uint32_t i = 0; i < L; ++i) {
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(acquire(ring, i, c, &t, &v));
    for (uint32_t k = 0; k < v.n_tensors; ++k) {  // padding after the last tensor is not copied
      lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
      ASSERT_LWO(lwo_pool_tensor_info(pool, i, k, &ti));
      EXPECT_EQ(std::memcmp(v.tensors[k], mem.p + base[i] + offs[i][k], ti.bytes), 0);
    }
    gpu->read(c, v.base, v.record_bytes);
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  }
  lwo_ring_stats st{};
  st.size = sizeof st;
  ASSERT_LWO(lwo_ring_get_stats(ring, &st));
  EXPECT_EQ(st.n_copies, L);  // one copy per layer
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  EXPECT_EQ(lwo_pool_write(pool, 0, "weight", mem.p, 1), LWO_ERR_UNSUPPORTED);
  destroy(ring, pool);
  EXPECT_EQ(gpu->n_registered(), 0u);
}

TEST_F(PoolTest, RegisteredScatteredTensorsArePackedIntoTheRecord) {
  // Each tensor in its own region, in reverse order: several copies per layer,
  // and the slot still holds the record layout.
  const uint32_t L = 3;
  ModelDesc m(L);
  std::vector<std::unique_ptr<Aligned>> bufs;
  std::vector<lwo_host_region> regions;
  for (uint32_t i = 0; i < L; ++i)
    for (auto& t : m.tensors[i]) {
      uint64_t bytes = lwo_dtype_size(t.dtype);
      for (int d = 0; d < t.n_dims; ++d) bytes *= t.shape[d];
      bufs.push_back(std::make_unique<Aligned>(bytes));
      fill_random(bufs.back()->p, bytes, bufs.size());
      t.host_data = bufs.back()->p;
      regions.push_back({bufs.back()->p, bytes, nullptr});
    }
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_registered(engine, m.layers.data(), L, regions.data(),
                                        static_cast<uint32_t>(regions.size()), nullptr, &pool));
  void* host = nullptr;
  EXPECT_EQ(lwo_pool_layer_host(pool, 1, &host, nullptr), LWO_ERR_UNSUPPORTED);
  lwo_ring* ring = make_ring(pool, 1);
  StreamH c = gpu->new_stream();
  uint64_t expect_copies = 0;
  for (uint32_t i = 0; i < L; ++i) {
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_NO_FATAL_FAILURE(acquire(ring, i, c, &t, &v));
    ASSERT_EQ(v.n_tensors, m.layers[i].n_tensors);
    for (uint32_t k = 0; k < v.n_tensors; ++k) {
      lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
      ASSERT_LWO(lwo_pool_tensor_info(pool, i, k, &ti));
      EXPECT_EQ(static_cast<uint8_t*>(v.base) + ti.offset, v.tensors[k]);
      EXPECT_EQ(std::memcmp(v.tensors[k], m.tensors[i][k].host_data, ti.bytes), 0);
      void* hp = nullptr;
      ASSERT_LWO(lwo_pool_tensor_host(pool, i, ti.name, &hp, nullptr));
      EXPECT_EQ(hp, m.tensors[i][k].host_data);
    }
    expect_copies += v.n_tensors;
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  }
  lwo_ring_stats st{};
  st.size = sizeof st;
  ASSERT_LWO(lwo_ring_get_stats(ring, &st));
  EXPECT_EQ(st.n_copies, expect_copies);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(ring, pool);
}

TEST_F(PoolTest, RegisteredPoolRejectsBadRegions) {
  ModelDesc m(1);
  Aligned mem(8192);
  m.tensors[0][0].host_data = mem.p;
  lwo_pool* pool = nullptr;
  lwo_host_region small{mem.p, 100, nullptr};  // the weight needs 37*19*2 = 1406 bytes
  EXPECT_EQ(lwo_pool_create_registered(engine, m.layers.data(), 1, &small, 1, nullptr, &pool),
            LWO_ERR_OUT_OF_RANGE);
  EXPECT_NE(std::string(lwo_last_error_message()).find("not inside any given region"),
            std::string::npos);
  lwo_host_region overlap[2] = {{mem.p, 4096, nullptr}, {mem.p + 100, 4096, nullptr}};
  EXPECT_EQ(lwo_pool_create_registered(engine, m.layers.data(), 1, overlap, 2, nullptr, &pool),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("overlap"), std::string::npos);
  EXPECT_EQ(lwo_pool_create_registered(engine, m.layers.data(), 1, nullptr, 0, nullptr, &pool),
            LWO_ERR_INVALID_ARGUMENT);
  m.tensors[0][0].host_data = nullptr;
  lwo_host_region whole{mem.p, 8192, nullptr};
  EXPECT_EQ(lwo_pool_create_registered(engine, m.layers.data(), 1, &whole, 1, nullptr, &pool),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("no host_data"), std::string::npos);
  gpu->refuse_register = true;
  m.tensors[0][0].host_data = mem.p;
  EXPECT_EQ(lwo_pool_create_registered(engine, m.layers.data(), 1, &whole, 1, nullptr, &pool),
            LWO_ERR_CUDA);
  EXPECT_EQ(pool, nullptr);
  EXPECT_EQ(gpu->n_registered(), 0u);
}

TEST(ParallelFill, CoversEveryByteOnce) {
  std::vector<uint8_t> buf((size_t(130) << 20) + 12345, 0);
  uint8_t* p = buf.data();
  parallel_for(buf.size(), 4, uint64_t(64) << 20, 4096, [p](uint64_t b, uint64_t e) {
    for (uint64_t i = b; i < e; ++i) p[i] += 1;
  });
  for (size_t i = 0; i < buf.size(); i += 4093) ASSERT_EQ(buf[i], 1) << i;
  ASSERT_EQ(buf.back(), 1);
}

// Chunks taken in turn: every item exactly once, every chunk but the last
// aligned, for counts around the chunk sizes and thread counts.
TEST(ParallelFor, ChunksInTurnCoverEveryItemOnce) {
  for (uint64_t n : {uint64_t{1}, uint64_t{63}, uint64_t{64}, uint64_t{1000}, uint64_t{123457}})
    for (uint32_t threads : {1u, 3u, 16u})
      for (uint32_t cpt : {1u, 8u}) {
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int> misaligned{0};
        parallel_for(
            n, threads, 8, 64,
            [&](uint64_t b, uint64_t e) {
              if (e != n && (e - b) % 64 != 0) misaligned.fetch_add(1);
              if (b % 64 != 0) misaligned.fetch_add(1);
              for (uint64_t i = b; i < e; ++i) hits[i].fetch_add(1);
            },
            cpt);
        for (uint64_t i = 0; i < n; ++i)
          ASSERT_EQ(hits[i].load(), 1) << "n " << n << " threads " << threads << " chunks " << cpt
                                       << " item " << i;
        EXPECT_EQ(misaligned.load(), 0) << "n " << n << " threads " << threads << " chunks " << cpt;
      }
}

}  // namespace
}  // namespace testing
}  // namespace lwo
