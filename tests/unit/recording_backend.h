// A Backend with no GPU, for unit tests. "Device" memory is host memory and
// copies happen at once, so tests can read slot bytes directly. Every stream
// operation is also run through a vector-clock model of CUDA stream semantics
// (a stream orders its own work; an event captures its stream's position when
// recorded; a wait orders the stream after the captured position), and every
// access to device memory is checked:
//   - a copy or fill into memory must be ordered after every earlier read and write
//     of the bytes it overwrites (no slot overwritten while a reader may run);
//   - a read (declared by the test with read()) must be ordered after the
//     copy that wrote the bytes it reads;
//   - copy sources must lie in host memory registered or pinned through the
//     backend (DMA-ready);
//   - the same rules hold for pinned and registered host memory, as copies
//     and host functions (by their declared spans) read and write it.
// A host wait (stream_sync, event_sync) orders every later operation, on any
// stream, after what it waited for. Violations are collected as text; a
// test asserts there are none.
// Graph capture: from capture_begin on a stream, the streams that wait on an
// event recorded in the capture join it; their copies (both ways), fills and
// host functions are checked as they are enqueued (the graph keeps the
// capture's order) but kept, not run, until graph_launch runs them in order
// (so a replay moves the bytes as they are at the launch, and calls each
// host function with the argument it was captured with; an event record node
// records its event at the launch's position). A test reads what a
// graph holds (graph_ops: each operation's kind, destination, source and
// bytes, in the capture's order) and what the launches did (stats.replayed_*).
// A launch is one operation of its stream: every access the capture made
// (copies, fills, host functions' spans, and the test's read() and write()
// on a captured stream) is checked again at the launch as an access of the
// launch's stream, so replays are ordered against the work around them by the
// same rules. capture_end fails, as cudaStreamEndCapture does, if a stream
// that joined the capture was not joined back into its origin. A host wait
// or query of captured work (stream_sync of a captured stream, event_sync or
// event_done of an event last recorded in the capture under way) is a
// violation: CUDA refuses it in every capture mode (the CUDA backend makes
// the others with the thread's capture mode relaxed). A test may begin and
// end a capture itself (caller_capture_begin / _end), as a framework would.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "src/common/error.h"

namespace lwo {
namespace testing {

class RecordingBackend final : public Backend {
 public:
  using Clock = std::vector<uint64_t>;  // indexed by stream number

  struct Stats {
    uint64_t copies = 0, bytes = 0, records = 0, waits = 0, reads = 0;
    uint64_t d2h_copies = 0, d2h_bytes = 0, host_funcs = 0, gathers = 0, reduces = 0;
    uint64_t all_reduces = 0, all_reduce_floats = 0;
    uint64_t fills = 0, fill_bytes = 0;
    uint64_t replayed_copies = 0, replayed_bytes = 0;  // H2D copies run by graph launches
    uint64_t replayed_d2h_copies = 0, replayed_d2h_bytes = 0, replayed_host_funcs = 0;
  };
  // One operation of a captured graph.
  struct GraphOp {
    enum Kind { Copy, CopyD2H, Fill, HostFunc, EventRecord } kind;
    void* dst;        // null for a host function and an event record
    const void* src;  // a copy's source; null for the others
    size_t bytes;
    size_t stream;    // the capture's stream it was enqueued on
    std::function<void()> run;
  };

  // Runs in host_func before the host function itself: a test's way in
  // between the enqueue and the host work (say, to cut a mapped file short).
  std::function<void()> before_host_func;

  RecordingBackend() { streams_.push_back({}); }  // stream 0: the legacy stream (NULL)
  ~RecordingBackend() override {
    for (auto& kv : allocs_) delete[] reinterpret_cast<uint8_t*>(kv.first);
    for (auto& kv : pinned_) delete[] reinterpret_cast<uint8_t*>(kv.first);
  }

