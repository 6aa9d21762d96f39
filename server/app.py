"""One server process: FastAPI (HTTP + WebSocket) under uvicorn and a grpc.aio server on one
asyncio loop, both feeding one Scheduler whose worker thread owns the model.

`ServerHandle` starts and stops it (tests run it in a background thread on free ports);
`serve(config)` is what `tilevox serve` calls: it runs until SIGTERM/SIGINT, then drains (new
streams get 503/UNAVAILABLE, /ready turns false, active streams get `drain_timeout_s` to finish,
streams still running then end with a `truncated` error on every surface) before stopping. A second
SIGINT/SIGTERM during the drain exits at once. `bind_ports` takes both ports before the model loads,
so a taken port fails fast, naming itself; the gRPC port is bound exclusively (no SO_REUSEPORT).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import grpc
import uvicorn
from fastapi import WebSocket

from tilevox.models.streaming import SpeechModel, SynthesisRequest
from tilevox.server.config import ServerConfig
from tilevox.server.grpc_service import add_to_server
from tilevox.server.http_api import build_http_app
from tilevox.server.logs import log_event
from tilevox.server.metrics import ServerMetrics
from tilevox.server.profiling import WorkerProfile
from tilevox.server.scheduler import Scheduler, SynthesisFailed
from tilevox.server.state import ServerState
from tilevox.server.voices import VoiceCatalog
from tilevox.server.ws import serve_websocket

__all__ = ["BoundPorts", "PortInUseError", "ServerHandle", "bind_ports", "build_state", "serve"]

# Audio per warm-up stream: at every level long enough for a stream's first codec chunk (Llasa's first XCodec2
# block needs 13 frames, 0.26 s), so the chunk decode of each batch bucket is captured too, not at the first
# clients' first audio; the longer texts need only their prefill and a few steps.
WARMUP_AUDIO_S = 0.4
WARMUP_LONG_TEXT_AUDIO_S = 0.1

log = logging.getLogger("tilevox.app")


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the app owns SIGTERM so it can drain first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def build_state(config: ServerConfig, model: SpeechModel) -> ServerState:
    metrics = ServerMetrics()
    if config.max_streams > model.max_streams:
        raise ValueError(
            f"--max-streams {config.max_streams} exceeds what {model.model_id} supports ({model.max_streams})"
        )
    profile = None
    if config.profile_steps:
        profile = WorkerProfile(
            config.profile_steps,
            config.profile_out,
            skip=config.profile_skip,
            min_batch=config.profile_min_batch,
            cuda=config.device == "cuda",
        )
    scheduler = Scheduler(
        model,
        max_active=config.max_streams,
        max_queued=config.max_queued,
        max_batch=config.max_batch,
        newcomer_slack_s=config.newcomer_slack_s,
        prefill_budget=config.prefill_budget,
        metrics=metrics,
        profile=profile,
    )
    return ServerState(
        config=config, model=model, scheduler=scheduler, metrics=metrics, catalog=VoiceCatalog.for_model(model)
    )


class PortInUseError(OSError):
    """A port the server needs is taken (or cannot be bound): the message names host:port."""


def _bind_port(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP (not 0): accepted sockets inherit it, and asyncio sets TCP_NODELAY only on sockets
    # whose proto says TCP. Without it small frames (a `first_audio` event, then audio) wait for the
    # client's delayed ACK (Nagle): ~40 ms late first audio on WebSocket.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUseError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def _grpc_address(host: str, port: int) -> str:
    return f"{'[::]' if host in ('::', '0.0.0.0') else host}:{port}"


@dataclass
class BoundPorts:
    """The HTTP listening socket (kept) and the gRPC port, checked free; made before the model loads."""

    http_sock: socket.socket
    grpc_port: int


def bind_ports(host: str, http_port: int, grpc_port: int) -> BoundPorts:
    """Bind the HTTP port and check the gRPC port is free (grpc binds its own socket later, exclusively),
    so that `tilevox serve` fails on a taken port before spending minutes loading a model."""
    http_sock = _bind_port(host, http_port)
    if grpc_port:
        try:
            probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            try:
                probe.bind((host, grpc_port))
            finally:
                probe.close()
        except OSError as exc:
            http_sock.close()
            raise PortInUseError(f"cannot bind the gRPC port {host}:{grpc_port}: {exc.strerror or exc}") from exc
    return BoundPorts(http_sock=http_sock, grpc_port=grpc_port)


class ServerHandle:
    """Runs the server on its own event loop in a background thread (`start`) or in the
    caller's loop (`run`). Ports of 0 are resolved to free ones before start returns."""

    def __init__(self, config: ServerConfig, model: SpeechModel, *, ports: BoundPorts | None = None, on_ready=None):
        self.config = config
        self.state = build_state(config, model)
        self._http_sock = ports.http_sock if ports is not None else _bind_port(config.host, config.http_port)
        self._on_ready = on_ready  # called once both ports serve (the CLI prints its "serving" line there)
        self.http_port = self._http_sock.getsockname()[1]
        self.grpc_port = config.grpc_port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    async def run(self, *, install_signals: bool = False) -> None:
        state, cfg = self.state, self.config
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        state.scheduler.start()
        app = build_http_app(state)

        @app.websocket("/v1/audio/speech/stream")
        async def speech_stream(ws: WebSocket) -> None:
            await serve_websocket(ws, state)

        uv_config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            log_config=None,  # uvicorn's loggers go through ours (JSON)
            # the frame limit sits above our message limit, so an oversized message gets the documented
            # `message_too_large` event instead of a 1009 close (beyond 4x the limit uvicorn still closes)
            ws_max_size=4 * cfg.max_message_bytes,
            timeout_keep_alive=int(max(1, cfg.idle_timeout_s)),
            timeout_graceful_shutdown=int(cfg.drain_timeout_s) + 1,
            lifespan="off",
        )
        http_server = _Uvicorn(uv_config)
        grpc_server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.so_reuseport", 0),  # gRPC's default would let a second server share the port silently
            ]
        )
        health, health_pb2 = add_to_server(grpc_server, state)
        address = _grpc_address(cfg.host, cfg.grpc_port)
        try:
            self.grpc_port = grpc_server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind ...")
            raise PortInUseError(f"cannot bind the gRPC port {address}: {exc}") from exc
        if self.grpc_port == 0:  # older grpc versions return 0 instead of raising
            raise PortInUseError(f"cannot bind the gRPC port {address}")
        await grpc_server.start()
        http_task = asyncio.create_task(http_server.serve(sockets=[self._http_sock]))
        while not http_server.started:
            if http_task.done():
                await http_task  # surfaces a startup error
            await asyncio.sleep(0.01)
        if cfg.warmup:
            await self._warm_up()
        for service in ("", "nvidia.riva.tts.RivaSpeechSynthesis"):
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        state.is_ready = True
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        log_event(
            log,
            "server.ready",
            model=state.model.model_id,
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            max_streams=cfg.max_streams,
            max_queued=cfg.max_queued,
            auth=cfg.api_key is not None,
        )
        if self._on_ready is not None:
            self._on_ready(self)
        self._started.set()
        await self._stop.wait()

        # Drain: refuse new work, let running streams finish within the deadline, then stop.
        log_event(log, "server.draining", active=state.scheduler.num_active, queued=state.scheduler.num_queued)
        state.is_draining = True
        state.scheduler.stop_accepting()
        await health.enter_graceful_shutdown()
        is_drained = await asyncio.to_thread(state.scheduler.wait_idle, cfg.drain_timeout_s)
        # Streams still running at the deadline are cancelled; their clients see the stream end.
        state.scheduler.shutdown()
        await asyncio.sleep(0.05)  # let the final chunks reach their writers
        http_server.should_exit = True
        await grpc_server.stop(grace=1.0)
        await http_task
        log_event(log, "server.stopped", drained=is_drained)

    def _on_signal(self, sig: signal.Signals) -> None:
        """First signal: drain. A second one while draining: exit now (streams are cut, not finished)."""
        if self._stop.is_set():
            log_event(log, "server.forced_exit", level=logging.WARNING, signal=sig.name)
            logging.shutdown()
            os._exit(130 if sig == signal.SIGINT else 143)
        self._stop.set()

    async def _warm_up(self) -> None:
        await warm_up(self.state)

    # ---- background-thread mode (tests, benchmark) ----------------------------------------
    def start(self, timeout_s: float = 60.0) -> ServerHandle:
        def target():
            try:
                asyncio.run(self.run())
            except BaseException as exc:  # noqa: BLE001 - reported to the thread that called start()
                self._error = exc
                self._started.set()

        self._thread = threading.Thread(target=target, name="tilevox-server", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError("server did not start in time")
        if self._error is not None:
            raise RuntimeError(f"server failed to start: {self._error}") from self._error
        return self

    def request_stop(self) -> None:
        """What SIGTERM does: begin the drain (thread-safe)."""
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self._thread is None or not self._thread.is_alive():
            return
        self.request_stop()
        self._thread.join(timeout_s)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def serve(config: ServerConfig, model: SpeechModel, *, ports: BoundPorts | None = None, on_ready=None) -> None:
    asyncio.run(ServerHandle(config, model, ports=ports, on_ready=on_ready).run(install_signals=True))


async def warm_up(state: ServerState) -> None:
    """Short syntheses before /ready turns true, so the first clients do not pay for lazy
    initialisation (allocator growth, kernel selection, codec buffers, CUDA-graph capture): for each
    level of `warmup_streams`, that many streams at once; then each longer text of `warmup_words` at the
    levels up to the scheduler's largest prefill batch, so that the executor's captured prefill has each
    (batch bucket, prompt-length bucket) too. The longest lengths stop at the first the model refuses.
    First, the model's own `warm_up_batches` at every level."""
    started = time.perf_counter()
    config = state.config
    # The model's late batched work (codec windows of a stream's first seconds) at every level, while no
    # stream runs: the worker thread is idle until the first warm-up stream is submitted below.
    await asyncio.to_thread(state.model.warm_up_batches, config.warmup_streams)
    prefill_levels = [n for n in config.warmup_streams if n <= state.scheduler.max_prefill_batch]
    for words in config.warmup_words:
        text = "Warm up." + " word" * words
        for level in config.warmup_streams if words == 0 else prefill_levels:
            refused = await _warm_level(state, text, level, WARMUP_AUDIO_S if words == 0 else WARMUP_LONG_TEXT_AUDIO_S)
            if refused is not None:
                break
        if refused is not None:
            # words == 0: e.g. a model that needs a voice prompt, served cold; longer: a prompt past the
            # model's context, so this length and the longer ones are captured when first used, if ever
            log_event(
                log,
                "server.warmup_skipped" if words == 0 else "server.warmup_longest",
                level=logging.WARNING if words == 0 else logging.INFO,
                words=words,
                streams=level,
                reason=refused,
            )
            break
    log_event(
        log,
        "server.warmed_up",
        seconds=round(time.perf_counter() - started, 3),
        levels=list(config.warmup_streams),
        words=list(config.warmup_words),
    )


async def _warm_level(state: ServerState, text: str, level: int, audio_s: float) -> str | None:
    """`level` streams of `text` (`audio_s` of audio each) at once; the reason if the model refused them."""
    handles = []
    try:
        for seed in range(level):
            handles.append(state.scheduler.submit(SynthesisRequest(text=text, seed=seed, max_duration_s=audio_s)))
        await asyncio.gather(*(handle.collect() for handle in handles))
    except (ValueError, SynthesisFailed) as exc:
        for handle in handles:
            handle.cancel()
        return str(exc)
    return None
