"""Tile-graph JSON: a compiled region's instructions, SM assignment, dependency edges, bytes and FLOPs.

The engine builder's simulator reads this file; `load_tile_graph` rebuilds the exact Program (queues,
counters, cost annotations) so a dumped region can be re-simulated or handed to an interpreter.
Imports: stdlib, trt_plugins.megakernel.instructions, this package.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tilevox.engine_builder.regions.cost import DeviceCosts
from tilevox.engine_builder.regions.schedule import dependency_edges, simulate
from tilevox.trt_plugins.megakernel.instructions import (
    BufferSpec,
    Instruction,
    Program,
    RegionConstants,
)

__all__ = ["FORMAT", "dump_tile_graph", "load_tile_graph", "tile_graph_dict", "totals"]

FORMAT = "tilevox.megakernel.tile_graph/1"


def totals(program: Program) -> dict[str, int]:
    insts = program.instructions
    return {
        "num_instructions": len(insts),
        "weight_bytes": sum(i.weight_bytes for i in insts),
        "kv_bytes": sum(i.kv_bytes for i in insts),
        "activation_bytes": sum(i.activation_bytes for i in insts),
        "bytes": sum(i.bytes_moved for i in insts),
        "flops": sum(i.flops for i in insts),
    }


def tile_graph_dict(program: Program, device: DeviceCosts, *, include_edges: bool = True) -> dict[str, Any]:
    """JSON-ready dict. Per instruction: its record fields, bytes/FLOPs, SM, queue position and the
    simulated start/finish (seconds). `edges` lists (producer, consumer) instruction indices."""
    sched = simulate(program, device)
    position = {idx: pos for queue in program.queues for pos, idx in enumerate(queue)}
    instructions = []
    for idx, inst in enumerate(program.instructions):
        instructions.append(
            {
                "index": idx,
                **inst.to_dict(),
                "sm": sched.sm[idx],
                "queue_position": position[idx],
                "time_s": sched.time_s[idx],
                "start_s": sched.start_s[idx],
                "finish_s": sched.finish_s[idx],
            }
        )
    out: dict[str, Any] = {
        "format": FORMAT,
        "metadata": program.metadata,
        "device": asdict(device),
        "constants": asdict(program.constants),
        "num_counters": program.num_counters,
        "buffers": [b.to_dict() for b in program.buffers],
        "instructions": instructions,
        "queues": [list(q) for q in program.queues],
        "totals": totals(program),
        "predicted_time_s": sched.makespan_s,
    }
    if include_edges:
        out["edges"] = [list(e) for e in dependency_edges(program)]
    return out


def dump_tile_graph(
    program: Program,
    device: DeviceCosts,
    path: str | Path,
    *,
    include_edges: bool = True,
) -> None:
    Path(path).write_text(json.dumps(tile_graph_dict(program, device, include_edges=include_edges), indent=1))


def load_tile_graph(source: str | Path | dict[str, Any]) -> Program:
    """Program from a dumped file (path) or dict; raises ValueError on another format."""
    data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"not a tile graph of format {FORMAT!r}: {data.get('format')!r}")
    return Program(
        constants=RegionConstants(**data["constants"]),
        buffers=tuple(BufferSpec.from_dict(b) for b in data["buffers"]),
        instructions=tuple(Instruction.from_dict(i) for i in data["instructions"]),
        queues=tuple(tuple(q) for q in data["queues"]),
        num_counters=int(data["num_counters"]),
        metadata=dict(data["metadata"]),
    )
