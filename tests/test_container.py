"""The Docker image, built and run as CI does: the Dockerfile's `cpu` target, built by
scripts/container/build-cpu.sh on a Debian stand-in for the runtime base (no container registry is
reachable, so the GPU image's nvidia/cuda bases and CUDA torch cannot be pulled; every other step of the
Dockerfile is shared with the GPU image), then run as a user runs it: /ready and the image's HEALTHCHECK,
the README's curl request, one Riva gRPC call, and `docker stop` draining a stream that is still playing.

Needs root (apt-get installs the engine if missing; dockerd is started here when none answers, and
stopped again by its PID). Deselect with `-m "not container"`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import riva.client

from tests.server.conftest import API_KEY, free_port

pytestmark = [pytest.mark.container, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
DOCKER = "/usr/bin/docker"  # the engine's own 20.10 client: it drives the engine's BuildKit
IMAGE = "tilevox:ci-cpu"
BUILD_TIMEOUT_S = 1800
READY_TIMEOUT_S = 300


@dataclass
class Container:
    name: str
    http_url: str
    grpc_target: str

    def logs(self) -> str:
        """The server's output (its log is on stderr), both streams in order."""
        return subprocess.run(
            [DOCKER, "logs", self.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60
        ).stdout

    def inspect(self, template: str) -> str:
        return _docker("inspect", "-f", template, self.name).stdout.strip()


def _docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _wait_ready(container: Container) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{container.http_url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:  # not listening yet (docker's proxy accepts, then drops the connection)
            pass
        if container.inspect("{{.State.Running}}") != "true":
            pytest.fail(f"the container exited before /ready answered 200; its log:\n{_tail(container.logs())}")
        time.sleep(0.5)
    pytest.fail(
        f"/ready did not answer 200 within {READY_TIMEOUT_S} s; the container's log:\n{_tail(container.logs())}"
    )


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    """Builds the stand-in base and the `cpu` image, runs it with its own CMD (random:llama-tiny on the
    CPU) and an API key as the README's `docker run` does, and waits for /ready."""
    if os.geteuid() != 0:
        pytest.skip(
            "needs root: installs the Docker engine with apt-get, starts dockerd and builds the base with mmdebstrap"
        )
    if shutil.which("apt-get") is None and shutil.which("dockerd") is None:
        pytest.skip("no Docker engine (dockerd) on this machine and no apt-get to install one")
    build = subprocess.run(
        ["bash", "scripts/container/build-cpu.sh"],
        cwd=REPO,
        env=os.environ | {"IMAGE": IMAGE, "LOGDIR": str(tmp_path_factory.mktemp("container-logs"))},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    info = dict(line.split("=", 1) for line in build.stdout.splitlines() if "=" in line)
    name = f"tilevox-ci-{os.getpid()}"
    try:
        if build.returncode != 0:
            pytest.fail(f"scripts/container/build-cpu.sh failed (exit {build.returncode}):\n{_tail(build.stderr, 60)}")
        http_port, grpc_port = free_port(), free_port()
        run = _docker(
            "run",
            "-d",
            "--name",
            name,
            "-p",
            f"127.0.0.1:{http_port}:8000",
            "-p",
            f"127.0.0.1:{grpc_port}:50051",
            "-e",
            f"TILEVOX_API_KEY={API_KEY}",
            "--health-interval",
            "2s",  # the image's HEALTHCHECK command, checked more often than its 15 s
            IMAGE,
        )
        if run.returncode != 0:
            pytest.fail(f"docker run {IMAGE} failed:\n{run.stderr}")
        started = Container(name, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
        _wait_ready(started)
        yield started
    finally:
        _docker("rm", "-f", name)
        if info.get("dockerd_pid"):
            subprocess.run(["bash", "scripts/container/stop-dockerd.sh", info["dockerd_pid"]], cwd=REPO, timeout=120)


def test_ready_and_the_image_healthcheck(container):
    assert httpx.get(f"{container.http_url}/ready", timeout=5).status_code == 200
    deadline = time.monotonic() + 60
    while (health := container.inspect("{{.State.Health.Status}}")) != "healthy" and time.monotonic() < deadline:
        time.sleep(1)
    assert health == "healthy", container.inspect("{{json .State.Health}}")


def test_the_readme_curl_request(container):
    """The README's `curl ... /v1/audio/speech` with its exact JSON body (plus the key the container has)."""
    readme = (REPO / "README.md").read_text()
    found = re.search(r"curl [^\n]*/v1/audio/speech\b.*?-d '(\{[^']*\})'", readme, re.S)
    assert found, "README.md has no `curl .../v1/audio/speech ... -d '{...}'` example any more"
    body = found.group(1)
    fmt = json.loads(body).get("response_format", "mp3")
    url = f"{container.http_url}/v1/audio/speech"
    headers = {"Content-Type": "application/json"}
    refused = httpx.post(url, content=body, headers=headers, timeout=30)
    assert refused.status_code == 401, "the container's TILEVOX_API_KEY is not in force"
    resp = httpx.post(url, content=body, headers=headers | {"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert resp.status_code == 200, resp.text
    audio = resp.content
    magic = {"wav": b"RIFF", "flac": b"fLaC", "opus": b"OggS"}
    assert resp.headers["content-type"].startswith("audio/"), resp.headers
    assert len(audio) > 1000
    if fmt in magic:
        assert audio.startswith(magic[fmt]), audio[:16]
    if fmt == "wav":
        assert audio[8:12] == b"WAVE"


def test_one_riva_grpc_call(container):
    """The README's Riva example: `synthesize` returns raw s16le at the asked rate."""
    auth = riva.client.Auth(
        uri=container.grpc_target, use_ssl=False, metadata_args=[["authorization", f"Bearer {API_KEY}"]]
    )
    resp = riva.client.SpeechSynthesisService(auth).synthesize("Hello from tilevox.", sample_rate_hz=44100)
    assert len(resp.audio) > 0 and len(resp.audio) % 2 == 0
    assert len(resp.audio) / 2 / 44100 <= 31  # a random: model speaks at most --max-duration (30 s)


def test_docker_stop_drains_a_playing_stream(container):
    """SIGTERM from `docker stop` lets a stream that is playing finish, then the server exits 0."""
    stopped: dict[str, subprocess.CompletedProcess] = {}
    stopper = threading.Thread(target=lambda: stopped.update(result=_docker("stop", "-t", "40", container.name)))
    body = {"model": "tts-1", "input": "Still speaking while the container stops.", "response_format": "pcm"}
    with httpx.stream(
        "POST",
        f"{container.http_url}/v1/audio/speech",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_bytes()
        received = len(next(chunks))  # the stream is running: now stop the container
        stopper.start()
        received += sum(len(chunk) for chunk in chunks)  # an aborted body would raise here
    stopper.join(60)
    assert not stopper.is_alive(), "docker stop -t 40 did not return within 60 s"
    logs = container.logs()
    assert stopped["result"].returncode == 0, stopped["result"].stderr
    assert container.inspect("{{.State.ExitCode}}") == "0", _tail(logs)
    events = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    draining = [e for e in events if e.get("event") == "server.draining"]
    finished = [e for e in events if e.get("event") == "server.stopped"]
    assert draining and draining[0]["active"] == 1, _tail(logs)
    assert finished and finished[0]["drained"] is True, _tail(logs)
    # the stream played to its end after the signal, and the client got all of it (pcm: s16le at 24 kHz)
    stats = [e["stats"] for e in events if e.get("event") == "speech.finished"][-1]
    assert stats["finish_reason"] in ("stop", "length"), stats
    assert abs(received / 2 / 24000 - stats["audio_duration_s"]) < 0.1, (received, stats)
