// megakernel.cu: the persistent instruction interpreter of decode regions (see megakernel.h).
//
// One block (256 threads) per queue walks its instruction records in order. An instruction first
// issues the loads that depend on nothing (its weight tile), then waits on its counters (thread 0,
// acquire loads + __nanosleep backoff + %globaltimer watchdog), stages its inputs, computes and
// stores; after one barrier thread 0 fences and bumps the signal counter. The opcode bodies follow
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

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChunk = 8;                    // batch rows per matrix-vector pass
constexpr int kXsFloats = 48 * 1024;            // 192 KiB: staged activation rows
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

enum DT { F32 = 0, BF16 = 1, F16 = 2, I64 = 3, I32 = 4 };

struct Buf {
  char* p;
  int dt;
  int ndim;
  int64_t dims[kMaxDims];
};

struct Ctx {
  tilevox_megakernel_params prm;
  int queue;
  int pos;
  int* stop;      // shared: set when this block must stop (error here or elsewhere)
  int64_t* prof;  // this queue's profile rows, or null
};

__device__ __forceinline__ Buf get_buf(const Ctx& c, int id) {
  Buf b;
  b.p = nullptr;
  b.dt = F32;
  b.ndim = 0;
  for (int i = 0; i < kMaxDims; ++i) b.dims[i] = 1;
  if (id < 0 || id >= c.prm.num_buffers) return b;
  const int64_t* row = c.prm.buffer_table + (int64_t)id * (3 + kMaxDims);
  b.p = static_cast<char*>(c.prm.buffer_ptrs[id]);
  b.dt = (int)row[1];
  b.ndim = (int)row[2];
  for (int i = 0; i < b.ndim && i < kMaxDims; ++i) b.dims[i] = row[3 + i];
  return b;
}

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

// ---------------------------------------------------------------------------------------------
// Matrix-vector core.

// Stage rows [b0, b0 + nc) of x (row length K) into xs as fp32; with ln, xn = rmsnorm(x) * ln_w in
// the VM's rounding order: x32 * (1 / sqrt(mean(x32^2) + eps)), rounded to x's dtype, times ln_w
// (rounded to x's dtype when ln_w has it). Ends with __syncthreads.
__device__ void stage_rows(float* xs, const Buf& x, int b0, int nc, int K, const Buf* ln, float eps) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c = warp; c < nc; c += kWarps) {
    const int64_t base = (int64_t)(b0 + c) * K;
    float* dst = xs + (int64_t)c * K;
    if (ln == nullptr) {
      for (int k = lane; k < K; k += 32) dst[k] = ld_act(x, base + k);
    } else {
      float ss = 0.f;
      for (int k = lane; k < K; k += 32) {
        const float v = ld_act(x, base + k);
        dst[k] = v;
        ss += v * v;
      }
      ss = warp_sum(ss);
      const float scale = 1.0f / sqrtf(ss / (float)K + eps);
      const int prod_dt = ln->dt == x.dt ? x.dt : F32;
      for (int k = lane; k < K; k += 32) dst[k] = rnd(ld_w(*ln, k) * rnd(dst[k] * scale, x.dt), prod_dt);
    }
  }
  __syncthreads();
}

// acc[c] += the 8 bf16 weights in `raw` . xs[c][k .. k+8).
__device__ __forceinline__ void fma_bf16x8(float (&acc)[kMaxChunk], const uint4 raw, const float* xs, int nc, int K,
                                           int k) {
  float wv[8];
  const unsigned u[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    wv[2 * j] = __uint_as_float(u[j] << 16);
    wv[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
  }
#pragma unroll
  for (int c = 0; c < kMaxChunk; ++c) {
    if (c < nc) {
      const float4 a = *reinterpret_cast<const float4*>(xs + (int64_t)c * K + k);
      const float4 b = *reinterpret_cast<const float4*>(xs + (int64_t)c * K + k + 4);
      acc[c] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z +
                wv[7] * b.w;
    }
  }
}

// acc[c] += sum_k xs[c][k] * w[row][k] over this lane's share of k (not yet warp-reduced).
template <int WDT>
__device__ __forceinline__ void dot_row(const float* xs, int nc, int K, const char* w, int64_t row,
                                        float (&acc)[kMaxChunk]) {
  const int lane = threadIdx.x & 31;
  if (WDT == BF16 && (K % 8) == 0) {
    // Four 16-byte weight loads in flight per lane (a warp streams 2 KiB of the row at a time).
    const uint4* wr = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(w) + row * K);
    const int n8 = K / 8;  // uint4 words in the row
    int i = lane;
    for (; i + 96 < n8; i += 128) {
      const uint4 r0 = __ldg(wr + i), r1 = __ldg(wr + i + 32), r2 = __ldg(wr + i + 64), r3 = __ldg(wr + i + 96);
      fma_bf16x8(acc, r0, xs, nc, K, 8 * i);
      fma_bf16x8(acc, r1, xs, nc, K, 8 * (i + 32));
      fma_bf16x8(acc, r2, xs, nc, K, 8 * (i + 64));
      fma_bf16x8(acc, r3, xs, nc, K, 8 * (i + 96));
    }
    for (; i < n8; i += 32) fma_bf16x8(acc, __ldg(wr + i), xs, nc, K, 8 * i);
  } else if (WDT == F32 && (K % 4) == 0) {
    const float* wr = reinterpret_cast<const float*>(w) + row * K;
    for (int k = lane * 4; k < K; k += 128) {
      const float4 wv = __ldg(reinterpret_cast<const float4*>(wr + k));
#pragma unroll
      for (int c = 0; c < kMaxChunk; ++c) {
        if (c < nc) {
          const float4 a = *reinterpret_cast<const float4*>(xs + (int64_t)c * K + k);
          acc[c] += wv.x * a.x + wv.y * a.y + wv.z * a.z + wv.w * a.w;
        }
      }
    }
  } else {
    Buf wb;
    wb.p = const_cast<char*>(w);
    wb.dt = WDT;
    for (int k = lane; k < K; k += 32) {
      const float wv = ld_w(wb, row * K + k);
#pragma unroll
      for (int c = 0; c < kMaxChunk; ++c)
        if (c < nc) acc[c] += wv * xs[(int64_t)c * K + k];
    }
  }
}

// For every row r in [r0, r1) (one warp per row): out[c] = xs[c] . w[r] (and . w2[r] when two);
// epi(c, r, v1, v2) runs on lane 0.
template <int WDT, bool TWO, class Epi>
__device__ void rows_loop(const float* xs, int nc, int K, const char* w, const char* w2, int r0, int r1, Epi epi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = r0 + warp; r < r1; r += kWarps) {
    float acc[kMaxChunk], acc2[kMaxChunk];
#pragma unroll
    for (int c = 0; c < kMaxChunk; ++c) acc[c] = acc2[c] = 0.f;
    dot_row<WDT>(xs, nc, K, w, r, acc);
    if (TWO) dot_row<WDT>(xs, nc, K, w2, r, acc2);
#pragma unroll
    for (int c = 0; c < kMaxChunk; ++c) {
      if (c < nc) {
        const float v = warp_sum(acc[c]);
        const float v2 = TWO ? warp_sum(acc2[c]) : 0.f;
        if (lane == 0) epi(c, r, v, v2);
      }
    }
  }
}

template <bool TWO, class Epi>
__device__ void rows(int wdt, const float* xs, int nc, int K, const Buf& w, const Buf* w2, int r0, int r1, Epi epi) {
  const char* p2 = w2 ? w2->p : nullptr;
  switch (wdt) {
    case BF16:
      rows_loop<BF16, TWO>(xs, nc, K, w.p, p2, r0, r1, epi);
      break;
    case F16:
      rows_loop<F16, TWO>(xs, nc, K, w.p, p2, r0, r1, epi);
      break;
    default:
      rows_loop<F32, TWO>(xs, nc, K, w.p, p2, r0, r1, epi);
      break;
  }
}

__device__ __forceinline__ int chunk_rows(int K) {
  const int n = kXsFloats / (K > 0 ? K : 1);
  return n < kMaxChunk ? n : kMaxChunk;
}

// ---------------------------------------------------------------------------------------------
// Tensor-core matrix-vector (bf16 weights x bf16 activations, fp32 accumulation).

