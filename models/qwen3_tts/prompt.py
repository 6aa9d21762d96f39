"""The dual-track prompt layout of Qwen3-TTS (text track + codec track summed per position).

`build_layout` turns one request into ids per prefill position as the official generate() does
(docs/qwen3-tts.md §3.1): instruction rows, role prefix, codec control prefix (think/language or
nothink, speaker slot, pad), then the streaming-text tail (first text token + codec BOS, the rest
trailing one token per frame), the non-streaming tail (all text + codec PAD, then BOS), or the
ICL block (transcripts zipped with reference codes). `embed_layout` embeds a layout. Imports: torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from tilevox.models.errors import RequestError
from tilevox.models.host_copy import to_device
from tilevox.models.qwen3_tts.config import Qwen3TTSConfig
from tilevox.models.qwen3_tts.tokenizer import TextTokenizer

__all__ = ["SPEAKER_VECTOR", "PromptLayout", "PromptSpec", "TextLayout", "build_layout", "embed_layout", "ref_frame"]

# Codec-track markers besides plain codec ids (>= 0): the x-vector slot, and reference frame k
# (ICL), encoded as -(2 + k).
SPEAKER_VECTOR = -1


def ref_frame(k: int) -> int:
    return -(2 + k)


class TextLayout(enum.Enum):
    STREAMING = "streaming"  # text trails one token per frame (official non_streaming_mode=False)
    NON_STREAMING = "non_streaming"  # whole text in the prefill (official non_streaming_mode=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptSpec:
    text: str
    language: str = "auto"  # lower-case language name or "auto"
    speaker: str | None = None  # CustomVoice speaker name (lower case)
    instructions: str | None = None
    speaker_vector: bool = False  # Base: the x-vector fills the speaker slot
    ref_text: str | None = None  # Base ICL mode: the reference transcript...
    num_ref_frames: int = 0  # ...and the number of reference frames
    layout: TextLayout = TextLayout.STREAMING

    def __post_init__(self) -> None:
        if self.speaker is not None and self.speaker_vector:
            raise ValueError("a prompt has either a named speaker or a speaker vector, not both")
        if (self.ref_text is None) != (self.num_ref_frames == 0):
            raise ValueError("ICL prompts need both ref_text and num_ref_frames > 0")
        if self.ref_text is not None and not self.speaker_vector:
            raise ValueError("ICL prompts carry the speaker vector too")


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """text_ids[p]: text-track token at prefill position p (None: no text track there);
    codec_ids[p]: codec id, SPEAKER_VECTOR, ref_frame(k), or None; trailing_text_ids: text
    tokens added to decode steps 0, 1, ... (then tts_pad)."""

    text_ids: tuple[int | None, ...]
    codec_ids: tuple[int | None, ...]
    trailing_text_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.text_ids)


def _assistant_ids(tokenizer: TextTokenizer, text: str, tail: int) -> list[int]:
    return tokenizer.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n" + ("<|im_start|>assistant\n" if tail else ""))


def build_layout(spec: PromptSpec, config: Qwen3TTSConfig, tokenizer: TextTokenizer) -> PromptLayout:
    tc = config.talker
    text_rows: list[int | None] = []
    codec_rows: list[int | None] = []
    if spec.instructions:
        instruct_ids = tokenizer.encode(f"<|im_start|>user\n{spec.instructions}<|im_end|>\n")
        text_rows += instruct_ids
        codec_rows += [None] * len(instruct_ids)

    ids = _assistant_ids(tokenizer, spec.text, tail=1)
    # The official code slices ids[:3] (role) and ids[3:-5] (text): the role and tail must be
    # exactly 3 and 5 tokens, which holds when "assistant" and "\n" are single tokens.
    text_ids = ids[3:-5]
    if len(ids) < 9 or ids[0] != config.im_start_token_id or not text_ids:
        raise RequestError(f"text tokenizes to an unexpected prompt ({len(ids)} ids); it must be non-empty")
    text_rows += ids[:3]
    codec_rows += [None, None, None]

    language = spec.language.lower()
    if language == "auto":
        language_id = None
    elif language in tc.languages:
        language_id = tc.languages[language]
    else:
        raise RequestError(f"language {spec.language!r} is not supported")
    if spec.speaker is not None and language in ("chinese", "auto"):
        dialect = tc.speaker_dialects.get(spec.speaker)
        if dialect is not None:
            language_id = tc.languages[dialect]
    if language_id is None:
        codec_prefix = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    else:
        codec_prefix = [tc.codec_think_id, tc.codec_think_bos_id, language_id, tc.codec_think_eos_id]
    if spec.speaker is not None:
        if spec.speaker not in tc.speakers:
            raise RequestError(f"voice {spec.speaker!r} is not one of this model's speakers")
        codec_prefix.append(tc.speakers[spec.speaker])
    elif spec.speaker_vector:
        codec_prefix.append(SPEAKER_VECTOR)
    codec_prefix += [tc.codec_pad_id, tc.codec_bos_id]
    # Control rows: text track tts_pad ... tts_bos over the codec prefix minus its final BOS.
    text_rows += [config.tts_pad_token_id] * (len(codec_prefix) - 2) + [config.tts_bos_token_id]
    codec_rows += codec_prefix[:-1]

    trailing: list[int] = []
    if spec.ref_text is not None:
        ref_ids = _assistant_ids(tokenizer, spec.ref_text, tail=0)[3:-2]
        icl_text = ref_ids + text_ids + [config.tts_eos_token_id]
        icl_codec = [tc.codec_bos_id] + [ref_frame(k) for k in range(spec.num_ref_frames)]
        if spec.layout is TextLayout.NON_STREAMING:
            text_rows += icl_text + [config.tts_pad_token_id] * len(icl_codec)
            codec_rows += [tc.codec_pad_id] * len(icl_text) + icl_codec
        elif len(icl_text) > len(icl_codec):
            text_rows += icl_text[: len(icl_codec)]
            codec_rows += icl_codec
            trailing = icl_text[len(icl_codec) :]
        else:
            text_rows += icl_text + [config.tts_pad_token_id] * (len(icl_codec) - len(icl_text))
            codec_rows += icl_codec
    elif spec.layout is TextLayout.NON_STREAMING:
        all_text = text_ids + [config.tts_eos_token_id]
        text_rows += all_text + [config.tts_pad_token_id]
        codec_rows += [tc.codec_pad_id] * len(all_text) + [tc.codec_bos_id]
    else:
        text_rows.append(text_ids[0])
        codec_rows.append(tc.codec_bos_id)
        trailing = text_ids[1:] + [config.tts_eos_token_id]
    return PromptLayout(tuple(text_rows), tuple(codec_rows), tuple(trailing))


@torch.no_grad()
def embed_layout(
    layout: PromptLayout,
    talker,
    *,
    speaker_vector: torch.Tensor | None = None,
    ref_codes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Layout -> talker prefill embeddings (P, H). `speaker_vector` (H,) fills SPEAKER_VECTOR;
    `ref_codes` (T_ref, Q) give reference frame k as the sum of its Q code embeddings."""
    device = talker.codec_head.weight.device
    hidden_size = talker.codec_head.weight.shape[1]
    text_pos = [p for p, t in enumerate(layout.text_ids) if t is not None]
    rows = torch.zeros(len(layout), hidden_size, device=device, dtype=talker.codec_head.weight.dtype)
    # Ids and positions reach the device through pinned asynchronous copies: no host synchronisation, so
    # that a prefill on its own stream (models.cuda_streams) never waits for the work queued before it.
    if text_pos:
        ids = to_device([layout.text_ids[p] for p in text_pos], dtype=torch.long, device=device)
        where = to_device(text_pos, dtype=torch.long, device=device)
        rows.index_put_((where,), talker.embed_text(ids))
    codec_pos = [p for p, c in enumerate(layout.codec_ids) if c is not None and c >= 0]
    if codec_pos:
        ids = to_device([layout.codec_ids[p] for p in codec_pos], dtype=torch.long, device=device)
        where = to_device(codec_pos, dtype=torch.long, device=device)
        rows.index_put_((where,), rows.index_select(0, where) + talker.embed_codec(ids))
    for p, c in enumerate(layout.codec_ids):
        if c is None or c >= 0:
            continue
        if c == SPEAKER_VECTOR:
            if speaker_vector is None:
                raise ValueError("the layout has a speaker slot but no speaker vector was given")
            rows[p] += speaker_vector.to(rows.dtype)
        else:
            if ref_codes is None:
                raise ValueError("the layout has reference frames but no reference codes were given")
            rows[p] += talker.embed_frame(ref_codes[-c - 2].to(device))
    return rows
