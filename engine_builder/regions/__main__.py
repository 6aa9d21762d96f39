"""Compile a region of a full-size model (shapes only, on the meta device) and write its tile graph.

    python -m tilevox.engine_builder.regions --model llama-1b --region decoder_step --batch 1 --max-context 2048 \
        --out llama1b_b1.json
    python -m tilevox.engine_builder.regions --model qwen3-tts-0.6b --region code_predictor_loop --batch 8 --out cp.json

--model: a preset of models.registry (the names synth and serve take, with or without `random:`).
--region: one of the model's regions (Llasa: decoder_step; Qwen3-TTS: talker_step, code_predictor_loop;
NH-TTS: nh_decoder_step, its cross cache as long as the encoder's positions), the same names as
`--megakernel`; --layers A-B compiles only layers [A, B) of that region's network
(no embedding, no head). Prints the instruction count, totals and the predicted region time; --check
also runs the static check of trt_plugins.megakernel.validate.
Imports: argparse, torch, models.registry, trt_plugins.megakernel, this package.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tilevox.engine_builder.regions.compiler import compile_region
from tilevox.engine_builder.regions.cost import H200
from tilevox.engine_builder.regions.schedule import SchedulingPolicy
from tilevox.engine_builder.regions.spec import RegionKind, RegionSpec, TilingConfig, region_spec
from tilevox.engine_builder.regions.tile_graph import dump_tile_graph, totals
from tilevox.models.registry import meta_regions
from tilevox.trt_plugins.megakernel.validate import check_program


def _build(model: str, region: str, layers: str | None) -> tuple[torch.nn.Module, RegionSpec]:
    regions = meta_regions(model, dtype=torch.bfloat16)
    if region not in regions:
        raise ValueError(f"region {region!r} does not apply to {model}; its regions: {', '.join(regions)}")
    if layers is None:
        return regions[region], region_spec(region)
    try:
        first, stop = (int(x) for x in layers.split("-"))
    except ValueError as exc:
        raise ValueError(f"--layers takes FIRST-STOP (e.g. 0-4), got {layers!r}") from exc
    if region_spec(region).kind is not RegionKind.DECODER:
        raise ValueError(f"--layers applies to decoder regions; {region!r} is compiled whole")
    return regions[region], RegionSpec.layers(first, stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tilevox.engine_builder.regions", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--region", required=True)
    parser.add_argument("--layers", default=None, metavar="FIRST-STOP", help="only layers [FIRST, STOP) of the region")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--num-sms", type=int, default=H200.num_sms)
    parser.add_argument("--policy", choices=[p.value for p in SchedulingPolicy], default="critical_path")
    parser.add_argument("--matvec-rows", type=int, default=TilingConfig().matvec_rows)
    parser.add_argument("--no-edges", action="store_true", help="omit the edge list (large for full models)")
    parser.add_argument("--check", action="store_true", help="run the static race/deadlock check (~10 s for 1B)")
    parser.add_argument("--out", default=None, help="tile-graph JSON path")
    args = parser.parse_args(argv)
    network, spec = _build(args.model, args.region, args.layers)
    region = compile_region(
        network,
        spec,
        batch_size=args.batch,
        max_context=args.max_context,
        tiling=TilingConfig(matvec_rows=args.matvec_rows),
        num_sms=args.num_sms,
        policy=SchedulingPolicy(args.policy),
    )
    if args.check:
        check_program(region.program)
    summary = {
        "model": args.model,
        "region_name": args.region,
        "region": spec.to_dict(),
        "batch": args.batch,
        "predicted_time_us": round(region.predicted_time_s * 1e6, 2),
        **totals(region.program),
    }
    print(json.dumps(summary))
    if args.out:
        dump_tile_graph(region.program, H200, args.out, include_edges=not args.no_edges)
    return 0


if __name__ == "__main__":
    sys.exit(main())
