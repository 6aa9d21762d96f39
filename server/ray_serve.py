"""tilevox on Ray Serve: many replicas (one executor each, on one GPU or CPU) behind one endpoint.

Two deployments make one Serve application (`app_builder`, `tilevox serve --ray`, `serve run`):

- `TilevoxReplica` (N replicas, or autoscaled): loads the model exactly as `tilevox serve` does and owns
  its Scheduler. It serves three streaming methods: `http` (a whole OpenAI HTTP request run through the
  same FastAPI app as the single-process server, its ASGI messages streamed back), `stream` (one
  synthesis, its float32 chunks then its StreamStats: the WebSocket phrases) and `riva` (one Riva RPC run
  by the same servicer, through a forwarding context). `max_ongoing_requests` is its stream capacity
  (`--max-streams`, later the executor's measured figure), so Ray never sends a replica more streams than
  it holds; its Prometheus metrics are mirrored into Ray's metrics export (`ray_tilevox_*`, tagged with
  the deployment and replica) and `check_health` fails once its model worker has died.
- `TilevoxIngress` (FastAPI, no model): behind Ray's HTTP proxy. `/v1/...` HTTP requests are relayed to a
  replica (so status codes, headers and bodies are the single-process server's); the WebSocket runs the
  same session code with a remote scheduler (each phrase a separate routed stream); the Riva gRPC front
  end (grpc.aio on --grpc-port inside this actor) forwards each Synthesize call and each SynthesizeOnline
  text to a replica. `/health`, `/ready`, `/metrics` are its own.

Ray gives the replicas, GPU placement, HTTP and WebSocket ingress, streaming, cancellation on client
disconnect (the relay cancels the replica's call, whose finally cancels the scheduler stream), health
checks and restarts, and autoscaling. tilevox adds: `MostFreeCapacityRouter` (each request goes to the
replica with the most free stream capacity; Ray's rejection protocol keeps a full replica from being sent
more), the autoscaling target from the stream capacity, and the mapping of Ray's failures onto each
surface: a caller queue over its limit (`max_queued_requests`, every replica full) is 429 /
RESOURCE_EXHAUSTED, a replica that dies mid-stream ends the stream with an SSE `speech.audio.error` event
(a raw body is aborted), a WebSocket `error` event (code `replica_failed`) or gRPC UNAVAILABLE.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import json
import logging
import os
import shlex
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response

from tilevox.models.streaming import SynthesisRequest, VoiceInfo
from tilevox.server.config import ServerConfig
from tilevox.server.logs import log_event
from tilevox.server.metrics import ServerMetrics
from tilevox.server.protocol import ApiError
from tilevox.server.riva_proto import riva_tts_pb2, riva_tts_pb2_grpc
from tilevox.server.scheduler import OverloadedError, StreamStats
from tilevox.server.state import ServerState, request_id_of
from tilevox.server.voices import VoiceCatalog

__all__ = [
    "AUTOSCALE_TARGET_FRACTION",
    "APP_NAME",
    "MostFreeCapacityRouter",
    "RayOptions",
    "ReplicaFailed",
    "TilevoxIngress",
    "TilevoxReplica",
    "app_builder",
    "build_app",
    "run_cli",
    "serve_args_of",
]

log = logging.getLogger("tilevox.ray")

APP_NAME = "tilevox"
# Autoscaling target: running streams per replica, as a fraction of its stream capacity. Below 1 so that a
# new replica starts (tens of seconds on a GPU) before the others are full.
AUTOSCALE_TARGET_FRACTION = 0.75
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("tilevox_ray_request_id", default=None)


class ReplicaFailed(ApiError):
    """The replica serving a stream died or became unreachable (HTTP 503 / gRPC UNAVAILABLE / WebSocket
    `error` code `replica_failed`); Ray restarts it, and a retry goes to another replica."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="replica_failed", type_="server_error")


