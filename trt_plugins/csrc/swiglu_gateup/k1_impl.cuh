// k1_impl.cuh: Kernel-1, a Pingpong GEMM whose custom collective mainloop computes gate and up
// accumulators for the same output tile and fuses silu(g) * u before a standard TMA epilogue.
//
// DualGateUpMma wraps the stock SM90 TMA/GMMA warp-specialized collective (same smem ring, same
// PipelineTmaAsync, same stage count) and replaces load_init/load/mma:
//  * the producer streams, per output tile, KT stages of (x k-tile, W_gate k-tile) and then KT stages
//    of (x k-tile, W_up k-tile) through one ring (two TMA descriptors for B, both HF (N, K) layout);
//  * the consumer warpgroup accumulates the gate tile (fp32 registers), issues the first up-tile
//    wgmma batch, waits only for the gate batches, and applies Swish to the gate accumulator while
//    that up batch runs and the producer keeps loading up tiles; after the up k-loop it forms
//    h = silu(g) * u in fp32 in the accumulator the kernel hands to the epilogue (one bf16 rounding).
// The Pingpong kernel layer (stock GemmUniversal) overlaps one consumer warpgroup's epilogue with the
// other's MMAs. The kernel sees K' = 2 * ceil(K / BK) * BK so its per-tile k-tile count (2 KT) and
// pipeline-state bookkeeping match the two phases; the real K travels in the mainloop arguments.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "../common/cutlass_runner.cuh"
#include "silu.cuh"

namespace tilevox {

template <class Base>
struct DualGateUpMma : Base {
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  using typename Base::DispatchPolicy;
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  static_assert(cute::size(ClusterShape{}) == 1, "DualGateUpMma supports cluster 1x1 only (no multicast masks)");

  struct Arguments {
    ElementA const* ptr_A;
    StrideA dA;
    ElementB const* ptr_B_gate;
    ElementB const* ptr_B_up;
    StrideB dB;
    int k_real;  // the true K; the problem shape carries K' = 2 * ceil(K / BK) * BK
  };

