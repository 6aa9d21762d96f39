"""The CUDA streams a model's work may run on beside the device's current stream.

Codec stream (`new_codec_stream`, `beside`): a step's codec decode of the frames it has just sampled runs
on a stream of its own, overlapping the talker (decoder) step that follows it; the step's one host wait
covers both. Only the step launches codec work, always there once installed (a codec backend's graphs
never replay on two streams at once), and the streams it decodes are ready ones, so it reads rows no
prefill writes.

Prefill stream (`PrefillStream`): prompts prefilled on a stream of their own, so that running streams
never wait for an admission. A model that supports it (SpeechModel.supports_prefill_stream) runs the whole
of `open_streams` (prompt embedding, the batched prefill, the first sample) inside `launch()`, records a
`ready()` event per admission batch and keeps it with each new stream. The running streams' steps go on
beside it, on a stream of higher priority (`decoding()`); the scheduler steps a new stream only once its
event has completed (SpeechModel.is_ready), and a step that gets one earlier makes its stream wait for it
on the device (`join`), never the host.

What makes the streams safe together:
  * They touch disjoint rows of the shared state: a prefill writes only its new streams' KV-cache slots and
    codec-state rows (both row-indexed), and a step reads and writes only the rows of the streams it
    steps, each of them ready.
  * Graph backends never run on two streams at once: each executor backend owns its graphs' memory pool
    and static buffers, so the prefill draws its first tokens with a token-sampling backend of its own
    (`token_sampling_backend`, None for the model's eager sampler), never the one the step replays.
  * Tensors the prefill allocates and a step later reads (the prompt's last hidden state, its logits) are
    freed only by host code after a step has synchronised its streams, so the caching allocator can hand
    their blocks to the next prefill only once no step reads them any more.
  * `launch()` orders the prefill after the current stream's queued work (a slot freed by a finished
    stream is rewritten only after that stream's last step), and nothing inside it synchronises the host:
    prompts reach the device through pinned asynchronous copies (models.host_copy.to_device), which the
    GPU test tests/executor/test_cuda_streams_cuda.py checks by queueing a long sleep on the prefill
    stream first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

_HIGHEST_PRIORITY = -5  # torch.cuda.Stream clamps it to the device's range (H100/H200: -5 .. 0, lower first)


@dataclass
class PrefillStream:
    device: torch.device
    token_sampling_backend: object | None = None  # the prefill's own (see the module docstring)
    stream: torch.cuda.Stream = field(init=False)  # the prefills: the default (lowest) priority
    decode_stream: torch.cuda.Stream = field(init=False)  # the steps: the highest priority

    def __post_init__(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"a prefill stream needs a CUDA device, got {self.device}")
        self.stream = torch.cuda.Stream(self.device)
        # A step's blocks are scheduled before a prefill's waiting ones: prefill GEMMs queued first would
        # otherwise hold the SMs while the running streams' small kernels wait behind them.
        self.decode_stream = torch.cuda.Stream(self.device, priority=_HIGHEST_PRIORITY)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """Run the block's GPU work (a step) on the high-priority decode stream, ordered after the current
        stream's queued work and before what is queued on it afterwards."""
        current = torch.cuda.current_stream(self.device)
        self.decode_stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.decode_stream):
                yield
        finally:
            current.wait_stream(self.decode_stream)

    @contextlib.contextmanager
    def launch(self) -> Iterator[None]:
        """Run the block's GPU work on the prefill stream, after the current stream's queued work."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def ready(self) -> torch.cuda.Event:
        """An event that completes when everything launched so far on the prefill stream has run."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def is_done(event: torch.cuda.Event | None) -> bool:
    """Whether a stream's prefill event has completed (None: there was none to wait for); never blocks."""
    return event is None or event.query()


def join(event: torch.cuda.Event | None, device: torch.device) -> None:
    """Make the current stream wait, on the device, for a stream's prefill event (None: nothing to wait for)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def new_codec_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream for a step's codec decode, of the steps' (highest) priority."""
    if device.type != "cuda":
        raise ValueError(f"a codec stream needs a CUDA device, got {device}")
    return torch.cuda.Stream(device, priority=_HIGHEST_PRIORITY)


@contextlib.contextmanager
def beside(stream: torch.cuda.Stream | None, device: torch.device) -> Iterator[None]:
    """Run the block's GPU work on `stream`, after the current stream's queued work (None: on the current
    stream). The caller synchronises `stream` before it reads the block's results on the host."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
