// testkit: the training-step workload, with its resident reference and its
// bound (bench_workloads; lwo run --train; lwo shard's step driver).
//
// A chain of ops without nonlinearity, x_{i+1} = op_i(x_i) (linear, or 3x3
// convolution, pad 1, NHWC), its weights in records (consecutive ops per
// record) of a pinned pool:
//
//   ChainWeights  the pool, filled from the spec's seed, and a copy of the
//                 records in device memory (the resident reference)
//   ChainRun      the activations of one row count (tokens or images) on a
//                 stream: a resident pass, a streamed pass through a ring by
//                 lwo_schedule ([0..R-1], then [R-1..0] with backward), and
//                 the bit-for-bit check of a streamed pass against resident
//   run_step      the streamed pass's driver alone, for callers with their own
//                 compute (lwo shard's sharded layers)
//   step_bound    max(resident, H2D bytes / H2D peak, D2H bytes / D2H peak)
//
// In a backward pass record r's weight gradients go to host memory through
// lwo_grads (lwo_grads_begin, the dweight calls, lwo_grads_end), sent before
// the record's last dx is computed; without grads the layers are frozen (dx
// only). Values: weight of op i uniform within +-sqrt(3 / fan_in) with key
// key_of(seed, 2i), bias within +-1 / sqrt(fan_in) with key_of(seed, 2i + 1),
// x_0 within +-1 (kInputIndex), dy_N within +-1 / sqrt(rows) (kGradIndex):
// variance 1 / fan_in, so activations keep their scale through the chain.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "lwo.h"
#include "check.h"
#include "owner.h"
#include "random.h"

namespace testkit {

// The extension that stores a tensor quantized in `format` on load
// (LWO_EXT_TENSOR_QUANT); a tensor_desc's next points to it.
inline lwo_tensor_quant_ext quant_ext(lwo_quant_format_t format) {
  lwo_tensor_quant_ext q{};
  q.header.type = LWO_EXT_TENSOR_QUANT;
  q.format = format;
  return q;
}
// The bytes (codes and scales) of a [rows, cols] tensor of `dtype` quantized
// in `format` (lwo_quant_layout); 0 where the format does not take the shape.
uint64_t quant_bytes(lwo_quant_format_t format, lwo_dtype_t dtype, int64_t rows, int64_t cols);

enum class OpKind { kLinear, kConv3x3 };

constexpr uint64_t kInputIndex = (uint64_t(1) << 62) - 1;  // key_of(seed, .) of x_0
constexpr uint64_t kGradIndex = uint64_t(1) << 62;         // ... of dy_N

struct ChainSpec {
  std::string name;
  OpKind kind = OpKind::kLinear;
  lwo_dtype_t dtype = LWO_DTYPE_BF16;            // bf16, f16 or f32
  bool bias = false;
  std::vector<std::pair<int64_t, int64_t>> ops;  // (in, out) features, or channels
  std::vector<std::vector<uint32_t>> records;    // consecutive op indices per record, in order
  int32_t h = 1, w = 1;                          // convolutions: image size
  uint64_t seed = 1;
  // Linear weights stored quantized in this format
  // (LWO_EXT_TENSOR_QUANT, quantized on load from their uniform values in
  // `dtype`; the layers compute with lwo_linear_desc.weight_format). Only
  // LWO_QUANT_FP8_E4M3_BLOCK128 trains (its dW dense in `dtype`); with any
  // other format lwo_grads_create refuses the pool, so run it frozen.
  lwo_quant_format_t quant = LWO_QUANT_NONE;

  uint32_t n_ops() const { return static_cast<uint32_t>(ops.size()); }
  uint32_t n_records() const { return static_cast<uint32_t>(records.size()); }
  uint64_t spatial() const { return static_cast<uint64_t>(h) * static_cast<uint64_t>(w); }
  uint64_t weight_elems(uint32_t i) const;  // out x in (x 9 for convolutions)
  uint64_t fan_in(uint32_t i) const;        // in (x 9)
  float weight_bound(uint32_t i) const;     // sqrt(3 / fan_in): the weights' values lie within +-it
  float bias_bound(uint32_t i) const;       // 1 / sqrt(fan_in): the biases'
  void group(uint32_t per_record);          // records of per_record consecutive ops
};
// n ops of dim x dim, per_record to a record.
ChainSpec linear_chain(std::string name, int64_t dim, uint32_t n, uint32_t per_record);
// The 144-linear model: 24 blocks of 4 x Linear(2048x2048), Linear(2048->8192),
// Linear(8192->2048); one record per block of 6, or per linear.
ChainSpec m144_chain(bool block_records);

// --- the weights ------------------------------------------------------------------

class ChainWeights {
 public:
  // The pinned pool of spec's records on `engine`, filled from all cores
  // (fill_now false: the caller calls fill() itself, e.g. with a progress bar).
  // Tensors are "weight" and "bias" in a record of one op, else "w<j>", "b<j>".
  ChainWeights(lwo_engine* engine, ChainSpec spec, bool fill_now = true);
  ChainWeights(const ChainWeights&) = delete;
  ChainWeights& operator=(const ChainWeights&) = delete;
  ~ChainWeights();  // the gradients' objects (a caller's too) must be gone first

