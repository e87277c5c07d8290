// lwo train: training steps of a chain of square linear layers through a
// ring, each timed against its split floor and its bound (what is measured
// and checked: kTrainCommand's help, at the end). The chain, its resident
// reference, the streamed step and the bound are testkit's training workload
// (testkit/workload.h), as bench_workloads runs it, one op per record.
#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "testkit/copy.h"
#include "testkit/dtype.h"
#include "testkit/host.h"
#include "testkit/workload.h"
#include "tools/cli.h"

namespace cli {
namespace {

constexpr double kTargetFrozen = 1.03;               // step / bound, --frozen
constexpr double kTargetTrainable = 1.10;            // step / bound, trainable layers
constexpr double kTargetFloor = 1.04;                // step / split floor
// Device memory kept free beyond the buffers counted: cuBLASLt workspace
// (32 MiB per stream), its handle, and slack for the allocator.
constexpr uint64_t kMarginBytes = uint64_t(512) << 20;

struct Options : ModelOptions {
  int64_t tokens = 8192;
  uint32_t depth = 2, grad_depth = 2, steps = 5;
  uint32_t micro_batches = 1;
  MicroOrder order = MicroOrder::kBatch;
  uint64_t seed = 1;
  // Gradients: "native" (the layer dtype on the wire and in host memory, the
  // library's default), "f32" (LWO_GRADS_F32) or "native-wire"
  // (LWO_GRADS_NATIVE_WIRE: the layer dtype on the wire, f32 host buffers).
  std::string grads = "native";
  bool frozen = false, bias = false, timing = false;
  bool grad_depth_set = false;
  std::string json;
  lwo_quant_format_t quant = LWO_QUANT_NONE;  // --quant: frozen, or fp8-block trainable
  std::string budget;  // --budget (plan, then run the plan too)
  // The host optimizer (lwo_optim): "" (none), "adamw" or
  // "sgd", its state dtype, and the global-norm clip (0: none).
  std::string optimizer;
  lwo_dtype_t optim_state = LWO_DTYPE_F32;
  double max_norm = 0;
  bool delayed = false;
  uint32_t optim_threads = 0;  // --optimizer-threads (0: one per CPU)
  bool trainable() const { return !frozen; }
};

// Byte counts of one configuration, all checked for overflow.
struct Sizes {
  uint64_t act_bytes = 0;            // one [tokens, cols] activation (or gradient) buffer
  uint64_t record_bytes = 0;         // one layer's record in the pool
  uint64_t pool_bytes = 0;           // all records
  lwo_dtype_t wire = LWO_DTYPE_F32;  // gradient dtype on the wire
  lwo_dtype_t host = LWO_DTYPE_F32;  // ... and of the host buffers
  uint64_t grad_bytes = 0;           // one layer's gradients on the wire (0: frozen)
};

std::vector<Flag> make_flags(Options& o) {
  return joined({{
      switch_flag("--frozen", "every layer frozen: input gradients only, no weight gradients",
                  o.frozen),
      quant_flag(o.quant),
      uint_flag(kLayersFlag, o.layers),
      uint_flag(kRowsFlag, o.rows),
      uint_flag(kColsFlag, o.cols),
      dtype_flag(o.dtype, {LWO_DTYPE_BF16, LWO_DTYPE_F16, LWO_DTYPE_F32}),
      uint_flag(kTokensFlag, o.tokens),
      uint_flag(kStepsFlag, o.steps),
      uint_flag(kDepthFlag, o.depth),
      value_flag("--grad-depth", "G", uint_flag(kGradDepthFlag, o.grad_depth).help,
                 [&o](const std::string& v) {
                   o.grad_depth = static_cast<uint32_t>(parse_uint("--grad-depth", v, 1, 64));
                   o.grad_depth_set = true;
                 }),
      choice_flag("--grads", "G",
                  "weight gradients: native (the layer dtype on the wire and in host memory, "
                  "the default), f32 (LWO_GRADS_F32) or native-wire (the layer dtype on the "
                  "wire, f32 host buffers: LWO_GRADS_NATIVE_WIRE)",
                  {"native", "f32", "native-wire"}, "is not native, f32 or native-wire",
                  [&o](const std::string& v) { o.grads = v; }),
      switch_flag("--native-wire", "the same as --grads native-wire",
                  [&o] { o.grads = "native-wire"; }),
      uint_flag("--micro-batches", "K", o.micro_batches, 1, 64,
                "micro-batches per step, each of --tokens tokens"),
      choice_flag("--order", "O",
                  "with --micro-batches: batch (each micro-batch a whole forward and backward "
                  "pass, gradients summed on the host; the default) or layer (each layer runs "
                  "every micro-batch while in its slot, gradients summed in the slot)",
                  {"batch", "layer"}, "is neither batch nor layer", [&o](const std::string& v) {
                    o.order =
                        v == "batch" ? MicroOrder::kBatch : MicroOrder::kLayer;
                  }),
      switch_flag("--bias", "each layer also has a tensor \"bias\" [rows]", o.bias),
      choice_flag("--optimizer", "O",
                  "full steps with the host optimizer (lwo_optim): adamw or sgd; each step's "
                  "update runs as the layers' gradients land",
                  {"adamw", "sgd"}, "is neither adamw nor sgd",
                  [&o](const std::string& v) { o.optimizer = v; }),
      choice_flag("--optimizer-state", "D",
                  "with --optimizer: the moments in f32 (the default) or bf16", {"f32", "bf16"},
                  "is neither f32 nor bf16", [&o](const std::string& v) {
                    o.optim_state = v == "f32" ? LWO_DTYPE_F32 : LWO_DTYPE_BF16;
                  }),
      switch_flag("--delayed", "with --optimizer: the one-step-delayed update (LWO_OPTIM_DELAYED)",
                  o.delayed),
      value_flag("--max-norm", "X", "with --optimizer: clip the gradients' global norm to X",
                 [&o](const std::string& v) {
                   char* end = nullptr;
                   o.max_norm = std::strtod(v.c_str(), &end);
                   if (end == v.c_str() || *end || !(o.max_norm > 0))
                     throw UsageError(strf("--max-norm %s is not a number above 0", v.c_str()));
                 }),
      uint_flag("--optimizer-threads", "N", o.optim_threads, 0, 64,
                "with --optimizer: its update threads (0, the default: one per CPU)"),
    }, pass_flags(o.seed, o.timing, o.device, o.json, o.budget), {
      moved_flag("--train", "--train is not needed: lwo train trains"),
      moved_flag("--passes", "--passes counts the passes of lwo run; lwo train counts --steps"),
  }});
}

void check_options(const Options& o) {
  if (o.rows != o.cols)
    throw UsageError(
        strf("--rows %lld and --cols %lld differ: lwo train chains the layers (the output of "
             "layer l is the input of layer l+1), so each weight is square",
             static_cast<long long>(o.rows), static_cast<long long>(o.cols)));
  if (!o.optimizer.empty() && o.frozen)
    throw UsageError("--optimizer updates weights; --frozen layers have no gradients");
  if (o.optimizer.empty() &&
      (o.optim_state != LWO_DTYPE_F32 || o.max_norm > 0 || o.delayed || o.optim_threads))
    throw UsageError("--optimizer-state, --max-norm, --delayed and --optimizer-threads need "
                     "--optimizer");
  if (o.delayed && o.max_norm > 0)
    throw UsageError("--delayed and --max-norm exclude each other (LWO_OPTIM_DELAYED keeps no "
                     "copy of the state to redo a clipped step from)");
  if (o.frozen && o.grads != "native")
    throw UsageError("--grads sets how weight gradients travel; --frozen layers have none");
  if (o.quant != LWO_QUANT_NONE && o.quant != LWO_QUANT_FP8_E4M3_BLOCK128 && !o.frozen)
    throw UsageError(strf("--quant %s: quantized weights of this format are frozen (add "
                          "--frozen; only --quant fp8-block trains)",
                          quant_flag_name(o.quant)));
  if (o.frozen && o.grad_depth_set)
    throw UsageError("--grad-depth sizes the gradient staging; --frozen layers have no gradients");
}

Sizes compute_sizes(const Options& o) {
  Sizes s;
  auto mul = [](uint64_t a, uint64_t b, const char* what) {
    uint64_t r = 0;
    if (__builtin_mul_overflow(a, b, &r)) throw UsageError(strf("%s do not fit in 64 bits", what));
    return r;
  };
  s.act_bytes =
      mul(mul(static_cast<uint64_t>(o.tokens), static_cast<uint64_t>(o.cols), "the activations"),
          lwo_dtype_size(o.dtype), "the activations");
  lwo_tensor_desc t[2] = {o.weight(), tensor_desc("bias", o.dtype, {o.rows})};
  lwo_tensor_quant_ext qx = quant_ext(o.quant);  // --quant: the record's bytes
  if (o.quant != LWO_QUANT_NONE) t[0].next = &qx;
  const lwo_layer_desc layer{t, o.bias ? 2u : 1u, nullptr};
  s.record_bytes = record_bytes(layer);
  s.pool_bytes = mul(s.record_bytes, o.layers, "the layers' records");
  if (o.trainable()) {
    s.wire = o.grads == "f32" ? LWO_DTYPE_F32 : o.dtype;
    s.host = o.grads == "native" ? o.dtype : LWO_DTYPE_F32;
    uint64_t wes = lwo_dtype_size(s.wire);
    uint64_t n =
        mul(static_cast<uint64_t>(o.rows), static_cast<uint64_t>(o.cols), "the weight gradients");
    // As testkit::ChainWeights::grad_bytes lays them out: the weight's, then
    // the bias's, each at a multiple of LWO_RECORD_ALIGN.
    s.grad_bytes = align_up(mul(n, wes, "the weight gradients"), LWO_RECORD_ALIGN) +
                   (o.bias ? align_up(static_cast<uint64_t>(o.rows) * wes, LWO_RECORD_ALIGN) : 0);
  }
  return s;
}


// --- results --------------------------------------------------------------------

struct Results {
  Sizes sz;
  double pool_s = 0, fill_s = 0, grads_s = 0, resident_copy_s = 0;
  float weight_bound = 0, dy_bound = 0;
  uint64_t free_bytes = 0, total_bytes = 0, need_bytes = 0;
  double h2d_peak = 0, h2d_peak_ms = 0, d2h_peak = 0, d2h_peak_ms = 0;
  double duplex_h2d = 0, duplex_d2h = 0, duplex_ms = 0;  // both directions at once
  lwo_ring_info ring{};
  // Resident reference.
  bool resident = false;
  std::string resident_note;
  std::vector<double> res_ms, res_fwd_ms, res_bwd_ms;
  double res_median = 0, res_fwd = 0, res_bwd = 0;
  // Streamed steps.
  StepStats warm;
  std::vector<StepStats> steps;
  double median_ms = 0, best_ms = 0;
  uint64_t h2d_bytes = 0, h2d_fwd_bytes = 0, d2h_bytes = 0, hits = 0, copies = 0, d2h_layers = 0;
  bool bytes_vary = false;
  double copy_ms = 0, wait_ms = 0;  // medians per step, with --timing
  // The bound.
  double h2d_term = 0, d2h_term = 0, bound = 0;
  const char* binding = "";
  bool phases = false;
  double fwd_h2d_term = 0, bwd_h2d_term = 0;  // the H2D bytes of each half at the peak
  double phase_fwd = 0, phase_bwd = 0;
  SplitFloor floor;                           // the split floor (resident measured)
  double start_ms = 0, turn_ms = 0, end_ms = 0;  // medians per step: the edges
  double add_gbps = 0;                        // host additions during the steps
  uint64_t add_bytes = 0;
  double add_alone_gbps = 0;                  // ... and with nothing else running
  uint64_t add_alone_bytes = 0;
  double target = 0;
  std::string check;
  // With --optimizer, what optimizer_steps measured: the pairs (each a plain
  // step, the update alone, a full step) and the host memory's floor.
  bool optimized = false;
  OptimPairs opt;
  OptimPairs::MemoryFloor opt_memory;
  // With --budget, the planned ring's steps in the same run.
  bool planned = false;
  PlanReport plan;
  lwo_ring_info plan_ring{};
  std::vector<double> plan_ms;
  double plan_median_ms = 0;
  uint64_t plan_h2d_bytes = 0;  // per step, median step's
  std::string plan_check;

