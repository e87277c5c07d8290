/*
 * lwo.h: the whole public C API of lwo, the layer-wise weight offload engine.
 *
 * lwo keeps a model's layers in host memory the GPU can read by DMA and streams
 * them through a small ring of device slots, overlapping each layer's transfer
 * with compute. This header compiles alone as C11 and as C++; it needs no CUDA
 * header. A `lwo_stream_t` is the same type as `cudaStream_t`.
 *
 * Conventions (they hold for every function below unless its comment says
 * otherwise; the comments never contradict them):
 *  - Every function returns `lwo_status_t`; LWO_OK is 0. On failure a
 *    per-thread message (`lwo_last_error_message`) starts with the name of
 *    the function the caller called (also when the failure arose in a call it
 *    makes inside, as lwo_schedule_next staging a layer), then names the
 *    object and the values; on success that message is cleared. Every object
 *    stays usable after a failed call.
 *  - Outputs of a failed call: a non-NULL output handle pointer
 *    (`lwo_pool** pool`) gets NULL and a non-NULL output ticket {0}, before
 *    anything else is checked; every other output is left as it was.
 *  - Checks run in this order, and the first that fails is reported: a NULL
 *    output handle pointer, then handles (LWO_ERR_INVALID_HANDLE), then other
 *    NULL pointers, config structs and arguments (the argument class), then
 *    ranges and names (layer ids, tensor names), then the state of the
 *    objects (the state class). A call's comment gives the order where one
 *    call can meet several state errors.
 *  - Handles are pointers to opaque structs, created through out-parameters and
 *    owned by the caller until passed to the matching `_destroy`. Destroying
 *    NULL does nothing and returns LWO_OK. A handle is an opaque value, not an
 *    address to read (compare it only with NULL); once destroyed it is
 *    LWO_ERR_INVALID_HANDLE for good, also after newer objects are created.
 *  - Structs the library writes (`lwo_layer_view`, `lwo_*_info`,
 *    `lwo_*_stats`, `lwo_checkpoint_tensor`, `lwo_checkpoint_file`) start
 *    with `size_t size`, set by the caller to the
 *    sizeof it was compiled with (the `_INIT` macros do); the library writes
 *    min(size, its own sizeof) bytes and never more, so an older caller's
 *    smaller struct keeps working. A size below sizeof(size_t) is
 *    LWO_ERR_INVALID_ARGUMENT.
 *  - Config and descriptor structs the library reads (`lwo_*_config`,
 *    `lwo_*_desc` with a size field) are read as min(size, its sizeof) bytes
 *    over the defaults. A newer caller's larger struct is accepted only if
 *    every byte past the library's sizeof is zero (options this version does
 *    not know are never silently dropped): else LWO_ERR_INVALID_ARGUMENT,
 *    naming the first nonzero byte. A size above LWO_MAX_STRUCT_SIZE (4096)
 *    is LWO_ERR_INVALID_ARGUMENT before any byte past the library's sizeof
 *    is read. Unknown flag bits are LWO_ERR_INVALID_ARGUMENT.
 *  - Descriptor arrays (`lwo_tensor_desc`, `lwo_layer_desc`,
 *    `lwo_host_region`) carry a `next` pointer: NULL, or a chain of
 *    extension structs, each starting with an `lwo_ext` header. Future
 *    options (per-tensor quantization scales, ...) arrive this way, never by
 *    growing the array element. The chain is walked link by link; a type
 *    this version does not know, or a known type on a descriptor it does
 *    not belong to, is LWO_ERR_UNSUPPORTED naming the type it found; a type
 *    twice in one chain, a nonzero `reserved` or a chain of more than 64
 *    links is LWO_ERR_INVALID_ARGUMENT. Since 0.4.0 one type is defined:
 *    LWO_EXT_TENSOR_QUANT on `lwo_tensor_desc.next` (see "Quantized
 *    records").
 *  - Streams: every `lwo_stream_t` passed to a call must be a stream of the
 *    engine's device (or NULL, the legacy default stream, which the call uses
 *    on the engine's device). lwo does not check this on every call: a
 *    stream of another device is the caller's error, with undefined effect.
 *  - Device work is enqueued, never waited for: a call that names a stream
 *    returns once its work is enqueued on that stream ("stream-ordered").
 *    The host never blocks on the GPU except in calls documented as doing so
 *    (`lwo_engine_synchronize`, destroy calls, `lwo_grads_wait` and
 *    `lwo_grads_zero`, and with LWO_RING_TIMING `lwo_ring_get_stats` /
 *    `lwo_ring_reset_stats`; a compute call waits for its stream once, when
 *    the stream's workspace must grow). Since 0.4.0, with an optimizer
 *    (`lwo_optim`) over the pool, `lwo_ring_stage` and `lwo_grads_begin` of
 *    a layer wait for that layer's host update of the running step (and
 *    `lwo_grads_wait` / `lwo_grads_zero` for the update of a layer they
 *    zero), and `lwo_optim_wait` for the step.
 *  - Every call makes the engine's device current and restores the caller's
 *    current device before returning.
 *  - Threads, by object kind (each kind's section repeats its line):
 *      engine:     any thread; calls serialise internally.
 *      pool:       any thread; calls serialise internally (writing host bytes
 *                  a ring may be copying is the caller's race to avoid).
 *      ring:       any thread; calls serialise internally.
 *      schedule:   one thread at a time (calls are serialised, but two
 *                  threads would take each other's layers).
 *      grads:      any thread; calls serialise internally.
 *      optim:      any thread; calls serialise internally (since 0.4.0).
 *      checkpoint: any thread; read-only after lwo_checkpoint_open.
 *      compute:    any thread; each stream has its own workspace.
 *  - Tensors: an n_dims = 0 tensor is a scalar of one element; a tensor with
 *    a 0 in its shape has 0 elements and 0 bytes, takes no room in its
 *    record (its offset is where the next tensor starts, its device address
 *    is base + offset, which it must never be read through), is never
 *    copied, and writes to it are 0-byte writes that succeed.
 *
 * Since: 0.1.0 unless marked otherwise. A call, struct, field, flag or value
 * added later says "since 0.x.0" in its comment (or in its section's
 * heading); a later change of an older call's behaviour says "from 0.x.0".
 * CHANGELOG.md lists the changes of each release.
 */
#ifndef LWO_H_
#define LWO_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define LWO_API
#elif defined(LWO_BUILDING_LIBRARY)
#define LWO_API __attribute__((visibility("default")))
#else
#define LWO_API
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                   */
/* ------------------------------------------------------------------------ */

#define LWO_VERSION_MAJOR 0
#define LWO_VERSION_MINOR 5
#define LWO_VERSION_PATCH 2
#define LWO_VERSION \
  (LWO_VERSION_MAJOR * 10000 + LWO_VERSION_MINOR * 100 + LWO_VERSION_PATCH)

/* The version of the linked library, as LWO_VERSION computes it. Any thread. */
LWO_API unsigned lwo_version(void);

/* ------------------------------------------------------------------------ */
/* Status                                                                    */
/* ------------------------------------------------------------------------ */

/* Statuses come in classes with stable ranges: a status's class is its
 * value / 100 (LWO_STATUS_CLASS). From 0.2 on values are never renumbered and
 * new ones are appended inside their class's range.
 *   0    success            LWO_OK, LWO_END
 *   1xx  argument           the call was given something wrong: fix the call
 *   2xx  state              the objects are not in a state that allows it now
 *                           (a full ring, a held layer, a changed file): the
 *                           same call may succeed later
 *   3xx  resource           host or device memory, files
 *   4xx  device             no device, or CUDA / cuBLAS / cuDNN / NCCL failed
 *   5xx  format             a checkpoint file is malformed
 *   6xx  collective         the ranks of a communicator disagree
 *   9xx  internal           a bug in lwo */
typedef enum lwo_status_t {
  LWO_OK = 0,
  /* Not an error: `lwo_schedule_next` has no more layers. */
  LWO_END = 1,

  /* -- argument (1xx) -- */
  /* A NULL pointer, a config with a bad size or unknown flag bits, a bad
   * dtype, a negative dimension, a depth of 0... */
  LWO_ERR_INVALID_ARGUMENT = 100,
  /* A handle that is NULL where one is required, was destroyed, or is not of
   * the kind the call expects. */
  LWO_ERR_INVALID_HANDLE = 101,
  /* A layer id, tensor index or byte range outside its object. */
  LWO_ERR_OUT_OF_RANGE = 102,
  /* A tensor name that the layer does not have. */
  LWO_ERR_NOT_FOUND = 103,
  /* A byte count that differs from the tensor's or record's size. */
  LWO_ERR_SIZE_MISMATCH = 104,
  /* A ticket that was not issued by this ring (or ticket 0). */
  LWO_ERR_FOREIGN_TICKET = 105,
  /* Objects of two different engines were mixed. */
  LWO_ERR_FOREIGN_OBJECT = 106,
  /* The operation is not supported with these arguments on this build (an
   * extension struct this version does not know, a write to a read-only
   * checkpoint pool, ...). */
  LWO_ERR_UNSUPPORTED = 107,
  /* A gradient was asked of a quantized weight (lwo_linear_backward, and
   * from 0.5.0 lwo_conv2d_backward, with a dweight or dbias for a
   * quantized weight, lwo_grads_create with a
   * trainable layer that holds a quantized tensor): quantized weights are
   * frozen, except, since 0.6.0, LWO_QUANT_FP8_E4M3_BLOCK128 ones, whose
   * masters the host optimizer keeps. Since 0.4.0. */
  LWO_ERR_QUANTIZED_WEIGHT = 108,

  /* -- state (2xx) -- */
  /* Every slot of the ring is staged or held: release a ticket first. */
  LWO_ERR_RING_FULL = 200,
  /* The layer is already staged or held in a slot of this ring under another
   * ticket (or begun in a gradient set); release (end) it first. */
  LWO_ERR_LAYER_BUSY = 201,
  /* A ticket whose occupancy has ended (released, or its slot reused). */
  LWO_ERR_STALE_TICKET = 202,
  /* A live ticket used in the wrong state (acquired twice), or a gradient
   * layer ended without being begun. */
  LWO_ERR_TICKET_STATE = 203,
  /* An object others depend on (a pool with rings, a ring with held tickets
   * or schedules, an engine with pools) cannot be destroyed yet. */
  LWO_ERR_BUSY = 204,
  /* A mapped checkpoint file changed size or modification time since it was
   * opened. */
  LWO_ERR_FILE_CHANGED = 205,
  /* The call cannot run while its engine captures a CUDA graph
   * (lwo_ring_capture_begin until lwo_ring_capture_end): it would wait for
   * or query device work, or enqueue work the graph would not hold; or the
   * ring is not capturing; or a replay of the caller's graph was not
   * announced (lwo_ring_capture_replay). Since 0.6.0. */
  LWO_ERR_CAPTURING = 206,

  /* -- resource (3xx) -- */
  /* Host or device memory could not be allocated or pinned. */
  LWO_ERR_OUT_OF_MEMORY = 300,
  /* A file could not be opened, read, mapped or examined (the message
   * carries the system's error text). */
  LWO_ERR_IO = 301,
  /* Since 0.4.0: the engine's device memory budget (lwo_engine_config
   * budget_bytes / budget_share) has too little left for what the call would
   * allocate; the message says how many bytes it needs and how many are
   * left. Nothing was allocated. Since 0.6.0 also the host memory limit
   * (host_limit_bytes): the message says "host memory", the bytes asked,
   * the bytes charged and the limit. */
  LWO_ERR_OVER_BUDGET = 302,

  /* -- device (4xx) -- */
  /* No CUDA device was found, or the requested ordinal does not exist. */
  LWO_ERR_NO_DEVICE = 400,
  /* The CUDA runtime returned an error; the message carries its text. */
  LWO_ERR_CUDA = 401,
  LWO_ERR_CUBLAS = 402,
  LWO_ERR_CUDNN = 403,
  LWO_ERR_NCCL = 404,

  /* -- format (5xx): checkpoint files -- */
  /* A checkpoint file is shorter than its own header says (cut short). */
  LWO_ERR_TRUNCATED = 500,
  /* A checkpoint's header length is beyond the file or above the limit, or
   * an index file is above the limit (100 MiB). */
  LWO_ERR_BAD_HEADER_SIZE = 501,
  /* A checkpoint's header (or index file) is not valid JSON of the expected
   * shape. */
  LWO_ERR_BAD_JSON = 502,
  /* A checkpoint tensor has a dtype this format does not define, or one lwo
   * cannot stream where it is used. */
  LWO_ERR_BAD_DTYPE = 503,
  /* A checkpoint tensor's shape does not match its byte range. */
  LWO_ERR_SHAPE_MISMATCH = 504,
  /* A checkpoint tensor's shape overflows 64-bit byte counts. */
  LWO_ERR_SHAPE_OVERFLOW = 505,
  /* A checkpoint tensor's byte range is malformed or outside the data. */
  LWO_ERR_BAD_RANGE = 506,
  /* Two checkpoint tensors' byte ranges overlap. */
  LWO_ERR_OVERLAP = 507,

  /* -- collective (6xx) -- */
  /* The ranks of a communicator disagree (different layer counts or record
   * sizes, or different collective calls under LWO_ENGINE_CHECK_COLLECTIVES):
   * collectives would hang or corrupt, so the call refuses. */
  LWO_ERR_COLLECTIVE_MISMATCH = 600,

  /* -- internal (9xx) -- */
  /* A bug in lwo: please report the message. */
  LWO_ERR_INTERNAL = 900,
  LWO_STATUS_FORCE_32 = 0x7fffffff
} lwo_status_t;

/* The class of a status: 0 success, 1 argument, 2 state, 3 resource,
 * 4 device, 5 format, 6 collective, 9 internal. Since 0.2.0. */
#define LWO_STATUS_CLASS(status) ((int)(status) / 100)
#define LWO_STATUS_CLASS_SUCCESS 0
#define LWO_STATUS_CLASS_ARGUMENT 1
#define LWO_STATUS_CLASS_STATE 2
#define LWO_STATUS_CLASS_RESOURCE 3
#define LWO_STATUS_CLASS_DEVICE 4
#define LWO_STATUS_CLASS_FORMAT 5
#define LWO_STATUS_CLASS_COLLECTIVE 6
#define LWO_STATUS_CLASS_INTERNAL 9

/* Static text naming a status ("LWO_ERR_RING_FULL"); "unknown status" for a
 * value this version does not know. Any thread. */
LWO_API const char* lwo_status_string(lwo_status_t status);

/* The message of the calling thread's last failed call, or "" after a
 * successful one. The pointer stays valid until the thread's next lwo call. */
LWO_API const char* lwo_last_error_message(void);

/* ------------------------------------------------------------------------ */
/* Foreign types                                                             */
/* ------------------------------------------------------------------------ */

/* Same type as cudaStream_t. NULL means the legacy default stream. */
typedef struct CUstream_st* lwo_stream_t;

/* Same type as ncclComm_t. */
typedef struct ncclComm* lwo_nccl_comm_t;

/* ------------------------------------------------------------------------ */
/* Tensors and records                                                       */
/* ------------------------------------------------------------------------ */

/* Any other value, negative ones included, is refused where a dtype is read
 * (LWO_ERR_INVALID_ARGUMENT); lwo_dtype_size gives 0 and lwo_dtype_name
 * "unknown" for it. */
typedef enum lwo_dtype_t {
  LWO_DTYPE_F32 = 0,
  LWO_DTYPE_BF16 = 1,
  LWO_DTYPE_F16 = 2,
  LWO_DTYPE_F8_E4M3 = 3,
  LWO_DTYPE_F8_E5M2 = 4,
  LWO_DTYPE_I8 = 5,
  LWO_DTYPE_U8 = 6,
  /* Since 0.2.0: the other element types of safetensors checkpoints. Pools
   * store and stream them as bytes; layer compute takes f32, bf16 and f16
   * only. */
  LWO_DTYPE_BOOL = 7,
  LWO_DTYPE_I16 = 8,
  LWO_DTYPE_U16 = 9,
  LWO_DTYPE_I32 = 10,
  LWO_DTYPE_U32 = 11,
  LWO_DTYPE_I64 = 12,
  LWO_DTYPE_U64 = 13,
  LWO_DTYPE_F64 = 14,
  LWO_DTYPE_F8_E8M0 = 15,
  LWO_DTYPE_C64 = 16,   /* complex, two f32 */
  LWO_DTYPE_FORCE_32 = 0x7fffffff
} lwo_dtype_t;

/* Bytes of one element, or 0 for an unknown dtype. Any thread. */
LWO_API size_t lwo_dtype_size(lwo_dtype_t dtype);
/* Static name ("bf16"), or "unknown". Any thread. */
LWO_API const char* lwo_dtype_name(lwo_dtype_t dtype);

#define LWO_MAX_DIMS 8
/* The largest `size` a config or descriptor struct the library reads may
 * claim: the bound of what it reads past its own sizeof. */
#define LWO_MAX_STRUCT_SIZE 4096u /* since 0.6.0 */
/* Every tensor of a record starts at a multiple of this many bytes, and a
 * record's size is a multiple of it. */
#define LWO_RECORD_ALIGN 256

/* The header every extension struct of a `next` chain starts with. Since
 * 0.2.0; the types are defined beside their structs (LWO_EXT_TENSOR_QUANT,
 * since 0.4.0; see Conventions). */
typedef struct lwo_ext {
  int32_t type;      /* which extension this is */
  uint32_t reserved; /* 0 */
  const void* next;  /* the next extension struct, or NULL */
} lwo_ext;

