// gemm_pingpong_64x128.cu: bf16 GEMM config 0, Pingpong 64x128x64, cluster 1x1 (small/medium M).
#include "gemm_impl.cuh"

namespace tilevox {
int gemm_pingpong_64x128(const GemmArgs& p, cudaStream_t stream) {
  using G = GemmBf16<cute::Shape<cute::_64, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                     cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
  return G::run(p, stream, "gemm_pingpong_64x128x64_c1x1");
}
}  // namespace tilevox
