"""Hooks through which another executor (the engine builder's megakernel) may run a model's per-step regions.

A model lists the regions it exposes in its class attribute `region_names` and names the network each
one runs in `region_modules()` (a network that implements models.decoder_view); each region has an
instance attribute `<name>_backend`, None for the conventional PyTorch path. A backend is a callable
with the same signature and results as the conventional call it replaces (the Protocols below), so
models stay unaware of what runs it. Executor regions (class attribute `executor_region_names`, modules
in `executor_region_modules()`: the codec decode, token sampling) are routed the same way but are no
decoder networks: the executor runs them, the region compiler does not compile them.
Imports: torch, models.sampling (model types only for typing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tilevox.models.sampling import SamplingParams, sample_tokens

if TYPE_CHECKING:
    from tilevox.models.llama.model import LlamaKVCache
    from tilevox.models.qwen3_tts.layers import CacheView
    from tilevox.models.qwen3_tts.speech_tokenizer.decoder import DecoderState

__all__ = [
    "CHUNK_DECODE",
    "CODEC_DECODE",
    "CODE_PREDICTOR_LOOP",
    "DAC_CHUNK",
    "DECODER_PREFILL",
    "DECODER_STEP",
    "LLASA_EXECUTOR_REGIONS",
    "LLASA_REGIONS",
    "NH_DECODER_STEP",
    "NH_ENCODER",
    "NH_SAMPLING",
    "NH_TTS_EXECUTOR_REGIONS",
    "NH_TTS_REGIONS",
    "QWEN3_TTS_EXECUTOR_REGIONS",
    "QWEN3_TTS_REGIONS",
    "SAMPLING_COUNTER_BASE",
    "TALKER_PREFILL",
    "TALKER_STEP",
    "TOKEN_SAMPLING",
    "ChunkDecodeBackend",
    "CodePredictorLoopBackend",
    "CodecDecodeBackend",
    "DecoderPrefillBackend",
    "DecoderStepBackend",
    "NhEncoderBackend",
    "NhPickRows",
    "NhSamplingBackend",
    "PredictorRows",
    "SamplingRows",
    "TalkerPrefillBackend",
    "TalkerStepBackend",
    "TokenSamplingBackend",
    "backend_attribute",
    "call_batch",
    "draw_tokens",
    "executor_region_names",
    "region_module",
    "region_names",
    "set_region_backend",
]

DECODER_STEP = "decoder_step"  # Llasa: one batched Llama decode (embed, layers, head) -> logits
TALKER_STEP = "talker_step"  # Qwen3-TTS: one talker forward of one position with the codec head
CODE_PREDICTOR_LOOP = "code_predictor_loop"  # Qwen3-TTS: codebooks 1..Q-1 of one frame
CODEC_DECODE = "codec_decode"  # Qwen3-TTS: incremental codec decode of new frames for a batch of state slots
TOKEN_SAMPLING = "token_sampling"  # the next token of each stream from its logits (penalties, filters, draw)
TALKER_PREFILL = "talker_prefill"  # Qwen3-TTS: one batched talker forward of right-padded prompts from position 0
DECODER_PREFILL = "decoder_prefill"  # Llasa: one batched Llama forward of prompts into empty slots -> logits
CHUNK_DECODE = "chunk_decode"  # Llasa: one XCodec2 decode of every stream's due block, windows right-padded
NH_ENCODER = "nh_encoder"  # NH-TTS: the text encoder of the streams being opened (both guidance rows)
NH_DECODER_STEP = "nh_decoder_step"  # NH-TTS: one decoder call over cache rows: codes (B, T, C) -> logits (B, C, V)
DAC_CHUNK = "dac_chunk"  # NH-TTS: one DAC decode of every stream's due chunk window, right-padded
NH_SAMPLING = "nh_sampling"  # NH-TTS: one delayed position of every channel per stream from its pending logits

LLASA_REGIONS: tuple[str, ...] = (DECODER_STEP,)
QWEN3_TTS_REGIONS: tuple[str, ...] = (TALKER_STEP, CODE_PREDICTOR_LOOP)
QWEN3_TTS_EXECUTOR_REGIONS: tuple[str, ...] = (CODEC_DECODE, TOKEN_SAMPLING, TALKER_PREFILL)
LLASA_EXECUTOR_REGIONS: tuple[str, ...] = (TOKEN_SAMPLING, DECODER_PREFILL, CHUNK_DECODE)
NH_TTS_REGIONS: tuple[str, ...] = (NH_DECODER_STEP,)
NH_TTS_EXECUTOR_REGIONS: tuple[str, ...] = (NH_ENCODER, DAC_CHUNK, NH_SAMPLING)
# A token-sampling backend that draws on the device uses counters from here on (the stream's token index
# added), so its draws never meet the code predictor's (frame x heads + head, far below) for one seed.
SAMPLING_COUNTER_BASE = 1 << 31


class DecoderStepBackend(Protocol):
    """As LlamaForCausalLM.decode: append one token per slot, advance cache.lengths, return logits (B, V)."""

    def __call__(self, cache: LlamaKVCache, slots: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor: ...


class DecoderPrefillBackend(Protocol):
    """As LlamaForCausalLM.prefill_many: each prompt (T_b,) into its empty slot, cache.lengths set; returns
    each prompt's last position's logits (B, V)."""

    def __call__(self, cache: LlamaKVCache, slots: Sequence[int], prompts: Sequence[torch.Tensor]) -> torch.Tensor: ...


class TalkerPrefillBackend(Protocol):
    """As Talker.forward_prompts: right-padded prompts (B, T, H) written from position 0 of view.slots
    (view.write_offset 0) -> (hidden (B, H), logits (B, V)) at each row's last prompt position `last` (B,)."""

    def __call__(
        self, inputs: torch.Tensor, view: CacheView, last: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class TalkerStepBackend(Protocol):
    """As Talker.forward_tokens: inputs (B, T, H) at view.start -> (final-norm hidden (B, H), logits (B, V))."""

    def __call__(self, inputs: torch.Tensor, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictorRows:
    """Per-row sampling for a code-predictor backend that samples by itself (on the device).

    Row b's draw for head j uses the counter-based RNG at (seeds[b], rng_offsets[b] + j): the model
    passes its stream's seed and frame index x (Q-1), so draws never repeat across a stream's frames
    and never depend on which other streams share the batch."""

    params: tuple[SamplingParams, ...]
    seeds: tuple[int, ...]
    rng_offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.params) == len(self.seeds) == len(self.rng_offsets):
            raise ValueError(
                f"one params, seed and rng offset per row: got {len(self.params)}, {len(self.seeds)}, "
                f"{len(self.rng_offsets)}"
            )


class CodePredictorLoopBackend(Protocol):
    """As CodePredictor.predict (codes (B, Q-1) int64). `choose` is the conventional per-head chooser
    (a backend that cannot run a call uses it); `rows` describes the same sampling for on-device draws."""

    def __call__(
        self,
        hidden: torch.Tensor,
        code0_embedding: torch.Tensor,
        choose: Callable[[int, torch.Tensor], torch.Tensor],
        rows: PredictorRows,
    ) -> torch.Tensor: ...


class CodecDecodeBackend(Protocol):
    """As SpeechTokenizerDecoder.decode_slots: codes (B, Q, n) of the streams whose codec states are rows
    `slots` (B,) long of `pool` -> samples (B, n * samples_per_frame); those rows advance in place."""

    def __call__(self, codes: torch.Tensor, pool: DecoderState, slots: torch.Tensor) -> torch.Tensor: ...


class ChunkDecodeBackend(Protocol):
    """As XCodec2Decoder.decode_windows: right-padded code windows (G, T) int64 and their frame counts (G,)
    int64 on the device -> (G, T * hop) float32, row g's first lengths[g] * hop samples its window's."""

    def __call__(self, codes: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingRows:
    """Per-row sampling of a batch of streams' next tokens, as models.sampling.sample_tokens does it with
    the streams' generators: `history[b]` holds row b's generated tokens (repetition penalty,
    min_new_tokens), `stop_token_ids` the ids held back until min_new_tokens exist. A backend that draws
    on the device uses the counter-based RNG at (seeds[b], counters[b]) instead of the generator, where
    the counter is SAMPLING_COUNTER_BASE + the row's token index (its history length)."""

    params: tuple[SamplingParams, ...]
    seeds: tuple[int, ...]
    history: tuple[torch.Tensor, ...]
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.params) == len(self.seeds) == len(self.history):
            raise ValueError(
                f"one params, seed and history per row: got {len(self.params)}, {len(self.seeds)}, {len(self.history)}"
            )

    @property
    def counters(self) -> tuple[int, ...]:
        return tuple(SAMPLING_COUNTER_BASE + int(h.shape[0]) for h in self.history)


class TokenSamplingBackend(Protocol):
    """Logits (B, V) and their rows -> (B,) int64 tokens on the logits' device."""

    def __call__(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor: ...


class NhEncoderBackend(Protocol):
    """As NhTtsNetwork.encode_text: right-padded byte ids (N, T) int64 and their validity (N, T) bool on the
    device -> hidden states (N, T, hidden); only the valid positions of each row mean anything."""

    def __call__(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class NhPickRows:
    """Per-stream state of one NH-TTS pick (models.nh_tts.generation.pick_codes), one entry per stream.

    Stream b picks delayed position positions[b]; row slots[b] of the model's delayed sequences holds its
    positions so far (the repetition penalty's history, BOS and prompt included) and, at positions not yet
    picked, its forced prompt entries (non-PAD, up to forced_lens[b]). prompt_lens[b] positions were
    prefilled (min_new_tokens counts from there), channel 0 is forced to EOS at eos_limits[b], and
    eos_positions[b] is where channel 0 ended (-1: not yet). The plain path draws from `generators`; a
    backend that draws on the device uses the counter-based RNG at (seeds[b], SAMPLING_COUNTER_BASE +
    positions[b] x channels + channel), so a stream draws the same alone and in any batch."""

    params: tuple[SamplingParams, ...]
    generators: tuple[torch.Generator, ...]
    seeds: tuple[int, ...]
    slots: tuple[int, ...]
    positions: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    forced_lens: tuple[int, ...]
    eos_limits: tuple[int, ...]
    eos_positions: tuple[int, ...]
    guidance_scale: float  # used when the pending logits hold two rows per stream (conditional, unconditional)

    def __post_init__(self) -> None:
        fields = (
            self.generators,
            self.seeds,
            self.slots,
            self.positions,
            self.prompt_lens,
            self.forced_lens,
            self.eos_limits,
            self.eos_positions,
        )
        if any(len(f) != len(self.params) for f in fields):
            raise ValueError(f"one entry per stream in every field: got {[len(self.params), *map(len, fields)]}")


class NhSamplingBackend(Protocol):
    """As models.nh_tts.generation.pick_codes (without its config): pending logits (B, R, C, V) float32 (R
    guidance rows per stream: conditional, then unconditional), the model's delayed sequences (S, L, C) int64
    and the rows -> (codes (B, C) int64 on the device, channel 0's best id after the filters (B,) int64: the
    host's EOS bookkeeping reads it once per step)."""

    def __call__(
        self, pending: torch.Tensor, sequences: torch.Tensor, rows: NhPickRows
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def draw_tokens(
    backend: TokenSamplingBackend | None,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    history: Sequence[torch.Tensor],
    stop_token_ids: tuple[int, ...],
) -> torch.Tensor:
    """Each row's next token (B,) int64: models.sampling.sample_tokens with the streams' generators, or,
    where a token_sampling backend is installed, that backend given the same rows (seeded by each
    generator's initial seed, see SamplingRows)."""
    if backend is None:
        return sample_tokens(logits, params, generators, history, stop_token_ids=stop_token_ids)
    rows = SamplingRows(
        params=tuple(params),
        seeds=tuple(g.initial_seed() for g in generators),
        history=tuple(history),
        stop_token_ids=stop_token_ids,
    )
    return backend(logits, rows)


# How many streams one call of each region's backend carries (from the Protocols' arguments).
_CALL_BATCH = {
    DECODER_STEP: lambda cache, slots, token_ids: len(slots),
    TALKER_STEP: lambda inputs, view: inputs.shape[0],
    CODE_PREDICTOR_LOOP: lambda hidden, code0_embedding, choose, rows: hidden.shape[0],
    CODEC_DECODE: lambda codes, pool, slots: codes.shape[0],
    TOKEN_SAMPLING: lambda logits, rows: logits.shape[0],
    TALKER_PREFILL: lambda inputs, view, last: inputs.shape[0],
    DECODER_PREFILL: lambda cache, slots, prompts: len(slots),
    CHUNK_DECODE: lambda codes, lengths: codes.shape[0],
    NH_ENCODER: lambda input_ids, valid: input_ids.shape[0],
    NH_DECODER_STEP: lambda cache, rows, codes: len(rows),
    DAC_CHUNK: lambda codes, lengths: codes.shape[0],
    NH_SAMPLING: lambda pending, sequences, rows: pending.shape[0],
}


def call_batch(name: str, *args, **kwargs) -> int:
    """The number of streams in a call of region `name`'s backend with these arguments."""
    if name not in _CALL_BATCH:
        raise ValueError(f"no region named {name!r}")
    return int(_CALL_BATCH[name](*args, **kwargs))


def executor_region_names(model: object) -> tuple[str, ...]:
    """The executor regions `model` lets the executor run (empty for models without them)."""
    return tuple(getattr(type(model), "executor_region_names", ()))


def region_names(model: object) -> tuple[str, ...]:
    """The regions `model` lets another executor run (empty for models without hooks)."""
    return tuple(getattr(type(model), "region_names", ()))


def _check_region(model: object, name: str) -> None:
    names = (*region_names(model), *executor_region_names(model))
    if name not in names:
        raise ValueError(f"{type(model).__name__} has no region {name!r}; its regions: {', '.join(names) or '(none)'}")


def region_module(model: object, name: str) -> torch.nn.Module:
    """The network that region `name` of `model` runs (a decoder region's is what a region compiler compiles)."""
    _check_region(model, name)
    if name in executor_region_names(model):
        return model.executor_region_modules()[name]
    return model.region_modules()[name]


def backend_attribute(name: str) -> str:
    return f"{name}_backend"


def set_region_backend(model: object, name: str, backend: Callable | None) -> None:
    """Route region `name` of `model` through `backend` (None: back to the conventional path)."""
    _check_region(model, name)
    setattr(model, backend_attribute(name), backend)
