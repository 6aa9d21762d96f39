// gemm_pingpong_64x256.cu: bf16 GEMM config 2, Pingpong 64x256x64, cluster 2x1.
#include "gemm_impl.cuh"

namespace tilevox {
int gemm_pingpong_64x256(const GemmArgs& p, cudaStream_t stream) {
  using G = GemmBf16<cute::Shape<cute::_64, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>,
                     cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
  return G::run(p, stream, "gemm_pingpong_64x256x64_c2x1");
}
}  // namespace tilevox