  struct Params {
    using TMA_A = typename Base::Params::TMA_A;
    using TMA_B = typename Base::Params::TMA_B;
    TMA_A tma_load_a;
    TMA_B tma_load_b;     // gate
    TMA_B tma_load_b_up;  // up
    uint32_t tma_transaction_bytes;  // one stage = one x tile + one weight tile
    int k_real;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    auto problem_shape_MNKL = cute::append<4>(problem_shape, 1);
    auto [M, N, K2, L] = problem_shape_MNKL;
    const int K = args.k_real;
    cute::Tensor tensor_a = cute::make_tensor(args.ptr_A, cute::make_layout(cute::make_shape(M, K, L), args.dA));
    cute::Tensor tensor_bg = cute::make_tensor(args.ptr_B_gate, cute::make_layout(cute::make_shape(N, K, L), args.dB));
    cute::Tensor tensor_bu = cute::make_tensor(args.ptr_B_up, cute::make_layout(cute::make_shape(N, K, L), args.dB));
    auto smem_a = SmemLayoutA{}(cute::_, cute::_, cute::Int<0>{});
    auto smem_b = SmemLayoutB{}(cute::_, cute::_, cute::Int<0>{});
    using GA = typename Base::GmemTiledCopyA;
    using GB = typename Base::GmemTiledCopyB;
    return {cute::make_tma_copy_A_sm90(GA{}, tensor_a, smem_a, TileShape{}, ClusterShape{}),
            cute::make_tma_copy_B_sm90(GB{}, tensor_bg, smem_b, TileShape{}, ClusterShape{}),
            cute::make_tma_copy_B_sm90(GB{}, tensor_bu, smem_b, TileShape{}, ClusterShape{}),
            Base::TmaTransactionBytesMK + Base::TmaTransactionBytesNK, K};
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K2, L] = cute::append<4>(problem_shape, 1);
    constexpr int kBK = cute::size<2>(TileShape{});
    const int kt = (args.k_real + kBK - 1) / kBK;
    return args.k_real > 0 && args.k_real % 8 == 0 && K2 == 2 * kt * kBK && N % 8 == 0 &&
           args.ptr_B_gate != nullptr && args.ptr_B_up != nullptr;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_load_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_load_b.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_load_b_up.get_tma_descriptor());
  }

  // get<0>: x tiled over K' (only its k-tile count, 2 KT, is read by the kernel); get<1>: gate tiles
  // (the kernel reads its n-tile count); get<2>: x over the real K; get<3>: up tiles.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& p) const {
    using X = cute::Underscore;
    auto [M, N, K2, L] = problem_shape_MNKL;
    const int K = p.k_real;
    auto mA2 = p.tma_load_a.get_tma_tensor(cute::make_shape(M, K2, L));
    auto mA = p.tma_load_a.get_tma_tensor(cute::make_shape(M, K, L));
    auto mBg = p.tma_load_b.get_tma_tensor(cute::make_shape(N, K, L));
    auto mBu = p.tma_load_b_up.get_tma_tensor(cute::make_shape(N, K, L));
    auto all = cute::make_coord(cute::_, cute::_, cute::_);
    return cute::make_tuple(cute::local_tile(mA2, TileShape{}, all, cute::Step<cute::_1, X, cute::_1>{}),
                            cute::local_tile(mBg, TileShape{}, all, cute::Step<X, cute::_1, cute::_1>{}),
                            cute::local_tile(mA, TileShape{}, all, cute::Step<cute::_1, X, cute::_1>{}),
                            cute::local_tile(mBu, TileShape{}, all, cute::Step<X, cute::_1, cute::_1>{}));
  }

  template <class LoadInputs, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           LoadInputs const& load_inputs, BlockCoord const& blk_coord, KTileIterator,
                           int k_tile_count, int, uint32_t, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor gA = get<2>(load_inputs)(_, _, m_coord, _, l_coord);   // (BLK_M,BLK_K,k)
    Tensor gBg = get<1>(load_inputs)(_, _, n_coord, _, l_coord);  // (BLK_N,BLK_K,k)
    Tensor gBu = get<3>(load_inputs)(_, _, n_coord, _, l_coord);
    auto tma_a = p.tma_load_a.get_slice(0);
    auto tma_bg = p.tma_load_b.get_slice(0);
    auto tma_bu = p.tma_load_b_up.get_slice(0);
    Tensor tAgA = tma_a.partition_S(gA);
    Tensor tAsA = tma_a.partition_D(sA);
    Tensor tBgBg = tma_bg.partition_S(gBg);
    Tensor tBgBu = tma_bu.partition_S(gBu);
    Tensor tBsB = tma_bg.partition_D(sB);
    const int k_tiles = k_tile_count / 2;
    // Gate phase then up phase through the same ring: the up-tile loads run while the consumer
    // finishes the gate k-loop and applies Swish.
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; t < k_tile_count; ++t) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const bool gate_phase = t < k_tiles;
      const int kk = gate_phase ? t : t - k_tiles;
      copy(p.tma_load_a.with(*tma_barrier, 0), tAgA(_, _, _, kk), tAsA(_, _, _, stage));
      if (gate_phase) {
        copy(p.tma_load_b.with(*tma_barrier, 0), tBgBg(_, _, _, kk), tBsB(_, _, _, stage));
      } else {
        copy(p.tma_load_b_up.with(*tma_barrier, 0), tBgBu(_, _, _, kk), tBsB(_, _, _, stage));
      }
      ++smem_pipe_write;
    }
  }

  // Consumer: k_tile_count = 2 KT. Releases 2 KT - 1 stages; the stock mma_tail releases the last.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<MmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCsA = thread_mma.partition_A(sA);
    Tensor tCsB = thread_mma.partition_B(sB);
    Tensor tCrA = thread_mma.make_fragment_A(tCsA);  // (MMA,MMA_M,MMA_K,PIPE) smem descriptors
    Tensor tCrB = thread_mma.make_fragment_B(tCsB);
    Tensor gate = make_fragment_like(accum);  // fp32 gate accumulator, same layout as the up/h one

    const int k_tiles = k_tile_count / 2;
    PipelineState smem_pipe_release = smem_pipe_read;

    // ---- gate phase ----
    warpgroup_fence_operand(gate);
    {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), gate);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      ++smem_pipe_read;
    }
    warpgroup_fence_operand(gate);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 1; t < k_tiles; ++t) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      warpgroup_fence_operand(gate);
      warpgroup_arrive();
      cute::gemm(tiled_mma, tCrA(_, _, _, stage), tCrB(_, _, _, stage), gate);
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // the previous batch is done: its stage can go back to the producer
      warpgroup_fence_operand(gate);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_read;
      ++smem_pipe_release;
    }

    // ---- up phase, first k-tile: issue it, then run Swish on the finished gate tile under it ----
    warpgroup_fence_operand(accum);
    {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // every gate batch has completed; this up batch is still in flight
      warpgroup_fence_operand(gate);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_read;
      ++smem_pipe_release;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(gate); ++i) {
      gate(i) = silu(gate(i));
    }
    warpgroup_fence_operand(gate);
    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 1; t < k_tiles; ++t) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      cute::gemm(tiled_mma, tCrA(_, _, _, stage), tCrB(_, _, _, stage), accum);
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      warpgroup_fence_operand(accum);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_read;
      ++smem_pipe_release;
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    // h = silu(g) * u in fp32; the epilogue rounds it to bf16 once.
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) {
      accum(i) = gate(i) * accum(i);
    }
    warpgroup_fence_operand(accum);
  }
};

template <class TileShape, class KernelSchedule, class EpilogueSchedule>
struct SwigluDualPingpong {
  using Element = cutlass::bfloat16_t;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlign = 8;
  static constexpr int kBK = cute::size<2>(TileShape{});
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlign,
      Element, cutlass::layout::RowMajor, kAlign, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;
  using StockMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using CollectiveMainloop = DualGateUpMma<StockMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static int run(const SwigluArgs& p, cudaStream_t stream, const char* name) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    const int k_tiles = (p.k + kBK - 1) / kBK;
    StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(p.m, p.k, 1));
    cute::get<0>(stride_a) = p.ldx;
    StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(p.n, p.k, 1));
    StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(p.m, p.n, 1));
    cute::get<0>(stride_d) = p.ldo;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {p.m, p.n, 2 * k_tiles * kBK, 1},
        {static_cast<const Element*>(p.x), stride_a, static_cast<const Element*>(p.w_gate),
         static_cast<const Element*>(p.w_up), stride_b, p.k},
        {{}, nullptr, {}, static_cast<Element*>(p.out), stride_d},
        hw_info_current_device()};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return run_cutlass<Gemm>(args, stream, name);
  }
};

}  // namespace tilevox