  // Fills every weight and bias of the pool (fill_uniform; the constructor
  // does unless told not to). fill_bytes() bytes in all.
  void fill(const Progress& progress = {});
  uint64_t fill_bytes() const;

  // Copies the records to device memory. Every record, or (allow_partial) where
  // they do not all fit in the free memory less margin_bytes, only the first and
  // the last: then all_resident() is false and resident_note() says why.
  void make_resident(bool allow_partial = false, uint64_t margin_bytes = 0);

  const ChainSpec& spec() const { return spec_; }
  lwo_engine* engine() const { return engine_; }
  lwo_pool* pool() const { return pool_.get(); }
  uint32_t n_records() const { return spec_.n_records(); }
  uint64_t pool_bytes() const { return pool_bytes_; }
  uint64_t record_bytes(uint32_t r) const { return record_bytes_[r]; }
  std::vector<HostRange> record_hosts() const;  // each record's pinned host bytes
  const std::string& weight_name(uint32_t r, uint32_t j) const { return names_[r][2 * j]; }
  const std::string& bias_name(uint32_t r, uint32_t j) const { return names_[r][2 * j + 1]; }
  double pool_seconds() const { return pool_s_; }
  double fill_seconds() const { return fill_s_; }

  bool resident(uint32_t r) const { return !resident_.empty() && resident_[r].get() != nullptr; }
  bool all_resident() const { return all_resident_; }
  const std::string& resident_note() const { return resident_note_; }
  double resident_seconds() const { return resident_s_; }
  const void* resident_weight(uint32_t r, uint32_t j) const;  // device
  const void* resident_bias(uint32_t r, uint32_t j) const;

  // Record r's gradients in dtype `wire`, as the resident passes lay them out:
  // per op, the weight's and then the bias's, each at a multiple of LWO_RECORD_ALIGN.
  uint64_t grad_bytes(uint32_t r, lwo_dtype_t wire) const;
  uint64_t grad_offset(uint32_t r, uint32_t j, bool bias, lwo_dtype_t wire) const;

