"""models.derived: parameter-derived constants computed once, recomputed whenever a parameter changes; and the two
activations that use it (Qwen3-TTS SnakeBeta, DAC Snake) against their formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilevox.models.dac.model import Snake
from tilevox.models.derived import derived
from tilevox.models.qwen3_tts.speech_tokenizer.decoder import SnakeBeta


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5))
        self.computed = 0

    def _double(self, w: torch.Tensor) -> tuple[torch.Tensor]:
        self.computed += 1
        return (w * 2,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (twice,) = derived(self, (self.w,), self._double)
        return x * twice


def test_computed_once_and_again_after_every_kind_of_change():
    m = Scaled()
    x = torch.ones(5)
    for _ in range(3):
        torch.testing.assert_close(m(x), m.w.detach() * 2)
    assert m.computed == 1
    with torch.no_grad():
        m.w.copy_(torch.arange(5.0))  # a loader's in-place write
    torch.testing.assert_close(m(x), torch.arange(5.0) * 2)
    assert m.computed == 2
    m.load_state_dict({"w": torch.full((5,), 3.0)})
    torch.testing.assert_close(m(x), torch.full((5,), 6.0))
    assert m.computed == 3
    m.to(torch.float64)  # a move: new storage and dtype
    assert m(x.double()).dtype == torch.float64 and m.computed == 4
    m(x.double())
    assert m.computed == 4


def test_no_autograd_graph_is_kept_and_compile_traces_it():
    m = Scaled()
    (twice,) = derived(m, (m.w,), m._double)
    assert not twice.requires_grad
    compiled = torch.compile(m, backend="eager", fullgraph=True)  # no graph break, computed inside the graph
    torch.testing.assert_close(compiled(torch.ones(5)), m.w.detach() * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snake_beta_equals_its_formula(dtype):
    gen = torch.Generator().manual_seed(0)
    act = SnakeBeta(7).to(dtype)
    with torch.no_grad():
        act.alpha.copy_(torch.randn(7, generator=gen))
        act.beta.copy_(torch.randn(7, generator=gen))
    x = (3 * torch.randn(2, 7, 11, generator=gen)).to(dtype)
    alpha, beta = torch.exp(act.alpha.double())[None, :, None], torch.exp(act.beta.double())[None, :, None]
    expected = x.double() + torch.sin(x.double() * alpha) ** 2 / (beta + 1e-9)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    for _ in range(2):  # computing the factors, then from the cache
        torch.testing.assert_close(act(x).double(), expected, **tol)
    with torch.no_grad():
        act.beta.zero_()  # the factors follow the parameter
    expected = x.double() + torch.sin(x.double() * alpha) ** 2 / (1 + 1e-9)
    torch.testing.assert_close(act(x).double(), expected, **tol)


def test_dac_snake_equals_its_formula():
    gen = torch.Generator().manual_seed(1)
    act = Snake(6)
    with torch.no_grad():
        act.alpha.copy_(torch.rand(1, 6, 1, generator=gen) + 0.1)
    x = 2 * torch.randn(3, 6, 9, generator=gen)
    a = act.alpha.double()
    expected = x.double() + torch.sin(a * x.double()) ** 2 / (a + 1e-9)
    for _ in range(2):
        torch.testing.assert_close(act(x).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_a_capture_uses_the_cache_and_refuses_to_fill_it():
    """On a GPU: captured after one eager call, a SnakeBeta replays from the cached factors (and equals the eager
    call); captured cold, it raises instead of allocating the factors inside the graph."""
    device = torch.device("cuda")
    act = SnakeBeta(8).to(device)
    with torch.no_grad():
        act.alpha.copy_(torch.randn(8, device=device))
    x = torch.randn(2, 8, 5, device=device)
    expected = act(x)  # the eager call fills the cache
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = act(x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected)
    cold = SnakeBeta(8).to(device)
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        with torch.cuda.stream(stream), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            cold(x)
