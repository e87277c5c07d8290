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
    case LWO_DTYPE_U8:
    case LWO_DTYPE_BOOL:
    case LWO_DTYPE_F8_E8M0: return 1;
    case LWO_DTYPE_I16:
    case LWO_DTYPE_U16: return 2;
    case LWO_DTYPE_I32:
    case LWO_DTYPE_U32: return 4;
    case LWO_DTYPE_I64:
    case LWO_DTYPE_U64:
    case LWO_DTYPE_F64:
    case LWO_DTYPE_C64: return 8;
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
    case LWO_DTYPE_BOOL: return "bool";
    case LWO_DTYPE_I16: return "i16";
    case LWO_DTYPE_U16: return "u16";
    case LWO_DTYPE_I32: return "i32";
    case LWO_DTYPE_U32: return "u32";
    case LWO_DTYPE_I64: return "i64";
    case LWO_DTYPE_U64: return "u64";
    case LWO_DTYPE_F64: return "f64";
    case LWO_DTYPE_F8_E8M0: return "f8_e8m0";
    case LWO_DTYPE_C64: return "c64";
    default: return "unknown";
  }
}

}  // namespace lwo
