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
             uint32_t n_threads, void* replica)
    : pool_(pool), engine_(pool.engine()), n_threads_(n_threads),
      checking_(pool.engine().checking()),
      sink_(Sink::make(pool, mode, replica)),
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
  replay_serials_.resize(layers_.size());
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
    engine_.gpu().event_destroy(join_event_);
    engine_.gpu().event_destroy(land_event_);
    if (land_stream_) engine_.gpu().stream_destroy(land_stream_);
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_capture("a gradient's begin");
  }
  if (Reader* r = reader_.load()) r->wait_reading(layer);
  std::lock_guard<std::mutex> lock(mu_);
  check_capture("a gradient's begin");
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
  std::lock_guard<std::mutex> lock(mu_);
  check_capture("a gradient's end");
  // Where the sink sums over ranks, a gradient end is a collective step (the
  // reduction, and the sum over the replicas): under the check every rank of
  // both communicators says what it will do, or that it fails here, first.
  engine_.collective_step({sink_->communicator(), sink_->replica_communicator()},
                          Engine::Step::GradsEnd, layer, [&](Engine::Step& step) {
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
  const uint64_t serial = end_counter_ + 1;
  // Captured: the end's host functions take a persistent argument.
  ReplayEnd* re = nullptr;
  if (capture_ == Capture::Capturing) {
    replay_->joined = true;  // the sink's wait brought the gradient stream in
    if (replay_->fresh[layer] < 0) {
      replay_->fresh[layer] = g.fresh ? 1 : 0;
      replay_->layers.insert(
          std::upper_bound(replay_->layers.begin(), replay_->layers.end(), layer), layer);
    }
    replay_->ends.push_back(
        std::make_unique<ReplayEnd>(ReplayEnd{this, layer, direct, g.fresh, 0, nullptr, bytes}));
    re = replay_->ends.back().get();
  } else if (!g.landed) {
    g.landed = gpu.event_create(false);
  }
  if (direct) {
    if (bytes) gpu.copy_d2h(host_.data() + g.host_base, s.dev + gl.lo, bytes, d2h);
    poison_slot(g, s, d2h);
    gpu.event_record(s.free, d2h);
    if (re) land_aside(re, d2h);
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
    if (re) {
      re->staging = k;
      re->src = st.data();
      // A layer's landings take its serials in the capture's order.
      order_landings(d2h);
      gpu.host_func(d2h, &Grads::replay_wait_staging, re, {});
    } else {
      auto wait = std::make_unique<StagingWait>(StagingWait{this, k});
      gpu.host_func(d2h, &Grads::wait_staging, wait.get(), {});
      wait.release();  // wait_staging owns it now
    }
    if (bytes) gpu.copy_d2h(st.data(), s.dev + gl.lo, bytes, d2h);
    poison_slot(g, s, d2h);
    gpu.event_record(s.free, d2h);
    // The worker reads the buffer and writes the layer's host region before
    // the buffer's next copy (above) and before the fence (wait()).
    const std::vector<Backend::HostSpan> spans = {
        {st.data(), bytes, false}, {host_.data() + g.host_base, gl.host_bytes, true}};
    if (re) {
      gpu.host_func(d2h, &Grads::replay_landed, re, spans);
    } else {
      auto job = std::make_unique<Job>(Job{this, layer, st.data(), g.fresh, k, serial});
      gpu.host_func(d2h, &Grads::post_job, job.get(), spans);
      job.release();  // post_job owns it now
    }
  }
  if (!re) {  // a replay's landing is its host function's, and wait()'s the graph's
    if (!done_) done_ = gpu.event_create(false);
    gpu.event_record(done_, d2h);
    gpu.event_record(g.landed, d2h);
  }
  end_counter_ = serial;
  g.end_serial = serial;
  g.end_direct = direct;
  g.end_replayed = false;
  slots_.freed(g.slot);
  slot_layer_[g.slot] = -1;
  g.slot = -1;
  g.fresh = false;
  g.stale = false;  // the assignment overwrites every element
  ++n_transfers_;
  bytes_ += bytes;
}

void Grads::enqueue_locked(std::unique_ptr<Job> job) {
  staging_busy_[job->staging] = 1;
  ++pending_;
  queue_.push_back(std::move(job));
}

void Grads::post_job(void* p) {
  std::unique_ptr<Job> job(static_cast<Job*>(p));
  Grads* g = job->grads;
  {
    std::lock_guard<std::mutex> lock(g->q_mu_);
    g->enqueue_locked(std::move(job));
  }
  g->q_cv_.notify_all();
}

void Grads::wait_staging_free(size_t staging) {
  std::unique_lock<std::mutex> lock(q_mu_);
  q_cv_.wait(lock, [&] { return !staging_busy_[staging]; });
}

void Grads::wait_staging(void* p) {
  std::unique_ptr<StagingWait> w(static_cast<StagingWait*>(p));
  w->grads->wait_staging_free(w->staging);
}

void Grads::replay_wait_staging(void* p) {
  const ReplayEnd* e = static_cast<const ReplayEnd*>(p);
  e->grads->wait_staging_free(e->staging);
}

// A replayed end has landed (direct) or its job is posted: it takes its
// serial, the next its launch queued for the layer.
void Grads::replay_landed(void* p) {
  const ReplayEnd* e = static_cast<const ReplayEnd*>(p);
  Grads* g = e->grads;
  try {
    std::lock_guard<std::mutex> lock(g->q_mu_);
    std::deque<uint64_t>& q = g->replay_serials_[e->layer];
    if (q.empty()) {
      // A launch of the caller's graph that lwo_ring_capture_replay did not
      // announce: nothing of it is taken in (no serial, no job); the bytes a
      // direct copy landed are refused by the next lwo_grads_wait and
      // lwo_ring_capture_replay until lwo_grads_zero.
      std::lock_guard<std::mutex> elock(g->err_mu_);
      if (g->unannounced_.empty())
        g->unannounced_ = strf("gradient layer %u: a replay of the caller's CUDA graph was "
                               "launched without lwo_ring_capture_replay before it", e->layer);
      g->q_cv_.notify_all();
      return;
    }
    const uint64_t serial = q.front();
    if (e->direct)
      g->added_serial_[e->layer] = std::max(g->added_serial_[e->layer], serial);
    else
      g->enqueue_locked(
          std::make_unique<Job>(Job{g, e->layer, e->src, e->assign, e->staging, serial}));
    q.pop_front();
  } catch (const std::exception& x) {
    std::lock_guard<std::mutex> lock(g->err_mu_);
    if (g->async_error_.empty()) g->async_error_ = strf("layer %u: %s", e->layer, x.what());
  }
  g->q_cv_.notify_all();
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

void Grads::wait() { wait_fence(true); }

void Grads::check_announced(const char* what) {
  std::lock_guard<std::mutex> elock(err_mu_);
  if (!unannounced_.empty())
    fail(LWO_ERR_CAPTURING, "%s: %s: what it landed was not taken in, and the gradients of the "
         "graph's layers are unspecified; call lwo_grads_zero, then announce each launch",
         what, unannounced_.c_str());
}

void Grads::wait_fence(bool report_unannounced) {
  engine_.check_not_capturing("waiting for the gradients");
  EventH replay = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    replay = last_replay_;
  }
  {
    DeviceScope scope(engine_);
    if (replay) engine_.gpu().event_sync(replay);  // the replay's host functions have run
    engine_.gpu().stream_sync(engine_.d2h());      // every job is posted
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
  if (report_unannounced) check_announced("the gradient fence");
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
  wait_fence(false);
  {
    // What an unannounced replay landed goes with the sums.
    std::lock_guard<std::mutex> elock(err_mu_);
    unannounced_.clear();
  }
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
  DeviceScope scope(engine_);
  if (last_replay_ && !engine_.gpu().event_done(last_replay_)) return false;
  if (done_ && !engine_.gpu().event_done(done_)) return false;  // not all posted yet
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
    // A replayed end lands by its host function or job: added_serial_ says.
    if (!g.end_replayed) {
      ev = g.landed;
      direct = g.end_direct && g.end_serial == serial;
    }
  }
  // The layer's event is recorded again only by its next end, which waits
  // (begin) for the reader: it still marks end `serial` here.
  if (ev) engine_.gpu().event_sync(ev);
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
    if (!g.end_replayed) {
      ev = g.landed;
      direct = g.end_direct && g.end_serial == serial;
    }
  }
  if (ev) {
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
  if (capture_ == Capture::Capturing)
    fail(LWO_ERR_BUSY, "the gradient set is part of a capture under way; end it first "
         "(lwo_ring_capture_end)");
  if (capture_ == Capture::Bound)
    fail(LWO_ERR_BUSY, "a CUDA graph holds the gradient set; %s", holder());
  // The destruction waits for the gradient stream, which another set's
  // capture may have joined: a host wait of captured work.
  engine_.check_not_capturing("destroying a gradient set (it waits for the gradient stream)");
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].slot >= 0) fail(LWO_ERR_BUSY, "layer %zu is begun and not ended", i);
}

