// API sequence fuzzer: the input is decoded as 2-4 threads' sequences of C ABI
// calls (lwo.h) over one engine on the recording backend
// (tests/unit/recording_backend.h, injected through bindings/c/testing.h, so
// every call goes through the ABI's checking layer into the real engine).
// Each thread drives pools, rings, schedules, gradient sets, optimizers and
// plans of its own, and stages, acquires and releases layers on a ring and a
// pool that all threads share (engine, pool and ring: "any thread"). Tickets
// passed include live, ended and never-issued ones; layers, depths, names,
// byte counts and step parameters include out-of-range ones. A thread may
// capture a pass over its own ring (with its gradient set: a training step)
// as a CUDA graph, launch it, misuse it and destroy it, while the other
// threads' calls meet the capture.
//
// The oracle, on every call:
//   - the status is one that docs/API.md's status table lists for that call
//     (kAllowed below, the one table of it here);
//   - a refused call leaves its object usable: a query of the object that
//     follows it succeeds;
//   - LWO_ERR_CAPTURING comes only while a capture may be under way (one
//     began before the call returned and had not ended before it began);
//   - a device read of an acquired slot (or a write of a gradient slot) is
//     declared to the backend on the consumer's stream, and the backend's
//     happens-before model reports nothing: no slot read before its copy,
//     none overwritten while a read may run, no copy from memory not pinned;
//   - when every thread is done, tearing everything down succeeds.
// A crash, a sanitizer report or a hang is a bug too.
//
// Two builds: with LWO_LIBFUZZER, a libFuzzer target (scripts/fuzz, clang
// -fsanitize=fuzzer); without it, a plain program that runs random inputs
// from a seed (the property mode: `lwo_api_fuzz [--seed S] [--runs N]`, in
// the unit tests), or replays the files it is given.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bindings/c/testing.h"
#include "fuzz.h"
#include "lwo.h"
#include "recording_backend.h"

