"""tilevox on Ray Serve (server/ray_serve.py), on a local Ray instance this module starts and tears down.

Unmodified `openai`, `websockets` and `nvidia-riva-client` clients against two replicas of
random:llama-tiny get the single-process server's audio for the same seed; 16 concurrent streams spread
over both replicas; each replica's metrics reach Ray's metrics export; killing a replica's process
mid-stream ends its streams with the documented errors on every surface, and the next requests succeed;
autoscaling goes from 1 to 2 replicas under a burst and back. Loopback only, CPU, every wait bounded.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import riva.client

from tests.server.conftest import free_port, make_server
from tests.server.ws_client import ws_synthesize
from tilevox.models.registry import load_model

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'tilevox[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'tilevox[ray]')")

from tilevox.server.ray_serve import APP_NAME, RayOptions, build_app  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning"),
]

MODEL = "random:llama-tiny"
MAX_DURATION_S = 0.4
TEXT, SEED = "The same words, every way.", 1234


class Cluster:
    def __init__(self) -> None:
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.grpc_port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def deploy(self, *, max_streams: int, timeout_s: float = 90.0, extra_args: tuple[str, ...] = (), **options) -> None:
        """(Re)deploy the application; returns once it serves (Serve waits for every replica's warm-up)."""
        self.grpc_port = free_port()
        serve_args = ("--model", MODEL, "--device", "cpu", "--max-streams", str(max_streams), "--host", "127.0.0.1")
        serve_args += ("--grpc-port", str(self.grpc_port), "--idle-timeout", "20", *extra_args)
        app = build_app(RayOptions(serve_args=serve_args, **options))
        started = time.monotonic()
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        while time.monotonic() - started < timeout_s:
            status = serve.status().applications.get(APP_NAME)
            if status is not None and status.status == "RUNNING":
                return
            if status is not None and status.status == "DEPLOY_FAILED":
                raise AssertionError(f"deploy failed: {status.message}")
            time.sleep(0.2)
        raise AssertionError(f"application not running within {timeout_s} s: {serve.status()}")

    def replicas(self) -> dict[str, int]:
        """Running TilevoxReplica actors: replica id -> pid (from Ray's actor table)."""
        from ray._private import state as ray_state  # the public state API needs the dashboard, which is off

        running = {}
        for info in ray_state.actors().values():
            name = info.get("Name", "")
            if info["State"] == "ALIVE" and name.startswith("SERVE_REPLICA::") and "#TilevoxReplica#" in name:
                running[name.rsplit("#", 1)[1]] = info["Pid"]
        return running

    def wait_replicas(self, count: int, timeout_s: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running = self.replicas()
            status = serve.status().applications[APP_NAME].deployments["TilevoxReplica"]
            if len(running) == count and status.status == "HEALTHY":
                return running
            time.sleep(0.25)
        raise AssertionError(f"expected {count} replicas within {timeout_s} s, have {self.replicas()}")


# Replicas and handles report their ongoing requests to the autoscaler every 10 s by default: 0.5 s here,
# so that the autoscaling test sees a burst within seconds. Read by Ray's processes at start.
_FAST_AUTOSCALING_METRICS = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    saved = {name: os.environ.get(name) for name in _FAST_AUTOSCALING_METRICS}
    os.environ.update(_FAST_AUTOSCALING_METRICS)
    ray.init(
        num_cpus=8,  # logical: two replicas, the ingress and Serve's actors share this machine's cores
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
        _metrics_export_port=c.metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": c.http_port})
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def two_replicas(cluster):
    cluster.deploy(max_streams=8, num_replicas=2)
    cluster.wait_replicas(2, timeout_s=60)
    return cluster


@pytest.fixture(scope="module")
def single_process():
    server = make_server(load_model(MODEL), max_streams=8, max_queued=8)
    yield server
    server.stop()


def _every_surface(http_url: str, http_port: int, grpc_target: str) -> dict[str, np.ndarray]:
    """The same request through every surface and client, as int16 samples at 16 kHz."""
    got: dict[str, np.ndarray] = {}
    client = openai.OpenAI(base_url=http_url + "/v1", api_key="unused", timeout=60)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=TEXT,
        response_format="pcm",
        extra_body={"seed": SEED, "max_duration_s": MAX_DURATION_S, "sample_rate": 16000},
    ) as response:
        got["openai pcm"] = np.frombuffer(b"".join(response.iter_bytes()), "<i2")
    body = {"input": TEXT, "seed": SEED, "max_duration_s": MAX_DURATION_S, "response_format": "pcm"}
    sse = httpx.post(
        http_url + "/v1/audio/speech", json=body | {"stream_format": "sse", "sample_rate": 16000}, timeout=60
    ).text
    events = [json.loads(block.split("data: ", 1)[1]) for block in sse.strip().split("\n\n")]
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    got["http sse"] = np.frombuffer(
        b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"), "<i2"
    )
    tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=grpc_target))
    custom = {"seed": SEED, "max_duration_s": MAX_DURATION_S}
    got["riva synthesize"] = np.frombuffer(
        tts.synthesize(TEXT, sample_rate_hz=16000, custom_configuration=custom).audio, "<i2"
    )
    online = tts.synthesize_online(TEXT, sample_rate_hz=16000, custom_configuration=custom)
    got["riva synthesize_online"] = np.frombuffer(b"".join(r.audio for r in online), "<i2")

    config = {"response_format": "pcm", "seed": SEED, "max_duration_s": MAX_DURATION_S}
    ws_audio, _ = asyncio.run(
        ws_synthesize(http_port, (TEXT[:7], TEXT[7:15], TEXT[15:]), config, open_timeout=30, fail_types=("error",))
    )
    got["websocket"] = np.frombuffer(ws_audio, "<i2")
    return got


