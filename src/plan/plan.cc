#include "plan.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "src/common/error.h"

namespace lwo {
namespace plan {
namespace {

double ms_at(uint64_t bytes, double gbps) {
  return gbps > 0 ? static_cast<double>(bytes) / (gbps * 1e6) : 0.0;
}

struct Slot {
  int64_t layer = -1;    // held, or -1
  double release = 0;    // when its last user's compute ends
  uint64_t order = 0;    // the schedule position of that release, for "longest ago"
};

// One pass over the schedule, slots carried over from an earlier pass.
// Returns the time the pass ends, from `t0` (the end of the one before).
Prediction run(const std::vector<LayerCost>& layers, const std::vector<bool>& resident,
               std::vector<Slot>& slots, const Link& link, const Pass& pass, double t0,
               uint64_t& order) {
  const uint32_t L = static_cast<uint32_t>(layers.size());
  const uint32_t n = pass.backward ? 2 * L : L;
  Prediction p;
  double h2d_free = t0, compute_free = t0, d2h_free = t0;
  std::vector<double> grad_free(std::max<uint32_t>(pass.grad_depth, 1), t0);
  size_t next_grad = 0;
  const double h2d_duplex = link.duplex_h2d_gbps > 0 ? link.duplex_h2d_gbps : link.h2d_gbps;
  const double d2h_duplex = link.duplex_d2h_gbps > 0 ? link.duplex_d2h_gbps : link.d2h_gbps;
  bool any_grads = false;
  for (const LayerCost& c : layers) any_grads = any_grads || c.grad_bytes > 0;
  for (uint32_t i = 0; i < n; ++i) {
    const bool bwd = i >= L;
    const uint32_t l = bwd ? 2 * L - 1 - i : i;
    const LayerCost& c = layers[l];
    Position pos;
    pos.layer = l;
    pos.backward = bwd;
    pos.resident = resident[l];
    double ready = compute_free;  // when the weights are in place
    Slot* slot = nullptr;
    if (!pos.resident) {
      for (Slot& s : slots)
        if (s.layer == static_cast<int64_t>(l)) slot = &s;
      if (slot) {
        pos.hit = true;
        ready = std::max(ready, slot->release);  // (its earlier user is this layer)
      } else {
        // The free slot released longest ago; its next copy waits for that
        // release and for the copy before it on the one engine.
        slot = &*std::min_element(slots.begin(), slots.end(), [](const Slot& a, const Slot& b) {
          return a.order < b.order;
        });
        const double rate = bwd && any_grads ? h2d_duplex : link.h2d_gbps;
        const double start = std::max(h2d_free, slot->release);
        pos.copy_ms = link.copy_overhead_ms + ms_at(c.bytes, rate);
        h2d_free = start + pos.copy_ms;
        ready = std::max(ready, h2d_free);
        slot->layer = l;
        p.h2d_bytes += c.bytes;
      }
    }
    const bool grads = bwd && c.grad_bytes > 0;
    size_t g = 0;
    if (grads) {  // the staging slot's previous copy must have left
      g = next_grad++ % grad_free.size();
      ready = std::max(ready, grad_free[g]);
    }
    pos.start_ms = ready - t0;
    pos.stall_ms = ready - compute_free;
    p.stall_ms += pos.stall_ms;
    compute_free = ready + (bwd ? c.bwd_ms : c.fwd_ms);
    if (slot) {
      slot->release = compute_free;
      slot->order = ++order;
    }
    if (grads) {
      const double start = std::max(d2h_free, compute_free);
      d2h_free = start + ms_at(c.grad_bytes, d2h_duplex);
      grad_free[g] = d2h_free;
      p.d2h_bytes += c.grad_bytes;
    }
    p.positions.push_back(pos);
  }
  p.ms = std::max(compute_free, d2h_free) - t0;
  return p;
}

bool any_streamed(const std::vector<bool>& resident) {
  return std::find(resident.begin(), resident.end(), false) != resident.end();
}

}  // namespace

Prediction predict(const std::vector<LayerCost>& layers, const std::vector<bool>& resident,
                   uint32_t depth, const Link& link, const Pass& pass) {
  if (resident.size() != layers.size())
    fail(LWO_ERR_INVALID_ARGUMENT, "%zu resident flags for %zu layers", resident.size(),
         layers.size());
  if (any_streamed(resident) && depth < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "a ring of depth 0 cannot stream the non-resident layers");
  if (any_streamed(resident) && link.h2d_gbps <= 0)
    fail(LWO_ERR_INVALID_ARGUMENT, "the H2D rate is %g GB/s", link.h2d_gbps);
  std::vector<Slot> slots(std::max<uint32_t>(depth, 1));
  uint64_t order = 0;
  if (layers.empty()) return Prediction{};
  // Steady state: the second of two passes, with the slots the first left.
  Prediction first = run(layers, resident, slots, link, pass, 0.0, order);
  return run(layers, resident, slots, link, pass, first.ms, order);
}

uint64_t device_bytes(const std::vector<LayerCost>& layers, const std::vector<bool>& resident,
                      uint32_t depth, const Pass& pass) {
  uint64_t res = 0, slot = 0, grad = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    if (resident[l])
      res += layers[l].bytes;
    else
      slot = std::max(slot, layers[l].bytes);
    if (pass.backward) grad = std::max(grad, layers[l].grad_bytes);
  }
  return res + (slot ? uint64_t(depth) * slot : 0) + (pass.backward ? pass.grad_depth * grad : 0);
}

namespace {

Plan evaluate(const std::vector<LayerCost>& layers, std::vector<bool> resident, uint32_t depth,
              const Link& link, const Pass& pass) {
  Plan p;
  p.depth = depth;
  p.device_bytes = device_bytes(layers, resident, depth, pass);
  p.prediction = predict(layers, resident, depth, link, pass);
  p.resident = std::move(resident);
  return p;
}

uint64_t smallest_ring(const std::vector<LayerCost>& layers, const Pass& pass,
                       const std::vector<uint32_t>& depths) {
  uint32_t d = *std::min_element(depths.begin(), depths.end());
  return device_bytes(layers, std::vector<bool>(layers.size(), false), d, pass);
}

void check_fits(const std::vector<LayerCost>& layers, uint64_t budget, const Pass& pass,
                const std::vector<uint32_t>& depths) {
  const uint64_t need = smallest_ring(layers, pass, depths);
  if (!layers.empty() && need > budget)
    fail(LWO_ERR_OVER_BUDGET,
         "a budget of %llu bytes holds no plan: the smallest ring (depth %u) and gradient "
         "staging need %llu bytes",
         static_cast<unsigned long long>(budget),
         *std::min_element(depths.begin(), depths.end()), static_cast<unsigned long long>(need));
}

}  // namespace

Plan choose(const std::vector<LayerCost>& layers, uint64_t budget, const Link& link,
            const Pass& pass, const std::vector<uint32_t>& depths) {
  if (depths.empty() || *std::min_element(depths.begin(), depths.end()) < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "the depths to try must be 1 or more");
  check_fits(layers, budget, pass, depths);
  Plan best;
  bool have = false;
  for (uint32_t depth : depths) {
    std::vector<bool> res(layers.size(), false);
    if (device_bytes(layers, res, depth, pass) > budget) continue;
    Plan cur = evaluate(layers, res, depth, link, pass);
    for (;;) {
      // The layer that saves the most time per byte and still fits.
      double best_gain = 0;
      size_t pick = layers.size();
      Plan pick_plan;
      for (size_t l = 0; l < layers.size(); ++l) {
        if (res[l]) continue;
        std::vector<bool> trial = res;
        trial[l] = true;
        if (device_bytes(layers, trial, depth, pass) > budget) continue;
        Plan t = evaluate(layers, trial, depth, link, pass);
        const double saved = cur.prediction.ms - t.prediction.ms;
        const double per_byte = saved / static_cast<double>(std::max<uint64_t>(layers[l].bytes, 1));
        if (saved > 1e-9 && per_byte > best_gain) {
          best_gain = per_byte;
          pick = l;
          pick_plan = std::move(t);
        }
      }
      if (pick == layers.size()) break;
      res[pick] = true;
      cur = std::move(pick_plan);
    }
    if (!have || cur.prediction.ms < best.prediction.ms - 1e-9) {
      best = std::move(cur);
      have = true;
    }
  }
  if (!have) fail(LWO_ERR_OVER_BUDGET, "no depth of those given fits the budget");
  return best;
}

Plan first_layers(const std::vector<LayerCost>& layers, uint64_t budget, const Link& link,
                  const Pass& pass, uint32_t depth) {
  check_fits(layers, budget, pass, {depth});
  std::vector<bool> res(layers.size(), false);
  for (size_t l = 0; l < layers.size(); ++l) {
    res[l] = true;
    if (device_bytes(layers, res, depth, pass) > budget) {
      res[l] = false;
      break;
    }
  }
  return evaluate(layers, res, depth, link, pass);
}

CopyFit fit_copy(uint64_t bytes_a, double ms_a, uint64_t bytes_b, double ms_b) {
  if (!(std::isfinite(ms_a) && ms_a > 0 && std::isfinite(ms_b) && ms_b > 0))
    fail(LWO_ERR_INVALID_ARGUMENT, "copy times %g ms and %g ms: they must be finite and > 0",
         ms_a, ms_b);
  if (bytes_a == bytes_b)
    fail(LWO_ERR_INVALID_ARGUMENT, "both calibration copies are %llu bytes: two sizes are needed",
         static_cast<unsigned long long>(bytes_a));
  if (bytes_a > bytes_b) {
    std::swap(bytes_a, bytes_b);
    std::swap(ms_a, ms_b);
  }
  if (ms_b <= ms_a)
    fail(LWO_ERR_INVALID_ARGUMENT, "the copy of %llu bytes (%g ms) was not slower than that of "
         "%llu bytes (%g ms): no rate fits", static_cast<unsigned long long>(bytes_b), ms_b,
         static_cast<unsigned long long>(bytes_a), ms_a);
  CopyFit f;
  f.gbps = static_cast<double>(bytes_b - bytes_a) / ((ms_b - ms_a) * 1e6);
  f.overhead_ms = ms_a - ms_at(bytes_a, f.gbps);
  if (f.overhead_ms < 0) {
    f.overhead_ms = 0;
    f.gbps = static_cast<double>(bytes_b) / (ms_b * 1e6);
  }
  return f;
}

std::vector<LayerCost> grouped_costs(const std::vector<LayerCost>& layers,
                                     const std::vector<Group>& groups) {
  std::vector<LayerCost> out;
  out.reserve(groups.size());
  for (const Group& g : groups) {
    if (g.count < 1 || uint64_t(g.first) + g.count > layers.size())
      fail(LWO_ERR_INVALID_ARGUMENT, "group of layers %u..+%u is outside the %zu layers",
           g.first, g.count, layers.size());
    LayerCost c;
    for (uint32_t l = g.first; l < g.first + g.count; ++l) {
      c.bytes += layers[l].bytes;
      c.grad_bytes += layers[l].grad_bytes;
      c.fwd_ms += layers[l].fwd_ms;
      c.bwd_ms += layers[l].bwd_ms;
    }
    out.push_back(c);
  }
  return out;
}

std::vector<bool> grouped_resident(const std::vector<Group>& groups) {
  std::vector<bool> r;
  r.reserve(groups.size());
  for (const Group& g : groups) r.push_back(g.resident);
  return r;
}

Grouping group(const std::vector<LayerCost>& layers, const std::vector<bool>& resident,
               uint64_t budget, const Link& link, const Pass& pass,
               const std::vector<uint32_t>& depths) {
  if (resident.size() != layers.size())
    fail(LWO_ERR_INVALID_ARGUMENT, "%zu resident flags for %zu layers", resident.size(),
         layers.size());
  if (depths.empty() || *std::min_element(depths.begin(), depths.end()) < 1)
    fail(LWO_ERR_INVALID_ARGUMENT, "the depths to try must be 1 or more");
  std::vector<Group> singles;
  for (uint32_t l = 0; l < layers.size(); ++l) singles.push_back(Group{l, 1, resident[l]});
  auto eval = [&](const std::vector<Group>& gs, uint32_t depth, Grouping& out) {
    std::vector<LayerCost> c = grouped_costs(layers, gs);
    std::vector<bool> r = grouped_resident(gs);
    uint64_t bytes = device_bytes(c, r, depth, pass);
    if (bytes > budget) return false;
    out.groups = gs;
    out.depth = depth;
    out.device_bytes = bytes;
    out.prediction = predict(c, r, depth, link, pass);
    return true;
  };
  // The start: no grouping, at the best depth that fits.
  Grouping best;
  bool have = false;
  for (uint32_t depth : depths) {
    Grouping g;
    if (eval(singles, depth, g) && (!have || g.prediction.ms < best.prediction.ms - 1e-9)) {
      best = std::move(g);
      have = true;
    }
  }
  if (!have)
    fail(LWO_ERR_OVER_BUDGET, "a budget of %llu bytes holds none of the depths given, ungrouped",
         static_cast<unsigned long long>(budget));
  // Uniform starts: every run of streamed layers cut into records of k
  // layers, k = 2, 3, ... while the records still fit.
  auto uniform = [&](uint32_t k) {
    std::vector<Group> gs;
    for (uint32_t l = 0; l < layers.size(); ++l) {
      if (!resident[l] && !gs.empty() && !gs.back().resident && gs.back().count < k)
        gs.back().count++;
      else
        gs.push_back(Group{l, 1, resident[l]});
    }
    return gs;
  };
  for (uint32_t depth : depths) {
    Grouping cur;
    if (!eval(singles, depth, cur)) continue;
    for (uint32_t k = 2; k <= layers.size(); ++k) {
      Grouping t;
      if (!eval(uniform(k), depth, t)) break;  // larger k needs larger slots
      if (t.prediction.ms < cur.prediction.ms - 1e-9) cur = std::move(t);
    }
    // Greedy merges from the best start: each round, every run of up to
    // kMergeRun neighbouring streamed groups merged into one, the best taken.
    constexpr size_t kMergeRun = 4;
    for (;;) {
      Grouping pick;
      bool found = false;
      for (size_t i = 0; i + 1 < cur.groups.size(); ++i) {
        if (cur.groups[i].resident) continue;
        for (size_t j = i + 1; j < cur.groups.size() && j < i + kMergeRun; ++j) {
          if (cur.groups[j].resident) break;
          std::vector<Group> trial(cur.groups.begin(), cur.groups.begin() + i + 1);
          for (size_t m = i + 1; m <= j; ++m) trial.back().count += cur.groups[m].count;
          trial.insert(trial.end(), cur.groups.begin() + j + 1, cur.groups.end());
          Grouping t;
          if (!eval(trial, depth, t)) break;  // a larger run needs a larger slot
          const double ref = found ? pick.prediction.ms : cur.prediction.ms;
          if (t.prediction.ms < ref - 1e-9) {
            pick = std::move(t);
            found = true;
          }
        }
      }
      if (!found) break;
      cur = std::move(pick);
    }
    if (cur.prediction.ms < best.prediction.ms - 1e-9) best = std::move(cur);
  }
  return best;
}

Grouping choose_grouped(const std::vector<LayerCost>& layers, uint64_t budget,
                        const Link& link, const Pass& pass, const std::vector<uint32_t>& depths) {
  const Plan a = choose(layers, budget, link, pass, depths);
  Grouping best = group(layers, a.resident, budget, link, pass, depths);
  // group() starts from `a` itself (its depth is among those it tries).
  // Groups first: the whole model cut into records of k layers (k = 2..16),
  // and the greedy grouping with none resident; residents then chosen among
  // the records.
  std::vector<std::vector<Group>> cuts;
  const uint32_t L = static_cast<uint32_t>(layers.size());
  for (uint32_t k = 2; k <= std::min<uint32_t>(L, 16); ++k) {
    std::vector<Group> gs;
    for (uint32_t l = 0; l < L; l += k) gs.push_back(Group{l, std::min(k, L - l), false});
    cuts.push_back(std::move(gs));
  }
  try {
    cuts.push_back(
        group(layers, std::vector<bool>(layers.size(), false), budget, link, pass, depths).groups);
  } catch (const Error&) {
  }
  for (const std::vector<Group>& gs : cuts) {
    Plan b;
    try {
      b = choose(grouped_costs(layers, gs), budget, link, pass, depths);
    } catch (const Error&) {
      continue;  // its slots do not fit
    }
    if (b.prediction.ms < best.prediction.ms - 1e-9) {
      best.groups = gs;
      for (size_t i = 0; i < best.groups.size(); ++i) best.groups[i].resident = b.resident[i];
      best.depth = b.depth;
      best.device_bytes = b.device_bytes;
      best.prediction = b.prediction;
    }
  }
  return best;
}

uint64_t charged_bytes(const std::vector<LayerCost>& layers, const std::vector<bool>& resident,
                       uint32_t depth, const Pass& pass, Footprint footprint) {
  if (resident.size() != layers.size())
    fail(LWO_ERR_INVALID_ARGUMENT, "%zu resident flags for %zu layers", resident.size(),
         layers.size());
  auto take = [footprint](uint64_t b) { return footprint ? footprint(b) : b; };
  uint64_t res = 0, slot = 0, grad = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    if (resident[l])
      res += take(layers[l].bytes);
    else
      slot = std::max(slot, layers[l].bytes);
    if (pass.backward) grad = std::max(grad, layers[l].grad_bytes);
  }
  return res + depth * take(slot ? slot : LWO_RECORD_ALIGN) +
         (pass.backward && grad ? pass.grad_depth * take(grad) : 0);
}

