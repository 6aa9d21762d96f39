// matvec.cuh: The matrix-vector core: CUDA-core rows, tensor-core (mma.sync) rows, and one staged chunk of batch rows on
// either path; every projection opcode runs through it.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

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
    wa[u] = in && va ? ld_w16(pa + 4 * (kb + u)) : zero;
    wb[u] = in && vb ? ld_w16(pb + 4 * (kb + u)) : zero;
    if (TWO) {
      wa2[u] = in && va ? ld_w16(pa2 + 4 * (kb + u)) : zero;
      wb2[u] = in && vb ? ld_w16(pb2 + 4 * (kb + u)) : zero;
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

template <bool TWO, int F, class Pro, class Epi>
__device__ bool tc_rows(const unsigned short* xs, int nc, int K, const Buf& w, const Buf* w2, int r0, int r1,
                        float* red, Pro& pro, Epi& epi) {
  // k blocks of weight loads in flight per warp (4-8 KiB at batch <= 16, times F); fewer at larger batch,
  // where the MMAs take longer and the accumulators need the registers.
  const auto* a = reinterpret_cast<const unsigned short*>(w.p);
  const auto* b = w2 ? reinterpret_cast<const unsigned short*>(w2->p) : nullptr;
  if (nc <= 8) return tc_rows_nb<1, TWO, F * (TWO ? 4 : 8)>(xs, nc, K, a, b, r0, r1, red, pro, epi);
  if (nc <= 16) return tc_rows_nb<2, TWO, F * (TWO ? 4 : 8)>(xs, nc, K, a, b, r0, r1, red, pro, epi);
  if (nc <= 32) return tc_rows_nb<4, TWO, F * (TWO ? 2 : 4)>(xs, nc, K, a, b, r0, r1, red, pro, epi);
  return tc_rows_nb<8, TWO, F * (TWO ? 2 : 4)>(xs, nc, K, a, b, r0, r1, red, pro, epi);
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
// output. False when pro fails (the block must stop). F: the tensor-core path's in-flight multiplier.
template <bool TWO, int F = TILEVOX_MK_INFLIGHT, class Pro, class Epi>
__device__ bool staged_rows(const Staged& s, const Buf& w, const Buf* w2, int r0, int r1, Pro pro, Epi epi) {
  if (s.tc) return tc_rows<TWO, F>(s.xb, s.nc, s.K, w, w2, r0, r1, s.red, pro, epi);
  if (!pro()) return false;
  rows<TWO>(w.dt, s.xf, s.nc, s.K, w, w2, r0, r1, epi);
  return true;
}
