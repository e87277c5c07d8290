// bench_quant: quantized weights on the bus. In ONE run, for the
// frozen 32 x Linear(8192x8192) model (one record per linear) and the
// 144-linear model (24 blocks of 4 x Linear(2048x2048), Linear(2048->8192),
// Linear(8192->2048)), each a chain x_{i+1} = y_i in bf16 without bias. The
// 144-linear model is measured as the project measures it elsewhere
// (bench_workloads m144/block_records): m144/block_records, one record per
// block of 6 tensors (24 records); m144/linear_records (one record per
// linear, 144 small copies) runs the speed cases in bf16 and int4 only, for
// comparison (the copy-size effect is largest at int4's smallest records).
//
//   quant/<model>/<fwd|fwd_bwd_data>/T:1024/depth:2
//       the weights streamed from a pinned pool through a ring (lwo_schedule
//       over the R records [0..R-1], or [0..R-1, R-1..0] with backward-data
//       dx = dy W on the way back, no weight gradients), in bf16 and in each quantized
//       format (quantized on load with lwo_pool_write_quantized; each
//       lwo_linear_forward / _backward dequantizes its slot into the
//       stream's weight workspace and runs the GEMM). Counters per format F:
//       F_ms (median pass), F_h2d_bytes (moved per pass, lwo_ring_get_stats),
//       F_speedup = bf16_ms / F_ms (throughput against bf16 in the same
//       run), F_target (1.9 for fp8 and int8, 3.5 for int4), F_met,
//       F_GBps (h2d bytes / pass time); records, tensors_per_record.
//   quant/<model>/dequant_share/T:16384
//       compute-bound: per format, the resident step (forward +
//       backward-data) on quantized device copies (dequantized in each call)
//       against the same GEMMs on pre-dequantized bf16 copies, timed in
//       --share-pairs pairs (default 21, the order alternating), and the
//       streamed quantized step. F_dequant_ms = the median of the pairs'
//       differences (resident quantized - resident pre-dequantized),
//       F_resident_dense_ms / F_resident_quant_ms the medians of each side,
//       F_share = F_dequant_ms / F_step_ms (the
//       streamed step), target <= 0.03 (F_share_met); F_kernels_ms: the
//       step's dequantizations alone (both directions, back to back, no
//       GEMMs; event-timed, the median of 5), F_kernels_share = F_kernels_ms
//       / F_step_ms, the same cost without the pairs' noise; F_matches_resident:
//       the streamed step's dx equals the resident quantized step's bit for
//       bit.
//
// Times are host wall-clock from the first call of a pass to the return of
// cudaStreamSynchronize, medians over --iterations (default 5) after
// --warmup (default 1).
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <random>

#include "bench/common.h"
#include "testkit/dtype.h"
#include "testkit/workload.h"

