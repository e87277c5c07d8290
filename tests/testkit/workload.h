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
  uint64_t h2d_bytes = 0, h2d_fwd_bytes = 0;  // ring copies; in the forward half (half_stats)
  uint64_t copies = 0, hits = 0, stages = 0;
  uint64_t d2h_bytes = 0, d2h_transfers = 0;  // lwo_grads
  double copy_ms = 0, wait_ms = 0;            // rings created with LWO_RING_TIMING
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

// --- the streamed step's driver -------------------------------------------------------

// What a record does in a streamed pass. `w` is the record's slot. backward
// gets the lwo_grads_begin view `g` (null: frozen, dx only) and calls done()
// once every weight gradient of the record is enqueued, before the last dx
// (it calls lwo_grads_end).
struct StepCalls {
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
  // Called after the untimed part (the zeroing, the counters read), just
  // before the timing starts: e.g. a barrier of ranks that step together.
  std::function<void()> before_start;
};

// The schedule order of a pass over n records.
std::vector<uint32_t> step_order(uint32_t n_records, bool backward);

// One pass: lwo_grads_zero (untimed; zero_grads), then timed from lwo_schedule_reset to
// the return of lwo_grads_wait and the stream's synchronisation: each
// lwo_schedule_next must give the next record of step_order. A failure throws.
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

class ChainRun {
 public:
  // Activations x_0 .. x_N (all kept for the backward pass), the output
  // gradient dy_N and two ping-pong gradient buffers, for `rows` rows (tokens,
  // or images) on `stream`; x_0 and dy_N filled. `trainable`: backward passes
  // compute weight gradients in `wire` (f32, or the chain's dtype).
  ChainRun(const ChainWeights& weights, int64_t rows, cudaStream_t stream, bool trainable = true,
           lwo_dtype_t wire = LWO_DTYPE_F32);
  ChainRun(const ChainRun&) = delete;
  ChainRun& operator=(const ChainRun&) = delete;

  int64_t rows() const { return rows_; }
  cudaStream_t stream() const { return stream_; }
  uint64_t act_bytes(int64_t width) const;  // one activation of `width` features or channels
  void* x(uint32_t i) const { return act_[i].get(); }
  const void* dy_in(uint32_t i) const;  // the gradient op i's backward reads
  void* dx_out(uint32_t i) const;       // ... and writes its dx into (dy_in(i - 1))
  uint64_t output_bytes() const;        // x_N
  float dy_bound() const;               // 1 / sqrt(rows): dy_N's values lie within +-it
  uint64_t input_bytes() const;         // x_0, dx_0

  // Every record resident (make_resident): the same calls as a streamed pass,
  // weight gradients into device buffers. With events, fwd_ms and bwd_ms too.
  PassTimes resident_pass(bool backward, bool events = false);
  // A streamed pass through `ring` by `schedule` (made over step_order);
  // `grads` null in a backward pass: frozen.
  StepStats streamed_pass(lwo_schedule* schedule, lwo_ring* ring, lwo_grads* grads,
                          const StepOptions& options);
  // Compares what the last streamed pass left (the output; with backward the
  // input gradient and, with grads, the host gradients of the first and the
  // last record) bit for bit with the resident computation, recomputed now:
  // the whole chain when every record is resident, else (records of one op)
  // the last record's forward and the first and last records' backward from
  // the streamed pass's own inputs. Waits for the stream.
  ChainCheck compare_with_resident(lwo_grads* grads, bool backward);

 private:
  void forward_op(uint32_t i, const void* w, const void* b) const;
  void backward_op(uint32_t i, const void* w, void* dx, void* dw, void* db) const;
  // t: a record's tensors (per op its weight, or weight and bias); g: their
  // gradients in the same order (null: frozen).
  void forward_record(uint32_t r, const void* const* t) const;
  void backward_record(uint32_t r, const void* const* t, void* const* g,
                       const std::function<void()>& done) const;
  void resident_views(uint32_t r, std::vector<const void*>& t, std::vector<void*>& g, bool grads);
  void ensure_grad_buffers();

  const ChainWeights& weights_;
  const ChainSpec& spec_;
  int64_t rows_;
  cudaStream_t stream_;
  bool trainable_;
  lwo_dtype_t wire_;
  std::vector<DeviceMem> act_;
  DeviceMem dy_last_, dbuf_[2];
  DeviceMem grad_first_, grad_last_, grad_scratch_;  // resident weight gradients
  std::vector<lwo_linear_desc> lin_;
  std::vector<lwo_conv2d_desc> conv_;
};

// n elements compared bit for bit: "" when equal, else "WHAT differs from the
// resident reference at element E (row R, col C): streamed V (0x..), resident V
// (0x..); K of N elements differ". `cols` names rows and columns.
std::string compare_bits(const std::string& what, const void* got, const void* want, uint64_t n,
                         lwo_dtype_t dtype, int64_t cols);

// bytes of device memory copied back (after a synchronisation of the caller's).
std::vector<uint8_t> copy_back(const void* device, uint64_t bytes);

}  // namespace testkit
