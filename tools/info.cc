// lwo info FILE: what a safetensors checkpoint holds (its files, metadata and
// every tensor), the layers name patterns or a names file map it to, bytes
// per layer, the layer indices no tensor has (gaps), and the device memory a
// ring over it needs. Works without a CUDA device (the ring size is then
// estimated).
#include <algorithm>
#include <string>
#include <vector>

#include "tools/cli.h"

namespace cli {
namespace {

struct Options {
  std::vector<std::string> paths;
  CkptSpec spec;
  uint32_t depth = 2;
  int device = 0;
  bool device_given = false;
  bool estimate = false;
  std::string json;
};

std::vector<Flag> make_flags(Options& o) {
  Flag device = uint_flag(kDeviceFlag, o.device);
  device.set = [&o](const std::string& v) {
    o.device = static_cast<int>(parse_uint("--device", v, 0, 1023));
    o.device_given = true;
  };
  device.help += "; without it the first device is used if there is one";
  Flag depth = uint_flag(kDepthFlag, o.depth);
  depth.help = "ring depth (device slots) for the memory figure" +
               depth.help.substr(depth.help.find(','));
  return {
      pattern_flag(o.spec),
      names_flag(o.spec),
      depth,
      switch_flag("--estimate", "estimate the ring's memory even when a CUDA device is present",
                  o.estimate),
      device,
      json_flag(o.json),
      quiet_flag(),
  };
}

struct LayerRow {
  uint32_t n_tensors = 0;
  uint64_t bytes = 0;         // the tensors' bytes
  uint64_t record_bytes = 0;  // the pool's record (0 without a pool)
  uint64_t estimate = 0;      // tensors rounded up to LWO_RECORD_ALIGN each
  std::string not_streamable; // a tensor lwo has no dtype for, if any
  bool gap() const { return n_tensors == 0; }
};

struct Report : CkptListing {
  uint64_t tensor_bytes = 0;
  bool mapped = false;
  CkptMap map;
  std::vector<LayerRow> layers;
  uint64_t min_layer = 0, max_layer = 0, total_layers = 0;
  // The ring.
  bool exact = false;          // from a pool on a device
  std::string estimate_reason; // why estimated
  std::string no_gpu;          // the library's message, when there is no GPU
  uint64_t slot_bytes = 0;
  uint64_t pool_total = 0;     // sum of records (exact only)
};

// "[4096, 4096]"
std::string shape_text(const CkptTensor& t) {
  std::string s = "[";
  for (size_t d = 0; d < t.shape.size(); ++d)
    s += (d ? ", " : "") + std::to_string(static_cast<long long>(t.shape[d]));
  if (t.n_dims > static_cast<int32_t>(t.shape.size())) s += ", ...";
  return s + "]";
}

// "3, 7..9, 12": ascending indices, runs folded.
std::string index_list(const std::vector<uint32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    s += (s.empty() ? "" : ", ") + std::to_string(v[i]);
    if (j > i) s += (j == i + 1 ? ", " : "..") + std::to_string(v[j]);
    i = j + 1;
  }
  return s;
}

// Columns `s` takes on a terminal: one per code point (escape() leaves only
// printable ASCII and valid UTF-8).
size_t width(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// Rows of cells, two spaces apart: a column of width w > 0 right-aligned in
// w columns (a longer cell runs on), one of width 0 left-aligned as wide as
// its widest cell; a row may end early, and its last cell is not padded.
using Rows = std::vector<std::vector<std::string>>;
void print_table(std::vector<size_t> widths, const Rows& rows) {
  const std::vector<size_t> right = widths;
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c)
      if (!right[c]) widths[c] = std::max(widths[c], width(row[c]));
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      const std::string& s = row[c];
      const std::string fill(widths[c] > width(s) ? widths[c] - width(s) : 0, ' ');
      line += (c ? "  " : "") + (right[c] ? fill + s : c + 1 < row.size() ? s + fill : s);
    }
    std::fprintf(g_out, "%s\n", line.c_str());
  }
}