__device__ __forceinline__ bool tc_eligible(const Buf& x, const Buf& w, const Buf* ln, int K) {
  return x.dt == BF16 && w.dt == BF16 && (ln == nullptr || ln->dt == BF16) && K % 32 == 0;
}

// Row stride of the staged bf16 activations in elements: 64 bytes past a multiple of 128, so the two
// batch rows a quarter-warp's 16-byte fragment loads touch fall in different banks.
__device__ __forceinline__ int tc_stride(int K) { return ((K * 2 + 127) / 128) * 64 + 32; }

// Largest 8 * 2^j <= n, capped at kTcMaxBatch (0 when n < 8): the batch rows of one staged chunk.
__device__ __forceinline__ int pow2x8_floor(int n) {
  if (n < 8) return 0;
  int r = 8;
  while (r * 2 <= n && r * 2 <= kTcMaxBatch) r *= 2;
  return r;
}

__device__ __forceinline__ int tc_chunk_rows(int K) { return pow2x8_floor(kTcStageBytes / (tc_stride(K) * 2)); }

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// bf16(g * bf16(x * scale)) for the two bf16 halves of u (x) and gw (g): the VM's rmsnorm rounding.
__device__ __forceinline__ uint32_t norm_pair(uint32_t u, uint32_t gw, float scale) {
  const float x0 = __uint_as_float(u << 16), x1 = __uint_as_float(u & 0xffff0000u);
  const float g0 = __uint_as_float(gw << 16), g1 = __uint_as_float(gw & 0xffff0000u);
  const float t0 = rnd(x0 * scale, BF16), t1 = rnd(x1 * scale, BF16);
  const __nv_bfloat16 r0 = __float2bfloat16_rn(g0 * t0), r1 = __float2bfloat16_rn(g1 * t1);
  return static_cast<uint32_t>(__bfloat16_as_ushort(r0)) | (static_cast<uint32_t>(__bfloat16_as_ushort(r1)) << 16);
}

// Stage rows [b0, b0 + nc) of x (bf16, row length K) into xs (row stride tc_stride(K)), rows
// [nc, nc_pad) zero; with ln, rmsnorm'ed as stage_rows does. Block-wide 16-byte copies. Ends with
// __syncthreads.
__device__ void tc_stage_rows(unsigned short* xs, const Buf& x, int b0, int nc, int nc_pad, int K, const Buf* ln,
                              float eps) {
  __shared__ float row_scale[kTcMaxBatch];
  const int stride = tc_stride(K), n8 = K / 8;
  const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(x.p) + (int64_t)b0 * K);
  for (int idx = threadIdx.x; idx < nc_pad * n8; idx += kThreads) {
    const int c = idx / n8, j = idx - c * n8;
    const uint4 v = c < nc ? __ldcg(src + (int64_t)c * n8 + j) : make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(xs + c * stride + 8 * j) = v;
  }
  __syncthreads();
  if (ln == nullptr) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c = warp; c < nc; c += kWarps) {
    float ss = 0.f;
    for (int k = lane * 8; k < K; k += 256) {
      const uint4 v = *reinterpret_cast<const uint4*>(xs + c * stride + k);
      const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float lo = __uint_as_float(u[j] << 16), hi = __uint_as_float(u[j] & 0xffff0000u);
        ss += lo * lo + hi * hi;
      }
    }
    ss = warp_sum(ss);
    if (lane == 0) row_scale[c] = 1.0f / sqrtf(ss / (float)K + eps);
  }
  __syncthreads();
  const uint4* gain = reinterpret_cast<const uint4*>(ln->p);
  for (int idx = threadIdx.x; idx < nc * n8; idx += kThreads) {
    const int c = idx / n8, j = idx - c * n8;
    uint4* p = reinterpret_cast<uint4*>(xs + c * stride + 8 * j);
    uint4 v = *p;
    const uint4 g = __ldg(gain + j);
    const float sc = row_scale[c];
    v.x = norm_pair(v.x, g.x, sc);
    v.y = norm_pair(v.y, g.y, sc);
    v.z = norm_pair(v.z, g.z, sc);
    v.w = norm_pair(v.w, g.w, sc);
    *p = v;
  }
  __syncthreads();
}

// Rows [r0, r1) of w (and w2) against the NB * 8 staged batch rows: every (16-row group, K-slice)
// work unit is one warp; within a 32-wide k block lane (g, q) loads the 16 bytes [8q, 8q + 8) of rows
// g and g + 8 and the same 16 bytes of batch row g, which serve as the fragments of two m16n8k16 MMAs
// (logical k 2q, 2q+1, 2q+8, 2q+9 <- physical 8q..8q+3, then 8q+4..8q+7). U k blocks of loads are
// issued before their MMAs. Partial sums meet in `red`; epi(c, r, v, v2) runs once per (c < nc, r).
// Issue the weight loads of k blocks [kb, kb + U) (zero past kb1 or for rows past the tile).
template <bool TWO, int U>
__device__ __forceinline__ void tc_load(uint4 (&wa)[U], uint4 (&wb)[U], uint4 (&wa2)[U], uint4 (&wb2)[U],
                                        const uint4* pa, const uint4* pb, const uint4* pa2, const uint4* pb2, int kb,
                                        int kb1, bool va, bool vb) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool in = kb + u < kb1;
    wa[u] = in && va ? __ldg(pa + 4 * (kb + u)) : zero;
    wb[u] = in && vb ? __ldg(pb + 4 * (kb + u)) : zero;
    if (TWO) {
      wa2[u] = in && va ? __ldg(pa2 + 4 * (kb + u)) : zero;
      wb2[u] = in && vb ? __ldg(pb2 + 4 * (kb + u)) : zero;
    }
  }
}

