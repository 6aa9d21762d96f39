"""TensorRT lowering of a plan: each region of each batch bucket as ONNX (`tilevox build --onnx`).

Each bucket's step becomes one ONNX model per region: a region the plan runs on the megakernel is one
`tilevox::MegakernelRegion` plugin node carrying its compiled program (trt_plugins.onnx.megakernel_region; the
same compile as the megakernel backend: batch = the bucket, the model's cache as the region's state); a region
it keeps conventional is standard ONNX ops (opset 18), written directly from the network's `decoder_view()`
(the weights the region compiler reads, so both lowerings use one source), with each MLP a
`tilevox::swiglu_mlp` plugin node (Kernel-1 [Wg; Wu] packing). A direct emitter, not torch.onnx.export of the
eager step: the eager step mutates the cache in place through advanced indexing and calls the megakernel
through a handle to a live launch, neither of which exports; the emitter states the step's dataflow and its
KV-cache contract explicitly.

Covered: Llasa's `decoder_step`, Qwen3-TTS's `talker_step` and `code_predictor_loop`, NH-TTS's
`nh_decoder_step`; a plan that cuts one of these decoder steps at layer boundaries lowers each bucket's step
as one file of chained pieces with the same I/O (export_cut_step: a MegakernelRegion node per megakernel piece,
each with its own `<region>.piece<i>.error` output). OnnxLoweringError names anything else.
A plan's executor regions (Qwen3-TTS `codec_decode`) are the executor's, not lowered: export_plan skips them.

Shapes: B = the bucket's batch; dtype = the model's; L layers, S cache slots, Hkv kv heads, T cache length,
D head dim of the region's network; V its head's rows. Every file's caches: k_cache, v_cache (L, S, Hkv, T, D)
in, k_cache_out, v_cache_out out: the caches with this step's keys and values written at
[layer, slots[b], :, positions[b]] (bind them to the same memory as the inputs for an in-place step; the
MegakernelRegion plugin copies each state input to its output, then runs in place there). Keys past a row's
own position are masked (their contents must be finite); rows are independent; the caller advances positions.
Megakernel form only: `<region>.error` (8,) int32, the kernel's error words (all zero when clean).

`decoder_step_b<B>.onnx` (Llasa):
  inputs   tokens (B,) int64; positions (B,) int64: each row's new position (its cache length);
           slots (B,) int64: each row's cache slot; k_cache, v_cache.
  outputs  logits (B, V); k_cache_out, v_cache_out.
`talker_step_b<B>.onnx` (Qwen3-TTS Talker.forward_tokens of one position per row; S x T: the model's talker
KVCache):
  inputs   x_in (B, hidden): the row's summed text + codec embeddings; positions, slots (B,) int64 as above;
           k_cache, v_cache.
  outputs  hidden (B, hidden): the final-norm hidden state (the code predictor's input); logits (B, V): the
           codec head's; k_cache_out, v_cache_out.
  The megakernel region ends with SAMPLE_EMBED; as in its backend the host samples the logits, so the
  node's sampling inputs are greedy constants and its token output is not a graph output.
`code_predictor_loop_b<B>.onnx` (Qwen3-TTS CodePredictor.predict of one frame, Q codebooks):
  inputs   hidden (B, talker hidden): the talker's `hidden`; code0_embedding (B, talker hidden): codebook 0's
           code through the talker's codec table; megakernel form only, the on-device sampling inputs as
           MegakernelCodePredictorLoop binds them (executor.megakernel_inputs.sampling_inputs):
           temperature (B,) fp32, top_k (B,) int64, top_p (B,) fp32, seed (B,) int64, rng_offset (B,) int64
           (head j of row b draws at counter rng_offset[b] + j; temperature 0 is greedy);
           k_cache, v_cache (L, B, Hkv, Q, D): the frame's cache (slot b = row b; every position is
           written before it is read, so any finite contents do).
  outputs  codes (B, Q-1) int64: codebooks 1..Q-1; logits (B, Q-1, V): each head's logits given the codes
           chosen before it; k_cache_out, v_cache_out.
  The conventional form is GREEDY ONLY (codes = ArgMax of each head, first of equal maxima): SAMPLE_EMBED's
  counter-based draw has no exact standard-op form, so that file has no sampling inputs, says so in its
  graph doc_string and carries the model property `tilevox.sampling` = `greedy`. A plan whose conventional
  predictor serves sampled streams needs the megakernel form (or the PyTorch path) for them.
  The megakernel form is one MegakernelRegion node (positions 0 and slots 0..B-1 as constants) whose
  per-head outputs Unsqueeze/Concat pack into codes and logits.
`nh_decoder_step_b<B>.onnx` (NH-TTS NhTtsNetwork.step of one position per row; S, T and Tt: the model's
max_streams x rows_per_stream, max_seq_len and max_text_len):
  inputs   x_in (B, hidden): the row's summed codebook embeddings (decoder.embeddings); positions, slots
           (B,) int64 as above; text_lengths (B,) int64: row b attends encoder positions [0, text_lengths[b]) (>= 1);
           k_cache, v_cache; cross_k_cache, cross_v_cache (L, S, Hc_kv, Tt, Dc): the encoder keys/values
           (NhDecoderCache.cross_k / cross_v), read only.
  outputs  logits (B, C x V): channel c's logits at [c V, (c + 1) V); k_cache_out, v_cache_out.
Build time only. Imports: numpy, onnx, torch, models, engine_builder, trt_plugins.onnx.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from tilevox.engine_builder.composition import Backend
from tilevox.engine_builder.plan import Plan
from tilevox.engine_builder.regions.compiler import CompiledRegion, compile_region
from tilevox.engine_builder.regions.spec import TilingConfig, region_spec
from tilevox.executor.megakernel_inputs import sampling_inputs
from tilevox.models.decoder_view import DecoderView, ModelFamily, decoder_view
from tilevox.models.region_backends import (
    CODE_PREDICTOR_LOOP,
    DECODER_STEP,
    NH_DECODER_STEP,
    TALKER_STEP,
    region_module,
)
from tilevox.models.sampling import SamplingParams
from tilevox.trt_plugins.megakernel.instructions import ERROR_WORDS, BufferKind
from tilevox.trt_plugins.onnx.export import check_plugin_nodes
from tilevox.trt_plugins.onnx.megakernel_region import (
    ERROR_OUTPUT,
    megakernel_region_node,
    node_io_buffers,
    onnx_dtype,
)
from tilevox.trt_plugins.onnx.schemas import register_schemas
from tilevox.trt_plugins.registry import PLUGINS

__all__ = [
    "OPSET",
    "CacheLayout",
    "OnnxLoweringError",
    "export_code_predictor_loop",
    "export_cut_step",
    "export_decoder_step",
    "export_nh_decoder_step",
    "export_plan",
    "export_region",
    "export_talker_step",
    "lowerable_regions",
    "save_onnx",
]

OPSET = 18
log = logging.getLogger(__name__)
_MLP = PLUGINS["tilevox::swiglu_mlp"]
_ONNX_FLOAT = {
    torch.float32: TensorProto.FLOAT,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.float16: TensorProto.FLOAT16,
}
_SAMPLING_TYPES = {torch.float32: TensorProto.FLOAT, torch.int64: TensorProto.INT64}
_CACHE_OUT = ("k_cache_out", "v_cache_out")
_EXTERNAL_DATA_BYTES = 1 << 30  # protobuf caps a message at 2 GiB: larger models keep weights beside the file


class OnnxLoweringError(ValueError):
    """A plan, region or model the ONNX lowering does not cover (the message says which and why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheLayout:
    """The KV cache the exported step reads and writes: `num_slots` streams x `cache_len` positions (NH-TTS:
    and cross caches of `text_len` encoder positions per slot)."""

    num_slots: int
    cache_len: int
    text_len: int | None = None  # NH-TTS: encoder positions per slot of the cross caches; else None

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.cache_len < 1:
            raise OnnxLoweringError(f"cache needs >= 1 slot and position, got {self.num_slots}, {self.cache_len}")
        if self.text_len is not None and self.text_len < 1:
            raise OnnxLoweringError(f"the cross caches need >= 1 encoder position, got {self.text_len}")


def _tensor(name: str, t: torch.Tensor) -> TensorProto:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().tobytes()
        return helper.make_tensor(name, TensorProto.BFLOAT16, list(t.shape), raw, raw=True)
    return onnx.numpy_helper.from_array(t.numpy(), name)


class _Graph:
    """Nodes, initializers and fresh names for one exported graph."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []  # types of plugin outputs that are no graph outputs
        self._names: set[str] = set()
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def init(self, name: str, value: torch.Tensor | np.ndarray) -> str:
        if name in self._names:
            raise OnnxLoweringError(f"initializer {name!r} defined twice")
        self._names.add(name)
        tensor = torch.from_numpy(np.asarray(value)) if isinstance(value, np.ndarray) else value
        self.initializers.append(_tensor(name, tensor))
        return name

    def weight(self, name: str, value: torch.Tensor) -> str:
        """An initializer read by several steps of one graph (the predictor's micro-steps): defined once."""
        return name if name in self._names else self.init(name, value)

    def const(self, values, dtype=np.int64) -> str:
        return self.init(self.fresh("const"), np.asarray(values, dtype=dtype))

    def op(self, op_type: str, *inputs: str, out: str | None = None, domain: str = "", **attrs) -> str:
        out = out or self.fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], domain=domain, **attrs))
        return out


