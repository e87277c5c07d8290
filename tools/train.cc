// lwo train: streams a chain of L square linear layers forward and then
// backward through a ring (one schedule over 0..L-1, L-1..0), sends each
// layer's weight gradients to host memory, and times every step against the
// bound max(resident compute time, H2D bytes / H2D peak, D2H bytes / D2H peak),
// each term measured in the same run. The first timed step is checked bit for
// bit against the same library calls with the weights resident on the device.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tools/cli.h"

namespace cli {
namespace {

constexpr double kTargetFrozen = 1.03;               // step / bound, --frozen
constexpr double kTargetTrainable = 1.10;            // step / bound, trainable layers
constexpr uint64_t kAlign = LWO_RECORD_ALIGN;
// Device memory kept free beyond the buffers counted: cuBLASLt workspace
// (32 MiB per stream), its handle, and slack for the allocator.
constexpr uint64_t kMarginBytes = uint64_t(512) << 20;

uint64_t align_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

struct Options {
  int device = 0;
  uint32_t layers = 32;
  int64_t rows = 8192, cols = 8192;
  lwo_dtype_t dtype = LWO_DTYPE_BF16;
  int64_t tokens = 8192;
  uint32_t depth = 2, grad_depth = 2, steps = 5;
  uint64_t seed = 1;
  bool frozen = false, native_wire = false, bias = false, timing = false;
  bool grad_depth_set = false;
  std::string json;
  bool trainable() const { return !frozen; }
};

// Byte counts of one configuration, all checked for overflow.
struct Sizes {
  uint64_t elem = 0;                 // bytes of one element of the layer dtype
  uint64_t act_bytes = 0;            // one [tokens, cols] activation (or gradient) buffer
  uint64_t record_bytes = 0;         // one layer's record in the pool
  uint64_t bias_off = 0;             // offset of "bias" within the record
  uint64_t pool_bytes = 0;           // all records
  lwo_dtype_t wire = LWO_DTYPE_F32;  // gradient dtype on the wire
  uint64_t grad_bytes = 0;           // one layer's gradients on the wire (0: frozen)
  uint64_t grad_bias_off = 0;        // offset of the bias gradient within them
};

std::vector<Flag> make_flags(Options& o) {
  return {
      switch_flag("--frozen",
                  "every layer frozen: input gradients only, no weight gradients",
                  [&o] { o.frozen = true; }),
      layers_flag(o.layers),
      rows_flag(o.rows),
      cols_flag(o.cols),
      dtype_flag(o.dtype, {LWO_DTYPE_BF16, LWO_DTYPE_F16, LWO_DTYPE_F32}),
      tokens_flag(o.tokens),
      steps_flag(o.steps),
      depth_flag(o.depth),
      value_flag("--grad-depth", "G", grad_depth_flag(o.grad_depth).help,
                 [&o](const std::string& v) {
                   o.grad_depth = static_cast<uint32_t>(parse_uint("--grad-depth", v, 1, 64));
                   o.grad_depth_set = true;
                 }),
      switch_flag("--native-wire",
                  "weight gradients travel in the layer dtype, not f32 (LWO_GRADS_NATIVE_WIRE)",
                  [&o] { o.native_wire = true; }),
      switch_flag("--bias", "each layer also has a tensor \"bias\" [rows]",
                  [&o] { o.bias = true; }),
      seed_flag(o.seed),
      timing_flag(o.timing),
      device_flag(o.device),
      json_flag(o.json),
      quiet_flag(),
      moved_flag("--train",
                 [](const std::string&) {
                   throw UsageError("--train is not needed: lwo train trains");
                 }),
      moved_flag("--passes",
                 [](const std::string&) {
                   throw UsageError("--passes counts the passes of lwo run; lwo train counts "
                                    "--steps");
                 }),
  };
}

std::vector<Flag> help_flags() {
  static Options o;
  return make_flags(o);
}

void check_options(const Options& o) {
  if (o.rows != o.cols)
    throw UsageError(
        strf("--rows %lld and --cols %lld differ: lwo train chains the layers (the output of "
             "layer l is the input of layer l+1), so each weight is square",
             static_cast<long long>(o.rows), static_cast<long long>(o.cols)));
  if (o.frozen && o.native_wire)
    throw UsageError("--native-wire sets how weight gradients travel; --frozen layers have none");
  if (o.frozen && o.grad_depth_set)
    throw UsageError("--grad-depth sizes the gradient staging; --frozen layers have no gradients");
}

Sizes compute_sizes(const Options& o) {
  Sizes s;
  s.elem = lwo_dtype_size(o.dtype);
  auto mul = [](uint64_t a, uint64_t b, const char* what) {
    uint64_t r = 0;
    if (__builtin_mul_overflow(a, b, &r)) throw UsageError(strf("%s do not fit in 64 bits", what));
    return r;
  };
  s.act_bytes =
      mul(mul(static_cast<uint64_t>(o.tokens), static_cast<uint64_t>(o.cols), "the activations"),
          s.elem, "the activations");
  lwo_tensor_desc t[2] = {};
  t[0].name = "weight";
  t[0].dtype = o.dtype;
  t[0].n_dims = 2;
  t[0].shape[0] = o.rows;
  t[0].shape[1] = o.cols;
  t[1].name = "bias";
  t[1].dtype = o.dtype;
  t[1].n_dims = 1;
  t[1].shape[0] = o.rows;
  const lwo_layer_desc layer{t, o.bias ? 2u : 1u, nullptr};
  uint64_t offsets[2] = {};
  if (lwo_record_layout(&layer, offsets, &s.record_bytes) != LWO_OK)
    throw UsageError(lwo_last_error_message());
  s.bias_off = offsets[1];
  s.pool_bytes = mul(s.record_bytes, o.layers, "the layers' records");
  if (o.trainable()) {
    s.wire = o.native_wire ? o.dtype : LWO_DTYPE_F32;
    uint64_t wes = lwo_dtype_size(s.wire);
    uint64_t n =
        mul(static_cast<uint64_t>(o.rows), static_cast<uint64_t>(o.cols), "the weight gradients");
    s.grad_bias_off = align_up(mul(n, wes, "the weight gradients"));
    s.grad_bytes = s.grad_bias_off + (o.bias ? align_up(static_cast<uint64_t>(o.rows) * wes) : 0);
  }
  return s;
}

// --- host values ---------------------------------------------------------------

uint16_t f32_to_bf16(float f) {  // round to nearest even; inputs are finite
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t f32_to_f16(float f) {  // round to nearest even; |f| is far below 65504 here
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up: infinity
  if (ax < 0x38800000u)                          // below 2^-14: subnormal or zero
    return sign | static_cast<uint16_t>(std::lrint(std::fabs(f) * 16777216.0f));
  ax += 0xc8000fffu + ((ax >> 13) & 1u);  // rebias the exponent by -112 and round
  return sign | static_cast<uint16_t>(ax >> 13);
}

float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float f16_to_f32(uint16_t h) {  // exact
  int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0)
    v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31)
    v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else
    v = std::ldexp(static_cast<float>(man | 0x400), exp - 25);
  return (h & 0x8000) ? -v : v;
}

// Element i of a buffer of `dtype` (bf16, f16 or f32) as a float.
float element(const void* data, lwo_dtype_t dtype, uint64_t i) {
  const auto* p = static_cast<const uint8_t*>(data);
  if (dtype == LWO_DTYPE_F32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return dtype == LWO_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// A range of `n` elements of `dtype` to fill with values uniform in
// [-bound, bound), each a function of `key` and its index only.
struct UniformRange {
  void* data;
  lwo_dtype_t dtype;
  uint64_t n;
  float bound;
  uint64_t key;
};

template <class Store>
void fill_chunk(const UniformRange& r, uint64_t b, uint64_t e, Store store) {
  for (uint64_t i = b; i < e; ++i) {
    uint64_t w = mix64(r.key + (i + 1) * kGolden);
    float u = static_cast<float>(w >> 40) * (1.0f / 8388608.0f) - 1.0f;  // [-1, 1)
    store(i, u * r.bound);
  }
}

// Fills the ranges from all cores; adds the bytes written to `phase` (may
// be NULL).
void fill_uniform(const std::vector<UniformRange>& ranges, Phase* phase = nullptr) {
  constexpr uint64_t kChunk = uint64_t(1) << 20;  // elements per work item
  struct Item {
    size_t range;
    uint64_t begin;
  };
  std::vector<Item> items;
  for (size_t r = 0; r < ranges.size(); ++r)
    for (uint64_t b = 0; b < ranges[r].n; b += kChunk) items.push_back({r, b});
  parallel_for(items.size(), [&](size_t i) {
    const UniformRange& r = ranges[items[i].range];
    uint64_t b = items[i].begin, e = std::min(r.n, b + kChunk);
    switch (r.dtype) {
      case LWO_DTYPE_F32: {
        auto* p = static_cast<float*>(r.data);
        fill_chunk(r, b, e, [p](uint64_t j, float v) { p[j] = v; });
        break;
      }
      case LWO_DTYPE_BF16: {
        auto* p = static_cast<uint16_t*>(r.data);
        fill_chunk(r, b, e, [p](uint64_t j, float v) { p[j] = f32_to_bf16(v); });
        break;
      }
      default: {
        auto* p = static_cast<uint16_t*>(r.data);
        fill_chunk(r, b, e, [p](uint64_t j, float v) { p[j] = f32_to_f16(v); });
        break;
      }
    }
    if (phase) phase->add((e - b) * lwo_dtype_size(r.dtype));
  });
}

uint64_t range_key(uint64_t seed, uint64_t tag) { return mix64(seed ^ mix64(tag)); }
constexpr uint64_t kTagInput = uint64_t(1) << 62, kTagGrad = kTagInput + 1;

// --- the chain on the device ----------------------------------------------------

// The activations every layer keeps for the backward pass (x_0 .. x_L), the
// output gradient of the last layer (dy_L, never overwritten) and two
// ping-pong gradient buffers: the backward of layer l reads dy_in(l) and
// writes dx into dx_out(l), which is dy_in(l - 1).
struct Net {
  lwo_engine* engine = nullptr;
  cudaStream_t stream = nullptr;
  lwo_linear_desc desc = LWO_LINEAR_DESC_INIT;
  int64_t tokens = 0;
  uint32_t n_layers = 0;
  bool bias = false;
  lwo_dtype_t grad_dtype = LWO_DTYPE_F32;
  std::vector<DeviceMem> act;
  DeviceMem dy_last, dy_buf[2];

  void* x(uint32_t l) const { return act[l].get(); }
  const void* dy_in(uint32_t l) const {
    uint32_t k = n_layers - 1 - l;  // backward position
    return k == 0 ? dy_last.get() : dy_buf[(k - 1) % 2].get();
  }
  void* dx_out(uint32_t l) const { return dy_buf[(n_layers - 1 - l) % 2].get(); }

  void forward(uint32_t l, const void* w, const void* b) const {
    lwo_status_t s =
        lwo_linear_forward(engine, &desc, tokens, x(l), w, bias ? b : nullptr, x(l + 1), stream);
    if (s != LWO_OK) check(s, strf("lwo_linear_forward (layer %u)", l).c_str());
  }
  void backward(uint32_t l, const void* w, void* dx, void* dw, void* db) const {
    lwo_status_t s = lwo_linear_backward(engine, &desc, tokens, x(l), dy_in(l), w, dx, dw,
                                         bias ? db : nullptr, grad_dtype, stream);
    if (s != LWO_OK) check(s, strf("lwo_linear_backward (layer %u)", l).c_str());
  }
};

// Copies of the records on the device (every layer, or where they do not
// fit only the first and the last), and device buffers for the gradients the
// resident passes compute: one per checked layer, and a scratch for the rest.
struct Resident {
  std::vector<DeviceMem> records;  // per layer; empty where not resident
  bool all = false;
  std::string skipped;          // why not all
  DeviceMem grads[2], scratch;  // layer 0, layer L-1, the others
  uint64_t bias_off = 0, grad_bias_off = 0;

  const void* w(uint32_t l) const { return records[l].get(); }
  const void* b(uint32_t l) const { return static_cast<const uint8_t*>(w(l)) + bias_off; }
  // Gradient buffer of layer l, or null for a frozen model.
  void* g(uint32_t l, uint32_t n_layers) const {
    return l == 0 ? grads[0].get() : l == n_layers - 1 ? grads[1].get() : scratch.get();
  }
  void* gb(uint32_t l, uint32_t n_layers) const {
    void* p = g(l, n_layers);
    return p ? static_cast<uint8_t*>(p) + grad_bias_off : nullptr;
  }
};

// One forward and backward pass over the resident records, with the same calls
// as a streamed step; events (may be null) before, between and after.
void resident_step(const Net& net, const Resident& res, const Event* a, const Event* mid,
                   const Event* b) {
  const uint32_t L = net.n_layers;
  if (a) CHECK(cudaEventRecord(a->get(), net.stream));
  for (uint32_t l = 0; l < L; ++l) net.forward(l, res.w(l), res.b(l));
  if (mid) CHECK(cudaEventRecord(mid->get(), net.stream));
  for (uint32_t l = L; l-- > 0;)
    net.backward(l, res.w(l), net.dx_out(l), res.g(l, L), res.gb(l, L));
  if (b) CHECK(cudaEventRecord(b->get(), net.stream));
}

// --- streamed steps -------------------------------------------------------------

struct StepStats {
  double ms = 0;
  uint64_t h2d_bytes = 0, h2d_fwd_bytes = 0, copies = 0, hits = 0, stages = 0;
  uint64_t d2h_bytes = 0, d2h_layers = 0;
  double copy_ms = 0, wait_ms = 0;  // with --timing
};

lwo_ring_stats ring_stats(lwo_ring* ring) {
  lwo_ring_stats s{};
  s.size = sizeof s;
  CHECK(lwo_ring_get_stats(ring, &s));
  return s;
}

lwo_grads_stats grads_stats(lwo_grads* grads) {
  lwo_grads_stats s{};
  s.size = sizeof s;
  if (grads) CHECK(lwo_grads_get_stats(grads, &s));
  return s;
}

// One step: zero the gradients (untimed), then from the start of the enqueue
// to the return of lwo_grads_wait (or, frozen, of the compute stream's sync):
// reset the schedule, forward 0..L-1, backward L-1..0.
StepStats stream_step(const Net& net, lwo_schedule* schedule, lwo_ring* ring, lwo_grads* grads,
                      bool timing) {
  const uint32_t L = net.n_layers;
  StepStats st;
  if (grads) CHECK(lwo_grads_zero(grads));
  const lwo_ring_stats r0 = ring_stats(ring);
  const lwo_grads_stats g0 = grads_stats(grads);
  lwo_ring_stats r_fwd{};
  const double t0 = now_seconds();
  CHECK(lwo_schedule_reset(schedule, net.stream));
  lwo_layer_view view = LWO_LAYER_VIEW_INIT;
  for (uint32_t i = 0; i < 2 * L; ++i) {
    lwo_status_t s = lwo_schedule_next(schedule, net.stream, &view);
    if (s == LWO_END) fail(strf("the schedule ended after %u of its %u layers", i, 2 * L));
    check(s, "lwo_schedule_next");
    const uint32_t l = i < L ? i : 2 * L - 1 - i;
    if (view.layer != l)
      fail(strf("lwo_schedule_next returned layer %u at position %u; expected layer %u", view.layer,
                i, l));
    const void* w = view.tensors[0];
    const void* b = net.bias ? view.tensors[1] : nullptr;
    if (i < L) {
      net.forward(l, w, b);
      // Without timing the statistics are host counters: reading them does
      // not wait for the GPU. (With it, it would.)
      if (i + 1 == L && !timing) r_fwd = ring_stats(ring);
      continue;
    }
    if (!grads) {
      net.backward(l, w, net.dx_out(l), nullptr, nullptr);
      continue;
    }
    // Weight gradients first and sent at once, so their copy to host runs
    // while dx is computed.
    lwo_layer_view g = LWO_LAYER_VIEW_INIT;
    check(lwo_grads_begin(grads, l, net.stream, &g), "lwo_grads_begin");
    net.backward(l, w, nullptr, g.tensors[0], net.bias ? g.tensors[1] : nullptr);
    check(lwo_grads_end(grads, l, net.stream), "lwo_grads_end");
    net.backward(l, w, net.dx_out(l), nullptr, nullptr);
  }
  lwo_status_t s = lwo_schedule_next(schedule, net.stream, &view);
  if (s != LWO_END) {
    check(s, "lwo_schedule_next");
    fail(strf("the schedule did not end after its %u layers", 2 * L));
  }
  // The step ends when every gradient has landed and the last dx is done.
  if (grads) CHECK(lwo_grads_wait(grads));
  CHECK(cudaStreamSynchronize(net.stream));
  st.ms = seconds_since(t0) * 1e3;
  // The last gradient copy followed all compute; this only makes it certain.
  CHECK(cudaStreamSynchronize(net.stream));
  CHECK(lwo_engine_check(net.engine));
  const lwo_ring_stats r1 = ring_stats(ring);
  const lwo_grads_stats g1 = grads_stats(grads);
  st.h2d_bytes = r1.bytes_copied - r0.bytes_copied;
  st.h2d_fwd_bytes = timing ? 0 : r_fwd.bytes_copied - r0.bytes_copied;
  st.copies = r1.n_copies - r0.n_copies;
  st.hits = r1.n_hits - r0.n_hits;
  st.stages = r1.n_stages - r0.n_stages;
  st.copy_ms = r1.copy_ms - r0.copy_ms;
  st.wait_ms = r1.wait_ms - r0.wait_ms;
  st.d2h_bytes = g1.bytes - g0.bytes;
  st.d2h_layers = g1.n_transfers - g0.n_transfers;
  return st;
}

// --- the check -------------------------------------------------------------------

std::vector<uint8_t> copy_back(const void* device, uint64_t bytes) {
  std::vector<uint8_t> host(bytes);
  // Every stream in flight is non-blocking: this copy on the legacy default
  // stream waits for none of them. Callers have synchronised.
  CHECK(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost));
  return host;
}

// Compares n elements bit for bit; at a difference prints the first one and
// how many differ, and fails. `cols` names rows and columns in the message.
void compare(const std::string& what, const void* got, const void* want, uint64_t n,
             lwo_dtype_t dtype, int64_t cols) {
  const uint64_t es = lwo_dtype_size(dtype);
  const auto* g = static_cast<const uint8_t*>(got);
  const auto* w = static_cast<const uint8_t*>(want);
  if (std::memcmp(g, w, n * es) == 0) return;
  uint64_t first = n, bad = 0;
  constexpr uint64_t kBlock = 4096;  // elements compared at once
  for (uint64_t b = 0; b < n; b += kBlock) {
    uint64_t e = std::min(n, b + kBlock);
    if (std::memcmp(g + b * es, w + b * es, (e - b) * es) == 0) continue;
    for (uint64_t i = b; i < e; ++i)
      if (std::memcmp(g + i * es, w + i * es, es) != 0) {
        if (first == n) first = i;
        ++bad;
      }
  }
  uint64_t gb = 0, wb = 0;
  std::memcpy(&gb, g + first * es, es);
  std::memcpy(&wb, w + first * es, es);
  const int hex = static_cast<int>(2 * es);
  fail(
      strf("check failed: %s differs from the resident reference at element %llu (row %lld, "
           "col %lld): streamed %.9g (0x%0*llx), resident %.9g (0x%0*llx); %llu of %llu "
           "elements differ",
           what.c_str(), static_cast<unsigned long long>(first),
           static_cast<long long>(first / static_cast<uint64_t>(cols)),
           static_cast<long long>(first % static_cast<uint64_t>(cols)), element(g, dtype, first),
           hex, static_cast<unsigned long long>(gb), element(w, dtype, first), hex,
           static_cast<unsigned long long>(wb), static_cast<unsigned long long>(bad),
           static_cast<unsigned long long>(n)));
}

// After the first timed step: saves what the streamed step left on the device
// (the last layer's output, the input gradient) and reads the host gradients
// of the first and the last layer, recomputes them with the resident records
// (the whole chain when every record is resident; else the first and the last
// layer from the streamed step's own inputs) and compares bit for bit.
// Returns a sentence saying what was checked.
std::string check_step(const Options& o, const Sizes& sz, const Net& net, const Resident& res,
                       lwo_grads* grads) {
  const uint32_t L = net.n_layers;
  const uint64_t n_act = static_cast<uint64_t>(o.tokens) * static_cast<uint64_t>(o.cols);
  const std::vector<uint8_t> out = copy_back(net.x(L), sz.act_bytes);
  const std::vector<uint8_t> dx0 = copy_back(net.dx_out(0), sz.act_bytes);
  if (res.all) {
    resident_step(net, res, nullptr, nullptr, nullptr);
  } else {
    // The streamed x_{L-1} and dy of layer 0 are still in place. Layer 0's
    // backward goes first: it reads a ping-pong buffer that layer L-1's dx
    // would overwrite, so layer L-1 computes no dx here.
    net.forward(L - 1, res.w(L - 1), res.b(L - 1));
    net.backward(0, res.w(0), net.dx_out(0), res.g(0, L), res.gb(0, L));
    if (L > 1 && o.trainable())
      net.backward(L - 1, res.w(L - 1), nullptr, res.g(L - 1, L), res.gb(L - 1, L));
  }
  CHECK(cudaStreamSynchronize(net.stream));
  CHECK(lwo_engine_check(net.engine));
  compare(strf("the output of layer %u", L - 1), out.data(),
          copy_back(net.x(L), sz.act_bytes).data(), n_act, o.dtype, o.cols);
  compare("the input gradient (dx of layer 0)", dx0.data(),
          copy_back(net.dx_out(0), sz.act_bytes).data(), n_act, o.dtype, o.cols);
  std::string what = res.all ? "the whole chain recomputed with every weight resident"
                             : "layers 0 and " + std::to_string(L - 1) +
                                   " recomputed from the streamed step's inputs";
  std::string items = strf("output of layer %u, input gradient", L - 1);
  if (!o.trainable()) return "first timed step equals " + what + " bit for bit: " + items;

  const uint32_t checked[2] = {0, L - 1};
  for (uint32_t c = 0; c < (L > 1 ? 2u : 1u); ++c) {
    const uint32_t l = checked[c];
    const std::vector<uint8_t> ref = copy_back(res.g(l, L), sz.grad_bytes);
    const uint64_t n_tensors = o.bias ? 2 : 1;
    for (uint64_t t = 0; t < n_tensors; ++t) {
      const char* name = t == 0 ? "weight" : "bias";
      float* host = nullptr;
      uint64_t first = 0, n = 0;
      CHECK(lwo_grads_shard(grads, l, name, &host, &first, &n));
      const uint64_t want_n =
          static_cast<uint64_t>(o.rows) * static_cast<uint64_t>(t == 0 ? o.cols : 1);
      if (first != 0 || n != want_n)
        fail(strf("lwo_grads_shard(layer %u, \"%s\") has elements [%llu, %llu), expected [0, %llu)",
                  l, name, static_cast<unsigned long long>(first),
                  static_cast<unsigned long long>(first + n),
                  static_cast<unsigned long long>(want_n)));
      // The reference in the wire dtype, widened to f32 exactly as the host
      // gradients were (with the f32 wire, as it is).
      const uint8_t* src = ref.data() + (t == 0 ? 0 : sz.grad_bias_off);
      std::vector<float> want(n);
      for (uint64_t i = 0; i < n; ++i) want[i] = element(src, sz.wire, i);
      compare(strf("d%s of layer %u (host gradients)", name, l), host, want.data(), n,
              LWO_DTYPE_F32, t == 0 ? o.cols : o.rows);
    }
    items += strf(", d%s of layer %u", o.bias ? "weight and dbias" : "weight", l);
  }
  return strf("first timed step equals %s bit for bit (%s wire): %s", what.c_str(),
              lwo_dtype_name(sz.wire), items.c_str());
}

// --- results --------------------------------------------------------------------

struct Results {
  Sizes sz;
  double pool_s = 0, fill_s = 0, grads_s = 0, resident_copy_s = 0;
  float weight_bound = 0, dy_bound = 0;
  uint64_t free_bytes = 0, total_bytes = 0, need_bytes = 0;
  double h2d_peak = 0, h2d_peak_ms = 0, d2h_peak = 0, d2h_peak_ms = 0;
  lwo_ring_info ring{};
  // Resident reference.
  bool resident = false;
  std::string resident_note;
  std::vector<double> res_ms, res_fwd_ms, res_bwd_ms;
  double res_median = 0, res_fwd = 0, res_bwd = 0;
  // Streamed steps.
  StepStats warm;
  std::vector<StepStats> steps;
  double median_ms = 0, best_ms = 0;
  uint64_t h2d_bytes = 0, h2d_fwd_bytes = 0, d2h_bytes = 0, hits = 0, copies = 0, d2h_layers = 0;
  bool bytes_vary = false;
  double copy_ms = 0, wait_ms = 0;  // medians per step, with --timing
  // The bound.
  double h2d_term = 0, d2h_term = 0, bound = 0;
  const char* binding = "";
  bool phases = false;
  double phase_fwd = 0, phase_bwd = 0;
  double target = 0;
  std::string check;

  double ratio(double ms) const { return bound > 0 ? ms / bound : 0; }
  bool met() const { return ratio(median_ms) <= target; }
  double gbps(uint64_t bytes, double ms) const {
    return ms > 0 ? static_cast<double>(bytes) / (ms * 1e6) : 0;
  }
};

template <class T>
T median_of(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void summarise(const Options& o, Results& r) {
  std::vector<double> ms;
  std::vector<uint64_t> h2d, h2d_fwd, d2h, hits, copies, d2h_layers;
  std::vector<double> copy_ms, wait_ms;
  for (const StepStats& s : r.steps) {
    ms.push_back(s.ms);
    h2d.push_back(s.h2d_bytes);
    h2d_fwd.push_back(s.h2d_fwd_bytes);
    d2h.push_back(s.d2h_bytes);
    hits.push_back(s.hits);
    copies.push_back(s.copies);
    d2h_layers.push_back(s.d2h_layers);
    copy_ms.push_back(s.copy_ms);
    wait_ms.push_back(s.wait_ms);
    r.bytes_vary |= s.h2d_bytes != r.steps[0].h2d_bytes || s.d2h_bytes != r.steps[0].d2h_bytes;
  }
  r.median_ms = median(ms);
  r.best_ms = *std::min_element(ms.begin(), ms.end());
  r.h2d_bytes = median_of(h2d);
  r.h2d_fwd_bytes = median_of(h2d_fwd);
  r.d2h_bytes = median_of(d2h);
  r.hits = median_of(hits);
  r.copies = median_of(copies);
  r.d2h_layers = median_of(d2h_layers);
  r.copy_ms = median(copy_ms);
  r.wait_ms = median(wait_ms);

  r.h2d_term = static_cast<double>(r.h2d_bytes) / (r.h2d_peak * 1e6);
  r.d2h_term = r.d2h_peak > 0 ? static_cast<double>(r.d2h_bytes) / (r.d2h_peak * 1e6) : 0;
  r.bound = r.h2d_term;
  r.binding = "H2D";
  if (r.d2h_term > r.bound) {
    r.bound = r.d2h_term;
    r.binding = "D2H";
  }
  if (r.resident && r.res_median > r.bound) {
    r.bound = r.res_median;
    r.binding = "resident compute";
  }
  // Gradients leave only during the backward half, weights arrive in both:
  // the bound of each half, added.
  r.phases = r.resident && !o.timing;
  if (r.phases) {
    double fwd_h2d = static_cast<double>(r.h2d_fwd_bytes) / (r.h2d_peak * 1e6);
    double bwd_h2d = static_cast<double>(r.h2d_bytes - r.h2d_fwd_bytes) / (r.h2d_peak * 1e6);
    r.phase_fwd = std::max(r.res_fwd, fwd_h2d);
    r.phase_bwd = std::max({r.res_bwd, bwd_h2d, r.d2h_term});
  }
  r.target = o.trainable() ? kTargetTrainable : kTargetFrozen;
}

void print_results(const Device& dev, const Options& o, const Results& r) {
  const uint32_t L = o.layers;
  const Sizes& sz = r.sz;
  std::printf("lwo train%s, %s\n", o.frozen ? " --frozen" : "", describe(dev).c_str());
  std::printf("%-10s %u layers x \"weight\" [%lld x %lld]%s %s: %s per record, %s in all; %s\n",
              "model", L, static_cast<long long>(o.rows), static_cast<long long>(o.cols),
              o.bias ? " + \"bias\"" : "", lwo_dtype_name(o.dtype),
              fmt_bytes(sz.record_bytes).c_str(), fmt_bytes(sz.pool_bytes).c_str(),
              o.frozen ? "all frozen (input gradients only)" : "all trainable");
  std::printf(
      "%-10s %lld tokens, x_0 within +-1, dy_%u within +-%.4g; x_0..x_%u kept for the backward "
      "(%u x %s) and 3 x %s of dy on the device\n",
      "batch", static_cast<long long>(o.tokens), L, r.dy_bound, L, L + 1,
      fmt_bytes(sz.act_bytes).c_str(), fmt_bytes(sz.act_bytes).c_str());
  std::printf("%-10s pinned pool %.2f s, uniform fill %.2f s (weights within +-%.4g, seed %llu)",
              "host", r.pool_s, r.fill_s, r.weight_bound, static_cast<unsigned long long>(o.seed));
  if (o.trainable()) std::printf(", gradient buffers %.2f s", r.grads_s);
  std::printf(
      "\n%-10s %.2f GB/s H2D (%u records back-to-back on one stream, best of %d: %.2f ms)\n",
      "peak", r.h2d_peak, L, kPeakRepeats, r.h2d_peak_ms);
  if (o.trainable())
    std::printf("%-10s %.2f GB/s D2H (%u x %s into pinned memory, best of %d: %.2f ms)\n", "peak",
                r.d2h_peak, L, fmt_bytes(sz.grad_bytes).c_str(), kPeakRepeats, r.d2h_peak_ms);
  std::printf("%-10s depth %u, %u x %s slots%s; one schedule: layers 0..%u, then %u..0\n", "ring",
              r.ring.depth, r.ring.depth, fmt_bytes(r.ring.slot_bytes).c_str(),
              o.timing ? ", timing on" : "", L - 1, L - 1);
  if (o.trainable())
    std::printf("%-10s depth %u, %s on the wire: %s per layer, into f32 host buffers\n", "grads",
                o.grad_depth, lwo_dtype_name(sz.wire), fmt_bytes(sz.grad_bytes).c_str());
  if (r.resident)
    std::printf(
        "%-10s median %.3f ms per step (forward %.3f, backward %.3f), all %u records on the "
        "device, %s, %u timed after 1 warm-up\n",
        "resident", r.res_median, r.res_fwd, r.res_bwd, L,
        o.trainable()
            ? strf("%s weight gradients to device memory", lwo_dtype_name(sz.wire)).c_str()
            : "input gradients only",
        o.steps);
  else
    std::printf("%-10s skipped: %s; the bound has no compute term\n", "resident",
                r.resident_note.c_str());
  std::printf(
      "%-10s %u timed after 1 warm-up; host clock from the first enqueue to the return of "
      "%s\n",
      "steps", o.steps, o.trainable() ? "lwo_grads_wait" : "the stream's sync");
  std::printf("%-10s median %.3f ms, best %.3f ms per step\n", "time", r.median_ms, r.best_ms);
  std::printf("%-10s %s per step (%llu copies, %llu ring hits), median %.2f GB/s\n", "H2D",
              fmt_bytes(r.h2d_bytes).c_str(), static_cast<unsigned long long>(r.copies),
              static_cast<unsigned long long>(r.hits), r.gbps(r.h2d_bytes, r.median_ms));
  if (o.trainable())
    std::printf("%-10s %s per step (%llu layers), median %.2f GB/s\n", "D2H",
                fmt_bytes(r.d2h_bytes).c_str(), static_cast<unsigned long long>(r.d2h_layers),
                r.gbps(r.d2h_bytes, r.median_ms));
  if (r.bytes_vary)
    std::printf("%-10s bytes per step varied between steps; medians shown\n", "note");
  std::printf("%-10s %.3f ms, %s binding (", "bound", r.bound, r.binding);
  if (r.resident)
    std::printf("resident %.3f ms, ", r.res_median);
  else
    std::printf("resident not measured, ");
  std::printf("H2D %.3f ms", r.h2d_term);
  if (o.trainable()) std::printf(", D2H %.3f ms", r.d2h_term);
  std::printf(")\n");
  std::printf("%-10s median %.4f, best %.4f x bound (target <= %.2f %s: %s)\n", "ratio",
              r.ratio(r.median_ms), r.ratio(r.best_ms), r.target,
              o.trainable() ? "trainable" : "frozen", r.met() ? "met" : "NOT met");
  if (r.phases)
    std::printf(
        "%-10s forward max(resident %.3f, H2D %.3f) + backward max(resident %.3f, H2D %.3f%s) = "
        "%.3f ms; step / that %.4f\n",
        "halves", r.res_fwd, static_cast<double>(r.h2d_fwd_bytes) / (r.h2d_peak * 1e6), r.res_bwd,
        static_cast<double>(r.h2d_bytes - r.h2d_fwd_bytes) / (r.h2d_peak * 1e6),
        o.trainable() ? strf(", D2H %.3f", r.d2h_term).c_str() : "", r.phase_fwd + r.phase_bwd,
        r.median_ms / (r.phase_fwd + r.phase_bwd));
  if (o.timing)
    std::printf("%-10s copies %.3f ms on the GPU per step, compute waited %.3f ms per step\n",
                "ring time", r.copy_ms, r.wait_ms);
  std::printf("%-10s %s\n", "check", r.check.c_str());
}

void json_step(std::FILE* j, const StepStats& s) {
  std::fprintf(
      j,
      "{\"ms\": %.4f, \"h2d_bytes\": %llu, \"h2d_forward_bytes\": %llu, \"copies\": %llu, "
      "\"hits\": %llu, \"stages\": %llu, \"d2h_bytes\": %llu, \"d2h_layers\": %llu",
      s.ms, static_cast<unsigned long long>(s.h2d_bytes),
      static_cast<unsigned long long>(s.h2d_fwd_bytes), static_cast<unsigned long long>(s.copies),
      static_cast<unsigned long long>(s.hits), static_cast<unsigned long long>(s.stages),
      static_cast<unsigned long long>(s.d2h_bytes), static_cast<unsigned long long>(s.d2h_layers));
  std::fprintf(j, ", \"copy_ms\": %.4f, \"wait_ms\": %.4f}", s.copy_ms, s.wait_ms);
}

void json_list(std::FILE* j, const std::vector<double>& v) {
  std::fputc('[', j);
  for (size_t i = 0; i < v.size(); ++i) std::fprintf(j, "%s%.4f", i ? ", " : "", v[i]);
  std::fputc(']', j);
}

void write_json(std::FILE* j, const Device& dev, const Options& o, const Results& r) {
  const Sizes& sz = r.sz;
  std::fprintf(j,
               "{\n  \"tool\": \"lwo\",\n  \"command\": \"train\",\n  \"mode\": \"%s\",\n"
               "  \"version\": \"%s\",\n  \"device\": %s,\n",
               o.frozen ? "frozen" : "train", version_text().c_str(), json_device(dev).c_str());
  std::fprintf(j,
               "  \"config\": {\"layers\": %u, \"rows\": %lld, \"cols\": %lld, \"dtype\": \"%s\", "
               "\"bias\": %s, \"tokens\": %lld, \"depth\": %u, \"grad_depth\": %u, "
               "\"native_wire\": %s, \"wire_dtype\": %s, \"steps\": %u, \"seed\": %llu, "
               "\"timing\": %s},\n",
               o.layers, static_cast<long long>(o.rows), static_cast<long long>(o.cols),
               lwo_dtype_name(o.dtype), o.bias ? "true" : "false", static_cast<long long>(o.tokens),
               o.depth, o.trainable() ? o.grad_depth : 0, o.native_wire ? "true" : "false",
               o.trainable() ? json_string(lwo_dtype_name(sz.wire)).c_str() : "null", o.steps,
               static_cast<unsigned long long>(o.seed), o.timing ? "true" : "false");
  std::fprintf(
      j,
      "  \"record_bytes\": %llu,\n  \"pool_bytes\": %llu,\n  \"activation_bytes\": %llu,\n"
      "  \"grad_bytes_per_layer\": %llu,\n"
      "  \"device_memory\": {\"free_bytes\": %llu, \"total_bytes\": %llu, "
      "\"needed_bytes\": %llu},\n"
      "  \"host_seconds\": {\"pool_create\": %.4f, \"fill\": %.4f, \"grads_create\": "
      "%.4f, \"resident_copy\": %.4f},\n",
      static_cast<unsigned long long>(sz.record_bytes),
      static_cast<unsigned long long>(sz.pool_bytes), static_cast<unsigned long long>(sz.act_bytes),
      static_cast<unsigned long long>(sz.grad_bytes), static_cast<unsigned long long>(r.free_bytes),
      static_cast<unsigned long long>(r.total_bytes), static_cast<unsigned long long>(r.need_bytes),
      r.pool_s, r.fill_s, r.grads_s, r.resident_copy_s);
  std::fprintf(j, "  \"peak\": {\"h2d_gbps\": %.4f, \"h2d_ms\": %.4f, \"h2d_bytes\": %llu, ",
               r.h2d_peak, r.h2d_peak_ms, static_cast<unsigned long long>(sz.pool_bytes));
  if (o.trainable())
    std::fprintf(j, "\"d2h_gbps\": %.4f, \"d2h_ms\": %.4f, \"d2h_bytes\": %llu, ", r.d2h_peak,
                 r.d2h_peak_ms, static_cast<unsigned long long>(sz.grad_bytes) * o.layers);
  else
    std::fprintf(j, "\"d2h_gbps\": null, ");
  std::fprintf(j, "\"repeats\": %d},\n", kPeakRepeats);
  if (r.resident) {
    std::fprintf(j,
                 "  \"resident\": {\"measured\": true, \"median_ms\": %.4f, \"forward_ms\": %.4f, "
                 "\"backward_ms\": %.4f, \"step_ms\": ",
                 r.res_median, r.res_fwd, r.res_bwd);
    json_list(j, r.res_ms);
    std::fprintf(j, "},\n");
  } else {
    std::fprintf(j, "  \"resident\": {\"measured\": false, \"skipped\": %s},\n",
                 json_string(r.resident_note).c_str());
  }
  std::fprintf(j, "  \"warmup_step\": ");
  json_step(j, r.warm);
  std::fprintf(j, ",\n  \"steps\": [");
  for (size_t i = 0; i < r.steps.size(); ++i) {
    std::fprintf(j, "%s\n    ", i ? "," : "");
    json_step(j, r.steps[i]);
  }
  std::fprintf(j,
               "\n  ],\n  \"median_ms\": %.4f,\n  \"best_ms\": %.4f,\n"
               "  \"h2d_bytes_per_step\": %llu,\n  \"d2h_bytes_per_step\": %llu,\n"
               "  \"hits_per_step\": %llu,\n"
               "  \"achieved_gbps\": {\"h2d\": %.4f, \"d2h\": %.4f},\n",
               r.median_ms, r.best_ms, static_cast<unsigned long long>(r.h2d_bytes),
               static_cast<unsigned long long>(r.d2h_bytes),
               static_cast<unsigned long long>(r.hits), r.gbps(r.h2d_bytes, r.median_ms),
               r.gbps(r.d2h_bytes, r.median_ms));
  std::fprintf(j, "  \"bound\": {\"ms\": %.4f, \"binding\": %s, \"resident_ms\": ", r.bound,
               json_string(r.binding).c_str());
  if (r.resident)
    std::fprintf(j, "%.4f", r.res_median);
  else
    std::fprintf(j, "null");
  std::fprintf(j, ", \"h2d_ms\": %.4f, \"d2h_ms\": %.4f},\n", r.h2d_term, r.d2h_term);
  if (r.phases)
    std::fprintf(j,
                 "  \"halves_bound_ms\": {\"forward\": %.4f, \"backward\": %.4f, \"sum\": %.4f},\n",
                 r.phase_fwd, r.phase_bwd, r.phase_fwd + r.phase_bwd);
  std::fprintf(j,
               "  \"ratio\": {\"median\": %.5f, \"best\": %.5f, \"target\": %.2f, \"met\": %s},\n",
               r.ratio(r.median_ms), r.ratio(r.best_ms), r.target, r.met() ? "true" : "false");
  const lwo_ring_info& ri = r.ring;
  std::fprintf(j, "  \"ring\": {\"depth\": %u, \"slot_bytes\": %llu},\n", ri.depth,
               static_cast<unsigned long long>(ri.slot_bytes));
  std::fprintf(j, "  \"verified\": true,\n  \"check\": %s\n}\n", json_string(r.check).c_str());
}

}  // namespace

int cmd_train(int argc, char** argv);

const Command kTrainCommand = {
    "train",
    "",
    "training steps through a ring, timed against their bound",
    "Trains a chain of square linear layers y = x W^T on random data: one schedule\n"
    "streams layers 0..L-1 forward, then L-1..0 backward; weight gradients go to\n"
    "f32 host buffers (lwo_grads). Each step is timed against max(resident\n"
    "compute, H2D bytes / H2D peak, D2H bytes / D2H peak), all measured in the\n"
    "same run (target: step <= 1.10 x bound, frozen <= 1.03 x), and the first\n"
    "timed step is checked bit for bit against the same computation with every\n"
    "weight resident on the device. --rows must equal --cols.\n",
    help_flags,
    cmd_train,
};

int cmd_train(int argc, char** argv) {
  Options o;
  if (!parse_flags(argc, argv, make_flags(o))) {
    print_command_help(kTrainCommand, stdout);
    return 0;
  }
  check_options(o);
  const uint32_t L = o.layers;
  Results r;
  r.sz = compute_sizes(o);
  const Sizes& sz = r.sz;

  Device dev;
  open_device(o.device, dev);
  lwo_engine* engine = dev.engine.get();
  JsonFile json;
  if (!o.json.empty()) json.open(o.json);
  progress("lwo train%s, %s: %u layers of %s (%s), %lld tokens", o.frozen ? " --frozen" : "",
           describe(dev).c_str(), L, fmt_bytes(sz.record_bytes).c_str(),
           fmt_bytes(sz.pool_bytes).c_str(), static_cast<long long>(o.tokens));
  if (o.depth >= L)
    progress(
        "note: depth %u >= %u layers: after the warm-up every layer stays in a slot, so "
        "steps hit and copy nothing",
        o.depth, L);

  // Device memory for the streamed steps (the resident records come later,
  // where they fit): activations, gradient buffers, ring slots, gradient
  // staging, the check's buffers and records of the first and last layer.
  const uint32_t n_check = L > 1 ? 2 : 1;
  {
    size_t free_b = 0, total_b = 0;
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    r.free_bytes = free_b;
    r.total_bytes = total_b;
    const double act = static_cast<double>(L + 4) * static_cast<double>(sz.act_bytes);
    const double ring = static_cast<double>(o.depth) * static_cast<double>(sz.record_bytes);
    const double grads = static_cast<double>(o.grad_depth + n_check + (L > 2 ? 1 : 0)) *
                         static_cast<double>(sz.grad_bytes);
    const double checks = static_cast<double>(n_check) * static_cast<double>(sz.record_bytes);
    const double need = act + ring + grads + checks + static_cast<double>(kMarginBytes);
    r.need_bytes = need < 1.8e19 ? static_cast<uint64_t>(need) : UINT64_MAX;
    if (need > static_cast<double>(free_b))
      fail(
          strf("lwo train needs about %s of device memory (activations and gradients %s, ring "
               "%s, gradient buffers %s, check records %s, margin %s) but %s of %s is free: "
               "lower --tokens, --layers or --depth",
               fmt_bytes(r.need_bytes).c_str(), fmt_bytes(static_cast<uint64_t>(act)).c_str(),
               fmt_bytes(static_cast<uint64_t>(ring)).c_str(),
               fmt_bytes(static_cast<uint64_t>(grads)).c_str(),
               fmt_bytes(static_cast<uint64_t>(checks)).c_str(), fmt_bytes(kMarginBytes).c_str(),
               fmt_bytes(free_b).c_str(), fmt_bytes(total_b).c_str()));
  }

  // The pool: a chain of square layers, weights uniform within +-sqrt(3 / cols)
  // (variance 1 / cols: activations and gradients keep their scale through
  // any number of layers, so f16 neither overflows nor underflows), biases
  // within +-1 / sqrt(cols).
  double t = now_seconds();
  Phase pool_phase("pool");
  lwo_tensor_desc tensors[2] = {};
  tensors[0].name = "weight";
  tensors[0].dtype = o.dtype;
  tensors[0].n_dims = 2;
  tensors[0].shape[0] = o.rows;
  tensors[0].shape[1] = o.cols;
  tensors[1].name = "bias";
  tensors[1].dtype = o.dtype;
  tensors[1].n_dims = 1;
  tensors[1].shape[0] = o.rows;
  const std::vector<lwo_layer_desc> layers(L, lwo_layer_desc{tensors, o.bias ? 2u : 1u, nullptr});
  Pool pool;
  CHECK(lwo_pool_create_pinned(engine, layers.data(), L, nullptr, pool.out()));
  r.pool_s = seconds_since(t);
  pool_phase.done("pinned, %s in %.2f s", fmt_bytes(sz.pool_bytes).c_str(), r.pool_s);
  r.weight_bound = std::sqrt(3.0f / static_cast<float>(o.cols));
  const float bias_bound = 1.0f / std::sqrt(static_cast<float>(o.cols));
  std::vector<HostRange> records(L);
  std::vector<UniformRange> fill;
  for (uint32_t l = 0; l < L; ++l) {
    CHECK(lwo_pool_layer_host(pool.get(), l, &records[l].data, &records[l].bytes));
    for (uint32_t k = 0; k < (o.bias ? 2u : 1u); ++k) {
      void* p = nullptr;
      uint64_t bytes = 0;
      CHECK(lwo_pool_tensor_host(pool.get(), l, tensors[k].name, &p, &bytes));
      fill.push_back({p, o.dtype, bytes / sz.elem, k == 0 ? r.weight_bound : bias_bound,
                      range_key(o.seed, 2 * uint64_t(l) + k + 1)});
    }
  }
  {
    uint64_t fill_bytes = 0;
    for (const UniformRange& u : fill) fill_bytes += u.n * sz.elem;
    Phase phase("fill", fill_bytes, true);
    fill_uniform(fill, &phase);
    r.fill_s = phase.seconds();
    phase.done("%s uniform within +-%.4g in %.2f s (%.1f GB/s, seed %llu)",
               fmt_bytes(fill_bytes).c_str(), r.weight_bound, r.fill_s,
               static_cast<double>(fill_bytes) / std::max(r.fill_s, 1e-9) / 1e9,
               static_cast<unsigned long long>(o.seed));
  }

  // Peaks, before anything else runs on the GPU.
  {
    Phase phase("peak");
    r.h2d_peak = measure_h2d_peak(records, sz.record_bytes, &r.h2d_peak_ms);
    std::string d2h;
    if (o.trainable()) {
      r.d2h_peak = measure_d2h_peak(sz.grad_bytes, L, &r.d2h_peak_ms);
      d2h = strf("; %.2f GB/s pinned D2H, %u x %s in %.2f ms", r.d2h_peak, L,
                 fmt_bytes(sz.grad_bytes).c_str(), r.d2h_peak_ms);
    }
    phase.done("%.2f GB/s pinned H2D, %s in %.2f ms%s", r.h2d_peak,
               fmt_bytes(sz.pool_bytes).c_str(), r.h2d_peak_ms, d2h.c_str());
  }

  // The chain's buffers and inputs: x_0 uniform in [-1, 1), dy_L uniform
  // within +-1/sqrt(tokens) (so each weight gradient, a sum over the tokens,
  // stays near 1 in size).
  Stream compute = make_stream();
  Net net;
  net.engine = engine;
  net.stream = compute.get();
  net.desc.dtype = o.dtype;
  net.desc.flags = o.bias ? LWO_LINEAR_BIAS : 0u;
  net.desc.in_features = o.cols;
  net.desc.out_features = o.rows;
  net.tokens = o.tokens;
  net.n_layers = L;
  net.bias = o.bias;
  net.grad_dtype = sz.wire;
  for (uint32_t l = 0; l <= L; ++l) net.act.push_back(device_alloc(sz.act_bytes));
  net.dy_last = device_alloc(sz.act_bytes);
  net.dy_buf[0] = device_alloc(sz.act_bytes);
  net.dy_buf[1] = device_alloc(sz.act_bytes);
  {
    const uint64_t n = static_cast<uint64_t>(o.tokens) * static_cast<uint64_t>(o.cols);
    std::vector<uint8_t> host(sz.act_bytes);
    r.dy_bound = 1.0f / std::sqrt(static_cast<float>(o.tokens));
    fill_uniform({{host.data(), o.dtype, n, 1.0f, range_key(o.seed, kTagInput)}});
    CHECK(cudaMemcpyAsync(net.x(0), host.data(), sz.act_bytes, cudaMemcpyHostToDevice, net.stream));
    CHECK(cudaStreamSynchronize(net.stream));  // pageable source: wait before reuse and reads
    fill_uniform({{host.data(), o.dtype, n, r.dy_bound, range_key(o.seed, kTagGrad)}});
    CHECK(cudaMemcpyAsync(net.dy_last.get(), host.data(), sz.act_bytes, cudaMemcpyHostToDevice, net.stream));
    CHECK(cudaStreamSynchronize(net.stream));  // pageable source: wait before reuse and reads
  }

  // The ring, the schedule (forward 0..L-1, backward L-1..0) and the gradients.
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  ring_config.depth = o.depth;
  ring_config.flags = o.timing ? LWO_RING_TIMING : 0u;
  Ring ring;
  CHECK(lwo_ring_create(pool.get(), &ring_config, ring.out()));
  r.ring.size = sizeof r.ring;
  CHECK(lwo_ring_get_info(ring.get(), &r.ring));
  std::vector<uint32_t> order(2 * size_t(L));
  for (uint32_t l = 0; l < L; ++l) order[l] = order[2 * size_t(L) - 1 - l] = l;
  Schedule schedule;
  CHECK(lwo_schedule_create(ring.get(), order.data(), 2 * L, schedule.out()));
  Grads grads;
  if (o.trainable()) {
    lwo_grads_config grads_config = LWO_GRADS_CONFIG_INIT;
    grads_config.depth = o.grad_depth;
    grads_config.flags = o.native_wire ? LWO_GRADS_NATIVE_WIRE : 0u;
    Phase phase("grads");
    CHECK(lwo_grads_create(pool.get(), nullptr, &grads_config, grads.out()));
    r.grads_s = phase.seconds();
    phase.done("f32 host buffers for %u layers in %.2f s, %s on the wire", L, r.grads_s,
               lwo_dtype_name(sz.wire));
  }

  // The resident reference: every record on the device where they fit, else
  // only the first and the last (for the check).
  Resident res;
  res.bias_off = sz.bias_off;
  res.grad_bias_off = sz.grad_bias_off;
  res.records.resize(L);
  if (o.trainable()) {
    res.grads[0] = device_alloc(sz.grad_bytes);
    if (L > 1) res.grads[1] = device_alloc(sz.grad_bytes);
  }
  res.records[0] = device_alloc(sz.record_bytes);
  if (L > 1) res.records[L - 1] = device_alloc(sz.record_bytes);
  {
    size_t free_b = 0, total_b = 0;
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double rest = static_cast<double>(L - n_check) * static_cast<double>(sz.record_bytes) +
                        (o.trainable() && L > 2 ? static_cast<double>(sz.grad_bytes) : 0.0);
    res.all =
        L <= n_check || rest + static_cast<double>(kMarginBytes) <= static_cast<double>(free_b);
    if (!res.all)
      res.skipped =
          strf("the other %u records (%s) do not fit in the %s of device memory left", L - n_check,
               fmt_bytes(static_cast<uint64_t>(rest)).c_str(), fmt_bytes(free_b).c_str());
    for (uint32_t l = 1; res.all && l + 1 < L; ++l) {
      void* p = nullptr;
      cudaError_t e = cudaMalloc(&p, sz.record_bytes);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        res.all = false;
        res.skipped = strf("cudaMalloc of the record of layer %u failed: out of memory", l);
        for (uint32_t k = 1; k < l; ++k) res.records[k].destroy();
        break;
      }
      check(e, "cudaMalloc (resident record)");
      res.records[l] = DeviceMem(p);
    }
    if (res.all && o.trainable() && L > 2) {
      void* p = nullptr;
      cudaError_t e = cudaMalloc(&p, sz.grad_bytes);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        res.all = false;
        res.skipped = "cudaMalloc of the gradient scratch failed: out of memory";
        for (uint32_t k = 1; k + 1 < L; ++k) res.records[k].destroy();
      } else {
        check(e, "cudaMalloc (resident gradient scratch)");
        res.scratch = DeviceMem(p);
      }
    }
  }
  t = now_seconds();
  for (uint32_t l = 0; l < L; ++l)
    if (res.records[l].get())
      CHECK(cudaMemcpy(res.records[l].get(), records[l].data, sz.record_bytes,
                       cudaMemcpyHostToDevice));
  r.resident_copy_s = seconds_since(t);
  r.resident = res.all;
  r.resident_note = res.skipped;

