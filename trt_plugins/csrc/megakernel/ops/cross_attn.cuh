// ops/cross_attn.cuh: CROSS_ATTN: attention of one kv group over per-row encoder keys/values (masked by text length).
// Included by megakernel.cu inside its anonymous namespace (one translation unit), after ops/attn_partial.cuh
// (it reuses dot_q_key); not a standalone header.
#pragma once

// The cross caches hold what NhDecoderCache stores, read in place: (layers, slots, kv heads, text, D),
// written once per stream before any launch. q and attn_out are (B, heads * D) activations. Head count
// and head_dim come from the buffers (they may differ from the self-attention's region constants).
// One warp per (row of the tile, query head of the group): the row's keys 32 at a time, one key per
// lane for the scores, online softmax in fp32, then the 32 weighted value rows accumulated with lanes
// over head dims; keys past text_lengths[b] are never read. Same math as vm.py's _cross_attn.
TILEVOX_MK_OP bool op_cross_attn(const Ctx c, const int* inst, float* q_smem) {
  const int* in = ins_of(inst);
  const Buf qb = get_buf(c, in[TILEVOX_MK_CROSS_ATTN_IN_Q]), kc = get_buf(c, in[TILEVOX_MK_CROSS_ATTN_IN_K_CACHE]),
            vc = get_buf(c, in[TILEVOX_MK_CROSS_ATTN_IN_V_CACHE]),
            lengths = get_buf(c, in[TILEVOX_MK_CROSS_ATTN_IN_TEXT_LENGTHS]),
            slots = get_buf(c, in[TILEVOX_MK_CROSS_ATTN_IN_SLOTS]);
  const Buf out = get_buf(c, outs_of(inst)[TILEVOX_MK_CROSS_ATTN_OUT_ATTN_OUT]);
  const int group = args_of(inst)[TILEVOX_MK_CROSS_ATTN_ARG_GROUP];
  const int layer = inst[TILEVOX_MK_FIELD_LAYER];
  const int64_t c_slots = kc.dims[1], c_heads = kc.dims[2], c_len = kc.dims[3];
  const int D = (int)kc.dims[4];
  const int64_t q_width = qb.dims[1];
  const int H = D > 0 ? (int)(q_width / D) : 0;
  // Block-uniform shape checks (from the buffer table): stop this block with an error.
  if (kc.ndim != 5 || vc.ndim != 5 || c_heads < 1 || D < 1 || D > TILEVOX_MK_MAX_HEAD_DIM ||
      (int64_t)H * D != q_width || H % c_heads || group < 0 || group >= c_heads || out.dims[1] != q_width || vc.dims[4] != D ||
      vc.dims[3] != c_len || vc.dims[2] != c_heads || vc.dims[1] != c_slots) {
    if (threadIdx.x == 0) raise_error(c, TILEVOX_MK_ERROR_UNSUPPORTED, inst[0], -1, D, (int)q_width);
    return false;
  }
  const int G = H / (int)c_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = c.prm.attn_scale;
  float* q = q_smem + warp * TILEVOX_MK_MAX_HEAD_DIM;
  constexpr int kPer = TILEVOX_MK_MAX_HEAD_DIM / 32;
  if (!wait_deps(c, inst)) return false;
  const int r0 = inst[TILEVOX_MK_FIELD_TILE_START], r1 = inst[TILEVOX_MK_FIELD_TILE_STOP];
  const int items = (r1 - r0) * G;
  for (int item = warp; item < items; item += kWarps) {
    const int b = r0 + item / G, i = item % G;
    const int64_t length = ld_int(lengths, b), slot = ld_int(slots, b);
    if (length < 1 || length > c_len || slot < 0 || slot >= c_slots) {
      if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)length, (int)c_len);
      continue;
    }
    const int head = group * G + i;
    const int64_t q_base = (int64_t)b * q_width + (int64_t)head * D;
    __syncwarp();
    for (int d = lane; d < D; d += 32) q[d] = ld_act(qb, q_base + d);
    __syncwarp();
    float acc[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[j] = 0.f;
    const int64_t cache_base = (((int64_t)layer * c_slots + slot) * c_heads + group) * c_len * D;
    float m = -INFINITY, l = 0.f;
    for (int64_t t0 = 0; t0 < length; t0 += 32) {
      const int64_t t = t0 + lane;
      const bool valid = t < length;
      const float s = valid ? dot_q_key(q, kc, cache_base + t * D, D) * scale : -INFINITY;
      const float m_new = fmaxf(m, warp_max(s));  // finite: key t0 is valid
      const float corr = expf(m - m_new);
      const float e = valid ? expf(s - m_new) : 0.f;
      l = l * corr + warp_sum(e);
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[j] *= corr;
      const int nk = (int)min((int64_t)32, length - t0);
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
      m = m_new;
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int d = lane + 32 * j;
      if (d < D) st(out, q_base + d, acc[j] / l);
    }
  }
  return true;
}
