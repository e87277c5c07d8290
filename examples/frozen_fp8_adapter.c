/* A frozen fp8 base streamed with a trainable adapter beside it (the LoRA
 * pattern). The base is a chain of N_LAYERS linear layers whose weights are
 * quantized on load into a pinned pool (fp8 e4m3, one scale per 128 x 128
 * block: LWO_EXT_TENSOR_QUANT, lwo_pool_write_quantized), half the bytes of
 * bf16 on the link. One schedule streams them forward (0 .. N_LAYERS-1) and
 * back (N_LAYERS-1 .. 0); each lwo_linear_forward / lwo_linear_backward with
 * weight_format set dequantizes the slot on the GPU and runs the GEMM. The
 * adapter, a rank-RANK pair A [RANK, DIM], B [DIM, RANK] on the base's
 * output, stays resident in device memory and is trained: its weight
 * gradients come from lwo_linear_backward like any dense layer's (an
 * optimizer would then update A and B). The base is frozen (by choice: an
 * fp8 block-128 base could train, lwo_optim keeping its f32 masters): the
 * gradient of its input (what an adapter further down would need) flows back
 * through the slots, dx only.
 *
 *   forward   x_{l+1} = x_l W_l^T (l < N_LAYERS), h = x_N A^T, out = x_N + h B^T
 *   backward  with dy = d loss / d out: dB = dy^T h, dh = dy B, dA = dh^T x_N;
 *             g_N = dy, g_l = g_{l+1} W_l (the base's input gradient; the
 *             adapter's own share dh A would be added to g_N in a model)
 *
 * The check: x_N, dA, dB and g_0 against a CPU reference (double sums) on the
 * dequantized weights (lwo_dequantize_host: the values the GPU computes
 * with).
 *
 * Build: cc -std=c11 frozen_fp8_adapter.c $(pkg-config --cflags --libs lwo) -lcudart
 * Run:   ./a.out */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <lwo.h>

#define EXAMPLE_PREFIX "frozen_fp8_adapter"
#include "common.h"

enum { N_LAYERS = 4, DIM = 320, RANK = 16, TOKENS = 96, DEPTH = 2 };
/* Relative L2 error accepted against the CPU reference: the GPU rounds each
 * activation to bf16 and sums in another order. */
static const double TOLERANCE = 2e-2;

/* ||got - want|| / ||want||, got in bf16 (or f32 when f32 is set). */
static double error_of(const void* got, int f32, const double* want, size_t n) {
  double d = 0.0, r = 0.0;
  size_t i;
  for (i = 0; i < n; ++i) {
    const double g = f32 ? (double)((const float*)got)[i] : (double)from_bf16(((const uint16_t*)got)[i]);
    d += (g - want[i]) * (g - want[i]);
    r += want[i] * want[i];
  }
  return r > 0.0 ? root(d / r) : root(d);
}
/* A bf16 device buffer of n values uniform within +-bound, and its values. */
static void* device_bf16(size_t n, float bound, uint64_t* rng, double* values) {
  uint16_t* h = (uint16_t*)malloc(n * 2);
  void* d = NULL;
  size_t i;
  EXPECT(h != NULL);
  for (i = 0; i < n; ++i) {
    h[i] = to_bf16(uniform(rng, bound));
    if (values) values[i] = from_bf16(h[i]);
  }
  CUDA_CHECK(cudaMalloc(&d, n * 2));
  CUDA_CHECK(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice));
  free(h);
  return d;
}
static void* fetch(const void* dev, size_t bytes) {
  void* h = malloc(bytes);
  EXPECT(h != NULL);
  CUDA_CHECK(cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost));
  return h;
}
/* out[r, c] = sum_k a[r * a_r + k * a_k] b[k * b_k + c * b_c], r < rows,
 * c < cols, k < n_k, in double: the three products below, by their strides. */
