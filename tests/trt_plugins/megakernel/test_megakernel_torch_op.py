"""`tilevox::megakernel_launch`: registered with a schema that declares every buffer the kernel writes,
a fake impl for tracing, a clear error off CUDA; on the GPU a launch through the op equals
BoundLaunch.launch bit for bit, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tilevox.trt_plugins.megakernel import launch_op  # importing the package registers the op


def _schema():
    return torch.ops.tilevox.megakernel_launch.default._schema


def test_op_is_registered_with_mutated_args():
    args = {a.name: a for a in _schema().arguments}
    assert list(args) == ["handle", "counters", "error", "outputs", "inputs", "check"]
    written = {name for name, a in args.items() if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"counters", "error", "outputs"}
    assert str(args["outputs"].type) == "List[Tensor]" and str(args["inputs"].type) == "List[Tensor]"
    assert len(_schema().returns) == 0


def test_cpu_tensors_raise_a_clear_error():
    counters, error = torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"tilevox::megakernel_launch runs on CUDA tensors only; counters is on cpu"):
        torch.ops.tilevox.megakernel_launch(1, counters, error, [torch.zeros(4)], [], True)


def test_fake_impl_traces_without_running():
    with FakeTensorMode():
        c = torch.empty(3, dtype=torch.int32)
        assert (
            torch.ops.tilevox.megakernel_launch(7, c, c.clone(), [torch.empty(2, 4)], [torch.empty(4)], False) is None
        )


# ---- GPU -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rt():
    """The runtime module (tests using it carry `requires_megakernel`, so they skip where it cannot run)."""
    from tilevox.trt_plugins.megakernel import runtime

    return runtime


def _region_and_inputs(batch: int = 3):
    from tilevox.engine_builder.regions import RegionSpec, TilingConfig, compile_region
    from tilevox.executor.megakernel_inputs import llama_decode_inputs, sampling_inputs
    from tilevox.models.llama.config import LlamaConfig
    from tilevox.models.llama.weights import random_llama
    from tilevox.models.sampling import SamplingParams

    config = LlamaConfig.preset("tiny")
    model = random_llama(config, seed=0, device="cpu", dtype=torch.float32)
    cache = model.new_cache(max_streams=5, max_seq_len=40)
    slots = [4, 0, 2][:batch]
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        cache.allocate()
    for slot, length in zip(slots, [1, 9, 17]):
        model.prefill(cache, slot, torch.randint(0, config.vocab_size, (length,), generator=gen))
    region = compile_region(
        model,
        RegionSpec.full_step(2),
        batch_size=batch,
        max_context=40,
        num_cache_slots=5,
        cache_len=40,
        tiling=TilingConfig(matvec_rows=24, lm_head_rows=100, partition_tokens=7),
        num_sms=8,
    )
    params = [SamplingParams(temperature=0.9, top_k=20), SamplingParams.greedy(), SamplingParams(top_p=0.7)]
    bound = {
        **llama_decode_inputs(region, cache, slots, torch.tensor([5, 700, 33])[:batch]),
        **sampling_inputs(params[:batch], seeds=[1, 2, 3][:batch], rng_offsets=[0, 4, 9][:batch]),
    }
    return region, {name: t.to("cuda").contiguous() for name, t in bound.items()}


def _fresh(bound):
    return {name: t.clone() for name, t in bound.items()}


@pytest.mark.gpu
@pytest.mark.requires_megakernel
def test_op_launch_equals_bound_launch_bitwise(rt):
    region, bound = _region_and_inputs()
    direct = rt.CudaProgram(region.program).bind(_fresh(bound))
    via_op = rt.CudaProgram(region.program).bind(_fresh(bound))
    out_direct = direct.launch(check=True)
    out_op = launch_op(via_op, check=True)
    for name in out_direct:
        assert torch.equal(out_direct[name], out_op[name]), name


@pytest.mark.gpu
@pytest.mark.requires_megakernel
def test_op_launch_replays_in_a_cuda_graph(rt):
    region, bound = _region_and_inputs()
    eager = rt.CudaProgram(region.program).bind(_fresh(bound))
    eager_out = eager.launch(check=True)
    captured = rt.CudaProgram(region.program).bind(_fresh(bound))
    caches = {name: captured.tensors[name].clone() for name in ("k_cache", "v_cache")}
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs recommends
        launch_op(captured, check=False)
    stream.synchronize()
    for name, saved in caches.items():
        captured.tensors[name].copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_op(captured, check=False)
    for name, saved in caches.items():
        captured.tensors[name].copy_(saved)
    graph.replay()
    captured.check_error()
    for name in ("s0.logits", "s0.tokens", "s1.logits", "s1.tokens", "k_cache", "v_cache"):
        assert torch.equal(eager_out[name], captured.tensors[name]), name


@pytest.mark.gpu
@pytest.mark.requires_megakernel
def test_op_refuses_buffers_or_handles_that_are_not_the_launch(rt):
    from tilevox.trt_plugins.megakernel.torch_op import _handle, _split_buffers

    region, bound = _region_and_inputs(batch=2)
    launch = rt.CudaProgram(region.program).bind(_fresh(bound))
    written, read = _split_buffers(launch)
    handle = _handle(launch)
    with pytest.raises(ValueError, match="not those bound"):
        torch.ops.tilevox.megakernel_launch(
            handle, launch.counters, launch.error, [w.clone() for w in written], read, True
        )
    with pytest.raises(ValueError, match="no live BoundLaunch"):
        torch.ops.tilevox.megakernel_launch(handle + 10_000, launch.counters, launch.error, written, read, True)