  if (res.all) {
    Phase phase("resident", o.steps + 1);
    Event a = make_event(), mid = make_event(), b = make_event();
    for (uint32_t s = 0; s <= o.steps; ++s) {
      resident_step(net, res, &a, &mid, &b);
      CHECK(cudaEventSynchronize(b.get()));
      CHECK(lwo_engine_check(engine));
      if (s == 0) {  // warm-up: algorithm choice, workspace
        phase.set(1, "warm-up step done");
        continue;
      }
      double f = elapsed_ms(a, mid), bw = elapsed_ms(mid, b);
      r.res_fwd_ms.push_back(f);
      r.res_bwd_ms.push_back(bw);
      r.res_ms.push_back(f + bw);
      phase.set(s + 1, strf("step %u/%u: %.3f ms (forward %.3f, backward %.3f)", s, o.steps,
                            f + bw, f, bw));
    }
    r.res_median = median(r.res_ms);
    r.res_fwd = median(r.res_fwd_ms);
    r.res_bwd = median(r.res_bwd_ms);
    phase.done("1 warm-up + %u timed steps with every record on the device: median %.3f ms "
               "(forward %.3f, backward %.3f)",
               o.steps, r.res_median, r.res_fwd, r.res_bwd);
  } else {
    progress("resident: skipped: %s; the bound has no compute term", res.skipped.c_str());
  }