static void product(const double* a, int a_r, int a_k, const double* b, int b_k, int b_c,
                    double* out, int rows, int cols, int n_k) {
  int r, c, k;
  for (r = 0; r < rows; ++r)
    for (c = 0; c < cols; ++c) {
      double acc = 0.0;
      for (k = 0; k < n_k; ++k) acc += a[r * a_r + k * a_k] * b[k * b_k + c * b_c];
      out[r * cols + c] = acc;
    }
}
/* out[t, o] = sum_i a[t, i] w[o, i] (the layers' x W^T). */
static void matmul_t(const double* a, const double* w, double* out, int t_n, int in, int out_n) {
  product(a, in, 1, w, 1, in, out, t_n, out_n, in);
}
/* out[t, i] = sum_o g[t, o] w[o, i] (dx = dy W). */
static void matmul(const double* g, const double* w, double* out, int t_n, int in, int out_n) {
  product(g, out_n, 1, w, in, 1, out, t_n, in, out_n);
}
/* dw[o, i] = sum_t g[t, o] a[t, i] (dW = dy^T x). */
static void grad_w(const double* g, const double* a, double* dw, int t_n, int in, int out_n) {
  product(g, 1, out_n, a, in, 1, dw, out_n, in, t_n);
}
/* Rounds each of x[0..n) to bf16, as the GPU stores it. */
static void round_bf16(double* x, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i) x[i] = from_bf16(to_bf16((float)x[i]));
}

/* Swaps the buffers *a and *b. */
static void swap_buffers(double** a, double** b) {
  double* t = *a;
  *a = *b;
  *b = t;
}

static double* doubles(size_t n) {
  double* p = (double*)calloc(n, sizeof(double));
  EXPECT(p != NULL);
  return p;
}

