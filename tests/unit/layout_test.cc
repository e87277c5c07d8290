#include "engine/layout.h"

#include <cstring>
#include <utility>

#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

TEST(Layout, PacksTensorsAt256ByteBoundaries) {
  std::vector<lwo_tensor_desc> t = {tensor("a", LWO_DTYPE_BF16, {3, 5}),        // 30 bytes
                                    tensor("b", LWO_DTYPE_F32, {64}),           // 256 bytes
                                    tensor("empty", LWO_DTYPE_F16, {0, 7}),     // 0 bytes
                                    tensor("c", LWO_DTYPE_F8_E4M3, {257}),      // 257 bytes
                                    tensor("scalar", LWO_DTYPE_I8, {})};        // 1 byte
  lwo_layer_desc l{t.data(), static_cast<uint32_t>(t.size()), nullptr};
  uint64_t off[5] = {}, rec = 0;
  ASSERT_LWO(lwo_record_layout(&l, off, &rec));
  EXPECT_EQ(off[0], 0u);
  EXPECT_EQ(off[1], 256u);
  EXPECT_EQ(off[2], 512u);
  EXPECT_EQ(off[3], 512u);  // a tensor of 0 bytes takes no room
  EXPECT_EQ(off[4], 1024u);
  EXPECT_EQ(rec, 1280u);
  EXPECT_STREQ(lwo_last_error_message(), "");
}

TEST(Layout, DtypeSizesAndNames) {
  const std::pair<lwo_dtype_t, size_t> sizes[] = {
      {LWO_DTYPE_F32, 4}, {LWO_DTYPE_BF16, 2}, {LWO_DTYPE_F16, 2}, {LWO_DTYPE_F8_E4M3, 1},
      {LWO_DTYPE_F8_E5M2, 1}, {LWO_DTYPE_I8, 1}, {LWO_DTYPE_U8, 1}, {LWO_DTYPE_BOOL, 1},
      {LWO_DTYPE_I16, 2}, {LWO_DTYPE_U32, 4}, {LWO_DTYPE_I64, 8}, {LWO_DTYPE_F64, 8},
      {LWO_DTYPE_C64, 8},
  };
  for (const auto& [dt, bytes] : sizes) EXPECT_EQ(lwo_dtype_size(dt), bytes) << lwo_dtype_name(dt);
  EXPECT_STREQ(lwo_dtype_name(LWO_DTYPE_F8_E8M0), "f8_e8m0");
  EXPECT_EQ(lwo_dtype_size(static_cast<lwo_dtype_t>(17)), 0u);  // past the last
  EXPECT_STREQ(lwo_dtype_name(LWO_DTYPE_F8_E5M2), "f8_e5m2");
  EXPECT_STREQ(lwo_dtype_name(static_cast<lwo_dtype_t>(-1)), "unknown");
}

// A C caller may store any int in an lwo_dtype_t field; a negative one lies
// outside the enum's range, so the library reads the field's integer before
// it uses it as an enum (under -fstrict-enums -fsanitize=enum, loading it
// was reported as undefined behaviour).
void store_int(lwo_dtype_t* field, int32_t v) { std::memcpy(field, &v, sizeof v); }

TEST(Layout, DtypeOutsideTheEnumRangeIsRefused) {
  lwo_tensor_desc t = tensor("w", LWO_DTYPE_F32, {4});
  store_int(&t.dtype, -1);
  lwo_layer_desc l{&t, 1, nullptr};
  uint64_t bytes = 0;
  EXPECT_EQ(lwo_record_layout(&l, nullptr, &bytes), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("tensor 'w' has unknown dtype -1"),
            std::string::npos) << lwo_last_error_message();
  store_int(&t.dtype, INT32_MIN);
  EXPECT_EQ(lwo_record_layout(&l, nullptr, &bytes), LWO_ERR_INVALID_ARGUMENT);
  lwo_conv2d_desc c = LWO_CONV2D_DESC_INIT;
  c.in_channels = c.out_channels = 1;
  c.kernel_h = c.kernel_w = 1;
  store_int(&c.dtype, -7);
  int32_t oh = 0, ow = 0;
  EXPECT_EQ(lwo_conv2d_output_size(&c, 4, 4, &oh, &ow), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("dtype -7 is not a dtype"),
            std::string::npos) << lwo_last_error_message();
  lwo_quant_desc q = LWO_QUANT_DESC_INIT;
  q.format = LWO_QUANT_FP8_E4M3_BLOCK128;
  q.rows = q.cols = 128;
  store_int(&q.dtype, -2);
  lwo_quant_layout_info qi = LWO_QUANT_LAYOUT_INFO_INIT;
  EXPECT_EQ(lwo_quant_layout(&q, &qi), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("dtype -2 is not a dtype"),
            std::string::npos) << lwo_last_error_message();
}

