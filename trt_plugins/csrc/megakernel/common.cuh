// common.cuh: Shared device helpers of the megakernel: kernel limits, buffer views (Buf, Ctx), typed loads and stores,
// warp and block reductions, error reporting, where a row's keys sit in the KV cache (sliding-window rings).
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChunk = 8;                    // batch rows per matrix-vector pass
constexpr int kXsFloats = TILEVOX_MK_MAX_ROW_WIDTH;  // 192 KiB: staged activation rows
constexpr int kExtraFloats = 8192;              // 32 KiB: per-head scratch (64 batch rows x 128 dims)
constexpr int kSmemBytes = (kXsFloats + kExtraFloats) * 4;
constexpr int kMaxDims = 5;
// Tensor-core path, inside the xs region: bf16 staging, then the warps' partial sums (fp32).
constexpr int kTcStageBytes = 136 * 1024;
constexpr int kTcRedFloats = (kXsFloats * 4 - kTcStageBytes) / 4;  // 64 KiB = 8 warps x 2 x 16 x 64
constexpr int kTcMaxBatch = 64;
// Partial sums: 8 warps x 16 rows x 64 batch rows per matrix. The one-matrix ops fit before `extra`
// (the QKV op uses extra as its per-head scratch at the same time); gate/up (two matrices) runs into
// extra, which that op does not use.
static_assert(kTcRedFloats >= kWarps * 16 * kTcMaxBatch, "one-matrix partial sums overflow");
static_assert(kTcRedFloats + kExtraFloats >= kWarps * 2 * 16 * kTcMaxBatch, "two-matrix partial sums overflow");
constexpr int kPrefetchDistance = 2;  // instructions ahead whose weights are prefetched to L2

