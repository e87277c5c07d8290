// bench_shard: host weights sharded across N ranks of this process (N threads,
// rank r on GPU r, each with its own engine and NCCL communicator). Every
// rank holds 1/N of each layer's record in a sharded pool (lwo_pool_create_
// sharded); its rings copy that shard up its own link and all-gather the
// record from the other GPUs. Measured in one run, for each rank count:
//
//  1. per GPU, the raw pinned host-to-device peak of shard-sized copies,
//     each GPU alone and all GPUs at once (the condition sharded streaming
//     runs under); with training, the device-to-host peak of gradient
//     shards, all GPUs at once;
//  2. the in-place ncclAllGather of one record over the ranks' communicator
//     (and, with training, the in-place ncclReduceScatter of one layer's f32
//     gradient, as the library reduces it);
//  3. forward streaming: every rank streams all layers pass after pass
//     through a ring, a checksum kernel reading every slot; the first (warm-
//     up) pass and the timed passes are checked against checksums computed
//     on the host from the generator's formula. Effective bandwidth per GPU
//     = layers x record bytes x passes / the rank's own time (CUDA events);
//     the slowest rank is reported, and its ratio to the link peak;
//  4. training (unless --no-train): per step, forward over every layer with
//     lwo_linear_forward, backward in reverse with lwo_linear_backward (the
//     weight gradient into lwo_grads_begin's view, then lwo_grads_end, which
//     sums it over the ranks and sends this rank's shard to host; then dx),
//     lwo_grads_wait. Timed against the bound max(resident compute, H2D
//     bytes / H2D peak, D2H bytes / D2H peak, the collectives' time on the
//     communication stream), every term measured in the same run; the host
//     gradient shards of the first and last layer are checked against N x
//     the resident dy^T x.
//
// The record of layer l is the same as `lwo run --seed S` makes: the bytes of
// the stream of testkit::key_of(S, l) (8-byte word i is counter_word(key, i)).
// Each rank writes only the words of its shard, and zero beyond the record.
//
// The JSON file holds {"tool", "command", "version", "config", "devices",
// "results": [...]}, with one result per rank count, each on its own line
// beginning {"ranks": (scripts/scale merges files by those lines). A result
// has, among others: ranks, record_bytes, shard_bytes; peak_h2d_gbps_per_gpu
// (the fastest rank's link alone: the conservative reference) and
// peak_h2d_together_gbps_per_gpu (the slowest rank, all GPUs at once);
// allgather_gbps (record bytes / time of one all-gather, the slowest rank;
// null for one rank) and allgather_busbw_gbps; forward_gbps_per_gpu (the
// slowest rank), forward_aggregate_gbps (the sum), forward_ratio_to_peak
// (forward_gbps_per_gpu / peak_h2d_gbps_per_gpu); and with training
// train_step_ms (median over steps of the slowest rank's step),
// train_gbps_per_gpu (2 x layers x record bytes / step), train_bound_ms,
// train_bound_term, train_ratio_to_bound, resident_ms; per_rank holds each
// rank's figures. Figures not measured are null.
#include <nccl.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>  // hardware_concurrency
#include <vector>

#include "src/common/thread_pool.h"
#include "testkit/checksum.h"
#include "testkit/copy.h"
#include "testkit/workload.h"
#include "tools/cli.h"

namespace cli {
namespace {

constexpr uint64_t kPeakBytes = uint64_t(2) << 30;  // bytes per round of a peak measurement
constexpr int kGraceSeconds = 30;  // after a rank fails, how long the others may take to stop
constexpr uint64_t kChunk = uint64_t(4) << 20;       // bytes per host work item (fill_bf16)

struct Options {
  std::vector<uint32_t> ranks;  // empty: every GPU
  uint32_t layers = 32;
  int64_t rows = 8192, cols = 8192, tokens = 8192;
  uint32_t depth = 2, grad_depth = 2, passes = 5;
  uint64_t seed = 1;
  bool train = true, check_collectives = false;
  bool ranks_given = false, list_given = false;  // --ranks, --ranks-list
  std::string json;
};

// What every rank reads: the layer descriptions, the checksums of the whole
// records, and for training the inputs and a resident copy of layer 0.
struct Model {
  Options o;
  lwo_tensor_desc tensor{};
  std::vector<lwo_layer_desc> layers;
  uint64_t record_bytes = 0;
  std::vector<uint64_t> expect;   // checksum of each layer's whole record
  std::vector<uint16_t> x, dy;    // bf16 [tokens, cols] and [tokens, rows]
  std::vector<uint8_t> resident;  // the record of layer 0
  uint64_t shard_bytes(uint32_t n_ranks) const {
    return align_up((record_bytes + n_ranks - 1) / n_ranks, LWO_RECORD_ALIGN);
  }
};

// --- the records' bytes, from their formula -----------------------------------

// lwo::kernels::checksum of each layer's whole record, from the formula
// (testkit::checksum_generated): no memory is read.
std::vector<uint64_t> record_checksums(uint64_t seed, uint32_t n_layers, uint64_t record_bytes) {
  std::vector<uint64_t> out(n_layers);
  for (uint32_t l = 0; l < n_layers; ++l)
    out[l] = testkit::checksum_generated(testkit::key_of(seed, l), record_bytes);
  return out;
}

// Finite bf16 values of magnitude in [2^-7, 2), either sign: element i from
// word i of the stream of `key`.
void fill_bf16(std::vector<uint16_t>& v, uint64_t key) {
  const uint64_t per_item = kChunk / 2;
  testkit::parallel_for((v.size() + per_item - 1) / per_item, [&](size_t item) {
    const uint64_t b = item * per_item, e = std::min<uint64_t>(v.size(), b + per_item);
    for (uint64_t i = b; i < e; ++i) {
      const uint64_t w = testkit::counter_word(key, i);
      v[i] = static_cast<uint16_t>(((w >> 63) << 15) | ((120 + ((w >> 8) & 7)) << 7) | (w & 0x7f));
    }
  });
}

// --- errors that name the rank -------------------------------------------------

struct Aborted {};  // another rank failed; its message says why

// Coordinates the rank threads of one rank count: a barrier that another
// rank's failure breaks, and the main thread's wait for the ranks.
class Coord {
 public:
  explicit Coord(uint32_t n) : n_(n), done_(n, false) {}
  uint32_t n_ranks() const { return n_; }
  lwo_nccl_unique_id id{};