# ---- options --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RayOptions:
    """How the application is laid out on the cluster; `serve_args` are `tilevox serve`'s own options."""

    serve_args: tuple[str, ...] = ()
    num_replicas: int | None = None  # fixed replica count (default 1 without autoscale)
    autoscale: tuple[int, int] | None = None  # (min, max) replicas
    gpus_per_replica: float | None = None  # default: 1 on cuda, 0 on cpu
    cpus_per_replica: float = 1.0
    autoscaling_overrides: dict | None = None  # merged into Ray's autoscaling_config (delays, look-back)
    grpc: bool = True  # run the Riva gRPC front end in the ingress (on --grpc-port)

    def __post_init__(self) -> None:
        if self.num_replicas is not None and self.autoscale is not None:
            raise ValueError("give either num_replicas or autoscale, not both")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.autoscale is not None:
            low, high = self.autoscale
            if not (0 <= low <= high and high >= 1):
                raise ValueError(f"autoscale must be MIN:MAX with 0 <= MIN <= MAX and MAX >= 1, got {low}:{high}")
        if self.gpus_per_replica is not None and self.gpus_per_replica < 0:
            raise ValueError(f"gpus_per_replica must be >= 0, got {self.gpus_per_replica}")


def parse_autoscale(value: str) -> tuple[int, int]:
    """'MIN:MAX' -> (MIN, MAX); ValueError naming the value otherwise."""
    low, sep, high = value.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = int(low), int(high)
    except ValueError:
        raise ValueError(f"--autoscale must be MIN:MAX (two integers), got {value!r}") from None
    RayOptions(autoscale=bounds)  # validates
    return bounds


_RAY_FLAGS = {"ray", "num_replicas", "autoscale", "gpus_per_replica"}
# Each replica's stream capacity before one has measured it (no --max-streams): the executor's largest batch.
UNMEASURED_CAPACITY = 256


def serve_args_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The `tilevox serve` options in `args` that differ from their defaults, as command-line words, without
    the --ray flags: what every replica and the ingress parse again (one source of truth for the options)."""
    from tilevox.server.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    words: list[str] = []
    for action in subparsers.choices["serve"]._actions:
        if not action.option_strings or action.dest in _RAY_FLAGS or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        else:
            words += [flag, str(value)]
    return tuple(words)


def _parse_serve_args(serve_args: Sequence[str]) -> argparse.Namespace:
    from tilevox.server.cli import build_parser

    args = build_parser().parse_args(["serve", *serve_args])
    if args.model is not None and args.device is None:
        raise ValueError("--device is required with Ray and --model: the replicas' device, which this host may lack")
    return args


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig `tilevox serve` would build from `args` (ports stay those of the options)."""
    from tilevox.server.cli import _api_key, _newcomer_slack_s
    from tilevox.server.config import DEFAULT_MODEL

    device = args.device or ("cpu" if args.model is None else _default_device())
    return ServerConfig(
        model=args.model or DEFAULT_MODEL,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        device=device,
        dtype=args.dtype or ("bf16" if device == "cuda" else "fp32"),
        api_key=_api_key(args),
        # without --max-streams: a placeholder until a replica has measured its capacity (_load_for_serving)
        max_streams=args.max_streams or UNMEASURED_CAPACITY,
        max_queued=(args.max_streams or UNMEASURED_CAPACITY) if args.max_queued is None else args.max_queued,
        max_text_chars=args.max_text_chars,
        strict_voices=args.strict_voices,
        idle_timeout_s=args.idle_timeout,
        drain_timeout_s=args.drain_timeout,
        newcomer_slack_s=_newcomer_slack_s(args.newcomer_slack_ms),
        prefill_budget=args.prefill_budget == "on",
    )


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- routing ------------------------------------------------------------------------------------

try:  # the router subclasses Ray's; the rest of this module imports Ray only where it runs
    from ray.serve.request_router import RequestRouter as _RequestRouterBase
except ImportError:  # Ray not installed: build_app says so; the single-process server never imports this module
    _RequestRouterBase = object


