"""NH-TTS: the non-hierarchical codec-LM family (served model: Dia-1.6B), served through SpeechModel streams.

A non-hierarchical codec LM predicts every codebook of a frame in one decoder step, the codebooks offset
by a delay pattern, with no per-frame inner loop. Each stream owns one cache row per guidance branch (2 with
classifier-free guidance: conditional and unconditional text), its encoder keys/values (computed once in
`open_streams`), one torch.Generator and one DAC streaming decoder. A step picks one delayed position of all
channels per listed stream from its pending logits (models.nh_tts.generation), undoes the delay for the
frame that became complete (position - max_delay), pushes the frames of every stream to the DAC in one
batched call and runs ONE decoder call for all rows of the streams that go on.

The first audio frame is complete max_delay steps after the first position (the delay pattern), and the
DAC stream decoder adds its chunk and lookahead (models.dac.streaming). A stream ends STOP when channel 0
picked EOS at position e and frame e - 1 is complete (position e - 1 + max_delay), LENGTH when the EOS was
forced by its frame budget; positions after e that no audio frame needs (the last forced EOS) are not run.
Imports: torch, numpy, models.{errors,sampling,streaming,dac}, models.nh_tts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function

from tilevox.models.dac import DacCodec, DacStreamDecoder, push_many
from tilevox.models.errors import RequestError
from tilevox.models.nh_tts.config import NhTtsConfig
from tilevox.models.nh_tts.decoder import NhDecoderCache, NhTtsNetwork
from tilevox.models.nh_tts.generation import delay_prompt, eos_started, pick_codes
from tilevox.models.nh_tts.tokenizer import PAD_ID, SPEAKER_TAGS, encode_text, has_speaker_tag
from tilevox.models.region_backends import (
    DAC_CHUNK,
    NH_DECODER_STEP,
    NH_ENCODER,
    NH_SAMPLING,
    NH_TTS_EXECUTOR_REGIONS,
    NH_TTS_REGIONS,
    NhEncoderBackend,
    NhPickRows,
    NhSamplingBackend,
)
from tilevox.models.sampling import SamplingParams, make_generator
from tilevox.models.streaming import AudioChunk, FinishReason, SpeechModel, SynthesisRequest, VoiceInfo

__all__ = [
    "DAC_CHUNK",
    "NH_DECODER_STEP",
    "NH_ENCODER",
    "NH_SAMPLING",
    "NH_TTS_EXECUTOR_REGIONS",
    "NH_TTS_REGIONS",
    "NhTtsModel",
    "StreamCapacityError",
    "nh_region_modules",
]


VOICES = ("S1", "S2")
DEFAULT_VOICE = "S1"


class StreamCapacityError(RuntimeError):
    """open_stream was called while all max_streams streams are open."""


def nh_region_modules(network: NhTtsNetwork) -> dict[str, torch.nn.Module]:
    """NH-TTS's decoder regions and the network each runs (models.region_backends)."""
    return {NH_DECODER_STEP: network}


@dataclass(slots=True, kw_only=True)
class _Stream:
    slot: int
    rows: list[int]  # cache rows: [conditional] or [conditional, unconditional]
    params: SamplingParams
    generator: torch.Generator
    forced: torch.Tensor  # (M, C) the delayed prompt; non-PAD entries are forced at their positions
    prompt_len: int  # P: positions prefilled (BOS + audio-prompt frames); the first generated frame is P
    position: int  # the next position to pick
    eos_limit: int  # channel 0 is forced to EOS here (the frame budget)
    codec: DacStreamDecoder
    pending: torch.Tensor | None = None  # (rows, C, V) logits of `position`
    eos_position: int | None = None
    eos_by_length: bool = False
    frames_pushed: int = 0