void print_report(const Options& o, const Report& r, const Device* dev) {
  const bool several = r.files.size() > 1;
  std::fprintf(g_out, "checkpoint %s: %zu file%s, %zu tensor%s, %s of tensor data\n",
               escape(r.path).c_str(), r.files.size(), r.files.size() == 1 ? "" : "s",
               r.tensors.size(), r.tensors.size() == 1 ? "" : "s",
               fmt_bytes(r.tensor_bytes).c_str());

  // The files, and their metadata.
  Rows files = {{"file", "tensors", "bytes", "path"}};
  for (size_t f = 0; f < r.files.size(); ++f)
    files.push_back({std::to_string(f), std::to_string(r.files[f].n_tensors),
                     std::to_string(r.files[f].bytes), escape(r.files[f].path)});
  std::fprintf(g_out, "\n");
  print_table({4, 7, 14, 0}, files);
  if (r.metadata.empty()) {
    std::fprintf(g_out, "\nmetadata   none\n");
  } else {
    std::fprintf(g_out, "\nmetadata   %zu entr%s (__metadata__)\n", r.metadata.size(),
                 r.metadata.size() == 1 ? "y" : "ies");
    for (const CkptMeta& m : r.metadata) {
      std::fprintf(g_out, "           %s = %s", escape(m.key).c_str(), quoted(m.value).c_str());
      if (several) std::fprintf(g_out, "  (%s)", escape(r.files[m.file].name).c_str());
      std::fprintf(g_out, "\n");
    }
  }

  // The tensor table. Quantized fp8 weights: the weight's format, the
  // scales' "scales"; the bytes they take against the same weights in bf16.
  Rows tensors = {{"tensor", "name", "dtype", "format", "shape", "bytes"}};
  if (several) tensors[0].push_back("file");
  tensors[0].push_back("offset");
  uint32_t n_quant = 0;
  uint64_t quant_bytes = 0, bf16_bytes = 0;
  for (size_t i = 0; i < r.tensors.size(); ++i) {
    const CkptTensor& t = r.tensors[i];
    std::string format = t.quant_partner != LWO_NO_LAYER ? "scales" : "-";
    if (t.quant_format != LWO_QUANT_NONE) {
      format = lwo_quant_format_name(static_cast<lwo_quant_format_t>(t.quant_format));
      ++n_quant;
      quant_bytes += t.bytes + r.tensors[t.quant_partner].bytes;
      bf16_bytes += 2 * t.bytes;
    }
    tensors.push_back({std::to_string(i), escape(t.name), t.lwo_dtype(), format, shape_text(t),
                       std::to_string(t.bytes)});
    if (several) tensors.back().push_back(escape(r.files[t.file].name));
    tensors.back().push_back(std::to_string(t.offset));
    if (t.dtype < 0) tensors.back().push_back("(not an lwo dtype: cannot be streamed)");
  }
  std::fprintf(g_out, "\n");
  print_table(several ? std::vector<size_t>{6, 0, 0, 0, 0, 14, 0, 14, 0}
                      : std::vector<size_t>{6, 0, 0, 0, 0, 14, 14, 0},
              tensors);
  std::fprintf(g_out, "\n");
  if (n_quant)
    std::fprintf(g_out,
                 "quantized  %u fp8 weight%s with 128x128 block scales: %s (codes and scales) "
                 "against %s as bf16, %s saved (%.2fx)\n",
                 n_quant, n_quant == 1 ? "" : "s", fmt_bytes(quant_bytes).c_str(),
                 fmt_bytes(bf16_bytes).c_str(), fmt_bytes(bf16_bytes - quant_bytes).c_str(),
                 static_cast<double>(bf16_bytes) / static_cast<double>(quant_bytes));
  if (!r.mapped) {
    std::fprintf(
        g_out,
        "layers     none: no default pattern (%s) maps any tensor; give --pattern or --names\n",
        default_patterns_text().c_str());
    return;
  }
  const size_t matched = r.tensors.size() - r.map.unmatched.size();
  std::fprintf(g_out, "layers     %zu by %s%s: %zu tensor%s in layers, %zu unmatched",
               r.layers.size(), r.map.describe().c_str(),
               r.map.is_default || !r.map.names_file.empty() ? ""
               : r.map.patterns.size() == 1                  ? " (--pattern)"
                                                             : " (--pattern, in order)",
               matched, matched == 1 ? "" : "s", r.map.unmatched.size());
  if (!r.map.gaps.empty())
    std::fprintf(g_out, ", %zu gap%s", r.map.gaps.size(), r.map.gaps.size() == 1 ? "" : "s");
  std::fprintf(g_out, "\n");
  Rows layers = {{"layer", "tensors", "bytes"}};
  if (r.exact) layers[0].insert(layers[0].end(), {"", "record bytes"});
  for (size_t l = 0; l < r.layers.size(); ++l) {
    const LayerRow& row = r.layers[l];
    if (row.gap()) {
      layers.push_back({std::to_string(l), "-", "-", "gap: no tensor has this layer index"});
      continue;
    }
    layers.push_back({std::to_string(l), std::to_string(row.n_tensors), std::to_string(row.bytes),
                      fmt_bytes(row.bytes)});
    if (r.exact) layers.back().push_back(std::to_string(row.record_bytes));
    if (!row.not_streamable.empty())
      layers.back().push_back("(" + quoted(row.not_streamable) + " has a dtype lwo cannot stream)");
  }
  std::fprintf(g_out, "\n");
  print_table(r.exact ? std::vector<size_t>{6, 7, 14, 10, 14, 0}
                      : std::vector<size_t>{6, 7, 14, 10, 0},
              layers);
  if (!r.map.gaps.empty())
    std::fprintf(
        g_out,
        "\ngaps       layer%s %s: no tensor has %s index; lwo stream refuses a mapping with "
        "gaps\n",
        r.map.gaps.size() == 1 ? "" : "s", index_list(r.map.gaps).c_str(),
        r.map.gaps.size() == 1 ? "its" : "their");
  std::fprintf(g_out, "\nunmatched  %zu tensor%s%s\n", r.map.unmatched.size(),
               r.map.unmatched.size() == 1 ? "" : "s", r.map.unmatched.empty() ? "" : ":");
  for (uint32_t i : r.map.unmatched)
    std::fprintf(g_out, "             %s (%s)\n", escape(r.tensors[i].name).c_str(),
                 fmt_bytes(r.tensors[i].bytes).c_str());
  std::fprintf(g_out, "per layer  min %s, max %s, total %s (%llu bytes)%s\n",
               fmt_bytes(r.min_layer).c_str(), fmt_bytes(r.max_layer).c_str(),
               fmt_bytes(r.total_layers).c_str(), static_cast<unsigned long long>(r.total_layers),
               r.map.gaps.empty() ? "" : " (gaps left out)");
  std::fprintf(g_out, "ring       depth %u: %u x %s = %s of device memory (%llu bytes)\n", o.depth,
               o.depth, fmt_bytes(r.slot_bytes).c_str(), fmt_bytes(r.slot_bytes * o.depth).c_str(),
               static_cast<unsigned long long>(r.slot_bytes * o.depth));
  if (r.exact) {
    std::fprintf(g_out, "           exact: the largest record of a pool on %s\n",
                 describe(*dev).c_str());
    std::fprintf(g_out,
                 "           records %s in all; the staged path also pins 2 x %s of host memory\n",
                 fmt_bytes(r.pool_total).c_str(), fmt_bytes(r.slot_bytes).c_str());
  } else {
    std::fprintf(
        g_out,
        "           estimated (%s): the largest layer's tensors, each rounded up to %d bytes\n",
        r.estimate_reason.c_str(), LWO_RECORD_ALIGN);
    if (!r.no_gpu.empty()) std::fprintf(g_out, "           (%s)\n", r.no_gpu.c_str());
  }
  for (const LayerRow& row : r.layers)
    if (!row.not_streamable.empty()) {
      std::fprintf(g_out,
                   "note       some layers hold tensors whose dtype lwo does not know: lwo stream "
                   "would fail (LWO_ERR_BAD_DTYPE)\n");
      break;
    }
}

