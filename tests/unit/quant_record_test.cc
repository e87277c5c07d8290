// Quantized tensors in records: the LWO_EXT_TENSOR_QUANT
// extension through lwo_record_layout, pinned and registered pools, the
// tensor info, lwo_pool_write / lwo_pool_write_quantized against
// lwo_quantize, and the refusals (chain errors, shapes, gradients).
#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/common/dtype.h"
#include "test_util.h"
#include "unit/conv_desc.h"
#include "unit/quant_formats.h"

namespace lwo {
namespace testing {
namespace {

using lwo_quant_test::desc_of;
using lwo_quant_test::kFormats;

std::string msg() { return lwo_last_error_message(); }
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

lwo_tensor_quant_ext quant_ext(lwo_quant_format_t f) {
  lwo_tensor_quant_ext q{};
  q.header.type = LWO_EXT_TENSOR_QUANT;
  q.format = f;
  return q;
}

uint64_t quant_bytes(lwo_quant_format_t f, lwo_dtype_t dt, int64_t rows, int64_t cols) {
  const lwo_quant_desc d = desc_of(f, rows, cols, dt);
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
    EXPECT_QERR(LWO_ERR_UNSUPPORTED, call, "type 4711", lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // the quant extension on a layer's chain: unsupported there
    QuantLayer L(LWO_QUANT_INT8_CHANNEL, 64, 128);
    lwo_tensor_quant_ext q = quant_ext(LWO_QUANT_INT8_CHANNEL);
    L.layer.next = &q;
    EXPECT_QERR(LWO_ERR_UNSUPPORTED, call, "type 1", lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // the same type twice (also what a loop of the chain meets)
    QuantLayer L(LWO_QUANT_INT8_CHANNEL, 64, 128);
    lwo_tensor_quant_ext q2 = quant_ext(LWO_QUANT_INT8_CHANNEL);
    L.q.header.next = &q2;
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "appears twice",
               lwo_record_layout(&L.layer, nullptr, &rb));
    L.q.header.next = &L.q;  // a loop
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "appears twice",
               lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // reserved words
    QuantLayer L(LWO_QUANT_INT8_CHANNEL, 64, 128);
    L.q.header.reserved = 3;
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "reserved 3",
               lwo_record_layout(&L.layer, nullptr, &rb));
    L.q.header.reserved = 0;
    L.q.reserved = 5;
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "reserved 5",
               lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // formats
    QuantLayer L(LWO_QUANT_NONE, 64, 128);
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "format 0", lwo_record_layout(&L.layer, nullptr, &rb));
    L.q.format = static_cast<lwo_quant_format_t>(99);
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "format 99",
               lwo_record_layout(&L.layer, nullptr, &rb));
  }
  {  // shapes and dtypes, each naming the tensor
    QuantLayer L(LWO_QUANT_INT4_GROUP128, 64, 100);
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "multiple of the group size",
               lwo_record_layout(&L.layer, nullptr, &rb));
    EXPECT_TRUE(contains(msg(), "tensor 'weight'")) << msg();
    QuantLayer z(LWO_QUANT_FP8_E4M3_CHANNEL, 0, 128);
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "must be >= 1",
               lwo_record_layout(&z.layer, nullptr, &rb));
    QuantLayer i8(LWO_QUANT_FP8_E4M3_CHANNEL, 64, 128, LWO_DTYPE_I8);
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "is not f32, bf16 or f16",
               lwo_record_layout(&i8.layer, nullptr, &rb));
    QuantLayer d3(LWO_QUANT_FP8_E4M3_CHANNEL, 64, 128);
    d3.t[1].n_dims = 3;
    d3.t[1].shape[2] = 2;
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "has 3 dimensions",
               lwo_record_layout(&d3.layer, nullptr, &rb));
    QuantLayer big(LWO_QUANT_FP8_E4M3_CHANNEL, int64_t(1) << 31, 1);
    EXPECT_QERR(LWO_ERR_OUT_OF_RANGE, call, "below 2^31",
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
      EXPECT_QERR(LWO_ERR_SIZE_MISMATCH, "lwo_pool_write", "given",
                 lwo_pool_write(pool, 1, "weight", junk.data(), rows * cols * 2));
    }
    // The checks, in the documented order.
    const std::vector<uint8_t> src = convert(w, LWO_DTYPE_BF16);
    const char* call = "lwo_pool_write_quantized";
    EXPECT_QERR(LWO_ERR_INVALID_HANDLE, call, "",
               lwo_pool_write_quantized(nullptr, 0, "weight", src.data(), LWO_DTYPE_BF16,
                                        src.size(), 1));
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "src is NULL",
               lwo_pool_write_quantized(pool, 0, "weight", nullptr, LWO_DTYPE_BF16, src.size(), 1));
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "src_dtype i8",
               lwo_pool_write_quantized(pool, 0, "weight", src.data(), LWO_DTYPE_I8, src.size(), 1));
    EXPECT_QERR(LWO_ERR_OUT_OF_RANGE, call, "layer 2",
               lwo_pool_write_quantized(pool, 2, "weight", src.data(), LWO_DTYPE_BF16, src.size(), 1));
    EXPECT_QERR(LWO_ERR_NOT_FOUND, call, "'wieght'",
               lwo_pool_write_quantized(pool, 0, "wieght", src.data(), LWO_DTYPE_BF16, src.size(), 1));
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "tensor 'bias' is not quantized",
               lwo_pool_write_quantized(pool, 0, "bias", src.data(), LWO_DTYPE_BF16, src.size(), 1));
    EXPECT_QERR(LWO_ERR_SIZE_MISMATCH, call, "holds 102400 bytes, given 102398",
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
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, call, "element [7, 9]",
               lwo_pool_write_quantized(pool, 0, "weight", bad_src.data(), LWO_DTYPE_F32,
                                        bad_src.size(), 2));
    EXPECT_TRUE(contains(msg(), "tensor 'weight'")) << msg();
    EXPECT_EQ(std::memcmp(p, before.data(), b), 0);
    // Element views of a quantized tensor are refused.
    uint64_t first = 0, n = 0;
    EXPECT_QERR(LWO_ERR_UNSUPPORTED, "lwo_pool_shard_tensor", "is quantized",
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
  EXPECT_QERR(LWO_ERR_UNSUPPORTED, "lwo_pool_write_quantized", "lwo_quantize",
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
  EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_grads_create", "layer 1",
             lwo_grads_create(pool, nullptr, nullptr, &g));
  EXPECT_TRUE(contains(msg(), "'weight'")) << msg();
  EXPECT_TRUE(contains(msg(), "int4_group128")) << msg();
  EXPECT_EQ(g, nullptr);
  const uint8_t trainable_bad[3] = {1, 1, 0};
  EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_grads_create", "layer 1",
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
  EXPECT_QERR(LWO_ERR_UNSUPPORTED, "lwo_pool_create_sharded", "sharded pools hold no quantized",
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
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_linear_forward", "weight_format 99",
             lwo_linear_forward(engine, &d, 4, p, p, p, p, nullptr));
  d.weight_format = LWO_QUANT_INT4_GROUP128;
  d.in_features = 100;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_linear_forward", "multiple of the group size",
             lwo_linear_forward(engine, &d, 4, p, p, p, p, nullptr));
  EXPECT_TRUE(contains(msg(), "weight_format int4_group128")) << msg();
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_linear_backward", "multiple of the group size",
             lwo_linear_backward(engine, &d, 4, p, p, p, p, nullptr, nullptr, LWO_DTYPE_F32,
                                 nullptr));
  d.in_features = 256;
  for (lwo_quant_format_t f : kFormats) {
    d.weight_format = f;
    if (f == LWO_QUANT_FP8_E4M3_BLOCK128) continue;  // it trains (fp8_train_test.cc)
    EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_linear_backward", "(given dweight)",
               lwo_linear_backward(engine, &d, 4, p, p, p, p, p, nullptr, LWO_DTYPE_F32, nullptr));
    EXPECT_TRUE(contains(msg(), lwo_quant_format_name(f))) << msg();
    EXPECT_TRUE(contains(msg(), "only fp8_e4m3_block128 weights train")) << msg();
    EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_linear_backward", "given dbias",
               lwo_linear_backward(engine, &d, 4, p, p, p, nullptr, nullptr, p, LWO_DTYPE_F32,
                                   nullptr));
    EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_linear_backward", "given dweight and dbias",
               lwo_linear_backward(engine, &d, 4, p, p, p, p, p, p, LWO_DTYPE_F32, nullptr));
  }
}


