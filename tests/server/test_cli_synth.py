"""`tilevox synth`: writes a WAV for a tiny preset; bad input gives one line and a non-zero exit."""

import subprocess
import sys

import numpy as np
import pytest
import soundfile

from tilevox.server.cli import main


@pytest.mark.parametrize("preset,rate", [("llama-tiny", 16000), ("qwen3-tts-tiny", 24000)])
def test_synth_writes_wav(tmp_path, capsys, preset, rate):
    out = tmp_path / "x.wav"
    code = main(
        ["synth", "--model", f"random:{preset}", "--text", "Hello there", "--out", str(out), "--max-duration", "1.0"]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "random weights" in captured.err
    assert "time to first audio" in captured.out and "real-time factor" in captured.out
    audio, sample_rate = soundfile.read(out)
    assert sample_rate == rate and audio.size > 0


def test_synth_decode_mode_reaches_the_model(tmp_path, monkeypatch):
    """--decode-mode official-chunked loads Qwen3-TTS with the official package's chunked codec decode."""
    from tilevox.models import registry

    loaded = []
    real_load = registry.load_model

    def spy(*args, **kwargs):
        loaded.append(real_load(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(registry, "load_model", spy)
    out = tmp_path / "x.wav"
    argv = ["synth", "--model", "random:qwen3-tts-tiny", "--text", "Hi", "--out", str(out), "--max-duration", "0.5"]
    assert main([*argv, "--decode-mode", "official-chunked", "--quiet"]) == 0
    assert loaded[-1].options.decode_mode == "official_chunked"
    assert main([*argv, "--quiet"]) == 0
    assert loaded[-1].options.decode_mode == "exact"


def test_synth_warmup_runs_the_request_first_and_writes_the_same_audio(tmp_path, capsys, monkeypatch):
    """--warmup N: N untimed runs of the same request (synth imports synthesize from models.streaming
    when it runs), then the reported one, whose audio is what a cold run writes."""
    from tilevox.models import streaming

    runs = []
    original = streaming.synthesize

    def counting(*args, **kwargs):
        runs.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(streaming, "synthesize", counting)
    argv = ["synth", "--model", "random:llama-tiny", "--text", "Hello", "--max-duration", "0.4", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "a.wav")]) == 0
    assert main([*argv, "--out", str(tmp_path / "b.wav"), "--warmup", "2"]) == 0
    assert len(runs) == 4 and len({r.text for r in runs}) == 1
    assert "warm-up: 2 untimed run(s)" in capsys.readouterr().err
    np.testing.assert_array_equal(soundfile.read(tmp_path / "a.wav")[0], soundfile.read(tmp_path / "b.wav")[0])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "random:llama-tiny", "--text", "  "], "text"),
        (["--model", "random:no-such-model", "--text", "hi"], "unknown preset"),
        (["--model", "/nonexistent/dir", "--text", "hi"], "unknown model"),
        (["--model", "random:llama-tiny", "--text", "hi", "--voice", "nobody"], "voice"),
        (["--model", "random:llama-tiny", "--text", "hi", "--decode-mode", "official-chunked"], "no decode_mode"),
    ],
)
def test_synth_bad_input_is_one_line(tmp_path, args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "tilevox.server.cli", "synth", *args, "--out", str(tmp_path / "x.wav")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line and not line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("tilevox: error:") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_synth_unreadable_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tilevox.server.cli",
            "synth",
            "--model",
            str(ckpt),
            "--text",
            "hi",
            "--out",
            str(tmp_path / "x.wav"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("tilevox: error:") and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("on", {"talker_step", "code_predictor_loop", "codec_decode", "token_sampling", "talker_prefill"}),
        ("auto", set()),
        ("off", set()),
    ],
)
def test_synth_cuda_graphs_flag_installs_the_executor(tmp_path, caplog, flag, expected):
    """--cuda-graphs on runs the executor's region backends (eagerly on a CPU); auto leaves a CPU model plain."""
    import logging

    caplog.set_level(logging.INFO, logger="tilevox.executor")
    out = tmp_path / "x.wav"
    argv = ["synth", "--model", "random:qwen3-tts-tiny", "--text", "Hi", "--out", str(out), "--max-duration", "0.5"]
    assert main([*argv, "--cuda-graphs", flag, "--quiet"]) == 0
    installed = {
        r.getMessage().split()[1].rstrip(":") for r in caplog.records if r.getMessage().endswith("executor (eager)")
    }
    assert installed == expected
    assert soundfile.read(out)[0].size > 0


def test_synth_compile_needs_the_executor(tmp_path, capsys):
    """--compile on compiles the executor's regions: without the executor (a CPU with --cuda-graphs auto,
    or off) it is a usage error naming the fix, not a silently uncompiled run."""
    argv = ["synth", "--model", "random:qwen3-tts-tiny", "--text", "Hi", "--out", str(tmp_path / "x.wav")]
    assert main([*argv, "--compile", "on", "--quiet"]) != 0
    assert "needs --cuda-graphs on" in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()


def test_synth_graph_prefill_flag_installs_the_prefill_region(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="tilevox.executor")
    argv = ["synth", "--model", "random:qwen3-tts-tiny", "--text", "Hi", "--out", str(tmp_path / "x.wav")]
    for flag in (["--graph-prefill", "on"], []):  # auto (the default): on wherever the executor runs
        caplog.clear()
        assert main([*argv, "--max-duration", "0.3", "--cuda-graphs", "on", *flag, "--quiet"]) == 0
        assert any(r.getMessage() == "region talker_prefill: executor (eager)" for r in caplog.records), flag
    caplog.clear()
    assert main([*argv, "--max-duration", "0.3", "--cuda-graphs", "on", "--graph-prefill", "off", "--quiet"]) == 0
    assert any("region talker_prefill: off" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert main([*argv, "--max-duration", "0.3", "--quiet"]) == 0  # no executor on a CPU: auto asks for nothing
    assert not any("talker_prefill" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("flag", ["--prefill-stream", "--codec-stream"])
def test_synth_side_streams_need_a_gpu(tmp_path, capsys, flag):
    """--prefill-stream / --codec-stream on move work onto CUDA streams of its own: on a CPU it is a usage
    error, without the executor (naming the fix) and with it (the executor says it needs a CUDA device)."""
    argv = ["synth", "--model", "random:qwen3-tts-tiny", "--text", "Hi", "--out", str(tmp_path / "x.wav")]
    assert main([*argv, flag, "on", "--quiet"]) != 0
    assert "needs --cuda-graphs on" in capsys.readouterr().err
    assert main([*argv, flag, "on", "--cuda-graphs", "on", "--quiet"]) != 0
    assert f"{flag} on: needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()


def test_synth_refuses_a_prefill_stream_for_llasa(tmp_path, capsys):
    """Llasa does not support --prefill-stream yet (models.llasa.model says why): the flag is a usage error
    naming the model, before any device check, and no audio is written."""
    out = tmp_path / "x.wav"
    argv = ["synth", "--model", "random:llama-tiny", "--text", "Hi", "--out", str(out), "--quiet"]
    assert main([*argv, "--prefill-stream", "on", "--cuda-graphs", "on"]) != 0
    assert "--prefill-stream on: random:llama-tiny prefills on the current stream only" in capsys.readouterr().err
    assert not out.exists()
