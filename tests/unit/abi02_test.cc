// The calls and rules that are new in ABI 0.2 (lwo.h), on the recording
// backend: size-first output structs, larger configs from newer callers,
// extension chains, status classes, pool kinds, whole/shard access on every
// pool, lwo_pool_write_range, ticket queries, lwo_ring_release_all,
// lwo_grads_query, the checkpoint calls (destroy, files, metadata,
// map_tensors), messages that name the C call, and outputs of failed calls.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>

#include "checkpoint_files.h"
#include "test_util.h"

namespace lwo {
namespace testing {
namespace {

constexpr uint8_t kSentinel = 0xCD;

std::string msg() { return lwo_last_error_message(); }
bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
// True if every byte of [from, to) of `p` is the sentinel.
bool untouched(const void* p, size_t from, size_t to) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (size_t i = from; i < to; ++i)
    if (b[i] != kSentinel) return false;
  return true;
}
template <class T>
T* bogus() {  // a non-NULL pointer an output must not keep
  return reinterpret_cast<T*>(uintptr_t{0x1234});
}

// A layer of an f32 "w" [4, 8] and a 0-element f32 "empty" [0, 3].
struct WithEmpty {
  lwo_tensor_desc t[2];
  lwo_layer_desc layer;
  WithEmpty() {
    t[0] = tensor("w", LWO_DTYPE_F32, {4, 8});
    t[1] = tensor("empty", LWO_DTYPE_F32, {0, 3});
    layer = lwo_layer_desc{t, 2, nullptr};
  }
};

// Memory for registered pools, page-aligned.
struct Aligned {
  explicit Aligned(size_t bytes)
      : p(static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096))) {}
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  uint8_t* p;
};

// A registered pool of ModelDesc layers laid out exactly as their records, in
// one region: every layer moves in one copy and has a host address.
struct RegisteredModel {
  ModelDesc m;
  std::vector<uint64_t> base, rec;
  std::unique_ptr<Aligned> mem;
  uint64_t total = 0;
  explicit RegisteredModel(uint32_t n) : m(n), base(n), rec(n) {
    std::vector<std::vector<uint64_t>> offs(n);
    for (uint32_t i = 0; i < n; ++i) {
      offs[i].resize(m.layers[i].n_tensors);
      EXPECT_EQ(lwo_record_layout(&m.layers[i], offs[i].data(), &rec[i]), LWO_OK);
      base[i] = total;
      total += rec[i];
    }
    mem = std::make_unique<Aligned>(total);
    fill_random(mem->p, total, 77);
    for (uint32_t i = 0; i < n; ++i)
      for (uint32_t k = 0; k < m.layers[i].n_tensors; ++k)
        m.tensors[i][k].host_data = mem->p + base[i] + offs[i][k];
  }
  lwo_host_region region() const { return lwo_host_region{mem->p, total, nullptr}; }
};

class Abi02Test : public EngineTest {
 protected:
  lwo_pool_info pool_info(lwo_pool* pool) {
    lwo_pool_info pi = LWO_POOL_INFO_INIT;
    EXPECT_EQ(lwo_pool_get_info(pool, &pi), LWO_OK) << msg();
    return pi;
  }
  lwo_ring_stats ring_stats(lwo_ring* ring) {
    lwo_ring_stats st{};
    st.size = sizeof st;
    EXPECT_EQ(lwo_ring_get_stats(ring, &st), LWO_OK) << msg();
    return st;
  }
  lwo_ticket_state_t state(lwo_ring* ring, lwo_ticket t) {
    lwo_ticket_state_t s = LWO_TICKET_STATE_FORCE_32;
    EXPECT_EQ(lwo_ring_ticket_state(ring, t, &s), LWO_OK) << msg();
    return s;
  }
  uint32_t n_free(lwo_ring* ring) {
    lwo_ring_info info{};
    info.size = sizeof info;
    EXPECT_EQ(lwo_ring_get_info(ring, &info), LWO_OK) << msg();
    return info.n_free;
  }
};

/* ---------------------------------------------------------------------- */
/* Size-first structs the library writes                                  */
/* ---------------------------------------------------------------------- */

using Abi02Structs = Abi02Test;

// Conventions: a written struct's size below sizeof(size_t) is
// LWO_ERR_INVALID_ARGUMENT, for every call that writes an lwo_layer_view.
TEST_F(Abi02Structs, ViewSizeBelowSizeTIsRefused) {
  lwo_pool* pool = make_pool(2);
  lwo_ring* ring = make_ring(pool, 2);
  StreamH c = gpu->new_stream();
  lwo_ticket t{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  uint32_t order[2] = {1, 1};
  lwo_schedule* s = nullptr;
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  for (size_t size : {size_t{0}, size_t{4}, sizeof(size_t) - 1}) {
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    v.size = size;
    EXPECT_EQ(lwo_ring_acquire(ring, t, stream(c), &v), LWO_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(starts_with(msg(), "lwo_ring_acquire: ")) << msg();
    EXPECT_TRUE(contains(msg(), "view size " + std::to_string(size))) << msg();
    EXPECT_EQ(state(ring, t), LWO_TICKET_STAGED);  // not acquired by the failed call

    ASSERT_LWO(lwo_schedule_create(ring, order, 2, &s));
    EXPECT_EQ(lwo_schedule_next(s, stream(c), &v), LWO_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(starts_with(msg(), "lwo_schedule_next: ")) << msg();
    uint32_t pos = 9;
    ASSERT_LWO(lwo_schedule_position(s, &pos));
    EXPECT_EQ(pos, 0u);
    ASSERT_LWO(lwo_schedule_destroy(s));

    EXPECT_EQ(lwo_grads_begin(g, 1, stream(c), &v), LWO_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(starts_with(msg(), "lwo_grads_begin: ")) << msg();
  }
  // Nothing was taken: the same calls succeed with a full view.
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(g, 1, stream(c), &v));
  ASSERT_LWO(lwo_grads_end(g, 1, stream(c)));
  ASSERT_LWO(lwo_grads_wait(g));
  ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
  ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Conventions: the library writes min(size, its sizeof) bytes of a view and
// never more: an older caller's smaller view gets its fields right and the
// bytes past its size untouched; a newer caller's larger one keeps its tail.
TEST_F(Abi02Structs, ViewsAreWrittenOnlyUpToTheirSize) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 3);
  lwo_grads* g = nullptr;
  lwo_grads_config f32 = LWO_GRADS_CONFIG_INIT;
  f32.flags = LWO_GRADS_F32;  // f32 on the wire (the 0.2 default)
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &f32, &g));
  StreamH c = gpu->new_stream();
  const size_t kBig = sizeof(lwo_layer_view) + 32;
  const size_t sizes[] = {offsetof(lwo_layer_view, layer), offsetof(lwo_layer_view, tensor_bytes),
                          offsetof(lwo_layer_view, tensor_dtypes), kBig};
  for (size_t size : sizes) {
    SCOPED_TRACE("view size " + std::to_string(size));
    const size_t written = std::min(size, sizeof(lwo_layer_view));
    alignas(lwo_layer_view) uint8_t buf[sizeof(lwo_layer_view) + 32];
    auto* v = reinterpret_cast<lwo_layer_view*>(buf);
    // Checks one view of layer `layer` with `n` tensors against `size`.
    auto check = [&](uint32_t layer, uint32_t n, uint64_t record_bytes, void* tensor0) {
      EXPECT_EQ(v->size, size);
      EXPECT_TRUE(untouched(buf, written, sizeof buf));
      if (written >= offsetof(lwo_layer_view, n_tensors) + 4) {
        EXPECT_EQ(v->layer, layer);
        EXPECT_EQ(v->n_tensors, n);
      }
      if (written >= offsetof(lwo_layer_view, tensors) + sizeof(void*)) {
        EXPECT_NE(v->base, nullptr);
        EXPECT_EQ(v->record_bytes, record_bytes);
        EXPECT_EQ(v->tensors[0], tensor0);
        EXPECT_EQ(v->tensors[0], v->base);  // the first tensor starts the record
      }
      if (written >= offsetof(lwo_layer_view, tensor_bytes) + sizeof(void*)) {
        EXPECT_NE(v->tensor_bytes, nullptr);
      }
      if (written == sizeof(lwo_layer_view)) {
        ASSERT_NE(v->tensor_dtypes, nullptr);
        EXPECT_EQ(v->tensor_dtypes[0], LWO_DTYPE_BF16);
      }
    };
    uint64_t rb = 0;
    ASSERT_LWO(lwo_pool_record_bytes(pool, 1, &rb));

    // lwo_ring_acquire.
    std::memset(buf, kSentinel, sizeof buf);
    v->size = size;
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(ring, 1, &t));
    ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), v));
    void* w = nullptr;
    ASSERT_LWO(lwo_ring_tensor(ring, t, "weight", &w));
    check(1, 2, rb, w);
    if (written == sizeof(lwo_layer_view)) {
      EXPECT_EQ(v->tensor_bytes[0], 74u * 19 * 2);
      EXPECT_EQ(v->tensor_bytes[1], 74u * 4);
      EXPECT_EQ(v->tensor_dtypes[1], LWO_DTYPE_F32);
    }
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));

    // lwo_schedule_next.
    uint32_t order[1] = {1};
    lwo_schedule* s = nullptr;
    ASSERT_LWO(lwo_schedule_create(ring, order, 1, &s));
    std::memset(buf, kSentinel, sizeof buf);
    v->size = size;
    ASSERT_LWO(lwo_schedule_next(s, stream(c), v));
    check(1, 2, rb, w);  // a hit of the same slot: the same device address
    ASSERT_LWO(lwo_schedule_destroy(s));

    // lwo_grads_begin: the wire view (f32 gradients).
    std::memset(buf, kSentinel, sizeof buf);
    v->size = size;
    ASSERT_LWO(lwo_grads_begin(g, 1, stream(c), v));
    EXPECT_EQ(v->size, size);
    EXPECT_TRUE(untouched(buf, written, sizeof buf));
    if (written >= offsetof(lwo_layer_view, n_tensors) + 4) {
      EXPECT_EQ(v->layer, 1u);
      EXPECT_EQ(v->n_tensors, 2u);
    }
    if (written == sizeof(lwo_layer_view)) {
      EXPECT_EQ(v->tensor_bytes[0], 74u * 19 * 4);  // bf16 weights, f32 on the wire
      EXPECT_EQ(v->tensor_dtypes[0], LWO_DTYPE_F32);
    }
    ASSERT_LWO(lwo_grads_end(g, 1, stream(c)));
  }
  ASSERT_LWO(lwo_grads_wait(g));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Conventions: the size rule for lwo_tensor_info (size-first)
