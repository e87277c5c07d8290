// libFuzzer target for safetensors checkpoints (src/safetensors.h): the input
// is a whole file. It is parsed as a checkpoint; its header text (when the
// length field fits) is parsed as an index file too; what parses is mapped to
// layers by a pattern and by names; what parses must be the whole header (or
// index) text. lwo::Error with a checkpoint status is the
// only allowed failure; any other exception, a crash, a sanitizer report, a
// hang, or a broken promise about the result (checked below) is a bug.
//
// Built and run by scripts/fuzz (clang++ -fsanitize=fuzzer,address,undefined).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "src/common/error.h"
#include "src/common/dtype.h"
#include "src/checkpoint/safetensors.h"
#include "src/quant/quant.h"

namespace {

const char* const kName = "fuzz.safetensors";

#define FUZZ_CHECK(cond)                                                         \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "%s:%d: broken promise: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                              \
    }                                                                            \
  } while (0)

void expect_status(const lwo::Error& e, std::initializer_list<lwo_status_t> allowed,
                   const char* where_name) {
  bool ok = std::find(allowed.begin(), allowed.end(), e.status()) != allowed.end();
  if (!ok) std::fprintf(stderr, "unexpected status %d: %s\n", static_cast<int>(e.status()), e.what());
  FUZZ_CHECK(ok);
  FUZZ_CHECK(std::strstr(e.what(), where_name) != nullptr);  // messages name the file
}

void check_entries(const std::vector<lwo::st::Entry>& es, const uint8_t* data, size_t size) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  const uint64_t data_start = 8 + n;
  uint64_t reach = 0;
  for (size_t i = 0; i < es.size(); ++i) {
    const lwo::st::Entry& e = es[i];
    FUZZ_CHECK(e.file == 0);
    FUZZ_CHECK(e.begin <= e.end && e.end <= size && e.begin >= data_start);
    if (i) FUZZ_CHECK(es[i - 1].begin <= e.begin);
    if (e.begin != e.end) {
      FUZZ_CHECK(e.begin >= reach);  // no overlap
      reach = e.end;
    }
    FUZZ_CHECK(e.elem_size == 1 || e.elem_size == 2 || e.elem_size == 4 || e.elem_size == 8);
    if (e.dtype != lwo::st::kNoDtype) FUZZ_CHECK(lwo::dtype_size(e.dtype) == e.elem_size);
    uint64_t bytes = e.elem_size;
    for (int64_t d : e.shape) {
      FUZZ_CHECK(d >= 0);
      if (d == 0) bytes = 0;
    }
    for (int64_t d : e.shape)
      if (bytes) bytes *= static_cast<uint64_t>(d);  // cannot overflow: it was checked
    FUZZ_CHECK(bytes == e.end - e.begin);
    FUZZ_CHECK(e.name.find('\0') == std::string::npos);
  }
}

void check_map(const lwo::st::LayerMap& m, size_t n_entries) {
  std::vector<int> seen(n_entries, 0);
  for (const auto& layer : m.layers)
    for (size_t i : layer) {
      FUZZ_CHECK(i < n_entries);
      ++seen[i];
    }
  for (size_t i : m.unmatched) {
    FUZZ_CHECK(i < n_entries);
    ++seen[i];
  }
  for (int s : seen) FUZZ_CHECK(s == 1);
}

// The scales' shape of an fp8 weight, by src/quant's block rule (what the
// checkpoint pool passes).
std::pair<int64_t, int64_t> block_scales(int64_t rows, int64_t cols) {
  const lwo::quant::Layout q =
      lwo::quant::layout_of(LWO_QUANT_FP8_E4M3_BLOCK128, LWO_DTYPE_BF16, rows, cols);
  return {q.scale_rows, q.scale_cols};
}

// Quantized fp8 weights in one layer (since 0.4.0): every pair is an F8_E4M3
// 2-D weight and its F32 "<weight>_scale_inv" of the block rule's shape, no
// entry in two pairs; a failure is one of the documented statuses.
void check_scale_pairs(const std::vector<lwo::st::Entry>& es, const std::vector<size_t>& layer) {
  try {
    const std::vector<lwo::st::ScalePair> pairs =
        lwo::st::find_scale_pairs(es, layer, block_scales, kName);
    std::vector<int> used(layer.size(), 0);
    for (const lwo::st::ScalePair& p : pairs) {
      FUZZ_CHECK(p.weight < layer.size() && p.scale < layer.size() && p.weight != p.scale);
      ++used[p.weight];
      ++used[p.scale];
      const lwo::st::Entry& w = es[layer[p.weight]];
      const lwo::st::Entry& s = es[layer[p.scale]];
      FUZZ_CHECK(w.dtype == LWO_DTYPE_F8_E4M3 && s.dtype == LWO_DTYPE_F32);
      FUZZ_CHECK(s.name == w.name + lwo::st::kScaleSuffix);
      FUZZ_CHECK(w.shape.size() == 2 && s.shape.size() == 2);
      const lwo::quant::Layout q = lwo::quant::layout_of(LWO_QUANT_FP8_E4M3_BLOCK128,
                                                         LWO_DTYPE_BF16, w.shape[0], w.shape[1]);
      FUZZ_CHECK(s.shape[0] == q.scale_rows && s.shape[1] == q.scale_cols);
      FUZZ_CHECK(w.end - w.begin == q.data_bytes && s.end - s.begin == q.scale_bytes);
    }
    for (int u : used) FUZZ_CHECK(u <= 1);
  } catch (const lwo::Error& e) {
    expect_status(e, {LWO_ERR_SHAPE_MISMATCH, LWO_ERR_SHAPE_OVERFLOW, LWO_ERR_BAD_DTYPE}, kName);
  }
}