// ---- CUDA graphs ----

void Grads::set_end_state(Layer& g, const EndState& e) {
  g.fresh = e.fresh;
  g.stale = e.stale;
  g.end_serial = e.end_serial;
  g.end_direct = e.end_direct;
  g.end_replayed = e.end_replayed;
}

void Grads::set_counters(const Counters& c) {
  end_counter_ = c.end_counter;
  n_transfers_ = c.n_transfers;
  bytes_ = c.bytes;
}

const char* Grads::holder() const {
  return replay_ && replay_->callers
             ? "the caller's graph of a joined capture holds it until lwo_ring_capture_release"
             : "the graph of lwo_ring_capture_end holds it until lwo_graph_destroy";
}

void Grads::check_capture(const char* what) {
  if (capture_ == Capture::Bound)
    fail(LWO_ERR_BUSY, "%s: the gradient set belongs to a CUDA graph: %s", what, holder());
  engine_.check_left_capture(what);  // the gradient stream may still be in the caller's capture
  const void* owner = engine_.capture_owner();
  if (!owner) return;
  if (engine_.capture_pool() != &pool_)
    fail(LWO_ERR_CAPTURING, "%s: ring %p of the engine is capturing a CUDA graph of another "
         "pool, and the gradient stream would join its capture; %s", what, owner,
         engine_.capture_joined() ? "leave it first (lwo_ring_capture_leave)"
                                  : "end it first (lwo_ring_capture_end)");
  if (capture_ == Capture::None) join_capture(what);
}

