// The host backend (backend.h, make_host_backend): the engine on host memory,
// for tests of the library's users on machines with no GPU.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "comm.h"
#include "src/common/error.h"

namespace lwo {
namespace {

constexpr size_t kAlign = 256;                      // as cudaMalloc's alignment (at least)
constexpr uint64_t kTotalBytes = uint64_t(64) << 30;  // the "device" the budget sees

// ---- Communicators: in-process worlds of N ranks ----
// Each rank of a world is an engine driven from its own thread of this
// process. A rank's communicator is a Member (its world and its rank);
// the world lives until its last member is destroyed. Every collective is a
// rendezvous (World::meet) run when enqueued, as all host backend work is.

std::atomic<int64_t> g_timeout_ms{
    std::chrono::duration_cast<std::chrono::milliseconds>(kHostCommTimeout).count()};

double timeout_s() { return static_cast<double>(g_timeout_ms.load()) / 1000.0; }

// "1, 3" for the ranks k with done[k] < seq.
std::string missing_ranks(const std::vector<uint64_t>& done, uint64_t seq) {
  std::string s;
  for (size_t k = 0; k < done.size(); ++k)
    if (done[k] < seq) s += strf("%s%zu", s.empty() ? "" : ", ", k);
  return s;
}

enum class Op { AllGather, ReduceOwned, AllReduce, Split };

// One rank's side of a collective: what it is, and what it reads from.
struct Post {
  Op op = Op::AllGather;
  uint64_t bytes = 0;            // per rank (all_gather), of the buffer (the reductions)
  const void* src = nullptr;     // its input
  std::vector<uint64_t> bounds;  // reduce_owned's
  int color = 0, key = 0;        // comm_split's
};

std::string describe(const Post& p) {
  switch (p.op) {
    case Op::AllGather:
      return strf("all_gather of %llu bytes per rank", static_cast<unsigned long long>(p.bytes));
    case Op::ReduceOwned:
      return strf("reduce_owned of %llu bytes", static_cast<unsigned long long>(p.bytes));
    case Op::AllReduce:
      return strf("all_reduce of %llu floats", static_cast<unsigned long long>(p.bytes / 4));
    case Op::Split:
      return "comm_split";
  }
  return "?";
}

bool agree(const Post& a, const Post& b) {
  return a.op == b.op && a.bytes == b.bytes && a.bounds == b.bounds;
}

struct World {
  explicit World(int n_ranks)
      : n(n_ranks), posted(n_ranks, 0), read(n_ranks, 0), posts(n_ranks) {}
  const int n;
  std::mutex mu;
  std::condition_variable cv;
  // Per rank, the number of its collectives posted and read: rank k's c-th
  // collective is posted (its Post in posts[k]) once posted[k] == c, and
  // read (it no longer reads any rank's input) once read[k] == c.
  std::vector<uint64_t> posted, read;
  std::vector<Post> posts;
  std::string broken;  // a rank missed a deadline: every later call fails with this
  // The worlds a split makes, by (collective number, color), until each of
  // their ranks has taken its own.
  struct Child {
    std::shared_ptr<World> world;
    int taken = 0;
  };
  std::map<std::pair<uint64_t, int>, Child> children;

  // Waits (lock held) until every rank's done[k] reaches seq; past the
  // deadline, breaks the world and throws LWO_ERR_NCCL naming `what`, the
  // ranks missing and the stage.
  void wait_all(std::unique_lock<std::mutex>& lock, const std::vector<uint64_t>& done,
                uint64_t seq, int rank, const std::string& what, const char* stage,
                std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      if (!broken.empty())
        fail(LWO_ERR_NCCL, "rank %d of %d, %s: %s", rank, n, what.c_str(), broken.c_str());
      if (missing_ranks(done, seq).empty()) return;
      if (cv.wait_until(lock, deadline) == std::cv_status::timeout &&
          !missing_ranks(done, seq).empty() && broken.empty()) {
        broken = strf("host communicator of %d ranks: rank(s) %s did not %s collective %llu "
                      "(%s) within %.3g s; the communicator is unusable now",
                      n, missing_ranks(done, seq).c_str(), stage,
                      static_cast<unsigned long long>(seq), what.c_str(), timeout_s());
        cv.notify_all();
      }
    }
  }