  double ratio(double ms) const { return bound > 0 ? ms / bound : 0; }
  bool met() const { return ratio(median_ms) <= target; }
  double gbps(uint64_t bytes, double ms) const {
    return testkit::gbps(static_cast<double>(bytes), ms);
  }
};

// The median step's value of a whole-number field (the upper of the middle
// two for an even count).
template <class T>
T median_of(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void summarise(const Options& o, Results& r) {
  // Each step's value of one field of testkit::StepStats, in step order.
  const auto each = [&r](auto field) {
    std::vector<std::decay_t<decltype(r.steps[0].*field)>> v;
    for (const StepStats& s : r.steps) v.push_back(s.*field);
    return v;
  };
  using S = StepStats;
  uint64_t add_bytes = 0, add_ns = 0;
  for (const S& s : r.steps) {
    add_bytes += s.accumulated_bytes;
    add_ns += s.accumulate_ns;
    r.bytes_vary |= s.h2d_bytes != r.steps[0].h2d_bytes || s.d2h_bytes != r.steps[0].d2h_bytes;
  }
  const std::vector<double> ms = each(&S::ms);
  r.median_ms = median(ms);
  r.best_ms = *std::min_element(ms.begin(), ms.end());
  r.h2d_bytes = median_of(each(&S::h2d_bytes));
  r.h2d_fwd_bytes = median_of(each(&S::h2d_fwd_bytes));
  r.d2h_bytes = median_of(each(&S::d2h_bytes));
  r.hits = median_of(each(&S::hits));
  r.copies = median_of(each(&S::copies));
  r.d2h_layers = median_of(each(&S::d2h_transfers));
  r.copy_ms = median(each(&S::copy_ms));
  r.wait_ms = median(each(&S::wait_ms));
  r.start_ms = median(each(&S::start_ms));
  r.turn_ms = median(each(&S::turn_ms));
  r.end_ms = median(each(&S::end_ms));
  r.add_bytes = r.steps.empty() ? 0 : add_bytes / r.steps.size();
  r.add_gbps = add_ns ? static_cast<double>(add_bytes) / static_cast<double>(add_ns) : 0;

  // max(resident compute, H2D bytes / H2D peak, D2H bytes / D2H peak); no
  // compute term where the records were not all resident.
  const Bound b = step_bound(r.resident ? r.res_median : 0, static_cast<double>(r.h2d_bytes),
                             r.h2d_peak, static_cast<double>(r.d2h_bytes), r.d2h_peak);
  r.h2d_term = b.terms_ms[1];
  r.d2h_term = b.terms_ms[2];
  r.bound = b.ms;
  r.binding = *b.name ? b.name : "H2D";  // every term 0: the H2D term, 0
  // Gradients leave only during the backward half, weights arrive in both:
  // the bound of each half, added.
  r.phases = r.resident && !o.timing;
  if (r.phases) {
    r.fwd_h2d_term = ms_at(static_cast<double>(r.h2d_fwd_bytes), r.h2d_peak);
    r.bwd_h2d_term = ms_at(static_cast<double>(r.h2d_bytes - r.h2d_fwd_bytes), r.h2d_peak);
    r.phase_fwd = std::max(r.res_fwd, r.fwd_h2d_term);
    r.phase_bwd = std::max({r.res_bwd, r.bwd_h2d_term, r.d2h_term});
    const LinkRates rates{r.h2d_peak, r.d2h_peak, o.trainable() ? r.duplex_h2d : r.h2d_peak,
                          o.trainable() ? r.duplex_d2h : r.d2h_peak};
    const uint32_t passes = o.order == MicroOrder::kBatch ? o.micro_batches : 1;
    r.floor = split_floor(r.res_fwd, r.res_bwd, static_cast<double>(r.h2d_fwd_bytes),
                          static_cast<double>(r.h2d_bytes - r.h2d_fwd_bytes),
                          static_cast<double>(r.d2h_bytes), passes, rates);
  }
  r.target = o.trainable() ? kTargetTrainable : kTargetFrozen;
}

void print_results(const Device& dev, const Options& o, const Results& r) {
  const uint32_t L = o.layers;
  const Sizes& sz = r.sz;
  const char* const wait = o.trainable() ? "lwo_grads_wait" : "the stream's sync";
  std::printf("lwo train%s, %s\n", o.frozen ? " --frozen" : "", describe(dev).c_str());
  print_row("model", "%u layers x \"weight\" [%lld x %lld]%s %s: %s per record, %s in all; %s", L,
            static_cast<long long>(o.rows), static_cast<long long>(o.cols),
            o.bias ? " + \"bias\"" : "", lwo_dtype_name(o.dtype),
            fmt_bytes(sz.record_bytes).c_str(), fmt_bytes(sz.pool_bytes).c_str(),
            o.frozen ? "all frozen (input gradients only)" : "all trainable");
  if (o.quant != LWO_QUANT_NONE) {
    const uint64_t dense = static_cast<uint64_t>(o.rows) * static_cast<uint64_t>(o.cols) *
                           lwo_dtype_size(o.dtype);
    const uint64_t quant = quant_bytes(o.quant, o.dtype, o.rows, o.cols);
    print_row("quant", "--quant %s (%s): \"weight\" %s dense, %s quantized (%.2fx fewer bytes); "
              "each layer dequantized on the GPU into %s before its GEMMs",
              quant_flag_name(o.quant), lwo_quant_format_name(o.quant), fmt_bytes(dense).c_str(),
              fmt_bytes(quant).c_str(), static_cast<double>(dense) / static_cast<double>(quant),
              lwo_dtype_name(o.dtype));
  }
  print_row("batch", "%lld tokens, x_0 within +-1, dy_%u within +-%.4g; x_0..x_%u kept for the "
            "backward (%u x %s) and 3 x %s of dy on the device",
            static_cast<long long>(o.tokens), L, r.dy_bound, L, L + 1,
            fmt_bytes(sz.act_bytes).c_str(), fmt_bytes(sz.act_bytes).c_str());
  if (o.micro_batches > 1)
    print_row("micro", "%u of %lld tokens per step, %s-major (%s); every micro-batch's "
              "activations kept",
              o.micro_batches, static_cast<long long>(o.tokens), micro_order_name(o.order),
              o.order == MicroOrder::kLayer
                  ? "one pass: each layer runs every micro-batch in its slot, gradients summed "
                    "there and sent once"
                  : "one pass per micro-batch, gradients summed on the host");
  print_row("host", "pinned pool %.2f s, uniform fill %.2f s (weights within +-%.4g, seed %llu)%s",
            r.pool_s, r.fill_s, r.weight_bound, static_cast<unsigned long long>(o.seed),
            o.trainable() ? strf(", gradient buffers %.2f s", r.grads_s).c_str() : "");
  print_row("peak", "%.2f GB/s H2D (%u records back-to-back on one stream, best of %d: %.2f ms)",
            r.h2d_peak, L, kPeakRepeats, r.h2d_peak_ms);
  if (o.trainable()) {
    print_row("peak", "%.2f GB/s D2H (%u x %s into pinned memory, best of %d: %.2f ms)",
              r.d2h_peak, L, fmt_bytes(sz.grad_bytes).c_str(), kPeakRepeats, r.d2h_peak_ms);
    print_row("duplex", "%.2f GB/s H2D and %.2f GB/s D2H at once (%u x %s each way, best of %d: "
              "%.2f ms)",
              r.duplex_h2d, r.duplex_d2h, L, fmt_bytes(sz.grad_bytes).c_str(), kPeakRepeats,
              r.duplex_ms);
  }
  print_row("ring", "depth %u, %u x %s slots%s; one schedule: layers 0..%u, then %u..0",
            r.ring.depth, r.ring.depth, fmt_bytes(r.ring.slot_bytes).c_str(),
            o.timing ? ", timing on" : "", L - 1, L - 1);
  if (o.trainable())
    print_row("grads", "depth %u, %s on the wire: %s per layer, into %s host buffers (--grads %s)",
              o.grad_depth, lwo_dtype_name(sz.wire), fmt_bytes(sz.grad_bytes).c_str(),
              lwo_dtype_name(sz.host), o.grads.c_str());
  if (r.resident)
    print_row("resident", "median %.3f ms per step (forward %.3f, backward %.3f), all %u records "
              "on the device, %s, %u timed after 1 warm-up",
              r.res_median, r.res_fwd, r.res_bwd, L,
              o.trainable()
                  ? strf("%s weight gradients to device memory", lwo_dtype_name(sz.wire)).c_str()
                  : "input gradients only",
              o.steps);
  else
    print_row("resident", "skipped: %s; the bound has no compute term", r.resident_note.c_str());
  print_row("steps", "%u timed after 1 warm-up; host clock from the first enqueue to the return "
            "of %s", o.steps, wait);
  print_row("time", "median %.3f ms, best %.3f ms per step", r.median_ms, r.best_ms);
  print_row("H2D", "%s per step (%llu copies, %llu ring hits), median %.2f GB/s",
            fmt_bytes(r.h2d_bytes).c_str(), static_cast<unsigned long long>(r.copies),
            static_cast<unsigned long long>(r.hits), r.gbps(r.h2d_bytes, r.median_ms));
  if (o.trainable())
    print_row("D2H", "%s per step (%llu layers), median %.2f GB/s", fmt_bytes(r.d2h_bytes).c_str(),
              static_cast<unsigned long long>(r.d2h_layers), r.gbps(r.d2h_bytes, r.median_ms));
  if (r.bytes_vary) print_row("note", "bytes per step varied between steps; medians shown");
  print_row("bound", "%.3f ms, %s binding (%s, H2D %.3f ms%s)", r.bound, r.binding,
            r.resident ? strf("resident %.3f ms", r.res_median).c_str() : "resident not measured",
            r.h2d_term, o.trainable() ? strf(", D2H %.3f ms", r.d2h_term).c_str() : "");
  print_row("ratio", "median %.4f, best %.4f x bound (target <= %.2f %s: %s)",
            r.ratio(r.median_ms), r.ratio(r.best_ms), r.target,
            o.trainable() ? "trainable" : "frozen", r.met() ? "met" : "NOT met");
  if (r.phases) {
    print_row("halves", "forward max(resident %.3f, H2D %.3f) + backward max(resident %.3f, H2D "
              "%.3f%s) = %.3f ms; step / that %.4f",
              r.res_fwd, r.fwd_h2d_term, r.res_bwd, r.bwd_h2d_term,
              o.trainable() ? strf(", D2H %.3f", r.d2h_term).c_str() : "",
              r.phase_fwd + r.phase_bwd, r.median_ms / (r.phase_fwd + r.phase_bwd));
    print_row("floor", "%.3f ms: %u x (forward max(compute %.3f, H2D %.3f) + backward "
              "max(compute %.3f, H2D and D2H at once %.3f)); step / floor median %.4f, best %.4f "
              "(target <= %.2f: %s)",
              r.floor.ms, r.steps.empty() ? 1u : r.steps[0].passes, r.floor.fwd_compute_ms,
              r.floor.fwd_h2d_ms, r.floor.bwd_compute_ms, r.floor.bwd_link_ms,
              r.median_ms / r.floor.ms, r.best_ms / r.floor.ms, kTargetFloor,
              r.median_ms / r.floor.ms <= kTargetFloor ? "met" : "NOT met");
  }
  print_row("edges", "start %.3f ms (step start to the first layer in its slot), turn %.3f ms "
            "(last forward compute to the first backward layer in its slot), end %.3f ms (last "
            "compute to the return of %s), medians per step",
            r.start_ms, r.turn_ms, r.end_ms, wait);
  if (r.add_bytes)
    print_row("host add", "%s per step added on the host at %.2f GB/s of %s input during the "
              "steps",
              fmt_bytes(r.add_bytes).c_str(), r.add_gbps, lwo_dtype_name(sz.wire));
  if (r.add_alone_bytes)
    print_row("host add", "%.2f GB/s of %s input by itself (%s added, one layer at a time, with "
              "no copy or compute running beside it)",
              r.add_alone_gbps, lwo_dtype_name(sz.wire), fmt_bytes(r.add_alone_bytes).c_str());
  if (o.timing)
    print_row("ring time", "copies %.3f ms on the GPU per step, compute waited %.3f ms per step",
              r.copy_ms, r.wait_ms);
  print_row("check", "%s", r.check.c_str());
}

Json json_step(const StepStats& s) {
  return {{"ms", s.ms},           {"h2d_bytes", s.h2d_bytes}, {"h2d_forward_bytes", s.h2d_fwd_bytes},
          {"copies", s.copies},   {"hits", s.hits},           {"stages", s.stages},
          {"d2h_bytes", s.d2h_bytes}, {"d2h_layers", s.d2h_transfers},
          {"copy_ms", s.copy_ms}, {"wait_ms", s.wait_ms}};
}

Json to_json(const Device& dev, const Options& o, const Results& r) {
  const Sizes& sz = r.sz;
  const bool t = o.trainable();
  Json j = json_doc("train");
  j["mode"] = o.frozen ? "frozen" : "train";
  j["device"] = json_device(dev);
  j["config"] = {{"layers", o.layers}, {"rows", o.rows}, {"cols", o.cols},
                 {"dtype", lwo_dtype_name(o.dtype)}, {"bias", o.bias}, {"tokens", o.tokens},
                 {"depth", o.depth}, {"grad_depth", t ? o.grad_depth : 0},
                 {"native_wire", o.grads == "native-wire"},
                 {"wire_dtype", t ? Json(lwo_dtype_name(sz.wire)) : Json()}, {"steps", o.steps},
                 {"seed", o.seed}, {"timing", o.timing}, {"grads", t ? Json(o.grads) : Json()},
                 {"host_dtype", t ? Json(lwo_dtype_name(sz.host)) : Json()},
                 {"micro_batches", o.micro_batches},
                 {"order", micro_order_name(o.order)}, {"quant", quant_flag_name(o.quant)}};
  j["record_bytes"] = sz.record_bytes;
  j["pool_bytes"] = sz.pool_bytes;
  j["activation_bytes"] = sz.act_bytes;
  j["grad_bytes_per_layer"] = sz.grad_bytes;
  j["device_memory"] = {
      {"free_bytes", r.free_bytes}, {"total_bytes", r.total_bytes}, {"needed_bytes", r.need_bytes}};
  j["host_seconds"] = {{"pool_create", r.pool_s}, {"fill", r.fill_s}, {"grads_create", r.grads_s},
                       {"resident_copy", r.resident_copy_s}};
  Json& peak = j["peak"] = {{"h2d_gbps", r.h2d_peak}, {"h2d_ms", r.h2d_peak_ms},
                            {"h2d_bytes", sz.pool_bytes}, {"d2h_gbps", nullptr}};
  if (t) {
    peak["d2h_gbps"] = r.d2h_peak;
    peak["d2h_ms"] = r.d2h_peak_ms;
    peak["d2h_bytes"] = sz.grad_bytes * o.layers;
    peak["duplex_h2d_gbps"] = r.duplex_h2d;
    peak["duplex_d2h_gbps"] = r.duplex_d2h;
    peak["duplex_ms"] = r.duplex_ms;
  }
  peak["repeats"] = kPeakRepeats;
  if (r.resident)
    j["resident"] = {{"measured", true}, {"median_ms", r.res_median}, {"forward_ms", r.res_fwd},
                     {"backward_ms", r.res_bwd}, {"step_ms", r.res_ms}};
  else
    j["resident"] = {{"measured", false}, {"skipped", r.resident_note}};
  j["warmup_step"] = json_step(r.warm);
  Json& steps = j["steps"] = Json::array();
  for (const StepStats& s : r.steps) steps.push_back(json_step(s));
  j["median_ms"] = r.median_ms;
  j["best_ms"] = r.best_ms;
  j["h2d_bytes_per_step"] = r.h2d_bytes;
  j["d2h_bytes_per_step"] = r.d2h_bytes;
  j["hits_per_step"] = r.hits;
  j["achieved_gbps"] = {{"h2d", r.gbps(r.h2d_bytes, r.median_ms)},
                        {"d2h", r.gbps(r.d2h_bytes, r.median_ms)}};
  j["bound"] = {{"ms", r.bound}, {"binding", r.binding},
                {"resident_ms", r.resident ? Json(r.res_median) : Json()},
                {"h2d_ms", r.h2d_term}, {"d2h_ms", r.d2h_term}};
  if (r.phases) {
    const SplitFloor& f = r.floor;
    j["halves_bound_ms"] = {
        {"forward", r.phase_fwd}, {"backward", r.phase_bwd}, {"sum", r.phase_fwd + r.phase_bwd}};
    j["split_floor"] = {{"ms", f.ms}, {"passes", r.steps.empty() ? 1u : r.steps[0].passes},
                        {"forward_ms", f.fwd_ms}, {"backward_ms", f.bwd_ms},
                        {"forward_compute_ms", f.fwd_compute_ms}, {"forward_h2d_ms", f.fwd_h2d_ms},
                        {"backward_compute_ms", f.bwd_compute_ms},
                        {"backward_link_ms", f.bwd_link_ms}, {"forward_binding", f.fwd_binding},
                        {"backward_binding", f.bwd_binding},
                        {"ratio_median", r.median_ms / f.ms}, {"ratio_best", r.best_ms / f.ms},
                        {"target", kTargetFloor}, {"met", r.median_ms / f.ms <= kTargetFloor}};
  }
  j["edges_ms"] = {{"start", r.start_ms}, {"turn", r.turn_ms}, {"end", r.end_ms}};
  j["host_add"] = {{"bytes_per_step", r.add_bytes}, {"gbps", r.add_gbps},
                   {"alone_bytes", r.add_alone_bytes}, {"alone_gbps", r.add_alone_gbps}};
  j["ratio"] = {{"median", r.ratio(r.median_ms)}, {"best", r.ratio(r.best_ms)},
                {"target", r.target}, {"met", r.met()}};
  j["ring"] = {{"depth", r.ring.depth}, {"slot_bytes", r.ring.slot_bytes}};
  if (r.planned) {  // --budget
    j["plan"] = json_plan(r.plan);
    j["planned"] = {{"depth", r.plan_ring.depth}, {"n_resident", r.plan_ring.n_resident},
                    {"step_ms", r.plan_ms}, {"median_ms", r.plan_median_ms},
                    {"predicted_ms", r.plan.info.predicted_ms}, {"h2d_bytes", r.plan_h2d_bytes},
                    {"time_ratio", r.median_ms > 0 ? r.plan_median_ms / r.median_ms : 0},
                    {"check", r.plan_check}};
  }
  if (r.optimized)  // --optimizer
    j["optimizer"] = {
        {"kind", o.optimizer}, {"state_dtype", lwo_dtype_name(o.optim_state)},
        {"max_norm", o.max_norm}, {"delayed", o.delayed}, {"params_per_step", r.opt.n_params},
        {"update_alone_ms", r.opt.alone()},
        {"params_per_s",
         r.opt.alone() > 0 ? static_cast<double>(r.opt.n_params) / r.opt.alone() * 1e3 : 0},
        {"full_step_ms", r.opt.full()}, {"gpu_step_ms", r.opt.gpu()},
        {"overlap", r.opt.overlap()}, {"ratio_to_bound", r.opt.ratio()}, {"target", 1.1},
        {"met", r.opt.ratio() <= 1.1}, {"tail_ms", median(r.opt.tail_ms)},
        {"host_update_bytes", r.opt_memory.update_bytes},
        {"host_copy_bytes", r.opt_memory.copy_bytes}, {"update_GBps", r.opt_memory.update_gbps},
        {"host_memory_floor_ms", r.opt_memory.floor_ms},
        {"ratio_to_host_memory_floor", r.opt_memory.ratio},
        {"pairs", r.opt.pair_ratio.size()}, {"pair_ratios", r.opt.pair_ratio}};
  j["verified"] = true;
  j["check"] = r.check;
  return j;
}

// --- the check -------------------------------------------------------------------

// After the first timed step: what the streamed step left on the device (the
// last layer's output, the input gradient) and the host gradients of the
// first and the last layer, bit for bit against the resident computation
// (testkit::ChainRun::compare_with_resident: the whole chain when every
// record is resident; else the first and the last layer from the streamed
// step's own inputs). A difference stops the program; returns a sentence
// saying what was checked.
std::string check_step(const Options& o, const Sizes& sz, ChainRun& run,
                       const ChainWeights& weights, lwo_grads* grads) {
  const uint32_t L = o.layers;
  const ChainCheck c = run.compare_with_resident(grads, /*backward=*/true);
  if (!c.same) fail("check failed: " + c.first);
  const std::string what = weights.all_resident()
                               ? "the whole chain recomputed with every weight resident"
                               : "layers 0 and " + std::to_string(L - 1) +
                                     " recomputed from the streamed step's inputs";
  std::string items = strf("output of layer %u, input gradient", L - 1);
  if (!o.trainable()) return "first timed step equals " + what + " bit for bit: " + items;
  const uint32_t checked[2] = {0, L - 1};
  for (uint32_t k = 0; k < (L > 1 ? 2u : 1u); ++k)
    items += strf(", d%s of layer %u", o.bias ? "weight and dbias" : "weight", checked[k]);
  return strf("first timed step equals %s bit for bit (%s wire): %s", what.c_str(),
              lwo_dtype_name(sz.wire), items.c_str());
}

}  // namespace

// --optimizer: the host optimizer over the same gradient set, timed in
// --steps alternating pairs (testkit::OptimPairs), the target at most 1.1.
void optimizer_steps(const Options& o, const Sizes& sz, Results& r, lwo_grads* grads,
                     const std::function<StepStats()>& plain_step, StepOptions& step_options) {
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  oc.kind = o.optimizer == "sgd" ? LWO_OPTIM_SGD : LWO_OPTIM_ADAMW;
  oc.state_dtype = o.optim_state;
  oc.flags = (o.max_norm > 0 ? LWO_OPTIM_CLIPPING : 0u) | (o.delayed ? LWO_OPTIM_DELAYED : 0u);
  oc.n_threads = o.optim_threads;
  lwo_optim* optim = nullptr;
  lwo_optim_info info{};
  {
    Phase phase("optimizer");
    TK_CHECK(lwo_optim_create(grads, &oc, &optim));
    info.size = sizeof info;
    TK_CHECK(lwo_optim_get_info(optim, &info));
    phase.done("%s, %s state, %llu parameters, %s of masters and state, %u threads on %u "
               "NUMA node%s, %s loops",
               o.optimizer.c_str(), lwo_dtype_name(o.optim_state),
               static_cast<unsigned long long>(info.n_params), fmt_bytes(info.state_bytes).c_str(),
               info.n_threads, info.n_numa_nodes, info.n_numa_nodes == 1 ? "" : "s",
               info.vector_level);
  }
  OptimPairs& t = r.opt;
  t.optim = optim;
  t.p.lr = 1e-5;  // small: the weights stay in range over the run
  t.p.max_norm = o.max_norm;
  {
    Phase phase("pairs", o.steps);
    for (uint32_t s = 0; s < o.steps; ++s) {
      t.time_pair(plain_step, step_options);
      phase.set(s + 1, strf("pair %u/%u: GPU step %.3f ms, update alone %.3f ms (%.3f G params/s), "
                            "full step %.3f ms: %.3f x", s + 1, o.steps, t.gpu_ms.back(),
                            t.alone_ms.back(), t.n_params / t.alone_ms.back() / 1e6,
                            t.full_ms.back(), t.pair_ratio.back()));
    }
    TK_CHECK(lwo_optim_wait(optim));
    const double gpu = t.gpu(), alone = t.alone(), full = t.full(), ratio = t.ratio();
    phase.done("medians: GPU step %.3f ms, update alone %.3f ms, full step %.3f ms; %.3f x "
               "(median of the pairs' ratios)", gpu, alone, full, ratio);
    r.optimized = true;
    std::printf("optimizer  %s (%s state%s): GPU step %.3f ms, update alone %.3f ms "
                "(%.3f G params/s), full step %.3f ms (medians of %u pairs); overlap %.0f%% of "
                "the shorter; %.3f x max(GPU step, update alone) (median of the pairs' ratios, "
                "%.3f-%.3f; target <= 1.1): %s; update tail after the last landing %.3f ms "
                "(median)\n",
                o.optimizer.c_str(), lwo_dtype_name(o.optim_state),
                (o.max_norm > 0 ? strf(", max norm %g", o.max_norm)
                                : std::string(o.delayed ? ", delayed" : ""))
                    .c_str(),
                gpu, alone, t.n_params / alone / 1e6, full, o.steps, 100 * t.overlap(), ratio,
                *std::min_element(t.pair_ratio.begin(), t.pair_ratio.end()),
                *std::max_element(t.pair_ratio.begin(), t.pair_ratio.end()),
                ratio <= 1.1 ? "PASS" : "MISS", median(t.tail_ms));
    std::string each;
    for (size_t i = 0; i < t.full_ms.size(); ++i)
      each += strf("%s%.1f/%.1f/%.1f: %.3f", i ? ", " : "", t.gpu_ms[i], t.alone_ms[i],
                   t.full_ms[i], t.pair_ratio[i]);
    std::printf("pairs  GPU step/update alone/full step ms: ratio, in order: %s\n", each.c_str());
    const OptimPairs::MemoryFloor& m = r.opt_memory = t.memory_floor(
        static_cast<double>(t.n_params) *
            update_bytes_per_param(oc.kind == LWO_OPTIM_ADAMW, o.optim_state, sz.host, o.dtype,
                                   info.vector_level),
        static_cast<double>(r.h2d_bytes + r.d2h_bytes));
    std::printf("host memory  a step: %.2f GB of update traffic and %.2f GB of copies (H2D and D2H); "
                "at the update's own %.1f GB/s that is %.3f ms: the full step is %.3f x it "
                "(median of the pairs)\n",
                m.update_bytes / 1e9, m.copy_bytes / 1e9, m.update_gbps, m.floor_ms, m.ratio);
  }
  TK_CHECK(lwo_optim_destroy(optim));
}

// One run of lwo train, phase by phase: what each phase makes (the pool, the
// chain's buffers, the ring, the schedule, the gradients) lives here until
// the run ends, released in the reverse order.
struct Trainer {
  const Options& o;
  Results& r;
  const Sizes& sz;
  lwo_engine* engine;
  const uint32_t L;
  const uint32_t n_check;  // layers the check recomputes: the first and the last
  std::unique_ptr<ChainWeights> weights;
  Stream compute;
  std::unique_ptr<ChainRun> run;
  Ring ring;
  Schedule schedule;
  Grads grads;
  std::vector<uint32_t> order;
  StepOptions step_options;

