// Gradients to host on the recording backend: ordering of every copy against
// the writes into staging slots, f32 / native wire, accumulation, fences.
#include <cmath>
#include <random>

#include "src/common/dtype.h"

#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

class GradsTest : public EngineTest {
 protected:
  // Layers: "weight" [rows, 19] bf16 + (odd layers) "bias" [rows] f32, as ModelDesc.
  lwo_grads* make_grads(lwo_pool* pool, const uint8_t* trainable, uint32_t depth, uint32_t flags) {
    lwo_grads_config c = LWO_GRADS_CONFIG_INIT;
    c.depth = depth;
    c.flags = flags;
    lwo_grads* g = nullptr;
    EXPECT_EQ(lwo_grads_create(pool, trainable, &c, &g), LWO_OK) << lwo_last_error_message();
    return g;
  }
  // A "kernel" on `s` writing values v(i) = f(layer, tensor, i, micro) into
  // the staging slot, in the wire dtype. Values are multiples of 1/8 below
  // 64, exact in bf16, f16 and f32, so sums are exact too.
  static float value(uint32_t layer, uint32_t tensor, uint64_t i, int micro) {
    return static_cast<float>(static_cast<int>((layer * 131 + tensor * 17 + i * 7 + micro * 3) % 97) - 48) / 8.0f;
  }
  void write_grads(lwo_grads* g, lwo_pool* pool, uint32_t layer, StreamH s, int micro, bool native,
                   const lwo_layer_view& v) {
    for (uint32_t k = 0; k < v.n_tensors; ++k) {
      lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
      ASSERT_LWO(lwo_pool_tensor_info(pool, layer, k, &ti));
      uint64_t n = ti.bytes / lwo_dtype_size(ti.dtype);
      lwo_dtype_t wire = native ? ti.dtype : LWO_DTYPE_F32;
      size_t es = lwo_dtype_size(wire);
      gpu->write(s, v.tensors[k], n * es);
      for (uint64_t i = 0; i < n; ++i) {
        float f = value(layer, k, i, micro);
        uint8_t* dst = static_cast<uint8_t*>(v.tensors[k]) + i * es;
        if (wire == LWO_DTYPE_F32) {
          std::memcpy(dst, &f, 4);
        } else {  // bf16: the top half of the f32 (exact for these values)
          uint32_t u;
          std::memcpy(&u, &f, 4);
          uint16_t h = static_cast<uint16_t>(u >> 16);
          std::memcpy(dst, &h, 2);
        }
      }
    }
    (void)g;
  }
  void expect_host(lwo_grads* g, lwo_pool* pool, uint32_t layer, std::vector<int> micros) {
    const std::vector<lwo_tensor_info> tensors = layer_tensors(pool, layer);
    for (uint32_t k = 0; k < tensors.size(); ++k) {
      const lwo_tensor_info& ti = tensors[k];
      float* h = nullptr;
      uint64_t n = 0, first = 9;
      ASSERT_LWO(lwo_grads_shard(g, layer, ti.name, &h, &first, &n));
      ASSERT_EQ(first, 0u);
      ASSERT_EQ(n, ti.bytes / lwo_dtype_size(ti.dtype));
      for (uint64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int m : micros) want += value(layer, k, i, m);
        ASSERT_EQ(h[i], want) << "layer " << layer << " tensor " << ti.name << " i " << i;
      }
    }
  }
};