// Rows [r0, r1) of w (and w2) against the NB * 8 staged batch rows: every (16-row group, K-slice)
// work unit is one warp; within a 32-wide k block lane (g, q) loads the 16 bytes [8q, 8q + 8) of rows
// g and g + 8 and the same 16 bytes of batch row g, which serve as the fragments of two m16n8k16 MMAs
// (logical k 2q, 2q+1, 2q+8, 2q+9 <- physical 8q..8q+3, then 8q+4..8q+7). U k blocks of loads are
// issued before their MMAs. The first U are issued before `pro` (block-wide: wait for the inputs,
// stage them), so the weight stream overlaps the dependency wait. Partial sums meet in `red`;
// epi(c, r, v, v2) runs once per (c < nc, r). False when pro fails.
template <int NB, bool TWO, int U, class Pro, class Epi>
__device__ bool tc_rows_nb(const unsigned short* xs, int nc, int K, const unsigned short* w, const unsigned short* w2,
                           int r0, int r1, float* red, Pro& pro, Epi& epi) {
  constexpr int kNc8 = NB * 8;
  constexpr int kWarpRed = (TWO ? 2 : 1) * 16 * kNc8;  // floats per warp: matrices x 16 rows x batch
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int stride = tc_stride(K), nkb = K / 32, n16 = K / 8;
  const int m = (r1 - r0 + 15) / 16;
  const int splits = m >= kWarps ? 1 : kWarps / m;
  const int units = m * splits;
  for (int base = 0; base < units; base += kWarps) {
    const int unit = base + warp;
    const bool active = unit < units;
    const int rg = active ? unit / splits : 0, sp = active ? unit - rg * splits : 0;
    const int kb0 = active ? (int)((int64_t)nkb * sp / splits) : 0;
    const int kb1 = active ? (int)((int64_t)nkb * (sp + 1) / splits) : 0;
    const int ra = r0 + rg * 16 + g, rb = ra + 8;
    const bool va = ra < r1, vb = rb < r1;
    const uint4* pa = reinterpret_cast<const uint4*>(w) + (int64_t)(va ? ra : r0) * n16 + q;
    const uint4* pb = reinterpret_cast<const uint4*>(w) + (int64_t)(vb ? rb : r0) * n16 + q;
    const uint4* pa2 = TWO ? reinterpret_cast<const uint4*>(w2) + (int64_t)(va ? ra : r0) * n16 + q : nullptr;
    const uint4* pb2 = TWO ? reinterpret_cast<const uint4*>(w2) + (int64_t)(vb ? rb : r0) * n16 + q : nullptr;
    uint4 wa[U], wb[U], wa2[U], wb2[U];
    tc_load<TWO, U>(wa, wb, wa2, wb2, pa, pb, pa2, pb2, kb0, kb1, va, vb);
    if (base == 0 && !pro()) return false;
    float acc[NB][4], acc2[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[nb][j] = acc2[nb][j] = 0.f;
    const unsigned short* xq = xs + g * stride + 8 * q;
    for (int kb = kb0; kb < kb1;) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (kb + u < kb1) {
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            const uint4 xv = *reinterpret_cast<const uint4*>(xq + nb * 8 * stride + (kb + u) * 32);
            mma_bf16_16816(acc[nb], wa[u].x, wb[u].x, wa[u].y, wb[u].y, xv.x, xv.y);
            mma_bf16_16816(acc[nb], wa[u].z, wb[u].z, wa[u].w, wb[u].w, xv.z, xv.w);
            if (TWO) {
              mma_bf16_16816(acc2[nb], wa2[u].x, wb2[u].x, wa2[u].y, wb2[u].y, xv.x, xv.y);
              mma_bf16_16816(acc2[nb], wa2[u].z, wb2[u].z, wa2[u].w, wb2[u].w, xv.z, xv.w);
            }
          }
        }
      }
      kb += U;
      if (kb < kb1) tc_load<TWO, U>(wa, wb, wa2, wb2, pa, pb, pa2, pb2, kb, kb1, va, vb);
    }
    if (active) {
      // D fragment: (row g, batch 2q + {0,1}) and (row g + 8, same batch) of each n8 block.
      float* rw = red + warp * kWarpRed;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const int n = nb * 8 + 2 * q;
        rw[g * kNc8 + n] = acc[nb][0];
        rw[g * kNc8 + n + 1] = acc[nb][1];
        rw[(g + 8) * kNc8 + n] = acc[nb][2];
        rw[(g + 8) * kNc8 + n + 1] = acc[nb][3];
        if (TWO) {
          rw[16 * kNc8 + g * kNc8 + n] = acc2[nb][0];
          rw[16 * kNc8 + g * kNc8 + n + 1] = acc2[nb][1];
          rw[16 * kNc8 + (g + 8) * kNc8 + n] = acc2[nb][2];
          rw[16 * kNc8 + (g + 8) * kNc8 + n + 1] = acc2[nb][3];
        }
      }
    }
    __syncthreads();
    // Whole row groups per round: splits divides kWarps when m < kWarps, and is 1 otherwise.
    const int groups = (min(units, base + kWarps) - base) / splits;
    for (int idx = threadIdx.x; idx < nc * groups * 16; idx += kThreads) {
      const int c = idx / (groups * 16), rem = idx - c * groups * 16;  // rows fastest: coalesced stores
      const int gi = rem / 16, i = rem - gi * 16;
      const int rgi = base / splits + gi, r = r0 + rgi * 16 + i;
      if (r >= r1) continue;
      float v = 0.f, v2 = 0.f;
      for (int s2 = 0; s2 < splits; ++s2) {
        const float* rw = red + (rgi * splits + s2 - base) * kWarpRed;
        v += rw[i * kNc8 + c];
        if (TWO) v2 += rw[16 * kNc8 + i * kNc8 + c];
      }
      epi(c, r, v, v2);
    }
    __syncthreads();
  }
  return true;
}

template <bool TWO, class Pro, class Epi>
__device__ bool tc_rows(const unsigned short* xs, int nc, int K, const Buf& w, const Buf* w2, int r0, int r1,
                        float* red, Pro& pro, Epi& epi) {
  // k blocks of weight loads in flight per warp (4-8 KiB at batch <= 16); fewer at larger batch, where
  // the MMAs take longer and the accumulators need the registers.
  const auto* a = reinterpret_cast<const unsigned short*>(w.p);
  const auto* b = w2 ? reinterpret_cast<const unsigned short*>(w2->p) : nullptr;
  if (nc <= 8) return tc_rows_nb<1, TWO, TWO ? 4 : 8>(xs, nc, K, a, b, r0, r1, red, pro, epi);
  if (nc <= 16) return tc_rows_nb<2, TWO, TWO ? 4 : 8>(xs, nc, K, a, b, r0, r1, red, pro, epi);
  if (nc <= 32) return tc_rows_nb<4, TWO, TWO ? 2 : 4>(xs, nc, K, a, b, r0, r1, red, pro, epi);
  return tc_rows_nb<8, TWO, TWO ? 2 : 4>(xs, nc, K, a, b, r0, r1, red, pro, epi);
}

// ---------------------------------------------------------------------------------------------
// One staged chunk of batch rows, on either path.

struct Staged {
  bool tc;
  float* xf;            // fp32 path: (nc, K)
  unsigned short* xb;   // tensor-core path: (nc_pad, tc_stride(K)) bf16
  float* red;           // tensor-core path: partial sums
  int nc;
  int K;
  __device__ float at(int ci, int k) const {
    return tc ? bf16_bits_to_float(xb[ci * tc_stride(K) + k]) : xf[(int64_t)ci * K + k];
  }
};

// Batch rows per chunk: the tensor-core path needs a power-of-two multiple of 8 (its n8 blocks).
// `cap` bounds it further (the QKV op's per-head scratch). 0: this path cannot stage one row.
__device__ __forceinline__ int chunk_limit(bool tc, int K, int cap) {
  if (tc) return pow2x8_floor(min(tc_chunk_rows(K), cap));
  return min(chunk_rows(K), cap);
}

__device__ Staged staged_layout(bool tc, float* smem, int nc, int K) {
  Staged s;
  s.tc = tc;
  s.nc = nc;
  s.K = K;
  s.xf = smem;
  s.xb = reinterpret_cast<unsigned short*>(smem);
  s.red = smem + kTcStageBytes / 4;
  return s;
}

// Stage batch rows [b0, b0 + s.nc) of x into s (rmsnorm'ed with ln). Block-wide; ends with a barrier.
__device__ void stage_into(const Staged& s, const Buf& x, int b0, const Buf* ln, float eps) {
  if (s.tc) {
    int pad = 8;
    while (pad < s.nc) pad *= 2;
    tc_stage_rows(s.xb, x, b0, s.nc, pad, s.K, ln, eps);
  } else {
    stage_rows(s.xf, x, b0, s.nc, s.K, ln, eps);
  }
}

// rows [r0, r1) of w (w2) against the chunk that pro() waits for and stages; epi(ci, r, v, v2) per
// output. False when pro fails (the block must stop).
template <bool TWO, class Pro, class Epi>
__device__ bool staged_rows(const Staged& s, const Buf& w, const Buf* w2, int r0, int r1, Pro pro, Epi epi) {
  if (s.tc) return tc_rows<TWO>(s.xb, s.nc, s.K, w, w2, r0, r1, s.red, pro, epi);
  if (!pro()) return false;
  rows<TWO>(w.dt, s.xf, s.nc, s.K, w, w2, r0, r1, epi);
  return true;
}

// Block-wide: thread 0 spin-waits until every awaited counter of `inst` reaches its target (acquire
// loads, __nanosleep backoff, %globaltimer watchdog). False when the block must stop (a watchdog or
// an error raised anywhere).
__device__ bool wait_deps(const Ctx& c, const int* inst) {
  if (threadIdx.x == 0) {
    const tilevox_megakernel_params& prm = c.prm;
    // Errors raised elsewhere are polled only while spinning: a satisfied wait costs one acquire load.
    int s = 0;
    const int nw = inst[TILEVOX_MK_FIELD_NUM_WAITS];
    for (int i = 0; i < nw && !s; ++i) {
      const int counter = inst[TILEVOX_MK_FIELD_WAITS + 2 * i], target = inst[TILEVOX_MK_FIELD_WAITS + 2 * i + 1];
      if (counter < 0 || counter >= prm.num_counters) {
        raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], counter, 0, target);
        s = 1;
        break;
      }
      const int* ctr = prm.counters + counter;
      int value = ld_acquire(ctr);
      if (value >= target) continue;
      const uint64_t t0 = global_ns();
      unsigned sleep_ns = 32;
      while ((value = ld_acquire(ctr)) < target) {
        if (ld_volatile(prm.error) != 0) {
          s = 1;
          break;
        }
        if ((int64_t)(global_ns() - t0) > prm.watchdog_ns) {
          raise_error(c, TILEVOX_MK_ERROR_WATCHDOG, inst[0], counter, value, target);
          s = 1;
          break;
        }
        __nanosleep(sleep_ns);
        sleep_ns = sleep_ns < 256 ? sleep_ns * 2 : 256;
      }
    }
    *c.stop = s;
    if (c.prof) c.prof[3 * c.pos + 1] = (int64_t)global_ns();
  }
  __syncthreads();
  return *c.stop == 0;
}

