// ops/rmsnorm_lmhead.cuh: RMSNORM_LMHEAD: final norm and the output head's logits.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

TILEVOX_MK_OP bool op_lmhead(const Ctx c, const int* inst, float* xs) {
  const Buf x = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_IN_X]), nw = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_IN_NORM_W]), w = get_buf(c, ins_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_IN_W_LM]);
  const Buf logits = get_buf(c, outs_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_OUT_LOGITS]);
  return rmsnorm_matvec(c, inst, xs, x, nw, w, logits, outs_of(inst)[TILEVOX_MK_RMSNORM_LMHEAD_OUT_X_NORMED],
                        TILEVOX_MK_NO_ID);
}