// Build-time variants, for same-run A/B measurements (benchmarks/megakernel_variants.py builds one library
// per setting; the default build uses the values below). "Measured" = Llasa-1B step, context 512, batch
// 1 / 8 / 32, on an H100 on 2026-12-06 (benchmarks/results/megakernel_variants_h100_*.json); run noise ~3 %.
// TILEVOX_MK_POLL: 0 = every poll of a counter also reads the error word and the timer, then sleeps
// (32-256 ns backoff); 1 = poll the counter alone, checking the error word and the watchdog every
// kPollCheckEvery polls, without sleeping. Measured: no difference.
#ifndef TILEVOX_MK_POLL
#define TILEVOX_MK_POLL 0
#endif
// TILEVOX_MK_RELEASE: 0 = __threadfence() then atomicAdd; 1 = one red.release.gpu add (cumulative: it
// orders every write the block's barrier ordered before it). Measured: no difference.
#ifndef TILEVOX_MK_RELEASE
#define TILEVOX_MK_RELEASE 0
#endif
// TILEVOX_MK_INFLIGHT: k blocks of weight loads in flight per warp on the tensor-core path, as a
// multiple of the default (1 or 2). Measured: 2 is 10-15 % slower (the waits that follow the loads grew).
#ifndef TILEVOX_MK_INFLIGHT
#define TILEVOX_MK_INFLIGHT 1
#endif
// TILEVOX_MK_QKV_INFLIGHT: the same multiplier for the QKV op alone. Its stages have fewer tiles than SMs
// (one per head: 48 for Llama-1B, 32 for the Qwen3-TTS predictor), each a whole head's rows (256 KiB), so
// HBM is not saturated and a deeper stream per SM could shorten the stage (written against the 13-14 us QKV
// tiles on the critical path). Measured (H100, megakernel_variants_h100_e666ade.json): 2 gives 2.76 / 6.63 ms
// against 2.77 / 6.57 at batch 1 / 32, no gain (ptxas: the QKV body then spills), so it follows INFLIGHT.
#ifndef TILEVOX_MK_QKV_INFLIGHT
#define TILEVOX_MK_QKV_INFLIGHT TILEVOX_MK_INFLIGHT
#endif
// TILEVOX_MK_ACQUIRE: 1 = counters are polled with ld.acquire.gpu; 0 = with ld.relaxed.gpu (tried on the
// guess that an acquire waits behind the weight loads issued before it). Relaxed would be enough here:
// everything an instruction reads that another SM wrote in this launch is read with ld.cg from L2, which
// the producer's release made current, after the block barrier that follows the poll. Measured: no
// difference, so the default stays with the memory model's acquire.
#ifndef TILEVOX_MK_ACQUIRE
#define TILEVOX_MK_ACQUIRE 1
#endif
// TILEVOX_MK_EARLY_POLL: 1 = when thread 0 reads an instruction's record it starts an asynchronous copy
// (cp.async, no register) of its first kEarlyWaits awaited counters into shared memory, ahead of the
// instruction's weight loads; wait_deps takes a copied value that already meets its target instead of
// polling (a copy can only be older than the counter, never ahead of it: counters only grow during a
// launch). 0 = the first poll is issued inside wait_deps, behind the weight loads. Written against the
// ~4.5 us per instruction the critical path spends between a record and its met counters. Measured: no
// difference (2.75 against 2.77 ms at batch 1, idle waits unchanged), so off.
#ifndef TILEVOX_MK_EARLY_POLL
#define TILEVOX_MK_EARLY_POLL 0
#endif
// TILEVOX_MK_OP_NOINLINE: 1 = every opcode body is a __noinline__ function (its own register allocation);
// 0 = the compiler decides (before 2026-12-06 it inlined most of them and the interpreter loop spilled).
// Measured with the context passed by value: 0 is 2 % faster at batch 1 (queue gaps 0.18 against 0.26 ms
// on the critical path), equal at 8 and 32: within run noise, so 1 stays (no spills in any opcode body).
#ifndef TILEVOX_MK_OP_NOINLINE
#define TILEVOX_MK_OP_NOINLINE 1
#endif
// TILEVOX_MK_WEIGHT_L1: 1 = the tensor-core path's weight stream is read through L1 like any read-only load
// (__ldg); 0 = with ld.global.nc.L1::no_allocate, so the stream (read once per launch) does not evict the
// ~28 KB of L1 left beside the 224 KB of shared memory, where the buffer table, the records' buffers and the
// norm gains could stay. Written against the buffer lookups (one L2 round trip each) at every instruction's
// start. Measured (H100, megakernel_variants_h100_e666ade.json, 16-row tiles): 0 gives 2.54 against 2.77 ms at
// batch 1 (attention on the critical path shrank) but 6.77 against 6.57 at batch 32, so 1 stays for now.
#ifndef TILEVOX_MK_WEIGHT_L1
#define TILEVOX_MK_WEIGHT_L1 1
#endif
// TILEVOX_MK_REPEAT_ATTN: a diagnostic, never for serving: 1 = every ATTN_PARTIAL runs twice in a row on its SM (the
// second run idempotent: same inputs, same outputs), so that the profile's execution time of the pair, against
// one run's, says how much of one run is cold-start cost (instruction fetch into a cold SM; its data come from L2
// both times) rather than the work itself.
#ifndef TILEVOX_MK_REPEAT_ATTN
#define TILEVOX_MK_REPEAT_ATTN 0
#endif
#if TILEVOX_MK_OP_NOINLINE
#define TILEVOX_MK_OP __device__ __noinline__
#else
#define TILEVOX_MK_OP __device__
#endif
constexpr int kEarlyWaits = 2;
constexpr int kPollCheckEvery = 32;

enum DT {
  F32 = TILEVOX_MK_DTYPE_FLOAT32,
  BF16 = TILEVOX_MK_DTYPE_BFLOAT16,
  F16 = TILEVOX_MK_DTYPE_FLOAT16,
  I64 = TILEVOX_MK_DTYPE_INT64,
  I32 = TILEVOX_MK_DTYPE_INT32
};

struct Buf {
  char* p;
  int dt;
  int ndim;
  int64_t dims[kMaxDims];
};

// prm refers to the kernel's __grid_constant__ parameter: reads stay in the constant bank (a copy in the
// context would live in local memory, whose L1 lines the weight stream evicts).
struct Ctx {
  const tilevox_megakernel_params& prm;
  int queue;
  int pos;
  int* stop;         // shared: set when this block must stop (error here or elsewhere)
  int64_t* prof;     // this queue's profile rows, or null
  const int* early;  // shared: the first kEarlyWaits awaited counters as read at the record (TILEVOX_MK_EARLY_POLL)
};