namespace {

using lwo::Backend;
using lwo::EventH;
using HostSpan = lwo::Backend::HostSpan;
using lwo::StreamH;
using lwo::testing::RecordingBackend;

// ---- which statuses each call may return (docs/API.md, the status table) ----
enum Call {
  kPoolCreate, kPoolDestroy, kPoolWrite, kPoolLayerChanged, kPoolInfo,
  kRingCreate, kRingDestroy, kRingStage, kRingAcquire, kRingRelease, kRingReleaseAll,
  kRingQuery, kRingTicketState, kRingTensor, kRingInfo,
  kScheduleCreate, kScheduleDestroy, kScheduleNext, kScheduleReset, kSchedulePosition,
  kGradsCreate, kGradsDestroy, kGradsBegin, kGradsEnd, kGradsWait, kGradsZero, kGradsQuery,
  kOptimCreate, kOptimDestroy, kOptimStep, kOptimWait, kOptimQuery, kOptimInfo,
  kPlanCreate, kPlanDestroy, kPlanInfo, kPlanRingConfig,
  kRingCaptureBegin, kRingCaptureEnd, kGraphLaunch, kGraphDestroy,
  kEngineMemory, kEngineDestroy,
  kNCalls
};

struct Allowed {
  const char* name;
  std::vector<lwo_status_t> statuses;  // LWO_OK is always allowed
};

const Allowed kAllowed[kNCalls] = {
    {"lwo_pool_create_pinned", {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_OUT_OF_MEMORY, LWO_ERR_CAPTURING}},
    {"lwo_pool_destroy", {LWO_ERR_BUSY}},
    {"lwo_pool_write",
     {LWO_ERR_OUT_OF_RANGE, LWO_ERR_NOT_FOUND, LWO_ERR_SIZE_MISMATCH, LWO_ERR_BUSY}},
    {"lwo_pool_layer_changed", {LWO_ERR_OUT_OF_RANGE, LWO_ERR_BUSY}},
    {"lwo_pool_get_info", {}},
    {"lwo_ring_create",
     {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_OUT_OF_RANGE, LWO_ERR_OUT_OF_MEMORY, LWO_ERR_OVER_BUDGET,
      LWO_ERR_CAPTURING}},
    {"lwo_ring_destroy", {LWO_ERR_BUSY}},
    {"lwo_ring_stage",
     {LWO_ERR_OUT_OF_RANGE, LWO_ERR_LAYER_BUSY, LWO_ERR_RING_FULL, LWO_ERR_BUSY, LWO_ERR_CAPTURING}},
    {"lwo_ring_acquire",
     {LWO_ERR_FOREIGN_TICKET, LWO_ERR_STALE_TICKET, LWO_ERR_TICKET_STATE, LWO_ERR_BUSY,
      LWO_ERR_CAPTURING}},
    {"lwo_ring_release",
     {LWO_ERR_FOREIGN_TICKET, LWO_ERR_STALE_TICKET, LWO_ERR_BUSY, LWO_ERR_CAPTURING}},
    {"lwo_ring_release_all", {LWO_ERR_BUSY, LWO_ERR_CAPTURING}},
    {"lwo_ring_query",
     {LWO_ERR_FOREIGN_TICKET, LWO_ERR_STALE_TICKET, LWO_ERR_BUSY, LWO_ERR_CAPTURING}},
    {"lwo_ring_ticket_state", {LWO_ERR_FOREIGN_TICKET}},
    {"lwo_ring_tensor", {LWO_ERR_FOREIGN_TICKET, LWO_ERR_STALE_TICKET, LWO_ERR_NOT_FOUND}},
    {"lwo_ring_get_info", {}},
    {"lwo_schedule_create", {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_OUT_OF_RANGE, LWO_ERR_CAPTURING}},
    {"lwo_schedule_destroy", {LWO_ERR_CAPTURING}},
    {"lwo_schedule_next",
     {LWO_END, LWO_ERR_LAYER_BUSY, LWO_ERR_RING_FULL, LWO_ERR_BUSY, LWO_ERR_CAPTURING}},
    {"lwo_schedule_reset", {LWO_ERR_CAPTURING}},
    {"lwo_schedule_position", {}},
    {"lwo_grads_create",
     {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_OUT_OF_MEMORY, LWO_ERR_OVER_BUDGET, LWO_ERR_CAPTURING}},
    {"lwo_grads_destroy", {LWO_ERR_BUSY, LWO_ERR_CAPTURING}},
    {"lwo_grads_begin",
     {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_OUT_OF_RANGE, LWO_ERR_RING_FULL, LWO_ERR_LAYER_BUSY,
      LWO_ERR_TICKET_STATE, LWO_ERR_BUSY, LWO_ERR_CAPTURING}},
    {"lwo_grads_end",
     {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_OUT_OF_RANGE, LWO_ERR_TICKET_STATE, LWO_ERR_BUSY,
      LWO_ERR_CAPTURING}},
    {"lwo_grads_wait", {LWO_ERR_BUSY, LWO_ERR_TICKET_STATE, LWO_ERR_CAPTURING}},
    {"lwo_grads_zero", {LWO_ERR_BUSY, LWO_ERR_TICKET_STATE, LWO_ERR_CAPTURING}},
    {"lwo_grads_query", {LWO_ERR_CAPTURING}},
    {"lwo_optim_create", {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_BUSY}},
    {"lwo_optim_destroy", {LWO_ERR_BUSY}},
    {"lwo_optim_step", {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_BUSY, LWO_ERR_CAPTURING}},
    {"lwo_optim_wait", {LWO_ERR_BUSY}},
    {"lwo_optim_query", {}},
    {"lwo_optim_get_info", {}},
    {"lwo_plan_create", {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_OVER_BUDGET, LWO_ERR_CAPTURING}},
    {"lwo_plan_destroy", {}},
    {"lwo_plan_get_info", {}},
    {"lwo_plan_ring_config", {}},
    {"lwo_ring_capture_begin",
     {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_UNSUPPORTED, LWO_ERR_BUSY, LWO_ERR_CAPTURING}},
    {"lwo_ring_capture_end", {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_TICKET_STATE, LWO_ERR_CAPTURING}},
    {"lwo_graph_launch", {LWO_ERR_INVALID_ARGUMENT, LWO_ERR_TICKET_STATE, LWO_ERR_CAPTURING}},
    {"lwo_graph_destroy", {LWO_ERR_CAPTURING}},
    {"lwo_engine_get_memory", {}},
    {"lwo_engine_destroy", {}},
};

// Captures under way (a thread counts its own from before its begin to after
// its end) and captures ended: LWO_ERR_CAPTURING is allowed only while one
// may have been under way since the thread's previous check.
std::atomic<int> g_capturing{0};
std::atomic<uint64_t> g_capture_ends{0};
thread_local uint64_t t_ends_seen = 0;
bool capture_window() {
  const uint64_t e = g_capture_ends.load();
  const bool may = g_capturing.load() > 0 || e != t_ends_seen;
  t_ends_seen = e;
  return may;
}

std::atomic<uint64_t> g_calls{0}, g_refused{0}, g_graphs{0}, g_launches{0};

// Checks `s` against the table; returns true for LWO_OK (and LWO_END).
// LWO_API_FUZZ_TRACE=1: every call and its status on stderr, and what the
// recording backend reported since the thread's previous call.
const bool g_trace = std::getenv("LWO_API_FUZZ_TRACE") != nullptr;
thread_local uint32_t t_thread = 0;
std::function<std::vector<std::string>()> g_reports;  // the backend's, while an input runs
std::atomic<size_t> g_reports_seen{0};
void trace(Call c, lwo_status_t s, long arg) {
  if (!g_trace) return;
  std::fprintf(stderr, "[%u] %s(%ld): %s\n", t_thread, kAllowed[c].name, arg, lwo_status_string(s));
  if (!g_reports) return;
  const std::vector<std::string> v = g_reports();
  for (size_t i = g_reports_seen.exchange(v.size()); i < v.size(); ++i)
    std::fprintf(stderr, "    the recording backend reports: %s\n", v[i].c_str());
}

bool check(Call c, lwo_status_t s, long arg = -1) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  trace(c, s, arg);
  const bool window = capture_window();
  if (s == LWO_OK) return true;
  const Allowed& a = kAllowed[c];
  const bool ok = std::find(a.statuses.begin(), a.statuses.end(), s) != a.statuses.end();
  const std::string m = lwo_last_error_message();
  FUZZ_CHECK(ok, std::string(a.name) + " returned " + lwo_status_string(s) + ": " + m);
  if (s == LWO_END) return true;
  FUZZ_CHECK(s != LWO_ERR_CAPTURING || window,
             std::string(a.name) + " returned LWO_ERR_CAPTURING with no capture under way: " + m);
  g_refused.fetch_add(1, std::memory_order_relaxed);
  // The message names the call.
  FUZZ_CHECK(m.compare(0, std::strlen(a.name), a.name) == 0, std::string(a.name) + ": " + m);
  return false;
}
#define MUST_OK(c, call)                                                             \
  do {                                                                               \
    lwo_status_t s_ = (call);                                                        \
    trace(c, s_, -1);                                                                \
    FUZZ_CHECK(s_ == LWO_OK, std::string(kAllowed[c].name) + ": " + lwo_status_string(s_) + \
                                 ": " + lwo_last_error_message());                   \
    g_calls.fetch_add(1, std::memory_order_relaxed);                                 \
  } while (0)

// ---- the recording backend, serialised for several threads ----
// The engine calls its backend from any thread, as CUDA allows; the
// recording backend is single-threaded, so every call takes one lock. A host
// function runs after the lock is let go (its stream's work is done by then,
// the recording backend doing everything at once), so that it may call back;
// one enqueued in a capture is a node of the graph, run by each launch (under
// the lock: the engine's graph nodes call no backend).
class LockedBackend final : public Backend {
 public:
  LockedBackend() : in_(std::make_unique<RecordingBackend>()) {}
  using L = std::lock_guard<std::recursive_mutex>;
  // The test's side: a kernel's read or write on `stream`.
  void read(StreamH s, const void* p, size_t n) { L l(m_); in_->read(s, p, n); }
  void write(StreamH s, void* p, size_t n) { L l(m_); in_->write(s, p, n); }
  StreamH new_stream() { L l(m_); return in_->stream_create(); }
  std::vector<std::string> violations() { L l(m_); return in_->violations; }

