#include "optimizer.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <queue>

#include "src/common/dtype.h"
#include "src/common/error.h"

namespace lwo {
namespace {

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

constexpr uint64_t kPage = 4096;

const char* state_name(lwo_optim_state_t w) {
  switch (w) {
    case LWO_OPTIM_MASTER: return "master";
    case LWO_OPTIM_M: return "first moment";
    case LWO_OPTIM_V: return "second moment";
    default: return "unknown";
  }
}

}  // namespace

Optimizer::Optimizer(Grads& grads, const Config& config)
    : grads_(grads),
      pool_(grads.pool()),
      cfg_(config),
      workers_(pool_.engine().threads(), config.n_threads) {
  // A sharded pool: this rank updates its shard of every tensor (the
  // elements of lwo_pool_shard_tensor, from the same elements of the
  // gradient, summed over the ranks: lwo_grads_shard).
  const bool sharded = pool_.kind() == LWO_POOL_SHARDED;
  if (sharded && pool_.n_ranks() > 1 && (cfg_.clipping || cfg_.stochastic))
    fail(LWO_ERR_UNSUPPORTED,
         "the pool is sharded over %d ranks: %s needs %s, which a rank's shard does not give",
         pool_.n_ranks(), cfg_.clipping ? "LWO_OPTIM_CLIPPING" : "LWO_OPTIM_STOCHASTIC_ROUNDING",
         cfg_.clipping ? "the norm of every rank's gradients"
                       : "each element's place in the whole tensor");
  if (!sharded && pool_.kind() != LWO_POOL_PINNED && pool_.kind() != LWO_POOL_REGISTERED)
    fail(LWO_ERR_UNSUPPORTED, "the pool is a checkpoint's mapped files (kind %d), read-only: "
         "the optimizer writes the weights (use a pinned or registered pool)", pool_.kind());
  const size_t ss = dtype_size(cfg_.state_dtype);
  const int sets = cfg_.clipping ? 2 : 1;
  const bool adam = cfg_.kind == LWO_OPTIM_ADAMW;
  layers_.resize(pool_.n_layers());
  uint64_t charged = 0;  // on the engine's host budget
  try {
    for (uint32_t li = 0; li < pool_.n_layers(); ++li) {
      Layer& l = layers_[li];
      l.trainable = grads_.trainable(li);
      if (!l.trainable) continue;
      const RecordLayout& rl = pool_.layer(li).layout;
      const std::vector<Grads::HostTensor> g =
          sharded ? std::vector<Grads::HostTensor>() : grads_.whole_layer(li);
      uint64_t bytes = 0;
      for (uint32_t ti = 0; ti < rl.tensors.size(); ++ti) {
        const TensorLayout& tl = rl.tensors[ti];
        Tensor t;
        t.name = tl.name;
        t.weight_dtype = tl.dtype;
        if (sharded) {
          uint64_t first = 0, gfirst = 0, gn = 0;
          pool_.shard_tensor(li, ti, &t.weights, &first, &t.n);
          t.grad = grads_.tensor(li, tl.name.c_str(), &t.grad_dtype, &gfirst, &gn);
          if (gn != t.n || (t.n && gfirst != first))
            fail(LWO_ERR_INTERNAL,
                 "layer %u tensor '%s': the weight shard holds elements [%llu, +%llu), the "
                 "gradient shard [%llu, +%llu)", li, tl.name.c_str(),
                 static_cast<unsigned long long>(first), static_cast<unsigned long long>(t.n),
                 static_cast<unsigned long long>(gfirst), static_cast<unsigned long long>(gn));
        } else if (tl.quant != LWO_QUANT_NONE) {
          if (tl.quant != LWO_QUANT_FP8_E4M3_BLOCK128)  // lwo_grads_create refuses them
            fail(LWO_ERR_QUANTIZED_WEIGHT,
                 "layer %u tensor '%s' is quantized (%s): only fp8_e4m3_block128 tensors train",
                 li, tl.name.c_str(), quant::format_name(tl.quant));
          t.quant = tl.quant;
          t.layout = quant::layout_of(tl.quant, tl.dtype, tl.shape[0], tl.shape[1]);
          t.n = static_cast<uint64_t>(tl.shape[0]) * static_cast<uint64_t>(tl.shape[1]);
          pool_.tensor_host(li, ti, &t.weights, nullptr);
          t.grad = g[ti].data;
          t.grad_dtype = g[ti].dtype;
        } else {
          t.n = tl.bytes / dtype_size(tl.dtype);
          pool_.tensor_host(li, ti, &t.weights, nullptr);
          t.grad = g[ti].data;
          t.grad_dtype = g[ti].dtype;
        }
        t.weight_bytes = t.quant != LWO_QUANT_NONE ? tl.bytes : t.n * dtype_size(t.weight_dtype);
        t.key = optim::tensor_key(cfg_.seed, li, ti);
        bytes += sets * (align_up(t.n * 4, kPage) + align_up(t.n * ss, kPage) * (adam ? 2 : 1));
        if (cfg_.delayed) bytes += align_up(t.weight_bytes, kPage);
        n_params_ += t.n;
        l.tensors.push_back(t);
      }
      if (bytes) {
        pool_.engine().charge_host(bytes, strf("layer %u: optimizer state", li).c_str());
        charged += bytes;
        // No page exists until a worker first touches it.
        void* p = optim::map_state(bytes, strf("layer %u: optimizer state", li).c_str());
        l.block = p;
        l.block_bytes = bytes;
        state_bytes_ += bytes;
        uint8_t* at = static_cast<uint8_t*>(p);
        for (Tensor& t : l.tensors)
          for (int s = 0; s < sets; ++s) {
            t.master[s] = reinterpret_cast<float*>(at);
            at += align_up(t.n * 4, kPage);
            t.m[s] = at;
            at += align_up(t.n * ss, kPage);
            if (adam) {
              t.v[s] = at;
              at += align_up(t.n * ss, kPage);
            }
            void* state[2] = {t.m[s], t.v[s]};
            const bool q = t.quant != LWO_QUANT_NONE;
            optim::first_touch(t.master[s], q ? nullptr : t.weights, t.weight_dtype, t.n, state,
                               adam ? 2 : 1, cfg_.state_dtype, workers_);
            // A quantized record's masters: code x its block's scale, in f32.
            if (q)
              quant::dequantize(t.layout, t.weights, t.master[s], LWO_DTYPE_F32, workers_.size());
          }
        if (cfg_.delayed)
          for (Tensor& t : l.tensors) {
            t.next = at;
            at += align_up(t.weight_bytes, kPage);
            std::memcpy(t.next, t.weights, t.weight_bytes);
          }
      }
    }
  } catch (...) {
    for (Layer& l : layers_)
      optim::unmap_state(l.block, l.block_bytes);
    pool_.engine().uncharge_host(charged);
    throw;
  }
  state_charge_ = HostCharge::adopt(pool_.engine(), charged);
  grads_.attach(this);  // throws LWO_ERR_BUSY if the set has an optimizer
  pool_.writer.store(this);
  dispatcher_ = pool_.engine().threads().start([this] { dispatch(); });
}

Optimizer::~Optimizer() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !running_; });
    stop_ = true;
  }
  cv_.notify_all();
  dispatcher_.join();
  pool_.writer.store(nullptr);
  grads_.attach(nullptr);
  for (Layer& l : layers_)
    optim::unmap_state(l.block, l.block_bytes);
}

