// k1_pingpong_64x64.cu: Kernel-1 config 1, dual gate/up Pingpong, 64x64x64 tiles (more CTAs for small M*N).
#include "k1_impl.cuh"

namespace tilevox {
int k1_dual_pingpong_64x64(const SwigluArgs& p, cudaStream_t stream) {
  using K = SwigluDualPingpong<cute::Shape<cute::_64, cute::_64, cute::_64>,
                               cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
  return K::run(p, stream, "k1_dual_pingpong_64x64x64_c1x1");
}
}  // namespace tilevox
