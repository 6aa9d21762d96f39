"""Parity with the official qwen-tts 0.1.1 speech tokenizer on a tiny random checkpoint (CPU, fp32).

The official model is built and saved by the `official_speech_tokenizer` fixture; ours is loaded
from that folder with `load_speech_tokenizer`. Decoder: plain full decode vs `decoder(codes)`,
chunked decode vs `decode()` (> 300 frames); encoder: codes equal through the official wrapper.
"""

import numpy as np
import pytest
import torch

from tilevox.models.qwen3_tts.speech_tokenizer import load_speech_tokenizer

pytestmark = pytest.mark.oracle

TOL = 1e-4


@pytest.fixture(scope="module")
def ours(official_speech_tokenizer):
    folder, _ = official_speech_tokenizer
    return load_speech_tokenizer(folder, device="cpu", dtype=torch.float32)


def _codes(batch, frames, seed, codebook_size=32, books=4):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, codebook_size, (batch, books, frames), generator=generator)


def test_loaded_tensors_equal_official(official_speech_tokenizer, ours):
    _, official = official_speech_tokenizer
    _, decoder, encoder = ours
    ref = official.decoder.state_dict()
    got = decoder.state_dict()
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    ref_enc = official.encoder.state_dict()
    got_enc = encoder.mimi.state_dict()
    assert set(got_enc) == set(ref_enc)
    assert all(torch.equal(got_enc[k], ref_enc[k]) for k in ref_enc)


@pytest.mark.parametrize(("batch", "frames"), [(2, 37), (1, 1), (3, 90)])
@torch.no_grad()
def test_full_decode_matches_official_decoder(official_speech_tokenizer, ours, batch, frames):
    _, official = official_speech_tokenizer
    _, decoder, _ = ours
    codes = _codes(batch, frames, seed=frames)
    expected = official.decoder(codes)[:, 0]
    got = decoder(codes)
    assert got.shape == expected.shape == (batch, frames * 1920)
    assert expected.std() > 0.05
    assert (got - expected).abs().max().item() <= TOL


@torch.no_grad()
def test_chunked_decode_matches_official_decode(official_speech_tokenizer, ours):
    """Official decode() = 300-frame chunks with 25 frames of left context; differs from a full decode.
    Row 1 is shorter and right-padded with -1, as the official batch decode receives it."""
    _, official = official_speech_tokenizer
    _, decoder, _ = ours
    codes = _codes(2, 333, seed=7)
    codes[1, :, 131:] = -1
    expected = official.decode(codes.transpose(1, 2), return_dict=True).audio_values
    got = decoder.decode_padded(codes)
    assert [g.shape[-1] for g in got] == [e.shape[-1] for e in expected] == [333 * 1920, 131 * 1920]
    for g, e in zip(got, expected):
        assert (g - e).abs().max().item() <= TOL
    chunked = decoder.chunked_decode(codes[:1])
    assert (chunked[0] - expected[0]).abs().max().item() <= TOL
    # The chunking matters: a plain full decode differs after frame 300 (so the test can fail).
    assert (decoder(codes[:1])[0] - expected[0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("num_samples", [24000 * 2 + 333, 1919 * 3 + 1, 1])
def test_encode_matches_official(official_speech_tokenizer, ours, num_samples):
    from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer

    folder, _ = official_speech_tokenizer
    _, _, encoder = ours
    wav = (np.random.default_rng(num_samples).standard_normal(num_samples) * 0.3).astype(np.float32)
    official = Qwen3TTSTokenizer.from_pretrained(str(folder), attn_implementation="sdpa")
    (expected,) = official.encode(wav, sr=24000).audio_codes  # (T, Q)
    got = encoder.encode(torch.from_numpy(wav)[None])  # (1, Q, T)
    assert got.shape == (1, 4, -(-num_samples // 1920))
    assert torch.equal(got[0], expected.T)
    if num_samples > 20000:
        assert all(got[0, q].unique().numel() > 1 for q in range(4)), "random encoder should not be constant"
