"""Qwen3-TTS as a `SpeechModel`: many streams in KV-cache slots, stepped together one frame at a time.

open_stream builds the dual-track prompt, prefills the stream's slot and samples codebook 0 of
frame 0. step(ids) runs for all listed streams at once: the code predictor (codebooks 1..Q-1),
one batched talker forward (each stream at its own position) sampling the next codebook 0, and
the incremental codec decode: exact (equal to one full decode) by default, or, with
ModelOptions.decode_mode "official_chunked", the official package's decode() of long audio
(300-frame chunks, 25 frames of left context; differs from exact after frame 300 = 24 s). Sampling and stopping follow the official generate() (see
`_sample_talker` and `step`). Imports: torch, numpy, models.*.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function

from tilevox.models.cuda_streams import PrefillStream, beside, is_done, join
from tilevox.models.errors import RequestError
from tilevox.models.host_copy import to_device, to_host
from tilevox.models.qwen3_tts.config import GenerationDefaults, Qwen3TTSConfig, TtsModelType
from tilevox.models.qwen3_tts.layers import CacheView, KVCache
from tilevox.models.qwen3_tts.prompt import PromptSpec, TextLayout, build_layout, embed_layout
from tilevox.models.qwen3_tts.speech_tokenizer.decoder import DecoderState
from tilevox.models.qwen3_tts.talker import Talker
from tilevox.models.qwen3_tts.tokenizer import TextTokenizer
from tilevox.models.region_backends import (
    CODE_PREDICTOR_LOOP,
    CODEC_DECODE,
    QWEN3_TTS_EXECUTOR_REGIONS,
    QWEN3_TTS_REGIONS,
    TALKER_PREFILL,
    TALKER_STEP,
    TOKEN_SAMPLING,
    CodecDecodeBackend,
    CodePredictorLoopBackend,
    PredictorRows,
    TalkerPrefillBackend,
    TalkerStepBackend,
    TokenSamplingBackend,
    draw_tokens,
)
from tilevox.models.sampling import SamplingParams, make_generator, sample_tokens
from tilevox.models.streaming import AudioChunk, FinishReason, SpeechModel, SynthesisRequest, VoiceInfo

__all__ = [
    "DECODE_MODES",
    "FrameObserver",
    "LogitObserver",
    "ModelOptions",
    "Qwen3TTSNetwork",
    "Qwen3TTSSpeechModel",
    "qwen3_tts_region_modules",
]

DECODE_MODES = ("exact", "official_chunked")

# (kind "talker" | "predictor", stream ids, head index (-1 for the talker), logits (B, V))
LogitObserver = Callable[[str, tuple[int, ...], int, torch.Tensor], None]
# (stream id, the Q codes of one emitted frame)
FrameObserver = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelOptions:
    max_streams: int = 8  # KV-cache slots
    max_seq_len: int = 4096  # prompt + generated tokens per slot
    audio_every_frames: int = 1  # decode and return audio every N frames (and at the end)
    text_layout: TextLayout | None = None  # None: the official default (streaming for clones only)
    # "exact": samples equal one full decode of the utterance. "official_chunked": equal to the official
    # qwen-tts decode(), which decodes in 300-frame chunks with 25 frames of left context, so audio past
    # frame 300 (24 s) differs slightly from the exact decode (streams then decode one by one).
    decode_mode: str = "exact"

    def __post_init__(self) -> None:
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {self.decode_mode!r}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.max_seq_len < 16:
            raise ValueError(f"max_seq_len must be >= 16, got {self.max_seq_len}")
        if self.audio_every_frames < 1:
            raise ValueError(f"audio_every_frames must be >= 1, got {self.audio_every_frames}")


class Qwen3TTSNetwork(nn.Module):
    """The weights of `model.safetensors`: `talker.*` and (Base models) `speaker_encoder.*`."""

    def __init__(self, config: Qwen3TTSConfig, speaker_encoder: nn.Module | None = None):
        super().__init__()
        self.talker = Talker(config.talker)
        self.speaker_encoder = speaker_encoder


@dataclass(slots=True)
class _Stream:
    stream_id: int
    slot: int
    position: int  # tokens in the KV cache
    hidden: torch.Tensor  # (H,) talker final-norm state that produced `code0`
    code0: torch.Tensor  # () long, codebook 0 of the pending frame
    trailing_text: torch.Tensor  # (n, H) text-track rows for decode steps 0..n-1
    talker_params: SamplingParams
    predictor_params: SamplingParams
    generator: torch.Generator
    generated: torch.Tensor  # (max_tokens,) long buffer of sampled codebook-0 tokens
    num_generated: int
    max_tokens: int
    decoder_state: object  # official_chunked: its ChunkedDecoderState; exact: None (row `slot` of the codec pool)
    pending_frames: list[torch.Tensor] = field(default_factory=list)  # (Q,) codes awaiting decode
    num_steps: int = 0
    prefilled: torch.cuda.Event | None = None  # its prefill on the prefill stream (None: none to wait for)


@dataclass(slots=True, kw_only=True)
class _Prepared:
    """A request made ready for the batched prefill (prompt embeddings and per-stream state)."""

    prefill: torch.Tensor  # (L, H) prompt embeddings
    trailing: torch.Tensor  # (n, H) text-track rows for decode steps 0..n-1
    talker_params: SamplingParams
    predictor_params: SamplingParams
    seed: int
    max_tokens: int
    decoder_state: object


def qwen3_tts_region_modules(talker: Talker) -> dict[str, nn.Module]:
    """Qwen3-TTS's regions and the network each one runs (models.region_backends)."""
    return {TALKER_STEP: talker, CODE_PREDICTOR_LOOP: talker.code_predictor}