/* One named tensor of a layer. `name` is copied; it must be non-empty, at most
 * 255 bytes and unique within its layer. Shape dimensions are >= 0 (a tensor
 * of 0 elements is allowed and takes no bytes). `host_data` is used only by
 * registered pools (see lwo_pool_create_registered) and must be NULL for
 * pinned pools. */
typedef struct lwo_tensor_desc {
  const char* name;
  lwo_dtype_t dtype;
  int32_t n_dims;
  int64_t shape[LWO_MAX_DIMS];
  const void* host_data;
  const void* next;  /* extension chain (since 0.2.0); NULL */
} lwo_tensor_desc;

/* One layer: a record of tensors, laid out in the given order, each at the
 * next multiple of LWO_RECORD_ALIGN. A "layer" may be a whole block of
 * several weight matrices: one record moves in one copy. */
typedef struct lwo_layer_desc {
  const lwo_tensor_desc* tensors;
  uint32_t n_tensors;
  const void* next;  /* extension chain (since 0.2.0); NULL */
} lwo_layer_desc;

/* The record layout of one layer, without creating anything: writes the byte
 * offset of each tensor within the record into `offsets` (n_tensors entries,
 * may be NULL) and the record's size into `*record_bytes`. Lets a caller lay
 * out its own memory to match, so a registered layer moves in one copy.
 * Any thread. */
LWO_API lwo_status_t lwo_record_layout(const lwo_layer_desc* layer,
                                       uint64_t* offsets,
                                       uint64_t* record_bytes);

/* ------------------------------------------------------------------------ */
/* Engine                                                                    */
/* ------------------------------------------------------------------------ */

/* Threads: any thread; calls serialise internally. */
typedef struct lwo_engine lwo_engine;

typedef struct lwo_engine_config {
  size_t size;        /* sizeof(lwo_engine_config) */
  int32_t device;     /* CUDA device ordinal; default 0 */
  uint32_t flags;     /* LWO_ENGINE_CHECK_COLLECTIVES | LWO_ENGINE_HEURISTIC_GEMM |
                         LWO_ENGINE_CHECKING */
  /* Since 0.4.0: the device memory budget, which lwo never exceeds. Every
   * device allocation lwo makes counts: ring slots, resident layers,
   * gradient staging slots and compute workspaces, each as cudaMalloc
   * rounds it (2 MiB pages from 1 MiB up, 512-byte units below). A call
   * that would go past it fails with LWO_ERR_OVER_BUDGET, allocating
   * nothing, and says how many bytes it needs and how many are left. The
   * limit is the smallest of those set: `budget_bytes`; `budget_share`
   * (0 < share <= 1) of the device memory free at creation; that free
   * memory less `budget_headroom` bytes (kept for other programs). All 0
   * (the default): no limit. lwo_engine_set_budget changes it later,
   * lwo_engine_get_memory reports it. (Not counted: what the CUDA, cuBLAS,
   * cuDNN and NCCL libraries reserve themselves, and the few bytes per rank
   * of a sharded pool's creation check and LWO_ENGINE_CHECK_COLLECTIVES.) */
  uint64_t budget_bytes;
  double budget_share;
  uint64_t budget_headroom;
  /* Since 0.6.0: the host memory limit. Every host buffer lwo pins,
   * registers or allocates for its objects counts: pinned and registered
   * pool bytes (a pinned arena rounded up to whole pages), checkpoint files
   * registered in place, staging buffers, host gradient buffers and the
   * host optimizer's masters and state. A call that would go past it fails
   * with LWO_ERR_OVER_BUDGET naming the call, the bytes asked, the bytes
   * charged and the limit; nothing is allocated and every object stays
   * usable. A checkpoint whose files would pass it is staged through
   * bounded buffers instead of registered (LWO_POOL_CHECKPOINT_STAGED).
   * 0 (the default): derived at creation as the smallest of the cgroup's
   * memory limit (v2 memory.max, v1 memory.limit_in_bytes) and
   * /proc/meminfo's MemAvailable, each less a margin of an eighth (at least
   * 256 MiB, at most half); no limit when neither is known (RLIMIT_MEMLOCK
   * is not a term: CUDA's pinned memory is not charged against it).
   * LWO_HOST_LIMIT_NONE: no limit. lwo_engine_set_host_limit changes it,
   * lwo_engine_host_usage reports it. */
  uint64_t host_limit_bytes;
} lwo_engine_config;

#define LWO_HOST_LIMIT_NONE UINT64_MAX

/* Debug mode for sharded pools: before every collective step (each stage of
 * a ring of a sharded pool, hits included, and each lwo_grads_end of its
 * gradients) the ranks exchange what they are about to do (call, layer,
 * hit or copy, bytes, step number) and compare. A difference fails the call
 * on every rank with LWO_ERR_COLLECTIVE_MISMATCH, naming each rank's step,
 * instead of a hang or a silent mix of layers; all objects stay usable. It
 * costs a small all-gather and a host wait per step, so the pipeline no
 * longer overlaps: use it to find a bug, not in production. The environment
 * variable LWO_CHECK_COLLECTIVES=1 turns it on for every engine as well. */
#define LWO_ENGINE_CHECK_COLLECTIVES 0x1u

/* GEMM algorithms: by default the first call of each GEMM shape times
 * cuBLASLt's first 8 heuristic candidates on the caller's stream and data
 * (a few runs each, the call's host thread waiting once) and keeps the
 * fastest for the engine's lifetime, so a streamed layer still equals its
 * resident twin bit for bit. Timing can pick differently in another engine
 * or process; with this flag the engine takes the heuristic's first
 * candidate instead, the same everywhere, and never waits. The environment
 * variable LWO_HEURISTIC_GEMM=1 sets it for every engine. Since 0.3.0. */
#define LWO_ENGINE_HEURISTIC_GEMM 0x2u

/* Checking mode, for finding a caller's ordering bugs: memory the caller
 * must no longer (or not yet) read holds LWO_CHECKING_BYTE in every byte
 * (NaN in f32, bf16 and f16), so such a read gives recognisable garbage
 * instead of plausible stale numbers.
 *  - lwo_ring_release: after the work enqueued on the release stream before
 *    the call (and after the slot's fill), the slot's record is filled with
 *    the pattern on that stream, before its free event. A kernel that reads
 *    the slot after the release, or on a stream not joined into it, reads
 *    the pattern. The layer no longer stays in the slot: staging it again
 *    copies it again (no hit), resident layers included.
 *  - lwo_grads_end: after the copy of the slot to host, the staging slot is
 *    filled with the pattern on the gradient stream, so a kernel reading it
 *    after the end, or adding into it after the next begin without writing
 *    it first, reads the pattern.
 *  - host gradients: from lwo_grads_create and from lwo_grads_zero, each
 *    layer's host gradients hold the pattern (not zeros, not the old sums)
 *    until its first gradient lands; lwo_grads_wait zeroes the layers that
 *    got none. A host read before lwo_grads_wait sees NaN where the copy has
 *    not landed. The sums of later micro-batches are added into the buffers
 *    as usual (poisoning them would destroy the sum), so a read before the
 *    fence there sees a partial sum, undetected.
 * It costs a device fill per release and per gradient end, a host fill of
 * the gradients per zero, and the ring's hits. Off (the default) it costs
 * nothing. The environment variable LWO_CHECKING=1 turns it on for every
 * engine as well. */
#define LWO_ENGINE_CHECKING 0x4u
#define LWO_CHECKING_BYTE 0xFFu

#define LWO_ENGINE_CONFIG_INIT {sizeof(lwo_engine_config), 0, 0u, 0u, 0.0, 0u, 0u}
LWO_API void lwo_engine_config_init(lwo_engine_config* config);

/* Creates an engine on one CUDA device, with its own non-blocking transfer
 * (host to device) and gradient (device to host) streams. `config` may be
 * NULL for the defaults. LWO_ERR_NO_DEVICE when there is no such device.
 * One engine per device per process is the intended use. Any thread. */
LWO_API lwo_status_t lwo_engine_create(const lwo_engine_config* config,
                                       lwo_engine** engine);

/* Destroys an engine after waiting for its streams (and, once a compute call
 * has run, for the whole device, since the compute workspaces belong to the
 * callers' streams). LWO_ERR_BUSY while pools of the engine exist. */
LWO_API lwo_status_t lwo_engine_destroy(lwo_engine* engine);

/* The CUDA device ordinal of the engine. */
LWO_API lwo_status_t lwo_engine_device(const lwo_engine* engine, int32_t* device);

/* Since 0.4.0: sets the engine's device memory budget as lwo_engine_config's
 * budget fields do (share and headroom of the memory free now to lwo: free
 * on the device plus what lwo holds); all 0 removes it. LWO_ERR_INVALID_ARGUMENT
 * for a share outside [0, 1]; LWO_ERR_OVER_BUDGET when lwo already holds more
 * than the new limit (the budget is then unchanged). */
LWO_API lwo_status_t lwo_engine_set_budget(lwo_engine* engine, uint64_t budget_bytes,
                                           double budget_share, uint64_t budget_headroom);

/* Since 0.6.0: sets the engine's host memory limit as lwo_engine_config's
 * host_limit_bytes does (0: derive it again now; LWO_HOST_LIMIT_NONE: none).
 * LWO_ERR_OVER_BUDGET when lwo already holds more host memory than the new
 * limit (the limit is then unchanged). Any thread. */
LWO_API lwo_status_t lwo_engine_set_host_limit(lwo_engine* engine, uint64_t host_limit_bytes);

/* Since 0.6.0: the engine's host memory limit (0: none) and the host bytes
 * its objects hold now, as the limit counts them. Either pointer may be
 * NULL. Any thread. */
LWO_API lwo_status_t lwo_engine_host_usage(const lwo_engine* engine, uint64_t* limit_bytes,
                                           uint64_t* charged_bytes);

/* What the engine's objects hold on the device now. Since 0.4.0. */
typedef struct lwo_engine_memory {
  size_t size;              /* sizeof(lwo_engine_memory), set by the caller */
  uint64_t budget;          /* the limit in bytes; 0: none */
  uint64_t used;            /* all that lwo holds, as the budget counts it */
  uint64_t left;            /* budget - used; with no budget, the device's free memory */
  uint64_t ring_slots;      /* of `used`: the rings' slots */
  uint64_t resident;        /* resident layers */
  uint64_t grads;           /* gradient staging slots */
  uint64_t workspaces;      /* compute workspaces */
  uint64_t device_free;     /* cudaMemGetInfo, now */
  uint64_t device_total;
} lwo_engine_memory;

#define LWO_ENGINE_MEMORY_INIT {sizeof(lwo_engine_memory), 0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u}

LWO_API lwo_status_t lwo_engine_get_memory(const lwo_engine* engine, lwo_engine_memory* memory);

/* The engine's transfer stream, on which every host-to-device copy of every
 * ring of the engine is enqueued. Owned by the engine; valid until it is
 * destroyed. For callers that want to order their own work after transfers. */
LWO_API lwo_status_t lwo_engine_transfer_stream(const lwo_engine* engine,
                                                lwo_stream_t* stream);

/* Errors that surfaced later on the GPU: returns LWO_OK if no device work of
 * this engine has failed so far, else the error, with a message. Does not
 * block. */
LWO_API lwo_status_t lwo_engine_check(lwo_engine* engine);

/* Blocks until all work on the engine's streams has finished, then reports as
 * lwo_engine_check does. */
LWO_API lwo_status_t lwo_engine_synchronize(lwo_engine* engine);

/* ------------------------------------------------------------------------ */
/* Host weight pools                                                         */
/* ------------------------------------------------------------------------ */

/* Threads: any thread; calls serialise internally. Writing host bytes of a
 * layer while a ring may be copying it is a race the caller must avoid. */
typedef struct lwo_pool lwo_pool;

typedef struct lwo_pool_config {
  size_t size;          /* sizeof(lwo_pool_config) */
  uint32_t flags;       /* none defined yet; must be 0 */
  uint32_t n_threads;   /* threads used to first-touch (and zero) a pinned
                           arena; 0 = one per core, at most 64 */
} lwo_pool_config;

#define LWO_POOL_CONFIG_INIT {sizeof(lwo_pool_config), 0u, 0u}
LWO_API void lwo_pool_config_init(lwo_pool_config* config);

/* Creates a pool of `n_layers` layers whose records live in one pinned host
 * arena the pool owns, sized exactly to the sum of the records (rounded up to
 * a page), zero-filled. Fill it with lwo_pool_write or through the pointers of
 * lwo_pool_layer_host / lwo_pool_tensor_host. `config` may be NULL.
 * The descriptions are copied. Any thread. */
LWO_API lwo_status_t lwo_pool_create_pinned(lwo_engine* engine,
                                            const lwo_layer_desc* layers,
                                            uint32_t n_layers,
                                            const lwo_pool_config* config,
                                            lwo_pool** pool);

/* A range of caller memory to register for DMA in place (cudaHostRegister). */
typedef struct lwo_host_region {
  const void* data;
  uint64_t bytes;
  const void* next;  /* extension chain (since 0.2.0); NULL */
} lwo_host_region;

/* Creates a pool over caller memory, registered in place: each region is
 * registered (memory the caller already pinned or registered is accepted and
 * left as it is), and each tensor's `host_data` must lie, whole, inside one
 * region. Where a layer's tensors sit in host memory exactly as its record
 * lays them out (see lwo_record_layout), the layer moves in one copy;
 * otherwise in one copy per contiguous run. The caller keeps the memory
 * alive and unmodified while any ring may stage from it, and until the pool
 * is destroyed (which unregisters what it registered). */
LWO_API lwo_status_t lwo_pool_create_registered(lwo_engine* engine,
                                                const lwo_layer_desc* layers,
                                                uint32_t n_layers,
                                                const lwo_host_region* regions,
                                                uint32_t n_regions,
                                                const lwo_pool_config* config,
                                                lwo_pool** pool);

/* LWO_ERR_BUSY while rings of the pool exist. */
LWO_API lwo_status_t lwo_pool_destroy(lwo_pool* pool);

/* Where a pool's host bytes live, and so how rings copy them. Since 0.2.0. */
typedef enum lwo_pool_kind_t {
  LWO_POOL_PINNED = 0,             /* a pinned arena the pool owns */
  LWO_POOL_REGISTERED = 1,         /* caller memory registered in place */
  LWO_POOL_CHECKPOINT_MAPPED = 2,  /* a checkpoint's mapped files, registered in place */
  LWO_POOL_CHECKPOINT_STAGED = 3,  /* a checkpoint's mapped files, copied through
                                      pinned staging buffers */
  LWO_POOL_SHARDED = 4,            /* this rank's shard of every record, pinned */
  LWO_POOL_KIND_FORCE_32 = 0x7fffffff
} lwo_pool_kind_t;

typedef struct lwo_pool_info {
  size_t size;                /* sizeof(lwo_pool_info), set by the caller */
  uint32_t n_layers;
  lwo_pool_kind_t kind;       /* since 0.2.0 (replaces is_registered, is_staged) */
  uint64_t total_bytes;       /* host bytes of every layer this pool holds: the
                                 records, or for a sharded pool this rank's
                                 shards */
  uint64_t max_record_bytes;  /* the size of a ring slot: the largest record
                                 (sharded: the largest n_ranks x shard) */
  int32_t rank;               /* this pool's rank: 0 unless sharded (since 0.2.0) */
  int32_t n_ranks;            /* ranks sharing the records: 1 unless sharded
                                 (since 0.2.0) */
} lwo_pool_info;

/* Since 0.2.0. */
#define LWO_POOL_INFO_INIT {sizeof(lwo_pool_info), 0u, LWO_POOL_PINNED, 0u, 0u, 0, 1}

LWO_API lwo_status_t lwo_pool_get_info(const lwo_pool* pool, lwo_pool_info* info);

/* Where one tensor sits in its layer's record. `name` points into the pool
 * and lives as long as the pool. */
typedef struct lwo_tensor_info {
  size_t size;       /* sizeof(lwo_tensor_info), set by the caller (since 0.2.0) */
  const char* name;
  lwo_dtype_t dtype;
  int32_t n_dims;
  int64_t shape[LWO_MAX_DIMS];
  uint64_t offset;   /* byte offset within the record */
  uint64_t bytes;    /* bytes in the record (quantized: the quantized size) */
  int32_t quant_format;  /* an lwo_quant_format_t: LWO_QUANT_NONE, or the format
                            the tensor is stored in (its dtype is then the
                            logical dtype; since 0.4.0) */
} lwo_tensor_info;

/* Since 0.2.0. */
#define LWO_TENSOR_INFO_INIT {sizeof(lwo_tensor_info), NULL, LWO_DTYPE_F32, 0, {0}, 0u, 0u, 0}

LWO_API lwo_status_t lwo_pool_layer_tensor_count(const lwo_pool* pool, uint32_t layer,
                                                 uint32_t* n_tensors);
LWO_API lwo_status_t lwo_pool_tensor_info(const lwo_pool* pool, uint32_t layer,
                                          uint32_t index, lwo_tensor_info* info);
/* Index of the tensor called `name` in `layer`; LWO_ERR_NOT_FOUND if none. */
LWO_API lwo_status_t lwo_pool_find_tensor(const lwo_pool* pool, uint32_t layer,
                                          const char* name, uint32_t* index);
/* Bytes of one layer's record. */
LWO_API lwo_status_t lwo_pool_record_bytes(const lwo_pool* pool, uint32_t layer,
                                           uint64_t* bytes);

