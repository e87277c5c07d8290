// Sharded pools on the recording backend (a communicator of one rank): the
// shard copy, the all-gather into the slot and the ready event after it.
#include "src/common/dtype.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

using ShardedTest = EngineTest;

TEST_F(ShardedTest, ShardCopyThenGatherThenReady) {
  ModelDesc m(4);
  int fake_comm = 0;
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 4,
                                     reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr, &pool));
  // Fill through lwo_pool_write (whole tensors) and check through the shard.
  std::vector<std::vector<uint8_t>> w(4);
  for (uint32_t l = 0; l < 4; ++l) {
    uint64_t rows = (l % 5 + 1) * 37;
    w[l].resize(rows * 19 * 2);
    fill_random(w[l].data(), w[l].size(), 100 + l);
    ASSERT_LWO(lwo_pool_write(pool, l, "weight", w[l].data(), w[l].size()));
    void* shard = nullptr;
    uint64_t off = 9, bytes = 0;
    ASSERT_LWO(lwo_pool_shard_host(pool, l, &shard, &off, &bytes));
    EXPECT_EQ(off, 0u);  // rank 0 of 1
    uint64_t rb = 0;
    ASSERT_LWO(lwo_pool_record_bytes(pool, l, &rb));
    EXPECT_EQ(bytes, rb);
    EXPECT_EQ(std::memcmp(shard, w[l].data(), w[l].size()), 0);
  }
  // One rank holds the whole record: the whole-layer calls give the shard.
  void* host = nullptr;
  void* shard0 = nullptr;
  ASSERT_LWO(lwo_pool_shard_host(pool, 0, &shard0, nullptr, nullptr));
  EXPECT_EQ(lwo_pool_layer_host(pool, 0, &host, nullptr), LWO_OK);
  EXPECT_EQ(host, shard0);
  EXPECT_EQ(lwo_pool_tensor_host(pool, 0, "weight", &host, nullptr), LWO_OK);
  EXPECT_EQ(host, shard0);
  lwo_ring* ring = make_ring(pool, 2);
  StreamH c = gpu->new_stream();
  uint64_t gathers = gpu->stats.gathers;
  for (int pass = 0; pass < 3; ++pass)
    for (uint32_t l = 0; l < 4; ++l) {
      lwo_ticket t{};
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_NO_FATAL_FAILURE(acquire(ring, l, c, &t, &v));
      EXPECT_EQ(std::memcmp(v.tensors[0], w[l].data(), w[l].size()), 0) << "layer " << l;
      gpu->read(c, v.base, v.record_bytes);  // must follow the gather, not only the copy
      ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
    }
  EXPECT_EQ(gpu->stats.gathers - gathers, 12u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(ring, pool);
  lwo_pool* p2 = nullptr;
  EXPECT_EQ(lwo_pool_create_sharded(engine, m.layers.data(), 4, nullptr, nullptr, &p2),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("lwo_pool_create_sharded"), std::string::npos);
}


