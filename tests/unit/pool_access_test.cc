// Pools through the C ABI, on the recording backend: kind, rank and ranks,
// whole and shard access on every pool kind, lwo_pool_write_range.
#include "abi_fixture.h"

namespace lwo {
namespace testing {
namespace {

/* ---------------------------------------------------------------------- */
/* Pools: kinds, whole / shard access, write_range                        */
/* ---------------------------------------------------------------------- */

class PoolAccess : public AbiTest {
 protected:
  // Layer l of a pool that is not sharded: its shard is the whole record
  // (lwo_pool_layer_host's address and bytes) at offset 0, at *shard.
  void shard_is_whole(lwo_pool* pool, uint32_t l, void** shard) {
    void* whole = nullptr;
    uint64_t wb = 0;
    ASSERT_LWO(lwo_pool_layer_host(pool, l, &whole, &wb));
    uint64_t off = 99, sb = 0;
    ASSERT_LWO(lwo_pool_shard_host(pool, l, shard, &off, &sb));
    EXPECT_EQ(*shard, whole);
    EXPECT_EQ(off, 0u);
    EXPECT_EQ(sb, wb);
  }
  // The tensor shards of a pool of one WithEmpty layer, not sharded: "empty"
  // is n 0 and NULL, "w" all its 32 elements from 0, at *w.
  void with_empty_shards(lwo_pool* pool, void** w) {
    void* d = bogus<void>();
    uint64_t first = 99, ne = 99;
    ASSERT_LWO(lwo_pool_shard_tensor(pool, 0, "empty", &d, &first, &ne));
    EXPECT_EQ(d, nullptr);
    EXPECT_EQ(first, 0u);
    EXPECT_EQ(ne, 0u);
    ASSERT_LWO(lwo_pool_shard_tensor(pool, 0, "w", &d, &first, &ne));
    EXPECT_EQ(first, 0u);
    EXPECT_EQ(ne, 32u);
    *w = d;
  }
};

// lwo_pool_get_info: kind, rank and n_ranks of pinned, registered and
// sharded pools (checkpoint kinds: CheckpointCalls).
TEST_F(PoolAccess, KindRankAndRanks) {
  lwo_pool* pool = make_pool(2);
  lwo_pool_info pi = pool_info(pool);
  EXPECT_EQ(pi.kind, LWO_POOL_PINNED);
  EXPECT_EQ(pi.rank, 0);
  EXPECT_EQ(pi.n_ranks, 1);
  ASSERT_LWO(lwo_pool_destroy(pool));

  RegisteredModel rm(2);
  lwo_host_region r = rm.region();
  ASSERT_LWO(lwo_pool_create_registered(engine, rm.m.layers.data(), 2, &r, 1, nullptr, &pool));
  pi = pool_info(pool);
  EXPECT_EQ(pi.kind, LWO_POOL_REGISTERED);
  EXPECT_EQ(pi.rank, 0);
  EXPECT_EQ(pi.n_ranks, 1);
  ASSERT_LWO(lwo_pool_destroy(pool));

  ModelDesc m(2);
  int fake_comm = 0;
  gpu->fake_ranks = 3;
  gpu->fake_rank = 2;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 2,
                                     reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr, &pool));
  pi = pool_info(pool);
  EXPECT_EQ(pi.kind, LWO_POOL_SHARDED);
  EXPECT_EQ(pi.rank, 2);
  EXPECT_EQ(pi.n_ranks, 3);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// "Whole" and "shard" access: on a pinned pool the shard is the whole record
// (offset 0, lwo_pool_layer_host's address and bytes) and a tensor's shard
// the whole tensor (first 0, every element, lwo_pool_tensor_host's address);
// a 0-element tensor's is n 0 and NULL.
TEST_F(PoolAccess, ShardAccessOnPinnedPoolIsTheWholeRecord) {
  lwo_pool* pool = make_pool(3);
  for (uint32_t l = 0; l < 3; ++l) {
    void* shard = nullptr;
    shard_is_whole(pool, l, &shard);
    for (const lwo_tensor_info& ti : layer_tensors(pool, l)) {
      void* th = nullptr;
      ASSERT_LWO(lwo_pool_tensor_host(pool, l, ti.name, &th, nullptr));
      void* d = nullptr;
      uint64_t first = 99, ne = 0;
      ASSERT_LWO(lwo_pool_shard_tensor(pool, l, ti.name, &d, &first, &ne));
      EXPECT_EQ(d, th);
      EXPECT_EQ(first, 0u);
      EXPECT_EQ(ne, ti.bytes / lwo_dtype_size(ti.dtype));
    }
  }
  ASSERT_LWO(lwo_pool_destroy(pool));

  WithEmpty we;
  ASSERT_LWO(lwo_pool_create_pinned(engine, &we.layer, 1, nullptr, &pool));
  void* w = nullptr;
  with_empty_shards(pool, &w);
  EXPECT_NE(w, nullptr);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// The same on registered pools: the shard of a contiguous layer is
// lwo_pool_layer_host's, a scattered layer's shard has its
// LWO_ERR_UNSUPPORTED, and a tensor's shard is the caller's memory.
TEST_F(PoolAccess, ShardAccessOnRegisteredPools) {
  RegisteredModel rm(3);
  lwo_host_region r = rm.region();
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_registered(engine, rm.m.layers.data(), 3, &r, 1, nullptr, &pool));
  for (uint32_t l = 0; l < 3; ++l) {
    void* shard = nullptr;
    shard_is_whole(pool, l, &shard);
    EXPECT_EQ(shard, rm.mem->p + rm.base[l]);
    for (uint32_t k = 0; k < rm.m.layers[l].n_tensors; ++k) {
      const lwo_tensor_desc& t = rm.m.tensors[l][k];
      void* d = nullptr;
      uint64_t first = 99, ne = 0;
      ASSERT_LWO(lwo_pool_shard_tensor(pool, l, t.name, &d, &first, &ne));
      EXPECT_EQ(d, t.host_data);
      EXPECT_EQ(first, 0u);
      uint64_t want = 1;
      for (int i = 0; i < t.n_dims; ++i) want *= static_cast<uint64_t>(t.shape[i]);
      EXPECT_EQ(ne, want);
    }
  }
  ASSERT_LWO(lwo_pool_destroy(pool));

  // Scattered: "w" in its own buffer, "empty" with no host data at all.
  WithEmpty we;
  Aligned buf(4096);
  we.t[0].host_data = buf.p + 512;  // not where the record would put it
  lwo_host_region r2{buf.p, 4096, nullptr};
  ASSERT_LWO(lwo_pool_create_registered(engine, &we.layer, 1, &r2, 1, nullptr, &pool));
  void* w = nullptr;
  with_empty_shards(pool, &w);
  EXPECT_EQ(w, buf.p + 512);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// lwo_grads_shard on a pool that is not sharded: the whole tensor, first
// element 0, at the same address every time; n 0 and NULL for a tensor of
// 0 elements.
TEST_F(PoolAccess, GradsShardOnUnshardedPoolIsTheWholeTensor) {
  lwo_pool* pool = make_pool(2);
  lwo_grads* g = nullptr;
  lwo_grads_config f32 = LWO_GRADS_CONFIG_INIT;
  f32.flags = LWO_GRADS_F32;  // f32 host buffers, which lwo_grads_shard reads
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &f32, &g));
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(g, 1, stream(c), &v));
  for (uint32_t k = 0; k < v.n_tensors; ++k) {
    gpu->write(c, v.tensors[k], v.tensor_bytes[k]);
    float* f = static_cast<float*>(v.tensors[k]);
    for (uint64_t i = 0; i < v.tensor_bytes[k] / 4; ++i) f[i] = static_cast<float>(k * 1000 + i);
  }
  ASSERT_LWO(lwo_grads_end(g, 1, stream(c)));
  ASSERT_LWO(lwo_grads_wait(g));
  for (const char* name : {"weight", "bias"}) {
    float* d = nullptr;
    uint64_t first = 99, ne = 0;
    ASSERT_LWO(lwo_grads_shard(g, 1, name, &d, &first, &ne));
    EXPECT_EQ(first, 0u);
    EXPECT_EQ(ne, std::string(name) == "weight" ? 74u * 19 : 74u);
    ASSERT_NE(d, nullptr);
    uint32_t k = std::string(name) == "weight" ? 0 : 1;
    for (uint64_t i = 0; i < ne; ++i) ASSERT_EQ(d[i], static_cast<float>(k * 1000 + i)) << name;
    float* again = nullptr;
    ASSERT_LWO(lwo_grads_shard(g, 1, name, &again, nullptr, nullptr));  // counts may be NULL
    EXPECT_EQ(again, d);
  }
  destroy(g, pool);

