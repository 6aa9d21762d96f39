"""Megakernel piece costs for the search, predicted by compiling each piece and simulating its tile graph.

`SimulatedMegakernelCost(model, context=...)` is an engine_builder.composition.MegakernelCost: for a
megakernel `Piece` at a batch it compiles that piece of the model's region (engine_builder.regions:
layers [first, stop) of a decoder region, with the embedding when it starts at layer 0 of a token model
and the head when it ends the region; the code-predictor loop whole), schedules it on the device's SMs
and returns the simulated makespan (engine_builder.regions.schedule.simulate under the per-instruction
roofline of engine_builder.regions.cost). Each (piece, batch) is compiled once. The costs are the
region compiler's own estimates: calibrating them against the kernel's per-instruction timestamps on the
GPU is the builder's profiling step, not done here. Imports: torch (through the region compiler),
models.region_backends, engine_builder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tilevox.engine_builder.composition import Backend, Piece
from tilevox.engine_builder.regions.compiler import CompiledRegion, compile_region
from tilevox.engine_builder.regions.cost import H200, DeviceCosts
from tilevox.engine_builder.regions.schedule import simulate
from tilevox.engine_builder.regions.spec import RegionKind, RegionSpec, TilingConfig, region_spec
from tilevox.models.region_backends import region_module

__all__ = ["SimulatedMegakernelCost", "piece_spec"]


def piece_spec(piece: Piece, num_layers: int) -> RegionSpec:
    """The RegionSpec that compiles `piece` of a region of `num_layers` layers (RegionSpec.piece, as the
    executor compiles a region's pieces: executor.split)."""
    whole = region_spec(piece.region)
    if whole.kind is RegionKind.CODE_PREDICTOR_LOOP:
        return whole
    return whole.piece(piece.first_layer, piece.stop_layer, num_layers)


class SimulatedMegakernelCost:
    """(piece, batch) -> simulated seconds of one launch, for rows attending `context` keys."""

    def __init__(
        self,
        model: object,
        *,
        context: int,
        device: DeviceCosts = H200,
        tiling: TilingConfig | None = None,
    ) -> None:
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.model = model
        self.context = context
        self.device = device
        self.tiling = tiling
        self._times: dict[tuple[Piece, int], float] = {}

    def __call__(self, piece: Piece, batch: int) -> float:
        key = (piece, batch)
        if key not in self._times:
            self._times[key] = self.compile(piece, batch).predicted_time_s
        return self._times[key]

    def share(self, piece: Piece, batch: int, num_layers: int) -> float:
        """The piece's simulated time over its whole region's (layers [0, num_layers) with the head), both as
        megakernels: how a region's measured time divides among its pieces."""
        piece = dataclasses.replace(piece, backend=Backend.MEGAKERNEL)  # one compile per piece, whatever runs it
        whole = dataclasses.replace(piece, first_layer=0, stop_layer=num_layers, head=True)
        return self(piece, batch) / self(whole, batch)

    def compile(self, piece: Piece, batch: int) -> CompiledRegion:
        """The piece compiled for `batch` rows (its program holds the SM queues the time comes from)."""
        network = region_module(self.model, piece.region)
        spec = piece_spec(piece, network.decoder_view().num_layers)
        predictor = spec.kind is RegionKind.CODE_PREDICTOR_LOOP
        return compile_region(
            network,
            spec,
            batch_size=batch,
            max_context=None if predictor else self.context + 1,
            tiling=self.tiling,
            device=self.device,
            num_sms=self.device.num_sms,
        )

    def timeline(self, piece: Piece, batch: int, path: Path) -> float:
        """Write the piece's simulated SM-queue timeline (engine_builder.report) to `path`; returns its
        simulated time in seconds."""
        from tilevox.engine_builder.report import plot_sm_timeline

        region = self.compile(piece, batch)
        schedule = simulate(region.program, self.device)
        plot_sm_timeline(
            region.program,
            schedule,
            path,
            title=f"{piece.region} [{piece.first_layer}-{piece.stop_layer}), batch {batch}",
        )
        return schedule.makespan_s

    @property
    def num_compiled(self) -> int:
        return len(self._times)
