// lwo probe: (1) pinned copy bandwidth by copy size, both directions; (2) ring
// streaming bandwidth by ring depth and record size, as a share of (1)'s peak.
#include <algorithm>
#include <string>
#include <vector>

#include "testkit/checksum.h"
#include "testkit/ring.h"
#include "testkit/workload.h"
#include "tools/cli.h"

namespace cli {
namespace {

constexpr int kBatches = 5;                  // timed batches per copy size and direction
constexpr uint64_t kBatchBytes = 256 * MiB;  // bytes per batch of small copies
constexpr uint64_t kPoolBytes = 1 * GiB;     // pool size aimed at per record size
constexpr uint32_t kMaxLayers = 1024;        // ... with at most this many layers
constexpr uint64_t kStreamBytes = 3 * GiB;   // bytes streamed per ring figure, at least
constexpr uint64_t kMaxSteps = 16384;        // ... in at most this many layer steps
constexpr uint64_t kSeed = 1;

struct Options {
  int device = 0;
  uint32_t max_depth = 8;
  std::vector<uint64_t> sizes{256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB};
  std::vector<uint64_t> records{4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB};
  std::string json;
};

std::vector<uint64_t> parse_size_list(const std::string& flag, const std::string& text,
                                      uint64_t min, uint64_t max) {
  std::vector<uint64_t> out;
  size_t b = 0;
  for (;;) {
    size_t e = text.find(',', b);
    out.push_back(parse_size(flag, text.substr(b, e == std::string::npos ? e : e - b), min, max));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// Pinned host and device buffers of the largest of `sizes` that fits (sizes
// ascending); returns that size, or 0.
uint64_t alloc_copy_buffers(const std::vector<uint64_t>& sizes, PinnedMem& host, DeviceMem& dev) {
  for (auto it = sizes.rbegin(); it != sizes.rend(); ++it) {
    void* h = nullptr;
    void* d = nullptr;
    cudaError_t e = cudaHostAlloc(&h, *it, cudaHostAllocDefault);
    if (e == cudaSuccess) {
      host = PinnedMem(h);
      e = cudaMalloc(&d, *it);
      if (e == cudaSuccess) {
        dev = DeviceMem(d);
        return *it;
      }
      host.destroy();
    }
    if (e != cudaErrorMemoryAllocation)
      check(e, strf("allocating %s of pinned host and device memory", fmt_bytes(*it).c_str()));
    (void)cudaGetLastError();
    progress("copy: %s buffers do not fit; trying smaller", fmt_bytes(*it).c_str());
  }
  return 0;
}

// The best H2D figure of the measured `copies`: its GB/s into *gbps (0 if
// none), its copy size returned.
uint64_t h2d_peak(const std::vector<CopyFigure>& copies, double* gbps) {
  uint64_t bytes = 0;
  *gbps = 0;
  for (const CopyFigure& f : copies)
    if (f.measured && f.h2d_best > *gbps) {
      *gbps = f.h2d_best;
      bytes = f.bytes;
    }
  return bytes;
}

std::vector<CopyFigure> measure_copies(const std::vector<uint64_t>& sizes) {
  PinnedMem host;
  DeviceMem dev;
  uint64_t fit = alloc_copy_buffers(sizes, host, dev);
  Phase phase("copies", sizes.size());
  // One stream for both directions, in turn: kBatches timed batches of
  // `copies` back-to-back copies, after one untimed batch.
  CopyLoop loop;
  const CopyRepeats repeats{1, kBatches};
  std::vector<CopyFigure> out;
  for (uint64_t bytes : sizes) {
    CopyFigure f;
    f.bytes = bytes;
    if (bytes <= fit) {
      f = time_copy_size(loop, host.get(), dev.get(), bytes, kBatchBytes, repeats);
      phase.set(out.size() + 1, strf("%s: H2D %.2f GB/s, D2H %.2f GB/s", fmt_bytes(bytes).c_str(),
                                     f.h2d_best, f.d2h_best));
    }
    out.push_back(f);
  }
  double peak = 0;
  const uint64_t peak_bytes = h2d_peak(out, &peak);
  const size_t measured = std::count_if(out.begin(), out.end(), [](const CopyFigure& f) {
    return f.measured;
  });
  phase.done("%zu of %zu sizes in %.1f s; peak H2D %.2f GB/s (%s copies)", measured, out.size(),
             phase.seconds(), peak, fmt_bytes(peak_bytes).c_str());
  return out;
}

// All depths for one record size; appends one figure per depth.
void measure_record_size(const Device& dev, const Options& o, uint64_t record,
                         cudaStream_t consumer, std::vector<RingFigure>& out) {
  // More layers than slots, so that every step copies (no hits).
  const uint32_t layers = static_cast<uint32_t>(std::max<uint64_t>(
      o.max_depth + 2, std::min<uint64_t>(kMaxLayers, (kPoolBytes + record - 1) / record)));
  size_t first = out.size();
  for (uint32_t d = 1; d <= o.max_depth; ++d) {
    RingFigure f;
    f.record_bytes = record;
    f.depth = d;
    f.layers = layers;
    out.push_back(f);
  }
  Phase phase("ring " + fmt_bytes(record), o.max_depth);
  auto skip_all = [&](const std::string& why) {
    phase.done("skipped: %s", why.c_str());
    for (size_t i = first; i < out.size(); ++i) out[i].skipped = why;
  };

  lwo_tensor_desc tensor = tensor_desc("data", LWO_DTYPE_U8, {static_cast<int64_t>(record)});
  std::vector<lwo_layer_desc> descs(layers, lwo_layer_desc{&tensor, 1, nullptr});
  Pool pool;
  lwo_status_t s =
      lwo_pool_create_pinned(dev.engine.get(), descs.data(), layers, nullptr, pool.out());
  if (s == LWO_ERR_OUT_OF_MEMORY) return skip_all(lwo_last_error_message());
  check(s, "lwo_pool_create_pinned");
  const lwo_pool_info info = pool_info(pool.get());
  std::vector<HostRange> ranges(layers);
  for (uint32_t l = 0; l < layers; ++l)
    TK_CHECK(lwo_pool_layer_host(pool.get(), l, &ranges[l].data, &ranges[l].bytes));
  fill_bytes(keyed_ranges(ranges, kSeed));
  std::vector<uint64_t> expect = checksums(ranges);
  const uint32_t passes = static_cast<uint32_t>(std::max<uint64_t>(
      2, std::min((kStreamBytes + info.total_bytes - 1) / info.total_bytes, kMaxSteps / layers)));
  const double pool_s = phase.seconds();

  DeviceMem sums = device_alloc(layers * sizeof(unsigned long long));
  Event a = make_event(), b = make_event();
  uint32_t no_room = 0;  // the first depth whose ring did not fit; deeper ones are not tried
  for (size_t i = first; i < out.size(); ++i) {
    RingFigure& f = out[i];
    f.passes = passes;
    if (no_room) {
      f.skipped = strf("not tried: a ring of depth %u did not fit", no_room);
    } else {
      measure_ring(dev.engine.get(), pool.get(), expect, info.total_bytes, consumer,
                   static_cast<unsigned long long*>(sums.get()), a, b, f);
      if (!f.measured) no_room = f.depth;
    }
    phase.set(f.depth, f.measured ? strf("depth %u: %.2f GB/s", f.depth, f.gbps)
                                  : strf("depth %u: skipped", f.depth));
  }
  sums.destroy();
  pool.destroy();
  std::string best;
  double best_gbps = 0;
  for (size_t i = first; i < out.size(); ++i)
    if (out[i].measured && out[i].gbps > best_gbps) {
      best_gbps = out[i].gbps;
      best = strf("best %.2f GB/s at depth %u", out[i].gbps, out[i].depth);
    }
  phase.done("pool of %u layers (%s) in %.2f s; depths 1..%u, %u passes each, in %.1f s%s%s%s",
             layers, fmt_bytes(info.total_bytes).c_str(), pool_s, o.max_depth, passes,
             phase.seconds() - pool_s, best.empty() ? "" : "; ", best.c_str(),
             no_room ? strf("; depth %u and deeper did not fit", no_room).c_str() : "");
}

void print_tables(const Device& dev, const Options& o, const std::vector<CopyFigure>& copies,
                  const std::vector<RingFigure>& rings, double peak, uint64_t peak_bytes) {
  std::printf("lwo probe, %s\n\n", describe(dev).c_str());
  std::printf(
      "pinned copies, back-to-back on one stream: GB/s (1e9 B/s), best and median of "
      "%d batches\n",
      kBatches);
  std::printf("%10s %8s %10s %10s %10s %10s\n", "size", "copies", "H2D best", "median", "D2H best",
              "median");
  for (const CopyFigure& f : copies) {
    if (!f.measured) {
      std::printf("%10s %8s %10s\n", fmt_bytes(f.bytes).c_str(), "-", "does not fit");
      continue;
    }
    std::printf("%10s %8llu %10.2f %10.2f %10.2f %10.2f\n", fmt_bytes(f.bytes).c_str(),
                static_cast<unsigned long long>(f.copies), f.h2d_best, f.h2d_median, f.d2h_best,
                f.d2h_median);
  }
  if (peak > 0)
    std::printf("peak H2D: %.2f GB/s (%s copies)\n", peak, fmt_bytes(peak_bytes).c_str());
  if (o.records.empty()) return;

  std::printf(
      "\nring streaming: pinned pool -> ring of depth D -> checksum kernel on a "
      "consumer stream\nGB/s and share of the peak H2D above, by record size\n");
  std::printf("%6s", "depth");
  for (uint64_t r : o.records) std::printf(" %16s", fmt_bytes(r).c_str());
  std::printf("\n");
  for (uint32_t d = 1; d <= o.max_depth; ++d) {
    std::printf("%6u", d);
    for (const RingFigure& f : rings) {
      if (f.depth != d) continue;
      if (!f.measured)
        std::printf(" %16s", "skipped");
      else if (peak > 0)
        std::printf("  %7.2f %6.1f%%", f.gbps, 100 * f.gbps / peak);
      else
        std::printf(" %16.2f", f.gbps);
    }
    std::printf("\n");
  }
  for (uint64_t record : o.records) {
    const RingFigure* skipped = nullptr;
    const RingFigure* any = nullptr;
    uint64_t hits = 0;
    for (const RingFigure& f : rings) {
      if (f.record_bytes != record) continue;
      any = &f;
      hits += f.hits;
      if (!f.measured && !skipped) skipped = &f;
    }
    std::printf("%s records: %u layers", fmt_bytes(record).c_str(), any->layers);
    if (skipped && skipped->depth == 1) {
      std::printf(", skipped: %s\n", skipped->skipped.c_str());
      continue;
    }
    std::printf(", %u timed passes after a warm-up pass, checksums match", any->passes);
    if (hits)
      std::printf(", %llu hits (layers found in a slot)", static_cast<unsigned long long>(hits));
    if (skipped)
      std::printf(", depth %u and deeper skipped: %s", skipped->depth, skipped->skipped.c_str());
    std::printf("\n");
  }
}

Json to_json(const Device& dev, const std::vector<CopyFigure>& copies,
             const std::vector<RingFigure>& rings, double peak, uint64_t peak_bytes) {
  Json j = json_doc("probe", &dev);
  Json& copy = j["copy"] = Json::array();
  for (const CopyFigure& f : copies) {
    Json e = {{"bytes", f.bytes}, {"measured", f.measured}};
    if (f.measured) {
      e["copies_per_batch"] = f.copies;
      e["batches"] = kBatches;
      e["h2d_gbps"] = {{"best", f.h2d_best}, {"median", f.h2d_median}};
      e["d2h_gbps"] = {{"best", f.d2h_best}, {"median", f.d2h_median}};
    }
    copy.push_back(e);
  }
  j["peak_h2d_gbps"] = peak;
  j["peak_h2d_bytes"] = peak_bytes;
  Json& ring = j["ring"] = Json::array();
  for (const RingFigure& f : rings) {
    Json e = {{"record_bytes", f.record_bytes}, {"depth", f.depth}, {"layers", f.layers},
              {"passes", f.passes}, {"measured", f.measured}};
    if (f.measured) {
      e["ms"] = f.ms;
      e["gbps"] = f.gbps;
      e["share_of_peak"] = peak > 0 ? f.gbps / peak : 0.0;
      e["hits"] = f.hits;
    } else {
      e["skipped"] = f.skipped;
    }
    ring.push_back(e);
  }
  return j;
}

std::vector<Flag> make_flags(Options& o) {
  return {
      uint_flag("--max-depth", "N", o.max_depth, 1, 64, "deepest ring measured"),
      value_flag("--sizes", "LIST",
                 "copy sizes, 1 B..16 GiB each, e.g. 256K,1M,1G (default "
                 "256K,1M,4M,16M,64M,256M,1G)",
                 [&o](const std::string& v) {
                   o.sizes = parse_size_list("--sizes", v, 1, 16 * GiB);
                 }),
      value_flag("--records", "LIST",
                 "ring record sizes, 256 B..4 GiB each (default 4M,16M,64M,256M)",
                 [&o](const std::string& v) {
                   o.records = parse_size_list("--records", v, 256, 4 * GiB);
                 }),
      uint_flag(kDeviceFlag, o.device),
      json_flag(o.json),
      quiet_flag(),
  };
}

}  // namespace

int cmd_probe(int argc, char** argv) {
  Options o;
  if (!parse_flags(argc, argv, make_flags(o))) return 0;  // --help: printed

  const Device dev(o.device);
  JsonFile json(o.json);
  progress("lwo probe, %s", describe(dev).c_str());

  double t0 = now_seconds();
  std::vector<CopyFigure> copies = measure_copies(o.sizes);
  double peak = 0;
  const uint64_t peak_bytes = h2d_peak(copies, &peak);

  Stream consumer = make_stream();
  std::vector<RingFigure> rings;
  for (uint64_t record : o.records) measure_record_size(dev, o, record, consumer.get(), rings);
  TK_CHECK(lwo_engine_synchronize(dev.engine.get()));
  consumer.destroy();
  progress("probe took %.1f s", now_seconds() - t0);

  print_tables(dev, o, copies, rings, peak, peak_bytes);
  json.write(to_json(dev, copies, rings, peak, peak_bytes));
  return 0;
}

const Command kProbeCommand = {"probe", "",
    "pinned copy bandwidth by size; ring bandwidth by depth and record size",
    R"(Measures (1) pinned copy bandwidth by copy size, both directions, best and
median of 5 batches; (2) ring streaming bandwidth by ring depth (1 to
--max-depth) and record size, as a share of (1)'s H2D peak: a pinned pool of
random records streamed through a ring, a checksum kernel reading every
slot, every sum checked.
)",
    throwaway_flags<Options, make_flags>, cmd_probe};

}  // namespace cli
