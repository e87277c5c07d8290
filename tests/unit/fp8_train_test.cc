// Trainable layers whose weights travel as fp8 e4m3 block-128 records, on
// the host backend (lwo_test_engine_create_host: the real engine on host
// memory, layer compute on the CPU): a streamed training loop (stage, the
// forward from the quantized slot, backward with dweight, the gradients to
// host in bf16, lwo_optim_step) against a reference that computes the same
// loop from the dequantized masters (f32 products and sums in the order the
// host compute takes them, so the gradients agree bit for bit; the update in
// f64); after each step the pool's record is lwo_quantize of the masters
// byte for byte and the next stage moves it. Then lwo_optim_write of the
// masters (re-quantized), and the refusals.
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bindings/c/lwo_test.h"
#include "src/common/dtype.h"
#include "test_util.h"
#include "unit/conv_desc.h"
#include "unit/quant_formats.h"

namespace lwo {
namespace testing {
namespace {

using lwo_quant_test::desc_of;

constexpr int64_t kDim = 160;  // 2 x 2 blocks of 128, the second ones partial
constexpr int64_t kTokens = 5;

std::string msg() { return lwo_last_error_message(); }
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A chain of kDim -> kDim linear layers: "weight" bf16 [kDim, kDim] (fp8
// block-128 where quant[l]) and "bias" bf16 [kDim].
struct Chain {
  std::vector<lwo_tensor_quant_ext> q;
  std::vector<std::vector<lwo_tensor_desc>> t;
  std::vector<lwo_layer_desc> layers;
  explicit Chain(const std::vector<lwo_quant_format_t>& formats, int64_t dim = kDim)
      : q(formats.size()), t(formats.size()), layers(formats.size()) {
    for (size_t l = 0; l < formats.size(); ++l) {
      q[l] = lwo_tensor_quant_ext{};
      q[l].header.type = LWO_EXT_TENSOR_QUANT;
      q[l].format = formats[l];
      t[l].push_back(tensor("weight", LWO_DTYPE_BF16, {dim, dim}));
      if (formats[l] != LWO_QUANT_NONE) t[l][0].next = &q[l];
      t[l].push_back(tensor("bias", LWO_DTYPE_BF16, {dim}));
      layers[l] = lwo_layer_desc{t[l].data(), 2, nullptr};
    }
  }
};

std::vector<float> normal(size_t n, float sd, std::mt19937& rng) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<uint8_t> quantized(const std::vector<float>& w) {
  // f32 source; the layout is the bf16 tensor's (the dtype changes no byte of it).
  const lwo_quant_desc d = desc_of(LWO_QUANT_FP8_E4M3_BLOCK128, kDim, kDim, LWO_DTYPE_F32);
  lwo_quant_layout_info info = LWO_QUANT_LAYOUT_INFO_INIT;
  EXPECT_EQ(lwo_quant_layout(&d, &info), LWO_OK) << msg();
  std::vector<uint8_t> out(info.total_bytes, 0xab);
  EXPECT_EQ(lwo_quantize(&d, w.data(), w.size() * 4, out.data(), out.size(), 1),
            LWO_OK)
      << msg();
  return out;
}

// The record dequantized to `dt` (f32 for masters, bf16: what the layer's
// compute reads), as f32 values.
std::vector<float> dequantized(const void* record, lwo_dtype_t dt) {
  const lwo_quant_desc d = desc_of(LWO_QUANT_FP8_E4M3_BLOCK128, kDim, kDim, dt);
  lwo_quant_layout_info info = LWO_QUANT_LAYOUT_INFO_INIT;
  EXPECT_EQ(lwo_quant_layout(&d, &info), LWO_OK) << msg();
  std::vector<uint8_t> out(size_t(kDim * kDim) * dtype_size(dt));
  EXPECT_EQ(lwo_dequantize_host(&d, record, info.total_bytes, out.data(), out.size(), 1), LWO_OK)
      << msg();
  std::vector<float> f(size_t(kDim * kDim));
  for (size_t i = 0; i < f.size(); ++i) f[i] = load_f32(out.data(), dt, i);
  return f;
}

std::vector<float> bf16_values(const void* p, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = load_f32(p, LWO_DTYPE_BF16, i);
  return v;
}
std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16(v[i]);
  return b;
}

// The reference layer compute: f32 products summed in order, each output
// rounded once to bf16 (the host compute's definition).
std::vector<float> ref_forward(const std::vector<float>& x, const std::vector<float>& w,
                               const std::vector<float>& b) {
  std::vector<float> y(size_t(kTokens * kDim));
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t o = 0; o < kDim; ++o) {
      float s = 0.f;
      for (int64_t i = 0; i < kDim; ++i) s += x[t * kDim + i] * w[o * kDim + i];
      y[t * kDim + o] = bf16_to_f32(f32_to_bf16(s + b[o]));
    }
  return y;
}
struct RefGrads {
  std::vector<float> dx, dw, db;
};
RefGrads ref_backward(const std::vector<float>& x, const std::vector<float>& dy,
                      const std::vector<float>& w) {
  RefGrads r{std::vector<float>(size_t(kTokens * kDim)), std::vector<float>(size_t(kDim * kDim)),
             std::vector<float>(size_t(kDim))};
  for (int64_t o = 0; o < kDim; ++o) {
    for (int64_t i = 0; i < kDim; ++i) {
      float s = 0.f;
      for (int64_t t = 0; t < kTokens; ++t) s += dy[t * kDim + o] * x[t * kDim + i];
      r.dw[o * kDim + i] = bf16_to_f32(f32_to_bf16(s));
    }
    float s = 0.f;
    for (int64_t t = 0; t < kTokens; ++t) s += dy[t * kDim + o];
    r.db[o] = bf16_to_f32(f32_to_bf16(s));
  }
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t i = 0; i < kDim; ++i) {
      float s = 0.f;
      for (int64_t o = 0; o < kDim; ++o) s += dy[t * kDim + o] * w[o * kDim + i];
      r.dx[t * kDim + i] = bf16_to_f32(f32_to_bf16(s));
    }
  return r;
}

// One tensor's reference state (f64).
struct Ref {
  std::vector<double> p, m, v;
};
void ref_update(Ref& t, const std::vector<float>& g, const lwo_optim_step_params& p, double c,
                lwo_optim_kind_t kind) {
  if (t.m.empty()) t.m.assign(t.p.size(), 0), t.v.assign(t.p.size(), 0);
  const double bc1 = 1 - std::pow(p.beta1, double(p.step)),
               bc2 = 1 - std::pow(p.beta2, double(p.step));
  for (size_t i = 0; i < t.p.size(); ++i) {
    const double gi = double(g[i]) * c;
    t.p[i] *= 1 - p.lr * p.weight_decay;
    if (kind == LWO_OPTIM_ADAMW) {
      t.m[i] = p.beta1 * t.m[i] + (1 - p.beta1) * gi;
      t.v[i] = p.beta2 * t.v[i] + (1 - p.beta2) * gi * gi;
      t.p[i] -= p.lr / bc1 * t.m[i] / (std::sqrt(t.v[i]) / std::sqrt(bc2) + p.eps);
    } else {
      t.m[i] = p.step == 1 ? gi : p.momentum * t.m[i] + (1 - p.dampening) * gi;
      t.p[i] -= p.lr * t.m[i];
    }
  }
}

class Fp8Train : public EngineTest {
 protected:
  void SetUp() override { ASSERT_LWO(lwo_test_engine_create_host(LWO_TEST_HOST_POISON, &engine)); }
  // A pool of the chain: fp8 weights quantized from N(0, 0.08), bf16 ones
  // rounded from it, biases N(0, 0.1).
  lwo_pool* make_chain(const Chain& c, uint64_t seed) {
    lwo_pool* pool = nullptr;
    EXPECT_EQ(lwo_pool_create_pinned(engine, c.layers.data(), uint32_t(c.layers.size()), nullptr,
                                     &pool),
              LWO_OK)
        << msg();
    if (!pool) return nullptr;
    std::mt19937 rng(static_cast<unsigned>(seed));
    for (uint32_t l = 0; l < c.layers.size(); ++l) {
      const std::vector<float> w = normal(size_t(kDim * kDim), 0.08f, rng);
      if (c.q[l].format != LWO_QUANT_NONE) {
        EXPECT_EQ(lwo_pool_write_quantized(pool, l, "weight", w.data(), LWO_DTYPE_F32,
                                           w.size() * 4, 1),
                  LWO_OK)
            << msg();
      } else {
        const std::vector<uint16_t> b = to_bf16(w);
        EXPECT_EQ(lwo_pool_write(pool, l, "weight", b.data(), b.size() * 2), LWO_OK) << msg();
      }
      const std::vector<uint16_t> b = to_bf16(normal(size_t(kDim), 0.1f, rng));
      EXPECT_EQ(lwo_pool_write(pool, l, "bias", b.data(), b.size() * 2), LWO_OK) << msg();
    }
    return pool;
  }
  const uint8_t* host(lwo_pool* pool, uint32_t l, const char* name, uint64_t* bytes = nullptr) {
    void* h = nullptr;
    EXPECT_EQ(lwo_pool_tensor_host(pool, l, name, &h, bytes), LWO_OK) << msg();
    return static_cast<const uint8_t*>(h);
  }
  std::vector<float> master(lwo_optim* o, uint32_t l, const char* name, size_t n) {
    std::vector<float> m(n);
    EXPECT_EQ(lwo_optim_read(o, l, name, LWO_OPTIM_MASTER, m.data(), n * 4), LWO_OK) << msg();
    return m;
  }
  lwo_linear_desc linear(lwo_quant_format_t f, int64_t dim = kDim) {
    lwo_linear_desc d = LWO_LINEAR_DESC_INIT;
    d.in_features = d.out_features = dim;
    d.dtype = LWO_DTYPE_BF16;
    d.flags = LWO_LINEAR_BIAS;
    d.weight_format = f;
    return d;
  }
};

struct Variant {
  const char* name;
  lwo_optim_kind_t kind;
  uint32_t flags;
  lwo_dtype_t state;
};

// Four layers: fp8 trainable, fp8 frozen, bf16 trainable, fp8 trainable;
// six steps of each optimizer variant (AdamW; SGD; AdamW clipping every
// step; AdamW delayed, bf16 state rounded stochastically). Per step: the
// activations and the landed gradients (dense bf16, rows x cols) equal the
// reference's bit for bit, the masters follow the f64 update, every fp8
// record is lwo_quantize(masters) byte for byte, the next forward's slot
// holds it; the frozen layer's record never changes.
TEST_F(Fp8Train, StreamedLoopMatchesTheReferenceFromTheDequantizedMasters) {
  const std::vector<lwo_quant_format_t> formats = {
      LWO_QUANT_FP8_E4M3_BLOCK128, LWO_QUANT_FP8_E4M3_BLOCK128, LWO_QUANT_NONE,
      LWO_QUANT_FP8_E4M3_BLOCK128};
  const uint32_t L = uint32_t(formats.size());
  const uint8_t trainable[4] = {1, 0, 1, 1};
  const Variant variants[] = {
      {"adamw", LWO_OPTIM_ADAMW, 0, LWO_DTYPE_F32},
      {"sgd", LWO_OPTIM_SGD, 0, LWO_DTYPE_F32},
      {"adamw clipping", LWO_OPTIM_ADAMW, LWO_OPTIM_CLIPPING, LWO_DTYPE_F32},
      {"adamw delayed, bf16 stochastic state", LWO_OPTIM_ADAMW,
       LWO_OPTIM_DELAYED | LWO_OPTIM_STOCHASTIC_ROUNDING, LWO_DTYPE_BF16},
  };
  const size_t NW = size_t(kDim * kDim), NB = size_t(kDim);
  for (const Variant& var : variants) {
    SCOPED_TRACE(var.name);
    Chain chain(formats);
    lwo_pool* pool = make_chain(chain, 5);
    ASSERT_NE(pool, nullptr);
    uint64_t frozen_bytes = 0;
    const uint8_t* frozen = host(pool, 1, "weight", &frozen_bytes);
    const std::vector<uint8_t> frozen_record(frozen, frozen + frozen_bytes);
    lwo_grads* g = nullptr;
    lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;  // native: bf16 on the wire and in host memory
    ASSERT_LWO(lwo_grads_create(pool, trainable, &gc, &g));
    lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
    oc.kind = var.kind;
    oc.flags = var.flags;
    oc.state_dtype = var.state;
    oc.n_threads = 2;
    oc.seed = 77;
    lwo_optim* o = nullptr;
    ASSERT_LWO(lwo_optim_create(g, &oc, &o));
    lwo_ring* ring = make_ring(pool, 2);
    // The reference's state, from the masters the optimizer made: an fp8
    // record's are its dequantization to f32, exactly.
    std::map<std::pair<uint32_t, std::string>, Ref> ref;
    for (uint32_t l = 0; l < L; ++l) {
      if (!trainable[l]) continue;
      for (const char* name : {"weight", "bias"}) {
        const size_t n = std::string(name) == "weight" ? NW : NB;
        const std::vector<float> m = master(o, l, name, n);
        if (formats[l] != LWO_QUANT_NONE && std::string(name) == "weight") {
          const std::vector<float> want = dequantized(host(pool, l, name), LWO_DTYPE_F32);
          ASSERT_EQ(0, std::memcmp(m.data(), want.data(), n * 4)) << "layer " << l;
        }
        ref[{l, name}].p.assign(m.begin(), m.end());
      }
    }
    std::mt19937 rng(11);
    lwo_optim_step_params p = LWO_OPTIM_STEP_PARAMS_INIT;
    p.lr = var.kind == LWO_OPTIM_SGD ? 1e-3 : 2e-3;
    p.weight_decay = 0.01;
    p.max_norm = (var.flags & LWO_OPTIM_CLIPPING) ? 0.05 : 0.0;  // below every step's norm
    uint64_t clipped = 0;
    // The step just run (p), once it is done: the gradients that landed,
    // the masters against the reference, the pool's bytes.
    std::map<std::pair<uint32_t, std::string>, std::vector<float>> G;
    auto check_step = [&] {
      ASSERT_LWO(lwo_optim_wait(o));
      ASSERT_LWO(lwo_grads_wait(g));
      // The landed gradients are the reference's; the norm and the clip.
      double sq = 0;
      for (auto& kv : G) {
        lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
        ASSERT_LWO(lwo_grads_tensor(g, kv.first.first, kv.first.second.c_str(), &gt));
        ASSERT_EQ(gt.dtype, LWO_DTYPE_BF16);
        ASSERT_EQ(gt.n_elements, kv.second.size());
        ASSERT_EQ(bf16_values(gt.data, gt.n_elements), kv.second)
            << "layer " << kv.first.first << " " << kv.first.second;
        for (float x : kv.second) sq += double(x) * x;
      }
      double c = 1;
      if (p.max_norm > 0) {
        c = std::min(1.0, p.max_norm / (std::sqrt(sq) + 1e-6));
        clipped += c < 1;
      }
      for (auto& kv : ref) ref_update(kv.second, G[kv.first], p, c, var.kind);
      // Masters against the reference; each fp8 record lwo_quantize(masters).
      const double tol = (var.state == LWO_DTYPE_BF16 ? 0.05 : 1e-3) * p.lr;
      for (auto& kv : ref) {
        const uint32_t l = kv.first.first;
        const char* name = kv.first.second.c_str();
        const std::vector<float> m = master(o, l, name, kv.second.p.size());
        for (size_t i = 0; i < m.size(); ++i)
          ASSERT_NEAR(m[i], kv.second.p[i], tol * double(p.step) + 1e-6 * std::fabs(kv.second.p[i]))
              << "layer " << l << " " << name << " element " << i;
        uint64_t bytes = 0;
        const uint8_t* h = host(pool, l, name, &bytes);
        if (formats[l] != LWO_QUANT_NONE && kv.first.second == "weight") {
          const std::vector<uint8_t> want = quantized(m);
          ASSERT_EQ(bytes, want.size());
          for (size_t i = 0; i < want.size(); ++i)
            ASSERT_EQ(h[i], want[i]) << "layer " << l << " record byte " << i;
        } else {
          for (size_t i = 0; i < m.size(); ++i)
            ASSERT_EQ(load_f32(h, LWO_DTYPE_BF16, i), bf16_to_f32(f32_to_bf16(m[i])))
                << "layer " << l << " " << name << " element " << i;
        }
      }
      uint64_t fb = 0;
      const uint8_t* fh = host(pool, 1, "weight", &fb);
      ASSERT_EQ(0, std::memcmp(fh, frozen_record.data(), fb)) << "the frozen layer changed";
    };
    // Plain steps are not waited for: the next forward's stage of each layer
    // waits for its update (and must then move the new record). Delayed ones
    // are, so that the pool holds the masters' quantization (lwo_optim_wait).
    const bool wait_now = (var.flags & LWO_OPTIM_DELAYED) != 0;
    for (uint64_t step = 1; step <= 6; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      // Forward, streamed: each slot holds the pool's record (once the
      // previous step is checked: the update's). The weights every layer
      // computes from: the slot's record dequantized to bf16 (fp8), its bf16
      // bytes (dense).
      std::vector<std::vector<float>> W(L), B(L);
      std::vector<std::vector<uint8_t>> S(L);  // the slots' records
      std::vector<std::vector<float>> X(L + 1);
      X[0] = bf16_values(to_bf16(normal(size_t(kTokens * kDim), 1.f, rng)).data(),
                         size_t(kTokens * kDim));
      for (uint32_t l = 0; l < L; ++l) {
        lwo_ticket t{};
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_LWO(lwo_ring_stage(ring, l, &t));
        ASSERT_LWO(lwo_ring_acquire(ring, t, nullptr, &v));
        ASSERT_TRUE(holds_layer(pool, v)) << "layer " << l;
        W[l] = formats[l] != LWO_QUANT_NONE ? dequantized(v.tensors[0], LWO_DTYPE_BF16)
                                            : bf16_values(v.tensors[0], NW);
        B[l] = bf16_values(v.tensors[1], NB);
        S[l].assign(static_cast<const uint8_t*>(v.base),
                    static_cast<const uint8_t*>(v.base) + v.record_bytes);
        const lwo_linear_desc d = linear(formats[l]);
        const std::vector<uint16_t> x = to_bf16(X[l]);
        std::vector<uint16_t> y(size_t(kTokens * kDim));
        ASSERT_LWO(lwo_linear_forward(engine, &d, kTokens, x.data(), v.tensors[0], v.tensors[1],
                                      y.data(), nullptr));
        ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
        X[l + 1] = bf16_values(y.data(), y.size());
        ASSERT_EQ(X[l + 1], ref_forward(X[l], W[l], B[l])) << "y of layer " << l;
      }
      if (step > 1 && !wait_now) {
        check_step();
        if (HasFatalFailure()) return;
        // The forward read the update's bytes: its stages waited for it.
        for (uint32_t l = 0; l < L; ++l) {
          void* h = nullptr;
          uint64_t bytes = 0;
          ASSERT_LWO(lwo_pool_layer_host(pool, l, &h, &bytes));
          ASSERT_EQ(bytes, S[l].size());
          ASSERT_EQ(0, std::memcmp(h, S[l].data(), bytes)) << "layer " << l << " staged early";
        }
      }
      // Backward: dy = the last output (the loss is half its squares).
      ASSERT_LWO(lwo_grads_zero(g));
      std::vector<float> dy = X[L];
      G.clear();
      for (uint32_t l = L; l-- > 0;) {
        lwo_ticket t{};
        lwo_layer_view v = LWO_LAYER_VIEW_INIT;
        ASSERT_LWO(lwo_ring_stage(ring, l, &t));
        ASSERT_LWO(lwo_ring_acquire(ring, t, nullptr, &v));
        const lwo_linear_desc d = linear(formats[l]);
        const std::vector<uint16_t> x = to_bf16(X[l]), dyb = to_bf16(dy);
        std::vector<uint16_t> dx(size_t(kTokens * kDim));
        const RefGrads r = ref_backward(X[l], dy, W[l]);
        if (trainable[l]) {
          lwo_layer_view gv = LWO_LAYER_VIEW_INIT;
          ASSERT_LWO(lwo_grads_begin(g, l, nullptr, &gv));
          ASSERT_EQ(gv.n_tensors, 2u);
          // The weight's gradient is dense: rows x cols bf16, whatever the record.
          ASSERT_EQ(gv.tensor_dtypes[0], LWO_DTYPE_BF16);
          ASSERT_EQ(gv.tensor_bytes[0], NW * 2) << "layer " << l;
          ASSERT_LWO(lwo_linear_backward(engine, &d, kTokens, x.data(), dyb.data(), v.tensors[0],
                                         dx.data(), gv.tensors[0], gv.tensors[1], LWO_DTYPE_BF16,
                                         nullptr));
          ASSERT_LWO(lwo_grads_end(g, l, nullptr));
          G[{l, "weight"}] = r.dw;
          G[{l, "bias"}] = r.db;
        } else {
          ASSERT_LWO(lwo_linear_backward(engine, &d, kTokens, x.data(), dyb.data(), v.tensors[0],
                                         dx.data(), nullptr, nullptr, LWO_DTYPE_BF16, nullptr));
        }
        ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
        dy = bf16_values(dx.data(), dx.size());
        ASSERT_EQ(dy, r.dx) << "dx of layer " << l;
      }
      p.step = step;
      ASSERT_LWO(lwo_optim_step(o, &p));
      if (wait_now) {
        check_step();
        if (HasFatalFailure()) return;
      }
    }
    if (!wait_now) check_step();
    if (HasFatalFailure()) return;
    if (p.max_norm > 0) {
      EXPECT_EQ(clipped, 6u);
    }
    lwo_optim_stats st{};
    st.size = sizeof st;
    ASSERT_LWO(lwo_optim_get_stats(o, &st));
    EXPECT_EQ(st.n_steps, 6u);
    EXPECT_EQ(st.n_clipped, clipped);
    ASSERT_LWO(lwo_ring_release_all(ring, nullptr, nullptr));
    ASSERT_LWO(lwo_optim_destroy(o));
    ASSERT_LWO(lwo_ring_destroy(ring));
    ASSERT_LWO(lwo_grads_destroy(g));
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
}

// lwo_optim_write of an fp8 tensor's masters quantizes them into the pool's
// record (the next stage moves it; lwo_optim_read gives them back exactly);
// a NaN master is refused as lwo_quantize refuses it, and leaves the masters
// and the record as they were. Delayed: the record moves too.
TEST_F(Fp8Train, WritingTheMastersRequantizesTheRecord) {
  for (uint32_t flags : {0u, static_cast<uint32_t>(LWO_OPTIM_DELAYED)}) {
    SCOPED_TRACE(flags ? "delayed" : "plain");
    Chain chain({LWO_QUANT_FP8_E4M3_BLOCK128});
    lwo_pool* pool = make_chain(chain, 9);
    ASSERT_NE(pool, nullptr);
    lwo_grads* g = nullptr;
    ASSERT_LWO(lwo_grads_create(pool, nullptr, nullptr, &g));
    lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
    oc.flags = flags;
    lwo_optim* o = nullptr;
    ASSERT_LWO(lwo_optim_create(g, &oc, &o));
    lwo_ring* ring = make_ring(pool, 1);
    lwo_ticket t{};
    lwo_layer_view v = LWO_LAYER_VIEW_INIT;
    ASSERT_LWO(lwo_ring_stage(ring, 0, &t));  // the slot holds the old record
    ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
    std::mt19937 rng(3);
    std::vector<float> m = normal(size_t(kDim * kDim), 0.3f, rng);
    m[17] = 1e4f;  // one large block
    ASSERT_LWO(lwo_optim_write(o, 0, "weight", LWO_OPTIM_MASTER, m.data(), m.size() * 4));
    EXPECT_EQ(master(o, 0, "weight", m.size()), m);
    const std::vector<uint8_t> want = quantized(m);
    uint64_t bytes = 0;
    const uint8_t* h = host(pool, 0, "weight", &bytes);
    ASSERT_EQ(bytes, want.size());
    EXPECT_EQ(0, std::memcmp(h, want.data(), bytes));
    ASSERT_LWO(lwo_ring_stage(ring, 0, &t));  // changed: copied again
    ASSERT_LWO(lwo_ring_acquire(ring, t, nullptr, &v));
    EXPECT_TRUE(holds_layer(pool, v));
    ASSERT_LWO(lwo_ring_release(ring, t, nullptr));
    std::vector<float> bad = m;
    bad[kDim * 130 + 5] = std::nanf("");  // row 130, column 5
    EXPECT_QERR(LWO_ERR_INVALID_ARGUMENT, "lwo_optim_write", "layer 0 tensor 'weight'",
                lwo_optim_write(o, 0, "weight", LWO_OPTIM_MASTER, bad.data(), bad.size() * 4));
    EXPECT_TRUE(contains(msg(), "element [130, 5]")) << msg();
    EXPECT_EQ(master(o, 0, "weight", m.size()), m);
    EXPECT_EQ(0, std::memcmp(host(pool, 0, "weight"), want.data(), want.size()));
    // The size of the masters is rows x cols f32, not the record's.
    EXPECT_QERR(LWO_ERR_SIZE_MISMATCH, "lwo_optim_write", "it holds 102400",
                lwo_optim_write(o, 0, "weight", LWO_OPTIM_MASTER, m.data(), want.size()));
    ASSERT_LWO(lwo_ring_destroy(ring));
    ASSERT_LWO(lwo_optim_destroy(o));
    ASSERT_LWO(lwo_grads_destroy(g));
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
}

// Only fp8 block-128 trains: a trainable layer holding another quantized
// format is LWO_ERR_QUANTIZED_WEIGHT at lwo_grads_create (naming the layer,
// the tensor and the format), and so is a dweight or dbias of such a weight
// in lwo_linear_backward; an fp8 block-128 layer's gradients are dense in
// its logical dtype (or f32 with LWO_GRADS_F32).
TEST_F(Fp8Train, OnlyFp8Block128Trains) {
  for (lwo_quant_format_t f : lwo_quant_test::kFormats) {
    SCOPED_TRACE(lwo_quant_format_name(f));
    const int64_t dim = 256;  // int4 groups need cols of a multiple of 128
    Chain chain({LWO_QUANT_NONE, f}, dim);
    lwo_pool* pool = nullptr;
    ASSERT_LWO(lwo_pool_create_pinned(engine, chain.layers.data(), 2, nullptr, &pool));
    lwo_grads* g = nullptr;
    const lwo_linear_desc d = linear(f, dim);
    std::vector<uint16_t> buf(size_t(dim * dim) * 2);
    void* b = buf.data();
    if (f == LWO_QUANT_FP8_E4M3_BLOCK128) {
      lwo_grads_config gc = LWO_GRADS_CONFIG_INIT;
      gc.flags = LWO_GRADS_F32;
      ASSERT_LWO(lwo_grads_create(pool, nullptr, &gc, &g));
      lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
      ASSERT_LWO(lwo_grads_tensor(g, 1, "weight", &gt));
      EXPECT_EQ(gt.dtype, LWO_DTYPE_F32);
      EXPECT_EQ(gt.n_elements, uint64_t(dim * dim));
      ASSERT_LWO(lwo_grads_destroy(g));
      ASSERT_LWO(lwo_linear_backward(engine, &d, 1, b, b, b, nullptr, b, b, LWO_DTYPE_F32,
                                     nullptr));
    } else {
      EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_grads_create", "layer 1",
                  lwo_grads_create(pool, nullptr, nullptr, &g));
      EXPECT_TRUE(contains(msg(), "tensor 'weight'")) << msg();
      EXPECT_TRUE(contains(msg(), lwo_quant_format_name(f))) << msg();
      EXPECT_TRUE(contains(msg(), "only fp8_e4m3_block128 tensors train")) << msg();
      EXPECT_EQ(g, nullptr);
      const uint8_t trainable[2] = {1, 0};  // frozen: fine
      ASSERT_LWO(lwo_grads_create(pool, trainable, nullptr, &g));
      ASSERT_LWO(lwo_grads_destroy(g));
      EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_linear_backward", "only fp8_e4m3_block128",
                  lwo_linear_backward(engine, &d, 1, b, b, b, nullptr, b, nullptr, LWO_DTYPE_F32,
                                      nullptr));
    }
    ASSERT_LWO(lwo_pool_destroy(pool));
  }
}

// A convolution's weight of fp8 block-128 trains too: lwo_conv2d_backward
// gives dweight and dbias with it, equal to the dense call's on the
// dequantized weight (dweight and dbias do not read W; dx reads its
// dequantization, as the forward does).
TEST_F(Fp8Train, ConvolutionWeightGradientsWithAnFp8Weight) {
  const int32_t n = 2, h = 6, w = 6, c = 16, k = 8;
  lwo_conv2d_desc d = lwo_conv_test::conv3x3_desc(c, k, LWO_CONV_BIAS);
  const int64_t cols = int64_t(c) * 9;  // weight [k, c * 3 * 3]
  std::mt19937 rng(5);
  const std::vector<float> wf = normal(size_t(k * cols), 0.1f, rng);
  const lwo_quant_desc qd = desc_of(LWO_QUANT_FP8_E4M3_BLOCK128, k, cols, LWO_DTYPE_F32);
  lwo_quant_layout_info info = LWO_QUANT_LAYOUT_INFO_INIT;
  ASSERT_LWO(lwo_quant_layout(&qd, &info));
  std::vector<uint8_t> rec(info.total_bytes);
  ASSERT_LWO(lwo_quantize(&qd, wf.data(), wf.size() * 4, rec.data(), rec.size(), 1));
  lwo_quant_desc bd = qd;
  bd.dtype = LWO_DTYPE_BF16;
  std::vector<uint16_t> dense(size_t(k * cols));
  ASSERT_LWO(lwo_dequantize_host(&bd, rec.data(), rec.size(), dense.data(), dense.size() * 2, 1));
  const std::vector<uint16_t> x = to_bf16(normal(size_t(n * c * h * w), 1.f, rng)),
                              dy = to_bf16(normal(size_t(n * k * h * w), 1.f, rng));
  std::vector<uint16_t> dx[2], dw[2], db[2];
  for (int q = 0; q < 2; ++q) {
    dx[q].assign(x.size(), 0);
    dw[q].assign(dense.size(), 0);
    db[q].assign(size_t(k), 0);
    d.weight_format = q ? LWO_QUANT_FP8_E4M3_BLOCK128 : LWO_QUANT_NONE;
    ASSERT_LWO(lwo_conv2d_backward(engine, &d, n, h, w, x.data(), dy.data(),
                                   q ? static_cast<const void*>(rec.data()) : dense.data(),
                                   dx[q].data(), dw[q].data(), db[q].data(), LWO_DTYPE_BF16,
                                   nullptr));
  }
  EXPECT_EQ(dw[1], dw[0]);
  EXPECT_EQ(db[1], db[0]);
  EXPECT_EQ(dx[1], dx[0]);
  EXPECT_NE(dw[1], std::vector<uint16_t>(dense.size(), 0));
  d.weight_format = LWO_QUANT_FP8_E4M3_CHANNEL;  // another format: frozen
  EXPECT_QERR(LWO_ERR_QUANTIZED_WEIGHT, "lwo_conv2d_backward", "only fp8_e4m3_block128",
              lwo_conv2d_backward(engine, &d, n, h, w, x.data(), dy.data(), rec.data(),
                                  dx[1].data(), dw[1].data(), nullptr, LWO_DTYPE_BF16, nullptr));
}

}  // namespace
}  // namespace testing
}  // namespace lwo