/* Copies `bytes` bytes from `src` into tensor `name` of `layer`; `bytes` must
 * equal the tensor's size (LWO_ERR_SIZE_MISMATCH). Pinned and sharded pools
 * only (LWO_ERR_UNSUPPORTED for registered pools, which are the caller's
 * memory to write directly, and for read-only checkpoint pools); a sharded
 * pool keeps only the part of the tensor in this rank's shard. Marks the
 * layer changed (lwo_pool_layer_changed). Writing a layer while a ring may be
 * copying it is a data race the caller must avoid: write before staging, or
 * after the ring's copies of that layer finished. LWO_ERR_BUSY, writing
 * nothing, while the layer is resident in a ring a CUDA graph the caller
 * captured holds (lwo_ring_capture_join; since 0.6.0). */
LWO_API lwo_status_t lwo_pool_write(lwo_pool* pool, uint32_t layer, const char* name,
                                    const void* src, uint64_t bytes);

/* As lwo_pool_write, for bytes [offset, offset + bytes) of the tensor only
 * (LWO_ERR_OUT_OF_RANGE past its end). Since 0.2.0. */
LWO_API lwo_status_t lwo_pool_write_range(lwo_pool* pool, uint32_t layer, const char* name,
                                          uint64_t offset, const void* src, uint64_t bytes);

/* "Whole" and "shard" access. A pool holds the whole of every record, except
 * a sharded pool of more than one rank, which holds one shard of each. The
 * whole-layer calls (lwo_pool_layer_host, lwo_pool_tensor_host) work on every
 * pool that holds the whole record and give LWO_ERR_UNSUPPORTED on a sharded
 * pool of more than one rank; the shard calls (lwo_pool_shard_host,
 * lwo_pool_shard_tensor, lwo_grads_shard) work on every pool, where an
 * unsharded pool is one shard: the whole record. */

/* The host address of a layer's bytes and their count, for filling them in
 * place (read-only for checkpoint pools: their memory is a read-only
 * mapping). Pinned pools: the whole record (record bytes). Registered and
 * checkpoint pools: only when the layer moves in one copy, the memory from
 * the first tensor to the end of the last (which may be less than the
 * record, whose tail padding is not copied); else LWO_ERR_UNSUPPORTED. Valid
 * until the pool is destroyed. */
LWO_API lwo_status_t lwo_pool_layer_host(lwo_pool* pool, uint32_t layer, void** data,
                                         uint64_t* bytes);

/* Declares that the host bytes of `layer` changed (written through the
 * pointers above, or in a registered pool's caller memory, for example by an
 * optimizer step): the next lwo_ring_stage of the layer copies it again
 * instead of reusing a slot that still holds the old bytes. lwo_pool_write
 * does this itself. Copies already enqueued are not affected: change a layer
 * only while no ring may be copying it. LWO_ERR_BUSY as for lwo_pool_write
 * (since 0.6.0). */
LWO_API lwo_status_t lwo_pool_layer_changed(lwo_pool* pool, uint32_t layer);

/* The host address and size of one tensor (read-only for checkpoint pools).
 * Valid until the pool is destroyed. */
LWO_API lwo_status_t lwo_pool_tensor_host(lwo_pool* pool, uint32_t layer,
                                          const char* name, void** data,
                                          uint64_t* bytes);

/* ------------------------------------------------------------------------ */
/* Device slot rings                                                         */
/* ------------------------------------------------------------------------ */

/* Threads: any thread; calls serialise internally. */
typedef struct lwo_ring lwo_ring;

/* One occupancy of one slot of one ring. Treat it as opaque; 0 is never a
 * valid ticket. No two tickets of a process are equal, so a ticket passed to
 * a ring that did not issue it is always LWO_ERR_FOREIGN_TICKET. */
typedef struct lwo_ticket {
  uint64_t id;
} lwo_ticket;

/* Record copy and wait timings with CUDA events (see lwo_ring_stats). */
#define LWO_RING_TIMING 0x1u
/* Since 0.6.0: a CUDA graph capture of the ring (lwo_ring_capture_begin,
 * lwo_ring_capture_join) starts warm: the slots keep the layers they hold
 * (released, and at the pool's current bytes), so that the capture's stages
 * of those layers are hits that copy nothing, as in an eager pass that
 * follows another (a training step's forward finds its first layers where
 * the last backward left them). Where the capture then fills such a slot
 * with another layer, it copies the kept layer back at its end (after the
 * slot's last reader), so each replay leaves the slots as its start reads
 * them. Before each launch, the host side of the replay (lwo_graph_launch;
 * for the caller's graph lwo_ring_capture_replay, which such a graph then
 * needs before every launch, with or without gradient sets) copies each of
 * those layers into its slot again where the pool's bytes of the layer
 * changed since they were copied, ordered after the last replay; the replay
 * waits for those copies. Without the flag a capture
 * takes the slots as empty. In checking mode the flag does nothing (released
 * slots are poisoned). */
#define LWO_RING_CAPTURE_WARM 0x2u
/* The most slots a ring can number: its depth, and its depth plus its
 * resident layers, are at most this. */
#define LWO_MAX_RING_DEPTH 4096u /* since 0.6.0 */

typedef struct lwo_ring_config {
  size_t size;      /* sizeof(lwo_ring_config) */
  uint32_t depth;   /* number of slots, 1..LWO_MAX_RING_DEPTH; default 2 (enough
                       to saturate one PCIe link when compute per layer is even) */
  uint32_t flags;   /* LWO_RING_TIMING, LWO_RING_CAPTURE_WARM, or 0 */
  /* Since 0.4.0: resident layers. `resident_layers` lists n_resident
   * distinct layer ids of the pool (copied; NULL when n_resident is 0) that
   * the ring keeps on the device in slots of their own, one per layer, each
   * the size of its record. They are uploaded once, at lwo_ring_create (on
   * the transfer stream, stream-ordered like a stage), and again only when
   * the layer changed (lwo_pool_layer_changed, lwo_pool_write): the next
   * stage then copies it into the same slot, ordered after every release of
   * the old bytes. Any other stage of a resident layer is a hit that moves
   * nothing. Tickets, acquire, release, schedules and gradients work on them
   * as on any layer. The `depth` slots then hold the largest streamed
   * record. depth + n_resident is at most LWO_MAX_RING_DEPTH. Errors: a
   * NULL list with n_resident > 0 or a repeated id
   * (LWO_ERR_INVALID_ARGUMENT), an id outside the pool
   * (LWO_ERR_OUT_OF_RANGE), a sharded pool (LWO_ERR_UNSUPPORTED), the
   * engine's budget (LWO_ERR_OVER_BUDGET). */
  const uint32_t* resident_layers;
  uint32_t n_resident;
} lwo_ring_config;

#define LWO_RING_CONFIG_INIT {sizeof(lwo_ring_config), 2u, 0u, NULL, 0u}
LWO_API void lwo_ring_config_init(lwo_ring_config* config);

/* Creates a ring of `depth` device slots, each the size of the pool's largest
 * record (from 0.4.0: its largest streamed record, when resident layers are
 * listed), serving layers of `pool`. `config` may be NULL. From 0.4.0 the
 * slots count against the engine's budget (LWO_ERR_OVER_BUDGET). */
LWO_API lwo_status_t lwo_ring_create(lwo_pool* pool, const lwo_ring_config* config,
                                     lwo_ring** ring);

/* Waits for the ring's copies and for the consumer streams' releases, then
 * frees its slots. LWO_ERR_BUSY while a ticket is acquired and not released,
 * or while a schedule of the ring exists. */
LWO_API lwo_status_t lwo_ring_destroy(lwo_ring* ring);

/* Claims a slot for `layer` and returns its ticket. If the layer is still in a
 * slot from an earlier occupancy (released, not overwritten, and not
 * changed since: lwo_pool_layer_changed), that is a hit: no copy. Otherwise
 * the slot taken is the free one released longest ago: an empty slot first
 * (the lowest-numbered), else the released slot whose lwo_ring_release call
 * came first (releases in any order; the order of the release calls, not of
 * the GPU work, decides). The layer's copy into it is enqueued on the
 * engine's transfer stream, ordered after every release of the slot's
 * previous occupant. Never blocks the host.
 *
 * What the copy moves: the layer's copy runs. A pinned pool's record is one
 * run of record_bytes (tail padding included); a registered or checkpoint
 * pool moves each run of tensors that lie in host memory as the record lays
 * them out, from the run's first tensor to its last tensor's end (no tail
 * padding), in one copy per run (a staged checkpoint pool packs the runs into
 * a pinned staging buffer and copies that in one copy); a sharded pool moves
 * this rank's shard (shard bytes) and all-gathers the rest. lwo_ring_stats
 * counts these: n_copies host-to-device copies and bytes_copied their run
 * bytes (never the all-gather).
 *
 * A resident layer (lwo_ring_config.resident_layers, since 0.4.0) is always a
 * hit, except after it changed: then it is copied again into its own slot,
 * ordered after every release of its old bytes.
 *
 * Errors, checked in this order: LWO_ERR_OUT_OF_RANGE (layer), LWO_ERR_FILE_CHANGED
 * (a checkpoint file changed size, or a staged copy out of it found it cut
 * short: then for good), LWO_ERR_LAYER_BUSY (the layer is already
 * staged or held under another ticket: this wins over a full ring),
 * LWO_ERR_RING_FULL (every slot is staged or held).
 *
 * From 0.4.0: where an optimizer (lwo_optim) is updating the layer, the
 * call first blocks until that layer's update is written (the step marked
 * the layer changed, so this stage copies the new bytes). */
LWO_API lwo_status_t lwo_ring_stage(lwo_ring* ring, uint32_t layer,
                                    lwo_ticket* ticket);

/* The device addresses of an acquired layer (or of a gradient slot, from
 * lwo_grads_begin). The arrays hold n_tensors entries in the layer's tensor
 * order; they and the addresses are valid until the ticket is released (the
 * gradient layer ended). Set `size` first (LWO_LAYER_VIEW_INIT). */
typedef struct lwo_layer_view {
  size_t size;                 /* sizeof(lwo_layer_view), set by the caller (since 0.2.0) */
  uint32_t layer;
  uint32_t n_tensors;
  void* base;                  /* device address of the record */
  uint64_t record_bytes;
  void* const* tensors;        /* device address of each tensor */
  const uint64_t* tensor_bytes;      /* bytes of each tensor (since 0.2.0) */
  const lwo_dtype_t* tensor_dtypes;  /* dtype of each tensor; in a gradient view
                                        its wire dtype (since 0.2.0) */
} lwo_layer_view;

/* Since 0.2.0. */
#define LWO_LAYER_VIEW_INIT {sizeof(lwo_layer_view), 0u, 0u, NULL, 0u, NULL, NULL, NULL}

/* Makes `stream` wait (on the GPU) until the ticket's layer is in its slot and
 * returns the device addresses. Work enqueued on `stream` after this call may
 * read the slot. A ticket is acquired at most once (LWO_ERR_TICKET_STATE).
 * LWO_ERR_FILE_CHANGED on a staged checkpoint pool once a host copy out of a
 * file found it cut short (docs/API.md, Files that change). */
LWO_API lwo_status_t lwo_ring_acquire(lwo_ring* ring, lwo_ticket ticket,
                                      lwo_stream_t stream, lwo_layer_view* view);

/* The device address of tensor `name` of a live (staged or acquired) ticket.
 * Device work may read it only after lwo_ring_acquire on its stream. */
LWO_API lwo_status_t lwo_ring_tensor(lwo_ring* ring, lwo_ticket ticket,
                                     const char* name, void** device_ptr);

/* Non-blocking: *landed = 1 if the ticket's layer is in its slot (its copy
 * has finished on the GPU; a hit has landed), else 0. A consumer must still
 * acquire before reading. LWO_ERR_STALE_TICKET for a ticket that has
 * ended. Since 0.2.0. */
LWO_API lwo_status_t lwo_ring_query(lwo_ring* ring, lwo_ticket ticket, uint32_t* landed);

typedef enum lwo_ticket_state_t {
  LWO_TICKET_STAGED = 1,    /* staged, not acquired */
  LWO_TICKET_ACQUIRED = 2,  /* acquired, not released */
  LWO_TICKET_ENDED = 3,     /* released, or its slot since reused */
  LWO_TICKET_STATE_FORCE_32 = 0x7fffffff
} lwo_ticket_state_t;

/* The state of a ticket this ring issued (LWO_ERR_FOREIGN_TICKET for any
 * other). Since 0.2.0. */
LWO_API lwo_status_t lwo_ring_ticket_state(lwo_ring* ring, lwo_ticket ticket,
                                           lwo_ticket_state_t* state);

/* Ends the ticket's occupancy: records the slot's free event on `stream`. The
 * slot will not be overwritten until the work enqueued on `stream` before this
 * call has finished, so every read of the slot must be ordered on `stream`
 * before the release (if reads ran on several streams, join them into
 * `stream` first). A staged ticket may be released without being acquired.
 * The layer stays in the slot, so staging it again before the slot is reused
 * is a hit. Releasing twice is LWO_ERR_STALE_TICKET. */
LWO_API lwo_status_t lwo_ring_release(lwo_ring* ring, lwo_ticket ticket,
                                      lwo_stream_t stream);

/* Releases every live ticket of the ring (staged or acquired) on `stream`,
 * as lwo_ring_release would one by one, and sets *n_released to their number
 * (may be NULL). LWO_ERR_BUSY while a schedule of the ring exists (it holds
 * tickets of its own: destroy or reset it). Since 0.2.0. */
LWO_API lwo_status_t lwo_ring_release_all(lwo_ring* ring, lwo_stream_t stream,
                                          uint32_t* n_released);

/* ---- CUDA graphs of a ring's passes (since 0.6.0) ----
 * The stages, acquires, compute calls and releases of one pass over a ring,
 * enqueued on one stream, captured once as a CUDA graph and replayed with one
 * launch: each copy into a slot becomes a memcpy node from the pool's host
 * memory, so a replay copies the bytes the pool holds when that copy runs,
 * and the slots' ready and free events become the graph's edges.
 *
 * lwo_ring_capture_begin waits until nothing of the ring runs, takes its slots
 * as empty (so each layer's first stage in the capture is a copy and a replay
 * does not depend on what the slots held before it; a ring made with
 * LWO_RING_CAPTURE_WARM keeps them instead, and each launch first copies again
 * what its hits on them need), begins a capture on
 * `stream` (cudaStreamBeginCapture, relaxed mode; not the legacy default
 * stream; LWO_ERR_CAPTURING if `stream` already captures: see
 * lwo_ring_capture_join) and joins the engine's transfer stream to it. Then
 * the caller stages, acquires, computes on `stream` and releases as in an
 * eager pass (run the pass once eagerly on `stream` first: a layer compute
 * call's first use of a shape times its algorithms with a host wait, and of a
 * stream allocates its workspace, neither of which a capture holds), or drives
 * a schedule of the ring made before the capture (since 0.6.0; it must hold
 * no ticket at lwo_ring_capture_begin: at its start, reset, or at its
 * LWO_END).
 * Until lwo_ring_capture_end, other rings' stages and schedules, gradient sets
 * of other pools, new rings, pools, schedules and gradient sets,
 * lwo_ring_query, lwo_grads_wait, lwo_grads_destroy, lwo_graph_destroy and
 * lwo_engine_synchronize of the engine are LWO_ERR_CAPTURING.
 * lwo_ring_capture_end joins the transfer stream back, ends
 * the capture and instantiates the graph; every ticket must be released first,
 * a schedule's by lwo_schedule_reset or its LWO_END, and every gradient layer
 * begun in the capture ended (else LWO_ERR_TICKET_STATE: the capture is
 * discarded and its tickets end; a schedule then goes on from its position,
 * staging again, and a gradient set is as before the capture).
 *
 * A training step: the gradient sets of the ring's pool begin and end in the
 * capture as in an eager step (since 0.6.0). A set joins at its first call in
 * the capture, which waits until nothing of the set runs (LWO_ERR_BUSY if a
 * layer was begun before the capture); its copies to host become memcpy nodes
 * and its host work (the staging buffers' waits, each layer's landing, the
 * accumulation the worker does) host nodes with arguments the graph keeps. The
 * capture runs nothing: lwo_grads_wait and the buffers are as before it. Each
 * launch does what each end did on the host (a layer's first gradient after
 * lwo_grads_zero overwrites, a later one adds), so each layer must be zeroed,
 * or not, as it was at the capture: capture after lwo_grads_zero and zero
 * before each launch (else lwo_graph_launch is LWO_ERR_TICKET_STATE with
 * nothing enqueued). lwo_grads_wait is the fence of the launches;
 * lwo_optim_step after a launch updates each layer once its replayed gradient
 * has landed (it is LWO_ERR_CAPTURING during a capture: the captured ends
 * never land).
 *
 * Resident layers (since 0.6.0): lwo_ring_capture_begin first uploads those
 * changed since their last upload (lwo_pool_layer_changed, lwo_pool_write, an
 * optimizer's update) and waits for them; in the capture their stages are
 * hits and the graph copies nothing into their slots. lwo_graph_launch
 * uploads each one the graph reads that changed since the capture or the
 * last launch, after the last replay and before this one, on `stream`: a
 * replay reads the pool's resident bytes as they are at its launch, moving
 * only the changed ones. (With the engine's checking mode, whose releases
 * poison slots, each replay copies its resident layers as it does streamed
 * ones.)
 *
 * The caller owns the graph; from lwo_ring_capture_end until lwo_graph_destroy
 * the graph owns the ring and the gradient sets it ends: the ring's stages,
 * acquires and releases, lwo_ring_destroy, the sets' begins and ends and
 * lwo_grads_destroy are LWO_ERR_BUSY, and so is lwo_schedule_next of the ring's
 * schedules (one at its LWO_END answers LWO_END; position and reset work: they
 * hold nothing). lwo_graph_launch enqueues one replay on any stream of the
 * engine's device, after an optimizer's pending writes of the captured layers
 * and reads of the gradients it ends, and after the graph's previous replay
 * (replays share the slots); the caller writes the pool's layers only while no
 * replay runs, as before eager stages (LWO_ERR_CAPTURING if `stream`
 * captures: a replay's host side runs once per launch). lwo_graph_destroy
 * waits for the last replay and gives the ring back with its slots empty; a
 * schedule then drives it eagerly from its position. It orders the engine's
 * transfer and gradient streams after the replays, so while a ring of the
 * engine captures it is LWO_ERR_CAPTURING with nothing changed.
 *
 * Threads: the calls of a capture come from one thread at a time, in the order
 * of the pass (other threads' CUDA work stays out of the graph unless it
 * enqueues on a captured stream); a graph's launches and destruction, one
 * thread at a time. Other threads may go on calling lwo meanwhile: a call the
 * capture refuses (LWO_ERR_CAPTURING) and lwo_ring_capture_begin or _join
 * exclude each other, so such a call made as a capture begins is either
 * refused or done with the engine's streams before they join the capture
 * (since 0.6.0), and two captures never begin together. Not captured
 * (LWO_ERR_UNSUPPORTED): rings with
 * LWO_RING_TIMING, staged and sharded pools; the host-only test backend
 * records no graphs. */
