/* Training steps of a chain of linear layers whose weights live in a pinned
 * pool. Each step streams the layers through a ring of depth 2 with one
 * schedule, forward (layers 0 to 7) and then backward (7 to 0), all on one
 * compute stream. In the backward pass each layer's weight gradients are
 * written into a staging slot in bf16 (the layer's dtype) and sent to bf16
 * host buffers before its input
 * gradient is computed. After the fence, an SGD update is written into the
 * pool, each changed layer is declared with lwo_pool_layer_changed, and the
 * sums are zeroed for the next step.
 *
 * The check: every step's host gradients are compared with a CPU reference
 * computed from the pool's weights of that step (so a step that ran on the
 * previous step's weights, left in a slot, would fail it), and the ring's
 * and the gradient set's counts are compared with what the schedule implies.
 *
 * Build: cc -std=c11 train_step.c $(pkg-config --cflags --libs lwo) -lcudart
 *        (the CUDA runtime makes the compute stream and the activation
 *        buffers; add the CUDA toolkit's include and library directories
 *        where they are not on the compiler's default paths)
 * Run:   ./a.out */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <lwo.h>

#define EXAMPLE_PREFIX "train_step"
#include "common.h"

enum { N_LAYERS = 8, DIM = 256, TOKENS = 128, DEPTH = 2, N_STEPS = 3 };
/* Large enough that every update moves the bf16 weights by several units in
 * the last place. */
static const float LEARNING_RATE = 0.1f;
/* The largest relative (L2) difference accepted between a gradient and its
 * CPU reference: both round each activation to bf16, but sum in another
 * order. */
static const double TOLERANCE = 1e-2;

static float round_bf16(float f) { return from_bf16(to_bf16(f)); }

/* The CPU reference of one step, from the pool's current weights: the same
 * forward and backward passes as the GPU's, rounding activations and input
 * gradients to bf16 where the GPU stores them in bf16, and leaving weight
 * gradients in f32. x: [N_LAYERS + 1][TOKENS * DIM], x[0] given. */
static void reference_step(lwo_pool* pool, float* x[N_LAYERS + 1], const float* dy_last,
                           float* dy, float* dx, float* gw[N_LAYERS], float* gb[N_LAYERS]) {
  const uint16_t* w[N_LAYERS];
  const uint16_t* b[N_LAYERS];
  int l, t, i, o;
  for (l = 0; l < N_LAYERS; ++l) {
    void* p = NULL;
    LWO_CHECK(lwo_pool_tensor_host(pool, (uint32_t)l, "weight", &p, NULL));
    w[l] = (const uint16_t*)p;
    LWO_CHECK(lwo_pool_tensor_host(pool, (uint32_t)l, "bias", &p, NULL));
    b[l] = (const uint16_t*)p;
  }
  for (l = 0; l < N_LAYERS; ++l) /* y = x W^T + b */
    for (t = 0; t < TOKENS; ++t)
      for (o = 0; o < DIM; ++o) {
        double acc = 0.0;
        for (i = 0; i < DIM; ++i) acc += (double)x[l][t * DIM + i] * from_bf16(w[l][o * DIM + i]);
        x[l + 1][t * DIM + o] = round_bf16((float)acc + from_bf16(b[l][o]));
      }
  memcpy(dy, dy_last, sizeof(float) * TOKENS * DIM);
  for (l = N_LAYERS - 1; l >= 0; --l) {
    for (o = 0; o < DIM; ++o) { /* dW = dy^T x, db = sum of dy over tokens */
      double sb = 0.0;
      for (i = 0; i < DIM; ++i) {
        double acc = 0.0;
        for (t = 0; t < TOKENS; ++t) acc += (double)dy[t * DIM + o] * x[l][t * DIM + i];
        gw[l][o * DIM + i] = (float)acc;
      }
      for (t = 0; t < TOKENS; ++t) sb += dy[t * DIM + o];
      gb[l][o] = (float)sb;
    }
    if (l == 0) break;
    for (t = 0; t < TOKENS; ++t) /* dx = dy W */
      for (i = 0; i < DIM; ++i) {
        double acc = 0.0;
        for (o = 0; o < DIM; ++o) acc += (double)dy[t * DIM + o] * from_bf16(w[l][o * DIM + i]);
        dx[t * DIM + i] = round_bf16((float)acc);
      }
    memcpy(dy, dx, sizeof(float) * TOKENS * DIM);
  }
}


/* ||a - b|| / ||b|| over n elements. */
static double relative_error(const float* a, const float* b, uint64_t n) {
  double d = 0.0, r = 0.0;
  uint64_t i;
  for (i = 0; i < n; ++i) {
    d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    r += (double)b[i] * b[i];
  }
  return r > 0.0 ? root(d / r) : root(d);
}

