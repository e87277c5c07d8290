/* Streams the layers of a safetensors checkpoint through a ring, twice, and
 * checks that every tensor arrives in device memory with the bytes of the
 * file. Without arguments it first writes a small checkpoint of its own
 * (four layers named "model.layers.<i>.", plus an embedding and a final norm
 * outside the layers) to a temporary folder, and removes it at the end.
 *
 * Build: cc -std=c11 stream_checkpoint.c $(pkg-config --cflags --libs lwo) -lcudart
 *        (the CUDA runtime only copies the slots back for the check)
 * Run:   ./a.out [FILE [PATTERN]]   FILE: a .safetensors file or a
 *        *.safetensors.index.json (default: the one it writes); PATTERN:
 *        default "model.layers.{i}."
 * Opening and listing need no GPU; without one the program stops at
 * lwo_engine_create. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, unlink, rmdir */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <lwo.h>

#define EXAMPLE_PREFIX "stream_checkpoint"
#include "common.h"

enum { N_LAYERS = 4, HIDDEN = 256, VOCAB = 64, DEPTH = 2, N_PASSES = 2 };

/* ---- Writing a small checkpoint (host only) ----------------------------- */

static char g_dir[512];
static char g_file[600];

static void remove_written(void) {
  if (g_file[0]) unlink(g_file);
  if (g_dir[0]) rmdir(g_dir);
}

/* A deterministic byte from a counter. */
static uint8_t byte_at(uint64_t i) {
  uint64_t z = i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (uint8_t)((z ^ (z >> 31)) >> 56);
}

/* The tensors of the file, in file order. */
typedef struct written_tensor {
  char name[96];
  const char* dtype; /* as safetensors spells it */
  int n_dims;
  long shape[2];
  uint64_t bytes;
} written_tensor;

static void add(written_tensor* t, const char* name, const char* dtype, long rows, long cols,
                uint64_t element_bytes) {
  snprintf(t->name, sizeof t->name, "%s", name);
  t->dtype = dtype;
  t->n_dims = cols > 0 ? 2 : 1;
  t->shape[0] = rows;
  t->shape[1] = cols;
  t->bytes = (uint64_t)rows * (uint64_t)(cols > 0 ? cols : 1) * element_bytes;
}

/* Writes the file: 8 bytes of little-endian header length, the JSON header
 * (padded with spaces to a multiple of 8), then the tensors' bytes in the
 * order they are listed. Each layer's two tensors lie together, so each
 * layer moves in one copy. */
static void write_checkpoint(const char* path) {
  written_tensor t[2 * N_LAYERS + 2];
  char header[8192], name[96];
  size_t len = 0, n = 0, i;
  uint64_t offset = 0, k;
  uint8_t len_bytes[8];
  FILE* f;

  add(&t[n++], "model.embed_tokens.weight", "BF16", VOCAB, HIDDEN, 2);
  for (i = 0; i < N_LAYERS; ++i) {
    snprintf(name, sizeof name, "model.layers.%zu.input_layernorm.weight", i);
    add(&t[n++], name, "F32", HIDDEN, 0, 4);
    snprintf(name, sizeof name, "model.layers.%zu.self_attn.q_proj.weight", i);
    add(&t[n++], name, "BF16", HIDDEN, HIDDEN, 2);
  }
  add(&t[n++], "model.norm.weight", "F32", HIDDEN, 0, 4);

  len += (size_t)snprintf(header + len, sizeof header - len,
                          "{\"__metadata__\":{\"format\":\"pt\"}");
  for (i = 0; i < n; ++i) {
    len += (size_t)snprintf(header + len, sizeof header - len,
                            ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%ld", t[i].name, t[i].dtype,
                            t[i].shape[0]);
    if (t[i].n_dims == 2)
      len += (size_t)snprintf(header + len, sizeof header - len, ",%ld", t[i].shape[1]);
    len += (size_t)snprintf(header + len, sizeof header - len,
                            "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
                            (unsigned long long)(offset + t[i].bytes));
    offset += t[i].bytes;
  }
  len += (size_t)snprintf(header + len, sizeof header - len, "}");
  EXPECT(len + 8 < sizeof header);
  while (len % 8 != 0) header[len++] = ' ';

  f = fopen(path, "wb");
  if (!f) {
    fprintf(stderr, "stream_checkpoint: cannot write %s\n", path);
    exit(1);
  }
  for (i = 0; i < 8; ++i) len_bytes[i] = (uint8_t)((uint64_t)len >> (8 * i));
  EXPECT(fwrite(len_bytes, 1, 8, f) == 8 && fwrite(header, 1, len, f) == len);
  for (k = 0; k < offset; ++k) EXPECT(fputc(byte_at(k), f) != EOF);
  EXPECT(fclose(f) == 0);
}