  // ---- test controls ----
  std::vector<std::string> violations;
  std::vector<std::string> log;  // one line per stream operation
  bool keep_log = false;
  Stats stats;
  // Called at the start of every event_sync, on the thread that syncs (a
  // test holds a host thread of the library there). Set before that thread
  // can sync and cleared after it is done.
  std::function<void()> on_event_sync;
  int fail_copy_after = -1;         // throw on the (n+1)-th copy from now
  int fail_alloc_after = -1;        // throw LWO_ERR_OUT_OF_MEMORY on the (n+1)-th alloc
  bool refuse_register = false;     // host_register throws (registration refused)
  int current_device = 0;
  // The communicator seen by comm_info: this process plays rank `fake_rank`
  // of `fake_ranks`, and every other rank sends the same bytes as this one
  // (so all-gathers replicate the send part and reductions multiply by
  // fake_ranks), unless `peer_send` rewrites what rank k sent. A
  // communicator in `fake_comms` has its own ranks instead (and, with a
  // device >= 0, lives on that device: comm_info refuses it on another, as
  // the CUDA backend does).
  int fake_ranks = 1, fake_rank = 0;
  struct FakeComm {
    int n_ranks = 1, rank = 0, device = -1;
  };
  std::map<const void*, FakeComm> fake_comms;
  std::function<void(int k, uint8_t* part, size_t bytes)> peer_send;
  int set_device_calls = 0;

  // A consumer kernel reading [ptr, ptr+n) on `stream`.
  void read(StreamH stream, const void* ptr, size_t n) {
    size_t s = stream_index(stream);
    tick(s);
    ++stats.reads;
    access(s, ptr, n, /*write=*/false, "read");
  }
  StreamH new_stream() { return stream_create(); }
  size_t n_device_allocs() const { return allocs_.size(); }
  size_t n_registered() const { return registered_.size(); }

  // ---- Backend ----
  int get_device() override { return current_device; }
  void set_device(int d) override {
    current_device = d;
    ++set_device_calls;
  }
  void* device_alloc(size_t bytes) override {
    if (fail_alloc_after == 0) {
      fail_alloc_after = -1;
      fail(LWO_ERR_OUT_OF_MEMORY, "cudaMalloc(%zu bytes): out of memory (injected)", bytes);
    }
    if (fail_alloc_after > 0) --fail_alloc_after;
    auto* p = new uint8_t[bytes ? bytes : 1];
    std::memset(p, 0xA5, bytes);
    allocs_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return p;
  }
  void device_free(void* p) noexcept override {
    if (!p) return;
    auto it = allocs_.find(reinterpret_cast<uintptr_t>(p));
    if (it == allocs_.end()) {
      violations.push_back("device_free of unknown pointer");
      return;
    }
    accesses_.erase(it->first);
    shadowed_.erase(it->first);
    allocs_.erase(it);
    delete[] static_cast<uint8_t*>(p);
  }
  // Device memory: `device_total` bytes, of which what this
  // backend has allocated is taken.
  uint64_t device_total = uint64_t(80) << 30;
  uint64_t device_allocated() const {
    uint64_t b = 0;
    for (auto& kv : allocs_) b += kv.second;
    return b;
  }
  void mem_get_info(size_t* free_bytes, size_t* total_bytes) override {
    uint64_t used = device_allocated();
    *free_bytes = static_cast<size_t>(device_total - std::min(used, device_total));
    *total_bytes = static_cast<size_t>(device_total);
  }
  void* host_alloc_pinned(size_t bytes) override {
    auto* p = new uint8_t[bytes ? bytes : 1];
    pinned_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return p;
  }
  void host_free_pinned(void* p) noexcept override {
    auto it = pinned_.find(reinterpret_cast<uintptr_t>(p));
    if (it == pinned_.end()) {
      violations.push_back("host_free_pinned of unknown pointer");
      return;
    }
    accesses_.erase(it->first);
    shadowed_.erase(it->first);
    pinned_.erase(it);
    delete[] static_cast<uint8_t*>(p);
  }
  bool host_register(void* p, size_t bytes, bool) override {
    if (refuse_register) fail(LWO_ERR_CUDA, "cudaHostRegister: operation not permitted (injected)");
    uintptr_t b = reinterpret_cast<uintptr_t>(p);
    for (auto& kv : registered_)
      if (b < kv.first + kv.second && kv.first < b + bytes) return false;  // already
    registered_[b] = bytes;
    return true;
  }
  void host_unregister(void* p) noexcept override {
    if (!registered_.erase(reinterpret_cast<uintptr_t>(p)))
      violations.push_back("host_unregister of memory not registered");
    accesses_.erase(reinterpret_cast<uintptr_t>(p));
    shadowed_.erase(reinterpret_cast<uintptr_t>(p));
  }