// and lwo_pool_info: too small is refused; a smaller struct gets its fields
// and nothing past them.
TEST_F(Abi02Structs, TensorInfoAndPoolInfoAreWrittenOnlyUpToTheirSize) {
  lwo_pool* pool = make_pool(2);
  for (size_t size : {size_t{0}, size_t{4}}) {
    lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
    ti.size = size;
    EXPECT_EQ(lwo_pool_tensor_info(pool, 1, 0, &ti), LWO_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(starts_with(msg(), "lwo_pool_tensor_info: ")) << msg();
    lwo_pool_info pi = LWO_POOL_INFO_INIT;
    pi.size = size;
    EXPECT_EQ(lwo_pool_get_info(pool, &pi), LWO_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(starts_with(msg(), "lwo_pool_get_info: ")) << msg();
  }
  {
    alignas(lwo_tensor_info) uint8_t buf[sizeof(lwo_tensor_info) + 16];
    std::memset(buf, kSentinel, sizeof buf);
    auto* ti = reinterpret_cast<lwo_tensor_info*>(buf);
    ti->size = offsetof(lwo_tensor_info, offset);
    ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 1, ti));
    EXPECT_EQ(ti->size, offsetof(lwo_tensor_info, offset));
    EXPECT_STREQ(ti->name, "bias");
    EXPECT_EQ(ti->dtype, LWO_DTYPE_F32);
    EXPECT_EQ(ti->n_dims, 1);
    EXPECT_EQ(ti->shape[0], 74);
    EXPECT_EQ(ti->shape[1], 0);
    EXPECT_TRUE(untouched(buf, offsetof(lwo_tensor_info, offset), sizeof buf));
    // A larger one: exactly sizeof(lwo_tensor_info) bytes are written.
    std::memset(buf, kSentinel, sizeof buf);
    ti->size = sizeof buf;
    ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 1, ti));
    EXPECT_EQ(ti->offset, 2816u);
    EXPECT_EQ(ti->bytes, 74u * 4);
    EXPECT_TRUE(untouched(buf, sizeof(lwo_tensor_info), sizeof buf));
  }
  {
    alignas(lwo_pool_info) uint8_t buf[sizeof(lwo_pool_info) + 16];
    std::memset(buf, kSentinel, sizeof buf);
    auto* pi = reinterpret_cast<lwo_pool_info*>(buf);
    pi->size = offsetof(lwo_pool_info, rank);  // a caller without rank / n_ranks
    ASSERT_LWO(lwo_pool_get_info(pool, pi));
    EXPECT_EQ(pi->n_layers, 2u);
    EXPECT_EQ(pi->kind, LWO_POOL_PINNED);
    uint64_t r0 = 0, r1 = 0;
    ASSERT_LWO(lwo_pool_record_bytes(pool, 0, &r0));
    ASSERT_LWO(lwo_pool_record_bytes(pool, 1, &r1));
    EXPECT_EQ(pi->total_bytes, r0 + r1);
    EXPECT_EQ(pi->max_record_bytes, std::max(r0, r1));
    EXPECT_TRUE(untouched(buf, offsetof(lwo_pool_info, rank), sizeof buf));
    pi->size = offsetof(lwo_pool_info, kind);  // only n_layers
    std::memset(buf + sizeof(size_t), kSentinel, sizeof buf - sizeof(size_t));
    ASSERT_LWO(lwo_pool_get_info(pool, pi));
    EXPECT_EQ(pi->n_layers, 2u);
    EXPECT_TRUE(untouched(buf, offsetof(lwo_pool_info, kind), sizeof buf));
  }
  ASSERT_LWO(lwo_pool_destroy(pool));
}

/* ---------------------------------------------------------------------- */
/* Config structs from a newer caller                                     */
/* ---------------------------------------------------------------------- */

using Abi02Configs = Abi02Test;

// A config struct `Cfg` followed by a tail of bytes a newer lwo would know.
template <class Cfg>
struct Larger {
  union {
    Cfg cfg;
    uint8_t bytes[sizeof(Cfg) + 24];
  };
  explicit Larger(const Cfg& c) {
    std::memset(bytes, 0, sizeof bytes);
    cfg = c;
    cfg.size = sizeof bytes;
  }
  // Sets byte `i` past the library's struct; returns its offset.
  size_t poke(size_t i) {
    bytes[sizeof(Cfg) + i] = 1;
    return sizeof(Cfg) + i;
  }
};

// Conventions: a larger lwo_ring_config is accepted when its tail is zero
// and refused (LWO_ERR_INVALID_ARGUMENT, naming the first nonzero byte)
// otherwise; the output ring is NULL then.
TEST_F(Abi02Configs, LargerRingConfig) {
  lwo_pool* pool = make_pool(2);
  lwo_ring_config c = LWO_RING_CONFIG_INIT;
  c.depth = 3;
  Larger<lwo_ring_config> big(c);
  lwo_ring* ring = nullptr;
  ASSERT_LWO(lwo_ring_create(pool, &big.cfg, &ring));
  lwo_ring_info info{};
  info.size = sizeof info;
  ASSERT_LWO(lwo_ring_get_info(ring, &info));
  EXPECT_EQ(info.depth, 3u);  // the known fields were read
  ASSERT_LWO(lwo_ring_destroy(ring));
  // Nonzero bytes at these tail positions; the first one is named.
  const std::vector<std::vector<size_t>> cases = {{0}, {7}, {23, 9}};
  for (const auto& poked : cases) {
    Larger<lwo_ring_config> bad(c);
    size_t at = SIZE_MAX;
    for (size_t i : poked) at = std::min(at, bad.poke(i));
    ring = bogus<lwo_ring>();
    EXPECT_EQ(lwo_ring_create(pool, &bad.cfg, &ring), LWO_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(ring, nullptr);
    EXPECT_TRUE(starts_with(msg(), "lwo_ring_create: ")) << msg();
    EXPECT_TRUE(contains(msg(), "byte " + std::to_string(at) + " ")) << msg();
  }
  c.size = 4;
  EXPECT_EQ(lwo_ring_create(pool, &c, &ring), LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_pool_destroy(pool));  // no ring was left counted
}

// A config's size is bounded before any byte past sizeof is read: a struct at
// the end of a readable page that claims 1 MiB is refused, not read (it
// faulted), and so is LWO_MAX_STRUCT_SIZE + 1; LWO_MAX_STRUCT_SIZE with a
// zero tail is still a newer caller's struct.
TEST_F(Abi02Configs, ConfigSizeIsBoundedBeforeTheTailIsRead) {
  lwo_pool* pool = make_pool(2);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* map = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  ASSERT_EQ(mprotect(static_cast<char*>(map) + page, page, PROT_NONE), 0);
  auto* c = reinterpret_cast<lwo_ring_config*>(static_cast<char*>(map) + page -
                                               sizeof(lwo_ring_config));
  *c = lwo_ring_config LWO_RING_CONFIG_INIT;
  c->depth = 2;
  for (size_t size : {size_t(1) << 20, size_t(LWO_MAX_STRUCT_SIZE) + 1}) {
    c->size = size;
    lwo_ring* ring = bogus<lwo_ring>();
    EXPECT_EQ(lwo_ring_create(pool, c, &ring), LWO_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(ring, nullptr);
    EXPECT_TRUE(contains(msg(), "size " + std::to_string(size) + " is larger than "
                                "LWO_MAX_STRUCT_SIZE (4096")) << msg();
  }
  c->size = sizeof *c;  // the exact size at the page's end still works
  lwo_ring* ring = nullptr;
  ASSERT_LWO(lwo_ring_create(pool, c, &ring));
  ASSERT_LWO(lwo_ring_destroy(ring));
  munmap(map, 2 * page);
  std::vector<uint8_t> buf(LWO_MAX_STRUCT_SIZE, 0);
  auto* max = reinterpret_cast<lwo_ring_config*>(buf.data());
  *max = lwo_ring_config LWO_RING_CONFIG_INIT;
  max->size = LWO_MAX_STRUCT_SIZE;
  ASSERT_LWO(lwo_ring_create(pool, max, &ring));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// The same rule for lwo_pool_config (pinned and registered pools) and
// lwo_grads_config.
TEST_F(Abi02Configs, LargerPoolAndGradsConfigs) {
  ModelDesc m(2);
  lwo_pool_config pc = LWO_POOL_CONFIG_INIT;
  pc.n_threads = 2;
  Larger<lwo_pool_config> big(pc);
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_pinned(engine, m.layers.data(), 2, &big.cfg, &pool));
  size_t at = big.poke(5);
  lwo_pool* p2 = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), 2, &big.cfg, &p2),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(p2, nullptr);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_create_pinned: ")) << msg();
  EXPECT_TRUE(contains(msg(), "byte " + std::to_string(at) + " ")) << msg();

  RegisteredModel rm(2);
  lwo_host_region r = rm.region();
  p2 = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_registered(engine, rm.m.layers.data(), 2, &r, 1, &big.cfg, &p2),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(p2, nullptr);
  EXPECT_TRUE(contains(msg(), "byte " + std::to_string(at) + " ")) << msg();
  EXPECT_EQ(gpu->n_registered(), 1u);  // only the pinned pool's arena
  Larger<lwo_pool_config> zero(pc);
  ASSERT_LWO(lwo_pool_create_registered(engine, rm.m.layers.data(), 2, &r, 1, &zero.cfg, &p2));
  ASSERT_LWO(lwo_pool_destroy(p2));

  lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
  gc.depth = 1;
  Larger<lwo_grads_config> gbig(gc);
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &gbig.cfg, &g));
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(g, 0, stream(c), &v));
  EXPECT_EQ(lwo_grads_begin(g, 1, stream(c), &v), LWO_ERR_RING_FULL);  // depth 1 was read
  ASSERT_LWO(lwo_grads_end(g, 0, stream(c)));
  ASSERT_LWO(lwo_grads_wait(g));
  ASSERT_LWO(lwo_grads_destroy(g));
  at = gbig.poke(0);
  g = bogus<lwo_grads>();
  EXPECT_EQ(lwo_grads_create(pool, nullptr, &gbig.cfg, &g), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(g, nullptr);
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_create: ")) << msg();
  EXPECT_TRUE(contains(msg(), "byte " + std::to_string(at) + " ")) << msg();
  ASSERT_LWO(lwo_pool_destroy(pool));  // no gradient set was left counted
}

/* ---------------------------------------------------------------------- */
/* Extension chains                                                       */
/* ---------------------------------------------------------------------- */

using Abi02Extensions = Abi02Test;