  // Rank `rank`'s collective number `seq`: posts `mine`, waits until every
  // rank has posted its collective number `seq`, checks that they agree
  // (LWO_ERR_COLLECTIVE_MISMATCH on every rank otherwise), runs
  // read(posts) with the lock held (it reads the others' inputs into memory
  // of its own and writes nothing another rank reads), then waits until
  // every rank has read: only then may the caller write its output, which
  // may be its own input (reduce_owned is in place).
  template <class Read>
  void meet(int rank, uint64_t seq, Post mine, Read&& read_inputs) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(g_timeout_ms.load());
    const std::string what = describe(mine);
    std::unique_lock<std::mutex> lock(mu);
    if (!broken.empty())
      fail(LWO_ERR_NCCL, "rank %d of %d, %s: %s", rank, n, what.c_str(), broken.c_str());
    posts[rank] = std::move(mine);
    posted[rank] = seq;
    cv.notify_all();
    wait_all(lock, posted, seq, rank, what, "reach", deadline);
    // Every rank compares every post with its own: all see the same posts,
    // so either all agree or every rank finds one that differs from its own.
    std::string diff;
    for (int k = 0; k < n; ++k)
      if (!agree(posts[k], posts[rank])) diff = "differs";
    if (!diff.empty()) {
      diff.clear();
      for (int k = 0; k < n; ++k)
        diff += strf("%srank %d: %s", k ? "; " : "", k, describe(posts[k]).c_str());
    } else {
      read_inputs(posts);
    }
    this->read[rank] = seq;
    cv.notify_all();
    wait_all(lock, this->read, seq, rank, what, "finish reading the inputs of", deadline);
    if (!diff.empty())
      fail(LWO_ERR_COLLECTIVE_MISMATCH,
           "rank %d of %d, collective %llu of the host communicator: the ranks are not making "
           "the same call (%s)",
           rank, n, static_cast<unsigned long long>(seq), diff.c_str());
  }
};

struct Member {
  std::shared_ptr<World> world;
  int rank;
  uint64_t seq = 0;  // this rank's collectives so far (under the world's lock)
};

void destroy_comm(void* comm) { delete static_cast<Member*>(comm); }

void* make_comm(std::shared_ptr<World> world, int rank) {
  auto* m = new Member{std::move(world), rank};
  try {
    register_comm(m, destroy_comm);
  } catch (...) {
    delete m;
    throw;
  }
  return m;
}

// The worlds being formed by lwo_nccl_comm_create, by unique id.
struct Forming {
  explicit Forming(int n_ranks)
      : n(n_ranks), joined(n_ranks, false), world(std::make_shared<World>(n_ranks)) {}
  const int n;
  std::vector<bool> joined;
  int count = 0;
  std::shared_ptr<World> world;
  lwo_status_t status = LWO_OK;  // failed: every rank waiting fails with this
  std::string failed;
};
struct Forum {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::shared_ptr<Forming>> forming;
};
Forum& forum() {
  static Forum* f = new Forum;  // never destroyed: usable at exit
  return *f;
}

std::string id_hex(const std::string& id) {
  std::string s;
  for (size_t i = 0; i < 4 && i < id.size(); ++i)
    s += strf("%02x", static_cast<unsigned>(static_cast<uint8_t>(id[i])));
  return s + "..";
}