void Optimizer::check_idle(const char* what) {
  if (open_)
    fail(LWO_ERR_BUSY, "%s: step %llu is open (lwo_optim_step_close first)", what,
         static_cast<unsigned long long>(last_step_));
  if (running_)
    fail(LWO_ERR_BUSY, "%s: step %llu is still running (lwo_optim_wait first)", what,
         static_cast<unsigned long long>(last_step_));
}

// A step or an open step's add or close takes the layers' last gradient ends,
// which in a capture under way are ends that never land (the capture runs
// nothing): LWO_ERR_CAPTURING until it ends; step after each replay instead.
static void check_not_capturing(Grads& grads, const char* what) {
  grads.pool().engine().check_not_capturing(what);
}

void Optimizer::step(const lwo_optim_step_params* groups, uint32_t n_groups, bool open) {
  check_not_capturing(grads_, open ? "opening an optimizer step" : "an optimizer step");
  if (n_groups == 0) fail(LWO_ERR_INVALID_ARGUMENT, "n_groups is 0 (at least one set)");
  const bool adam = cfg_.kind == LWO_OPTIM_ADAMW;
  for (uint32_t gi = 0; gi < n_groups; ++gi) {
    const lwo_optim_step_params& p = groups[gi];
    auto bad = [&](const char* what, double x, const char* range) {
      if (n_groups > 1)
        fail(LWO_ERR_INVALID_ARGUMENT, "group %u: %s %g is outside %s", gi, what, x, range);
      fail(LWO_ERR_INVALID_ARGUMENT, "%s %g is outside %s", what, x, range);
    };
    if (p.step == 0) bad("step", 0, "[1, inf) (the first step is 1)");
    if (!(std::isfinite(p.lr) && p.lr >= 0)) bad("lr", p.lr, "[0, inf)");
    if (!(std::isfinite(p.weight_decay) && p.weight_decay >= 0))
      bad("weight_decay", p.weight_decay, "[0, inf)");
    if (adam) {
      if (!(p.beta1 >= 0 && p.beta1 < 1)) bad("beta1", p.beta1, "[0, 1)");
      if (!(p.beta2 >= 0 && p.beta2 < 1)) bad("beta2", p.beta2, "[0, 1)");
      if (!(std::isfinite(p.eps) && p.eps > 0)) bad("eps", p.eps, "(0, inf)");
    } else {
      if (!(std::isfinite(p.momentum) && p.momentum >= 0)) bad("momentum", p.momentum, "[0, inf)");
      if (!(p.dampening >= 0 && p.dampening <= 1)) bad("dampening", p.dampening, "[0, 1]");
    }
    if (!(std::isfinite(p.max_norm) && p.max_norm >= 0)) bad("max_norm", p.max_norm, "[0, inf)");
    if (!(std::isfinite(p.extra_sumsq) && p.extra_sumsq >= 0))
      bad("extra_sumsq", p.extra_sumsq, "[0, inf)");
    if (p.max_norm > 0 && !cfg_.clipping)
      fail(LWO_ERR_INVALID_ARGUMENT, "max_norm %g, but the optimizer was created without "
           "LWO_OPTIM_CLIPPING (it keeps no copy of the state to redo a clipped step from)",
           p.max_norm);
  }
  const lwo_optim_step_params& p = groups[0];
  if (open && p.max_norm > 0)
    fail(LWO_ERR_UNSUPPORTED, "max_norm %g: an open step updates each layer as it is added, "
         "before the global norm is known (clip with lwo_optim_step_groups)", p.max_norm);
  if (open && cfg_.delayed)
    fail(LWO_ERR_UNSUPPORTED, "the optimizer is LWO_OPTIM_DELAYED: its updates run after "
         "every layer has landed, which an open step does not know before its close");
  std::vector<Job> jobs;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Delayed: the previous step's updates run through the next forward and
    // backward; this step starts after them.
    if (cfg_.delayed) cv_.wait(lock, [&] { return !running_; });
    check_idle("lwo_optim_step");
    for (uint32_t li = 0; li < layers_.size(); ++li)
      for (const Tensor& t : layers_[li].tensors)
        if (t.group >= n_groups)
          fail(LWO_ERR_INVALID_ARGUMENT, "layer %u tensor '%.255s' is in group %u, but the "
               "step has %u set%s of hyperparameters", li, t.name.c_str(), t.group, n_groups,
               n_groups == 1 ? "" : "s");
    for (uint32_t li = 0; li < layers_.size(); ++li) {
      Layer& l = layers_[li];
      if (!l.trainable || l.tensors.empty()) continue;
      bool stale = false;
      const uint64_t serial = grads_.last_end(li, &stale);
      if (stale || serial == 0 || serial == l.used_serial) continue;  // no gradient since
      jobs.push_back({li, serial});
    }
    // In the order the layers were ended: the order they land.
    std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.serial < b.serial; });
    for (const Job& j : jobs) pool_.check_not_held(j.layer, "updating the layer");
    for (const Job& j : jobs) {
      layers_[j.layer].pending = true;
      layers_[j.layer].reading = true;
      layers_[j.layer].used_serial = j.serial;
      pool_.changed(j.layer);  // before any byte is written: no ring reuses the old copy
    }
    if (open)
      for (const Job& j : jobs) layers_[j.layer].taken = true;
    jobs_ = std::move(jobs);
    params_.assign(groups, groups + n_groups);
    last_step_ = p.step;
    running_ = true;
    have_job_ = true;
    open_ = open;
  }
  cv_.notify_all();
}

