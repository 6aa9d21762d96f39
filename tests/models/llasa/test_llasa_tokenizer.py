"""Llasa tokenizer: token layout, the model card's chat prompt, file loading and rejection of special tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models

from tilevox.models.errors import CheckpointError, RequestError
from tilevox.models.llasa.tokenizer import LLASA_MARKERS, LlasaTokenizer, build_random_tokenizer

# Written out by hand from the Llama 3.2 chat template rendered for the Llasa-1B model card's messages
# (user: "Convert the text to speech:" + text in TEXT_UNDERSTANDING markers; assistant continued
# from "<|SPEECH_GENERATION_START|>").
EXPECTED_PROMPT = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
    "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
    "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>{text}<|TEXT_UNDERSTANDING_END|><|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n<|SPEECH_GENERATION_START|>"
)


@pytest.fixture(scope="module")
def tokenizer() -> LlasaTokenizer:
    return build_random_tokenizer(300)


def test_layout_mirrors_llasa(tokenizer):
    # Llasa-1B: markers 128256..128263, <|s_0|> = 128264, SPEECH_GENERATION_END = 128261 (3 before <|s_0|>).
    backend = tokenizer.backend
    marker_ids = [backend.token_to_id(m) for m in LLASA_MARKERS]
    assert marker_ids == list(range(marker_ids[0], marker_ids[0] + 8))
    assert tokenizer.speech_offset == marker_ids[-1] + 1
    assert tokenizer.speech_end_id == tokenizer.speech_offset - 3
    assert tokenizer.speech_start_id == tokenizer.speech_offset - 4
    assert tokenizer.num_speech_tokens == 300
    assert tokenizer.vocab_size == tokenizer.speech_offset + 300
    assert backend.token_to_id("<|s_299|>") == tokenizer.speech_offset + 299
    assert tokenizer.speech_code(tokenizer.speech_offset + 7) == 7
    assert tokenizer.speech_code(tokenizer.speech_end_id) is None
    assert tokenizer.speech_code(tokenizer.speech_offset + 300) is None


@pytest.mark.parametrize("text", ["Hello there", " spaced  out ", "Grüße, 你好! 3.14", "line\nbreak"])
def test_prompt_is_the_model_card_chat(tokenizer, text):
    ids = tokenizer.prompt_ids(text)
    assert tokenizer.decode(ids) == EXPECTED_PROMPT.format(text=text)
    # Encoding the rendered prompt in one go gives the same ids as the segment-wise encoding.
    assert tokenizer.backend.encode(EXPECTED_PROMPT.format(text=text), add_special_tokens=False).ids == ids
    assert ids[-1] == tokenizer.speech_start_id
    assert len(ids) == tokenizer.num_prompt_overhead_tokens + len(text.encode("utf-8"))


@pytest.mark.parametrize("text", ["say <|s_12|> now", "a<|eot_id|>b", "x<|SPEECH_GENERATION_END|>"])
def test_text_spelling_special_tokens_is_rejected(tokenizer, text):
    with pytest.raises(RequestError, match="special token"):
        tokenizer.prompt_ids(text)


def test_round_trip_through_tokenizer_json(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tokenizer.backend.save(str(path))
    loaded = LlasaTokenizer.from_file(path)
    assert loaded.speech_offset == tokenizer.speech_offset
    assert loaded.num_speech_tokens == tokenizer.num_speech_tokens
    assert loaded.prompt_ids("Round trip") == tokenizer.prompt_ids("Round trip")


def test_bad_tokenizers_are_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        LlasaTokenizer.from_file(tmp_path / "tokenizer.json")
    plain = Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    plain.add_special_tokens(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    with pytest.raises(CheckpointError, match="TEXT_GENERATION_START"):
        LlasaTokenizer(plain)
    plain.add_tokens(list(LLASA_MARKERS) + ["<|s_0|>", "<|s_1|>", "filler", "<|s_2|>"])
    with pytest.raises(CheckpointError, match=r"not contiguous: <\|s_2\|>"):
        LlasaTokenizer(plain)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a readable tokenizers file"):
        LlasaTokenizer.from_file(tmp_path / "tokenizer.json")


def test_random_tokenizer_is_deterministic():
    a, b = build_random_tokenizer(64), build_random_tokenizer(65)
    assert a.prompt_ids("same text") == b.prompt_ids("same text")
    assert a.backend.to_str() == build_random_tokenizer(64).backend.to_str()
    with pytest.raises(ValueError, match="num_speech_tokens"):
        build_random_tokenizer(0)