// Rank `rank` of `n` joins the world of unique id `id` (kNcclUniqueIdBytes
// bytes), blocking until all n have joined.
std::shared_ptr<World> join_world(const void* id, int n, int rank) {
  const std::string key(static_cast<const char*>(id), kNcclUniqueIdBytes);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(g_timeout_ms.load());
  Forum& f = forum();
  std::unique_lock<std::mutex> lock(f.mu);
  std::shared_ptr<Forming>& slot = f.forming[key];
  if (!slot) slot = std::make_shared<Forming>(n);
  std::shared_ptr<Forming> w = slot;
  // Bad input fails the ranks waiting too: the world can never form.
  auto refuse = [&](lwo_status_t status, const std::string& msg) {
    w->status = status;
    w->failed = msg;
    f.forming.erase(key);
    f.cv.notify_all();
    fail(status, "%s", msg.c_str());
  };
  if (w->n != n)
    refuse(LWO_ERR_COLLECTIVE_MISMATCH,
           strf("rank %d of %d ranks: the ranks that joined communicator id %s first gave "
                "n_ranks %d; every rank must give the same n_ranks",
                rank, n, id_hex(key).c_str(), w->n));
  if (w->joined[rank])
    refuse(LWO_ERR_INVALID_ARGUMENT,
           strf("rank %d of %d ranks: rank %d has joined communicator id %s already (each rank "
                "joins once)",
                rank, n, rank, id_hex(key).c_str()));
  w->joined[rank] = true;
  if (++w->count == n) {
    f.forming.erase(key);
    f.cv.notify_all();
    return w->world;
  }
  while (w->count < n && w->status == LWO_OK) {
    if (f.cv.wait_until(lock, deadline) == std::cv_status::timeout && w->count < n &&
        w->status == LWO_OK) {
      std::string missing;
      for (int k = 0; k < n; ++k)
        if (!w->joined[k]) missing += strf("%s%d", missing.empty() ? "" : ", ", k);
      w->status = LWO_ERR_NCCL;
      w->failed = strf("communicator id %s of %d ranks: rank(s) %s did not join within %.3g s",
                       id_hex(key).c_str(), n, missing.c_str(), timeout_s());
      auto it = f.forming.find(key);
      if (it != f.forming.end() && it->second == w) f.forming.erase(it);
      f.cv.notify_all();
    }
  }
  if (w->status != LWO_OK) fail(w->status, "rank %d of %d ranks: %s", rank, n, w->failed.c_str());
  return w->world;
}

class HostBackend final : public Backend {
 public:
  explicit HostBackend(bool poison) : poison_(poison) {}
  ~HostBackend() override {
    for (auto& kv : allocs_) std::free(reinterpret_cast<void*>(kv.first));
  }

  int get_device() override { return device_; }
  void set_device(int device) override { device_ = device; }