  int get_device() override { L l(m_); return in_->get_device(); }
  void set_device(int d) override { L l(m_); in_->set_device(d); }
  void* device_alloc(size_t b) override { L l(m_); return in_->device_alloc(b); }
  void device_free(void* p) noexcept override { L l(m_); in_->device_free(p); }
  void mem_get_info(size_t* f, size_t* t) override { L l(m_); in_->mem_get_info(f, t); }
  void* host_alloc_pinned(size_t b) override { L l(m_); return in_->host_alloc_pinned(b); }
  void host_free_pinned(void* p) noexcept override { L l(m_); in_->host_free_pinned(p); }
  bool host_register(void* p, size_t b, bool ro) override { L l(m_); return in_->host_register(p, b, ro); }
  void host_unregister(void* p) noexcept override { L l(m_); in_->host_unregister(p); }
  StreamH stream_create() override { L l(m_); return in_->stream_create(); }
  void stream_destroy(StreamH s) noexcept override { L l(m_); in_->stream_destroy(s); }
  void stream_sync(StreamH s) override { L l(m_); in_->stream_sync(s); }
  void stream_check(StreamH s) override { L l(m_); in_->stream_check(s); }
  EventH event_create(bool t) override { L l(m_); return in_->event_create(t); }
  void event_destroy(EventH e) noexcept override { L l(m_); in_->event_destroy(e); }
  void event_record(EventH e, StreamH s) override { L l(m_); in_->event_record(e, s); }
  void stream_wait(StreamH s, EventH e) override { L l(m_); in_->stream_wait(s, e); }
  bool event_done(EventH e) override { L l(m_); return in_->event_done(e); }
  void event_sync(EventH e) override { L l(m_); in_->event_sync(e); }
  float event_elapsed_ms(EventH a, EventH b) override { L l(m_); return in_->event_elapsed_ms(a, b); }
  void fill_device(void* d, uint8_t v, size_t b, StreamH st) override { L l(m_); in_->fill_device(d, v, b, st); }
  void copy_h2d(void* d, const void* s, size_t b, StreamH st) override { L l(m_); in_->copy_h2d(d, s, b, st); }
  void copy_d2h(void* d, const void* s, size_t b, StreamH st) override { L l(m_); in_->copy_d2h(d, s, b, st); }
  void comm_info(void* c, int* n, int* r) override { L l(m_); in_->comm_info(c, n, r); }
  void all_gather(const void* s, void* r, size_t b, void* c, StreamH st) override {
    L l(m_);
    in_->all_gather(s, r, b, c, st);
  }
  void reduce_owned(void* b, const uint64_t* bo, void* c, StreamH st) override {
    L l(m_);
    in_->reduce_owned(b, bo, c, st);
  }
  void all_reduce(void* b, size_t n, void* c, StreamH st) override {
    L l(m_);
    in_->all_reduce(b, n, c, st);
  }
  void host_func(StreamH st, void (*fn)(void*), void* arg, const std::vector<HostSpan>& spans) override {
    {
      L l(m_);
      if (in_->capture_status(st) != CaptureStatus::None) return in_->host_func(st, fn, arg, spans);
      in_->host_func(st, [](void*) {}, nullptr, spans);
    }
    fn(arg);
  }
  void capture_begin(StreamH s) override { L l(m_); in_->capture_begin(s); }
  void* capture_end(StreamH s) override { L l(m_); return in_->capture_end(s); }
  void graph_launch(void* g, StreamH s) override { L l(m_); in_->graph_launch(g, s); }
  void graph_destroy(void* g) noexcept override { L l(m_); in_->graph_destroy(g); }
  void event_record_in_graph(EventH e, StreamH s) override { L l(m_); in_->event_record_in_graph(e, s); }
  CaptureStatus capture_status(StreamH s) override { L l(m_); return in_->capture_status(s); }

 private:
  std::recursive_mutex m_;
  std::unique_ptr<RecordingBackend> in_;
};

// ---- input decoding ----
class Bytes {
 public:
  Bytes(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool empty() const { return i_ >= n_; }
  uint8_t u8() { return i_ < n_ ? p_[i_++] : 0; }
  uint32_t u32(uint32_t below) { return below ? (u8() | uint32_t(u8()) << 8) % below : 0; }
  bool coin() { return u8() & 1; }

 private:
  const uint8_t* p_;
  size_t n_, i_ = 0;
};

// Layers of a pool: layer i has "weight" (rows x 8) and, when i is odd, "bias".
struct ModelDesc {
  std::vector<std::vector<lwo_tensor_desc>> tensors;
  std::vector<lwo_layer_desc> layers;
  ModelDesc(uint32_t n, uint32_t seed) : tensors(n), layers(n) {
    for (uint32_t i = 0; i < n; ++i) {
      lwo_tensor_desc w{};
      w.name = "weight";
      w.dtype = (seed + i) % 3 == 0 ? LWO_DTYPE_F32 : LWO_DTYPE_BF16;
      w.n_dims = 2;
      w.shape[0] = 1 + (seed * 7 + i * 13) % 40;
      w.shape[1] = 8;
      tensors[i].push_back(w);
      if (i % 2) {
        lwo_tensor_desc b{};
        b.name = "bias";
        b.dtype = LWO_DTYPE_F32;
        b.n_dims = 1;
        b.shape[0] = w.shape[0];
        tensors[i].push_back(b);
      }
      layers[i] = lwo_layer_desc{tensors[i].data(), static_cast<uint32_t>(tensors[i].size()), nullptr};
    }
  }
};

constexpr uint32_t kPoolLayers = 6;
const char* const kNames[] = {"weight", "bias", "nothing", ""};

struct Held {
  lwo_ticket t;
  bool acquired;
  StreamH stream;
};

struct Shared {
  LockedBackend* gpu = nullptr;
  lwo_engine* engine = nullptr;
  lwo_pool* pool = nullptr;
  lwo_ring* ring = nullptr;
};

// A call that another thread's capture may refuse (LWO_ERR_CAPTURING), made
// again until that capture ends (each capture ends within one step of its
// thread); its last status.
template <class F>
lwo_status_t settle(F call) {
  lwo_status_t s;
  while ((s = call()) == LWO_ERR_CAPTURING) std::this_thread::yield();
  return s;
}

// One thread's objects and its sequence of calls.
class Driver {
 public:
  Driver(Shared& sh, Bytes in, uint32_t id) : sh_(sh), in_(in), id_(id) {
    for (auto& s : streams_) s = sh_.gpu->new_stream();
  }

