// Extension chains (`next` pointers of descriptor arrays, see lwo.h): the one
// walker every descriptor's chain goes through. Each descriptor says which
// types it accepts; an unknown type, or a known one where it does not
// belong, is LWO_ERR_UNSUPPORTED naming it; a type twice, a nonzero
// reserved word or a chain longer than kMaxExtensions links (a loop) is
// LWO_ERR_INVALID_ARGUMENT.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "error.h"
#include "lwo.h"

namespace lwo {

constexpr int kMaxExtensions = 64;

// Walks `next`, calling on(const lwo_ext&) for each link whose type is one
// of `allowed`. `where` names the descriptor for the messages.
template <class F>
void walk_extensions(const void* next, const std::string& where,
                     std::initializer_list<int32_t> allowed, F&& on) {
  uint64_t seen = 0;  // bit t: type t (1..63) met already
  int n = 0;
  for (const lwo_ext* e = static_cast<const lwo_ext*>(next); e;
       e = static_cast<const lwo_ext*>(e->next)) {
    if (++n > kMaxExtensions)
      fail(LWO_ERR_INVALID_ARGUMENT,
           "%s: its next chain has more than %d extension structs (a loop?)", where.c_str(),
           kMaxExtensions);
    bool ok = false;
    for (int32_t t : allowed) ok = ok || t == e->type;
    if (!ok)
      fail(LWO_ERR_UNSUPPORTED,
           "%s: extension struct of type %d in its next chain is unknown to lwo %d.%d.%d",
           where.c_str(), e->type, LWO_VERSION_MAJOR, LWO_VERSION_MINOR, LWO_VERSION_PATCH);
    if (e->reserved != 0)
      fail(LWO_ERR_INVALID_ARGUMENT,
           "%s: extension struct of type %d has reserved %u (must be 0)", where.c_str(), e->type,
           e->reserved);
    if (e->type > 0 && e->type < 64) {
      const uint64_t bit = uint64_t(1) << e->type;
      if (seen & bit)
        fail(LWO_ERR_INVALID_ARGUMENT,
             "%s: extension struct of type %d appears twice in its next chain", where.c_str(),
             e->type);
      seen |= bit;
    }
    on(*e);
  }
}

// A descriptor that accepts no extension type (lwo_layer_desc,
// lwo_host_region).
inline void check_no_extensions(const void* next, const std::string& where) {
  walk_extensions(next, where, {}, [](const lwo_ext&) {});
}

}  // namespace lwo
