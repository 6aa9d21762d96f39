/*
 * megakernel.h: C ABI of the persistent decode megakernel (part of libtilevox_kernels.so).
 *
 * One launch runs a whole compiled region: one block per instruction queue (the launcher refuses
 * more queues than can be co-resident on the device), each block interpreting its queue of
 * 48-word records (instructions.h) in order. An instruction issues its weight loads, then spin-waits
 * (acquire loads, __nanosleep backoff) until every awaited counter reaches its target; after it, a
 * __threadfence() and an atomicAdd on its signal counter release its writes. The semantics of every
 * opcode are those of trt_plugins/megakernel/vm.py (fp32 accumulation; bf16 matrix-vector tiles on
 * tensor cores, others on CUDA cores; sums in a different order, so equal to fp32 rounding).
 *
 * Counter reset (CUDA-graph replay): the launcher enqueues cudaMemsetAsync of the counters and of
 * the error words on the launch stream before the kernel, so a captured graph holds two memset
 * nodes + the kernel node and every replay starts from zero counters.
 *
 * Watchdog: a wait that spins longer than watchdog_ns (device %globaltimer) writes the error words
 * (first writer wins) and the block exits; every other block polls the error code while it spins
 * and exits too. The kernel therefore always terminates. With TILEVOX_MK_FLAG_SYNC_CHECK the
 * launcher synchronizes the stream and returns TILEVOX_ERR_MK_WATCHDOG / TILEVOX_ERR_MK_FAULT with
 * the details in tilevox_last_error(); without it (e.g. under graph capture) the caller reads the
 * error words itself after the stream completes.
 */
#ifndef TILEVOX_MEGAKERNEL_H_
#define TILEVOX_MEGAKERNEL_H_

#include <stdint.h>

#include "instructions.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Status and error codes, error words, flags, limits and the launch parameter struct
 * (tilevox_megakernel_params) are generated from trt_plugins/megakernel/instructions.py into instructions.h.
 *   profile:  per instruction the %globaltimer ns when its record was read, when its waits were satisfied
 *             and when it finished (before its signal); for the cost model and the benchmarks
 *   prefetch: per instruction up to two weight ranges [address, bytes] (bytes 0: none; address and bytes
 *             multiples of 16) that the block asks L2 to prefetch a few instructions ahead (a hint only:
 *             results never depend on it). Built from the bound pointers by runtime.py. */

int tilevox_megakernel_launch(const tilevox_megakernel_params* params, void* cuda_stream);

/* Blocks the launcher can keep co-resident on the current device (SMs x blocks per SM); -1 on error. */
int tilevox_megakernel_max_queues(void);

#ifdef __cplusplus
}
#endif

#endif /* TILEVOX_MEGAKERNEL_H_ */
