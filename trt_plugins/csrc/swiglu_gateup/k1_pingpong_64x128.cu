// k1_pingpong_64x128.cu: Kernel-1 config 0, dual gate/up Pingpong, 64x128x64 output tile per warpgroup.
#include "k1_impl.cuh"

namespace tilevox {
int k1_dual_pingpong_64x128(const SwigluArgs& p, cudaStream_t stream) {
  using K = SwigluDualPingpong<cute::Shape<cute::_64, cute::_128, cute::_64>,
                               cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
  return K::run(p, stream, "k1_dual_pingpong_64x128x64_c1x1");
}
}  // namespace tilevox
