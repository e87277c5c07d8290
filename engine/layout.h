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
};

struct RecordLayout {
  std::vector<TensorLayout> tensors;
  uint64_t record_bytes = 0;  // a multiple of LWO_RECORD_ALIGN
  int find(const char* name) const;  // index or -1
};

// Validates one layer's description and lays it out. `where` names the call
// and layer for messages ("lwo_pool_create_pinned: layer 3"). Throws
// LWO_ERR_INVALID_ARGUMENT (bad dtype, dims, names), LWO_ERR_OUT_OF_RANGE
// (sizes that overflow 64 bits).
RecordLayout make_layout(const lwo_layer_desc& layer, const std::string& where,
                         bool want_host_data);

}  // namespace lwo