__device__ __forceinline__ const int* args_of(const int* inst) { return inst + TILEVOX_MK_FIELD_ARGS; }
__device__ __forceinline__ const int* ins_of(const int* inst) { return inst + TILEVOX_MK_FIELD_INPUTS; }
__device__ __forceinline__ const int* outs_of(const int* inst) { return inst + TILEVOX_MK_FIELD_OUTPUTS; }

// ---------------------------------------------------------------------------------------------
// Opcodes. Each returns false after raising an error (the caller stops the block).

__device__ bool op_embed(const Ctx& c, const int* inst) {
  const Buf tokens = get_buf(c, ins_of(inst)[0]), table = get_buf(c, ins_of(inst)[1]);
  const Buf x = get_buf(c, outs_of(inst)[0]);
  const int64_t width = table.dims[1], vocab = table.dims[0];
  if (!wait_deps(c, inst)) return false;
  for (int b = inst[TILEVOX_MK_FIELD_TILE_START]; b < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++b) {
    const int64_t tok = ld_int(tokens, b);
    if (tok < 0 || tok >= vocab) {
      if (threadIdx.x == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)tok, (int)vocab);
      return false;
    }
    for (int64_t k = threadIdx.x; k < width; k += kThreads) st(x, b * width + k, ld_w(table, tok * width + k));
  }
  return true;
}

// Runs body(b0, nc) over the batch rows in chunks of at most step_rows (chunk_limit), with a block
// barrier after each chunk. False (error raised) when not one row fits or body fails.
template <class Body>
__device__ bool for_each_row_chunk(const Ctx& c, const int* inst, int B, int K, int step_rows, Body&& body) {
  if (step_rows < 1) {  // a row longer than the staging buffer
    if (threadIdx.x == 0) raise_error(c, TILEVOX_MK_ERROR_UNSUPPORTED, inst[0], -1, K, kXsFloats);
    return false;
  }
  for (int b0 = 0; b0 < B; b0 += step_rows) {
    if (!body(b0, min(step_rows, B - b0))) return false;
    __syncthreads();
  }
  return true;
}

__device__ bool op_linear_bias(const Ctx& c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[0]), w = get_buf(c, ins_of(inst)[1]);
  const int bias_id = ins_of(inst)[2];
  const Buf bias = get_buf(c, bias_id);
  const Buf y = get_buf(c, outs_of(inst)[0]);
  const int B = (int)x.dims[0], K = (int)x.dims[1], N = (int)y.dims[1];
  const bool tc = tc_eligible(x, w, nullptr, K) && chunk_limit(true, K, kTcMaxBatch) > 0;
  return for_each_row_chunk(c, inst, B, K, chunk_limit(tc, K, kTcMaxBatch), [&](int b0, int nc) {
    const Staged sx = staged_layout(tc, xs, nc, K);
    return staged_rows<false>(
        sx, w, nullptr, inst[TILEVOX_MK_FIELD_TILE_START], inst[TILEVOX_MK_FIELD_TILE_STOP],
        [&] {
          if (b0 == 0 && !wait_deps(c, inst)) return false;
          stage_into(sx, x, b0, nullptr, 0.f);
          return true;
        },
        [&](int ci, int r, float v, float) {
          if (bias_id >= 0) v += ld_w(bias, r);
          st(y, (int64_t)(b0 + ci) * N + r, v);
        });
  });
}

__device__ bool op_qkv(const Ctx& c, const int* inst, float* xs, float* hb) {
  const int* in = ins_of(inst);
  const Buf x = get_buf(c, in[0]), ln = get_buf(c, in[1]), wq = get_buf(c, in[2]), wk = get_buf(c, in[3]),
            wv = get_buf(c, in[4]), qkn = get_buf(c, in[5]), inv_freq = get_buf(c, in[6]),
            positions = get_buf(c, in[7]), slots = get_buf(c, in[8]);
  const bool has_qkn = in[5] >= 0;
  const Buf qb = get_buf(c, outs_of(inst)[0]), kc = get_buf(c, outs_of(inst)[1]), vc = get_buf(c, outs_of(inst)[2]);
  const int group = args_of(inst)[0];
  const int layer = inst[TILEVOX_MK_FIELD_LAYER], step = inst[TILEVOX_MK_FIELD_STEP];
  const int D = c.prm.head_dim, G = c.prm.num_heads / c.prm.num_kv_heads, H = c.prm.num_heads;
  const int B = (int)x.dims[0], K = (int)x.dims[1];
  const float eps = c.prm.rms_norm_eps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Cache dims (layers, slots, kv heads, length, D).
  const int64_t c_slots = kc.dims[1], c_heads = kc.dims[2], c_len = kc.dims[3];
  // Every head's (nc, D) output goes through the per-head scratch hb.
  const bool tc = tc_eligible(x, wq, &ln, K) && wk.dt == BF16 && wv.dt == BF16 &&
                  chunk_limit(true, K, kExtraFloats / D) > 0;
  return for_each_row_chunk(c, inst, B, K, chunk_limit(tc, K, kExtraFloats / D), [&](int b0, int nc) {
    const Staged sx = staged_layout(tc, xs, nc, K);
    bool staged = false;  // the first head's rows wait for x (first chunk) and stage it
    auto pro = [&] {
      if (staged) return true;
      staged = true;
      if (b0 == 0 && !wait_deps(c, inst)) return false;
      stage_into(sx, x, b0, &ln, eps);
      return true;
    };
    for (int hs = inst[TILEVOX_MK_FIELD_TILE_START]; hs < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++hs) {
      if (hs > G + 1) {
        if (threadIdx.x == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, hs, G + 1);
        return false;
      }
      const Buf& w = hs < G ? wq : (hs == G ? wk : wv);
      const int row0 = hs < G ? (group * G + hs) * D : group * D;
      if (!staged_rows<false>(sx, w, nullptr, row0, row0 + D, pro,
                              [&](int ci, int r, float v, float) { hb[ci * D + (r - row0)] = rnd(v, x.dt); }))
        return false;
      __syncthreads();
      for (int ci = warp; ci < nc; ci += kWarps) {
        const int b = b0 + ci;
        float* h = hb + ci * D;
        const int64_t pos = ld_int(positions, b) + step;
        if (hs <= G) {  // q or k: optional per-head rmsnorm, then rope
          if (has_qkn) {
            float ss = 0.f;
            for (int d = lane; d < D; d += 32) ss += h[d] * h[d];
            ss = warp_sum(ss);
            const float scale = 1.0f / sqrtf(ss / (float)D + eps);
            const int row = hs < G ? 0 : 1;
            const int prod_dt = qkn.dt == x.dt ? x.dt : F32;
            float tmp[TILEVOX_MK_MAX_HEAD_DIM / 32];
            for (int j = 0, d = lane; d < D; d += 32, ++j)
              tmp[j] = rnd(ld_w(qkn, (int64_t)row * D + d) * rnd(h[d] * scale, x.dt), prod_dt);
            __syncwarp();
            for (int j = 0, d = lane; d < D; d += 32, ++j) h[d] = tmp[j];
            __syncwarp();
          }
          float outv[TILEVOX_MK_MAX_HEAD_DIM / 32];
          const int half = D / 2;
          for (int j = 0, d = lane; d < D; d += 32, ++j) {
            const float f = (float)pos * ld_w(inv_freq, d % half);
            const float cs = rnd(cosf(f), x.dt), sn = rnd(sinf(f), x.dt);
            const float rot = d < half ? -h[d + half] : h[d - half];
            outv[j] = rnd(rnd(h[d] * cs, x.dt) + rnd(rot * sn, x.dt), x.dt);
          }
          if (hs < G) {
            const int head = group * G + hs;
            for (int j = 0, d = lane; d < D; d += 32, ++j) st(qb, ((int64_t)b * H + head) * D + d, outv[j]);
          } else {
            const int64_t slot = ld_int(slots, b);
            if (slot < 0 || slot >= c_slots || pos < 0 || pos >= c_len || group >= c_heads) {
              if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)pos, (int)c_len);
              continue;
            }
            const int64_t base = ((((int64_t)layer * c_slots + slot) * c_heads + group) * c_len + pos) * D;
            for (int j = 0, d = lane; d < D; d += 32, ++j) st(kc, base + d, outv[j]);
          }
        } else {  // v: straight into the cache
          const int64_t slot = ld_int(slots, b);
          if (slot < 0 || slot >= c_slots || pos < 0 || pos >= c_len || group >= c_heads) {
            if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)pos, (int)c_len);
            continue;
          }
          const int64_t base = ((((int64_t)layer * c_slots + slot) * c_heads + group) * c_len + pos) * D;
          for (int d = lane; d < D; d += 32) st(vc, base + d, h[d]);
        }
      }
      __syncthreads();
    }
    return true;
  });
}

