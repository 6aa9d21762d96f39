// megakernel.cu: the persistent instruction interpreter of decode regions (see megakernel.h).
//
// One block (256 threads) per queue walks its instruction records in order. An instruction first
// issues the loads that depend on nothing (its weight tile), then waits on its counters (thread 0,
// acquire loads + __nanosleep backoff + %globaltimer watchdog), stages its inputs, computes and
// stores; after one barrier thread 0 bumps the signal counter with release semantics. The opcode bodies follow
// trt_plugins/megakernel/vm.py, including where the VM rounds to the activation dtype (sums are
// fp32 in a different order, so results agree to fp32 rounding, not bitwise).
// Matrix-vector tiles, two paths with the same semantics (fp32 accumulation):
//  - bf16 weights and bf16 activations (the serving case): tensor cores (mma.sync m16n8k16) for every
//    batch size 1..64. Batch rows are staged in shared memory as bf16 (exact: the VM rounds them to
//    bf16 there too); each warp streams a 16-row x K-slice of the weight tile with 16-byte loads, many
//    in flight, and the warps' partial sums meet in shared memory. The k order inside a 32-wide block
//    is permuted identically for weights and activations (a dot product does not care), so each lane
//    loads 16 contiguous bytes instead of 4-byte fragments.
//  - anything else (fp32 / fp16 models): CUDA cores, one warp per output row, batch rows staged as
//    fp32 in chunks of up to kMaxChunk rows.
// Before running instruction i a block asks L2 to prefetch the weight tile of instruction i + 2 of
// its queue (cp.async.bulk.prefetch), so HBM streams while the block waits on counters.
// Activations and state are read with ld.cg (L2, never a stale L1 line written by another SM);
// weights with the read-only path.
// Every opcode body is a __noinline__ function (TILEVOX_MK_OP): each gets its own register allocation, so one opcode's
// pressure does not make the interpreter loop spill (inlined, the loop spilled ~1 KB per thread to local
// memory, whose L1 lines the weight stream evicts).
// Files: this one holds the interpreter loop and the launcher; common.cuh (limits, buffers, loads/stores,
// reductions, errors), matvec.cuh (the matrix-vector core), deps.cuh (counter waits, watchdog),
// head_rope.cuh (per-head norm and rope), row_chunks.cuh, and one file per instruction under ops/ (the VM has
// one method per instruction). They are included into this one translation unit, in the order below (the
// split left the compiled cubin byte for byte unchanged).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "../common/tilevox_common.h"
#include "instructions.h"
#include "megakernel.h"

namespace {

#include "common.cuh"
#include "matvec.cuh"
#include "deps.cuh"
#include "head_rope.cuh"
// Opcodes, one file each (ops/): each returns false after raising an error (the caller stops the block).
#include "ops/embed.cuh"
#include "row_chunks.cuh"
#include "ops/linear_bias.cuh"
#include "ops/rmsnorm_qkv_rope_append.cuh"
#include "ops/rmsnorm_linear.cuh"
#include "ops/kv_append.cuh"
#include "ops/attn_partial.cuh"
#include "ops/attn_reduce.cuh"
#include "ops/cross_attn.cuh"
#include "ops/proj_residual.cuh"
#include "ops/rmsnorm_gateup_swiglu.cuh"
#include "ops/rmsnorm_lmhead.cuh"
#include "ops/sample_embed.cuh"

// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void prefetch_l2(int64_t address, int64_t bytes) {
  // 16-byte multiples (checked by the host); one bulk prefetch per 64 KiB piece.
  for (int64_t off = 0; off < bytes; off += 65536) {
    const uint32_t n = (uint32_t)(bytes - off < 65536 ? bytes - off : 65536);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(address + off), "r"(n) : "memory");
  }
}