class Qwen3TTSSpeechModel(SpeechModel):
    # Regions another executor may run (models.region_backends): the talker decode step with its codec
    # head, and the whole code-predictor loop of a frame.
    region_names = QWEN3_TTS_REGIONS
    # Regions only an executor runs: the codec decode of a batch of streams' new frames (exact decode
    # mode, from the codec-state pool), the sampling of codebook 0, and the batched talker prefill.
    executor_region_names = QWEN3_TTS_EXECUTOR_REGIONS

    def region_modules(self) -> dict[str, nn.Module]:
        return qwen3_tts_region_modules(self.talker)

    def executor_region_modules(self) -> dict[str, nn.Module]:
        return {CODEC_DECODE: self.codec_decoder, TOKEN_SAMPLING: self.talker.codec_head, TALKER_PREFILL: self.talker}

    def __init__(
        self,
        *,
        model_id: str,
        config: Qwen3TTSConfig,
        network: Qwen3TTSNetwork,
        text_tokenizer: TextTokenizer,
        codec_decoder: nn.Module,
        codec_encoder: nn.Module | None,
        generation: GenerationDefaults,
        sample_rate_hz: int = 24000,
        frame_rate_hz: float = 12.5,
        options: ModelOptions = ModelOptions(),
        is_random: bool = False,
    ):
        self.model_id = model_id
        self.config = config
        if (network.speaker_encoder is not None) != (config.tts_model_type is TtsModelType.BASE):
            raise ValueError("a speaker encoder must be present exactly for Base (voice-clone) models")
        self.network = network.eval()
        self.talker: Talker = network.talker
        self.text_tokenizer = text_tokenizer
        self.codec_decoder = codec_decoder.eval()
        self.codec_encoder = codec_encoder
        self.generation = generation
        self.options = options
        self.sample_rate_hz = sample_rate_hz
        self.frame_rate_hz = frame_rate_hz
        self.max_streams = options.max_streams
        self._is_random = is_random
        param = self.talker.codec_head.weight
        self.device = param.device
        self.dtype = param.dtype
        self.cache: KVCache = self.talker.new_cache(num_slots=options.max_streams, max_len=options.max_seq_len)
        self._free_slots = list(range(options.max_streams))
        # Exact decode mode: every stream's codec state is row `slot` of one pool, so a batch of streams
        # decodes with one gather, one decode and one scatter (a capturable region, CODEC_DECODE).
        self._codec_pool: DecoderState | None = (
            None if options.decode_mode == "official_chunked" else self.codec_decoder.new_state(options.max_streams)
        )
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self.logit_observer: LogitObserver | None = None  # test/debug hooks
        self.frame_observer: FrameObserver | None = None
        # None: the conventional calls (talker.forward_tokens, code_predictor.predict). Otherwise
        # callables with the same results (the engine builder's megakernel), set through
        # models.region_backends.set_region_backend.
        self.talker_step_backend: TalkerStepBackend | None = None
        self.code_predictor_loop_backend: CodePredictorLoopBackend | None = None
        self.codec_decode_backend: CodecDecodeBackend | None = None  # codec_decoder.decode_slots
        self.token_sampling_backend: TokenSamplingBackend | None = None  # sample_tokens of codebook 0
        self.talker_prefill_backend: TalkerPrefillBackend | None = None  # talker.forward_prompts
        self.prefill_stream: PrefillStream | None = None  # see use_prefill_stream
        self.codec_stream: torch.cuda.Stream | None = None  # see use_codec_stream
        tc = config.talker
        self._eos = tc.codec_eos_token_id
        # The official generate() suppresses the top 1024 codec ids except EOS.
        self._suppress = torch.zeros(tc.vocab_size, dtype=torch.bool, device=self.device)
        self._suppress[tc.vocab_size - 1024 :] = True
        self._suppress[self._eos] = False
        with torch.no_grad():
            self._tts_pad_embed = self.talker.embed_text(torch.tensor([config.tts_pad_token_id], device=self.device))[
                0
            ]  # (H,)

    # ---- metadata -------------------------------------------------------------------------

    @property
    def is_random(self) -> bool:
        return self._is_random

    @property
    def open_stream_ids(self) -> tuple[int, ...]:
        return tuple(self._streams)

    def torch_modules(self) -> tuple[nn.Module, ...]:
        return (self.network,)

    def voices(self) -> tuple[VoiceInfo, ...]:
        if self.config.tts_model_type is not TtsModelType.CUSTOM_VOICE:
            return ()
        tc = self.config.talker
        out = []
        for name in tc.speakers:
            dialect = tc.speaker_dialects.get(name)
            desc = f"speaks {dialect} for language chinese/auto" if dialect else ""
            out.append(VoiceInfo(name=name, languages=self.config.languages, description=desc))
        return tuple(out)

    # ---- requests -------------------------------------------------------------------------

    def validate(self, request: SynthesisRequest) -> None:
        self._layout(request)

    def _layout(self, request: SynthesisRequest):
        """(prompt spec, prompt layout) of a valid request; RequestError if its prompt exceeds the context."""
        spec = self._prompt_spec(request)
        layout = build_layout(spec, self.config, self.text_tokenizer)
        if len(layout) + 1 > self.options.max_seq_len:
            raise RequestError(
                f"text too long: the prompt has {len(layout)} positions, this model holds {self.options.max_seq_len}"
            )
        return spec, layout

    def _prompt_spec(self, request: SynthesisRequest) -> PromptSpec:
        kind = self.config.tts_model_type
        language = "auto" if request.language is None else request.language.lower()
        if language != "auto" and language not in self.config.languages:
            raise RequestError(
                f"language {request.language!r} is not supported; choose auto or one of "
                f"{', '.join(self.config.languages)}"
            )
        if request.instructions is not None and not self.config.supports_instructions:
            raise RequestError(
                f"instructions are not supported by this {kind.value} model ({self.config.tts_model_size})"
            )
        if request.voice_prompt is not None and kind is not TtsModelType.BASE:
            raise RequestError(f"voice_prompt (voice cloning) needs a Base model; this is a {kind.value} model")
        speaker = None
        if kind is TtsModelType.CUSTOM_VOICE:
            speakers = list(self.config.talker.speakers)
            speaker = (request.voice or speakers[0]).lower()
            if speaker not in self.config.talker.speakers:
                raise RequestError(f"voice {request.voice!r} is not one of: {', '.join(speakers)}")
        elif request.voice is not None:
            raise RequestError(f"voice names are only for CustomVoice models; this is a {kind.value} model")
        ref_text = None
        if kind is TtsModelType.BASE:
            prompt = request.voice_prompt
            if prompt is None:
                raise RequestError("a Base (voice-clone) model needs voice_prompt reference audio")
            if prompt.sample_rate_hz != self.sample_rate_hz:
                raise RequestError(
                    f"voice_prompt must be sampled at {self.sample_rate_hz} Hz, got {prompt.sample_rate_hz} Hz"
                )
            ref_text = prompt.transcript
            if ref_text is not None and not ref_text.strip():
                raise RequestError("voice_prompt.transcript is empty; pass None for x-vector-only cloning")
        layout = self.options.text_layout
        if layout is None:
            layout = TextLayout.STREAMING if kind is TtsModelType.BASE else TextLayout.NON_STREAMING
        num_ref_frames = 0
        if ref_text is not None:
            samples_per_frame = round(self.sample_rate_hz / self.frame_rate_hz)
            num_ref_frames = -(-request.voice_prompt.samples.size // samples_per_frame)
        return PromptSpec(
            text=request.text,
            language=language,
            speaker=speaker,
            instructions=request.instructions or None,
            speaker_vector=kind is TtsModelType.BASE,
            ref_text=ref_text,
            num_ref_frames=num_ref_frames,
            layout=layout,
        )

    def _sampling(self, request: SynthesisRequest) -> tuple[SamplingParams, SamplingParams]:
        g = self.generation
        if request.sampling is None:  # not chosen by the caller: generation_config.json
            talker = SamplingParams(
                temperature=g.temperature if g.do_sample else 0.0,
                top_k=g.top_k,
                top_p=g.top_p,
                repetition_penalty=g.repetition_penalty,
                max_new_tokens=g.max_new_tokens,
                min_new_tokens=min(g.min_new_tokens, g.max_new_tokens),
            )
        else:
            s = request.sampling
            # EOS is blocked for the first 2 tokens upstream (capped so that min <= max stays valid).
            talker = replace(s, min_new_tokens=min(max(s.min_new_tokens, g.min_new_tokens), s.max_new_tokens))
        if talker.is_greedy or not g.subtalker_dosample:
            predictor = SamplingParams.greedy()
        else:
            predictor = SamplingParams(
                temperature=g.subtalker_temperature, top_k=g.subtalker_top_k, top_p=g.subtalker_top_p
            )
        return talker, predictor

    @torch.no_grad()
    def open_stream(self, request: SynthesisRequest) -> int:
        result = self.open_streams([request])[0]
        if isinstance(result, Exception):
            raise result
        return result

    @property
    def supports_prefill_stream(self) -> bool:
        return True

    def use_prefill_stream(self, prefill_stream: PrefillStream | None) -> None:
        self.prefill_stream = prefill_stream

    @property
    def supports_codec_stream(self) -> bool:
        return True

    def use_codec_stream(self, codec_stream: torch.cuda.Stream | None) -> None:
        self.codec_stream = codec_stream

    def is_ready(self, stream_id: int) -> bool:
        stream = self._streams.get(stream_id)
        return stream is None or is_done(stream.prefilled)  # not open: nothing to wait for (step() says why)

    @torch.no_grad()
    def open_streams(self, requests: Sequence[SynthesisRequest]) -> list[int | Exception]:
        """Prepare each request (prompt layout, voice, codec state), then run every prompt in one batched
        talker prefill (right-padded to the longest; padding sits after each row's prompt, so causal
        attention keeps it out of the prompt, and decode overwrites it before any step can read it).
        With a prefill stream all of it runs there (models.cuda_streams), beside the running streams' steps."""
        if self.prefill_stream is None:
            return self._open_streams(requests)
        with self.prefill_stream.launch():
            out = self._open_streams(requests)
            ready = self.prefill_stream.ready()
        for result in out:
            if not isinstance(result, Exception):
                self._streams[result].prefilled = ready
        return out

    def _open_streams(self, requests: Sequence[SynthesisRequest]) -> list[int | Exception]:
        out: list[int | Exception] = []
        prepared: list[tuple[int, _Prepared]] = []
        for index, request in enumerate(requests):
            try:
                if len(prepared) >= len(self._free_slots):
                    raise RuntimeError(f"all {self.max_streams} stream slots are in use; close a stream first")
                prepared.append((index, self._prepare(request)))
                out.append(RuntimeError("not admitted"))  # replaced below
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                out.append(exc)
        if prepared:
            try:
                admitted: list[int | Exception] = list(self._admit([p for _, p in prepared]))
            except Exception as exc:  # noqa: BLE001 - the batched prefill failed: each of its requests fails
                admitted = [exc] * len(prepared)
            for (index, _), result in zip(prepared, admitted, strict=True):
                out[index] = result
        return out

    def _prepare(self, request: SynthesisRequest) -> _Prepared:
        spec, layout = self._layout(request)
        talker_params, predictor_params = self._sampling(request)
        speaker_vector = ref_codes = None
        chunked = self.options.decode_mode == "official_chunked"
        decoder_state = self.codec_decoder.new_chunked_state(1) if chunked else self.codec_decoder.new_state(1)
        if spec.speaker_vector:
            wav = torch.as_tensor(np.asarray(request.voice_prompt.samples, dtype=np.float32), device=self.device)
            speaker_vector = self.network.speaker_encoder.embed(wav.to(self.dtype))
            if spec.ref_text is not None:
                if self.codec_encoder is None:
                    raise RequestError(
                        "in-context cloning (a voice_prompt transcript) needs the speech-tokenizer encoder"
                    )
                ref_codes = self.codec_encoder.encode(wav[None].to(self.dtype))[0].T  # (T_ref, Q)
                if ref_codes.shape[0] != spec.num_ref_frames:
                    raise RuntimeError(f"encoder gave {ref_codes.shape[0]} frames, expected {spec.num_ref_frames}")
                # Prime the decoder with the reference frames: upstream decodes ref + generated codes
                # together and cuts the reference part off, so generated audio sees them as context.
                ref = ref_codes.T[None].to(self.device)
                if chunked:  # the reference frames count toward the official chunk boundaries, as upstream
                    self.codec_decoder.decode_incremental_chunked(ref, decoder_state)
                else:
                    self.codec_decoder.decode_incremental(ref, decoder_state)
        prefill = embed_layout(layout, self.talker, speaker_vector=speaker_vector, ref_codes=ref_codes)
        trailing = (
            self.talker.embed_text(to_device(layout.trailing_text_ids, dtype=torch.long, device=self.device))
            if layout.trailing_text_ids
            else prefill.new_zeros(0, prefill.shape[1])
        )
        # Codebook-0 tokens: duration limit in frames, +1 because upstream discards the token that
        # hits max_new_tokens; and the slot must hold prompt + every fed-back token.
        max_frames = int(request.max_duration_s * self.frame_rate_hz)
        max_tokens = min(talker_params.max_new_tokens, max_frames + 1, self.options.max_seq_len - len(layout) + 1)
        return _Prepared(
            prefill=prefill,
            trailing=trailing,
            talker_params=talker_params,
            predictor_params=predictor_params,
            seed=request.seed,
            max_tokens=max_tokens,
            decoder_state=decoder_state,
        )

    def _admit(self, prepared: Sequence[_Prepared]) -> list[int]:
        """One talker prefill for all prepared requests; each gets a slot and its first codebook-0 token."""
        slots = [self._free_slots.pop(0) for _ in prepared]
        try:
            lengths = [p.prefill.shape[0] for p in prepared]
            longest = max(lengths)
            width, dtype = prepared[0].prefill.shape[1], prepared[0].prefill.dtype
            inputs = torch.zeros(len(prepared), longest, width, dtype=dtype, device=self.device)
            for row, p in enumerate(prepared):
                inputs[row, : lengths[row]] = p.prefill
            view = CacheView(
                cache=self.cache,
                slots=to_device(slots, dtype=torch.long, device=self.device),
                start=torch.zeros(len(prepared), dtype=torch.long, device=self.device),
                kv_len=longest,
                write_offset=0,
            )
            prefill = self.talker_prefill_backend or self.talker.forward_prompts
            with record_function("tilevox.prefill"):
                hidden, logits = prefill(inputs, view, to_device(lengths, dtype=torch.long, device=self.device) - 1)
            streams = []
            for row, (p, slot) in enumerate(zip(prepared, slots)):
                streams.append(
                    _Stream(
                        stream_id=next(self._ids),
                        slot=slot,
                        position=lengths[row],
                        hidden=hidden[row],
                        code0=torch.zeros((), dtype=torch.long, device=self.device),
                        trailing_text=p.trailing,
                        talker_params=p.talker_params,
                        predictor_params=p.predictor_params,
                        generator=make_generator(p.seed, self.device),
                        generated=torch.zeros(max(p.max_tokens, 1), dtype=torch.long, device=self.device),
                        num_generated=0,
                        max_tokens=p.max_tokens,
                        decoder_state=p.decoder_state,
                    )
                )
            if self._codec_pool is not None:  # each stream's fresh (or voice-primed) codec state into its row
                self._codec_pool.put(view.slots, DecoderState.cat([p.decoder_state for p in prepared]))
                for stream in streams:
                    stream.decoder_state = None
            first = self._sample_talker(streams, logits)
        except BaseException:
            self._free_slots = sorted(self._free_slots + slots)
            raise
        for stream, code0 in zip(streams, first):
            stream.code0 = code0
            self._streams[stream.stream_id] = stream
        return [s.stream_id for s in streams]

    def close(self, stream_id: int) -> bool:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return False
        self._free_slots.append(stream.slot)
        self._free_slots.sort()
        return True

    # ---- stepping -------------------------------------------------------------------------

    def _observe(self, kind: str, streams: Sequence[_Stream], head: int, logits: torch.Tensor) -> None:
        if self.logit_observer is not None:
            self.logit_observer(kind, tuple(s.stream_id for s in streams), head, logits.detach().clone())

    def _sample_talker(self, streams: Sequence[_Stream], logits: torch.Tensor) -> torch.Tensor:
        """Sample codebook 0 for each stream, record it, and return (B,) long.

        As the official generate(): ids [vocab-1024, vocab) except EOS are suppressed, EOS is
        blocked for the first min_new_tokens (2) tokens, and the repetition penalty covers the
        stream's generated codebook-0 tokens (the prompt is embeddings, so nothing else)."""
        self._observe("talker", streams, -1, logits)
        logits = logits.float().masked_fill(self._suppress, float("-inf"))
        tokens = draw_tokens(
            self._token_sampler(),
            logits,
            [s.talker_params for s in streams],
            [s.generator for s in streams],
            [s.generated[: s.num_generated] for s in streams],
            stop_token_ids=(self._eos,),
        )
        for row, s in enumerate(streams):
            s.generated[s.num_generated] = tokens[row]
            s.num_generated += 1
        return tokens

    def _token_sampler(self) -> TokenSamplingBackend | None:
        """The token-sampling backend for work on the current stream: on the prefill stream its own, since
        graph backends never replay on two streams at once (models.cuda_streams)."""
        if self.prefill_stream is not None and torch.cuda.current_stream(self.device) == self.prefill_stream.stream:
            return self.prefill_stream.token_sampling_backend
        return self.token_sampling_backend

    def _predictor_chooser(self, streams: Sequence[_Stream]) -> Callable[[int, torch.Tensor], torch.Tensor]:
        params = [s.predictor_params for s in streams]
        generators = [s.generator for s in streams]
        empty = [torch.zeros(0, dtype=torch.long, device=self.device)] * len(streams)

        def choose(head: int, logits: torch.Tensor) -> torch.Tensor:
            self._observe("predictor", streams, head, logits)
            if all(p.is_greedy for p in params):
                return torch.argmax(logits.float(), dim=-1)
            return sample_tokens(logits, params, generators, empty)

        return choose

    @torch.no_grad()
    def step(self, stream_ids: Sequence[int]) -> list[AudioChunk]:
        """See _step; with a prefill stream on the high-priority decode stream (models.cuda_streams)."""
        if self.prefill_stream is None:
            return self._step(stream_ids)
        with self.prefill_stream.decoding():
            return self._step(stream_ids)

    def _step(self, stream_ids: Sequence[int]) -> list[AudioChunk]:
        """One frame for every listed stream. A stream stops when EOS is sampled (the EOS frame is
        not emitted) or after max_new_tokens codebook-0 tokens (the last one is discarded, as
        upstream). The code predictor samples without repetition penalty, from its own params."""
        if len(set(stream_ids)) != len(stream_ids):
            raise ValueError(f"stream ids must be unique, got {list(stream_ids)}")
        missing = [i for i in stream_ids if i not in self._streams]
        if missing:
            raise ValueError(f"streams {missing} are not open")
        if not stream_ids:
            return []
        # A stream whose pending token already reached its limit (max_new_tokens 1, or a duration
        # under one frame) ends with no frame, as upstream returns none for it.
        spent = {i for i in stream_ids if self._streams[i].num_generated >= self._streams[i].max_tokens}
        streams = [self._streams[i] for i in stream_ids if i not in spent]
        if not streams:
            return [self._finish_empty(i) for i in stream_ids]
        for s in streams:  # a stream whose prefill may still run: this step waits for it on the device
            join(s.prefilled, self.device)
            s.prefilled = None
        hidden = torch.stack([s.hidden for s in streams])  # (B, H)
        code0 = torch.stack([s.code0 for s in streams])  # (B,)
        code0_embedding, choose = self.talker.embed_codec(code0), self._predictor_chooser(streams)
        with record_function("tilevox.code_predictor_loop"):
            if self.code_predictor_loop_backend is None:
                rest = self.talker.code_predictor.predict(hidden, code0_embedding, choose)  # (B, Q-1)
            else:
                # A backend that samples on the device draws from (stream seed, frame x heads + head): see
                # PredictorRows. The streams' torch generators are then not advanced by predictor draws.
                heads = self.talker.code_predictor.num_steps
                rows = PredictorRows(
                    params=tuple(s.predictor_params for s in streams),
                    seeds=tuple(s.generator.initial_seed() for s in streams),
                    rng_offsets=tuple(s.num_steps * heads for s in streams),
                )
                rest = self.code_predictor_loop_backend(hidden, code0_embedding, choose, rows)
        frames = torch.cat((code0[:, None], rest), dim=1)  # (B, Q)
        for row, s in enumerate(streams):
            s.pending_frames.append(frames[row])
            if self.frame_observer is not None:
                self.frame_observer(s.stream_id, frames[row].clone())
        # With audio every frame (the default, exact decode) every stream decodes its new frame whatever it
        # samples next: launched now, ahead of the talker step, and read after the step's one wait.
        decode_now = self.options.audio_every_frames == 1 and self.options.decode_mode == "exact"
        launched = []
        if decode_now:  # on the codec stream, if any: beside the talker step (models.cuda_streams)
            with record_function("tilevox.codec_decode"), beside(self.codec_stream, self.device):
                launched = self._launch_decode(streams)
        text_rows = torch.stack(
            [
                s.trailing_text[s.num_steps] if s.num_steps < s.trailing_text.shape[0] else self._tts_pad_embed
                for s in streams
            ]
        )  # (B, H)
        inputs = self.talker.embed_frame(frames) + text_rows  # (B, H)
        start = to_device([s.position for s in streams], dtype=torch.long, device=self.device)
        view = CacheView(
            cache=self.cache,
            slots=to_device([s.slot for s in streams], dtype=torch.long, device=self.device),
            start=start,
            kv_len=max(s.position for s in streams) + 1,
        )
        forward = self.talker_step_backend or self.talker.forward_tokens
        with record_function("tilevox.talker_step"):
            new_hidden, logits = forward(inputs[:, None], view)
        with record_function("tilevox.talker_sampling"):
            next_code0 = self._sample_talker(streams, logits)
            eos_host = to_host(next_code0 == self._eos)
        with record_function("tilevox.host_wait"):  # the step's one wait: EOS flags and the new samples
            _synchronize(self.device)
            if decode_now and self.codec_stream is not None:
                self.codec_stream.synchronize()
        is_eos = eos_host.tolist()

        finish: list[FinishReason | None] = []
        for row, s in enumerate(streams):
            s.hidden = new_hidden[row]
            s.code0 = next_code0[row]
            s.position += 1
            s.num_steps += 1
            if is_eos[row]:
                finish.append(FinishReason.STOP)
            elif s.num_generated >= s.max_tokens:
                finish.append(FinishReason.LENGTH)
            else:
                finish.append(None)
        if not decode_now:
            with record_function("tilevox.codec_decode"):
                launched = self._launch_decode(
                    [
                        s
                        for s, f in zip(streams, finish)
                        if f is not None or len(s.pending_frames) >= self.options.audio_every_frames
                    ]
                )
                _synchronize(self.device)
        audio = self._collect(launched)
        chunks = {}
        for s, f in zip(streams, finish):
            samples = audio.get(s.stream_id, np.zeros(0, dtype=np.float32))
            chunks[s.stream_id] = AudioChunk(stream_id=s.stream_id, samples=samples, num_new_frames=1, finish_reason=f)
            if f is not None:
                self.close(s.stream_id)
        return [chunks[i] if i not in spent else self._finish_empty(i) for i in stream_ids]

    def _finish_empty(self, stream_id: int) -> AudioChunk:
        self.close(stream_id)
        empty = np.zeros(0, dtype=np.float32)
        return AudioChunk(stream_id=stream_id, samples=empty, num_new_frames=0, finish_reason=FinishReason.LENGTH)

    def _launch_decode(self, streams: Sequence[_Stream]) -> list[tuple[list[_Stream], torch.Tensor]]:
        """Launch the incremental decode of each stream's pending frames: (streams, their samples) per call,
        the samples a host copy valid once the device is synchronised (see _collect). Exact mode: streams
        with the same number of pending frames decode as one batch from their rows of the codec-state pool
        (the codec_decode region); official_chunked: one stream at a time (ChunkedDecoderState)."""
        launched: list[tuple[list[_Stream], torch.Tensor]] = []
        by_count: dict[int, list[_Stream]] = {}
        for s in streams:
            if s.pending_frames:
                by_count.setdefault(len(s.pending_frames), []).append(s)
        if self.options.decode_mode == "official_chunked":  # per stream: chunk boundaries differ between streams
            groups = [[s] for s in streams if s.pending_frames]
        else:
            groups = list(by_count.values())
        for group in groups:
            codes = torch.stack([torch.stack(s.pending_frames, dim=1) for s in group])  # (B, Q, n)
            if self.options.decode_mode == "official_chunked":
                wav = self.codec_decoder.decode_incremental_chunked(codes, group[0].decoder_state)
            else:
                slots = to_device([s.slot for s in group], dtype=torch.long, device=self.device)
                decode = self.codec_decode_backend or self.codec_decoder.decode_slots
                wav = decode(codes, self._codec_pool, slots)
            launched.append((group, to_host(wav.float())))
            for s in group:
                s.pending_frames = []
        return launched

    @staticmethod
    def _collect(launched: list[tuple[list[_Stream], torch.Tensor]]) -> dict[int, np.ndarray]:
        """Stream id -> its samples, from _launch_decode's host copies (after a synchronisation)."""
        out: dict[int, np.ndarray] = {}
        for group, wav in launched:
            samples = wav.numpy()
            for row, s in enumerate(group):
                out[s.stream_id] = samples[row]
        return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