using QuantConvArgs = EngineTest;

lwo_conv2d_desc quant_conv(lwo_quant_format_t f) {
  lwo_conv2d_desc d = lwo_conv_test::conv3x3_desc(128, 48, LWO_CONV_BIAS);
  d.weight_format = f;  // cols 128 * 3 * 3 = 1152: 9 groups of 128
  return d;
}

// The weight_format a 0.4 caller's smaller struct lacks reads as
// LWO_QUANT_NONE; what lies past its size is never read.
TEST_F(QuantConvArgs, WeightFormatIsAppendedToTheStruct) {
  EXPECT_EQ(offsetof(lwo_conv2d_desc, weight_format), offsetof(lwo_conv2d_desc, groups) + 4);
  lwo_conv2d_desc init;
  std::memset(&init, 0x5a, sizeof init);
  lwo_conv2d_desc_init(&init);
  EXPECT_EQ(init.size, sizeof init);
  EXPECT_EQ(init.weight_format, LWO_QUANT_NONE);
  const lwo_conv2d_desc macro = LWO_CONV2D_DESC_INIT;
  EXPECT_EQ(macro.weight_format, LWO_QUANT_NONE);
  EXPECT_EQ(macro.groups, 1);
  int buf[4] = {1, 2, 3, 4};
  void* p = buf;
  lwo_conv2d_desc d = quant_conv(static_cast<lwo_quant_format_t>(99));
  int32_t oh = 0, ow = 0;
  // The whole struct: the format is read and refused, by every call.
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_output_size", "weight_format 99",
             lwo_conv2d_output_size(&d, 8, 8, &oh, &ow));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_forward", "weight_format 99",
             lwo_conv2d_forward(engine, &d, 2, 8, 8, p, p, p, p, nullptr));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_backward", "weight_format 99",
             lwo_conv2d_backward(engine, &d, 2, 8, 8, p, p, p, p, nullptr, nullptr, LWO_DTYPE_F32,
                                 nullptr));
  // The 0.4 size: the 99 past it is not read (LWO_QUANT_NONE): the call
  // succeeds where it needs no device, and fails on the next check else.
  d.size = offsetof(lwo_conv2d_desc, weight_format);
  ASSERT_LWO(lwo_conv2d_output_size(&d, 8, 7, &oh, &ow));
  EXPECT_EQ(oh, 8);
  EXPECT_EQ(ow, 7);
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_forward", "batch 0",
             lwo_conv2d_forward(engine, &d, 0, 8, 8, p, p, p, p, nullptr));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_backward", "batch 0",
             lwo_conv2d_backward(engine, &d, 0, 8, 8, p, p, p, p, p, p, LWO_DTYPE_F32, nullptr));
  // Every valid format, read in full, passes output_size (no device work).
  for (lwo_quant_format_t f : kFormats) {
    lwo_conv2d_desc q = quant_conv(f);
    ASSERT_LWO(lwo_conv2d_output_size(&q, 8, 7, &oh, &ow));
    EXPECT_EQ(oh, 8);
    EXPECT_EQ(ow, 7);
  }
}