void map_layers(const std::vector<lwo::st::Entry>& es, const uint8_t* data, size_t size) {
  const char* const where = "fuzz layers";
  // By pattern: the pattern comes from the last input byte, so the fuzzer can
  // steer which one it exercises.
  static const char* const patterns[] = {"blocks.{i}.", "{i}", "h.{i}", "layers.{i}.w",
                                         "", "{i}{i}"};
  const char* pattern = patterns[size ? data[size - 1] % 6 : 0];
  try {
    lwo::st::LayerMap m = lwo::st::map_by_pattern(es, pattern, where);
    check_map(m, es.size());
    FUZZ_CHECK(!m.layers.empty());
    for (const auto& layer : m.layers) check_scale_pairs(es, layer);
    for (const auto& layer : m.layers) {
      FUZZ_CHECK(!layer.empty());
      for (size_t k = 1; k < layer.size(); ++k)
        FUZZ_CHECK(es[layer[k - 1]].begin <= es[layer[k]].begin);
    }
  } catch (const lwo::Error& e) {
    expect_status(e, {LWO_ERR_NOT_FOUND, LWO_ERR_INVALID_ARGUMENT, LWO_ERR_BAD_RANGE}, where);
  }
  // The same pattern with gaps allowed: missing indices are empty layers, so
  // every layer up to the largest index exists and the tensors are those the
  // strict mapping would take (when it succeeds).
  try {
    lwo::st::LayerMap g = lwo::st::map_by_pattern(es, pattern, where, /*allow_gaps=*/true);
    check_map(g, es.size());
    FUZZ_CHECK(!g.layers.empty() && !g.layers.back().empty());
    FUZZ_CHECK(g.layers.size() <= lwo::st::kMaxLayers);
  } catch (const lwo::Error& e) {
    expect_status(e, {LWO_ERR_NOT_FOUND, LWO_ERR_INVALID_ARGUMENT, LWO_ERR_BAD_RANGE}, where);
  }
  // By names: every tensor, in two layers, last first. Names in one file are
  // unique, so this must succeed.
  std::vector<std::vector<std::string>> names(2);
  for (size_t i = es.size(); i-- > 0;) names[i % 2].push_back(es[i].name);
  lwo::st::LayerMap m = lwo::st::map_by_names(es, names, where);
  check_map(m, es.size());
  FUZZ_CHECK(m.unmatched.empty());
  // A name twice, and a missing name.
  if (!es.empty()) {
    names[1].push_back(es[0].name);
    try {
      lwo::st::map_by_names(es, names, where);
      FUZZ_CHECK(false);
    } catch (const lwo::Error& e) {
      expect_status(e, {LWO_ERR_INVALID_ARGUMENT}, where);
    }
  }
  try {
    lwo::st::map_by_names(es, {{"\x01 not a tensor"}}, where);
    FUZZ_CHECK(false);
  } catch (const lwo::Error& e) {
    expect_status(e, {LWO_ERR_NOT_FOUND}, where);
  }
}

void parse_index_text(const char* text, size_t n) {
  const char* const name = "fuzz.safetensors.index.json";
  try {
    std::map<std::string, std::string> m = lwo::st::parse_index(std::string(text, n), name);
    // what parses is the whole text: one JSON value, no NUL, nothing after
    FUZZ_CHECK(std::memchr(text, 0, n) == nullptr);
    FUZZ_CHECK(nlohmann::json::accept(text, text + n));
    for (const auto& kv : m) {
      FUZZ_CHECK(!kv.second.empty() && kv.second[0] != '/');
      FUZZ_CHECK(kv.second.find('\0') == std::string::npos);
      FUZZ_CHECK(kv.first.find('\0') == std::string::npos);
    }
  } catch (const lwo::Error& e) {
    expect_status(e, {LWO_ERR_BAD_JSON}, name);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The header text doubles as an index file.
  uint64_t n = 0;
  if (size >= 8) {
    for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
    if (n <= size - 8) parse_index_text(reinterpret_cast<const char*>(data + 8), n);
  }
  std::map<std::string, std::string> meta;
  std::vector<lwo::st::Entry> es;
  try {
    es = lwo::st::parse_header(size ? data : nullptr, size, kName, &meta);
  } catch (const lwo::Error& e) {
    expect_status(e,
                  {LWO_ERR_TRUNCATED, LWO_ERR_BAD_HEADER_SIZE, LWO_ERR_BAD_JSON,
                   LWO_ERR_BAD_DTYPE, LWO_ERR_SHAPE_OVERFLOW, LWO_ERR_BAD_RANGE,
                   LWO_ERR_SHAPE_MISMATCH, LWO_ERR_OVERLAP},
                  kName);
    return 0;
  }
  // The whole header was consumed: its n bytes are one JSON value with no
  // NUL and nothing after it (padding is JSON whitespace).
  FUZZ_CHECK(size >= 8 && n <= size - 8);
  FUZZ_CHECK(std::memchr(data + 8, 0, n) == nullptr);
  FUZZ_CHECK(nlohmann::json::accept(data + 8, data + 8 + n));
  check_entries(es, data, size);
  map_layers(es, data, size);
  return 0;
}