TEST_F(GradsTest, F32WireLandsInPlaceThenAccumulates) {
  lwo_pool* pool = make_pool(4);
  lwo_grads* g = make_grads(pool, nullptr, 2, LWO_GRADS_F32);
  StreamH c = gpu->new_stream();
  for (int micro = 0; micro < 3; ++micro) {
    for (uint32_t l = 4; l-- > 0;) {
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_grads_begin(g, l, stream(c), &v));
      write_grads(g, pool, l, c, micro, false, v);
      ASSERT_LWO(lwo_grads_end(g, l, stream(c)));
    }
    ASSERT_LWO(lwo_grads_wait(g));
    std::vector<int> ms;
    for (int m = 0; m <= micro; ++m) ms.push_back(m);
    for (uint32_t l = 0; l < 4; ++l) expect_host(g, pool, l, ms);
  }
  lwo_grads_stats st{};
  st.size = sizeof st;
  ASSERT_LWO(lwo_grads_get_stats(g, &st));
  EXPECT_EQ(st.n_transfers, 12u);
  EXPECT_EQ(st.n_accumulated, 8u);  // the first micro-batch landed in place
  ASSERT_LWO(lwo_grads_zero(g));
  // A new sum: layer 2 gets one gradient, the others none and read as zero.
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(g, 2, stream(c), &v));
  write_grads(g, pool, 2, c, 5, false, v);
  ASSERT_LWO(lwo_grads_end(g, 2, stream(c)));
  ASSERT_LWO(lwo_grads_wait(g));
  for (uint32_t l = 0; l < 4; ++l) expect_host(g, pool, l, l == 2 ? std::vector<int>{5} : std::vector<int>{});
  ASSERT_LWO(lwo_grads_zero(g));
  ASSERT_LWO(lwo_grads_wait(g));
  for (uint32_t l = 0; l < 4; ++l) expect_host(g, pool, l, {});
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(GradsTest, NativeWireHalvesTrafficAndConvertsExactly) {
  lwo_pool* pool = make_pool(3);
  lwo_grads* g32 = make_grads(pool, nullptr, 1, LWO_GRADS_F32);
  lwo_grads* g16 = make_grads(pool, nullptr, 1, LWO_GRADS_NATIVE_WIRE);
  StreamH c = gpu->new_stream();
  for (lwo_grads* g : {g32, g16}) {
    for (int micro = 0; micro < 2; ++micro)
      for (uint32_t l = 0; l < 3; ++l) {
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_LWO(lwo_grads_begin(g, l, stream(c), &v));
        write_grads(g, pool, l, c, micro, g == g16, v);
        ASSERT_LWO(lwo_grads_end(g, l, stream(c)));
      }
    ASSERT_LWO(lwo_grads_wait(g));
    for (uint32_t l = 0; l < 3; ++l) expect_host(g, pool, l, {0, 1});
  }
  lwo_grads_stats s32{}, s16{};
  s32.size = s16.size = sizeof s32;
  ASSERT_LWO(lwo_grads_get_stats(g32, &s32));
  ASSERT_LWO(lwo_grads_get_stats(g16, &s16));
  EXPECT_LT(s16.bytes, s32.bytes * 3 / 4);  // bf16 weights travel in half the bytes
  EXPECT_EQ(s16.n_accumulated, 6u);       // every native transfer is converted
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_grads_destroy(g32));
  ASSERT_LWO(lwo_grads_destroy(g16));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Random interleavings over several streams and slot depths: every copy to
