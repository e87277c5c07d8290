// lwo info: what a safetensors checkpoint holds (every tensor), the layers a
// name pattern maps it to, bytes per layer, and the device memory a ring over
// it needs. Works without a CUDA device (the ring size is then estimated).
#include <algorithm>
#include <string>
#include <vector>

#include "tools/cli.h"

namespace cli {
namespace {

struct Options {
  std::string path;
  std::string pattern;
  uint32_t depth = 2;
  int device = 0;
  bool device_given = false;
  bool estimate = false;
  std::string json;
};

// Flags of lwo info that take a value (so that a value is never taken for
// the file name).
const char* const kValueFlags[] = {"--pattern", "--depth", "--json", "--device"};

Options parse_options(int argc, char** argv, bool* help) {
  Options o;
  // The one argument that is not a flag (nor a flag's value) is the file.
  std::vector<char*> rest = {argv[0], argv[1]};
  std::vector<std::string> files;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.empty() || arg[0] != '-') {
      files.push_back(arg);
      continue;
    }
    rest.push_back(argv[i]);
    if (arg.find('=') == std::string::npos)
      for (const char* f : kValueFlags)
        if (arg == f && i + 1 < argc) rest.push_back(argv[++i]);
  }
  const std::vector<Flag> flags = {
      {"--pattern",
       [&](const std::string& v) {
         if (v.empty()) throw UsageError("--pattern needs a pattern such as \"blocks.{i}.\"");
         o.pattern = v;
       }},
      uint_flag("--depth", o.depth, 1, 4096),
      {"--device",
       [&](const std::string& v) {
         o.device = static_cast<int>(parse_uint("--device", v, 0, 1023));
         o.device_given = true;
       }},
      {"--estimate", [&] { o.estimate = true; }},
      {"--json", [&](const std::string& v) { o.json = parse_path("--json", v); }},
      {"--quiet", [] { g_quiet = true; }},
  };
  *help = !parse_flags(static_cast<int>(rest.size()), rest.data(), 2, flags);
  if (*help) return o;
  if (files.empty()) throw UsageError("lwo info needs a checkpoint file (.safetensors or .json)");
  if (files.size() > 1) throw UsageError(strf("unexpected argument '%s'", files[1].c_str()));
  o.path = files[0];
  return o;
}

struct LayerRow {
  uint32_t n_tensors = 0;
  uint64_t bytes = 0;         // the tensors' bytes
  uint64_t record_bytes = 0;  // the pool's record (0 without a pool)
  uint64_t estimate = 0;      // tensors rounded up to LWO_RECORD_ALIGN each
  std::string not_streamable; // a tensor lwo has no dtype for, if any
};

struct Report {
  std::vector<CkptTensor> tensors;
  uint32_t n_files = 0;
  uint64_t tensor_bytes = 0;
  bool mapped = false;
  CkptMap map;
  std::vector<LayerRow> layers;
  uint64_t min_layer = 0, max_layer = 0, total_layers = 0;
  // The ring.
  bool exact = false;          // from a pool on a device
  std::string estimate_reason; // why estimated
  uint64_t slot_bytes = 0;
  uint64_t pool_total = 0;     // sum of records (exact only)
};