// The interpreter loop. Per instruction: the record (double-buffered in shared memory, fetched one
// instruction ahead) is dispatched; the opcode issues its weight loads, calls wait_deps, computes and
// stores; one barrier; then thread 0 fences and bumps the signal counter while the other warps
// already start the next instruction. `ok` is block-uniform (wait_deps broadcasts through shared
// memory and every error path depends on block-uniform data), so no extra barrier decides to stop.
// A block stops at its own error, or at anybody's error while it spins in wait_deps; a block that
// never waits runs its finite queue to the end, so the kernel always terminates.
__global__ void __launch_bounds__(kThreads, 1) megakernel(const __grid_constant__ tilevox_megakernel_params prm) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* xs = smem;
  float* extra = smem + kXsFloats;
  __shared__ int records[2][TILEVOX_MK_INSTRUCTION_WORDS];
  __shared__ int stop;
  __shared__ int early[kEarlyWaits];
  const int n = prm.queue_lengths[blockIdx.x];
  const int* queue = prm.instructions + (int64_t)blockIdx.x * prm.max_queue_len * TILEVOX_MK_INSTRUCTION_WORDS;
  const int64_t* pf_queue = prm.prefetch ? prm.prefetch + (int64_t)blockIdx.x * prm.max_queue_len * TILEVOX_MK_PREFETCH_WORDS : nullptr;
  int64_t* prof = prm.profile ? prm.profile + (int64_t)blockIdx.x * prm.max_queue_len * TILEVOX_MK_PROFILE_WORDS : nullptr;
  Ctx c{prm, (int)blockIdx.x, 0, &stop, prof, early};
  const bool record_lane = threadIdx.x < TILEVOX_MK_INSTRUCTION_WORDS;
  const bool prefetch_lane = pf_queue != nullptr && threadIdx.x >= 32 && threadIdx.x < 32 + TILEVOX_MK_PREFETCH_WORDS;  // warp 1
  // Prologue: the first record, and the weights of the first kPrefetchDistance instructions.
  if (record_lane && n > 0) records[0][threadIdx.x] = queue[threadIdx.x];
  if (prefetch_lane && threadIdx.x == 32)
    for (int i = 0; i < kPrefetchDistance && i < n; ++i) {
      prefetch_l2(pf_queue[TILEVOX_MK_PREFETCH_WORDS * i], pf_queue[TILEVOX_MK_PREFETCH_WORDS * i + 1]);
      prefetch_l2(pf_queue[TILEVOX_MK_PREFETCH_WORDS * i + 2], pf_queue[TILEVOX_MK_PREFETCH_WORDS * i + 3]);
    }
  __syncthreads();
  for (int pos = 0; pos < n; ++pos) {
    c.pos = pos;
    const int* inst = records[pos & 1];
    // Loads for later, in flight while this instruction waits and runs: the next record, and the
    // weight ranges of instruction pos + kPrefetchDistance.
    int next_word = 0;
    if (record_lane && pos + 1 < n) next_word = queue[(int64_t)(pos + 1) * TILEVOX_MK_INSTRUCTION_WORDS + threadIdx.x];
    int64_t pf_word = 0;
    if (prefetch_lane && pos + kPrefetchDistance < n) pf_word = pf_queue[TILEVOX_MK_PREFETCH_WORDS * (pos + kPrefetchDistance) + threadIdx.x - 32];
    if (threadIdx.x == 0 && prof) prof[TILEVOX_MK_PROFILE_WORDS * pos] = (int64_t)global_ns();
#if TILEVOX_MK_EARLY_POLL
    if (threadIdx.x == 0) {  // the awaited counters, copied to shared memory while the weights load
      // An instruction that never reached wait_deps may have left its copies in flight: let them land
      // before this record's copies and stores take the same slots.
      asm volatile("cp.async.wait_all;" ::: "memory");
      const int nw = inst[TILEVOX_MK_FIELD_NUM_WAITS];
      for (int i = 0; i < kEarlyWaits; ++i) {
        const int counter = i < nw ? inst[TILEVOX_MK_FIELD_WAITS + 2 * i] : -1;
        if (counter >= 0 && counter < prm.num_counters) {
          const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(early + i));
          asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(prm.counters + counter) : "memory");
        } else {
          early[i] = -1;  // no such wait: never taken as met
        }
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
#endif
    const int signal = inst[TILEVOX_MK_FIELD_SIGNAL];
    bool ok;
    switch (inst[0]) {
      case TILEVOX_MK_OP_EMBED:
        ok = op_embed(c, inst);
        break;
      case TILEVOX_MK_OP_LINEAR_BIAS:
        ok = op_linear_bias(c, inst, xs);
        break;
      case TILEVOX_MK_OP_RMSNORM_QKV_ROPE_APPEND:
        ok = op_qkv(c, inst, xs, extra);
        break;
      case TILEVOX_MK_OP_RMSNORM_LINEAR:
        ok = op_rmsnorm_linear(c, inst, xs);
        break;
      case TILEVOX_MK_OP_KV_APPEND:
        ok = op_kv_append(c, inst, extra);
        break;
      case TILEVOX_MK_OP_ATTN_PARTIAL:
        ok = op_attn_partial(c, inst, extra, xs);
#if TILEVOX_MK_REPEAT_ATTN
        __syncthreads();  // the first run's shared-memory staging is done before the second overwrites it
        if (ok) ok = op_attn_partial(c, inst, extra, xs);
#endif
        break;
      case TILEVOX_MK_OP_ATTN_REDUCE:
        ok = op_attn_reduce(c, inst, extra);
        break;
      case TILEVOX_MK_OP_CROSS_ATTN:
        ok = op_cross_attn(c, inst, extra);
        break;
      case TILEVOX_MK_OP_OPROJ_RESIDUAL:
      case TILEVOX_MK_OP_DOWN_RESIDUAL:
        ok = op_proj_residual(c, inst, xs);
        break;
      case TILEVOX_MK_OP_RMSNORM_GATEUP_SWIGLU:
        ok = op_gateup(c, inst, xs);
        break;
      case TILEVOX_MK_OP_RMSNORM_LMHEAD:
        ok = op_lmhead(c, inst, xs);
        break;
      case TILEVOX_MK_OP_SAMPLE_EMBED:
        ok = op_sample(c, inst, extra);
        break;
      default:
        if (threadIdx.x == 0) raise_error(c, TILEVOX_MK_ERROR_BAD_OPCODE, inst[0], -1, 0, 0);
        ok = false;
        break;
    }
    if (!ok) return;
    // The other record buffer is free: nobody reads it before the barrier below.
    if (record_lane && pos + 1 < n) records[(pos + 1) & 1][threadIdx.x] = next_word;
    __syncthreads();  // every thread's stores of this instruction precede thread 0's release below
    if (threadIdx.x == 0) {
      if (prof) prof[TILEVOX_MK_PROFILE_WORDS * pos + 2] = (int64_t)global_ns();
      if (signal >= 0) release_add(prm.counters + signal, 1);
    }
    if (prefetch_lane) {
      const int64_t a0 = __shfl_sync(0xfu, pf_word, 0), b0 = __shfl_sync(0xfu, pf_word, 1);
      const int64_t a1 = __shfl_sync(0xfu, pf_word, 2), b1 = __shfl_sync(0xfu, pf_word, 3);
      if (threadIdx.x == 32) {
        if (b0 > 0) prefetch_l2(a0, b0);
        if (b1 > 0) prefetch_l2(a1, b1);
      }
    }
  }
}

