"""The streaming interface that every tilevox speech model implements.

The server's scheduler and the engine builder drive models only through `SpeechModel`:
open a stream per request, step any subset of the open streams together one codec frame
at a time, collect each stream's newly final audio, and close (or cancel) streams at any
time. Streams are independent: which other streams share a step never changes a stream's
tokens, and its audio only by float rounding of batched matmuls.

Imports: torch, numpy and models.sampling only.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tilevox.models.errors import RequestError
from tilevox.models.sampling import SamplingParams

__all__ = [
    "AudioChunk",
    "FinishReason",
    "SpeechModel",
    "SynthesisRequest",
    "SynthesisResult",
    "VoiceInfo",
    "VoicePrompt",
    "synthesize",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class VoicePrompt:
    """Reference audio for voice cloning (mono float32 samples in [-1, 1])."""

    samples: np.ndarray
    sample_rate_hz: int
    transcript: str | None = None  # given: in-context (ICL) cloning; None: speaker-embedding only

    def __post_init__(self) -> None:
        if self.samples.ndim != 1 or self.samples.size == 0:
            raise RequestError(f"voice prompt audio must be a non-empty mono array, got shape {self.samples.shape}")
        if self.sample_rate_hz <= 0:
            raise RequestError(f"voice prompt sample rate must be positive, got {self.sample_rate_hz}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SynthesisRequest:
    """One utterance to synthesize. Validation of model-specific fields (voice names,
    languages) happens in `SpeechModel.validate`."""

    text: str
    voice: str | None = None  # speaker name from SpeechModel.voices(); None = the model's default
    language: str | None = None  # None = the model's automatic choice
    instructions: str | None = None  # natural-language voice description (voice-design models)
    voice_prompt: VoicePrompt | None = None  # reference audio (voice-cloning models)
    sampling: SamplingParams | None = None  # None: not chosen by the caller, the model's own defaults
    seed: int = 0
    max_duration_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise RequestError("text must be a non-empty string")
        if not (0.0 < self.max_duration_s <= 3600.0):
            raise RequestError(f"max_duration_s must be in (0, 3600], got {self.max_duration_s}")
        if not (0 <= self.seed < 2**63):
            raise RequestError(f"seed must be in [0, 2**63), got {self.seed}")


@dataclass(frozen=True, slots=True, kw_only=True)
class VoiceInfo:
    name: str
    languages: tuple[str, ...] = ()
    description: str = ""


class FinishReason(enum.Enum):
    STOP = "stop"  # the model emitted its end-of-speech token
    LENGTH = "length"  # max_new_tokens or max_duration_s reached
    CANCELLED = "cancelled"  # closed by the caller before it finished


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """What one step produced for one stream."""

    stream_id: int
    samples: np.ndarray  # float32 mono, newly final samples (may be empty while a codec waits for lookahead)
    num_new_frames: int  # codec frames generated in this step (0 or 1 for frame-stepped models)
    finish_reason: FinishReason | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class SpeechModel(abc.ABC):
    """A speech model that synthesizes many independent streams frame by frame.

    Contract:
      * `open_stream` validates the request (raising ValueError with a message naming the
        bad field), allocates the stream's state (KV cache slot, codec state, RNG) and
        runs its prompt; it returns a stream id unique for this model instance.
      * `step(ids)` advances every listed open stream by one frame and returns one
        AudioChunk per id, in order. A chunk with `finish_reason` set is that stream's
        last: its state is already released and the id is no longer open.
      * `close(id)` cancels an open stream and releases its state at once; it is
        idempotent and returns whether the stream was still open.
    """

    model_id: str
    sample_rate_hz: int
    frame_rate_hz: float
    device: torch.device
    max_streams: int  # how many streams may be open at once

    @abc.abstractmethod
    def voices(self) -> tuple[VoiceInfo, ...]: ...

    @abc.abstractmethod
    def validate(self, request: SynthesisRequest) -> None:
        """Raise ValueError if this model cannot serve `request` (unknown voice, text too long...)."""

    @abc.abstractmethod
    def open_stream(self, request: SynthesisRequest) -> int: ...

    def open_streams(self, requests: Sequence[SynthesisRequest]) -> list[int | Exception]:
        """Open several streams at once: a stream id, or the exception that refused that request, per
        request in order (one bad request never fails the others). A model may run the prompts of all
        of them in one batched prefill; this default opens them one by one."""
        out: list[int | Exception] = []
        for request in requests:
            try:
                out.append(self.open_stream(request))
            except Exception as exc:  # noqa: BLE001 - returned to the caller, who fails that request only
                out.append(exc)
        return out

    @abc.abstractmethod
    def step(self, stream_ids: Sequence[int]) -> list[AudioChunk]: ...

    @abc.abstractmethod
    def close(self, stream_id: int) -> bool: ...

    @property
    @abc.abstractmethod
    def open_stream_ids(self) -> tuple[int, ...]: ...

    @property
    def supports_speed(self) -> bool:
        return False

    @property
    def supports_prefill_stream(self) -> bool:
        """Whether `use_prefill_stream` may move this model's prefills onto their own CUDA stream."""
        return False

    def use_prefill_stream(self, prefill_stream) -> None:
        """Prefill on `prefill_stream` (models.cuda_streams.PrefillStream), or on the current stream
        again (None). Only for a model whose supports_prefill_stream is True."""
        raise NotImplementedError(f"{type(self).__name__} prefills on the current stream only")

    @property
    def supports_codec_stream(self) -> bool:
        """Whether `use_codec_stream` may move this model's step codec decode onto a CUDA stream of its own."""
        return False

    def use_codec_stream(self, codec_stream) -> None:
        """Run each step's codec decode on `codec_stream` (a torch.cuda.Stream, models.cuda_streams), beside
        the step's other work, or on the current stream again (None)."""
        raise NotImplementedError(f"{type(self).__name__} decodes audio on the current stream only")

    def is_ready(self, stream_id: int) -> bool:
        """Whether an open stream's prefill has finished on the device (never blocks). A stream that is
        not ready may still be stepped: the step then waits for its prefill on the device."""
        del stream_id
        return True

    def warm_up_batches(self, batch_sizes: Sequence[int]) -> None:
        """Run, once at each of these batch sizes, the batched work that streams reach only late (a codec
        window that grows over a stream's first seconds), so that a backend that captures per shape (the
        executor's CUDA graphs) has every shape before serving. No stream state changes. A no-op unless a
        model has such work."""
        del batch_sizes  # nothing here: most models reach every shape in their first steps

    def torch_modules(self) -> tuple[torch.nn.Module, ...]:
        """The language-model networks, for load-time rewrites such as the fused SwiGLU swap."""
        return ()

    @property
    def is_random(self) -> bool:
        """True for `random:` presets, whose audio is noise."""
        return False


