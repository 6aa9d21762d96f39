"""Megakernel backends for the models' per-step regions (models.region_backends), with logged fallback.

Run-time code: compiling a region into an instruction program is build-time code (engine_builder.regions)
that this module never imports. The caller hands a `RegionCompiler` in `BackendOptions.compiler`
(engine_builder.regions.region_compiler(), which the CLI, the engine builder and the tests pass); without
one a backend is unavailable (MegakernelUnavailable says so), never silently conventional.

Each backend asks the compiler for its region once per batch bucket (max context = the model's cache
length), binds the model's own KV caches, runs the region on the chosen executor (CUDA: the persistent
megakernel through the `tilevox::megakernel_launch` op; VM: the pure-PyTorch interpreter, on any
device) and returns exactly what the conventional call returns. Construction raises
`MegakernelUnavailable` where the region can never run here; a single call it cannot take (batch
above `max_batch`, sampling the on-device sampler lacks, a prefill) runs the conventional path and
logs why, once per reason, on the "tilevox.megakernel" logger. Nothing falls back silently.

The code-predictor loop samples on the device with its counter-based RNG (seed, frame x heads +
head): greedy codes equal the conventional path's (up to bf16 near-ties); sampled codes follow the
same distribution but are different draws, and the streams' torch generators no longer advance on
predictor draws, so later talker draws differ too. The NH-TTS decoder step returns logits only (the model
picks codes with guidance and its delay pattern on the host); its summed codebook embeddings are computed
by the model's own embedding before the launch.

Batch buckets (BackendOptions.buckets): a region is compiled and bound once per batch bucket
(executor.graphs.batch_bucket, capped at max_batch and at the rows the bound cache holds), not per exact
batch. A call's B rows are padded with copies of row 0, as the executor's graphed backends pad: same
slot, same position, same input, so the copy writes the same key/value to the same cache place as row
0 and touches no other slot; the code-predictor loop's copies use slots of its own per-bucket cache.
The padded rows' outputs are dropped and the host bookkeeping (cache lengths) advances per real row.

No host synchronisation per call on CUDA: host-side inputs are staged with one pinned, asynchronous
copy, the kernel is launched with check=False (from the second call of a bucket on, as a replay of a
CUDA graph captured after the first, eager launch: BackendOptions.cuda_graphs), and the launch's error
words are copied to pinned memory behind it with an event. A later call of the same backend, or
`check()`, reads them once the event has completed and raises MegakernelWatchdogError /
MegakernelFaultError as the synchronous check would. So an error surfaces one call late (or later,
while the GPU runs behind): acceptable because the conventional CUDA graphs have no per-step check at
all, and a failed launch still fails its batch, at its next step. BackendOptions(sync_check=True)
restores the synchronous check at every launch (tests, debugging).
Imports: torch, models, trt_plugins.megakernel, this package (batch buckets, region inputs).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tilevox.executor.graphs import BATCH_BUCKETS, _Graphs, batch_bucket
from tilevox.executor.megakernel_inputs import (
    CompiledProgram,
    code_predictor_inputs,
    llama_decode_inputs,
    sampling_inputs,
)
from tilevox.models.decoder_view import DecoderView, decoder_view
from tilevox.models.llama.model import LlamaForCausalLM, LlamaKVCache
from tilevox.models.nh_tts.decoder import NhDecoderCache, NhTtsNetwork
from tilevox.models.qwen3_tts.code_predictor import CodePredictor
from tilevox.models.qwen3_tts.layers import CacheView, KVCache
from tilevox.models.qwen3_tts.talker import Talker
from tilevox.models.region_backends import (
    CODE_PREDICTOR_LOOP,
    CODEC_DECODE,
    DECODER_STEP,
    NH_DECODER_STEP,
    TALKER_STEP,
    PredictorRows,
    executor_region_names,
    region_module,
    region_names,
    set_region_backend,
)
from tilevox.models.sampling import SamplingParams
from tilevox.trt_plugins.megakernel.instructions import MAX_HEAD_DIM, MAX_ROW_WIDTH, BufferKind, ErrorCode
from tilevox.trt_plugins.megakernel.runtime import (
    ERROR_WORDS,
    BoundLaunch,
    CudaProgram,
    MegakernelFaultError,
    MegakernelWatchdogError,
    _raise_for_words,  # runtime's private reading of the error words, on purpose: raise what its check raises
    unavailable_reason,
)
from tilevox.trt_plugins.megakernel.torch_op import launch_op
from tilevox.trt_plugins.megakernel.vm import TORCH_DTYPES, run_program

__all__ = [
    "LOGGER_NAME",
    "MAX_HEAD_DIM",
    "MAX_ROW_WIDTH",
    "BackendOptions",
    "Executor",
    "MegakernelCodePredictorLoop",
    "MegakernelCodecDecode",
    "MegakernelDecoderStep",
    "MegakernelFaultError",
    "MegakernelNhDecoderStep",
    "MegakernelTalkerStep",
    "MegakernelUnavailable",
    "MegakernelWatchdogError",
    "BACKENDS",
    "CompiledProgram",
    "RegionCompiler",
    "install_megakernel_regions",
    "make_backend",
    "megakernel_region_names",
    "parse_regions",
]

LOGGER_NAME = "tilevox.megakernel"
log = logging.getLogger(LOGGER_NAME)

# The kernel's limits (from the instruction registry, as instructions.h has them): the largest head_dim,
# and the shared staging buffer one matrix-vector input row must fit in. Checked for both executors, so
# that the VM proves exactly what the GPU would run.
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN = 16  # bytes: the kernel's vector loads need 16-byte aligned buffers (CudaProgram.bind checks)


class MegakernelUnavailable(RuntimeError):
    """The region can never run through the megakernel here; `reason` says why (one line)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RegionCompiler(Protocol):
    """Compiles region `region` (a models.region_backends name) of `module` for `batch_size` rows on
    `num_sms` queues; `compile_args` are the cache's sizes (max_context, num_cache_slots, cache_len,
    cross_cache_len). Raises ValueError for a batch or shape it cannot compile."""

    def __call__(
        self, module: torch.nn.Module, region: str, *, batch_size: int, num_sms: int, **compile_args: int
    ) -> CompiledProgram: ...


