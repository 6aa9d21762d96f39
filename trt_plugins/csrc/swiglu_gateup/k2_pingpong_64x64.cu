// k2_pingpong_64x64.cu: Kernel-2 config 4, Pingpong 64x64x64 over the packed 2N (64x32 of h): the most CTAs
// per weight byte, for decode shapes whose 2N/96 and 2N/128 tile counts leave a badly filled last wave.
#include "k2_impl.cuh"

namespace tilevox {
int k2_packed_evt_pingpong_64x64(const SwigluArgs& p, cudaStream_t stream) {
  using K = SwigluPackedEvt<cute::Shape<cute::_64, cute::_64, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                            cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
  return K::run(p, stream, "k2_packed_evt_pingpong_64x64x64_c1x1");
}
}  // namespace tilevox