class MostFreeCapacityRouter(_RequestRouterBase):
    """Each request to the replica with the most free stream capacity: replicas ranked by capacity (their
    `record_routing_stats`, else max_ongoing_requests) minus the streams this router knows they run (Ray's
    queue-length cache, which every response and probe refreshes). Within a rank Ray takes the replica
    with the fewest ongoing requests below max_ongoing_requests, and a replica that is full rejects the
    request (Ray's rejection protocol), so a full replica is never sent more while another has room."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        def free(replica) -> int:
            capacity = (replica.routing_stats or {}).get("max_streams", replica.max_ongoing_requests)
            running = self.replica_queue_len_cache.get(replica.replica_id)
            return capacity - (running or 0)  # unknown: Ray probes it before sending anything

        ranks: dict[int, list] = {}
        for replica in candidate_replicas:
            ranks.setdefault(free(replica), []).append(replica)
        return [ranks[key] for key in sorted(ranks, reverse=True)]


# ---- failures -----------------------------------------------------------------------------------


def _translate(exc: BaseException) -> BaseException:
    """A Ray exception from a replica call -> the exception the front ends map (server/errors.py):
    the replica's own exception, OverloadedError when the caller's queue is full, ReplicaFailed when the
    replica died; anything else unchanged."""
    from ray import exceptions as ray_exceptions
    from ray.serve import exceptions as serve_exceptions

    if isinstance(exc, serve_exceptions.BackPressureError):
        return OverloadedError(
            f"every replica is at its stream capacity and {exc.message.split('.')[0].lower()}; retry shortly",
            retry_after_s=1.0,
        )
    if isinstance(exc, ray_exceptions.RayTaskError) and isinstance(exc.cause, Exception):
        return exc.cause
    if isinstance(exc, ray_exceptions.RayActorError | serve_exceptions.DeploymentUnavailableError):
        return ReplicaFailed(f"the replica serving this stream failed ({type(exc).__name__}); retry")
    return exc


# ---- the remote scheduler the ingress's WebSocket sessions use --------------------------------------


class RemoteStream:
    """Duck-types scheduler.StreamHandle over one `TilevoxReplica.stream` call: float32 chunks, then
    `stats`; a replica failure raises ReplicaFailed; `cancel()` cancels the replica's stream."""

    def __init__(self, response, request: SynthesisRequest) -> None:
        self._response = response
        self.request = request
        self.stats: StreamStats | None = None
        self._ended = False

    def cancel(self) -> None:
        if not self._ended:
            self._ended = True
            self._response.cancel()

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self):
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._response.__anext__()
        except StopAsyncIteration:
            self._ended = True
            raise ReplicaFailed("the replica ended the stream without its statistics") from None
        except Exception as exc:
            self._ended = True
            raise _translate(exc) from exc
        if isinstance(item, StreamStats):
            self.stats, self._ended = item, True
            raise StopAsyncIteration
        return item

    async def collect(self):
        import numpy as np

        pieces = [samples async for samples in self]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


class RemoteScheduler:
    """What the WebSocket session code needs of a Scheduler, over the replicas: `submit` starts a routed
    replica stream at once (validation and admission happen on the replica and surface on iteration, where
    the session reports them exactly as it reports a local refusal)."""

    worker_error = None

    def __init__(self, replicas) -> None:
        self._stream = replicas.options(stream=True, method_name="stream")

    def submit(
        self, request: SynthesisRequest, *, ticket: str | None = None, client: str | None = None
    ) -> RemoteStream:
        return RemoteStream(self._stream.remote(request, _REQUEST_ID.get()), request)

    num_active = 0  # the ingress runs no streams itself
    num_queued = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ServedModel:
    """The model facts the ingress needs (its replicas hold the model)."""

    model_id: str
    sample_rate_hz: int
    max_streams: int
    voice_infos: tuple[VoiceInfo, ...]

    def voices(self) -> tuple[VoiceInfo, ...]:
        return self.voice_infos