typedef struct lwo_graph lwo_graph;

LWO_API lwo_status_t lwo_ring_capture_begin(lwo_ring* ring, lwo_stream_t stream);
LWO_API lwo_status_t lwo_ring_capture_end(lwo_ring* ring, lwo_stream_t stream,
                                          lwo_graph** graph);
LWO_API lwo_status_t lwo_graph_launch(lwo_graph* graph, lwo_stream_t stream);
/* NULL does nothing. */
LWO_API lwo_status_t lwo_graph_destroy(lwo_graph* graph);

/* Joining a capture the caller began (since 0.6.0): what a framework that
 * captures and replays on its own needs (torch.cuda.graph begins the capture
 * on its stream and replays with cudaGraphLaunch; lwo never sees a launch).
 *
 * lwo_ring_capture_join, while `stream` captures (cudaStreamBeginCapture by
 * the caller, any mode; else LWO_ERR_CAPTURING), does what
 * lwo_ring_capture_begin does but begin a capture: the same refusals, the
 * upload of changed resident layers, the wait until nothing of the ring runs,
 * the slots taken as empty (or kept, with LWO_RING_CAPTURE_WARM), the
 * transfer stream joined to the caller's
 * capture. (lwo's host waits and queries are never of captured work, and are
 * made with the calling thread's capture mode relaxed: a capture in global
 * mode, torch's default, refuses neither the join's waits nor those of lwo's
 * own threads, such as an optimizer's wait for a landing.) The caller then
 * stages, acquires, computes and releases on `stream`, by hand or with a
 * schedule of the ring, as in lwo_ring_capture_begin's capture, with its
 * refusals. lwo_ring_capture_leave, on the same stream and with every ticket
 * released (else LWO_ERR_TICKET_STATE with nothing changed: release them in
 * the capture and leave again), joins the transfer stream back into `stream`;
 * it ends nothing and instantiates nothing. The caller ends its capture after
 * it (before it, cudaStreamEndCapture fails: the transfer stream is unjoined);
 * until then the engine's streams are still streams of that capture, and the
 * engine's other work (stages of other rings, waits, the release) is
 * LWO_ERR_CAPTURING.
 * If the caller's capture ended or was invalidated before the leave, the leave
 * is LWO_ERR_CAPTURING and drops the ring's part: its tickets end and the ring
 * stages eagerly again (once the caller ends an invalidated capture).
 *
 * What a replay does: each is the caller's cudaGraphLaunch. Fixed at the
 * capture: the layers of the pass, their order and their slots (every view's
 * pointers), and the resident layers' bytes; the caller's buffers are its own
 * to keep in place. The copies into streamed slots read the pool's host bytes
 * as they are when they run, as lwo_graph_launch's do; the caller orders its
 * replays one after another (they share the slots: launch them on one
 * stream). Resident layers are read as they were at the join, so while the
 * ring is joined or held, a change of one (lwo_pool_write, _write_quantized,
 * _layer_changed, lwo_optim_step, lwo_optim_write of a master) is LWO_ERR_BUSY
 * with nothing changed. Not supported in a joined capture: what
 * lwo_ring_capture_begin refuses.
 *
 * A training step (since 0.6.0): gradient sets of the ring's pool take part
 * as in lwo_ring_capture_begin's capture (begin and end in the capture; the
 * leave is LWO_ERR_TICKET_STATE, nothing changed, while a gradient layer is
 * begun and not ended), and the leave ends the ring's part with an event
 * record node of the graph. Each launch of such a graph needs its host side,
 * which lwo_ring_capture_replay does before it; without gradient sets the
 * call is optional (it waits for the pool's writer, as lwo_optim_wait would),
 * except for a ring made with LWO_RING_CAPTURE_WARM whose capture hit a layer
 * its slots held: the call copies it again where needed.
 *
 * lwo_ring_capture_replay(ring, stream): call it right before each
 * cudaGraphLaunch of the graph instantiated from the capture the ring joined
 * and left (between lwo_ring_capture_leave and lwo_ring_capture_release),
 * with the stream of that launch; then launch, once. It does what
 * lwo_graph_launch does before its launch: waits for the host optimizer's
 * writes of the layers the graph copies and for its reads of the graph's
 * gradient layers, refuses a replay that would land gradients wrongly
 * (LWO_ERR_TICKET_STATE, as lwo_graph_launch: call lwo_grads_zero before each
 * replay when the graph was captured after one), copies again the layers a
 * warm capture (LWO_RING_CAPTURE_WARM) read in place whose pool bytes changed
 * since, orders `stream` after the last replay, and takes each gradient end
 * of the replay in (its serial: the fence and the optimizer then wait for its
 * landing, as for an eager end).
 * `stream` may be NULL, the legacy default stream (where a framework's
 * replay on its default stream launches). Refused, with nothing changed:
 * LWO_ERR_CAPTURING if the ring holds no graph of the caller's (not left, or
 * an lwo_graph's), if `stream` captures, or while a ring of the engine
 * captures; LWO_ERR_CAPTURING too after a launch that was not announced,
 * which lwo sees only once its gradient ends ran: that launch's gradients
 * are not taken in, and this call and lwo_grads_wait say so until
 * lwo_grads_zero. A launch without the call is the caller's error that lwo
 * cannot prevent: its copies may race the optimizer's writes of the pool and
 * reads of the gradients. A call not followed by its launch leaves the
 * optimizer waiting for gradients that never land. Threads: the caller's
 * thread of the capture's calls; it may block until the optimizer is done
 * with the layers.
 *
 * Lifetime: from lwo_ring_capture_leave until lwo_ring_capture_release the
 * caller's graph holds the ring: its stages, acquires, releases, schedules'
 * nexts and destruction are LWO_ERR_BUSY, as under an lwo_graph. The caller
 * calls lwo_ring_capture_release once it will launch the graph no more
 * (typically as it destroys it), on a stream that every launch was enqueued
 * on or ordered before (the legacy default stream, NULL, if the launches ran
 * on blocking streams); it enqueues an event there and orders the ring's
 * (and its gradient sets') later copies after it, waiting for nothing (the
 * last replays may still run) unless gradient sets took part: then it waits
 * on the host for the last replay's gradient ends to run (their host work
 * refers to the sets) and gives the sets back. Call it also when the caller's
 * capture failed after the leave. A graph
 * instantiated from that capture must not be launched after the release.
 * LWO_ERR_CAPTURING if `stream` captures, or if the ring is held by no graph
 * of the caller's (not left yet, or held by an lwo_graph), and with nothing
 * changed while a ring of the engine captures (it orders the transfer stream
 * after the event).
 *
 * Threads: as lwo_ring_capture_begin's capture: the calls from one thread at
 * a time, in the pass's order. */
LWO_API lwo_status_t lwo_ring_capture_join(lwo_ring* ring, lwo_stream_t stream);
LWO_API lwo_status_t lwo_ring_capture_leave(lwo_ring* ring, lwo_stream_t stream);
LWO_API lwo_status_t lwo_ring_capture_replay(lwo_ring* ring, lwo_stream_t stream);
LWO_API lwo_status_t lwo_ring_capture_release(lwo_ring* ring, lwo_stream_t stream);

typedef struct lwo_ring_info {
  size_t size;            /* sizeof(lwo_ring_info), set by the caller */
  uint32_t depth;
  uint32_t n_free;        /* slots that are empty or released */
  uint64_t slot_bytes;
  uint32_t n_resident;      /* resident layers (since 0.4.0) */
  uint64_t resident_bytes;  /* their records' bytes on the device (since 0.4.0) */
} lwo_ring_info;

LWO_API lwo_status_t lwo_ring_get_info(const lwo_ring* ring, lwo_ring_info* info);

typedef struct lwo_ring_stats {
  size_t size;              /* sizeof(lwo_ring_stats), set by the caller */
  uint64_t n_stages;        /* successful lwo_ring_stage calls */
  uint64_t n_hits;          /* of which found the layer already in a slot */
  uint64_t n_copies;        /* host-to-device copies enqueued (a
                               non-contiguous layer may take several) */
  uint64_t bytes_copied;
  /* With LWO_RING_TIMING only (else 0): */
  double copy_ms;           /* sum of the copies' durations on the GPU */
  double wait_ms;           /* time consumer streams stood waiting in
                               lwo_ring_acquire for copies to land */
  double bandwidth_gbps;    /* bytes_copied / copy_ms, in 1e9 bytes/s */
  /* Since 0.4.0: resident layers. n_hits and n_copies / bytes_copied include
   * these (the uploads at lwo_ring_create count until the first reset). */
  uint64_t n_resident_hits;         /* stages of resident layers (all hits) */
  uint64_t n_resident_uploads;      /* copies of resident layers: at creation,
                                       and after each change */
  uint64_t resident_bytes_uploaded; /* their bytes */
} lwo_ring_stats;

/* Statistics since creation or the last reset. With LWO_RING_TIMING, both
 * calls block until the timed work enqueued so far has finished, and
 * lwo_ring_stage blocks on the oldest interval when more than 256 timed
 * intervals are pending (a consumer far behind the host). */
LWO_API lwo_status_t lwo_ring_get_stats(lwo_ring* ring, lwo_ring_stats* stats);
LWO_API lwo_status_t lwo_ring_reset_stats(lwo_ring* ring);

/* ------------------------------------------------------------------------ */
/* Schedules                                                                 */
/* ------------------------------------------------------------------------ */

/* Threads: one thread at a time (calls are serialised, but two threads
 * driving one schedule would take each other's layers). */
typedef struct lwo_schedule lwo_schedule;

/* A pass over an ordered list of layer ids of the ring's pool (copied; ids
 * may repeat). */
LWO_API lwo_status_t lwo_schedule_create(lwo_ring* ring, const uint32_t* layers,
                                         uint32_t n_layers, lwo_schedule** schedule);

/* Releases every layer the schedule still holds or has staged ahead, on the
 * stream of the last lwo_schedule_next or lwo_schedule_reset (the legacy
 * default stream if there was none), then destroys it. LWO_ERR_CAPTURING
 * (since 0.6.0) while another ring of the engine captures a CUDA graph and
 * the schedule holds tickets: the releases would be outside the graph. */
LWO_API lwo_status_t lwo_schedule_destroy(lwo_schedule* schedule);

/* One step of the pass: releases the previously returned layer on `stream`,
 * stages up to the ring's depth of layers ahead, makes `stream` wait for the
 * next layer and returns its view (as lwo_ring_acquire does). After the last
 * layer it releases that one and returns LWO_END (view untouched). If the
 * next layer cannot be staged (for example LWO_ERR_LAYER_BUSY because the
 * caller holds it), the previous layer stays released, the position does
 * not advance, and a later call retries; the message names
 * lwo_schedule_next, the position and the layer, then the staging error.
 * After LWO_END every call returns LWO_END again (holding nothing) until
 * lwo_schedule_reset. During a capture of the schedule's ring its stages,
 * acquires and releases are captured (lwo_ring_capture_begin); while another
 * ring captures it is LWO_ERR_CAPTURING with nothing changed (since 0.6.0). */
LWO_API lwo_status_t lwo_schedule_next(lwo_schedule* schedule, lwo_stream_t stream,
                                       lwo_layer_view* view);

/* Position of the next layer lwo_schedule_next will return (0..n_layers). */
LWO_API lwo_status_t lwo_schedule_position(const lwo_schedule* schedule,
                                           uint32_t* position);

/* Releases whatever the schedule holds on `stream` and restarts the pass from
 * the first layer. Layers still in slots will be hits. LWO_ERR_CAPTURING
 * while another ring captures and the schedule holds tickets (since 0.6.0). */
LWO_API lwo_status_t lwo_schedule_reset(lwo_schedule* schedule, lwo_stream_t stream);

/* ------------------------------------------------------------------------ */
/* The planner (since 0.4.0)                                                 */
/* ------------------------------------------------------------------------ */

/* Threads: any thread; a plan is read-only once made.
 *
 * Given a pool, a device memory budget, a pass (a forward, or a training
 * step: forward, then backward in reverse order with the trainable layers'
 * gradients going to the host) and each layer's compute time, the planner
 * chooses which layers stay resident and the ring depth that minimise the
 * predicted pass time within the budget, and predicts the pass layer by
 * layer (when each compute starts, how long it waits for its weights). The
 * model and the search are described in docs/ARCHITECTURE.md ("The
 * planner"). lwo_plan_ring_config turns the plan into the ring to create. */
typedef struct lwo_plan lwo_plan;

/* The pass is a training step (forward, then backward) rather than a forward. */
#define LWO_PLAN_TRAIN 0x1u
/* Measure the link on the engine's device (host to device, device to host,
 * and both at once, with pinned buffers of calibrate_bytes on the engine's
 * streams; it blocks for the copies) instead of taking the rates below. */
#define LWO_PLAN_CALIBRATE_LINK 0x2u
/* Also choose how to group the streamed layers: runs of consecutive streamed
 * layers to store as one record each, so that fewer copies pay the per-copy
 * overhead (copy_overhead_ms) within the budget (a grouped record needs a
 * slot as large as itself). The plan only recommends groups: the caller
 * builds a pool with one record per group (lwo_plan_get_group) to use them.
 * With LWO_PLAN_CALIBRATE_LINK the overhead is measured too: a second
 * host-to-device calibration at calibrate_bytes / 64 (at least 4096 bytes), and
 * t = overhead + bytes / rate fitted through the two sizes. */
#define LWO_PLAN_GROUP 0x4u

typedef struct lwo_plan_config {
  size_t size;               /* sizeof(lwo_plan_config) */
  uint32_t flags;            /* LWO_PLAN_TRAIN | LWO_PLAN_CALIBRATE_LINK */
  uint32_t grad_depth;       /* gradient staging slots of a step; default 2 */
  uint64_t budget_bytes;     /* device bytes the plan may use; 0: what the
                                engine's budget has left (lwo_engine_get_memory
                                `left`), or the device's free memory */
  const double* fwd_ms;      /* per layer (n_layers): forward compute, ms; required */
  const double* bwd_ms;      /* per layer: backward compute, ms; required for a step */
  const uint8_t* trainable;  /* per layer, 1 = its gradients go to the host in
                                a step; NULL: every layer */
  const uint64_t* grad_bytes;/* per layer: gradient bytes of a trainable layer;
                                NULL: its tensors' bytes (the layer's dtype) */
  /* The link, in 1e9 bytes/s: each direction alone and both at once (0: as
   * alone). Ignored with LWO_PLAN_CALIBRATE_LINK. */
  double h2d_gbps, d2h_gbps, duplex_h2d_gbps, duplex_d2h_gbps;
  uint64_t calibrate_bytes;  /* per copy when calibrating; default 256 MiB */
  const uint32_t* depths;    /* ring depths to try (1..LWO_MAX_RING_DEPTH);
                                NULL: 1, 2, 3, 4, 6, 8 */
  uint32_t n_depths;
  /* Since 0.4.0 (grouping): the fixed cost of one host-to-device copy on top
   * of bytes / h2d rate, ms (finite, >= 0; 0: none). Used by the prediction
   * with or without LWO_PLAN_GROUP; measured instead with
   * LWO_PLAN_GROUP | LWO_PLAN_CALIBRATE_LINK. */
  double copy_overhead_ms;
} lwo_plan_config;

#define LWO_PLAN_CONFIG_INIT \
  {sizeof(lwo_plan_config), 0u, 2u, 0u, NULL, NULL, NULL, NULL, 0.0, 0.0, 0.0, 0.0, 0u, NULL, 0u, \
   0.0}
LWO_API void lwo_plan_config_init(lwo_plan_config* config);

/* Chooses and predicts. Errors: a NULL config, fwd_ms (or bwd_ms for a
 * step), a negative or non-finite time or copy_overhead_ms, a rate <= 0
 * without calibration, a depth outside 1..LWO_MAX_RING_DEPTH
 * (LWO_ERR_INVALID_ARGUMENT); a sharded pool (LWO_ERR_UNSUPPORTED: resident
 * layers are refused there); a budget that not even a ring of the smallest
 * depth fits (LWO_ERR_OVER_BUDGET, with the bytes it needs). */
LWO_API lwo_status_t lwo_plan_create(lwo_pool* pool, const lwo_plan_config* config,
                                     lwo_plan** plan);
LWO_API lwo_status_t lwo_plan_destroy(lwo_plan* plan);

