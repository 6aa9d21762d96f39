"""TensorRT lowering of a plan: one decoder step per batch bucket as ONNX (`tilevox build --onnx`).

Each bucket's step becomes one ONNX model per region: a region the plan runs on the megakernel is one
`tilevox::MegakernelRegion` plugin node carrying its compiled program (trt_plugins.onnx.megakernel_region; the
same compile as the megakernel backend: batch = the bucket, the model's cache as the region's state); a region
it keeps conventional is standard ONNX ops (opset 18), written directly from the network's `decoder_view()`
(the weights the region compiler reads, so both lowerings use one source), with each MLP a
`tilevox::swiglu_mlp` plugin node (Kernel-1 [Wg; Wu] packing). A direct emitter, not torch.onnx.export of the
eager step: the eager step mutates the cache in place through advanced indexing and calls the megakernel
through a handle to a live launch, neither of which exports; the emitter states the step's dataflow and its
KV-cache contract explicitly.

Covered: Llasa's `decoder_step` (models.llama LlamaForCausalLM). Not lowered yet (OnnxLoweringError says so):
Qwen3-TTS `talker_step` / `code_predictor_loop`, NH-TTS `nh_decoder_step`, and plans that cut a region.

I/O contract of `decoder_step_b<B>.onnx` (B = the bucket's batch; dtype = the model's; L layers, S cache
slots, Hkv kv heads, T cache length, D head dim, V vocabulary):
  inputs   tokens (B,) int64; positions (B,) int64: each row's new position (its cache length);
           slots (B,) int64: each row's cache slot; k_cache, v_cache (L, S, Hkv, T, D): the whole cache.
  outputs  logits (B, V); k_cache_out, v_cache_out: the cache with this step's keys and values written at
           [layer, slots[b], :, positions[b]] (bind them to the same memory as the inputs for an in-place
           step; the MegakernelRegion plugin copies state input to output, then runs in place there);
           megakernel only: `decoder_step.error` (8,) int32, the kernel's error words (all zero when clean).
  Keys past a row's own position are masked; rows are independent. The caller advances positions.
Build time only. Imports: numpy, onnx, torch, models, engine_builder, trt_plugins.onnx.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from tilevox.engine_builder.composition import Backend
from tilevox.engine_builder.plan import Plan
from tilevox.engine_builder.regions.adapters import DecoderView, ModelFamily, decoder_view
from tilevox.engine_builder.regions.bindings import sampling_inputs
from tilevox.engine_builder.regions.compiler import compile_region
from tilevox.engine_builder.regions.spec import TilingConfig, region_spec
from tilevox.models.region_backends import DECODER_STEP, region_module
from tilevox.models.sampling import SamplingParams
from tilevox.trt_plugins.megakernel.instructions import ERROR_WORDS, BufferKind
from tilevox.trt_plugins.onnx.export import check_plugin_nodes
from tilevox.trt_plugins.onnx.megakernel_region import (
    ERROR_OUTPUT,
    megakernel_region_node,
    node_io_buffers,
)
from tilevox.trt_plugins.onnx.schemas import register_schemas
from tilevox.trt_plugins.registry import PLUGINS

__all__ = [
    "OPSET",
    "CacheLayout",
    "OnnxLoweringError",
    "export_decoder_step",
    "export_plan",
    "save_onnx",
]

OPSET = 18
_MLP = PLUGINS["tilevox::swiglu_mlp"]
_ONNX_FLOAT = {
    torch.float32: TensorProto.FLOAT,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.float16: TensorProto.FLOAT16,
}
_EXTERNAL_DATA_BYTES = 1 << 30  # protobuf caps a message at 2 GiB: larger models keep weights beside the file


class OnnxLoweringError(ValueError):
    """A plan, region or model the ONNX lowering does not cover (the message says which and why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheLayout:
    """The KV cache the exported step reads and writes: `num_slots` streams x `cache_len` positions."""

    num_slots: int
    cache_len: int

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.cache_len < 1:
            raise OnnxLoweringError(f"cache needs >= 1 slot and position, got {self.num_slots}, {self.cache_len}")


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

    def const(self, values, dtype=np.int64) -> str:
        return self.init(self.fresh("const"), np.asarray(values, dtype=dtype))

    def op(self, op_type: str, *inputs: str, out: str | None = None, domain: str = "", **attrs) -> str:
        out = out or self.fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], domain=domain, **attrs))
        return out


