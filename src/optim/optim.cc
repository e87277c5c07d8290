#include "optim.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/quant/codec.h"

namespace lwo {
namespace optim {
namespace {

// Every per-element constant of one AdamW step, in f32.
struct AdamConsts {
  float decay, b1, one_b1, b2, one_b2, step_size, inv_sqrt_bc2, eps, scale;
  uint32_t key;  // the step's stochastic-rounding key for this range
};

// State element access: f32, or bf16 rounded to nearest even (S_BF16) or
// stochastically (S_SR) with 16 random bits.
enum StateKind { S_F32, S_BF16, S_SR };

template <StateKind S>
inline float load_state(const void* p, uint64_t i) {
  if (S == S_F32) return static_cast<const float*>(p)[i];
  return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}
template <StateKind S>
inline void store_state(void* p, uint64_t i, float x, uint32_t r16) {
  if (S == S_F32)
    static_cast<float*>(p)[i] = x;
  else if (S == S_BF16)
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
  else
    static_cast<uint16_t*>(p)[i] = f32_to_bf16_stochastic(x, r16);
}

// The loop for one (state, grad dtype) pair: templates so that each inner
// loop has fixed types and vectorizes. [b, e) lies within one 2^32-element
// block (the key covers it). The masters only: with_weights stores the
// pool's weights from them.
template <StateKind S, lwo_dtype_t G>
LWO_VECTOR_LOOP void adam_range(float* __restrict p, void* __restrict m, void* __restrict v,
                                const float* __restrict pin, const void* __restrict min,
                                const void* __restrict vin, const void* __restrict g, uint64_t b,
                                uint64_t e, const AdamConsts c) {
  for (uint64_t i = b; i < e; ++i) {
    const float gi = load_f32(g, G, i) * c.scale;
    float pi = pin[i] * c.decay;
    const float mi = c.b1 * load_state<S>(min, i) + c.one_b1 * gi;
    const float vi = c.b2 * load_state<S>(vin, i) + c.one_b2 * gi * gi;
    pi -= c.step_size * mi / (__builtin_sqrtf(vi) * c.inv_sqrt_bc2 + c.eps);
    const uint32_t r = S == S_SR ? mix32(static_cast<uint32_t>(i) ^ c.key) : 0;
    store_state<S>(m, i, mi, r);
    store_state<S>(v, i, vi, r >> 16);
    p[i] = pi;
  }
}

// Elements per chunk of with_weights: the chunk's masters (8 KiB) are still
// in the L1 cache when they are rounded into the pool.
constexpr uint64_t kChunk = 2048;

// update(b, e) over [b, e) and, where the tensor has pool weights, the
// updated masters rounded into them chunk by chunk with streaming stores
// (the pool's bytes are next read by the copy engine: no read for
// ownership, no cache lines taken for them), fenced before returning.
template <typename F>
void with_weights(const Tensor& t, uint64_t b, uint64_t e, F&& update) {
  if (!t.weights) return update(b, e);
  for (uint64_t i = b; i < e; i += kChunk) {
    const uint64_t j = std::min(e, i + kChunk);
    update(i, j);
    store_rounded(t.weights, t.weight_dtype, i, t.master + i, j - i, true);
  }
  streaming_fence();
}

// The masters and moments of [i, j) (no weights).
template <StateKind S>
void adam_update(const Tensor& t, uint64_t i, uint64_t j, const AdamConsts& c) {
  const float* pin = t.master_in ? t.master_in : t.master;
  const void* min = t.m_in ? t.m_in : t.m;
  const void* vin = t.v_in ? t.v_in : t.v;
  switch (t.grad_dtype) {
    case LWO_DTYPE_BF16:
      return adam_range<S, LWO_DTYPE_BF16>(t.master, t.m, t.v, pin, min, vin, t.grad, i, j, c);
    case LWO_DTYPE_F16:
      return adam_range<S, LWO_DTYPE_F16>(t.master, t.m, t.v, pin, min, vin, t.grad, i, j, c);
    default:
      return adam_range<S, LWO_DTYPE_F32>(t.master, t.m, t.v, pin, min, vin, t.grad, i, j, c);
  }
}

// ---- the fused fp8 block-128 write (Tensor::quant_format) ----

constexpr uint64_t kBlock = static_cast<uint64_t>(quant::kBlock);
constexpr uint64_t kTileBlocks = kTileCols / kBlock;
static_assert(kTileCols % kBlock == 0, "a tile is whole blocks wide");
constexpr uint32_t kNonFinite = 0x7f800000u;  // |x|'s bits at or above it: infinity or NaN

// amax[k] = max(amax[k], the bits of |p[x]| for x in block k of [0, n)):
// |x|'s f32 bits order as |x| does, NaN and infinity above every finite
// value, so an integer max gives the amax exactly and flags a non-finite
// block, whatever the order the lanes take.
LWO_VECTOR_LOOP void fold_abs_max(const float* __restrict p, uint64_t n, uint32_t* __restrict amax) {
  for (uint64_t k = 0; k * kBlock < n; ++k) {
    const uint64_t lo = k * kBlock, hi = std::min(n, lo + kBlock);
    uint32_t m = amax[k];
    for (uint64_t i = lo; i < hi; ++i) {
      uint32_t u;
      std::memcpy(&u, p + i, 4);
      u &= 0x7fffffffu;
      m = u > m ? u : m;
    }
    amax[k] = m;
  }
}

// q[x] = the code of p[x] under the scale of its block, whose inverse is
// inverse[x / 128].
LWO_VECTOR_LOOP void encode(uint8_t* __restrict q, const float* __restrict p, uint64_t n,
                            const float* __restrict inverse) {
  for (uint64_t k = 0; k * kBlock < n; ++k) {
    const uint64_t lo = k * kBlock, hi = std::min(n, lo + kBlock);
    const float inv = inverse[k];
    for (uint64_t i = lo; i < hi; ++i) q[i] = quant::e4m3_code(p[i], inv);
  }
}

// Elements a row of a tile is updated, its amax folded and its codes written
// in, in turn (4 blocks: the masters still in L1).
constexpr uint64_t kFp8Chunk = 512;
static_assert(kTileCols % kFp8Chunk == 0 && kFp8Chunk % kBlock == 0, "chunks of whole blocks");

// The scale a block's codes are first written under: the one its record
// holds (the previous update's), where that is a power of two an fp8 scale
// can be; else 1.
inline float predicted_scale(float held) {
  const uint32_t u = quant::bits_of_f32(held);
  const uint32_t exp = u >> 23;  // the sign bit included: negative scales are no prediction
  return (u & 0x7fffffu) == 0 && exp >= 1 && exp <= 247 ? held : 1.0f;
}

// Elements [b, e) (whole bands of 128 rows, e at most n) updated by
// update(i, j) (the masters and state of [i, j), any stochastic keys
// included), `weights` written, and the bands' codes and scales. Each band
// is taken in tiles of 128 rows x kTileCols columns (fewer where the band
// ends). A tile's rows are updated in chunks of kFp8Chunk elements, and while a
// chunk is in L1 its weights are written, its blocks' amax folded in and its
// codes written under each block's predicted scale: the scale the record
// held (fp8 scales are powers of two, so an update rarely moves a block's
// amax across one). Once the tile's rows are done, its scales: a block whose
// scale is not the predicted one has its codes written again (from the
// masters, in L2), so the bytes are quantize's of the updated masters
// whatever the record held; a block with a NaN or infinite master gets the
// scale NaN and the codes 0x7f. One pass over the masters and state, and a
// second over the few blocks whose scale moved (every block on the first
// update of a record whose scales were not fp8_scale's).
template <typename F>
void with_fp8(const Tensor& t, uint64_t b, uint64_t e, F&& update) {
  const uint64_t cols = static_cast<uint64_t>(t.cols), rows = static_cast<uint64_t>(t.rows);
  const uint64_t scale_cols = (cols + kBlock - 1) / kBlock;
  const uint64_t r_end = std::min(rows, (e + cols - 1) / cols);
  for (uint64_t r0 = b / cols; r0 < r_end; r0 += kBlock) {
    const uint64_t r1 = std::min(r_end, r0 + kBlock);
    for (uint64_t c0 = 0; c0 < cols; c0 += kTileCols) {
      const uint64_t w = std::min(cols - c0, kTileCols), n_blocks = (w + kBlock - 1) / kBlock;
      float* scale = t.scales + (r0 / kBlock) * scale_cols + c0 / kBlock;
      float predicted[kTileBlocks], inverse[kTileBlocks];
      uint32_t amax[kTileBlocks] = {};
      for (uint64_t k = 0; k < n_blocks; ++k) {
        predicted[k] = predicted_scale(scale[k]);
        inverse[k] = quant::fp8_inverse(predicted[k]);
      }
      for (uint64_t r = r0; r < r1; ++r) {
        const uint64_t i = r * cols + c0;
        for (uint64_t c = 0; c < w; c += kFp8Chunk) {
          const uint64_t u = std::min(kFp8Chunk, w - c);
          update(i + c, i + c + u);
          if (t.weights) store_rounded(t.weights, t.weight_dtype, i + c, t.master + i + c, u, true);
          fold_abs_max(t.master + i + c, u, amax + c / kBlock);
          encode(t.codes + i + c, t.master + i + c, u, inverse + c / kBlock);
        }
      }
      for (uint64_t k = 0; k < n_blocks; ++k) {
        const uint64_t lo = c0 + k * kBlock, bw = std::min(kBlock, cols - lo);
        if (amax[k] >= kNonFinite) {
          scale[k] = quant::f32_of_bits(0x7fc00000u);
          for (uint64_t r = r0; r < r1; ++r) std::memset(t.codes + r * cols + lo, 0x7f, bw);
          continue;
        }
        scale[k] = quant::fp8_scale(quant::f32_of_bits(amax[k]));
        if (scale[k] == predicted[k]) continue;
        const float inv = quant::fp8_inverse(scale[k]);
        for (uint64_t r = r0; r < r1; ++r)
          encode(t.codes + r * cols + lo, t.master + r * cols + lo, bw, &inv);
      }
    }
  }
  if (t.weights) streaming_fence();
}

// The elements of one band: parts of whole bands where the tensor has a
// quantized copy, else the 4096-element pages of every other step.
uint64_t part_align(const Tensor& t) {
  return t.quant_format == LWO_QUANT_NONE ? kAlign : kBlock * static_cast<uint64_t>(t.cols);
}

// First: step 1, where the buffer is the gradient (the old one is not read).
template <StateKind S, lwo_dtype_t G, bool First>
LWO_VECTOR_LOOP void sgd_range(float* __restrict p, void* __restrict m, const float* __restrict pin,
                               const void* __restrict min, const void* __restrict g, uint64_t b,
                               uint64_t e, float decay, float mom, float damp, float lr,
                               float scale, uint32_t key) {
  for (uint64_t i = b; i < e; ++i) {
    const float gi = load_f32(g, G, i) * scale;
    const float bi = First ? gi : mom * load_state<S>(min, i) + damp * gi;
    const uint32_t r = S == S_SR ? mix32(static_cast<uint32_t>(i) ^ key) : 0;
    store_state<S>(m, i, bi, r);
    p[i] = pin[i] * decay - lr * bi;
  }
}

void check_tensor(const Tensor& t, uint64_t step, bool needs_v, const char* what) {
  if (step == 0) fail(LWO_ERR_INVALID_ARGUMENT, "%s: step 0 (the first step is 1)", what);
  auto known = [](lwo_dtype_t d) {
    return d == LWO_DTYPE_F32 || d == LWO_DTYPE_BF16 || d == LWO_DTYPE_F16;
  };
  if (!known(t.grad_dtype))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: gradients of dtype %s (f32, bf16 or f16)", what,
         dtype_name(t.grad_dtype));
  if (t.weights && !known(t.weight_dtype))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: weights of dtype %s (f32, bf16 or f16)", what,
         dtype_name(t.weight_dtype));
  if (t.state_dtype != LWO_DTYPE_F32 && t.state_dtype != LWO_DTYPE_BF16)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: state of dtype %s (f32 or bf16)", what,
         dtype_name(t.state_dtype));
  if (t.n && (!t.master || !t.m || !t.grad || (needs_v && !t.v)))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: a NULL master, state or gradient buffer for %llu "
         "parameters", what, static_cast<unsigned long long>(t.n));
  if (!(std::isfinite(t.grad_scale) && t.grad_scale >= 0))
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: gradient scale %g (finite, >= 0)", what,
         static_cast<double>(t.grad_scale));
  if (t.quant_format == LWO_QUANT_NONE) {
    if (t.codes || t.scales)
      fail(LWO_ERR_INVALID_ARGUMENT, "%s: quantized codes or scales given with quant_format "
           "LWO_QUANT_NONE (0)", what);
    return;
  }
  if (t.quant_format != LWO_QUANT_FP8_E4M3_BLOCK128)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: quant_format %d: the step writes LWO_QUANT_NONE (0) or "
         "LWO_QUANT_FP8_E4M3_BLOCK128 (%d) only", what, static_cast<int>(t.quant_format),
         static_cast<int>(LWO_QUANT_FP8_E4M3_BLOCK128));
  constexpr int64_t kMaxDim = INT64_C(1) << 31;
  if (t.rows < 1 || t.cols < 1 || t.rows >= kMaxDim || t.cols >= kMaxDim ||
      static_cast<uint64_t>(t.rows) * static_cast<uint64_t>(t.cols) != t.n)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: an fp8 block-128 copy of %lld x %lld for %llu parameters "
         "(rows x cols must be the parameters, each of 1 .. 2^31 - 1)", what,
         static_cast<long long>(t.rows), static_cast<long long>(t.cols),
         static_cast<unsigned long long>(t.n));
  if (!t.codes || !t.scales)
    fail(LWO_ERR_INVALID_ARGUMENT, "%s: an fp8 block-128 copy of %lld x %lld with a NULL %s",
         what, static_cast<long long>(t.rows), static_cast<long long>(t.cols),
         t.codes ? "scales" : "codes");
}