  void barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    if (failed_) throw Aborted{};
    const uint64_t generation = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation || failed_; });
    if (generation_ == generation) throw Aborted{};
  }
  void fail_now() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) failed_at_ = std::chrono::steady_clock::now();
    failed_ = true;
    cv_.notify_all();
  }
  void finish(uint32_t rank) {
    std::lock_guard<std::mutex> lock(mu_);
    done_[rank] = true;
    ++finished_;
    cv_.notify_all();
  }
  // Waits until every rank has finished; returns false if one failed. Ranks
  // that are still running kGraceSeconds after a failure wait in a collective
  // for the failed rank and never will return: then it says which, removes
  // `json_path` and exits the process.
  bool wait_all(const std::string& json_path) {
    std::unique_lock<std::mutex> lock(mu_);
    while (finished_ < n_) {
      if (!failed_) {
        cv_.wait(lock);
        continue;
      }
      if (cv_.wait_until(lock, failed_at_ + std::chrono::seconds(kGraceSeconds)) ==
              std::cv_status::timeout &&
          finished_ < n_) {
        std::string which;
        for (uint32_t r = 0; r < n_; ++r)
          if (!done_[r]) which += strf("%s%u", which.empty() ? "" : ", ", r);
        std::fprintf(stderr,
                     "bench_shard: rank %s still running %d s after the failure above (waiting in a "
                     "collective for the failed rank, most likely); exiting without cleanup\n",
                     which.c_str(), kGraceSeconds);
        if (!json_path.empty()) std::remove(json_path.c_str());
        std::fflush(stdout);
        std::fflush(stderr);
        std::_Exit(kExitFailure);
      }
    }
    return !failed_;
  }

 private:
  const uint32_t n_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint32_t arrived_ = 0, finished_ = 0;
  uint64_t generation_ = 0;
  bool failed_ = false;
  std::chrono::steady_clock::time_point failed_at_;
  std::vector<bool> done_;
};

// The number of CUDA devices; with none, stops as Device(0) does (the
// library's message says why).
int device_count() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n > 0) return n;
  (void)cudaGetLastError();
  const Device probe(0);
  fail(strf("cudaGetDeviceCount: %s", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"));
}

thread_local int t_rank = -1;
thread_local Coord* t_coord = nullptr;

// Tells the other ranks (their next barrier throws Aborted), prints
// "bench_shard: rank R: <message>" and throws Failure.
[[noreturn]] void rank_fail(const std::string& message) {
  if (t_coord) t_coord->fail_now();
  fail(t_rank >= 0 ? strf("rank %d: %s", t_rank, message.c_str()) : message);
}

// A failed lwo or CUDA call throws testkit::Error (TK_CHECK, testkit's
// factories); so does a failed NCCL call of this program's own. rank_main
// prints it with the rank and tells the other ranks.
void nccl_check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) testkit::fail(strf("%s failed: %s", call, ncclGetErrorString(r)));
}
#define NCCL_CHECK(call) nccl_check((call), #call)

using testkit::gbps;

// --- one rank --------------------------------------------------------------------

struct RankResult {
  std::string device;  // "NVIDIA H200"
  int pci_bus = 0;
  uint64_t shard_offset = 0;
  double pool_s = 0, fill_s = 0;
  double h2d_alone = 0, h2d_together = 0, d2h_together = 0;  // GB/s
  double allgather_ms = 0, reduce_scatter_ms = 0;            // one operation
  std::vector<double> pass_ms;
  double forward_ms = 0;  // every timed pass, end to end
  lwo_ring_stats fwd_stats{};
  std::vector<double> resident_ms, step_ms;
  double resident_median = 0;
  uint64_t step_h2d_bytes = 0, step_d2h_bytes = 0, step_stages = 0, step_hits = 0;
  uint64_t grad_first[2] = {}, grad_n[2] = {};
};

// GB/s of the best of kPeakRepeats batches of back-to-back copies of `bytes`
// on one stream, at least kPeakBytes a batch, after one untimed batch
// (testkit::time_copies of a cycle_plan): host to device from each of `host`
// in turn into one device buffer, or device to host from one device buffer
// into each of `host` in turn.
double copy_peak(const std::vector<void*>& host, uint64_t bytes, testkit::Direction direction) {
  DeviceMem dev = device_alloc(bytes, "peak measurement");
  TK_CHECK(cudaMemset(dev.get(), 0, bytes));
  TK_CHECK(cudaDeviceSynchronize());  // the copy loop's streams do not wait for the memset
  const uint64_t n = std::max<uint64_t>(1, (kPeakBytes + bytes - 1) / bytes);
  return testkit::time_copies(testkit::cycle_plan(direction, host, dev.get(), bytes, n),
                              {1, kPeakRepeats})
      .best_gbps();
}

// Compares the per-layer sums on the device with `times` x the expected
// checksums (testkit::verify_sums); a mismatch stops the rank.
void verify(const unsigned long long* sums, const std::vector<uint64_t>& expect, uint64_t times,
            const char* what) {
  const auto bad = check_sums(sums, expect, times, [what](const testkit::SumMismatch& m) {
    return strf("bench_shard: rank %d: layer %u, %s: checksum 0x%016llx, expected 0x%016llx\n",
                t_rank, m.layer, what, m.got, m.want);
  });
  if (!bad.empty())
    rank_fail(
        strf("checksum mismatch in %zu of %zu layers (%s): the slots hold bytes that differ "
             "from the records the shards make up",
             bad.size(), expect.size(), what));
}

// The in-place all-gather of one record and, for training, the in-place
// reduce-scatter of one layer's f32 gradient: milliseconds per operation,
// the mean of `reps` back-to-back after one warm-up.
void measure_collectives(const Model& m, uint32_t rank, uint32_t n, lwo_nccl_comm_t comm,
                         RankResult& out) {
  const uint64_t S = m.shard_bytes(n);
  const int reps = static_cast<int>(m.o.passes);
  Stream stream = make_stream();
  Event a = make_event(), b = make_event();
  auto timed = [&](const auto& op) {
    op();
    TK_CHECK(cudaEventRecord(a.get(), stream.get()));
    for (int i = 0; i < reps; ++i) op();
    TK_CHECK(cudaEventRecord(b.get(), stream.get()));
    TK_CHECK(cudaEventSynchronize(b.get()));
    return elapsed_ms(a, b) / reps;
  };
  {
    DeviceMem buf = device_alloc(S * n, "all-gather measurement");
    auto* base = static_cast<uint8_t*>(buf.get());
    TK_CHECK(cudaMemsetAsync(base, 0, S * n, stream.get()));
    out.allgather_ms = timed(
        [&] { NCCL_CHECK(ncclAllGather(base + S * rank, base, S, ncclUint8, comm, stream.get())); });
  }
  if (m.o.train) {
    const uint64_t count = S / 2;  // f32 gradients of a shard of bf16 weights
    DeviceMem buf = device_alloc(count * 4 * n, "reduce-scatter measurement");
    auto* base = static_cast<float*>(buf.get());
    TK_CHECK(cudaMemsetAsync(base, 0, count * 4 * n, stream.get()));
    out.reduce_scatter_ms = timed([&] {
      NCCL_CHECK(ncclReduceScatter(base, base + count * rank, count, ncclFloat32, ncclSum, comm,
                               stream.get()));
    });
  }
}