void Grads::join_capture(const char* what) {
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].slot >= 0)
      fail(LWO_ERR_BUSY, "%s: layer %zu was begun before the capture; end it before "
           "the capture (lwo_ring_capture_begin, lwo_ring_capture_join)", what, i);
  DeviceScope scope(engine_);
  Backend& gpu = engine_.gpu();
  // Nothing of the set may still run: the capture's copies and host work find
  // the slots, the staging buffers and the host gradients free, and its first
  // begins wait on no event from before it.
  gpu.stream_sync(engine_.d2h());
  wait_worker();
  if (!join_event_) join_event_ = gpu.event_create(false);
  if (!land_event_) land_event_ = gpu.event_create(false);
  if (!land_stream_) land_stream_ = gpu.stream_create();
  auto r = std::make_unique<Replay>();
  r->fresh.assign(layers_.size(), -1);
  for (const Layer& g : layers_) r->saved.push_back(end_state(g));
  r->counters = counters();
  for (size_t i = 0; i < slots_.size(); ++i) {
    slots_[i].ever_freed = false;
    slots_.emptied(i);
  }
  replay_ = std::move(r);
  capture_ = Capture::Capturing;
  engine_.join_capture(this);
}

std::string Grads::live() {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].slot >= 0) return strf("gradient layer %zu begun and not ended", i);
  return "";
}

void Grads::join_back(StreamH stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!replay_ || !replay_->joined) return;
  DeviceScope scope(engine_);
  Backend& gpu = engine_.gpu();
  gpu.event_record(join_event_, engine_.d2h());
  gpu.stream_wait(stream, join_event_);
  if (replay_->land_joined) {
    gpu.event_record(join_event_, land_stream_);
    gpu.stream_wait(stream, join_event_);
  }
}

void Grads::land_aside(ReplayEnd* end, StreamH d2h) {
  Backend& gpu = engine_.gpu();
  gpu.event_record(land_event_, d2h);
  gpu.stream_wait(land_stream_, land_event_);
  gpu.host_func(land_stream_, &Grads::replay_landed, end, {});
  replay_->land_joined = replay_->land_pending = true;
}

void Grads::order_landings(StreamH d2h) {
  if (!replay_->land_pending) return;
  Backend& gpu = engine_.gpu();
  gpu.event_record(land_event_, land_stream_);
  gpu.stream_wait(d2h, land_event_);
  replay_->land_pending = false;
}

