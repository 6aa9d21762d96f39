"""Region compiler: a model + RegionSpec + batch size + max context -> a megakernel Program.

Instructions are emitted stage by stage in a topological order. Every stage (e.g. the QKV tiles of
one kv group of one layer of one step) shares one counter; a consumer waits for exactly the stages
holding the tiles it reads (attention of kv group g waits for group g's QKV tiles only). Activations
are single-assignment buffers per (step, layer), so the only write-after-read hazards are in the KV
cache, where each step appends at a fresh position. Queues are then filled by `schedule.py`.
Imports: torch, trt_plugins.megakernel, models (their decoder views), this package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tilevox.engine_builder.regions.cost import H200, DeviceCosts
from tilevox.engine_builder.regions.schedule import SchedulingPolicy, schedule_program
from tilevox.engine_builder.regions.spec import RegionKind, RegionSpec, TilingConfig, region_spec
from tilevox.models.decoder_view import DecoderView, ModelFamily, decoder_view
from tilevox.trt_plugins.megakernel.instructions import (
    NO_ID,
    BufferKind,
    BufferSpec,
    DType,
    Instruction,
    Opcode,
    Program,
    RegionConstants,
    Wait,
)

__all__ = ["CompiledRegion", "RegionCompilerFn", "compile_region", "region_compiler"]

_DTYPES = {
    torch.float32: DType.FLOAT32,
    torch.bfloat16: DType.BFLOAT16,
    torch.float16: DType.FLOAT16,
    torch.int64: DType.INT64,
    torch.int32: DType.INT32,
}
_SAMPLING_INPUTS = (
    ("temperature", DType.FLOAT32),
    ("top_k", DType.INT64),
    ("top_p", DType.FLOAT32),
    ("seed", DType.INT64),
    ("rng_offset", DType.INT64),
)
_SAMPLING_BYTES_PER_ROW = 4 + 8 + 4 + 8 + 8


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledRegion:
    """The program plus the weight tensors to bind by buffer name (views of the model's parameters).

    Callers bind INPUT and STATE buffers themselves: see `program.buffers` (names documented in
    `compile_region`)."""

    spec: RegionSpec
    program: Program
    weights: dict[str, torch.Tensor]
    num_steps: int  # decode (micro-)steps the region runs
    max_context: int

    @property
    def predicted_time_s(self) -> float:
        return float(self.program.metadata["predicted_time_s"])


def _tiles(total: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, total)) for start in range(0, total, size)]


class _Builder:
    def __init__(self, view: DecoderView, constants: RegionConstants, tiling: TilingConfig, num_sms: int) -> None:
        self.view = view
        self.c = constants
        self.tiling = tiling
        self.num_sms = num_sms
        self.elt = view.final_norm.element_size()
        self.act_dtype = _DTYPES[view.dtype]
        self.buffers: list[BufferSpec] = []
        self.ids: dict[str, int] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.instructions: list[Instruction] = []
        self.num_counters = 0
        self.cross_cost_text = 0  # encoder keys per row assumed by the CROSS_ATTN cost estimates

    # buffers ---------------------------------------------------------------------------------
    def buffer(self, name: str, kind: BufferKind, dtype: DType, shape: tuple[int, ...]) -> int:
        if name in self.ids:
            raise AssertionError(f"buffer {name!r} declared twice")
        self.ids[name] = len(self.buffers)
        self.buffers.append(
            BufferSpec(
                buffer_id=len(self.buffers), name=name, kind=kind, dtype=dtype, shape=tuple(int(d) for d in shape)
            )
        )
        return self.ids[name]

    def weight(self, name: str, tensor: torch.Tensor | None) -> int:
        if tensor is None:
            return NO_ID
        if name not in self.ids:
            self.buffer(name, BufferKind.WEIGHT, _DTYPES[tensor.dtype], tuple(tensor.shape))
            self.weights[name] = tensor.detach()
        return self.ids[name]

    def act(self, name: str, width: int, kind: BufferKind = BufferKind.SCRATCH) -> int:
        return self.buffer(name, kind, self.act_dtype, (self.c.batch_size, width))

    # stages ----------------------------------------------------------------------------------
    def rows_per_tile(self, rows: int, tile_rows: int) -> int:
        """Rows per tile of a matrix-vector stage of `rows` outputs whose fixed tile size is `tile_rows`; with
        `TilingConfig.sm_balanced`, ceil(rows / num_sms) rounded up to a multiple of matvec_rows instead."""
        if not self.tiling.sm_balanced:
            return tile_rows
        unit = self.tiling.matvec_rows
        return max(unit, -(-math.ceil(rows / self.num_sms) // unit) * unit)

    def stage(self, records: list[dict[str, Any]]) -> Wait:
        """Emit instructions that all signal one new counter; returns the wait for all of them."""
        counter = self.num_counters
        self.num_counters += 1
        for record in records:
            self.instructions.append(Instruction(signal=counter, **record))
        return Wait(counter_id=counter, target=len(records))

    def matvec_stage(self, opcode: Opcode, *, rows: int, tile_rows: int, **record: Any) -> Wait:
        """A stage of matrix-vector tiles over `rows` output features (matvec_records' tiles, `tile_rows` rows
        each, or the balanced size: rows_per_tile)."""
        return self.stage(
            self.matvec_records(opcode, rows=rows, rows_per_tile=self.rows_per_tile(rows, tile_rows), **record)
        )

    def matvec_records(
        self,
        opcode: Opcode,
        *,
        layer: int = NO_ID,
        step: int,
        rows: int,
        rows_per_tile: int,
        in_width: int,
        inputs: tuple[int, ...],
        outputs: tuple[int, ...],
        waits: tuple[Wait, ...],
        num_mats: int = 1,
        norm: bool = False,
        residual: bool = False,
        bias: bool = False,
        scale: bool = False,
        first_tile_extra_bytes: int = 0,
    ) -> list[dict[str, Any]]:
        """Matrix-vector tiles of `rows_per_tile` rows over `rows` output features (one stage may hold several
        matrices' records). Tile [r0, r1) reads num_mats x (r1 - r0) weight rows of in_width (+ bias), the whole
        (B, in_width) input (+ a norm gain: every tile recomputes the norm, as Hazy's kernel does), writes
        (B, r1 - r0), and with `residual` also reads that slice of the residual stream (with `scale`, and its
        layer scale)."""
        batch, elt = self.c.batch_size, self.elt
        records = []
        for start, stop in _tiles(rows, rows_per_tile):
            n = stop - start
            records.append(
                {
                    "opcode": opcode,
                    "layer": layer,
                    "step": step,
                    "tile_start": start,
                    "tile_stop": stop,
                    "inputs": inputs,
                    "outputs": outputs,
                    "waits": waits,
                    "weight_bytes": num_mats * n * in_width * elt + (n * elt if bias else 0),
                    "activation_bytes": (
                        batch * in_width * elt
                        + (in_width * elt if norm else 0)
                        + (2 if residual else 1) * batch * n * elt
                        + (n * elt if scale else 0)
                        + (first_tile_extra_bytes if start == 0 else 0)
                    ),
                    "flops": 2 * num_mats * batch * n * in_width,
                }
            )
        return records


def _layer(
    b: _Builder,
    tiling: TilingConfig,
    *,
    step: int,
    layer: int,
    x_in: int,
    x_waits: tuple[Wait, ...],
    kv_wait: tuple[Wait, ...] | None,
    context_tokens: int,
    full: bool,
    out_name: str | None = None,
) -> tuple[int, Wait, tuple[Wait, ...]]:
    """Emit one decoder layer at one step; returns (x_out buffer or NO_ID, its wait or None, per-group
    QKV waits). Not `full`: only the QKV/KV-append tiles are live (nothing reads the layer's output).
    kv_wait: the previous step's QKV (or KV_APPEND) stage of this layer and group (see the chain below)."""
    c, elt = b.c, b.elt
    w = b.view.layers[layer]
    batch, d = c.batch_size, c.head_dim
    prefix = f"layers.{layer}."
    ln1, wq, wk, wv = (
        b.weight(prefix + n, t) for n, t in (("ln1", w.ln1), ("w_q", w.w_q), ("w_k", w.w_k), ("w_v", w.w_v))
    )
    qk_norm = b.weight(prefix + "qk_norm", w.qk_norm)
    tag = f"s{step}.l{layer}."
    row_tiles = _tiles(batch, batch if tiling.attn_rows is None else tiling.attn_rows)
    if tiling.split_qkv:
        q_buf, fresh, linear_wait, qkv_waits = _split_qkv(
            b,
            tiling,
            step=step,
            layer=layer,
            x_in=x_in,
            x_waits=x_waits,
            kv_wait=kv_wait,
            full=full,
            tag=tag,
            weights=(ln1, wq, wk, wv, qk_norm),
            row_tiles=row_tiles,
        )
        if not full:
            return NO_ID, None, qkv_waits
        # Attention of kv group g waits for the projections and for the previous step's appends (the cache
        # below this step's position); this step's KV_APPEND runs beside it.
        attn_waits = [(linear_wait, *(() if kv_wait is None else (kv_wait[group],))) for group in range(c.num_kv_heads)]
        attn_extra_bytes = 2 * d * elt + (2 * d * elt if w.qk_norm is not None else 0) + (d // 2) * 4
    else:
        q_buf, qkv_waits = _fused_qkv(
            b,
            tiling,
            step=step,
            layer=layer,
            x_in=x_in,
            x_waits=x_waits,
            kv_wait=kv_wait,
            tag=tag,
            weights=(ln1, wq, wk, wv, qk_norm),
        )
        if not full:
            return NO_ID, None, qkv_waits
        fresh = (NO_ID,) * 4
        attn_waits = [(qkv_waits[group],) for group in range(c.num_kv_heads)]
        attn_extra_bytes = 0
    return _attention_and_mlp(
        b,
        tiling,
        step=step,
        layer=layer,
        x_in=x_in,
        q_buf=q_buf,
        fresh=fresh,
        attn_waits=attn_waits,
        attn_extra_bytes=attn_extra_bytes,
        row_tiles=row_tiles,
        context_tokens=context_tokens,
        tag=tag,
        prefix=prefix,
        out_name=out_name,
        qkv_waits=qkv_waits,
    )


def _fused_qkv(
    b: _Builder,
    tiling: TilingConfig,
    *,
    step: int,
    layer: int,
    x_in: int,
    x_waits: tuple[Wait, ...],
    kv_wait: tuple[Wait, ...] | None,
    tag: str,
    weights: tuple[int, ...],
) -> tuple[int, tuple[Wait, ...]]:
    """RMSNORM_QKV_ROPE_APPEND stages, one per kv group of whole-head tiles; returns (q_buf, per-group waits)."""
    c, elt = b.c, b.elt
    batch, d, g_size, hidden = c.batch_size, c.head_dim, c.group_size, b.view.hidden_size
    ln1, wq, wk, wv, qk_norm = weights
    has_qk_norm = qk_norm != NO_ID
    q_buf = b.buffer(tag + "q", BufferKind.SCRATCH, b.act_dtype, (batch, c.num_heads, d))
    ids = b.ids
    qkv_waits = []
    for group in range(c.num_kv_heads):
        # KV chain: QKV of step s waits for QKV of step s-1 (same layer and group), so a finished QKV
        # stage implies every earlier position of the region is in the cache. Attention then needs
        # a single wait even when a step's input does not depend on the previous step (the
        # predictor's micro-steps 0 and 1).
        waits = x_waits if kv_wait is None else (*x_waits, kv_wait[group])
        records = []
        for start, stop in _tiles(g_size + 2, tiling.heads_per_qkv_tile):
            num_q = max(0, min(stop, g_size) - start)
            num_kv = (stop - start) - num_q
            records.append(
                {
                    "opcode": Opcode.RMSNORM_QKV_ROPE_APPEND,
                    "layer": layer,
                    "step": step,
                    "tile_start": start,
                    "tile_stop": stop,
                    "args": (group,),
                    "inputs": (x_in, ln1, wq, wk, wv, qk_norm, ids["inv_freq"], ids["positions"], ids["slots"]),
                    "outputs": (q_buf, ids["k_cache"], ids["v_cache"]),
                    "waits": waits,
                    "weight_bytes": (stop - start) * d * hidden * elt,
                    "kv_bytes": num_kv * batch * d * elt,
                    "activation_bytes": (
                        batch * hidden * elt
                        + hidden * elt
                        + (2 * d * elt if has_qk_norm else 0)
                        + (d // 2) * 4
                        + 2 * batch * 8
                        + num_q * batch * d * elt
                    ),
                    "flops": 2 * batch * (stop - start) * d * hidden,
                }
            )
        qkv_waits.append(b.stage(records))
    return q_buf, tuple(qkv_waits)


def _split_qkv(
    b: _Builder,
    tiling: TilingConfig,
    *,
    step: int,
    layer: int,
    x_in: int,
    x_waits: tuple[Wait, ...],
    kv_wait: tuple[Wait, ...] | None,
    full: bool,
    tag: str,
    weights: tuple[int, ...],
    row_tiles: list[tuple[int, int]],
) -> tuple[int, tuple[int, int, int, int], Wait, tuple[Wait, ...]]:
    """TilingConfig.split_qkv: one stage of RMSNORM_LINEAR tiles over the q, k and v rows together (balanced
    like every matrix-vector stage, rather than one whole head per tile), writing the raw projections, then
    KV_APPEND tiles per kv group and row range that norm, rope and append this step's key and value. Returns
    (raw q or NO_ID, ATTN_PARTIAL's (k_new, v_new, qk_norm_w, inv_freq), the projection stage's wait, the
    append stage's wait once per kv group: the KV chain, as the fused stage's waits are)."""
    c, elt = b.c, b.elt
    d, kv_heads, hidden = c.head_dim, c.num_kv_heads, b.view.hidden_size
    ln1, wq, wk, wv, qk_norm = weights
    ids = b.ids
    mats = [("k_raw", wk, kv_heads * d), ("v_raw", wv, kv_heads * d)]
    if full:  # a layer that only appends (the predictor's micro-step 0, last layer) needs no queries
        mats.insert(0, ("q_raw", wq, c.num_heads * d))
    per_tile = b.rows_per_tile(sum(rows for _, _, rows in mats), tiling.matvec_rows)
    raw, records = {}, []
    for name, weight, rows in mats:
        raw[name] = b.act(tag + name, rows)
        records += b.matvec_records(
            Opcode.RMSNORM_LINEAR,
            layer=layer,
            step=step,
            rows=rows,
            rows_per_tile=min(per_tile, rows),
            in_width=hidden,
            inputs=(x_in, ln1, weight, NO_ID),
            outputs=(raw[name],),
            waits=x_waits,
            norm=True,
        )
    linear_wait = b.stage(records)
    has_qk_norm = qk_norm != NO_ID
    append_wait = b.stage(
        [
            {
                "opcode": Opcode.KV_APPEND,
                "layer": layer,
                "step": step,
                "tile_start": group,
                "tile_stop": group + 1,
                "args": (row0, row1),
                "inputs": (raw["k_raw"], raw["v_raw"], qk_norm, ids["inv_freq"], ids["positions"], ids["slots"]),
                "outputs": (ids["k_cache"], ids["v_cache"]),
                "waits": (linear_wait, *(() if kv_wait is None else (kv_wait[group],))),
                "kv_bytes": 2 * (row1 - row0) * d * elt,
                "activation_bytes": (
                    2 * (row1 - row0) * d * elt + (d * elt if has_qk_norm else 0) + (d // 2) * 4 + 2 * (row1 - row0) * 8
                ),
            }
            for group in range(kv_heads)
            for row0, row1 in row_tiles
        ]
    )
    fresh = (raw["k_raw"], raw["v_raw"], qk_norm, ids["inv_freq"])
    return raw.get("q_raw", NO_ID), fresh, linear_wait, (append_wait,) * kv_heads


def _attention_and_mlp(
    b: _Builder,
    tiling: TilingConfig,
    *,
    step: int,
    layer: int,
    x_in: int,
    q_buf: int,
    fresh: tuple[int, ...],
    attn_waits: list[tuple[Wait, ...]],
    attn_extra_bytes: int,
    row_tiles: list[tuple[int, int]],
    context_tokens: int,
    tag: str,
    prefix: str,
    out_name: str | None,
    qkv_waits: tuple[Wait, ...],
) -> tuple[int, Wait, tuple[Wait, ...]]:
    """Attention (ATTN_PARTIAL, then ATTN_REDUCE unless one partition covers the context), the output
    projection, optional cross-attention and the MLP of one layer and step."""
    c, v, elt = b.c, b.view, b.elt
    w = v.layers[layer]
    batch, d, g_size, hidden = c.batch_size, c.head_dim, c.group_size, v.hidden_size
    ids = b.ids

    # One partition (a region whose max context fits one, e.g. the Qwen3-TTS code predictor's 17 positions):
    # ATTN_PARTIAL's normalised output is the attention output, so it writes attn_out, whose (rows, heads x
    # head_dim) layout equals part_out's (rows, kv groups, 1, group size, head_dim), in its dtype, and no
    # ATTN_REDUCE stage follows (one dependent stage fewer per layer; the reduce would multiply by exp(0) / 1).
    single = c.num_partitions == 1 and not tiling.reduce_single_partition
    if single:
        part_out = attn_out = b.act(tag + "attn_out", c.num_heads * d)
    else:
        part_out = b.buffer(
            tag + "part_out", BufferKind.SCRATCH, DType.FLOAT32, (batch, c.num_kv_heads, c.num_partitions, g_size, d)
        )
    part_lse = b.buffer(
        tag + "part_lse", BufferKind.SCRATCH, DType.FLOAT32, (batch, c.num_kv_heads, c.num_partitions, g_size)
    )
    part_waits, part_records = [], []
    for group in range(c.num_kv_heads):
        records = []
        for partition in range(c.num_partitions):
            first = partition * c.partition_tokens
            keys = max(0, min(first + c.partition_tokens, context_tokens) - first)
            for row0, row1 in row_tiles:
                rows = row1 - row0
                records.append(
                    {
                        "opcode": Opcode.ATTN_PARTIAL,
                        "layer": layer,
                        "step": step,
                        "tile_start": partition,
                        "tile_stop": partition + 1,
                        "args": (group, row0, row1),
                        "inputs": (q_buf, ids["k_cache"], ids["v_cache"], ids["positions"], ids["slots"], *fresh),
                        "outputs": (part_out, part_lse),
                        "waits": attn_waits[group],
                        "kv_bytes": 2 * rows * keys * d * elt,
                        "activation_bytes": rows * g_size * d * elt
                        + rows * g_size * ((d * elt) if single else (d + 1) * 4)
                        + 2 * rows * 8
                        + rows * attn_extra_bytes,
                        "flops": 2 * 2 * rows * g_size * keys * d,
                    }
                )
        if single:
            part_records += records
        else:
            part_waits.append(b.stage(records))
    if single:
        attn_wait = b.stage(part_records)
    else:
        attn_out = b.act(tag + "attn_out", c.num_heads * d)
        attn_wait = b.stage(
            [
                {
                    "opcode": Opcode.ATTN_REDUCE,
                    "layer": layer,
                    "step": step,
                    "tile_start": group,
                    "tile_stop": group + 1,
                    "args": (row0, row1),
                    "inputs": (part_out, part_lse),
                    "outputs": (attn_out,),
                    "waits": (part_waits[group],),
                    "activation_bytes": (row1 - row0) * (c.num_partitions * g_size * (d + 1) * 4 + g_size * d * elt),
                }
                for group in range(c.num_kv_heads)
                for row0, row1 in row_tiles
            ]
        )
    wo = b.weight(prefix + "w_o", w.w_o)
    attn_scale, mlp_scale = (
        b.weight(prefix + n, t)
        for n, t in (("attn_layer_scale", w.attn_layer_scale), ("mlp_layer_scale", w.mlp_layer_scale))
    )
    x_mid = b.act(tag + "x_mid", hidden)
    hd = c.num_heads * d
    oproj_wait = b.matvec_stage(
        Opcode.OPROJ_RESIDUAL,
        layer=layer,
        step=step,
        rows=hidden,
        tile_rows=tiling.matvec_rows,
        in_width=hd,
        inputs=(attn_out, wo, x_in, attn_scale),
        outputs=(x_mid,),
        waits=(attn_wait,),
        residual=True,
        scale=attn_scale != NO_ID,
    )
    if w.cross is not None:
        x_mid, oproj_wait = _cross_attention(
            b, tiling, step=step, layer=layer, x=x_mid, x_wait=oproj_wait, tag=tag, prefix=prefix
        )
    ln2, wg, wu, wd = (
        b.weight(prefix + n, t)
        for n, t in (("ln2", w.ln2), ("w_gate", w.w_gate), ("w_up", w.w_up), ("w_down", w.w_down))
    )
    inter = v.intermediate_size
    h = b.act(tag + "h", inter)
    gateup_wait = b.matvec_stage(
        Opcode.RMSNORM_GATEUP_SWIGLU,
        layer=layer,
        step=step,
        rows=inter,
        tile_rows=tiling.matvec_rows,
        in_width=hidden,
        num_mats=2,
        inputs=(x_mid, ln2, wg, wu),
        outputs=(h,),
        waits=(oproj_wait,),
        norm=True,
    )
    x_out = b.act(
        tag + "x_out" if out_name is None else out_name,
        hidden,
        BufferKind.SCRATCH if out_name is None else BufferKind.OUTPUT,
    )
    down_wait = b.matvec_stage(
        Opcode.DOWN_RESIDUAL,
        layer=layer,
        step=step,
        rows=hidden,
        tile_rows=tiling.matvec_rows,
        in_width=inter,
        inputs=(h, wd, x_mid, mlp_scale),
        outputs=(x_out,),
        waits=(gateup_wait,),
        residual=True,
        scale=mlp_scale != NO_ID,
    )
    return x_out, down_wait, tuple(qkv_waits)


def _cross_attention(
    b: _Builder, tiling: TilingConfig, *, step: int, layer: int, x: int, x_wait: Wait, tag: str, prefix: str
) -> tuple[int, Wait]:
    """One layer's cross-attention (NH_TTS): x + w_o . CROSS_ATTN(rmsnorm(x) * ln . w_q) over each row's
    encoder keys/values (`cross_k_cache` / `cross_v_cache`, masked by `text_lengths`). The query projection
    is a norm + matrix-vector stage (RMSNORM_LMHEAD's semantics, no head involved), the output projection
    an OPROJ_RESIDUAL stage; returns (x after the residual, its wait)."""
    c, v, elt = b.c, b.view, b.elt
    cw, shape = v.layers[layer].cross, v.cross
    batch, hidden = c.batch_size, v.hidden_size
    d, kv_heads = shape.head_dim, shape.num_kv_heads
    g_size = shape.num_heads // kv_heads
    width = shape.num_heads * d
    ln, wq, wo = (
        b.weight(prefix + n, t) for n, t in (("cross.ln", cw.ln), ("cross.w_q", cw.w_q), ("cross.w_o", cw.w_o))
    )
    q = b.act(tag + "cross_q", width)
    q_wait = b.matvec_stage(
        Opcode.RMSNORM_LMHEAD,
        layer=layer,
        step=step,
        rows=width,
        tile_rows=tiling.matvec_rows,
        in_width=hidden,
        inputs=(x, ln, wq),
        outputs=(q, NO_ID),
        waits=(x_wait,),
        norm=True,
    )
    attn = b.act(tag + "cross_attn_out", width)
    ids, text = b.ids, b.cross_cost_text
    records = []
    for group in range(kv_heads):
        for start, stop in _tiles(batch, tiling.cross_attn_rows):
            n = stop - start
            records.append(
                {
                    "opcode": Opcode.CROSS_ATTN,
                    "layer": layer,
                    "step": step,
                    "tile_start": start,
                    "tile_stop": stop,
                    "args": (group,),
                    "inputs": (q, ids["cross_k_cache"], ids["cross_v_cache"], ids["text_lengths"], ids["slots"]),
                    "outputs": (attn,),
                    "waits": (q_wait,),
                    "kv_bytes": 2 * n * text * d * elt,
                    "activation_bytes": 2 * n * g_size * d * elt + 2 * n * 8,
                    "flops": 2 * 2 * n * g_size * text * d,
                }
            )
    attn_wait = b.stage(records)
    x_out = b.act(tag + "x_cross", hidden)
    out_wait = b.matvec_stage(
        Opcode.OPROJ_RESIDUAL,
        layer=layer,
        step=step,
        rows=hidden,
        tile_rows=tiling.matvec_rows,
        in_width=width,
        inputs=(attn, wo, x, NO_ID),
        outputs=(x_out,),
        waits=(attn_wait,),
        residual=True,
    )
    return x_out, out_wait


def _head(
    b: _Builder,
    tiling: TilingConfig,
    *,
    step: int,
    head_idx: int,
    rng_step: int,
    x: int,
    x_wait: Wait,
    x_normed: int,
    next_table: torch.Tensor | None,
    vocab_limit: int | None,
    sample: bool = True,
) -> tuple[int, Wait]:
    """Final norm + head + sampling (+ next-token embedding); returns (x_next buffer or NO_ID, wait).
    Row b's draw uses RNG counter rng_offset[b] + rng_step. Without `sample`: logits only (their wait)."""
    c, v, elt = b.c, b.view, b.elt
    batch, hidden = c.batch_size, v.hidden_size
    head = v.heads[head_idx]
    vocab = head.shape[0]
    limit = vocab if vocab_limit is None else vocab_limit
    if limit > vocab:
        raise ValueError(f"vocab_limit {limit} exceeds the head's {vocab} rows")
    norm_w = b.weight("final_norm", v.final_norm)
    w_lm = b.weight(f"heads.{head_idx}", head)
    logits = b.act(f"s{step}.logits", vocab, BufferKind.OUTPUT)
    lm_wait = b.matvec_stage(
        Opcode.RMSNORM_LMHEAD,
        step=step,
        rows=vocab,
        tile_rows=tiling.lm_head_rows,
        in_width=hidden,
        inputs=(x, norm_w, w_lm),
        outputs=(logits, x_normed),
        waits=(x_wait,),
        norm=True,
        first_tile_extra_bytes=batch * hidden * elt if x_normed != NO_ID else 0,  # tile 0 also writes xn
    )
    if not sample:
        return NO_ID, lm_wait
    tokens = b.buffer(f"s{step}.tokens", BufferKind.OUTPUT, DType.INT64, (batch,))
    table = NO_ID
    x_next = NO_ID
    if next_table is not None:
        table = b.weight(f"embed_tables.{_table_index(b, next_table)}", next_table)
        x_next = b.act(f"s{step}.x_next", v.input_size)
    ids = b.ids
    sample_wait = b.stage(
        [
            {
                "opcode": Opcode.SAMPLE_EMBED,
                "step": step,
                "tile_start": start,
                "tile_stop": stop,
                "args": (limit, rng_step),
                "inputs": (logits, *(ids[name] for name, _ in _SAMPLING_INPUTS), table),
                "outputs": (tokens, x_next),
                "waits": (lm_wait,),
                "weight_bytes": (stop - start) * v.input_size * elt if next_table is not None else 0,
                "activation_bytes": (stop - start) * (limit * elt + _SAMPLING_BYTES_PER_ROW + 8),
            }
            for start, stop in _tiles(batch, tiling.sample_rows)
        ]
    )
    return x_next, sample_wait


def _table_index(b: _Builder, table: torch.Tensor) -> int:
    for idx, candidate in enumerate(b.view.embed_tables):
        if candidate is table:
            return idx
    raise AssertionError("embedding table not in the view")


def _project(
    b: _Builder, tiling: TilingConfig, *, step: int, x: int, x_waits: tuple[Wait, ...], name: str
) -> tuple[int, tuple[Wait, ...]]:
    """The predictor's talker-width -> predictor-width input projection (identity when absent)."""
    v = b.view
    if v.projection is None:
        return x, x_waits
    weight, bias = v.projection
    w_id, b_id = (b.weight("projection.weight", weight), b.weight("projection.bias", bias))
    y = b.act(name, v.hidden_size)
    wait = b.matvec_stage(
        Opcode.LINEAR_BIAS,
        step=step,
        rows=v.hidden_size,
        tile_rows=tiling.matvec_rows,
        in_width=v.input_size,
        inputs=(x, w_id, b_id),
        outputs=(y,),
        waits=x_waits,
        bias=True,
    )
    return y, (wait,)


def compile_region(
    model: torch.nn.Module,
    spec: RegionSpec,
    *,
    batch_size: int,
    max_context: int | None = None,
    num_cache_slots: int | None = None,
    cache_len: int | None = None,
    tiling: TilingConfig | None = None,
    num_sms: int = H200.num_sms,
    policy: SchedulingPolicy = SchedulingPolicy.CRITICAL_PATH,
    device: DeviceCosts = H200,
    cost_context: int | None = None,
    cross_cache_len: int | None = None,
) -> CompiledRegion:
    """Compile `spec` of `model` for `batch_size` rows attending at most `max_context` keys.

    Buffers to bind by name. INPUT: `positions`, `slots` (B,) int64 (row b's first new token goes to
    cache[layer, slots[b], :, positions[b]], step s to positions[b] + s); `tokens` (B,) int64 with
    embed_input, else `x_in` (B, hidden); predictor: `hidden`, `code0_embedding` (B, talker width);
    with sampling `temperature`, `top_p` (B,) fp32 and `top_k`, `seed`, `rng_offset` (B,) int64 (the
    draw of decoder step s, or of predictor head j, uses RNG counter rng_offset[b] + s, or + j).
    STATE: `k_cache`, `v_cache` (layers, num_cache_slots, kv heads, cache_len, head_dim), the model's
    own cache layout. OUTPUT: `s{step}.logits`, `s{step}.tokens`, `x_out` (layers region without
    head), `x_normed` (talker head: the final-norm hidden). cost_context: keys per row at step 0
    assumed by the cost estimates (default: the most the region allows).

    A view with cross-attention (NH_TTS) also takes INPUT `text_lengths` (B,) int64 (row b attends encoder
    positions [0, text_lengths[b]) of cache row slots[b]) and STATE `cross_k_cache`, `cross_v_cache` (layers,
    num_cache_slots, cross kv heads, cross_cache_len, cross head_dim): NhDecoderCache's cross_k / cross_v,
    read in place (default cross_cache_len: the view's max_text_len; the cost estimates assume full texts).
    NH_TTS regions end with the logits (`s0.logits`, channels x vocab per row): no on-device sampling.

    A codec transformer (QWEN3_TTS_CODEC, one frame per row and launch) takes `x_in` (B, latent) through its
    input projection when the region starts at layer 0, and with lm_head ends with the final norm and output
    projection into `x_out` (B, latent). Its attention has a sliding window (the view's): max_context is the
    window, and the caches hold a ring of it written twice (cache_len >= 2 x window; RegionConstants.window),
    positions growing without bound.
    """
    tiling = TilingConfig() if tiling is None else tiling
    view = decoder_view(model)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if spec.kind is RegionKind.CODE_PREDICTOR_LOOP:
        if view.family is not ModelFamily.QWEN3_TTS_CODE_PREDICTOR:
            raise ValueError(f"CODE_PREDICTOR_LOOP needs a CodePredictor, got {view.family.value}")
        num_steps = len(view.heads) + 1  # micro-steps = positions 0..Q-1
        max_context = num_steps if max_context is None else max_context
        if max_context != num_steps:
            raise ValueError(
                f"the code-predictor loop attends exactly {num_steps} positions; got max_context {max_context}"
            )
        first, stop = 0, view.num_layers
    else:
        if view.family is ModelFamily.QWEN3_TTS_CODE_PREDICTOR:
            raise ValueError("a CodePredictor compiles only as RegionSpec.code_predictor_loop()")
        if spec.embed_input and view.family is not ModelFamily.LLAMA:
            raise ValueError(f"embed_input needs a token-embedding model; {view.family.value} takes embeddings")
        if view.sliding_window is not None:  # a row attends its last `sliding_window` positions at most
            max_context = view.sliding_window if max_context is None else max_context
            if max_context != view.sliding_window:
                raise ValueError(
                    f"a sliding-window network attends exactly its window of {view.sliding_window} keys at most; "
                    f"got max_context {max_context}"
                )
        if max_context is None or max_context < spec.num_steps:
            raise ValueError(f"max_context must be given and >= num_steps ({spec.num_steps}), got {max_context}")
        num_steps = spec.num_steps
        first = spec.first_layer
        stop = view.num_layers if spec.stop_layer is None else spec.stop_layer
        if stop > view.num_layers:
            raise ValueError(f"stop_layer {stop} exceeds the model's {view.num_layers} layers")
    num_cache_slots = batch_size if num_cache_slots is None else num_cache_slots
    window = view.sliding_window or 0
    # A sliding window's cache is a ring of `window` positions written twice (RegionConstants.window).
    needed = 2 * window if window else max_context
    cache_len = needed if cache_len is None else cache_len
    if num_cache_slots < batch_size or cache_len < needed:
        raise ValueError(
            f"the cache ({num_cache_slots} slots x {cache_len}) must hold {batch_size} rows x {needed} positions"
            + (f" (a twice-written ring of the {window}-key window)" if window else "")
        )
    cross_cache_len = _check_cross(view, first, stop, cross_cache_len)
    partition_tokens = tiling.resolve_partition_tokens(max_context)
    constants = RegionConstants(
        batch_size=batch_size,
        num_heads=view.num_heads,
        num_kv_heads=view.num_kv_heads,
        head_dim=view.head_dim,
        rms_norm_eps=view.rms_norm_eps,
        attn_scale=view.head_dim**-0.5 if view.attn_scale is None else view.attn_scale,
        partition_tokens=partition_tokens,
        num_partitions=math.ceil(max_context / partition_tokens),
        window=window,
    )
    b = _Builder(view, constants, tiling, num_sms)
    for name in ("positions", "slots"):
        b.buffer(name, BufferKind.INPUT, DType.INT64, (batch_size,))
    b.weight("inv_freq", view.inv_freq)
    cache_shape = (view.num_layers, num_cache_slots, view.num_kv_heads, cache_len, view.head_dim)
    b.buffer("k_cache", BufferKind.STATE, b.act_dtype, cache_shape)
    b.buffer("v_cache", BufferKind.STATE, b.act_dtype, cache_shape)
    if view.cross is not None:
        b.buffer("text_lengths", BufferKind.INPUT, DType.INT64, (batch_size,))
        cross = view.cross
        cross_shape = (view.num_layers, num_cache_slots, cross.num_kv_heads, cross_cache_len, cross.head_dim)
        b.buffer("cross_k_cache", BufferKind.STATE, b.act_dtype, cross_shape)
        b.buffer("cross_v_cache", BufferKind.STATE, b.act_dtype, cross_shape)
        b.cross_cost_text = cross_cache_len
    has_sampling = spec.kind is RegionKind.CODE_PREDICTOR_LOOP or (spec.lm_head and _samples(view))
    if has_sampling:
        for name, dtype in _SAMPLING_INPUTS:
            b.buffer(name, BufferKind.INPUT, dtype, (batch_size,))
    if cost_context is None:
        cost_context = 1 if spec.kind is RegionKind.CODE_PREDICTOR_LOOP else max_context - num_steps + 1
    if not 1 <= cost_context <= max_context - num_steps + 1:
        raise ValueError(f"cost_context must be in [1, {max_context - num_steps + 1}], got {cost_context}")

    if spec.kind is RegionKind.CODE_PREDICTOR_LOOP:
        _compile_predictor_loop(b, tiling, num_steps)
    else:
        _compile_decoder(b, tiling, spec, first, stop, cost_context)

    program = Program(
        constants=constants,
        buffers=tuple(b.buffers),
        instructions=tuple(b.instructions),
        queues=(tuple(range(len(b.instructions))),),
        num_counters=b.num_counters,
        metadata={
            "region": spec.to_dict(),
            "model_family": view.family.value,
            "num_steps": num_steps,
            "max_context": max_context,
            "cost_context": cost_context,
        },
    )
    affinity = tiling.opcode_affinity and policy is SchedulingPolicy.CRITICAL_PATH
    program = schedule_program(program, num_sms=num_sms, policy=policy, device=device, affinity=affinity)
    return CompiledRegion(spec=spec, program=program, weights=b.weights, num_steps=num_steps, max_context=max_context)


def _samples(view: DecoderView) -> bool:
    """Whether a region ending with the head samples on the device (NH_TTS: logits only; a codec's head is
    its output projection)."""
    return view.family not in (ModelFamily.NH_TTS, ModelFamily.QWEN3_TTS_CODEC)


def _check_cross(view: DecoderView, first: int, stop: int, cross_cache_len: int | None) -> int:
    """The cross cache length (0 without cross-attention); ValueError naming what does not fit."""
    with_cross = [i for i in range(first, stop) if view.layers[i].cross is not None]
    if view.cross is None:
        if with_cross:
            raise ValueError(f"layers {with_cross} have cross-attention weights but the view declares no cross shape")
        if cross_cache_len is not None:
            raise ValueError("cross_cache_len given for a network without cross-attention")
        return 0
    if len(with_cross) != stop - first:
        raise ValueError(f"cross-attention in layers {with_cross} only; the region needs it in every layer")
    cross = view.cross
    if min(cross.num_heads, cross.num_kv_heads, cross.head_dim) < 1 or cross.num_heads % cross.num_kv_heads:
        raise ValueError(
            f"cross-attention heads {cross.num_heads} must be a positive multiple of its kv heads "
            f"{cross.num_kv_heads} (head_dim {cross.head_dim})"
        )
    length = cross.max_text_len if cross_cache_len is None else cross_cache_len
    if length < 1:
        raise ValueError(f"cross_cache_len must be >= 1, got {length}")
    return length


def _compile_decoder(
    b: _Builder, tiling: TilingConfig, spec: RegionSpec, first: int, stop: int, cost_context: int
) -> None:
    v, batch = b.view, b.c.batch_size
    if spec.embed_input:
        tokens = b.buffer("tokens", BufferKind.INPUT, DType.INT64, (batch,))
        table = b.weight("embed_tables.0", v.embed_tables[0])
        x = b.act("s0.x_in", v.hidden_size)
        x_waits: tuple[Wait, ...] = (
            b.stage(
                [
                    {
                        "opcode": Opcode.EMBED,
                        "step": 0,
                        "tile_start": start,
                        "tile_stop": stop_row,
                        "inputs": (tokens, table),
                        "outputs": (x,),
                        "weight_bytes": (stop_row - start) * v.hidden_size * b.elt,
                        "activation_bytes": (stop_row - start) * (8 + v.hidden_size * b.elt),
                    }
                    for start, stop_row in _tiles(batch, tiling.sample_rows)
                ]
            ),
        )
    elif v.family is ModelFamily.QWEN3_TTS_CODEC and first == 0:  # the codec latent in through input_proj
        x, x_waits = _project(
            b, tiling, step=0, x=b.act("x_in", v.input_size, BufferKind.INPUT), x_waits=(), name="s0.x_proj"
        )
    else:
        x = b.act("x_in", v.hidden_size, BufferKind.INPUT)
        x_waits = ()
    x_normed = (
        b.act("x_normed", v.hidden_size, BufferKind.OUTPUT)
        if (spec.lm_head and v.family is ModelFamily.QWEN3_TTS_TALKER)
        else NO_ID
    )
    kv_waits: dict[int, tuple[Wait, ...]] = {}
    for step in range(spec.num_steps):
        for layer in range(first, stop):
            out_name = "x_out" if layer == stop - 1 and not spec.lm_head else None
            x, wait, kv_waits[layer] = _layer(
                b,
                tiling,
                step=step,
                layer=layer,
                x_in=x,
                x_waits=x_waits,
                kv_wait=kv_waits.get(layer),
                context_tokens=cost_context + step,
                full=True,
                out_name=out_name,
            )
            x_waits = (wait,)
        if not spec.lm_head:
            return
        if v.family is ModelFamily.QWEN3_TTS_CODEC:  # its "head": final norm and output projection
            _output_projection(b, tiling, step=step, x=x, x_wait=x_waits[0])
            return
        is_last = step == spec.num_steps - 1
        next_table = None if is_last or v.family is not ModelFamily.LLAMA else v.embed_tables[0]
        x, wait = _head(
            b,
            tiling,
            step=step,
            head_idx=0,
            rng_step=step,
            x=x,
            x_wait=x_waits[0],
            x_normed=x_normed,
            next_table=next_table,
            vocab_limit=spec.vocab_limit,
            sample=_samples(v),
        )
        x_waits = (wait,)


def _output_projection(b: _Builder, tiling: TilingConfig, *, step: int, x: int, x_wait: Wait) -> Wait:
    """A codec transformer's end: `x_out` = rmsnorm(x) * final_norm . w_out + b_out, one RMSNORM_LINEAR stage."""
    v = b.view
    weight, bias = v.output_projection
    y = b.act("x_out", weight.shape[0], BufferKind.OUTPUT)
    return b.matvec_stage(
        Opcode.RMSNORM_LINEAR,
        step=step,
        rows=weight.shape[0],
        tile_rows=tiling.matvec_rows,
        in_width=v.hidden_size,
        inputs=(
            x,
            b.weight("final_norm", v.final_norm),
            b.weight("output_projection.weight", weight),
            b.weight("output_projection.bias", bias),
        ),
        outputs=(y,),
        waits=(x_wait,),
        norm=True,
        bias=True,
    )


def _compile_predictor_loop(b: _Builder, tiling: TilingConfig, num_steps: int) -> None:
    """Micro-step 0 is the talker hidden (position 0), micro-step 1 the codebook-0 embedding (position 1,
    head 0), micro-step m >= 2 the embedding of code m-1 through table m-2 (head m-1). Causal attention
    makes this equal to the reference's two-token prefill followed by single-token steps."""
    v = b.view
    hidden = b.act("hidden", v.input_size, BufferKind.INPUT)
    code0 = b.act("code0_embedding", v.input_size, BufferKind.INPUT)
    x, x_waits = _project(b, tiling, step=0, x=hidden, x_waits=(), name="s0.x_proj")
    kv_waits: dict[int, tuple[Wait, ...]] = {}
    for step in range(num_steps):
        last = v.num_layers - 1
        for layer in range(v.num_layers):
            # Micro-step 0 feeds no head: its last layer only needs to append K/V.
            full = step >= 1 or layer < last
            x_out, wait, kv_waits[layer] = _layer(
                b,
                tiling,
                step=step,
                layer=layer,
                x_in=x,
                x_waits=x_waits,
                kv_wait=kv_waits.get(layer),
                context_tokens=step + 1,
                full=full,
            )
            if full:
                x, x_waits = x_out, (wait,)
        if step == 0:
            x, x_waits = _project(b, tiling, step=1, x=code0, x_waits=(), name="s1.x_proj")
            continue
        head_idx = step - 1
        next_table = v.embed_tables[head_idx] if step + 1 < num_steps else None
        emb, wait = _head(
            b,
            tiling,
            step=step,
            head_idx=head_idx,
            rng_step=head_idx,
            x=x,
            x_wait=x_waits[0],
            x_normed=NO_ID,
            next_table=next_table,
            vocab_limit=None,
        )
        if next_table is not None:
            x, x_waits = _project(b, tiling, step=step + 1, x=emb, x_waits=(wait,), name=f"s{step + 1}.x_proj")


@dataclass(frozen=True, slots=True)
class RegionCompilerFn:
    """compile_region as the executor's RegionCompiler (executor.megakernel): a region name in, the region
    spec the models declare for it (spec.region_spec), compiled with `tiling` (None: TilingConfig());
    `layers=(first, stop)`: only that piece of it (RegionSpec.piece)."""

    tiling: TilingConfig | None = None

    def __call__(
        self,
        module: torch.nn.Module,
        region: str,
        *,
        batch_size: int,
        num_sms: int,
        layers: tuple[int, int] | None = None,
        **compile_args: int,
    ) -> CompiledRegion:
        spec = region_spec(region)
        if layers is not None:
            spec = spec.piece(*layers, decoder_view(module).num_layers)
        return compile_region(module, spec, batch_size=batch_size, tiling=self.tiling, num_sms=num_sms, **compile_args)


def region_compiler(tiling: TilingConfig | None = None) -> RegionCompilerFn:
    """The compiler the megakernel backends take (BackendOptions(compiler=region_compiler()))."""
    return RegionCompilerFn(tiling)