// Forward streaming: a warm-up pass, checked, then the timed passes.
void stream_forward(const Model& m, Coord& c, uint32_t rank, lwo_pool* pool, RankResult& out) {
  const uint32_t L = m.o.layers, P = m.o.passes;
  Stream consumer = make_stream();
  DeviceMem sums_mem = device_alloc(2 * uint64_t(L) * sizeof(unsigned long long), "checksums");
  auto* sums = static_cast<unsigned long long*>(sums_mem.get());
  TK_CHECK(cudaMemsetAsync(sums, 0, 2 * size_t(L) * sizeof(*sums), consumer.get()));
  lwo_ring_config config = LWO_RING_CONFIG_INIT;
  config.depth = m.o.depth;
  Ring ring;
  TK_CHECK(lwo_ring_create(pool, &config, ring.out()));
  std::vector<uint32_t> order(L);
  for (uint32_t l = 0; l < L; ++l) order[l] = l;
  Schedule schedule;
  TK_CHECK(lwo_schedule_create(ring.get(), order.data(), L, schedule.out()));

  // One pass: the checksum kernel reads each slot (a whole record) and adds
  // into row[layer].
  auto pass = [&](unsigned long long* row) {
    testkit::checksum_pass(schedule.get(), consumer.get(), row, m.record_bytes);
  };

  pass(sums);
  TK_CHECK(cudaStreamSynchronize(consumer.get()));
  verify(sums, m.expect, 1, "warm-up pass");
  if (rank == 0) progress("forward: warm-up pass checked on rank 0");

  // Row 1 of the sums holds every timed pass. The host enqueues pass p while
  // the GPU runs pass p-1, then waits for pass p-1.
  c.barrier();
  Event start = make_event();
  std::vector<Event> ends;
  for (uint32_t p = 0; p < P; ++p) ends.push_back(make_event());
  out.pass_ms.assign(P, 0);
  TK_CHECK(cudaEventRecord(start.get(), consumer.get()));
  std::unique_ptr<Phase> bar;
  if (rank == 0) bar = std::make_unique<Phase>("forward", P);
  auto finish = [&](uint32_t p) {
    TK_CHECK(cudaEventSynchronize(ends[p].get()));
    out.pass_ms[p] = elapsed_ms(p == 0 ? start : ends[p - 1], ends[p]);
    if (bar) bar->set(p + 1, strf("pass %u/%u on rank 0: %.3f ms", p + 1, P, out.pass_ms[p]));
  };
  for (uint32_t p = 0; p < P; ++p) {
    pass(sums + L);
    TK_CHECK(cudaEventRecord(ends[p].get(), consumer.get()));
    if (p >= 1) finish(p - 1);
  }
  finish(P - 1);
  out.forward_ms = elapsed_ms(start, ends.back());
  if (bar) bar->end();
  TK_CHECK(cudaStreamSynchronize(consumer.get()));
  verify(sums + L, m.expect, P, "timed passes, summed");
  out.fwd_stats = testkit::ring_stats(ring.get());
  progress("rank %u: forward %u passes in %.3f ms: %.2f GB/s effective, checksums match", rank, P,
      out.forward_ms, gbps(static_cast<double>(m.record_bytes) * L * P, out.forward_ms));
}

struct LinearCalls {
  lwo_engine* engine;
  lwo_linear_desc desc;
  int64_t tokens;
  cudaStream_t stream;
  const void *x, *dy;
  void *y, *dx;

  void forward(uint32_t l, const void* w) const {
    lwo_status_t s = lwo_linear_forward(engine, &desc, tokens, x, w, nullptr, y, stream);
    if (s != LWO_OK) check(s, strf("lwo_linear_forward (layer %u)", l).c_str());
  }
  void weight_grad(uint32_t l, const void* w, void* dw) const {
    lwo_status_t s = lwo_linear_backward(engine, &desc, tokens, x, dy, w, nullptr, dw, nullptr,
                                         LWO_DTYPE_F32, stream);
    if (s != LWO_OK) check(s, strf("lwo_linear_backward (layer %u, dweight)", l).c_str());
  }
  void input_grad(uint32_t l, const void* w) const {
    lwo_status_t s = lwo_linear_backward(engine, &desc, tokens, x, dy, w, dx, nullptr, nullptr,
                                         LWO_DTYPE_F32, stream);
    if (s != LWO_OK) check(s, strf("lwo_linear_backward (layer %u, dx)", l).c_str());
  }
};

// After the first timed step: this rank's host shard of the weight gradient
// of the first and the last layer must hold exactly the elements of its
// weight shard (as lwo_pool_shard_tensor gives them), each N x the resident
// gradient dy^T x (every rank, every layer has the same x and dy). N = 1
// must match bit for bit, more ranks within a few roundings of the sum.
void check_gradients(const Model& m, uint32_t rank, uint32_t n, lwo_pool* pool, lwo_grads* grads,
                     const float* g_res, RankResult& out) {
  const uint32_t L = m.o.layers;
  const uint64_t n_el = static_cast<uint64_t>(m.o.rows) * static_cast<uint64_t>(m.o.cols);
  const uint64_t S = m.shard_bytes(n);
  const uint64_t want_first = std::min(n_el, rank * S / 2);
  const uint64_t want_n = std::min(n_el, (rank + 1) * S / 2) - want_first;
  const uint32_t checked[2] = {0, L - 1};
  for (uint32_t k = 0; k < (L > 1 ? 2u : 1u); ++k) {
    const uint32_t l = checked[k];
    float* data = nullptr;
    uint64_t first = 0, count = 0;
    check(lwo_grads_shard(grads, l, "weight", &data, &first, &count),
           strf("lwo_grads_shard (layer %u)", l).c_str());
    out.grad_first[k] = first;
    out.grad_n[k] = count;
    void* w = nullptr;
    uint64_t w_first = 0, w_count = 0;
    check(lwo_pool_shard_tensor(pool, l, "weight", &w, &w_first, &w_count),
           strf("lwo_pool_shard_tensor (layer %u)", l).c_str());
    if (w_count != count || (count > 0 && w_first != first))
      rank_fail(
          strf("layer %u: lwo_grads_shard gives elements [%llu, +%llu), "
               "lwo_pool_shard_tensor [%llu, +%llu); they must be the same",
               l, static_cast<unsigned long long>(first), static_cast<unsigned long long>(count),
               static_cast<unsigned long long>(w_first), static_cast<unsigned long long>(w_count)));
    if (count != want_n || (count > 0 && first != want_first))
      rank_fail(strf(
          "lwo_grads_shard (layer %u) gives elements [%llu, +%llu), expected [%llu, "
          "+%llu): the elements of this rank's shard of the record",
          l, static_cast<unsigned long long>(first), static_cast<unsigned long long>(count),
          static_cast<unsigned long long>(want_first), static_cast<unsigned long long>(want_n)));
    if (count == 0) continue;
    std::vector<float> ref(count);
    TK_CHECK(cudaMemcpy(ref.data(), g_res + first, count * 4, cudaMemcpyDeviceToHost));
    uint64_t bad = 0, first_bad = 0;
    for (uint64_t i = 0; i < count; ++i) {
      const double want = static_cast<double>(n) * ref[i], got = data[i];
      const bool ok = n == 1
                          ? std::memcmp(&data[i], &ref[i], 4) == 0
                          : std::fabs(got - want) <= 4.0 * n * FLT_EPSILON * (std::fabs(want) + 1);
      if (!ok && bad++ == 0) first_bad = i;
    }
    if (bad) {
      const uint64_t e = first + first_bad;
      rank_fail(
          strf("layer %u: the host gradient of weight element %llu (row %llu, col %llu) is "
               "%.9g, expected %u x %.9g = %.9g; %llu of this rank's %llu elements differ",
               l, static_cast<unsigned long long>(e),
               static_cast<unsigned long long>(e / static_cast<uint64_t>(m.o.cols)),
               static_cast<unsigned long long>(e % static_cast<uint64_t>(m.o.cols)),
               data[first_bad], n, ref[first_bad], static_cast<double>(n) * ref[first_bad],
               static_cast<unsigned long long>(bad), static_cast<unsigned long long>(count)));
    }
  }
}