Json to_json(const Options& o, const Report& r, const Device* dev) {
  Json j = json_doc("info");
  j["path"] = r.path;
  Json& files = j["files"] = Json::array();
  for (size_t f = 0; f < r.files.size(); ++f)
    files.push_back({{"file", f},
                     {"path", r.files[f].path},
                     {"bytes", r.files[f].bytes},
                     {"tensors", r.files[f].n_tensors}});
  Json& metadata = j["metadata"] = Json::array();
  for (const CkptMeta& m : r.metadata)
    metadata.push_back({{"file", m.file}, {"key", m.key}, {"value", m.value}});
  j["tensor_bytes"] = r.tensor_bytes;
  Json& tensors = j["tensors"] = Json::array();
  for (const CkptTensor& t : r.tensors) {
    Json e = {{"name", t.name}, {"dtype", t.dtype >= 0 ? Json(t.lwo_dtype()) : Json()},
              {"file_dtype", t.dtype_name}, {"streamable", t.dtype >= 0}, {"shape", t.shape},
              {"n_dims", t.n_dims}, {"bytes", t.bytes}, {"file", t.file}, {"offset", t.offset}};
    // "format" of an fp8 weight with block scales, "scales_of" for its scales.
    if (t.quant_format != LWO_QUANT_NONE) {
      e["format"] = lwo_quant_format_name(static_cast<lwo_quant_format_t>(t.quant_format));
      e["scales"] = t.quant_partner;
    } else if (t.quant_partner != LWO_NO_LAYER) {
      e["scales_of"] = t.quant_partner;
    }
    tensors.push_back(e);
  }
  if (!r.mapped) {
    j["mapping"] = nullptr;
    j["layers"] = Json::array();
    j["gaps"] = Json::array();
    return j;
  }
  j["mapping"] = json_mapping(r.map);
  Json& layers = j["layers"] = Json::array();
  for (size_t l = 0; l < r.layers.size(); ++l) {
    const LayerRow& row = r.layers[l];
    Json e = {{"layer", l}, {"tensors", row.n_tensors}, {"bytes", row.bytes}, {"gap", row.gap()}};
    if (r.exact) e["record_bytes"] = row.record_bytes;
    e["streamable"] = row.not_streamable.empty();
    layers.push_back(e);
  }
  j["gaps"] = r.map.gaps;
  Json& unmatched = j["unmatched"] = Json::array();
  for (uint32_t t : r.map.unmatched) unmatched.push_back(r.tensors[t].name);
  j["bytes_per_layer"] = {{"min", r.min_layer}, {"max", r.max_layer}, {"total", r.total_layers}};
  j["ring"] = {{"depth", o.depth}, {"slot_bytes", r.slot_bytes},
               {"device_bytes", r.slot_bytes * o.depth}, {"estimated", !r.exact}};
  if (!r.exact)
    j["ring"]["estimate_reason"] =
        r.no_gpu.empty() ? r.estimate_reason : r.estimate_reason + ": " + r.no_gpu;
  j["device"] = dev ? json_device(*dev) : Json();
  return j;
}

