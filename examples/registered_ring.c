/* The model lives in the caller's own memory, laid out with lwo_record_layout
 * so that each layer moves in one copy, registered in place (no second host
 * copy) and streamed through a ring of depth 3 driven by hand: stage up to
 * DEPTH layers ahead, acquire, read, release. The check copies every tensor
 * of every acquired layer back (on the consumer stream, before the release)
 * and compares it with the caller's memory, and checks the ring's counts:
 * one stage and one copy per layer.
 *
 * Build: cc -std=c11 registered_ring.c $(pkg-config --cflags --libs lwo) -lcudart
 *        (the CUDA runtime makes the consumer stream and copies the slots back)
 * Run:   ./a.out */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <lwo.h>

#define EXAMPLE_PREFIX "registered_ring"
#include "common.h"

enum { N_LAYERS = 24, DIM = 1024, DEPTH = 3 };


int main(void) {
  lwo_engine* engine = NULL;
  lwo_pool* pool = NULL;
  lwo_ring* ring = NULL;
  lwo_engine_config engine_config;
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  lwo_ring_stats stats;
  lwo_tensor_desc tensors[N_LAYERS][2];
  lwo_layer_desc layers[N_LAYERS];
  lwo_ticket tickets[N_LAYERS];
  uint64_t offsets[2], record_bytes = 0, run_bytes, total, k, rng = 7;
  lwo_host_region region;
  cudaStream_t stream = NULL; /* the consumer stream (an lwo_stream_t) */
  uint8_t* model;
  uint8_t* back; /* what the slots held, copied back for the check */
  uint32_t layer, next_stage = 0;

  lwo_engine_config_init(&engine_config);
  engine_config.device = 0;
  LWO_CHECK(lwo_engine_create(&engine_config, &engine));
  CUDA_CHECK(cudaSetDevice(0)); /* the consumer stream on the engine's device */
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  /* Every layer: "weight" [DIM x DIM] bf16 and "bias" [DIM] f32. */
  for (layer = 0; layer < N_LAYERS; ++layer) {
    lwo_tensor_desc* t = tensors[layer];
    t[0] = tensor_desc("weight", LWO_DTYPE_BF16, DIM, DIM);
    t[1] = tensor_desc("bias", LWO_DTYPE_F32, DIM, 0);
    layers[layer].tensors = t;
    layers[layer].n_tensors = 2;
    layers[layer].next = NULL; /* no extensions */
  }

  /* Lay the caller's memory out exactly as the records: record i at
   * i * record_bytes, each tensor at its offset within the record. */
  LWO_CHECK(lwo_record_layout(&layers[0], offsets, &record_bytes));
  total = record_bytes * N_LAYERS;
  model = (uint8_t*)aligned_alloc(4096, (size_t)((total + 4095) / 4096 * 4096));
  back = (uint8_t*)malloc((size_t)total);
  if (!model || !back) return 1;
  memset(back, 0, (size_t)total);
  for (layer = 0; layer < N_LAYERS; ++layer) {
    uint8_t* record = model + (uint64_t)layer * record_bytes;
    uint16_t* w = (uint16_t*)(record + offsets[0]);
    float* b = (float*)(record + offsets[1]);
    float f;
    uint32_t u;
    for (k = 0; k < (uint64_t)DIM * DIM; ++k) { /* bf16: the top half of an f32 */
      f = uniform(&rng, 1.0f);
      memcpy(&u, &f, 4);
      w[k] = (uint16_t)(u >> 16);
    }
    for (k = 0; k < DIM; ++k) b[k] = uniform(&rng, 1.0f);
    tensors[layer][0].host_data = record + offsets[0];
    tensors[layer][1].host_data = record + offsets[1];
  }

  /* Register the memory in place: no second host copy. */
  region.data = model;
  region.bytes = total;
  region.next = NULL;
  LWO_CHECK(lwo_pool_create_registered(engine, layers, N_LAYERS, &region, 1, NULL, &pool));

  ring_config.depth = DEPTH;
  ring_config.flags = LWO_RING_TIMING;
  LWO_CHECK(lwo_ring_create(pool, &ring_config, &ring));

  for (layer = 0; layer < N_LAYERS; ++layer) {
    lwo_layer_view view = LWO_LAYER_VIEW_INIT;
    void* bias = NULL;
    uint8_t* dst = back + (uint64_t)layer * record_bytes;
    /* Keep up to DEPTH layers staged: their copies run on the engine's
     * transfer stream while `stream` works on the current one. Layer
     * layer-1 was released below, so at most DEPTH-1 tickets are out here
     * and this never answers LWO_ERR_RING_FULL. */
    while (next_stage < N_LAYERS && next_stage < layer + DEPTH) {
      LWO_CHECK(lwo_ring_stage(ring, next_stage, &tickets[next_stage]));
      ++next_stage;
    }
    /* `stream` waits (on the GPU) until the layer is in its slot. */
    LWO_CHECK(lwo_ring_acquire(ring, tickets[layer], stream, &view));
    LWO_CHECK(lwo_ring_tensor(ring, tickets[layer], "bias", &bias));
    EXPECT(view.layer == layer && view.n_tensors == 2 && bias == view.tensors[1]);
    /* Launch the kernels that read view.tensors[0] ("weight") and `bias`
     * on `stream` here. Reads on other streams must be joined into
     * `stream` (event record + wait) before the release. Here the reads
     * are the check's copies back to host memory. */
    CUDA_CHECK(cudaMemcpyAsync(dst + offsets[0], view.tensors[0], view.tensor_bytes[0],
                               cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaMemcpyAsync(dst + offsets[1], bias, view.tensor_bytes[1],
                               cudaMemcpyDeviceToHost, stream));
    LWO_CHECK(lwo_ring_release(ring, tickets[layer], stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));

  for (layer = 0; layer < N_LAYERS; ++layer) {
    const uint64_t at = (uint64_t)layer * record_bytes;
    if (memcmp(back + at + offsets[0], model + at + offsets[0], (size_t)DIM * DIM * 2) != 0 ||
        memcmp(back + at + offsets[1], model + at + offsets[1], (size_t)DIM * 4) != 0) {
      fprintf(stderr, "registered_ring: layer %u arrived with other bytes\n", layer);
      return 1;
    }
  }

  /* Blocks until the timed copies have finished (LWO_RING_TIMING). */
  memset(&stats, 0, sizeof stats);
  stats.size = sizeof stats;
  LWO_CHECK(lwo_ring_get_stats(ring, &stats));
  printf("%llu stages, %llu copies, %.1f GB/s\n", (unsigned long long)stats.n_stages,
         (unsigned long long)stats.n_copies, stats.bandwidth_gbps);
  /* One copy per layer, because the memory follows the record layout; each
   * copy moves the layer's run, from its first tensor to its last tensor's
   * end (no tail padding). */
  run_bytes = offsets[1] + (uint64_t)DIM * 4;
  EXPECT(stats.n_stages == N_LAYERS && stats.n_hits == 0 && stats.n_copies == N_LAYERS);
  EXPECT(stats.bytes_copied == N_LAYERS * run_bytes);

  LWO_CHECK(lwo_ring_destroy(ring));  /* waits for copies and releases */
  LWO_CHECK(lwo_pool_destroy(pool));  /* unregisters the memory */
  LWO_CHECK(lwo_engine_destroy(engine));
  CUDA_CHECK(cudaStreamDestroy(stream));
  free(model);                        /* only after the pool is gone */
  free(back);
  printf("registered_ring: ok\n");
  return 0;
}
