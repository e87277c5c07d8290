// lwo run: streams a synthetic model through a ring pass after pass, times each
// pass against the raw pinned-copy peak measured in the same run, and checks
// that every layer arrived byte for byte.
#include <algorithm>
#include <string>
#include <vector>

#include "testkit/checksum.h"
#include "testkit/random.h"
#include "testkit/workload.h"
#include "tools/cli.h"

namespace cli {
namespace {

constexpr double kTargetShare = 0.99;  // at depth >= 2

struct Options : ModelOptions {
  uint32_t depth = 2;
  uint32_t passes = 5;
  uint64_t seed = 1;
  bool timing = false;
  std::string json;
  lwo_quant_format_t quant = LWO_QUANT_NONE;  // --quant
  std::string budget;  // --budget (plan, then run the plan too)
};

struct Results : PassResults {
  uint64_t record_bytes = 0;
  double pool_s = 0, fill_s = 0, checksum_s = 0;  // host work
  // With --budget, the planned ring's passes in the same run.
  bool planned = false;
  PlanReport plan;
  double compute_ms = 0;  // the checksum consumer per layer, measured
  lwo_ring_info plan_ring{};
  TimedPasses plan_passes;
  lwo_ring_stats plan_stats{};
};

std::vector<Flag> make_flags(Options& o) {
  return model_flags(o, joined({{
      quant_flag(o.quant),
      uint_flag(kDepthFlag, o.depth),
      uint_flag(kPassesFlag, o.passes),
    }, pass_flags(o.seed, o.timing, o.device, o.json, o.budget), {
      // Spellings of lwo 0.1, which made lwo run front three programs.
      moved_flag("--train", "--train moved: training steps are the command lwo train",
                 "run 'lwo train --help' for its flags"),
      moved_flag("--frozen", "--frozen moved: lwo train --frozen trains with input gradients only",
                 "run 'lwo train --help' for its flags"),
      moved_flag("--weights", "--weights moved: stream a checkpoint with lwo stream {FILE}",
                 "run 'lwo stream --help' for its flags"),
  }}));
}

// Compares the device sums with `times` the host checksum of each layer
// (testkit::verify_sums); `what` names the passes summed.
void verify(const unsigned long long* sums, const std::vector<uint64_t>& expect, uint64_t times,
            const char* what) {
  const auto bad = check_sums(sums, expect, times, [what](const SumMismatch& m) {
    return strf("lwo: layer %u, %s: checksum 0x%016llx, expected 0x%016llx\n", m.layer, what,
                m.got, m.want);
  });
  if (!bad.empty())
    fail(
        strf("checksum mismatch in %zu of %zu layers (%s): the ring delivered bytes that "
             "differ from the host pool",
             bad.size(), expect.size(), what));
}

void print_results(const Device& dev, const Options& o, const Results& r) {
  std::printf("lwo run, %s\n", describe(dev).c_str());
  print_model(o, r.record_bytes, r.pass_bytes);
  if (o.quant != LWO_QUANT_NONE) {
    const uint64_t dense = static_cast<uint64_t>(o.rows) * static_cast<uint64_t>(o.cols) *
                           lwo_dtype_size(o.dtype);
    print_row("quant", "--quant %s (%s): %s dense per record, %s moved (%.2fx fewer bytes); %s "
              "moved per pass", quant_flag_name(o.quant), lwo_quant_format_name(o.quant),
              fmt_bytes(dense).c_str(), fmt_bytes(r.record_bytes).c_str(),
              static_cast<double>(dense) / static_cast<double>(r.record_bytes),
              fmt_bytes(r.pass_bytes).c_str());
  }
  print_row("host", "pinned pool %.2f s, %s %.2f s (seed %llu), host checksums %.2f s", r.pool_s,
            o.quant != LWO_QUANT_NONE ? "uniform values quantized on load" : "random fill",
            r.fill_s, static_cast<unsigned long long>(o.seed), r.checksum_s);
  print_row("peak", "%.2f GB/s pinned H2D (every record back-to-back on one stream, best of %d: "
            "%.2f ms)", r.peak_gbps, kPeakRepeats, r.peak_ms);
  r.print(o.passes, o.timing);
  if (o.depth >= 2)
    std::printf(" (target >= %.0f%% at depth >= 2: %s)", 100 * kTargetShare,
                r.share(r.median_ms) >= kTargetShare ? "met" : "NOT met");
  std::printf("\n%-10s %u layers x %u passes match the host\n", "checksums", o.layers,
              o.passes + 1);
  print_ring_stats(r.stats, o.timing);
  if (r.planned) {  // --budget
    std::printf("\n");
    print_plan(r.plan);
    const double t = r.plan_passes.median_ms, b = r.median_ms;
    print_row("planned", "depth %u, %u resident (%s): median %.3f ms, best %.3f ms per pass",
              r.plan_ring.depth, r.plan_ring.n_resident,
              fmt_bytes(r.plan_ring.resident_bytes).c_str(), t, r.plan_passes.best_ms);
    print_row("prediction", "predicted %.3f ms, measured %.3f ms (%+.1f%%); stall predicted %.3f "
              "ms, measured wait %.3f ms per pass", r.plan.info.predicted_ms, t,
              100 * (t / r.plan.info.predicted_ms - 1), r.plan.info.predicted_stall_ms,
              r.plan_stats.wait_ms / (o.passes + 1));
    const double moved = static_cast<double>(r.plan_stats.bytes_copied) /
                         std::max<double>(1, static_cast<double>(r.stats.bytes_copied));
    print_row("budgeted", "bytes moved %.1f%% of the unbudgeted run (target <= 53%%), time %.3fx "
              "(target <= 0.55x)", 100 * moved, b > 0 ? t / b : 0);
  }
}

Json to_json(const Device& dev, const Options& o, const Results& r) {
  Json j = json_doc("run", &dev);
  j["config"] = {{"layers", o.layers},  {"rows", o.rows},     {"cols", o.cols},
                 {"dtype", lwo_dtype_name(o.dtype)}, {"depth", o.depth}, {"passes", o.passes},
                 {"seed", o.seed},      {"timing", o.timing}, {"quant", quant_flag_name(o.quant)}};
  j["record_bytes"] = r.record_bytes;
  j["bytes_per_pass"] = r.pass_bytes;
  j["host_seconds"] = {{"pool_create", r.pool_s}, {"fill", r.fill_s}, {"checksum", r.checksum_s}};
  r.to_json(j, o.passes);
  const lwo_ring_stats& s = r.stats;
  j["ring"] = json_ring(r.ring, s, o.timing);
  if (r.planned) {  // --budget
    const lwo_ring_stats& ps = r.plan_stats;
    j["compute_ms_per_layer"] = r.compute_ms;
    j["plan"] = json_plan(r.plan);
    j["planned"] = {
        {"depth", r.plan_ring.depth}, {"n_resident", r.plan_ring.n_resident},
        {"resident_bytes", r.plan_ring.resident_bytes}, {"pass_ms", r.plan_passes.ms},
        {"median_ms", r.plan_passes.median_ms}, {"best_ms", r.plan_passes.best_ms},
        {"predicted_ms", r.plan.info.predicted_ms}, {"bytes_copied", ps.bytes_copied},
        {"wait_ms", ps.wait_ms}, {"resident_hits", ps.n_resident_hits},
        {"bytes_ratio", static_cast<double>(ps.bytes_copied) /
                            std::max<double>(1, static_cast<double>(s.bytes_copied))},
        {"time_ratio", r.median_ms > 0 ? r.plan_passes.median_ms / r.median_ms : 0}};
  }
  j["verified"] = true;
  return j;
}

}  // namespace

int cmd_run(int argc, char** argv) {
  Options o;
  if (!parse_flags(argc, argv, make_flags(o))) return 0;  // --help: printed
  lwo_tensor_desc tensor = o.weight();
  // --quant: the weight is stored quantized (its record holds the codes and
  // scales), filled with uniform values quantized on load.
  lwo_tensor_quant_ext qx = quant_ext(o.quant);
  if (o.quant != LWO_QUANT_NONE) {
    if (o.dtype != LWO_DTYPE_BF16 && o.dtype != LWO_DTYPE_F16 && o.dtype != LWO_DTYPE_F32)
      throw UsageError(strf("--quant %s quantizes bf16, f16 or f32 weights, not --dtype %s",
                            quant_flag_name(o.quant), lwo_dtype_name(o.dtype)));
    tensor.next = &qx;
  }
  const lwo_layer_desc layer{&tensor, 1, nullptr};
  Results r;
  r.record_bytes = record_bytes(layer);
  r.pass_bytes = model_bytes(r.record_bytes, o.layers);

  const Device dev(o.device);
  JsonFile json(o.json);
  progress("lwo run, %s: %u layers of %s (%s)", describe(dev).c_str(), o.layers,
           fmt_bytes(r.record_bytes).c_str(), fmt_bytes(r.pass_bytes).c_str());
  note_depth(o.depth, o.layers, "the first pass", "passes");

  // The host pool, filled with random bytes, and each record's checksum.
  Pool pool;
  {
    Phase phase("pool");
    std::vector<lwo_layer_desc> layers(o.layers, layer);
    TK_CHECK(lwo_pool_create_pinned(dev.engine.get(), layers.data(), o.layers, nullptr, pool.out()));
    r.pool_s = phase.seconds();
    phase.done("pinned, %s in %.2f s", fmt_bytes(r.pass_bytes).c_str(), r.pool_s);
  }
  std::vector<HostRange> records(o.layers);
  for (uint32_t l = 0; l < o.layers; ++l)
    TK_CHECK(lwo_pool_layer_host(pool.get(), l, &records[l].data, &records[l].bytes));
  if (o.quant != LWO_QUANT_NONE) {
    // Each layer's uniform values (within +-1, from its own key) in --dtype,
    // quantized into the pool on all cores.
    Phase phase("quantize", o.layers);
    const uint64_t n = static_cast<uint64_t>(o.rows) * static_cast<uint64_t>(o.cols);
    std::vector<uint8_t> src(n * lwo_dtype_size(o.dtype));
    for (uint32_t l = 0; l < o.layers; ++l) {
      fill_uniform({{src.data(), o.dtype, n, 1.0f, key_of(o.seed, l)}});
      TK_CHECK(lwo_pool_write_quantized(pool.get(), l, "weight", src.data(), o.dtype, src.size(),
                                        0));
      phase.set(l + 1);
    }
    r.fill_s = phase.seconds();
    phase.done("%u layers of %s values quantized as %s in %.2f s", o.layers,
               lwo_dtype_name(o.dtype), quant_flag_name(o.quant), r.fill_s);
  } else {
    Phase phase("fill", r.pass_bytes, true);
    fill_bytes(keyed_ranges(records, o.seed), 0, phase.counter());
    r.fill_s = phase.seconds();
    phase.done("%s of random bytes in %.2f s (%.1f GB/s, seed %llu)",
               fmt_bytes(r.pass_bytes).c_str(), r.fill_s,
               static_cast<double>(r.pass_bytes) / std::max(r.fill_s, 1e-9) / 1e9,
               static_cast<unsigned long long>(o.seed));
  }
  std::vector<uint64_t> expect;
  {
    Phase phase("checksums", r.pass_bytes, true);
    expect = checksums(records, phase.counter());
    r.checksum_s = phase.seconds();
    phase.done("%u layers on the host in %.2f s", o.layers, r.checksum_s);
  }
  {
    Phase phase("peak");
    const CopyResult peak = time_h2d_copies(records, r.record_bytes, kPeak);
    r.peak_gbps = peak.best_gbps();
    r.peak_ms = peak.best_ms();
    phase.done("%.2f GB/s pinned H2D, %s in %.2f ms", r.peak_gbps, fmt_bytes(r.pass_bytes).c_str(),
               r.peak_ms);
  }

  // The ring, the schedule and the consumer.
  Stream consumer = make_stream();
  DeviceMem sums_mem = device_alloc(2 * size_t(o.layers) * sizeof(unsigned long long));
  auto* sums = static_cast<unsigned long long*>(sums_mem.get());
  TK_CHECK(cudaMemsetAsync(sums, 0, 2 * size_t(o.layers) * sizeof(*sums), consumer.get()));
  lwo_ring_config config = LWO_RING_CONFIG_INIT;
  config.depth = o.depth;
  config.flags = (o.timing || !o.budget.empty()) ? LWO_RING_TIMING : 0u;  // --budget: both rings timed alike
  Ring ring;
  TK_CHECK(lwo_ring_create(pool.get(), &config, ring.out()));
  r.ring = ring_info(ring.get());
  const std::vector<uint32_t> order = step_order(o.layers, /*backward=*/false);
  Schedule schedule;
  TK_CHECK(lwo_schedule_create(ring.get(), order.data(), o.layers, schedule.out()));

  // Pass 0 warms up; with `shown`, each pass is reported as it ends. Row 0 of
  // the sums holds the first timed pass alone, row 1 all others.
  Phase phase("passes", o.passes + 1);
  const auto timed_passes = [&](lwo_schedule* sched, bool shown, const char* first) {
    return time_passes(
        o.passes, consumer.get(),
        [&](uint32_t p) { checksum_pass(sched, consumer.get(), p == 1 ? sums : sums + o.layers); },
        [&](uint32_t p, double ms) {
          if (shown) phase.set(p + 1, r.pass_line(p, o.passes, ms));
          if (p == 1) verify(sums, expect, 1, first);
        });
  };
  const TimedPasses times = timed_passes(schedule.get(), true, "first timed pass");
  TK_CHECK(lwo_engine_check(dev.engine.get()));
  r.take(times, ring.get());
  schedule.destroy();
  ring.destroy();

  verify(sums + o.layers, expect, o.passes, "warm-up and later timed passes, summed");
  if (!o.budget.empty()) {
    // --budget. The plan for the budget (the link measured now,
    // the checksum consumer as each layer's compute), then its ring's passes,
    // every byte checked again, with the engine held to the budget.
    r.planned = true;
    r.compute_ms = checksum_ms(pool.get(), 0, consumer.get());
    const uint64_t budget = parse_budget(o.budget, r.pass_bytes);
    r.plan = make_plan(pool.get(), plan_budget(dev.engine.get(), budget),
                       std::vector<double>(o.layers, r.compute_ms), {}, nullptr, 2);
    TK_CHECK(lwo_engine_set_budget(dev.engine.get(), budget, 0.0, 0));
    lwo_ring_config pc = plan_ring_config(r.plan, LWO_RING_TIMING);
    Ring pring;
    TK_CHECK(lwo_ring_create(pool.get(), &pc, pring.out()));
    r.plan_ring = ring_info(pring.get());
    TK_CHECK(lwo_ring_reset_stats(pring.get()));  // the uploads at creation are not a pass
    Schedule psched;
    TK_CHECK(lwo_schedule_create(pring.get(), order.data(), o.layers, psched.out()));
    TK_CHECK(cudaMemsetAsync(sums, 0, 2 * size_t(o.layers) * sizeof(*sums), consumer.get()));
    r.plan_passes = timed_passes(psched.get(), false, "first timed pass of the plan");
    TK_CHECK(lwo_engine_check(dev.engine.get()));
    r.plan_stats = ring_stats(pring.get());
    psched.destroy();
    pring.destroy();
    verify(sums + o.layers, expect, o.passes, "the plan's warm-up and later passes, summed");
    // The unbudgeted ring's bytes per pass, to compare with: the stats cover
    // warm-up and timed passes alike in both runs.
  }
  phase.done("1 warm-up + %u timed in %.2f s: median %.3f ms, %.2f GB/s, %.2f%% of the peak; "
             "checksums match",
             o.passes, phase.seconds(), r.median_ms, r.gbps(r.median_ms),
             100 * r.share(r.median_ms));

  print_results(dev, o, r);
  json.write(to_json(dev, o, r));
  return 0;
}

const Command kRunCommand = {"run", "",
    "stream a synthetic model through a ring, timed, every byte checked",
    R"(Streams a synthetic model (every layer one tensor "weight" [rows x cols] of
random bytes in a pinned pool) through a ring of device slots, pass after
pass. Each pass is timed against the pinned H2D peak measured in the same run
(target >= 99% at depth >= 2), and a checksum kernel reads every slot: every
layer of every pass is checked against the host bytes.
Training steps are lwo train; checkpoints are lwo stream.
)",
    throwaway_flags<Options, make_flags>, cmd_run};

}  // namespace cli
