"""Llasa loading: random presets, checkpoint directories with XCodec2 beside them, and the registry path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tilevox.models.errors import CheckpointError
from tilevox.models.llama.config import LLAMA_PRESETS
from tilevox.models.llasa.loader import LLASA_PRESETS, XCODEC2_DIR_ENV, load_checkpoint, load_preset
from tilevox.models.registry import load_model
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize
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
