// lwo run --weights FILE: streams the layers of a safetensors checkpoint
// through a ring, pass after pass, straight from the mapped file (registered
// for DMA) or through pinned staging buffers (--staged, or where registration
// is refused). Times each pass against the raw pinned-copy peak measured in
// the same run and checks that every layer arrived byte for byte.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "testkit/checksum.h"
#include "tools/cli.h"

namespace cli {
namespace {

constexpr double kTargetShare = 0.97;  // registered path, depth >= 2
constexpr uint32_t kMaxMismatchLines = 8;
// checksum_async needs this alignment.
constexpr uint64_t kChecksumAlign = 16;

struct Options {
  int device = 0;
  std::string path;
  std::string pattern;
  bool staged = false;
  uint32_t depth = 2;
  uint32_t passes = 5;
  bool timing = false;
  std::string json;
};

// One range of a slot the consumer checksums: a layer's whole copied span
// (tensor < 0), or one tensor.
struct Check {
  uint32_t layer;
  int32_t tensor;
  std::string name;  // of the tensor
  uint64_t bytes;
  HostRange host;
};

struct Results {
  CkptMap map;
  size_t n_tensors = 0;
  lwo_pool_info pool{};
  std::vector<uint64_t> copy_bytes;  // per layer: what the ring moves from the file
  uint64_t pass_bytes = 0;
  std::vector<Check> checks;
  std::vector<std::vector<uint32_t>> layer_checks;  // indices into checks, per layer
  uint32_t whole_layers = 0, checked_tensors = 0, skipped_tensors = 0;
  double open_s = 0, pool_s = 0, checksum_s = 0;
  double peak_gbps = 0, peak_ms = 0;
  lwo_ring_info ring{};
  std::vector<double> pass_ms;
  double median_ms = 0, best_ms = 0, total_ms = 0;
  lwo_ring_stats stats{};
  double gbps(double ms) const { return static_cast<double>(pass_bytes) / (ms * 1e6); }
  double share(double ms) const { return peak_gbps > 0 ? gbps(ms) / peak_gbps : 0; }
  bool staged() const { return pool.kind == LWO_POOL_CHECKPOINT_STAGED; }
};

// Flags of lwo run, with and without --weights and --train, that take a
// value, so that a value is never taken for a flag.
const char* const kValueFlags[] = {"--device", "--layers", "--rows",    "--cols",  "--dtype",
                                   "--depth",  "--passes", "--seed",    "--json",  "--tokens",
                                   "--steps",  "--grad-depth", "--weights", "--pattern"};
// Flags of the synthetic model and of training, which --weights replaces.
const char* const kNotWithWeights[] = {"--layers", "--rows",  "--cols",       "--dtype",
                                       "--seed",   "--train", "--frozen",     "--tokens",
                                       "--steps",  "--grad-depth", "--native-wire", "--bias"};
const char* const kWeightsOnly[] = {"--pattern", "--staged"};

Options parse_options(int argc, char** argv, bool* help) {
  Options o;
  const std::vector<Flag> flags = {
      {"--weights", [&](const std::string& v) { o.path = parse_path("--weights", v); }},
      {"--pattern",
       [&](const std::string& v) {
         if (v.empty()) throw UsageError("--pattern needs a pattern such as \"blocks.{i}.\"");
         o.pattern = v;
       }},
      {"--staged", [&] { o.staged = true; }},
      uint_flag("--device", o.device, 0, 1023),
      uint_flag("--depth", o.depth, 1, 1024),
      uint_flag("--passes", o.passes, 1, 100000),
      {"--json", [&](const std::string& v) { o.json = parse_path("--json", v); }},
      {"--timing", [&] { o.timing = true; }},
      {"--quiet", [] { g_quiet = true; }},
  };
  *help = !parse_flags(argc, argv, 2, flags);
  return o;
}

// Copies the device sums back and compares each with `times` the host
// checksum of its range; `what` names the passes summed.
void verify(const unsigned long long* sums, const Results& r, const std::vector<uint64_t>& expect,
            uint64_t times, const char* what) {
  // Every stream in flight is non-blocking, so this copy on the legacy
  // default stream waits for none of them; the caller has waited for the sums.
  std::vector<unsigned long long> got(expect.size());
  if (!got.empty())
    CHECK(cudaMemcpy(got.data(), sums, got.size() * sizeof(got[0]), cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    unsigned long long want = times * expect[i];
    if (got[i] == want) continue;
    const Check& c = r.checks[i];
    if (++bad <= kMaxMismatchLines)
      std::fprintf(stderr, "lwo: layer %u, %s, %s: checksum 0x%016llx, expected 0x%016llx\n",
                   c.layer, c.tensor < 0 ? "whole span" : ("tensor \"" + c.name + "\"").c_str(),
                   what, got[i], want);
  }
  if (bad)
    fail(
        strf("checksum mismatch in %zu of %zu checked ranges (%s): the ring delivered bytes "
             "that differ from the file",
             bad, got.size(), what));
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
      check(lwo::kernels::checksum_async(data, c.bytes, sums + i, stream),
            "lwo::kernels::checksum_async");
    }
  }
  CHECK(lwo_schedule_reset(schedule, stream));
}

std::string path_text(const Options& o, const Results& r) {
  if (!r.staged()) return "registered";
  return o.staged ? "staged (--staged)" : "staged (registering the file was refused)";
}

void print_results(const Device& dev, const Options& o, const Results& r) {
  const uint32_t n_layers = r.pool.n_layers;
  std::printf("lwo run --weights, %s\n", describe(dev).c_str());
  std::printf("%-10s %s\n", "weights", o.path.c_str());
  std::printf(
      "%-10s %u layers by the pattern \"%s\"%s, %zu tensors (%zu unmatched, left out); "
      "%s per pass, largest record %s\n",
      "layers", n_layers, r.map.pattern.c_str(), r.map.is_default ? " (default)" : "",
      r.n_tensors - r.map.unmatched.size(), r.map.unmatched.size(),
      fmt_bytes(r.pass_bytes).c_str(), fmt_bytes(r.pool.max_record_bytes).c_str());
  if (r.staged())
    std::printf(
        "%-10s %s: host threads pack each layer into one of 2 pinned staging buffers of %s, "
        "then it is copied to its slot\n",
        "path", path_text(o, r).c_str(), fmt_bytes(r.ring.slot_bytes).c_str());
  else
    std::printf(
        "%-10s registered: the mapped file is registered for DMA (read-only) and copied "
        "straight from the page cache\n",
        "path");
  std::printf("%-10s open %.3f s, pool %.2f s, host checksums %.2f s\n", "host", r.open_s,
              r.pool_s, r.checksum_s);
  std::printf(
      "%-10s %.2f GB/s pinned H2D (each layer's copy size back-to-back from one pinned buffer "
      "of %s on one stream, best of %d: %.2f ms)\n",
      "peak", r.peak_gbps, fmt_bytes(r.pool.max_record_bytes).c_str(), kPeakRepeats, r.peak_ms);
  std::printf(
      "%-10s depth %u, %u x %s slots%s; checksum kernel per layer on a consumer stream\n",
      "ring", r.ring.depth, r.ring.depth, fmt_bytes(r.ring.slot_bytes).c_str(),
      o.timing ? ", timing on" : "");
  std::printf("%-10s %u timed after 1 warm-up\n", "passes", o.passes);
  std::printf("%-10s median %.3f ms, best %.3f ms per pass\n", "time", r.median_ms, r.best_ms);
  std::printf("%-10s median %.2f GB/s, best %.2f GB/s, all passes %.2f GB/s\n", "bandwidth",
              r.gbps(r.median_ms), r.gbps(r.best_ms), r.gbps(r.total_ms / o.passes));
  std::printf("%-10s median %.2f%%, best %.2f%% of the peak, %s path", "share",
              100 * r.share(r.median_ms), 100 * r.share(r.best_ms),
              r.staged() ? "staged" : "registered");
  if (r.staged())
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

void write_json(std::FILE* j, const Device& dev, const Options& o, const Results& r) {
  std::fprintf(j,
               "{\n  \"tool\": \"lwo\",\n  \"command\": \"run\",\n  \"mode\": \"weights\",\n"
               "  \"version\": \"%s\",\n  \"device\": %s,\n",
               version_text().c_str(), json_device(dev).c_str());
  std::fprintf(j,
               "  \"config\": {\"weights\": %s, \"pattern\": %s, \"pattern_source\": \"%s\", "
               "\"staged\": %s, \"depth\": %u, \"passes\": %u, \"timing\": %s},\n",
               json_string(o.path).c_str(), json_string(r.map.pattern).c_str(),
               r.map.is_default ? "default" : "given", o.staged ? "true" : "false", o.depth,
               o.passes, o.timing ? "true" : "false");
  std::fprintf(j,
               "  \"path\": \"%s\",\n  \"is_staged\": %s,\n  \"layers\": %u,\n"
               "  \"tensors\": %zu,\n  \"unmatched\": %zu,\n  \"max_record_bytes\": %llu,\n"
               "  \"records_bytes\": %llu,\n  \"bytes_per_pass\": %llu,\n",
               r.staged() ? "staged" : "registered", r.staged() ? "true" : "false",
               r.pool.n_layers, r.n_tensors - r.map.unmatched.size(), r.map.unmatched.size(),
               static_cast<unsigned long long>(r.pool.max_record_bytes),
               static_cast<unsigned long long>(r.pool.total_bytes),
               static_cast<unsigned long long>(r.pass_bytes));
  std::fprintf(j,
               "  \"host_seconds\": {\"open\": %.4f, \"pool_create\": %.4f, \"checksum\": %.4f},\n"
               "  \"peak\": {\"gbps\": %.4f, \"ms\": %.4f, \"repeats\": %d},\n  \"pass_ms\": [",
               r.open_s, r.pool_s, r.checksum_s, r.peak_gbps, r.peak_ms, kPeakRepeats);
  for (size_t i = 0; i < r.pass_ms.size(); ++i)
    std::fprintf(j, "%s%.4f", i ? ", " : "", r.pass_ms[i]);
  std::fprintf(j,
               "],\n  \"median_ms\": %.4f,\n  \"best_ms\": %.4f,\n"
               "  \"gbps\": {\"median\": %.4f, \"best\": %.4f, \"all_passes\": %.4f},\n"
               "  \"share_of_peak\": {\"median\": %.5f, \"best\": %.5f, \"all_passes\": %.5f},\n",
               r.median_ms, r.best_ms, r.gbps(r.median_ms), r.gbps(r.best_ms),
               r.gbps(r.total_ms / o.passes), r.share(r.median_ms), r.share(r.best_ms),
               r.share(r.total_ms / o.passes));
  if (r.staged() || o.depth < 2)
    std::fprintf(j, "  \"target\": {\"share\": %.2f, \"applies\": false},\n", kTargetShare);
  else
    std::fprintf(j, "  \"target\": {\"share\": %.2f, \"applies\": true, \"met\": %s},\n",
                 kTargetShare, r.share(r.median_ms) >= kTargetShare ? "true" : "false");
  const lwo_ring_stats& s = r.stats;
  std::fprintf(
      j,
      "  \"ring\": {\"depth\": %u, \"slot_bytes\": %llu, \"stages\": %llu, "
      "\"hits\": %llu, \"copies\": %llu, \"bytes_copied\": %llu",
      r.ring.depth, static_cast<unsigned long long>(r.ring.slot_bytes),
      static_cast<unsigned long long>(s.n_stages), static_cast<unsigned long long>(s.n_hits),
      static_cast<unsigned long long>(s.n_copies), static_cast<unsigned long long>(s.bytes_copied));
  if (o.timing)
    std::fprintf(j, ", \"copy_ms\": %.4f, \"wait_ms\": %.4f, \"copy_gbps\": %.4f", s.copy_ms,
                 s.wait_ms, s.bandwidth_gbps);
  std::fprintf(j,
               "},\n  \"checks\": {\"whole_layers\": %u, \"tensors\": %u, \"skipped_tensors\": "
               "%u},\n  \"verified\": true\n}\n",
               r.whole_layers, r.checked_tensors, r.skipped_tensors);
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
        r.checks.push_back({l, -1, "", bytes, {data, bytes}});
      }
      continue;
    }
    if (s != LWO_ERR_UNSUPPORTED) check(s, "lwo_pool_layer_host");
    uint32_t n = 0;
    CHECK(lwo_pool_layer_tensor_count(pool, l, &n));
    for (uint32_t t = 0; t < n; ++t) {
      lwo_tensor_info info = LWO_TENSOR_INFO_INIT;
      CHECK(lwo_pool_tensor_info(pool, l, t, &info));
      r.copy_bytes[l] += info.bytes;
      if (!info.bytes) continue;
      if (info.offset % kChecksumAlign) {
        ++r.skipped_tensors;
        continue;
      }
      void* host = nullptr;
      uint64_t host_bytes = 0;
      CHECK(lwo_pool_tensor_host(pool, l, info.name, &host, &host_bytes));
      ++r.checked_tensors;
      r.layer_checks[l].push_back(static_cast<uint32_t>(r.checks.size()));
      r.checks.push_back({l, static_cast<int32_t>(t), info.name, host_bytes, {host, host_bytes}});
    }
  }
  r.pass_bytes = std::accumulate(r.copy_bytes.begin(), r.copy_bytes.end(), uint64_t(0));
}

}  // namespace

