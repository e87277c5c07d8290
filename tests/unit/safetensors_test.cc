// safetensors header parsing, index files and layer mapping (src/safetensors.h).
// Files are built in memory; every parse reads an exact-size heap copy, so the
// sanitizer build catches any read outside the file.
#include "src/checkpoint/safetensors.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "src/common/error.h"
#include "src/common/dtype.h"

namespace lwo {
namespace st {
namespace {

using Bytes = std::vector<uint8_t>;
const char* const kFile = "ckpt/model-00001.safetensors";

// A file: the little-endian length of `header`, `header`, then `data`.
Bytes file_of(const std::string& header, const Bytes& data) {
  Bytes f(8);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f[i] = static_cast<uint8_t>(n >> (8 * i));
  f.insert(f.end(), header.begin(), header.end());
  f.insert(f.end(), data.begin(), data.end());
  return f;
}
Bytes file_of(const std::string& header, size_t data_bytes) {
  return file_of(header, Bytes(data_bytes, 0xab));
}
// A file whose length field says `n` whatever follows.
Bytes with_length(uint64_t n, const std::string& rest) {
  Bytes f(8);
  for (int i = 0; i < 8; ++i) f[i] = static_cast<uint8_t>(n >> (8 * i));
  f.insert(f.end(), rest.begin(), rest.end());
  return f;
}

// parse_header over an exact-size heap copy of `f` (or of its first `size`).
std::vector<Entry> parse(const Bytes& f, std::map<std::string, std::string>* meta = nullptr,
                         size_t size = SIZE_MAX) {
  size = std::min(size, f.size());
  std::unique_ptr<uint8_t[]> copy(new uint8_t[size ? size : 1]);
  if (size) std::memcpy(copy.get(), f.data(), size);
  return parse_header(size ? copy.get() : nullptr, size, kFile, meta);
}

// Runs `fn`, expecting lwo::Error with `status` and every one of `parts` in
// its message.
void expect_error(const std::function<void()>& fn, lwo_status_t status,
                  const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected " << lwo_status_string(status);
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << lwo_status_string(e.status()) << ": " << e.what();
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message lacks '" << p << "': " << e.what();
  }
}
void expect_parse_error(const Bytes& f, lwo_status_t status, std::vector<std::string> parts) {
  parts.insert(parts.begin(), kFile);
  expect_error([&] { parse(f); }, status, parts);
}

// ---------------------------------------------------------------------------
// Valid files
// ---------------------------------------------------------------------------

TEST(Safetensors, ParsesTensorsMetadataScalarsAndEmptyTensors) {
  const std::string h =
      R"({"b.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[16,28]},)"
      R"("__metadata__":{"format":"pt","note":"x"},)"
      R"("a.bias":{"shape":[4],"dtype":"F32","data_offsets":[0,16]},)"
      R"("scalar":{"dtype":"I64","shape":[],"data_offsets":[28,36]},)"
      R"("empty":{"dtype":"F16","shape":[0,7],"data_offsets":[16,16]}})";
  Bytes data(40);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i);
  Bytes f = file_of(h, data);
  std::map<std::string, std::string> meta{{"stale", "entry"}};
  std::vector<Entry> e = parse(f, &meta);
  const uint64_t base = 8 + h.size();
  ASSERT_EQ(e.size(), 4u);
  EXPECT_EQ(e[0].name, "a.bias");
  EXPECT_EQ(e[0].dtype_name, "F32");
  EXPECT_EQ(e[0].dtype, LWO_DTYPE_F32);
  EXPECT_EQ(e[0].elem_size, 4u);
  EXPECT_EQ(e[0].shape, std::vector<int64_t>{4});
  EXPECT_EQ(e[0].begin, base);
  EXPECT_EQ(e[0].end, base + 16);
  EXPECT_EQ(e[0].file, 0u);
  // Sorted by begin, then end: the empty tensor at 16 comes before b.weight.
  EXPECT_EQ(e[1].name, "empty");
  EXPECT_EQ(e[1].begin, base + 16);
  EXPECT_EQ(e[1].end, base + 16);
  EXPECT_EQ(e[1].shape, (std::vector<int64_t>{0, 7}));
  EXPECT_EQ(e[1].dtype, LWO_DTYPE_F16);
  EXPECT_EQ(e[2].name, "b.weight");
  EXPECT_EQ(e[2].dtype, LWO_DTYPE_BF16);
  EXPECT_EQ(e[2].begin, base + 16);
  EXPECT_EQ(e[2].end, base + 28);
  EXPECT_EQ(e[3].name, "scalar");
  EXPECT_TRUE(e[3].shape.empty());
  EXPECT_EQ(e[3].dtype_name, "I64");
  EXPECT_EQ(e[3].dtype, LWO_DTYPE_I64);
  EXPECT_EQ(e[3].elem_size, 8u);
  EXPECT_EQ(e[3].end - e[3].begin, 8u);
  EXPECT_EQ(f[e[3].begin], 28);  // absolute offsets index the file
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"format", "pt"}, {"note", "x"}}));
  // Without a metadata pointer it parses the same.
  EXPECT_EQ(parse(f).size(), 4u);
}

