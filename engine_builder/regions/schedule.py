"""Assign a Program's instructions to per-SM queues, and predict the region's time from the queues.

CRITICAL_PATH is list scheduling (HLFET): repeatedly take the ready instruction with the longest
cost-weighted path to the end of the region and put it on the SM where it can start earliest.
ROUND_ROBIN deals instructions in program order to SMs 0, 1, 2, ... (a baseline for comparison).
With affinity, CRITICAL_PATH puts an instruction on the SM that ran its opcode most recently among those free by
the time it could start anyway (so no start moves in the model): an opcode body stays in fewer SMs' instruction
caches. Same instructions, same waits, same outputs; only the SM of an instruction changes.
`simulate` replays any queue set in order with counter waits and returns per-instruction start and
finish times; the region's predicted time is the last finish. Both orders are deadlock-free: every
queue is a subsequence of one topological order.
Imports: stdlib, trt_plugins.megakernel.instructions, engine_builder.regions.cost.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from tilevox.engine_builder.regions.cost import DeviceCosts, instruction_time_s
from tilevox.trt_plugins.megakernel.instructions import NO_ID, Program

__all__ = [
    "Schedule",
    "SchedulingPolicy",
    "dependency_edges",
    "predecessors",
    "schedule_program",
    "simulate",
]


class SchedulingPolicy(enum.Enum):
    CRITICAL_PATH = "critical_path"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    sm: tuple[int, ...]  # per instruction
    start_s: tuple[float, ...]
    finish_s: tuple[float, ...]
    time_s: tuple[float, ...]  # estimated run time of each instruction

    @property
    def makespan_s(self) -> float:
        return max(self.finish_s, default=0.0)


def predecessors(program: Program) -> list[list[int]]:
    """Instruction indices each instruction waits for (through its counters).

    A wait's target must equal the number of instructions signalling that counter: the compiler
    waits for whole stages only, so the edge set is exact."""
    signalers, _ = _counter_tables(program)
    return [[p for wait in inst.waits for p in signalers[wait.counter_id]] for inst in program.instructions]


def dependency_edges(program: Program) -> list[tuple[int, int]]:
    """(producer, consumer) pairs, consumer-major."""
    return [(p, idx) for idx, preds in enumerate(predecessors(program)) for p in preds]


def _counter_tables(
    program: Program,
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """counter -> signalling instructions, counter -> waiting instructions (validated: whole stages only)."""
    signalers: dict[int, list[int]] = {}
    waiters: dict[int, list[int]] = {}
    for idx, inst in enumerate(program.instructions):
        if inst.signal != NO_ID:
            signalers.setdefault(inst.signal, []).append(idx)
    for idx, inst in enumerate(program.instructions):
        for wait in inst.waits:
            if wait.target != len(signalers.get(wait.counter_id, [])):
                raise ValueError(
                    f"instruction {idx} waits for counter {wait.counter_id} to reach {wait.target}, "
                    f"but {len(signalers.get(wait.counter_id, []))} instructions signal it"
                )
            waiters.setdefault(wait.counter_id, []).append(idx)
    return signalers, waiters


def simulate(program: Program, device: DeviceCosts) -> Schedule:
    """Replay the queues in order: an instruction starts when its SM is free and every counter it waits
    on is complete, plus one hand-off latency. Raises ValueError if the queues deadlock. Works per
    counter, not per edge (stages are densely connected: O(instructions + waits))."""
    signalers, _ = _counter_tables(program)
    cost = [instruction_time_s(inst, device) for inst in program.instructions]
    n = len(program.instructions)
    sm_of = [NO_ID] * n
    for sm, queue in enumerate(program.queues):
        for idx in queue:
            sm_of[idx] = sm
    remaining = {c: len(s) for c, s in signalers.items()}
    complete_at: dict[int, float] = {}  # counter -> time its last signaller finished
    finish = [0.0] * n
    start = [0.0] * n
    heads = [0] * len(program.queues)
    sm_free = [0.0] * len(program.queues)
    done = 0
    progress = True
    while progress:
        progress = False
        for sm, queue in enumerate(program.queues):
            while heads[sm] < len(queue):
                idx = queue[heads[sm]]
                inst = program.instructions[idx]
                if any(w.counter_id not in complete_at for w in inst.waits):
                    break
                ready = max(
                    (complete_at[w.counter_id] + device.wait_latency_s for w in inst.waits),
                    default=0.0,
                )
                start[idx] = max(sm_free[sm], ready)
                finish[idx] = start[idx] + cost[idx]
                sm_free[sm] = finish[idx]
                if inst.signal != NO_ID:
                    remaining[inst.signal] -= 1
                    if not remaining[inst.signal]:
                        complete_at[inst.signal] = max(finish[i] for i in signalers[inst.signal])
                heads[sm] += 1
                done += 1
                progress = True
    if done != n:
        raise ValueError(f"the queues deadlock: {n - done} of {n} instructions can never start")
    return Schedule(
        sm=tuple(sm_of),
        start_s=tuple(start),
        finish_s=tuple(finish),
        time_s=tuple(cost),
    )


# How many of an opcode's most recent SMs affinity looks at before taking the earliest-free SM.
_AFFINITY_SCAN = 32


def _critical_path_queues(
    program: Program, num_sms: int, device: DeviceCosts, affinity: bool = False
) -> list[list[int]]:
    signalers, waiters = _counter_tables(program)
    n = len(program.instructions)
    insts = program.instructions
    cost = [instruction_time_s(inst, device) for inst in insts]
    # Longest remaining path. Program order is topological (producers are emitted first), so a
    # reverse sweep sees every waiter of a counter before its signallers.
    priority = [0.0] * n
    waiter_best: dict[int, float] = {}  # counter -> highest priority among its waiters
    for idx in range(n - 1, -1, -1):
        inst = insts[idx]
        tail = waiter_best.get(inst.signal)
        priority[idx] = cost[idx] + (0.0 if tail is None else device.wait_latency_s + tail)
        for wait in inst.waits:
            waiter_best[wait.counter_id] = max(waiter_best.get(wait.counter_id, 0.0), priority[idx])
    missing = [len(inst.waits) for inst in insts]
    data_ready = [0.0] * n
    remaining = {c: len(s) for c, s in signalers.items()}
    counter_done = {c: 0.0 for c in signalers}
    heap = [(-priority[idx], idx) for idx in range(n) if not missing[idx]]
    heapq.heapify(heap)
    sm_free = [(0.0, sm) for sm in range(num_sms)]  # heap of (free time, sm); stale entries skipped
    free = [0.0] * num_sms
    recent: dict[int, list[int]] = {}  # opcode -> SMs that ran it, most recent first
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    while heap:
        _, idx = heapq.heappop(heap)
        # The earliest-free SM also gives the earliest start, since start = max(free, data ready).
        while sm_free[0][0] != free[sm_free[0][1]]:
            heapq.heappop(sm_free)
        free_at, sm = sm_free[0]
        start = max(free_at, data_ready[idx])
        if affinity:
            # Any SM free by `start` starts the instruction at `start` too: the one that ran its opcode last.
            ran = recent.setdefault(insts[idx].opcode, [])
            sm = next((s for s in ran[:_AFFINITY_SCAN] if free[s] <= start), sm)
            if sm in ran:
                ran.remove(sm)
            ran.insert(0, sm)
        finish = start + cost[idx]
        queues[sm].append(idx)
        free[sm] = finish
        heapq.heappush(sm_free, (finish, sm))
        counter = insts[idx].signal
        if counter == NO_ID:
            continue
        counter_done[counter] = max(counter_done[counter], finish)
        remaining[counter] -= 1
        if remaining[counter]:
            continue
        for waiter in waiters.get(counter, []):
            data_ready[waiter] = max(data_ready[waiter], counter_done[counter] + device.wait_latency_s)
            missing[waiter] -= 1
            if not missing[waiter]:
                heapq.heappush(heap, (-priority[waiter], waiter))
    if sum(len(q) for q in queues) != n:
        raise ValueError("the program's waits can never all be met (a cycle or a wait on an unsignalled counter)")
    return queues


def schedule_program(
    program: Program, *, num_sms: int, policy: SchedulingPolicy, device: DeviceCosts, affinity: bool = False
) -> Program:
    """`program` with queues for `num_sms` SMs; metadata gains policy, num_sms, predicted_time_s and, when set,
    affinity (CRITICAL_PATH only: see the module's docstring)."""
    if num_sms < 1:
        raise ValueError(f"num_sms must be >= 1, got {num_sms}")
    if affinity and policy is not SchedulingPolicy.CRITICAL_PATH:
        raise ValueError(f"opcode affinity is a CRITICAL_PATH option, not {policy.value}'s")
    if policy is SchedulingPolicy.CRITICAL_PATH:
        queues = _critical_path_queues(program, num_sms, device, affinity)
    else:
        queues = [list(range(sm, len(program.instructions), num_sms)) for sm in range(num_sms)]
    extra = {"affinity": True} if affinity else {}
    scheduled = program.with_queues(
        tuple(tuple(q) for q in queues),
        policy=policy.value,
        num_sms=num_sms,
        device=device.name,
        **extra,
    )
    makespan = simulate(scheduled, device).makespan_s
    return scheduled.with_queues(scheduled.queues, predicted_time_s=makespan)