# ---- the replica --------------------------------------------------------------------------------


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _ForwardedContext:
    """The part of grpc.aio.ServicerContext the Riva servicer uses, for a call forwarded by the ingress."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)
        self.trailing: tuple = ()

    def invocation_metadata(self):
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    def peer(self) -> None:
        return None  # the ingress's connection, not the client's: no connection-kept place in line

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise _Aborted(code, details)


async def _one(item):
    yield item


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


class TilevoxReplica:
    """One executor: the model, its Scheduler and the single-process server's front-end code."""

    async def __init__(self, serve_args: Sequence[str]) -> None:
        from tilevox.server.app import build_state, warm_up
        from tilevox.server.grpc_service import RivaSynthesisService
        from tilevox.server.http_api import build_http_app
        from tilevox.server.logs import configure_logging

        configure_logging(logging.INFO)
        args = _parse_serve_args(serve_args)
        config, model = _load_for_serving(args)
        self.state = build_state(config, model)
        self.state.scheduler.start()
        self._app = build_http_app(self.state)
        self._riva = RivaSynthesisService(self.state)
        self.replica = _replica_id()
        await warm_up(self.state)  # the single-process server's warm-up, before Ray routes to this replica
        self.state.is_ready = True
        self._bridge = _MetricsBridge(self.state.metrics)
        self._bridge_task = asyncio.get_running_loop().create_task(self._bridge.run())
        log_event(
            log,
            "ray.replica_ready",
            replica=self.replica,
            pid=os.getpid(),
            model=model.model_id,
            max_streams=config.max_streams,
        )

    # ---- Ray hooks ------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Ray restarts a replica whose check fails: here, once its model worker has died."""
        if self.state.scheduler.worker_error is not None:
            raise RuntimeError(f"model worker died: {self.state.scheduler.worker_error}")

    def record_routing_stats(self) -> dict:
        scheduler = self.state.scheduler
        return {"max_streams": scheduler.max_active, "running": scheduler.num_active, "queued": scheduler.num_queued}

    def __del__(self) -> None:
        # Ray calls this after its graceful shutdown (ongoing requests had graceful_shutdown_timeout_s to end).
        state = getattr(self, "state", None)
        if state is not None:
            state.is_draining = True
            state.scheduler.shutdown()

    # ---- methods the ingress calls --------------------------------------------------------------------
    def facts(self) -> dict:
        model = self.state.model
        return {
            "model_id": model.model_id,
            "sample_rate_hz": model.sample_rate_hz,
            "max_streams": self.state.config.max_streams,
            "voices": tuple(model.voices()),
            "replica": self.replica,
            "pid": os.getpid(),
        }

    async def stream(self, request: SynthesisRequest, request_id: str | None) -> AsyncIterator:
        handle = self.state.scheduler.submit(request)
        log_event(log, "ray.stream_accepted", request_id=request_id, replica=self.replica, chars=len(request.text))
        try:
            async for samples in handle:
                yield samples
            yield handle.stats
        finally:
            handle.cancel()  # the caller went away (cancellation) or the stream ended: frees the slot

    async def http(self, request: dict) -> AsyncIterator[dict]:
        """Run one HTTP request through the FastAPI app; yield its ASGI messages (the response start carries
        `x-tilevox-replica`). Cancelled (the client left): the app sees a disconnect and is cancelled."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": request["method"],
            "scheme": "http",
            "path": request["path"],
            "raw_path": request["path"].encode(),
            "query_string": request["query_string"],
            "root_path": "",
            "headers": request["headers"],
            "client": request["client"],
            "server": ("127.0.0.1", 0),
        }
        body = request["body"]
        messages: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            messages.put_nowait(message)

        task = asyncio.get_running_loop().create_task(self._app(scope, receive, send))
        try:
            while True:
                get = asyncio.ensure_future(messages.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    if messages.empty():
                        task.result()  # the app ended without finishing its response: its error, or:
                        raise RuntimeError("the HTTP app ended without completing its response")
                    continue
                message = get.result()
                if message["type"] == "http.response.start":
                    message = dict(
                        message, headers=[*message["headers"], (b"x-tilevox-replica", self.replica.encode())]
                    )
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    break
        finally:
            disconnected.set()
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def riva(self, method: str, request_bytes: bytes, metadata: Sequence[tuple[str, str]]) -> AsyncIterator:
        """One Riva Synthesize call, or one SynthesizeOnline text, through the servicer: yields
        ("response", bytes) items, and ("abort", code name, details, trailing metadata) if it aborted."""
        context = _ForwardedContext(metadata)
        request = riva_tts_pb2.SynthesizeSpeechRequest.FromString(request_bytes)
        try:
            if method == "Synthesize":
                response = await self._riva.Synthesize(request, context)
                yield ("response", response.SerializeToString())
            elif method == "SynthesizeOnline":
                async for response in self._riva.SynthesizeOnline(_one(request), context):
                    yield ("response", response.SerializeToString())
            else:
                raise ValueError(f"unknown Riva method {method!r}")
        except _Aborted as aborted:
            yield ("abort", aborted.code.name, aborted.details, context.trailing)

    async def riva_config(self, request_bytes: bytes) -> bytes:
        request = riva_tts_pb2.RivaSynthesisConfigRequest.FromString(request_bytes)
        response = await self._riva.GetRivaSynthesisConfig(request, _ForwardedContext(()))
        return response.SerializeToString()


def _load_for_serving(args: argparse.Namespace):
    """Load and prepare the model as `tilevox serve` does (server/cli.py `_run_serve`): same options, same
    region backends, same warm-up levels. Returns (ServerConfig, model)."""
    from tilevox.models.registry import load_model, parse_dtype
    from tilevox.server.cli import WARMUP_WORDS, _decode_mode, _fused_swiglu_mode, _install_regions, _warmup_streams

    config = _server_config(args)
    model = load_model(
        config.model,
        device=config.device,
        dtype=parse_dtype(config.dtype),
        fused_swiglu=_fused_swiglu_mode(args),
        decode_mode=_decode_mode(args),
    )
    graphs = _install_regions(model, args, config.device)
    if args.max_streams is None:  # the capacity this replica measured (models.capacity), as `tilevox serve`
        queued = model.max_streams if args.max_queued is None else args.max_queued
        config = dataclasses.replace(config, max_streams=model.max_streams, max_queued=queued)
    if config.max_streams > model.max_streams:
        raise ValueError(
            f"--max-streams {config.max_streams} exceeds what {model.model_id} supports ({model.max_streams})"
        )
    warm = {"warmup_streams": _warmup_streams(config.max_streams), "warmup_words": WARMUP_WORDS} if graphs else {}
    return dataclasses.replace(config, **warm), model


class _MetricsBridge:
    """Mirrors one replica's Prometheus registry into Ray's metrics (ray.serve.metrics gauges, exported by
    every node's metrics agent as `ray_<name>` with deployment/replica/application tags) every `period_s`."""

    def __init__(self, metrics: ServerMetrics, period_s: float = 1.0) -> None:
        self._metrics = metrics
        self._period_s = period_s
        self._gauges: dict[tuple[str, tuple[str, ...]], object] = {}

    def export(self) -> None:
        from ray.serve.metrics import Gauge

        for family in self._metrics.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # prometheus_client's creation timestamps
                keys = tuple(sorted(sample.labels))
                gauge = self._gauges.get((sample.name, keys))
                if gauge is None:
                    gauge = Gauge(sample.name, description=family.documentation, tag_keys=keys)
                    self._gauges[(sample.name, keys)] = gauge
                gauge.set(sample.value, tags=dict(sample.labels))

    async def run(self) -> None:
        while True:
            self.export()
            await asyncio.sleep(self._period_s)


# ---- the ingress --------------------------------------------------------------------------------


class _RelayedResponse(Response):
    """Sends a replica's ASGI messages as they come; a replica that dies mid-stream ends an SSE stream with
    a `speech.audio.error` event and aborts any other body (no chunked terminator: incomplete to the client)."""

    def __init__(self, start: dict, rest, request_id: str) -> None:
        super().__init__(status_code=start["status"])
        self._start = start
        self._rest = rest
        self._request_id = request_id
        headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
        self._is_sse = headers.get("content-type", "").startswith("text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        finished = False
        try:
            await send(self._start)
            async for message in self._rest:
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    finished = True
        except Exception as exc:
            translated = _translate(exc)
            if not isinstance(translated, ReplicaFailed):
                raise
            log_event(log, "ray.replica_failed", level=logging.WARNING, request_id=self._request_id, error=str(exc))
            if not self._is_sse:
                raise translated from exc
            payload = {"type": "speech.audio.error", **translated.body()}
            event = f"event: speech.audio.error\ndata: {json.dumps(payload)}\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": False})
            finished = True
        finally:
            if not finished:
                self._rest.cancel()  # the client left (or the send failed): the replica's stream stops