 private:
  ChainSpec spec_;
  lwo_engine* engine_;
  Pool pool_;
  uint64_t pool_bytes_ = 0;
  std::vector<uint64_t> record_bytes_;
  std::vector<std::vector<uint64_t>> tensor_off_;  // per record: weight, bias, weight, ...
  std::vector<std::vector<std::string>> names_;    // the same order
  std::vector<UniformRange> fill_;                 // every tensor's values
  // Quantized weights (spec.quant): their uniform values are made in a host
  // buffer and quantized into the pool (lwo_pool_write_quantized).
  struct QuantFill {
    uint32_t record;
    std::string name;
    UniformRange values;  // data: null (the buffer is made by fill())
  };
  std::vector<QuantFill> quant_fill_;
  std::vector<DeviceMem> resident_;                // per record; empty where not resident
  bool all_resident_ = false;
  std::string resident_note_;
  double pool_s_ = 0, fill_s_ = 0, resident_s_ = 0;
};

// --- one step's figures, and the bound --------------------------------------------------

// A pass timed on the host, from its first call to the return of its final
// synchronisation; the GPU idle before.
struct PassTimes {
  double wall_ms = 0;
  double fwd_ms = 0, bwd_ms = 0;  // CUDA events around each half, when asked for
};

struct StepStats {
  double ms = 0;                              // wall clock, as PassTimes
  uint32_t passes = 1;                        // schedule passes in the step (micro-batch-major: K)
  uint64_t h2d_bytes = 0, h2d_fwd_bytes = 0;  // ring copies; in the forward half (half_stats)
  uint64_t copies = 0, hits = 0, stages = 0;
  uint64_t d2h_bytes = 0, d2h_transfers = 0;  // lwo_grads
  double copy_ms = 0, wait_ms = 0;            // rings created with LWO_RING_TIMING
  // The edges (StepOptions::edges), per step, summed over its passes: `start`
  // from the step's start to the first record in its slot (compute can
  // begin), `turn` from the last forward compute to the first backward
  // record in its slot, `end` from the last compute's completion to the
  // return of lwo_grads_wait (the gradients still on their way).
  double start_ms = 0, turn_ms = 0, end_ms = 0;
  uint64_t accumulated_bytes = 0, accumulate_ns = 0;  // lwo_grads: the host additions
  // With StepOptions::stalls: per schedule position, how long the
  // stream stood between the previous position's compute (the pass's start
  // for the first) and this one's, waiting for its record to land in its
  // slot (and, in a backward, for its gradient slot), summed over the passes.
  std::vector<double> stall_ms;
};

struct BoundTerm {
  const char* name;
  double ms;
};
struct Bound {
  double ms = 0;
  const char* name = "";         // "" when no term is above 0
  size_t index = 0;              // of the term, in the caller's order
  std::vector<double> terms_ms;  // every term, in the caller's order
};
// The largest term (the first of equal ones).
Bound bound_of(const std::vector<BoundTerm>& terms);
// max(resident, H2D bytes / H2D peak, D2H bytes / D2H peak), index 0, 1, 2 in
// that order ("resident compute", "H2D", "D2H"); a peak of 0 gives a 0 term.
Bound step_bound(double resident_ms, double h2d_bytes, double h2d_gbps, double d2h_bytes,
                 double d2h_gbps);

// The rates of the link, measured in one run: each direction alone, and both
// at once (testkit::measure_pinned_peak with Direction::kBoth).
struct LinkRates {
  double h2d_gbps = 0, d2h_gbps = 0;                // alone
  double duplex_h2d_gbps = 0, duplex_d2h_gbps = 0;  // together
};
// The time to move h2d and d2h bytes at once: both at their duplex rates
// until the smaller finishes, the rest at its one-way rate; with bytes in one
// direction only, that direction at its one-way rate. Unmeasured (0) rates
// give 0.
double duplex_ms(double h2d_bytes, double d2h_bytes, const LinkRates& rates);

// The split floor of a step: gradients exist only in the backward half, and
// both directions at once do not each reach the one-way peak, so per pass
//   forward max(compute, H2D alone) + backward max(compute, H2D and D2H at once),
// the step's bytes and compute spread evenly over its passes.
struct SplitFloor {
  double ms = 0;                   // the floor of the whole step
  double fwd_ms = 0, bwd_ms = 0;   // of one pass's halves
  double fwd_compute_ms = 0, fwd_h2d_ms = 0;
  double bwd_compute_ms = 0, bwd_link_ms = 0;
  const char* fwd_binding = "";    // "compute" or "H2D"
  const char* bwd_binding = "";    // "compute" or "link"
};
SplitFloor split_floor(double fwd_compute_ms, double bwd_compute_ms, double h2d_fwd_bytes,
                       double h2d_bwd_bytes, double d2h_bytes, uint32_t passes,
                       const LinkRates& rates);

// --- the streamed step's driver -------------------------------------------------------

// What a record does in a streamed pass. `w` is the record's slot. backward
// gets the lwo_grads_begin view `g` (null: frozen, dx only) and calls done()
// once every weight gradient of the record is enqueued, before the last dx
// (it calls lwo_grads_end).
struct StepCalls {
  std::function<void(uint32_t pass)> begin_pass;  // optional: before each pass's first call
  std::function<void(uint32_t r, const lwo_layer_view& w)> forward;
  std::function<void(uint32_t r, const lwo_layer_view& w, const lwo_layer_view* g,
                     const std::function<void()>& done)>
      backward;
};

struct StepOptions {
  bool backward = true;     // the order is [0..R-1, R-1..0]; false: [0..R-1]
  bool half_stats = false;  // read the ring's counters after the forward half (a host call)
  bool timing = false;      // the ring has LWO_RING_TIMING (its counters then wait for the GPU)
  bool zero_grads = true;   // lwo_grads_zero first (false: the caller has, e.g. before a barrier)
  lwo_engine* check_engine = nullptr;  // lwo_engine_check after the timed part
  uint32_t passes = 1;      // schedule passes per step (reset and run each), one zero and one wait
  bool edges = false;       // time the start, the turn and the end (StepStats::start_ms...)
  // An event before and after each position's calls, for
  // StepStats::stall_ms (two cudaEventRecord per position).
  bool stalls = false;
  // Called after the untimed part (the zeroing, the counters read), just
  // before the timing starts: e.g. a barrier of ranks that step together.
  std::function<void()> before_start;
  // Called once every record's work (and every lwo_grads_end) is enqueued,
  // before the step waits for anything: e.g. lwo_optim_step.
  std::function<void()> after_enqueue;
};

// The schedule order of a pass over n records.
std::vector<uint32_t> step_order(uint32_t n_records, bool backward);

// One step: lwo_grads_zero (untimed; zero_grads), then timed from the first
// lwo_schedule_reset to the return of lwo_grads_wait and the stream's
// synchronisation, `passes` passes of the schedule: each lwo_schedule_next
// must give the next record of step_order. A failure throws.
StepStats run_step(lwo_schedule* schedule, lwo_ring* ring, lwo_grads* grads, cudaStream_t stream,
                   uint32_t n_records, const StepOptions& options, const StepCalls& calls);

// --- the chain on the device ----------------------------------------------------------

// The outcome of ChainRun::compare_with_resident.
struct ChainCheck {
  bool same = true;
  std::string differs;  // " output input-gradient weight-gradient(record 0, w0)", "" when same
  std::string first;    // the first difference, in words ("" when same)
  std::string what;     // what was compared, a sentence
};

// How a step runs K micro-batches (each `rows` rows: a slice of the
// activations, all kept). kBatch: K passes of the schedule, each a whole
// forward and backward of one micro-batch, its gradients ended on their own
// (summed on the host). kLayer: one pass; each record runs all K micro-batches
// while it sits in its slot, the gradients summed in the slot
// (LWO_LINEAR_ACCUMULATE) and ended once.
enum class MicroOrder { kBatch, kLayer };
const char* micro_order_name(MicroOrder order);  // "batch", "layer"

class ChainRun {
 public:
  // Activations x_0 .. x_N (all kept for the backward pass), the output
  // gradient dy_N and two ping-pong gradient buffers, for `micro_batches`
  // micro-batches of `rows` rows (tokens, or images) on `stream`; x_0 and dy_N
  // filled. `trainable`: backward passes compute weight gradients in `wire`
  // (f32, or the chain's dtype: the dtype of the grads' slots).
  ChainRun(const ChainWeights& weights, int64_t rows, cudaStream_t stream, bool trainable = true,
           lwo_dtype_t wire = LWO_DTYPE_F32, uint32_t micro_batches = 1,
           MicroOrder order = MicroOrder::kBatch);
  ChainRun(const ChainRun&) = delete;
  ChainRun& operator=(const ChainRun&) = delete;

