"""Pure-PyTorch interpreter of megakernel programs: the oracle the CUDA persistent kernel must match.

`run_program` walks the per-SM queues of a `Program` in order, one instruction at a time, choosing
among the SMs whose head instruction has all its counter waits met (round-robin or seeded random),
exactly the freedom the GPU has. No SM ready while work remains raises `DeadlockError` (the
watchdog's error, never a hang). Each opcode's math is written here with plain torch ops, in the
same rounding order as the reference models (fp32 norm statistics, fp32 softmax). Imports: torch
and trt_plugins.megakernel.instructions only (no models).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from tilevox.trt_plugins.megakernel.instructions import (
    NO_ID,
    BufferKind,
    DType,
    Instruction,
    Program,
    RegionConstants,
    row_range,
)

__all__ = [
    "TORCH_DTYPES",
    "DeadlockError",
    "SchedulePolicy",
    "key_span",
    "run_program",
    "uniform_from_seed",
]

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
    DType.INT64: torch.int64,
    DType.INT32: torch.int32,
}

_MASK32 = 0xFFFFFFFF


class DeadlockError(RuntimeError):
    """No queue head can run and work remains: a wait that no remaining instruction can satisfy."""


class SchedulePolicy(enum.Enum):
    ROUND_ROBIN = "round_robin"  # next ready SM after the one that ran last
    RANDOM = "random"  # uniformly random ready SM (seeded): another legal interleaving per seed


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on uint32 values held in int64 (products wrap, low 32 bits stay exact)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_from_seed(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), float32, one per (seed, counter) pair (int64 tensors).

    Stateless so that a GPU thread computes the same value: u = (2 * (hash >> 9) + 1) / 2^24, exact in
    float32 (24-bit odd numerator), with hash = h(h(h(seed_lo) ^ seed_hi) ^ h(counter)); the seed is
    taken as 64-bit, the counter as 32-bit, h = lowbias32."""
    seed_lo = seed & _MASK32
    seed_hi = (seed >> 32) & _MASK32
    key = _hash32(_hash32(seed_lo) ^ seed_hi)
    bits = _hash32(key ^ _hash32(counter & _MASK32))
    return ((bits >> 9) * 2 + 1).to(torch.float32) * 2.0**-24


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_tables(
    positions: torch.Tensor, step: int, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions + step, cos, sin) of every row, (B,) and (B, D), the angles in fp32 like the references."""
    pos = positions + step
    freqs = pos.to(torch.float32)[:, None] * inv_freq  # (B, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)
    return pos, angles.cos().to(dtype), angles.sin().to(dtype)


def _norm_rope(
    raw: torch.Tensor, norm_w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """One head's q or k (..., D) in raw's dtype: the optional per-head rmsnorm, then rope."""
    out = raw if norm_w is None else _rmsnorm(raw, norm_w, eps)
    return out * cos + _rotate_half(out) * sin


def key_span(window: int, length: int) -> tuple[int, int]:
    """(keys, first cache position) of a row of `length` positions: every position from cache position 0
    without a window; with one, its last min(length, window) positions, contiguous in the twice-written ring
    from cache position start % window (RegionConstants.window). The kernel's key_span, line for line."""
    if window <= 0:
        return length, 0
    start = max(0, length - window)
    return length - start, start % window


