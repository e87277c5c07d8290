// Quantized tensors in records (since 0.4.0): the LWO_EXT_TENSOR_QUANT
// extension through lwo_record_layout, pinned and registered pools, the
// tensor info, lwo_pool_write / lwo_pool_write_quantized against
// lwo_quantize, and the refusals (chain errors, shapes, gradients).
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/common/dtype.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

constexpr lwo_quant_format_t kFormats[] = {LWO_QUANT_FP8_E4M3_CHANNEL, LWO_QUANT_FP8_E4M3_BLOCK128,
                                           LWO_QUANT_INT8_CHANNEL, LWO_QUANT_INT4_GROUP128};

std::string msg() { return lwo_last_error_message(); }
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

#define EXPECT_ERR(status, call, part, expr)                                              \
  do {                                                                                    \
    lwo_status_t s_ = (expr);                                                             \
    std::string m_ = msg();                                                               \
    EXPECT_STREQ(lwo_status_string(status), lwo_status_string(s_)) << #expr << ": " << m_; \
    EXPECT_EQ(m_.rfind(call, 0), 0u) << #expr << ": " << m_;                             \
    EXPECT_TRUE(contains(m_, part)) << #expr << ": \"" << m_ << "\" lacks \"" << (part)   \
                                    << "\"";                                              \
  } while (0)

lwo_tensor_quant_ext quant_ext(lwo_quant_format_t f) {
  lwo_tensor_quant_ext q{};
  q.header.type = LWO_EXT_TENSOR_QUANT;
  q.format = f;
  return q;
}

uint64_t quant_bytes(lwo_quant_format_t f, lwo_dtype_t dt, int64_t rows, int64_t cols) {
  lwo_quant_desc d = LWO_QUANT_DESC_INIT;
  d.format = f;
  d.dtype = dt;
  d.rows = rows;
  d.cols = cols;
  lwo_quant_layout_info info = LWO_QUANT_LAYOUT_INFO_INIT;
  EXPECT_EQ(lwo_quant_layout(&d, &info), LWO_OK) << msg();
  return info.total_bytes;
}

uint64_t align256(uint64_t v) { return (v + 255) / 256 * 256; }

// Random f32 weights, a few large outliers per row (heavy-tailed).
std::vector<float> weights(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, 0.05f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (auto& v : w) v = n(rng);
  for (int64_t r = 0; r < rows; ++r)
    for (int k = 0; k < 3; ++k) w[static_cast<size_t>(r * cols + rng() % cols)] *= 40.f;
  return w;
}

std::vector<uint8_t> convert(const std::vector<float>& w, lwo_dtype_t dt) {
  std::vector<uint8_t> out(w.size() * dtype_size(dt));
  for (size_t i = 0; i < w.size(); ++i) store_f32(out.data(), dt, i, w[i]);
  return out;
}

// A layer: "norm" f32 [cols], "weight" [rows, cols] quantized in `f`,
// "bias" bf16 [rows].
struct QuantLayer {
  lwo_tensor_quant_ext q;
  std::vector<lwo_tensor_desc> t;
  lwo_layer_desc layer{};
  QuantLayer(lwo_quant_format_t f, int64_t rows, int64_t cols, lwo_dtype_t dt = LWO_DTYPE_BF16)
      : q(quant_ext(f)) {
    t.push_back(tensor("norm", LWO_DTYPE_F32, {cols}));
    t.push_back(tensor("weight", dt, {rows, cols}));
    t[1].next = &q;
    t.push_back(tensor("bias", LWO_DTYPE_BF16, {rows}));
    layer = lwo_layer_desc{t.data(), 3, nullptr};
  }
};

TEST(QuantRecord, LayoutTakesEachFormatsQuantizedBytes) {
  for (lwo_quant_format_t f : kFormats) {
    for (lwo_dtype_t dt : {LWO_DTYPE_BF16, LWO_DTYPE_F16, LWO_DTYPE_F32}) {
      QuantLayer L(f, 300, 384, dt);
      uint64_t off[3] = {1, 1, 1}, rb = 0;
      ASSERT_LWO(lwo_record_layout(&L.layer, off, &rb));
      const uint64_t qb = quant_bytes(f, dt, 300, 384);
      EXPECT_EQ(off[0], 0u);
      EXPECT_EQ(off[1], align256(384 * 4));
      EXPECT_EQ(off[2], off[1] + qb) << lwo_quant_format_name(f);  // qb is 256-aligned
      EXPECT_EQ(rb, align256(off[2] + 300 * 2));
      EXPECT_LT(qb, 300u * 384u * dtype_size(dt));  // fewer bytes than dense
    }
  }
}