// q (fp32, shared) . cached key row at element offset `base`.
__device__ __forceinline__ float dot_q_key(const float* q, const Buf& kc, int64_t base, int D) {
  float dot = 0.f;
  if (kc.dt == BF16 && (D % 8) == 0) {
    const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(kc.p) + base);
#pragma unroll 8
    for (int i = 0; i < D / 8; ++i) {
      const uint4 r = __ldcg(p + i);
      const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        dot += q[8 * i + 2 * j] * __uint_as_float(u[j] << 16) + q[8 * i + 2 * j + 1] * __uint_as_float(u[j] & 0xffff0000u);
    }
  } else if (kc.dt == F32 && (D % 4) == 0) {
    const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(kc.p) + base);
#pragma unroll 8
    for (int i = 0; i < D / 4; ++i) {
      const float4 r = __ldcg(p + i);
      dot += q[4 * i] * r.x + q[4 * i + 1] * r.y + q[4 * i + 2] * r.z + q[4 * i + 3] * r.w;
    }
  } else {
    for (int d = 0; d < D; ++d) dot += q[d] * ld_act(kc, base + d);
  }
  return dot;
}

// One warp per (row, query head): keys of the partition 32 at a time, one key per lane for the
// scores, then the 32 weighted value rows accumulated with lanes over head dims (online softmax).
// ATTN_PARTIAL for bf16 caches, G <= kMaxGroup query heads per kv head, D / 8 dividing 32: one warp
// per (row, partition) computes all G heads of the group together, so each key and value row is loaded
// once, not G times. Per 32-key round: lane t scores key t against the G queries (staged in shared
// memory), then lane (kk, cc) accumulates 8 value dims [8cc, 8cc + 8) over keys kk, kk + kpl, ... with
// 16-byte loads; the lanes of one cc are summed at the end (the online-softmax rescale is linear, so it
// commutes with that sum). Same outputs as the general path.
constexpr int kMaxGroup = 8;
constexpr int kGroupedQFloats = 1024;  // per warp: G x D staged queries (8 warps x 1024 = kExtraFloats)

__device__ __forceinline__ bool attn_grouped_eligible(const Buf& kc, const Buf& vc, int G, int D) {
  return kc.dt == BF16 && vc.dt == BF16 && D % 8 == 0 && 32 % (D / 8) == 0 && G <= kMaxGroup &&
         G * D <= kGroupedQFloats;
}

__device__ void attn_partial_grouped(const Ctx& c, const int* inst, float* q_smem) {
  const int* in = ins_of(inst);
  const Buf qb = get_buf(c, in[0]), kc = get_buf(c, in[1]), vc = get_buf(c, in[2]), positions = get_buf(c, in[3]),
            slots = get_buf(c, in[4]);
  const Buf po = get_buf(c, outs_of(inst)[0]), pl = get_buf(c, outs_of(inst)[1]);
  const int group = args_of(inst)[0];
  const int layer = inst[TILEVOX_MK_FIELD_LAYER], step = inst[TILEVOX_MK_FIELD_STEP];
  const int D = c.prm.head_dim, KVH = c.prm.num_kv_heads, G = c.prm.num_heads / KVH, H = c.prm.num_heads;
  const int P = c.prm.num_partitions, PT = c.prm.partition_tokens, B = c.prm.batch_size;
  const int64_t c_slots = kc.dims[1], c_heads = kc.dims[2], c_len = kc.dims[3];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = c.prm.attn_scale;
  const int cpr = D / 8, kpl = 32 / cpr, kk0 = lane / cpr, cc = lane % cpr;
  float* q = q_smem + warp * kGroupedQFloats;  // (G, D)
  const int t_start = inst[TILEVOX_MK_FIELD_TILE_START], t_stop = inst[TILEVOX_MK_FIELD_TILE_STOP];
  const int items = B * (t_stop - t_start);
  for (int item = warp; item < items; item += kWarps) {
    const int b = item / (t_stop - t_start), part = t_start + item % (t_stop - t_start);
    const int64_t first = (int64_t)part * PT;
    const int64_t length = ld_int(positions, b) + step + 1;
    const int64_t limit = min((int64_t)P * PT, c_len);
    const int64_t base_bp = ((int64_t)b * KVH + group) * P + part;  // (b, group, part): * G + head
    if (length > limit) {
      if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)length, (int)limit);
      continue;
    }
    const int64_t last = min(first + PT, length);
    if (last <= first) {
      for (int idx = lane; idx < G * D; idx += 32) st(po, base_bp * G * D + idx, 0.f);
      if (lane < G) st(pl, base_bp * G + lane, -INFINITY);
      continue;
    }
    const int64_t slot = ld_int(slots, b);
    if (slot < 0 || slot >= c_slots || group >= c_heads) {
      if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)slot, (int)c_slots);
      continue;
    }
    __syncwarp();
    for (int idx = lane; idx < G * D; idx += 32) q[idx] = ld_act(qb, ((int64_t)b * H + group * G) * D + idx);
    __syncwarp();
    const int64_t cache_base = (((int64_t)layer * c_slots + slot) * c_heads + group) * c_len * D;
    const uint4* keys = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(kc.p) + cache_base);
    const unsigned short* vals = reinterpret_cast<const unsigned short*>(vc.p) + cache_base + cc * 8;
    float m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][8];
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
      m[h] = -INFINITY;
      l[h] = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] = 0.f;
    }
    for (int64_t t0 = first; t0 < last; t0 += 32) {
      const int64_t t = t0 + lane;
      const bool valid = t < last;
      float sc[kMaxGroup];
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) sc[h] = 0.f;
      if (valid) {
        const uint4* kr = keys + t * cpr;
#pragma unroll 4
        for (int i = 0; i < cpr; ++i) {
          const uint4 r = __ldcg(kr + i);
          const unsigned u[4] = {r.x, r.y, r.z, r.w};
          float kv[8];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            kv[2 * j] = __uint_as_float(u[j] << 16);
            kv[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
          }
#pragma unroll
          for (int h = 0; h < kMaxGroup; ++h) {
            if (h < G) {
              const float* qh = q + h * D + 8 * i;
#pragma unroll
              for (int j = 0; j < 8; ++j) sc[h] += qh[j] * kv[j];
            }
          }
        }
      }
      float e[kMaxGroup];
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) {
        if (h < G) {
          const float s = valid ? sc[h] * scale : -INFINITY;
          const float m_new = fmaxf(m[h], warp_max(s));  // finite: key t0 is valid
          const float corr = expf(m[h] - m_new);
          e[h] = valid ? expf(s - m_new) : 0.f;
          l[h] = l[h] * corr + warp_sum(e[h]);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[h][j] *= corr;
          m[h] = m_new;
        } else {
          e[h] = 0.f;
        }
      }
      const int nk = (int)min((int64_t)32, last - t0);
      const unsigned short* vr = vals + t0 * D;