  StreamH stream_create() override {
    streams_.push_back({});
    return reinterpret_cast<StreamH>(streams_.size() - 1);
  }
  void stream_destroy(StreamH) noexcept override {}
  // The host waits for the stream: work enqueued after this, on any stream,
  // is ordered after the stream's work so far.
  void stream_sync(StreamH stream) override {
    const size_t s = stream_index(stream);
    if (capturing(s))
      violations.push_back(strf("stream_sync of stream s%zu, which is part of a capture", s));
    merge(host_clock_, streams_[s].clock);
  }
  void stream_check(StreamH) override {}

  EventH event_create(bool) override {
    events_.push_back({});
    return reinterpret_cast<EventH>(events_.size());  // 1-based, never NULL
  }
  void event_destroy(EventH) noexcept override {}
  void event_record(EventH e, StreamH stream) override {
    size_t s = stream_index(stream);
    tick(s);
    ++stats.records;
    Event& ev = event(e);
    ev.recorded = true;
    ev.clock = streams_[s].clock;
    ev.in_capture = capturing(s);
    if (keep_log) log.push_back(strf("record e%zu on s%zu", event_index(e), s));
  }
  void stream_wait(StreamH stream, EventH e) override {
    size_t s = stream_index(stream);
    Event& ev = event(e);
    ++stats.waits;
    if (keep_log) log.push_back(strf("wait s%zu on e%zu", s, event_index(e)));
    if (!ev.recorded) return;  // CUDA: waiting on a never-recorded event is a no-op
    if (ev.in_capture && capturing_.empty())
      violations.push_back(strf("stream s%zu waits on event e%zu, last recorded in a capture "
                                "that has ended", s, event_index(e)));
    else if (ev.in_capture && !capturing(s))
      capturing_.push_back(s);  // the stream joins the capture
    else if (!ev.in_capture && capturing(s))
      violations.push_back(strf("a capture's stream s%zu waits on event e%zu recorded outside it",
                                s, event_index(e)));
    merge(streams_[s].clock, ev.clock);
  }
  bool event_done(EventH e) override {
    check_not_captured(e, "event_done");
    return true;
  }
  // A host wait or query of an event last recorded in the capture under way.
  void check_not_captured(EventH e, const char* what) {
    const Event& ev = event(e);
    if (ev.recorded && ev.in_capture && !capturing_.empty())
      violations.push_back(strf("%s of event e%zu, last recorded in the capture under way", what,
                                event_index(e)));
  }
  void event_sync(EventH e) override {
    check_not_captured(e, "event_sync");
    if (on_event_sync) on_event_sync();
    resume();  // a host wait lets a paused launch finish (every event is after it)
    const Event& ev = event(e);
    if (ev.recorded && !ev.in_capture) merge(host_clock_, ev.clock);  // as stream_sync
  }
  float event_elapsed_ms(EventH, EventH) override { return 1.0f; }

