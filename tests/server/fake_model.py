"""A small deterministic SpeechModel test double for the scheduler and protocol tests.

Each stream's audio depends only on (text, seed): frame k of a stream is noise drawn from a
generator seeded by (seed, text, k), so batching cannot change it. The first step returns no
samples (like a codec waiting for lookahead); the stream stops after `len(text)` frames or at
max_duration_s. It records every step's ids so tests can check batching and fairness.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from tilevox.models.errors import RequestError
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import AudioChunk, FinishReason, SpeechModel, SynthesisRequest, VoiceInfo


class FakeSpeechModel(SpeechModel):
    def __init__(
        self,
        *,
        sample_rate_hz: int = 16000,
        frame_rate_hz: float = 50.0,
        max_streams: int = 64,
        step_delay_s: float = 0.0,
    ):
        self.model_id = "fake-tts"
        self.sample_rate_hz = sample_rate_hz
        self.frame_rate_hz = frame_rate_hz
        self.device = torch.device("cpu")
        self.max_streams = max_streams
        self.step_delay_s = step_delay_s
        self.samples_per_frame = round(sample_rate_hz / frame_rate_hz)
        self._streams: dict[int, dict] = {}
        self._next_id = 0
        self.step_log: list[tuple[int, ...]] = []
        self.closed: list[int] = []
        self.open_at_step: dict[int, int] = {}  # stream id -> len(step_log) when it was opened
        self._owner: threading.Thread | None = None

    def voices(self):
        return (VoiceInfo(name="anna", languages=("en",)), VoiceInfo(name="bert", languages=("en",)))

    def validate(self, request: SynthesisRequest) -> None:
        if request.voice is not None and request.voice not in {v.name for v in self.voices()}:
            raise RequestError(f"voice {request.voice!r} is not one of anna, bert")

    def _check_thread(self) -> None:
        # The scheduler promises a single owner thread for open/step/close.
        if self._owner is None:
            self._owner = threading.current_thread()
        assert self._owner is threading.current_thread(), "model used from two threads"

    def open_stream(self, request: SynthesisRequest) -> int:
        self._check_thread()
        self.validate(request)
        sid = self._next_id
        self._next_id += 1
        self.open_at_step[sid] = len(self.step_log)
        max_frames = min(
            len(request.text),
            int(request.max_duration_s * self.frame_rate_hz),
            (request.sampling or SamplingParams()).max_new_tokens,
        )
        key = zlib.crc32(f"{request.seed}|{request.voice}|{request.text}".encode())
        self._streams[sid] = {"key": key, "frame": 0, "max_frames": max(1, max_frames), "started": False}
        return sid

    def frame_samples(self, key: int, frame_idx: int) -> np.ndarray:
        rng = np.random.default_rng([key, frame_idx])
        return (rng.standard_normal(self.samples_per_frame) * 0.2).astype(np.float32)

    def step(self, stream_ids: Sequence[int]) -> list[AudioChunk]:
        self._check_thread()
        self.step_log.append(tuple(stream_ids))
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = []
        for sid in stream_ids:
            st = self._streams[sid]
            if not st["started"]:  # lookahead: a frame is generated but no audio is final yet
                st["started"] = True
                st["frame"] += 1
                samples = np.zeros(0, dtype=np.float32)
            else:
                samples = self.frame_samples(st["key"], st["frame"] - 1)
                st["frame"] += 1
            finished = st["frame"] >= st["max_frames"]
            if finished:
                # the final step also releases the held-back frame
                samples = np.concatenate([samples, self.frame_samples(st["key"], st["frame"] - 1)])
                del self._streams[sid]
            out.append(AudioChunk(sid, samples, 1, FinishReason.LENGTH if finished else None))
        return out

    def close(self, stream_id: int) -> bool:
        self._check_thread()
        self.closed.append(stream_id)
        return self._streams.pop(stream_id, None) is not None

    @property
    def open_stream_ids(self):
        return tuple(self._streams)

    @property
    def is_random(self) -> bool:
        return True

    def expected(self, request: SynthesisRequest) -> np.ndarray:
        """The audio a solo run of `request` must produce."""
        max_frames = max(
            1,
            min(
                len(request.text),
                int(request.max_duration_s * self.frame_rate_hz),
                (request.sampling or SamplingParams()).max_new_tokens,
            ),
        )
        key = zlib.crc32(f"{request.seed}|{request.voice}|{request.text}".encode())
        return np.concatenate([self.frame_samples(key, k) for k in range(max_frames)])