#pragma unroll 4
      for (int pass = 0; pass < cpr; ++pass) {
        const int kk = kk0 + pass * kpl;
        uint4 r = make_uint4(0u, 0u, 0u, 0u);
        if (kk < nk) r = __ldcg(reinterpret_cast<const uint4*>(vr + (int64_t)kk * D));
        const unsigned u[4] = {r.x, r.y, r.z, r.w};
        float vv[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          vv[2 * j] = __uint_as_float(u[j] << 16);
          vv[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
        }
#pragma unroll
        for (int h = 0; h < kMaxGroup; ++h) {
          if (h < G) {
            const float ek = __shfl_sync(0xffffffffu, e[h], kk);  // e = 0 past nk
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[h][j] += ek * vv[j];
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
      if (h < G) {
        for (int off = cpr; off < 32; off <<= 1)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[h][j] += __shfl_xor_sync(0xffffffffu, acc[h][j], off);
        if (kk0 == 0)
#pragma unroll
          for (int j = 0; j < 8; ++j) st(po, (base_bp * G + h) * D + cc * 8 + j, acc[h][j] / l[h]);
        if (lane == 0) st(pl, base_bp * G + h, m[h] + logf(l[h]));
      }
    }
  }
}

__device__ bool op_attn_partial(const Ctx& c, const int* inst, float* q_smem) {
  const int* in = ins_of(inst);
  const Buf qb = get_buf(c, in[0]), kc = get_buf(c, in[1]), vc = get_buf(c, in[2]), positions = get_buf(c, in[3]),
            slots = get_buf(c, in[4]);
  const Buf po = get_buf(c, outs_of(inst)[0]), pl = get_buf(c, outs_of(inst)[1]);
  const int group = args_of(inst)[0];
  const int layer = inst[TILEVOX_MK_FIELD_LAYER], step = inst[TILEVOX_MK_FIELD_STEP];
  const int D = c.prm.head_dim, KVH = c.prm.num_kv_heads, G = c.prm.num_heads / KVH, H = c.prm.num_heads;
  const int P = c.prm.num_partitions, PT = c.prm.partition_tokens, B = c.prm.batch_size;
  const int64_t c_slots = kc.dims[1], c_heads = kc.dims[2], c_len = kc.dims[3];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = c.prm.attn_scale;
  float* q = q_smem + warp * TILEVOX_MK_MAX_HEAD_DIM;
  constexpr int kPer = TILEVOX_MK_MAX_HEAD_DIM / 32;
  // bf16 values with D / 8 dividing 32: lane (kk, cc) accumulates 8 dims [8cc, 8cc + 8) over keys
  // kk, kk + kpl, ... of each 32-key round with 16-byte loads, all in flight at once; the lanes of one
  // cc are summed at the end (the online-softmax rescale is linear, so it commutes with that sum).
  const bool vec_v = vc.dt == BF16 && D % 8 == 0 && 32 % (D / 8) == 0;
  const int cpr = vec_v ? D / 8 : 1, kpl = 32 / cpr, kk0 = lane / cpr, cc = lane % cpr;
  if (!wait_deps(c, inst)) return false;
  if (attn_grouped_eligible(kc, vc, G, D)) {
    attn_partial_grouped(c, inst, q_smem);
    return true;
  }
  for (int part = inst[TILEVOX_MK_FIELD_TILE_START]; part < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++part) {
    const int64_t first = (int64_t)part * PT;
    for (int pair = warp; pair < B * G; pair += kWarps) {
      const int b = pair / G, i = pair % G;
      const int64_t length = ld_int(positions, b) + step + 1;
      const int64_t limit = min((int64_t)P * PT, c_len);
      const int64_t out_base = ((((int64_t)b * KVH + group) * P + part) * G + i) * D;
      const int64_t lse_idx = (((int64_t)b * KVH + group) * P + part) * G + i;
      if (length > limit) {
        if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)length, (int)limit);
        continue;
      }
      const int64_t last = min(first + PT, length);
      if (last <= first) {
        for (int d = lane; d < D; d += 32) st(po, out_base + d, 0.f);
        if (lane == 0) st(pl, lse_idx, -INFINITY);
        continue;
      }
      const int64_t slot = ld_int(slots, b);
      if (slot < 0 || slot >= c_slots || group >= c_heads) {
        if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)slot, (int)c_slots);
        continue;
      }
      const int head = group * G + i;
      __syncwarp();
      for (int d = lane; d < D; d += 32) q[d] = ld_act(qb, ((int64_t)b * H + head) * D + d);
      __syncwarp();
      float acc[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[j] = 0.f;  // kPer >= 8: acc[0..8) are the vec_v lane's dims
      const int64_t cache_base = (((int64_t)layer * c_slots + slot) * c_heads + group) * c_len * D;
      float m = -INFINITY, l = 0.f;
      for (int64_t t0 = first; t0 < last; t0 += 32) {
        const int64_t t = t0 + lane;
        const bool valid = t < last;
        const float s = valid ? dot_q_key(q, kc, cache_base + t * D, D) * scale : -INFINITY;
        const float m_new = fmaxf(m, warp_max(s));  // finite: key t0 is valid
        const float corr = expf(m - m_new);
        const float e = valid ? expf(s - m_new) : 0.f;
        l = l * corr + warp_sum(e);
#pragma unroll
        for (int j = 0; j < kPer; ++j) acc[j] *= corr;
        const int nk = (int)min((int64_t)32, last - t0);
        if (vec_v) {
          const unsigned short* vr = reinterpret_cast<const unsigned short*>(vc.p) + cache_base + t0 * D + cc * 8;
#pragma unroll 8
          for (int pass = 0; pass < cpr; ++pass) {
            const int kk = kk0 + pass * kpl;
            const float ek = __shfl_sync(0xffffffffu, e, kk);
            if (kk < nk) {
              const uint4 r = __ldcg(reinterpret_cast<const uint4*>(vr + (int64_t)kk * D));
              const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                acc[2 * j] += ek * __uint_as_float(u[j] << 16);
                acc[2 * j + 1] += ek * __uint_as_float(u[j] & 0xffff0000u);
              }
            }
          }
        } else if (vc.dt == BF16) {
          const unsigned short* vr = reinterpret_cast<const unsigned short*>(vc.p) + cache_base + t0 * D;
#pragma unroll 4
          for (int kk = 0; kk < nk; ++kk) {
            const float ek = __shfl_sync(0xffffffffu, e, kk);
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
              const int d = lane + 32 * j;
              if (d < D) acc[j] += ek * bf16_bits_to_float(__ldcg(vr + (int64_t)kk * D + d));
            }
          }
        } else {
#pragma unroll 4
          for (int kk = 0; kk < nk; ++kk) {
            const float ek = __shfl_sync(0xffffffffu, e, kk);
            const int64_t vb = cache_base + (t0 + kk) * D;
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
              const int d = lane + 32 * j;
              if (d < D) acc[j] += ek * ld_act(vc, vb + d);
            }
          }
        }
        m = m_new;
      }
      if (vec_v) {
        for (int off = cpr; off < 32; off <<= 1)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
        if (kk0 == 0)
#pragma unroll
          for (int j = 0; j < 8; ++j) st(po, out_base + cc * 8 + j, acc[j] / l);
      } else {
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int d = lane + 32 * j;
          if (d < D) st(po, out_base + d, acc[j] / l);
        }
      }
      if (lane == 0) st(pl, lse_idx, m + logf(l));
    }
  }
  return true;
}

