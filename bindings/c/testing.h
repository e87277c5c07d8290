// Hooks for tests linked against the static library: build C API handles over
// a backend of the test's choosing (for example a recording one, with no GPU).
#pragma once

#include <memory>
#include <vector>

#include "engine/backend.h"
#include "lwo.h"

namespace lwo {
class Ring;
namespace testing {

// Creates an engine handle over `backend` (device ordinal `device`); it is
// registered like any other and destroyed with lwo_engine_destroy.
lwo_status_t engine_create(std::unique_ptr<Backend> backend, int device, lwo_engine** engine);
// The backend of an engine handle (the one passed to engine_create).
Backend* engine_backend(lwo_engine* engine);
// Turns the collective check (LWO_ENGINE_CHECK_COLLECTIVES) on or off.
void engine_set_check_collectives(lwo_engine* engine, bool on);
// Turns checking mode (LWO_ENGINE_CHECKING) on or off for rings and gradient
// sets created from now on.
void engine_set_checking(lwo_engine* engine, bool on);
// The layers of an optimizer's last step in the order it updated them.
std::vector<uint32_t> optim_last_order(lwo_optim* optim);
// The stream type of the C API as the backend's opaque stream.
inline lwo_stream_t as_stream(void* s) { return static_cast<lwo_stream_t>(s); }

}  // namespace testing
}  // namespace lwo