def _rmsnorm(g: _Graph, x: str, weight: str, eps: float, dtype: int) -> str:
    """models.layers.RMSNorm: fp32 statistics, rounded to the model dtype before the weight."""
    x32 = g.op("Cast", x, to=TensorProto.FLOAT)
    mean = g.op("ReduceMean", g.op("Mul", x32, x32), g.const([-1]), keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean, g.const(eps, np.float32))))
    return g.op("Mul", weight, g.op("Cast", g.op("Mul", x32, inv), to=dtype))


def _rope(g: _Graph, x: str, cos: str, sin: str, half: int) -> str:
    """x * cos + rotate_half(x) * sin over the last dim (as models.llama)."""
    x1 = g.op("Slice", x, g.const([0]), g.const([half]), g.const([-1]))
    x2 = g.op("Slice", x, g.const([half]), g.const([2 * half]), g.const([-1]))
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def _linear(g: _Graph, x: str, name: str, weight: torch.Tensor) -> str:
    """x @ weight^T with the transposed weight stored once as an initializer."""
    return g.op("MatMul", x, g.init(name, weight.detach().t().contiguous()))


def _cache_io(view: DecoderView, batch: int, cache: CacheLayout, dtype: int) -> tuple[list, list]:
    shape = [view.num_layers, cache.num_slots, view.num_kv_heads, cache.cache_len, view.head_dim]
    inputs = [
        helper.make_tensor_value_info("tokens", TensorProto.INT64, [batch]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, [batch]),
        helper.make_tensor_value_info("slots", TensorProto.INT64, [batch]),
        helper.make_tensor_value_info("k_cache", dtype, shape),
        helper.make_tensor_value_info("v_cache", dtype, shape),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", dtype, [batch, view.heads[0].shape[0]]),
        helper.make_tensor_value_info("k_cache_out", dtype, shape),
        helper.make_tensor_value_info("v_cache_out", dtype, shape),
    ]
    return inputs, outputs


