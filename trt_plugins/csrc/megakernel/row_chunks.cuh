// row_chunks.cuh: Batch rows in chunks that fit the staging buffer, for the projection opcodes, and the norm +
// matrix-vector body two of them share.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

// Runs body(b0, nc) over the batch rows in chunks of at most step_rows (chunk_limit), with a block
// barrier after each chunk. False (error raised) when not one row fits or body fails.
template <class Body>
__device__ bool for_each_row_chunk(const Ctx& c, const int* inst, int B, int K, int step_rows, Body&& body) {
  if (step_rows < 1) {  // a row longer than the staging buffer
    if (threadIdx.x == 0) raise_error(c, TILEVOX_MK_ERROR_UNSUPPORTED, inst[0], -1, K, kXsFloats);
    return false;
  }
  for (int b0 = 0; b0 < B; b0 += step_rows) {
    if (!body(b0, min(step_rows, B - b0))) return false;
    __syncthreads();
  }
  return true;
}

// y[b, r] = (rmsnorm(x) * ln_w) . w[r] for the instruction's tile rows r; with xn_id >= 0 the tile starting at row 0
// also writes the normed rows there. The body of RMSNORM_LMHEAD and RMSNORM_LINEAR.
__device__ __forceinline__ bool rmsnorm_matvec(const Ctx& c, const int* inst, float* xs, const Buf& x, const Buf& ln,
                                               const Buf& w, const Buf& y, int xn_id, int bias_id) {
  const Buf xn = get_buf(c, xn_id), bias = get_buf(c, bias_id);
  const int B = (int)x.dims[0], K = (int)x.dims[1], N = (int)y.dims[1];
  const int r0 = inst[TILEVOX_MK_FIELD_TILE_START];
  const bool tc = tc_eligible(x, w, &ln, K) && chunk_limit(true, K, kTcMaxBatch) > 0;
  return for_each_row_chunk(c, inst, B, K, chunk_limit(tc, K, kTcMaxBatch), [&](int b0, int nc) {
    const Staged sx = staged_layout(tc, xs, nc, K);
    return staged_rows<false>(
        sx, w, nullptr, r0, inst[TILEVOX_MK_FIELD_TILE_STOP],
        [&] {
          if (b0 == 0 && !wait_deps(c, inst)) return false;
          stage_into(sx, x, b0, &ln, c.prm.rms_norm_eps);
          if (r0 == 0 && xn_id >= 0)
            for (int idx = threadIdx.x; idx < nc * K; idx += kThreads)
              st(xn, (int64_t)b0 * K + idx, sx.at(idx / K, idx % K));
          return true;
        },
        [&](int ci, int r, float v, float) {
          if (bias_id >= 0) v += ld_w(bias, r);
          st(y, (int64_t)(b0 + ci) * N + r, v);
        });
  });
}