// host is ordered after the writes it reads, no slot is rewritten before its
// copy has left, and the sums are exact.
TEST_F(GradsTest, RandomInterleavingsKeepOrderAndSums) {
  const uint32_t L = 6;
  lwo_pool* pool = make_pool(L);
  std::mt19937 rng(4242);
  std::vector<StreamH> streams = {gpu->new_stream(), gpu->new_stream()};
  for (uint32_t depth = 1; depth <= 4; ++depth) {
    for (uint32_t flags : {LWO_GRADS_F32, LWO_GRADS_NATIVE_WIRE}) {
      uint8_t trainable[L];
      for (uint32_t l = 0; l < L; ++l) trainable[l] = (l % 3 != 1);
      lwo_grads* g = make_grads(pool, trainable, depth, flags);
      std::vector<std::vector<int>> sent(L);
      for (int micro = 0; micro < 4; ++micro) {
        std::vector<uint32_t> order;
        for (uint32_t l = 0; l < L; ++l)
          if (trainable[l]) order.push_back(l);
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<std::pair<uint32_t, StreamH>> open;
        size_t next = 0;
        while (next < order.size() || !open.empty()) {
          bool can_begin = next < order.size() && open.size() < depth;
          if (can_begin && (open.empty() || rng() % 2)) {
            uint32_t l = order[next++];
            StreamH s = streams[rng() % streams.size()];
            lwo_layer_view v = LWO_LAYER_VIEW_INIT;
            ASSERT_LWO(lwo_grads_begin(g, l, stream(s), &v));
            write_grads(g, pool, l, s, micro, flags == LWO_GRADS_NATIVE_WIRE, v);
            open.push_back({l, s});
          } else {
            size_t i = rng() % open.size();
            ASSERT_LWO(lwo_grads_end(g, open[i].first, stream(open[i].second)));
            sent[open[i].first].push_back(micro);
            open.erase(open.begin() + static_cast<long>(i));
          }
          ASSERT_TRUE(gpu->violations.empty()) << gpu->violations[0];
        }
      }
      ASSERT_LWO(lwo_grads_wait(g));
      for (uint32_t l = 0; l < L; ++l)
        if (trainable[l]) expect_host(g, pool, l, sent[l]);
      ASSERT_LWO(lwo_grads_destroy(g));
    }
  }
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Layers begun and ended one at a time rotate through the staging slots, so
// a layer's gradients never wait for the previous layer's copy to host.
TEST_F(GradsTest, SlotsRotate) {
  lwo_pool* pool = make_pool(6);
  lwo_grads* g = make_grads(pool, nullptr, 3, LWO_GRADS_F32);
  StreamH c = gpu->new_stream();
  std::vector<void*> bases;
  for (uint32_t l = 0; l < 6; ++l) {
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_grads_begin(g, l, stream(c), &v));
    bases.push_back(v.base);
    write_grads(g, pool, l, c, 0, false, v);
    ASSERT_LWO(lwo_grads_end(g, l, stream(c)));
  }
  EXPECT_NE(bases[0], bases[1]);
  EXPECT_NE(bases[1], bases[2]);
  EXPECT_NE(bases[0], bases[2]);
  EXPECT_EQ(bases[0], bases[3]);  // least recently used comes round again
  EXPECT_EQ(bases[1], bases[4]);
  ASSERT_LWO(lwo_grads_wait(g));
  for (uint32_t l = 0; l < 6; ++l) expect_host(g, pool, l, {0});
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(GradsTest, MisuseGivesDistinctStatuses) {
  lwo_pool* pool = make_pool(3);
  uint8_t trainable[3] = {1, 0, 1};
  lwo_grads* g = make_grads(pool, trainable, 1, LWO_GRADS_F32);
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_grads_begin(g, 1, stream(c), &v), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("layer 1 is frozen"), std::string::npos);
  EXPECT_EQ(lwo_grads_begin(g, 3, stream(c), &v), LWO_ERR_OUT_OF_RANGE);
  EXPECT_EQ(lwo_grads_end(g, 0, stream(c)), LWO_ERR_TICKET_STATE);
  ASSERT_LWO(lwo_grads_begin(g, 0, stream(c), &v));
  EXPECT_EQ(lwo_grads_begin(g, 0, stream(c), &v), LWO_ERR_LAYER_BUSY);
  EXPECT_EQ(lwo_grads_begin(g, 2, stream(c), &v), LWO_ERR_RING_FULL);
  EXPECT_EQ(lwo_grads_wait(g), LWO_ERR_BUSY);
  EXPECT_EQ(lwo_grads_destroy(g), LWO_ERR_BUSY);
  EXPECT_EQ(lwo_pool_destroy(pool), LWO_ERR_BUSY);
  EXPECT_NE(std::string(lwo_last_error_message()).find("gradient set"), std::string::npos);
  float* h = nullptr;
  EXPECT_EQ(lwo_grads_shard(g, 0, "nope", &h, nullptr, nullptr), LWO_ERR_NOT_FOUND);
  EXPECT_EQ(lwo_grads_shard(g, 1, "weight", &h, nullptr, nullptr), LWO_ERR_INVALID_ARGUMENT);
  write_grads(g, pool, 0, c, 0, false, v);
  ASSERT_LWO(lwo_grads_end(g, 0, stream(c)));
  ASSERT_LWO(lwo_grads_wait(g));
  expect_host(g, pool, 0, {0});
  lwo_grads_config bad = LWO_GRADS_CONFIG_INIT;
  bad.depth = 0;
  lwo_grads* g2 = nullptr;
  EXPECT_EQ(lwo_grads_create(pool, nullptr, &bad, &g2), LWO_ERR_INVALID_ARGUMENT);
  bad = lwo_grads_config LWO_GRADS_CONFIG_INIT;
  bad.flags = 8;
  EXPECT_EQ(lwo_grads_create(pool, nullptr, &bad, &g2), LWO_ERR_INVALID_ARGUMENT);
  uint8_t none[3] = {0, 0, 0};
  EXPECT_EQ(lwo_grads_create(pool, none, nullptr, &g2), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(g2, nullptr);
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(GradsTest, Fp8LayersCannotBeTrainable) {
  lwo_tensor_desc t = tensor("w", LWO_DTYPE_F8_E4M3, {64});
  lwo_layer_desc l{&t, 1, nullptr};
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, &l, 1, nullptr, &pool));
  lwo_grads* g = nullptr;
  EXPECT_EQ(lwo_grads_create(pool, nullptr, nullptr, &g), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("f8_e4m3"), std::string::npos);
  ASSERT_LWO(lwo_pool_destroy(pool));
}


