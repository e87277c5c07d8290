#include "pool.h"

#include <algorithm>
#include <cstring>

#include "src/common/error.h"
#include "src/common/ext.h"
#include "src/quant/quant.h"

namespace lwo {

namespace {
// The scales' shape of an fp8 checkpoint weight: src/quant's block rule.
std::pair<int64_t, int64_t> fp8_block_scale_shape(int64_t rows, int64_t cols) {
  const quant::Layout q = quant::layout_of(LWO_QUANT_FP8_E4M3_BLOCK128, LWO_DTYPE_BF16, rows, cols);
  return {q.scale_rows, q.scale_cols};
}
}  // namespace

void Pool::build_layouts(const lwo_layer_desc* layers, uint32_t n_layers, bool want_host_data) {
  if (n_layers == 0) fail(LWO_ERR_INVALID_ARGUMENT, "n_layers is 0");
  if (!layers) fail(LWO_ERR_INVALID_ARGUMENT, "layers is NULL");
  layers_.resize(n_layers);
  for (uint32_t i = 0; i < n_layers; ++i) {
    layers_[i].layout = make_layout(layers[i], strf("layer %u", i), want_host_data);
    uint64_t rb = layers_[i].layout.record_bytes;
    if (__builtin_add_overflow(total_bytes_, rb, &total_bytes_))
      fail(LWO_ERR_OUT_OF_RANGE, "total pool size overflows");
    max_record_ = std::max(max_record_, rb);
  }
  if (max_record_ == 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "every layer of the %u is empty (0 bytes)", n_layers);
}

void Pool::finish_layers() {
  versions_.reset(new std::atomic<uint64_t>[layers_.size()]);
  for (size_t i = 0; i < layers_.size(); ++i) versions_[i].store(0);
  held_.reset(new std::atomic<int>[layers_.size()]);
  for (size_t i = 0; i < layers_.size(); ++i) held_[i].store(0);
  for (Layer& l : layers_) {
    if (!communicator_) l.shard_bytes = l.layout.record_bytes;  // one shard: the record
    l.tensor_bytes.clear();
    l.tensor_dtypes.clear();
    for (const TensorLayout& t : l.layout.tensors) {
      l.tensor_bytes.push_back(t.bytes);
      l.tensor_dtypes.push_back(t.dtype);
    }
  }
}

std::unique_ptr<Pool> Pool::create_pinned(Engine& engine, const lwo_layer_desc* layers,
                                          uint32_t n_layers, uint32_t n_threads) {
  std::unique_ptr<Pool> pool(new Pool(engine, LWO_POOL_PINNED));
  pool->build_layouts(layers, n_layers, false);
  DeviceScope scope(engine);
  pool->arena_ = PinnedArena(engine, pool->total_bytes_, n_threads, "pinned pool arena");
  uint64_t off = 0;
  for (auto& l : pool->layers_) {
    l.host = pool->arena_.data() + off;
    if (l.layout.record_bytes) l.runs.push_back({0, l.host, l.layout.record_bytes});
    off += l.layout.record_bytes;
  }
  pool->finish_layers();
  pool->source_ = std::make_unique<DirectSource>(engine, nullptr);
  return pool;
}

std::unique_ptr<Pool> Pool::create_sharded(Engine& engine, const lwo_layer_desc* layers,
                                           uint32_t n_layers, void* comm, uint32_t n_threads) {
  if (!comm) fail(LWO_ERR_INVALID_ARGUMENT, "comm is NULL");
  std::unique_ptr<Pool> pool(new Pool(engine, LWO_POOL_SHARDED));
  pool->build_layouts(layers, n_layers, false);
  for (uint32_t li = 0; li < n_layers; ++li) {
    const int qi = pool->first_quantized(li);
    if (qi >= 0)
      fail(LWO_ERR_UNSUPPORTED,
           "layer %u tensor '%s' is quantized (%s): sharded pools hold no quantized tensors", li,
           pool->layers_[li].layout.tensors[qi].name.c_str(),
           quant::format_name(pool->layers_[li].layout.tensors[qi].quant));
  }
  DeviceScope scope(engine);
  Backend& gpu = engine.gpu();
  int n = 1, r = 0;
  gpu.comm_info(comm, &n, &r);
  pool->communicator_ = comm;
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
    PinnedArena host(gpu, 16 * static_cast<size_t>(n), 1);
    std::memcpy(host.data() + 16 * r, mine, 16);
    uint8_t* dev = static_cast<uint8_t*>(gpu.device_alloc(16 * static_cast<size_t>(n)));
    try {
      StreamH st = engine.collective_stream();
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
             "rank %d describes %llu layers (layout hash 0x%llx), rank %d %llu layers "
             "(0x%llx): every rank must create the same layers, with the same tensor sizes and "
             "dtypes",
             r, static_cast<unsigned long long>(mine[0]),
             static_cast<unsigned long long>(mine[1]), k,
             static_cast<unsigned long long>(theirs[0]), static_cast<unsigned long long>(theirs[1]));
    }
  }
  pool->total_bytes_ = total;
  pool->max_record_ = max_slot;
  pool->arena_ = PinnedArena(engine, total, n_threads, "sharded pool arena");
  uint64_t off = 0;
  for (Layer& l : pool->layers_) {
    l.host = pool->arena_.data() + off;
    if (l.shard_bytes) l.runs.push_back({l.shard_bytes * static_cast<uint64_t>(r), l.host, l.shard_bytes});
    off += l.shard_bytes;
  }
  pool->finish_layers();
  pool->source_ = std::make_unique<ShardedSource>(engine, comm, r);
  return pool;
}