  Trainer(const Options& options, Results& results, lwo_engine* e)
      : o(options), r(results), sz(r.sz), engine(e), L(o.layers), n_check(L > 1 ? 2 : 1) {}

  // Device memory for the streamed steps, checked before anything is made.
  void check_memory() {
    // The streamed steps need (the resident records come later,
    // where they fit): activations, gradient buffers, ring slots, gradient
    // staging, the check's buffers and records of the first and last layer.
    size_t free_b = 0, total_b = 0;
    TK_CHECK(cudaMemGetInfo(&free_b, &total_b));
    r.free_bytes = free_b;
    r.total_bytes = total_b;
    const double act = static_cast<double>(L + 4) * static_cast<double>(sz.act_bytes) *
                       static_cast<double>(o.micro_batches);
    const double ring_b = static_cast<double>(o.depth) * static_cast<double>(sz.record_bytes);
    const double grads_b = static_cast<double>(o.grad_depth + n_check + (L > 2 ? 1 : 0)) *
                           static_cast<double>(sz.grad_bytes);
    const double checks = static_cast<double>(n_check) * static_cast<double>(sz.record_bytes);
    const double need = act + ring_b + grads_b + checks + static_cast<double>(kMarginBytes);
    r.need_bytes = need < 1.8e19 ? static_cast<uint64_t>(need) : UINT64_MAX;
    if (need > static_cast<double>(free_b))
      fail(
          strf("lwo train needs about %s of device memory (activations and gradients %s, ring "
               "%s, gradient buffers %s, check records %s, margin %s) but %s of %s is free: "
               "lower --tokens, --layers or --depth",
               fmt_bytes(r.need_bytes).c_str(), fmt_bytes(static_cast<uint64_t>(act)).c_str(),
               fmt_bytes(static_cast<uint64_t>(ring_b)).c_str(),
               fmt_bytes(static_cast<uint64_t>(grads_b)).c_str(),
               fmt_bytes(static_cast<uint64_t>(checks)).c_str(), fmt_bytes(kMarginBytes).c_str(),
               fmt_bytes(free_b).c_str(), fmt_bytes(total_b).c_str()));
  }

