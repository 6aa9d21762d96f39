"""Tests of trt_plugins.ops.swiglu: references vs float64, weight packing, the torch.library ops (CPU, fake, CUDA).

CPU tests run in CI; `gpu` tests need an SM90 GPU and libtilevox_kernels.so ($TILEVOX_KERNELS_LIB or the
default build folder) and compare the CUDA kernels with the references on fresh random inputs.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tilevox.trt_plugins.library import KernelLibraryNotFoundError, kernels_library, kernels_library_path
from tilevox.trt_plugins.ops import (
    GateUpLayout,
    SwigluKernel,
    SwigluMLP,
    TileRule,
    TileTable,
    gate_up_from_packed,
    gemm_ref,
    layout_for_device,
    pack_gate_up,
    swiglu_gateup,
    swiglu_gateup_ref,
    swiglu_mlp,
    swiglu_mlp_ref,
    unpack_gate_up,
)

BF16_RTOL = 2.0**-8  # one bf16 unit roundoff: the bound for a single final rounding
LAYOUTS = [
    GateUpLayout(kernel=SwigluKernel.DUAL_PINGPONG, block=0),
    GateUpLayout(kernel=SwigluKernel.PACKED_EVT, block=1),
    GateUpLayout(kernel=SwigluKernel.PACKED_EVT, block=8),
]
# (M, N, K): token counts and sizes that are not powers of two or tile multiples
SHAPES = [(1, 8, 16), (7, 24, 40), (37, 200, 96), (199, 56, 72)]


def _inputs(m: int, n: int, k: int, dtype=torch.bfloat16, *, hidden: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_gate = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    w_up = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    w_down = (torch.randn(hidden or k, n, generator=g) / n**0.5).to(dtype)
    return x, w_gate, w_up, w_down


def _gateup_f64(x, w_gate, w_up):
    g = x.double() @ w_gate.double().t()
    return g * torch.sigmoid(g) * (x.double() @ w_up.double().t())


def _assert_within(actual: torch.Tensor, expected64: torch.Tensor, scale: float, rtol: float) -> None:
    # atol floor ~ fp32 accumulation error of a K-long dot product (cancellation makes pure rtol meaningless)
    err = (actual.double() - expected64).abs()
    bound = rtol * expected64.abs() + 1e-5 * scale
    worst = (err - bound).max().item()
    assert worst <= 0, f"max excess over bound {worst:.3g} (max err {err.max().item():.3g})"


# ---------------------------------------------------------------------------------------------------------------
# references


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_gateup_ref_matches_float64(m, n, k, dtype):
    x, w_gate, w_up, _ = _inputs(m, n, k, dtype, seed=m * 1000 + n)
    out = swiglu_gateup_ref(x, w_gate, w_up)
    assert out.dtype == dtype and out.shape == (m, n)
    rtol = BF16_RTOL if dtype == torch.bfloat16 else 1e-5
    _assert_within(out, _gateup_f64(x, w_gate, w_up), scale=1.0, rtol=rtol)


def test_swiglu_gateup_ref_single_rounding_is_tighter_than_eager():
    # The reference rounds once; eager bf16 (g, u, silu rounded separately) must be visibly worse.
    x, w_gate, w_up, _ = _inputs(128, 256, 512, seed=3)
    exact = _gateup_f64(x, w_gate, w_up)
    ref_err = ((swiglu_gateup_ref(x, w_gate, w_up).double() - exact).abs() / exact.abs().clamp_min(1e-3)).mean()
    eager = torch.nn.functional.silu(x @ w_gate.t()) * (x @ w_up.t())
    eager_err = ((eager.double() - exact).abs() / exact.abs().clamp_min(1e-3)).mean()
    assert ref_err < 0.7 * eager_err, (ref_err.item(), eager_err.item())


def test_swiglu_gateup_ref_extreme_gate_is_finite():
    x, w_gate, w_up, _ = _inputs(5, 16, 32, torch.float32, seed=4)
    out = swiglu_gateup_ref(x * 1e3, w_gate * 1e2, w_up)  # |g| >> 88: exp(-g) overflows in a naive silu
    assert torch.isfinite(out).all()
    g = (x * 1e3) @ (w_gate * 1e2).t()
    assert (out[g < -200] == 0).all()


@pytest.mark.parametrize("m,n,k", SHAPES[:3])
def test_swiglu_mlp_ref_is_composition_and_down_matches_float64(m, n, k):
    x, w_gate, w_up, w_down = _inputs(m, n, k, hidden=k + 8, seed=5)
    h = swiglu_gateup_ref(x, w_gate, w_up)
    out = swiglu_mlp_ref(x, w_gate, w_up, w_down)
    assert torch.equal(out, gemm_ref(h, w_down))
    _assert_within(out, h.double() @ w_down.double().t(), scale=1.0, rtol=BF16_RTOL)


# ---------------------------------------------------------------------------------------------------------------
# weight layout


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"k{int(lay.kernel)}b{lay.block}")
def test_pack_unpack_round_trip_and_layout(layout):
    _, w_gate, w_up, _ = _inputs(1, 48, 24, seed=6)
    packed = pack_gate_up(w_gate, w_up, kernel=layout.kernel, block=layout.block)
    assert packed.shape == (96, 24) and packed.is_contiguous()
    gate, up = unpack_gate_up(packed, kernel=layout.kernel, block=layout.block)
    assert torch.equal(gate, w_gate) and torch.equal(up, w_up)
    if layout.kernel is SwigluKernel.DUAL_PINGPONG:
        assert torch.equal(packed[:48], w_gate) and torch.equal(packed[48:], w_up)
    else:  # the header's rule: block q = gate rows qB..qB+B-1, then up rows qB..qB+B-1
        b = layout.block
        for q in range(48 // b):
            assert torch.equal(packed[2 * q * b : 2 * q * b + b], w_gate[q * b : q * b + b])
            assert torch.equal(packed[2 * q * b + b : 2 * q * b + 2 * b], w_up[q * b : q * b + b])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"k{int(lay.kernel)}b{lay.block}")
def test_packed_gemm_plus_pairwise_activation_equals_reference(layout):
    x, w_gate, w_up, _ = _inputs(37, 64, 40, seed=7)
    packed = pack_gate_up(w_gate, w_up, kernel=layout.kernel, block=layout.block)
    y = x.float() @ packed.float().t()  # (M, 2N): what Kernel-2's single GEMM accumulates
    gate, up = gate_up_from_packed(y, layout)
    fused = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    ref = swiglu_gateup_ref(x, w_gate, w_up)
    # same products, possibly another fp32 summation order: at most one bf16 ulp apart
    torch.testing.assert_close(fused, ref, rtol=BF16_RTOL, atol=1e-5)


def test_layout_validation_messages():
    _, w_gate, w_up, _ = _inputs(1, 24, 16, seed=8)
    with pytest.raises(ValueError, match="multiple of the packing block 16"):
        pack_gate_up(w_gate, w_up, kernel=SwigluKernel.PACKED_EVT, block=16)
    with pytest.raises(ValueError, match="block must be 0"):
        GateUpLayout(kernel=SwigluKernel.DUAL_PINGPONG, block=8)
    with pytest.raises(ValueError, match="block >= 1"):
        GateUpLayout(kernel=SwigluKernel.PACKED_EVT, block=0)
    with pytest.raises(ValueError, match="must both be"):
        pack_gate_up(w_gate, w_up[:8], kernel=SwigluKernel.DUAL_PINGPONG, block=0)
    assert layout_for_device("cpu", 24, 16) == GateUpLayout(kernel=SwigluKernel.DUAL_PINGPONG, block=0)


# ---------------------------------------------------------------------------------------------------------------
# torch.library ops on CPU, fake tensors and export


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"k{int(lay.kernel)}b{lay.block}")
@pytest.mark.parametrize("m,n,k", SHAPES[:3])
def test_ops_cpu_equal_references(layout, m, n, k):
    x, w_gate, w_up, w_down = _inputs(m, n, k, hidden=24, seed=9)
    packed = pack_gate_up(w_gate, w_up, kernel=layout.kernel, block=layout.block)
    x3 = x.reshape(1, m, k)  # leading dims are flattened into M
    assert torch.equal(swiglu_gateup(x3, packed, layout=layout), swiglu_gateup_ref(x3, w_gate, w_up))
    assert torch.equal(swiglu_mlp(x3, packed, w_down, layout=layout), swiglu_mlp_ref(x3, w_gate, w_up, w_down))


@pytest.mark.parametrize("layout", LAYOUTS[::2], ids=lambda lay: f"k{int(lay.kernel)}b{lay.block}")
def test_opcheck_cpu(layout):
    x, w_gate, w_up, w_down = _inputs(7, 24, 40, hidden=16, seed=10)
    packed = pack_gate_up(w_gate, w_up, kernel=layout.kernel, block=layout.block)
    kernel, block = int(layout.kernel), layout.block
    torch.library.opcheck(torch.ops.tilevox.swiglu_gateup.default, (x.reshape(1, 7, 40), packed, kernel, block, -1))
    torch.library.opcheck(torch.ops.tilevox.swiglu_mlp.default, (x, packed, w_down, kernel, block, -1, -1))


def test_fake_tensor_shapes_and_validation():
    layout = LAYOUTS[2]
    with FakeTensorMode():
        x = torch.empty(2, 9, 40, dtype=torch.bfloat16)
        packed = torch.empty(48, 40, dtype=torch.bfloat16)
        w_down = torch.empty(40, 24, dtype=torch.bfloat16)
        assert swiglu_gateup(x, packed, layout=layout).shape == (2, 9, 24)
        assert swiglu_mlp(x, packed, w_down, layout=layout).shape == (2, 9, 40)
        with pytest.raises(ValueError, match="must end in K"):
            swiglu_gateup(torch.empty(2, 9, 32, dtype=torch.bfloat16), packed, layout=layout)
        with pytest.raises(ValueError, match="w_down must be"):
            swiglu_mlp(x, packed, torch.empty(40, 16, dtype=torch.bfloat16), layout=layout)


def test_export_traces_with_dynamic_tokens():
    x, w_gate, w_up, w_down = _inputs(9, 24, 40, hidden=40, seed=11)
    module = SwigluMLP(w_gate, w_up, w_down, layout=LAYOUTS[2])
    tokens = torch.export.Dim("tokens", min=2, max=4096)
    program = torch.export.export(module, (x.reshape(1, 9, 40),), dynamic_shapes=({1: tokens},))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert torch.ops.tilevox.swiglu_mlp.default in targets
    x2 = torch.randn(1, 33, 40).to(torch.bfloat16)
    assert torch.equal(program.module()(x2), swiglu_mlp_ref(x2, w_gate, w_up, w_down))


@pytest.mark.oracle
@pytest.mark.parametrize("layout", LAYOUTS[::2], ids=lambda lay: f"k{int(lay.kernel)}b{lay.block}")
def test_swiglu_mlp_module_matches_hf_qwen2_mlp(layout):
    transformers = pytest.importorskip("transformers", reason="the HF parity test needs transformers")
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    torch.manual_seed(14)
    config = transformers.Qwen2Config(hidden_size=56, intermediate_size=152, hidden_act="silu")
    hf = Qwen2MLP(config).eval()
    fused = SwigluMLP.from_linears(hf.gate_proj, hf.up_proj, hf.down_proj, layout=layout)
    x = torch.randn(2, 11, 56)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), hf(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias"):
        SwigluMLP.from_linears(torch.nn.Linear(4, 8), hf.up_proj, hf.down_proj, layout=layout)


# ---------------------------------------------------------------------------------------------------------------
# tile table and library loading


def test_tile_table_lookup_and_json_round_trip():
    rules = (
        TileRule(kernel=SwigluKernel.PACKED_EVT, n=4864, k=896, max_m=4096, tile_config=1),
        TileRule(kernel=SwigluKernel.PACKED_EVT, n=4864, k=896, max_m=64, tile_config=0),
    )
    table = TileTable(rules=rules)
    assert table.lookup(SwigluKernel.PACKED_EVT, 1, 4864, 896) == 0
    assert table.lookup(SwigluKernel.PACKED_EVT, 65, 4864, 896) == 1
    assert table.lookup(SwigluKernel.PACKED_EVT, 5000, 4864, 896) == -1  # beyond every rule: library heuristic
    assert table.lookup(SwigluKernel.DUAL_PINGPONG, 1, 4864, 896) == -1
    assert TileTable.from_json(table.to_json()) == table
    with pytest.raises(ValueError, match="tile_config"):
        TileRule(kernel=SwigluKernel.PACKED_EVT, n=8, k=8, max_m=1, tile_config=-2)


def test_missing_kernel_library_error_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEVOX_KERNELS_LIB", str(tmp_path / "nope.so"))
    assert kernels_library_path() == tmp_path / "nope.so"
    with pytest.raises(KernelLibraryNotFoundError, match="python -m tilevox.trt_plugins.build"):
        kernels_library()


# ---------------------------------------------------------------------------------------------------------------
# CUDA (H200)


@pytest.fixture
def cuda_lib():
    try:
        return kernels_library()
    except KernelLibraryNotFoundError as exc:
        pytest.skip(f"CUDA op tests need libtilevox_kernels.so: {exc}")


def _poison_next_output(shape: tuple[int, ...]) -> None:
    # The caching allocator hands a freed block of the same size to the next allocation: fill it with NaN so
    # that a kernel which writes nothing cannot pass by inheriting an earlier call's correct output.
    poison = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    del poison


def _cuda_layouts(lib) -> list[GateUpLayout]:
    return [
        GateUpLayout(kernel=SwigluKernel.DUAL_PINGPONG, block=0),
        GateUpLayout(kernel=SwigluKernel.PACKED_EVT, block=lib.tilevox_swiglu_packing_block()),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 37, 200, 1031])
@pytest.mark.parametrize("n,k", [(128, 64), (200, 72), (1152, 896), (4864, 896)])
def test_cuda_gateup_matches_reference(cuda_lib, m, n, k):
    x, w_gate, w_up, _ = _inputs(m, n, k, seed=m + n)
    exact = _gateup_f64(x, w_gate, w_up)
    for layout in _cuda_layouts(cuda_lib):
        if n % max(layout.block, 1):
            continue
        packed = pack_gate_up(w_gate, w_up, kernel=layout.kernel, block=layout.block).cuda()
        for cfg in range(-1, cuda_lib.tilevox_swiglu_gateup_num_configs(int(layout.kernel))):
            _poison_next_output((m, n))
            out = torch.ops.tilevox.swiglu_gateup(x.cuda(), packed, int(layout.kernel), layout.block, cfg)
            _assert_within(out.cpu(), exact, scale=1.0, rtol=BF16_RTOL)


@pytest.mark.gpu
def test_cuda_mlp_matches_reference_and_captures_in_cuda_graph(cuda_lib):
    m, n, k = 37, 1152, 896
    x, w_gate, w_up, w_down = _inputs(m, n, k, hidden=k, seed=12)
    for layout in _cuda_layouts(cuda_lib):
        module = SwigluMLP(w_gate, w_up, w_down, layout=layout).cuda()
        xc = x.cuda().reshape(1, m, k)
        out = module(xc)
        # h as the kernel rounds it (checked against float64 by the gate/up test); the down GEMM rounds once more
        h = torch.ops.tilevox.swiglu_gateup(xc, module.w_packed, int(layout.kernel), layout.block, -1)
        _assert_within(out.cpu(), h.cpu().double() @ w_down.double().t(), scale=1.0, rtol=BF16_RTOL)
        static_x = xc.clone()
        module(static_x)  # warm up outside capture (library load, CUTLASS init)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = module(static_x)
        fresh = torch.randn_like(static_x)
        static_x.copy_(fresh)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, module(fresh)), "graph replay differs from an eager call"


@pytest.mark.gpu
def test_cuda_rejects_unaligned_k_with_library_message(cuda_lib):
    x, w_gate, w_up, _ = _inputs(4, 16, 36, seed=13)  # K = 36 is not a multiple of 8 (16-byte TMA rows)
    packed = pack_gate_up(w_gate, w_up, kernel=SwigluKernel.DUAL_PINGPONG, block=0).cuda()
    with pytest.raises(RuntimeError, match="TILEVOX_ERR_UNSUPPORTED_SHAPE"):
        torch.ops.tilevox.swiglu_gateup(x.cuda(), packed, 1, 0, -1)


@pytest.mark.gpu
def test_layout_for_cuda_uses_library_heuristic(cuda_lib):
    kernel, cfg = ctypes.c_int(), ctypes.c_int()
    assert cuda_lib.tilevox_swiglu_gateup_select(2048, 4864, 896, 0, ctypes.byref(kernel), ctypes.byref(cfg)) == 0
    layout = layout_for_device("cuda", 4864, 896)
    assert int(layout.kernel) == kernel.value