def _conventional_llama_step(g: _Graph, view: DecoderView, batch: int, cache: CacheLayout, dtype: int) -> None:
    heads, kv_heads, dim = view.num_heads, view.num_kv_heads, view.head_dim
    groups, half = heads // kv_heads, dim // 2
    scale = view.head_dim**-0.5 if view.attn_scale is None else view.attn_scale
    x = g.op("Gather", g.init("embed_tokens", view.embed_tables[0]), "tokens", axis=0)  # (B, hidden)
    # RoPE in fp32 as the model computes it: angles = positions * inv_freq, duplicated over both halves
    freqs = g.op(
        "Mul",
        g.op("Unsqueeze", g.op("Cast", "positions", to=TensorProto.FLOAT), g.const([1])),
        g.init("inv_freq", view.inv_freq),
    )
    angles = g.op("Concat", freqs, freqs, axis=-1)  # (B, D)
    cos = g.op("Unsqueeze", g.op("Cast", g.op("Cos", angles), to=dtype), g.const([1]))  # (B, 1, D)
    sin = g.op("Unsqueeze", g.op("Cast", g.op("Sin", angles), to=dtype), g.const([1]))
    # key s of row b is visible iff s <= positions[b]: an additive fp32 mask (B, 1, 1, T)
    visible = g.op(
        "LessOrEqual", g.const(np.arange(cache.cache_len)[None, :]), g.op("Unsqueeze", "positions", g.const([1]))
    )
    mask = g.op("Where", visible, g.const(0.0, np.float32), g.const(-np.inf, np.float32))
    mask = g.op("Unsqueeze", mask, g.const([1, 2]))
    # ScatterND indices (B, Hkv, 4) = [layer, slot, kv head, position]; the layer column is set per layer
    bh1 = g.const([batch, kv_heads, 1])
    per_row = lambda t: g.op("Expand", g.op("Unsqueeze", t, g.const([1, 2])), bh1)  # noqa: E731
    head_idx = g.op("Expand", g.const(np.arange(kv_heads).reshape(1, kv_heads, 1)), bh1)
    scale_c = g.init("attn_scale", torch.tensor(scale, dtype=view.dtype))  # scores are scaled in the model dtype
    k_cache, v_cache = "k_cache", "v_cache"
    for i, layer in enumerate(view.layers):
        p = f"layers.{i}"
        h = _rmsnorm(g, x, g.init(f"{p}.ln1", layer.ln1), view.rms_norm_eps, dtype)
        q = g.op("Reshape", _linear(g, h, f"{p}.w_q.T", layer.w_q), g.const([batch, heads, dim]))
        k = g.op("Reshape", _linear(g, h, f"{p}.w_k.T", layer.w_k), g.const([batch, kv_heads, dim]))
        v = g.op("Reshape", _linear(g, h, f"{p}.w_v.T", layer.w_v), g.const([batch, kv_heads, dim]))
        q, k = _rope(g, q, cos, sin, half), _rope(g, k, cos, sin, half)
        layer_idx = g.op("Expand", g.const([[[i]]]), bh1)
        index = g.op("Concat", layer_idx, per_row("slots"), head_idx, per_row("positions"), axis=-1)
        k_cache = g.op("ScatterND", k_cache, index, k, out="k_cache_out" if i == view.num_layers - 1 else None)
        v_cache = g.op("ScatterND", v_cache, index, v, out="v_cache_out" if i == view.num_layers - 1 else None)
        keys = g.op("Gather", g.op("Gather", k_cache, g.const(i), axis=0), "slots", axis=0)  # (B, Hkv, T, D)
        values = g.op("Gather", g.op("Gather", v_cache, g.const(i), axis=0), "slots", axis=0)
        qg = g.op("Reshape", q, g.const([batch, kv_heads, groups, dim]))  # query head h uses kv head h // G
        scores = g.op("Mul", g.op("MatMul", qg, g.op("Transpose", keys, perm=[0, 1, 3, 2])), scale_c)
        probs = g.op("Softmax", g.op("Add", g.op("Cast", scores, to=TensorProto.FLOAT), mask), axis=-1)
        attn = g.op("MatMul", g.op("Cast", probs, to=dtype), values)  # (B, Hkv, G, D)
        attn = g.op("Reshape", attn, g.const([batch, heads * dim]))
        x = g.op("Add", x, _linear(g, attn, f"{p}.w_o.T", layer.w_o))
        h = _rmsnorm(g, x, g.init(f"{p}.ln2", layer.ln2), view.rms_norm_eps, dtype)
        w_packed = g.init(f"{p}.mlp.w_packed", torch.cat([layer.w_gate, layer.w_up], dim=0))
        w_down = g.init(f"{p}.mlp.w_down", layer.w_down)
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
    x = _rmsnorm(g, x, g.init("final_norm", view.final_norm), view.rms_norm_eps, dtype)
    g.op("MatMul", x, g.init("lm_head.T", view.heads[0].detach().t().contiguous()), out="logits")


