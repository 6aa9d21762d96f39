"""tilevox: engine_builder.regions, the megakernel region compiler (model + region spec -> tile program,
SM queues, cost estimates, tile-graph JSON). Build-time code: the backends that run compiled regions are
run-time code in executor.megakernel, which takes `region_compiler()` as its compiler.
Imports: torch, models, trt_plugins.megakernel."""

from tilevox.engine_builder.regions.compiler import CompiledRegion, RegionCompilerFn, compile_region, region_compiler
from tilevox.engine_builder.regions.cost import H200, DeviceCosts
from tilevox.engine_builder.regions.schedule import SchedulingPolicy, simulate
from tilevox.engine_builder.regions.spec import RegionKind, RegionSpec, TilingConfig
from tilevox.engine_builder.regions.tile_graph import (
    dump_tile_graph,
    load_tile_graph,
    tile_graph_dict,
)

__all__ = [
    "H200",
    "CompiledRegion",
    "DeviceCosts",
    "RegionCompilerFn",
    "RegionKind",
    "RegionSpec",
    "SchedulingPolicy",
    "TilingConfig",
    "compile_region",
    "dump_tile_graph",
    "load_tile_graph",
    "region_compiler",
    "simulate",
    "tile_graph_dict",
]
