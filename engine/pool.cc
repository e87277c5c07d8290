#include "pool.h"

#include <algorithm>
#include <cstring>

#include "src/common/error.h"

namespace lwo {

void Pool::build_layouts(const lwo_layer_desc* layers, uint32_t n_layers, const char* call) {
  if (n_layers == 0) fail(LWO_ERR_INVALID_ARGUMENT, "%s: n_layers is 0", call);
  if (!layers) fail(LWO_ERR_INVALID_ARGUMENT, "%s: layers is NULL", call);
  layers_.resize(n_layers);
  versions_.reset(new std::atomic<uint64_t>[n_layers]);
  for (uint32_t i = 0; i < n_layers; ++i) versions_[i].store(0);
  for (uint32_t i = 0; i < n_layers; ++i) {
    layers_[i].layout = make_layout(layers[i], strf("%s: layer %u", call, i), registered_);
    uint64_t rb = layers_[i].layout.record_bytes;
    if (__builtin_add_overflow(total_bytes_, rb, &total_bytes_))
      fail(LWO_ERR_OUT_OF_RANGE, "%s: total pool size overflows", call);
    max_record_ = std::max(max_record_, rb);
  }
  if (max_record_ == 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: every layer of the %u is empty (0 bytes)", call,
         n_layers);
}

std::unique_ptr<Pool> Pool::create_pinned(Engine& engine, const lwo_layer_desc* layers,
                                          uint32_t n_layers, const lwo_pool_config& cfg) {
  static const char* call = "lwo_pool_create_pinned";
  std::unique_ptr<Pool> pool(new Pool(engine, false));
  pool->build_layouts(layers, n_layers, call);
  DeviceScope scope(engine);
  pool->arena_ = PinnedArena(engine.gpu(), pool->total_bytes_, cfg.n_threads, call);
  uint64_t off = 0;
  for (auto& l : pool->layers_) {
    l.host = pool->arena_.data() + off;
    if (l.layout.record_bytes) l.runs.push_back({0, l.host, l.layout.record_bytes});
    off += l.layout.record_bytes;
  }
  return pool;
}

std::unique_ptr<Pool> Pool::create_sharded(Engine& engine, const lwo_layer_desc* layers,
                                           uint32_t n_layers, void* comm,
                                           const lwo_pool_config& cfg) {
  static const char* call = "lwo_pool_create_sharded";
  if (!comm) fail(LWO_ERR_INVALID_ARGUMENT, "%s: comm is NULL", call);
  std::unique_ptr<Pool> pool(new Pool(engine, false));
  pool->build_layouts(layers, n_layers, call);
  DeviceScope scope(engine);
  Backend& gpu = engine.gpu();
  int n = 1, r = 0;
  gpu.comm_info(comm, &n, &r);
  pool->comm_ = comm;
  pool->rank_ = r;
  pool->n_ranks_ = n;
  uint64_t total = 0, max_slot = 0;
  for (Layer& l : pool->layers_) {
    uint64_t rb = l.layout.record_bytes;
    l.shard_bytes = align_up((rb + n - 1) / n, LWO_RECORD_ALIGN);
    total += l.shard_bytes;
    max_slot = std::max(max_slot, l.shard_bytes * static_cast<uint64_t>(n));
  }
  // Every rank must describe the same layers: compare (layer count, a hash
  // of the record sizes) across the ranks before any collective can hang.
  {
    uint64_t mine[2] = {n_layers, 1469598103934665603ull};
    auto mix = [&](uint64_t v) { mine[1] = (mine[1] ^ v) * 1099511628211ull; };
    for (const Layer& l : pool->layers_) {
      mix(l.layout.record_bytes);
      for (const TensorLayout& t : l.layout.tensors) {
        mix(t.offset);
        mix(t.bytes);
        mix(static_cast<uint64_t>(t.dtype));
      }
    }
    PinnedArena host(gpu, 16 * static_cast<size_t>(n), 1, call);
    std::memcpy(host.data() + 16 * r, mine, 16);
    uint8_t* dev = static_cast<uint8_t*>(gpu.device_alloc(16 * static_cast<size_t>(n)));
    try {
      StreamH st = engine.comm();
      gpu.copy_h2d(dev + 16 * r, host.data() + 16 * r, 16, st);
      gpu.all_gather(dev + 16 * r, dev, 16, comm, st);
      gpu.copy_d2h(host.data(), dev, 16 * static_cast<size_t>(n), st);
      gpu.stream_sync(st);
    } catch (...) {
      gpu.device_free(dev);
      throw;
    }
    gpu.device_free(dev);
    for (int k = 0; k < n; ++k) {
      uint64_t theirs[2];
      std::memcpy(theirs, host.data() + 16 * k, 16);
      if (theirs[0] != mine[0] || theirs[1] != mine[1])
        fail(LWO_ERR_COLLECTIVE_MISMATCH,
             "%s: rank %d describes %llu layers (layout hash 0x%llx), rank %d %llu layers "
             "(0x%llx): every rank must create the same layers, with the same tensor sizes and "
             "dtypes",
             call, r, static_cast<unsigned long long>(mine[0]),
             static_cast<unsigned long long>(mine[1]), k,
             static_cast<unsigned long long>(theirs[0]), static_cast<unsigned long long>(theirs[1]));
    }
  }
  pool->total_bytes_ = total;
  pool->max_record_ = max_slot;
  pool->arena_ = PinnedArena(gpu, total, cfg.n_threads, call);
  uint64_t off = 0;
  for (Layer& l : pool->layers_) {
    l.host = pool->arena_.data() + off;
    if (l.shard_bytes) l.runs.push_back({l.shard_bytes * static_cast<uint64_t>(r), l.host, l.shard_bytes});
    off += l.shard_bytes;
  }
  return pool;
}

std::unique_ptr<Pool> Pool::create_registered(Engine& engine, const lwo_layer_desc* layers,
                                              uint32_t n_layers, const lwo_host_region* regions,
                                              uint32_t n_regions, const lwo_pool_config&) {
  static const char* call = "lwo_pool_create_registered";
  std::unique_ptr<Pool> pool(new Pool(engine, true));
  pool->build_layouts(layers, n_layers, call);
  if (n_regions == 0 || !regions)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: no host regions given (regions %p, n_regions %u)", call,
         static_cast<const void*>(regions), n_regions);
  std::vector<Region> rs;
  for (uint32_t i = 0; i < n_regions; ++i) {
    if (!regions[i].data || regions[i].bytes == 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: region %u is empty (data %p, %llu bytes)", call, i,
           regions[i].data, static_cast<unsigned long long>(regions[i].bytes));
    uintptr_t b = reinterpret_cast<uintptr_t>(regions[i].data);
    if (b + regions[i].bytes < b)
      fail(LWO_ERR_OUT_OF_RANGE, "%s: region %u wraps around the address space", call, i);
    rs.push_back({static_cast<uint8_t*>(const_cast<void*>(regions[i].data)), regions[i].bytes,
                  false});
  }
  std::sort(rs.begin(), rs.end(), [](const Region& a, const Region& b) { return a.data < b.data; });
  for (size_t i = 1; i < rs.size(); ++i)
    if (rs[i - 1].data + rs[i - 1].bytes > rs[i].data)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: host regions at %p and %p overlap", call,
           static_cast<void*>(rs[i - 1].data), static_cast<void*>(rs[i].data));
  auto region_of = [&](const uint8_t* p, uint64_t n) -> const Region* {
    auto it = std::upper_bound(rs.begin(), rs.end(), p,
                               [](const uint8_t* q, const Region& r) { return q < r.data; });
    if (it == rs.begin()) return nullptr;
    --it;
    if (p + n <= it->data + it->bytes && p + n >= p) return &*it;
    return nullptr;
  };
  // Copy plan: tensors whose host addresses keep the record's relative layout
  // within one region merge into one run.
  for (uint32_t li = 0; li < pool->layers_.size(); ++li) {
    Layer& l = pool->layers_[li];
    const Region* run_region = nullptr;
    for (const TensorLayout& t : l.layout.tensors) {
      if (t.bytes == 0) continue;
      const uint8_t* src = static_cast<const uint8_t*>(t.host_data);
      const Region* r = region_of(src, t.bytes);
      if (!r)
        fail(LWO_ERR_OUT_OF_RANGE,
             "%s: layer %u tensor '%s' (%p, %llu bytes) is not inside any given region", call,
             li, t.name.c_str(), t.host_data, static_cast<unsigned long long>(t.bytes));
      if (!l.runs.empty() && r == run_region) {
        CopyRun& prev = l.runs.back();
        if (prev.src + (t.offset - prev.dst_offset) == src) {
          prev.bytes = t.offset + t.bytes - prev.dst_offset;
          continue;
        }
      }
      l.runs.push_back({t.offset, src, t.bytes});
      run_region = r;
    }
    if (l.runs.size() == 1 && l.runs[0].dst_offset == 0)
      l.host = const_cast<uint8_t*>(l.runs[0].src);
  }
  DeviceScope scope(engine);
  try {
    for (Region& r : rs) r.we_registered = engine.gpu().host_register(r.data, r.bytes, true);
  } catch (const Error& e) {
    for (Region& r : rs)
      if (r.we_registered) engine.gpu().host_unregister(r.data);
    fail(e.status(), "%s: %s", call, e.what());
  }
  pool->regions_ = std::move(rs);
  return pool;
}

