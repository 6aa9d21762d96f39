// cutlass_runner.cuh: runs one CUTLASS 3.x GemmUniversalAdapter instantiation on a stream.
//
// Shared by every kernel translation unit: can_implement, a zero-workspace check (the launchers take
// no workspace, so a config that needs one is rejected rather than run with a dangling pointer),
// initialize and run, each failure mapped to a TILEVOX_* status with a message.
#pragma once

#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "tilevox_common.h"

namespace tilevox {

template <class Gemm>
int run_cutlass(typename Gemm::Arguments const& arguments, cudaStream_t stream, const char* name) {
  Gemm gemm;
  cutlass::Status status = Gemm::can_implement(arguments);
  if (status != cutlass::Status::kSuccess) {
    return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE,
                std::string(name) + ": CUTLASS can_implement refused the problem (" +
                    cutlassGetStatusString(status) + ")");
  }
  if (Gemm::get_workspace_size(arguments) != 0) {
    return fail(TILEVOX_ERR_CUTLASS, std::string(name) + ": config needs a workspace, which the ABI has none of");
  }
  status = gemm.initialize(arguments, nullptr, stream);
  if (status != cutlass::Status::kSuccess) {
    return fail(TILEVOX_ERR_CUTLASS, std::string(name) + ": initialize failed (" + cutlassGetStatusString(status) + ")");
  }
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    cudaError_t err = cudaGetLastError();
    return fail(TILEVOX_ERR_CUDA, std::string(name) + ": run failed (" + cutlassGetStatusString(status) + ", " +
                                      cudaGetErrorString(err) + ")");
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return fail(TILEVOX_ERR_CUDA, std::string(name) + ": launch failed: " + cudaGetErrorString(err));
  }
  return TILEVOX_OK;
}

inline cutlass::KernelHardwareInfo hw_info_current_device() {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count_current_device();
  return hw;
}

}  // namespace tilevox
