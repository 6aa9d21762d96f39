"""The load-time swap of SwiGLU MLPs for the fused op: found, gated, and equal to the reference."""

import pytest
import torch
from torch import nn

from tilevox.models.fused_swiglu import FusedSwiglu, apply_fused_swiglu, fused_swiglu_unavailable_reason
from tilevox.models.registry import load_model


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
