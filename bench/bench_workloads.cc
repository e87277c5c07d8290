// bench_workloads: streamed against resident, forward and forward+backward
// (a training step), on the workloads. Each benchmark measures, in the
// same process:
//   resident   the same library calls with every weight in device memory
//              (weight gradients into device scratch: compute only)
//   streamed   the weights streamed from a pinned pool through a ring by
//              lwo_schedule over [0..R-1] (forward) or [0..R-1, R-1..0]
//              (step); in a step every record's weight gradients go to host
//              memory through lwo_grads (f32 wire), sent before dx is computed
// and reports the bound max(resident, H2D bytes / H2D peak, D2H bytes / D2H
// peak) with the bytes each streamed iteration moved (lwo_ring_get_stats,
// lwo_grads_get_stats) and the pinned peaks measured once at start, and the
// ratio streamed / bound. The last streamed iteration's output (and in a step
// its input gradient) is compared bit for bit with the resident one.
//
// Times are host wall-clock from the first call of the iteration to the
// return of the final synchronisation (cudaStreamSynchronize, and in a step
// lwo_grads_wait), the GPU idle before; medians over --iterations (default 5)
// after --warmup (default 1) untimed iterations of each kind.
//
// Workloads (bf16, no bias, activations chained x_{i+1} = y_i):
//   linear8192x32            32 x Linear(8192x8192), T = 1024, 8192, 16384
//   m144/linear_records      24 blocks of 4 x Linear(2048x2048), Linear(2048->8192),
//   m144/block_records       Linear(8192->2048), T = 1024: one record per linear
//                            (144 records) or per block (24 records of 6 tensors)
//   linear2048x256/rec1      256 x Linear(2048x2048), T = 256, records of 1 layer
//   linear2048x256/rec4      ... records of 4 layers (64 records)
//   linear256x512            512 x Linear(256x256), T = 16 (overhead-bound)
//   conv3x3_stage/rec1, rec4 32 x Conv2d(512->512, 3x3, pad 1), NHWC, N = 64 images,
//                            one or four layers per record
//                            of 14x14 (a ResNet-stage-like stack, made deep)
// Names: <workload>/<fwd|step>/T:<tokens>/depth:<ring depth> (N:<images> for
// convolutions). --depth=2,4 runs each at several ring depths. The whole
// program runs in about a minute on an H200.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>

#include "bench/common.h"

namespace lwob {
namespace {

constexpr uint64_t kAlign = LWO_RECORD_ALIGN;
uint64_t align_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

std::vector<uint64_t> g_depths{2};
int g_iterations = 5;
int g_warmup = 1;

// --- models ---------------------------------------------------------------------

enum class OpKind { kLinear, kConv3x3 };

struct Model {
  std::string name;
  OpKind kind = OpKind::kLinear;
  std::vector<std::pair<int64_t, int64_t>> ops;  // (in, out) features or channels
  std::vector<std::vector<uint32_t>> records;    // consecutive op indices per record
  int32_t h = 1, w = 1;                          // convolutions: image size
  double target = 1.03;                          // streamed / bound
  double resident_target = 0;                    // streamed / resident, 0: none
  const char* rows_name = "T";                   // tokens, or images for convolutions
  std::vector<int64_t> rows;                     // the row counts to run