  void load() {
    // The pool: a chain of square layers (testkit::ChainWeights, one layer a
    // record), weights uniform within +-sqrt(3 / cols) (variance 1 / cols:
    // activations and gradients keep their scale through any number of layers,
    // so f16 neither overflows nor underflows), biases within +-1 / sqrt(cols).
    ChainSpec spec = linear_chain("lwo train", o.cols, L, 1);
    spec.dtype = o.dtype;
    spec.bias = o.bias;
    spec.seed = o.seed;
    spec.quant = o.quant;  // --quant: quantized on load (fill)
    {
      Phase phase("pool");
      weights = std::make_unique<ChainWeights>(engine, spec, /*fill_now=*/false);
      r.pool_s = weights->pool_seconds();
      phase.done("pinned, %s in %.2f s", fmt_bytes(sz.pool_bytes).c_str(), r.pool_s);
    }
    r.weight_bound = spec.weight_bound(0);
    const uint64_t fill_bytes = weights->fill_bytes();
    Phase phase("fill", fill_bytes, true);
    weights->fill(phase.counter());
    r.fill_s = weights->fill_seconds();
    phase.done("%s uniform within +-%.4g in %.2f s (%.1f GB/s, seed %llu)",
               fmt_bytes(fill_bytes).c_str(), r.weight_bound, r.fill_s,
               static_cast<double>(fill_bytes) / std::max(r.fill_s, 1e-9) / 1e9,
               static_cast<unsigned long long>(o.seed));
  }

