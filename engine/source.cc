#include "source.h"

#include <algorithm>
#include <cstring>

#include "src/checkpoint/checkpoint.h"
#include "src/common/error.h"
#include "src/common/parallel.h"
#include "src/common/sigbus.h"

namespace lwo {

void Source::check_readable() const {
  check_copies();
  if (ckpt_) ckpt_->check_unchanged();
}

namespace {

// Copies every run of a layer, as `fill` found them, into place.
Source::Moved copy_runs_h2d(Backend& gpu, const HostLayer& l, uint8_t* dst, StreamH h2d) {
  Source::Moved m;
  for (const CopyRun& r : l.runs) {
    gpu.copy_h2d(dst + r.dst_offset, r.src, r.bytes, h2d);
    m.bytes += r.bytes;
    ++m.n_copies;
  }
  return m;
}

}  // namespace

Source::Moved DirectSource::fill(const HostLayer& l, DeviceSlot& slot) {
  Backend& gpu = engine_.gpu();
  Moved m = copy_runs_h2d(gpu, l, slot.dev, engine_.h2d());
  gpu.event_record(slot.ready, engine_.h2d());
  return m;
}

// ---- staged ----

namespace {

// A host function on the fill stream: packs a layer's copy runs from their
// (not DMA-ready) sources into a pinned staging buffer, from several threads
// when the record is large (one per 16 MiB, at most 8). Out of a checkpoint's
// mapping (`source` set) every chunk is a guarded copy: a file cut short
// meanwhile is a fault the source remembers, not a SIGBUS that kills.
struct FillJob {
  const std::vector<CopyRun>* runs;
  uint8_t* dst;
  ThreadPool* threads;    // the engine's
  StagedSource* source;  // null: the runs are the caller's memory
};

void run_fill(void* p) {
  std::unique_ptr<FillJob> job(static_cast<FillJob*>(p));
  const std::vector<CopyRun>& runs = *job->runs;
  uint64_t total = 0;
  for (const CopyRun& r : runs) total += r.bytes;
  const uint64_t n = std::min<uint64_t>(8, std::max<uint64_t>(1, total >> 24));
  // Part k of n copies the k-th n-th of every run. The parts are taken in
  // turn (chunks of one part), so that a thread of the pool busy with other
  // work holds up no pack.
  parallel_for(
      *job->threads, n, static_cast<uint32_t>(n), 1, 1,
      [&](uint64_t pb, uint64_t pe) {
        for (uint64_t part = pb; part < pe; ++part)
          for (const CopyRun& r : runs) {
            uint64_t chunk = (r.bytes + n - 1) / n;
            uint64_t b = std::min(r.bytes, chunk * part), e = std::min(r.bytes, chunk * (part + 1));
            if (b >= e) continue;
            if (!job->source) {
              std::memcpy(job->dst + r.dst_offset + b, r.src + b, e - b);
            } else if (const void* at =
                           guarded_copy(job->dst + r.dst_offset + b, r.src + b, e - b)) {
              job->source->copy_faulted(at);
              return;  // the layer is lost: the rest of this part is not worth reading
            }
          }
      },
      2);
}

}  // namespace

void StagedSource::attach(uint64_t slot_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!staging_.empty() && staging_[0].buf.bytes() >= slot_bytes) return;
  Backend& gpu = engine_.gpu();
  DeviceScope scope(engine_);
  std::vector<Staging> st(2);
  StreamH fs = nullptr;
  try {
    for (Staging& s : st) {
      s.buf = PinnedArena(engine_, slot_bytes, 0, "checkpoint staging buffer");
      s.ready = gpu.event_create(false);
      s.free = gpu.event_create(false);
    }
    fs = fill_stream_ ? fill_stream_ : gpu.stream_create();
  } catch (...) {
    for (Staging& s : st) {
      gpu.event_destroy(s.ready);
      gpu.event_destroy(s.free);
    }
    throw;
  }
  // Slots are sized alike for every ring of a pool: this runs once.
  staging_ = std::move(st);
  fill_stream_ = fs;
}

