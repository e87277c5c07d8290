/* Data-parallel training over two GPUs with sharded host weights: two ranks
 * (one thread each here; one process each works the same way), each with its
 * own engine, share one NCCL communicator. Each rank keeps half of every layer
 * in host memory and streams its half up its own PCIe link; the ring
 * all-gathers the whole layer into every GPU's slot. Each rank trains on its
 * own micro-batch; lwo_grads_end sums the weight gradients over the ranks and
 * each rank receives, in host memory, only the part that matches its half of
 * the weights, which it updates itself (a sharded SGD step).
 *
 * The check, every step: each rank compares its part of the last layer's
 * summed gradients with a CPU reference summed over both ranks' micro-batches
 * (the bias gradient exactly, the weight gradient at a sample of elements),
 * then prints "rank R step S: ..."; the program ends with "sharded_train: ok".
 *
 * Build: cc -std=c11 sharded_train.c $(pkg-config --cflags --libs lwo) -lcudart -lpthread
 * Run on a machine with two GPUs: NCCL_NVLS_ENABLE=0 ./a.out */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t */

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <lwo.h>

#define EXAMPLE_PREFIX "sharded_train: rank %d"
#define EXAMPLE_PREFIX_ARGS rank,
#include "common.h"

enum { N_RANKS = 2, N_LAYERS = 8, DIM = 1024, TOKENS = 512, DEPTH = 2, N_STEPS = 3 };
static const float LEARNING_RATE = 1e-3f;
static lwo_nccl_unique_id g_id; /* made once, before the ranks start */
/* For the check: every rank's loss gradient and input of the last layer. */
static float* g_dy_last[N_RANKS];
static float* g_x_last[N_RANKS];
static pthread_barrier_t g_barrier;

/* A value uniform in [-bound, bound) from a counter: the same on every rank. */
static float uniform_at(uint64_t i, float bound) {
  uint64_t z = i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return ((float)(z >> 40) / 16777216.0f * 2.0f - 1.0f) * bound;
}
/* Rank r's loss gradient, element k (bf16). */
static uint16_t dy_last_at(int r, uint64_t k) {
  return to_bf16(uniform_at((1ull << 44) * (uint64_t)(r + 1) + k, 0.01f));
}

/* Compares this rank's part of the summed gradient of the last layer's
 * tensor `name` with the sum over the ranks computed here: the bias
 * gradient is the sum of dy over tokens, the weight gradient dy^T x (checked
 * at every 61st element). Exits on a difference. */
static void check_last_layer(int rank, lwo_grads* grads, const char* name, uint32_t step) {
  const int is_weight = strcmp(name, "weight") == 0;
  float* grad = NULL;
  uint64_t first = 0, n = 0, q;
  LWO_CHECK(lwo_grads_shard(grads, N_LAYERS - 1, name, &grad, &first, &n));
  for (q = 0; q < n; q += is_weight ? 61 : 1) {
    const uint64_t e = first + q, o = is_weight ? e / DIM : e, i = e % DIM;
    double sum = 0.0, scale = 0.0;
    int r, t;
    for (r = 0; r < N_RANKS; ++r)
      for (t = 0; t < TOKENS; ++t) {
        double term = g_dy_last[r][(uint64_t)t * DIM + o];
        if (is_weight) term *= g_x_last[r][(uint64_t)t * DIM + i];
        sum += term;
        scale += term < 0 ? -term : term;
      }
    if (!(grad[q] - sum <= 1e-4 * scale + 1e-7 && sum - grad[q] <= 1e-4 * scale + 1e-7)) {
      fprintf(stderr, "sharded_train: rank %d step %u: layer %d %s gradient element %llu "
              "is %g, the sum over the ranks is %g\n", rank, step, N_LAYERS - 1, name,
              (unsigned long long)e, grad[q], sum);
      exit(1);
    }
  }
}

