// k2_pingpong_64x128.cu: Kernel-2 config 0, Pingpong 64x128x64 over the packed 2N (64x64 of h).
#include "k2_impl.cuh"

namespace tilevox {
int k2_packed_evt_pingpong_64x128(const SwigluArgs& p, cudaStream_t stream) {
  using K = SwigluPackedEvt<cute::Shape<cute::_64, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                            cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
  return K::run(p, stream, "k2_packed_evt_pingpong_64x128x64_c1x1");
}
}  // namespace tilevox