// Training steps: the resident reference first, then the streamed steps.
void train(const Model& m, Coord& c, uint32_t rank, lwo_engine* engine, lwo_pool* pool,
           RankResult& out) {
  const uint32_t L = m.o.layers, P = m.o.passes, n = c.n_ranks();
  const uint64_t T = static_cast<uint64_t>(m.o.tokens);
  const uint64_t x_bytes = T * static_cast<uint64_t>(m.o.cols) * 2;
  const uint64_t y_bytes = T * static_cast<uint64_t>(m.o.rows) * 2;
  const uint64_t g_bytes = static_cast<uint64_t>(m.o.rows) * static_cast<uint64_t>(m.o.cols) * 4;
  DeviceMem x = device_alloc(x_bytes, "x"), y = device_alloc(y_bytes, "y"), dy = device_alloc(y_bytes, "dy"),
            dx = device_alloc(x_bytes, "dx"), w_res = device_alloc(m.record_bytes, "resident weights"),
            g_res = device_alloc(g_bytes, "resident weight gradient");
  TK_CHECK(cudaMemcpy(x.get(), m.x.data(), x_bytes, cudaMemcpyHostToDevice));
  TK_CHECK(cudaMemcpy(dy.get(), m.dy.data(), y_bytes, cudaMemcpyHostToDevice));
  TK_CHECK(cudaMemcpy(w_res.get(), m.resident.data(), m.record_bytes, cudaMemcpyHostToDevice));
  Stream compute = make_stream();
  LinearCalls calls{
      engine,  LWO_LINEAR_DESC_INIT, m.o.tokens, compute.get(), x.get(), dy.get(), y.get(),
      dx.get()};
  calls.desc.dtype = LWO_DTYPE_BF16;
  calls.desc.in_features = m.o.cols;
  calls.desc.out_features = m.o.rows;

  // The resident step: the same calls with one layer's weights resident,
  // every GPU at once. One warm-up (algorithm choice, workspace).
  Event a = make_event(), b = make_event();
  for (uint32_t s = 0; s <= P; ++s) {
    c.barrier();
    TK_CHECK(cudaEventRecord(a.get(), compute.get()));
    for (uint32_t l = 0; l < L; ++l) calls.forward(l, w_res.get());
    for (uint32_t l = L; l-- > 0;) {
      calls.weight_grad(l, w_res.get(), g_res.get());
      calls.input_grad(l, w_res.get());
    }
    TK_CHECK(cudaEventRecord(b.get(), compute.get()));
    TK_CHECK(cudaEventSynchronize(b.get()));
    TK_CHECK(lwo_engine_check(engine));
    if (s > 0) out.resident_ms.push_back(elapsed_ms(a, b));
  }
  out.resident_median = median(out.resident_ms);
  progress("rank %u: resident step %.3f ms (median of %u)", rank, out.resident_median, P);

  // The streamed steps: one schedule, forward 0..L-1 then backward L-1..0.
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  ring_config.depth = m.o.depth;
  Ring ring;
  TK_CHECK(lwo_ring_create(pool, &ring_config, ring.out()));
  const std::vector<uint32_t> order = testkit::step_order(L, /*backward=*/true);
  Schedule schedule;
  TK_CHECK(lwo_schedule_create(ring.get(), order.data(), 2 * L, schedule.out()));
  lwo_grads_config grads_config = LWO_GRADS_CONFIG_INIT;
  grads_config.depth = m.o.grad_depth;
  Grads grads;
  const double t = now_seconds();
  TK_CHECK(lwo_grads_create(pool, nullptr, &grads_config, grads.out()));
  progress("rank %u: gradient buffers in %.2f s", rank, now_seconds() - t);

  // One step (testkit::run_step): the gradients zeroed and the counters read
  // (untimed), then every rank starts together at a barrier; timed to the
  // return of lwo_grads_wait and the compute stream's sync.
  testkit::StepCalls step_calls;
  step_calls.forward = [&](uint32_t l, const lwo_layer_view& w) { calls.forward(l, w.tensors[0]); };
  step_calls.backward = [&](uint32_t l, const lwo_layer_view& w, const lwo_layer_view* g,
                            const std::function<void()>& done) {
    // The weight gradient first and sent at once (done: lwo_grads_end), so
    // that its reduction and copy to host run while dx is computed.
    calls.weight_grad(l, w.tensors[0], g->tensors[0]);
    done();
    calls.input_grad(l, w.tensors[0]);
  };
  testkit::StepOptions step_options;
  step_options.check_engine = engine;
  step_options.before_start = [&c] { c.barrier(); };

  std::unique_ptr<Phase> bar;
  if (rank == 0) bar = std::make_unique<Phase>("train", P + 1);
  for (uint32_t s = 0; s <= P; ++s) {
    const testkit::StepStats st = testkit::run_step(schedule.get(), ring.get(), grads.get(),
                                                    compute.get(), L, step_options, step_calls);
    const double ms = st.ms;
    out.step_h2d_bytes = st.h2d_bytes;
    out.step_stages = st.stages;
    out.step_hits = st.hits;
    out.step_d2h_bytes = st.d2h_bytes;
    if (bar) bar->set(s + 1, s == 0 ? strf("warm-up step on rank 0: %.3f ms", ms)
                                    : strf("step %u/%u on rank 0: %.3f ms", s, P, ms));
    if (s == 0) {
      progress("rank %u: warm-up step %.3f ms", rank, ms);
      continue;
    }
    out.step_ms.push_back(ms);
    if (s == 1) {
      check_gradients(m, rank, n, pool, grads.get(), static_cast<const float*>(g_res.get()), out);
      if (rank == 0) progress("gradients: first timed step checked on rank 0");
    }
  }
  TK_CHECK(lwo_engine_synchronize(engine));
  if (bar) bar->end();
}

