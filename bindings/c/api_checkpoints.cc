// lwo.h: Checkpoints: safetensors files streamed in place.
#include "abi.h"
#include "src/quant/quant.h"
#include "src/common/dtype.h"

using namespace lwo::abi;
using lwo::fail;

namespace {

// A checked lwo_checkpoint_pool_config, converted to the checkpoint's mapping.
struct Mapped {
  lwo::Checkpoint::Mapping mapping;
  uint32_t flags = 0;
};

Mapped map_layers(const lwo::Checkpoint& ck, const lwo_checkpoint_pool_config* config) {
  need(config, "config");
  lwo_checkpoint_pool_config cfg =
      read_config(config, lwo_checkpoint_pool_config LWO_CHECKPOINT_POOL_CONFIG_INIT);
  check_flags(cfg.flags, LWO_CHECKPOINT_STAGED | LWO_CHECKPOINT_ALLOW_GAPS);
  const int given = (cfg.pattern != nullptr) + (cfg.patterns != nullptr) + (cfg.names != nullptr);
  if (given > 1) fail(LWO_ERR_INVALID_ARGUMENT, "give one of pattern, patterns or names");
  const bool gaps = (cfg.flags & LWO_CHECKPOINT_ALLOW_GAPS) != 0;
  Mapped m;
  m.flags = cfg.flags;
  if (cfg.pattern) {
    m.mapping = ck.map_by_patterns({cfg.pattern}, gaps);
  } else if (cfg.patterns) {
    if (cfg.n_patterns == 0) fail(LWO_ERR_INVALID_ARGUMENT, "patterns given with n_patterns 0");
    std::vector<std::string> ps;
    for (uint32_t k = 0; k < cfg.n_patterns; ++k) {
      if (!cfg.patterns[k]) fail(LWO_ERR_INVALID_ARGUMENT, "pattern %u is NULL", k);
      ps.push_back(cfg.patterns[k]);
    }
    m.mapping = ck.map_by_patterns(ps, gaps);
  } else if (cfg.names) {
    if (!cfg.n_names || cfg.n_layers == 0)
      fail(LWO_ERR_INVALID_ARGUMENT, "names need n_names and n_layers >= 1");
    std::vector<std::vector<std::string>> names(cfg.n_layers);
    size_t k = 0;
    for (uint32_t l = 0; l < cfg.n_layers; ++l)
      for (uint32_t j = 0; j < cfg.n_names[l]; ++j, ++k) {
        if (!cfg.names[k]) fail(LWO_ERR_INVALID_ARGUMENT, "name %u of layer %u is NULL", j, l);
        names[l].push_back(cfg.names[k]);
      }
    m.mapping = ck.map_by_names(names);
  } else {
    fail(LWO_ERR_INVALID_ARGUMENT, "the config has no pattern, patterns or names");
  }
  return m;
}

}  // namespace

static_assert(lwo::Checkpoint::kNoLayer == LWO_NO_LAYER, "one value marks an unmatched tensor");

