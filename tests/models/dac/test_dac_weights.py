"""random_dac determinism and sizes; load_dac strictness (without transformers: our own state written in
the save_pretrained layout)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.models.dac.conftest import TINY, weight_normed, write_checkpoint
from tilevox.models.dac import DAC_PRESETS, DacCodec, load_dac, random_dac
from tilevox.models.errors import CheckpointError

CONV_WEIGHT = "decoder.block.1.res_unit2.conv1.weight"
CONV = CONV_WEIGHT.removesuffix(".weight")


@pytest.fixture
def state(tiny_codec) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_codec.state_dict().items()}


def test_random_is_seeded(tiny_codec):
    again, other = random_dac(TINY, seed=3), random_dac(TINY, seed=4)
    for (name, a), b in zip(tiny_codec.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(tiny_codec.decoder.conv2.weight, other.decoder.conv2.weight)


def test_attributes_and_shapes(tiny_codec):
    codec = tiny_codec
    assert (codec.sample_rate_hz, codec.hop_length, codec.num_codebooks, codec.codebook_size) == (44100, 512, 9, 1024)
    codes = torch.randint(0, 1024, (2, 9, 5))
    with torch.inference_mode():
        audio = codec(codes)
        recoded = codec.encode(audio[:, None])
    assert audio.shape == (2, 5 * 512) and audio.dtype == torch.float32 and torch.isfinite(audio).all()
    assert recoded.shape == (2, 9, 5) and recoded.dtype == torch.long
    assert int(recoded.min()) >= 0 and int(recoded.max()) < 1024


def test_bf16_close_to_fp32(tiny_codec):
    low = random_dac(TINY, seed=3, dtype=torch.bfloat16)
    codes = torch.randint(0, 1024, (1, 9, 20))
    with torch.inference_mode():
        ref, out = tiny_codec(codes), low(codes)
    assert out.dtype == torch.bfloat16
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.1, f"bf16 vs fp32 relative L2 error {rel:.3f}"


def test_bad_codes_are_refused(tiny_codec):
    with pytest.raises(ValueError, match=r"int64 \(batch, 9, frames\)"):
        tiny_codec.decode(torch.zeros(1, 8, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="float"):
        tiny_codec.encode(torch.zeros(1, 1, 1024, dtype=torch.long))


def test_tiny_decode_is_fast(tiny_codec):
    codes = torch.randint(0, 1024, (1, 9, 200))
    with torch.inference_mode():
        tiny_codec(codes)
        start = time.perf_counter()
        tiny_codec(codes)
        elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"tiny decode of 200 frames took {elapsed:.3f} s"


@pytest.mark.parametrize("layout", ["plain", "parametrized", "old"])
def test_layouts_load_identically(tiny_codec, state, tmp_path, layout):
    if layout != "plain":
        state = weight_normed(state, old_names=layout == "old")
    loaded = load_dac(write_checkpoint(tmp_path, TINY.to_dict(), state))
    for (name, a), b in zip(tiny_codec.state_dict().items(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_dtype_and_device_follow_the_arguments(state, tmp_path):
    loaded = load_dac(write_checkpoint(tmp_path, TINY.to_dict(), state), dtype=torch.float64)
    assert loaded.dtype == torch.float64 and loaded.device.type == "cpu" and not loaded.training


def _load_error(tmp_path, state, config=None) -> str:
    folder = write_checkpoint(tmp_path, TINY.to_dict() if config is None else config, state)
    with pytest.raises(CheckpointError) as info:
        load_dac(folder)
    return str(info.value)


def test_missing_tensor_is_named(state, tmp_path):
    del state[CONV_WEIGHT]
    assert f"missing tensor {CONV_WEIGHT!r}" in _load_error(tmp_path, state)


def test_unexpected_tensor_is_named(state, tmp_path):
    state["decoder.block.9.conv_t1.weight"] = torch.zeros(2, 2, 2)
    assert "unexpected tensor(s) for this config: decoder.block.9.conv_t1.weight" in _load_error(tmp_path, state)


def test_wrong_shape_is_named(state, tmp_path):
    state["quantizer.quantizers.4.codebook.weight"] = torch.zeros(512, 8)
    message = _load_error(tmp_path, state)
    assert "'quantizer.quantizers.4.codebook.weight' has shape (512, 8), expected (1024, 8)" in message


def test_integer_tensor_is_refused(state, tmp_path):
    state[CONV_WEIGHT] = state[CONV_WEIGHT].to(torch.int32)
    assert f"{CONV_WEIGHT!r} has dtype torch.int32" in _load_error(tmp_path, state)


def test_half_a_weight_norm_pair_is_named(state, tmp_path):
    normed = weight_normed(state)
    del normed[f"{CONV}.parametrizations.weight.original1"]
    assert f"{CONV}.parametrizations.weight.original0" in _load_error(tmp_path, normed)


def test_plain_and_weight_normed_twice_is_refused(state, tmp_path):
    normed = weight_normed(state)
    normed[CONV_WEIGHT] = state[CONV_WEIGHT]
    assert f"{CONV_WEIGHT!r} is stored twice" in _load_error(tmp_path, normed)


def test_bad_weight_norm_magnitude_shape_is_named(state, tmp_path):
    normed = weight_normed(state, old_names=True)
    normed[f"{CONV}.weight_g"] = normed[f"{CONV}.weight_g"].flatten()
    assert f"magnitude '{CONV}.weight_g' has shape" in _load_error(tmp_path, normed)


def test_bad_config_is_a_checkpoint_error(state, tmp_path):
    config = TINY.to_dict() | {"codebook_size": 512}
    message = _load_error(tmp_path, state, config)  # the config parses; the codebook shapes then differ
    assert "codebook.weight' has shape (1024, 8), expected (512, 8)" in message
    assert "unknown DAC config field(s) causal" in _load_error(tmp_path, state, TINY.to_dict() | {"causal": True})


def test_missing_files_are_named(state, tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", TINY.to_dict(), state)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_dac(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: unreadable JSON"):
        load_dac(folder)
    (folder / "config.json").write_text(json.dumps(TINY.to_dict()))
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: missing"):
        load_dac(folder)


def test_full_preset_builds_on_meta():
    codec = DacCodec(DAC_PRESETS["dac-44khz"], device="meta")
    params = sum(p.numel() for p in codec.parameters())
    assert 70e6 < params < 80e6  # descript/dac_44khz has ~76M parameters