  WithEmpty we;
  ASSERT_LWO(lwo_pool_create_pinned(engine, &we.layer, 1, nullptr, &pool));
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &f32, &g));
  float* d = reinterpret_cast<float*>(uintptr_t{0x1234});
  uint64_t first = 99, ne = 99;
  ASSERT_LWO(lwo_grads_shard(g, 0, "empty", &d, &first, &ne));
  EXPECT_EQ(first, 0u);
  EXPECT_EQ(ne, 0u);
  EXPECT_EQ(d, nullptr) << "lwo.h: *n_elements may be 0 (then *data is NULL)";
  destroy(g, pool);
}

// lwo_pool_write_range writes exactly bytes [offset, offset + bytes) of the
// tensor and marks the layer changed: a released slot holding it is no
// longer a hit.
TEST_F(PoolAccess, WriteRangeWritesExactlyTheRangeAndMarksTheLayerChanged) {
  auto [pool, ring, c] = pool_ring_stream(3, 3);
  use(ring, pool, 0, c);
  use(ring, pool, 1, c);
  use(ring, pool, 1, c);
  lwo_ring_stats st = ring_stats(ring);
  EXPECT_EQ(st.n_hits, 1u);
  EXPECT_EQ(st.n_copies, 2u);

  void* rec = nullptr;
  uint64_t rb = 0;
  ASSERT_LWO(lwo_pool_layer_host(pool, 1, &rec, &rb));
  std::vector<uint8_t> before(static_cast<uint8_t*>(rec), static_cast<uint8_t*>(rec) + rb);
  lwo_tensor_info wi = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 0, &wi));  // "weight", 2812 bytes at 0
  std::vector<uint8_t> src(13);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(before[101 + i] ^ 0xFF);
  ASSERT_LWO(lwo_pool_write_range(pool, 1, "weight", 101, src.data(), src.size()));
  const uint8_t* now = static_cast<const uint8_t*>(rec);
  for (uint64_t i = 0; i < rb; ++i) {
    uint8_t want = (i >= wi.offset + 101 && i < wi.offset + 101 + src.size())
                       ? src[i - wi.offset - 101]
                       : before[i];
    ASSERT_EQ(now[i], want) << "record byte " << i;
  }
  use(ring, pool, 1, c);  // copied again, with the new bytes
  st = ring_stats(ring);
  EXPECT_EQ(st.n_hits, 1u);
  EXPECT_EQ(st.n_copies, 3u);
  use(ring, pool, 1, c);  // unchanged since: a hit
  EXPECT_EQ(ring_stats(ring).n_hits, 2u);
  use(ring, pool, 0, c);  // another layer was not marked
  EXPECT_EQ(ring_stats(ring).n_hits, 3u);

  // The last bytes of the last tensor, up to its end.
  lwo_tensor_info bi = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 1, &bi));
  uint32_t tail = 0xA1B2C3D4;
  ASSERT_LWO(lwo_pool_write_range(pool, 1, "bias", bi.bytes - 4, &tail, 4));
  EXPECT_EQ(std::memcmp(now + bi.offset + bi.bytes - 4, &tail, 4), 0);
  EXPECT_EQ(now[bi.offset + bi.bytes - 5], before[bi.offset + bi.bytes - 5]);
  use(ring, pool, 1, c);
  EXPECT_EQ(ring_stats(ring).n_copies, 4u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(ring, pool);
}

