"""A decoder region run in pieces cut at layer boundaries: each piece on the conventional path (captured as a
CUDA graph, Inductor-compiled or not) or as one megakernel launch, the residual stream handed on between them.

This is what the engine builder's layer splits (engine_builder.composition: a region cut into 2-4
megakernels, or megakernel and conventional runs) run as. A split backend stands in for one region with the
same call and results as the conventional call (models.region_backends), so the model never knows what runs
it. A piece [first, stop) hands on the residual stream after layer stop - 1 (before the final norm): the
conventional pieces through the network's own layer span (`forward_layers`, then `head` on the last piece),
a megakernel piece as the region compiler's piece of the region (RegionSpec.piece: `x_in` / `x_out`, the
token embedding only from layer 0 and the head only through the last layer). Every piece of a call runs at
one batch bucket (rows padded with copies of row 0, as both the graphs and the megakernel backends pad),
with no host synchronisation between pieces: conventional pieces replay their graphs, megakernel pieces
their captured launches, each piece reading the previous piece's output buffer on the device.

A call that a split cannot take runs the conventional path whole and logs why once (a prefill, a batch above
max_batch, another KV cache, a bucket a megakernel piece does not compile for): never silently. Regions that
split: DECODER_STEP (Llama networks: LlamaForCausalLM.embed / forward_layers / head), TALKER_STEP (the
Qwen3-TTS talker: forward_layers / head) and NH_DECODER_STEP (NH-TTS: the decoder's embeddings / forward_layers,
the network's head; cross-attention in every layer). Imports: torch, models, this package.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tilevox.executor.graphs import (
    BATCH_BUCKETS,
    MIN_TEXT_BUCKET,
    RECOMPILE_LIMIT,
    GraphOptions,
    _Graphs,
    batch_bucket,
    host_rows,
    key_bucket,
    length_bucket,
)
from tilevox.executor.megakernel import (
    BackendOptions,
    Executor,
    MegakernelUnavailable,
    _CallUnsupported,
    _check_cuda,
    _checked_view,
    _Compiled,
    _decoder_cache_args,
    _greedy_inputs,
    _nh_cache_args,
    _nh_check_decode,
    _nh_well_formed,
    _RegionRunner,
    _talker_cache_args,
)
from tilevox.models.decoder_view import decoder_view
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.region_backends import DECODER_STEP, NH_DECODER_STEP, TALKER_STEP, region_module
from tilevox.trt_plugins.megakernel.instructions import BufferKind

__all__ = [
    "SPLIT_BACKENDS",
    "SplitDecoderStep",
    "SplitNhDecoderStep",
    "SplitPiece",
    "SplitTalkerStep",
    "make_split_backend",
]

log = logging.getLogger("tilevox.executor")


@dataclass(frozen=True, slots=True)
class SplitPiece:
    """Layers [first, stop) of a region on the megakernel, or on the conventional path (`compiled`: with
    Inductor, as GraphOptions(compile=True))."""

    first: int
    stop: int
    megakernel: bool
    compiled: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.first < self.stop:
            raise ValueError(f"a piece needs 0 <= first < stop, got [{self.first}, {self.stop})")
        if self.megakernel and self.compiled:
            raise ValueError("a megakernel piece is not Inductor-compiled")

    @property
    def label(self) -> str:
        kind = "megakernel" if self.megakernel else "compiled" if self.compiled else "graph"
        return f"[{self.first}-{self.stop}]={kind}"


def _check_pieces(pieces: Sequence[SplitPiece], num_layers: int) -> tuple[SplitPiece, ...]:
    edges = [p.first for p in pieces] + [pieces[-1].stop] if pieces else []
    if not pieces or edges[0] != 0 or edges[-1] != num_layers or edges != sorted(set(edges)):
        raise ValueError(f"pieces {[p.label for p in pieces]} do not cover layers [0, {num_layers}) in order")
    if any(p.stop != q.first for p, q in zip(pieces, pieces[1:], strict=False)):
        raise ValueError(f"pieces {[p.label for p in pieces]} leave a gap")
    return tuple(pieces)


class _SplitRegion:
    """The pieces' runners (a megakernel runner, or graphs of a conventional span, per piece) and the
    bookkeeping every split region shares. `network` is the region's module (models.region_backends.region_module:
    the LlamaForCausalLM, the talker, the NH-TTS network)."""

    name = ""

    def __init__(
        self,
        network: torch.nn.Module,
        pieces: Sequence[SplitPiece],
        graphs: GraphOptions | None = None,
        megakernel: BackendOptions | None = None,
    ) -> None:
        self.num_layers = decoder_view(network).num_layers
        self.pieces = _check_pieces(pieces, self.num_layers)
        graphs, megakernel = graphs or GraphOptions(), megakernel or BackendOptions()
        self.network, self.graph_options, self.megakernel = network, graphs, megakernel
        self.device = next(network.parameters()).device
        if any(p.megakernel for p in self.pieces):
            _checked_view(network)
            if megakernel.compiler is None:
                raise MegakernelUnavailable("no region compiler given (BackendOptions.compiler)")
            if megakernel.executor is Executor.CUDA:
                _check_cuda(self.device)
        self._graphs = [_Graphs(self.device, graphs.capture, compiled=p.compiled) for p in self.pieces]
        self._functions = [self._compiled(self._span_function(p), p) for p in self.pieces]
        self._runners: list[_RegionRunner | None] = [None] * len(self.pieces)
        self._cache: object | None = None
        self._spans: dict[int, torch.Tensor] = {}
        self._logged: set[str] = set()
        self.num_split_calls = 0
        self.num_conventional_calls = 0

    @property
    def label(self) -> str:
        return " ".join(p.label for p in self.pieces)

    def _span_function(self, piece: SplitPiece) -> Callable[..., object]:
        raise NotImplementedError

    def _compiled(self, fn: Callable[..., object], piece: SplitPiece) -> Callable[..., object]:
        if not piece.compiled:
            return fn
        # as executor.graphs: a recompile past the limit is an error, never a silent uncompiled path
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        return torch.compile(fn, fullgraph=True)

    def _fallback(self, reason: str) -> None:
        self.num_conventional_calls += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("split region %s (%s): conventional path for this call: %s", self.name, self.label, reason)

    def _span(self, length: int) -> torch.Tensor:
        """A tensor whose size carries the key bucket into a compiled span as a symbolic size."""
        if length not in self._spans:
            self._spans[length] = torch.empty(length, dtype=torch.uint8, device=self.device)
        return self._spans[length]

    def _bucket(self, batch: int, num_slots: int) -> int:
        """Rows every piece runs: the batch bucket, capped at the rows the cache holds and at the megakernel's
        max_batch where a piece is one (as executor.megakernel buckets), never below `batch`."""
        if batch > BATCH_BUCKETS[-1]:
            return batch
        limit = num_slots
        if any(p.megakernel for p in self.pieces):
            limit = min(limit, self.megakernel.max_batch)
        return max(batch, min(batch_bucket(batch), limit))

    def _check_call(self, batch: int, cache: object) -> None:
        if batch > self.graph_options.max_batch:
            raise _CallUnsupported(f"batch {batch} above max_batch {self.graph_options.max_batch}")
        if any(p.megakernel for p in self.pieces) and batch > self.megakernel.max_batch:
            raise _CallUnsupported(f"batch {batch} above the megakernel's max_batch {self.megakernel.max_batch}")
        if self._cache is not None and cache is not self._cache:
            raise _CallUnsupported("another KV cache than the one the pieces were bound to")

    def _compile_pieces(self, bucket: int, compile_args: Mapping[str, int]) -> list[_Compiled | None]:
        """Every megakernel piece compiled for `bucket` rows (before any piece runs: a call either runs split
        or, if one piece cannot compile, whole on the conventional path)."""
        compiled: list[_Compiled | None] = []
        for i, piece in enumerate(self.pieces):
            if not piece.megakernel:
                compiled.append(None)
                continue
            if self._runners[i] is None:
                self._runners[i] = _RegionRunner(
                    self.network,
                    name=self.name,  # the compiler takes the region by name, the piece by `layers`
                    device=self.device,
                    options=self.megakernel,
                    compile_args={**compile_args, "layers": (piece.first, piece.stop)},
                )
            compiled.append(self._runners[i].region(bucket))
        return compiled

    def _run_pieces(
        self,
        x: torch.Tensor,
        compiled: Sequence[_Compiled | None],
        bucket: int,
        *,
        megakernel_inputs: dict[str, torch.Tensor],
        graph_key: tuple,
        graph_inputs: dict[str, torch.Tensor],
        head_of: Callable[[dict[str, torch.Tensor]], object],
    ) -> object:
        """Every piece in order from x (the step's input rows, `bucket` of them): a megakernel piece launched with
        `megakernel_inputs` (its token or x_in input is x; head_of picks the step's result from the last piece's
        buffers), a conventional piece replaying its graph at `graph_key` with `graph_inputs` and x (every input
        has the rows in dimension 0). Returns the last piece's result, the call's result for `bucket` rows."""
        for i, piece in enumerate(self.pieces):
            last = piece.stop == self.num_layers
            if piece.megakernel:
                bound = dict(megakernel_inputs)
                bound["tokens" if piece.first == 0 and "tokens" in _input_names(compiled[i]) else "x_in"] = x
                if last and "temperature" in _input_names(compiled[i]):
                    bound.update(_greedy_inputs(bucket))  # the head samples on the device; the model on the host
                out = self._runners[i].run(compiled[i], bound)
                x = head_of(out) if last else out["x_out"]
            else:
                inputs = {"x": x, **graph_inputs}
                x = self._graphs[i].run(graph_key, self._functions[i], inputs, dynamic=dict.fromkeys(inputs, (0,)))
        return x

    def check(self) -> None:
        """Wait for the megakernel pieces' launches and raise the first error recorded (see
        executor.megakernel._Backend.check)."""
        for runner in self._runners:
            if runner is not None:
                runner.checks.wait()


def _input_names(compiled: _Compiled) -> set[str]:
    return {spec.name for spec in compiled.region.program.buffers if spec.kind is BufferKind.INPUT}


def _pad_index(batch: int, bucket: int, device: torch.device) -> torch.Tensor:
    """Rows 0..batch-1, then copies of row 0, as an index (bucket,) on `device`."""
    index = torch.arange(bucket, device=device)
    return torch.where(index < batch, index, torch.zeros_like(index))


class SplitDecoderStep(_SplitRegion):
    """LlamaForCausalLM.decode of one token per slot (the DecoderStepBackend protocol), in pieces."""

    name = DECODER_STEP

    def _span_function(self, piece: SplitPiece) -> Callable[..., object]:
        last = piece.stop == self.num_layers

        def span(x: torch.Tensor, where: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
            # x: token ids (B,) on the first piece, else the residual stream (B, hidden)
            h = self.network.embed(x[:, None]) if piece.first == 0 else x[:, None]
            h = self.network.forward_layers(
                h, self._cache, where[:, 0], where[:, 1:2], keys.shape[0], piece.first, piece.stop
            )[:, 0]
            return self.network.head(h) if last else h

        return span

    @torch.no_grad()
    def __call__(self, cache, slots: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
        slots = [int(s) for s in slots]
        if token_ids.dim() != 1 or not cache.takes_decode(slots, token_ids.shape[0]):
            return self.network.decode(cache, slots, token_ids)  # not a fallback: decode raises its own error
        batch = len(slots)
        try:
            self._check_call(batch, cache)
            bucket = self._bucket(batch, cache.k.shape[1])
            compiled = self._compile_pieces(bucket, _decoder_cache_args(cache))
        except _CallUnsupported as exc:
            self._fallback(str(exc))
            return self.network.decode(cache, slots, token_ids)
        self._cache = cache
        positions = [cache.lengths[s] for s in slots]
        padded_slots = slots + [slots[0]] * (bucket - batch)
        padded_positions = positions + [positions[0]] * (bucket - batch)
        keys = key_bucket(max(positions) + 1, cache.max_seq_len)
        index = _pad_index(batch, bucket, self.device)
        logits = self._run_pieces(
            token_ids.to(device=self.device, dtype=torch.int64)[index],
            compiled,
            bucket,
            megakernel_inputs={
                "positions": torch.tensor(padded_positions, dtype=torch.int64),
                "slots": torch.tensor(padded_slots, dtype=torch.int64),
                "k_cache": cache.k,
                "v_cache": cache.v,
            },
            graph_key=(bucket, keys),
            graph_inputs={
                "where": host_rows(list(zip(padded_slots, padded_positions)), torch.int64, self.device),
                "keys": self._span(keys),
            },
            head_of=lambda out: out["s0.logits"],
        )
        for slot in slots:
            cache.lengths[slot] += 1
        self.num_split_calls += 1
        return logits[:batch].clone()


class SplitTalkerStep(_SplitRegion):
    """Talker.forward_tokens of one new position per row (the TalkerStepBackend protocol), in pieces."""

    name = TALKER_STEP

    def _span_function(self, piece: SplitPiece) -> Callable[..., object]:
        last = piece.stop == self.num_layers

        def span(x: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, keys: torch.Tensor):
            view = CacheView(cache=self._cache, slots=slots, start=start, kv_len=keys.shape[0])
            h = self.network.forward_layers(x[:, None], view, piece.first, piece.stop)[:, 0]
            return self.network.head(h) if last else h

        return span

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_new = inputs.shape[:2]
        try:
            if num_new != 1:
                raise _CallUnsupported(f"{num_new} new positions per row (a prefill)")
            if not isinstance(view.slots, torch.Tensor):
                raise _CallUnsupported("slots given as a slice")
            self._check_call(batch, view.cache)
            bucket = self._bucket(batch, view.cache.num_slots)
            compiled = self._compile_pieces(bucket, _talker_cache_args(view.cache))
        except _CallUnsupported as exc:
            self._fallback(str(exc))
            return self.network.forward_tokens(inputs, view)
        cache = self._cache = view.cache
        keys = key_bucket(view.kv_len, cache.max_len)
        index = _pad_index(batch, bucket, inputs.device)
        slots, start = view.slots.to(torch.int64)[index], view.start.to(torch.int64)[index]
        hidden, logits = self._run_pieces(
            inputs[index, 0],
            compiled,
            bucket,
            megakernel_inputs={"positions": start, "slots": slots, "k_cache": cache.keys, "v_cache": cache.values},
            graph_key=(bucket, keys),
            graph_inputs={"slots": slots, "start": start, "keys": self._span(keys)},
            head_of=lambda out: (out["x_normed"], out["s0.logits"]),
        )
        self.num_split_calls += 1
        return hidden[:batch].clone(), logits[:batch].clone()


class SplitNhDecoderStep(_SplitRegion):
    """NhTtsNetwork.step of one new position per cache row (codes (B, 1, C) -> logits (B, C, V)), in pieces:
    the summed codebook embeddings are computed first (as the megakernel backend computes them), then each
    piece's layers (self-attention, cross-attention over the rows' encoder keys/values, MLP), the final norm and
    the all-channel head on the last piece."""

    name = NH_DECODER_STEP

    def _span_function(self, piece: SplitPiece) -> Callable[..., object]:
        last = piece.stop == self.num_layers

        def span(x: torch.Tensor, where: torch.Tensor, keys: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            h = self.network.decoder.forward_layers(
                self._cache,
                where[:, 0],
                where[:, 1:2],
                x[:, None],
                num_keys=keys.shape[0],
                num_text=text.shape[0],
                first=piece.first,
                stop=piece.stop,
            )[:, -1]
            return self.network.head(h) if last else h

        return span

    @torch.no_grad()
    def __call__(self, cache, rows: Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        rows = [int(r) for r in rows]
        if not _nh_well_formed(cache, rows, codes):
            return self.network.step(cache, rows, codes)  # not a fallback: step raises its own error
        batch = codes.shape[0]
        try:
            _nh_check_decode(cache, rows, codes)
            self._check_call(batch, cache)
            bucket = self._bucket(batch, cache.max_rows)
            compiled = self._compile_pieces(bucket, _nh_cache_args(cache))
        except _CallUnsupported as exc:
            self._fallback(str(exc))
            return self.network.step(cache, rows, codes)
        self._cache = cache
        positions = [cache.lengths[r] for r in rows]
        texts = [cache.text_lengths[r] for r in rows]
        pad = bucket - batch
        padded_rows, padded_positions, padded_texts = (
            rows + rows[:1] * pad,
            positions + positions[:1] * pad,
            texts + texts[:1] * pad,
        )
        keys = key_bucket(max(positions) + 1, cache.max_seq_len)
        text = length_bucket(max(texts), MIN_TEXT_BUCKET, cache.max_text_len)
        dec = self.network.config.decoder
        logits = self._run_pieces(
            self.network.decoder.embeddings(codes[_pad_index(batch, bucket, codes.device)])[:, 0],  # (bucket, hidden)
            compiled,
            bucket,
            megakernel_inputs={
                "positions": torch.tensor(padded_positions, dtype=torch.int64),
                "slots": torch.tensor(padded_rows, dtype=torch.int64),
                "text_lengths": torch.tensor(padded_texts, dtype=torch.int64),
                "k_cache": cache.self_k,
                "v_cache": cache.self_v,
                "cross_k_cache": cache.cross_k,
                "cross_v_cache": cache.cross_v,
            },
            graph_key=(bucket, keys, text),
            graph_inputs={
                "where": host_rows(list(zip(padded_rows, padded_positions)), torch.int64, self.device),
                "keys": self._span(keys),
                "text": self._span(text),
            },
            head_of=lambda out: out["s0.logits"].view(bucket, dec.num_channels, dec.vocab_size),
        )
        for r in rows:
            cache.lengths[r] += 1
        self.num_split_calls += 1
        return logits[:batch].clone()


# Region name (models.region_backends) -> the split backend that runs it in pieces; each takes the region's network.
SPLIT_BACKENDS: dict[str, type[_SplitRegion]] = {
    DECODER_STEP: SplitDecoderStep,
    TALKER_STEP: SplitTalkerStep,
    NH_DECODER_STEP: SplitNhDecoderStep,
}


def make_split_backend(
    model: object,
    name: str,
    pieces: Sequence[SplitPiece],
    graphs: GraphOptions | None = None,
    megakernel: BackendOptions | None = None,
) -> _SplitRegion:
    """The backend that runs region `name` of `model` in `pieces`; MegakernelUnavailable where a megakernel
    piece can never run here, ValueError for a region that is not cut at layer boundaries at run time."""
    if name not in SPLIT_BACKENDS:
        raise ValueError(f"region {name!r} does not run in pieces; regions that do: {', '.join(SPLIT_BACKENDS)}")
    return SPLIT_BACKENDS[name](region_module(model, name), pieces, graphs, megakernel)