__device__ __forceinline__ Buf get_buf(const Ctx& c, int id) {
  Buf b;
  b.p = nullptr;
  b.dt = F32;
  b.ndim = 0;
  for (int i = 0; i < kMaxDims; ++i) b.dims[i] = 1;
  if (id < 0 || id >= c.prm.num_buffers) return b;
  // The whole 64-byte row and the pointer in independent read-only loads (the tables do not change during a
  // launch): one round trip, not one for the rank and another for the dims it bounds.
  const longlong2* row = reinterpret_cast<const longlong2*>(c.prm.buffer_table + (int64_t)id * (3 + kMaxDims));
  const longlong2 r01 = __ldg(row), r23 = __ldg(row + 1), r45 = __ldg(row + 2), r67 = __ldg(row + 3);
  b.p = reinterpret_cast<char*>(__ldg(reinterpret_cast<const unsigned long long*>(c.prm.buffer_ptrs) + id));
  b.dt = (int)r01.y;
  b.ndim = (int)r23.x;
  const int64_t dims[kMaxDims] = {r23.y, r45.x, r45.y, r67.x, r67.y};
#pragma unroll
  for (int i = 0; i < kMaxDims; ++i) b.dims[i] = i < b.ndim ? dims[i] : 1;
  return b;
}
static_assert(3 + kMaxDims == 8, "get_buf loads a buffer-table row as four 16-byte words");

// The keys a row of `length` positions attends and where they start in the cache (RegionConstants.window; the
// VM's key_span): every position from cache position 0 without a window; with a window W, the last min(length, W)
// positions, contiguous from cache position start % W of the ring written twice (position p at p % W and
// p % W + W).
struct KeySpan {
  int64_t count, phys;
};
__device__ __forceinline__ KeySpan key_span(int window, int64_t length) {
  if (window <= 0) return {length, 0};
  const int64_t start = length > window ? length - window : 0;
  return {length - start, start % window};
}
// The cache position that holds position `pos`, and with a window the second copy's offset from it (0: none).
__device__ __forceinline__ int64_t cache_pos(int window, int64_t pos) { return window > 0 ? pos % window : pos; }
__device__ __forceinline__ int64_t ring_copy(int window) { return window > 0 ? window : 0; }

__device__ __forceinline__ float bf16_bits_to_float(unsigned short u) {
  return __uint_as_float(static_cast<unsigned>(u) << 16);
}

// Activation / state load through L2 (coherent across SMs within the launch).
__device__ __forceinline__ float ld_act(const Buf& b, int64_t i) {
  switch (b.dt) {
    case F32:
      return __ldcg(reinterpret_cast<const float*>(b.p) + i);
    case BF16:
      return bf16_bits_to_float(__ldcg(reinterpret_cast<const unsigned short*>(b.p) + i));
    case F16:
      return __half2float(__ushort_as_half(__ldcg(reinterpret_cast<const unsigned short*>(b.p) + i)));
    case I64:
      return (float)__ldcg(reinterpret_cast<const long long*>(b.p) + i);
    default:
      return (float)__ldcg(reinterpret_cast<const int*>(b.p) + i);
  }
}

// Weight load (read-only for the whole launch).
__device__ __forceinline__ float ld_w(const Buf& b, int64_t i) {
  switch (b.dt) {
    case F32:
      return __ldg(reinterpret_cast<const float*>(b.p) + i);
    case BF16:
      return bf16_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(b.p) + i));
    case F16:
      return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(b.p) + i)));
    default:
      return 0.f;
  }
}

// 16 bytes of a weight stream (see TILEVOX_MK_WEIGHT_L1).
__device__ __forceinline__ uint4 ld_w16(const uint4* p) {
#if TILEVOX_MK_WEIGHT_L1
  return __ldg(p);
#else
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
#endif
}

__device__ __forceinline__ int64_t ld_int(const Buf& b, int64_t i) {
  if (b.dt == I64) return __ldcg(reinterpret_cast<const long long*>(b.p) + i);
  return __ldcg(reinterpret_cast<const int*>(b.p) + i);
}