  uint64_t spatial() const { return static_cast<uint64_t>(h) * static_cast<uint64_t>(w); }
  uint64_t weight_elems(uint32_t i) const {
    return static_cast<uint64_t>(ops[i].first) * static_cast<uint64_t>(ops[i].second) *
           (kind == OpKind::kConv3x3 ? 9 : 1);
  }
  uint64_t fan_in(uint32_t i) const {
    return static_cast<uint64_t>(ops[i].first) * (kind == OpKind::kConv3x3 ? 9 : 1);
  }
};

void group(Model& m, uint32_t per_record) {
  for (uint32_t i = 0; i < m.ops.size(); i += per_record) {
    std::vector<uint32_t> r;
    for (uint32_t k = i; k < std::min<size_t>(m.ops.size(), i + per_record); ++k) r.push_back(k);
    m.records.push_back(r);
  }
}

Model chain(const std::string& name, int64_t dim, uint32_t n, uint32_t per_record,
            std::vector<int64_t> rows) {
  Model m;
  m.name = name;
  m.ops.assign(n, {dim, dim});
  group(m, per_record);
  m.rows = std::move(rows);
  return m;
}

Model m144(bool block_records) {
  Model m;
  m.name = block_records ? "m144/block_records" : "m144/linear_records";
  for (int b = 0; b < 24; ++b) {
    for (int k = 0; k < 4; ++k) m.ops.push_back({2048, 2048});
    m.ops.push_back({2048, 8192});
    m.ops.push_back({8192, 2048});
  }
  group(m, block_records ? 6 : 1);
  if (block_records) m.target = 1.02;
  m.rows = {1024};
  return m;
}

Model conv_stage(uint32_t per_record) {
  Model m;
  m.name = "conv3x3_stage/rec" + std::to_string(per_record);
  m.kind = OpKind::kConv3x3;
  m.ops.assign(32, {512, 512});
  group(m, per_record);
  m.h = m.w = 14;
  m.rows_name = "N";
  m.rows = {64};
  return m;
}

std::vector<Model> models() {
  std::vector<Model> v;
  v.push_back(chain("linear8192x32", 8192, 32, 1, {1024, 8192, 16384}));
  v.push_back(m144(false));
  v.push_back(m144(true));
  v.push_back(chain("linear2048x256/rec1", 2048, 256, 1, {256}));
  v.push_back(chain("linear2048x256/rec4", 2048, 256, 4, {256}));
  Model small = chain("linear256x512", 256, 512, 1, {16});
  small.resident_target = 1.5;
  v.push_back(small);
  v.push_back(conv_stage(1));
  v.push_back(conv_stage(4));  // four 4.7 MiB layers per record
  return v;
}

// --- the loaded model: pool, resident copy, gradients -----------------------------

struct Loaded {
  std::string name;
  Pool pool;
  Grads grads;  // created by the first step benchmark
  uint64_t pool_bytes = 0;
  std::vector<uint64_t> record_bytes, resident_off;         // per record
  std::vector<std::vector<uint64_t>> tensor_off, grad_off;  // per record, per tensor
  uint64_t max_grad_bytes = 0;                              // f32 gradients of one record
  DeviceMem resident;                                       // every record, back to back

