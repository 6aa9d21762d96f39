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

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes beyond tilevox_kernels.h's. */
#define TILEVOX_ERR_MK_WATCHDOG 16 /* a counter wait exceeded watchdog_ns (a deadlock) */
#define TILEVOX_ERR_MK_FAULT 17    /* an instruction found an out-of-range index or shape */

/* Error words (int32, TILEVOX_MK_ERROR_WORDS of them, zeroed by every launch):
 * [0] code (0 none, 1 watchdog, 2 unknown opcode, 3 index out of range, 4 unsupported shape)
 * [1] queue (block) [2] position in the queue [3] opcode [4] counter [5] counter value [6] target */
#define TILEVOX_MK_ERROR_WORDS 8
#define TILEVOX_MK_ERROR_NONE 0
#define TILEVOX_MK_ERROR_WATCHDOG 1
#define TILEVOX_MK_ERROR_BAD_OPCODE 2
#define TILEVOX_MK_ERROR_OUT_OF_RANGE 3
#define TILEVOX_MK_ERROR_UNSUPPORTED 4

/* Flags. */
#define TILEVOX_MK_FLAG_SYNC_CHECK 1 /* synchronize the stream and turn the error words into a status */

/* Largest head_dim the attention and QKV instructions handle. */
#define TILEVOX_MK_MAX_HEAD_DIM 256

/*
 * All pointers are device pointers on the current device.
 *   instructions:  (num_queues, max_queue_len, TILEVOX_MK_INSTRUCTION_WORDS) int32
 *   queue_lengths: (num_queues,) int32
 *   buffer_table:  (num_buffers, 8) int64 rows [kind, dtype, ndim, dims[0..4]] (packing.py)
 *   buffer_ptrs:   (num_buffers,) device pointers, each a contiguous tensor of its row's shape
 *   counters:      (num_counters,) int32, zeroed by the launch
 *   error:         (TILEVOX_MK_ERROR_WORDS,) int32, zeroed by the launch
 *   profile:       optional (num_queues, max_queue_len, 3) int64 or null: per instruction the
 *                  %globaltimer ns when its record was read, when its waits were satisfied and when
 *                  it finished (before its signal); for the cost model and the benchmarks
 *   prefetch:      optional (num_queues, max_queue_len, 4) int64 or null: per instruction up to two
 *                  weight ranges [address, bytes] (bytes 0: none; address and bytes multiples of 16)
 *                  that the block asks L2 to prefetch a few instructions ahead (a hint only:
 *                  results never depend on it). Built from the bound pointers by runtime.py.
 */
typedef struct tilevox_megakernel_params {
  const int32_t* instructions;
  const int32_t* queue_lengths;
  const int64_t* buffer_table;
  void* const* buffer_ptrs;
  int32_t* counters;
  int32_t* error;
  int64_t* profile;
  const int64_t* prefetch;
  int32_t num_queues;
  int32_t max_queue_len;
  int32_t num_buffers;
  int32_t num_counters;
  /* RegionConstants */
  int32_t batch_size;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t partition_tokens;
  int32_t num_partitions;
  float rms_norm_eps;
  float attn_scale;
  int64_t watchdog_ns; /* per wait; must be > 0 */
  int32_t flags;       /* TILEVOX_MK_FLAG_* */
} tilevox_megakernel_params;

int tilevox_megakernel_launch(const tilevox_megakernel_params* params, void* cuda_stream);

/* Blocks the launcher can keep co-resident on the current device (SMs x blocks per SM); -1 on error. */
int tilevox_megakernel_max_queues(void);

#ifdef __cplusplus
}
#endif

#endif /* TILEVOX_MEGAKERNEL_H_ */
