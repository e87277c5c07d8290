// bench_plan: the planner's prediction against the measurement
// ("predicted against measured"), on five workloads, each in one run:
//
//   1. the model's records in a pinned pool (random bf16 weights, testkit's
//      training-step chain), and a copy of them in device memory;
//   2. each record's compute measured resident on the GPU: its forward (and in
//      a step its backward, weight gradients into device scratch), CUDA events
//      between every two records, the median of --compute_repeats passes
//      after a warm-up pass (ChainRun::resident_record_times);
//   3. a plan (lwo_plan_create with LWO_PLAN_CALIBRATE_LINK, the link measured
//      now; LWO_PLAN_TRAIN for the step) for a budget of --budget percent of
//      the model's bytes (default 50, as `lwo run --budget 50%`), less the
//      compute workspaces the engine already holds, which the plan does not
//      count (as the lwo program does); the engine is then held to the budget;
//   4. the ring lwo_plan_ring_config gives (its depth, its resident records),
//      a schedule over the plan's order ([0..R-1], then [R-1..0] in a step),
//      and the planned passes through it with real compute (lwo_linear_forward,
//      lwo_linear_backward; in a step every record's weight gradients go to
//      host memory through lwo_grads, in the layer dtype, over as many
//      staging slots as the plan assumed); --warmup passes (at least one:
//      the plan predicts the steady state, the pass after another whose last
//      records may still be in their slots), then --iterations timed ones;
//   5. --stall_passes more passes with an event before and after each
//      position's compute, for the measured stall per position; then the last
//      pass's output (and in a step its input gradient and the host gradients
//      of the first and last record) compared bit for bit with the resident
//      computation.
//
// Times are host wall-clock from the pass's first call to the return of its
// final synchronisation (and lwo_grads_wait), the GPU idle before, as in
// bench_workloads; medians over the timed passes.
//
// Workloads (bf16, no bias, x_{i+1} = y_i, T tokens):
//   uniform8192x32/fwd/T:1024        32 x Linear(8192x8192), forward
//   m144/fwd/T:1024                  the 144-linear model (testkit::m144_chain),
//                                    one record per block of 6 linears, forward
//   uneven32/fwd/T:1024              32 linears of widths cycling over 1024, 4096,
//                                    8192, 8192, 2048, 1024, 1024, 8192: records
//                                    of 2 MiB to 128 MiB (64x), forward
//   uniform8192x32/fwd/T:16384       compute-bound: the uniform model at T = 16384
//   uniform8192x32/step/T:1024       a training step of the uniform model, every
//                                    layer trainable
//
// Counters (per benchmark):
//   predicted_ms       lwo_plan_info.predicted_ms: the planned pass, predicted
//   measured_ms        the median timed pass (measured_ms_best: the fastest)
//   error              measured_ms / predicted_ms - 1
//   target, met        0.05; met = 1 when |error| <= target
//   n_resident, depth  the plan's resident records and ring depth (the ring's
//                      own, read back from lwo_ring_get_info)
//   records            the pool's records; budget_bytes, plan_device_bytes
//                      (lwo_plan_info.device_bytes), weight_bytes (the model)
//   h2d_bytes_predicted, h2d_bytes_measured   per pass (lwo_plan_info.h2d_bytes;
//                      lwo_ring_get_stats over one timed pass), h2d_bytes_error
//                      their ratio - 1; d2h_bytes_predicted / measured likewise
//                      (lwo_grads_get_stats) in a step
//   stall_predicted_ms, stall_measured_ms   compute waiting for weights (and
//                      gradient slots), summed over the pass; stall_max_diff_ms the
//                      largest |predicted - measured| of one position, at
//                      stall_max_diff_position
//   compute_ms         the per-record compute given to the plan, summed
//   copy_overhead_ms   the per-copy overhead the plan used (--copy_overhead_ms)
//   first_k_ms         the plan's "first k layers resident" rule, predicted
//   h2d_GBps, d2h_GBps, duplex_h2d_GBps, duplex_d2h_GBps   the link the plan
//                      measured (lwo_plan_info)
//   matches_resident   1 when the last planned pass equals the resident one
//
// --table prints a summary of the five (one line each) on stdout after the
// run; --per_layer also each position's predicted and measured stall.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "bench/common.h"
#include "testkit/plan.h"
#include "testkit/workload.h"

