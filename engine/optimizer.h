// The optimizer over a pool and its gradient set (lwo_optim):
// f32 master weights and state (f32 or bf16) for every trainable tensor, in
// host memory first touched by the threads that update it; each step updates
// each layer as soon as its gradients have landed, on the optimizer's host
// threads, while the backward pass continues on the GPU, and writes the
// weights into the pool rounded to its dtype.
//
// Ordering (no CUDA host function waits on the host, so no driver thread is
// ever blocked):
//   step():    for every layer with a gradient ended since the last step,
//              mark it pending and bump the pool's version of it (so no ring
//              reuses a slot with the old bytes), then hand the list, in the
//              order the layers were ended, to the dispatcher thread.
//   dispatch:  per layer: Grads::wait_landed (the layer's gradient-stream
//              event, then the host addition), update on the workers, clear
//              pending (without clipping) and wake the waiters. The next
//              layer is the lowest of those landed (Grads::landed), or the
//              next to land if none has: once the backward pass is over the
//              rest go in ascending order, the order the next forward
//              stages them.
//   stage:     Ring::stage of a pending layer blocks the calling thread
//              until it is no longer pending (Pool::Writer); then it copies.
//   begin:     Grads::begin of a pending layer does the same (Grads::Reader):
//              no new gradient lands under an update reading the old one;
//              Grads::wait waits the same way before it zeroes a layer
//              lazily (so lwo_grads_zero does not wait for the whole step).
// Clipping by global norm: every layer is updated speculatively with scale 1
// as it lands, from the state it had before the step into a second copy of
// the masters and state; once every layer has landed the norm (the sum of
// the layers' sums of squares, in layer order) gives the scale; where it is
// below 1 every layer is redone from the saved copy with it. Layers stay
// pending until then.
// Delayed (LWO_OPTIM_DELAYED): the pool lags the masters by one step. Each
// tensor keeps the rounded weights of the last update beside the pool
// ("next"); as a layer lands the dispatcher copies its next weights into the
// pool (what the forward of the coming step reads: the weights before this
// step's update) and clears pending; once every layer has landed it runs the
// updates, which write masters, state and next, while the GPU goes on with
// the next step's forward. A layer is read (Grads::Reader) until its update
// is done. wait() writes next into the pool (the pool then equals the
// masters' rounding).
// fp8 block-128 tensors (the one quantized format that trains): the masters
// start as the record dequantized to f32; each update writes the record's
// codes and scales from the updated masters in the same pass (next holds a
// whole record where delayed), so the pool holds exactly what lwo_quantize
// writes from the masters, under the same pending / changed fences as a
// dense tensor's rounding.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "grads.h"
#include "pool.h"
#include "src/common/thread_pool.h"
#include "src/optim/optim.h"
#include "src/optim/workers.h"
#include "src/quant/quant.h"

