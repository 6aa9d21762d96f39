"""Loading Qwen3-TTS: official folder layout (strict tensor checks), full-size presets' tensor
names and shapes against the official classes, and the text tokenizer against transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from oracle_checkpoints import _import_qwen_tts
from safetensors.torch import load_file, save_file

from tilevox.models.errors import CheckpointError
from tilevox.models.qwen3_tts.config import Qwen3TTSConfig
from tilevox.models.qwen3_tts.loader import load_checkpoint, preset_config_dict
from tilevox.models.qwen3_tts.model import Qwen3TTSNetwork, Qwen3TTSSpeechModel
from tilevox.models.qwen3_tts.tokenizer import TextTokenizer, build_byte_tokenizer, save_tokenizer_files
from tilevox.models.registry import load_model

TEXTS = [
    "Hello, world!",
    "<|im_start|>assistant\nIt's 3.14159 — naïve café, 日本語のテキスト。<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\n\n\ttabs and\r\nnewlines   ",
    "I'll say we've got 1234567 items, don't we?",
    "emoji 🎉🎉 and ZWJ 👩‍👩‍👧",
]


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["qwen3-tts-0.6b", "qwen3-tts-1.7b"])
def test_full_size_tensors_match_official_classes(name):
    """Every talker tensor name and shape of our network equals the official module's (meta device)."""
    _import_qwen_tts()
    from qwen_tts.core.models import Qwen3TTSConfig as OfficialConfig
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration

    config_dict = preset_config_dict(name)
    with torch.device("meta"):
        official = Qwen3TTSForConditionalGeneration(OfficialConfig(**config_dict))
        ours = Qwen3TTSNetwork(Qwen3TTSConfig.from_dict(config_dict))
    expected = {k: tuple(v.shape) for k, v in official.state_dict().items()}
    got = {f"talker.{k}": tuple(v.shape) for k, v in ours.talker.state_dict().items()}
    assert got == expected
    assert got["talker.model.layers.27.self_attn.q_proj.weight"] == (2048, official.config.talker_config.hidden_size)
    assert ("talker.code_predictor.small_to_mtp_projection.weight" in got) == (name == "qwen3-tts-1.7b")


def _copy(oracle_checkpoints, kind, tmp_path):
    target = tmp_path / kind
    shutil.copytree(oracle_checkpoints[kind], target)
    return target


@pytest.mark.oracle
def test_registry_loads_official_folder(oracle_checkpoints):
    for kind in ("custom_voice", "base", "voice_design"):
        model = load_model(str(oracle_checkpoints[kind]))
        assert isinstance(model, Qwen3TTSSpeechModel)
        assert model.sample_rate_hz == 24000 and model.frame_rate_hz == 12.5
        assert (model.network.speaker_encoder is not None) == (kind == "base")
        assert [v.name for v in model.voices()] == (["aiden", "dylan"] if kind == "custom_voice" else [])


