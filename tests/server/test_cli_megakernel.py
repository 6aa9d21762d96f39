"""`tilevox synth --megakernel`: bad region names are a one-line usage error listing the valid names; on
CPU the CUDA megakernel logs why each region stays conventional and the WAV equals a run without the
flag; the VM executor writes the same WAV; on a Hopper GPU (marked gpu) `--megakernel all` runs every
region through the kernel."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import soundfile
import torch

from tilevox.executor.megakernel import LOGGER_NAME
from tilevox.server.cli import main

PRESETS = ["llama-tiny", "qwen3-tts-tiny"]


def _synth(tmp_path, preset: str, name: str, *extra: str, device: str = "cpu") -> tuple[int, np.ndarray]:
    out = tmp_path / f"{name}.wav"
    code = main(
        [
            "synth",
            "--model",
            f"random:{preset}",
            "--text",
            "Hello there",
            "--out",
            str(out),
            "--max-duration",
            "0.3",
            "--temperature",
            "0",
            "--device",
            device,
            *extra,
        ]
    )
    return code, (soundfile.read(out, dtype="int16")[0] if code == 0 else np.zeros(0, dtype=np.int16))


def _regions(preset: str) -> list[str]:
    return ["decoder_step"] if preset == "llama-tiny" else ["talker_step", "code_predictor_loop", "codec_decode"]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME and r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "preset, regions, message",
    [
        ("llama-tiny", "talker_step", "unknown megakernel region(s) 'talker_step'; valid: decoder_step, all, none"),
        (
            "qwen3-tts-tiny",
            "talker_step,nope",
            "unknown megakernel region(s) 'nope'; valid: talker_step, code_predictor_loop, codec_decode, all, none",
        ),
    ],
)
def test_unknown_region_is_a_one_line_error(tmp_path, capsys, preset, regions, message):
    code, _ = _synth(tmp_path, preset, "bad", "--megakernel", regions)
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert err == [f"tilevox: error: {message}"]
    assert not (tmp_path / "bad.wav").exists()


@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_megakernel_on_cpu_logs_and_matches_conventional(tmp_path, caplog, preset):
    code, ref = _synth(tmp_path, preset, "ref")
    assert code == 0 and ref.size > 0
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        code, got = _synth(tmp_path, preset, "mk", "--megakernel", "all")
    assert code == 0
    assert _warnings(caplog) == [
        f"megakernel region {n}: conventional path: no CUDA device is visible" for n in _regions(preset)
    ]
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("preset", PRESETS)
def test_vm_executor_writes_the_conventional_wav(tmp_path, caplog, preset):
    _, ref = _synth(tmp_path, preset, "ref")
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        code, got = _synth(tmp_path, preset, "vm", "--megakernel", "all", "--megakernel-executor", "vm")
    assert code == 0 and _warnings(caplog) == []
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME] == [
        f"megakernel region {n}: vm executor" for n in _regions(preset)
    ]
    # The decoder regions give the same tokens and audio bit for bit; the codec region's transformer sums in
    # another order (fp32), so its samples may differ by one int16 step.
    step = 1 if "codec_decode" in _regions(preset) else 0
    np.testing.assert_allclose(got.astype(np.int32), ref.astype(np.int32), atol=step, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_synth_cuda_bf16_megakernel_all(tmp_path, caplog, preset):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the megakernel runs on sm_90 (Hopper) only")
    from tilevox.trt_plugins.library import kernels_library

    try:
        kernels_library().tilevox_megakernel_launch  # noqa: B018
    except (OSError, AttributeError) as exc:
        pytest.skip(f"libtilevox_kernels.so with the megakernel is not available: {exc}")
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        code, got = _synth(tmp_path, preset, "gpu", "--dtype", "bf16", "--megakernel", "all", device="cuda")
    assert code == 0 and got.size > 0
    # every region was installed and no call fell back
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME] == [
        f"megakernel region {n}: cuda executor" for n in _regions(preset)
    ]


def test_auto_fused_swiglu_yields_to_megakernel_regions():
    from tilevox.models.fused_swiglu import FusedSwiglu
    from tilevox.server.cli import _fused_swiglu_mode, build_parser

    def mode(*extra: str) -> FusedSwiglu:
        args = build_parser().parse_args(["synth", "--model", "m", "--text", "t", "--out", "x.wav", *extra])
        return _fused_swiglu_mode(args)

    assert mode() is FusedSwiglu.AUTO
    assert mode("--megakernel", "none") is FusedSwiglu.AUTO
    assert mode("--megakernel", "all") is FusedSwiglu.OFF
    assert mode("--megakernel", "all", "--fused-swiglu", "on") is FusedSwiglu.ON
