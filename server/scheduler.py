"""Continuous batching at codec-frame granularity over one `SpeechModel`.

One worker thread owns the model (and so the device): it alone calls open_stream, step and
close. Between two steps it closes cancelled streams, admits queued requests into free slots
and picks the next batch, so streams join and leave the running batch every frame. Admission
is bounded (`max_active` running + `max_queued` waiting); beyond that `submit` raises
`OverloadedError` at once, with a Retry-After from the measured rate at which streams finish.

Fair admission: the waiting requests form one FIFO across all surfaces. A refusal also hands out a
ticket (valid for `TICKET_TTL_S` after its Retry-After; the newest `MAX_TICKETS` are kept); a client that
comes back with it is queued even when the queue is full (up to another `max_active + max_queued`
waiting), in the order of its first attempt, so clients that wait as told are served before later
arrivals and are not beaten by clients that retry at once. A client that does not echo the ticket but
retries on the same connection (front ends pass it as `client`; stock clients such as OpenAI's SDK honour
`retry-after-ms` over a kept-alive connection but do not know `x-tilevox-ticket`) keeps its place the same
way. Tickets never hold places: a ticket nobody redeems costs nothing. Each stream's chunks reach the
asyncio loop through `loop.call_soon_threadsafe`, so front ends simply iterate a `StreamHandle`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np

from tilevox.models.capacity import MAX_PREFILL_BATCH
from tilevox.models.streaming import AudioChunk, FinishReason, SpeechModel, SynthesisRequest
from tilevox.server.metrics import ServerMetrics
from tilevox.server.profiling import WorkerProfile

__all__ = [
    "OverloadedError",
    "Scheduler",
    "ShuttingDownError",
    "StreamHandle",
    "StreamStats",
    "StreamTruncated",
    "SynthesisFailed",
]

log = logging.getLogger("tilevox.scheduler")

TICKET_TTL_S = 10.0  # how long after its Retry-After a refused client's ticket keeps its place in line
MAX_TICKETS = 10_000  # outstanding tickets kept (oldest dropped): bounded memory under any retry storm


class OverloadedError(RuntimeError):
    """All running slots and queue places are taken (HTTP 429 / RESOURCE_EXHAUSTED). `retry_after_s` is
    when a place is expected to be free, from the measured rate at which streams finish."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, ticket: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.ticket = ticket  # present it on the retry (HTTP header / gRPC metadata `x-tilevox-ticket`)


class ShuttingDownError(RuntimeError):
    """The server is draining and accepts no new streams (HTTP 503 / UNAVAILABLE)."""


class SynthesisFailed(RuntimeError):
    """The model raised while opening or stepping this stream (HTTP 500 / INTERNAL)."""


class StreamTruncated(RuntimeError):
    """The stream was cut before its end (the drain deadline passed, or the server stopped): raised
    from the handle's iteration after the audio already delivered, so no surface can mistake a cut
    stream for a finished one (HTTP: aborted body / SSE error event, WS `error` code `truncated`,
    gRPC ABORTED)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamStats:
    num_frames: int
    num_samples: int
    sample_rate_hz: int
    queue_wait_s: float  # submit -> open_stream returned
    time_to_first_audio_s: float  # submit -> first non-empty chunk (nan if none)
    wall_time_s: float  # submit -> last chunk
    finish_reason: FinishReason

    @property
    def audio_duration_s(self) -> float:
        return self.num_samples / self.sample_rate_hz

    @property
    def real_time_factor(self) -> float:
        return self.wall_time_s / self.audio_duration_s if self.num_samples else float("inf")

    def as_dict(self) -> dict:
        return {
            "num_frames": self.num_frames,
            "audio_duration_s": round(self.audio_duration_s, 4),
            "queue_wait_ms": round(self.queue_wait_s * 1e3, 2),
            "time_to_first_audio_ms": None
            if np.isnan(self.time_to_first_audio_s)
            else round(self.time_to_first_audio_s * 1e3, 2),
            "wall_time_ms": round(self.wall_time_s * 1e3, 2),
            "real_time_factor": round(self.real_time_factor, 4) if self.num_samples else None,
            "finish_reason": self.finish_reason.value,
        }


_END = object()
MAX_JOINED_CHUNKS = 8  # model chunks a StreamHandle joins into one array at most


def _put_all(items: list[tuple[StreamHandle, object]]) -> None:
    """On an event loop: hand a worker step's items to their streams, in order."""
    for handle, item in items:
        handle._queue.put_nowait(item)


