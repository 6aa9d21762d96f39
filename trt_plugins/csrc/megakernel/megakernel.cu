// megakernel.cu: the persistent instruction interpreter of decode regions (see megakernel.h).
//
// One block (256 threads) per queue walks its instruction records in order: wait on counters
// (thread 0, acquire loads + __nanosleep backoff + %globaltimer watchdog), __syncthreads, execute,
// __syncthreads, then thread 0 fences and bumps the signal counter. The opcode bodies follow
// trt_plugins/megakernel/vm.py exactly, including where the VM rounds to the activation dtype.
// Matrix-vector tiles: one warp per output row, batch rows staged in shared memory (fp32) in
// chunks of up to kMaxChunk rows, fp32 accumulation. Activations and state are read with ld.cg
// (L2, never a stale L1 line written by another SM); weights with the read-only path.
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
constexpr int kExtraFloats = 2048;              // 8 KiB: per-head scratch (kMaxChunk x 256)
constexpr int kSmemBytes = (kXsFloats + kExtraFloats) * 4;
constexpr int kMaxDims = 5;

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

__device__ __forceinline__ const int* args_of(const int* inst) { return inst + TILEVOX_MK_FIELD_ARGS; }
__device__ __forceinline__ const int* ins_of(const int* inst) { return inst + TILEVOX_MK_FIELD_INPUTS; }
__device__ __forceinline__ const int* outs_of(const int* inst) { return inst + TILEVOX_MK_FIELD_OUTPUTS; }

// ---------------------------------------------------------------------------------------------
// Opcodes. Each returns false after raising an error (the caller stops the block).