  int64_t rows() const { return rows_; }  // of one micro-batch
  uint32_t micro_batches() const { return micro_; }
  MicroOrder order() const { return order_; }
  uint32_t passes() const { return order_ == MicroOrder::kBatch ? micro_ : 1; }  // per step
  cudaStream_t stream() const { return stream_; }
  uint64_t act_bytes(int64_t width) const;  // one micro-batch's activation of `width`
  void* x(uint32_t i) const { return act_[i].get(); }
  const void* dy_in(uint32_t i) const;  // the gradient op i's backward reads
  void* dx_out(uint32_t i) const;       // ... and writes its dx into (dy_in(i - 1))
  uint64_t output_bytes() const;        // x_N, every micro-batch
  float dy_bound() const;               // 1 / sqrt(rows): dy_N's values lie within +-it
  uint64_t input_bytes() const;         // x_0, dx_0, every micro-batch

  // Every record resident (make_resident): the same calls as a streamed step
  // (every pass of it), weight gradients into device buffers. With events,
  // fwd_ms and bwd_ms too (summed over the passes). after_pass(p), if given,
  // runs after pass p's backward is enqueued.
  PassTimes resident_pass(bool backward, bool events = false,
                          const std::function<void(uint32_t pass)>& after_pass = {});
  // Each record's compute, every record resident: `repeats`
  // resident passes (the same calls as resident_pass, weight gradients into
  // device buffers) with an event between every two records; per record the
  // median over the passes of its forward and (backward) its backward, in
  // ms, summed over a step's passes. bwd_ms is empty without backward.
  struct RecordTimes {
    std::vector<double> fwd_ms, bwd_ms;
  };
  RecordTimes resident_record_times(bool backward, uint32_t repeats);
  // Record r's forward (every micro-batch) enqueued on the stream from
  // `tensors`: a ring's view of the record, or resident_tensors(r). The
  // calls of every pass above, for callers that drive (or capture) a pass
  // themselves.
  void forward(uint32_t r, const void* const* tensors) const {
    forward_record(r, tensors, 0, micro_);
  }
  // Record r's resident tensors (make_resident), in a view's order.
  std::vector<const void*> resident_tensors(uint32_t r);
  // A streamed step through `ring` by `schedule` (made over step_order):
  // passes() passes (options.passes is set from it); `grads` null in a
  // backward pass: frozen.
  StepStats streamed_pass(lwo_schedule* schedule, lwo_ring* ring, lwo_grads* grads,
                          const StepOptions& options);
  // One training step's calls, enqueued only (no wait, no statistics, no
  // allocation: the body a capture holds; one pass, so passes() must be 1):
  // `schedule` (over step_order(R, true)) reset and driven to its LWO_END,
  // each record's forward, then each record's backward, its weight gradients
  // between lwo_grads_begin and lwo_grads_end of `grads` (null: a frozen
  // backward). A failure throws.
  void enqueue_streamed_step(lwo_schedule* schedule, lwo_grads* grads);
  // The same calls on the resident records (make_resident), the weight
  // gradients into device buffers as resident_pass, enqueued only (the
  // buffers are made on the first call: make it outside a capture).
  void enqueue_resident_step();
  // Compares what the last streamed pass left (the output; with backward the
  // input gradient and, with grads, the host gradients of the first and the
  // last record) bit for bit with the resident computation, recomputed now:
  // the whole chain when every record is resident, else (records of one op)
  // the last record's forward and the first and last records' backward from
  // the streamed pass's own inputs. Waits for the stream.
  ChainCheck compare_with_resident(lwo_grads* grads, bool backward);