// ---- native gradients (the 0.3 default) ------------------------------------

// The host buffer of tensor `name` of `layer` through lwo_grads_tensor.
lwo_grad_tensor grad_tensor(lwo_grads* g, uint32_t layer, const char* name) {
  lwo_grad_tensor t = LWO_GRAD_TENSOR_INIT;
  EXPECT_EQ(lwo_grads_tensor(g, layer, name, &t), LWO_OK) << lwo_last_error_message();
  return t;
}

// Flags 0: each tensor travels and lands in its own dtype (bf16 weights, f32
// biases); the first gradient after a zero lands by DMA with no host work, the
// later ones are added on the host. The values' sums are exact in bf16.
TEST_F(GradsTest, NativeDefaultKeepsEachTensorsDtypeAndAddsOnTheHost) {
  lwo_pool* pool = make_pool(4);
  lwo_grads* g = make_grads(pool, nullptr, 2, 0);
  StreamH c = gpu->new_stream();
  uint64_t wire_total = 0, record_total = 0;  // tensor bytes; records with their padding
  for (int micro = 0; micro < 3; ++micro) {
    for (uint32_t l = 4; l-- > 0;) {
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_grads_begin(g, l, stream(c), &v));
      for (uint32_t k = 0; k < v.n_tensors; ++k) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
        EXPECT_EQ(v.tensor_dtypes[k], ti.dtype) << "layer " << l << " tensor " << ti.name;
        EXPECT_EQ(v.tensor_bytes[k], ti.bytes) << "the wire is the tensor's own size";
        if (micro == 0) wire_total += ti.bytes;
      }
      if (micro == 0) record_total += v.record_bytes;
      write_grads(g, pool, l, c, micro, true, v);
      ASSERT_LWO(lwo_grads_end(g, l, stream(c)));
    }
    ASSERT_LWO(lwo_grads_wait(g));
    for (uint32_t l = 0; l < 4; ++l) {
      uint32_t nt = 0;
      ASSERT_LWO(lwo_pool_layer_tensor_count(pool, l, &nt));
      for (uint32_t k = 0; k < nt; ++k) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
        lwo_grad_tensor t = grad_tensor(g, l, ti.name);
        ASSERT_EQ(t.dtype, ti.dtype);
        ASSERT_EQ(t.first_element, 0u);
        ASSERT_EQ(t.n_elements, ti.bytes / lwo_dtype_size(ti.dtype));
        ASSERT_NE(t.data, nullptr);
        for (uint64_t i = 0; i < t.n_elements; ++i) {
          double want = 0;
          for (int m = 0; m <= micro; ++m) want += value(l, k, i, m);
          const float got = ti.dtype == LWO_DTYPE_BF16
                                ? bf16_to_f32(static_cast<const uint16_t*>(t.data)[i])
                                : static_cast<const float*>(t.data)[i];
          ASSERT_EQ(got, want) << "layer " << l << " " << ti.name << " element " << i
                               << " after micro-batch " << micro;
        }
      }
    }
  }
  lwo_grads_stats st{};
  st.size = sizeof st;
  ASSERT_LWO(lwo_grads_get_stats(g, &st));
  EXPECT_EQ(st.n_transfers, 12u);
  EXPECT_EQ(st.bytes, 3 * record_total);  // nothing widened on the wire
  EXPECT_EQ(st.n_accumulated, 8u);        // micro-batch 0 landed in place
  EXPECT_EQ(st.accumulated_bytes, 2 * wire_total);
  EXPECT_GT(st.accumulate_ns, 0u);
  // lwo_grads_shard reads f32 buffers only: the bf16 weight is refused with
  // its own status, the f32 bias of layer 1 is not.
  float* h = nullptr;
  EXPECT_EQ(lwo_grads_shard(g, 1, "weight", &h, nullptr, nullptr), LWO_ERR_BAD_DTYPE);
  const std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("lwo_grads_shard: layer 1 tensor 'weight'"), std::string::npos) << m;
  EXPECT_NE(m.find("bf16"), std::string::npos) << m;
  EXPECT_NE(m.find("lwo_grads_tensor"), std::string::npos) << m;
  ASSERT_LWO(lwo_grads_shard(g, 1, "bias", &h, nullptr, nullptr));
  EXPECT_EQ(static_cast<void*>(h), grad_tensor(g, 1, "bias").data);
  lwo_grad_tensor t = LWO_GRAD_TENSOR_INIT;
  EXPECT_EQ(lwo_grads_tensor(g, 1, "nope", &t), LWO_ERR_NOT_FOUND);
  EXPECT_EQ(lwo_grads_tensor(g, 9, "weight", &t), LWO_ERR_OUT_OF_RANGE);
  EXPECT_EQ(lwo_grads_tensor(g, 1, "weight", nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(GradsTest, WireFlagsExcludeEachOther) {
  lwo_pool* pool = make_pool(2);
  lwo_grads_config c = LWO_GRADS_CONFIG_INIT;
  c.flags = LWO_GRADS_F32 | LWO_GRADS_NATIVE_WIRE;
  lwo_grads* g = nullptr;
  EXPECT_EQ(lwo_grads_create(pool, nullptr, &c, &g), LWO_ERR_INVALID_ARGUMENT);
  const std::string m = lwo_last_error_message();
  EXPECT_NE(m.find("lwo_grads_create: flags 0x3"), std::string::npos) << m;
  EXPECT_EQ(g, nullptr);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// bf16 and f16 layers summed on the host: each sum rounds once from f32 to the
// buffer's dtype, to nearest even, within half an ulp of the fp64 sum (plus
// f32's own rounding of the sum).
TEST_F(GradsTest, NativeHostSumsRoundOnceToNearestEven) {
  const uint64_t n = 1000 + 37;  // not a multiple of any vector width
  for (lwo_dtype_t dt : {LWO_DTYPE_BF16, LWO_DTYPE_F16}) {
    SCOPED_TRACE(lwo_dtype_name(dt));
    lwo_tensor_desc t = tensor("w", dt, {static_cast<int64_t>(n)});
    lwo_layer_desc ld{&t, 1, nullptr};
    lwo_pool* pool = nullptr;
    ASSERT_LWO(lwo_pool_create_pinned(engine, &ld, 1, nullptr, &pool));
    lwo_grads* g = make_grads(pool, nullptr, 1, 0);
    StreamH c = gpu->new_stream();
    std::mt19937 rng(dt * 7 + 1);
    std::uniform_real_distribution<float> u(-4.f, 4.f);
    auto round16 = [&](float f) { return dt == LWO_DTYPE_BF16 ? f32_to_bf16(f) : f32_to_f16(f); };
    auto widen = [&](uint16_t h) { return dt == LWO_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h); };
    std::vector<uint16_t> sum(n);
    for (int micro = 0; micro < 3; ++micro) {
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      ASSERT_LWO(lwo_grads_begin(g, 0, stream(c), &v));
      ASSERT_EQ(v.tensor_dtypes[0], dt);
      gpu->write(c, v.tensors[0], n * 2);
      auto* w = static_cast<uint16_t*>(v.tensors[0]);
      for (uint64_t i = 0; i < n; ++i) {
        // Mixed magnitudes, so sums need rounding.
        w[i] = round16(u(rng) * (i % 3 == 0 ? 1.f / 64 : 1.f));
        sum[i] = micro == 0 ? w[i] : round16(widen(sum[i]) + widen(w[i]));
      }
      std::vector<uint16_t> before(n);
      if (micro > 0) std::memcpy(before.data(), grad_tensor(g, 0, "w").data, n * 2);
      ASSERT_LWO(lwo_grads_end(g, 0, stream(c)));
      ASSERT_LWO(lwo_grads_wait(g));
      const auto* got = static_cast<const uint16_t*>(grad_tensor(g, 0, "w").data);
      for (uint64_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], sum[i]) << "element " << i << " micro-batch " << micro;
        if (micro == 0) continue;
        const double exact = double(widen(before[i])) + double(widen(w[i]));
        const double r = widen(got[i]);
        const int e = r == 0 ? -126 : std::ilogb(r);  // ilogb(0) is INT_MIN
        const double ulp = dt == LWO_DTYPE_BF16 ? std::ldexp(1.0, std::max(e, -126) - 7)
                                                : std::ldexp(1.0, std::max(e, -14) - 10);
        EXPECT_LE(std::fabs(r - exact), 0.5 * ulp + std::fabs(exact) * 0x1p-24) << "element " << i;
      }
    }
    EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
    ASSERT_LWO(lwo_grads_destroy(g));
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
}

// The host addition by itself, every pair of dtypes, lengths around the vector
// widths, against the scalar conversions and an fp64 bound.
TEST(HostAddition, EveryPairMatchesTheScalarRoundingAndFp64) {
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> u(-100.f, 100.f);
  const std::pair<lwo_dtype_t, lwo_dtype_t> pairs[] = {
      {LWO_DTYPE_F32, LWO_DTYPE_F32}, {LWO_DTYPE_F32, LWO_DTYPE_BF16}, {LWO_DTYPE_F32, LWO_DTYPE_F16},
      {LWO_DTYPE_BF16, LWO_DTYPE_BF16}, {LWO_DTYPE_F16, LWO_DTYPE_F16}};
  auto load = [](const std::vector<uint8_t>& b, lwo_dtype_t d, uint64_t i) -> float {
    if (d == LWO_DTYPE_F32) {
      float f;
      std::memcpy(&f, b.data() + 4 * i, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, b.data() + 2 * i, 2);
    return d == LWO_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
  };
  auto store = [](std::vector<uint8_t>& b, lwo_dtype_t d, uint64_t i, float f) {
    if (d == LWO_DTYPE_F32) return std::memcpy(b.data() + 4 * i, &f, 4), void();
    uint16_t h = d == LWO_DTYPE_BF16 ? f32_to_bf16(f) : f32_to_f16(f);
    std::memcpy(b.data() + 2 * i, &h, 2);
  };
  for (auto [dd, sd] : pairs)
    for (uint64_t n : {uint64_t{1}, uint64_t{15}, uint64_t{64}, uint64_t{1000}, uint64_t{4099}})
      for (bool assign : {true, false}) {
        SCOPED_TRACE(std::string(lwo_dtype_name(sd)) + " into " + lwo_dtype_name(dd) + " n " +
                     std::to_string(n) + (assign ? " assign" : " add"));
        std::vector<uint8_t> d(n * lwo_dtype_size(dd)), s(n * lwo_dtype_size(sd));
        for (uint64_t i = 0; i < n; ++i) {
          store(d, dd, i, u(rng));
          store(s, sd, i, u(rng) * (i % 4 == 0 ? 1e-3f : 1.f));
        }
        std::vector<uint8_t> want = d;
        for (uint64_t i = 0; i < n; ++i)
          store(want, dd, i, assign ? load(s, sd, i) : load(d, dd, i) + load(s, sd, i));
        std::vector<uint8_t> got = d;
        lwo::accumulate(got.data(), dd, s.data(), sd, n, assign);
        ASSERT_EQ(got, want);
        for (uint64_t i = 0; i < n; ++i) {
          const double exact = (assign ? 0.0 : double(load(d, dd, i))) + double(load(s, sd, i));
          const double r = load(got, dd, i);
          const int bits = dd == LWO_DTYPE_F32 ? 23 : dd == LWO_DTYPE_BF16 ? 7 : 10;
          const int e = r == 0 ? -126 : std::ilogb(r);  // ilogb(0) is INT_MIN
          const double ulp = std::ldexp(1.0, std::max(e, dd == LWO_DTYPE_F16 ? -14 : -126) - bits);
          ASSERT_LE(std::fabs(r - exact), 0.5 * ulp + std::fabs(exact) * 0x1p-24) << "element " << i;
        }
      }
  EXPECT_THROW(lwo::accumulate(nullptr, LWO_DTYPE_BF16, nullptr, LWO_DTYPE_F32, 1, false),
               lwo::Error);
}

// The branch-free f16 widening is exact for every one of the 65536 values.
TEST(HostAddition, F16WideningIsExactForEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double want = e == 0 ? std::ldexp(double(m), -24)
                         : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(double(m | 0x400), int(e) - 25);
    if (h & 0x8000) want = -want;
    const float got = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(want))
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
    else
      ASSERT_EQ(double(got), want) << std::hex << h;
    if (!std::isnan(want)) {
      ASSERT_EQ(f32_to_f16(got), h) << "round trip of " << std::hex << h;
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace lwo