typedef struct lwo_plan_info {
  size_t size;               /* sizeof(lwo_plan_info), set by the caller */
  uint32_t depth;            /* the ring depth chosen */
  uint32_t n_resident;       /* layers kept resident */
  uint32_t n_positions;      /* positions of the pass: L, or 2L for a step */
  uint32_t train;            /* 1 for a training step */
  uint64_t device_bytes;     /* the plan's device bytes (slots, resident
                                records, gradient staging), unrounded */
  uint64_t budget_bytes;     /* the budget it was chosen for */
  double predicted_ms;       /* the pass, in the steady state */
  double predicted_stall_ms; /* compute waiting for weights, summed */
  uint64_t h2d_bytes, d2h_bytes;  /* the pass's transfers */
  double h2d_gbps, d2h_gbps, duplex_h2d_gbps, duplex_d2h_gbps;  /* the link used */
  double first_k_ms;         /* the "first k layers resident" rule at the
                                same depth and budget, for comparison */
  /* Since 0.4.0 (grouping). */
  uint32_t n_groups;         /* records of the plan: n_layers without grouping */
  uint32_t reserved;
  double ungrouped_ms;       /* the best plan with one record per layer */
  double copy_overhead_ms;   /* the per-copy overhead used */
} lwo_plan_info;

LWO_API lwo_status_t lwo_plan_get_info(const lwo_plan* plan, lwo_plan_info* info);

/* One position of the predicted pass (schedule order: records 0..R-1, then
 * for a step R-1..0 backward). R is n_groups: with grouping a position's
 * `layer` is a group's index (lwo_plan_get_group), otherwise the layer's. */
typedef struct lwo_plan_position {
  size_t size;          /* sizeof(lwo_plan_position), set by the caller */
  uint32_t layer;
  uint32_t backward;    /* 1 in a step's backward half */
  uint32_t resident;    /* 1 if the layer is resident */
  uint32_t hit;         /* 1 if streamed but still in a slot */
  double copy_ms;       /* its copy (0 if resident or a hit) */
  double start_ms;      /* its compute's start, from the pass's start */
  double stall_ms;      /* how long its compute waited for the weights */
} lwo_plan_position;

/* LWO_ERR_OUT_OF_RANGE for position >= n_positions. */
LWO_API lwo_status_t lwo_plan_get_position(const lwo_plan* plan, uint32_t position,
                                           lwo_plan_position* out);

/* The plan as a ring config: depth, resident_layers (ascending; the array
 * lives as long as the plan) and n_resident; size and flags are kept. The
 * indices are records of the plan: group indices with grouping (for the
 * pool built with one record per group), layer indices otherwise. */
LWO_API lwo_status_t lwo_plan_ring_config(const lwo_plan* plan, lwo_ring_config* config);

/* Since 0.4.0. One record the plan recommends (index < n_groups, in layer
 * order): layers first_layer .. first_layer + n_layers - 1 stored as one
 * record. Without LWO_PLAN_GROUP every group is one layer. */
typedef struct lwo_plan_group {
  size_t size;           /* sizeof(lwo_plan_group), set by the caller */
  uint32_t first_layer;
  uint32_t n_layers;
  uint32_t resident;     /* 1 if kept resident (the whole record) */
  uint32_t reserved;
  uint64_t bytes;        /* its layers' record bytes, summed */
} lwo_plan_group;

/* LWO_ERR_OUT_OF_RANGE for group >= n_groups. */
LWO_API lwo_status_t lwo_plan_get_group(const lwo_plan* plan, uint32_t group,
                                        lwo_plan_group* out);

/* ------------------------------------------------------------------------ */
/* Layer compute: linear layers                                              */
/* ------------------------------------------------------------------------ */

/* The layer has a bias b[out_features]. */
#define LWO_LINEAR_BIAS 0x1u
/* f32 layers may use TF32 tensor cores (about 10 bits of mantissa in the
 * products); without it f32 layers compute in full f32. */
#define LWO_LINEAR_TF32 0x2u
/* Backward adds into dweight and dbias (dW += dy^T x, db += the sum of dy)
 * instead of overwriting them: one layer's gradients summed over several
 * micro-batches on the GPU while the layer sits in its slot. The sum is
 * formed in f32 and rounded once per call to grad_dtype. Since 0.3.0. */
#define LWO_LINEAR_ACCUMULATE 0x4u

/* y[tokens, out] = x[tokens, in] * W[out, in]^T (+ b[out]). Every matrix is
 * row-major and dense; x, W, b, y and dx share `dtype` (bf16, f16 or f32);
 * products accumulate in f32. W and b usually come from an acquired slot. */
typedef struct lwo_linear_desc {
  size_t size;           /* sizeof(lwo_linear_desc) */
  lwo_dtype_t dtype;     /* LWO_DTYPE_BF16 (default), LWO_DTYPE_F16 or LWO_DTYPE_F32 */
  uint32_t flags;        /* LWO_LINEAR_BIAS | LWO_LINEAR_TF32 | LWO_LINEAR_ACCUMULATE */
  int64_t in_features;   /* >= 1 */
  int64_t out_features;  /* >= 1 */
  /* Since 0.4.0: an lwo_quant_format_t. LWO_QUANT_NONE (0, the default): W
   * is dense in `dtype`. Else W is a quantized tensor of that format,
   * [out_features x in_features] (rows x cols, as lwo_quant_layout lays it
   * out, for example a quantized record tensor in a ring slot): the call
   * dequantizes it on `stream` into the stream's weight workspace in `dtype`
   * (engine-owned, grown on first use of a larger weight: the call then waits
   * for its stream once) and runs the same GEMM; bias, x, y, dy and dx stay
   * in `dtype`. Frozen only: lwo_linear_backward refuses dweight and dbias
   * (LWO_ERR_QUANTIZED_WEIGHT). */
  int32_t weight_format;
} lwo_linear_desc;

#define LWO_LINEAR_DESC_INIT {sizeof(lwo_linear_desc), LWO_DTYPE_BF16, 0u, 0, 0, 0}
LWO_API void lwo_linear_desc_init(lwo_linear_desc* desc);

/* Enqueues y = x W^T (+ b) on `stream` (tokens >= 1; any sizes below 2^31,
 * aligned or not: LWO_ERR_OUT_OF_RANGE above). The GEMM algorithm is chosen
 * once per shape, dtype and pointer alignment (timed on first use unless
 * LWO_ENGINE_HEURISTIC_GEMM) and cached in the engine;
 * each stream gets its own workspace (32 MiB or what a convolution needs,
 * kept until the engine is destroyed). All pointers are device
 * memory of the engine's device; `bias` is read only with LWO_LINEAR_BIAS. */
LWO_API lwo_status_t lwo_linear_forward(lwo_engine* engine, const lwo_linear_desc* desc,
                                        int64_t tokens, const void* x, const void* weight,
                                        const void* bias, void* y, lwo_stream_t stream);

/* Enqueues the backward pass on `stream`: dx = dy W (skipped if dx is NULL);
 * for a trainable layer dweight = dy^T x ([out, in]) and, with
 * LWO_LINEAR_BIAS, dbias = the sum of dy over tokens, both in `grad_dtype`
 * (LWO_DTYPE_F32, or the layer's dtype): the products accumulate in f32
 * over the tokens and are rounded once to grad_dtype. With
 * LWO_LINEAR_ACCUMULATE they are added to what dweight and dbias hold. Pass
 * NULL dweight and dbias for a frozen layer. x is the forward input (may be
 * NULL when dweight is). With a quantized weight (desc->weight_format, since
 * 0.4.0) dx only: a dweight or dbias is LWO_ERR_QUANTIZED_WEIGHT, except
 * (since 0.6.0) for LWO_QUANT_FP8_E4M3_BLOCK128, which trains: dweight is
 * then the dense [out, in] gradient (it reads x and dy, never W; dx reads
 * W's dequantization, as the forward does). */
LWO_API lwo_status_t lwo_linear_backward(lwo_engine* engine, const lwo_linear_desc* desc,
                                         int64_t tokens, const void* x, const void* dy,
                                         const void* weight, void* dx, void* dweight,
                                         void* dbias, lwo_dtype_t grad_dtype,
                                         lwo_stream_t stream);

/* ------------------------------------------------------------------------ */
/* Weight gradients to host memory                                          */
/* ------------------------------------------------------------------------ */

/* Threads: any thread; calls serialise internally (the accumulation runs on
 * the engine's host threads, behind the lwo_grads_wait fence). */
typedef struct lwo_grads lwo_grads;

/* Gradients, by default (flags 0, from 0.3.0): each tensor's gradient is
 * written on the GPU, sent and kept on the host in the tensor's own dtype
 * (bf16, f16 or f32). A layer's first gradient after lwo_grads_zero lands by
 * DMA straight in its host buffer, with no host work; each later one (a
 * micro-batch summed on the host) goes through a pinned staging buffer and
 * is added on the engine's host threads: element by element in f32, rounded
 * once to the buffer's dtype (round to nearest even). Sharded pools of more
 * than one rank are the exception: they reduce, send and keep f32.
 *
 * LWO_GRADS_F32 (since 0.3.0): f32 on the wire and f32 host buffers (the
 * 0.2 default): twice the traffic of a bf16 layer, and sums that round only
 * in f32.
 * LWO_GRADS_NATIVE_WIRE: the tensor's own dtype on the wire, f32 host
 * buffers: the host widens every gradient and adds it. At most one of the
 * two. */
#define LWO_GRADS_NATIVE_WIRE 0x1u
#define LWO_GRADS_F32 0x2u

typedef struct lwo_grads_config {
  size_t size;         /* sizeof(lwo_grads_config) */
  uint32_t depth;      /* device staging slots, 1..64; default 2 */
  uint32_t flags;      /* 0 (native), LWO_GRADS_F32 or LWO_GRADS_NATIVE_WIRE */
  uint32_t n_threads;  /* host threads for first-touching the buffers (at
                          most 64) and for accumulating (at most 32); 0 = one
                          per core, within those limits */
  lwo_nccl_comm_t replica_comm; /* since 0.6.0; NULL (and for a caller's
                          smaller struct): none. With a sharded pool, the
                          communicator of the ranks that hold this rank's
                          shard in other groups (the same rank of the pool's
                          communicator on the other nodes): lwo_grads_end
                          sums this rank's part, after the sum over the
                          pool's communicator, over it too, on the
                          collective stream before the copy to host, so each
                          rank's host shard is the sum over every rank of
                          both. Every rank of it must end the same layers in
                          the same order. The caller keeps it alive while
                          the set exists. LWO_ERR_UNSUPPORTED with a pool that
                          is not sharded; LWO_ERR_INVALID_ARGUMENT if it is
                          the pool's communicator or on another device. */
} lwo_grads_config;

#define LWO_GRADS_CONFIG_INIT {sizeof(lwo_grads_config), 2u, 0u, 0u, NULL}
LWO_API void lwo_grads_config_init(lwo_grads_config* config);

/* Creates host gradient buffers (in each tensor's dtype, or f32: see
 * LWO_GRADS_F32), zeroed, one per tensor of every trainable
 * layer of `pool` (`trainable`: n_layers bytes, nonzero = trainable; NULL =
 * every layer), and `depth` device staging slots, each the size of the
 * largest trainable layer's gradients on the wire. Trainable tensors must be
 * f32, bf16 or f16. LWO_ERR_BUSY destroying the pool while it exists.
 * From 0.4.0: a trainable layer (trainable NULL: every layer) that holds a
 * quantized tensor (LWO_EXT_TENSOR_QUANT, or an fp8 checkpoint weight) is
 * LWO_ERR_QUANTIZED_WEIGHT, naming the layer, the tensor and the format.
 * Since 0.6.0 LWO_QUANT_FP8_E4M3_BLOCK128 tensors train: the gradient of
 * one is dense, rows x cols of the tensor's logical dtype (or f32 with
 * LWO_GRADS_F32), on the wire (the view's tensor_bytes) and in host memory,
 * and lwo_optim keeps its f32 masters and writes its record; every other
 * format stays LWO_ERR_QUANTIZED_WEIGHT.
 *
 * Gradients of a sharded pool (lwo_pool_create_sharded) are summed over the
 * ranks: lwo_grads_end reduces the layer's f32 gradients across the
 * communicator on the engine's collective stream, so that each rank holds
 * the sum of every rank's gradient for the elements of its own weight shard,
 * and copies only that part to host memory (about 1/N of the layer). Read it
 * with lwo_grads_tensor. The wire and the buffers are always f32 (flags 0
 * mean that here; LWO_GRADS_NATIVE_WIRE gives LWO_ERR_UNSUPPORTED), and
 * lwo_grads_end is a collective: every rank must
 * end the same layers in the same order, interleaved alike with its ring
 * stages (see LWO_ENGINE_CHECK_COLLECTIVES). Frozen layers move nothing. */
LWO_API lwo_status_t lwo_grads_create(lwo_pool* pool, const uint8_t* trainable,
                                      const lwo_grads_config* config, lwo_grads** grads);

/* Waits for every transfer, then frees. LWO_ERR_BUSY while a layer is begun
 * and not ended, and (since 0.6.0) while a capture or a CUDA graph holds the
 * set; LWO_ERR_CAPTURING while a ring of the engine captures (since 0.6.0:
 * the wait would be of the gradient stream, which a capture may hold). */
LWO_API lwo_status_t lwo_grads_destroy(lwo_grads* grads);

/* Claims a staging slot for the gradients of trainable `layer`: makes
 * `stream` wait until the slot's previous contents have left for the host,
 * and returns the slot's device addresses in `view` (one per tensor, in the
 * layer's tensor order, each the tensor's shape in its wire dtype, which
 * view.tensor_dtypes names: the tensor's own, or f32 with LWO_GRADS_F32 and
 * on sharded pools). Write every tensor's gradient there on `stream` (for
 * example with lwo_linear_backward: several micro-batches may be summed in
 * the slot with LWO_LINEAR_ACCUMULATE), then call lwo_grads_end. LWO_ERR_RING_FULL if every slot is begun;
 * LWO_ERR_LAYER_BUSY if the layer is already begun; LWO_ERR_INVALID_ARGUMENT
 * for a frozen layer. From 0.4.0: where an optimizer (lwo_optim) is still
 * reading the layer's gradients, the call first blocks until it is done
 * (and lwo_grads_wait, so lwo_grads_zero, until it is done with the layers
 * it zeroes). Since 0.6.0 lwo_grads_begin and lwo_grads_end are captured
 * while a ring of the set's pool captures (lwo_ring_capture_begin, or
 * lwo_ring_capture_join with lwo_ring_capture_replay before each launch). */
LWO_API lwo_status_t lwo_grads_begin(lwo_grads* grads, uint32_t layer, lwo_stream_t stream,
                                     lwo_layer_view* view);

/* Sends the gradients written on `stream` before this call to the host: the
 * engine's gradient stream waits for `stream`, copies the slot to host
 * memory and adds it into the layer's host buffers. Returns once enqueued;
 * the host must not read the buffers before lwo_grads_wait.
 * LWO_ERR_TICKET_STATE if the layer was not begun. */
LWO_API lwo_status_t lwo_grads_end(lwo_grads* grads, uint32_t layer, lwo_stream_t stream);

/* The fence: blocks until every gradient ended so far has landed in host
 * memory and been accumulated (since 0.6.0 those of a CUDA graph's launches
 * too). The only way the host may safely read the buffers. LWO_ERR_BUSY
 * (after waiting for the rest) if a layer is begun and not ended;
 * LWO_ERR_CAPTURING after a launch of the caller's graph that
 * lwo_ring_capture_replay did not announce, until lwo_grads_zero. */
LWO_API lwo_status_t lwo_grads_wait(lwo_grads* grads);

/* Waits as lwo_grads_wait does, then starts new sums: the next gradient of
 * each layer overwrites its buffers instead of adding to them, and the next
 * lwo_grads_wait zeroes the buffers of layers that got no gradient since, so
 * after it every buffer holds exactly the sum of the gradients ended since
 * the zero (zero, if none). Costs no memory traffic for layers that get a
 * gradient. As always, read the buffers only after lwo_grads_wait. */
LWO_API lwo_status_t lwo_grads_zero(lwo_grads* grads);

/* Non-blocking: *done = 1 if every gradient ended so far has landed in host
 * memory and been accumulated, so lwo_grads_wait would not wait for the
 * GPU; else 0. Read the buffers only after lwo_grads_wait all the same (it
 * is the fence, and finishes lazy zeroing). Since 0.2.0. */
LWO_API lwo_status_t lwo_grads_query(lwo_grads* grads, uint32_t* done);

/* One tensor's host gradient: the part of it that this rank holds. Since
 * 0.3.0. */
typedef struct lwo_grad_tensor {
  size_t size;             /* sizeof(lwo_grad_tensor), set by the caller */
  void* data;              /* host memory owned by the grads object, valid
                              until it is destroyed; NULL when n_elements is 0 */
  lwo_dtype_t dtype;       /* of the host buffer: the tensor's, or f32 */
  uint64_t first_element;  /* of the tensor, in its row-major order */
  uint64_t n_elements;
} lwo_grad_tensor;

#define LWO_GRAD_TENSOR_INIT {sizeof(lwo_grad_tensor), NULL, LWO_DTYPE_F32, 0, 0}

/* The gradient accessor: tensor `name`'s host gradient, elements
 * [first_element, first_element + n_elements) of the tensor at data. For a
 * sharded pool these are exactly the elements of the tensor that lie in
 * this rank's weight shard (see lwo_pool_shard_tensor), summed over the
 * ranks; n_elements may be 0. For any other pool it is the whole tensor
 * (first element 0). Read it only after lwo_grads_wait. Since 0.3.0. */
LWO_API lwo_status_t lwo_grads_tensor(lwo_grads* grads, uint32_t layer, const char* name,
                                      lwo_grad_tensor* info);

