"""XCodec2Config: presets, validation messages, dict round trip and the package's config.json."""

from __future__ import annotations

import dataclasses

import pytest

from tilevox.models.xcodec2 import XCodec2Config


def test_full_preset_has_official_sizes():
    cfg = XCodec2Config.preset("full")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim) == (1024, 12, 16, 64)
    assert cfg.codebook_size == 65536 and cfg.vq_dim == 2048
    assert (cfg.hop_samples, cfg.n_fft, cfg.sample_rate_hz, cfg.frame_rate_hz) == (320, 1280, 16000, 50.0)
    assert cfg.istft_pad_samples == 480


@pytest.mark.parametrize("name", ["full", "tiny"])
def test_round_trip_through_dict(name):
    cfg = XCodec2Config.preset(name)
    assert XCodec2Config.from_dict(cfg.to_dict()) == cfg


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        XCodec2Config.preset("tiny").hidden_size = 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(hidden_size=0), "hidden_size must be a positive int"),
        (dict(num_heads=3), "multiple of num_heads"),
        (dict(rope_dim=32), "rope_dim 32 must equal the head dim 64"),
        (dict(num_norm_groups=48), "multiple of num_norm_groups"),
        (dict(fsq_levels=(4, 1)), "FSQ level must be an int >= 2"),
        (dict(fsq_levels=[4, 4]), "fsq_levels must be a non-empty tuple"),
        (dict(n_fft=320), "must exceed hop_samples"),
        (dict(n_fft=1281), "by an even number"),
        (dict(num_prior_blocks=-1), "num_prior_blocks must be a non-negative int"),
    ],
)
def test_validation_messages(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(XCodec2Config.preset("full"), **overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown XCodec2 preset 'huge'"):
        XCodec2Config.preset("huge")
    # unknown config keys are accepted and logged: tests/models/test_checkpoint_loader_defects.py


def test_package_config_json_maps_to_full():
    package_json = {
        "model_type": "xcodec2",
        "semantic_hidden_size": 1024,
        "codec_encoder_hidden_size": 1024,
        "codec_decoder_hidden_size": 1024,
        "use_vocos": True,
    }
    assert XCodec2Config.from_dict(package_json) == XCodec2Config.preset("full")
    with pytest.raises(ValueError, match="codec_decoder_hidden_size 512 is not served"):
        XCodec2Config.from_dict({**package_json, "codec_decoder_hidden_size": 512})
    with pytest.raises(ValueError, match="use_vocos must be true"):
        XCodec2Config.from_dict({**package_json, "use_vocos": False})