class Executor(enum.Enum):
    CUDA = "cuda"  # the persistent megakernel (libtilevox_kernels.so), sm_90
    VM = "vm"  # trt_plugins.megakernel.vm.run_program: the semantic oracle, any device


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendOptions:
    """executor; compiler: what compiles a region per batch bucket (build-time code, handed in: see the
    module docstring; None: no backend can be made); max_batch: larger calls run conventionally; num_sms:
    the queues compiled for (None: the device's SM count, or 132 for the VM); watchdog_s: the kernel's
    per-wait limit.
    buckets: compile per batch bucket, padding a call's rows with copies of row 0 (False: per exact batch).
    sync_check: CUDA only: synchronise after every launch and raise its error there (False: the error
    words are read without blocking, one call late; see the module docstring).
    cuda_graphs: CUDA with sync_check off: replay a CUDA graph of each bucket's launch after its first call."""

    executor: Executor = Executor.CUDA
    compiler: RegionCompiler | None = None
    max_batch: int = 64
    num_sms: int | None = None
    watchdog_s: float = 2.0
    buckets: bool = True
    sync_check: bool = False
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.executor, Executor):
            raise TypeError(f"executor must be an Executor, got {self.executor!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.num_sms is not None and self.num_sms < 1:
            raise ValueError(f"num_sms must be >= 1, got {self.num_sms}")
        if not self.watchdog_s > 0:
            raise ValueError(f"watchdog_s must be > 0, got {self.watchdog_s}")


def _check_cuda(device: torch.device) -> None:
    reason = unavailable_reason(device)
    if reason is not None:
        raise MegakernelUnavailable(reason)


def _checked_view(module: torch.nn.Module) -> DecoderView:
    """The compiler's view of `module`, refused where the kernel cannot run it."""
    try:
        view = decoder_view(module)
    except (TypeError, ValueError) as exc:
        raise MegakernelUnavailable(str(exc)) from exc
    except AttributeError as exc:  # a layer whose MLP was replaced (fused SwiGLU keeps packed weights only)
        raise MegakernelUnavailable(
            f"the model's layers lack the plain projection weights the region reads ({exc}); "
            "the fused SwiGLU swap removes them: load with --fused-swiglu off"
        ) from exc
    if view.dtype not in _DTYPES:
        raise MegakernelUnavailable(f"dtype {view.dtype} is not one of bf16, fp16, fp32")
    if view.head_dim % 2 or view.head_dim > MAX_HEAD_DIM:
        raise MegakernelUnavailable(f"head_dim {view.head_dim} is odd or above the kernel's {MAX_HEAD_DIM}")
    widths = {
        "hidden_size": view.hidden_size,
        "intermediate_size": view.intermediate_size,
        "input_size": view.input_size,
        "q width": view.num_heads * view.head_dim,
    }
    if view.cross is not None:
        if view.cross.head_dim > MAX_HEAD_DIM:
            raise MegakernelUnavailable(
                f"cross-attention head_dim {view.cross.head_dim} is above the kernel's {MAX_HEAD_DIM}"
            )
        widths["cross q width"] = view.cross.num_heads * view.cross.head_dim
    for name, width in widths.items():
        if width > MAX_ROW_WIDTH:
            raise MegakernelUnavailable(f"{name} {width} exceeds the kernel's row staging of {MAX_ROW_WIDTH}")
    return view


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_contiguous() and tensor.data_ptr() % 16 == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


class _CallUnsupported(Exception):
    """This call cannot run through the region (the reason is logged; the call runs conventionally)."""


def _pad_rows(tensor: torch.Tensor, bucket: int) -> torch.Tensor:
    """`tensor`'s rows (dim 0), then copies of row 0 up to `bucket` rows (on the tensor's device)."""
    extra = bucket - tensor.shape[0]
    if extra == 0:
        return tensor
    return torch.cat((tensor, tensor[:1].expand(extra, *tensor.shape[1:])))


def _pad_list(values: Sequence, bucket: int) -> list:
    """`values`, then copies of values[0] up to `bucket` entries."""
    return [*values, *[values[0]] * (bucket - len(values))]


def _pinned_words() -> tuple[torch.Tensor, torch.cuda.Event]:
    """A pinned host copy of one launch's error words and the event that says when it has landed."""
    return torch.empty(ERROR_WORDS, dtype=torch.int32, pin_memory=True), torch.cuda.Event()


@dataclass(slots=True)
class _PendingCheck:
    words: torch.Tensor  # host (pinned) copy of the launch's error words, written by an async copy
    event: object  # torch.cuda.Event recorded behind that copy
    bucket: int


class _ErrorChecks:
    """The error words of launches made with check=False, read without blocking once they have landed.

    `record` enqueues an asynchronous copy of a launch's error words into pinned memory and an event
    behind it on the current stream; `poll` (every call of the runner) reads the entries whose event has
    completed, never waits, and raises the first recorded error as the synchronous check would; `wait`
    (`check()` of a backend) waits for every pending entry, then polls. Raising drops the entries still
    pending: they are launches enqueued before the error was reported, whose batch fails with it. The
    launcher clears a launch's error words before it starts, so each copy holds exactly its launch's."""

    def __init__(self, name: str, new_slot: Callable[[], tuple[torch.Tensor, object]] = _pinned_words) -> None:
        self.name = name
        self._new_slot = new_slot  # (host words, event); tests give a host tensor and a fake event
        self._pending: list[_PendingCheck] = []
        self._spare: list[tuple[torch.Tensor, object]] = []

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def record(self, error: torch.Tensor, bucket: int) -> None:
        """After a launch on the current stream: copy its error words behind it (no host synchronisation)."""
        words, event = self._spare.pop() if self._spare else self._new_slot()
        words.copy_(error, non_blocking=True)
        event.record()
        self._pending.append(_PendingCheck(words=words, event=event, bucket=bucket))

    def poll(self) -> None:
        """Raise MegakernelWatchdogError / MegakernelFaultError for the first completed launch that
        recorded an error; entries whose event has not completed stay pending (never blocks)."""
        done = [entry for entry in self._pending if entry.event.query()]
        if not done:
            return
        self._pending = [entry for entry in self._pending if not any(entry is d for d in done)]
        failed: tuple[_PendingCheck, list[int]] | None = None
        for entry in done:
            words = entry.words.tolist()
            self._spare.append((entry.words, entry.event))
            if failed is None and words[0] != ErrorCode.NONE:
                failed = (entry, words)
        if failed is None:
            return
        entry, words = failed
        self._pending.clear()  # still in flight: not reused (their copies may land later)
        try:
            _raise_for_words(words)
        except (MegakernelWatchdogError, MegakernelFaultError) as exc:
            exc.add_note(
                f"megakernel region {self.name} (batch bucket {entry.bucket}): an earlier launch, checked "
                "once it completed (BackendOptions.sync_check=True checks every launch as it runs)"
            )
            raise
        raise AssertionError(f"error words {words} raised nothing")  # _raise_for_words raises for any code != 0

    def wait(self) -> None:
        """Wait for every pending launch's error words, then poll (synchronises the host)."""
        for entry in self._pending:
            entry.event.synchronize()
        self.poll()


@dataclass(slots=True)
class _Staging:
    """A bound launch's INPUT buffers, laid out in one device arena (each 16-byte aligned): the inputs a
    call builds on the host (positions, slots, sampling values) come first and reach the device through
    one pinned, asynchronous copy of that prefix; inputs already on the device are copied in place."""

    arena: torch.Tensor  # uint8, on the device
    inputs: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)  # name -> (byte offset, buffer)

    def stage(self, bound: Mapping[str, torch.Tensor]) -> None:
        host_end = 0
        for name, (offset, buffer) in self.inputs.items():
            source = bound[name]
            if tuple(source.shape) != tuple(buffer.shape):
                raise ValueError(f"input {name!r} is {tuple(source.shape)}, the region takes {tuple(buffer.shape)}")
            if source.device.type == "cpu":
                host_end = max(host_end, offset + buffer.numel() * buffer.element_size())
        if host_end:
            # A fresh block of the pinned host cache per call: it is not reused before its copy has run.
            host = torch.empty(host_end, dtype=torch.uint8, pin_memory=True)
            for name, (offset, buffer) in self.inputs.items():
                if bound[name].device.type == "cpu":
                    size = buffer.numel() * buffer.element_size()
                    host[offset : offset + size].view(buffer.dtype).view(buffer.shape).copy_(bound[name])
            self.arena[:host_end].copy_(host, non_blocking=True)
        for name, (_, buffer) in self.inputs.items():  # after the prefix copy: it may span device inputs
            if bound[name].device.type != "cpu":
                buffer.copy_(bound[name])