namespace lwob {
namespace {

int g_iterations = 5;
int g_warmup = 1;
int g_compute_repeats = 5;
int g_stall_passes = 3;
double g_budget_pct = 50;
double g_copy_overhead_ms = 0;  // lwo_plan_config.copy_overhead_ms (0: the default, none)
bool g_table = false;
bool g_per_layer = false;
constexpr double kTarget = 0.05;  // |measured / predicted - 1|

// --- the workloads ----------------------------------------------------------------

struct Workload {
  std::string label;  // for the table
  testkit::ChainSpec chain;
  int64_t rows = 1024;
  bool step = false;
};

testkit::ChainSpec uniform() { return testkit::linear_chain("uniform8192x32", 8192, 32, 1); }

// 32 linears whose widths cycle over 8 values, so that consecutive records
// differ and their bytes span 2 MiB (1024x1024) to 128 MiB (8192x8192).
testkit::ChainSpec uneven() {
  static const int64_t kCycle[] = {1024, 4096, 8192, 8192, 2048, 1024, 1024, 8192};
  constexpr size_t kN = sizeof kCycle / sizeof kCycle[0];
  testkit::ChainSpec c;
  c.name = "uneven32";
  for (size_t i = 0; i < 32; ++i) c.ops.push_back({kCycle[i % kN], kCycle[(i + 1) % kN]});
  c.group(1);
  return c;
}

// Run order: the models loaded once each (the uniform model serves three).
std::vector<Workload> workloads() {
  std::vector<Workload> v;
  v.push_back({"uniform 32 x 8192^2, forward, T=1024", uniform(), 1024, false});
  v.push_back({"compute-bound 32 x 8192^2, forward, T=16384", uniform(), 16384, false});
  v.push_back({"training step 32 x 8192^2, T=1024", uniform(), 1024, true});
  v.push_back({"144-linear model (block records), forward, T=1024", testkit::m144_chain(true),
               1024, false});
  v.push_back({"uneven 32 linears (2..128 MiB), forward, T=1024", uneven(), 1024, false});
  return v;
}

// --- the loaded model -------------------------------------------------------------

std::unique_ptr<testkit::ChainWeights> g_weights;

void cleanup_model() { g_weights.reset(); }

testkit::ChainWeights& load(const testkit::ChainSpec& spec) {
  if (g_weights && g_weights->spec().name == spec.name) return *g_weights;
  g_weights.reset();  // one model at a time
  g_weights = std::make_unique<testkit::ChainWeights>(engine(), spec);
  g_weights->make_resident();
  return *g_weights;
}

// The engine held to a budget for the planned passes, lifted again after
// (also when the benchmark stops with an error).
struct BudgetHold {
  bool held = false;
  void set(uint64_t bytes) {
    check(lwo_engine_set_budget(engine(), bytes, 0.0, 0), "lwo_engine_set_budget");
    held = true;
  }
  ~BudgetHold() {
    if (held && lwo_engine_set_budget(engine(), 0, 0.0, 0) != LWO_OK)
      std::fprintf(stderr, "bench_plan: lifting the engine's budget failed: %s\n",
                   lwo_last_error_message());
  }
};

// --- the results, for --table -------------------------------------------------------

struct Row {
  std::string name, label;
  double predicted_ms = 0, measured_ms = 0, error = 0;
  uint32_t n_resident = 0, depth = 0, records = 0;
  double h2d_pred = 0, h2d_meas = 0;
  double stall_pred = 0, stall_meas = 0;
  bool matches = false;
  std::vector<lwo_plan_position> positions;
  std::vector<double> stall_measured;  // per position
};
std::vector<Row> g_rows;

// --- the benchmark -----------------------------------------------------------------

std::string bench_name(const Workload& wl) {
  return wl.chain.name + (wl.step ? "/step" : "/fwd") + "/T:" + std::to_string(wl.rows);
}

void bm_plan(benchmark::State& state, const Workload& wl) {
  run_guarded(state, [&] {
    testkit::ChainWeights& W = load(wl.chain);
    const uint32_t R = W.n_records();
    const bool step = wl.step;
    Stream stream = make_stream();
    // Gradients in the chain's dtype on the wire and in host memory (the
    // library's default, and the plan's default gradient bytes).
    testkit::ChainRun run(W, wl.rows, stream.get(), /*trainable=*/step, wl.chain.dtype);

    // 1. Each record's compute, resident: a warm-up pass (algorithm choice,
    //    workspaces), then the timed ones.
    run.resident_pass(step);
    const testkit::ChainRun::RecordTimes times =
        run.resident_record_times(step, static_cast<uint32_t>(g_compute_repeats));
    check(lwo_engine_check(engine()), "lwo_engine_check (resident)");
    double compute_ms = 0;
    for (double t : times.fwd_ms) compute_ms += t;
    for (double t : times.bwd_ms) compute_ms += t;

    // 2. The gradients of a step, before the plan: their staging counts
    //    against the engine's budget, and the plan counts it in its own.
    Grads grads;
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
    if (step) check(lwo_grads_create(W.pool(), nullptr, &gc, grads.out()), "lwo_grads_create");

    // 3. The plan: the budget less the workspaces the engine holds (the plan
    //    counts slots, resident records and gradient staging).
    const uint64_t budget =
        static_cast<uint64_t>(static_cast<double>(W.pool_bytes()) * g_budget_pct / 100.0);
    lwo_engine_memory mem = LWO_ENGINE_MEMORY_INIT;
    check(lwo_engine_get_memory(engine(), &mem), "lwo_engine_get_memory");
    if (mem.workspaces >= budget)
      fail(strf("a budget of %s: the compute workspaces alone hold %s",
                fmt_bytes(budget).c_str(), fmt_bytes(mem.workspaces).c_str()));
    // Every layer trainable, in a step (testkit::make_plan).
    const testkit::PlanReport plan =
        testkit::make_plan(W.pool(), budget - mem.workspaces, times.fwd_ms,
                           step ? times.bwd_ms : std::vector<double>{}, nullptr, gc.depth,
                           /*group=*/false, g_copy_overhead_ms);
    const lwo_plan_info& info = plan.info;
    const std::vector<lwo_plan_position>& positions = plan.positions;
    const std::vector<uint32_t> order = testkit::step_order(R, step);
    if (info.n_positions != order.size())
      fail(strf("the plan has %u positions; the pass has %zu", info.n_positions, order.size()));
    for (uint32_t i = 0; i < info.n_positions; ++i)
      if (positions[i].layer != order[i])
        fail(strf("the plan's position %u is record %u; the pass's is %u", i, positions[i].layer,
                  order[i]));

    // 4. The plan's ring, the engine held to the budget.
    BudgetHold hold;
    hold.set(budget);
    const lwo_ring_config rc = testkit::plan_ring_config(plan, 0);
    Ring ring;
    check(lwo_ring_create(W.pool(), &rc, ring.out()), "lwo_ring_create (the plan's)");
    lwo_ring_info ri{};
    ri.size = sizeof ri;
    check(lwo_ring_get_info(ring.get(), &ri), "lwo_ring_get_info");
    if (ri.depth != info.depth || ri.n_resident != info.n_resident)
      fail(strf("the ring has depth %u and %u resident records; the plan %u and %u", ri.depth,
                ri.n_resident, info.depth, info.n_resident));
    Schedule schedule;
    check(lwo_schedule_create(ring.get(), order.data(), static_cast<uint32_t>(order.size()),
                              schedule.out()),
          "lwo_schedule_create");
    testkit::StepOptions options;
    options.backward = step;
    for (int k = 0; k < g_warmup; ++k)
      run.streamed_pass(schedule.get(), ring.get(), grads.get(), options);
    std::vector<double> ms;
    std::vector<uint64_t> h2d, d2h;
    for (auto _ : state) {
      const testkit::StepStats it = run.streamed_pass(schedule.get(), ring.get(), grads.get(),
                                                      options);
      state.SetIterationTime(it.ms / 1e3);
      ms.push_back(it.ms);
      h2d.push_back(it.h2d_bytes);
      d2h.push_back(it.d2h_bytes);
    }
    check(lwo_engine_check(engine()), "lwo_engine_check (planned)");

    // 5. The stalls, then the check of the last pass.
    std::vector<std::vector<double>> stall(order.size());
    testkit::StepOptions so = options;
    so.stalls = true;
    for (int k = 0; k < g_stall_passes; ++k) {
      const testkit::StepStats it = run.streamed_pass(schedule.get(), ring.get(), grads.get(), so);
      for (size_t i = 0; i < order.size() && i < it.stall_ms.size(); ++i)
        stall[i].push_back(it.stall_ms[i]);
    }
    check(lwo_engine_check(engine()), "lwo_engine_check (stalls)");
    const testkit::ChainCheck same = run.compare_with_resident(grads.get(), step);
    if (!same.same)
      std::fprintf(stderr, "bench_plan: %s: the planned pass differs from resident in:%s (%s)\n",
                   wl.chain.name.c_str(), same.differs.c_str(), same.first.c_str());
    schedule.reset();
    ring.reset();

    Row row;
    row.name = bench_name(wl);
    row.label = wl.label;
    row.predicted_ms = info.predicted_ms;
    row.measured_ms = median(ms);
    row.error = info.predicted_ms > 0 ? row.measured_ms / info.predicted_ms - 1 : 0;
    row.n_resident = ri.n_resident;
    row.depth = ri.depth;
    row.records = R;
    // Bytes per pass: every timed pass moves the same in the steady state;
    // the median of them.
    auto med_bytes = [](const std::vector<uint64_t>& v) {
      std::vector<double> d(v.begin(), v.end());
      return median(d);
    };
    row.h2d_pred = static_cast<double>(info.h2d_bytes);
    row.h2d_meas = med_bytes(h2d);
    row.stall_pred = info.predicted_stall_ms;
    double max_diff = 0;
    size_t max_at = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      const double m = stall[i].empty() ? 0 : median(stall[i]);
      row.stall_measured.push_back(m);
      row.stall_meas += m;
      const double d = std::fabs(m - positions[i].stall_ms);
      if (d > max_diff) {
        max_diff = d;
        max_at = i;
      }
    }
    row.matches = same.same;
    row.positions = positions;

    auto& c = state.counters;
    c["predicted_ms"] = row.predicted_ms;
    c["measured_ms"] = row.measured_ms;
    c["measured_ms_best"] = ms.empty() ? 0 : *std::min_element(ms.begin(), ms.end());
    c["error"] = row.error;
    c["target"] = kTarget;
    c["met"] = info.predicted_ms > 0 && std::fabs(row.error) <= kTarget ? 1 : 0;
    c["n_resident"] = row.n_resident;
    c["depth"] = row.depth;
    c["records"] = R;
    c["budget_bytes"] = static_cast<double>(budget);
    c["plan_budget_bytes"] = static_cast<double>(info.budget_bytes);
    c["plan_device_bytes"] = static_cast<double>(info.device_bytes);
    c["weight_bytes"] = static_cast<double>(W.pool_bytes());
    c["h2d_bytes_predicted"] = row.h2d_pred;
    c["h2d_bytes_measured"] = row.h2d_meas;
    c["h2d_bytes_error"] = row.h2d_pred > 0 ? row.h2d_meas / row.h2d_pred - 1 : 0;
    if (step) {
      c["d2h_bytes_predicted"] = static_cast<double>(info.d2h_bytes);
      c["d2h_bytes_measured"] = med_bytes(d2h);
    }
    c["stall_predicted_ms"] = row.stall_pred;
    if (g_stall_passes > 0) {  // else not measured
      c["stall_measured_ms"] = row.stall_meas;
      c["stall_max_diff_ms"] = max_diff;
      c["stall_max_diff_position"] = static_cast<double>(max_at);
    }
    c["compute_ms"] = compute_ms;
    c["copy_overhead_ms"] = info.copy_overhead_ms;
    c["first_k_ms"] = info.first_k_ms;
    c["h2d_GBps"] = info.h2d_gbps;
    c["d2h_GBps"] = info.d2h_gbps;
    c["duplex_h2d_GBps"] = info.duplex_h2d_gbps;
    c["duplex_d2h_GBps"] = info.duplex_d2h_gbps;
    c["matches_resident"] = same.same ? 1 : 0;
    c["rows"] = static_cast<double>(wl.rows);
    g_rows.push_back(std::move(row));
  });
}

void register_benchmarks() {
  static const std::vector<Workload> all = workloads();
  for (const Workload& wl : all)
    timed_ms(benchmark::RegisterBenchmark(bench_name(wl).c_str(),
                                          [&wl](benchmark::State& st) { bm_plan(st, wl); }),
             g_iterations);
}

void print_table() {
  if (!g_table || g_rows.empty()) return;
  std::printf("\nbench_plan: predicted against measured, budget %.0f%% of each model\n",
              g_budget_pct);
  std::printf("%-52s %4s %5s %5s %11s %11s %8s %4s %10s %10s %10s %10s %5s\n", "workload", "rec",
              "depth", "res", "predicted", "measured", "error", "met", "H2D pred", "H2D meas",
              "stall pr", "stall ms", "same");
  int met = 0;
  for (const Row& r : g_rows) {
    const bool ok = r.predicted_ms > 0 && std::fabs(r.error) <= kTarget;
    met += ok ? 1 : 0;
    std::printf("%-52s %4u %5u %5u %8.3f ms %8.3f ms %+7.2f%% %4s %10s %10s %7.3f ms %7.3f ms %5s\n",
                r.label.c_str(), r.records, r.depth, r.n_resident, r.predicted_ms, r.measured_ms,
                100 * r.error, ok ? "yes" : "NO",
                fmt_bytes(static_cast<uint64_t>(r.h2d_pred)).c_str(),
                fmt_bytes(static_cast<uint64_t>(r.h2d_meas)).c_str(), r.stall_pred, r.stall_meas,
                r.matches ? "yes" : "NO");
  }
  std::printf("%d of %zu within %.0f%% of the prediction\n", met, g_rows.size(), 100 * kTarget);
  if (!g_per_layer) return;
  for (const Row& r : g_rows) {
    std::printf("\n%s (%s): per position\n", r.label.c_str(), r.name.c_str());
    std::printf("%8s %6s %4s %9s %10s %10s %12s %12s\n", "position", "record", "half", "resident",
                "hit", "copy ms", "stall pred", "stall meas");
    for (size_t i = 0; i < r.positions.size(); ++i) {
      const lwo_plan_position& p = r.positions[i];
      std::printf("%8zu %6u %4s %9s %10s %10.3f %9.3f ms %9.3f ms\n", i, p.layer,
                  p.backward ? "bwd" : "fwd", p.resident ? "yes" : "", p.hit ? "yes" : "",
                  p.copy_ms, p.stall_ms, i < r.stall_measured.size() ? r.stall_measured[i] : 0.0);
    }
  }
}

void cleanup() {
  print_table();
  cleanup_model();
}

double parse_percent(const std::string& v) {
  std::string num = !v.empty() && v.back() == '%' ? v.substr(0, v.size() - 1) : v;
  char* end = nullptr;
  const double pct = std::strtod(num.c_str(), &end);
  if (num.empty() || *end || !(pct > 0 && pct <= 100))
    throw std::invalid_argument(
        strf("--budget: '%s' is not a share of the model in (0, 100] percent", v.c_str()));
  return pct;
}

bool parse_bool(const char* flag, const std::string& v) {
  if (v == "1" || v == "true" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "no") return false;
  throw std::invalid_argument(strf("%s: '%s' is not 0 or 1", flag, v.c_str()));
}

}  // namespace