  void* device_alloc(size_t bytes) override {
    void* p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign + kAlign);
    if (!p) fail(LWO_ERR_OUT_OF_MEMORY, "host backend: device_alloc of %zu bytes failed", bytes);
    std::memset(p, 0xA5, bytes);  // never zero by chance: unwritten bytes show
    std::lock_guard<std::mutex> lock(mu_);
    allocs_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return p;
  }
  void device_free(void* ptr) noexcept override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocs_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocs_.end()) return;
    const uintptr_t b = it->first, e = it->first + it->second;
    for (auto s = shadows_.lower_bound(b); s != shadows_.end() && s->first < e;)
      s = shadows_.erase(s);
    allocs_.erase(it);
    std::free(ptr);
  }
  void mem_get_info(size_t* free_bytes, size_t* total_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t used = 0;
    for (auto& kv : allocs_) used += kv.second;
    *free_bytes = static_cast<size_t>(kTotalBytes - std::min(used, kTotalBytes));
    *total_bytes = static_cast<size_t>(kTotalBytes);
  }

  void* host_alloc_pinned(size_t bytes) override {
    void* p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign + kAlign);
    if (!p)
      fail(LWO_ERR_OUT_OF_MEMORY, "host backend: host_alloc_pinned of %zu bytes failed", bytes);
    return p;
  }
  void host_free_pinned(void* ptr) noexcept override { std::free(ptr); }
  bool host_register(void*, size_t, bool) override { return true; }
  void host_unregister(void*) noexcept override {}

  // Streams: tokens. Work runs when enqueued, so each stream is in order and
  // every stream is ordered after all work enqueued before.
  StreamH stream_create() override { return new char(0); }
  void stream_destroy(StreamH stream) noexcept override { delete static_cast<char*>(stream); }
  void stream_sync(StreamH) override {}
  void stream_check(StreamH) override {}

  // Events: the host clock when recorded (the work before it is done then).
  EventH event_create(bool) override { return new double(0.0); }
  void event_destroy(EventH event) noexcept override { delete static_cast<double*>(event); }
  void event_record(EventH event, StreamH) override {
    *static_cast<double*>(event) =
        std::chrono::duration<double, std::milli>(
            std::chrono::steady_clock::now().time_since_epoch())
            .count();
  }
  void stream_wait(StreamH, EventH) override {}
  bool event_done(EventH) override { return true; }
  void event_sync(EventH) override {}
  float event_elapsed_ms(EventH start, EventH end) override {
    return static_cast<float>(*static_cast<double*>(end) - *static_cast<double*>(start));
  }

  // Streams run their work when it is enqueued: the fill is done here.
  void fill_device(void* dst, uint8_t value, size_t bytes, StreamH) override {
    std::memset(dst, value, bytes);
  }
  void copy_h2d(void* dst, const void* src, size_t bytes, StreamH) override {
    unpoison(dst, bytes);
    std::memcpy(dst, src, bytes);
  }
  void copy_d2h(void* dst, const void* src, size_t bytes, StreamH) override {
    std::memcpy(dst, src, bytes);
  }

  // Communicators (no NCCL), registered like NCCL's (engine/comm.h) so
  // lwo_nccl_comm_destroy destroys them: one rank, or N ranks of one process
  // that meet by the unique id's bytes, each an engine on its own thread.
  // Collectives run when enqueued: each blocks its thread until every rank
  // of the communicator has made the same call (World::meet).
  void* comm_create(const void* id, int n_ranks, int rank) override {
    if (n_ranks == 1) return make_comm(std::make_shared<World>(1), 0);
    return make_comm(join_world(id, n_ranks, rank), rank);
  }
  void* comm_split(void* parent, int color, int key) override {
    Member& m = member(parent);
    World& w = *m.world;
    std::shared_ptr<World> child;
    int child_rank = 0;
    Post mine;
    mine.op = Op::Split;
    mine.color = color;
    mine.key = key;
    const uint64_t seq = next_seq(m);
    w.meet(m.rank, seq, std::move(mine), [&](const std::vector<Post>& posts) {
      // The ranks of this color, by key, ties by parent rank (as NCCL).
      std::vector<int> group;
      for (int k = 0; k < w.n; ++k)
        if (posts[k].color == color) group.push_back(k);
      std::stable_sort(group.begin(), group.end(),
                       [&](int a, int b) { return posts[a].key < posts[b].key; });
      child_rank =
          static_cast<int>(std::find(group.begin(), group.end(), m.rank) - group.begin());
      World::Child& c = w.children[{seq, color}];
      if (!c.world) c.world = std::make_shared<World>(static_cast<int>(group.size()));
      child = c.world;
      if (++c.taken == c.world->n) w.children.erase({seq, color});
    });
    return make_comm(std::move(child), child_rank);
  }
  void comm_info(void* comm, int* n_ranks, int* rank) override {
    const Member& m = member(comm);
    *n_ranks = m.world->n;
    *rank = m.rank;
  }
  void all_gather(const void* send, void* recv, size_t bytes, void* comm, StreamH) override {
    Member& m = member(comm);
    const int n = m.world->n;
    std::vector<uint8_t> got(bytes * static_cast<size_t>(n));
    Post mine;
    mine.op = Op::AllGather;
    mine.bytes = bytes;
    mine.src = send;
    m.world->meet(m.rank, next_seq(m), std::move(mine), [&](const std::vector<Post>& posts) {
      for (int k = 0; k < n; ++k)
        if (bytes) std::memcpy(got.data() + bytes * static_cast<size_t>(k), posts[k].src, bytes);
    });
    unpoison(recv, got.size());
    if (!got.empty()) std::memcpy(recv, got.data(), got.size());
  }
  // Rank q's part is the f32 sum over the ranks in rank order, so every
  // rank's sums are the same bits whichever rank computes them.
  void reduce_owned(void* buf, const uint64_t* bounds, void* comm, StreamH) override {
    Member& m = member(comm);
    const int n = m.world->n;
    Post mine;
    mine.op = Op::ReduceOwned;
    mine.bytes = bounds[n];
    mine.src = buf;
    mine.bounds.assign(bounds, bounds + n + 1);
    sum_range(m, std::move(mine), bounds[m.rank], bounds[m.rank + 1]);
  }
  // Every rank's buf becomes the f32 sum in rank order.
  void all_reduce(void* buf, size_t n_floats, void* comm, StreamH) override {
    const uint64_t bytes = n_floats * sizeof(float);
    Post mine;
    mine.op = Op::AllReduce;
    mine.bytes = bytes;
    mine.src = buf;
    sum_range(member(comm), std::move(mine), 0, bytes);
  }

  void host_func(StreamH, void (*fn)(void*), void* arg, const std::vector<HostSpan>&) override {
    fn(arg);  // the stream's earlier work is done: it ran when enqueued
  }

  // Poison: a released slot's bytes are kept aside and the slot filled with
  // 0xff (NaN in every float dtype), so a read after the release shows; an
  // acquire of the slot again (a hit) puts them back, a fill drops them.
  void slot_released(void* ptr, size_t bytes, StreamH) override {
    if (!poison_ || !bytes) return;
    std::lock_guard<std::mutex> lock(mu_);
    // Released again without an acquire between (a hit never acquired): the
    // kept bytes are still the slot's.
    if (shadows_.count(reinterpret_cast<uintptr_t>(ptr))) return;
    auto* p = static_cast<uint8_t*>(ptr);
    std::vector<uint8_t>& keep = shadows_[reinterpret_cast<uintptr_t>(ptr)];
    keep.assign(p, p + bytes);
    std::memset(p, 0xff, bytes);
  }
  void slot_reclaimed(void* ptr, size_t bytes, StreamH) override { unpoison(ptr, bytes); }
  void slot_handed_out(void* ptr, size_t bytes, StreamH) override {
    if (poison_) std::memset(ptr, 0xff, bytes);
  }
  bool compute_on_host() const override { return true; }

 private:
  // Puts back the kept bytes of every released slot overlapping [ptr, ptr + n).
  void unpoison(void* ptr, size_t n) {
    if (!poison_) return;
    std::lock_guard<std::mutex> lock(mu_);
    const uintptr_t b = reinterpret_cast<uintptr_t>(ptr), e = b + n;
    auto s = shadows_.upper_bound(b);
    if (s != shadows_.begin()) --s;
    while (s != shadows_.end() && s->first < e) {
      if (s->first + s->second.size() <= b) {
        ++s;
        continue;
      }
      std::memcpy(reinterpret_cast<void*>(s->first), s->second.data(), s->second.size());
      s = shadows_.erase(s);
    }
  }

  // The host backend's own communicator, or LWO_ERR_UNSUPPORTED.
  static Member& member(void* comm) {
    if (!registered_with(comm, destroy_comm))
      fail(LWO_ERR_UNSUPPORTED,
           "communicator %p: the host backend has collectives only over the communicators it "
           "makes (its one-rank communicators and its in-process ones of N ranks: "
           "lwo_nccl_comm_create, lwo_nccl_comm_split)",
           comm);
    return *static_cast<Member*>(comm);
  }
  // A reduction (`mine`, in place at mine.src): bytes [lo, hi) of this
  // rank's buffer become the f32 sum over the ranks, in rank order.
  static void sum_range(Member& m, Post mine, uint64_t lo, uint64_t hi) {
    const int n = m.world->n;
    uint8_t* buf = static_cast<uint8_t*>(const_cast<void*>(mine.src));
    std::vector<float> sum((hi - lo) / sizeof(float));
    m.world->meet(m.rank, next_seq(m), std::move(mine), [&](const std::vector<Post>& posts) {
      if (sum.empty()) return;
      std::memcpy(sum.data(), static_cast<const uint8_t*>(posts[0].src) + lo, hi - lo);
      for (int k = 1; k < n; ++k) {
        const auto* in =
            reinterpret_cast<const float*>(static_cast<const uint8_t*>(posts[k].src) + lo);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += in[i];
      }
    });
    if (!sum.empty()) std::memcpy(buf + lo, sum.data(), hi - lo);
  }
  // The number of rank m's next collective.
  static uint64_t next_seq(Member& m) {
    std::lock_guard<std::mutex> lock(m.world->mu);
    return ++m.seq;
  }

  const bool poison_;
  int device_ = 0;
  std::mutex mu_;
  std::map<uintptr_t, size_t> allocs_;
  std::map<uintptr_t, std::vector<uint8_t>> shadows_;  // released slots: their bytes
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(bool poison) {
  return std::make_unique<HostBackend>(poison);
}

std::chrono::milliseconds set_host_comm_timeout(std::chrono::milliseconds timeout) {
  return std::chrono::milliseconds(g_timeout_ms.exchange(timeout.count()));
}

}  // namespace lwo