Optimizer::Job Optimizer::take(uint32_t layer, const char* call) {
  if (layer >= layers_.size())
    fail(LWO_ERR_OUT_OF_RANGE, "%s: layer %u is out of range (pool has %zu layers)", call, layer,
         layers_.size());
  Layer& l = layers_[layer];
  if (!l.trainable) fail(LWO_ERR_INVALID_ARGUMENT, "%s: layer %u is frozen", call, layer);
  bool stale = false;
  const uint64_t serial = grads_.last_end(layer, &stale);
  if (l.taken)
    fail(LWO_ERR_TICKET_STATE, "%s: layer %u is already in step %llu", call, layer,
         static_cast<unsigned long long>(last_step_));
  if (stale || serial == 0 || serial == l.used_serial)
    fail(LWO_ERR_TICKET_STATE, "%s: layer %u has no gradient ended (lwo_grads_end) since its "
         "last update or lwo_grads_zero", call, layer);
  pool_.check_not_held(layer, "updating the layer");
  l.pending = l.reading = l.taken = true;
  l.used_serial = serial;
  pool_.changed(layer);  // before any byte is written: no ring reuses the old copy
  return {layer, serial};
}

void Optimizer::add(uint32_t layer) {
  check_not_capturing(grads_, "adding a layer to the open step");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_)
      fail(LWO_ERR_TICKET_STATE, "no step is open (lwo_optim_step_open first; step %llu %s)",
           static_cast<unsigned long long>(last_step_), running_ ? "runs" : "has ended");
    jobs_.push_back(take(layer, "lwo_optim_step_add"));
  }
  cv_.notify_all();
}