void print_report(const Options& o, const Report& r, const Device* dev) {
  std::printf("checkpoint %s: %u file%s, %zu tensor%s, %s of tensor data\n", o.path.c_str(),
              r.n_files, r.n_files == 1 ? "" : "s", r.tensors.size(),
              r.tensors.size() == 1 ? "" : "s", fmt_bytes(r.tensor_bytes).c_str());
  // The tensor table, its name and shape columns as wide as their longest.
  size_t wname = 4, wshape = 5, wdtype = 5;
  std::vector<std::string> shapes;
  for (const CkptTensor& t : r.tensors) {
    shapes.push_back(shape_text(t));
    wname = std::max(wname, t.name.size());
    wshape = std::max(wshape, shapes.back().size());
    wdtype = std::max(wdtype, t.dtype_name.size());
  }
  std::printf("\n%6s  %-*s  %-*s  %-*s  %14s  %4s  %14s\n", "tensor", static_cast<int>(wname),
              "name", static_cast<int>(wdtype), "dtype", static_cast<int>(wshape), "shape",
              "bytes", "file", "offset");
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    const CkptTensor& t = r.tensors[i];
    std::printf("%6zu  %-*s  %-*s  %-*s  %14llu  %4u  %14llu%s\n", i, static_cast<int>(wname),
                t.name.c_str(), static_cast<int>(wdtype), t.dtype_name.c_str(),
                static_cast<int>(wshape), shapes[i].c_str(),
                static_cast<unsigned long long>(t.bytes), t.file,
                static_cast<unsigned long long>(t.offset),
                t.dtype < 0 ? "  (lwo cannot stream this dtype)" : "");
  }

  std::printf("\n");
  if (!r.mapped) {
    std::printf(
        "layers     none: no default pattern (%s) maps any tensor; give one with --pattern\n",
        default_patterns_text().c_str());
    return;
  }
  size_t matched = r.tensors.size() - r.map.unmatched.size();
  std::printf("layers     %zu, by the pattern \"%s\"%s: %zu tensor%s in layers, %zu unmatched\n",
              r.layers.size(), r.map.pattern.c_str(),
              r.map.is_default ? " (the first default that maps a tensor)" : " (--pattern)",
              matched, matched == 1 ? "" : "s", r.map.unmatched.size());
  if (r.exact)
    std::printf("\n%6s  %7s  %14s  %10s  %14s\n", "layer", "tensors", "bytes", "", "record bytes");
  else
    std::printf("\n%6s  %7s  %14s\n", "layer", "tensors", "bytes");
  for (size_t l = 0; l < r.layers.size(); ++l) {
    const LayerRow& row = r.layers[l];
    std::printf("%6zu  %7u  %14llu  %10s", l, row.n_tensors,
                static_cast<unsigned long long>(row.bytes), fmt_bytes(row.bytes).c_str());
    if (r.exact) std::printf("  %14llu", static_cast<unsigned long long>(row.record_bytes));
    if (!row.not_streamable.empty())
      std::printf("  (\"%s\" has a dtype lwo cannot stream)", row.not_streamable.c_str());
    std::printf("\n");
  }
  std::printf("\nunmatched  %zu tensor%s%s\n", r.map.unmatched.size(),
              r.map.unmatched.size() == 1 ? "" : "s", r.map.unmatched.empty() ? "" : ":");
  for (uint32_t i : r.map.unmatched)
    std::printf("             %s (%s)\n", r.tensors[i].name.c_str(),
                fmt_bytes(r.tensors[i].bytes).c_str());
  std::printf("per layer  min %s, max %s, total %s (%llu bytes)\n", fmt_bytes(r.min_layer).c_str(),
              fmt_bytes(r.max_layer).c_str(), fmt_bytes(r.total_layers).c_str(),
              static_cast<unsigned long long>(r.total_layers));
  std::printf("ring       depth %u: %u x %s = %s of device memory (%llu bytes)\n", o.depth,
              o.depth, fmt_bytes(r.slot_bytes).c_str(), fmt_bytes(r.slot_bytes * o.depth).c_str(),
              static_cast<unsigned long long>(r.slot_bytes * o.depth));
  if (r.exact) {
    std::printf("           exact: the largest record of a pool on %s\n", describe(*dev).c_str());
    std::printf("           records %s in all; the staged path also pins 2 x %s of host memory\n",
                fmt_bytes(r.pool_total).c_str(), fmt_bytes(r.slot_bytes).c_str());
  } else {
    std::printf(
        "           estimated (%s): the largest layer's tensors, each rounded up to %d bytes\n",
        r.estimate_reason.c_str(), LWO_RECORD_ALIGN);
  }
  for (const LayerRow& row : r.layers)
    if (!row.not_streamable.empty()) {
      std::printf(
          "note       some layers hold tensors whose dtype lwo cannot stream: lwo run --weights "
          "would fail (LWO_ERR_BAD_DTYPE)\n");
      break;
    }
}