int max_blocks_per_sm() {
  static thread_local int cached_device = -1;
  static thread_local int cached = -1;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  if (device != cached_device) {
    if (cudaFuncSetAttribute(megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) != cudaSuccess)
      return -1;
    int nb = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, megakernel, kThreads, kSmemBytes) != cudaSuccess) return -1;
    cached = nb;
    cached_device = device;
  }
  return cached;
}

}  // namespace

extern "C" int tilevox_megakernel_max_queues(void) {
  const int nb = max_blocks_per_sm();
  const int sms = tilevox::sm_count_current_device();
  if (nb < 0 || sms < 0) return -1;
  return nb * sms;
}

extern "C" int tilevox_megakernel_launch(const tilevox_megakernel_params* params, void* cuda_stream) {
  using tilevox::fail;
  tilevox::clear_error();
  if (params == nullptr) return fail(TILEVOX_ERR_INVALID_ARGUMENT, "megakernel: params is null");
  const tilevox_megakernel_params& p = *params;
  if (!p.instructions || !p.queue_lengths || !p.buffer_table || !p.buffer_ptrs || !p.error ||
      (p.num_counters > 0 && !p.counters))
    return fail(TILEVOX_ERR_INVALID_ARGUMENT, "megakernel: a required pointer is null");
  if (p.num_queues < 1 || p.max_queue_len < 0 || p.num_buffers < 0 || p.num_counters < 0 || p.batch_size < 1 ||
      p.num_heads < 1 || p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads || p.partition_tokens < 1 ||
      p.num_partitions < 1 || p.window < 0 || p.watchdog_ns <= 0)
    return fail(TILEVOX_ERR_INVALID_ARGUMENT, "megakernel: invalid sizes or region constants");
  if (p.head_dim < 2 || p.head_dim % 2 || p.head_dim > TILEVOX_MK_MAX_HEAD_DIM)
    return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE, "megakernel: head_dim must be even and <= " +
                                                   std::to_string(TILEVOX_MK_MAX_HEAD_DIM) + ", got " +
                                                   std::to_string(p.head_dim));
  if (p.head_dim > kExtraFloats / kMaxChunk)
    return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE, "megakernel: head_dim too large for the per-head scratch");
  const int nb = max_blocks_per_sm();
  const int sms = tilevox::sm_count_current_device();
  if (nb < 1 || sms < 1) return fail(TILEVOX_ERR_CUDA, "megakernel: cannot query occupancy / SM count");
  if (p.num_queues > nb * sms)
    return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE, "megakernel: " + std::to_string(p.num_queues) +
                                                   " queues but only " + std::to_string(nb * sms) +
                                                   " blocks can be co-resident on this device (" +
                                                   std::to_string(sms) + " SMs)");
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  cudaError_t err = cudaSuccess;
  if (p.num_counters > 0) err = cudaMemsetAsync(p.counters, 0, sizeof(int32_t) * p.num_counters, stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(p.error, 0, sizeof(int32_t) * TILEVOX_MK_ERROR_WORDS, stream);
  if (err != cudaSuccess) return fail(TILEVOX_ERR_CUDA, std::string("megakernel: reset: ") + cudaGetErrorString(err));
  megakernel<<<p.num_queues, kThreads, kSmemBytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return fail(TILEVOX_ERR_CUDA, std::string("megakernel: launch: ") + cudaGetErrorString(err));
  if (p.flags & TILEVOX_MK_FLAG_SYNC_CHECK) {
    err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return fail(TILEVOX_ERR_CUDA, std::string("megakernel: run: ") + cudaGetErrorString(err));
    int32_t words[TILEVOX_MK_ERROR_WORDS];
    err = cudaMemcpy(words, p.error, sizeof(words), cudaMemcpyDeviceToHost);
    if (err != cudaSuccess)
      return fail(TILEVOX_ERR_CUDA, std::string("megakernel: read error words: ") + cudaGetErrorString(err));
    if (words[0] != TILEVOX_MK_ERROR_NONE) {
      const std::string detail = "queue " + std::to_string(words[1]) + " position " + std::to_string(words[2]) +
                                 " opcode " + std::to_string(words[3]) + " counter " + std::to_string(words[4]) +
                                 " value " + std::to_string(words[5]) + " target " + std::to_string(words[6]);
      if (words[0] == TILEVOX_MK_ERROR_WATCHDOG)
        return fail(TILEVOX_ERR_MK_WATCHDOG, "megakernel: watchdog (a wait never satisfied): " + detail);
      return fail(TILEVOX_ERR_MK_FAULT, "megakernel: fault code " + std::to_string(words[0]) + ": " + detail);
    }
  }
  return TILEVOX_OK;
}
