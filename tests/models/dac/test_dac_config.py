"""DacConfig: presets, derived sizes, and strict parsing of transformers' config.json."""

from __future__ import annotations

import pytest

from tilevox.models.dac import DAC_PRESETS, DacConfig
from tilevox.models.errors import CheckpointError

FULL = DAC_PRESETS["dac-44khz"]

# descript/dac_44khz's config.json as transformers writes it (generic keys included).
HUB_CONFIG = {
    "architectures": ["DacModel"],
    "codebook_dim": 8,
    "codebook_loss_weight": 1.0,
    "codebook_size": 1024,
    "commitment_loss_weight": 0.25,
    "decoder_hidden_size": 1536,
    "downsampling_ratios": [2, 4, 8, 8],
    "encoder_hidden_size": 64,
    "hidden_size": 1024,
    "hop_length": 512,
    "model_type": "dac",
    "n_codebooks": 9,
    "quantizer_dropout": 0.0,
    "sampling_rate": 44100,
    "torch_dtype": "float32",
    "transformers_version": "4.40.0.dev0",
    "upsampling_ratios": [8, 8, 4, 2],
}


def test_full_preset_sizes():
    assert (FULL.hidden_size, FULL.hop_length, FULL.upsampling_ratios) == (1024, 512, (8, 8, 4, 2))
    assert (FULL.n_codebooks, FULL.codebook_size, FULL.sampling_rate) == (9, 1024, 44100)
    assert FULL.frame_rate_hz == pytest.approx(86.13, abs=0.01)


def test_tiny_preset_shares_codes_and_rate():
    tiny = DAC_PRESETS["dac-tiny"]
    for name in ("n_codebooks", "codebook_size", "sampling_rate", "hop_length"):
        assert getattr(tiny, name) == getattr(FULL, name), name


def test_hub_config_parses_to_the_preset():
    assert DacConfig.from_dict(HUB_CONFIG) == FULL


@pytest.mark.parametrize("preset", sorted(DAC_PRESETS))
def test_to_dict_round_trips(preset):
    assert DacConfig.from_dict(DAC_PRESETS[preset].to_dict()) == DAC_PRESETS[preset]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "encodec"}, "model_type must be 'dac'"),
        ({"use_causal_conv": True}, "unknown DAC config field(s) use_causal_conv"),
        ({"codebook_size": None}, "missing key 'codebook_size'"),
        ({"n_codebooks": "9"}, "n_codebooks must be an integer"),
        ({"downsampling_ratios": [2, 4, 8, 8.0]}, "downsampling_ratios must be a list of integers"),
        ({"downsampling_ratios": [2, 3]}, "even int"),
        ({"hop_length": 256}, "hop_length is 256 but the other fields make it 512"),
        ({"upsampling_ratios": [2, 4, 8, 8]}, "upsampling_ratios"),
        ({"quantizer_dropout": "no"}, "quantizer_dropout must be a number"),
        ({"decoder_hidden_size": 0}, "decoder_hidden_size must be a positive int"),
    ],
)
def test_bad_config_raises_checkpoint_error(change, message):
    data = {k: v for k, v in HUB_CONFIG.items() if change.get(k, 0) is not None}
    data.update({k: v for k, v in change.items() if v is not None})
    with pytest.raises(CheckpointError, match="^my/config.json: ") as info:
        DacConfig.from_dict(data, source="my/config.json")
    assert message in str(info.value)


def test_missing_required_field_is_named():
    data = dict(HUB_CONFIG)
    del data["encoder_hidden_size"]
    with pytest.raises(CheckpointError, match="encoder_hidden_size"):
        DacConfig.from_dict(data)