// Gradients of a sharded pool, for every rank of 2 and 3 (this process plays
// each in turn; the other ranks send the same gradients, so the sum is N
// times this rank's): each rank gets the elements of its own weight shard,
// summed, and moves only those to the host.
TEST_F(ShardedTest, GradientsAreSummedAndEachRankKeepsItsShard) {
  const uint32_t L = 6;
  ModelDesc m(L);
  int fake_comm = 0;
  auto value = [](uint32_t layer, uint32_t k, uint64_t i, int micro) {
    return static_cast<float>(static_cast<int>((layer * 131 + k * 17 + i * 7 + micro * 3) % 97) - 48) / 8.0f;
  };
  for (int n : {2, 3}) {
    // covered[layer][tensor][element]: how many ranks hold it.
    std::vector<std::vector<std::vector<int>>> covered(L);
    uint64_t d2h_total = 0, wire_total = 0;
    for (int r = 0; r < n; ++r) {
      gpu->fake_ranks = n;
      gpu->fake_rank = r;
      lwo_pool* pool = nullptr;
      ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), L,
                                         reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr, &pool));
      std::vector<std::vector<std::vector<uint8_t>>> w(L);
      for (uint32_t l = 0; l < L; ++l)
        for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
          lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
          ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
          w[l].emplace_back(ti.bytes);
          fill_random(w[l][k].data(), ti.bytes, 7000 + l * 10 + k);
          ASSERT_LWO(lwo_pool_write(pool, l, ti.name, w[l][k].data(), ti.bytes));
        }
      lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
      lwo_grads* g = nullptr;
      gc.flags = LWO_GRADS_NATIVE_WIRE;
      EXPECT_EQ(lwo_grads_create(pool, nullptr, &gc, &g), LWO_ERR_UNSUPPORTED);
      EXPECT_NE(std::string(lwo_last_error_message()).find("LWO_GRADS_NATIVE_WIRE"), std::string::npos);
      gc.flags = 0;
      ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &g));
      StreamH c = gpu->new_stream();
      uint64_t reduces = gpu->stats.reduces;
      for (int micro = 0; micro < 2; ++micro)
        for (uint32_t l = L; l-- > 0;) {
          lwo_layer_view v = LWO_LAYER_VIEW_INIT;
          ASSERT_LWO(lwo_grads_begin(g, l, stream(c), &v));
          wire_total += v.record_bytes;
          for (uint32_t k = 0; k < v.n_tensors; ++k) {
            lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
            ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
            uint64_t ne = ti.bytes / lwo_dtype_size(ti.dtype);
            gpu->write(c, v.tensors[k], ne * 4);
            for (uint64_t i = 0; i < ne; ++i) static_cast<float*>(v.tensors[k])[i] = value(l, k, i, micro);
          }
          ASSERT_LWO(lwo_grads_end(g, l, stream(c)));
        }
      EXPECT_EQ(gpu->stats.reduces - reduces, 2u * L);
      ASSERT_LWO(lwo_grads_wait(g));
      for (uint32_t l = 0; l < L; ++l) {
        covered[l].resize(m.layers[l].n_tensors);
        for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
          lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
          ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
          uint64_t ne = ti.bytes / lwo_dtype_size(ti.dtype), es = lwo_dtype_size(ti.dtype);
          covered[l][k].resize(ne);
          void* wd = nullptr;
          uint64_t wf = 0, wn = 0;
          ASSERT_LWO(lwo_pool_shard_tensor(pool, l, ti.name, &wd, &wf, &wn));
          float* gd = nullptr;
          uint64_t gf = 9, gn = 9;
          ASSERT_LWO(lwo_grads_shard(g, l, ti.name, &gd, &gf, &gn));
          ASSERT_EQ(wn, gn) << "n " << n << " rank " << r << " layer " << l << " " << ti.name;
          if (wn) {
            ASSERT_EQ(wf, gf);
            ASSERT_LE(wf + wn, ne);
            EXPECT_EQ(std::memcmp(wd, w[l][k].data() + wf * es, wn * es), 0);
          }
          for (uint64_t i = 0; i < gn; ++i) {
            ++covered[l][k][gf + i];
            float want = static_cast<float>(n) * (value(l, k, gf + i, 0) + value(l, k, gf + i, 1));
            ASSERT_EQ(gd[i], want) << "n " << n << " rank " << r << " layer " << l << " " << ti.name
                                   << " element " << gf + i;
          }
          // The whole-tensor accessor refuses a pool that holds only a shard.
          void* whole = nullptr;
          EXPECT_EQ(lwo_pool_tensor_host(pool, l, ti.name, &whole, nullptr),
                    n > 1 ? LWO_ERR_UNSUPPORTED : LWO_OK);
          if (n > 1) {
            EXPECT_NE(std::string(lwo_last_error_message()).find("lwo_pool_shard_tensor"),
                      std::string::npos);
          }
        }
      }
      lwo_grads_stats st{};
      st.size = sizeof st;
      ASSERT_LWO(lwo_grads_get_stats(g, &st));
      d2h_total += st.bytes;
      EXPECT_LT(st.bytes, wire_total);  // not the whole record
      destroy(g, pool);
    }
    // Over the ranks, every element exactly once, and the bytes moved to the
    // host add up to the gradients once (2 micro-batches).
    for (uint32_t l = 0; l < L; ++l)
      for (size_t k = 0; k < covered[l].size(); ++k)
        for (size_t i = 0; i < covered[l][k].size(); ++i)
          ASSERT_EQ(covered[l][k][i], 1) << "n " << n << " layer " << l << " tensor " << k << " element " << i;
    EXPECT_EQ(d2h_total * static_cast<uint64_t>(n), wire_total);
  }
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
}

