"""Where a codec decode's work is: FLOPs and weight bytes per part of one streamed decode, and what they allow.

Two decoders, random weights (the counts depend on shapes only), fp32 on CPU, counted by
torch.utils.flop_counter.FlopCounterMode on a real forward (matmuls, convolutions, attention):

- Qwen3-TTS's 12 Hz codec, one new frame per stream (`decode_incremental` of one frame, 80 ms of audio, past the
  transformer's window): per top-level part (RVQ + pre-conv, the sliding-window transformer, each upsampler, the
  first conv, each SnakeBeta decoder block, the output conv).
- XCodec2 (Llasa), one streamed block at steady state (`decode_windows` of the window XCodec2StreamDecoder
  decodes: left context + block + lookahead frames; its block is 100 ms of audio): per part (code embedding,
  backbone: embed conv, prior ResNet, transformer, post ResNet, head, ISTFT).

Per part: FLOPs, bf16 weight bytes, rows (time positions) its matrices multiply, and at the H200's peaks
(bf16 dense 989 TFLOP/s, HBM 4.8 TB/s) the time its FLOPs and its weight bytes each take at batch 1, and the
batch from which its FLOPs take longer than its weight bytes (the arithmetic intensity's crossing of the ridge
point). A megakernel pays where that batch is large (memory- and latency-bound matrix-vector work, what its
instructions are built for); where it is about 1, the part is GEMM work that cuBLAS / cuDNN run near peak.
Runs on CPU in seconds; writes JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import RESULTS, commit, utc_now
from tilevox.models.qwen3_tts.speech_tokenizer import PRESETS, random_speech_tokenizer
from tilevox.models.xcodec2.config import XCodec2Config
from tilevox.models.xcodec2.model import XCodec2Decoder
from tilevox.models.xcodec2.streaming import (
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_LEFT_CONTEXT_FRAMES,
    DEFAULT_LOOKAHEAD_FRAMES,
)

PEAK_FLOPS = 989e12  # H200 / H100 SXM bf16 dense tensor-core peak
PEAK_BYTES_S = 4.8e12  # H200 HBM3e


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters()) * 2  # bf16


def _count(fn: Callable[[], object]) -> tuple[object, int]:
    """fn()'s result and the FLOPs of the matrix ops it ran."""
    counter = FlopCounterMode(display=False)
    with counter:
        result = fn()
    return result, counter.get_total_flops()


def _row(name: str, flops: int, weight_bytes: int, rows: int | None) -> dict:
    flop_s, byte_s = flops / PEAK_FLOPS, weight_bytes / PEAK_BYTES_S
    return {
        "part": name,
        "flops": flops,
        "weight_bytes": weight_bytes,
        "rows": rows,
        "flop_time_us_b1": flop_s * 1e6,
        "weight_time_us_b1": byte_s * 1e6,
        "ridge_batch": (byte_s / flop_s) if flops else None,  # batch at which FLOPs take as long as the bytes
    }


def qwen_codec(preset: str = "12hz") -> dict:
    decoder, _ = random_speech_tokenizer(PRESETS[preset], seed=0, dtype=torch.float32, with_encoder=False)
    cfg = decoder.config
    state = decoder.new_state(1)
    state.positions.fill_(100)  # past the 72-frame window: a full window of keys
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 1))
    expected = decoder.decode_incremental(codes, copy.deepcopy(state))
    rows = []
    # decode_incremental's parts, one by one (decode_front; the transformer; decode_back's loop, as it runs it).
    h, flops = _count(lambda: decoder.decode_front(codes, state))
    # The RVQ reads one row per codebook (not its tables), then its output projections and the pre-conv.
    gathered = cfg.num_quantizers * cfg.codebook_dim * 2
    projections = sum(p.numel() * 2 for n, p in decoder.quantizer.named_parameters() if "codebook" not in n)
    rows.append(_row("RVQ + pre-conv", flops, gathered + projections + _bytes(decoder.pre_conv), 1))
    h, flops = _count(lambda: decoder.pre_transformer(h, state))
    rows.append(_row(f"transformer ({cfg.num_hidden_layers} layers)", flops, _bytes(decoder.pre_transformer), 1))
    h, t = h.transpose(1, 2), 1
    for ratio, (trans, convnext) in zip(cfg.upsampling_ratios, decoder.upsample, strict=True):
        h, flops = _count(lambda: convnext.step(trans.step(h, state), state))  # noqa: B023 - called at once
        t *= ratio
        rows.append(_row(f"upsampler x{ratio} + ConvNeXt", flops, _bytes(trans) + _bytes(convnext), t))
    blocks = iter(cfg.upsample_rates)
    for module in decoder.decoder:
        h, flops = _count(lambda: module.step(h, state))  # noqa: B023 - called at once
        name = type(module).__name__
        if name == "DecoderBlock":
            rate = next(blocks)
            t *= rate
            name = f"decoder block x{rate} ({module.block[1].conv.out_channels} channels)"
        elif name == "CausalConv1d":
            name = f"conv {module.conv.in_channels} -> {module.conv.out_channels}, k{module.conv.kernel_size[0]}"
        rows.append(_row(name, flops, _bytes(module), t))
    got = h.clamp(-1.0, 1.0)[:, 0]
    torch.testing.assert_close(got, expected)  # the parts are the decode
    return {
        "decoder": f"Qwen3-TTS speech tokenizer {preset}",
        "unit": "one new frame per stream (80 ms of audio; decode_incremental, the transformer past its window)",
        "parts": rows,
    }