TEST(Safetensors, EmptyHeaderPaddingGapsAndTrailingBytes) {
  EXPECT_TRUE(parse(file_of("{}", 0)).empty());
  EXPECT_TRUE(parse(file_of("  {}\n\t ", 100)).empty());
  // The reference writer pads the header with spaces to 8 bytes.
  const std::string h = R"({"w":{"dtype":"U8","shape":[3],"data_offsets":[5,8]}})" + std::string(6, ' ');
  std::vector<Entry> e = parse(file_of(h, 20));  // a gap before, 12 unused bytes after
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].begin, 8 + h.size() + 5);
  EXPECT_EQ(e[0].dtype, LWO_DTYPE_U8);
  // "-0" is the integer 0; a UTF-8 name is kept as it is.
  e = parse(file_of(u8R"({"层.0":{"dtype":"I8","shape":[-0],"data_offsets":[0,0]}})", 0));
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].name, u8"层.0");
  EXPECT_EQ(e[0].shape, std::vector<int64_t>{0});
  // A dimension of 0 makes 0 bytes, whatever the others (no overflow).
  e = parse(file_of(
      R"({"z":{"dtype":"F64","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0]}})",
      0));
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].shape[0], INT64_C(4611686018427387904));
  // Zero-size tensors never overlap, even inside another's range.
  e = parse(file_of(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},)"
                    R"("c":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},)"
                    R"("d":{"dtype":"U8","shape":[2],"data_offsets":[8,10]}})",
                    10));
  ASSERT_EQ(e.size(), 4u);
  EXPECT_EQ(e[1].name, "b");
  EXPECT_EQ(e[2].name, "c");
}

TEST(Safetensors, EveryDtypeHasItsSizeAndLwoDtype) {
  struct D {
    const char* name;
    size_t size;
    lwo_dtype_t dtype;
  };
  const D all[] = {{"BOOL", 1, LWO_DTYPE_BOOL},   {"U8", 1, LWO_DTYPE_U8},
                   {"I8", 1, LWO_DTYPE_I8},       {"F8_E5M2", 1, LWO_DTYPE_F8_E5M2},
                   {"F8_E4M3", 1, LWO_DTYPE_F8_E4M3}, {"F8_E8M0", 1, LWO_DTYPE_F8_E8M0},
                   {"I16", 2, LWO_DTYPE_I16},     {"U16", 2, LWO_DTYPE_U16},
                   {"F16", 2, LWO_DTYPE_F16},     {"BF16", 2, LWO_DTYPE_BF16},
                   {"I32", 4, LWO_DTYPE_I32},     {"U32", 4, LWO_DTYPE_U32},
                   {"F32", 4, LWO_DTYPE_F32},     {"F64", 8, LWO_DTYPE_F64},
                   {"I64", 8, LWO_DTYPE_I64},     {"U64", 8, LWO_DTYPE_U64},
                   {"C64", 8, LWO_DTYPE_C64}};
  for (const D& d : all) {
    SCOPED_TRACE(d.name);
    std::string h = strf(R"({"t":{"dtype":"%s","shape":[3],"data_offsets":[0,%zu]}})", d.name,
                         3 * d.size);
    std::vector<Entry> e = parse(file_of(h, 3 * d.size));
    ASSERT_EQ(e.size(), 1u);
    EXPECT_EQ(e[0].dtype_name, d.name);
    EXPECT_EQ(e[0].elem_size, d.size);
    EXPECT_EQ(e[0].dtype, d.dtype);
    if (d.dtype != kNoDtype) {
      EXPECT_EQ(dtype_size(d.dtype), d.size);
    }
  }
  EXPECT_EQ(lwo_dtype_size(kNoDtype), 0u);
  EXPECT_STREQ(lwo_dtype_name(kNoDtype), "unknown");
}

// ---------------------------------------------------------------------------
// Bad files: each status, with a message naming the file, tensor and values
// ---------------------------------------------------------------------------

TEST(Safetensors, ShortFilesAndBadHeaderLengths) {
  for (size_t n = 0; n < 8; ++n) {
    SCOPED_TRACE(n);
    expect_parse_error(Bytes(n, 0), LWO_ERR_TRUNCATED, {strf("is %zu bytes", n)});
  }
  expect_parse_error(with_length(0, "{}"), LWO_ERR_BAD_HEADER_SIZE, {"header length is 0"});
  expect_parse_error(with_length(kMaxHeaderBytes + 1, "{}"), LWO_ERR_BAD_HEADER_SIZE,
                     {"104857601", "limit of 104857600"});
  expect_parse_error(with_length(UINT64_MAX, "{}"), LWO_ERR_BAD_HEADER_SIZE,
                     {"18446744073709551615"});
  expect_parse_error(with_length(3, "{}"), LWO_ERR_BAD_HEADER_SIZE,
                     {"3 bytes", "only 2", "10 bytes in all"});
  // The limit itself is allowed (and then needs the bytes).
  expect_parse_error(with_length(kMaxHeaderBytes, "{}"), LWO_ERR_BAD_HEADER_SIZE,
                     {"holds only 2"});
  expect_error([] { parse_header(nullptr, 16, kFile); }, LWO_ERR_INVALID_ARGUMENT,
               {kFile, "NULL"});
}

