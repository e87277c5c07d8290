/* The README's first program: sixteen layers of one bf16 matrix each, in a
 * pinned pool, streamed through a ring of depth 2 by a schedule. It uses only
 * lwo.h (no CUDA header, no other library) and checks what the library
 * reports: every layer arrives in order, with its tensor's size and dtype,
 * in one copy each, and no device work failed.
 *
 * Build: cc -std=c11 first_program.c $(pkg-config --cflags --libs lwo)
 * Run:   ./a.out            (prints "first_program: ok" and exits 0) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lwo.h>

#define EXAMPLE_PREFIX "first_program"
#include "common.h"

enum { N_LAYERS = 16, ROWS = 2048, COLS = 2048 };

int main(void) {
  lwo_engine* engine = NULL;
  lwo_pool* pool = NULL;
  lwo_ring* ring = NULL;
  lwo_schedule* sched = NULL;
  lwo_tensor_desc weight[N_LAYERS];
  lwo_layer_desc layers[N_LAYERS];
  uint32_t order[N_LAYERS];
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  lwo_ring_stats stats;
  lwo_stream_t stream = NULL; /* your cudaStream_t; NULL is the legacy default stream */
  lwo_layer_view view = LWO_LAYER_VIEW_INIT; /* size set: the library fills it */
  lwo_status_t s;
  uint64_t record_bytes = 0;
  uint32_t i, n_seen = 0;

  LWO_CHECK(lwo_engine_create(NULL, &engine)); /* NULL config: device 0 */

  /* One bf16 tensor "weight" of ROWS x COLS per layer. */
  for (i = 0; i < N_LAYERS; ++i) {
    weight[i] = tensor_desc("weight", LWO_DTYPE_BF16, ROWS, COLS);
    layers[i].tensors = &weight[i];
    layers[i].n_tensors = 1;
    layers[i].next = NULL; /* no extensions */
    order[i] = i;
  }
  LWO_CHECK(lwo_pool_create_pinned(engine, layers, N_LAYERS, NULL, &pool));

  /* Fill each record in place. "weight" is the first tensor, at offset 0. */
  for (i = 0; i < N_LAYERS; ++i) {
    void* host = NULL;
    uint64_t bytes = 0, k;
    uint16_t* w;
    LWO_CHECK(lwo_pool_layer_host(pool, i, &host, &bytes));
    w = (uint16_t*)host;
    for (k = 0; k < (uint64_t)ROWS * COLS; ++k) w[k] = 0x3f80; /* bf16 1.0 */
  }
  LWO_CHECK(lwo_pool_record_bytes(pool, 0, &record_bytes));

  ring_config.depth = 2;
  LWO_CHECK(lwo_ring_create(pool, &ring_config, &ring));
  LWO_CHECK(lwo_schedule_create(ring, order, N_LAYERS, &sched));

  while ((s = lwo_schedule_next(sched, stream, &view)) == LWO_OK) {
    /* Layer view.layer is in device memory: view.tensors[0] points to its
     * "weight" (ROWS x COLS bf16). Launch the kernels that read it here, on
     * `stream`. The next lwo_schedule_next call releases the layer on
     * `stream`, so its slot is reused only after those kernels finish. */
    EXPECT(view.layer == order[n_seen]);
    EXPECT(view.n_tensors == 1 && view.tensors[0] != NULL);
    EXPECT(view.tensor_bytes[0] == (uint64_t)ROWS * COLS * 2);
    EXPECT(view.tensor_dtypes[0] == LWO_DTYPE_BF16);
    ++n_seen;
  }
  if (s != LWO_END) LWO_CHECK(s);
  EXPECT(n_seen == N_LAYERS);

  /* A second pass would call lwo_schedule_reset(sched, stream) first. */
  LWO_CHECK(lwo_engine_synchronize(engine)); /* waits; reports copy errors */

  /* Every layer was staged once and moved in one copy of its record. */
  memset(&stats, 0, sizeof stats);
  stats.size = sizeof stats;
  LWO_CHECK(lwo_ring_get_stats(ring, &stats));
  printf("%llu stages, %llu copies, %llu bytes\n", (unsigned long long)stats.n_stages,
         (unsigned long long)stats.n_copies, (unsigned long long)stats.bytes_copied);
  EXPECT(stats.n_stages == N_LAYERS && stats.n_hits == 0 && stats.n_copies == N_LAYERS);
  EXPECT(stats.bytes_copied == N_LAYERS * record_bytes);

  LWO_CHECK(lwo_schedule_destroy(sched));
  LWO_CHECK(lwo_ring_destroy(ring));
  LWO_CHECK(lwo_pool_destroy(pool));
  LWO_CHECK(lwo_engine_destroy(engine));
  printf("first_program: ok\n");
  return 0;
}