// lwo_optim over a sharded pool, for every rank of 1, 2 and 3 (this process
// plays each in turn; the other ranks send the same gradients, so the sum is
// N times this rank's): each rank updates exactly the elements of its weight
// shard, from the same elements of its gradient shard, and after two AdamW
// steps they equal, bit for bit, those of an unsharded pool updated from the
// summed gradient; lwo_optim_read copies the shard's masters. With more than
// one rank, clipping (the norm of every rank's gradients) is refused.
TEST_F(ShardedTest, OptimizerUpdatesEachRanksShardAsTheWholePoolDoes) {
  const uint32_t L = 4;
  ModelDesc m(L);
  int fake_comm = 0;
  auto weight = [](uint32_t layer, uint32_t k, uint64_t i) {
    return static_cast<float>(static_cast<int>((layer * 53 + k * 29 + i * 11) % 89) - 44) / 64.0f;
  };
  auto grad = [](uint32_t layer, uint32_t k, uint64_t i) {
    return static_cast<float>(static_cast<int>((layer * 131 + k * 17 + i * 7) % 97) - 48) / 8.0f;
  };
  auto fill = [&](lwo_pool* pool) {
    for (uint32_t l = 0; l < L; ++l)
      for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
        std::vector<uint8_t> b(ti.bytes);
        const uint64_t ne = ti.bytes / lwo_dtype_size(ti.dtype);
        for (uint64_t i = 0; i < ne; ++i) store_f32(b.data(), ti.dtype, i, weight(l, k, i));
        ASSERT_LWO(lwo_pool_write(pool, l, ti.name, b.data(), b.size()));
      }
  };
  lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  // Two steps: the gradient of each is `scale` times grad() (the sum over the
  // ranks), written into the slot whole.
  auto train = [&](lwo_pool* pool, lwo_grads* g, lwo_optim* o, float scale) {
    StreamH c = gpu->new_stream();
    for (uint64_t step = 1; step <= 2; ++step) {
      ASSERT_LWO(lwo_grads_zero(g));
      for (uint32_t l = L; l-- > 0;) {
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_LWO(lwo_grads_begin(g, l, stream(c), &v));
        for (uint32_t k = 0; k < v.n_tensors; ++k) {
          ASSERT_EQ(v.tensor_dtypes[k], LWO_DTYPE_F32);
          lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
          ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
          const uint64_t ne = ti.bytes / lwo_dtype_size(ti.dtype);
          gpu->write(c, v.tensors[k], ne * 4);
          for (uint64_t i = 0; i < ne; ++i)
            static_cast<float*>(v.tensors[k])[i] = scale * grad(l, k, i) * static_cast<float>(step);
        }
        ASSERT_LWO(lwo_grads_end(g, l, stream(c)));
      }
      p.step = step;
      ASSERT_LWO(lwo_optim_step(o, &p));
      ASSERT_LWO(lwo_optim_wait(o));
    }
  };
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  for (int n : {1, 2, 3}) {
    SCOPED_TRACE(n);
    // The reference: the whole pool, f32 gradients of the sum.
    lwo_pool* whole = nullptr;
    ASSERT_LWO(lwo_pool_create_pinned(engine, m.layers.data(), L, nullptr, &whole));
    fill(whole);
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    gc.flags = LWO_GRADS_F32;
    lwo_grads* wg = nullptr;
    ASSERT_LWO(lwo_grads_create(whole, nullptr, &gc, &wg));
    lwo_optim* wo = nullptr;
    ASSERT_LWO(lwo_optim_create(wg, &oc, &wo));
    train(whole, wg, wo, static_cast<float>(n));
    std::vector<std::vector<int>> covered;
    for (int r = 0; r < n; ++r) {
      gpu->fake_ranks = n;
      gpu->fake_rank = r;
      lwo_pool* pool = nullptr;
      ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), L,
                                         reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr,
                                         &pool));
      fill(pool);
      gc.flags = 0;
      lwo_grads* g = nullptr;
      ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &g));
      lwo_optim* o = nullptr;
      lwo_optim_config clip = oc;
      clip.flags = LWO_OPTIM_CLIPPING;
      if (n > 1) {
        EXPECT_EQ(lwo_optim_create(g, &clip, &o), LWO_ERR_UNSUPPORTED);
        o = nullptr;
        EXPECT_NE(std::string(lwo_last_error_message()).find("LWO_OPTIM_CLIPPING"),
                  std::string::npos) << lwo_last_error_message();
      }
      ASSERT_LWO(lwo_optim_create(g, &oc, &o));
      train(pool, g, o, 1.0f);
      size_t at = 0;
      for (uint32_t l = 0; l < L; ++l)
        for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k, ++at) {
          lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
          ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
          const uint64_t es = lwo_dtype_size(ti.dtype), ne = ti.bytes / es;
          if (covered.size() <= at) covered.emplace_back(ne);
          void* wd = nullptr;
          uint64_t wf = 0, wn = 0;
          ASSERT_LWO(lwo_pool_shard_tensor(pool, l, ti.name, &wd, &wf, &wn));
          void* want = nullptr;
          ASSERT_LWO(lwo_pool_tensor_host(whole, l, ti.name, &want, nullptr));
          if (wn) {
            EXPECT_EQ(std::memcmp(wd, static_cast<uint8_t*>(want) + wf * es, wn * es), 0)
                << "rank " << r << " layer " << l << " " << ti.name;
          }
          for (uint64_t i = 0; i < wn; ++i) ++covered[at][wf + i];
          std::vector<float> mine(wn), all(ne);
          EXPECT_EQ(lwo_optim_read(o, l, ti.name, LWO_OPTIM_MASTER, mine.data(), wn * 4), LWO_OK)
              << lwo_last_error_message();
          ASSERT_LWO(lwo_optim_read(wo, l, ti.name, LWO_OPTIM_MASTER, all.data(), ne * 4));
          if (wn) {
            EXPECT_EQ(std::memcmp(mine.data(), all.data() + wf, wn * 4), 0);
          }
          if (wn != ne) {
            EXPECT_EQ(lwo_optim_read(o, l, ti.name, LWO_OPTIM_MASTER, all.data(), ne * 4),
                      LWO_ERR_SIZE_MISMATCH);
          }
        }
      ASSERT_LWO(lwo_optim_destroy(o));
      destroy(g, pool);
    }
    // Over the ranks, every element updated exactly once.
    for (size_t t = 0; t < covered.size(); ++t)
      for (size_t i = 0; i < covered[t].size(); ++i)
        ASSERT_EQ(covered[t][i], 1) << "tensor " << t << " element " << i;
    ASSERT_LWO(lwo_optim_destroy(wo));
    destroy(wg, whole);
  }
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
}