struct BadCase {
  std::string header;
  size_t data_bytes;
  lwo_status_t status;
  std::vector<std::string> parts;  // besides the file name
};

TEST(Safetensors, BadHeadersGetDistinctStatusesAndMessages) {
  const std::string ok = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::vector<BadCase> cases = {
      // Not JSON, or not of the expected shape.
      {"{", 0, LWO_ERR_BAD_JSON, {"not valid JSON", "byte"}},
      {R"({"w":})", 0, LWO_ERR_BAD_JSON, {"not valid JSON"}},
      {"{} x", 0, LWO_ERR_BAD_JSON, {"not valid JSON"}},
      {"{\"\xff\":{}}", 0, LWO_ERR_BAD_JSON, {"not valid JSON"}},
      {"{\"\xc3\x28\":{}}", 0, LWO_ERR_BAD_JSON, {"not valid JSON"}},
      {R"({"\ud800":{}})", 0, LWO_ERR_BAD_JSON, {"not valid JSON"}},
      {"[]", 0, LWO_ERR_BAD_JSON, {"header is an array, not a JSON object"}},
      {"7", 0, LWO_ERR_BAD_JSON, {"header is the number 7"}},
      {R"("x")", 0, LWO_ERR_BAD_JSON, {"header is a string \"x\""}},
      {R"({"w":5})", 0, LWO_ERR_BAD_JSON, {"tensor \"w\"", "entry is the number 5"}},
      {R"({"w":[]})", 0, LWO_ERR_BAD_JSON, {"tensor \"w\"", "entry is an array"}},
      {R"({"w":null})", 0, LWO_ERR_BAD_JSON, {"tensor \"w\"", "entry is null"}},
      {R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "no dtype"}},
      {R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "no shape"}},
      {R"({"w":{"dtype":"F32","shape":[2]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "no data_offsets"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "unknown field \"x\""}},
      {R"({"w":{"dtype":"F32","shape":[2],"dtype":"F32","data_offsets":[0,8]}})", 8,
       LWO_ERR_BAD_JSON, {"tensor \"w\"", "field \"dtype\" appears twice"}},
      {R"({"w":{"dtype":5,"shape":[2],"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "dtype is the number 5, not a string"}},
      {R"({"w":{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "dtype is an array"}},
      {R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "shape is the number 2"}},
      {R"({"w":{"dtype":"F32","shape":{},"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "shape is an object"}},
      {R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "shape[0] is the number 2.0"}},
      {R"({"w":{"dtype":"F32","shape":[1,2e0],"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "shape[1] is the number 2e0"}},
      {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "shape[0] is the number -2"}},
      {R"({"w":{"dtype":"F32","shape":[true],"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "shape[0] is true"}},
      {R"({"w":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "shape[0] is an array"}},
      {R"({"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "shape[0] is a string \"2\""}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}})", 9, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "data_offsets has 3 values, not 2"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "data_offsets has 1 values"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})", 9, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "data_offsets[1] is the number 8.5"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "data_offsets[0] is the number -1"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":"0,8"}})", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "data_offsets is a string"}},
      {R"({"w":)" + ok + R"(,"w":)" + ok + "}", 8, LWO_ERR_BAD_JSON,
       {"tensor \"w\"", "appears twice"}},
      {R"({"a\u0000b":)" + ok + "}", 8, LWO_ERR_BAD_JSON, {"tensor \"a\\x00b\"", "NUL"}},
      {R"({"__metadata__":[]})", 0, LWO_ERR_BAD_JSON, {"__metadata__ is an array"}},
      {R"({"__metadata__":{"k":1}})", 0, LWO_ERR_BAD_JSON,
       {"__metadata__ value of key \"k\" is the number 1"}},
      {R"({"__metadata__":{"k":{}}})", 0, LWO_ERR_BAD_JSON,
       {"__metadata__ value of key \"k\" is an object"}},
      {R"({"__metadata__":{"k":"a","k":"b"}})", 0, LWO_ERR_BAD_JSON,
       {"__metadata__ key \"k\" appears twice"}},
      {R"({"__metadata__":{},"__metadata__":{}})", 0, LWO_ERR_BAD_JSON, {"appears twice"}},
      // Unknown dtypes.
      {R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", 1, LWO_ERR_BAD_DTYPE,
       {"tensor \"w\"", "unknown dtype \"F4\"", "BF16"}},
      {R"({"w":{"dtype":"bf16","shape":[2],"data_offsets":[0,4]}})", 4, LWO_ERR_BAD_DTYPE,
       {"tensor \"w\"", "unknown dtype \"bf16\""}},
      {R"({"w":{"dtype":"","shape":[2],"data_offsets":[0,4]}})", 4, LWO_ERR_BAD_DTYPE,
       {"tensor \"w\"", "unknown dtype \"\""}},
      // Shapes whose byte size overflows.
      {R"({"w":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})", 8,
       LWO_ERR_SHAPE_OVERFLOW, {"tensor \"w\"", "[4611686018427387904, 8]", "F32", "overflows"}},
      {R"({"w":{"dtype":"BF16","shape":[4611686018427387904,2],"data_offsets":[0,8]}})", 8,
       LWO_ERR_SHAPE_OVERFLOW, {"tensor \"w\"", "overflows"}},
      {R"({"w":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,8]}})", 8,
       LWO_ERR_SHAPE_OVERFLOW, {"tensor \"w\"", "shape[0] is 9223372036854775808, above INT64_MAX"}},
      {R"({"w":{"dtype":"U8","shape":[1,18446744073709551616],"data_offsets":[0,8]}})", 8,
       LWO_ERR_SHAPE_OVERFLOW, {"tensor \"w\"", "shape[1] is 18446744073709551616, beyond 64 bits"}},
      // Byte ranges.
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[12,4]}})", 16, LWO_ERR_BAD_RANGE,
       {"tensor \"w\"", "[12, 4]", "begin after their end"}},
      {R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,18446744073709551616]}})", 8,
       LWO_ERR_BAD_RANGE, {"tensor \"w\"", "18446744073709551616", "beyond 64 bits"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 7, LWO_ERR_TRUNCATED,
       {"tensor \"w\"", "[0, 8]", "data section of 7 bytes", "cut short"}},
      {R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[100,100]}})", 7, LWO_ERR_TRUNCATED,
       {"tensor \"w\"", "[100, 100]"}},
      {R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 24,
       LWO_ERR_SHAPE_MISMATCH, {"tensor \"w\"", "[2, 3]", "24 bytes", "[0, 20]", "span 20"}},
      {R"({"w":{"dtype":"F32","shape":[],"data_offsets":[0,0]}})", 0, LWO_ERR_SHAPE_MISMATCH,
       {"tensor \"w\"", "shape [] of F32 is 4 bytes"}},
      {R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
       12, LWO_ERR_OVERLAP, {"\"a\"", "\"b\"", "overlap"}},
      {R"({"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},)"
       R"("b":{"dtype":"U8","shape":[2],"data_offsets":[10,12]},)"
       R"("c":{"dtype":"U8","shape":[2],"data_offsets":[12,14]}})",
       16, LWO_ERR_OVERLAP, {"\"a\"", "\"b\""}},
      {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})",
       4, LWO_ERR_OVERLAP, {"\"a\"", "\"b\"", "(bytes ["}},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.header);
    expect_parse_error(file_of(c.header, c.data_bytes), c.status, c.parts);
  }
  // A header with a NUL byte inside.
  expect_parse_error(file_of(std::string("{\"a\0\":{}}", 9), 0), LWO_ERR_BAD_JSON,
                     {"not valid JSON"});
  // A NUL byte after valid JSON: nlohmann's lexer takes it for the end of the
  // input, the reference implementation refuses the file.
  expect_parse_error(file_of(std::string("{}\0garbage", 10), 0), LWO_ERR_BAD_JSON,
                     {"not valid JSON", "byte 2", "NUL byte"});
  expect_parse_error(file_of(std::string("{}\0", 3), 0), LWO_ERR_BAD_JSON, {"NUL byte"});
  // NUL characters in __metadata__ keys and values (the C ABI hands them out
  // as C strings: they would be cut).
  expect_parse_error(file_of(R"({"__metadata__":{"k\u0000x":"v"}})", 0), LWO_ERR_BAD_JSON,
                     {"__metadata__ key \"k\\x00x\"", "NUL character"});
  expect_parse_error(file_of(R"({"__metadata__":{"k":"v\u0000x"}})", 0), LWO_ERR_BAD_JSON,
                     {"__metadata__ value of key \"k\"", "NUL character"});
}

