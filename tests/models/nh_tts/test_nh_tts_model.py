"""NH-TTS loading (strict, Hugging Face Dia layout + DAC folder), presets and regions, request validation,
stream bookkeeping, streamed audio against a full DAC decode, and `tilevox synth` at 44.1 kHz on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
import torch
from safetensors.torch import load_file, save_file

from tests.models.nh_tts.nh_reference import make_reference
from tilevox.models.dac.streaming import STREAM_MAX_ABS_ERROR
from tilevox.models.errors import CheckpointError, RequestError
from tilevox.models.nh_tts.generation import delay_prompt, undelay
from tilevox.models.nh_tts.loader import NETWORK_SHAPES, load_checkpoint, load_preset
from tilevox.models.nh_tts.model import (
    DAC_CHUNK,
    NH_DECODER_STEP,
    NH_ENCODER,
    NH_SAMPLING,
    NhTtsModel,
    StreamCapacityError,
)
from tilevox.models.nh_tts.tokenizer import encode_text
from tilevox.models.region_backends import region_module, set_region_backend
from tilevox.models.registry import load_model, meta_regions, preset_family
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import FinishReason, SynthesisRequest, VoicePrompt, synthesize
from tilevox.server.cli import main


@pytest.fixture(scope="module")
def tiny() -> NhTtsModel:
    return load_preset("nh-tts-tiny", device="cpu", dtype=torch.float32, max_streams=2)


def test_presets_aliases_and_regions():
    assert preset_family("random:nh-tts-1.6b").name == preset_family("random:dia-1.6b").name == "nh_tts"
    meta = meta_regions("dia-1.6b", dtype=torch.bfloat16)
    assert tuple(meta) == (NH_DECODER_STEP,)
    network = meta[NH_DECODER_STEP]
    assert all(p.device.type == "meta" for p in network.parameters())
    # Dia-1.6B's shapes: ~1.6 B parameters in all.
    assert 1.5e9 < sum(p.numel() for p in network.parameters()) < 1.7e9
    assert network.config == NETWORK_SHAPES["1.6b"] and network.config.delay_pattern == (
        0,
        8,
        9,
        10,
        11,
        12,
        13,
        14,
        15,
    )


def test_tokenizer_keeps_tags_and_bytes():
    assert encode_text("[S1] Hé [S2]") == [1, 32, 72, 195, 169, 32, 2]


def test_delay_pattern_round_trip(tiny):
    config = tiny.config
    codes = torch.randint(0, 1024, (7, 9))
    delayed = delay_prompt(config, codes, device="cpu")
    assert delayed.shape == (1 + 7 + 15, 9)
    assert (delayed[0] == config.bos_token_id).all() and delayed[9, 1] == codes[0, 1]
    assert torch.equal(undelay(config, delayed, 1, 8), codes.T)


def test_validation_names_the_field(tiny):
    with pytest.raises(RequestError, match="voice 'alloy' is unknown"):
        tiny.validate(SynthesisRequest(text="hi", voice="alloy"))
    with pytest.raises(RequestError, match="instructions"):
        tiny.validate(SynthesisRequest(text="hi", instructions="calm"))
    with pytest.raises(RequestError, match="Dia speaks English only"):
        tiny.validate(SynthesisRequest(text="hi", language="de"))
    samples = np.zeros(2048, dtype=np.float32)
    with pytest.raises(RequestError, match="transcript is required"):
        tiny.validate(SynthesisRequest(text="hi", voice_prompt=VoicePrompt(samples=samples, sample_rate_hz=44100)))
    with pytest.raises(RequestError, match="sampled at 44100 Hz"):
        tiny.validate(
            SynthesisRequest(text="hi", voice_prompt=VoicePrompt(samples=samples, sample_rate_hz=16000, transcript="x"))
        )
    with pytest.raises(RequestError, match="text is too long"):
        tiny.validate(SynthesisRequest(text="a" * 1100))
    tiny.validate(SynthesisRequest(text="[S2] fine", voice="S2"))


def test_capacity_close_and_length_finish(tiny):
    request = SynthesisRequest(text="one", max_duration_s=0.05, sampling=SamplingParams.greedy())  # 4 frames
    a, b = tiny.open_stream(request), tiny.open_stream(request)
    with pytest.raises(StreamCapacityError):
        tiny.open_stream(request)
    assert tiny.close(a) and not tiny.close(a)
    frames, chunk = 0, None
    while chunk is None or not chunk.is_finished:
        (chunk,) = tiny.step([b])
        frames += chunk.num_new_frames
    assert chunk.finish_reason is FinishReason.LENGTH and frames == 4
    assert tiny.open_stream_ids == ()


def test_streamed_audio_equals_a_full_decode(tiny):
    picked: dict[int, torch.Tensor] = {}
    tiny.code_observer = lambda sid, pos, codes: picked.__setitem__(pos, codes.clone())
    try:
        result = synthesize(tiny, SynthesisRequest(text="[S1] Chunked audio.", seed=3, max_duration_s=0.5))
    finally:
        tiny.code_observer = None
    sequence = torch.stack([picked[p] for p in sorted(picked)])
    sequence = torch.cat([torch.full((1, 9), tiny.config.bos_token_id), sequence])
    frames = undelay(tiny.config, sequence, 1, result.num_frames + 1)
    with torch.no_grad():
        full = tiny.codec.decode(frames[None])[0].numpy()
    assert result.samples.shape == full.shape == (result.num_frames * 512,)
    np.testing.assert_allclose(result.samples, full, atol=STREAM_MAX_ABS_ERROR, rtol=0)


def test_region_backends_are_called(tiny):
    assert region_module(tiny, NH_ENCODER) is tiny.network.encoder and region_module(tiny, DAC_CHUNK) is tiny.codec
    assert region_module(tiny, NH_SAMPLING) is tiny.network
    calls = {name: 0 for name in (NH_ENCODER, NH_DECODER_STEP, DAC_CHUNK, NH_SAMPLING)}
    conventional = {
        NH_ENCODER: tiny.network.encode_text,
        NH_DECODER_STEP: tiny.network.step,
        DAC_CHUNK: tiny.codec.decode_windows,
        NH_SAMPLING: tiny._pick_codes,
    }

    def counting(name):
        def run(*args):
            calls[name] += 1
            return conventional[name](*args)

        return run

    request = SynthesisRequest(text="hooks", seed=1, max_duration_s=0.3)
    want = synthesize(tiny, request).samples
    for name in calls:
        set_region_backend(tiny, name, counting(name))
    try:
        got = synthesize(tiny, request).samples
    finally:
        for name in calls:
            set_region_backend(tiny, name, None)
    assert all(calls.values()), calls
    np.testing.assert_array_equal(got, want)


def test_synth_writes_a_44_1_khz_wav(tmp_path):
    out = tmp_path / "x.wav"
    assert main(["synth", "--model", "random:nh-tts-tiny", "--text", "Hello there", "--out", str(out),
                 "--max-duration", "0.3", "--quiet"]) == 0  # fmt: skip
    samples, rate = soundfile.read(out)
    assert rate == 44100 and samples.size == 25 * 512


@pytest.fixture
def checkpoint(tmp_path):
    make_reference(tmp_path, "a", seed=2)
    return tmp_path


def test_registry_loads_the_hugging_face_layout(checkpoint):
    model = load_model(str(checkpoint))
    assert isinstance(model, NhTtsModel) and model.sample_rate_hz == 44100 and model.rows_per_stream == 1


@pytest.mark.parametrize("defect", ["missing", "unexpected", "misshaped"])
def test_loading_is_strict(checkpoint, defect):
    path = checkpoint / "model.safetensors"
    state = load_file(path)
    if defect == "missing":
        del state["model.decoder.layers.1.cross_attention.k_proj.weight"]
        match = "missing tensors: model.decoder.layers.1.cross_attention.k_proj.weight"
    elif defect == "unexpected":
        state["model.decoder.layers.9.mlp.down_proj.weight"] = torch.zeros(2, 2)
        match = "unexpected tensors: model.decoder.layers.9.mlp.down_proj.weight"
    else:
        state["logits_dense.weight"] = state["logits_dense.weight"][:-1]
        match = r"mis-shaped tensors: logits_dense.weight \[9251, 48\] \(expected \[9252, 48\]\)"
    save_file(state, path)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(checkpoint, device="cpu", dtype=torch.float32)


def test_dac_folder_and_config_errors(checkpoint, monkeypatch):
    monkeypatch.delenv("TILEVOX_DAC_DIR", raising=False)
    (checkpoint / "dac").rename(checkpoint / "elsewhere")
    with pytest.raises(CheckpointError, match="no DAC checkpoint found.*TILEVOX_DAC_DIR"):
        load_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    monkeypatch.setenv("TILEVOX_DAC_DIR", str(checkpoint / "elsewhere"))
    assert load_checkpoint(checkpoint, device="cpu", dtype=torch.float32).codec.num_codebooks == 9
    config = json.loads((checkpoint / "config.json").read_text())
    config["decoder_config"]["num_channels"] = "9"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="decoder_config.num_channels must be an integer"):
        load_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
