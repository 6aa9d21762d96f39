// ops/proj_residual.cuh: OPROJ_RESIDUAL and DOWN_RESIDUAL: a projection added to the residual stream.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

// One body for both opcodes: their slots sit at the same positions (named after OPROJ_RESIDUAL's).
static_assert(TILEVOX_MK_OPROJ_RESIDUAL_IN_ATTN_OUT == TILEVOX_MK_DOWN_RESIDUAL_IN_H, "slot mismatch");
static_assert(TILEVOX_MK_OPROJ_RESIDUAL_IN_W_O == TILEVOX_MK_DOWN_RESIDUAL_IN_W_DOWN, "slot mismatch");
static_assert(TILEVOX_MK_OPROJ_RESIDUAL_IN_X_IN == TILEVOX_MK_DOWN_RESIDUAL_IN_X_IN, "slot mismatch");
static_assert(TILEVOX_MK_OPROJ_RESIDUAL_IN_SCALE == TILEVOX_MK_DOWN_RESIDUAL_IN_SCALE, "slot mismatch");
static_assert(TILEVOX_MK_OPROJ_RESIDUAL_OUT_X_OUT == TILEVOX_MK_DOWN_RESIDUAL_OUT_X_OUT, "slot mismatch");

// OPROJ_RESIDUAL and DOWN_RESIDUAL: x_out[b, r] = x_in[b, r] + (a[b] . w[r]) rounded; with a layer scale,
// x_in[b, r] + scale[r] * that, rounded as LayerScale rounds it.
TILEVOX_MK_OP bool op_proj_residual(const Ctx c, const int* inst, float* xs) {
  const Buf a = get_buf(c, ins_of(inst)[TILEVOX_MK_OPROJ_RESIDUAL_IN_ATTN_OUT]), w = get_buf(c, ins_of(inst)[TILEVOX_MK_OPROJ_RESIDUAL_IN_W_O]), x_in = get_buf(c, ins_of(inst)[TILEVOX_MK_OPROJ_RESIDUAL_IN_X_IN]);
  const Buf x_out = get_buf(c, outs_of(inst)[TILEVOX_MK_OPROJ_RESIDUAL_OUT_X_OUT]);
  const int scale_id = ins_of(inst)[TILEVOX_MK_OPROJ_RESIDUAL_IN_SCALE];
  const Buf scale = get_buf(c, scale_id);
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
          float y = rnd(v, x_out.dt);
          if (scale_id >= 0) y = rnd(ld_w(scale, r) * y, x_out.dt);
          st(x_out, o, rnd(ld_act(x_in, o) + y, x_out.dt));
        });
  });
}
