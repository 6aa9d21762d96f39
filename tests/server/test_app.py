"""Process-level behaviour: SIGTERM-style drain, the drain deadline, config validation, and
`tilevox serve` as a new user runs it (subprocess, curl-equivalent request, SIGTERM)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile

from tests.server.conftest import serve_subprocess, wait_ready
from tests.server.fake_model import FakeSpeechModel
from tilevox.server.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]


def test_drain_lets_active_streams_finish_and_refuses_new_ones(server_factory):
    server = server_factory(FakeSpeechModel(step_delay_s=0.004), max_streams=2, drain_timeout_s=10.0)
    url = server.http_url + "/v1/audio/speech"
    result = {}

    def long_request():
        r = httpx.post(url, json={"input": "d" * 150, "response_format": "pcm", "sample_rate": 16000}, timeout=30)
        result["status"], result["bytes"] = r.status_code, len(r.content)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 5
    while server.state.scheduler.num_active == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    server.request_stop()
    time.sleep(0.05)
    r = httpx.post(url, json={"input": "late", "response_format": "pcm"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert httpx.get(server.http_url + "/ready").status_code == 503
    t.join(10)
    assert result == {"status": 200, "bytes": 150 * 320 * 2}  # the active stream ran to its end


def test_drain_deadline_cuts_streams_that_run_too_long(server_factory):
    server = server_factory(FakeSpeechModel(step_delay_s=0.004), max_streams=1, drain_timeout_s=0.3)
    url = server.http_url + "/v1/audio/speech"
    result = {}

    def very_long():
        try:
            r = httpx.post(url, json={"input": "v" * 4000, "response_format": "pcm", "max_duration_s": 100}, timeout=30)
            result["bytes"] = len(r.content)
        except httpx.RemoteProtocolError as exc:  # a cut stream aborts its body: it never looks finished
            result["error"] = type(exc).__name__

    t = threading.Thread(target=very_long)
    t.start()
    while server.state.scheduler.num_active == 0:
        time.sleep(0.005)
    started = time.monotonic()
    server.stop(timeout_s=10)
    assert time.monotonic() - started < 3.0
    t.join(10)
    assert result == {"error": "RemoteProtocolError"}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"http_port": 70000}, "http_port"),
        ({"http_port": 9000, "grpc_port": 9000}, "differ"),
        ({"max_streams": 0}, "max_streams"),
        ({"max_batch": 99}, "max_batch"),
        ({"api_key": " "}, "api_key"),
        ({"device": "tpu"}, "device"),
        ({"idle_timeout_s": 0}, "idle_timeout_s"),
        ({"warmup_streams": (1, 33)}, "warmup_streams"),
        ({"warmup_streams": ()}, "warmup_streams"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kwargs)


@pytest.mark.slow
def test_tilevox_serve_then_readme_curl_gives_playable_wav(tmp_path):
    proc, http_port, _ = serve_subprocess()
    try:
        base = f"http://127.0.0.1:{http_port}"
        wait_ready(proc, http_port)
        # the README's curl example, as JSON
        r = httpx.post(
            base + "/v1/audio/speech",
            json={
                "model": "tts-1",
                "input": "Hello from tilevox.",
                "voice": "alloy",
                "response_format": "wav",
                "max_duration_s": 1,
            },
            timeout=30,
        )
        assert r.status_code == 200
        path = tmp_path / "out.wav"
        path.write_bytes(r.content)
        samples, rate = soundfile.read(path)
        assert rate == 16000 and len(samples) == 16000 and np.abs(samples).max() > 0
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert "no --model given: serving random:llama-tiny" in err
    assert '"event": "server.stopped"' in err


def test_serve_rejects_more_streams_than_the_model_supports(capsys):
    from tilevox.server.cli import main

    assert (
        main(
            [
                "serve",
                "--model",
                "random:llama-tiny",
                "--device",
                "cpu",
                "--max-streams",
                "999",
                "--http-port",
                "0",
                "--grpc-port",
                "0",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "tilevox: error: --max-streams 999 exceeds" in err


def test_warm_up_runs_each_level_at_once_so_the_executor_captures_those_batch_sizes():
    """Before /ready: each warm-up level's streams step together, so every batch bucket named has been
    through the executor's backends (graphs captured on a GPU; here, on CPU, the same code eagerly)."""
    from tests.server.conftest import make_server
    from tilevox.executor import GraphOptions, install_graph_regions
    from tilevox.models.registry import load_model
    from tilevox.server.cli import _warmup_streams

    assert _warmup_streams(256)[-3:] == (128, 192, 256) and _warmup_streams(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    model = load_model("random:qwen3-tts-tiny")
    install_graph_regions(model, options=GraphOptions(capture=False, prefill=True))
    server = make_server(model, max_streams=4, warmup_streams=(1, 3, 4), warmup_words=(0, 4))
    try:
        assert server.state.is_ready
        buckets = {key[0] for key in model.talker_step_backend.keys_used}
        assert {1, 4} <= buckets
        assert {key[0] for key in model.codec_decode_backend.keys_used} >= {1, 4}
        # each text length reached its own prompt-length bucket, at each level
        assert {(1, 32), (4, 32), (1, 64), (4, 64)} <= model.talker_prefill_backend.keys_used
        assert server.state.scheduler.num_active == 0
    finally:
        server.stop()


def test_warm_up_streams_reach_their_first_codec_chunk_so_the_chunk_decode_is_captured():
    """Llasa's first XCodec2 block needs 13 frames: the warm-up streams are long enough that each level's
    batched block decode (region chunk_decode) runs before /ready, not at the first clients' first audio."""
    from tests.server.conftest import make_server
    from tilevox.executor import GraphOptions, install_graph_regions
    from tilevox.models.registry import load_model

    model = load_model("random:llama-tiny")
    install_graph_regions(model, options=GraphOptions(capture=False))
    server = make_server(model, max_streams=4, warmup_streams=(1, 4))
    try:
        assert server.state.is_ready
        # every block window of a stream's first seconds (13 to 163 frames: widths 64, 128, 192) at each level
        assert {(b, w) for b in (1, 4) for w in (64, 128, 192)} <= model.chunk_decode_backend.keys_used
    finally:
        server.stop()


def test_warm_up_stops_at_a_text_length_the_model_refuses_and_becomes_ready(caplog):
    """A warm-up length longer than the model's context is refused like any request: the warm-up logs it,
    skips the longer lengths and the server becomes ready."""
    import logging

    from tests.server.conftest import make_server
    from tilevox.models.registry import load_model

    model = load_model("random:qwen3-tts-tiny")
    too_long = model.options.max_seq_len + 10
    caplog.set_level(logging.INFO, logger="tilevox")
    server = make_server(model, max_streams=2, warmup_streams=(1, 2), warmup_words=(0, too_long, 3))
    try:
        assert server.state.is_ready
        skipped = [r for r in caplog.records if r.getMessage() == "server.warmup_longest"]
        assert len(skipped) == 1 and "too long" in skipped[0].fields["reason"], [r.fields for r in skipped]
        assert skipped[0].fields["words"] == too_long
        assert server.state.scheduler.num_active == 0
    finally:
        server.stop()