TEST(QuantRecord, ChainAndShapeValidation) {
  const char* call = "lwo_record_layout";
  uint64_t rb = 0;
  {  // unknown type beside the quant extension: unsupported, named
    QuantLayer L(LWO_QUANT_INT8_CHANNEL, 64, 128);
    lwo_ext other{4711, 0u, nullptr};
    L.q.header.next = &other;
    EXPECT_ERR(LWO_ERR_UNSUPPORTED, call, "type 4711", lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // the quant extension on a layer's chain: unsupported there
    QuantLayer L(LWO_QUANT_INT8_CHANNEL, 64, 128);
    lwo_tensor_quant_ext q = quant_ext(LWO_QUANT_INT8_CHANNEL);
    L.layer.next = &q;
    EXPECT_ERR(LWO_ERR_UNSUPPORTED, call, "type 1", lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // the same type twice (also what a loop of the chain meets)
    QuantLayer L(LWO_QUANT_INT8_CHANNEL, 64, 128);
    lwo_tensor_quant_ext q2 = quant_ext(LWO_QUANT_INT8_CHANNEL);
    L.q.header.next = &q2;
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "appears twice",
               lwo_record_layout(&L.layer, nullptr, &rb));
    L.q.header.next = &L.q;  // a loop
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "appears twice",
               lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // reserved words
    QuantLayer L(LWO_QUANT_INT8_CHANNEL, 64, 128);
    L.q.header.reserved = 3;
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "reserved 3",
               lwo_record_layout(&L.layer, nullptr, &rb));
    L.q.header.reserved = 0;
    L.q.reserved = 5;
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "reserved 5",
               lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // formats
    QuantLayer L(LWO_QUANT_NONE, 64, 128);
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "format 0", lwo_record_layout(&L.layer, nullptr, &rb));
    L.q.format = static_cast<lwo_quant_format_t>(99);
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "format 99",
               lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // shapes and dtypes, each naming the tensor
    QuantLayer L(LWO_QUANT_INT4_GROUP128, 64, 100);
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "multiple of the group size",
               lwo_record_layout(&L.layer, nullptr, &rb));
    EXPECT_TRUE(contains(msg(), "tensor 'weight'")) << msg();
    QuantLayer z(LWO_QUANT_FP8_E4M3_CHANNEL, 0, 128);
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "must be >= 1",
               lwo_record_layout(&z.layer, nullptr, &rb));
    QuantLayer i8(LWO_QUANT_FP8_E4M3_CHANNEL, 64, 128, LWO_DTYPE_I8);
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "is not f32, bf16 or f16",
               lwo_record_layout(&i8.layer, nullptr, &rb));
    QuantLayer d3(LWO_QUANT_FP8_E4M3_CHANNEL, 64, 128);
    d3.t[1].n_dims = 3;
    d3.t[1].shape[2] = 2;
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "has 3 dimensions",
               lwo_record_layout(&d3.layer, nullptr, &rb));
    QuantLayer big(LWO_QUANT_FP8_E4M3_CHANNEL, int64_t(1) << 31, 1);
    EXPECT_ERR(LWO_ERR_OUT_OF_RANGE, call, "below 2^31",
               lwo_record_layout(&big.layer, nullptr, &rb));
  }
}

using QuantPool = EngineTest;