TEST(Safetensors, MessagesShowStrangeNamesSafely) {
  EXPECT_EQ(printable("blocks.0.w"), "\"blocks.0.w\"");
  EXPECT_EQ(printable("a\"b\\c\n\x01"), "\"a\\\"b\\\\c\\x0a\\x01\"");
  EXPECT_EQ(printable(u8"层"), u8"\"层\"");
  EXPECT_EQ(printable("\xff\xc3"), "\"\\xff\\xc3\"");
  // C1 controls (U+0080..U+009F, such as CSI U+009B) are escaped too: one rule
  // with the lwo program's (src/common/utf8.h).
  EXPECT_EQ(printable("a\xc2\x9b[2Jb"), "\"a\\xc2\\x9b[2Jb\"");
  EXPECT_EQ(printable("\xc2\xa0"), "\"\xc2\xa0\"");  // U+00A0 is printable
  std::string long_name(1000, 'x');
  std::string p = printable(long_name);
  EXPECT_LT(p.size(), 200u);
  EXPECT_NE(p.find("(1000 bytes)"), std::string::npos);
  expect_parse_error(file_of(R"({"bad\nname":{"dtype":"Q","shape":[],"data_offsets":[0,0]}})", 0),
                     LWO_ERR_BAD_DTYPE, {"tensor \"bad\\x0aname\""});
}