// Every case fails before any device work (the recording backend has none).
TEST_F(QuantConvArgs, QuantizedWeightsAreCheckedAndFrozen) {
  int buf[4] = {1, 2, 3, 4};
  void* p = buf;
  int32_t oh = 0, ow = 0;
  // int4: cols = in_channels / groups * kernel_h * kernel_w must be a
  // multiple of 128; the message names the format, the rows and the cols.
  lwo_conv2d_desc d = quant_conv(LWO_QUANT_INT4_GROUP128);
  d.in_channels = 8;  // 8 * 3 * 3 = 72
  d.out_channels = 16;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_forward", "multiple of the group size",
             lwo_conv2d_forward(engine, &d, 2, 8, 8, p, p, p, p, nullptr));
  EXPECT_TRUE(contains(msg(), "weight_format int4_group128 with out_channels 16 and 72 cols"))
      << msg();
  EXPECT_TRUE(contains(msg(), "in_channels 8 / groups 1 x kernel 3x3")) << msg();
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_backward", "multiple of the group size",
             lwo_conv2d_backward(engine, &d, 2, 8, 8, p, p, p, p, nullptr, nullptr, LWO_DTYPE_F32,
                                 nullptr));
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_output_size", "multiple of the group size",
             lwo_conv2d_output_size(&d, 8, 8, &oh, &ow));
  // The other formats hold any cols (here 72, a partial 128 x 128 block).
  for (lwo_quant_format_t f :
       {LWO_QUANT_FP8_E4M3_CHANNEL, LWO_QUANT_FP8_E4M3_BLOCK128, LWO_QUANT_INT8_CHANNEL}) {
    d.weight_format = f;
    ASSERT_LWO(lwo_conv2d_output_size(&d, 8, 8, &oh, &ow));
  }
  // Groups divide the cols: 256 / 2 * 1 * 1 = 128 holds int4, 256 / 4 does not.
  lwo_conv2d_desc g = quant_conv(LWO_QUANT_INT4_GROUP128);
  g.in_channels = 256;
  g.out_channels = 64;
  g.kernel_h = g.kernel_w = 1;
  g.pad_h = g.pad_w = 0;
  g.groups = 2;
  ASSERT_LWO(lwo_conv2d_output_size(&g, 8, 8, &oh, &ow));
  g.groups = 4;
  EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_output_size", "and 64 cols",
             lwo_conv2d_output_size(&g, 8, 8, &oh, &ow));
  // cols of 2^31 or more: out of range, named by its factors.
  lwo_conv2d_desc big = quant_conv(LWO_QUANT_INT8_CHANNEL);
  big.in_channels = 8;
  big.kernel_h = big.kernel_w = 1 << 15;  // 8 * 2^30 cols
  EXPECT_QERR(LWO_ERR_OUT_OF_RANGE, "lwo_conv2d_forward", "in_channels 8 / groups 1 x kernel 32768x32768",
             lwo_conv2d_forward(engine, &big, 1, 8, 8, p, p, p, p, nullptr));
  EXPECT_TRUE(contains(msg(), "below 2^31")) << msg();
  big.kernel_h = big.kernel_w = INT32_MAX;  // the product overflows no integer
  EXPECT_QERR(LWO_ERR_OUT_OF_RANGE, "lwo_conv2d_forward", "below 2^31",
             lwo_conv2d_forward(engine, &big, 1, 8, 8, p, p, p, p, nullptr));
  big.in_channels = 1 << 30;
  big.kernel_h = 4;
  EXPECT_QERR(LWO_ERR_OUT_OF_RANGE, "lwo_conv2d_forward", "below 2^31",
             lwo_conv2d_forward(engine, &big, 1, 8, 8, p, p, p, p, nullptr));
  // Frozen: dweight and dbias refused, after the argument checks the linear's
  // backward makes first (as lwo_linear_backward orders them).
  for (lwo_quant_format_t f : kFormats) {
    SCOPED_TRACE(lwo_quant_format_name(f));
    lwo_conv2d_desc q = quant_conv(f);
    if (f != LWO_QUANT_FP8_E4M3_BLOCK128) {  // fp8 block-128 trains
      EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_conv2d_backward", "(given dweight)",
                 lwo_conv2d_backward(engine, &q, 2, 8, 8, p, p, p, p, p, nullptr, LWO_DTYPE_F32,
                                     nullptr));
      EXPECT_TRUE(contains(msg(), std::string("weight_format ") + lwo_quant_format_name(f)))
          << msg();
      EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_conv2d_backward", "given dbias",
                 lwo_conv2d_backward(engine, &q, 2, 8, 8, p, p, p, nullptr, nullptr, p,
                                     LWO_DTYPE_F32, nullptr));
      EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_conv2d_backward", "given dweight and dbias",
                 lwo_conv2d_backward(engine, &q, 2, 8, 8, p, p, p, p, p, p, LWO_DTYPE_BF16,
                                     nullptr));
    }
    // The argument class comes first.
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_backward", "grad_dtype f16",
               lwo_conv2d_backward(engine, &q, 2, 8, 8, p, p, p, p, p, nullptr, LWO_DTYPE_F16,
                                   nullptr));
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_backward", "x (needed for dweight)",
               lwo_conv2d_backward(engine, &q, 2, 8, 8, nullptr, p, p, p, p, nullptr,
                                   LWO_DTYPE_F32, nullptr));
    lwo_conv2d_desc nb = q;
    nb.flags = 0;
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_backward", "no LWO_CONV_BIAS",
               lwo_conv2d_backward(engine, &nb, 2, 8, 8, p, p, p, p, nullptr, p, LWO_DTYPE_F32,
                                   nullptr));
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_conv2d_forward", "bias",
               lwo_conv2d_forward(engine, &q, 2, 8, 8, p, p, nullptr, p, nullptr));
    // The desc stays usable.
    ASSERT_LWO(lwo_conv2d_output_size(&q, 8, 8, &oh, &ow));
  }
}

}  // namespace
}  // namespace testing
}  // namespace lwo
