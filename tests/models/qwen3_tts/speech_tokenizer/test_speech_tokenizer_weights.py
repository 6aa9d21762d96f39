"""Config parsing, strict loading (missing / unexpected / mis-shaped tensors) and seeded random init."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tilevox.models.errors import CheckpointError
from tilevox.models.qwen3_tts.speech_tokenizer import (
    PRESETS,
    SpeechDecoderConfig,
    SpeechTokenizerConfig,
    load_speech_tokenizer,
    random_speech_tokenizer,
    save_speech_tokenizer,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config = PRESETS["tiny"]
    decoder, encoder = random_speech_tokenizer(config, seed=4)
    folder = tmp_path_factory.mktemp("st") / "speech_tokenizer"
    save_speech_tokenizer(folder, config, decoder, encoder)
    return folder, config, decoder, encoder


def _rewrite(tmp_path, folder, edit_tensors=None, edit_config=None):
    out = tmp_path / "edited"
    out.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    data = json.loads((folder / "config.json").read_text())
    if edit_config:
        edit_config(data)
    (out / "config.json").write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("name", ["12hz", "tiny"])
def test_config_round_trips(name):
    config = PRESETS[name]
    assert SpeechTokenizerConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    json.dumps(dataclasses.asdict(config))  # configs go into engine artifacts as JSON


def test_config_missing_keys_take_official_class_defaults():
    config = SpeechTokenizerConfig.from_dict({"decoder_config": {"codebook_dim": 512}})
    assert config.decoder.hidden_size == 1024 and config.decoder.intermediate_size == 3072
    assert config.decoder.head_dim == 1024 // 16
    assert config.frame_rate_hz == 12.5


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"decoder_config": {}}, "codebook_dim"),
        ({"model_type": "mimi", "decoder_config": {"codebook_dim": 8}}, "model_type"),
        ({"decoder_config": {"codebook_dim": 8, "rope_scaling": {"rope_type": "yarn"}}}, "rope_scaling"),
        ({"decoder_config": {"codebook_dim": 8}, "decode_upsample_rate": 960}, "decode_upsample_rate"),
        ({"decoder_config": {"codebook_dim": 8, "num_quantizers": 8}}, "encoder_valid_num_quantizers"),
    ],
)
def test_config_rejects_bad_values(data, match):
    with pytest.raises(ValueError, match=match):
        SpeechTokenizerConfig.from_dict(data)


def test_decoder_config_validation():
    with pytest.raises(ValueError, match="codebook_dim must be even"):
        SpeechDecoderConfig(codebook_dim=15)
    with pytest.raises(ValueError, match="decoder_dim"):
        SpeechDecoderConfig(decoder_dim=100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].decoder.hidden_size = 3  # type: ignore[misc]


@torch.no_grad()
def test_save_load_round_trip(saved):
    folder, config, decoder, encoder = saved
    loaded_config, dec2, enc2 = load_speech_tokenizer(folder)
    assert loaded_config == config
    codes = torch.randint(0, 32, (1, 4, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(dec2(codes), decoder(codes))
    wav = torch.randn(1, 5000, generator=torch.Generator().manual_seed(1)) * 0.3
    assert torch.equal(enc2.encode(wav), encoder.encode(wav))
    _, _, none = load_speech_tokenizer(folder, with_encoder=False)
    assert none is None


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: t.pop("decoder.pre_transformer.layers.1.mlp.up_proj.weight"),
            r"decoder\.pre_transformer\.layers\.1\.mlp\.up_proj\.weight: missing",
        ),
        (lambda t: t.pop("encoder.downsample.conv.weight"), r"encoder\.downsample\.conv\.weight: missing"),
        (lambda t: t.update({"decoder.extra.weight": torch.zeros(2)}), r"decoder\.extra\.weight: unexpected"),
        (lambda t: t.update({"talker.x": torch.zeros(2)}), r"talker\.x: unexpected"),
        (
            lambda t: t.update({"decoder.pre_conv.conv.weight": torch.zeros(32, 16, 5)}),
            r"decoder\.pre_conv\.conv\.weight: shape \(32, 16, 5\)",
        ),
    ],
)
def test_loader_is_strict(tmp_path, saved, edit, match):
    folder = _rewrite(tmp_path, saved[0], edit_tensors=edit)
    with pytest.raises(CheckpointError, match=match):
        load_speech_tokenizer(folder)


def test_loader_reports_bad_files(tmp_path, saved):
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_speech_tokenizer(tmp_path)
    folder = _rewrite(tmp_path, saved[0], edit_config=lambda d: d["decoder_config"].pop("codebook_dim"))
    with pytest.raises(CheckpointError, match="codebook_dim"):
        load_speech_tokenizer(folder)
    (folder / "model.safetensors").unlink()
    (folder / "config.json").write_text(json.dumps(PRESETS["tiny"].to_dict()))
    with pytest.raises(CheckpointError, match="model.safetensors: missing"):
        load_speech_tokenizer(folder)


def test_random_init_is_seeded():
    config = PRESETS["tiny"]
    a, _ = random_speech_tokenizer(config, seed=1, with_encoder=False)
    b, _ = random_speech_tokenizer(config, seed=1, with_encoder=False)
    c, _ = random_speech_tokenizer(config, seed=2, with_encoder=False)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["pre_conv.conv.weight"], sc["pre_conv.conv.weight"])
    table = a.quantizer.rvq_rest.vq.layers[0]._codebook.table()
    assert table.abs().min() > 0, "codebooks must not be zero (zero tables decode to silence)"
