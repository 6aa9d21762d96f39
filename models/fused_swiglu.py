"""Swap a model's SwiGLU MLPs (bias-free gate_proj/up_proj/down_proj) for the fused CUTLASS op where it is faster.

The fused op (trt_plugins.ops) runs only on SM 9.0 GPUs in bf16 with the kernel library built; everywhere else
the model keeps its plain PyTorch MLP, which is the reference.

`AUTO` never picks a path that was measured slower than the plain PyTorch MLP. Which path is fastest depends on
the MLP's shape and on the token count M of each call (decode: a few tokens; prefill: thousands), so the choice is
made per call from a table measured on the GPU (`fused_swiglu_dispatch.json`, written by
benchmarks/swiglu/run_auto.py): for each (hidden, intermediate) shape and each measured M it names the fastest of

- `torch`: the plain PyTorch MLP (three cuBLAS GEMMs, silu, mul), exactly what the model runs without the swap;
- `fused_torch_down`: the fused CUTLASS gate/up kernel, then cuBLAS for the down projection (wins at small M,
  where the CUTLASS down GEMM loses to cuBLAS);
- `fused`: the fused gate/up kernel and the CUTLASS down GEMM (the `tilevox::swiglu_mlp` op).

A fused path is recorded only where it beat `torch` by the table's margin both under CUDA graphs and in eager
mode. Between two measured token counts a stage runs fused only if it did at both neighbours; beyond the largest
measured M, on another GPU than the table's, and for shapes the table lacks, the MLP stays plain PyTorch: never
slower by construction. The per-call cost is one tuple index (the choice for every M up to the table's largest is
precomputed at load). The weights are packed once, gate and up concatenated ([Wg; Wu], Kernel-1's layout), so
that the `torch` path runs on views of the same memory.

`ON` swaps every MLP for the fused op at every M (raises where it cannot run); `OFF` never swaps.
"""

from __future__ import annotations

import bisect
import enum
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DISPATCH_TABLE_ENV_VAR",
    "DISPATCH_TABLE_PATH",
    "DispatchTable",
    "DispatchedSwigluMLP",
    "FusedSwiglu",
    "MlpPath",
    "ShapeDispatch",
    "apply_fused_swiglu",
    "dispatch_table_for",
    "fused_swiglu_unavailable_reason",
]

log = logging.getLogger(__name__)

DISPATCH_TABLE_PATH = Path(__file__).resolve().parent / "fused_swiglu_dispatch.json"
DISPATCH_TABLE_ENV_VAR = "TILEVOX_SWIGLU_DISPATCH"  # a table measured on another GPU (same JSON format)
_PRECOMPUTED_M = 1 << 16


