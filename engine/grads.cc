#include "grads.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/parallel.h"

namespace lwo {
namespace {
// The wire record of a pool's trainable layers: what Grads needs to size its
// slots before it can make them.
// The dtypes of a tensor's gradient on the wire and in its host buffer.
lwo_dtype_t wire_dtype(Grads::Mode mode, bool sharded, lwo_dtype_t t) {
  return (mode == Grads::Mode::kF32 || sharded) ? LWO_DTYPE_F32 : t;
}
lwo_dtype_t host_dtype(Grads::Mode mode, bool sharded, lwo_dtype_t t) {
  return (mode == Grads::Mode::kNative && !sharded) ? t : LWO_DTYPE_F32;
}

uint64_t max_wire_bytes(Pool& pool, const uint8_t* trainable, Grads::Mode mode) {
  uint64_t m = 0;
  for (uint32_t li = 0; li < pool.n_layers(); ++li) {
    if (trainable && !trainable[li]) continue;
    uint64_t woff = 0;
    for (const TensorLayout& t : pool.layer(li).layout.tensors) {
      size_t es = dtype_size(t.dtype);
      if (t.dtype != LWO_DTYPE_F32 && t.dtype != LWO_DTYPE_BF16 && t.dtype != LWO_DTYPE_F16)
        fail(LWO_ERR_INVALID_ARGUMENT,
             "layer %u tensor '%s' is %s; trainable tensors must be f32, bf16 or f16 "
             "(mark the layer frozen)", li, t.name.c_str(), dtype_name(t.dtype));
      woff = align_up(woff + t.bytes / es * dtype_size(wire_dtype(mode, pool.comm(), t.dtype)),
                      LWO_RECORD_ALIGN);
    }
    m = std::max(m, woff);
  }
  return m;
}
}  // namespace

Grads::Grads(Pool& pool, const uint8_t* trainable, uint32_t depth, Mode mode,
             uint32_t n_threads)
    : pool_(pool), engine_(pool.engine()), mode_(mode), n_threads_(n_threads),
      max_wire_((pool.comm() && mode == Mode::kNativeWire) ? 0
                                                            : max_wire_bytes(pool, trainable, mode)),
      slot_charge_(max_wire_ ? Charge(pool.engine(), MemUse::Grads, max_wire_, depth,
                                      strf("%u x %llu-byte gradient staging slots", depth,
                                           static_cast<unsigned long long>(max_wire_)).c_str())
                             : Charge()),
      slots_(make_slots(pool, depth, max_wire_)) {
  if (pool.comm() && mode_ == Mode::kNativeWire)
    fail(LWO_ERR_UNSUPPORTED,
         "the pool is sharded over %d ranks: its gradients are summed over the ranks in "
         "f32, so LWO_GRADS_NATIVE_WIRE is not supported", pool.n_ranks());
  layers_.resize(pool.n_layers());
  uint64_t host_total = 0;
  bool any = false;
  for (uint32_t li = 0; li < pool.n_layers(); ++li) {
    Layer& g = layers_[li];
    g.trainable = !trainable || trainable[li];
    if (!g.trainable) continue;
    any = true;
    const RecordLayout& rl = pool.layer(li).layout;
    uint64_t woff = 0, hoff = 0;
    g.direct = true;
    for (const TensorLayout& t : rl.tensors) {
      Tensor gt;
      gt.wire = wire_dtype(mode_, pool.comm() != nullptr, t.dtype);
      gt.host = host_dtype(mode_, pool.comm() != nullptr, t.dtype);
      gt.n = t.bytes / dtype_size(t.dtype);
      gt.wire_off = woff;
      gt.host_off = hoff;
      woff = align_up(woff + gt.n * dtype_size(gt.wire), LWO_RECORD_ALIGN);
      hoff = align_up(hoff + gt.n * dtype_size(gt.host), LWO_RECORD_ALIGN);
      g.direct = g.direct && gt.wire == gt.host;
      g.tensors.push_back(gt);
      g.names.push_back(t.name);
      g.view_bytes.push_back(gt.n * dtype_size(gt.wire));
      g.view_dtypes.push_back(gt.wire);
    }
    g.wire_bytes = woff;
    g.lo = 0;
    g.hi = woff;
    if (pool.comm()) {
      // Rank q owns the gradients of the weight bytes [q*S, (q+1)*S): map
      // each boundary q*S of the weight record into the f32 wire record.
      // Offsets and S are multiples of LWO_RECORD_ALIGN, so every boundary
      // falls between elements, and the mapped one on a multiple of 4.
      const uint64_t S = pool.layer(li).shard_bytes;
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
  }
  if (!any || max_wire_ == 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "no trainable layer has any gradient bytes");
  DeviceScope scope(engine_);
  host_ = PinnedArena(engine_.gpu(), std::max<uint64_t>(host_total, LWO_RECORD_ALIGN),
                      n_threads_);
  slot_layer_.assign(slots_.size(), -1);
  added_serial_.assign(layers_.size(), 0);
  worker_ = std::thread([this] { work(); });
  pool_.n_grads.fetch_add(1);
}

SlotSet Grads::make_slots(Pool& pool, uint32_t depth, uint64_t bytes) {
  // No slots yet where the checks that follow will refuse the set anyway.
  DeviceScope scope(pool.engine());
  return SlotSet(pool.engine().gpu(), bytes ? depth : 0, std::max<uint64_t>(bytes, 1));
}

Grads::~Grads() {
  pool_.n_grads.fetch_sub(1);
  try {
    DeviceScope scope(engine_);
    engine_.gpu().stream_sync(engine_.d2h());  // every job is posted
    engine_.gpu().event_destroy(done_);
    for (Layer& g : layers_)
      if (g.landed) engine_.gpu().event_destroy(g.landed);
  } catch (...) {
  }
  {
    std::lock_guard<std::mutex> lock(q_mu_);
    stop_ = true;
  }
  q_cv_.notify_all();
  if (worker_.joinable()) worker_.join();  // it finishes the queue first
}

Grads::Layer& Grads::trainable_layer(uint32_t layer) {
  if (layer >= layers_.size())
    fail(LWO_ERR_OUT_OF_RANGE, "layer %u is out of range (pool has %zu layers)", layer,
         layers_.size());
  Layer& g = layers_[layer];
  if (!g.trainable)
    fail(LWO_ERR_INVALID_ARGUMENT, "layer %u is frozen: it has no gradients", layer);
  return g;
}

void Grads::begin(uint32_t layer, StreamH stream, lwo_layer_view* view) {
  if (Reader* r = reader_.load()) r->wait_reading(layer);
  std::lock_guard<std::mutex> lock(mu_);
  Layer& g = trainable_layer(layer);
  if (g.slot >= 0)
    fail(LWO_ERR_LAYER_BUSY, "layer %u is already begun (staging slot %d); end it first", layer,
         g.slot);
  // The free slot whose copy to host was enqueued longest ago: its copy is
  // the most likely to have finished, so the caller's stream waits least.
  int32_t si = slots_.pick([this](size_t i) { return slot_layer_[i] < 0; });
  if (si < 0)
    fail(LWO_ERR_RING_FULL, "layer %u: all %zu gradient staging slots are begun", layer,
         slots_.size());
  DeviceSlot& s = slots_[si];
  DeviceScope scope(engine_);
  if (s.ever_freed) engine_.gpu().stream_wait(stream, s.free);
  engine_.gpu().slot_handed_out(s.dev, g.wire_bytes, stream);
  slot_layer_[si] = static_cast<int32_t>(layer);
  g.slot = si;
  g.ptrs.resize(g.tensors.size());
  for (size_t i = 0; i < g.tensors.size(); ++i) g.ptrs[i] = s.dev + g.tensors[i].wire_off;
  lwo_layer_view v{};
  v.size = sizeof v;
  v.layer = layer;
  v.n_tensors = static_cast<uint32_t>(g.tensors.size());
  v.base = s.dev;
  v.record_bytes = g.wire_bytes;
  v.tensors = g.ptrs.data();
  v.tensor_bytes = g.view_bytes.data();
  v.tensor_dtypes = g.view_dtypes.data();
  *view = v;
}

void Grads::end(uint32_t layer, StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  // A sharded pool's gradient end is a collective step (the reduction): under
  // the check every rank says what it will do, or that it fails here, first.
  engine_.collective_step(pool_.comm(), Engine::Step::GradsEnd, layer,
                          [&](Engine::Step& step) { step.bytes = begun_layer(layer).wire_bytes; });
  end_locked(layer, stream);
}

Grads::Layer& Grads::begun_layer(uint32_t layer) {
  Layer& g = trainable_layer(layer);
  if (g.slot < 0)
    fail(LWO_ERR_TICKET_STATE, "layer %u was not begun (call lwo_grads_begin first)", layer);
  return g;
}

void Grads::end_locked(uint32_t layer, StreamH stream) {
  Layer& g = begun_layer(layer);
  DeviceSlot& s = slots_[g.slot];
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
    gpu.event_record(s.aux, cs);
    gpu.stream_wait(d2h, s.aux);
  } else {
    gpu.stream_wait(d2h, s.ready);
  }
  const uint64_t bytes = g.hi - g.lo;
  // The offsets of the wire record and the host region are the same when
  // every tensor keeps its dtype (both align each tensor alike).
  bool direct = g.direct && g.fresh;
  if (!g.landed) g.landed = gpu.event_create(false);
  const uint64_t serial = end_counter_ + 1;
  if (direct) {
    if (bytes) gpu.copy_d2h(host_.data() + g.host_base, s.dev + g.lo, bytes, d2h);
    gpu.event_record(s.free, d2h);
  } else {
    if (staging_.size() < slots_.size()) {
      staging_.emplace_back(gpu, max_wire_, 1);  // small, made once on first use
      std::lock_guard<std::mutex> lock(q_mu_);
      staging_busy_.push_back(0);
    }
    const size_t k = next_staging_ % staging_.size();
    PinnedArena& st = staging_[k];
    ++next_staging_;
    // The copy into the buffer waits (in stream order, on the host) until the
    // worker has added the buffer's previous contents.
    auto wait = std::make_unique<StagingWait>(StagingWait{this, k});
    gpu.host_func(d2h, &Grads::wait_staging, wait.get(), {});
    wait.release();  // wait_staging owns it now
    if (bytes) gpu.copy_d2h(st.data(), s.dev + g.lo, bytes, d2h);
    gpu.event_record(s.free, d2h);
    // The worker reads the buffer and writes the layer's host region before
    // the buffer's next copy (above) and before the fence (wait()).
    auto job = std::make_unique<Job>(Job{this, layer, st.data(), g.fresh, k, serial});
    gpu.host_func(d2h, &Grads::post_job, job.get(),
                  {{st.data(), bytes, false}, {host_.data() + g.host_base, g.host_bytes, true}});
    job.release();  // post_job owns it now
  }
  if (!done_) done_ = gpu.event_create(false);
  gpu.event_record(done_, d2h);
  gpu.event_record(g.landed, d2h);
  end_counter_ = serial;
  g.end_serial = serial;
  g.end_direct = direct;
  slots_.freed(g.slot);
  slot_layer_[g.slot] = -1;
  g.slot = -1;
  g.fresh = false;
  g.stale = false;  // the assignment overwrites every element
  ++n_transfers_;
  bytes_ += bytes;
}

void Grads::post_job(void* p) {
  std::unique_ptr<Job> job(static_cast<Job*>(p));
  Grads* g = job->grads;
  {
    std::lock_guard<std::mutex> lock(g->q_mu_);
    g->staging_busy_[job->staging] = 1;
    ++g->pending_;
    g->queue_.push_back(std::move(job));
  }
  g->q_cv_.notify_all();
}

void Grads::wait_staging(void* p) {
  std::unique_ptr<StagingWait> w(static_cast<StagingWait*>(p));
  Grads* g = w->grads;
  std::unique_lock<std::mutex> lock(g->q_mu_);
  g->q_cv_.wait(lock, [&] { return !g->staging_busy_[w->staging]; });
}

void Grads::work() {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(q_mu_);
      q_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped, and nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      accumulate(*job);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(err_mu_);
      if (async_error_.empty()) async_error_ = strf("layer %u: %s", job->layer, e.what());
    }
    {
      std::lock_guard<std::mutex> lock(q_mu_);
      staging_busy_[job->staging] = 0;
      added_serial_[job->layer] = std::max(added_serial_[job->layer], job->serial);
      --pending_;
    }
    q_cv_.notify_all();
  }
}