StateKind state_kind(const Tensor& t) {
  return t.state_dtype == LWO_DTYPE_F32 ? S_F32 : t.stochastic ? S_SR : S_BF16;
}

// fn(b, e, key) over [b, e) cut at every 2^32-element boundary, with the
// step's key for that block.
template <typename F>
void by_block(const Tensor& t, uint64_t step, uint64_t b, uint64_t e, F&& fn) {
  while (b < e) {
    const uint64_t hi = b >> 32, end = std::min(e, (hi + 1) << 32);
    fn(b, end, t.stochastic ? step_key(t.key, step, hi) : 0u);
    b = end;
  }
}

// One step over the tensor on `workers`: update(i, j, key) updates the
// masters and state of [i, j) (inside one 2^32-element block; key: its
// stochastic stream), and the step writes what the tensor asks besides:
// `weights` (4096-element pages per part), or with an fp8 copy its codes and
// scales too (whole bands of 128 rows per part, with_fp8).
template <typename F>
void run_step(const Tensor& t, uint64_t step, Workers& workers, F&& update) {
  workers.run(t.n, part_align(t), kMinPart, [&](uint64_t b, uint64_t e) {
    if (t.quant_format != LWO_QUANT_NONE) {
      with_fp8(t, b, e, [&](uint64_t i, uint64_t j) { by_block(t, step, i, j, update); });
      return;
    }
    by_block(t, step, b, e, [&](uint64_t bb, uint64_t ee, uint32_t key) {
      with_weights(t, bb, ee, [&](uint64_t i, uint64_t j) { update(i, j, key); });
    });
  });
}

}  // namespace