/* lwo_grads_tensor for f32 host buffers (LWO_GRADS_F32, LWO_GRADS_NATIVE_WIRE,
 * f32 tensors, sharded pools): the same part as a float pointer. A buffer of
 * another dtype is LWO_ERR_BAD_DTYPE (use lwo_grads_tensor). */
LWO_API lwo_status_t lwo_grads_shard(lwo_grads* grads, uint32_t layer, const char* name,
                                     float** data, uint64_t* first_element,
                                     uint64_t* n_elements);

typedef struct lwo_grads_stats {
  size_t size;               /* sizeof(lwo_grads_stats), set by the caller */
  uint64_t n_transfers;      /* successful lwo_grads_end calls */
  uint64_t bytes;            /* bytes those calls copied device to host (this
                                rank's part, on the wire dtype) */
  uint64_t n_accumulated;    /* of those layers, how many the host has
                                converted or added so far (the rest landed
                                in place by DMA, or are still on their way) */
  uint64_t accumulated_bytes; /* wire bytes those host additions read (since 0.3.0) */
  uint64_t accumulate_ns;    /* their wall-clock time on the host, summed over
                                layers (since 0.3.0): accumulated_bytes over it
                                is the host's adding speed */
} lwo_grads_stats;

LWO_API lwo_status_t lwo_grads_get_stats(lwo_grads* grads, lwo_grads_stats* stats);

/* ------------------------------------------------------------------------ */
/* The optimizer step on the host (since 0.4.0)                             */
/* ------------------------------------------------------------------------ */

/* Threads: any thread; calls serialise internally (the updates run on the
 * optimizer's own host threads, behind the lwo_optim_wait fence).
 *
 * An optimizer over a gradient set and its pool: f32 master weights (made
 * from the pool's weights) and state for every tensor of every trainable
 * layer, in host memory. lwo_optim_step, called once the step's last
 * lwo_grads_end of every layer has been enqueued, updates each layer as soon
 * as its gradients have landed in host memory (and been added), on host
 * threads, while the GPU goes on with the rest of the backward pass; it
 * writes the new weights into the pool rounded to each tensor's dtype (round
 * to nearest even) and marks the layers changed. The next lwo_ring_stage of
 * a layer (and the next lwo_grads_begin of it) waits, on the calling host
 * thread, for that layer's update alone (lwo_grads_wait and lwo_grads_zero
 * wait for the update of a layer whose buffers they zero). These are the only
 * calls that block for it besides lwo_optim_wait.
 * An LWO_QUANT_FP8_E4M3_BLOCK128 tensor of a trainable layer (since 0.6.0)
 * trains as any other: its masters start as its record dequantized to f32
 * (code x its block's scale, exact), and each update writes the record's
 * e4m3 codes and 128 x 128-block scales from the updated masters in the
 * same pass over them (the record's padding is left as it is): exactly what
 * lwo_quantize writes from the masters, under the same fences. A block with
 * a NaN or infinite updated master gets scale NaN and codes 0x7f (NaN).
 * Clipping, delayed updates (the record lags as dense weights do), groups
 * and bf16 state apply to it unchanged.
 * The pool must be pinned, registered or sharded (not a checkpoint). On a
 * sharded pool (since 0.6.0) each rank's optimizer holds the masters and
 * state of its shard of every tensor (the elements lwo_pool_shard_tensor
 * gives) and updates them from the same elements of the gradient summed over
 * the ranks (lwo_grads_shard); lwo_optim_read / lwo_optim_write then copy
 * those elements, and with more than one rank LWO_OPTIM_CLIPPING and
 * LWO_OPTIM_STOCHASTIC_ROUNDING are LWO_ERR_UNSUPPORTED. */
typedef struct lwo_optim lwo_optim;

typedef enum lwo_optim_kind_t {
  /* PyTorch's AdamW: p *= 1 - lr wd; m = b1 m + (1 - b1) g;
   * v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) m / (sqrt(v) / sqrt(1 - b2^t) + eps) */
  LWO_OPTIM_ADAMW = 0,
  /* SGD with PyTorch's momentum and dampening, its weight decay decoupled as
   * AdamW's (PyTorch's SGD instead adds wd p to the gradient): p *= 1 - lr wd;
   * b = momentum b + (1 - dampening) g (b = g on step 1); p -= lr b */
  LWO_OPTIM_SGD = 1,
  LWO_OPTIM_KIND_FORCE_32 = 0x7fffffff
} lwo_optim_kind_t;

/* bf16 state (state_dtype LWO_DTYPE_BF16) rounded stochastically instead of
 * to nearest even: deterministic for a seed (a counter-based hash of the
 * seed, layer, tensor, step and element; docs/ARCHITECTURE.md). */
#define LWO_OPTIM_STOCHASTIC_ROUNDING 0x1u
/* Allows clipping by global norm (max_norm in the step): keeps a second
 * copy of the masters and state (twice their memory), so that each layer is
 * updated speculatively as it lands and redone from the copy when the norm
 * of the whole step's gradients exceeds max_norm. */
#define LWO_OPTIM_CLIPPING 0x2u
/* The one-step-delayed update: the pool lags the masters by one step. Each
 * layer's pool bytes become the previous step's update as the layer's
 * gradients land (after this step's last read of the old bytes), and the
 * step's updates run once every layer has landed, overlapping the next
 * step's forward (whose stages then wait only for that copy). Staleness one
 * step: step k+1's gradients are taken at the weights of step k - 1 and
 * applied to the masters of step k. lwo_optim_wait brings the pool up to the
 * masters. Not with LWO_OPTIM_CLIPPING. */
#define LWO_OPTIM_DELAYED 0x4u

typedef struct lwo_optim_config {
  size_t size;              /* sizeof(lwo_optim_config) */
  lwo_optim_kind_t kind;    /* LWO_OPTIM_ADAMW (default) or LWO_OPTIM_SGD */
  lwo_dtype_t state_dtype;  /* of the moments: LWO_DTYPE_F32 (default) or LWO_DTYPE_BF16 */
  uint32_t flags;           /* LWO_OPTIM_STOCHASTIC_ROUNDING, LWO_OPTIM_CLIPPING,
                               LWO_OPTIM_DELAYED */
  uint32_t n_threads;       /* parts of each update, each on a fixed host thread of the
                               library's pool (one thread per CPU), at most 64; 0 = one
                               per CPU */
  uint64_t seed;            /* the stochastic rounding's stream */
} lwo_optim_config;

#define LWO_OPTIM_CONFIG_INIT {sizeof(lwo_optim_config), LWO_OPTIM_ADAMW, LWO_DTYPE_F32, 0u, 0u, 0u}
LWO_API void lwo_optim_config_init(lwo_optim_config* config);

/* Creates the optimizer of `grads` (and its pool): masters from the pool's
 * weights (an fp8 block-128 record's dequantized to f32), state zero. LWO_ERR_INVALID_ARGUMENT for a kind, state dtype or
 * flag outside those above (stochastic rounding needs bf16 state);
 * LWO_ERR_UNSUPPORTED for a checkpoint pool (and the above on a sharded
 * pool of more than one rank); LWO_ERR_BUSY if
 * the gradient set has an optimizer already. LWO_ERR_BUSY destroying the
 * gradient set while the optimizer exists. */
LWO_API lwo_status_t lwo_optim_create(lwo_grads* grads, const lwo_optim_config* config,
                                      lwo_optim** optim);

/* Waits for the step, then frees (its errors are dropped). */
LWO_API lwo_status_t lwo_optim_destroy(lwo_optim* optim);

/* One step's hyperparameters, read like a config (size first). */
typedef struct lwo_optim_step_params {
  size_t size;          /* sizeof(lwo_optim_step_params) */
  uint64_t step;        /* 1 for the first: AdamW's bias correction; SGD's first momentum */
  double lr;            /* >= 0 */
  double beta1, beta2;  /* AdamW, each in [0, 1) */
  double eps;           /* AdamW, > 0 */
  double weight_decay;  /* >= 0 (decoupled, as above) */
  double momentum;      /* SGD, >= 0 */
  double dampening;     /* SGD, in [0, 1] */
  double max_norm;      /* > 0: clip the global gradient norm to it
                           (LWO_OPTIM_CLIPPING); 0: no clipping */
  double extra_sumsq;   /* >= 0, since 0.6.0: the sum of squares of the step's
                           gradients that the optimizer does not hold (parameters
                           updated elsewhere, on the GPU), added to its own
                           before the square root: the global norm is
                           sqrt(own + extra_sumsq); read only with max_norm > 0 */
} lwo_optim_step_params;

#define LWO_OPTIM_STEP_PARAMS_INIT \
  {sizeof(lwo_optim_step_params), 1u, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.0, 0.0, 0.0, 0.0}
LWO_API void lwo_optim_step_params_init(lwo_optim_step_params* params);

/* Starts a step: updates every trainable layer that got a gradient (an
 * lwo_grads_end) since the previous step and was not zeroed since, each
 * once its last such gradient has landed; layers without are left as they
 * are (as PyTorch skips parameters without a gradient). Among the layers
 * that have landed the lowest-numbered is updated first (from 0.5.0; the
 * order the next forward stages them). Returns at once.
 * Call it after the step's last lwo_grads_end of every layer; a later end
 * of a layer is the next step's. LWO_ERR_INVALID_ARGUMENT for a parameter
 * outside its range above, step 0, or max_norm > 0 without
 * LWO_OPTIM_CLIPPING; LWO_ERR_BUSY while the previous step is still
 * running (lwo_optim_wait, or a stage of every updated layer, ends it).
 * With LWO_OPTIM_DELAYED the call first waits for the previous step's
 * updates instead (they run on through the next forward and backward).
 * LWO_ERR_BUSY, starting nothing, if a layer it would update is held as for
 * lwo_pool_write (since 0.6.0). LWO_ERR_CAPTURING, starting nothing, while a
 * ring of the engine captures (since 0.6.0: the captured gradient ends never
 * land; step after each replay). */
LWO_API lwo_status_t lwo_optim_step(lwo_optim* optim, const lwo_optim_step_params* params);

/* Since 0.6.0: hyperparameter groups, as PyTorch's param_groups. Each tensor
 * of a trainable layer is in group 0 until lwo_optim_set_group puts it in
 * another; lwo_optim_step_groups then takes one lwo_optim_step_params per
 * group (params[0] .. params[n_groups - 1]) and updates each tensor with its
 * group's step, lr, betas, eps, weight_decay, momentum and dampening (a group
 * added later counts its own steps, as PyTorch's per-parameter step does);
 * max_norm and extra_sumsq are params[0]'s (clipping takes one global norm),
 * and lwo_optim_info.last_step is params[0].step. lwo_optim_step is
 * lwo_optim_step_groups with one group. LWO_ERR_INVALID_ARGUMENT for
 * n_groups 0, a group's parameter outside its range (the message names the
 * group), or a tensor whose group is n_groups or more (named); lwo_optim_set_group: as lwo_optim_read for the layer and name,
 * LWO_ERR_BUSY while a step runs. */
LWO_API lwo_status_t lwo_optim_set_group(lwo_optim* optim, uint32_t layer, const char* name,
                                         uint32_t group);
LWO_API lwo_status_t lwo_optim_step_groups(lwo_optim* optim, const lwo_optim_step_params* params,
                                           uint32_t n_groups);

/* Since 0.6.0: a step opened before its gradients are ended, so that its
 * updates start with the first gradient that lands rather than once the last
 * lwo_grads_end is enqueued. lwo_optim_step_open takes the layers
 * lwo_optim_step_groups would take now (none, typically) and the parameters
 * of the whole step; each lwo_optim_step_add(layer) then gives the step a
 * layer whose last gradient of the step has been ended (lwo_grads_end), and
 * the layer is updated once that gradient lands, in the order added;
 * lwo_optim_step_close takes every other layer ended since its last update,
 * as lwo_optim_step does, and from then on the step is an ordinary running
 * step (lwo_optim_wait is its fence). Until the close: lwo_optim_wait,
 * lwo_optim_destroy, a step, lwo_optim_read / _write / _set_group and, in
 * checking mode, lwo_grads_zero are LWO_ERR_BUSY; lwo_grads_begin of a layer
 * the step has taken is LWO_ERR_TICKET_STATE (its update reads the sum
 * ended before; a later gradient of it belongs to the next step). A stage of
 * a taken layer waits for its update, as after lwo_optim_step.
 * lwo_optim_step_open: as lwo_optim_step_groups, and LWO_ERR_UNSUPPORTED for
 * max_norm > 0 (the norm is known only at the end) or an LWO_OPTIM_DELAYED
 * optimizer. lwo_optim_step_add: LWO_ERR_TICKET_STATE if no step is open, the
 * layer is already in it, or it has no gradient ended since its last update
 * or lwo_grads_zero; LWO_ERR_OUT_OF_RANGE, LWO_ERR_INVALID_ARGUMENT (frozen).
 * lwo_optim_step_close: LWO_ERR_TICKET_STATE if no step is open. Each is
 * LWO_ERR_BUSY, taking nothing, for a layer held as for lwo_pool_write (an
 * open step stays open), and LWO_ERR_CAPTURING while a ring of the engine
 * captures (as lwo_optim_step). */
LWO_API lwo_status_t lwo_optim_step_open(lwo_optim* optim, const lwo_optim_step_params* params,
                                         uint32_t n_groups);
LWO_API lwo_status_t lwo_optim_step_add(lwo_optim* optim, uint32_t layer);
LWO_API lwo_status_t lwo_optim_step_close(lwo_optim* optim);

/* The fence: blocks until the step's every update is written into the
 * pool (with LWO_OPTIM_DELAYED: writes the masters' rounding into the pool
 * now, and marks the layers changed); reports an error the step met on the host (LWO_ERR_INTERNAL, or the
 * gradient set's own status) once. With LWO_OPTIM_DELAYED, a layer held as
 * for lwo_pool_write keeps its update in the masters and the call is
 * LWO_ERR_BUSY after the rest are written (since 0.6.0): wait again once the
 * layer is no longer held. */
LWO_API lwo_status_t lwo_optim_wait(lwo_optim* optim);

/* Non-blocking: *done = 1 if no step is running, else 0. */
LWO_API lwo_status_t lwo_optim_query(lwo_optim* optim, uint32_t* done);

typedef enum lwo_optim_state_t {
  LWO_OPTIM_MASTER = 0,  /* the f32 master weights */
  LWO_OPTIM_M = 1,       /* AdamW's first moment, SGD's momentum buffer (state dtype) */
  LWO_OPTIM_V = 2,       /* AdamW's second moment (state dtype) */
  LWO_OPTIM_STATE_FORCE_32 = 0x7fffffff
} lwo_optim_state_t;

/* Checkpointing: copies one tensor's masters or moments, the whole tensor
 * (a sharded pool: this rank's shard of it, lwo_pool_shard_tensor's
 * elements) (bytes = its elements times 4 for masters, times the state dtype's size
 * for moments), out of (read) or into (write) the optimizer. Writing masters
 * also writes them, rounded, into the pool and marks the layer changed; for
 * an fp8 block-128 tensor (since 0.6.0) the masters are its rows x cols f32
 * values and writing them quantizes them into its record as lwo_quantize
 * does (a NaN or infinite one is LWO_ERR_INVALID_ARGUMENT naming the
 * element, and nothing changes).
 * LWO_ERR_SIZE_MISMATCH for other bytes; LWO_ERR_INVALID_ARGUMENT for
 * LWO_OPTIM_V of SGD or a frozen layer; LWO_ERR_NOT_FOUND for a name the
 * layer lacks; LWO_ERR_BUSY while a step runs, or, for masters, while the
 * layer is held as for lwo_pool_write (since 0.6.0). The step number is the
 * caller's (lwo_optim_info.last_step says the last one). */
LWO_API lwo_status_t lwo_optim_read(lwo_optim* optim, uint32_t layer, const char* name,
                                    lwo_optim_state_t which, void* dst, uint64_t bytes);
LWO_API lwo_status_t lwo_optim_write(lwo_optim* optim, uint32_t layer, const char* name,
                                     lwo_optim_state_t which, const void* src, uint64_t bytes);

typedef struct lwo_optim_info {
  size_t size;                /* sizeof(lwo_optim_info), set by the caller */
  lwo_optim_kind_t kind;
  lwo_dtype_t state_dtype;
  uint32_t flags;
  uint32_t n_threads;         /* the update parts (lwo_optim_config.n_threads) */
  uint32_t n_numa_nodes;      /* the nodes they are spread over */
  uint64_t n_params;          /* trainable elements */
  uint64_t state_bytes;       /* host bytes of masters and state */
  uint64_t last_step;         /* the step number of the last lwo_optim_step, 0 before */
  const char* vector_level;   /* the loop picked at load time: "x86-64-v4"
                                 (AVX-512), "x86-64-v3" (AVX2) or "baseline" */
} lwo_optim_info;

LWO_API lwo_status_t lwo_optim_get_info(lwo_optim* optim, lwo_optim_info* info);

typedef struct lwo_optim_stats {
  size_t size;                /* sizeof(lwo_optim_stats), set by the caller */
  uint64_t n_steps;           /* steps finished */
  uint64_t n_layer_updates;   /* layer updates done (redone ones count again) */
  uint64_t n_params_updated;  /* elements those updates wrote */
  uint64_t update_ns;         /* host time of the updates (wall clock, summed) */
  uint64_t landing_wait_ns;   /* time the dispatcher waited for gradients to land */
  uint64_t last_step_ns;      /* the last step: lwo_optim_step to its end */
  uint64_t last_tail_ns;      /* of it, the time after the last layer landed */
  uint64_t n_clipped;         /* steps whose norm exceeded max_norm */
  uint64_t n_redone;          /* layers redone for them */
  double last_norm;           /* the last step's global gradient norm (clipping on), else 0 */
} lwo_optim_stats;

