// ops/rmsnorm_gateup_swiglu.cuh: RMSNORM_GATEUP_SWIGLU: norm, gate and up projections, SiLU(gate) x up.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

TILEVOX_MK_OP bool op_gateup(const Ctx c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_GATEUP_SWIGLU_IN_X]), ln = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_GATEUP_SWIGLU_IN_LN_W]), wg = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_GATEUP_SWIGLU_IN_W_GATE]),
            wu = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_GATEUP_SWIGLU_IN_W_UP]);
  const Buf h = get_buf(c, outs_of(inst)[TILEVOX_MK_RMSNORM_GATEUP_SWIGLU_OUT_H]);
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