void run_rank(const Model& m, Coord& c, uint32_t rank, RankResult& out) {
  const uint32_t n = c.n_ranks(), L = m.o.layers;
  const uint64_t S = m.shard_bytes(n);
  TK_CHECK(cudaSetDevice(static_cast<int>(rank)));
  cudaDeviceProp prop{};
  TK_CHECK(cudaGetDeviceProperties(&prop, static_cast<int>(rank)));
  out.device = prop.name;
  out.pci_bus = prop.pciBusID;
  Engine engine = testkit::make_engine(static_cast<int>(rank),
                                       m.o.check_collectives ? LWO_ENGINE_CHECK_COLLECTIVES : 0u);
  Comm comm;
  TK_CHECK(lwo_nccl_comm_create(engine.get(), &c.id, static_cast<int32_t>(n),
                              static_cast<int32_t>(rank), comm.out()));

  // The pool of this rank's shards, filled from the formula.
  std::unique_ptr<Phase> bar;
  if (rank == 0) bar = std::make_unique<Phase>("pools");
  double t = now_seconds();
  Pool pool;
  TK_CHECK(
      lwo_pool_create_sharded(engine.get(), m.layers.data(), L, comm.get(), nullptr, pool.out()));
  out.pool_s = now_seconds() - t;
  // Shard l: bytes [offset, offset + S) of the stream of layer l's key, and
  // zero beyond the record.
  std::vector<testkit::ByteRange> shards(L);
  std::vector<void*> hosts(L);
  for (uint32_t l = 0; l < L; ++l) {
    testkit::ByteRange& s = shards[l];
    TK_CHECK(lwo_pool_shard_host(pool.get(), l, &s.data, &s.offset, &s.bytes));
    if (s.bytes != S || s.offset != S * rank)
      rank_fail(strf(
          "lwo_pool_shard_host (layer %u) gives %llu bytes at record offset %llu; "
          "expected %llu at %llu",
          l, static_cast<unsigned long long>(s.bytes), static_cast<unsigned long long>(s.offset),
          static_cast<unsigned long long>(S), static_cast<unsigned long long>(S * rank)));
    s.key = testkit::key_of(m.o.seed, l);
    s.limit = m.record_bytes;
    hosts[l] = s.data;
  }
  out.shard_offset = S * rank;
  t = now_seconds();
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  testkit::fill_bytes(shards, std::max(1u, hw / n));
  out.fill_s = now_seconds() - t;
  if (bar) bar->end();
  progress("rank %u (device %u, %s): shards of %s at offset %s, pool %.2f s, fill %.2f s", rank, rank,
      prop.name, fmt_bytes(S).c_str(), fmt_bytes(S * rank).c_str(), out.pool_s, out.fill_s);

  // Peaks: each GPU alone, in turn, then all at once.
  for (uint32_t q = 0; q < n; ++q) {
    c.barrier();
    if (q == rank) out.h2d_alone = copy_peak(hosts, S, testkit::Direction::kH2D);
  }
  c.barrier();
  out.h2d_together = copy_peak(hosts, S, testkit::Direction::kH2D);
  progress("rank %u: pinned H2D peak %.2f GB/s alone, %.2f GB/s with %u GPUs at once (%s copies)", rank,
      out.h2d_alone, out.h2d_together, n, fmt_bytes(S).c_str());
  if (m.o.train) {
    PinnedMem buf = testkit::pinned_alloc(2 * S);
    c.barrier();
    out.d2h_together = copy_peak({buf.get()}, 2 * S, testkit::Direction::kD2H);
    progress("rank %u: pinned D2H peak %.2f GB/s with %u GPUs at once (%s copies)", rank,
        out.d2h_together, n, fmt_bytes(2 * S).c_str());
  }

  // Collectives alone (the all-gather with one rank moves nothing).
  c.barrier();
  if (n > 1) {
    measure_collectives(m, rank, n, comm.get(), out);
    progress("rank %u: all-gather of %s in %.3f ms (%.2f GB/s)%s", rank,
        fmt_bytes(m.record_bytes).c_str(), out.allgather_ms,
        gbps(static_cast<double>(m.record_bytes), out.allgather_ms),
        m.o.train ? strf("; reduce-scatter of %s f32 in %.3f ms", fmt_bytes(2 * S * n).c_str(),
                         out.reduce_scatter_ms)
                        .c_str()
                  : "");
  }

  c.barrier();
  stream_forward(m, c, rank, pool.get(), out);
  if (m.o.train) train(m, c, rank, engine.get(), pool.get(), out);
  TK_CHECK(lwo_engine_synchronize(engine.get()));
}

void rank_main(const Model& m, Coord& c, uint32_t rank, RankResult& out) {
  t_rank = static_cast<int>(rank);
  t_coord = &c;
  // A failed call (testkit::Error) tells the other ranks before this rank's
  // stack unwinds, as rank_fail does; the catch below prints it.
  testkit::set_thread_fail_hook([](const std::string&) {
    if (t_coord) t_coord->fail_now();
  });
  try {
    run_rank(m, c, rank, out);
  } catch (const Aborted&) {  // another rank failed and said why
    c.fail_now();
  } catch (const Failure&) {  // printed
    c.fail_now();
  } catch (const std::exception& e) {
    print_stderr(strf("bench_shard: rank %u: %s\n", rank, e.what()));
    c.fail_now();
  } catch (...) {
    print_stderr(strf("bench_shard: rank %u: unknown error\n", rank));
    c.fail_now();
  }
  c.finish(rank);
}

// --- one rank count ---------------------------------------------------------------

struct Result {
  uint32_t ranks = 0;
  uint64_t shard_bytes = 0;
  std::vector<RankResult> per_rank;
  double peak = 0;           // GB/s, the fastest rank's link alone
  double peak_together = 0;  // the slowest rank's, all GPUs at once
  double d2h_together = 0;
  double allgather_ms = 0, reduce_scatter_ms = 0;  // slowest rank
  double fwd_gbps = 0, fwd_aggregate = 0, fwd_ratio = 0, fwd_bound_gbps = 0, pass_ms = 0;
  // Training.
  double resident_ms = 0, step_ms = 0, train_gbps = 0, bound_ms = 0, train_ratio = 0;
  const char* bound_term = "";
  double h2d_term = 0, d2h_term = 0, comm_term = 0;
  uint64_t stages = 0, hits = 0;
  double allgather_gbps() const {
    return ranks > 1 ? gbps(static_cast<double>(record_bytes), allgather_ms) : 0;
  }
  uint64_t record_bytes = 0;
};

