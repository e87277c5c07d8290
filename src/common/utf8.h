// UTF-8 validation and the one escaping rule for names and messages (the
// checkpoint parser's and the lwo program's). Header-only, so the program
// uses the same rule without linking the library's internals.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>

namespace lwo {

// Length of the valid UTF-8 sequence starting at s[i], or 0 (ASCII bytes
// included: the callers handle those first).
inline size_t utf8_len(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char c = b(i);
  size_t n;
  unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (b(i + k) < 0x80 || b(i + k) > 0xBF) return 0;
  return n;
}

// C1 control characters (U+0080..U+009F) are two bytes, C2 80..C2 9F.
inline bool is_c1(const std::string& s, size_t i, size_t n) {
  return n == 2 && static_cast<unsigned char>(s[i]) == 0xC2 &&
         static_cast<unsigned char>(s[i + 1]) <= 0x9F;
}

// Appends the escaped form of s (at most `max` input bytes) to out: `quote`
// ('"' by default) and '\\' get a backslash, printable ASCII and valid UTF-8
// (but C1 controls) stay, every other byte becomes \xHH. Returns the input
// bytes used.
inline size_t escape_into(const std::string& s, size_t max, std::string& out,
                          char quote = '"') {
  size_t i = 0;
  while (i < s.size() && i < max) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == static_cast<unsigned char>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
      ++i;
    } else if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
      ++i;
    } else if (size_t n = c >= 0x80 ? utf8_len(s, i) : 0; n && !is_c1(s, i, n)) {
      out.append(s, i, n);
      i += n;
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
      ++i;
    }
  }
  return i;
}

}  // namespace lwo