// Conventions: a non-NULL `next` of lwo_tensor_desc, lwo_layer_desc or
// lwo_host_region is LWO_ERR_UNSUPPORTED naming the extension's type; the
// output pool is NULL and nothing stays registered. NULL next is fine.
TEST_F(Abi02Extensions, NonNullNextIsUnsupportedAndNamesTheType) {
  lwo_ext ext{4711, 0u, nullptr};
  ModelDesc m(3);
  lwo_pool* pool = nullptr;
  // A tensor's chain (layer 1, tensor 1).
  m.tensors[1][1].next = &ext;
  pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), 3, nullptr, &pool),
            LWO_ERR_UNSUPPORTED);
  EXPECT_EQ(pool, nullptr);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_create_pinned: ")) << msg();
  EXPECT_TRUE(contains(msg(), "type 4711")) << msg();
  EXPECT_TRUE(contains(msg(), "layer 1")) << msg();
  uint64_t rb = 0;
  EXPECT_EQ(lwo_record_layout(&m.layers[1], nullptr, &rb), LWO_ERR_UNSUPPORTED);
  EXPECT_TRUE(contains(msg(), "type 4711")) << msg();
  m.tensors[1][1].next = nullptr;
  // A layer's chain.
  ext.type = 99;
  m.layers[2].next = &ext;
  EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), 3, nullptr, &pool),
            LWO_ERR_UNSUPPORTED);
  EXPECT_TRUE(contains(msg(), "type 99")) << msg();
  EXPECT_TRUE(contains(msg(), "layer 2")) << msg();
  EXPECT_EQ(lwo_record_layout(&m.layers[2], nullptr, &rb), LWO_ERR_UNSUPPORTED);
  m.layers[2].next = nullptr;
  EXPECT_EQ(gpu->n_registered(), 0u);
  // NULL chains: the same descriptions work.
  ASSERT_LWO(lwo_pool_create_pinned(engine, m.layers.data(), 3, nullptr, &pool));
  ASSERT_LWO(lwo_pool_destroy(pool));

  // A host region's chain (the second of two).
  RegisteredModel rm(2);
  uint64_t half = rm.base[1];
  lwo_host_region regions[2] = {{rm.mem->p, half, nullptr}, {rm.mem->p + half, rm.total - half, &ext}};
  ext.type = -5;
  pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_registered(engine, rm.m.layers.data(), 2, regions, 2, nullptr, &pool),
            LWO_ERR_UNSUPPORTED);
  EXPECT_EQ(pool, nullptr);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_create_registered: ")) << msg();
  EXPECT_TRUE(contains(msg(), "type -5")) << msg();
  EXPECT_TRUE(contains(msg(), "region 1")) << msg();
  EXPECT_EQ(gpu->n_registered(), 0u);
  // And a registered tensor's chain.
  regions[1].next = nullptr;
  rm.m.tensors[0][0].next = &ext;
  EXPECT_EQ(lwo_pool_create_registered(engine, rm.m.layers.data(), 2, regions, 2, nullptr, &pool),
            LWO_ERR_UNSUPPORTED);
  rm.m.tensors[0][0].next = nullptr;
  ASSERT_LWO(lwo_pool_create_registered(engine, rm.m.layers.data(), 2, regions, 2, nullptr, &pool));
  ASSERT_LWO(lwo_pool_destroy(pool));
  EXPECT_EQ(gpu->n_registered(), 0u);
}

/* ---------------------------------------------------------------------- */
/* Status classes                                                         */
/* ---------------------------------------------------------------------- */

// Status: every status's value / 100 is the class of the section lwo.h lists
// it in, the class constants are the documented numbers, and every status
// has a name.
TEST(Abi02Status, EveryStatusLiesInItsClassRange) {
  EXPECT_EQ(LWO_STATUS_CLASS_SUCCESS, 0);
  EXPECT_EQ(LWO_STATUS_CLASS_ARGUMENT, 1);
  EXPECT_EQ(LWO_STATUS_CLASS_STATE, 2);
  EXPECT_EQ(LWO_STATUS_CLASS_RESOURCE, 3);
  EXPECT_EQ(LWO_STATUS_CLASS_DEVICE, 4);
  EXPECT_EQ(LWO_STATUS_CLASS_FORMAT, 5);
  EXPECT_EQ(LWO_STATUS_CLASS_COLLECTIVE, 6);
  EXPECT_EQ(LWO_STATUS_CLASS_INTERNAL, 9);
  const struct {
    lwo_status_t s;
    int cls;
  } table[] = {
      {LWO_OK, LWO_STATUS_CLASS_SUCCESS},
      {LWO_END, LWO_STATUS_CLASS_SUCCESS},
      {LWO_ERR_INVALID_ARGUMENT, LWO_STATUS_CLASS_ARGUMENT},
      {LWO_ERR_INVALID_HANDLE, LWO_STATUS_CLASS_ARGUMENT},
      {LWO_ERR_OUT_OF_RANGE, LWO_STATUS_CLASS_ARGUMENT},
      {LWO_ERR_NOT_FOUND, LWO_STATUS_CLASS_ARGUMENT},
      {LWO_ERR_SIZE_MISMATCH, LWO_STATUS_CLASS_ARGUMENT},
      {LWO_ERR_FOREIGN_TICKET, LWO_STATUS_CLASS_ARGUMENT},
      {LWO_ERR_FOREIGN_OBJECT, LWO_STATUS_CLASS_ARGUMENT},
      {LWO_ERR_UNSUPPORTED, LWO_STATUS_CLASS_ARGUMENT},
      {LWO_ERR_RING_FULL, LWO_STATUS_CLASS_STATE},
      {LWO_ERR_LAYER_BUSY, LWO_STATUS_CLASS_STATE},
      {LWO_ERR_STALE_TICKET, LWO_STATUS_CLASS_STATE},
      {LWO_ERR_TICKET_STATE, LWO_STATUS_CLASS_STATE},
      {LWO_ERR_BUSY, LWO_STATUS_CLASS_STATE},
      {LWO_ERR_FILE_CHANGED, LWO_STATUS_CLASS_STATE},
      {LWO_ERR_OUT_OF_MEMORY, LWO_STATUS_CLASS_RESOURCE},
      {LWO_ERR_IO, LWO_STATUS_CLASS_RESOURCE},
      {LWO_ERR_NO_DEVICE, LWO_STATUS_CLASS_DEVICE},
      {LWO_ERR_CUDA, LWO_STATUS_CLASS_DEVICE},
      {LWO_ERR_CUBLAS, LWO_STATUS_CLASS_DEVICE},
      {LWO_ERR_CUDNN, LWO_STATUS_CLASS_DEVICE},
      {LWO_ERR_NCCL, LWO_STATUS_CLASS_DEVICE},
      {LWO_ERR_TRUNCATED, LWO_STATUS_CLASS_FORMAT},
      {LWO_ERR_BAD_HEADER_SIZE, LWO_STATUS_CLASS_FORMAT},
      {LWO_ERR_BAD_JSON, LWO_STATUS_CLASS_FORMAT},
      {LWO_ERR_BAD_DTYPE, LWO_STATUS_CLASS_FORMAT},
      {LWO_ERR_SHAPE_MISMATCH, LWO_STATUS_CLASS_FORMAT},
      {LWO_ERR_SHAPE_OVERFLOW, LWO_STATUS_CLASS_FORMAT},
      {LWO_ERR_BAD_RANGE, LWO_STATUS_CLASS_FORMAT},
      {LWO_ERR_OVERLAP, LWO_STATUS_CLASS_FORMAT},
      {LWO_ERR_COLLECTIVE_MISMATCH, LWO_STATUS_CLASS_COLLECTIVE},
      {LWO_ERR_INTERNAL, LWO_STATUS_CLASS_INTERNAL},
  };
  std::set<int> values;
  for (const auto& e : table) {
    SCOPED_TRACE(lwo_status_string(e.s));
    EXPECT_EQ(LWO_STATUS_CLASS(e.s), e.cls);
    EXPECT_EQ(static_cast<int>(e.s) / 100, e.cls);
    EXPECT_GE(static_cast<int>(e.s), 0);
    EXPECT_LT(static_cast<int>(e.s), 1000);
    EXPECT_STRNE(lwo_status_string(e.s), "unknown status");
    EXPECT_TRUE(values.insert(static_cast<int>(e.s)).second);  // never two with one value
  }
  // The first of each error class starts its range.
  EXPECT_EQ(LWO_ERR_INVALID_ARGUMENT, 100);
  EXPECT_EQ(LWO_ERR_RING_FULL, 200);
  EXPECT_EQ(LWO_ERR_OUT_OF_MEMORY, 300);
  EXPECT_EQ(LWO_ERR_NO_DEVICE, 400);
  EXPECT_EQ(LWO_ERR_TRUNCATED, 500);
  EXPECT_EQ(LWO_ERR_COLLECTIVE_MISMATCH, 600);
  EXPECT_EQ(LWO_ERR_INTERNAL, 900);
  // Values 0.1 used mean nothing now.
  EXPECT_STREQ(lwo_status_string(static_cast<lwo_status_t>(2)), "unknown status");
  EXPECT_STREQ(lwo_status_string(static_cast<lwo_status_t>(32)), "unknown status");
}

/* ---------------------------------------------------------------------- */
/* Pools: kinds, whole / shard access, write_range                        */
/* ---------------------------------------------------------------------- */

using Abi02Pools = Abi02Test;

