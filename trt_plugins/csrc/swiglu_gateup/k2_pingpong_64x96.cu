// k2_pingpong_64x96.cu: Kernel-2 config 3, Pingpong 64x96x64 over the packed 2N (64x48 of h). For decode
// (weight-streaming) shapes the tile width sets the wave count: 2N/96 tiles fill the 132 SMs more evenly
// than 2N/128 for several Qwen2.5 widths (e.g. 7B: 395 tiles = 2.99 waves vs 296 = 2.24 waves).
#include "k2_impl.cuh"

namespace tilevox {
int k2_packed_evt_pingpong_64x96(const SwigluArgs& p, cudaStream_t stream) {
  using K = SwigluPackedEvt<cute::Shape<cute::_64, cute::_96, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                            cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
  return K::run(p, stream, "k2_packed_evt_pingpong_64x96x64_c1x1");
}
}  // namespace tilevox
