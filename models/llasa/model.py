"""Llasa TTS: a Llama decoder that writes XCodec2 speech tokens, served through SpeechModel streams.

Each stream owns one KV cache slot, one torch.Generator and one XCodec2 streaming decoder. A step
samples one token per listed stream from its pending logits, turns speech tokens into audio (one
token = one 20 ms XCodec2 frame; every stream's due block in ONE codec call) and runs ONE batched Llama
decode for the streams that go on. Both are launched before the step waits for the codec's samples,
so the host emits audio while the GPU runs the next decode.
Imports: torch, numpy, models.{errors,host_copy,sampling,streaming,region_backends,llama,xcodec2,llasa.tokenizer}.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function

from tilevox.models.cuda_streams import PrefillStream, beside, is_done, join
from tilevox.models.errors import RequestError
from tilevox.models.host_copy import to_device
from tilevox.models.llama.model import LlamaForCausalLM, LlamaKVCache
from tilevox.models.llasa.tokenizer import LlasaTokenizer
from tilevox.models.region_backends import (
    CHUNK_DECODE,
    DECODER_PREFILL,
    DECODER_STEP,
    LLASA_EXECUTOR_REGIONS,
    LLASA_REGIONS,
    TOKEN_SAMPLING,
    ChunkDecodeBackend,
    DecoderPrefillBackend,
    DecoderStepBackend,
    TokenSamplingBackend,
    draw_tokens,
)
from tilevox.models.sampling import SamplingParams, make_generator
from tilevox.models.streaming import AudioChunk, FinishReason, SpeechModel, SynthesisRequest, VoiceInfo
from tilevox.models.xcodec2.model import XCodec2Decoder
from tilevox.models.xcodec2.streaming import XCodec2StreamDecoder, start_push_many

__all__ = ["DEFAULT_VOICE", "LlasaModel", "StreamCapacityError", "llasa_region_modules"]

DEFAULT_VOICE = "default"


class StreamCapacityError(RuntimeError):
    """open_stream was called while all max_streams streams are open."""


@dataclass(slots=True, kw_only=True)
class _Stream:
    slot: int
    params: SamplingParams
    generator: torch.Generator
    pending_logits: torch.Tensor  # (V,) logits of the next token
    generated: torch.Tensor  # (max_new_tokens,) int64 on the model device; [:num_generated] are valid
    num_generated: int
    max_new_tokens: int
    codec: XCodec2StreamDecoder
    prefilled: torch.cuda.Event | None = None  # its prefill on the prefill stream (None: none to wait for)


def llasa_region_modules(llama: LlamaForCausalLM) -> dict[str, torch.nn.Module]:
    """Llasa's regions and the network each one runs (models.region_backends)."""
    return {DECODER_STEP: llama}