def _megakernel_llama_step(
    g: _Graph, llama: torch.nn.Module, batch: int, cache: CacheLayout, *, tiling: TilingConfig | None, num_sms: int
) -> onnx.ValueInfoProto:
    region = compile_region(
        llama,
        region_spec(DECODER_STEP),
        batch_size=batch,
        max_context=cache.cache_len,
        num_cache_slots=cache.num_slots,
        cache_len=cache.cache_len,
        tiling=tiling,
        num_sms=num_sms,
    )
    program = region.program
    greedy = sampling_inputs([SamplingParams.greedy()] * batch, seeds=[0] * batch)  # the host samples the logits
    graph_io = {"tokens", "positions", "slots", "k_cache", "v_cache"}
    in_specs, out_specs = node_io_buffers(program)
    names = []
    for spec in in_specs:
        if spec.kind is BufferKind.WEIGHT:
            names.append(g.init(f"{DECODER_STEP}.{spec.name}", region.weights[spec.name]))
        elif spec.name in graph_io:
            names.append(spec.name)
        elif spec.name in greedy:
            names.append(g.init(f"{DECODER_STEP}.{spec.name}", greedy[spec.name]))
        else:
            raise OnnxLoweringError(
                f"{DECODER_STEP}: no graph value for region buffer {spec.name!r} ({spec.kind.name})"
            )
    renamed = {"k_cache": "k_cache_out", "v_cache": "v_cache_out", "s0.logits": "logits"}
    outputs = [renamed.get(s.name, f"{DECODER_STEP}.{s.name}") for s in out_specs] + [f"{DECODER_STEP}.{ERROR_OUTPUT}"]
    g.nodes.append(megakernel_region_node(program, names, outputs, name=f"{DECODER_STEP}.megakernel"))
    return helper.make_tensor_value_info(outputs[-1], TensorProto.INT32, [ERROR_WORDS])


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
    view = decoder_view(llama)
    if view.family is not ModelFamily.LLAMA:
        raise OnnxLoweringError(f"export_decoder_step lowers Llama decoder steps; got a {view.family.value} network")
    if view.dtype not in _ONNX_FLOAT:
        raise OnnxLoweringError(f"dtype {view.dtype} has no ONNX lowering here (fp32, bf16, fp16)")
    if batch < 1 or batch > cache.num_slots:
        raise OnnxLoweringError(f"batch {batch} must be in [1, {cache.num_slots}] (the cache's slots)")
    dtype = _ONNX_FLOAT[view.dtype]
    register_schemas()
    g = _Graph()
    inputs, outputs = _cache_io(view, batch, cache, dtype)
    if megakernel:
        outputs.append(_megakernel_llama_step(g, llama, batch, cache, tiling=tiling, num_sms=num_sms))
    else:
        _conventional_llama_step(g, view, batch, cache, dtype)
    kind = "megakernel" if megakernel else "conventional"
    graph = helper.make_graph(g.nodes, f"{DECODER_STEP}_b{batch}_{kind}", inputs, outputs, g.initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(_MLP.namespace, 1)],
        producer_name="tilevox",
    )
    model.ir_version = 9  # onnx 1.15+ readers; TensorRT 10's parser reads IR 9
    check_plugin_nodes(model)
    if _weight_bytes(model) < _EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(model, full_check=True)  # larger models are checked from their file (save_onnx)
    return model


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


def _cache_layout(model) -> CacheLayout:
    slots, length = getattr(model, "max_streams", None), getattr(model, "max_seq_len", None)
    if not isinstance(slots, int) or not isinstance(length, int):
        raise OnnxLoweringError(f"{type(model).__name__} has no max_streams / max_seq_len: its cache layout is unknown")
    return CacheLayout(num_slots=slots, cache_len=length)


def export_plan(
    model,
    plan: Plan,
    out_dir: Path,
    *,
    tiling: TilingConfig | None = None,
    num_sms: int = 132,
) -> list[Path]:
    """Write `<out_dir>/<region>_b<batch>.onnx` for each region of each bucket of `plan` (the backend the bucket
    chose: megakernel -> a MegakernelRegion node, graph/compiled -> standard ops). Returns the files written.
    OnnxLoweringError for a region this module does not lower or a region the plan cuts."""
    written = []
    cache = None
    for bucket in plan.buckets:
        for piece in bucket.composition.pieces:
            if piece.first_layer != 0 or not piece.head:
                raise OnnxLoweringError(f"bucket {bucket.batch} cuts region {piece.region}; only whole regions lower")
            if piece.region != DECODER_STEP:
                raise OnnxLoweringError(
                    f"region {piece.region} has no ONNX lowering yet (covered: {DECODER_STEP}, the Llasa step)"
                )
            cache = cache or _cache_layout(model)
            step = export_decoder_step(
                region_module(model, piece.region),
                batch=bucket.batch,
                cache=cache,
                megakernel=piece.backend is Backend.MEGAKERNEL,
                tiling=tiling,
                num_sms=num_sms,
            )
            written.append(save_onnx(step, Path(out_dir) / f"{piece.region}_b{bucket.batch}.onnx"))
    return written


def lowerable_regions() -> Sequence[str]:
    """The regions export_plan lowers today."""
    return (DECODER_STEP,)