def xcodec2() -> dict:
    decoder = XCodec2Decoder(XCodec2Config()).eval()
    window = DEFAULT_LEFT_CONTEXT_FRAMES + DEFAULT_CHUNK_FRAMES + DEFAULT_LOOKAHEAD_FRAMES
    codes = torch.randint(0, 2**10, (1, window))
    _, total = _count(lambda: decoder.decode_windows(codes, torch.tensor([window])))
    backbone = decoder.backbone
    rows = []
    # decode_windows of one full window (no padding: Backbone.forward's unmasked path, the same arithmetic).
    x, flops = _count(lambda: decoder.embed_codes(codes))
    embed_bytes = _bytes(decoder.fsq_project_out) + _bytes(decoder.fc_post_a)
    rows.append(_row("code embedding (FSQ out, fc_post_a)", flops, embed_bytes, window))
    x, flops = _count(lambda: backbone.embed(x.transpose(1, 2)))
    rows.append(_row("backbone embed conv", flops, _bytes(backbone.embed), window))
    x, flops = _count(lambda: backbone.prior_net(x))
    rows.append(_row("backbone prior ResNet blocks", flops, _bytes(backbone.prior_net), window))
    x, flops = _count(lambda: backbone.transformers(x.transpose(1, 2)))
    rows.append(_row("backbone transformer", flops, _bytes(backbone.transformers), window))
    x, flops = _count(lambda: backbone.post_net(x.transpose(1, 2)).transpose(1, 2))
    rows.append(_row("backbone post ResNet blocks", flops, _bytes(backbone.post_net), window))
    x = backbone.final_layer_norm(x)
    _, flops = _count(lambda: decoder.head_out(x))
    rows.append(_row("ISTFT head projection", flops, _bytes(decoder.head_out), window))
    # decode_windows' masked attention runs its scores and weighted sums as bmm (the unmasked path above, SDPA,
    # is not counted on CPU): the difference, no weights.
    rest = total - sum(r["flops"] for r in rows)
    rows.append(_row("backbone attention scores and sums (bmm, T x T)", rest, 0, window))
    return {
        "decoder": "XCodec2 (Llasa)",
        "unit": f"one streamed block at steady state: a window of {window} frames ({DEFAULT_LEFT_CONTEXT_FRAMES} "
        f"left context + {DEFAULT_CHUNK_FRAMES} + {DEFAULT_LOOKAHEAD_FRAMES} lookahead) emits "
        f"{DEFAULT_CHUNK_FRAMES} frames (100 ms of audio)",
        "parts": rows,
    }


def format_table(report: dict) -> str:
    lines = []
    for codec in report["codecs"]:
        lines += [
            f"### {codec['decoder']}: {codec['unit']}",
            "",
            "| part | GFLOP | weights MB | rows | FLOPs at peak, us (batch 1) | weights at 4.8 TB/s, us | "
            "ridge batch |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in codec["parts"]:
            ridge = f"{r['ridge_batch']:.1f}" if r["ridge_batch"] is not None else "-"
            lines.append(
                f"| {r['part']} | {r['flops'] / 1e9:.3f} | {r['weight_bytes'] / 1e6:.1f} | {r['rows']} | "
                f"{r['flop_time_us_b1']:.1f} | {r['weight_time_us_b1']:.1f} | {ridge} |"
            )
        flops = sum(r["flops"] for r in codec["parts"])
        weights = sum(r["weight_bytes"] for r in codec["parts"])
        lines += [
            f"| **total** | {flops / 1e9:.3f} | {weights / 1e6:.1f} | | {flops / PEAK_FLOPS * 1e6:.1f} | "
            f"{weights / PEAK_BYTES_S * 1e6:.1f} | {weights / PEAK_BYTES_S / (flops / PEAK_FLOPS):.1f} |",
            "",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "codec_roofline.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    report = {
        "benchmark": "codec_roofline",
        "date": utc_now(),
        "commit": commit(),
        "torch": torch.__version__,
        "peaks": {"bf16_flops_per_s": PEAK_FLOPS, "hbm_bytes_per_s": PEAK_BYTES_S},
        "counting": "torch.utils.flop_counter.FlopCounterMode around each part of one fp32 CPU decode (the parts "
        "checked to compose the decode); weight bytes = parameters in bf16 (the RVQ: the rows it gathers, not its "
        "tables)",
        "codecs": [qwen_codec(), xcodec2()],
    }
    table = format_table(report)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
