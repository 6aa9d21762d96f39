// gemm_impl.cuh: plain bf16 GEMM D = A @ B^T (fp32 accumulate, one rounding) for the down projection.
//
// Stock CUTLASS SM90 TMA warp-specialized kernel from the collective builders; each .cu file in this
// folder instantiates one (tile, cluster, schedule) config so translation units stay small.
// A is (M, K) row-major with row stride lda; B is the HF Linear weight (N, K), K-contiguous, i.e.
// CUTLASS ColumnMajor B; D is (M, N) row-major with row stride ldd. C is void (beta is never used).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "../common/cutlass_runner.cuh"

namespace tilevox {

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct GemmBf16 {
  using Element = cutlass::bfloat16_t;
  static constexpr int kAlign = 8;  // 16 bytes: the TMA requirement
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlign,
      Element, cutlass::layout::RowMajor, kAlign, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static int run(const GemmArgs& p, cudaStream_t stream, const char* name) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(p.m, p.k, 1));
    cute::get<0>(stride_a) = p.lda;
    StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(p.n, p.k, 1));
    StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(p.m, p.n, 1));
    cute::get<0>(stride_d) = p.ldd;
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {p.m, p.n, p.k, 1},
                                  {static_cast<const Element*>(p.a), stride_a, static_cast<const Element*>(p.b), stride_b},
                                  {{}, nullptr, {}, static_cast<Element*>(p.d), stride_d},
                                  hw_info_current_device()};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return run_cutlass<Gemm>(args, stream, name);
  }
};

}  // namespace tilevox
