// What the unit and GPU tests of quantized weights share (unit/quant_test.cc,
// unit/quant_record_test.cc, gpu/quant_util.h): every format, and the
// descriptor of a quantized [rows, cols] weight, and the check of a refused
// call.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "lwo.h"

namespace lwo_quant_test {

constexpr lwo_quant_format_t kFormats[] = {LWO_QUANT_FP8_E4M3_CHANNEL, LWO_QUANT_FP8_E4M3_BLOCK128,
                                           LWO_QUANT_INT8_CHANNEL, LWO_QUANT_INT4_GROUP128};

inline lwo_quant_desc desc_of(lwo_quant_format_t f, int64_t rows, int64_t cols,
                              lwo_dtype_t dt = LWO_DTYPE_BF16) {
  lwo_quant_desc d = LWO_QUANT_DESC_INIT;
  d.format = f;
  d.dtype = dt;
  d.rows = rows;
  d.cols = cols;
  return d;
}

}  // namespace lwo_quant_test

// Expects `status` from `expr` and a message that starts with `call` and
// holds `part`.
#define EXPECT_QERR(status, call, part, expr)                                            \
  do {                                                                                   \
    lwo_status_t s_ = (expr);                                                            \
    std::string m_ = lwo_last_error_message();                                           \
    EXPECT_STREQ(lwo_status_string(status), lwo_status_string(s_)) << #expr << ": " << m_; \
    EXPECT_EQ(m_.rfind(call, 0), 0u) << #expr << ": " << m_;                            \
    EXPECT_NE(m_.find(part), std::string::npos) << #expr << ": \"" << m_ << "\" lacks \"" \
                                                 << (part) << "\"";                      \
  } while (0)
