// One rank of a sharded pool, as a process of its own on CUDA device `rank`
// (launched by tests/gpu/sharded_process_test.cc, two at a time):
//
//   lwo_shard_rank --rank R --ranks N --id HEX --seed S [--check] [--mismatch pool|stage]
//
// HEX is the 128 bytes of an lwo_nccl_unique_id as 256 hex digits. Every rank
// builds the same model on the host from the seed (linear layers of odd
// sizes: "weight" [out, in] bf16 and "bias" [out] bf16 or f32, so shard
// boundaries fall inside tensors, on tensor starts and in padding) and checks:
//
//  - lwo_pool_shard_host and lwo_pool_shard_tensor against the full records
//    (lwo_pool_write copies only this rank's shard);
//  - rings of depth 2 and 3 staging every layer in a seeded order (the same on
//    every rank), several tickets ahead: each slot holds the whole record,
//    byte for byte, and a layer staged again right after its release is a hit;
//  - gradients: two micro-batches of lwo_linear_backward per layer into
//    lwo_grads staging slots (each rank its own inputs), then lwo_grads_shard
//    against the sum of every rank's gradients, which this rank recomputes on
//    its own GPU from the seeds;
//  - lwo_grads_shard gives only this rank's part of the sharded gradients.
//
// It prints one line per tensor and kind, "POOLRANGE layer name first n numel"
// and "GRADRANGE layer name first n numel", for the parent to check that the
// ranks' ranges cover every element exactly once, then "DONE rank R".
//
// --check creates the engine with LWO_ENGINE_CHECK_COLLECTIVES.
// --mismatch pool: rank 1 describes a different layer 3; every rank must get
//   LWO_ERR_COLLECTIVE_MISMATCH from lwo_pool_create_sharded, naming the call
//   (then prints "DONE rank R" and exits 0).
// --mismatch stage (needs --check): at the first step of the first ring, rank
//   0 stages one layer and the others another; every rank must get
//   LWO_ERR_COLLECTIVE_MISMATCH from lwo_ring_stage, and everything then goes
//   on as without it (the ring stays usable).
//
// Exits 0 when every check passed; otherwise prints what failed (rank, call,
// status, lwo_last_error_message) to stderr and exits 1.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "lwo.h"
#include "testkit/check.h"
#include "testkit/dtype.h"
#include "testkit/owner.h"
#include "testkit/random.h"