std::unique_ptr<Pool> Pool::create_from_checkpoint(
    Engine& engine, std::shared_ptr<Checkpoint> ckpt,
    const std::vector<std::vector<size_t>>& layers, const std::vector<std::string>& strip,
    bool staged, const char* call) {
  std::unique_ptr<Pool> pool(new Pool(engine, true));
  if (layers.empty()) fail(LWO_ERR_INVALID_ARGUMENT, "%s: '%s': no layers", call, ckpt->path().c_str());
  const auto& entries = ckpt->entries();
  pool->layers_.resize(layers.size());
  pool->versions_.reset(new std::atomic<uint64_t>[layers.size()]);
  for (size_t l = 0; l < layers.size(); ++l) {
    pool->versions_[l].store(0);
    Layer& L = pool->layers_[l];
    uint64_t sum = 0, lo = UINT64_MAX, hi = 0;
    bool one_file = true;
    for (size_t k : layers[l]) {
      const st::Entry& e = entries[k];
      if (lwo::dtype_size(e.dtype) == 0)
        fail(LWO_ERR_BAD_DTYPE, "%s: '%s': tensor '%s' of layer %zu is %s, which lwo cannot stream",
             call, ckpt->path().c_str(), e.name.c_str(), l, e.dtype_name.c_str());
      if (e.file != entries[layers[l][0]].file) one_file = false;
      sum += e.end - e.begin;
      lo = std::min(lo, e.begin);
      hi = std::max(hi, e.end);
      if (e.shape.size() > LWO_MAX_DIMS)
        fail(LWO_ERR_UNSUPPORTED, "%s: '%s': tensor '%s' has %zu dimensions (at most %d)", call,
             ckpt->path().c_str(), e.name.c_str(), e.shape.size(), LWO_MAX_DIMS);
    }
    // Tensors that lie together in one file keep the file's layout, so the
    // layer moves in one copy; others are packed at 256-byte boundaries.
    bool file_layout = one_file && !layers[l].empty() && (hi - lo) <= sum + sum / 4 + 4096;
    uint64_t off = 0;
    for (size_t k : layers[l]) {
      const st::Entry& e = entries[k];
      TensorLayout t;
      t.name = e.name;
      if (!strip[l].empty() && t.name.compare(0, strip[l].size(), strip[l]) == 0)
        t.name = t.name.substr(strip[l].size());
      if (t.name.empty())
        fail(LWO_ERR_INVALID_ARGUMENT,
             "%s: '%s': tensor '%s' has no name left in layer %zu once the prefix '%s' is taken "
             "off (end the pattern before the tensor's own name)",
             call, ckpt->path().c_str(), e.name.c_str(), l, strip[l].c_str());
      t.dtype = e.dtype;
      t.n_dims = static_cast<int32_t>(e.shape.size());
      for (size_t d = 0; d < e.shape.size(); ++d) t.shape[d] = e.shape[d];
      t.bytes = e.end - e.begin;
      t.host_data = ckpt->bytes(e);
      if (file_layout) {
        t.offset = e.begin - lo;
      } else {
        t.offset = off;
        off = align_up(off + t.bytes, LWO_RECORD_ALIGN);
        if (t.bytes) L.runs.push_back({t.offset, static_cast<const uint8_t*>(t.host_data), t.bytes});
      }
      L.layout.tensors.push_back(std::move(t));
    }
    if (file_layout) {
      L.layout.record_bytes = align_up(hi - lo, LWO_RECORD_ALIGN);
      if (hi > lo) L.runs.push_back({0, ckpt->files()[entries[layers[l][0]].file].map + lo, hi - lo});
      L.host = const_cast<uint8_t*>(ckpt->files()[entries[layers[l][0]].file].map + lo);
    } else {
      L.layout.record_bytes = off;
    }
    pool->total_bytes_ += L.layout.record_bytes;
    pool->max_record_ = std::max(pool->max_record_, L.layout.record_bytes);
  }
  if (pool->max_record_ == 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: '%s': every layer is empty", call, ckpt->path().c_str());
  DeviceScope scope(engine);
  pool->staged_ = staged;
  if (!staged) {
    // Register every mapped file for DMA, read-only, in place. Refused: stage.
    try {
      for (const Checkpoint::File& f : ckpt->files())
        if (f.size) {
          Region r{f.map, f.size, false};
          r.we_registered = engine.gpu().host_register(f.map, f.size, true);
          pool->regions_.push_back(r);
        }
    } catch (const Error&) {
      for (Region& r : pool->regions_)
        if (r.we_registered) engine.gpu().host_unregister(r.data);
      pool->regions_.clear();
      pool->staged_ = true;
    }
  }
  pool->ckpt_ = std::move(ckpt);
  return pool;
}

Pool::~Pool() {
  try {
    DeviceScope scope(engine_);
    Backend& gpu = engine_.gpu();
    for (Region& r : regions_)
      if (r.we_registered) gpu.host_unregister(r.data);
    arena_ = PinnedArena();
  } catch (...) {
  }
}

const Pool::Layer& Pool::layer(uint32_t id, const char* call) const {
  if (id >= layers_.size())
    fail(LWO_ERR_OUT_OF_RANGE, "%s: layer %u is out of range (pool has %zu layers)", call, id,
         layers_.size());
  return layers_[id];
}

uint32_t Pool::tensor_index(uint32_t layer_id, const char* name, const char* call) const {
  const Layer& l = layer(layer_id, call);
  if (!name) fail(LWO_ERR_INVALID_ARGUMENT, "%s: tensor name is NULL", call);
  int i = l.layout.find(name);
  if (i < 0)
    fail(LWO_ERR_NOT_FOUND, "%s: layer %u has no tensor named '%.255s' (it has %zu tensors)",
         call, layer_id, name, l.layout.tensors.size());
  return static_cast<uint32_t>(i);
}

void Pool::write(uint32_t layer_id, const char* name, const void* src, uint64_t bytes) {
  static const char* call = "lwo_pool_write";
  if (ckpt_)
    fail(LWO_ERR_UNSUPPORTED, "%s: the pool maps checkpoint '%s' read-only; it cannot be written",
         call, ckpt_->path().c_str());
  if (registered_)
    fail(LWO_ERR_UNSUPPORTED,
         "%s: the pool is registered caller memory; write to the caller's memory directly", call);
  uint32_t ti = tensor_index(layer_id, name, call);
  const Layer& l = layers_[layer_id];
  const TensorLayout& t = l.layout.tensors[ti];
  if (bytes != t.bytes)
    fail(LWO_ERR_SIZE_MISMATCH, "%s: layer %u tensor '%s' holds %llu bytes, given %llu", call,
         layer_id, name, static_cast<unsigned long long>(t.bytes),
         static_cast<unsigned long long>(bytes));
  if (bytes && !src) fail(LWO_ERR_INVALID_ARGUMENT, "%s: src is NULL", call);
  if (comm_) {  // only the part of the tensor in this rank's shard
    uint64_t lo = l.shard_bytes * static_cast<uint64_t>(rank_), hi = lo + l.shard_bytes;
    uint64_t b = std::max(lo, t.offset), e = std::min(hi, t.offset + t.bytes);
    if (b < e) std::memcpy(l.host + (b - lo), static_cast<const uint8_t*>(src) + (b - t.offset), e - b);
  } else if (bytes) {
    std::memcpy(l.host + t.offset, src, bytes);
  }
  changed(layer_id, call);
}

void Pool::changed(uint32_t layer_id, const char* call) {
  layer(layer_id, call);
  versions_[layer_id].fetch_add(1, std::memory_order_acq_rel);
}

}  // namespace lwo