  void copy_h2d(void* dst, const void* src, size_t bytes, StreamH stream) override {
    if (fail_copy_after == 0) {
      fail_copy_after = -1;
      fail(LWO_ERR_CUDA, "cudaMemcpyAsync: unspecified launch failure (injected)");
    }
    if (fail_copy_after > 0) --fail_copy_after;
    size_t s = stream_index(stream);
    tick(s);
    ++stats.copies;
    stats.bytes += bytes;
    if (!dma_ready(src, bytes))
      violations.push_back(strf("copy from host %p (%zu bytes) that is not pinned or registered",
                                src, bytes));
    access(s, dst, bytes, /*write=*/true, "copy");
    host_access(s, src, bytes, /*write=*/false, "copy from host");
    copy(s, GraphOp::Copy, dst, src, bytes, &stats.replayed_copies, &stats.replayed_bytes);
    if (keep_log) log.push_back(strf("copy %zu bytes on s%zu", bytes, s));
  }
  void copy_d2h(void* dst, const void* src, size_t bytes, StreamH stream) override {
    size_t s = stream_index(stream);
    tick(s);
    ++stats.d2h_copies;
    stats.d2h_bytes += bytes;
    if (!dma_ready(dst, bytes))
      violations.push_back(strf("copy to host %p (%zu bytes) that is not pinned or registered",
                                dst, bytes));
    access(s, src, bytes, /*write=*/false, "d2h copy");
    if (keep_log) log.push_back(strf("d2h %zu bytes on s%zu", bytes, s));
    host_access(s, dst, bytes, /*write=*/true, "copy to host");
    copy(s, GraphOp::CopyD2H, dst, src, bytes, &stats.replayed_d2h_copies,
         &stats.replayed_d2h_bytes);
  }
  // A device fill is a write of the bytes it sets, like a copy into them.
  void fill_device(void* dst, uint8_t value, size_t bytes, StreamH stream) override {
    size_t s = stream_index(stream);
    tick(s);
    ++stats.fills;
    stats.fill_bytes += bytes;
    access(s, dst, bytes, /*write=*/true, "fill");
    if (capturing(s))
      captured_.push_back({GraphOp::Fill, dst, nullptr, bytes, s,
                           [=] { std::memset(dst, value, bytes); }});
    else
      std::memset(dst, value, bytes);
    if (keep_log) log.push_back(strf("fill %zu bytes on s%zu", bytes, s));
  }
  void comm_info(void* comm, int* n_ranks, int* rank) override {
    auto it = fake_comms.find(comm);
    if (it != fake_comms.end() && it->second.device >= 0 && it->second.device != current_device)
      fail(LWO_ERR_INVALID_ARGUMENT, "communicator %p is on device %d, the engine on device %d",
           comm, it->second.device, current_device);
    ranks(comm, n_ranks, rank);
  }
  // All-gather reads the send part and writes the whole receive range.
  void all_gather(const void* send, void* recv, size_t bytes, void* comm, StreamH stream) override {
    size_t s = stream_index(stream);
    tick(s);
    ++stats.gathers;
    int n_ranks = 1, rank = 0;  // the communicator's
    ranks(comm, &n_ranks, &rank);
    access(s, send, bytes, /*write=*/false, "all-gather send");
    std::vector<uint8_t> mine(static_cast<const uint8_t*>(send),
                              static_cast<const uint8_t*>(send) + bytes);
    for (int k = 0; k < n_ranks; ++k) {
      uint8_t* part = static_cast<uint8_t*>(recv) + bytes * static_cast<size_t>(k);
      std::memcpy(part, mine.data(), bytes);
      if (k != rank && peer_send) peer_send(k, part, bytes);
    }
    access(s, recv, bytes * static_cast<size_t>(n_ranks), /*write=*/true, "all-gather receive");
  }
  void reduce_owned(void* buf, const uint64_t* bounds, void* comm, StreamH stream) override {
    size_t s = stream_index(stream);
    tick(s);
    ++stats.reduces;
    if (keep_log) log.push_back(strf("reduce on s%zu", s));
    int n_ranks = 1, rank = 0;  // the communicator's
    ranks(comm, &n_ranks, &rank);
    uint8_t* b = static_cast<uint8_t*>(buf);
    for (int q = 0; q < n_ranks; ++q) {
      if (bounds[q + 1] < bounds[q] || bounds[q] % 4 || bounds[q + 1] % 4)
        violations.push_back("reduce: bad bounds");
    }
    access(s, b + bounds[0], bounds[n_ranks] - bounds[0], /*write=*/false, "reduce send");
    float* own = reinterpret_cast<float*>(b + bounds[rank]);
    for (uint64_t i = 0; i < (bounds[rank + 1] - bounds[rank]) / 4; ++i)
      own[i] *= static_cast<float>(n_ranks);
    access(s, own, bounds[rank + 1] - bounds[rank], /*write=*/true, "reduce receive");
  }
  // Every rank sends the same floats: the sum is n_ranks times them.
  void all_reduce(void* buf, size_t n_floats, void* comm, StreamH stream) override {
    size_t s = stream_index(stream);
    tick(s);
    ++stats.all_reduces;
    stats.all_reduce_floats += n_floats;
    if (keep_log) log.push_back(strf("all_reduce %zu floats on s%zu", n_floats, s));
    int n = 1, r = 0;
    ranks(comm, &n, &r);
    access(s, buf, n_floats * 4, /*write=*/false, "all-reduce send");
    float* f = static_cast<float*>(buf);
    for (size_t i = 0; i < n_floats; ++i) f[i] *= static_cast<float>(n);
    access(s, buf, n_floats * 4, /*write=*/true, "all-reduce receive");
  }
  void host_func(StreamH stream, void (*fn)(void*), void* arg,
                 const std::vector<HostSpan>& spans) override {
    size_t s = stream_index(stream);
    tick(s);
    ++stats.host_funcs;
    for (const HostSpan& h : spans) host_access(s, h.data, h.bytes, h.write, "host function");
    auto run = [this, fn, arg] {
      if (before_host_func) before_host_func();
      fn(arg);  // the stream's earlier work is already done here
    };
    if (capturing(s))
      captured_.push_back({GraphOp::HostFunc, nullptr, nullptr, 0, s, [this, run] {
                             ++stats.replayed_host_funcs;
                             run();
                           }});
    else
      run();
  }
  void capture_begin(StreamH stream) override {
    size_t s = stream_index(stream);
    if (s == 0) fail(LWO_ERR_CUDA, "recording backend: the legacy stream cannot be captured");
    if (!capturing_.empty()) fail(LWO_ERR_CUDA, "recording backend: a capture is under way");
    capturing_.push_back(s);
    captured_.clear();
    captured_acc_.clear();
  }
  void* capture_end(StreamH stream) override {
    if (capturing_.empty() || capturing_[0] != stream_index(stream))
      fail(LWO_ERR_CUDA, "recording backend: stream %p began no capture", stream);
    const size_t origin = capturing_[0];
    std::vector<size_t> joined;
    joined.swap(capturing_);
    end_capture_accesses();
    const bool invalid = invalidated_;
    invalidated_ = false;
    if (invalid) {
      captured_.clear();
      fail(LWO_ERR_CUDA, "recording backend: the capture was invalidated "
           "(cudaErrorStreamCaptureInvalidated)");
    }
    const Clock& oc = streams_[origin].clock;
    for (size_t j : joined)
      if (j != origin && (j >= oc.size() || oc[j] < streams_[j].clock[j])) {
        captured_.clear();
        fail(LWO_ERR_CUDA, "recording backend: stream s%zu joined the capture and was not "
             "joined back (cudaErrorStreamCaptureUnjoined)", j);
      }
    graphs_.push_back(std::move(captured_));
    graph_acc_.push_back(std::move(captured_acc_));
    captured_.clear();
    captured_acc_.clear();
    return reinterpret_cast<void*>(graphs_.size());  // 1-based
  }
  CaptureStatus capture_status(StreamH stream) override {
    if (!capturing(stream_index(stream))) return CaptureStatus::None;
    return invalidated_ ? CaptureStatus::Invalidated : CaptureStatus::Active;
  }
  // An event record node: at each replay the event takes the launch's
  // position on its stream (a launch is one operation), as an eager record
  // there would; the capture itself records nothing.
  void event_record_in_graph(EventH e, StreamH stream) override {
    const size_t s = stream_index(stream);
    if (!capturing(s)) fail(LWO_ERR_CUDA, "recording backend: stream s%zu is not capturing", s);
    event(e);  // a known event
    if (keep_log) log.push_back(strf("record e%zu in the graph on s%zu", event_index(e), s));
    captured_.push_back({GraphOp::EventRecord, nullptr, nullptr, 0, s, [this, e] {
                           ++stats.records;
                           Event& ev = event(e);
                           ev.recorded = true;
                           ev.clock = launch_clock_;
                           ev.in_capture = false;
                         }});
  }
  // A capture the test begins as a framework would, and ends (returning the
  // graph, as capture_end does).
  void caller_capture_begin(StreamH stream) { capture_begin(stream); }
  void* caller_capture_end(StreamH stream) { return capture_end(stream); }
  // A call the capture cannot hold failed it: it stays under way, invalidated,
  // until its origin ends it (which then fails).
  void invalidate_capture() { invalidated_ = !capturing_.empty(); }
  void graph_launch(void* g, StreamH stream) override {
    size_t i = reinterpret_cast<size_t>(g);
    if (i == 0 || i > graphs_.size()) fail(LWO_ERR_CUDA, "recording backend: unknown graph");
    const size_t L = stream_index(stream);
    tick(L);
    ++launches;
    launch_clock_ = streams_[L].clock;
    // The replay's accesses, as accesses of the launch's stream.
    for (const Acc& a : graph_acc_[i - 1]) {
      const std::string what = std::string("replayed ") + a.what;
      if (a.device)
        access(L, a.p, a.n, a.write, what.c_str());
      else
        host_access(L, a.p, a.n, a.write, what.c_str());
    }
    const std::vector<GraphOp>& ops = graphs_[i - 1];
    for (size_t k = 0; k < ops.size(); ++k) {
      if (pause_at_host_func && ops[k].kind == GraphOp::HostFunc) {
        paused_.assign(ops.begin() + static_cast<std::ptrdiff_t>(k), ops.end());
        return;
      }
      ops[k].run();
    }
  }
  // A test's control of a replay's host work coming late: with
  // pause_at_host_func set, a launch stops before its first host function,
  // and resume() (or any event_sync: the host waits for the GPU) runs the
  // rest of it.
  bool pause_at_host_func = false;
  void resume() {
    std::vector<GraphOp> rest;
    rest.swap(paused_);
    for (GraphOp& op : rest) op.run();
  }
  void graph_destroy(void* g) noexcept override {
    size_t i = reinterpret_cast<size_t>(g);
    if (i && i <= graphs_.size()) {
      graphs_[i - 1].clear();
      graph_acc_[i - 1].clear();
    }
  }
  uint64_t launches = 0;
  size_t captured_ops() const { return captured_.size(); }
  // The operations of the graph ended last (empty once destroyed).
  const std::vector<GraphOp>& graph_ops() const {
    static const std::vector<GraphOp> none;
    return graphs_.empty() ? none : graphs_.back();
  }
  // A kernel writing [ptr, ptr+n) on `stream` (for gradients).
  void write(StreamH stream, void* ptr, size_t n) {
    size_t s = stream_index(stream);
    tick(s);
    access(s, ptr, n, /*write=*/true, "kernel write");
  }