def test_every_client_gets_the_single_process_audio(two_replicas, single_process):
    expected = _every_surface(single_process.http_url, single_process.http_port, single_process.grpc_target)
    got = _every_surface(two_replicas.url, two_replicas.http_port, f"127.0.0.1:{two_replicas.grpc_port}")
    reference = expected["openai pcm"]
    assert reference.size == int(MAX_DURATION_S * 16000)
    for surface in expected:
        np.testing.assert_array_equal(expected[surface], reference, err_msg=f"single process, {surface}")
        np.testing.assert_array_equal(got[surface], reference, err_msg=f"ray, {surface}")


def test_errors_and_request_ids_come_back_as_from_one_process(two_replicas):
    r = httpx.post(two_replicas.url + "/v1/audio/speech", json={"input": "x", "voice": "nobody"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "voice_not_found"
    r = httpx.post(
        two_replicas.url + "/v1/audio/speech",
        json={"input": "Hello.", "response_format": "pcm", "max_duration_s": 0.1},
        headers={"x-request-id": "client-id-42"},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["client-id-42"]
    assert r.headers["x-tilevox-replica"] in two_replicas.replicas()
    assert httpx.get(two_replicas.url + "/ready", timeout=10).json()["ready"] is True


def test_16_concurrent_streams_spread_over_both_replicas(two_replicas, single_process):
    jobs = [(f"Stream number {i} says {i * 7919}.", 1000 + i) for i in range(16)]
    results: dict[int, httpx.Response] = {}
    barrier = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        text, seed = jobs[i]
        barrier.wait(timeout=30)
        body = {"input": text, "seed": seed, "response_format": "pcm", "sample_rate": 16000, "max_duration_s": 1.0}
        results[i] = httpx.post(two_replicas.url + "/v1/audio/speech", json=body, timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert sorted(results) == list(range(16))
    served_by: dict[str, int] = {}
    for i, (text, seed) in enumerate(jobs):
        r = results[i]
        assert r.status_code == 200, r.text[:300]
        served_by[r.headers["x-tilevox-replica"]] = served_by.get(r.headers["x-tilevox-replica"], 0) + 1
        solo = httpx.post(
            single_process.http_url + "/v1/audio/speech",
            json={"input": text, "seed": seed, "response_format": "pcm", "sample_rate": 16000, "max_duration_s": 1.0},
            timeout=60,
        )
        got, want = np.frombuffer(r.content, "<i2").astype(np.int32), np.frombuffer(solo.content, "<i2")
        assert got.shape == want.shape and np.abs(got - want).max() <= 1, f"stream {i}"  # batched float rounding
    assert len(served_by) == 2 and min(served_by.values()) >= 4, served_by


def test_each_replicas_metrics_reach_rays_export(two_replicas):
    replicas = set(two_replicas.replicas())
    deadline = time.monotonic() + 30
    seen: set[str] = set()
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{two_replicas.metrics_port}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("ray_tilevox_steps_total{"):
                seen |= {r for r in replicas if f'replica="{r}"' in line or f'replica="TilevoxReplica#{r}"' in line}
        if seen == replicas:
            return
        time.sleep(1)
    raise AssertionError(f"tilevox metrics of replicas {replicas - seen} not in Ray's export")


def _replica_metric(cluster, name: str, replica: str) -> float | None:
    """A replica's value of tilevox metric `name` in Ray's metrics export (None until exported)."""
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"ray_{name}{{") and (f'replica="{replica}"' in line or f'#{replica}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_client_disconnect_cancels_its_stream_on_the_replica(two_replicas):
    """A client that reads the start of a 60 s stream and disconnects: the replica stops generating it (its
    frame counter stops within seconds, far short of the stream's 3,000 frames; on this CPU the whole
    stream would take about 8 s more) and its running streams fall back to 0."""
    body = {"input": "A long stream to walk away from.", "response_format": "pcm", "max_duration_s": 60}
    time.sleep(3)  # the earlier tests' frames reach the export first (replica bridge and Ray's report: 1 s each)
    before = {r: _replica_metric(two_replicas, "tilevox_frames_total", r) or 0.0 for r in two_replicas.replicas()}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", two_replicas.url + "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            replica = response.headers["x-tilevox-replica"].rsplit("#", 1)[-1]
            received = 0
            for chunk in response.iter_bytes():
                received += len(chunk)
                if received >= 16000:  # half a second of 16 kHz int16 audio, then hang up
                    break
    deadline, counts = time.monotonic() + 20, []
    while time.monotonic() < deadline:
        time.sleep(1.5)
        frames = _replica_metric(two_replicas, "tilevox_frames_total", replica)
        active = _replica_metric(two_replicas, "tilevox_active_streams", replica)
        counts.append(frames)
        if active == 0 and len(counts) >= 3 and counts[-1] == counts[-2] == counts[-3]:
            break
    else:
        raise AssertionError(f"the replica kept generating after the disconnect: frames {counts}, active {active}")
    assert counts[-1] is not None and counts[-1] - before[replica] < 3000, (before[replica], counts)


def _long_sse(url: str, client: httpx.Client, request_id: str):
    body = {"input": "A long stream.", "response_format": "pcm", "stream_format": "sse", "max_duration_s": 60}
    response = client.send(
        client.build_request("POST", url + "/v1/audio/speech", json=body, headers={"x-request-id": request_id}),
        stream=True,
    )
    assert response.status_code == 200
    return response


def test_a_replica_killed_mid_stream_ends_its_streams_with_clear_errors(cluster):
    """Two replicas of 3 streams. One is filled with SSE streams, so that an SSE, a raw audio, a WebSocket and
    a gRPC stream all run on the other (the router never sends a full replica more); its process is killed:
    each of those ends with its surface's error, never a hang; the next requests succeed; Ray restarts it."""
    cluster.deploy(max_streams=4, num_replicas=2)
    before = cluster.wait_replicas(2, timeout_s=60)
    client = httpx.Client(timeout=httpx.Timeout(30, read=30))
    fillers = [_long_sse(cluster.url, client, f"filler-{i}") for i in range(8)]
    by_replica: dict[str, list] = {}
    for response in fillers:
        by_replica.setdefault(response.headers["x-tilevox-replica"], []).append(response)
    assert sorted(len(v) for v in by_replica.values()) == [4, 4], {k: len(v) for k, v in by_replica.items()}
    victim, survivor = sorted(by_replica)
    for response in by_replica[victim]:  # frees the victim: everything next goes there
        response.close()
    time.sleep(1.0)  # the victim's slots are free once its cancelled streams end

    sse = _long_sse(cluster.url, client, "victim-sse")
    assert sse.headers["x-tilevox-replica"] == victim
    raw = client.send(
        client.build_request(
            "POST",
            cluster.url + "/v1/audio/speech",
            json={"input": "Raw audio.", "response_format": "pcm", "max_duration_s": 60},
        ),
        stream=True,
    )
    assert raw.status_code == 200 and raw.headers["x-tilevox-replica"] == victim
    outcome: dict[str, object] = {}
    ws_started, grpc_started = threading.Event(), threading.Event()

    async def ws_session() -> None:
        _, events = await ws_synthesize(
            cluster.http_port,
            ("A long phrase.",),
            {"response_format": "pcm", "max_duration_s": 60},
            open_timeout=30,
            end_types=("error", "done"),
            on_audio=lambda _chunk: ws_started.set(),
        )
        outcome["ws"] = events[-1]

    def grpc_stream() -> None:
        tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=f"127.0.0.1:{cluster.grpc_port}"))
        try:
            for _ in tts.synthesize_online("A long gRPC stream.", custom_configuration={"max_duration_s": 60}):
                grpc_started.set()
            outcome["grpc"] = "finished"
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["grpc"] = exc

    ws_thread = threading.Thread(target=lambda: asyncio.run(ws_session()))
    grpc_thread = threading.Thread(target=grpc_stream)
    ws_thread.start()
    grpc_thread.start()
    assert ws_started.wait(30) and grpc_started.wait(30)
    assert before[victim] != before[survivor]
    os.kill(before[victim], signal.SIGKILL)

    started = time.monotonic()
    events = []
    for line in sse.iter_lines():
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
    assert events[-1]["type"] == "speech.audio.error", events[-1]
    assert events[-1]["error"]["code"] == "replica_failed"
    with pytest.raises(httpx.RemoteProtocolError):  # a raw body is aborted: incomplete to the client
        for _ in raw.iter_bytes():
            pass
    ws_thread.join(30)
    grpc_thread.join(30)
    assert time.monotonic() - started < 30
    assert outcome["ws"]["type"] == "error" and outcome["ws"]["code"] == "replica_failed", outcome["ws"]
    assert isinstance(outcome["grpc"], Exception) and outcome["grpc"].code().name == "UNAVAILABLE", outcome["grpc"]

    # The next requests succeed (on the survivor, or on the restarted replica).
    for _ in range(3):
        r = httpx.post(
            cluster.url + "/v1/audio/speech",
            json={"input": "After the crash.", "response_format": "pcm", "max_duration_s": 0.2},
            timeout=60,
        )
        assert r.status_code == 200 and len(r.content) > 0
    for response in by_replica[survivor]:
        response.close()
    after = cluster.wait_replicas(2, timeout_s=60)
    assert victim not in after and survivor in after  # Ray replaced the dead replica
    client.close()


def test_autoscaling_from_one_to_two_replicas_under_a_burst_and_back(cluster):
    """Capacity 2 streams per replica (target 1.5 running): a burst of 4 long streams scales to 2 replicas;
    once they end, back to 1 (Ray's delays shortened for the test)."""
    cluster.deploy(
        max_streams=2,
        autoscale=(1, 2),
        autoscaling_overrides={
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 2.0,
            "look_back_period_s": 1.0,
            # deprecated in favour of the two environment variables above, but still what the controller reads
            "metrics_interval_s": 0.5,
        },
    )
    cluster.wait_replicas(1, timeout_s=60)
    client = httpx.Client(timeout=httpx.Timeout(30, read=30))
    results: list[int] = []

    def one(i: int) -> None:
        body = {"input": f"Burst {i}.", "response_format": "pcm", "max_duration_s": 8}
        r = client.post(cluster.url + "/v1/audio/speech", json=body, timeout=120)
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    cluster.wait_replicas(2, timeout_s=60)
    for t in threads:
        t.join(120)
    assert results == [200] * 4
    cluster.wait_replicas(1, timeout_s=60)
    client.close()


def test_without_max_streams_replicas_measure_their_capacity_and_ray_follows(cluster):
    """No --max-streams: the first replica measures its capacity as `tilevox serve` does (here the tiny
    model's 8 slots), `deploy` updates Ray's max_ongoing_requests to it in place (no replica restart), and
    the application serves."""
    from tilevox.server.ray_serve import deploy

    cluster.grpc_port = free_port()
    serve_args = ("--model", MODEL, "--device", "cpu", "--host", "127.0.0.1", "--grpc-port", str(cluster.grpc_port))
    assert deploy(RayOptions(serve_args=serve_args, num_replicas=1), blocking_timeout_s=90) == 8
    (pid,) = cluster.wait_replicas(1, timeout_s=60).values()
    replicas = serve.get_deployment_handle("TilevoxReplica", app_name=APP_NAME)
    assert replicas.facts.remote().result(timeout_s=30)["max_streams"] == load_model(MODEL).max_streams == 8
    body = {"input": "Measured.", "response_format": "pcm", "max_duration_s": 0.3}
    assert httpx.post(cluster.url + "/v1/audio/speech", json=body, timeout=60).status_code == 200
    assert set(cluster.replicas().values()) == {pid}  # the in-place update kept the replica
    from ray.serve.context import _get_global_client  # deployment configs need the dashboard's API otherwise

    details = _get_global_client().get_serve_details()
    config = details["applications"][APP_NAME]["deployments"]["TilevoxReplica"]["deployment_config"]
    assert config["max_ongoing_requests"] == 8


def test_every_replica_full_gives_429_and_resource_exhausted(cluster):
    """Two replicas of one stream each and no queue beyond Ray's (--max-queued 0: the caller holds at most
    2 waiting requests): of 7 long requests sent at once on one surface, some are refused, over HTTP with
    429 and a retry hint and over gRPC with RESOURCE_EXHAUSTED; none fails otherwise, and the admitted ones
    are spread over both replicas."""
    import grpc

    cluster.deploy(max_streams=1, num_replicas=2, extra_args=("--max-queued", "0"))
    cluster.wait_replicas(2, timeout_s=60)
    body = {"input": "A long sentence that keeps its replica busy.", "response_format": "pcm", "max_duration_s": 6}

    def burst(call, count: int = 7) -> list:
        results: list = [None] * count
        barrier = threading.Barrier(count)

        def run(i: int) -> None:
            barrier.wait(timeout=30)
            results[i] = call()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        return results

    with httpx.Client(timeout=120) as client:
        responses = burst(lambda: client.post(cluster.url + "/v1/audio/speech", json=body))
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "overloaded" and "retry-after" in refused.headers
    assert len({r.headers["x-tilevox-replica"] for r in responses if r.status_code == 200}) == 2

    tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=f"127.0.0.1:{cluster.grpc_port}"))

    def riva_call():
        try:
            tts.synthesize(body["input"], sample_rate_hz=16000, custom_configuration={"max_duration_s": 6})
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    codes = burst(riva_call)
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