const MainSpec kMain = {
    "bench_plan", "the planner's predicted pass against the measured one, on five workloads",
    register_benchmarks, cleanup,
    {{"--budget", "device memory budget, percent of each model's bytes (default 50)",
      [](const std::string& v) { g_budget_pct = parse_percent(v); }},
     {"--copy_overhead_ms",
      "the fixed cost of one host-to-device copy the plan assumes, ms (default 0: none, "
      "lwo_plan_config's default)",
      [](const std::string& v) {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        if (v.empty() || *end || !(x >= 0 && std::isfinite(x)))
          throw std::invalid_argument(
              strf("--copy_overhead_ms: '%s' is not a finite number >= 0", v.c_str()));
        g_copy_overhead_ms = x;
      }},
     int_flag("--iterations", "timed planned passes (default 5)", g_iterations, 1, 1000),
     int_flag("--warmup",
              "untimed planned passes first, at least 1: the plan is the steady state (default 1)",
              g_warmup, 1, 1000),
     int_flag("--compute_repeats", "resident passes timing each record's compute (default 5)",
              g_compute_repeats, 1, 1000),
     int_flag("--stall_passes",
              "passes with an event per position, for the measured stalls; 0: none (default 3)",
              g_stall_passes, 0, 1000),
     {"--table", "1: print a summary of the workloads on stdout after the run (default 0)",
      [](const std::string& v) { g_table = parse_bool("--table", v); }},
     {"--per_layer", "1: with --table, each position's predicted and measured stall too",
      [](const std::string& v) { g_per_layer = parse_bool("--per_layer", v); }}}};

}  // namespace lwob