  void peaks() {
    // Peaks, before anything else runs on the GPU.
    Phase phase("peak");
    const CopyResult h2d = time_h2d_copies(weights->record_hosts(), sz.record_bytes, kPeak);
    r.h2d_peak = h2d.best_gbps();
    r.h2d_peak_ms = h2d.best_ms();
    std::string d2h;
    if (o.trainable()) {
      // L gradients' worth of copies into pinned memory.
      PeakKnobs knobs{sz.grad_bytes, L, kPeak.warmup, kPeakRepeats, Direction::kD2H};
      const CopyResult peak = measure_pinned_peak(knobs);
      r.d2h_peak = peak.best_gbps();
      r.d2h_peak_ms = peak.best_ms();
      // Both directions at once, as the backward half moves them.
      knobs.direction = Direction::kBoth;
      const CopyResult both = measure_pinned_peak(knobs);
      r.duplex_h2d = both.h2d_best_gbps();
      r.duplex_d2h = both.d2h_best_gbps();
      r.duplex_ms = both.best_ms();
      d2h = strf("; %.2f GB/s pinned D2H, %u x %s in %.2f ms; at once %.2f + %.2f GB/s",
                 r.d2h_peak, L, fmt_bytes(sz.grad_bytes).c_str(), r.d2h_peak_ms, r.duplex_h2d,
                 r.duplex_d2h);
    }
    phase.done("%.2f GB/s pinned H2D, %s in %.2f ms%s", r.h2d_peak,
               fmt_bytes(sz.pool_bytes).c_str(), r.h2d_peak_ms, d2h.c_str());
  }