void write_json(std::FILE* j, const Options& o, const Report& r, const Device* dev) {
  std::fprintf(j,
               "{\n  \"tool\": \"lwo\",\n  \"command\": \"info\",\n  \"version\": \"%s\",\n"
               "  \"path\": %s,\n  \"files\": %u,\n  \"tensor_bytes\": %llu,\n  \"tensors\": [",
               version_text().c_str(), json_string(o.path).c_str(), r.n_files,
               static_cast<unsigned long long>(r.tensor_bytes));
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    const CkptTensor& t = r.tensors[i];
    std::fprintf(j, "%s\n    {\"name\": %s, \"dtype\": %s, \"streamable\": %s, \"shape\": [",
                 i ? "," : "", json_string(t.name).c_str(), json_string(t.dtype_name).c_str(),
                 t.dtype >= 0 ? "true" : "false");
    for (size_t d = 0; d < t.shape.size(); ++d)
      std::fprintf(j, "%s%lld", d ? ", " : "", static_cast<long long>(t.shape[d]));
    std::fprintf(j, "], \"n_dims\": %d, \"bytes\": %llu, \"file\": %u, \"offset\": %llu}",
                 t.n_dims, static_cast<unsigned long long>(t.bytes), t.file,
                 static_cast<unsigned long long>(t.offset));
  }
  std::fprintf(j, "\n  ]");
  if (!r.mapped) {
    std::fprintf(j, ",\n  \"pattern\": null,\n  \"layers\": []\n}\n");
    return;
  }
  std::fprintf(j, ",\n  \"pattern\": %s,\n  \"pattern_source\": \"%s\",\n  \"layers\": [",
               json_string(r.map.pattern).c_str(), r.map.is_default ? "default" : "given");
  for (size_t l = 0; l < r.layers.size(); ++l) {
    const LayerRow& row = r.layers[l];
    std::fprintf(j, "%s\n    {\"layer\": %zu, \"tensors\": %u, \"bytes\": %llu", l ? "," : "", l,
                 row.n_tensors, static_cast<unsigned long long>(row.bytes));
    if (r.exact)
      std::fprintf(j, ", \"record_bytes\": %llu", static_cast<unsigned long long>(row.record_bytes));
    std::fprintf(j, ", \"streamable\": %s}", row.not_streamable.empty() ? "true" : "false");
  }
  std::fprintf(j, "\n  ],\n  \"unmatched\": [");
  for (size_t i = 0; i < r.map.unmatched.size(); ++i)
    std::fprintf(j, "%s%s", i ? ", " : "", json_string(r.tensors[r.map.unmatched[i]].name).c_str());
  std::fprintf(j,
               "],\n  \"bytes_per_layer\": {\"min\": %llu, \"max\": %llu, \"total\": %llu},\n"
               "  \"ring\": {\"depth\": %u, \"slot_bytes\": %llu, \"device_bytes\": %llu, "
               "\"estimated\": %s",
               static_cast<unsigned long long>(r.min_layer),
               static_cast<unsigned long long>(r.max_layer),
               static_cast<unsigned long long>(r.total_layers), o.depth,
               static_cast<unsigned long long>(r.slot_bytes),
               static_cast<unsigned long long>(r.slot_bytes * o.depth),
               r.exact ? "false" : "true");
  if (!r.exact) std::fprintf(j, ", \"estimate_reason\": %s", json_string(r.estimate_reason).c_str());
  std::fprintf(j, "},\n  \"device\": %s\n}\n", dev ? json_device(*dev).c_str() : "null");
}

