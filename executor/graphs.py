"""Conventional regions captured as CUDA graphs: one graph per batch bucket and, where a region reads a
growing length, per length bucket (keys for attention, frames for the codec, history for sampling).

Each backend stands in for one region a model declares (models.region_backends) with the same call and
results as the conventional call, installed through `set_region_backend`, so the model never knows what
runs it. A call's B rows are padded to the next batch bucket with copies of row 0 (the copy writes the
same key/value to the same cache position as row 0, and its outputs are dropped), and attention reads a
static number of keys, the next key bucket (a power of two from 256, capped at the cache length), masked
per row as the eager path masks. Inputs are copied into the graph's static buffers on the device; per-row
host values go through one pinned, asynchronous copy, so a call adds no host synchronisation.
The code-predictor loop samples every head inside its graph with executor.sampling (the megakernel's
counter-based draw: stream seed, frame x (Q-1) + head), so its draws never depend on the batch; token
sampling (the models' executor region) draws every stream's next token the same way (stream seed,
SAMPLING_COUNTER_BASE + token index) after batched penalties. The Qwen3-TTS codec decode gathers its
rows' states from the model's slot-indexed pool, decodes and scatters them back inside its graph; Llasa's
XCodec2 block decode pads every due window to the next multiple of WINDOW_BUCKET frames (masked per row).
NH-TTS: its text encoder is captured per (row bucket, text bucket), and its whole pick of every stream
(guidance, penalties, filters, the EOS rules and the draw at (stream seed, SAMPLING_COUNTER_BASE + position x
channels + channel)) runs as one graph per batch bucket (executor.sampling.nh_pick_codes).

`GraphOptions(compile=True)` compiles each backend's function with torch.compile (Inductor, fullgraph)
before its first capture; batch rows and key/history lengths are marked dynamic (a length enters as the
size of a `_span` tensor), so a backend compiles about twice (batch 1, then any batch) rather than once
per bucket. Compiled regions write their KV caches through `tilevox::write_kv_cache` (models.kv_cache_write),
which Inductor keeps in place on the cache itself: the models' plain indexed writes, functionalized, may be
compiled into a copy of the whole cache per call (28 GiB for Qwen3-TTS-0.6B's 256-stream cache). The codec
decode is captured but never compiled, so its slot-indexed state pool is only ever written in place.
`GraphOptions(capture=False)`, or a CPU model, runs exactly the same code eagerly: the CPU reference.
A call a backend cannot take (a prefill of several positions, a batch above max_batch, predictor
sampling with a repetition penalty, another KV cache) runs the conventional path and the reason is
logged once on the "tilevox.executor" logger. Imports: torch, models, this package.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from tilevox.executor.sampling import filter_plan, nh_pick_codes, sample_next_tokens, sample_rows
from tilevox.models.cuda_streams import PrefillStream, new_codec_stream
from tilevox.models.nh_tts.generation import pick_codes
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.region_backends import (
    CHUNK_DECODE,
    CODE_PREDICTOR_LOOP,
    CODEC_DECODE,
    DAC_CHUNK,
    DECODER_PREFILL,
    DECODER_STEP,
    NH_DECODER_STEP,
    NH_ENCODER,
    NH_SAMPLING,
    SAMPLING_COUNTER_BASE,
    TALKER_PREFILL,
    TALKER_STEP,
    TOKEN_SAMPLING,
    NhPickRows,
    PredictorRows,
    SamplingRows,
    backend_attribute,
    executor_region_names,
    region_module,
    region_names,
    set_region_backend,
)
from tilevox.models.streaming import SpeechModel

__all__ = [
    "BATCH_BUCKETS",
    "WINDOW_BUCKET",
    "GRAPH_BACKENDS",
    "LOGGER_NAME",
    "MIN_HISTORY_BUCKET",
    "MIN_KEY_BUCKET",
    "MIN_PROMPT_BUCKET",
    "GraphOptions",
    "GraphedChunkDecode",
    "GraphedCodePredictorLoop",
    "GraphedCodecDecode",
    "GraphedDacChunk",
    "GraphedDecoderPrefill",
    "GraphedDecoderStep",
    "GraphedNhDecoderStep",
    "GraphedNhEncoder",
    "GraphedNhSampling",
    "GraphedTalkerPrefill",
    "GraphedTalkerStep",
    "GraphedTokenSampling",
    "batch_bucket",
    "host_rows",
    "install_codec_stream",
    "install_graph_regions",
    "install_prefill_stream",
    "key_bucket",
    "length_bucket",
]

LOGGER_NAME = "tilevox.executor"
log = logging.getLogger(LOGGER_NAME)

BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_KEY_BUCKET = 256
MIN_HISTORY_BUCKET = 64
WINDOW_BUCKET = 64  # frames of a captured XCodec2 window decode: multiples of this
DAC_WINDOW_BUCKET = 16  # frames of a captured DAC window decode (NH-TTS): multiples of this
MIN_TEXT_BUCKET = 64  # text positions an NH-TTS step cross-attends: powers of two from here, capped at the cache
MIN_PROMPT_BUCKET = 32  # prompt lengths of a captured prefill: powers of two from here, capped at the cache
RECOMPILE_LIMIT = 32  # compilations per region function under GraphOptions(compile=True), all models together


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphOptions:
    capture: bool = True  # False: the same code eagerly (a CPU model always runs eagerly)
    max_batch: int = BATCH_BUCKETS[-1]  # larger calls run the conventional path
    # Capture the batched prefill too (regions talker_prefill, decoder_prefill), per batch bucket and
    # prompt-length bucket: off by default (see OPT_IN; its eager form runs otherwise).
    prefill: bool = False
    # Padded positions (batch bucket x prompt-length bucket) of one captured prefill: a larger batch runs as
    # several graphs of fewer rows. Bounds the activations a prefill graph holds: 16 prompts padded to
    # 2,048 positions asked for 8 GiB of attention scores on Llama-1B (H200, 2026-12-04, the serve warm-up).
    prefill_tokens: int = 8192
    # Inductor-compile each region's function (torch.compile, fullgraph) before its graphs are captured:
    # fewer, fused kernels per frame. Batch and length dimensions are compiled dynamic, so a backend
    # compiles twice (batch 1, then every other bucket and length) and the server's warm-up does both.
    compile: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= BATCH_BUCKETS[-1]:
            raise ValueError(f"max_batch must be in [1, {BATCH_BUCKETS[-1]}], got {self.max_batch}")
        if self.prefill_tokens < MIN_PROMPT_BUCKET:
            raise ValueError(f"prefill_tokens must be >= {MIN_PROMPT_BUCKET}, got {self.prefill_tokens}")


def batch_bucket(batch: int) -> int:
    """The smallest bucket holding `batch` rows."""
    for bucket in BATCH_BUCKETS:
        if bucket >= batch:
            return bucket
    raise ValueError(f"batch {batch} exceeds the largest bucket {BATCH_BUCKETS[-1]}")


def length_bucket(length: int, minimum: int, limit: int | None = None) -> int:
    """The next power of two >= length, at least `minimum` (itself a power of two), at most `limit`."""
    bucket = minimum
    while bucket < length:
        bucket *= 2
    return bucket if limit is None else min(bucket, limit)


def key_bucket(num_keys: int, limit: int) -> int:
    """Keys a call reads: the next power of two >= num_keys (at least MIN_KEY_BUCKET), at most `limit`."""
    if not 1 <= num_keys <= limit:
        raise ValueError(f"num_keys must be in [1, {limit}], got {num_keys}")
    return length_bucket(num_keys, MIN_KEY_BUCKET, limit)


class _Graphs:
    """Captured graphs by key. run() copies inputs into the key's static buffers and replays. The first
    call of a key runs the function once eagerly on a side stream (the warm-up; its result is that call's
    result, so a function that advances state, like a codec decode, runs exactly once per call), then
    captures it. All graphs of one backend share a memory pool (they never run concurrently)."""

    def __init__(self, device: torch.device, capture: bool, *, compiled: bool = False) -> None:
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.compiled = compiled  # fn is torch.compile'd: mark the inputs' dynamic dimensions before a call
        self._entries: dict[tuple, tuple[dict[str, torch.Tensor], torch.cuda.CUDAGraph, object]] = {}
        self._pool = None

    @property
    def num_graphs(self) -> int:
        return len(self._entries)

    def run(
        self,
        key: tuple,
        fn: Callable[..., object],
        inputs: dict[str, torch.Tensor],
        dynamic: dict[str, tuple[int, ...]] | None = None,
    ):
        """`dynamic`: input name -> the dimensions a compiled fn takes as symbolic sizes (batch, keys)."""
        if not self.capture:
            self._mark_dynamic(inputs, dynamic)
            return fn(**inputs)
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key], result = self._capture(fn, inputs, dynamic)
            return result
        static, graph, out = entry
        for name, tensor in inputs.items():
            static[name].copy_(tensor)
        graph.replay()
        return out

    def _mark_dynamic(self, tensors: dict[str, torch.Tensor], dynamic: dict[str, tuple[int, ...]] | None) -> None:
        """Compile these dimensions for any size (a size 1 stays specialised: Dynamo compiles it apart)."""
        if not self.compiled or not dynamic:
            return
        for name, dims in dynamic.items():
            for dim in dims:
                if tensors[name].shape[dim] >= 2:
                    torch._dynamo.mark_dynamic(tensors[name], dim)

    def _capture(self, fn, inputs, dynamic):
        static = {name: tensor.clone() for name, tensor in inputs.items()}
        self._mark_dynamic(static, dynamic)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            result = fn(**static)  # this call's result: capturing below runs nothing
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Not `with torch.cuda.graph(...)`: its entry synchronises the device, empties the caching allocator
        # and the pinned host cache (and may gc.collect()): about 210 ms per capture in a served Llasa
        # profile (H200, 2026-12-04), every running stream stalled, and each emptied cache refilled with
        # cudaMalloc / cudaHostAlloc afterwards. The capture itself needs none of it.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = fn(**static)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return (static, graph, out), result


class _GraphBackend:
    name = ""

    def __init__(self, module: torch.nn.Module, options: GraphOptions) -> None:
        self.options = options
        self.device = next(module.parameters()).device
        self.graphs = _Graphs(self.device, options.capture, compiled=options.compile)
        self.num_graph_calls = 0  # calls this backend ran (captured or, on CPU, eagerly)
        self.num_conventional_calls = 0
        self.keys_used: set[tuple] = set()  # (batch bucket[, key bucket]) of every call taken
        self._logged: set[str] = set()
        self._spans: dict[int, torch.Tensor] = {}

    def _fallback(self, reason: str) -> None:
        self.num_conventional_calls += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("%s: conventional path for this call: %s", self.name, reason)

    def _rows(self, batch: int) -> tuple[int, torch.Tensor]:
        """(bucket, index (bucket,)): rows 0..batch-1, then copies of row 0."""
        bucket = batch_bucket(batch)
        index = torch.arange(bucket, device=self.device)
        return bucket, torch.where(index < batch, index, torch.zeros_like(index))

    def _compiled(self, fn: Callable[..., object]) -> Callable[..., object]:
        """`fn` itself, or under GraphOptions(compile=True) Inductor's compilation of it (whole graph: a
        graph break is an error, not a silent slow path)."""
        if not self.options.compile:
            return fn
        # Never fall back to the uncompiled function in silence: a recompile past the limit is an error
        # (a backend compiles about twice: batch 1, then every other batch and length).
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        return torch.compile(fn, fullgraph=True)

    def _span(self, length: int) -> torch.Tensor:
        """A tensor of `length` elements whose size carries a length (keys, history) into a compiled
        function as a symbolic size instead of a constant that would be compiled once per bucket."""
        span = self._spans.get(length)
        if span is None:
            span = self._spans[length] = torch.empty(length, dtype=torch.uint8, device=self.device)
        return span

    def _host_rows(self, values: Sequence[Sequence[float]], dtype: torch.dtype) -> torch.Tensor:
        return host_rows(values, dtype, self.device)


def host_rows(values: Sequence[Sequence[float]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row host values (B, n) on `device` through one pinned asynchronous copy."""
    pinned = device.type == "cuda"
    host = torch.tensor(values, dtype=dtype, pin_memory=pinned)
    return host.to(device, non_blocking=pinned)


