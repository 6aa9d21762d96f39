// k2_impl.cuh: Kernel-2, one gate||up GEMM over packed weights + a custom Epilogue Visitor Tree node.
//
// The GEMM runs over the packed weight (2N, K) whose rows interleave gate and up (row 2j = gate_j,
// row 2j+1 = up_j; tilevox_swiglu_packing_block() == 1), so every accumulator tile holds matching gate
// and up columns. In the SM90 GMMA accumulator layout each thread owns column pairs (2c, 2c+1), and
// the epilogue's register fragments keep them adjacent, so the root EVT node (SwigluPairStore) takes
// fragment elements (2i, 2i+1) as (gate, up), computes silu(g)*u in fp32 and stores h[m, n/2] as bf16
// with one rounding, predicated on the absolute coordinates. C and D are void: the stock TMA store
// of the full-width tile never runs; only the half-width h is written.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "../common/cutlass_runner.cuh"
#include "silu.cuh"

namespace tilevox {

template <class ElementOut>
struct Sm90SwigluPairStore {
  using ElementAux = ElementOut;  // lets the builder deduce a D element type while D is void

  struct SharedStorage {};
  struct Arguments {
    ElementOut* ptr_out = nullptr;
    int64_t ldo = 0;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_out != nullptr;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90SwigluPairStore() {}
  CUTLASS_HOST_DEVICE Sm90SwigluPairStore(Params const& params, SharedStorage const&) : params(params) {}

  Params const params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(
      cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class CoordTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor&& tC_cD_, int M_, int N_, Params const& params_)
        : tC_cD(cute::forward<CoordTensor>(tC_cD_)), M(M_), N(N_), params(params_) {}

    CoordTensor tC_cD;  // absolute (m, n) of every accumulator element: (CPY,CPY_M,CPY_N,EPI_M,EPI_N)
    int M, N;           // N is the packed width 2 * n_out
    Params const& params;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementOut, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      static_assert(FragmentSize % 2 == 0, "gate/up pairs need an even fragment");
      // Same linear order as the stock aux-store nodes: fragment epi_v covers elements
      // [epi_v * FragmentSize, (epi_v + 1) * FragmentSize) of this subtile's partition.
      auto tC_cD_mn = tC_cD(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize / 2; ++i) {
        auto crd = tC_cD_mn(epi_v * FragmentSize + 2 * i);
        int m = cute::get<0>(crd);
        int n = cute::get<1>(crd);
        if (m < M && n < N) {
          float h = silu_mul(static_cast<float>(frg_input[2 * i]), static_cast<float>(frg_input[2 * i + 1]));
          params.ptr_out[static_cast<int64_t>(m) * params.ldo + (n >> 1)] = static_cast<ElementOut>(h);
        }
      }
      return cutlass::Array<ElementOut, FragmentSize>{};
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    cute::Tensor mCrd = cute::make_identity_tensor(cute::make_shape(M, N));
    cute::Tensor gCrd = cute::local_tile(mCrd, cute::take<0, 2>(args.tile_shape_mnk), cute::make_coord(m, n));
    cute::Tensor tC_cCrd = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        gCrd, args.epi_tile, args.tiled_copy, args.thread_idx);
    return ConsumerStoreCallbacks<decltype(tC_cCrd)>(cute::move(tC_cCrd), static_cast<int>(M), static_cast<int>(N),
                                                     params);
  }
};

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct SwigluPackedEvt {
  using Element = cutlass::bfloat16_t;
  static constexpr int kAlign = 8;
  using EVT = cutlass::epilogue::fusion::Sm90EVT<Sm90SwigluPairStore<Element>,
                                                 cutlass::epilogue::fusion::Sm90AccFetch>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlign, void,
      cutlass::layout::RowMajor, kAlign, EpilogueSchedule, EVT>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(cute::size<1>(TileShape{}) % 2 == 0, "tile N must hold whole gate/up pairs");

  static int run(const SwigluArgs& p, cudaStream_t stream, const char* name) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    const int n2 = 2 * p.n;
    StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(p.m, p.k, 1));
    cute::get<0>(stride_a) = p.ldx;
    StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n2, p.k, 1));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {p.m, n2, p.k, 1},
        {static_cast<const Element*>(p.x), stride_a, static_cast<const Element*>(p.w_packed), stride_b},
        {{}, nullptr, {}, nullptr, {}},
        hw_info_current_device()};
    // EVT arguments nest children first, then the node: {AccFetch args, node args}.
    args.epilogue.thread = {{}, {static_cast<Element*>(p.out), p.ldo}};
    return run_cutlass<Gemm>(args, stream, name);
  }
};

}  // namespace tilevox
