"""Static checks of a Program before it runs: waits are satisfiable, queues cannot deadlock, no races.

Each opcode declares the boxes of buffer elements it reads and writes (its footprint, derived from the
record alone). A program is race-free when every read of a written element happens after that write
through the counter graph (producers are ancestors of consumers), and no element is written twice.
KV-cache positions are relative to the launch (step s writes position positions[b] + s), so one
symbolic check covers every batch of stream positions. Imports: trt_plugins.megakernel.instructions.
"""

from __future__ import annotations

from collections import defaultdict

from tilevox.trt_plugins.megakernel.instructions import NO_ID, Instruction, Opcode, Program, row_range

__all__ = ["ProgramError", "check_program", "footprint"]

Box = tuple[tuple[int, int], ...]  # half-open ranges, one per logical dimension of a buffer
_ALL = (0, 1 << 30)


class ProgramError(ValueError):
    """The program can deadlock, waits for a count no stage reaches, or races."""


def footprint(inst: Instruction, program: Program) -> tuple[list[tuple[int, Box]], list[tuple[int, Box]]]:
    """(reads, writes) of `inst` as (buffer id, box) pairs over written-in-launch buffers.

    Boxes: activations (rows, cols); q (rows, heads); partials (rows, kv group, partition), or attn_out's
    (rows, cols) where a one-partition region's ATTN_PARTIAL writes it;
    KV caches (layer, kv group, step relative to the launch, rows)."""
    c = program.constants
    rows = (0, c.batch_size)
    tile = (inst.tile_start, inst.tile_stop)
    ins, outs = inst.inputs, inst.outputs
    reads: list[tuple[int, Box]] = []
    writes: list[tuple[int, Box]] = []
    op = inst.opcode
    if op is Opcode.EMBED:
        writes.append((outs[0], (tile, _ALL)))
    elif op is Opcode.LINEAR_BIAS:
        reads.append((ins[0], (rows, _ALL)))
        writes.append((outs[0], (rows, tile)))
    elif op is Opcode.RMSNORM_QKV_ROPE_APPEND:
        (group,) = inst.args
        g_size = c.group_size
        reads.append((ins[0], (rows, _ALL)))
        num_q = max(0, min(inst.tile_stop, g_size) - inst.tile_start)
        if num_q:
            first = group * g_size + inst.tile_start
            writes.append((outs[0], (rows, (first, first + num_q))))
        kv_box = ((inst.layer, inst.layer + 1), (group, group + 1), (inst.step, inst.step + 1), rows)
        if inst.tile_start <= g_size < inst.tile_stop:
            writes.append((outs[1], kv_box))
        if inst.tile_start <= g_size + 1 < inst.tile_stop:
            writes.append((outs[2], kv_box))
    elif op is Opcode.KV_APPEND:
        own = row_range(inst.args, 0, c.batch_size)
        cols = (inst.tile_start * c.head_dim, inst.tile_stop * c.head_dim)
        reads += [(ins[0], (own, cols)), (ins[1], (own, cols))]
        kv_box = ((inst.layer, inst.layer + 1), tile, (inst.step, inst.step + 1), own)
        writes += [(outs[0], kv_box), (outs[1], kv_box)]
    elif op is Opcode.ATTN_PARTIAL:
        group = inst.args[0]
        own = row_range(inst.args, 1, c.batch_size)
        heads = (group * c.group_size, (group + 1) * c.group_size)
        if ins[5] == NO_ID:  # q_buf (rows, heads, dim); the newest key and value are in the cache
            reads.append((ins[0], (own, heads)))
            past = ((inst.layer, inst.layer + 1), (group, group + 1), (0, inst.step + 1), own)
        else:  # split QKV: raw q (rows, heads x dim) and the newest key/value from k_new / v_new
            width = c.group_size * c.head_dim
            reads.append((ins[0], (own, (group * width, (group + 1) * width))))
            kv_cols = (group * c.head_dim, (group + 1) * c.head_dim)
            reads += [(ins[5], (own, kv_cols)), (ins[6], (own, kv_cols))]
            past = ((inst.layer, inst.layer + 1), (group, group + 1), (0, inst.step), own)
        reads += [(ins[1], past), (ins[2], past)]
        if len(program.buffers[outs[0]].shape) == 2:  # one partition: part_out is attn_out (rows, heads x dim)
            width = c.group_size * c.head_dim
            writes.append((outs[0], (own, (group * width, (group + 1) * width))))
        else:
            writes.append((outs[0], (own, (group, group + 1), tile)))
        writes.append((outs[1], (own, (group, group + 1), tile)))
    elif op is Opcode.CROSS_ATTN:
        # The cross caches are written before the launch (once per stream): only q and attn_out are tracked.
        (group,) = inst.args
        width = _cross_group_width(program, inst)
        cols = (group * width, (group + 1) * width)
        reads.append((ins[0], (tile, cols)))
        writes.append((outs[0], (tile, cols)))
    elif op is Opcode.ATTN_REDUCE:
        own = row_range(inst.args, 0, c.batch_size)
        reads += [(ins[0], (own, tile, _ALL)), (ins[1], (own, tile, _ALL))]
        width = c.group_size * c.head_dim
        writes.append((outs[0], (own, (inst.tile_start * width, inst.tile_stop * width))))
    elif op in (Opcode.OPROJ_RESIDUAL, Opcode.DOWN_RESIDUAL):
        reads += [(ins[0], (rows, _ALL)), (ins[2], (rows, tile))]
        writes.append((outs[0], (rows, tile)))
    elif op in (Opcode.RMSNORM_GATEUP_SWIGLU, Opcode.RMSNORM_LINEAR):
        reads.append((ins[0], (rows, _ALL)))
        writes.append((outs[0], (rows, tile)))
    elif op is Opcode.RMSNORM_LMHEAD:
        reads.append((ins[0], (rows, _ALL)))
        writes.append((outs[0], (rows, tile)))
        if inst.tile_start == 0 and outs[1] != NO_ID:
            writes.append((outs[1], (rows, _ALL)))
    elif op is Opcode.SAMPLE_EMBED:
        reads.append((ins[0], (tile, _ALL)))
        writes += [(outs[0], (tile,))] + ([(outs[1], (tile, _ALL))] if outs[1] != NO_ID else [])
    else:  # pragma: no cover - every opcode is listed above; a new one must declare its footprint
        raise AssertionError(f"no footprint for {op.name}")
    return [(b, box) for b, box in reads if b != NO_ID], [(b, box) for b, box in writes if b != NO_ID]


