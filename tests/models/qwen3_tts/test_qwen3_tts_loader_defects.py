"""Loader defects of issue 11 on official Qwen3-TTS folders (tiny checkpoints built by qwen-tts 0.1.1):
a truncated model.safetensors, an int32 talker tensor (the official loader refuses it; tilevox used to
cast it), a non-numeric hidden_size (used to be "unsupported operand type(s) for //"), and the
unknown-field rule (the official configs log nothing; unknown fields are logged naming field and file).
rope_scaling: test_qwen3_tts_rope_scaling.py. Other models: tests/models/test_checkpoint_loader_defects.py.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tilevox.models.errors import CheckpointError
from tilevox.models.qwen3_tts.loader import load_checkpoint

pytestmark = pytest.mark.oracle

FIELDS_LOGGER = "tilevox.models.config_fields"


def _copy(oracle_checkpoints, kind, tmp_path):
    return shutil.copytree(oracle_checkpoints[kind], tmp_path / kind)


def _edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_truncated_weights_name_the_file(oracle_checkpoints, tmp_path):
    path = _copy(oracle_checkpoints, "custom_voice", tmp_path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_checkpoint(path)
    assert str(info.value).startswith(f"{weights}: ")


@pytest.mark.parametrize("name", ["talker.model.layers.0.mlp.up_proj.weight", "speaker_encoder.asp.conv.weight"])
def test_int_tensor_is_refused_naming_tensor_and_file(oracle_checkpoints, tmp_path, name):
    path = _copy(oracle_checkpoints, "base", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    assert name in tensors, sorted(k for k in tensors if k.startswith(name.split(".")[0]))[:8]
    tensors[name] = (tensors[name] * 100).to(torch.int32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(info.value) == (
        f"{path / 'model.safetensors'}: tensor {name!r} has dtype torch.int32, expected a floating-point tensor"
    )


def test_non_numeric_hidden_size_names_key_file_and_type(oracle_checkpoints, tmp_path):
    path = _copy(oracle_checkpoints, "custom_voice", tmp_path)
    _edit_config(path, lambda c: c["talker_config"].update(hidden_size="32"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(info.value) == f"{path / 'config.json'}: talker_config.hidden_size must be an integer, got '32' (str)"


def test_official_configs_log_no_unknown_fields(oracle_checkpoints, caplog):
    """Everything qwen-tts writes into config.json, generation_config.json and speech_tokenizer/config.json
    is known (read, or known not to change inference): loading logs no unknown field."""
    with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
        for kind in ("custom_voice", "base"):
            load_checkpoint(oracle_checkpoints[kind])
    assert not [r.getMessage() for r in caplog.records if r.name == FIELDS_LOGGER]


def test_unknown_fields_are_logged_naming_field_and_file(oracle_checkpoints, tmp_path, caplog):
    path = _copy(oracle_checkpoints, "base", tmp_path)

    def edit(config):
        config["talker_config"]["future_knob"] = 1
        config["speaker_encoder_config"]["enc_future"] = 2

    _edit_config(path, edit)
    with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
        load_checkpoint(path)
    lines = [r.getMessage() for r in caplog.records if r.name == FIELDS_LOGGER]
    assert any(str(path / "config.json") in m and "talker_config.future_knob" in m for m in lines), lines
    assert any(str(path / "config.json") in m and "speaker_encoder_config.enc_future" in m for m in lines), lines