void Grads::wait_worker() {
  std::unique_lock<std::mutex> lock(q_mu_);
  q_cv_.wait(lock, [&] { return pending_ == 0; });
}

void Grads::accumulate(const Job& job) {
  // Runs on the worker thread; layers_ entries it reads are fixed after
  // construction.
  const auto t0 = std::chrono::steady_clock::now();
  const Layer& g = layers_[job.layer];
  uint32_t hw = std::max(1u, std::thread::hardware_concurrency());
  uint32_t nt = std::min<uint32_t>(n_threads_ ? n_threads_ : hw, 32);
  constexpr uint64_t kPerThread = uint64_t(1) << 18;  // elements
  uint64_t bytes = 0;
  for (const Tensor& t : g.tensors) {
    // This rank's elements of the tensor: all of them, or (sharded pools,
    // f32 wire and host) those whose wire bytes lie in [lo, hi); the staging
    // copy and the host region both start at wire byte lo.
    uint64_t wb = std::max(t.wire_off, g.lo), we = std::min(t.wire_off + t.n * 4, g.hi);
    if (pool_.comm() && wb >= we) continue;
    uint8_t* dst = pool_.comm() ? host_.data() + g.host_base + (wb - g.lo)
                                : host_.data() + g.host_base + t.host_off;
    const uint8_t* src = pool_.comm() ? job.src + (wb - g.lo) : job.src + t.wire_off;
    const uint64_t count = pool_.comm() ? (we - wb) / 4 : t.n;
    const size_t ds = dtype_size(t.host), ss = dtype_size(t.wire);
    // Chunks start on 64-element boundaries (whole cache lines), eight per
    // thread taken in turn: the caller's host thread usually spins in a CUDA
    // synchronisation on one of the cores meanwhile (measured on the H200's
    // 16 cores: 15-25 GB/s with one fixed part per thread, against 32-34 GB/s
    // for the same loop with every core free).
    parallel_for(
        count, nt, kPerThread, 64,
        [&](uint64_t b, uint64_t e) {
          lwo::accumulate(dst + b * ds, t.host, src + b * ss, t.wire, e - b, job.assign);
        },
        8);
    bytes += count * ss;
  }
  n_accumulated_.fetch_add(1);
  accumulated_bytes_.fetch_add(bytes);
  accumulate_ns_.fetch_add(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count()));
}

