// bench_capture: a streamed forward pass captured once as a CUDA graph and
// replayed (lwo_ring_capture_begin / _end, lwo_graph_launch), against the
// same pass eager and the resident chain eager and captured, all in one run.
//
// Workload: 512 x Linear(256x256) bf16, no bias, T = 16 tokens (the
// overhead-bound workload of bench_workloads), the layers grouped into
// records of --per-record consecutive layers (default 32: 16 records of
// 4 MiB), streamed from a pinned pool through rings of --depth slots
// (default 2). Four variants of one forward pass, each on one stream:
//   streamed           eager: a schedule over the records (lwo_schedule_next,
//                      then the record's lwo_linear_forward calls), reset first
//   replayed           the same calls on a second ring of the pool and its
//                      schedule, captured once (lwo_ring_capture_begin / _end);
//                      a pass is one lwo_graph_launch
//   resident           eager: the same lwo_linear_forward calls on device
//                      copies of the records
//   resident_captured  those calls captured with cudaStreamBeginCapture
//                      (relaxed); a pass is one cudaGraphLaunch
// Each iteration runs the four in turn, the GPU drained after each pass.
//
// Counters (times are medians over the iterations):
//   host_us_per_layer_<variant>  host time of the pass's enqueue over the
//        layers: for replayed the one lwo_graph_launch, for resident_captured
//        the one cudaGraphLaunch
//   <variant>_ms        device time of a pass: CUDA events on the stream
//                       before and after it
//   copy_GBps           pinned H2D rate of the pool's records, each copied in
//                       turn back-to-back on one stream (testkit::time_h2d_copies),
//                       best of 5 after one warm-up round, measured in this run
//   pass_bytes, copy_ms the bytes a pass streams, and their time at copy_GBps
//   floor_ms            max(resident_captured_ms, copy_ms)
//   ratio               replayed_ms / floor_ms; target 1.10 (met: 1 or 0)
//   host_target_us      0.3 (host_met: host_us_per_layer_replayed at most that)
//   capture_ms          host time of the capture and instantiation (once)
//   matches_resident    1: the output of every variant equals the resident
//                       chain's bit for bit (random weights and input; checked
//                       before and after the timed iterations); a mismatch
//                       stops the benchmark with an error instead
// Runs in a few seconds on an H200.
//
// The training step (capture/linear256x512/step/T:16): the same chain
// trainable, a forward and a backward whose weight gradients go to host
// memory through a gradient set (--grads: native, the library's default,
// bf16 on the wire and in host memory, as lwo.torch streams them; f32,
// LWO_GRADS_F32, twice the bytes down; both by default, the third argument
// f32_grads 0 or 1), in four variants of one step:
//   streamed           eager: lwo_grads_zero, a schedule over the forward and
//                      backward order (testkit::ChainRun::enqueue_streamed_step),
//                      lwo_grads_wait
//   replayed           the same calls on a second ring, schedule and gradient
//                      set, captured once; a step is lwo_grads_zero,
//                      lwo_graph_launch, lwo_grads_wait
//   resident           eager: the same compute calls on device copies of the
//                      records, gradients into device buffers
//   resident_captured  those calls captured; a step is one cudaGraphLaunch
// Counters as above, per step: host_us_per_layer_<variant> over the 1,024
// layer calls of a step (the enqueue: for replayed, the zero and the launch);
// <variant>_ms the wall time from the enqueue's start to the step's end (the
// gradients landed and the stream drained); step_bytes the bytes a streamed
// step copies to the device (ring statistics of one eager step), copy_ms their
// time at copy_GBps, grad_bytes the gradient bytes it sends to the host
// (they share the link with the backward's copies up: where the two at once
// take as long as the backward's compute, the step cannot reach its floor);
// floor_ms max(resident_captured_ms, copy_ms), ratio replayed_ms / floor_ms
// against the same targets (met, host_met), record_bytes and copy_GBps_median;
// matches_resident 1 when the streamed and replayed steps' output, input
// gradient and host gradients of the first and last records equal the
// resident step's bit for bit and the captured resident step's output and
// input gradient equal the eager one's (checked before and after the timed
// steps; a mismatch stops the benchmark).
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

#include "bench/common.h"
#include "testkit/workload.h"