std::unique_ptr<Pool> Pool::create_registered(Engine& engine, const lwo_layer_desc* layers,
                                              uint32_t n_layers, const lwo_host_region* regions,
                                              uint32_t n_regions) {
  std::unique_ptr<Pool> pool(new Pool(engine, LWO_POOL_REGISTERED));
  pool->build_layouts(layers, n_layers, true);
  if (n_regions == 0 || !regions)
    fail(LWO_ERR_INVALID_ARGUMENT, "no host regions given (regions %p, n_regions %u)",
         static_cast<const void*>(regions), n_regions);
  std::vector<Region> rs;
  for (uint32_t i = 0; i < n_regions; ++i) {
    check_no_extensions(regions[i].next, strf("region %u", i));
    if (!regions[i].data || regions[i].bytes == 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "region %u is empty (data %p, %llu bytes)", i,
           regions[i].data, static_cast<unsigned long long>(regions[i].bytes));
    uintptr_t b = reinterpret_cast<uintptr_t>(regions[i].data);
    if (b + regions[i].bytes < b)
      fail(LWO_ERR_OUT_OF_RANGE, "region %u wraps around the address space", i);
    rs.push_back({static_cast<uint8_t*>(const_cast<void*>(regions[i].data)), regions[i].bytes,
                  false});
  }
  std::sort(rs.begin(), rs.end(), [](const Region& a, const Region& b) { return a.data < b.data; });
  for (size_t i = 1; i < rs.size(); ++i)
    if (rs[i - 1].data + rs[i - 1].bytes > rs[i].data)
      fail(LWO_ERR_INVALID_ARGUMENT, "host regions at %p and %p overlap",
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
             "layer %u tensor '%s' (%p, %llu bytes) is not inside any given region", li, t.name.c_str(), t.host_data, static_cast<unsigned long long>(t.bytes));
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
  uint64_t reg_bytes = 0;
  for (const Region& r : rs) reg_bytes += r.bytes;
  HostCharge charge(engine, reg_bytes, "registered pool memory");
  try {
    for (Region& r : rs) r.we_registered = engine.gpu().host_register(r.data, r.bytes, true);
  } catch (const Error& e) {
    for (Region& r : rs)
      if (r.we_registered) engine.gpu().host_unregister(r.data);
    throw;
  }
  pool->regions_ = std::move(rs);
  pool->regions_charge_ = std::move(charge);
  pool->finish_layers();
  pool->source_ = std::make_unique<DirectSource>(engine, nullptr);
  return pool;
}