// A slot released without being acquired: its next copy must still wait for
// the all-gather that filled it, which ran on the collective stream.
TEST_F(ShardedTest, ReusedSlotWaitsForItsGather) {
  ModelDesc m(3);
  int fake_comm = 0;
  gpu->fake_ranks = 2;
  gpu->fake_rank = 1;
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 3,
                                     reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr, &pool));
  lwo_ring* ring = make_ring(pool, 1);
  StreamH c = gpu->new_stream();
  for (uint32_t l = 0; l < 3; ++l) {
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(ring, l, &t));
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  }
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(ring, pool);
}

// The debug check of collectives: a rank that is about to do something else
// fails the call with a status that names both ranks' steps; the ring and
// the gradients stay usable; without the check no exchange happens.
TEST_F(ShardedTest, CollectiveCheckFindsRanksThatDiffer) {
  ModelDesc m(4);
  int fake_comm = 0;
  gpu->fake_ranks = 2;
  gpu->fake_rank = 0;
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 4,
                                     reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr, &pool));
  for (uint32_t l = 0; l < 4; ++l) {
    void* shard = nullptr;
    uint64_t off = 0, bytes = 0;
    ASSERT_LWO(lwo_pool_shard_host(pool, l, &shard, &off, &bytes));
    fill_random(shard, bytes, 300 + l);
  }
  lwo_ring* ring = make_ring(pool, 2);
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  StreamH c = gpu->new_stream();
  // Off: a stage is one all-gather (the record), no exchange.
  uint64_t gathers = gpu->stats.gathers;
  lwo_ticket t{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  EXPECT_EQ(gpu->stats.gathers - gathers, 1u);

  engine_set_check_collectives(engine, true);
  // The peer stages layer 3 where this rank stages layer 1.
  auto peer_layer = [&](uint32_t layer) {
    gpu->peer_send = [layer](int, uint8_t* part, size_t bytes) {
      if (bytes == 32) std::memcpy(part + 24, &layer, 4);
    };
  };
  peer_layer(3);
  EXPECT_EQ(lwo_ring_stage(ring, 1, &t), LWO_ERR_COLLECTIVE_MISMATCH);
  std::string msg = lwo_last_error_message();
  EXPECT_NE(msg.find("lwo_ring_stage"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 0: step 0: lwo_ring_stage of layer 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1: step 0: lwo_ring_stage of layer 3"), std::string::npos) << msg;
  // The peer hits layer 0 where this rank... also hits it: agreed.
  gpu->peer_send = nullptr;
  gathers = gpu->stats.gathers;
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));  // a hit: only the exchange
  EXPECT_EQ(gpu->stats.gathers - gathers, 1u);
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  // The peer copies where this rank hits.
  gpu->peer_send = [](int, uint8_t* part, size_t bytes) {
    if (bytes == 32) part[28] = 0;
  };
  EXPECT_EQ(lwo_ring_stage(ring, 0, &t), LWO_ERR_COLLECTIVE_MISMATCH);
  EXPECT_NE(std::string(lwo_last_error_message()).find("a hit"), std::string::npos);
  // A local error of this rank: its own status, after telling the peer.
  gpu->peer_send = nullptr;
  gathers = gpu->stats.gathers;
  EXPECT_EQ(lwo_ring_stage(ring, 9, &t), LWO_ERR_OUT_OF_RANGE);
  EXPECT_EQ(gpu->stats.gathers - gathers, 1u);
  // Still usable: a copy, agreed, lands the record.
  ASSERT_NO_FATAL_FAILURE(acquire(ring, 2, c, &t, &v));
  void* shard = nullptr;
  uint64_t off = 0, bytes = 0;
  ASSERT_LWO(lwo_pool_shard_host(pool, 2, &shard, &off, &bytes));
  EXPECT_EQ(std::memcmp(v.base, shard, bytes), 0);
  gpu->read(c, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  // Gradients: the peer ends another layer.
  ASSERT_LWO(lwo_grads_begin(g, 1, stream(c), &v));
  gpu->write(c, v.base, v.record_bytes);
  peer_layer(2);
  EXPECT_EQ(lwo_grads_end(g, 1, stream(c)), LWO_ERR_COLLECTIVE_MISMATCH);
  EXPECT_NE(std::string(lwo_last_error_message()).find("lwo_grads_end of layer 2"), std::string::npos);
  gpu->peer_send = nullptr;
  ASSERT_LWO(lwo_grads_end(g, 1, stream(c)));  // the layer is still begun; now agreed
  ASSERT_LWO(lwo_grads_wait(g));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(g, ring, pool);
}

// Rank-local and sharded pools on one engine: each ring copies its own way.
TEST_F(ShardedTest, RankLocalAndShardedPoolsCoexist) {
  ModelDesc m(3);
  int fake_comm = 0;
  gpu->fake_ranks = 2;
  gpu->fake_rank = 1;
  lwo_pool* sharded = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 3,
                                     reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr, &sharded));
  lwo_pool* local = make_pool(3, 5);
  for (uint32_t l = 0; l < 3; ++l) {
    void* shard = nullptr;
    uint64_t off = 0, bytes = 0;
    ASSERT_LWO(lwo_pool_shard_host(sharded, l, &shard, &off, &bytes));
    fill_random(shard, bytes, 500 + l);
  }
  lwo_ring* rs = make_ring(sharded, 2);
  lwo_ring* rl = make_ring(local, 2);
  StreamH c = gpu->new_stream();
  for (int pass = 0; pass < 3; ++pass)
    for (uint32_t l = 0; l < 3; ++l) {
      lwo_ticket ts{}, tl{};
      lwo_layer_view vs = LWO_LAYER_VIEW_INIT, vl = LWO_LAYER_VIEW_INIT;
      uint64_t gathers = gpu->stats.gathers;
      ASSERT_LWO(lwo_ring_stage(rl, l, &tl));
      EXPECT_EQ(gpu->stats.gathers, gathers);  // the local pool gathers nothing
      ASSERT_LWO(lwo_ring_stage(rs, l, &ts));
      ASSERT_LWO(lwo_ring_acquire(rl, tl, stream(c), &vl));
      ASSERT_LWO(lwo_ring_acquire(rs, ts, stream(c), &vs));
      EXPECT_TRUE(holds_layer(local, vl));
      void* shard = nullptr;
      uint64_t off = 0, bytes = 0;
      ASSERT_LWO(lwo_pool_shard_host(sharded, l, &shard, &off, &bytes));
      EXPECT_EQ(off, bytes);  // rank 1
      // Both ranks "sent" this shard: the record is it twice.
      EXPECT_EQ(std::memcmp(static_cast<uint8_t*>(vs.base) + off, shard, bytes), 0);
      EXPECT_EQ(std::memcmp(vs.base, shard, bytes), 0);
      gpu->read(c, vs.base, vs.record_bytes);
      gpu->read(c, vl.base, vl.record_bytes);
      ASSERT_LWO(lwo_ring_release(rs, ts, stream(c)));
      ASSERT_LWO(lwo_ring_release(rl, tl, stream(c)));
    }
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  destroy(rs, rl, sharded, local);
}

}  // namespace
}  // namespace testing
}  // namespace lwo