struct BadCase {
  const char* what;
  lwo_tensor_desc t0, t1;
  lwo_status_t want;
  const char* in_message;
};

TEST(Layout, RejectsBadDescriptionsWithDistinctMessages) {
  lwo_tensor_desc ok = tensor("w", LWO_DTYPE_F32, {4});
  lwo_tensor_desc unnamed = tensor("", LWO_DTYPE_F32, {4});
  lwo_tensor_desc null_name = tensor("x", LWO_DTYPE_F32, {4});
  null_name.name = nullptr;
  lwo_tensor_desc bad_dtype = tensor("d", static_cast<lwo_dtype_t>(42), {4});
  lwo_tensor_desc neg = tensor("n", LWO_DTYPE_F32, {4, -1});
  lwo_tensor_desc many = tensor("m", LWO_DTYPE_F32, {1});
  many.n_dims = 9;
  lwo_tensor_desc huge = tensor("h", LWO_DTYPE_F32, {INT64_C(1) << 40, INT64_C(1) << 30});
  lwo_tensor_desc dup = tensor("w", LWO_DTYPE_BF16, {2});
  std::vector<BadCase> cases = {
      {"empty name", ok, unnamed, LWO_ERR_INVALID_ARGUMENT, "no name"},
      {"null name", ok, null_name, LWO_ERR_INVALID_ARGUMENT, "no name"},
      {"unknown dtype", ok, bad_dtype, LWO_ERR_INVALID_ARGUMENT, "unknown dtype 42"},
      {"negative dim", ok, neg, LWO_ERR_INVALID_ARGUMENT, "dimension 1 is -1"},
      {"too many dims", ok, many, LWO_ERR_INVALID_ARGUMENT, "n_dims 9"},
      {"overflow", ok, huge, LWO_ERR_OUT_OF_RANGE, "overflows"},
      {"duplicate", ok, dup, LWO_ERR_INVALID_ARGUMENT, "appears twice"},
  };
  for (const BadCase& c : cases) {
    lwo_tensor_desc t[2] = {c.t0, c.t1};
    lwo_layer_desc l{t, 2, nullptr};
    uint64_t rec = 0;
    EXPECT_EQ(lwo_record_layout(&l, nullptr, &rec), c.want) << c.what;
    std::string msg = lwo_last_error_message();
    EXPECT_NE(msg.find("lwo_record_layout"), std::string::npos) << c.what << ": " << msg;
    EXPECT_NE(msg.find(c.in_message), std::string::npos) << c.what << ": " << msg;
  }
  uint64_t rec = 0;
  EXPECT_EQ(lwo_record_layout(nullptr, nullptr, &rec), LWO_ERR_INVALID_ARGUMENT);
  lwo_layer_desc null_tensors{nullptr, 3, nullptr};
  EXPECT_EQ(lwo_record_layout(&null_tensors, nullptr, &rec), LWO_ERR_INVALID_ARGUMENT);
}

TEST(Layout, RandomLayoutsAreAlignedDisjointAndTight) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 2000; ++iter) {
    int n = 1 + static_cast<int>(rng() % 12);
    std::vector<std::string> names(n);
    std::vector<lwo_tensor_desc> t(n);
    for (int i = 0; i < n; ++i) {
      names[i] = "t" + std::to_string(i);
      std::vector<int64_t> shape(rng() % 4);
      for (auto& d : shape) d = rng() % 300;
      t[i] = tensor(names[i].c_str(), static_cast<lwo_dtype_t>(rng() % 7), shape);
    }
    lwo_layer_desc l{t.data(), static_cast<uint32_t>(n), nullptr};
    RecordLayout rl = make_layout(l, "test", false);
    uint64_t end = 0;
    for (int i = 0; i < n; ++i) {
      const TensorLayout& x = rl.tensors[i];
      uint64_t bytes = dtype_size(t[i].dtype);
      for (int d = 0; d < t[i].n_dims; ++d) bytes *= static_cast<uint64_t>(t[i].shape[d]);
      ASSERT_EQ(x.bytes, bytes);
      ASSERT_EQ(x.offset % LWO_RECORD_ALIGN, 0u);
      ASSERT_GE(x.offset, end);                        // disjoint, in order
      ASSERT_LT(x.offset, end + LWO_RECORD_ALIGN);     // no wasted alignment unit
      end = x.offset + x.bytes;
    }
    ASSERT_EQ(rl.record_bytes, align_up(end, LWO_RECORD_ALIGN));
  }
}

}  // namespace
}  // namespace testing
}  // namespace lwo
