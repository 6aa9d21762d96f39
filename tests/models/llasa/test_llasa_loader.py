"""Llasa loading: random presets, checkpoint directories with XCodec2 beside them, and the registry path."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tilevox.models.errors import CheckpointError
from tilevox.models.llama.config import LLAMA_PRESETS
from tilevox.models.llasa.loader import (
    LLASA_PRESETS,
    XCODEC2_DIR_ENV,
    llama_config,
    load_checkpoint,
    load_preset,
    meta_regions,
)
from tilevox.models.llasa.tokenizer import build_random_tokenizer
from tilevox.models.registry import load_model
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize
from tilevox.models.xcodec2.config import XCodec2Config
from tilevox.models.xcodec2.weights import checkpoint_name

REQUEST = SynthesisRequest(text="Checkpoint parity", sampling=SamplingParams(max_new_tokens=12), seed=5)


def _save_llasa_checkpoint(model, root, *, with_codec: bool):
    """Write `model` the way a Llasa release is laid out (HF Llama config + safetensors + tokenizer.json)."""
    root.mkdir(parents=True, exist_ok=True)
    c = model.llama.config
    (root / "config.json").write_text(json.dumps(c.to_hf_config()))
    save_file({k: v.contiguous() for k, v in model.llama.state_dict().items()}, str(root / "model.safetensors"))
    model.tokenizer.backend.save(str(root / "tokenizer.json"))
    if with_codec:
        _save_codec(model.codec, root / "xcodec2")
    return root


def _save_codec(codec, directory):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(codec.config.to_dict()))
    save_file(
        {checkpoint_name(n): p.contiguous() for n, p in codec.named_parameters()}, str(directory / "model.safetensors")
    )


@pytest.fixture(scope="module")
def tiny():
    return load_preset("llama-tiny", device="cpu", dtype=torch.float32, max_streams=2)


def test_presets(tiny):
    assert tiny.is_random and tiny.model_id == "random:llama-tiny" and tiny.max_streams == 2
    assert tiny.llama.config.vocab_size == tiny.tokenizer.vocab_size
    preset = LLASA_PRESETS["llama-1b"]
    config = LLAMA_PRESETS[preset.llama].with_vocab_size(preset.vocab_size)
    assert (
        config.vocab_size,
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
    ) == (193800, 2048, 16, 32, 8, 8192)
    assert (config.rope_theta, config.rope_type, config.rope_factor) == (500000.0, "llama3", 32.0)
    assert 128256 + 8 + 65536 == config.vocab_size
    assert preset.codec == "full" and preset.max_seq_len == 2048
    with pytest.raises(ValueError, match="unknown Llasa preset 'llama-7b'"):
        load_preset("llama-7b", device="cpu", dtype=torch.float32)


def test_llama_3_2_1b_preset_without_building_it():
    """llama-3.2-1b: Llama-3.2-1B's own network (128,256 tokens, tied head) with the full XCodec2; the random
    tokenizer's 65,805 ids fit inside the vocabulary (the rest are masked as non-speech). Shapes only: the
    network is built on the meta device, the codec and tokenizer from their configs."""
    preset = LLASA_PRESETS["llama-3.2-1b"]
    assert preset.codec == "full" and preset.max_seq_len == 2048 and preset.num_speech_tokens is None
    config = llama_config("llama-3.2-1b")
    assert config == LLAMA_PRESETS["3.2-1b"] and config.tie_word_embeddings
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        128256,
        2048,
        16,
        8192,
    )
    # the same decoder as Llasa-1B's llama-1b but for the vocabulary and the tie
    assert dataclasses.replace(llama_config("llama-1b"), vocab_size=128256, tie_word_embeddings=True) == config
    tokenizer = build_random_tokenizer(XCodec2Config.preset(preset.codec).codebook_size)
    last_speech_id = tokenizer.speech_offset + tokenizer.num_speech_tokens - 1
    assert tokenizer.vocab_size == 65805 and max(last_speech_id, tokenizer.speech_end_id) < config.vocab_size
    network = meta_regions("llama-3.2-1b", dtype=torch.bfloat16)["decoder_step"]
    assert network.lm_head.weight is network.model.embed_tokens.weight  # one tensor
    assert sum(p.numel() for p in network.parameters()) == 1_235_814_400


def test_registry_random_preset():
    model = load_model("random:llama-tiny", device="cpu", dtype=torch.float32)
    assert model.is_random and model.sample_rate_hz == 16000


def test_checkpoint_with_xcodec2_subfolder_matches_the_saved_model(tiny, tmp_path):
    root = _save_llasa_checkpoint(tiny, tmp_path / "llasa", with_codec=True)
    loaded = load_model(str(root), device="cpu", dtype=torch.float32)  # registry: model_type "llama"
    assert not loaded.is_random and loaded.max_seq_len == 2048
    expected = synthesize(tiny, REQUEST)
    got = synthesize(loaded, REQUEST)
    assert got.num_frames == expected.num_frames == 12
    np.testing.assert_array_equal(got.samples, expected.samples)


def test_checkpoint_xcodec2_from_env_var(tiny, tmp_path, monkeypatch):
    root = _save_llasa_checkpoint(tiny, tmp_path / "llasa", with_codec=False)
    monkeypatch.delenv(XCODEC2_DIR_ENV, raising=False)
    with pytest.raises(CheckpointError, match=rf"xcodec2.*{XCODEC2_DIR_ENV}"):
        load_checkpoint(root, device="cpu", dtype=torch.float32)
    monkeypatch.setenv(XCODEC2_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(root, device="cpu", dtype=torch.float32)
    _save_codec(tiny.codec, tmp_path / "codec")
    monkeypatch.setenv(XCODEC2_DIR_ENV, str(tmp_path / "codec"))
    loaded = load_checkpoint(root, device="cpu", dtype=torch.bfloat16)
    assert loaded.llama.dtype == torch.bfloat16
    result = synthesize(loaded, REQUEST)
    assert result.num_frames == 12 and np.isfinite(result.samples).all()


def test_checkpoint_problems_are_named(tiny, tmp_path):
    root = _save_llasa_checkpoint(tiny, tmp_path / "llasa", with_codec=True)
    (root / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        load_checkpoint(root, device="cpu", dtype=torch.float32)
    root = _save_llasa_checkpoint(tiny, tmp_path / "llasa2", with_codec=True)
    config = json.loads((root / "config.json").read_text())
    config["vocab_size"] = tiny.tokenizer.speech_offset  # too small for the speech tokens
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_checkpoint(root, device="cpu", dtype=torch.float32)


@pytest.mark.oracle
def test_greedy_speech_tokens_match_transformers(tiny, tmp_path):
    """The saved checkpoint run by transformers picks the same greedy tokens (over the speech + end
    tokens that LlasaModel samples from) at every step as the streaming model did."""
    transformers = pytest.importorskip("transformers", reason="oracle tests need transformers (pip install -e .[test])")
    root = _save_llasa_checkpoint(tiny, tmp_path / "llasa", with_codec=True)
    model = load_checkpoint(root, device="cpu", dtype=torch.float32, max_streams=1)
    with torch.no_grad():  # sharpen (std 0.02 -> 0.2) so that the whole history moves the logits
        for name, param in model.llama.named_parameters():
            if param.dim() == 2 and name != "lm_head.weight":
                param.mul_(10.0)
    tokens = []
    model.token_observer = lambda _stream_id, token: tokens.append(token)
    request = SynthesisRequest(text="Parity with transformers", sampling=SamplingParams.greedy(max_new_tokens=20))
    synthesize(model, request)
    assert len(tokens) == 20

    hf = transformers.LlamaForCausalLM.from_pretrained(root, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 2 and name != "lm_head.weight":
                param.mul_(10.0)
        prompt = model.tokenizer.prompt_ids(request.text)
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    speech = slice(model.tokenizer.speech_offset, model.tokenizer.speech_offset + model.tokenizer.num_speech_tokens)
    allowed = torch.full_like(logits, float("-inf"))
    allowed[:, speech] = 0.0
    allowed[:, model.tokenizer.speech_end_id] = 0.0
    assert (logits + allowed).argmax(dim=-1).tolist() == tokens
