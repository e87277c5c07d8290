// bench_workloads: streamed against resident, forward and forward+backward
// (a training step), on the reference workloads (below). Each benchmark measures, in the
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
// its input gradient and the host gradients of the first and the last record)
// is compared bit for bit with the resident computation. The chain, its
// passes, the check and the bound are the testkit's training-step workload
// (testkit/workload.h).
//
// Times are host wall-clock from the first call of the iteration to the
// return of the final synchronisation (cudaStreamSynchronize, and in a step
// lwo_grads_wait), the GPU idle before; medians over --iterations (default 5)
// after --warmup (default 1) untimed iterations of each kind.
//
// Workloads (bf16, no bias, activations chained x_{i+1} = y_i):
//   linear8192x32            32 x Linear(8192x8192), T = 1024, 8192, 16384
//   linear8192x32_fp8        the same, its weights streamed as fp8 e4m3 with
//                            128 x 128 block scales (dW in bf16), T = 1024
//   m144/linear_records      24 blocks of 4 x Linear(2048x2048), Linear(2048->8192),
//   m144/block_records       Linear(8192->2048), T = 1024: one record per linear
//                            (144 records) or per block (24 records of 6 tensors)
//   m144/block_records_fp8   the block records with fp8 block-128 weights
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
#include <cstring>
#include <memory>

#include "bench/common.h"
#include "testkit/workload.h"