// lwo_pool_get_info: kind, rank and n_ranks of pinned, registered and
// sharded pools (checkpoint kinds: Abi02Checkpoints).
TEST_F(Abi02Pools, KindRankAndRanks) {
  lwo_pool* pool = make_pool(2);
  lwo_pool_info pi = pool_info(pool);
  EXPECT_EQ(pi.kind, LWO_POOL_PINNED);
  EXPECT_EQ(pi.rank, 0);
  EXPECT_EQ(pi.n_ranks, 1);
  ASSERT_LWO(lwo_pool_destroy(pool));

  RegisteredModel rm(2);
  lwo_host_region r = rm.region();
  ASSERT_LWO(lwo_pool_create_registered(engine, rm.m.layers.data(), 2, &r, 1, nullptr, &pool));
  pi = pool_info(pool);
  EXPECT_EQ(pi.kind, LWO_POOL_REGISTERED);
  EXPECT_EQ(pi.rank, 0);
  EXPECT_EQ(pi.n_ranks, 1);
  ASSERT_LWO(lwo_pool_destroy(pool));

  ModelDesc m(2);
  int fake_comm = 0;
  gpu->fake_ranks = 3;
  gpu->fake_rank = 2;
  ASSERT_LWO(lwo_pool_create_sharded(engine, m.layers.data(), 2,
                                     reinterpret_cast<lwo_nccl_comm_t>(&fake_comm), nullptr, &pool));
  pi = pool_info(pool);
  EXPECT_EQ(pi.kind, LWO_POOL_SHARDED);
  EXPECT_EQ(pi.rank, 2);
  EXPECT_EQ(pi.n_ranks, 3);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// "Whole" and "shard" access: on a pinned pool the shard is the whole record
// (offset 0, lwo_pool_layer_host's address and bytes) and a tensor's shard
// the whole tensor (first 0, every element, lwo_pool_tensor_host's address);
// a 0-element tensor's is n 0 and NULL.
TEST_F(Abi02Pools, ShardAccessOnPinnedPoolIsTheWholeRecord) {
  lwo_pool* pool = make_pool(3);
  for (uint32_t l = 0; l < 3; ++l) {
    void* whole = nullptr;
    uint64_t wb = 0;
    ASSERT_LWO(lwo_pool_layer_host(pool, l, &whole, &wb));
    void* shard = nullptr;
    uint64_t off = 99, sb = 0;
    ASSERT_LWO(lwo_pool_shard_host(pool, l, &shard, &off, &sb));
    EXPECT_EQ(shard, whole);
    EXPECT_EQ(off, 0u);
    EXPECT_EQ(sb, wb);
    uint32_t n = 0;
    ASSERT_LWO(lwo_pool_layer_tensor_count(pool, l, &n));
    for (uint32_t k = 0; k < n; ++k) {
      lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
      ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
      void* th = nullptr;
      ASSERT_LWO(lwo_pool_tensor_host(pool, l, ti.name, &th, nullptr));
      void* d = nullptr;
      uint64_t first = 99, ne = 0;
      ASSERT_LWO(lwo_pool_shard_tensor(pool, l, ti.name, &d, &first, &ne));
      EXPECT_EQ(d, th);
      EXPECT_EQ(first, 0u);
      EXPECT_EQ(ne, ti.bytes / lwo_dtype_size(ti.dtype));
    }
  }
  ASSERT_LWO(lwo_pool_destroy(pool));

  WithEmpty we;
  ASSERT_LWO(lwo_pool_create_pinned(engine, &we.layer, 1, nullptr, &pool));
  void* d = bogus<void>();
  uint64_t first = 99, ne = 99;
  ASSERT_LWO(lwo_pool_shard_tensor(pool, 0, "empty", &d, &first, &ne));
  EXPECT_EQ(d, nullptr);
  EXPECT_EQ(first, 0u);
  EXPECT_EQ(ne, 0u);
  ASSERT_LWO(lwo_pool_shard_tensor(pool, 0, "w", &d, &first, &ne));
  EXPECT_NE(d, nullptr);
  EXPECT_EQ(ne, 32u);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// The same on registered pools: the shard of a contiguous layer is
// lwo_pool_layer_host's, a scattered layer's shard has its
// LWO_ERR_UNSUPPORTED, and a tensor's shard is the caller's memory.
TEST_F(Abi02Pools, ShardAccessOnRegisteredPools) {
  RegisteredModel rm(3);
  lwo_host_region r = rm.region();
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_registered(engine, rm.m.layers.data(), 3, &r, 1, nullptr, &pool));
  for (uint32_t l = 0; l < 3; ++l) {
    void* whole = nullptr;
    uint64_t wb = 0;
    ASSERT_LWO(lwo_pool_layer_host(pool, l, &whole, &wb));
    void* shard = nullptr;
    uint64_t off = 99, sb = 0;
    ASSERT_LWO(lwo_pool_shard_host(pool, l, &shard, &off, &sb));
    EXPECT_EQ(shard, whole);
    EXPECT_EQ(shard, rm.mem->p + rm.base[l]);
    EXPECT_EQ(off, 0u);
    EXPECT_EQ(sb, wb);
    for (uint32_t k = 0; k < rm.m.layers[l].n_tensors; ++k) {
      const lwo_tensor_desc& t = rm.m.tensors[l][k];
      void* d = nullptr;
      uint64_t first = 99, ne = 0;
      ASSERT_LWO(lwo_pool_shard_tensor(pool, l, t.name, &d, &first, &ne));
      EXPECT_EQ(d, t.host_data);
      EXPECT_EQ(first, 0u);
      uint64_t want = 1;
      for (int i = 0; i < t.n_dims; ++i) want *= static_cast<uint64_t>(t.shape[i]);
      EXPECT_EQ(ne, want);
    }
  }
  ASSERT_LWO(lwo_pool_destroy(pool));

  // Scattered: "w" in its own buffer, "empty" with no host data at all.
  WithEmpty we;
  Aligned buf(4096);
  we.t[0].host_data = buf.p + 512;  // not where the record would put it
  lwo_host_region r2{buf.p, 4096, nullptr};
  ASSERT_LWO(lwo_pool_create_registered(engine, &we.layer, 1, &r2, 1, nullptr, &pool));
  void* d = bogus<void>();
  uint64_t first = 99, ne = 99;
  ASSERT_LWO(lwo_pool_shard_tensor(pool, 0, "empty", &d, &first, &ne));
  EXPECT_EQ(d, nullptr);
  EXPECT_EQ(first, 0u);
  EXPECT_EQ(ne, 0u);
  ASSERT_LWO(lwo_pool_shard_tensor(pool, 0, "w", &d, &first, &ne));
  EXPECT_EQ(d, buf.p + 512);
  EXPECT_EQ(ne, 32u);
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// lwo_grads_shard on a pool that is not sharded: the whole tensor, first
// element 0, at the same address every time; n 0 and NULL for a tensor of
// 0 elements.
TEST_F(Abi02Pools, GradsShardOnUnshardedPoolIsTheWholeTensor) {
  lwo_pool* pool = make_pool(2);
  lwo_grads* g = nullptr;
  lwo_grads_config f32 = LWO_GRADS_CONFIG_INIT;
  f32.flags = LWO_GRADS_F32;  // f32 host buffers, which lwo_grads_shard reads
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &f32, &g));
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(g, 1, stream(c), &v));
  for (uint32_t k = 0; k < v.n_tensors; ++k) {
    gpu->write(c, v.tensors[k], v.tensor_bytes[k]);
    float* f = static_cast<float*>(v.tensors[k]);
    for (uint64_t i = 0; i < v.tensor_bytes[k] / 4; ++i) f[i] = static_cast<float>(k * 1000 + i);
  }
  ASSERT_LWO(lwo_grads_end(g, 1, stream(c)));
  ASSERT_LWO(lwo_grads_wait(g));
  for (const char* name : {"weight", "bias"}) {
    float* d = nullptr;
    uint64_t first = 99, ne = 0;
    ASSERT_LWO(lwo_grads_shard(g, 1, name, &d, &first, &ne));
    EXPECT_EQ(first, 0u);
    EXPECT_EQ(ne, std::string(name) == "weight" ? 74u * 19 : 74u);
    ASSERT_NE(d, nullptr);
    uint32_t k = std::string(name) == "weight" ? 0 : 1;
    for (uint64_t i = 0; i < ne; ++i) ASSERT_EQ(d[i], static_cast<float>(k * 1000 + i)) << name;
    float* again = nullptr;
    ASSERT_LWO(lwo_grads_shard(g, 1, name, &again, nullptr, nullptr));  // counts may be NULL
    EXPECT_EQ(again, d);
  }
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));

  WithEmpty we;
  ASSERT_LWO(lwo_pool_create_pinned(engine, &we.layer, 1, nullptr, &pool));
  ASSERT_LWO(lwo_grads_create(pool, nullptr, &f32, &g));
  float* d = reinterpret_cast<float*>(uintptr_t{0x1234});
  uint64_t first = 99, ne = 99;
  ASSERT_LWO(lwo_grads_shard(g, 0, "empty", &d, &first, &ne));
  EXPECT_EQ(first, 0u);
  EXPECT_EQ(ne, 0u);
  EXPECT_EQ(d, nullptr) << "lwo.h: *n_elements may be 0 (then *data is NULL)";
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// lwo_pool_write_range writes exactly bytes [offset, offset + bytes) of the
// tensor and marks the layer changed: a released slot holding it is no
// longer a hit.
TEST_F(Abi02Pools, WriteRangeWritesExactlyTheRangeAndMarksTheLayerChanged) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 3);
  StreamH c = gpu->new_stream();
  auto use = [&](uint32_t l) {
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_ring_stage(ring, l, &t));
    ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
    EXPECT_TRUE(holds_layer(pool, v)) << "layer " << l;
    gpu->read(c, v.base, v.record_bytes);
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  };
  use(0);
  use(1);
  use(1);
  lwo_ring_stats st = ring_stats(ring);
  EXPECT_EQ(st.n_hits, 1u);
  EXPECT_EQ(st.n_copies, 2u);

  void* rec = nullptr;
  uint64_t rb = 0;
  ASSERT_LWO(lwo_pool_layer_host(pool, 1, &rec, &rb));
  std::vector<uint8_t> before(static_cast<uint8_t*>(rec), static_cast<uint8_t*>(rec) + rb);
  lwo_tensor_info wi = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 0, &wi));  // "weight", 2812 bytes at 0
  std::vector<uint8_t> src(13);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(before[101 + i] ^ 0xFF);
  ASSERT_LWO(lwo_pool_write_range(pool, 1, "weight", 101, src.data(), src.size()));
  const uint8_t* now = static_cast<const uint8_t*>(rec);
  for (uint64_t i = 0; i < rb; ++i) {
    uint8_t want = (i >= wi.offset + 101 && i < wi.offset + 101 + src.size())
                       ? src[i - wi.offset - 101]
                       : before[i];
    ASSERT_EQ(now[i], want) << "record byte " << i;
  }
  use(1);  // copied again, with the new bytes
  st = ring_stats(ring);
  EXPECT_EQ(st.n_hits, 1u);
  EXPECT_EQ(st.n_copies, 3u);
  use(1);  // unchanged since: a hit
  EXPECT_EQ(ring_stats(ring).n_hits, 2u);
  use(0);  // another layer was not marked
  EXPECT_EQ(ring_stats(ring).n_hits, 3u);

  // The last bytes of the last tensor, up to its end.
  lwo_tensor_info bi = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 1, &bi));
  uint32_t tail = 0xA1B2C3D4;
  ASSERT_LWO(lwo_pool_write_range(pool, 1, "bias", bi.bytes - 4, &tail, 4));
  EXPECT_EQ(std::memcmp(now + bi.offset + bi.bytes - 4, &tail, 4), 0);
  EXPECT_EQ(now[bi.offset + bi.bytes - 5], before[bi.offset + bi.bytes - 5]);
  use(1);
  EXPECT_EQ(ring_stats(ring).n_copies, 4u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// lwo_pool_write_range: LWO_ERR_OUT_OF_RANGE past the tensor's end (also
// where offset + bytes would overflow), an empty range at the end is fine,
// LWO_ERR_UNSUPPORTED on registered pools; messages name the call.
TEST_F(Abi02Pools, WriteRangeRefusesRangesPastTheEndAndRegisteredPools) {
  lwo_pool* pool = make_pool(2);
  const uint64_t kW = 74u * 19 * 2;  // layer 1 "weight"
  std::vector<uint8_t> src(64, 7);
  struct {
    uint64_t offset, bytes;
  } bad[] = {{kW - 4, 8}, {kW + 1, 0}, {kW, 1}, {UINT64_MAX - 1, 4}, {8, UINT64_MAX - 4},
             {UINT64_MAX, UINT64_MAX}};
  for (const auto& b : bad) {
    EXPECT_EQ(lwo_pool_write_range(pool, 1, "weight", b.offset, src.data(), b.bytes),
              LWO_ERR_OUT_OF_RANGE)
        << b.offset << " + " << b.bytes;
    EXPECT_TRUE(starts_with(msg(), "lwo_pool_write_range: ")) << msg();
  }
  void* rec = nullptr;
  ASSERT_LWO(lwo_pool_layer_host(pool, 1, &rec, nullptr));
  ASSERT_LWO(lwo_pool_write_range(pool, 1, "weight", kW, src.data(), 0));
  ASSERT_LWO(lwo_pool_write_range(pool, 1, "weight", kW - 1, src.data(), 1));
  EXPECT_EQ(static_cast<uint8_t*>(rec)[kW - 1], 7);
  EXPECT_EQ(lwo_pool_write_range(pool, 1, "nope", 0, src.data(), 1), LWO_ERR_NOT_FOUND);
  EXPECT_EQ(lwo_pool_write_range(pool, 2, "weight", 0, src.data(), 1), LWO_ERR_OUT_OF_RANGE);
  EXPECT_EQ(lwo_pool_write_range(pool, 1, "weight", 0, nullptr, 4), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_pool_write_range(nullptr, 1, "weight", 0, src.data(), 4), LWO_ERR_INVALID_HANDLE);
  ASSERT_LWO(lwo_pool_destroy(pool));

  // A tensor of 0 elements takes 0-byte writes.
  WithEmpty we;
  ASSERT_LWO(lwo_pool_create_pinned(engine, &we.layer, 1, nullptr, &pool));
  ASSERT_LWO(lwo_pool_write_range(pool, 0, "empty", 0, nullptr, 0));
  EXPECT_EQ(lwo_pool_write_range(pool, 0, "empty", 0, src.data(), 1), LWO_ERR_OUT_OF_RANGE);
  ASSERT_LWO(lwo_pool_destroy(pool));

  RegisteredModel rm(2);
  lwo_host_region r = rm.region();
  ASSERT_LWO(lwo_pool_create_registered(engine, rm.m.layers.data(), 2, &r, 1, nullptr, &pool));
  std::vector<uint8_t> keep(rm.mem->p, rm.mem->p + rm.total);
  EXPECT_EQ(lwo_pool_write_range(pool, 1, "weight", 0, src.data(), 8), LWO_ERR_UNSUPPORTED);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_write_range: ")) << msg();
  EXPECT_EQ(std::memcmp(keep.data(), rm.mem->p, rm.total), 0);  // the caller's memory as it was
  ASSERT_LWO(lwo_pool_destroy(pool));
}

/* ---------------------------------------------------------------------- */
/* Rings: ticket queries and release_all                                  */
/* ---------------------------------------------------------------------- */

using Abi02Rings = Abi02Test;

// lwo_ring_ticket_state follows a ticket: STAGED, ACQUIRED, then ENDED once
// released or once its slot is reused (also by a hit); ticket 0 and another
// ring's tickets are LWO_ERR_FOREIGN_TICKET. lwo_ring_query: landed for live
// tickets (the recording backend reports every event done, so always 1),
// LWO_ERR_STALE_TICKET once ended.
TEST_F(Abi02Rings, TicketStateAndQuery) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 1);
  lwo_ring* other = make_ring(pool, 1);
  StreamH c = gpu->new_stream();
  lwo_ticket t0{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t0));
  EXPECT_EQ(state(ring, t0), LWO_TICKET_STAGED);
  uint32_t landed = 7;
  ASSERT_LWO(lwo_ring_query(ring, t0, &landed));
  EXPECT_EQ(landed, 1u);
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_acquire(ring, t0, stream(c), &v));
  EXPECT_EQ(state(ring, t0), LWO_TICKET_ACQUIRED);
  landed = 7;
  ASSERT_LWO(lwo_ring_query(ring, t0, &landed));
  EXPECT_EQ(landed, 1u);
  gpu->read(c, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t0, stream(c)));
  EXPECT_EQ(state(ring, t0), LWO_TICKET_ENDED);
  landed = 7;
  EXPECT_EQ(lwo_ring_query(ring, t0, &landed), LWO_ERR_STALE_TICKET);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_query: ")) << msg();
  EXPECT_EQ(landed, 7u);  // left as it was

  // A hit takes the slot again under a new ticket: the old one stays ended.
  lwo_ticket t1{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t1));
  EXPECT_NE(t1.id, t0.id);
  EXPECT_EQ(ring_stats(ring).n_hits, 1u);
  EXPECT_EQ(state(ring, t0), LWO_TICKET_ENDED);
  EXPECT_EQ(state(ring, t1), LWO_TICKET_STAGED);
  ASSERT_LWO(lwo_ring_query(ring, t1, &landed));
  EXPECT_EQ(landed, 1u);  // a hit has landed
  ASSERT_LWO(lwo_ring_release(ring, t1, stream(c)));
  // A copy of another layer reuses the slot.
  lwo_ticket t2{};
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t2));
  EXPECT_EQ(state(ring, t1), LWO_TICKET_ENDED);
  EXPECT_EQ(state(ring, t2), LWO_TICKET_STAGED);
  EXPECT_EQ(lwo_ring_query(ring, t1, &landed), LWO_ERR_STALE_TICKET);

  // Foreign tickets.
  lwo_ticket_state_t s = LWO_TICKET_STATE_FORCE_32;
  EXPECT_EQ(lwo_ring_ticket_state(ring, lwo_ticket{0}, &s), LWO_ERR_FOREIGN_TICKET);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_ticket_state: ")) << msg();
  EXPECT_EQ(s, LWO_TICKET_STATE_FORCE_32);
  lwo_ticket ot{};
  ASSERT_LWO(lwo_ring_stage(other, 2, &ot));
  EXPECT_EQ(lwo_ring_ticket_state(ring, ot, &s), LWO_ERR_FOREIGN_TICKET);
  EXPECT_EQ(lwo_ring_ticket_state(other, t2, &s), LWO_ERR_FOREIGN_TICKET);
  EXPECT_EQ(lwo_ring_query(ring, ot, &landed), LWO_ERR_FOREIGN_TICKET);
  EXPECT_EQ(lwo_ring_query(ring, lwo_ticket{0}, &landed), LWO_ERR_FOREIGN_TICKET);
  EXPECT_EQ(s, LWO_TICKET_STATE_FORCE_32);
  EXPECT_EQ(state(other, ot), LWO_TICKET_STAGED);
  EXPECT_EQ(lwo_ring_ticket_state(ring, t2, nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_ring_query(ring, t2, nullptr), LWO_ERR_INVALID_ARGUMENT);

  ASSERT_LWO(lwo_ring_release(other, ot, stream(c)));
  ASSERT_LWO(lwo_ring_release(ring, t2, stream(c)));
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_destroy(other));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// lwo_ring_release_all releases every staged and acquired ticket, as
// lwo_ring_release would one by one: the count, the tickets ENDED, every slot
// free, the layers hits afterwards, and no slot reused before the release's
// stream work (also for a hit that was never acquired, whose release must
// cover the previous occupancy's readers).
TEST_F(Abi02Rings, ReleaseAllReleasesEveryLiveTicketInStreamOrder) {
  lwo_pool* pool = make_pool(6);
  lwo_ring* ring = make_ring(pool, 3);
  StreamH a = gpu->new_stream(), b = gpu->new_stream();
  uint32_t n = 99;
  ASSERT_LWO(lwo_ring_release_all(ring, stream(b), &n));
  EXPECT_EQ(n, 0u);

  // Layer 0: acquired and read on a, released; staged again (a hit, not
  // acquired). Layer 1: acquired and read on b. Layer 2: staged only.
  lwo_ticket t0{}, t1{}, t2{}, old{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_stage(ring, 0, &old));
  ASSERT_LWO(lwo_ring_acquire(ring, old, stream(a), &v));
  gpu->read(a, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, old, stream(a)));
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t0));
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t1));
  ASSERT_LWO(lwo_ring_acquire(ring, t1, stream(b), &v));
  gpu->read(b, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_stage(ring, 2, &t2));
  EXPECT_EQ(n_free(ring), 0u);

  n = 99;
  ASSERT_LWO(lwo_ring_release_all(ring, stream(b), &n));
  EXPECT_EQ(n, 3u);
  EXPECT_EQ(n_free(ring), 3u);
  for (lwo_ticket t : {t0, t1, t2}) {
    EXPECT_EQ(state(ring, t), LWO_TICKET_ENDED);
    EXPECT_EQ(lwo_ring_release(ring, t, stream(b)), LWO_ERR_STALE_TICKET);
  }
  ASSERT_LWO(lwo_ring_release_all(ring, stream(b), nullptr));  // n_released may be NULL
  // Released, the layers are still in their slots: hits.
  uint64_t hits = ring_stats(ring).n_hits;
  for (uint32_t l : {0u, 1u, 2u}) {
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(ring, l, &t));
    ASSERT_LWO(lwo_ring_release(ring, t, stream(b)));
  }
  EXPECT_EQ(ring_stats(ring).n_hits, hits + 3);
  // Overwrite every slot: each copy must follow the reads on a and b.
  for (uint32_t l : {3u, 4u, 5u}) {
    lwo_ticket t{};
    ASSERT_LWO(lwo_ring_stage(ring, l, &t));
  }
  EXPECT_EQ(n_free(ring), 0u);
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_release_all(ring, stream(a), &n));
  EXPECT_EQ(n, 3u);
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// A depth-1 ring: a hit released by lwo_ring_release_all on a stream other
// than the first reader's; the next copy into the slot must still follow
// that reader (the checker would flag the copy otherwise).
TEST_F(Abi02Rings, ReleaseAllOfAHitCoversEarlierReaders) {
  lwo_pool* pool = make_pool(2);
  lwo_ring* ring = make_ring(pool, 1);
  StreamH a = gpu->new_stream(), b = gpu->new_stream();
  lwo_ticket t{};
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));
  ASSERT_LWO(lwo_ring_acquire(ring, t, stream(a), &v));
  gpu->read(a, v.base, v.record_bytes);
  ASSERT_LWO(lwo_ring_release(ring, t, stream(a)));
  ASSERT_LWO(lwo_ring_stage(ring, 0, &t));  // hit
  uint32_t n = 0;
  ASSERT_LWO(lwo_ring_release_all(ring, stream(b), &n));
  EXPECT_EQ(n, 1u);
  ASSERT_LWO(lwo_ring_stage(ring, 1, &t));  // overwrites the slot
  EXPECT_TRUE(gpu->violations.empty()) << gpu->violations[0];
  ASSERT_LWO(lwo_ring_release(ring, t, stream(b)));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// lwo_ring_release_all is LWO_ERR_BUSY while a schedule of the ring exists,
