"""Fused SwiGLU ops: `tilevox::swiglu_gateup` (h = silu(x Wg^T) * (x Wu^T)) and `tilevox::swiglu_mlp` (h Wd^T).

Each op takes the gate/up weights packed once at load time (`pack_gate_up`) into the layout of the kernel that
will run them (Kernel-1: [Wg; Wu]; Kernel-2: block-interleaved, see tilevox_kernels.h). The CUDA kernel calls the
C launchers of libtilevox_kernels.so through ctypes on the current stream; the CPU kernel is the pure-PyTorch
reference (`*_ref`: fp32 internally, one rounding to the input dtype per GEMM stage), which is also the oracle.
Imports: torch, trt_plugins.library only.
"""

from __future__ import annotations

import ctypes
import enum
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tilevox.trt_plugins.library import GemmBf16Params, SwigluGateupParams, check_status, kernels_library

__all__ = [
    "GateUpLayout",
    "SwigluKernel",
    "SwigluMLP",
    "TileRule",
    "TileTable",
    "gate_up_from_packed",
    "gemm_ref",
    "layout_for_device",
    "pack_gate_up",
    "swiglu_gateup",
    "swiglu_gateup_ref",
    "swiglu_mlp",
    "swiglu_mlp_ref",
    "unpack_gate_up",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class SwigluKernel(enum.IntEnum):
    """Kernel ids of tilevox_kernels.h (TILEVOX_KERNEL_*); AUTO is not offered: the layout fixes the kernel."""

    DUAL_PINGPONG = 1  # Kernel-1: Pingpong mainloop fusion, reads Wg and Wu (N, K) each
    PACKED_EVT = 2  # Kernel-2: one GEMM over 2N with an EVT SwiGLU epilogue, block-interleaved weights


@dataclass(frozen=True, slots=True, kw_only=True)
class GateUpLayout:
    """How the (2N, K) packed gate/up weight is laid out: Kernel-1 concatenates, Kernel-2 interleaves blocks."""

    kernel: SwigluKernel
    block: int  # rows per interleaved block for PACKED_EVT; 0 for DUAL_PINGPONG (plain concatenation)

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, SwigluKernel):
            raise ValueError(f"kernel must be a SwigluKernel, got {self.kernel!r}")
        if self.kernel is SwigluKernel.DUAL_PINGPONG and self.block != 0:
            raise ValueError(f"DUAL_PINGPONG uses the [gate; up] concatenation: block must be 0, got {self.block}")
        if self.kernel is SwigluKernel.PACKED_EVT and self.block < 1:
            raise ValueError(f"PACKED_EVT needs an interleave block >= 1, got {self.block}")

    def check_n(self, n: int) -> None:
        if self.kernel is SwigluKernel.PACKED_EVT and n % self.block != 0:
            raise ValueError(f"intermediate size {n} must be a multiple of the packing block {self.block}")


def layout_for_device(device: torch.device | str, n: int, k: int, *, m_hint: int = 2048) -> GateUpLayout:
    """The layout to pack weights in for `device`.

    On CUDA the kernel library's recorded heuristic (`tilevox_swiglu_gateup_select` for AUTO at a typical
    token count `m_hint`) picks the kernel, and the library's packing block is used. Elsewhere the op runs its
    reference, for which the plain concatenation is the cheapest layout.
    """
    if torch.device(device).type != "cuda":
        return GateUpLayout(kernel=SwigluKernel.DUAL_PINGPONG, block=0)
    lib = kernels_library()
    kernel_out, config_out = ctypes.c_int(), ctypes.c_int()
    status = lib.tilevox_swiglu_gateup_select(m_hint, n, k, 0, ctypes.byref(kernel_out), ctypes.byref(config_out))
    check_status(lib, status, f"tilevox_swiglu_gateup_select(m={m_hint}, n={n}, k={k})")
    kernel = SwigluKernel(kernel_out.value)
    block = lib.tilevox_swiglu_packing_block() if kernel is SwigluKernel.PACKED_EVT else 0
    return GateUpLayout(kernel=kernel, block=block)