namespace lwo {

class Optimizer final : public Pool::Writer, public Grads::Reader {
 public:
  // The validated lwo_optim_config and lwo_optim_step_params.
  struct Config {
    lwo_optim_kind_t kind = LWO_OPTIM_ADAMW;
    lwo_dtype_t state_dtype = LWO_DTYPE_F32;
    bool stochastic = false;
    bool clipping = false;
    bool delayed = false;
    uint32_t n_threads = 0;
    uint64_t seed = 0;
  };
  Optimizer(Grads& grads, const Config& config);
  ~Optimizer() override;  // waits for the step
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One set of hyperparameters per group (lwo_optim_step_groups; a tensor's
  // group is set_group's, 0 by default), its step number included; max_norm
  // and extra_sumsq are group 0's.
  // open: lwo_optim_step_open, a step that add() gives layers until close().
  void step(const lwo_optim_step_params* groups, uint32_t n_groups, bool open = false);
  void add(uint32_t layer);  // lwo_optim_step_add
  void close();              // lwo_optim_step_close
  void set_group(uint32_t layer, const char* name, uint32_t group);
  void wait();
  bool done();
  // Whole-tensor state access (lwo_optim_read / _write); LWO_ERR_BUSY while a
  // step runs.
  void read(uint32_t layer, const char* name, lwo_optim_state_t which, void* dst, uint64_t bytes);
  void write(uint32_t layer, const char* name, lwo_optim_state_t which, const void* src,
             uint64_t bytes);
  void info(lwo_optim_info* out);
  void stats(lwo_optim_stats* out);
  void check_destroyable();
  // The layers of the last step in the order they were updated (tests).
  std::vector<uint32_t> last_order();

  // Pool::Writer and Grads::Reader.
  void wait_layer(uint32_t layer) override;
  void wait_reading(uint32_t layer) override;
  void wait_all() override;

 private:
  struct Tensor {
    std::string name;
    uint64_t n = 0;
    void* weights = nullptr;  // the pool's bytes
    lwo_dtype_t weight_dtype = LWO_DTYPE_BF16;
    const void* grad = nullptr;
    lwo_dtype_t grad_dtype = LWO_DTYPE_F32;
    // Two sets where clipping is on (the state before the step is kept).
    float* master[2] = {nullptr, nullptr};
    void* m[2] = {nullptr, nullptr};
    void* v[2] = {nullptr, nullptr};
    uint64_t key = 0;
    void* next = nullptr;  // delayed: the last update's rounded weights
    uint32_t group = 0;    // its hyperparameters: the step's set of this index
    // An fp8 e4m3 block-128 tensor of the pool (quant, else LWO_QUANT_NONE):
    // `weights` is its record (codes, scales at layout.scale_offset), which
    // each update writes from the masters (fused, optim::Tensor::codes);
    // the masters start as its dequantization to f32.
    lwo_quant_format_t quant = LWO_QUANT_NONE;
    quant::Layout layout;
    uint64_t weight_bytes = 0;  // of the pool's tensor (and of next)
  };
  struct Layer {
    bool trainable = false;
    bool pending = false;        // the pool's bytes are not yet the step's
    bool reading = false;        // an update still reads the layer's gradients
    bool dirty = false;          // delayed: next is newer than the pool
    int cur = 0;                 // the set that holds the state
    uint64_t used_serial = 0;    // the end serial of the last step's update
    bool taken = false;          // given to the open step: no further gradient until close
    std::vector<Tensor> tensors;
    void* block = nullptr;       // the mapping that holds the masters and state
    uint64_t block_bytes = 0;
    double sumsq = 0;            // this step's sum of squares (clipping)
  };
  struct Job {
    uint32_t layer;
    uint64_t serial;
  };
  void dispatch();                    // the dispatcher thread's loop
  using Groups = std::vector<lwo_optim_step_params>;
  void run_step(const std::vector<Job>& jobs, const Groups& g);
  void run_open(const Groups& g);  // an open step's jobs, in the order given
  Job take(uint32_t layer, const char* call);  // under mu_: a job, its layer marked
  void update(Layer& l, uint32_t li, const Groups& g, float scale, int from, int to);
  void publish_next(Layer& l);  // delayed: next -> the pool
  Tensor& tensor_of(uint32_t layer, const char* name);
  void* state_of(Tensor& t, uint32_t layer, const char* name, lwo_optim_state_t which,
                 uint64_t bytes, const void* buf, const char* buf_name,
                 const char* call);  // under mu_
  void check_idle(const char* what);  // under mu_

  Grads& grads_;
  Pool& pool_;
  Config cfg_;
  optim::Workers workers_;
  std::vector<Layer> layers_;
  uint64_t n_params_ = 0, state_bytes_ = 0;
  HostCharge state_charge_;  // state_bytes_ on the engine's host budget

  std::mutex mu_;
  std::condition_variable cv_;
  bool running_ = false;  // a step is armed and not finished
  bool stop_ = false;
  bool have_job_ = false;
  bool open_ = false;     // the running step takes more layers (add) until close
  std::vector<Job> jobs_;  // an open step's grow under mu_
  Groups params_;  // the running or last step's, one per group
  uint64_t last_step_ = 0;
  std::string async_error_;
  // Statistics.
  uint64_t n_steps_ = 0, n_layer_updates_ = 0, n_params_updated_ = 0, n_clipped_ = 0,
           n_redone_ = 0;
  uint64_t update_ns_ = 0, landing_wait_ns_ = 0, last_step_ns_ = 0, last_tail_ns_ = 0;
  double last_norm_ = 0;
  std::vector<uint32_t> order_;  // the running or last step's update order
  // Last: started (a thread of the engine's pool, ThreadPool::start) once
  // everything else is built.
  HostThread dispatcher_;
};

}  // namespace lwo
