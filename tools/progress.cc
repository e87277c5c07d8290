// Progress on stderr: a bar for the running phase on a terminal, one line
// per phase elsewhere, nothing with --quiet. See tools/cli.h.
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "src/common/thread_pool.h"
#include "tools/cli.h"

namespace cli {

bool g_quiet = false;

namespace {

std::mutex g_mu;           // every write to stderr
bool g_bar_shown = false;  // a bar is on the screen, the cursor at its end

bool terminal() {
  static const bool on = [] {
    const char* term = std::getenv("TERM");
    return isatty(STDERR_FILENO) && !(term && std::strcmp(term, "dumb") == 0);
  }();
  return on && g_err == stderr;
}

bool progress_on_terminal() { return terminal() && !g_quiet; }  // bars are drawn

int columns() {
  winsize ws{};
  if (ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 80;
}

void clear_locked() {
  if (!g_bar_shown) return;
  std::fputs("\r\033[K", g_err);
  g_bar_shown = false;
}

}  // namespace

struct Phase::State {
  std::string label;
  uint64_t total = 0;
  bool bytes = false;
  double start = 0;
  std::atomic<uint64_t> done{0};
  std::string detail;  // under g_mu
  bool ended = false;
  // The ticker redraws the bar (terminal only): a waiting thread of the
  // library's host pool (ThreadPool::start).
  lwo::HostThread ticker;
  std::mutex tick_mu;
  std::condition_variable tick_cv;
  bool stop = false;
  State* previous = nullptr;  // the phase this one interrupted
};

namespace {

Phase::State* g_active = nullptr;  // under g_mu

std::string count_text(uint64_t v, bool bytes) {
  return bytes ? fmt_bytes(v) : std::to_string(static_cast<unsigned long long>(v));
}

void draw_locked(const Phase::State& s, double now) {
  const uint64_t done = std::min(s.done.load(), s.total ? s.total : UINT64_MAX);
  const int cols = columns();
  std::string line = s.label;
  if (s.total) {
    const int width = std::max(10, std::min(30, cols / 4));  // the same for every drawing
    int fill = static_cast<int>(static_cast<double>(width) * done / s.total);
    line += " [" + std::string(fill, '#') + std::string(width - fill, '.') + "]" +
            strf(" %3d%%  %s/%s", static_cast<int>(100.0 * done / s.total),
                 count_text(done, s.bytes).c_str(), count_text(s.total, s.bytes).c_str());
  }
  line += strf("  %.1f s", now - s.start);
  if (!s.detail.empty()) line += "  " + s.detail;
  if (static_cast<int>(line.size()) > cols - 1) line.resize(std::max(cols - 1, 0));
  std::fprintf(g_err, "\r%s\033[K", line.c_str());
  std::fflush(g_err);
  g_bar_shown = true;
}

}  // namespace

void print_stderr(const std::string& text) {
  std::lock_guard<std::mutex> lock(g_mu);
  clear_locked();
  std::fputs(text.c_str(), g_err);
  std::fflush(g_err);
}

namespace {
// "<head><the text of fmt>\n", whole, the bar cleared first; nothing with --quiet.
void print_line(const std::string& head, const char* fmt, va_list ap) {
  if (g_quiet) return;
  char buf[2048];
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  print_stderr(head + buf + "\n");
}
}  // namespace

void progress(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  print_line("", fmt, ap);
  va_end(ap);
}

void note_depth(uint32_t depth, uint32_t layers, const char* after, const char* units) {
  if (depth >= layers)
    progress("note: depth %u >= %u layers: after %s every layer stays in a slot, so %s hit and "
             "copy nothing", depth, layers, after, units);
}

Phase::Phase(std::string label, uint64_t total, bool bytes) : s_(new State) {
  s_->label = std::move(label);
  s_->total = total;
  s_->bytes = bytes;
  s_->start = now_seconds();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    s_->previous = g_active;
    g_active = s_;
  }
  if (!progress_on_terminal()) return;
  State* s = s_;
  s_->ticker = lwo::ThreadPool::process().start([s] {
    std::unique_lock<std::mutex> tick(s->tick_mu);
    // The first drawing waits a little: short phases show no bar.
    while (!s->tick_cv.wait_for(tick, std::chrono::milliseconds(150), [s] { return s->stop; })) {
      std::lock_guard<std::mutex> lock(g_mu);
      if (g_active == s) draw_locked(*s, now_seconds());
    }
  });
}

void Phase::set(uint64_t done, const std::string& detail) {
  s_->done = done;
  if (!progress_on_terminal()) return;
  std::lock_guard<std::mutex> lock(g_mu);
  s_->detail = detail;
}

Progress Phase::counter() {
  State* s = s_;
  return [s](uint64_t n) { s->done += n; };
}

double Phase::seconds() const { return now_seconds() - s_->start; }

void Phase::end() {
  if (s_->ended) return;
  s_->ended = true;
  {  // the ticker, if one runs, stops
    std::lock_guard<std::mutex> tick(s_->tick_mu);
    s_->stop = true;
  }
  s_->tick_cv.notify_all();
  s_->ticker.join();
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_active == s_) g_active = s_->previous;
  clear_locked();
}

void Phase::done(const char* fmt, ...) {
  end();
  va_list ap;
  va_start(ap, fmt);
  print_line(s_->label + ": ", fmt, ap);
  va_end(ap);
}

Phase::~Phase() {
  end();
  delete s_;
}

}  // namespace cli