extern "C" {

LWO_API lwo_status_t lwo_checkpoint_open(const char* path, lwo_checkpoint** checkpoint) {
  return guard("lwo_checkpoint_open", [&] {
    clear_output(checkpoint, "checkpoint (output)");
    need(path, "path");
    *checkpoint = publish(std::make_unique<lwo_checkpoint>(lwo_checkpoint{lwo::Checkpoint::open(path)}));
  });
}

LWO_API lwo_status_t lwo_checkpoint_destroy(lwo_checkpoint* checkpoint) {
  return guard("lwo_checkpoint_destroy", [&] {
    if (checkpoint) retire(check_handle(checkpoint));
  });
}

LWO_API lwo_status_t lwo_checkpoint_tensor_count(const lwo_checkpoint* checkpoint,
                                                 uint32_t* n_tensors) {
  return guard("lwo_checkpoint_tensor_count", [&] {
    count_out(check_handle(checkpoint)->impl->entries(), n_tensors, "n_tensors");
  });
}

LWO_API lwo_status_t lwo_checkpoint_tensor_info(const lwo_checkpoint* checkpoint, uint32_t index,
                                                lwo_checkpoint_tensor* info) {
  return guard("lwo_checkpoint_tensor_info", [&] {
    lwo_checkpoint* c = check_handle(checkpoint);
    check_out(info, "info");
    const lwo::st::Entry& e = at(c->impl->entries(), index, "'" + c->impl->path() + "'", "tensors");
    lwo_checkpoint_tensor v{};
    v.name = e.name.c_str();
    v.dtype_name = e.dtype_name.c_str();
    v.dtype = lwo::dtype_size(e.dtype) ? static_cast<int32_t>(e.dtype) : -1;
    v.n_dims = static_cast<int32_t>(e.shape.size());
    for (size_t d = 0; d < e.shape.size() && d < LWO_MAX_DIMS; ++d) v.shape[d] = e.shape[d];
    v.bytes = e.end - e.begin;
    v.file_offset = e.begin;
    v.file = e.file;
    // An fp8 weight and its block scales, by name and shape.
    v.quant_format = LWO_QUANT_NONE;
    v.quant_partner = LWO_NO_LAYER;
    const std::string suffix = lwo::st::kScaleSuffix;
    const auto& es = c->impl->entries();
    auto paired = [&](size_t w, size_t s) {
      const lwo::st::Entry& we = es[w];
      const lwo::st::Entry& se = es[s];
      if (we.dtype != LWO_DTYPE_F8_E4M3 || se.dtype != LWO_DTYPE_F32 || we.shape.size() != 2 ||
          se.shape.size() != 2 || we.shape[0] < 1 || we.shape[1] < 1 ||
          we.shape[0] >= (INT64_C(1) << 31) || we.shape[1] >= (INT64_C(1) << 31))
        return false;
      const lwo::quant::Layout q = lwo::quant::layout_of(LWO_QUANT_FP8_E4M3_BLOCK128,
                                                         LWO_DTYPE_BF16, we.shape[0], we.shape[1]);
      return se.shape[0] == q.scale_rows && se.shape[1] == q.scale_cols;
    };
    const int64_t s = c->impl->find(e.name + suffix);
    if (s >= 0 && paired(index, static_cast<size_t>(s))) {
      v.quant_format = LWO_QUANT_FP8_E4M3_BLOCK128;
      v.quant_partner = static_cast<uint32_t>(s);
    } else if (e.name.size() > suffix.size() &&
               e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      const int64_t w = c->impl->find(e.name.substr(0, e.name.size() - suffix.size()));
      if (w >= 0 && paired(static_cast<size_t>(w), index))
        v.quant_partner = static_cast<uint32_t>(w);
    }
    write_out(info, v, "info");
  });
}

LWO_API lwo_status_t lwo_checkpoint_file_count(const lwo_checkpoint* checkpoint,
                                               uint32_t* n_files) {
  return guard("lwo_checkpoint_file_count", [&] {
    count_out(check_handle(checkpoint)->impl->files(), n_files, "n_files");
  });
}

LWO_API lwo_status_t lwo_checkpoint_file_info(const lwo_checkpoint* checkpoint, uint32_t index,
                                              lwo_checkpoint_file* info) {
  return guard("lwo_checkpoint_file_info", [&] {
    lwo_checkpoint* c = check_handle(checkpoint);
    check_out(info, "info");
    const lwo::Checkpoint::File& f = at(c->impl->files(), index, "'" + c->impl->path() + "'", "files");
    lwo_checkpoint_file v{};
    v.path = f.path.c_str();
    v.bytes = f.size;
    v.n_tensors = f.n_tensors;
    write_out(info, v, "info");
  });
}

LWO_API lwo_status_t lwo_checkpoint_metadata_count(const lwo_checkpoint* checkpoint,
                                                   uint32_t* n_entries) {
  return guard("lwo_checkpoint_metadata_count", [&] {
    count_out(check_handle(checkpoint)->impl->metadata(), n_entries, "n_entries");
  });
}

LWO_API lwo_status_t lwo_checkpoint_metadata(const lwo_checkpoint* checkpoint, uint32_t index,
                                             uint32_t* file, const char** key,
                                             const char** value) {
  return guard("lwo_checkpoint_metadata", [&] {
    lwo_checkpoint* c = check_handle(checkpoint);
    need(key, "key");
    need(value, "value");
    const lwo::Checkpoint::Metadata& m =
        at(c->impl->metadata(), index, "'" + c->impl->path() + "'", "metadata entries");
    if (file) *file = m.file;
    *key = m.key.c_str();
    *value = m.value.c_str();
  });
}

LWO_API void lwo_checkpoint_pool_config_init(lwo_checkpoint_pool_config* c) {
  if (c) *c = lwo_checkpoint_pool_config LWO_CHECKPOINT_POOL_CONFIG_INIT;
}

LWO_API lwo_status_t lwo_pool_create_from_checkpoint(lwo_engine* engine,
                                                     lwo_checkpoint* checkpoint,
                                                     const lwo_checkpoint_pool_config* config,
                                                     lwo_pool** pool) {
  return guard("lwo_pool_create_from_checkpoint", [&] {
    CaptureGate gate;
    lwo_engine* e = pool_engine(engine, pool, &gate);
    lwo_checkpoint* c = check_handle(checkpoint);
    Mapped m = map_layers(*c->impl, config);
    add_pool(
             lwo::Pool::create_from_checkpoint(*e->impl, c->impl, m.mapping,
                                               (m.flags & LWO_CHECKPOINT_STAGED) != 0),
             pool);
  });
}

LWO_API lwo_status_t lwo_checkpoint_unmatched_count(lwo_checkpoint* checkpoint,
                                                    const lwo_checkpoint_pool_config* config,
                                                    uint32_t* n_unmatched) {
  return guard("lwo_checkpoint_unmatched_count", [&] {
    lwo_checkpoint* c = check_handle(checkpoint);
    need(n_unmatched, "n_unmatched");
    *n_unmatched = static_cast<uint32_t>(map_layers(*c->impl, config).mapping.map.unmatched.size());
  });
}

LWO_API lwo_status_t lwo_checkpoint_unmatched_name(lwo_checkpoint* checkpoint,
                                                   const lwo_checkpoint_pool_config* config,
                                                   uint32_t index, const char** name) {
  return guard("lwo_checkpoint_unmatched_name", [&] {
    lwo_checkpoint* c = check_handle(checkpoint);
    need(name, "name");
    const auto& un = map_layers(*c->impl, config).mapping.map.unmatched;
    *name = c->impl->entries()[at(un, index, "the mapping", "unmatched tensors")].name.c_str();
  });
}

LWO_API lwo_status_t lwo_checkpoint_map_tensors(lwo_checkpoint* checkpoint,
                                                const lwo_checkpoint_pool_config* config,
                                                uint32_t n_tensors, uint32_t* layers,
                                                const char** names, uint32_t* n_layers) {
  return guard("lwo_checkpoint_map_tensors", [&] {
    lwo_checkpoint* c = check_handle(checkpoint);
    need(layers, "layers");
    const auto& es = c->impl->entries();
    if (n_tensors != es.size())
      fail(LWO_ERR_SIZE_MISMATCH, "n_tensors %u, but '%s' has %zu tensors", n_tensors,
           c->impl->path().c_str(), es.size());
    Mapped m = map_layers(*c->impl, config);
    c->impl->tensor_layers(m.mapping, layers, names);
    if (n_layers) *n_layers = static_cast<uint32_t>(m.mapping.map.layers.size());
  });
}

}  // extern "C"