StagedSource::~StagedSource() {
  Backend& gpu = engine_.gpu();
  try {
    DeviceScope scope(engine_);
    if (fill_stream_) gpu.stream_sync(fill_stream_);
    for (Staging& st : staging_)
      if (st.used) gpu.event_sync(st.free);
  } catch (...) {
  }
  try {
    DeviceScope scope(engine_);
    for (Staging& st : staging_) {
      gpu.event_destroy(st.ready);
      gpu.event_destroy(st.free);
    }
    staging_.clear();
    if (fill_stream_) gpu.stream_destroy(fill_stream_);
  } catch (...) {
  }
}

Source::Moved StagedSource::fill(const HostLayer& l, DeviceSlot& slot) {
  // Fill stream: wait until the staging buffer's last copy to the device is
  // done, pack the layer into it, mark it ready. Transfer stream: wait for
  // that, copy it to the slot, free the buffer. Two buffers alternate, so the
  // host packs one layer while the link carries the previous one.
  std::lock_guard<std::mutex> lock(mu_);
  Backend& gpu = engine_.gpu();
  StreamH h2d = engine_.h2d();
  Staging& st = staging_[next_++ % staging_.size()];
  if (st.used) gpu.stream_wait(fill_stream_, st.free);
  Moved m;
  uint64_t extent = 0;  // the bytes the runs fill, as the direct path copies
  for (const CopyRun& r : l.runs) {
    extent = std::max(extent, r.dst_offset + r.bytes);
    m.bytes += r.bytes;
  }
  auto job = std::make_unique<FillJob>(
      FillJob{&l.runs, st.buf.data(), &engine_.threads(), ckpt_ ? this : nullptr});
  gpu.host_func(fill_stream_, run_fill, job.get(), {{st.buf.data(), extent, true}});
  job.release();
  gpu.event_record(st.ready, fill_stream_);
  gpu.stream_wait(h2d, st.ready);
  if (extent) {
    gpu.copy_h2d(slot.dev, st.buf.data(), extent, h2d);
    m.n_copies = 1;
  }
  gpu.event_record(st.free, h2d);
  st.used = true;
  gpu.event_record(slot.ready, h2d);
  // A backend that ran the fill already (the recording one does): its fault
  // is this stage's status.
  check_copies();
  return m;
}

void StagedSource::copy_faulted(const void* addr) noexcept {
  try {
    std::lock_guard<std::mutex> lock(fault_mu_);
    if (faulted_.load()) return;  // the first fault tells
    const uint8_t* a = static_cast<const uint8_t*>(addr);
    std::string file = "a file of " + st::printable(ckpt_->path(), '\'');
    uint64_t at = 0;
    for (const Checkpoint::File& f : ckpt_->files())
      if (a >= f.map && a < f.map + f.size) {
        file = st::printable(f.path, '\'');
        at = static_cast<uint64_t>(a - f.map);
        break;
      }
    fault_ = strf("%s was cut short while a layer was copied out of its mapping (reading byte "
                  "%llu faulted); reopen the checkpoint once the file is whole",
                  file.c_str(), static_cast<unsigned long long>(at));
  } catch (...) {
    fault_.clear();
  }
  faulted_.store(true);
}

void StagedSource::check_copies() const {
  if (!faulted_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(fault_mu_);
  fail(LWO_ERR_FILE_CHANGED, "%s",
       fault_.empty() ? "a checkpoint file was cut short while a layer was copied out of it"
                      : fault_.c_str());
}

// ---- sharded ----

Source::Moved ShardedSource::fill(const HostLayer& l, DeviceSlot& slot) {
  // The local shard goes up this rank's link; the other ranks' shards come
  // over the GPUs' links: all-gather the record into the slot on the
  // collective stream, which then holds the slot's ready event.
  Backend& gpu = engine_.gpu();
  StreamH h2d = engine_.h2d(), cs = engine_.collective_stream();
  Moved m = copy_runs_h2d(gpu, l, slot.dev, h2d);
  gpu.event_record(slot.aux, h2d);
  gpu.stream_wait(cs, slot.aux);
  gpu.all_gather(slot.dev + l.shard_bytes * static_cast<uint64_t>(rank_), slot.dev,
                 l.shard_bytes, communicator_, cs);
  gpu.event_record(slot.ready, cs);
  m.ready_elsewhere = true;
  return m;
}

}  // namespace lwo
