// Argument validation of the linear-layer calls (no GPU: every case fails
// before any device work).
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

using LinearArgs = EngineTest;

TEST_F(LinearArgs, ForwardRejectsBadArguments) {
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.in_features = 16;
  d.out_features = 8;
  int buf[4] = {1, 2, 3, 4};
  const void* p = buf;
  void* q = buf;
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
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.in_features = 16;
  d.out_features = 8;
  int buf[4] = {1, 2, 3, 4};
  const void* p = buf;
  void* q = buf;
  auto bwd = [&](const lwo_linear_desc& desc, const void* x, const void* dy, const void* w,
                 void* dx, void* dw, void* db, lwo_dtype_t gd) {
    return lwo_linear_backward(engine, &desc, 4, x, dy, w, dx, dw, db, gd, nullptr);
  };
  EXPECT_EQ(bwd(d, p, nullptr, p, q, q, nullptr, LWO_DTYPE_F32), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("dy is NULL"), std::string::npos);
  EXPECT_EQ(bwd(d, p, p, nullptr, q, nullptr, nullptr, LWO_DTYPE_F32), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("weight"), std::string::npos);
  EXPECT_EQ(bwd(d, nullptr, p, p, nullptr, q, nullptr, LWO_DTYPE_F32), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("x (needed for dweight)"), std::string::npos);
  EXPECT_EQ(bwd(d, p, p, p, nullptr, q, q, LWO_DTYPE_F32), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("no LWO_LINEAR_BIAS"), std::string::npos);
  EXPECT_EQ(bwd(d, p, p, p, nullptr, q, nullptr, LWO_DTYPE_F16), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("grad_dtype f16"), std::string::npos);
  EXPECT_EQ(bwd(d, p, p, p, nullptr, nullptr, nullptr, LWO_DTYPE_F32), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lwo_last_error_message()).find("nothing to do"), std::string::npos);
}

}  // namespace
}  // namespace testing
}  // namespace lwo
