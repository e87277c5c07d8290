#include "sigbus.h"

#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace lwo {

namespace {

// The copy a thread is in: where to jump back to and which bytes it reads.
struct Guard {
  sigjmp_buf env;
  const uint8_t* lo;
  const uint8_t* hi;
  const void* volatile fault;
};

// initial-exec: the handler reads it without __tls_get_addr, which may
// allocate on a thread's first access and is not async-signal-safe.
__attribute__((tls_model("initial-exec"))) thread_local Guard* volatile t_guard = nullptr;

struct sigaction g_previous;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  Guard* g = t_guard;
  const uint8_t* a = static_cast<const uint8_t*>(info->si_addr);
  if (g && info->si_code > 0 && a >= g->lo && a < g->hi) {  // si_code > 0: sent by the kernel
    g->fault = a;
    siglongjmp(g->env, 1);
  }
  // Not ours: the handler that was there before, or the default action.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler == SIG_IGN) {
    if (info->si_code <= 0) return;  // sent, and ignored as before
  } else if (g_previous.sa_handler != SIG_DFL) {
    g_previous.sa_handler(sig);
    return;
  }
  // The default action (a fault kills even where SIGBUS was ignored):
  // restore it and raise again; SIGBUS is blocked in here, so it arrives on
  // return (a faulting read faults again then, too).
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
  raise(SIGBUS);
}

// Kept out of line, a memcpy and nothing else: a siglongjmp out of it skips
// no destructor.
__attribute__((noinline)) const void* copy_under_guard(Guard* g, void* dst, const void* src,
                                                        size_t n) noexcept {
  g->lo = static_cast<const uint8_t*>(src);
  g->hi = g->lo + n;
  g->fault = nullptr;
  // savemask 1: the jump out of the handler unblocks SIGBUS again.
  if (sigsetjmp(g->env, 1) == 0) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
    t_guard = g;
    std::atomic_signal_fence(std::memory_order_seq_cst);
    std::memcpy(dst, src, n);
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_guard = nullptr;
  return g->fault;
}

}  // namespace

void install_sigbus_handler() noexcept {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

const void* guarded_copy(void* dst, const void* src, size_t n) noexcept {
  if (n == 0) return nullptr;
  install_sigbus_handler();
  Guard g;
  return copy_under_guard(&g, dst, src, n);
}

}  // namespace lwo