// and then releases nothing (n_released left as it was).
TEST_F(Abi02Rings, ReleaseAllIsBusyWhileAScheduleExists) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 2);
  StreamH c = gpu->new_stream();
  lwo_ticket mine{};
  ASSERT_LWO(lwo_ring_stage(ring, 2, &mine));
  uint32_t order[2] = {0, 1};
  lwo_schedule* s = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 2, &s));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_schedule_next(s, stream(c), &v));
  uint32_t n = 99;
  EXPECT_EQ(lwo_ring_release_all(ring, stream(c), &n), LWO_ERR_BUSY);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_release_all: ")) << msg();
  EXPECT_TRUE(contains(msg(), "schedule")) << msg();
  EXPECT_EQ(n, 99u);
  EXPECT_EQ(state(ring, mine), LWO_TICKET_STAGED);  // nothing was released
  EXPECT_EQ(n_free(ring), 0u);
  ASSERT_LWO(lwo_schedule_destroy(s));
  ASSERT_LWO(lwo_ring_release_all(ring, stream(c), &n));
  EXPECT_EQ(n, 1u);
  EXPECT_EQ(state(ring, mine), LWO_TICKET_ENDED);
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

/* ---------------------------------------------------------------------- */
/* Gradients: lwo_grads_query                                              */
/* ---------------------------------------------------------------------- */

using Abi02Grads = Abi02Test;