 private:
  // The ranks of `comm`: its fake_comms entry, or fake_ranks / fake_rank.
  void ranks(const void* comm, int* n_ranks, int* rank) const {
    auto it = fake_comms.find(comm);
    *n_ranks = it != fake_comms.end() ? it->second.n_ranks : fake_ranks;
    *rank = it != fake_comms.end() ? it->second.rank : fake_rank;
  }
  Clock launch_clock_;  // the last launch's position on its stream (event record nodes')
  struct StreamState {
    Clock clock;
  };
  struct Event {
    bool recorded = false;
    bool in_capture = false;  // last recorded on a stream of the capture
    Clock clock;
  };
  bool capturing(size_t s) const {
    return std::find(capturing_.begin(), capturing_.end(), s) != capturing_.end();
  }
  // A copy on stream s: now, or kept by the capture and counted in (*n, *b)
  // at each launch.
  void copy(size_t s, GraphOp::Kind kind, void* dst, const void* src, size_t bytes, uint64_t* n,
            uint64_t* b) {
    if (!capturing(s)) {
      std::memcpy(dst, src, bytes);
      return;
    }
    captured_.push_back({kind, dst, src, bytes, s, [dst, src, bytes, n, b] {
                           std::memcpy(dst, src, bytes);
                           ++*n;
                           *b += bytes;
                         }});
  }
  std::vector<size_t> capturing_;                    // the capture's streams, its origin first
  std::vector<GraphOp> captured_;                    // the capture's copies and fills
  std::vector<std::vector<GraphOp>> graphs_;
  // An access a capture made, checked again at each launch.
  struct Acc {
    const void* p;
    size_t n;
    bool write, device;
    std::string what;
  };
  std::vector<Acc> captured_acc_;
  std::vector<std::vector<Acc>> graph_acc_;
  bool invalidated_ = false;
  std::vector<GraphOp> paused_;  // the rest of a paused launch
  struct Access {
    size_t begin, end;  // offsets within the allocation
    size_t stream;
    uint64_t epoch;     // the stream's own clock value at the access
    bool write;
    bool captured = false;  // made in a capture: checked there, gone at its end
  };
  // Accesses from outside a capture that a captured write covered: back at
  // the capture's end (the captured write never ran; its launches run it).
  std::map<uintptr_t, std::vector<Access>> shadowed_;
  // The capture ended: its accesses never ran (each launch makes them anew).
  void end_capture_accesses() {
    for (auto& kv : accesses_) {
      std::vector<Access>& list = kv.second;
      list.erase(std::remove_if(list.begin(), list.end(), [](const Access& a) { return a.captured; }),
                 list.end());
    }
    for (auto& kv : shadowed_) {
      std::vector<Access>& list = accesses_[kv.first];
      list.insert(list.begin(), kv.second.begin(), kv.second.end());
    }
    shadowed_.clear();
  }

