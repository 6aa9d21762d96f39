"""tilevox.executor: runs the models' decode regions on the GPU.

Today: each region a model declares (models.region_backends: Llasa's decoder_step, Qwen3-TTS's
talker_step and code_predictor_loop) can run as a CUDA graph of its conventional PyTorch path, captured
per (batch bucket, key-length bucket), with slot-indexed static inputs and the code predictor's sampling
inside the graph (executor.sampling); with GraphOptions(compile=True) each region's function is compiled
by Inductor first (batch and lengths symbolic). executor.megakernel runs regions as megakernel launches
(compiled by a build-time compiler the caller hands in), executor.split a region in pieces cut at layer
boundaries (each piece conventional or a megakernel), executor.dispatch per the plan's batch buckets.
On a CPU the same code runs eagerly. Imports flow one way:
trt_plugins <- models <- executor <- engine_builder <- server.
"""

from tilevox.executor.graphs import (
    GRAPH_BACKENDS,
    GraphedCodePredictorLoop,
    GraphedDecoderStep,
    GraphedTalkerStep,
    GraphOptions,
    install_codec_stream,
    install_graph_regions,
    install_prefill_stream,
)
from tilevox.executor.sampling import sample_rows

__all__ = [
    "GRAPH_BACKENDS",
    "GraphOptions",
    "GraphedCodePredictorLoop",
    "GraphedDecoderStep",
    "GraphedTalkerStep",
    "install_codec_stream",
    "install_graph_regions",
    "install_prefill_stream",
    "sample_rows",
]
