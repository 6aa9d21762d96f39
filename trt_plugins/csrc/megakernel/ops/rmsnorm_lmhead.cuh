// ops/rmsnorm_lmhead.cuh: RMSNORM_LMHEAD: final norm and the output head's logits.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

TILEVOX_MK_OP bool op_lmhead(const Ctx c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_IN_X]), nw = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_IN_NORM_W]), w = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_IN_W_LM]);
  const Buf logits = get_buf(c, outs_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_OUT_LOGITS]);
  const int xn_id = outs_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_OUT_X_NORMED];
  const Buf xn = get_buf(c, xn_id);
  const int B = (int)x.dims[0], K = (int)x.dims[1], N = (int)logits.dims[1];
  const int r0 = inst[TILEVOX_MK_FIELD_TILE_START];
  const bool tc = tc_eligible(x, w, &nw, K) && chunk_limit(true, K, kTcMaxBatch) > 0;
  return for_each_row_chunk(c, inst, B, K, chunk_limit(tc, K, kTcMaxBatch), [&](int b0, int nc) {
    const Staged sx = staged_layout(tc, xs, nc, K);
    return staged_rows<false>(
        sx, w, nullptr, r0, inst[TILEVOX_MK_FIELD_TILE_STOP],
        [&] {
          if (b0 == 0 && !wait_deps(c, inst)) return false;
          stage_into(sx, x, b0, &nw, c.prm.rms_norm_eps);
          if (r0 == 0 && xn_id >= 0)
            for (int idx = threadIdx.x; idx < nc * K; idx += kThreads)
              st(xn, (int64_t)b0 * K + idx, sx.at(idx / K, idx % K));
          return true;
        },
        [&](int ci, int r, float v, float) { st(logits, (int64_t)(b0 + ci) * N + r, v); });
  });
}
