// k2_coop_128x256.cu: Kernel-2 config 1, Cooperative 128x256x64 cluster 2x1 over the packed 2N.
#include "k2_impl.cuh"

namespace tilevox {
int k2_packed_evt_coop_128x256(const SwigluArgs& p, cudaStream_t stream) {
  using K = SwigluPackedEvt<cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>,
                            cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                            cutlass::epilogue::TmaWarpSpecializedCooperative>;
  return K::run(p, stream, "k2_packed_evt_coop_128x256x64_c2x1");
}
}  // namespace tilevox
