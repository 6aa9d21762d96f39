"""Random construction and checkpoint loading: determinism, shapes, and loader strictness."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from safetensors.torch import save_file

from tilevox.models.errors import CheckpointError
from tilevox.models.xcodec2 import XCodec2Config, load_xcodec2_decoder, random_xcodec2_decoder
from tilevox.models.xcodec2.weights import IGNORED_PREFIXES, checkpoint_name

TINY = XCodec2Config.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return random_xcodec2_decoder(TINY, seed=3)


def _official_state(model) -> dict[str, torch.Tensor]:
    state = {checkpoint_name(k): v.clone() for k, v in model.state_dict().items()}
    state["generator.head.istft.window"] = torch.hann_window(TINY.n_fft)
    state["generator.quantizer.project_in.weight"] = torch.randn(8, 2048)
    return state


def _save(state, tmp_path, name="model.safetensors"):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def test_random_is_seeded(model):
    again = random_xcodec2_decoder(TINY, seed=3)
    other = random_xcodec2_decoder(TINY, seed=4)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(model.head_out.weight, other.head_out.weight)


@pytest.mark.parametrize("num_frames", [1, 2, 37, 199])
def test_output_length_and_attributes(model, num_frames):
    codes = torch.randint(0, TINY.codebook_size, (3, num_frames))
    with torch.inference_mode():
        audio = model(codes)
    assert model.sample_rate_hz == 16000 and model.hop_samples == 320
    assert audio.shape == (3, num_frames * 320) and audio.dtype == torch.float32
    assert torch.isfinite(audio).all()


def test_batch_rows_are_independent(model):
    codes = torch.randint(0, TINY.codebook_size, (3, 41))
    with torch.inference_mode():
        batched = model(codes)
        single = model(codes[1:2])
    torch.testing.assert_close(batched[1:2], single, rtol=1e-5, atol=1e-5)


def test_bf16_close_to_fp32(model):
    low = random_xcodec2_decoder(TINY, seed=3, dtype=torch.bfloat16)
    codes = torch.randint(0, TINY.codebook_size, (1, 53))
    with torch.inference_mode():
        ref, out = model(codes), low(codes)
    assert out.dtype == torch.float32
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.1, f"bf16 vs fp32 relative L2 error {rel:.3f}"


def test_tiny_decode_is_fast(model):
    codes = torch.randint(0, TINY.codebook_size, (1, 200))
    with torch.inference_mode():
        model(codes)  # warm-up
        start = time.perf_counter()
        model(codes)
        elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"tiny decode of 200 frames took {elapsed:.2f} s"


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([[0, 65536]]),
        torch.tensor([[-1]]),
        torch.zeros(4, dtype=torch.long),
        torch.zeros(1, 3, dtype=torch.int32),
        torch.zeros(1, 0, dtype=torch.long),
    ],
)
def test_rejects_bad_codes(model, bad):
    with pytest.raises(ValueError, match="codes must"):
        model(bad)


def test_loads_round_trip_from_directory(model, tmp_path):
    _save(_official_state(model), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_dict()))
    loaded = load_xcodec2_decoder(tmp_path)
    assert loaded.config == TINY
    codes = torch.randint(0, TINY.codebook_size, (1, 29))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(codes), model(codes), rtol=0, atol=0)


def test_missing_tensor_is_named(model, tmp_path):
    state = _official_state(model)
    del state["generator.backbone.transformers.1.mlp.fc2.weight"]
    name = "generator.backbone.transformers.1.mlp.fc2.weight"
    with pytest.raises(CheckpointError, match=f"missing decoder tensor {re.escape(repr(name))}"):
        load_xcodec2_decoder(_save(state, tmp_path), config=TINY)


def test_misshaped_tensor_is_named(model, tmp_path):
    state = _official_state(model)
    state["fc_post_a.weight"] = torch.zeros(64, 1024)
    with pytest.raises(CheckpointError, match=r"'fc_post_a.weight' has shape \(64, 1024\), expected \(64, 2048\)"):
        load_xcodec2_decoder(_save(state, tmp_path), config=TINY)


def test_unexpected_decoder_tensor_is_named(model, tmp_path):
    """A deeper checkpoint than the config (an extra transformer block) must not load silently."""
    state = _official_state(model)
    state["generator.backbone.transformers.2.att_norm.weight"] = torch.ones(64)
    with pytest.raises(CheckpointError, match="generator.backbone.transformers.2.att_norm.weight"):
        load_xcodec2_decoder(_save(state, tmp_path), config=TINY)


def test_ignored_prefixes_are_skipped(model, tmp_path):
    state = _official_state(model)
    for prefix in IGNORED_PREFIXES:
        state[prefix + "anything.weight"] = torch.randn(2, 2)
    load_xcodec2_decoder(_save(state, tmp_path), config=TINY)


def test_wrong_window_is_rejected(model, tmp_path):
    state = _official_state(model)
    state["generator.head.istft.window"] = torch.hamming_window(TINY.n_fft)
    with pytest.raises(CheckpointError, match="generator.head.istft.window"):
        load_xcodec2_decoder(_save(state, tmp_path), config=TINY)


def test_integer_tensor_is_rejected(model, tmp_path):
    state = _official_state(model)
    state["generator.head.out.bias"] = torch.zeros(TINY.n_fft + 2, dtype=torch.int64)
    with pytest.raises(CheckpointError, match="'generator.head.out.bias' has dtype torch.int64"):
        load_xcodec2_decoder(_save(state, tmp_path), config=TINY)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(CheckpointError, match="model.safetensors: missing"):
        load_xcodec2_decoder(tmp_path, config=TINY)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_xcodec2_decoder(bad, config=TINY)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json: not a usable XCodec2 config"):
        load_xcodec2_decoder(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_windows_equals_each_window_alone(dtype):
    """Right-padded windows of awkward lengths (1 frame, a prime, the longest) in one masked call: each
    row's samples are what its window decoded alone gives, and past its end there are zeros, even when
    the padding holds other codes (a float64 backbone: equal to the head's float32 rounding, so the mask,
    not luck, keeps rows apart)."""
    decoder = random_xcodec2_decoder(TINY, seed=5).to(dtype)
    generator = torch.Generator().manual_seed(11)
    lengths = [1, 13, 37, 6, 37]
    windows = [torch.randint(0, TINY.codebook_size, (n,), generator=generator) for n in lengths]
    longest = max(lengths)
    padded = torch.randint(0, TINY.codebook_size, (len(lengths), longest), generator=generator)  # junk padding
    for row, window in enumerate(windows):
        padded[row, : window.numel()] = window
    with torch.inference_mode():
        out = decoder.decode_windows(padded, torch.tensor(lengths))
        alone = [decoder(w[None])[0] for w in windows]
    assert out.shape == (len(lengths), longest * TINY.hop_samples) and out.dtype == alone[0].dtype
    tolerance = 1e-6 if dtype == torch.float64 else 2e-5
    for row, (n, expected) in enumerate(zip(lengths, alone)):
        scale = expected.abs().max().item()
        torch.testing.assert_close(out[row, : n * 320], expected, rtol=0, atol=tolerance * max(scale, 1.0))
        assert torch.equal(out[row, n * 320 :], torch.zeros(longest * 320 - n * 320, dtype=out.dtype))


def test_masked_group_norm_equals_group_norm_of_the_real_frames():
    from tilevox.models.xcodec2.model import masked_group_norm

    norm = torch.nn.GroupNorm(4, 12, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, 12, 9, dtype=torch.float64)
    x[1, :, 5:] = float("nan")  # padding never reaches the statistics
    mask = torch.tensor([[True] * 9, [True] * 5 + [False] * 4])[:, None, :]
    out = masked_group_norm(norm, x, mask)
    torch.testing.assert_close(out[0], norm(x[:1])[0])
    torch.testing.assert_close(out[1, :, :5], norm(x[1:, :, :5])[0])