def _cache_put(
    c: RegionConstants,
    cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    group: int,
    pos: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """cache[layer, slots, group, pos] = value (rows of pos / slots); with a sliding window, at the ring's two
    copies of each position, pos % window and pos % window + window."""
    if c.window <= 0:
        cache[layer, slots, group, pos] = value
        return
    ring = pos % c.window
    cache[layer, slots, group, ring] = value
    cache[layer, slots, group, ring + c.window] = value


def _scaled(y: torch.Tensor, scale: torch.Tensor | None, cols: slice) -> torch.Tensor:
    """A projection's rounded output times its layer scale (none: unchanged), as LayerScale applies it."""
    return y if scale is None else scale[cols] * y


class _Machine:
    def __init__(self, program: Program, tensors: dict[int, torch.Tensor]) -> None:
        self.program = program
        self.c = program.constants
        self.t = tensors

    def buf(self, buffer_id: int) -> torch.Tensor | None:
        return None if buffer_id == NO_ID else self.t[buffer_id]

    def execute(self, inst: Instruction) -> None:
        getattr(self, "_" + inst.opcode.name.lower())(inst)

    def _embed(self, inst: Instruction) -> None:
        tokens, table = (self.buf(i) for i in inst.inputs)
        (x,) = (self.buf(i) for i in inst.outputs)
        rows = slice(inst.tile_start, inst.tile_stop)
        x[rows] = table[tokens[rows]]

    def _linear_bias(self, inst: Instruction) -> None:
        x, w, bias = (self.buf(i) for i in inst.inputs)
        (y,) = (self.buf(i) for i in inst.outputs)
        cols = slice(inst.tile_start, inst.tile_stop)
        y[:, cols] = F.linear(x, w[cols], None if bias is None else bias[cols])

    def _rmsnorm_qkv_rope_append(self, inst: Instruction) -> None:
        x, ln_w, w_q, w_k, w_v, qk_norm_w, inv_freq, positions, slots = (self.buf(i) for i in inst.inputs)
        q_buf, k_cache, v_cache = (self.buf(i) for i in inst.outputs)
        (group,) = inst.args
        c = self.c
        d, g_size = c.head_dim, c.group_size
        xn = _rmsnorm(x, ln_w, c.rms_norm_eps)  # (B, hidden)
        pos, cos, sin = _rope_tables(positions, inst.step, inv_freq, x.dtype)
        q_norm, k_norm = (None, None) if qk_norm_w is None else (qk_norm_w[0], qk_norm_w[1])
        for head_slot in range(inst.tile_start, inst.tile_stop):
            if head_slot < g_size:
                head = group * g_size + head_slot
                out = F.linear(xn, w_q[head * d : (head + 1) * d])  # (B, D)
                q_buf[:, head] = _norm_rope(out, q_norm, c.rms_norm_eps, cos, sin)
            elif head_slot == g_size:
                out = F.linear(xn, w_k[group * d : (group + 1) * d])  # (B, D)
                _cache_put(c, k_cache, inst.layer, slots, group, pos, _norm_rope(out, k_norm, c.rms_norm_eps, cos, sin))
            elif head_slot == g_size + 1:
                _cache_put(c, v_cache, inst.layer, slots, group, pos, F.linear(xn, w_v[group * d : (group + 1) * d]))
            else:
                raise ValueError(f"head slot {head_slot} out of range for group size {g_size}")

    def _rmsnorm_linear(self, inst: Instruction) -> None:
        x, ln_w, w, bias = (self.buf(i) for i in inst.inputs)
        (y,) = (self.buf(i) for i in inst.outputs)
        cols = slice(inst.tile_start, inst.tile_stop)
        y[:, cols] = F.linear(_rmsnorm(x, ln_w, self.c.rms_norm_eps), w[cols], None if bias is None else bias[cols])

    def _kv_append(self, inst: Instruction) -> None:
        k_raw, v_raw, qk_norm_w, inv_freq, positions, slots = (self.buf(i) for i in inst.inputs)
        k_cache, v_cache = (self.buf(i) for i in inst.outputs)
        c = self.c
        d = c.head_dim
        rows = slice(*row_range(inst.args, 0, c.batch_size))
        pos, cos, sin = _rope_tables(positions[rows], inst.step, inv_freq, k_raw.dtype)
        k_norm = None if qk_norm_w is None else qk_norm_w[1]
        for group in range(inst.tile_start, inst.tile_stop):
            cols = slice(group * d, (group + 1) * d)
            key = _norm_rope(k_raw[rows, cols], k_norm, c.rms_norm_eps, cos, sin)
            _cache_put(c, k_cache, inst.layer, slots[rows], group, pos, key)
            _cache_put(c, v_cache, inst.layer, slots[rows], group, pos, v_raw[rows, cols])

    def _attn_partial(self, inst: Instruction) -> None:
        q_buf, k_cache, v_cache, positions, slots, k_new, v_new, qk_norm_w, inv_freq = (
            self.buf(i) for i in inst.inputs
        )
        part_out, part_lse = (self.buf(i) for i in inst.outputs)
        group = inst.args[0]
        c = self.c
        d, g_size = c.head_dim, c.group_size
        rows = range(*row_range(inst.args, 1, c.batch_size))
        heads = slice(group * g_size, (group + 1) * g_size)
        # A region of one partition passes attn_out (rows, heads x head_dim) as part_out: same layout, its dtype.
        final = part_out.dim() == 2
        cols = slice(heads.start * d, heads.stop * d)
        lengths = (positions + inst.step + 1).tolist()
        spans = [key_span(c.window, length) for length in lengths]  # (keys, first cache position) per row
        if max(n for n, _ in spans) > c.num_partitions * c.partition_tokens or any(
            n + phys > k_cache.shape[3] for n, phys in spans
        ):
            raise ValueError(
                f"a row attends {max(n for n, _ in spans)} keys; the region covers {c.num_partitions} partitions "
                f"x {c.partition_tokens} keys and the cache holds {k_cache.shape[3]} positions (window {c.window})"
            )
        fresh = k_new is not None  # split QKV: raw q, and the newest key/value from the raw projections
        if fresh:
            _, cos, sin = _rope_tables(positions, inst.step, inv_freq, q_buf.dtype)
            q_norm, k_norm = (None, None) if qk_norm_w is None else (qk_norm_w[0], qk_norm_w[1])
            kv_cols = slice(group * d, (group + 1) * d)
        slot_list = slots.tolist()
        for partition in range(inst.tile_start, inst.tile_stop):
            first = partition * c.partition_tokens
            for row in rows:
                slot = slot_list[row]
                count, phys = spans[row]  # keys [length - count, length) at cache positions [phys, phys + count)
                last = min(first + c.partition_tokens, count)
                if last <= first:  # nothing of this row's context falls in the partition
                    if final:
                        part_out[row, cols] = 0.0
                    else:
                        part_out[row, group, partition] = 0.0
                    part_lse[row, group, partition] = float("-inf")
                    continue
                if fresh:
                    raw_q = q_buf[row, cols].view(g_size, d)
                    q = _norm_rope(raw_q, q_norm, c.rms_norm_eps, cos[row], sin[row]).float()  # (G, D)
                    cached = min(last, count - 1)  # the newest position comes from k_new / v_new
                    keys = k_cache[inst.layer, slot, group, phys + first : phys + cached].float()
                    values = v_cache[inst.layer, slot, group, phys + first : phys + cached].float()
                    if last == count:
                        key = _norm_rope(k_new[row, kv_cols], k_norm, c.rms_norm_eps, cos[row], sin[row])
                        keys = torch.cat((keys, key.to(k_cache.dtype).float()[None]))
                        values = torch.cat((values, v_new[row, kv_cols].to(v_cache.dtype).float()[None]))
                else:
                    q = q_buf[row, heads].float()  # (G, D)
                    keys = k_cache[inst.layer, slot, group, phys + first : phys + last].float()  # (n, D)
                    values = v_cache[inst.layer, slot, group, phys + first : phys + last].float()  # (n, D)
                scores = (q @ keys.T) * c.attn_scale  # (G, n)
                peak = scores.amax(dim=-1, keepdim=True)
                weights = torch.exp(scores - peak)
                total = weights.sum(dim=-1, keepdim=True)
                out = (weights / total) @ values  # (G, D)
                if final:
                    part_out[row, cols] = out.reshape(-1).to(part_out.dtype)
                else:
                    part_out[row, group, partition] = out
                part_lse[row, group, partition] = (peak + torch.log(total))[:, 0]

    def _cross_attn(self, inst: Instruction) -> None:
        q, k_cache, v_cache, text_lengths, slots = (self.buf(i) for i in inst.inputs)
        (attn_out,) = (self.buf(i) for i in inst.outputs)
        (group,) = inst.args
        layers, num_slots, kv_heads, text_len, d = k_cache.shape
        heads = q.shape[1] // d
        if heads * d != q.shape[1] or heads % kv_heads or not 0 <= group < kv_heads:
            raise ValueError(
                f"CROSS_ATTN: q width {q.shape[1]} is not a multiple of {kv_heads} kv heads x head_dim {d}, "
                f"or group {group} is out of range"
            )
        g_size = heads // kv_heads
        cols = slice(group * g_size * d, (group + 1) * g_size * d)
        for row in range(inst.tile_start, inst.tile_stop):
            length, slot = int(text_lengths[row]), int(slots[row])
            if not 1 <= length <= text_len or not 0 <= slot < num_slots:
                raise ValueError(
                    f"CROSS_ATTN row {row}: text length {length} outside [1, {text_len}] or slot {slot} outside "
                    f"[0, {num_slots})"
                )
            queries = q[row, cols].float().view(g_size, d)  # (G, D)
            keys = k_cache[inst.layer, slot, group, :length].float()  # (n, D)
            values = v_cache[inst.layer, slot, group, :length].float()  # (n, D)
            scores = (queries @ keys.T) * self.c.attn_scale  # (G, n)
            weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            out = (weights / weights.sum(dim=-1, keepdim=True)) @ values  # (G, D)
            attn_out[row, cols] = out.reshape(-1).to(attn_out.dtype)

    def _attn_reduce(self, inst: Instruction) -> None:
        part_out, part_lse = (self.buf(i) for i in inst.inputs)
        (attn_out,) = (self.buf(i) for i in inst.outputs)
        c = self.c
        d, g_size = c.head_dim, c.group_size
        rows = slice(*row_range(inst.args, 0, c.batch_size))
        for group in range(inst.tile_start, inst.tile_stop):
            lse = part_lse[rows, group]  # (rows, P, G)
            peak = lse.amax(dim=1, keepdim=True)  # partition 0 is never empty, so finite
            weights = torch.exp(lse - peak)  # (rows, P, G); empty partitions weigh 0
            merged = (weights[..., None] * part_out[rows, group]).sum(1) / weights.sum(1)[..., None]  # (rows, G, D)
            cols = slice(group * g_size * d, (group + 1) * g_size * d)
            attn_out[rows, cols] = merged.reshape(merged.shape[0], g_size * d).to(attn_out.dtype)

    def _oproj_residual(self, inst: Instruction) -> None:
        attn_out, w_o, x_in, scale = (self.buf(i) for i in inst.inputs)
        (x_out,) = (self.buf(i) for i in inst.outputs)
        cols = slice(inst.tile_start, inst.tile_stop)
        x_out[:, cols] = x_in[:, cols] + _scaled(F.linear(attn_out, w_o[cols]), scale, cols)

    def _rmsnorm_gateup_swiglu(self, inst: Instruction) -> None:
        x, ln_w, w_gate, w_up = (self.buf(i) for i in inst.inputs)
        (h,) = (self.buf(i) for i in inst.outputs)
        cols = slice(inst.tile_start, inst.tile_stop)
        xn = _rmsnorm(x, ln_w, self.c.rms_norm_eps)
        h[:, cols] = F.silu(F.linear(xn, w_gate[cols])) * F.linear(xn, w_up[cols])

    def _down_residual(self, inst: Instruction) -> None:
        h, w_down, x_in, scale = (self.buf(i) for i in inst.inputs)
        (x_out,) = (self.buf(i) for i in inst.outputs)
        cols = slice(inst.tile_start, inst.tile_stop)
        x_out[:, cols] = x_in[:, cols] + _scaled(F.linear(h, w_down[cols]), scale, cols)

    def _rmsnorm_lmhead(self, inst: Instruction) -> None:
        x, norm_w, w_lm = (self.buf(i) for i in inst.inputs)
        logits, x_normed = (self.buf(i) for i in inst.outputs)
        cols = slice(inst.tile_start, inst.tile_stop)
        xn = _rmsnorm(x, norm_w, self.c.rms_norm_eps)
        logits[:, cols] = F.linear(xn, w_lm[cols])
        if inst.tile_start == 0 and x_normed is not None:
            x_normed.copy_(xn)

    def _sample_embed(self, inst: Instruction) -> None:
        logits, temperature, top_k, top_p, seed, rng_offset, table = (self.buf(i) for i in inst.inputs)
        tokens_out, x_next = (self.buf(i) for i in inst.outputs)
        vocab_limit, rng_step = inst.args
        for row in range(inst.tile_start, inst.tile_stop):
            scores = logits[row, :vocab_limit].float()
            temp = float(temperature[row])
            if temp == 0.0:
                token = int(torch.argmax(scores))
            else:
                scores = _filter_top_k_top_p(scores / temp, int(top_k[row]), float(top_p[row]))
                probs = scores.softmax(dim=-1)
                cdf = probs.cumsum(dim=-1)
                u = uniform_from_seed(seed[row : row + 1], rng_offset[row : row + 1] + rng_step)
                token = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=vocab_limit - 1))
            tokens_out[row] = token
            if table is not None:
                x_next[row] = table[token]