Link calibrate(const MeasureLink& measure, uint64_t bytes, bool fit_overhead,
               double copy_overhead_ms) {
  const uint64_t big = bytes ? bytes : (uint64_t(256) << 20);
  Link link = measure(big);
  link.copy_overhead_ms = copy_overhead_ms;
  if (fit_overhead) {  // a second, smaller size: t = overhead + bytes / rate
    const uint64_t small = std::max<uint64_t>(big / 64, 4096);
    if (small < big) {
      const Link s = measure(small);
      auto ms = [](uint64_t b, double gbps) { return static_cast<double>(b) / (gbps * 1e6); };
      try {
        const CopyFit f = fit_copy(small, ms(small, s.h2d_gbps), big, ms(big, link.h2d_gbps));
        link.copy_overhead_ms = f.overhead_ms;
        link.h2d_gbps = f.gbps;
      } catch (const Error&) {
        link.copy_overhead_ms = 0;  // the small copy was not faster: no overhead seen
      }
    }
  }
  return link;
}

Choice best_fit(const Request& r) {
  const std::vector<LayerCost>& layers = r.layers;
  const uint64_t budget = r.budget_bytes;
  auto charged = [&](const std::vector<LayerCost>& costs, const std::vector<bool>& resident,
                     uint32_t depth) {
    return charged_bytes(costs, resident, depth, r.pass, r.footprint);
  };
  Choice c;
  uint64_t room = budget;
  for (int tries = 0;; ++tries) {
    c.plan = choose(layers, room, r.link, r.pass, r.depths);
    const uint64_t need = charged(layers, c.plan.resident, c.plan.depth);
    if (need <= budget) break;
    if (tries == 8 || need - budget >= room)
      fail(LWO_ERR_OVER_BUDGET, "no plan's allocations fit a budget of %llu bytes (the "
           "smallest found needs %llu)", static_cast<unsigned long long>(budget),
           static_cast<unsigned long long>(need));
    room -= need - budget;
  }
  c.room_bytes = room;
  try {
    c.first_k = first_layers(layers, room, r.link, r.pass, c.plan.depth);
  } catch (const Error&) {
    c.first_k = c.plan;
  }
  const uint32_t L = static_cast<uint32_t>(layers.size());
  for (uint32_t l = 0; l < L; ++l) c.groups.push_back(Group{l, 1, c.plan.resident[l]});
  c.prediction = c.plan.prediction;
  c.depth = c.plan.depth;
  c.device_bytes = c.plan.device_bytes;
  if (r.grouping && L > 1) {
    // Groups and residents together; taken only if it predicts less and its
    // charge fits the budget too.
    Grouping g = choose_grouped(layers, room, r.link, r.pass, r.depths);
    if (g.prediction.ms < c.prediction.ms &&
        charged(grouped_costs(layers, g.groups), grouped_resident(g.groups), g.depth) <= budget) {
      c.groups = std::move(g.groups);
      c.prediction = std::move(g.prediction);
      c.depth = g.depth;
      c.device_bytes = g.device_bytes;
    }
  }
  for (uint32_t i = 0; i < c.groups.size(); ++i) {
    uint64_t b = 0;
    for (uint32_t l = c.groups[i].first; l < c.groups[i].first + c.groups[i].count; ++l)
      b += layers[l].bytes;
    c.group_bytes.push_back(b);
    if (c.groups[i].resident) c.resident.push_back(i);
  }
  return c;
}

}  // namespace plan
}  // namespace lwo