void Optimizer::close() {
  check_not_capturing(grads_, "closing the open step");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_)
      fail(LWO_ERR_TICKET_STATE, "no step is open (step %llu %s)",
           static_cast<unsigned long long>(last_step_), running_ ? "runs" : "has ended");
    // The layers ended since their last update and not added: as
    // lwo_optim_step takes them, in the order they were ended.
    std::vector<Job> rest;
    for (uint32_t li = 0; li < layers_.size(); ++li) {
      const Layer& l = layers_[li];
      if (!l.trainable || l.tensors.empty() || l.taken) continue;
      bool stale = false;
      const uint64_t serial = grads_.last_end(li, &stale);
      if (!stale && serial != 0 && serial != l.used_serial) rest.push_back({li, serial});
    }
    std::sort(rest.begin(), rest.end(),
              [](const Job& a, const Job& b) { return a.serial < b.serial; });
    for (const Job& j : rest) pool_.check_not_held(j.layer, "updating the layer");  // before any
    for (const Job& j : rest) jobs_.push_back(take(j.layer, "lwo_optim_step_close"));
    for (const Job& j : jobs_) layers_[j.layer].taken = false;
    open_ = false;
  }
  cv_.notify_all();
}

void Optimizer::dispatch() {
  for (;;) {
    std::vector<Job> jobs;
    Groups p;
    bool open = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || have_job_; });
      if (!have_job_) return;
      have_job_ = false;
      open = open_;
      if (!open) jobs = jobs_;
      p = params_;
    }
    const uint64_t t0 = now_ns();
    std::string err;
    try {
      if (open)
        run_open(p);
      else
        run_step(jobs, p);
    } catch (const std::exception& e) {
      err = e.what();
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (open) jobs = jobs_;  // run_open returns after the close: every layer of the step
    for (const Job& j : jobs) layers_[j.layer].pending = layers_[j.layer].reading = false;
    if (!err.empty() && async_error_.empty()) async_error_ = err;
    last_step_ns_ = now_ns() - t0;
    ++n_steps_;
    running_ = false;
    cv_.notify_all();
  }
}

void Optimizer::publish_next(Layer& l) {
  // On the optimizer's threads, each copying the part it updates (the same
  // partition, so the same NUMA node): one thread moved about 5-10 GB/s,
  // and a delayed step of 32 x 128 MiB spent most of its time here.
  for (Tensor& t : l.tensors) {
    // A quantized record goes as bytes (codes, padding, scales).
    const bool q = t.quant != LWO_QUANT_NONE;
    const size_t es = q ? 1 : dtype_size(t.weight_dtype);
    auto* dst = static_cast<uint8_t*>(t.weights);
    const auto* src = static_cast<const uint8_t*>(t.next);
    workers_.run(q ? t.weight_bytes : t.n, optim::kAlign, optim::kMinPart, [&](uint64_t b, uint64_t e) {
      std::memcpy(dst + b * es, src + b * es, (e - b) * es);
    });
  }
  l.dirty = false;
}

