// k2_pingpong_64x256.cu: Kernel-2 config 2, Pingpong 64x256x64 cluster 2x1 over the packed 2N (64x128 of h);
// the pingpong epilogue (SwiGLU stores) of one warpgroup overlaps the other's MMAs.
#include "k2_impl.cuh"

namespace tilevox {
int k2_packed_evt_pingpong_64x256(const SwigluArgs& p, cudaStream_t stream) {
  using K = SwigluPackedEvt<cute::Shape<cute::_64, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>,
                            cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
  return K::run(p, stream, "k2_packed_evt_pingpong_64x256x64_c2x1");
}
}  // namespace tilevox
