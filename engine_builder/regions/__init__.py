"""tilevox: engine_builder.regions, the megakernel region compiler (model + region spec -> tile program,
SM queues, cost estimates, tile-graph JSON). Imports: torch, models, trt_plugins.megakernel."""

from tilevox.engine_builder.regions.backends import (
    BackendOptions,
    Executor,
    MegakernelUnavailable,
    install_megakernel_regions,
    parse_regions,
)
from tilevox.engine_builder.regions.compiler import CompiledRegion, compile_region
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
    "BackendOptions",
    "CompiledRegion",
    "DeviceCosts",
    "Executor",
    "MegakernelUnavailable",
    "RegionKind",
    "RegionSpec",
    "SchedulingPolicy",
    "TilingConfig",
    "compile_region",
    "dump_tile_graph",
    "install_megakernel_regions",
    "load_tile_graph",
    "parse_regions",
    "simulate",
    "tile_graph_dict",
]