void Grads::free_slots_after(EventH after) noexcept {
  try {
    DeviceScope scope(engine_);
    Backend& gpu = engine_.gpu();
    if (after) gpu.stream_wait(engine_.d2h(), after);
    for (size_t i = 0; i < slots_.size(); ++i) {
      gpu.event_record(slots_[i].free, engine_.d2h());
      slots_.freed(i);
    }
  } catch (...) {
  }
}

void Grads::ended(bool kept, StreamH stream) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (!replay_) return;
  // The capture ran nothing: the host state is the join's again, and no
  // layer is begun.
  for (size_t i = 0; i < layers_.size(); ++i) {
    set_end_state(layers_[i], replay_->saved[i]);
    layers_[i].slot = -1;
  }
  std::fill(slot_layer_.begin(), slot_layer_.end(), -1);
  set_counters(replay_->counters);
  // Later begins are ordered after the capture's stream. Without one the
  // capture goes on (the caller's, joined): nothing is ordered now; a kept
  // graph's release orders them (released), a dropped capture ran nothing.
  if (stream) {
    EventH after = nullptr;
    try {
      DeviceScope scope(engine_);
      engine_.gpu().event_record(join_event_, stream);
      after = join_event_;
    } catch (...) {
    }
    free_slots_after(after);
  }
  if (kept) {
    capture_ = Capture::Bound;  // the graph holds the set (and a pointer to it)
    replay_->callers = !stream;
  } else {
    capture_ = Capture::None;
    replay_.reset();
  }
}

void Grads::check_launch() {
  check_announced("replaying");
  std::lock_guard<std::mutex> lock(mu_);
  if (capture_ != Capture::Bound) return;
  for (uint32_t l : replay_->layers) {
    const bool fresh = replay_->fresh[l] > 0;
    if (layers_[l].fresh == fresh) continue;
    if (fresh)
      fail(LWO_ERR_TICKET_STATE, "gradient layer %u holds gradients not zeroed since the last "
           "replay (or since its last end), and the graph was captured after lwo_grads_zero: "
           "the replay would overwrite them; call lwo_grads_zero before each replay, as before "
           "the capture", l);
    fail(LWO_ERR_TICKET_STATE, "gradient layer %u was zeroed (lwo_grads_zero), and the graph "
         "was captured with gradients in it: the replay would add to the sums the zero dropped; "
         "capture after lwo_grads_zero to replay after it", l);
  }
}

void Grads::arm() {
  std::vector<uint32_t> layers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (capture_ != Capture::Bound) return;
    layers = replay_->layers;
  }
  // No gradient lands under the optimizer's read of the last one (as begin).
  if (Reader* r = reader_.load())
    for (uint32_t l : layers) r->wait_reading(l);
  std::lock_guard<std::mutex> lock(mu_);
  Replay& r = *replay_;
  r.armed.clear();
  for (uint32_t l : r.layers) r.armed.push_back(end_state(layers_[l]));
  r.armed_counters = counters();
  std::lock_guard<std::mutex> qlock(q_mu_);
  for (const std::unique_ptr<ReplayEnd>& e : r.ends) {
    Layer& g = layers_[e->layer];
    const uint64_t serial = ++end_counter_;
    replay_serials_[e->layer].push_back(serial);
    g.end_serial = serial;
    g.end_direct = e->direct;
    g.end_replayed = true;
    g.fresh = false;
    g.stale = false;
    ++n_transfers_;
    bytes_ += e->bytes;
  }
}

void Grads::disarm() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (capture_ != Capture::Bound) return;
  Replay& r = *replay_;
  for (size_t i = 0; i < r.layers.size(); ++i) set_end_state(layers_[r.layers[i]], r.armed[i]);
  set_counters(r.armed_counters);
  std::lock_guard<std::mutex> qlock(q_mu_);
  for (const std::unique_ptr<ReplayEnd>& e : r.ends) replay_serials_[e->layer].pop_back();
}

void Grads::launched(EventH done) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (capture_ == Capture::Bound) last_replay_ = done;
}

void Grads::released(EventH last) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (capture_ != Capture::Bound) return;
  // The graph's launches are done (their host functions have run): eager
  // begins are ordered after its readers of the slots.
  free_slots_after(last);
  capture_ = Capture::None;
  replay_.reset();
  last_replay_ = nullptr;
}

}  // namespace lwo
