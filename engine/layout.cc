#include "layout.h"

#include <cstring>
#include <unordered_set>

#include "src/common/error.h"
#include "src/common/ext.h"
#include "src/quant/quant.h"

namespace lwo {

int RecordLayout::find(const char* name) const {
  if (!name) return -1;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].name == name) return static_cast<int>(i);
  return -1;
}

namespace {
bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}
constexpr size_t kMaxName = 255;
}  // namespace

lwo_quant_format_t tensor_quant_format(const void* next, const std::string& where) {
  lwo_quant_format_t format = LWO_QUANT_NONE;
  walk_extensions(next, where, {LWO_EXT_TENSOR_QUANT}, [&](const lwo_ext& e) {
    const auto& q = reinterpret_cast<const lwo_tensor_quant_ext&>(e);
    if (q.reserved != 0)
      fail(LWO_ERR_INVALID_ARGUMENT,
           "%s: lwo_tensor_quant_ext has reserved %u (must be 0)", where.c_str(), q.reserved);
    if (q.format == LWO_QUANT_NONE || !quant::format_name(q.format))
      fail(LWO_ERR_INVALID_ARGUMENT,
           "%s: lwo_tensor_quant_ext has format %d, which is not a quantized format",
           where.c_str(), static_cast<int>(q.format));
    format = q.format;
  });
  return format;
}

uint64_t quant_tensor_bytes(lwo_quant_format_t format, lwo_dtype_t dtype, int32_t n_dims,
                            const int64_t* shape, const std::string& where,
                            const std::string& name) {
  if (n_dims != 2)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "%s: tensor '%s' is quantized (%s) but has %d dimensions (a quantized tensor is 2-D "
         "[rows, cols])",
         where.c_str(), name.c_str(), quant::format_name(format), n_dims);
  try {
    return quant::layout_of(format, dtype, shape[0], shape[1]).total_bytes;
  } catch (const Error& e) {
    fail(e.status(), "%s: tensor '%s' [%lld, %lld] quantized as %s: %s", where.c_str(),
         name.c_str(), static_cast<long long>(shape[0]), static_cast<long long>(shape[1]),
         quant::format_name(format), e.what());
  }
}

RecordLayout make_layout(const lwo_layer_desc& layer, const std::string& where,
                         bool want_host_data) {
  RecordLayout out;
  check_no_extensions(layer.next, where);
  if (layer.n_tensors > 0 && !layer.tensors)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensors is NULL with n_tensors %u", where.c_str(),
         layer.n_tensors);
  if (layer.n_tensors > 1u << 20)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: n_tensors %u is more than 1048576", where.c_str(),
         layer.n_tensors);
  out.tensors.reserve(layer.n_tensors);
  std::unordered_set<std::string> names;
  uint64_t off = 0;
  for (uint32_t i = 0; i < layer.n_tensors; ++i) {
    const lwo_tensor_desc& t = layer.tensors[i];
    const lwo_quant_format_t qf = tensor_quant_format(t.next, where + strf(": tensor %u", i));
    if (!t.name || !t.name[0])
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensor %u has no name", where.c_str(), i);
    size_t nlen = strnlen(t.name, kMaxName + 1);
    if (nlen > kMaxName)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensor %u name is longer than %zu bytes",
           where.c_str(), i, kMaxName);
    std::string name(t.name, nlen);
    if (!names.insert(name).second)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensor name '%s' appears twice", where.c_str(),
           name.c_str());
    // The integer first: t.dtype is loaded as an enum only once it is one.
    const int32_t dv = dtype_value(t.dtype);
    size_t es = dv < 0 ? 0 : dtype_size(t.dtype);
    if (es == 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensor '%s' has unknown dtype %d", where.c_str(),
           name.c_str(), static_cast<int>(dv));
    if (t.n_dims < 0 || t.n_dims > LWO_MAX_DIMS)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensor '%s' has n_dims %d (allowed 0..%d)",
           where.c_str(), name.c_str(), t.n_dims, LWO_MAX_DIMS);
    uint64_t bytes = es;
    for (int d = 0; d < t.n_dims; ++d) {
      if (t.shape[d] < 0)
        fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensor '%s' dimension %d is %lld", where.c_str(),
             name.c_str(), d, static_cast<long long>(t.shape[d]));
      if (mul_overflows(bytes, static_cast<uint64_t>(t.shape[d]), &bytes))
        fail(LWO_ERR_OUT_OF_RANGE, "%s: tensor '%s' byte size overflows 64 bits",
             where.c_str(), name.c_str());
    }
    if (bytes > (UINT64_C(1) << 56))
      fail(LWO_ERR_OUT_OF_RANGE, "%s: tensor '%s' has %llu bytes, more than 2^56",
           where.c_str(), name.c_str(), static_cast<unsigned long long>(bytes));
    if (qf != LWO_QUANT_NONE) bytes = quant_tensor_bytes(qf, t.dtype, t.n_dims, t.shape, where, name);
    if (want_host_data && !t.host_data && bytes > 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensor '%s' has no host_data", where.c_str(),
           name.c_str());
    if (!want_host_data && t.host_data)
      fail(LWO_ERR_INVALID_ARGUMENT,
           "%s: tensor '%s' has host_data, but a pinned pool owns its memory (set it to NULL)",
           where.c_str(), name.c_str());
    TensorLayout tl;
    tl.name = std::move(name);
    tl.dtype = t.dtype;
    tl.n_dims = t.n_dims;
    for (int d = 0; d < t.n_dims; ++d) tl.shape[d] = t.shape[d];
    tl.offset = off;
    tl.bytes = bytes;
    tl.host_data = t.host_data;
    tl.quant = qf;
    off = align_up(off + bytes, LWO_RECORD_ALIGN);
    if (off > (UINT64_C(1) << 58))
      fail(LWO_ERR_OUT_OF_RANGE, "%s: record size overflows", where.c_str());
    out.tensors.push_back(std::move(tl));
  }
  out.record_bytes = off;
  return out;
}

}  // namespace lwo