std::vector<uint32_t> Optimizer::last_order() {
  std::lock_guard<std::mutex> lock(mu_);
  return order_;
}

void Optimizer::run_step(const std::vector<Job>& jobs, const Groups& g) {
  const lwo_optim_step_params& p = g[0];
  const bool clip = p.max_norm > 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    order_.clear();
  }
  uint64_t last_landed = now_ns();
  if (cfg_.delayed) {
    // As each layer lands (its last reader of the old bytes has read them),
    // the pool gets the weights of the previous update; then the updates.
    for (const Job& j : jobs) {
      Layer& l = layers_[j.layer];
      const uint64_t w0 = now_ns();
      grads_.wait_landed(j.layer, j.serial);
      last_landed = now_ns();
      publish_next(l);
      std::lock_guard<std::mutex> lock(mu_);
      landing_wait_ns_ += last_landed - w0;
      l.pending = false;
      cv_.notify_all();
    }
    for (const Job& j : jobs) {
      Layer& l = layers_[j.layer];
      {
        std::lock_guard<std::mutex> lock(mu_);
        order_.push_back(j.layer);
      }
      update(l, j.layer, g, 1.0f, l.cur, l.cur);
      std::lock_guard<std::mutex> lock(mu_);
      l.dirty = true;
      l.reading = false;
      cv_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    last_norm_ = 0;
    last_tail_ns_ = now_ns() - last_landed;
    return;
  }
  // The order of the updates: among the layers that have landed, the lowest
  // first; when none has, the next to land. While the backward pass runs
  // that is about the landing order; once it is over every layer has landed
  // and the rest go 0, 1, 2, ...: the order in which the next forward stages
  // them, so it can follow the update layer by layer instead of waiting for
  // layer 0, which lands last. The gradient stream and the host addition are
  // in order, so the landed jobs are a prefix of `jobs` (landing order):
  // `frontier` is its end, and each job is tested landed once it is there,
  // and again only while it is the frontier (a step asks O(layers) times).
  // last_landed: when every layer was first seen landed (checked between
  // updates, so up to one layer's update late).
  using Ready = std::pair<uint32_t, size_t>;  // (layer, index in jobs)
  std::priority_queue<Ready, std::vector<Ready>, std::greater<Ready>> ready;
  size_t frontier = 0, n_done = 0;
  bool all_landed = false;
  while (n_done < jobs.size()) {
    while (frontier < jobs.size() && grads_.landed(jobs[frontier].layer, jobs[frontier].serial)) {
      ready.push({jobs[frontier].layer, frontier});
      ++frontier;
    }
    if (frontier == jobs.size() && !all_landed) {
      all_landed = true;
      last_landed = now_ns();
    }
    size_t pick = frontier;  // none landed: the next to land, waited for below
    if (!ready.empty()) {
      pick = ready.top().second;
      ready.pop();
    } else {
      ++frontier;
    }
    const Job j = jobs[pick];
    const bool last = ++n_done == jobs.size();
    {
      std::lock_guard<std::mutex> lock(mu_);
      order_.push_back(j.layer);
    }
    Layer& l = layers_[j.layer];
    const uint64_t w0 = now_ns();
    grads_.wait_landed(j.layer, j.serial);
    if (last && !all_landed) {
      all_landed = true;
      last_landed = now_ns();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      landing_wait_ns_ += now_ns() - w0;
    }
    if (clip) {
      l.sumsq = 0;
      for (const Tensor& t : l.tensors)
        l.sumsq += optim::sum_squares(t.grad, t.grad_dtype, t.n, workers_);
      update(l, j.layer, g, 1.0f, l.cur, 1 - l.cur);  // speculative
    } else {
      update(l, j.layer, g, 1.0f, l.cur, l.cur);
      // The last layer is released with the end of the step (dispatch), so
      // that a caller its stage wakes finds the step finished.
      if (last) continue;
      std::lock_guard<std::mutex> lock(mu_);
      l.pending = l.reading = false;
      cv_.notify_all();
    }
  }
  if (clip) {
    // The global norm: the layers' sums in layer order (any landing order
    // and any threads give the same bits).
    std::vector<uint32_t> order;
    for (const Job& j : jobs) order.push_back(j.layer);
    std::sort(order.begin(), order.end());
    double sq = 0;
    for (uint32_t li : order) sq += layers_[li].sumsq;
    sq += p.extra_sumsq;  // the gradients held elsewhere
    const double norm = std::sqrt(sq);
    const float scale = optim::clip_scale(norm, p.max_norm);
    uint64_t redone = 0;
    if (scale < 1.0f)
      for (const Job& j : jobs) {
        Layer& l = layers_[j.layer];
        update(l, j.layer, g, scale, l.cur, 1 - l.cur);
        ++redone;
      }
    for (const Job& j : jobs) layers_[j.layer].cur ^= 1;
    std::lock_guard<std::mutex> lock(mu_);
    last_norm_ = norm;
    n_clipped_ += scale < 1.0f;
    n_redone_ += redone;
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    last_norm_ = 0;
  }
  std::lock_guard<std::mutex> lock(mu_);
  last_tail_ns_ = now_ns() - last_landed;
}