Result summarise(const Model& m, uint32_t n, std::vector<RankResult> rr) {
  const uint32_t L = m.o.layers, P = m.o.passes;
  const double R = static_cast<double>(m.record_bytes);
  Result r;
  r.ranks = n;
  r.record_bytes = m.record_bytes;
  r.shard_bytes = m.shard_bytes(n);
  r.peak_together = r.d2h_together = r.fwd_gbps = std::numeric_limits<double>::infinity();
  double slowest_fwd = 0;
  for (const RankResult& q : rr) {
    r.peak = std::max(r.peak, q.h2d_alone);
    r.peak_together = std::min(r.peak_together, q.h2d_together);
    r.d2h_together = std::min(r.d2h_together, q.d2h_together);
    r.allgather_ms = std::max(r.allgather_ms, q.allgather_ms);
    r.reduce_scatter_ms = std::max(r.reduce_scatter_ms, q.reduce_scatter_ms);
    const double g = gbps(R * L * P, q.forward_ms);
    r.fwd_aggregate += g;
    if (g < r.fwd_gbps) {
      r.fwd_gbps = g;
      slowest_fwd = median(q.pass_ms);
    }
  }
  r.pass_ms = slowest_fwd;
  r.fwd_ratio = r.peak > 0 ? r.fwd_gbps / r.peak : 0;
  // The best a pass can do: each shard up its link, each record all-gathered.
  const double fwd_bound_ms =
      std::max(testkit::ms_at(static_cast<double>(r.shard_bytes), r.peak_together), r.allgather_ms);
  r.fwd_bound_gbps = gbps(R, fwd_bound_ms);
  if (!m.o.train) {
    r.per_rank = std::move(rr);
    return r;
  }
  // Step s takes as long as its slowest rank; the bound is the largest term
  // of any rank.
  std::vector<double> steps(P, 0);
  for (RankResult& q : rr) {
    for (uint32_t s = 0; s < P; ++s) steps[s] = std::max(steps[s], q.step_ms[s]);
    r.resident_ms = std::max(r.resident_ms, q.resident_median);
    const double h2d = testkit::ms_at(static_cast<double>(q.step_h2d_bytes), q.h2d_together);
    const double d2h = testkit::ms_at(static_cast<double>(q.step_d2h_bytes), q.d2h_together);
    const double comm = n > 1 ? static_cast<double>(q.step_stages - q.step_hits) * q.allgather_ms +
                                    L * q.reduce_scatter_ms
                              : 0;
    r.h2d_term = std::max(r.h2d_term, h2d);
    r.d2h_term = std::max(r.d2h_term, d2h);
    r.comm_term = std::max(r.comm_term, comm);
    r.stages = q.step_stages;
    r.hits = q.step_hits;
  }
  r.step_ms = median(steps);
  r.train_gbps = gbps(2.0 * L * R, r.step_ms);
  const testkit::Bound bound = testkit::bound_of({{"resident compute", r.resident_ms},
                                                   {"H2D", r.h2d_term},
                                                   {"D2H", r.d2h_term},
                                                   {"collectives", r.comm_term}});
  r.bound_ms = bound.ms;
  r.bound_term = bound.name;
  r.train_ratio = r.bound_ms > 0 ? r.step_ms / r.bound_ms : 0;
  r.per_rank = std::move(rr);
  return r;
}

Result run_ranks(const Model& m, uint32_t n, const std::string& json_path) {
  progress("bench_shard: %u rank%s: %u layers of %s, %s shards", n, n == 1 ? "" : "s", m.o.layers,
      fmt_bytes(m.record_bytes).c_str(), fmt_bytes(m.shard_bytes(n)).c_str());
  Coord c(n);
  TK_CHECK(lwo_nccl_get_unique_id(&c.id));
  std::vector<RankResult> rr(n);
  // Each rank a waiting thread of its own from the library's host pool
  // (ThreadPool::start, not a slot): the collectives block until every rank
  // joins, so the ranks must run at once.
  std::vector<lwo::HostThread> threads;
  for (uint32_t r = 0; r < n; ++r) {
    try {
      threads.push_back(lwo::ThreadPool::process().start(
          [&m, &c, r, &rr] { rank_main(m, c, r, rr[r]); }));
    } catch (const std::system_error& e) {
      print_stderr(strf("bench_shard: rank %u: cannot start its thread: %s\n", r, e.what()));
      c.fail_now();
      for (uint32_t q = r; q < n; ++q) c.finish(q);
      break;
    }
  }
  const bool ok = c.wait_all(json_path);
  for (lwo::HostThread& t : threads) t.join();
  if (!ok) throw Failure(strf("%u ranks: a rank failed", n));
  return summarise(m, n, std::move(rr));
}

// --- command line and output --------------------------------------------------------