@dataclass(slots=True)
class _Compiled:
    region: CompiledProgram
    weights: dict[str, torch.Tensor]  # on the model's device
    # CUDA: the BoundLaunch (inputs are staged into its INPUT buffers), their staging arena, and the CUDA
    # graph of the launch once captured (after the bucket's first, eager launch).
    launch: BoundLaunch | None = None
    staging: _Staging | None = None
    graph: torch.cuda.CUDAGraph | None = None


class _RegionRunner:
    """Compiles one region per batch bucket (on first use) and runs it on the executor."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name: str,
        device: torch.device,
        options: BackendOptions,
        compile_args: Mapping[str, int],
    ) -> None:
        if device.type == "cuda" and device.index is None:  # CudaProgram.bind compares devices exactly
            device = torch.device("cuda", torch.cuda.current_device())
        self.module, self.name, self.device, self.options = module, name, device, options
        self.compile_args = dict(compile_args)
        self._compiled: dict[int, _Compiled] = {}  # by the number of rows compiled (a bucket)
        self._failed: dict[int, str] = {}
        self.checks = _ErrorChecks(name)
        self.capture = options.executor is Executor.CUDA and options.cuda_graphs and not options.sync_check
        if options.num_sms is not None:
            self.num_sms = options.num_sms
        elif options.executor is Executor.CUDA:
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.num_sms = 132  # H200: the VM runs any queue count; keep the GPU's schedule

    def region(self, batch: int) -> _Compiled:
        """The region compiled for `batch` rows (a call's bucket, or its exact batch without buckets)."""
        if batch in self._failed:
            raise _CallUnsupported(self._failed[batch])
        if batch not in self._compiled:
            try:
                region = self.options.compiler(
                    self.module, self.name, batch_size=batch, num_sms=self.num_sms, **self.compile_args
                )
            except ValueError as exc:
                self._failed[batch] = f"batch {batch} does not compile: {exc}"
                raise _CallUnsupported(self._failed[batch]) from exc
            # The kernel reads dense, 16-byte-aligned buffers: a weight view that is not (a slice of a fused
            # matrix at an odd offset) is copied once.
            weights = {name: _dense(t.to(self.device)) for name, t in region.weights.items()}
            self._compiled[batch] = _Compiled(region=region, weights=weights)
        return self._compiled[batch]

    @torch.no_grad()
    def run(self, compiled: _Compiled, bound: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run with INPUT and STATE buffers from `bound` (weights come from `compiled`); returns every
        buffer by name. CUDA: the buffers are the launch's own and are overwritten by the next run; the
        launch's error is raised by a later run or `checks.wait()` unless sync_check. Raises first an
        earlier launch's error that has landed since (this call then runs nothing)."""
        self.checks.poll()
        program = compiled.region.program
        if self.options.executor is Executor.VM:
            tensors = {**compiled.weights, **{n: t.to(self.device) for n, t in bound.items()}}
            return run_program(program, tensors)
        with torch.cuda.device(self.device):
            if compiled.launch is None:
                compiled.launch, compiled.staging = self._bind(compiled, bound)
            launch = compiled.launch
            for spec in program.buffers:
                if (
                    spec.kind is BufferKind.STATE
                    and bound[spec.name].data_ptr() != launch.tensors[spec.name].data_ptr()
                ):
                    raise AssertionError(f"{spec.name} moved since the region was bound")  # callers check the cache
            compiled.staging.stage(bound)
            if self.options.sync_check:
                return launch_op(launch, check=True)
            if compiled.graph is not None:
                compiled.graph.replay()
            else:
                launch_op(launch, check=False)
            self.checks.record(launch.error, program.constants.batch_size)
            if compiled.graph is None and self.capture:
                compiled.graph = self._capture(launch)
            return launch.tensors

    def bound_launch(self, compiled: _Compiled, state: Mapping[str, torch.Tensor]) -> tuple[BoundLaunch, _Staging]:
        """CUDA: `compiled`'s launch, bound to the STATE tensors in `state` (on first use; later calls must
        name the same tensors), and its staging of INPUT buffers (every input then comes from the device), for
        a caller that stages and launches by itself inside a CUDA graph of its own."""
        if compiled.launch is None:
            placeholders = {
                spec.name: torch.empty(0, device=self.device)
                for spec in compiled.region.program.buffers
                if spec.kind is BufferKind.INPUT
            }
            compiled.launch, compiled.staging = self._bind(compiled, {**placeholders, **state})
        for name, tensor in state.items():
            if tensor.data_ptr() != compiled.launch.tensors[name].data_ptr():
                raise AssertionError(f"{name} moved since the region was bound")
        return compiled.launch, compiled.staging

    def _capture(self, launch: BoundLaunch) -> torch.cuda.CUDAGraph:
        """A CUDA graph of one launch (check=False) of `launch`, captured on a side stream after its first,
        eager launch: capturing runs nothing, and the bound buffers never move (inputs are staged into them
        before each replay). Not `with torch.cuda.graph(...)`: its entry synchronises the device and empties
        the allocator caches (executor.graphs._Graphs._capture says what that cost); this capture needs none
        of it and allocates nothing."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch_op(launch, check=False)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return graph

    def _bind(self, compiled: _Compiled, bound: Mapping[str, torch.Tensor]) -> tuple[BoundLaunch, _Staging]:
        """Bind the weights, the caller's STATE tensors (the model's caches, in place) and INPUT buffers laid
        out in one staging arena: the inputs this call has on the host first (they stay on the host from
        call to call: the bindings build them there), so each call's pinned copy covers a short prefix."""
        inputs = [spec for spec in compiled.region.program.buffers if spec.kind is BufferKind.INPUT]
        inputs.sort(key=lambda spec: bound[spec.name].device.type != "cpu")  # stable: program order within
        offsets, size = {}, 0
        for spec in inputs:
            offsets[spec.name] = size
            nbytes = math.prod(spec.shape) * TORCH_DTYPES[spec.dtype].itemsize
            size += -(-nbytes // _ALIGN) * _ALIGN
        staging = _Staging(arena=torch.empty(max(size, _ALIGN), dtype=torch.uint8, device=self.device))
        tensors = dict(compiled.weights)
        for spec in inputs:
            dtype, offset = TORCH_DTYPES[spec.dtype], offsets[spec.name]
            nbytes = math.prod(spec.shape) * dtype.itemsize
            buffer = staging.arena[offset : offset + nbytes].view(dtype).view(spec.shape)
            staging.inputs[spec.name] = (offset, buffer)
            tensors[spec.name] = buffer
        for spec in compiled.region.program.buffers:
            if spec.kind is BufferKind.STATE:
                tensors[spec.name] = bound[spec.name]
        program = CudaProgram(compiled.region.program, device=self.device, watchdog_s=self.options.watchdog_s)
        return program.bind(tensors), staging


class _Backend:
    """Shared fallback bookkeeping: counts calls per path, logs each distinct fallback reason once."""

    name: str

    def __init__(self, options: BackendOptions) -> None:
        if options.compiler is None:
            raise MegakernelUnavailable(
                "no region compiler given (BackendOptions.compiler, e.g. engine_builder.regions.region_compiler())"
            )
        self.options = options
        self._cache: object | None = None  # the KV cache the region is bound to (its first call's)
        self._runner: _RegionRunner | None = None
        self.num_megakernel_calls = 0
        self.num_conventional_calls = 0
        self._logged: set[str] = set()

    def _bound_runner(
        self, cache: object, module: torch.nn.Module, device: torch.device, compile_args: Mapping[str, int]
    ) -> _RegionRunner:
        """The runner bound to `cache` (the first call's KV cache; `compile_args` are its sizes): a region
        binds one cache, so a call with another runs conventionally."""
        if self._cache is None:
            self._cache = cache
            self._runner = _RegionRunner(
                module, name=self.name, device=device, options=self.options, compile_args=compile_args
            )
        elif cache is not self._cache:
            raise _CallUnsupported("the call's KV cache is not the one the region was bound to")
        return self._runner

    def _runners(self) -> list[_RegionRunner]:
        return [] if self._runner is None else [self._runner]

    def check(self) -> None:
        """Wait for this backend's launches and raise MegakernelWatchdogError / MegakernelFaultError for
        the first one that recorded an error no call has reported yet. Synchronises the host (tests,
        debugging, the end of a run); the calls themselves never do (unless sync_check)."""
        for runner in self._runners():
            runner.checks.wait()

    def _fallback(self, reason: str) -> None:
        self.num_conventional_calls += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("megakernel region %s: conventional path: %s", self.name, reason)

    def _check_batch(self, batch: int) -> None:
        if batch > self.options.max_batch:
            raise _CallUnsupported(f"batch {batch} exceeds max_batch {self.options.max_batch}")

    def _bucket(self, batch: int, num_slots: int | None = None) -> int:
        """The rows a call of `batch` rows runs as: its batch bucket, capped at max_batch and at the
        `num_slots` rows the bound cache holds (a call has distinct rows, so never more), never below
        `batch`; `batch` itself without buckets or above the largest bucket."""
        if not self.options.buckets or batch > BATCH_BUCKETS[-1]:
            return batch
        limit = self.options.max_batch if num_slots is None else min(self.options.max_batch, num_slots)
        return max(batch, min(batch_bucket(batch), limit))


def _greedy_inputs(batch: int) -> dict[str, torch.Tensor]:
    # The decoder regions end with SAMPLE_EMBED; the models sample on the host from the logits, so the
    # region's own draw (greedy) is discarded.
    return sampling_inputs([SamplingParams.greedy()] * batch, seeds=[0] * batch)


def _nh_step_inputs(cache: NhDecoderCache, rows: Sequence[int], x_in: torch.Tensor) -> dict[str, torch.Tensor]:
    """bindings.nh_decoder_inputs without the weights, with each row's text length from the cache's host
    copy (`text_lengths`, kept equal to text_lengths_device by write_cross): the bindings gather the
    device copy with a row index made on the device, a blocking host-to-device copy per call. The caller
    has checked the rows (allocated, encoder keys/values, room for a position); rows may repeat (padding)."""
    return {
        "x_in": x_in,
        "positions": torch.tensor([cache.lengths[r] for r in rows], dtype=torch.int64),
        "slots": torch.tensor(list(rows), dtype=torch.int64),
        "text_lengths": torch.tensor([cache.text_lengths[r] for r in rows], dtype=torch.int64),
        "k_cache": cache.self_k,
        "v_cache": cache.self_v,
        "cross_k_cache": cache.cross_k,
        "cross_v_cache": cache.cross_v,
    }


# What the region compiler takes from each model's KV cache (one place for the whole-region backends below and
# executor.split's pieces).
def _decoder_cache_args(cache: LlamaKVCache) -> dict[str, int]:
    return {"max_context": cache.max_seq_len, "num_cache_slots": cache.k.shape[1], "cache_len": cache.max_seq_len}


def _talker_cache_args(cache: KVCache) -> dict[str, int]:
    return {"max_context": cache.max_len, "num_cache_slots": cache.num_slots, "cache_len": cache.max_len}


def _nh_cache_args(cache: NhDecoderCache) -> dict[str, int]:
    return {
        "max_context": cache.max_seq_len,
        "num_cache_slots": cache.max_rows,
        "cache_len": cache.max_seq_len,
        "cross_cache_len": cache.max_text_len,
    }


class MegakernelDecoderStep(_Backend):
    """LlamaForCausalLM.decode as one full-step region (embed, layers, final norm, head)."""

    name = DECODER_STEP

    def __init__(self, llama: LlamaForCausalLM, options: BackendOptions = BackendOptions()) -> None:
        super().__init__(options)
        if options.executor is Executor.CUDA:
            _check_cuda(llama.device)
        _checked_view(llama)
        self.llama = llama

    def _runner_for(self, cache: LlamaKVCache) -> _RegionRunner:
        return self._bound_runner(
            cache,
            self.llama,
            self.llama.device,
            _decoder_cache_args(cache),
        )

    def __call__(self, cache: LlamaKVCache, slots: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
        slots = [int(s) for s in slots]
        if token_ids.dim() != 1 or not cache.takes_decode(
            slots, token_ids.shape[0]
        ):  # not a fallback: decode raises its own error for these calls
            return self.llama.decode(cache, slots, token_ids)
        batch = len(slots)
        try:
            self._check_batch(batch)
            runner = self._runner_for(cache)
            bucket = self._bucket(batch, cache.k.shape[1])
            compiled = runner.region(bucket)
        except _CallUnsupported as exc:
            self._fallback(str(exc))
            return self.llama.decode(cache, slots, token_ids)
        # Padding rows repeat row 0: same slot, position and token, so they write row 0's keys/values again.
        bound = {
            **llama_decode_inputs(compiled.region, cache, _pad_list(slots, bucket), _pad_rows(token_ids, bucket)),
            **_greedy_inputs(bucket),
        }
        out = runner.run(compiled, {n: t for n, t in bound.items() if n not in compiled.weights})
        for slot in slots:
            cache.lengths[slot] += 1
        self.num_megakernel_calls += 1
        return out["s0.logits"][:batch].clone()


class MegakernelTalkerStep(_Backend):
    """Talker.forward_tokens of one new position per row as a layers + codec-head region."""

    name = TALKER_STEP

    def __init__(self, talker: Talker, options: BackendOptions = BackendOptions()) -> None:
        super().__init__(options)
        device = next(talker.parameters()).device
        if options.executor is Executor.CUDA:
            _check_cuda(device)
        _checked_view(talker)
        self.talker, self.device = talker, device

    def _runner_for(self, cache: KVCache) -> _RegionRunner:
        return self._bound_runner(
            cache,
            self.talker,
            self.device,
            _talker_cache_args(cache),
        )

    def __call__(self, inputs: torch.Tensor, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_new = inputs.shape[:2]
        try:
            if num_new != 1:
                raise _CallUnsupported(f"{num_new} new positions per row; the region decodes one")
            if not isinstance(view.slots, torch.Tensor):
                raise _CallUnsupported("slots given as a slice; the region takes a slot index per row")
            self._check_batch(batch)
            runner = self._runner_for(view.cache)
            bucket = self._bucket(batch, view.cache.num_slots)
            compiled = runner.region(bucket)
        except _CallUnsupported as exc:
            self._fallback(str(exc))
            return self.talker.forward_tokens(inputs, view)
        # Padding rows repeat row 0: same slot, position and input, so they write row 0's keys/values again.
        bound = {
            "x_in": _pad_rows(inputs[:, 0], bucket),
            "positions": _pad_rows(view.start.to(torch.int64), bucket),
            "slots": _pad_rows(view.slots.to(torch.int64), bucket),
            "k_cache": view.cache.keys,
            "v_cache": view.cache.values,
            **_greedy_inputs(bucket),
        }
        out = runner.run(compiled, bound)
        self.num_megakernel_calls += 1
        return out["x_normed"][:batch].clone(), out["s0.logits"][:batch].clone()


class MegakernelCodePredictorLoop(_Backend):
    """CodePredictor.predict as one CODE_PREDICTOR_LOOP region that samples every head on the device."""

    name = CODE_PREDICTOR_LOOP

    def __init__(self, predictor: CodePredictor, options: BackendOptions = BackendOptions()) -> None:
        super().__init__(options)
        device = next(predictor.parameters()).device
        if options.executor is Executor.CUDA:
            _check_cuda(device)
        _checked_view(predictor)
        self.predictor, self.device = predictor, device
        self._runner = _RegionRunner(
            predictor,
            name=self.name,
            device=device,
            options=options,
            compile_args={},
        )
        self._caches: dict[int, KVCache] = {}  # per bucket: every position is written before it is read

    def __call__(
        self,
        hidden: torch.Tensor,
        code0_embedding: torch.Tensor,
        choose: Callable[[int, torch.Tensor], torch.Tensor],
        rows: PredictorRows,
    ) -> torch.Tensor:
        batch = hidden.shape[0]
        try:
            if len(rows.params) != batch:
                raise ValueError(f"{len(rows.params)} sampling rows for a batch of {batch}")
            bucket = self._bucket(batch)
            # Padding rows repeat row 0 (its hidden state, embedding and sampling) in slots of their own.
            try:
                sampling = sampling_inputs(
                    _pad_list(rows.params, bucket), _pad_list(rows.seeds, bucket), _pad_list(rows.rng_offsets, bucket)
                )
            except ValueError as exc:  # repetition penalty / min_new_tokens: not in SAMPLE_EMBED
                raise _CallUnsupported(str(exc)) from exc
            self._check_batch(batch)
            compiled = self._runner.region(bucket)
        except _CallUnsupported as exc:
            self._fallback(str(exc))
            return self.predictor.predict(hidden, code0_embedding, choose)
        cache = self._caches.get(bucket)
        if cache is None:
            cache = self._caches[bucket] = self.predictor.new_cache(bucket)
        bound = {
            **code_predictor_inputs(
                compiled.region, cache, _pad_rows(hidden, bucket), _pad_rows(code0_embedding, bucket)
            ),
            **sampling,
        }
        out = self._runner.run(compiled, {n: t for n, t in bound.items() if n not in compiled.weights})
        self.num_megakernel_calls += 1
        return torch.stack([out[f"s{head + 1}.tokens"][:batch] for head in range(self.predictor.num_steps)], dim=1)


def _nh_well_formed(cache: NhDecoderCache, rows: Sequence[int], codes: torch.Tensor) -> bool:
    """Whether NhTtsNetwork.step takes this call (distinct allocated rows with room, codes (B, T, C)); where not,
    the backends call it anyway so that it raises its own error."""
    if codes.dim() != 3 or codes.shape[0] != len(rows) or len(set(rows)) != len(rows):
        return False
    return all(cache.is_allocated(r) and cache.lengths[r] + codes.shape[1] <= cache.max_seq_len for r in rows)


def _nh_check_decode(cache: NhDecoderCache, rows: Sequence[int], codes: torch.Tensor) -> None:
    """_CallUnsupported for a well-formed call that a decode region cannot take."""
    if codes.shape[1] != 1:
        raise _CallUnsupported(f"{codes.shape[1]} new positions per row (a prompt prefill); the region decodes one")
    empty = [r for r in rows if cache.text_lengths[r] < 1]
    if empty:
        raise _CallUnsupported(f"cache rows {empty} have no encoder keys/values (text length 0)")


class MegakernelNhDecoderStep(_Backend):
    """NhTtsNetwork.step of one new position per row (codes (B, 1, C) -> logits (B, C, V)) as one region:
    layers with self-attention, cross-attention over the rows' encoder keys/values and MLP, final norm and
    the all-channel head. A prompt prefill (several positions per row) runs conventionally."""

    name = NH_DECODER_STEP

    def __init__(self, network: NhTtsNetwork, options: BackendOptions = BackendOptions()) -> None:
        super().__init__(options)
        if options.executor is Executor.CUDA:
            _check_cuda(network.device)
        _checked_view(network)
        self.network = network

    def _runner_for(self, cache: NhDecoderCache) -> _RegionRunner:
        return self._bound_runner(
            cache,
            self.network,
            self.network.device,
            _nh_cache_args(cache),
        )

    def __call__(self, cache: NhDecoderCache, rows: Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        rows = [int(r) for r in rows]
        if not _nh_well_formed(cache, rows, codes):
            return self.network.step(cache, rows, codes)  # not a fallback: step raises its own error
        batch = codes.shape[0]
        try:
            _nh_check_decode(cache, rows, codes)
            self._check_batch(batch)
            runner = self._runner_for(cache)
            bucket = self._bucket(batch, cache.max_rows)
            compiled = runner.region(bucket)
        except _CallUnsupported as exc:
            self._fallback(str(exc))
            return self.network.step(cache, rows, codes)
        with torch.no_grad():
            x_in = self.network.decoder.embeddings(codes)[:, 0]
        # Padding rows repeat row 0: same cache row, position, text length and input (row 0's keys/values).
        bound = _nh_step_inputs(cache, _pad_list(rows, bucket), _pad_rows(x_in, bucket))
        out = runner.run(compiled, bound)
        for row in rows:
            cache.lengths[row] += 1
        self.num_megakernel_calls += 1
        dec = self.network.config.decoder
        return out["s0.logits"][:batch].view(batch, dec.num_channels, dec.vocab_size).clone()


class MegakernelCodecDecode(_Backend):
    """SpeechTokenizerDecoder.decode_slots (the CODEC_DECODE executor region) with the codec's sliding-window
    transformer as a megakernel region; the RVQ lookup and the convolutions before it (decode_front) and the
    upsamplers and SnakeBeta decoder after it (decode_back) stay conventional. The region reads and writes the
    pool's own rings in place (DecoderState.keys / values are its k_cache / v_cache), so the conventional
    decode of any later call continues the same streams exactly: a call this backend cannot take runs
    decode_slots, and nothing has to be moved between the two.

    n new frames per row: decode_front of all n, n launches of the region (frame f at position + f), then
    decode_back of all n. CUDA with graphs (BackendOptions.cuda_graphs, not sync_check): the whole call (state
    gather, front, the launches, back, scatter) is one CUDA graph per (batch bucket, n), the first call of a
    key running eagerly as executor.graphs captures; each launch's error words are copied behind it inside the
    graph and checked as the other backends' are, one call late."""

    name = CODEC_DECODE

    def __init__(self, decoder: torch.nn.Module, options: BackendOptions = BackendOptions()) -> None:
        super().__init__(options)
        device = next(decoder.parameters()).device
        if options.executor is Executor.CUDA:
            _check_cuda(device)
        _checked_view(decoder.pre_transformer)
        self.decoder, self.device = decoder, device
        capture = options.executor is Executor.CUDA and options.cuda_graphs and not options.sync_check
        self._graphs = _Graphs(device, capture) if capture else None

    def __call__(self, codes: torch.Tensor, pool, slots: torch.Tensor) -> torch.Tensor:
        self.decoder.check_codes(codes)
        batch, _, frames = codes.shape
        if frames < 1 or slots.dim() != 1 or slots.shape[0] != batch or pool.keys.shape[1] != pool.batch_size:
            return self.decoder.decode_slots(codes, pool, slots)  # not a fallback: it raises its own error
        try:
            self._check_batch(batch)
            runner = self._bound_runner(
                pool, self.decoder.pre_transformer, self.device, {"num_cache_slots": pool.batch_size}
            )
            bucket = self._bucket(batch, pool.batch_size)
            compiled = runner.region(bucket)
        except _CallUnsupported as exc:
            self._fallback(str(exc))
            return self.decoder.decode_slots(codes, pool, slots)
        # Padding rows repeat row 0: same slot, codes and position, so they write row 0's state and ring again.
        codes, slots = _pad_rows(codes.to(torch.int64), bucket), _pad_rows(slots.to(torch.int64), bucket)
        rings = {"k_cache": pool.keys, "v_cache": pool.values}
        if self._graphs is None:
            wav, _ = self._decode(codes, pool, slots, lambda bound: runner.run(compiled, {**bound, **rings})["x_out"])
        else:
            runner.checks.poll()  # an earlier launch's error, landed since: raised before this call runs
            launch, staging = runner.bound_launch(compiled, rings)

            def region(bound: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
                staging.stage(bound)
                launch_op(launch, check=False)
                return launch.tensors["x_out"], launch.error.clone()

            wav, errors = self._graphs.run(
                (bucket, frames),
                lambda codes, slots: self._decode(codes, pool, slots, region),
                {"codes": codes, "slots": slots},
            )
            for words in errors:
                runner.checks.record(words, bucket)
        self.num_megakernel_calls += 1
        return wav[:batch].clone()

    def _decode(self, codes: torch.Tensor, pool, slots: torch.Tensor, region: Callable) -> tuple[torch.Tensor, list]:
        """decode_front, `region` per frame (its INPUT buffers by name -> x_out, or (x_out, error words)),
        decode_back; the rows' states gathered from `pool` and scattered back, their rings left in place."""
        state = pool.select(slots, rings=False)
        h = self.decoder.decode_front(codes, state)  # (bucket, n, latent)
        outs, errors = [], []
        for frame in range(h.shape[1]):
            out = region({"x_in": h[:, frame], "positions": state.positions + frame, "slots": slots})
            if isinstance(out, tuple):
                out, words = out
                errors.append(words)
            outs.append(out.clone())  # the launch's own buffer: the next launch overwrites it
        wav = self.decoder.decode_back(torch.stack(outs, dim=1), state)
        pool.put(slots, state, rings=False)
        return wav, errors


# Region name (models.region_backends) -> the backend class that runs it; each takes the region's network.
BACKENDS: dict[str, type[_Backend]] = {
    DECODER_STEP: MegakernelDecoderStep,
    TALKER_STEP: MegakernelTalkerStep,
    CODE_PREDICTOR_LOOP: MegakernelCodePredictorLoop,
    NH_DECODER_STEP: MegakernelNhDecoderStep,
    CODEC_DECODE: MegakernelCodecDecode,
}


def megakernel_region_names(model: object) -> tuple[str, ...]:
    """The regions of `model` a megakernel backend can run: its decoder regions, then the executor regions
    that have one (the Qwen3-TTS codec decode)."""
    return (*region_names(model), *(n for n in executor_region_names(model) if n in BACKENDS))


def make_backend(model: object, name: str, options: BackendOptions = BackendOptions()) -> _Backend:
    """The megakernel backend for region `name` of `model` (the network its region modules name);
    raises MegakernelUnavailable."""
    if name not in (*region_names(model), *executor_region_names(model)):
        raise ValueError(f"{type(model).__name__} has no region {name!r}")
    if name not in BACKENDS:
        raise MegakernelUnavailable(f"no megakernel backend for region {name!r}")
    return BACKENDS[name](region_module(model, name), options)


def parse_regions(model: object, text: str) -> tuple[str, ...]:
    """`all`, `none` (or empty) or a comma list of `model`'s megakernel region names (megakernel_region_names:
    its decoder regions, then the executor regions with a megakernel backend); ValueError names the valid ones."""
    names = megakernel_region_names(model)
    text = text.strip()
    if text in ("", "none"):
        return ()
    if text == "all":
        return names
    asked = list(dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [n for n in asked if n not in names]
    if unknown:
        valid = ", ".join((*names, "all", "none"))
        raise ValueError(f"unknown megakernel region(s) {', '.join(map(repr, unknown))}; valid: {valid}")
    return tuple(asked)


def install_megakernel_regions(
    model: object, names: Iterable[str], options: BackendOptions = BackendOptions()
) -> dict[str, str | None]:
    """Route each region in `names` through a megakernel backend. Returns name -> None (installed) or the
    reason it stays on the conventional path (also logged as a warning)."""
    result: dict[str, str | None] = {}
    for name in names:
        try:
            backend = make_backend(model, name, options)
        except MegakernelUnavailable as exc:
            set_region_backend(model, name, None)
            log.warning("megakernel region %s: conventional path: %s", name, exc.reason)
            result[name] = exc.reason
            continue
        set_region_backend(model, name, backend)
        log.info("megakernel region %s: %s executor", name, options.executor.value)
        result[name] = None
    return result