// Every cut of a valid file fails, with the status the cut calls for.
TEST(Safetensors, EveryPrefixOfAValidFileFails) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
                        R"("b":{"dtype":"U8","shape":[5],"data_offsets":[12,17]}})";
  Bytes f = file_of(h, 17);
  ASSERT_EQ(parse(f).size(), 2u);
  for (size_t cut = 0; cut < f.size(); ++cut) {
    SCOPED_TRACE(cut);
    lwo_status_t want = cut < 8                ? LWO_ERR_TRUNCATED
                        : cut < 8 + h.size()   ? LWO_ERR_BAD_HEADER_SIZE
                                               : LWO_ERR_TRUNCATED;
    expect_error([&] { parse(f, nullptr, cut); }, want, {kFile});
  }
}

// ---------------------------------------------------------------------------
// Random valid files: what is written is what is parsed
// ---------------------------------------------------------------------------

struct Made {
  std::string name, dtype;
  size_t elem;
  std::vector<int64_t> shape;
  uint64_t off_begin, off_end;  // in the data section
};

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

TEST(Safetensors, RandomValidFilesRoundTrip) {
  const std::pair<const char*, size_t> dtypes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2},
      {"U16", 2},  {"F16", 2}, {"BF16", 2}, {"I32", 4},    {"U32", 4},     {"F32", 4},
      {"F64", 8},  {"I64", 8}, {"U64", 8}};
  std::mt19937_64 rng(1234);
  auto pick = [&](uint64_t n) { return static_cast<uint64_t>(rng() % n); };
  for (int iter = 0; iter < 300; ++iter) {
    SCOPED_TRACE(iter);
    std::vector<Made> ts(pick(12));
    uint64_t pos = 0;
    std::set<std::string> used;
    for (size_t i = 0; i < ts.size(); ++i) {
      Made& t = ts[i];
      do {  // names with '"' and '\\' too, escaped in the JSON
        t.name = strf("m%d.%llu%s", static_cast<int>(pick(3)),
                      static_cast<unsigned long long>(pick(1000)), pick(4) ? "" : "\"q\\");
      } while (!used.insert(t.name).second);
      const auto& dt = dtypes[pick(15)];
      t.dtype = dt.first;
      t.elem = dt.second;
      uint64_t bytes = t.elem;
      for (uint64_t d = pick(4); d > 0; --d) {
        t.shape.push_back(static_cast<int64_t>(pick(6)));
        bytes *= static_cast<uint64_t>(t.shape.back());
      }
      pos += pick(3) ? 0 : pick(40);  // a gap now and then
      t.off_begin = pos;
      t.off_end = pos + bytes;
      pos = t.off_end;
    }
    // The header, in a shuffled order, fields shuffled, with metadata and padding.
    std::vector<std::string> parts;
    for (const Made& t : ts) {
      std::string shape;
      for (int64_t d : t.shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
      std::vector<std::string> fields = {
          "\"dtype\":\"" + t.dtype + "\"", "\"shape\":[" + shape + "]",
          strf("\"data_offsets\":[%llu, %llu]", static_cast<unsigned long long>(t.off_begin),
               static_cast<unsigned long long>(t.off_end))};
      std::shuffle(fields.begin(), fields.end(), rng);
      parts.push_back(json_string(t.name) + ":{" + fields[0] + "," + fields[1] + " , " +
                      fields[2] + "}");
    }
    std::map<std::string, std::string> meta_in;
    if (pick(2)) {
      meta_in["format"] = "pt";
      meta_in[strf("k%d", static_cast<int>(pick(9)))] = "v\"";
      std::string m;
      for (const auto& kv : meta_in)
        m += (m.empty() ? "" : ",") + json_string(kv.first) + ":" + json_string(kv.second);
      parts.push_back("\"__metadata__\":{" + m + "}");
    }
    std::shuffle(parts.begin(), parts.end(), rng);
    std::string h = "{";
    for (size_t i = 0; i < parts.size(); ++i) h += (i ? ",\n" : "") + parts[i];
    h += "}" + std::string(pick(8), ' ');
    Bytes data(pos + pick(30));
    for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
    Bytes f = file_of(h, data);

    std::map<std::string, std::string> meta;
    std::vector<Entry> got = parse(f, &meta);
    EXPECT_EQ(meta, meta_in);
    ASSERT_EQ(got.size(), ts.size());
    for (size_t i = 1; i < got.size(); ++i) EXPECT_LE(got[i - 1].begin, got[i].begin);
    const uint64_t base = 8 + h.size();
    for (const Made& t : ts) {
      auto it = std::find_if(got.begin(), got.end(),
                             [&](const Entry& e) { return e.name == t.name; });
      ASSERT_NE(it, got.end()) << t.name;
      EXPECT_EQ(it->dtype_name, t.dtype);
      EXPECT_EQ(it->elem_size, t.elem);
      EXPECT_EQ(it->shape, t.shape);
      EXPECT_EQ(it->begin, base + t.off_begin);
      EXPECT_EQ(it->end, base + t.off_end);
      EXPECT_TRUE(std::equal(f.begin() + static_cast<ptrdiff_t>(it->begin),
                             f.begin() + static_cast<ptrdiff_t>(it->end),
                             data.begin() + static_cast<ptrdiff_t>(t.off_begin)));
    }
  }
}