void* map_state(uint64_t bytes, const char* what) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    fail(LWO_ERR_OUT_OF_MEMORY, "%s: cannot map %llu bytes", what,
         static_cast<unsigned long long>(bytes));
  return p;
}

void unmap_state(void* p, uint64_t bytes) noexcept {
  if (p) munmap(p, bytes);
}

void adamw_step(const Tensor& t, const AdamW& h, uint64_t step, Workers& workers) {
  check_tensor(t, step, true, "adamw");
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  const AdamConsts c0{static_cast<float>(1 - h.lr * h.weight_decay), static_cast<float>(h.beta1),
                      static_cast<float>(1 - h.beta1), static_cast<float>(h.beta2),
                      static_cast<float>(1 - h.beta2), static_cast<float>(h.lr / bc1),
                      static_cast<float>(1 / std::sqrt(bc2)), static_cast<float>(h.eps),
                      t.grad_scale, 0u};
  const StateKind sk = state_kind(t);
  run_step(t, step, workers, [&](uint64_t i, uint64_t j, uint32_t key) {
    AdamConsts c = c0;
    c.key = key;
    switch (sk) {
      case S_F32: return adam_update<S_F32>(t, i, j, c);
      case S_BF16: return adam_update<S_BF16>(t, i, j, c);
      default: return adam_update<S_SR>(t, i, j, c);
    }
  });
}

