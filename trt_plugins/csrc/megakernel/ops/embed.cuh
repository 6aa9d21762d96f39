// ops/embed.cuh: EMBED: token ids -> rows of the embedding table.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

TILEVOX_MK_OP bool op_embed(const Ctx c, const int* inst) {
  const Buf tokens = get_buf(c, ins_of(inst)[TILEVOX_MK_EMBED_IN_TOKENS]), table = get_buf(c, ins_of(inst)[TILEVOX_MK_EMBED_IN_TABLE]);
  const Buf x = get_buf(c, outs_of(inst)[TILEVOX_MK_EMBED_OUT_X]);
  const int64_t width = table.dims[1], vocab = table.dims[0];
  if (!wait_deps(c, inst)) return false;
  for (int b = inst[TILEVOX_MK_FIELD_TILE_START]; b < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++b) {
    const int64_t tok = ld_int(tokens, b);
    if (tok < 0 || tok >= vocab) {
      if (threadIdx.x == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)tok, (int)vocab);
      return false;
    }
    for (int64_t k = threadIdx.x; k < width; k += kThreads) st(x, b * width + k, ld_w(table, tok * width + k));
  }
  return true;
}