// lwo_pool_write_range: LWO_ERR_OUT_OF_RANGE past the tensor's end (also
// where offset + bytes would overflow), an empty range at the end is fine,
// LWO_ERR_UNSUPPORTED on registered pools; messages name the call.
TEST_F(PoolAccess, WriteRangeRefusesRangesPastTheEndAndRegisteredPools) {
  lwo_pool* pool = make_pool(2);
  const uint64_t kW = 74u * 19 * 2;  // layer 1 "weight"
  std::vector<uint8_t> src(64, 7);
  struct {
    uint64_t offset, bytes;
  } bad[] = {{kW - 4, 8}, {kW + 1, 0}, {kW, 1}, {UINT64_MAX - 1, 4}, {8, UINT64_MAX - 4},
             {UINT64_MAX, UINT64_MAX}};
  for (const auto& b : bad) {
    EXPECT_EQ(lwo_pool_write_range(pool, 1, "weight", b.offset, src.data(), b.bytes),
              LWO_ERR_OUT_OF_RANGE)
        << b.offset << " + " << b.bytes;
    EXPECT_TRUE(starts_with(msg(), "lwo_pool_write_range: ")) << msg();
  }
  void* rec = nullptr;
  ASSERT_LWO(lwo_pool_layer_host(pool, 1, &rec, nullptr));
  ASSERT_LWO(lwo_pool_write_range(pool, 1, "weight", kW, src.data(), 0));
  ASSERT_LWO(lwo_pool_write_range(pool, 1, "weight", kW - 1, src.data(), 1));
  EXPECT_EQ(static_cast<uint8_t*>(rec)[kW - 1], 7);
  EXPECT_EQ(lwo_pool_write_range(pool, 1, "nope", 0, src.data(), 1), LWO_ERR_NOT_FOUND);
  EXPECT_EQ(lwo_pool_write_range(pool, 2, "weight", 0, src.data(), 1), LWO_ERR_OUT_OF_RANGE);
  EXPECT_EQ(lwo_pool_write_range(pool, 1, "weight", 0, nullptr, 4), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_pool_write_range(nullptr, 1, "weight", 0, src.data(), 4), LWO_ERR_INVALID_HANDLE);
  ASSERT_LWO(lwo_pool_destroy(pool));

  // A tensor of 0 elements takes 0-byte writes.
  WithEmpty we;
  ASSERT_LWO(lwo_pool_create_pinned(engine, &we.layer, 1, nullptr, &pool));
  ASSERT_LWO(lwo_pool_write_range(pool, 0, "empty", 0, nullptr, 0));
  EXPECT_EQ(lwo_pool_write_range(pool, 0, "empty", 0, src.data(), 1), LWO_ERR_OUT_OF_RANGE);
  ASSERT_LWO(lwo_pool_destroy(pool));

  RegisteredModel rm(2);
  lwo_host_region r = rm.region();
  ASSERT_LWO(lwo_pool_create_registered(engine, rm.m.layers.data(), 2, &r, 1, nullptr, &pool));
  std::vector<uint8_t> keep(rm.mem->p, rm.mem->p + rm.total);
  EXPECT_EQ(lwo_pool_write_range(pool, 1, "weight", 0, src.data(), 8), LWO_ERR_UNSUPPORTED);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_write_range: ")) << msg();
  EXPECT_EQ(std::memcmp(keep.data(), rm.mem->p, rm.total), 0);  // the caller's memory as it was
  ASSERT_LWO(lwo_pool_destroy(pool));
}

}  // namespace
}  // namespace testing
}  // namespace lwo