  void prepare() {
    // The chain's buffers and inputs (testkit::ChainRun): x_0 .. x_L, dy_L and
    // two ping-pong gradient buffers; x_0 uniform in [-1, 1), dy_L uniform
    // within +-1/sqrt(tokens) (so each weight gradient, a sum over the tokens,
    // stays near 1 in size).
    compute = make_stream();
    run = std::make_unique<ChainRun>(*weights, o.tokens, compute.get(), o.trainable(),
                                                   sz.wire, o.micro_batches, o.order);
    r.dy_bound = run->dy_bound();

    // The ring, the schedule (forward 0..L-1, backward L-1..0) and the gradients.
    lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
    ring_config.depth = o.depth;
    ring_config.flags = o.timing ? LWO_RING_TIMING : 0u;
    TK_CHECK(lwo_ring_create(weights->pool(), &ring_config, ring.out()));
    r.ring = ring_info(ring.get());
    order = step_order(L, /*backward=*/true);
    TK_CHECK(lwo_schedule_create(ring.get(), order.data(), 2 * L, schedule.out()));
    if (o.trainable()) {
      lwo_grads_config grads_config = LWO_GRADS_CONFIG_INIT;
      grads_config.depth = o.grad_depth;
      grads_config.flags = o.grads == "f32"           ? LWO_GRADS_F32
                           : o.grads == "native-wire" ? LWO_GRADS_NATIVE_WIRE
                                                      : 0u;  // the layer dtype throughout
      Phase phase("grads");
      TK_CHECK(lwo_grads_create(weights->pool(), nullptr, &grads_config, grads.out()));
      r.grads_s = phase.seconds();
      phase.done("%s host buffers for %u layers in %.2f s, %s on the wire",
                 lwo_dtype_name(sz.host), L, r.grads_s, lwo_dtype_name(sz.wire));
    }
  }