// Mutated files either parse into entries that keep every promise, or fail
// with lwo::Error; nothing else escapes (the fuzzer does this at length).
TEST(Safetensors, MutatedFilesOnlyFailWithLwoErrors) {
  const std::string h = R"({"__metadata__":{"format":"pt"},)"
                        R"("blocks.0.w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},)"
                        R"("blocks.1.w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
                        R"("head":{"dtype":"I64","shape":[],"data_offsets":[16,24]}})";
  const Bytes base = file_of(h, 24);
  std::mt19937 rng(99);
  int parsed = 0, failed = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    Bytes f = base;
    for (int k = 1 + static_cast<int>(rng() % 3); k > 0; --k) {
      size_t at = rng() % f.size();
      switch (rng() % 4) {
        case 0: f[at] = static_cast<uint8_t>(rng()); break;
        case 1: f[at] = "{}[],:\"0123456789-.eE \\u"[rng() % 25]; break;
        case 2: f.erase(f.begin() + static_cast<ptrdiff_t>(at)); break;
        default: f.insert(f.begin() + static_cast<ptrdiff_t>(at), static_cast<uint8_t>(rng())); break;
      }
      if (f.size() < 9) f = base;
    }
    try {
      std::vector<Entry> e = parse(f);
      ++parsed;
      uint64_t reach = 0;
      for (const Entry& x : e) {
        ASSERT_LE(x.begin, x.end);
        ASSERT_LE(x.end, f.size());
        if (x.begin == x.end) continue;
        ASSERT_GE(x.begin, reach);
        reach = x.end;
      }
    } catch (const Error&) {
      ++failed;
    }
  }
  EXPECT_GT(parsed, 0);
  EXPECT_GT(failed, 0);
}

// ---------------------------------------------------------------------------
// Layer mapping
// ---------------------------------------------------------------------------

Entry entry(const std::string& name, uint64_t begin, uint32_t file = 0, uint64_t bytes = 4) {
  Entry e;
  e.name = name;
  e.dtype_name = "F32";
  e.dtype = LWO_DTYPE_F32;
  e.elem_size = 4;
  e.shape = {static_cast<int64_t>(bytes / 4)};
  e.begin = begin;
  e.end = begin + bytes;
  e.file = file;
  return e;
}

std::vector<std::string> names_of(const std::vector<Entry>& es, const std::vector<size_t>& idx) {
  std::vector<std::string> out;
  for (size_t i : idx) out.push_back(es[i].name);
  return out;
}

TEST(SafetensorsLayers, PatternMapsIndicesAnchoredWithoutLeadingZeros) {
  const std::vector<Entry> es = {
      entry("embed.weight", 0),      entry("blocks.1.b", 100),    entry("blocks.0.w", 40),
      entry("blocks.10.w", 200),     entry("blocks.1.a", 60),     entry("xblocks.3.w", 300),
      entry("blocks.012.w", 310),    entry("blocks.00.w", 320),   entry("blocks.2", 330),
      entry("blocks.2.w", 340),      entry("blocks.3x.w", 350),   entry("blocks..w", 360),
      entry("Blocks.4.w", 370),      entry("blocks.-1.w", 380),   entry("head.weight", 390),
      entry("blocks.3.w", 400),      entry("blocks.4.w", 410),    entry("blocks.5.w", 420),
      entry("blocks.6.w", 430),      entry("blocks.7.w", 440),    entry("blocks.8.w", 450),
      entry("blocks.9.w", 460),      entry("blocks.0.a", 50, 1),
  };
  LayerMap m = map_by_pattern(es, "blocks.{i}.", "test");
  ASSERT_EQ(m.layers.size(), 11u);
  // Within a layer: by file, then begin.
  EXPECT_EQ(names_of(es, m.layers[0]), (std::vector<std::string>{"blocks.0.w", "blocks.0.a"}));
  EXPECT_EQ(names_of(es, m.layers[1]), (std::vector<std::string>{"blocks.1.a", "blocks.1.b"}));
  EXPECT_EQ(names_of(es, m.layers[2]), std::vector<std::string>{"blocks.2.w"});
  EXPECT_EQ(names_of(es, m.layers[10]), std::vector<std::string>{"blocks.10.w"});
  EXPECT_EQ(names_of(es, m.unmatched),
            (std::vector<std::string>{"embed.weight", "xblocks.3.w", "blocks.012.w",
                                      "blocks.00.w", "blocks.2", "blocks.3x.w", "blocks..w",
                                      "Blocks.4.w", "blocks.-1.w", "head.weight"}));
  // A pattern with {i} at the very end takes whatever follows the digits.
  const std::vector<Entry> es2 = {entry("l3", 0), entry("l0", 8), entry("l1.x", 16),
                                  entry("l2y", 24), entry("l", 32), entry("l01", 40)};
  m = map_by_pattern(es2, "l{i}", "test");
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(names_of(es2, m.layers[3]), std::vector<std::string>{"l3"});
  EXPECT_EQ(names_of(es2, m.unmatched), (std::vector<std::string>{"l", "l01"}));
  // {i} first.
  m = map_by_pattern({entry("0.w", 0), entry("1.w", 4), entry("w", 8)}, "{i}.w", "t");
  EXPECT_EQ(m.layers.size(), 2u);
  EXPECT_EQ(m.unmatched, std::vector<size_t>{2});
}

