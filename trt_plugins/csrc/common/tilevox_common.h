// tilevox_common.h: internal helpers shared by every translation unit of libtilevox_kernels.so.
//
// Holds the thread-local error slot behind tilevox_last_error(), argument validation that turns
// unsupported shapes into messages (never a wrong result), and the internal per-config entry points
// that the C ABI dispatcher (common/api.cu) calls. Nothing here includes CUTLASS, so api.cu
// compiles in seconds; the heavy CUTLASS instantiations live one per translation unit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../tilevox_kernels.h"

namespace tilevox {

// Records msg as this thread's last error and returns code (so callers can `return fail(...)`).
int fail(int code, const std::string& msg);
void clear_error();

// Multiprocessor count of the current device, cached per device id; -1 on a CUDA error.
int sm_count_current_device();

// Internal launch arguments after validation (all sizes fit in int32 where CUTLASS needs them).
struct SwigluArgs {
  const void* x;
  const void* w_gate;
  const void* w_up;
  const void* w_packed;
  void* out;
  int m, n, k;
  int64_t ldx, ldo;
};

struct GemmArgs {
  const void* a;
  const void* b;
  void* d;
  int m, n, k;
  int64_t lda, ldd;
};

// One function per compiled configuration (defined in its own .cu file). Each returns a TILEVOX_*
// status and sets the error message on failure.
int k1_dual_pingpong_64x128(const SwigluArgs&, cudaStream_t);
int k1_dual_pingpong_64x64(const SwigluArgs&, cudaStream_t);
int k2_packed_evt_pingpong_64x128(const SwigluArgs&, cudaStream_t);
int k2_packed_evt_coop_128x256(const SwigluArgs&, cudaStream_t);
int k2_packed_evt_pingpong_64x256(const SwigluArgs&, cudaStream_t);
int k2_packed_evt_pingpong_64x96(const SwigluArgs&, cudaStream_t);
int k2_packed_evt_pingpong_64x64(const SwigluArgs&, cudaStream_t);
int gemm_pingpong_64x128(const GemmArgs&, cudaStream_t);
int gemm_coop_128x256(const GemmArgs&, cudaStream_t);
int gemm_pingpong_64x256(const GemmArgs&, cudaStream_t);

}  // namespace tilevox