std::vector<uint32_t> parse_ranks_list(const std::string& text) {
  std::vector<uint32_t> out;
  size_t b = 0;
  for (;;) {
    size_t e = text.find(',', b);
    out.push_back(static_cast<uint32_t>(
        parse_uint("--ranks-list", text.substr(b, e == std::string::npos ? e : e - b), 1, 1024)));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

std::vector<Flag> make_flags(Options& o) {
  return {
      value_flag("--ranks", "N", "ranks, 1..the GPUs of this machine (default: every GPU)",
                 [&o](const std::string& v) {
                   o.ranks = {static_cast<uint32_t>(parse_uint("--ranks", v, 1, 1024))};
                   o.ranks_given = true;
                 }),
      value_flag("--ranks-list", "L",
                 "several rank counts in turn, e.g. 1,2,4 (each with its own threads, engines "
                 "and communicators)",
                 [&o](const std::string& v) {
                   o.ranks = parse_ranks_list(v);
                   o.list_given = true;
                 }),
      uint_flag(kLayersFlag, o.layers),
      uint_flag(kRowsFlag, o.rows),
      uint_flag(kColsFlag, o.cols),
      uint_flag(kDepthFlag, o.depth),
      uint_flag(kPassesFlag, o.passes),
      uint_flag(kTokensFlag, o.tokens),
      uint_flag(kGradDepthFlag, o.grad_depth),
      switch_flag("--no-train",
                  "skip the training step (it needs f32 gradient shards on the host: twice the "
                  "weights' host memory)",
                  o.train, false),
      switch_flag("--check-collectives",
                  "engines with LWO_ENGINE_CHECK_COLLECTIVES (slow: finds ranks whose "
                  "collective calls differ)",
                  o.check_collectives),
      uint_flag(kSeedFlag, o.seed),
      json_flag(o.json),
      quiet_flag(),
      moved_flag("--device",
                 "--device does not apply to bench_shard: rank r runs on GPU r "
                 "(CUDA_VISIBLE_DEVICES picks the GPUs)"),
      moved_flag("--steps",
                 "--steps does not apply to bench_shard: it times as many training steps as "
                 "--passes"),
  };
}

// MemAvailable from /proc/meminfo, or 0 if it cannot be read.
uint64_t host_available_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
  std::fclose(f);
  return static_cast<uint64_t>(kib) * 1024;
}

// A figure, or null where it was not measured (or is not finite).
Json num(double v, bool valid = true) { return valid ? Json(v) : Json(); }

// One result: a line of the file (scripts/scale merges files by these lines).
Json json_result(const Model& m, const Result& r) {
  const bool t = m.o.train, ag = r.ranks > 1;
  Json j = {{"ranks", r.ranks}, {"layers", m.o.layers}, {"record_bytes", r.record_bytes},
            {"shard_bytes", r.shard_bytes}, {"peak_h2d_gbps_per_gpu", num(r.peak)},
            {"peak_h2d_together_gbps_per_gpu", num(r.peak_together)},
            {"allgather_ms", num(r.allgather_ms, ag)}, {"allgather_gbps", num(r.allgather_gbps(), ag)},
            {"allgather_busbw_gbps", num(r.allgather_gbps() * (r.ranks - 1) / r.ranks, ag)},
            {"forward_pass_ms", num(r.pass_ms)}, {"forward_gbps_per_gpu", num(r.fwd_gbps)},
            {"forward_aggregate_gbps", num(r.fwd_aggregate)},
            {"forward_ratio_to_peak", num(r.fwd_ratio)},
            {"forward_bound_gbps_per_gpu", num(r.fwd_bound_gbps)},
            {"forward_share_of_bound", num(r.fwd_bound_gbps > 0 ? r.fwd_gbps / r.fwd_bound_gbps : 0)},
            {"checksums_verified", true}, {"train", t}, {"tokens", m.o.tokens},
            {"resident_ms", num(r.resident_ms, t)}, {"train_step_ms", num(r.step_ms, t)},
            {"train_gbps_per_gpu", num(r.train_gbps, t)}, {"train_bound_ms", num(r.bound_ms, t)},
            {"train_bound_term", t ? Json(r.bound_term) : Json()},
            {"train_ratio_to_bound", num(r.train_ratio, t)}, {"train_h2d_ms", num(r.h2d_term, t)},
            {"train_d2h_ms", num(r.d2h_term, t)}, {"train_collectives_ms", num(r.comm_term, t)},
            {"train_stages_per_step", t ? Json(r.stages) : Json()},
            {"train_hits_per_step", t ? Json(r.hits) : Json()},
            {"peak_d2h_together_gbps_per_gpu", num(r.d2h_together, t)},
            {"reduce_scatter_ms", num(r.reduce_scatter_ms, t && ag)}, {"gradients_verified", t},
            {"per_rank", Json::array()}};
  for (size_t i = 0; i < r.per_rank.size(); ++i) {
    const RankResult& q = r.per_rank[i];
    Json e = {{"rank", i}, {"device", i}, {"name", q.device}, {"pci_bus", q.pci_bus},
              {"shard_offset", q.shard_offset}, {"pool_seconds", q.pool_s},
              {"fill_seconds", q.fill_s}, {"peak_h2d_gbps", num(q.h2d_alone)},
              {"peak_h2d_together_gbps", num(q.h2d_together)},
              {"allgather_ms", num(q.allgather_ms, ag)}, {"forward_ms", q.forward_ms},
              {"forward_gbps",
               num(gbps(static_cast<double>(r.record_bytes) * m.o.layers * m.o.passes, q.forward_ms))},
              {"pass_ms", q.pass_ms}, {"ring_stages", q.fwd_stats.n_stages},
              {"ring_hits", q.fwd_stats.n_hits}, {"ring_bytes_copied", q.fwd_stats.bytes_copied}};
    if (t) {
      e["peak_d2h_together_gbps"] = num(q.d2h_together);
      e["reduce_scatter_ms"] = num(q.reduce_scatter_ms, ag);
      e["resident_ms"] = q.resident_ms;
      e["step_ms"] = q.step_ms;
      e["step_h2d_bytes"] = q.step_h2d_bytes;
      e["step_d2h_bytes"] = q.step_d2h_bytes;
      e["grad_first_element"] = q.grad_first[0];
      e["grad_n_elements"] = q.grad_n[0];
    }
    j["per_rank"].push_back(e);
  }
  return j;
}

void print_result(const Model& m, const Result& r) {
  const Options& o = m.o;
  const double R = static_cast<double>(r.record_bytes);
  std::printf("\nbench_shard, %u rank%s (threads of one process, rank r on GPU r)\n", r.ranks,
              r.ranks == 1 ? "" : "s");
  std::printf(
      "%-11s %u layers x \"weight\" [%lld x %lld] bf16: %s records, %s in all; %s shard "
      "per rank\n",
      "model", o.layers, static_cast<long long>(o.rows), static_cast<long long>(o.cols),
      fmt_bytes(r.record_bytes).c_str(), fmt_bytes(r.record_bytes * uint64_t(o.layers)).c_str(),
      fmt_bytes(r.shard_bytes).c_str());
  std::printf("%-11s depth %u; checksum kernel per layer; %u timed passes after 1 warm-up\n",
              "ring", o.depth, o.passes);
  std::printf("\n%4s  %-24s %9s %9s %10s %9s", "rank", "device", "H2D alone", "together",
              "all-gather", "forward");
  if (o.train) std::printf(" %9s %9s %9s", "D2H", "resident", "step");
  std::printf("\n%4s  %-24s %9s %9s %10s %9s", "", "", "GB/s", "GB/s", "ms", "GB/s");
  if (o.train) std::printf(" %9s %9s %9s", "GB/s", "ms", "ms");
  std::printf("\n");
  for (size_t i = 0; i < r.per_rank.size(); ++i) {
    const RankResult& q = r.per_rank[i];
    std::string dev = strf("%zu: %s", i, q.device.c_str());
    std::printf("%4zu  %-24.24s %9.2f %9.2f %10s %9.2f", i, dev.c_str(), q.h2d_alone,
                q.h2d_together, r.ranks > 1 ? strf("%.3f", q.allgather_ms).c_str() : "-",
                gbps(R * o.layers * o.passes, q.forward_ms));
    if (o.train)
      std::printf(" %9.2f %9.3f %9.3f", q.d2h_together, q.resident_median, median(q.step_ms));
    std::printf("\n");
  }
  if (r.ranks == 1)
    std::printf("\n%-11s %.2f GB/s pinned H2D (measured again: %.2f GB/s), %s copies\n", "peak",
                r.peak, r.peak_together, fmt_bytes(r.shard_bytes).c_str());
  else
    std::printf(
        "\n%-11s %.2f GB/s per GPU alone (the fastest rank's link), %.2f GB/s with all %u "
        "copying at once (the slowest rank), %s copies\n",
        "peak", r.peak, r.peak_together, r.ranks, fmt_bytes(r.shard_bytes).c_str());
  if (r.ranks > 1)
    std::printf("%-11s %s in %.3f ms (the slowest rank): %.2f GB/s, bus %.2f GB/s\n", "all-gather",
                fmt_bytes(r.record_bytes).c_str(), r.allgather_ms, r.allgather_gbps(),
                r.allgather_gbps() * (r.ranks - 1) / r.ranks);
  std::printf(
      "%-11s %u rank%s: %.2f GB/s per GPU (the slowest rank) = %.2fx the %.2f GB/s link; "
      "%.2f GB/s in all\n",
      "forward", r.ranks, r.ranks == 1 ? "" : "s", r.fwd_gbps, r.fwd_ratio, r.peak,
      r.fwd_aggregate);
  std::printf("%-11s %.2f GB/s per GPU (shards at the shared peak%s): forward at %.1f%% of it\n",
              "bound", r.fwd_bound_gbps, r.ranks > 1 ? ", records at the all-gather's rate" : "",
              r.fwd_bound_gbps > 0 ? 100 * r.fwd_gbps / r.fwd_bound_gbps : 0);
  std::printf("%-11s every rank's slots match the records: %u layers x %u passes\n", "checksums",
              o.layers, o.passes + 1);
  if (!o.train) return;
  std::printf(
      "%-11s %lld tokens: step %.3f ms (median of %u, the slowest rank): %.2f GB/s per "
      "GPU effective (2 x %u records a step; %llu stages, %llu hits)\n",
      "train", static_cast<long long>(o.tokens), r.step_ms, o.passes, r.train_gbps, o.layers,
      static_cast<unsigned long long>(r.stages), static_cast<unsigned long long>(r.hits));
  std::printf(
      "%-11s %.3f ms (%s): resident compute %.3f, H2D %.3f, D2H %.3f, collectives %.3f "
      "ms; step / bound %.3f\n",
      "step bound", r.bound_ms, r.bound_term, r.resident_ms, r.h2d_term, r.d2h_term, r.comm_term,
      r.train_ratio);
  std::printf("%-11s layer%s %s: each rank's host shard holds %u x dy^T x%s\n", "gradients",
              o.layers > 1 ? "s 0 and" : "",
              o.layers > 1 ? std::to_string(o.layers - 1).c_str() : "0", r.ranks,
              r.ranks == 1 ? " bit for bit" : " within rounding");
}

void print_table(const Model& m, const std::vector<Result>& results) {
  std::printf("\n%5s %10s %10s %11s %12s %7s", "ranks", "shard", "peak GB/s", "all-gather",
              "forward/GPU", "x link");
  if (m.o.train) std::printf(" %10s %10s %10s", "step ms", "train/GPU", "step/bound");
  std::printf("\n");
  for (const Result& r : results) {
    std::printf("%5u %10s %10.2f %11s %12.2f %7.2f", r.ranks, fmt_bytes(r.shard_bytes).c_str(),
                r.peak, r.ranks > 1 ? strf("%.2f", r.allgather_gbps()).c_str() : "-", r.fwd_gbps,
                r.fwd_ratio);
    if (m.o.train) std::printf(" %10.3f %10.2f %10.3f", r.step_ms, r.train_gbps, r.train_ratio);
    std::printf("\n");
  }
}

}  // namespace

