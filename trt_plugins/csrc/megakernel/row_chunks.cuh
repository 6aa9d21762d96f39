// row_chunks.cuh: Batch rows in chunks that fit the staging buffer, for the projection opcodes.
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
