#include "grads.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>

#include "src/common/error.h"

namespace lwo {
namespace {

float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0)
    v = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
  else if (exp == 31)
    v = man ? NAN : INFINITY;
  else
    v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  return sign ? -v : v;
}

// dst[i] (=|+=) convert(src[i]) for i in [b, e).
void convert_range(float* dst, const uint8_t* src, lwo_dtype_t wire, uint64_t b, uint64_t e,
                   bool assign) {
  switch (wire) {
    case LWO_DTYPE_F32: {
      const float* s = reinterpret_cast<const float*>(src);
      if (assign)
        std::memcpy(dst + b, s + b, (e - b) * 4);
      else
        for (uint64_t i = b; i < e; ++i) dst[i] += s[i];
      break;
    }
    case LWO_DTYPE_BF16: {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
      if (assign)
        for (uint64_t i = b; i < e; ++i) dst[i] = bf16_to_f32(s[i]);
      else
        for (uint64_t i = b; i < e; ++i) dst[i] += bf16_to_f32(s[i]);
      break;
    }
    default: {  // f16
      const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
      if (assign)
        for (uint64_t i = b; i < e; ++i) dst[i] = f16_to_f32(s[i]);
      else
        for (uint64_t i = b; i < e; ++i) dst[i] += f16_to_f32(s[i]);
      break;
    }
  }
}

}  // namespace

