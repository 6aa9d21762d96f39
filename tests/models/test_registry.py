"""One table of model names: every preset resolves to one family, and each family's models declare the
same regions (names and networks) whether loaded with weights or built shape-only for the compiler."""

from __future__ import annotations

import pytest
import torch

from tilevox.models.region_backends import region_module, region_names
from tilevox.models.registry import FAMILIES, load_model, meta_regions, preset_family, presets


def test_every_preset_belongs_to_exactly_one_family():
    table = presets()
    assert set(table) >= {
        "llama-tiny",
        "llama-1b",
        "llama-3.2-1b",
        "qwen3-tts-tiny",
        "qwen3-tts-0.6b",
        "qwen3-tts-1.7b",
    }
    assert {family.name for family in table.values()} == {family.name for family in FAMILIES}
    assert preset_family("random:llama-1b").name == preset_family("random:llama-3.2-1b").name == "llasa"
    with pytest.raises(ValueError, match="unknown preset 'random:llama-2b'.*random:llama-tiny"):
        preset_family("random:llama-2b")


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tts-tiny"])
def test_loaded_and_meta_regions_agree(preset):
    model = load_model(f"random:{preset}")
    meta = meta_regions(preset, dtype=torch.float32)
    assert tuple(meta) == region_names(model) == tuple(model.region_modules())
    for name in region_names(model):
        loaded_view = region_module(model, name).decoder_view()
        meta_view = meta[name].decoder_view()
        assert meta_view.family is loaded_view.family
        assert [t.shape for t in meta_view.heads] == [t.shape for t in loaded_view.heads]
        assert meta_view.num_layers == loaded_view.num_layers
        assert all(t.device.type == "meta" for t in meta_view.heads)


def test_region_module_names_the_valid_regions():
    model = load_model("random:llama-tiny")
    with pytest.raises(ValueError, match="no region 'talker_step'; its regions: decoder_step"):
        region_module(model, "talker_step")


def test_decode_mode_is_a_qwen3_tts_option():
    model = load_model("random:qwen3-tts-tiny", decode_mode="official_chunked")
    assert model.options.decode_mode == "official_chunked"
    assert load_model("random:qwen3-tts-tiny").options.decode_mode == "exact"
    with pytest.raises(ValueError, match="llasa models take no decode_mode option"):
        load_model("random:llama-tiny", decode_mode="exact")
    with pytest.raises(ValueError, match="decode_mode must be one of"):
        load_model("random:qwen3-tts-tiny", decode_mode="chunked")
