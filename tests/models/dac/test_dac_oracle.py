"""Parity with transformers' DacModel: tiny random reference models saved by `save_pretrained`, loaded by
`load_dac`; codes, quantizer latents and waveforms compared (fp32 and fp64)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tilevox.models.dac import DAC_PRESETS, DacCodec, DacConfig, load_dac

pytestmark = pytest.mark.oracle

MAX_ABS_ERROR_FP32 = 1e-4
MAX_ABS_ERROR_FP64 = 1e-10

# Two shapes of the reference (stride sets, widths, codebooks differ), each with its own seed; the
# first is saved weight-normed (as trained DAC checkpoints are), the second with plain weights.
REFERENCES = {
    "wn-2x4": (
        dict(encoder_hidden_size=4, downsampling_ratios=[2, 4], decoder_hidden_size=32, n_codebooks=3,
             codebook_size=16, codebook_dim=4, sampling_rate=8000),
        11,
        True,
    ),
    "plain-2x2x4": (
        dict(encoder_hidden_size=2, downsampling_ratios=[2, 2, 4], decoder_hidden_size=48, n_codebooks=4,
             codebook_size=32, codebook_dim=8, sampling_rate=16000),
        12,
        False,
    ),
}  # fmt: skip


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values for every parameter (biases and snake alphas included), scaled so the
    output stays clear of tanh's saturation."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("alpha"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            elif name.endswith("codebook.weight"):
                param.copy_(0.5 * noise)
            elif param.dim() >= 2:
                scale = 0.3 if ("res_unit" in name and "conv2" in name) else 1.0
                param.copy_(noise * scale * param[0].numel() ** -0.5)
            else:
                param.copy_(0.05 * noise)


@pytest.fixture(scope="module", params=sorted(REFERENCES))
def reference(request, hf_dac, tmp_path_factory):
    """(transformers model, its save_pretrained folder)."""
    kwargs, seed, weight_norm = REFERENCES[request.param]
    model = hf_dac.DacModel(hf_dac.DacConfig(**kwargs)).eval()
    _randomize(model, seed)
    if weight_norm:
        model.apply_weight_norm()
    folder = tmp_path_factory.mktemp(f"dac-{request.param}")
    model.save_pretrained(folder)
    return model, folder


def _codes(config: DacConfig, batch: int, frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.codebook_size, (batch, config.n_codebooks, frames), generator=gen)


def test_saved_names_are_what_the_loader_folds(reference):
    model, folder = reference
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    normed = any(".parametrizations.weight.original0" in k for k in keys)
    assert normed == any("parametrizations" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("extra_samples", [0, 5])
def test_encode_matches(reference, extra_samples):
    model, folder = reference
    ours = load_dac(folder)
    gen = torch.Generator().manual_seed(7)
    wav = 0.5 * torch.randn(2, 1, 29 * ours.hop_length + extra_samples, generator=gen)
    with torch.inference_mode():
        expected = model.encode(wav).audio_codes
        actual = ours.encode(wav)
    assert actual.dtype == torch.long and actual.shape == expected.shape == (2, ours.num_codebooks, 29)
    assert torch.equal(actual, expected)
    assert len(actual.unique()) > ours.codebook_size // 4  # the codebooks are really exercised


@pytest.mark.parametrize("frames", [1, 17, 64])
def test_latent_and_decode_match(reference, frames):
    model, folder = reference
    ours = load_dac(folder)
    codes = _codes(ours.config, 2, frames, seed=frames)
    with torch.inference_mode():
        expected_latent = model.quantizer.from_codes(codes)[0]
        expected = model.decode(audio_codes=codes).audio_values
        latent, audio = ours.codes_to_latent(codes), ours.decode(codes)
    assert audio.shape == expected.shape == (2, frames * ours.hop_length) and audio.dtype == torch.float32
    assert (latent - expected_latent).abs().max().item() <= MAX_ABS_ERROR_FP32
    max_abs = (audio - expected).abs().max().item()
    assert max_abs <= MAX_ABS_ERROR_FP32, f"max abs diff {max_abs:.3g} over {frames} frames"
    # Neither silent nor saturated, or differences would not show.
    assert audio.std().item() > 0.05 and (audio.abs() > 0.99).float().mean().item() < 0.05


def test_float64_round_trip_matches(reference):
    """In float64 the only differences are summation order: encoder latent, codes and waveform agree to
    ~1e-12, so the fp32 tolerance above hides no structural error."""
    model, folder = reference
    model64 = type(model)(model.config).eval()
    if any("parametrizations" in name for name, _ in model.named_parameters()):
        model64.apply_weight_norm()
    model64.load_state_dict(model.state_dict())
    model64 = model64.double()
    ours = load_dac(folder, dtype=torch.float64)
    wav = 0.5 * torch.randn(1, 1, 23 * ours.hop_length, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.inference_mode():
        latent_error = (ours.encoder(wav) - model64.encoder(wav)).abs().max().item()
        codes = ours.encode(wav)
        expected_codes = model64.encode(wav).audio_codes
        audio, expected = ours.decode(codes), model64.decode(audio_codes=codes).audio_values
    assert latent_error <= MAX_ABS_ERROR_FP64
    assert torch.equal(codes, expected_codes)
    assert audio.dtype == torch.float64
    assert (audio - expected).abs().max().item() <= MAX_ABS_ERROR_FP64


def test_old_weight_norm_names_load_the_same(reference, tmp_path):
    """`weight_g` / `weight_v` (torch's old weight-norm hook) load like the parametrization names."""
    _, folder = reference
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        state = {k: handle.get_tensor(k) for k in handle.keys()}
    renamed = {
        k.replace(".parametrizations.weight.original0", ".weight_g").replace(
            ".parametrizations.weight.original1", ".weight_v"
        ): v
        for k, v in state.items()
    }
    tmp_path.joinpath("config.json").write_text((folder / "config.json").read_text())
    save_file(renamed, str(tmp_path / "model.safetensors"))
    for a, b in zip(load_dac(folder).state_dict().values(), load_dac(tmp_path).state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weight_norm", [False, True])
def test_full_size_layout_matches_reference(hf_dac, tmp_path, weight_norm):
    """descript/dac_44khz's config parses to our preset, and the reference's tensor names and shapes (plain
    or weight-normed, built on the meta device) are what our 44.1 kHz codec folds them into."""
    preset = DAC_PRESETS["dac-44khz"]
    config = hf_dac.DacConfig(**{k: v for k, v in preset.to_dict().items() if k in _HF_ARGS})
    config.save_pretrained(tmp_path)
    assert DacConfig.from_dict(json.loads((tmp_path / "config.json").read_text())) == preset
    with torch.device("meta"):
        model = hf_dac.DacModel(config)
        if weight_norm:
            model.apply_weight_norm()
        ours = DacCodec(preset)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    folded = {}
    for name, shape in theirs.items():
        if name.endswith(".parametrizations.weight.original0"):
            continue
        folded[name.replace(".parametrizations.weight.original1", ".weight")] = shape
    assert folded == {k: tuple(v.shape) for k, v in ours.state_dict().items()}


_HF_ARGS = (
    "encoder_hidden_size",
    "downsampling_ratios",
    "decoder_hidden_size",
    "n_codebooks",
    "codebook_size",
    "codebook_dim",
    "sampling_rate",
)