  void resident() {
    // The resident reference: every record on the device where they fit, else
    // only the first and the last (for the check). The margin also keeps room
    // for the gradient buffers of the resident passes (the first and the last
    // layer's, and a scratch for the others'), which they allocate on first use.
    const uint64_t resident_grad_bytes =
        o.trainable() ? (n_check + (L > 2 ? 1 : 0)) * sz.grad_bytes : 0;
    weights->make_resident(/*allow_partial=*/true, kMarginBytes + resident_grad_bytes);
    r.resident_copy_s = weights->resident_seconds();
    r.resident = weights->all_resident();
    r.resident_note = weights->resident_note();

    if (r.resident) {
      Phase phase("resident", o.steps + 1);
      for (uint32_t s = 0; s <= o.steps; ++s) {
        // The same calls as a streamed step; forward and backward timed by events.
        const PassTimes t = run->resident_pass(/*backward=*/true, /*events=*/true);
        TK_CHECK(lwo_engine_check(engine));
        if (s == 0) {  // warm-up: algorithm choice, workspace
          phase.set(1, "warm-up step done");
          continue;
        }
        r.res_fwd_ms.push_back(t.fwd_ms);
        r.res_bwd_ms.push_back(t.bwd_ms);
        r.res_ms.push_back(t.fwd_ms + t.bwd_ms);
        phase.set(s + 1, strf("step %u/%u: %.3f ms (forward %.3f, backward %.3f)", s, o.steps,
                              t.fwd_ms + t.bwd_ms, t.fwd_ms, t.bwd_ms));
      }
      r.res_median = median(r.res_ms);
      r.res_fwd = median(r.res_fwd_ms);
      r.res_bwd = median(r.res_bwd_ms);
      phase.done("1 warm-up + %u timed steps with every record on the device: median %.3f ms "
                 "(forward %.3f, backward %.3f)",
                 o.steps, r.res_median, r.res_fwd, r.res_bwd);
    } else {
      progress("resident: skipped: %s; the bound has no compute term", r.resident_note.c_str());
    }
  }

  StepStats step() {
    return run->streamed_pass(schedule.get(), ring.get(), grads.get(), step_options);
  }

  std::string report(const char* name, const StepStats& s) const {
    return strf("%s: %.3f ms; H2D %s %.2f GB/s, %llu hits%s", name, s.ms,
                fmt_bytes(s.h2d_bytes).c_str(), r.gbps(s.h2d_bytes, s.ms),
                static_cast<unsigned long long>(s.hits),
                o.trainable() ? strf("; D2H %s %.2f GB/s", fmt_bytes(s.d2h_bytes).c_str(),
                                     r.gbps(s.d2h_bytes, s.ms))
                                    .c_str()
                              : "");
  }

