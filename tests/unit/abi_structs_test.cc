// The C ABI's struct rules, on the recording backend: size-first output
// structs written only up to their size, larger configs from newer callers
// (bounded, their tails zero), extension chains, and every status in its
// class range.
#include "abi_fixture.h"

namespace lwo {
namespace testing {
namespace {

/* ---------------------------------------------------------------------- */
/* Size-first structs the library writes                                  */
/* ---------------------------------------------------------------------- */

using AbiStructs = AbiTest;

// Conventions: a written struct's size below sizeof(size_t) is
// LWO_ERR_INVALID_ARGUMENT, for every call that writes an lwo_layer_view.
TEST_F(AbiStructs, ViewSizeBelowSizeTIsRefused) {
  auto [pool, ring, c] = pool_ring_stream(2, 2);
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
  destroy(g, ring, pool);
}

// Conventions: the library writes min(size, its sizeof) bytes of a view and
// never more: an older caller's smaller view gets its fields right and the
// bytes past its size untouched; a newer caller's larger one keeps its tail.
TEST_F(AbiStructs, ViewsAreWrittenOnlyUpToTheirSize) {
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
  destroy(g, ring, pool);
}

// Conventions: the size rule for lwo_tensor_info (size-first)
// and lwo_pool_info: too small is refused; a smaller struct gets its fields
// and nothing past them.
TEST_F(AbiStructs, TensorInfoAndPoolInfoAreWrittenOnlyUpToTheirSize) {
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

using AbiConfigs = AbiTest;

// Conventions: a larger lwo_ring_config is accepted when its tail is zero
// and refused (LWO_ERR_INVALID_ARGUMENT, naming the first nonzero byte)
// otherwise; the output ring is NULL then.
TEST_F(AbiConfigs, LargerRingConfig) {
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
TEST_F(AbiConfigs, ConfigSizeIsBoundedBeforeTheTailIsRead) {
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
  destroy(ring, pool);
}

// The same rule for lwo_pool_config (pinned and registered pools) and
// lwo_grads_config.
TEST_F(AbiConfigs, LargerPoolAndGradsConfigs) {
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

using AbiExtensions = AbiTest;

// Conventions: a non-NULL `next` of lwo_tensor_desc, lwo_layer_desc or
// lwo_host_region is LWO_ERR_UNSUPPORTED naming the extension's type; the
// output pool is NULL and nothing stays registered. NULL next is fine.
TEST_F(AbiExtensions, NonNullNextIsUnsupportedAndNamesTheType) {
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
TEST(AbiStatus, EveryStatusLiesInItsClassRange) {
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

}  // namespace
}  // namespace testing
}  // namespace lwo
