"""LlamaConfig <-> transformers' config.json."""

from __future__ import annotations

import pytest

from tilevox.models.llama.config import LlamaConfig


@pytest.mark.parametrize("name", ["tiny", "1b"])
def test_hf_config_round_trip(name):
    """to_hf_config writes the config.json that from_hf_config reads back to the same config."""
    config = LlamaConfig.preset(name)
    assert LlamaConfig.from_hf_config(config.to_hf_config()) == config