class NhTtsModel(SpeechModel):
    """NH-TTS text-to-speech over a row-indexed decoder cache and per-stream DAC streaming decoders.

    Args:
        network: text encoder + decoder + head (models.nh_tts.decoder.NhTtsNetwork).
        codec: the DAC codec (44.1 kHz, 512 samples per frame for Dia).
        model_id: a name for logs.
        max_streams: streams open at once.
        max_seq_len: delayed positions per stream in the decoder cache (Dia: 3072).
        max_text_len: text bytes per stream (Dia's encoder: 1024).
        guidance_scale: classifier-free guidance scale (1: off, one row per stream).
        default_sampling: the sampling of requests that choose none (the checkpoint's generation config).
        is_random: True for random-weight presets.
        code_observer: called as observer(stream_id, position, codes (C,) int64) for every picked position.
        codec_left_context, codec_lookahead, codec_chunk_frames: DacStreamDecoder options (None: its defaults).
    """

    region_names = NH_TTS_REGIONS
    executor_region_names = NH_TTS_EXECUTOR_REGIONS

    def __init__(
        self,
        *,
        network: NhTtsNetwork,
        codec: DacCodec,
        model_id: str,
        max_streams: int,
        max_seq_len: int,
        max_text_len: int,
        guidance_scale: float,
        default_sampling: SamplingParams,
        is_random: bool = False,
        code_observer: Callable[[int, int, torch.Tensor], None] | None = None,
        codec_left_context: int | None = None,
        codec_lookahead: int | None = None,
        codec_chunk_frames: int | None = None,
    ) -> None:
        config = network.config
        if codec.num_codebooks != config.num_channels:
            raise ValueError(
                f"the codec has {codec.num_codebooks} codebooks, the decoder {config.num_channels} channels"
            )
        if codec.codebook_size < config.num_codes:
            raise ValueError(
                f"the decoder writes codes below {config.num_codes} (its EOS id) but the codec's codebooks hold "
                f"{codec.codebook_size}"
            )
        if codec.device != network.device:
            raise ValueError(f"network ({network.device}) and codec ({codec.device}) must share a device")
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1 (1 = no guidance), got {guidance_scale}")
        if max_seq_len < config.max_delay + 2:
            raise ValueError(f"max_seq_len {max_seq_len} leaves no room for a frame past the delay pattern")
        self.network = network
        self.config: NhTtsConfig = config
        self.codec = codec
        self.model_id = model_id
        self.device = network.device
        self.sample_rate_hz = codec.sample_rate_hz
        self.frame_rate_hz = codec.sample_rate_hz / codec.hop_length
        self.max_streams = max_streams
        self.max_seq_len = max_seq_len
        self.max_text_len = max_text_len
        self.guidance_scale = float(guidance_scale)
        self.rows_per_stream = 2 if self.guidance_scale != 1.0 else 1
        self.default_sampling = default_sampling
        self._is_random = is_random
        self.code_observer = code_observer
        self._codec_options = {
            k: v
            for k, v in (
                ("left_context", codec_left_context),
                ("lookahead", codec_lookahead),
                ("chunk_frames", codec_chunk_frames),
            )
            if v is not None
        }
        self._cache: NhDecoderCache = network.new_cache(
            max_rows=max_streams * self.rows_per_stream, max_seq_len=max_seq_len, max_text_len=max_text_len
        )
        self._free_slots = list(range(max_streams))
        self._sequences = torch.zeros(
            max_streams, max_seq_len + config.max_delay + 1, config.num_channels, dtype=torch.long, device=self.device
        )
        self._streams: dict[int, _Stream] = {}
        self._next_id = itertools.count(1)
        self._delays_device = torch.tensor(config.delay_pattern, dtype=torch.long, device=self.device)
        self._channels_device = torch.arange(config.num_channels, device=self.device)
        # None: the conventional path. Otherwise callables with the same signature and results, set through
        # models.region_backends.set_region_backend (network.encode_text, network.step, codec.decode_windows,
        # generation.pick_codes).
        self.nh_encoder_backend: NhEncoderBackend | None = None
        self.nh_decoder_step_backend: Callable[[NhDecoderCache, Sequence[int], torch.Tensor], torch.Tensor] | None = (
            None
        )
        self.dac_chunk_backend: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.nh_sampling_backend: NhSamplingBackend | None = None

    # ---- regions ---------------------------------------------------------------------------

    def region_modules(self) -> dict[str, torch.nn.Module]:
        return nh_region_modules(self.network)

    def executor_region_modules(self) -> dict[str, torch.nn.Module]:
        return {NH_ENCODER: self.network.encoder, DAC_CHUNK: self.codec, NH_SAMPLING: self.network}

    # ---- SpeechModel interface -------------------------------------------------------------

    @property
    def is_random(self) -> bool:
        return self._is_random

    @property
    def open_stream_ids(self) -> tuple[int, ...]:
        return tuple(self._streams)

    def torch_modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.network,)

    def voices(self) -> tuple[VoiceInfo, ...]:
        return tuple(
            VoiceInfo(
                name=name,
                languages=("en",),
                description=(
                    f"speaker tag [{name}]: prepended to text without a speaker tag. Without an audio prompt the "
                    "speaker's voice is drawn anew for each seed; tags in the text choose the speakers of a dialogue"
                ),
            )
            for name in VOICES
        )

    def validate(self, request: SynthesisRequest) -> None:
        self._text_ids(request)
        self._prompt_samples(request)

    def _text_ids(self, request: SynthesisRequest) -> list[int]:
        voice = DEFAULT_VOICE if request.voice is None else request.voice
        if voice not in VOICES:
            raise RequestError(f"voice {request.voice!r} is unknown; NH-TTS voices are {', '.join(VOICES)}")
        if request.language is not None and request.language.lower() not in ("en", "en-us", "english"):
            raise RequestError(f"language {request.language!r}: Dia speaks English only; leave language unset")
        if request.instructions is not None:
            raise RequestError("instructions: NH-TTS has no voice-design control; leave instructions unset")
        text = request.text
        prompt = request.voice_prompt
        if prompt is not None:
            if not prompt.transcript or not prompt.transcript.strip():
                raise RequestError(
                    "voice_prompt.transcript is required: NH-TTS clones a voice by continuing its audio, and the "
                    "text must begin with the prompt's words (with their [S1]/[S2] tags)"
                )
            text = prompt.transcript.strip() + " " + text.strip()
        if not has_speaker_tag(text):
            text = f"[{voice}] " + text.strip()
        ids = encode_text(text)
        if len(ids) > self.max_text_len:
            raise RequestError(
                f"text is too long: {len(ids)} bytes (with the speaker tag and any prompt transcript), the encoder "
                f"holds {self.max_text_len}"
            )
        if any(i == PAD_ID for i in ids):
            raise RequestError("text contains '<pad>' or a NUL byte, which the encoder reads as padding")
        return ids

    def _prompt_samples(self, request: SynthesisRequest) -> np.ndarray | None:
        prompt = request.voice_prompt
        if prompt is None:
            return None
        if prompt.sample_rate_hz != self.sample_rate_hz:
            raise RequestError(
                f"voice_prompt must be sampled at {self.sample_rate_hz} Hz (the DAC's rate), got {prompt.sample_rate_hz} Hz"
            )
        frames = -(-prompt.samples.size // self.codec.hop_length)
        if 1 + frames + self.config.max_delay + 1 > self.max_seq_len:
            raise RequestError(
                f"voice_prompt is too long: {frames} frames; the decoder holds {self.max_seq_len} positions"
            )
        return np.asarray(prompt.samples, dtype=np.float32)

    def encode_prompt_audio(self, samples: np.ndarray) -> torch.Tensor:
        """Prompt audio (S,) at the codec's rate -> codes (T, C), T = ceil(S / hop): the audio is zero-padded
        to whole frames as DiaProcessor's feature extractor does, then DAC-encoded."""
        hop = self.codec.hop_length
        padded = np.zeros(-(-samples.size // hop) * hop, dtype=np.float32)
        padded[: samples.size] = samples
        wav = torch.from_numpy(padded).to(self.device)[None, None]
        with torch.inference_mode():
            codes = self.codec.encode(wav)  # (1, C, T)
        return codes[0].T.contiguous()

    def open_stream(self, request: SynthesisRequest) -> int:
        result = self.open_streams([request])[0]
        if isinstance(result, Exception):
            raise result
        return result

    @torch.no_grad()
    def open_streams(self, requests: Sequence[SynthesisRequest]) -> list[int | Exception]:
        """Every acceptable request's text in one batched encoder call (both guidance rows), its encoder keys and
        values into the cache, then the decoder prefill (one batched call for the streams without an audio
        prompt); a refused request gets its exception and never fails the others."""
        out: list[int | Exception] = []
        accepted: list[tuple[int, list[int], np.ndarray | None]] = []
        for request in requests:
            try:
                ids = self._text_ids(request)
                samples = self._prompt_samples(request)
                if len(self._streams) + len(accepted) >= self.max_streams:
                    raise StreamCapacityError(
                        f"all {self.max_streams} streams are open (max_streams); close or finish one before opening another"
                    )
                accepted.append((len(out), ids, samples))
                out.append(RuntimeError("not admitted"))  # replaced below
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                out.append(exc)
        if not accepted:
            return out
        slots = [self._free_slots.pop(0) for _ in accepted]
        rows = [self._rows(slot) for slot in slots]
        for r in rows:
            self._cache.claim(r)
        try:
            streams = self._start_streams(requests, accepted, slots, rows)
        except Exception as exc:  # noqa: BLE001 - the batched prefill failed: each of its requests fails
            for slot, r in zip(slots, rows):
                self._cache.free(r)
                self._free_slots.append(slot)
            self._free_slots.sort()
            for index, _, _ in accepted:
                out[index] = exc
            return out
        for (index, _, _), stream in zip(accepted, streams):
            stream_id = next(self._next_id)
            self._streams[stream_id] = stream
            out[index] = stream_id
        return out

    def _rows(self, slot: int) -> list[int]:
        return [slot + k * self.max_streams for k in range(self.rows_per_stream)]

    def _start_streams(self, requests, accepted, slots, rows) -> list[_Stream]:
        config = self.config
        # Encoder: conditional rows (the text) and unconditional rows (zeros of the same length and mask, as
        # transformers' generate builds them), right-padded into one batch.
        width = max(len(ids) for _, ids, _ in accepted)
        n = len(accepted)
        input_ids = torch.zeros(n * self.rows_per_stream, width, dtype=torch.long)
        valid = torch.zeros(n * self.rows_per_stream, width, dtype=torch.bool)
        for b, (_, ids, _) in enumerate(accepted):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            for k in range(self.rows_per_stream):
                valid[b + k * n, : len(ids)] = True
        input_ids, valid = input_ids.to(self.device), valid.to(self.device)
        with record_function("tilevox.nh_encoder"):
            encoded = (self.nh_encoder_backend or self.network.encode_text)(input_ids, valid)
        all_rows = [r[k] for k in range(self.rows_per_stream) for r in rows]
        self.network.decoder.write_cross(self._cache, all_rows, encoded, valid)

        streams: list[_Stream] = []
        for (index, _, samples), slot, r in zip(accepted, slots, rows):
            request = requests[index]
            codes = None if samples is None else self.encode_prompt_audio(samples)
            forced = delay_prompt(config, codes, device=self.device)
            prompt_len = 1 + (0 if codes is None else codes.shape[0])
            sampling = request.sampling or self.default_sampling
            budget = math.floor(request.max_duration_s * self.frame_rate_hz + 1e-9)
            room = self.max_seq_len - prompt_len - config.max_delay + 1  # frames whose positions fit the cache
            frames = min(sampling.max_new_tokens, budget, room)
            if frames < 1:
                raise RequestError(
                    f"no room for audio: max_duration_s {request.max_duration_s} and the context of {self.max_seq_len} "
                    f"positions (prompt {prompt_len}) allow {frames} frames"
                )
            # The prefilled positions, and ahead of them the forced prompt entries (non-PAD) that the picks of
            # those positions keep (generation.pick_codes reads them here); every pick writes its position.
            self._sequences[slot].fill_(config.pad_token_id)
            self._sequences[slot, : forced.shape[0]] = forced
            streams.append(
                _Stream(
                    slot=slot,
                    rows=r,
                    params=sampling,
                    generator=make_generator(request.seed, self.device),
                    forced=forced,
                    prompt_len=prompt_len,
                    position=prompt_len,
                    eos_limit=prompt_len + frames,
                    codec=DacStreamDecoder(self.codec, **self._codec_options),
                    frames_pushed=prompt_len,
                )
            )
        # Decoder prefill: all streams without an audio prompt (one BOS frame each) in one call; a prompted
        # stream's delayed prompt on its own.
        step = self.nh_decoder_step_backend or self.network.step
        plain = [s for s in streams if s.prompt_len == 1]
        if plain:
            batch_rows = [s.rows[k] for s in plain for k in range(self.rows_per_stream)]
            codes = torch.full(
                (len(batch_rows), 1, config.num_channels), config.bos_token_id, dtype=torch.long, device=self.device
            )
            with record_function("tilevox.nh_prefill"):
                logits = step(self._cache, batch_rows, codes)
            for i, s in enumerate(plain):
                s.pending = logits[i * self.rows_per_stream : (i + 1) * self.rows_per_stream]
        for s in streams:
            if s.prompt_len == 1:
                continue
            codes = s.forced[: s.prompt_len][None].expand(self.rows_per_stream, -1, -1)
            with record_function("tilevox.nh_prefill"):
                s.pending = step(self._cache, s.rows, codes)
        return streams

    @torch.no_grad()
    def step(self, stream_ids: Sequence[int]) -> list[AudioChunk]:
        ids = list(stream_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"stream ids must be distinct, got {ids}")
        unknown = [i for i in ids if i not in self._streams]
        if unknown:
            raise ValueError(f"stream id(s) {unknown} are not open")
        if not ids:
            return []
        streams = [self._streams[i] for i in ids]
        with record_function("tilevox.sampling"):
            tokens = self._pick(streams)  # (B, C) on the device
        config = self.config
        # Every stream's pick into its sequence in one indexed write (its indices through one pinned copy: no
        # host synchronisation per stream).
        slots = self._device_index([s.slot for s in streams])
        self._sequences[slots, self._device_index([s.position for s in streams])] = tokens
        if self.code_observer is not None:
            for b, (stream_id, s) in enumerate(zip(ids, streams)):
                self.code_observer(stream_id, s.position, tokens[b])
        # Frames that became complete: frame f = position - max_delay, for f in [P, e); undone from the delay
        # (generation.undelay: channel c of frame f at position f + delay[c]) for all of them in one gather.
        pushed: list[tuple[int, int]] = []
        for b, s in enumerate(streams):
            frame = s.position - config.max_delay
            if frame >= s.prompt_len and (s.eos_position is None or frame < s.eos_position):
                pushed.append((b, frame))
                s.frames_pushed = frame + 1
        pushes: list[tuple[int, torch.Tensor]] = []
        if pushed:
            where = self._device_index([(streams[b].slot, frame) for b, frame in pushed])  # (P, 2)
            frames = self._sequences[where[:, :1], where[:, 1:] + self._delays_device, self._channels_device]
            pushes = [(b, frames[i][:, None]) for i, (b, _) in enumerate(pushed)]  # (C, 1) each
        finished: list[int] = []
        going_on: list[int] = []
        for b, s in enumerate(streams):
            if s.eos_position is not None and s.position >= s.eos_position - 1 + config.max_delay:
                finished.append(b)
            else:
                going_on.append(b)
        with record_function("tilevox.dac_chunk"):
            audio = push_many(
                [streams[b].codec for b, _ in pushes],
                [c for _, c in pushes],
                check_range=False,
                decode=self.dac_chunk_backend,
            )
        samples: list[np.ndarray] = [np.zeros(0, dtype=np.float32) for _ in streams]
        counts = [0] * len(streams)
        for (b, _), piece in zip(pushes, audio):
            counts[b] = 1
            if piece is not None:
                samples[b] = piece
        if going_on:
            rows = [streams[b].rows[k] for b in going_on for k in range(self.rows_per_stream)]
            going = tokens if len(going_on) == len(streams) else tokens[self._device_index(going_on)]
            codes = going.repeat_interleave(self.rows_per_stream, dim=0)[:, None, :]
            step = self.nh_decoder_step_backend or self.network.step
            with record_function("tilevox.nh_decoder_step"):
                logits = step(self._cache, rows, codes)  # (B' x rows, C, V)
            for i, b in enumerate(going_on):
                streams[b].pending = logits[i * self.rows_per_stream : (i + 1) * self.rows_per_stream]
                streams[b].position += 1
        chunks: list[AudioChunk] = []
        for b, (stream_id, s) in enumerate(zip(ids, streams)):
            if b in finished:
                tail = s.codec.flush()
                reason = FinishReason.LENGTH if s.eos_by_length else FinishReason.STOP
                chunks.append(AudioChunk(stream_id, np.concatenate([samples[b], tail]), counts[b], reason))
                self._release(stream_id)
            else:
                chunks.append(AudioChunk(stream_id, samples[b], counts[b]))
        return chunks

    def _device_index(self, values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        """Host ints as an int64 tensor on the model's device, through one pinned asynchronous copy on a GPU."""
        pinned = self.device.type == "cuda"
        return torch.tensor(values, dtype=torch.long, pin_memory=pinned).to(self.device, non_blocking=pinned)

    def _pick(self, streams: list[_Stream]) -> torch.Tensor:
        """One delayed position of every channel per stream (B, C), by the rules of models.nh_tts.generation:
        generation.pick_codes, or the nh_sampling backend where one is installed; then the EOS bookkeeping
        from channel 0's best ids (one host sync per step)."""
        eos = self.config.eos_token_id
        pending = torch.stack([s.pending for s in streams]).float()  # (B, rows, C, V)
        rows = NhPickRows(
            params=tuple(s.params for s in streams),
            generators=tuple(s.generator for s in streams),
            seeds=tuple(s.generator.initial_seed() for s in streams),
            slots=tuple(s.slot for s in streams),
            positions=tuple(s.position for s in streams),
            prompt_lens=tuple(s.prompt_len for s in streams),
            forced_lens=tuple(s.forced.shape[0] for s in streams),
            eos_limits=tuple(s.eos_limit for s in streams),
            eos_positions=tuple(-1 if s.eos_position is None else s.eos_position for s in streams),
            guidance_scale=self.guidance_scale,
        )
        tokens, top0 = (self.nh_sampling_backend or self._pick_codes)(pending, self._sequences, rows)
        for b, (s, best) in enumerate(zip(streams, top0.tolist())):
            if eos_started(rows, b, best, eos):
                s.eos_position = s.position
                s.eos_by_length = best != eos
        return tokens

    def _pick_codes(
        self, pending: torch.Tensor, sequences: torch.Tensor, rows: NhPickRows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pick_codes(self.config, pending, sequences, rows)

    def close(self, stream_id: int) -> bool:
        if stream_id not in self._streams:
            return False
        self._release(stream_id)
        return True

    def _release(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id)
        self._cache.free(stream.rows)
        self._free_slots.append(stream.slot)
        self._free_slots.sort()

    # ---- helpers for tests and tools --------------------------------------------------------

    @staticmethod
    def speaker_tags() -> dict[str, int]:
        return dict(SPEAKER_TAGS)