  void run() {
    t_thread = id_;
    t_ends_seen = g_capture_ends.load();
    int ops = 0;
    while (!in_.empty() && ops++ < 400) step();
    teardown();
  }

 private:
  struct RingObj {
    lwo_ring* ring = nullptr;
    std::vector<Held> held;   // live tickets this thread holds
    std::vector<lwo_ticket> ended;
    lwo_schedule* sched = nullptr;
    bool sched_holds = false;  // the last next returned a view
    StreamH sched_stream = nullptr;
  };

  StreamH stream() { return streams_[in_.u8() % 2]; }
  lwo_stream_t as(StreamH s) { return lwo::testing::as_stream(s); }

  void pool_query() {
    if (!pool_) return;
    lwo_pool_info pi = LWO_POOL_INFO_INIT;
    MUST_OK(kPoolInfo, lwo_pool_get_info(pool_, &pi));
  }
  void ring_query(lwo_ring* r) {
    lwo_ring_info info{};
    info.size = sizeof info;
    MUST_OK(kRingInfo, lwo_ring_get_info(r, &info));
  }
  RingObj* pick_ring() {
    if (own_.ring && in_.coin()) return &own_;
    return &shared_;
  }
  uint32_t layers_of(RingObj* r) { return r == &own_ ? n_layers_ : kPoolLayers; }
  lwo_pool* pool_of(RingObj* r) { return r == &own_ ? pool_ : sh_.pool; }

  // A ticket to pass: a live one, an ended one, or one never issued.
  lwo_ticket pick_ticket(RingObj* r, size_t* live) {
    *live = SIZE_MAX;
    uint8_t k = in_.u8() % 8;
    if (k < 5 && !r->held.empty()) {
      *live = in_.u32(static_cast<uint32_t>(r->held.size()));
      return r->held[*live].t;
    }
    if (k < 7 && !r->ended.empty()) return r->ended[in_.u32(static_cast<uint32_t>(r->ended.size()))];
    if (k == 7 && in_.coin()) return lwo_ticket{0};
    return lwo_ticket{(uint64_t(1) << 62) | in_.u32(65536)};  // never issued
  }

  void create_pool() {
    n_layers_ = 1 + in_.u8() % kPoolLayers;
    ModelDesc m(n_layers_, id_ * 31 + in_.u8());
    lwo_pool* p = nullptr;
    if (in_.u8() % 16 == 0) {  // a bad description: a tensor of no name
      m.tensors[0][0].name = nullptr;
      check(kPoolCreate, lwo_pool_create_pinned(sh_.engine, m.layers.data(), n_layers_, nullptr, &p));
      FUZZ_CHECK(p == nullptr, "");
      return;
    }
    if (!check(kPoolCreate, lwo_pool_create_pinned(sh_.engine, m.layers.data(), n_layers_, nullptr, &p)))
      return;
    pool_ = p;
  }

  void create_ring() {
    lwo_ring_config c = LWO_RING_CONFIG_INIT;
    uint8_t k = in_.u8();
    c.depth = k % 32 == 0 ? (k & 32 ? 0u : 5000u) : 1 + k % 4;
    if (in_.u8() % 32 == 0) c.flags = 0x100;  // unknown flag
    uint32_t res[2];
    if (in_.u8() % 4 == 0) {
      res[0] = in_.u32(n_layers_ + 1);  // may be out of range
      res[1] = in_.u32(n_layers_ + 1);
      c.resident_layers = res;
      c.n_resident = 1 + in_.u8() % 2;
    }
    lwo_ring* r = nullptr;
    if (!check(kRingCreate, lwo_ring_create(pool_, &c, &r))) {
      FUZZ_CHECK(r == nullptr, "");
      pool_query();
      return;
    }
    own_.ring = r;
  }

  void stage(RingObj* r) {
    lwo_ticket t{1};
    uint32_t layer = in_.u32(layers_of(r) + 1);
    if (!check(kRingStage, lwo_ring_stage(r->ring, layer, &t))) {
      FUZZ_CHECK(t.id == 0, "a refused stage leaves a ticket");
      ring_query(r->ring);
      return;
    }
    FUZZ_CHECK(t.id != 0, "");
    r->held.push_back({t, false, nullptr});
  }

  void acquire(RingObj* r) {
    size_t live;
    lwo_ticket t = pick_ticket(r, &live);
    StreamH s = stream();
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    const lwo_status_t st = lwo_ring_acquire(r->ring, t, as(s), &v);
    if (!check(kRingAcquire, st)) {
      FUZZ_CHECK(live == SIZE_MAX || r->held[live].acquired || st == LWO_ERR_CAPTURING,
                 "a staged ticket of ours was refused");
      ring_query(r->ring);
      return;
    }
    FUZZ_CHECK(live != SIZE_MAX && !r->held[live].acquired, "acquired a ticket not staged");
    r->held[live].acquired = true;
    r->held[live].stream = s;
    sh_.gpu->read(s, v.base, v.record_bytes);  // the consumer kernel
    ++reads_;
  }

  void release(RingObj* r) {
    size_t live;
    lwo_ticket t = pick_ticket(r, &live);
    // An acquired ticket is released on the stream that read it (a staged
    // one on either).
    StreamH s = live != SIZE_MAX && r->held[live].acquired ? r->held[live].stream : stream();
    const lwo_status_t st = lwo_ring_release(r->ring, t, as(s));
    if (!check(kRingRelease, st)) {
      FUZZ_CHECK(live == SIZE_MAX || st == LWO_ERR_CAPTURING, "a live ticket of ours was refused");
      ring_query(r->ring);
      return;
    }
    FUZZ_CHECK(live != SIZE_MAX, "released a ticket not live");
    r->ended.push_back(t);
    r->held.erase(r->held.begin() + static_cast<long>(live));
  }

  void release_all() {
    if (!own_.ring) return;
    // Every read of our acquired tickets ran on one of two streams: join them.
    StreamH s = join_streams();
    uint32_t n = 0;
    const lwo_status_t st = lwo_ring_release_all(own_.ring, as(s), &n);
    if (!check(kRingReleaseAll, st)) {
      FUZZ_CHECK(own_.sched || graph_ || st == LWO_ERR_CAPTURING,
                 "release_all refused with no schedule, graph or capture");
      ring_query(own_.ring);
      return;
    }
    FUZZ_CHECK(n == own_.held.size(), "release_all released " + std::to_string(n));
    for (const Held& h : own_.held) own_.ended.push_back(h.t);
    own_.held.clear();
  }

