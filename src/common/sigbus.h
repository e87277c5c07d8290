// Copies out of file mappings that survive the file being cut short. A page
// of a shared mapping past the file's end raises SIGBUS when read; inside a
// guarded copy that fault ends the copy and is reported, anywhere else the
// process dies of it as it would without the library.
#pragma once

#include <cstddef>

namespace lwo {

// Copies `n` bytes from `src` (part of a file mapping) to `dst`. Returns null
// once every byte is copied, or the address in [src, src + n) whose read
// raised SIGBUS; the bytes of `dst` from that point on are then unspecified.
// The first call installs the process's SIGBUS handler (sigaction,
// SA_SIGINFO | SA_ONSTACK); a SIGBUS that is not a read of the range a
// thread is copying goes to the handler installed before it, or kills the
// process as the default action does. Costs one sigsetjmp (with the signal
// mask) per call: guard copies of megabytes, not pages.
const void* guarded_copy(void* dst, const void* src, size_t n) noexcept;

// Installs the handler now (guarded_copy does on its first call).
void install_sigbus_handler() noexcept;

}  // namespace lwo