class TilevoxIngress:
    """The FastAPI ingress (no model): relays /v1 HTTP to the replicas, serves the WebSocket sessions with
    a remote scheduler, and runs the Riva gRPC front end; /health, /ready and /metrics are its own."""

    async def __init__(self, replicas, serve_args: Sequence[str], grpc_front_end: bool = True) -> None:
        from tilevox.server.http_api import build_http_app
        from tilevox.server.logs import configure_logging
        from tilevox.server.ws import serve_websocket

        configure_logging(logging.INFO)
        args = _parse_serve_args(serve_args)
        config = _server_config(args)
        self._replicas = replicas
        self._http = replicas.options(stream=True, method_name="http")
        facts = await replicas.facts.remote()  # waits for the first replica
        model = ServedModel(facts["model_id"], facts["sample_rate_hz"], facts["max_streams"], facts["voices"])
        self.state = ServerState(
            config=config,
            model=model,
            scheduler=RemoteScheduler(replicas),
            metrics=ServerMetrics(),
            catalog=VoiceCatalog.for_model(model),
        )
        app = build_http_app(self.state)
        relayed = {"/v1/audio/speech", "/v1/models", "/v1/audio/voices"}
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in relayed]
        app.add_api_route("/v1/{path:path}", self._relay, methods=["GET", "POST"])

        @app.websocket("/v1/audio/speech/stream")
        async def speech_stream(ws: WebSocket) -> None:
            token = _REQUEST_ID.set(request_id_of(ws.headers))
            try:
                await serve_websocket(ws, self.state)
            finally:
                _REQUEST_ID.reset(token)

        self._app = app
        self._grpc_server = None
        if grpc_front_end and config.grpc_port:
            self._grpc_server = await _start_grpc_front_end(replicas, config)
        self.state.is_ready = True
        log_event(
            log, "ray.ingress_ready", model=model.model_id, grpc_port=config.grpc_port if grpc_front_end else None
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app

    async def _relay(self, request: Request) -> Response:
        from tilevox.server.http_api import _error_response

        request_id = request_id_of(request.headers)
        cfg = self.state.config
        try:
            body = await asyncio.wait_for(_read_bounded(request, cfg.max_message_bytes), timeout=cfg.idle_timeout_s)
        except TimeoutError:
            return _error_response(
                ApiError(408, f"request body not received within {cfg.idle_timeout_s:g} s", code="request_timeout"),
                request_id,
            )
        except ApiError as exc:
            return _error_response(exc, request_id)
        headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"x-request-id"]
        forwarded = {
            "method": request.method,
            "path": request.url.path,
            "query_string": request.scope.get("query_string", b""),
            "headers": [*headers, (b"x-request-id", request_id.encode())],
            "client": request.scope.get("client"),
            "body": body,
        }
        response = self._http.remote(forwarded)
        try:
            start = await response.__anext__()
        except Exception as exc:  # nothing sent yet: a plain error response
            translated = _translate(exc)
            if not isinstance(translated, OverloadedError | ReplicaFailed):
                raise
            log_event(log, "ray.rejected", level=logging.WARNING, request_id=request_id, error=str(translated))
            return _error_response(translated, request_id)
        # Ray's proxy adds x-request-id (the same id) to every response: keep one.
        start = dict(
            start,
            headers=[
                (k, v) for k, v in start["headers"] if not (k.lower() == b"x-request-id" and v == request_id.encode())
            ],
        )
        return _RelayedResponse(start, response, request_id)

    def __del__(self) -> None:
        if self._grpc_server is not None:
            self._grpc_server = None  # grpc.aio stops with its loop when the actor exits


