"""Measuring a model's regions where they run: per-region time of `SpeechModel.step`, and this machine's
provenance for the plan.

The models label each phase of a step with `torch.profiler.record_function("tilevox.<phase>")`, the
phase named after its region (`tilevox.talker_step`, `tilevox.code_predictor_loop`,
`tilevox.decoder_step`, ...), an executor region's too (Qwen3-TTS `tilevox.codec_decode`: the batched
decode of the streams' new frames through whatever backend the region has). `phases_timed(PhaseTimer(device))`
swaps that name in the labelled modules for a timer that synchronises the device before and after each
phase, so a phase's time includes its launches and its GPU work. `SteadyStreams` keeps B streams open,
replacing finished ones outside the timed spans. `region_times` runs warm-up steps, then timed steps, and
returns each phase's median per step; `step_time_ms` times whole steps (one sync each, no per-region
syncs) and returns their mean. `this_machine` is the provenance a plan built here records and a plan
loaded here must match.
Imports: torch, models (streaming, capacity), engine_builder.plan, trt_plugins.library (path only).
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

from tilevox.engine_builder.plan import Provenance
from tilevox.models.capacity import MAX_PREFILL_BATCH
from tilevox.models.errors import RequestError
from tilevox.models.streaming import SynthesisRequest

__all__ = [
    "LABELLED_MODULES",
    "PhaseTimer",
    "SteadyStreams",
    "phases_timed",
    "region_times",
    "settle",
    "step_time_ms",
    "this_machine",
]

# Modules whose phases are labelled with record_function (each imports the name, so each is patched).
LABELLED_MODULES = ("tilevox.models.qwen3_tts.model", "tilevox.models.llasa.model", "tilevox.models.nh_tts.model")
PROFILE_TEXT = (
    "Streaming speech synthesis on a Hopper GPU, one frame at a time, for as long as the profile needs "
    "it to go on, with many streams sharing every step of the model. "
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Stands in for `record_function` in the labelled modules: sync, time, sync, add (milliseconds)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.totals[name.removeprefix("tilevox.")] += (time.perf_counter() - start) * 1e3


@contextlib.contextmanager
def phases_timed(timer: PhaseTimer):
    modules = [sys.modules[name] for name in LABELLED_MODULES if name in sys.modules]
    saved = [module.record_function for module in modules]
    for module in modules:
        module.record_function = timer
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module.record_function = original


def profile_text(model, repeats: int = 8) -> str:
    """PROFILE_TEXT repeated `repeats` times, or as often as the model's text limit allows (NH-TTS's encoder
    holds 1,024 bytes): the longest the model validates."""
    for count in range(repeats, 0, -1):
        text = PROFILE_TEXT * count
        try:
            model.validate(SynthesisRequest(text=text))
        except RequestError:
            continue
        return text
    raise RequestError(f"{model.model_id} refuses even one profile sentence ({len(PROFILE_TEXT)} characters)")


# Untimed steps that a warm-up until first audio may add (Llasa's first audio comes at its 13th frame; a model
# whose streams end before they sound, as tiny random ones may, stops waiting here).
MAX_EXTRA_WARMUP = 48


class SteadyStreams:
    """B open streams of a long text; a finished one is replaced before the next step. Streams are opened in
    batched prefills of at most MAX_PREFILL_BATCH, as the scheduler admits them: the memory that KV capacity
    leaves free (models.capacity) holds the activations of such a prefill, not of one of every stream."""

    def __init__(self, model, batch: int, max_duration_s: float, *, text: str | None = None):
        self.model, self.max_duration_s, self.opened = model, max_duration_s, 0
        self.text = profile_text(model) if text is None else text
        self.ids: list[int] = self.open(batch)
        self.finished: set[int] = set()
        self.heard: set[int] = set()  # streams that have given audio

    def open(self, count: int) -> list[int]:
        requests = [
            SynthesisRequest(text=self.text, seed=self.opened + i, max_duration_s=self.max_duration_s)
            for i in range(count)
        ]
        self.opened += count
        ids = []
        for first in range(0, count, MAX_PREFILL_BATCH):
            ids += self.model.open_streams(requests[first : first + MAX_PREFILL_BATCH])
        for stream_id in ids:
            if isinstance(stream_id, Exception):
                raise stream_id
        return ids

    def step(self) -> None:
        chunks = self.model.step(self.ids)
        self.finished = {chunk.stream_id for chunk in chunks if chunk.is_finished}
        self.heard.update(chunk.stream_id for chunk in chunks if len(chunk.samples))

    def warm_up(self, steps: int, *, until_audio: bool = False, max_extra: int = MAX_EXTRA_WARMUP) -> int:
        """`steps` untimed steps (with refills); with `until_audio`, more until every open stream has given
        audio, at most `max_extra` more. Returns the steps run. A block codec's streams start with a transient:
        no audio until a block and its lookahead have arrived (Llasa: 13 frames), then its first, shortest
        window. Timed steps that start past it hold whole blocks (10 steps: two of Llasa's 5-frame blocks per
        stream, whatever the streams' phases) instead of the transient's edge."""
        run = 0
        while run < steps or (until_audio and run < steps + max_extra and not self.heard.issuperset(self.ids)):
            self.step()
            self.refill()
            run += 1
        return run

    def refill(self) -> None:
        """Replace the streams the last step finished (outside the timed spans)."""
        for stream_id in self.finished:
            self.model.close(stream_id)
        self.ids = [i for i in self.ids if i not in self.finished] + self.open(len(self.finished))
        self.finished = set()

    def close(self) -> None:
        for stream_id in self.ids:
            self.model.close(stream_id)


def region_times(
    model,
    batch: int,
    *,
    warmup: int = 4,
    steps: int = 10,
    max_duration_s: float = 60.0,
    until_audio: bool = False,
) -> dict[str, float]:
    """Median milliseconds per step of each labelled phase of `model.step` with `batch` streams (synced
    timing; the first `warmup` steps, where graphs are captured and kernels compiled, are not counted, nor,
    with `until_audio`, those before every stream has given audio: SteadyStreams.warm_up)."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"need warmup >= 0 and steps >= 1, got {warmup}, {steps}")
    streams = SteadyStreams(model, batch, max_duration_s)
    per_step: list[dict[str, float]] = []
    try:
        streams.warm_up(warmup, until_audio=until_audio)
        for _ in range(steps):
            timer = PhaseTimer(model.device)
            with phases_timed(timer):
                streams.step()
            per_step.append(dict(timer.totals))
            streams.refill()
    finally:
        streams.close()
    names = sorted({name for step in per_step for name in step})
    return {name: statistics.median(step.get(name, 0.0) for step in per_step) for name in names}


def settle(model, batch: int, seconds: float, *, max_duration_s: float = 60.0, max_steps: int = 10_000) -> int:
    """Untimed steps of `batch` streams for at least `seconds` (one sync each, at most `max_steps`): the GPU's
    clocks and the host's caches come up to speed before a build's first timing, which otherwise runs slower
    than the same composition timed later. Returns the steps run."""
    if seconds < 0:
        raise ValueError(f"seconds must be >= 0, got {seconds}")
    streams = SteadyStreams(model, batch, max_duration_s)
    run, start = 0, time.perf_counter()
    try:
        while run < max_steps and time.perf_counter() - start < seconds:
            streams.step()
            synchronize(model.device)
            streams.refill()
            run += 1
    finally:
        streams.close()
    return run


def step_time_ms(
    model,
    batch: int,
    *,
    warmup: int = 4,
    steps: int = 10,
    max_duration_s: float = 60.0,
    record: list[float] | None = None,
    until_audio: bool = False,
) -> float:
    """Mean milliseconds of a whole `model.step` of `batch` streams (one sync after each step). A mean, not a
    median: where a step's work is periodic (Llasa decodes an audio block every fifth step), step times are
    bimodal and their median jumps between the modes with the streams' phases; the mean is the frame rate's.
    `record`, if given, is extended with each timed step's milliseconds (the build report keeps them, so that a
    prediction error can be told apart from two measurements of one composition that disagree). `until_audio`:
    the warm-up goes on until every stream has given audio (SteadyStreams.warm_up)."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"need warmup >= 0 and steps >= 1, got {warmup}, {steps}")
    streams = SteadyStreams(model, batch, max_duration_s)
    times = []
    try:
        streams.warm_up(warmup, until_audio=until_audio)
        synchronize(model.device)
        for _ in range(steps):
            start = time.perf_counter()
            streams.step()
            synchronize(model.device)
            times.append((time.perf_counter() - start) * 1e3)
            streams.refill()
    finally:
        streams.close()
    if record is not None:
        record.extend(times)
    return statistics.fmean(times)


def _driver() -> str:
    if shutil.which("nvidia-smi") is None:
        return "none"
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return out.stdout.strip() or "unknown"


def _library_hash() -> str:
    """sha256 (first 16 hex digits) of the kernel library the megakernel would load, or `none`."""
    from tilevox.trt_plugins.library import kernels_library_path

    path = kernels_library_path()
    if not path.is_file():
        return "none"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def this_machine(device: torch.device, *, commit: str, profile_date: str) -> Provenance:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Provenance(
        gpu=gpu,
        driver=_driver() if device.type == "cuda" else "none",
        library_hash=_library_hash(),
        commit=commit,
        profile_date=profile_date,
    )