  // The streamed steps: one warm-up, then the timed ones.
  Phase steps_phase("steps", o.steps + 1);
  auto report = [&](const char* name, const StepStats& s) {
    return strf("%s: %.3f ms; H2D %s %.2f GB/s, %llu hits%s", name, s.ms,
                fmt_bytes(s.h2d_bytes).c_str(), r.gbps(s.h2d_bytes, s.ms),
                static_cast<unsigned long long>(s.hits),
                o.trainable() ? strf("; D2H %s %.2f GB/s", fmt_bytes(s.d2h_bytes).c_str(),
                                     r.gbps(s.d2h_bytes, s.ms))
                                    .c_str()
                              : "");
  };
  r.warm = stream_step(net, schedule.get(), ring.get(), grads.get(), o.timing);
  steps_phase.set(1, report("warm-up step", r.warm));
  for (uint32_t s = 1; s <= o.steps; ++s) {
    r.steps.push_back(stream_step(net, schedule.get(), ring.get(), grads.get(), o.timing));
    steps_phase.set(s + 1, report(strf("step %u/%u", s, o.steps).c_str(), r.steps.back()));
    if (s == 1) {
      r.check = check_step(o, sz, net, res, grads.get());
      progress("check: %s", r.check.c_str());
    }
  }
  CHECK(cudaStreamSynchronize(compute.get()));
  CHECK(lwo_engine_synchronize(engine));
  summarise(o, r);
  steps_phase.done("1 warm-up + %u timed streamed steps in %.2f s: median %.3f ms, %.4f x the "
                   "bound (%s)",
                   o.steps, steps_phase.seconds(), r.median_ms, r.ratio(r.median_ms), r.binding);

  print_results(dev, o, r);
  if (json.is_open()) {
    write_json(json.get(), dev, o, r);
    json.commit();
  }
  grads.destroy();
  schedule.destroy();
  ring.destroy();
  res = Resident();
  net = Net();
  compute.destroy();
  pool.destroy();
  dev.engine.destroy();
  return 0;
}

}  // namespace cli