async def _read_bounded(request: Request, limit: int) -> bytes:
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes")
        parts.append(part)
    return b"".join(parts)


# ---- the Riva gRPC front end ------------------------------------------------------------------------


async def _start_grpc_front_end(replicas, config: ServerConfig):
    """grpc.aio on the ingress's event loop: the Riva service forwarding to the replicas, and grpc.health.v1."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tilevox.server.app import _grpc_address

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ]
    )
    riva_tts_pb2_grpc.add_RivaSpeechSynthesisServicer_to_server(RivaForwarder(replicas, config), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = _grpc_address(config.host, config.grpc_port)
    if not server.add_insecure_port(address):
        raise RuntimeError(f"cannot bind the gRPC port {address}")
    await server.start()
    for service in ("", "nvidia.riva.tts.RivaSpeechSynthesis"):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server


def _grpc_code(translated: BaseException) -> grpc.StatusCode | None:
    if isinstance(translated, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(translated, ReplicaFailed):
        return grpc.StatusCode.UNAVAILABLE
    return None


class RivaForwarder(riva_tts_pb2_grpc.RivaSpeechSynthesisServicer):
    """The Riva service of the ingress: each Synthesize call and each SynthesizeOnline text goes to the
    replica with the most free capacity, where the single-process servicer runs it; its status codes and
    trailing metadata come back as they are. A replica that fails mid-stream: UNAVAILABLE."""

    def __init__(self, replicas, config: ServerConfig) -> None:
        self._riva = replicas.options(stream=True, method_name="riva")
        self._config_call = replicas.options(method_name="riva_config")
        self._idle_timeout_s = config.idle_timeout_s

    async def _forward(self, method: str, request, context) -> AsyncIterator[bytes]:
        metadata = tuple((k, v) for k, v in (context.invocation_metadata() or ()) if isinstance(v, str))
        if not any(k.lower() == "x-request-id" for k, _ in metadata):
            metadata += (("x-request-id", request_id_of({})),)
        response = self._riva.remote(method, request.SerializeToString(), metadata)
        finished = False
        try:
            async for item in response:
                if item[0] == "abort":
                    finished = True
                    _, code_name, details, trailing = item
                    if trailing:
                        context.set_trailing_metadata(tuple(trailing))
                    await context.abort(grpc.StatusCode[code_name], details)
                yield item[1]
            finished = True
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            finished = True
            translated = _translate(exc)
            code = _grpc_code(translated)
            if code is None:
                raise
            if isinstance(translated, OverloadedError):
                context.set_trailing_metadata((("retry-after-ms", str(round(translated.retry_after_s * 1000))),))
            log_event(log, "ray.grpc_failed", level=logging.WARNING, code=code.name, error=str(translated))
            await context.abort(code, str(translated))
        finally:
            if not finished:
                response.cancel()

    async def Synthesize(self, request, context):
        parts = [part async for part in self._forward("Synthesize", request, context)]
        return riva_tts_pb2.SynthesizeSpeechResponse.FromString(parts[-1])

    async def SynthesizeOnline(self, request_iterator, context):
        iterator = request_iterator.__aiter__()
        while True:
            try:
                request = await asyncio.wait_for(iterator.__anext__(), timeout=self._idle_timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no request for {self._idle_timeout_s} s")
            async for part in self._forward("SynthesizeOnline", request, context):
                yield riva_tts_pb2.SynthesizeSpeechResponse.FromString(part)

    async def GetRivaSynthesisConfig(self, request, context):
        try:
            data = await self._config_call.remote(request.SerializeToString())
        except Exception as exc:
            translated = _translate(exc)
            code = _grpc_code(translated)
            if code is None:
                raise
            await context.abort(code, str(translated))
        return riva_tts_pb2.RivaSynthesisConfigResponse.FromString(data)


# ---- the application ----------------------------------------------------------------------------


def build_app(options: RayOptions, *, capacity: int | None = None):
    """The Serve application: the ingress bound to the replica deployment, laid out as `options` says.
    `capacity`: each replica's stream capacity (default --max-streams; without it UNMEASURED_CAPACITY until
    `deploy` has asked a replica what it measured)."""
    try:
        from ray import serve
        from ray.serve.config import RequestRouterConfig
    except ImportError as exc:
        raise RuntimeError("Ray Serve is not installed: pip install 'tilevox[ray]'") from exc

    args = _parse_serve_args(options.serve_args)
    config = _server_config(args)
    capacity = capacity or config.max_streams
    on_gpu = config.device == "cuda"
    gpus = options.gpus_per_replica if options.gpus_per_replica is not None else (1 if on_gpu else 0)
    replica_options: dict = {
        "max_ongoing_requests": capacity,
        # Requests waiting at a caller for a replica, beyond which the caller refuses them (429 /
        # RESOURCE_EXHAUSTED): --max-queued per replica, at least the cluster's capacity so that a burst
        # that fits is never refused while it is being routed (Ray counts requests in routing as queued).
        "max_queued_requests": None,
        "request_router_config": RequestRouterConfig(
            request_router_class=MostFreeCapacityRouter, request_routing_stats_period_s=2.0
        ),
        "ray_actor_options": {"num_cpus": options.cpus_per_replica, "num_gpus": gpus},
        "graceful_shutdown_timeout_s": config.drain_timeout_s,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
    }
    if options.autoscale is not None:
        low, high = options.autoscale
        autoscaling = {
            "min_replicas": low,
            "max_replicas": high,
            "target_ongoing_requests": max(1.0, AUTOSCALE_TARGET_FRACTION * capacity),
        }
        autoscaling.update(options.autoscaling_overrides or {})
        replica_options["autoscaling_config"] = autoscaling
        max_replicas = high
    else:
        replica_options["num_replicas"] = options.num_replicas or 1
        max_replicas = replica_options["num_replicas"]
    replica_options["max_queued_requests"] = max(1, max_replicas * (capacity + config.max_queued))
    serve_args = list(options.serve_args)
    ingress_actor_options: dict = {"num_cpus": 0}
    if os.environ.get("TILEVOX_API_KEY") is not None:  # the key reaches the replicas and the ingress on any node
        runtime_env = {"env_vars": {"TILEVOX_API_KEY": os.environ["TILEVOX_API_KEY"]}}
        replica_options["ray_actor_options"]["runtime_env"] = runtime_env
        ingress_actor_options["runtime_env"] = runtime_env
    replicas = serve.deployment(TilevoxReplica).options(name="TilevoxReplica", **replica_options)
    ingress = serve.deployment(serve.ingress()(TilevoxIngress)).options(
        name="TilevoxIngress",
        num_replicas=1,
        max_ongoing_requests=100_000,  # every stream of the cluster passes through here
        ray_actor_options=ingress_actor_options,
    )
    return ingress.bind(replicas.bind(serve_args), serve_args, options.grpc)


def app_builder(args: dict):
    """`serve run` / KubeRay entry point (import_path tilevox.server.ray_serve:app_builder). Keys:
    serve_args (a string or list: `tilevox serve`'s options; give --max-streams here, as `serve run` cannot
    measure it first), num_replicas,
    autoscale ("MIN:MAX"), gpus_per_replica, cpus_per_replica, grpc (bool)."""
    known = {"serve_args", "num_replicas", "autoscale", "gpus_per_replica", "cpus_per_replica", "grpc"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown tilevox application args {unknown}; known: {sorted(known)}")
    serve_args = args.get("serve_args", ())
    if isinstance(serve_args, str):
        serve_args = shlex.split(serve_args)
    options = RayOptions(
        serve_args=tuple(str(a) for a in serve_args),
        num_replicas=None if args.get("num_replicas") is None else int(args["num_replicas"]),
        autoscale=parse_autoscale(str(args["autoscale"])) if args.get("autoscale") else None,
        gpus_per_replica=None if args.get("gpus_per_replica") is None else float(args["gpus_per_replica"]),
        cpus_per_replica=float(args.get("cpus_per_replica", 1.0)),
        grpc=bool(args.get("grpc", True)),
    )
    return build_app(options)


def deploy(options: RayOptions, *, blocking_timeout_s: float = 600.0) -> int:
    """Run the application on the connected Ray cluster; returns each replica's stream capacity. Without
    --max-streams, the first replica measures its capacity from its GPU's free memory (models.capacity, as
    `tilevox serve` does), and the deployment is updated in place (max_ongoing_requests and the autoscaling
    target are lightweight updates: no replica restarts) to what it measured."""
    from ray import serve

    serve.run(build_app(options), name=APP_NAME, route_prefix="/")
    if _parse_serve_args(options.serve_args).max_streams is not None:
        return _server_config(_parse_serve_args(options.serve_args)).max_streams
    replicas = serve.get_deployment_handle("TilevoxReplica", app_name=APP_NAME)
    measured = int(replicas.facts.remote().result(timeout_s=blocking_timeout_s)["max_streams"])
    serve.run(build_app(options, capacity=measured), name=APP_NAME, route_prefix="/")
    log_event(log, "ray.capacity_measured", max_streams=measured)
    return measured


def run_cli(options: RayOptions, *, host: str, http_port: int, on_ready=None) -> None:
    """`tilevox serve --ray`: connect to the Ray cluster at $RAY_ADDRESS (or start a local one), run the
    application with Ray's HTTP proxy on host:http_port, and serve until SIGINT/SIGTERM; then shut Serve
    down (replicas get --drain-timeout for their streams)."""
    import signal
    import threading

    import ray
    from ray import serve

    build_app(options)  # option mistakes surface before Ray starts
    ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": http_port})
        started = time.monotonic()
        capacity = deploy(options)
        log_event(log, "ray.serving", seconds=round(time.monotonic() - started, 1), max_streams=capacity)
        if on_ready is not None:
            on_ready()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
