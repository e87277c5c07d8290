// Argument validation of the linear-layer calls (no GPU: every case fails
// before any device work).
#include "test_util.h"
#include "unit/conv_desc.h"

namespace lwo {
namespace testing {
namespace {

class LinearArgs : public EngineTest {
 protected:
  // A valid descriptor: 16 in, 8 out, bf16.
  static lwo_linear_desc linear() {
    lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
    d.in_features = 16;
    d.out_features = 8;
    return d;
  }
  // Memory that is never touched: every case fails before any device work.
  int buf[4] = {1, 2, 3, 4};
  const void* p = buf;
  void* q = buf;
};

TEST_F(LinearArgs, ForwardRejectsBadArguments) {
  const lwo_linear_desc d = linear();
  struct Case {
    const char* what;
    lwo_linear_desc desc;
    int64_t tokens;
    const void *x, *w, *b;
    void* y;
    lwo_status_t want;
    const char* in_msg;
  };
  lwo_linear_desc bad_dtype = d, bad_flags = d, zero_in = d, with_bias = d, huge = d, small = d;
  bad_dtype.dtype = LWO_DTYPE_I8;
  bad_flags.flags = 0x40;
  zero_in.in_features = 0;
  with_bias.flags = LWO_LINEAR_BIAS;
  huge.out_features = INT64_C(1) << 31;
  small.size = 2;
  std::vector<Case> cases = {
      {"dtype", bad_dtype, 4, p, p, nullptr, q, LWO_ERR_INVALID_ARGUMENT, "dtype i8"},
      {"flags", bad_flags, 4, p, p, nullptr, q, LWO_ERR_INVALID_ARGUMENT, "unknown flags 0x40"},
      {"in", zero_in, 4, p, p, nullptr, q, LWO_ERR_INVALID_ARGUMENT, "in_features 0"},
      {"tokens", d, 0, p, p, nullptr, q, LWO_ERR_INVALID_ARGUMENT, "tokens 0"},
      {"x", d, 4, nullptr, p, nullptr, q, LWO_ERR_INVALID_ARGUMENT, "x is NULL"},
      {"w", d, 4, p, nullptr, nullptr, q, LWO_ERR_INVALID_ARGUMENT, "weight is NULL"},
      {"y", d, 4, p, p, nullptr, nullptr, LWO_ERR_INVALID_ARGUMENT, "y is NULL"},
      {"bias", with_bias, 4, p, p, nullptr, q, LWO_ERR_INVALID_ARGUMENT, "bias"},
      {"huge", huge, 4, p, p, nullptr, q, LWO_ERR_OUT_OF_RANGE, "2^31"},
      {"size", small, 4, p, p, nullptr, q, LWO_ERR_INVALID_ARGUMENT, "config size 2"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(lwo_linear_forward(engine, &c.desc, c.tokens, c.x, c.w, c.b, c.y, nullptr), c.want)
        << c.what;
    std::string m = lwo_last_error_message();
    EXPECT_NE(m.find("lwo_linear_forward"), std::string::npos) << c.what << ": " << m;
    EXPECT_NE(m.find(c.in_msg), std::string::npos) << c.what << ": " << m;
  }
  EXPECT_EQ(lwo_linear_forward(nullptr, &d, 4, p, p, nullptr, q, nullptr), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(lwo_linear_forward(engine, nullptr, 4, p, p, nullptr, q, nullptr),
            LWO_ERR_INVALID_ARGUMENT);
  lwo_linear_desc init;
  lwo_linear_desc_init(&init);
  EXPECT_EQ(init.size, sizeof init);
  EXPECT_EQ(init.dtype, LWO_DTYPE_BF16);
}

TEST_F(LinearArgs, BackwardRejectsBadArguments) {
  const lwo_linear_desc d = linear();
  struct Case {
    const void *x, *dy, *w;
    void *dx, *dw, *db;
    lwo_dtype_t grad_dtype;
    const char* in_msg;
  };
  const Case cases[] = {
      {p, nullptr, p, q, q, nullptr, LWO_DTYPE_F32, "dy is NULL"},
      {p, p, nullptr, q, nullptr, nullptr, LWO_DTYPE_F32, "weight"},
      {nullptr, p, p, nullptr, q, nullptr, LWO_DTYPE_F32, "x (needed for dweight)"},
      {p, p, p, nullptr, q, q, LWO_DTYPE_F32, "no LWO_LINEAR_BIAS"},
      {p, p, p, nullptr, q, nullptr, LWO_DTYPE_F16, "grad_dtype f16"},
      {p, p, p, nullptr, nullptr, nullptr, LWO_DTYPE_F32, "nothing to do"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(lwo_linear_backward(engine, &d, 4, c.x, c.dy, c.w, c.dx, c.dw, c.db, c.grad_dtype,
                                  nullptr),
              LWO_ERR_INVALID_ARGUMENT)
        << c.in_msg;
    EXPECT_NE(std::string(lwo_last_error_message()).find(c.in_msg), std::string::npos)
        << c.in_msg;
  }
}

TEST_F(LinearArgs, Conv2dRejectsBadArguments) {
  lwo_conv2d_desc d = lwo_conv_test::conv3x3_desc(8, 16, 0);
  int32_t oh = 0, ow = 0;
  ASSERT_LWO(lwo_conv2d_output_size(&d, 10, 7, &oh, &ow));
  EXPECT_EQ(oh, 10);
  EXPECT_EQ(ow, 7);
  lwo_conv2d_desc s2 = d;
  s2.stride_h = 2;
  s2.dilation_w = 2;
  ASSERT_LWO(lwo_conv2d_output_size(&s2, 10, 7, &oh, &ow));
  EXPECT_EQ(oh, 5);  // (10 + 2 - 3) / 2 + 1
  EXPECT_EQ(ow, 5);  // (7 + 2 - 5) / 1 + 1
  // Sizes past 32 bits are refused, not narrowed: h = pad = 1e9 makes an
  // output of 3e9 - 2 rows; a padding of 2^31 - 1 overflowed 2 * pad.
  lwo_conv2d_desc huge = d;
  huge.pad_h = 1000000000;
  oh = ow = 0;
  EXPECT_EQ(lwo_conv2d_output_size(&huge, 1000000000, 7, &oh, &ow), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("2999999998x7 does not fit in 32 bits"),
            std::string::npos) << lwo_last_error_message();
  EXPECT_NE(std::string(lwo_last_error_message()).find("padding 1000000000x1"),
            std::string::npos) << lwo_last_error_message();
  EXPECT_EQ(oh, 0);
  huge.pad_h = 0;
  huge.pad_w = INT32_MAX;
  EXPECT_EQ(lwo_conv2d_output_size(&huge, 10, 7, &oh, &ow), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("8x4294967299 does not fit"),
            std::string::npos) << lwo_last_error_message();
  // The largest size that fits is still computed.
  huge.pad_w = 0;
  huge.pad_h = (INT32_MAX - 9) / 2;  // 10 + 2 pad - 3 + 1 = INT32_MAX - 1
  ASSERT_LWO(lwo_conv2d_output_size(&huge, 10, 7, &oh, &ow));
  EXPECT_EQ(oh, INT32_MAX - 1);
  EXPECT_EQ(ow, 5);
  struct Case {
    const char* what;
    lwo_conv2d_desc desc;
    int32_t n, h, w;
    lwo_status_t want;
    const char* in_msg;
  };
  lwo_conv2d_desc groups = d, layout = d, kernel = d, pad = d, big = d, dtype = d;
  groups.groups = 3;
  layout.layout = static_cast<lwo_layout_t>(5);
  kernel.kernel_w = 0;
  pad.pad_h = -1;
  big.kernel_h = 9;
  big.pad_h = 0;
  dtype.dtype = LWO_DTYPE_U8;
  std::vector<Case> cases = {
      {"groups", groups, 2, 8, 8, LWO_ERR_INVALID_ARGUMENT, "multiples of groups 3"},
      {"layout", layout, 2, 8, 8, LWO_ERR_INVALID_ARGUMENT, "layout 5"},
      {"kernel", kernel, 2, 8, 8, LWO_ERR_INVALID_ARGUMENT, "kernel 3x0"},
      {"pad", pad, 2, 8, 8, LWO_ERR_INVALID_ARGUMENT, "padding -1x1"},
      {"fit", big, 2, 8, 8, LWO_ERR_INVALID_ARGUMENT, "does not fit"},
      {"dtype", dtype, 2, 8, 8, LWO_ERR_INVALID_ARGUMENT, "dtype u8"},
      {"batch", d, 0, 8, 8, LWO_ERR_INVALID_ARGUMENT, "batch 0"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(lwo_conv2d_forward(engine, &c.desc, c.n, c.h, c.w, p, p, nullptr, q, nullptr), c.want)
        << c.what;
    std::string m = lwo_last_error_message();
    EXPECT_NE(m.find("lwo_conv2d_forward"), std::string::npos) << c.what << ": " << m;
    EXPECT_NE(m.find(c.in_msg), std::string::npos) << c.what << ": " << m;
  }
  lwo_conv2d_desc bias = d;
  bias.flags = LWO_CONV_BIAS;
  EXPECT_EQ(lwo_conv2d_forward(engine, &bias, 2, 8, 8, p, p, nullptr, q, nullptr),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_conv2d_backward(engine, &d, 2, 8, 8, p, p, p, nullptr, q, q, LWO_DTYPE_F32, nullptr),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("no LWO_CONV_BIAS"), std::string::npos);
  EXPECT_EQ(lwo_conv2d_backward(engine, &d, 2, 8, 8, p, p, p, nullptr, q, nullptr, LWO_DTYPE_F16,
                                nullptr),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_conv2d_backward(engine, &d, 2, 8, 8, p, nullptr, p, q, nullptr, nullptr,
                                LWO_DTYPE_F32, nullptr),
            LWO_ERR_INVALID_ARGUMENT);
  lwo_conv2d_desc init;
  lwo_conv2d_desc_init(&init);
  EXPECT_EQ(init.layout, LWO_LAYOUT_NHWC);
  EXPECT_EQ(init.stride_h, 1);
  EXPECT_EQ(init.groups, 1);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