class StreamHandle:
    """The asyncio-side view of one stream: `async for samples in handle` yields float32 arrays
    (never empty) until the stream finishes; then `handle.stats` is set. Raises SynthesisFailed
    if the model failed. `cancel()` is safe from any thread and idempotent. Chunks that are already
    waiting when the consumer asks come joined, up to MAX_JOINED_CHUNKS per array (a consumer that falls
    behind catches up in fewer writes, and a fast producer's audio still streams in pieces)."""

    def __init__(
        self, scheduler: Scheduler, handle_id: int, request: SynthesisRequest, loop: asyncio.AbstractEventLoop
    ):
        self.handle_id = handle_id
        self.request = request
        self._scheduler = scheduler
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._held = None  # an end, stats or error item taken while joining waiting chunks
        self.stats: StreamStats | None = None
        # worker-thread state
        self.submitted_at = time.perf_counter()
        self.model_stream_id: int | None = None
        self.opened_at = float("nan")
        self.first_audio_at = float("nan")
        self.num_frames = 0
        self.num_samples = 0
        self.is_cancelled = False
        self.is_truncated = False  # cut by the server (shutdown), not by its client
        self.queue_order = time.monotonic()  # place in the waiting FIFO: the first attempt's time
        self.holds_ticket = False  # admitted with a ticket: does not count against max_queued

    def cancel(self) -> None:
        self._scheduler._cancel(self)

    # ---- called on the worker thread -------------------------------------------------
    def _deliver(self, item) -> None:
        outbox = getattr(self._scheduler._worker_local, "outbox", None)
        if outbox is not None:  # inside a worker step: sent with the step's other items in one wake-up
            outbox.append((self, item))
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    # ---- asyncio side --------------------------------------------------------------
    def __aiter__(self):
        return self

    async def __anext__(self) -> np.ndarray:
        if self._held is not None:
            item, self._held = self._held, None
        else:
            item = await self._queue.get()
        if isinstance(item, np.ndarray):
            pieces = [item]
            while len(pieces) < MAX_JOINED_CHUNKS and not self._queue.empty():
                waiting = self._queue.get_nowait()
                if not isinstance(waiting, np.ndarray):
                    self._held = waiting
                    break
                pieces.append(waiting)
            return item if len(pieces) == 1 else np.concatenate(pieces)
        if item is _END:
            self._queue.put_nowait(_END)  # later iterations also stop
            raise StopAsyncIteration
        if isinstance(item, StreamStats):
            self.stats = item
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._queue.put_nowait(_END)
            raise item
        return item

    async def collect(self) -> np.ndarray:
        pieces = [s async for s in self]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