int main(void) {
  static const char* const names[2] = {"weight", "bias"};
  lwo_engine* engine = NULL;
  lwo_pool* pool = NULL;
  lwo_ring* ring = NULL;
  lwo_schedule* sched = NULL;
  lwo_grads* grads = NULL;
  lwo_tensor_desc tensors[2];
  lwo_layer_desc layers[N_LAYERS];
  uint32_t order[2 * N_LAYERS];
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  lwo_grads_config grads_config = LWO_GRADS_CONFIG_INIT;
  lwo_linear_desc lin = LWO_LINEAR_DESC_INIT;
  lwo_ring_stats ring_stats;
  lwo_grads_stats grads_stats;
  cudaStream_t stream = NULL;
  void* x[N_LAYERS + 1]; /* activations x[0..N_LAYERS], kept for the backward pass */
  void* dy_last = NULL;  /* the loss gradient: dy of the last layer */
  void* dy[2];           /* ping-pong: dx of one layer is dy of the layer below */
  const size_t act_bytes = (size_t)TOKENS * DIM * 2; /* [TOKENS, DIM] bf16 */
  const size_t act_n = (size_t)TOKENS * DIM;
  uint16_t* host;
  float* ref_x[N_LAYERS + 1];
  float* grad_f32; /* one host gradient, widened from bf16 for the comparison */
  float *ref_dy_last, *ref_dy, *ref_dx, *ref_gw[N_LAYERS], *ref_gb[N_LAYERS];
  uint64_t rng = 1, k;
  uint32_t l, step;

  LWO_CHECK(lwo_engine_create(NULL, &engine)); /* device 0 */
  CUDA_CHECK(cudaSetDevice(0));                /* the caller's buffers, same device */
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  /* Every layer: "weight" [DIM (out), DIM (in)] and "bias" [DIM], bf16. */
  tensors[0] = tensor_desc("weight", LWO_DTYPE_BF16, DIM, DIM);
  tensors[1] = tensor_desc("bias", LWO_DTYPE_BF16, DIM, 0);
  for (l = 0; l < N_LAYERS; ++l) {
    layers[l].tensors = tensors;
    layers[l].n_tensors = 2;
    layers[l].next = NULL;           /* no extensions */
    order[l] = l;                    /* forward: 0 .. N_LAYERS-1 */
    order[2 * N_LAYERS - 1 - l] = l; /* then backward: N_LAYERS-1 .. 0 */
  }
  LWO_CHECK(lwo_pool_create_pinned(engine, layers, N_LAYERS, NULL, &pool));
  for (l = 0; l < N_LAYERS; ++l) { /* weights and biases within +-0.1 */
    void* p = NULL;
    uint64_t bytes = 0;
    LWO_CHECK(lwo_pool_tensor_host(pool, l, "weight", &p, &bytes));
    for (k = 0; k < bytes / 2; ++k) ((uint16_t*)p)[k] = to_bf16(uniform(&rng, 0.1f));
    LWO_CHECK(lwo_pool_tensor_host(pool, l, "bias", &p, &bytes));
    for (k = 0; k < bytes / 2; ++k) ((uint16_t*)p)[k] = to_bf16(uniform(&rng, 0.1f));
  }

  ring_config.depth = DEPTH;
  LWO_CHECK(lwo_ring_create(pool, &ring_config, &ring));
  LWO_CHECK(lwo_schedule_create(ring, order, 2 * N_LAYERS, &sched));
  /* Every layer trainable (NULL mask); gradients in each tensor's dtype
   * (bf16) on the wire and in host memory, the default. */
  LWO_CHECK(lwo_grads_create(pool, NULL, &grads_config, &grads));

  lin.dtype = LWO_DTYPE_BF16;
  lin.flags = LWO_LINEAR_BIAS;
  lin.in_features = DIM;
  lin.out_features = DIM;

  for (l = 0; l <= N_LAYERS; ++l) CUDA_CHECK(cudaMalloc(&x[l], act_bytes));
  CUDA_CHECK(cudaMalloc(&dy_last, act_bytes));
  CUDA_CHECK(cudaMalloc(&dy[0], act_bytes));
  CUDA_CHECK(cudaMalloc(&dy[1], act_bytes));

  /* The reference's buffers. */
  for (l = 0; l <= N_LAYERS; ++l) ref_x[l] = (float*)malloc(act_n * sizeof(float));
  for (l = 0; l < N_LAYERS; ++l) {
    ref_gw[l] = (float*)malloc((size_t)DIM * DIM * sizeof(float));
    ref_gb[l] = (float*)malloc((size_t)DIM * sizeof(float));
    if (!ref_gw[l] || !ref_gb[l]) return 1;
  }
  ref_dy_last = (float*)malloc(act_n * sizeof(float));
  ref_dy = (float*)malloc(act_n * sizeof(float));
  ref_dx = (float*)malloc(act_n * sizeof(float));
  grad_f32 = (float*)malloc((size_t)DIM * DIM * sizeof(float));
  host = (uint16_t*)malloc(act_bytes);
  if (!host || !ref_dy_last || !ref_dy || !ref_dx || !grad_f32) return 1;
  for (l = 0; l <= N_LAYERS; ++l)
    if (!ref_x[l]) return 1;

  /* The inputs and the loss gradient, random, on the device and (the same
   * bf16 values) in the reference. */
  for (k = 0; k < act_n; ++k) host[k] = to_bf16(uniform(&rng, 1.0f));
  for (k = 0; k < act_n; ++k) ref_x[0][k] = from_bf16(host[k]);
  CUDA_CHECK(cudaMemcpyAsync(x[0], host, act_bytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (k = 0; k < act_n; ++k) host[k] = to_bf16(uniform(&rng, 0.01f));
  for (k = 0; k < act_n; ++k) ref_dy_last[k] = from_bf16(host[k]);
  CUDA_CHECK(cudaMemcpyAsync(dy_last, host, act_bytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  for (step = 0; step < N_STEPS; ++step) {
    lwo_layer_view view = LWO_LAYER_VIEW_INIT; /* size set: the library fills it */
    lwo_status_t s;
    uint32_t pos = 0;
    double worst = 0.0;

    /* One pass: layers 0 .. N_LAYERS-1, then N_LAYERS-1 .. 0, all on `stream`.
     * (A real model puts its activation functions and its loss around these
     * calls; this chain of linear layers has none.) */
    LWO_CHECK(lwo_schedule_reset(sched, stream));
    while ((s = lwo_schedule_next(sched, stream, &view)) == LWO_OK) {
      const void* w = view.tensors[0]; /* "weight" in its slot */
      const void* b = view.tensors[1]; /* "bias" */
      l = view.layer;
      if (pos < N_LAYERS) {
        /* Forward: x[l+1] = x[l] W^T + b. */
        LWO_CHECK(lwo_linear_forward(engine, &lin, TOKENS, x[l], w, b, x[l + 1], stream));
      } else {
        /* Backward position j: layer N_LAYERS-1-j. */
        uint32_t j = pos - N_LAYERS;
        const void* dy_in = j == 0 ? dy_last : dy[(j - 1) % 2];
        lwo_layer_view g = LWO_LAYER_VIEW_INIT;
        /* Weight gradients first, into a staging slot, in the slot's wire
         * dtype (bf16 here), and sent at once: their copy to host memory
         * runs while dx is computed. */
        LWO_CHECK(lwo_grads_begin(grads, l, stream, &g));
        LWO_CHECK(lwo_linear_backward(engine, &lin, TOKENS, x[l], dy_in, w, NULL,
                                      g.tensors[0], g.tensors[1], g.tensor_dtypes[0], stream));
        LWO_CHECK(lwo_grads_end(grads, l, stream));
        /* Then dx, the dy of the layer below (layer 0 has none below). */
        if (l > 0)
          LWO_CHECK(lwo_linear_backward(engine, &lin, TOKENS, x[l], dy_in, w, dy[j % 2],
                                        NULL, NULL, LWO_DTYPE_F32, stream));
      }
      /* The next lwo_schedule_next releases layer l on `stream`, after the
       * calls above have read its slot. */
      ++pos;
    }
    if (s != LWO_END) LWO_CHECK(s);

    /* The fence: every gradient ended above is in the host buffers. Layer 0
     * was acquired last and its gradients were ended after that, so every
     * copy of this pass into the ring has finished too: the pool may be
     * written. */
    LWO_CHECK(lwo_grads_wait(grads));

    /* The check, before the update: the pool still holds this step's
     * weights. */
    reference_step(pool, ref_x, ref_dy_last, ref_dy, ref_dx, ref_gw, ref_gb);
    for (l = 0; l < N_LAYERS; ++l) {
      uint32_t t;
      for (t = 0; t < 2; ++t) {
        lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
        uint64_t i, n;
        double e;
        LWO_CHECK(lwo_grads_tensor(grads, l, names[t], &gt));
        n = gt.n_elements;
        EXPECT(gt.dtype == LWO_DTYPE_BF16);
        EXPECT(gt.first_element == 0 && n == (t == 0 ? (uint64_t)DIM * DIM : (uint64_t)DIM));
        for (i = 0; i < n; ++i) grad_f32[i] = from_bf16(((const uint16_t*)gt.data)[i]);
        e = relative_error(grad_f32, t == 0 ? ref_gw[l] : ref_gb[l], n);
        if (!(e <= TOLERANCE)) {
          fprintf(stderr, "train_step: step %u layer %u %s gradient: relative error %.3g "
                  "against the CPU reference (at most %.3g)\n", step, l, names[t], e, TOLERANCE);
          return 1;
        }
        if (e > worst) worst = e;
      }
    }

    /* The optimizer: plain SGD on the pool's host copy. */
    for (l = 0; l < N_LAYERS; ++l) {
      uint32_t t;
      for (t = 0; t < 2; ++t) {
        lwo_grad_tensor gt = LWO_GRAD_TENSOR_INIT;
        const uint16_t* grad;
        void* p = NULL;
        uint16_t* param;
        uint64_t i; /* not sharded: the whole tensor, first element 0 */
        LWO_CHECK(lwo_grads_tensor(grads, l, names[t], &gt));
        grad = (const uint16_t*)gt.data;
        LWO_CHECK(lwo_pool_tensor_host(pool, l, names[t], &p, NULL));
        param = (uint16_t*)p;
        for (i = 0; i < gt.n_elements; ++i)
          param[i] = to_bf16(from_bf16(param[i]) - LEARNING_RATE * from_bf16(grad[i]));
      }
      /* Its host bytes changed: the next stage copies the layer again
       * instead of reusing a slot that holds the old weights. */
      LWO_CHECK(lwo_pool_layer_changed(pool, l));
    }
    /* A new sum for the next step (no memory traffic). */
    LWO_CHECK(lwo_grads_zero(grads));
    printf("step %u: gradients match the CPU reference (largest relative error %.2e)\n", step,
           worst);
  }

  /* Each step stages 16 layers and copies 14: layers 7 and 6 are still in
   * the ring's two slots when the backward pass begins. */
  memset(&ring_stats, 0, sizeof ring_stats);
  ring_stats.size = sizeof ring_stats;
  LWO_CHECK(lwo_ring_get_stats(ring, &ring_stats));
  memset(&grads_stats, 0, sizeof grads_stats);
  grads_stats.size = sizeof grads_stats;
  LWO_CHECK(lwo_grads_get_stats(grads, &grads_stats));
  printf("%llu stages, %llu hits, %llu copies; %llu gradient transfers, %llu added on the host\n",
         (unsigned long long)ring_stats.n_stages, (unsigned long long)ring_stats.n_hits,
         (unsigned long long)ring_stats.n_copies, (unsigned long long)grads_stats.n_transfers,
         (unsigned long long)grads_stats.n_accumulated);
  EXPECT(ring_stats.n_stages == 2 * N_LAYERS * N_STEPS);
  EXPECT(ring_stats.n_hits == 2 * N_STEPS);
  EXPECT(ring_stats.n_copies == (2 * N_LAYERS - 2) * N_STEPS);
  EXPECT(grads_stats.n_transfers == N_LAYERS * N_STEPS);
  /* One gradient per layer per sum: each lands in its zeroed bf16 buffer in
   * place, by DMA, with no host work. */
  EXPECT(grads_stats.n_accumulated == 0);

  CUDA_CHECK(cudaStreamSynchronize(stream));
  LWO_CHECK(lwo_schedule_destroy(sched));
  LWO_CHECK(lwo_ring_destroy(ring));
  LWO_CHECK(lwo_grads_destroy(grads));
  LWO_CHECK(lwo_pool_destroy(pool));
  LWO_CHECK(lwo_engine_destroy(engine));
  for (l = 0; l <= N_LAYERS; ++l) CUDA_CHECK(cudaFree(x[l]));
  CUDA_CHECK(cudaFree(dy_last));
  CUDA_CHECK(cudaFree(dy[0]));
  CUDA_CHECK(cudaFree(dy[1]));
  CUDA_CHECK(cudaStreamDestroy(stream));
  for (l = 0; l <= N_LAYERS; ++l) free(ref_x[l]);
  for (l = 0; l < N_LAYERS; ++l) {
    free(ref_gw[l]);
    free(ref_gb[l]);
  }
  free(ref_dy_last);
  free(grad_f32);
  free(ref_dy);
  free(ref_dx);
  free(host);
  printf("train_step: ok\n");
  return 0;
}
