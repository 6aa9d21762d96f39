"""The megakernel instruction set: one registry of opcodes, buffer kinds and the fixed-width record.

Everything a persistent kernel interprets is defined here once; `header.py` generates the C header
`trt_plugins/csrc/megakernel/instructions.h` from these tables, and `vm.py` is the pure-PyTorch
interpreter of the same records. A `Program` (buffers, instructions, per-SM queues, counters) is
what a region compiler produces and what either interpreter consumes.
Imports: stdlib only (no torch, no models).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "ERROR_WORDS",
    "FLAG_SYNC_CHECK",
    "INSTRUCTION_WORDS",
    "LAUNCH_PARAMS",
    "MAX_HEAD_DIM",
    "MAX_ROW_WIDTH",
    "PREFETCH_RANGES",
    "PROFILE_WORDS",
    "MAX_ARGS",
    "MAX_INPUTS",
    "MAX_OUTPUTS",
    "MAX_WAITS",
    "NO_ID",
    "RECORD_FIELDS",
    "BufferKind",
    "BufferSpec",
    "DType",
    "ErrorCode",
    "Instruction",
    "LaunchStatus",
    "Opcode",
    "OpcodeInfo",
    "Program",
    "RegionConstants",
    "Wait",
    "row_range",
]

# Record capacity. An instruction is INSTRUCTION_WORDS int32 words; unused slots hold NO_ID.
MAX_ARGS = 4
MAX_INPUTS = 10
MAX_OUTPUTS = 4
MAX_WAITS = 6
NO_ID = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class OpcodeInfo:
    """What one opcode computes and how its record slots are used (documentation that the header carries)."""

    code: int
    summary: str
    tile: str  # what [tile_start, tile_stop) ranges over
    args: tuple[str, ...]  # names of args[0..]
    inputs: tuple[str, ...]  # names of inputs[0..] (buffer ids)
    outputs: tuple[str, ...]  # names of outputs[0..] (buffer ids)

    def __post_init__(self) -> None:
        if len(self.args) > MAX_ARGS or len(self.inputs) > MAX_INPUTS or len(self.outputs) > MAX_OUTPUTS:
            raise ValueError(
                f"opcode {self.code}: record capacity exceeded ({self.args}, {self.inputs}, {self.outputs})"
            )


class Opcode(enum.Enum):
    """Fused decode instructions. Rows are batch rows b in [0, B); `step` is the micro-step of a loop
    region (its position is positions[b] + step). Shapes are given in each buffer's BufferSpec."""

    EMBED = OpcodeInfo(
        code=1,
        summary="x[b, :] = table[tokens[b], :] (region input tokens)",
        tile="batch rows",
        args=(),
        inputs=("tokens", "table"),
        outputs=("x",),
    )
    LINEAR_BIAS = OpcodeInfo(
        code=2,
        summary="y[b, r] = x[b, :] . w[r, :] + bias[r] (bias NO_ID: none); Qwen3-TTS predictor input projection",
        tile="output features",
        args=(),
        inputs=("x", "w", "bias"),
        outputs=("y",),
    )
    RMSNORM_QKV_ROPE_APPEND = OpcodeInfo(
        code=3,
        summary=(
            "xn = rmsnorm(x) * ln_w; for the tile's heads of kv group `group` ([q heads of the group, k, v]): "
            "h = xn . w_head; q/k: optional per-head rmsnorm (qk_norm_w rows 0=q, 1=k), rope at "
            "positions[b]+step; q -> q_buf[b, head], k/v -> cache[layer, slots[b], group, positions[b]+step] "
            "(with a sliding window W: at p % W and p % W + W, see ATTN_PARTIAL)"
        ),
        tile="head slots of the group (0..G-1 query heads, G key head, G+1 value head)",
        args=("group",),
        inputs=(
            "x",
            "ln_w",
            "w_q",
            "w_k",
            "w_v",
            "qk_norm_w",
            "inv_freq",
            "positions",
            "slots",
        ),
        outputs=("q_buf", "k_cache", "v_cache"),
    )
    ATTN_PARTIAL = OpcodeInfo(
        code=4,
        summary=(
            "for kv group `group` and batch rows [row_start, row_stop), keys [partition*partition_tokens, "
            "+partition_tokens) clipped to each row's length positions[b]+step+1: softmax-normalised partial "
            "output and its log-sum-exp (-inf if empty); in a region of one partition, part_out is attn_out "
            "(same layout, its dtype) and no ATTN_REDUCE follows. With k_new (split QKV), q_buf holds the raw "
            "queries (B, heads x head_dim) and the newest key is not read from the cache: q and k_new[b, group] "
            "get RMSNORM_QKV_ROPE_APPEND's per-head norm (qk_norm_w, NO_ID: none) and rope, v_new[b, group] is "
            "used as it is, both rounded to the cache dtype, so the cache is read at positions below "
            "positions[b]+step only (KV_APPEND writes the newest off the critical path). With a sliding window W "
            "(RegionConstants.window > 0) a row attends its last min(length, W) positions, held in a ring of W cache "
            "positions written twice (position p at p % W and p % W + W), so they lie contiguous from cache "
            "position start % W (start = length - min(length, W)); partitions then count keys from start"
        ),
        tile="kv partitions",
        args=("group", "row_start", "row_stop"),
        inputs=("q_buf", "k_cache", "v_cache", "positions", "slots", "k_new", "v_new", "qk_norm_w", "inv_freq"),
        outputs=("part_out", "part_lse"),
    )
    ATTN_REDUCE = OpcodeInfo(
        code=5,
        summary=(
            "attn_out[b, heads of group] = sum_p exp(lse_p - lse) * part_out_p over the group's partitions, "
            "for batch rows b in [row_start, row_stop)"
        ),
        tile="kv groups",
        args=("row_start", "row_stop"),
        inputs=("part_out", "part_lse"),
        outputs=("attn_out",),
    )
    OPROJ_RESIDUAL = OpcodeInfo(
        code=6,
        summary=(
            "x_out[b, r] = x_in[b, r] + scale[r] * (attn_out[b, :] . w_o[r, :]) (scale NO_ID: none; a layer "
            "scale, applied to the rounded projection)"
        ),
        tile="hidden features",
        args=(),
        inputs=("attn_out", "w_o", "x_in", "scale"),
        outputs=("x_out",),
    )
    RMSNORM_GATEUP_SWIGLU = OpcodeInfo(
        code=7,
        summary="xn = rmsnorm(x) * ln_w; h[b, r] = silu(xn . w_gate[r]) * (xn . w_up[r])",
        tile="intermediate features",
        args=(),
        inputs=("x", "ln_w", "w_gate", "w_up"),
        outputs=("h",),
    )
    DOWN_RESIDUAL = OpcodeInfo(
        code=8,
        summary="x_out[b, r] = x_in[b, r] + scale[r] * (h[b, :] . w_down[r, :]) (scale NO_ID: none, as OPROJ_RESIDUAL)",
        tile="hidden features",
        args=(),
        inputs=("h", "w_down", "x_in", "scale"),
        outputs=("x_out",),
    )
    RMSNORM_LMHEAD = OpcodeInfo(
        code=9,
        summary="xn = rmsnorm(x) * norm_w; logits[b, v] = xn . w_lm[v]; the tile starting at 0 also writes xn",
        tile="vocabulary rows",
        args=(),
        inputs=("x", "norm_w", "w_lm"),
        outputs=("logits", "x_normed"),
    )
    SAMPLE_EMBED = OpcodeInfo(
        code=10,
        summary=(
            "token[b] = argmax (temperature[b] == 0) or a seeded draw after temperature/top-k/top-p from "
            "logits[b, :vocab_limit]; tokens_out[b] = token; x_next[b, :] = table[token] (table NO_ID: none)"
        ),
        tile="batch rows",
        args=("vocab_limit", "rng_step"),
        inputs=(
            "logits",
            "temperature",
            "top_k",
            "top_p",
            "seed",
            "rng_offset",
            "table",
        ),
        outputs=("tokens_out", "x_next"),
    )
    CROSS_ATTN = OpcodeInfo(
        code=11,
        summary=(
            "cross-attention of kv group `group` over per-row encoder keys/values computed before the launch: "
            "for the group's query heads h, attn_out[b, h] = softmax(q[b, h] . k_cache[layer, slots[b], group, "
            ":text_lengths[b]] * attn_scale) @ v_cache[layer, slots[b], group, :text_lengths[b]] (fp32 softmax); "
            "head count and head_dim from the buffers: caches (layers, slots, kv heads, text, D), q and attn_out "
            "(B, heads * D)"
        ),
        tile="batch rows",
        args=("group",),
        inputs=("q", "k_cache", "v_cache", "text_lengths", "slots"),
        outputs=("attn_out",),
    )
    RMSNORM_LINEAR = OpcodeInfo(
        code=12,
        summary=(
            "xn = rmsnorm(x) * ln_w; y[b, r] = xn . w[r] + bias[r] (bias NO_ID: none) (split QKV: a layer's raw "
            "q, k or v projection, cut into balanced row tiles; the per-head norms and rope follow in ATTN_PARTIAL "
            "and KV_APPEND; a codec transformer's final norm and output projection)"
        ),
        tile="output features",
        args=(),
        inputs=("x", "ln_w", "w", "bias"),
        outputs=("y",),
    )
    KV_APPEND = OpcodeInfo(
        code=13,
        summary=(
            "split QKV: for kv groups g in the tile and batch rows [row_start, row_stop), k = rope(rmsnorm(k_raw[b, "
            "g]) * qk_norm_w[1]) (norm skipped when qk_norm_w is NO_ID) at positions[b]+step -> k_cache[layer, "
            "slots[b], g, positions[b]+step], v_raw[b, g] -> v_cache there (RMSNORM_QKV_ROPE_APPEND's k and v); "
            "with a sliding window W, at cache positions p % W and p % W + W (p = positions[b]+step), as there"
        ),
        tile="kv groups",
        args=("row_start", "row_stop"),
        inputs=("k_raw", "v_raw", "qk_norm_w", "inv_freq", "positions", "slots"),
        outputs=("k_cache", "v_cache"),
    )

    @property
    def code(self) -> int:
        return self.value.code

    @classmethod
    def from_code(cls, code: int) -> Opcode:
        for op in cls:
            if op.value.code == code:
                return op
        raise ValueError(f"unknown opcode {code}")