class PrefillBudget:
    """How many admissions a worker iteration may prefill before the running streams step (policy only).

    An iteration is a prefill then a step, so a playing stream's next audio arrives a prefill plus a step
    after the last: with `buffered_s` the least audio any playing stream has left in its client's buffer,
    the prefill may take buffered_s - step - margin. A prefill of n admissions is priced as fixed + n x
    marginal, fitted by least squares to recent prefills (exponentially forgotten; the plain ratio
    time / n until prefills of two sizes are seen), the step at its moving average. At least one admission
    per iteration, so newcomers always progress; unconstrained before anything is measured or while nothing
    plays (no buffer to protect)."""

    def __init__(self, *, margin_s: float = 0.010, smoothing: float = 0.2) -> None:
        self.margin_s = margin_s
        self.smoothing = smoothing
        self.step_s: float | None = None
        self._sums = [0.0] * 5  # weighted sums of 1, n, t, n^2, n t over past prefills

    def observe_step(self, step_s: float) -> None:
        self.step_s = step_s if self.step_s is None else self.step_s + self.smoothing * (step_s - self.step_s)

    def observe_prefill(self, admissions: int, prefill_s: float) -> None:
        n, t = float(admissions), prefill_s
        keep = 1.0 - self.smoothing
        self._sums = [keep * old + new for old, new in zip(self._sums, (1.0, n, t, n * n, n * t))]

    def cost(self) -> tuple[float, float] | None:
        """(fixed, per-admission) seconds of a prefill, or None before any prefill."""
        w, sn, st, snn, snt = self._sums
        if w == 0.0:
            return None
        mean_n, mean_t = sn / w, st / w
        var_n = snn / w - mean_n * mean_n
        if var_n < 1e-6:  # one size so far: no split between fixed and marginal cost
            return 0.0, mean_t / mean_n
        marginal = max((snt / w - mean_n * mean_t) / var_n, 1e-5)
        return max(mean_t - marginal * mean_n, 0.0), marginal

    def admissions(self, buffered_s: float | None) -> int:
        """The most admissions this iteration may prefill (a large number when unconstrained)."""
        cost = self.cost()
        if buffered_s is None or self.step_s is None or cost is None:
            return 1 << 30
        fixed, marginal = cost
        budget = buffered_s - self.step_s - self.margin_s - fixed
        return max(1, int(budget / marginal)) if budget > 0 else 1