  // Makes streams_[0] wait for streams_[1]'s work (an event, as a caller
  // joins streams) and returns it.
  StreamH join_streams() {
    // The C ABI has no event call; the backend's own records do the join.
    lwo::Backend* be = sh_.gpu;
    EventH e = be->event_create(false);
    be->event_record(e, streams_[1]);
    be->stream_wait(streams_[0], e);
    be->event_destroy(e);
    return streams_[0];
  }

  void ticket_queries(RingObj* r) {
    size_t live;
    lwo_ticket t = pick_ticket(r, &live);
    lwo_ticket_state_t st = LWO_TICKET_STATE_FORCE_32;
    if (check(kRingTicketState, lwo_ring_ticket_state(r->ring, t, &st)) && live != SIZE_MAX)
      FUZZ_CHECK(st == (r->held[live].acquired ? LWO_TICKET_ACQUIRED : LWO_TICKET_STAGED), "");
    uint32_t landed = 7;
    if (check(kRingQuery, lwo_ring_query(r->ring, t, &landed))) FUZZ_CHECK(landed <= 1, "");
    void* p = nullptr;
    check(kRingTensor, lwo_ring_tensor(r->ring, t, kNames[in_.u8() % 4], &p));
    ring_query(r->ring);
  }

  void schedule_op() {
    if (!own_.ring) return;
    uint8_t k = in_.u8() % 8;
    if (!own_.sched) {
      uint32_t n = in_.u8() % 9;  // 0 is refused
      std::vector<uint32_t> ls(n);
      for (auto& l : ls) l = in_.u32(n_layers_ + (in_.u8() % 16 == 0));
      lwo_schedule* s = nullptr;
      if (check(kScheduleCreate, lwo_schedule_create(own_.ring, n ? ls.data() : nullptr, n, &s)))
        own_.sched = s;
      else
        ring_query(own_.ring);
      return;
    }
    if (k < 5) {
      StreamH s = own_.sched_holds ? own_.sched_stream : stream();
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      lwo_status_t st = lwo_schedule_next(own_.sched, as(s), &v);
      // A refused next may still hold the layer it returned last (its
      // release refused): its read's stream stays the one to go on with.
      if (st == LWO_END) own_.sched_holds = false;
      if (check(kScheduleNext, st) && st == LWO_OK) {
        sh_.gpu->read(s, v.base, v.record_bytes);
        ++reads_;
        own_.sched_holds = true;
        own_.sched_stream = s;
      }
      uint32_t pos = 0;
      MUST_OK(kSchedulePosition, lwo_schedule_position(own_.sched, &pos));
    } else if (k < 7) {
      StreamH s = own_.sched_holds ? own_.sched_stream : stream();
      if (check(kScheduleReset, lwo_schedule_reset(own_.sched, as(s)))) own_.sched_holds = false;
    } else {
      destroy_schedule(false);
    }
  }
  // With `settled`, made again until another thread's capture lets it.
  void destroy_schedule(bool settled) {
    if (!own_.sched) return;
    // It releases on the stream of its last call: where the last read ran.
    lwo_schedule* sch = own_.sched;
    const lwo_status_t st = settled ? settle([&] { return lwo_schedule_destroy(sch); })
                                    : lwo_schedule_destroy(sch);
    if (!check(kScheduleDestroy, st)) return;
    own_.sched = nullptr;
    own_.sched_holds = false;
  }

  void destroy_ring() {
    if (!own_.ring) return;
    if (!check(kRingDestroy, lwo_ring_destroy(own_.ring))) {
      bool acquired = std::any_of(own_.held.begin(), own_.held.end(),
                                  [](const Held& h) { return h.acquired; });
      FUZZ_CHECK(acquired || own_.sched || graph_, "ring_destroy refused with nothing held");
      ring_query(own_.ring);
      return;
    }
    own_ = RingObj{};
  }

  void grads_op() {
    if (!pool_) return;
    uint8_t k = in_.u8() % 8;
    if (!grads_) {
      lwo_grads_config c = LWO_GRADS_CONFIG_INIT;
      uint8_t d = in_.u8();
      c.depth = d % 16 == 0 ? 0u : 1 + d % 3;
      c.flags = in_.coin() ? LWO_GRADS_F32 : 0u;
      uint8_t tr[kPoolLayers];
      for (uint32_t i = 0; i < n_layers_ && i < kPoolLayers; ++i) tr[i] = in_.u8() % 4 != 0;
      const bool all = in_.coin();
      lwo_grads* g = nullptr;
      if (check(kGradsCreate, lwo_grads_create(pool_, all ? nullptr : tr, &c, &g))) {
        grads_ = g;
        std::copy(tr, tr + n_layers_, trainable_);
        if (all) std::fill(trainable_, trainable_ + kPoolLayers, 1);
      } else {
        FUZZ_CHECK(g == nullptr, "");
        pool_query();
      }
      return;
    }
    uint32_t done = 0;
    if (k < 3) {  // begin, the backward kernel's writes, end
      uint32_t layer = in_.u32(n_layers_ + 1);
      StreamH s = stream();
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      if (check(kGradsBegin, lwo_grads_begin(grads_, layer, as(s), &v), layer)) {
        for (uint32_t t = 0; t < v.n_tensors; ++t)
          if (v.tensor_bytes[t]) sh_.gpu->write(s, v.tensors[t], v.tensor_bytes[t]);
        begun_.push_back({layer, s});
      } else {
        check(kGradsQuery, lwo_grads_query(grads_, &done));
      }
    } else if (k < 5) {
      size_t i = begun_.empty() || in_.u8() % 8 == 0 ? SIZE_MAX : in_.u32(uint32_t(begun_.size()));
      uint32_t layer = i == SIZE_MAX ? in_.u32(n_layers_ + 1) : begun_[i].first;
      for (size_t j = 0; j < begun_.size(); ++j)
        if (begun_[j].first == layer) i = j;
      // Ended on the stream its gradient was written on.
      StreamH s = i == SIZE_MAX ? stream() : begun_[i].second;
      const lwo_status_t st = lwo_grads_end(grads_, layer, as(s));
      if (check(kGradsEnd, st, layer)) {
        FUZZ_CHECK(i != SIZE_MAX || std::any_of(begun_.begin(), begun_.end(),
                                                [&](auto& b) { return b.first == layer; }),
                   "ended a layer not begun");
        auto it = std::find_if(begun_.begin(), begun_.end(), [&](auto& b) { return b.first == layer; });
        begun_.erase(it);
      } else {
        FUZZ_CHECK(i == SIZE_MAX || st == LWO_ERR_CAPTURING, "ending a begun layer was refused");
        check(kGradsQuery, lwo_grads_query(grads_, &done));
      }
    } else if (k == 5) {
      const lwo_status_t st = lwo_grads_wait(grads_);
      if (!check(kGradsWait, st)) FUZZ_CHECK(!begun_.empty() || st == LWO_ERR_CAPTURING, "");
    } else if (k == 6) {
      const lwo_status_t st = lwo_grads_zero(grads_);
      if (!check(kGradsZero, st)) FUZZ_CHECK(!begun_.empty() || st == LWO_ERR_CAPTURING, "");
    } else {
      destroy_grads();
    }
  }
  void destroy_grads() {
    if (!grads_) return;
    const lwo_status_t st = lwo_grads_destroy(grads_);
    if (!check(kGradsDestroy, st)) {
      FUZZ_CHECK(!begun_.empty() || optim_ || (graph_ && graph_grads_) || st == LWO_ERR_CAPTURING,
                 "grads_destroy refused with nothing begun");
      uint32_t done = 0;
      check(kGradsQuery, lwo_grads_query(grads_, &done));
      return;
    }
    grads_ = nullptr;
  }