Grads::Grads(Pool& pool, const uint8_t* trainable, uint32_t depth, bool native_wire,
             uint32_t n_threads)
    : pool_(pool), engine_(pool.engine()), native_(native_wire), n_threads_(n_threads) {
  static const char* call = "lwo_grads_create";
  if (pool.comm() && native_)
    fail(LWO_ERR_UNSUPPORTED,
         "%s: the pool is sharded over %d ranks: its gradients are summed over the ranks in "
         "f32, so LWO_GRADS_NATIVE_WIRE is not supported", call, pool.n_ranks());
  layers_.resize(pool.n_layers());
  uint64_t host_total = 0;
  bool any = false;
  for (uint32_t li = 0; li < pool.n_layers(); ++li) {
    Layer& g = layers_[li];
    g.trainable = !trainable || trainable[li];
    if (!g.trainable) continue;
    any = true;
    const RecordLayout& rl = pool.layer(li, call).layout;
    uint64_t woff = 0, hoff = 0;
    for (const TensorLayout& t : rl.tensors) {
      if (t.dtype != LWO_DTYPE_F32 && t.dtype != LWO_DTYPE_BF16 && t.dtype != LWO_DTYPE_F16)
        fail(LWO_ERR_INVALID_ARGUMENT,
             "%s: layer %u tensor '%s' is %s; trainable tensors must be f32, bf16 or f16 "
             "(mark the layer frozen)", call, li, t.name.c_str(), dtype_name(t.dtype));
      Tensor gt;
      gt.wire = native_ ? t.dtype : LWO_DTYPE_F32;
      gt.n = t.bytes / dtype_size(t.dtype);
      gt.wire_off = woff;
      gt.host_off = hoff;
      woff = align_up(woff + gt.n * dtype_size(gt.wire), LWO_RECORD_ALIGN);
      hoff = align_up(hoff + gt.n * 4, LWO_RECORD_ALIGN);
      g.tensors.push_back(gt);
      g.names.push_back(t.name);
    }
    g.wire_bytes = woff;
    g.lo = 0;
    g.hi = woff;
    if (pool.comm()) {
      // Rank q owns the gradients of the weight bytes [q*S, (q+1)*S): map
      // each boundary q*S of the weight record into the f32 wire record.
      // Offsets and S are multiples of LWO_RECORD_ALIGN, so every boundary
      // falls between elements, and the mapped one on a multiple of 4.
      const uint64_t S = pool.layer(li, call).shard_bytes;
      const int n = pool.n_ranks();
      g.bounds.assign(static_cast<size_t>(n) + 1, woff);
      for (int q = 0; q <= n; ++q) {
        uint64_t b = S * static_cast<uint64_t>(q);
        for (size_t i = 0; i < rl.tensors.size(); ++i) {
          const TensorLayout& t = rl.tensors[i];
          if (b < t.offset + t.bytes) {
            g.bounds[q] = b <= t.offset ? g.tensors[i].wire_off
                                        : g.tensors[i].wire_off + (b - t.offset) / dtype_size(t.dtype) * 4;
            break;
          }
        }
      }
      g.bounds[0] = 0;
      g.bounds[static_cast<size_t>(n)] = woff;
      g.lo = g.bounds[static_cast<size_t>(pool.rank())];
      g.hi = g.bounds[static_cast<size_t>(pool.rank()) + 1];
      hoff = g.hi - g.lo;
    }
    g.host_bytes = hoff;
    g.host_base = host_total;
    host_total = align_up(host_total + hoff, LWO_RECORD_ALIGN);
    max_wire_ = std::max(max_wire_, woff);
  }
  if (!any || max_wire_ == 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: no trainable layer has any gradient bytes", call);
  DeviceScope scope(engine_);
  Backend& gpu = engine_.gpu();
  host_ = PinnedArena(gpu, std::max<uint64_t>(host_total, LWO_RECORD_ALIGN), n_threads_, call);
  slots_.resize(depth);
  try {
    for (Slot& s : slots_) {
      s.dev = static_cast<uint8_t*>(gpu.device_alloc(max_wire_));
      s.ready = gpu.event_create(false);
      s.free = gpu.event_create(false);
      s.reduced = gpu.event_create(false);
    }
  } catch (...) {
    for (Slot& s : slots_) {
      gpu.device_free(s.dev);
      gpu.event_destroy(s.ready);
      gpu.event_destroy(s.free);
      gpu.event_destroy(s.reduced);
    }
    throw;
  }
}

Grads::~Grads() {
  try {
    DeviceScope scope(engine_);
    engine_.gpu().stream_sync(engine_.d2h());
    for (Slot& s : slots_) {
      engine_.gpu().device_free(s.dev);
      engine_.gpu().event_destroy(s.ready);
      engine_.gpu().event_destroy(s.free);
      engine_.gpu().event_destroy(s.reduced);
    }
  } catch (...) {
  }
}

Grads::Layer& Grads::trainable_layer(uint32_t layer, const char* call) {
  if (layer >= layers_.size())
    fail(LWO_ERR_OUT_OF_RANGE, "%s: layer %u is out of range (pool has %zu layers)", call, layer,
         layers_.size());
  Layer& g = layers_[layer];
  if (!g.trainable)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: layer %u is frozen: it has no gradients", call, layer);
  return g;
}

void Grads::begin(uint32_t layer, StreamH stream, lwo_layer_view* view) {
  static const char* call = "lwo_grads_begin";
  std::lock_guard<std::mutex> lock(mu_);
  Layer& g = trainable_layer(layer, call);
  if (g.slot >= 0)
    fail(LWO_ERR_LAYER_BUSY, "%s: layer %u is already begun (staging slot %d); end it first",
         call, layer, g.slot);
  // The free slot whose copy to host was enqueued longest ago: its copy is
  // the most likely to have finished, so the caller's stream waits least.
  int32_t si = -1;
  for (size_t i = 0; i < slots_.size(); ++i)
    if (!slots_[i].held && (si < 0 || slots_[i].last_end < slots_[si].last_end))
      si = static_cast<int32_t>(i);
  if (si < 0)
    fail(LWO_ERR_RING_FULL, "%s: layer %u: all %zu gradient staging slots are begun", call, layer,
         slots_.size());
  Slot& s = slots_[si];
  DeviceScope scope(engine_);
  if (s.ever_freed) engine_.gpu().stream_wait(stream, s.free);
  s.held = true;
  g.slot = si;
  s.ptrs.resize(g.tensors.size());
  for (size_t i = 0; i < g.tensors.size(); ++i) s.ptrs[i] = s.dev + g.tensors[i].wire_off;
  view->layer = layer;
  view->n_tensors = static_cast<uint32_t>(g.tensors.size());
  view->base = s.dev;
  view->record_bytes = g.wire_bytes;
  view->tensors = s.ptrs.data();
}

void Grads::end(uint32_t layer, StreamH stream) {
  static const char* call = "lwo_grads_end";
  std::lock_guard<std::mutex> lock(mu_);
  // Sharded pools under the collective check: every rank says what it is
  // about to do (or that it fails here) before the reduction.
  const bool check = pool_.comm() && engine_.checks_collectives();
  if (check) {
    uint64_t bytes = 0;
    try {
      bytes = begun_layer(layer, call).wire_bytes;
    } catch (const Error&) {
      try {
        engine_.check_collective(pool_.comm(), Engine::Step{call, layer, 0, false, true});
      } catch (const Error&) {
        // The other ranks learn of this rank's error; this rank reports its own.
      }
      throw;
    }
    engine_.check_collective(pool_.comm(), Engine::Step{call, layer, bytes, false, false});
  }
  end_locked(layer, stream);
}

Grads::Layer& Grads::begun_layer(uint32_t layer, const char* call) {
  Layer& g = trainable_layer(layer, call);
  if (g.slot < 0)
    fail(LWO_ERR_TICKET_STATE, "%s: layer %u was not begun (call lwo_grads_begin first)", call,
         layer);
  return g;
}

void Grads::end_locked(uint32_t layer, StreamH stream) {
  static const char* call = "lwo_grads_end";
  Layer& g = begun_layer(layer, call);
  Slot& s = slots_[g.slot];
  Backend& gpu = engine_.gpu();
  DeviceScope scope(engine_);
  StreamH d2h = engine_.d2h();
  gpu.event_record(s.ready, stream);
  if (pool_.comm()) {
    // Sum the layer over the ranks on the communication stream; this rank's
    // part then goes down its own link.
    StreamH cs = engine_.comm();
    gpu.stream_wait(cs, s.ready);
    gpu.reduce_owned(s.dev, g.bounds.data(), pool_.comm(), cs);
    gpu.event_record(s.reduced, cs);
    gpu.stream_wait(d2h, s.reduced);
  } else {
    gpu.stream_wait(d2h, s.ready);
  }
  const uint64_t bytes = g.hi - g.lo;
  bool direct = !native_ && g.fresh;
  if (direct) {
    if (bytes) gpu.copy_d2h(host_.data() + g.host_base, s.dev + g.lo, bytes, d2h);
    gpu.event_record(s.free, d2h);
  } else {
    if (staging_.size() < slots_.size())
      staging_.emplace_back(gpu, max_wire_, 1, call);  // small, made once on first use
    PinnedArena& st = staging_[next_staging_ % staging_.size()];
    ++next_staging_;
    // The host function that last read this staging buffer ran earlier on
    // the same stream, so the copy cannot overtake it.
    if (bytes) gpu.copy_d2h(st.data(), s.dev + g.lo, bytes, d2h);
    gpu.event_record(s.free, d2h);
    auto job = std::make_unique<Job>(Job{this, layer, st.data(), g.fresh});
    gpu.host_func(d2h, &Grads::run_job, job.get());
    job.release();  // run_job owns it now
  }
  s.ever_freed = true;
  s.held = false;
  s.last_end = ++clock_;
  g.slot = -1;
  g.fresh = false;
  g.stale = false;  // the assignment overwrites every element
  ++n_transfers_;
  bytes_ += bytes;
}

void Grads::run_job(void* p) {
  std::unique_ptr<Job> job(static_cast<Job*>(p));
  try {
    job->grads->accumulate(*job);
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(job->grads->err_mu_);
    if (job->grads->async_error_.empty())
      job->grads->async_error_ = strf("layer %u: %s", job->layer, e.what());
  }
}

void Grads::accumulate(const Job& job) {
  // Runs on the gradient stream's host thread; layers_ entries it reads are
  // fixed after construction.
  const Layer& g = layers_[job.layer];
  uint32_t hw = std::max(1u, std::thread::hardware_concurrency());
  uint32_t nt = std::min<uint32_t>(n_threads_ ? n_threads_ : hw, 32);
  for (const Tensor& t : g.tensors) {
    // This rank's elements of the tensor: all of them, or (sharded pools,
    // f32 wire) those whose wire bytes lie in [lo, hi); the staging copy
    // and the host region both start at wire byte lo.
    uint64_t wb = std::max(t.wire_off, g.lo), we = std::min(t.wire_off + t.n * 4, g.hi);
    if (pool_.comm() && wb >= we) continue;
    float* dst = pool_.comm()
                     ? reinterpret_cast<float*>(host_.data() + g.host_base + (wb - g.lo))
                     : reinterpret_cast<float*>(host_.data() + g.host_base + t.host_off);
    const uint8_t* src = pool_.comm() ? job.src + (wb - g.lo) : job.src + t.wire_off;
    const uint64_t count = pool_.comm() ? (we - wb) / 4 : t.n;
    constexpr uint64_t kPerThread = uint64_t(1) << 20;
    uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(nt, (count + kPerThread - 1) / kPerThread));
    if (n <= 1) {
      convert_range(dst, src, t.wire, 0, count, job.assign);
      continue;
    }
    std::vector<std::thread> threads;
    uint64_t chunk = (count + n - 1) / n;
    for (uint32_t i = 0; i < n; ++i) {
      uint64_t b = std::min(count, chunk * i), e = std::min(count, chunk * (i + 1));
      try {
        threads.emplace_back(convert_range, dst, src, t.wire, b, e, job.assign);
      } catch (...) {
        convert_range(dst, src, t.wire, b, e, job.assign);
      }
    }
    for (auto& th : threads) th.join();
  }
  n_accumulated_.fetch_add(1);
}

