// A random walk over one ring: stages random layers (ahead, hits, busy and
// full attempts), acquires on several consumer streams, checksums what it
// reads, releases in and out of order, tries stale and double-acquired
// tickets, and predicts every status, every hit and the exact copy
// accounting from a model of the ring that uses only documented behaviour:
//   - a layer staged or held under a live ticket -> LWO_ERR_LAYER_BUSY;
//   - a layer released and not overwritten -> a hit (no copy);
//   - otherwise the least recently used free slot (never used, else released
//     longest ago) is overwritten, or LWO_ERR_RING_FULL when there is none.
#pragma once

#include <map>
#include <set>

#include "gpu_util.h"

namespace lwo_test {

struct WalkOptions {
  uint32_t depth = 2;
  uint32_t n_ops = 500;
  uint32_t n_streams = 2;       // 2 or 3; the third is the legacy default stream
  uint64_t seed = 1;
  double tensor_check_prob = 0.2;  // also checksum single tensors
  bool delays = true;           // now and then stall a consumer or the transfer stream
};

struct WalkResult {
  uint64_t stages = 0, hits = 0, misses = 0, ring_full = 0, layer_busy = 0;
  uint64_t acquires = 0, releases = 0, misuses = 0, checks = 0;
};

inline void random_walk(lwo_engine* engine, TestPool& tp, const WalkOptions& opt,
                        WalkResult* res) {
  std::mt19937_64 rng(opt.seed);
  auto coin = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };

  lwo_stream_t transfer = nullptr;
  CHECK_LWO(lwo_engine_transfer_stream(engine, &transfer));

