// lwo stream FILE...: streams the layers of safetensors checkpoints through a
// ring, pass after pass, straight from the mapped files (registered for DMA)
// or through pinned staging buffers (--staged, or where registration is
// refused). Times each pass against the raw pinned-copy peak measured in the
// same run and checks that every layer arrived byte for byte. Tensors of
// every dtype stream as bytes.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "testkit/checksum.h"
#include "testkit/workload.h"
#include "tools/cli.h"

namespace cli {
namespace {

constexpr double kTargetShare = 0.97;  // registered path, depth >= 2
// checksum_async needs this alignment.
constexpr uint64_t kChecksumAlign = 16;

struct Options {
  int device = 0;
  std::vector<std::string> paths;
  CkptSpec spec;
  bool staged = false;
  uint32_t depth = 2;
  uint32_t passes = 5;
  bool timing = false;
  std::string json;
  lwo_quant_format_t quant = LWO_QUANT_NONE;  // --quant
};

// One range of a slot the consumer checksums: a layer's whole copied span
// (tensor < 0), or one tensor.
struct Check {
  uint32_t layer;
  int32_t tensor;
  std::string name;  // of the tensor
  HostRange host;    // its bytes
};

// One checkpoint: opened and mapped before the device, streamed after.
struct Results : PassResults, CkptListing {
  Checkpoint ck;
  CkptMap map;
  lwo_pool_info pool{};
  std::vector<uint64_t> copy_bytes;  // per layer: what the ring moves from the file
  std::vector<Check> checks;
  std::vector<std::vector<uint32_t>> layer_checks;  // indices into checks, per layer
  uint32_t whole_layers = 0, checked_tensors = 0, skipped_tensors = 0;
  // --quant: the tensors quantized on load into a pinned pool, their bytes in
  // the file and in the pool.
  bool quantized = false;
  uint32_t quant_tensors = 0, dense_tensors = 0;
  uint64_t quant_file_bytes = 0, quant_pool_bytes = 0;
  double quant_s = 0;
  double open_s = 0, pool_s = 0, checksum_s = 0;
  bool staged() const { return pool.kind == LWO_POOL_CHECKPOINT_STAGED; }
  size_t n_matched() const { return tensors.size() - map.unmatched.size(); }
};

std::vector<Flag> make_flags(Options& o) {
  return {
      pattern_flag(o.spec),
      names_flag(o.spec),
      switch_flag("--staged",
                  "stream through pinned staging buffers, not the registered file "
                  "(LWO_CHECKPOINT_STAGED)",
                  o.staged),
      quant_flag(o.quant),
      uint_flag(kDepthFlag, o.depth),
      uint_flag(kPassesFlag, o.passes),
      timing_flag(o.timing),
      uint_flag(kDeviceFlag, o.device),
      json_flag(o.json),
      quiet_flag(),
      moved_flag("--weights",
                 "--weights is not needed: the checkpoints are the operands, lwo stream {FILE}"),
  };
}

// Compares the device sums with `times` the host checksum of each checked
// range (testkit::verify_sums); `what` names the passes summed.
void verify(const unsigned long long* sums, const Results& r, const std::vector<uint64_t>& expect,
            uint64_t times, const char* what) {
  const auto bad = check_sums(sums, expect, times, [&](const SumMismatch& m) {
    const Check& c = r.checks[m.layer];  // the index of the checked range
    return strf("%s: layer %u, %s, %s: checksum 0x%016llx, expected 0x%016llx\n",
                prefix().c_str(), c.layer,
                c.tensor < 0 ? "whole span" : ("tensor " + quoted(c.name)).c_str(), what, m.got,
                m.want);
  });
  if (!bad.empty())
    fail(
        strf("%s: checksum mismatch in %zu of %zu checked ranges (%s): the ring delivered bytes "
             "that differ from the file",
             escape(r.path).c_str(), bad.size(), expect.size(), what));
}

// One pass of `schedule` on `stream`: each layer's checks add into their sums.
void weights_pass(const Results& r, lwo_schedule* schedule, cudaStream_t stream,
                  unsigned long long* sums) {
  lwo_layer_view view = LWO_LAYER_VIEW_INIT;
  for (;;) {
    lwo_status_t s = lwo_schedule_next(schedule, stream, &view);
    if (s == LWO_END) break;
    check(s, "lwo_schedule_next");
    for (uint32_t i : r.layer_checks[view.layer]) {
      const Check& c = r.checks[i];
      const void* data = c.tensor < 0 ? view.base : view.tensors[c.tensor];
      check(lwo::kernels::checksum_async(data, c.host.bytes, sums + i, stream),
            "lwo::kernels::checksum_async");
    }
  }
  TK_CHECK(lwo_schedule_reset(schedule, stream));
}

std::string path_text(const Options& o, const Results& r) {
  if (!r.staged()) return "registered";
  return o.staged ? "staged (--staged)" : "staged (registering the file was refused)";
}

// "bf16 x 120, i64 x 2": the lwo dtypes of the tensors in layers.
std::string dtypes_text(const Results& r) {
  std::map<std::string, size_t> count;
  for (const auto& layer : r.map.layers)
    for (uint32_t i : layer) ++count[r.tensors[i].lwo_dtype()];
  std::string s;
  for (const auto& [name, n] : count) s += strf("%s%s x %zu", s.empty() ? "" : ", ", name.c_str(), n);
  return s.empty() ? "none" : s;
}

void print_results(const Device& dev, const Options& o, const Results& r) {
  const uint32_t n_layers = r.pool.n_layers;
  std::printf("lwo stream, %s\n", describe(dev).c_str());
  print_row("weights", "%s", escape(r.path).c_str());
  for (size_t f = 0; f < r.files.size(); ++f)
    print_row(f == 0 ? "files" : "", "%s: %u tensor%s, %s", escape(r.files[f].path).c_str(),
              r.files[f].n_tensors, r.files[f].n_tensors == 1 ? "" : "s",
              fmt_bytes(r.files[f].bytes).c_str());
  for (size_t m = 0; m < r.metadata.size(); ++m) {
    const CkptMeta& e = r.metadata[m];
    print_row(m == 0 ? "metadata" : "", "%s = %s%s", escape(e.key).c_str(), quoted(e.value).c_str(),
              r.files.size() > 1 ? (" (" + escape(r.files[e.file].name) + ")").c_str() : "");
  }
  print_row("layers", "%u layers by %s, %zu tensors (%zu unmatched, left out); %s per pass, "
            "largest record %s", n_layers, r.map.describe().c_str(), r.n_matched(),
            r.map.unmatched.size(), fmt_bytes(r.pass_bytes).c_str(),
            fmt_bytes(r.pool.max_record_bytes).c_str());
  print_row("dtypes", "%s (streamed as bytes)", dtypes_text(r).c_str());
  if (r.quantized)
    print_row("quant", "--quant %s (%s): %u 2-D float tensors quantized on load into a pinned "
              "pool in %.2f s, %s in the file, %s quantized (%.2fx fewer bytes); %u tensors "
              "kept as they are", quant_flag_name(o.quant), lwo_quant_format_name(o.quant),
              r.quant_tensors, r.quant_s, fmt_bytes(r.quant_file_bytes).c_str(),
              fmt_bytes(r.quant_pool_bytes).c_str(),
              r.quant_pool_bytes ? static_cast<double>(r.quant_file_bytes) /
                                       static_cast<double>(r.quant_pool_bytes)
                                 : 0.0,
              r.dense_tensors);
  if (r.quantized)
    print_row("path", "pinned: the quantized records are copied from a pinned pool");
  else if (r.staged())
    print_row("path", "%s: host threads pack each layer into one of 2 pinned staging buffers of "
              "%s, then it is copied to its slot", path_text(o, r).c_str(),
              fmt_bytes(r.ring.slot_bytes).c_str());
  else
    print_row("path", "registered: the mapped file is registered for DMA (read-only) and copied "
              "straight from the page cache");
  print_row("host", "open %.3f s, pool %.2f s, host checksums %.2f s", r.open_s, r.pool_s,
            r.checksum_s);
  print_row("peak", "%.2f GB/s pinned H2D (each layer's copy size back-to-back from one pinned "
            "buffer of %s on one stream, best of %d: %.2f ms)", r.peak_gbps,
            fmt_bytes(r.pool.max_record_bytes).c_str(), kPeakRepeats, r.peak_ms);
  r.print(o.passes, o.timing);
  std::printf(", %s path", r.staged() ? "staged" : "registered");
  if (r.staged() || r.quantized)
    std::printf(" (reported; the target is for the registered path)");
  else if (o.depth >= 2)
    std::printf(" (target >= %.0f%% at depth >= 2: %s)", 100 * kTargetShare,
                r.share(r.median_ms) >= kTargetShare ? "met" : "NOT met");
  std::printf("\n%-10s %u layers x %u passes match the file (%u layers whole, %u tensors one by "
              "one",
              "checksums", n_layers, o.passes + 1, r.whole_layers, r.checked_tensors);
  if (r.skipped_tensors)
    std::printf(", %u tensors not checked: not %llu-byte aligned", r.skipped_tensors,
                static_cast<unsigned long long>(kChecksumAlign));
  std::printf(")\n");
  print_ring_stats(r.stats, o.timing);
}

// One checkpoint's results, an element of "checkpoints".
Json json_checkpoint(const Options& o, const Results& r) {
  Json j = {{"path", r.path}, {"files", Json::array()}, {"metadata", Json::array()}};
  for (const CkptFile& f : r.files)
    j["files"].push_back({{"path", f.path}, {"bytes", f.bytes}, {"tensors", f.n_tensors}});
  for (const CkptMeta& m : r.metadata)
    j["metadata"].push_back({{"file", m.file}, {"key", m.key}, {"value", m.value}});
  j["mapping"] = json_mapping(r.map);
  if (r.quantized)  // --quant
    j["quant"] = {{"tensors", r.quant_tensors}, {"kept", r.dense_tensors},
                  {"file_bytes", r.quant_file_bytes}, {"quantized_bytes", r.quant_pool_bytes},
                  {"seconds", r.quant_s}};
  j["path_kind"] = r.quantized ? "pinned" : r.staged() ? "staged" : "registered";
  j["is_staged"] = r.staged();
  j["layers"] = r.pool.n_layers;
  j["tensors"] = r.n_matched();
  j["unmatched"] = r.map.unmatched.size();
  j["max_record_bytes"] = r.pool.max_record_bytes;
  j["records_bytes"] = r.pool.total_bytes;
  j["bytes_per_pass"] = r.pass_bytes;
  j["host_seconds"] = {{"open", r.open_s}, {"pool_create", r.pool_s}, {"checksum", r.checksum_s}};
  r.to_json(j, o.passes);
  j["target"] = {{"share", kTargetShare}, {"applies", !(r.staged() || o.depth < 2)}};
  if (!(r.staged() || o.depth < 2)) j["target"]["met"] = r.share(r.median_ms) >= kTargetShare;
  j["ring"] = json_ring(r.ring, r.stats, o.timing);
  j["checks"] = {{"whole_layers", r.whole_layers}, {"tensors", r.checked_tensors},
                 {"skipped_tensors", r.skipped_tensors}};
  j["verified"] = true;
  return j;
}

Json to_json(const Device& dev, const Options& o, const std::vector<std::unique_ptr<Results>>& all) {
  Json j = json_doc("stream", &dev);
  j["config"] = {{"paths", o.paths},   {"mapping", json_mapping(all.front()->map)},
                 {"staged", o.staged}, {"depth", o.depth},
                 {"passes", o.passes}, {"timing", o.timing},
                 {"quant", quant_flag_name(o.quant)}};
  Json& checkpoints = j["checkpoints"] = Json::array();
  for (const auto& r : all) checkpoints.push_back(json_checkpoint(o, *r));
  return j;
}

// What each layer's slot is checked by: the whole copied span where the pool
// gives the layer's host bytes in one piece (the file's bytes from its first
// tensor on, exactly what the ring copies), else each tensor on its own
// (those whose slot address suits the checksum kernel).
void plan_checks(lwo_pool* pool, Results& r) {
  const uint32_t n_layers = r.pool.n_layers;
  r.copy_bytes.assign(n_layers, 0);
  r.layer_checks.assign(n_layers, {});
  for (uint32_t l = 0; l < n_layers; ++l) {
    void* data = nullptr;
    uint64_t bytes = 0;
    lwo_status_t s = lwo_pool_layer_host(pool, l, &data, &bytes);
    if (s == LWO_OK) {
      r.copy_bytes[l] = bytes;
      ++r.whole_layers;
      if (bytes) {
        r.layer_checks[l].push_back(static_cast<uint32_t>(r.checks.size()));
        r.checks.push_back({l, -1, "", {data, bytes}});
      }
      continue;
    }
    if (s != LWO_ERR_UNSUPPORTED) check(s, "lwo_pool_layer_host");
    uint32_t n = 0;
    TK_CHECK(lwo_pool_layer_tensor_count(pool, l, &n));
    for (uint32_t t = 0; t < n; ++t) {
      lwo_tensor_info info = LWO_TENSOR_INFO_INIT;
      TK_CHECK(lwo_pool_tensor_info(pool, l, t, &info));
      r.copy_bytes[l] += info.bytes;
      if (!info.bytes) continue;
      if (info.offset % kChecksumAlign) {
        ++r.skipped_tensors;
        continue;
      }
      void* host = nullptr;
      uint64_t host_bytes = 0;
      TK_CHECK(lwo_pool_tensor_host(pool, l, info.name, &host, &host_bytes));
      ++r.checked_tensors;
      r.layer_checks[l].push_back(static_cast<uint32_t>(r.checks.size()));
      r.checks.push_back({l, static_cast<int32_t>(t), info.name, {host, host_bytes}});
    }
  }
  r.pass_bytes = std::accumulate(r.copy_bytes.begin(), r.copy_bytes.end(), uint64_t(0));
}

// Opens one checkpoint and maps its tensors to layers (no device needed):
// every usage error is found before the GPU is touched.
void open_and_map(const Options& o, const std::string& path, Results& r) {
  Phase phase("open");
  open_checkpoint(path, r.ck, &r);
  r.open_s = phase.seconds();
  const std::string hint = strf("run 'lwo info %s' for its tensors and layers", escape(path).c_str());
  if (!map_checkpoint(r.ck.get(), r.tensors, o.spec, 0, hint, &r.map))
    throw UsageError(strf("%s: no default pattern (%s) maps any tensor; give --pattern or --names",
                          escape(path).c_str(), default_patterns_text().c_str()),
                     hint);
  phase.done("%s: %zu file%s, %zu tensors, %zu layers by %s in %.3f s", escape(path).c_str(),
             r.files.size(), r.files.size() == 1 ? "" : "s", r.tensors.size(),
             r.map.layers.size(), r.map.describe().c_str(), r.open_s);
}

// --quant: a pinned pool of the checkpoint pool's layers, each 2-D f32, bf16
// or f16 tensor that the format takes quantized on load from the mapped file
// (lwo_pool_write_quantized, on all cores), the others copied as they are.
// Replaces `pool`.
void quantize_pool(const Device& dev, const Options& o, Pool& pool, Results& r) {
  Phase phase("quantize", r.pool.n_layers);
  const uint32_t L = r.pool.n_layers;
  lwo_tensor_quant_ext qx = quant_ext(o.quant);
  std::vector<std::vector<lwo_tensor_desc>> tensors(L);  // quantized: next is the format
  std::vector<lwo_layer_desc> layers(L);
  for (uint32_t l = 0; l < L; ++l) {
    uint32_t n = 0;
    TK_CHECK(lwo_pool_layer_tensor_count(pool.get(), l, &n));
    for (uint32_t t = 0; t < n; ++t) {
      lwo_tensor_info info = LWO_TENSOR_INFO_INIT;
      TK_CHECK(lwo_pool_tensor_info(pool.get(), l, t, &info));
      lwo_tensor_desc d{};
      d.name = info.name;  // lives as long as the checkpoint pool
      d.dtype = info.dtype;
      d.n_dims = info.n_dims;
      for (int k = 0; k < info.n_dims; ++k) d.shape[k] = info.shape[k];
      const bool is_float = info.dtype == LWO_DTYPE_F32 || info.dtype == LWO_DTYPE_BF16 ||
                            info.dtype == LWO_DTYPE_F16;
      // The format must take the shape (int4: cols a multiple of 128).
      const uint64_t quant_bytes =
          is_float && info.n_dims == 2 && info.shape[0] >= 1 && info.shape[1] >= 1 &&
                  info.quant_format == LWO_QUANT_NONE
              ? testkit::quant_bytes(o.quant, info.dtype, info.shape[0], info.shape[1])
              : 0;
      if (quant_bytes > 0) {
        ++r.quant_tensors;
        r.quant_file_bytes += info.bytes;
        r.quant_pool_bytes += quant_bytes;
        d.next = &qx;
      } else {
        ++r.dense_tensors;
      }
      tensors[l].push_back(d);
    }
    layers[l] = lwo_layer_desc{tensors[l].data(), n, nullptr};
  }
  Pool pinned;
  TK_CHECK(lwo_pool_create_pinned(dev.engine.get(), layers.data(), L, nullptr, pinned.out()));
  for (uint32_t l = 0; l < L; ++l) {
    for (const lwo_tensor_desc& d : tensors[l]) {
      void* src = nullptr;
      uint64_t bytes = 0;
      TK_CHECK(lwo_pool_tensor_host(pool.get(), l, d.name, &src, &bytes));
      if (d.next)
        TK_CHECK(lwo_pool_write_quantized(pinned.get(), l, d.name, src, d.dtype, bytes, 0));
      else
        TK_CHECK(lwo_pool_write(pinned.get(), l, d.name, src, bytes));
    }
    phase.set(l + 1);
  }
  pool.destroy();
  pool = std::move(pinned);
  r.quantized = true;
  r.quant_s = phase.seconds();
  phase.done("%u tensors quantized as %s in %.2f s (%s -> %s)", r.quant_tensors,
             quant_flag_name(o.quant), r.quant_s, fmt_bytes(r.quant_file_bytes).c_str(),
             fmt_bytes(r.quant_pool_bytes).c_str());
}

void stream_one(const Device& dev, const Options& o, Results& r) {
  Pool pool;
  {
    Phase phase("pool");
    // --quant reads the file only to quantize it: no registration.
    const lwo_checkpoint_pool_config config = checkpoint_pool_config(
        r.map, o.staged || o.quant != LWO_QUANT_NONE ? LWO_CHECKPOINT_STAGED : 0u);
    TK_CHECK(lwo_pool_create_from_checkpoint(dev.engine.get(), r.ck.get(), &config, pool.out()));
    r.pool_s = phase.seconds();
    r.ck.destroy();  // the pool keeps the files mapped
    r.pool = pool_info(pool.get());
    phase.done("%s, %u layers, %s of records in %.2f s", path_text(o, r).c_str(), r.pool.n_layers,
               fmt_bytes(r.pool.total_bytes).c_str(), r.pool_s);
  }
  if (o.quant != LWO_QUANT_NONE) {
    quantize_pool(dev, o, pool, r);
    r.pool = pool_info(pool.get());
  }
  const uint32_t n_layers = r.pool.n_layers;
  note_depth(o.depth, n_layers, "the first pass", "passes");

  plan_checks(pool.get(), r);
  std::vector<HostRange> ranges;
  uint64_t check_bytes = 0;
  for (const Check& c : r.checks) {
    ranges.push_back(c.host);
    check_bytes += c.host.bytes;
  }
  std::vector<uint64_t> expect;
  {
    Phase phase("checksums", check_bytes, true);
    expect = checksums(ranges, phase.counter());
    r.checksum_s = phase.seconds();
    phase.done("%s of the file on the host in %.2f s", fmt_bytes(check_bytes).c_str(),
               r.checksum_s);
  }

  // The peak: the same copy sizes from pinned memory (the pool is the file).
  {
    Phase phase("peak");
    PinnedMem buffer = pinned_alloc(r.pool.max_record_bytes);
    std::memset(buffer.get(), 0, r.pool.max_record_bytes);
    std::vector<HostRange> copies;
    for (uint64_t b : r.copy_bytes)
      if (b) copies.push_back({buffer.get(), b});
    const CopyResult peak = time_h2d_copies(copies, r.pool.max_record_bytes, kPeak);
    r.peak_gbps = peak.best_gbps();
    r.peak_ms = peak.best_ms();
    phase.done("%.2f GB/s pinned H2D, %s in %.2f ms", r.peak_gbps, fmt_bytes(r.pass_bytes).c_str(),
               r.peak_ms);
  }

  // The ring, the schedule and the consumer.
  const size_t n_checks = r.checks.size();
  Stream consumer = make_stream();
  DeviceMem sums_mem = device_alloc(2 * std::max<size_t>(n_checks, 1) * sizeof(unsigned long long));
  auto* sums = static_cast<unsigned long long*>(sums_mem.get());
  TK_CHECK(cudaMemsetAsync(sums, 0, 2 * std::max<size_t>(n_checks, 1) * sizeof(*sums),
                        consumer.get()));
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  ring_config.depth = o.depth;
  ring_config.flags = o.timing ? LWO_RING_TIMING : 0u;
  Ring ring;
  TK_CHECK(lwo_ring_create(pool.get(), &ring_config, ring.out()));
  r.ring = ring_info(ring.get());
  const std::vector<uint32_t> order = step_order(n_layers, /*backward=*/false);
  Schedule schedule;
  TK_CHECK(lwo_schedule_create(ring.get(), order.data(), n_layers, schedule.out()));

  // Pass 0 warms up; each pass is reported as it ends.
  Phase phase("passes", o.passes + 1);
  const TimedPasses times = time_passes(
      o.passes, consumer.get(),
      [&](uint32_t p) {
        // Row 0 of the sums holds the first timed pass alone, row 1 all others.
        weights_pass(r, schedule.get(), consumer.get(), p == 1 ? sums : sums + n_checks);
      },
      [&](uint32_t p, double ms) {
        phase.set(p + 1, r.pass_line(p, o.passes, ms));
        if (p == 1) verify(sums, r, expect, 1, "first timed pass");
      });
  TK_CHECK(lwo_engine_check(dev.engine.get()));
  r.take(times, ring.get());
  schedule.destroy();
  ring.destroy();

  verify(sums + n_checks, r, expect, o.passes, "warm-up and later timed passes, summed");
  phase.done("1 warm-up + %u timed in %.2f s: median %.3f ms, %.2f GB/s, %.2f%% of the peak; "
             "checksums match",
             o.passes, phase.seconds(), r.median_ms, r.gbps(r.median_ms),
             100 * r.share(r.median_ms));
}

}  // namespace

int cmd_stream(int argc, char** argv) {
  Options o;
  if (!parse_checkpoint_args(argc, argv, make_flags(o), &o.paths)) return 0;  // --help: printed
  for (const std::string& p : o.paths) parse_path("FILE", p);

  // Every checkpoint opened and mapped first: usage errors need no device.
  std::vector<std::unique_ptr<Results>> all;
  for (const std::string& path : o.paths) {
    all.push_back(std::make_unique<Results>());
    open_and_map(o, path, *all.back());
  }

  const Device dev(o.device);
  JsonFile json(o.json);
  progress("lwo stream, %s: %zu checkpoint%s", describe(dev).c_str(), all.size(),
           all.size() == 1 ? "" : "s");
  for (size_t i = 0; i < all.size(); ++i) {
    stream_one(dev, o, *all[i]);
    if (i) std::printf("\n");
    print_results(dev, o, *all[i]);
    std::fflush(stdout);
  }
  json.write(to_json(dev, o, all));
  return 0;
}

const Command kStreamCommand = {"stream", "FILE...",
    "stream safetensors checkpoints through a ring, timed, every byte checked",
    R"(Streams the layers of each checkpoint FILE (a .safetensors file, or the shards
of a *.safetensors.index.json) through a ring, in turn, as lwo run does:
checksums of every layer against the file's bytes, bandwidth against the
pinned-copy peak of the same copy sizes. Tensors of every dtype stream as
bytes. The files are mapped and registered for DMA in place ("registered"
path; target >= 97% of the peak at depth >= 2); where that is refused, or
with --staged, layers go through pinned staging buffers ("staged" path).
Processes that stream the same file share its pages. A layer index that no
tensor has (a gap) is refused: lwo info FILE lists the gaps.
)",
    throwaway_flags<Options, make_flags>, cmd_stream};

}  // namespace cli