namespace lwo {
namespace testing {
namespace {

// The hierarchical layout: shards within a node (the pool's communicator of
// `per_node` ranks), each rank's gradient part summed over the ranks that
// hold the same shard on the other nodes too (a replica communicator of
// `nodes` ranks). This process plays every rank of the pool's communicator
// in turn; every rank sends the same gradient, so the host shard is
// per_node x nodes times this rank's part. The all-reduce runs on the
// collective stream after the reduction and before the copy down (the
// log's order; an unordered copy would be a violation), over this rank's
// part only.
TEST_F(ShardedTest, AReplicaCommunicatorSumsEachShardOverTheNodes) {
  const uint32_t L = 3;
  ModelDesc m(L);
  int pool_comm = 0, replica_comm = 0;
  auto value = [](uint32_t layer, uint32_t k, uint64_t i) {
    return static_cast<float>(static_cast<int>((layer * 131 + k * 17 + i * 7) % 97) - 48) / 8.0f;
  };
  struct Shape {
    int per_node, nodes;
  };
  for (Shape sh : {Shape{2, 2}, Shape{1, 3}, Shape{3, 1}}) {
    SCOPED_TRACE(::testing::Message() << sh.per_node << " ranks per node x " << sh.nodes);
    for (int r = 0; r < sh.per_node; ++r) {
      SCOPED_TRACE(r);
      gpu->fake_comms[&pool_comm] = {sh.per_node, r, -1};
      gpu->fake_comms[&replica_comm] = {sh.nodes, (r + 1) % sh.nodes, -1};
      lwo_pool* pool = nullptr;
      ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), L,
                                         reinterpret_cast<lwo_nccl_comm_t>(&pool_comm), nullptr,
                                         &pool));
      lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
      EXPECT_EQ(gc.replica_comm, nullptr);
      gc.replica_comm = reinterpret_cast<lwo_nccl_comm_t>(&replica_comm);
      lwo_grads* g = nullptr;
      ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &g));
      StreamH c = gpu->new_stream();
      const uint64_t all_reduces = gpu->stats.all_reduces;
      const uint64_t floats = gpu->stats.all_reduce_floats;
      uint64_t kept = 0;  // this rank's gradient elements
      gpu->log.clear();
      gpu->keep_log = true;
      for (uint32_t l = L; l-- > 0;) {
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_LWO(lwo_grads_begin(g, l, stream(c), &v));
        for (uint32_t k = 0; k < v.n_tensors; ++k) {
          const uint64_t ne = v.tensor_bytes[k] / 4;
          gpu->write(c, v.tensors[k], ne * 4);
          for (uint64_t i = 0; i < ne; ++i) static_cast<float*>(v.tensors[k])[i] = value(l, k, i);
        }
        ASSERT_LWO(lwo_grads_end(g, l, stream(c)));
      }
      gpu->keep_log = false;
      ASSERT_LWO(lwo_grads_wait(g));
      const float times = static_cast<float>(sh.per_node * sh.nodes);
      for (uint32_t l = 0; l < L; ++l)
        for (uint32_t k = 0; k < m.layers[l].n_tensors; ++k) {
          float* h = nullptr;
          uint64_t first = 0, n = 0;
          ASSERT_LWO(lwo_grads_shard(g, l, m.layers[l].tensors[k].name, &h, &first, &n));
          kept += n;
          for (uint64_t i = 0; i < n; ++i)
            ASSERT_EQ(h[i], times * value(l, k, first + i)) << "layer " << l << " tensor " << k;
        }
      EXPECT_EQ(gpu->stats.all_reduces - all_reduces, L);
      // This rank's part of each layer: its elements, and the padding after
      // a tensor (less than LWO_RECORD_ALIGN bytes) where the part goes on.
      uint32_t n_tensors = 0;
      for (uint32_t l = 0; l < L; ++l) n_tensors += m.layers[l].n_tensors;
      EXPECT_GE(gpu->stats.all_reduce_floats - floats, kept);
      EXPECT_LT(gpu->stats.all_reduce_floats - floats, kept + n_tensors * LWO_RECORD_ALIGN / 4);
      // Per end: the reduction, then the all-reduce, then the copy down.
      std::vector<std::string> order;
      for (const std::string& line : gpu->log)
        if (line.rfind("reduce", 0) == 0 || line.rfind("all_reduce", 0) == 0 ||
            line.rfind("d2h", 0) == 0)
          order.push_back(line.substr(0, line.find(' ')));
      std::vector<std::string> want;
      for (uint32_t l = 0; l < L; ++l) want.insert(want.end(), {"reduce", "all_reduce", "d2h"});
      EXPECT_EQ(order, want);
      EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
      destroy(g, pool);
    }
  }
  gpu->fake_comms.clear();
}