int main(void) {
  lwo_engine* engine = NULL;
  lwo_pool* pool = NULL;
  lwo_ring* ring = NULL;
  lwo_schedule* sched = NULL;
  lwo_tensor_quant_ext fp8; /* the base's weights: fp8 e4m3, 128 x 128 block scales */
  lwo_tensor_desc weight;
  lwo_layer_desc layers[N_LAYERS];
  uint32_t order[2 * N_LAYERS];
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  lwo_linear_desc base = LWO_LINEAR_DESC_INIT, lin_a = LWO_LINEAR_DESC_INIT,
                  lin_b = LWO_LINEAR_DESC_INIT;
  lwo_tensor_info info = LWO_TENSOR_INFO_INIT;
  lwo_ring_stats stats;
  lwo_layer_view v = LWO_LAYER_VIEW_INIT;
  lwo_quant_desc qd = LWO_QUANT_DESC_INIT;
  cudaStream_t stream = NULL;
  void *x[2], *g[2], *xn, *h, *dy, *dh, *a, *b, *da, *db;
  const size_t act = (size_t)TOKENS * DIM;
  double *rx, *rnext, *rw[N_LAYERS], *ra, *rb, *rh, *rdy, *rdh, *rda, *rdb, *rg, *rgn;
  float* wf;
  uint16_t* wq;
  uint64_t rng = 7;
  uint32_t l;
  size_t i;
  int cur;

  LWO_CHECK(lwo_engine_create(NULL, &engine));
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  /* The base: every layer one "weight" [DIM, DIM], logical dtype bf16,
   * stored as fp8 with its scales (the record holds both: one copy). */
  memset(&fp8, 0, sizeof fp8);
  fp8.header.type = LWO_EXT_TENSOR_QUANT;
  fp8.format = LWO_QUANT_FP8_E4M3_BLOCK128;
  weight = tensor_desc("weight", LWO_DTYPE_BF16, DIM, DIM);
  weight.next = &fp8;
  for (l = 0; l < N_LAYERS; ++l) {
    layers[l].tensors = &weight;
    layers[l].n_tensors = 1;
    layers[l].next = NULL;
    order[l] = l;
    order[2 * N_LAYERS - 1 - l] = l;
  }
  LWO_CHECK(lwo_pool_create_pinned(engine, layers, N_LAYERS, NULL, &pool));
  LWO_CHECK(lwo_pool_tensor_info(pool, 0, 0, &info));
  EXPECT(info.quant_format == LWO_QUANT_FP8_E4M3_BLOCK128);
  EXPECT(info.bytes < (uint64_t)DIM * DIM * 2); /* fewer bytes than bf16 */

  /* Quantized on load from f32 weights (multithreaded on the host); the
   * reference keeps their dequantized values. */
  wf = (float*)malloc(sizeof(float) * DIM * DIM);
  wq = (uint16_t*)malloc(2 * DIM * DIM);
  EXPECT(wf != NULL && wq != NULL);
  qd.format = LWO_QUANT_FP8_E4M3_BLOCK128;
  qd.dtype = LWO_DTYPE_BF16;
  qd.rows = DIM;
  qd.cols = DIM;
  for (l = 0; l < N_LAYERS; ++l) {
    void* q = NULL;
    uint64_t qbytes = 0;
    for (i = 0; i < (size_t)DIM * DIM; ++i) wf[i] = uniform(&rng, 0.0968f); /* ~ sqrt(3 / DIM) */
    LWO_CHECK(lwo_pool_write_quantized(pool, l, "weight", wf, LWO_DTYPE_F32,
                                       sizeof(float) * DIM * DIM, 0));
    LWO_CHECK(lwo_pool_tensor_host(pool, l, "weight", &q, &qbytes));
    LWO_CHECK(lwo_dequantize_host(&qd, q, qbytes, wq, 2 * DIM * DIM, 0));
    rw[l] = doubles((size_t)DIM * DIM);
    for (i = 0; i < (size_t)DIM * DIM; ++i) rw[l][i] = from_bf16(wq[i]);
  }


  /* Activations, the adapter (resident, trainable) and its gradients. */
  rx = doubles(act);
  rnext = doubles(act);
  x[0] = device_bf16(act, 1.0f, &rng, rx);
  CUDA_CHECK(cudaMalloc(&x[1], act * 2));
  CUDA_CHECK(cudaMalloc(&g[0], act * 2));
  CUDA_CHECK(cudaMalloc(&g[1], act * 2));
  ra = doubles((size_t)RANK * DIM);
  rb = doubles((size_t)DIM * RANK);
  a = device_bf16((size_t)RANK * DIM, 0.1f, &rng, ra);
  b = device_bf16((size_t)DIM * RANK, 0.1f, &rng, rb);
  rdy = doubles(act);
  dy = device_bf16(act, 0.1f, &rng, rdy);
  CUDA_CHECK(cudaMalloc(&h, (size_t)TOKENS * RANK * 2));
  CUDA_CHECK(cudaMalloc(&dh, (size_t)TOKENS * RANK * 2));
  CUDA_CHECK(cudaMalloc(&da, sizeof(float) * RANK * DIM));
  CUDA_CHECK(cudaMalloc(&db, sizeof(float) * DIM * RANK));

  base.in_features = DIM;
  base.out_features = DIM;
  base.weight_format = LWO_QUANT_FP8_E4M3_BLOCK128; /* W is the slot's fp8 tensor */
  lin_a.in_features = DIM;
  lin_a.out_features = RANK;
  lin_b.in_features = RANK;
  lin_b.out_features = DIM;

  ring_config.depth = DEPTH;
  LWO_CHECK(lwo_ring_create(pool, &ring_config, &ring));
  LWO_CHECK(lwo_schedule_create(ring, order, 2 * N_LAYERS, &sched));

  /* Forward through the streamed base. */
  cur = 0;
  for (l = 0; l < N_LAYERS; ++l) {
    LWO_CHECK(lwo_schedule_next(sched, stream, &v));
    EXPECT(v.layer == l);
    LWO_CHECK(lwo_linear_forward(engine, &base, TOKENS, x[cur], v.tensors[0], NULL, x[1 - cur],
                                 stream));
    cur = 1 - cur;
  }
  /* The adapter on x_N: h = x_N A^T; its weight gradients: dB = dy^T h,
   * dh = dy B, dA = dh^T x_N. */
  xn = x[cur];
  LWO_CHECK(lwo_linear_forward(engine, &lin_a, TOKENS, xn, a, NULL, h, stream));
  LWO_CHECK(lwo_linear_backward(engine, &lin_b, TOKENS, h, dy, b, dh, db, NULL, LWO_DTYPE_F32,
                                stream));
  LWO_CHECK(lwo_linear_backward(engine, &lin_a, TOKENS, xn, dh, a, NULL, da, NULL,
                                LWO_DTYPE_F32, stream));
  /* Backward through the streamed base, input gradients only. */
  CUDA_CHECK(cudaMemcpyAsync(g[0], dy, act * 2, cudaMemcpyDeviceToDevice, stream));
  cur = 0;
  for (l = N_LAYERS; l-- > 0;) {
    LWO_CHECK(lwo_schedule_next(sched, stream, &v));
    EXPECT(v.layer == l);
    LWO_CHECK(lwo_linear_backward(engine, &base, TOKENS, NULL, g[cur], v.tensors[0], g[1 - cur],
                                  NULL, NULL, LWO_DTYPE_F32, stream));
    cur = 1 - cur;
  }
  EXPECT(lwo_schedule_next(sched, stream, &v) == LWO_END);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  LWO_CHECK(lwo_engine_check(engine));

  /* The CPU reference: forward (rounding each activation to bf16 as the GPU
   * stores it), the adapter's gradients, the base's input gradient. */
  for (l = 0; l < N_LAYERS; ++l) {
    matmul_t(rx, rw[l], rnext, TOKENS, DIM, DIM);
    round_bf16(rnext, act);
    swap_buffers(&rx, &rnext);
  }
  rh = doubles((size_t)TOKENS * RANK);
  rdh = doubles((size_t)TOKENS * RANK);
  rda = doubles((size_t)RANK * DIM);
  rdb = doubles((size_t)DIM * RANK);
  matmul_t(rx, ra, rh, TOKENS, DIM, RANK);
  round_bf16(rh, (size_t)TOKENS * RANK);
  grad_w(rdy, rh, rdb, TOKENS, RANK, DIM);
  matmul(rdy, rb, rdh, TOKENS, RANK, DIM);
  round_bf16(rdh, (size_t)TOKENS * RANK);
  grad_w(rdh, rx, rda, TOKENS, DIM, RANK);
  rg = doubles(act);
  rgn = doubles(act);
  memcpy(rg, rdy, sizeof(double) * act);
  for (l = N_LAYERS; l-- > 0;) {
    matmul(rg, rw[l], rgn, TOKENS, DIM, DIM);
    round_bf16(rgn, act);
    swap_buffers(&rg, &rgn);
  }
  {
    void* got_x = fetch(xn, act * 2);
    void* got_g = fetch(g[cur], act * 2);
    void* got_da = fetch(da, sizeof(float) * RANK * DIM);
    void* got_db = fetch(db, sizeof(float) * DIM * RANK);
    const double ex = error_of(got_x, 0, rx, act), eg = error_of(got_g, 0, rg, act);
    const double ea = error_of(got_da, 1, rda, (size_t)RANK * DIM);
    const double eb = error_of(got_db, 1, rdb, (size_t)DIM * RANK);
    printf("frozen_fp8_adapter: base output error %.2e, input gradient %.2e, adapter dA %.2e, "
           "dB %.2e (tolerance %.0e)\n",
           ex, eg, ea, eb, TOLERANCE);
    EXPECT(ex < TOLERANCE && eg < TOLERANCE && ea < TOLERANCE && eb < TOLERANCE);
    free(got_x);
    free(got_g);
    free(got_da);
    free(got_db);
  }
  stats.size = sizeof stats;
  LWO_CHECK(lwo_ring_get_stats(ring, &stats));
  printf("frozen_fp8_adapter: %u layers of %llu quantized bytes (bf16: %llu); %llu bytes "
         "copied in %llu copies, %llu hits\n",
         (unsigned)N_LAYERS, (unsigned long long)info.bytes,
         (unsigned long long)DIM * DIM * 2, (unsigned long long)stats.bytes_copied,
         (unsigned long long)stats.n_copies, (unsigned long long)stats.n_hits);
  EXPECT(stats.n_stages == 2 * N_LAYERS);

  LWO_CHECK(lwo_schedule_destroy(sched));
  LWO_CHECK(lwo_ring_destroy(ring));
  LWO_CHECK(lwo_pool_destroy(pool));
  CUDA_CHECK(cudaFree(x[0]));
  CUDA_CHECK(cudaFree(x[1]));
  CUDA_CHECK(cudaFree(g[0]));
  CUDA_CHECK(cudaFree(g[1]));
  CUDA_CHECK(cudaFree(a));
  CUDA_CHECK(cudaFree(b));
  CUDA_CHECK(cudaFree(h));
  CUDA_CHECK(cudaFree(dh));
  CUDA_CHECK(cudaFree(dy));
  CUDA_CHECK(cudaFree(da));
  CUDA_CHECK(cudaFree(db));
  CUDA_CHECK(cudaStreamDestroy(stream));
  LWO_CHECK(lwo_engine_destroy(engine));
  for (l = 0; l < N_LAYERS; ++l) free(rw[l]);
  free(rx);
  free(rnext);
  free(ra);
  free(rb);
  free(rh);
  free(rdh);
  free(rda);
  free(rdb);
  free(rdy);
  free(rg);
  free(rgn);
  free(wf);
  free(wq);
  printf("frozen_fp8_adapter: ok\n");
  return 0;
}