def _cross_group_width(program: Program, inst: Instruction) -> int:
    """Columns of q / attn_out one CROSS_ATTN kv group covers: (heads / kv heads) x head_dim of its cache."""
    q_width = program.buffers[inst.inputs[0]].shape[1]
    kv_heads = program.buffers[inst.inputs[1]].shape[2]
    return q_width // kv_heads


def _overlap(a: Box, b: Box) -> bool:
    return all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(a, b))


def check_program(program: Program, *, max_reports: int = 8) -> None:
    """Raise ProgramError naming the first problems; return None for a valid program."""
    insts = program.instructions
    signalers: dict[int, list[int]] = defaultdict(list)
    for idx, inst in enumerate(insts):
        if inst.signal != NO_ID:
            signalers[inst.signal].append(idx)
    problems: list[str] = []
    for idx, inst in enumerate(insts):
        for wait in inst.waits:
            if wait.target > len(signalers[wait.counter_id]):
                problems.append(
                    f"#{idx} {inst.opcode.name} waits for counter {wait.counter_id} >= {wait.target}, "
                    f"but only {len(signalers[wait.counter_id])} instructions signal it"
                )
    if problems:
        raise ProgramError("\n".join(problems[:max_reports]))

    # Replay the queues in order without timing: a stall with work left is a deadlock on the GPU too.
    counters = [0] * program.num_counters
    heads = [0] * len(program.queues)
    order: list[int] = []
    progress = True
    while progress:
        progress = False
        for sm, queue in enumerate(program.queues):
            while heads[sm] < len(queue):
                inst = insts[queue[heads[sm]]]
                if any(counters[w.counter_id] < w.target for w in inst.waits):
                    break
                order.append(queue[heads[sm]])
                if inst.signal != NO_ID:
                    counters[inst.signal] += 1
                heads[sm] += 1
                progress = True
    if len(order) != len(insts):
        stuck = [f"sm {sm}: #{q[heads[sm]]}" for sm, q in enumerate(program.queues) if heads[sm] < len(q)]
        raise ProgramError(f"the queues deadlock with {len(insts) - len(order)} instructions left: {stuck[:8]}")

    # Happens-before: a wait for counter c at target t is satisfied only after the first t signals of
    # c; with whole-stage targets (t == number of signallers) that is every signaller, whatever order
    # they run in. Partial targets are not given that meaning (they would depend on timing).
    ancestors = [0] * len(insts)  # bitset of instructions that surely finished before this one starts
    for idx in order:
        mask = 0
        for wait in insts[idx].waits:
            producers = signalers[wait.counter_id]
            if wait.target == len(producers):
                for p in producers:
                    mask |= ancestors[p] | (1 << p)
        ancestors[idx] = mask
    writes_by_buffer: dict[int, list[tuple[int, Box]]] = defaultdict(list)
    reads_by_buffer: dict[int, list[tuple[int, Box]]] = defaultdict(list)
    for idx, inst in enumerate(insts):
        reads, writes = footprint(inst, program)
        for buf, box in writes:
            writes_by_buffer[buf].append((idx, box))
        for buf, box in reads:
            reads_by_buffer[buf].append((idx, box))
    names = {spec.buffer_id: spec.name for spec in program.buffers}
    for buf, writes in writes_by_buffer.items():
        for i, (w1, box1) in enumerate(writes):
            for w2, box2 in writes[i + 1 :]:
                if _overlap(box1, box2):
                    problems.append(f"#{w1} and #{w2} both write {names[buf]} {box1} / {box2}")
        for reader, rbox in reads_by_buffer.get(buf, []):
            for writer, wbox in writes:
                if writer != reader and _overlap(rbox, wbox) and not (ancestors[reader] >> writer) & 1:
                    problems.append(
                        f"race: #{reader} {insts[reader].opcode.name} reads {names[buf]} {rbox} without waiting "
                        f"for #{writer} {insts[writer].opcode.name}, which writes {wbox}"
                    )
                    if len(problems) >= max_reports:
                        raise ProgramError("\n".join(problems))
    if problems:
        raise ProgramError("\n".join(problems[:max_reports]))