namespace lwob {
namespace {

std::vector<uint64_t> g_depths{2};
int g_iterations = 5;
int g_warmup = 1;

// --- models ---------------------------------------------------------------------

// A testkit chain and what the benchmark asks of it.
constexpr double kFloorTarget = 1.04;  // streamed step / split floor

struct Model {
  testkit::ChainSpec chain;
  double target = 1.03;            // streamed / bound
  double resident_target = 0;      // streamed / resident, 0: none
  const char* rows_name = "T";     // tokens, or images for convolutions
  std::vector<int64_t> rows;       // the row counts to run
};

Model chain(const std::string& name, int64_t dim, uint32_t n, uint32_t per_record,
            std::vector<int64_t> rows) {
  Model m;
  m.chain = testkit::linear_chain(name, dim, n, per_record);
  m.rows = std::move(rows);
  return m;
}

Model m144(bool block_records) {
  Model m;
  m.chain = testkit::m144_chain(block_records);
  if (block_records) m.target = 1.02;
  m.rows = {1024};
  return m;
}

Model conv_stage(uint32_t per_record) {
  Model m;
  m.chain.name = "conv3x3_stage/rec" + std::to_string(per_record);
  m.chain.kind = testkit::OpKind::kConv3x3;
  m.chain.ops.assign(32, {512, 512});
  m.chain.group(per_record);
  m.chain.h = m.chain.w = 14;
  m.rows_name = "N";
  m.rows = {64};
  return m;
}

// The same model with its weights streamed as fp8 e4m3 with 128 x 128 block
// scales (trainable: dW in bf16, dx from the dequantized weight).
Model fp8(Model m, std::vector<int64_t> rows) {
  m.chain.name += "_fp8";
  m.chain.quant = LWO_QUANT_FP8_E4M3_BLOCK128;
  m.rows = std::move(rows);
  return m;
}

std::vector<Model> models() {
  std::vector<Model> v;
  v.push_back(chain("linear8192x32", 8192, 32, 1, {1024, 8192, 16384}));
  v.push_back(fp8(chain("linear8192x32", 8192, 32, 1, {}), {1024}));
  v.push_back(m144(false));
  v.push_back(m144(true));
  v.push_back(fp8(m144(true), {1024}));
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
  std::unique_ptr<testkit::ChainWeights> weights;  // the pool and the resident copy
  Grads grads;  // created by the first step benchmark

  ~Loaded() { grads.reset(); }  // before the pool
};
std::unique_ptr<Loaded> g_loaded;

void cleanup() { g_loaded.reset(); }

Loaded& load(const Model& m) {
  if (g_loaded && g_loaded->weights->spec().name == m.chain.name) return *g_loaded;
  cleanup();  // one model at a time
  auto L = std::make_unique<Loaded>();
  L->weights = std::make_unique<testkit::ChainWeights>(engine(), m.chain);
  L->weights->make_resident();
  g_loaded = std::move(L);
  return *g_loaded;
}

void bm_workload(benchmark::State& state, const Model& m, bool step) {
  run_guarded(state, [&] {
    const int64_t rows = state.range(0);
    const uint32_t depth = static_cast<uint32_t>(state.range(1));
    Loaded& L = load(m);
    const testkit::ChainWeights& W = *L.weights;
    const uint32_t R = W.n_records();
    Stream stream = make_stream();
    // Gradients in the chain's dtype, on the wire and in host memory (the
    // library's default).
    testkit::ChainRun run(W, rows, stream.get(), /*trainable=*/true, m.chain.dtype);

    // Resident: warm-up (algorithm choice, workspace), then timed; each half
    // by events too, for the split floor.
    std::vector<double> res_ms, res_fwd, res_bwd;
    for (int k = 0; k < g_warmup + g_iterations; ++k) {
      const testkit::PassTimes t = run.resident_pass(step, /*events=*/true);
      if (k >= g_warmup) {
        res_ms.push_back(t.wall_ms);
        res_fwd.push_back(t.fwd_ms);
        res_bwd.push_back(t.bwd_ms);
      }
    }
    check(lwo_engine_check(engine()), "lwo_engine_check (resident)");

    // Streamed.
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    rc.depth = depth;
    Ring ring;
    check(lwo_ring_create(W.pool(), &rc, ring.out()), "lwo_ring_create");
    const std::vector<uint32_t> order = testkit::step_order(R, step);
    Schedule schedule;
    check(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()),
                              schedule.out()),
          "lwo_schedule_create");
    if (step && !L.grads.get()) {
      lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
      check(lwo_grads_create(W.pool(), nullptr, &gc, L.grads.out()), "lwo_grads_create");
    }
    lwo_grads* grads = step ? L.grads.get() : nullptr;
    testkit::StepOptions options;
    options.backward = step;
    options.half_stats = true;
    options.edges = true;
    for (int k = 0; k < g_warmup; ++k)
      run.streamed_pass(schedule.get(), ring.get(), grads, options);
    std::vector<double> ms, start, turn, end;
    uint64_t h2d = 0, h2d_fwd = 0, d2h = 0, hits = 0;
    for (auto _ : state) {
      const testkit::StepStats it = run.streamed_pass(schedule.get(), ring.get(), grads, options);
      state.SetIterationTime(it.ms / 1e3);
      ms.push_back(it.ms);
      h2d += it.h2d_bytes;
      h2d_fwd += it.h2d_fwd_bytes;
      d2h += it.d2h_bytes;
      hits += it.hits;
      start.push_back(it.start_ms);
      turn.push_back(it.turn_ms);
      end.push_back(it.end_ms);
    }
    check(lwo_engine_check(engine()), "lwo_engine_check (streamed)");
    schedule.reset();
    ring.reset();

    // The check: the last streamed iteration against the resident one, bit
    // for bit: the output, and in a step the input gradient and the host
    // gradients of the first and the last record.
    const testkit::ChainCheck same = run.compare_with_resident(grads, step);
    if (!same.same)
      std::fprintf(
          stderr, "bench_workloads: %s %s %s=%lld depth %u: streamed differs from resident in:%s (%s)\n",
          m.chain.name.c_str(), step ? "step" : "fwd", m.rows_name, static_cast<long long>(rows),
          depth, same.differs.c_str(), same.first.c_str());

    const double n_it = static_cast<double>(std::max<size_t>(1, ms.size()));
    const double h2d_b = static_cast<double>(h2d) / n_it, d2h_b = static_cast<double>(d2h) / n_it;
    const testkit::Peaks& pk = peaks();
    const double res = median(res_ms), str = median(ms);
    const testkit::Bound bound = testkit::step_bound(res, h2d_b, pk.h2d_gbps, d2h_b, pk.d2h_gbps);
    const double ratio = bound.ms > 0 ? str / bound.ms : 0;
    // The split floor: forward max(compute, H2D alone) + backward max(compute,
    // H2D and D2H at once), the duplex rates measured at start-up.
    const double h2d_fwd_b = static_cast<double>(h2d_fwd) / n_it;
    const testkit::SplitFloor floor =
        testkit::split_floor(median(res_fwd), median(res_bwd), h2d_fwd_b, h2d_b - h2d_fwd_b, d2h_b,
                             1, link_rates());
    auto& c = state.counters;
    c["floor_ms"] = floor.ms;
    c["floor_ratio"] = floor.ms > 0 ? str / floor.ms : 0;
    c["floor_ratio_best"] = floor.ms > 0 ? *std::min_element(ms.begin(), ms.end()) / floor.ms : 0;
    c["floor_target"] = kFloorTarget;
    c["floor_met"] = floor.ms > 0 && str / floor.ms <= kFloorTarget ? 1 : 0;
    c["floor_fwd_compute_ms"] = floor.fwd_compute_ms;
    c["floor_fwd_h2d_ms"] = floor.fwd_h2d_ms;
    c["floor_bwd_compute_ms"] = floor.bwd_compute_ms;
    c["floor_bwd_link_ms"] = floor.bwd_link_ms;
    c["resident_fwd_ms"] = median(res_fwd);
    c["resident_bwd_ms"] = median(res_bwd);
    c["duplex_h2d_GBps"] = link_rates().duplex_h2d_gbps;
    c["duplex_d2h_GBps"] = link_rates().duplex_d2h_gbps;
    c["edge_start_ms"] = median(start);
    c["edge_turn_ms"] = median(turn);
    c["edge_end_ms"] = median(end);
    c["streamed_ms"] = str;
    c["streamed_ms_best"] = *std::min_element(ms.begin(), ms.end());
    c["resident_ms"] = res;
    c["h2d_bytes"] = h2d_b;
    c["d2h_bytes"] = d2h_b;
    c["h2d_peak_GBps"] = pk.h2d_gbps;
    c["d2h_peak_GBps"] = pk.d2h_gbps;
    c["h2d_ms_at_peak"] = bound.terms_ms[1];
    c["d2h_ms_at_peak"] = bound.terms_ms[2];
    c["bound_ms"] = bound.ms;
    c["bound_by"] = static_cast<double>(bound.index);  // compute, H2D, D2H
    c["ratio"] = ratio;
    c["ratio_best"] = bound.ms > 0 ? c["streamed_ms_best"].value / bound.ms : 0;
    c["target"] = m.target;
    c["met"] = ratio <= m.target ? 1 : 0;
    c["streamed_over_resident"] = res > 0 ? str / res : 0;
    if (m.resident_target > 0) {
      c["resident_target"] = m.resident_target;
      c["resident_met"] = res > 0 && str / res <= m.resident_target ? 1 : 0;
    }
    c["achieved_h2d_GBps"] = testkit::gbps(h2d_b, str);
    c["hits"] = static_cast<double>(hits) / n_it;
    c["matches_resident"] = same.same ? 1 : 0;
    c["weight_bytes"] = static_cast<double>(W.pool_bytes());
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
        std::string name = m.chain.name + (step ? "/step" : "/fwd");
        auto* b = benchmark::RegisterBenchmark(
            name.c_str(), [&m, step](benchmark::State& st) { bm_workload(st, m, step); });
        for (uint64_t d : g_depths) b->Args({rows, static_cast<int64_t>(d)});
        timed_ms(b->ArgNames({m.rows_name, "depth"}), g_iterations);
      }
}

}  // namespace

const MainSpec kMain = {
    "bench_workloads",
    "streamed against resident, forward and training step, on the reference workloads",
    register_benchmarks, cleanup,
    {{"--depth", "ring depths, comma-separated (default 2)",
      [](const std::string& v) { g_depths = parse_uint_list("--depth", v, 1, 64); }},
     int_flag("--iterations", "timed iterations of each kind (default 5)", g_iterations, 1, 1000),
     int_flag("--warmup", "untimed iterations of each kind first (default 1)", g_warmup, 0,
              1000)}};

}  // namespace lwob