  void optim_op() {
    if (!grads_) return;
    uint8_t k = in_.u8() % 8;
    if (!optim_ || k == 0) {
      lwo_optim_config c = LWO_OPTIM_CONFIG_INIT;
      c.kind = in_.coin() ? LWO_OPTIM_SGD : LWO_OPTIM_ADAMW;
      c.n_threads = 1 + in_.u8() % 2;
      if (in_.u8() % 16 == 0) c.n_threads = 100;  // over 64
      if (in_.coin()) c.flags |= LWO_OPTIM_DELAYED;
      lwo_optim* o = nullptr;
      if (check(kOptimCreate, lwo_optim_create(grads_, &c, &o))) {
        FUZZ_CHECK(!optim_, "a second optimizer over one gradient set");
        optim_ = o;
      } else {
        FUZZ_CHECK(o == nullptr, "");
      }
      return;
    }
    if (k < 4) {
      lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
      p.step = ++steps_;
      if (in_.u8() % 8 == 0) p.lr = -1;  // refused
      if (!check(kOptimStep, lwo_optim_step(optim_, &p))) {
        lwo_optim_info info{};
        info.size = sizeof info;
        MUST_OK(kOptimInfo, lwo_optim_get_info(optim_, &info));
      }
    } else if (k < 6) {
      MUST_OK(kOptimWait, lwo_optim_wait(optim_));
    } else if (k == 6) {
      uint32_t done = 0;
      MUST_OK(kOptimQuery, lwo_optim_query(optim_, &done));
    } else {
      MUST_OK(kOptimDestroy, lwo_optim_destroy(optim_));
      optim_ = nullptr;
    }
  }

  void plan_op() {
    if (!pool_) return;
    if (plan_) {
      lwo_plan_info info{};
      info.size = sizeof info;
      MUST_OK(kPlanInfo, lwo_plan_get_info(plan_, &info));
      lwo_ring_config rc = LWO_RING_CONFIG_INIT;
      MUST_OK(kPlanRingConfig, lwo_plan_ring_config(plan_, &rc));
      if (!own_.ring && in_.coin()) {  // a ring of the plan's choice
        lwo_ring* r = nullptr;
        if (check(kRingCreate, lwo_ring_create(pool_, &rc, &r))) own_.ring = r;
      }
      MUST_OK(kPlanDestroy, lwo_plan_destroy(plan_));
      plan_ = nullptr;
      return;
    }
    double fwd[kPoolLayers], bwd[kPoolLayers];
    for (uint32_t i = 0; i < kPoolLayers; ++i) fwd[i] = bwd[i] = 0.01 * (1 + in_.u8() % 4);
    lwo_plan_config c = LWO_PLAN_CONFIG_INIT;
    c.flags = in_.coin() ? LWO_PLAN_TRAIN : 0u;
    c.budget_bytes = uint64_t(in_.u8()) << (6 + in_.u8() % 8);  // may be too small
    c.fwd_ms = in_.u8() % 16 ? fwd : nullptr;                 // required
    c.bwd_ms = bwd;
    c.h2d_gbps = c.d2h_gbps = 0.02;
    lwo_plan* p = nullptr;
    if (check(kPlanCreate, lwo_plan_create(pool_, &c, &p)))
      plan_ = p;
    else
      pool_query();
  }

  void pool_op() {
    if (!pool_) return;
    uint8_t k = in_.u8() % 4;
    uint32_t layer = in_.u32(n_layers_ + 1);
    if (k < 2) {
      // Writing bytes a ring may be copying is the caller's race: the
      // recording backend copies at once, so no copy is in flight here.
      uint8_t buf[40 * 8 * 4];
      std::memset(buf, in_.u8(), sizeof buf);
      uint64_t bytes = in_.u32(sizeof buf + 1);
      if (in_.coin() && layer < n_layers_) bytes = 40 * 8 * 4;  // often the wrong size
      if (!check(kPoolWrite, lwo_pool_write(pool_, layer, kNames[in_.u8() % 4], buf, bytes)))
        pool_query();
    } else {
      if (!check(kPoolLayerChanged, lwo_pool_layer_changed(pool_, layer))) pool_query();
    }
  }

  void destroy_pool() {
    if (!pool_) return;
    if (!check(kPoolDestroy, lwo_pool_destroy(pool_))) {
      FUZZ_CHECK(own_.ring || grads_, "pool_destroy refused with nothing on it");
      pool_query();
      return;
    }
    pool_ = nullptr;
  }

  // The end of this thread's capture window (see capture_window).
  static void capture_ended() {
    g_capture_ends.fetch_add(1);
    g_capturing.fetch_sub(1);
  }

