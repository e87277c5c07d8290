// The planner: given each layer's bytes and compute times, the link's rates,
// a ring depth and which layers stay resident on the device, predict a pass
// (forward, or a training step) layer by layer; and choose, for a device
// memory budget, the resident layers, the depth and the groups of records
// that minimise the prediction, with the allocations rounded as the device
// charges them (best_fit). Host code only; the measurements it needs (link
// rates, per-layer compute) and the device's rounding come from the caller.
//
// The model follows the ring's protocol (docs/ARCHITECTURE.md): positions in
// schedule order (0..L-1, then L-1..0 for a step); a streamed layer takes the
// free slot released longest ago and is copied on the one H2D engine once
// that slot's previous layer is computed and the previous copy is done; a
// layer still in a slot is a hit; resident layers need no slot. Compute runs
// in order, each layer once its weights are in place; in a training step each
// trainable layer's gradients leave on the one D2H engine after its backward,
// through `grad_depth` staging slots, and both directions then move at their
// duplex rates. Steps are predicted in the steady state: the second of two
// consecutive steps, whose first layers may still be in their slots.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace lwo {
namespace plan {

struct LayerCost {
  uint64_t bytes = 0;       // the record, host to device when streamed
  uint64_t grad_bytes = 0;  // its gradients, device to host in a step (0: frozen)
  double fwd_ms = 0, bwd_ms = 0;
};

struct Link {  // 1e9 bytes per second
  double h2d_gbps = 0, d2h_gbps = 0;                // each direction alone
  double duplex_h2d_gbps = 0, duplex_d2h_gbps = 0;  // both at once (0: as alone)
  // A fixed cost of every host-to-device copy on top of bytes / rate (launch,
  // descriptor setup, the engine's ramp): what makes many small records
  // slower than a few large ones. 0: none (every copy is bytes / rate).
  double copy_overhead_ms = 0;
};

// The fixed cost and rate of a copy, t = overhead + bytes / rate, fitted
// through two calibration points (bytes_a, ms_a) and (bytes_b, ms_b) with
// bytes_a != bytes_b. A negative fitted overhead (noise) is clamped to 0 and
// the rate refitted through the larger point. Throws LWO_ERR_INVALID_ARGUMENT
// for equal sizes, a time <= 0 or not finite, or a larger copy that was not
// slower (no rate can be fitted).
struct CopyFit {
  double overhead_ms = 0;
  double gbps = 0;
};
CopyFit fit_copy(uint64_t bytes_a, double ms_a, uint64_t bytes_b, double ms_b);

struct Pass {
  bool backward = false;    // a training step: forward, then backward
  uint32_t grad_depth = 2;  // gradient staging slots
};

struct Position {
  uint32_t layer = 0;
  bool backward = false;
  bool resident = false, hit = false;
  double copy_ms = 0;     // its copy (0: resident or hit)
  double start_ms = 0;    // its compute, from the pass's start
  double stall_ms = 0;    // how long the compute waited for this layer
};

struct Prediction {
  double ms = 0;                    // the pass: to the last compute or gradient copy
  double stall_ms = 0;              // summed over positions
  uint64_t h2d_bytes = 0, d2h_bytes = 0;
  std::vector<Position> positions;  // schedule order
};

// The pass with `resident[l]` layers on the device and a ring of `depth`
// slots (>= 1 where any layer streams).
Prediction predict(const std::vector<LayerCost>& layers, const std::vector<bool>& resident,
                   uint32_t depth, const Link& link, const Pass& pass);

// Device bytes of a configuration: the resident records, `depth` slots of the
// largest streamed record, and in a step `grad_depth` staging slots of the
// largest trainable layer's gradients.
uint64_t device_bytes(const std::vector<LayerCost>& layers, const std::vector<bool>& resident,
                      uint32_t depth, const Pass& pass);

struct Plan {
  std::vector<bool> resident;
  uint32_t depth = 0;
  uint64_t device_bytes = 0;
  Prediction prediction;
};

// The plan with the smallest predicted time within `budget_bytes`, over the
// depths given: for each depth, layers are made resident one at a time, each
// time the one that saves the most predicted time per byte among those that
// still fit (a greedy search, each candidate simulated), until none saves
// time. Throws LWO_ERR_OVER_BUDGET (naming the bytes needed) when not even
// the smallest ring fits.
Plan choose(const std::vector<LayerCost>& layers, uint64_t budget_bytes, const Link& link,
            const Pass& pass, const std::vector<uint32_t>& depths = {1, 2, 3, 4, 6, 8});

// The simple rule to compare with: the first k layers resident, k as large as
// the budget allows, at `depth`.
Plan first_layers(const std::vector<LayerCost>& layers, uint64_t budget_bytes, const Link& link,
                  const Pass& pass, uint32_t depth);

// Grouping small records. A group is a run of consecutive layers stored as
// one record: one copy instead of several (each copy costs
// link.copy_overhead_ms), computed one after the other once the
// record is in place, its gradients leaving together after its backward. A
// grouped record needs a slot as large as itself, so grouping trades slot
// memory for fewer copies.
struct Group {
  uint32_t first = 0, count = 1;  // layers first .. first + count - 1
  bool resident = false;
};

// The cost of layers taken as `groups` (bytes, gradient bytes and compute
// times summed), and the groups' resident flags.
std::vector<LayerCost> grouped_costs(const std::vector<LayerCost>& layers,
                                     const std::vector<Group>& groups);
std::vector<bool> grouped_resident(const std::vector<Group>& groups);

struct Grouping {
  std::vector<Group> groups;  // in layer order, covering every layer once
  uint32_t depth = 0;
  uint64_t device_bytes = 0;  // of the grouped records (device_bytes above)
  Prediction prediction;      // positions are groups: Position::layer is a group index
};

// Groups the streamed layers of `resident` (resident layers stay groups of
// one; a group never mixes resident and streamed layers) to minimise the
// predicted pass within `budget_bytes`, over the depths given. The search is
// a greedy merge, for each depth: start from one layer per group; each round
// simulate every merge of two neighbouring streamed groups that still fits
// the budget and take the one that saves the most predicted time; stop when
// no merge saves time. Its start is the ungrouped configuration at the best
// depth that fits, so the result is never predicted slower than no grouping.
// It is not exhaustive (the ring's prediction does not decompose over groups,
// so no exact dynamic program applies); the unit tests compare it with every
// partition on small random models. Throws as choose() when no depth fits.
Grouping group(const std::vector<LayerCost>& layers, const std::vector<bool>& resident,
               uint64_t budget_bytes, const Link& link, const Pass& pass,
               const std::vector<uint32_t>& depths = {1, 2, 3, 4, 6, 8});

// Resident layers, depth and groups together, the better of two orders:
// residents chosen first (choose()) and the streamed layers then grouped
// (group()); or the layers grouped first (the whole model cut into records
// of k = 2..16 layers, or group() with none resident) and the resident
// records then chosen among the groups (choose() over grouped_costs; a
// resident group may then hold several layers). Never predicted slower than
// choose() alone. Throws as choose().
Grouping choose_grouped(const std::vector<LayerCost>& layers, uint64_t budget_bytes,
                        const Link& link, const Pass& pass,
                        const std::vector<uint32_t>& depths = {1, 2, 3, 4, 6, 8});

// ---- The plan for a device budget, in one call ----
//
// The model counts bytes as asked; a device allocator rounds each allocation
// up. `Footprint` is that rounding, the bytes one allocation of `bytes` takes
// (the engine's is device_footprint, engine/engine.h); null: bytes as asked.
using Footprint = uint64_t (*)(uint64_t bytes);

// The bytes a configuration takes when every allocation is rounded by
// `footprint`: each resident record on its own, `depth` slots of the largest
// streamed record (LWO_RECORD_ALIGN bytes when every layer is resident), and
// in a step `grad_depth` staging slots of the largest gradients.
uint64_t charged_bytes(const std::vector<LayerCost>& layers, const std::vector<bool>& resident,
                       uint32_t depth, const Pass& pass, Footprint footprint);

// The link from measurements: `measure(bytes)` times copies of `bytes` each
// way, alone and at once, and returns their rates (copy_overhead_ms unused).
// One size, `bytes` (0: 256 MiB); with `fit_overhead`, a second one 64 times
// smaller (at least 4096 bytes) and fit_copy through the two H2D times give
// the copy overhead and the H2D rate (overhead 0 when the smaller copy was
// not faster). Otherwise, or when the second size would not be smaller, the
// overhead is `copy_overhead_ms`. Throws what `measure` throws.
using MeasureLink = std::function<Link(uint64_t bytes)>;
Link calibrate(const MeasureLink& measure, uint64_t bytes, bool fit_overhead,
               double copy_overhead_ms);

struct Request {
  std::vector<LayerCost> layers;
  uint64_t budget_bytes = 0;  // as the device charges it (footprint)
  Link link;
  Pass pass;
  std::vector<uint32_t> depths = {1, 2, 3, 4, 6, 8};
  bool grouping = false;      // also consider groups of layers (choose_grouped)
  Footprint footprint = nullptr;
};

struct Choice {
  Plan plan;     // one record per layer: choose() within the room that fits
  Plan first_k;  // first_layers() at plan's depth in that room (plan itself if none fits)
  uint64_t room_bytes = 0;  // the budget the model searched within
  // The records recommended (one per layer without grouping) with their
  // bytes, their prediction, depth and model bytes, and the resident ones
  // (ascending record indices).
  std::vector<Group> groups;
  std::vector<uint64_t> group_bytes;
  Prediction prediction;
  uint32_t depth = 0;
  uint64_t device_bytes = 0;
  std::vector<uint32_t> resident;
};

// The plan with the smallest prediction whose charged bytes fit the budget.
// choose() searches the whole budget first; while the chosen plan's charge
// exceeds the budget, it searches again with the excess taken off the room
// (at most 8 times more, and only while the excess is less than the room).
// With `grouping` and more than one layer, choose_grouped() within that same
// room is taken instead when it predicts less and its charge fits too.
// Throws LWO_ERR_OVER_BUDGET (naming the smallest charge found) when no
// search fits, and what choose() and choose_grouped() throw.
Choice best_fit(const Request& request);

}  // namespace plan
}  // namespace lwo
