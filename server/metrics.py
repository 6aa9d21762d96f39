"""Prometheus metrics of one server process, in a private registry (so tests can run many servers).

Names follow Prometheus conventions: counters end in `_total`, durations are seconds. Frames per
second and real-time factor come from counters (`rate(tilevox_frames_total[1m])`,
`rate(tilevox_step_seconds_total[1m]) / rate(tilevox_audio_seconds_total[1m])`), plus a
per-request RTF histogram and a gauge of the last step window's frames/s for quick reads.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServerMetrics"]

_TTFA_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class ServerMetrics:
    def __init__(self, *, window_s: float = 5.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttfa_seconds = Histogram(
            "tilevox_time_to_first_audio_seconds",
            "Request accepted to first audio produced",
            buckets=_TTFA_BUCKETS_S,
            registry=r,
        )
        self.rtf = Histogram(
            "tilevox_request_real_time_factor",
            "Per-request wall time over audio duration",
            buckets=_RTF_BUCKETS,
            registry=r,
        )
        self.active_streams = Gauge("tilevox_active_streams", "Streams in the running batch", registry=r)
        self.queue_depth = Gauge("tilevox_queue_depth", "Accepted streams waiting for a slot", registry=r)
        self.frames_total = Counter("tilevox_frames_total", "Codec frames generated", registry=r)
        self.audio_seconds_total = Counter("tilevox_audio_seconds_total", "Seconds of audio generated", registry=r)
        self.step_seconds_total = Counter("tilevox_step_seconds_total", "Model step wall time", registry=r)
        self.steps_total = Counter(
            "tilevox_steps_total", "Model steps (one frame of every stream in the batch)", registry=r
        )
        self.prefill_seconds_total = Counter(
            "tilevox_prefill_seconds_total", "Batched prefill (admission) wall time", registry=r
        )
        self.prefills_total = Counter("tilevox_prefills_total", "Batched prefills", registry=r)
        self.admissions_total = Counter("tilevox_admissions_total", "Requests admitted by a prefill", registry=r)
        self.frames_per_second = Gauge(
            "tilevox_frames_per_second", "Frames generated per second over the last window", registry=r
        )
        self.requests_total = Counter(
            "tilevox_requests_total", "Finished streams by API and outcome", ["api", "outcome"], registry=r
        )
        self._window_s = window_s
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def observe_step(self, *, num_frames: int, step_s: float) -> None:
        now = time.monotonic()
        self.frames_total.inc(num_frames)
        self.step_seconds_total.inc(step_s)
        self.steps_total.inc()
        with self._lock:
            self._window.append((now, num_frames))
            while self._window and self._window[0][0] < now - self._window_s:
                self._window.popleft()
            self.frames_per_second.set(sum(n for _, n in self._window) / self._window_s)

    def observe_prefill(self, *, num_requests: int, prefill_s: float) -> None:
        self.prefill_seconds_total.inc(prefill_s)
        self.prefills_total.inc()
        self.admissions_total.inc(num_requests)

    def observe_finished(self, stats) -> None:
        self.audio_seconds_total.inc(stats.audio_duration_s)
        if stats.num_samples:
            self.rtf.observe(stats.real_time_factor)

    def render(self) -> bytes:
        return generate_latest(self.registry)