TEST_F(QuantPool, PinnedRoundTripAgainstLwoQuantize) {
  const int64_t rows = 200, cols = 256;
  for (lwo_quant_format_t f : kFormats) {
    QuantLayer L0(f, rows, cols), L1(f, rows, cols, LWO_DTYPE_F16);
    lwo_layer_desc layers[2] = {L0.layer, L1.layer};
    lwo_pool* pool = nullptr;
    ASSERT_LWO(lwo_pool_create_pinned(engine, layers, 2, nullptr, &pool));
    lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
    ASSERT_LWO(lwo_pool_tensor_info(pool, 0, 1, &ti));
    EXPECT_EQ(ti.quant_format, f);
    EXPECT_EQ(ti.dtype, LWO_DTYPE_BF16);
    EXPECT_EQ(ti.n_dims, 2);
    EXPECT_EQ(ti.bytes, quant_bytes(f, LWO_DTYPE_BF16, rows, cols));
    ASSERT_LWO(lwo_pool_tensor_info(pool, 0, 2, &ti));
    EXPECT_EQ(ti.quant_format, LWO_QUANT_NONE);

    const std::vector<float> w = weights(rows, cols, 17 + f);
    lwo_quant_desc d = LWO_QUANT_DESC_INIT;
    d.format = f;
    d.rows = rows;
    d.cols = cols;
    for (lwo_dtype_t src_dt : {LWO_DTYPE_F32, LWO_DTYPE_BF16, LWO_DTYPE_F16}) {
      const std::vector<uint8_t> src = convert(w, src_dt);
      d.dtype = src_dt;
      std::vector<uint8_t> want(quant_bytes(f, src_dt, rows, cols));
      ASSERT_LWO(lwo_quantize(&d, src.data(), src.size(), want.data(), want.size(), 1));
      for (uint32_t threads : {1u, 3u, 0u}) {
        ASSERT_LWO(lwo_pool_write_quantized(pool, 0, "weight", src.data(), src_dt, src.size(),
                                            threads));
        void* p = nullptr;
        uint64_t b = 0;
        ASSERT_LWO(lwo_pool_tensor_host(pool, 0, "weight", &p, &b));
        ASSERT_EQ(b, want.size());
        EXPECT_EQ(std::memcmp(p, want.data(), b), 0)
            << lwo_quant_format_name(f) << " from " << dtype_name(src_dt) << ", " << threads;
      }
      // lwo_pool_write takes the quantized bytes as they are.
      std::vector<uint8_t> junk(want.size());
      fill_random(junk.data(), junk.size(), 3);
      ASSERT_LWO(lwo_pool_write(pool, 1, "weight", junk.data(), junk.size()));
      void* p = nullptr;
      uint64_t b = 0;
      ASSERT_LWO(lwo_pool_tensor_host(pool, 1, "weight", &p, &b));
      EXPECT_EQ(std::memcmp(p, junk.data(), b), 0);
      EXPECT_ERR(LWO_ERR_SIZE_MISMATCH, "lwo_pool_write", "given",
                 lwo_pool_write(pool, 1, "weight", junk.data(), rows * cols * 2));
    }
    // The checks, in the documented order.
    const std::vector<uint8_t> src = convert(w, LWO_DTYPE_BF16);
    const char* call = "lwo_pool_write_quantized";
    EXPECT_ERR(LWO_ERR_INVALID_HANDLE, call, "",
               lwo_pool_write_quantized(nullptr, 0, "weight", src.data(), LWO_DTYPE_BF16,
                                        src.size(), 1));
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "src is NULL",
               lwo_pool_write_quantized(pool, 0, "weight", nullptr, LWO_DTYPE_BF16, src.size(), 1));
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "src_dtype i8",
               lwo_pool_write_quantized(pool, 0, "weight", src.data(), LWO_DTYPE_I8, src.size(), 1));
    EXPECT_ERR(LWO_ERR_OUT_OF_RANGE, call, "layer 2",
               lwo_pool_write_quantized(pool, 2, "weight", src.data(), LWO_DTYPE_BF16, src.size(), 1));
    EXPECT_ERR(LWO_ERR_NOT_FOUND, call, "'wieght'",
               lwo_pool_write_quantized(pool, 0, "wieght", src.data(), LWO_DTYPE_BF16, src.size(), 1));
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "tensor 'bias' is not quantized",
               lwo_pool_write_quantized(pool, 0, "bias", src.data(), LWO_DTYPE_BF16, src.size(), 1));
    EXPECT_ERR(LWO_ERR_SIZE_MISMATCH, call, "holds 102400 bytes, given 102398",
               lwo_pool_write_quantized(pool, 0, "weight", src.data(), LWO_DTYPE_BF16,
                                        src.size() - 2, 1));
    // A NaN leaves the tensor as it was.
    void* p = nullptr;
    uint64_t b = 0;
    ASSERT_LWO(lwo_pool_tensor_host(pool, 0, "weight", &p, &b));
    std::vector<uint8_t> before(static_cast<uint8_t*>(p), static_cast<uint8_t*>(p) + b);
    std::vector<float> bad = w;
    bad[static_cast<size_t>(7 * cols + 9)] = NAN;
    const std::vector<uint8_t> bad_src = convert(bad, LWO_DTYPE_F32);
    EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, call, "element [7, 9]",
               lwo_pool_write_quantized(pool, 0, "weight", bad_src.data(), LWO_DTYPE_F32,
                                        bad_src.size(), 2));
    EXPECT_TRUE(contains(msg(), "tensor 'weight'")) << msg();
    EXPECT_EQ(std::memcmp(p, before.data(), b), 0);
    // Element views of a quantized tensor are refused.
    uint64_t first = 0, n = 0;
    EXPECT_ERR(LWO_ERR_UNSUPPORTED, "lwo_pool_shard_tensor", "is quantized",
               lwo_pool_shard_tensor(pool, 0, "weight", &p, &first, &n));
    ASSERT_LWO(lwo_pool_shard_tensor(pool, 0, "bias", &p, &first, &n));
    EXPECT_EQ(n, static_cast<uint64_t>(rows));
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
}