int cmd_shard(int argc, char** argv) {
  Options o;
  if (!parse_flags(argc, argv, make_flags(o))) return 0;  // --help: printed
  if (o.ranks_given && o.list_given)
    throw UsageError("--ranks and --ranks-list exclude each other");
  Model m;
  m.tensor = tensor_desc("weight", LWO_DTYPE_BF16, {o.rows, o.cols});
  const lwo_layer_desc layer{&m.tensor, 1, nullptr};
  m.record_bytes = record_bytes(layer);
  m.layers.assign(o.layers, layer);
  (void)model_bytes(m.record_bytes, o.layers);  // a usage error past 64 bits

  // NCCL reads its environment once, at its first call.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const int n_gpus = device_count();
  if (o.ranks.empty()) o.ranks = {static_cast<uint32_t>(n_gpus)};
  for (uint32_t n : o.ranks)
    if (n > static_cast<uint32_t>(n_gpus))
      fail(strf("%u ranks need %u GPUs (rank r runs on GPU r), but %d CUDA device%s found", n, n,
                n_gpus, n_gpus == 1 ? " was" : "s were"));
  // Every rank holds its shards; with training also its f32 gradient shards.
  const uint32_t max_ranks = *std::max_element(o.ranks.begin(), o.ranks.end());
  for (uint32_t n : o.ranks) {
    const double shards = static_cast<double>(m.shard_bytes(n)) * o.layers * n;
    const double need = shards * (o.train ? 3.0 : 1.0);
    const uint64_t avail = host_available_bytes();
    // A warning, not a refusal: on some machines MemAvailable starts small
    // and grows as memory is used.
    if (avail && need > static_cast<double>(avail))
      progress("%s",
          strf("warning: %u ranks need about %s of host memory (weight shards %s%s) but "
               "MemAvailable reads %s; if the run fails, lower --layers%s",
               n, fmt_bytes(static_cast<uint64_t>(need)).c_str(),
               fmt_bytes(static_cast<uint64_t>(shards)).c_str(),
               o.train ? strf(", f32 gradient shards %s",
                              fmt_bytes(static_cast<uint64_t>(2 * shards)).c_str())
                             .c_str()
                       : "",
               fmt_bytes(avail).c_str(), o.train ? " or pass --no-train" : "")
              .c_str());
  }
  if (o.depth >= o.layers)
    progress("note: depth %u >= %u layers: after the first pass every layer stays in a slot, so "
        "passes hit and move nothing",
        o.depth, o.layers);
  JsonFile json(o.json);
  m.o = o;

  double t = now_seconds();
  m.expect = record_checksums(o.seed, o.layers, m.record_bytes);
  progress("host: checksums of %u records of %s from their formula in %.2f s", o.layers,
      fmt_bytes(m.record_bytes).c_str(), now_seconds() - t);
  if (o.train) {
    const uint64_t T = static_cast<uint64_t>(o.tokens);
    m.x.resize(T * static_cast<uint64_t>(o.cols));
    m.dy.resize(T * static_cast<uint64_t>(o.rows));
    fill_bf16(m.x, testkit::mix64(o.seed ^ 0x78));
    fill_bf16(m.dy, testkit::mix64(o.seed ^ 0x6479));
    m.resident.resize(m.record_bytes);
    testkit::fill_bytes({{m.resident.data(), m.record_bytes, testkit::key_of(o.seed, 0)}});
  }

  std::vector<Result> results;
  for (uint32_t n : o.ranks) {
    results.push_back(run_ranks(m, n, o.json));
    print_result(m, results.back());
  }
  if (results.size() > 1) print_table(m, results);

  Json j = json_doc("shard");
  j["config"] = {{"layers", o.layers}, {"rows", o.rows},     {"cols", o.cols},
                 {"dtype", "bf16"},    {"depth", o.depth},   {"passes", o.passes},
                 {"tokens", o.tokens}, {"grad_depth", o.grad_depth}, {"seed", o.seed},
                 {"train", o.train},   {"check_collectives", o.check_collectives}};
  j["gpus"] = n_gpus;
  Json& devices = j["devices"] = Json::array();
  for (uint32_t d = 0; d < max_ranks && json.is_open(); ++d) {
    cudaDeviceProp prop{};
    TK_CHECK(cudaGetDeviceProperties(&prop, static_cast<int>(d)));
    devices.push_back(json_device(static_cast<int>(d), prop));
  }
  Json& out = j["results"] = Json::array();
  for (const Result& r : results) out.push_back(json_result(m, r));
  json.write(j);
  return 0;
}

const Command kShardCommand = {"", "",
    "host weights sharded across this machine's GPUs, one NCCL rank each",
    R"(Runs N ranks as threads of this process, rank r on GPU r, each with its own
engine, NCCL communicator and a sharded pool holding 1/N of every layer (a
chain of layers "weight" [rows x cols] bf16; rank r fills only its shard,
the same bytes as lwo run --seed S). Measures, in one run and per rank
count: each GPU's pinned H2D peak of shard-sized copies, alone and with all
GPUs at once; the in-place NCCL all-gather of one record; forward streaming
through a ring (every slot checksummed; bandwidth per GPU of the slowest
rank, and its ratio to the link peak); and a training step (as many as
--passes; weight gradients summed over the ranks into host shards, checked)
against max(resident compute, H2D, D2H, collectives), each term measured in
the same run. The JSON holds one result per rank count. Sets
NCCL_NVLS_ENABLE=0 unless it is set.
)",
    throwaway_flags<Options, make_flags>, cmd_shard};

}  // namespace cli

// bench_shard [flags]: one command alone, built on the lwo program's pieces
// (tools/cli.h); its parser reads the flags from argv[2], as lwo COMMAND's.
int main(int argc, char** argv) {
  cli::g_program = "bench_shard";
  cli::g_running = &cli::kShardCommand;
  std::vector<char*> args(argv, argv + argc);
  args.insert(args.begin() + 1, argv[0]);
  return cli::run_program(argc + 1, args.data(), cli::cmd_shard);
}