  // The streamed steps (testkit::ChainRun::streamed_pass): one warm-up, then
  // the timed ones. Each zeroes the gradients (untimed), then is timed from
  // the start of the enqueue to the return of lwo_grads_wait and the compute
  // stream's sync. Without --timing the ring's statistics are host counters,
  // read after the forward half without waiting for the GPU.
  void streamed(Phase& steps_phase) {
    step_options.half_stats = !o.timing;
    step_options.timing = o.timing;
    step_options.check_engine = engine;
    step_options.edges = true;
    r.warm = step();
    steps_phase.set(1, report("warm-up step", r.warm));
    for (uint32_t s = 1; s <= o.steps; ++s) {
      r.steps.push_back(step());
      steps_phase.set(s + 1, report(strf("step %u/%u", s, o.steps).c_str(), r.steps.back()));
      if (s == 1) {
        r.check = check_step(o, sz, *run, *weights, grads.get());
        progress("check: %s", r.check.c_str());
      }
    }
    TK_CHECK(cudaStreamSynchronize(compute.get()));
    TK_CHECK(lwo_engine_synchronize(engine));
  }

  // The host addition by itself (testkit::time_host_add), where the wire
  // dtype is the host buffers'.
  void host_add() {
    if (!o.trainable() || sz.wire != sz.host) return;
    Phase phase("host add");
    const HostAdd add = time_host_add(grads, compute, L);
    r.add_alone_bytes = add.bytes;
    r.add_alone_gbps = add.gbps();
    phase.done("%s in %.2f ms of host work: %.2f GB/s", fmt_bytes(r.add_alone_bytes).c_str(),
               static_cast<double>(add.ns) / 1e6, r.add_alone_gbps);
  }

  void planned() {
    if (o.budget.empty()) return;
    // --budget. The plan from the link measured now and the
    // resident steps' compute per layer (0 where they could not be measured),
    // then its ring's steps with the same gradients, the engine held to the
    // budget (the gradient staging already held counts against it).
    r.planned = true;
    const double f = r.resident ? r.res_fwd / L : 0, b = r.resident ? r.res_bwd / L : 0;
    const uint64_t budget = parse_budget(o.budget, sz.pool_bytes);
    std::vector<uint8_t> mask(L, o.trainable() ? 1 : 0);
    r.plan = make_plan(weights->pool(), plan_budget(engine, budget), std::vector<double>(L, f),
                       std::vector<double>(L, b), mask.data(), o.grad_depth);
    schedule.destroy();
    ring.destroy();
    TK_CHECK(lwo_engine_set_budget(engine, budget, 0.0, 0));
    lwo_ring_config pc = plan_ring_config(r.plan, o.timing ? LWO_RING_TIMING : 0u);
    TK_CHECK(lwo_ring_create(weights->pool(), &pc, ring.out()));
    r.plan_ring = ring_info(ring.get());
    TK_CHECK(lwo_schedule_create(ring.get(), order.data(), 2 * L, schedule.out()));
    Phase plan_phase("planned", o.steps + 1);
    step();  // warm-up
    std::vector<StepStats> ps;
    for (uint32_t s2 = 1; s2 <= o.steps; ++s2) {
      ps.push_back(step());
      r.plan_ms.push_back(ps.back().ms);
      plan_phase.set(s2 + 1, report(strf("planned step %u/%u", s2, o.steps).c_str(), ps.back()));
      if (s2 == 1) {  // the planned ring's first timed step, checked as the first one was
        r.plan_check = check_step(o, sz, *run, *weights, grads.get());
        progress("planned check: %s", r.plan_check.c_str());
      }
    }
    r.plan_median_ms = median(r.plan_ms);
    for (const StepStats& st : ps)
      if (st.ms == r.plan_median_ms) r.plan_h2d_bytes = st.h2d_bytes;
    if (!r.plan_h2d_bytes && !ps.empty()) r.plan_h2d_bytes = ps[0].h2d_bytes;
    plan_phase.done("depth %u, %u resident: median %.3f ms, predicted %.3f ms",
                    r.plan_ring.depth, r.plan_ring.n_resident, r.plan_median_ms,
                    r.plan.info.predicted_ms);
  }
};

void print_planned(const Results& r) {
  std::printf("\n");
  print_plan(r.plan);
  print_row("planned", "predicted %.3f ms, measured %.3f ms per step (%+.1f%%); %.3fx the "
            "unbudgeted step (target <= 0.6x); H2D %s per step", r.plan.info.predicted_ms,
            r.plan_median_ms, 100 * (r.plan_median_ms / r.plan.info.predicted_ms - 1),
            r.median_ms > 0 ? r.plan_median_ms / r.median_ms : 0,
            fmt_bytes(r.plan_h2d_bytes).c_str());
  print_row("check", "%s", r.plan_check.c_str());
}

int cmd_train(int argc, char** argv) {
  Options o;
  if (!parse_flags(argc, argv, make_flags(o))) return 0;  // --help: printed
  check_options(o);
  const uint32_t L = o.layers;
  Results r;
  r.sz = compute_sizes(o);
  const Sizes& sz = r.sz;

  const Device dev(o.device);
  lwo_engine* engine = dev.engine.get();
  JsonFile json(o.json);
  progress("lwo train%s, %s: %u layers of %s (%s), %lld tokens", o.frozen ? " --frozen" : "",
           describe(dev).c_str(), L, fmt_bytes(sz.record_bytes).c_str(),
           fmt_bytes(sz.pool_bytes).c_str(), static_cast<long long>(o.tokens));
  note_depth(o.depth, L, "the warm-up", "steps");

  {
    Trainer t(o, r, engine);
    t.check_memory();
    t.load();
    t.peaks();
    t.prepare();
    t.resident();
    Phase steps_phase("steps", o.steps + 1);
    t.streamed(steps_phase);
    t.host_add();
    t.planned();
    summarise(o, r);
    if (!o.optimizer.empty())
      optimizer_steps(o, r.sz, r, t.grads.get(), [&t] { return t.step(); }, t.step_options);
    steps_phase.done("1 warm-up + %u timed streamed steps in %.2f s: median %.3f ms, %.4f x the "
                     "bound (%s)",
                     o.steps, steps_phase.seconds(), r.median_ms, r.ratio(r.median_ms), r.binding);
    print_results(dev, o, r);
    if (r.planned) print_planned(r);  // --budget
    json.write(to_json(dev, o, r));
  }
  return 0;
}

const Command kTrainCommand = {"train", "",
    "training steps through a ring, timed against their bound",
    R"(Trains a chain of square linear layers y = x W^T on random data: one schedule
streams layers 0..L-1 forward, then L-1..0 backward; weight gradients go to
host buffers in the layer dtype (lwo_grads; --grads f32 or native-wire for f32
buffers). Each step is timed against its split floor, forward max(resident
compute, H2D bytes / H2D peak) + backward max(resident compute, H2D and D2H
bytes at once), and against the older bound max(resident compute, H2D bytes /
H2D peak, D2H bytes / D2H peak), every term measured in the same run
(targets: step <= 1.04 x floor; <= 1.10 x bound, frozen <= 1.03 x). The
start, the turn and the end of each step are timed. --micro-batches K runs K
micro-batches per step in --order batch or layer. The first timed step is
checked bit for bit against the same computation with every weight resident
on the device. --rows must equal --cols.
)",
    throwaway_flags<Options, make_flags>, cmd_train};

}  // namespace cli