  // A pass over the thread's ring captured as a CUDA graph, a training step
  // when its gradient set takes part (sometimes ended with a ticket live or a
  // gradient begun: refused, the capture discarded); or, while the graph
  // exists, a launch, a stage the graph refuses, or the graph's destruction.
  void capture_op() {
    if (graph_) {
      const uint8_t k = in_.u8() % 8;
      if (k < 4) {
        if (graph_grads_ && in_.coin()) check(kGradsZero, lwo_grads_zero(grads_));
        if (check(kGraphLaunch, lwo_graph_launch(graph_, as(stream())))) ++g_launches;
      } else if (k < 6) {
        lwo_ticket t{1};
        const lwo_status_t st = lwo_ring_stage(own_.ring, in_.u32(n_layers_), &t);
        check(kRingStage, st);
        FUZZ_CHECK(st == LWO_ERR_BUSY && t.id == 0,
                   std::string("a stage of a ring a graph holds: ") + lwo_status_string(st));
        ring_query(own_.ring);
      } else {
        destroy_graph(false);
      }
      return;
    }
    if (!own_.ring) return;
    StreamH s = stream();
    const uint64_t ends = g_capture_ends.load();
    const int others = g_capturing.fetch_add(1);
    lwo_status_t st = lwo_ring_capture_begin(own_.ring, as(s));
    if (st != LWO_OK) {
      const bool window = others > 0 || g_capturing.load() > 1 || g_capture_ends.load() != ends;
      capture_ended();
      check(kRingCaptureBegin, st);
      FUZZ_CHECK(st != LWO_ERR_CAPTURING || window, "capture_begin: LWO_ERR_CAPTURING alone");
      FUZZ_CHECK(st != LWO_ERR_BUSY || !own_.held.empty() || own_.sched,
                 "capture_begin refused as busy with no ticket held");
      FUZZ_CHECK(st == LWO_ERR_CAPTURING || st == LWO_ERR_BUSY,
                 std::string("capture_begin: ") + lwo_status_string(st));
      ring_query(own_.ring);
      return;
    }
    check(kRingCaptureBegin, st);
    const bool train = grads_ && begun_.empty() && in_.coin();
    const uint32_t m = 1 + in_.u8() % 4;
    const bool leave_live = in_.u8() % 8 == 0;
    const bool leave_begun = train && in_.u8() % 8 == 0;
    lwo_ticket live{0};
    int64_t begun = -1;
    bool grads_used = false;
    for (uint32_t i = 0; i < m; ++i) {
      const uint32_t layer = in_.u32(n_layers_);
      lwo_ticket t{};
      MUST_OK(kRingStage, lwo_ring_stage(own_.ring, layer, &t));
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      MUST_OK(kRingAcquire, lwo_ring_acquire(own_.ring, t, as(s), &v));
      sh_.gpu->read(s, v.base, v.record_bytes);
      ++reads_;
      if (train && trainable_[layer] && begun < 0 && in_.coin()) {
        lwo_layer_view g = LWO_LAYER_VIEW_INIT;
        MUST_OK(kGradsBegin, lwo_grads_begin(grads_, layer, as(s), &g));
        for (uint32_t k = 0; k < g.n_tensors; ++k)
          if (g.tensor_bytes[k]) sh_.gpu->write(s, g.tensors[k], g.tensor_bytes[k]);
        grads_used = true;
        if (leave_begun)
          begun = layer;
        else
          MUST_OK(kGradsEnd, lwo_grads_end(grads_, layer, as(s)));
      }
      if (leave_live && i + 1 == m)
        live = t;
      else
        MUST_OK(kRingRelease, lwo_ring_release(own_.ring, t, as(s)));
    }
    lwo_graph* g = nullptr;
    st = lwo_ring_capture_end(own_.ring, as(s), &g);
    capture_ended();
    check(kRingCaptureEnd, st);
    if (!live.id && begun < 0) {
      FUZZ_CHECK(st == LWO_OK && g, std::string("capture_end: ") + lwo_status_string(st));
      graph_ = g;
      graph_grads_ = grads_used;
      ++g_graphs;
      return;
    }
    // Discarded: its tickets and gradient layers ended.
    FUZZ_CHECK(st == LWO_ERR_TICKET_STATE && !g,
               std::string("capture_end with a ticket live or a gradient begun: ") +
                   lwo_status_string(st));
    if (live.id) {
      lwo_ticket_state_t ts = LWO_TICKET_STATE_FORCE_32;
      MUST_OK(kRingTicketState, lwo_ring_ticket_state(own_.ring, live, &ts));
      FUZZ_CHECK(ts == LWO_TICKET_ENDED, "a discarded capture's ticket is live");
      own_.ended.push_back(live);
    }
    if (begun >= 0) {
      const lwo_status_t e = settle([&] { return lwo_grads_end(grads_, uint32_t(begun), as(s)); });
      check(kGradsEnd, e);
      FUZZ_CHECK(e == LWO_ERR_TICKET_STATE, "a discarded capture's gradient layer is begun");
    }
    ring_query(own_.ring);
  }
  // With `settled`, made again until another thread's capture lets it.
  void destroy_graph(bool settled) {
    if (!graph_) return;
    lwo_graph* g = graph_;
    const lwo_status_t st = settled ? settle([&] { return lwo_graph_destroy(g); })
                                    : lwo_graph_destroy(g);
    if (!check(kGraphDestroy, st)) return;
    graph_ = nullptr;
    graph_grads_ = false;
  }

  void step() {
    switch (in_.u8() % 22) {
      case 0: if (!pool_) create_pool(); else if (in_.u8() % 4 == 0) destroy_pool(); break;
      case 1: if (pool_ && !own_.ring) create_ring(); else if (in_.u8() % 4 == 0) destroy_ring(); break;
      case 2: case 3: stage(pick_ring()); break;
      case 4: case 5: acquire(pick_ring()); break;
      case 6: case 7: release(pick_ring()); break;
      case 8: release_all(); break;
      case 9: ticket_queries(pick_ring()); break;
      case 10: case 11: schedule_op(); break;
      case 12: case 13: grads_op(); break;
      case 14: case 15: optim_op(); break;
      case 16: plan_op(); break;
      case 17: pool_op(); break;
      case 18: {
        lwo_engine_memory m{};
        m.size = sizeof m;
        MUST_OK(kEngineMemory, lwo_engine_get_memory(sh_.engine, &m));
        break;
      }
      case 19: case 20: capture_op(); break;
      default: destroy_schedule(false); break;
    }
  }

