"""Speaker encoder (ECAPA-TDNN x-vector): config, strict loading, and parity with qwen-tts 0.1.1.

The official embedding is taken through the official `extract_speaker_embedding` (mel front end
+ encoder) on a tiny and an official-size random encoder; awkward audio lengths, fp32.
"""

import types
import warnings

import numpy as np
import pytest
import torch
from oracle_checkpoints import _import_qwen_tts

from tilevox.models.errors import CheckpointError
from tilevox.models.qwen3_tts.speaker_encoder import (
    SpeakerEncoder,
    SpeakerEncoderConfig,
    load_speaker_encoder,
    mel_spectrogram,
    random_speaker_encoder,
    slaney_mel_filterbank,
)
from tilevox.models.qwen3_tts.speech_tokenizer import randomize_

TINY = {
    "enc_dim": 32,
    "sample_rate": 24000,
    "enc_channels": [16, 16, 16, 16, 48],
    "enc_attention_channels": 8,
    "enc_se_channels": 8,
}


def _official():
    _import_qwen_tts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from qwen_tts.core.models import modeling_qwen3_tts as official
        from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    return official, Qwen3TTSSpeakerEncoderConfig


def _official_encoder(config_dict, seed):
    official, config_cls = _official()
    module = official.Qwen3TTSSpeakerEncoder(config_cls(**config_dict)).eval()
    randomize_(module, torch.Generator().manual_seed(seed))
    state = {f"speaker_encoder.{k}": v for k, v in module.state_dict().items()}
    return module, state


def _wav(num_samples, seed):
    return (np.random.default_rng(seed).standard_normal(num_samples) * 0.25).astype(np.float32)


def test_config_official_two_key_form():
    config = SpeakerEncoderConfig.from_dict({"enc_dim": 2048, "sample_rate": 24000})
    assert config.enc_dim == 2048 and config.enc_channels == (512, 512, 512, 512, 1536)
    # unknown keys are accepted and logged (tests/models/test_checkpoint_loader_defects.py)
    assert SpeakerEncoderConfig.from_dict({"enc_dim": 1024, "model_type": "x"}).enc_dim == 1024
    with pytest.raises(ValueError, match="sum of the SE-Res2Net"):
        SpeakerEncoderConfig(enc_channels=(16, 16, 16, 16, 40))
    with pytest.raises(ValueError, match="sample_rate"):
        SpeakerEncoderConfig(sample_rate=16000)


def test_embed_rejects_bad_audio():
    encoder = SpeakerEncoder(SpeakerEncoderConfig.from_dict(TINY))
    with pytest.raises(ValueError, match="1-D"):
        encoder.embed(torch.zeros(1, 5000))
    assert encoder.min_samples == 1280  # 5 mel frames: the k=3, dilation=4 conv pads 4 frames per side
    with pytest.raises(ValueError, match="at least 1280 samples"):
        encoder.embed(torch.zeros(1279))
    with pytest.raises(ValueError, match="more than 384 samples"):
        mel_spectrogram(torch.zeros(1, 384))


def test_loader_is_strict():
    _, state = _official_encoder(TINY, seed=0)
    config = SpeakerEncoderConfig.from_dict(TINY)
    name = "speaker_encoder.blocks.2.res2net_block.blocks.3.conv.weight"
    with pytest.raises(CheckpointError, match=f"{name}: missing"):
        load_speaker_encoder({k: v for k, v in state.items() if k != name}, config)
    with pytest.raises(CheckpointError, match=r"speaker_encoder\.fc\.extra: unexpected"):
        load_speaker_encoder({**state, "speaker_encoder.fc.extra": torch.zeros(1)}, config)
    with pytest.raises(CheckpointError, match=r"speaker_encoder\.fc\.weight: shape \(32, 96, 2\)"):
        load_speaker_encoder({**state, "speaker_encoder.fc.weight": torch.zeros(32, 96, 2)}, config)
    with pytest.raises(CheckpointError, match="no speaker_encoder"):
        load_speaker_encoder({"talker.codec_head.weight": torch.zeros(2, 2)}, config)
    # Tensors of other components are ignored, so the whole model.safetensors dict can be passed.
    load_speaker_encoder({**state, "talker.codec_head.weight": torch.zeros(2, 2)}, config)


@pytest.mark.oracle
def test_mel_filterbank_matches_librosa():
    import librosa

    expected = librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)
    got = slaney_mel_filterbank(sample_rate=24000, n_fft=1024, num_mels=128, fmin=0, fmax=12000)
    assert got.dtype == expected.dtype == np.float32
    assert np.array_equal(got, expected)


@pytest.mark.oracle
@pytest.mark.parametrize("num_samples", [24000 * 3 + 17, 385, 5001])
def test_mel_spectrogram_matches_official(num_samples):
    official, _ = _official()
    wav = torch.from_numpy(_wav(num_samples, num_samples))[None]
    expected = official.mel_spectrogram(
        wav, n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256, win_size=1024, fmin=0, fmax=12000
    )
    got = mel_spectrogram(wav)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.oracle
@pytest.mark.parametrize(
    ("config_dict", "num_samples"),
    [(TINY, 24000 * 3 + 17), (TINY, 4001), (TINY, 1280), ({"enc_dim": 1024, "sample_rate": 24000}, 24000 * 2 + 999)],
)
def test_embedding_matches_official(config_dict, num_samples):
    official, _ = _official()
    module, state = _official_encoder(config_dict, seed=num_samples)
    ours = load_speaker_encoder(state, SpeakerEncoderConfig.from_dict(config_dict))
    wav = _wav(num_samples, seed=num_samples + 1)
    # The official method only needs these attributes of the full model.
    host = types.SimpleNamespace(speaker_encoder=module, device=torch.device("cpu"), dtype=torch.float32)
    expected = official.Qwen3TTSForConditionalGeneration.extract_speaker_embedding(host, wav, 24000)
    got = ours.embed(torch.from_numpy(wav))
    assert got.shape == expected.shape == (config_dict["enc_dim"],)
    assert expected.abs().mean() > 0.1
    assert (got - expected).abs().max().item() <= 1e-4


def test_bf16_embedding_tracks_fp32():
    """The front end stays fp32 whatever the module dtype; the bf16 x-vector is close to fp32's."""
    encoder = SpeakerEncoder(SpeakerEncoderConfig.from_dict(TINY)).eval()
    randomize_(encoder, torch.Generator().manual_seed(5))
    wav = torch.from_numpy(_wav(24000 + 77, seed=3))
    reference = encoder.embed(wav)
    got = encoder.to(torch.bfloat16).embed(wav)
    assert got.dtype == torch.bfloat16
    assert torch.nn.functional.cosine_similarity(got.float(), reference, dim=0) > 0.99


def test_random_speaker_encoder_is_seeded():
    config = SpeakerEncoderConfig.from_dict(TINY)
    wav = torch.from_numpy(_wav(6000, seed=9))
    a = random_speaker_encoder(config, seed=1).embed(wav)
    b = random_speaker_encoder(config, seed=1).embed(wav)
    c = random_speaker_encoder(config, seed=2).embed(wav)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.abs().mean() > 0.1