/* ---- Streaming it --------------------------------------------------------- */

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : NULL;
  const char* pattern = argc > 2 ? argv[2] : "model.layers.{i}.";
  lwo_checkpoint* ckpt = NULL;
  lwo_engine* engine = NULL;
  lwo_pool* pool = NULL;
  lwo_ring* ring = NULL;
  lwo_schedule* sched = NULL;
  lwo_checkpoint_pool_config config = LWO_CHECKPOINT_POOL_CONFIG_INIT;
  lwo_ring_config ring_config = LWO_RING_CONFIG_INIT;
  lwo_pool_info info = LWO_POOL_INFO_INIT;
  lwo_ring_stats stats;
  lwo_stream_t stream = NULL; /* your cudaStream_t; NULL is the legacy default stream */
  lwo_layer_view view = LWO_LAYER_VIEW_INIT; /* size set: the library fills it */
  lwo_status_t s;
  uint32_t n_tensors = 0, n_unmatched = 0, i, pass;
  uint64_t checked_bytes = 0;
  uint32_t* order;
  uint8_t* back;

  if (!path) {
    const char* tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/lwo-example-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) {
      fprintf(stderr, "stream_checkpoint: cannot make a folder like %s\n", g_dir);
      return 1;
    }
    snprintf(g_file, sizeof g_file, "%s/model.safetensors", g_dir);
    atexit(remove_written);
    write_checkpoint(g_file);
    path = g_file;
  }

  /* 1. Open: maps every file read-only and validates every header. No GPU
   * is needed for this step. */
  LWO_CHECK(lwo_checkpoint_open(path, &ckpt));
  LWO_CHECK(lwo_checkpoint_tensor_count(ckpt, &n_tensors));

  /* 2. The layers: "model.layers.<i>.<rest>" goes to layer i as "<rest>".
   * List what the pattern leaves out (embeddings, final norm, head...). */
  config.pattern = pattern;
  LWO_CHECK(lwo_checkpoint_unmatched_count(ckpt, &config, &n_unmatched));
  printf("%s: %u tensors, %u outside the layers\n", path, n_tensors, n_unmatched);
  for (i = 0; i < n_unmatched; ++i) {
    const char* name = NULL;
    LWO_CHECK(lwo_checkpoint_unmatched_name(ckpt, &config, i, &name));
    printf("  not streamed: %s\n", name);
  }
  if (path == g_file) EXPECT(n_tensors == 2 * N_LAYERS + 2 && n_unmatched == 2);

  /* 3. The pool: the mapped file itself, registered for DMA in place. */
  LWO_CHECK(lwo_engine_create(NULL, &engine)); /* device 0 */
  LWO_CHECK(lwo_pool_create_from_checkpoint(engine, ckpt, &config, &pool));
  LWO_CHECK(lwo_checkpoint_destroy(ckpt)); /* the pool keeps the files mapped */
  LWO_CHECK(lwo_pool_get_info(pool, &info));
  printf("%u layers, largest record %llu bytes, %s path\n", info.n_layers,
         (unsigned long long)info.max_record_bytes,
         info.kind == LWO_POOL_CHECKPOINT_STAGED ? "staged" : "registered");
  if (path == g_file) EXPECT(info.n_layers == N_LAYERS);

  /* 4. A ring of DEPTH slots and a schedule over layers 0 .. n_layers-1. */
  order = (uint32_t*)malloc(info.n_layers * sizeof *order);
  back = (uint8_t*)malloc(info.max_record_bytes);
  if (!order || !back) return 1;
  for (i = 0; i < info.n_layers; ++i) order[i] = i;
  ring_config.depth = DEPTH;
  LWO_CHECK(lwo_ring_create(pool, &ring_config, &ring));
  LWO_CHECK(lwo_schedule_create(ring, order, info.n_layers, &sched));

  /* 5. The passes. */
  for (pass = 0; pass < N_PASSES; ++pass) {
    if (pass > 0) LWO_CHECK(lwo_schedule_reset(sched, stream));
    while ((s = lwo_schedule_next(sched, stream, &view)) == LWO_OK) {
      uint32_t q = 0, t;
      /* Tensor names within a layer have no prefix. Look one up by name:
       * view.tensors[q] is its device address in the slot. */
      if (lwo_pool_find_tensor(pool, view.layer, "self_attn.q_proj.weight", &q) == LWO_OK) {
        const void* wq = view.tensors[q];
        /* Launch the kernels that read the layer here, on `stream`. In the
         * file's layout wq is only as aligned as the file places it. */
        (void)wq;
      } else if (path == g_file) {
        fprintf(stderr, "stream_checkpoint: layer %u has no self_attn.q_proj.weight\n", view.layer);
        return 1;
      }
      /* The check: copy each tensor back (on the legacy default stream,
       * which `stream` is here, so after the layer has landed) and compare
       * it with the file's bytes, read through the pool's mapping. */
      for (t = 0; t < view.n_tensors; ++t) {
        lwo_tensor_info ti = LWO_TENSOR_INFO_INIT;
        void* host = NULL;
        uint64_t bytes = 0;
        LWO_CHECK(lwo_pool_tensor_info(pool, view.layer, t, &ti));
        LWO_CHECK(lwo_pool_tensor_host(pool, view.layer, ti.name, &host, &bytes));
        EXPECT(bytes == ti.bytes && bytes == view.tensor_bytes[t]);
        if (bytes == 0) continue;
        CUDA_CHECK(cudaMemcpy(back, view.tensors[t], bytes, cudaMemcpyDeviceToHost));
        if (memcmp(back, host, bytes) != 0) {
          fprintf(stderr, "stream_checkpoint: pass %u layer %u %s: bytes differ from the file\n",
                  pass, view.layer, ti.name);
          return 1;
        }
        checked_bytes += bytes;
      }
    }
    /* LWO_ERR_FILE_CHANGED here means a file changed size after it was
     * opened: reopen the checkpoint and make a new pool. */
    if (s != LWO_END) LWO_CHECK(s);
  }
  LWO_CHECK(lwo_engine_synchronize(engine)); /* waits; reports copy errors */

  /* Each layer's tensors lie together in the file: one copy per miss. */
  memset(&stats, 0, sizeof stats);
  stats.size = sizeof stats;
  LWO_CHECK(lwo_ring_get_stats(ring, &stats));
  printf("%llu stages (%llu hits), %llu copies, %llu bytes compared\n",
         (unsigned long long)stats.n_stages, (unsigned long long)stats.n_hits,
         (unsigned long long)stats.n_copies, (unsigned long long)checked_bytes);
  EXPECT(stats.n_stages == (uint64_t)N_PASSES * info.n_layers);
  if (path == g_file) {
    uint64_t k;
    void* host = NULL;
    /* The mapping holds what write_checkpoint wrote: the embedding's 32 KiB,
     * then layer 0's norm, then its q_proj. */
    LWO_CHECK(lwo_pool_tensor_host(pool, 0, "input_layernorm.weight", &host, NULL));
    for (k = 0; k < HIDDEN * 4; ++k)
      EXPECT(((const uint8_t*)host)[k] == byte_at((uint64_t)VOCAB * HIDDEN * 2 + k));
    EXPECT(stats.n_copies == stats.n_stages - stats.n_hits);
  }

  LWO_CHECK(lwo_schedule_destroy(sched));
  LWO_CHECK(lwo_ring_destroy(ring));
  LWO_CHECK(lwo_pool_destroy(pool)); /* unregisters and unmaps the files */
  LWO_CHECK(lwo_engine_destroy(engine));
  free(order);
  free(back);
  printf("stream_checkpoint: ok\n");
  return 0;
}
