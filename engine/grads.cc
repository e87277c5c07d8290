#include "grads.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/parallel.h"

namespace lwo {

Grads::Grads(Pool& pool, const uint8_t* trainable, uint32_t depth, Mode mode,
             uint32_t n_threads)
    : pool_(pool), engine_(pool.engine()), n_threads_(n_threads),
      checking_(pool.engine().checking()),
      sink_(Sink::make(pool, mode)),
      layers_(make_layers(pool, trainable, *sink_)),
      max_wire_(max_wire_bytes(layers_)),
      slot_charge_(max_wire_ ? Charge(pool.engine(), MemUse::Grads, max_wire_, depth,
                                      strf("%u x %llu-byte gradient staging slots", depth,
                                           static_cast<unsigned long long>(max_wire_)).c_str())
                             : Charge()),
      slots_(make_slots(pool, depth, max_wire_)) {
  uint64_t host_total = 0;
  bool any = false;
  for (Layer& g : layers_) {
    if (!g.trainable) continue;
    any = true;
    g.host_base = host_total;
    host_total = align_up(host_total + g.layout.host_bytes, LWO_RECORD_ALIGN);
  }
  if (!any || max_wire_ == 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "no trainable layer has any gradient bytes");
  DeviceScope scope(engine_);
  host_ = PinnedArena(engine_, std::max<uint64_t>(host_total, LWO_RECORD_ALIGN), n_threads_,
                      "host gradient buffers");
  if (checking_)  // every layer waits for its first gradient, as after a zero
    for (Layer& g : layers_)
      if (g.trainable) {
        poison_host(g);
        g.stale = true;
      }
  slot_layer_.assign(slots_.size(), -1);
  added_serial_.assign(layers_.size(), 0);
  worker_ = engine_.threads().start([this] { work(); });
  pool_.n_grads.fetch_add(1);
}

std::vector<Grads::Layer> Grads::make_layers(Pool& pool, const uint8_t* trainable,
                                             const Sink& sink) {
  std::vector<Layer> layers(pool.n_layers());
  for (uint32_t li = 0; li < pool.n_layers(); ++li) {
    Layer& g = layers[li];
    g.trainable = !trainable || trainable[li];
    if (!g.trainable) continue;
    g.layout = sink.lay_out(li, pool.layer(li));
    for (size_t i = 0; i < g.layout.tensors.size(); ++i) {
      const GradTensor& t = g.layout.tensors[i];
      g.names.push_back(pool.layer(li).layout.tensors[i].name);
      g.view_bytes.push_back(t.n * dtype_size(t.wire));
      g.view_dtypes.push_back(t.wire);
    }
  }
  return layers;
}

uint64_t Grads::max_wire_bytes(const std::vector<Layer>& layers) {
  uint64_t m = 0;
  for (const Layer& g : layers)
    if (g.trainable) m = std::max(m, g.layout.wire_bytes);
  return m;
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
  worker_.join();  // it finishes the queue first
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
  engine_.check_not_capturing("a gradient's begin");
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
  engine_.gpu().slot_handed_out(s.dev, g.layout.wire_bytes, stream);
  slot_layer_[si] = static_cast<int32_t>(layer);
  g.slot = si;
  const std::vector<GradTensor>& ts = g.layout.tensors;
  g.ptrs.resize(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) g.ptrs[i] = s.dev + ts[i].wire_off;
  lwo_layer_view v{};
  v.size = sizeof v;
  v.layer = layer;
  v.n_tensors = static_cast<uint32_t>(ts.size());
  v.base = s.dev;
  v.record_bytes = g.layout.wire_bytes;
  v.tensors = g.ptrs.data();
  v.tensor_bytes = g.view_bytes.data();
  v.tensor_dtypes = g.view_dtypes.data();
  *view = v;
}

void Grads::end(uint32_t layer, StreamH stream) {
  engine_.check_not_capturing("a gradient's end");
  std::lock_guard<std::mutex> lock(mu_);
  // Where the sink sums over ranks, a gradient end is a collective step (the
  // reduction): under the check every rank says what it will do, or that it
  // fails here, first.
  engine_.collective_step(sink_->communicator(), Engine::Step::GradsEnd, layer,
                          [&](Engine::Step& step) {
                            step.bytes = begun_layer(layer).layout.wire_bytes;
                          });
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
  const GradLayout& gl = g.layout;
  gpu.event_record(s.ready, stream);
  sink_->reduce(gl, s, d2h);
  const uint64_t bytes = gl.hi - gl.lo;
  // The copied bytes are laid out as the host region when every tensor keeps
  // its dtype (both align each tensor alike).
  bool direct = gl.direct && g.fresh;
  if (!g.landed) g.landed = gpu.event_create(false);
  const uint64_t serial = end_counter_ + 1;
  if (direct) {
    if (bytes) gpu.copy_d2h(host_.data() + g.host_base, s.dev + gl.lo, bytes, d2h);
    poison_slot(g, s, d2h);
    gpu.event_record(s.free, d2h);
  } else {
    if (staging_.size() < slots_.size()) {
      staging_.emplace_back(engine_, max_wire_, 1, "gradient staging buffer");  // small, made once on first use
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
    if (bytes) gpu.copy_d2h(st.data(), s.dev + gl.lo, bytes, d2h);
    poison_slot(g, s, d2h);
    gpu.event_record(s.free, d2h);
    // The worker reads the buffer and writes the layer's host region before
    // the buffer's next copy (above) and before the fence (wait()).
    auto job = std::make_unique<Job>(Job{this, layer, st.data(), g.fresh, k, serial});
    gpu.host_func(d2h, &Grads::post_job, job.get(),
                  {{st.data(), bytes, false}, {host_.data() + g.host_base, gl.host_bytes, true}});
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
  ThreadPool& threads = engine_.threads();
  uint32_t nt = std::min<uint32_t>(n_threads_ ? n_threads_ : threads.size(), 32);
  constexpr uint64_t kPerThread = uint64_t(1) << 18;  // elements
  uint64_t bytes = 0;
  for (const GradTensor& t : g.layout.tensors) {
    // This rank's elements of the tensor (the sink's part): at copy_at in the
    // staging copy, host_at in the layer's host region.
    const uint64_t count = t.count;
    if (count == 0) continue;
    uint8_t* dst = host_.data() + g.host_base + t.host_at;
    const uint8_t* src = job.src + t.copy_at;
    const size_t ds = dtype_size(t.host), ss = dtype_size(t.wire);
    // Chunks start on 64-element boundaries (whole cache lines), eight per
    // thread taken in turn: the caller's host thread usually spins in a CUDA
    // synchronisation on one of the cores meanwhile (measured on the H200's
    // 16 cores: 15-25 GB/s with one fixed part per thread, against 32-34 GB/s
    // for the same loop with every core free).
    parallel_for(
        threads, count, nt, kPerThread, 64,
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
  engine_.check_not_capturing("waiting for the gradients");
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
      std::memset(host_.data() + g.host_base, 0, g.layout.host_bytes);
      g.stale = false;
    }
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].slot >= 0)
      fail(LWO_ERR_BUSY, "layer %zu was begun and not ended: its gradients were not sent", i);
}

void Grads::zero() {
  wait();
  // Checking mode overwrites the old sums at once: a reader (the optimizer)
  // must be done with every layer first.
  if (checking_)
    if (Reader* r = reader_.load()) r->wait_all();
  // No memset here: the next gradient of each layer assigns every element
  // (in place, or converted), and wait() zeroes the layers that got none.
  std::lock_guard<std::mutex> lock(mu_);
  for (Layer& g : layers_)
    if (g.trainable && !g.fresh) {
      g.fresh = true;
      g.stale = true;
      if (checking_) poison_host(g);
    }
}

void Grads::poison_host(const Layer& g) {
  for (const GradTensor& t : g.layout.tensors)
    if (t.count)
      std::memset(host_.data() + g.host_base + t.host_at, kCheckingByte,
                  t.count * dtype_size(t.host));
}

void Grads::poison_slot(const Layer& g, DeviceSlot& s, StreamH d2h) {
  // After the copy down, before the free event: the next begin's writer
  // waits for it.
  if (checking_ && g.layout.wire_bytes)
    engine_.gpu().fill_device(s.dev, kCheckingByte, g.layout.wire_bytes, d2h);
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
  const GradTensor& t = g.layout.tensors[tensor_of(g, layer, name)];
  *dtype = t.host;
  *first = t.first;
  *n = t.count;
  return t.count ? host_.data() + g.host_base + t.host_at : nullptr;
}

std::vector<Grads::HostTensor> Grads::whole_layer(uint32_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& g = trainable_layer(layer);
  std::vector<HostTensor> out;
  for (size_t i = 0; i < g.layout.tensors.size(); ++i) {
    const GradTensor& t = g.layout.tensors[i];
    if (t.first != 0 || t.count != t.n)
      fail(LWO_ERR_INTERNAL, "layer %u tensor '%s': the gradient holds %llu of %llu elements",
           layer, g.names[i].c_str(), static_cast<unsigned long long>(t.count),
           static_cast<unsigned long long>(t.n));
    out.push_back({t.count ? host_.data() + g.host_base + t.host_at : nullptr, t.host, t.n});
  }
  return out;
}

bool Grads::done() {
  engine_.check_not_capturing("querying the gradients");
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
  // Zeroed with no gradient since: fresh (its buffers may already have been
  // cleared by a later wait, which ends `stale` but not that).
  if (stale) *stale = g.stale || g.fresh;
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