__device__ bool op_attn_reduce(const Ctx& c, const int* inst, float* lse_smem) {
  const Buf po = get_buf(c, ins_of(inst)[0]), pl = get_buf(c, ins_of(inst)[1]);
  const Buf out = get_buf(c, outs_of(inst)[0]);
  const int D = c.prm.head_dim, KVH = c.prm.num_kv_heads, G = c.prm.num_heads / KVH, H = c.prm.num_heads;
  const int P = c.prm.num_partitions, B = c.prm.batch_size;
  // The group's log-sum-exps (b, p, i) go to shared memory once when they fit; every output element
  // then reads P of them.
  const bool lse_staged = B * P * G <= kExtraFloats;
  if (!wait_deps(c, inst)) return false;
  for (int g = inst[TILEVOX_MK_FIELD_TILE_START]; g < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++g) {
    if (lse_staged) {
      for (int idx = threadIdx.x; idx < B * P * G; idx += kThreads) {
        const int b = idx / (P * G), rest = idx - b * P * G;  // rest = p * G + i
        lse_smem[idx] = ld_act(pl, ((int64_t)b * KVH + g) * P * G + rest);
      }
      __syncthreads();
    }
    if (lse_staged && po.dt == F32 && D % 4 == 0) {
      // Turn the staged log-sum-exps into normalised partition weights in place, then every thread
      // combines 4 output dims with 16-byte loads of the partial outputs.
      for (int idx = threadIdx.x; idx < B * G; idx += kThreads) {
        const int b = idx / G, i = idx % G;
        float* w = lse_smem + b * P * G + i;  // stride G over p
        float peak = -INFINITY;
        for (int p = 0; p < P; ++p) peak = fmaxf(peak, w[p * G]);
        float den = 0.f;
        for (int p = 0; p < P; ++p) den += expf(w[p * G] - peak);
        for (int p = 0; p < P; ++p) w[p * G] = expf(w[p * G] - peak) / den;
      }
      __syncthreads();
      const int D4 = D / 4;
      const float* pof = reinterpret_cast<const float*>(po.p);
      for (int idx = threadIdx.x; idx < B * G * D4; idx += kThreads) {
        const int d4 = idx % D4, i = (idx / D4) % G, b = idx / (D4 * G);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int p = 0; p < P; ++p) {
          const float w = lse_smem[(b * P + p) * G + i];
          const float4 v =
              __ldcg(reinterpret_cast<const float4*>(pof + ((((int64_t)b * KVH + g) * P + p) * G + i) * D) + d4);
          acc.x += w * v.x;
          acc.y += w * v.y;
          acc.z += w * v.z;
          acc.w += w * v.w;
        }
        const int64_t o = (int64_t)b * H * D + ((int64_t)g * G + i) * D + 4 * d4;
        st(out, o, acc.x);
        st(out, o + 1, acc.y);
        st(out, o + 2, acc.z);
        st(out, o + 3, acc.w);
      }
      __syncthreads();
      continue;
    }
    for (int idx = threadIdx.x; idx < B * G * D; idx += kThreads) {
      const int d = idx % D, i = (idx / D) % G, b = idx / (D * G);
      const int64_t lse_base = ((int64_t)b * KVH + g) * P * G + i;  // + p * G
      auto lse = [&](int p) { return lse_staged ? lse_smem[(b * P + p) * G + i] : ld_act(pl, lse_base + (int64_t)p * G); };
      float peak = -INFINITY;
      for (int p = 0; p < P; ++p) peak = fmaxf(peak, lse(p));
      float num = 0.f, den = 0.f;
#pragma unroll 8
      for (int p = 0; p < P; ++p) {
        const float w = expf(lse(p) - peak);
        num += w * ld_act(po, ((((int64_t)b * KVH + g) * P + p) * G + i) * D + d);
        den += w;
      }
      st(out, (int64_t)b * H * D + ((int64_t)g * G + i) * D + d, num / den);
    }
    __syncthreads();
  }
  return true;
}

// OPROJ_RESIDUAL and DOWN_RESIDUAL: x_out[b, r] = x_in[b, r] + (a[b] . w[r]) rounded.
__device__ bool op_proj_residual(const Ctx& c, const int* inst, float* xs) {
  const Buf a = get_buf(c, ins_of(inst)[0]), w = get_buf(c, ins_of(inst)[1]), x_in = get_buf(c, ins_of(inst)[2]);
  const Buf x_out = get_buf(c, outs_of(inst)[0]);
  const int B = (int)a.dims[0], K = (int)a.dims[1], N = (int)x_out.dims[1];
  const bool tc = tc_eligible(a, w, nullptr, K) && chunk_limit(true, K, kTcMaxBatch) > 0;
  return for_each_row_chunk(c, inst, B, K, chunk_limit(tc, K, kTcMaxBatch), [&](int b0, int nc) {
    const Staged sa = staged_layout(tc, xs, nc, K);
    return staged_rows<false>(
        sa, w, nullptr, inst[TILEVOX_MK_FIELD_TILE_START], inst[TILEVOX_MK_FIELD_TILE_STOP],
        [&] {
          if (b0 == 0 && !wait_deps(c, inst)) return false;
          stage_into(sa, a, b0, nullptr, 0.f);
          return true;
        },
        [&](int ci, int r, float v, float) {
          const int64_t o = (int64_t)(b0 + ci) * N + r;
          st(x_out, o, rnd(ld_act(x_in, o) + rnd(v, x_out.dt), x_out.dt));
        });
  });
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

__device__ bool op_gateup(const Ctx& c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[0]), ln = get_buf(c, ins_of(inst)[1]), wg = get_buf(c, ins_of(inst)[2]),
            wu = get_buf(c, ins_of(inst)[3]);
  const Buf h = get_buf(c, outs_of(inst)[0]);
  const int B = (int)x.dims[0], K = (int)x.dims[1], N = (int)h.dims[1];
  const int dt = h.dt;
  const bool tc = tc_eligible(x, wg, &ln, K) && wu.dt == BF16 && chunk_limit(true, K, kTcMaxBatch) > 0;
  return for_each_row_chunk(c, inst, B, K, chunk_limit(tc, K, kTcMaxBatch), [&](int b0, int nc) {
    const Staged sx = staged_layout(tc, xs, nc, K);
    return staged_rows<true>(
        sx, wg, &wu, inst[TILEVOX_MK_FIELD_TILE_START], inst[TILEVOX_MK_FIELD_TILE_STOP],
        [&] {
          if (b0 == 0 && !wait_deps(c, inst)) return false;
          stage_into(sx, x, b0, &ln, c.prm.rms_norm_eps);
          return true;
        },
        [&](int ci, int r, float g, float u) {
          st(h, (int64_t)(b0 + ci) * N + r, rnd(silu(rnd(g, dt)), dt) * rnd(u, dt));
        });
  });
}

__device__ bool op_lmhead(const Ctx& c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[0]), nw = get_buf(c, ins_of(inst)[1]), w = get_buf(c, ins_of(inst)[2]);
  const Buf logits = get_buf(c, outs_of(inst)[0]);
  const int xn_id = outs_of(inst)[1];
  const Buf xn = get_buf(c, xn_id);
  const int B = (int)x.dims[0], K = (int)x.dims[1], N = (int)logits.dims[1];
  const int r0 = inst[TILEVOX_MK_FIELD_TILE_START];
  const bool tc = tc_eligible(x, w, &nw, K) && chunk_limit(true, K, kTcMaxBatch) > 0;
  return for_each_row_chunk(c, inst, B, K, chunk_limit(tc, K, kTcMaxBatch), [&](int b0, int nc) {
    const Staged sx = staged_layout(tc, xs, nc, K);
    return staged_rows<false>(
        sx, w, nullptr, r0, inst[TILEVOX_MK_FIELD_TILE_STOP],
        [&] {
          if (b0 == 0 && !wait_deps(c, inst)) return false;
          stage_into(sx, x, b0, &nw, c.prm.rms_norm_eps);
          if (r0 == 0 && xn_id >= 0)
            for (int idx = threadIdx.x; idx < nc * K; idx += kThreads)
              st(xn, (int64_t)b0 * K + idx, sx.at(idx / K, idx % K));
          return true;
        },
        [&](int ci, int r, float v, float) { st(logits, (int64_t)(b0 + ci) * N + r, v); });
  });
}

