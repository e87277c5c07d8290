// lwo plan: chooses, for a device memory budget, which layers of
// a synthetic model stay resident and the ring depth, from the link measured
// on the device and each layer's compute, and prints the plan layer by layer
// (resident or streamed, predicted copy and stall) with the predicted pass
// time. The shared pieces here also serve lwo run --budget.
#include <algorithm>
#include <string>
#include <vector>

#include "testkit/checksum.h"
#include "tools/cli.h"

namespace cli {

uint64_t parse_budget(const std::string& text, uint64_t model_bytes) {
  if (text.empty()) return 0;
  if (text.back() == '%') {
    const std::string num = text.substr(0, text.size() - 1);
    char* end = nullptr;
    double pct = std::strtod(num.c_str(), &end);
    if (num.empty() || *end || !(pct > 0 && pct <= 100))
      throw UsageError(strf("--budget %s: a share is a number in (0, 100] followed by %%",
                            escape(text).c_str()));
    return static_cast<uint64_t>(static_cast<double>(model_bytes) * pct / 100.0);
  }
  return parse_size("--budget", text, 1, UINT64_MAX);
}

uint64_t plan_budget(lwo_engine* engine, uint64_t budget) {
  lwo_engine_memory m = LWO_ENGINE_MEMORY_INIT;
  TK_CHECK(lwo_engine_get_memory(engine, &m));
  if (m.workspaces >= budget)
    throw UsageError(strf("--budget %llu bytes: the compute workspaces alone hold %llu",
                          static_cast<unsigned long long>(budget),
                          static_cast<unsigned long long>(m.workspaces)));
  return budget - m.workspaces;
}

void print_plan(const PlanReport& r) {
  const lwo_plan_info& i = r.info;
  print_row("plan", "budget %s: depth %u, %u layers resident, %s on the device",
            fmt_bytes(i.budget_bytes).c_str(), i.depth, i.n_resident,
            fmt_bytes(i.device_bytes).c_str());
  print_row("link", "H2D %.2f GB/s, D2H %.2f GB/s, both at once %.2f / %.2f GB/s (measured)",
            i.h2d_gbps, i.d2h_gbps, i.duplex_h2d_gbps, i.duplex_d2h_gbps);
  print_row("predicted", "%.3f ms per %s, stall %.3f ms, %s H2D%s; first-k rule %.3f ms",
            i.predicted_ms, i.train ? "step" : "pass", i.predicted_stall_ms,
            fmt_bytes(i.h2d_bytes).c_str(),
            i.train ? (", " + fmt_bytes(i.d2h_bytes) + " D2H").c_str() : "", i.first_k_ms);
  if (r.grouped) {
    print_row("groups", "%u records for %zu layers (copy overhead %.4f ms, measured); one record "
              "per layer: %.3f ms", i.n_groups,
              r.groups.empty() ? size_t(0)
                               : size_t(r.groups.back().first_layer + r.groups.back().n_layers),
              i.copy_overhead_ms, i.ungrouped_ms);
    std::printf("  %-6s %-11s %8s %10s\n", "group", "layers", "count", "bytes");
    for (size_t g = 0; g < r.groups.size(); ++g) {
      const lwo_plan_group& G = r.groups[g];
      std::printf("  %-6zu %-11s %8u %10s%s\n", g,
                  strf("%u..%u", G.first_layer, G.first_layer + G.n_layers - 1).c_str(),
                  G.n_layers, fmt_bytes(G.bytes).c_str(), G.resident ? "  resident" : "");
    }
  }
  std::printf("  %-5s %-4s %-9s %10s %10s %10s %10s\n", "pos", "dir", r.grouped ? "group" : "layer",
              "weights",
              "copy ms", "start ms", "stall ms");
  for (size_t k = 0; k < r.positions.size(); ++k) {
    const lwo_plan_position& p = r.positions[k];
    std::printf("  %-5zu %-4s %-9u %10s %10.3f %10.3f %10.3f\n", k, p.backward ? "bwd" : "fwd",
                p.layer, p.resident ? "resident" : p.hit ? "hit" : "streamed", p.copy_ms,
                p.start_ms, p.stall_ms);
  }
}

Json json_plan(const PlanReport& r) {
  const lwo_plan_info& i = r.info;
  Json j = {{"budget_bytes", i.budget_bytes}, {"depth", i.depth}, {"n_resident", i.n_resident},
            {"device_bytes", i.device_bytes}, {"train", static_cast<bool>(i.train)},
            {"predicted_ms", i.predicted_ms}, {"predicted_stall_ms", i.predicted_stall_ms},
            {"h2d_bytes", i.h2d_bytes}, {"d2h_bytes", i.d2h_bytes}, {"first_k_ms", i.first_k_ms},
            {"link_gbps", {{"h2d", i.h2d_gbps}, {"d2h", i.d2h_gbps},
                           {"duplex_h2d", i.duplex_h2d_gbps}, {"duplex_d2h", i.duplex_d2h_gbps}}},
            {"resident", r.resident}, {"groups", Json::array()}};
  for (const lwo_plan_group& g : r.groups)
    j["groups"].push_back({{"first_layer", g.first_layer}, {"n_layers", g.n_layers},
                           {"bytes", g.bytes}, {"resident", static_cast<bool>(g.resident)}});
  j["grouped"] = r.grouped;
  j["ungrouped_ms"] = i.ungrouped_ms;
  j["copy_overhead_ms"] = i.copy_overhead_ms;
  Json& positions = j["positions"] = Json::array();
  for (const lwo_plan_position& p : r.positions)
    positions.push_back({{"layer", p.layer}, {"backward", static_cast<bool>(p.backward)},
                         {"weights", p.resident ? "resident" : p.hit ? "hit" : "streamed"},
                         {"copy_ms", p.copy_ms}, {"start_ms", p.start_ms},
                         {"stall_ms", p.stall_ms}});
  return j;
}

namespace {

// --budget B: device bytes (K/M/G suffixes) or a share of the model ("50%").
Flag budget_flag(std::string& budget) {
  return value_flag("--budget", "B",
                    "device memory budget: bytes (K/M/G suffixes) or a share of the model "
                    "(\"50%\"); the planner chooses the resident layers and the depth",
                    [&budget](const std::string& v) {
                      if (v.empty()) throw UsageError("--budget needs a value");
                      parse_budget(v, 1);  // its form, checked while parsing the flags
                      budget = v;
                    });
}

struct Options : ModelOptions {
  std::string budget = "50%";
  double fwd_ms = -1, bwd_ms = -1;  // < 0: measured (forward: the checksum consumer)
  bool train = false;
  bool group = false;
  uint32_t grad_depth = 2;
  std::string json;
};

double parse_ms(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(d >= 0))
    throw UsageError(strf("%s %s is not a time in ms >= 0", flag.c_str(), escape(v).c_str()));
  return d;
}

std::vector<Flag> make_flags(Options& o) {
  return model_flags(o, {
      budget_flag(o.budget),
      value_flag("--fwd-ms", "MS",
                 "forward compute per layer, ms (default: the checksum consumer's, measured)",
                 [&o](const std::string& v) { o.fwd_ms = parse_ms("--fwd-ms", v); }),
      value_flag("--bwd-ms", "MS",
                 "backward compute per layer of a step, ms (default: twice the forward's)",
                 [&o](const std::string& v) { o.bwd_ms = parse_ms("--bwd-ms", v); }),
      switch_flag("--train", "plan a training step (every layer trainable)", o.train),
      switch_flag("--group",
                  "also choose runs of streamed layers to store as one record each (the "
                  "per-copy overhead measured); the plan prints the groups it recommends",
                  o.group),
      uint_flag(kGradDepthFlag, o.grad_depth),
      uint_flag(kDeviceFlag, o.device),
      json_flag(o.json),
      quiet_flag(),
  });
}

int cmd_plan(int argc, char** argv) {
  Options o;
  if (!parse_flags(argc, argv, make_flags(o))) return 0;  // --help: printed
  lwo_tensor_desc tensor = o.weight();
  const lwo_layer_desc layer{&tensor, 1, nullptr};
  const uint64_t record = record_bytes(layer);
  const uint64_t model = record * o.layers;
  const uint64_t budget = parse_budget(o.budget, model);
  const Device dev(o.device);
  JsonFile json(o.json);
  Pool pool;
  std::vector<lwo_layer_desc> layers(o.layers, layer);
  TK_CHECK(lwo_pool_create_pinned(dev.engine.get(), layers.data(), o.layers, nullptr, pool.out()));
  Stream s = make_stream();
  const double f = o.fwd_ms < 0 ? checksum_ms(pool.get(), 0, s.get()) : o.fwd_ms;
  std::vector<double> fwd(o.layers, f), bwd;
  if (o.train) bwd.assign(o.layers, o.bwd_ms < 0 ? 2 * f : o.bwd_ms);
  progress("lwo plan: %u layers of %s, budget %s, compute %.4f ms per layer", o.layers,
           fmt_bytes(record).c_str(), fmt_bytes(budget).c_str(), f);
  PlanReport r = make_plan(pool.get(), budget, fwd, bwd, nullptr, o.grad_depth, o.group);
  std::printf("lwo plan, %s\n", describe(dev).c_str());
  print_model(o, record, model);
  print_row("compute", "forward %.4f ms per layer%s", f,
            o.train ? strf(", backward %.4f ms", bwd[0]).c_str() : "");
  print_plan(r);
  Json j = json_doc("plan", &dev);
  j["config"] = {{"layers", o.layers}, {"rows", o.rows},     {"cols", o.cols},
                 {"dtype", lwo_dtype_name(o.dtype)}, {"budget", o.budget},
                 {"train", o.train},   {"group", o.group}};
  j["plan"] = json_plan(r);
  json.write(j);
  return 0;
}

}  // namespace

std::vector<Flag> pass_flags(uint64_t& seed, bool& timing, int& device, std::string& json,
                             std::string& budget) {
  return {uint_flag(kSeedFlag, seed), timing_flag(timing), uint_flag(kDeviceFlag, device),
          json_flag(json),            quiet_flag(),        budget_flag(budget)};
}

const Command kPlanCommand = {"plan", "",
    "choose resident layers and the ring depth for a device memory budget",
    R"(Makes the synthetic model of lwo run (every layer one tensor "weight" [rows x
cols] in a pinned pool), measures the link on the device (H2D, D2H, both at
once) and the compute per layer (or takes --fwd-ms / --bwd-ms), and prints the
plan lwo_plan_create chooses for --budget: per position resident or streamed,
the predicted copy, start and stall, and the predicted pass (or step) time
against the rule "the first k layers resident". lwo run --budget applies it.
With --group it also measures the per-copy overhead and prints the runs of
layers it recommends storing as one record each (positions are then groups);
the plan only recommends them: lwo run keeps one record per layer.
)",
    throwaway_flags<Options, make_flags>, cmd_plan};

}  // namespace cli
