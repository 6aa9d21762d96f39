// head_rope.cuh: one attention head's optional per-head rmsnorm and rotary embedding, in the VM's rounding order
// (vm._norm_rope): shared by RMSNORM_QKV_ROPE_APPEND, KV_APPEND and the split-QKV path of ATTN_PARTIAL.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

constexpr int kHeadPer = TILEVOX_MK_MAX_HEAD_DIM / 32;  // a lane's dims of one head: d = lane + 32 j

// Rope's cosine and sine of one angle, out of line: precise sinf / cosf each inline a large argument-reduction slow
// path at every call site.
__device__ __noinline__ void rope_cos_sin(float f, float* cs, float* sn) { sincosf(f, sn, cs); }

// One warp. h: the head's D raw values (already rounded to dt) in shared memory, visible to the whole warp; with
// has_norm they become rmsnorm(h) * norm_w[row] (rows 0 = q, 1 = k), then h[d] the roped head at position pos,
// rounded to dt. Dims d and d + D/2 share one rope angle and each other's values, so the lane that owns d < D/2
// rotates the pair: no exchange between lanes after the norm, one sincos per pair, plain loops. T >= 0: dt is T,
// known at compile time (ld_act_t). Ends with __syncwarp. Measured against the out-of-place form with a dtype
// switch per element that it replaced (H100, outputs bit for bit equal): the Qwen3-TTS QKV tile 15.3 against
// 17.4 us (generic loads, 2026-12-07 morning); with KV_APPEND's and split QKV's typed loads-first, 2026-12-07
// 14:40 UTC (benchmarks/results/megakernel_variants_h100_b49c9b2_typedrope_*.json): the predictor loop 6.84 ->
// 6.49 ms at batch 1, 14.35 -> 14.04 at 32, 9.11 -> 6.99 ms at batch 1 with split QKV; the Llama-1B step 2.60 ->
// 2.47 ms at batch 1, 5.48 / 5.49 at 32.
template <int T = -1>
__device__ __forceinline__ void norm_rope_in_place(float* h, const Buf& norm_w, bool has_norm, int row,
                                                   const Buf& inv_freq, int64_t pos, int D, int dt, float eps) {
  const int lane = threadIdx.x & 31, half = D / 2;
  // The models' tables (bf16 gains, fp32 frequencies) without a dtype switch per element.
  const bool typed_tables = inv_freq.dt == F32 && (!has_norm || norm_w.dt == BF16);
  if (has_norm) {
    float ss = 0.f;
#pragma unroll 1
    for (int d = lane; d < D; d += 32) ss += h[d] * h[d];
    ss = warp_sum(ss);
    const float scale = 1.0f / sqrtf(ss / (float)D + eps);
    const bool round_product = norm_w.dt == dt;  // the product in dt when the gain has the activations' dtype
#pragma unroll 1
    for (int d = lane; d < D; d += 32) {
      const int64_t i = (int64_t)row * D + d;
      const float prod = (typed_tables ? ld_w_t<BF16>(norm_w, i) : ld_w(norm_w, i)) * rnd_t<T>(h[d] * scale, dt);
      h[d] = round_product ? rnd_t<T>(prod, dt) : prod;
    }
    __syncwarp();
  }
#pragma unroll 1
  for (int d = lane; d < half; d += 32) {
    float cs, sn;
    rope_cos_sin((float)pos * (typed_tables ? ld_w_t<F32>(inv_freq, d) : ld_w(inv_freq, d)), &cs, &sn);
    cs = rnd_t<T>(cs, dt);
    sn = rnd_t<T>(sn, dt);
    const float x1 = h[d], x2 = h[d + half];
    h[d] = rnd_t<T>(rnd_t<T>(x1 * cs, dt) + rnd_t<T>(-x2 * sn, dt), dt);
    h[d + half] = rnd_t<T>(rnd_t<T>(x2 * cs, dt) + rnd_t<T>(x1 * sn, dt), dt);
  }
  __syncwarp();
}