def _rmsnorm(g: _Graph, x: str, weight: str, eps: float, dtype: int, *, out: str | None = None) -> str:
    """models.layers.RMSNorm: fp32 statistics, rounded to the model dtype before the weight."""
    x32 = g.op("Cast", x, to=TensorProto.FLOAT)
    mean = g.op("ReduceMean", g.op("Mul", x32, x32), g.const([-1]), keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean, g.const(eps, np.float32))))
    return g.op("Mul", weight, g.op("Cast", g.op("Mul", x32, inv), to=dtype), out=out)


def _rope(g: _Graph, x: str, cos: str, sin: str, half: int) -> str:
    """x * cos + rotate_half(x) * sin over the last dim (as models.llama)."""
    x1 = g.op("Slice", x, g.const([0]), g.const([half]), g.const([-1]))
    x2 = g.op("Slice", x, g.const([half]), g.const([2 * half]), g.const([-1]))
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def _linear(g: _Graph, x: str, name: str, weight: torch.Tensor) -> str:
    """x @ weight^T with the transposed weight stored once as an initializer."""
    return g.op("MatMul", x, g.weight(name, weight.detach().t().contiguous()))


def _value(name: str, elem_type: int, shape: Sequence[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, list(shape))


def _cache_values(view: DecoderView, cache: CacheLayout, dtype: int) -> tuple[list, list]:
    """(k_cache, v_cache) inputs and (k_cache_out, v_cache_out) outputs of shape (L, S, Hkv, T, D)."""
    shape = [view.num_layers, cache.num_slots, view.num_kv_heads, cache.cache_len, view.head_dim]
    inputs = [_value("k_cache", dtype, shape), _value("v_cache", dtype, shape)]
    return inputs, [_value("k_cache_out", dtype, shape), _value("v_cache_out", dtype, shape)]


def _row_values(batch: int) -> list[onnx.ValueInfoProto]:
    return [_value("positions", TensorProto.INT64, [batch]), _value("slots", TensorProto.INT64, [batch])]


@dataclass(frozen=True, slots=True)
class _Rows:
    """Graph values of one step's rows: RoPE cos/sin (B, 1, D), the additive key mask (B, 1, 1, T), and the
    ScatterND index columns (B, Hkv, 1) of slot, kv head and position (the layer column is set per layer)."""

    cos: str
    sin: str
    mask: str
    slot_idx: str
    head_idx: str
    pos_idx: str
    bh1: str


def _rows(g: _Graph, view: DecoderView, positions: str, slots: str, batch: int, cache_len: int, dtype: int) -> _Rows:
    # RoPE in fp32 as the models compute it: angles = positions * inv_freq, duplicated over both halves
    freqs = g.op(
        "Mul",
        g.op("Unsqueeze", g.op("Cast", positions, to=TensorProto.FLOAT), g.const([1])),
        g.weight("inv_freq", view.inv_freq),
    )
    angles = g.op("Concat", freqs, freqs, axis=-1)  # (B, D)
    cos = g.op("Unsqueeze", g.op("Cast", g.op("Cos", angles), to=dtype), g.const([1]))  # (B, 1, D)
    sin = g.op("Unsqueeze", g.op("Cast", g.op("Sin", angles), to=dtype), g.const([1]))
    # key s of row b is visible iff s <= positions[b]: an additive fp32 mask (B, 1, 1, T)
    visible = g.op("LessOrEqual", g.const(np.arange(cache_len)[None, :]), g.op("Unsqueeze", positions, g.const([1])))
    mask = g.op("Where", visible, g.const(0.0, np.float32), g.const(-np.inf, np.float32))
    mask = g.op("Unsqueeze", mask, g.const([1, 2]))
    kv_heads = view.num_kv_heads
    bh1 = g.const([batch, kv_heads, 1])
    per_row = lambda t: g.op("Expand", g.op("Unsqueeze", t, g.const([1, 2])), bh1)  # noqa: E731
    head_idx = g.op("Expand", g.const(np.arange(kv_heads).reshape(1, kv_heads, 1)), bh1)
    return _Rows(cos, sin, mask, per_row(slots), head_idx, per_row(positions), bh1)


def _attend(g: _Graph, q: str, keys: str, values: str, mask: str, scale: str, shape: tuple[int, ...], dtype: int):
    """Grouped-query attention of q (B, H, D) over keys/values (B, Hkv, T, D) with an additive fp32 mask
    broadcastable to (B, Hkv, G, T); query head h uses kv head h // G. Returns (B, H * D)."""
    batch, heads, kv_heads, dim = shape
    qg = g.op("Reshape", q, g.const([batch, kv_heads, heads // kv_heads, dim]))
    scores = g.op("Mul", g.op("MatMul", qg, g.op("Transpose", keys, perm=[0, 1, 3, 2])), scale)
    probs = g.op("Softmax", g.op("Add", g.op("Cast", scores, to=TensorProto.FLOAT), mask), axis=-1)
    attn = g.op("MatMul", g.op("Cast", probs, to=dtype), values)  # (B, Hkv, G, D)
    return g.op("Reshape", attn, g.const([batch, heads * dim]))


@dataclass(frozen=True, slots=True)
class _Cross:
    """NH-TTS: the cross caches (L, S, Hc_kv, Tt, Dc), read only, and each row's additive text mask (B, 1, 1, Tt)."""

    k_cache: str
    v_cache: str
    mask: str


def _layers(
    g: _Graph,
    view: DecoderView,
    x: str,
    rows: _Rows,
    slots: str,
    caches: tuple[str, str],
    *,
    batch: int,
    dtype: int,
    kv_only_last: bool = False,
    cache_out: tuple[str, str] | None = None,
    cross: _Cross | None = None,
    first: int = 0,
    stop: int | None = None,
) -> tuple[str, str, str]:
    """One new position per row through layers [first, stop) (None: the last; pre-norm attention with optional
    per-head q/k RMSNorm, then the SwiGLU MLP as a swiglu_mlp node); each layer's keys/values are written into
    the caches before attention reads them. kv_only_last: the last layer only appends its keys/values (x is
    returned as it entered it). With `cross` each layer attends its rows' encoder keys/values between
    self-attention and the MLP (no RoPE). Returns (x, k_cache, v_cache); cache_out names the last layer's
    caches."""
    heads, kv_heads, dim = view.num_heads, view.num_kv_heads, view.head_dim
    half, eps = dim // 2, view.rms_norm_eps
    scale = dim**-0.5 if view.attn_scale is None else view.attn_scale
    scale_c = g.weight("attn_scale", torch.tensor(scale, dtype=view.dtype))  # scores are scaled in the model dtype
    k_cache, v_cache = caches
    stop = view.num_layers if stop is None else stop
    for i in range(first, stop):
        layer = view.layers[i]
        p, last = f"layers.{i}", i == stop - 1
        h = _rmsnorm(g, x, g.weight(f"{p}.ln1", layer.ln1), eps, dtype)
        q = g.op("Reshape", _linear(g, h, f"{p}.w_q.T", layer.w_q), g.const([batch, heads, dim]))
        k = g.op("Reshape", _linear(g, h, f"{p}.w_k.T", layer.w_k), g.const([batch, kv_heads, dim]))
        v = g.op("Reshape", _linear(g, h, f"{p}.w_v.T", layer.w_v), g.const([batch, kv_heads, dim]))
        if layer.qk_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
            q = _rmsnorm(g, q, g.weight(f"{p}.q_norm", layer.qk_norm[0]), eps, dtype)
            k = _rmsnorm(g, k, g.weight(f"{p}.k_norm", layer.qk_norm[1]), eps, dtype)
        q, k = _rope(g, q, rows.cos, rows.sin, half), _rope(g, k, rows.cos, rows.sin, half)
        layer_idx = g.op("Expand", g.const([[[i]]]), rows.bh1)
        index = g.op("Concat", layer_idx, rows.slot_idx, rows.head_idx, rows.pos_idx, axis=-1)  # (B, Hkv, 4)
        k_out, v_out = cache_out if (last and cache_out is not None) else (None, None)
        k_cache = g.op("ScatterND", k_cache, index, k, out=k_out)
        v_cache = g.op("ScatterND", v_cache, index, v, out=v_out)
        if last and kv_only_last:
            break
        keys = g.op("Gather", g.op("Gather", k_cache, g.const(i), axis=0), slots, axis=0)  # (B, Hkv, T, D)
        values = g.op("Gather", g.op("Gather", v_cache, g.const(i), axis=0), slots, axis=0)
        attn = _attend(g, q, keys, values, rows.mask, scale_c, (batch, heads, kv_heads, dim), dtype)
        x = g.op("Add", x, _linear(g, attn, f"{p}.w_o.T", layer.w_o))
        if cross is not None:
            if layer.cross is None or view.cross is None:
                raise OnnxLoweringError(f"layer {i} has no cross-attention weights")
            cs = view.cross
            h = _rmsnorm(g, x, g.weight(f"{p}.cross.ln", layer.cross.ln), eps, dtype)
            q = g.op(
                "Reshape",
                _linear(g, h, f"{p}.cross.w_q.T", layer.cross.w_q),
                g.const([batch, cs.num_heads, cs.head_dim]),
            )
            keys = g.op("Gather", g.op("Gather", cross.k_cache, g.const(i), axis=0), slots, axis=0)  # (B, Hc, Tt, Dc)
            values = g.op("Gather", g.op("Gather", cross.v_cache, g.const(i), axis=0), slots, axis=0)
            shape = (batch, cs.num_heads, cs.num_kv_heads, cs.head_dim)
            attn = _attend(g, q, keys, values, cross.mask, scale_c, shape, dtype)
            x = g.op("Add", x, _linear(g, attn, f"{p}.cross.w_o.T", layer.cross.w_o))
        h = _rmsnorm(g, x, g.weight(f"{p}.ln2", layer.ln2), eps, dtype)
        w_packed = g.weight(f"{p}.mlp.w_packed", torch.cat([layer.w_gate, layer.w_up], dim=0))
        w_down = g.weight(f"{p}.mlp.w_down", layer.w_down)
        mlp = g.op(
            _MLP.name,
            h,
            w_packed,
            w_down,
            domain=_MLP.namespace,
            kernel=1,  # Kernel-1 dual Pingpong: w_packed = [Wg; Wu]
            block=0,
            tile_config=-1,
            down_tile_config=-1,
            plugin_version=_MLP.version,
            plugin_namespace=_MLP.namespace,
        )
        x = g.op("Add", x, mlp)
    return x, k_cache, v_cache


def _conventional_llama_step(g: _Graph, view: DecoderView, batch: int, cache: CacheLayout, dtype: int) -> None:
    x = g.op("Gather", g.init("embed_tokens", view.embed_tables[0]), "tokens", axis=0)  # (B, hidden)
    rows = _rows(g, view, "positions", "slots", batch, cache.cache_len, dtype)
    x, _, _ = _layers(g, view, x, rows, "slots", ("k_cache", "v_cache"), batch=batch, dtype=dtype, cache_out=_CACHE_OUT)
    x = _rmsnorm(g, x, g.init("final_norm", view.final_norm), view.rms_norm_eps, dtype)
    g.op("MatMul", x, g.init("lm_head.T", view.heads[0].detach().t().contiguous()), out="logits")


def _conventional_talker_step(g: _Graph, view: DecoderView, batch: int, cache: CacheLayout, dtype: int) -> None:
    rows = _rows(g, view, "positions", "slots", batch, cache.cache_len, dtype)
    x, _, _ = _layers(
        g, view, "x_in", rows, "slots", ("k_cache", "v_cache"), batch=batch, dtype=dtype, cache_out=_CACHE_OUT
    )
    hidden = _rmsnorm(g, x, g.init("final_norm", view.final_norm), view.rms_norm_eps, dtype, out="hidden")
    g.op("MatMul", hidden, g.init("codec_head.T", view.heads[0].detach().t().contiguous()), out="logits")


def _nh_cross(g: _Graph, cache: CacheLayout) -> _Cross:
    """The cross caches (graph inputs) and each row's text mask: encoder position s of row b is visible iff
    s < text_lengths[b]."""
    visible = g.op("Less", g.const(np.arange(cache.text_len)[None, :]), g.op("Unsqueeze", "text_lengths", g.const([1])))
    mask = g.op("Where", visible, g.const(0.0, np.float32), g.const(-np.inf, np.float32))
    return _Cross("cross_k_cache", "cross_v_cache", g.op("Unsqueeze", mask, g.const([1, 2])))


def _nh_inputs(view: DecoderView, batch: int, cache: CacheLayout, dtype: int) -> list[onnx.ValueInfoProto]:
    """An NH-TTS step's inputs (module docstring), the self caches' included."""
    if cache.text_len is None or view.cross is None:
        raise OnnxLoweringError("an NH-TTS step needs the cross caches' text_len (CacheLayout.text_len)")
    cs = view.cross
    cross_shape = [view.num_layers, cache.num_slots, cs.num_kv_heads, cache.text_len, cs.head_dim]
    return [
        _value("x_in", dtype, [batch, view.input_size]),
        *_row_values(batch),
        _value("text_lengths", TensorProto.INT64, [batch]),
        *_cache_values(view, cache, dtype)[0],
        _value("cross_k_cache", dtype, cross_shape),
        _value("cross_v_cache", dtype, cross_shape),
    ]


def _conventional_nh_step(g: _Graph, view: DecoderView, batch: int, cache: CacheLayout, dtype: int) -> None:
    rows = _rows(g, view, "positions", "slots", batch, cache.cache_len, dtype)
    cross = _nh_cross(g, cache)
    x, _, _ = _layers(
        g,
        view,
        "x_in",
        rows,
        "slots",
        ("k_cache", "v_cache"),
        batch=batch,
        dtype=dtype,
        cache_out=_CACHE_OUT,
        cross=cross,
    )
    x = _rmsnorm(g, x, g.init("final_norm", view.final_norm), view.rms_norm_eps, dtype)
    g.op("MatMul", x, g.init("logits_dense.T", view.heads[0].detach().t().contiguous()), out="logits")


def _project(g: _Graph, view: DecoderView, x: str) -> str:
    """The predictor's talker-width -> predictor-width input projection (a Linear with bias), if any."""
    if view.projection is None:
        return x
    weight, bias = view.projection
    return g.op("Add", _linear(g, x, "projection.weight.T", weight), g.weight("projection.bias", bias))


def _conventional_predictor_loop(g: _Graph, view: DecoderView, batch: int, dtype: int) -> None:
    """Greedy: micro-step m at position m (causal attention makes it equal to the reference's two-token
    prefill then single steps); head j's code is the ArgMax (first of equal maxima) of its logits."""
    positions_total = len(view.heads) + 1
    slots = g.const(np.arange(batch))
    caches = ("k_cache", "v_cache")
    x_in, codes, logits = "hidden", [], []
    for m in range(positions_total):
        rows = _rows(g, view, g.const(np.full(batch, m)), slots, batch, positions_total, dtype)
        last = m == positions_total - 1
        x, *caches = _layers(
            g,
            view,
            _project(g, view, x_in),
            rows,
            slots,
            tuple(caches),
            batch=batch,
            dtype=dtype,
            kv_only_last=m == 0,  # position 0 (the talker hidden) feeds no head
            cache_out=_CACHE_OUT if last else None,
        )
        if m == 0:
            x_in = "code0_embedding"
            continue
        head = m - 1
        xn = _rmsnorm(g, x, g.weight("final_norm", view.final_norm), view.rms_norm_eps, dtype)
        head_logits = _linear(g, xn, f"heads.{head}.T", view.heads[head])  # (B, V)
        code = g.op("ArgMax", head_logits, axis=-1, keepdims=0)  # (B,) int64
        logits.append(g.op("Unsqueeze", head_logits, g.const([1])))
        codes.append(g.op("Unsqueeze", code, g.const([1])))
        if not last:  # code head+1 through table `head` is the next position's input
            x_in = g.op("Gather", g.weight(f"embed_tables.{head}", view.embed_tables[head]), code, axis=0)
    g.op("Concat", *codes, axis=1, out="codes")
    g.op("Concat", *logits, axis=1, out="logits")


def _megakernel_region(
    g: _Graph,
    name: str,
    region: CompiledRegion,
    *,
    graph_inputs: set[str],
    constants: dict[str, torch.Tensor],
    renamed: dict[str, str],
    bound: dict[str, str] | None = None,
) -> tuple[list[str], onnx.ValueInfoProto]:
    """One MegakernelRegion node: weights and `constants` as initializers, `graph_inputs` bound to the graph's
    inputs of the same name, `bound` buffers to the graph values it names (an earlier piece's outputs);
    outputs named by `renamed`, else `<name>.<buffer>`. Returns (the node's output names, in the order of
    node_io_buffers' outputs, then the error output; the error output's value info)."""
    program = region.program
    in_specs, out_specs = node_io_buffers(program)
    bound = bound or {}
    names = []
    for spec in in_specs:
        if spec.kind is BufferKind.WEIGHT:
            names.append(g.init(f"{name}.{spec.name}", region.weights[spec.name]))
        elif spec.name in bound:
            names.append(bound[spec.name])
        elif spec.name in graph_inputs:
            names.append(spec.name)
        elif spec.name in constants:
            names.append(g.init(f"{name}.{spec.name}", constants[spec.name]))
        else:
            raise OnnxLoweringError(f"{name}: no graph value for region buffer {spec.name!r} ({spec.kind.name})")
    outputs = [renamed.get(s.name, f"{name}.{s.name}") for s in out_specs] + [f"{name}.{ERROR_OUTPUT}"]
    g.value_info += [  # the plugin schema infers no types: state them for the nodes that read these
        _value(out, onnx_dtype(s.dtype), s.shape) for s, out in zip(out_specs, outputs) if s.name not in renamed
    ]
    g.nodes.append(megakernel_region_node(program, names, outputs, name=f"{name}.megakernel"))
    return outputs, _value(outputs[-1], TensorProto.INT32, [ERROR_WORDS])


def _greedy(batch: int) -> dict[str, torch.Tensor]:
    """The decoder regions end with SAMPLE_EMBED; the host samples the logits, the region's draw is unused."""
    return sampling_inputs([SamplingParams.greedy()] * batch, seeds=[0] * batch)


def _checked_view(module: torch.nn.Module, family: ModelFamily, what: str) -> tuple[DecoderView, int]:
    view = decoder_view(module)
    if view.family is not family:
        raise OnnxLoweringError(f"{what} lowers {family.value} networks; got a {view.family.value} network")
    if view.dtype not in _ONNX_FLOAT:
        raise OnnxLoweringError(f"dtype {view.dtype} has no ONNX lowering here (fp32, bf16, fp16)")
    return view, _ONNX_FLOAT[view.dtype]


def _check_batch(batch: int, cache: CacheLayout) -> None:
    if batch < 1 or batch > cache.num_slots:
        raise OnnxLoweringError(f"batch {batch} must be in [1, {cache.num_slots}] (the cache's slots)")


def _finish(
    g: _Graph, name: str, inputs: list, outputs: list, *, doc: str = "", props: dict[str, str] | None = None
) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.initializers, doc_string=doc, value_info=g.value_info)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(_MLP.namespace, 1)],
        producer_name="tilevox",
    )
    model.ir_version = 9  # onnx 1.15+ readers; TensorRT 10's parser reads IR 9
    if props:
        helper.set_model_props(model, props)
    check_plugin_nodes(model)
    if _weight_bytes(model) < _EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(model, full_check=True)  # larger models are checked from their file (save_onnx)
    return model


def _kind(megakernel: bool) -> str:
    return "megakernel" if megakernel else "conventional"


def _compile_cached(network, name: str, batch: int, cache: CacheLayout, **options):
    """The region compile of `name` for a bucket over `cache` (the same arguments as its megakernel backend)."""
    return compile_region(
        network,
        region_spec(name),
        batch_size=batch,
        max_context=cache.cache_len,
        num_cache_slots=cache.num_slots,
        cache_len=cache.cache_len,
        **options,
    )


def export_decoder_step(
    llama: torch.nn.Module,
    *,
    batch: int,
    cache: CacheLayout,
    megakernel: bool,
    tiling: TilingConfig | None = None,
    num_sms: int = 132,
) -> onnx.ModelProto:
    """One Llama decoder step of `batch` rows as ONNX (module docstring: I/O contract), fully checked.
    megakernel: the step is one MegakernelRegion node (compiled for `num_sms` queues: the GPU's SM count,
    132 on the H200); else standard ops with swiglu_mlp plugin nodes."""
    view, dtype = _checked_view(llama, ModelFamily.LLAMA, "export_decoder_step")
    _check_batch(batch, cache)
    register_schemas()
    g = _Graph()
    cache_in, cache_out = _cache_values(view, cache, dtype)
    inputs = [_value("tokens", TensorProto.INT64, [batch]), *_row_values(batch), *cache_in]
    outputs = [_value("logits", dtype, [batch, view.heads[0].shape[0]]), *cache_out]
    if megakernel:
        region = _compile_cached(llama, DECODER_STEP, batch, cache, tiling=tiling, num_sms=num_sms)
        _, error = _megakernel_region(
            g,
            DECODER_STEP,
            region,
            graph_inputs={"tokens", "positions", "slots", "k_cache", "v_cache"},
            constants=_greedy(batch),
            renamed={"k_cache": "k_cache_out", "v_cache": "v_cache_out", "s0.logits": "logits"},
        )
        outputs.append(error)
    else:
        _conventional_llama_step(g, view, batch, cache, dtype)
    return _finish(g, f"{DECODER_STEP}_b{batch}_{_kind(megakernel)}", inputs, outputs)


def export_talker_step(
    talker: torch.nn.Module,
    *,
    batch: int,
    cache: CacheLayout,
    megakernel: bool,
    tiling: TilingConfig | None = None,
    num_sms: int = 132,
) -> onnx.ModelProto:
    """One Qwen3-TTS talker step (Talker.forward_tokens of one new position per row) of `batch` rows as ONNX
    (module docstring: I/O contract), fully checked; megakernel as in export_decoder_step (the compile of
    executor.megakernel.MegakernelTalkerStep)."""
    view, dtype = _checked_view(talker, ModelFamily.QWEN3_TTS_TALKER, "export_talker_step")
    _check_batch(batch, cache)
    register_schemas()
    g = _Graph()
    cache_in, cache_out = _cache_values(view, cache, dtype)
    inputs = [_value("x_in", dtype, [batch, view.input_size]), *_row_values(batch), *cache_in]
    outputs = [
        _value("hidden", dtype, [batch, view.hidden_size]),
        _value("logits", dtype, [batch, view.heads[0].shape[0]]),
        *cache_out,
    ]
    if megakernel:
        region = _compile_cached(talker, TALKER_STEP, batch, cache, tiling=tiling, num_sms=num_sms)
        _, error = _megakernel_region(
            g,
            TALKER_STEP,
            region,
            graph_inputs={"x_in", "positions", "slots", "k_cache", "v_cache"},
            constants=_greedy(batch),
            renamed={"k_cache": "k_cache_out", "v_cache": "v_cache_out", "s0.logits": "logits", "x_normed": "hidden"},
        )
        outputs.append(error)
    else:
        _conventional_talker_step(g, view, batch, cache, dtype)
    return _finish(g, f"{TALKER_STEP}_b{batch}_{_kind(megakernel)}", inputs, outputs)


def export_nh_decoder_step(
    network: torch.nn.Module,
    *,
    batch: int,
    cache: CacheLayout,
    megakernel: bool,
    tiling: TilingConfig | None = None,
    num_sms: int = 132,
) -> onnx.ModelProto:
    """One NH-TTS decoder step (NhTtsNetwork.step of one new position per row, from the summed codebook
    embeddings) of `batch` rows as ONNX (module docstring: I/O contract), fully checked; megakernel as in
    export_decoder_step (the compile of executor.megakernel.MegakernelNhDecoderStep)."""
    view, dtype = _checked_view(network, ModelFamily.NH_TTS, "export_nh_decoder_step")
    _check_batch(batch, cache)
    inputs = _nh_inputs(view, batch, cache, dtype)
    register_schemas()
    g = _Graph()
    cache_out = _cache_values(view, cache, dtype)[1]
    outputs = [_value("logits", dtype, [batch, view.heads[0].shape[0]]), *cache_out]
    if megakernel:
        region = _compile_cached(
            network, NH_DECODER_STEP, batch, cache, tiling=tiling, num_sms=num_sms, cross_cache_len=cache.text_len
        )
        _, error = _megakernel_region(
            g,
            NH_DECODER_STEP,
            region,
            graph_inputs={i.name for i in inputs},
            constants={},
            renamed={"k_cache": "k_cache_out", "v_cache": "v_cache_out", "s0.logits": "logits"},
        )
        outputs.append(error)
    else:
        _conventional_nh_step(g, view, batch, cache, dtype)
    return _finish(g, f"{NH_DECODER_STEP}_b{batch}_{_kind(megakernel)}", inputs, outputs)


def export_code_predictor_loop(
    predictor: torch.nn.Module,
    *,
    batch: int,
    megakernel: bool,
    tiling: TilingConfig | None = None,
    num_sms: int = 132,
) -> onnx.ModelProto:
    """The Qwen3-TTS code-predictor loop of one frame (CodePredictor.predict) for `batch` rows as ONNX (module
    docstring: I/O contract), fully checked. megakernel: one MegakernelRegion node sampling every head on the
    device (the compile of MegakernelCodePredictorLoop), its per-head outputs packed by Unsqueeze/Concat;
    conventional: standard ops, GREEDY ONLY (ArgMax per head; no sampling inputs, model property
    `tilevox.sampling` = `greedy`): the counter-based draw of SAMPLE_EMBED has no exact standard-op form."""
    view, dtype = _checked_view(predictor, ModelFamily.QWEN3_TTS_CODE_PREDICTOR, "export_code_predictor_loop")
    if batch < 1:
        raise OnnxLoweringError(f"batch must be >= 1, got {batch}")
    register_schemas()
    g = _Graph()
    num_heads, vocab = len(view.heads), view.heads[0].shape[0]
    frame = CacheLayout(num_slots=batch, cache_len=num_heads + 1)  # positions 0..Q-1 of rows 0..B-1
    cache_in, cache_out = _cache_values(view, frame, dtype)
    inputs = [
        _value("hidden", dtype, [batch, view.input_size]),
        _value("code0_embedding", dtype, [batch, view.input_size]),
    ]
    outputs = [
        _value("codes", TensorProto.INT64, [batch, num_heads]),
        _value("logits", dtype, [batch, num_heads, vocab]),
    ]
    props = None
    if megakernel:
        region = compile_region(
            predictor, region_spec(CODE_PREDICTOR_LOOP), batch_size=batch, tiling=tiling, num_sms=num_sms
        )
        sampling = _greedy(batch)
        inputs += [_value(n, _SAMPLING_TYPES[t.dtype], [batch]) for n, t in sampling.items()]
        names, error = _megakernel_region(
            g,
            CODE_PREDICTOR_LOOP,
            region,
            graph_inputs={"hidden", "code0_embedding", "k_cache", "v_cache", *sampling},
            constants={
                "positions": torch.zeros(batch, dtype=torch.int64),
                "slots": torch.arange(batch, dtype=torch.int64),
            },
            renamed={"k_cache": "k_cache_out", "v_cache": "v_cache_out"},
        )
        for packed, buffer in (("codes", "tokens"), ("logits", "logits")):
            per_head = [f"{CODE_PREDICTOR_LOOP}.s{head + 1}.{buffer}" for head in range(num_heads)]
            missing = set(per_head) - set(names)
            if missing:
                raise OnnxLoweringError(f"{CODE_PREDICTOR_LOOP}: the region has no outputs {sorted(missing)}")
            g.op("Concat", *(g.op("Unsqueeze", n, g.const([1])) for n in per_head), axis=1, out=packed)
        outputs.append(error)
    else:
        _conventional_predictor_loop(g, view, batch, dtype)
        props = {"tilevox.sampling": "greedy"}
    inputs += cache_in
    outputs[2:2] = cache_out
    doc = "" if megakernel else "greedy only: codes are the ArgMax of each head's logits (no sampling inputs)"
    return _finish(g, f"{CODE_PREDICTOR_LOOP}_b{batch}_{_kind(megakernel)}", inputs, outputs, doc=doc, props=props)


# The regions a plan may cut at layer boundaries that lower as a chain of pieces (executor.split runs the same).
_CUT_FAMILIES = {
    DECODER_STEP: ModelFamily.LLAMA,
    TALKER_STEP: ModelFamily.QWEN3_TTS_TALKER,
    NH_DECODER_STEP: ModelFamily.NH_TTS,
}


def export_cut_step(
    network: torch.nn.Module,
    region: str,
    pieces: Sequence[tuple[int, int, bool]],
    *,
    batch: int,
    cache: CacheLayout,
    tiling: TilingConfig | None = None,
    num_sms: int = 132,
) -> onnx.ModelProto:
    """A decoder step (DECODER_STEP: Llama; TALKER_STEP: the Qwen3-TTS talker; NH_DECODER_STEP: NH-TTS, from the
    summed codebook embeddings, cross-attention in every layer) cut at layer boundaries, as one ONNX model with
    the whole step's I/O contract (module docstring): `pieces` lists (first, stop, megakernel) in layer order,
    covering every layer. A megakernel piece is one MegakernelRegion node of the region
    compiler's piece (RegionSpec.piece: the same compile as executor.split's), with an error output
    `<region>.piece<i>.error`; a conventional piece is standard ops over its layers. The residual stream and
    both caches flow from piece to piece; the last piece writes k_cache_out / v_cache_out."""
    if region not in _CUT_FAMILIES:
        raise OnnxLoweringError(f"region {region} is not lowered in pieces (cut regions: {', '.join(_CUT_FAMILIES)})")
    view, dtype = _checked_view(network, _CUT_FAMILIES[region], f"export_cut_step({region})")
    _check_batch(batch, cache)
    n = view.num_layers
    edges = [p[0] for p in pieces] + [pieces[-1][1]] if pieces else []
    if not pieces or edges[0] != 0 or edges[-1] != n or any(a >= b for a, b in zip(edges, edges[1:])):
        raise OnnxLoweringError(f"pieces {list(pieces)} do not cover layers [0, {n}) of {region} in order")
    nh = region == NH_DECODER_STEP
    inputs = _nh_inputs(view, batch, cache, dtype) if nh else []  # checks the cross layout first
    register_schemas()
    g = _Graph()
    cache_in, cache_out = _cache_values(view, cache, dtype)
    llama, talker = region == DECODER_STEP, region == TALKER_STEP
    if not nh:
        step_in = (
            _value("tokens", TensorProto.INT64, [batch]) if llama else _value("x_in", dtype, [batch, view.input_size])
        )
        inputs = [step_in, *_row_values(batch), *cache_in]
    outputs = [_value("hidden", dtype, [batch, view.hidden_size])] if talker else []
    outputs += [_value("logits", dtype, [batch, view.heads[0].shape[0]]), *cache_out]
    x, caches, rows = None if llama else "x_in", ("k_cache", "v_cache"), None
    cross = _nh_cross(g, cache) if nh else None
    extra = {"text_lengths", "cross_k_cache", "cross_v_cache"} if nh else set()
    for i, (first, stop, megakernel) in enumerate(pieces):
        last = stop == n
        if megakernel:
            compiled = compile_region(
                network,
                region_spec(region).piece(first, stop, n),
                batch_size=batch,
                max_context=cache.cache_len,
                num_cache_slots=cache.num_slots,
                cache_len=cache.cache_len,
                tiling=tiling,
                num_sms=num_sms,
                **({"cross_cache_len": cache.text_len} if nh else {}),
            )
            renamed = {"k_cache": "k_cache_out", "v_cache": "v_cache_out", "s0.logits": "logits"} if last else {}
            if last and talker:
                renamed["x_normed"] = "hidden"
            bound = {"k_cache": caches[0], "v_cache": caches[1]}
            if x is not None:
                bound["x_in"] = x
            names, error = _megakernel_region(
                g,
                f"{region}.piece{i}",
                compiled,
                graph_inputs={"tokens", "positions", "slots", *extra},
                constants=_greedy(batch) if last and not nh else {},
                renamed=renamed,
                bound=bound,
            )
            produced = dict(zip([s.name for s in node_io_buffers(compiled.program)[1]], names))
            caches, x = (produced["k_cache"], produced["v_cache"]), produced.get("x_out")
            outputs.append(error)
            continue
        if x is None:  # a conventional first piece of a token model embeds the tokens
            x = g.op("Gather", g.init("embed_tokens", view.embed_tables[0]), "tokens", axis=0)  # (B, hidden)
        if rows is None:
            rows = _rows(g, view, "positions", "slots", batch, cache.cache_len, dtype)
        x, k, v = _layers(
            g,
            view,
            x,
            rows,
            "slots",
            caches,
            batch=batch,
            dtype=dtype,
            cache_out=_CACHE_OUT if last else None,
            cross=cross,
            first=first,
            stop=stop,
        )
        caches = (k, v)
        if last:
            normed = _rmsnorm(
                g, x, g.init("final_norm", view.final_norm), view.rms_norm_eps, dtype, out="hidden" if talker else None
            )
            head = "lm_head.T" if llama else "codec_head.T" if talker else "logits_dense.T"
            g.op("MatMul", normed, g.init(head, view.heads[0].detach().t().contiguous()), out="logits")
    label = "_".join(f"{a}-{b}{'mk' if m else 'conv'}" for a, b, m in pieces)
    return _finish(g, f"{region}_b{batch}_cut_{label}", inputs, outputs)


def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def save_onnx(model: onnx.ModelProto, path: Path) -> Path:
    """Write `model` (weights in `<path>.data` beside it when over 1 GiB) and run the full checker on the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    external = _weight_bytes(model) >= _EXTERNAL_DATA_BYTES
    onnx.save_model(model, str(path), save_as_external_data=external, location=f"{path.name}.data")
    onnx.checker.check_model(str(path), full_check=True)
    return path


def _cache_layout(model, region: str) -> CacheLayout:
    """The model's own cache for a region: Qwen3-TTS's talker KVCache (`model.cache`), else (Llasa) its
    max_streams x max_seq_len."""
    if region == TALKER_STEP:
        kv = getattr(model, "cache", None)
        slots, length = getattr(kv, "num_slots", None), getattr(kv, "max_len", None)
        where = "cache.num_slots / cache.max_len"
    elif region == NH_DECODER_STEP:  # a stream owns rows_per_stream cache rows (guidance)
        streams, per_stream = getattr(model, "max_streams", None), getattr(model, "rows_per_stream", None)
        slots = streams * per_stream if isinstance(streams, int) and isinstance(per_stream, int) else None
        length, text = getattr(model, "max_seq_len", None), getattr(model, "max_text_len", None)
        if not isinstance(text, int):
            raise OnnxLoweringError(f"{type(model).__name__} has no max_text_len: the cross cache layout is unknown")
        if isinstance(slots, int) and isinstance(length, int):
            return CacheLayout(num_slots=slots, cache_len=length, text_len=text)
        where = "max_streams / rows_per_stream / max_seq_len"
    else:
        slots, length = getattr(model, "max_streams", None), getattr(model, "max_seq_len", None)
        where = "max_streams / max_seq_len"
    if not isinstance(slots, int) or not isinstance(length, int):
        raise OnnxLoweringError(f"{type(model).__name__} has no {where}: the {region} cache layout is unknown")
    return CacheLayout(num_slots=slots, cache_len=length)


def export_region(
    model,
    region: str,
    *,
    batch: int,
    megakernel: bool,
    tiling: TilingConfig | None = None,
    num_sms: int = 132,
) -> onnx.ModelProto:
    """`region` of a speech model (its network from models.region_backends.region_module) for `batch` rows,
    against the model's own cache layout. OnnxLoweringError for a region this module does not lower."""
    if region not in _EXPORTS:
        raise OnnxLoweringError(f"region {region} has no ONNX lowering yet (covered: {', '.join(lowerable_regions())})")
    kwargs = {"batch": batch, "megakernel": megakernel, "tiling": tiling, "num_sms": num_sms}
    if region != CODE_PREDICTOR_LOOP:  # the predictor's cache is one frame of the batch's rows
        kwargs["cache"] = _cache_layout(model, region)
    return _EXPORTS[region](region_module(model, region), **kwargs)


def export_plan(
    model,
    plan: Plan,
    out_dir: Path,
    *,
    tiling: TilingConfig | None = None,
    num_sms: int = 132,
) -> list[Path]:
    """Write `<out_dir>/<region>_b<batch>.onnx` for each region of each bucket of `plan` (the backend the bucket
    chose: megakernel -> a MegakernelRegion node, graph/compiled -> standard ops; a conventional
    code_predictor_loop is greedy only, see export_code_predictor_loop); the plan's executor regions are the
    executor's and are skipped. Megakernel regions are compiled with the tiling the plan was measured with
    where it records one (`tiling`, if given, must equal it), else with `tiling`. Returns the files written.
    OnnxLoweringError for a region this module does not lower, a region the plan cuts (checked for every piece
    before anything is written) or a tiling other than the plan's."""
    executor = {r.name for r in plan.layout if r.executor}  # run by the executor, not lowered
    steps: list[tuple[int, str, list]] = []  # (batch, region, its pieces in layer order)
    for bucket in plan.buckets:
        for piece in bucket.composition.pieces:
            if piece.region in executor:
                continue
            if steps and steps[-1][:2] == (bucket.batch, piece.region):
                steps[-1][2].append(piece)
            else:
                steps.append((bucket.batch, piece.region, [piece]))
    for batch, region, pieces in steps:
        if region not in _EXPORTS:
            raise OnnxLoweringError(
                f"region {region} has no ONNX lowering yet (covered: {', '.join(lowerable_regions())})"
            )
        if _is_cut(pieces) and region not in _CUT_FAMILIES:
            raise OnnxLoweringError(
                f"bucket {batch} cuts region {region}; cut regions lower for {', '.join(_CUT_FAMILIES)} only"
            )
    if plan.tiling is not None:
        recorded = TilingConfig.from_dict(plan.tiling)
        if tiling is not None and tiling != recorded:
            raise OnnxLoweringError(f"the plan was measured with tiling {recorded}, not {tiling}")
        tiling = recorded
    written = []
    for batch, region, pieces in steps:
        if _is_cut(pieces):
            step = export_cut_step(
                region_module(model, region),
                region,
                [(p.first_layer, p.stop_layer, p.backend is Backend.MEGAKERNEL) for p in pieces],
                batch=batch,
                cache=_cache_layout(model, region),
                tiling=tiling,
                num_sms=num_sms,
            )
        else:
            step = export_region(
                model,
                region,
                batch=batch,
                megakernel=pieces[0].backend is Backend.MEGAKERNEL,
                tiling=tiling,
                num_sms=num_sms,
            )
        written.append(save_onnx(step, Path(out_dir) / f"{region}_b{batch}.onnx"))
        if region == CODE_PREDICTOR_LOOP and pieces[0].backend is not Backend.MEGAKERNEL:
            log.warning("%s: the conventional code-predictor loop is greedy only (no sampling inputs)", written[-1])
    return written


def _is_cut(pieces: Sequence) -> bool:
    return len(pieces) > 1 or pieces[0].first_layer != 0 or not pieces[0].head


_EXPORTS = {
    DECODER_STEP: export_decoder_step,
    TALKER_STEP: export_talker_step,
    CODE_PREDICTOR_LOOP: export_code_predictor_loop,
    NH_DECODER_STEP: export_nh_decoder_step,
}


def lowerable_regions() -> Sequence[str]:
    """The regions export_plan lowers today."""
    return tuple(_EXPORTS)