TEST_F(QuantPool, OlderTensorInfoGetsItsPrefix) {
  QuantLayer L(LWO_QUANT_INT8_CHANNEL, 64, 128);
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, &L.layer, 1, nullptr, &pool));
  struct Old {  // lwo_tensor_info of 0.3
    size_t size;
    const char* name;
    lwo_dtype_t dtype;
    int32_t n_dims;
    int64_t shape[LWO_MAX_DIMS];
    uint64_t offset, bytes;
    uint32_t canary;
  } old{};
  old.size = offsetof(lwo_tensor_info, quant_format);
  old.canary = 0xdeadbeef;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 0, 1, reinterpret_cast<lwo_tensor_info*>(&old)));
  EXPECT_EQ(old.bytes, quant_bytes(LWO_QUANT_INT8_CHANNEL, LWO_DTYPE_BF16, 64, 128));
  EXPECT_EQ(old.canary, 0xdeadbeefu);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(QuantPool, RegisteredPoolMovesQuantizedBytesInOneCopy) {
  const int64_t rows = 128, cols = 256;
  QuantLayer L(LWO_QUANT_FP8_E4M3_BLOCK128, rows, cols);
  uint64_t off[3], rb = 0;
  ASSERT_LWO(lwo_record_layout(&L.layer, off, &rb));
  std::vector<uint8_t> mem(rb + 4096);
  uint8_t* base = mem.data() + (256 - reinterpret_cast<uintptr_t>(mem.data()) % 256) % 256;
  for (int i = 0; i < 3; ++i) L.t[i].host_data = base + off[i];
  lwo_host_region r{base, rb, nullptr};
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_registered(engine, &L.layer, 1, &r, 1, nullptr, &pool));
  void* p = nullptr;
  uint64_t b = 0;
  ASSERT_LWO(lwo_pool_layer_host(pool, 0, &p, &b));  // one copy run
  EXPECT_EQ(p, base);
  EXPECT_EQ(b, off[2] + rows * 2);
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 0, 1, &ti));
  EXPECT_EQ(ti.quant_format, LWO_QUANT_FP8_E4M3_BLOCK128);
  const std::vector<uint8_t> src = convert(weights(rows, cols, 5), LWO_DTYPE_BF16);
  EXPECT_ERR(LWO_ERR_UNSUPPORTED, "lwo_pool_write_quantized", "lwo_quantize",
             lwo_pool_write_quantized(pool, 0, "weight", src.data(), LWO_DTYPE_BF16, src.size(), 1));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(QuantPool, GradientsOfQuantizedLayersAreRefused) {
  QuantLayer q(LWO_QUANT_INT4_GROUP128, 64, 128);
  ModelDesc m(3);
  lwo_layer_desc layers[3] = {m.layers[0], q.layer, m.layers[2]};
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, layers, 3, nullptr, &pool));
  lwo_grads* g = nullptr;
  EXPECT_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_grads_create", "layer 1",
             lwo_grads_create(pool, nullptr, nullptr, &g));
  EXPECT_TRUE(contains(msg(), "'weight'")) << msg();
  EXPECT_TRUE(contains(msg(), "int4_group128")) << msg();
  EXPECT_EQ(g, nullptr);
  const uint8_t trainable_bad[3] = {1, 1, 0};
  EXPECT_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_grads_create", "layer 1",
             lwo_grads_create(pool, trainable_bad, nullptr, &g));
  const uint8_t trainable[3] = {1, 0, 1};  // the quantized layer frozen: fine
  ASSERT_LWO(lwo_grads_create(pool, trainable, nullptr, &g));
  ASSERT_LWO(lwo_grads_destroy(g));
  EXPECT_STREQ(lwo_status_string(LWO_ERR_QUANTIZED_WEIGHT), "LWO_ERR_QUANTIZED_WEIGHT");
  EXPECT_EQ(LWO_STATUS_CLASS(LWO_ERR_QUANTIZED_WEIGHT), LWO_STATUS_CLASS_ARGUMENT);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