void Grads::wait() {
  static const char* call = "lwo_grads_wait";
  {
    DeviceScope scope(engine_);
    engine_.gpu().stream_sync(engine_.d2h());
  }
  std::lock_guard<std::mutex> lock(mu_);
  {
    std::lock_guard<std::mutex> elock(err_mu_);
    if (!async_error_.empty()) {
      std::string e = async_error_;
      async_error_.clear();
      fail(LWO_ERR_INTERNAL, "%s: accumulating on the host failed: %s", call, e.c_str());
    }
  }
  // Layers zeroed since their last gradient and not written again: zero now.
  for (Layer& g : layers_)
    if (g.stale) {
      std::memset(host_.data() + g.host_base, 0, g.host_bytes);
      g.stale = false;
    }
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].slot >= 0)
      fail(LWO_ERR_BUSY, "%s: layer %zu was begun and not ended: its gradients were not sent",
           call, i);
}

void Grads::zero() {
  wait();
  // No memset here: the next gradient of each layer assigns every element
  // (f32 in place, or converted), and wait() zeroes the layers that got none.
  std::lock_guard<std::mutex> lock(mu_);
  for (Layer& g : layers_)
    if (g.trainable && !g.fresh) {
      g.fresh = true;
      g.stale = true;
    }
}

int Grads::tensor_of(const Layer& g, uint32_t layer, const char* name, const char* call) const {
  if (!name) fail(LWO_ERR_INVALID_ARGUMENT, "%s: name is NULL", call);
  for (size_t i = 0; i < g.names.size(); ++i)
    if (g.names[i] == name) return static_cast<int>(i);
  fail(LWO_ERR_NOT_FOUND, "%s: layer %u has no tensor named '%.255s'", call, layer, name);
}