// The refusals of a replica communicator, each naming it: with a pool that
// is not sharded (LWO_ERR_UNSUPPORTED), the pool's own communicator, and one
// on another device (LWO_ERR_INVALID_ARGUMENT). A caller's struct that ends
// before replica_comm means none, whatever follows it in memory.
TEST_F(ShardedTest, AReplicaCommunicatorIsRefusedWhereItCannotSum) {
  ModelDesc m(2);
  int pool_comm = 0, replica_comm = 0;
  gpu->fake_comms[&pool_comm] = {2, 1, -1};
  gpu->fake_comms[&replica_comm] = {2, 0, 3};  // on device 3
  auto msg = [] { return std::string(lwo_last_error_message()); };
  lwo_pool* pinned = make_pool(2);
  lwo_pool* sharded = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 2,
                                     reinterpret_cast<lwo_nccl_comm_t>(&pool_comm), nullptr,
                                     &sharded));
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.replica_comm = reinterpret_cast<lwo_nccl_comm_t>(&replica_comm);
  lwo_grads* g = nullptr;
  EXPECT_EQ(lwo_grads_create(pinned, nullptr, &gc, &g), LWO_ERR_UNSUPPORTED);
  EXPECT_NE(msg().find("lwo_grads_create: replica communicator"), std::string::npos) << msg();
  EXPECT_NE(msg().find("sums the gradient shards of a sharded pool"), std::string::npos) << msg();
  EXPECT_EQ(g, nullptr);
  gc.replica_comm = reinterpret_cast<lwo_nccl_comm_t>(&pool_comm);
  EXPECT_EQ(lwo_grads_create(sharded, nullptr, &gc, &g), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg().find("is the pool's own communicator"), std::string::npos) << msg();
  gc.replica_comm = reinterpret_cast<lwo_nccl_comm_t>(&replica_comm);
  EXPECT_EQ(lwo_grads_create(sharded, nullptr, &gc, &g), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg().find("is on device 3, the engine on device 0"), std::string::npos) << msg();
  EXPECT_EQ(g, nullptr);
  // An older caller's struct: its size ends before replica_comm.
  struct Old {
    lwo_grads_config cfg;
  } old;
  std::memset(&old, 0xab, sizeof old);
  old.cfg.size = offsetof(lwo_grads_config, replica_comm);
  old.cfg.depth = 2;
  old.cfg.flags = 0;
  old.cfg.n_threads = 0;
  const uint64_t all_reduces = gpu->stats.all_reduces;
  ASSERT_LWO(lwo_grads_create(sharded, nullptr, &old.cfg, &g));
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(g, 0, stream(c), &v));
  gpu->write(c, v.base, v.record_bytes);
  ASSERT_LWO(lwo_grads_end(g, 0, stream(c)));
  ASSERT_LWO(lwo_grads_wait(g));
  EXPECT_EQ(gpu->stats.all_reduces, all_reduces);  // no replica communicator
  destroy(g, sharded, pinned);
  gpu->fake_comms.clear();
}

