// ops/rmsnorm_qkv_rope_append.cuh: RMSNORM_QKV_ROPE_APPEND: norm, Q/K/V projections, optional per-head norms, rotary embedding, cache append.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

TILEVOX_MK_OP bool op_qkv(const Ctx c, const int* inst, float* xs, float* hb) {
  const int* in = ins_of(inst);
  const Buf x = get_buf(c, in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_X]), ln = get_buf(c, in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_LN_W]), wq = get_buf(c, in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_W_Q]), wk = get_buf(c, in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_W_K]),
            wv = get_buf(c, in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_W_V]), qkn = get_buf(c, in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_QK_NORM_W]), inv_freq = get_buf(c, in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_INV_FREQ]),
            positions = get_buf(c, in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_POSITIONS]), slots = get_buf(c, in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_SLOTS]);
  const bool has_qkn = in[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_IN_QK_NORM_W] >= 0;
  const Buf qb = get_buf(c, outs_of(inst)[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_OUT_Q_BUF]), kc = get_buf(c, outs_of(inst)[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_OUT_K_CACHE]), vc = get_buf(c, outs_of(inst)[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_OUT_V_CACHE]);
  const int group = args_of(inst)[TILEVOX_MK_RMSNORM_QKV_ROPE_APPEND_ARG_GROUP];
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
      if (!staged_rows<false, TILEVOX_MK_QKV_INFLIGHT>(sx, w, nullptr, row0, row0 + D, pro,
                              [&](int ci, int r, float v, float) { hb[ci * D + (r - row0)] = rnd(v, x.dt); }))
        return false;
      __syncthreads();
      for (int ci = warp; ci < nc; ci += kWarps) {
        const int b = b0 + ci;
        float* h = hb + ci * D;
        const int64_t pos = ld_int(positions, b) + step;
        const int64_t at = cache_pos(c.prm.window, pos), copy = ring_copy(c.prm.window);  // a window's ring: twice
        if (hs <= G) {  // q or k: optional per-head rmsnorm, then rope
          // In place on the head's row; bf16 activations without a dtype switch per element.
          if (x.dt == BF16)
            norm_rope_in_place<BF16>(h, qkn, has_qkn, hs < G ? 0 : 1, inv_freq, pos, D, x.dt, eps);
          else
            norm_rope_in_place(h, qkn, has_qkn, hs < G ? 0 : 1, inv_freq, pos, D, x.dt, eps);
          auto out_at = [&](int j) { return h[lane + 32 * j]; };
          if (hs < G) {
            const int head = group * G + hs;
            for (int j = 0, d = lane; d < D; d += 32, ++j) st(qb, ((int64_t)b * H + head) * D + d, out_at(j));
          } else {
            const int64_t slot = ld_int(slots, b);
            if (slot < 0 || slot >= c_slots || pos < 0 || at + copy >= c_len || group >= c_heads) {
              if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)pos, (int)c_len);
              continue;
            }
            const int64_t base = ((((int64_t)layer * c_slots + slot) * c_heads + group) * c_len + at) * D;
            for (int j = 0, d = lane; d < D; d += 32, ++j) {
              st(kc, base + d, out_at(j));
              if (copy) st(kc, base + copy * D + d, out_at(j));
            }
          }
        } else {  // v: straight into the cache
          const int64_t slot = ld_int(slots, b);
          if (slot < 0 || slot >= c_slots || pos < 0 || at + copy >= c_len || group >= c_heads) {
            if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)pos, (int)c_len);
            continue;
          }
          const int64_t base = ((((int64_t)layer * c_slots + slot) * c_heads + group) * c_len + at) * D;
          for (int d = lane; d < D; d += 32) {
            st(vc, base + d, h[d]);
            if (copy) st(vc, base + copy * D + d, h[d]);
          }
        }
      }
      __syncthreads();
    }
    return true;
  });
}