  ~Loaded() {
    grads.reset();  // before the pool
    pool.reset();
  }
  const void* resident_tensor(uint32_t r, uint32_t j) const {
    return static_cast<const uint8_t*>(resident.get()) + resident_off[r] + tensor_off[r][j];
  }
};
Loaded* g_loaded = nullptr;

void cleanup() {
  delete g_loaded;
  g_loaded = nullptr;
}

Loaded& load(const Model& m) {
  if (g_loaded && g_loaded->name == m.name) return *g_loaded;
  cleanup();  // one model at a time
  auto L = std::make_unique<Loaded>();
  L->name = m.name;
  const uint32_t R = static_cast<uint32_t>(m.records.size());
  std::vector<std::vector<std::string>> names(R);
  std::vector<std::vector<lwo_tensor_desc>> tensors(R);
  std::vector<lwo_layer_desc> layers(R);
  for (uint32_t r = 0; r < R; ++r) {
    for (uint32_t j = 0; j < m.records[r].size(); ++j) names[r].push_back(strf("w%u", j));
    for (uint32_t j = 0; j < m.records[r].size(); ++j) {
      const uint32_t i = m.records[r][j];
      lwo_tensor_desc t{};
      t.name = names[r][j].c_str();
      t.dtype = LWO_DTYPE_BF16;
      if (m.kind == OpKind::kLinear) {
        t.n_dims = 2;
        t.shape[0] = m.ops[i].second;  // [out, in]
        t.shape[1] = m.ops[i].first;
      } else {
        t.n_dims = 4;  // NHWC filters: [k, kh, kw, c]
        t.shape[0] = m.ops[i].second;
        t.shape[1] = 3;
        t.shape[2] = 3;
        t.shape[3] = m.ops[i].first;
      }
      tensors[r].push_back(t);
    }
    layers[r] =
        lwo_layer_desc{tensors[r].data(), static_cast<uint32_t>(tensors[r].size()), nullptr};
  }
  check(lwo_pool_create_pinned(engine(), layers.data(), R, nullptr, L->pool.out()),
        "lwo_pool_create_pinned");

  std::vector<Bf16Range> fill;
  L->record_bytes.resize(R);
  L->resident_off.resize(R);
  L->tensor_off.resize(R);
  L->grad_off.resize(R);
  for (uint32_t r = 0; r < R; ++r) {
    check(lwo_pool_record_bytes(L->pool.get(), r, &L->record_bytes[r]), "lwo_pool_record_bytes");
    L->resident_off[r] = L->pool_bytes;
    L->pool_bytes += L->record_bytes[r];
    uint64_t g = 0;
    for (uint32_t j = 0; j < m.records[r].size(); ++j) {
      const uint32_t i = m.records[r][j];
      lwo_tensor_info info = LWO_TENSOR_INFO_INIT;
      check(lwo_pool_tensor_info(L->pool.get(), r, j, &info), "lwo_pool_tensor_info");
      L->tensor_off[r].push_back(info.offset);
      L->grad_off[r].push_back(g);
      g += align_up(m.weight_elems(i) * 4);
      void* p = nullptr;
      uint64_t bytes = 0;
      check(lwo_pool_tensor_host(L->pool.get(), r, names[r][j].c_str(), &p, &bytes),
            "lwo_pool_tensor_host");
      // Uniform within +-sqrt(3 / fan_in): variance 1 / fan_in, so activations
      // keep their scale through the chain.
      fill.push_back(
          {p, bytes / 2, std::sqrt(3.0f / static_cast<float>(m.fan_in(i))), mix64(0x5eedull + i)});
    }
    L->max_grad_bytes = std::max(L->max_grad_bytes, g);
  }
  fill_uniform_bf16(fill);

  L->resident = device_alloc(L->pool_bytes);
  for (uint32_t r = 0; r < R; ++r) {
    void* host = nullptr;
    uint64_t bytes = 0;
    check(lwo_pool_layer_host(L->pool.get(), r, &host, &bytes), "lwo_pool_layer_host");
    check(cudaMemcpy(static_cast<uint8_t*>(L->resident.get()) + L->resident_off[r], host, bytes,
                     cudaMemcpyHostToDevice),
          "cudaMemcpy (resident record)");
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  g_loaded = L.release();
  return *g_loaded;
}

// --- the chain on the device ---------------------------------------------------------

// Activations x_0 .. x_N (all kept for the backward pass), the output gradient
// dy_N and two ping-pong gradient buffers: the backward of op i reads dy_in(i)
// and writes its dx into dx_out(i), which is dy_in(i - 1).
struct Net {
  const Model* m = nullptr;
  int64_t rows = 0;
  cudaStream_t stream = nullptr;
  std::vector<DeviceMem> act;
  DeviceMem dy_last, dbuf[2];
  std::vector<lwo_linear_desc> lin;
  std::vector<lwo_conv2d_desc> conv;

  uint32_t n_ops() const { return static_cast<uint32_t>(m->ops.size()); }
  uint64_t act_bytes(int64_t width) const {
    return static_cast<uint64_t>(rows) * m->spatial() * static_cast<uint64_t>(width) * 2;
  }
  void* x(uint32_t i) const { return act[i].get(); }
  const void* dy_in(uint32_t i) const {
    uint32_t k = n_ops() - 1 - i;
    return k == 0 ? dy_last.get() : dbuf[(k - 1) % 2].get();
  }
  void* dx_out(uint32_t i) const { return dbuf[(n_ops() - 1 - i) % 2].get(); }

  Net(const Model& model, int64_t n_rows, cudaStream_t s) : m(&model), rows(n_rows), stream(s) {
    const uint32_t N = n_ops();
    int64_t widest = 0;
    act.push_back(device_alloc(act_bytes(m->ops[0].first)));
    for (uint32_t i = 0; i < N; ++i) {
      act.push_back(device_alloc(act_bytes(m->ops[i].second)));
      widest = std::max({widest, m->ops[i].first, m->ops[i].second});
      lwo_linear_desc l = LWO_LINEAR_DESC_INIT;
      l.in_features = m->ops[i].first;
      l.out_features = m->ops[i].second;
      lin.push_back(l);
      lwo_conv2d_desc c = LWO_CONV2D_DESC_INIT;
      c.in_channels = static_cast<int32_t>(m->ops[i].first);
      c.out_channels = static_cast<int32_t>(m->ops[i].second);
      c.kernel_h = c.kernel_w = 3;
      c.pad_h = c.pad_w = 1;
      conv.push_back(c);
    }
    dy_last = device_alloc(act_bytes(m->ops[N - 1].second));
    dbuf[0] = device_alloc(act_bytes(widest));
    dbuf[1] = device_alloc(act_bytes(widest));
    // x_0 uniform in [-1, 1); dy_N within +-1/sqrt(rows) (each weight gradient
    // is a sum over the rows).
    const uint64_t n0 = act_bytes(m->ops[0].first) / 2, nl = act_bytes(m->ops[N - 1].second) / 2;
    std::vector<uint16_t> host(std::max(n0, nl));
    // (Copies from pageable memory on `stream`, each waited for: a
    // cudaMemcpy may return before its DMA lands, and the non-blocking
    // compute stream would not wait for it.)
    fill_uniform_bf16({{host.data(), n0, 1.0f, mix64(0xacull)}});
    check(cudaMemcpyAsync(x(0), host.data(), n0 * 2, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync (x_0)");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    fill_uniform_bf16(
        {{host.data(), nl, 1.0f / std::sqrt(static_cast<float>(rows)), mix64(0xdeull)}});
    check(cudaMemcpyAsync(dy_last.get(), host.data(), nl * 2, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync (dy_N)");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  void forward(uint32_t i, const void* w) const {
    lwo_status_t s;
    if (m->kind == OpKind::kLinear)
      s = lwo_linear_forward(engine(), &lin[i], rows, x(i), w, nullptr, x(i + 1), stream);
    else
      s = lwo_conv2d_forward(engine(), &conv[i], static_cast<int32_t>(rows), m->h, m->w, x(i), w,
                             nullptr, x(i + 1), stream);
    if (s != LWO_OK) check(s, strf("forward of op %u", i).c_str());
  }
  // The weight gradient (dx == NULL) or dx (dw == NULL) of op i.
  void backward(uint32_t i, const void* w, void* dx, void* dw) const {
    lwo_status_t s;
    if (m->kind == OpKind::kLinear)
      s = lwo_linear_backward(engine(), &lin[i], rows, x(i), dy_in(i), w, dx, dw, nullptr,
                              LWO_DTYPE_F32, stream);
    else
      s = lwo_conv2d_backward(engine(), &conv[i], static_cast<int32_t>(rows), m->h, m->w, x(i),
                              dy_in(i), w, dx, dw, nullptr, LWO_DTYPE_F32, stream);
    if (s != LWO_OK) check(s, strf("backward of op %u", i).c_str());
  }

  void forward_record(uint32_t r, void* const* w) const {
    const auto& rec = m->records[r];
    for (uint32_t j = 0; j < rec.size(); ++j) forward(rec[j], w[j]);
  }
  // Backward of record r: for each op from the last, its weight gradient into
  // g[j] and then its dx (the dy of the op before). `grads_done` runs once all
  // weight gradients are enqueued, before the last dx, so that they travel to
  // the host while it is computed.
  template <class Done>
  void backward_record(uint32_t r, void* const* w, void* const* g, Done grads_done) const {
    const auto& rec = m->records[r];
    for (uint32_t j = static_cast<uint32_t>(rec.size()); j-- > 0;) {
      backward(rec[j], w[j], nullptr, g[j]);
      if (j == 0) grads_done();
      backward(rec[j], w[j], dx_out(rec[j]), nullptr);
    }
  }
};

void sync(cudaStream_t s) { check(cudaStreamSynchronize(s), "cudaStreamSynchronize"); }

// One resident iteration; returns milliseconds.
double resident_iteration(const Net& net, const Loaded& L, bool step, void* scratch) {
  const uint32_t R = static_cast<uint32_t>(net.m->records.size());
  std::vector<std::vector<void*>> w(R), g(R);
  for (uint32_t r = 0; r < R; ++r)
    for (uint32_t j = 0; j < net.m->records[r].size(); ++j) {
      w[r].push_back(const_cast<void*>(L.resident_tensor(r, j)));
      g[r].push_back(step ? static_cast<uint8_t*>(scratch) + L.grad_off[r][j] : nullptr);
    }
  const double t0 = now_seconds();
  for (uint32_t r = 0; r < R; ++r) net.forward_record(r, w[r].data());
  if (step)
    for (uint32_t r = R; r-- > 0;) net.backward_record(r, w[r].data(), g[r].data(), [] {});
  sync(net.stream);
  return (now_seconds() - t0) * 1e3;
}

struct StreamedIter {
  double ms = 0;
  uint64_t h2d = 0, d2h = 0, hits = 0;
};

lwo_ring_stats ring_stats(lwo_ring* ring) {
  lwo_ring_stats s{};
  s.size = sizeof s;
  check(lwo_ring_get_stats(ring, &s), "lwo_ring_get_stats");
  return s;
}

lwo_grads_stats grads_stats(lwo_grads* grads) {
  lwo_grads_stats s{};
  s.size = sizeof s;
  if (grads) check(lwo_grads_get_stats(grads, &s), "lwo_grads_get_stats");
  return s;
}

StreamedIter streamed_iteration(const Net& net, lwo_schedule* schedule, lwo_ring* ring,
                                lwo_grads* grads) {
  const uint32_t R = static_cast<uint32_t>(net.m->records.size());
  const uint32_t n = grads ? 2 * R : R;
  if (grads) check(lwo_grads_zero(grads), "lwo_grads_zero");
  const lwo_ring_stats r0 = ring_stats(ring);
  const lwo_grads_stats g0 = grads_stats(grads);
  const double t0 = now_seconds();
  check(lwo_schedule_reset(schedule, net.stream), "lwo_schedule_reset");
  lwo_layer_view view = LWO_LAYER_VIEW_INIT;
  for (uint32_t i = 0; i < n; ++i) {
    lwo_status_t s = lwo_schedule_next(schedule, net.stream, &view);
    if (s == LWO_END) fail(strf("the schedule ended after %u of its %u layers", i, n));
    check(s, "lwo_schedule_next");
    const uint32_t r = i < R ? i : 2 * R - 1 - i;
    if (view.layer != r)
      fail(strf("lwo_schedule_next returned layer %u at position %u; expected %u", view.layer, i,
                r));
    if (i < R) {
      net.forward_record(r, view.tensors);
      continue;
    }
    lwo_layer_view g = LWO_LAYER_VIEW_INIT;
    check(lwo_grads_begin(grads, r, net.stream, &g), "lwo_grads_begin");
    net.backward_record(r, view.tensors, g.tensors,
                        [&] { check(lwo_grads_end(grads, r, net.stream), "lwo_grads_end"); });
  }
  lwo_status_t s = lwo_schedule_next(schedule, net.stream, &view);
  if (s != LWO_END) {
    check(s, "lwo_schedule_next");
    fail(strf("the schedule did not end after its %u layers", n));
  }
  if (grads) check(lwo_grads_wait(grads), "lwo_grads_wait");
  sync(net.stream);  // the last dx follows the last gradient's copy
  StreamedIter it;
  it.ms = (now_seconds() - t0) * 1e3;
  const lwo_ring_stats r1 = ring_stats(ring);
  const lwo_grads_stats g1 = grads_stats(grads);
  it.h2d = r1.bytes_copied - r0.bytes_copied;
  it.hits = r1.n_hits - r0.n_hits;
  it.d2h = g1.bytes - g0.bytes;
  return it;
}

std::vector<uint8_t> copy_back(const void* device, uint64_t bytes) {
  std::vector<uint8_t> host(bytes);
  check(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (check)");
  return host;
}

void bm_workload(benchmark::State& state, const Model& m, bool step) {
  run_guarded(state, [&] {
    const int64_t rows = state.range(0);
    const uint32_t depth = static_cast<uint32_t>(state.range(1));
    const uint32_t R = static_cast<uint32_t>(m.records.size());
    const uint32_t N = static_cast<uint32_t>(m.ops.size());
    Loaded& L = load(m);
    Stream stream = make_stream();
    Net net(m, rows, stream.get());

    // Resident: warm-up (algorithm choice, workspace), then timed.
    DeviceMem scratch;
    if (step) scratch = device_alloc(L.max_grad_bytes);
    std::vector<double> res_ms;
    for (int k = 0; k < g_warmup + g_iterations; ++k) {
      double ms = resident_iteration(net, L, step, scratch.get());
      if (k >= g_warmup) res_ms.push_back(ms);
    }
    check(lwo_engine_check(engine()), "lwo_engine_check (resident)");
    const std::vector<uint8_t> want_y = copy_back(net.x(N), net.act_bytes(m.ops[N - 1].second));
    std::vector<uint8_t> want_dx, want_g0;
    if (step) {
      want_dx = copy_back(net.dx_out(0), net.act_bytes(m.ops[0].first));
      // The backward pass ends with record 0: the scratch holds its gradients.
      const uint32_t last = static_cast<uint32_t>(m.records[0].size()) - 1;
      want_g0 =
          copy_back(scratch.get(), L.grad_off[0][last] + m.weight_elems(m.records[0][last]) * 4);
    }
    scratch.reset();

    // Streamed.
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    rc.depth = depth;
    Ring ring;
    check(lwo_ring_create(L.pool.get(), &rc, ring.out()), "lwo_ring_create");
    std::vector<uint32_t> order(step ? 2 * R : R);
    for (uint32_t r = 0; r < R; ++r) {
      order[r] = r;
      if (step) order[2 * R - 1 - r] = r;
    }
    Schedule schedule;
    check(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()),
                              schedule.out()),
          "lwo_schedule_create");
    if (step && !L.grads.get()) {
      lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
      check(lwo_grads_create(L.pool.get(), nullptr, &gc, L.grads.out()), "lwo_grads_create");
    }
    lwo_grads* grads = step ? L.grads.get() : nullptr;
    for (int k = 0; k < g_warmup; ++k) streamed_iteration(net, schedule.get(), ring.get(), grads);
    std::vector<double> ms;
    uint64_t h2d = 0, d2h = 0, hits = 0;
    for (auto _ : state) {
      StreamedIter it = streamed_iteration(net, schedule.get(), ring.get(), grads);
      state.SetIterationTime(it.ms / 1e3);
      ms.push_back(it.ms);
      h2d += it.h2d;
      d2h += it.d2h;
      hits += it.hits;
    }
    check(lwo_engine_check(engine()), "lwo_engine_check (streamed)");
    schedule.reset();
    ring.reset();

    // The check: the last streamed iteration against the resident one, bit
    // for bit: the output, and in a step the input gradient and the host
    // gradients of record 0.
    std::string differs;
    if (copy_back(net.x(N), want_y.size()) != want_y) differs += " output";
    if (step && copy_back(net.dx_out(0), want_dx.size()) != want_dx) differs += " input-gradient";
    for (uint32_t j = 0; step && j < m.records[0].size(); ++j) {
      float* host = nullptr;
      uint64_t first = 0, n = 0;
      check(lwo_grads_shard(grads, 0, strf("w%u", j).c_str(), &host, &first, &n),
            "lwo_grads_shard");
      if (first != 0 || n != m.weight_elems(m.records[0][j]) ||
          std::memcmp(host, want_g0.data() + L.grad_off[0][j], n * 4) != 0)
        differs += strf(" weight-gradient(record 0, w%u)", j);
    }
    if (!differs.empty())
      std::fprintf(
          stderr, "bench_workloads: %s %s %s=%lld depth %u: streamed differs from resident in:%s\n",
          m.name.c_str(), step ? "step" : "fwd", m.rows_name, static_cast<long long>(rows), depth,
          differs.c_str());
    const bool same = differs.empty();

    const double n_it = static_cast<double>(std::max<size_t>(1, ms.size()));
    const double h2d_b = static_cast<double>(h2d) / n_it, d2h_b = static_cast<double>(d2h) / n_it;
    const Peaks& pk = peaks();
    const double res = median(res_ms), str = median(ms);
    const double h2d_term = pk.h2d_gbps > 0 ? h2d_b / (pk.h2d_gbps * 1e6) : 0;
    const double d2h_term = pk.d2h_gbps > 0 ? d2h_b / (pk.d2h_gbps * 1e6) : 0;
    const double bound = std::max({res, h2d_term, d2h_term});
    const double ratio = bound > 0 ? str / bound : 0;
    auto& c = state.counters;
    c["streamed_ms"] = str;
    c["streamed_ms_best"] = *std::min_element(ms.begin(), ms.end());
    c["resident_ms"] = res;
    c["h2d_bytes"] = h2d_b;
    c["d2h_bytes"] = d2h_b;
    c["h2d_peak_GBps"] = pk.h2d_gbps;
    c["d2h_peak_GBps"] = pk.d2h_gbps;
    c["h2d_ms_at_peak"] = h2d_term;
    c["d2h_ms_at_peak"] = d2h_term;
    c["bound_ms"] = bound;
    c["bound_by"] = bound == res ? 0 : bound == h2d_term ? 1 : 2;  // compute, H2D, D2H
    c["ratio"] = ratio;
    c["ratio_best"] = bound > 0 ? c["streamed_ms_best"].value / bound : 0;
    c["target"] = m.target;
    c["met"] = ratio <= m.target ? 1 : 0;
    c["streamed_over_resident"] = res > 0 ? str / res : 0;
    if (m.resident_target > 0) {
      c["resident_target"] = m.resident_target;
      c["resident_met"] = res > 0 && str / res <= m.resident_target ? 1 : 0;
    }
    c["achieved_h2d_GBps"] = str > 0 ? h2d_b / (str * 1e6) : 0;
    c["hits"] = static_cast<double>(hits) / n_it;
    c["matches_resident"] = same ? 1 : 0;
    c["weight_bytes"] = static_cast<double>(L.pool_bytes);
    c["records"] = R;
    c["depth"] = depth;
    c["rows"] = static_cast<double>(rows);
  });
}

void register_benchmarks() {
  static const std::vector<Model> all = models();
  for (const Model& m : all)
    for (int64_t rows : m.rows)
      for (bool step : {false, true}) {
        std::string name = m.name + (step ? "/step" : "/fwd");
        auto* b = benchmark::RegisterBenchmark(
            name.c_str(), [&m, step](benchmark::State& st) { bm_workload(st, m, step); });
        for (uint64_t d : g_depths) b->Args({rows, static_cast<int64_t>(d)});
        b->ArgNames({m.rows_name, "depth"})
            ->UseManualTime()
            ->Iterations(g_iterations)
            ->Unit(benchmark::kMillisecond);
      }
}

}  // namespace
}  // namespace lwob

int main(int argc, char** argv) {
  lwob::MainSpec spec;
  spec.program = "bench_workloads";
  spec.about = "streamed against resident, forward and training step, on the issue's workloads";
  spec.flags = {
      {"--depth", "ring depths, comma-separated (default 2)",
       [](const std::string& v) { lwob::g_depths = lwob::parse_uint_list("--depth", v, 1, 64); }},
      {"--iterations", "timed iterations of each kind (default 5)",
       [](const std::string& v) {
         lwob::g_iterations = static_cast<int>(lwob::parse_uint("--iterations", v, 1, 1000));
       }},
      {"--warmup", "untimed iterations of each kind first (default 1)",
       [](const std::string& v) {
         lwob::g_warmup = static_cast<int>(lwob::parse_uint("--warmup", v, 0, 1000));
       }},
  };
  spec.register_benchmarks = lwob::register_benchmarks;
  spec.cleanup = lwob::cleanup;
  return lwob::bench_main(argc, argv, spec);
}