namespace lwob {
namespace {

int g_iterations = 5;
int g_share_pairs = 21;  // dequant_share: pairs of resident steps (--share-pairs)
int g_warmup = 1;

struct Op {
  int64_t in, out;
};
struct QModel {
  std::string name;
  std::vector<Op> ops;
  uint32_t per_record = 1;  // ops per record: op i is tensor i % per_record of record i / per_record
  bool share = true;        // runs the dequant_share case
  bool all_formats = true;  // else bf16 and int4 only
  uint32_t records() const { return static_cast<uint32_t>(ops.size() / per_record); }
  // The name of op i's tensor in its record.
  std::string tensor(size_t i) const {
    return per_record == 1 ? std::string("weight") : "weight" + std::to_string(i % per_record);
  }
  int64_t max_dim() const {
    int64_t m = 0;
    for (const Op& o : ops) m = std::max({m, o.in, o.out});
    return m;
  }
};

QModel linear8192x32() {
  QModel m;
  m.name = "linear8192x32";
  m.ops.assign(32, {8192, 8192});
  return m;
}
QModel m144(bool block_records) {
  const testkit::ChainSpec c = testkit::m144_chain(block_records);
  QModel m;
  m.name = c.name;
  for (const auto& op : c.ops) m.ops.push_back({op.first, op.second});
  m.per_record = static_cast<uint32_t>(c.records.front().size());
  m.share = m.all_formats = block_records;
  return m;
}

struct Format {
  lwo_quant_format_t f;
  const char* name;
  double target;  // speed-up over bf16 at T=1024 (0: bf16 itself)
};
const std::vector<Format>& formats() {
  static const std::vector<Format> v = {{LWO_QUANT_NONE, "bf16", 0},
                                        {LWO_QUANT_FP8_E4M3_CHANNEL, "fp8", 1.9},
                                        {LWO_QUANT_FP8_E4M3_BLOCK128, "fp8_block", 1.9},
                                        {LWO_QUANT_INT8_CHANNEL, "int8", 1.9},
                                        {LWO_QUANT_INT4_GROUP128, "int4", 3.5}};
  return v;
}

constexpr double kShareTarget = 0.03;

// --- pools: one per (model, format), kept for the whole run ------------------

struct QPool {
  Pool pool;
  uint64_t bytes = 0;
};
std::map<std::string, std::unique_ptr<QPool>> g_pools;

void cleanup() { g_pools.clear(); }

// bf16 random normal weights (std 0.02) of one shape; seeded by the shape.
std::vector<uint16_t> source_weights(const Op& op) {
  std::vector<uint16_t> w(static_cast<size_t>(op.in * op.out));
  std::mt19937_64 rng(static_cast<uint64_t>(op.in * 131 + op.out));
  std::normal_distribution<float> g(0.f, 0.02f);
  for (size_t i = 0; i < w.size(); ++i) testkit::store_f32(w.data(), LWO_DTYPE_BF16, i, g(rng));
  return w;
}

QPool& pool_of(const QModel& m, const Format& fmt) {
  const std::string key = m.name + "/" + fmt.name;
  auto it = g_pools.find(key);
  if (it != g_pools.end()) return *it->second;
  // The cases run model by model: another model's pools are done with.
  for (auto p = g_pools.begin(); p != g_pools.end();)
    p = p->first.compare(0, m.name.size() + 1, m.name + "/") == 0 ? std::next(p) : g_pools.erase(p);
  const size_t n_ops = m.ops.size();
  const uint32_t R = m.records(), P = m.per_record;
  lwo_tensor_quant_ext q = testkit::quant_ext(fmt.f);
  std::vector<std::string> names(n_ops);
  std::vector<lwo_tensor_desc> t(n_ops);
  std::vector<lwo_layer_desc> layers(R);
  for (size_t i = 0; i < n_ops; ++i) {
    names[i] = m.tensor(i);
    t[i].name = names[i].c_str();
    t[i].dtype = LWO_DTYPE_BF16;
    t[i].n_dims = 2;
    t[i].shape[0] = m.ops[i].out;
    t[i].shape[1] = m.ops[i].in;
    t[i].next = fmt.f == LWO_QUANT_NONE ? nullptr : &q;
  }
  for (uint32_t l = 0; l < R; ++l) layers[l] = lwo_layer_desc{&t[size_t(l) * P], P, nullptr};
  auto p = std::make_unique<QPool>();
  check(lwo_pool_create_pinned(engine(), layers.data(), R, nullptr, p->pool.out()),
        "lwo_pool_create_pinned");
  // The first op of each shape from its bf16 source (quantized on load),
  // the others copied from it.
  std::map<std::pair<int64_t, int64_t>, size_t> first;
  for (size_t i = 0; i < n_ops; ++i) {
    const Op& op = m.ops[i];
    const uint32_t l = static_cast<uint32_t>(i / P);
    auto f = first.find({op.in, op.out});
    if (f == first.end()) {
      const std::vector<uint16_t> src = source_weights(op);
      if (fmt.f == LWO_QUANT_NONE)
        check(lwo_pool_write(p->pool.get(), l, names[i].c_str(), src.data(), src.size() * 2),
              "lwo_pool_write");
      else
        check(lwo_pool_write_quantized(p->pool.get(), l, names[i].c_str(), src.data(),
                                       LWO_DTYPE_BF16, src.size() * 2, 0),
              "lwo_pool_write_quantized");
      first[{op.in, op.out}] = i;
      continue;
    }
    void* h = nullptr;
    uint64_t b = 0;
    check(lwo_pool_tensor_host(p->pool.get(), static_cast<uint32_t>(f->second / P),
                               names[f->second].c_str(), &h, &b),
          "lwo_pool_tensor_host");
    check(lwo_pool_write(p->pool.get(), l, names[i].c_str(), h, b), "lwo_pool_write");
  }
  lwo_pool_info info = LWO_POOL_INFO_INIT;
  check(lwo_pool_get_info(p->pool.get(), &info), "lwo_pool_get_info");
  p->bytes = info.total_bytes;
  return *(g_pools[key] = std::move(p));
}

// --- passes ------------------------------------------------------------------

lwo_linear_desc desc_of(const Op& op, lwo_quant_format_t f) {
  lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
  d.dtype = LWO_DTYPE_BF16;
  d.in_features = op.in;
  d.out_features = op.out;
  d.weight_format = f;
  return d;
}

// Activations: the input x0 [T, max], the output gradient g0, and two
// ping-pong buffers; random bf16 in [-1, 1).
struct Acts {
  DeviceMem x0, g0, a, b;
  Acts(int64_t T, int64_t dim) {
    const size_t bytes = static_cast<size_t>(T * dim) * 2;
    x0 = device_alloc(bytes, "x0");
    g0 = device_alloc(bytes, "dy0");
    a = device_alloc(bytes, "activations a");
    b = device_alloc(bytes, "activations b");
    std::vector<uint16_t> h(static_cast<size_t>(T * dim));
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (size_t i = 0; i < h.size(); ++i) testkit::store_f32(h.data(), LWO_DTYPE_BF16, i, u(rng));
    check(cudaMemcpy(x0.get(), h.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy x0");
    check(cudaMemcpy(g0.get(), h.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy dy0");
  }
};

// One pass; `weight(i, bwd)` gives op i's weight pointer (streamed: from the
// schedule, which gives a record at its first op in the pass's direction). Returns the buffer holding the last result.
template <class W>
void* chain_pass(const QModel& m, lwo_quant_format_t f, int64_t T, bool bwd, Acts& acts,
                 cudaStream_t st, W&& weight) {
  const size_t R = m.ops.size();
  const void* cur = acts.x0.get();
  void* bufs[2] = {acts.a.get(), acts.b.get()};
  int k = 0;
  for (size_t i = 0; i < R; ++i) {
    const lwo_linear_desc d = desc_of(m.ops[i], f);
    check(lwo_linear_forward(engine(), &d, T, cur, weight(i, false), nullptr, bufs[k], st),
          "lwo_linear_forward");
    cur = bufs[k];
    k ^= 1;
  }
  if (!bwd) return const_cast<void*>(cur);
  cur = acts.g0.get();
  for (size_t i = R; i-- > 0;) {
    const lwo_linear_desc d = desc_of(m.ops[i], f);
    check(lwo_linear_backward(engine(), &d, T, nullptr, cur, weight(i, true), bufs[k], nullptr,
                              nullptr, LWO_DTYPE_F32, st),
          "lwo_linear_backward");
    cur = bufs[k];
    k ^= 1;
  }
  return const_cast<void*>(cur);
}

struct Streamed {
  double median_ms = 0;
  double h2d_bytes = 0;  // per pass
  void* last = nullptr;
};

Streamed streamed(const QModel& m, const Format& fmt, int64_t T, bool bwd, uint32_t depth,
                  Acts& acts, cudaStream_t st) {
  QPool& qp = pool_of(m, fmt);
  lwo_ring_config rc = LWO_RING_CONFIG_INIT;
  rc.depth = depth;
  Ring ring;
  check(lwo_ring_create(qp.pool.get(), &rc, ring.out()), "lwo_ring_create");
  const uint32_t R = m.records(), P = m.per_record;
  std::vector<uint32_t> order;
  for (uint32_t l = 0; l < R; ++l) order.push_back(l);
  if (bwd)
    for (uint32_t l = R; l-- > 0;) order.push_back(l);
  Schedule sched;
  check(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()),
                            sched.out()),
        "lwo_schedule_create");
  // The record's view, taken at its first op in the pass's direction (op
  // i % P == 0 forward, P - 1 backward) and used for its other ops.
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  auto weight = [&](size_t i, bool bwd_op) -> const void* {
    if (i % P == (bwd_op ? P - 1 : 0)) {
      v = LWO_LAYER_VIEW_INIT;
      check(lwo_schedule_next(sched.get(), st, &v), "lwo_schedule_next");
      if (v.layer != i / P) fail(strf("schedule gave layer %u, expected %zu", v.layer, i / P));
      if (v.n_tensors != P) fail(strf("layer %u has %u tensors, expected %u", v.layer, v.n_tensors, P));
    }
    return v.tensors[i % P];
  };
  std::vector<double> ms;
  Streamed out;
  uint64_t bytes0 = 0;
  for (int it = 0; it < g_warmup + g_iterations; ++it) {
    if (it == g_warmup) bytes0 = testkit::ring_stats(ring.get()).bytes_copied;
    check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    const double t0 = now_seconds();
    check(lwo_schedule_reset(sched.get(), st), "lwo_schedule_reset");
    out.last = chain_pass(m, fmt.f, T, bwd, acts, st, weight);
    lwo_layer_view end = LWO_LAYER_VIEW_INIT;
    if (lwo_schedule_next(sched.get(), st, &end) != LWO_END) fail("the schedule did not end");
    check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    if (it >= g_warmup) ms.push_back((now_seconds() - t0) * 1e3);
  }
  check(lwo_engine_check(engine()), "lwo_engine_check");
  out.median_ms = median(ms);
  out.h2d_bytes =
      static_cast<double>(testkit::ring_stats(ring.get()).bytes_copied - bytes0) / g_iterations;
  return out;
}

void bm_speed(benchmark::State& state, const QModel& m, bool bwd) {
  run_guarded(state, [&] {
    const int64_t T = state.range(0);
    const uint32_t depth = static_cast<uint32_t>(state.range(1));
    Stream stream = make_stream();
    Acts acts(T, m.max_dim());
    auto& c = state.counters;
    double bf16_ms = 0, total = 0;
    for (auto _ : state) {
      for (const Format& fmt : formats()) {
        if (!m.all_formats && fmt.f != LWO_QUANT_NONE && fmt.f != LWO_QUANT_INT4_GROUP128) continue;
        const Streamed s = streamed(m, fmt, T, bwd, depth, acts, stream.get());
        total += s.median_ms;
        const std::string n = fmt.name;
        c[n + "_ms"] = s.median_ms;
        c[n + "_h2d_bytes"] = s.h2d_bytes;
        c[n + "_pool_bytes"] = static_cast<double>(pool_of(m, fmt).bytes);
        c[n + "_GBps"] = s.h2d_bytes / (s.median_ms * 1e6);
        if (fmt.f == LWO_QUANT_NONE) {
          bf16_ms = s.median_ms;
          continue;
        }
        const double speedup = s.median_ms > 0 ? bf16_ms / s.median_ms : 0;
        c[n + "_speedup"] = speedup;
        c[n + "_target"] = fmt.target;
        c[n + "_met"] = speedup >= fmt.target ? 1 : 0;
      }
      state.SetIterationTime(total / 1e3);
    }
    c["h2d_peak_GBps"] = peaks().h2d_gbps;
    c["records"] = static_cast<double>(m.records());
    c["tensors_per_record"] = static_cast<double>(m.per_record);
    c["depth"] = depth;
    c["T"] = static_cast<double>(T);
  });
}

// Resident copies of one format's weights: the quantized bytes (as the pool
// holds them) and their dequantization to bf16 (lwo_dequantize).
struct Resident {
  std::vector<DeviceMem> q, dense;
};
Resident make_resident(const QModel& m, const Format& fmt, cudaStream_t st) {
  QPool& P = pool_of(m, fmt);
  Resident r;
  for (size_t i = 0; i < m.ops.size(); ++i) {
    void* h = nullptr;
    uint64_t b = 0;
    check(lwo_pool_tensor_host(P.pool.get(), static_cast<uint32_t>(i / m.per_record),
                               m.tensor(i).c_str(), &h, &b),
          "lwo_pool_tensor_host");
    r.q.push_back(device_alloc(b, "resident quantized weight"));
    check(cudaMemcpy(r.q.back().get(), h, b, cudaMemcpyHostToDevice), "cudaMemcpy");
    const Op& op = m.ops[i];
    r.dense.push_back(device_alloc(static_cast<size_t>(op.in * op.out) * 2, "dequantized weight"));
    lwo_quant_desc qd = LWO_QUANT_DESC_INIT;
    qd.format = fmt.f;
    qd.dtype = LWO_DTYPE_BF16;
    qd.rows = op.out;
    qd.cols = op.in;
    check(lwo_dequantize(engine(), &qd, r.q.back().get(), r.dense.back().get(), st),
          "lwo_dequantize");
  }
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
  return r;
}

double pass_ms(const QModel& m, lwo_quant_format_t f, const std::vector<DeviceMem>& w, int64_t T,
               Acts& acts, cudaStream_t st, void** last) {
  auto weight = [&](size_t i, bool) -> const void* { return w[i].get(); };
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
  const double t0 = now_seconds();
  *last = chain_pass(m, f, T, true, acts, st, weight);
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
  return (now_seconds() - t0) * 1e3;
}

// The resident step on pre-dequantized bf16 copies and on the quantized
// copies, in pairs (the order alternating from pair to pair), so that the
// slow drift of a compute-bound GPU's clocks falls on both sides of each
// difference: the medians of each side and of the pairs' differences.
struct Paired {
  double dense_ms = 0, quant_ms = 0, dequant_ms = 0;
};
Paired paired_ms(const QModel& m, const Format& fmt, const Resident& r, int64_t T, Acts& acts,
                 cudaStream_t st, void** last_quant) {
  std::vector<double> dense, quant, diff;
  void* last = nullptr;
  for (int it = 0; it < g_warmup + g_share_pairs; ++it) {
    double d, q;
    // The last pair ends with the quantized step: *last_quant is its output
    // (the passes share the activation buffers).
    if ((g_warmup + g_share_pairs - 1 - it) % 2 == 0) {
      d = pass_ms(m, LWO_QUANT_NONE, r.dense, T, acts, st, &last);
      q = pass_ms(m, fmt.f, r.q, T, acts, st, last_quant);
    } else {
      q = pass_ms(m, fmt.f, r.q, T, acts, st, last_quant);
      d = pass_ms(m, LWO_QUANT_NONE, r.dense, T, acts, st, &last);
    }
    if (it < g_warmup) continue;
    dense.push_back(d);
    quant.push_back(q);
    diff.push_back(q - d);
  }
  return {median(dense), median(quant), median(diff)};
}

// The step's dequantizations alone: each weight dequantized twice (forward
// and backward-data), as the quantized step does, back to back on the
// stream into one scratch buffer, without the GEMMs; the median of 5 passes
// (event-timed): the kernels' own cost, without the noise of a difference
// between two compute-bound steps.
double dequant_alone_ms(const QModel& m, const Format& fmt, const Resident& r, cudaStream_t st) {
  size_t most = 0;
  for (const Op& op : m.ops) most = std::max(most, static_cast<size_t>(op.in * op.out) * 2);
  DeviceMem scratch = device_alloc(most, "dequantization scratch");
  cudaEvent_t e[2];
  check(cudaEventCreate(&e[0]), "cudaEventCreate");
  check(cudaEventCreate(&e[1]), "cudaEventCreate");
  std::vector<double> ms;
  for (int it = 0; it < 6; ++it) {  // the first warms up
    check(cudaEventRecord(e[0], st), "cudaEventRecord");
    for (int dir = 0; dir < 2; ++dir)
      for (size_t k = 0; k < m.ops.size(); ++k) {
        const size_t i = dir == 0 ? k : m.ops.size() - 1 - k;
        lwo_quant_desc qd = LWO_QUANT_DESC_INIT;
        qd.format = fmt.f;
        qd.dtype = LWO_DTYPE_BF16;
        qd.rows = m.ops[i].out;
        qd.cols = m.ops[i].in;
        check(lwo_dequantize(engine(), &qd, r.q[i].get(), scratch.get(), st), "lwo_dequantize");
      }
    check(cudaEventRecord(e[1], st), "cudaEventRecord");
    check(cudaEventSynchronize(e[1]), "cudaEventSynchronize");
    float t = 0;
    check(cudaEventElapsedTime(&t, e[0], e[1]), "cudaEventElapsedTime");
    if (it) ms.push_back(t);
  }
  check(cudaEventDestroy(e[0]), "cudaEventDestroy");
  check(cudaEventDestroy(e[1]), "cudaEventDestroy");
  return median(ms);
}

void bm_share(benchmark::State& state, const QModel& m) {
  run_guarded(state, [&] {
    const int64_t T = state.range(0);
    Stream stream = make_stream();
    Acts acts(T, m.max_dim());
    const int64_t last_dim = m.ops.front().in;  // dx of layer 0
    const size_t out_bytes = static_cast<size_t>(T * last_dim) * 2;
    auto& c = state.counters;
    double total = 0;
    for (auto _ : state) {
      for (const Format& fmt : formats()) {
        if (fmt.f == LWO_QUANT_NONE) continue;
        const std::string n = fmt.name;
        Resident r = make_resident(m, fmt, stream.get());
        void* last = nullptr;
        const Paired pr = paired_ms(m, fmt, r, T, acts, stream.get(), &last);
        const double kernels = dequant_alone_ms(m, fmt, r, stream.get());
        const double dense = pr.dense_ms, quant = pr.quant_ms;
        std::vector<uint8_t> want(out_bytes), got(out_bytes);
        check(cudaMemcpy(want.data(), last, out_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
        r = Resident();  // free before streaming
        const Streamed s = streamed(m, fmt, T, true, 2, acts, stream.get());
        check(cudaMemcpy(got.data(), s.last, out_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
        total += s.median_ms;
        const double dq = pr.dequant_ms;
        c[n + "_resident_dense_ms"] = dense;
        c[n + "_resident_quant_ms"] = quant;
        c[n + "_step_ms"] = s.median_ms;
        c[n + "_dequant_ms"] = dq;
        c[n + "_share"] = s.median_ms > 0 ? dq / s.median_ms : 0;
        c[n + "_share_met"] = s.median_ms > 0 && dq / s.median_ms <= kShareTarget ? 1 : 0;
        c[n + "_kernels_ms"] = kernels;
        c[n + "_kernels_share"] = s.median_ms > 0 ? kernels / s.median_ms : 0;
        c[n + "_matches_resident"] = want == got ? 1 : 0;
        if (want != got)
          std::fprintf(stderr, "bench_quant: %s %s T=%lld: streamed dx differs from resident\n",
                       m.name.c_str(), fmt.name, static_cast<long long>(T));
      }
      state.SetIterationTime(total / 1e3);
    }
    c["share_target"] = kShareTarget;
    c["T"] = static_cast<double>(T);
  });
}

void register_benchmarks() {
  static const std::vector<QModel> all = {linear8192x32(), m144(true), m144(false)};
  for (const QModel& m : all) {
    for (bool bwd : {false, true}) {
      const std::string name = "quant/" + m.name + (bwd ? "/fwd_bwd_data" : "/fwd");
      timed_ms(benchmark::RegisterBenchmark(
                   name.c_str(), [&m, bwd](benchmark::State& st) { bm_speed(st, m, bwd); })
                   ->Args({1024, 2})
                   ->ArgNames({"T", "depth"}),
               1);
    }
    if (!m.share) continue;
    const std::string name = "quant/" + m.name + "/dequant_share";
    timed_ms(benchmark::RegisterBenchmark(name.c_str(),
                                          [&m](benchmark::State& st) { bm_share(st, m); })
                 ->Args({16384})
                 ->ArgNames({"T"}),
             1);
  }
}

}  // namespace

const MainSpec kMain = {
    "bench_quant", "quantized weights on the bus: speed against bf16, dequantization's share",
    register_benchmarks, cleanup,
    {int_flag("--iterations", "timed passes of each kind (default 5)", g_iterations, 1, 1000),
     int_flag("--share-pairs", "dequant_share: timed pairs of resident steps (default 21)",
              g_share_pairs, 1, 1000),
     int_flag("--warmup", "untimed passes of each kind first (default 1)", g_warmup, 0, 1000)},
    /*needs_engine=*/true, /*needs_peaks=*/true, /*needs_d2h_peak=*/false};

}  // namespace lwob
