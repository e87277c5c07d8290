#include "safetensors.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <limits>
#include <set>
#include <unordered_map>
#include <utility>

#include <nlohmann/json.hpp>

#include "src/common/error.h"
#include "src/common/utf8.h"

namespace lwo {
namespace st {

namespace {

using json = nlohmann::json;

struct DtypeInfo {
  const char* name;
  size_t size;
  lwo_dtype_t dtype;
};

// Every dtype safetensors defines with a whole number of bytes per element,
// each an lwo dtype: pools stream them all as bytes.
constexpr DtypeInfo kDtypes[] = {
    {"BOOL", 1, LWO_DTYPE_BOOL},
    {"U8", 1, LWO_DTYPE_U8},
    {"I8", 1, LWO_DTYPE_I8},
    {"F8_E5M2", 1, LWO_DTYPE_F8_E5M2},
    {"F8_E4M3", 1, LWO_DTYPE_F8_E4M3},
    {"F8_E8M0", 1, LWO_DTYPE_F8_E8M0},
    {"I16", 2, LWO_DTYPE_I16},
    {"U16", 2, LWO_DTYPE_U16},
    {"F16", 2, LWO_DTYPE_F16},
    {"BF16", 2, LWO_DTYPE_BF16},
    {"I32", 4, LWO_DTYPE_I32},
    {"U32", 4, LWO_DTYPE_U32},
    {"F32", 4, LWO_DTYPE_F32},
    {"F64", 8, LWO_DTYPE_F64},
    {"I64", 8, LWO_DTYPE_I64},
    {"U64", 8, LWO_DTYPE_U64},
    {"C64", 8, LWO_DTYPE_C64},
};

const DtypeInfo* find_dtype(const std::string& name) {
  for (const DtypeInfo& d : kDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

std::string known_dtypes() {
  std::string s;
  for (const DtypeInfo& d : kDtypes) {
    if (!s.empty()) s += ' ';
    s += d.name;
  }
  return s;
}

unsigned long long ull(uint64_t v) { return static_cast<unsigned long long>(v); }


// Printable ASCII only: for text that may hold anything (nlohmann's messages
// quote the bytes they choked on).
std::string ascii(const std::string& s, size_t max = 240) {
  std::string out;
  for (size_t i = 0; i < s.size() && out.size() < max; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else {
      out += strf("\\x%02x", c);
    }
  }
  if (out.size() >= max) out += "...";
  return out;
}

// The JSON value kinds, for messages ("shape[1] is a string").
std::string num_text(const std::string& raw) { return "the number " + ascii(raw, 40); }

// ---------------------------------------------------------------------------
// SAX handler shared by the header and the index: grammar errors and
// duplicate keys (at any depth) become LWO_ERR_BAD_JSON. Subclasses get typed
// events.
// ---------------------------------------------------------------------------
class Sax : public nlohmann::json_sax<json> {
 public:
  explicit Sax(std::string what) : what_(std::move(what)) {}

  bool parse_error(std::size_t position, const std::string& last_token,
                   const nlohmann::json::exception& ex) override {
    // nlohmann's text: "[json.exception.parse_error.101] parse error at line 1,
    // column 7: syntax error while parsing value - invalid literal; last read: ..."
    std::string text = ex.what();
    const std::string tag = "] ";
    size_t p = text.find(tag);
    if (text.compare(0, 16, "[json.exception.") == 0 && p != std::string::npos)
      text = text.substr(p + tag.size());
    fail(LWO_ERR_BAD_JSON, "%s is not valid JSON (byte %zu of the JSON text): %s", what_.c_str(),
         position, ascii(text).c_str());
  }
  bool binary(binary_t&) override { fail(LWO_ERR_BAD_JSON, "%s: unexpected binary value", what_.c_str()); }

  bool start_object(std::size_t) override {
    keys_.emplace_back();
    on_object_start();
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    on_object_end();
    return true;
  }
  bool key(string_t& k) override {
    if (!keys_.back().insert(k).second) on_duplicate_key(k);
    on_key(k);
    return true;
  }
  bool start_array(std::size_t) override {
    on_array_start();
    return true;
  }
  bool end_array() override {
    on_array_end();
    return true;
  }
  bool null() override {
    on_scalar("null");
    return true;
  }
  bool boolean(bool v) override {
    on_scalar(v ? "true" : "false");
    return true;
  }
  bool number_integer(number_integer_t v) override {
    if (v >= 0) {
      on_uint(static_cast<uint64_t>(v), std::to_string(v));
    } else {
      on_scalar("the number " + std::to_string(v));
    }
    return true;
  }
  bool number_unsigned(number_unsigned_t v) override {
    on_uint(v, std::to_string(v));
    return true;
  }
  bool number_float(number_float_t, const string_t& raw) override {
    // An integer literal too large for 64 bits arrives here too.
    bool integral = raw.find_first_of(".eE") == std::string::npos;
    if (integral && !raw.empty() && raw[0] != '-') {
      on_huge_uint(raw);
    } else {
      on_scalar(num_text(raw));
    }
    return true;
  }
  bool string(string_t& v) override {
    on_string(v);
    return true;
  }

  void run(const char* begin, const char* end) {
    // nlohmann's lexer takes a NUL byte for the end of the input, so
    // `{...}\0garbage` would pass; a raw NUL is never valid JSON (inside a
    // string it must be written \u0000), so it is refused first.
    if (const void* nul = std::memchr(begin, '\0', static_cast<size_t>(end - begin)))
      fail(LWO_ERR_BAD_JSON,
           "%s is not valid JSON (byte %zu of the JSON text): a NUL byte (the reference "
           "safetensors implementation refuses it too)",
           what_.c_str(), static_cast<size_t>(static_cast<const char*>(nul) - begin));
    // Every handler either returns true or throws.
    if (!json::sax_parse(begin, end, this, nlohmann::json::input_format_t::json, true, false))
      fail(LWO_ERR_INTERNAL, "%s: the JSON parser stopped without a reason", what_.c_str());
  }

 protected:
  virtual void on_object_start() = 0;
  virtual void on_object_end() = 0;
  virtual void on_key(const std::string& k) = 0;
  virtual void on_duplicate_key(const std::string& k) = 0;
  virtual void on_array_start() = 0;
  virtual void on_array_end() = 0;
  virtual void on_scalar(const std::string& text) = 0;  // null, bool, negative, float
  virtual void on_uint(uint64_t v, const std::string& text) = 0;
  virtual void on_huge_uint(const std::string& raw) = 0;
  virtual void on_string(const std::string& v) = 0;

  std::string what_;
  std::vector<std::set<std::string>> keys_;
};

// ---------------------------------------------------------------------------
// The header
// ---------------------------------------------------------------------------
struct Raw {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::string huge_dim;  // a dimension beyond 64 bits, as written
  size_t huge_dim_at = 0;
  uint64_t offsets[2] = {0, 0};
  size_t n_offsets = 0;
  std::string huge_offset;  // an offset beyond 64 bits, as written
};

class HeaderSax final : public Sax {
 public:
  HeaderSax(const std::string& file, std::map<std::string, std::string>* metadata)
      : Sax(file + ": header"), file_(file), metadata_(metadata) {}

  std::vector<Raw> tensors;

 private:
  enum class S { kStart, kRoot, kRootValue, kTensor, kField, kArray, kMeta, kMetaValue, kEnd };
  enum class F { kDtype, kShape, kOffsets };

  const char* field_name() const {
    return field_ == F::kDtype ? "dtype" : field_ == F::kShape ? "shape" : "data_offsets";
  }
  std::string tq() const { return printable(cur_.name); }

  [[noreturn]] void bad_value(const std::string& got) {
    switch (state_) {
      case S::kStart:
        fail(LWO_ERR_BAD_JSON, "%s: header is %s, not a JSON object", file_.c_str(), got.c_str());
      case S::kRootValue:
        if (cur_.name == "__metadata__")
          fail(LWO_ERR_BAD_JSON, "%s: header: __metadata__ is %s, not an object of strings",
               file_.c_str(), got.c_str());
        fail(LWO_ERR_BAD_JSON,
             "%s: tensor %s: entry is %s, not an object with dtype, shape and data_offsets",
             file_.c_str(), tq().c_str(), got.c_str());
      case S::kField:
        fail(LWO_ERR_BAD_JSON, "%s: tensor %s: %s is %s, not %s", file_.c_str(), tq().c_str(),
             field_name(), got.c_str(),
             field_ == F::kDtype ? "a string"
             : field_ == F::kShape ? "an array of non-negative integers"
                                   : "an array of 2 non-negative integers");
      case S::kArray:
        fail(LWO_ERR_BAD_JSON, "%s: tensor %s: %s[%zu] is %s, not a non-negative integer",
             file_.c_str(), tq().c_str(), field_name(), array_len_, got.c_str());
      case S::kMetaValue:
        fail(LWO_ERR_BAD_JSON, "%s: header: __metadata__ value of key %s is %s, not a string",
             file_.c_str(), printable(meta_key_).c_str(), got.c_str());
      default:
        fail(LWO_ERR_BAD_JSON, "%s: header: unexpected %s", file_.c_str(), got.c_str());
    }
  }

  void on_object_start() override {
    if (state_ == S::kStart) {
      state_ = S::kRoot;
    } else if (state_ == S::kRootValue) {
      state_ = cur_.name == "__metadata__" ? S::kMeta : S::kTensor;
    } else {
      bad_value("an object");
    }
  }
  void on_object_end() override {
    if (state_ == S::kRoot) {
      state_ = S::kEnd;
    } else if (state_ == S::kMeta) {
      state_ = S::kRoot;
    } else if (state_ == S::kTensor) {
      const char* missing = !has_dtype_ ? "dtype" : !has_shape_ ? "shape"
                          : !has_offsets_ ? "data_offsets" : nullptr;
      if (missing)
        fail(LWO_ERR_BAD_JSON, "%s: tensor %s: entry has no %s", file_.c_str(), tq().c_str(),
             missing);
      tensors.push_back(std::move(cur_));
      state_ = S::kRoot;
    }
  }
  void on_key(const std::string& k) override {
    if (state_ == S::kRoot) {
      if (k.find('\0') != std::string::npos)
        fail(LWO_ERR_BAD_JSON, "%s: tensor %s: the name holds a NUL character", file_.c_str(),
             printable(k).c_str());
      cur_ = Raw();
      cur_.name = k;
      has_dtype_ = has_shape_ = has_offsets_ = false;
      state_ = S::kRootValue;
    } else if (state_ == S::kTensor) {
      if (k == "dtype") {
        field_ = F::kDtype;
        has_dtype_ = true;
      } else if (k == "shape") {
        field_ = F::kShape;
        has_shape_ = true;
      } else if (k == "data_offsets") {
        field_ = F::kOffsets;
        has_offsets_ = true;
      } else {
        fail(LWO_ERR_BAD_JSON,
             "%s: tensor %s: unknown field %s (an entry has exactly dtype, shape and "
             "data_offsets)",
             file_.c_str(), tq().c_str(), printable(k).c_str());
      }
      state_ = S::kField;
    } else if (state_ == S::kMeta) {
      if (k.find('\0') != std::string::npos)
        fail(LWO_ERR_BAD_JSON, "%s: header: __metadata__ key %s holds a NUL character",
             file_.c_str(), printable(k).c_str());
      meta_key_ = k;
      state_ = S::kMetaValue;
    }
  }
  void on_duplicate_key(const std::string& k) override {
    if (state_ == S::kRoot)
      fail(LWO_ERR_BAD_JSON, "%s: tensor %s: the name appears twice in the header",
           file_.c_str(), printable(k).c_str());
    if (state_ == S::kTensor)
      fail(LWO_ERR_BAD_JSON, "%s: tensor %s: field %s appears twice", file_.c_str(),
           tq().c_str(), printable(k).c_str());
    fail(LWO_ERR_BAD_JSON, "%s: header: __metadata__ key %s appears twice", file_.c_str(),
         printable(k).c_str());
  }
  void on_array_start() override {
    if (state_ != S::kField || field_ == F::kDtype) bad_value("an array");
    state_ = S::kArray;
    array_len_ = 0;
  }
  void on_array_end() override {
    // Only reached in kArray: a nested array fails at its start.
    if (field_ == F::kOffsets && array_len_ != 2)
      fail(LWO_ERR_BAD_JSON, "%s: tensor %s: data_offsets has %zu values, not 2 (begin, end)",
           file_.c_str(), tq().c_str(), array_len_);
    state_ = S::kTensor;
  }
  void on_scalar(const std::string& text) override { bad_value(text); }
  void on_uint(uint64_t v, const std::string& text) override {
    if (state_ != S::kArray) bad_value("the number " + text);
    if (field_ == F::kShape) {
      cur_.shape.push_back(v);
    } else if (array_len_ < 2) {
      cur_.offsets[array_len_] = v;
    }
    ++array_len_;
  }
  void on_huge_uint(const std::string& raw) override {
    if (state_ != S::kArray) bad_value(num_text(raw));
    if (field_ == F::kShape) {
      if (cur_.huge_dim.empty()) {
        cur_.huge_dim = raw;
        cur_.huge_dim_at = array_len_;
      }
      cur_.shape.push_back(0);
    } else if (cur_.huge_offset.empty()) {
      cur_.huge_offset = raw;
    }
    ++array_len_;
  }
  void on_string(const std::string& v) override {
    if (state_ == S::kField && field_ == F::kDtype) {
      cur_.dtype = v;
      state_ = S::kTensor;
    } else if (state_ == S::kMetaValue) {
      if (v.find('\0') != std::string::npos)
        fail(LWO_ERR_BAD_JSON, "%s: header: __metadata__ value of key %s holds a NUL character",
             file_.c_str(), printable(meta_key_).c_str());
      if (metadata_) (*metadata_)[meta_key_] = v;
      state_ = S::kMeta;
    } else {
      bad_value("a string " + printable(v));
    }
  }

  std::string file_;
  std::map<std::string, std::string>* metadata_;
  S state_ = S::kStart;
  F field_ = F::kDtype;
  Raw cur_;
  bool has_dtype_ = false, has_shape_ = false, has_offsets_ = false;
  size_t array_len_ = 0;
  std::string meta_key_;
};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    if (i == 6 && shape.size() > 8) {
      s += strf("... (%zu dims)", shape.size());
      break;
    }
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Entry check_tensor(const Raw& r, const std::string& file, uint64_t data_start,
                   uint64_t data_size) {
  const char* f = file.c_str();
  std::string tq = printable(r.name);
  const char* t = tq.c_str();
  const DtypeInfo* d = find_dtype(r.dtype);
  if (!d)
    fail(LWO_ERR_BAD_DTYPE, "%s: tensor %s: unknown dtype %s (safetensors defines %s)", f, t,
         printable(r.dtype).c_str(), known_dtypes().c_str());
  Entry e;
  e.name = r.name;
  e.dtype_name = r.dtype;
  e.dtype = d->dtype;
  e.elem_size = d->size;
  e.file = 0;
  if (!r.huge_dim.empty())
    fail(LWO_ERR_SHAPE_OVERFLOW, "%s: tensor %s: shape[%zu] is %s, beyond 64 bits", f, t,
         r.huge_dim_at, ascii(r.huge_dim, 60).c_str());
  e.shape.reserve(r.shape.size());
  bool zero = false;
  for (size_t i = 0; i < r.shape.size(); ++i) {
    if (r.shape[i] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(LWO_ERR_SHAPE_OVERFLOW, "%s: tensor %s: shape[%zu] is %llu, above INT64_MAX", f, t,
           i, ull(r.shape[i]));
    e.shape.push_back(static_cast<int64_t>(r.shape[i]));
    if (r.shape[i] == 0) zero = true;
  }
  // A tensor with a dimension of 0 has 0 bytes whatever the others are.
  uint64_t bytes = zero ? 0 : d->size;
  for (size_t i = 0; !zero && i < r.shape.size(); ++i)
    if (__builtin_mul_overflow(bytes, r.shape[i], &bytes))
      fail(LWO_ERR_SHAPE_OVERFLOW,
           "%s: tensor %s: shape %s of %s (%zu bytes each) overflows 64-bit byte counts", f, t,
           shape_text(e.shape).c_str(), d->name, d->size);
  if (!r.huge_offset.empty())
    fail(LWO_ERR_BAD_RANGE, "%s: tensor %s: data_offsets holds %s, beyond 64 bits", f, t,
         ascii(r.huge_offset, 60).c_str());
  uint64_t b = r.offsets[0], en = r.offsets[1];
  if (b > en)
    fail(LWO_ERR_BAD_RANGE, "%s: tensor %s: data_offsets [%llu, %llu] begin after their end", f,
         t, ull(b), ull(en));
  if (en > data_size)
    fail(LWO_ERR_TRUNCATED,
         "%s: tensor %s: data_offsets [%llu, %llu] end beyond the data section of %llu bytes "
         "(the file is %llu bytes, it needs at least %llu: cut short?)",
         f, t, ull(b), ull(en), ull(data_size), ull(data_start + data_size),
         ull(data_start + en));
  if (en - b != bytes)
    fail(LWO_ERR_SHAPE_MISMATCH,
         "%s: tensor %s: shape %s of %s is %llu bytes, but data_offsets [%llu, %llu] span %llu",
         f, t, shape_text(e.shape).c_str(), d->name, ull(bytes), ull(b), ull(en), ull(en - b));
  e.begin = data_start + b;
  e.end = data_start + en;
  return e;
}

bool by_position(const Entry& a, const Entry& b) {
  if (a.file != b.file) return a.file < b.file;
  if (a.begin != b.begin) return a.begin < b.begin;
  if (a.end != b.end) return a.end < b.end;
  return a.name < b.name;
}

// ---------------------------------------------------------------------------
// The index
// ---------------------------------------------------------------------------
class IndexSax final : public Sax {
 public:
  explicit IndexSax(const std::string& index) : Sax(index), index_(index) {}

  std::map<std::string, std::string> map;
  bool have_map = false;

 private:
  // depth_: 0 outside everything, 1 in the root object, 2 in weight_map or in
  // some other value of the root, and so on.
  [[noreturn]] void bad(const std::string& got) {
    if (depth_ == 0)
      fail(LWO_ERR_BAD_JSON, "%s: the index is %s, not a JSON object", index_.c_str(),
           got.c_str());
    if (in_map_ && depth_ == 1)
      fail(LWO_ERR_BAD_JSON, "%s: weight_map is %s, not an object of file names", index_.c_str(),
           got.c_str());
    fail(LWO_ERR_BAD_JSON, "%s: weight_map: tensor %s maps to %s, not a file name",
         index_.c_str(), printable(key_).c_str(), got.c_str());
  }
  bool watching() const { return (in_map_ && depth_ <= 2) || depth_ == 0; }
  void value(const std::string& got) {
    if (watching()) bad(got);
  }

  void on_object_start() override {
    if (watching() && depth_ == 2) bad("an object");
    ++depth_;
  }
  void on_object_end() override {
    --depth_;
    if (depth_ == 1) in_map_ = false;
  }
  void on_key(const std::string& k) override {
    if (depth_ == 1) {
      in_map_ = k == "weight_map";
      if (in_map_) have_map = true;
    } else if (in_map_ && depth_ == 2) {
      if (k.find('\0') != std::string::npos)
        fail(LWO_ERR_BAD_JSON, "%s: weight_map: tensor %s: the name holds a NUL character",
             index_.c_str(), printable(k).c_str());
      key_ = k;
    }
  }
  void on_duplicate_key(const std::string& k) override {
    if (in_map_ && depth_ == 2)
      fail(LWO_ERR_BAD_JSON, "%s: weight_map: tensor %s appears twice", index_.c_str(),
           printable(k).c_str());
    fail(LWO_ERR_BAD_JSON, "%s: key %s appears twice in one object", index_.c_str(),
         printable(k).c_str());
  }
  void on_array_start() override {
    value("an array");
    ++depth_;
  }
  void on_array_end() override { --depth_; }
  void on_scalar(const std::string& text) override { value(text); }
  void on_uint(uint64_t, const std::string& text) override { value("the number " + text); }
  void on_huge_uint(const std::string& raw) override { value(num_text(raw)); }
  void on_string(const std::string& v) override {
    if (depth_ == 0 || (in_map_ && depth_ == 1)) bad("a string " + printable(v));
    if (!(in_map_ && depth_ == 2)) return;
    const char* problem = nullptr;
    if (v.empty()) {
      problem = "is empty";
    } else if (v.find('\0') != std::string::npos) {
      problem = "holds a NUL character";
    } else if (v[0] == '/') {
      problem = "is absolute (it must be relative to the index's folder)";
    } else {
      size_t p = 0;
      while (p <= v.size()) {
        size_t q = v.find('/', p);
        if (q == std::string::npos) q = v.size();
        if (v.compare(p, q - p, "..") == 0) {
          problem = "has a \"..\" component (it must stay in the index's folder)";
          break;
        }
        p = q + 1;
      }
    }
    if (problem)
      fail(LWO_ERR_BAD_JSON, "%s: weight_map: tensor %s: shard file %s %s", index_.c_str(),
           printable(key_).c_str(), printable(v).c_str(), problem);
    map[key_] = v;
  }

  std::string index_;
  int depth_ = 0;
  bool in_map_ = false;
  std::string key_;
};

// A decimal index at name[pos..): the digits, without a leading zero unless
// "0". Returns the number of digits (0: none or a leading zero).
size_t scan_index(const std::string& name, size_t pos, uint64_t* value) {
  size_t n = 0;
  while (pos + n < name.size() && name[pos + n] >= '0' && name[pos + n] <= '9') ++n;
  if (n == 0 || (n > 1 && name[pos] == '0')) return 0;
  uint64_t v = 0;
  for (size_t k = 0; k < n; ++k) {
    unsigned digit = static_cast<unsigned>(name[pos + k] - '0');
    if (__builtin_mul_overflow(v, UINT64_C(10), &v) || __builtin_add_overflow(v, digit, &v)) {
      v = std::numeric_limits<uint64_t>::max();
      break;
    }
  }
  *value = v;
  return n;
}

}  // namespace

std::string printable(const std::string& s, char quote) {
  constexpr size_t kMax = 160;
  std::string out(1, quote);
  const size_t i = escape_into(s, kMax, out, quote);
  out += quote;
  if (i < s.size()) out += strf("... (%zu bytes)", s.size());
  return out;
}

std::vector<Entry> parse_header(const uint8_t* data, uint64_t file_size,
                                const std::string& file_name,
                                std::map<std::string, std::string>* metadata) {
  const char* f = file_name.c_str();
  if (metadata) metadata->clear();
  if (!data && file_size > 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: data is NULL with a size of %llu bytes", f,
         ull(file_size));
  if (file_size < 8)
    fail(LWO_ERR_TRUNCATED,
         "%s: the file is %llu bytes, shorter than the 8-byte header length of a safetensors "
         "file",
         f, ull(file_size));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  if (n == 0)
    fail(LWO_ERR_BAD_HEADER_SIZE, "%s: the header length is 0 (a header is at least \"{}\")", f);
  if (n > kMaxHeaderBytes)
    fail(LWO_ERR_BAD_HEADER_SIZE, "%s: the header length is %llu bytes, above the limit of %llu",
         f, ull(n), ull(kMaxHeaderBytes));
  if (n > file_size - 8)
    fail(LWO_ERR_BAD_HEADER_SIZE,
         "%s: the header length is %llu bytes, but the file holds only %llu after the length "
         "(%llu bytes in all)",
         f, ull(n), ull(file_size - 8), ull(file_size));

  std::map<std::string, std::string> meta;
  HeaderSax sax(file_name, &meta);
  const char* text = reinterpret_cast<const char*>(data + 8);
  sax.run(text, text + n);

  const uint64_t data_start = 8 + n;
  const uint64_t data_size = file_size - data_start;
  std::vector<Entry> out;
  out.reserve(sax.tensors.size());
  for (const Raw& r : sax.tensors) out.push_back(check_tensor(r, file_name, data_start, data_size));
  std::sort(out.begin(), out.end(), by_position);

  // Sorted by begin, a tensor overlaps an earlier one exactly when it begins
  // before the furthest end so far; tensors of 0 bytes take no room.
  const Entry* reach = nullptr;
  for (const Entry& e : out) {
    if (e.begin == e.end) continue;
    if (reach && e.begin < reach->end)
      fail(LWO_ERR_OVERLAP,
           "%s: tensors %s (bytes [%llu, %llu) of the file) and %s (bytes [%llu, %llu)) overlap",
           f, printable(reach->name).c_str(), ull(reach->begin), ull(reach->end),
           printable(e.name).c_str(), ull(e.begin), ull(e.end));
    if (!reach || e.end > reach->end) reach = &e;
  }
  if (metadata) *metadata = std::move(meta);
  return out;
}

std::map<std::string, std::string> parse_index(const std::string& text,
                                               const std::string& index_name) {
  IndexSax sax(index_name);
  sax.run(text.data(), text.data() + text.size());
  if (!sax.have_map)
    fail(LWO_ERR_BAD_JSON, "%s: the index has no \"weight_map\" (tensor name -> shard file)",
         index_name.c_str());
  return std::move(sax.map);
}

LayerMap map_by_pattern(const std::vector<Entry>& entries, const std::string& pattern,
                        const std::string& where, bool allow_gaps) {
  const char* w = where.c_str();
  const std::string mark = "{i}";
  size_t at = pattern.find(mark);
  if (at == std::string::npos || pattern.find(mark, at + 1) != std::string::npos)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: layer pattern %s must hold \"{i}\" exactly once", w,
         printable(pattern).c_str());
  const std::string prefix = pattern.substr(0, at), suffix = pattern.substr(at + mark.size());

  LayerMap m;
  std::vector<std::pair<uint64_t, size_t>> hits;  // (layer, entry)
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string& name = entries[i].name;
    uint64_t layer = 0;
    size_t digits = 0;
    if (name.compare(0, prefix.size(), prefix) == 0)
      digits = scan_index(name, prefix.size(), &layer);
    if (digits && name.compare(prefix.size() + digits, suffix.size(), suffix) == 0) {
      hits.emplace_back(layer, i);
    } else {
      m.unmatched.push_back(i);
    }
  }
  if (hits.empty())
    fail(LWO_ERR_NOT_FOUND, "%s: no tensor matches the layer pattern %s (of %zu tensors)", w,
         printable(pattern).c_str(), entries.size());

  std::sort(hits.begin(), hits.end(), [&](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first < b.first;
    return by_position(entries[a.second], entries[b.second]);
  });
  // Layers 0..max: each index must appear, so the k-th distinct one is k
  // (with allow_gaps, a missing index is an empty layer). No index at or
  // above kMaxLayers makes a layer, so a stray huge index (or many indices
  // far apart) cannot allocate without bound.
  uint64_t expect = 0;
  for (const auto& h : hits) {
    if (h.first >= kMaxLayers && (h.first == expect || (allow_gaps && h.first > expect))) {
      const std::string& name = entries[h.second].name;
      uint64_t ignored = 0;
      size_t nd = scan_index(name, prefix.size(), &ignored);
      fail(LWO_ERR_BAD_RANGE,
           "%s: tensor %s has layer index %s under the pattern %s, beyond the %llu layers a "
           "mapping may make (empty layers of gaps included)",
           w, printable(name).c_str(), name.substr(prefix.size(), nd).c_str(),
           printable(pattern).c_str(), ull(kMaxLayers));
    }
    if (allow_gaps && h.first > expect) {
      while (expect < h.first) {
        m.layers.emplace_back();
        ++expect;
      }
    }
    if (h.first == expect) {
      m.layers.emplace_back();
      ++expect;
    } else if (expect == 0 || h.first != expect - 1) {
      const Entry& last = entries[hits.back().second];
      uint64_t top = 0;
      size_t nd = scan_index(last.name, prefix.size(), &top);
      fail(LWO_ERR_NOT_FOUND,
           "%s: layer %llu has no tensor matching the pattern %s, but layers up to %s do (%s)", w,
           ull(expect), printable(pattern).c_str(), last.name.substr(prefix.size(), nd).c_str(),
           printable(last.name).c_str());
    }
    m.layers.back().push_back(h.second);
  }
  return m;
}

LayerMap map_by_names(const std::vector<Entry>& entries,
                      const std::vector<std::vector<std::string>>& names,
                      const std::string& where) {
  const char* w = where.c_str();
  // name -> entry, or kSeveral if several entries have the name.
  constexpr size_t kSeveral = std::numeric_limits<size_t>::max();
  constexpr size_t kNone = std::numeric_limits<size_t>::max();
  std::unordered_map<std::string, size_t> index;
  index.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    auto r = index.emplace(entries[i].name, i);
    if (!r.second) r.first->second = kSeveral;
  }
  LayerMap m;
  m.layers.resize(names.size());
  std::vector<size_t> owner(entries.size(), kNone);  // the layer using each entry
  for (size_t l = 0; l < names.size(); ++l) {
    for (const std::string& name : names[l]) {
      auto it = index.find(name);
      if (it == index.end())
        fail(LWO_ERR_NOT_FOUND, "%s: layer %zu: tensor %s is not in the checkpoint", w, l,
             printable(name).c_str());
      if (it->second == kSeveral) {
        std::vector<uint32_t> files;
        for (const Entry& e : entries)
          if (e.name == name) files.push_back(e.file);
        fail(LWO_ERR_INVALID_ARGUMENT,
             "%s: layer %zu: tensor %s is in the checkpoint more than once (files %u and %u)", w,
             l, printable(name).c_str(), files[0], files[1]);
      }
      size_t i = it->second;
      if (owner[i] != kNone) {
        if (owner[i] == l)
          fail(LWO_ERR_INVALID_ARGUMENT, "%s: layer %zu names tensor %s twice", w, l,
               printable(name).c_str());
        fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensor %s is named by layer %zu and by layer %zu", w,
             printable(name).c_str(), owner[i], l);
      }
      owner[i] = l;
      m.layers[l].push_back(i);
    }
  }
  for (size_t i = 0; i < entries.size(); ++i)
    if (owner[i] == kNone) m.unmatched.push_back(i);
  return m;
}

namespace {
std::string shape_str(const std::vector<int64_t>& shape) {
  std::string t = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    t += strf("%s%lld", i ? ", " : "", static_cast<long long>(shape[i]));
  return t + "]";
}
}  // namespace

std::vector<ScalePair> find_scale_pairs(const std::vector<Entry>& entries,
                                        const std::vector<size_t>& layer, ScaleShape scale_shape,
                                        const std::string& where) {
  std::vector<ScalePair> pairs;
  std::unordered_map<std::string, size_t> by_name;
  for (size_t j = 0; j < layer.size(); ++j) by_name.emplace(entries[layer[j]].name, j);
  for (size_t j = 0; j < layer.size(); ++j) {
    const Entry& w = entries[layer[j]];
    if (w.dtype != LWO_DTYPE_F8_E4M3) continue;
    auto it = by_name.find(w.name + kScaleSuffix);
    if (it == by_name.end()) continue;
    const Entry& sc = entries[layer[it->second]];
    if (w.shape.size() != 2 || w.shape[0] < 1 || w.shape[1] < 1)
      fail(LWO_ERR_SHAPE_MISMATCH,
           "%s: fp8 tensor %s %s has scales %s beside it, but a block-quantized weight "
           "is 2-D [rows, cols] of at least one element (it has %zu dimensions)",
           printable(where, '\'').c_str(), printable(w.name, '\'').c_str(),
           shape_str(w.shape).c_str(), printable(sc.name, '\'').c_str(),
           w.shape.size());
    const int64_t kMax = int64_t(1) << 31;
    if (w.shape[0] >= kMax || w.shape[1] >= kMax)
      fail(LWO_ERR_SHAPE_OVERFLOW,
           "%s: fp8 tensor %s %s with scales %s: rows and cols must be below 2^31",
           printable(where, '\'').c_str(), printable(w.name, '\'').c_str(),
           shape_str(w.shape).c_str(), printable(sc.name, '\'').c_str());
    if (sc.dtype != LWO_DTYPE_F32)
      fail(LWO_ERR_BAD_DTYPE, "%s: scales %s of fp8 tensor %s are %s (must be F32)",
           printable(where, '\'').c_str(), printable(sc.name, '\'').c_str(),
           printable(w.name, '\'').c_str(), sc.dtype_name.c_str());
    const std::pair<int64_t, int64_t> want = scale_shape(w.shape[0], w.shape[1]);
    if (sc.shape.size() != 2 || sc.shape[0] != want.first || sc.shape[1] != want.second)
      fail(LWO_ERR_SHAPE_MISMATCH,
           "%s: scales %s of fp8 tensor %s %s must be [%lld, %lld] (one per 128 x 128 "
           "block), not %s",
           printable(where, '\'').c_str(), printable(sc.name, '\'').c_str(),
           printable(w.name, '\'').c_str(), shape_str(w.shape).c_str(),
           static_cast<long long>(want.first), static_cast<long long>(want.second),
           shape_str(sc.shape).c_str());
    pairs.push_back({j, it->second});
  }
  return pairs;
}

}  // namespace st
}  // namespace lwo
