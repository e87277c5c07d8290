/* The public header as a C user sees it: compiled as strict C11
 * (-std=c11 -Wall -Wextra -pedantic -Werror), linked to liblwo, run.
 * Works with or without a GPU: without one, engine creation must fail with
 * LWO_ERR_NO_DEVICE and a message; with one, a small pool streams through a
 * ring and a schedule. Exits non-zero on the first failed check. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lwo.h"

static int failures = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: check failed: %s (last message: %s)\n", \
              __FILE__, __LINE__, #cond, lwo_last_error_message());   \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

int main(void) {
  lwo_engine_config ecfg = LWO_ENGINE_CONFIG_INIT;
  lwo_pool_config pcfg;
  lwo_ring_config rcfg;
  lwo_engine* engine = NULL;
  lwo_status_t s;
  lwo_tensor_desc t[2];
  lwo_layer_desc layer;
  uint64_t offsets[2], record = 0;

  CHECK(lwo_version() == LWO_VERSION);
  CHECK(strcmp(lwo_status_string(LWO_ERR_RING_FULL), "LWO_ERR_RING_FULL") == 0);
  CHECK(strcmp(lwo_status_string((lwo_status_t)12345), "unknown status") == 0);
  CHECK(lwo_dtype_size(LWO_DTYPE_BF16) == 2);
  CHECK(lwo_dtype_size((lwo_dtype_t)99) == 0);

  lwo_pool_config_init(&pcfg);
  lwo_ring_config_init(&rcfg);
  CHECK(pcfg.size == sizeof pcfg && rcfg.depth == 2);

  memset(t, 0, sizeof t);
  t[0].name = "weight";
  t[0].dtype = LWO_DTYPE_BF16;
  t[0].n_dims = 2;
  t[0].shape[0] = 3;
  t[0].shape[1] = 5;
  t[1].name = "bias";
  t[1].dtype = LWO_DTYPE_F32;
  t[1].n_dims = 1;
  t[1].shape[0] = 3;
  layer.tensors = t;
  layer.n_tensors = 2;
  layer.next = NULL;
  CHECK(lwo_record_layout(&layer, offsets, &record) == LWO_OK);
  CHECK(offsets[0] == 0 && offsets[1] == 256 && record == 512);
  CHECK(strcmp(lwo_last_error_message(), "") == 0);

  /* Bad input: a distinct status and a message naming the call. */
  CHECK(lwo_engine_create(&ecfg, NULL) == LWO_ERR_INVALID_ARGUMENT);
  CHECK(strstr(lwo_last_error_message(), "lwo_engine_create") != NULL);
  CHECK(lwo_ring_stage(NULL, 0, NULL) == LWO_ERR_INVALID_HANDLE);
  CHECK(lwo_engine_destroy(NULL) == LWO_OK);

  s = lwo_engine_create(&ecfg, &engine);
  if (s == LWO_ERR_NO_DEVICE) {
    CHECK(engine == NULL);
    CHECK(strstr(lwo_last_error_message(), "no CUDA device") != NULL ||
          strstr(lwo_last_error_message(), "does not exist") != NULL);
    printf("c_api_test: no CUDA device (%s); host-side checks only\n", lwo_last_error_message());
  } else {
    lwo_pool* pool = NULL;
    lwo_ring* ring = NULL;
    lwo_schedule* sched = NULL;
    lwo_layer_view view = LWO_LAYER_VIEW_INIT;
    uint32_t order[3] = {0, 1, 0};
    int n = 0;
    CHECK(s == LWO_OK);
    {
      lwo_layer_desc layers[2];
      layers[0] = layer;
      layers[1] = layer;
      CHECK(lwo_pool_create_pinned(engine, layers, 2, &pcfg, &pool) == LWO_OK);
    }
    CHECK(lwo_ring_create(pool, &rcfg, &ring) == LWO_OK);
    CHECK(lwo_schedule_create(ring, order, 3, &sched) == LWO_OK);
    while ((s = lwo_schedule_next(sched, NULL, &view)) == LWO_OK) {
      CHECK(view.n_tensors == 2 && view.base != NULL);
      CHECK(view.tensor_bytes != NULL && view.tensor_bytes[0] == 3 * 5 * 2 &&
            view.tensor_bytes[1] == 3 * 4);
      CHECK(view.tensor_dtypes != NULL && view.tensor_dtypes[0] == LWO_DTYPE_BF16 &&
            view.tensor_dtypes[1] == LWO_DTYPE_F32);
      ++n;
    }
    CHECK(s == LWO_END && n == 3);
    CHECK(lwo_pool_destroy(pool) == LWO_ERR_BUSY);
    CHECK(lwo_schedule_destroy(sched) == LWO_OK);
    CHECK(lwo_ring_destroy(ring) == LWO_OK);
    CHECK(lwo_pool_destroy(pool) == LWO_OK);
    CHECK(lwo_engine_synchronize(engine) == LWO_OK);
    CHECK(lwo_engine_destroy(engine) == LWO_OK);
    printf("c_api_test: streamed %d layers on the device\n", n);
  }
  printf("c_api_test: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