 private:
  // Micro-batch k's part of an activation buffer of `width` features.
  void* slice(const DeviceMem& buf, int64_t width, uint32_t k) const;
  const void* dy_slice(uint32_t i, uint32_t k) const;
  void* dx_slice(uint32_t i, uint32_t k) const;
  void forward_op(uint32_t i, const void* w, const void* b, uint32_t k) const;
  // accumulate: add the weight gradients to dw and db (LWO_LINEAR_ACCUMULATE).
  void backward_op(uint32_t i, const void* w, void* dx, void* dw, void* db, uint32_t k,
                   bool accumulate) const;
  // t: a record's tensors (per op its weight, or weight and bias); g: their
  // gradients in the same order (null: frozen). Micro-batches [k0, k1).
  void forward_record(uint32_t r, const void* const* t, uint32_t k0, uint32_t k1) const;
  void backward_record(uint32_t r, const void* const* t, void* const* g,
                       const std::function<void()>& done, uint32_t k0, uint32_t k1) const;
  // The micro-batches of pass p.
  uint32_t pass_first(uint32_t p) const { return order_ == MicroOrder::kBatch ? p : 0; }
  uint32_t pass_end(uint32_t p) const { return order_ == MicroOrder::kBatch ? p + 1 : micro_; }
  void resident_views(uint32_t r, std::vector<const void*>& t, std::vector<void*>& g, bool grads);
  void ensure_grad_buffers();

  const ChainWeights& weights_;
  const ChainSpec& spec_;
  int64_t rows_;
  cudaStream_t stream_;
  bool trainable_;
  lwo_dtype_t wire_;
  uint32_t micro_;
  MicroOrder order_;
  std::vector<DeviceMem> act_;
  DeviceMem dy_last_, dbuf_[2];
  DeviceMem grad_first_, grad_last_, grad_scratch_;  // resident weight gradients
  std::vector<lwo_linear_desc> lin_, lin_acc_;   // plain, and with LWO_LINEAR_ACCUMULATE
  std::vector<lwo_conv2d_desc> conv_, conv_acc_;
};

// n elements compared bit for bit: "" when equal, else "WHAT differs from the
// resident reference at element E (row R, col C): streamed V (0x..), resident V
// (0x..); K of N elements differ". `cols` names rows and columns.
std::string compare_bits(const std::string& what, const void* got, const void* want, uint64_t n,
                         lwo_dtype_t dtype, int64_t cols);

// bytes of device memory copied back (after a synchronisation of the caller's).
std::vector<uint8_t> copy_back(const void* device, uint64_t bytes);

}  // namespace testkit