TEST(SafetensorsLayers, PatternErrors) {
  const std::vector<Entry> gap = {entry("h.0.w", 0), entry("h.1.w", 4), entry("h.3.w", 8)};
  expect_error([&] { map_by_pattern(gap, "h.{i}.", "lwo info m.safetensors"); },
               LWO_ERR_NOT_FOUND,
               {"lwo info m.safetensors", "layer 2 has no tensor", "\"h.{i}.\"", "up to 3"});
  expect_error([] { map_by_pattern({entry("h.1.w", 0), entry("h.2.w", 4)}, "h.{i}.", "w"); },
               LWO_ERR_NOT_FOUND, {"layer 0 has no tensor", "up to 2"});
  // A huge index is a gap, found without allocating layers for it.
  expect_error(
      [] {
        map_by_pattern({entry("h.0.w", 0), entry("h.99999999999999999999999999.w", 4)}, "h.{i}.",
                       "w");
      },
      LWO_ERR_NOT_FOUND, {"layer 1 has no tensor", "up to 99999999999999999999999999"});
  expect_error(
      [] { map_by_pattern({entry("h.18446744073709551615.w", 4)}, "h.{i}.", "w"); },
      LWO_ERR_NOT_FOUND, {"layer 0 has no tensor"});
  expect_error([] { map_by_pattern({entry("a.0", 0), entry("b", 4)}, "h.{i}.", "where"); },
               LWO_ERR_NOT_FOUND, {"where", "no tensor matches", "\"h.{i}.\"", "2 tensors"});
  expect_error([] { map_by_pattern({}, "h.{i}.", "where"); }, LWO_ERR_NOT_FOUND,
               {"no tensor matches"});
  for (const char* bad : {"blocks.", "blocks.{i}.{i}", "{i}{i}", "", "{I}", "{i"}) {
    SCOPED_TRACE(bad);
    expect_error([&] { map_by_pattern({entry("a", 0)}, bad, "where"); },
                 LWO_ERR_INVALID_ARGUMENT, {"where", "exactly once"});
  }
}

// A total limit on the layers a mapping makes, gaps included: a few tensors
// far apart cannot make millions of empty layers. A file problem
// (LWO_ERR_BAD_RANGE), and the index as the name spells it.
TEST(SafetensorsLayers, LayerIndicesAboveTheLimitAreRefused) {
  // Many gaps of at most 2^20 each.
  std::vector<Entry> far;
  for (uint64_t k = 0; k < 8; ++k) far.push_back(entry("blocks." + std::to_string(k << 20) + ".w", 4 * k));
  expect_error([&] { map_by_pattern(far, "blocks.{i}.", "lwo info m.safetensors", true); },
               LWO_ERR_BAD_RANGE,
               {"lwo info m.safetensors", "\"blocks.1048576.w\"", "layer index 1048576",
                "beyond the 1048576 layers"});
  // An index beyond 64 bits: spelled as written, not saturated.
  expect_error(
      [] {
        map_by_pattern({entry("h.0.w", 0), entry("h.99999999999999999999999999.w", 4)}, "h.{i}.",
                       "w", true);
      },
      LWO_ERR_BAD_RANGE, {"layer index 99999999999999999999999999 "});
  try {
    map_by_pattern({entry("h.0.w", 0), entry("h.99999999999999999999999999.w", 4)}, "h.{i}.", "w",
                   true);
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("18446744073709551615"), std::string::npos) << e.what();
  }
  // The last index below the limit still maps.
  LayerMap m = map_by_pattern({entry("h.0.w", 0), entry("h.1048575.w", 4)}, "h.{i}.", "w", true);
  EXPECT_EQ(m.layers.size(), size_t(1) << 20);
}

TEST(SafetensorsLayers, PatternOverAParsedFile) {
  const std::string h = R"({"blocks.1.w":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]},)"
                        R"("blocks.0.b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},)"
                        R"("blocks.0.w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                        R"("norm":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})";
  std::vector<Entry> es = parse(file_of(h, 16));
  LayerMap m = map_by_pattern(es, "blocks.{i}.", kFile);
  ASSERT_EQ(m.layers.size(), 2u);
  EXPECT_EQ(names_of(es, m.layers[0]), (std::vector<std::string>{"blocks.0.w", "blocks.0.b"}));
  EXPECT_EQ(names_of(es, m.layers[1]), std::vector<std::string>{"blocks.1.w"});
  EXPECT_EQ(names_of(es, m.unmatched), std::vector<std::string>{"norm"});
}

TEST(SafetensorsLayers, NamesKeepTheCallersOrder) {
  const std::vector<Entry> es = {entry("a", 0), entry("b", 4), entry("c", 8), entry("d", 12),
                                 entry("e", 0, 1)};
  LayerMap m = map_by_names(es, {{"c", "a"}, {}, {"e", "b"}}, "test");
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[0], (std::vector<size_t>{2, 0}));
  EXPECT_TRUE(m.layers[1].empty());
  EXPECT_EQ(m.layers[2], (std::vector<size_t>{4, 1}));
  EXPECT_EQ(m.unmatched, std::vector<size_t>{3});
  m = map_by_names(es, {}, "test");
  EXPECT_TRUE(m.layers.empty());
  EXPECT_EQ(m.unmatched.size(), 5u);
}

