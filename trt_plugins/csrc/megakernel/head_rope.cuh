// head_rope.cuh: one attention head's optional per-head rmsnorm and rotary embedding, in the VM's rounding order
// (vm._norm_rope): shared by RMSNORM_QKV_ROPE_APPEND, KV_APPEND and the split-QKV path of ATTN_PARTIAL.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

// One warp. h: the head's D raw values (already rounded to dt) in shared memory, visible to the whole warp; with
// has_norm they are replaced by rmsnorm(h) * norm_w[row] (norm_w rows 0 = q, 1 = k). out[j] receives dim
// d = lane + 32 j of the roped head at position pos, rounded to dt. Ends with __syncwarp; h may be reused after.
__device__ __forceinline__ void norm_rope_head(float* h, const Buf& norm_w, bool has_norm, int row, const Buf& inv_freq,
                                               int64_t pos, int D, int dt, float eps,
                                               float (&out)[TILEVOX_MK_MAX_HEAD_DIM / 32]) {
  const int lane = threadIdx.x & 31;
  if (has_norm) {
    float ss = 0.f;
    for (int d = lane; d < D; d += 32) ss += h[d] * h[d];
    ss = warp_sum(ss);
    const float scale = 1.0f / sqrtf(ss / (float)D + eps);
    const int prod_dt = norm_w.dt == dt ? dt : F32;
    float tmp[TILEVOX_MK_MAX_HEAD_DIM / 32];
    for (int j = 0, d = lane; d < D; d += 32, ++j)
      tmp[j] = rnd(ld_w(norm_w, (int64_t)row * D + d) * rnd(h[d] * scale, dt), prod_dt);
    __syncwarp();
    for (int j = 0, d = lane; d < D; d += 32, ++j) h[d] = tmp[j];
    __syncwarp();
  }
  const int half = D / 2;
  for (int j = 0, d = lane; d < D; d += 32, ++j) {
    const float f = (float)pos * ld_w(inv_freq, d % half);
    const float cs = rnd(cosf(f), dt), sn = rnd(sinf(f), dt);
    const float rot = d < half ? -h[d + half] : h[d - half];
    out[j] = rnd(rnd(h[d] * cs, dt) + rnd(rot * sn, dt), dt);
  }
  __syncwarp();
}
