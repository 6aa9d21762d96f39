// gemm_coop_128x256.cu: bf16 GEMM config 1, Cooperative 128x256x64, cluster 2x1 (large M).
#include "gemm_impl.cuh"

namespace tilevox {
int gemm_coop_128x256(const GemmArgs& p, cudaStream_t stream) {
  using G = GemmBf16<cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>,
                     cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                     cutlass::epilogue::TmaWarpSpecializedCooperative>;
  return G::run(p, stream, "gemm_coop_128x256x64_c2x1");
}
}  // namespace tilevox