LWO_API lwo_status_t lwo_optim_get_stats(lwo_optim* optim, lwo_optim_stats* stats);

/* ------------------------------------------------------------------------ */
/* Layer compute: 2-D convolutions                                           */
/* ------------------------------------------------------------------------ */

typedef enum lwo_layout_t {
  /* x [n, c, h, w], y [n, k, oh, ow], weight [k, c/groups, kh, kw] */
  LWO_LAYOUT_NCHW = 0,
  /* x [n, h, w, c], y [n, oh, ow, k], weight [k, kh, kw, c/groups] */
  LWO_LAYOUT_NHWC = 1,
  LWO_LAYOUT_FORCE_32 = 0x7fffffff
} lwo_layout_t;

/* The layer has a bias b[out_channels]. */
#define LWO_CONV_BIAS 0x1u
/* f32 layers may use TF32 tensor cores. */
#define LWO_CONV_TF32 0x2u
/* Backward adds into dweight and dbias instead of overwriting them (see
 * LWO_LINEAR_ACCUMULATE). Since 0.3.0. */
#define LWO_CONV_ACCUMULATE 0x4u

/* y = conv2d(x, W) (+ b), a cross-correlation as deep-learning frameworks
 * define it, through cuDNN. x, W, b, y and dx share `dtype` (bf16, f16 or
 * f32); products accumulate in f32. W may be quantized (weight_format, since
 * 0.5.0). */
typedef struct lwo_conv2d_desc {
  size_t size;             /* sizeof(lwo_conv2d_desc) */
  lwo_dtype_t dtype;       /* LWO_DTYPE_BF16 (default), LWO_DTYPE_F16 or LWO_DTYPE_F32 */
  uint32_t flags;          /* LWO_CONV_BIAS | LWO_CONV_TF32 | LWO_CONV_ACCUMULATE */
  lwo_layout_t layout;     /* default LWO_LAYOUT_NHWC */
  int32_t in_channels;     /* >= 1, a multiple of groups */
  int32_t out_channels;    /* >= 1, a multiple of groups */
  int32_t kernel_h, kernel_w;      /* >= 1 */
  int32_t stride_h, stride_w;      /* >= 1; default 1 */
  int32_t pad_h, pad_w;            /* >= 0; default 0 */
  int32_t dilation_h, dilation_w;  /* >= 1; default 1 */
  int32_t groups;                  /* >= 1; default 1 */
  /* Since 0.5.0: an lwo_quant_format_t (a caller's struct of the 0.4 size,
   * without this field, reads as LWO_QUANT_NONE). LWO_QUANT_NONE (0, the
   * default): W is dense in `dtype`. Else W is a quantized tensor of that
   * format, quantized as a 2-D [rows x cols] tensor (as lwo_quant_layout
   * lays it out) with rows = out_channels and cols = in_channels / groups *
   * kernel_h * kernel_w: the layout's weight above with its three inner
   * dimensions flattened, in the layout's order (per output channel scales
   * for the _CHANNEL formats, 128 x 128 blocks or groups of 128 along cols
   * otherwise; LWO_QUANT_INT4_GROUP128 needs cols a multiple of 128). A
   * quantized record tensor holding it is declared 2-D [out_channels,
   * cols] with LWO_EXT_TENSOR_QUANT. The forward and backward-data calls
   * dequantize it on `stream` into the stream's weight workspace in `dtype`
   * (the one quantized linears use: engine-owned, grown on first use of a
   * larger weight, the call then waiting for its stream once) and run the
   * same cuDNN call; x, b, y, dy and dx stay in `dtype`. Frozen only:
   * lwo_conv2d_backward refuses dweight and dbias
   * (LWO_ERR_QUANTIZED_WEIGHT). */
  int32_t weight_format;
} lwo_conv2d_desc;

#define LWO_CONV2D_DESC_INIT \
  {sizeof(lwo_conv2d_desc), LWO_DTYPE_BF16, 0u, LWO_LAYOUT_NHWC, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0}
LWO_API void lwo_conv2d_desc_init(lwo_conv2d_desc* desc);

/* The output height and width for an input of h x w (LWO_ERR_INVALID_ARGUMENT
 * if the kernel does not fit the padded input, or if an output size does not
 * fit in int32_t: the message names the sizes, padding, kernel, stride and
 * dilation; the forward and backward calls refuse such shapes too). */
LWO_API lwo_status_t lwo_conv2d_output_size(const lwo_conv2d_desc* desc, int32_t h, int32_t w,
                                            int32_t* out_h, int32_t* out_w);

/* Enqueues y = conv2d(x, W) (+ b) on `stream` for a batch of n images of
 * h x w. The cuDNN algorithm is chosen once per shape (deterministic ones
 * only, workspace at most 1 GiB: LWO_ERR_UNSUPPORTED if cuDNN has none) and
 * cached in the engine; workspace comes from the engine, per stream. W is
 * dense in `dtype`, or quantized in desc->weight_format (since 0.5.0;
 * LWO_ERR_INVALID_ARGUMENT for an unknown format or a shape the format
 * cannot hold, naming the format and the shape). */
LWO_API lwo_status_t lwo_conv2d_forward(lwo_engine* engine, const lwo_conv2d_desc* desc,
                                        int32_t n, int32_t h, int32_t w, const void* x,
                                        const void* weight, const void* bias, void* y,
                                        lwo_stream_t stream);

/* Enqueues the backward pass on `stream`: dx (backward data; skipped if
 * NULL), and for a trainable layer dweight (backward filter) and, with
 * LWO_CONV_BIAS, dbias, in `grad_dtype` (LWO_DTYPE_F32 or the layer's
 * dtype); NULL dweight and dbias for a frozen layer. cuDNN computes the
 * weight gradient in the layer's dtype; an f32 one is that, widened. With
 * LWO_CONV_ACCUMULATE both are added to what the buffers hold (an f32
 * dweight: the layer-dtype gradient, widened and added). With a quantized
 * weight (desc->weight_format, since 0.5.0) dx only: a dweight or dbias is
 * LWO_ERR_QUANTIZED_WEIGHT, except (since 0.6.0) for
 * LWO_QUANT_FP8_E4M3_BLOCK128, whose dense dweight comes from x and dy. */
LWO_API lwo_status_t lwo_conv2d_backward(lwo_engine* engine, const lwo_conv2d_desc* desc,
                                         int32_t n, int32_t h, int32_t w, const void* x,
                                         const void* dy, const void* weight, void* dx,
                                         void* dweight, void* dbias, lwo_dtype_t grad_dtype,
                                         lwo_stream_t stream);

/* ------------------------------------------------------------------------ */
/* Checkpoints: safetensors files streamed in place                          */
/* ------------------------------------------------------------------------ */

/* Threads: any thread; read-only once open. */
typedef struct lwo_checkpoint lwo_checkpoint;

/* Opens a safetensors checkpoint read-only: a `.safetensors` file, or the
 * shards named by a `*.safetensors.index.json` (shards in the index's
 * folder). Anything that is not a regular file (a folder, a named pipe, a
 * device) is LWO_ERR_IO, found without blocking (from 0.2.0). Every file is mapped (shared: processes that open the same file
 * share its pages in the page cache) and every header is validated: length,
 * JSON, dtypes, shapes against byte ranges, ranges inside the data, no
 * overlaps. Failures: LWO_ERR_IO, LWO_ERR_TRUNCATED, LWO_ERR_BAD_HEADER_SIZE,
 * LWO_ERR_BAD_JSON, LWO_ERR_BAD_DTYPE, LWO_ERR_SHAPE_MISMATCH,
 * LWO_ERR_SHAPE_OVERFLOW, LWO_ERR_BAD_RANGE, LWO_ERR_OVERLAP (LWO_ERR_BAD_JSON
 * too for a tensor an index names that is not in its shard, LWO_ERR_NOT_FOUND
 * before this release, and for an index naming no tensor); the message names the file,
 * the tensor and the problem. Needs no engine and no GPU. Any thread. */
LWO_API lwo_status_t lwo_checkpoint_open(const char* path, lwo_checkpoint** checkpoint);

/* Destroys the handle (0.2.0: was lwo_checkpoint_close). Pools made from it
 * keep the files mapped until they are destroyed. */
LWO_API lwo_status_t lwo_checkpoint_destroy(lwo_checkpoint* checkpoint);

/* One file of a checkpoint: the .safetensors file itself, or one shard of
 * an index, in the order lwo_checkpoint_tensor's `file` counts them (the
 * index's shards sorted by name). Since 0.2.0. */
typedef struct lwo_checkpoint_file {
  size_t size;          /* sizeof(lwo_checkpoint_file), set by the caller */
  const char* path;     /* as opened (shards: the index's folder + the name
                           the index gives); owned by the checkpoint */
  uint64_t bytes;       /* the file's size */
  uint32_t n_tensors;   /* tensors of the checkpoint that lie in it */
} lwo_checkpoint_file;

#define LWO_CHECKPOINT_FILE_INIT {sizeof(lwo_checkpoint_file), NULL, 0u, 0u}

LWO_API lwo_status_t lwo_checkpoint_file_count(const lwo_checkpoint* checkpoint,
                                               uint32_t* n_files);
LWO_API lwo_status_t lwo_checkpoint_file_info(const lwo_checkpoint* checkpoint, uint32_t index,
                                              lwo_checkpoint_file* info);

/* The "__metadata__" strings of the files, file by file (in file order), key
 * by key (in byte order of the keys): entry `index` is key *key with value
 * *value in file *file (may be NULL). Strings are owned by the checkpoint.
 * Since 0.2.0. */
LWO_API lwo_status_t lwo_checkpoint_metadata_count(const lwo_checkpoint* checkpoint,
                                                   uint32_t* n_entries);
LWO_API lwo_status_t lwo_checkpoint_metadata(const lwo_checkpoint* checkpoint, uint32_t index,
                                             uint32_t* file, const char** key,
                                             const char** value);

typedef struct lwo_checkpoint_tensor {
  size_t size;              /* sizeof(lwo_checkpoint_tensor), set by the caller */
  const char* name;         /* owned by the checkpoint */
  const char* dtype_name;   /* as in the file ("BF16"); owned by the checkpoint */
  int32_t dtype;            /* an lwo_dtype_t, or -1 when lwo has no such dtype */
  int32_t n_dims;
  int64_t shape[LWO_MAX_DIMS];  /* the first min(n_dims, LWO_MAX_DIMS) */
  uint64_t bytes;
  uint64_t file_offset;     /* of the first byte, in its file */
  uint32_t file;            /* index of the file (shard) that holds it: see
                               lwo_checkpoint_file_info */
  /* Since 0.4.0: an lwo_quant_format_t. LWO_QUANT_FP8_E4M3_BLOCK128 for an
   * F8_E4M3 [rows, cols] weight whose f32 scales "<name>_scale_inv" of
   * [ceil(rows/128), ceil(cols/128)] are in the checkpoint (a checkpoint pool
   * maps the two as one quantized tensor when they fall in the same layer);
   * else LWO_QUANT_NONE. */
  int32_t quant_format;
  /* Since 0.4.0: with quant_format, the index of the scales' tensor; for the
   * scales themselves, the index of their weight; else LWO_NO_LAYER. */
  uint32_t quant_partner;
} lwo_checkpoint_tensor;

/* Since 0.2.0. */
#define LWO_CHECKPOINT_TENSOR_INIT \
  {sizeof(lwo_checkpoint_tensor), NULL, NULL, -1, 0, {0}, 0u, 0u, 0u, 0, 0xffffffffu}

LWO_API lwo_status_t lwo_checkpoint_tensor_count(const lwo_checkpoint* checkpoint,
                                                 uint32_t* n_tensors);
/* Tensors in file order (by shard, then offset). */
LWO_API lwo_status_t lwo_checkpoint_tensor_info(const lwo_checkpoint* checkpoint, uint32_t index,
                                                lwo_checkpoint_tensor* info);

/* Do not register the files for DMA: stream through two pinned staging
 * buffers of one record each, packed by host threads (the fallback that is
 * also taken when registration is refused). */
#define LWO_CHECKPOINT_STAGED 0x1u
/* A layer index between 0 and the largest that no tensor has becomes an
 * empty layer (no tensors, 0 bytes) instead of LWO_ERR_NOT_FOUND, so that a
 * listing can show where the gaps are. Since 0.2.0. With or without it, a
 * mapping makes at most 2^20 layers (gaps included): a tensor of a layer
 * index of 2^20 or more is LWO_ERR_BAD_RANGE (a file problem). */
#define LWO_CHECKPOINT_ALLOW_GAPS 0x2u

/* How checkpoint tensors become layers, by exactly one of:
 *  - `pattern`, a prefix with one "{i}" for a decimal layer index
 *    ("blocks.{i}." takes every tensor whose name starts "blocks.<i>." into
 *    layer i; layers are 0..the largest index and must all be present unless
 *    LWO_CHECKPOINT_ALLOW_GAPS; within a layer a tensor is named without the
 *    prefix, so "blocks.3.attn.weight" is "attn.weight" of layer 3);
 *  - `patterns`, n_patterns such patterns (since 0.2.0), for models with
 *    several stacks ("double_blocks.{i}.", "single_blocks.{i}."): the layers
 *    of patterns[0] come first, then those of patterns[1], and so on; each
 *    pattern must match some tensor, and a tensor matched by an earlier
 *    pattern is not matched again;
 *  - explicit names: `names` holds n_layers groups of full tensor names,
 *    `n_names[l]` in layer l, in the order given.
 * Tensors that match no layer are left out (see lwo_checkpoint_unmatched_count). */
typedef struct lwo_checkpoint_pool_config {
  size_t size;                /* sizeof(lwo_checkpoint_pool_config) */
  const char* pattern;        /* NULL when names or patterns are given */
  const char* const* names;
  const uint32_t* n_names;
  uint32_t n_layers;          /* with names */
  uint32_t flags;             /* LWO_CHECKPOINT_STAGED | LWO_CHECKPOINT_ALLOW_GAPS */
  const char* const* patterns;  /* since 0.2.0; NULL unless several patterns */
  uint32_t n_patterns;          /* since 0.2.0; with patterns, >= 1 */
} lwo_checkpoint_pool_config;

#define LWO_CHECKPOINT_POOL_CONFIG_INIT \
  {sizeof(lwo_checkpoint_pool_config), NULL, NULL, NULL, 0u, 0u, NULL, 0u}
LWO_API void lwo_checkpoint_pool_config_init(lwo_checkpoint_pool_config* config);

/* Creates a read-only pool over the mapped checkpoint: each layer's tensors
 * keep the file's layout where they lie together in one file (so the layer
 * moves in one copy; tensor addresses then have the file's alignment), else
 * they are packed at 256-byte boundaries. The files are registered for DMA in
 * place (cudaHostRegister, read-only) and rings copy straight from the page
 * cache; where registration is refused or LWO_CHECKPOINT_STAGED is set, rings
 * copy through pinned staging buffers instead (LWO_POOL_CHECKPOINT_STAGED). lwo_ring_stage fails with LWO_ERR_FILE_CHANGED once a file has
 * changed size. LWO_ERR_BAD_DTYPE for a tensor whose dtype lwo cannot stream;
 * LWO_ERR_NOT_FOUND for a name or a layer index that is missing. The pool's
 * kind (lwo_pool_get_info) says which path it took.
 * From 0.4.0: an F8_E4M3 [rows, cols] tensor with its f32 scales
 * "<name>_scale_inv" ([ceil(rows/128), ceil(cols/128)], as fp8 checkpoints
 * ship them) in the same layer becomes one LWO_QUANT_FP8_E4M3_BLOCK128 tensor
 * of the record named after the weight (logical dtype bf16; the scales are no
 * tensor of their own), moved in two copy runs from the file, and such a
 * layer is packed; scales of another dtype are LWO_ERR_BAD_DTYPE, of another
 * shape (or a weight that is not 2-D) LWO_ERR_SHAPE_MISMATCH, naming both
 * tensors. lwo_pool_tensor_host refuses such a tensor (LWO_ERR_UNSUPPORTED:
 * its parts lie apart in the file). */
LWO_API lwo_status_t lwo_pool_create_from_checkpoint(lwo_engine* engine,
                                                     lwo_checkpoint* checkpoint,
                                                     const lwo_checkpoint_pool_config* config,
                                                     lwo_pool** pool);

/* The number of checkpoint tensors that `config` maps to no layer, and their
 * names one by one (owned by the checkpoint). Needs no engine. */
LWO_API lwo_status_t lwo_checkpoint_unmatched_count(lwo_checkpoint* checkpoint,
                                                    const lwo_checkpoint_pool_config* config,
                                                    uint32_t* n_unmatched);
LWO_API lwo_status_t lwo_checkpoint_unmatched_name(lwo_checkpoint* checkpoint,
                                                   const lwo_checkpoint_pool_config* config,
                                                   uint32_t index, const char** name);

/* Marks a checkpoint tensor that `config` maps to no layer. Since 0.2.0. */
#define LWO_NO_LAYER 0xffffffffu

/* Which layer each checkpoint tensor becomes under `config`, exactly as
 * lwo_pool_create_from_checkpoint would map it: for tensor i (in
 * lwo_checkpoint_tensor_info order, n_tensors of them: the checkpoint's
 * count, else LWO_ERR_SIZE_MISMATCH) layers[i] is its layer, or
 * LWO_NO_LAYER, and names[i] (may be NULL) its name inside the layer (the
 * pattern's prefix taken off; owned by the checkpoint), or NULL when it maps
 * to no layer. *n_layers (may be NULL) is the layer count. Fails as
 * lwo_pool_create_from_checkpoint's mapping does (LWO_ERR_NOT_FOUND for a
 * missing name or layer index). Needs no engine. Since 0.2.0. */