namespace lwob {
namespace {

// `body`'s work on `st` captured (relaxed mode) and instantiated into `exec`;
// a failure ends the capture before it propagates.
template <typename Body>
void capture_on(cudaStream_t st, testkit::GraphExec& exec, Body body) {
  check(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed), "cudaStreamBeginCapture");
  cudaGraph_t g = nullptr;
  try {
    body();
  } catch (...) {
    cudaStreamEndCapture(st, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  check(cudaStreamEndCapture(st, &g), "cudaStreamEndCapture");
  const cudaError_t e = cudaGraphInstantiate(exec.out(), g, 0);
  cudaGraphDestroy(g);
  check(e, "cudaGraphInstantiate");
}

constexpr int64_t kDim = 256;
constexpr uint32_t kLayers = 512;
constexpr int64_t kTokens = 16;
constexpr double kTarget = 1.10;       // replayed / floor
constexpr double kHostTargetUs = 0.3;  // host time per layer of a replay

// The chain both benchmarks stream: the ring's depth and the layers per
// record from the benchmark's arguments, the weights resident for the
// reference passes, and the stream of the passes.
struct Chain {
  uint32_t depth, per_record;
  testkit::ChainSpec spec;
  testkit::ChainWeights W;
  uint32_t R;
  Stream stream;
  Ring eager_ring, graph_ring;  // two rings of `depth` over the pool

  explicit Chain(const benchmark::State& state)
      : depth(static_cast<uint32_t>(state.range(0))),
        per_record(static_cast<uint32_t>(state.range(1))),
        spec(testkit::linear_chain("linear256x512", kDim, kLayers, per_record)),
        W(engine(), spec),
        R((W.make_resident(), W.n_records())),
        stream(make_stream()) {
    if (depth >= R)
      fail(strf("depth %u holds all %u records: every eager stage after the first pass would be "
                "a hit", depth, R));
    lwo_ring_config rc = LWO_RING_CONFIG_INIT;
    rc.depth = depth;
    check(lwo_ring_create(W.pool(), &rc, eager_ring.out()), "lwo_ring_create");
    check(lwo_ring_create(W.pool(), &rc, graph_ring.out()), "lwo_ring_create");
  }

  // `body` captured into `graph` on the graph ring (lwo_ring_capture_begin to
  // _end on the chain's stream); if it throws, `schedule` lets go of its
  // tickets and the capture is ended and its graph discarded before the
  // exception goes on. Returns the host time of the capture, in ms.
  template <typename Body>
  double capture(testkit::Graph& graph, lwo_schedule* schedule, Body body) {
    const cudaStream_t st = stream.get();
    const double c0 = now_seconds();
    check(lwo_ring_capture_begin(graph_ring.get(), st), "lwo_ring_capture_begin");
    try {
      body();
    } catch (...) {
      lwo_schedule_reset(schedule, st);
      lwo_graph* discarded = nullptr;
      lwo_ring_capture_end(graph_ring.get(), st, &discarded);
      lwo_graph_destroy(discarded);
      throw;
    }
    check(lwo_ring_capture_end(graph_ring.get(), st, graph.out()), "lwo_ring_capture_end");
    return (now_seconds() - c0) * 1e3;
  }
};

std::vector<uint64_t> g_per_record{32};
std::vector<uint64_t> g_depths{2};
std::vector<int64_t> g_f32_grads{0, 1};  // the step's gradients: native, f32
int g_iterations = 20;
int g_warmup = 3;

enum Variant { kStreamed, kReplayed, kResident, kResidentCaptured, kVariants };
const char* const kNames[kVariants] = {"streamed", "replayed", "resident", "resident_captured"};

// The counters both benchmarks report: each variant's median time and host
// cost per layer, the copy rate of the chain's records measured now, the
// floor (max(resident_captured, `bytes`, named `bytes_name`, at that rate)),
// the ratio against the targets, and the chain's shape.
void report(benchmark::State& state, Chain& chain, const char* bytes_name, uint64_t bytes,
            const std::vector<double> (&dev_ms)[kVariants],
            const std::vector<double> (&host_us)[kVariants], double capture_ms) {
  const std::vector<testkit::HostRange> hosts = chain.W.record_hosts();
  uint64_t largest = 0;
  for (const testkit::HostRange& h : hosts) largest = std::max(largest, h.bytes);
  const testkit::CopyResult copies = testkit::time_h2d_copies(hosts, largest, {1, 5});
  const double copy_gbps = copies.best_gbps();
  const double copy_ms = copy_gbps > 0 ? static_cast<double>(bytes) / (copy_gbps * 1e6) : 0;
  auto& c = state.counters;
  double ms[kVariants];
  for (int v = 0; v < kVariants; ++v) {
    ms[v] = median(dev_ms[v]);
    c[strf("host_us_per_layer_%s", kNames[v])] = median(host_us[v]);
    c[strf("%s_ms", kNames[v])] = ms[v];
  }
  const double floor_ms = std::max(ms[kResidentCaptured], copy_ms);
  const double ratio = floor_ms > 0 ? ms[kReplayed] / floor_ms : 0;
  c["copy_GBps"] = copy_gbps;
  c["copy_GBps_median"] = copies.median_gbps();
  c[bytes_name] = static_cast<double>(bytes);
  c["record_bytes"] = static_cast<double>(largest);
  c["copy_ms"] = copy_ms;
  c["floor_ms"] = floor_ms;
  c["ratio"] = ratio;
  c["target"] = kTarget;
  c["met"] = ratio > 0 && ratio <= kTarget ? 1 : 0;
  c["host_target_us"] = kHostTargetUs;
  c["host_met"] = median(host_us[kReplayed]) <= kHostTargetUs ? 1 : 0;
  c["replayed_over_streamed"] = ms[kStreamed] > 0 ? ms[kReplayed] / ms[kStreamed] : 0;
  c["capture_ms"] = capture_ms;
  c["matches_resident"] = 1;  // else the checks stopped the benchmark
  c["layers"] = kLayers;
  c["records"] = chain.R;
  c["per_record"] = chain.per_record;
  c["depth"] = chain.depth;
  c["rows"] = kTokens;
}

// One pass over the records by `schedule` (over 0..R-1 on its ring): reset,
// then each lwo_schedule_next and the record's forward, to LWO_END. The same
// calls eager and under capture.
void streamed_pass(testkit::ChainRun& run, lwo_schedule* schedule) {
  check(lwo_schedule_reset(schedule, run.stream()), "lwo_schedule_reset");
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  lwo_status_t st;
  while ((st = lwo_schedule_next(schedule, run.stream(), &v)) == LWO_OK)
    run.forward(v.layer, v.tensors);
  if (st != LWO_END) check(st, "lwo_schedule_next");
}

void forward_pass(benchmark::State& state, Chain& chain) {
  const uint32_t R = chain.R;
  const testkit::ChainSpec& spec = chain.spec;
  testkit::ChainWeights& W = chain.W;
  const cudaStream_t st = chain.stream.get();
  testkit::ChainRun run(W, kTokens, st, /*trainable=*/false);
  std::vector<std::vector<const void*>> resident(R);
  for (uint32_t r = 0; r < R; ++r) resident[r] = run.resident_tensors(r);
  const std::vector<uint32_t> order = testkit::step_order(R, /*backward=*/false);
  Schedule eager_schedule, graph_schedule;
  check(lwo_schedule_create(chain.eager_ring.get(), order.data(), R, eager_schedule.out()),
        "lwo_schedule_create");
  check(lwo_schedule_create(chain.graph_ring.get(), order.data(), R, graph_schedule.out()),
        "lwo_schedule_create");

  // The passes, eager (the capture's calls too).
  auto resident_pass = [&] {
    for (uint32_t r = 0; r < R; ++r) run.forward(r, resident[r].data());
  };
  auto drain = [&] { check(cudaStreamSynchronize(st), "cudaStreamSynchronize"); };
  // Eager first (the compute's plans and workspace are made outside the
  // captures), then the two captures.
  for (int k = 0; k < std::max(1, g_warmup); ++k) {
    streamed_pass(run, eager_schedule.get());
    resident_pass();
    drain();
  }
  testkit::Graph graph;
  const double capture_ms =
      chain.capture(graph, graph_schedule.get(), [&] { streamed_pass(run, graph_schedule.get()); });
  testkit::GraphExec resident_graph;
  capture_on(st, resident_graph, [&] { resident_pass(); });

  // One pass of variant v, its host enqueue time into *host_s.
  auto pass = [&](int v, double* host_s) {
    const double t0 = now_seconds();
    switch (v) {
      case kStreamed: streamed_pass(run, eager_schedule.get()); break;
      case kReplayed: check(lwo_graph_launch(graph.get(), st), "lwo_graph_launch"); break;
      case kResident: resident_pass(); break;
      default: check(cudaGraphLaunch(resident_graph.get(), st), "cudaGraphLaunch"); break;
    }
    *host_s = now_seconds() - t0;
  };

  // The check: every variant's output equals the resident chain's bit for
  // bit, each pass run on activations poisoned first.
  const uint32_t N = spec.n_ops();
  auto poison = [&] {
    for (uint32_t i = 1; i <= N; ++i)
      check(cudaMemsetAsync(run.x(i), 0xff, run.act_bytes(spec.ops[i - 1].second), st),
            "cudaMemsetAsync");
  };
  auto output = [&] {
    drain();
    return testkit::copy_back(run.x(N), run.output_bytes());
  };
  auto check_outputs = [&](const char* when) {
    double unused = 0;
    poison();
    pass(kResident, &unused);
    const std::vector<uint8_t> want = output();
    for (int v : {kStreamed, kReplayed, kResidentCaptured}) {
      poison();
      pass(v, &unused);
      const std::vector<uint8_t> got = output();
      const std::string diff =
          testkit::compare_bits(strf("%s: the %s pass's output", when, kNames[v]), got.data(),
                                want.data(), run.output_bytes() / lwo_dtype_size(spec.dtype),
                                spec.dtype, kDim);
      if (!diff.empty()) fail(diff);
    }
  };
  check_outputs("before the timed passes");

  Event ev0 = make_event(), ev1 = make_event();
  std::vector<double> host_us[kVariants], dev_ms[kVariants];
  for (int k = 0; k < g_warmup; ++k)
    for (int v = 0; v < kVariants; ++v) {
      double unused = 0;
      pass(v, &unused);
      drain();
    }
  for (auto _ : state) {
    for (int v = 0; v < kVariants; ++v) {
      double host_s = 0;
      check(cudaEventRecord(ev0.get(), st), "cudaEventRecord");
      pass(v, &host_s);
      check(cudaEventRecord(ev1.get(), st), "cudaEventRecord");
      drain();
      host_us[v].push_back(host_s * 1e6 / kLayers);
      dev_ms[v].push_back(elapsed_ms(ev0, ev1));
    }
    state.SetIterationTime(dev_ms[kReplayed].back() / 1e3);
  }
  check(lwo_engine_check(engine()), "lwo_engine_check");
  check_outputs("after the timed passes");

  // The bytes a pass streams: every record's, once.
  uint64_t pass_bytes = 0;
  for (const testkit::HostRange& h : W.record_hosts()) pass_bytes += h.bytes;
  report(state, chain, "pass_bytes", pass_bytes, dev_ms, host_us, capture_ms);
}

void training_step(benchmark::State& state, Chain& chain) {
  const uint32_t R = chain.R;
  const testkit::ChainSpec& spec = chain.spec;
  testkit::ChainWeights& W = chain.W;
  const cudaStream_t st = chain.stream.get();
  const bool f32_grads = state.range(2) != 0;
  testkit::ChainRun run(W, kTokens, st, /*trainable=*/true,
                        f32_grads ? LWO_DTYPE_F32 : spec.dtype);
  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.flags = f32_grads ? LWO_GRADS_F32 : 0;
  Grads eager_grads, graph_grads;
  check(lwo_grads_create(W.pool(), nullptr, &gc, eager_grads.out()), "lwo_grads_create");
  check(lwo_grads_create(W.pool(), nullptr, &gc, graph_grads.out()), "lwo_grads_create");
  const std::vector<uint32_t> order = testkit::step_order(R, /*backward=*/true);
  const uint32_t n_order = static_cast<uint32_t>(order.size());
  Schedule eager_schedule, graph_schedule;
  check(lwo_schedule_create(chain.eager_ring.get(), order.data(), n_order, eager_schedule.out()),
        "lwo_schedule_create");
  check(lwo_schedule_create(chain.graph_ring.get(), order.data(), n_order, graph_schedule.out()),
        "lwo_schedule_create");
  auto drain = [&] { check(cudaStreamSynchronize(st), "cudaStreamSynchronize"); };
  auto streamed_step = [&](lwo_schedule* schedule, lwo_grads* grads) {
    check(lwo_grads_zero(grads), "lwo_grads_zero");
    run.enqueue_streamed_step(schedule, grads);
  };
  // Eager first (the compute's plans, workspaces and gradient buffers are
  // made outside the captures); the bytes of one eager step.
  lwo_ring_stats r0{};
  r0.size = sizeof r0;
  lwo_grads_stats g0{};
  g0.size = sizeof g0;
  for (int k = 0; k < std::max(1, g_warmup); ++k) {
    check(lwo_ring_get_stats(chain.eager_ring.get(), &r0), "lwo_ring_get_stats");
    check(lwo_grads_get_stats(eager_grads.get(), &g0), "lwo_grads_get_stats");
    streamed_step(eager_schedule.get(), eager_grads.get());
    check(lwo_grads_wait(eager_grads.get()), "lwo_grads_wait");
    run.enqueue_resident_step();
    drain();
  }
  lwo_ring_stats r1{};
  r1.size = sizeof r1;
  lwo_grads_stats g1{};
  g1.size = sizeof g1;
  check(lwo_ring_get_stats(chain.eager_ring.get(), &r1), "lwo_ring_get_stats");
  check(lwo_grads_get_stats(eager_grads.get(), &g1), "lwo_grads_get_stats");
  const uint64_t step_bytes = r1.bytes_copied - r0.bytes_copied;
  const uint64_t grad_bytes = g1.bytes - g0.bytes;

  check(lwo_grads_zero(graph_grads.get()), "lwo_grads_zero");
  testkit::Graph graph;
  const double capture_ms = chain.capture(graph, graph_schedule.get(), [&] {
    run.enqueue_streamed_step(graph_schedule.get(), graph_grads.get());
  });
  testkit::GraphExec resident_graph;
  capture_on(st, resident_graph, [&] { run.enqueue_resident_step(); });

  // One step of variant v: its host enqueue time into *host_s; returns
  // when the step is over (gradients landed, stream drained).
  auto step = [&](int v, double* host_s) {
    const double t0 = now_seconds();
    switch (v) {
      case kStreamed: streamed_step(eager_schedule.get(), eager_grads.get()); break;
      case kReplayed:
        check(lwo_grads_zero(graph_grads.get()), "lwo_grads_zero");
        check(lwo_graph_launch(graph.get(), st), "lwo_graph_launch");
        break;
      case kResident: run.enqueue_resident_step(); break;
      default: check(cudaGraphLaunch(resident_graph.get(), st), "cudaGraphLaunch"); break;
    }
    *host_s = now_seconds() - t0;
    if (v == kStreamed) check(lwo_grads_wait(eager_grads.get()), "lwo_grads_wait");
    if (v == kReplayed) check(lwo_grads_wait(graph_grads.get()), "lwo_grads_wait");
    drain();
  };

  // The check, each step on activations and input gradients poisoned first.
  const uint32_t N = spec.n_ops();
  auto poison = [&] {
    for (uint32_t i = 1; i <= N; ++i)
      check(cudaMemsetAsync(run.x(i), 0xff, run.act_bytes(spec.ops[i - 1].second), st),
            "cudaMemsetAsync");
    check(cudaMemsetAsync(run.dx_out(0), 0xff, run.input_bytes(), st), "cudaMemsetAsync");
  };
  auto outputs = [&] {
    drain();
    std::vector<uint8_t> y = testkit::copy_back(run.x(N), run.output_bytes());
    const std::vector<uint8_t> dx = testkit::copy_back(run.dx_out(0), run.input_bytes());
    y.insert(y.end(), dx.begin(), dx.end());
    return y;
  };
  auto check_steps = [&](const char* when) {
    double unused = 0;
    for (int v : {kStreamed, kReplayed}) {
      poison();
      step(v, &unused);
      const testkit::ChainCheck c =
          run.compare_with_resident(v == kStreamed ? eager_grads.get() : graph_grads.get(), true);
      if (!c.same) fail(strf("%s: the %s step: %s", when, kNames[v], c.first.c_str()));
    }
    poison();
    step(kResident, &unused);
    const std::vector<uint8_t> want = outputs();
    poison();
    step(kResidentCaptured, &unused);
    const std::vector<uint8_t> got = outputs();
    const uint64_t es = lwo_dtype_size(spec.dtype);
    const std::string diff = testkit::compare_bits(
        strf("%s: the resident_captured step's output and input gradient", when), got.data(),
        want.data(), got.size() / es, spec.dtype, kDim);
    if (!diff.empty()) fail(diff);
  };
  check_steps("before the timed steps");

  std::vector<double> host_us[kVariants], step_ms[kVariants];
  for (int k = 0; k < g_warmup; ++k)
    for (int v = 0; v < kVariants; ++v) {
      double unused = 0;
      step(v, &unused);
    }
  for (auto _ : state) {
    for (int v = 0; v < kVariants; ++v) {
      double host_s = 0;
      const double t0 = now_seconds();
      step(v, &host_s);
      step_ms[v].push_back((now_seconds() - t0) * 1e3);
      host_us[v].push_back(host_s * 1e6 / (2.0 * kLayers));
    }
    state.SetIterationTime(step_ms[kReplayed].back() / 1e3);
  }
  check(lwo_engine_check(engine()), "lwo_engine_check");
  check_steps("after the timed steps");

  report(state, chain, "step_bytes", step_bytes, step_ms, host_us, capture_ms);
  state.counters["grad_bytes"] = static_cast<double>(grad_bytes);
  state.counters["f32_grads"] = f32_grads ? 1 : 0;
}

// A benchmark of `Body` over the chain its arguments describe.
template <void (*Body)(benchmark::State&, Chain&)>
void on_chain(benchmark::State& state) {
  run_guarded(state, [&] {
    Chain chain(state);
    Body(state, chain);
  });
}

void register_benchmarks() {
  auto* b = benchmark::RegisterBenchmark("capture/linear256x512/fwd/T:16", on_chain<forward_pass>);
  for (uint64_t d : g_depths)
    for (uint64_t p : g_per_record) b->Args({static_cast<int64_t>(d), static_cast<int64_t>(p)});
  timed_ms(b->ArgNames({"depth", "per_record"}), g_iterations);
  auto* t = benchmark::RegisterBenchmark("capture/linear256x512/step/T:16",
                                         on_chain<training_step>);
  for (int64_t f : g_f32_grads)
    for (uint64_t d : g_depths)
      for (uint64_t p : g_per_record) t->Args({static_cast<int64_t>(d), static_cast<int64_t>(p), f});
  timed_ms(t->ArgNames({"depth", "per_record", "f32_grads"}), g_iterations);
}

}  // namespace

const MainSpec kMain = {
    "bench_capture",
    "a streamed forward and training step (512 x Linear(256), T=16) captured and replayed, "
    "against eager and resident",
    register_benchmarks,
    {},
    {{"--per-record", "layers per record, comma-separated divisors of 512 (default 32)",
      [](const std::string& v) {
        g_per_record = parse_uint_list("--per-record", v, 1, kLayers);
        for (uint64_t p : g_per_record)
          if (kLayers % p)
            throw std::invalid_argument(strf("--per-record: %llu does not divide %u",
                                             static_cast<unsigned long long>(p), kLayers));
      }},
     {"--grads", "the training step's gradients: native (bf16, the library's default), f32, "
      "or both comma-separated (default native,f32)",
      [](const std::string& v) {
        g_f32_grads.clear();
        for (const std::string& w : split_list(v)) {
          if (w != "native" && w != "f32")
            throw std::invalid_argument(strf("--grads: '%s' is neither native nor f32",
                                             w.c_str()));
          g_f32_grads.push_back(w == "f32" ? 1 : 0);
        }
      }},
     {"--depth", "ring depths, comma-separated (default 2)",
      [](const std::string& v) { g_depths = parse_uint_list("--depth", v, 1, 64); }},
     int_flag("--iterations", "timed iterations (default 20)", g_iterations, 1, 10000),
     int_flag("--warmup", "untimed passes of each variant first (default 3)", g_warmup, 0, 1000)},
    /*needs_engine=*/true,
    /*needs_peaks=*/false};

}  // namespace lwob
