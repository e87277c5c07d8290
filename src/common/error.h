// Errors inside the library: thrown as lwo::Error, turned into a status and a
// per-thread message at the C ABI (bindings/c/abi.h: guard). Nothing else escapes.
#pragma once

#include <cstdarg>
#include <exception>
#include <string>

#include "lwo.h"

namespace lwo {

class Error : public std::exception {
 public:
  Error(lwo_status_t status, std::string message)
      : status_(status), message_(std::move(message)) {}
  lwo_status_t status() const noexcept { return status_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  lwo_status_t status_;
  std::string message_;
};

// printf-style formatting into a std::string.
std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string vstrf(const char* fmt, va_list ap);

// Throws Error(status, formatted message).
[[noreturn]] void fail(lwo_status_t status, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));

}  // namespace lwo