# --------------------------------------------------------------------------------------------------------------
# Weight layout (done once, at load time)


def pack_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor, *, kernel: SwigluKernel, block: int) -> torch.Tensor:
    """Pack Hugging Face gate_proj/up_proj weights, (N, K) each, into one contiguous (2N, K) tensor."""
    layout = GateUpLayout(kernel=SwigluKernel(kernel), block=block)
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must both be (N, K)")
    if w_gate.dtype != w_up.dtype or w_gate.device != w_up.device:
        raise ValueError("w_gate and w_up must share dtype and device")
    n, k = w_gate.shape
    layout.check_n(n)
    if layout.kernel is SwigluKernel.DUAL_PINGPONG:
        return torch.cat([w_gate, w_up], dim=0).contiguous()  # (2N, K) = [Wg; Wu]
    b = layout.block
    # (N/B, 2, B, K): block q holds gate rows qB..qB+B-1 then up rows qB..qB+B-1
    return torch.stack([w_gate.reshape(n // b, b, k), w_up.reshape(n // b, b, k)], dim=1).reshape(2 * n, k).contiguous()


def unpack_gate_up(w_packed: torch.Tensor, *, kernel: SwigluKernel, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_gate_up`: (w_gate, w_up), each (N, K)."""
    layout = GateUpLayout(kernel=SwigluKernel(kernel), block=block)
    _check_packed(w_packed)
    gate, up = gate_up_from_packed(w_packed.t(), layout)  # rows of W are columns of W^T
    return gate.t(), up.t()


def gate_up_from_packed(y: torch.Tensor, layout: GateUpLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the last dim (2N) of a packed-weight GEMM result `y = x @ w_packed^T` into (gate, up), (..., N) each."""
    two_n = y.shape[-1]
    if two_n % 2:
        raise ValueError(f"packed dimension {two_n} must be even")
    n = two_n // 2
    layout.check_n(n)
    if layout.kernel is SwigluKernel.DUAL_PINGPONG:
        return y[..., :n], y[..., n:]
    b = layout.block
    pairs = y.reshape(*y.shape[:-1], n // b, 2, b)  # (..., N/B, {gate, up}, B)
    return pairs[..., 0, :].reshape(*y.shape[:-1], n), pairs[..., 1, :].reshape(*y.shape[:-1], n)


# --------------------------------------------------------------------------------------------------------------
# References (the CPU kernels and the test oracle)


def swiglu_gateup_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) with Hugging Face (N, K) weights: fp32 GEMMs and activation, one final rounding."""
    xf = x.float()
    gate = xf @ w_gate.float().t()  # (..., N)
    up = xf @ w_up.float().t()
    return (F.silu(gate) * up).to(x.dtype)


def gemm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T with b an (N, K) Linear weight: fp32 accumulate, one rounding to a's dtype."""
    return (a.float() @ b.float().t()).to(a.dtype)


def swiglu_mlp_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)): the composition of `swiglu_gateup_ref` (rounded h) and `gemm_ref`."""
    return gemm_ref(swiglu_gateup_ref(x, w_gate, w_up), w_down)


# --------------------------------------------------------------------------------------------------------------
# Tile configuration table (overrides the kernel library's heuristic per shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class TileRule:
    """Use `tile_config` for `kernel` at (n, k) when the token count m <= max_m."""

    kernel: SwigluKernel
    n: int
    k: int
    max_m: int
    tile_config: int

    def __post_init__(self) -> None:
        if min(self.n, self.k, self.max_m) < 1:
            raise ValueError(f"n, k and max_m must be >= 1, got n={self.n} k={self.k} max_m={self.max_m}")
        if self.tile_config < -1:
            raise ValueError(f"tile_config must be -1 (heuristic) or an index >= 0, got {self.tile_config}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TileTable:
    """Measured per-shape tile choices; a shape no rule covers uses the library's heuristic (-1).

    Rules for the same (kernel, n, k) are tried in increasing max_m; the table round-trips through JSON so a
    benchmark run can record it and a deployment can load it.
    """

    rules: tuple[TileRule, ...] = ()

    def __post_init__(self) -> None:
        if not all(isinstance(rule, TileRule) for rule in self.rules):
            raise ValueError("rules must be TileRule instances")
        object.__setattr__(self, "rules", tuple(sorted(self.rules, key=lambda r: (r.kernel, r.n, r.k, r.max_m))))

    def lookup(self, kernel: SwigluKernel, m: int, n: int, k: int) -> int:
        for rule in self.rules:
            if rule.kernel == kernel and rule.n == n and rule.k == k and m <= rule.max_m:
                return rule.tile_config
        return -1

    def to_json(self) -> str:
        return json.dumps([{**asdict(r), "kernel": int(r.kernel)} for r in self.rules], indent=1)

    @classmethod
    def from_json(cls, text: str) -> TileTable:
        return cls(rules=tuple(TileRule(**{**d, "kernel": SwigluKernel(d["kernel"])}) for d in json.loads(text)))

    @classmethod
    def load(cls, path: str | Path) -> TileTable:
        return cls.from_json(Path(path).read_text())


_NO_TILES = TileTable()


# --------------------------------------------------------------------------------------------------------------
# The torch.library ops


def _check_packed(w_packed: torch.Tensor) -> None:
    if w_packed.dim() != 2 or w_packed.shape[0] % 2:
        raise ValueError(f"w_packed must be (2N, K), got shape {tuple(w_packed.shape)}")


def _check_gateup_args(x: torch.Tensor, w_packed: torch.Tensor, kernel: int, block: int) -> GateUpLayout:
    if kernel not in tuple(SwigluKernel):
        raise ValueError(f"kernel must be one of {[int(k) for k in SwigluKernel]}, got {kernel}")
    layout = GateUpLayout(kernel=SwigluKernel(kernel), block=block)
    _check_packed(w_packed)
    if x.dim() < 1 or x.shape[-1] != w_packed.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} must end in K = {w_packed.shape[1]} (w_packed {tuple(w_packed.shape)})")
    if x.dtype not in _FLOAT_DTYPES or x.dtype != w_packed.dtype:
        raise ValueError(f"x ({x.dtype}) and w_packed ({w_packed.dtype}) must share one of {_FLOAT_DTYPES}")
    layout.check_n(w_packed.shape[0] // 2)
    return layout


def _check_down(h_features: int, x: torch.Tensor, w_down: torch.Tensor) -> None:
    if w_down.dim() != 2 or w_down.shape[1] != h_features:
        raise ValueError(f"w_down must be (H, N) with N = {h_features}, got {tuple(w_down.shape)}")
    if w_down.dtype != x.dtype:
        raise ValueError(f"w_down ({w_down.dtype}) must have x's dtype ({x.dtype})")


def _check_cuda(x: torch.Tensor, *weights: torch.Tensor) -> None:
    for t in (x, *weights):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"the CUDA kernels take bf16 tensors only, got {t.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"x's last dimension must be contiguous, got strides {x.stride()}")
    for w in weights:  # the launchers take weights as dense (rows, K) with no row stride
        if not w.is_contiguous():
            raise ValueError(f"weights must be contiguous (pack them once at load time), got strides {w.stride()}")
    device = x.device
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise NotImplementedError(
            f"the tilevox SwiGLU kernels are built for sm_90a (Hopper) only; {torch.cuda.get_device_name(device)} "
            f"has compute capability {torch.cuda.get_device_capability(device)}: run on CPU for the reference"
        )


def _launch_gateup(
    lib,
    x2: torch.Tensor,
    w_packed: torch.Tensor,
    out: torch.Tensor,
    layout: GateUpLayout,
    tile_config: int,
    stream: int,
) -> None:
    m, k = x2.shape
    n = out.shape[1]
    if layout.kernel is SwigluKernel.PACKED_EVT and layout.block != lib.tilevox_swiglu_packing_block():
        raise ValueError(
            f"w_packed was packed with block {layout.block}, but this kernel library packs with "
            f"{lib.tilevox_swiglu_packing_block()}: repack the weights"
        )
    is_dual = layout.kernel is SwigluKernel.DUAL_PINGPONG
    params = SwigluGateupParams(
        x=x2.data_ptr(),
        w_gate=w_packed.data_ptr() if is_dual else None,
        w_up=w_packed[n:].data_ptr() if is_dual else None,  # [Wg; Wu]: Wu starts at row N
        w_packed=None if is_dual else w_packed.data_ptr(),
        out=out.data_ptr(),
        m=m,
        n=n,
        k=k,
        ldx=x2.stride(0),
        ldo=out.stride(0),
        kernel=int(layout.kernel),
        tile_config=tile_config,
    )
    status = lib.tilevox_swiglu_gateup_launch(ctypes.byref(params), ctypes.c_void_p(stream))
    check_status(lib, status, f"tilevox_swiglu_gateup_launch(m={m}, n={n}, k={k}, kernel={int(layout.kernel)})")


@torch.library.custom_op("tilevox::swiglu_gateup", mutates_args=(), device_types="cpu")
def _swiglu_gateup_op(
    x: torch.Tensor, w_packed: torch.Tensor, kernel: int, block: int, tile_config: int
) -> torch.Tensor:
    layout = _check_gateup_args(x, w_packed, kernel, block)
    w_gate, w_up = unpack_gate_up(w_packed, kernel=layout.kernel, block=layout.block)
    return swiglu_gateup_ref(x, w_gate, w_up)


@_swiglu_gateup_op.register_kernel("cuda")
def _swiglu_gateup_cuda(
    x: torch.Tensor, w_packed: torch.Tensor, kernel: int, block: int, tile_config: int
) -> torch.Tensor:
    layout = _check_gateup_args(x, w_packed, kernel, block)
    _check_cuda(x, w_packed)
    lib = kernels_library()
    k, n = x.shape[-1], w_packed.shape[0] // 2
    x2 = x.reshape(-1, k)  # (M, K)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)  # (M, N)
    if x2.shape[0] > 0:
        with torch.cuda.device(x.device):
            _launch_gateup(lib, x2, w_packed, out, layout, tile_config, torch.cuda.current_stream(x.device).cuda_stream)
    return out.reshape(*x.shape[:-1], n)


@_swiglu_gateup_op.register_fake
def _swiglu_gateup_fake(
    x: torch.Tensor, w_packed: torch.Tensor, kernel: int, block: int, tile_config: int
) -> torch.Tensor:
    _check_gateup_args(x, w_packed, kernel, block)
    return x.new_empty((*x.shape[:-1], w_packed.shape[0] // 2))


@torch.library.custom_op("tilevox::swiglu_mlp", mutates_args=(), device_types="cpu")
def _swiglu_mlp_op(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_down: torch.Tensor,
    kernel: int,
    block: int,
    tile_config: int,
    down_tile_config: int,
) -> torch.Tensor:
    layout = _check_gateup_args(x, w_packed, kernel, block)
    _check_down(w_packed.shape[0] // 2, x, w_down)
    w_gate, w_up = unpack_gate_up(w_packed, kernel=layout.kernel, block=layout.block)
    return swiglu_mlp_ref(x, w_gate, w_up, w_down)


@_swiglu_mlp_op.register_kernel("cuda")
def _swiglu_mlp_cuda(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_down: torch.Tensor,
    kernel: int,
    block: int,
    tile_config: int,
    down_tile_config: int,
) -> torch.Tensor:
    layout = _check_gateup_args(x, w_packed, kernel, block)
    _check_down(w_packed.shape[0] // 2, x, w_down)
    _check_cuda(x, w_packed, w_down)
    lib = kernels_library()
    k, n, hidden = x.shape[-1], w_packed.shape[0] // 2, w_down.shape[0]
    x2 = x.reshape(-1, k)  # (M, K)
    m = x2.shape[0]
    h = torch.empty((m, n), dtype=x.dtype, device=x.device)  # (M, N) intermediate, never leaves the op
    out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)  # (M, H)
    if m > 0:
        with torch.cuda.device(x.device):
            stream = torch.cuda.current_stream(x.device).cuda_stream
            _launch_gateup(lib, x2, w_packed, h, layout, tile_config, stream)
            params = GemmBf16Params(
                a=h.data_ptr(),
                b=w_down.data_ptr(),
                d=out.data_ptr(),
                m=m,
                n=hidden,
                k=n,
                lda=h.stride(0),
                ldd=out.stride(0),
                tile_config=down_tile_config,
            )
            status = lib.tilevox_gemm_bf16_launch(ctypes.byref(params), ctypes.c_void_p(stream))
            check_status(lib, status, f"tilevox_gemm_bf16_launch(m={m}, n={hidden}, k={n})")
    return out.reshape(*x.shape[:-1], hidden)


@_swiglu_mlp_op.register_fake
def _swiglu_mlp_fake(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_down: torch.Tensor,
    kernel: int,
    block: int,
    tile_config: int,
    down_tile_config: int,
) -> torch.Tensor:
    _check_gateup_args(x, w_packed, kernel, block)
    _check_down(w_packed.shape[0] // 2, x, w_down)
    return x.new_empty((*x.shape[:-1], w_down.shape[0]))


def _tokens(x: torch.Tensor) -> int:
    m = 1
    for d in x.shape[:-1]:
        m *= d
    return m


def _tile(tiles: TileTable, layout: GateUpLayout, x: torch.Tensor, n: int) -> int:
    # Under torch.export the token count is symbolic: keep the library heuristic, which sees the real M.
    if tiles is _NO_TILES or not tiles.rules or isinstance(_tokens(x), torch.SymInt):
        return -1
    return tiles.lookup(layout.kernel, _tokens(x), n, x.shape[-1])


def swiglu_gateup(
    x: torch.Tensor, w_packed: torch.Tensor, *, layout: GateUpLayout, tiles: TileTable = _NO_TILES
) -> torch.Tensor:
    """h = silu(x Wg^T) * (x Wu^T) for x (..., K) and `w_packed` = pack_gate_up(Wg, Wu, layout); returns (..., N)."""
    n = w_packed.shape[0] // 2
    return torch.ops.tilevox.swiglu_gateup(x, w_packed, int(layout.kernel), layout.block, _tile(tiles, layout, x, n))


def swiglu_mlp(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_down: torch.Tensor,
    *,
    layout: GateUpLayout,
    tiles: TileTable = _NO_TILES,
    down_tile_config: int = -1,
) -> torch.Tensor:
    """(silu(x Wg^T) * (x Wu^T)) Wd^T for x (..., K), w_down (H, N) (HF down_proj); returns (..., H)."""
    n = w_packed.shape[0] // 2
    return torch.ops.tilevox.swiglu_mlp(
        x, w_packed, w_down, int(layout.kernel), layout.block, _tile(tiles, layout, x, n), down_tile_config
    )


class SwigluMLP(torch.nn.Module):
    """A bias-free SwiGLU MLP (Llama/Qwen `mlp`) holding its gate/up weights packed for one kernel."""

    def __init__(
        self,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
        *,
        layout: GateUpLayout,
        tiles: TileTable = _NO_TILES,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.tiles = tiles
        self.w_packed = torch.nn.Parameter(
            pack_gate_up(w_gate, w_up, kernel=layout.kernel, block=layout.block), requires_grad=False
        )
        self.w_down = torch.nn.Parameter(w_down.contiguous(), requires_grad=False)

    @classmethod
    def from_linears(
        cls,
        gate_proj: torch.nn.Linear,
        up_proj: torch.nn.Linear,
        down_proj: torch.nn.Linear,
        *,
        layout: GateUpLayout,
        tiles: TileTable = _NO_TILES,
    ) -> SwigluMLP:
        """Pack a Hugging Face MLP's bias-free gate_proj/up_proj/down_proj Linears (done once, at load time)."""
        for name, linear in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if linear.bias is not None:
                raise ValueError(f"{name} has a bias; the fused SwiGLU ops take bias-free projections")
        return cls(
            gate_proj.weight.detach(), up_proj.weight.detach(), down_proj.weight.detach(), layout=layout, tiles=tiles
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.w_packed, self.w_down, layout=self.layout, tiles=self.tiles)