// An open step (no clipping, not delayed): each job as it was added (the
// order its gradients were ended, so the order they land), waited for as
// the dispatcher reaches it; then the next, waiting for add() or close().
// A failed update is reported at lwo_optim_wait; the rest of the step's
// layers are released unchanged as they come, so no stage waits forever.
void Optimizer::run_open(const Groups& g) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    order_.clear();
  }
  uint64_t last_landed = now_ns();
  std::string err;
  for (size_t next = 0;; ++next) {
    Job j;
    uint64_t w0 = now_ns();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return next < jobs_.size() || !open_; });
      if (next == jobs_.size()) break;  // closed, every layer taken
      j = jobs_[next];
      order_.push_back(j.layer);
    }
    Layer& l = layers_[j.layer];
    if (err.empty()) {
      try {
        grads_.wait_landed(j.layer, j.serial);
        last_landed = now_ns();
        {
          std::lock_guard<std::mutex> lock(mu_);
          landing_wait_ns_ += last_landed - w0;  // waiting for its add, then its landing
        }
        update(l, j.layer, g, 1.0f, l.cur, l.cur);
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    // The last layer is released with the end of the step (dispatch), as in
    // run_step.
    if (!open_ && next + 1 == jobs_.size()) break;
    l.pending = l.reading = false;
    cv_.notify_all();
  }
  std::lock_guard<std::mutex> lock(mu_);
  last_norm_ = 0;
  last_tail_ns_ = now_ns() - last_landed;
  if (!err.empty()) throw Error(LWO_ERR_INTERNAL, err);
}

void Optimizer::update(Layer& l, uint32_t li, const Groups& g, float scale, int from, int to) {
  const uint64_t t0 = now_ns();
  uint64_t n = 0;
  for (Tensor& t : l.tensors) {
    const lwo_optim_step_params& p = g[t.group];
    optim::Tensor ot;
    ot.n = t.n;
    ot.master = t.master[to];
    ot.m = t.m[to];
    ot.v = t.v[to];
    if (from != to) {
      ot.master_in = t.master[from];
      ot.m_in = t.m[from];
      ot.v_in = t.v[from];
    }
    ot.state_dtype = cfg_.state_dtype;
    ot.stochastic = cfg_.stochastic;
    ot.key = t.key;
    ot.grad = t.grad;
    ot.grad_dtype = t.grad_dtype;
    ot.grad_scale = scale;
    void* dst = cfg_.delayed ? t.next : t.weights;
    if (t.quant != LWO_QUANT_NONE) {  // the record, written from the masters in the same pass
      ot.quant_format = t.quant;
      ot.rows = t.layout.rows;
      ot.cols = t.layout.cols;
      ot.codes = static_cast<uint8_t*>(dst);
      ot.scales = reinterpret_cast<float*>(static_cast<uint8_t*>(dst) + t.layout.scale_offset);
    } else {
      ot.weights = dst;
    }
    ot.weight_dtype = t.weight_dtype;
    if (cfg_.kind == LWO_OPTIM_ADAMW) {
      optim::AdamW h;
      h.lr = p.lr;
      h.beta1 = p.beta1;
      h.beta2 = p.beta2;
      h.eps = p.eps;
      h.weight_decay = p.weight_decay;
      optim::adamw_step(ot, h, p.step, workers_);
    } else {
      optim::Sgd h;
      h.lr = p.lr;
      h.momentum = p.momentum;
      h.dampening = p.dampening;
      h.weight_decay = p.weight_decay;
      optim::sgd_step(ot, h, p.step, workers_);
    }
    n += t.n;
  }
  std::lock_guard<std::mutex> lock(mu_);
  update_ns_ += now_ns() - t0;
  ++n_layer_updates_;
  n_params_updated_ += n;
  (void)li;
}

