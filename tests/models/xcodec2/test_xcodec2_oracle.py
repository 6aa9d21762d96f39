"""Parity with the xcodec2 package: a tiny decoder built from the package's own classes, saved in
the official checkpoint layout, loaded by tilevox and decoded through `XCodec2Model.decode_code`."""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import save_file

from tilevox.models.xcodec2 import XCodec2Config, load_xcodec2_decoder
from tilevox.models.xcodec2.model import fsq_indices_to_codes

pytestmark = pytest.mark.oracle

TINY = XCodec2Config.preset("tiny")
MAX_ABS_ERROR_FP32 = 1e-4


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values for every parameter, norms and biases included, so that a swapped or
    skipped tensor shows up in the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() >= 2:
                param.copy_(noise * param[0].numel() ** -0.5)
            elif name.endswith("weight"):  # norm scales
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.1 * noise)


@pytest.fixture(scope="module")
def package_model(xcodec2_vocos):
    """A stand-in for XCodec2Model holding what `decode_code` touches: `generator` and `fc_post_a`."""
    torch.manual_seed(0)  # the package's constructors draw from the global RNG
    generator = xcodec2_vocos.CodecDecoderVocos(
        hidden_dim=TINY.hidden_size, depth=TINY.num_layers, heads=TINY.num_heads, pos_meb_dim=TINY.rope_dim
    ).eval()
    fc_post_a = torch.nn.Linear(2048, TINY.hidden_size)
    holder = types.SimpleNamespace(generator=generator, fc_post_a=fc_post_a)
    _randomize(generator, seed=1)
    _randomize(fc_post_a, seed=2)
    return holder


def _official_state_dict(holder) -> dict[str, torch.Tensor]:
    state = {f"generator.{k}": v for k, v in holder.generator.state_dict().items()}
    state.update({f"fc_post_a.{k}": v for k, v in holder.fc_post_a.state_dict().items()})
    # Encoder-side tensors an official checkpoint also holds (the loader must skip them).
    state["fc_prior.weight"] = torch.randn(8, 8)
    state["CodecEnc.conv_blocks.0.weight"] = torch.randn(4, 1, 7)
    state["semantic_model.encoder.layers.0.ffn1.weight"] = torch.randn(4, 4)
    state["SemanticEncoder_module.initial_conv.weight"] = torch.randn(4, 4, 3)
    return {k: v.contiguous() for k, v in state.items()}


@pytest.fixture(scope="module")
def checkpoint_file(package_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("xcodec2") / "model.safetensors"
    save_file(_official_state_dict(package_model), str(path))
    return path


def test_fsq_codes_match_package_codebook(xcodec2_vocos):
    fsq = xcodec2_vocos.ResidualFSQ(dim=2048, levels=list(TINY.fsq_levels), num_quantizers=1).layers[0]
    indices = torch.arange(TINY.codebook_size)
    ours = fsq_indices_to_codes(indices, torch.tensor(TINY.fsq_levels))
    torch.testing.assert_close(ours, fsq.implicit_codebook.float(), rtol=0, atol=0)


@pytest.mark.parametrize("num_frames", [1, 37, 199])
def test_decode_matches_package(package_model, checkpoint_file, xcodec2_modeling, num_frames):
    ours = load_xcodec2_decoder(checkpoint_file, config=TINY)
    gen = torch.Generator().manual_seed(100 + num_frames)
    codes = torch.randint(0, TINY.codebook_size, (2, num_frames), generator=gen)
    expected = xcodec2_modeling.XCodec2Model.decode_code(package_model, codes.unsqueeze(1))  # (B, 1, T * hop)
    with torch.inference_mode():
        actual = ours(codes)
    assert expected.shape == (2, 1, num_frames * TINY.hop_samples)
    assert actual.shape == (2, num_frames * TINY.hop_samples)
    max_abs = (actual - expected[:, 0]).abs().max().item()
    assert max_abs <= MAX_ABS_ERROR_FP32, f"max abs diff {max_abs:.3g} over {num_frames} frames"


def test_torch_checkpoint_layout_loads_the_same(package_model, checkpoint_file, tmp_path):
    """A .pth holding the same keys (wrapped in "state_dict" as Lightning saves) loads identically."""
    pth = tmp_path / "ckpt.pth"
    torch.save({"state_dict": _official_state_dict(package_model)}, pth)
    from_pth = load_xcodec2_decoder(pth, config=TINY)
    from_safetensors = load_xcodec2_decoder(checkpoint_file, config=TINY)
    for (name, a), (_, b) in zip(from_pth.state_dict().items(), from_safetensors.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