void sgd_step(const Tensor& t, const Sgd& h, uint64_t step, Workers& workers) {
  check_tensor(t, step, false, "sgd");
  const float decay = static_cast<float>(1 - h.lr * h.weight_decay);
  const float mom = static_cast<float>(h.momentum), damp = static_cast<float>(1 - h.dampening);
  const float lr = static_cast<float>(h.lr);
  const bool first = step == 1;
  const float* pin = t.master_in ? t.master_in : t.master;
  const void* min = t.m_in ? t.m_in : t.m;
  const StateKind sk = state_kind(t);
  // The masters and momentum of [i, j) (no weights), in one 2^32 block.
  auto update = [&](uint64_t i, uint64_t j, uint32_t key) {
    auto run = [&](auto s_tag, auto g_tag) {
      constexpr StateKind S = decltype(s_tag)::value;
      constexpr lwo_dtype_t G = decltype(g_tag)::value;
      if (first)
        sgd_range<S, G, true>(t.master, t.m, pin, min, t.grad, i, j, decay, mom, damp, lr,
                              t.grad_scale, key);
      else
        sgd_range<S, G, false>(t.master, t.m, pin, min, t.grad, i, j, decay, mom, damp, lr,
                               t.grad_scale, key);
    };
    auto by_g = [&](auto s_tag) {
      switch (t.grad_dtype) {
        case LWO_DTYPE_BF16: return run(s_tag, std::integral_constant<lwo_dtype_t, LWO_DTYPE_BF16>{});
        case LWO_DTYPE_F16: return run(s_tag, std::integral_constant<lwo_dtype_t, LWO_DTYPE_F16>{});
        default: return run(s_tag, std::integral_constant<lwo_dtype_t, LWO_DTYPE_F32>{});
      }
    };
    switch (sk) {
      case S_F32: return by_g(std::integral_constant<StateKind, S_F32>{});
      case S_BF16: return by_g(std::integral_constant<StateKind, S_BF16>{});
      default: return by_g(std::integral_constant<StateKind, S_SR>{});
    }
  };
  run_step(t, step, workers, update);
}