// Under the collective check (LWO_ENGINE_CHECK_COLLECTIVES) a gradient end
// with a replica communicator is exchanged on both communicators: two tag
// all-gathers per end.
TEST_F(ShardedTest, TheCollectiveCheckOfAnEndCoversTheReplicaCommunicator) {
  ModelDesc m(2);
  int pool_comm = 0, replica_comm = 0;
  gpu->fake_comms[&pool_comm] = {2, 0, -1};
  gpu->fake_comms[&replica_comm] = {2, 1, -1};
  engine_set_check_collectives(engine, true);
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 2,
                                     reinterpret_cast<lwo_nccl_comm_t>(&pool_comm), nullptr,
                                     &pool));
  for (bool replica : {false, true}) {
    SCOPED_TRACE(replica);
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    if (replica) gc.replica_comm = reinterpret_cast<lwo_nccl_comm_t>(&replica_comm);
    lwo_grads* g = nullptr;
    ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &g));
    StreamH c = gpu->new_stream();
    const uint64_t gathers = gpu->stats.gathers;
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(g, 1, stream(c), &v));
    gpu->write(c, v.base, v.record_bytes);
    ASSERT_LWO(lwo_grads_end(g, 1, stream(c)));
    ASSERT_LWO(lwo_grads_wait(g));
    EXPECT_EQ(gpu->stats.gathers - gathers, replica ? 2u : 1u);
    EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
    ASSERT_LWO(lwo_grads_destroy(g));
  }
  destroy(pool);
  gpu->fake_comms.clear();
}

}  // namespace
}  // namespace testing
}  // namespace lwo
