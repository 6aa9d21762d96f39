// ops/rmsnorm_linear.cuh: RMSNORM_LINEAR: norm, then one projection (split QKV's raw q, k or v).
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

TILEVOX_MK_OP bool op_rmsnorm_linear(const Ctx c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LINEAR_IN_X]), ln = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LINEAR_IN_LN_W]), w = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LINEAR_IN_W]);
  const Buf y = get_buf(c, outs_of(inst)[TILEVOX_MK_RMSNORM_LINEAR_OUT_Y]);
  const int B = (int)x.dims[0], K = (int)x.dims[1], N = (int)y.dims[1];
  const bool tc = tc_eligible(x, w, &ln, K) && chunk_limit(true, K, kTcMaxBatch) > 0;
  return for_each_row_chunk(c, inst, B, K, chunk_limit(tc, K, kTcMaxBatch), [&](int b0, int nc) {
    const Staged sx = staged_layout(tc, xs, nc, K);
    return staged_rows<false>(
        sx, w, nullptr, inst[TILEVOX_MK_FIELD_TILE_START], inst[TILEVOX_MK_FIELD_TILE_STOP],
        [&] {
          if (b0 == 0 && !wait_deps(c, inst)) return false;
          stage_into(sx, x, b0, &ln, c.prm.rms_norm_eps);
          return true;
        },
        [&](int ci, int r, float v, float) { st(y, (int64_t)(b0 + ci) * N + r, v); });
  });
}
