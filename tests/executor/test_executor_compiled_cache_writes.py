"""Compiled regions (GraphOptions(compile=True)) write their KV caches in place.

Each region that writes a cache (talker step and prefill, code-predictor loop, Llama decoder step and
prefill, NH-TTS decoder step) is compiled once, on a cache far larger than anything else a call touches
(slots x POSITIONS, sizes no other tensor has), and its generated code is read: no buffer the size of the
cache or of one of its layers is allocated (the copy a functionalized scatter leaves when Inductor does not
re-inplace it: a compiled talker prefill copied the whole key tensor, 28 GiB on the H200), and every
write is `tilevox::write_kv_cache` called on the cache inputs themselves. On a CPU (Inductor's C++ code, fp32)
the compiled call gives what the same backend gives eagerly: outputs within float tolerance, the same cache
elements written. On a GPU (Triton code, bf16: what `tilevox synth --compile on` runs) the same code checks
hold and a compiled call's peak memory stays far below one cache layer. `tilevox::write_kv_cache` itself
passes torch.library.opcheck and equals the plain index write."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from tilevox.executor.graphs import (
    GraphedCodePredictorLoop,
    GraphedDecoderPrefill,
    GraphedDecoderStep,
    GraphedNhDecoderStep,
    GraphedTalkerPrefill,
    GraphedTalkerStep,
    GraphOptions,
)
from tilevox.models.kv_cache_write import write_kv_cache_reference
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.qwen3_tts.code_predictor import CodePredictor
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.region_backends import PredictorRows
from tilevox.models.registry import load_model
from tilevox.models.sampling import SamplingParams

# Cache slots (per device: a GPU's cache is made large enough that a copy shows in its peak memory) and
# positions; no other dimension of these calls takes any of these sizes.
SLOTS = {"cpu": 37, "cuda": 997}
POSITIONS = 1031
# Rows per call: one on a CPU (a static batch: a third less compile time), two on a GPU (the batch compiled
# as a symbolic size, as every batch bucket above 1 is served).
ROWS = {"cpu": 1, "cuda": 2}
COMPILED = GraphOptions(capture=False, compile=True, prefill=True)
EAGER = GraphOptions(capture=False, prefill=True)
REGIONS = ["talker_step", "talker_prefill", "code_predictor_loop", "decoder_step", "decoder_prefill", "nh_step"]

_ALLOC = re.compile(r"empty_strided_\w+\(\(([^)]*)\)")
_INPUT = re.compile(r"assert_size_stride\((\w+), \(([^)]*)\)")
_WRITE = re.compile(r"torch\.ops\.tilevox\.write_kv_cache\.default\((\w+), (\w+),")


def _dims(text: str) -> tuple[str, ...]:
    return tuple(d.strip() for d in text.split(",") if d.strip())


def _is_cache(dims: tuple[str, ...], shape: torch.Size) -> bool:
    """An input of the cache's shape (layers, slots, heads, positions, head_dim); only the slots may be
    symbolic (the predictor's per-bucket cache is compiled with a dynamic slot count)."""
    return len(dims) == len(shape) and all(
        d == str(n) or (i == 1 and not d.isdigit()) for i, (d, n) in enumerate(zip(dims, shape))
    )


def check_cache_writes(codes: list[str], shapes: list[torch.Size], num_layers: int) -> None:
    """The generated modules allocate nothing of a cache's (or a layer's) size, and each writes the caches
    only through tilevox::write_kv_cache on its cache inputs (keys, values), at least once per layer."""
    assert codes, "nothing was compiled"
    for code in codes:
        inputs = {name: _dims(dims) for name, dims in _INPUT.findall(code)}
        caches = {name: dims for name, dims in inputs.items() if any(_is_cache(dims, s) for s in shapes)}
        assert len(caches) == 2 * len(shapes), f"cache inputs not found: {inputs}"
        allocations = [_dims(a) for a in _ALLOC.findall(code)]
        assert allocations, "no allocation found: has Inductor's output code changed?"
        whole = set(caches.values()) | {dims[1:] for dims in caches.values()}
        copies = [a for a in allocations if a in whole]
        assert not copies, f"buffers of a cache's or a layer's size: {copies}"
        writes = _WRITE.findall(code)
        assert len(writes) >= num_layers, f"{len(writes)} write_kv_cache calls for {num_layers} layers"
        assert all(keys in caches and values in caches for keys, values in writes), writes


@dataclass
class Case:
    """One region's backend call on a cache of its own."""

    call: Callable[[], object]
    caches: dict[str, torch.Tensor]  # the cache tensors the call writes, by name
    shapes: list[torch.Size]  # shapes of the cache tensors the compiled call takes (keys and values of each)
    num_layers: int
    again: Callable[[], object] | None = None  # the same call once more (default: `call` itself)


class Models:
    """The tiny models of one device, each with a cache of random contents (built once per module)."""

    def __init__(self, device: str) -> None:
        self.device, self.slots, self.rows = torch.device(device), SLOTS[device], ROWS[device]
        self.dtype = torch.float32 if device == "cpu" else torch.bfloat16
        options = ModelOptions(max_streams=self.slots, max_seq_len=POSITIONS)
        self.qwen3 = load_qwen3("qwen3-tts-tiny", device=device, dtype=self.dtype, options=options)
        _random_(self.qwen3.cache.keys, self.qwen3.cache.values)
        llasa = load_llasa("llama-tiny", device=device, dtype=self.dtype, max_streams=1, max_seq_len=64)
        self.llama = llasa.llama
        self.llama_cache = self.llama.new_cache(max_streams=self.slots, max_seq_len=POSITIONS)
        _random_(self.llama_cache.k, self.llama_cache.v)
        self.nh = load_model("random:nh-tts-tiny", device=device, dtype=self.dtype).network
        self.nh_cache = self.nh.new_cache(max_rows=self.slots, max_seq_len=POSITIONS, max_text_len=131)
        nh = self.nh_cache
        _random_(nh.self_k, nh.self_v, nh.cross_k, nh.cross_v)
        # Three codebooks (the tiny preset has four): both kinds of write, the two-position first step and
        # a one-position step, in a fifth less compile time.
        config = self.qwen3.talker.config
        config = replace(config, num_code_groups=3, code_predictor=replace(config.code_predictor, num_code_groups=3))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.predictor = CodePredictor(config).to(device=device, dtype=self.dtype)

    def _randn(self, *shape: int, seed: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(self.device, self.dtype)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, device=self.device)

    def case(self, region: str, options: GraphOptions) -> Case:
        """A fresh copy of the region's cache and a call of a new backend with `options` on it, for
        `self.rows` rows (the first of them at position 1000 of the cache's 1031, the second at 5)."""
        n = self.rows
        talker, width = self.qwen3.talker, self.qwen3.talker.config.transformer.hidden_size
        if region in ("talker_step", "talker_prefill"):
            cache = copy.deepcopy(self.qwen3.cache)
            if region == "talker_step":
                backend, hidden = GraphedTalkerStep(talker, options), self._randn(n, 1, width, seed=1)
                slots, start = self._tensor([36, 3][:n]), self._tensor([1000, 5][:n])
                view = CacheView(cache=cache, slots=slots, start=start, kv_len=1001)
                call = lambda: backend(hidden, view)  # noqa: E731
            else:
                backend, hidden = GraphedTalkerPrefill(talker, options), self._randn(n, 20, width, seed=2)
                start = torch.zeros(n, dtype=torch.long, device=self.device)
                view = CacheView(cache=cache, slots=self._tensor([30, 1][:n]), start=start, kv_len=20, write_offset=0)
                call = lambda: backend(hidden, view, self._tensor([19, 10][:n]))  # noqa: E731
            caches = {"keys": cache.keys, "values": cache.values}
            return Case(call, caches, [cache.keys.shape], talker.config.transformer.num_layers)
        if region == "code_predictor_loop":
            predictor = self.predictor
            backend = GraphedCodePredictorLoop(predictor, options)
            hidden, code0 = self._randn(n, width, seed=3), self._randn(n, width, seed=4)
            rows = PredictorRows(params=(SamplingParams.greedy(),) * n, seeds=(1, 2)[:n], rng_offsets=(0,) * n)

            def predict():
                codes = backend(hidden, code0, None, rows)
                caches.update(keys=backend._caches[n].keys, values=backend._caches[n].values)  # made by the call
                return codes

            caches: dict[str, torch.Tensor] = {}
            num_layers = predictor.config.code_predictor.transformer.num_layers
            return Case(predict, caches, [predictor.new_cache(n).keys.shape], num_layers)
        if region in ("decoder_step", "decoder_prefill"):
            cache, num_layers = copy.deepcopy(self.llama_cache), self.llama.config.num_hidden_layers
            if region == "decoder_step":
                slots = [cache.allocate() for _ in range(7)][5 : 5 + n]
                for slot, length in zip(slots, (1000, 5)):
                    cache.lengths[slot] = length
                backend, tokens = GraphedDecoderStep(self.llama, options), self._tensor([3, 4][:n])
                call = lambda: backend(cache, slots, tokens)  # noqa: E731
            else:
                slots = [cache.allocate() for _ in range(22)][20 : 20 + n]
                backend = GraphedDecoderPrefill(self.llama, options)
                prompts = [torch.arange(1, 12), torch.arange(3, 9)][:n]
                call = lambda: backend(cache, slots, prompts)  # noqa: E731

                def again():  # a prefill fills empty slots
                    for slot in slots:
                        cache.lengths[slot] = 0
                    return call()

                return Case(call, {"k": cache.k, "v": cache.v}, [cache.k.shape], num_layers, again)
            return Case(call, {"k": cache.k, "v": cache.v}, [cache.k.shape], num_layers)
        assert region == "nh_step"
        cache, rows = copy.deepcopy(self.nh_cache), [33, 4][:n]
        cache.claim(rows)
        for row, length, text in zip(rows, (1000, 5), (120, 10)):
            cache.lengths[row], cache.text_lengths[row] = length, text
        cache.text_lengths_device[self._tensor(rows)] = self._tensor([120, 10][:n])
        backend = GraphedNhDecoderStep(self.nh, options)
        channels = self.nh.config.decoder.num_channels
        codes = torch.randint(0, 100, (n, 1, channels), generator=torch.Generator().manual_seed(5)).to(self.device)
        caches = {"self_k": cache.self_k, "self_v": cache.self_v, "cross_k": cache.cross_k, "cross_v": cache.cross_v}
        shapes = [cache.self_k.shape, cache.cross_k.shape]
        return Case(lambda: backend(cache, rows, codes), caches, shapes, self.nh.config.decoder.num_hidden_layers)

    def before(self, region: str) -> dict[str, torch.Tensor]:
        """The region's cache tensors as every case starts from (the predictor's start empty)."""
        if region.startswith("talker"):
            return {"keys": self.qwen3.cache.keys, "values": self.qwen3.cache.values}
        if region.startswith("decoder"):
            return {"k": self.llama_cache.k, "v": self.llama_cache.v}
        if region == "nh_step":
            nh = self.nh_cache
            return {"self_k": nh.self_k, "self_v": nh.self_v, "cross_k": nh.cross_k, "cross_v": nh.cross_v}
        return {}


def _random_(*tensors: torch.Tensor) -> None:
    generator = torch.Generator().manual_seed(7)
    for tensor in tensors:
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))


