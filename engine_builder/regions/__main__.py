"""Compile a region of a full-size model (shapes only, on the meta device) and write its tile graph.

    python -m tilevox.engine_builder.regions --model llama-1b --region full_step --batch 1 --max-context 4096 \
        --out llama1b_b1.json
    python -m tilevox.engine_builder.regions --model qwen3-tts-0.6b --region predictor_loop --batch 8 --out cp.json

--region: full_step | layers:FIRST-STOP | talker_step | predictor_loop. Prints the instruction count,
totals and the predicted region time; --check also runs the static check of trt_plugins.megakernel.validate.
Imports: argparse, torch, models, trt_plugins.megakernel, this package.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tilevox.engine_builder.regions.compiler import compile_region
from tilevox.engine_builder.regions.cost import H200
from tilevox.engine_builder.regions.schedule import SchedulingPolicy
from tilevox.engine_builder.regions.spec import RegionSpec, TilingConfig
from tilevox.engine_builder.regions.tile_graph import dump_tile_graph, totals
from tilevox.models.llama.config import LLAMA_PRESETS
from tilevox.models.llama.weights import random_llama
from tilevox.models.qwen3_tts.config import Qwen3TTSConfig
from tilevox.models.qwen3_tts.loader import PRESET_CONFIGS, preset_config_dict
from tilevox.models.qwen3_tts.talker import Talker
from tilevox.trt_plugins.megakernel.validate import check_program

_LLAMA_MODELS = {f"llama-{name}": name for name in LLAMA_PRESETS}
_QWEN_MODELS = (*PRESET_CONFIGS, "qwen3-tts-tiny")


def _build(model: str, region: str) -> tuple[torch.nn.Module, RegionSpec]:
    if model in _LLAMA_MODELS:
        network = random_llama(LLAMA_PRESETS[_LLAMA_MODELS[model]], seed=0, device="meta", dtype=torch.bfloat16)
        if region.startswith("layers:"):
            first, stop = (int(x) for x in region.split(":", 1)[1].split("-"))
            return network, RegionSpec.layers(first, stop)
        if region == "full_step":
            return network, RegionSpec.full_step(1)
        raise ValueError(f"region {region!r} does not apply to {model}; use full_step or layers:A-B")
    if model in _QWEN_MODELS:
        with torch.device("meta"):
            talker = Talker(Qwen3TTSConfig.from_dict(preset_config_dict(model)).talker).to(torch.bfloat16)
        if region == "predictor_loop":
            return talker.code_predictor, RegionSpec.code_predictor_loop()
        if region == "talker_step":
            return talker, RegionSpec(lm_head=True)
        if region.startswith("layers:"):
            first, stop = (int(x) for x in region.split(":", 1)[1].split("-"))
            return talker, RegionSpec.layers(first, stop)
        raise ValueError(f"region {region!r} does not apply to {model}; use predictor_loop, talker_step or layers:A-B")
    raise ValueError(f"unknown model {model!r}; known: {', '.join((*_LLAMA_MODELS, *_QWEN_MODELS))}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tilevox.engine_builder.regions", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--region", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--num-sms", type=int, default=H200.num_sms)
    parser.add_argument("--policy", choices=[p.value for p in SchedulingPolicy], default="critical_path")
    parser.add_argument("--matvec-rows", type=int, default=TilingConfig().matvec_rows)
    parser.add_argument("--no-edges", action="store_true", help="omit the edge list (large for full models)")
    parser.add_argument("--check", action="store_true", help="run the static race/deadlock check (~10 s for 1B)")
    parser.add_argument("--out", default=None, help="tile-graph JSON path")
    args = parser.parse_args(argv)
    network, spec = _build(args.model, args.region)
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