class DType(enum.Enum):
    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2
    INT64 = 3
    INT32 = 4

    @property
    def itemsize(self) -> int:
        return {
            DType.FLOAT32: 4,
            DType.BFLOAT16: 2,
            DType.FLOAT16: 2,
            DType.INT64: 8,
            DType.INT32: 4,
        }[self]


class BufferKind(enum.Enum):
    """WEIGHT: read-only parameters. INPUT: written by the caller before a launch. OUTPUT: read by the
    caller after it. STATE: persistent across launches (KV caches). SCRATCH: written and read inside
    one launch only (poisoned with NaN by the VM so that a read-before-write shows)."""

    WEIGHT = 0
    INPUT = 1
    OUTPUT = 2
    STATE = 3
    SCRATCH = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferSpec:
    buffer_id: int
    name: str
    kind: BufferKind
    dtype: DType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.buffer_id < 0:
            raise ValueError(f"buffer_id must be >= 0, got {self.buffer_id}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ValueError(f"buffer {self.name!r}: shape must be non-negative ints, got {self.shape}")

    @property
    def num_bytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "buffer_id": self.buffer_id,
            "name": self.name,
            "kind": self.kind.name,
            "dtype": self.dtype.name,
            "shape": list(self.shape),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferSpec:
        return cls(
            buffer_id=int(d["buffer_id"]),
            name=str(d["name"]),
            kind=BufferKind[d["kind"]],
            dtype=DType[d["dtype"]],
            shape=tuple(int(x) for x in d["shape"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    """Block until counters[counter_id] >= target (counters only ever increase within a launch)."""

    counter_id: int
    target: int

    def __post_init__(self) -> None:
        if self.counter_id < 0 or self.target < 1:
            raise ValueError(f"wait needs counter_id >= 0 and target >= 1, got {self.counter_id}, {self.target}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Instruction:
    """One fused tile of work. On completion it adds 1 to counters[signal] (NO_ID: signals nothing).

    weight_bytes / kv_bytes / activation_bytes / flops are cost-model annotations (not encoded):
    weight_bytes counts the matrix rows this tile owns (plus embedding rows it gathers), kv_bytes the
    cached keys/values it reads or writes, activation_bytes everything else it moves (including
    replicated norm-weight reads); flops counts 2 x multiply-adds of matrix products only."""

    opcode: Opcode
    layer: int = NO_ID
    step: int = 0
    tile_start: int = 0
    tile_stop: int = 1
    args: tuple[int, ...] = ()
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    waits: tuple[Wait, ...] = ()
    signal: int = NO_ID
    weight_bytes: int = 0
    kv_bytes: int = 0
    activation_bytes: int = 0
    flops: int = 0

    def __post_init__(self) -> None:
        info = self.opcode.value
        if len(self.args) != len(info.args):
            raise ValueError(f"{self.opcode.name} takes args {info.args}, got {self.args}")
        if len(self.inputs) != len(info.inputs) or len(self.outputs) != len(info.outputs):
            raise ValueError(
                f"{self.opcode.name} takes inputs {info.inputs} and outputs {info.outputs}, got "
                f"{len(self.inputs)} inputs and {len(self.outputs)} outputs"
            )
        if len(self.waits) > MAX_WAITS:
            raise ValueError(f"{self.opcode.name}: at most {MAX_WAITS} waits, got {len(self.waits)}")
        if not 0 <= self.tile_start < self.tile_stop:
            raise ValueError(
                f"{self.opcode.name}: tile range must satisfy 0 <= start < stop, got "
                f"[{self.tile_start}, {self.tile_stop})"
            )
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if min(self.weight_bytes, self.kv_bytes, self.activation_bytes, self.flops) < 0:
            raise ValueError("cost annotations must be >= 0")

    @property
    def bytes_moved(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    def encode(self) -> list[int]:
        """The INSTRUCTION_WORDS int32 words the CUDA interpreter reads (layout: RECORD_FIELDS)."""
        words = [
            self.opcode.code,
            self.layer,
            self.step,
            self.tile_start,
            self.tile_stop,
            self.signal,
            len(self.waits),
        ]
        words += _pad(self.args, MAX_ARGS) + _pad(self.inputs, MAX_INPUTS) + _pad(self.outputs, MAX_OUTPUTS)
        for wait in self.waits:
            words += [wait.counter_id, wait.target]
        words += [NO_ID, 0] * (MAX_WAITS - len(self.waits))
        words += [NO_ID] * (INSTRUCTION_WORDS - len(words))
        assert len(words) == INSTRUCTION_WORDS
        return words

    @classmethod
    def decode(cls, words: list[int]) -> Instruction:
        """Inverse of encode (cost annotations are not encoded and come back as 0)."""
        if len(words) != INSTRUCTION_WORDS:
            raise ValueError(f"an instruction record has {INSTRUCTION_WORDS} words, got {len(words)}")
        opcode = Opcode.from_code(words[0])
        info = opcode.value
        offset = {name: start for name, start, _ in RECORD_FIELDS}
        num_waits = words[offset["num_waits"]]
        wait_words = words[offset["waits"] : offset["waits"] + 2 * num_waits]
        return cls(
            opcode=opcode,
            layer=words[1],
            step=words[2],
            tile_start=words[3],
            tile_stop=words[4],
            signal=words[5],
            args=tuple(words[offset["args"] : offset["args"] + len(info.args)]),
            inputs=tuple(words[offset["inputs"] : offset["inputs"] + len(info.inputs)]),
            outputs=tuple(words[offset["outputs"] : offset["outputs"] + len(info.outputs)]),
            waits=tuple(Wait(counter_id=c, target=t) for c, t in zip(wait_words[0::2], wait_words[1::2])),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "opcode": self.opcode.name,
            "layer": self.layer,
            "step": self.step,
            "tile_start": self.tile_start,
            "tile_stop": self.tile_stop,
            "args": list(self.args),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "waits": [[w.counter_id, w.target] for w in self.waits],
            "signal": self.signal,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "activation_bytes": self.activation_bytes,
            "bytes": self.bytes_moved,
            "flops": self.flops,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Instruction:
        return cls(
            opcode=Opcode[d["opcode"]],
            layer=int(d["layer"]),
            step=int(d["step"]),
            tile_start=int(d["tile_start"]),
            tile_stop=int(d["tile_stop"]),
            args=tuple(d["args"]),
            inputs=tuple(d["inputs"]),
            outputs=tuple(d["outputs"]),
            waits=tuple(Wait(counter_id=c, target=t) for c, t in d["waits"]),
            signal=int(d["signal"]),
            weight_bytes=int(d["weight_bytes"]),
            kv_bytes=int(d["kv_bytes"]),
            activation_bytes=int(d["activation_bytes"]),
            flops=int(d["flops"]),
        )


def _pad(values: tuple[int, ...], width: int) -> list[int]:
    return list(values) + [NO_ID] * (width - len(values))


# (name, first word, number of words) of the record; the header emits these as constants.
RECORD_FIELDS: tuple[tuple[str, int, int], ...] = (
    ("opcode", 0, 1),
    ("layer", 1, 1),
    ("step", 2, 1),
    ("tile_start", 3, 1),
    ("tile_stop", 4, 1),
    ("signal", 5, 1),
    ("num_waits", 6, 1),
    ("args", 7, MAX_ARGS),
    ("inputs", 7 + MAX_ARGS, MAX_INPUTS),
    ("outputs", 7 + MAX_ARGS + MAX_INPUTS, MAX_OUTPUTS),
    (
        "waits",
        7 + MAX_ARGS + MAX_INPUTS + MAX_OUTPUTS,
        2 * MAX_WAITS,
    ),  # (counter_id, target) pairs
)
INSTRUCTION_WORDS = 48  # 192 bytes; the fields above use 7 + 4 + 10 + 4 + 12 = 37, the rest is reserved
assert RECORD_FIELDS[-1][1] + RECORD_FIELDS[-1][2] <= INSTRUCTION_WORDS


def row_range(args: tuple[int, ...], first: int, batch_size: int) -> tuple[int, int]:
    """Batch rows [args[first], args[first + 1]) of an instruction whose args carry a row range (attention);
    NO_ID stands for 0 / batch_size (all rows)."""
    start = 0 if args[first] == NO_ID else args[first]
    stop = batch_size if args[first + 1] == NO_ID else args[first + 1]
    if not 0 <= start < stop <= batch_size:
        raise ValueError(f"row range [{start}, {stop}) outside the batch [0, {batch_size})")
    return start, stop


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionConstants:
    """Per-region scalars every instruction of the region shares (a launch parameter on the GPU)."""

    batch_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attn_scale: float
    partition_tokens: int  # keys per ATTN_PARTIAL tile
    num_partitions: int  # ATTN_PARTIAL tiles per kv group (covers the region's max context)
    # Sliding-window attention: a row attends its last `window` positions, cached in a ring of `window`
    # positions written twice (p at p % window and p % window + window; see ATTN_PARTIAL). 0: every position.
    window: int = 0

    def __post_init__(self) -> None:
        for name in (
            "batch_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "partition_tokens",
            "num_partitions",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0 (0: no sliding window), got {self.window}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.rms_norm_eps > 0 or not self.attn_scale > 0:
            raise ValueError(f"rms_norm_eps and attn_scale must be > 0, got {self.rms_norm_eps}, {self.attn_scale}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True, kw_only=True)
class Program:
    """A compiled region: buffers, instructions (a topological order), per-SM queues of instruction
    indices, and the number of counters (all zero at launch start)."""

    constants: RegionConstants
    buffers: tuple[BufferSpec, ...]
    instructions: tuple[Instruction, ...]
    queues: tuple[tuple[int, ...], ...]
    num_counters: int
    metadata: dict[str, Any] = field(default_factory=dict)  # free-form (region spec, policy, predicted time)

    def __post_init__(self) -> None:
        ids = [b.buffer_id for b in self.buffers]
        if ids != list(range(len(ids))):
            raise ValueError("buffer ids must be 0..N-1 in order")
        seen = sorted(i for q in self.queues for i in q)
        if seen != list(range(len(self.instructions))):
            raise ValueError("queues must hold every instruction index exactly once")
        for idx, inst in enumerate(self.instructions):
            for buf in (*inst.inputs, *inst.outputs):
                if buf != NO_ID and not 0 <= buf < len(self.buffers):
                    raise ValueError(f"instruction {idx} references unknown buffer {buf}")
            for counter in (inst.signal, *(w.counter_id for w in inst.waits)):
                if counter != NO_ID and not 0 <= counter < self.num_counters:
                    raise ValueError(f"instruction {idx} references unknown counter {counter}")

    def buffer(self, name: str) -> BufferSpec:
        for spec in self.buffers:
            if spec.name == name:
                return spec
        raise KeyError(f"no buffer named {name!r}")

    def with_queues(self, queues: tuple[tuple[int, ...], ...], **metadata: Any) -> Program:
        return Program(
            constants=self.constants,
            buffers=self.buffers,
            instructions=self.instructions,
            queues=tuple(tuple(q) for q in queues),
            num_counters=self.num_counters,
            metadata={**self.metadata, **metadata},
        )

    def with_instructions(self, instructions: tuple[Instruction, ...]) -> Program:
        return Program(
            constants=self.constants,
            buffers=self.buffers,
            instructions=tuple(instructions),
            queues=self.queues,
            num_counters=self.num_counters,
            metadata=dict(self.metadata),
        )


# ---- The kernel's interface beyond the records: limits, error words, statuses, flags, launch parameters.
# header.py writes all of these into instructions.h; runtime.py builds its ctypes structure from
# LAUNCH_PARAMS; the region backends check MAX_HEAD_DIM and MAX_ROW_WIDTH. Typed here only.

MAX_HEAD_DIM = 256  # largest head_dim the attention and QKV instructions handle
MAX_ROW_WIDTH = 48 * 1024  # fp32 elements of the shared staging buffer one matrix-vector input row must fit
ERROR_WORDS = 8  # int32 error words per launch: [code, queue, position, opcode, counter, value, target, -]
FLAG_SYNC_CHECK = 1  # launch flag: synchronize the stream and turn the error words into a status
PREFETCH_RANGES = 2  # weight ranges [address, bytes] per instruction in the optional prefetch table
PROFILE_WORDS = 3  # int64 timestamps per instruction in the optional profile: record read, waits met, finished


class ErrorCode(enum.IntEnum):
    """Word 0 of the error words: what stopped the kernel."""

    NONE = 0
    WATCHDOG = 1  # a counter wait exceeded watchdog_ns (a deadlock)
    BAD_OPCODE = 2  # an unknown opcode
    OUT_OF_RANGE = 3  # an out-of-range index (token, slot, position)
    UNSUPPORTED = 4  # a shape the kernel does not handle

    @property
    def description(self) -> str:
        return {
            ErrorCode.NONE: "none",
            ErrorCode.WATCHDOG: "watchdog",
            ErrorCode.BAD_OPCODE: "unknown opcode",
            ErrorCode.OUT_OF_RANGE: "index out of range",
            ErrorCode.UNSUPPORTED: "unsupported shape",
        }[self]


class LaunchStatus(enum.IntEnum):
    """Status codes of tilevox_megakernel_launch beyond the kernel library's (tilevox_kernels.h)."""

    MK_WATCHDOG = 16  # a counter wait exceeded watchdog_ns (a deadlock)
    MK_FAULT = 17  # an instruction found an out-of-range index or shape


# tilevox_megakernel_params, field for field: (name, C type, comment). Every RegionConstants field is one of
# them (checked below), so one struct carries the whole launch.
LAUNCH_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("instructions", "const int32_t*", "(num_queues, max_queue_len, TILEVOX_MK_INSTRUCTION_WORDS) int32"),
    ("queue_lengths", "const int32_t*", "(num_queues,) int32"),
    ("buffer_table", "const int64_t*", "(num_buffers, 8) int64 rows [kind, dtype, ndim, dims[0..4]] (packing.py)"),
    ("buffer_ptrs", "void* const*", "(num_buffers,) device pointers, each a contiguous tensor of its row's shape"),
    ("counters", "int32_t*", "(num_counters,) int32, zeroed by the launch"),
    ("error", "int32_t*", "(TILEVOX_MK_ERROR_WORDS,) int32, zeroed by the launch"),
    ("profile", "int64_t*", "optional (num_queues, max_queue_len, 3) int64: read / waited / finished ns"),
    ("prefetch", "const int64_t*", "optional (num_queues, max_queue_len, 4) int64: two [address, bytes] ranges"),
    ("num_queues", "int32_t", ""),
    ("max_queue_len", "int32_t", ""),
    ("num_buffers", "int32_t", ""),
    ("num_counters", "int32_t", ""),
    ("batch_size", "int32_t", "RegionConstants"),
    ("num_heads", "int32_t", "RegionConstants"),
    ("num_kv_heads", "int32_t", "RegionConstants"),
    ("head_dim", "int32_t", "RegionConstants"),
    ("partition_tokens", "int32_t", "RegionConstants"),
    ("num_partitions", "int32_t", "RegionConstants"),
    ("rms_norm_eps", "float", "RegionConstants"),
    ("attn_scale", "float", "RegionConstants"),
    ("window", "int32_t", "RegionConstants: sliding window (0: none)"),
    ("watchdog_ns", "int64_t", "per wait; must be > 0"),
    ("flags", "int32_t", "TILEVOX_MK_FLAG_*"),
)
assert {f.name for f in fields(RegionConstants)} <= {name for name, _, _ in LAUNCH_PARAMS}