// lwo_grads_query: done 1 with nothing ended (a begun layer does not count),
// and after ends as the backend reports (the recording backend completes
// every copy at once, so 1); NULL done is refused.
TEST_F(Abi02Grads, QueryReportsDone) {
  lwo_pool* pool = make_pool(2);
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  uint32_t done = 7;
  ASSERT_LWO(lwo_grads_query(g, &done));
  EXPECT_EQ(done, 1u);
  StreamH c = gpu->new_stream();
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  ASSERT_LWO(lwo_grads_begin(g, 0, stream(c), &v));
  done = 7;
  ASSERT_LWO(lwo_grads_query(g, &done));
  EXPECT_EQ(done, 1u);
  gpu->write(c, v.base, v.record_bytes);
  ASSERT_LWO(lwo_grads_end(g, 0, stream(c)));
  done = 7;
  ASSERT_LWO(lwo_grads_query(g, &done));
  EXPECT_EQ(done, 1u);
  ASSERT_LWO(lwo_grads_wait(g));
  done = 7;
  ASSERT_LWO(lwo_grads_query(g, &done));
  EXPECT_EQ(done, 1u);
  EXPECT_EQ(lwo_grads_query(g, nullptr), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_query: ")) << msg();
  EXPECT_EQ(lwo_grads_query(nullptr, &done), LWO_ERR_INVALID_HANDLE);
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

/* ---------------------------------------------------------------------- */
/* Messages and outputs of failed calls                                   */
/* ---------------------------------------------------------------------- */

using Abi02Errors = Abi02Test;

// Conventions: the message starts with the name of the call the caller
// made, also for a failure deep inside it (lwo_schedule_next staging a
// layer names lwo_schedule_next, then the position and layer, then the
// staging error); the schedule's position does not advance.
TEST_F(Abi02Errors, MessagesStartWithTheCallersCall) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 1);
  StreamH c = gpu->new_stream();
  lwo_ticket held{};
  ASSERT_LWO(lwo_ring_stage(ring, 1, &held));
  uint32_t order[2] = {1, 2};
  lwo_schedule* s = nullptr;
  ASSERT_LWO(lwo_schedule_create(ring, order, 2, &s));
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  EXPECT_EQ(lwo_schedule_next(s, stream(c), &v), LWO_ERR_LAYER_BUSY);
  std::string m = msg();
  EXPECT_TRUE(starts_with(m, "lwo_schedule_next: ")) << m;
  EXPECT_FALSE(contains(m, "lwo_ring_stage")) << m;
  size_t at_pos = m.find("position 0");
  size_t at_layer = m.find("layer 1");
  size_t at_err = m.find("already staged");
  EXPECT_NE(at_pos, std::string::npos) << m;
  EXPECT_NE(at_layer, std::string::npos) << m;
  EXPECT_NE(at_err, std::string::npos) << m;
  EXPECT_LT(at_pos, at_err) << m;
  uint32_t pos = 9;
  ASSERT_LWO(lwo_schedule_position(s, &pos));
  EXPECT_EQ(pos, 0u);
  ASSERT_LWO(lwo_ring_release(ring, held, stream(c)));
  ASSERT_LWO(lwo_schedule_next(s, stream(c), &v));  // the retry works
  EXPECT_EQ(v.layer, 1u);
  EXPECT_EQ(msg(), "");
  ASSERT_LWO(lwo_schedule_destroy(s));

  std::vector<uint8_t> w(10);
  EXPECT_EQ(lwo_pool_write(pool, 1, "weight", w.data(), w.size()), LWO_ERR_SIZE_MISMATCH);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_write: ")) << msg();
  EXPECT_TRUE(contains(msg(), "given 10")) << msg();
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(ring, 7, &t), LWO_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(starts_with(msg(), "lwo_ring_stage: ")) << msg();
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  EXPECT_EQ(lwo_grads_end(g, 0, stream(c)), LWO_ERR_TICKET_STATE);
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_end: ")) << msg();
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Conventions: a failed call sets an output handle to NULL, also when the
// failure is the input handle itself or an argument checked after it.
TEST_F(Abi02Errors, FailedCreatesSetTheirHandleToNull) {
  ModelDesc m(2);
  lwo_pool* pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_pinned(nullptr, m.layers.data(), 2, nullptr, &pool),
            LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(pool, nullptr);
  pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_pinned(engine, m.layers.data(), 0, nullptr, &pool),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(pool, nullptr);
  pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_registered(engine, m.layers.data(), 2, nullptr, 0, nullptr, &pool),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(pool, nullptr);
  pool = make_pool(2);
  lwo_ring* ring = bogus<lwo_ring>();
  EXPECT_EQ(lwo_ring_create(nullptr, nullptr, &ring), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(ring, nullptr);
  lwo_ring_config rc = LWO_RING_CONFIG_INIT;
  rc.depth = 0;
  ring = bogus<lwo_ring>();
  EXPECT_EQ(lwo_ring_create(pool, &rc, &ring), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ring, nullptr);
  gpu->fail_alloc_after = 0;
  ring = bogus<lwo_ring>();
  EXPECT_EQ(lwo_ring_create(pool, nullptr, &ring), LWO_ERR_OUT_OF_MEMORY);
  EXPECT_EQ(ring, nullptr);
  lwo_grads* g = bogus<lwo_grads>();
  uint8_t none[2] = {0, 0};
  EXPECT_EQ(lwo_grads_create(pool, none, nullptr, &g), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(g, nullptr);
  ring = make_ring(pool, 1);
  lwo_schedule* s = bogus<lwo_schedule>();
  uint32_t order[1] = {5};
  EXPECT_EQ(lwo_schedule_create(ring, order, 1, &s), LWO_ERR_OUT_OF_RANGE);
  EXPECT_EQ(s, nullptr);
  s = bogus<lwo_schedule>();
  EXPECT_EQ(lwo_schedule_create(nullptr, order, 1, &s), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(s, nullptr);
  lwo_checkpoint* ck = bogus<lwo_checkpoint>();
  EXPECT_EQ(lwo_checkpoint_open("/nonexistent/lwo_abi02.safetensors", &ck), LWO_ERR_IO);
  EXPECT_EQ(ck, nullptr);
  ck = bogus<lwo_checkpoint>();
  EXPECT_EQ(lwo_checkpoint_open(nullptr, &ck), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ck, nullptr);
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Conventions: a failed lwo_ring_stage sets the output ticket to {0}, for
// every failure once the ticket pointer is known to be valid (a non-NULL
// pointer is valid whatever the ring handle is).
TEST_F(Abi02Errors, FailedStageSetsTheTicketToZero) {
  lwo_pool* pool = make_pool(3);
  lwo_ring* ring = make_ring(pool, 1);
  lwo_ticket held{};
  ASSERT_LWO(lwo_ring_stage(ring, 0, &held));
  lwo_ticket t{0xdeadbeef};
  EXPECT_EQ(lwo_ring_stage(ring, 0, &t), LWO_ERR_LAYER_BUSY);
  EXPECT_EQ(t.id, 0u);
  t.id = 0xdeadbeef;
  EXPECT_EQ(lwo_ring_stage(ring, 1, &t), LWO_ERR_RING_FULL);
  EXPECT_EQ(t.id, 0u);
  t.id = 0xdeadbeef;
  EXPECT_EQ(lwo_ring_stage(ring, 3, &t), LWO_ERR_OUT_OF_RANGE);
  EXPECT_EQ(t.id, 0u);
  t.id = 0xdeadbeef;
  EXPECT_EQ(lwo_ring_stage(nullptr, 1, &t), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(t.id, 0u) << "the ticket pointer was valid; only the ring handle was not";
  t.id = 0xdeadbeef;
  EXPECT_EQ(lwo_ring_stage(reinterpret_cast<lwo_ring*>(pool), 1, &t), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(t.id, 0u);
  ASSERT_LWO(lwo_ring_release(ring, held, nullptr));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Conventions: checks run in order: handles, then NULL pointers, structs and
// other arguments, then ranges and names. A call given both a bad argument
// and a bad layer / index reports the argument.
TEST_F(Abi02Errors, ArgumentErrorsComeBeforeRangeErrors) {
  lwo_pool* pool = make_pool(2);
  lwo_ring* ring = make_ring(pool, 1);
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  // Handles first.
  lwo_ticket t{};
  EXPECT_EQ(lwo_ring_stage(nullptr, 99, &t), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(lwo_pool_write_range(nullptr, 99, nullptr, 0, nullptr, 4), LWO_ERR_INVALID_HANDLE);
  // Then arguments, before the range of the layer.
  EXPECT_EQ(lwo_ring_stage(ring, 99, nullptr), LWO_ERR_INVALID_ARGUMENT);
  lwo_layer_view small = LWO_LAYER_VIEW_INIT;
  small.size = 0;
  EXPECT_EQ(lwo_grads_begin(g, 99, nullptr, &small), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_pool_shard_tensor(pool, 99, "weight", nullptr, nullptr, nullptr),
            LWO_ERR_INVALID_ARGUMENT);
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  ti.size = 0;
  EXPECT_EQ(lwo_pool_tensor_info(pool, 99, 0, &ti), LWO_ERR_INVALID_ARGUMENT)
      << "an info struct of size 0 is an argument error, checked before the layer: " << msg();
  EXPECT_EQ(lwo_pool_write_range(pool, 99, "weight", 0, nullptr, 4), LWO_ERR_INVALID_ARGUMENT)
      << "src NULL with 4 bytes is an argument error, checked before the layer: " << msg();
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// Conventions: every output other than handles and tickets is left as it
// was by a failed call.
TEST_F(Abi02Errors, OtherOutputsOfFailedCallsAreLeftAlone) {
  lwo_pool* pool = make_pool(2);
  void* d = bogus<void>();
  uint64_t first = 99, n = 99, off = 99;
  EXPECT_EQ(lwo_pool_shard_tensor(pool, 1, "nope", &d, &first, &n), LWO_ERR_NOT_FOUND);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_shard_tensor: ")) << msg();
  EXPECT_EQ(d, bogus<void>());
  EXPECT_EQ(first, 99u);
  EXPECT_EQ(n, 99u);
  EXPECT_EQ(lwo_pool_shard_host(pool, 2, &d, &off, &n), LWO_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(starts_with(msg(), "lwo_pool_shard_host: ")) << msg();
  EXPECT_EQ(d, bogus<void>());
  EXPECT_EQ(off, 99u);
  EXPECT_EQ(n, 99u);
  lwo_grads* g = nullptr;
  ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
  float* gd = reinterpret_cast<float*>(uintptr_t{0x1234});
  EXPECT_EQ(lwo_grads_shard(g, 0, "bias", &gd, &first, &n), LWO_ERR_NOT_FOUND);  // even layers have none
  EXPECT_TRUE(starts_with(msg(), "lwo_grads_shard: ")) << msg();
  EXPECT_EQ(gd, reinterpret_cast<float*>(uintptr_t{0x1234}));
  EXPECT_EQ(first, 99u);
  EXPECT_EQ(n, 99u);
  ASSERT_LWO(lwo_grads_destroy(g));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

/* ---------------------------------------------------------------------- */
/* Checkpoints                                                            */
/* ---------------------------------------------------------------------- */

uint64_t file_size(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(stat(path.c_str(), &st), 0) << path;
  return static_cast<uint64_t>(st.st_size);
}

class Abi02Checkpoints : public Abi02Test {
 protected:
  void SetUp() override {
    Abi02Test::SetUp();
    ASSERT_FALSE(tmp.dir().empty());
    dir = tmp.dir();
  }
  std::string file(const std::string& name) { return tmp.file(name); }
  std::vector<FileTensor> model(uint32_t L, uint64_t seed) { return test_model(L, seed); }
  lwo_checkpoint* open(const std::string& path) {
    lwo_checkpoint* ck = nullptr;
    EXPECT_EQ(lwo_checkpoint_open(path.c_str(), &ck), LWO_OK) << msg();
    return ck;
  }
  lwo_checkpoint_file file_info(lwo_checkpoint* ck, uint32_t i) {
    lwo_checkpoint_file f = LWO_CHECKPOINT_FILE_INIT;
    EXPECT_EQ(lwo_checkpoint_file_info(ck, i, &f), LWO_OK) << msg();
    return f;
  }
  lwo_checkpoint_tensor tensor_info(lwo_checkpoint* ck, uint32_t i) {
    lwo_checkpoint_tensor t = LWO_CHECKPOINT_TENSOR_INIT;
    EXPECT_EQ(lwo_checkpoint_tensor_info(ck, i, &t), LWO_OK) << msg();
    return t;
  }
  TempFiles tmp;
  std::string dir;
};

// lwo_checkpoint_destroy: NULL is fine, the handle is dead afterwards, and
// a pool made from it keeps the files mapped and streams them.
TEST_F(Abi02Checkpoints, DestroyKeepsPoolsWorking) {
  auto ts = model(2, 10);
  std::string path = file("m.safetensors");
  write_safetensors(path, ts);
  EXPECT_EQ(lwo_checkpoint_destroy(nullptr), LWO_OK);
  lwo_checkpoint* ck = open(path);
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "blocks.{i}.";
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
  uint32_t n = 0;
  EXPECT_EQ(lwo_checkpoint_tensor_count(ck, &n), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(lwo_checkpoint_file_count(ck, &n), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(lwo_checkpoint_destroy(ck), LWO_ERR_INVALID_HANDLE);
  EXPECT_TRUE(starts_with(msg(), "lwo_checkpoint_destroy: ")) << msg();
  lwo_ring* ring = make_ring(pool, 1);
  StreamH c = gpu->new_stream();
  for (uint32_t l = 0; l < 2; ++l) {
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_ring_stage(ring, l, &t));
    ASSERT_LWO(lwo_ring_acquire(ring, t, stream(c), &v));
    void* w = nullptr;
    ASSERT_LWO(lwo_ring_tensor(ring, t, "weight", &w));
    EXPECT_EQ(std::memcmp(w, ts[1 + 2 * l].bytes.data(), ts[1 + 2 * l].bytes.size()), 0);
    ASSERT_LWO(lwo_ring_release(ring, t, stream(c)));
  }
  ASSERT_LWO(lwo_ring_destroy(ring));
  ASSERT_LWO(lwo_pool_destroy(pool));
}

// lwo_checkpoint_file_count / file_info for one file: its path as opened,
// its size, its tensor count; index 1 is out of range; the size rule holds.
TEST_F(Abi02Checkpoints, FileInfoOfOneFile) {
  auto ts = model(3, 20);
  std::string path = file("one.safetensors");
  write_safetensors(path, ts);
  lwo_checkpoint* ck = open(path);
  uint32_t n = 0;
  ASSERT_LWO(lwo_checkpoint_file_count(ck, &n));
  EXPECT_EQ(n, 1u);
  lwo_checkpoint_file f = file_info(ck, 0);
  EXPECT_EQ(f.size, sizeof(lwo_checkpoint_file));
  EXPECT_EQ(std::string(f.path), path);
  EXPECT_EQ(f.bytes, file_size(path));
  EXPECT_EQ(f.n_tensors, ts.size());
  EXPECT_EQ(lwo_checkpoint_file_info(ck, 1, &f), LWO_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(starts_with(msg(), "lwo_checkpoint_file_info: ")) << msg();
  f.size = 0;
  EXPECT_EQ(lwo_checkpoint_file_info(ck, 0, &f), LWO_ERR_INVALID_ARGUMENT);
  alignas(lwo_checkpoint_file) uint8_t buf[sizeof(lwo_checkpoint_file)];
  std::memset(buf, kSentinel, sizeof buf);
  auto* fp = reinterpret_cast<lwo_checkpoint_file*>(buf);
  fp->size = offsetof(lwo_checkpoint_file, n_tensors);
  ASSERT_LWO(lwo_checkpoint_file_info(ck, 0, fp));
  EXPECT_EQ(fp->bytes, file_size(path));
  EXPECT_TRUE(untouched(buf, offsetof(lwo_checkpoint_file, n_tensors), sizeof buf));
  EXPECT_EQ(lwo_checkpoint_file_count(ck, nullptr), LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// Files of an index are numbered in shard-name order, whatever the order
// of the index and of the tensor names: here the index lists the second
// shard's tensors first and they sort first by name. Each tensor's `file`
// is the file_info whose path holds it; tensors come in file order.
TEST_F(Abi02Checkpoints, ShardsAreNumberedInNameOrder) {
  // Shard "m-00002" holds "a.*", shard "m-00001" holds "b.*".
  std::vector<FileTensor> s2 = {make_tensor("a.x", "F32", 4, {8}, 1),
                                make_tensor("a.y", "F32", 4, {3, 4}, 2)};
  std::vector<FileTensor> s1 = {make_tensor("b.x", "BF16", 2, {16}, 3),
                                make_tensor("b.y", "F32", 4, {5}, 4),
                                make_tensor("b.z", "F32", 4, {2}, 5)};
  std::string p1 = file("m-00001.safetensors"), p2 = file("m-00002.safetensors");
  write_safetensors(p2, s2);  // the second shard is written first, too
  write_safetensors(p1, s1);
  std::string index = file("m.safetensors.index.json");
  {
    std::ofstream out(index);
    out << "{\"metadata\":{\"total_size\":\"0\"},\"weight_map\":{"
        << "\"a.y\":\"m-00002.safetensors\",\"a.x\":\"m-00002.safetensors\","
        << "\"b.z\":\"m-00001.safetensors\",\"b.x\":\"m-00001.safetensors\","
        << "\"b.y\":\"m-00001.safetensors\"}}";
  }
  lwo_checkpoint* ck = open(index);
  uint32_t nf = 0;
  ASSERT_LWO(lwo_checkpoint_file_count(ck, &nf));
  ASSERT_EQ(nf, 2u);
  lwo_checkpoint_file f0 = file_info(ck, 0), f1 = file_info(ck, 1);
  EXPECT_EQ(std::string(f0.path), p1);
  EXPECT_EQ(std::string(f1.path), p2);
  EXPECT_EQ(f0.bytes, file_size(p1));
  EXPECT_EQ(f1.bytes, file_size(p2));
  EXPECT_EQ(f0.n_tensors, 3u);
  EXPECT_EQ(f1.n_tensors, 2u);
  uint32_t nt = 0;
  ASSERT_LWO(lwo_checkpoint_tensor_count(ck, &nt));
  ASSERT_EQ(nt, 5u);
  uint32_t last_file = 0;
  for (uint32_t i = 0; i < nt; ++i) {
    lwo_checkpoint_tensor t = tensor_info(ck, i);
    std::string name = t.name;
    SCOPED_TRACE(name);
    ASSERT_LT(t.file, nf);
    EXPECT_EQ(std::string(file_info(ck, t.file).path), name[0] == 'b' ? p1 : p2);
    EXPECT_GE(t.file, last_file);  // file order
    last_file = t.file;
  }
  EXPECT_STREQ(tensor_info(ck, 0).name, "b.x");  // file 0, offset order
  EXPECT_STREQ(tensor_info(ck, 3).name, "a.x");
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// lwo_checkpoint_metadata_count / metadata: one file's "__metadata__" key by
// key in byte order (not the file's order), with its file index; the file
// pointer may be NULL; out of range leaves the outputs alone.
TEST_F(Abi02Checkpoints, MetadataOfOneFileInKeyByteOrder) {
  auto ts = model(1, 30);
  std::string path = file("meta.safetensors");
  write_safetensors(path, ts, {{"b", "2"}, {"a", "1"}, {"B", "3"}, {"\xc3\xa9", "4"}});
  lwo_checkpoint* ck = open(path);
  uint32_t n = 0;
  ASSERT_LWO(lwo_checkpoint_metadata_count(ck, &n));
  ASSERT_EQ(n, 4u);
  const char* want[4][2] = {{"B", "3"}, {"a", "1"}, {"b", "2"}, {"\xc3\xa9", "4"}};
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t f = 9;
    const char* k = nullptr;
    const char* v = nullptr;
    ASSERT_LWO(lwo_checkpoint_metadata(ck, i, &f, &k, &v));
    EXPECT_EQ(f, 0u);
    EXPECT_STREQ(k, want[i][0]) << i;
    EXPECT_STREQ(v, want[i][1]) << i;
  }
  const char* k = nullptr;
  const char* v = nullptr;
  ASSERT_LWO(lwo_checkpoint_metadata(ck, 1, nullptr, &k, &v));
  EXPECT_STREQ(k, "a");
  uint32_t f = 9;
  k = v = "kept";
  EXPECT_EQ(lwo_checkpoint_metadata(ck, 4, &f, &k, &v), LWO_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(starts_with(msg(), "lwo_checkpoint_metadata: ")) << msg();
  EXPECT_EQ(f, 9u);
  EXPECT_STREQ(k, "kept");
  EXPECT_EQ(lwo_checkpoint_metadata(ck, 0, &f, nullptr, &v), LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));

  // No metadata at all.
  std::string plain = file("plain.safetensors");
  write_safetensors(plain, ts);
  ck = open(plain);
  ASSERT_LWO(lwo_checkpoint_metadata_count(ck, &n));
  EXPECT_EQ(n, 0u);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// Metadata of an index's shards: file by file in file (shard-name) order,
// each file's keys in byte order, each entry naming its file.
TEST_F(Abi02Checkpoints, MetadataOfShardsInFileOrder) {
  std::string p1 = file("s-00001.safetensors"), p2 = file("s-00002.safetensors");
  write_safetensors(p2, {make_tensor("a.w", "F32", 4, {4}, 1)}, {{"shard", "two"}, {"format", "pt"}});
  write_safetensors(p1, {make_tensor("b.w", "F32", 4, {4}, 2)}, {{"shard", "one"}});
  std::string index = file("s.safetensors.index.json");
  {
    std::ofstream out(index);
    out << "{\"weight_map\":{\"a.w\":\"s-00002.safetensors\",\"b.w\":\"s-00001.safetensors\"}}";
  }
  lwo_checkpoint* ck = open(index);
  uint32_t n = 0;
  ASSERT_LWO(lwo_checkpoint_metadata_count(ck, &n));
  ASSERT_EQ(n, 3u);
  const struct {
    uint32_t file;
    const char *key, *value;
  } want[] = {{0, "shard", "one"}, {1, "format", "pt"}, {1, "shard", "two"}};
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t f = 9;
    const char* k = nullptr;
    const char* v = nullptr;
    ASSERT_LWO(lwo_checkpoint_metadata(ck, i, &f, &k, &v));
    EXPECT_EQ(f, want[i].file) << i;
    EXPECT_STREQ(k, want[i].key) << i;
    EXPECT_STREQ(v, want[i].value) << i;
  }
  EXPECT_EQ(std::string(file_info(ck, 1).path), p2);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// lwo_checkpoint_map_tensors with a pattern: layers[i] and names[i] (the
// prefix taken off) for matched tensors, LWO_NO_LAYER and NULL for the
// others, n_layers; exactly what lwo_pool_create_from_checkpoint builds.
TEST_F(Abi02Checkpoints, MapTensorsByPatternAgreesWithThePool) {
  const uint32_t L = 3;
  auto ts = model(L, 40);
  ts.push_back(make_tensor("head.weight", "F32", 4, {7}, 99));
  std::string path = file("map.safetensors");
  write_safetensors(path, ts);
  lwo_checkpoint* ck = open(path);
  uint32_t nt = 0;
  ASSERT_LWO(lwo_checkpoint_tensor_count(ck, &nt));
  ASSERT_EQ(nt, ts.size());
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "blocks.{i}.";
  std::vector<uint32_t> layers(nt, 12345);
  std::vector<const char*> names(nt, "unset");
  uint32_t nl = 0;
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &cfg, nt, layers.data(), names.data(), &nl));
  EXPECT_EQ(nl, L);
  std::map<uint32_t, std::vector<std::string>> by_layer;
  for (uint32_t i = 0; i < nt; ++i) {
    std::string full = tensor_info(ck, i).name;
    SCOPED_TRACE(full);
    if (full == "embed" || full == "head.weight") {
      EXPECT_EQ(layers[i], LWO_NO_LAYER);
      EXPECT_EQ(names[i], nullptr);
      continue;
    }
    uint32_t l = static_cast<uint32_t>(std::stoul(full.substr(7)));
    EXPECT_EQ(layers[i], l);
    ASSERT_NE(names[i], nullptr);
    EXPECT_EQ(std::string(names[i]), full.substr(std::string("blocks.").size() + 2));
    by_layer[layers[i]].push_back(names[i]);
  }
  // names and n_layers may be NULL.
  std::vector<uint32_t> layers2(nt, 12345);
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &cfg, nt, layers2.data(), nullptr, nullptr));
  EXPECT_EQ(layers2, layers);
  // The pool has the same layers, with the same tensor names.
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  ASSERT_EQ(pool_info(pool).n_layers, nl);
  for (uint32_t l = 0; l < nl; ++l) {
    uint32_t n = 0;
    ASSERT_LWO(lwo_pool_layer_tensor_count(pool, l, &n));
    ASSERT_EQ(n, by_layer[l].size()) << "layer " << l;
    for (uint32_t k = 0; k < n; ++k) {
      lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
      ASSERT_LWO(lwo_pool_tensor_info(pool, l, k, &ti));
      EXPECT_EQ(std::string(ti.name), by_layer[l][k]) << "layer " << l << " tensor " << k;
    }
  }
  ASSERT_LWO(lwo_pool_destroy(pool));
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// lwo_checkpoint_map_tensors with explicit names: full names, the caller's
// layers; a wrong n_tensors is LWO_ERR_SIZE_MISMATCH and a missing name
// LWO_ERR_NOT_FOUND, with the arrays left as they were.
TEST_F(Abi02Checkpoints, MapTensorsByNamesAndErrors) {
  auto ts = model(2, 50);
  std::string path = file("names.safetensors");
  write_safetensors(path, ts);
  lwo_checkpoint* ck = open(path);
  const uint32_t nt = static_cast<uint32_t>(ts.size());  // embed, b0.w, b0.b, b1.w, b1.b
  // Layer 0: blocks.1.bias, embed; layer 1: blocks.0.weight.
  const char* nm[3] = {"blocks.1.bias", "embed", "blocks.0.weight"};
  uint32_t nn[2] = {2, 1};
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.names = nm;
  cfg.n_names = nn;
  cfg.n_layers = 2;
  std::vector<uint32_t> layers(nt, 12345);
  std::vector<const char*> names(nt, "unset");
  uint32_t nl = 0;
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &cfg, nt, layers.data(), names.data(), &nl));
  EXPECT_EQ(nl, 2u);
  const uint32_t want_layer[5] = {0, 1, LWO_NO_LAYER, LWO_NO_LAYER, 0};
  for (uint32_t i = 0; i < nt; ++i) {
    std::string full = tensor_info(ck, i).name;
    SCOPED_TRACE(full);
    EXPECT_EQ(layers[i], want_layer[i]);
    if (want_layer[i] == LWO_NO_LAYER) {
      EXPECT_EQ(names[i], nullptr);
    } else {
      ASSERT_NE(names[i], nullptr);
      EXPECT_EQ(std::string(names[i]), full);  // unstripped
    }
  }
  lwo_pool* pool = nullptr;
  ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
  lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
  ASSERT_LWO(lwo_pool_tensor_info(pool, 0, 1, &ti));
  EXPECT_STREQ(ti.name, "embed");
  ASSERT_LWO(lwo_pool_tensor_info(pool, 1, 0, &ti));
  EXPECT_STREQ(ti.name, "blocks.0.weight");
  ASSERT_LWO(lwo_pool_destroy(pool));

  for (uint32_t wrong : {nt - 1, nt + 1, 0u}) {
    EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &cfg, wrong, layers.data(), names.data(), &nl),
              LWO_ERR_SIZE_MISMATCH);
    EXPECT_TRUE(starts_with(msg(), "lwo_checkpoint_map_tensors: ")) << msg();
  }
  nm[2] = "blocks.0.nope";
  std::fill(layers.begin(), layers.end(), 777u);
  nl = 99;
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &cfg, nt, layers.data(), names.data(), &nl),
            LWO_ERR_NOT_FOUND);
  EXPECT_TRUE(contains(msg(), "blocks.0.nope")) << msg();
  EXPECT_EQ(layers, std::vector<uint32_t>(nt, 777u));
  EXPECT_EQ(nl, 99u);
  // A pattern's whole prefix for layer i comes off ("blocks.0.w" of
  // "blocks.0.weight").
  lwo_checkpoint_pool_config pat = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  pat.pattern = "blocks.{i}.w";  // only "blocks.<i>.weight": layers 0 and 1
  ASSERT_LWO(lwo_checkpoint_map_tensors(ck, &pat, nt, layers.data(), names.data(), &nl));
  EXPECT_EQ(nl, 2u);
  EXPECT_STREQ(names[1], "eight");
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, nullptr, nt, layers.data(), names.data(), &nl),
            LWO_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lwo_checkpoint_map_tensors(ck, &pat, nt, nullptr, names.data(), &nl),
            LWO_ERR_INVALID_ARGUMENT);
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

// lwo_pool_get_info of checkpoint pools: mapped when the files register,
// staged when asked (LWO_CHECKPOINT_STAGED) or when registration is
// refused; rank 0 of 1. Checkpoint pools are read-only (write_range
// LWO_ERR_UNSUPPORTED) and their shard calls give the whole tensor.
TEST_F(Abi02Checkpoints, PoolKindsAndAccess) {
  auto ts = model(2, 60);
  std::string path = file("kinds.safetensors");
  write_safetensors(path, ts);
  lwo_checkpoint* ck = open(path);
  for (int how = 0; how < 3; ++how) {
    SCOPED_TRACE(how);
    lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
    cfg.pattern = "blocks.{i}.";
    cfg.flags = how == 1 ? LWO_CHECKPOINT_STAGED : 0u;
    gpu->refuse_register = how == 2;
    lwo_pool* pool = nullptr;
    ASSERT_LWO(lwo_pool_create_from_checkpoint(engine, ck, &cfg, &pool));
    gpu->refuse_register = false;
    lwo_pool_info pi = pool_info(pool);
    EXPECT_EQ(pi.kind, how == 0 ? LWO_POOL_CHECKPOINT_MAPPED : LWO_POOL_CHECKPOINT_STAGED);
    EXPECT_EQ(pi.rank, 0);
    EXPECT_EQ(pi.n_ranks, 1);
    EXPECT_EQ(pi.n_layers, 2u);
    uint8_t x[4] = {1, 2, 3, 4};
    EXPECT_EQ(lwo_pool_write_range(pool, 0, "bias", 0, x, 4), LWO_ERR_UNSUPPORTED);
    EXPECT_TRUE(starts_with(msg(), "lwo_pool_write_range: ")) << msg();
    void* th = nullptr;
    ASSERT_LWO(lwo_pool_tensor_host(pool, 1, "weight", &th, nullptr));
    void* d = nullptr;
    uint64_t first = 99, ne = 0;
    ASSERT_LWO(lwo_pool_shard_tensor(pool, 1, "weight", &d, &first, &ne));
    EXPECT_EQ(d, th);
    EXPECT_EQ(first, 0u);
    EXPECT_EQ(ne, ts[3].bytes.size() / 2);
    EXPECT_EQ(std::memcmp(d, ts[3].bytes.data(), ts[3].bytes.size()), 0);
    void* wh = nullptr;
    uint64_t wb = 0, off = 99, sb = 0;
    ASSERT_LWO(lwo_pool_layer_host(pool, 1, &wh, &wb));
    ASSERT_LWO(lwo_pool_shard_host(pool, 1, &d, &off, &sb));
    EXPECT_EQ(d, wh);
    EXPECT_EQ(off, 0u);
    EXPECT_EQ(sb, wb);
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
  // A failed pool creation sets the pool to NULL.
  lwo_checkpoint_pool_config bad = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  bad.pattern = "nothing.{i}.";
  lwo_pool* pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_from_checkpoint(engine, ck, &bad, &pool), LWO_ERR_NOT_FOUND);
  EXPECT_EQ(pool, nullptr);
  pool = bogus<lwo_pool>();
  EXPECT_EQ(lwo_pool_create_from_checkpoint(nullptr, ck, &bad, &pool), LWO_ERR_INVALID_HANDLE);
  EXPECT_EQ(pool, nullptr);
  // A newer caller's larger checkpoint config: a zero tail is fine, else the
  // first nonzero byte is named.
  lwo_checkpoint_pool_config cfg = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  cfg.pattern = "blocks.{i}.";
  Larger<lwo_checkpoint_pool_config> big(cfg);
  uint32_t un = 0;
  ASSERT_LWO(lwo_checkpoint_unmatched_count(ck, &big.cfg, &un));
  EXPECT_EQ(un, 1u);
  size_t at = big.poke(3);
  EXPECT_EQ(lwo_checkpoint_unmatched_count(ck, &big.cfg, &un), LWO_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(msg(), "byte " + std::to_string(at) + " ")) << msg();
  ASSERT_LWO(lwo_checkpoint_destroy(ck));
}

}  // namespace
}  // namespace testing
}  // namespace lwo
