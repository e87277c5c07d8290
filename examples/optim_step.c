/* Training steps with the host optimizer (lwo_optim, since 0.4.0). Four
 * layers of bf16 weights live in a pinned pool; each step stages them for
 * the forward pass, then in reverse order for the backward pass, whose
 * weight gradients (here: known values copied into the gradient slots, where
 * a real backward would run its kernels) go to host memory through a
 * gradient set. lwo_optim_step, called once the backward is enqueued,
 * updates each layer with AdamW as soon as its gradients have landed, while
 * the GPU works on; the next forward's lwo_ring_stage of a layer waits for
 * that layer's update only, and copies the new bytes.
 *
 * The check: the optimizer's f32 masters follow a double-precision AdamW on
 * the same gradients, and the pool holds their bf16 rounding.
 *
 * Build: cc -std=c11 optim_step.c $(pkg-config --cflags --libs lwo) -lcudart -lm
 * Run:   ./a.out */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <lwo.h>

#define EXAMPLE_PREFIX "optim_step"
#include "common.h"

enum { N_LAYERS = 4, ROWS = 128, COLS = 64, N = ROWS * COLS, N_STEPS = 5 };


int main(void) {
  static double p[N_LAYERS][N], m[N_LAYERS][N], v[N_LAYERS][N];
  static uint16_t grad[N_LAYERS][N], w[N];
  static float master[N];
  uint64_t rng = 42;
  lwo_engine* engine = NULL;
  lwo_pool* pool = NULL;
  lwo_ring* ring = NULL;
  lwo_grads* grads = NULL;
  lwo_optim* optim = NULL;
  lwo_tensor_desc t[N_LAYERS];
  lwo_layer_desc layers[N_LAYERS];
  lwo_ring_config rc = LWO_RING_CONFIG_INIT;
  lwo_optim_config oc = LWO_OPTIM_CONFIG_INIT;
  lwo_optim_step_params hp = LWO_OPTIM_STEP_PARAMS_INIT;
  cudaStream_t stream;
  uint64_t step;
  int l, i;

  LWO_CHECK(lwo_engine_create(NULL, &engine));
  for (l = 0; l < N_LAYERS; ++l) {
    t[l] = tensor_desc("weight", LWO_DTYPE_BF16, ROWS, COLS);
    layers[l].tensors = &t[l];
    layers[l].n_tensors = 1;
    layers[l].next = NULL;
  }
  LWO_CHECK(lwo_pool_create_pinned(engine, layers, N_LAYERS, NULL, &pool));
  for (l = 0; l < N_LAYERS; ++l) {
    for (i = 0; i < N; ++i) {
      w[i] = to_bf16(uniform(&rng, 1.0f));
      p[l][i] = from_bf16(w[i]);
      m[l][i] = v[l][i] = 0.0;
    }
    LWO_CHECK(lwo_pool_write(pool, (uint32_t)l, "weight", w, sizeof w));
  }
  rc.depth = 2;
  LWO_CHECK(lwo_ring_create(pool, &rc, &ring));
  LWO_CHECK(lwo_grads_create(pool, NULL, NULL, &grads)); /* every layer trainable */
  oc.kind = LWO_OPTIM_ADAMW;                              /* f32 masters and moments */
  LWO_CHECK(lwo_optim_create(grads, &oc, &optim));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaHostRegister(grad, sizeof grad, cudaHostRegisterDefault));
  hp.lr = 1e-2;
  hp.weight_decay = 0.1;

  for (step = 1; step <= N_STEPS; ++step) {
    lwo_ticket tk;
    lwo_layer_view view = LWO_LAYER_VIEW_INIT, gview = LWO_LAYER_VIEW_INIT;
    /* Forward: each stage waits for that layer's update of the last step. */
    for (l = 0; l < N_LAYERS; ++l) {
      LWO_CHECK(lwo_ring_stage(ring, (uint32_t)l, &tk));
      LWO_CHECK(lwo_ring_acquire(ring, tk, stream, &view));
      /* ... the layer's forward kernels on `stream`, reading view.tensors[0] ... */
      LWO_CHECK(lwo_ring_release(ring, tk, stream));
    }
    /* Backward, last layer first: gradients into the slots, then to host. */
    LWO_CHECK(lwo_grads_zero(grads));
    for (l = N_LAYERS - 1; l >= 0; --l) {
      for (i = 0; i < N; ++i) grad[l][i] = to_bf16(0.1f * uniform(&rng, 1.0f));
      LWO_CHECK(lwo_ring_stage(ring, (uint32_t)l, &tk));
      LWO_CHECK(lwo_ring_acquire(ring, tk, stream, &view));
      LWO_CHECK(lwo_grads_begin(grads, (uint32_t)l, stream, &gview));
      CUDA_CHECK(cudaMemcpyAsync(gview.tensors[0], grad[l], sizeof grad[l],
                                 cudaMemcpyHostToDevice, stream));
      LWO_CHECK(lwo_grads_end(grads, (uint32_t)l, stream));
      LWO_CHECK(lwo_ring_release(ring, tk, stream));
    }
    /* The update: each layer as its gradients land. */
    hp.step = step;
    LWO_CHECK(lwo_optim_step(optim, &hp));
    /* (The next forward needs no wait; here the check reads the masters.) */
    LWO_CHECK(lwo_optim_wait(optim));
    for (l = 0; l < N_LAYERS; ++l) {
      const double bc1 = 1.0 - pow(hp.beta1, (double)step), bc2 = 1.0 - pow(hp.beta2, (double)step);
      void* host = NULL;
      LWO_CHECK(lwo_optim_read(optim, (uint32_t)l, "weight", LWO_OPTIM_MASTER, master,
                               sizeof master));
      LWO_CHECK(lwo_pool_tensor_host(pool, (uint32_t)l, "weight", &host, NULL));
      for (i = 0; i < N; ++i) {
        const double g = from_bf16(grad[l][i]);
        p[l][i] *= 1.0 - hp.lr * hp.weight_decay;
        m[l][i] = hp.beta1 * m[l][i] + (1.0 - hp.beta1) * g;
        v[l][i] = hp.beta2 * v[l][i] + (1.0 - hp.beta2) * g * g;
        p[l][i] -= hp.lr / bc1 * m[l][i] / (sqrt(v[l][i]) / sqrt(bc2) + hp.eps);
        EXPECT(fabs(master[i] - p[l][i]) <= 1e-5 * (double)step);
        EXPECT(((const uint16_t*)host)[i] == to_bf16(master[i]));
      }
    }
  }
  {
    lwo_optim_stats st;
    memset(&st, 0, sizeof st);
    st.size = sizeof st;
    LWO_CHECK(lwo_optim_get_stats(optim, &st));
    EXPECT(st.n_steps == N_STEPS);
    EXPECT(st.n_layer_updates == (uint64_t)N_STEPS * N_LAYERS);
  }
  LWO_CHECK(lwo_ring_release_all(ring, stream, NULL));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  LWO_CHECK(lwo_optim_destroy(optim)); /* before its gradient set */
  LWO_CHECK(lwo_grads_destroy(grads));
  LWO_CHECK(lwo_ring_destroy(ring));
  LWO_CHECK(lwo_pool_destroy(pool));
  CUDA_CHECK(cudaHostUnregister(grad));
  CUDA_CHECK(cudaStreamDestroy(stream));
  LWO_CHECK(lwo_engine_destroy(engine));
  printf("optim_step: ok\n");
  return 0;
}
