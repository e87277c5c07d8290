/* Test-only exports of liblwo: not part of the API (include/lwo.h), not
 * installed, and not for programs. They let the tests of the library's users
 * (python/tests) run the real library on a machine with no GPU. */
#ifndef LWO_TEST_H
#define LWO_TEST_H

#include "lwo.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A released ring slot reads as 0xff bytes (NaN in every float dtype) until
 * it is acquired again or filled anew. */
#define LWO_TEST_HOST_POISON 1u

/* An engine on the host backend (engine/backend.h, make_host_backend):
 * "device" memory is host memory (pointers are host addresses), every stream
 * runs its work when it is enqueued, and layer compute (lwo_linear_*,
 * lwo_conv2d_*, lwo_dequantize) runs on the CPU in f32, each output rounded
 * once to its dtype. Everything else is the library as it is. Destroyed with
 * lwo_engine_destroy. LWO_ERR_INVALID_ARGUMENT for unknown flags.
 * Its communicators (lwo_nccl_comm_create, lwo_nccl_comm_split) have one rank
 * or N ranks of this process: N such engines, each driven from its own
 * thread, meet by the id's 128 bytes (any bytes the ranks share), each call
 * blocking until all N make it; ranks that make different collective calls
 * fail with LWO_ERR_COLLECTIVE_MISMATCH, and a rank missing for 120 s
 * (lwo_test_host_comm_timeout) fails the others with LWO_ERR_NCCL. */
LWO_API lwo_status_t lwo_test_engine_create_host(uint32_t flags, lwo_engine** engine);

/* The deadline of the host backend's communicators, for every host engine of
 * the process: a rank that waits longer for the others, at
 * lwo_nccl_comm_create or at a collective, fails with LWO_ERR_NCCL (120000
 * ms until set). Applies to the calls that start after it; `previous_ms`
 * (may be NULL) gets the one it replaces. LWO_ERR_INVALID_ARGUMENT for 0. */
LWO_API lwo_status_t lwo_test_host_comm_timeout(uint32_t timeout_ms, uint32_t* previous_ms);

#ifdef __cplusplus
}
#endif

#endif /* LWO_TEST_H */