namespace {

int g_rank = -1;
int g_failures = 0;

[[noreturn]] void die(const char* fmt, ...) {
  std::fflush(stdout);
  std::fprintf(stderr, "rank %d: ", g_rank);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
  std::fflush(stderr);
  // No exit handlers: another rank may be stuck in a collective with us.
  _exit(1);
}

// A check that does not stop the rank (the first few are printed).
void fail(const char* fmt, ...) {
  ++g_failures;
  if (g_failures > 40) return;
  std::fprintf(stderr, "rank %d: FAILED: ", g_rank);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
}

#define LWO_CHECK(expr)                                                                    \
  do {                                                                                     \
    lwo_status_t lwo_s_ = (expr);                                                          \
    if (lwo_s_ != LWO_OK)                                                                  \
      die("%s (line %d) returned %s", #expr, __LINE__, testkit::describe(lwo_s_).c_str()); \
  } while (0)

#define CUDA_CHECK(expr)                                                                    \
  do {                                                                                      \
    cudaError_t cuda_e_ = (expr);                                                           \
    if (cuda_e_ != cudaSuccess)                                                             \
      die("%s (line %d): %s", #expr, __LINE__, testkit::describe(cuda_e_).c_str());         \
  } while (0)

#define REQUIRE(cond, ...)                   \
  do {                                       \
    if (!(cond)) die(__VA_ARGS__);           \
  } while (0)

// ---- deterministic random numbers (the same on every rank) ----

// The testkit generator's sub-stream of (a, b, c) under `seed`.
testkit::Rng make_rng(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  testkit::Rng rng(seed);
  rng.absorb(a).absorb(b).absorb(c);
  return rng;
}

// Fills `count` elements of `dtype` (bf16 or f32) at `out` with values in
// [-scale, scale).
void fill_values(uint8_t* out, uint64_t count, lwo_dtype_t dtype, float scale, testkit::Rng& rng) {
  for (uint64_t i = 0; i < count; ++i) testkit::store_f32(out, dtype, i, rng.uniform_pm1() * scale);
}

// ---- the model ----

struct LayerShape {
  int64_t out, in;
  lwo_dtype_t bias_dtype;
};

// With 2 ranks (S = R/2 rounded up to 256 bytes) the boundary falls inside the
// weight (most layers), inside an f32 bias (layer 1: rank 1 holds none of the
// weight), and on the start of the bias (layer 6: each rank holds one whole
// tensor and none of the other). Layer 4 has one output.
const LayerShape kLayers[] = {
    {37, 301, LWO_DTYPE_BF16}, {3000, 1, LWO_DTYPE_F32}, {129, 1000, LWO_DTYPE_BF16},
    {515, 77, LWO_DTYPE_F32},  {1, 4097, LWO_DTYPE_BF16}, {250, 3, LWO_DTYPE_F32},
    {5, 7, LWO_DTYPE_BF16},
};
constexpr uint32_t kNumLayers = sizeof(kLayers) / sizeof(kLayers[0]);
constexpr uint32_t kMismatchLayer = 3;
const char* const kNames[2] = {"weight", "bias"};

struct HostTensor {
  const char* name = nullptr;
  lwo_dtype_t dtype = LWO_DTYPE_BF16;
  uint64_t numel = 0;
  uint64_t offset = 0;  // in the record
  std::vector<uint8_t> bytes;
};

struct HostLayer {
  LayerShape shape{};
  lwo_tensor_desc desc[2];
  HostTensor t[2];
  uint64_t record_bytes = 0;
  std::vector<uint8_t> record;  // the whole record, zero padded
};

std::vector<HostLayer> make_model(uint64_t seed, bool mismatched) {
  std::vector<HostLayer> model(kNumLayers);
  for (uint32_t l = 0; l < kNumLayers; ++l) {
    HostLayer& h = model[l];
    h.shape = kLayers[l];
    if (mismatched && l == kMismatchLayer) h.shape.out += 85;  // a different record size
    const int64_t out = h.shape.out, in = h.shape.in;
    std::memset(h.desc, 0, sizeof h.desc);
    h.desc[0].name = kNames[0];
    h.desc[0].dtype = LWO_DTYPE_BF16;
    h.desc[0].n_dims = 2;
    h.desc[0].shape[0] = out;
    h.desc[0].shape[1] = in;
    h.desc[1].name = kNames[1];
    h.desc[1].dtype = h.shape.bias_dtype;
    h.desc[1].n_dims = 1;
    h.desc[1].shape[0] = out;
    lwo_layer_desc ld{h.desc, 2, nullptr};
    uint64_t offsets[2] = {0, 0};
    LWO_CHECK(lwo_record_layout(&ld, offsets, &h.record_bytes));
    h.record.assign(h.record_bytes, 0);
    testkit::Rng rng = make_rng(seed, 0x1000 + l);
    for (int k = 0; k < 2; ++k) {
      HostTensor& t = h.t[k];
      t.name = kNames[k];
      t.dtype = h.desc[k].dtype;
      t.numel = static_cast<uint64_t>(k == 0 ? out * in : out);
      t.offset = offsets[k];
      t.bytes.resize(t.numel * lwo_dtype_size(t.dtype));
      fill_values(t.bytes.data(), t.numel, t.dtype,
                  k == 0 ? 1.0f / std::sqrt(static_cast<float>(in)) : 1.0f, rng);
      REQUIRE(t.offset % LWO_RECORD_ALIGN == 0 && t.offset + t.bytes.size() <= h.record_bytes,
              "lwo_record_layout: tensor %s of layer %u at %llu (%zu bytes) in a record of %llu",
              t.name, l, (unsigned long long)t.offset, t.bytes.size(),
              (unsigned long long)h.record_bytes);
      std::memcpy(h.record.data() + t.offset, t.bytes.data(), t.bytes.size());
    }
  }
  return model;
}

// The elements of tensor `t` that lie in bytes [shard_off, shard_off + shard_bytes).
struct Range {
  uint64_t first = 0, n = 0;
};
Range shard_range(const HostTensor& t, uint64_t shard_off, uint64_t shard_bytes) {
  const uint64_t es = lwo_dtype_size(t.dtype);
  uint64_t lo = std::max(shard_off, t.offset);
  uint64_t hi = std::min(shard_off + shard_bytes, t.offset + t.bytes.size());
  Range r;
  if (hi > lo) {
    r.first = (lo - t.offset) / es;
    r.n = (hi - lo) / es;
  }
  return r;
}

// ---- device buffers ----

struct DevBuf {
  testkit::DeviceMem mem;
  void* p = nullptr;
  size_t bytes = 0;
  void alloc(size_t n) {
    bytes = n;
    CUDA_CHECK(cudaMalloc(mem.out(), std::max<size_t>(n, 1)));
    p = mem.get();
  }
  void upload(const std::vector<uint8_t>& h) {
    alloc(h.size());
    CUDA_CHECK(cudaMemcpy(p, h.data(), h.size(), cudaMemcpyHostToDevice));
  }
};

// ---- gradients' inputs: rank q's tokens, x_q [T, in] and dy_q [T, out] bf16 ----

int64_t tokens_of(int q) { return 29 + 12 * q; }

struct Inputs {
  std::vector<uint8_t> x, dy;
};
Inputs make_inputs(uint64_t seed, int q, uint32_t layer, int micro, const LayerShape& s) {
  Inputs in;
  const int64_t T = tokens_of(q);
  testkit::Rng rng =
      make_rng(seed, 0x2000 + static_cast<uint64_t>(q), layer, static_cast<uint64_t>(micro));
  in.x.resize(static_cast<size_t>(T * s.in) * 2);
  in.dy.resize(static_cast<size_t>(T * s.out) * 2);
  fill_values(in.x.data(), static_cast<uint64_t>(T * s.in), LWO_DTYPE_BF16, 1.0f, rng);
  fill_values(in.dy.data(), static_cast<uint64_t>(T * s.out), LWO_DTYPE_BF16, 1.0f, rng);
  return in;
}

lwo_linear_desc linear_of(const LayerShape& s) {
  lwo_linear_desc d;
  lwo_linear_desc_init(&d);
  d.dtype = LWO_DTYPE_BF16;
  d.flags = LWO_LINEAR_BIAS;
  d.in_features = s.in;
  d.out_features = s.out;
  return d;
}

constexpr int kMicroBatches = 2;

// ---- the phases ----

struct Ctx {
  int rank = 0, ranks = 0;
  uint64_t seed = 0;
  bool check = false;
  std::string mismatch;  // "", "pool" or "stage"
  lwo_engine* engine = nullptr;
  lwo_pool* pool = nullptr;
  std::vector<HostLayer> model;
  uint64_t max_record = 0;
  std::vector<uint64_t> shard_off, shard_bytes;       // per layer
  std::vector<std::vector<Range>> pool_ranges;        // per layer, per tensor
  cudaStream_t stream = nullptr;
};

uint64_t expected_shard_bytes(uint64_t record, int ranks) {
  uint64_t s = (record + static_cast<uint64_t>(ranks) - 1) / static_cast<uint64_t>(ranks);
  return (s + LWO_RECORD_ALIGN - 1) / LWO_RECORD_ALIGN * LWO_RECORD_ALIGN;
}

void check_pool_shards(Ctx& c) {
  lwo_pool_info info;
  std::memset(&info, 0, sizeof info);
  info.size = sizeof info;
  LWO_CHECK(lwo_pool_get_info(c.pool, &info));
  REQUIRE(info.n_layers == kNumLayers, "lwo_pool_get_info: %u layers, want %u", info.n_layers,
          kNumLayers);
  if (info.max_record_bytes != c.max_record)
    fail("lwo_pool_get_info: max_record_bytes %llu, want %llu",
         (unsigned long long)info.max_record_bytes, (unsigned long long)c.max_record);
  c.shard_off.assign(kNumLayers, 0);
  c.shard_bytes.assign(kNumLayers, 0);
  c.pool_ranges.assign(kNumLayers, std::vector<Range>(2));
  for (uint32_t l = 0; l < kNumLayers; ++l) {
    const HostLayer& h = c.model[l];
    uint64_t rb = 0;
    LWO_CHECK(lwo_pool_record_bytes(c.pool, l, &rb));
    REQUIRE(rb == h.record_bytes, "lwo_pool_record_bytes(layer %u) = %llu, want %llu", l,
            (unsigned long long)rb, (unsigned long long)h.record_bytes);
    void* shard = nullptr;
    uint64_t off = 0, sb = 0;
    LWO_CHECK(lwo_pool_shard_host(c.pool, l, &shard, &off, &sb));
    const uint64_t want_s = expected_shard_bytes(h.record_bytes, c.ranks);
    REQUIRE(sb == want_s && off == static_cast<uint64_t>(c.rank) * want_s,
            "lwo_pool_shard_host(layer %u): offset %llu, %llu bytes; want %llu, %llu (record %llu)",
            l, (unsigned long long)off, (unsigned long long)sb,
            (unsigned long long)(c.rank * want_s), (unsigned long long)want_s,
            (unsigned long long)h.record_bytes);
    REQUIRE(shard != nullptr, "lwo_pool_shard_host(layer %u): NULL data", l);
    c.shard_off[l] = off;
    c.shard_bytes[l] = sb;
    // The shard's bytes: the record's [off, off + sb), zero beyond the record.
    const uint8_t* sp = static_cast<const uint8_t*>(shard);
    uint64_t bad = 0, first_bad = 0;
    for (uint64_t i = 0; i < sb; ++i) {
      uint8_t want = off + i < h.record_bytes ? h.record[off + i] : 0;
      if (sp[i] != want && bad++ == 0) first_bad = i;
    }
    if (bad)
      fail("layer %u: %llu bytes of the host shard differ from the record (first at shard byte %llu)",
           l, (unsigned long long)bad, (unsigned long long)first_bad);
    // Each tensor's part of the shard.
    for (int k = 0; k < 2; ++k) {
      const HostTensor& t = h.t[k];
      const uint64_t es = lwo_dtype_size(t.dtype);
      Range want = shard_range(t, off, sb);
      void* data = nullptr;
      uint64_t first = ~0ull, n = ~0ull;
      LWO_CHECK(lwo_pool_shard_tensor(c.pool, l, t.name, &data, &first, &n));
      Range got{first, n};
      if (got.n != want.n || (want.n && got.first != want.first)) {
        fail("lwo_pool_shard_tensor(layer %u, %s): elements [%llu, +%llu), want [%llu, +%llu)", l,
             t.name, (unsigned long long)got.first, (unsigned long long)got.n,
             (unsigned long long)want.first, (unsigned long long)want.n);
      } else if (want.n == 0) {
        if (data != nullptr) fail("lwo_pool_shard_tensor(layer %u, %s): 0 elements but data %p", l, t.name, data);
        got.first = 0;
      } else {
        const uint8_t* expect_ptr = sp + (t.offset + want.first * es - off);
        if (data != expect_ptr)
          fail("lwo_pool_shard_tensor(layer %u, %s): data %p, want the shard's address %p", l,
               t.name, data, static_cast<const void*>(expect_ptr));
        if (std::memcmp(data, t.bytes.data() + want.first * es, want.n * es) != 0)
          fail("lwo_pool_shard_tensor(layer %u, %s): the bytes differ from the tensor's", l, t.name);
      }
      c.pool_ranges[l][k] = got;
      std::printf("POOLRANGE %u %s %llu %llu %llu\n", l, t.name, (unsigned long long)got.first,
                  (unsigned long long)got.n, (unsigned long long)t.numel);
    }
  }
  std::fflush(stdout);
}

// A seeded order of `n` stages for a ring of `depth` slots read with `depth`
// stages in flight: every layer once (shuffled), then random layers, a third
// of them the layer `depth` entries back (released just before this stage,
// so it is a hit). No layer repeats within depth - 1 entries (it would still
// be staged: LWO_ERR_LAYER_BUSY). `*sure_hits` counts the entries that repeat
// the one `depth` back.
std::vector<uint32_t> stage_order(uint64_t seed, size_t n, uint32_t depth, uint64_t* sure_hits) {
  testkit::Rng rng = make_rng(seed, 0x3000, n, depth);
  std::vector<uint32_t> order(kNumLayers);
  for (uint32_t l = 0; l < kNumLayers; ++l) order[l] = l;
  for (uint32_t i = kNumLayers; i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  *sure_hits = 0;
  while (order.size() < n) {
    const size_t j = order.size();
    uint32_t l = rng.below(3) == 0 ? order[j - depth] : static_cast<uint32_t>(rng.below(kNumLayers));
    bool recent = false;
    for (size_t k = 1; k < depth; ++k) recent |= order[j - k] == l;
    if (recent) continue;
    *sure_hits += order[j - depth] == l;
    order.push_back(l);
  }
  return order;
}

void check_view(const Ctx& c, const lwo_layer_view& v, uint32_t layer, const char* what) {
  const HostLayer& h = c.model[layer];
  REQUIRE(v.layer == layer && v.n_tensors == 2 && v.record_bytes == h.record_bytes &&
              v.base != nullptr,
          "%s: view of layer %u: layer %u, %u tensors, %llu record bytes (want %llu)", what, layer,
          v.layer, v.n_tensors, (unsigned long long)v.record_bytes,
          (unsigned long long)h.record_bytes);
  for (int k = 0; k < 2; ++k)
    REQUIRE(v.tensors[k] == static_cast<uint8_t*>(v.base) + h.t[k].offset,
            "%s: layer %u tensor %s at %p, want base + %llu", what, layer, h.t[k].name,
            v.tensors[k], (unsigned long long)h.t[k].offset);
}

// Slots copied back to pinned host memory, compared once the stream is done.
struct SlotCopies {
  testkit::PinnedMem mem;
  uint8_t* host = nullptr;
  uint64_t stride = 0;
  size_t capacity = 0;
  std::vector<std::pair<uint32_t, std::string>> entries;  // layer, what
  SlotCopies(size_t n, uint64_t max_record) : stride(max_record), capacity(n) {
    CUDA_CHECK(cudaMallocHost(mem.out(), std::max<uint64_t>(n * stride, 1)));
    host = static_cast<uint8_t*>(mem.get());
  }
  void add(const Ctx& c, const lwo_layer_view& v, std::string what) {
    REQUIRE(entries.size() < capacity && v.record_bytes <= stride,
            "%s: no room to copy the slot back", what.c_str());
    CUDA_CHECK(cudaMemcpyAsync(host + entries.size() * stride, v.base, v.record_bytes,
                               cudaMemcpyDeviceToHost, c.stream));
    entries.emplace_back(v.layer, std::move(what));
  }
  void verify(const Ctx& c) {
    CUDA_CHECK(cudaStreamSynchronize(c.stream));
    for (size_t i = 0; i < entries.size(); ++i) {
      const HostLayer& h = c.model[entries[i].first];
      const uint8_t* got = host + i * stride;
      if (std::memcmp(got, h.record.data(), h.record_bytes) != 0) {
        uint64_t first_bad = 0;
        while (got[first_bad] == h.record[first_bad]) ++first_bad;
        fail("%s: the slot differs from the record of layer %u (%llu bytes) from byte %llu on",
             entries[i].second.c_str(), entries[i].first, (unsigned long long)h.record_bytes,
             (unsigned long long)first_bad);
      }
    }
    entries.clear();
  }
};

// Stage, acquire, copy back, release, one layer at a time (verified at once).
void round_trip(Ctx& c, lwo_ring* ring, uint32_t layer, const std::string& what) {
  SlotCopies copies(1, c.max_record);
  lwo_ticket t{0};
  LWO_CHECK(lwo_ring_stage(ring, layer, &t));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  LWO_CHECK(lwo_ring_acquire(ring, t, c.stream, &v));
  check_view(c, v, layer, what.c_str());
  copies.add(c, v, what);
  LWO_CHECK(lwo_ring_release(ring, t, c.stream));
  copies.verify(c);
}

// --mismatch stage: rank 0 stages layer 1, the others layer 2. Every rank must
// be refused, and the ring must go on as if the call had not been made.
void stage_mismatch(Ctx& c, lwo_ring* ring) {
  round_trip(c, ring, 0, "before the mismatched stage");
  const uint32_t mine = c.rank == 0 ? 1u : 2u;
  lwo_ticket t{0};
  lwo_status_t s = lwo_ring_stage(ring, mine, &t);
  std::string msg = lwo_last_error_message();
  std::printf("STAGE_MISMATCH %s: %s\n", lwo_status_string(s), msg.c_str());
  std::fflush(stdout);
  if (s == LWO_OK) die("lwo_ring_stage of layer %u (the other ranks stage another) returned LWO_OK", mine);
  if (s != LWO_ERR_COLLECTIVE_MISMATCH)
    die("lwo_ring_stage of layer %u (the other ranks stage another) returned %s, want "
        "LWO_ERR_COLLECTIVE_MISMATCH: %s", mine, lwo_status_string(s), msg.c_str());
  if (msg.find("lwo_ring_stage") == std::string::npos)
    fail("the mismatch message does not name lwo_ring_stage: \"%s\"", msg.c_str());
  lwo_ring_info ri;
  std::memset(&ri, 0, sizeof ri);
  ri.size = sizeof ri;
  LWO_CHECK(lwo_ring_get_info(ring, &ri));
  if (ri.n_free != ri.depth)
    fail("after the refused stage the ring has %u free slots of %u", ri.n_free, ri.depth);
  // The layer this rank was refused, then the other one: both stage normally.
  round_trip(c, ring, 1, "after the mismatched stage (layer 1)");
  round_trip(c, ring, 2, "after the mismatched stage (layer 2)");
}

void ring_phase(Ctx& c) {
  bool first_ring = true;
  for (uint32_t depth : {2u, 3u}) {
    lwo_ring_config rc;
    lwo_ring_config_init(&rc);
    rc.depth = depth;
    lwo_ring* ring = nullptr;
    LWO_CHECK(lwo_ring_create(c.pool, &rc, &ring));
    if (first_ring && c.mismatch == "stage") {
      stage_mismatch(c, ring);
      LWO_CHECK(lwo_ring_reset_stats(ring));
    }
    first_ring = false;
    uint64_t sure_hits = 0;
    const std::vector<uint32_t> order = stage_order(c.seed, 4 * kNumLayers, depth, &sure_hits);
    SlotCopies copies(order.size(), c.max_record);
    std::deque<std::pair<size_t, lwo_ticket>> ahead;
    size_t next = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      // Keep `depth` layers staged ahead of the one being read.
      while (next < order.size() && next < i + depth) {
        lwo_ticket t{0};
        lwo_status_t s = lwo_ring_stage(ring, order[next], &t);
        if (s != LWO_OK)
          die("lwo_ring_stage(layer %u) at step %zu of the depth-%u ring returned %s: %s",
              order[next], next, depth, lwo_status_string(s), lwo_last_error_message());
        ahead.emplace_back(next, t);
        ++next;
      }
      const std::pair<size_t, lwo_ticket> front = ahead.front();
      ahead.pop_front();
      const uint32_t layer = order[front.first];
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      LWO_CHECK(lwo_ring_acquire(ring, front.second, c.stream, &v));
      std::string what = "depth " + std::to_string(depth) + " step " + std::to_string(i) +
                         " layer " + std::to_string(layer);
      check_view(c, v, layer, what.c_str());
      copies.add(c, v, what);
      LWO_CHECK(lwo_ring_release(ring, front.second, c.stream));
    }
    copies.verify(c);
    lwo_ring_stats st;
    std::memset(&st, 0, sizeof st);
    st.size = sizeof st;
    LWO_CHECK(lwo_ring_get_stats(ring, &st));
    std::printf("RING depth %u: %llu stages, %llu hits (at least %llu expected), %llu bytes copied\n",
                depth, (unsigned long long)st.n_stages, (unsigned long long)st.n_hits,
                (unsigned long long)sure_hits, (unsigned long long)st.bytes_copied);
    if (st.n_stages != order.size() || st.n_hits < sure_hits)
      fail("depth-%u ring: %llu stages and %llu hits; want %zu stages and at least %llu hits (a "
           "layer staged again right after its release is still in its slot)", depth,
           (unsigned long long)st.n_stages, (unsigned long long)st.n_hits, order.size(),
           (unsigned long long)sure_hits);
    LWO_CHECK(lwo_ring_destroy(ring));
  }
}

void grads_phase(Ctx& c) {
  lwo_ring_config rc;
  lwo_ring_config_init(&rc);
  rc.depth = 2;
  lwo_ring* ring = nullptr;
  LWO_CHECK(lwo_ring_create(c.pool, &rc, &ring));
  lwo_grads* grads = nullptr;
  LWO_CHECK(lwo_grads_create(c.pool, nullptr, nullptr, &grads));

  if (c.ranks > 1) {
    // The one gradient accessor gives this rank's part only: the elements of
    // the weight shard, as lwo_pool_shard_tensor gives them.
    float* data = nullptr;
    uint64_t first = ~0ull, n = ~0ull;
    lwo_status_t s = lwo_grads_shard(grads, 0, "weight", &data, &first, &n);
    const Range& pr = c.pool_ranges[0][0];
    if (s != LWO_OK)
      fail("lwo_grads_shard on sharded gradients returned %s, want LWO_OK: %s",
           lwo_status_string(s), lwo_last_error_message());
    else if (n != pr.n || (n && first != pr.first))
      fail("lwo_grads_shard(layer 0, weight) on sharded gradients: elements [%llu, +%llu), want "
           "this rank's part [%llu, +%llu) of the %llu", (unsigned long long)first,
           (unsigned long long)n, (unsigned long long)pr.first, (unsigned long long)pr.n,
           (unsigned long long)c.model[0].t[0].numel);
  }

  // This rank's inputs, on the device.
  const int64_t T = tokens_of(c.rank);
  std::vector<std::vector<DevBuf>> x(kMicroBatches), dy(kMicroBatches);
  int64_t max_in = 1;
  for (int m = 0; m < kMicroBatches; ++m)
    for (uint32_t l = 0; l < kNumLayers; ++l) {
      Inputs in = make_inputs(c.seed, c.rank, l, m, c.model[l].shape);
      x[m].emplace_back();
      x[m].back().upload(in.x);
      dy[m].emplace_back();
      dy[m].back().upload(in.dy);
      max_in = std::max(max_in, c.model[l].shape.in);
    }
  DevBuf dx;  // scratch: dx is computed (from the slot's weight) but not checked
  dx.alloc(static_cast<size_t>(T * max_in) * 2);

  // Backward, last layer first, twice (two micro-batches, summed).
  for (int m = 0; m < kMicroBatches; ++m) {
    for (uint32_t l = kNumLayers; l-- > 0;) {
      const HostLayer& h = c.model[l];
      lwo_linear_desc d = linear_of(h.shape);
      lwo_ticket t{0};
      LWO_CHECK(lwo_ring_stage(ring, l, &t));
      lwo_layer_view v = LWO_LAYER_VIEW_INIT;
      LWO_CHECK(lwo_ring_acquire(ring, t, c.stream, &v));
      check_view(c, v, l, "backward");
      lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
      LWO_CHECK(lwo_grads_begin(grads, l, c.stream, &gv));
      REQUIRE(gv.n_tensors == 2 && gv.tensors[0] && gv.tensors[1],
              "lwo_grads_begin(layer %u): %u tensors", l, gv.n_tensors);
      LWO_CHECK(lwo_linear_backward(c.engine, &d, T, x[m][l].p, dy[m][l].p, v.tensors[0], dx.p,
                                    gv.tensors[0], gv.tensors[1], LWO_DTYPE_F32, c.stream));
      LWO_CHECK(lwo_grads_end(grads, l, c.stream));
      LWO_CHECK(lwo_ring_release(ring, t, c.stream));
    }
  }
  LWO_CHECK(lwo_grads_wait(grads));
  CUDA_CHECK(cudaStreamSynchronize(c.stream));

  // The reference: every rank's gradients, recomputed here from the seeds.
  for (uint32_t l = 0; l < kNumLayers; ++l) {
    const HostLayer& h = c.model[l];
    const LayerShape& s = h.shape;
    lwo_linear_desc d = linear_of(s);
    std::vector<double> ref[2] = {std::vector<double>(h.t[0].numel, 0.0),
                                  std::vector<double>(h.t[1].numel, 0.0)};
    DevBuf dw, db;
    dw.alloc(h.t[0].numel * 4);
    db.alloc(h.t[1].numel * 4);
    std::vector<float> gw(h.t[0].numel), gb(h.t[1].numel);
    for (int m = 0; m < kMicroBatches; ++m)
      for (int q = 0; q < c.ranks; ++q) {
        Inputs in = make_inputs(c.seed, q, l, m, s);
        DevBuf xq, dyq;
        xq.upload(in.x);
        dyq.upload(in.dy);
        LWO_CHECK(lwo_linear_backward(c.engine, &d, tokens_of(q), xq.p, dyq.p, nullptr, nullptr,
                                      dw.p, db.p, LWO_DTYPE_F32, c.stream));
        CUDA_CHECK(cudaMemcpyAsync(gw.data(), dw.p, gw.size() * 4, cudaMemcpyDeviceToHost, c.stream));
        CUDA_CHECK(cudaMemcpyAsync(gb.data(), db.p, gb.size() * 4, cudaMemcpyDeviceToHost, c.stream));
        CUDA_CHECK(cudaStreamSynchronize(c.stream));
        for (size_t i = 0; i < gw.size(); ++i) ref[0][i] += gw[i];
        for (size_t i = 0; i < gb.size(); ++i) ref[1][i] += gb[i];
      }
    for (int k = 0; k < 2; ++k) {
      const HostTensor& t = h.t[k];
      double max_abs = 0;
      for (double r : ref[k]) max_abs = std::max(max_abs, std::fabs(r));
      float* data = nullptr;
      uint64_t first = ~0ull, n = ~0ull;
      LWO_CHECK(lwo_grads_shard(grads, l, t.name, &data, &first, &n));
      const Range& pr = c.pool_ranges[l][k];
      if (n != pr.n || (n && first != pr.first))
        fail("lwo_grads_shard(layer %u, %s): elements [%llu, +%llu), but lwo_pool_shard_tensor "
             "gives [%llu, +%llu)", l, t.name, (unsigned long long)first, (unsigned long long)n,
             (unsigned long long)pr.first, (unsigned long long)pr.n);
      if (n == 0) first = 0;
      std::printf("GRADRANGE %u %s %llu %llu %llu\n", l, t.name, (unsigned long long)first,
                  (unsigned long long)n, (unsigned long long)t.numel);
      if (first > t.numel || n > t.numel - first) {
        fail("lwo_grads_shard(layer %u, %s): [%llu, +%llu) lies outside the %llu elements", l,
             t.name, (unsigned long long)first, (unsigned long long)n, (unsigned long long)t.numel);
        continue;
      }
      if (n && !data) {
        fail("lwo_grads_shard(layer %u, %s): %llu elements at NULL", l, t.name, (unsigned long long)n);
        continue;
      }
      uint64_t bad = 0;
      double worst = 0;  // the largest error, in tolerances
      for (uint64_t i = 0; i < n; ++i) {
        const double want = ref[k][first + i], got = data[i];
        const double tol = 1e-5 * std::fabs(want) + 1e-6 * max_abs;
        worst = std::max(worst, std::fabs(got - want) / tol);
        if (!(std::fabs(got - want) <= tol)) {
          if (bad < 5)
            fail("gradient of layer %u %s element %llu: %.9g, want %.9g (sum of %d ranks x %d "
                 "micro-batches; tolerance %.3g)", l, t.name, (unsigned long long)(first + i),
                 got, want, c.ranks, kMicroBatches, tol);
          ++bad;
        }
      }
      if (bad)
        fail("gradient of layer %u %s: %llu of %llu elements differ", l, t.name,
             (unsigned long long)bad, (unsigned long long)n);
      std::printf("GRADCHECK layer %u %s: %llu elements, largest error %.3g of the tolerance\n", l,
                  t.name, (unsigned long long)n, worst);
    }
  }
  std::fflush(stdout);

  lwo_grads_stats gs;
  std::memset(&gs, 0, sizeof gs);
  gs.size = sizeof gs;
  LWO_CHECK(lwo_grads_get_stats(grads, &gs));
  std::printf("GRADS %llu transfers, %llu bytes to host, %llu accumulated\n",
              (unsigned long long)gs.n_transfers, (unsigned long long)gs.bytes,
              (unsigned long long)gs.n_accumulated);
  LWO_CHECK(lwo_grads_destroy(grads));
  LWO_CHECK(lwo_ring_destroy(ring));
}

bool parse_hex_id(const std::string& hex, lwo_nccl_unique_id* id) {
  if (hex.size() != 2 * sizeof id->internal) return false;
  for (size_t i = 0; i < sizeof id->internal; ++i) {
    unsigned v = 0;
    for (int k = 0; k < 2; ++k) {
      char ch = hex[2 * i + k];
      unsigned d;
      if (ch >= '0' && ch <= '9') d = ch - '0';
      else if (ch >= 'a' && ch <= 'f') d = ch - 'a' + 10;
      else if (ch >= 'A' && ch <= 'F') d = ch - 'A' + 10;
      else return false;
      v = v * 16 + d;
    }
    id->internal[i] = static_cast<char>(v);
  }
  return true;
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "lwo_shard_rank: %s\nusage: lwo_shard_rank --rank R --ranks N --id HEX --seed S "
               "[--check] [--mismatch pool|stage]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  Ctx c;
  c.rank = -1;
  std::string id_hex;
  bool have_seed = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--rank") c.rank = std::atoi(value().c_str());
    else if (a == "--ranks") c.ranks = std::atoi(value().c_str());
    else if (a == "--id") id_hex = value();
    else if (a == "--seed") {
      c.seed = std::strtoull(value().c_str(), nullptr, 0);
      have_seed = true;
    } else if (a == "--check") c.check = true;
    else if (a == "--mismatch") c.mismatch = value();
    else usage(("unknown argument " + a).c_str());
  }
  if (c.ranks < 1 || c.rank < 0 || c.rank >= c.ranks) usage("bad --rank / --ranks");
  if (!have_seed) usage("missing --seed");
  if (c.mismatch != "" && c.mismatch != "pool" && c.mismatch != "stage") usage("bad --mismatch");
  if (c.mismatch == "stage" && (!c.check || c.ranks < 2)) usage("--mismatch stage needs --check and 2 ranks");
  lwo_nccl_unique_id id;
  if (!parse_hex_id(id_hex, &id)) usage("--id must be 256 hex digits");
  g_rank = c.rank;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  int n_dev = 0;
  CUDA_CHECK(cudaGetDeviceCount(&n_dev));
  REQUIRE(n_dev > c.rank, "needs CUDA device %d, found %d devices", c.rank, n_dev);
  CUDA_CHECK(cudaSetDevice(c.rank));
  CUDA_CHECK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));