@pytest.mark.oracle
@pytest.mark.parametrize(
    "mutation,message",
    [
        ("drop", "missing tensor talker.model.layers.1.mlp.up_proj.weight"),
        ("extra", "unexpected tensor"),
        ("reshape", "shape (32, 31)"),
        ("drop_speaker_encoder", "speaker_encoder"),
        ("no_generation_config", "generation_config.json"),
        ("no_merges", "merges.txt"),
        ("bad_config", "num_code_groups"),
        ("no_speech_tokenizer", "speech_tokenizer"),
    ],
)
def test_strict_loading(oracle_checkpoints, tmp_path, mutation, message):
    kind = "base" if mutation == "drop_speaker_encoder" else "custom_voice"
    path = _copy(oracle_checkpoints, kind, tmp_path)
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    if mutation == "drop":
        del tensors["talker.model.layers.1.mlp.up_proj.weight"]
    elif mutation == "extra":
        tensors["talker.model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    elif mutation == "reshape":
        tensors["talker.model.layers.0.self_attn.o_proj.weight"] = torch.zeros(32, 31)
    elif mutation == "drop_speaker_encoder":
        tensors = {k: v for k, v in tensors.items() if not k.startswith("speaker_encoder.")}
    elif mutation == "no_generation_config":
        (path / "generation_config.json").unlink()
    elif mutation == "no_merges":
        (path / "merges.txt").unlink()
    elif mutation == "bad_config":
        config = json.loads((path / "config.json").read_text())
        config["talker_config"]["num_code_groups"] = 5  # disagrees with the code predictor's 4
        (path / "config.json").write_text(json.dumps(config))
    elif mutation == "no_speech_tokenizer":
        shutil.rmtree(path / "speech_tokenizer")
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_checkpoint(path)


def _trained_bpe_dir(tmp_path):
    """A byte-level BPE with real merges (trained here), saved in the official file layout."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    base = build_byte_tokenizer()
    tok = Tokenizer(BPE())
    tok.normalizer = base.normalizer
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog, again and again"] * 20 + TEXTS
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["assistant"])
    directory = tmp_path / "bpe"
    save_tokenizer_files(tok, directory)
    return directory, tok


@pytest.mark.oracle
def test_text_tokenizer_matches_transformers(oracle_checkpoints, tmp_path):
    """Our tokenizers-only rebuild from vocab.json/merges.txt/tokenizer_config.json encodes like
    transformers' Qwen2TokenizerFast (toy byte vocab of the oracle checkpoints, and trained merges)."""
    from transformers import Qwen2TokenizerFast

    bpe_dir, trained = _trained_bpe_dir(tmp_path)
    assert trained.get_vocab_size() > 300  # merges exist
    for directory in (oracle_checkpoints["custom_voice"], bpe_dir):
        ours = TextTokenizer.from_directory(directory)
        # The oracle folder also has tokenizer.json (what the official wrapper loads); the trained
        # one has only the official three files, so transformers converts them itself.
        reference = Qwen2TokenizerFast.from_pretrained(str(directory))
        for text in TEXTS:
            assert ours.encode(text) == reference(text, add_special_tokens=False)["input_ids"], text


@pytest.mark.oracle
def test_request_errors_per_model_type(oracle_checkpoints):
    """Requests a model type cannot serve raise RequestError naming the field, before any state."""
    import numpy as np

    from tilevox.models.errors import RequestError
    from tilevox.models.streaming import SynthesisRequest, VoicePrompt

    clip = VoicePrompt(samples=np.full(4800, 0.1, np.float32), sample_rate_hz=24000)
    cases = {
        "base": [
            (dict(), "voice_prompt"),
            (dict(voice_prompt=clip, instructions="calm"), "instructions"),
            (dict(voice_prompt=clip, voice="aiden"), "voice"),
            (dict(voice_prompt=VoicePrompt(samples=clip.samples, sample_rate_hz=16000)), "24000 Hz"),
            (dict(voice_prompt=VoicePrompt(samples=clip.samples, sample_rate_hz=24000, transcript=" ")), "transcript"),
        ],
        "voice_design": [
            (dict(voice_prompt=clip), "voice_prompt"),
            (dict(voice="aiden"), "voice"),
            (dict(language="martian"), "language"),
        ],
        "custom_voice": [(dict(voice_prompt=clip), "voice_prompt"), (dict(voice="zed"), "voice")],
    }
    for kind, bad in cases.items():
        model = load_checkpoint(oracle_checkpoints[kind])
        for kwargs, word in bad:
            with pytest.raises(RequestError, match=word):
                model.open_stream(SynthesisRequest(text="hello", **kwargs))
        assert model.open_stream_ids == ()
    # Voice design without instructions and x-vector cloning are valid requests.
    load_checkpoint(oracle_checkpoints["voice_design"]).validate(SynthesisRequest(text="hello"))
    load_checkpoint(oracle_checkpoints["base"]).validate(SynthesisRequest(text="hello", voice_prompt=clip))