class FusedSwiglu(enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class MlpPath(enum.Enum):
    """How one MLP call runs; see the module docstring."""

    TORCH = "torch"
    FUSED_TORCH_DOWN = "fused_torch_down"
    FUSED = "fused"

    @property
    def fused_gateup(self) -> bool:
        return self is not MlpPath.TORCH

    @property
    def cutlass_down(self) -> bool:
        return self is MlpPath.FUSED


def _path_of(fused_gateup: bool, cutlass_down: bool) -> MlpPath:
    if cutlass_down and fused_gateup:
        return MlpPath.FUSED
    return MlpPath.FUSED_TORCH_DOWN if fused_gateup else MlpPath.TORCH


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeDispatch:
    """The measured choice for one MLP shape: (token count M, path) pairs in increasing M."""

    hidden: int
    intermediate: int
    points: tuple[tuple[int, MlpPath], ...]

    def __post_init__(self) -> None:
        if min(self.hidden, self.intermediate) < 1:
            raise ValueError(f"hidden and intermediate must be >= 1, got {self.hidden} x {self.intermediate}")
        ms = [m for m, _ in self.points]
        if not ms or ms[0] < 1 or any(b <= a for a, b in zip(ms, ms[1:])):
            raise ValueError(f"points need strictly increasing token counts >= 1, got {ms}")
        if not all(isinstance(p, MlpPath) for _, p in self.points):
            raise ValueError("points must pair token counts with MlpPath values")

    @property
    def max_m(self) -> int:
        return self.points[-1][0]

    def path_for(self, m: int) -> MlpPath:
        """The path for a call with `m` tokens (see the module docstring for between and beyond the points)."""
        ms = [p for p, _ in self.points]
        i = bisect.bisect_left(ms, m)
        if m < 1 or i == len(ms):
            return MlpPath.TORCH
        if ms[i] == m:
            return self.points[i][1]
        if i == 0:  # below the smallest measured M: nothing was measured there
            return MlpPath.TORCH
        lo, hi = self.points[i - 1][1], self.points[i][1]
        return _path_of(lo.fused_gateup and hi.fused_gateup, lo.cutlass_down and hi.cutlass_down)

    @property
    def ever_fused(self) -> bool:
        return any(p.fused_gateup for _, p in self.points)

    @classmethod
    def from_timings(
        cls, hidden: int, intermediate: int, timings: dict[int, dict[str, dict[MlpPath, float]]], *, margin: float
    ) -> ShapeDispatch:
        """Pick per M the fastest path, from `timings[m][regime][path]` (ms; regimes e.g. "graph", "eager").

        A fused path must be at least `margin` (a fraction) faster than `torch` in every regime; among those that
        are, the one with the smallest worst-regime time relative to `torch` wins. A missing time disqualifies.
        """
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        points = []
        for m in sorted(timings):
            regimes = timings[m]
            best, best_ratio = MlpPath.TORCH, 1.0 - margin
            for path in (MlpPath.FUSED_TORCH_DOWN, MlpPath.FUSED):
                ratios = [
                    r[path] / r[MlpPath.TORCH] if path in r and MlpPath.TORCH in r else float("inf")
                    for r in regimes.values()
                ]
                worst = max(ratios, default=float("inf"))
                if worst <= best_ratio:
                    best, best_ratio = path, worst
            points.append((m, best))
        return cls(hidden=hidden, intermediate=intermediate, points=tuple(points))


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchTable:
    """Measured per-shape choices for one GPU model (`device` as torch.cuda.get_device_name reports it)."""

    device: str
    shapes: tuple[ShapeDispatch, ...]
    source: str = ""  # where the timings came from (benchmark result file, date)
    margin: float = 0.0

    def __post_init__(self) -> None:
        keys = [(s.hidden, s.intermediate) for s in self.shapes]
        if len(set(keys)) != len(keys):
            raise ValueError(f"a shape appears twice in the dispatch table: {keys}")

    def for_shape(self, hidden: int, intermediate: int) -> ShapeDispatch | None:
        for entry in self.shapes:
            if (entry.hidden, entry.intermediate) == (hidden, intermediate):
                return entry
        return None

    def to_json(self) -> str:
        head = json.dumps({"device": self.device, "source": self.source, "margin": self.margin})[:-1]
        shapes = [
            json.dumps(
                {"hidden": s.hidden, "intermediate": s.intermediate, "points": [[m, p.value] for m, p in s.points]}
            )
            for s in self.shapes
        ]
        return head + ', "shapes": [\n  ' + ",\n  ".join(shapes) + "\n]}\n"  # one line per shape

    @classmethod
    def from_json(cls, text: str, *, where: str = "dispatch table") -> DispatchTable:
        data = json.loads(text)
        unknown = set(data) - {"device", "source", "margin", "shapes"}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        shapes = tuple(
            ShapeDispatch(
                hidden=int(s["hidden"]),
                intermediate=int(s["intermediate"]),
                points=tuple((int(m), MlpPath(p)) for m, p in s["points"]),
            )
            for s in data["shapes"]
        )
        return cls(
            device=str(data["device"]),
            shapes=shapes,
            source=str(data.get("source", "")),
            margin=float(data.get("margin", 0.0)),
        )

    @classmethod
    def load(cls, path: str | Path) -> DispatchTable:
        return cls.from_json(Path(path).read_text(), where=str(path))


def dispatch_table_for(device: torch.device) -> DispatchTable | None:
    """The committed table (or $TILEVOX_SWIGLU_DISPATCH's) if it was measured on this GPU model, else None."""
    path = Path(os.environ.get(DISPATCH_TABLE_ENV_VAR) or DISPATCH_TABLE_PATH)
    table = DispatchTable.load(path)
    name = torch.cuda.get_device_name(device)
    if table.device != name:
        log.info(
            "fused SwiGLU not used: %s was measured on %s, this GPU is %s (measure it with "
            "benchmarks/swiglu/run_auto.py and point $%s at the result)",
            path,
            table.device,
            name,
            DISPATCH_TABLE_ENV_VAR,
        )
        return None
    return table


def fused_swiglu_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the fused op can run for weights on `device` in `dtype`; otherwise why not."""
    if device.type != "cuda":
        return f"device is {device.type}, the fused SwiGLU kernels need a CUDA Hopper GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"GPU compute capability is {capability[0]}.{capability[1]}, the kernels are built for sm_90a"
    if dtype != torch.bfloat16:
        return f"dtype is {dtype}, the fused SwiGLU kernels take bf16"
    from tilevox.trt_plugins.library import KernelLibraryError, KernelLibraryNotFoundError, kernels_library

    try:
        kernels_library()
    except (KernelLibraryError, KernelLibraryNotFoundError) as exc:
        return str(exc)
    return None


class DispatchedSwigluMLP(nn.Module):
    """A bias-free SwiGLU MLP that runs each call on the path its shape's table names for the call's token count."""

    def __init__(
        self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *, dispatch: ShapeDispatch
    ) -> None:
        super().__init__()
        from tilevox.trt_plugins.ops import GateUpLayout, SwigluKernel, pack_gate_up

        n, k = w_gate.shape
        if (dispatch.hidden, dispatch.intermediate) != (k, n):
            raise ValueError(f"dispatch entry is for {dispatch.hidden}x{dispatch.intermediate}, the MLP is {k}x{n}")
        self.layout = GateUpLayout(kernel=SwigluKernel.DUAL_PINGPONG, block=0)  # [Wg; Wu]: torch uses the halves
        self.dispatch = dispatch
        self.w_packed = nn.Parameter(
            pack_gate_up(w_gate, w_up, kernel=self.layout.kernel, block=0), requires_grad=False
        )
        self.w_down = nn.Parameter(w_down.contiguous(), requires_grad=False)
        # index = token count; larger counts (past a table's usual 8192) take the bisect in dispatch.path_for
        self._paths = tuple(dispatch.path_for(m) for m in range(min(dispatch.max_m, _PRECOMPUTED_M) + 1))
        self._hidden = k
        self._halves()

    def _halves(self) -> None:
        # Views of [Wg; Wu] for the PyTorch path, made once (a slice per call costs host time in eager decode).
        n = self.w_packed.shape[0] // 2
        self._w_gate, self._w_up = self.w_packed[:n], self.w_packed[n:]

    def _apply(self, fn, recurse=True):  # .to() / .cuda() replace w_packed: refresh the views
        module = super()._apply(fn, recurse)
        self._halves()
        return module

    @classmethod
    def from_linears(
        cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, *, dispatch: ShapeDispatch
    ) -> DispatchedSwigluMLP:
        for name, linear in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if linear.bias is not None:
                raise ValueError(f"{name} has a bias; the fused SwiGLU ops take bias-free projections")
        return cls(gate_proj.weight.detach(), up_proj.weight.detach(), down_proj.weight.detach(), dispatch=dispatch)

    def path_for(self, m: int) -> MlpPath:
        return self._paths[m] if 0 <= m < len(self._paths) else self.dispatch.path_for(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // self._hidden
        paths = self._paths
        if isinstance(m, torch.SymInt):  # under torch.export: the exported op (a TensorRT plugin) sees the real M
            path = MlpPath.FUSED
        else:
            path = paths[m] if m < len(paths) else self.dispatch.path_for(m)
        if path is MlpPath.TORCH:
            return F.linear(F.silu(F.linear(x, self._w_gate)) * F.linear(x, self._w_up), self.w_down)
        from tilevox.trt_plugins.ops import swiglu_gateup, swiglu_mlp

        if path is MlpPath.FUSED:
            return swiglu_mlp(x, self.w_packed, self.w_down, layout=self.layout)
        return F.linear(swiglu_gateup(x, self.w_packed, layout=self.layout), self.w_down)


def _swiglu_mlps(root: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    found = []
    for parent in root.modules():
        for name, child in parent.named_children():
            projections = [getattr(child, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
            if all(isinstance(p, nn.Linear) and p.bias is None for p in projections):
                found.append((parent, name, child))
    return found


def apply_fused_swiglu(roots: tuple[nn.Module, ...], mode: FusedSwiglu, *, table: DispatchTable | None = None) -> int:
    """Replace the SwiGLU MLPs under `roots` (AUTO: those whose shape the table makes faster); returns how many.

    `table` overrides the committed dispatch table for AUTO (tests, a table measured elsewhere)."""
    if mode is FusedSwiglu.OFF:
        return 0
    from tilevox.trt_plugins.ops import SwigluMLP, layout_for_device

    count = 0
    unmeasured: set[tuple[int, int]] = set()
    never_faster: set[tuple[int, int]] = set()
    for root in roots:
        for parent, name, mlp in _swiglu_mlps(root):
            weight = mlp.gate_proj.weight
            reason = fused_swiglu_unavailable_reason(weight.device, weight.dtype)
            n, k = weight.shape
            if reason is None and (n % 8 or k % 8):
                reason = f"MLP shape N={n}, K={k}: the kernels need multiples of 8"
            if reason is None and mode is FusedSwiglu.AUTO and table is None:
                table = dispatch_table_for(weight.device)
                if table is None:
                    return count  # dispatch_table_for logged why
            if reason is not None:
                if mode is FusedSwiglu.ON:
                    raise ValueError(f"fused SwiGLU was asked for but cannot run: {reason}")
                log.info("fused SwiGLU not used: %s", reason)
                return count
            if mode is FusedSwiglu.ON:
                layout = layout_for_device(weight.device, n, k)
                fused = SwigluMLP.from_linears(mlp.gate_proj, mlp.up_proj, mlp.down_proj, layout=layout)
            else:
                entry = table.for_shape(k, n)
                if entry is None or not entry.ever_fused:
                    (unmeasured if entry is None else never_faster).add((k, n))
                    continue
                fused = DispatchedSwigluMLP.from_linears(mlp.gate_proj, mlp.up_proj, mlp.down_proj, dispatch=entry)
            setattr(parent, name, fused)
            count += 1
    if unmeasured:
        log.info(
            "fused SwiGLU not used for MLP shapes (hidden, intermediate) %s: not in the dispatch table",
            sorted(unmeasured),
        )
    if never_faster:
        log.info(
            "fused SwiGLU not used for MLP shapes (hidden, intermediate) %s: PyTorch was as fast at every "
            "measured token count",
            sorted(never_faster),
        )
    if count:
        log.info(
            "fused SwiGLU: %d MLPs use the CUTLASS kernels%s",
            count,
            "" if mode is FusedSwiglu.ON else " where the dispatch table measured them faster",
        )
    return count