static void* run_rank(void* arg) {
  const int rank = (int)(intptr_t)arg;
  static const char* const names[2] = {"weight", "bias"};
  lwo_engine_config engine_config = LWO_ENGINE_CONFIG_INIT;
  lwo_engine* engine = NULL;
  lwo_nccl_comm_t comm = NULL;
  lwo_pool* pool = NULL;
  lwo_ring* ring = NULL;
  lwo_schedule* sched = NULL;
  lwo_grads* grads = NULL;
  lwo_tensor_desc tensors[2];
  lwo_layer_desc layers[N_LAYERS];
  uint32_t order[2 * N_LAYERS];
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  lwo_linear_desc lin = LWO_LINEAR_DESC_INIT;
  cudaStream_t stream = NULL;
  void* x[N_LAYERS + 1];
  void* dy_last = NULL;
  void* dy[2];
  const size_t act_bytes = (size_t)TOKENS * DIM * 2;
  uint16_t* host;
  uint64_t k;
  uint32_t l, t, step;

  engine_config.device = rank; /* rank r drives GPU r */
  LWO_CHECK(lwo_engine_create(&engine_config, &engine));
  LWO_CHECK(lwo_nccl_comm_create(engine, &g_id, N_RANKS, rank, &comm));
  CUDA_CHECK(cudaSetDevice(rank));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  tensors[0] = tensor_desc("weight", LWO_DTYPE_BF16, DIM, DIM);
  tensors[1] = tensor_desc("bias", LWO_DTYPE_BF16, DIM, 0);
  for (l = 0; l < N_LAYERS; ++l) {
    layers[l].tensors = tensors;
    layers[l].n_tensors = 2;
    layers[l].next = NULL; /* no extensions */
    order[l] = l;
    order[2 * N_LAYERS - 1 - l] = l;
  }
  /* Every rank describes the same layers (checked collectively) and keeps
   * its own half of each record. */
  LWO_CHECK(lwo_pool_create_sharded(engine, layers, N_LAYERS, comm, NULL, &pool));
  for (l = 0; l < N_LAYERS; ++l) { /* this rank's part of each weight */
    void* p = NULL;
    uint64_t first = 0, n = 0;
    LWO_CHECK(lwo_pool_shard_tensor(pool, l, "weight", &p, &first, &n));
    for (k = 0; k < n; ++k)
      ((uint16_t*)p)[k] = to_bf16(uniform_at((uint64_t)l * DIM * DIM + first + k, 0.05f));
  }
  ring_config.depth = DEPTH; /* the same depth on every rank */
  LWO_CHECK(lwo_ring_create(pool, &ring_config, &ring));
  LWO_CHECK(lwo_schedule_create(ring, order, 2 * N_LAYERS, &sched));
  LWO_CHECK(lwo_grads_create(pool, NULL, NULL, &grads)); /* f32, summed over ranks */

  lin.dtype = LWO_DTYPE_BF16;
  lin.flags = LWO_LINEAR_BIAS;
  lin.in_features = DIM;
  lin.out_features = DIM;
  for (l = 0; l <= N_LAYERS; ++l) CUDA_CHECK(cudaMalloc(&x[l], act_bytes));
  CUDA_CHECK(cudaMalloc(&dy_last, act_bytes));
  CUDA_CHECK(cudaMalloc(&dy[0], act_bytes));
  CUDA_CHECK(cudaMalloc(&dy[1], act_bytes));
  host = (uint16_t*)malloc(act_bytes);
  if (!host) exit(1);
  /* This rank's micro-batch: its own inputs and loss gradient. */
  for (k = 0; k < act_bytes / 2; ++k) host[k] = to_bf16(uniform_at((1ull << 40) * (rank + 1) + k, 1.0f));
  CUDA_CHECK(cudaMemcpy(x[0], host, act_bytes, cudaMemcpyHostToDevice));
  for (k = 0; k < act_bytes / 2; ++k) host[k] = dy_last_at(rank, k);
  CUDA_CHECK(cudaMemcpy(dy_last, host, act_bytes, cudaMemcpyHostToDevice));

  for (step = 0; step < N_STEPS; ++step) {
    lwo_layer_view view = LWO_LAYER_VIEW_INIT;
    lwo_status_t s;
    uint32_t pos = 0;
    double sum_sq = 0.0;

    /* The same schedule on every rank: the same stages (collectives) in the
     * same order, and lwo_grads_end of the same layers between them. */
    LWO_CHECK(lwo_schedule_reset(sched, stream));
    while ((s = lwo_schedule_next(sched, stream, &view)) == LWO_OK) {
      const void* w = view.tensors[0];
      const void* b = view.tensors[1];
      l = view.layer;
      if (pos < N_LAYERS) {
        LWO_CHECK(lwo_linear_forward(engine, &lin, TOKENS, x[l], w, b, x[l + 1], stream));
      } else {
        uint32_t j = pos - N_LAYERS;
        const void* dy_in = j == 0 ? dy_last : dy[(j - 1) % 2];
        lwo_layer_view g = LWO_LAYER_VIEW_INIT;
        LWO_CHECK(lwo_grads_begin(grads, l, stream, &g));
        LWO_CHECK(lwo_linear_backward(engine, &lin, TOKENS, x[l], dy_in, w, NULL,
                                      g.tensors[0], g.tensors[1], LWO_DTYPE_F32, stream));
        /* Sums this layer's gradients over the ranks; this rank's part of
         * the sum goes to its host memory. */
        LWO_CHECK(lwo_grads_end(grads, l, stream));
        if (l > 0)
          LWO_CHECK(lwo_linear_backward(engine, &lin, TOKENS, x[l], dy_in, w, dy[j % 2],
                                        NULL, NULL, LWO_DTYPE_F32, stream));
      }
      ++pos;
    }
    if (s != LWO_END) LWO_CHECK(s);
    LWO_CHECK(lwo_grads_wait(grads));

    /* The check: this step's input of the last layer, from every rank. */
    CUDA_CHECK(cudaMemcpyAsync(host, x[N_LAYERS - 1], act_bytes, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (k = 0; k < act_bytes / 2; ++k) g_x_last[rank][k] = from_bf16(host[k]);
    pthread_barrier_wait(&g_barrier);
    check_last_layer(rank, grads, "weight", step);
    check_last_layer(rank, grads, "bias", step);
    pthread_barrier_wait(&g_barrier); /* before the next step rewrites g_x_last */

    /* Sharded SGD: the gradient part and the weight part cover the same
     * elements of each tensor, so element i updates element i. */
    for (l = 0; l < N_LAYERS; ++l) {
      for (t = 0; t < 2; ++t) {
        float* grad = NULL;
        void* p = NULL;
        uint64_t gfirst = 0, gn = 0, wfirst = 0, wn = 0, i;
        LWO_CHECK(lwo_grads_shard(grads, l, names[t], &grad, &gfirst, &gn));
        LWO_CHECK(lwo_pool_shard_tensor(pool, l, names[t], &p, &wfirst, &wn));
        if (gn != wn || (gn && gfirst != wfirst)) {
          fprintf(stderr, "rank %d: layer %u %s: parts differ\n", rank, l, names[t]);
          exit(1);
        }
        for (i = 0; i < gn; ++i) {
          uint16_t* param = (uint16_t*)p;
          sum_sq += (double)grad[i] * grad[i];
          param[i] = to_bf16(from_bf16(param[i]) - LEARNING_RATE * grad[i]);
        }
      }
      /* Every rank declares every layer changed: hits must stay alike. */
      LWO_CHECK(lwo_pool_layer_changed(pool, l));
    }
    LWO_CHECK(lwo_grads_zero(grads));
    printf("rank %d step %u: sum of squares of this rank's part of the summed gradients: %g\n",
           rank, step, sum_sq);
  }

  CUDA_CHECK(cudaStreamSynchronize(stream));
  LWO_CHECK(lwo_schedule_destroy(sched));
  LWO_CHECK(lwo_ring_destroy(ring));
  LWO_CHECK(lwo_grads_destroy(grads));
  LWO_CHECK(lwo_pool_destroy(pool));
  LWO_CHECK(lwo_nccl_comm_destroy(comm)); /* after every pool and ring using it */
  LWO_CHECK(lwo_engine_destroy(engine));
  for (l = 0; l <= N_LAYERS; ++l) CUDA_CHECK(cudaFree(x[l]));
  CUDA_CHECK(cudaFree(dy_last));
  CUDA_CHECK(cudaFree(dy[0]));
  CUDA_CHECK(cudaFree(dy[1]));
  CUDA_CHECK(cudaStreamDestroy(stream));
  free(host);
  return NULL;
}

int main(void) {
  pthread_t threads[N_RANKS];
  lwo_engine* engine = NULL;
  lwo_status_t s;
  int rank = -1, n_devices = 0, r;
  uint64_t k;
  /* Is there a GPU at all? lwo's message says what is missing. */
  s = lwo_engine_create(NULL, &engine);
  if (s != LWO_OK) {
    fprintf(stderr, "sharded_train: lwo_engine_create: %s: %s\n", lwo_status_string(s),
            lwo_last_error_message());
    return 1;
  }
  LWO_CHECK(lwo_engine_destroy(engine));
  CUDA_CHECK(cudaGetDeviceCount(&n_devices));
  if (n_devices < N_RANKS) {
    fprintf(stderr, "sharded_train: this example needs %d GPUs; found %d\n", N_RANKS, n_devices);
    return 1;
  }
  for (r = 0; r < N_RANKS; ++r) {
    g_dy_last[r] = (float*)malloc((size_t)TOKENS * DIM * sizeof(float));
    g_x_last[r] = (float*)malloc((size_t)TOKENS * DIM * sizeof(float));
    if (!g_dy_last[r] || !g_x_last[r]) return 1;
    for (k = 0; k < (uint64_t)TOKENS * DIM; ++k) g_dy_last[r][k] = from_bf16(dy_last_at(r, k));
  }
  if (pthread_barrier_init(&g_barrier, NULL, N_RANKS) != 0) return 1;
  LWO_CHECK(lwo_nccl_get_unique_id(&g_id)); /* processes would send it to each other */
  for (r = 0; r < N_RANKS; ++r)
    if (pthread_create(&threads[r], NULL, run_rank, (void*)(intptr_t)r) != 0) return 1;
  for (r = 0; r < N_RANKS; ++r) pthread_join(threads[r], NULL);
  pthread_barrier_destroy(&g_barrier);
  for (r = 0; r < N_RANKS; ++r) {
    free(g_dy_last[r]);
    free(g_x_last[r]);
  }
  printf("sharded_train: ok\n"); /* a failing rank exits the process with 1 */
  return 0;
}
