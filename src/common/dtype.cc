#include "dtype.h"

namespace lwo {

size_t dtype_size(lwo_dtype_t d) {
  switch (d) {
    case LWO_DTYPE_F32: return 4;
    case LWO_DTYPE_BF16:
    case LWO_DTYPE_F16: return 2;
    case LWO_DTYPE_F8_E4M3:
    case LWO_DTYPE_F8_E5M2:
    case LWO_DTYPE_I8:
    case LWO_DTYPE_U8: return 1;
    default: return 0;
  }
}

const char* dtype_name(lwo_dtype_t d) {
  switch (d) {
    case LWO_DTYPE_F32: return "f32";
    case LWO_DTYPE_BF16: return "bf16";
    case LWO_DTYPE_F16: return "f16";
    case LWO_DTYPE_F8_E4M3: return "f8_e4m3";
    case LWO_DTYPE_F8_E5M2: return "f8_e5m2";
    case LWO_DTYPE_I8: return "i8";
    case LWO_DTYPE_U8: return "u8";
    default: return "unknown";
  }
}

}  // namespace lwo