std::unique_ptr<Pool> Pool::create_from_checkpoint(Engine& engine,
                                                   std::shared_ptr<Checkpoint> ckpt,
                                                   const Checkpoint::Mapping& mapping,
                                                   bool staged) {
  const std::vector<std::vector<size_t>>& layers = mapping.map.layers;
  const std::vector<std::string>& strip = mapping.strip;
  std::unique_ptr<Pool> pool(new Pool(engine, LWO_POOL_CHECKPOINT_MAPPED));
  if (layers.empty()) fail(LWO_ERR_INVALID_ARGUMENT, "'%s': no layers", ckpt->path().c_str());
  const auto& entries = ckpt->entries();
  pool->layers_.resize(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    Layer& L = pool->layers_[l];
    uint64_t sum = 0, lo = UINT64_MAX, hi = 0;
    bool one_file = true;
    // Quantized fp8 weights: an F8_E4M3 [rows, cols] tensor
    // with its f32 scales beside it in the layer, named "<weight>_scale_inv"
    // ([ceil(rows/128), ceil(cols/128)], code x scale = the weight, as fp8
    // checkpoints ship them), becomes one LWO_QUANT_FP8_E4M3_BLOCK128 tensor
    // of the record (logical dtype bf16): the codes and the scales, two copy
    // runs from the file. scale_of[k]: the scale entry of weight k;
    // is_scale[k]: entry k is a weight's scale (no tensor of its own).
    std::vector<size_t> scale_of(layers[l].size(), SIZE_MAX);
    std::vector<bool> is_scale(layers[l].size(), false);
    const std::vector<st::ScalePair> pairs =
        st::find_scale_pairs(entries, layers[l], fp8_block_scale_shape, ckpt->path());
    for (const st::ScalePair& p : pairs) {
      scale_of[p.weight] = p.scale;
      is_scale[p.scale] = true;
    }
    const bool any_quant = !pairs.empty();
    for (size_t k : layers[l]) {
      const st::Entry& e = entries[k];
      if (lwo::dtype_size(e.dtype) == 0)
        fail(LWO_ERR_BAD_DTYPE, "'%s': tensor '%s' of layer %zu is %s, which lwo cannot stream",
             ckpt->path().c_str(), e.name.c_str(), l, e.dtype_name.c_str());
      if (e.file != entries[layers[l][0]].file) one_file = false;
      sum += e.end - e.begin;
      lo = std::min(lo, e.begin);
      hi = std::max(hi, e.end);
      if (e.shape.size() > LWO_MAX_DIMS)
        fail(LWO_ERR_UNSUPPORTED, "'%s': tensor '%s' has %zu dimensions (at most %d)",
             ckpt->path().c_str(), e.name.c_str(), e.shape.size(), LWO_MAX_DIMS);
    }
    // Tensors that lie together in one file keep the file's layout, so the
    // layer moves in one copy; others are packed at 256-byte boundaries.
    bool file_layout = one_file && !layers[l].empty() && (hi - lo) <= sum + sum / 4 + 4096 &&
                       !any_quant;  // quantized tensors: the record's layout, packed
    uint64_t off = 0;
    for (size_t j = 0; j < layers[l].size(); ++j) {
      const size_t k = layers[l][j];
      if (is_scale[j]) continue;  // inside its weight's quantized tensor
      const st::Entry& e = entries[k];
      TensorLayout t;
      t.name = e.name;
      if (!strip[l].empty() && t.name.compare(0, strip[l].size(), strip[l]) == 0)
        t.name = t.name.substr(strip[l].size());
      if (t.name.empty())
        fail(LWO_ERR_INVALID_ARGUMENT,
             "'%s': tensor '%s' has no name left in layer %zu once the prefix '%s' is taken "
             "off (end the pattern before the tensor's own name)",
             ckpt->path().c_str(), e.name.c_str(), l, strip[l].c_str());
      t.dtype = e.dtype;
      t.n_dims = static_cast<int32_t>(e.shape.size());
      for (size_t d = 0; d < e.shape.size(); ++d) t.shape[d] = e.shape[d];
      t.bytes = e.end - e.begin;
      t.host_data = ckpt->bytes(e);
      if (scale_of[j] != SIZE_MAX) {
        const st::Entry& sc = entries[layers[l][scale_of[j]]];
        const quant::Layout ql =
            quant::layout_of(LWO_QUANT_FP8_E4M3_BLOCK128, LWO_DTYPE_BF16, e.shape[0], e.shape[1]);
        t.quant = LWO_QUANT_FP8_E4M3_BLOCK128;
        t.dtype = LWO_DTYPE_BF16;  // the logical dtype
        t.bytes = ql.total_bytes;
        t.offset = off;
        L.runs.push_back({t.offset, static_cast<const uint8_t*>(t.host_data), ql.data_bytes});
        L.runs.push_back({t.offset + ql.scale_offset,
                          static_cast<const uint8_t*>(ckpt->bytes(sc)), ql.scale_bytes});
        off = align_up(off + t.bytes, LWO_RECORD_ALIGN);
        L.layout.tensors.push_back(std::move(t));
        continue;
      }
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
    fail(LWO_ERR_INVALID_ARGUMENT, "'%s': every layer is empty", ckpt->path().c_str());
  DeviceScope scope(engine);
  uint64_t file_bytes = 0;
  for (const Checkpoint::File& f : ckpt->files()) file_bytes += f.size;
  // Registered whole or not at all: files that would pass the host budget
  // are staged through bounded buffers instead, as refused ones are.
  if (!staged && !engine.try_charge_host(file_bytes)) staged = true;
  if (!staged) {
    pool->regions_charge_ = HostCharge::adopt(engine, file_bytes);
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
      pool->regions_charge_.reset();
      staged = true;
    }
  }
  pool->finish_layers();
  if (staged) {
    pool->kind_ = LWO_POOL_CHECKPOINT_STAGED;
    pool->source_ = std::make_unique<StagedSource>(engine, ckpt.get());
  } else {
    pool->source_ = std::make_unique<DirectSource>(engine, ckpt.get());
  }
  pool->ckpt_ = std::move(ckpt);
  return pool;
}

Pool::~Pool() {
  engine_.n_pools.fetch_sub(1);
  source_.reset();  // waits for its own streams
  try {
    DeviceScope scope(engine_);
    Backend& gpu = engine_.gpu();
    for (Region& r : regions_)
      if (r.we_registered) gpu.host_unregister(r.data);
    arena_ = PinnedArena();
  } catch (...) {
  }
}

const Pool::Layer& Pool::layer(uint32_t id) const {
  if (id >= layers_.size())
    fail(LWO_ERR_OUT_OF_RANGE, "layer %u is out of range (pool has %zu layers)", id,
         layers_.size());
  return layers_[id];
}

uint32_t Pool::tensor_index(uint32_t layer_id, const char* name) const {
  const Layer& l = layer(layer_id);
  if (!name) fail(LWO_ERR_INVALID_ARGUMENT, "tensor name is NULL");
  int i = l.layout.find(name);
  if (i < 0)
    fail(LWO_ERR_NOT_FOUND, "layer %u has no tensor named '%.255s' (it has %zu tensors)",
         layer_id, name, l.layout.tensors.size());
  return static_cast<uint32_t>(i);
}

Pool::TensorPart Pool::tensor_part(uint32_t layer_id, uint32_t ti, int rank) const {
  const Layer& l = layers_[layer_id];
  const TensorLayout& t = l.layout.tensors[ti];
  const uint64_t lo = l.shard_bytes * static_cast<uint64_t>(rank), hi = lo + l.shard_bytes;
  const uint64_t b = std::max(lo, t.offset), e = std::min(hi, t.offset + t.bytes);
  TensorPart p;
  if (b >= e) return p;
  const uint64_t es = dtype_size(t.dtype);
  p.first = (b - t.offset) / es;
  p.n = (e - b) / es;
  p.shard_offset = b - lo;
  return p;
}

namespace {
void need_whole(const Pool& p, uint32_t layer) {
  if (!p.holds_whole())
    fail(LWO_ERR_UNSUPPORTED,
         "layer %u: the pool is sharded over %d ranks and this rank holds only its shard "
         "(use lwo_pool_shard_host / lwo_pool_shard_tensor)", layer, p.n_ranks());
}
}  // namespace

void Pool::layer_host(uint32_t layer_id, void** data, uint64_t* bytes) const {
  const Layer& l = layer(layer_id);
  need_whole(*this, layer_id);
  if (!l.host)
    fail(LWO_ERR_UNSUPPORTED, "layer %u is not contiguous in host memory (%zu copy runs)",
         layer_id, l.runs.size());
  *data = l.host;
  if (bytes) {
    const bool owned = kind_ == LWO_POOL_PINNED || kind_ == LWO_POOL_SHARDED;
    *bytes = owned ? l.layout.record_bytes : l.runs.empty() ? 0 : l.runs[0].bytes;
  }
}

void Pool::tensor_host(uint32_t layer_id, uint32_t ti, void** data, uint64_t* bytes) const {
  const Layer& l = layers_[layer_id];
  need_whole(*this, layer_id);
  const TensorLayout& t = l.layout.tensors[ti];
  const bool owned = kind_ == LWO_POOL_PINNED || kind_ == LWO_POOL_SHARDED;
  if (ckpt_ && t.quant != LWO_QUANT_NONE)
    fail(LWO_ERR_UNSUPPORTED,
         "layer %u tensor '%s' is an fp8 weight and its scales, which lie apart in '%s' (two "
         "copy runs): it has no one host range",
         layer_id, t.name.c_str(), ckpt_->path().c_str());
  *data = owned ? l.host + t.offset : const_cast<void*>(t.host_data);
  if (bytes) *bytes = t.bytes;
}

void Pool::shard_host(uint32_t layer_id, void** data, uint64_t* record_offset,
                      uint64_t* bytes) const {
  const Layer& l = layer(layer_id);
  if (holds_whole()) {
    layer_host(layer_id, data, bytes);
    if (record_offset) *record_offset = 0;
    return;
  }
  *data = l.host;
  if (record_offset) *record_offset = l.shard_bytes * static_cast<uint64_t>(rank_);
  if (bytes) *bytes = l.shard_bytes;
}

void Pool::shard_tensor(uint32_t layer_id, uint32_t ti, void** data, uint64_t* first,
                        uint64_t* n) const {
  const Layer& l = layers_[layer_id];
  if (l.layout.tensors[ti].quant != LWO_QUANT_NONE)
    fail(LWO_ERR_UNSUPPORTED,
         "layer %u tensor '%s' is quantized (%s): its bytes are not elements (use "
         "lwo_pool_tensor_host)",
         layer_id, l.layout.tensors[ti].name.c_str(),
         quant::format_name(l.layout.tensors[ti].quant));
  const TensorPart p = tensor_part(layer_id, ti, rank_);
  if (first) *first = p.first;
  if (n) *n = p.n;
  if (p.n == 0) {
    *data = nullptr;
    if (first) *first = 0;
    return;
  }
  const TensorLayout& t = l.layout.tensors[ti];
  const bool owned = kind_ == LWO_POOL_PINNED || kind_ == LWO_POOL_SHARDED;
  *data = owned ? l.host + p.shard_offset
                : const_cast<uint8_t*>(static_cast<const uint8_t*>(t.host_data)) +
                      p.first * dtype_size(t.dtype);
}

void Pool::write(uint32_t layer_id, const char* name, uint64_t offset, const void* src,
                 uint64_t bytes, bool whole) {
  if (bytes && !src) fail(LWO_ERR_INVALID_ARGUMENT, "src is NULL");
  if (ckpt_)
    fail(LWO_ERR_UNSUPPORTED, "the pool maps checkpoint '%s' read-only; it cannot be written",
         ckpt_->path().c_str());
  if (kind_ == LWO_POOL_REGISTERED)
    fail(LWO_ERR_UNSUPPORTED,
         "the pool is registered caller memory; write to the caller's memory directly");
  uint32_t ti = tensor_index(layer_id, name);
  const Layer& l = layers_[layer_id];
  const TensorLayout& t = l.layout.tensors[ti];
  check_not_held(layer_id, "writing the layer");
  if (whole && bytes != t.bytes)
    fail(LWO_ERR_SIZE_MISMATCH, "layer %u tensor '%s' holds %llu bytes, given %llu", layer_id,
         name, static_cast<unsigned long long>(t.bytes), static_cast<unsigned long long>(bytes));
  if (offset > t.bytes || bytes > t.bytes - offset)
    fail(LWO_ERR_OUT_OF_RANGE,
         "layer %u tensor '%s' holds %llu bytes: bytes [%llu, %llu + %llu) are past its end",
         layer_id, name, static_cast<unsigned long long>(t.bytes),
         static_cast<unsigned long long>(offset), static_cast<unsigned long long>(offset),
         static_cast<unsigned long long>(bytes));
  // Only the part of the record in this rank's shard (all of it, unsharded).
  const uint64_t lo = l.shard_bytes * static_cast<uint64_t>(rank_), hi = lo + l.shard_bytes;
  const uint64_t rb = t.offset + offset, re = rb + bytes;
  const uint64_t b = std::max(lo, rb), e = std::min(hi, re);
  if (b < e) std::memcpy(l.host + (b - lo), static_cast<const uint8_t*>(src) + (b - rb), e - b);
  changed(layer_id);
}

int Pool::first_quantized(uint32_t layer_id) const {
  const Layer& l = layer(layer_id);
  for (size_t i = 0; i < l.layout.tensors.size(); ++i)
    if (l.layout.tensors[i].quant != LWO_QUANT_NONE) return static_cast<int>(i);
  return -1;
}

void Pool::write_quantized(uint32_t layer_id, const char* name, const void* src,
                           lwo_dtype_t src_dtype, uint64_t src_bytes, uint32_t n_threads) {
  if (!src) fail(LWO_ERR_INVALID_ARGUMENT, "src is NULL");
  if (src_dtype != LWO_DTYPE_F32 && src_dtype != LWO_DTYPE_BF16 && src_dtype != LWO_DTYPE_F16)
    fail(LWO_ERR_INVALID_ARGUMENT, "src_dtype %s (%d) is not f32, bf16 or f16",
         dtype_name(src_dtype), static_cast<int>(src_dtype));
  const uint32_t ti = tensor_index(layer_id, name);
  if (ckpt_)
    fail(LWO_ERR_UNSUPPORTED, "the pool maps checkpoint '%s' read-only; it cannot be written",
         ckpt_->path().c_str());
  if (kind_ == LWO_POOL_REGISTERED)
    fail(LWO_ERR_UNSUPPORTED,
         "the pool is registered caller memory; quantize into the caller's memory with "
         "lwo_quantize");
  if (kind_ != LWO_POOL_PINNED)
    fail(LWO_ERR_UNSUPPORTED, "the pool is sharded: it holds no quantized tensors");
  const Layer& l = layers_[layer_id];
  const TensorLayout& t = l.layout.tensors[ti];
  if (t.quant == LWO_QUANT_NONE)
    fail(LWO_ERR_INVALID_ARGUMENT,
         "layer %u tensor '%s' is not quantized (no LWO_EXT_TENSOR_QUANT in its description): "
         "use lwo_pool_write",
         layer_id, t.name.c_str());
  check_not_held(layer_id, "writing the layer");
  const quant::Layout ql = quant::layout_of(t.quant, t.dtype, t.shape[0], t.shape[1]);
  const uint64_t want = static_cast<uint64_t>(t.shape[0]) * static_cast<uint64_t>(t.shape[1]) *
                        dtype_size(src_dtype);
  if (src_bytes != want)
    fail(LWO_ERR_SIZE_MISMATCH,
         "layer %u tensor '%s' is %lld x %lld: its %s source holds %llu bytes, given %llu",
         layer_id, t.name.c_str(), static_cast<long long>(t.shape[0]),
         static_cast<long long>(t.shape[1]), dtype_name(src_dtype),
         static_cast<unsigned long long>(want), static_cast<unsigned long long>(src_bytes));
  try {
    quant::quantize(ql, src, src_dtype, l.host + t.offset, n_threads);
  } catch (const Error& e) {
    fail(e.status(), "layer %u tensor '%s': %s", layer_id, t.name.c_str(), e.what());
  }
  changed(layer_id);
}

void Pool::check_not_held(uint32_t layer_id, const char* what) const {
  layer(layer_id);
  if (held_[layer_id].load() > 0)
    fail(LWO_ERR_BUSY, "%s: layer %u is resident in a ring whose pass a CUDA graph the caller "
         "captured holds (lwo_ring_capture_join): its replays copy nothing into the layer's "
         "slot, so the change would never reach them; lwo_ring_capture_release first", what,
         layer_id);
}

void Pool::changed(uint32_t layer_id) {
  layer(layer_id);
  versions_[layer_id].fetch_add(1, std::memory_order_acq_rel);
}

void Pool::check_destroyable() const {
  int n = n_rings.load();
  if (n > 0)
    fail(LWO_ERR_BUSY, "pool of %zu layers still has %d ring%s", layers_.size(), n,
         n == 1 ? "" : "s");
  int ng = n_grads.load();
  if (ng > 0)
    fail(LWO_ERR_BUSY, "pool of %zu layers still has %d gradient set%s", layers_.size(), ng,
         ng == 1 ? "" : "s");
}

}  // namespace lwo