LWO_API lwo_status_t lwo_checkpoint_map_tensors(lwo_checkpoint* checkpoint,
                                                const lwo_checkpoint_pool_config* config,
                                                uint32_t n_tensors, uint32_t* layers,
                                                const char** names, uint32_t* n_layers);

/* ------------------------------------------------------------------------ */
/* Host weights sharded across NCCL ranks (see docs/API.md)                 */
/* ------------------------------------------------------------------------ */

/* Same layout as ncclUniqueId. */
typedef struct lwo_nccl_unique_id {
  char internal[128];
} lwo_nccl_unique_id;

/* ncclGetUniqueId, for callers that have no communicator of their own: make
 * the id on one rank and pass it to the others. */
LWO_API lwo_status_t lwo_nccl_get_unique_id(lwo_nccl_unique_id* id);

/* ncclCommInitRank on the engine's device. Blocks until all n_ranks ranks
 * have called it (from their own threads or processes). The caller owns the
 * communicator and destroys it with lwo_nccl_comm_destroy after every pool
 * and ring that uses it. */
LWO_API lwo_status_t lwo_nccl_comm_create(lwo_engine* engine, const lwo_nccl_unique_id* id,
                                          int32_t n_ranks, int32_t rank,
                                          lwo_nccl_comm_t* comm);
/* Since 0.6.0. ncclCommSplit (NCCL 2.18 or later) of `parent`, a
 * communicator the caller owns (a ncclComm_t of its own, PyTorch's
 * ProcessGroupNCCL's, or one lwo made) on the engine's device: a private
 * communicator for lwo's collectives, so that they never interleave with the
 * caller's on one communicator. A collective over the parent: every rank of
 * the parent calls it (from its own thread or process) and it blocks until
 * they have; the ranks that give one `color` (0 or more) form one child,
 * ranked by `key` (ties by their parent rank). The child is blocking whatever
 * the parent's mode, and otherwise configured as the parent. lwo only reads
 * the parent: the caller keeps it, and destroys it when it likes, after the
 * split has returned on every rank. The caller owns the child and destroys it
 * with lwo_nccl_comm_destroy after every pool and ring that uses it.
 * LWO_ERR_INVALID_ARGUMENT for a NULL parent, a negative color or a parent on
 * another device; LWO_ERR_UNSUPPORTED where lwo was built with an older NCCL;
 * LWO_ERR_NCCL with NCCL's message. On the test host backend the parent must
 * be one of its communicators (of one rank, or of N ranks of one process),
 * and so is the child. */
LWO_API lwo_status_t lwo_nccl_comm_split(lwo_engine* engine, lwo_nccl_comm_t parent,
                                         int32_t color, int32_t key, lwo_nccl_comm_t* comm);
/* ncclCommDestroy of a communicator that lwo_nccl_comm_create or
 * lwo_nccl_comm_split made. Any other pointer (a communicator of the
 * caller's own, one already destroyed, or no communicator at all) is
 * LWO_ERR_INVALID_HANDLE and is left alone: the caller destroys its own
 * communicators with ncclCommDestroy. NULL does nothing. */
LWO_API lwo_status_t lwo_nccl_comm_destroy(lwo_nccl_comm_t comm);

/* Creates a pinned pool that holds this rank's shard of every layer: with N
 * ranks and a record of R bytes, S = R / N rounded up to a multiple of
 * LWO_RECORD_ALIGN, and rank r keeps bytes [r*S, (r+1)*S) of the record (zero
 * beyond R). `comm` is the caller's communicator, one lwo_nccl_comm_create
 * made or a ncclComm_t of its own (its device must be the engine's); every rank must create its pool with the same layers, in the
 * same order of calls: the call checks, collectively, that all ranks describe
 * the same layer count and record sizes (LWO_ERR_COLLECTIVE_MISMATCH on every
 * rank otherwise) and blocks until all ranks have called it. Rings of a
 * sharded pool copy the local shard up this rank's link and all-gather the
 * whole record into the slot on the engine's collective stream.
 *
 * The rule for collectives: the ranks' rings of the pool must be created
 * with the same depth, and every rank must make the same collective calls in
 * the same order: lwo_ring_stage of the same layers (hits included; a hit
 * moves nothing and happens alike on every rank that makes the same calls,
 * so call lwo_pool_layer_changed / lwo_pool_write on every rank, for the same
 * layers, between the same stages) and lwo_grads_end of the same layers. A
 * rank that breaks it makes the others wait forever in NCCL or mixes up
 * layers; LWO_ENGINE_CHECK_COLLECTIVES finds where. Rank-local pools of the
 * same engine take no part in the rule. */
LWO_API lwo_status_t lwo_pool_create_sharded(lwo_engine* engine, const lwo_layer_desc* layers,
                                             uint32_t n_layers, lwo_nccl_comm_t comm,
                                             const lwo_pool_config* config, lwo_pool** pool);

/* This rank's shard of `layer`: its host address, where it starts in the
 * record, and its size S (writable; fill it before staging, or call
 * lwo_pool_layer_changed after). On a pool that is not sharded the shard is
 * the whole layer: offset 0 and the address and bytes of lwo_pool_layer_host
 * (with its LWO_ERR_UNSUPPORTED for a layer that is not contiguous). */
LWO_API lwo_status_t lwo_pool_shard_host(lwo_pool* pool, uint32_t layer, void** data,
                                         uint64_t* record_offset, uint64_t* bytes);

/* The part of tensor `name` of `layer` in this rank's shard: elements
 * [*first_element, *first_element + *n_elements) of the tensor (row-major),
 * at `*data` in host memory (writable, but for checkpoint pools); *n_elements
 * may be 0 (then *data is NULL). The same elements as lwo_grads_shard's, so
 * a sharded optimizer updates data[i] from the gradient shard's data[i]. On
 * a pool that is not sharded: the whole tensor, first element 0. */
LWO_API lwo_status_t lwo_pool_shard_tensor(lwo_pool* pool, uint32_t layer, const char* name,
                                           void** data, uint64_t* first_element,
                                           uint64_t* n_elements);

/* ------------------------------------------------------------------------ */
/* Quantized weights (since 0.3.0; first part: formats, host quantization,   */
/* dequantization; see docs/API.md)                                          */
/* ------------------------------------------------------------------------ */

/* A weight matrix [rows x cols] (rows: output channels, cols: input
 * features, row-major) stored in fewer bits with f32 scales. The quantized
 * tensor is one block of bytes: the codes at offset 0, then the scales (f32,
 * row-major [scale_rows x scale_cols]) at the next multiple of
 * LWO_RECORD_ALIGN, its size rounded up to LWO_RECORD_ALIGN (the padding is
 * zero), so a layer with its scales still moves in one copy. With amax the
 * largest magnitude of the elements a scale covers, an integer format's
 * scale is max(amax / M, 2^-126), M the largest code (127, 7), and an fp8
 * format's is the smallest power of two s with amax / s <= 464 (the
 * midpoint past 448, the largest code: up to it a value rounds to 448 within
 * half a step), at least 2^-126 (since 0.6.0; e4m3's relative step is the
 * same in every binade, so a power of two costs no precision above the
 * subnormal codes, code x scale is exact, and quantizing a record's own
 * dequantized values gives the record again); an element's code is its
 * value divided by its scale (f32), rounded to nearest even (fp8 saturating
 * to +-448, the integer codes clamped to +-M); dequantized it is code x
 * scale, one f32 multiply, rounded to nearest even to the output dtype.
 * Since 0.3.0. */
typedef enum lwo_quant_format_t {
  LWO_QUANT_NONE = 0,               /* not quantized: refused by the calls below */
  /* fp8 e4m3 (OCP, no infinity, +-448) codes, one byte each; one scale per
   * row (scale_rows = rows, scale_cols = 1). */
  LWO_QUANT_FP8_E4M3_CHANNEL = 1,
  /* fp8 e4m3 codes; one scale per 128 x 128 block (the edge blocks may be
   * smaller): scale_rows = ceil(rows / 128), scale_cols = ceil(cols / 128),
   * as fp8 checkpoints ship them (code x scale = the weight). Any shape. */
  LWO_QUANT_FP8_E4M3_BLOCK128 = 2,
  /* int8 codes -127..127; one scale per row. */
  LWO_QUANT_INT8_CHANNEL = 3,
  /* int4 codes -7..7, two per byte (element 2k in the low nibble of byte k
   * of the row, 2k+1 in the high one), each stored as code + 8; one scale
   * per group of 128 consecutive elements of a row: cols must be a multiple
   * of 128; scale_rows = rows, scale_cols = cols / 128. 4.25 bits per
   * weight; dequantized with one subtraction and one multiply. */
  LWO_QUANT_INT4_GROUP128 = 4,
  LWO_QUANT_FORMAT_FORCE_32 = 0x7fffffff
} lwo_quant_format_t;

/* A quantized tensor: its format, its shape, and the dtype of the tensor it
 * stands for: the source of lwo_quantize, the output of lwo_dequantize_host
 * and lwo_dequantize (f32, bf16 or f16). rows and cols in 1..2^31-1
 * (LWO_ERR_INVALID_ARGUMENT below 1, LWO_ERR_OUT_OF_RANGE above). Since
 * 0.3.0. */
typedef struct lwo_quant_desc {
  size_t size;                /* sizeof(lwo_quant_desc) */
  lwo_quant_format_t format;  /* default LWO_QUANT_NONE: must be set */
  lwo_dtype_t dtype;          /* default LWO_DTYPE_BF16 */
  int64_t rows;               /* output channels; must be set */
  int64_t cols;               /* input features; must be set */
} lwo_quant_desc;

#define LWO_QUANT_DESC_INIT {sizeof(lwo_quant_desc), LWO_QUANT_NONE, LWO_DTYPE_BF16, 0, 0}
LWO_API void lwo_quant_desc_init(lwo_quant_desc* desc);

/* Where the parts of a quantized tensor lie (byte offsets from its start).
 * Since 0.3.0. */
typedef struct lwo_quant_layout_info {
  size_t size;             /* sizeof(lwo_quant_layout_info), set by the caller */
  uint64_t data_offset;    /* the codes: always 0 */
  uint64_t data_bytes;     /* rows x cols (fp8, int8) or rows x cols / 2 (int4) */
  uint64_t scale_offset;   /* the f32 scales: data_bytes rounded up to LWO_RECORD_ALIGN */
  uint64_t scale_bytes;    /* 4 x scale_rows x scale_cols */
  int64_t scale_rows;
  int64_t scale_cols;
  uint64_t total_bytes;    /* the whole tensor, a multiple of LWO_RECORD_ALIGN */
} lwo_quant_layout_info;

#define LWO_QUANT_LAYOUT_INFO_INIT {sizeof(lwo_quant_layout_info), 0, 0, 0, 0, 0, 0, 0}

/* The layout of the quantized tensor `desc` describes. Needs no engine; any
 * thread. LWO_ERR_INVALID_ARGUMENT for a NULL desc or info, LWO_QUANT_NONE or
 * an unknown format, a dtype other than f32 / bf16 / f16, rows or cols below
 * 1, or cols not a multiple of 128 for LWO_QUANT_INT4_GROUP128;
 * LWO_ERR_OUT_OF_RANGE for rows or cols of 2^31 or more. Since 0.3.0. */
LWO_API lwo_status_t lwo_quant_layout(const lwo_quant_desc* desc, lwo_quant_layout_info* info);

/* Static name of a format ("fp8_e4m3_channel", "none"), or "unknown". Any
 * thread. Since 0.3.0. */
LWO_API const char* lwo_quant_format_name(lwo_quant_format_t format);

/* Quantizes a host tensor: src holds rows x cols elements of desc->dtype
 * (src_bytes of them at least); dst receives the whole quantized tensor as
 * lwo_quant_layout lays it out (dst_bytes >= total_bytes; bytes past
 * total_bytes are not written). n_threads: host threads (0: one per core; at
 * most 64 are used). Checks, in order: the descriptor as lwo_quant_layout
 * and NULL src or dst (LWO_ERR_INVALID_ARGUMENT), rows and cols
 * (LWO_ERR_OUT_OF_RANGE), the sizes (LWO_ERR_SIZE_MISMATCH naming both),
 * then the values: a NaN or infinity in src is
 * LWO_ERR_INVALID_ARGUMENT naming its row and column, found before anything
 * is written (dst is left as it was). Any thread. Since 0.3.0. */
LWO_API lwo_status_t lwo_quantize(const lwo_quant_desc* desc, const void* src, uint64_t src_bytes,
                                  void* dst, uint64_t dst_bytes, uint32_t n_threads);

/* The CPU reference of lwo_dequantize: src holds a quantized tensor laid out
 * as lwo_quant_layout says (src_bytes >= total_bytes), dst receives rows x
 * cols elements of desc->dtype (dst_bytes at least). Checks as lwo_quantize
 * but for the values: every code decodes, and a NaN result (the fp8 NaN
 * codes 0x7f / 0xff, or a NaN or infinite scale) is always the quiet NaN
 * 0x7fc00000 (bf16 0x7fc0, f16 0x7e00). Any thread. Since 0.3.0. */
LWO_API lwo_status_t lwo_dequantize_host(const lwo_quant_desc* desc, const void* src,
                                         uint64_t src_bytes, void* dst, uint64_t dst_bytes,
                                         uint32_t n_threads);

/* Dequantizes on the GPU: src is a quantized tensor in device memory laid
 * out as lwo_quant_layout says (for example a ring slot's tensor, which is
 * 256-byte aligned), dst a device buffer of rows x cols elements of
 * desc->dtype (f32, bf16 or f16) that must not overlap src. Stream-ordered
 * on `stream` (after the work enqueued there before, such as a copy or an
 * lwo_ring_acquire); the result equals lwo_dequantize_host's bit for bit.
 * src may have any alignment; cols a multiple of 8, dst 16-byte aligned
 * and src 8-byte aligned (int4: 4) take the vectorized path. Checks: the engine
 * handle (LWO_ERR_INVALID_HANDLE), then the descriptor, NULL src or dst and
 * a dst not aligned to its element's size (LWO_ERR_INVALID_ARGUMENT), rows
 * and cols (LWO_ERR_OUT_OF_RANGE); a launch that fails is LWO_ERR_CUDA.
 * Threads: as layer compute (any thread). Since 0.3.0. */
LWO_API lwo_status_t lwo_dequantize(lwo_engine* engine, const lwo_quant_desc* desc,
                                    const void* src, void* dst, lwo_stream_t stream);

/* ------------------------------------------------------------------------ */
/* Quantized records (since 0.4.0; see docs/API.md)                          */
/* ------------------------------------------------------------------------ */

/* The extension type of lwo_tensor_quant_ext. Since 0.4.0. */
#define LWO_EXT_TENSOR_QUANT 1

/* On a tensor's `next` chain (lwo_tensor_desc): the tensor is stored
 * quantized in `format`. The tensor's dtype is its logical dtype (f32, bf16
 * or f16: what lwo_pool_write_quantized reads and a quantized linear
 * computes in) and its shape is 2-D [rows, cols] (rows: output channels),
 * both >= 1 (and cols a multiple of 128 for LWO_QUANT_INT4_GROUP128). Its
 * bytes in the record are lwo_quant_layout's total_bytes for that format,
 * dtype and shape: the codes, then the scales, so the layer still moves in
 * one copy. lwo_record_layout, pinned and registered pools honour it
 * (LWO_ERR_INVALID_ARGUMENT, naming the tensor, for a bad format, dtype or
 * shape; sharded pools refuse it with LWO_ERR_UNSUPPORTED); the pool's
 * tensor info reports the format (lwo_tensor_info.quant_format) and the
 * quantized bytes, lwo_pool_write takes the quantized bytes (as lwo_quantize
 * writes them) and lwo_pool_write_quantized quantizes into the tensor.
 * Ring views (lwo_layer_view) give the tensor's logical dtype and its
 * quantized bytes. Since 0.4.0. */
typedef struct lwo_tensor_quant_ext {
  lwo_ext header;             /* type LWO_EXT_TENSOR_QUANT */
  lwo_quant_format_t format;  /* not LWO_QUANT_NONE */
  uint32_t reserved;          /* 0 */
} lwo_tensor_quant_ext;

/* Quantizes `src` into quantized tensor `name` of `layer` (multithreaded on
 * the host): src holds rows x cols elements of `src_dtype` (f32, bf16 or
 * f16; src_bytes must be exactly their size, else LWO_ERR_SIZE_MISMATCH),
 * quantized as lwo_quantize would into the tensor's bytes (equal to them bit
 * for bit). n_threads: 0 = one per core, at most 64 used. Pinned pools only,
 * as lwo_pool_write (LWO_ERR_UNSUPPORTED for the others). Checks, in order:
 * the handle, NULL src, src_dtype (LWO_ERR_INVALID_ARGUMENT), the layer
 * (LWO_ERR_OUT_OF_RANGE), the name (LWO_ERR_NOT_FOUND), the pool kind, a
 * tensor that is not quantized (LWO_ERR_INVALID_ARGUMENT), a layer held as
 * for lwo_pool_write (LWO_ERR_BUSY, since 0.6.0), the size, then a
 * NaN or infinity in src (LWO_ERR_INVALID_ARGUMENT naming its row and
 * column; the tensor is left as it was). Marks the layer changed. Threads:
 * as the pool's. Since 0.4.0. */
LWO_API lwo_status_t lwo_pool_write_quantized(lwo_pool* pool, uint32_t layer, const char* name,
                                              const void* src, lwo_dtype_t src_dtype,
                                              uint64_t src_bytes, uint32_t n_threads);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LWO_H_ */
