// safetensors checkpoints: header parsing and validation, index files, and the
// mapping of tensors to layers. Host-only, pure C++17 (no CUDA); every failure
// throws lwo::Error with a checkpoint status (see lwo.h) and a message that
// names the file, the tensor (when there is one) and the values at fault.
//
// The format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
// (an object: tensor name -> {"dtype", "shape", "data_offsets"}, plus an
// optional "__metadata__" object of strings), then the data section; each
// tensor's data_offsets [begin, end) are relative to the data section.
//
// JSON is read with nlohmann/json's SAX parser (no document is built): the
// grammar, UTF-8 and escapes are nlohmann's; the shape of the header (which
// keys, which value types, duplicate keys) is checked here as it streams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "lwo.h"

namespace lwo {
namespace st {

// The largest header parse_header accepts (as the reference implementation).
constexpr uint64_t kMaxHeaderBytes = UINT64_C(100) << 20;
// The largest index file Checkpoint::open reads (the same limit: an index is
// the header of a sharded checkpoint); a larger one is LWO_ERR_BAD_HEADER_SIZE,
// refused from its size before it is read.
constexpr uint64_t kMaxIndexBytes = kMaxHeaderBytes;

// Means "lwo has no such dtype" in Entry::dtype. Not -1: lwo_dtype_t has no
// fixed underlying type and no negative enumerator, so -1 is outside its range
// and loading it is undefined behaviour (GCC's -fsanitize=enum reports it).
// lwo_dtype_size() of it is 0 and lwo_dtype_name() "unknown".
constexpr lwo_dtype_t kNoDtype = LWO_DTYPE_FORCE_32;

struct Entry {
  std::string name;
  std::string dtype_name;        // as in the file: "BF16", "F32", ...
  lwo_dtype_t dtype = kNoDtype;  // kNoDtype when lwo has no such dtype (F64, I64, BOOL, ...)
  size_t elem_size = 0;          // bytes per element of dtype_name
  std::vector<int64_t> shape;    // [] for a scalar
  uint64_t begin = 0, end = 0;   // absolute byte offsets in the file: 8 + N + data_offsets
  uint32_t file = 0;             // index into the file list (parse_header sets 0)
};

// Validates and parses the safetensors header of a file whose whole contents
// are [data, data + file_size). `file_name` is for messages. Returns the
// tensors sorted by begin offset (then end, then name). "__metadata__" (an
// object of strings) is not a tensor; it is returned in *metadata (cleared
// first) when metadata is not null. Reads nothing outside the buffer, and of
// it only the first min(file_size, 8 + N) bytes: `data` may hold just those
// (Checkpoint::open passes the header read with pread, not the mapping).
//
// Statuses, checked in this order:
//  LWO_ERR_INVALID_ARGUMENT data is null with file_size > 0
//  LWO_ERR_TRUNCATED        the file is shorter than 8 bytes
//  LWO_ERR_BAD_HEADER_SIZE  N == 0, N > kMaxHeaderBytes, or 8 + N > file_size
//  LWO_ERR_BAD_JSON         not valid JSON / UTF-8 (a NUL byte anywhere in the
//                           JSON text included), not an object, a duplicate
//                           key anywhere, a tensor entry that is not an object
//                           of exactly "dtype" (string), "shape" (array of
//                           non-negative integers) and "data_offsets" (array of
//                           2 non-negative integers), a tensor name holding a
//                           NUL character, "__metadata__" not an object of
//                           strings or a key or value of it holding a NUL
//                           character (the C ABI hands them out as C strings)
//  then for each tensor in file order:
//  LWO_ERR_BAD_DTYPE        a dtype string safetensors does not define
//  LWO_ERR_SHAPE_OVERFLOW   a dimension above INT64_MAX, or the product of the
//                           shape and the element size overflows 64 bits
//  LWO_ERR_BAD_RANGE        begin > end, or an offset beyond 64 bits
//  LWO_ERR_TRUNCATED        end beyond the data section (file_size - 8 - N)
//  LWO_ERR_SHAPE_MISMATCH   the shape's bytes differ from end - begin
//  then over all tensors:
//  LWO_ERR_OVERLAP          two tensors' byte ranges overlap (tensors of 0
//                           bytes never overlap anything)
// Gaps between tensors and unused bytes after the last one are allowed.
std::vector<Entry> parse_header(const uint8_t* data, uint64_t file_size,
                                const std::string& file_name,
                                std::map<std::string, std::string>* metadata = nullptr);

// Parses the text of a *.safetensors.index.json: returns tensor name -> shard
// file name (as written, relative to the index's folder). The text must be a
// JSON object with a "weight_map" object whose values are strings; other keys
// ("metadata", ...) may hold anything. LWO_ERR_BAD_JSON for invalid JSON (a NUL
// byte in the text included), a
// duplicate key, a missing or ill-typed weight_map, a tensor name with a NUL
// character, or a shard name that is empty, absolute, holds a NUL character
// or a ".." component. `index_name` is for messages.
std::map<std::string, std::string> parse_index(const std::string& text,
                                               const std::string& index_name);

// The most layers a mapping makes (empty layers of gaps included): a file's
// layer index of 2^20 or more is refused (LWO_ERR_BAD_RANGE, a file problem),
// so that a few tensors far apart cannot make millions of empty layers.
constexpr uint64_t kMaxLayers = uint64_t(1) << 20;

// Tensors mapped to layers: indices into the entries given.
struct LayerMap {
  std::vector<std::vector<size_t>> layers;
  std::vector<size_t> unmatched;  // entries that belong to no layer, in entry order
};

// Layer mapping by a name pattern holding "{i}" exactly once, standing for a
// decimal layer index without leading zeros. The pattern matches at the start
// of a name: the text before {i}, the longest run of digits there (no leading
// zero unless it is "0"), then the text after {i}; whatever follows is free.
// "blocks.{i}." takes "blocks.12.attn.weight" into layer 12, but not
// "blocks.012.x" nor "xblocks.1.x" (those are unmatched). Layers are 0..the
// largest index found. Within a layer, tensors are ordered by (file, begin,
// end, name). `where` names the caller and the checkpoint for messages.
//  LWO_ERR_INVALID_ARGUMENT  the pattern does not hold "{i}" exactly once
//  LWO_ERR_NOT_FOUND         no tensor matches, or an index between 0 and the
//                            largest has no tensor (the message names the first
//                            such layer)
//  With allow_gaps, an index between 0 and the largest that no tensor has is
//  an empty layer instead.
//  LWO_ERR_BAD_RANGE         a layer would have an index of kMaxLayers or more
//                            (the message spells the index as the name does)
LayerMap map_by_pattern(const std::vector<Entry>& entries, const std::string& pattern,
                        const std::string& where, bool allow_gaps = false);

// Layer mapping by explicit names: names[l] lists the tensor names of layer l,
// kept in the order given (a layer may list none).
//  LWO_ERR_NOT_FOUND         a name that no entry has (names the layer and name)
//  LWO_ERR_INVALID_ARGUMENT  a name listed twice (in one layer or two), or a
//                            name that more than one entry has (two shards)
LayerMap map_by_names(const std::vector<Entry>& entries,
                      const std::vector<std::vector<std::string>>& names,
                      const std::string& where);

// A name as messages show it: in double quotes (or `quote`), with the quote,
// '\\', control characters and bytes that are not UTF-8 escaped, cut to about
// 160 bytes. File and tensor names in messages go through it, so that a name
// read from a file cannot put an escape sequence or a line on a terminal.
std::string printable(const std::string& s, char quote = '"');

// Quantized fp8 weights: among one layer's entries (`layer`:
// indices into `entries`), each F8_E4M3 entry W with an entry named
// W.name + "_scale_inv" in the same layer, as fp8 checkpoints ship their
// 128 x 128 block scales. `scale_shape(rows, cols)` gives the scales' shape
// (the layout rule is src/quant's; the caller passes it). Returns the pairs
// as positions in `layer`. Throws lwo::Error naming `where` and both tensors:
// LWO_ERR_SHAPE_MISMATCH (W not 2-D, a 0 in its shape, or scales of another
// shape), LWO_ERR_SHAPE_OVERFLOW (rows or cols of 2^31 or more),
// LWO_ERR_BAD_DTYPE (scales not F32).
struct ScalePair {
  size_t weight, scale;
};
using ScaleShape = std::pair<int64_t, int64_t> (*)(int64_t rows, int64_t cols);
std::vector<ScalePair> find_scale_pairs(const std::vector<Entry>& entries,
                                        const std::vector<size_t>& layer, ScaleShape scale_shape,
                                        const std::string& where);
// The suffix of the scales' name.
constexpr const char* kScaleSuffix = "_scale_inv";

}  // namespace st
}  // namespace lwo