TEST(SafetensorsLayers, NamesErrors) {
  const std::vector<Entry> es = {entry("a", 0), entry("b", 4), entry("dup", 8),
                                 entry("dup", 0, 3)};
  expect_error([&] { map_by_names(es, {{"a"}, {"b", "zz"}}, "lwo_pool_create_safetensors"); },
               LWO_ERR_NOT_FOUND,
               {"lwo_pool_create_safetensors", "layer 1", "\"zz\"", "not in the checkpoint"});
  expect_error([&] { map_by_names(es, {{"a", "b", "a"}}, "w"); }, LWO_ERR_INVALID_ARGUMENT,
               {"layer 0 names tensor \"a\" twice"});
  expect_error([&] { map_by_names(es, {{"a"}, {"b"}, {"a"}}, "w"); }, LWO_ERR_INVALID_ARGUMENT,
               {"tensor \"a\" is named by layer 0 and by layer 2"});
  expect_error([&] { map_by_names(es, {{"dup"}}, "w"); }, LWO_ERR_INVALID_ARGUMENT,
               {"\"dup\"", "more than once", "files 0 and 3"});
}

// ---------------------------------------------------------------------------
// Index files
// ---------------------------------------------------------------------------

TEST(SafetensorsIndex, ParsesWeightMap) {
  const std::string text = R"({
    "metadata": {"total_size": 123456, "nested": {"x": [1, {"y": null}]}},
    "weight_map": {
      "model.embed.weight": "model-00001-of-00002.safetensors",
      "model.layers.0.w": "model-00001-of-00002.safetensors",
      "lm_head.weight": "shards/model-00002-of-00002.safetensors",
      "odd": "a..b.safetensors"
    },
    "extra": [1, 2, 3]
  })";
  std::map<std::string, std::string> m = parse_index(text, "m.safetensors.index.json");
  EXPECT_EQ(m, (std::map<std::string, std::string>{
                   {"model.embed.weight", "model-00001-of-00002.safetensors"},
                   {"model.layers.0.w", "model-00001-of-00002.safetensors"},
                   {"lm_head.weight", "shards/model-00002-of-00002.safetensors"},
                   {"odd", "a..b.safetensors"}}));
  EXPECT_TRUE(parse_index(R"({"weight_map":{}})", "i").empty());
}

TEST(SafetensorsIndex, RejectsBadIndexes) {
  const char* const name = "dir/m.safetensors.index.json";
  struct C {
    std::string text;
    std::vector<std::string> parts;
  };
  const std::vector<C> cases = {
      {"", {"not valid JSON"}},
      {"{", {"not valid JSON"}},
      {R"({"weight_map":{"a":"f"}} x)", {"not valid JSON"}},
      {"[]", {"index is an array, not a JSON object"}},
      {R"("weight_map")", {"index is a string"}},
      {R"({})", {"no \"weight_map\""}},
      {R"({"metadata":{"weight_map":{}}})", {"no \"weight_map\""}},
      {R"({"weight_map":[]})", {"weight_map is an array"}},
      {R"({"weight_map":"x"})", {"weight_map is a string \"x\""}},
      {R"({"weight_map":null})", {"weight_map is null"}},
      {R"({"weight_map":{"a":1}})", {"tensor \"a\" maps to the number 1"}},
      {R"({"weight_map":{"a":{}}})", {"tensor \"a\" maps to an object"}},
      {R"({"weight_map":{"a":["f"]}})", {"tensor \"a\" maps to an array"}},
      {R"({"weight_map":{"a":"f","a":"g"}})", {"tensor \"a\" appears twice"}},
      {R"({"weight_map":{},"weight_map":{}})", {"\"weight_map\" appears twice"}},
      {R"({"metadata":{"k":1,"k":2},"weight_map":{}})", {"\"k\" appears twice"}},
      {R"({"weight_map":{"a":""}})", {"tensor \"a\"", "is empty"}},
      {R"({"weight_map":{"a":"/etc/passwd"}})", {"\"/etc/passwd\"", "absolute"}},
      {R"({"weight_map":{"a":"../m.safetensors"}})", {"\"../m.safetensors\"", ".."}},
      {R"({"weight_map":{"a":"x/../../m"}})", {".."}},
      {R"({"weight_map":{"a":"x/.."}})", {".."}},
      {R"({"weight_map":{"a":"f\u0000"}})", {"NUL"}},
      {R"({"weight_map":{"a\u0000":"f"}})", {"NUL"}},
      {"{\"weight_map\":{\"a\":\"\xff\"}}", {"not valid JSON"}},
      {std::string("{\"weight_map\":{\"a\":\"f\"}}\0garbage", 32), {"not valid JSON", "NUL byte"}},
      {std::string("{\"weight_map\":{}}\0", 18), {"byte 17", "NUL byte"}},
  };
  for (const C& c : cases) {
    SCOPED_TRACE(c.text);
    std::vector<std::string> parts = c.parts;
    parts.insert(parts.begin(), name);
    expect_error([&] { parse_index(c.text, name); }, LWO_ERR_BAD_JSON, parts);
  }
}

}  // namespace
}  // namespace st
}  // namespace lwo
