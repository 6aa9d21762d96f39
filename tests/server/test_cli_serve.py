"""`tilevox serve` / `tilevox voices` as a user runs them: option checks before the model loads, ports that
are taken, authentication that cannot be switched off by accident, JSON-only logs, a forced second Ctrl-C."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port, serve_subprocess, wait_ready
from tilevox.server.bench import serve_command
from tilevox.server.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["--api-key", ""], {}, "--api-key is empty"),
        (["--api-key", "   "], {}, "--api-key is empty"),
        ([], {"TILEVOX_API_KEY": ""}, "TILEVOX_API_KEY is empty"),
        (["--max-streams", "0"], {}, "--max-streams must be >= 1, got 0"),
        (["--max-streams", "-3"], {}, "--max-streams must be >= 1"),
        (["--switch-interval-ms", "0"], {}, "--switch-interval-ms must be > 0, got 0.0"),
        (["--switch-interval-ms", "nan"], {}, "--switch-interval-ms must be > 0, got nan"),
        (["--newcomer-slack-ms", "-1"], {}, "--newcomer-slack-ms must be milliseconds >= 0 or 'off', got '-1'"),
        (["--newcomer-slack-ms", "soon"], {}, "--newcomer-slack-ms must be milliseconds >= 0 or 'off'"),
        (["--profile-steps", "-1"], {}, "profile_steps and profile_skip must be >= 0"),
    ],
)
def test_bad_options_fail_before_the_model_loads(argv, env, message, capsys, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("tilevox.models.registry.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", "--model", "random:llama-tiny", "--http-port", "0", "--grpc-port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert f"tilevox: error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_a_taken_port_fails_fast_and_names_itself(which, capsys, monkeypatch):
    monkeypatch.setattr("tilevox.models.registry.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        ports = {
            "http": ["--http-port", str(port), "--grpc-port", "0"],
            "grpc": ["--http-port", "0", "--grpc-port", str(port)],
        }[which]
        assert main(["serve", "--host", "127.0.0.1", "--model", "random:llama-tiny", *ports]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "serving" not in err


@pytest.mark.slow
def test_a_second_server_cannot_share_the_grpc_port():
    first, http_port, grpc_port = serve_subprocess()
    try:
        wait_ready(first, http_port)
        second = subprocess.run(
            serve_command(free_port(), grpc_port),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2 and f"127.0.0.1:{grpc_port}" in second.stderr, second.stderr[-2000:]
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)


def _read_all(url: str, headers: dict, outcome: list) -> None:
    try:
        with httpx.stream(
            "POST", url, json={"input": "long " * 200, "max_duration_s": 60}, headers=headers, timeout=30
        ) as r:
            outcome.append(sum(len(b) for b in r.iter_bytes()))
    except httpx.HTTPError as exc:  # the forced exit cuts this stream
        outcome.append(type(exc).__name__)


@pytest.mark.slow
def test_logs_are_one_json_object_per_line_and_a_second_ctrl_c_forces_exit():
    proc, http_port, _ = serve_subprocess("--drain-timeout", "60", "--api-key", "k")
    try:
        wait_ready(proc, http_port)
        url = f"http://127.0.0.1:{http_port}/v1/audio/speech"
        auth = {"authorization": "Bearer k"}
        httpx.post(url, content=b'{"input": ' + b"[" * 5000, headers=auth)  # rejected: logged
        httpx.post(url, json={"input": "x"})  # 401: logged
        # a long stream (read by a client thread) keeps the drain busy, so the second SIGINT is what ends it
        outcome: list = []
        reader = threading.Thread(target=_read_all, args=(url, auth, outcome), daemon=True)
        reader.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # the first Ctrl-C drains: the stream is still running
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        out, err = proc.communicate(timeout=20)
        assert time.monotonic() - started < 5 and proc.returncode == 130
        reader.join(10)
        assert outcome == ["RemoteProtocolError"]  # the stream was cut, visibly
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    # the CLI's own human lines come before logging is configured and start with "tilevox:" / "warning:"
    log_lines = [ln for ln in lines if not ln.startswith(("tilevox:", "warning:"))]
    events = [json.loads(ln) for ln in log_lines]  # every other line is one JSON object
    names = [e["event"] for e in events]
    assert "server.ready" in names and "speech.rejected" in names and "server.forced_exit" in names


def test_help_lists_presets_and_voices_lists_aliases(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "qwen3-tts-0.6b" in capsys.readouterr().out
    assert main(["voices", "--model", "random:llama-tiny", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    ids = {v["id"] for v in listed["voices"]}
    assert "alloy" in ids and listed["model"] == "random:llama-tiny"


def test_an_unexpected_error_shows_its_cause_and_exits_1(capsys, monkeypatch):
    def boom(*args, **kwargs):
        try:
            raise OSError("device-side assert")
        except OSError as inner:
            raise RuntimeError("CUDA error: an illegal memory access was encountered") from inner

    monkeypatch.setattr("tilevox.models.streaming.synthesize", boom)
    assert (
        main(["synth", "--model", "random:llama-tiny", "--text", "hi", "--out", "/tmp/tilevox_cli_boom.wav", "--quiet"])
        == 1
    )
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: CUDA error: an illegal memory access" in err and "caused by OSError" in err


def test_switch_interval_is_set_while_serving(monkeypatch):
    seen = []
    monkeypatch.setattr("tilevox.server.app.serve", lambda *a, **k: seen.append(sys.getswitchinterval()))
    previous = sys.getswitchinterval()
    try:
        argv = ["serve", "--model", "random:llama-tiny", "--device", "cpu", "--http-port", "0", "--grpc-port", "0"]
        assert main([*argv, "--switch-interval-ms", "0.5"]) == 0
    finally:
        sys.setswitchinterval(previous)
    assert seen == [pytest.approx(0.0005)]


@pytest.mark.parametrize("value,expected", [("off", None), ("OFF", None), ("0", 0.0), ("150", 0.15)])
def test_newcomer_slack_reaches_the_config(value, expected, monkeypatch):
    seen = []
    monkeypatch.setattr("tilevox.server.app.serve", lambda config, *a, **k: seen.append(config.newcomer_slack_s))
    argv = ["serve", "--model", "random:llama-tiny", "--device", "cpu", "--http-port", "0", "--grpc-port", "0"]
    assert main([*argv, "--newcomer-slack-ms", value]) == 0
    assert seen == [expected]
