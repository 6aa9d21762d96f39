"""tilevox: engine_builder.regions, the megakernel region compiler (model + region spec -> tile program,
SM queues, cost estimates, tile-graph JSON). Imports: torch, models, trt_plugins.megakernel."""

from engine_builder.regions.compiler import CompiledRegion, compile_region
from engine_builder.regions.cost import H200, DeviceCosts
from engine_builder.regions.schedule import SchedulingPolicy, simulate
from engine_builder.regions.spec import RegionKind, RegionSpec, TilingConfig
from engine_builder.regions.tile_graph import (
    dump_tile_graph,
    load_tile_graph,
    tile_graph_dict,
)

__all__ = [
    "H200",
    "CompiledRegion",
    "DeviceCosts",
    "RegionKind",
    "RegionSpec",
    "SchedulingPolicy",
    "TilingConfig",
    "compile_region",
    "dump_tile_graph",
    "load_tile_graph",
    "simulate",
    "tile_graph_dict",
]