class GraphedTalkerStep(_GraphBackend):
    """Talker.forward_tokens of one new position per row (the TalkerStepBackend protocol)."""

    name = TALKER_STEP

    def __init__(self, talker: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(talker, options)
        self.talker = talker
        self._cache = None
        self._run_step = self._compiled(self._step)

    def _step(self, x: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, keys: torch.Tensor):
        view = CacheView(cache=self._cache, slots=slots, start=start, kv_len=keys.shape[0])
        return self.talker.forward_tokens(x, view)

    def __call__(self, inputs: torch.Tensor, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_new = inputs.shape[:2]
        reason = None
        if num_new != 1:
            reason = f"{num_new} new positions per row (a prefill)"
        elif not isinstance(view.slots, torch.Tensor):
            reason = "slots given as a slice"
        elif batch > self.options.max_batch:
            reason = f"batch {batch} above max_batch {self.options.max_batch}"
        elif self._cache is not None and view.cache is not self._cache:
            reason = "another KV cache than the one the graphs were captured on"
        if reason is not None:
            self._fallback(reason)
            return self.talker.forward_tokens(inputs, view)
        cache = self._cache = view.cache
        keys = key_bucket(view.kv_len, cache.max_len)
        bucket, rows = self._rows(batch)
        self.keys_used.add((bucket, keys))
        hidden, logits = self.graphs.run(
            (bucket, keys),
            self._run_step,
            {"x": inputs[rows], "slots": view.slots[rows], "start": view.start[rows], "keys": self._span(keys)},
            dynamic={"x": (0,), "slots": (0,), "start": (0,), "keys": (0,)},
        )
        self.num_graph_calls += 1
        return hidden[:batch].clone(), logits[:batch].clone()


def _row_parts(batch: int, span: int, budget: int) -> list[slice]:
    """Rows of a prefill in parts whose padded size (batch bucket x span) stays within `budget` positions
    (a single row may exceed it: a prompt is never split)."""
    rows = max(1, budget // span)
    rows = max([b for b in BATCH_BUCKETS if b <= rows], default=1)
    return [slice(first, min(batch, first + rows)) for first in range(0, batch, rows)]


class GraphedTalkerPrefill(_GraphBackend):
    """Talker.forward_prompts of right-padded prompts from position 0 (the TalkerPrefillBackend protocol),
    one graph per (batch bucket, prompt-length bucket). The prompts are padded further, to the length
    bucket, with zeros: as with the model's own right padding, those positions' keys lie past each
    stream's prompt, where attention never looks and where decoding writes before it reads."""

    name = TALKER_PREFILL

    def __init__(self, talker: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(talker, options)
        self.talker = talker
        self._cache = None
        self._run_prefill = self._compiled(self._prefill)

    def _prefill(self, x: torch.Tensor, slots: torch.Tensor, last: torch.Tensor):
        start = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        view = CacheView(cache=self._cache, slots=slots, start=start, kv_len=x.shape[1], write_offset=0)
        return self.talker.forward_prompts(x, view, last)

    def __call__(self, inputs: torch.Tensor, view: CacheView, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length = inputs.shape[:2]
        reason = None
        if view.write_offset != 0:
            reason = "a prefill that does not start at position 0"
        elif not isinstance(view.slots, torch.Tensor):
            reason = "slots given as a slice"
        elif batch > self.options.max_batch:
            reason = f"batch {batch} above max_batch {self.options.max_batch}"
        elif self._cache is not None and view.cache is not self._cache:
            reason = "another KV cache than the one the graphs were captured on"
        elif length > view.cache.max_len:
            reason = f"{length} prompt positions exceed the cache's {view.cache.max_len}"
        if reason is not None:
            self._fallback(reason)
            return self.talker.forward_prompts(inputs, view, last)
        self._cache = view.cache
        span = length_bucket(length, MIN_PROMPT_BUCKET, view.cache.max_len)
        parts = [
            self._prefill_rows(inputs[part], view.slots[part], last[part], span)
            for part in _row_parts(batch, span, self.options.prefill_tokens)
        ]
        return torch.cat([h for h, _ in parts]), torch.cat([g for _, g in parts])

    def _prefill_rows(self, inputs, slots, last, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length = inputs.shape[:2]
        bucket, rows = self._rows(batch)
        padded = inputs.new_zeros(bucket, span, inputs.shape[2])
        padded[:, :length] = inputs[rows]
        self.keys_used.add((bucket, span))
        hidden, logits = self.graphs.run(
            (bucket, span),
            self._run_prefill,
            {"x": padded, "slots": slots[rows], "last": last[rows]},
            dynamic={"x": (0, 1), "slots": (0,), "last": (0,)},
        )
        self.num_graph_calls += 1
        return hidden[:batch].clone(), logits[:batch].clone()  # cloned before the next part replays


class GraphedDecoderPrefill(_GraphBackend):
    """LlamaForCausalLM.prefill_many (the DecoderPrefillBackend protocol): the checked, right-padded prompts
    (prompt_batch) padded further to a batch bucket and a prompt-length bucket, then prefill_tokens from one
    graph per (batch bucket, length bucket); padding rows repeat row 0 (same slot, same keys)."""

    name = DECODER_PREFILL

    def __init__(self, llama: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(llama, options)
        self.llama = llama
        self._cache = None
        self._run_prefill = self._compiled(self._prefill)

    def _prefill(self, tokens: torch.Tensor, slots: torch.Tensor, last: torch.Tensor):
        return self.llama.prefill_tokens(tokens, self._cache, slots, last)

    def __call__(self, cache, slots: Sequence[int], prompts: Sequence[torch.Tensor]) -> torch.Tensor:
        tokens, lengths = self.llama.prompt_batch(cache, slots, prompts)  # raises for a malformed call
        batch, length = tokens.shape
        reason = None
        if batch > self.options.max_batch:
            reason = f"batch {batch} above max_batch {self.options.max_batch}"
        elif self._cache is not None and cache is not self._cache:
            reason = "another KV cache than the one the graphs were captured on"
        if reason is not None:
            self._fallback(reason)
            return self.llama.prefill_many(cache, slots, prompts)
        self._cache = cache
        span = length_bucket(length, MIN_PROMPT_BUCKET, cache.max_seq_len)
        where = self._host_rows([(int(s), n - 1) for s, n in zip(slots, lengths)], torch.int64)
        logits = torch.cat(
            [
                self._prefill_rows(tokens[part], where[part], span)
                for part in _row_parts(batch, span, self.options.prefill_tokens)
            ]
        )
        for slot, n in zip(slots, lengths):
            cache.lengths[int(slot)] = n
        return logits

    def _prefill_rows(self, tokens: torch.Tensor, where: torch.Tensor, span: int) -> torch.Tensor:
        batch, length = tokens.shape
        bucket, rows = self._rows(batch)
        padded = tokens.new_zeros(bucket, span)
        padded[:, :length] = tokens[rows]
        where = where[rows]
        self.keys_used.add((bucket, span))
        logits = self.graphs.run(
            (bucket, span),
            self._run_prefill,
            {"tokens": padded, "slots": where[:, 0].contiguous(), "last": where[:, 1].contiguous()},
            dynamic={"tokens": (0, 1), "slots": (0,), "last": (0,)},
        )
        self.num_graph_calls += 1
        return logits[:batch].clone()  # cloned before the next part replays


class GraphedCodePredictorLoop(_GraphBackend):
    """CodePredictor.predict of one frame with every head sampled in the graph (CodePredictorLoopBackend)."""

    name = CODE_PREDICTOR_LOOP

    def __init__(self, predictor: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(predictor, options)
        self.predictor = predictor
        self._caches: dict[int, object] = {}  # per bucket: every position is written before it is read
        self._run_frame = self._compiled(self._frame)

    def _frame(self, hidden, code0, floats, ints, cache, candidates, nucleus):
        def choose_on_device(head: int, logits: torch.Tensor) -> torch.Tensor:
            return sample_rows(
                logits,
                floats[:, 0],
                ints[:, 0],
                floats[:, 1],
                ints[:, 1],
                ints[:, 2] + head,
                candidates=candidates,
                nucleus=nucleus,
            )

        return self.predictor.predict(hidden, code0, choose_on_device, cache)

    def __call__(
        self,
        hidden: torch.Tensor,
        code0_embedding: torch.Tensor,
        choose: Callable[[int, torch.Tensor], torch.Tensor],
        rows: PredictorRows,
    ) -> torch.Tensor:
        batch = hidden.shape[0]
        reason = None
        if len(rows.params) != batch:
            raise ValueError(f"{len(rows.params)} sampling rows for a batch of {batch}")
        if batch > self.options.max_batch:
            reason = f"batch {batch} above max_batch {self.options.max_batch}"
        elif any(p.repetition_penalty != 1.0 or p.min_new_tokens for p in rows.params):
            reason = "predictor sampling with a repetition penalty or min_new_tokens"
        if reason is not None:
            self._fallback(reason)
            return self.predictor.predict(hidden, code0_embedding, choose)
        bucket, index = self._rows(batch)
        floats = self._host_rows([(p.temperature, p.top_p) for p in rows.params], torch.float32)
        ints = self._host_rows(
            [(p.top_k, seed, offset) for p, seed, offset in zip(rows.params, rows.seeds, rows.rng_offsets)],
            torch.int64,
        )
        cache = self._caches.get(bucket)
        if cache is None:
            cache = self._caches[bucket] = self.predictor.new_cache(bucket)
            if self.options.compile and bucket >= 2:  # its slots dimension is the batch
                torch._dynamo.mark_dynamic(cache.keys, 1)
                torch._dynamo.mark_dynamic(cache.values, 1)
        plan = filter_plan(
            [p.top_k for p in rows.params], [p.top_p for p in rows.params], self.predictor.lm_head[0].out_features
        )
        self.keys_used.add((bucket,))
        codes = self.graphs.run(
            (bucket, *plan),
            functools.partial(self._run_frame, cache=cache, candidates=plan[0], nucleus=plan[1]),
            {"hidden": hidden[index], "code0": code0_embedding[index], "floats": floats[index], "ints": ints[index]},
            dynamic={"hidden": (0,), "code0": (0,), "floats": (0,), "ints": (0,)},
        )
        self.num_graph_calls += 1
        return codes[:batch].clone()


class GraphedDecoderStep(_GraphBackend):
    """LlamaForCausalLM.decode of one token per slot (the DecoderStepBackend protocol)."""

    name = DECODER_STEP

    def __init__(self, llama: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(llama, options)
        self.llama = llama
        self._cache = None
        self._run_step = self._compiled(self._step)

    def _step(self, tokens: torch.Tensor, where: torch.Tensor, keys: torch.Tensor):
        hidden = self.llama.forward(tokens[:, None], self._cache, where[:, 0], where[:, 1:2], keys.shape[0])
        return self.llama.lm_head(hidden[:, 0])

    def __call__(self, cache, slots: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
        slots = [int(s) for s in slots]
        if token_ids.dim() != 1 or not cache.takes_decode(
            slots, token_ids.shape[0]
        ):  # not a fallback: decode raises its own error for these calls
            return self.llama.decode(cache, slots, token_ids)
        batch = len(slots)
        reason = None
        if batch > self.options.max_batch:
            reason = f"batch {batch} above max_batch {self.options.max_batch}"
        elif self._cache is not None and cache is not self._cache:
            reason = "another KV cache than the one the graphs were captured on"
        if reason is not None:
            self._fallback(reason)
            return self.llama.decode(cache, slots, token_ids)
        self._cache = cache
        positions = [cache.lengths[s] for s in slots]
        keys = key_bucket(max(positions) + 1, cache.max_seq_len)
        bucket, index = self._rows(batch)
        where = self._host_rows(list(zip(slots, positions)), torch.int64)
        logits = self.graphs.run(
            (bucket, keys),
            self._run_step,
            {"tokens": token_ids.to(torch.int64)[index], "where": where[index], "keys": self._span(keys)},
            dynamic={"tokens": (0,), "where": (0,), "keys": (0,)},
        )
        for slot in slots:
            cache.lengths[slot] += 1
        self.num_graph_calls += 1
        return logits[:batch].clone()


class GraphedCodecDecode(_GraphBackend):
    """SpeechTokenizerDecoder.decode_slots of n new frames per row (the CodecDecodeBackend protocol): the
    rows' states are gathered from the pool, decoded and scattered back inside one graph per (batch
    bucket, n). Padding rows repeat row 0 (same codes, same slot: they write row 0's new state again).
    Captured, never Inductor-compiled (GraphOptions.compile leaves it as it is): its indexed writes into the pool
    (conv state, the transformer's rings) would be functionalized into copies of whole pool tensors, the
    problem the compiled KV-cache writes had (models/kv_cache_write.py), and a compile per frame count would
    land mid-serving."""

    name = CODEC_DECODE

    def __init__(self, decoder: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(decoder, options)
        self.decoder = decoder
        self._pool = None

    def __call__(self, codes: torch.Tensor, pool, slots: torch.Tensor) -> torch.Tensor:
        batch, _, frames = codes.shape
        reason = None
        if batch > self.options.max_batch:
            reason = f"batch {batch} above max_batch {self.options.max_batch}"
        elif self._pool is not None and pool is not self._pool:
            reason = "another codec-state pool than the one the graphs were captured on"
        if reason is not None:
            self._fallback(reason)
            return self.decoder.decode_slots(codes, pool, slots)
        self._pool = pool
        bucket, index = self._rows(batch)
        decoder = self.decoder

        def decode(codes: torch.Tensor, slots: torch.Tensor):
            return decoder.decode_slots(codes, pool, slots)

        self.keys_used.add((bucket, frames))
        wav = self.graphs.run((bucket, frames), decode, {"codes": codes.to(torch.int64)[index], "slots": slots[index]})
        self.num_graph_calls += 1
        return wav[:batch].clone()


class GraphedChunkDecode(_GraphBackend):
    """XCodec2Decoder.decode_windows of G right-padded windows (the ChunkDecodeBackend protocol): one graph
    per (batch bucket, frames rounded up to a multiple of WINDOW_BUCKET). The decode is masked per row, so
    the extra frames (code 0) and padding rows (copies of row 0) change no row's samples."""

    name = CHUNK_DECODE

    def __init__(self, decoder: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(decoder, options)
        self.decoder = decoder
        self._run_decode = self._compiled(decoder.decode_windows)

    width_bucket = WINDOW_BUCKET

    def _hop(self) -> int:
        return self.decoder.hop_samples

    def __call__(self, codes: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        batch, frames = codes.shape[0], codes.shape[-1]  # codes (G, frames) or (G, codebooks, frames)
        if batch > self.options.max_batch:
            self._fallback(f"batch {batch} above max_batch {self.options.max_batch}")
            return self.decoder.decode_windows(codes, lengths)
        bucket, index = self._rows(batch)
        width = -(-frames // self.width_bucket) * self.width_bucket
        padded = torch.nn.functional.pad(codes.to(torch.int64), (0, width - frames))
        self.keys_used.add((bucket, width))
        wav = self.graphs.run(
            (bucket, width),
            self._run_decode,
            {"codes": padded[index], "lengths": lengths.to(torch.int64)[index]},
            dynamic={"codes": (0,), "lengths": (0,)},  # widths compile apart (a few multiples of 64)
        )
        self.num_graph_calls += 1
        return wav[:batch, : frames * self._hop()].clone()


class GraphedDacChunk(GraphedChunkDecode):
    """DacCodec.decode_windows for NH-TTS (region dac_chunk): as GraphedChunkDecode, codes (G, codebooks,
    frames) and widths in multiples of DAC_WINDOW_BUCKET (a DAC window is at most 28 frames)."""

    name = DAC_CHUNK
    width_bucket = DAC_WINDOW_BUCKET

    def _hop(self) -> int:
        return self.decoder.hop_length


class GraphedNhDecoderStep(_GraphBackend):
    """NhTtsNetwork.step of one new position per cache row (NH-TTS region nh_decoder_step): one graph per
    (batch bucket, key bucket, text bucket); self-attention reads the key bucket and cross-attention the
    text bucket (powers of two from MIN_TEXT_BUCKET), each masked per row as the eager path masks. A
    several-position call (a stream's prompt) runs the conventional path."""

    name = NH_DECODER_STEP

    def __init__(self, network: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(network, options)
        self.network = network
        self._cache = None
        self._run_step = self._compiled(self._step)

    def _step(self, codes: torch.Tensor, where: torch.Tensor, keys: torch.Tensor, text: torch.Tensor):
        decoder = self.network.decoder
        hidden = decoder.forward_static(
            self._cache, where[:, 0], where[:, 1:2], codes, num_keys=keys.shape[0], num_text=text.shape[0]
        )
        return self.network.logits_dense(hidden).view(hidden.shape[0], codes.shape[2], -1)

    def __call__(self, cache, rows: Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        rows = [int(r) for r in rows]
        batch, steps = codes.shape[:2]
        reason = None
        if steps != 1:
            reason = "a call of several positions (a stream's prompt)"
        elif batch > self.options.max_batch:
            reason = f"batch {batch} above max_batch {self.options.max_batch}"
        elif self._cache is not None and cache is not self._cache:
            reason = "another decoder cache than the one the graphs were captured on"
        elif len(rows) != batch or len(set(rows)) != batch or not all(cache.is_allocated(r) for r in rows):
            reason = "rows that are not distinct allocated rows"  # the conventional path raises its error
        elif max(cache.lengths[r] for r in rows) + 1 > cache.max_seq_len:
            reason = "a row without room for another position"
        if reason is not None:
            self._fallback(reason)
            return self.network.step(cache, rows, codes)
        self._cache = cache
        positions = [cache.lengths[r] for r in rows]
        keys = key_bucket(max(positions) + 1, cache.max_seq_len)
        text = length_bucket(max(cache.text_lengths[r] for r in rows), MIN_TEXT_BUCKET, cache.max_text_len)
        bucket, index = self._rows(batch)
        where = self._host_rows(list(zip(rows, positions)), torch.int64)
        self.keys_used.add((bucket, keys, text))
        logits = self.graphs.run(
            (bucket, keys, text),
            self._run_step,
            {"codes": codes[index], "where": where[index], "keys": self._span(keys), "text": self._span(text)},
            dynamic={"codes": (0,), "where": (0,), "keys": (0,), "text": (0,)},
        )
        for r in rows:
            cache.lengths[r] += 1
        self.num_graph_calls += 1
        return logits[:batch].clone()


class GraphedNhEncoder(_GraphBackend):
    """NhTextEncoder of right-padded texts (NH-TTS region nh_encoder, the NhEncoderBackend protocol): one graph
    per (batch bucket of rows, text bucket: powers of two from MIN_TEXT_BUCKET). The extra positions are
    padding (id 0, not valid: no row's keys include them, and RoPE positions of the real ones are unchanged),
    the extra rows copies of row 0; both are dropped from the result."""

    name = NH_ENCODER

    def __init__(self, encoder: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(encoder, options)
        self.encoder = encoder
        self._run_encode = self._compiled(encoder.forward)

    def __call__(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        if batch > self.options.max_batch:
            self._fallback(f"batch {batch} above max_batch {self.options.max_batch}")
            with torch.no_grad():
                return self.encoder(input_ids, valid)
        span = length_bucket(length, MIN_TEXT_BUCKET)
        bucket, index = self._rows(batch)
        ids = torch.nn.functional.pad(input_ids.to(torch.int64)[index], (0, span - length))
        mask = torch.nn.functional.pad(valid.to(torch.bool)[index], (0, span - length))
        self.keys_used.add((bucket, span))
        with torch.no_grad():
            hidden = self.graphs.run(
                (bucket, span),
                self._run_encode,
                {"input_ids": ids, "valid": mask},
                dynamic={"input_ids": (0, 1), "valid": (0, 1)},
            )
        self.num_graph_calls += 1
        return hidden[:batch, :length].clone()


class GraphedNhSampling(_GraphBackend):
    """NH-TTS's pick of every stream (region nh_sampling, the NhSamplingBackend protocol): guidance (with its
    top-k), repetition penalty, min_new_tokens, temperature, the EOS channel filter, top-k / top-p, the EOS
    delay rule, the draw and the forced prompt entries, all rows at once (executor.sampling.nh_pick_codes),
    one graph per (batch bucket, history bucket, filter plan) instead of a loop of small ops per stream. The
    draw of stream b's channel c is the counter-based one at (seed, SAMPLING_COUNTER_BASE + position x C + c).
    Per-row values arrive in one pinned copy; the model's delayed sequences are read inside the graph (the
    history of the repetition penalty, padded to a power of two from MIN_HISTORY_BUCKET, or left out when no
    row penalises; the forced prompt entries)."""

    name = NH_SAMPLING

    def __init__(self, network: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(network, options)
        config = self.config = network.config
        self.eos, self.pad, self.channels = config.eos_token_id, config.pad_token_id, config.num_channels
        self.vocab = config.decoder.vocab_size
        self._delays = torch.tensor(config.delay_pattern, dtype=torch.int64, device=self.device)
        self._sequences: torch.Tensor | None = None
        self._run_pick = self._compiled(self._pick)

    def _pick(self, pending, floats, ints, history, *, scale, guidance_candidates, candidates, nucleus):
        return nh_pick_codes(
            pending,
            self._sequences,
            floats,
            ints,
            self._delays,
            history=history.shape[0],
            eos=self.eos,
            pad=self.pad,
            scale=scale,
            guidance_candidates=guidance_candidates,
            candidates=candidates,
            nucleus=nucleus,
        )

    def row_values(self, rows: NhPickRows) -> tuple[torch.Tensor, torch.Tensor]:
        """(floats (B, 3), ints (B, 10)) on the device in executor.sampling's NH_FLOATS / NH_INTS columns."""
        floats, ints = [], []
        for b, p in enumerate(rows.params):
            sampled = not p.is_greedy
            position = rows.positions[b]
            floats.append((p.temperature if sampled else 0.0, p.top_p if sampled else 1.0, p.repetition_penalty))
            ints.append(
                (
                    p.top_k,
                    p.top_k if sampled else 0,
                    rows.seeds[b],
                    SAMPLING_COUNTER_BASE + position * self.channels,
                    int(position - rows.prompt_lens[b] < p.min_new_tokens),
                    position,
                    rows.eos_limits[b],
                    rows.eos_positions[b],
                    rows.slots[b],
                    rows.forced_lens[b],
                )
            )
        return self._host_rows(floats, torch.float32), self._host_rows(ints, torch.int64)

    def plan(self, rows: NhPickRows) -> tuple[int | None, int | None, bool]:
        """(guidance candidates, sampling candidates, nucleus) for these rows (executor.sampling.filter_plan)."""
        guidance, _ = filter_plan([p.top_k for p in rows.params], [], self.vocab)
        sampled = [p for p in rows.params if not p.is_greedy]
        candidates, nucleus = filter_plan([p.top_k for p in sampled], [p.top_p for p in sampled], self.vocab)
        return guidance, candidates, nucleus

    def __call__(
        self, pending: torch.Tensor, sequences: torch.Tensor, rows: NhPickRows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = pending.shape[0]
        if len(rows.params) != batch:
            raise ValueError(f"{len(rows.params)} pick rows for a batch of {batch}")
        reason = None
        if batch > self.options.max_batch:
            reason = f"batch {batch} above max_batch {self.options.max_batch}"
        elif self._sequences is not None and sequences is not self._sequences:
            reason = "other sequences than the ones the graphs were captured on"
        if reason is not None:
            self._fallback(reason)
            return pick_codes(self.config, pending, sequences, rows)
        self._sequences = sequences
        penalised = [b for b, p in enumerate(rows.params) if p.repetition_penalty != 1.0 and rows.positions[b]]
        limit = sequences.shape[1]
        width = length_bucket(max(rows.positions[b] for b in penalised), MIN_HISTORY_BUCKET, limit) if penalised else 0
        floats, ints = self.row_values(rows)
        guidance, candidates, nucleus = self.plan(rows)
        scale = float(rows.guidance_scale) if pending.shape[1] == 2 else 1.0
        bucket, index = self._rows(batch)
        self.keys_used.add((bucket, width))
        codes, top0 = self.graphs.run(
            (bucket, width, scale, guidance, candidates, nucleus),
            functools.partial(
                self._run_pick, scale=scale, guidance_candidates=guidance, candidates=candidates, nucleus=nucleus
            ),
            {
                "pending": pending.float()[index],
                "floats": floats[index],
                "ints": ints[index],
                "history": self._span(width),
            },
            dynamic={"pending": (0,), "floats": (0,), "ints": (0,), "history": (0,)},
        )
        self.num_graph_calls += 1
        return codes[:batch].clone(), top0[:batch].clone()


class GraphedTokenSampling(_GraphBackend):
    """The next token of each row (the TokenSamplingBackend protocol) with executor.sampling's batched,
    counter-based draw: one graph per (batch bucket, history bucket) instead of a loop over rows with a
    generator each. The history (for repetition penalties) is padded to a power of two from
    MIN_HISTORY_BUCKET, or left out when no row penalises. A batch above max_batch runs the same function
    eagerly."""

    name = TOKEN_SAMPLING

    def __init__(self, head: torch.nn.Module, options: GraphOptions = GraphOptions()) -> None:
        super().__init__(head, options)
        self._stop_ids: dict[tuple[int, ...], torch.Tensor] = {}
        self._run_draw = self._compiled(sample_next_tokens)

    def __call__(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        batch = logits.shape[0]
        if len(rows.params) != batch:
            raise ValueError(f"{len(rows.params)} sampling rows for a batch of {batch}")
        stop_ids = self._stop_ids.get(rows.stop_token_ids)
        if stop_ids is None:
            stop_ids = self._stop_ids[rows.stop_token_ids] = torch.tensor(
                rows.stop_token_ids, dtype=torch.int64, device=self.device
            )
        lengths = [int(h.shape[0]) for h in rows.history]
        penalised = [b for b, p in enumerate(rows.params) if p.repetition_penalty != 1.0 and lengths[b]]
        width = length_bucket(max(lengths[b] for b in penalised), MIN_HISTORY_BUCKET) if penalised else 0
        history = torch.zeros(batch, width, dtype=torch.int64, device=self.device)
        for b in penalised:
            history[b, : lengths[b]] = rows.history[b]
        floats = self._host_rows([(p.temperature, p.top_p, p.repetition_penalty) for p in rows.params], torch.float32)
        ints = self._host_rows(
            [
                (p.top_k, seed, counter, p.min_new_tokens, length)
                for p, seed, counter, length in zip(rows.params, rows.seeds, rows.counters, lengths)
            ],
            torch.int64,
        )

        candidates, nucleus = filter_plan(
            [p.top_k for p in rows.params], [p.top_p for p in rows.params], logits.shape[-1]
        )
        if batch > self.options.max_batch:
            self._fallback(f"batch {batch} above max_batch {self.options.max_batch} (sampled eagerly)")
            return sample_next_tokens(
                logits.float(), floats, ints, history, stop_ids, candidates=candidates, nucleus=nucleus
            )
        bucket, index = self._rows(batch)
        self.keys_used.add((bucket, width))
        tokens = self.graphs.run(
            (bucket, width, candidates, nucleus),
            functools.partial(self._run_draw, stop_ids=stop_ids, candidates=candidates, nucleus=nucleus),
            {"logits": logits.float()[index], "floats": floats[index], "ints": ints[index], "history": history[index]},
            dynamic={"logits": (0,), "floats": (0,), "ints": (0,), "history": (0, 1)},
        )
        self.num_graph_calls += 1
        return tokens[:batch].clone()


# Region name (models.region_backends) -> the graph backend that runs it; each takes the region's network.
GRAPH_BACKENDS: dict[str, type[_GraphBackend]] = {
    NH_DECODER_STEP: GraphedNhDecoderStep,
    NH_ENCODER: GraphedNhEncoder,
    NH_SAMPLING: GraphedNhSampling,
    DAC_CHUNK: GraphedDacChunk,
    DECODER_STEP: GraphedDecoderStep,
    TALKER_STEP: GraphedTalkerStep,
    CODE_PREDICTOR_LOOP: GraphedCodePredictorLoop,
    CODEC_DECODE: GraphedCodecDecode,
    TOKEN_SAMPLING: GraphedTokenSampling,
    TALKER_PREFILL: GraphedTalkerPrefill,
    DECODER_PREFILL: GraphedDecoderPrefill,
    CHUNK_DECODE: GraphedChunkDecode,
}
# Regions captured only when GraphOptions asks for them (measured on the H200 2026-12-04; opt-in while their
# captures, one per batch and prompt-length bucket, happen during serving rather than in the warm-up).
OPT_IN: dict[str, str] = {TALKER_PREFILL: "prefill", DECODER_PREFILL: "prefill"}


def install_graph_regions(
    model: object, names: Iterable[str] | None = None, options: GraphOptions = GraphOptions()
) -> dict[str, str | None]:
    """Route each region in `names` (default: all the model's decoder and executor regions) through its
    graph backend. Returns name -> None (installed) or the reason it stays as it was (also logged)."""
    result: dict[str, str | None] = {}
    for name in (*region_names(model), *executor_region_names(model)) if names is None else names:
        backend_class = GRAPH_BACKENDS.get(name)
        if backend_class is None:
            result[name] = f"no graph backend for region {name!r}"
            log.warning("graph region %s: %s", name, result[name])
            continue
        if name in OPT_IN and not getattr(options, OPT_IN[name]):
            result[name] = f"off (GraphOptions.{OPT_IN[name]}=False): its eager form runs"
            log.info("region %s: %s", name, result[name])
            continue
        set_region_backend(model, name, backend_class(region_module(model, name), options))
        mode = "CUDA graphs" if options.capture and next(region_module(model, name).parameters()).is_cuda else "eager"
        log.info("region %s: executor (%s)", name, mode)
        result[name] = None
    return result


def install_codec_stream(model: SpeechModel) -> str | None:
    """Run each step's codec decode on a CUDA stream of its own, beside the talker (decoder) step
    (models.cuda_streams). Returns None (installed) or why not (also logged)."""
    reason = None
    if not model.supports_codec_stream:
        reason = f"{model.model_id} decodes audio on the current stream only"
    elif model.device.type != "cuda":
        reason = f"needs a CUDA device (the model is on {model.device})"
    if reason is not None:
        log.warning("codec stream: %s", reason)
        return reason
    model.use_codec_stream(new_codec_stream(model.device))
    log.info("codec stream: on")
    return None


def install_prefill_stream(model: SpeechModel, options: GraphOptions = GraphOptions()) -> str | None:
    """Move `model`'s prefills onto a CUDA stream of their own (models.cuda_streams). Its first tokens are
    drawn by a token-sampling backend of its own when the model's is the executor's (never one backend's
    graphs on two streams at once). Returns None (installed) or why not (also logged)."""
    reason = None
    if not model.supports_prefill_stream:
        reason = f"{model.model_id} prefills on the current stream only"
    elif model.device.type != "cuda":
        reason = f"needs a CUDA device (the model is on {model.device})"
    if reason is not None:
        log.warning("prefill stream: %s", reason)
        return reason
    sampler = None
    if isinstance(getattr(model, backend_attribute(TOKEN_SAMPLING), None), GraphedTokenSampling):
        sampler = GraphedTokenSampling(region_module(model, TOKEN_SAMPLING), options)
    model.use_prefill_stream(PrefillStream(model.device, token_sampling_backend=sampler))
    log.info("prefill stream: on (%s token sampling)", "its own graphed" if sampler is not None else "eager")
    return None