  size_t stream_index(StreamH s) {
    size_t i = reinterpret_cast<size_t>(s);
    if (i >= streams_.size()) fail(LWO_ERR_CUDA, "recording backend: unknown stream %zu", i);
    return i;
  }
  size_t event_index(EventH e) { return reinterpret_cast<size_t>(e); }
  Event& event(EventH e) {
    size_t i = event_index(e);
    if (i == 0 || i > events_.size()) fail(LWO_ERR_CUDA, "recording backend: unknown event");
    return events_[i - 1];
  }
  static void merge(Clock& into, const Clock& from) {
    if (into.size() < from.size()) into.resize(from.size(), 0);
    for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
  }
  // A new operation on stream s, after whatever the host has waited for.
  void tick(size_t s) {
    Clock& c = streams_[s].clock;
    merge(c, host_clock_);
    if (c.size() <= s) c.resize(s + 1, 0);
    ++c[s];
  }
  bool ordered_before(const Access& a, size_t s) const {
    const Clock& c = streams_[s].clock;
    return a.stream < c.size() && c[a.stream] >= a.epoch;
  }
  bool dma_ready(const void* p, size_t n) const {
    uintptr_t b = reinterpret_cast<uintptr_t>(p);
    auto inside = [&](const std::map<uintptr_t, size_t>& m) {
      auto it = m.upper_bound(b);
      if (it == m.begin()) return false;
      --it;
      return b + n <= it->first + it->second;
    };
    return inside(registered_) || inside(pinned_);
  }
  // The region of `m` holding [p, p + n), or m.end().
  static std::map<uintptr_t, size_t>::const_iterator region(const std::map<uintptr_t, size_t>& m,
                                                            const void* p, size_t n) {
    uintptr_t b = reinterpret_cast<uintptr_t>(p);
    auto it = m.upper_bound(b);
    if (it == m.begin() || b + n > std::prev(it)->first + std::prev(it)->second) return m.end();
    return std::prev(it);
  }
  void access(size_t s, const void* p, size_t n, bool write, const char* what) {
    if (capturing(s)) captured_acc_.push_back({p, n, write, true, what});
    auto it = region(allocs_, p, n);
    if (it == allocs_.end()) {
      violations.push_back(strf("%s of %zu bytes at %p outside any device allocation", what, n, p));
      return;
    }
    check_access(it->first, s, p, n, write, what);
  }
  // Stream-ordered access to pinned or registered host memory (other host
  // memory is not tracked).
  void host_access(size_t s, const void* p, size_t n, bool write, const char* what) {
    if (n == 0) return;
    if (capturing(s)) captured_acc_.push_back({p, n, write, false, what});
    auto it = region(registered_, p, n);
    if (it != registered_.end()) return check_access(it->first, s, p, n, write, what);
    it = region(pinned_, p, n);
    if (it != pinned_.end()) check_access(it->first, s, p, n, write, what);
  }
  void check_access(uintptr_t base, size_t s, const void* p, size_t n, bool write,
                    const char* what) {
    auto it = accesses_.emplace(base, std::vector<Access>()).first;
    size_t off = reinterpret_cast<uintptr_t>(p) - base;
    std::vector<Access>& list = it->second;
    Access me{off, off + n, s, streams_[s].clock[s], write, capturing(s)};
    for (const Access& a : list) {
      bool overlap = a.begin < me.end && me.begin < a.end;
      if (!overlap) continue;
      // A write must follow every earlier access; a read must follow writes.
      if ((write || a.write) && !ordered_before(a, s))
        violations.push_back(strf("%s on stream %zu of bytes [%zu, %zu) of allocation %p is not "
                                  "ordered after the %s on stream %zu (epoch %llu)",
                                  what, s, me.begin, me.end, reinterpret_cast<void*>(base),
                                  a.write ? "copy" : "read", a.stream,
                                  static_cast<unsigned long long>(a.epoch)));
    }
    if (write)  // accesses wholly overwritten are covered by this one from now on
      list.erase(std::remove_if(list.begin(), list.end(),
                                [&](const Access& a) {
                                  const bool covered = a.begin >= me.begin && a.end <= me.end;
                                  if (covered && me.captured && !a.captured)
                                    shadowed_[base].push_back(a);
                                  return covered;
                                }),
                 list.end());
    list.push_back(me);
  }

  std::vector<StreamState> streams_;
  std::vector<Event> events_;
  Clock host_clock_;  // what the host has waited for (stream_sync, event_sync)
  std::map<uintptr_t, size_t> allocs_, pinned_, registered_;
  std::map<uintptr_t, std::vector<Access>> accesses_;
};

}  // namespace testing
}  // namespace lwo