def _compiled(call) -> tuple[object, list[str]]:
    with torch.no_grad():
        return run_and_get_code(call)


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo():
    """Leave no compiled entry of these caches' shapes behind for the region functions other tests compile
    (their recompile counts and the executor's recompile limit)."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def cpu_models() -> Models:
    return Models("cpu")


@pytest.fixture(scope="module")
def cuda_models() -> Models:
    return Models("cuda")


@pytest.mark.parametrize("region", REGIONS)
def test_compiled_region_writes_its_cache_in_place_and_equals_the_eager_backend(region, cpu_models):
    case = cpu_models.case(region, COMPILED)
    got, codes = _compiled(case.call)
    check_cache_writes(codes, case.shapes, case.num_layers)
    eager = cpu_models.case(region, EAGER)
    with torch.no_grad():
        want = eager.call()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    before = cpu_models.before(region)
    assert case.caches.keys() == eager.caches.keys()
    for name, tensor in case.caches.items():
        if name in before:  # the same elements written (compared with the cache before), the same values
            written = eager.caches[name] != before[name]
            assert torch.equal(tensor != before[name], written)
            assert written.any() or name.startswith("cross")  # the step reads cross keys, never writes them
        torch.testing.assert_close(tensor, eager.caches[name], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("region", REGIONS)
def test_compiled_region_on_a_gpu_writes_its_cache_in_place(region, cuda_models):
    """Inductor's Triton code for the region allocates no cache-sized buffer and calls the op on the cache
    inputs; a compiled call (after the one that compiled it) raises the peak allocated memory by far less
    than one layer of the cache (a copy of the whole cache is what ran the H200 out of memory)."""
    with torch.no_grad():
        cuda_models.case(region, EAGER).call()  # cuBLAS and the eager kernels set up before the peak is read
    case = cuda_models.case(region, COMPILED)
    _, codes = _compiled(case.call)
    check_cache_writes(codes, case.shapes, case.num_layers)
    if region == "code_predictor_loop":
        return  # its cache is one frame of the batch: smaller than a peak measurement can tell apart
    layer_bytes = min(t[0].numel() * t.element_size() for t in case.caches.values())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.no_grad():
        (case.again or case.call)()  # the same backend and shapes: no compile
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - start < layer_bytes // 4


def _op_args(num_new: int) -> tuple:
    generator = torch.Generator().manual_seed(5)
    keys, values = torch.randn(3, 6, 2, 9, 4, generator=generator), torch.randn(3, 6, 2, 9, 4, generator=generator)
    k, v = torch.randn(2, 2, num_new, 4, generator=generator), torch.randn(2, 2, num_new, 4, generator=generator)
    slots, positions = torch.tensor([4, 1]), torch.tensor([[2], [7]]) if num_new == 1 else torch.arange(3).expand(2, 3)
    return keys, values, 1, slots, positions, k, v


@pytest.mark.parametrize("num_new", [1, 3])
def test_write_kv_cache_op(num_new):
    """The op passes opcheck (schema, fake tensor, autograd registration, AOT dispatch) and writes exactly
    the plain index write: row b's keys at slot slots[b], positions[b], of one layer, nothing else."""
    keys, values, layer, slots, positions, k, v = _op_args(num_new)
    torch.library.opcheck(torch.ops.tilevox.write_kv_cache.default, _op_args(num_new))
    want_k, want_v = keys.clone(), values.clone()
    for b in range(2):
        for t in range(num_new):
            want_k[layer, slots[b], :, positions[b, t]] = k[b, :, t]
            want_v[layer, slots[b], :, positions[b, t]] = v[b, :, t]
    torch.ops.tilevox.write_kv_cache(keys, values, layer, slots, positions, k, v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    again_k, again_v = want_k.clone(), want_v.clone()
    write_kv_cache_reference(again_k, again_v, layer, slots, positions, k, v)
    assert torch.equal(again_k, want_k) and torch.equal(again_v, want_v)