void Optimizer::wait_layer(uint32_t layer) {
  std::unique_lock<std::mutex> lock(mu_);
  if (layer >= layers_.size()) return;
  cv_.wait(lock, [&] { return !layers_[layer].pending; });
}

void Optimizer::wait_reading(uint32_t layer) {
  std::unique_lock<std::mutex> lock(mu_);
  if (layer >= layers_.size()) return;
  // A new gradient of a layer the open step has taken would land after (or
  // under) the update that reads its sum.
  if (layers_[layer].taken)
    fail(LWO_ERR_TICKET_STATE, "layer %u is in the open step %llu (lwo_optim_step_add), whose "
         "update reads the gradients ended before: a further gradient of it belongs after "
         "lwo_optim_step_close", layer, static_cast<unsigned long long>(last_step_));
  cv_.wait(lock, [&] { return !layers_[layer].pending && !layers_[layer].reading; });
}

void Optimizer::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  if (open_)
    fail(LWO_ERR_BUSY, "the optimizer's step %llu is open (lwo_optim_step_close first)",
         static_cast<unsigned long long>(last_step_));
  cv_.wait(lock, [&] { return !running_; });
}

void Optimizer::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  if (open_)
    fail(LWO_ERR_BUSY, "step %llu is open: it ends after lwo_optim_step_close",
         static_cast<unsigned long long>(last_step_));
  cv_.wait(lock, [&] { return !running_; });
  // The pool catches up with the masters, but for a layer a caller's CUDA
  // graph holds resident (Pool::hold), which keeps its update until a later
  // wait.
  int64_t held = -1;
  if (cfg_.delayed)
    for (uint32_t li = 0; li < layers_.size(); ++li)
      if (layers_[li].dirty) {
        if (pool_.held(li)) {
          if (held < 0) held = li;
          continue;
        }
        publish_next(layers_[li]);
        pool_.changed(li);
      }
  if (!async_error_.empty()) {
    std::string e = async_error_;
    async_error_.clear();
    fail(LWO_ERR_INTERNAL, "the update of step %llu failed: %s",
         static_cast<unsigned long long>(last_step_), e.c_str());
  }
  if (held >= 0)
    fail(LWO_ERR_BUSY, "step %llu is done, but layer %lld's update stays in the masters: the "
         "layer is resident in a ring whose pass a CUDA graph the caller captured holds "
         "(lwo_ring_capture_join); lwo_optim_wait again after lwo_ring_capture_release",
         static_cast<unsigned long long>(last_step_), static_cast<long long>(held));
}

bool Optimizer::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return !running_;
}

void Optimizer::set_group(uint32_t layer, const char* name, uint32_t group) {
  std::lock_guard<std::mutex> lock(mu_);
  check_idle("lwo_optim_set_group");
  tensor_of(layer, name).group = group;
}

Optimizer::Tensor& Optimizer::tensor_of(uint32_t layer, const char* name) {
  if (layer >= layers_.size())
    fail(LWO_ERR_OUT_OF_RANGE, "layer %u is out of range (pool has %zu layers)", layer,
         layers_.size());
  if (!name) fail(LWO_ERR_INVALID_ARGUMENT, "name is NULL");
  Layer& l = layers_[layer];
  if (!l.trainable) fail(LWO_ERR_INVALID_ARGUMENT, "layer %u is frozen: it has no optimizer state", layer);
  for (Tensor& t : l.tensors)
    if (t.name == name) return t;
  fail(LWO_ERR_NOT_FOUND, "layer %u has no tensor named '%.255s'", layer, name);
}

namespace {
void check_state_access(lwo_optim_kind_t kind, lwo_optim_state_t which, uint64_t want,
                        uint64_t bytes, uint32_t layer, const char* name) {
  if (which != LWO_OPTIM_MASTER && which != LWO_OPTIM_M && which != LWO_OPTIM_V)
    fail(LWO_ERR_INVALID_ARGUMENT, "state %d is not LWO_OPTIM_MASTER, _M or _V", which);
  if (which == LWO_OPTIM_V && kind != LWO_OPTIM_ADAMW)
    fail(LWO_ERR_INVALID_ARGUMENT, "LWO_OPTIM_V: SGD keeps no second moment");
  if (bytes != want)
    fail(LWO_ERR_SIZE_MISMATCH, "layer %u tensor '%.255s' %s: %llu bytes given, it holds %llu",
         layer, name, state_name(which), static_cast<unsigned long long>(bytes),
         static_cast<unsigned long long>(want));
}
}  // namespace

