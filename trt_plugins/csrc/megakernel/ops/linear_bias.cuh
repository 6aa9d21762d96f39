// ops/linear_bias.cuh: LINEAR_BIAS: y = x . w^T + bias.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

TILEVOX_MK_OP bool op_linear_bias(const Ctx c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[TILEVOX_MK_LINEAR_BIAS_IN_X]), w = get_buf(c, ins_of(inst)[TILEVOX_MK_LINEAR_BIAS_IN_W]);
  const int bias_id = ins_of(inst)[TILEVOX_MK_LINEAR_BIAS_IN_BIAS];
  const Buf bias = get_buf(c, bias_id);
  const Buf y = get_buf(c, outs_of(inst)[TILEVOX_MK_LINEAR_BIAS_OUT_Y]);
  const int B = (int)x.dims[0], K = (int)x.dims[1], N = (int)y.dims[1];
  const bool tc = tc_eligible(x, w, nullptr, K) && chunk_limit(true, K, kTcMaxBatch) > 0;
  return for_each_row_chunk(c, inst, B, K, chunk_limit(tc, K, kTcMaxBatch), [&](int b0, int nc) {
    const Staged sx = staged_layout(tc, xs, nc, K);
    return staged_rows<false>(
        sx, w, nullptr, inst[TILEVOX_MK_FIELD_TILE_START], inst[TILEVOX_MK_FIELD_TILE_STOP],
        [&] {
          if (b0 == 0 && !wait_deps(c, inst)) return false;
          stage_into(sx, x, b0, nullptr, 0.f);
          return true;
        },
        [&](int ci, int r, float v, float) {
          if (bias_id >= 0) v += ld_w(bias, r);
          st(y, (int64_t)(b0 + ci) * N + r, v);
        });
  });
}