TEST_F(QuantPool, ShardedPoolsRefuseQuantizedTensors) {
  QuantLayer L(LWO_QUANT_FP8_E4M3_CHANNEL, 64, 128);
  int fake_comm = 0;
  lwo_pool* pool = nullptr;
  EXPECT_ERR(LWO_ERR_UNSUPPORTED, "lwo_pool_create_sharded", "sharded pools hold no quantized",
             lwo_pool_create_sharded(engine, &L.layer, 1,
                                     reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr,
                                     &pool));
  EXPECT_TRUE(contains(msg(), "tensor 'weight'")) << msg();
  EXPECT_EQ(pool, nullptr);
}

using QuantLinearArgs = EngineTest;

// Every case fails before any device work (the recording backend has none).
TEST_F(QuantLinearArgs, QuantizedWeightsAreCheckedAndFrozen) {
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.in_features = 256;
  d.out_features = 64;
  d.flags = LWO_LINEAR_BIAS;
  int buf[4] = {1, 2, 3, 4};
  void* p = buf;
  d.weight_format = 99;
  EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_linear_forward", "weight_format 99",
             lwo_linear_forward(engine, &d, 4, p, p, p, p, nullptr));
  d.weight_format = LWO_QUANT_INT4_GROUP128;
  d.in_features = 100;
  EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_linear_forward", "multiple of the group size",
             lwo_linear_forward(engine, &d, 4, p, p, p, p, nullptr));
  EXPECT_TRUE(contains(msg(), "weight_format int4_group128")) << msg();
  EXPECT_ERR(LWO_ERR_INVALID_ARGUMENT, "lwo_linear_backward", "multiple of the group size",
             lwo_linear_backward(engine, &d, 4, p, p, p, p, nullptr, nullptr, LWO_DTYPE_F32,
                                 nullptr));
  d.in_features = 256;
  for (lwo_quant_format_t f : kFormats) {
    d.weight_format = f;
    EXPECT_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_linear_backward", "(given dweight)",
               lwo_linear_backward(engine, &d, 4, p, p, p, p, p, nullptr, LWO_DTYPE_F32, nullptr));
    EXPECT_TRUE(contains(msg(), lwo_quant_format_name(f))) << msg();
    EXPECT_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_linear_backward", "given dbias",
               lwo_linear_backward(engine, &d, 4, p, p, p, nullptr, nullptr, p, LWO_DTYPE_F32,
                                   nullptr));
    EXPECT_ERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_linear_backward", "given dweight and dbias",
               lwo_linear_backward(engine, &d, 4, p, p, p, p, p, p, LWO_DTYPE_F32, nullptr));
  }
}

}  // namespace
}  // namespace testing
}  // namespace lwo
