"""Qwen2 byte-level BPE text tokenizer for Qwen3-TTS, built with `tokenizers` only.

Official checkpoints ship `vocab.json`, `merges.txt` and `tokenizer_config.json` (added tokens
in `added_tokens_decoder`); we rebuild the same pipeline transformers' Qwen2 converter builds
(NFC, Qwen2 split regex, byte-level, BPE). `build_byte_tokenizer` makes the toy vocabulary of
the tiny preset and of the oracle checkpoints: 256 byte symbols, no merges, plus the special
tokens the prompt layout needs. Imports: tokenizers and the standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from tilevox.models.errors import CheckpointError

__all__ = ["TINY_SPECIAL_TOKENS", "TextTokenizer", "build_byte_tokenizer", "bytes_to_unicode", "save_tokenizer_files"]

# Qwen2's pre-tokenization regex (transformers' Qwen2Converter).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Special tokens of the toy vocabulary; "assistant" and "user" must be single tokens because the
# prompt layout slices the role prefix as the first three ids.
TINY_SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("assistant", False),
    ("user", False),
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _assemble(vocab: dict[str, int], merges: list[tuple[str, str]], added: list[tuple[int, str, bool]]) -> Tokenizer:
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Added tokens must land on their declared ids: a token already in the BPE vocab keeps its id
    # (tokenizers reuses it); new ones are appended in id order right after the vocab.
    for token_id, content, special in sorted(added):
        next_id = tok.get_vocab_size(with_added_tokens=True)
        expected = vocab.get(content, next_id)
        if token_id != expected:
            raise CheckpointError(f"added token {content!r} has id {token_id}, but it would get id {expected}")
        token = AddedToken(content, special=special, normalized=not special)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


def build_byte_tokenizer() -> Tokenizer:
    """The toy tokenizer: one token per byte (ids 0-255), then TINY_SPECIAL_TOKENS (ids 256+)."""
    vocab = {ch: b for b, ch in sorted(bytes_to_unicode().items())}
    added = [(256 + i, content, special) for i, (content, special) in enumerate(TINY_SPECIAL_TOKENS)]
    return _assemble(vocab, [], added)


def save_tokenizer_files(tok: Tokenizer, directory: Path) -> None:
    """Write `vocab.json`, `merges.txt`, `tokenizer_config.json` in the official layout."""
    directory.mkdir(parents=True, exist_ok=True)
    model_json = json.loads(tok.to_str())["model"]
    (directory / "vocab.json").write_text(json.dumps(model_json["vocab"], ensure_ascii=False))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model_json["merges"]]
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges))
    added = {
        str(tid): {
            "content": t.content,
            "special": t.special,
            "lstrip": False,
            "rstrip": False,
            "normalized": t.normalized,
            "single_word": False,
        }
        for tid, t in tok.get_added_tokens_decoder().items()
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "errors": "replace",
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))


@dataclass(frozen=True, slots=True)
class TextTokenizer:
    """Encodes prompt strings to Qwen token ids."""

    tokenizer: Tokenizer

    @classmethod
    def from_directory(cls, directory: Path) -> TextTokenizer:
        paths = {name: directory / name for name in ("vocab.json", "merges.txt", "tokenizer_config.json")}
        for name, path in paths.items():
            if not path.is_file():
                raise CheckpointError(f"{path}: missing; a Qwen3-TTS checkpoint needs {name}")
        try:
            vocab = json.loads(paths["vocab.json"].read_text(encoding="utf-8"))
            config = json.loads(paths["tokenizer_config.json"].read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{directory}: unreadable tokenizer files ({exc})") from exc
        merges: list[tuple[str, str]] = []
        for line_idx, line in enumerate(paths["merges.txt"].read_text(encoding="utf-8").splitlines()):
            if line_idx == 0 and line.startswith("#version"):
                continue
            if not line.strip():
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise CheckpointError(f"{paths['merges.txt']}: line {line_idx + 1} is not a merge pair: {line!r}")
            merges.append((parts[0], parts[1]))
        added = [
            (int(tid), spec["content"], bool(spec.get("special", False)))
            for tid, spec in config.get("added_tokens_decoder", {}).items()
        ]
        return cls(_assemble(vocab, merges, added))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token_id(self, content: str) -> int:
        token_id = self.tokenizer.token_to_id(content)
        if token_id is None:
            raise KeyError(f"token {content!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)
