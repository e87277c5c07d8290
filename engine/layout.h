// Record layout: how a layer's named tensors are packed into one record.
// Host-only logic, no CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lwo.h"
#include "src/common/dtype.h"

namespace lwo {

struct TensorLayout {
  std::string name;
  lwo_dtype_t dtype = LWO_DTYPE_F32;
  int32_t n_dims = 0;
  int64_t shape[LWO_MAX_DIMS] = {};
  uint64_t offset = 0;  // within the record, a multiple of LWO_RECORD_ALIGN
  uint64_t bytes = 0;
  const void* host_data = nullptr;  // registered pools only
  // Stored quantized (LWO_EXT_TENSOR_QUANT): dtype is the logical dtype,
  // shape [rows, cols], bytes quant::layout_of(...).total_bytes.
  lwo_quant_format_t quant = LWO_QUANT_NONE;
};

struct RecordLayout {
  std::vector<TensorLayout> tensors;
  uint64_t record_bytes = 0;  // a multiple of LWO_RECORD_ALIGN
  int find(const char* name) const;  // index or -1
};

// Validates one layer's description and lays it out. `where` names the call
// and layer for messages ("lwo_pool_create_pinned: layer 3"). Throws
// LWO_ERR_INVALID_ARGUMENT (bad dtype, dims, names), LWO_ERR_OUT_OF_RANGE
// (sizes that overflow 64 bits). A tensor with an LWO_EXT_TENSOR_QUANT
// extension is laid out by src/quant's rule (quant_tensor_bytes).
RecordLayout make_layout(const lwo_layer_desc& layer, const std::string& where,
                         bool want_host_data);

// The bytes of a quantized tensor of logical `dtype` and `shape` in a
// record: src/quant's total_bytes. Throws LWO_ERR_INVALID_ARGUMENT (not
// 2-D, a bad format or dtype, rows or cols below 1, int4 cols not a
// multiple of 128) or LWO_ERR_OUT_OF_RANGE, the message starting with
// `where` and the tensor's name.
uint64_t quant_tensor_bytes(lwo_quant_format_t format, lwo_dtype_t dtype, int32_t n_dims,
                            const int64_t* shape, const std::string& where,
                            const std::string& name);

// The LWO_EXT_TENSOR_QUANT format on a tensor's `next` chain (LWO_QUANT_NONE
// if none); the chain walked as src/common/ext.h does.
lwo_quant_format_t tensor_quant_format(const void* next, const std::string& where);

}  // namespace lwo