// The state `which` of t (layer `layer`, tensor `name`) that `call` reads or
// writes through buf (named buf_name), bytes long: checked against the
// state's size, buf, and the optimizer being idle.
void* Optimizer::state_of(Tensor& t, uint32_t layer, const char* name, lwo_optim_state_t which,
                          uint64_t bytes, const void* buf, const char* buf_name, const char* call) {
  const uint64_t want = t.n * (which == LWO_OPTIM_MASTER ? 4 : dtype_size(cfg_.state_dtype));
  check_state_access(cfg_.kind, which, want, bytes, layer, name);
  if (bytes && !buf) fail(LWO_ERR_INVALID_ARGUMENT, "%s is NULL", buf_name);
  check_idle(call);
  const int c = layers_[layer].cur;
  return which == LWO_OPTIM_MASTER ? static_cast<void*>(t.master[c])
         : which == LWO_OPTIM_M    ? t.m[c]
                                   : t.v[c];
}

void Optimizer::read(uint32_t layer, const char* name, lwo_optim_state_t which, void* dst,
                     uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Tensor& t = tensor_of(layer, name);
  const void* src = state_of(t, layer, name, which, bytes, dst, "dst", "lwo_optim_read");
  if (bytes) std::memcpy(dst, src, bytes);
}

void Optimizer::write(uint32_t layer, const char* name, lwo_optim_state_t which, const void* src,
                      uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Tensor& t = tensor_of(layer, name);
  void* dst = state_of(t, layer, name, which, bytes, src, "src", "lwo_optim_write");
  if (which == LWO_OPTIM_MASTER) pool_.check_not_held(layer, "writing the layer's master");
  if (which == LWO_OPTIM_MASTER && t.quant != LWO_QUANT_NONE) {
    // Quantized first: a NaN or infinite master (which quantization refuses)
    // leaves the masters and the pool as they were.
    try {
      quant::quantize(t.layout, src, LWO_DTYPE_F32, t.weights, workers_.size());
    } catch (const Error& e) {
      fail(e.status(), "layer %u tensor '%.255s' is %s: its masters: %s", layer, name,
           quant::format_name(t.quant), e.what());
    }
  }
  if (bytes) std::memcpy(dst, src, bytes);
  const int c = layers_[layer].cur;
  if (which == LWO_OPTIM_MASTER) {
    if (t.quant == LWO_QUANT_NONE)
      store_rounded(t.weights, t.weight_dtype, 0, t.master[c], t.n, false);
    if (t.next) std::memcpy(t.next, t.weights, t.weight_bytes);
    pool_.changed(layer);
  }
}

void Optimizer::info(lwo_optim_info* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->kind = cfg_.kind;
  out->state_dtype = cfg_.state_dtype;
  out->flags = (cfg_.stochastic ? LWO_OPTIM_STOCHASTIC_ROUNDING : 0u) |
               (cfg_.clipping ? LWO_OPTIM_CLIPPING : 0u) | (cfg_.delayed ? LWO_OPTIM_DELAYED : 0u);
  out->n_threads = workers_.size();
  out->n_numa_nodes = workers_.n_nodes();
  out->n_params = n_params_;
  out->state_bytes = state_bytes_;
  out->last_step = last_step_;
  out->vector_level = optim::vector_level();
}

void Optimizer::stats(lwo_optim_stats* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->n_steps = n_steps_;
  out->n_layer_updates = n_layer_updates_;
  out->n_params_updated = n_params_updated_;
  out->update_ns = update_ns_;
  out->landing_wait_ns = landing_wait_ns_;
  out->last_step_ns = last_step_ns_;
  out->last_tail_ns = last_tail_ns_;
  out->n_clipped = n_clipped_;
  out->n_redone = n_redone_;
  out->last_norm = last_norm_;
}

void Optimizer::check_destroyable() {
  std::lock_guard<std::mutex> lock(mu_);
  if (open_)
    fail(LWO_ERR_BUSY, "step %llu is open (lwo_optim_step_close first)",
         static_cast<unsigned long long>(last_step_));
}

}  // namespace lwo
