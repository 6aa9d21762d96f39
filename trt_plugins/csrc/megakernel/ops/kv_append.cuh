// ops/kv_append.cuh: KV_APPEND: split QKV's newest key (per-head norm, rope) and value into the caches.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

// One warp per (kv group, batch row): the raw key through norm_rope_in_place (qk_norm_w row 1), the raw value as
// it is.
TILEVOX_MK_OP bool op_kv_append(const Ctx c, const int* inst, float* hb) {
  const int* in = ins_of(inst);
  const Buf kr = get_buf(c, in[TILEVOX_MK_KV_APPEND_IN_K_RAW]), vr = get_buf(c, in[TILEVOX_MK_KV_APPEND_IN_V_RAW]),
            qkn = get_buf(c, in[TILEVOX_MK_KV_APPEND_IN_QK_NORM_W]), inv_freq = get_buf(c, in[TILEVOX_MK_KV_APPEND_IN_INV_FREQ]),
            positions = get_buf(c, in[TILEVOX_MK_KV_APPEND_IN_POSITIONS]), slots = get_buf(c, in[TILEVOX_MK_KV_APPEND_IN_SLOTS]);
  const bool has_qkn = in[TILEVOX_MK_KV_APPEND_IN_QK_NORM_W] >= 0;
  const Buf kc = get_buf(c, outs_of(inst)[TILEVOX_MK_KV_APPEND_OUT_K_CACHE]), vc = get_buf(c, outs_of(inst)[TILEVOX_MK_KV_APPEND_OUT_V_CACHE]);
  const int layer = inst[TILEVOX_MK_FIELD_LAYER], step = inst[TILEVOX_MK_FIELD_STEP];
  const int D = c.prm.head_dim, B = c.prm.batch_size;
  const int64_t width = kr.dims[1];  // kv heads x D
  const int64_t c_slots = kc.dims[1], c_heads = kc.dims[2], c_len = kc.dims[3];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int r0, r1;
  if (!row_range(c, inst, TILEVOX_MK_KV_APPEND_ARG_ROW_START, B, r0, r1)) return false;
  if (!wait_deps(c, inst)) return false;
  float* h = hb + warp * TILEVOX_MK_MAX_HEAD_DIM;
  const int g0 = inst[TILEVOX_MK_FIELD_TILE_START], groups = inst[TILEVOX_MK_FIELD_TILE_STOP] - g0;
  // Typed<BF16> when the raw rows and both caches are bf16 (the served models), else each buffer's own dtype. Per
  // item every load is issued before any store (a store may alias a later load, so the compiler keeps their order;
  // H100, 2026-12-07, with the out-of-place rope: 5.0 us per KV_APPEND of the Qwen3-TTS predictor against 11.9).
  auto items = [&](auto typed) {
    constexpr int T = decltype(typed)::value;
    for (int item = warp; item < groups * (r1 - r0); item += kWarps) {
      const int g = g0 + item / (r1 - r0), b = r0 + item % (r1 - r0);
      const int64_t pos = ld_int(positions, b) + step, slot = ld_int(slots, b);
      const int64_t at = cache_pos(c.prm.window, pos), copy = ring_copy(c.prm.window);  // a window's ring: twice
      if (slot < 0 || slot >= c_slots || pos < 0 || at + copy >= c_len || g >= c_heads ||
          (int64_t)(g + 1) * D > width) {
        if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)pos, (int)c_len);
        continue;
      }
      const int64_t src = (int64_t)b * width + (int64_t)g * D;
      const int64_t base = ((((int64_t)layer * c_slots + slot) * c_heads + g) * c_len + at) * D;
      float kv[kHeadPer], vv[kHeadPer];
#pragma unroll
      for (int j = 0; j < kHeadPer; ++j) {
        const int d = lane + 32 * j;
        vv[j] = d < D ? ld_act_t<T>(vr, src + d) : 0.f;
        kv[j] = d < D ? ld_act_t<T>(kr, src + d) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kHeadPer; ++j) {
        const int d = lane + 32 * j;
        if (d < D) {
          st_t<T>(vc, base + d, vv[j]);
          if (copy) st_t<T>(vc, base + copy * D + d, vv[j]);
          h[d] = kv[j];
        }
      }
      __syncwarp();
      norm_rope_in_place<T>(h, qkn, has_qkn, 1, inv_freq, pos, D, kr.dt, c.prm.rms_norm_eps);
#pragma unroll 1
      for (int d = lane; d < D; d += 32) {
        st_t<T>(kc, base + d, h[d]);
        if (copy) st_t<T>(kc, base + copy * D + d, h[d]);
      }
      __syncwarp();
    }
  };
  if (kr.dt == BF16 && vr.dt == BF16 && kc.dt == BF16 && vc.dt == BF16)
    items(Typed<BF16>{});
  else
    items(Typed<-1>{});
  return true;
}
