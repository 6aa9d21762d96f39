"""Llasa's tokenizer: Llama 3 text tokens, 8 task markers and the XCodec2 speech tokens <|s_0|>...

Llasa-1B (HKUSTAudio/Llasa-1B) extends Llama-3.2-1B-Instruct's 128,256 tokens with the markers
<|TEXT_GENERATION_START|> ... <|SPEECH_UNDERSTANDING_END|> (ids 128256-128263) and 65,536 speech
tokens (ids 128264-193799). The prompt is the model card's chat: user "Convert the text to speech:"
+ text in TEXT_UNDERSTANDING markers, assistant turn opened with <|SPEECH_GENERATION_START|>.
`build_random_tokenizer` makes a deterministic byte-level stand-in for random presets.
Imports: tokenizers, models.errors.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tilevox.models.errors import CheckpointError, RequestError

__all__ = ["LLASA_MARKERS", "LlasaTokenizer", "build_random_tokenizer"]

LLASA_MARKERS = (
    "<|TEXT_GENERATION_START|>",
    "<|TEXT_GENERATION_END|>",
    "<|TEXT_UNDERSTANDING_START|>",
    "<|TEXT_UNDERSTANDING_END|>",
    "<|SPEECH_GENERATION_START|>",
    "<|SPEECH_GENERATION_END|>",
    "<|SPEECH_UNDERSTANDING_START|>",
    "<|SPEECH_UNDERSTANDING_END|>",
)
_LLAMA_CHAT_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# Llama 3.2's chat template stamps "Today Date" with strftime_now, i.e. the day it runs; a fixed date
# (the template's own fallback) keeps prompts, and so seeded outputs, identical from day to day.
CHAT_DATE = "26 Jul 2024"
# The Llama 3.2 Instruct chat template rendered for the model card's two messages with
# continue_final_message=True (so the assistant turn stays open after SPEECH_GENERATION_START).
_PROMPT_PREFIX = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    f"Cutting Knowledge Date: December 2023\nToday Date: {CHAT_DATE}\n\n<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nConvert the text to speech:<|TEXT_UNDERSTANDING_START|>"
)
_PROMPT_SUFFIX = (
    "<|TEXT_UNDERSTANDING_END|><|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<|SPEECH_GENERATION_START|>"
)
_MAX_SPEECH_TOKENS = 1 << 20


def speech_token(code: int) -> str:
    return f"<|s_{code}|>"


class LlasaTokenizer:
    """Wraps a `tokenizers.Tokenizer` that holds the Llama chat tokens, Llasa markers and speech tokens.

    Speech code c is token id `speech_offset + c` for c in [0, num_speech_tokens)."""

    def __init__(self, tokenizer: Tokenizer, *, source: str = "tokenizer") -> None:
        self._tokenizer = tokenizer
        self.source = source
        ids = {}
        for token in _LLAMA_CHAT_TOKENS + LLASA_MARKERS + (speech_token(0),):
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise CheckpointError(f"{source}: token {token!r} is missing (not a Llasa tokenizer)")
            ids[token] = token_id
        self.speech_offset = ids[speech_token(0)]
        count = 0
        while count < _MAX_SPEECH_TOKENS:
            token_id = tokenizer.token_to_id(speech_token(count))
            if token_id is None:
                break
            if token_id != self.speech_offset + count:
                raise CheckpointError(
                    f"{source}: speech tokens are not contiguous: {speech_token(count)} has id {token_id}, "
                    f"expected {self.speech_offset + count}"
                )
            count += 1
        self.num_speech_tokens = count
        self.speech_start_id = ids["<|SPEECH_GENERATION_START|>"]
        self.speech_end_id = ids["<|SPEECH_GENERATION_END|>"]
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # Added tokens (Llama's reserved specials, markers, speech tokens) must not come from user text.
        self._added_ids = frozenset(tokenizer.get_added_tokens_decoder())
        self._prefix_ids = self._encode(_PROMPT_PREFIX)
        self._suffix_ids = self._encode(_PROMPT_SUFFIX)

    @classmethod
    def from_file(cls, path: str | Path) -> LlasaTokenizer:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (a Llasa checkpoint needs its tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: not a readable tokenizers file ({exc})") from exc
        return cls(tokenizer, source=str(path))

    @property
    def backend(self) -> Tokenizer:
        return self._tokenizer

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def num_prompt_overhead_tokens(self) -> int:
        """Prompt tokens around the user's text."""
        return len(self._prefix_ids) + len(self._suffix_ids)

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of the model card's TTS prompt for `text` (as apply_chat_template with
        continue_final_message=True). Raises RequestError if `text` spells a special or speech token."""
        # The template trims the whole user message, whose ends are markers: `text` itself stays as is.
        # Markers delimit pre-tokenizer segments, so encoding the text alone matches encoding the
        # whole rendered prompt.
        text_ids = self._encode(text)
        bad = [i for i in text_ids if i in self._added_ids]
        if bad:
            raise RequestError(
                f"text contains the special token {self._tokenizer.id_to_token(bad[0])!r}; plain text only"
            )
        return self._prefix_ids + text_ids + self._suffix_ids

    def speech_code(self, token_id: int) -> int | None:
        """The XCodec2 code of a speech token id, or None for any other id."""
        code = token_id - self.speech_offset
        return code if 0 <= code < self.num_speech_tokens else None

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


@functools.lru_cache(maxsize=4)
def _random_backend(num_speech_tokens: int) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(_LLAMA_CHAT_TOKENS))
    # Llasa adds its markers and speech tokens as ordinary added tokens (tokenizer.add_tokens), in this order.
    tokenizer.add_tokens(list(LLASA_MARKERS))
    tokenizer.add_tokens([speech_token(code) for code in range(num_speech_tokens)])
    return tokenizer


def build_random_tokenizer(num_speech_tokens: int) -> LlasaTokenizer:
    """A deterministic byte-level tokenizer (256 byte tokens, no merges) with Llasa's special and speech
    tokens in Llasa's order, for random-weight presets. Built in memory; ~0.5 s for 65,536 speech tokens."""
    if not (1 <= num_speech_tokens <= _MAX_SPEECH_TOKENS):
        raise ValueError(f"num_speech_tokens must be in [1, {_MAX_SPEECH_TOKENS}], got {num_speech_tokens}")
    return LlasaTokenizer(_random_backend(num_speech_tokens), source=f"random tokenizer ({num_speech_tokens} speech)")