bool run_wants_weights(int argc, char** argv) {
  bool weights = false;
  std::string other, only;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    size_t eq = arg.find('=');
    std::string name = arg.substr(0, eq);
    if (name == "--weights") weights = true;
    for (const char* f : kNotWithWeights)
      if (name == f && other.empty()) other = name;
    for (const char* f : kWeightsOnly)
      if (name == f && only.empty()) only = name;
    if (eq == std::string::npos)
      for (const char* f : kValueFlags)
        if (name == f) ++i;
  }
  if (weights && !other.empty())
    throw UsageError(strf("%s does not apply to lwo run --weights (the checkpoint is the model)",
                          other.c_str()));
  if (!weights && !only.empty())
    throw UsageError(strf("%s is a flag of lwo run --weights", only.c_str()));
  return weights;
}

int cmd_run_weights(int argc, char** argv) {
  bool help = false;
  const Options o = parse_options(argc, argv, &help);
  if (help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (o.path.empty()) throw UsageError("--weights needs a checkpoint file");
  Results r;

  // The checkpoint and its layers need no device.
  double t = now_seconds();
  Checkpoint ck;
  open_checkpoint(o.path, ck);
  r.open_s = seconds_since(t);
  const std::vector<CkptTensor> tensors = checkpoint_tensors(ck.get());
  r.n_tensors = tensors.size();
  if (!map_checkpoint(ck.get(), tensors, o.pattern, &r.map))
    fail(strf("'%s': no default pattern (%s) maps any tensor; give one with --pattern "
              "(lwo info lists the tensors)",
              o.path.c_str(), default_patterns_text().c_str()));

  Device dev;
  open_device(o.device, dev);
  JsonFile json;
  if (!o.json.empty()) json.open(o.json);
  progress("lwo run --weights, %s: %s, %zu layers by \"%s\"", describe(dev).c_str(),
           o.path.c_str(), r.map.layers.size(), r.map.pattern.c_str());

  t = now_seconds();
  Pool pool;
  const lwo_checkpoint_pool_config config =
      checkpoint_pool_config(r.map, o.staged ? LWO_CHECKPOINT_STAGED : 0u);
  CHECK(lwo_pool_create_from_checkpoint(dev.engine.get(), ck.get(), &config, pool.out()));
  r.pool_s = seconds_since(t);
  ck.destroy();  // the pool keeps the files mapped
  r.pool.size = sizeof r.pool;
  CHECK(lwo_pool_get_info(pool.get(), &r.pool));
  const uint32_t n_layers = r.pool.n_layers;
  if (o.depth >= n_layers)
    progress(
        "note: depth %u >= %u layers: after the first pass every layer stays in a slot, "
        "so passes hit and copy nothing",
        o.depth, n_layers);

  plan_checks(pool.get(), r);
  std::vector<HostRange> ranges;
  for (const Check& c : r.checks) ranges.push_back(c.host);
  t = now_seconds();
  const std::vector<uint64_t> expect = checksums(ranges);
  r.checksum_s = seconds_since(t);
  progress("host: pool %.2f s (%s), checksums of %s %.2f s", r.pool_s, path_text(o, r).c_str(),
           fmt_bytes(r.pass_bytes).c_str(), r.checksum_s);

  // The peak: the same copy sizes from pinned memory (the pool is the file).
  {
    PinnedMem buffer;
    check(cudaHostAlloc(buffer.out(), r.pool.max_record_bytes, cudaHostAllocDefault),
          strf("cudaHostAlloc(%s)", fmt_bytes(r.pool.max_record_bytes).c_str()).c_str());
    std::memset(buffer.get(), 0, r.pool.max_record_bytes);
    std::vector<HostRange> copies;
    for (uint64_t b : r.copy_bytes)
      if (b) copies.push_back({buffer.get(), b});
    r.peak_gbps = measure_h2d_peak(copies, r.pool.max_record_bytes, &r.peak_ms);
  }
  progress("peak: %.2f GB/s pinned H2D, %s in %.2f ms", r.peak_gbps,
           fmt_bytes(r.pass_bytes).c_str(), r.peak_ms);

  // The ring, the schedule and the consumer.
  const size_t n_checks = r.checks.size();
  Stream consumer = make_stream();
  DeviceMem sums_mem = device_alloc(2 * std::max<size_t>(n_checks, 1) * sizeof(unsigned long long));
  auto* sums = static_cast<unsigned long long*>(sums_mem.get());
  CHECK(cudaMemsetAsync(sums, 0, 2 * std::max<size_t>(n_checks, 1) * sizeof(*sums),
                        consumer.get()));
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  ring_config.depth = o.depth;
  ring_config.flags = o.timing ? LWO_RING_TIMING : 0u;
  Ring ring;
  CHECK(lwo_ring_create(pool.get(), &ring_config, ring.out()));
  r.ring.size = sizeof r.ring;
  CHECK(lwo_ring_get_info(ring.get(), &r.ring));
  std::vector<uint32_t> order(n_layers);
  std::iota(order.begin(), order.end(), 0u);
  Schedule schedule;
  CHECK(lwo_schedule_create(ring.get(), order.data(), n_layers, schedule.out()));

  // Pass 0 warms up. The host enqueues pass p while the GPU runs pass p-1,
  // then waits for pass p-1 and reports it. ends[p] follows pass p's last
  // consumer kernel.
  std::vector<Event> ends;
  for (uint32_t p = 0; p <= o.passes; ++p) ends.push_back(make_event());
  r.pass_ms.resize(o.passes);
  auto finish = [&](uint32_t p) {
    CHECK(cudaEventSynchronize(ends[p].get()));
    double ms = r.pass_ms[p - 1] = elapsed_ms(ends[p - 1], ends[p]);
    progress("pass %u/%u: %9.3f ms, %7.2f GB/s, %6.2f%% of the peak", p, o.passes, ms, r.gbps(ms),
             100 * r.share(ms));
    if (p == 1) verify(sums, r, expect, 1, "first timed pass");
  };
  for (uint32_t p = 0; p <= o.passes; ++p) {
    // Row 0 of the sums holds the first timed pass alone, row 1 all others.
    weights_pass(r, schedule.get(), consumer.get(), p == 1 ? sums : sums + n_checks);
    CHECK(cudaEventRecord(ends[p].get(), consumer.get()));
    if (p >= 2) finish(p - 1);
  }
  finish(o.passes);
  CHECK(cudaStreamSynchronize(consumer.get()));
  CHECK(lwo_engine_check(dev.engine.get()));
  r.total_ms = elapsed_ms(ends.front(), ends.back());
  r.median_ms = median(r.pass_ms);
  r.best_ms = *std::min_element(r.pass_ms.begin(), r.pass_ms.end());
  r.stats.size = sizeof r.stats;
  CHECK(lwo_ring_get_stats(ring.get(), &r.stats));
  schedule.destroy();
  ring.destroy();

  verify(sums + n_checks, r, expect, o.passes, "warm-up and later timed passes, summed");

  print_results(dev, o, r);
  if (json.is_open()) {
    write_json(json.get(), dev, o, r);
    json.commit();
  }
  ends.clear();
  sums_mem.destroy();
  consumer.destroy();
  pool.destroy();
  dev.engine.destroy();
  return 0;
}

}  // namespace cli