void Grads::wait() {
  {
    DeviceScope scope(engine_);
    engine_.gpu().stream_sync(engine_.d2h());  // every job is posted
  }
  wait_worker();
  // A reader (the optimizer) may still read the old sums of a
  // layer zeroed lazily: wait for it before the memset below. (It starts no
  // new read of a stale layer: its steps skip them.)
  if (Reader* r = reader_.load()) {
    std::vector<uint32_t> stale;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < layers_.size(); ++i)
        if (layers_[i].stale) stale.push_back(static_cast<uint32_t>(i));
    }
    for (uint32_t l : stale) r->wait_reading(l);
  }
  std::lock_guard<std::mutex> lock(mu_);
  {
    std::lock_guard<std::mutex> elock(err_mu_);
    if (!async_error_.empty()) {
      std::string e = async_error_;
      async_error_.clear();
      fail(LWO_ERR_INTERNAL, "accumulating on the host failed: %s", e.c_str());
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
      fail(LWO_ERR_BUSY, "layer %zu was begun and not ended: its gradients were not sent", i);
}

void Grads::zero() {
  wait();
  // No memset here: the next gradient of each layer assigns every element
  // (in place, or converted), and wait() zeroes the layers that got none.
  std::lock_guard<std::mutex> lock(mu_);
  for (Layer& g : layers_)
    if (g.trainable && !g.fresh) {
      g.fresh = true;
      g.stale = true;
    }
}

int Grads::tensor_of(const Layer& g, uint32_t layer, const char* name) const {
  if (!name) fail(LWO_ERR_INVALID_ARGUMENT, "name is NULL");
  for (size_t i = 0; i < g.names.size(); ++i)
    if (g.names[i] == name) return static_cast<int>(i);
  fail(LWO_ERR_NOT_FOUND, "layer %u has no tensor named '%.255s'", layer, name);
}

void* Grads::tensor(uint32_t layer, const char* name, lwo_dtype_t* dtype, uint64_t* first,
                    uint64_t* n) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& g = trainable_layer(layer);
  const Tensor& t = g.tensors[tensor_of(g, layer, name)];
  *dtype = t.host;
  if (!pool_.comm()) {
    *first = 0;
    *n = t.n;
    return t.n ? host_.data() + g.host_base + t.host_off : nullptr;
  }
  // Sharded: f32 on the wire and in the host region.
  uint64_t wb = std::max(t.wire_off, g.lo), we = std::min(t.wire_off + t.n * 4, g.hi);
  if (wb >= we) {
    *first = 0;
    *n = 0;
    return nullptr;
  }
  *first = (wb - t.wire_off) / 4;
  *n = (we - wb) / 4;
  return host_.data() + g.host_base + (wb - g.lo);
}