// Whether a CUDA device can be used; else why not.
bool have_device(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    *why = strf("no CUDA device: %s", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return false;
  }
  return true;
}

}  // namespace

int cmd_info(int argc, char** argv) {
  bool help = false;
  const Options o = parse_options(argc, argv, &help);
  if (help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  JsonFile json;
  if (!o.json.empty()) json.open(o.json);

  Report r;
  Checkpoint ck;
  open_checkpoint(o.path, ck);
  r.tensors = checkpoint_tensors(ck.get());
  // A .safetensors file is one file even without tensors; an index names
  // its shards through its tensors.
  const bool is_index = o.path.size() >= 5 && o.path.compare(o.path.size() - 5, 5, ".json") == 0;
  r.n_files = is_index ? 0 : 1;
  for (const CkptTensor& t : r.tensors) {
    r.n_files = std::max(r.n_files, t.file + 1);
    r.tensor_bytes += t.bytes;
  }
  r.mapped = map_checkpoint(ck.get(), r.tensors, o.pattern, &r.map);

  Device dev;
  bool on_device = false;
  if (r.mapped) {
    r.layers.resize(r.map.layers.size());
    r.min_layer = UINT64_MAX;
    bool streamable = true;
    for (size_t l = 0; l < r.layers.size(); ++l) {
      LayerRow& row = r.layers[l];
      for (uint32_t i : r.map.layers[l]) {
        const CkptTensor& t = r.tensors[i];
        ++row.n_tensors;
        row.bytes += t.bytes;
        row.estimate += align_up(t.bytes, LWO_RECORD_ALIGN);
        if (t.dtype < 0 && row.not_streamable.empty()) row.not_streamable = t.name;
      }
      streamable = streamable && row.not_streamable.empty();
      r.min_layer = std::min(r.min_layer, row.bytes);
      r.max_layer = std::max(r.max_layer, row.bytes);
      r.total_layers += row.bytes;
      r.slot_bytes = std::max(r.slot_bytes, row.estimate);
    }

    // The exact slot size comes from a pool, which needs a device. The pool
    // is created staged: that registers nothing (no pinning of the file).
    if (o.estimate)
      r.estimate_reason = "--estimate";
    else if (!streamable)
      r.estimate_reason = "a layer holds a tensor lwo cannot stream, so no pool";
    else if (o.device_given || have_device(&r.estimate_reason))
      on_device = true;
    if (on_device) {
      open_device(o.device, dev);
      const lwo_checkpoint_pool_config config =
          checkpoint_pool_config(r.map, LWO_CHECKPOINT_STAGED);
      Pool pool;
      CHECK(lwo_pool_create_from_checkpoint(dev.engine.get(), ck.get(), &config, pool.out()));
      lwo_pool_info info{};
      info.size = sizeof info;
      CHECK(lwo_pool_get_info(pool.get(), &info));
      if (info.n_layers != r.layers.size())
        fail(strf("internal: the pool has %u layers, the pattern %zu; please report this",
                  info.n_layers, r.layers.size()));
      for (uint32_t l = 0; l < info.n_layers; ++l) {
        CHECK(lwo_pool_record_bytes(pool.get(), l, &r.layers[l].record_bytes));
        uint32_t n = 0;
        CHECK(lwo_pool_layer_tensor_count(pool.get(), l, &n));
        if (n != r.layers[l].n_tensors)
          fail(strf("internal: layer %u of the pool has %u tensors, of the pattern %u; please "
                    "report this",
                    l, n, r.layers[l].n_tensors));
      }
      r.exact = true;
      r.slot_bytes = info.max_record_bytes;
      r.pool_total = info.total_bytes;
      pool.destroy();
    }
  }

  print_report(o, r, on_device ? &dev : nullptr);
  if (json.is_open()) {
    write_json(json.get(), o, r, on_device ? &dev : nullptr);
    json.commit();
  }
  ck.destroy();
  if (on_device) dev.engine.destroy();
  return 0;
}

}  // namespace cli