float* Grads::host(uint32_t layer, const char* name, uint64_t* n_elements) {
  static const char* call = "lwo_grads_host";
  std::lock_guard<std::mutex> lock(mu_);
  Layer& g = trainable_layer(layer, call);
  int i = tensor_of(g, layer, name, call);
  if (pool_.comm() && pool_.n_ranks() > 1)
    fail(LWO_ERR_UNSUPPORTED,
         "%s: layer %u tensor '%s': the pool is sharded over %d ranks and this rank holds only "
         "part of each gradient; use lwo_grads_shard", call, layer, name, pool_.n_ranks());
  if (n_elements) *n_elements = g.tensors[i].n;
  return reinterpret_cast<float*>(host_.data() + g.host_base + g.tensors[i].host_off);
}

float* Grads::shard(uint32_t layer, const char* name, uint64_t* first, uint64_t* n) {
  static const char* call = "lwo_grads_shard";
  std::lock_guard<std::mutex> lock(mu_);
  Layer& g = trainable_layer(layer, call);
  const Tensor& t = g.tensors[tensor_of(g, layer, name, call)];
  if (!pool_.comm()) {
    *first = 0;
    *n = t.n;
    return reinterpret_cast<float*>(host_.data() + g.host_base + t.host_off);
  }
  uint64_t wb = std::max(t.wire_off, g.lo), we = std::min(t.wire_off + t.n * 4, g.hi);
  if (wb >= we) {
    *first = 0;
    *n = 0;
    return nullptr;
  }
  *first = (wb - t.wire_off) / 4;
  *n = (we - wb) / 4;
  return reinterpret_cast<float*>(host_.data() + g.host_base + (wb - g.lo));
}

void Grads::stats(lwo_grads_stats* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->n_transfers = n_transfers_;
  out->bytes = bytes_;
  out->n_accumulated = n_accumulated_.load();
}

void Grads::check_destroyable(const char* call) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].slot >= 0)
      fail(LWO_ERR_BUSY, "%s: layer %zu is begun and not ended", call, i);
}

}  // namespace lwo
