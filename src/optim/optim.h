// Optimizer steps on host memory: a fused AdamW and SGD with momentum over
// one tensor's parameters, f32 master weights, state in f32 or bf16 (rounded
// to nearest even, or stochastically from a counter-based random stream),
// gradients read in their wire dtype and scaled (the clipping coefficient),
// the updated weights written back rounded to the pool's dtype and/or as an
// fp8 block-128 copy (Tensor::quant_format). Host only, run on a Workers set
// (workers.h: fixed parts per thread, NUMA placement);
// the loops are built once per x86-64 level (AVX-512, AVX2, baseline) and
// one is picked at load time (LWO_VECTOR_LOOP, src/common/dtype.h).
//
// Every result is a function of the element's own inputs (and, for the
// stochastic rounding, of its index, the tensor's key and the step; for an
// fp8 code or scale, of its 128 x 128 block's, a block never split between
// threads): the number of threads and the parts they take change no bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "lwo.h"
#include "workers.h"

namespace lwo {
namespace optim {

// As PyTorch's AdamW: p *= 1 - lr wd; m = b1 m + (1 - b1) g; v = b2 v + (1 -
// b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
struct AdamW {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

// p *= 1 - lr wd; b = momentum b + (1 - dampening) g (b = g on step 1);
// p -= lr b.
struct Sgd {
  double lr = 1e-2, momentum = 0.9, dampening = 0, weight_decay = 0;
};

// One tensor's parameters and state. The step reads master_in / m_in / v_in
// (null: the outputs, updated in place) and writes master / m / v; `weights`
// (may be null) receives each updated master rounded to `weight_dtype` (f32,
// bf16 or f16, nearest even); `grad` holds n elements of `grad_dtype` (f32,
// bf16, f16), each multiplied by `grad_scale` before use (1: exactly the
// gradient). State is `state_dtype` (f32 or bf16); bf16 state is rounded to
// nearest even, or, with `stochastic`, stochastically (below).
struct Tensor {
  uint64_t n = 0;
  float* master = nullptr;
  void* m = nullptr;  // AdamW: first moment; SGD: the momentum buffer
  void* v = nullptr;  // AdamW: second moment
  const float* master_in = nullptr;
  const void* m_in = nullptr;
  const void* v_in = nullptr;
  lwo_dtype_t state_dtype = LWO_DTYPE_F32;
  bool stochastic = false;
  uint64_t key = 0;  // the tensor's random stream (stochastic rounding)
  const void* grad = nullptr;
  lwo_dtype_t grad_dtype = LWO_DTYPE_F32;
  float grad_scale = 1.0f;
  void* weights = nullptr;
  lwo_dtype_t weight_dtype = LWO_DTYPE_BF16;
  // The quantized transport copy (LWO_QUANT_NONE: none). With
  // LWO_QUANT_FP8_E4M3_BLOCK128 (the only format written here), the tensor
  // is a rows x cols matrix, row-major (rows * cols == n), and the step
  // writes from the updated masters exactly what quant::quantize writes
  // from them: `codes`, rows x cols e4m3 codes (row-major: the data of
  // quant::Layout, at the record's offset 0), and `scales`,
  // ceil(rows / 128) x ceil(cols / 128) f32 scales (row-major: at the
  // record's scale_offset); the record's padding is not written. Each block's
  // scale is quant::fp8_scale(amax) (the smallest power of two with
  // amax / scale <= 464) and each code quant::e4m3_code (exact x / scale
  // rounded to nearest even, saturating at 448; src/quant/codec.h). Fused:
  // the tensor is taken in bands of 128 rows (one block row), each band in
  // tiles of 128 rows x up to kTileCols columns; a tile's masters are
  // updated (and `weights` written) in chunks of its rows, each chunk's
  // blocks' amax folded in and its codes written under the scale the record
  // held while the chunk is in the L1 cache; then the tile's scales, and the
  // codes again of the blocks whose scale moved: one pass over the masters
  // and state. The scales are read before they are written (a record whose
  // scales are not fp8 scales only costs the second pass).
  // The parts a Workers set gives its threads are whole bands. A block with
  // a NaN or infinite updated master (quantize would refuse it) gets the
  // scale NaN and every code 0x7f (NaN): it dequantizes to NaN; the masters
  // and state are updated as ever. `weights` may be written too.
  lwo_quant_format_t quant_format = LWO_QUANT_NONE;
  int64_t rows = 0, cols = 0;
  uint8_t* codes = nullptr;
  float* scales = nullptr;
};

// Columns of the tile the fused fp8 write updates and encodes: 32 blocks,
// 2 MiB of f32 masters for a full tile of 128 rows (the L2 of a core on the
// hosts measured: 1-2 MiB). Wider tiles ran faster on the dev host (rows of
// 16 KiB per array keep the prefetchers' runs long; the fused step over the
// bf16 write's time was 1.68 at 1024 columns, 1.32 at 2048, 1.28 at 4096,
// with an encoder since made cheaper).
constexpr uint64_t kTileCols = 4096;

// Stochastic rounding of bf16 state. The random source is a counter-based
// hash, not a generator with state: for element i of a tensor with key K at
// step s, the 32 bits are mix32(uint32(i) ^ k) with k = low 32 bits of
// mix64(K ^ mix64(s ^ (i >> 32) << 40)) (mix64 is splitmix64's finaliser,
// mix32 the "lowbias32" finaliser, both below); m takes the low 16 bits, v
// the high 16. x rounds to bf16 by adding the 16 bits to x's f32 bits below
// the bf16 mantissa and truncating, so it rounds up with probability equal
// to its distance from the lower neighbour (NaN and infinity stay as they
// are). The same seed gives the same bits on every machine and any threads.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}
inline uint32_t step_key(uint64_t key, uint64_t step, uint64_t hi) {
  return static_cast<uint32_t>(mix64(key ^ mix64(step ^ (hi << 40))));
}
inline uint16_t f32_to_bf16_stochastic(float f, uint32_t r16) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return static_cast<uint16_t>((u >> 16) | ((u & 0xffffu) ? 0x40u : 0));
  return static_cast<uint16_t>((u + (r16 & 0xffffu)) >> 16);
}

// A tensor key for (seed, layer, tensor): the caller's seed spread over the
// tensors so that no two share a stream.
inline uint64_t tensor_key(uint64_t seed, uint32_t layer, uint32_t tensor) {
  return mix64(seed ^ mix64((uint64_t(layer) << 20) ^ tensor ^ 0x6f7074696d));
}

// Step `step` (1 for the first) over the tensor on `workers`.
// LWO_ERR_INVALID_ARGUMENT for a step of 0, a dtype outside those above, a
// missing buffer, a quantized format other than LWO_QUANT_NONE and
// LWO_QUANT_FP8_E4M3_BLOCK128, or a quantized copy whose rows x cols is not
// n, whose rows or cols are below 1 or of 2^31 or more, or that lacks
// `codes` or `scales` (codes or scales without a format, too); each message
// names the call ("adamw", "sgd") and the value.
void adamw_step(const Tensor& t, const AdamW& h, uint64_t step, Workers& workers);
void sgd_step(const Tensor& t, const Sgd& h, uint64_t step, Workers& workers);

// The sum of the squares of n gradient elements in f64: blocks of 2^14
// elements, each summed in 16 lanes then in lane order, the blocks' sums
// added in block order, so any threads give the same bits.
double sum_squares(const void* grad, lwo_dtype_t dtype, uint64_t n, Workers& workers);

// PyTorch's clip_grad_norm_: min(1, max_norm / (norm + 1e-6)) in f32.
float clip_scale(double norm, double max_norm);

// The loop the runtime dispatch picked on this machine: "x86-64-v4"
// (AVX-512), "x86-64-v3" (AVX2) or "baseline".
const char* vector_level();

// Fills `n` floats of dst from `src` in `dtype` (the masters from the pool's
// weights), and zeroes `state_bytes` bytes of each of the `n_state` state
// buffers, by the partition `workers` uses for the steps, so that each page
// is first touched by the thread that will update it.
void first_touch(float* dst, const void* src, lwo_dtype_t dtype, uint64_t n, void* const* state,
                 uint32_t n_state, lwo_dtype_t state_dtype, Workers& workers);

// Anonymous memory for masters and state: no page exists until a worker
// first touches it (first_touch). LWO_ERR_OUT_OF_MEMORY naming `what` if the
// mapping fails.
void* map_state(uint64_t bytes, const char* what);
void unmap_state(void* p, uint64_t bytes) noexcept;
// The partition every step uses: parts aligned to 4096 elements (whole
// pages of f32 and bf16), at least 2^15 elements each; with a quantized
// copy, parts of whole bands (128 x cols elements) instead.
constexpr uint64_t kAlign = 4096;
constexpr uint64_t kMinPart = uint64_t(1) << 15;

}  // namespace optim
}  // namespace lwo
