"""Fixtures for the speech-tokenizer tests: a tiny official 12 Hz tokenizer folder.

`official_speech_tokenizer` (session scope) builds `Qwen3TTSTokenizerV2Model` from qwen-tts 0.1.1
with the tiny preset's config (Mimi `upsample_groups` = hidden, docs §8.2 step 5), re-initialises
it with seeded non-degenerate values (`randomize_`), and saves it with `save_pretrained` plus an
EncodecFeatureExtractor, i.e. the official folder layout. Returns (folder, official model).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from oracle_checkpoints import _import_qwen_tts

from tilevox.models.qwen3_tts.speech_tokenizer import PRESETS, randomize_


def import_official_tokenizer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _import_qwen_tts()  # torchaudio stand-ins; see oracle_checkpoints.py
        from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
        from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
    return Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model


@pytest.fixture(scope="session")
def official_speech_tokenizer(tmp_path_factory):
    from transformers import EncodecFeatureExtractor

    config_cls, model_cls = import_official_tokenizer()
    data = PRESETS["tiny"].to_dict()
    config = config_cls(
        encoder_config=data["encoder_config"],
        decoder_config=data["decoder_config"],
        encoder_valid_num_quantizers=data["encoder_valid_num_quantizers"],
    )
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval()
    generator = torch.Generator().manual_seed(20261202)
    randomize_(model, generator)
    for module in model.modules():  # Mimi caches its codebook tables on first use
        if hasattr(module, "_embed"):
            module._embed = None
    folder = tmp_path_factory.mktemp("official") / "speech_tokenizer"
    model.save_pretrained(folder)
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(folder)
    return folder, model