  Stream owned[2];
  CUDA_OK(cudaStreamCreateWithFlags(owned[0].out(), cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(owned[1].out(), cudaStreamDefault));
  std::vector<cudaStream_t> streams = {owned[0].get(), owned[1].get()};
  if (opt.n_streams >= 3) streams.push_back(nullptr);  // legacy default stream

  Checks checks;
  ASSERT_NO_FATAL_FAILURE(checks.init(size_t(opt.n_ops) * 6 + 16));

  Ring ring;
  ASSERT_NO_FATAL_FAILURE(create_ring(tp.pool, opt.depth, 0, &ring));
  {
    lwo_ring_info in = ring_info(ring.get());
    ASSERT_EQ(opt.depth, in.depth);
    ASSERT_EQ(opt.depth, in.n_free);
    ASSERT_EQ(tp.max_record, in.slot_bytes);
  }

  // The model.
  struct Held {
    lwo_ticket t;
    bool acquired = false;
    size_t stream = 0;
  };
  std::map<uint32_t, Held> held;              // layer -> live ticket
  std::map<uint32_t, uint64_t> resident;      // released layer -> release clock
  uint32_t n_empty = opt.depth;
  uint64_t clock = 0;
  uint64_t exp_copies = 0, exp_bytes = 0;
  std::vector<lwo_ticket> dead;               // released tickets
  std::vector<uint32_t> recent;               // recently released layers

  // On any early return, release what is still held so the ring can go.
  auto cleanup = defer([&] {
    for (auto& kv : held) (void)lwo_ring_release(ring.get(), kv.second.t, streams[kv.second.stream]);
    held.clear();
  });

  auto do_release = [&](uint32_t layer, size_t stream_idx) {
    Held h = held.at(layer);
    CHECK_LWO(lwo_ring_release(ring.get(), h.t, streams[stream_idx]));
    ASSERT_STREQ("", lwo_last_error_message());
    held.erase(layer);
    resident[layer] = ++clock;
    dead.push_back(h.t);
    if (dead.size() > 16) dead.erase(dead.begin());
    recent.push_back(layer);
    if (recent.size() > 2 * opt.depth + 2) recent.erase(recent.begin());
    ++res->releases;
  };

  const uint32_t n_layers = tp.n_layers();
  for (uint32_t op = 0; op < opt.n_ops; ++op) {
    SCOPED_TRACE("op " + std::to_string(op));
    // Phases of 100 operations alternate between filling the ring (mostly
    // stages: runs into LWO_ERR_RING_FULL) and draining it (mostly releases).
    const bool filling = (op / 100) % 2 == 0;
    const double p_stage = filling ? 0.60 : 0.25;
    const double p_acquire = p_stage + 0.30;
    double r = std::uniform_real_distribution<double>(0, 1)(rng);
    std::vector<uint32_t> staged;
    for (auto& kv : held)
      if (!kv.second.acquired) staged.push_back(kv.first);

    // A full ring mostly turns a stage into an acquire or a release.
    if (r < p_stage && held.size() >= opt.depth && coin(0.8)) r = staged.empty() ? 0.9 : p_stage;
    if (r < p_stage || (r < p_acquire && staged.empty()) || (r < 0.95 && held.empty())) {
      // ---- stage: a layer still in a slot (a hit), now and then a held one
      // (busy), else any layer ----
      uint32_t layer;
      std::vector<uint32_t> in_slot;
      for (uint32_t l : recent)
        if (resident.count(l)) in_slot.push_back(l);
      if (!in_slot.empty() && coin(0.4))
        layer = in_slot[pick(in_slot.size())];
      else if (!held.empty() && coin(0.05))
        layer = std::next(held.begin(), static_cast<long>(pick(held.size())))->first;
      else
        layer = static_cast<uint32_t>(pick(n_layers));
      if (opt.delays && coin(0.03)) CUDA_OK(stream_delay(transfer, 100 + pick(400)));

      lwo_status_t want;
      bool hit = false;
      if (held.count(layer))
        want = LWO_ERR_LAYER_BUSY;
      else if (resident.count(layer)) {
        want = LWO_OK;
        hit = true;
      } else if (held.size() >= opt.depth)
        want = LWO_ERR_RING_FULL;
      else
        want = LWO_OK;

      lwo_ticket t{0};
      lwo_status_t s = lwo_ring_stage(ring.get(), layer, &t);
      std::string msg = lwo_last_error_message();
      ASSERT_EQ(std::string(lwo_status_string(want)), lwo_status_string(s))
          << "lwo_ring_stage(layer " << layer << "), held " << held.size() << "/" << opt.depth
          << ": " << msg;
      if (s != LWO_OK) {
        ASSERT_NE(std::string::npos, msg.find("lwo_ring_stage")) << msg;
        if (s == LWO_ERR_RING_FULL) ++res->ring_full;
        else ++res->layer_busy;
        continue;
      }
      ASSERT_EQ("", msg);
      ASSERT_NE(0u, t.id);
      ++res->stages;
      if (hit) {
        resident.erase(layer);
        ++res->hits;
      } else {
        ++res->misses;
        if (n_empty > 0) {
          --n_empty;
        } else {
          auto lru = resident.begin();
          for (auto it = resident.begin(); it != resident.end(); ++it)
            if (it->second < lru->second) lru = it;
          ASSERT_NE(resident.end(), lru);
          resident.erase(lru);
        }
        exp_copies += tp.layers[layer].copy_runs;
        exp_bytes += tp.layers[layer].copy_bytes;
      }
      held[layer] = Held{t, false, 0};
    } else if (r < p_acquire) {
      // ---- acquire, read, maybe release at once ----
      uint32_t layer = staged[pick(staged.size())];
      Held& h = held.at(layer);
      size_t si = pick(streams.size());
      cudaStream_t st = streams[si];
      if (opt.delays && coin(0.05)) CUDA_OK(stream_delay(st, 100 + pick(400)));
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      CHECK_LWO(lwo_ring_acquire(ring.get(), h.t, st, &v));
      h.acquired = true;
      h.stream = si;
      ++res->acquires;
      const LayerRef& lr = tp.layers[layer];
      ASSERT_EQ(layer, v.layer);
      ASSERT_EQ(lr.tensors.size(), v.n_tensors);
      ASSERT_EQ(lr.record_bytes, v.record_bytes);
      ASSERT_NE(nullptr, v.base);
      ASSERT_EQ(0u, reinterpret_cast<uintptr_t>(v.base) % LWO_RECORD_ALIGN);
      for (uint32_t i = 0; i < v.n_tensors; ++i)
        ASSERT_EQ(static_cast<uint8_t*>(v.base) + lr.tensors[i].offset, v.tensors[i]);
      bool tensors = !lr.whole_check || coin(opt.tensor_check_prob);
      if (lr.whole_check && lr.whole_bytes)
        CUDA_OK(checks.add(v.base, lr.whole_bytes, lr.whole_sum, st,
                           "op " + std::to_string(op) + " layer " + std::to_string(layer)));
      if (tensors && v.n_tensors) {
        int n = lr.whole_check ? 1 : static_cast<int>(v.n_tensors);
        for (int k = 0; k < n; ++k) {
          uint32_t i = lr.whole_check ? static_cast<uint32_t>(pick(v.n_tensors)) : uint32_t(k);
          const TensorRef& tr = lr.tensors[i];
          void* p = nullptr;
          CHECK_LWO(lwo_ring_tensor(ring.get(), h.t, tr.name.c_str(), &p));
          ASSERT_EQ(v.tensors[i], p);
          if (tr.bytes)
            CUDA_OK(checks.add(p, tr.bytes, tr.sum, st,
                               "op " + std::to_string(op) + " layer " + std::to_string(layer) +
                                   " tensor " + tr.name));
        }
      }
      if (coin(filling ? 0.5 : 0.9)) {
        ASSERT_NO_FATAL_FAILURE(do_release(layer, si));
      }
    } else if (r < 0.95) {
      // ---- release any live ticket, out of order ----
      uint32_t layer = std::next(held.begin(), static_cast<long>(pick(held.size())))->first;
      Held& h = held.at(layer);
      size_t si = h.acquired ? h.stream : pick(streams.size());
      if (h.acquired && streams.size() > 1 && coin(0.15)) {
        // Join the reader's stream into another one and release there.
        size_t other = (h.stream + 1 + pick(streams.size() - 1)) % streams.size();
        cudaEvent_t ev = nullptr;
        CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        CUDA_OK(cudaEventRecord(ev, streams[h.stream]));
        CUDA_OK(cudaStreamWaitEvent(streams[other], ev, 0));
        CUDA_OK(cudaEventDestroy(ev));
        si = other;
      }
      ASSERT_NO_FATAL_FAILURE(do_release(layer, si));
    } else {
      // ---- misuse, expected to fail without side effects ----
      ++res->misuses;
      int kind = static_cast<int>(pick(3));
      if (kind == 0 && !dead.empty()) {
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_acquire",
                       lwo_ring_acquire(ring.get(), dead[pick(dead.size())], streams[0], &v));
      } else if (kind == 1 && !dead.empty()) {
        EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_release",
                       lwo_ring_release(ring.get(), dead[pick(dead.size())], streams[0]));
      } else {
        bool done = false;
        for (auto& kv : held) {
          if (!kv.second.acquired) continue;
          lwo_layer_view v = LWO_LAYER_VIEW_INIT;
          EXPECT_LWO_ERR(LWO_ERR_TICKET_STATE, "lwo_ring_acquire",
                         lwo_ring_acquire(ring.get(), kv.second.t, streams[0], &v));
          done = true;
          break;
        }
        if (!done && !dead.empty()) {
          void* p = nullptr;
          EXPECT_LWO_ERR(LWO_ERR_STALE_TICKET, "lwo_ring_tensor",
                         lwo_ring_tensor(ring.get(), dead.back(), tp.layers[0].tensors[0].name.c_str(),
                                         &p));
        }
      }
    }
    if (op % 64 == 0) {
      lwo_ring_info in = ring_info(ring.get());
      ASSERT_EQ(opt.depth - held.size(), in.n_free);
    }
    if (op % 128 == 0) EXPECT_LWO_OK(lwo_engine_check(engine));
  }

  // Release what is still out: acquired ones on their stream, staged ones anywhere.
  while (!held.empty()) {
    auto it = held.begin();
    ASSERT_NO_FATAL_FAILURE(
        do_release(it->first, it->second.acquired ? it->second.stream : pick(streams.size())));
  }
  ASSERT_EQ(opt.depth, ring_info(ring.get()).n_free);

  lwo_ring_stats st = ring_stats(ring.get());
  EXPECT_EQ(res->stages, st.n_stages);
  EXPECT_EQ(res->hits, st.n_hits);
  EXPECT_EQ(exp_copies, st.n_copies);
  EXPECT_EQ(exp_bytes, st.bytes_copied);
  EXPECT_EQ(0.0, st.copy_ms) << "no LWO_RING_TIMING: copy_ms must stay 0";

  EXPECT_LWO_OK(lwo_engine_check(engine));
  for (cudaStream_t s : streams) CUDA_OK(cudaStreamSynchronize(s));
  CHECK_LWO(lwo_engine_synchronize(engine));
  res->checks = checks.size();
  checks.verify();
  CHECK_LWO(ring.reset());
}

inline std::string describe(const WalkResult& r) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%llu stages (%llu hits, %llu misses), %llu ring-full, %llu layer-busy, "
                "%llu acquires, %llu releases, %llu misuses, %llu checksums",
                (unsigned long long)r.stages, (unsigned long long)r.hits,
                (unsigned long long)r.misses, (unsigned long long)r.ring_full,
                (unsigned long long)r.layer_busy, (unsigned long long)r.acquires,
                (unsigned long long)r.releases, (unsigned long long)r.misuses,
                (unsigned long long)r.checks);
  return buf;
}

}  // namespace lwo_test