  lwo_engine_config ec;
  lwo_engine_config_init(&ec);
  ec.device = c.rank;
  ec.flags = c.check ? LWO_ENGINE_CHECK_COLLECTIVES : 0u;
  LWO_CHECK(lwo_engine_create(&ec, &c.engine));
  int32_t dev = -1;
  LWO_CHECK(lwo_engine_device(c.engine, &dev));
  REQUIRE(dev == c.rank, "lwo_engine_device: %d, want %d", dev, c.rank);
  lwo_nccl_comm_t comm = nullptr;
  LWO_CHECK(lwo_nccl_comm_create(c.engine, &id, c.ranks, c.rank, &comm));
  int cur = -1;
  CUDA_CHECK(cudaGetDevice(&cur));
  REQUIRE(cur == c.rank, "the current device is %d after lwo_nccl_comm_create, want %d", cur, c.rank);

  c.model = make_model(c.seed, c.mismatch == "pool" && c.rank == 1);
  for (const HostLayer& h : c.model) c.max_record = std::max(c.max_record, h.record_bytes);
  std::vector<lwo_layer_desc> descs;
  for (HostLayer& h : c.model) descs.push_back(lwo_layer_desc{h.desc, 2, nullptr});

  lwo_status_t s = lwo_pool_create_sharded(c.engine, descs.data(), kNumLayers, comm, nullptr, &c.pool);
  if (c.mismatch == "pool") {
    std::string msg = lwo_last_error_message();
    std::printf("POOL_MISMATCH %s: %s\n", lwo_status_string(s), msg.c_str());
    if (s == LWO_OK) {
      (void)lwo_pool_destroy(c.pool);
      die("lwo_pool_create_sharded returned LWO_OK although rank 1 describes layer %u differently",
          kMismatchLayer);
    }
    if (s != LWO_ERR_COLLECTIVE_MISMATCH)
      die("lwo_pool_create_sharded returned %s, want LWO_ERR_COLLECTIVE_MISMATCH: %s",
          lwo_status_string(s), msg.c_str());
    if (msg.find("lwo_pool_create_sharded") == std::string::npos)
      fail("the mismatch message does not name lwo_pool_create_sharded: \"%s\"", msg.c_str());
  } else {
    if (s != LWO_OK)
      die("lwo_pool_create_sharded returned %s: %s", lwo_status_string(s), lwo_last_error_message());
    for (uint32_t l = 0; l < kNumLayers; ++l)
      for (const HostTensor& t : c.model[l].t)
        LWO_CHECK(lwo_pool_write(c.pool, l, t.name, t.bytes.data(), t.bytes.size()));
    check_pool_shards(c);
    ring_phase(c);
    grads_phase(c);
    LWO_CHECK(lwo_engine_check(c.engine));
    LWO_CHECK(lwo_pool_destroy(c.pool));
    c.pool = nullptr;
  }
  LWO_CHECK(lwo_nccl_comm_destroy(comm));
  LWO_CHECK(lwo_engine_destroy(c.engine));
  CUDA_CHECK(cudaStreamDestroy(c.stream));
  if (g_failures) {
    std::fprintf(stderr, "rank %d: %d checks failed\n", c.rank, g_failures);
    return 1;
  }
  std::printf("DONE rank %d\n", c.rank);
  return 0;
}