bool Grads::done() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_) return true;
  DeviceScope scope(engine_);
  if (!engine_.gpu().event_done(done_)) return false;  // not all posted yet
  std::lock_guard<std::mutex> qlock(q_mu_);
  return pending_ == 0;
}

void Grads::stats(lwo_grads_stats* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->n_transfers = n_transfers_;
  out->bytes = bytes_;
  out->n_accumulated = n_accumulated_.load();
  out->accumulated_bytes = accumulated_bytes_.load();
  out->accumulate_ns = accumulate_ns_.load();
}

void Grads::attach(Reader* reader) {
  if (!reader) {
    reader_.store(nullptr);
    return;
  }
  Reader* none = nullptr;
  if (!reader_.compare_exchange_strong(none, reader))
    fail(LWO_ERR_BUSY, "the gradient set already has an optimizer");
}

uint64_t Grads::last_end(uint32_t layer, bool* stale) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& g = trainable_layer(layer);
  if (stale) *stale = g.stale;
  return g.end_serial;
}

void Grads::wait_landed(uint32_t layer, uint64_t serial) {
  EventH ev = nullptr;
  bool direct = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Layer& g = layers_.at(layer);
    if (serial == 0 || g.end_serial < serial) return;  // nothing of that serial (yet)
    ev = g.landed;
    direct = g.end_direct && g.end_serial == serial;
  }
  // The layer's event is recorded again only by its next end, which waits
  // (begin) for the reader: it still marks end `serial` here.
  engine_.gpu().event_sync(ev);
  if (direct) return;
  std::unique_lock<std::mutex> lock(q_mu_);
  q_cv_.wait(lock, [&] { return added_serial_[layer] >= serial; });
}

bool Grads::landed(uint32_t layer, uint64_t serial) {
  EventH ev = nullptr;
  bool direct = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Layer& g = layers_.at(layer);
    if (serial == 0 || g.end_serial < serial) return true;  // as wait_landed
    ev = g.landed;
    direct = g.end_direct && g.end_serial == serial;
  }
  {
    DeviceScope scope(engine_);
    if (!engine_.gpu().event_done(ev)) return false;
  }
  if (direct) return true;
  std::lock_guard<std::mutex> lock(q_mu_);
  return added_serial_[layer] >= serial;
}

void Grads::check_destroyable() {
  if (reader_.load())
    fail(LWO_ERR_BUSY, "the gradient set has an optimizer; destroy the optimizer first");
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].slot >= 0) fail(LWO_ERR_BUSY, "layer %zu is begun and not ended", i);
}

}  // namespace lwo