class Scheduler:
    """Owns the model worker thread. `max_batch` caps how many streams one step carries; when
    more are running, streams that have not produced audio yet go first, then the rest in
    round-robin order, so a newcomer's first audio never waits behind long streams.

    First audio first: while some streams wait for their first audio and every stream already playing
    has at least `newcomer_slack_s` of audio delivered beyond what real time has consumed since its first
    audio (its client's buffer), a step carries the waiting streams alone: a smaller batch, so a faster
    step, so earlier first audio (Llasa needs 13 steps before its first block). The rule is checked
    before every step, so a playing stream pauses at most one iteration (a prefill plus a step) past the
    point where its buffer falls to `newcomer_slack_s`. None, the default: every step carries every
    running stream (up to max_batch). Side by side on the H200 (2026-12-04,
    benchmarks/results/executor_h200_ff8846e_log.txt), 0.2 s helped Qwen3-TTS at 32 streams (TTFA p50 157
    vs 186 ms, p95 244 vs 266, stalls 2 vs 19); for Llasa the runs were mixed (8 streams, TTFA p50: 126 vs
    172 ms without graph prefill, 187 vs 107 with it) and its streams stalled more at 64 (73 and 44 vs 0),
    a cause not yet found. So it is opt-in: `tilevox serve --newcomer-slack-ms 200`."""

    def __init__(
        self,
        model: SpeechModel,
        *,
        max_active: int,
        max_queued: int,
        max_batch: int | None = None,
        max_prefill_batch: int = MAX_PREFILL_BATCH,
        prefill_budget: bool = False,
        newcomer_slack_s: float | None = None,
        metrics: ServerMetrics | None = None,
        profile: WorkerProfile | None = None,
    ) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {max_active}")
        if max_active > model.max_streams:
            raise ValueError(f"max_active {max_active} exceeds the model's max_streams {model.max_streams}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {max_batch}")
        if max_prefill_batch < 1:
            raise ValueError(f"max_prefill_batch must be >= 1, got {max_prefill_batch}")
        if newcomer_slack_s is not None and not newcomer_slack_s >= 0:
            raise ValueError(f"newcomer_slack_s must be >= 0 or None, got {newcomer_slack_s}")
        self.model = model
        self.max_active = max_active
        self.max_queued = max_queued
        self.max_batch = max_batch or max_active
        # Admissions per worker iteration while streams are running: their prompts run as one batched
        # prefill, then the running streams step; a burst is spread over frames so that no running
        # stream waits for more than one prefill of this many prompts between two of its frames.
        self.max_prefill_batch = max_prefill_batch
        # Prefill time budget: fewer admissions in an iteration when the prefill of max_prefill_batch would
        # make a playing stream's next audio arrive after its client's buffer has run dry (PrefillBudget).
        self.prefill_budget = PrefillBudget() if prefill_budget else None
        self.newcomer_slack_s = newcomer_slack_s
        self.newcomer_steps = 0  # steps that carried waiting streams alone (first audio first)
        self.metrics = metrics
        self.profile = profile  # `--profile-steps`: wraps worker iterations that step
        self._worker_local = threading.local()  # .outbox: the items a worker step delivers, sent at its end
        self._lock = threading.Condition()
        self._pending: collections.deque[StreamHandle] = collections.deque()
        self._active: dict[int, StreamHandle] = {}  # model stream id -> handle, in round-robin order
        self._to_close: list[StreamHandle] = []
        self._unfinished: dict[int, StreamHandle] = {}  # every handle not yet ended, wherever it is
        self._ids = itertools.count(1)
        self._finish_times: collections.deque[float] = collections.deque(maxlen=4096)  # monotonic, for Retry-After
        self._tickets: collections.OrderedDict[str, tuple[float, float]] = (
            collections.OrderedDict()
        )  # -> (first attempt, expires)
        # connection -> the ticket its last refusal handed out (a retry on it without the ticket redeems it)
        self._client_tickets: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._accepting = True
        self._stop = False
        self.worker_error: BaseException | None = None  # set if the worker loop itself died
        self._thread = threading.Thread(target=self._run, name="tilevox-model-worker", daemon=True)
        self.step_batch_sizes: collections.deque[int] = collections.deque(maxlen=4096)  # for tests and metrics

    # ---- public API (any thread; submit from the event loop) ---------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    @property
    def num_queued(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(
        self, request: SynthesisRequest, *, ticket: str | None = None, client: str | None = None
    ) -> StreamHandle:
        """Validate and enqueue; raises RequestError (bad request), OverloadedError or ShuttingDownError.
        `ticket`: what an earlier OverloadedError handed out (unknown or expired tickets are ignored).
        `client`: the connection the request came on (e.g. "http 127.0.0.1:53122"); without `ticket`, the
        ticket of that connection's last refusal is used."""
        self.model.validate(request)
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.worker_error is not None:
                raise SynthesisFailed(f"the model worker stopped: {self.worker_error}")
            if not self._accepting:
                raise ShuttingDownError("server is shutting down")
            now = time.monotonic()
            while self._tickets and (len(self._tickets) > MAX_TICKETS or next(iter(self._tickets.values()))[1] < now):
                self._tickets.popitem(last=False)  # tickets expire in the order they were handed out
            if client is not None:
                remembered = self._client_tickets.pop(client, None)
                ticket = ticket or remembered
            redeemed = self._tickets.pop(ticket, None) if ticket else None
            if redeemed is not None and redeemed[1] < now:
                redeemed = None  # expired: a newcomer again
            # A handle counts against the limits until the worker has closed it; ticket holders wait
            # beyond max_queued, up to another max_active + max_queued of them.
            holders = sum(1 for h in self._pending if h.holds_ticket)
            used = len(self._active) + len(self._to_close) + len(self._pending) - holders
            limit = self.max_active + self.max_queued
            if (used >= limit and redeemed is None) or (redeemed is not None and holders >= limit):
                retry_after_s = self._expected_wait_s()
                new_ticket = secrets.token_urlsafe(12)  # a returning client keeps its first attempt's place
                self._tickets[new_ticket] = (redeemed[0] if redeemed else now, now + retry_after_s + TICKET_TTL_S)
                if client is not None:
                    self._client_tickets[client] = new_ticket
                    while len(self._client_tickets) > MAX_TICKETS:
                        self._client_tickets.popitem(last=False)
                raise OverloadedError(
                    f"server busy: {self.max_active} streams running and {self.max_queued} queued; "
                    f"retry in {retry_after_s:.1f} s",
                    retry_after_s=retry_after_s,
                    ticket=new_ticket,
                )
            handle = StreamHandle(self, next(self._ids), request, loop)
            if redeemed is None:
                self._pending.append(handle)
            else:  # back in the line at its first attempt's place
                handle.holds_ticket, handle.queue_order = True, redeemed[0]
                index = next(
                    (i for i, h in enumerate(self._pending) if h.queue_order > handle.queue_order), len(self._pending)
                )
                self._pending.insert(index, handle)
            self._unfinished[handle.handle_id] = handle
            self._update_gauges()
            self._lock.notify()
        return handle

    def _expected_wait_s(self) -> float:
        """Under the lock: seconds until a newcomer would reach a running slot: the streams waiting ahead
        of it (plus itself) over the rate at which streams finished in the last minute (1 s before two
        have finished; between 50 ms and 30 s)."""
        now = time.monotonic()
        while self._finish_times and self._finish_times[0] < now - 60.0:
            self._finish_times.popleft()
        if len(self._finish_times) < 2:
            return 1.0
        rate = len(self._finish_times) / max(now - self._finish_times[0], 1e-3)
        return min(30.0, max(0.05, (len(self._pending) + 1) / rate))

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until nothing runs or waits; returns False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._active or self._pending or self._to_close:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(timeout=min(left, 0.05))
        return True

    def shutdown(self) -> None:
        """Stop the worker (after draining, or at the drain deadline). Streams still waiting or running
        are cut: their iteration raises StreamTruncated after the audio already delivered."""
        with self._lock:
            self._accepting = False
            for handle in list(self._pending) + list(self._active.values()):
                handle.is_cancelled = True
                handle.is_truncated = True
                self._to_close.append(handle)
            self._pending.clear()
            self._stop = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # ---- internals -------------------------------------------------------------------
    def _cancel(self, handle: StreamHandle) -> None:
        with self._lock:
            if handle.is_cancelled or handle.stats is not None:
                return
            handle.is_cancelled = True
            if handle in self._pending:
                self._pending.remove(handle)
                self._finish(handle, FinishReason.CANCELLED)
            elif handle.model_stream_id in self._active:
                self._to_close.append(handle)
            self._update_gauges()
            self._lock.notify()

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.active_streams.set(len(self._active))
            self.metrics.queue_depth.set(len(self._pending))

    def _finish(self, handle: StreamHandle, reason: FinishReason) -> None:
        """Set the handle's stats and end its iteration: cleanly, or with StreamTruncated if the server cut it."""
        now = time.perf_counter()
        stats = StreamStats(
            num_frames=handle.num_frames,
            num_samples=handle.num_samples,
            sample_rate_hz=self.model.sample_rate_hz,
            queue_wait_s=handle.opened_at - handle.submitted_at,
            time_to_first_audio_s=handle.first_audio_at - handle.submitted_at,
            wall_time_s=now - handle.submitted_at,
            finish_reason=reason,
        )
        handle.stats = stats  # visible to the worker at once; the loop side sets it again on receipt
        self._unfinished.pop(handle.handle_id, None)
        self._finish_times.append(time.monotonic())
        if handle.is_truncated:
            handle._deliver(
                StreamTruncated(
                    f"stream cut by the server after {handle.num_samples / self.model.sample_rate_hz:.2f} s of audio "
                    "(server shutting down: the drain deadline passed)"
                )
            )
        else:
            handle._deliver(stats)
        if self.metrics is not None:
            self.metrics.observe_finished(stats)

    def _fail(self, handle: StreamHandle, exc: BaseException) -> None:
        handle.stats = StreamStats(
            num_frames=handle.num_frames,
            num_samples=handle.num_samples,
            sample_rate_hz=self.model.sample_rate_hz,
            queue_wait_s=float("nan"),
            time_to_first_audio_s=float("nan"),
            wall_time_s=time.perf_counter() - handle.submitted_at,
            finish_reason=FinishReason.CANCELLED,
        )
        self._unfinished.pop(handle.handle_id, None)
        handle._deliver(SynthesisFailed(f"synthesis failed: {type(exc).__name__}: {exc}"))

    def _take_work(self) -> tuple[list[StreamHandle], list[StreamHandle], list[StreamHandle]] | None:
        """Under the lock: wait for work, then return (to close, to admit, batch candidates)."""
        with self._lock:
            while not (self._stop or self._to_close or self._pending or self._active):
                self._lock.wait()
            if self._stop and not self._to_close:
                return None
            to_close, self._to_close = self._to_close, []
            for handle in to_close:
                self._active.pop(handle.model_stream_id, None)
            free = self.max_active - len(self._active)
            if self._active:
                free = min(free, self.max_prefill_batch)
                if self.prefill_budget is not None and self._pending:
                    free = min(free, self.prefill_budget.admissions(self._buffered_s(self._active.values())))
            admit = [self._pending.popleft() for _ in range(min(free, len(self._pending)))]
            return to_close, admit, list(self._active.values())

    def _buffered_s(self, handles) -> float | None:
        """The least audio a playing stream has delivered beyond what real time has consumed since its first
        audio (its client's buffer), over the streams whose buffer has not run dry (waiting cannot undo a
        stall that has happened); None if there are none."""
        now, rate = time.perf_counter(), self.model.sample_rate_hz
        buffers = [h.num_samples / rate - (now - h.first_audio_at) for h in handles if not np.isnan(h.first_audio_at)]
        buffers = [b for b in buffers if b > 0]
        return min(buffers) if buffers else None

    def _ready(self, running: list[StreamHandle]) -> list[StreamHandle]:
        """The streams whose prefill has finished (a model prefilling on its own CUDA stream, models.cuda_streams:
        the others join a later step instead of holding this one up); all of them when none has (the step then
        waits for the prefills on the device: nothing else could run meanwhile)."""
        ready = [h for h in running if self.model.is_ready(h.model_stream_id)]
        return ready or running

    def _pick_batch(self, running: list[StreamHandle]) -> list[StreamHandle]:
        if self.newcomer_slack_s is None and len(running) <= self.max_batch:
            return running  # the plain path: everyone, no sorting
        waiting = sorted((h for h in running if np.isnan(h.first_audio_at)), key=lambda h: h.submitted_at)
        started = [h for h in running if not np.isnan(h.first_audio_at)]
        if waiting and started and self.newcomer_slack_s is not None:
            now, rate = time.perf_counter(), self.model.sample_rate_hz
            slack = min(h.num_samples / rate - (now - h.first_audio_at) for h in started)
            if slack >= self.newcomer_slack_s:  # first audio first: the playing streams can wait a step
                self.newcomer_steps += 1
                return waiting[: self.max_batch]
        if len(running) <= self.max_batch:
            return running
        # Streams still waiting for first audio first (oldest first), then round-robin the rest.
        batch = (waiting + started)[: self.max_batch]
        with self._lock:
            # Rotate: move the stepped ones to the back of the dict order.
            for h in batch:
                if h.model_stream_id in self._active:
                    self._active[h.model_stream_id] = self._active.pop(h.model_stream_id)
        return batch

    def _run(self) -> None:
        try:
            self._loop_forever()
        except Exception as exc:  # a bug or a failing close(): fail every stream loudly, refuse new ones
            log.exception("model worker died")
            with self._lock:
                self.worker_error = exc
                handles = list(self._unfinished.values())
                self._pending.clear()
                self._active.clear()
                self._to_close = []
                self._update_gauges()
                self._lock.notify_all()
            for handle in handles:
                if handle.stats is None:
                    self._fail(handle, exc)

    def _loop_forever(self) -> None:
        while True:
            work = self._take_work()
            if work is None:
                break
            to_close, admit, running = work
            for handle in to_close:
                if handle.model_stream_id is not None:
                    self.model.close(handle.model_stream_id)
                self._finish(handle, FinishReason.CANCELLED)
            started = time.perf_counter()
            try:
                opened = self.model.open_streams([handle.request for handle in admit]) if admit else []
            except Exception as exc:  # the batched prefill itself failed: those requests fail, the worker goes on
                opened = [exc] * len(admit)
            if admit and self.metrics is not None:
                self.metrics.observe_prefill(num_requests=len(admit), prefill_s=time.perf_counter() - started)
            if admit and self.prefill_budget is not None:
                self.prefill_budget.observe_prefill(len(admit), time.perf_counter() - started)
            for handle, result in zip(admit, opened, strict=True):
                if isinstance(result, Exception):  # a model failure must fail this request only, never the worker
                    log.error("open_stream failed for stream %d", handle.handle_id, exc_info=result)
                    self._fail(handle, result)
                    continue
                handle.model_stream_id = result
                handle.opened_at = time.perf_counter()
                with self._lock:
                    if handle.is_cancelled:
                        self._to_close.append(handle)
                    self._active[handle.model_stream_id] = handle
                running.append(handle)
            with self._lock:
                self._update_gauges()
                self._lock.notify_all()  # wake wait_idle
                running = [h for h in running if h.model_stream_id in self._active and not h.is_cancelled]
            if not running:
                continue
            batch = self._pick_batch(self._ready(running))
            if self.profile is not None:
                self.profile.begin(len(batch))
            self._step(batch)
            if self.profile is not None:
                self.profile.end()

    def _step(self, batch: list[StreamHandle]) -> None:
        """One model step; every item it hands to streams reaches their event loops in one call per loop."""
        self._worker_local.outbox = []
        try:
            self._step_streams(batch)
        finally:
            outbox, self._worker_local.outbox = self._worker_local.outbox, None
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[StreamHandle, object]]] = {}
            for handle, item in outbox:
                by_loop.setdefault(handle._loop, []).append((handle, item))
            for loop, items in by_loop.items():
                loop.call_soon_threadsafe(_put_all, items)

    def _step_streams(self, batch: list[StreamHandle]) -> None:
        ids = [h.model_stream_id for h in batch]
        started = time.perf_counter()
        try:
            chunks: list[AudioChunk] = self.model.step(ids)
        except Exception as exc:  # fail the whole batch; the model's state for it is unknown
            log.exception("model.step failed for %d streams", len(ids))
            with self._lock:
                for handle in batch:
                    self._active.pop(handle.model_stream_id, None)
            for handle in batch:
                self.model.close(handle.model_stream_id)
                self._fail(handle, exc)
            return
        now = time.perf_counter()
        self.step_batch_sizes.append(len(batch))
        if self.prefill_budget is not None:
            self.prefill_budget.observe_step(now - started)
        num_frames = 0
        for handle, chunk in zip(batch, chunks, strict=True):
            num_frames += chunk.num_new_frames
            handle.num_frames += chunk.num_new_frames
            if chunk.samples.size:
                if np.isnan(handle.first_audio_at):
                    handle.first_audio_at = now
                    if self.metrics is not None:
                        self.metrics.ttfa_seconds.observe(now - handle.submitted_at)
                handle.num_samples += chunk.samples.size
                handle._deliver(chunk.samples.astype(np.float32, copy=False))
            if chunk.finish_reason is not None:
                with self._lock:
                    self._active.pop(handle.model_stream_id, None)
                    if handle in self._to_close:  # cancelled during this step: it finished anyway
                        self._to_close.remove(handle)
                self._finish(handle, chunk.finish_reason)
        if self.metrics is not None:
            self.metrics.observe_step(num_frames=num_frames, step_s=now - started)
        with self._lock:
            self._update_gauges()
            self._lock.notify_all()