// The work on the one FILE: opens it, maps it, prints the listing to g_out
// (and the JSON file); a failure throws as any command's does.
int info_one(const Options& o) {
  JsonFile json(o.json);

  Report r;
  Checkpoint ck;
  open_checkpoint(parse_path("FILE", o.paths[0]), ck, &r);
  for (const CkptTensor& t : r.tensors) r.tensor_bytes += t.bytes;
  // Gaps are listed, not refused.
  r.mapped = map_checkpoint(ck.get(), r.tensors, o.spec, LWO_CHECKPOINT_ALLOW_GAPS,
                            "run 'lwo help info' for --pattern and --names", &r.map);

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
      r.slot_bytes = std::max(r.slot_bytes, row.estimate);
      if (row.gap()) continue;
      r.min_layer = std::min(r.min_layer, row.bytes);
      r.max_layer = std::max(r.max_layer, row.bytes);
      r.total_layers += row.bytes;
    }
    if (r.min_layer == UINT64_MAX) r.min_layer = 0;

    // The exact slot size comes from a pool, which needs a device. The pool
    // is created staged: that registers nothing (no pinning of the file).
    if (o.estimate)
      r.estimate_reason = "--estimate";
    else if (!streamable)
      r.estimate_reason = "a layer holds a tensor lwo cannot stream, so no pool";
    else if (!r.map.gaps.empty())
      r.estimate_reason = "the layers have gaps, so no pool";
    else if (r.total_layers == 0)
      r.estimate_reason = "every layer is empty (0 bytes), so no pool";
    else if (o.device_given) {
      dev = Device(o.device);
      on_device = true;
    } else if (!(on_device = try_open_device(o.device, dev, &r.no_gpu)))
      r.estimate_reason = "no usable GPU";
    if (on_device) {
      Phase phase("pool");
      const lwo_checkpoint_pool_config config =
          checkpoint_pool_config(r.map, LWO_CHECKPOINT_STAGED);
      Pool pool;
      TK_CHECK(lwo_pool_create_from_checkpoint(dev.engine.get(), ck.get(), &config, pool.out()));
      const lwo_pool_info info = pool_info(pool.get());
      if (info.n_layers != r.layers.size())
        fail(strf("internal: the pool has %u layers, the mapping %zu; please report this",
                  info.n_layers, r.layers.size()));
      for (uint32_t l = 0; l < info.n_layers; ++l) {
        TK_CHECK(lwo_pool_record_bytes(pool.get(), l, &r.layers[l].record_bytes));
        uint32_t n = 0;
        TK_CHECK(lwo_pool_layer_tensor_count(pool.get(), l, &n));
        if (n != r.layers[l].n_tensors)
          fail(strf("internal: layer %u of the pool has %u tensors, of the mapping %u; please "
                    "report this",
                    l, n, r.layers[l].n_tensors));
      }
      r.exact = true;
      r.slot_bytes = info.max_record_bytes;
      r.pool_total = info.total_bytes;
    }
  }

  print_report(o, r, on_device ? &dev : nullptr);
  json.write(to_json(o, r, on_device ? &dev : nullptr));
  return 0;
}

}  // namespace

int cmd_info(int argc, char** argv) {
  Options o;
  if (!parse_checkpoint_args(argc, argv, make_flags(o), &o.paths)) return 0;  // --help: printed
  if (o.paths.size() > 1)
    throw UsageError(strf("one checkpoint FILE, not also %s (lwo stream takes several)",
                          quoted(o.paths[1]).c_str()));
  return info_one(o);
}

const Command kInfoCommand = {"info", "FILE",
    "a checkpoint's files, metadata, tensors, layers and gaps (no GPU needed)",
    R"(Prints a safetensors checkpoint (a .safetensors file, or the shards of a
*.safetensors.index.json): its files, their __metadata__, every tensor (name,
lwo dtype, shape, bytes, file, offset), the layers the patterns or names map
the tensors to (tensors and bytes per layer), the layer indices no tensor has
(gaps: listed, not refused), the unmatched tensors, and the device memory a
ring of depth D needs: D x the largest record, from a pool on the device when
one is present, else estimated (each tensor rounded up to 256 bytes). Names
and metadata are shown with control characters escaped.
)",
    throwaway_flags<Options, make_flags>, cmd_info};

}  // namespace cli
