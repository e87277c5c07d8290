// Extension chains (`next` pointers of descriptor arrays, see lwo.h).
#pragma once

#include <string>

#include "error.h"
#include "lwo.h"

namespace lwo {

// Throws LWO_ERR_UNSUPPORTED if `next` starts a chain: this version defines
// no extension types. `where` names the descriptor for the message.
inline void check_no_extensions(const void* next, const std::string& where) {
  if (next)
    fail(LWO_ERR_UNSUPPORTED,
         "%s: extension struct of type %d in its next chain is unknown to lwo %d.%d.%d", where.c_str(),
         static_cast<const lwo_ext*>(next)->type, LWO_VERSION_MAJOR, LWO_VERSION_MINOR,
         LWO_VERSION_PATCH);
}

}  // namespace lwo