def _filter_top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top-k, then outside the smallest nucleus reaching top_p (at least one kept);
    top_k 0 / top_p 1 disable. Same rule as transformers' warpers."""
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1.0 - top_p)
        drop_sorted[-1] = False
        scores = scores.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return scores


def _bind(program: Program, bound: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    names = {spec.name for spec in program.buffers}
    unknown = sorted(set(bound) - names)
    if unknown:
        raise ValueError(f"unknown buffer name(s): {unknown}")
    tensors: dict[int, torch.Tensor] = {}
    device = next(iter(bound.values())).device if bound else torch.device("cpu")
    for spec in program.buffers:
        dtype = TORCH_DTYPES[spec.dtype]
        if spec.kind in (BufferKind.SCRATCH, BufferKind.OUTPUT) and spec.name not in bound:
            # Poison: a read before its producer ran shows up as NaN (floats) or an index error (ints).
            fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
            tensors[spec.buffer_id] = torch.full(spec.shape, fill, dtype=dtype, device=device)
            continue
        if spec.name not in bound:
            raise ValueError(f"buffer {spec.name!r} ({spec.kind.name}) must be bound")
        tensor = bound[spec.name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != dtype:
            raise ValueError(
                f"buffer {spec.name!r} expects {spec.shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        tensors[spec.buffer_id] = tensor
    return tensors


@torch.no_grad()
def run_program(
    program: Program,
    bound: Mapping[str, torch.Tensor],
    *,
    policy: SchedulePolicy = SchedulePolicy.ROUND_ROBIN,
    seed: int = 0,
    trace: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Execute `program` with weights, inputs and state bound by buffer name; returns every buffer by name.

    STATE tensors (KV caches) are updated in place. `trace(sm, instruction_idx)` sees the order run.
    Raises DeadlockError when no queue head is ready and instructions remain."""
    tensors = _bind(program, bound)
    machine = _Machine(program, tensors)
    counters = [0] * program.num_counters
    queues = program.queues
    heads = [0] * len(queues)
    remaining = sum(len(q) for q in queues)
    rng = random.Random(seed)
    last_sm = -1

    def is_ready(sm: int) -> bool:
        if heads[sm] >= len(queues[sm]):
            return False
        inst = program.instructions[queues[sm][heads[sm]]]
        return all(counters[w.counter_id] >= w.target for w in inst.waits)

    while remaining:
        ready = [sm for sm in range(len(queues)) if is_ready(sm)]
        if not ready:
            blocked = []
            for sm, queue in enumerate(queues):
                if heads[sm] < len(queue):
                    idx = queue[heads[sm]]
                    inst = program.instructions[idx]
                    unmet = [
                        (w.counter_id, counters[w.counter_id], w.target)
                        for w in inst.waits
                        if counters[w.counter_id] < w.target
                    ]
                    blocked.append(
                        f"sm {sm}: #{idx} {inst.opcode.name} layer {inst.layer} step {inst.step} "
                        f"waits (counter, value, target) {unmet}"
                    )
            raise DeadlockError(f"deadlock with {remaining} instructions left:\n" + "\n".join(blocked[:16]))
        if policy is SchedulePolicy.RANDOM:
            sm = rng.choice(ready)
        else:
            sm = min(ready, key=lambda s: (s - last_sm - 1) % len(queues))
        idx = queues[sm][heads[sm]]
        inst = program.instructions[idx]
        machine.execute(inst)
        if trace is not None:
            trace(sm, idx)
        if inst.signal != NO_ID:
            counters[inst.signal] += 1
        heads[sm] += 1
        remaining -= 1
        last_sm = sm
    return {spec.name: tensors[spec.buffer_id] for spec in program.buffers}