  // Everything this thread made, torn down in the documented order: each
  // call must succeed once no other thread's capture refuses it.
  void teardown() {
    destroy_graph(true);
    destroy_schedule(true);
    FUZZ_CHECK(!own_.sched, "a schedule was not destroyed");
    StreamH s = join_streams();
    for (const Held& h : shared_.held)
      MUST_OK(kRingRelease, settle([&] { return lwo_ring_release(shared_.ring, h.t, as(s)); }));
    if (own_.ring) {
      uint32_t n = 0;
      MUST_OK(kRingReleaseAll, settle([&] { return lwo_ring_release_all(own_.ring, as(s), &n); }));
      MUST_OK(kRingDestroy, lwo_ring_destroy(own_.ring));
    }
    if (optim_) MUST_OK(kOptimDestroy, lwo_optim_destroy(optim_));
    if (grads_) {
      for (auto& b : begun_)
        MUST_OK(kGradsEnd, settle([&] { return lwo_grads_end(grads_, b.first, as(b.second)); }));
      MUST_OK(kGradsWait, settle([&] { return lwo_grads_wait(grads_); }));
      MUST_OK(kGradsDestroy, settle([&] { return lwo_grads_destroy(grads_); }));
    }
    if (plan_) MUST_OK(kPlanDestroy, lwo_plan_destroy(plan_));
    if (pool_) MUST_OK(kPoolDestroy, lwo_pool_destroy(pool_));
  }

 public:
  uint64_t reads_ = 0;

 private:
  Shared& sh_;
  Bytes in_;
  uint32_t id_;
  StreamH streams_[2];
  lwo_pool* pool_ = nullptr;
  uint32_t n_layers_ = 0;
  RingObj own_;
  RingObj shared_{};
  lwo_grads* grads_ = nullptr;
  uint8_t trainable_[kPoolLayers] = {};
  std::vector<std::pair<uint32_t, StreamH>> begun_;
  lwo_optim* optim_ = nullptr;
  uint64_t steps_ = 0;
  lwo_plan* plan_ = nullptr;
  lwo_graph* graph_ = nullptr;
  bool graph_grads_ = false;  // the graph holds grads_

  friend void run_input(const uint8_t*, size_t);
  void set_shared_ring(lwo_ring* r) { shared_.ring = r; }
};

std::atomic<uint64_t> g_sequences{0};
uint32_t g_threads = 0;  // the property mode's --threads: this many, not the input's 2-4

void run_input(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const uint32_t n_threads = g_threads ? g_threads : 2 + data[0] % 3;
  Shared sh;
  auto be = std::make_unique<LockedBackend>();
  sh.gpu = be.get();
  if (g_trace) g_reports = [g = be.get()] { return g->violations(); };
  g_reports_seen = 0;
  MUST_OK(kEngineDestroy, lwo::testing::engine_create(std::move(be), 0, &sh.engine));
  ModelDesc m(kPoolLayers, data[1]);
  MUST_OK(kPoolCreate, lwo_pool_create_pinned(sh.engine, m.layers.data(), kPoolLayers, nullptr, &sh.pool));
  lwo_ring_config c = LWO_RING_CONFIG_INIT;
  c.depth = 1 + data[1] % 4;
  MUST_OK(kRingCreate, lwo_ring_create(sh.pool, &c, &sh.ring));

  // The rest of the input, split evenly: one part per thread.
  const size_t body = size - 2, part = body / n_threads;
  std::vector<std::unique_ptr<Driver>> drivers;
  for (uint32_t t = 0; t < n_threads; ++t) {
    drivers.push_back(std::make_unique<Driver>(sh, Bytes(data + 2 + t * part, part), t));
    drivers.back()->set_shared_ring(sh.ring);
  }
  std::vector<std::thread> threads;
  for (auto& d : drivers) threads.emplace_back([&d] { d->run(); });
  for (auto& t : threads) t.join();

  const std::vector<std::string> v = sh.gpu->violations();
  g_reports = nullptr;
  FUZZ_CHECK(v.empty(), "the recording backend reports: " + v.front());
  MUST_OK(kRingDestroy, lwo_ring_destroy(sh.ring));
  MUST_OK(kPoolDestroy, lwo_pool_destroy(sh.pool));
  MUST_OK(kEngineDestroy, lwo_engine_destroy(sh.engine));
  g_sequences.fetch_add(n_threads, std::memory_order_relaxed);
}

}  // namespace

LWO_FUZZ_ENTRY(run_input)

#ifndef LWO_LIBFUZZER
// The property mode: `--runs N` random inputs (lengths 2..2048) from
// `--seed S`; or the inputs in the files named (a libFuzzer artifact, say).
int main(int argc, char** argv) {
  uint64_t seed = 1, runs = 200;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 0);
    else if (a == "--runs" && i + 1 < argc) runs = std::strtoull(argv[++i], nullptr, 0);
    else if (a == "--threads" && i + 1 < argc) g_threads = static_cast<uint32_t>(std::atoi(argv[++i]));
    else files.push_back(a);
  }
  if (!files.empty()) {
    for (const std::string& f : files) lwo_fuzz::run_file(f, run_input);
  } else {
    std::mt19937_64 rng(seed);
    for (uint64_t r = 0; r < runs; ++r) {
      std::vector<uint8_t> b(2 + rng() % 2047);
      for (auto& x : b) x = static_cast<uint8_t>(rng() >> 23);
      run_input(b.data(), b.size());
    }
  }
  std::printf("lwo_api_fuzz: %llu inputs, %llu thread sequences, %llu calls (%llu refused), "
              "%llu graphs captured, %llu launches, no failure\n",
              static_cast<unsigned long long>(files.empty() ? runs : files.size()),
              static_cast<unsigned long long>(g_sequences.load()),
              static_cast<unsigned long long>(g_calls.load()),
              static_cast<unsigned long long>(g_refused.load()),
              static_cast<unsigned long long>(g_graphs.load()),
              static_cast<unsigned long long>(g_launches.load()));
  return 0;
}
#endif