__device__ bool op_embed(const Ctx& c, const int* inst) {
  const Buf tokens = get_buf(c, ins_of(inst)[0]), table = get_buf(c, ins_of(inst)[1]);
  const Buf x = get_buf(c, outs_of(inst)[0]);
  const int64_t width = table.dims[1], vocab = table.dims[0];
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

// Runs body(b0, nc) over the batch rows in chunks whose K-wide rows fit the shared staging buffer,
// with a block barrier after each chunk. False (error raised) when one row does not fit or body fails.
template <class Body>
__device__ bool for_each_row_chunk(const Ctx& c, const int* inst, int B, int K, Body&& body) {
  const int step_rows = chunk_rows(K);
  if (step_rows < 1) {  // a row longer than the staging buffer (kXsFloats)
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
  return for_each_row_chunk(c, inst, B, K, [&](int b0, int nc) {
    stage_rows(xs, x, b0, nc, K, nullptr, 0.f);
    rows<false>(w.dt, xs, nc, K, w, nullptr, inst[TILEVOX_MK_FIELD_TILE_START], inst[TILEVOX_MK_FIELD_TILE_STOP],
                [&](int ci, int r, float v, float) {
                  if (bias_id >= 0) v += ld_w(bias, r);
                  st(y, (int64_t)(b0 + ci) * N + r, v);
                });
    return true;
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
  return for_each_row_chunk(c, inst, B, K, [&](int b0, int nc) {
    stage_rows(xs, x, b0, nc, K, &ln, eps);
    for (int hs = inst[TILEVOX_MK_FIELD_TILE_START]; hs < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++hs) {
      if (hs > G + 1) {
        if (threadIdx.x == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, hs, G + 1);
        return false;
      }
      const Buf& w = hs < G ? wq : (hs == G ? wk : wv);
      const int row0 = hs < G ? (group * G + hs) * D : group * D;
      rows<false>(w.dt, xs, nc, K, w, nullptr, row0, row0 + D,
                  [&](int ci, int r, float v, float) { hb[ci * D + (r - row0)] = rnd(v, x.dt); });
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
      for (int j = 0; j < kPer; ++j) acc[j] = 0.f;
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
        if (vc.dt == BF16) {
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
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int d = lane + 32 * j;
        if (d < D) st(po, out_base + d, acc[j] / l);
      }
      if (lane == 0) st(pl, lse_idx, m + logf(l));
    }
  }
  return true;
}

__device__ bool op_attn_reduce(const Ctx& c, const int* inst) {
  const Buf po = get_buf(c, ins_of(inst)[0]), pl = get_buf(c, ins_of(inst)[1]);
  const Buf out = get_buf(c, outs_of(inst)[0]);
  const int D = c.prm.head_dim, KVH = c.prm.num_kv_heads, G = c.prm.num_heads / KVH, H = c.prm.num_heads;
  const int P = c.prm.num_partitions, B = c.prm.batch_size;
  for (int g = inst[TILEVOX_MK_FIELD_TILE_START]; g < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++g) {
    for (int idx = threadIdx.x; idx < B * G * D; idx += kThreads) {
      const int d = idx % D, i = (idx / D) % G, b = idx / (D * G);
      const int64_t lse_base = ((int64_t)b * KVH + g) * P * G + i;  // + p * G
      float peak = -INFINITY;
      for (int p = 0; p < P; ++p) peak = fmaxf(peak, ld_act(pl, lse_base + (int64_t)p * G));
      float num = 0.f, den = 0.f;
      for (int p = 0; p < P; ++p) {
        const float w = expf(ld_act(pl, lse_base + (int64_t)p * G) - peak);
        num += w * ld_act(po, ((((int64_t)b * KVH + g) * P + p) * G + i) * D + d);
        den += w;
      }
      st(out, (int64_t)b * H * D + ((int64_t)g * G + i) * D + d, num / den);
    }
  }
  return true;
}

// OPROJ_RESIDUAL and DOWN_RESIDUAL: x_out[b, r] = x_in[b, r] + (a[b] . w[r]) rounded.
__device__ bool op_proj_residual(const Ctx& c, const int* inst, float* xs) {
  const Buf a = get_buf(c, ins_of(inst)[0]), w = get_buf(c, ins_of(inst)[1]), x_in = get_buf(c, ins_of(inst)[2]);
  const Buf x_out = get_buf(c, outs_of(inst)[0]);
  const int B = (int)a.dims[0], K = (int)a.dims[1], N = (int)x_out.dims[1];
  return for_each_row_chunk(c, inst, B, K, [&](int b0, int nc) {
    stage_rows(xs, a, b0, nc, K, nullptr, 0.f);
    rows<false>(w.dt, xs, nc, K, w, nullptr, inst[TILEVOX_MK_FIELD_TILE_START], inst[TILEVOX_MK_FIELD_TILE_STOP],
                [&](int ci, int r, float v, float) {
                  const int64_t o = (int64_t)(b0 + ci) * N + r;
                  st(x_out, o, rnd(ld_act(x_in, o) + rnd(v, x_out.dt), x_out.dt));
                });
    return true;
  });
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

__device__ bool op_gateup(const Ctx& c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[0]), ln = get_buf(c, ins_of(inst)[1]), wg = get_buf(c, ins_of(inst)[2]),
            wu = get_buf(c, ins_of(inst)[3]);
  const Buf h = get_buf(c, outs_of(inst)[0]);
  const int B = (int)x.dims[0], K = (int)x.dims[1], N = (int)h.dims[1];
  const int dt = h.dt;
  return for_each_row_chunk(c, inst, B, K, [&](int b0, int nc) {
    stage_rows(xs, x, b0, nc, K, &ln, c.prm.rms_norm_eps);
    rows<true>(wg.dt, xs, nc, K, wg, &wu, inst[TILEVOX_MK_FIELD_TILE_START], inst[TILEVOX_MK_FIELD_TILE_STOP],
               [&](int ci, int r, float g, float u) {
                 st(h, (int64_t)(b0 + ci) * N + r, rnd(silu(rnd(g, dt)), dt) * rnd(u, dt));
               });
    return true;
  });
}

__device__ bool op_lmhead(const Ctx& c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[0]), nw = get_buf(c, ins_of(inst)[1]), w = get_buf(c, ins_of(inst)[2]);
  const Buf logits = get_buf(c, outs_of(inst)[0]);
  const int xn_id = outs_of(inst)[1];
  const Buf xn = get_buf(c, xn_id);
  const int B = (int)x.dims[0], K = (int)x.dims[1], N = (int)logits.dims[1];
  const int r0 = inst[TILEVOX_MK_FIELD_TILE_START];
  return for_each_row_chunk(c, inst, B, K, [&](int b0, int nc) {
    stage_rows(xs, x, b0, nc, K, &nw, c.prm.rms_norm_eps);
    if (r0 == 0 && xn_id >= 0)
      for (int idx = threadIdx.x; idx < nc * K; idx += kThreads) st(xn, (int64_t)b0 * K + idx, xs[idx]);
    rows<false>(w.dt, xs, nc, K, w, nullptr, r0, inst[TILEVOX_MK_FIELD_TILE_STOP],
                [&](int ci, int r, float v, float) { st(logits, (int64_t)(b0 + ci) * N + r, v); });
    return true;
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
  for (int row = inst[TILEVOX_MK_FIELD_TILE_START]; row < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++row) {
    const int64_t base = (int64_t)row * row_len;
    const float temp = ld_act(temperature, row);
    long long token;
    if (temp == 0.0f) {
      // argmax, first index among equal maxima (torch.argmax).
      float best = -INFINITY;
      long long best_i = V;
      for (int v = threadIdx.x; v < V; v += kThreads) {
        const float s = ld_act(logits, base + v);
        if (s > best || best_i == V) {
          best = s;
          best_i = v;
        }
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

__global__ void __launch_bounds__(kThreads, 1) megakernel(tilevox_megakernel_params prm) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* xs = smem;
  float* extra = smem + kXsFloats;
  __shared__ int inst[TILEVOX_MK_INSTRUCTION_WORDS];
  __shared__ int stop;
  Ctx c;
  c.prm = prm;
  c.queue = blockIdx.x;
  const int n = prm.queue_lengths[blockIdx.x];
  for (int pos = 0; pos < n; ++pos) {
    c.pos = pos;
    const int* rec = prm.instructions + ((int64_t)blockIdx.x * prm.max_queue_len + pos) * TILEVOX_MK_INSTRUCTION_WORDS;
    if (threadIdx.x < TILEVOX_MK_INSTRUCTION_WORDS) inst[threadIdx.x] = rec[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
      int s = ld_volatile(prm.error) != 0;
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
      stop = s;
    }
    __syncthreads();
    if (stop) return;
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
        ok = op_attn_reduce(c, inst);
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
    __syncthreads();
    // A fault anywhere (this block's threads or another block) stops the block; `ok` is uniform.
    if (threadIdx.x == 0) stop = !ok || ld_volatile(prm.error) != 0;
    __syncthreads();
    if (stop) return;
    if (threadIdx.x == 0 && signal >= 0) {
      __threadfence();
      atomicAdd(prm.counters + signal, 1);
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