// Order-preserving map of a float to uint32 (larger float -> larger key; -inf lowest of non-NaN).
__device__ __forceinline__ unsigned fkey(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

__device__ bool op_sample(const Ctx& c, const int* inst, float* smem) {
  const int* in = ins_of(inst);
  const Buf logits = get_buf(c, in[0]), temperature = get_buf(c, in[1]), top_k = get_buf(c, in[2]),
            top_p = get_buf(c, in[3]), seed = get_buf(c, in[4]), rng_offset = get_buf(c, in[5]),
            table = get_buf(c, in[6]);
  const bool has_table = in[6] >= 0;
  const Buf tokens_out = get_buf(c, outs_of(inst)[0]), x_next = get_buf(c, outs_of(inst)[1]);
  const int V = args_of(inst)[0], rng_step = args_of(inst)[1];
  const int64_t row_len = logits.dims[1];
  float* red = smem;                                          // kWarps floats
  long long* red_ll = reinterpret_cast<long long*>(smem + 16);  // kWarps int64
  float* scan = smem + 64;                                    // kWarps floats
  __shared__ long long s_token;
  if (!wait_deps(c, inst)) return false;
  for (int row = inst[TILEVOX_MK_FIELD_TILE_START]; row < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++row) {
    const int64_t base = (int64_t)row * row_len;
    const float temp = ld_act(temperature, row);
    long long token;
    if (temp == 0.0f) {
      // argmax, first index among equal maxima (torch.argmax). Each thread scans its elements in
      // increasing order; bf16 rows go 8 elements per 16-byte load, several loads in flight.
      float best = -INFINITY;
      long long best_i = V;
      auto consider = [&](float s, int v) {
        if (s > best || best_i == V) {
          best = s;
          best_i = v;
        }
      };
      if (logits.dt == BF16 && row_len % 8 == 0) {
        const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(logits.p) + base);
        const int nv = (V + 7) / 8;  // the last word may pass V, never the row (row_len % 8 == 0)
#pragma unroll 4
        for (int j = threadIdx.x; j < nv; j += kThreads) {
          const uint4 r = __ldcg(p + j);
          const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int v = 8 * j + 2 * e;
            if (v < V) consider(__uint_as_float(u[e] << 16), v);
            if (v + 1 < V) consider(__uint_as_float(u[e] & 0xffff0000u), v + 1);
          }
        }
      } else {
        for (int v = threadIdx.x; v < V; v += kThreads) consider(ld_act(logits, base + v), v);
      }
      const float top = block_max(best, red);
      token = block_min_ll(best == top ? best_i : (long long)V, red_ll);
    } else {
      const int64_t k = ld_int(top_k, row);
      const float p = ld_act(top_p, row);
      // keep(v): key >= kth_key (top-k) and key > drop_key (top-p), maximum always kept.
      unsigned kth_key = 0;
      if (k > 0 && k < V) {
        for (int bit = 31; bit >= 0; --bit) {
          const unsigned cand = kth_key | (1u << bit);
          float cnt = 0.f;
          for (int v = threadIdx.x; v < V; v += kThreads) cnt += fkey(ld_act(logits, base + v) / temp) >= cand;
          if (block_sum(cnt, red) >= (float)k) kth_key = cand;
        }
      }
      float mx = -INFINITY;
      for (int v = threadIdx.x; v < V; v += kThreads) mx = fmaxf(mx, ld_act(logits, base + v) / temp);
      mx = block_max(mx, red);
      const unsigned max_key = fkey(mx);
      float z = 0.f;
      for (int v = threadIdx.x; v < V; v += kThreads) {
        const float s = ld_act(logits, base + v) / temp;
        if (fkey(s) >= kth_key) z += expf(s - mx);
      }
      z = block_sum(z, red);
      long long drop_key = -1;  // drop keys <= drop_key
      if (p < 1.0f) {
        unsigned t = 0;
        bool any = false;
        for (int bit = 31; bit >= 0; --bit) {
          const unsigned cand = t | (1u << bit);
          float mass = 0.f;
          for (int v = threadIdx.x; v < V; v += kThreads) {
            const float s = ld_act(logits, base + v) / temp;
            const unsigned key = fkey(s);
            if (key >= kth_key && key <= cand) mass += expf(s - mx);
          }
          if (block_sum(mass, red) / z <= 1.0f - p) {
            t = cand;
            any = true;
          }
        }
        if (!any) {
          float mass = 0.f;  // t == 0 itself: only NaN-like keys, mass 0
          any = block_sum(mass, red) / z <= 1.0f - p;
        }
        if (any) drop_key = (long long)t;
      }
      auto kept = [&](float s) {
        const unsigned key = fkey(s);
        return key >= kth_key && ((long long)key > drop_key || key == max_key);
      };
      float total = 0.f;
      for (int v = threadIdx.x; v < V; v += kThreads) {
        const float s = ld_act(logits, base + v) / temp;
        if (kept(s)) total += expf(s - mx);
      }
      total = block_sum(total, red);
      // u from the counter-based hash of vm.uniform_from_seed.
      const long long sd = ld_int(seed, row);
      const uint32_t lo = (uint32_t)((unsigned long long)sd & 0xffffffffull);
      const uint32_t hi = (uint32_t)(((unsigned long long)sd >> 32) & 0xffffffffull);
      const uint32_t key = hash32(hash32(lo) ^ hi);
      const uint32_t ctr = (uint32_t)((unsigned long long)(ld_int(rng_offset, row) + rng_step) & 0xffffffffull);
      const uint32_t bits = hash32(key ^ hash32(ctr));
      const float u = (float)((bits >> 9) * 2u + 1u) * 5.9604644775390625e-8f;  // 2^-24
      const float target = u * total;
      // First index whose inclusive prefix sum exceeds target (searchsorted right), chunk by chunk.
      float carry = 0.f;
      token = V - 1;
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
      for (int start = 0; start < V; start += kThreads) {
        const int v = start + threadIdx.x;
        float e = 0.f;
        if (v < V) {
          const float s = ld_act(logits, base + v) / temp;
          if (kept(s)) e = expf(s - mx);
        }
        float inc = e;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const float n = __shfl_up_sync(0xffffffffu, inc, o);
          if (lane >= o) inc += n;
        }
        __syncthreads();
        if (lane == 31) scan[warp] = inc;
        __syncthreads();
        float off = carry;
        for (int i = 0; i < warp; ++i) off += scan[i];
        float chunk_total = 0.f;
        for (int i = 0; i < kWarps; ++i) chunk_total += scan[i];
        const long long hit = block_min_ll((v < V && off + inc > target) ? (long long)v : (long long)V, red_ll);
        if (hit < V) {
          token = hit;
          break;
        }
        carry += chunk_total;
      }
    }
    if (threadIdx.x == 0) {
      s_token = token;
      st_int(tokens_out, row, token);
    }
    __syncthreads();
    token = s_token;
    if (has_table) {
      const int64_t width = table.dims[1];
      for (int64_t k2 = threadIdx.x; k2 < width; k2 += kThreads)
        st(x_next, (int64_t)row * width + k2, ld_w(table, token * width + k2));
    }
    __syncthreads();
  }
  return true;
}

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
__global__ void __launch_bounds__(kThreads, 1) megakernel(tilevox_megakernel_params prm) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* xs = smem;
  float* extra = smem + kXsFloats;
  __shared__ int records[2][TILEVOX_MK_INSTRUCTION_WORDS];
  __shared__ int stop;
  Ctx c;
  c.prm = prm;
  c.queue = blockIdx.x;
  c.stop = &stop;
  const int n = prm.queue_lengths[blockIdx.x];
  const int* queue = prm.instructions + (int64_t)blockIdx.x * prm.max_queue_len * TILEVOX_MK_INSTRUCTION_WORDS;
  const int64_t* pf_queue = prm.prefetch ? prm.prefetch + (int64_t)blockIdx.x * prm.max_queue_len * 4 : nullptr;
  int64_t* prof = prm.profile ? prm.profile + (int64_t)blockIdx.x * prm.max_queue_len * 3 : nullptr;
  c.prof = prof;
  const bool record_lane = threadIdx.x < TILEVOX_MK_INSTRUCTION_WORDS;
  const bool prefetch_lane = pf_queue != nullptr && threadIdx.x >= 32 && threadIdx.x < 36;  // warp 1, lanes 0-3
  // Prologue: the first record, and the weights of the first kPrefetchDistance instructions.
  if (record_lane && n > 0) records[0][threadIdx.x] = queue[threadIdx.x];
  if (prefetch_lane && threadIdx.x == 32)
    for (int i = 0; i < kPrefetchDistance && i < n; ++i) {
      prefetch_l2(pf_queue[4 * i], pf_queue[4 * i + 1]);
      prefetch_l2(pf_queue[4 * i + 2], pf_queue[4 * i + 3]);
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
    if (prefetch_lane && pos + kPrefetchDistance < n) pf_word = pf_queue[4 * (pos + kPrefetchDistance) + threadIdx.x - 32];
    if (threadIdx.x == 0 && prof) prof[3 * pos] = (int64_t)global_ns();
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
      case TILEVOX_MK_OP_ATTN_PARTIAL:
        ok = op_attn_partial(c, inst, extra);
        break;
      case TILEVOX_MK_OP_ATTN_REDUCE:
        ok = op_attn_reduce(c, inst, extra);
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
      if (prof) prof[3 * pos + 2] = (int64_t)global_ns();
      if (signal >= 0) {
        __threadfence();
        atomicAdd(prm.counters + signal, 1);
      }
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
      p.num_partitions < 1 || p.watchdog_ns <= 0)
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
