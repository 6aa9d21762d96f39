// ops/attn_reduce.cuh: ATTN_REDUCE: the partitions' partial outputs combined by their log-sum-exp.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

TILEVOX_MK_OP bool op_attn_reduce(const Ctx c, const int* inst, float* lse_smem) {
  const Buf po = get_buf(c, ins_of(inst)[TILEVOX_MK_ATTN_REDUCE_IN_PART_OUT]), pl = get_buf(c, ins_of(inst)[TILEVOX_MK_ATTN_REDUCE_IN_PART_LSE]);
  const Buf out = get_buf(c, outs_of(inst)[TILEVOX_MK_ATTN_REDUCE_OUT_ATTN_OUT]);
  const int D = c.prm.head_dim, KVH = c.prm.num_kv_heads, G = c.prm.num_heads / KVH, H = c.prm.num_heads;
  const int P = c.prm.num_partitions;
  int r0, r1;  // this tile's batch rows; below, b counts from r0
  if (!row_range(c, inst, TILEVOX_MK_ATTN_REDUCE_ARG_ROW_START, c.prm.batch_size, r0, r1)) return false;
  const int B = r1 - r0;
  // The group's log-sum-exps (b, p, i) go to shared memory once when they fit; every output element
  // then reads P of them.
  const bool lse_staged = B * P * G <= kExtraFloats;
  if (!wait_deps(c, inst)) return false;
  for (int g = inst[TILEVOX_MK_FIELD_TILE_START]; g < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++g) {
    if (lse_staged) {
      for (int idx = threadIdx.x; idx < B * P * G; idx += kThreads) {
        const int b = idx / (P * G), rest = idx - b * P * G;  // rest = p * G + i
        lse_smem[idx] = ld_act(pl, ((int64_t)(r0 + b) * KVH + g) * P * G + rest);
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
              __ldcg(reinterpret_cast<const float4*>(pof + ((((int64_t)(r0 + b) * KVH + g) * P + p) * G + i) * D) + d4);
          acc.x += w * v.x;
          acc.y += w * v.y;
          acc.z += w * v.z;
          acc.w += w * v.w;
        }
        const int64_t o = (int64_t)(r0 + b) * H * D + ((int64_t)g * G + i) * D + 4 * d4;
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
      const int64_t lse_base = ((int64_t)(r0 + b) * KVH + g) * P * G + i;  // + p * G
      auto lse = [&](int p) { return lse_staged ? lse_smem[(b * P + p) * G + i] : ld_act(pl, lse_base + (int64_t)p * G); };
      float peak = -INFINITY;
      for (int p = 0; p < P; ++p) peak = fmaxf(peak, lse(p));
      float num = 0.f, den = 0.f;
#pragma unroll 8
      for (int p = 0; p < P; ++p) {
        const float w = expf(lse(p) - peak);
        num += w * ld_act(po, ((((int64_t)(r0 + b) * KVH + g) * P + p) * G + i) * D + d);
        den += w;
      }
      st(out, (int64_t)(r0 + b) * H * D + ((int64_t)g * G + i) * D + d, num / den);
    }
    __syncthreads();
  }
  return true;
}