@dataclass(frozen=True, slots=True)
class SynthesisResult:
    samples: np.ndarray  # float32 mono, whole utterance
    sample_rate_hz: int
    num_frames: int
    finish_reason: FinishReason
    time_to_first_audio_s: float  # from open_stream to the first non-empty chunk
    wall_time_s: float

    @property
    def duration_s(self) -> float:
        return self.samples.size / self.sample_rate_hz

    @property
    def real_time_factor(self) -> float:
        """Wall time over audio duration: below 1 is faster than real time."""
        return self.wall_time_s / self.duration_s if self.samples.size else float("inf")


def synthesize(
    model: SpeechModel, request: SynthesisRequest, *, on_chunk: Callable[[AudioChunk], None] | None = None
) -> SynthesisResult:
    """Run one request to completion on its own (batch of one); `on_chunk` sees every step's chunk (progress)."""
    start = time.perf_counter()
    stream_id = model.open_stream(request)
    pieces: list[np.ndarray] = []
    first_audio_s = float("nan")
    num_frames = 0
    try:
        while True:
            (chunk,) = model.step([stream_id])
            if on_chunk is not None:
                on_chunk(chunk)
            num_frames += chunk.num_new_frames
            if chunk.samples.size:
                if not pieces:
                    first_audio_s = time.perf_counter() - start
                pieces.append(chunk.samples)
            if chunk.finish_reason is not None:
                break
    finally:
        model.close(stream_id)
    samples = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    return SynthesisResult(
        samples=samples.astype(np.float32, copy=False),
        sample_rate_hz=model.sample_rate_hz,
        num_frames=num_frames,
        finish_reason=chunk.finish_reason,
        time_to_first_audio_s=first_audio_s,
        wall_time_s=time.perf_counter() - start,
    )
