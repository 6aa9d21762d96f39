"""The load-time swap of SwiGLU MLPs for the fused op: found, gated, dispatched per token count from the measured
table (never onto a path measured slower than PyTorch), and equal to the reference."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tilevox.models.fused_swiglu import (
    DISPATCH_TABLE_ENV_VAR,
    DISPATCH_TABLE_PATH,
    DispatchedSwigluMLP,
    DispatchTable,
    FusedSwiglu,
    MlpPath,
    ShapeDispatch,
    apply_fused_swiglu,
    dispatch_table_for,
    fused_swiglu_unavailable_reason,
)
from tilevox.models.registry import load_model
from tilevox.trt_plugins.ops import swiglu_gateup_ref, swiglu_mlp_ref

REPO = Path(__file__).resolve().parents[2]


class _Block(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def test_cpu_keeps_reference_and_on_raises():
    model = load_model("random:llama-tiny", fused_swiglu=FusedSwiglu.AUTO)
    (llama,) = model.torch_modules()
    assert all(type(layer.mlp).__name__ == "GatedMLP" for layer in llama.model.layers)
    assert "device is cpu" in fused_swiglu_unavailable_reason(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="fused SwiGLU was asked for but cannot run: device is cpu"):
        apply_fused_swiglu(model.torch_modules(), FusedSwiglu.ON)
    assert apply_fused_swiglu(model.torch_modules(), FusedSwiglu.OFF) == 0


def test_qwen_exposes_its_network():
    model = load_model("random:qwen3-tts-tiny")
    (network,) = model.torch_modules()
    assert any(hasattr(m, "gate_proj") for m in network.modules())


@pytest.mark.gpu
def test_swap_on_hopper_matches_reference():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernels are built for sm_90a only")
    torch.manual_seed(0)
    root = nn.Sequential(_Block(256, 688), _Block(256, 688, bias=True)).cuda().to(torch.bfloat16)
    x = torch.randn(13, 256, device="cuda", dtype=torch.bfloat16)
    expected = root(x).float()
    assert apply_fused_swiglu((root,), FusedSwiglu.ON) == 1  # the biased block is left alone
    assert type(root[0]).__name__ == "SwigluMLP" and isinstance(root[1], _Block)
    torch.testing.assert_close(root(x).float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_llama_tiny_runs_fused_on_hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernels are built for sm_90a only")
    fused = load_model("random:llama-tiny", device="cuda", dtype=torch.bfloat16, fused_swiglu=FusedSwiglu.ON)
    (llama,) = fused.torch_modules()
    assert all(type(layer.mlp).__name__ == "SwigluMLP" for layer in llama.model.layers)


# ---------------------------------------------------------------------------------------------------------------
# `auto`: the measured per-shape, per-token-count dispatch (issue 11 item 5)

FTD, FUSED, TORCH = MlpPath.FUSED_TORCH_DOWN, MlpPath.FUSED, MlpPath.TORCH


def _fake_entry(hidden: int = 16, inter: int = 48) -> ShapeDispatch:
    # measured at 1, 4, 8, 64: fused gate/up + cuBLAS down at 1, everything fused at 4 and 8, PyTorch at 64
    return ShapeDispatch(hidden=hidden, intermediate=inter, points=((1, FTD), (4, FUSED), (8, FUSED), (64, TORCH)))


def test_shape_dispatch_exact_between_and_beyond_the_measured_counts():
    entry = _fake_entry()
    assert [entry.path_for(m) for m in (1, 4, 8, 64)] == [FTD, FUSED, FUSED, TORCH]  # measured: as measured
    assert entry.path_for(2) is FTD  # gate/up fused at both neighbours, CUTLASS down only at one: cuBLAS down
    assert entry.path_for(6) is FUSED  # both neighbours fully fused
    assert entry.path_for(9) is TORCH and entry.path_for(63) is TORCH  # a neighbour is PyTorch
    assert entry.path_for(65) is TORCH and entry.path_for(10**7) is TORCH  # beyond the table: never measured
    assert entry.path_for(0) is TORCH
    with pytest.raises(ValueError, match="strictly increasing"):
        ShapeDispatch(hidden=16, intermediate=48, points=((4, FUSED), (4, TORCH)))


def test_from_timings_needs_the_margin_in_every_regime():
    def t(torch_ms, fused_ms, ftd_ms):
        return {TORCH: torch_ms, FUSED: fused_ms, FTD: ftd_ms}

    timings = {
        1: {"graph": t(1.0, 1.3, 0.8), "eager": t(1.0, 1.3, 0.9)},  # fused+cuBLAS down wins in both
        2: {"graph": t(1.0, 0.5, 0.8), "eager": t(1.0, 0.97, 0.9)},  # fused wins under graphs only by < margin eager
        4: {"graph": t(1.0, 0.98, 0.97), "eager": t(1.0, 0.9, 0.9)},  # within the margin under graphs: PyTorch
        8: {"graph": {TORCH: 1.0, FTD: 0.5}, "eager": t(1.0, 0.1, 0.5)},  # no graph time for fused: disqualified
    }
    entry = ShapeDispatch.from_timings(16, 48, timings, margin=0.05)
    assert entry.points == ((1, FTD), (2, FTD), (4, TORCH), (8, FTD))
    assert ShapeDispatch.from_timings(16, 48, {1: {"graph": t(1.0, 2.0, 2.0)}}, margin=0.05).ever_fused is False


def test_dispatched_module_runs_the_named_path_on_cpu():
    torch.manual_seed(3)
    mlp = _Block(16, 48).to(torch.bfloat16)
    module = DispatchedSwigluMLP.from_linears(mlp.gate_proj, mlp.up_proj, mlp.down_proj, dispatch=_fake_entry())
    wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    for m in (0, 1, 2, 5, 9, 64, 100):
        x = torch.randn(1, m, 16).to(torch.bfloat16)
        out = module(x)
        path = module.path_for(m)
        if path is TORCH:  # exactly the plain PyTorch MLP, bit for bit
            assert torch.equal(out, mlp(x))
        elif path is FTD:  # the fused gate/up (its CPU kernel is the reference) then a plain cuBLAS-style Linear
            assert torch.equal(out, torch.nn.functional.linear(swiglu_gateup_ref(x, wg, wu), wd))
        else:
            assert torch.equal(out, swiglu_mlp_ref(x, wg, wu, wd))
    assert [module.path_for(m) for m in (1, 2, 5, 9, 100)] == [FTD, FTD, FUSED, TORCH, TORCH]
    with pytest.raises(ValueError, match="dispatch entry is for 16x48, the MLP is 16x40"):
        DispatchedSwigluMLP.from_linears(
            *(_Block(16, 40).to(torch.bfloat16).get_submodule(p) for p in ("gate_proj", "up_proj", "down_proj")),
            dispatch=_fake_entry(),
        )


def test_dispatched_module_keeps_its_weight_views_across_to():
    torch.manual_seed(4)
    mlp = _Block(16, 48).to(torch.bfloat16)
    module = DispatchedSwigluMLP.from_linears(mlp.gate_proj, mlp.up_proj, mlp.down_proj, dispatch=_fake_entry())
    module.float()
    mlp.float()
    x = torch.randn(9, 16)  # M = 9: the PyTorch path, on views of the converted packed weight
    assert torch.equal(module(x), mlp(x))


def test_auto_swaps_only_shapes_the_table_makes_faster(monkeypatch):
    import tilevox.models.fused_swiglu as fused_swiglu

    monkeypatch.setattr(fused_swiglu, "fused_swiglu_unavailable_reason", lambda device, dtype: None)
    never = ShapeDispatch(hidden=32, intermediate=64, points=((1, TORCH), (64, TORCH)))
    table = DispatchTable(device="fake GPU", shapes=(_fake_entry(), never))
    root = nn.Sequential(_Block(16, 48), _Block(32, 64), _Block(24, 40)).to(torch.bfloat16)
    x = torch.randn(9, 16).to(torch.bfloat16)
    expected = root[0](x)
    assert apply_fused_swiglu((root,), FusedSwiglu.AUTO, table=table) == 1
    assert isinstance(root[0], DispatchedSwigluMLP)
    assert isinstance(root[1], _Block)  # measured, never faster: the plain MLP stays
    assert isinstance(root[2], _Block)  # not measured: the plain MLP stays
    assert torch.equal(root[0](x), expected)  # M = 9 runs the PyTorch path


def test_auto_uses_no_table_measured_on_another_gpu(monkeypatch, tmp_path):
    import tilevox.models.fused_swiglu as fused_swiglu

    path = tmp_path / "table.json"
    path.write_text(DispatchTable(device="NVIDIA H200", shapes=(_fake_entry(),)).to_json())
    monkeypatch.setenv(DISPATCH_TABLE_ENV_VAR, str(path))
    monkeypatch.setattr(fused_swiglu, "fused_swiglu_unavailable_reason", lambda device, dtype: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    root = nn.Sequential(_Block(16, 48)).to(torch.bfloat16)
    assert dispatch_table_for(torch.device("cpu")) is None
    assert apply_fused_swiglu((root,), FusedSwiglu.AUTO) == 0 and isinstance(root[0], _Block)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert dispatch_table_for(torch.device("cpu")) == DispatchTable.load(path)
    assert apply_fused_swiglu((root,), FusedSwiglu.AUTO) == 1 and isinstance(root[0], DispatchedSwigluMLP)


def test_dispatch_table_json_round_trip_and_refusals():
    table = DispatchTable(device="NVIDIA H200", shapes=(_fake_entry(),), source="a run", margin=0.05)
    assert DispatchTable.from_json(table.to_json()) == table
    with pytest.raises(ValueError, match="unknown fields"):
        DispatchTable.from_json('{"device": "x", "shapes": [], "colour": 1}')
    with pytest.raises(ValueError, match="'fastest' is not a valid MlpPath"):
        DispatchTable.from_json(
            '{"device": "x", "shapes": [{"hidden": 8, "intermediate": 8, "points": [[1, "fastest"]]}]}'
        )
    with pytest.raises(ValueError, match="appears twice"):
        DispatchTable(device="x", shapes=(_fake_entry(), _fake_entry()))


def test_committed_table_is_what_the_committed_h200_run_derives():
    results = json.loads((REPO / "benchmarks" / "results" / "swiglu_auto_h200.json").read_text())
    table = DispatchTable.load(DISPATCH_TABLE_PATH)
    assert table.device == results["device"] == "NVIDIA H200"
    for shape in results["shapes"]:
        timings = {}
        for row in shape["rows"]:
            # both regimes of the first measurement, and of the re-measurement of the path `auto` then ran
            timings[row["M"]] = {
                regime: {
                    MlpPath(c): row["ms"][c][regime]
                    for c in ("torch", "fused", "fused_torch_down")
                    if row["rel_err"][c] <= 1e-2
                }
                for regime in ("graph", "eager")
            }
            verify = row["verify"]
            if verify["auto_path"] != "torch":
                for regime in ("graph", "eager"):
                    timings[row["M"]][f"{regime}_verify"] = {
                        TORCH: verify["ms"]["torch"][regime],
                        MlpPath(verify["auto_path"]): verify["ms"]["auto"][regime],
                    }
        derived = ShapeDispatch.from_timings(shape["H"], shape["I"], timings, margin=table.margin)
        assert table.for_shape(shape["H"], shape["I"]) == derived, shape["name"]
        for row in shape["rows"]:  # every fused point was faster than PyTorch in both regimes, twice
            path = derived.path_for(row["M"])
            if path is not TORCH:
                for regime in ("graph", "eager"):
                    assert row["ms"][path.value][regime] < row["ms"]["torch"][regime]
                    assert row["verify"]["ms"]["auto"][regime] < row["verify"]["ms"]["torch"][regime]
    for hidden, inter in ((1024, 3072), (2048, 6144), (2048, 8192)):  # the shapes tilevox's presets serve
        assert table.for_shape(hidden, inter) is not None


@pytest.mark.gpu
@torch.no_grad()
def test_dispatched_paths_on_hopper_match_float64_and_capture_in_a_graph():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernels are built for sm_90a only")
    torch.manual_seed(5)
    mlp = _Block(1024, 3072).cuda().to(torch.bfloat16)
    wg, wu, wd = (mlp.get_submodule(p).weight.double() for p in ("gate_proj", "up_proj", "down_proj"))
    for path in MlpPath:
        entry = ShapeDispatch(hidden=1024, intermediate=3072, points=((1, path), (4096, path)))
        module = DispatchedSwigluMLP.from_linears(mlp.gate_proj, mlp.up_proj, mlp.down_proj, dispatch=entry)
        for m in (1, 7, 300):
            x = torch.randn(m, 1024, device="cuda").to(torch.bfloat16)
            g = x.double() @ wg.t()
            ref = (g * torch.sigmoid(g) * (x.double() @ wu.t())) @ wd.t()
            out = module(x)
            assert torch.isfinite(out).all()
            assert float((out.double() - ref).norm() / ref.norm()) < 1e-2, (path, m)
        static_x = torch.randn(3, 1024, device="cuda").to(torch.bfloat16)
        module(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = module(static_x)
        fresh = torch.randn_like(static_x)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, module(fresh)), path
