// ops/rmsnorm_linear.cuh: RMSNORM_LINEAR: norm, then one projection with an optional bias (split QKV's raw q, k
// or v; a codec transformer's output projection).
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

TILEVOX_MK_OP bool op_rmsnorm_linear(const Ctx c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LINEAR_IN_X]), ln = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LINEAR_IN_LN_W]), w = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LINEAR_IN_W]);
  const Buf y = get_buf(c, outs_of(inst)[TILEVOX_MK_RMSNORM_LINEAR_OUT_Y]);
  return rmsnorm_matvec(c, inst, xs, x, ln, w, y, TILEVOX_MK_NO_ID, ins_of(inst)[TILEVOX_MK_RMSNORM_LINEAR_IN_BIAS]);
}