__device__ __forceinline__ float rnd(float v, int dt) {
  if (dt == BF16) return __bfloat162float(__float2bfloat16_rn(v));
  if (dt == F16) return __half2float(__float2half_rn(v));
  return v;
}

__device__ __forceinline__ void st(const Buf& b, int64_t i, float v) {
  switch (b.dt) {
    case F32:
      reinterpret_cast<float*>(b.p)[i] = v;
      break;
    case BF16:
      reinterpret_cast<__nv_bfloat16*>(b.p)[i] = __float2bfloat16_rn(v);
      break;
    case F16:
      reinterpret_cast<__half*>(b.p)[i] = __float2half_rn(v);
      break;
    default:
      break;
  }
}

// Dtype-typed forms of ld_act / ld_w / st for fast paths that check their buffers' dtypes once: DT >= 0 is that
// dtype, known at compile time (no switch per element); DT < 0 falls back to the buffer's own dtype. A switch per
// element is a chain of branches around every load and store (see head_rope.cuh for what removing it
// measured).
template <int DT>
__device__ __forceinline__ float ld_act_t(const Buf& b, int64_t i) {
  if constexpr (DT == F32) return __ldcg(reinterpret_cast<const float*>(b.p) + i);
  else if constexpr (DT == BF16) return bf16_bits_to_float(__ldcg(reinterpret_cast<const unsigned short*>(b.p) + i));
  else return ld_act(b, i);
}
template <int DT>
__device__ __forceinline__ float ld_w_t(const Buf& b, int64_t i) {
  if constexpr (DT == F32) return __ldg(reinterpret_cast<const float*>(b.p) + i);
  else if constexpr (DT == BF16) return bf16_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(b.p) + i));
  else return ld_w(b, i);
}
template <int DT>
__device__ __forceinline__ void st_t(const Buf& b, int64_t i, float v) {
  if constexpr (DT == F32) reinterpret_cast<float*>(b.p)[i] = v;
  else if constexpr (DT == BF16) reinterpret_cast<__nv_bfloat16*>(b.p)[i] = __float2bfloat16_rn(v);
  else st(b, i, v);
}
template <int DT>
__device__ __forceinline__ float rnd_t(float v, int dt) {
  if constexpr (DT == F32) return v;
  else if constexpr (DT == BF16) return __bfloat162float(__float2bfloat16_rn(v));
  else return rnd(v, dt);
}
// The dtype tag of a fast path: Typed<BF16> when every buffer it checks is bf16, else Typed<-1> (each its own).
template <int DT>
struct Typed {
  static constexpr int value = DT;
};

__device__ __forceinline__ void st_int(const Buf& b, int64_t i, int64_t v) {
  if (b.dt == I64)
    reinterpret_cast<long long*>(b.p)[i] = v;
  else
    reinterpret_cast<int*>(b.p)[i] = (int)v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }

// One poll of a dependency counter (see TILEVOX_MK_ACQUIRE).
__device__ __forceinline__ int ld_poll(const int* p) {
#if TILEVOX_MK_ACQUIRE
  return ld_acquire(p);
#else
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Add v to *p with release semantics at GPU scope (see TILEVOX_MK_RELEASE).
__device__ __forceinline__ void release_add(int* p, int v) {
#if TILEVOX_MK_RELEASE
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
  __threadfence();
  atomicAdd(p, v);
#endif
}

// First writer wins; the remaining words are written by that writer only.
__device__ void raise_error(const Ctx& c, int code, int opcode, int counter, int value, int target) {
  int* e = c.prm.error;
  if (atomicCAS(e, 0, code) == 0) {
    e[1] = c.queue;
    e[2] = c.pos;
    e[3] = opcode;
    e[4] = counter;
    e[5] = value;
    e[6] = target;
    __threadfence();
  }
}

// Block-wide reductions (all threads call; result broadcast). red: kWarps floats of shared memory.
__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < kWarps; ++i) t += red[i];
  return t;
}

__device__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = -INFINITY;
  for (int i = 0; i < kWarps; ++i) t = fmaxf(t, red[i]);
  return t;
}

__device__ long long block_min_ll(long long v, long long* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    long long other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other < v ? other : v;
  }
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  long long t = red[0];
  for (int i = 1; i < kWarps; ++i) t = red[i] < t ? red[i] : t;
  return t;
}