namespace {
constexpr uint64_t kNormBlock = uint64_t(1) << 14;

template <lwo_dtype_t G>
LWO_VECTOR_LOOP double block_squares(const void* __restrict g, uint64_t b, uint64_t e) {
  double lane[16] = {};
  uint64_t i = b;
  for (; i + 16 <= e; i += 16)
    for (int j = 0; j < 16; ++j) {
      const double x = load_f32(g, G, i + j);
      lane[j] += x * x;
    }
  for (int j = 0; i < e; ++i, ++j) {
    const double x = load_f32(g, G, i);
    lane[j] += x * x;
  }
  double s = 0;
  for (int j = 0; j < 16; ++j) s += lane[j];
  return s;
}
}  // namespace

double sum_squares(const void* grad, lwo_dtype_t dtype, uint64_t n, Workers& workers) {
  if (n == 0) return 0;
  const uint64_t n_blocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> part(n_blocks, 0.0);
  workers.run(n_blocks, 1, 8, [&](uint64_t b, uint64_t e) {
    for (uint64_t k = b; k < e; ++k) {
      const uint64_t lo = k * kNormBlock, hi = std::min(n, lo + kNormBlock);
      part[k] = dtype == LWO_DTYPE_BF16  ? block_squares<LWO_DTYPE_BF16>(grad, lo, hi)
                : dtype == LWO_DTYPE_F16 ? block_squares<LWO_DTYPE_F16>(grad, lo, hi)
                                         : block_squares<LWO_DTYPE_F32>(grad, lo, hi);
    }
  });
  double s = 0;
  for (double x : part) s += x;
  return s;
}

float clip_scale(double norm, double max_norm) {
  const double c = max_norm / (norm + 1e-6);
  return c < 1 ? static_cast<float>(c) : 1.0f;
}

const char* vector_level() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__ELF__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3";
#endif
  return "baseline";
}

void first_touch(float* dst, const void* src, lwo_dtype_t dtype, uint64_t n, void* const* state,
                 uint32_t n_state, lwo_dtype_t state_dtype, Workers& workers) {
  const size_t ss = state_dtype == LWO_DTYPE_BF16 ? 2 : 4;
  workers.run(n, kAlign, kMinPart, [&](uint64_t b, uint64_t e) {
    for (uint64_t i = b; i < e; ++i) dst[i] = src ? load_f32(src, dtype, i) : 0.0f;
    for (uint32_t k = 0; k < n_state; ++k)
      if (state[k]) std::memset(static_cast<uint8_t*>(state[k]) + b * ss, 0, (e - b) * ss);
  });
}

}  // namespace optim
}  // namespace lwo