class LlasaModel(SpeechModel):
    """Llasa text-to-speech over a batched Llama KV cache and per-stream XCodec2 streaming decoders.

    Args:
        llama: the decoder (vocabulary = text + markers + speech tokens).
        tokenizer: the matching LlasaTokenizer.
        codec: the XCodec2 decoder (16 kHz, 320 samples per speech token).
        model_id: a name for logs ("random:llama-tiny", a checkpoint path).
        max_streams: streams open at once (KV cache slots).
        max_seq_len: prompt + generated tokens per stream (Llasa was trained on 2048).
        is_random: True for random-weight presets.
        token_observer: called as observer(stream_id, token_id) for every sampled token (tracing, tests).
        codec_left_context_frames, codec_lookahead_frames: XCodec2StreamDecoder options (None: its defaults).
    """

    # Regions another executor may run (models.region_backends): the per-step batched decode.
    region_names = LLASA_REGIONS

    executor_region_names = LLASA_EXECUTOR_REGIONS  # token sampling, the batched prefill, the codec's blocks

    @torch.no_grad()
    def warm_up_batches(self, batch_sizes: Sequence[int]) -> None:
        """The chunk-decode backend (when one is installed) at every block window of a stream's first seconds
        (13 to 163 frames with the defaults) and each batch size: zero codes, results dropped."""
        if self.chunk_decode_backend is None:
            return  # the plain path captures nothing
        windows = XCodec2StreamDecoder(self.codec, **self._codec_options).block_window_frames()
        with beside(self.codec_stream, self.device):  # where the steps replay these graphs
            for batch in batch_sizes:
                for frames in windows:
                    codes = torch.zeros(batch, frames, dtype=torch.long, device=self.device)
                    lengths = torch.full((batch,), frames, dtype=torch.long, device=self.device)
                    self.chunk_decode_backend(codes, lengths)
        if self.codec_stream is not None:
            self.codec_stream.synchronize()

    def executor_region_modules(self) -> dict[str, torch.nn.Module]:
        return {TOKEN_SAMPLING: self.llama.lm_head, DECODER_PREFILL: self.llama, CHUNK_DECODE: self.codec}

    def region_modules(self) -> dict[str, torch.nn.Module]:
        return llasa_region_modules(self.llama)

    def __init__(
        self,
        *,
        llama: LlamaForCausalLM,
        tokenizer: LlasaTokenizer,
        codec: XCodec2Decoder,
        model_id: str,
        max_streams: int,
        max_seq_len: int,
        is_random: bool = False,
        token_observer: Callable[[int, int], None] | None = None,
        codec_left_context_frames: int | None = None,
        codec_lookahead_frames: int | None = None,
    ) -> None:
        vocab_size = llama.config.vocab_size
        last_speech_id = tokenizer.speech_offset + tokenizer.num_speech_tokens - 1
        if max(last_speech_id, tokenizer.speech_end_id) >= vocab_size:
            raise ValueError(
                f"the tokenizer's speech tokens (up to id {last_speech_id}) and end token "
                f"({tokenizer.speech_end_id}) must lie inside the model's vocabulary of {vocab_size}"
            )
        if tokenizer.num_speech_tokens > codec.config.codebook_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.num_speech_tokens} speech tokens but the XCodec2 code book only "
                f"{codec.config.codebook_size} codes"
            )
        if codec.device != llama.device:
            raise ValueError(f"llama ({llama.device}) and codec ({codec.device}) must share a device")
        self.llama = llama
        self.tokenizer = tokenizer
        self.codec = codec
        self.model_id = model_id
        self.device = llama.device
        self.sample_rate_hz = codec.sample_rate_hz
        self.frame_rate_hz = codec.sample_rate_hz / codec.hop_samples
        self.max_streams = max_streams
        self.max_seq_len = max_seq_len
        self._is_random = is_random
        self.token_observer = token_observer
        self._codec_options = {
            "left_context_frames": codec_left_context_frames,
            "lookahead_frames": codec_lookahead_frames,
        }
        self._cache: LlamaKVCache = llama.new_cache(max_streams=max_streams, max_seq_len=max_seq_len)
        self._streams: dict[int, _Stream] = {}
        # Each slot's sampled tokens (a stream's `generated` is its slot's row): one scatter per step
        # writes every stream's new token, instead of a copy per stream.
        self._generated = torch.zeros(max_streams, max_seq_len, dtype=torch.long, device=self.device)
        self._next_id = itertools.count(1)
        # Llasa only ever answers with speech tokens then <|SPEECH_GENERATION_END|>, but nothing in the
        # network forbids other ids (text, markers). A text token here has no audio meaning, so every
        # logit outside the speech tokens and the end token is set to -inf before sampling: the
        # sampled distribution is the model's, renormalised over the tokens a TTS answer may contain.
        allowed = torch.full((vocab_size,), float("-inf"), dtype=torch.float32, device=self.device)
        allowed[tokenizer.speech_offset : last_speech_id + 1] = 0.0
        allowed[tokenizer.speech_end_id] = 0.0
        self._logit_mask = allowed
        # None: `llama.decode`. Otherwise a callable with decode's signature and results (e.g. the
        # engine builder's megakernel step), set through models.region_backends.set_region_backend.
        self.decoder_step_backend: DecoderStepBackend | None = None
        self.token_sampling_backend: TokenSamplingBackend | None = None
        self.decoder_prefill_backend: DecoderPrefillBackend | None = None  # llama.prefill_many
        self.chunk_decode_backend: ChunkDecodeBackend | None = None  # codec.decode_windows
        self.prefill_stream: PrefillStream | None = None  # see use_prefill_stream
        self.codec_stream: torch.cuda.Stream | None = None  # see use_codec_stream

    # ---- SpeechModel interface -------------------------------------------------------------

    @property
    def is_random(self) -> bool:
        return self._is_random

    @property
    def open_stream_ids(self) -> tuple[int, ...]:
        return tuple(self._streams)

    def torch_modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.llama,)

    def voices(self) -> tuple[VoiceInfo, ...]:
        return (
            VoiceInfo(
                name=DEFAULT_VOICE,
                languages=("zh", "en"),
                description="Llasa's single voice: a text-only prompt, no speaker conditioning",
            ),
        )

    def validate(self, request: SynthesisRequest) -> None:
        self._prompt_ids(request)

    def _prompt_ids(self, request: SynthesisRequest) -> list[int]:
        if request.voice not in (None, DEFAULT_VOICE):
            raise RequestError(f"voice {request.voice!r} is unknown; Llasa has one voice, {DEFAULT_VOICE!r}")
        if request.language is not None:
            raise RequestError(
                f"language {request.language!r}: Llasa takes the language from the text; leave language unset"
            )
        if request.instructions is not None:
            raise RequestError("instructions: Llasa has no voice-design control; leave instructions unset")
        if request.voice_prompt is not None:
            raise RequestError("voice_prompt: voice cloning is not supported by this Llasa model")
        prompt_ids = self.tokenizer.prompt_ids(request.text)
        if len(prompt_ids) >= self.max_seq_len:
            raise RequestError(
                f"text is too long: its prompt is {len(prompt_ids)} tokens and the context holds {self.max_seq_len} "
                f"(prompt plus at least one speech token)"
            )
        return prompt_ids

    def open_stream(self, request: SynthesisRequest) -> int:
        result = self.open_streams([request])[0]
        if isinstance(result, Exception):
            raise result
        return result

    @property
    def supports_prefill_stream(self) -> bool:
        # Not yet: measured with --prefill-stream on (2026-12-05, H100) the served Llama-1B ran out of memory
        # at 64 streams (the caching allocator keeps each stream's freed blocks apart, so the prefill's
        # workspace came on top of the decode's, beyond what the memory-sized capacity reserves), and with
        # --codec-stream on as well an XCodec2 chunk-decode capture was invalidated. The mechanism stays
        # (use_prefill_stream) for the fix; until then the model says no and the CLI refuses the flag.
        return False

    def use_prefill_stream(self, prefill_stream: PrefillStream | None) -> None:
        self.prefill_stream = prefill_stream  # the prefill samples nothing: no token sampler of its own

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
        """Every acceptable request's prompt in one batched prefill (LlamaForCausalLM.prefill_many); a
        request refused (bad input, no free stream) gets its exception and never fails the others. With a
        prefill stream the prefill runs there (models.cuda_streams), beside the running streams' steps."""
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
        accepted: list[tuple[int, list[int], SamplingParams, int]] = []  # (index, prompt, sampling, max new)
        for request in requests:
            try:
                prompt_ids = self._prompt_ids(request)
                if len(self._streams) + len(accepted) >= self.max_streams:
                    raise StreamCapacityError(
                        f"all {self.max_streams} streams are open (max_streams); close or finish one before "
                        "opening another"
                    )
                max_frames = max(1, math.floor(request.max_duration_s * self.frame_rate_hz + 1e-9))
                # prompt + generated tokens stay within max_seq_len, as transformers' max_length would.
                sampling = request.sampling or SamplingParams()  # Llasa's card has no generation defaults
                max_new = min(sampling.max_new_tokens, max_frames, self.max_seq_len - len(prompt_ids))
                accepted.append((len(out), prompt_ids, sampling, max_new))
                out.append(RuntimeError("not admitted"))  # replaced below
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                out.append(exc)
        if not accepted:
            return out
        slots = [self._cache.allocate() for _ in accepted]
        try:
            prompts = [torch.tensor(p, dtype=torch.long) for _, p, _, _ in accepted]  # host: see prompt_batch
            with record_function("tilevox.prefill"):
                prefill = self.decoder_prefill_backend or self.llama.prefill_many
                logits = prefill(self._cache, slots, prompts)  # (B, V)
        except Exception as exc:  # noqa: BLE001 - the batched prefill failed: each of its requests fails
            for slot in slots:
                self._cache.free(slot)
            for index, _, _, _ in accepted:
                out[index] = exc
            return out
        for row, ((index, _, sampling, max_new), slot) in enumerate(zip(accepted, slots)):
            stream_id = next(self._next_id)
            self._streams[stream_id] = _Stream(
                slot=slot,
                params=sampling,
                generator=make_generator(requests[index].seed, self.device),
                pending_logits=logits[row],
                generated=self._generated[slot, :max_new],
                num_generated=0,
                max_new_tokens=max_new,
                codec=XCodec2StreamDecoder(self.codec, **self._codec_options),
            )
            out[index] = stream_id
        return out

    def step(self, stream_ids: Sequence[int]) -> list[AudioChunk]:
        """See _step; with a prefill stream on the high-priority decode stream (models.cuda_streams)."""
        if self.prefill_stream is None:
            return self._step(stream_ids)
        with self.prefill_stream.decoding():
            return self._step(stream_ids)

    def _step(self, stream_ids: Sequence[int]) -> list[AudioChunk]:
        ids = list(stream_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"stream ids must be distinct, got {ids}")
        unknown = [i for i in ids if i not in self._streams]
        if unknown:
            raise ValueError(f"stream id(s) {unknown} are not open")
        if not ids:
            return []
        streams = [self._streams[i] for i in ids]
        for stream in streams:  # a stream whose prefill may still run: this step waits for it on the device
            join(stream.prefilled, self.device)
            stream.prefilled = None
        with record_function("tilevox.sampling"):
            logits = torch.stack([s.pending_logits for s in streams]).float() + self._logit_mask  # (B, V)
            tokens = draw_tokens(
                self.token_sampling_backend,
                logits,
                [s.params for s in streams],
                [s.generator for s in streams],
                [s.generated[: s.num_generated] for s in streams],
                stop_token_ids=(self.tokenizer.speech_end_id,),
            )  # (B,)
            token_list = tokens.tolist()
        chunks: list[AudioChunk | None] = [None] * len(ids)
        pushed: list[int] = []  # batch rows whose token goes to their codec
        stopped: list[int] = []  # batch rows that drew the end token
        for row, (stream_id, stream, token) in enumerate(zip(ids, streams, token_list)):
            if self.token_observer is not None:
                self.token_observer(stream_id, token)
            if token == self.tokenizer.speech_end_id:
                stopped.append(row)  # its codec's tail is decoded after this step's launches
                continue
            stream.num_generated += 1
            pushed.append(row)
        if pushed:  # each new token into its stream's history, device to device, in one scatter
            where = to_device(
                [(row, streams[row].slot, streams[row].num_generated - 1) for row in pushed],
                dtype=torch.long,
                device=self.device,
            )  # (P, 3): batch row, slot, position
            self._generated[where[:, 1], where[:, 2]] = tokens[where[:, 0]]
        # On the codec stream, if any (models.cuda_streams): beside the decoder step; every codec launch of
        # the step goes there (its flushes too), so the chunk-decode graphs replay on one stream only.
        with record_function("tilevox.codec_decode"), beside(self.codec_stream, self.device):
            # Every stream's due blocks in one decoder call (windows right-padded and masked). The logit
            # mask admits speech tokens (and the end token, handled above) only, so the codes need no
            # range check. Launched now, waited for after the decoder step is launched.
            codes = tokens - self.tokenizer.speech_offset
            pending = start_push_many(
                [streams[row].codec for row in pushed],
                [codes[row : row + 1] for row in pushed],
                check_range=False,
                decode=self.chunk_decode_backend,
            )
        going_on = [row for row in pushed if streams[row].num_generated < streams[row].max_new_tokens]
        if going_on:
            slots = [streams[row].slot for row in going_on]
            decode = self.decoder_step_backend or self.llama.decode
            with record_function("tilevox.decoder_step"):
                going_tokens = tokens if len(going_on) == len(ids) else tokens[going_on]
                next_logits = decode(self._cache, slots, going_tokens)  # (B', V), one batched call
            for out_row, row in enumerate(going_on):
                streams[row].pending_logits = next_logits[out_row]
        for row in stopped:
            chunks[row] = AudioChunk(ids[row], self._flush(streams[row]), 0, FinishReason.STOP)
            self._release(ids[row])
        with record_function("tilevox.codec_wait"):
            audio = pending.finish()
        for row, samples in zip(pushed, audio, strict=True):
            stream_id, stream = ids[row], streams[row]
            if stream.num_generated >= stream.max_new_tokens:
                samples = np.concatenate([samples, self._flush(stream)])
                chunks[row] = AudioChunk(stream_id, samples, 1, FinishReason.LENGTH)
                self._release(stream_id)
                continue
            chunks[row] = AudioChunk(stream_id, samples, 1)
        missing = [ids[row] for row, chunk in enumerate(chunks) if chunk is None]
        if missing:
            raise RuntimeError(f"step produced no chunk for streams {missing}")
        return chunks

    def _flush(self, stream: _Stream) -> np.ndarray:
        with beside(self.codec_stream, self.device):
            return stream.codec.flush(self.chunk_decode_backend)

    def close(self, stream_id: int) -> bool:
        if stream_id not in self._streams:
            return False
        self._release(stream_id)
        return True

    def _release(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id)
        self._cache.free(stream.slot)
